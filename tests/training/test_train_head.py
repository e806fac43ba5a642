"""Draft heads: self-distillation data, training (loss goes down, checkpoints, resume), saving and
loading (bit-identical, wrong models refused), the eesd / kangaroo methods on the default model.

Losslessness of eesd and kangaroo on tiny models (greedy at batch 1 and 4, and sampling) is in
test_spec.py with the other drafters.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_NEW

from jspec.api import Model
from jspec.cli import main
from jspec.convert import store
from jspec.errors import JspecError
from jspec.model import decoder as M
from jspec.parts import heads
from jspec.parts.folder import fingerprint
from jspec.training import distill, head_data, teacher_forced, train_head as train

NEW = 12


@pytest.fixture(scope="module")
def lm(tiny_llama) -> Model:
    return tiny_llama.jspec_model(eos_token_ids=())


def token_prompts(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": i, "token_ids": rng.integers(3, vocab, rng.integers(4, 20)).tolist()} for i in range(n)]


def make_data(lm, folder, count=24, **kw):
    opts = dict(count=count, max_prompt_tokens=24, max_new_tokens=NEW, top_k=8, shard_size=8, batch_size=8,
                progress=False)
    return distill.make(lm, token_prompts(40, lm.cfg.vocab_size), folder, **{**opts, **kw})


def perturbed(hp: dict, scale: float) -> dict:
    """Head parameters with seeded noise of `scale` on every float array (the vocabulary kept)."""
    return jax.tree.map(lambda x: x + scale * np.random.default_rng(0).standard_normal(x.shape).astype(x.dtype)
                        if x.dtype != np.int32 else x, hp)


@pytest.fixture(scope="module")
def data(lm, tmp_path_factory):
    return make_data(lm, tmp_path_factory.mktemp("distill") / "data")


RECIPE = train.Recipe(kind="eesd", exit_layer=1, steps=30, batch_size=4, lr=3e-3, warmup=3, draft_vocab=128,
                      eval_fraction=0.2, save_every=10)


def test_distill_data_is_the_models_own_greedy_answer(lm, data):
    meta, d = distill.load(data)
    assert meta["count"] == 24 and len(d["tokens"]) == 24
    assert d["top_ids"].shape == (24, NEW, 8) and d["top_logp"].shape == (24, NEW, 8)
    assert (np.diff(d["top_logp"], axis=-1) <= 0).all() and (np.exp(d["top_logp"]).sum(-1) <= 1 + 1e-5).all()
    prompts = {tuple(p["token_ids"]) for p in token_prompts(40, lm.cfg.vocab_size)}
    for row, p, a, top in zip(d["tokens"], d["prompt_lens"], d["answer_lens"], d["top_ids"]):
        assert tuple(row[:p]) in prompts and a == NEW  # no EOS ids: full answers
        [ref] = lm.generate([{"token_ids": row[:p].tolist()}], max_new_tokens=NEW)
        assert row[p:p + a].tolist() == ref["token_ids"]
        assert top[:a, 0].tolist() == ref["token_ids"]  # the teacher's top-1 is the greedy answer
    # The log-probabilities the decoding loop returned: as one forward over prompt + answer gives them.
    ids, logp = distill.teacher_top_k(lm.params, jnp.asarray(d["tokens"]), jnp.asarray(d["prompt_lens"]), cfg=lm.cfg,
                                      answer=NEW, k=8)
    np.testing.assert_array_equal(d["top_ids"], ids)
    np.testing.assert_allclose(d["top_logp"], logp, rtol=0, atol=1e-5)


def test_distill_data_bounds_the_prompt_length_by_the_context(lm, tmp_path):
    """--max-prompt-tokens beyond what the context leaves for the answer is refused before any work."""
    room = lm.cfg.max_position_embeddings - NEW
    for bad in (0, room + 1, 10**12):
        with pytest.raises(JspecError, match=rf"--max-prompt-tokens must be in 1\.\.{room} "):
            make_data(lm, tmp_path / "data", max_prompt_tokens=bad)
    assert not (tmp_path / "data").exists()


def test_a_damaged_shard_is_one_line(data, tmp_path):
    """A truncated shard, or one of other arrays than its siblings: refused naming the file."""
    for damage in ("truncated", "other arrays"):
        folder = shutil.copytree(data, tmp_path / damage.replace(" ", "-"))
        shard = sorted(folder.glob("shard-*.npz"))[-1]
        if damage == "truncated":
            shard.write_bytes(shard.read_bytes()[:200])
        else:
            np.savez(shard, tokens=np.zeros((1, 4), np.int32))
        with pytest.raises(JspecError, match=f"{shard.name} is damaged") as e:
            distill.load(folder)
        assert "\n" not in str(e.value)


def test_distill_data_resumes_missing_shards(lm, data, tmp_path):
    folder = tmp_path / "data"
    make_data(lm, folder)
    shards = sorted(folder.glob("shard-*.npz"))
    assert len(shards) == 3
    kept = shards[0].stat().st_mtime_ns
    shards[1].unlink()  # as if interrupted while writing the second shard
    make_data(lm, folder)
    assert shards[0].stat().st_mtime_ns == kept  # not redone
    _, resumed = distill.load(folder)
    _, reference = distill.load(data)
    for name in reference:
        np.testing.assert_array_equal(resumed[name], reference[name])
    with pytest.raises(JspecError, match="other settings"):
        make_data(lm, folder, max_new_tokens=NEW + 1)


def test_distill_data_grows_with_a_larger_count(lm, data, tmp_path):
    """A rerun with a larger --count extends the folder: the prompts already answered keep their
    shards, the smaller run's short last shard is answered again in full, and the folder equals
    one made with the larger count from the start. A smaller count is refused."""
    folder = tmp_path / "data"
    make_data(lm, folder, count=20)  # shards of 8, 8 and 4 answers
    shards = sorted(folder.glob("shard-*.npz"))
    kept = [s.stat().st_mtime_ns for s in shards[:2]]
    make_data(lm, folder, count=24)
    assert [s.stat().st_mtime_ns for s in shards[:2]] == kept
    meta, grown = distill.load(folder)
    _, reference = distill.load(data)
    assert meta["count"] == 24
    for name in reference:
        np.testing.assert_array_equal(grown[name], reference[name])
    with pytest.raises(JspecError, match="count 24 -> 16"):
        make_data(lm, folder, count=16)


def test_distill_data_splits_over_folders_with_skip(lm, data, tmp_path):
    """--skip N answers what comes after the first N prompts of the seeded order: two folders,
    --count 16 and --skip 16, hold what one run of 24 holds; a skip past the prompts is refused."""
    make_data(lm, tmp_path / "rest", count=8, skip=16)
    meta, rest = distill.load(tmp_path / "rest")
    _, reference = distill.load(data)
    assert meta["skip"] == 16 and meta["count"] == 8
    for name in reference:
        np.testing.assert_array_equal(rest[name], reference[name][16:])
    # A count beyond the prompts takes what there is, and meta.json says how many that was.
    meta, tail = distill.load(make_data(lm, tmp_path / "tail", count=100, skip=32))
    assert meta["count"] == len(tail["tokens"]) == 40 - 32
    with pytest.raises(JspecError, match="no prompt is left after skipping 40"):
        make_data(lm, tmp_path / "none", count=8, skip=40)
    assert not (tmp_path / "none").exists()


def make_text(lm, folder, sequences, **kw):
    return teacher_forced.make(lm, sequences, folder, **{**dict(max_tokens=40, top_k=8, shard_size=16,
                                                              batch_tokens=160, progress=False), **kw})


def test_teacher_forced_data_equals_the_generating_paths(lm, data, tmp_path):
    """Over the same prompt + answer tokens, one forward stores what answering stored."""
    folder = make_text(lm, tmp_path / "text", teacher_forced.from_answers(data))
    _, ref = distill.load(data)
    _, got = distill.load(folder)
    order = [int(np.flatnonzero(got["prompt_key"] == k)[0]) for k in ref["prompt_key"]]
    assert sorted(order) == list(range(24))
    for row, r in enumerate(order):
        p, a = ref["prompt_lens"][row], ref["answer_lens"][row]
        assert (got["prompt_lens"][r], got["answer_lens"][r]) == (p, a)
        np.testing.assert_array_equal(got["tokens"][r, :p + a], ref["tokens"][row, :p + a])
        np.testing.assert_array_equal(got["top_ids"][r, :a], ref["top_ids"][row, :a])
        np.testing.assert_allclose(got["top_logp"][r, :a], ref["top_logp"][row, :a], rtol=0, atol=1e-5)


def test_teacher_forced_data_covers_the_prompt_text_and_resumes(lm, tmp_path):
    prompts = token_prompts(40, lm.cfg.vocab_size)
    sequences = teacher_forced.from_prompts(lm, prompts)
    folder = make_text(lm, tmp_path / "text", sequences, max_tokens=16)
    _, d = distill.load(folder)
    assert len(d["tokens"]) == 40 and (d["prompt_lens"] == 1).all()  # token ids: every next token a target
    lens = np.array([min(len(p["token_ids"]), 16) for p in prompts])
    assert sorted(d["answer_lens"].tolist()) == sorted((lens - 1).tolist())
    # teacher-forced: the target of position i is the text's token i + 1, and the teacher's top-1
    # at i is the model's greedy next token after the text up to i (one causal forward over the
    # padded rows: what follows a row's text cannot move its logits)
    greedy = np.asarray(_full_logits(lm, d["tokens"])).argmax(-1)
    for row_greedy, a, top in zip(greedy, d["answer_lens"], d["top_ids"]):
        np.testing.assert_array_equal(top[:a, 0], row_greedy[:a])
    shards = sorted(folder.glob("shard-*.npz"))
    assert len(shards) == 3
    kept = shards[0].stat().st_mtime_ns
    shards[2].unlink()
    make_text(lm, folder, sequences, max_tokens=16)
    assert shards[0].stat().st_mtime_ns == kept
    _, resumed = distill.load(folder)
    for name in d:
        np.testing.assert_array_equal(resumed[name], d[name])
    with pytest.raises(JspecError, match="other settings"):
        make_text(lm, folder, sequences[:30], max_tokens=16)


def _full_logits(lm, tokens):
    """Logits [B, T, V] of token rows [B, T], each from position 0."""
    from jspec.model import decoder as M

    b, t = tokens.shape
    h, _ = M.forward(lm.params, lm.cfg, jnp.asarray(tokens, jnp.int32), None, M.KVCache.zeros(lm.cfg, b, t))
    return M.logits(lm.params, lm.cfg, h)


def test_split_never_puts_a_prompt_on_both_sides(lm, data, tmp_path):
    text = make_text(lm, tmp_path / "text", teacher_forced.from_prompts(lm, token_prompts(40, lm.cfg.vocab_size)))
    _, d = head_data.load_data([data, text])
    assert len(set(d["prompt_key"][d["folder"] == 0]) & set(d["prompt_key"][d["folder"] == 1])) == 24
    for fraction in (0.2, 0.5):
        tr, ev = head_data.split(d["prompt_key"], fraction, seed=3)
        assert len(tr) + len(ev) == len(d["prompt_key"]) and len(ev) and len(tr)
        assert not set(d["prompt_key"][tr]) & set(d["prompt_key"][ev])
    few = np.repeat(d["prompt_key"][:4], 2)  # four prompts, two rows each: 1% holds out one prompt
    tr, ev = head_data.split(few, 0.01, seed=3)
    assert len(ev) == 2 and len(set(few[ev])) == 1 and not set(few[tr]) & set(few[ev])
    held = d["prompt_key"][d["folder"] == 0][:5]
    tr, ev = head_data.split(d["prompt_key"], 0, 0, held)
    assert set(d["prompt_key"][ev]) == set(held) and not set(d["prompt_key"][tr]) & set(held)


def test_training_on_answers_and_text_with_held_out_answers(lm, data, tmp_path):
    text = make_text(lm, tmp_path / "text", teacher_forced.from_prompts(lm, token_prompts(40, lm.cfg.vocab_size)))
    held = make_data(lm, tmp_path / "held", count=6, seed=1)
    recipe = train.Recipe(**{**RECIPE.__dict__, "steps": 40, "eval_every": 5, "patience": 2})
    path, summary = train.train(lm, [data, text], tmp_path / "head", recipe, eval_dirs=[held], progress=False)
    assert summary["held_out_sequences"] == 6 and summary["held_out_tokens"] == 6 * NEW
    assert [d["held_out"] for d in summary["data"]] == [False, False, True]
    held_keys = set(distill.load(held)[1]["prompt_key"])
    total = sum(len(distill.load(f)[1]["tokens"]) for f in (data, text))
    keys = np.concatenate([distill.load(f)[1]["prompt_key"] for f in (data, text)])
    assert summary["train_sequences"] == total - np.isin(keys, list(held_keys)).sum()
    assert summary["best_step"] % 5 == 0 and summary["best_step"] <= summary["steps"] <= 40
    if summary["steps"] < 40:  # stopped early: `patience` measurements after the best
        assert summary["steps"] == summary["best_step"] + 2 * 5
    again = train.evaluate_head(lm, path, [data, text, held], data_folders=2, batch_size=RECIPE.batch_size)
    assert again["held_out_sequences"] == 6
    assert abs(again["agreement"] - summary["agreement"]) < 1e-4  # the saved head is the best one


def test_exit_states_by_width_equal_the_full_width_forward(lm, data):
    _, d = head_data.load_data([data])
    ends = d["prompt_lens"] + d["answer_lens"]
    length, width = d["tokens"].shape[1], head_data.widths(d)
    assert (width < length).any() and (width >= ends).all()
    got = head_data.exit_states(lm.params, lm.cfg, 2, d["tokens"], width, 4)
    full = head_data.exit_states(lm.params, lm.cfg, 2, d["tokens"], np.full_like(ends, length), 4)
    assert got.flat.shape[0] == width.sum()  # each row kept up to its own width only
    rows = np.arange(len(ends))[::-1]
    got, full = got.rows(rows, length), full.rows(rows, length)
    for i, end in enumerate(ends[rows]):
        np.testing.assert_allclose(got[i, :end], full[i, :end], atol=1e-5)
        assert not got[i, width[rows[i]]:].any()


def test_eagle_states_are_the_previous_positions_final_states(lm, data):
    """An EAGLE head reads at each position the target's final-normed state one position back."""
    _, d = head_data.load_data([data])
    width = head_data.widths(d)
    got = head_data.exit_states(lm.params, lm.cfg, lm.cfg.num_layers, d["tokens"], width, 4, previous_final=True)
    rows = np.arange(3)
    w = int(width[rows].max())
    tokens = jnp.asarray(d["tokens"][rows, :w])
    h, _ = M.forward(lm.params, lm.cfg, tokens, None, M.KVCache.zeros(lm.cfg, len(rows), w))
    final = np.asarray(heads.final_state(lm.params, lm.cfg, h))
    states = got.rows(rows, w)
    for i, r in enumerate(rows):
        assert not states[i, 0].any()
        np.testing.assert_allclose(states[i, 1:width[r]], final[i, :width[r] - 1], atol=1e-5)


