"""`jspec bench`: time decoding methods on Spec-Bench, check they are lossless, compare them with
Hugging Face `generate`, and write a results JSONL, a Markdown report and plots.

    jspec bench --methods ar,ngram,layer-skip,early-exit --limit 10 --hf --hf-assisted \\
        --batch-sizes 1,8 --output benchmarks/results.jsonl --markdown docs/benchmarks.md --plots docs/img

Methods are a comma-separated list. Each is a name, optionally followed by `:` and options of
`jspec.methods.build` separated by `;` (quote it for the shell):
`"ar,early-exit:exit_layer=20;max_draft=6,layer-skip:skip_layers=4,6,8;controller=heuristic"`.
A comma followed by something that is not a method name continues a list value (`4,6,8`). The
whole spec labels the method in the results. `ar`, the baseline and the lossless reference, is
added when missing and always runs first.

The prompts default to Spec-Bench's questions, which ship with jspec (`jspec.prompt_sets`).
Protocol (Spec-Bench): the first turn of each question with the chat template, greedy, batch 1;
tokens/s is averaged over questions, speedup = method / jspec `ar` in the same run, and mean
accepted tokens counts the bonus token. Every new compiled shape is warmed up (run once,
untimed) before it is timed; `--repeats R` times each batch R times and keeps the median.
Methods are interleaved prompt by prompt, so a change in machine load hits them all alike.
Rows are appended (fsynced) to OUT.partial as they come and published to OUT at the end;
`--resume` keeps the rows already there and runs only the missing (method, batch size, prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import re
import shlex
import statistics
import sys
from pathlib import Path

from jspec import methods, prompt_sets
from jspec.errors import JspecError
from jspec.jsonl import check_not_prompts

_NAME = re.compile(r"[A-Za-z][\w-]*(:|$)")
log = logging.getLogger("jspec")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    label: str  # how results and tables name it: the spec as written (options normalised)
    name: str  # a jspec.methods name
    options: tuple = ()  # ((key, value), ...) for jspec.methods.build


def parse_methods(text: str) -> list[MethodSpec]:
    """`ar,early-exit:exit_layer=20;max_draft=6,...` -> specs, with plain `ar` first."""
    pieces: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if pieces and part and not _NAME.match(part):  # `skip_layers=4,6,8`: the list goes on
            pieces[-1] += "," + part
        else:
            pieces.append(part)
    specs = [_parse_method(p) for p in pieces]
    labels = [s.label for s in specs]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise JspecError(f"--methods names {dup!r} twice")
    ar = [s for s in specs if s.label == "ar"] or [MethodSpec("ar", "ar")]
    return ar + [s for s in specs if s.label != "ar"]


def _parse_method(piece: str) -> MethodSpec:
    name, colon, rest = piece.partition(":")
    name = name.strip()
    if not name:
        raise JspecError("--methods has an empty entry; write e.g. ar,ngram,early-exit:exit_layer=20")
    if name not in methods.METHODS:
        raise JspecError(f"unknown method {name!r} in --methods; choose among {', '.join(methods.METHODS)}")
    options, parts = [], [p.strip() for p in rest.split(";") if p.strip()]
    if colon and not parts:
        raise JspecError(f"method {name!r} has ':' but no options; write {name}:key=value;key=value")
    for part in parts:
        key, eq, value = (s.strip() for s in part.partition("="))
        key = key.replace("-", "_")
        if not eq or not value:
            raise JspecError(f"bad option {part!r} for method {name}: write key=value")
        if name not in methods.TAKES.get(key, ()):
            takes = [k for k, takers in methods.TAKES.items() if name in takers]
            raise JspecError(f"method {name} takes no option {key!r}; " +
                             (f"its options are {', '.join(takes)}" if takes else "it takes none"))
        if key in dict(options):
            raise JspecError(f"method {name} sets {key} twice in --methods")
        options.append((key, value))
    label = name + (":" + ";".join(f"{k}={v}" for k, v in options) if options else "")
    return MethodSpec(label, name, tuple((k, _value(k, v)) for k, v in options))


def _value(key: str, text: str):
    """The option's value as methods.build takes it: refused here, in one line, when its type is
    wrong."""
    values = [_scalar(v.strip()) for v in text.split(",")]
    value = tuple(values) if key == "skip_layers" or len(values) > 1 else values[0]
    if methods.KINDS[key] in ("str", "") and value is not None:  # a name or a path (draft_model loads later)
        return text
    methods.check_types({key: value})
    return value


def _scalar(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_batch_sizes(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        given = [int(x) for x in text.split(",")]
    except ValueError:
        given = []
    sizes = sorted(set(given))
    if not sizes or sizes[0] < 1 or len(sizes) < len(given):
        raise JspecError(f"bad --batch-sizes {text!r}: write distinct positive integers like 1,8")
    return sizes


# -- prompts ---------------------------------------------------------------------------------------

def read_bench_prompts(path, limit: int | None = None) -> list[dict]:
    """Spec-Bench rows (`question_id`, `category`, `turns`: the first turn is the prompt) or jspec
    prompt rows (`id`, `prompt` or `messages`, optional `category`, default "all"), from a path (.gz
    too) or a shipped set's file (`prompt_sets.resolve`); `limit` keeps the first `limit` of each
    category, in file order."""
    from jspec.jsonl import read_prompts

    rows = []
    for lineno, line in enumerate(prompt_sets.read_text(path).split("\n"), 1):  # not splitlines: U+2028
        if line.strip():
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise JspecError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
    if rows and all(isinstance(o, dict) and "turns" in o for _, o in rows):
        prompts = []
        for i, (lineno, o) in enumerate(rows):
            turns = o["turns"]
            if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip()):
                raise JspecError(f"{path} line {lineno}: \"turns\" must be a list of strings, the first non-empty")
            prompts.append({"id": o.get("question_id", o.get("id", i)), "prompt": turns[0]})
    else:
        prompts = read_prompts(path)  # validates the jspec format (and the ids)
    for p, (_, o) in zip(prompts, rows):
        p["category"] = str(o.get("category") or "all") if isinstance(o, dict) else "all"
    ids = [p["id"] for p in prompts]
    if len(set(map(json.dumps, ids))) < len(ids):
        raise JspecError(f"{path} has duplicate question ids")
    if limit is not None:
        kept, seen = [], {}
        for p in prompts:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            if seen[p["category"]] <= limit:
                kept.append(p)
        prompts = kept
    return prompts


# -- results ---------------------------------------------------------------------------------------

def row_key(row: dict) -> tuple:
    return row["method"], row["batch_size"], json.dumps(row["id"])


class Results:
    """Result rows, appended durably to OUT.partial and published to OUT by `finish()`."""

    def __init__(self, path: str | Path, resume: bool, settings: dict):
        from jspec.jsonl import RecordWriter

        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        if resume and path.is_file() and not partial.exists():  # extend a finished run
            partial.write_text(prompt_sets.read_text(path, "results"), encoding="utf-8")
        self.writer = RecordWriter(path, resume=resume)
        self.rows = []
        if resume and self.writer.partial.exists():
            text = self.writer.partial.read_text(encoding="utf-8")
            self.rows = [json.loads(x) for x in text.split("\n") if x.strip()]  # not splitlines: U+2028
        for r in self.rows:
            other = {k: r.get(k) for k in settings if r.get(k) != settings[k]}
            if other:
                raise JspecError(f"{path} holds rows made with other settings ({other}); use another --output "
                                 "or run without --resume")
        self.done = {row_key(r) for r in self.rows}
        self.ar = {(r["batch_size"], json.dumps(r["id"])): r["token_ids"] for r in self.rows if r["method"] == "ar"}

    def add(self, rows: list[dict]) -> None:
        self.writer.write(rows)
        self.rows += rows
        self.done.update(map(row_key, rows))
        self.ar.update({(r["batch_size"], json.dumps(r["id"])): r["token_ids"] for r in rows if r["method"] == "ar"})


# -- runs ------------------------------------------------------------------------------------------

def _row(method: str, kind: str, batch_size: int, prompt: dict, ids: list[int], seconds: float, batch_rows: int,
         stats: dict | None, results: Results, settings: dict, lossless: bool, text: str | None,
         nll=None) -> dict:
    """One result row; `nll` (per-token NLL of the output under the full model) adds the quality
    columns: its sum and count, the fraction of positions whose token is ar's, the mean layers run."""
    ref = results.ar.get((1 if kind == "hf" else batch_size, json.dumps(prompt["id"])))
    same = True if (kind, method) == ("jspec", "ar") else None if ref is None else ids == ref
    quality = {}
    if nll is not None:  # lossy methods, and ar beside them: what the output is worth (jspec.quality)
        quality = {"nll_sum": round(float(nll.sum(dtype="float64")), 6), "nll_tokens": len(nll),
                   "same_tokens": None if ref is None else sum(a == b for a, b in zip(ids, ref)) / max(len(ref), 1),
                   "mean_layers": stats and stats.get("mean_layers")}
    return {"method": method, "kind": kind, "batch_size": batch_size, "id": prompt["id"],
            "category": prompt["category"], "new_tokens": len(ids), "seconds": round(seconds, 6),
            "batch_rows": batch_rows, "tokens_per_second": round(len(ids) / seconds, 3) if seconds > 0 else None,
            "mean_accepted_tokens": stats and stats["mean_accepted_tokens"],
            "acceptance_rate": stats and stats["acceptance_rate"], "same_as_ar": same,
            **({"domain": stats["domain"]} if stats and "domain" in stats else {}),
            "mismatch": bool(lossless and same is False), **quality, **settings, "token_ids": ids, "text": text}


