"""Greedy speculative decoding is lossless: every drafter under every controller emits exactly the
tokens plain autoregressive decoding (`ar`) emits (sampling: test_sampling.py; bfloat16:
test_bfloat16.py).

The models are tiny random Llamas (conftest's `tiny_hf_model`, converted by store.convert), fed
token ids. So that drafts are accepted often enough to exercise every path (partial accepts,
full accepts with a bonus token, EOS inside an accepted draft, a draft crossing
max_new_tokens), the 4-layer target's layers 1..3 are damped: their residual branches are
scaled down, so its first layers (early exit), its layers without 1 and 2 (layer skipping) and
its first two layers as a separate model (the draft model) predict it fairly well but not
perfectly. Repeated motifs in the prompts, and the loops random models fall into, feed n-gram
lookup.

Each (method, options, controller, batch size, prompt bucket, max_new_tokens) compiles the loop
once, seconds each on a small CPU, so the tests share one target and one set of prompts
(tests/support/lossless.py).
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lossless import (CANDIDATES, DRAFTERS, FREE_NEW, HEAD_EXIT, K, NEW, Spec, check_lossless, make_spec,
                              run, run_candidates)
from support.spec import LENGTHS, check_stats, convert_tiny, ids

from jspec import methods
from jspec.api import Model
from jspec.bench.hlo import cache_copies
from jspec.controllers import Fixed
from jspec.drafters.base import Drafter
from jspec.drafters.early_exit import EarlyExitState
from jspec.engine.sampling import Sampling
from jspec.engine.state import Draft
from jspec.engine.width import verify_widths
from jspec.errors import JspecError
from jspec.methods import options, wrappers
from jspec.model import decoder as jmodel
from jspec.parts import heads, shipped
from jspec.parts.folder import fingerprint
from jspec.training import distill


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Spec:
    return make_spec(tmp_path_factory)


# -- greedy: token-identical to ar ---------------------------------------------------------------

def test_ar_stats(spec):
    records = spec.target.generate(spec.prompts, max_new_tokens=NEW, batch_size=4, batching="static")
    check_lossless(spec, records, k=0)
    for r in records:
        assert r["stats"]["mean_accepted_tokens"] == 1.0
        assert (r["stats"]["drafted"], r["stats"]["accepted"]) == (0, 0)
        assert r["stats"]["rounds"] == r["new_tokens"]


@pytest.mark.parametrize("method", ["ar", "eesd"])
def test_logprobs_are_the_targets_top_k(spec, method):
    """`logprobs`: behind every generated token, the target's top k as one forward over prompt +
    output gives them, whichever round emitted it (accepted drafts and bonus tokens alike)."""
    k = 5
    records = (spec.target.generate(spec.prompts, max_new_tokens=NEW, batch_size=4, logprobs=k, batching="static")
               if method == "ar"
               else run(spec, method, logprobs=k))
    assert ids(records) == spec.ar
    # The teacher's forward over every prompt + output at once, rows padded at their end (causal:
    # a position sees nothing after it): one program for the four.
    texts = [p["token_ids"] + r["token_ids"] for p, r in zip(spec.prompts, records)]
    longest = max(map(len, texts))
    tokens = jnp.asarray([t + [0] * (longest - len(t)) for t in texts], jnp.int32)
    want_ids, want_logp = distill.teacher_top_k(spec.target.params, tokens,
                                                jnp.asarray([len(p["token_ids"]) for p in spec.prompts]),
                                                cfg=spec.target.cfg, answer=NEW, k=k)
    for i, r in enumerate(records):
        n = r["new_tokens"]
        assert r["top_ids"].shape == r["top_logprobs"].shape == (n, k)
        assert r["top_ids"][:, 0].tolist() == r["token_ids"]  # greedy: the most likely token is the one emitted
        np.testing.assert_array_equal(r["top_ids"], want_ids[i, :n])
        np.testing.assert_allclose(r["top_logprobs"], want_logp[i, :n], rtol=0, atol=1e-5)


# Every drafter under `fixed` (which checks that a model drafter drafts K every round), every other
# controller with one drafter here and others at batch 1 (BATCH1). The full product (42 programs)
# would add minutes of compiles and no path: a controller sees only each drafted token's
# confidence and each round's drafted and accepted counts (jspec/controllers).
BATCH4 = [(d, "fixed") for d in DRAFTERS] + [
    ("draft", "thompson-beta"), ("layer-skip", "dv"), ("eesd", "heuristic"), ("early-exit-2", "thompson-calibration"),
    ("kangaroo", "confidence")]


@pytest.mark.parametrize("drafter, controller", BATCH4)
def test_greedy_equals_ar_batch4(spec, drafter, controller):
    """Four prompts of very different lengths in one batch; some rows stop at EOS, some run to
    max_new_tokens."""
    records = run(spec, drafter, controller)
    check_lossless(spec, records, fixed_model_drafter=controller == "fixed" and drafter != "ngram")
    # Some drafts are accepted: the lossless check is not vacuous. (How many follows the
    # controllers' draws, which follow where each prompt sits in the batch.)
    assert sum(r["stats"]["accepted"] for r in records) >= 1


# Every drafter and every controller at batch 1 too.
BATCH1 = [("draft", "heuristic"), ("early-exit-1", "thompson-beta"), ("early-exit-2", "dv"),
          ("layer-skip", "thompson-calibration"), ("ngram", "confidence"), ("layer-skip", "fixed"),
          ("eesd", "thompson-beta"), ("kangaroo", "confidence"), ("eagle", "confidence")]


@pytest.mark.parametrize("drafter, controller", BATCH1)
def test_greedy_equals_ar_batch1(spec, drafter, controller):
    records = run(spec, drafter, controller, batch_size=1)
    check_lossless(spec, records, fixed_model_drafter=controller == "fixed" and drafter != "ngram")


# -- candidates side by side: a head's top C for one position --------------------------------------

@pytest.mark.parametrize("drafter, batch_size", [("eagle", 1), ("eagle", 4), ("eesd", 1), ("kangaroo", 4),
                                                 ("early-exit-1", 4)])
def test_candidates_equal_ar(spec, drafter, batch_size):
    """Rows accept different candidates (or none) in the same round; every output is ar's."""
    records = run_candidates(spec, drafter, batch_size)
    check_lossless(spec, records, k=CANDIDATES)
    for r in records:  # C proposed a round, at most one accepted
        assert r["stats"]["drafted"] == CANDIDATES * (r["stats"]["rounds"] - 1)
        assert r["new_tokens"] <= 2 * r["stats"]["rounds"] - 1
    assert sum(r["stats"]["accepted"] for r in records) >= 8


