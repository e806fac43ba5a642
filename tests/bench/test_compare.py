"""`jspec compare`: the first differing token of each row, and the target's logit gap there."""

from __future__ import annotations

import copy
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits
from support.cli import PROMPTS, assert_one_error, read_jsonl, run, tiny, write_lines  # noqa: F401

import jspec.api
from jspec.bench.compare import DIFFERS, NEAR_TIE, Row, compare
from jspec.jsonl import read_prompts
from jspec.model import decoder as M


def test_compare_finds_the_first_difference_and_the_target_gap(tiny_llama):
    model = tiny_llama.jspec_model(eos_token_ids=())  # every row runs its 8 tokens
    rng = np.random.default_rng(0)
    prompts = [{"id": i, "token_ids": rng.integers(3, 256, n).tolist()} for i, n in enumerate((5, 9, 7, 6))]
    a = model.generate(prompts, max_new_tokens=8)
    # B: row 0 identical, row 1 takes the target's second choice at position 3, row 2 stops after
    # 5 tokens, row 3 is missing and B has a row of its own.
    p = 3
    context = prompts[1]["token_ids"] + a[1]["token_ids"][:p]
    logits = hf_logits(tiny_llama.hf, np.asarray([context]))[0, -1]
    first, second = np.argsort(-logits)[:2]
    assert a[1]["token_ids"][p] == first  # the greedy run followed the target
    b = copy.deepcopy(a[:3]) + [{"id": "extra", "token_ids": [5]}]
    b[1]["token_ids"][p:] = [int(second), 7]
    b[2]["token_ids"] = b[2]["token_ids"][:5]

    rows = compare(model, a, b, prompts)
    assert [(r.id, r.position, r.a, r.b, r.only_in) for r in rows] == [
        (1, p, first, second, None), (2, 5, a[2]["token_ids"][5], None, None), (3, None, None, None, "A"),
        ("extra", None, None, None, "B")]
    changed = rows[0]
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert changed.gap == pytest.approx(logits[first] - logits[second], abs=1e-4)
    assert (changed.a_rank, changed.b_rank) == (1, 2)
    assert (changed.a_prob, changed.b_prob) == pytest.approx((probs[first], probs[second]), abs=1e-5)
    assert [r.verdict for r in rows[1:]] == [DIFFERS] * 3  # an output that ends early is no near-tie
    for tie, verdict in ((changed.gap * 1.01, NEAR_TIE), (changed.gap * 0.99, DIFFERS)):
        assert compare(model, a, b, prompts, tie=tie)[0].verdict == verdict

    # Without prompts: positions and tokens only.
    assert compare(None, a, b)[0] == Row(1, p, first, second)
    assert compare(None, a, a) == []


def records(*token_ids, ids=None) -> list[dict]:
    return [{"id": i, "token_ids": list(t)} for i, t in zip(ids or range(len(token_ids)), token_ids)]


def test_cli_without_prompts(capsys, tmp_path):
    a = write_lines(tmp_path / "a.jsonl", *records([1, 2, 3], [4, 5, 6, 7], [8]))
    code, out, err = run(capsys, "compare", a, a)
    assert (code, out, err) == (0, "3/3 rows identical\n", "")

    b = write_lines(tmp_path / "b.jsonl", *records([1, 2, 3], [4, 5, 9, 7], [8], ids=[0, 1, "new"]))
    code, out, err = run(capsys, "compare", a, b)
    assert code == 1 and err == ""
    assert out.splitlines() == [
        "id 1, token 2: A 6 vs B 9",
        "id 2: only in A: DIFFERS",
        'id "new": only in B: DIFFERS',
        "1/4 rows identical; 3 differ: 2 DIFFERS, 1 unscored (the logit gaps need --prompts IN.jsonl)"]

    code, out, err = run(capsys, "compare", a, b, "--json")
    assert code == 1 and err.startswith("1/4 rows identical")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["id"], r["position"], r["a"], r["b"], r["verdict"]) for r in rows] == [
        (1, 2, 6, 9, None), (2, None, None, None, DIFFERS), ("new", None, None, None, DIFFERS)]


