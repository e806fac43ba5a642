"""`jspec bench`'s runs: each method timed on each batch of prompts beside `ar` (and Hugging Face
`generate` as a peer), its rows checked against `ar`'s tokens and, for a lossy method, scored under
the full model (jspec.bench.quality); rows appended durably as they come."""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path

from jspec import methods
from jspec.batching import batches, prompt_bucket
from jspec.bench import hf as bench_hf, quality
from jspec.bench.specs import MethodSpec
from jspec.errors import JspecError
from jspec.jsonl import RecordWriter

log = logging.getLogger("jspec")


def row_key(row: dict) -> tuple:
    return row["method"], row["batch_size"], json.dumps(row["id"])


class Results:
    """Result rows, appended durably to OUT.partial and published to OUT by `finish()`."""

    def __init__(self, path: str | Path, resume: bool, settings: dict, overwrite: bool = False):
        path = Path(path)
        # extend: a finished run's rows are resumed, and more methods or sizes added to them
        self.writer = RecordWriter(path, resume=resume, overwrite=overwrite, extend=True)
        self.rows = []
        if resume and self.writer.partial.exists():
            text = self.writer.partial.read_text(encoding="utf-8")
            self.rows = [json.loads(x) for x in text.split("\n") if x.strip()]  # not splitlines: U+2028
        for r in self.rows:
            other = {k: r.get(k) for k in settings if r.get(k) != settings[k]}
            if other:
                self.writer.close()  # let the output go: nothing runs
                raise JspecError(f"{path} holds rows made with other settings ({other}); use another --output "
                                 "or run without --resume")
        self.done = {row_key(r) for r in self.rows}
        self.ar = {(r["batch_size"], json.dumps(r["id"])): r["token_ids"] for r in self.rows if r["method"] == "ar"}

    def add(self, rows: list[dict]) -> None:
        self.writer.write(rows)
        self.rows += rows
        self.done.update(map(row_key, rows))
        self.ar.update({(r["batch_size"], json.dumps(r["id"])): r["token_ids"] for r in rows if r["method"] == "ar"})


def _row(method: str, kind: str, batch_size: int, prompt: dict, ids: list[int], seconds: float, batch_rows: int,
         stats: dict | None, results: Results, settings: dict, lossless: bool, text: str | None,
         nll=None) -> dict:
    """One result row; `nll` (per-token NLL of the output under the full model) adds the quality
    columns: its sum and count, the fraction of positions whose token is ar's, the mean layers run."""
    ref = results.ar.get((1 if kind == "hf" else batch_size, json.dumps(prompt["id"])))
    same = True if (kind, method) == ("jspec", "ar") else None if ref is None else ids == ref
    scores = {}
    if nll is not None:  # lossy methods, and ar beside them: what the output is worth (jspec.bench.quality)
        scores = {"nll_sum": round(float(nll.sum(dtype="float64")), 6), "nll_tokens": len(nll),
                   "same_tokens": None if ref is None else sum(a == b for a, b in zip(ids, ref)) / max(len(ref), 1),
                   "mean_layers": stats and stats.get("mean_layers")}
    return {"method": method, "kind": kind, "batch_size": batch_size, "id": prompt["id"],
            "category": prompt["category"], "new_tokens": len(ids), "seconds": round(seconds, 6),
            "batch_rows": batch_rows, "tokens_per_second": round(len(ids) / seconds, 3) if seconds > 0 else None,
            "mean_accepted_tokens": stats and stats["mean_accepted_tokens"],
            "acceptance_rate": stats and stats["acceptance_rate"], "same_as_ar": same,
            **({"domain": stats["domain"]} if stats and "domain" in stats else {}),
            "mismatch": bool(lossless and same is False), **scores, **settings, "token_ids": ids, "text": text}


