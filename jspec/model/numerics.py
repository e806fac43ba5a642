"""The numerics of a decoding program: the dtype of its activations and of its KV cache, the
precision of its matrix products, and the platform it is compiled for.

The weights' dtype is the parameters' own (`jspec.load(dtype=...)`); the rest is a `Numerics`.
Its default keeps activations and the cache in float32, which is what makes a speculative
method's tokens those of `ar`: a float32 value carries the last-bit differences between XLA's
programs (a row decoded alone, among the K + 1 of a verification, in a batch) as differences near
1e-6 of a logit, where bfloat16 turns them into whole bfloat16 steps that flip near-tied tokens
(docs/design.md, "Batch invariance"). Float32 is only float32 when its products are: at JAX's
DEFAULT precision a TPU multiplies float32 in bfloat16 passes and a recent NVIDIA GPU in
TF32, so float32 activations get HIGHEST precision (a no-op on a CPU). bfloat16 activations get
DEFAULT: their products are exact at any precision, accumulated in float32.

A program is traced inside `tracing(numerics, platform, mesh)` (jspec.engine.loop.Run.tracing: a
program's one static argument, its Run, carries them, so a program is compiled per policy,
platform and mesh); the decoder asks `activation_dtype()`, `platform()` and `mesh()` while it is
traced. Outside, they are float32, the default backend and no mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.errors import JspecError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Numerics:
    activations: str = "float32"  # the residual stream and every matmul's rows
    kv_cache: str = "float32"

    def __post_init__(self):
        for name, value in (("activation", self.activations), ("KV cache", self.kv_cache)):
            if value not in DTYPES:
                raise JspecError(f"unknown {name} dtype {value!r}; choose float32 or bfloat16")

    @property
    def precision(self) -> str:
        """The matmul precision (jax.default_matmul_precision) the activations get."""
        return "highest" if self.activations == "float32" else "default"

    @property
    def kv_cache_dtype(self) -> jnp.dtype:
        return jnp.dtype(DTYPES[self.kv_cache])

    def to_json(self) -> dict:
        """The policy as records and `jspec env` name it."""
        return {"activation_dtype": self.activations, "kv_cache_dtype": self.kv_cache,
                "matmul_precision": self.precision}


_tracing: contextvars.ContextVar[tuple[Numerics, str, Mesh | None] | None] = contextvars.ContextVar(
    "jspec_numerics", default=None)


@contextlib.contextmanager
def tracing(numerics: Numerics, platform: str, mesh: Mesh | None = None):
    """Trace a program for `platform` (and `mesh`, when it is split over one) with `numerics`."""
    token = _tracing.set((numerics, platform, mesh))
    # A CPU multiplies float32 in float32 at any precision: its programs are left as they were.
    precision = jax.default_matmul_precision(numerics.precision) if platform != "cpu" else contextlib.nullcontext()
    try:
        with precision:
            yield
    finally:
        _tracing.reset(token)


def activation_dtype():
    current = _tracing.get()
    return DTYPES[current[0].activations] if current else jnp.float32


def platform() -> str:
    """The platform of the program being traced: a GPU or TPU program, exported from this CPU
    (jax.export), gets what runs there, not the CPU's paths."""
    current = _tracing.get()
    return current[1] if current else jax.default_backend()


def mesh() -> Mesh | None:
    """The mesh the program being traced is split over, or None (one device)."""
    current = _tracing.get()
    return current[2] if current else None
