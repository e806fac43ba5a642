"""jspec's kernels: on a CPU, native code called through jax.ffi, a matmul of float32 rows by a
float32, bfloat16 or int8 weight (matmul.cc) and attention over the KV cache (attention.cc); on an
NVIDIA GPU, in Pallas, attention over the filled part of the KV cache (gpu_attention.py) and the
product of an int8 weight read as stored (gpu_int8.py).

XLA:CPU multiplies a few rows by a weight far below what memory bandwidth allows (it repacks
the weight for a small matmul, and the multiply-and-sum `decoder.linear` uses instead is compute
bound); the matmul streams each weight once per 16 rows on AVX2 + FMA (docs/design.md, "Few
rows"). Its attention transposes the whole cache of every layer before multiplying; the
attention kernel reads the cache in place (docs/design.md, "Attention on a CPU"). `decoder.linear`
and `attention.attention` ask `takes` and `takes_attention` at trace time, so a program compiled
with the kernels keeps them: call jax.clear_caches() after changing `enabled`.

The kernels are optional. The CPU's are not used when the extension was not built (pip install
prints why), when the CPU lacks AVX2 or FMA, or when JSPEC_NATIVE=0 is set; `unavailable` says
which. The GPU's are not used when JSPEC_NATIVE=0 is set.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.model import numerics
from jspec.model.kernels import gpu_attention, gpu_int8

TARGETS = {jnp.dtype(jnp.float32): "jspec_matmul", jnp.dtype(jnp.bfloat16): "jspec_matmul_bf16"}
# The most float32 rows it is used for (docs/design.md, "Few rows"): above 32 the
# multiply-and-sum of `decoder.linear` is as fast. One row takes it too: a decode step ran 13-19%
# faster than with XLA's matrix-vector kernel (docs/journal/2026-11-27_one-row-through-the-kernel.md),
# and a row then gets the same bits in a decode step as in a verification. A bfloat16 weight takes
# it at every row count: XLA converts the whole weight before its matmul, and its
# multiply-and-sum ran 13x slower inside the decoding loop than alone.
MAX_ROWS = 32
# The most rows an int8 weight takes it for with AVX-512 and without AMX. Past them (a prefill) the
# product is bound by arithmetic, not by reading the weight, and XLA's mixed int8 product was
# faster there: on a [3072, 576] weight 2.8 ms against 3.0 at 128 rows, 10.1 against 11.6 at 512,
# where at 64 the kernel took 1.55 ms against 2.1 (benchmarks/probes/int8_matmul.py, on an AVX-512
# AMD EPYC host: docs/journal/2026-12-04_int8-weights.md). Where the products run on AVX2 alone
# and where AMX's integer tiles are in use it takes every row count: on an AVX2 host (AMD EPYC,
# Zen 3) the same probe had XLA's mixed product slower at every row count (6.0 ms against 4.6 at
# 128 rows, 11.6 against 7.8 at 256, 19.5 against 17.3 at 512); AMX's tiles run 2.5x the AVX-512
# path past 64 rows, faster still than XLA's (docs/design.md, "Tiles of AMX", "Int8 prefill on
# AVX2 alone").
MAX_INT8_ROWS = 64
AMX_INT8_DEPTH = 64  # AMX's tiles take an int8 weight whose D is a multiple of this (matmul.cc)
# Query positions per row the attention kernel takes: decode steps, verifications, beams and a
# prefill's chunks (up to jspec.engine.loop.MAX_CHUNK), which XLA's attention would run over the
# whole cache. Whole texts (training, scoring) attend in XLA's blocks of 64, whose matmuls were
# faster there (0.83-0.92x with the kernel over one 896-token prompt:
# docs/journal/2026-11-24_attention-kernel.md).
MAX_QUERIES = 128


ABI = 2  # the library's jspec_abi(): its kernels take the arguments this module passes
WANTED = os.environ.get("JSPEC_NATIVE") != "0"  # JSPEC_NATIVE=0 turns every kernel off


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """Register the kernels with XLA: (the library, None), or (None, why they cannot be used)."""
    if not WANTED:
        return None, "JSPEC_NATIVE=0 is set"
    here = Path(__file__).parent
    built = [here / f"_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    built = [p for p in built if p.is_file()]
    if not built:
        return None, "the extension jspec/model/kernels/_native was not built (pip install's log says why)"
    try:
        lib = ctypes.CDLL(str(built[0]))
    except OSError as e:  # built for another system, say
        return None, f"jspec/model/kernels/_native could not be loaded: {e}"
    if not lib.jspec_cpu_supported():
        return None, "this CPU lacks AVX2 or FMA"
    if not hasattr(lib, "jspec_abi") or lib.jspec_abi() != ABI:  # built from an older jspec's sources
        return None, "jspec/model/kernels/_native is out of date: pip install jspec again to rebuild it"
    jax.ffi.register_ffi_target(TARGETS[jnp.dtype(jnp.float32)], jax.ffi.pycapsule(lib.JspecMatmul), platform="cpu")
    jax.ffi.register_ffi_target(TARGETS[jnp.dtype(jnp.bfloat16)], jax.ffi.pycapsule(lib.JspecMatmulBf16), platform="cpu")
    jax.ffi.register_ffi_target("jspec_matmul_int8", jax.ffi.pycapsule(lib.JspecMatmulInt8), platform="cpu")
    jax.ffi.register_ffi_target("jspec_attention", jax.ffi.pycapsule(lib.JspecAttention), platform="cpu")
    lib.jspec_set_spin_us.restype = ctypes.c_long
    return lib, None


_lib, unavailable = _load()  # the CPU kernels' library, or why they are not used
enabled = unavailable is None  # read by `takes` and `takes_attention` at trace time
gpu_enabled = WANTED  # read by `takes_gpu_attention` at trace time
gpu_int8_enabled = WANTED  # read by `takes_gpu_int8` at trace time (the device check's A/B turns it off)


def spin(micros: int) -> int:
    """Set how long the CPU kernels' helper threads spin for the next call before they sleep (0:
    they sleep at once); returns what it was (1000 microseconds unless changed). For probes that
    weigh it in one process (benchmarks/probes/kernel_spin.py) and tests; common.h, beside the
    kernels, says why they spin."""
    if _lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {unavailable}")
    return _lib.jspec_set_spin_us(ctypes.c_long(micros))


def avx512(use: bool) -> bool:
    """Let the CPU's kernels (products and attention) take their AVX-512 paths where the CPU has
    them (the default), or not; returns whether they did. For tests that run the AVX2 paths on a
    CPU with both. `takes` reads it at trace time for int8 (int8_rows)."""
    if _lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {unavailable}")
    return bool(_lib.jspec_use_avx512(ctypes.c_int(use)))


def amx(use: bool) -> bool:
    """Let bfloat16 and int8 products use AMX's tiles where the CPU has them (the default), or not;
    returns whether they did. For tests and probes that run the AVX paths on a CPU with AMX. The
    kernel reads it at each call; `takes` reads it at trace time for int8 (int8_rows)
    (call jax.clear_caches() after switching where that matters)."""
    if _lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {unavailable}")
    return bool(_lib.jspec_use_amx(ctypes.c_int(use)))


def uses_avx512() -> bool:
    """Whether the CPU's products run on AVX-512 (not AVX2 alone) in this process."""
    return _lib is not None and bool(_lib.jspec_paths() & 1)


