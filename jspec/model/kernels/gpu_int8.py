"""An int8 weight's product on an NVIDIA GPU: a Pallas kernel (Triton) that reads the int8 values as
stored and widens each tile in registers.

jax's CUDA lowering of a product of float rows by int8 values converts the values first, and XLA
writes that widened copy of the weight to memory (a whole matrix, or a layer's, each step: on an
H200 int8 weights ran 1.21x bfloat16 at batch 1 where their bytes would allow about 2x:
docs/benchmarks-accelerator.md). Here a program per block of rows and block of output channels
walks the weight's depth a tile at a time: it loads the tile's int8 values, widens them to the
rows' dtype (exact: every int8 value is a bfloat16) and multiplies them in. The per-channel scale
is applied by `decoder.linear` after, as on every other path.

Its products take the precision of the program being traced (jspec.model.numerics: HIGHEST for
float32 rows, which Triton runs in IEEE float32), so they round as XLA's float32 product would up
to the order of the sum. Triton's blocks are powers of two of at least 16: rows are padded to one,
and a weight's output channels and depth, on each device, must be whole numbers of such blocks
(`takes`; every Llama's are).

In a program split over a mesh (jspec.model.numerics.mesh) XLA cannot split the kernel's call, and
would gather the weight whole onto every device for it: each device runs it on its own part
instead (shard_map), split as jspec.model.sharding's rules split the weights. A projection in
(the default) splits its output channels over the `model` axis; a projection out (`split_depth`:
`wo`, `w_down`) splits its depth, and the devices' partial products are summed (a psum over
`model`, where XLA's product would all-reduce the same sums). Rows split over `data`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jspec.model import numerics, sharding

ROW_BLOCK = 64  # rows a program holds at most (a decode step or a verification is one block)
CHANNEL_BLOCK = 64  # output channels a program computes at most
DEPTH_BLOCK = 128  # weight columns a step of a program's loop reads at most
MIN_BLOCK = 16  # Triton's dot takes no smaller operand


def block(n: int, most: int) -> int:
    """The largest power of two at most `most` that divides n (0 if below MIN_BLOCK)."""
    size = min(most, n & -n)
    return size if size >= MIN_BLOCK else 0


def takes(x: jax.Array, values: jax.Array, split_depth: bool = False) -> bool:
    """Whether the kernel multiplies rows x [R, D] by int8 values [N, D]: N and D in whole blocks on
    each device of the program's mesh."""
    if x.ndim != 2 or x.shape[1] != values.shape[1]:
        return False
    n, d = local_shape(values.shape, split_depth)
    return block(n, CHANNEL_BLOCK) > 0 and block(d, DEPTH_BLOCK) > 0


def specs(shape: tuple[int, int], split_depth: bool):
    """(output channels' axis, depth's axis) of a weight of `shape` on the program's mesh: `model`
    where jspec.model.sharding's rules split it and it divides, else None."""
    mesh = numerics.mesh()
    if mesh is None:
        return None, None
    return tuple(sharding.spec(mesh, (None, "model") if split_depth else ("model", None), shape))


def local_shape(shape: tuple[int, int], split_depth: bool) -> tuple[int, int]:
    """A weight's [N, D] on each device of the program's mesh."""
    mesh = numerics.mesh()
    return tuple(dim // (mesh.shape[axis] if axis else 1) for dim, axis in zip(shape, specs(shape, split_depth)))


def matmul(x: jax.Array, values: jax.Array, split_depth: bool = False, interpret: bool = False) -> jax.Array:
    """x [R, D] (float32 or bfloat16) times int8 values [N, D] transposed -> [R, N] float32, the
    values widened tile by tile in registers; on a mesh each device multiplies its part
    (this module's docstring). `interpret` runs the kernel as JAX operations (any platform: the
    tests' CPU)."""
    call = functools.partial(on_device, interpret=interpret)
    mesh = numerics.mesh()
    if mesh is None or mesh.devices.size == 1:
        return call(x, values)
    rows = sharding.spec(mesh, ("data", None), x.shape)[0]
    channels, depth = specs(values.shape, split_depth)
    if depth:
        in_specs, out_specs = (P(rows, depth), P(channels, depth)), P(rows, channels)
        part = lambda x, w: jax.lax.psum(call(x, w), "model")  # noqa: E731
    else:
        in_specs, out_specs, part = (P(rows, None), P(channels, None)), P(rows, channels), call
    return jax.shard_map(part, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(x, values)


def on_device(x: jax.Array, values: jax.Array, interpret: bool = False) -> jax.Array:
    """matmul() on one device (or one device's part of a mesh)."""
    # Pallas is imported when a GPU program is traced: at import it took 0.1 s of every start.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r, d = x.shape
    n = values.shape[0]
    rows = min(max(MIN_BLOCK, 1 << (r - 1).bit_length()), ROW_BLOCK)
    padded = -(-r // rows) * rows
    channels, depth = block(n, CHANNEL_BLOCK), block(d, DEPTH_BLOCK)
    out = pl.pallas_call(
        functools.partial(_kernel, rows=rows, channels=channels, depth=depth, steps=d // depth),
        grid=(padded // rows, n // channels),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, channels), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="jspec_int8_matmul",
    )(jnp.pad(x, ((0, padded - r), (0, 0))), values)
    return out[:r]


def _kernel(x_ref, w_ref, out_ref, *, rows, channels, depth, steps):
    """One block of rows and of output channels: the sum over the depth's tiles of the rows' tile
    times the weight's, widened to the rows' dtype as it is loaded."""
    from jax.experimental import pallas as pl

    row_block = pl.ds(pl.multiple_of(pl.program_id(0) * rows, rows), rows)
    channel_block = pl.ds(pl.multiple_of(pl.program_id(1) * channels, channels), channels)

    def step(i, acc):
        tile = pl.ds(pl.multiple_of(i * depth, depth), depth)
        x = x_ref[row_block, tile]
        w = w_ref[channel_block, tile].astype(x.dtype)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros((rows, channels), jnp.float32))
