"""MJSD: beam drafts accepted by joint likelihood (jspec.drafters.beam, jspec.engine.acceptance.joint).

Lossy, so no test compares it with `ar`. Instead: the rule on hand-computed numbers; W = 1 with
tau near 0 accepting every draft; with the target as its own drafter and beams wide enough, the
output of exact multi-token joint greedy decoding (MJGD, by enumeration on a 16-token vocabulary);
batch rows equal to their batch-1 runs; and beams that never read each other's draft entries.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_bfloat16, hf_logits, on_mesh

from jspec import batching, methods
from jspec.api import Model
from jspec.controllers import make_controller
from jspec.drafters.beam import Beam, beam_step, empty_entries
from jspec.drafters.early_exit import EarlyExit
from jspec.engine import acceptance, loop
from jspec.engine.sampling import Sampling
from jspec.errors import JspecError
from jspec.model.decoder import KVCache
from jspec.parts import heads
from jspec.parts.folder import fingerprint

PROMPTS = [{"token_ids": [5, 9, 3, 7, 1, 4]}, {"token_ids": [11, 2, 8]}, {"token_ids": [6, 6, 13, 0, 9, 12, 3, 1, 2]}]


# -- the acceptance rule -------------------------------------------------------------------------

def _rule_case():
    """Three rows, K = 3, V = 4, target log-probs set exactly. Row 0: r = 0, log(.1/.4), then
    log(.1/.4) + log(.9/.2) = +0.118, so d = 3 passes after d = 2 fails. Row 1: r_1 = log(.1/.9)
    fails and so does every longer prefix. Row 2: row 0 with only 2 drafted tokens."""
    p = np.full((3, 4, 4), 0.1 / 3, np.float32)
    draft = np.array([[0, 1, 2], [0, 1, 2], [0, 1, 2]], np.int32)
    p_draft = np.array([[0.5, 0.1, 0.9], [0.1, 0.5, 0.5], [0.5, 0.1, 0.9]], np.float32)
    q_draft = np.array([[0.5, 0.4, 0.2], [0.9, 0.5, 0.5], [0.5, 0.4, 0.2]], np.float32)
    for b in range(3):
        for t in range(3):
            p[b, t] = (1 - p_draft[b, t]) / 3
            p[b, t, draft[b, t]] = p_draft[b, t]
    # The target's own next token: 3 after the full draft of row 0, 2 at the start of row 1 (one-hot,
    # so a sample equals the argmax), 3 after one token of row 2 (p(x_2) stays 0.1 there).
    for b, pos, tok in ((0, 3, 3), (1, 0, 2)):
        p[b, pos] = 0.0
        p[b, pos, tok] = 1.0
    p[2, 1] = [0.15, 0.1, 0.15, 0.6]
    logits = jnp.log(jnp.maximum(jnp.asarray(p), 1e-30))
    return jnp.asarray(draft), jnp.log(jnp.asarray(q_draft)), jnp.array([3, 3, 2]), logits


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)], ids=["greedy", "sampling"])
def test_joint_rule_by_hand(sampling):
    draft, logq, n, logits = _rule_case()
    n_acc, nxt = acceptance.joint(draft, logq, n, logits, sampling, math.log(0.5), jax.random.key(0))
    assert n_acc.tolist() == [3, 0, 1]
    assert nxt.tolist()[:2] == [3, 2]
    if sampling.greedy:
        assert nxt.tolist()[2] == 3
    # tau above every r_d's exp rejects all; tau near 0 accepts every drafted token.
    assert acceptance.joint(draft, logq, n, logits, sampling, math.log(2.0), jax.random.key(0))[0].tolist() == [0, 0, 0]
    assert acceptance.joint(draft, logq, n, logits, sampling, -1e9, jax.random.key(0))[0].tolist() == [3, 3, 2]


def test_tree_rule_by_hand():
    """W = 2 beams, K = 2; p is the target's probability of each beam token, best the drafter's best
    beam score after each step, tau = 0.5. Row 0: beam 0 passes d = 1 only (.5/.6), beam 1 passes
    d = 2 (.35 * .6 / .4 = .525): keep 2 tokens of beam 1. Row 1: nothing passes. Row 2: both pass
    d = 1 only: the likelier (beam 1, .45). Row 3: beam 0 fails d = 1 (.35/.8) and passes d = 2
    (.315/.3): keep 2, as the chain rule keeps a longer prefix after a shorter one fails."""
    p = np.array([[[.5, .1], [.35, .6]], [[.3, .9], [.2, .5]], [[.4, .1], [.45, .1]], [[.35, .9], [.1, .1]]])
    best = np.array([[.6, .4], [.9, .8], [.5, .5], [.8, .3]])
    logp, log_best = jnp.log(jnp.asarray(p, jnp.float32)), jnp.log(jnp.asarray(best, jnp.float32))
    pick, kept = acceptance.tree_joint(logp, log_best, math.log(0.5))
    assert kept.tolist() == [2, 0, 1, 2]
    assert pick.tolist() == [1, 0, 1, 0]
    # Against the drafter's best, not the beam's own q: tau near 0 keeps all K of the likeliest beam.
    pick, kept = acceptance.tree_joint(logp, log_best, -1e9)
    assert kept.tolist() == [2, 2, 2, 2] and pick.tolist() == [1, 0, 1, 0]


# -- end to end on tiny models -------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-layer random Llama over 16 tokens, no EOS: (Model, its HF twin)."""
    from conftest import save_source, tiny_hf_model

    from jspec.convert import store

    hf = tiny_hf_model("llama", seed=3, vocab_size=16, num_hidden_layers=2)
    root = tmp_path_factory.mktemp("mjsd-small")
    cfg, params, _ = store.load(store.convert(save_source(hf, root / "source", "safetensors"), root / "converted"))
    return Model(dataclasses.replace(cfg, eos_token_ids=()), params, name="small"), hf