def uses_amx() -> bool:
    """Whether the CPU's bfloat16 and int8 products run on AMX's tiles in this process."""
    return _lib is not None and bool(_lib.jspec_paths() & 2)


def paths() -> str:
    """The instruction sets the CPU's products run on in this process, in words."""
    if _lib is None:
        return "none"
    used = _lib.jspec_paths()
    return ("AVX-512" if used & 1 else "AVX2") + (", AMX for bfloat16 and int8 weights" if used & 2 else "")


@contextlib.contextmanager
def off():
    """Trace without the CPU's kernels, for a program over several devices: XLA cannot split a
    foreign call, so to make one it would gather every weight and cache whole onto each device (a
    1.5B model on 8 devices then needs 8 copies). The multiply-and-sum path splits like any op.
    (The GPU's attention kernel is split by the program's mesh instead: gpu_attention.)"""
    global enabled
    before, enabled = enabled, False
    try:
        yield
    finally:
        enabled = before


def takes(x: jax.Array, w, rows: int) -> bool:
    """Whether `decoder.linear` multiplies x (`rows` rows) by w (an array or an Int8) with the kernel."""
    if not enabled or x.dtype != jnp.float32 or numerics.platform() != "cpu":
        return False
    if w.dtype == jnp.int8:
        limit = int8_rows(w.shape[1])
        return limit is None or rows <= limit
    return w.dtype == jnp.bfloat16 or (w.dtype == jnp.float32 and rows <= MAX_ROWS)


