"""What one target forward costs as the number of positions grows (the price of verification).

Times a forward of the default model (float32, cache of 512) over B rows x T positions, the
shape a speculative round verifies (T = K + 1), and prints a Markdown table with the ratio to
the single-position step that autoregressive decoding pays per token.

    python benchmarks/probes/forward_cost.py
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.model import decoder as M


def main() -> None:
    m = jspec.load()
    cfg, params = m.cfg, m.params

    # The cache is donated, so it is updated in place as in the engine's loop; a copy of it
    # (190 MB at batch 8) would otherwise be timed with every forward.
    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens, positions):
        h, cache = M.forward(params, cfg, tokens, positions, cache)
        return M.logits(params, cfg, h), cache

    print("| rows B | positions T | ms per forward | x the B=1, T=1 step |\n| --- | --- | --- | --- |")
    base = None
    for b in (1, 8):
        for t in (1, 2, 3, 5, 9, 17):
            cache = M.KVCache.zeros(cfg, b, 512)
            tokens = jnp.zeros((b, t), jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(100, 100 + t), (b, t))
            logits, cache = step(params, cache, tokens, positions)
            logits.block_until_ready()
            times = []
            for _ in range(20):
                start = time.perf_counter()
                logits, cache = step(params, cache, tokens, positions)
                logits.block_until_ready()
                times.append(time.perf_counter() - start)
            ms = float(np.median(times)) * 1e3
            base = base or ms
            print(f"| {b} | {t} | {ms:.1f} | {ms / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
