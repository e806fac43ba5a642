"""Where two outputs of the same prompts part, and whether the target model cares (`jspec compare`).

Speculative decoding promises the tokens of plain decoding (`ar`), but two runs whose arithmetic
differs (bfloat16 against float32, a K+1-position verification against a one-position decode
step) may round a near-tie the other way, and from there on write different text. For each row
that differs, the first differing position says where, and the target's logits there, from a
teacher-forced forward over the prompt and the tokens both runs agree on, say why: the gap
between the logits of A's token and B's is a fraction of a logit for a near-tie, which a change
of rounding can flip, and wide when a run did not follow the target, which is a bug. Later
positions are not compared: once the outputs part, each run continues its own text.

    rows = compare(model, read_records("ar.jsonl"), read_records("spec.jsonl"), read_prompts("in.jsonl"))
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.batching import prompt_bucket
from jspec.errors import JspecError
from jspec.model import decoder as M

# bfloat16 moves the gap between the default model's top two tokens by 0.05 at the median, 0.24 at
# the 99th percentile and 0.77 at most (benchmarks/probes/bf16_gaps.py, docs/journal/2026-11-23_reading-a-mismatch.md): a pair of
# tokens closer than this may swap under rounding; one further apart rarely does.
TIE = 0.5
NEAR_TIE, DIFFERS = "near-tie", "DIFFERS"


@dataclasses.dataclass
class Row:
    """A row whose outputs differ. `position` indexes the generated tokens; `a` and `b` are the
    tokens there (None where that output has ended). A row in one file only (`only_in`) has none.
    The rest comes from the target model: `gap` is the logit of `a` minus that of `b`, ranks
    count from 1 (the target's greedy choice), and `verdict` is NEAR_TIE, DIFFERS or None (not
    scored: no prompts)."""

    id: Any
    position: int | None = None
    a: int | None = None
    b: int | None = None
    only_in: str | None = None
    a_text: str | None = None
    b_text: str | None = None
    gap: float | None = None
    a_rank: int | None = None
    b_rank: int | None = None
    a_prob: float | None = None
    b_prob: float | None = None
    verdict: str | None = None


def compare(model, a: Sequence[dict], b: Sequence[dict], prompts: Sequence | None = None, *, chat: bool = True,
            tie: float = TIE) -> list[Row]:
    """The rows of records `a` and `b` (matched by id) that differ, in A's order, then B's extra
    ids. With `model`, tokens get their text; with `prompts` too (those that produced the records,
    as `Model.requests` takes them, encoded with `chat` as the run did), the target's scores and a
    verdict: NEAR_TIE when |gap| < `tie`."""
    rows = differences(a, b)
    if model is not None and model.tokenizer is not None:
        for row in rows:
            row.a_text, row.b_text = (None if t is None else model.tokenizer.decode([t]) for t in (row.a, row.b))
    if prompts is not None:
        score(model, rows, a, b, prompts, chat, tie)
    return rows


def differences(a: Sequence[dict], b: Sequence[dict]) -> list[Row]:
    """Rows (id, first differing position and tokens) of the records that differ."""
    by_a, by_b = ({rec["id"]: rec for rec in records} for records in (a, b))
    rows = []
    for key in [*by_a, *(i for i in by_b if i not in by_a)]:
        if key not in by_a or key not in by_b:
            rows.append(Row(key, only_in="A" if key in by_a else "B", verdict=DIFFERS))
            continue
        ta, tb = by_a[key]["token_ids"], by_b[key]["token_ids"]
        if ta == tb:
            continue
        p = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        at = lambda tokens: tokens[p] if p < len(tokens) else None
        # One output ending where the other goes on is no near-tie (EOS is a token of its own).
        verdict = None if p < min(len(ta), len(tb)) else DIFFERS
        rows.append(Row(key, p, at(ta), at(tb), verdict=verdict))
    return rows


def score(model, rows: Sequence[Row], a: Sequence[dict], b: Sequence[dict], prompts: Sequence, chat: bool,
          tie: float) -> None:
    """Fill in the target's scores and verdict of each row with two tokens, in place, after checking
    that every record both files hold (scored or not) belongs to `prompts` as encoded with `chat`."""
    requests = {r.id: r for r in model.requests(prompts, chat)}
    in_both = {rec["id"] for rec in a} & {rec["id"] for rec in b}
    # A wrong prompts file or chat setting shows here, on any row, whether it differs or not.
    for record in (rec for rec in [*a, *b] if rec["id"] in in_both):
        if record["id"] not in requests:
            raise JspecError(f"id {json.dumps(record['id'])} of the outputs is not among the prompts")
        prompt = requests[record["id"]].token_ids
        if record.get("prompt_tokens", len(prompt)) != len(prompt):
            raise JspecError(f"prompt {json.dumps(record['id'])} encodes to {len(prompt)} tokens, its record says "
                             f"{record['prompt_tokens']}: give the prompts that produced the outputs, "
                             f"with --no-chat if they had it")
    by_a = {rec["id"]: rec for rec in a}
    vocab = model.cfg.vocab_size
    for row in (row for row in rows if row.a is not None and row.b is not None):
        prompt = requests[row.id].token_ids
        tokens = prompt + by_a[row.id]["token_ids"][:row.position]
        if max(tokens + [row.a, row.b]) >= vocab:
            raise JspecError(f"row {json.dumps(row.id)} holds token ids beyond the model's vocabulary of {vocab}")
        padded = np.zeros((1, prompt_bucket(len(tokens))), np.int32)
        padded[0, :len(tokens)] = tokens
        gap, ranks, probs = jax.device_get(_scores(model.params, jnp.asarray(padded), len(tokens) - 1,
                                                   jnp.asarray([row.a, row.b]), cfg=model.cfg))
        row.gap = float(gap)
        row.a_rank, row.b_rank = (int(r) for r in ranks)
        row.a_prob, row.b_prob = (float(p) for p in probs)
        row.verdict = NEAR_TIE if abs(row.gap) < tie else DIFFERS


@functools.partial(jax.jit, static_argnames="cfg")
def _scores(params, tokens, last, pair, *, cfg):
    """The target's next token after tokens[0, :last + 1] (right padding after it is never seen):
    the logit of pair[0] minus pair[1]'s, and their ranks (1 = top) and probabilities."""
    h, _ = M.forward(params, cfg, tokens, None, M.KVCache.zeros(cfg, 1, tokens.shape[1]))
    logits = M.logits(params, cfg, h[0, last])
    chosen = logits[pair]
    ranks = 1 + jnp.sum(logits[None, :] > chosen[:, None], axis=1)
    return chosen[0] - chosen[1], ranks, jax.nn.softmax(logits)[pair]


