"""What the greedy token costs: jnp.argmax against jspec.engine.sampling.argmax (a max, then the first
index holding it) over the default model's vocabulary, for the shapes the loop takes them in
(B rows x T verified positions). Prints a Markdown table of medians over 200 jitted calls.

    python benchmarks/probes/argmax_cost.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine.sampling import argmax

VOCAB = 49_152  # SmolLM2


def median_us(f, x) -> float:
    f(x).block_until_ready()
    times = []
    for _ in range(200):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main() -> None:
    xla = jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))
    ours = jax.jit(argmax)
    print("| rows B x positions T | jnp.argmax (us) | sampling.argmax (us) | speedup |\n| --- | ---: | ---: | ---: |")
    for b, t in ((1, 1), (1, 2), (1, 5), (8, 1), (8, 2), (8, 5)):
        x = jax.random.normal(jax.random.key(0), (b, t, VOCAB))
        assert (xla(x) == ours(x)).all()
        a, o = median_us(xla, x), median_us(ours, x)
        print(f"| {b} x {t} | {a:.0f} | {o:.0f} | {a / o:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
