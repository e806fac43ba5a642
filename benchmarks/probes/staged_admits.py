"""Continuous batching with prompts staged ahead (a CPU's default from batch 4) against admits in
place, in one process, with the seconds each program took (docs/journal/2026-12-07_staged-prompts.md).

    python benchmarks/probes/staged_admits.py --method ar --batch-size 8

Each variant runs once after a short warm-up that compiles its programs; tokens/s is over the
Model's clock (compiles left out), the seconds per program include waiting for its result (and
any compile: the last column says how many the run still needed).
"""

from __future__ import annotations

import argparse
import collections
import time

import jax

import jspec
import jspec.api
from jspec import prompt_sets
from jspec.bench.specs import read_bench_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ar")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="the first N questions of each category")
    args = p.parse_args()
    model = jspec.load()
    requests = model.requests(read_bench_prompts(prompt_sets.resolve("spec_bench"), args.limit))
    spent, calls = collections.defaultdict(float), collections.Counter()
    run_program = jspec.api.Model._run_program

    def timed(self, program, *rest, **kw):
        began = time.perf_counter()
        out = run_program(self, program, *rest, **kw)
        jax.block_until_ready(out[0])
        spent[program.__name__] += time.perf_counter() - began
        calls[program.__name__] += 1
        return out

    jspec.api.Model._run_program = timed
    staged = jspec.api.stage_rows
    variants = {"in place": lambda platform, rows: 0, "staged": staged}
    for name, stage_rows in variants.items():
        jspec.api.stage_rows = stage_rows
        list(model.stream(requests[:args.batch_size * 3], args.method, max_new_tokens=16,
                          batch_size=args.batch_size))
    print("| admits | tokens/s | seconds | " + " | ".join(["fill", "advance", "admit", "admit_staged"])
          + " | compiled in the run |")
    print("|---" * 8 + "|")
    for name, stage_rows in variants.items():
        jspec.api.stage_rows = stage_rows
        spent.clear()
        calls.clear()
        compiled, began = model.compiling[0], model.clock()
        records = list(model.stream(requests, args.method, max_new_tokens=args.max_new_tokens,
                                    batch_size=args.batch_size))
        seconds = model.clock() - began
        tokens = sum(r["new_tokens"] for r in records)
        programs = " | ".join(f"{spent[k]:.1f} s, {calls[k]} calls" if calls[k] else "-"
                              for k in ("fill", "advance", "admit", "admit_staged"))
        print(f"| {name} | {tokens / seconds:.1f} | {seconds:.1f} | {programs} | {model.compiling[0] - compiled} |",
              flush=True)


if __name__ == "__main__":
    main()
