"""Int8 weights against float32 ones, and llama.cpp's 8-bit, side by side in one run (issue 76).

    python benchmarks/int8.py --limit 2 --llama-python /path/to/venv/bin/python \\
        --output benchmarks/results/DATE_int8.jsonl --markdown benchmarks/results/DATE_int8.md

The default model loaded twice, in float32 and in int8 (jspec.model.weights), decodes the same
prompts (Spec-Bench's questions, `--limit` of each category) greedy: at each batch size `ar` in
float32, then `ar` and each of `--methods` in int8. Per run: tokens/s over the Model's clock
(compiles left out), the ratio to float32 `ar` at that batch size, and rows token-identical to
the int8 `ar` (every lossless method must give all of them) and to float32 `ar` (reported). The
quality rows give mean NLL a token (jspec.bench.quality): of both `ar` outputs under the float32
model, and teacher-forced, of float32 `ar`'s output under each model (the same text for both).

The anchor: llama.cpp (llama-cpp-python, in the interpreter `--llama-python` names: it is built
from source, so it lives apart from jspec's environment) on a Q8_0 copy of the same GGUF, made by
llama.cpp's own quantizer, at batch 1, greedy, the same chat prompts and token budget, its wall
time including the prompt's prefill as jspec's records do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import jspec  # noqa: E402
from jspec import prompt_sets  # noqa: E402
from jspec.bench import quality  # noqa: E402
from jspec.bench.specs import parse_methods, read_bench_prompts  # noqa: E402
from jspec.convert import cache as model_cache  # noqa: E402

# Runs in --llama-python: quantize the GGUF to Q8_0 once, then decode each prompt alone.
LLAMA = r"""
import json, os, sys, time
import llama_cpp
src, q8, listed, max_new, threads = sys.argv[1:6]
prompts, max_new, threads = json.loads(open(listed).read()), int(max_new), int(threads)
if not os.path.exists(q8):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(src.encode(), q8.encode(), params) == 0
llm = llama_cpp.Llama(q8, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
out = []
for p in prompts:
    t = time.perf_counter()
    r = llm.create_chat_completion([{"role": "user", "content": p}], max_tokens=max_new, temperature=0.0, top_k=1)
    out.append({"seconds": time.perf_counter() - t, "new_tokens": r["usage"]["completion_tokens"]})
print(json.dumps({"version": llama_cpp.__version__, "runs": out, "q8_bytes": os.path.getsize(q8)}))
"""


def timed(model, requests, method: str, batch_size: int, max_new: int, options: dict) -> tuple[float, dict]:
    """Tokens/s of a run after an untimed one of its first batch, which compiles and, for a priced
    method, measures its round costs: what a run of thousands of prompts pays once."""
    list(model.stream(requests[:batch_size], method, max_new_tokens=max_new, batch_size=batch_size, **options))
    began = model.clock()
    records = list(model.stream(requests, method, max_new_tokens=max_new, batch_size=batch_size, **options))
    seconds = model.clock() - began
    return sum(r["new_tokens"] for r in records) / seconds, {r["id"]: r for r in records}  # by prompt id


def llama_cpp_anchor(args, prompts: list[dict]) -> dict:
    gguf = model_cache.default_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        listed = Path(tmp) / "prompts.json"
        listed.write_text(json.dumps([p["prompt"] for p in prompts]))
        q8 = args.q8_path or str(Path(tmp) / "q8_0.gguf")
        done = subprocess.run([args.llama_python, "-c", LLAMA, str(gguf), q8, str(listed), str(args.max_new_tokens),
                               str(args.threads)], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = sum(r["new_tokens"] for r in result["runs"])
    return {"engine": f"llama.cpp (llama-cpp-python {result['version']}), Q8_0", "batch_size": 1,
            "tokens_per_second": round(tokens / sum(r["seconds"] for r in result["runs"]), 2),
            "new_tokens": tokens, "weights_bytes": result["q8_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ngram,eagle", help="speculative methods run on the int8 model")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="spec_bench")
    p.add_argument("--limit", type=int, default=None, help="the first N questions of each category")
    p.add_argument("--llama-python", default=None, help="a python with llama-cpp-python (none: no anchor)")
    p.add_argument("--q8-path", default=None, help="keep the Q8_0 GGUF here (made once)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (jspec uses every core)")
    p.add_argument("--output", required=True, help="JSONL, one row per run")
    p.add_argument("--markdown", default=None)
    args = p.parse_args()

    models = {"float32": jspec.load(dtype="float32"), "int8": jspec.load(dtype="int8")}
    prompts = read_bench_prompts(prompt_sets.resolve(args.prompts), args.limit)
    requests = models["float32"].requests(prompts)
    rows, outputs = [], {}
    with open(args.output, "w", encoding="utf-8") as out:
        def emit(row):
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), file=sys.stderr)

        for batch_size in map(int, args.batch_sizes.split(",")):
            runs = [("float32", "ar", {}), ("int8", "ar", {})] + [
                ("int8", spec.name, dict(spec.options)) for spec in parse_methods(args.methods) if spec.name != "ar"]
            base = None
            for dtype, method, options in runs:
                rate, records = timed(models[dtype], requests, method, batch_size, args.max_new_tokens, options)
                outputs[dtype, method, batch_size] = records
                base = base or rate
                same = lambda ref: sum(records[i]["token_ids"] == ref[i]["token_ids"] for i in records)  # noqa: E731
                emit({"engine": "jspec", "dtype": dtype, "method": method, "batch_size": batch_size,
                      "prompts": len(records), "new_tokens": sum(r["new_tokens"] for r in records.values()),
                      "tokens_per_second": round(rate, 2), "vs_float32_ar": round(rate / base, 3),
                      "same_as_int8_ar": same(outputs["int8", "ar", batch_size]) if dtype == "int8" else None,
                      "same_as_float32_ar": same(outputs["float32", "ar", batch_size])})
        first = int(args.batch_sizes.split(",")[0])
        def pairs(dtype):  # (prompt ids, output ids) of `ar` at the first batch size
            return [(r.token_ids, outputs[dtype, "ar", first][r.id]["token_ids"]) for r in requests]
        emit({"quality": "mean NLL a token under the float32 model", "batch_size": first,
              **{f"{d}_ar": round(quality.mean_nll(models["float32"], pairs(d)), 4) for d in models}})
        # The same text under both models: float32 `ar`'s outputs scored by each. Two models'
        # own outputs differ from the first diverging token on, and a different continuation's
        # NLL moves by more than the weights' error (docs/benchmarks.md, "Int8 weights").
        emit({"quality": "mean NLL a token of float32 ar's output (teacher-forced)", "batch_size": first,
              **{f"{d}_model": round(quality.mean_nll(models[d], pairs("float32")), 4) for d in models}})
        if args.llama_python:
            emit(llama_cpp_anchor(args, prompts))
    if args.markdown:
        Path(args.markdown).write_text(table(rows, args), encoding="utf-8")


def table(rows: list[dict], args) -> str:
    jspec_rows = [r for r in rows if r.get("engine") == "jspec"]
    lines = [f"# Int8 weights against float32 ({jspec_rows[0]['prompts']} prompts of {args.prompts}, "
             f"{args.max_new_tokens} new tokens, greedy)", "",
             "Command: `python benchmarks/int8.py --methods " + args.methods + f" --batch-sizes {args.batch_sizes}"
             + (f" --limit {args.limit}" if args.limit else "") + (" --llama-python ..." if args.llama_python else "")
             + "`", "",
             "| weights | method | batch | tokens/s | vs float32 ar | rows = int8 ar | rows = float32 ar |",
             "|---|---|---|---|---|---|---|"]
    for r in jspec_rows:
        lines.append(f"| {r['dtype']} | {r['method']} | {r['batch_size']} | {r['tokens_per_second']:.1f} | "
                     f"{r['vs_float32_ar']:.2f}x | {r['same_as_int8_ar'] if r['same_as_int8_ar'] is not None else '-'}"
                     f"{'/' + str(r['prompts']) if r['same_as_int8_ar'] is not None else ''} | "
                     f"{r['same_as_float32_ar']}/{r['prompts']} |")
    for r in rows:
        if "quality" in r:
            what = "ar" if "int8_ar" in r else "model"  # whose output is scored, or which model scores
            f32, i8 = r[f"float32_{what}"], r[f"int8_{what}"]
            lines += ["", f"Quality ({r['quality']}, batch {r['batch_size']}): float32 {what} {f32:.4f}, "
                          f"int8 {what} {i8:.4f} ({100 * (i8 / f32 - 1):+.2f}%)."]
        if r.get("engine", "").startswith("llama.cpp"):
            ar = next(x for x in jspec_rows if x["dtype"] == "int8" and x["method"] == "ar" and x["batch_size"] == 1)
            lines += ["", f"Anchor: {r['engine']}, batch 1, {r['tokens_per_second']:.1f} tokens/s "
                          f"({r['weights_bytes'] / 1e6:.0f} MB file); int8 `ar` "
                          f"{ar['tokens_per_second'] / r['tokens_per_second']:.2f}x it."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
