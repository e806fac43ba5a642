"""Two builds of jspec's native attention kernel side by side, alone: one call over the default
model's attention shapes (3 kv heads x 3 queries each, head dim 64) with another build's kernel and
with this checkout's, alternating call by call (best of CALLS), and whether their outputs are
bit-identical. The shapes are decode steps and verifications of 1-32 rows, and a prefill's chunks
(32-128 positions of 1-8 rows) at a few offsets into the cache of the 480-question Spec-Bench run.

    cp jspec/model/kernels/_native*.so /tmp/before.so   # before the change
    pip install -e .                                    # rebuild with it
    python benchmarks/probes/attention_ab.py /tmp/before.so
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from kernel_ab import register_other_build  # this script's folder

# (rows, queries a row, cache length, first query's position)
SHAPES = [(1, 1, 2368, 1500), (8, 1, 2368, 300), (8, 1, 2368, 1500), (1, 5, 2368, 300), (8, 5, 2368, 300),
          (8, 5, 2368, 1500), (32, 2, 2368, 400), (1, 32, 2368, 0), (1, 32, 2368, 600), (8, 32, 2368, 512),
          (4, 64, 2368, 0), (4, 64, 2368, 512), (4, 64, 2368, 1536), (1, 128, 2368, 0), (1, 128, 2368, 1536)]
CALLS = 50


def call(target: str, q, k, v, pos, prefix, valid, rows):
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:4], jnp.float32))
    return jax.ffi.ffi_call(target, out)(q, k, v, pos, prefix, valid, rows, scale=np.float32(q.shape[-1] ** -0.5))


def main() -> None:
    register_other_build("attention_ab.py", "JspecAttention", "other_build_attention")
    builds = {"other build": "other_build_attention", "this checkout": "jspec_attention"}
    rng = np.random.default_rng(0)
    print(f"One call, best of {CALLS}, us\n\n| rows x queries | cache | first position | other build | "
          "this checkout | speedup | bit-identical |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for rows, t, length, first in SHAPES:
        q = jnp.asarray(rng.standard_normal((rows, t, 3, 3, 64)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((rows, length, 3, 64)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((rows, length, 3, 64)), jnp.float32)
        pos = jnp.asarray(np.broadcast_to(first + np.arange(t), (rows, t)), jnp.int32)
        args = (q, k, v, pos, pos + 1, jnp.ones((rows, length), jnp.bool_), jnp.arange(rows, dtype=jnp.int32))
        fns = {name: jax.jit(lambda *a, target=target: call(target, *a)) for name, target in builds.items()}
        outs = {name: jax.block_until_ready(fn(*args)) for name, fn in fns.items()}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(CALLS):
            for name, fn in fns.items():
                began = time.perf_counter()
                jax.block_until_ready(fn(*args))
                best[name] = min(best[name], time.perf_counter() - began)
        same = all(np.array_equal(a, b) for a, b in zip(outs["other build"], outs["this checkout"]))
        a, b = best["other build"] * 1e6, best["this checkout"] * 1e6
        print(f"| {rows} x {t} | {length} | {first} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {same} |")


if __name__ == "__main__":
    main()
