"""How long the CPU kernels' helper threads should spin for the next call before they sleep
(jspec/model/kernels/common.h, docs/design.md "Helpers that spin"), weighed in one process.

    python benchmarks/probes/kernel_spin.py --dtype int8 --method ar --batch-size 1 --spins 0,100,300

The default model decodes the first `--prompts` Spec-Bench questions (128 new tokens, greedy)
`--repeats` times at each spin in turn, after one untimed pass (compiles). Spin 0 is helpers that
sleep at once, as XLA's pool's did when the kernels gave it their work. Prints tokens/s at each
spin: at batch size 1 the records' own seconds, above it the calls' wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import jspec  # noqa: E402
from jspec import prompt_sets  # noqa: E402
from jspec.bench.specs import read_bench_prompts  # noqa: E402
from jspec.model import kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--method", default="ar")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--spins", default="0,100,300", help="microseconds, comma-separated")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spins = [int(s) for s in args.spins.split(",")]
    model = jspec.load(dtype=args.dtype)
    prompts = read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH), 1)[:args.prompts]
    options = dict(method=args.method, max_new_tokens=128, batch_size=args.batch_size)
    model.generate(prompts, **options)
    tokens, seconds = dict.fromkeys(spins, 0), dict.fromkeys(spins, 0.0)
    for _ in range(args.repeats):
        for s in spins:
            kernels.spin(s)
            began = time.perf_counter()
            records = model.generate(prompts, **options)
            wall = time.perf_counter() - began
            tokens[s] += sum(r["new_tokens"] for r in records)
            seconds[s] += sum(r["seconds"] for r in records) if args.batch_size == 1 else wall
    base = tokens[spins[0]] / seconds[spins[0]]
    print(f"{args.dtype} {args.method} batch {args.batch_size}: " + ", ".join(
        f"spin {s} us {tokens[s] / seconds[s]:.1f} tokens/s ({tokens[s] / seconds[s] / base:.2f}x)" for s in spins))


if __name__ == "__main__":
    main()
