"""Sampled speculative decoding draws from exactly the target's distribution: every drafter's
first, first-two and third tokens over thousands of samples, against the distributions computed
exactly from a 16-token model (tests/support/spec.py's goodness-of-fit check)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.lossless import save_heads
from support.spec import (SAMPLE_ROWS, SAMPLES, SPROMPT, SV, assert_sampled_from, check_stats, convert_tiny,
                          exact_marginals, ids)

from jspec.api import Model
from jspec.engine.sampling import Sampling
from jspec.parts import heads
from jspec.parts.folder import fingerprint

LOOKUP_SAMPLES = 1024  # prompt lookup runs at batch 1: one program run per sample


@dataclasses.dataclass
class SamplingSetup:
    target: Model
    draft: Model
    p1: np.ndarray  # [V] first token
    p12: np.ndarray  # [V, V] first two tokens
    p3: np.ndarray  # [V] third token (marginal)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> SamplingSetup:
    _, cfg, params = convert_tiny(tmp_path_factory, "spec-small", seed=5, vocab_size=SV, num_hidden_layers=3)
    cfg = dataclasses.replace(cfg, eos_token_ids=())
    target = Model(cfg, params, name="small")
    # Three different draft distributions: layers 0-1 (early exit), 0 and 2 (layer skip), 0 alone (draft model).
    draft = Model(dataclasses.replace(cfg, num_layers=1), {**params, "layers": params["layers"][:1]}, name="small-draft")
    return SamplingSetup(target, draft, *exact_marginals(cfg, params, SPROMPT, Sampling(1.0)))


SAMPLED = {
    "ar": dict(method="ar"),
    "early-exit": dict(method="early-exit", exit_layer=2, max_draft=3),  # confidence controller
    "ngram": dict(method="ngram", max_draft=3, lookup=1),  # 3 new tokens: a 2-token repeat would be rare
    # after the first round's repeat, the datastore's chains (a table of random text: 3.7x the drafts)
    "ngram-datastore": dict(method="ngram", max_draft=3, datastore="small"),
    "layer-skip": dict(method="layer-skip", skip_layers=(1,), max_draft=3, controller="thompson"),
    "draft": dict(method="draft", max_draft=3, controller="heuristic"),
    # temperature, top-k and top-p: target and draft distributions both filtered
    "draft-filtered": dict(method="draft", max_draft=3, controller="fixed", temperature=0.8, top_k=6, top_p=0.9),
    "eesd": dict(method="eesd", max_draft=3),  # thompson; a draft vocabulary of 12 of the 16 tokens
    "kangaroo": dict(method="kangaroo", max_draft=3),  # confidence
    "eagle": dict(method="eagle", max_draft=3),  # confidence
    "eagle-candidates": dict(method="eagle", candidates=3),  # the target's own draw, matched to a candidate
    # every token is in the prompt: every round copies (q one-hot), the head's state fed behind it;
    # batch 1 only (lookup is off above it), so fewer samples
    "eesd-lookup": dict(method="eesd", max_draft=3, lookup=1, lookup_draft=3),
    # the others run static batches (one program each); rows refilled as they end draw alike
    "eesd-continuous": dict(method="eesd", max_draft=3, batching="continuous", pricing="off"),
}


@pytest.fixture(scope="module")
def small_heads(small, tmp_path_factory) -> dict:
    vocab = np.arange(SV, dtype=np.int32)[2:14]
    return save_heads(tmp_path_factory.mktemp("small-heads"), small.target.cfg, small.target.params, vocab)


@pytest.fixture(scope="module")
def small_datastore(small, tmp_path_factory) -> str:
    from jspec.parts import datastore

    text = np.random.default_rng(2).integers(0, SV, (64, 64)).tolist()
    table = datastore.build([(row, 3) for row in text], min_count=1, min_share=0.01)
    meta = {"model": fingerprint(small.target.cfg)}
    return str(datastore.save(tmp_path_factory.mktemp("small-datastore") / "ds", table, meta))


@pytest.mark.parametrize("method", list(SAMPLED))
def test_sampling_matches_target_distribution(small, small_heads, small_datastore, method):
    opts = {"temperature": 1.0, "batching": "static", **SAMPLED[method]}
    if opts.get("datastore") == "small":
        opts["datastore"] = small_datastore
    if opts["method"] == "draft":
        opts["draft_model"] = small.draft
    if opts["method"] in heads.KINDS:
        opts["head"] = small_heads[opts["method"]]
    exact = (small.p1, small.p12, small.p3)
    if opts.get("top_k") or opts.get("top_p"):
        sampling = Sampling(opts["temperature"], opts.get("top_k", 0), opts.get("top_p", 1.0))
        exact = exact_marginals(small.target.cfg, small.target.params, SPROMPT, sampling)
        assert (exact[0] == 0).sum() >= SV - 6  # the filters do cut tokens
    copies_first = "lookup" in opts and opts["method"] != "ngram"  # prompt lookup in front of a drafter
    samples, rows = (LOOKUP_SAMPLES, 1) if copies_first else (SAMPLES, SAMPLE_ROWS)
    records = small.target.generate([{"token_ids": SPROMPT}] * samples, max_new_tokens=3, batch_size=rows,
                                    seed=17, **opts)
    out = np.array(ids(records))
    assert out.shape == (samples, 3)
    v = SV
    assert_sampled_from(np.bincount(out[:, 0], minlength=v), exact[0], "first token")
    assert_sampled_from(np.bincount(out[:, 0] * v + out[:, 1], minlength=v * v), exact[1], "first two tokens")
    assert_sampled_from(np.bincount(out[:, 2], minlength=v), exact[2], "third token")
    if method != "ar":
        # Drafts were proposed, and both accepted and rejected: the test exercises rejection sampling.
        drafted = sum(r["stats"]["drafted"] for r in records)
        accepted = sum(r["stats"]["accepted"] for r in records)
        assert 200 * samples / SAMPLES < accepted < 0.95 * drafted, (accepted, drafted)
    if copies_first:  # every round after the prefill copied
        assert sum(r["stats"]["lookup_rounds"] for r in records) == sum(r["stats"]["rounds"] - 1 for r in records)
    check_stats(records, opts.get("max_draft", opts.get("candidates", 0)))
