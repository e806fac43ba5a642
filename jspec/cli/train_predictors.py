"""`jspec train-predictors`: SpecEE's exit predictors, trained on the model's own answers
(jspec.training.train_predictors)."""

from __future__ import annotations

import argparse
import sys

from jspec import prompt_sets
from jspec.cli.common import add_model_options, load_model
from jspec.errors import JspecError

HELP = "train SpecEE's exit predictors on the model's own answers"
DESCRIPTION = ("Let the model answer training prompts, record at every layer from the head's on whether "
               "that layer's choice among the head's 4 candidates is already the final token, and fit "
               "one predictor per layer (held-out accuracy and precision go into OUT/predictors.json).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=prompt_sets.TRAIN_PROMPTS, metavar="IN.jsonl",
                   help="training prompts: a file (.gz too) or a shipped training set (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the predictors go")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="the Kangaroo or EESD head whose top 4 are the candidates (default: the shipped Kangaroo head)")
    p.add_argument("--count", type=int, default=256, help="prompts to answer (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=192, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="answer length (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=30, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="rows per decoding batch (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    add_model_options(p, decodes=False)


def run(args: argparse.Namespace) -> int:
    from jspec import files
    from jspec.jsonl import read_prompts
    from jspec.parts import predictors
    from jspec.training import train_predictors

    source = prompt_sets.resolve(args.prompts)
    if source.name in ("spec_bench.jsonl", "spec_bench.jsonl.gz"):
        raise JspecError("spec_bench is the evaluation set: train on training prompts")
    prompts = read_prompts(source)
    files.check_output(args.out, predictors.FOLDER.marker)
    model = load_model(args)
    path, summary = train_predictors.make(model, prompts, args.out, head=args.head, count=args.count,
                                    max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                    epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    print(f"saved {path}: {summary['samples_per_depth']} samples per layer, loss {summary['first_loss']} -> "
          f"{summary['final_loss']}, {summary['mean_layers_at_0.5']} layers per token at 0.5 "
          f"(oracle {summary['oracle_mean_layers']}), {summary['wall_seconds']:.0f} s", file=sys.stderr)
    return 0
