"""Rounds priced by what they cost (jspec.engine.pricing): priced out, every lossless method
decodes as `ar` does, round for round; free, it drafts as much as unpriced; measured, the costs
are the device's and the output is still `ar`'s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cli import assert_one_error, run as cli_run, tiny  # noqa: F401
from support.lossless import CANDIDATES, DRAFTERS, K, NEW, make_spec, method_options, run
from support.spec import ids

from jspec import methods
from jspec.engine import pricing
from jspec.engine.sampling import Sampling
from jspec.errors import JspecError

PRICED_OUT = [float(k + 1) for k in range(K + 1)]  # verifying k + 1 positions costs k + 1 plain steps
FREE = [1.0] * (K + 1)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return make_spec(tmp_path_factory)


def test_draft_length_maximises_expected_tokens_per_second():
    accepted, drafted, live = jnp.asarray([7, 0]), jnp.asarray([10, 10]), jnp.asarray([True, True])
    # rates 8/11 and 1/11: expected tokens 1, 1.73, 2.26, ... over costs that grow by 0.2 a token
    costs = jnp.asarray([1.0, 1.2, 1.4, 1.6, 1.8])
    expected = [(1 - a ** (k + 1)) / (1 - a) for a in (8 / 11, 1 / 11) for k in range(5)]
    want = int(np.argmax([(expected[k] + expected[5 + k]) / float(costs[k]) for k in range(5)]))
    assert int(pricing.draft_length(costs, accepted, drafted, live)) == want and 0 < want < K  # neither end
    assert int(pricing.draft_length(jnp.asarray(PRICED_OUT), accepted, drafted, live)) == 0
    assert int(pricing.draft_length(jnp.asarray(FREE), accepted * 0, drafted * 0, live)) == K
    # a done row counts for nothing: the live one alone, accepting nearly nothing, prices drafting out
    assert int(pricing.draft_length(costs, accepted, drafted, jnp.asarray([False, True]))) == 0


@pytest.mark.parametrize("remaining", [None, [20, 20]])
def test_rows_that_never_drafted_try_drafts_first(remaining):
    """A row is credited one accepted draft before its first: where one draft costs 1.6 plain
    rounds (more than a rate of 0.5 would pay for) rows that never drafted draft, so their
    acceptance is seen, and stop once it says drafting does not pay."""
    costs, live = jnp.asarray([1.0, 1.6, 2.2, 2.8, 3.4]), jnp.asarray([True, True])
    remaining = None if remaining is None else jnp.asarray(remaining)
    assert int(pricing.draft_length(costs, jnp.asarray([0, 0]), jnp.asarray([0, 0]), live, remaining)) == K
    assert int(pricing.draft_length(costs, jnp.asarray([4, 4]), jnp.asarray([20, 20]), live, remaining)) == 0
    # a rate of 1 ties with costs of k + 1: the plain round
    assert int(pricing.draft_length(jnp.asarray(PRICED_OUT), jnp.asarray([0, 0]), jnp.asarray([0, 0]), live,
                                    remaining)) == 0


def test_static_batches_draft_for_the_row_furthest_from_its_end():
    """Under static batching the batch ends with its last row: the row accepting nearly nothing
    decides, where the sum over rows would draft for the other one."""
    accepted, drafted, live = jnp.asarray([9, 0]), jnp.asarray([10, 10]), jnp.asarray([True, True])
    costs, remaining = jnp.asarray([1.0, 1.2, 1.4, 1.6, 1.8]), jnp.asarray([20, 20])
    assert int(pricing.draft_length(costs, accepted, drafted, live)) > 0
    assert int(pricing.draft_length(costs, accepted, drafted, live, remaining)) == 0
    # ... unless it is nearly done: then the other row is the furthest from its end
    assert int(pricing.draft_length(costs, accepted, drafted, live, jnp.asarray([20, 1]))) > 0
    assert int(pricing.draft_length(jnp.asarray(PRICED_OUT), accepted, drafted, live, remaining)) == 0
    assert int(pricing.draft_length(jnp.asarray(FREE), accepted * 0, drafted * 0, live, remaining)) == K


@pytest.mark.parametrize("k", [0, 2, K])
def test_a_measured_round_drafts_its_whole_length(spec, k):
    """The rounds `measure` times draft k tokens in every live row even where the controller
    would stop after one (a confidence it never reaches), and keep `ar`'s output."""
    model = spec.target
    plan = methods.build("early-exit", model, exit_layer=1, max_draft=K, controller="confidence", threshold=1.0)
    batch = model.requests(spec.prompts)[:4]
    records = model.run_batch(batch, 4, NEW, Sampling(), jax.random.key(0), plan, costs=pricing.forcing(k, K))
    assert ids(records) == spec.ar[:4]
    for r in records:
        assert r["stats"]["drafted"] == k * (r["stats"]["rounds"] - 1)


# every drafter, in static batches (one program each: the round is the same); two under continuous
# batching too, whose advance program takes the costs as well
@pytest.mark.parametrize("drafter, batching", [(d, "static") for d in DRAFTERS] + [("ngram", "continuous"),
                                                                                  ("early-exit-1", "continuous")])
