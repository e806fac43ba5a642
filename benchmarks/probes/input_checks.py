"""What issue 72's checks of untrusted input cost on the default model, each side by side with the
same work unchecked, in one run:

- loading a converted folder in a new process, with and without the finite-weights check
  (`jspec.convert.store.check_finite`; the runs alternate, so drift in the host's speed falls on both);
- rendering chat prompts with jspec's bounded template environment against Jinja's plain sandbox
  (the one transformers uses), the same template, the same prompts;
- the GGUF layout pre-scan (`jspec.convert.gguf_checks.check_layout`) against opening the file
  with gguf's reader.

    python benchmarks/probes/input_checks.py [--runs 5] [--output benchmarks/results/DATE_input-checks.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LOAD = """
import sys, time, jax
from jspec.convert import cache, store
if sys.argv[1] == "unchecked":
    store.check_finite = lambda tree, where: None
path = cache.resolve(None)
start = time.perf_counter()
cfg, params, tokenizer = store.load(path)
jax.block_until_ready(params)
print(time.perf_counter() - start)
"""


def load_seconds(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", LOAD, mode], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def render_seconds(runs: int) -> dict:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    import jspec
    from jspec import jsonl, prompt_sets

    tokenizer = jspec.load().tokenizer
    prompts = jsonl.read_prompts(prompt_sets.resolve("train_prompts"))[:200]
    conversations = [[{"role": "user", "content": p["prompt"]}] for p in prompts if "prompt" in p]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[jinja2.ext.loopcontrols]).from_string(tokenizer.chat_template)
    out = {"bounded": [], "plain": []}
    for _ in range(runs):
        start = time.perf_counter()
        bounded = [tokenizer.render_chat(m) for m in conversations]
        out["bounded"].append(time.perf_counter() - start)
        start = time.perf_counter()
        unbounded = [plain.render(messages=m, add_generation_prompt=True, **tokenizer.special_tokens)
                     for m in conversations]
        out["plain"].append(time.perf_counter() - start)
        assert bounded == unbounded, "the bounded render wrote other text"
    return {"prompts": len(conversations), **out}


def scan_seconds(runs: int) -> dict:
    import gguf

    from jspec.convert import gguf_checks
    from jspec.convert.cache import default_gguf

    path = str(default_gguf())
    out = {"check_layout": [], "GGUFReader": []}
    for _ in range(runs):
        start = time.perf_counter()
        gguf_checks.check_layout(path)
        out["check_layout"].append(time.perf_counter() - start)
        start = time.perf_counter()
        gguf.GGUFReader(path)
        out["GGUFReader"].append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--output")
    args = parser.parse_args()

    load_seconds("checked")  # converts the default model into the cache first, if it is not there
    loads = {"checked": [], "unchecked": []}
    for _ in range(args.runs):
        for mode in loads:
            loads[mode].append(load_seconds(mode))
    rows = [{"what": "load the default model (new process)", **loads},
            {"what": "render chat prompts", **render_seconds(args.runs)},
            {"what": "open the default GGUF", **scan_seconds(args.runs)}]
    print("| what | checked (median s) | unchecked (median s) |\n| --- | --- | --- |")
    for row in rows:
        checked, unchecked = [row[k] for k in row if isinstance(row[k], list)]
        print(f"| {row['what']} | {statistics.median(checked):.3f} | {statistics.median(unchecked):.3f} |")
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
