"""`jspec distill-data`: the model's top-k next-token distributions over its own answers or over
existing text, the data heads train on (jspec.training.distill, teacher_forced)."""

from __future__ import annotations

import argparse
import sys

from jspec import prompt_sets
from jspec.cli.common import add_model_options, load_model
from jspec.errors import JspecError

HELP = "record the model's distributions (over its own answers or existing text) for heads"
DESCRIPTION = ("Store the model's top-k next-token log-probabilities in shards under OUT: over its own "
               "answers to training prompts (--source answers), or teacher-forced over the prompts' text "
               "and earlier answer folders, one forward each (--source text). Rerunning the same command "
               "resumes.")


# The options of one --source only, and their defaults (None on the command line tells whether one
# was given, so that the other source refuses it rather than ignore it).
DISTILL_SOURCE_OPTIONS = {
    "answers": {"skip": 0, "max_prompt_tokens": 256, "max_new_tokens": 128, "temperature": 0.0, "batch_size": 32},
    "text": {"max_tokens": 256, "batch_tokens": 2048},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    import random

    from jspec.engine.sampling import Sampling
    from jspec.jsonl import read_prompts
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
