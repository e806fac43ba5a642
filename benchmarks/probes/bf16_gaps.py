"""How far bfloat16 moves the target's logit gaps from float32's: the basis of `jspec compare --tie`.

At every generated position of a float32 `ar` output, teacher-forced, this takes the float32
model's top two tokens and measures how much the bfloat16 model's gap between the same two
tokens differs from the float32 gap. A divergence whose float32 gap is well inside that spread
is a near-tie that rounding flipped. docs/journal/2026-11-23_reading-a-mismatch.md ("Reading a mismatch") ran it on 16
Spec-Bench first turns (every 30th question), 96 new tokens:

    python -c "import json; [print(json.dumps({'id': q['question_id'], 'prompt': q['turns'][0]}))
               for q in map(json.loads, list(open('../shared/data/spec_bench.jsonl'))[::30])]" > in.jsonl
    jspec generate --prompts in.jsonl --output f32.jsonl --max-new-tokens 96 --batch-size 4
    python benchmarks/probes/bf16_gaps.py --prompts in.jsonl --records f32.jsonl
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.batching import prompt_bucket
from jspec.jsonl import read_prompts, read_records
from jspec.model import decoder as M


@functools.partial(jax.jit, static_argnames="cfg")
def all_logits(params, tokens, cfg):
    h, _ = M.forward(params, cfg, tokens, None, M.KVCache.zeros(cfg, 1, tokens.shape[1]))
    return M.logits(params, cfg, h[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True)
    p.add_argument("--records", required=True, help="a float32 ar output of those prompts")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    f32, bf16 = jspec.load(args.model), jspec.load(args.model, dtype="bfloat16")
    requests = {r.id: r.token_ids for r in f32.requests(read_prompts(args.prompts))}
    shifts, gaps, swaps = [], [], 0
    for record in read_records(args.records):
        prompt = requests[record["id"]]
        tokens = prompt + record["token_ids"]
        padded = np.zeros((1, prompt_bucket(len(tokens))), np.int32)
        padded[0, :len(tokens)] = tokens
        at = slice(len(prompt) - 1, len(tokens) - 1)  # the positions that chose a generated token
        f, b = (np.asarray(all_logits(m.params, jnp.asarray(padded), cfg=f32.cfg))[at] for m in (f32, bf16))
        rows = np.arange(len(f))[:, None]
        top2 = np.argsort(-f, axis=1)[:, :2]
        gap_f, gap_b = (np.subtract(*x[rows, top2].T) for x in (f, b))
        shifts += list(np.abs(gap_b - gap_f))
        gaps += list(gap_f)
        swaps += int(np.sum(gap_b < 0))
    shifts, gaps = np.array(shifts), np.array(gaps)
    q = np.quantile(shifts, [0.5, 0.9, 0.99])
    print(f"{len(shifts)} positions; |bfloat16 gap - float32 gap| of the float32 top two: median {q[0]:.3f}, "
          f"90% {q[1]:.3f}, 99% {q[2]:.3f}, max {shifts.max():.3f}; float32 top-two gaps below 0.5: "
          f"{np.mean(gaps < 0.5):.1%}; positions where bfloat16 swaps the two: {swaps}")


if __name__ == "__main__":
    main()
