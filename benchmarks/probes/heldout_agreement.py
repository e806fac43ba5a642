"""Held-out agreement of saved heads on the same rows, to compare heads trained on different data.

    python benchmarks/probes/heldout_agreement.py --data text/ --heads jspec/checkpoints/smollm2-135m-instruct/eesd new-eesd

Rows: those `jspec train-head` holds out with the same --data, --eval-data, --eval-fraction and
--seed (jspec.training.train.held_out), so a new head and a shipped one are measured alike.
"""

from __future__ import annotations

import argparse

import jspec
from jspec.parts.heads import read_meta
from jspec.training import train_head as train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--eval-data", nargs="*", default=[])
    p.add_argument("--eval-fraction", type=float, default=train.Recipe.eval_fraction)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", nargs="+", required=True)
    args = p.parse_args()
    lm = jspec.load()
    print("| head | kind | exit layer | held-out agreement | expected acceptance | held-out tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for head in args.heads:
        meta = read_meta(head)
        m = train.evaluate_head(lm, head, args.data + args.eval_data, len(args.data), args.eval_fraction, args.seed,
                                progress=True)
        print(f"| {head} | {meta['kind']} | {meta['exit_layer']} | {m['agreement']:.3f} | "
              f"{m['expected_acceptance']:.3f} | {m['held_out_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
