"""`jspec search-skip`: one domain's sublayer skip set for knn-ssd, searched by Bayesian
optimisation (jspec.training.search_skip); resumable."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jspec import prompt_sets
from jspec.cli.common import add_model_options, load_model
from jspec.errors import JspecError

HELP = "search a domain's sublayer skip set (knn-ssd)"
DESCRIPTION = ("Bayesian optimisation (Optuna) of which attention and MLP sublayers a layer-skip draft leaves out, "
               "by measured tokens/s on a few of the domain's prompts; resumable.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, metavar="IN.jsonl",
                   help=f"the domain's prompts: a file (.gz too) or a set jspec ships ({', '.join(prompt_sets.SETS[1:])})")
    p.add_argument("--category", default=None, help="only the prompts whose \"category\" is this")
    p.add_argument("--out", required=True, metavar="OUT.json", help="the searched set (OUT.trials.jsonl logs the trials)")
    p.add_argument("--name", default=None, help="the domain's name (default: OUT's file name without .json)")
    p.add_argument("--trials", type=int, default=40, help="trials in all, warm starts included (default: %(default)s)")
    p.add_argument("--count", type=int, default=8, help="prompts timed per trial (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N", help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and sampler seed (default: %(default)s)")
    p.add_argument("--objective", default="measured", choices=("measured", "modeled"),
                   help="tokens/s as timed, or tokens per modeled cost (see jspec.training.search_skip; default: %(default)s)")
    p.add_argument("--all-buckets", action="store_true",
                   help="time prompts of any length (a program per prompt bucket), not one bucket's")
    add_model_options(p)


def run(args: argparse.Namespace) -> int:
    from jspec.parts import knn
    from jspec.training import search_skip

    if args.trials < 1 or args.count < 1 or args.max_new_tokens < 1:
        raise JspecError("--trials, --count and --max-new-tokens must be >= 1")
    out = Path(args.out)
    if out.suffix != ".json":
        raise JspecError(f"--out {out} must name a .json file (jspec fit-knn gathers the sets as *.json)")
    if out.exists():
        knn.read_set(out)  # an earlier search's set may be replaced, nothing else
    name = args.name or out.name.removesuffix(".json")
    prompts = search_skip.domain_prompts(args.prompts, args.category)
    model = load_model(args)
    best, value, row = search_skip.search_set(
        model, prompts, out, name, source=str(args.prompts), category=args.category, trials=args.trials,
        count=args.count, max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed, objective=args.objective, one_bucket=not args.all_buckets)
    print(f"{out}: attention {list(best.attention)}, mlp {list(best.mlp)}: {args.objective} {value:.3f} "
          f"({row['mean_accepted_tokens']:.2f} accepted) after {best.info['search']['trials']} trials", file=sys.stderr)
    return 0
