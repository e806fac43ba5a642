"""Attention over the KV cache on an NVIDIA GPU: a Pallas kernel (Triton) that reads, for each row,
only the cache entries its queries can see.

XLA's attention reads the whole allocated cache every step, [B, S, K, H] a layer, however little of
it is filled: at batch 32 with a 2,048-entry cache an 8B model reads about as many bytes of cache
as of weights each step. An XLA loop over the filled blocks would bound the reads, but a `while`
on a GPU copies its trip test to the host every iteration, a layer at a time. Here the loop is in
the kernel (flash decoding): a program per row, KV head, block of queries and split of the
cache's key blocks walks its blocks up to its furthest query position, keeping a running softmax,
and the splits' softmaxes are combined after; a row reads its own filled part and nothing past it.

The queries of a row's KV head, T positions x G heads, are [M, H] (M padded to a power of two, at
least 16, as Triton's dot asks), in blocks of at most QUERY_BLOCK rows, each its own program, so a
decode step, a verification of K + 1 positions and a block of alternatives are one block, and a
chunk of a prefill several, each reading the keys up to its own furthest position. Its products
take the precision of the program being traced (jspec.model.numerics: HIGHEST for float32
activations, which Triton runs in IEEE float32, not TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.model import numerics, online_softmax, sharding

KEY_BLOCK = 64  # keys a step of the kernel's loop reads
QUERY_BLOCK = 64  # query rows (positions x heads of a KV head) a program holds at most
# Programs a call aims for at least: a row's keys are split over several programs (flash
# decoding) when rows x KV heads are fewer, so one row over a long cache still keeps the GPU's
# streaming multiprocessors (132 on an H100) busy; each split's softmax is combined after.
PROGRAMS = 256
TARGET = "__gpu$xla.gpu.triton"  # the custom call it lowers to (jax.export needs it named)


def takes(q: jax.Array, k: jax.Array) -> bool:
    """Whether the kernel takes queries q [B, T, K, G, H] over a cache k [B, S, K, H]: Triton's
    blocks are powers of two, so the head dimension must be one and the cache a whole number of
    key blocks (jspec's caches are multiples of 64 entries: jspec.memory)."""
    h, s = q.shape[-1], k.shape[1]
    return h >= 16 and h & (h - 1) == 0 and s % KEY_BLOCK == 0


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array, prefix: jax.Array,
              interpret: bool = False):
    """q [B, T, K, G, H] over the cache k, v [B, S, K, H]: query (b, t) sees keys j < prefix[b, t]
    and key q_pos[b, t], those with valid[b, j] (as kernels.attention). Returns the output
    [B, T, K, G, H] in q's dtype and the log of each query's softmax denominator [B, T, K, G]
    (-inf where it sees no key), float32. `interpret` runs the kernel as JAX operations (any
    platform: the tests' CPU).

    In a program split over a mesh (jspec.model.numerics.mesh) XLA cannot split the kernel's call,
    and would gather the cache whole onto every device for it: each device runs it on its own rows
    and KV heads instead (shard_map), the cache split as jspec.model.sharding splits it."""
    call = functools.partial(on_device, interpret=interpret)
    mesh = numerics.mesh()
    if mesh is None or mesh.devices.size == 1:
        return call(q, k, v, q_pos, valid, prefix)
    heads = sharding.spec(mesh, ("data", None, "model", None, None), q.shape)
    rows = lambda x: sharding.spec(mesh, ("data", None), x.shape)  # noqa: E731
    cache = sharding.spec(mesh, sharding.CACHE_RULE, k.shape)
    split = jax.shard_map(call, mesh=mesh, in_specs=(heads, cache, cache, rows(q_pos), rows(valid), rows(prefix)),
                          out_specs=(heads, jax.sharding.PartitionSpec(*heads[:4])), check_vma=False)
    return split(q, k, v, q_pos, valid, prefix)


