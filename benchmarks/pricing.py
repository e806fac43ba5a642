"""Priced rounds against unpriced ones and `ar`, side by side in one run (issue 75).

    python benchmarks/pricing.py --methods ar,ngram,eesd,kangaroo --batch-sizes 1,8 --limit 2 \\
        --output benchmarks/results/DATE_pricing.jsonl --markdown benchmarks/results/DATE_pricing.md

For each batch size and method the prompts (Spec-Bench's questions by default, `--limit` of each
category) run greedy, in one process: above batch size 1 (continuous batching) under
`--pricing off` and then `--pricing on`; at batch size 1 under the default (unpriced), which is
what `auto` runs there. Each run is done `--repeats` times, the methods taking turns within each
repeat, after one untimed run of each on the first batch of prompts (it compiles and, for a priced
run, measures the costs, which a run of thousands of prompts pays once: left out of the clock).
Per run: tokens/s over the Model's clock (compiles left out), tokens per round, and whether every
row is `ar`'s; the table gives the median over repeats and each method's ratio to `ar` in the same
repeat, its median and range. The costs a priced run measured are in its row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import jspec  # noqa: E402
from jspec import prompt_sets  # noqa: E402
from jspec.bench.specs import parse_methods, read_bench_prompts  # noqa: E402


def measure(model, requests, spec, batch_size: int, pricing: str, max_new: int) -> tuple[dict, list[dict]]:
    began = model.clock()
    records = list(model.stream(requests, spec.name, max_new_tokens=max_new, batch_size=batch_size,
                                pricing=pricing, **dict(spec.options)))
    seconds = model.clock() - began
    tokens = sum(r["new_tokens"] for r in records)
    rounds = sum(r["stats"]["rounds"] for r in records)
    row = {"method": spec.label, "batch_size": batch_size, "pricing": pricing, "prompts": len(requests),
           "new_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2),
           "tokens_per_round": round(tokens / rounds, 3), "drafted": sum(r["stats"]["drafted"] for r in records)}
    return row, records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,ngram")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="spec_bench")
    p.add_argument("--limit", type=int, default=None, help="the first N questions of each category")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each method, taking turns")
    p.add_argument("--output", required=True, help="JSONL, one row per run")
    p.add_argument("--markdown", default=None)
    args = p.parse_args()

    model = jspec.load(args.model, args.dtype)
    prompts = read_bench_prompts(prompt_sets.resolve(args.prompts), args.limit)
    requests = model.requests(prompts)
    rows = []
    with open(args.output, "w", encoding="utf-8") as out:
        for batch_size in map(int, args.batch_sizes.split(",")):
            runs = [(spec, pricing) for spec in parse_methods(args.methods)
                    for pricing in (("auto",) if spec.name in ("ar", "auto") or batch_size == 1 else ("off", "on"))]
            costs = {}
            for spec, pricing in runs:  # compiles, and measures a priced run's costs
                known = set(model._costs)
                measure(model, requests[:batch_size], spec, batch_size, pricing, args.max_new_tokens)
                costs[spec.label, pricing] = [model._costs[k].round(5).tolist() for k in model._costs if k not in known]
            ar_tokens = None
            for repeat in range(args.repeats):
                ar = None
                for spec, pricing in runs:
                    row, records = measure(model, requests, spec, batch_size, pricing, args.max_new_tokens)
                    tokens = {r["id"]: r["token_ids"] for r in records}
                    if spec.name == "ar":
                        ar, ar_tokens = row, ar_tokens or tokens
                    found = costs[spec.label, pricing]
                    row.update(repeat=repeat, costs=found[0] if found else None,
                               same_as_ar=None if ar_tokens is None else sum(ar_tokens[i] == t for i, t in tokens.items()),
                               vs_ar=None if ar is None else round(row["tokens_per_second"] / ar["tokens_per_second"], 3))
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(table(rows, args), encoding="utf-8")


def table(rows: list[dict], args) -> str:
    lines = [f"# Priced rounds against unpriced ones ({rows[0]['prompts']} prompts of {args.prompts}, "
             f"{args.max_new_tokens} new tokens, greedy, {args.repeats} repeats)", "",
             f"Command: `python benchmarks/pricing.py --methods {args.methods} --batch-sizes {args.batch_sizes} "
             f"--max-new-tokens {args.max_new_tokens} --repeats {args.repeats}"
             + (f" --limit {args.limit}" if args.limit else "") + (f" --dtype {args.dtype}" if args.dtype else "") + "`",
             "", "Tokens/s: the median over repeats. vs ar: the ratio to `ar`'s tokens/s in the same repeat, its "
             "median (and range over repeats).", "",
             "| method | batch | pricing | tokens/s | vs ar | tokens a round | drafted | rows = ar | costs (s a round, k = 0..K) |",
             "|---|---|---|---|---|---|---|---|---|"]
    runs = {}
    for r in rows:
        runs.setdefault((r["batch_size"], r["method"], r["pricing"]), []).append(r)
    for (batch, method, pricing), repeats in runs.items():
        first, ratios = repeats[0], sorted(r["vs_ar"] for r in repeats if r["vs_ar"] is not None)
        vs_ar = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}x)" if ratios else "-"
        costs = "" if first["costs"] is None else ", ".join(f"{c * 1e3:.1f}ms" for c in first["costs"])
        same = "-" if first["same_as_ar"] is None else f"{min(r['same_as_ar'] for r in repeats)}/{first['prompts']}"
        lines.append(f"| {method} | {batch} | {pricing} | "
                     f"{statistics.median(r['tokens_per_second'] for r in repeats):.1f} | {vs_ar} | "
                     f"{first['tokens_per_round']:.2f} | {first['drafted']} | {same} | {costs} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
