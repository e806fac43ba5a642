"""The native kernel's int8 product against float32 and bfloat16, and against XLA at many rows
(docs/journal/2026-12-04_int8-weights.md).

    python benchmarks/probes/int8_matmul.py

1. SmolLM2-135M's 121 matrices a token (4 a layer and the LM head, random) in one program, each
   multiplied by the kernel at 1 and 4 rows: weights streamed from memory as in a decode step;
   ms a token and GB/s of weights read.
2. One [3072, 576] weight (the MLP's gate and up; in cache, so arithmetic bounds it) at 8 to 512
   rows: the kernel in int8, XLA over the weight widened first, XLA's mixed int8 product, XLA
   in float32, and the float32 kernel up to its 32 rows.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.model import kernels, weights  # noqa: E402


# SmolLM2-135M's matrices of a decode step, [N, D]: 30 layers' four and the LM head.
STEP_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def seconds(fn, *args, runs: int) -> float:
    fn(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(runs):
        y = fn(*args)
    y.block_until_ready()
    return (time.perf_counter() - t) / runs


def streamed(rng) -> None:
    for name in ("float32", "bfloat16", "int8"):
        ws = []
        for n, d in STEP_SHAPES:
            w = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
            ws.append(weights.quantize(w) if name == "int8" else w.astype(name))

        @jax.jit
        def chain(x, ws):
            wide = jnp.tile(x, (1, 3))
            return jnp.concatenate([kernels.matmul(wide[:, :w.shape[1]], w)[:, :4] for w in ws], 1)

        for rows in (1, 4):
            x = jnp.asarray(rng.normal(size=(rows, 576)).astype(np.float32))
            s = seconds(chain, x, ws, runs=30)
            print(f"{name:8s} {rows} rows: {s * 1e3:.2f} ms a token, {weights.nbytes(ws) / s / 1e9:.1f} GB/s")


def many_rows(rng) -> None:
    n, d = 3072, 576
    wf = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
    w8 = weights.quantize(wf)
    ways = {"kernel int8": (jax.jit(kernels.matmul), w8),
            "XLA, widened": (jax.jit(lambda x, w: x @ weights.dequantize(w).T), w8),
            "XLA, mixed": (jax.jit(lambda x, w: jax.lax.dot_general(
                x, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * w.scale), w8),
            "XLA float32": (jax.jit(lambda x, w: x @ w.T), wf),
            "kernel float32": (jax.jit(kernels.matmul), wf)}
    for rows in (8, 16, 40, 64, 128, 256, 512):
        x = jnp.asarray(rng.normal(size=(rows, d)).astype(np.float32))
        cells = [f"{name} {seconds(fn, x, w, runs=50) * 1e6:.0f} us" for name, (fn, w) in ways.items()
                 if name != "kernel float32" or rows <= kernels.MAX_ROWS]
        print(f"{rows:4d} rows: " + " | ".join(cells))


if __name__ == "__main__":
    if kernels.unavailable:
        raise SystemExit(f"the native kernel is unavailable: {kernels.unavailable}")
    rng = np.random.default_rng(0)
    streamed(rng)
    many_rows(rng)
