"""Two builds of jspec's native matmul side by side: a forward of the default model over R
positions (one row, float32 or bfloat16 weights, cache of 512 donated) with another build's kernel
and with this checkout's, alternating call by call (benchmarks/probes/few_rows.py's programs and
timing), and whether the logits are bit-identical.

Tuning the kernel needs this: the host's speed drifts by 10-20% between runs, so two builds timed
in separate runs cannot be told apart, and a kernel change must not change a bit.

    cp jspec/model/kernels/_native*.so /tmp/before.so      # before the change
    pip install -e .                                       # rebuild with it
    python benchmarks/probes/kernel_ab.py /tmp/before.so [bfloat16]
"""

from __future__ import annotations

import ctypes
import sys

import jax
import jax.numpy as jnp
import numpy as np
from few_rows import ROUNDS, forward_programs, time_forwards  # this script's folder

import jspec
from jspec.model import kernels

ROWS = (1, 2, 3, 5, 9, 13)  # a decode step, and verifications of 1, 2, 4, 8 and 12 drafts
CALLS = 10  # timed forwards per build, shape and round
SYMBOLS = {"float32": "JspecMatmul", "bfloat16": "JspecMatmulBf16"}  # the weights' dtype -> its handler


def compiled(dtype: str, target: str, build):
    """build() traced and compiled with the `dtype` linears calling `target` (read at trace time)."""
    kernels.TARGETS[jnp.dtype(dtype)] = target
    jax.clear_caches()
    return build()


def register_other_build(script: str, symbol: str, target: str) -> None:
    """The build named on the command line (the first argument of `script`) loaded beside this
    checkout's, its handler `symbol` registered as the FFI target `target`."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: python benchmarks/probes/{script} OTHER_BUILD.so")
    if kernels.unavailable:
        raise SystemExit(f"the native kernel is unavailable: {kernels.unavailable}")
    other = ctypes.CDLL(sys.argv[1])
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(other, symbol)), platform="cpu")


def main() -> None:
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    if dtype not in SYMBOLS:
        raise SystemExit(f"the weights' dtype is one of {', '.join(SYMBOLS)}, not {dtype}")
    register_other_build("kernel_ab.py", SYMBOLS[dtype], "other_build_matmul")
    ours = kernels.TARGETS[jnp.dtype(dtype)]
    m = jspec.load(dtype=dtype)
    build, args = forward_programs(m, ROWS)
    builds = {"other build": compiled(dtype, "other_build_matmul", build), "this checkout": compiled(dtype, ours, build)}
    ms, logits = time_forwards(m, builds, args, ROWS, CALLS)
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
