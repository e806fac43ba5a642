"""What jspec's decoding programs hold when lowered for a GPU or a TPU (issue 73), read from
`jax.export` (no device needed): for each method, platform and weight dtype, the StableHLO op
counts that decide how a round runs there.

    python benchmarks/probes/export_programs.py [--methods ar,layer-skip,kangaroo] [--rows 1]

Counted, in the whole module and inside `while` bodies (the decode loop's round):
- `case`: conditionals (XLA:GPU copies each branch index to the host: a sync);
- `while`: loops (each condition is a sync on a GPU);
- `dot_general` with a `precision_config` of HIGHEST, and without one (DEFAULT: bfloat16 passes on
  a TPU, TF32 on recent NVIDIA GPUs for float32 operands);
- `convert` from bf16 to f32 of a tensor of at least hidden_size^2 elements: a weight widened (per
  round when inside the loop, unless XLA fuses it into the dot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import methods
from jspec.engine import loop
from jspec.engine.sampling import Sampling
from jspec.model import decoder, kernels
from jspec.model.kernels import gpu_attention

DOT = re.compile(r"stablehlo\.dot_general")
CONVERT = re.compile(r"stablehlo\.convert\s.*?:\s*\(tensor<([0-9x]+)xbf16>\)\s*->\s*tensor<[0-9x]+xf32>")


def regions(text: str):
    """(line, whether it lies in a `while` op's regions) for each line of a StableHLO module; a
    `while` op runs from its line until the braces return to the depth before it (braces inside
    strings, such as a kernel's serialized IR, do not count)."""
    depth, loops = 0, []
    for line in text.splitlines():
        starts = "stablehlo.while" in line
        if starts:
            loops.append(depth)
        yield line, bool(loops) and not starts
        code = re.sub(r'"(?:[^"\\]|\\.)*"', "", line)
        depth += code.count("{") - code.count("}")
        while loops and not starts and depth <= loops[-1]:
            loops.pop()


def count(text: str, weight_elems: int) -> dict:
    out = {k: 0 for k in ("case", "while", "dot_highest", "dot_default", "weight_converts",
                          "case_in_loop", "dot_default_in_loop", "weight_converts_in_loop")}
    for line, inside in regions(text):
        if "stablehlo.case" in line:
            out["case"] += 1
            out["case_in_loop"] += inside
        if "stablehlo.while" in line:
            out["while"] += 1
        if DOT.search(line):
            if "HIGHEST" in line:
                out["dot_highest"] += 1
            else:
                out["dot_default"] += 1
                out["dot_default_in_loop"] += inside
        m = CONVERT.search(line)
        if m and np.prod([int(n) for n in m.group(1).split("x")]) >= weight_elems:
            out["weight_converts"] += 1
            out["weight_converts_in_loop"] += inside
    return out


def export(model, method: str, platform: str, rows: int, max_new: int = 16) -> str:
    """The StableHLO of `model`'s decoding program for `method` on `platform`."""
    plan = methods.build(method, model, **({"datastore": "off"} if method == "ngram" else {}))
    drafter, dparams, controller = plan
    batch = model.requests([[{"role": "user", "content": "Name three primes."}]] * rows)
    s = model.cache_length(batch, max_new, drafter.max_draft)
    tokens, lens = model.prompt_rows(batch, rows, s)
    eos = np.asarray(model.cfg.eos_token_ids or (-1,), np.int32)
    args = jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(eos)
    cache = decoder.KVCache.zeros(model.cfg, rows, s)
    # A GPU's program holds the Pallas attention kernel, a Triton call jax.export asks to be named.
    triton = [jax.export.DisabledSafetyCheck.custom_call(gpu_attention.TARGET)]
    with kernels.off() if platform == "cpu" else contextlib.nullcontext():
        run = loop.Run(model.cfg, Sampling(), max_new, drafter, controller, platform=platform)
        exported = jax.export.export(loop.generate, platforms=[platform], disabled_checks=triton)(
            model.params, dparams, cache, *args, jax.random.key(0), None, run=run)
    return exported.mlir_module()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="ar,layer-skip,kangaroo")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--output")
    args = parser.parse_args()
    rows = []
    for dtype in ("float32", "bfloat16"):
        model = jspec.load(dtype=dtype)
        weight = model.cfg.hidden_size ** 2
        for method in args.methods.split(","):
            for platform in ("cuda", "tpu"):
                row = {"method": method, "platform": platform, "dtype": dtype, "rows": args.rows,
                       **count(export(model, method, platform, args.rows), weight)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