# -- the report ----------------------------------------------------------------------------------

def describe(row: Row) -> str:
    """One line about a differing row."""
    name = f"id {json.dumps(row.id, ensure_ascii=False)}"
    if row.only_in is not None:
        return f"{name}: only in {row.only_in}: {row.verdict}"
    sides = []
    for side, token, text, rank, prob in (("A", row.a, row.a_text, row.a_rank, row.a_prob),
                                          ("B", row.b, row.b_text, row.b_rank, row.b_prob)):
        if token is None:
            sides.append(f"{side} ends ({row.position} tokens)")
            continue
        words = f"{side} {token}" + (f" {json.dumps(text, ensure_ascii=False)}" if text is not None else "")
        sides.append(words + (f" (rank {rank}, p={prob:.3g})" if rank is not None else ""))
    line = f"{name}, token {row.position}: {sides[0]} vs {sides[1]}"
    if row.gap is not None:
        line += f", A-B logit gap {row.gap:+.3f}"
    return line + (f": {row.verdict}" if row.verdict is not None else "")


def summary(rows: Sequence[Row], total: int, tie: float) -> str:
    """The last line: how many rows are identical, and what the others are."""
    line = f"{total - len(rows)}/{total} rows identical"
    if not rows:
        return line
    counts = {verdict: sum(row.verdict == verdict for row in rows) for verdict in (NEAR_TIE, DIFFERS, None)}
    parts = {NEAR_TIE: f"near-tie (|gap| < {tie:g} logits: rounding)", DIFFERS: "DIFFERS",
             None: "unscored (the logit gaps need --prompts IN.jsonl)"}
    return f"{line}; {len(rows)} differ: " + ", ".join(f"{n} {parts[v]}" for v, n in counts.items() if n)
