"""Weights in int8 (jspec.model.weights): the quantization's error bound, NumPy and jax agreeing,
the stored tree (`abstract`) matching what `cast` makes, a conversion to int8 and its load, and a
TPU program that multiplies the int8 values as stored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.convert import store
from jspec.model import layout, weights


def test_quantization_is_within_half_a_step_of_each_row():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 33)).astype(np.float32) * rng.uniform(0.01, 10, (40, 1)).astype(np.float32)
    w[3] = 0  # an all-zero row: scale 1, values 0
    q = weights.quantize(w)
    assert q.values.dtype == np.int8 and q.scale.dtype == np.float32 and q.shape == (40, 33)
    assert np.abs(q.values).max() == 127 and (q.values[3] == 0).all() and q.scale[3] == 1
    err = np.abs(weights.dequantize(q) - w)
    assert (err <= q.scale[:, None] / 2 * (1 + 1e-6)).all()
    np.testing.assert_allclose(q.scale[q.scale != 1], np.abs(w).max(-1)[q.scale != 1] / 127, rtol=1e-6)
    on_device = weights.quantize(jnp.asarray(w))  # conversion quantizes in NumPy, a load on the device
    np.testing.assert_array_equal(np.asarray(on_device.values), q.values)
    np.testing.assert_array_equal(np.asarray(on_device.scale), q.scale)


def test_gathered_rows_dequantize_as_the_matrix_does():
    """Rows gathered by an index of any shape (an embedding lookup [B, T], SpecEE's and the
    predictors' candidates [B, C]) keep their scales: the same floats as the dequantized matrix's rows."""
    w = weights.quantize(jnp.asarray(np.random.default_rng(1).standard_normal((10, 6)), jnp.float32))
    for idx in (jnp.array([3, 0]), jnp.array([[1, 2, 3], [4, 5, 9]]), jnp.zeros((2, 2, 2), jnp.int32)):
        np.testing.assert_array_equal(np.asarray(weights.as_float(weights.take_rows(w, idx))),
                                      np.asarray(weights.dequantize(w))[np.asarray(idx)])


def test_bfloat16_rows_are_taken_without_widening_the_table():
    """An embedding lookup in a loop over a bfloat16 table: the rows are the table's, and the loop
    carries the table as it is, not a float32 copy (XLA:CPU takes bfloat16 rows in float32, and
    without the barrier widened the whole table before the loop, once a call)."""
    table = jnp.asarray(np.random.default_rng(2).standard_normal((4096, 48)), jnp.bfloat16)
    idx = jnp.array([[7, 4095], [0, 7]])

    def lookups(table, idx):
        step = lambda i, acc: acc + weights.as_float(weights.take_rows(table, (idx + i) % 4096))  # noqa: E731
        return jax.lax.fori_loop(0, 3, step, jnp.zeros((2, 2, 48), jnp.float32))

    np.testing.assert_array_equal(np.asarray(weights.take_rows(table, idx)), np.asarray(table)[np.asarray(idx)])
    hlo = jax.jit(lookups).lower(table, idx).compile().as_text()
    [loop] = [line for line in hlo.splitlines() if " while(" in line]  # what the loop carries
    assert "bf16[4096,48]" in loop and "f32[4096,48]" not in loop


def test_cast_makes_the_tree_abstract_describes(tiny_llama):
    cast = weights.cast(tiny_llama.params, "int8")
    want = weights.abstract(layout.param_shapes(tiny_llama.cfg), "int8")
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), t)  # noqa: E731
    assert shapes(cast) == shapes(want)
    assert weights.dtype_of(cast) == "int8" and weights.dtype_of(tiny_llama.params) == "float32"
    assert cast["layers"][0]["attn_norm"].dtype == jnp.float32  # norms stay float32
    ratio = weights.nbytes(cast) / weights.nbytes(tiny_llama.params)
    assert 0.25 < ratio < 0.27  # a byte a weight, plus a float32 a row and the norms
    back = weights.cast(cast, "float32")
    assert weights.dtype_of(back) == "float32" and shapes(back) == shapes(tiny_llama.params)


def test_converted_to_int8_and_loaded(tiny_llama, tmp_path):
    """`jspec convert --dtype int8`'s folder holds what quantizing the float model in NumPy gives,
    and loads as int8; a float folder loaded with dtype="int8" is quantized on load by XLA to the
    same scales and values within a step (its division may round a quotient the other way)."""
    out = store.convert(str(tiny_llama.path.parent / "source"), tmp_path / "int8", "int8")
    cfg, meta = store.read_meta(out)
    assert meta["dtype"] == "int8"
    _, params, _ = store.load(out)
    _, on_load, _ = store.load(tiny_llama.path, "int8")
    want = weights.cast(jax.tree.map(np.asarray, tiny_llama.params), "int8")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-6, atol=1),
                 on_load, want)
    m = jspec.load(str(out))
    assert m.dtype == "int8" and m.policy()["dtype"] == "int8"
    assert sum(p.stat().st_size for p in (out / "params").rglob("*") if p.is_file()) < 0.4 * sum(
        p.stat().st_size for p in (tiny_llama.path / "params").rglob("*") if p.is_file())


def test_unknown_dtype_is_refused_in_one_line(tiny_llama):
    with pytest.raises(jspec.JspecError, match="unknown dtype 'int4'; choose float32, bfloat16, int8"):
        jspec.load(str(tiny_llama.path), "int4")
