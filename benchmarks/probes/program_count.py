"""How many decoding programs a JSONL run compiles, by batching and prompt buckets (issue 74).

    python benchmarks/probes/program_count.py --prompts spec_bench --batch-sizes 1,8,32

Counted from the shapes, without compiling: a static batch compiles one program per (rows,
packed length, prompt bucket, cache length); a continuous run one fill, one advance and one admit
per prompt bucket of the prompts it admits. "steps of 128" is the bucketing before 2026-12-03
(powers of two to 128, then multiples of 128), "1.5x" today's (jspec.batching.prompt_bucket).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jspec  # noqa: E402
from jspec import batching, prompt_sets  # noqa: E402
from jspec.bench.specs import read_bench_prompts  # noqa: E402


def steps_of_128(n: int) -> int:
    if n <= 128:
        return max(32, 1 << (n - 1).bit_length())
    return -(-n // 128) * 128


def static_programs(model, requests, batch_size: int) -> int:
    shapes = set()
    for batch in batching.batches(requests, batch_size):
        tokens, packing = model.pack(batch, model.batch_rows(len(batch), batch_size))
        shapes.add((tokens.shape, packing.bucket))
    return len(shapes)


def continuous_programs(requests, batch_size: int) -> int:
    return 2 + len({batching.prompt_bucket(len(r.token_ids)) for r in requests[batch_size:]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="spec_bench")
    p.add_argument("--batch-sizes", default="1,8,32")
    args = p.parse_args()
    model = jspec.load()
    requests = model.requests(read_bench_prompts(prompt_sets.resolve(args.prompts)))
    print(f"{len(requests)} prompts of {args.prompts}")
    print("| batch | static, steps of 128 | static, 1.5x | continuous, 1.5x |")
    print("|---|---|---|---|")
    today = batching.prompt_bucket
    for b in map(int, args.batch_sizes.split(",")):
        batching.prompt_bucket = steps_of_128  # pack() reads it through the module
        before = static_programs(model, requests, b)
        batching.prompt_bucket = today
        after = static_programs(model, requests, b)
        print(f"| {b} | {before} | {after} | {continuous_programs(requests, b) if b > 1 else after} |")


if __name__ == "__main__":
    main()
