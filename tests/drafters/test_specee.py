"""SpecEE on a tiny random Llama (3 layers; an untrained Kangaroo head at layer 1 supplies the
candidates, predictors cover depths 1 and 2): with exits disabled it is `ar`; with predictors
forced to say "exit" every token leaves at the first checked depth, exactly as a plain-Python
reference decoder (explicit loops over tokens and layers, K/V kept in lists) computes it."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import all_bfloat16, in_bfloat16

from jspec.api import Model
from jspec.bench.hlo import cache_copies
from jspec.errors import JspecError
from jspec.model import decoder as jmodel
from jspec.parts import heads, predictors
from jspec.parts.folder import fingerprint

EXIT = 1
NEW = 12
THRESHOLD = 0.5
PROMPTS = [{"token_ids": [5, 17, 99, 4, 31, 8, 77]}, {"token_ids": [3, 9] * 7}, {"token_ids": [200, 1, 45]},
           {"token_ids": list(range(40, 60))}]


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """(model, head folder, predictors that never say exit, predictors that always do)."""
    model = tiny_llama.jspec_model()
    cfg, params = tiny_llama.cfg, tiny_llama.params
    root = tmp_path_factory.mktemp("specee")
    vocab = np.arange(0, cfg.vocab_size, 2, dtype=np.int32)  # a draft vocabulary of half the tokens
    head = heads.save(root / "head", heads.init(params, cfg, "kangaroo", EXIT, vocab),
                      {"kind": "kangaroo", "exit_layer": EXIT, "model": fingerprint(cfg)})
    depths = list(range(EXIT, cfg.num_layers))
    meta = {"model": fingerprint(cfg), "head": {"kind": "kangaroo", "exit_layer": EXIT},
            "depths": depths, "schedule": depths}
    pp = predictors.init(jax.random.key(0), len(depths))
    forced = {**pp, "w2": jnp.zeros_like(pp["w2"]), "b2": jnp.full_like(pp["b2"], 50.0)}
    # Exit when the head's first candidate holds more than half of the candidates' softmax: a
    # data-dependent split, far from the threshold for most tokens.
    confident = {"w1": jnp.zeros_like(pp["w1"]).at[:, 4, 0].set(1.0), "b1": jnp.zeros_like(pp["b1"]),
                 "w2": jnp.zeros_like(pp["w2"]).at[:, 0].set(40.0), "b2": jnp.full_like(pp["b2"], -20.0)}
    return (model, str(head), str(predictors.save(root / "confident", confident, meta, head)),
            str(predictors.save(root / "always", forced, {**meta, "schedule": depths[:1]}, head)))


def ids(records):
    return [r["token_ids"] for r in records]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_no_exit_is_ar(setup, batch_size):
    model, head, pred, _ = setup
    ar = ids(model.generate(PROMPTS, max_new_tokens=NEW, batch_size=batch_size))
    out = model.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=1.5,
                         max_new_tokens=NEW, batch_size=batch_size)
    assert ids(out) == ar
    for r in out:
        assert r["stats"]["mean_layers"] == model.cfg.num_layers
        assert r["stats"]["exit_layers"] == {str(model.cfg.num_layers): r["new_tokens"] - 1}


def test_sampling_without_exits_is_ar_sampling(setup):
    model, head, pred, _ = setup
    opts = dict(max_new_tokens=NEW, batch_size=4, temperature=1.0, seed=3)
    ar = ids(model.generate(PROMPTS, **opts))
    assert ids(model.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=1.5, **opts)) == ar
    for lookup in (None, 1):
        sampled = model.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=0.0,
                                 lookup=lookup, **opts)
        assert all(0 <= t < model.cfg.vocab_size for r in sampled for t in r["token_ids"])
        assert all(r["new_tokens"] == NEW or r["token_ids"][-1] in model.cfg.eos_token_ids for r in sampled)


def test_forced_exit_is_first_checked_depths_choice(setup):
    """Predictors forced to 1: every token exits at the first checked depth, with its choice."""
    model, head, _, always = setup
    out = model.generate(PROMPTS, method="specee", head=head, predictors=always, max_new_tokens=NEW, batch_size=4)
    hp, _ = heads.load(head, model.cfg)
    for prompt, r in zip(PROMPTS, out):
        assert r["token_ids"] == reference(model, hp, None, 0.5, "fill", prompt["token_ids"], len(r["token_ids"]))
        assert r["stats"]["mean_layers"] == EXIT


@pytest.mark.parametrize("kv, lookup", [("fill", None), ("mask", None), ("fill", 2)])
def test_no_cache_copy_in_the_loop(setup, kv, lookup):
    """A layer that runs only while some row is going is two conditionals with the cache write
    between them, never inside one, where XLA would copy the cache every token (docs/design.md);
    behind lookup, the copying round's verification is a one-trip loop, not a conditional."""
    model, head, pred, _ = setup
    fresh = Model(model.cfg, model.params)
    fresh.generate(PROMPTS[:1], method="specee", head=head, predictors=pred, exit_kv=kv, lookup=lookup,
                   max_new_tokens=NEW)
    ((rows, _, in_loop),) = cache_copies(fresh.cfg, fresh.programs())
    assert rows == 1 and in_loop == 0


