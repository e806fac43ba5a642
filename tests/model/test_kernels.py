"""jspec's native kernels (jspec/model/kernels): the few-rows matmul, for float32, bfloat16 and int8 weights, and attention
over the KV cache. Each equals the JAX path and gives a row (a query) the same bits whatever else
the call holds, `decoder.linear` and `attention.attention` take them only where they should, generation
with them emits the same tokens as without, and jspec runs without them (JSPEC_NATIVE=0).

Tests that need the kernel skip, with the reason, when it is unavailable (not built, no AVX2,
JSPEC_NATIVE=0). The choice is made at trace time, so each switch clears jax's caches.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention import attention_inputs, random

from jspec.api import Model
from jspec.model import attention, decoder as M, kernels, weights


@pytest.fixture
def kernel():
    if kernels.unavailable:
        pytest.skip(f"the native kernel is unavailable: {kernels.unavailable}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 33, 64])
@pytest.mark.parametrize("n, d", [(7, 64), (50, 13), (97, 100), (48, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_equals_jax(kernel, rows, n, d, dtype):
    """Weights in float32, or bfloat16 (widened exactly, so the reference is the rounded weight)."""
    x, w = random((rows, d), 0), random((n, d), 1).astype(dtype).astype(jnp.float32)
    got = jax.jit(kernels.matmul)(x, w.astype(dtype))
    want = jnp.einsum("rd,nd->rn", x, w, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [100, 96])  # bfloat16 with D of 96 takes AMX's tiles where the CPU has them
def test_row_gets_the_same_bits_in_any_batch(kernel, dtype, d):
    x, w = random((80, d), 2), random((61, d), 3).astype(dtype)
    product = jax.jit(kernels.matmul)
    full = np.asarray(product(x, w))
    for rows in (1, 3, 5, 6, 11, 16, 17, 72):
        np.testing.assert_array_equal(np.asarray(product(x[:rows], w)), full[:rows])
    np.testing.assert_array_equal(np.asarray(product(x[::-1], w))[::-1], full)  # each row elsewhere in the call


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 33, 64, 300])
@pytest.mark.parametrize("n, d", [(7, 64), (50, 13), (97, 100), (48, 1), (5, 33)])
def test_int8_matmul_equals_the_jax_path(kernel, use_native, rows, n, d):
    """An int8 weight (values and per-row scale) read in place equals linear's pure-JAX path: its
    multiply-and-sum up to 64 rows, its mixed dot past them (a prefill, which the kernel takes on
    AVX2 alone and with AMX). D of 13, 33 and 1 exercise the tails of 16-lane steps."""
    x, w = random((rows, d), 0), weights.quantize(random((n, d), 1))
    got = np.asarray(jax.jit(kernels.matmul)(x, w))
    use_native(False)
    want = np.asarray(jax.jit(M.linear)(x, w))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    exact = np.asarray(x, np.float64) @ np.asarray(weights.dequantize(w), np.float64).T
    np.testing.assert_allclose(got, exact, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("d", [100, 128])  # D of 128 takes AMX's tiles where the CPU has them
def test_int8_row_gets_the_same_bits_in_any_batch(kernel, d):
    x, w = random((80, d), 2), weights.quantize(random((61, d), 3))
    product = jax.jit(kernels.matmul)
    full = np.asarray(product(x, w))
    for rows in (1, 3, 5, 6, 16, 17, 72):
        np.testing.assert_array_equal(np.asarray(product(x[:rows], w)), full[:rows])
    np.testing.assert_array_equal(np.asarray(product(x[::-1], w))[::-1], full)  # each row elsewhere in the call


@pytest.fixture
def avx2_too(kernel):
    """For tests that run the kernels' AVX2 paths beside their AVX-512 ones; yields a function
    that switches between them (the CPU must have both)."""
    if not kernels.avx512(True):
        pytest.skip("this CPU lacks AVX-512 (F, BW, DQ, VL), so only the AVX2 paths run")
    yield kernels.avx512
    kernels.avx512(True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_avx2_and_avx512_tiles_give_the_same_bits(avx2_too, dtype):
    """Float32 and bfloat16 weights: AVX-512's tiles of up to 8 rows x 6 weight rows (two to a
    16-lane register) and AVX2's of up to 4 x 3 sum every output alike, so a CPU with AVX-512 emits
    what one without does. D of 100 exercises the tail of an 8-lane step (and keeps bfloat16 off
    AMX's tiles, which take D in 32s); 13 and 17 rows leave tiles of every height, 97 to 101 weight
    rows (blocks of 48) tiles of every width."""
    product = jax.jit(kernels.matmul)
    for rows in (1, 5, 8, 13, 17):
        for n in (97, 98, 99, 100, 101):
            x, w = random((rows, 100), 8), random((n, 100), 9).astype(dtype)
            avx2_too(True)
            wide = np.asarray(product(x, w))
            avx2_too(False)
            np.testing.assert_array_equal(np.asarray(product(x, w)), wide, err_msg=f"{rows} rows, {n} weight rows")


@pytest.fixture
def amx_too(kernel):
    """For tests that run the bfloat16 and int8 products on AMX's tiles and on AVX's; yields a
    function that switches between them (the CPU must have AMX and Linux must let the process use it)."""
    if not kernels.amx(True):
        pytest.skip("this CPU lacks AMX (tiles, bfloat16 and int8 products, AVX-512 BF16), or Linux refused them")
    yield kernels.amx
    kernels.amx(True)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 11, 16, 33])
@pytest.mark.parametrize("n, d", [(7, 64), (97, 96), (130, 32), (64, 576)])
def test_amx_product_equals_the_exact_one(amx_too, rows, n, d):
    """A bfloat16 weight on AMX's tiles, x in three bfloat16 parts: the product of x and the
    weight in float64, to float32's rounding of the sum, as close as the AVX path's. N of 7, 97 and
    130 leave a last tile of weight rows part empty (and a last pair of tiles one tile short); 6,
    11, 16 and 33 rows a last tile of x part empty."""
    x, w = random((rows, d), 0) * 10, random((n, d), 1).astype(jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    product = jax.jit(kernels.matmul)
    amx = np.asarray(product(x, w))
    amx_too(False)
    avx = np.asarray(product(x, w))
    bound = 4 * np.finfo(np.float32).eps * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w.astype(jnp.float32))).T)
    assert np.all(np.abs(amx - exact) <= bound) and np.all(np.abs(avx - exact) <= bound)
    assert not np.array_equal(amx, avx) or rows * n < 8, "AMX's sums should round apart from AVX's somewhere"


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 11, 16, 33, 65, 130])
@pytest.mark.parametrize("n, d", [(7, 64), (97, 128), (130, 576)])
def test_amx_int8_product_equals_the_exact_one(amx_too, rows, n, d):
    """An int8 weight on AMX's tiles, x in three digits of x / s (s the row's power of two with
    |x / s| <= 127, digits at powers of 128): within s / 2^15 of x, which is 4 float32 epsilons of
    the row's largest |x|; the bound is twice that times the sum of the weight row's |w|, so it
    holds the float32 rounding of the sum too. A row of zeros gives zeros; a row with one value
    40 times the others still meets the bound; a NaN makes its row's outputs NaN. N of 7, 97 and 130 leave a last tile of weight rows
    part empty; 6, 11, 16, 33, 65 and 130 rows a last tile of x part empty."""
    x = np.asarray(random((rows, d), 0)) * 10
    x[-1, 3] = 40 * np.abs(x[-1]).max()
    x[: rows // 2] = 0  # rows of zeros where there are two rows or more
    w = weights.quantize(random((n, d), 1))
    wide = np.asarray(weights.dequantize(w), np.float64)
    exact = x.astype(np.float64) @ wide.T
    product = jax.jit(kernels.matmul)
    amx = np.asarray(product(jnp.asarray(x), w))
    bound = 8 * np.finfo(np.float32).eps * np.abs(x).max(1, keepdims=True) * np.abs(wide).sum(1)
    assert np.all(np.abs(amx - exact) <= bound)
    assert not amx[: rows // 2].any()
    wild = np.asarray(product(jnp.asarray(x).at[-1, -1].set(np.nan), w))  # NaN out, the other rows as they were
    assert np.isnan(wild[-1]).all() and np.array_equal(wild[:-1], amx[:-1])
    amx_too(False)
    assert not np.array_equal(amx, np.asarray(product(jnp.asarray(x), w))) or rows * n < 8, "AMX's path not taken"


@pytest.mark.parametrize("rows", [1, 5, 17, 300])
def test_int8_avx2_path_equals_the_jax_path(avx2_too, use_native, rows):
    """An int8 weight on a CPU without AVX-512 (8 lanes a step, not 16): the pure-JAX path's product,
    at a prefill's rows too (there the kernel takes every row count)."""
    x, w = random((rows, 33), 0), weights.quantize(random((50, 33), 1))
    avx2_too(False)
    got = np.asarray(jax.jit(kernels.matmul)(x, w))
    use_native(False)
    np.testing.assert_allclose(got, np.asarray(jax.jit(M.linear)(x, w)), atol=1e-4, rtol=1e-5)