@pytest.mark.parametrize("kind, depth", [("eesd", 1), ("kangaroo", 1), ("eesd", 2), ("eagle", 1)])
def test_training_lowers_the_loss(lm, data, tmp_path, kind, depth):
    losses = []
    exit_layer = lm.cfg.num_layers if kind == "eagle" else RECIPE.exit_layer
    recipe = train.Recipe(**{**RECIPE.__dict__, "kind": kind, "head_layers": depth, "exit_layer": exit_layer})
    path, summary = train.train(lm, data, tmp_path / "head", recipe, progress=False,
                                on_step=lambda step, m: losses.append(float(m["loss"])))
    assert len(losses) == RECIPE.steps
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])
    # (30 steps on 24 held-out tokens: an eagle head, which starts further from the target, may agree on none yet)
    assert 0 <= summary["agreement"] <= 1 and 0 < summary["expected_acceptance"] <= 1
    meta = heads.read_meta(path)
    assert (meta["kind"], meta["exit_layer"], meta["draft_vocab"]) == (kind, exit_layer, 128)
    hp, _ = heads.load(path, lm.cfg)
    assert len(hp["layers"]) == depth and all(("w_down" in lp) == (kind != "kangaroo") for lp in hp["layers"])
    assert ("fuse" in hp) == (kind == "eagle")
    assert hp["vocab"].shape == (128,) and (np.diff(np.asarray(hp["vocab"])) > 0).all()


