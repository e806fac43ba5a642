"""Offline: how many tokens a round prompt lookup, and prompt lookup with a datastore behind it,
would accept on `ar`'s own outputs, for datastores built from more or fewer answers.

Replays greedy decoding over the `ar` records of a `jspec bench` results file (Spec-Bench
questions, with their token ids): each round proposes up to K tokens (a repeat in the text so
far, else the datastore's chain), keeps the leading ones that equal `ar`'s, and adds one. No
model runs, so this measures drafts, not speed.

    python benchmarks/probes/datastore_offline.py --answers ANSWERS_DIR --results benchmarks/results/2026-11-26_specee-lookup-39.jsonl \
        --shards 25,50,112
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json

import numpy as np

import jspec
from jspec.parts import datastore
from jspec.prompt_sets import resolve

K = 4


def repeat(ctx: list[int], n: int = 2) -> list[int]:
    """What followed the most recent earlier occurrence of the last n tokens (prompt lookup)."""
    for j in range(len(ctx) - n - 1, -1, -1):
        if ctx[j:j + n] == ctx[-n:]:
            return ctx[j + n:j + n + K]
    return []


def chain(table: dict, ctx: list[int]) -> list[int]:
    """The datastore's draft (jspec.parts.datastore.lookup, as a dict: tests/parts/test_datastore.py checks they agree)."""
    ctx, out = list(ctx), []
    for _ in range(K):
        token = table.get(tuple(ctx[-3:]), table.get((-1, *ctx[-2:])))
        if token is None:
            break
        out.append(token)
        ctx.append(token)
    return out


def tokens_per_round(rows, propose) -> float:
    rounds = tokens = 0
    for prompt, answer in rows:
        text, i = prompt + answer, len(prompt)
        while i < len(text):
            draft = propose(text[:i])
            m = 0
            while m < len(draft) and i + m < len(text) and draft[m] == text[i + m]:
                m += 1
            rounds, tokens, i = rounds + 1, tokens + m + 1, i + m + 1
    return tokens / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", required=True, help="a jspec distill-data answer folder")
    ap.add_argument("--results", required=True, help="jspec bench results with ar rows (token_ids)")
    ap.add_argument("--shards", default="112", help="build datastores from the first N shards, for each N")
    args = ap.parse_args()
    model = jspec.load()
    questions = {q["question_id"]: q for q in map(json.loads, gzip.open(resolve("spec_bench"), "rt"))}
    records = [json.loads(line) for line in open(args.results)]
    rows = [(model.encode([{"role": "user", "content": questions[r["id"]]["turns"][0]}]), r["token_ids"])
            for r in records if r["method"] == "ar" and r["batch_size"] == 1]
    print(f"{len(rows)} questions; prompt lookup alone: {tokens_per_round(rows, repeat):.3f} tokens a round")
    files = sorted(glob.glob(f"{args.answers}/shard-*[0-9].npz"))
    for n in map(int, args.shards.split(",")):
        sequences = []
        for f in files[:n]:
            z = np.load(f)
            sequences += [(row[:p + a], int(p)) for row, p, a in zip(z["tokens"], z["prompt_lens"], z["answer_lens"])]
        t = datastore.build(sequences)
        table = {tuple(k): int(v) for k, v in zip(t["ngram_keys"].tolist(), t["ngram_next"])}
        got = tokens_per_round(rows, lambda ctx: repeat(ctx) or chain(table, ctx))
        print(f"{len(sequences)} answers, {len(table)} n-grams: prompt lookup, else the datastore: {got:.3f} tokens a round")


if __name__ == "__main__":
    main()