def _ids(records):
    return [r["token_ids"] for r in records]


def _with_plan(monkeypatch, model, plan, prompts, **options):
    """Generate with a hand-built (drafter, dparams, controller), e.g. one build() refuses."""
    monkeypatch.setattr(methods, "build", lambda *a, **k: plan)
    return model.generate(prompts, method="mjsd", **options)


def mjgd(hf, prompt, k: int, new: int, vocab: int) -> list[int]:
    """Exact multi-token joint greedy decoding laid out as MJSD's rounds: the first token greedy
    (the prefill's), then per round the k tokens of highest joint probability (all vocab^k
    enumerated) followed by the target's greedy token after them."""
    seq, out = list(prompt), []
    cands = np.array(list(itertools.product(range(vocab), repeat=k)), np.int64)  # [V^k, k]
    out.append(int(hf_logits(hf, np.array([seq]))[0, -1].argmax()))
    seq.append(out[-1])
    while len(out) < new:
        batch = np.concatenate([np.tile(seq, (len(cands), 1)), cands], axis=1)
        logp = jax.nn.log_softmax(jnp.asarray(hf_logits(hf, batch)), axis=-1)
        n = len(seq)
        joint = sum(logp[np.arange(len(cands)), n - 1 + t, cands[:, t]] for t in range(k))
        best = int(jnp.argmax(joint))
        step = cands[best].tolist() + [int(jnp.argmax(logp[best, -1]))]
        out += step
        seq += step
    return out[:new]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_target_as_drafter_is_mjgd(small, monkeypatch, tree):
    model, hf = small
    k, new = 2, 10
    # The target as its own drafter: every layer is "shallow", and W = V keeps every 1-token
    # prefix, so the best of W x V 2-token beams is the exact joint argmax; verified as a tree, that
    # beam's joint log p is the drafter's best score, so it passes and is the likeliest kept.
    drafter = Beam(EarlyExit(max_draft=k, exit_layer=model.cfg.num_layers), width=16, threshold=0.5, tree=tree)
    records = _with_plan(monkeypatch, model, (drafter, drafter.params(()), make_controller("fixed")), PROMPTS,
                         max_new_tokens=new, batch_size=1)
    for p, r in zip(PROMPTS, records):
        assert r["token_ids"] == mjgd(hf, p["token_ids"], k, new, 16)
        assert r["stats"]["accepted"] == r["stats"]["drafted"]  # r_d is ~0: every draft passes


# Sampled: no top-k or top-p, which could give a drafted token p = 0 (r_d = -inf).
@pytest.mark.parametrize("sampling", [dict(), pytest.param(dict(temperature=1.0), marks=pytest.mark.slow)],
                         ids=["greedy", "sampling"])
def test_one_beam_tiny_tau_accepts_every_draft(small, sampling):
    model, _ = small
    records = model.generate(PROMPTS, method="mjsd", max_new_tokens=12, max_draft=3, exit_layer=1,
                             beam_width=1, accept_threshold=1e-300, **sampling)
    for r in records:
        assert r["new_tokens"] == 12 and r["stats"]["drafted"] > 0
        assert r["stats"]["accepted"] == r["stats"]["drafted"]