def test_helpers_that_slept_and_calls_side_by_side_give_the_same_bits(kernel):
    """The kernels' helper threads (common.h) after they fell asleep, and while four threads call
    the kernels at once (each call's job may replace another's before a helper takes it): every
    result is the one a call alone gives."""
    x, w = random((5, 100), 6), random((97 * 48, 100), 7)
    product = jax.jit(kernels.matmul)
    want = np.asarray(product(x, w))
    before = kernels.spin(0)  # the helpers sleep between calls
    try:
        for _ in range(3):
            time.sleep(0.01)
            np.testing.assert_array_equal(np.asarray(product(x, w)), want)
    finally:
        kernels.spin(before)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for got in pool.map(lambda _: np.asarray(product(x, w)), range(64)):
            np.testing.assert_array_equal(got, want)


def test_int8_gradient_flows_through_the_rows(kernel):
    """A head trained on an int8 model: the gradient with respect to x is the dequantized product's."""
    x, w = random((5, 24), 4), weights.quantize(random((9, 24), 5))
    loss = lambda f: lambda x: jnp.sum(jnp.tanh(f(x)))  # noqa: E731
    got = jax.grad(loss(lambda x: kernels.matmul(x, w)))(x)
    want = jax.grad(loss(lambda x: x @ weights.dequantize(w).T))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_gradient_is_the_jax_one(kernel):
    x, w = random((5, 24), 4), random((9, 24), 5)
    loss = lambda f: lambda x, w: jnp.sum(jnp.tanh(f(x, w)))
    got = jax.grad(loss(kernels.matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: x @ w.T), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5)


