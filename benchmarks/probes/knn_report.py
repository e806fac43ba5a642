"""Markdown tables of knn-ssd runs of `jspec bench` (docs/journal/2026-11-24_knn-ssd.md, "KNN-SSD").

    python benchmarks/probes/knn_report.py RESULTS.jsonl [RESULTS.jsonl ...]

Each results file is one `jspec bench` run (its own `ar`, interleaved prompt by prompt), so a
method's speed is its tokens/s over the same file's `ar` on the same prompts. Methods labelled
`knn-ssd:domain=NAME` are one domain's set run on every prompt; `knn-ssd` chooses per prompt.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys

# The Spec-Bench categories a domain's training prompts stand for (the domain-shift diagonal).
OWN = {"translation": "translation", "summarization": "summarization", "qa": "qa", "math_reasoning": "math",
       "math": "math", "rag": "rag", "coding": "coding", "writing": "writing", "roleplay": "writing"}


def label_name(method: str) -> str:
    return method.split("domain=")[1] if "domain=" in method else method


def main(paths: list[str]) -> None:
    rows = []
    for i, path in enumerate(paths):
        for line in open(path):
            if line.strip():
                rows.append({**json.loads(line), "run": i})
    rows = [r for r in rows if r["kind"] == "jspec" and r["batch_size"] == 1]
    ar = {(r["run"], json.dumps(r["id"])): r["tokens_per_second"] for r in rows if r["method"] == "ar"}
    categories = list(dict.fromkeys(r["category"] for r in rows))
    by = collections.defaultdict(list)
    for r in rows:
        by[r["method"]].append(r)

    print("| method | tokens/s | vs ar (same prompts) | mean accepted tokens | same as ar |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for method, rs in by.items():
        tps = statistics.mean(r["tokens_per_second"] for r in rs)
        ratio = statistics.mean(r["tokens_per_second"] for r in rs) / statistics.mean(
            ar[(r["run"], json.dumps(r["id"]))] for r in rs)
        same = sum(bool(r["same_as_ar"]) for r in rs)
        print(f"| `{method}` | {tps:.2f} | {ratio:.2f}x | {statistics.mean(r['mean_accepted_tokens'] for r in rs):.2f} "
              f"| {same}/{len(rs)} |")

    sets = [m for m in by if m.startswith("knn-ssd")]
    print("\nMean accepted tokens per Spec-Bench category (**bold**: the set's own domain):\n")
    print("| set | " + " | ".join(categories) + " | all | vs ar, all |")
    print("| --- |" + " ---: |" * (len(categories) + 2))
    for method in sets:
        name = label_name(method)
        cells = []
        for c in categories:
            rs = [r for r in by[method] if r["category"] == c]
            v = f"{statistics.mean(r['mean_accepted_tokens'] for r in rs):.2f}" if rs else "-"
            cells.append(f"**{v}**" if OWN.get(c) == name else v)
        rs = by[method]
        ratio = statistics.mean(r["tokens_per_second"] for r in rs) / statistics.mean(
            ar[(r["run"], json.dumps(r["id"]))] for r in rs)
        overall = statistics.mean(r["mean_accepted_tokens"] for r in rs)
        print(f"| `{name}` | " + " | ".join(cells) + f" | {overall:.2f} | {ratio:.2f}x |")

    chosen = collections.defaultdict(collections.Counter)
    for r in by.get("knn-ssd", []):
        chosen[r["category"]][r.get("domain")] += 1
    if chosen:
        print("\nDomains `knn-ssd` chose, per category:\n")
        print("| category | chosen |")
        print("| --- | --- |")
        for c in categories:
            print(f"| {c} | " + ", ".join(f"{d} ({n})" for d, n in chosen[c].most_common()) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
