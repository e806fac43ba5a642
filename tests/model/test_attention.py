"""Attention on GPUs and TPUs, run on this CPU: the TPU's loop over the filled key blocks
(attention.filled_attention) and the GPU's Pallas kernel (kernels/gpu_attention.py, in Pallas's
interpreter) each equal XLA's einsums, give a row the same bits whatever the other rows' lengths,
and decode the tokens the CPU's path does. What each platform's program holds is
tests/engine/test_programs.py's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_mesh
from support.attention import attention_inputs
from support.spec import repetitive_prompts

from jspec.api import Model
from jspec.model import attention, numerics
from jspec.model.kernels import gpu_attention

# (B, T, kv heads, G, H, S): a decode step, a verification, a block of alternatives, a prefill block.
SHAPES = [(1, 1, 2, 3, 16, 128), (2, 5, 3, 3, 64, 192), (3, 9, 2, 2, 32, 64), (2, 64, 1, 4, 16, 256)]
interpreted = functools.partial(gpu_attention.attention, interpret=True)
PATHS = {"tpu": attention.filled_attention, "cuda": interpreted}


def masks(q_pos, valid):
    """The three kinds of call: causal, with invalid entries (SpecEE), and with a gap below each
    query's own key (alternatives side by side)."""
    gap = q_pos + 1 - jnp.asarray(np.random.default_rng(1).integers(0, 4, q_pos.shape), jnp.int32)
    return [(jnp.ones_like(valid), q_pos + 1), (valid, q_pos + 1), (valid, jnp.maximum(gap, 1))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_equals_the_einsums(path, shape):
    q, k, v, q_pos, valid = attention_inputs(*shape, seed=0)
    for mask, prefix in masks(q_pos, valid):
        got, got_lse = jax.jit(PATHS[path])(q, k, v, q_pos, mask, prefix)
        want, want_lse = attention.xla_attention(q, k, v, q_pos, mask, prefix)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("queries", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_bfloat16_cache(path, queries):
    """A bfloat16 cache under bfloat16 or float32 queries: products in the wider type, accumulated
    in float32, the output in the queries' type."""
    q, k, v, q_pos, valid = attention_inputs(2, 4, 2, 2, 32, 128, seed=3)
    q, k, v = q.astype(queries), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    got, _ = jax.jit(PATHS[path])(q, k, v, q_pos, valid, q_pos + 1)
    want, _ = attention.xla_attention(q, k, v, q_pos, valid)
    assert got.dtype == queries
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2 if queries == jnp.bfloat16 else 2e-6, rtol=0)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_row_does_not_depend_on_the_others_lengths(path):
    """The loops run to the furthest query (the batch's for the TPU's, the row's for the GPU's):
    blocks a row sees nothing of change none of its bits."""
    q, k, v, _, valid = attention_inputs(3, 4, 2, 2, 16, 256, seed=2)
    outs = []
    for others in (10, 200):
        q_pos = jnp.asarray([3, others, others + 30])[:, None] + jnp.arange(4)
        outs.append(np.asarray(jax.jit(PATHS[path])(q, k, v, q_pos, valid, q_pos + 1)[0]))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])


def test_the_gpu_kernel_multiplies_at_the_programs_precision():
    """Under float32 activations the kernel's products ask for HIGHEST, as XLA's do (which Triton
    runs in float32, not TF32); under bfloat16 ones, DEFAULT."""
    q, k, v, q_pos, valid = attention_inputs(1, 2, 1, 2, 16, 64, seed=4)

    def precisions(policy):
        with numerics.tracing(policy, "cuda"):
            jaxpr = jax.make_jaxpr(gpu_attention.attention)(q, k, v, q_pos, valid, q_pos + 1).jaxpr
        return [str(e.params["precision"]) for e in equations(jaxpr) if e.primitive.name == "dot_general"]

    assert len(precisions(numerics.Numerics())) == 2  # scores and values, inside the kernel
    assert all(p.count("HIGHEST") == 2 for p in precisions(numerics.Numerics()))
    assert not any("HIGHEST" in p for p in precisions(numerics.Numerics("bfloat16", "bfloat16")))


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs its equations hold (a kernel's, a loop's)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


