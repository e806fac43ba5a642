"""`jspec compare`: where two outputs of the same prompts part, and whether a near-tie explains it.
Exits 1 when they differ, like `diff`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from jspec.bench.compare import TIE
from jspec.cli.common import UsageError, add_model_options, load_model
from jspec.errors import JspecError

HELP = "compare two outputs of the same prompts; say whether they differ by a near-tie"
DESCRIPTION = ("Compare two outputs of `jspec generate --prompts` row by row (matched by id). For each row that "
               "differs, print the first differing generated token of each and, with --prompts, the target model's "
               "logits there (a teacher-forced forward in --dtype, float32 unless told otherwise, over the prompt "
               "and the tokens both outputs share): the logit of A's token minus B's, their ranks and "
               "probabilities, and a verdict, near-tie or DIFFERS. Exit status: 0 when all rows are identical, 1 "
               "when some differ, 2 on bad input.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A.jsonl", help="one output, say the reference (--method ar, float32)")
    p.add_argument("b", metavar="B.jsonl", help="the other output")
    p.add_argument("--prompts", metavar="IN.jsonl",
                   help="the prompts that produced both outputs; the logit gaps need them (and the model)")
    p.add_argument("--no-chat", action="store_true", help="the outputs were generated with --no-chat")
    p.add_argument("--tie", type=float, default=TIE, metavar="LOGITS",
                   help="two tokens whose target logits are closer than this are a near-tie, which rounding "
                        "may flip: bfloat16 moves the gap between the default model's top two tokens by less "
                        "than 0.25 at 99%% of positions (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per differing row instead of a line (the summary goes to stderr)")
    add_model_options(p, decodes=False)


def run(args: argparse.Namespace) -> int:
    from jspec.bench import compare
    from jspec.jsonl import read_prompts, read_records

    if not (math.isfinite(args.tie) and args.tie >= 0):
        raise JspecError(f"--tie must be a number >= 0, got {args.tie}")
    scoring = args.model is not None or args.mesh is not None or args.no_chat or args.dtype is not None or \
        args.tie != compare.TIE
    if args.prompts is None and scoring:
        raise UsageError("--model, --dtype, --mesh, --no-chat and --tie score the differences: they go with "
                          "--prompts IN.jsonl")
    a, b = read_records(args.a), read_records(args.b)
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    rows = compare.differences(a, b)
    if rows and prompts is not None:  # the model only loads when there is something to score
        rows = compare.compare(load_model(args), a, b, prompts, chat=not args.no_chat, tie=args.tie)
    for row in rows:
        print(json.dumps(dataclasses.asdict(row), ensure_ascii=False) if args.json else compare.describe(row))
    total = len({r["id"] for r in a} | {r["id"] for r in b})
    print(compare.summary(rows, total, args.tie), file=sys.stderr if args.json else sys.stdout)
    return 1 if rows else 0
