"""What the methods' tests share: tiny random models, prompts, the stats every record must
satisfy, and exact sampling distributions with a goodness-of-fit check."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import save_source, tiny_hf_model
from scipy import stats

from jspec.convert import store
from jspec.engine.sampling import Sampling, probabilities
from jspec.model import decoder as jmodel

LENGTHS = (3, 30, 12, 21)  # very different, all in the 32-token prompt bucket (one compile per batch size)
DAMP = 0.3


def ids(records):
    return [r["token_ids"] for r in records]


def convert_tiny(tmp_path_factory, name: str, seed: int, **overrides):
    """conftest's tiny random HF Llama, saved and converted like a real checkpoint: (hf, cfg, params)."""
    hf = tiny_hf_model("llama", seed=seed, **overrides)
    root = tmp_path_factory.mktemp(name)
    cfg, params, _ = store.load(store.convert(save_source(hf, root / "source", "safetensors"), root / "converted"))
    return hf, cfg, params


def damped(params, layers, factor):
    """Scale the attention and MLP outputs of `layers`: the residual stream then changes less there."""
    out = [dict(lp) for lp in params["layers"]]
    for i in layers:
        out[i]["wo"] = out[i]["wo"] * factor
        out[i]["w_down"] = out[i]["w_down"] * factor
    return {**params, "layers": out}


def repetitive_prompts(lengths, vocab, seed):
    """Prompts made of a short random motif repeated, with a few tokens changed."""
    rng = np.random.default_rng(seed)
    prompts = []
    for n in lengths:
        motif = rng.integers(0, vocab, rng.integers(3, 7))
        ids_ = np.resize(motif, n)
        flip = rng.random(n) < 0.15
        ids_[flip] = rng.integers(0, vocab, flip.sum())
        prompts.append({"token_ids": ids_.tolist()})
    return prompts


def check_stats(records, k: int, fixed_model_drafter: bool = False):
    """Invariants of the counters: every round emits 1..accepted+1 tokens, at most k drafted per
    round after the prefill, accepted <= drafted; a model drafter under `fixed` drafts k."""
    for r in records:
        s, n = r["stats"], r["new_tokens"]
        assert s["mean_accepted_tokens"] == pytest.approx(n / s["rounds"], abs=1e-4)
        assert s["rounds"] * s["mean_accepted_tokens"] == pytest.approx(n, rel=1e-3)
        assert 0 <= s["accepted"] <= s["drafted"] <= k * (s["rounds"] - 1)
        assert s["rounds"] <= n <= s["rounds"] + s["accepted"]
        if s["drafted"]:
            assert 0.0 <= s["acceptance_rate"] <= 1.0
            assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-4)
        else:
            assert s["acceptance_rate"] is None
        if fixed_model_drafter:
            assert s["drafted"] == k * (s["rounds"] - 1)


SV = 16  # vocab of the sampling model: small enough to enumerate two tokens exactly
SAMPLES = 4096
SAMPLE_ROWS = 1024  # rows per batch: every row draws its own tokens
# Every token twice, in the same shuffled order: n-gram lookup always finds the newest token
# earlier in the text and proposes what followed it.
SPROMPT = np.random.default_rng(2).permutation(SV).tolist() * 2


def exact_marginals(cfg, params, prompt, sampling: Sampling):
    """Enumerate every continuation prompt + [a, b]: the exact distributions of the first token,
    the first two, and the third, from jspec.model.forward and the sampling filters."""
    v, p = cfg.vocab_size, len(prompt)
    pairs = np.array([[a, b] for a in range(v) for b in range(v)], np.int32)
    tokens = np.concatenate([np.tile(np.asarray(prompt, np.int32), (v * v, 1)), pairs], axis=1)
    cache = jmodel.KVCache.zeros(cfg, v * v, p + 2)
    positions = jnp.broadcast_to(jnp.arange(p + 2, dtype=jnp.int32), tokens.shape)
    h, _ = jmodel.forward(params, cfg, jnp.asarray(tokens), positions, cache)
    probs = np.asarray(probabilities(jmodel.logits(params, cfg, h), sampling), np.float64)
    p1 = probs[0, p - 1]
    p2 = probs[::v, p].reshape(v, v)  # row a: after prompt + [a]
    p12 = p1[:, None] * p2
    p3 = (p12.reshape(-1, 1) * probs[:, p + 1]).sum(0)
    return p1, p12, p3


def assert_sampled_from(counts, probs, what):
    """Chi-square goodness of fit (cells expecting fewer than 5 draws pooled); deterministic
    (seeded), so the threshold is about power, not flakiness."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    assert counts[probs < 1e-12].sum() == 0, f"{what}: drew a token of probability 0"
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # too little pooled mass to stand alone: fold it into the largest cell
        top = np.argmax(exp[:-1])
        obs[top], exp[top] = obs[top] + obs[-1], exp[top] + exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert pvalue > 1e-3, f"{what}: chi-square p = {pvalue:.2e}\nobserved {obs}\nexpected {np.round(exp, 1)}"
    return pvalue