@pytest.mark.parametrize("kv, batch_size", [("fill", 4), ("mask", 4), ("mask", 2)])
def test_exits_match_reference(setup, kv, batch_size):
    """Random predictors at a threshold where some tokens exit at depth 1, some at 2 and some
    run all 3 layers, under either KV handling, against the plain-Python decoder. The cache
    starts as garbage: reading any entry that was never written (or, under "mask", one that a
    skipped layer left) would change the tokens. At batch 2 two of the four prompts are admitted
    into rows that another prompt decoded in (continuous batching): its state must not leak."""
    model, head, pred, _ = setup
    p = 32  # the prompt bucket; the cache needs p + NEW + 1 positions, aligned to 64
    rng = np.random.default_rng(0)
    shape = (batch_size, 64, model.cfg.num_kv_heads, model.cfg.head_dim)
    junk = lambda: jnp.asarray(rng.normal(0, 1e3, shape), jnp.float32)
    model._caches[(batch_size, 64)] = jmodel.KVCache([junk() for _ in range(model.cfg.num_layers)],
                                                     [junk() for _ in range(model.cfg.num_layers)])
    out = model.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=THRESHOLD, exit_kv=kv,
                         max_new_tokens=NEW, batch_size=batch_size)
    assert p + NEW + 1 <= 64
    hp, _ = heads.load(head, model.cfg)
    pp, _ = predictors.load(pred, model.cfg)
    exits = {}
    for prompt, r in zip(PROMPTS, out):
        assert r["token_ids"] == reference(model, hp, pp, THRESHOLD, kv, prompt["token_ids"], len(r["token_ids"]))
        for d, c in r["stats"]["exit_layers"].items():
            exits[d] = exits.get(d, 0) + c
    assert set(exits) == {"1", "2", "3"}, exits


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lookup_first_without_exits_is_ar(setup, batch_size):
    """Prompt lookup in front: copying rounds verify at full depth, the others are SpecEE's; with
    exits disabled both are `ar` (at batch 1 rounds of both kinds happen)."""
    model, head, pred, _ = setup
    ar = ids(model.generate(PROMPTS, max_new_tokens=NEW, batch_size=batch_size))
    out = model.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=1.5, lookup=2,
                         max_new_tokens=NEW, batch_size=batch_size)
    assert ids(out) == ar
    if batch_size == 1:
        lookups = [r["stats"]["lookup_rounds"] for r in out]
        assert sum(lookups) > 0 and any(n < r["stats"]["rounds"] - 1 for n, r in zip(lookups, out))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_bfloat16_lookup_first_without_exits_is_ar(setup, batch_size):
    """In bfloat16 (weights only: activations and caches stay float32) the copying rounds'
    verification and SpecEE's one-token rounds still give ar's tokens."""
    model, head, pred, _ = setup
    bf16 = in_bfloat16(model)
    ar = ids(bf16.generate(PROMPTS, max_new_tokens=NEW))
    out = bf16.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=1.5, lookup=1,
                        max_new_tokens=NEW, batch_size=batch_size)
    assert ids(out) == ar
    assert batch_size > 1 or sum(r["stats"]["lookup_rounds"] for r in out) > 0


