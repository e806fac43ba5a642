"""What jspec's native attention kernel changes in a forward of the default model (float32).

One run, side by side: the same jitted forward with every attention in the kernel and every one
in XLA (the few-rows matmul kernel is on in both), the two alternating call by call, medians.
Decode shapes (B rows x T positions over a cache of S positions, the cache donated as in the
engine's loop) and prefills (B prompts of P tokens), with the largest difference in the logits
between the two. The prefill rows force the kernel on every block of 64 queries, which jspec
does not (kernels.MAX_QUERIES): they show why.

    python benchmarks/probes/attention_cost.py
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.model import decoder as M, kernels

DECODES = [(1, 1, 192), (1, 1, 1088), (8, 1, 192), (8, 1, 1088), (1, 5, 192), (1, 5, 1088), (8, 5, 1088)]
PREFILLS = [(1, 128), (1, 896), (8, 128)]
CALLS = 9


def programs(m, use_kernel: bool):
    """The decode step and the prefill compiled with every attention in the kernel, or none."""
    kernels.takes_attention = (lambda q, k, v: True) if use_kernel else (lambda q, k, v: False)
    jax.clear_caches()

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens, positions):
        h, cache = M.forward(params, m.cfg, tokens, positions, cache)
        return M.logits(params, m.cfg, h[:, -1]), cache

    @jax.jit
    def prefill(params, cache, tokens):
        h, cache = M.forward(params, m.cfg, tokens, None, cache)
        return M.logits(params, m.cfg, h[:, -1]), cache

    def decode_args(b, t, s):
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.cfg.vocab_size, (b, t)), jnp.int32)
        return M.KVCache.zeros(m.cfg, b, s), tokens, jnp.broadcast_to(s - 8 + jnp.arange(t), (b, t))

    def prefill_args(b, p):
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, m.cfg.vocab_size, (b, p)), jnp.int32)
        return M.KVCache.zeros(m.cfg, b, p + 64), tokens

    compiled = {("decode", *shape): step.lower(m.params, *decode_args(*shape)).compile() for shape in DECODES}
    compiled |= {("prefill", *shape): prefill.lower(m.params, *prefill_args(*shape)).compile() for shape in PREFILLS}
    return compiled, decode_args, prefill_args


def main() -> None:
    if kernels.unavailable:
        raise SystemExit(f"the native kernel is unavailable: {kernels.unavailable}")
    m = jspec.load(dtype="float32")
    takes = kernels.takes_attention
    paths = {"kernel": programs(m, True), "xla": programs(m, False)}
    kernels.takes_attention = takes
    keys = [("decode", *s) for s in DECODES] + [("prefill", *s) for s in PREFILLS]
    times = {(path, key): [] for path in paths for key in keys}
    gaps = {}
    for key in keys:
        calls = 3 if key == ("prefill", 1, 896) or key == ("prefill", 8, 128) else CALLS
        out = {}
        state = {path: (decode_args if key[0] == "decode" else prefill_args)(*key[1:])
                 for path, (_, decode_args, prefill_args) in paths.items()}
        for _ in range(calls):
            for path, (compiled, _, _) in paths.items():
                args = state[path]
                start = time.perf_counter()
                logits, cache = compiled[key](m.params, *args)
                logits.block_until_ready()
                times[path, key].append(time.perf_counter() - start)
                out[path] = np.asarray(logits)
                if key[0] == "decode":
                    state[path] = (cache, *args[1:])
        gaps[key] = float(np.max(np.abs(out["kernel"] - out["xla"])))
        print(f"{key}: kernel {np.median(times['kernel', key]) * 1e3:.1f} ms, "
              f"xla {np.median(times['xla', key]) * 1e3:.1f} ms", flush=True)
    print("\n| forward | B | T or P | cache S | attention in XLA, ms | kernel, ms | ratio | max logit gap |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key in keys:
        x, k = (float(np.median(times[p, key])) * 1e3 for p in ("xla", "kernel"))
        s = key[3] if key[0] == "decode" else key[2] + 64
        print(f"| {key[0]} | {key[1]} | {key[2]} | {s} | {x:.1f} | {k:.1f} | {x / k:.2f}x | {gaps[key]:.1e} |")


if __name__ == "__main__":
    main()