def steady_run(model, run):
    """`run()`, and once more if it compiled a program: a program's first run pays for its first
    execution (a second or more on a long prompt's bucket), so the second run is the one to time.
    For scripts that time runs one by one; `run_jspec` warms each program before its clock instead."""
    programs = len(model.programs())
    out = run()
    return run() if len(model.programs()) > programs else out


def run_jspec(model, spec: MethodSpec, options: dict, chunk: list, requests: list, batch_size: int, args,
              results: Results, settings: dict, warmed: set, score: bool = False) -> list[dict]:
    """Time one batch of `requests` (the prompts `chunk`) `args.repeats` times; one row per prompt.
    `score` (lossy methods and ar beside them) scores each output under the full model, untimed."""
    from jspec import quality
    from jspec.api import batches

    [batch] = batches(requests, batch_size)
    rows = model.batch_rows(len(batch), batch_size)
    tokens, packing = model.pack(batch, rows)
    shape = (spec.label, rows, tokens.shape, packing.bucket)  # the program `run` compiles
    run = lambda: list(model.stream(requests, spec.name, max_new_tokens=args.max_new_tokens,  # noqa: E731
                                    batch_size=batch_size, **options))
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
    from jspec.bench import hf as bench_hf

    runs = [bench_hf.generate(hf, method, request.token_ids, args.max_new_tokens, eos, exit_layer)
            for _ in range(args.repeats)]
    seconds = statistics.median(s for _, s in runs)
    return _row(method, "hf", 1, prompt, runs[0][0], seconds, 1, None, results, settings, False, None)


