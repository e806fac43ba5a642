"""`jspec build-datastore`: what the model writes after 2-3 tokens, tabulated from its own answers,
for ngram and --lookup (jspec.training.build_datastore)."""

from __future__ import annotations

import argparse
import sys

from jspec.cli.common import add_model_options, load_model

HELP = "tabulate what the model writes after 2-3 tokens, for ngram and --lookup"
DESCRIPTION = ("From the model's own answers (jspec distill-data folders), keep for each bigram and trigram the "
               "token it wrote next most often, where that is clear enough, in a table that prompt lookup falls "
               "back on (--datastore).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="answer folders of jspec distill-data (the model's own answers)")
    p.add_argument("--out", required=True, metavar="DIR", help="the datastore folder")
    p.add_argument("--min-count", type=int, default=2, metavar="N",
                   help="keep a continuation written at least N times (default: %(default)s)")
    p.add_argument("--min-share", type=float, default=0.5, metavar="S",
                   help="... and after at least this share of the bigram's or trigram's occurrences (a single "
                        "token's entry, a guess, needs no share; default: %(default)s)")
    add_model_options(p, decodes=False)


def run(args: argparse.Namespace) -> int:
    from jspec import files
    from jspec.parts import datastore
    from jspec.training import build_datastore

    build_datastore.check_args(args.min_count, args.min_share)
    answers = build_datastore.read_answers(args.data)
    files.check_output(args.out, datastore.FOLDER.marker)
    model = load_model(args)
    path, entries, count, tokens = build_datastore.make(model, answers, args.out, min_count=args.min_count,
                                                        min_share=args.min_share)
    print(f"saved {path}: {entries} n-grams from {count} answers ({tokens} tokens)", file=sys.stderr)
    return 0
