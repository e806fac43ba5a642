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
from conftest import in_int8
from support.attention import random
from support.spec import repetitive_prompts

from jspec.api import Model
from jspec.model import kernels, numerics, sharding
from jspec.model.kernels import gpu_attention, gpu_int8

interpreted = functools.partial(gpu_int8.matmul, interpret=True)


def int8_values(n, d, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(-127, 128, (n, d)), jnp.int8)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 64, 70])
@pytest.mark.parametrize("n, d", [(64, 128), (192, 576), (48, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_the_exact_product(rows, n, d, dtype):
    """Rows in float32 or bfloat16 times int8 values (widened exactly), summed in float32: the
    exact product to float32's rounding of a sum of d terms, every row (the padded ones dropped)."""
    x, values = random((rows, d), rows).astype(dtype), int8_values(n, d, d)
    got = interpreted(x, values)
    want = jnp.einsum("rd,nd->rn", x.astype(jnp.float32), values.astype(jnp.float32), precision="highest")
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_takes_whole_blocks_on_one_gpu():
    """Output channels and depth in whole blocks of 16 or more, a GPU program, one device."""
    x = jnp.zeros((3, 64), jnp.float32)
    with numerics.tracing(numerics.Numerics(), "cuda"):
        assert kernels.takes_gpu_int8(x, int8_values(48, 64, 0))
        assert not kernels.takes_gpu_int8(x, int8_values(50, 64, 0))  # channels: no block of 16
        assert not kernels.takes_gpu_int8(jnp.zeros((3, 24), jnp.float32), int8_values(48, 24, 0))  # depth
    with numerics.tracing(numerics.Numerics(), "tpu"):
        assert not kernels.takes_gpu_int8(x, int8_values(48, 64, 0))
    with numerics.tracing(numerics.Numerics(), "cuda", sharding.make_mesh("data=2,model=2")):
        assert not kernels.takes_gpu_int8(x, int8_values(48, 64, 0))


def test_decodes_the_cpus_int8_tokens(tiny_llama, monkeypatch):
    """A whole generation in int8 with the GPU's kernels interpreted here (the int8 product and the
    attention): `ar` and a speculative method at batch 3, the tokens of the CPU's int8 path."""
    model = in_int8(Model(tiny_llama.cfg, tiny_llama.params, name="tiny"))
    prompts = repetitive_prompts((9, 30, 14), model.cfg.vocab_size, seed=4)
    calls = []

    def spy(x, values):
        calls.append(values.shape)
        return interpreted(x, values)

    monkeypatch.setattr(gpu_int8, "matmul", spy)
    monkeypatch.setattr(gpu_attention, "attention", functools.partial(gpu_attention.attention, interpret=True))
    jax.clear_caches()  # no trace of a kernel uninterpreted is reused
    for method, options in (("ar", {}), ("ngram", {"datastore": "off", "max_draft": 3})):
        want = model.generate(prompts, method=method, batch_size=3, batching="static", max_new_tokens=10, **options)
        with monkeypatch.context() as m:
            m.setattr(Model, "platform", property(lambda self: "cuda"))
            got = model.generate(prompts, method=method, batch_size=3, batching="static", max_new_tokens=10, **options)
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want], method
    weights = {x.shape for x in jax.tree.leaves(model.params) if x.dtype == jnp.int8}
    assert set(calls) == weights  # every matrix, the LM head included
