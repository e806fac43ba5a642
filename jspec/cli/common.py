"""What several commands share: the model options, the generation options (the methods' flags come
from their records, jspec.methods.OPTIONS), their checks before the model loads, and loading it."""

from __future__ import annotations

import argparse
import logging

from jspec import methods
from jspec.model import weights
from jspec.errors import JspecError

TYPES = {"int": int, "float": float, "str": str, "model": str}  # "layers" and "bool": below


class UsageError(Exception):
    """A misuse of the command line (an argparse error, options that go together), in one line."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line, with the hint a command attached to it (`jspec_hint`)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return with_hint(text, e)


def with_hint(text: str, e: BaseException) -> str:
    hint = getattr(e, "jspec_hint", None)
    return f"{text} ({hint})" if hint else text


def add_model_options(p: argparse.ArgumentParser, decodes: bool = True) -> None:
    """--model, --dtype and --mesh; and for a command that `decodes`, the dtypes of its programs'
    activations and KV cache (jspec.model.numerics)."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="a converted jspec folder, a GGUF file, a Hugging Face folder or a hub id in the "
                        "local HF cache (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=None, choices=weights.DTYPES,
                   help="the weights' dtype (default: the checkpoint's own: bfloat16 for most Hugging Face "
                        "models, float32 for GGUF files and the default model); int8: one scale per output "
                        "channel, quantized once on conversion")
    g.add_argument("--mesh", default=None, metavar="data=N,model=M",
                   help="shard over a device mesh: batch rows over 'data', tensor parallel over 'model'")
    if not decodes:
        p.set_defaults(kv_cache_dtype="float32", activation_dtype="float32")
        return
    for name, what in (("--kv-cache-dtype", "the KV cache's dtype: bfloat16 halves its memory"),
                       ("--activation-dtype", "the activations' dtype: bfloat16 halves their bytes and "
                                              "takes the accelerators' bfloat16 matmuls")):
        g.add_argument(name, default="float32", choices=("float32", "bfloat16"),
                       help=f"{what}; float32 (the default) keeps speculative output token-identical to ar "
                            "(README, \"What token-identical means\")")


def model_dtype(args: argparse.Namespace) -> str:
    """The dtype the run's model loads in: --dtype, else the checkpoint's own."""
    from jspec.convert.cache import own_dtype

    return args.dtype or own_dtype(args.model)


def numerics_settings(args: argparse.Namespace) -> dict:
    """The run's activation and KV cache dtypes and matmul precision, as an output's settings name them."""
    from jspec.model.numerics import Numerics

    return Numerics(args.activation_dtype, args.kv_cache_dtype).to_json()


def load_model(args: argparse.Namespace):
    from jspec.api import load

    return load(args.model, args.dtype, args.mesh, kv_cache_dtype=args.kv_cache_dtype,
                activation_dtype=args.activation_dtype)


def _layers(text: str) -> list[int]:
    """A layer list flag (--skip-layers 4,6,8)."""
    try:
        layers = [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise JspecError(f"--skip-layers takes comma-separated layer numbers, got {text!r}") from None
    if not layers:
        raise JspecError("--skip-layers names no layer: the draft would be the whole model")
    return layers


def _max_draft_defaults() -> str:
    """--max-draft's defaults, from the methods' records: "eesd, kangaroo 1 on a CPU and 4 elsewhere; ..."."""
    by_default: dict[tuple[int, int], list[str]] = {}
    for m in methods.REGISTRY.values():
        if m.drafts:
            by_default.setdefault(m.max_draft, []).append(m.name)
    common = max(by_default, key=lambda k: len(by_default[k]))
    parts = [f"{', '.join(names)} {cpu}" + ("" if cpu == other else f" on a CPU and {other} elsewhere")
             for (cpu, other), names in by_default.items() if (cpu, other) != common]
    return "; ".join(parts + [f"{common[0]} otherwise"])


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """The options of `Model.stream`, and a flag for each option of the methods (grouped as their
    records say; the help names the methods that take it)."""
    g = p.add_argument_group("generation")
    g.add_argument("--method", default="ar",
                   help=f"decoding method: {', '.join(methods.METHODS)} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate per prompt at most (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=1, metavar="N",
                   help="rows decoded together; the output keeps the prompts' order (default: %(default)s)")
    g.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: a row that finishes takes the next prompt (shortest first) at once; "
                        "static: batches of prompts sorted by length, each until its longest row ends "
                        "(default: %(default)s)")
    g.add_argument("--pricing", choices=("auto", "on", "off"), default="auto",
                   help="price each round by what drafting costs on this device, drafting less (or nothing) "
                        "where it does not pay: on, off, or auto, which prices lossless methods under continuous "
                        "batching and --method auto above batch size 1 (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature: 0 is greedy, otherwise at least 1e-6 (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens; 0 is off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass in (0, 1]; 1 is off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")
    g.add_argument("--no-chat", action="store_true",
                   help="feed text prompts as they are, without the model's chat template")
    drafting = {m.name for m in methods.REGISTRY.values() if m.drafts}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for o in methods.OPTIONS.values():
        if not o.flag:
            continue
        group = groups.get(o.group) or groups.setdefault(o.group, p.add_argument_group(o.group))
        takers = methods.TAKES[o.name]
        named = set(takers) == drafting or o.group != methods.options.DRAFTING_GROUP  # a method's own group names it
        help = o.help if named else f"{', '.join(takers)}: {o.help}"
        if o.name == "max_draft":
            help += f" (default: {_max_draft_defaults()}; specee drafts nothing)"
        if o.type == "bool":
            group.add_argument(o.flag_name, action="store_true", default=None, help=help)
        else:
            group.add_argument(o.flag_name, type=_layers if o.type == "layers" else TYPES[o.type], default=None,
                               metavar=o.metavar, choices=o.choices, help=help)


def generation_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of `Model.stream` (after the requests and the method)."""
    given = {name: getattr(args, name) for name, o in methods.OPTIONS.items() if o.flag}
    return dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, batching=args.batching,
                pricing=args.pricing, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                **{k: v for k, v in given.items() if v is not None})


def check_generation_args(args: argparse.Namespace) -> None:
    """Cheap checks of the generation options, before any model is loaded."""
    from jspec.engine.sampling import Sampling
    from jspec.model.sharding import parse_mesh

    if args.method not in methods.METHODS:
        raise JspecError(f"unknown --method {args.method!r}; choose one of {', '.join(methods.METHODS)}")
    if args.max_new_tokens < 1:
        raise JspecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise JspecError(f"--batch-size must be >= 1, got {args.batch_size}")
    Sampling(args.temperature, args.top_k, args.top_p)  # raises a JspecError naming the option
    options = generation_options(args)
    methods.check(args.method, {k: v for k, v in options.items() if k in methods.OPTIONS})
    if args.method in methods.LOSSY:
        logging.getLogger("jspec").warning(
            f"--method {args.method} is lossy: its output differs from ar's (docs/methods.md measures the cost)")
    if args.mesh is not None:
        parse_mesh(args.mesh)
