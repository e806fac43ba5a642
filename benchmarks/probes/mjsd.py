"""MJSD against greedy `ar` and the lossless method with the same drafter and K: speed, mean
accepted tokens, and the mean NLL of the outputs under the full model (jspec.bench.quality).

Spec-Bench first turns (the first `--limit` of each category), batch 1, greedy, default model.
Every method runs once untimed on the first prompt (compiling), then prompt by prompt every method
runs in turn, so load on the machine falls on all of them alike; a run that compiled a program (a
new prompt bucket) is run again and the second run is timed. tokens/s is total new tokens /
total wall time; mean accepted tokens is total new tokens / total rounds (target forwards).

    python benchmarks/probes/mjsd.py --limit 1 --max-new-tokens 128 \\
        --methods "ar,eesd:max_draft=4;controller=fixed,mjsd,mjsd:accept_threshold=0.1,..."

Each result is also appended to --output as one JSON line (default: today's
benchmarks/results/DATE_mjsd.jsonl; docs/journal/2026-11-23_mjsd.md names each run's file, the
first runs' benchmarks/results/2026-11-23_mjsd-first-head.jsonl).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jspec
from jspec import prompt_sets
from jspec.engine.programs import steady_run
from jspec.bench import quality
from jspec.bench.specs import parse_methods, read_bench_prompts

DEFAULT_METHODS = "ar,eesd:max_draft=4;controller=fixed,mjsd"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="jspec bench --methods syntax")
    ap.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category")
    ap.add_argument("--categories", default=None, help="comma-separated Spec-Bench categories (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--output", default=time.strftime("benchmarks/results/%Y-%m-%d_mjsd.jsonl"))
    args = ap.parse_args()

    model = jspec.load()
    prompts = read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH), args.limit)
    if args.categories:
        prompts = [p for p in prompts if p["category"] in args.categories.split(",")]
    requests = model.requests(prompts)
    specs = parse_methods(args.methods)
    plans = {s.label: (s.name, dict(s.options)) for s in specs}

    def run(label, req):
        name, options = plans[label]
        [record] = steady_run(
            model, lambda: list(model.stream([req], name, max_new_tokens=args.max_new_tokens, **options)))
        return record

    for label in plans:  # compile
        run(label, requests[0])
    totals = {label: {"tokens": 0, "seconds": 0.0, "rounds": 0, "pairs": []} for label in plans}
    for req in requests:
        for label in plans:
            r = run(label, req)
            t = totals[label]
            t["tokens"] += r["new_tokens"]
            t["seconds"] += r["seconds"]
            t["rounds"] += r["stats"]["rounds"]
            t["pairs"].append((req.token_ids, r["token_ids"]))

    ar = totals[specs[0].label]
    ar_rate = ar["tokens"] / ar["seconds"]
    print(f"{len(requests)} prompts ({args.limit} per category of {args.categories or 'all'}), batch 1, "
          f"{args.max_new_tokens} new tokens, greedy\n")
    print("| method | tokens/s | vs ar | mean accepted tokens | output NLL | NLL vs ar |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ar_nll = quality.mean_nll(model, ar["pairs"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(args.output, "a") as out:
        for label, t in totals.items():
            rate = t["tokens"] / t["seconds"]
            nll = quality.mean_nll(model, t["pairs"])
            row = {"method": label, "tokens_per_second": round(rate, 3), "speedup": round(rate / ar_rate, 4),
                   "mean_accepted_tokens": round(t["tokens"] / t["rounds"], 4), "nll": round(nll, 4),
                   "ar_nll": round(ar_nll, 4), "prompts": len(requests), "max_new_tokens": args.max_new_tokens,
                   "machine": platform.node(), "time": stamp}
            out.write(json.dumps(row) + "\n")
            print(f"| `{label}` | {rate:.1f} | {rate / ar_rate:.2f}x | {row['mean_accepted_tokens']:.2f} | "
                  f"{nll:.3f} | {nll - ar_nll:+.3f} |")


if __name__ == "__main__":
    main()
