"""jspec's native few-rows matmul (jspec/native.py), for float32 and bfloat16 weights: it equals the JAX path, `model.linear` takes
it only where it should, generation with it emits the same tokens as without, and jspec runs
without it (JSPEC_NATIVE=0).

Tests that need the kernel skip, with the reason, when it is unavailable (not built, no AVX2,
JSPEC_NATIVE=0). The choice is made at trace time, so each switch clears jax's caches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec import native
from jspec.api import Model


@pytest.fixture
def kernel():
    if native.unavailable:
        pytest.skip(f"the native kernel is unavailable: {native.unavailable}")


def use_native(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(native, "enabled", on)
    jax.clear_caches()


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 33, 64])
@pytest.mark.parametrize("n, d", [(7, 64), (50, 13), (97, 100), (48, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_equals_jax(kernel, rows, n, d, dtype):
    """Weights in float32, or bfloat16 (widened exactly, so the reference is the rounded weight)."""
    x, w = random((rows, d), 0), random((n, d), 1).astype(dtype).astype(jnp.float32)
    got = jax.jit(native.matmul)(x, w.astype(dtype))
    want = jnp.einsum("rd,nd->rn", x, w, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_gets_the_same_bits_in_any_batch(kernel, dtype):
    x, w = random((80, 100), 2), random((61, 100), 3).astype(dtype)
    full = np.asarray(jax.jit(native.matmul)(x, w))
    for rows in (1, 3, 16, 17, 72):
        np.testing.assert_array_equal(np.asarray(jax.jit(native.matmul)(x[:rows], w)), full[:rows])


def test_gradient_is_the_jax_one(kernel):
    x, w = random((5, 24), 4), random((9, 24), 5)
    loss = lambda f: lambda x, w: jnp.sum(jnp.tanh(f(x, w)))
    got = jax.grad(loss(native.matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: x @ w.T), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5)


def test_bad_shapes_are_refused(kernel):
    with pytest.raises(ValueError, match="needs x \\[R, D\\] and w \\[N, D\\]"):
        native.matmul(random((2, 8), 0), random((3, 9), 1))


def calls_kernel(x, w) -> bool:
    return "jspec_matmul" in str(jax.make_jaxpr(M.linear)(x, w))


def test_linear_takes_the_kernel_only_in_its_range(kernel, monkeypatch):
    w = random((6, 16), 0)
    for rows, expected in [(1, False), (native.MIN_ROWS, True), (native.MAX_ROWS, True), (native.MAX_ROWS + 1, False)]:
        assert calls_kernel(random((1, rows, 16), 1), w) == expected, rows
    x = random((1, 4, 16), 1)
    for rows in (1, 4, 300):  # bfloat16 weights take it at every row count
        assert calls_kernel(random((1, rows, 16), 1), w.astype(jnp.bfloat16)), rows
    use_native(monkeypatch, False)
    assert not calls_kernel(x, w)
    assert not calls_kernel(x, w.astype(jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_fallback_equals_kernel(kernel, monkeypatch, dtype):
    x, w = random((2, 3, 40), 6), random((33, 40), 7).astype(dtype)
    with_kernel = np.asarray(jax.jit(M.linear)(x, w))
    use_native(monkeypatch, False)
    np.testing.assert_allclose(np.asarray(jax.jit(M.linear)(x, w)), with_kernel, atol=1e-5)


# (method, options, batch size): one row, K + 1 rows and four rows of K + 1.
RUNS = [("ar", {}, 1), ("ar", {}, 4), ("ngram", {}, 1), ("layer-skip", dict(skip_layers=(1,)), 4)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_generation_is_token_identical(kernel, tiny_llama, monkeypatch, dtype):
    rng = np.random.default_rng(0)
    motif = rng.integers(0, tiny_llama.cfg.vocab_size, 5)
    prompts = [{"token_ids": np.resize(motif, n).tolist()} for n in (7, 12, 20, 9)]

    def run():
        params = jax.tree.map(lambda x: x.astype(dtype), tiny_llama.params)
        m = Model(tiny_llama.cfg, params, name="tiny")  # a fresh cache of compiled programs
        return [[r["token_ids"] for r in m.generate(prompts[:b], method, max_new_tokens=12, batch_size=b, **opts)]
                for method, opts, b in RUNS]

    with_kernel = run()
    use_native(monkeypatch, False)
    assert run() == with_kernel


def test_jspec_native_0_turns_it_off():
    code = ("from jspec import native, model as M; import jax, jax.numpy as jnp; "
            "x, w = jnp.ones((4, 8)), jnp.ones((3, 8)); "
            "print(native.unavailable, native.enabled, 'jspec_matmul' in str(jax.make_jaxpr(M.linear)(x, w)))")
    env = {**os.environ, "JSPEC_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "JSPEC_NATIVE=0 is set False False"