def int8_rows(d: int) -> int | None:
    """The most rows an int8 weight of depth d takes the kernel for in this process: MAX_INT8_ROWS
    on AVX-512's tiles, None (every row count) on AVX2 alone and on AMX's, which take a d that is
    a multiple of AMX_INT8_DEPTH."""
    if not uses_avx512() or (uses_amx() and d % AMX_INT8_DEPTH == 0):
        return None
    return MAX_INT8_ROWS


def matmul(x: jax.Array, w) -> jax.Array:
    """x [R, D] float32 times w [N, D] (float32, bfloat16, or an Int8 of jspec.model.weights)
    transposed -> [R, N] float32."""
    if x.ndim != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"kernels.matmul needs x [R, D] and w [N, D], got {x.shape} and {w.shape}")
    if w.dtype == jnp.int8:
        return _matmul_int8(x, w.values, w.scale)
    return _matmul(x, w)


def _out(x, w) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)


@jax.custom_jvp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call(TARGETS[w.dtype], _out(x, w))(x, w)


@_matmul.defjvp
def _matmul_jvp(primals, tangents):
    # XLA cannot differentiate a foreign call. The tangent is linear in (dx, dw), so jax can
    # transpose it too: gradients through `linear` (training a draft head) work.
    (x, w), (dx, dw) = primals, tangents
    return _matmul(x, w), dx @ w.T + x @ dw.T


@jax.custom_jvp
def _matmul_int8(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call("jspec_matmul_int8", _out(x, values))(x, values, scale)


@_matmul_int8.defjvp
def _matmul_int8_jvp(primals, tangents):
    # Quantized weights are not trained: the tangent flows through x alone (a head trained on an
    # int8 model).
    (x, values, scale), dx = primals, tangents[0]
    return _matmul_int8(x, values, scale), (dx @ values.T.astype(jnp.float32)) * scale


def takes_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether `attention.attention` runs the attention kernel for queries q [B, T, K, G, H] over k, v."""
    float32 = q.dtype == k.dtype == v.dtype == jnp.float32
    return enabled and float32 and q.shape[1] <= MAX_QUERIES and numerics.platform() == "cpu"


def takes_gpu_attention(q: jax.Array, k: jax.Array) -> bool:
    """Whether `attention.attention` runs the GPU's Pallas kernel for queries q over the cache k."""
    return gpu_enabled and numerics.platform() == "cuda" and gpu_attention.takes(q, k)


def takes_gpu_int8(x: jax.Array, values: jax.Array, split_depth: bool = False) -> bool:
    """Whether `decoder.linear` multiplies rows x [R, D] by int8 values [N, D] with the GPU's Pallas
    kernel (`split_depth`: a mesh splits the weight's depth, gpu_int8.matmul)."""
    return gpu_int8_enabled and numerics.platform() == "cuda" and gpu_int8.takes(x, values, split_depth)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array, prefix: jax.Array,
              rows: jax.Array | None = None):
    """q [B, T, K, G, H] over the cache k, v [R, S, K, H] (float32): query (b, t) sees keys
    j < prefix[b, t] and key q_pos[b, t] of cache row rows[b] (default: row b), those with
    valid[b, j]. Returns the output [B, T, K, G, H] and the log of each query's softmax denominator
    [B, T, K, G] (-inf where it sees no key), float32. No derivative: `attention.attention` gives it
    the JAX path's."""
    b, t, kv, g, h = q.shape
    rows = jnp.arange(b, dtype=jnp.int32) if rows is None else rows
    if (k.shape[2:] != (kv, h) or v.shape != k.shape or q_pos.shape != (b, t) or prefix.shape != (b, t)
            or valid.shape != (b, k.shape[1]) or rows.shape != (b,)):
        raise ValueError(f"kernels.attention needs q [B, T, K, G, H], k and v [R, S, K, H], q_pos and prefix [B, T], "
                         f"valid [B, S] and rows [B], got {q.shape}, {k.shape}, {v.shape}, {q_pos.shape}, "
                         f"{prefix.shape}, {valid.shape} and {rows.shape}")
    call = jax.ffi.ffi_call("jspec_attention", (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                                jax.ShapeDtypeStruct(q.shape[:4], jnp.float32)))
    return call(q, k, v, q_pos.astype(jnp.int32), prefix.astype(jnp.int32), valid.astype(jnp.bool_),
                rows.astype(jnp.int32), scale=np.float32(h ** -0.5))