@pytest.mark.parametrize("policy", [numerics.Numerics(), numerics.Numerics(kv_cache="bfloat16"),
                                    numerics.Numerics("bfloat16", "bfloat16")], ids=str)
def test_the_gpu_kernel_lowers_for_cuda_in_every_policy(policy):
    """Lowered through Triton (no device needed), which multiplies operands of one type only: float32
    queries over a bfloat16 cache included."""
    q, k, v, q_pos, valid = attention_inputs(2, 3, 2, 2, 16, 128, seed=0)
    q, k, v = q.astype(numerics.DTYPES[policy.activations]), k.astype(policy.kv_cache_dtype), v.astype(policy.kv_cache_dtype)
    with numerics.tracing(policy, "cuda"):
        text = jax.jit(gpu_attention.attention).trace(q, k, v, q_pos, valid, q_pos + 1).lower(
            lowering_platforms=("cuda",)).as_text()
    assert f"@{gpu_attention.TARGET}" in text


def test_gradients_are_the_einsums(monkeypatch):
    """Training a head on a TPU differentiates the einsums (a loop of unknown length cannot be
    reversed)."""
    q, k, v, q_pos, valid = attention_inputs(2, 3, 2, 2, 8, 64, seed=5)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.tanh(f(q, k, v, q_pos, valid)))  # noqa: E731
    with numerics.tracing(numerics.Numerics(), "tpu"):
        got = jax.grad(loss(attention.attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda *a: attention.xla_attention(*a)[0]), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5)


@pytest.mark.parametrize("platform", sorted(PATHS))
def test_decodes_the_cpus_tokens(tiny_llama, platform, monkeypatch):
    """A whole generation with the platform's attention, run here: `ar` and a speculative method at
    batch 3 (rows of different lengths), the tokens of the CPU's path."""
    model = Model(tiny_llama.cfg, tiny_llama.params, name="tiny")
    prompts = repetitive_prompts((9, 30, 14), model.cfg.vocab_size, seed=4)
    monkeypatch.setattr(gpu_attention, "attention", interpreted)
    jax.clear_caches()  # no trace of the kernel uninterpreted is reused
    for method, options in (("ar", {}), ("ngram", {"datastore": "off", "max_draft": 3})):
        want = model.generate(prompts, method=method, batch_size=3, batching="static", max_new_tokens=10, **options)
        with monkeypatch.context() as m:
            m.setattr(Model, "platform", property(lambda self: platform))
            got = model.generate(prompts, method=method, batch_size=3, batching="static", max_new_tokens=10, **options)
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want], method


def test_on_a_mesh_each_device_runs_the_gpu_kernel_on_its_rows_and_heads(tiny_llama, monkeypatch):
    """On a data=2, model=2 mesh (4 of this CPU's 8 devices, the platform taken for cuda), the
    kernel runs on each device's 2 rows and 1 KV head of the batch's 4 and 2 (shard_map), and the
    sharded generation has the unsharded CPU's tokens."""
    model = Model(tiny_llama.cfg, tiny_llama.params, name="tiny")
    prompts = repetitive_prompts((9, 30, 14, 20), model.cfg.vocab_size, seed=4)
    options = {"datastore": "off", "max_draft": 3}
    want = model.generate(prompts, method="ngram", batch_size=4, batching="static", max_new_tokens=10, **options)
    seen, one_device = [], gpu_attention.on_device

    def spy(q, *args, **kwargs):
        seen.append(q.shape)
        return one_device(q, *args, **kwargs)

    monkeypatch.setattr(gpu_attention, "on_device", spy)
    monkeypatch.setattr(gpu_attention, "attention", interpreted)
    monkeypatch.setattr(Model, "platform", property(lambda self: "cuda"))
    jax.clear_caches()
    got = on_mesh(model, "data=2,model=2").generate(prompts, method="ngram", batch_size=4, batching="static",
                                                     max_new_tokens=10, **options)
    jax.clear_caches()
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert seen and all(shape[0] == 2 and shape[2] == 1 for shape in seen), seen