@pytest.fixture(scope="module")
def head_path(small, tmp_path_factory):
    model, _ = small
    vocab = np.arange(1, 16, dtype=np.int32)  # token 0 can never be drafted
    meta = {"kind": "eesd", "exit_layer": 1, "model": fingerprint(model.cfg)}
    return str(heads.save(tmp_path_factory.mktemp("mjsd-head") / "eesd",
                          heads.init(model.params, model.cfg, "eesd", 1, vocab), meta))


@pytest.fixture(scope="module")
def eagle_path(small, tmp_path_factory):
    model, _ = small
    layers = model.cfg.num_layers
    meta = {"kind": "eagle", "exit_layer": layers, "model": fingerprint(model.cfg)}
    hp = heads.init(model.params, model.cfg, "eagle", layers, np.arange(1, 16, dtype=np.int32))
    # The fuse starts as state + embedding; a random one makes the beams' states matter.
    hp["fuse"] = jax.random.normal(jax.random.key(5), hp["fuse"].shape) * 0.5
    return str(heads.save(tmp_path_factory.mktemp("mjsd-eagle") / "eagle", hp, meta))


def _drafter_options(model, head_path, eagle_path, drafter):
    if drafter in ("head", "eagle"):
        return dict(head=head_path if drafter == "head" else eagle_path)
    if drafter == "exit":
        return dict(exit_layer=1)
    dcfg = dataclasses.replace(model.cfg, num_layers=1)
    return dict(draft_model=Model(dcfg, {**model.params, "layers": model.params["layers"][:1]}, name="d"))


@pytest.mark.parametrize("drafter,tree", [("head", False), ("eagle", False), ("exit", True),
                                          pytest.param("draft-model", False, marks=pytest.mark.slow),
                                          pytest.param("draft-model", True, marks=pytest.mark.slow)])
def test_batch_rows_equal_batch_one(small, head_path, eagle_path, drafter, tree):
    model, _ = small
    opts = dict(_drafter_options(model, head_path, eagle_path, drafter), tree=tree)
    run = lambda b, batching: model.generate(PROMPTS, method="mjsd", max_new_tokens=16, batch_size=b,  # noqa: E731
                                             batching=batching, **opts)
    # in one static batch of three; at batch 2 (continuous) the third prompt is admitted mid-run
    one, three, two = run(1, "static"), run(3, "static"), run(2, "continuous")
    assert _ids(one) == _ids(three) == _ids(two)
    drop = lambda r: {k: v for k, v in r["stats"].items() if k != "batch_rounds"}  # noqa: E731
    assert [drop(r) for r in one] == [drop(r) for r in three] == [drop(r) for r in two]
    assert any(0 < r["stats"]["accepted"] < r["stats"]["drafted"] for r in one)  # partial accepts happen


@pytest.mark.parametrize("kind,tree", [("eesd", False), pytest.param("eagle", False, marks=pytest.mark.slow),
                                       ("eesd", True)])
def test_mesh_equals_one_device(small, head_path, eagle_path, kind, tree):
    """Beams of the head on a data=2, model=4 mesh at batch 3 and a model-parallel one at batch 1
    (the prefix attention through the kernel, the beams' entries reordered across shards; with
    `tree` every beam through the whole target)."""
    model, _ = small
    opts = dict(method="mjsd", head=head_path if kind == "eesd" else eagle_path, max_new_tokens=16, tree=tree)
    for mesh, batch in (("data=2,model=4", 3), ("data=1,model=4", 1)):
        sharded = on_mesh(model, mesh)
        assert _ids(sharded.generate(PROMPTS, batch_size=batch, batching="static", **opts)) == \
            _ids(model.generate(PROMPTS, **opts))


@pytest.mark.parametrize("kind", ["eesd", "eagle"])
def test_beams_never_read_each_others_entries(small, head_path, eagle_path, kind):
    model, _ = small
    cfg, w, k, j = model.cfg, 4, 4, 2
    path = head_path if kind == "eesd" else eagle_path
    drafter, dparams, _ = methods.build("mjsd", model, head=path, beam_width=w, max_draft=k)
    tokens, lens = map(jnp.asarray, batching.prompt_rows([PROMPTS[0]["token_ids"]], 32))
    prefill = jax.jit(lambda p, d, c: loop.prefill(drafter, p, d, cfg, tokens, lens, c, (8,)))
    _, cache, dstate = prefill(model.params, dparams, KVCache.zeros(cfg, 1, 32))
    stack = drafter.inner.beam_stack(model.params, dparams.inner, cfg, cache, dstate.inner)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    entries = [tuple(jax.random.normal(next(keys), x.shape) for x in kv) for kv in empty_entries(stack, 1, w, k)]
    x = jnp.array([[3, 4, 5, 6]], jnp.int32)
    prev = jax.random.normal(next(keys), (1, w, cfg.hidden_size))
    step = jax.jit(lambda e, prev: beam_step(stack, x, lens, j, e, prev)[0])
    base = np.asarray(step(entries, prev))
    # Beam 1's entries, every slot, every layer (and an EAGLE head's state of beam 1): only beam
    # 1's logits may move.
    moved = [np.asarray(step([tuple(e.at[:, 1].add(5.0) for e in kv) for kv in entries], prev))]
    if kind == "eagle":
        moved.append(np.asarray(step(entries, prev.at[:, 1].add(5.0))))
    for m in moved:
        np.testing.assert_array_equal(m[:, [0, 2, 3]], base[:, [0, 2, 3]])
        assert not np.allclose(m[:, 1], base[:, 1])