def test_a_head_of_the_remaining_layers_is_the_target(lm, tmp_path):
    """An untrained EESD head of every layer after N, over the whole vocabulary, computes the
    target's own logits, so it drafts what the target says: every draft is accepted."""
    cfg, n = lm.cfg, 1
    hp = heads.init(lm.params, cfg, "eesd", n, np.arange(cfg.vocab_size, dtype=np.int32), depth=cfg.num_layers - n)
    tokens = jnp.asarray(token_prompts(1, cfg.vocab_size)[0]["token_ids"])[None]
    cache = M.KVCache.zeros(cfg, *tokens.shape)
    h, cache = M.run_layers(lm.params, cfg, M.embed(lm.params, tokens), None, cache, range(n))
    x, _ = heads.block(cfg, hp, h, None, heads.empty_kv(cfg, hp, *tokens.shape))
    full, _ = M.run_layers(lm.params, cfg, h, None, cache, range(n, cfg.num_layers))
    np.testing.assert_allclose(heads.vocab_logits(cfg, heads.draft_params(lm.params, hp), x),
                               M.logits(lm.params, cfg, full), atol=1e-4)
    path = heads.save(tmp_path / "h", hp, {"kind": "eesd", "exit_layer": n, "model": fingerprint(cfg)})
    prompts = token_prompts(4, cfg.vocab_size, seed=3)
    ar = lm.generate(prompts, max_new_tokens=NEW)
    out = lm.generate(prompts, method="eesd", head=str(path), max_draft=3, controller="fixed",
                      max_new_tokens=NEW, batch_size=4, batching="static")
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ar]
    assert all(r["stats"]["accepted"] == r["stats"]["drafted"] > 0 for r in out)


