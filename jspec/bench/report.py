"""The tables, Markdown report and plots of `jspec bench`, computed from its result rows.

Spec-Bench aggregation: tokens/s is the mean over questions of new_tokens / seconds; speedup is a
method's mean tokens/s over jspec `ar`'s on the same questions, with a 95% interval over the choice
of questions (a seeded bootstrap); mean accepted tokens (bonus token
included) is averaged over questions. Batch throughput is total new tokens over total batch time,
each batch counted once (a row carries its batch's seconds and how many prompts shared it).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

from jspec import files
from jspec.errors import JspecError

INTRO = ("# Benchmarks\n\nMeasured with `jspec bench` (see `benchmarks/README.md`; `benchmarks/run_all.sh` "
         "regenerates this page). The section between the bench markers is rewritten on each run; "
         "text outside it is kept.\n\n")
SPEEDUP_PNG, THROUGHPUT_PNG = "bench_speedup_by_category.png", "bench_throughput.png"


def markers(section: str) -> tuple[str, str]:
    """The comments that delimit a report section in a Markdown file."""
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def write_section(path, block: str, section: str, intro: str = INTRO) -> None:
    """Put `block` (the section's text, its markers included) into the Markdown file at `path` in
    place of the section's old text, or at its end (a new file starts with `intro`); the rest of the
    file is kept."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else intro
    begin, end = markers(section)
    i, j = text.find(begin), text.find(end)
    if 0 <= i < j:
        text = text[:i] + block + text[j + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, text)  # whole or not at all: the file holds more than this report


def check_markdown(path, section: str = "bench") -> None:
    """Refuse, before anything runs, a --markdown file the report could not go into."""
    path = Path(path)
    if path.is_dir():
        raise JspecError(f"--markdown {path} is a folder; name a .md file")
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    begin, end = markers(section)
    if (begin in text) != (end in text) or text.find(begin) > text.find(end):
        raise JspecError(f"{path} has one of {begin} and {end} without the other after it; fix the "
                         "markers or give another --section")


def machine_info() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": usable, "os": platform.platform(terse=True),
            "python": platform.python_version(), "jax": jax.__version__,
            "jax_device": f"{jax.default_backend()} ({jax.devices()[0].device_kind}) x{jax.device_count()}",
            **_hf_libraries(),
            "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _hf_libraries() -> dict:
    """Versions of torch and transformers (the HF peers' libraries; jspec needs neither) where installed,
    and torch's thread count where the peers ran in this process."""
    found = {}
    for name in ("torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    if sys.modules.get("torch") is not None:
        found["torch_threads"] = sys.modules["torch"].get_num_threads()
    return found


def libraries(m: dict) -> str:
    """", torch 2.13.0 (2 threads), transformers 5.23.0", or what of it was recorded."""
    threads = f" ({m['torch_threads']} threads)" if m.get("torch_threads") else ""
    torch = f", torch {m['torch']}{threads}" if m.get("torch") else ""
    return torch + (f", transformers {m['transformers']}" if m.get("transformers") else "")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, align, *rows])


def speedup_range(interval) -> str:
    """A speedup's 95% interval as the tables show it ("1.21-1.43x"; "-" for none)."""
    return "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}x"


def change_range(interval) -> str:
    """A relative change's 95% interval as the tables show it ("-3.9% to +6.8%"; "-" for none)."""
    return "-" if interval is None else f"{interval[0]:+.1%} to {interval[1]:+.1%}"


def nll_change(nll, ar_nll):
    """The relative change of a method's NLL against ar's ("NLL vs ar"); None where either is missing."""
    return nll / ar_nll - 1 if nll is not None and ar_nll else None


def _resampled(statistic, n: int, resamples: int = 2000):
    """The 2.5th and 97.5th percentiles of statistic([resamples, n] question indices) over seeded
    draws of n questions with replacement (the same draw for every method compared); None below 3
    questions."""
    if n < 3:
        return None
    draw = np.random.default_rng(0).integers(0, n, (resamples, n))
    lo, hi = np.percentile(statistic(draw), [2.5, 97.5])
    return float(lo), float(hi)