def test_bad_shapes_are_refused(kernel):
    with pytest.raises(ValueError, match="needs x \\[R, D\\] and w \\[N, D\\]"):
        kernels.matmul(random((2, 8), 0), random((3, 9), 1))


def calls_kernel(x, w) -> bool:
    return "jspec_matmul" in str(jax.make_jaxpr(M.linear)(x, w))


def test_linear_takes_the_kernel_only_in_its_range(kernel, use_native):
    w = random((6, 16), 0)
    for rows, expected in [(1, True), (2, True), (kernels.MAX_ROWS, True), (kernels.MAX_ROWS + 1, False)]:
        assert calls_kernel(random((1, rows, 16), 1), w) == expected, rows

    def int8(rows, d=16):
        return "jspec_matmul_int8" in str(jax.make_jaxpr(M.linear)(random((1, rows, d), 1),
                                                                   weights.quantize(random((6, d), 0))))

    # Without AMX's tiles an int8 weight takes it up to MAX_INT8_ROWS rows on AVX-512, at every
    # row count on AVX2 alone
    amx, avx512 = kernels.amx(False), kernels.uses_avx512()
    try:
        assert [int8(rows) for rows in (1, kernels.MAX_ROWS + 1, kernels.MAX_INT8_ROWS)] == [True, True, True]
        assert int8(kernels.MAX_INT8_ROWS + 1) == (not avx512)
        kernels.avx512(False)
        jax.clear_caches()  # `takes` asked at trace time
        assert int8(kernels.MAX_INT8_ROWS + 1) and int8(300)
    finally:
        kernels.amx(amx)
        kernels.avx512(avx512)
        jax.clear_caches()
    if amx:  # with them, at every row count where D suits the tiles (16 does not)
        assert not int8(kernels.MAX_INT8_ROWS + 1)
        assert int8(kernels.MAX_INT8_ROWS + 1, kernels.AMX_INT8_DEPTH) and int8(300, kernels.AMX_INT8_DEPTH)
    x = random((1, 4, 16), 1)
    for rows in (1, 4, 300):  # bfloat16 weights take it at every row count
        assert calls_kernel(random((1, rows, 16), 1), w.astype(jnp.bfloat16)), rows
    use_native(False)
    assert not calls_kernel(x, w)
    assert not calls_kernel(x, w.astype(jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_fallback_equals_kernel(kernel, use_native, dtype):
    x, w = random((2, 3, 40), 6), random((33, 40), 7).astype(dtype)
    with_kernel = np.asarray(jax.jit(M.linear)(x, w))
    use_native(False)
    np.testing.assert_allclose(np.asarray(jax.jit(M.linear)(x, w)), with_kernel, atol=1e-5)


# (B, T, kv heads, G, H, S): a decode step, a verification, a prefill block; odd head dims.
ATTENTION_SHAPES = [(1, 1, 3, 3, 64, 50), (2, 5, 3, 3, 64, 40), (3, 17, 2, 2, 13, 30), (2, 40, 1, 4, 9, 70),
                    (1, 3, 2, 1, 128, 9)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_equals_jax(kernel, shape):
    """Causal (prefix = q_pos + 1, what the JAX path does without one) and with a gap below each
    query's own key (a candidate side by side with others)."""
    q, k, v, q_pos, valid = attention_inputs(*shape, seed=0)
    gap = q_pos + 1 - jnp.asarray(np.random.default_rng(1).integers(0, 4, q_pos.shape), jnp.int32)
    for mask, prefix in ((jnp.ones_like(valid), None), (valid, None), (valid, jnp.maximum(gap, 1))):  # key 0: valid
        got, got_lse = jax.jit(kernels.attention)(q, k, v, q_pos, mask, q_pos + 1 if prefix is None else prefix)
        want, want_lse = attention.xla_attention(q, k, v, q_pos, mask, prefix)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=1e-5, rtol=1e-6)


def test_attention_over_chunks_equals_jax(kernel):
    """A cache of several 128-key chunks, queries seeing some of them: the partial softmaxes combine;
    and queries that all see only the first chunks of a long cache (a prefill's first chunks: the
    kernel stops at the furthest key seen)."""
    q, k, v, _, valid = attention_inputs(2, 3, 2, 2, 16, 600, seed=5)
    for q_pos in ([[5, 130, 299], [256, 257, 40]], [[5, 60, 140], [0, 1, 2]]):
        q_pos = jnp.asarray(q_pos, jnp.int32)
        got, got_lse = jax.jit(kernels.attention)(q, k, v, q_pos, valid, q_pos + 1)
        want, want_lse = attention.xla_attention(q, k, v, q_pos, valid)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=1e-5, rtol=1e-6)


def test_attention_query_gets_the_same_bits_in_any_call(kernel):
    """A query alone, among the K + 1 of a verification, in a batch, over a longer cache."""
    q, k, v, q_pos, valid = attention_inputs(4, 9, 3, 3, 64, 60, seed=1)
    q_pos = jnp.minimum(q_pos, 40)
    full = np.asarray(jax.jit(kernels.attention)(q, k, v, q_pos, valid, q_pos + 1)[0])
    for b, t in [(0, 0), (2, 5), (3, 8)]:
        at = q_pos[b:b + 1, t:t + 1]
        alone = jax.jit(kernels.attention)(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1], at, valid[b:b + 1], at + 1)[0]
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], full[b, t])
    shorter = jax.jit(kernels.attention)(q, k[:, :41], v[:, :41], q_pos, valid[:, :41], q_pos + 1)[0]
    np.testing.assert_array_equal(np.asarray(shorter), full)