def test_one_layer_heads_of_format_2_load(lm, tmp_path):
    """Heads saved before heads had several layers (params `layer`) load as one-layer heads."""
    hp = heads.init(lm.params, lm.cfg, "kangaroo", 1, np.arange(7, 60, dtype=np.int32))
    path = tmp_path / "h"
    store.save_params(path / "params", {"layer": hp["layers"][0], "norm": hp["norm"], "vocab": hp["vocab"]})
    (path / "head.json").write_text(json.dumps({"format": 2, "kind": "kangaroo", "exit_layer": 1,
                                                "model": fingerprint(lm.cfg)}))
    restored, _ = heads.load(path, lm.cfg)
    assert jax.tree.structure(restored) == jax.tree.structure(hp)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_heads_of_format_3_load_with_gate_and_up_interleaved(lm, tmp_path):
    """Heads saved before the interleaving (the shipped ones among them) hold each layer's gate rows
    then its up rows; they load in the model's interleaved order (jspec.model.layout.gate_up)."""
    hp = perturbed(heads.init(lm.params, lm.cfg, "eesd", 1, np.arange(7, 60, dtype=np.int32), depth=2), 1e-3)
    F = lm.cfg.intermediate_size
    concatenated = lambda w: np.concatenate([np.asarray(w)[0::2], np.asarray(w)[1::2]])  # noqa: E731
    path = tmp_path / "h"
    store.save_params(path / "params", {**hp, "layers": [{**lp, "w_gate_up": concatenated(lp["w_gate_up"])}
                                                          for lp in hp["layers"]]})
    (path / "head.json").write_text(json.dumps({"format": 3, "kind": "eesd", "exit_layer": 1,
                                                "model": fingerprint(lm.cfg)}))
    restored, _ = heads.load(path, lm.cfg)
    assert restored["layers"][0]["w_gate_up"].shape == (2 * F, lm.cfg.hidden_size)
    assert jax.tree.structure(restored) == jax.tree.structure(hp)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert json.loads((heads.save(tmp_path / "new", hp, {"kind": "eesd", "exit_layer": 1, "model": fingerprint(
        lm.cfg)}) / "head.json").read_text())["format"] == heads.FOLDER.format == 4


