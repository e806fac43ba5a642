"""The datastore (jspec.parts.datastore): the table of what the model wrote after two or three tokens,
its hash, its lookup inside jit against a Python reference, and its refusals."""

from __future__ import annotations

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_NEW

from jspec.cli import main
from jspec.errors import JspecError
from jspec.parts import datastore, shipped
from jspec.parts.folder import fingerprint
from jspec.training import distill


def test_hash_is_the_same_in_numpy_and_jax():
    keys = np.random.default_rng(0).integers(-1, 2**17, (2000, 3)).astype(np.int32)
    np.testing.assert_array_equal(datastore.key_hash(keys), np.asarray(datastore.key_hash(jnp.asarray(keys))))


def test_build_keeps_clear_continuations():
    """Each token, bigram and trigram before an answer token counts it; kept when the most
    frequent continuation is written at least min_count times and, for a bigram or trigram, in at
    least min_share of them (a single token's entry is a guess: no share asked)."""
    sequences = [([7, 1, 2, 3, 1, 2, 3, 1, 2, 4], 3), ([1, 2, 3], 2), ([9, 9, 1, 2, 3], 4)]
    table = datastore.build(sequences, min_count=2, min_share=0.5)
    got = {tuple(k): int(n) for k, n in zip(table["ngram_keys"].tolist(), table["ngram_next"])}
    # (1, 2) -> 3 four times of five, 4 once; (3, 1, 2) -> 3 once and 4 once; (7, 1, 2) only once
    assert got == {(-1, 1, 2): 3, (-1, 2, 3): 1, (-1, 3, 1): 2, (1, 2, 3): 1, (2, 3, 1): 2,
                   (-1, -1, 1): 2, (-1, -1, 2): 3, (-1, -1, 3): 1}
    assert np.all(np.diff(table["ngram_hash"]) >= 0)
    np.testing.assert_array_equal(table["ngram_hash"], datastore.key_hash(table["ngram_keys"]))
    clearer = datastore.build(sequences, min_count=2, min_share=0.9)  # 2 -> 3 (a share of 0.8) stays a guess
    assert {tuple(k) for k in clearer["ngram_keys"].tolist()} == got.keys() - {(-1, 1, 2)}
    frequent = datastore.build(sequences, min_count=3, min_share=0.5)
    assert sorted(frequent["ngram_keys"].tolist()) == [[-1, -1, 2], [-1, 1, 2]]


def test_a_round_with_nothing_better_guesses_one_token():
    """n-gram drafting proposes a repeat of 2+ tokens, else the datastore's chain, else (with
    `guess`) one token: what followed the newest token's most recent earlier occurrence, else the
    table's most frequent continuation of that token, else nothing."""
    from jspec.drafters.ngram import propose

    # 21 -> 22 twice and -> 23 once: (20, 21) is no clear bigram, but 22 is 21's guess
    sequences = [([20, 21, 22], 1), ([19, 21, 22], 1), ([20, 21, 23], 1), ([30, 31, 32, 33], 1)]
    table = {k: jnp.asarray(v) for k, v in datastore.build(sequences, min_count=1, min_share=1.0).items()}
    seq = jnp.array([[1, 2, 3, 1, 2],    # a repeat of (1, 2): 3, 1, 2
                     [7, 30, 31, 0, 0],  # the chain 32, 33
                     [5, 21, 6, 21, 0],  # 21 recurs: 6 followed it
                     [8, 9, 21, 0, 0],   # the table's guess after 21: 22
                     [8, 9, 40, 0, 0]])  # nothing
    end = jnp.array([4, 2, 3, 2, 2])
    wanted = [[3, 1, 2], [32, 33], [6], [22], []]
    for guess in (True, False):
        tokens, found = propose(seq, end, 4, 2, 3, table, guess=guess)
        want = wanted if guess else wanted[:2] + [[], [], []]
        assert [tokens[b, :int(n)].tolist() for b, n in enumerate(found)] == want
    tokens, found = propose(seq, end, 4, 2, 3, None, guess=True)  # no datastore: repeats only
    assert [tokens[b, :int(n)].tolist() for b, n in enumerate(found)] == [[3, 1, 2], [], [6], [], []]


def reference_lookup(counts, context, k):
    """The chain of most frequent continuations (trigram before bigram), and its gapless length."""
    tokens, found, gap = [], 0, False
    context = list(context)
    for _ in range(k):
        tri = counts.get(tuple(context[-3:]))
        bi = counts.get((-1, *context[-2:]))
        token = tri if tri is not None else bi
        gap |= token is None
        found += not gap
        tokens.append(token)
        context.append(-5 if token is None else token)
    return tokens, found


def test_lookup_equals_a_python_reference():
    rng = np.random.default_rng(1)
    vocab = 12  # small, so that chains of several known n-grams happen
    sequences = [(rng.integers(0, vocab, 40).tolist(), 2) for _ in range(30)]
    table = datastore.build(sequences, min_count=2, min_share=0.3)
    counts = {tuple(k): int(n) for k, n in zip(table["ngram_keys"].tolist(), table["ngram_next"])}
    seq = rng.integers(0, vocab, (64, 10)).astype(np.int32)
    end = rng.integers(0, 10, 64).astype(np.int32)
    tokens, found = datastore.lookup({k: jnp.asarray(v) for k, v in table.items()}, jnp.asarray(seq),
                                     jnp.asarray(end), 4)
    lengths = collections.Counter()
    for row in range(64):
        context = [-1] * max(0, 2 - end[row]) + seq[row, max(0, end[row] - 2):end[row] + 1].tolist()
        want, n = reference_lookup(counts, context, 4)
        assert int(found[row]) == n, row
        assert tokens[row, :n].tolist() == want[:n], row
        lengths[n] += 1
    assert lengths[0] and lengths[1] and sum(v for n, v in lengths.items() if n >= 2)


