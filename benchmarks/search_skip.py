"""Search the default model's layer-skip set (SWIFT-style), then pick it by measured speed.

1. Score: the fraction of answer positions where the model with a set of layers skipped predicts
   the same next token as the full model, teacher-forced over the model's own greedy answers to
   training prompts (one parallel pass per candidate, no generation).
2. Search: for each skip count m, random sets of m layers (the first and last layer always kept,
   as SWIFT does) are scored and the best kept.
3. Pick: each count's best set runs `jspec bench` (layer-skip with its default K and controller)
   next to `ar` on the held-out training prompts of benchmarks/heldout_prompts.jsonl; the fastest
   set is written to checkpoints/smollm2-135m-instruct/layer-skip.json, which `--method
   layer-skip` reads when no --skip-layers is given.

Uses only ../shared/data/train_prompts.jsonl (never Spec-Bench). Prints a Markdown table.

    python benchmarks/search_skip.py --prompts 8 --tokens 48 --trials 24 --counts 4,6,8,10,12
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import methods
from jspec import model as M

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "shared" / "data" / "train_prompts.jsonl"
HELDOUT = HERE / "heldout_prompts.jsonl"


def skipped_forward(params, cfg, tokens, skip):
    """Teacher-forced logits of the model with layers where skip[i] is True left out."""
    h = M.embed(params, tokens)
    cos, sin = M.rope_at(cfg, h, None)
    zeros = jnp.zeros((*tokens.shape, cfg.num_kv_heads, cfg.head_dim), h.dtype)
    for i, lp in enumerate(params["layers"]):
        def run(h, lp=lp):
            return M.decoder_layer(cfg, lp, h, None, cos, sin, zeros, zeros)[0]
        h = jax.lax.cond(skip[i], lambda h: h, run, h)
    return M.logits(params, cfg, h)


def search(model, prompts: int, tokens: int, trials: int, counts: list[int], seed: int) -> dict[int, tuple]:
    """{m: (agreement, best skip set of m layers)}."""
    cfg = model.cfg
    heldout = {json.loads(line)["id"] for line in HELDOUT.read_text(encoding="utf-8").split("\n") if line.strip()}
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").split("\n") if line.strip()]
    rng = random.Random(seed)
    picked = rng.sample([r for r in rows if r["id"] not in heldout], prompts)
    records = model.generate([r["prompt"] for r in picked], max_new_tokens=tokens)
    seqs = [model.encode(r["prompt"]) + rec["token_ids"] for r, rec in zip(picked, records)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    scored = np.zeros(ids.shape, bool)
    for i, (s, rec) in enumerate(zip(seqs, records)):
        ids[i, :len(s)] = s
        scored[i, len(s) - len(rec["token_ids"]) - 1:len(s) - 1] = True  # positions predicting answer tokens
    fwd = jax.jit(lambda skip: jnp.argmax(skipped_forward(model.params, cfg, jnp.asarray(ids), skip), -1))
    full = np.asarray(fwd(jnp.zeros(cfg.num_layers, bool)))

    def agreement(skip_set):
        mask = np.zeros(cfg.num_layers, bool)
        mask[list(skip_set)] = True
        return float((np.asarray(fwd(jnp.asarray(mask))) == full)[scored].mean())

    middle = list(range(1, cfg.num_layers - 1))
    best = {}
    for m in counts:
        scores = {tuple(sorted(rng.sample(middle, m))): None for _ in range(trials)}
        scores = {s: agreement(s) for s in scores}
        top = max(scores, key=scores.get)
        best[m] = (scores[top], top)
        print(f"{m} layers skipped: agreement {scores[top]:.3f} with {','.join(map(str, top))}", flush=True)
    return best


def measure(best: dict[int, tuple], max_new_tokens: int, output: Path) -> dict[str, tuple[float, float]]:
    """{method label: (tokens/s, mean accepted tokens)} of ar and each set on the held-out prompts."""
    labels = {m: "layer-skip:skip_layers=" + ",".join(map(str, s)) for m, (_, s) in best.items()}
    cmd = ["jspec", "bench", "--methods", ",".join(["ar", *labels.values()]), "--prompts", str(HELDOUT),
           "--max-new-tokens", str(max_new_tokens), "--output", str(output), "--resume"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in output.read_text().split("\n") if line.strip()]
    stat = lambda label, key: statistics.mean(r[key] for r in rows if r["method"] == label and r["batch_size"] == 1)
    return {label: (stat(label, "tokens_per_second"), stat(label, "mean_accepted_tokens"))
            for label in ["ar", *labels.values()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8, help="training prompts to score agreement on")
    ap.add_argument("--tokens", type=int, default=48, help="answer tokens per scoring prompt")
    ap.add_argument("--trials", type=int, default=24, help="random sets per skip count")
    ap.add_argument("--counts", default="4,6,8,10,12", help="skip counts to search")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per held-out prompt when timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(HERE / "search_skip_results.jsonl"))
    args = ap.parse_args()
    model = jspec.load()
    counts = [int(c) for c in args.counts.split(",")]
    best = search(model, args.prompts, args.tokens, args.trials, counts, args.seed)
    speed = measure(best, args.max_new_tokens, Path(args.output))
    ar = speed["ar"][0]
    table = ["| layers skipped | agreement (teacher-forced) | skip set | mean accepted tokens | speedup vs ar |",
             "| ---: | ---: | --- | ---: | ---: |"]
    ranked = []
    for m, (agree, skip) in best.items():
        tps, accepted = speed["layer-skip:skip_layers=" + ",".join(map(str, skip))]
        ranked.append((tps, m, skip))
        table.append(f"| {m} | {agree:.3f} | {','.join(map(str, skip))} | {accepted:.2f} | {tps / ar:.2f}x |")
    _, m, skip = max(ranked)
    command = "python benchmarks/search_skip.py " + " ".join(sys.argv[1:])
    path = methods.SHIPPED / methods.DEFAULT_MODEL_KEY / "layer-skip.json"
    path.write_text(json.dumps({"skip_layers": list(skip), "searched_by": command, "table": table}, indent=1) + "\n")
    print("\n".join(table))
    print(f"\n`ar`: {ar:.1f} tokens/s on the held-out prompts. Default written to {path}: {m} layers, "
          f"{','.join(map(str, skip))}")


if __name__ == "__main__":
    main()
