"""`jspec build-datastore`: the datastore (jspec.parts.datastore) of the model's own greedy answers,
for ngram and --lookup."""

from __future__ import annotations

import os
from pathlib import Path

from jspec.errors import JspecError
from jspec.parts import datastore, folder
from jspec.training import distill


def check_args(min_count: int, min_share: float) -> None:
    if min_count < 1 or not 0 < min_share <= 1:
        raise JspecError("--min-count must be >= 1 and --min-share in (0, 1]")


def read_answers(data_dirs) -> list[tuple[str, dict, dict]]:
    """(folder, meta, arrays) of each answer folder, refused unless they are greedy answers."""
    distill.check_distinct(data_dirs)
    answers = [(d, *distill.load(d)) for d in data_dirs]
    for d, meta, _ in answers:
        if meta.get("source", "answers") != "answers" or meta.get("temperature", 0.0) != 0.0:
            raise JspecError(f"{d} is not greedy answers of the model (jspec distill-data --source answers)")
    return answers


def make(model, answers: list[tuple[str, dict, dict]], out: str | os.PathLike, *, min_count: int = 2,
         min_share: float = 0.5):
    """Build and save the table of `answers` (read_answers: the model's own); returns (path,
    entries, answers, answer tokens)."""
    check_args(min_count, min_share)
    for d, meta, _ in answers:
        if meta.get("model") != model.name:
            raise JspecError(f"{d} holds answers of {meta.get('model')}, not of {model.name} "
                             "(name the model as jspec distill-data was given it)")
    sequences = [(row[:p + a], int(p)) for _, _, data in answers
                 for row, p, a in zip(data["tokens"], data["prompt_lens"], data["answer_lens"])]
    table = datastore.build(sequences, min_count, min_share)
    if not len(table["ngram_next"]):
        raise JspecError("no n-gram of the data passes --min-count and --min-share: nothing to save")
    tokens = int(sum(len(t) - p for t, p in sequences))
    path = datastore.save(out, table, {"model": folder.fingerprint(model.cfg), "model_name": model.name,
                                       "data": [{"folder": str(Path(d).absolute()), **meta} for d, meta, _ in answers],
                                       "answers": len(sequences), "answer_tokens": tokens, "min_count": min_count,
                                       "min_share": min_share, "entries": len(table["ngram_next"])})
    return path, len(table["ngram_next"]), len(sequences), tokens
