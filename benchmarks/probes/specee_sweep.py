"""SpecEE's speed-quality curve from a `jspec bench` results file: one point per exit threshold.

    python benchmarks/probes/specee_sweep.py benchmarks/results/2026-11-23_specee-loaded-host.jsonl \\
        jspec/checkpoints/smollm2-135m-instruct/specee/predictors.json docs/img/specee_sweep.png [DEFAULT]

DEFAULT is the threshold of a label that names none (jspec's default when the run was made: 0.5
for 2026-11-23_specee-loaded-host.jsonl; by default jspec's default now).

Each `specee` label of the run (`specee`, `specee:exit_threshold=0.3`, ...) gives its speedup over
`ar` (mean tokens/s on the same questions), its mean NLL per token under the full model against
ar's, and its mean layers per token; labels with `lookup=N` (prompt lookup in front) make a curve
of their own. The oracle bound: predictors that exit exactly at the first depth whose choice among
the candidates is the final token (its mean layers, held-out, from the predictors' training
summary) lose nothing; its speed is read off a straight line fitted to the plain curve's seconds
per token against their mean layers (an estimate, not a run; only where that curve has two points).
Prints a Markdown table and writes the plot.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def points(rows: list[dict], default_threshold: float) -> tuple[dict, list[dict]]:
    by = defaultdict(dict)
    for r in rows:
        if r["kind"] == "jspec" and r["batch_size"] == 1:
            by[r["method"]][json.dumps(r["id"])] = r
    ar = by["ar"]
    out = []
    for label, got in by.items():
        if not label.startswith("specee") or "exit_kv" in label or "exit_choice" in label:
            continue
        ids = [i for i in got if i in ar and "nll_sum" in got[i] and "nll_sum" in ar[i]]
        nll = lambda rs: sum(rs[i]["nll_sum"] for i in ids) / sum(rs[i]["nll_tokens"] for i in ids)  # noqa: E731
        tps = lambda rs: statistics.fmean(rs[i]["tokens_per_second"] for i in ids)  # noqa: E731
        options = dict(kv.split("=") for kv in label.partition(":")[2].split(";") if kv)
        threshold = float(options.get("exit_threshold", default_threshold))
        out.append({"label": label, "threshold": threshold, "lookup": options.get("lookup"), "questions": len(ids),
                    "speedup": tps(got) / tps(ar),
                    "nll": nll(got), "ar_nll": nll(ar), "layers": statistics.fmean(got[i]["mean_layers"] for i in ids),
                    "same": statistics.fmean(got[i]["same_tokens"] for i in ids),
                    "sec_per_token": statistics.fmean(1 / got[i]["tokens_per_second"] for i in ids),
                    "ar_sec_per_token": statistics.fmean(1 / ar[i]["tokens_per_second"] for i in ids)})
    return ar, sorted(out, key=lambda p: (p["lookup"] or "", p["threshold"]))


def curves(pts: list[dict]) -> dict:
    """The points by lookup setting: None (plain SpecEE), then each --lookup N."""
    out = defaultdict(list)
    for p in pts:
        out[p["lookup"]].append(p)
    return dict(sorted(out.items(), key=lambda kv: kv[0] or ""))


def main(results: str, predictors_json: str, png: str, default_threshold: str | None = None) -> None:
    from jspec.methods import EXIT_THRESHOLD

    rows = [json.loads(x) for x in Path(results).read_text().splitlines() if x.strip()]
    _, pts = points(rows, EXIT_THRESHOLD if default_threshold is None else float(default_threshold))
    by_lookup = curves(pts)
    plain = by_lookup.get(None, [])
    oracle = None
    if len({p["layers"] for p in plain}) >= 2:
        oracle_layers = json.loads(Path(predictors_json).read_text())["training"]["oracle_mean_layers"]
        slope, icept = np.polyfit([p["layers"] for p in plain], [p["sec_per_token"] for p in plain], 1)
        ar_spt = statistics.fmean(p["ar_sec_per_token"] for p in plain)
        oracle = (ar_spt / (slope * oracle_layers + icept), oracle_layers)
    print("| lookup | threshold | speedup vs ar | mean layers | NLL | ar NLL | NLL vs ar | tokens identical to ar |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p in pts:
        print(f"| {p['lookup'] or '-'} | {p['threshold']:g} | {p['speedup']:.2f}x | {p['layers']:.1f} | {p['nll']:.3f} | "
              f"{p['ar_nll']:.3f} | {p['nll'] / p['ar_nll'] - 1:+.1%} | {p['same']:.1%} |")
    if oracle:
        print(f"| - | oracle (estimate) | {oracle[0]:.2f}x | {oracle[1]:.1f} | = ar | | +0.0% | 100% |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for lookup, curve in by_lookup.items():
        ax.plot([p["speedup"] for p in curve], [p["nll"] / p["ar_nll"] - 1 for p in curve], marker="o",
                label="specee" if lookup is None else f"specee --lookup {lookup}")
        for p in curve:
            ax.annotate(f"{p['threshold']:g}", (p["speedup"], p["nll"] / p["ar_nll"] - 1), textcoords="offset points",
                        xytext=(4, 4), fontsize="small")
    if oracle:
        ax.plot([oracle[0]], [0.0], marker="*", markersize=12, linestyle="", label="oracle exits (estimate)")
    ax.plot([1.0], [0.0], marker="s", linestyle="", label="ar")
    ax.axhline(0.05, color="grey", linestyle=":", linewidth=0.8, label="+5% NLL")
    ax.set_xlabel("speedup vs jspec ar (tokens/s, batch 1)")
    ax.set_ylabel("NLL per token vs ar (relative)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_title("SpecEE on SmolLM2-135M-Instruct: exit threshold sweep")
    ax.legend(fontsize="small")
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:5])
