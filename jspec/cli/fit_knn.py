"""`jspec fit-knn`: anchors for knn-ssd (k-means centres of each domain's prompt features), gathered
with the searched skip sets into one folder (jspec.training.fit_knn)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jspec.cli.common import add_model_options, load_model
from jspec.errors import JspecError

HELP = "fit knn-ssd anchors and gather the skip sets"
DESCRIPTION = ("Compute prompt features of each domain's prompts, keep k-means centres as anchors and write them "
               "with the searched skip sets into one folder for --method knn-ssd.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sets", required=True, metavar="DIR", help="the domains' sets from jspec search-skip (*.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="the knn-ssd folder to write")
    p.add_argument("--count", type=int, default=1000, help="prompts per domain at most (default: %(default)s)")
    p.add_argument("--centres", type=int, default=10, help="anchors per domain (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N",
                   help="leave out longer prompts (default: %(default)s)")
    p.add_argument("--no-anchors", default="", metavar="NAME,...", help="sets kept without anchors")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and k-means seed (default: %(default)s)")
    add_model_options(p, decodes=False)


def run(args: argparse.Namespace) -> int:
    from jspec import files
    from jspec.parts import knn
    from jspec.training import fit_knn

    paths = sorted(Path(args.sets).glob("*.json"))
    if not paths:
        raise JspecError(f"{args.sets} holds no skip sets (*.json from jspec search-skip)")
    if args.count < 1 or args.centres < 1:
        raise JspecError(f"--count and --centres must be >= 1, got {args.count} and {args.centres}")
    sets = [knn.read_set(p) for p in paths]
    bare = {n for n in args.no_anchors.split(",") if n}
    if bare - {s.name for s in sets}:
        raise JspecError(f"--no-anchors names no set in {args.sets}: {', '.join(sorted(bare - {s.name for s in sets}))}")
    if bare == {s.name for s in sets}:
        raise JspecError("--no-anchors names every set: the nearest-neighbour lookup would have nothing to find")
    files.check_output(args.out, knn.FOLDER.marker)
    model = load_model(args)
    out, anchors, domains = fit_knn.fit(model, sets, bare, Path(args.sets) / ".features", args.out, count=args.count,
                                        centres_per_domain=args.centres, max_prompt_tokens=args.max_prompt_tokens,
                                        seed=args.seed)
    print(f"{out}: {anchors} anchors over {domains} domains, {len(sets)} skip sets", file=sys.stderr)
    return 0