def test_tree_never_reads_another_beams_tokens(small):
    """The whole target over a tree of W = 3 beams: changing beam 1's tokens moves beam 1's states
    and entries only; and each beam's states are what a plain forward over [last, that beam] gives."""
    from jspec.drafters.beam import spread, tree_forward
    from jspec.model import decoder as jmodel

    model, _ = small
    cfg = model.cfg
    prompt = jnp.array([PROMPTS[0]["token_ids"]], jnp.int32)
    _, cache = jax.jit(lambda p, c: jmodel.forward(p, cfg, prompt, None, c))(model.params, KVCache.zeros(cfg, 1, 32))
    length, last = jnp.array([prompt.shape[1]]), jnp.array([2])
    tokens = jnp.array([[[3, 4, 5], [6, 7, 8], [9, 10, 11]]], jnp.int32)
    run = jax.jit(lambda t: jax.tree.map(lambda x: spread(x, 3), tree_forward(model.params, cfg, last, t, length, cache)[:2]))
    (h, kv), (h2, kv2) = run(tokens), run(tokens.at[0, 1].set(jnp.array([12, 13, 14])))
    for a, b in [(h, h2)] + [x for pair in zip(kv, kv2) for x in zip(*pair)]:
        np.testing.assert_array_equal(np.asarray(a)[:, [0, 2]], np.asarray(b)[:, [0, 2]])
        assert not np.allclose(np.asarray(a)[:, 1, 1:], np.asarray(b)[:, 1, 1:])
    chain = jax.jit(lambda p, t, c: jmodel.forward(p, cfg, t, length[:, None] + jnp.arange(4)[None], c)[0])
    for w in range(3):
        fed = jnp.concatenate([last[:, None], tokens[:, w]], axis=1)
        np.testing.assert_allclose(np.asarray(h[:, w]), np.asarray(chain(model.params, fed, cache)), atol=2e-5)


@pytest.mark.parametrize("drafter,sampling",
                         [("head", {}), ("eagle", {}), ("exit", {}), ("exit", {"temperature": 1.0})],
                         ids=["head", "eagle", "exit", "exit-sampling"])
def test_a_tree_of_one_beam_is_the_chain(small, head_path, eagle_path, drafter, sampling):
    """W = 1: the tree is the one beam, so verifying it in the drafter leaves what the loop's own
    verification does: the same tokens and acceptance (sampled: the same draws, from the same keys)."""
    model, _ = small
    opts = dict(_drafter_options(model, head_path, eagle_path, drafter), method="mjsd", beam_width=1,
                max_new_tokens=16, **sampling)
    chain, tree = model.generate(PROMPTS, **opts), model.generate(PROMPTS, tree=True, **opts)
    assert _ids(chain) == _ids(tree)
    assert [r["stats"] for r in chain] == [r["stats"] for r in tree]