def test_candidates_accept_beyond_the_top_one(spec):
    """Not a chain of one in disguise: some accepted candidates are not the head's first choice,
    so a round with C = 3 accepts more often than with C = 2 somewhere."""
    two, three = (run_candidates(spec, "eagle", 4, c) for c in (2, 3))
    assert ids(two) == ids(three) == spec.ar
    rate = lambda rs: sum(r["stats"]["accepted"] for r in rs) / sum(r["stats"]["rounds"] - 1 for r in rs)  # noqa: E731
    assert rate(three) > rate(two)


@pytest.mark.parametrize("drafter", ["eagle", "eesd"])
def test_candidates_behind_lookup_equal_ar(spec, drafter):
    """Prompt lookup in front: rounds that copy a chain and rounds of candidates in one run."""
    opts = {**DRAFTERS[drafter], "head": spec.heads[drafter]}
    records = spec.target.generate(spec.prompts, max_new_tokens=NEW, batch_size=1, candidates=CANDIDATES, lookup=2,
                                   **opts)
    check_lossless(spec, records, k=wrappers.LOOKUP_MAX_DRAFT)
    copied = sum(r["stats"]["lookup_rounds"] for r in records)
    assert 0 < copied < sum(r["stats"]["rounds"] - 1 for r in records)