def test_attention_query_gets_the_same_bits_in_any_work_item(kernel):
    """A prefill's chunk of 128 positions of 2 rows, 400 positions into a cache of 600, goes in
    work items of up to 64 positions, its keys paired for the score tiles: each query's bits are
    those it gets in a call of 16 positions (items of 16) and alone (its keys unpaired)."""
    q, k, v, _, valid = attention_inputs(2, 128, 3, 3, 64, 600, seed=6)
    q_pos = jnp.broadcast_to(400 + jnp.arange(128, dtype=jnp.int32), (2, 128))
    call = jax.jit(kernels.attention)
    whole = [np.asarray(x) for x in call(q, k, v, q_pos, valid, q_pos + 1)]
    for start, width in ((0, 16), (48, 16), (5, 1), (127, 1)):
        at = q_pos[:, start:start + width]
        part = call(q[:, start:start + width], k, v, at, valid, at + 1)
        for got, want in zip(part, whole):
            np.testing.assert_array_equal(np.asarray(got), want[:, start:start + width])


def test_attention_reads_the_cache_rows_it_is_given(kernel):
    """Queries of 2 rows over a cache of 4, reading its rows 3 and 1 (an admit's prompts prefilled
    into their slots): the bits of the same queries over those rows taken out; and through
    attention.attention both on the kernel and on XLA's path (which takes the rows out)."""
    q, k, v, q_pos, _ = attention_inputs(4, 5, 2, 2, 16, 300, seed=6)
    q, q_pos, valid = q[:2], q_pos[:2], jnp.ones((2, 300), jnp.bool_)
    rows = jnp.asarray([3, 1], jnp.int32)
    want = jax.jit(kernels.attention)(q, k[rows], v[rows], q_pos, valid, q_pos + 1)
    got = jax.jit(kernels.attention)(q, k, v, q_pos, valid, q_pos + 1, rows)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    through = jax.jit(lambda q, k, v, p: attention.attention(q, k, v, p, rows=rows))
    np.testing.assert_array_equal(np.asarray(through(q, k, v, q_pos)), np.asarray(want[0]))
    xla = attention.xla_attention(q, k[rows], v[rows], q_pos, None)[0]
    np.testing.assert_allclose(np.asarray(through(q.astype(jnp.bfloat16), k, v, q_pos)),  # not the kernel's dtype
                               np.asarray(xla), atol=2e-2)
    with pytest.raises(Exception, match="a row outside the cache"):
        jax.block_until_ready(kernels.attention(q, k, v, q_pos, valid, q_pos + 1, jnp.asarray([4, 0], jnp.int32)))