def test_off_is_no_datastore(tiny_llama, tmp_path):
    """`off` (CLI, API and a bench spec alike) means no table; a path must be a datastore."""
    from jspec import methods
    from jspec.api import Model
    from jspec.bench.specs import parse_methods

    model = Model(tiny_llama.cfg, tiny_llama.params, name="tiny")
    [_, spec] = parse_methods("ngram:datastore=off")
    assert spec.options == (("datastore", "off"),)
    assert methods.build("ngram", model, **dict(spec.options))[1] == ()
    assert methods.build("early-exit", model, exit_layer=1, lookup=2, datastore="off")[1].own is None
    with pytest.raises(JspecError, match="not a jspec datastore"):
        methods.build("ngram", model, datastore=str(tmp_path))


def write_answers(folder, meta):
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(meta))
    tokens = np.array([[1, 5, 6, 7, 5, 6, 7, 5, 6, 7], [1, 4, 5, 6, 7, 5, 6, 7, 0, 0]], np.int32)
    distill.write_npz(folder / "shard-00000.npz", tokens=tokens, prompt_lens=np.array([2, 2], np.int32),
                      answer_lens=np.array([8, 6], np.int32), top_ids=np.zeros((2, 8, 1), np.int32),
                      top_logp=np.zeros((2, 8, 1), np.float32))


def test_cli_builds_and_refuses(tiny_llama, tmp_path, capsys):
    """build-datastore on answers of the model; one-line errors for other models' answers,
    teacher-forced text, and a table of another model."""
    model = ["--model", str(tiny_llama.path)]
    name = str(tiny_llama.path)  # a model's name is how --model named it
    write_answers(tmp_path / "answers", {"format": 1, "model": name, "temperature": 0.0})
    assert main(["build-datastore", *model, "--data", str(tmp_path / "answers"), "--out", str(tmp_path / "ds")]) == 0
    meta = json.loads((tmp_path / "ds" / "datastore.json").read_text())
    assert meta["model"] == fingerprint(tiny_llama.cfg) and meta["answers"] == 2 and meta["entries"] > 0
    table = datastore.load(tmp_path / "ds", tiny_llama.cfg)
    assert {(tuple(k), int(n)) for k, n in zip(table["ngram_keys"].tolist(), table["ngram_next"])} >= {
        ((-1, 5, 6), 7), ((5, 6, 7), 5)}

    write_answers(tmp_path / "text", {"format": 1, "source": "text", "model": name})
    write_answers(tmp_path / "other", {"format": 1, "model": "another-model", "temperature": 0.0})
    write_answers(tmp_path / "sampled", {"format": 1, "model": name, "temperature": 0.7})
    capsys.readouterr()
    for argv, message in [
        (["--data", str(tmp_path / "text")], "not greedy answers"),
        (["--data", str(tmp_path / "sampled")], "not greedy answers"),
        (["--data", str(tmp_path / "other")], "answers of another-model"),
        (["--data", str(tmp_path / "none")], "none does not exist"),
        (["--data", str(tmp_path)], "no distillation data"),
        (["--data", str(tmp_path / "answers"), "--min-count", "9"], "nothing to save"),
        (["--data", str(tmp_path / "answers"), "--min-share", "0"], "--min-share"),
    ]:
        assert main(["build-datastore", *model, *argv, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("jspec: error:") and message in err, err
        assert not (tmp_path / "bad").exists()
    # --out naming a folder of something else (here its own data) is refused, and it is untouched
    before = sorted((tmp_path / "answers").iterdir())
    assert main(["build-datastore", *model, "--data", str(tmp_path / "answers"), "--out", str(tmp_path / "answers")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec: error:") and "no datastore.json" in err and len(err.strip().splitlines()) == 1
    assert sorted((tmp_path / "answers").iterdir()) == before
    assert main(["build-datastore", *model, "--data", str(tmp_path / "answers"), "--out", str(tmp_path / "ds")]) == 0

    other = tiny_llama.cfg.__class__(**{**tiny_llama.cfg.__dict__, "vocab_size": 64})
    with pytest.raises(JspecError, match="was built for another model: vocab_size"):
        datastore.load(tmp_path / "ds", other)
    with pytest.raises(JspecError, match="not a jspec datastore"):
        datastore.load(tmp_path, tiny_llama.cfg)


@pytest.mark.slow
def test_shipped_datastore_on_the_default_model(default_model):
    """The datastore in jspec/checkpoints/ loads by default for ngram and --lookup, drafts where the
    text has no repeat (more accepted than without it), and the output is ar's."""
    from jspec import methods

    assert shipped.find(default_model, "datastore") is not None, "no shipped datastore in jspec/checkpoints/"
    assert set(methods.build("ngram", default_model)[1]) == {"ngram_keys", "ngram_hash", "ngram_next"}
    prompts = ["Write a haiku about the sea.", "What is 12 times 7? Explain."]
    ar = [r["token_ids"] for r in default_model.generate(prompts, max_new_tokens=DEFAULT_NEW)]
    accepted = {}
    for store in (None, "off"):
        out = default_model.generate(prompts, method="ngram", max_new_tokens=DEFAULT_NEW, datastore=store)
        assert [r["token_ids"] for r in out] == ar
        accepted[store] = sum(r["stats"]["accepted"] for r in out)
    assert accepted[None] > accepted["off"]