def test_keep_candidate_moves_the_heads_entries_too(spec):
    """After a round of candidates an early exit's head cache, like the target's, holds the accepted
    candidate's entries at the next position (the recompute test above barely sees a stale head
    entry: one of many keys the head attends over)."""
    cfg = spec.target.cfg
    drafter, dparams, _ = methods.build("eesd", spec.target, head=spec.heads["eesd"], candidates=CANDIDATES)
    rng = np.random.default_rng(0)
    entries = lambda n: [jnp.asarray(rng.standard_normal((2, 12, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)  # noqa: E731
                         for _ in range(n)]
    cache, head = jmodel.KVCache(entries(cfg.num_layers), entries(cfg.num_layers)), jmodel.KVCache(entries(1), entries(1))
    src, dst = np.array([5, 9]), np.array([3, 7])
    moved, dstate = drafter.keep_candidate(spec.target.params, dparams, cfg, cache, EarlyExitState(None, head),
                                           jnp.asarray(src), jnp.asarray(dst))
    before = cache.k + cache.v + head.k + head.v
    after = moved.k + moved.v + dstate.head.k + dstate.head.v
    for old, new in zip(before, after):
        want = np.array(old)
        want[[0, 1], dst] = want[[0, 1], src]
        np.testing.assert_array_equal(np.asarray(new), want)


def test_every_option_is_taken_and_a_flag_of_generate():
    """Each option of the methods' records is taken by some method and is a flag of `jspec
    generate` (the command line's flags come from the records), but for the API's own."""
    from jspec.cli.main import build_parser

    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    dests = {a.dest for a in generate._actions}
    for name, option in methods.OPTIONS.items():
        assert methods.TAKES[name] and set(methods.TAKES[name]) <= set(methods.METHODS)
        assert (name in dests) == option.flag, name
    assert {"exit_choice", "exit_kv"} == {n for n, o in methods.OPTIONS.items() if not o.flag}


@pytest.mark.parametrize("options, phrase", [
    (dict(method="ngram", candidates=3), "--candidates does not go with --method ngram; it goes with --method eagle"),
    (dict(method="eagle", candidates=1), "--candidates must be between 2 and 16"),
    (dict(method="kangaroo", candidates=3, max_draft=2), "it takes no --max-draft or --controller"),
    (dict(method="ar", max_draft=2), "--max-draft does not go with --method ar: it drafts nothing"),
    (dict(method="ar", controller="fixed"), "--controller does not go with --method ar"),
    (dict(method="ngram", exit_layer=1), "--exit-layer does not go with --method ngram"),
    (dict(method="eesd", skip_layers=(1,)), "--skip-layers does not go with --method eesd"),
    (dict(method="specee", exit_layer=1), "--exit-layer does not go with --method specee"),
    (dict(method="specee", max_draft=4), "--max-draft does not go with --method specee"),
    (dict(method="eagle", lookup_draft=8), "--lookup-draft goes with --lookup N"),
    (dict(method="ar", threshold=0.5), "--threshold does not go with --method ar: it drafts nothing"),
    (dict(method="early-exit", controller="fixed", threshold=0.9), "--threshold does not go with the fixed"),
    (dict(method="layer-skip", draft_cost=0.5), "--draft-cost does not go with the dv controller"),
    (dict(method="early-exit", thompson_variant="calibration"), "--thompson-variant does not go with the confidence"),
    (dict(method="early-exit", threshold=7.0), "--threshold must be in 0..1, got 7.0"),
    (dict(method="layer-skip", controller="dv", threshold=float("nan")), "--threshold must be in 0..1, got nan"),
    (dict(method="eesd", draft_cost=-1.0), "--draft-cost must be in 0..1, got -1.0"),
    (dict(method="ar", draft_model="/no/such/model"), "--draft-model does not go with --method ar"),
    (dict(method="mjsd", lookup=2), "--lookup does not go with --method mjsd; it goes with --method draft, eagle"),
    (dict(method="ngram", exit_choice="full"), "exit_choice does not go with --method ngram; it goes with --method spe"),
])
def test_options_a_method_would_ignore_are_refused(spec, options, phrase):
    if options["method"] in heads.KINDS:
        options = {**options, "head": spec.heads[options["method"]]}
    with pytest.raises(JspecError, match=phrase):
        spec.target.generate(spec.prompts[:1], max_new_tokens=4, **options)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_every_draft_length(spec, k):
    """K from 1 to 8 (the default maximum) under `fixed`, a width alone (K = 1) up to four of them
    (jspec.engine.width): k drafted every round."""
    records = run(spec, "early-exit-1", "fixed", max_draft=k)
    check_lossless(spec, records, k=k, fixed_model_drafter=True)
    assert sum(r["stats"]["accepted"] for r in records) >= 4


@pytest.mark.parametrize("max_new, drafter", [(1, "ngram"), (2, "early-exit-2"), (3, "layer-skip"), (5, "draft")])
def test_max_new_tokens_boundary(spec, max_new, drafter):
    """A round that would emit past max_new_tokens is cut there: the first max_new tokens of ar."""
    records = run(spec, drafter, "fixed", max_new_tokens=max_new)
    assert ids(records) == [row[:max_new] for row in spec.ar]
    assert all(len(t) == max_new for t in ids(records))  # no row's EOS comes this early (index >= 5)
    check_stats(records, K, fixed_model_drafter=drafter != "ngram")
    if max_new == 1:
        assert all(r["stats"]["rounds"] == 1 and r["stats"]["drafted"] == 0 for r in records)


def test_pure_jax_path_emits_ar_tokens(spec, pure_jax_path):
    """Every lossless drafter without the native kernels emits `ar`'s tokens (with them: the
    tests above), so the kernels change no token of any method (issue 13): half of them at batch
    size 1, half at 4 (the kernels' paths are per row; the paths of batch 4 are the same code)."""
    target = Model(spec.target.cfg, spec.target.params, name="jax-path")
    for i, drafter in enumerate(DRAFTERS):
        records = run(dataclasses.replace(spec, target=target), drafter, batch_size=1 + 3 * (i % 2))
        assert ids(records) == spec.ar, drafter


def test_unrelated_draft_model(spec, tmp_path_factory):
    """A draft model of another shape (hidden size, heads, layers) and weights: nearly every
    draft is rejected, and the output is still ar's."""
    _, dcfg, dparams = convert_tiny(tmp_path_factory, "spec-unrelated", seed=11, hidden_size=32,
                                    num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    other = Model(dcfg, dparams, name="unrelated")
    records = run(spec, "draft", "fixed", draft_model=other)
    check_lossless(spec, records, fixed_model_drafter=True)


@pytest.mark.parametrize("drafter", ["eesd", "kangaroo", "eagle", "draft", "layer-skip"])
def test_lookup_first_equals_ar(spec, drafter):
    """Prompt lookup in front of a model drafter: rounds of both kinds happen (at batch 1; at batch
    4 a round copies only when every live row found a repeat), and the output is ar's."""
    opts = {**DRAFTERS[drafter], "draft_model": spec.draft} if drafter == "draft" else dict(DRAFTERS[drafter])
    if drafter in heads.KINDS:
        opts["head"] = spec.heads[drafter]
    for batch_size in (1, 4) if drafter in ("eesd", "draft") else (1,):  # batch 4: lossless, rounds of one kind
        records = spec.target.generate(spec.prompts, max_new_tokens=NEW, batch_size=batch_size, max_draft=2,
                                       controller="fixed", lookup=2, lookup_draft=K, batching="static", **opts)
        check_lossless(spec, records)
        lookups = [r["stats"]["lookup_rounds"] for r in records]
        assert all(n <= r["stats"]["rounds"] - 1 for n, r in zip(lookups, records))
        if batch_size == 1:
            assert sum(lookups) > 0 and any(n < r["stats"]["rounds"] - 1 for n, r in zip(lookups, records))


def test_datastore_drafts_what_the_model_wrote(spec, tmp_path):
    """A datastore of the target's own output (its answers to these prompts): `ngram` and prompt
    lookup in front of a head draft from it where the text has no repeat (more accepted drafts;
    more copying rounds at batch 1), and the output is still ar's (batch 1 and 4)."""
    from jspec.errors import JspecError
    from jspec.parts import datastore

    table = datastore.build([(p["token_ids"] + row, len(p["token_ids"])) for p, row in zip(spec.prompts, spec.ar)])
    path = str(datastore.save(tmp_path / "ds", table, {"model": fingerprint(spec.target.cfg)}))
    accepted = lambda records: sum(r["stats"]["accepted"] for r in records)
    for batch_size in (1, 4):
        options = dict(max_new_tokens=NEW, batch_size=batch_size, max_draft=K, batching="static")
        plain = spec.target.generate(spec.prompts, method="ngram", **options)
        stored = spec.target.generate(spec.prompts, method="ngram", datastore=path, **options)
        check_lossless(spec, stored)
        assert accepted(stored) > accepted(plain)
        if batch_size > 1:  # prompt lookup in front of a head: batch 1 (batch 4 copies only when every row can)
            continue
        options.update(method="kangaroo", head=spec.heads["kangaroo"], max_draft=1, controller="fixed", lookup=2)
        plain = spec.target.generate(spec.prompts, datastore="off", **options)
        stored = spec.target.generate(spec.prompts, datastore=path, **options)
        check_lossless(spec, stored)
        copied = lambda records: sum(r["stats"]["lookup_rounds"] for r in records)
        assert copied(stored) > copied(plain)
    with pytest.raises(JspecError, match="--datastore goes with --method ngram or with --lookup"):
        methods.build("eesd", spec.target, head=spec.heads["eesd"], datastore=path)


def test_ngram_copies_repeats_of_at_least_lookup_tokens(spec):
    """`ngram`'s --lookup N is the shortest repeat it copies (default 2): the last token alone
    recurring proposes nothing at N = 2 and what followed it at N = 1; both are lossless."""
    from jspec.drafters.ngram import lookup
    from jspec.errors import JspecError

    seq = jnp.array([[5, 9, 3, 5, 0, 0]])
    for n, want in ((1, 3), (2, 0)):  # at N = 1 it copies 9, 3, 5 after the earlier 5
        tokens, found = lookup(seq, jnp.array([3]), 4, n, 3)
        assert int(found[0]) == want and (want == 0 or tokens[0, :3].tolist() == [9, 3, 5])
    assert methods.build("ngram", spec.target)[0].min_ngram == options.LOOKUP_MIN_NGRAM == 2
    drafted = {}
    for n in (1, 2):
        records = spec.target.generate(spec.prompts, method="ngram", lookup=n, max_draft=K, max_new_tokens=NEW)
        check_lossless(spec, records)
        drafted[n] = sum(r["stats"]["drafted"] for r in records)
    assert drafted[1] > drafted[2] > 0
    for bad in (dict(lookup=0), dict(lookup=4), dict(lookup_draft=4)):
        with pytest.raises(JspecError, match="--lookup"):
            methods.build("ngram", spec.target, **bad)


@pytest.mark.parametrize("options", [dict(method="eesd", max_draft=K, controller="fixed"),
                                     dict(method="eesd", max_draft=2, controller="fixed", lookup=2),
                                     dict(method="eesd", candidates=CANDIDATES, lookup=2)],
                         ids=["widths", "lookup", "candidates"])
def test_no_cache_copy_in_the_loop(spec, options):
    """A round's conditionals (its verification's width, prompt lookup's choice) never update
    the cache inside a branch, where XLA would copy it every round (docs/design.md), and moving an
    accepted candidate's entries copies no more than them."""
    m = Model(spec.target.cfg, spec.target.params)
    m.generate(spec.prompts[:1], max_new_tokens=NEW, head=spec.heads["eesd"], **options)
    ((rows, _, in_loop),) = cache_copies(m.cfg, m.programs())
    assert rows == 1 and in_loop == 0


# -- an oracle drafter: whole drafts accepted, EOS inside them, drafts crossing max_new_tokens ----

@dataclasses.dataclass(frozen=True)
class Oracle(Drafter):
    """Proposes the target's own greedy continuation, read from `dparams` [B, W] (each row's
    prompt then its greedy tokens, by position, past EOS and NEW too), so every draft is accepted whole. With wrong_at = j
    the token at draft slot j is replaced by another, so exactly j are accepted every round."""

    max_draft: int = 4
    wrong_at: int = -1
    proposes: int = -1  # tokens proposed a round (-1: max_draft)

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        width = dparams.shape[1]
        pos = s.length[:, None] + 1 + jnp.arange(self.max_draft)[None, :]
        tokens = jnp.take_along_axis(dparams, jnp.minimum(pos, width - 1), axis=1)
        if self.wrong_at >= 0:
            tokens = tokens.at[:, self.wrong_at].set((tokens[:, self.wrong_at] + 1) % cfg.vocab_size)
        n = jnp.where(s.done, 0, self.max_draft if self.proposes < 0 else self.proposes).astype(jnp.int32)
        return Draft(tokens, None, n, s.cache, s.dstate, s.cstate)


VERIFIED_WIDTHS = []


@dataclasses.dataclass(frozen=True)
class WidthRecorder(Oracle):
    """An Oracle that notes how many positions each verification's LM head runs over (the layers
    run at the same model.Width; a callback runs only in the branch the round takes)."""

    def target_logits(self, params, dparams, cfg, h, dstate, sampling):
        jax.debug.callback(lambda: VERIFIED_WIDTHS.append(h.shape[1]))
        return super().target_logits(params, dparams, cfg, h, dstate, sampling)


def run_oracle(spec: Spec, drafter: Oracle, batch_size: int = len(LENGTHS)):
    m = spec.target
    requests = m.requests(spec.prompts)
    width = max(LENGTHS) + FREE_NEW
    assert FREE_NEW >= NEW + drafter.max_draft
    table = np.zeros((len(requests), width), np.int32)
    for i, (r, out) in enumerate(zip(requests, spec.free_ar)):
        row = r.token_ids + out
        table[i, :len(row)] = row
    return [record for i in range(0, len(requests), batch_size)
            for record in m.run_batch(requests[i:i + batch_size], batch_size, NEW, Sampling(), jax.random.key(0),
                                      (drafter, jnp.asarray(table[i:i + batch_size]), Fixed()))]


@pytest.mark.parametrize("proposes", [1, 3, 8])
def test_a_round_verifies_only_what_it_drafted(spec, proposes):
    """With up to K = 8 drafts but `proposes` drafted a round, each verification runs over the
    narrowest width that holds them (2, 5, 9 positions), at batch 1 and 4. The output is ar's."""
    assert verify_widths(8) == (2, 3, 5, 9)
    width = 1 + {1: 1, 3: 4, 8: 8}[proposes]
    for batch_size in (1, 4):
        VERIFIED_WIDTHS.clear()
        records = run_oracle(spec, WidthRecorder(max_draft=8, proposes=proposes), batch_size)
        assert ids(records) == spec.ar
        assert set(VERIFIED_WIDTHS) == {width}
        rounds = [r["stats"]["rounds"] - 1 for r in records]
        assert len(VERIFIED_WIDTHS) == (sum(rounds) if batch_size == 1 else max(rounds))


def drafts_by_recompute(model, kind: str, hp, text, count: int = 1) -> np.ndarray:
    """A head's `count` most likely drafts after each prefix of text [T] -> [T, count], recomputed
    from scratch with no cache kept: for an eagle head the target's final-normed states over the
    whole text, each read at the next position; for eesd and kangaroo the target's first
    HEAD_EXIT layers; then the head over every position (causal, so position t sees text[:t + 1])."""
    cfg, params = model.cfg, model.params
    tokens = jnp.asarray(text, jnp.int32)[None]
    empty = jmodel.KVCache.zeros(cfg, 1, len(text))
    if kind == "eagle":
        h, _ = jmodel.forward(params, cfg, tokens, None, empty)
        prev = jnp.pad(heads.final_state(params, cfg, h)[:, :-1], ((0, 0), (1, 0), (0, 0)))
        x = heads.fuse_input(params, hp, tokens, prev)
    else:
        x, _ = jmodel.run_layers(params, cfg, jmodel.embed(params, tokens), None, empty, range(HEAD_EXIT))
    x, _ = heads.block(cfg, hp, x, None, heads.empty_kv(cfg, hp, 1, len(text)))
    return np.asarray(jax.lax.top_k(heads.vocab_logits(cfg, hp, x[0]), count)[1])


def accepted_by_recompute(spec: Spec, kind: str, count: int) -> list[int]:
    """Each row's accepted drafts if every round proposed the recomputed top `count` of the head
    (one position a round), on spec.free's EOS-less text."""
    hp = heads.draft_params(spec.free.params, heads.load(spec.heads[kind], spec.free.cfg)[0])
    counts = []
    for prompt, out in zip(spec.prompts, spec.free_ar):
        text, n, accepted = list(prompt["token_ids"]) + out, 1, 0
        drafts = drafts_by_recompute(spec.free, kind, hp, text, count)
        at = len(prompt["token_ids"])  # the newest committed token's position
        while n < NEW:
            hit = int(text[at + 1] in drafts[at])
            accepted, n, at = accepted + hit, n + 1 + hit, at + 1 + hit
        counts.append(accepted)
    return counts


@pytest.mark.parametrize("batch_size", [1, 4])
def test_eagle_drafts_what_a_recompute_drafts(spec, batch_size):
    """Greedy, one draft a round: each row's accepted drafts are those a head recomputed over the
    whole committed text would have drafted. The head's cache must then hold, for every committed
    position (drafted and accepted, or not), the entry of the target's true previous state, which
    `Eagle.accepted` writes after each round."""
    records = spec.free.generate(spec.prompts, method="eagle", head=spec.heads["eagle"], max_draft=1,
                                 controller="fixed", max_new_tokens=NEW, batch_size=batch_size, batching="static")
    assert ids(records) == [row[:NEW] for row in spec.free_ar]
    assert [r["stats"]["accepted"] for r in records] == accepted_by_recompute(spec, "eagle", 1)
    assert sum(r["stats"]["accepted"] for r in records) >= 4  # not vacuous


@pytest.mark.parametrize("kind", ["eagle", "eesd"])
def test_candidates_are_what_a_recompute_drafts(spec, kind):
    """The same with a head's top 3 side by side: a round accepts exactly when the next token is
    among the top 3 a head recomputed over the committed text proposes. So the accepted
    candidate's entries (the target's, an eesd head's own) are where a chain of one would have
    put them, and no candidate's state leaks into the next round's drafts."""
    records = spec.free.generate(spec.prompts, method=kind, head=spec.heads[kind], candidates=CANDIDATES,
                                 max_new_tokens=NEW, batch_size=4, batching="static")
    assert ids(records) == [row[:NEW] for row in spec.free_ar]
    assert [r["stats"]["accepted"] for r in records] == accepted_by_recompute(spec, kind, CANDIDATES)
    assert sum(r["stats"]["accepted"] for r in records) >= 8  # not vacuous


def test_layer_skip_default_sets(default_model, spec):
    """The default model skips the set searched for it (shipped in jspec/checkpoints/); any other model
    every other layer of its middle half."""
    searched = shipped.find(default_model, "layer-skip.json")
    assert searched is not None, "no searched layer-skip set in jspec/checkpoints/"
    drafter, _, _ = methods.build("layer-skip", default_model)
    assert drafter.skip == tuple(json.loads(searched.read_text())["skip_layers"])
    drafter, _, _ = methods.build("layer-skip", spec.target)
    assert spec.target.cfg.num_layers == 4 and drafter.skip == (2,)


def test_oracle_drafts_accepted_whole(spec):
    """Every round emits K drafts + the bonus token; EOS inside an accepted draft ends the row
    right there (the draft tokens after it are dropped), and the round that crosses NEW is cut."""
    eos_at = [row.index(spec.eos) for row in spec.ar if spec.eos in row]

    def inside(k):  # rows whose EOS is an accepted draft token with more draft tokens after it
        return sum((e - 1) % (k + 1) < k - 1 for e in eos_at)

    k = max(range(2, 7), key=inside)
    assert inside(k) >= 1
    records = run_oracle(spec, Oracle(max_draft=k))
    check_lossless(spec, records, k=k, fixed_model_drafter=True)
    for r in records:
        s = r["stats"]
        assert s["rounds"] == 1 + math.ceil((r["new_tokens"] - 1) / (k + 1))
        assert s["accepted"] == s["drafted"]  # all accepted, even past EOS / NEW: emission cuts
    assert any(len(t) == NEW and (NEW - 1) % (k + 1) for t in ids(records))  # a row cut at NEW mid-round


def test_oracle_partial_accepts(spec):
    """A draft wrong at slot j: j accepted and the target's token emitted instead, every round."""
    k, wrong_at = 3, 2
    records = run_oracle(spec, Oracle(max_draft=k, wrong_at=wrong_at))
    check_lossless(spec, records, k=k, fixed_model_drafter=True)
    for r in records:
        s = r["stats"]
        assert s["rounds"] == 1 + math.ceil((r["new_tokens"] - 1) / (wrong_at + 1))
        assert s["accepted"] == wrong_at * (s["rounds"] - 1)


# -- compiled once per shape bucket ----------------------------------------------------------------

def test_compiled_once_per_bucket(spec, count_compiles):
    new = 23  # a max_new_tokens no other test uses, so nothing is in jax's own caches yet
    m = Model(spec.target.cfg, spec.target.params, name="fresh")
    a, b = spec.prompts[0], {"token_ids": spec.prompts[3]["token_ids"][:9]}  # 3 and 9 tokens: bucket 32
    opts = dict(method="early-exit", exit_layer=2, max_draft=K, max_new_tokens=new)
    [ra] = m.generate([a], **opts)
    assert len(m.programs()) == 1 and count_compiles
    compiled = m.programs()
    count_compiles.clear()
    [rb] = m.generate([b], **opts)  # another length, the same bucket
    rs = m.generate([a, b, a], **opts)  # three batches
    assert m.programs() == compiled and count_compiles == []
    assert ids(rs) == [ra["token_ids"], rb["token_ids"], ra["token_ids"]]
    assert ra["token_ids"] == spec.ar[0][:new]
