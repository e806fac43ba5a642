"""The pooled baseline set: of the sets every domain's search tried (its warm starts), the one
with the best mean modeled speed over all domains, i.e. a search on the domains' prompts pooled,
limited to those candidates. Writes SETS_DIR/pooled.json (kept without anchors by fit-knn).

    python benchmarks/knn_pooled.py benchmarks/knn_sets
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from jspec import skip_search


def main(sets: str) -> None:
    logs = {p.name.removesuffix(skip_search.LOG_SUFFIX): p for p in sorted(Path(sets).glob("*" + skip_search.LOG_SUFFIX))
            if not p.name.startswith("pooled")}
    rows = {d: [json.loads(x) for x in log.read_text().splitlines()[1:] if x.strip()] for d, log in logs.items()}
    logs = {d: log for d, log in logs.items() if rows[d]}  # a search with no finished trial has no say
    tried = {}
    for domain in logs:
        for row in rows[domain]:
            tried.setdefault(json.dumps(row["params"], sort_keys=True), {})[domain] = row["objective"]
    common = {k: v for k, v in tried.items() if len(v) == len(logs)}
    best = max(common, key=lambda k: statistics.mean(common[k].values()))
    params = json.loads(best)
    n = len(params) // 2
    s = skip_search.to_set("pooled", params, n)
    s.info = {"pooled_from": sorted(logs), "candidates": len(common),
              "mean_modeled_speed": round(statistics.mean(common[best].values()), 4)}
    (Path(sets) / "pooled.json").write_text(json.dumps(s.to_json(), indent=1) + "\n")
    print(f"pooled: attention {list(s.attention)}, mlp {list(s.mlp)}; best of {len(common)} sets tried in all "
          f"{len(logs)} domains, mean modeled speed {s.info['mean_modeled_speed']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
