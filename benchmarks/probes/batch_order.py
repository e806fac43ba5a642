"""What batching prompts by length buys: throughput at batch 8, prompts in file order against
prompts sorted by length (`jspec.batching.batches`, what `generate` and the CLI do), side by side.

Spec-Bench first turns (the first `--limit` of each category), greedy, default model. Each
order runs once untimed (compiling its shapes), then the orders alternate `--repeats` times;
tokens/s is total new tokens / total batch wall time, and the greedy tokens must match.

    python benchmarks/probes/batch_order.py --methods ar,eesd --limit 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics

import jspec
from jspec import prompt_sets
from jspec.batching import batches
from jspec.bench.specs import read_bench_prompts


def throughput(model, chunks, method, max_new_tokens, batch_size):
    """(tokens/s, {id: token_ids}) of running `chunks` (lists of requests) batch by batch."""
    tokens = seconds = 0.0
    out = {}
    for chunk in chunks:
        records = list(model.stream(chunk, method, max_new_tokens=max_new_tokens, batch_size=batch_size))
        tokens += sum(r["new_tokens"] for r in records)
        seconds += records[0]["seconds"]
        out.update({r["id"]: r["token_ids"] for r in records})
    return tokens / seconds, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ar")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    model = jspec.load()
    requests = model.requests(read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH), args.limit))
    b = args.batch_size
    orders = {"file order": [requests[i:i + b] for i in range(0, len(requests), b)],
              "by length": batches(requests, b)}  # each chunk is one batch
    print(f"{len(requests)} prompts, batch {b}, {args.max_new_tokens} new tokens\n")
    print("| method | file order (tokens/s) | by length (tokens/s) | ratio |\n| --- | ---: | ---: | ---: |")
    for method in args.methods.split(","):
        runs = {name: [] for name in orders}
        tokens = {}
        for repeat in range(args.repeats + 1):
            for name, chunks in orders.items():
                rate, tokens[name] = throughput(model, chunks, method, args.max_new_tokens, b)
                if repeat:  # the first pass compiles
                    runs[name].append(rate)
        assert tokens["file order"] == tokens["by length"], "greedy tokens depend on the batch"
        a, s = (statistics.median(runs[name]) for name in orders)
        print(f"| `{method}` | {a:.1f} | {s:.1f} | {s / a:.2f}x |")


if __name__ == "__main__":
    main()
