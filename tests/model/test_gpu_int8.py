"""The GPU's int8 product (kernels/gpu_int8.py), run on this CPU in Pallas's interpreter: it equals
the exact product of the rows and the stored values, `decoder.linear` gives it the weights it
should, and a generation through it emits the tokens of the CPU's int8 path. That a GPU's program
holds it in place of a widened weight is tests/engine/test_programs.py's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import in_int8, on_mesh
from support.attention import random
from support.spec import repetitive_prompts

from jspec.api import Model
from jspec.model import kernels, numerics, sharding
from jspec.model.kernels import gpu_attention, gpu_int8

on_device = gpu_int8.on_device


def int8_values(n, d, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(-127, 128, (n, d)), jnp.int8)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 64, 70])
@pytest.mark.parametrize("n, d", [(64, 128), (192, 576), (48, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_the_exact_product(rows, n, d, dtype):
    """Rows in float32 or bfloat16 times int8 values (widened exactly), summed in float32: the
    exact product to float32's rounding of a sum of d terms, every row (the padded ones dropped)."""
    x, values = random((rows, d), rows).astype(dtype), int8_values(n, d, d)
    got = on_device(x, values, interpret=True)
    want = jnp.einsum("rd,nd->rn", x.astype(jnp.float32), values.astype(jnp.float32), precision="highest")
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_takes_whole_blocks_on_each_gpu():
    """Output channels and depth in whole blocks of 16 or more on each device, a GPU program."""
    x = jnp.zeros((3, 64), jnp.float32)
    with numerics.tracing(numerics.Numerics(), "cuda"):
        assert kernels.takes_gpu_int8(x, int8_values(48, 64, 0))
        assert not kernels.takes_gpu_int8(x, int8_values(50, 64, 0))  # channels: no block of 16
        assert not kernels.takes_gpu_int8(jnp.zeros((3, 24), jnp.float32), int8_values(48, 24, 0))  # depth
    with numerics.tracing(numerics.Numerics(), "tpu"):
        assert not kernels.takes_gpu_int8(x, int8_values(48, 64, 0))
    # model=2: a projection in splits its channels (48: 24 a device), a projection out its depth.
    with numerics.tracing(numerics.Numerics(), "cuda", sharding.make_mesh("data=2,model=2")):
        assert kernels.takes_gpu_int8(x, int8_values(64, 64, 0))
        assert not kernels.takes_gpu_int8(x, int8_values(48, 64, 0))
        assert kernels.takes_gpu_int8(x, int8_values(48, 64, 0), split_depth=True)


@pytest.mark.parametrize("split_depth", [False, True])
def test_on_a_mesh_each_device_multiplies_its_part(split_depth):
    """On a data=2, model=2 mesh (4 of this CPU's 8 devices) each device multiplies its rows by its
    part of the weight (its output channels, or its depth with the parts summed): the product of
    one device to float32's rounding."""
    x, values = random((6, 128), 0), int8_values(64, 128, 1)
    want = jnp.einsum("rd,nd->rn", x, values.astype(jnp.float32), precision="highest")
    mesh = sharding.make_mesh("data=2,model=2")
    with numerics.tracing(numerics.Numerics(), "cuda", mesh):
        got = jax.jit(functools.partial(gpu_int8.matmul, split_depth=split_depth, interpret=True))(x, values)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.fixture
def interpreted(monkeypatch) -> list:
    """The GPU's kernels (the int8 product and the attention) run in Pallas's interpreter for the
    rest of the test; returns the list of the weight shapes each int8 product was called with (a
    device's part on a mesh)."""
    calls = []

    def spy(x, values, interpret=False):
        calls.append(values.shape)
        return on_device(x, values, interpret=True)

    monkeypatch.setattr(gpu_int8, "on_device", spy)
    monkeypatch.setattr(gpu_attention, "attention", functools.partial(gpu_attention.attention, interpret=True))
    jax.clear_caches()  # no trace of a kernel uninterpreted is reused
    yield calls
    jax.clear_caches()


def test_decodes_the_cpus_int8_tokens(tiny_llama, interpreted, monkeypatch):
    """A whole generation in int8 with the GPU's kernels interpreted here (the int8 product and the
    attention): `ar` and a speculative method at batch 3, the tokens of the CPU's int8 path."""
    model = in_int8(Model(tiny_llama.cfg, tiny_llama.params, name="tiny"))
    prompts = repetitive_prompts((9, 30, 14), model.cfg.vocab_size, seed=4)
    for method, options in (("ar", {}), ("ngram", {"datastore": "off", "max_draft": 3})):
        want = model.generate(prompts, method=method, batch_size=3, batching="static", max_new_tokens=10, **options)
        with monkeypatch.context() as m:
            m.setattr(Model, "platform", property(lambda self: "cuda"))
            got = model.generate(prompts, method=method, batch_size=3, batching="static", max_new_tokens=10, **options)
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want], method
    weights = {x.shape for x in jax.tree.leaves(model.params) if x.dtype == jnp.int8}
    assert set(interpreted) == weights  # every matrix, the LM head included


def test_decodes_the_unsharded_int8_tokens_on_a_mesh(tiny_llama, interpreted, monkeypatch):
    """On a data=2, model=2 mesh, the platform taken for cuda and the kernels interpreted, each
    device multiplies its part of every int8 matrix (half its output channels, or half the depth
    of `wo` and `w_down`), and `ngram` at batch 4 emits the unsharded CPU's int8 tokens."""
    model = in_int8(Model(tiny_llama.cfg, tiny_llama.params, name="tiny"))
    prompts = repetitive_prompts((9, 30, 14, 20), model.cfg.vocab_size, seed=4)
    options = {"datastore": "off", "max_draft": 3}
    want = model.generate(prompts, method="ngram", batch_size=4, batching="static", max_new_tokens=10, **options)
    assert not interpreted  # the CPU's own path
    monkeypatch.setattr(Model, "platform", property(lambda self: "cuda"))
    got = on_mesh(model, "data=2,model=2").generate(prompts, method="ngram", batch_size=4, batching="static",
                                                     max_new_tokens=10, **options)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    # Each int8 matrix's part on a device: halved along the axis jspec's sharding rules split.
    parts = {tuple(n // 2 if axis == "model" else n for n, axis in zip(x.shape, sharding.rule(path, 2)))
             for path, x in jax.tree_util.tree_flatten_with_path(model.params)[0] if x.dtype == jnp.int8}
    assert set(interpreted) == parts, interpreted
