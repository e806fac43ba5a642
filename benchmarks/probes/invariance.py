"""Is every lossless method token-identical to `ar` at batch 1? Rows identical, and tokens/s.

Runs the default model over held-out-style prompts (the 12 of benchmarks/probes/heldout_prompts.jsonl
and the first 4 of each shipped domain set, jspec.prompt_sets: 36 prompts, none used to train or search
what ships), greedy, in one process, and prints one Markdown row per method and batch size:
rows whose tokens equal `ar` at batch 1 (batch invariance), rows equal to `ar` at the same batch
size (speculation changes nothing), and throughput.

    python benchmarks/probes/invariance.py --dtype bfloat16 --max-new-tokens 48
    python benchmarks/probes/invariance.py --dtype bfloat16 --kv-cache-dtype bfloat16 --activation-dtype bfloat16
    python benchmarks/probes/invariance.py --dtype bfloat16 --runs "ar@8 eesd@8" --draft-model DIR
    python benchmarks/probes/invariance.py --runs "eesd:max_draft=4;controller=thompson@8 eagle:lookup=2@1"

A run is a method written as for `jspec bench --methods` (options after ':'), then '@' and the
batch size; runs are separated by spaces.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jspec
from jspec import prompt_sets
from jspec.bench.specs import MethodSpec, parse_methods

HERE = Path(__file__).resolve().parent
RUNS = "ar@8 early-exit@1 eesd@1 kangaroo@1 eagle@1 layer-skip@1 knn-ssd@1 ngram@1 eesd@8 eagle@8"


def prompts(per_domain: int) -> list[dict]:
    rows = [json.loads(line) for line in (HERE / "heldout_prompts.jsonl").read_text().splitlines() if line]
    for domain in sorted(prompt_sets.DOMAINS):
        lines = prompt_sets.read_text(prompt_sets.resolve(f"domains/{domain}")).split("\n")
        rows += [json.loads(line) for line in lines[:per_domain] if line]
    return [{"id": r["id"], "prompt": r["prompt"]} for r in rows]


def parse_runs(text: str) -> list[tuple[MethodSpec, int]]:
    """`eesd:max_draft=4@8 ar@8` -> [(spec, batch size), ...]."""
    runs = []
    for run in text.split():
        spec, at, batch = run.rpartition("@")
        if not at or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"bad run {run!r}: write METHOD[:OPTIONS]@BATCH, e.g. eesd:max_draft=4@8")
        runs.append((parse_methods(spec)[-1], int(batch)))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--activation-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--runs", default=RUNS, help="METHOD[:OPTIONS]@BATCH runs, compared with ar at batch 1")
    ap.add_argument("--draft-model", default=None, help="adds --method draft at batch 1 with this model")
    args = ap.parse_args()

    model = jspec.load(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, activation_dtype=args.activation_dtype)
    todo = prompts(args.per_domain)
    runs = parse_runs(args.runs)
    if args.draft_model:
        runs.append((MethodSpec("draft", "draft", (("draft_model", args.draft_model),)), 1))
    plain = MethodSpec("ar", "ar")

    def run(spec: MethodSpec, batch: int) -> tuple[list[list[int]], float]:
        options = dict(spec.options)
        model.generate(todo[:batch], spec.name, max_new_tokens=4, batch_size=batch, **options)  # compile
        t0 = time.perf_counter()
        records = model.generate(todo, spec.name, max_new_tokens=args.max_new_tokens, batch_size=batch, **options)
        seconds = time.perf_counter() - t0
        return [r["token_ids"] for r in records], sum(r["new_tokens"] for r in records) / seconds

    ar = {}
    print(f"{len(todo)} prompts, {args.max_new_tokens} new tokens, greedy, {model.policy()}\n")
    print("| method | batch | rows identical to ar batch 1 | ... to ar, same batch | tokens/s |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for spec, batch in [(plain, 1)] + sorted(runs, key=lambda r: r[0].label != "ar"):
        tokens, rate = run(spec, batch)
        if spec.label == "ar":
            ar[batch] = tokens
        if batch not in ar:
            ar[batch], _ = run(plain, batch)
        same = lambda ref: f"{sum(a == b for a, b in zip(tokens, ref))}/{len(todo)}"
        print(f"| `{spec.label}` | {batch} | {same(ar[1])} | {same(ar[batch])} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
