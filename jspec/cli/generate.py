"""`jspec generate`: text for one prompt (the answer on stdout, the speed on stderr), or one record
per prompt of a JSONL file, each written as its row finishes, and resumable (jspec.jsonl.RecordWriter says
what happens to the files). Each record carries `prompt_sha256` (`jspec.jsonl.prompt_digest`), so that a
resume refuses records whose prompt was edited since."""

from __future__ import annotations

import argparse
import json
import sys

from jspec.cli.common import (UsageError, add_generation_options, add_model_options, check_generation_args,
                              generation_options, load_model, numerics_settings)
from jspec.errors import JspecError
from jspec.jsonl import check_not_prompts, prompt_digest

HELP = "generate text for one prompt or a JSONL file of prompts"
DESCRIPTION = ("Generate text for one PROMPT (the answer goes to stdout, the speed to stderr) or for every prompt "
               "of a JSONL file (one record per prompt, written to OUT.partial as it is made and renamed to OUT "
               "when the run completes).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text")
    src.add_argument("--prompts", metavar="IN.jsonl",
                     help='a JSONL file: one {"prompt": ...} or {"messages": [...]} object a line, '
                          'with an optional "id"')
    p.add_argument("--output", metavar="OUT.jsonl", help="where the records go (required with --prompts)")
    p.add_argument("--resume", action="store_true",
                   help="keep the records of an interrupted run (OUT.partial) and do only the rest")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT even when it is not an earlier output of jspec (a file of records)")
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


def run(args: argparse.Namespace) -> int:
    if args.prompts is None:
        if args.prompt is None:
            raise UsageError("give a PROMPT or --prompts IN.jsonl (see jspec generate --help)")
        if args.output is not None or args.resume or args.overwrite:
            raise UsageError("--output, --resume and --overwrite go with --prompts IN.jsonl")
        if not args.prompt.strip():
            raise JspecError("the prompt is empty")
    elif args.output is None:
        raise UsageError("--prompts needs --output OUT.jsonl")
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


def check_answered(answered: dict, prompts: list[dict], records_file, prompts_file) -> None:
    """Refuse records (`answered`: id -> the `prompt_sha256` its record in `records_file` carries)
    whose prompt in `prompts` has another digest now: it was edited after they were written.
    Records of an older jspec, without one, pass."""
    for p in prompts:
        digest = answered.get(p["id"])
        if digest is not None and digest != prompt_digest(p):
            raise JspecError(f"prompt {json.dumps(p['id'])} of {prompts_file} was edited after {records_file} "
                             "answered it; run without --resume to start over")


def _generate_file(args: argparse.Namespace) -> int:
    from jspec import distributed
    from jspec.jsonl import NoWriter, RecordWriter, read_prompts

    prompts = read_prompts(args.prompts)
    distributed.check_same("prompts", json.dumps(prompts, sort_keys=True))
    # Process 0 alone writes (and resumes) the output; the others learn from it what is left.
    options = generation_options(args)
    settings = {"model": args.model, "dtype": args.dtype, **numerics_settings(args), "method": args.method,
                "chat": not args.no_chat, **options}
    writer = (RecordWriter(args.output, resume=args.resume, settings=settings, overwrite=args.overwrite)
              if distributed.is_writer() else NoWriter(args.output))
    try:  # the writer holds the output until it is closed
        return _write_records(args, prompts, options, writer)
    finally:
        writer.close()


def _write_records(args: argparse.Namespace, prompts: list[dict], options: dict, writer) -> int:
    import numpy as np
    from tqdm import tqdm

    from jspec import distributed
    from jspec.jsonl import read_records

    ids = {p["id"] for p in prompts}
    stale = writer.done_ids - ids
    if stale:
        raise JspecError(f"{writer.partial} holds records of ids that {args.prompts} no longer has "
                         f"({', '.join(json.dumps(i) for i in sorted(stale, key=str)[:3])}); "
                         "run without --resume to start over")
    if writer.prompt_digests:
        check_answered(writer.prompt_digests, prompts, writer.partial, args.prompts)
    if writer.complete:
        answered = {r["id"]: r.get("prompt_sha256") for r in read_records(args.output)}
        if set(answered) != ids:
            raise JspecError(f"{args.output} is complete and holds other prompts than {args.prompts}; "
                             "run without --resume to redo it, or give another --output")
        check_answered(answered, prompts, args.output, args.prompts)
    digests = {p["id"]: prompt_digest(p) for p in prompts}
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
            began = model.clock()  # compiles left out, as in the records' own seconds
            # delay: a bad prompt found before the first batch (too long, say) fails without a bar.
            with tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="prompt", file=sys.stderr,
                      disable=len(prompts) <= 1 or not distributed.is_writer(), delay=0.5,
                      dynamic_ncols=True) as bar:
                for r in records:  # each made durable as it comes
                    writer.write([{**r, "prompt_sha256": digests[r["id"]]}])
                    bar.update(1)
                    tokens += r["new_tokens"]
            seconds = model.clock() - began
        path = writer.finish(order=[p["id"] for p in prompts])
    except BaseException as e:
        if writer.count:
            e.jspec_hint = f"{writer.count} records kept in {writer.partial}; rerun with --resume to continue"
        raise
    if not distributed.is_writer():
        return 0
    rate = f", {tokens / seconds:.1f} tokens/s" if seconds > 0 else ""
    print(f"[{len(prompts)} records in {path}; this run: {len(todo)} prompts, {int(tokens)} tokens, "
          f"{seconds:.2f} s{rate}]", file=sys.stderr)
    return 0
