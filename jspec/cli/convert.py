"""`jspec convert`: a GGUF file or a Hugging Face model into a jspec folder, converted once."""

from __future__ import annotations

import argparse
import time

HELP = "convert a GGUF file or Hugging Face model into a fast-loading jspec folder"
DESCRIPTION = ("Convert SRC (a GGUF file, a Hugging Face folder, or a hub id in the local HF cache) into the jspec "
               "checkpoint folder OUT, then time loading it.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="GGUF file, Hugging Face folder, or cached hub id")
    p.add_argument("out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="stored parameter dtype (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import jax

    from jspec.convert import store

    t0 = time.perf_counter()
    out = store.convert(args.src, args.out, args.dtype)
    convert_s = time.perf_counter() - t0
    print(f"converted {args.src} -> {out} ({args.dtype}) in {convert_s:.2f} s")
    t0 = time.perf_counter()
    cfg, params, tokenizer = store.load(out)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    tok = "with tokenizer" if tokenizer is not None else "no tokenizer: token ids only"
    print(f"loaded {out} in {load_s:.2f} s ({sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M parameters, "
          f"{cfg.arch}, {tok})")
    return 0
