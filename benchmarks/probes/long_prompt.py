"""Compile time, time and peak memory of one long prompt on the default model (issue 74).

    for n in 1000 4000 7500; do python benchmarks/probes/long_prompt.py --tokens $n; done

One prompt per process, so that the peak resident memory (ru_maxrss) is this length's. The
prompt is Spec-Bench's questions' tokens end to end, cut to --tokens. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jspec  # noqa: E402
from jspec import prompt_sets  # noqa: E402
from jspec.bench.specs import read_bench_prompts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--method", default="ar")
    args = p.parse_args()
    model = jspec.load()
    ids = []
    for r in model.requests(read_bench_prompts(prompt_sets.resolve("spec_bench"))):
        ids += r.token_ids
        if len(ids) >= args.tokens:
            break
    prompt = {"token_ids": ids[:args.tokens]}
    t0 = time.perf_counter()
    [record] = model.generate(prompt, args.method, max_new_tokens=args.max_new_tokens)
    wall = time.perf_counter() - t0
    print(json.dumps({"tokens": args.tokens, "method": args.method,
                      "compile_s": round(model.compiling[1], 2), "first_call_s": round(wall, 2),
                      "run_s": record["seconds"], "new_tokens": record["new_tokens"],
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


if __name__ == "__main__":
    main()
