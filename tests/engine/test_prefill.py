"""Chunked prefill (jspec.engine.loop.prefill): what a drafter keeps of a prompt does not depend on
the chunks it came in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lossless import K, make_spec, method_options
from support.spec import repetitive_prompts

from jspec import methods
from jspec.batching import prompt_rows
from jspec.drafters.knn_ssd import KnnSsd, nearest_anchor, prompt_feature
from jspec.engine import loop
from jspec.model import decoder

LENGTHS = (5, 30, 41, 70)  # one chunk of 32, two and three; of 8, up to nine
LENGTH = 128  # the cache's


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return make_spec(tmp_path_factory)


# The drafters that keep something of the prompt beside the target's cache: a draft model's
# cache, an early exit head's cache, EAGLE's head cache and the state before the next token.
@pytest.mark.parametrize("drafter", ["draft", "eesd", "kangaroo", "eagle"])
def test_chunk_sizes_leave_the_same_state(spec, drafter):
    """The prompts in chunks of 8 positions, of 32, or of 32 then 8 (loop.prefill_chunks' two
    sizes) leave the same last state, cache and drafter state (every array that runs along the
    cache: at each row's prompt positions)."""
    cfg, params = spec.target.cfg, spec.target.params
    prompts = [p["token_ids"] for p in repetitive_prompts(LENGTHS, cfg.vocab_size, seed=5)]
    method, opts = method_options(spec, drafter, {"max_draft": K})
    plan, dparams, _ = methods.build(method, spec.target, **opts)
    tokens, lens = map(jnp.asarray, prompt_rows(prompts, LENGTH))
    prefill = jax.jit(lambda params, dparams, chunks: loop.prefill(
        plan, params, dparams, cfg, tokens, lens, decoder.KVCache.zeros(cfg, len(prompts), LENGTH), chunks),
        static_argnums=2)
    by8 = jax.tree.leaves(prefill(params, dparams, (8,)))
    assert len(by8) > 3
    for other in (32,), (32, 8):
        assert_same_state(jax.tree.leaves(prefill(params, dparams, other)), by8, lens)


def assert_same_state(got, want, lens):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.ndim >= 2 and a.shape[1] == LENGTH:  # padding past a prompt differs with the chunks
            for row, n in enumerate(lens.tolist()):
                np.testing.assert_allclose(a[row, :n], b[row, :n], rtol=0, atol=2e-5)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_prefill_into_rows_of_a_cache_leaves_them_as_one_into_its_own(spec, dtype):
    """What an admit does (jspec.engine.slots): prompts prefilled into rows 3 and 0 of a cache of 4
    whose entries are another batch's leave those rows holding what a prefill into a fresh cache of
    2 rows holds (the same bits), the other rows as they were, and the same state (a float32 cache
    takes the attention kernel, a bfloat16 one XLA's path)."""
    cfg, params = spec.target.cfg, spec.target.params
    prompts = [p["token_ids"] for p in repetitive_prompts(LENGTHS[2:], cfg.vocab_size, seed=6)]
    method, opts = method_options(spec, "eesd", {"max_draft": K})
    plan, dparams, _ = methods.build(method, spec.target, **opts)
    tokens, lens = map(jnp.asarray, prompt_rows(prompts, LENGTH))
    rows = jnp.asarray([3, 0], jnp.int32)
    rng = np.random.default_rng(7)
    shape = (4, LENGTH, cfg.num_kv_heads, cfg.head_dim)
    other = decoder.KVCache(*([jnp.asarray(rng.normal(size=shape), dtype) for _ in range(cfg.num_layers)]
                              for _ in "kv"))
    prefill = jax.jit(lambda params, dparams, cache: loop.prefill(plan, params, dparams, cfg, tokens, lens, cache,
                                                                  (32, 8)))
    h, fresh, state = prefill(params, dparams, decoder.KVCache.zeros(cfg, len(prompts), LENGTH, dtype))
    h_in, into, state_in = prefill(params, dparams, decoder.KVCache(other.k, other.v, rows))
    np.testing.assert_array_equal(np.asarray(h_in), np.asarray(h))
    for a, b in zip(jax.tree.leaves(state_in), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(into.rows), np.asarray(rows))
    for got, want, before in zip(into.k + into.v, fresh.k + fresh.v, other.k + other.v):
        got, want, before = (np.asarray(x, np.float32) for x in (got, want, before))
        for i, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
            np.testing.assert_array_equal(got[row, :n], want[i, :n])
        np.testing.assert_array_equal(got[[1, 2]], before[[1, 2]])


def test_prefill_chunks_fill_products_with_rows():
    """On a CPU a prefill of few rows takes chunks of up to 128 positions before its chunks of 32
    (none longer than the cache), and one of many rows chunks of 32 only (the last size always
    divides the cache); an accelerator takes one size."""
    assert loop.prefill_chunks("cpu", 1024, 1) == (128, 32)
    assert loop.prefill_chunks("cpu", 1024, 4) == (64, 32)
    assert loop.prefill_chunks("cpu", 1024, 8) == loop.prefill_chunks("cpu", 1024, 32) == (32,)
    assert loop.prefill_chunks("cpu", 100, 1) == (64, 4)
    assert loop.prefill_chunks("cpu", 48, 1) == (32, 16)
    assert loop.prefill_chunks("cpu", 16, 1) == (16,)
    assert loop.prefill_chunks("cuda", 1024, 1) == (256,)


def test_knn_ssd_matches_the_whole_prompts_feature(spec):
    """KNN-SSD's feature summed chunk by chunk is the mean over the whole prompt, and picks its
    nearest anchor."""
    cfg, params = spec.target.cfg, spec.target.params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in LENGTHS]
    anchors = rng.normal(size=(6, cfg.hidden_size))
    dparams = {"anchors": jnp.asarray(anchors / np.linalg.norm(anchors, axis=1, keepdims=True), jnp.float32),
               "anchor_domain": jnp.arange(6, dtype=jnp.int32) % 3,
               "skip": jnp.zeros((3, 2, cfg.num_layers), bool)}
    tokens, lens = map(jnp.asarray, prompt_rows(prompts, LENGTH))

    @jax.jit
    def chunked(params, dparams, tokens, lens):
        cache = decoder.KVCache.zeros(cfg, len(prompts), LENGTH)
        return loop.prefill(KnnSsd(), params, dparams, cfg, tokens, lens, cache, (8,))[2]

    @jax.jit
    def whole(params, tokens, lens):
        h, _ = decoder.forward(params, cfg, tokens, None, decoder.KVCache.zeros(cfg, len(prompts), LENGTH))
        return prompt_feature(params, cfg, h, lens)

    state, feature = chunked(params, dparams, tokens, lens), whole(params, tokens, lens)
    np.testing.assert_allclose(np.asarray(state.feature / lens[:, None]), np.asarray(feature), rtol=0, atol=1e-5)
    want = dparams["anchor_domain"][nearest_anchor(feature, dparams["anchors"])]
    assert state.domain.tolist() == want.tolist()
