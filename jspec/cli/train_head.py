"""`jspec train-head`: an EESD exit layer, a Kangaroo adapter or an EAGLE head trained on distillation
data (jspec.training.train_head)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jspec.cli.common import add_model_options, load_model
from jspec.errors import JspecError

HELP = "train an EESD exit layer, a Kangaroo adapter or an EAGLE head on distillation data"
DESCRIPTION = ("Train a draft head on the data of `jspec distill-data`, checkpointing under OUT.train "
               "(rerunning the same command resumes), then save the head to OUT.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jspec.parts.heads import KINDS
    from jspec.training.train_head import Recipe

    r = Recipe()
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--exit-layer", type=int, default=None, metavar="N",
                   help="eesd, kangaroo (required): draft from the first N layers; an eagle head reads the last "
                        "layer's state")
    p.add_argument("--head-layers", type=int, default=r.head_layers, metavar="D",
                   help="the head's own layers, started from the target's layers N .. N+D-1 (eagle: its last D) "
                        "(default: %(default)s)")
    p.add_argument("--data", required=True, nargs="+", metavar="DIR", help="jspec distill-data folders")
    p.add_argument("--eval-data", nargs="*", default=[], metavar="DIR",
                   help="held-out distill-data folders; their prompts are left out of training "
                        "(default: hold out --eval-fraction of the prompts)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the trained head goes")
    p.add_argument("--steps", type=int, default=r.steps, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=r.batch_size, metavar="N", help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=r.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=r.warmup, metavar="STEPS", help="(default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=r.weight_decay, help="(default: %(default)s)")
    p.add_argument("--b1", type=float, default=r.b1, help="AdamW beta 1 (default: %(default)s)")
    p.add_argument("--b2", type=float, default=r.b2, help="AdamW beta 2 (default: %(default)s)")
    p.add_argument("--clip", type=float, default=r.clip, help="gradient norm clip (default: %(default)s)")
    p.add_argument("--ce-weight", type=float, default=r.ce_weight,
                   help="weight of cross-entropy on the answer tokens, added to the KL (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=r.draft_vocab, metavar="M",
                   help="draft-only vocabulary: the M most frequent answer tokens; 0 = all (default: %(default)s)")
    p.add_argument("--init", default=r.init, metavar="HEAD",
                   help="start from this trained head (same kind and exit layer; its draft vocabulary is kept), "
                        "e.g. to go on training a shipped head on new data; a larger --head-layers grows it "
                        "by layers that start out adding nothing")
    p.add_argument("--eval-fraction", type=float, default=r.eval_fraction, help="(default: %(default)s)")
    p.add_argument("--save-every", type=int, default=r.save_every, metavar="STEPS", help="(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=r.eval_every, metavar="STEPS",
                   help="measure held-out agreement this often, keep the best head, stop after --patience "
                        "measurements without a gain; 0: only at the end (default: %(default)s)")
    p.add_argument("--patience", type=int, default=None,
                   help=f"with --eval-every: measurements without a gain before stopping (default: {r.patience})")
    p.add_argument("--seed", type=int, default=r.seed, help="(default: %(default)s)")
    add_model_options(p, decodes=False)


def run(args: argparse.Namespace) -> int:
    from jspec import files
    from jspec.parts import heads
    from jspec.training import distill, train_head

    recipe = train_head.Recipe(kind=args.kind, exit_layer=args.exit_layer, head_layers=args.head_layers, steps=args.steps, batch_size=args.batch_size,
                          lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, b1=args.b1, b2=args.b2,
                          clip=args.clip, ce_weight=args.ce_weight, draft_vocab=args.draft_vocab, init=args.init,
                          eval_fraction=args.eval_fraction, save_every=args.save_every,
                          eval_every=args.eval_every, seed=args.seed,
                          **({} if args.patience is None else {"patience": args.patience}))
    recipe.check()
    if args.patience is not None and not args.eval_every:
        raise JspecError("--patience goes with --eval-every N: without measurements nothing stops early")
    if args.exit_layer is None and args.kind != "eagle":
        raise JspecError(f"--kind {args.kind} needs --exit-layer N")
    distill.check_distinct(args.data + args.eval_data)
    for folder in args.data + args.eval_data:
        distill.read_meta(folder)
    if args.init:
        heads.read_meta(args.init)  # before the model loads
    files.check_output(args.out, heads.FOLDER.marker)
    model = load_model(args)
    if args.exit_layer is None:
        recipe = dataclasses.replace(recipe, exit_layer=model.cfg.num_layers)
    path, summary = train_head.train(model, args.data, args.out, recipe, eval_dirs=args.eval_data)
    print(f"saved {path}: held-out agreement {summary['agreement']:.3f}, expected acceptance "
          f"{summary['expected_acceptance']:.3f}, {summary['wall_seconds']:.0f} s", file=sys.stderr)
    return 0
