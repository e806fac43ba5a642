"""What a forward over a few rows costs with jspec's native kernel and without (issue 13).

One run, side by side, on the default model in float32 (cache of 512, donated as in the
engine's loop):

  * a forward over R = 1, 2, 5, 8, 16 positions of one row (a verification of R - 1 drafts),
    in milliseconds and as a multiple of the one-position decode step of the JAX path (where
    one row is XLA's matrix-vector kernel);
  * `ar` tokens per second at batch 1 and batch 8 (8 prompts, 64 new tokens), and whether the
    tokens are the same with and without the kernel.

The two paths alternate call by call, ROUNDS times, and every figure is a median, so a process
sharing the machine slows both alike.

    python benchmarks/probes/few_rows.py
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.api import Model
from jspec.model import decoder as M, kernels

ROWS = (1, 2, 5, 8, 16)
CALLS = 15  # timed forwards per path, shape and round
ROUNDS = 3
PROMPTS = ["Name three primes.", "What is a hash table?", "Write a haiku about rain.",
           "Explain recursion in one sentence.", "List four colours.", "What is 12 times 7?",
           "Say hello in French.", "Why is the sky blue?"]
NEW_TOKENS = 64


def compiled(use_native: bool, build):
    """build() traced and compiled with the kernel on or off (the choice is made at trace time)."""
    kernels.enabled = use_native
    jax.clear_caches()
    return build()


def forward_programs(m, rows=ROWS):
    """(build, args): build() compiles a forward over each of `rows` positions (one row, the
    linears through whatever `kernels.enabled` says at trace time); args(r) are a program's arguments."""
    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens, positions):
        h, cache = M.forward(params, m.cfg, tokens, positions, cache)
        return M.logits(params, m.cfg, h), cache

    def args(r):
        return (M.KVCache.zeros(m.cfg, 1, 512), jnp.zeros((1, r), jnp.int32),
                jnp.arange(100, 100 + r, dtype=jnp.int32)[None])

    def build():
        out = {}
        for r in rows:
            lowered = step.lower(m.params, *args(r))
            target = kernels.TARGETS[jnp.dtype(m.dtype)]
            x, w = jax.ShapeDtypeStruct((r, 1), jnp.float32), jax.ShapeDtypeStruct((1, 1), m.dtype)
            assert (target in lowered.as_text()) == kernels.takes(x, w, r)
            out[r] = lowered.compile()
        return out
    return build, args


def time_forwards(m, paths: dict, args, rows=ROWS, calls=CALLS) -> tuple[dict, dict]:
    """Each path's programs (R -> compiled forward, from forward_programs) called in turn, `calls`
    times per R, ROUNDS times: the median ms per (path, R), and each path's last logits per R."""
    times = {(p, r): [] for p in paths for r in rows}
    logits = {}
    for _ in range(ROUNDS):
        for r in rows:
            state = {p: args(r) for p in paths}
            for _ in range(calls):
                for p, programs in paths.items():
                    cache, tokens, positions = state[p]
                    start = time.perf_counter()
                    out, cache = programs[r](m.params, cache, tokens, positions)
                    out.block_until_ready()
                    times[p, r].append(time.perf_counter() - start)
                    state[p] = cache, tokens, positions
                    logits[p, r] = out
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}, logits


def time_ar(m) -> tuple[dict, bool]:
    def build():
        model = Model(m.cfg, m.params, m.tokenizer, name=m.name)
        for b in (1, 8):  # compiles (the first run of a shape is not timed)
            model.generate(PROMPTS[:b], "ar", max_new_tokens=NEW_TOKENS, batch_size=b)
        return model

    models = {"native": compiled(True, build), "jax": compiled(False, build)}
    rates, tokens = {(p, b): [] for p in models for b in (1, 8)}, {}
    for _ in range(ROUNDS):
        for b in (1, 8):
            for p, model in models.items():
                records = model.generate(PROMPTS if b == 8 else PROMPTS[:2], "ar",
                                         max_new_tokens=NEW_TOKENS, batch_size=b)
                if b == 1:
                    rates[p, b] += [r["tokens_per_second"] for r in records]
                else:
                    rates[p, b].append(sum(r["new_tokens"] for r in records) / records[0]["seconds"])
                tokens[p, b] = [r["token_ids"] for r in records]
    same = all(tokens["native", b] == tokens["jax", b] for b in (1, 8))
    return {k: float(np.median(v)) for k, v in rates.items()}, same


def main() -> None:
    if kernels.unavailable:
        raise SystemExit(f"the native kernel is unavailable: {kernels.unavailable}")
    m = jspec.load(dtype="float32")
    build, args = forward_programs(m)
    ms, _ = time_forwards(m, {"native": compiled(True, build), "jax": compiled(False, build)}, args)
    step = ms["jax", 1]
    print(f"Forward over R positions (B = 1), median of {ROUNDS} x {CALLS}; 'steps' = / the JAX path's "
          f"1-position step ({step:.1f} ms)\n")
    print("| R | native ms | native steps | JAX ms | JAX steps |\n| --- | --- | --- | --- | --- |")
    for r in ROWS:
        print(f"| {r} | {ms['native', r]:.1f} | {ms['native', r] / step:.2f} | {ms['jax', r]:.1f} | "
              f"{ms['jax', r] / step:.2f} |", flush=True)
    rates, same = time_ar(m)
    print(f"\n`ar`, {NEW_TOKENS} new tokens, tokens/s (median; batch 8 counts all rows)\n")
    print("| batch | native | JAX |\n| --- | --- | --- |")
    for b in (1, 8):
        print(f"| {b} | {rates['native', b]:.1f} | {rates['jax', b]:.1f} |")
    print(f"\ntokens identical with and without the kernel: {same}")


if __name__ == "__main__":
    main()
