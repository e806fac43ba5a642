"""`jspec bench`: time decoding methods on Spec-Bench, check they are lossless, compare them with
Hugging Face `generate`, and write a results JSONL, a Markdown report and plots (jspec.bench).

    jspec bench --methods ar,ngram,layer-skip,early-exit --limit 10 --hf --hf-assisted \\
        --batch-sizes 1,8 --output results.jsonl --markdown docs/benchmarks.md --plots docs/img

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
import functools
import re
import shlex
import sys
from pathlib import Path

from jspec import methods, prompt_sets
from jspec.bench.specs import parse_batch_sizes, parse_methods, read_bench_prompts
from jspec.cli.common import add_model_options, load_model, model_dtype, numerics_settings
from jspec.convert.cache import DEFAULT_MODEL
from jspec.errors import JspecError
from jspec.jsonl import check_not_prompts

HELP = "benchmark decoding methods"
DESCRIPTION = ("Time decoding methods on Spec-Bench prompts (greedy), check that lossless methods match ar token "
               "for token, compare with Hugging Face generate, and write results, a Markdown report and plots. "
               "Method syntax: name[:key=value;key=value] (see benchmarks/README.md).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    model_actions = list(p._actions)
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
    o.add_argument("--overwrite", action="store_true",
                   help="replace OUT even when it is not an earlier output of jspec (a file of rows)")
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


def run(args) -> int:
    from jspec.bench import hf as bench_hf, report as bench_report, run as bench_run

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

    settings = {"model": args.model or DEFAULT_MODEL, "dtype": model_dtype(args), **numerics_settings(args),
                "max_new_tokens": args.max_new_tokens, "chat": not args.no_chat}
    results = bench_run.Results(args.output, args.resume, settings, overwrite=args.overwrite)
    try:  # from here on the output is locked: every way out lets it go
        model = load_model(args)
        options = {}
        for s in specs:  # check every method's options before anything is timed
            opts = dict(s.options)
            try:
                opts = model.load_models(s.name, opts)
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
        bench_run.run_all(model, specs, options, sizes, batch_labels, hf, hf_methods, prompts, requests, args,
                          results, settings, eos, exit_layer)
        path = results.writer.finish()
    except BaseException as e:
        results.writer.close()
        if results.writer.count:
            e.jspec_hint = f"{results.writer.count} rows kept in {results.writer.partial}; rerun with --resume"
        raise
    labels = [s.label for s in specs]
    report = bench_report.Report(results.rows, prompts, labels, hf_methods, sizes, command_line(args),
                                 bench_report.machine_info(), f"{model.name} ({model.dtype})", args)
    bench_run.warn_mismatches(report)
    print(report.console())
    if args.markdown:
        plots = Path(args.plots) if args.plots else Path(args.markdown).parent / "img"
        report.write_markdown(args.markdown, plots, args.section)
        print(f"[report in {args.markdown}, plots in {plots}]", file=sys.stderr)
    elif args.plots:
        report.plot(Path(args.plots))
    print(f"[{len(results.rows)} rows in {path}]", file=sys.stderr)
    return 0
