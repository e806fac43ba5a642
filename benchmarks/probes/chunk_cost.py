"""What a prefill chunk costs by its rows, its positions and how far along the prompt it is.

Times a forward of the default model (float32, a cache of 2,368 positions: the 480-question
Spec-Bench run's) over R rows x C positions starting at position P, best of 5, and prints a
Markdown table (docs/journal/2026-12-07_staged-prompts.md).

    python benchmarks/probes/chunk_cost.py --shapes 1x128,1x32,8x32 --starts 0,512,1024,1536
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import jspec
from jspec.model import decoder
from jspec.model.numerics import Numerics, tracing

LENGTH = 2368


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x128,1x32,4x64,8x32", help="rows x positions, comma-separated")
    p.add_argument("--starts", default="0,512,1024,1536")
    args = p.parse_args()
    m = jspec.load()
    cfg, params = m.cfg, m.params
    starts = [int(s) for s in args.starts.split(",")]
    print("| forward | " + " | ".join(f"at {s}" for s in starts) + " | ms a position at the first |")
    print("|---" * (len(starts) + 2) + "|")
    for shape in args.shapes.split(","):
        rows, positions = map(int, shape.split("x"))
        times = [chunk_ms(params, cfg, rows, positions, start) for start in starts]
        print(f"| {rows} x {positions} | " + " | ".join(f"{t:.1f} ms" for t in times)
              + f" | {times[0] / (rows * positions):.2f} |", flush=True)


def chunk_ms(params, cfg, rows: int, positions: int, start: int, repeats: int = 5) -> float:
    """Best of `repeats` of one jitted forward (its cache donated, as in the loop)."""
    with tracing(Numerics(), "cpu", None):
        step = jax.jit(functools.partial(decoder.forward, cfg=cfg), donate_argnames="cache")
        tokens = jnp.zeros((rows, positions), jnp.int32)
        at = jnp.broadcast_to(start + jnp.arange(positions, dtype=jnp.int32), (rows, positions))
        cache = decoder.KVCache.zeros(cfg, rows, LENGTH)
        best = float("inf")
        for i in range(repeats + 1):
            began = time.perf_counter()
            h, cache = step(params, tokens=tokens, positions=at, cache=cache)
            jax.block_until_ready(h)
            if i:  # the first compiles
                best = min(best, time.perf_counter() - began)
    return best * 1e3


if __name__ == "__main__":
    main()
