"""What a priced round that drafts nothing costs against `ar`'s step, side by side in one process
(issue 75: a method priced out should decode at `ar`'s speed).

    python benchmarks/probes/plain_round.py --dtype bfloat16 --batch-sizes 8,32 --methods ar,auto

For each batch size the first B Spec-Bench questions are prefilled into a batch of B rows
(`jspec.engine.slots.fill`, the continuous-batching programs priced rounds are measured on); then,
`--passes` times, each method in turn runs a call of 1 and a call of 1 + `--rounds` rounds
(`slots.advance`), every round of a priced method forced to draft nothing (`pricing.forcing(0)`).
A round's time is the difference over `--rounds`, the fastest of the passes counting (as
jspec.engine.pricing.measure takes it, with its `timed`). Prints ms a round and the ratio to the
first method's.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec import methods, prompt_sets  # noqa: E402
from jspec.bench.specs import read_bench_prompts  # noqa: E402
from jspec.engine import pricing, slots  # noqa: E402
from jspec.engine.sampling import Sampling  # noqa: E402


def timer(model, requests, rows: int, method: str, max_new: int):
    """seconds(rounds): the wall time of a call of that many of `method`'s rounds, each drafting
    nothing, on the batch's continuous-batching programs, called as Model.round_costs calls them
    (jspec.engine.pricing.measure's fill and advance)."""
    plan = methods.build(method, model)
    k = plan[0].max_draft
    length = model.cache_length(requests, max_new, k)
    tokens, lens = model.prompt_rows(requests, rows, length)
    run = functools.partial(model._run_program, plan=plan, max_new=max_new, sampling=Sampling(), logprobs=0)
    eos, idle = model._eos(), np.zeros(rows, bool)
    costs = pricing.forcing(0, k) if k else None

    def fill():
        return run(slots.fill, rows, length, model._cache(rows, length), model._rows(tokens), model._rows(lens),
                   model._rows(~idle), eos, jax.random.key(0))[0]

    def advance(s, costs, rounds):
        steps = int(s.steps)
        (s, *_), _ = run(slots.advance, rows, length, s, eos, model._rows(idle), np.int32(rows + 1),
                         model._on_all(costs), np.int32(steps + rounds))
        return s, int(s.steps) - steps

    state = {"s": fill()}

    def seconds(rounds: int) -> float:
        state["s"], took = pricing.timed(fill, advance, state["s"], costs, rounds)
        return took

    seconds(1)  # compiles
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default="ar,auto")
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    names = args.methods.split(",")
    model = jspec.load(dtype=args.dtype)
    prompts = read_bench_prompts(prompt_sets.resolve(prompt_sets.SPEC_BENCH), None)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        requests = model.requests(prompts[:b])
        timers = {m: timer(model, requests, model.batch_rows(b, b), m, args.max_new_tokens) for m in names}
        best = {m: np.inf for m in names}
        for _ in range(args.passes):
            for m in names:
                one, more = timers[m](1), timers[m](1 + args.rounds)
                best[m] = min(best[m], (more - one) / args.rounds)
        base = best[names[0]]
        print(f"{args.dtype} batch {b}: " + ", ".join(
            f"{m} {best[m] * 1e3:.2f} ms ({best[m] / base:.3f}x)" for m in names), flush=True)


if __name__ == "__main__":
    main()
