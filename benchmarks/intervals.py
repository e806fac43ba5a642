"""The speedups of a `jspec bench` results file with their 95% intervals over the choice of
questions (jspec.bench.report.Report.speedup_interval), without running anything: for results
written before the overall table had the column.

    python benchmarks/intervals.py benchmarks/results.jsonl [BATCH_SIZE]
"""

from __future__ import annotations

import json
import sys

from jspec.bench.report import Report


def main(path: str, batch_size: int = 1) -> None:
    rows = [json.loads(line) for line in open(path)]
    ids = list(dict.fromkeys(json.dumps(r["id"]) for r in rows if r["method"] == "ar" and r["batch_size"] == batch_size))
    prompts = [{"id": json.loads(i), "category": ""} for i in ids]
    labels = list(dict.fromkeys(r["method"] for r in rows if r.get("kind", "jspec") == "jspec"))
    report = Report(rows, prompts, labels, [], [batch_size], "", {}, "", None)
    print("| method | questions | speedup vs ar | 95% interval |\n| --- | ---: | ---: | ---: |")
    for m in labels:
        ratio, interval = report.speedup(m, batch_size, ids), report.speedup_interval(m, batch_size, ids)
        if m != "ar" and ratio is not None:
            shown = "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}x"
            print(f"| `{m}` | {len(report.rows[(m, batch_size)])} | {ratio:.2f}x | {shown} |")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