def test_cli_scores_the_prompts_as_generate_encoded_them(capsys, tiny, tmp_path):
    prompts = write_lines(tmp_path / "in.jsonl", PROMPTS[0], PROMPTS[2])  # plain text: --no-chat takes it
    a = tmp_path / "a.jsonl"
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", a, "--model", tiny,
                       "--max-new-tokens", "6")
    assert code == 0, err
    changed = read_jsonl(a)
    p, first = 2, changed[1]["token_ids"][2]
    changed[1]["token_ids"][p] = first + 1
    b = write_lines(tmp_path / "b.jsonl", *changed)

    code, out, err = run(capsys, "compare", a, b, "--prompts", prompts, "--model", tiny)
    assert code == 1, err
    [line, last] = out.splitlines()
    assert line.startswith(f'id 1, token {p}: A {first} "') and f"B {first + 1} " in line
    assert "(rank 1, p=" in line  # A is the greedy run: the target's top choice, if the prompt encodes alike
    assert last.startswith("1/2 rows identical; 1 differ: ")
    # The gap from a forward over the prompt and A's first p tokens, unpadded.
    model = jspec.api.load(tiny)
    tokens = model.requests(read_prompts(prompts))[1].token_ids + changed[1]["token_ids"][:p]
    cache = M.KVCache.zeros(model.cfg, 1, len(tokens))
    h, _ = M.forward(model.params, model.cfg, jnp.asarray([tokens]), None, cache)
    logits = np.asarray(M.logits(model.params, model.cfg, h[0, -1]))
    gap = float(re.search(r"A-B logit gap ([-+][\d.]+)", line)[1])
    assert gap == pytest.approx(logits[first] - logits[first + 1], abs=2e-3)

    # Encoded without the chat template, the prompts are not those of the outputs.
    assert_one_error(*run(capsys, "compare", a, b, "--prompts", prompts, "--model", tiny, "--no-chat"),
                     "prompt 0 encodes to")  # an identical row is checked too
    # Every record is checked against the prompts, also one that is only cut short (nothing to score).
    cut = {**changed[1], "token_ids": changed[1]["token_ids"][:2]}
    shorter = write_lines(tmp_path / "shorter.jsonl", changed[0], cut)
    one_prompt = write_lines(tmp_path / "one.jsonl", PROMPTS[0])
    assert_one_error(*run(capsys, "compare", a, shorter, "--prompts", one_prompt, "--model", tiny),
                     "id 1 of the outputs is not among the prompts")


@pytest.mark.parametrize("lines, args, phrase", [
    (None, [], "does not exist"),
    (['{"id": 0, "token_ids": [1]', ], [], "line 1: not valid JSON"),
    ([{"id": 0, "text": "no tokens"}], [], 'line 1: has no "token_ids"'),
    ([{"id": 0, "token_ids": "1 2"}], [], '"token_ids" must be a list'),
    ([{"id": 0, "token_ids": [1]}, {"id": 0, "token_ids": [2]}], [], "line 2: duplicate id 0"),
    ([{"id": 0, "token_ids": [1]}], ["--tie", "-1"], "--tie must be a number >= 0"),
    ([{"id": 0, "token_ids": [1]}], ["--no-chat"], "go with --prompts"),
    ([{"id": 0, "token_ids": [1]}], ["--tie", "3"], "go with --prompts"),
    ([{"id": 0, "token_ids": [1]}], ["--dtype", "bfloat16"], "go with --prompts"),
])
def test_cli_bad_input(capsys, tmp_path, lines, args, phrase):
    a = write_lines(tmp_path / "a.jsonl", *records([1]))
    b = tmp_path / "b.jsonl"
    if lines is not None:
        write_lines(b, *lines)
    assert_one_error(*run(capsys, "compare", a, b, *args), phrase)