def test_saved_head_restores_bit_identically(lm, tmp_path):
    hp = perturbed(heads.init(lm.params, lm.cfg, "eesd", 2, np.arange(7, 60, dtype=np.int32)), 1e-3)
    path = heads.save(tmp_path / "h", hp, {"kind": "eesd", "exit_layer": 2, "model": fingerprint(lm.cfg)})
    restored, meta = heads.load(path, lm.cfg)
    assert jax.tree.structure(restored) == jax.tree.structure(hp)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(hp)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_after_interrupt_continues_from_last_checkpoint(lm, data, tmp_path, monkeypatch):
    """With held-out evaluation on, so the early-stopping state (best loss, patience) resumes too."""
    recipe = train.Recipe(**{**RECIPE.__dict__, "steps": 12, "save_every": 4, "eval_every": 2, "patience": 3})
    ref_path, ref_summary = train.train(lm, data, tmp_path / "ref", recipe, progress=False)

    def interrupt(step, metrics):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train.train(lm, data, tmp_path / "head", recipe, progress=False, on_step=interrupt)
    ckpt = tmp_path / "head.train"
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 6]  # every 4, and on interrupt
    assert not (tmp_path / "head").exists()
    with monkeypatch.context() as m:  # other settings are refused before the long pass over the data
        m.setattr(head_data, "head_inputs", lambda *a, **k: pytest.fail("the target ran before the settings check"))
        with pytest.raises(JspecError, match="holds a run with other settings"):
            train.train(lm, data, tmp_path / "head", train.Recipe(**{**recipe.__dict__, "lr": recipe.lr / 2}),
                        progress=False)
    steps = []
    path, summary = train.train(lm, data, tmp_path / "head", recipe, progress=False,
                                on_step=lambda step, m: steps.append(step))
    assert steps == list(range(7, ref_summary["steps"] + 1))  # went on from step 6
    assert {k: v for k, v in summary.items() if k != "wall_seconds"} == \
        {k: v for k, v in ref_summary.items() if k != "wall_seconds"}
    resumed, _ = heads.load(path, lm.cfg)
    reference, _ = heads.load(ref_path, lm.cfg)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_goes_on_from_a_saved_head(lm, data, tmp_path, caplog):
    first, summary = train.train(lm, data, tmp_path / "first", RECIPE, progress=False)
    # One step at the warmup's learning rate of 0: the head comes out as it went in, vocabulary too.
    again = train.Recipe(**{**RECIPE.__dict__, "init": str(first), "steps": 1, "warmup": 1, "draft_vocab": 64})
    path, resumed = train.train(lm, data, tmp_path / "again", again, progress=False)
    assert "--warmup 1 >= --steps 1: the learning rate never reaches" in caplog.text
    assert resumed["agreement"] == summary["agreement"]
    assert heads.read_meta(path)["training"]["started_from"] == heads.read_meta(first)["training"]
    for a, b in zip(jax.tree.leaves(heads.load(path, lm.cfg)[0]), jax.tree.leaves(heads.load(first, lm.cfg)[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(JspecError, match="ask for the same"):
        train.train(lm, data, tmp_path / "other", train.Recipe(**{**again.__dict__, "exit_layer": 2}), progress=False)


@pytest.mark.parametrize("kind", ["kangaroo", "eesd"])
def test_a_grown_head_computes_what_it_grew_from(lm, tmp_path, kind):
    """--init with a larger --head-layers appends layers that add nothing yet: the grown head's
    logits equal the saved head's (test_training_grows_a_saved_head: training then moves them)."""
    cfg = lm.cfg
    # perturbed: a trained head is no longer a copy of the target's layer
    hp = perturbed(heads.init(lm.params, cfg, kind, 1, np.arange(7, 60, dtype=np.int32)), 1e-2)
    grown = heads.grow(lm.params, cfg, kind, 1, hp, 2)
    assert len(grown["layers"]) == 2
    tokens = jnp.asarray(token_prompts(1, cfg.vocab_size)[0]["token_ids"])[None]
    h = M.embed(lm.params, tokens)
    logits = [heads.vocab_logits(cfg, heads.draft_params(lm.params, p),
                                 heads.block(cfg, p, h, None, heads.empty_kv(cfg, p, *tokens.shape))[0])
              for p in (hp, grown)]
    np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))
    with pytest.raises(JspecError, match="cannot grow"):
        heads.grow(lm.params, cfg, kind, 1, grown, 1)


def test_training_grows_a_saved_head(lm, data, tmp_path):
    first, _ = train.train(lm, data, tmp_path / "first", RECIPE, progress=False)
    deeper = train.Recipe(**{**RECIPE.__dict__, "init": str(first), "head_layers": 2, "steps": 10})
    path, _ = train.train(lm, data, tmp_path / "deeper", deeper, progress=False)
    hp, meta = heads.load(path, lm.cfg)
    assert len(hp["layers"]) == 2 and meta["training"]["started_from"] == heads.read_meta(first)["training"]
    assert np.abs(np.asarray(hp["layers"][1]["wo"])).max() > 0  # the new layer learned
    with pytest.raises(JspecError, match="at least its --head-layers"):
        train.train(lm, data, tmp_path / "shallower", train.Recipe(**{**deeper.__dict__, "init": str(path),
                                                                       "head_layers": 1}), progress=False)


def test_head_for_another_model_is_refused(lm, make_tiny, tmp_path):
    hp = heads.init(lm.params, lm.cfg, "kangaroo", 1, np.arange(lm.cfg.vocab_size, dtype=np.int32))
    path = heads.save(tmp_path / "h", hp, {"kind": "kangaroo", "exit_layer": 1, "model": fingerprint(lm.cfg)})
    for change, what in [(dict(hidden_size=32), "hidden_size 64"), (dict(vocab_size=300), "vocab_size 256"),
                         (dict(num_hidden_layers=2), "num_layers 3")]:
        other = make_tiny("llama", **change).jspec_model()
        with pytest.raises(JspecError, match=f"another model: .*{what}"):
            other.generate([{"token_ids": [5, 6, 7]}], method="kangaroo", head=str(path), max_new_tokens=2)
    meta = json.loads((path / "head.json").read_text())
    (path / "head.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(JspecError, match=f"format 99; this jspec reads formats 2, 3 and {heads.FOLDER.format}"):
        lm.generate([{"token_ids": [5, 6, 7]}], method="kangaroo", head=str(path), max_new_tokens=2)
    (path / "head.json").write_text(json.dumps(meta))
    with pytest.raises(JspecError, match="is of kind kangaroo, not eesd"):
        lm.generate([{"token_ids": [5, 6, 7]}], method="eesd", head=str(path), max_new_tokens=2)
    with pytest.raises(JspecError, match="needs --head"):
        lm.generate([{"token_ids": [5, 6, 7]}], method="eesd", max_new_tokens=2)
    with pytest.raises(JspecError, match="--head does not go with --method ngram"):
        lm.generate([{"token_ids": [5, 6, 7]}], method="ngram", head=str(path), max_new_tokens=2)


def test_cli_errors_are_one_line(tmp_path, capsys):
    bench = tmp_path / "spec_bench.jsonl"
    bench.write_text('{"prompt": "x"}\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "meta.json").write_text("{")
    for argv, message in [
        (["distill-data", "--prompts", str(bench), "--out", str(tmp_path / "d")], "evaluation set"),
        (["distill-data", "--prompts", "all", "spec_bench", "--out", str(tmp_path / "d")], "evaluation set"),
        (["distill-data", "--answers", str(tmp_path), "--out", str(tmp_path / "d")], "--answers goes with --source text"),
        (["distill-data", "--count", "0", "--out", str(tmp_path / "d")], "--count must be >= 1"),
        (["distill-data", "--shard-size", "0", "--out", str(tmp_path / "d")], "--shard-size must be >= 1, got 0"),
        (["distill-data", "--max-tokens", "64", "--out", str(tmp_path / "d")], "--max-tokens goes with --source text"),
        (["distill-data", "--source", "text", "--batch-size", "8", "--out", str(tmp_path / "d")],
         "--batch-size goes with --source answers"),
        (["distill-data", "--temperature", "nan", "--out", str(tmp_path / "d"), "--model", "/no/such/model"],
         r"--temperature must be 0 \(greedy\)"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", "d", "--out", "h", "--lr", "nan"],
         "--lr and --clip must be > 0"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", "d", "--out", "h", "--weight-decay", "-1"],
         "--weight-decay and --eval-every >= 0"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", str(tmp_path / "none"),
          "--out", str(tmp_path / "h"), "--model", "/no/such/model"], "data folder .*none does not exist"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", str(tmp_path),
          "--out", str(tmp_path / "h"), "--model", "/no/such/model"], "holds no distillation data"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", str(tmp_path / "bad"),
          "--out", str(tmp_path / "h"), "--model", "/no/such/model"], r"bad/meta.json is not valid"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", str(tmp_path / "data"),
          "--eval-data", str(tmp_path / "data") + "/", "--out", "h"], "data folder .*data/ is given twice"),
        (["build-datastore", "--data", str(tmp_path / "data"), str(tmp_path / "data"), "--out", "ds"],
         "is given twice"),
        (["train-head", "--kind", "medusa", "--exit-layer", "4", "--data", "d", "--out", "h"], "invalid choice"),
        (["train-head", "--kind", "kangaroo", "--data", "d", "--out", "h"], "--kind kangaroo needs --exit-layer N"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", "d", "--out", "h", "--steps", "0"],
         "--steps must be >= 1"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", "d", "--out", "h", "--patience", "2"],
         "--patience goes with --eval-every N"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", str(tmp_path / "data"), "--out", "h",
          "--init", str(tmp_path), "--model", "/no/such/model"], "not a jspec head"),
        (["train-head", "--kind", "eesd", "--exit-layer", "4", "--data", str(tmp_path / "data"),
          "--out", str(tmp_path / "data"), "--model", "/no/such/model"], r"not empty .* \(no head.json\)"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("jspec: error:")
        assert __import__("re").search(message, err), err
    assert not (tmp_path / "d").exists()  # nothing written before the error


@pytest.mark.slow
@pytest.mark.parametrize("method", heads.KINDS)
def test_shipped_heads_are_lossless_on_the_default_model(default_model, method):
    """The heads in jspec/checkpoints/ load by default and give ar's tokens, drafting well. Batch 1 only:
    rows with their own acceptance are checked on tiny models (test_spec) and with the shipped
    `eesd` head at batch 2 on a mesh (test_sharding)."""
    from jspec.parts import shipped

    assert shipped.find(default_model, method) is not None, "no shipped head in jspec/checkpoints/"
    meta = json.loads((shipped.find(default_model, method) / "head.json").read_text())
    assert meta["kind"] == method and meta["model"] == fingerprint(default_model.cfg)
    prompts = ["Write a haiku about the sea.", "What is 12 times 7? Explain."]
    ar = default_model.generate(prompts, max_new_tokens=DEFAULT_NEW)
    out = default_model.generate(prompts, method=method, max_new_tokens=DEFAULT_NEW)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ar]
    assert all(r["stats"]["drafted"] <= r["stats"]["rounds"] - 1 for r in out)  # K = 1 on a CPU
    assert sum(r["stats"]["accepted"] for r in out) > 0.2 * sum(r["stats"]["drafted"] for r in out) > 0


