"""The weights' dtypes: float32, bfloat16, or int8 with one float32 scale per output channel.

An int8 matrix [N, D] is an `Int8`: values int8 [N, D] and scale float32 [N], with
w[n, :] ~ values[n, :] * scale[n] and scale[n] = max |w[n, :]| / 127 (symmetric, so zero stays
exact and no zero point enters the product). Why per output channel: the scale then multiplies
each output once after the row's sum (`decoder.linear`), so a matmul reads the int8 values as
they are stored, on the CPU kernel as on an accelerator; and a row's scale follows it wherever the
row goes (a split over the model axis, the LM head's rows of a head's vocabulary). Why symmetric
int8 rather than 4 bits or groups along D: its error is a quarter step of each row's own range,
small enough that the output follows float32's (docs/benchmarks.md, "Int8 weights"), and a group
scale inside the sum would cost the kernel a multiply per group.

Every matrix is quantized: the embedding (a tied model's LM head) and the untied LM head too,
being a fifth of SmolLM2-135M's bytes. Norms and biases stay float32. Activations and the KV cache
keep their own policy (jspec.model.numerics): float32 unless asked otherwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16", "int8")
FLOATS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8:
    values: jax.Array  # int8 [N, D]
    scale: jax.Array  # float32 [N]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def rows(self, fn) -> "Int8":
        """fn applied to the leading axis of both: a selection or regrouping of output channels."""
        return Int8(fn(self.values), fn(self.scale))


def quantize(w) -> Int8:
    """A float matrix [N, D] (NumPy or jax) -> Int8, in the same library. An all-zero row gets
    scale 1 (its values are 0 either way)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = w.astype(xp.float32)
    top = xp.max(xp.abs(w), axis=-1)
    # Times the reciprocal, not over 127: XLA makes a division by a constant that product, so
    # NumPy (conversion) and jax (a cast on load) give the same scales. (Their quotients w / scale
    # still differ by a step in about one value in 16,000 of SmolLM2-135M.)
    scale = xp.where(top > 0, top * np.float32(1 / 127), 1).astype(xp.float32)
    values = xp.clip(xp.round(w / scale[:, None]), -127, 127).astype(xp.int8)
    return Int8(values, scale)


def dequantize(w: Int8, dtype=jnp.float32):
    """values [..., D] times scale [...]: a matrix, or rows of it gathered by an index of any shape
    (take_rows)."""
    xp = np if isinstance(w.values, np.ndarray) else jnp
    return (w.values.astype(xp.float32) * w.scale[..., None]).astype(dtype)


def is_int8(w) -> bool:
    return isinstance(w, Int8)


def as_float(w, dtype=jnp.float32):
    """A weight (float or Int8) as a float array in `dtype`; one already in it as it is (no copy:
    conversion holds a piece once)."""
    if is_int8(w):
        return dequantize(w, dtype)
    return w if w.dtype == jnp.dtype(dtype) else w.astype(dtype)


def take_rows(w, idx):
    """Rows idx (any shape) of a weight [N, D], Int8 or float, keeping its kind.

    The barrier ties the weight to the index, so that what follows the rows stays with them: XLA:CPU
    takes bfloat16 rows in float32, and without it widens the whole weight first and, in a decoding
    loop, hoists that out of the loop, once a call (36 ms for the default model's embedding here,
    against rounds of 22-80 ms)."""
    w, idx = jax.lax.optimization_barrier((w, idx))
    return w.rows(lambda a: jnp.take(a, idx, axis=0)) if is_int8(w) else jnp.take(w, idx, axis=0)


def cast(tree, dtype: str):
    """A parameter tree (NumPy or jax, float or Int8 leaves) in the weights' dtype `dtype`:
    matrices quantized for int8 (the rest float32), everything cast for a float dtype."""
    def one(w):
        if dtype == "int8":
            if is_int8(w):
                return w
            return quantize(w) if w.ndim == 2 else as_float(w)
        return as_float(w, FLOATS[dtype])
    return jax.tree.map(one, tree, is_leaf=is_int8)


def abstract(shapes, dtype: str):
    """The jax.ShapeDtypeStruct tree of a model's parameters stored in `dtype`, from their shapes
    (jspec.model.layout.param_shapes): what a checkpoint is restored as."""
    def one(shape):
        if dtype == "int8":
            if len(shape) == 2:
                return Int8(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct(shape[:1], jnp.float32))
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return jax.ShapeDtypeStruct(shape, FLOATS[dtype])
    return jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, tuple))


def dtype_of(params) -> str:
    """The weights' dtype by name: int8 when the matrices are Int8, else their float dtype."""
    leaves = jax.tree.leaves(params, is_leaf=is_int8)
    if any(is_int8(w) for w in leaves):
        return "int8"
    dtype = jnp.dtype(leaves[0].dtype)
    return next(name for name, d in FLOATS.items() if jnp.dtype(d) == dtype)


def nbytes(tree) -> int:
    """Bytes of a parameter tree (arrays or ShapeDtypeStructs), scales included."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