class Report:
    def __init__(self, rows, prompts, labels, hf_methods, sizes, command, machine, model_name, args):
        self.prompts, self.labels, self.hf = prompts, list(labels), list(hf_methods)
        self.sizes, self.main = list(sizes), sizes[0]
        self.command, self.machine, self.model_name, self.args = command, machine, model_name, args
        self.categories = list(dict.fromkeys(p["category"] for p in prompts))
        wanted = {json.dumps(p["id"]) for p in prompts}
        self.rows: dict[tuple, dict[str, dict]] = {}
        for r in rows:
            if json.dumps(r["id"]) in wanted and r["method"] in self.labels + self.hf and r["batch_size"] in sizes:
                self.rows.setdefault((r["method"], r["batch_size"]), {})[json.dumps(r["id"])] = r

    # -- numbers ---------------------------------------------------------------------------------
    def _ids(self, category=None) -> list[str]:
        return [json.dumps(p["id"]) for p in self.prompts if category in (None, p["category"])]

    def tps(self, method, b, ids):
        got = self.rows.get((method, b), {})
        return _mean(got[i]["tokens_per_second"] for i in ids if i in got)

    def _paired(self, method, b, ids, base):
        """(method's rows, base's rows, the questions of ids both have)."""
        name, bb = base
        mine, theirs = self.rows.get((method, b), {}), self.rows.get((name, bb or b), {})
        return mine, theirs, [i for i in ids if i in mine and i in theirs]

    def speedup(self, method, b, ids, base=("ar", None)):
        """Mean tokens/s of `method` over that of `base` on the questions both have."""
        mine, theirs, common = self._paired(method, b, ids, base)
        a, c = _mean(mine[i]["tokens_per_second"] for i in common), _mean(theirs[i]["tokens_per_second"] for i in common)
        return a / c if a and c else None

    def speedup_interval(self, method, b, ids, base=("ar", None)):
        """A 95% interval of `speedup` over the choice of questions (`_resampled`). It says how
        much the ratio depends on which questions were asked, not how the host's speed drifts
        between runs."""
        mine, theirs, common = self._paired(method, b, ids, base)
        a = np.array([mine[i]["tokens_per_second"] for i in common])
        c = np.array([theirs[i]["tokens_per_second"] for i in common])
        return _resampled(lambda d: a[d].mean(1) / c[d].mean(1), len(common))

    def accepted(self, method, b, ids):
        got = self.rows.get((method, b), {})
        return _mean(got[i]["mean_accepted_tokens"] for i in ids if i in got)

    def throughput(self, method, b):
        got = self.rows.get((method, b), {}).values()
        seconds = sum(r["seconds"] / r["batch_rows"] for r in got)
        return sum(r["new_tokens"] for r in got) / seconds if seconds else None

    def mismatches(self) -> dict[str, list]:
        """Lossless jspec methods whose tokens differ from ar's: {label (b=B when not main): [ids]}."""
        out = {}
        for (method, b), got in self.rows.items():
            bad = [r["id"] for r in got.values() if r.get("mismatch")]
            if bad:
                out[method if b == self.main else f"{method} (b={b})"] = bad
        return out

    def _scored(self, method, b, ids):
        """(method's rows, ar's rows, the questions of ids whose outputs both have NLLs for)."""
        mine, ar = self.rows.get((method, b), {}), self.rows.get(("ar", b), {})
        return mine, ar, [i for i in ids if i in mine and i in ar and "nll_sum" in mine[i] and "nll_sum" in ar[i]]

    def quality(self, method, b, ids):
        """(mean NLL per token, ar's on the same questions, mean fraction of tokens identical to ar,
        mean layers per token) of a lossy method; None where not measured."""
        mine, ar, common = self._scored(method, b, ids)
        nll = lambda got: (sum(got[i]["nll_sum"] for i in common) / sum(got[i]["nll_tokens"] for i in common)
                           if common and sum(got[i]["nll_tokens"] for i in common) else None)
        return (nll(mine), nll(ar), _mean(mine[i].get("same_tokens") for i in common),
                _mean(mine[i].get("mean_layers") for i in common))

    def nll_interval(self, method, b, ids):
        """A 95% interval of the NLL's relative change against `ar`'s (the quality table's "NLL vs
        ar") over the choice of questions (`_resampled`). A lossy method's changed token changes
        the rest of its answer, so a question's NLL moves either way by far more than the method
        shifts the mean; this says whether a difference outlives the choice of questions."""
        mine, ar, common = self._scored(method, b, ids)
        nll_sum, tokens, ar_nll_sum, ar_tokens = (np.array([got[i][key] for i in common], float)
                                                  for got in (mine, ar) for key in ("nll_sum", "nll_tokens"))
        return _resampled(lambda d: (nll_sum[d].sum(1) / tokens[d].sum(1))
                          / (ar_nll_sum[d].sum(1) / ar_tokens[d].sum(1)) - 1, len(common))

    def lossy_labels(self) -> list[str]:
        return [m for m in self.labels if m != "ar"
                and any("nll_sum" in r for r in self.rows.get((m, self.main), {}).values())]

    def quality_table(self) -> str:
        rows = []
        for m in self.lossy_labels():
            for cat in self.categories + [None]:
                ids = self._ids(cat)
                nll, ar_nll, same, layers = self.quality(m, self.main, ids)
                interval = self.nll_interval(m, self.main, ids)
                rows.append([f"`{m}`", cat or "**overall**", str(len(ids)),
                             _fmt(self.speedup(m, self.main, ids, ("ar", self.main)), ".2f", "x"),
                             _fmt(nll, ".3f"), _fmt(ar_nll, ".3f"),
                             _fmt(nll_change(nll, ar_nll), "+.1%"), change_range(interval),
                             _fmt(same, ".1%"), _fmt(layers, ".1f")])
        return _table(["method", "category", "questions", "speedup vs ar", "NLL", "ar NLL", "NLL vs ar", "95% interval",
                       "tokens identical to ar", "mean layers"], rows)

    # -- tables ----------------------------------------------------------------------------------
    def overall_table(self) -> str:
        ids, b = self._ids(), self.main
        hf_base = ("hf", 1) if "hf" in self.hf else None
        rows = []
        for m in self.labels + self.hf:
            got = self.rows.get((m, b if m in self.labels else 1), {})
            if not got:
                continue
            bm = b if m in self.labels else 1
            if m in self.labels:
                miss = str(sum(bool(r.get("mismatch")) for r in got.values()))
            else:  # HF: informational (other kernels, other rounding)
                miss = f"({sum(r.get('same_as_ar') is False for r in got.values())})"
            if m in self.lossy_labels():
                miss = "(lossy)"
            interval = self.speedup_interval(m, bm, ids, ("ar", b)) if m != "ar" else None
            rows.append([f"`{m}`", str(len(got)), _fmt(self.tps(m, bm, ids), ".1f"),
                         _fmt(self.speedup(m, bm, ids, ("ar", b)), ".2f", "x"),
                         speedup_range(interval),
                         _fmt(self.speedup(m, bm, ids, hf_base), ".2f", "x") if hf_base else "-",
                         _fmt(self.accepted(m, bm, ids), ".2f"), miss])
        return _table(["method", "prompts", "tokens/s", "speedup vs jspec ar", "95% interval", "speedup vs HF generate",
                       "mean accepted tokens", "mismatches vs ar"], rows)

    def category_table(self, what: str) -> str:
        methods = [m for m in self.labels + self.hf if m != "ar"] if what == "speedup" else self.labels
        methods = [m for m in methods if (m, self.main if m in self.labels else 1) in self.rows]
        rows = []
        for cat in self.categories + [None]:
            ids = self._ids(cat)
            cells = []
            for m in methods:
                bm = self.main if m in self.labels else 1
                cells.append(_fmt(self.speedup(m, bm, ids, ("ar", self.main)), ".2f", "x") if what == "speedup"
                             else _fmt(self.accepted(m, bm, ids), ".2f"))
            rows.append([cat or "**overall**", str(len(ids))] + cells)
        return _table(["category", "questions"] + [f"`{m}`" for m in methods], rows)

    def batch_table(self) -> str:
        rows = []
        for m in self.labels:
            if not any((m, b) in self.rows for b in self.sizes):
                continue
            cells = []
            for b in self.sizes:
                t, base = self.throughput(m, b), self.throughput("ar", b)
                cells.append("-" if t is None else f"{t:.1f} ({t / base:.2f}x)" if base else f"{t:.1f}")
            miss = sum(bool(r.get("mismatch")) for b in self.sizes for r in self.rows.get((m, b), {}).values())
            rows.append([f"`{m}`"] + cells + [str(miss)])
        return _table(["method"] + [f"batch {b}" for b in self.sizes] + ["mismatches"], rows)

    # -- output ----------------------------------------------------------------------------------
    def setup(self) -> str:
        a, m = self.args, self.machine
        n, cats = len(self.prompts), len(self.categories)
        per = f"the first {a.limit} of each of {cats} categories" if a.limit else f"{cats} categories"
        prompts = Path(a.prompts).name
        return "\n".join([
            f"- Command: `{self.command}`",
            f"- Model: {self.model_name}; prompts: `{prompts}`, {n} questions ({per}), first turn, "
            f"{'no chat template' if a.no_chat else 'chat template'}; greedy, at most {a.max_new_tokens} new "
            f"tokens; batch {self.main}; median of {a.repeats} timed run(s) after an untimed warm-up of each "
            "compiled shape.",
            f"- Machine: {m['cpu']}, {m['cpus']} CPUs ({m['usable_cpus']} usable), {m['os']}; Python {m['python']}, "
            f"jax {m['jax']} on {m['jax_device']}{libraries(m)}; load average at the end {m['load_average']}; "
            f"{m['date']}.",
        ])

    def console(self) -> str:
        parts = [self.overall_table()] + ([self.quality_table()] if self.lossy_labels() else [])
        if len(self.sizes) > 1:
            parts.append(self.batch_table())
        return "\n\n".join(parts)

    def markdown(self, image_dir: str | None, section: str = "bench") -> str:
        b = self.main
        begin, end = markers(section)
        title = "Results" if section == "bench" else f"Results: {section}"
        out = [begin, "", f"## {title}", "", self.setup(), "", f"### Overall (batch {b})", "", self.overall_table(), "",
               "tokens/s: mean over questions of new tokens / seconds (prefill included, compilation excluded). "
               "Speedups: ratio of mean tokens/s on the same questions, same run; its 95% interval over the "
               "choice of questions (2,000 resamples of them with replacement; timing drift between runs "
               "comes on top). Mean accepted tokens per "
               "target forward counts the bonus token (ar = 1.00). Mismatches: prompts whose tokens differ "
               "from jspec `ar`; 0 for every lossless jspec method, and in parentheses for Hugging Face "
               "(torch kernels round differently, so near-ties may flip).", "",
               f"### Speedup vs jspec ar by category (batch {b})", "", self.category_table("speedup"), "",
               f"### Mean accepted tokens by category (batch {b})", "", self.category_table("accepted"), ""]
        if self.lossy_labels():
            out += [f"### Lossy methods: quality (batch {b})", "", self.quality_table(), "",
                    "NLL: mean negative log-likelihood per generated token under the full model, teacher-forced "
                    "(jspec/bench/quality.py), beside `ar`'s on the same questions; the 95% interval of its change "
                    "resamples the questions as the speedup's does. Tokens identical to ar: the "
                    "fraction of ar's positions where the method wrote the same token. Mean layers: layers run "
                    "per decoded token.", ""]
        if len(self.sizes) > 1:
            out += ["### Batch throughput", "", self.batch_table(), "",
                    "Total new tokens / total wall time of the batches (tokens/s), and in parentheses the ratio "
                    "to jspec `ar` at the same batch size.", ""]
        if image_dir is not None:
            out += [f"![speedup by category]({image_dir}/{SPEEDUP_PNG})", ""]
            if len(self.sizes) > 1:
                out += [f"![throughput vs batch size]({image_dir}/{THROUGHPUT_PNG})", ""]
        return "\n".join(out + [end])

    def write_markdown(self, path, plots: Path, section: str = "bench") -> None:
        path = Path(path)
        self.plot(plots)
        rel = os.path.relpath(plots.resolve(), path.resolve().parent).replace(os.sep, "/")
        write_section(path, self.markdown(rel, section), section)

    def plot(self, folder: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder.mkdir(parents=True, exist_ok=True)
        methods = [m for m in self.labels + self.hf if m != "ar"
                   and (m, self.main if m in self.labels else 1) in self.rows]
        groups = self.categories + ["overall"]
        fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(groups) * max(1, len(methods)) ** 0.5 + 3), 4.5))
        width = 0.8 / max(1, len(methods))
        for k, m in enumerate(methods):
            bm = self.main if m in self.labels else 1
            ys = [self.speedup(m, bm, self._ids(None if g == "overall" else g), ("ar", self.main)) or 0.0
                  for g in groups]
            ax.bar([x + (k - (len(methods) - 1) / 2) * width for x in range(len(groups))], ys, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)), groups, rotation=35, ha="right")
        ax.set_ylabel("speedup vs jspec ar")
        ax.set_title(f"{self.model_name}: speedup by category (batch {self.main})")
        if methods:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(folder / SPEEDUP_PNG, dpi=120)
        plt.close(fig)
        if len(self.sizes) < 2:
            return
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        sizes = sorted(self.sizes)
        for m in self.labels:
            pts = [(b, self.throughput(m, b)) for b in sizes if (m, b) in self.rows]
            if pts:
                ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s (all rows)")
        ax.set_title(f"{self.model_name}: throughput vs batch size")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(folder / THROUGHPUT_PNG, dpi=120)
        plt.close(fig)
