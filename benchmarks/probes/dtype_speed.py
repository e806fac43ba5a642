"""Tokens/s of `ar` and a trained head (eesd) in float32 and bfloat16, batch 1 and 8, over the
held-out prompts: the cost of what a dtype's numerics choose (docs/journal/2026-11-23_batch-invariance-bfloat16.md). It uses
only jspec's public API, so one checkout can time another side by side:

    python benchmarks/probes/dtype_speed.py                                   # this checkout
    PYTHONPATH=/path/to/older/checkout python benchmarks/probes/dtype_speed.py # the same runs, before
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jspec

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--runs", default="ar:1,eesd:1,ar:8", help="method:batch_size pairs")
    ap.add_argument("--prompts", type=int, default=12, help="the first N held-out prompts")
    args = ap.parse_args()
    lines = (HERE / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line][:args.prompts]
    print(f"jspec at {Path(jspec.__file__).parent.parent}; {len(prompts)} prompts, {args.max_new_tokens} new tokens\n")
    print("| dtype | method | batch | tokens/s |\n| --- | --- | ---: | ---: |")
    for dtype in ("float32", "bfloat16"):
        model = jspec.load(dtype=dtype)
        for method, batch in (r.split(":") for r in args.runs.split(",")):
            batch = int(batch)
            rates = []  # the first run compiles each prompt bucket's program, the second is timed clean
            for _ in range(2):
                t0 = time.perf_counter()
                records = model.generate(prompts, method, max_new_tokens=args.max_new_tokens, batch_size=batch)
                rates.append(sum(r["new_tokens"] for r in records) / (time.perf_counter() - t0))
            print(f"| {dtype} | {method} | {batch} | {max(rates):.1f} |", flush=True)


if __name__ == "__main__":
    main()
