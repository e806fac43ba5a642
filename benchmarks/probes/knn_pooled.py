"""The pooled baseline's prompts: one prompt from each of the nine domains (the same sources the
domain searches read), so `jspec search-skip --prompts POOLED --count 9 --all-buckets` searches
one set on all domains pooled, timed on every domain at every trial.

    python benchmarks/probes/knn_pooled.py benchmarks/probes/knn_sets/pooled_prompts.jsonl
"""

from __future__ import annotations

import json
import random
import statistics
import sys

from jspec import prompt_sets
from jspec.training.search_skip import domain_prompts

DOMAINS = {"coding": ("train_prompts", "coding"), "writing": ("train_prompts", "writing"),
           "math": ("train_prompts", "math"), **{d: (f"domains/{d}", None) for d in prompt_sets.DOMAINS}}


def main(out: str, seed: int = 0) -> None:
    rows = []
    for name, (source, category) in DOMAINS.items():
        prompts = domain_prompts(source, category)
        lengths = [len(json.dumps(p["prompt"])) for p in prompts]
        median = statistics.median(lengths)
        p = random.Random(seed).choice([p for p, n in zip(prompts, lengths) if n <= median])  # typical, not the longest
        rows.append({"id": f"{name}/{p['id']}", "category": name, "prompt": p["prompt"]})
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{out}: one prompt from each of {len(rows)} domains")


if __name__ == "__main__":
    main(*sys.argv[1:])