# -- the command -----------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options, on a parser that already has the model options (jspec.cli adds them
    first, so this package never imports the command line that imports it)."""
    model_actions = list(p._actions)
    p.description = ("Time decoding methods on Spec-Bench prompts (greedy), check that lossless methods match "
                     "ar token for token, compare with Hugging Face generate, and write results, a Markdown "
                     "report and plots. Method syntax: name[:key=value;key=value] (see benchmarks/README.md).")
    g = p.add_argument_group("benchmark")
    g.add_argument("--methods", default="ar,ngram,layer-skip,early-exit", metavar="LIST",
                   help="comma-separated methods, each optionally name:key=value;key=value; ar is always run "
                        "first (default: %(default)s)")
    g.add_argument("--prompts", default=prompt_sets.SPEC_BENCH, metavar="FILE",
                   help="Spec-Bench question.jsonl or a jspec prompt file (.gz too), or the name of a prompt "
                        f"set jspec ships: {', '.join(prompt_sets.SETS)} (default: %(default)s, Spec-Bench)")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="the first N questions of each category")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="(default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="batch size of the main tables (Spec-Bench: 1; default: %(default)s)")
    g.add_argument("--batch-sizes", default=None, metavar="LIST",
                   help="batch sizes for the throughput table, e.g. 1,8")
    g.add_argument("--batch-methods", default=None, metavar="LIST",
                   help="method labels to run at --batch-sizes (default: all of --methods)")
    g.add_argument("--repeats", type=int, default=1, metavar="R", help="time each batch R times, keep the median")
    g.add_argument("--no-chat", action="store_true", help="feed prompts without the chat template")
    g.add_argument("--hf", action="store_true", help="also time Hugging Face generate (torch, float32, batch 1)")
    g.add_argument("--hf-assisted", action="store_true",
                   help="also HF assistant_early_exit and prompt lookup (implies --hf)")
    g.add_argument("--hf-exit-layer", type=int, default=None, metavar="N",
                   help="HF assistant_early_exit layer (default: jspec early-exit's default, layers // 4)")
    g.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads for the HF peers (default: torch's own choice, one per core)")
    o = p.add_argument_group("output")
    o.add_argument("--output", required=True, metavar="OUT.jsonl", help="results, one row per method x prompt x batch")
    o.add_argument("--resume", action="store_true", help="keep the rows of OUT (or OUT.partial); run only the rest")
    o.add_argument("--markdown", default=None, metavar="FILE.md",
                   help="write the report between <!-- SECTION:begin --> and <!-- SECTION:end --> in FILE.md")
    o.add_argument("--section", default="bench", metavar="SECTION",
                   help="which marked section of FILE.md the report replaces (default: %(default)s)")
    o.add_argument("--plots", default=None, metavar="DIR", help="PNG plots (default: img/ next to --markdown)")
    ordered = [a for a in p._actions if a not in model_actions] + model_actions  # the command reads bench first
    p.set_defaults(bench_options=[(a.dest, a.option_strings[0], a.default, a.nargs == 0)
                                  for a in ordered if a.option_strings and a.dest != "help"])


def command_line(args) -> str:
    """The command, with every option that differs from its default."""
    words = ["jspec", "bench"]
    for dest, flag, default, is_flag in args.bench_options:
        value = getattr(args, dest)
        if value != default:
            words += [flag] if is_flag else [flag, str(value)]
    return shlex.join(words)


def main(args) -> int:
    from jspec.api import load
    from jspec.bench import hf as bench_hf, report as bench_report

    specs = parse_methods(args.methods)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.section):
        raise JspecError(f"--section takes letters, digits, - and _, got {args.section!r}")
    sizes = [args.batch_size] + [b for b in parse_batch_sizes(args.batch_sizes) if b != args.batch_size]
    batch_labels = {s.label for s in specs} if args.batch_methods is None else \
        {"ar"} | {s.label for s in parse_methods(args.batch_methods)}
    unknown = batch_labels - {s.label for s in specs}
    if unknown:
        raise JspecError(f"--batch-methods names {', '.join(sorted(unknown))}, which --methods does not run")
    for name, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1),
                             ("--repeats", args.repeats, 1), ("--limit", args.limit, 1),
                             ("--hf-exit-layer", args.hf_exit_layer, 1), ("--torch-threads", args.torch_threads, 1)):
        if value is not None and value < low:
            raise JspecError(f"{name} must be >= {low}, got {value}")
    hf_methods = list(bench_hf.METHODS if args.hf_assisted else bench_hf.METHODS[:1] if args.hf else ())
    for flag, given, needs, ok in (("--hf-exit-layer", args.hf_exit_layer, "--hf-assisted", args.hf_assisted),
                                   ("--torch-threads", args.torch_threads, "--hf", hf_methods),
                                   ("--batch-methods", args.batch_methods, "--batch-sizes", args.batch_sizes),
                                   ("--section", args.section != "bench" or None, "--markdown", args.markdown)):
        if given is not None and not ok:
            raise JspecError(f"{flag} goes with {needs}")
    if args.markdown is not None:
        bench_report.check_markdown(args.markdown, args.section)
    if hf_methods and args.batch_size != 1:
        raise JspecError("--hf compares at batch size 1: use --batch-size 1 (and --batch-sizes for the others)")
    source = prompt_sets.resolve(args.prompts)
    check_not_prompts(args.output, source)
    prompts = read_bench_prompts(source, args.limit)

    from jspec.convert.cache import DEFAULT_MODEL

    settings = {"model": args.model or DEFAULT_MODEL, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                "chat": not args.no_chat}
    results = Results(args.output, args.resume, settings)
    model = load(args.model, args.dtype, args.mesh)
    options = {}
    for s in specs:  # check every method's options before anything is timed
        opts = dict(s.options)
        try:
            if isinstance(opts.get("draft_model"), str):
                from jspec.api import load

                opts["draft_model"] = load(opts["draft_model"], args.dtype)
            methods.build(s.name, model, **opts)
        except JspecError as e:  # the message names the option as a flag: say which entry set it
            raise JspecError(f"--methods {s.label}: {e}") from None
        options[s.label] = opts
    requests = model.requests(prompts, chat=not args.no_chat)
    hf = functools.cache(lambda: bench_hf.load(args.model, args.torch_threads))  # loaded when first needed
    eos = list(model.cfg.eos_token_ids) or [0]
    exit_layer = args.hf_exit_layer or max(1, model.cfg.num_layers // 4)
    if hf_methods and not 1 <= exit_layer < model.cfg.num_layers:
        raise JspecError(f"--hf-exit-layer must be between 1 and {model.cfg.num_layers - 1}, got {exit_layer}")
    try:
        _run_all(model, specs, options, sizes, batch_labels, hf, hf_methods, prompts, requests, args, results,
                 settings, eos, exit_layer)
        path = results.writer.finish()
    except BaseException as e:
        results.writer.close()
        if results.writer.count:
            e.jspec_hint = f"{results.writer.count} rows kept in {results.writer.partial}; rerun with --resume"
        raise
    labels = [s.label for s in specs]
    report = bench_report.Report(results.rows, prompts, labels, hf_methods, sizes, command_line(args),
                                 bench_report.machine_info(), model.name, args)
    _warn_mismatches(report)
    print(report.console())
    if args.markdown:
        plots = Path(args.plots) if args.plots else Path(args.markdown).parent / "img"
        report.write_markdown(args.markdown, plots, args.section)
        print(f"[report in {args.markdown}, plots in {plots}]", file=sys.stderr)
    elif args.plots:
        report.plot(Path(args.plots))
    print(f"[{len(results.rows)} rows in {path}]", file=sys.stderr)
    return 0


def _run_all(model, specs, options, sizes, batch_labels, hf, hf_methods, prompts, requests, args, results,
             settings, eos, exit_layer) -> None:
    from tqdm import tqdm

    from jspec.bench import hf as bench_hf
    from jspec.api import batches

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


def _warn_mismatches(report) -> None:
    for label, bad in report.mismatches().items():
        log.warning("LOSSLESS CHECK FAILED: %s differs from ar on %d prompt(s) (%s): a bug, or float "
                    "near-ties between equally likely tokens", label, len(bad), ", ".join(map(str, bad[:10])))
