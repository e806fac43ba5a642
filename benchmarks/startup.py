"""Wall time of a one-prompt `jspec generate` in a new process: without JAX's persistent
compilation cache, filling it, and loading from it (docs/design.md, "Compiled programs across
processes").

    python benchmarks/startup.py [--methods ar,kangaroo] [--runs 2] [--dtype bfloat16] [--model M]

Prints a markdown table. Runs without the cache and from it alternate, so that drift in the
host's speed falls on both columns; every run must print what the first printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

PROMPT = "Explain speculative decoding in one sentence."


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"startup: {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return seconds, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="ar,kangaroo")
    parser.add_argument("--runs", type=int, default=2, help="runs from the cache, each followed by one without")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model")
    args = parser.parse_args()

    columns = ("without the cache", "filling it", "from it")
    print("| method | " + " | ".join(f"{c} (s)" for c in columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for method in args.methods.split(","):
        argv = [sys.executable, "-m", "jspec.cli", "generate", PROMPT, "--method", method, "--dtype", args.dtype]
        argv += ["--model", args.model] if args.model else []
        seconds: dict[str, list[float]] = {c: [] for c in columns}
        outputs = set()
        with tempfile.TemporaryDirectory() as folder:
            off, on = {"JAX_ENABLE_COMPILATION_CACHE": "false"}, {"JAX_COMPILATION_CACHE_DIR": folder}
            runs = [(columns[0], off), (columns[1], on)] + [(columns[2], on), (columns[0], off)] * args.runs
            for column, env in runs:
                t, text = timed(argv, env)
                seconds[column].append(t)
                outputs.add(text)
        if len(outputs) != 1:
            sys.exit(f"startup: {method}'s runs printed different text")
        print(f"| `{method}` | " + " | ".join(", ".join(f"{t:.1f}" for t in seconds[c]) for c in columns) + " |",
              flush=True)


if __name__ == "__main__":
    main()