def test_lookup_first_matches_reference(setup):
    """Exits at every depth between copying rounds, against the plain-Python decoder with the
    same lookup; the cache starts as garbage, as in test_exits_match_reference."""
    model, head, pred, _ = setup
    rng = np.random.default_rng(1)
    shape = (1, 64, model.cfg.num_kv_heads, model.cfg.head_dim)
    junk = lambda: jnp.asarray(rng.normal(0, 1e3, shape), jnp.float32)
    model._caches[(1, 64)] = jmodel.KVCache([junk() for _ in range(model.cfg.num_layers)],
                                            [junk() for _ in range(model.cfg.num_layers)])
    # One-token repeats: a random model seldom repeats two tokens in a row.
    out = model.generate(PROMPTS, method="specee", head=head, predictors=pred, exit_threshold=THRESHOLD, lookup=1,
                         max_new_tokens=2 * NEW)
    hp, _ = heads.load(head, model.cfg)
    pp, _ = predictors.load(pred, model.cfg)
    for prompt, r in zip(PROMPTS, out):
        exits = {}
        assert r["token_ids"] == reference(model, hp, pp, THRESHOLD, "fill", prompt["token_ids"], len(r["token_ids"]),
                                           lookup=1, exits=exits)
        assert r["stats"]["exit_layers"] == exits  # the head's cache kept up through copying rounds
    assert all(r["stats"]["lookup_rounds"] > 0 for r in out)
    assert sum(c for r in out for d, c in r["stats"]["exit_layers"].items() if d != "3") > 0


def test_lookup_refuses_mask(setup):
    model, head, pred, _ = setup
    with pytest.raises(JspecError, match="--lookup goes with SpecEE's exit_kv='fill'"):
        model.generate(PROMPTS[:1], method="specee", head=head, predictors=pred, exit_kv="mask", lookup=2)


def test_mesh_equals_one_device(setup, tiny_llama):
    """Row masks, the per-layer conds and the K/V fill sharded over data=2, model=4; behind lookup
    too, on a model-parallel mesh at batch 1."""
    import jspec

    model, head, pred, _ = setup
    opts = dict(method="specee", head=head, predictors=pred, exit_threshold=THRESHOLD, max_new_tokens=NEW,
                batch_size=4)
    sharded = jspec.load(str(tiny_llama.path), mesh="data=2,model=4")
    assert ids(sharded.generate(PROMPTS, **opts)) == ids(model.generate(PROMPTS, **opts))
    opts.update(batch_size=1, lookup=1)
    tensor_parallel = jspec.load(str(tiny_llama.path), mesh="data=1,model=4")
    got = tensor_parallel.generate(PROMPTS, **opts)
    assert ids(got) == ids(model.generate(PROMPTS, **opts)) and sum(r["stats"]["lookup_rounds"] for r in got) > 0


def test_training_lowers_the_loss(setup, tmp_path):
    from jspec.training import train_predictors as train_predictors

    model, head, _, _ = setup
    answers = ids(model.generate(PROMPTS, max_new_tokens=NEW, batch_size=4))
    sequences = [(p["token_ids"], a) for p, a in zip(PROMPTS, answers)] * 3
    pp, meta = train_predictors.train(model, head, "kangaroo", sequences, epochs=40, progress=False)
    t = meta["training"]
    assert t["final_loss"] < t["first_loss"] and len(t["held_out"]) == len(meta["depths"]) == 2
    predictors.save(tmp_path / "p", pp, meta, head)
    assert predictors.load(tmp_path / "p", model.cfg)[1]["schedule"] == meta["schedule"]
    # Without --head, specee takes its candidates from the head saved with the predictors.
    opts = dict(method="specee", predictors=str(tmp_path / "p"), max_new_tokens=NEW, batch_size=4)
    assert ids(model.generate(PROMPTS, **opts)) == ids(model.generate(PROMPTS, head=head, **opts))


def test_wrong_model_refused(setup, make_tiny):
    _, head, pred, _ = setup
    other = make_tiny("llama", num_hidden_layers=4).jspec_model()
    with pytest.raises(JspecError, match="trained for another model"):
        other.generate(PROMPTS[:1], method="specee", predictors=pred, head=head, max_new_tokens=2)


