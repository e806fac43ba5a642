"""knn-ssd on Spec-Bench: the chosen sets, the pooled set and every domain's set on every prompt.

    python benchmarks/probes/knn_bench.py --limit 1 --max-new-tokens 32 --shard 0/4 --output out-0.jsonl

For each prompt (the first --limit of each of the 13 categories; greedy, batch 1, the chat
template) this runs `ar`, then `knn-ssd` (each prompt choosing its set), then `knn-ssd` with
each set of the folder forced (`--domain`), interleaved prompt by prompt so that a change in the
machine's load hits them all alike; a domain whose set equals an earlier domain's is not run
again, its rows are copies (`copied_from`). All the knn-ssd variants are one compiled program (the sets
are data), which is why this does not go through `jspec bench`: that warms every method up
separately. Here a run that compiled a program is run again and the second run is timed.
--shard i/n takes every n-th prompt from the i-th, so n processes split the work.
Rows are appended as they come; rerunning resumes. Tables: benchmarks/probes/knn_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax

import jspec
from jspec import methods, prompt_sets
from jspec.engine.programs import steady_run
from jspec.bench.specs import read_bench_prompts
from jspec.engine.sampling import Sampling
from jspec.parts import knn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--knn", default=None, help="the folder (default: the shipped one)")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--output", required=True)
    ap.add_argument("--labels", default=None, help="only these labels (comma-separated; ar always runs)")
    args = ap.parse_args()
    i, n = map(int, args.shard.split("/"))
    model = jspec.load()
    prompts = read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH), args.limit)[i::n]
    folder = knn.load_for(model, args.knn)
    wanted = set(args.labels.split(",")) if args.labels else None
    plans = {"ar": methods.build("ar", model)}
    if wanted is None or "knn-ssd" in wanted:
        plans["knn-ssd"] = methods.build("knn-ssd", model, knn=args.knn)
    first = {}  # a domain whose set another domain already has decodes exactly as that one: copied
    for s in folder.sets:
        label = f"knn-ssd:domain={s.name}"
        if wanted is not None and label not in wanted:
            continue
        if first.setdefault((s.attention, s.mlp), label) == label:
            plans[label] = methods.build("knn-ssd", model, knn=args.knn, domain=s.name)
    copies = {f"knn-ssd:domain={s.name}": first[(s.attention, s.mlp)] for s in folder.sets
              if (s.attention, s.mlp) in first and (wanted is None or f"knn-ssd:domain={s.name}" in wanted)}
    out = Path(args.output)
    done = {(r["method"], json.dumps(r["id"])) for r in map(json.loads, out.read_text().splitlines())} \
        if out.exists() else set()
    with open(out, "a") as f:
        for p in prompts:
            [request] = model.requests([p])
            ar = None
            for label, plan in plans.items():
                key = (label, json.dumps(p["id"]))
                if key in done and label != "ar":  # ar runs again: the others are checked against it
                    continue
                # Else a program's first run would land on whichever variant meets a bucket first.
                [rec] = steady_run(model, lambda: model.run_batch(
                    [request], 1, args.max_new_tokens, Sampling(), jax.random.key(0), plan))
                ar = rec["token_ids"] if label == "ar" else ar
                if key in done:
                    continue
                row = {"method": label, "kind": "jspec", "batch_size": 1, "id": p["id"], "category": p["category"],
                       "new_tokens": rec["new_tokens"], "seconds": rec["seconds"],
                       "tokens_per_second": rec["tokens_per_second"], **rec["stats"],
                       "same_as_ar": rec["token_ids"] == ar}
                rows = [row] + [{**row, "method": copy, "copied_from": label, "domain": copy.split("=")[1]}
                                for copy, original in copies.items() if original == label and copy != label]
                f.write("".join(json.dumps(r) + "\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())
                print(label, p["category"], rec["tokens_per_second"], rec["stats"].get("domain"), flush=True)


if __name__ == "__main__":
    main()