@pytest.mark.parametrize("kind", [pytest.param("eesd", marks=pytest.mark.slow), "eagle"])  # eesd: 40 s here
def test_one_beam_drafts_and_caches_like_the_token_by_token_drafter(small, head_path, eagle_path, kind):
    """W = 1 beam search is greedy drafting: the same tokens, and the same cache, layer-N states
    and head entries left behind for verification (over an EAGLE head, each token fused with the
    head's state for the token before it)."""
    import types

    model, _ = small
    cfg, k = model.cfg, 3
    path = head_path if kind == "eesd" else eagle_path
    beam, dparams, ctrl = methods.build("mjsd", model, head=path, beam_width=1, max_draft=k)
    tokens, lens = map(jnp.asarray, batching.prompt_rows([PROMPTS[0]["token_ids"][:6], PROMPTS[2]["token_ids"][:5]], 32))

    def draft(params, dparams, cache, use_beam):
        drafter = beam if use_beam else beam.inner
        dparams = dparams if use_beam else dparams.inner
        _, cache, dstate = loop.prefill(drafter, params, dparams, cfg, tokens, lens, cache, (8,))
        s = types.SimpleNamespace(cache=cache, dstate=dstate, last=jnp.array([7, 1]), length=lens,
                                  done=jnp.zeros(2, bool), cstate=ctrl.init(2, k), budget=jnp.asarray(k))
        return drafter.draft(params, dparams, cfg, s, ctrl, Sampling(), jax.random.key(0))

    draft = jax.jit(draft, static_argnums=3)
    want, got = (draft(model.params, dparams, KVCache.zeros(cfg, 2, 32), b) for b in (False, True))
    assert got.tokens.tolist() == want.tokens.tolist() and got.n.tolist() == want.n.tolist() == [k, k]
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    if kind == "eesd":
        close(got.dstate.inner.hidden, want.dstate.hidden)
        for i in range(cfg.num_layers):  # the prompts and this round's entries, up to position 6 + k
            close(got.cache.k[i][:, :7 + k], want.cache.k[i][:, :7 + k])
            close(got.cache.v[i][:, :7 + k], want.cache.v[i][:, :7 + k])
    else:
        assert len(set(got.tokens[0].tolist())) > 1  # the drafts vary: the fed-back states are read
    for name in ("k", "v"):  # each head layer's entries
        for g, w in zip(getattr(got.dstate.inner.head, name), getattr(want.dstate.head, name), strict=True):
            close(g[:, :7 + k], w[:, :7 + k])
    assert np.all(np.isfinite(np.asarray(got.logq))) and np.all(np.asarray(got.logq) <= 0)


def test_options_checked(small):
    model, _ = small
    with pytest.raises(JspecError, match="--beam-width"):
        methods.build("mjsd", model, beam_width=0)
    with pytest.raises(JspecError, match="--accept-threshold"):
        methods.build("mjsd", model, accept_threshold=0.0)
    with pytest.raises(JspecError, match="--beam-width does not go with --method eesd; it goes with --method mjsd"):
        methods.build("eesd", model, beam_width=2)
    with pytest.raises(JspecError, match="--tree does not go with --method eagle; it goes with --method mjsd"):
        methods.build("eagle", model, tree=True)
    with pytest.raises(JspecError, match="tree takes true or false"):
        methods.build("mjsd", model, tree="yes")
    with pytest.raises(JspecError, match="no --controller"):
        methods.build("mjsd", model, controller="confidence")
    layers = model.cfg.num_layers
    with pytest.raises(JspecError, match=f"between 1 and {layers} for --method mjsd"):
        methods.build("mjsd", model, exit_layer=layers + 1)
    assert "mjsd" in methods.LOSSY and "mjsd" not in methods.LOSSLESS


# -- command line --------------------------------------------------------------------------------

def test_cli_warns_that_mjsd_is_lossy(capsys, tmp_path):
    from jspec.cli import main

    code = main(["generate", "hi", "--model", str(tmp_path / "missing"), "--method", "mjsd", "--beam-width", "2"])
    err = capsys.readouterr().err.splitlines()
    assert code != 0
    assert err[0] == "jspec: warning: --method mjsd is lossy: its output differs from ar's (docs/methods.md measures the cost)"
    assert len(err) == 2 and err[1].startswith("jspec: error:")


@pytest.mark.slow
def test_cli_default_model(capsys, default_model, tmp_path):
    """The shipped EESD head drafts on the default model, beam sampling from the command line; the
    record counts its accepted tokens."""
    from jspec.cli import main

    prompts, output = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text('{"prompt": "Name three primes."}\n')
    code = main(["generate", "--prompts", str(prompts), "--output", str(output), "--method", "mjsd",
                 "--max-new-tokens", "24", "--beam-width", "2", "--accept-threshold", "0.3",
                 "--temperature", "0.8", "--top-p", "0.9"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "lossy" in err
    [r] = [json.loads(line) for line in output.read_text().splitlines()]
    assert r["text"].strip() and r["stats"]["mean_accepted_tokens"] >= 1.0 and r["stats"]["drafted"] > 0


def test_bfloat16_activations_and_cache_run(small):
    """MJSD's tree of beams with weights, activations and cache in bfloat16: every row decodes,
    drafts accepted."""
    model, _ = small
    records = all_bfloat16(model).generate(PROMPTS, method="mjsd", max_new_tokens=12, max_draft=3, exit_layer=1,
                                           tree=True, batch_size=2)
    assert [r["new_tokens"] for r in records] == [12] * len(PROMPTS)
    assert sum(r["stats"]["accepted"] for r in records) > 0
