"""int8 weights are lossless relative to themselves: activations and the KV cache stay float32,
so every drafter at batch 1 and 4 emits the int8 target's own `ar` tokens. The heads are those
made for the float model (tests/support/lossless.py): they draft for the int8 one unchanged.
The target and prompts are test_lossless.py's."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import in_int8
from support.lossless import DRAFTERS, NEW, Spec, check_lossless, make_spec, run
from support.spec import ids


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Spec:
    return make_spec(tmp_path_factory)


@pytest.fixture(scope="module")
def spec_int8(spec) -> Spec:
    """spec's target and draft model in int8, with their own ar batch-1 reference."""
    target = in_int8(spec.target)
    assert target.dtype == "int8"
    ar = ids(target.generate(spec.prompts, max_new_tokens=NEW))
    return dataclasses.replace(spec, target=target, draft=in_int8(spec.draft), free=None, ar=ar)


def test_int8_ar_batch4_equals_batch1(spec_int8):
    check_lossless(spec_int8, spec_int8.target.generate(spec_int8.prompts, max_new_tokens=NEW, batch_size=4,
                                                        batching="static"), k=0)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_int8_greedy_equals_int8_ar(spec_int8, drafter, batch_size):
    check_lossless(spec_int8, run(spec_int8, drafter, "confidence", batch_size=batch_size))
