"""A small draft model for `--method draft` on the default model, cut from the model itself.

No other model that works offline here shares SmolLM2's tokenizer, so the draft method's
benchmark uses this one: the default model's first N layers followed by the shipped EESD exit
layer (a trained decoder layer) and its norm, with the full embedding and LM head, saved as an
ordinary converted checkpoint of N + 1 layers. It drafts exactly as `--method eesd` does but as a
separate model: its own KV cache, its own forward over the accepted tokens, and verification
through the whole target, which is what the self-speculative methods save.

    python benchmarks/make_draft_model.py ~/.cache/jspec/smollm2-135m-draft
    jspec generate "Name three primes." --method draft --draft-model ~/.cache/jspec/smollm2-135m-draft
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp

import jspec
from jspec.convert import store
from jspec.parts import heads, shipped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="folder to write the draft model to")
    args = ap.parse_args()
    target = jspec.load()
    hp, meta = heads.load(shipped.find(target, "eesd"), target.cfg)
    n = meta["exit_layer"]
    dtype = target.params["embed"].dtype
    exit_layers = [{k: jnp.asarray(v, dtype) for k, v in lp.items()} for lp in hp["layers"]]
    params = {**target.params, "layers": target.params["layers"][:n] + exit_layers,
              "final_norm": jnp.asarray(hp["norm"], dtype)}
    cfg = dataclasses.replace(target.cfg, num_layers=n + len(exit_layers))
    path = store.save(args.out, cfg, params, target.tokenizer, "float32",
                      f"first {n} layers of {target.name} + its shipped eesd exit layer")
    print(f"{cfg.num_layers}-layer draft model written to {path}")


if __name__ == "__main__":
    main()