def test_options_checked(setup):
    model, head, pred, _ = setup
    with pytest.raises(JspecError, match="exit-threshold"):
        model.generate(PROMPTS[:1], method="specee", head=head, predictors=pred, exit_threshold=-1)
    with pytest.raises(JspecError, match="--predictors does not go with --method ar"):
        model.generate(PROMPTS[:1], method="ar", predictors=pred)
    with pytest.raises(JspecError, match="is not a jspec set of SpecEE predictors .no predictors.json."):
        model.generate(PROMPTS[:1], method="specee", head=head, predictors=head)
    cfg = model.cfg
    params = heads.init(model.params, cfg, "eesd", EXIT, np.arange(8, dtype=np.int32))
    eesd = heads.save(Path(head).parent / "eesd-head", params,
                      {"kind": "eesd", "exit_layer": EXIT, "model": fingerprint(cfg)})
    with pytest.raises(JspecError, match="were trained over a head of kind kangaroo: give --head one of that kind"):
        model.generate(PROMPTS[:1], method="specee", head=str(eesd), predictors=pred)


def test_cli_warns_and_checks(capsys):
    from jspec.cli import main

    assert main(["generate", "hi", "--method", "specee", "--exit-threshold", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--exit-threshold must be a number >= 0" in err and "Traceback" not in err
    assert main(["generate", "hi", "--method", "ar", "--exit-threshold", "0.5", "--max-new-tokens", "0"]) == 2
    assert main(["generate", "hi", "--method", "specee", "--mesh", "data=999"]) == 2  # fails after the checks
    assert "jspec: warning: --method specee is lossy" in capsys.readouterr().err


# -- the reference: one token at a time, every layer by hand ------------------------------------

def reference(model, hp, pp, threshold, kv_mode, prompt, count, lookup=None, exits=None):
    """Greedy SpecEE, batch 1, every depth from EXIT checked; pp None: every token exits at EXIT.
    With `lookup` = n, a position whose last n to 3 tokens occurred before instead verifies what
    followed their most recent occurrence (up to 4 tokens) at full depth, as plain greedy
    speculative decoding does. `exits`, if given, gets the tokens decoded per depth ("L": none)."""
    cfg, params = model.cfg, jax.tree.map(np.asarray, model.params)
    hp = jax.tree.map(np.asarray, hp)
    pp = None if pp is None else jax.tree.map(np.asarray, pp)
    layers = params["layers"]
    kv = [([], []) for _ in range(cfg.num_layers)]
    head_kv = ([], [])
    lm = np.asarray(jmodel.head_weight(params), np.float32)
    out = []
    for pos, token in enumerate(prompt):  # the prefill: full depth, the head's K/V at depth EXIT
        h = _run(cfg, layers, params["embed"][token], pos, kv, range(EXIT))
        _kv(cfg, hp["layers"][0], h, pos, *head_kv)
        h = _run(cfg, layers, h, pos, kv, range(EXIT, cfg.num_layers))
    tok = int(np.argmax(lm @ _norm(h, params["final_norm"], cfg)))
    pos = len(prompt)
    while len(out) < count - 1:
        out.append(tok)
        copied = _repeat(prompt + out, lookup) if lookup else []
        if copied:  # verify [tok, copied...] at full depth; keep the matching prefix, then the target's token
            choices = []
            for i, t in enumerate([tok] + copied):
                h = _run(cfg, layers, params["embed"][t], pos + i, kv, range(EXIT))
                _kv(cfg, hp["layers"][0], h, pos + i, *head_kv)
                h = _run(cfg, layers, h, pos + i, kv, range(EXIT, cfg.num_layers))
                choices.append(int(np.argmax(lm @ _norm(h, params["final_norm"], cfg))))
            n = 0
            while n < len(copied) and copied[n] == choices[n]:
                n += 1
            for ks, vs in [*kv, head_kv]:  # entries past the kept tokens are stale
                del ks[pos + n + 1:], vs[pos + n + 1:]
            out += copied[:n]
            tok, pos = choices[n], pos + n + 1
            continue
        h = _run(cfg, layers, params["embed"][tok], pos, kv, range(EXIT))
        x = _attend(cfg, hp["layers"][0], h, pos, *head_kv)
        sub = lm[hp["vocab"]] @ _norm(x, hp["norm"], cfg)
        cands = hp["vocab"][np.argsort(-sub, kind="stable")[:4]]
        prev, exited, depth = np.zeros(4), False, cfg.num_layers
        for d in range(EXIT, cfg.num_layers):
            if not exited:
                logits = lm[cands] @ _norm(h, params["final_norm"], cfg)
                probs = np.exp(logits - logits.max())
                probs /= probs.sum()
                x, prev = np.concatenate([logits, probs, probs - prev]), probs
                j = d - EXIT
                score = 1.0 if pp is None else 1 / (1 + np.exp(-(np.maximum(x @ pp["w1"][j] + pp["b1"][j], 0)
                                                                 @ pp["w2"][j] + pp["b2"][j])))
                if score > threshold:
                    exited, tok, depth = True, int(cands[np.argmax(logits)]), d
            if not exited:
                h = _run(cfg, layers, h, pos, kv, [d])
            elif kv_mode == "fill":  # the deeper layer's K/V of the exit state; "mask": nothing
                _kv(cfg, layers[d], h, pos, *kv[d])
        if not exited:
            tok = int(np.argmax(lm @ _norm(h, params["final_norm"], cfg)))
        if exits is not None:
            exits[str(depth)] = exits.get(str(depth), 0) + 1
        pos += 1
    return (out + [tok])[:count]


def _repeat(seq, shortest, longest=3, most=4):
    """What followed the most recent earlier occurrence of seq's last n tokens, for the longest n
    from shortest to longest that occurs; [] if none does."""
    end, best = len(seq) - 1, None
    for n in range(shortest, longest + 1):
        hits = [p for p in range(n - 1, end) if seq[p - n + 1:p + 1] == seq[end - n + 1:end + 1]]
        if hits:
            best = hits[-1]
    return [] if best is None else seq[best + 1:best + 1 + min(end - best, most)]


def _norm(x, w, cfg):
    return w * (x / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps))


def _rope(cfg, x, pos):
    cos, sin = (np.asarray(a)[0, 0] for a in jmodel.rope(cfg, jnp.array([[pos]])))
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _kv(cfg, lp, h, pos, ks, vs):
    """Append this position's K and V [K, H]; return the queries [K, G, H]."""
    g = cfg.group_size
    qkv = (lp["wqkv"] @ _norm(h, lp["attn_norm"], cfg)).reshape(cfg.num_kv_heads, g + 2, cfg.head_dim)
    ks.append(_rope(cfg, qkv[:, g], pos))
    vs.append(qkv[:, g + 1])
    return _rope(cfg, qkv[:, :g], pos)


def _attend(cfg, lp, h, pos, ks, vs):
    q = _kv(cfg, lp, h, pos, ks, vs)
    k, v = np.stack(ks), np.stack(vs)  # [P, K, H]
    scores = np.einsum("kgh,pkh->kgp", q, k) / np.sqrt(cfg.head_dim)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return h + lp["wo"] @ np.einsum("kgp,pkh->kgh", w, v).reshape(-1)


def _run(cfg, layers, h, pos, kv, which):
    for i in which:
        h = _attend(cfg, layers[i], h, pos, *kv[i])
        gate_up = layers[i]["w_gate_up"] @ _norm(h, layers[i]["mlp_norm"], cfg)
        gate, up = gate_up[0::2], gate_up[1::2]  # interleaved (jspec.model.layout.gate_up)
        h = h + layers[i]["w_down"] @ (gate / (1 + np.exp(-gate)) * up)
    return h


def test_bfloat16_activations_and_cache_run(setup):
    """SpecEE with weights, activations and cache in bfloat16, exits taken: every row decodes."""
    model, head, pred, _ = setup
    out = all_bfloat16(model).generate(PROMPTS, method="specee", head=head, predictors=pred,
                                       exit_threshold=THRESHOLD, max_new_tokens=NEW, batch_size=4)
    assert [r["new_tokens"] for r in out] == [NEW] * len(PROMPTS)
    assert {r["numerics"]["activation_dtype"] for r in out} == {"bfloat16"}
