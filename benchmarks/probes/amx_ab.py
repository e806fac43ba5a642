"""AMX's tiles against the AVX-512 tiles for bfloat16 or int8 weights, in one process, the two paths
taking turns call by call (jspec/model/kernels/matmul.cc, docs/design.md "Tiles of AMX").

    python benchmarks/probes/amx_ab.py --rows 1,5,9,16,32,64 [--dtype int8]
    python benchmarks/probes/amx_ab.py --methods ar,auto --batch-size 8 [--dtype int8]

With --rows: the default model's 121 matrices of a decode step (random values in --dtype), each
times R rows, in one program; the median of 15 calls a path. With --methods: the default model in
--dtype decodes the first --prompts Spec-Bench questions (128 new tokens, greedy) --repeats
times a path in turn, after an untimed pass of each (compiles, and measures a priced round's
costs); tokens/s at batch size 1 over the records' own seconds, above it over the calls' wall
time (prefill included). The switch is read inside the kernel at each call, so both paths run
the same compiled programs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from int8_matmul import STEP_SHAPES  # this script's folder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import jspec  # noqa: E402
from jspec import prompt_sets  # noqa: E402
from jspec.bench.specs import read_bench_prompts  # noqa: E402
from jspec.model import kernels, weights  # noqa: E402

PATHS = {"AVX-512": False, "AMX": True}


def matrices(rows: list[int], dtype: str) -> None:
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.05) for s in STEP_SHAPES]
    ws = [weights.quantize(w) if dtype == "int8" else w.astype(dtype) for w in ws]

    @jax.jit
    def step(x576, x1536, ws):
        return jnp.concatenate([kernels.matmul(x576 if w.shape[1] == 576 else x1536, w)[:, :1] for w in ws], 1)

    print("| rows | AVX-512, ms | AMX, ms | speedup |\n| ---: | ---: | ---: | ---: |")
    for r in rows:
        args = (jnp.asarray(rng.standard_normal((r, 576), dtype=np.float32)),
                jnp.asarray(rng.standard_normal((r, 1536), dtype=np.float32)), ws)
        ms = {path: [] for path in PATHS}
        for calls in (1, 15):  # the first call a path: untimed
            for _ in range(calls):
                for path, use in PATHS.items():
                    kernels.amx(use)
                    began = time.perf_counter()
                    step(*args).block_until_ready()
                    ms[path].append(1e3 * (time.perf_counter() - began))
        avx, amx = (np.median(ms[path][1:]) for path in PATHS)
        print(f"| {r} | {avx:.2f} | {amx:.2f} | {avx / amx:.2f}x |", flush=True)


def decoding(methods: list[str], batch_size: int, prompts: int, repeats: int, dtype: str) -> None:
    model = jspec.load(dtype=dtype)
    questions = read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH), 1)[:prompts]
    tokens, seconds, outputs = {}, {}, {}
    for timed in (False,) + (True,) * repeats:
        for path, use in PATHS.items():
            kernels.amx(use)
            for method in methods:
                began = time.perf_counter()
                records = model.generate(questions, method=method, max_new_tokens=128, batch_size=batch_size)
                wall = time.perf_counter() - began
                outputs.setdefault((path, method), [r["token_ids"] for r in records])
                if timed:
                    tokens[path, method] = tokens.get((path, method), 0) + sum(r["new_tokens"] for r in records)
                    seconds[path, method] = seconds.get((path, method), 0.0) + (
                        sum(r["seconds"] for r in records) if batch_size == 1 else wall)
    print(f"{dtype}, batch {batch_size}, {len(questions)} questions, {repeats} repeats")
    for method in methods:
        speed = {path: tokens[path, method] / seconds[path, method] for path in PATHS}
        same = all(outputs[path, method] == outputs[path, methods[0]] for path in PATHS)
        print(f"{method}: " + ", ".join(f"{path} {s:.1f} tokens/s" for path, s in speed.items())
              + f", AMX {speed['AMX'] / speed['AVX-512']:.2f}x; rows equal to {methods[0]}'s on each path: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=None, help="comma-separated row counts: time the step's matrices")
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "int8"])
    args = parser.parse_args()
    if kernels.unavailable or not kernels.amx(True):
        raise SystemExit(f"AMX's path is not available here: {kernels.unavailable or 'the CPU or Linux lacks AMX'}")
    if args.rows:
        matrices([int(r) for r in args.rows.split(",")], args.dtype)
    else:
        decoding(args.methods.split(","), args.batch_size, args.prompts, args.repeats, args.dtype)
    kernels.amx(True)


if __name__ == "__main__":
    main()
