"""Continuous batching: a batch of B slots, each row refilled with the next prompt once it finishes.

The rows of a static batch (jspec.engine.loop.generate) that finished keep their slot until its
longest row ends. Here the host (jspec.api) runs these programs over one LoopState of B rows:

    fill     prefill the first B prompts into the batch's cache (`active` marks the rows that hold one)
    advance  decoding rounds until `need` rows finished that the host has not yet taken, or all did
             (or a number of rounds passed: jspec.engine.pricing times rounds with it)
    admit    prefill n new prompts and put them into the given slots (rows), mid-run (the host
             admits the free slots' prompts in groups of as many prefill chunks, n a power of
             two: a program per n; jspec.batching.admit_groups)
    admit_staged  put one prompt that fill prefilled ahead, with others, into a slot: on a CPU
             the host stages the next few prompts so (jspec.batching.stage_rows) and admits
             none itself

A round is the same `Run.round` in every program, so each row decodes as it would alone: speculation
per row, and for the lossless methods the tokens of `ar` at batch 1. A row's cache, tokens,
counters, drafter state and controller state are its rows of each array of the LoopState
(jspec.engine.state), so admitting a prompt is prefilling it into the slot's rows of the cache
and writing its rows of the rest of a fresh prefill's state over the slot's; nothing of the slot's
last prompt is read again (entries past a row's length are never attended to). The batch's
cache length is fixed for the run: its longest prompt's bucket, plus max_new_tokens and the draft.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.engine.loop import Run
from jspec.engine.state import LoopState
from jspec.model import decoder, sharding


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("cache",))
def fill(params, dparams, cache: decoder.KVCache, tokens, lens, active, eos_ids, key, *, run: Run) -> LoopState:
    """The batch's first B prompts (tokens [B, S] and lens [B], as in loop.generate) prefilled into
    `cache`; rows whose `active` [B] is False (a run with fewer prompts than slots) start done."""
    with run.tracing():
        s = run.start(params, dparams, cache, tokens, lens, eos_ids, key)
        return pinned(dataclasses.replace(s, done=s.done | ~active), run.mesh)


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("s",))
def admit(params, dparams, s: LoopState, tokens, lens, slots, eos_ids, key, *, run: Run) -> LoopState:
    """n prompts (tokens [n, S], lens [n]) prefilled and put into rows slots [n] of s (distinct
    slots below B). The prefill writes the batch's cache in place, in the slots' rows
    (decoder.KVCache.rows): a fresh cache of n rows to copy in after cost an admit 40 ms of
    zeros and copies at 2,368 positions, where its prefill of a short prompt took as long."""
    with run.tracing():
        new = run.start(params, dparams, dataclasses.replace(s.cache, rows=slots), tokens, lens, eos_ids, key)
        without_cache = functools.partial(dataclasses.replace, cache=None)
        s = put_rows(without_cache(s), without_cache(new), slots)
        return pinned(dataclasses.replace(s, cache=dataclasses.replace(new.cache, rows=None)), run.mesh)


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("s",))
def admit_staged(params, dparams, s: LoopState, staged: LoopState, row, slot, *, run: Run) -> LoopState:
    """Row `row` of `staged` (prompts prefilled ahead by fill into a cache of their own: the host
    stages them where jspec.batching.stage_rows says) put into slot `slot` of s, its cache row
    with it."""
    with run.tracing():
        one = jax.tree.map(lambda x: x if x.ndim == 0 else jax.lax.dynamic_slice_in_dim(x, row, 1), staged)
        return pinned(put_rows(s, one, slot[None]), run.mesh)


def put_rows(s: LoopState, new: LoopState, slots: jax.Array) -> LoopState:
    """s with rows slots [n] of every per-row array taken from new's n rows. 0-d arrays (the loop's
    key, a controller's constant) are shared by the rows and stay s's."""
    def put(full, rows):
        return full if full.ndim == 0 else full.at[slots].set(rows.astype(full.dtype))

    return jax.tree.map(put, s, new)


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("s",))
def advance(params, dparams, s: LoopState, eos_ids, idle, need, costs, until, *, run: Run):
    """Rounds until `need` rows that are not `idle` [B] (rows whose output the host took, or that
    hold no prompt) are done, or every row is, or the batch has run `until` rounds (s.steps), with
    rounds priced by `costs` (jspec.engine.pricing) or not (None). Returns (s, done [B], out,
    stats) with out and stats as loop.generate's, for every row."""
    with run.tracing():
        going = lambda s: ~jnp.all(s.done) & (jnp.sum(s.done & ~idle) < need) & (s.steps < until)  # noqa: E731
        s = jax.lax.while_loop(going, functools.partial(run.round, params, dparams, eos_ids, costs), s)
        return (pinned(s, run.mesh), s.done, *run.finish(s))


def pinned(s: LoopState, mesh: Mesh | None) -> LoopState:
    """s laid out on `mesh` as every program here returns it (the cache as caches are split, the
    rest by rows): each program is compiled for the layout the last one left, whichever it was."""
    return dataclasses.replace(sharding.pin_rows(s, mesh), cache=sharding.pin_cache(s.cache, mesh))
