"""The speedups of a `jspec bench` results file with their 95% intervals over the choice of
questions (jspec.bench.report.Report.speedup_interval), and for lossy methods the change of their
output's NLL against `ar`'s with its interval (Report.nll_interval), without running anything: for
results written before the report had those columns.

    python benchmarks/probes/intervals.py benchmarks/results/2026-11-28_run-all.jsonl [BATCH_SIZE]
"""

from __future__ import annotations

import json
import sys

from jspec import prompt_sets
from jspec.bench.report import Report, change_range, nll_change, speedup_range


def main(path: str, batch_size: int = 1) -> None:
    rows = [json.loads(line) for line in prompt_sets.read_text(path, "results").split("\n") if line.strip()]
    ids = list(dict.fromkeys(json.dumps(r["id"]) for r in rows if r["method"] == "ar" and r["batch_size"] == batch_size))
    prompts = [{"id": json.loads(i), "category": ""} for i in ids]
    labels = list(dict.fromkeys(r["method"] for r in rows if r.get("kind", "jspec") == "jspec"))
    report = Report(rows, prompts, labels, [], [batch_size], "", {}, "", None)
    print("| method | questions | speedup vs ar | 95% interval | NLL vs ar | 95% interval |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for m in labels:
        ratio = report.speedup(m, batch_size, ids)
        if m == "ar" or ratio is None:
            continue
        nll, ar_nll, _, _ = report.quality(m, batch_size, ids)
        change = nll_change(nll, ar_nll)
        print(f"| `{m}` | {len(report.rows[(m, batch_size)])} | {ratio:.2f}x | "
              f"{speedup_range(report.speedup_interval(m, batch_size, ids))} | "
              f"{'-' if change is None else f'{change:+.1%}'} | {change_range(report.nll_interval(m, batch_size, ids))} |")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
