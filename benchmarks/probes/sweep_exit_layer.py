"""Exit-layer sweep: train a head at each exit layer, then measure agreement, mean accepted
tokens and end-to-end speedup on held-out training prompts (never Spec-Bench: the defaults are
chosen from this table, so it must not see the evaluation set).

    python benchmarks/probes/sweep_exit_layer.py --kind eesd --layers 2,4,6,8,10,12 --steps 200 \\
        --data ~/jspec-data/distill --heads ~/jspec-heads

Heads go to HEADS/KIND-N (an existing head is reused; training resumes if interrupted). The
held-out prompts are written to benchmarks/probes/heldout_prompts.jsonl: prompts of train_prompts.jsonl
from the far end of the shuffled order `jspec distill-data` draws from (seed 0), so none is in
the distillation data. Prints a Markdown table (docs/heads.md, section 3, holds the measured ones).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELDOUT = HERE / "heldout_prompts.jsonl"
TRAIN = HERE.parents[1] / ".." / "shared" / "data" / "train_prompts.jsonl"


def heldout_prompts(per_category: int) -> None:
    rows = [json.loads(line) for line in TRAIN.read_text(encoding="utf-8").split("\n") if line.strip()]
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)  # the order jspec distill-data --seed 0 takes prompts in
    picked, seen = [], {}
    for i in reversed(order):
        cat = rows[i]["category"]
        if seen.get(cat, 0) < per_category and len(rows[i]["prompt"]) < 1000:
            seen[cat] = seen.get(cat, 0) + 1
            picked.append({"id": rows[i]["id"], "category": cat, "prompt": rows[i]["prompt"]})
    picked.sort(key=lambda r: (r["category"], r["id"]))
    HELDOUT.write_text("".join(json.dumps(r) + "\n" for r in picked))


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="eesd")
    ap.add_argument("--layers", default="2,4,6,8,10,12")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--data", required=True)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--output", default=str(HERE.parent / "results" / time.strftime("%Y-%m-%d_sweep-exit-layer.jsonl")))
    args = ap.parse_args()
    layers = [int(n) for n in args.layers.split(",")]
    heldout_prompts(args.per_category)
    heads = {}
    for n in layers:
        out = Path(args.heads) / f"{args.kind}-{n}"
        if not (out / "head.json").exists():
            run(["jspec", "train-head", "--kind", args.kind, "--exit-layer", str(n), "--steps", str(args.steps),
                 "--data", args.data, "--out", str(out)])
        heads[n] = out
    methods = ",".join(["ar"] + [f"{args.kind}:head={heads[n]}" for n in layers])
    run(["jspec", "bench", "--methods", methods, "--prompts", str(HELDOUT), "--max-new-tokens",
         str(args.max_new_tokens), "--output", args.output, "--resume"])
    rows = [json.loads(line) for line in Path(args.output).read_text().split("\n") if line.strip()]
    tps = lambda m: statistics.mean(r["tokens_per_second"] for r in rows if r["method"] == m and r["batch_size"] == 1)
    ar = tps("ar")
    lines = ["| exit layer N | held-out agreement | expected acceptance | mean accepted tokens | tokens/s | "
             "speedup vs ar |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in layers:
        m = f"{args.kind}:head={heads[n]}"
        t = json.loads((heads[n] / "head.json").read_text())["training"]
        acc = statistics.mean(r["mean_accepted_tokens"] for r in rows if r["method"] == m and r["batch_size"] == 1)
        lines.append(f"| {n} | {t['agreement']:.3f} | {t['expected_acceptance']:.3f} | {acc:.2f} | {tps(m):.1f} | "
                     f"{tps(m) / ar:.2f}x |")
    lines.append(f"\n`ar`: {ar:.1f} tokens/s on the same {len(rows) // (len(layers) + 1)} held-out prompts.")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
