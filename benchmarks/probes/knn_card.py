"""Write the card (README.md) of a knn-ssd folder from its knn.json and the searches' trial logs.

    python benchmarks/probes/knn_card.py jspec/checkpoints/smollm2-135m-instruct/knn-ssd benchmarks/probes/knn_sets
"""

from __future__ import annotations

import sys
from pathlib import Path

from jspec.parts import knn
from jspec.training.search_skip import LOG_SUFFIX, read_log


def trials(sets: str, name: str) -> list[dict]:
    log = Path(sets) / (name + LOG_SUFFIX)
    return read_log(log)[1] if log.exists() else []


def main(folder: str, sets: str) -> None:
    k = knn.load(folder)
    search = next(s.info["search"] for s in k.sets if s.name != "pooled")
    anchored = [s for s in k.sets if s.info.get("anchors")]
    lines = [
        "# knn-ssd for SmolLM2-135M-Instruct",
        "",
        "`--method knn-ssd` on the default model reads this folder: a sublayer skip set per domain and",
        f"{anchored[0].info['anchors']} k-means anchors per domain "
        "(`anchors.npz`); each prompt drafts with the set of its nearest anchor (docs/methods.md, \"KNN-SSD\").",
        "",
        "**Data.** Training prompts only, never Spec-Bench: `train_prompts` categories coding, writing",
        "and math, and `jspec/data/domains/` translation, summarization, qa, text_to_sql, story_writing and",
        "rag. `pooled` has no anchors: the single-set baseline (`--domain pooled`), searched the same way",
        "on one prompt from each of the nine domains (`benchmarks/probes/knn_pooled.py`), all nine timed at every trial.",
        "",
        f"**Search** (`jspec search-skip`, Optuna TPE over 2 x 30 sublayer choices, warm-started with the",
        "shipped layer-skip set and SWIFT's middle-half set, each as whole layers, attention only and MLP",
        f"only): {search['trials']} trials per domain, each {search['prompts_timed']} of the domain's prompts "
        f"(one prompt bucket) x {search['max_new_tokens']} new tokens,",
        f"greedy, batch 1, K = 12, stop below 0.8 confidence; objective `{search['objective']}` tokens/s, "
        "one search at a time on the quiet 2-core CPU. `bash benchmarks/probes/knn_search_all.sh` reruns",
        "(and resumes) it; the reference runs 1,000 iterations per domain.",
        "",
        f"**Anchors** (`jspec fit-knn`): the prefill feature of {anchored[0].info['anchor_prompts']} prompts "
        "per domain, k-means centres of each.",
        "",
        "| domain | skipped attention | skipped MLP | trials | tokens/s | `ar` tokens/s | mean accepted tokens | anchors |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in k.sets:
        rows = trials(sets, s.name)
        best = max(rows, key=lambda r: r["objective"])
        lines.append(f"| {s.name} | {', '.join(map(str, s.attention)) or '-'} | {', '.join(map(str, s.mlp)) or '-'} | "
                     f"{len(rows)} | {best['measured_tokens_per_second']:.1f} | {best['ar_tokens_per_second']:.1f} | "
                     f"{best['mean_accepted_tokens']:.2f} | {s.info.get('anchors', 0)} |")
    lines += ["", "Speeds on the domain's own search prompts, as the search timed them. The shipped sets were",
              "searched before the search timed steady runs only (docs/methods.md, \"KNN-SSD\"): `ar`'s is one",
              "run per bucket, which pays the program's first execution (up to about 1.5 s), so it reads low.",
              "Compare the sets with each other here, and with `ar` on Spec-Bench: [docs/journal, \"KNN-SSD\"]"
              "(../../../../docs/journal/2026-11-24_knn-ssd.md#knn-ssd-issue-15).",
              ""]
    (Path(folder) / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
