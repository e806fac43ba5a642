"""`jspec calibrate`: what a decoding round costs on this device at each draft length, for a model,
method and batch size (the costs `--pricing` decides by), and the draft length they choose at a
few acceptance rates."""

from __future__ import annotations

import argparse

from jspec.cli.common import add_generation_options, add_model_options, check_generation_args, load_model
from jspec.errors import JspecError

HELP = "time a decoding round at each draft length on this device (what --pricing decides by)"
DESCRIPTION = ("Time a round of --method at each draft length 0..K (0: a plain decoding step) for a batch of "
               "--batch-size prompts on this device, and print the draft length a priced round chooses at a few "
               "acceptance rates. The prompts are the first of --prompts (default: the shipped training prompts).")
RATES = (0.2, 0.4, 0.6, 0.8, 0.9)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="train_prompts", metavar="SET|IN.jsonl",
                   help="a shipped prompt set's name or a JSONL file (default: %(default)s)")
    add_model_options(p)
    add_generation_options(p)


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from jspec import methods, prompt_sets
    from jspec.cli.common import generation_options
    from jspec.engine.pricing import draft_length
    from jspec.jsonl import read_prompts

    check_generation_args(args)
    method = methods.get(args.method)
    if not method.drafts or not method.lossless:
        raise JspecError(f"--method {args.method} is not priced: pricing is for the lossless methods that draft "
                         f"({', '.join(m for m in methods.LOSSLESS if methods.get(m).drafts)})")
    options = {k: v for k, v in generation_options(args).items() if k in methods.OPTIONS}
    prompts = read_prompts(prompt_sets.resolve(args.prompts))[:args.batch_size]
    model = load_model(args)
    costs = model.calibrate(prompts, args.method, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            **options)
    print(f"{args.method} at batch size {args.batch_size}, {model.platform}: milliseconds a round by draft length")
    print("  k       ms  x plain step")
    for k, c in enumerate(costs):
        print(f"{k:>3}  {1000 * c:7.2f}  {c / costs[0]:6.2f}")
    rows = jnp.ones((args.batch_size,), bool)
    chosen = [int(draft_length(jnp.asarray(costs), jnp.full(rows.shape, 1000 * r), jnp.full(rows.shape, 1000), rows))
              for r in RATES]
    print("acceptance rate  " + "  ".join(f"{r:4.1f}" for r in RATES))
    print("draft length     " + "  ".join(f"{k:>4}" for k in chosen))
    return 0