@pytest.mark.parametrize("shape", ATTENTION_SHAPES + [(2, 32, 3, 3, 64, 300), (3, 7, 2, 3, 24, 140)])
def test_attention_avx2_and_avx512_give_the_same_bits(avx2_too, shape):
    """AVX-512's score tiles (two keys a register, 8 queries x 4 keys, their lanes summed across
    registers), value tiles (a head of 64 values at once) and softmax (16 keys at a time) add
    every number as AVX2's do: the same bits, a host with AVX-512 or without. Head dims of 13, 9,
    24 and 128 take the tails of 8-lane steps and several value tiles; 300 and 140 positions more
    than one chunk of 128 keys; a gap below each query's own key and invalid keys the masks."""
    q, k, v, q_pos, valid = attention_inputs(*shape, seed=3)
    prefix = jnp.maximum(q_pos + 1 - jnp.asarray(np.random.default_rng(4).integers(0, 4, q_pos.shape), jnp.int32), 1)
    call = jax.jit(kernels.attention)
    wide = jax.tree.map(np.asarray, call(q, k, v, q_pos, valid, prefix))
    avx2_too(False)
    narrow = jax.tree.map(np.asarray, call(q, k, v, q_pos, valid, prefix))
    for a, b in zip(wide, narrow):
        np.testing.assert_array_equal(a, b)


def test_attention_gradient_is_the_jax_one(kernel):
    q, k, v, q_pos, valid = attention_inputs(2, 3, 2, 2, 8, 12, seed=2)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.tanh(f(q, k, v, q_pos, valid)))
    got = jax.grad(loss(attention.attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda *a: attention.xla_attention(*a)[0]), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5)


def test_attention_takes_the_kernel_up_to_max_queries(kernel, use_native):
    def calls(t):
        q, k, v, q_pos, _ = attention_inputs(1, t, 1, 2, 8, 40, seed=3)
        return "jspec_attention" in str(jax.make_jaxpr(attention.attention)(q, k, v, q_pos))

    assert calls(1) and calls(kernels.MAX_QUERIES) and not calls(kernels.MAX_QUERIES + 1)
    use_native(False)
    assert not calls(1)


def test_attention_bad_shapes_are_refused(kernel):
    q, k, v, q_pos, valid = attention_inputs(1, 2, 1, 2, 8, 6, seed=4)
    with pytest.raises(ValueError, match="kernels.attention needs"):
        kernels.attention(q, k[:, :, :, :4], v, q_pos, valid, q_pos + 1)


# (method, options, batch size): one row, K + 1 rows and four rows of K + 1.
RUNS = [("ar", {}, 1), ("ar", {}, 4), ("ngram", {}, 1), ("layer-skip", dict(skip_layers=(1,)), 4)]


def test_bfloat16_generation_is_token_identical(kernel, tiny_llama, use_native):
    """bfloat16 weights, with the kernels and without (float32: every lossless drafter in
    tests/methods/test_lossless.py::test_pure_jax_path_emits_ar_tokens)."""
    rng = np.random.default_rng(0)
    motif = rng.integers(0, tiny_llama.cfg.vocab_size, 5)
    prompts = [{"token_ids": np.resize(motif, n).tolist()} for n in (7, 12, 20, 9)]

    def run():
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_llama.params)
        m = Model(tiny_llama.cfg, params, name="tiny")  # a fresh cache of compiled programs
        return [[r["token_ids"] for r in m.generate(prompts[:b], method, max_new_tokens=12, batch_size=b, **opts)]
                for method, opts, b in RUNS]

    with_kernel = run()
    use_native(False)
    assert run() == with_kernel


def test_jspec_native_0_turns_it_off():
    code = ("from jspec.model import kernels, decoder as M; import jax, jax.numpy as jnp; "
            "x, w = jnp.ones((4, 8)), jnp.ones((3, 8)); "
            "print(kernels.unavailable, kernels.enabled, 'jspec_matmul' in str(jax.make_jaxpr(M.linear)(x, w)))")
    env = {**os.environ, "JSPEC_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "JSPEC_NATIVE=0 is set False False"
