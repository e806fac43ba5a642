"""bfloat16 weights are as lossless as float32 ones: activations and the KV cache stay float32, so
every drafter at batch 1 and 8 emits the rounded target's own `ar` tokens. With bfloat16
activations and cache too, rows part from `ar` only at near-ties (the numerics policy,
docs/design.md "Batch invariance"). The target and prompts are test_lossless.py's."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
from conftest import all_bfloat16, in_bfloat16
from support.lossless import CANDIDATES, DRAFTERS, K, NEW, Spec, check_lossless, make_spec, run, run_candidates
from support.spec import check_stats, ids

from jspec.api import Model
from jspec.bench import compare
from jspec.model.numerics import Numerics


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Spec:
    return make_spec(tmp_path_factory)


@pytest.fixture(scope="module")
def spec_bf16(spec) -> Spec:
    """spec's target, draft model and prompts in bfloat16, with their own ar batch-1 reference.
    Were any activation or cache entry rounded to bfloat16, a forward whose rows got numbers
    that depend on the forward's other rows (K + 1 verified positions, a batch) would part from
    ar at near-ties."""
    target = in_bfloat16(spec.target)
    ar = ids(target.generate(spec.prompts, max_new_tokens=NEW))
    return dataclasses.replace(spec, target=target, draft=in_bfloat16(spec.draft), free=None, ar=ar)


def test_bfloat16_ar_batch8_equals_batch1(spec_bf16):
    """Batch 8 over 4 prompts: a program of 4 rows of its own (a short batch runs at a power of two)."""
    check_lossless(spec_bf16, spec_bf16.target.generate(spec_bf16.prompts, max_new_tokens=NEW, batch_size=8), k=0)


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_bfloat16_greedy_equals_ar(spec_bf16, drafter, batch_size):
    records = run(spec_bf16, drafter, "confidence", batch_size=batch_size)
    check_lossless(spec_bf16, records)


# -- numerics: bfloat16 activations and cache ----------------------------------------------------

@pytest.fixture(scope="module")
def spec_all_bf16(spec) -> Spec:
    """spec with weights, activations and cache in bfloat16, and its own batch-4 ar reference."""
    target = all_bfloat16(spec.target)
    ar = ids(target.generate(spec.prompts, max_new_tokens=NEW, batch_size=4, batching="static"))
    return dataclasses.replace(spec, target=target, draft=all_bfloat16(spec.draft), free=None, ar=ar)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_bfloat16_activations_and_cache_run_every_drafter(spec, spec_all_bf16, drafter):
    """Every drafter decodes with bfloat16 activations and cache, and the records name the policy.
    Its tokens are not ar's: a bfloat16 activation depends on the forward's other rows (a K + 1
    verification, a batch) by whole bfloat16 steps. But where a row parts from ar, the target in
    float32 sees a near-tie between the two tokens, and until then the row is ar's: the drafts
    were checked, only the rounding differs."""
    records = run(spec_all_bf16, drafter, "confidence", batch_size=4)
    ar = [{"id": i, "token_ids": t} for i, t in enumerate(spec_all_bf16.ar)]
    rows = compare.compare(spec.target, ar, records, spec.prompts)
    assert all(row.verdict == compare.NEAR_TIE for row in rows), rows
    check_stats(records, K)
    assert {json.dumps(r["numerics"], sort_keys=True) for r in records} == {json.dumps(
        {"dtype": "bfloat16", "activation_dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
         "matmul_precision": "default"}, sort_keys=True)}


def test_a_bfloat16_cache_is_half_a_float32_one(spec_bf16):
    """What stays alive after a batch: the cache the next batch reuses, half the bytes in bfloat16."""
    def cache_bytes(numerics):
        model = Model(spec_bf16.target.cfg, spec_bf16.target.params, name="target", numerics=numerics)
        before = {id(x) for x in jax.live_arrays()}
        model.generate(spec_bf16.prompts, max_new_tokens=NEW, batch_size=4)
        kept = [x for x in jax.live_arrays() if id(x) not in before]
        assert {x.dtype for x in kept} == {numerics.kv_cache_dtype}
        assert len(kept) == 2 * model.cfg.num_layers  # k and v of each layer, nothing else
        return sum(x.nbytes for x in kept)

    f32, bf16 = cache_bytes(Numerics()), cache_bytes(Numerics(kv_cache="bfloat16"))
    assert bf16 > 0 and f32 == 2 * bf16


@pytest.mark.parametrize("drafter", ["eagle", "kangaroo"])
def test_bfloat16_candidates_equal_ar(spec_bf16, drafter):
    check_lossless(spec_bf16, run_candidates(spec_bf16, drafter, 8), k=CANDIDATES)

