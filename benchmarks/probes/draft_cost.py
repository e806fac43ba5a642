"""Where a draft step's time goes: the shallow layers, the head's layer, and the LM head (full
vocabulary vs a draft-only vocabulary of M tokens), next to one full decode step.

    python benchmarks/probes/draft_cost.py [--exit-layer 6]

One row per part, batch 1, one position, float32, median of 50 jitted calls; prints Markdown.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.model import decoder as M
from jspec.parts import heads


def timed(fn, *args) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exit-layer", type=int, default=6)
    args = ap.parse_args()
    m = jspec.load()
    cfg, params, n = m.cfg, m.params, args.exit_layer
    cache = M.KVCache.zeros(cfg, 1, 512)
    tokens, positions = jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 100, jnp.int32)
    h = jnp.zeros((1, 1, cfg.hidden_size), jnp.float32)

    full = jax.jit(lambda p, c: M.logits(p, cfg, M.forward(p, cfg, tokens, positions, c)[0]))
    shallow = jax.jit(lambda p, c: M.run_layers(p, cfg, M.embed(p, tokens), positions, c, range(n))[0])
    rows = [("full decode step (30 layers + LM head)", timed(full, params, cache)),
            (f"first {n} layers", timed(shallow, params, cache))]
    for kind in heads.KINDS:
        hp = heads.init(params, cfg, kind, n, np.arange(8192, dtype=np.int32))
        kv = heads.empty_kv(cfg, hp, 1, 512)
        block = jax.jit(lambda hp, kv: heads.block(cfg, hp, h, positions, kv)[0])
        rows.append((f"{kind} head layer", timed(block, hp, kv)))
    x = h[:, 0]
    head = jax.jit(lambda w: M.linear(x, w, jnp.float32))
    rows.append((f"LM head, full vocabulary ({cfg.vocab_size})", timed(head, M.head_weight(params))))
    for size in (4096, 8192, 16384):
        rows.append((f"LM head, draft vocabulary of {size}", timed(head, M.head_weight(params)[:size])))
    base = rows[0][1]
    print("| part (batch 1, one position) | ms | x full step |\n| --- | ---: | ---: |")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
