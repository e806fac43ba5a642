"""How fast XLA:CPU multiplies a few rows by the default model's weights, by formulation.

A jitted stack of 30 layers of SmolLM2-135M's linears (wqkv 960x576, wo 576x576, w_gate_up
3072x576, w_down 576x1536; random float32, read in place) over R rows; median of 15 calls.
XLA flags are read once per process, so run it once per flag setting:

    python benchmarks/probes/linear_survey.py
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT python benchmarks/probes/linear_survey.py dot sum
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.model import kernels

LAYERS, D, F, QKV = 30, 576, 1536, 960
ROWS = (1, 2, 5, 8, 16)
BLOCK = 256  # output columns per dot in the "blocked" formulation

FORMS = {
    "dot": lambda x, w: jnp.einsum("rd,nd->rn", x, w),
    "dot-wx": lambda x, w: jnp.einsum("nd,rd->nr", w, x).T,  # the other orientation, transposed after
    "blocked": lambda x, w: jnp.concatenate(
        [jnp.einsum("rd,nd->rn", x, w[i:i + BLOCK]) for i in range(0, w.shape[0], BLOCK)], axis=1),
    "sum": lambda x, w: jnp.sum(w[None] * x[:, None], axis=-1),
    "native": kernels.matmul,
}


def stack(linear):
    def run(layers, x):
        for lp in layers:
            a = linear(x, lp["wqkv"])[:, :D]
            x = x + linear(a, lp["wo"])
            g = linear(x, lp["w_gate_up"]).reshape(-1, F, 2)  # interleaved, as jspec.model.decoder.mlp_block
            x = x + linear(g[..., 0] * g[..., 1], lp["w_down"])
        return x
    return jax.jit(run)


def main() -> None:
    forms = sys.argv[1:] or list(FORMS)
    rng = np.random.default_rng(0)
    shapes = {"wqkv": (QKV, D), "wo": (D, D), "w_gate_up": (2 * F, D), "w_down": (D, F)}
    layers = [{k: jnp.asarray(rng.standard_normal(s, np.float32) * s[1] ** -0.5) for k, s in shapes.items()}
              for _ in range(LAYERS)]
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| form | " + " | ".join(f"R={r} ms" for r in ROWS) + " |")
    for form in forms:
        fn, cells = stack(FORMS[form]), []
        for r in ROWS:
            x = jnp.asarray(rng.standard_normal((r, D), np.float32))
            fn(layers, x).block_until_ready()
            times = []
            for _ in range(15):
                start = time.perf_counter()
                fn(layers, x).block_until_ready()
                times.append(time.perf_counter() - start)
            cells.append(f"{np.median(times) * 1e3:.1f}")
        print(f"| {form} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
