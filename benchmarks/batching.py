"""Continuous against static batching, side by side in one run (issue 74).

    python benchmarks/batching.py --methods ar,ngram --batch-sizes 8,32 --max-new-tokens 256 \\
        --output benchmarks/results/DATE_batching.jsonl --markdown benchmarks/results/DATE_batching.md

For each batch size and method (`ar` only where named), the prompts (Spec-Bench's questions by
default, `--limit` of each category) run under `--batching static` and then `--batching
continuous`, greedy, in one process. Per run: tokens/s (the new tokens over the Model's clock,
which leaves compiles out, as records' `seconds` do), and useful row-steps: the rounds rows spent
decoding (each record's `rounds` less its prefill) over the rows times the rounds the batch ran
(`batch_rounds`: a static batch's own, summed over its batches; for a continuous run, the run's);
also the programs the run compiled and the seconds that took (left out of tokens/s). The
continuous run's tokens must be the static run's, row for row: the script says where they are not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import jspec  # noqa: E402
from jspec import prompt_sets  # noqa: E402
from jspec.batching import batches  # noqa: E402
from jspec.bench.specs import parse_methods, read_bench_prompts  # noqa: E402


def useful_row_steps(model, requests, records, batch_size: int, batching: str) -> tuple[int, int]:
    """(row-steps spent decoding, row-steps run) of one run's records."""
    by_id = {r["id"]: r for r in records}
    useful = sum(r["stats"]["rounds"] - 1 for r in records)
    if batching == "continuous":
        rows = model.batch_rows(len(requests), batch_size)
        return useful, rows * max(r["stats"]["batch_rounds"] for r in records)
    run = sum(model.batch_rows(len(b), batch_size) * max(by_id[q.id]["stats"]["batch_rounds"] for q in b)
              for b in batches(requests, batch_size))
    return useful, run


def measure(model, requests, spec, batch_size: int, batching: str, max_new: int,
            pricing: str = "auto") -> tuple[dict, list[dict]]:
    began, (compiles, compile_seconds) = model.clock(), model.compiling
    records = list(model.stream(requests, spec.name, max_new_tokens=max_new, batch_size=batch_size,
                                batching=batching, pricing=pricing, **dict(spec.options)))
    seconds = model.clock() - began
    tokens = sum(r["new_tokens"] for r in records)
    useful, run = useful_row_steps(model, requests, records, batch_size, batching)
    row = {"method": spec.label, "batch_size": batch_size, "batching": batching, "pricing": pricing,
           "prompts": len(requests),
           "new_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2),
           "useful_row_steps": round(useful / run, 4), "row_steps": run,
           "programs_compiled": model.compiling[0] - compiles,
           "compile_seconds": round(model.compiling[1] - compile_seconds, 1)}
    return row, records


def methods_named(text: str) -> list:
    """--methods' specs; `ar` only where named (parse_methods puts it first for comparisons between
    methods: this script compares batchings)."""
    specs = parse_methods(text)
    named = any(part.strip() == "ar" for part in text.split(","))
    return specs if named else specs[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,ngram")
    p.add_argument("--batch-sizes", default="8")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts", default="spec_bench")
    p.add_argument("--limit", type=int, default=None, help="the first N questions of each category")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--pricing", default="auto", choices=("auto", "on", "off"),
                   help="generate's --pricing for both runs; auto prices continuous batching's rounds only, "
                        "so `on` or `off` compares the batching alone")
    p.add_argument("--output", required=True, help="JSONL, one row per run")
    p.add_argument("--markdown", default=None)
    args = p.parse_args()

    model = jspec.load(args.model, args.dtype)
    prompts = read_bench_prompts(prompt_sets.resolve(args.prompts), args.limit)
    requests = model.requests(prompts)
    rows = []
    with open(args.output, "w", encoding="utf-8") as out:
        for batch_size in map(int, args.batch_sizes.split(",")):
            for spec in methods_named(args.methods):
                tokens = {}
                for batching in ("static", "continuous"):
                    row, records = measure(model, requests, spec, batch_size, batching, args.max_new_tokens,
                                           args.pricing)
                    tokens[batching] = {r["id"]: r["token_ids"] for r in records}
                    if batching == "continuous":
                        row["same_as_static"] = sum(tokens["static"][i] == t for i, t in tokens[batching].items())
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(table(rows, args), encoding="utf-8")


def table(rows: list[dict], args) -> str:
    lines = [f"# Continuous against static batching ({rows[0]['prompts']} prompts of "
             f"{args.prompts}, {args.max_new_tokens} new tokens, greedy)", "",
             f"Command: `python benchmarks/batching.py --methods {args.methods} --batch-sizes {args.batch_sizes} "
             f"--max-new-tokens {args.max_new_tokens} --pricing {args.pricing}"
             + (f" --limit {args.limit}" if args.limit else "") + "`", "",
             "| method | batch | static tokens/s | continuous tokens/s | ratio | static useful row-steps | "
             "continuous useful row-steps | rows identical | programs compiled, static / continuous |",
             "|---|---|---|---|---|---|---|---|---|"]
    for static, cont in zip(rows[::2], rows[1::2]):
        lines.append(f"| {static['method']} | {static['batch_size']} | {static['tokens_per_second']:.1f} | "
                     f"{cont['tokens_per_second']:.1f} | {cont['tokens_per_second'] / static['tokens_per_second']:.2f}x | "
                     f"{static['useful_row_steps']:.0%} | {cont['useful_row_steps']:.0%} | "
                     f"{cont['same_as_static']}/{cont['prompts']} | "
                     f"{static.get('programs_compiled', '-')} / {cont.get('programs_compiled', '-')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
