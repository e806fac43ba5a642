"""The loop/drafter contract: what the loop carries (LoopState) and what a drafter hands a round (Draft).

A drafter's own state (`dstate`) and a controller's (`cstate`) travel inside LoopState as pytrees
of their own types; the loop never looks inside them, except to know that each of their arrays
holds the batch's rows along its first axis (a 0-d array is shared by every row): a row refilled
with a new prompt (jspec.engine.slots) takes its rows of a fresh prefill's state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.model import decoder


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
    cache: decoder.KVCache
    seq: jax.Array  # [B, S] int32, every committed token by position
    last: jax.Array  # [B] newest committed token (at position `length`, not yet in the cache)
    length: jax.Array  # [B]
    n: jax.Array  # [B] tokens generated so far
    done: jax.Array  # [B]
    key: jax.Array
    rounds: jax.Array  # [B] target forwards that produced tokens (prefill counts as one)
    drafted: jax.Array  # [B]
    accepted: jax.Array  # [B]
    dstate: object  # the drafter's own state
    cstate: object  # the controller's state
    prompt: jax.Array  # [B] prompt lengths: where each row's output starts in seq
    finite: jax.Array  # [B] whether the row's first logits were all finite numbers
    steps: jax.Array  # 0-d: rounds the batch has run, in every row at once (done rows too)
    # 0-d: the most tokens a row may draft this round (max_draft, unless rounds are priced:
    # jspec.engine.pricing); draft_loop stops there, and the round drops drafts past it.
    budget: jax.Array
    top: tuple | None = None  # (ids, log-probs) [B, max_new, k] of the target at each emitted token, if asked


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    tokens: jax.Array  # [B, K]
    probs: jax.Array | None  # [B, K, V] draft distributions (sampling), None if deterministic
    n: jax.Array  # [B] how many of tokens are proposed
    cache: decoder.KVCache
    dstate: object
    cstate: object
    logq: jax.Array | None = None  # [B, K] log q of each drafted token, for a rule that needs it (MJSD)
    # [B] bool, where a drafter with candidates may also feed a chain (prompt lookup in front): the rows
    # whose tokens are alternatives. None: all of them (with Drafter.candidates), or none.
    alternatives: jax.Array | None = None
    # (target's states [B, K+1, D], its logits [B, K+1, V]) of a drafter that verified its own draft
    # (MJSD's tree, jspec/drafters/beam.py), whose `cache` then holds the target's entries: the loop
    # runs no verification of its own.
    verified: tuple | None = None
    # [B] how many of tokens such a drafter keeps, when its rule needed more than the one chain it
    # hands the round (MJSD's tree judges every beam); None: the drafter's `accept` decides.
    kept: jax.Array | None = None

    def first(self, j: int) -> "Draft":
        """The draft cut to its first j slots (a verification of j + 1 positions), its rows'
        counts with it."""
        cut = lambda x: None if x is None else x[:, :j]  # noqa: E731
        return dataclasses.replace(self, tokens=self.tokens[:, :j], probs=cut(self.probs), n=jnp.minimum(self.n, j),
                                   logq=cut(self.logq))
