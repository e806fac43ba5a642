"""Search a layer-skip set for the default model (SWIFT-style scoring, random search).

Score of a skip set = the fraction of positions where the model with those layers skipped
predicts the same next token as the full model, teacher-forced over the model's own greedy
answers to training prompts (one parallel pass per candidate, no generation). For each skip
count m, random sets of m middle layers are scored and the best kept; the printed table then
estimates the speedup of each with the measured cost of a draft step (kept layers + LM head)
and of verifying K+1 positions. Uses only ../shared/data/train_prompts.jsonl.

    python benchmarks/search_skip.py --prompts 8 --tokens 48 --trials 40
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import model as M

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "train_prompts.jsonl"


def skipped_forward(params, cfg, tokens, skip):
    """Teacher-forced logits of the model with layers where skip[i] is True left out."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cos, sin = M.rope(cfg, positions)
    h = M.embed(params, tokens)
    zeros = jnp.zeros((b, t, cfg.num_kv_heads, cfg.head_dim), h.dtype)
    for i, lp in enumerate(params["layers"]):
        def run(h, lp=lp):
            return M.decoder_layer(cfg, lp, h, positions, cos, sin, zeros, zeros)[0]
        h = jax.lax.cond(skip[i], lambda h: h, run, h)
    return M.logits(params, cfg, h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = jspec.load()
    cfg = model.cfg
    rows = [json.loads(line) for line in DATA.open(encoding="utf-8") if line.strip()]
    rng = random.Random(args.seed)
    picked = rng.sample(rows, args.prompts)
    records = model.generate([r["prompt"] for r in picked], max_new_tokens=args.tokens)
    seqs = [model.encode(r["prompt"]) + rec["token_ids"] for r, rec in zip(picked, records)]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    scored = np.zeros((len(seqs), width), bool)
    for i, (s, rec) in enumerate(zip(seqs, records)):
        tokens[i, :len(s)] = s
        scored[i, len(s) - len(rec["token_ids"]) - 1:len(s) - 1] = True  # positions predicting answer tokens
    fwd = jax.jit(lambda skip: jnp.argmax(skipped_forward(model.params, cfg, jnp.asarray(tokens), skip), -1))
    full = np.asarray(fwd(jnp.zeros(cfg.num_layers, bool)))

    def agreement(skip_set):
        mask = np.zeros(cfg.num_layers, bool)
        mask[list(skip_set)] = True
        return float((np.asarray(fwd(jnp.asarray(mask))) == full)[scored].mean())

    middle = list(range(1, cfg.num_layers - 1))  # first and last layer always kept (SWIFT)
    print("| skipped layers | agreement | skip set |\n| --- | --- | --- |")
    for m in (4, 6, 8, 10, 12, 15):
        best = max((tuple(sorted(rng.sample(middle, m))) for _ in range(args.trials)), key=agreement)
        print(f"| {m} | {agreement(best):.3f} | {','.join(map(str, best))} |", flush=True)


if __name__ == "__main__":
    main()
