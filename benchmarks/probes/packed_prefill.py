"""A batch's prefill packed end to end against padded to its longest prompt, side by side.

The batches are those `jspec generate --batch-size B` makes of Spec-Bench's first N questions
per category (sorted by length, the last one padded with copies of its first prompt). Each
batch's prefill (the default model's forward over its prompts, float32) runs in both layouts
of `jspec.batching.pack`: one packed row (what jspec does) and one prompt per row padded to the
longest prompt's bucket (what it did before), alternating call by call; medians. It also checks
that both give every prompt the same last hidden state.

    python benchmarks/probes/packed_prefill.py [--limit 3] [--batch-size 8] [--calls 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import batching
from jspec.bench import read_bench_prompts
from jspec.model import decoder as M
from jspec.prompt_sets import resolve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    m = jspec.load()
    prompts = read_bench_prompts(resolve("spec_bench"), limit=args.limit)
    requests = m.requests([q["prompt"] for q in prompts])

    @jax.jit
    def prefill(params, tokens, packing, cache):
        h, cache = M.forward(params, m.cfg, tokens, packing, cache)
        return packing.last(h), cache

    print(f"| batch | prompt tokens | padded positions | packed positions | padded s | packed s | speedup |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    totals = [0.0, 0.0]
    for i, batch in enumerate(batching.batches(requests, args.batch_size)):
        ids = [r.token_ids for r in batch] + [batch[0].token_ids] * (args.batch_size - len(batch))
        layouts = [jax.tree.map(jnp.asarray, batching.pack(ids, rows)) for rows in (args.batch_size, 1)]
        length = layouts[0][1].bucket
        run = [prefill.lower(m.params, *layout, M.KVCache.zeros(m.cfg, args.batch_size, length)).compile()
               for layout in layouts]
        seconds = [[], []]
        states = [None, None]
        for _ in range(args.calls):
            for j, layout in enumerate(layouts):
                cache = M.KVCache.zeros(m.cfg, args.batch_size, length)
                t0 = time.perf_counter()
                states[j] = jax.block_until_ready(run[j](m.params, *layout, cache))[0]
                seconds[j].append(time.perf_counter() - t0)
        gap = float(jnp.max(jnp.abs(states[0] - states[1])))
        assert gap < 1e-3, f"batch {i}: packed and padded last states differ by {gap}"
        padded, packed = (statistics.median(s) for s in seconds)
        totals[0] += padded
        totals[1] += packed
        print(f"| {i} | {sum(map(len, ids))} | {layouts[0][0].size} | {layouts[1][0].size} | "
              f"{padded:.2f} | {packed:.2f} | {padded / packed:.2f}x |")
    print(f"| all | | | | {totals[0]:.2f} | {totals[1]:.2f} | {totals[0] / totals[1]:.2f}x |")


if __name__ == "__main__":
    main()