@pytest.mark.slow
def test_cli_distill_train_generate(tiny_chat_model, tmp_path, capsys):
    """The whole path from the command line, text prompts through a chat template: distill-data,
    train-head, generate with the head (the tokens of ar: the head is lossless), and a datastore of
    the same answers behind ngram and prompt lookup."""
    model = ["--model", tiny_chat_model]
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in
                               enumerate(["Say hi.", "Count to three.", "Name a colour."])))
    data, head = tmp_path / "data", tmp_path / "head"
    assert main(["distill-data", *model, "--prompts", str(prompts), "--out", str(data), "--count", "3",
                 "--max-new-tokens", "8", "--max-prompt-tokens", "64", "--batch-size", "4",
                 "--shard-size", "2"]) == 0
    assert len(list(data.glob("shard-*.npz"))) == 2
    # The same answers re-scored teacher-forced, without the prompts' own text.
    assert main(["distill-data", *model, "--source", "text", "--prompts", str(prompts), "--count", "0",
                 "--answers", str(data), "--top-k", "4", "--out", str(tmp_path / "rescored")]) == 0
    rescored = distill.load(tmp_path / "rescored")[1]
    assert sorted(rescored["answer_lens"].tolist()) == sorted(distill.load(data)[1]["answer_lens"].tolist())
    # The held-out split is by prompt, seeded: take a seed that holds out one of the three.
    keys = head_data.load_data([data])[1]["prompt_key"]
    seed = next(s for s in range(100) if len(head_data.split(keys, 0.34, s)[1]) == 1)
    assert main(["train-head", *model, "--kind", "kangaroo", "--exit-layer", "2", "--data", str(data),
                 "--out", str(head), "--steps", "2", "--batch-size", "2", "--eval-fraction", "0.34",
                 "--seed", str(seed), "--draft-vocab", "512"]) == 0
    assert heads.read_meta(head)["draft_vocab"] == 512
    capsys.readouterr()
    assert main(["generate", *model, "Name three primes.", "--max-new-tokens", "12"]) == 0
    ar = capsys.readouterr().out
    assert main(["generate", *model, "Name three primes.", "--max-new-tokens", "12", "--method", "kangaroo",
                 "--head", str(head)]) == 0
    assert capsys.readouterr().out == ar
    assert main(["build-datastore", *model, "--data", str(data), "--out", str(tmp_path / "ds"), "--min-count", "1"]) == 0
    for method in (["ngram"], ["kangaroo", "--head", str(head), "--lookup", "2"]):
        assert main(["generate", *model, "Name three primes.", "--max-new-tokens", "12", "--method", *method,
                     "--datastore", str(tmp_path / "ds")]) == 0
        assert capsys.readouterr().out == ar