def test_priced_out_is_ar_round_for_round(spec, drafter, batching):
    records = run(spec, drafter, batching=batching, pricing=PRICED_OUT)
    assert ids(records) == spec.ar
    for r in records:
        assert (r["stats"]["drafted"], r["stats"]["rounds"]) == (0, r["new_tokens"])


@pytest.mark.parametrize("costs", [[float(k + 1) for k in range(CANDIDATES + 1)], [1.0] * (CANDIDATES + 1)])
def test_priced_candidates_are_ar(spec, costs):
    """Candidates side by side (an EAGLE head's top C), priced out (a round that verifies the last
    token alone, with no candidate to judge) and free: `ar`'s tokens either way."""
    method, opts = method_options(spec, "eagle", {})
    records = spec.target.generate(spec.prompts, method=method, max_new_tokens=NEW, batch_size=4, batching="static",
                                   candidates=CANDIDATES, pricing=costs, **opts)
    assert ids(records) == spec.ar
    drafted = [r["stats"]["drafted"] for r in records]
    assert sum(drafted) == 0 if costs[-1] > 1 else min(drafted) > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_free_drafts_what_unpriced_drafts(spec, drafter):
    unpriced = run(spec, drafter, pricing="off")
    free = run(spec, drafter, pricing=FREE)
    assert ids(free) == ids(unpriced) == spec.ar
    assert [r["stats"] for r in free] == [r["stats"] for r in unpriced]


def test_measured_costs_are_the_devices_and_lossless(spec):
    """auto at batch 4 (continuous) times a round at each draft length, once per model and plan."""
    model = type(spec.target)(spec.target.cfg, spec.target.params, name="fresh")
    records = model.generate(spec.prompts, method="early-exit", exit_layer=1, max_draft=K, max_new_tokens=NEW,
                             batch_size=4)
    assert ids(records) == spec.ar
    [costs] = model._costs.values()
    assert costs.shape == (K + 1,) and np.all(costs > 0)
    model.generate(spec.prompts, method="early-exit", exit_layer=1, max_draft=K, max_new_tokens=NEW, batch_size=4)
    assert len(model._costs) == 1  # measured once


@pytest.mark.parametrize("pricing_, phrase", [
    ("sometimes", "--pricing must be one of auto, on, off or K \\+ 1 costs, got 'sometimes'"),
    ([1.0, 2.0], "pricing costs must be 5 positive seconds"),
    ([1.0, 0.0, 1.0, 1.0, 1.0], "pricing costs must be 5 positive seconds"),
])
def test_bad_pricing_is_refused(spec, pricing_, phrase):
    with pytest.raises(JspecError, match=phrase):
        run(spec, "ngram", pricing=pricing_)


def test_calibrate_prints_a_cost_per_draft_length(capsys, tiny):
    code, out, err = cli_run(capsys, "calibrate", "--model", tiny, "--method", "ngram", "--batch-size", 2,
                             "--max-new-tokens", 8, "--max-draft", 3)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "ngram at batch size 2, cpu: milliseconds a round by draft length"
    table = [line.split() for line in lines[2:6]]
    assert [int(row[0]) for row in table] == [0, 1, 2, 3]
    ms = [float(row[1]) for row in table]
    assert all(0 < a <= b for a, b in zip(ms, ms[1:])) and float(table[0][2]) == 1.0
    assert lines[7].startswith("draft length") and all(0 <= int(k) <= 3 for k in lines[7].split()[2:])


def test_calibrate_refuses_a_method_that_does_not_draft(capsys, tiny):
    assert_one_error(*cli_run(capsys, "calibrate", "--model", tiny, "--method", "ar"), "--method ar is not priced")


def test_cli_refuses_a_bad_pricing(capsys):
    assert_one_error(*cli_run(capsys, "generate", "hi", "--pricing", "never"), "argument --pricing: invalid choice: 'never'")


@pytest.mark.parametrize("batch_size", [1, 4])
def test_auto_is_lossless_and_names_its_choice(spec, batch_size):
    records = spec.target.generate(spec.prompts, method="auto", max_new_tokens=NEW, batch_size=batch_size)
    assert ids(records) == spec.ar
    assert {r["method"] for r in records} == {"ngram"}


def test_auto_prices_static_batches_and_a_named_method_does_not(spec):
    """`--pricing auto` (the default) under static batching: `--method auto` measures its costs
    (and stays lossless), `ngram` by name keeps its unpriced rounds."""
    model = type(spec.target)(spec.target.cfg, spec.target.params, name="fresh")
    assert ids(model.generate(spec.prompts, method="ngram", max_new_tokens=NEW, batch_size=4,
                              batching="static")) == spec.ar
    assert not model._costs
    assert ids(model.generate(spec.prompts, method="auto", max_new_tokens=NEW, batch_size=4,
                              batching="static")) == spec.ar
    assert len(model._costs) == 1


def test_a_lossy_method_is_not_priced(spec):
    with pytest.raises(JspecError, match="--pricing prices the rounds of lossless methods"):
        spec.target.generate(spec.prompts[:1], method="mjsd", exit_layer=1, max_new_tokens=2, pricing="on")