def on_device(q, k, v, q_pos, valid, prefix, interpret=False):
    """attention() on one device (or one device's part of a mesh)."""
    # Pallas is imported when a GPU program is traced: at import it took 0.1 s of every start.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, t, kv, g, h = q.shape
    m = t * g
    rows = max(16, 1 << (m - 1).bit_length())
    q_rows = min(rows, QUERY_BLOCK)
    q_blocks = rows // q_rows
    blocks = k.shape[1] // KEY_BLOCK
    splits = min(blocks, -(-PROGRAMS // (b * kv * q_blocks)))
    per_split = -(-blocks // splits)
    # Query rows (t, g) of each KV head together, padded with queries that see nothing.
    qr = jnp.pad(q.transpose(0, 2, 1, 3, 4).reshape(b, kv, m, h), ((0, 0), (0, 0), (0, rows - m), (0, 0)))
    per_row = lambda x: jnp.pad(jnp.repeat(x.astype(jnp.int32), g, axis=1), ((0, 0), (0, rows - m)),  # noqa: E731
                                constant_values=-1)
    # Triton multiplies operands of one type: each product in the wider of its two, as XLA's einsums.
    kernel = functools.partial(_kernel, per_split=per_split, scale=h ** -0.5,
                               scores_dtype=jnp.promote_types(q.dtype, k.dtype),
                               probs_dtype=jnp.promote_types(q.dtype, v.dtype))
    part = lambda *shape: jax.ShapeDtypeStruct((b, kv, splits, rows, *shape), jnp.float32)  # noqa: E731
    part_spec = lambda *shape: pl.BlockSpec((None, None, None, q_rows, *shape),  # noqa: E731
                                            lambda i, j, r, n: (i, j, n, r, *(0 for _ in shape)))
    acc, top, total = pl.pallas_call(
        kernel,
        grid=(b, kv, q_blocks, splits),
        in_specs=[pl.BlockSpec((None, q_rows), lambda i, j, r, n: (i, r)),
                  pl.BlockSpec((None, q_rows), lambda i, j, r, n: (i, r)),
                  pl.BlockSpec((None, None, q_rows, h), lambda i, j, r, n: (i, j, r, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[part_spec(h), part_spec(), part_spec()],
        out_shape=[part(h), part(), part()],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jspec_attention",
    )(per_row(q_pos), per_row(prefix), qr, k, v, valid.astype(jnp.int32))
    out, lse = online_softmax.result(online_softmax.combine((top, total, acc), axis=2))
    return (out[:, :, :m].reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4).astype(q.dtype),
            lse[:, :, :m].reshape(b, kv, t, g).transpose(0, 2, 1, 3))


def _kernel(q_pos_ref, prefix_ref, q_ref, k_ref, v_ref, valid_ref, acc_ref, top_ref, total_ref, *, per_split, scale,
            scores_dtype, probs_dtype):
    """One (row, KV head, block of queries, split of the keys): the running softmax of the block's
    queries over the split's key blocks, up to the block of its furthest query: its unnormalised
    sum of values, largest score and sum of weights."""
    from jax.experimental import pallas as pl

    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    q = q_ref[...].astype(scores_dtype)
    q_pos, prefix = q_pos_ref[...], prefix_ref[...]
    # At the precision of the program being traced, as every product (jspec.model.numerics).
    dot = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)

    def block(i, state):
        keys = pl.ds(pl.multiple_of(i * KEY_BLOCK, KEY_BLOCK), KEY_BLOCK)
        k = k_ref[row, keys, head, :].astype(scores_dtype)
        v = v_ref[row, keys, head, :].astype(probs_dtype)
        key = i * KEY_BLOCK + jnp.arange(KEY_BLOCK)
        seen = ((key[None, :] < prefix[:, None]) | (key[None, :] == q_pos[:, None])) & (valid_ref[row, keys] != 0)[None, :]
        scores = jnp.where(seen, dot(q, k, (((1,), (1,)), ((), ()))) * scale, -jnp.inf)
        return online_softmax.step(state, scores, lambda p: dot(p.astype(probs_dtype), v, (((1,), (0,)), ((), ()))))

    # This split's blocks, up to the block of the row's furthest query (none past the cache).
    first = split * per_split
    last = jnp.minimum(jnp.minimum(first + per_split, k_ref.shape[1] // KEY_BLOCK), jnp.max(q_pos) // KEY_BLOCK + 1)
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), block, online_softmax.empty(q.shape[:1], q.shape[1]))
    acc_ref[...], top_ref[...], total_ref[...] = acc, m, l
