"""Two builds of jspec's native matmul side by side: a forward of the default model over R
positions (one row, float32, cache of 512 donated) with another build's kernel and with this
checkout's, alternating call by call, and whether the logits are bit-identical.

Tuning the kernel needs this: the host's speed drifts by 10-20% between runs, so two builds timed
in separate runs cannot be told apart, and a kernel change must not change a bit.

    cp jspec/_native*.so /tmp/before.so      # before the change
    pip install -e .                         # rebuild with it
    python benchmarks/kernel_ab.py /tmp/before.so
"""

from __future__ import annotations

import ctypes
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import model as M
from jspec import native

ROWS = (1, 2, 3, 5, 9, 13)  # a decode step, and verifications of 1, 2, 4, 8 and 12 drafts
CALLS = 10  # timed forwards per build, shape and round
ROUNDS = 3


def programs(m, target: str) -> dict:
    """R -> (compiled forward whose float32 linears call `target`, its arguments)."""
    native.TARGETS[jnp.dtype(jnp.float32)] = target  # read at trace time
    jax.clear_caches()

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens, positions):
        h, cache = M.forward(params, m.cfg, tokens, positions, cache)
        return M.logits(params, m.cfg, h), cache

    out = {}
    for r in ROWS:
        args = [M.KVCache.zeros(m.cfg, 1, 512), jnp.zeros((1, r), jnp.int32),
                jnp.arange(100, 100 + r, dtype=jnp.int32)[None]]
        out[r] = step.lower(m.params, *args).compile(), args
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/kernel_ab.py OTHER_BUILD.so")
    if native.unavailable:
        raise SystemExit(f"the native kernel is unavailable: {native.unavailable}")
    other = ctypes.CDLL(sys.argv[1])
    jax.ffi.register_ffi_target("other_build_matmul", jax.ffi.pycapsule(other.JspecMatmul), platform="cpu")
    m = jspec.load(dtype="float32")
    builds = {"other build": programs(m, "other_build_matmul"), "this checkout": programs(m, "jspec_matmul")}
    times = {(b, r): [] for b in builds for r in ROWS}
    logits = {}
    for _ in range(ROUNDS):
        for r in ROWS:
            for _ in range(CALLS):
                for b, progs in builds.items():
                    program, args = progs[r]
                    start = time.perf_counter()
                    out, args[0] = program(m.params, *args)
                    out.block_until_ready()
                    times[b, r].append(time.perf_counter() - start)
                    logits[b, r] = np.asarray(out)
    ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    step = ms["this checkout", 1]
    print(f"Forward over R positions, median of {ROUNDS} x {CALLS} ms (in decode steps of this checkout's "
          f"{step:.1f} ms)\n")
    print("| R | other build | this checkout | speedup |\n| --- | ---: | ---: | ---: |")
    for r in ROWS:
        a, b = ms["other build", r], ms["this checkout", r]
        print(f"| {r} | {a:.1f} ({a / step:.2f}) | {b:.1f} ({b / step:.2f}) | {a / b:.2f}x |")
    same = all(np.array_equal(logits["other build", r], logits["this checkout", r]) for r in ROWS)
    print(f"\nlogits bit-identical: {same}")


if __name__ == "__main__":
    main()
