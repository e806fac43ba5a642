"""Continuous batching (jspec.engine.slots): rows refilled with the next prompt as they finish
decode what static batches and `ar` at batch 1 decode, token for token, for every lossless drafter."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import in_bfloat16, on_mesh
from support.lossless import DRAFTERS, K, NEW, make_spec, method_options
from support.spec import ids, repetitive_prompts

from jspec import batching
from jspec.bench.hlo import cache_copies
from jspec.engine import slots
from jspec.errors import JspecError

# Ten prompts of mixed lengths (two past the 32-token bucket and the 32-position chunk of a
# prefill), for four rows: six are admitted mid-run.
LENGTHS = (3, 30, 12, 21, 40, 7, 70, 16, 25, 5)
BATCH = 4


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return make_spec(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(spec):
    return repetitive_prompts(LENGTHS, spec.target.cfg.vocab_size, seed=1)


def reference(spec, prompts):
    """`ar` at batch 1: some rows stop at EOS, at different steps, the rest at NEW tokens."""
    out = ids(spec.target.generate(prompts, max_new_tokens=NEW))
    ends = sorted({len(row) for row in out})
    assert len(ends) >= 3 and ends[-1] == NEW, ends
    return out


@pytest.fixture(scope="module")
def ar(spec, prompts):
    return reference(spec, prompts)


@pytest.mark.parametrize("drafter", ["ar", *DRAFTERS])
def test_continuous_equals_static_equals_ar(spec, prompts, ar, drafter):
    method, opts = ("ar", {}) if drafter == "ar" else method_options(spec, drafter, {"max_draft": K})
    run = lambda batching: spec.target.generate(prompts, method=method, max_new_tokens=NEW,  # noqa: E731
                                                batch_size=BATCH, batching=batching, **opts)
    continuous = run("continuous")
    assert ids(continuous) == ar
    if drafter in ("ar", "ngram"):  # static batches of every drafter: tests/methods/test_lossless.py
        assert ids(run("static")) == ar
    for r in continuous:
        assert r["seconds"] > 0 and r["stats"]["rounds"] >= 1
        assert r["stats"]["accepted"] <= r["stats"]["drafted"]


@pytest.mark.parametrize("drafter", ["ngram", "eesd"])
def test_continuous_in_bfloat16_equals_ar(spec, prompts, drafter):
    """bfloat16 weights (float32 activations and cache, the default numerics)."""
    model = in_bfloat16(spec.target)
    want = ids(model.generate(prompts, max_new_tokens=NEW))
    method, opts = method_options(spec, drafter, {"max_draft": K})
    assert ids(model.generate(prompts, method=method, max_new_tokens=NEW, batch_size=BATCH, **opts)) == want


def test_continuous_on_a_mesh_equals_ar(spec, prompts, ar):
    """Rows split over data=2 and weights over model=4: admitted groups of one row too (not a
    multiple of the data shards)."""
    method, opts = method_options(spec, "eesd", {"max_draft": K})
    sharded = on_mesh(spec.target, "data=2,model=4")
    assert ids(sharded.generate(prompts, method=method, max_new_tokens=NEW, batch_size=BATCH, **opts)) == ar


def test_a_refilled_row_forgets_its_last_prompt(spec, prompts, ar):
    """One row decoding every prompt in turn is `ar`: nothing of a slot's last prompt is read
    again (at batch 2 the other row's prompts pass through the same slots too)."""
    order = ids(spec.target.generate(prompts[::-1], max_new_tokens=NEW, batch_size=2))
    assert order == ar[::-1]


@pytest.mark.parametrize("drafter", ["ngram", "eesd", "draft"])
def test_admits_in_place_equal_ar(spec, prompts, ar, drafter):
    """At batch 2 (no prompts staged: batching.stage_rows) each admit prefills its prompts into
    their slots' rows of the batch's cache: the target's, an early exit head's, a draft model's."""
    method, opts = method_options(spec, drafter, {"max_draft": K})
    assert batching.stage_rows("cpu", 2) == 0
    assert ids(spec.target.generate(prompts, method=method, max_new_tokens=NEW, batch_size=2, **opts)) == ar


def test_programs_of_a_run(spec, prompts):
    """A continuous run compiles fill for its slots and for the prompts it stages (on a CPU, two
    at a time at batch 4), one advance (its priced rounds' costs were timed on it), one
    admit_staged and an admit per group size for prompts unlike their neighbours, whatever its
    prompts' lengths (they are prefilled in chunks); neither its decoding loop nor a staged
    prompt's admit copies a layer's cache (the state is donated)."""
    model = type(spec.target)(spec.target.cfg, spec.target.params, name="fresh")
    assert len({batching.prompt_bucket(len(p["token_ids"])) for p in prompts}) >= 3
    model.generate(prompts, method="ngram", max_new_tokens=8, batch_size=BATCH)
    assert sorted(sig.rows for sig in model.programs() if sig.program == "fill") == [2, BATCH]
    kinds = [sig.program for sig in model.programs()]
    assert kinds.count("advance") == kinds.count("admit_staged") == 1 and "generate" not in kinds
    admits = [sig.rows for sig in model.programs() if sig.program == "admit"]
    assert len(admits) == len(set(admits)) and set(admits) <= {1, 2}
    loops = {sig: c for sig, c in model.programs().items() if sig.program in ("advance", "admit_staged")}
    assert cache_copies(model.cfg, loops) == [(BATCH, 0, 0)] * 2


def test_prompts_are_staged_on_a_cpu_only():
    """Half the batch, four at most, and none below two; an accelerator prefills each admit's
    prompts in place."""
    assert [batching.stage_rows("cpu", b) for b in (1, 2, 3, 4, 6, 8, 32)] == [0, 0, 0, 2, 3, 4, 4]
    assert batching.stage_rows("cuda", 8) == batching.stage_rows("tpu", 32) == 0


def test_only_alike_prompts_are_staged_together():
    """A stage's rows run as many chunks as its longest prompt needs: four prompts are staged
    together only if the longest needs at most a quarter more chunks than the shortest, and
    never fewer than the stage's rows."""
    assert batching.stage_alike([40, 50, 60, 64], 4, 32)  # two chunks each
    assert not batching.stage_alike([30, 40, 50, 60], 4, 32)  # one chunk, then two
    assert batching.stage_alike([400, 420, 480, 500], 4, 32)  # 13 to 16 chunks
    assert not batching.stage_alike([400, 420, 480, 540], 4, 32)  # 13 to 17
    assert not batching.stage_alike([40, 50], 4, 32)


def test_rows_that_end_together_are_refilled_in_one_admit(spec):
    """Six prompts of one length, two tokens each (no EOS), at batch 2 (admits in place): every
    round the two rows end together, and the next two come in one admit (one program, run
    twice), not two."""
    model = type(spec.free)(spec.free.cfg, spec.free.params, name="fresh")
    same = [{"token_ids": p["token_ids"][:3]} for p in repetitive_prompts([9] * 6, model.cfg.vocab_size, seed=2)]
    records = model.generate(same, max_new_tokens=2, batch_size=2)
    assert ids(records) == [ids(model.generate([p], max_new_tokens=2))[0] for p in same]
    assert [sig.rows for sig in model.programs() if sig.program == "admit"] == [2]


def test_admits_group_prompts_of_as_many_chunks_in_powers_of_two():
    """Prompts freed together are admitted by their number of prefill chunks (of 32 positions
    here), each group a power of two: no row is prefilled past its prompt's last chunk, and no
    padding row is."""
    lengths = [3, 40, 64, 5, 33, 700, 20, 31, 1, 9]
    groups = batching.admit_groups(lengths, 32)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len({-(-lengths[i] // 32) for i in g}) == 1 and len(g) & (len(g) - 1) == 0, g
    assert sorted(map(len, groups)) == [1, 1, 2, 2, 4]  # 6 of one chunk (4 + 2), 3 of two (2 + 1), 1 of 22


def test_a_run_admits_prompts_of_mixed_lengths_by_their_chunks(spec):
    """Two rows end together (two tokens, no EOS) and the next two prompts, of 4 and 70 tokens,
    come in two admits of one row each, not one of two rows both prefilled for 3 chunks."""
    model = type(spec.free)(spec.free.cfg, spec.free.params, name="fresh")
    prompts = repetitive_prompts([4, 4, 3, 70], model.cfg.vocab_size, seed=4)
    records = model.generate(prompts, max_new_tokens=2, batch_size=2)
    assert ids(records) == [ids(model.generate([p], max_new_tokens=2))[0] for p in prompts]
    assert [sig.rows for sig in model.programs() if sig.program == "admit"] == [1]


def test_slots_take_the_shortest_prompts_first(spec):
    """Given longest first, the prompts are prefilled shortest first: two tokens each and no EOS,
    so rows taken together finish together and the records come in the order they were taken."""
    model = spec.free
    requests = model.requests(repetitive_prompts([40, 3, 21, 9, 30, 5], model.cfg.vocab_size, seed=3))
    records = list(model.stream(requests, max_new_tokens=2, batch_size=2))
    length = {r.id: len(r.token_ids) for r in requests}
    assert [length[r["id"]] for r in records] == sorted(length.values())


def test_put_rows_keeps_shared_arrays():
    import jax.numpy as jnp

    full = {"rows": jnp.zeros((4, 3)), "shared": jnp.asarray(7)}
    new = {"rows": jnp.ones((2, 3)), "shared": jnp.asarray(1)}
    new["rows"] = new["rows"].at[1].set(2)
    out = slots.put_rows(full, new, jnp.asarray([3, 1]))
    np.testing.assert_array_equal(out["rows"], [[0] * 3, [2] * 3, [0] * 3, [1] * 3])
    assert int(out["shared"]) == 7


def test_unknown_batching_is_refused(spec, prompts):
    with pytest.raises(JspecError, match="--batching must be one of continuous, static"):
        spec.target.generate(prompts[:1], batching="dynamic")