def run_jspec(model, spec: MethodSpec, options: dict, chunk: list, requests: list, batch_size: int, args,
              results: Results, settings: dict, warmed: set, score: bool = False) -> list[dict]:
    """Time one batch of `requests` (the prompts `chunk`) `args.repeats` times; one row per prompt.
    `score` (lossy methods and ar beside them) scores each output under the full model, untimed."""
    [batch] = batches(requests, batch_size)
    rows = model.batch_rows(len(batch), batch_size)
    # The program `run` compiles: its cache's length follows the longest prompt's bucket.
    shape = (spec.label, rows, max(prompt_bucket(len(r.token_ids)) for r in batch))
    run = lambda: list(model.stream(requests, spec.name, max_new_tokens=args.max_new_tokens,  # noqa: E731
                                    batch_size=batch_size, batching="static", **options))
    if shape not in warmed:  # compile (before the clock) and run once untimed
        run()
        warmed.add(shape)
    runs = [run() for _ in range(args.repeats)]
    seconds = statistics.median(rs[0]["seconds"] for rs in runs)
    lossless = spec.name in methods.LOSSLESS
    score = score or spec.name in methods.LOSSY
    return [_row(spec.label, "jspec", batch_size, p, r["token_ids"], seconds, len(chunk), r["stats"], results,
                 settings, lossless, r["text"], quality.token_nll(model, q.token_ids, r["token_ids"]) if score else None)
            for p, q, r in zip(chunk, requests, runs[0])]


def run_hf(hf, method: str, prompt: dict, request, args, results: Results, settings: dict, eos: list[int],
           exit_layer: int) -> dict:
    runs = [bench_hf.generate(hf, method, request.token_ids, args.max_new_tokens, eos, exit_layer)
            for _ in range(args.repeats)]
    seconds = statistics.median(s for _, s in runs)
    return _row(method, "hf", 1, prompt, runs[0][0], seconds, 1, None, results, settings, False, None)


def run_all(model, specs, options, sizes, batch_labels, hf, hf_methods, prompts, requests, args, results,
             settings, eos, exit_layer) -> None:
    from tqdm import tqdm

    plan = [(b, [s for s in specs if b == args.batch_size or s.label in batch_labels]) for b in sizes]
    keys = {(s.label, b, json.dumps(p["id"])) for b, ss in plan for s in ss for p in prompts}
    keys |= {(m, 1, json.dumps(p["id"])) for m in hf_methods for p in prompts}
    todo = len(keys - results.done)
    if todo < len(keys):
        print(f"resuming: {len(keys) - todo} of {len(keys)} rows already in {args.output}", file=sys.stderr)
    warmed: set = set()
    lossy = any(s.name in methods.LOSSY for s in specs)
    with tqdm(total=len(keys), initial=len(keys) - todo, unit="row", file=sys.stderr, dynamic_ncols=True,
              mininterval=1.0, disable=todo == 0) as bar:
        for b, ss in plan:
            for batch in batches(requests, b):
                for s in ss:
                    idx = [r.index for r in batch
                           if (s.label, b, json.dumps(prompts[r.index]["id"])) not in results.done]
                    if idx:
                        bar.set_description(f"{s.label} b={b}", refresh=False)
                        results.add(run_jspec(model, s, options[s.label], [prompts[i] for i in idx],
                                              [requests[i] for i in idx], b, args, results, settings, warmed,
                                              score=lossy and s.label == "ar"))
                        bar.update(len(idx))
                if b != 1:
                    continue
                start = batch[0].index
                for m in hf_methods:
                    if (m, 1, json.dumps(prompts[start]["id"])) in results.done:
                        continue
                    bar.set_description(m, refresh=False)
                    if m not in warmed:  # one untimed generate first
                        bench_hf.generate(hf(), m, requests[start].token_ids, args.max_new_tokens, eos, exit_layer)
                        warmed.add(m)
                    results.add([run_hf(hf(), m, prompts[start], requests[start], args, results, settings, eos,
                                        exit_layer)])
                    bar.update(1)


def warn_mismatches(report) -> None:
    for label, bad in report.mismatches().items():
        log.warning("LOSSLESS CHECK FAILED: %s differs from ar on %d prompt(s) (%s): a bug, or float "
                    "near-ties between equally likely tokens", label, len(bad), ", ".join(map(str, bad[:10])))
