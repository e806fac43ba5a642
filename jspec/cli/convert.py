"""`jspec convert`: a GGUF file or a Hugging Face model into a jspec folder, converted once."""

from __future__ import annotations

import argparse
import time

from jspec.model import weights

HELP = "convert a GGUF file or Hugging Face model into a fast-loading jspec folder"
DESCRIPTION = ("Convert SRC (a GGUF file, a Hugging Face folder, or a hub id in the local HF cache) into the jspec "
               "checkpoint folder OUT, or without OUT into jspec's cache, where --model SRC finds it (a TPU pod's "
               "setup converts there once, before the first run). Conversion runs on the host, a layer at a time.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="GGUF file, Hugging Face folder, or cached hub id")
    p.add_argument("out", metavar="OUT", nargs="?", default=None,
                   help="the folder to write (must not exist, or be empty); default: jspec's cache")
    p.add_argument("--dtype", default=None, choices=weights.DTYPES,
                   help="stored parameter dtype (default: the checkpoint's own: bfloat16 for most Hugging Face "
                        "models, float32 for GGUF files); int8 quantizes every matrix, one scale per output channel")


def run(args: argparse.Namespace) -> int:
    from jspec.convert import cache, store

    t0 = time.perf_counter()
    out = store.convert(args.src, args.out, args.dtype) if args.out is not None else cache.resolve(args.src, args.dtype)
    seconds = time.perf_counter() - t0
    cfg, meta = store.read_meta(out)
    size = sum(f.stat().st_size for f in (out / "params").rglob("*") if f.is_file())
    print(f"{args.src} -> {out}: {cfg.arch}, {cfg.num_layers} layers, {meta['dtype']}, {size / 2**30:.2f} GiB "
          f"in {seconds:.1f} s")
    return 0
