"""Rounds priced by what they cost on the device: each round drafts the number of tokens that
maximises the batch's expected tokens per second, none at all when speculation does not pay.

A round that lets each row draft k tokens costs `costs[k]` seconds (k = 0 .. K: a plain decoding
step at k = 0), measured on the device for the batch's own program (`measure`), so it holds the
draft steps, the verification over B x (k + 1) positions and the loop's overhead as they are at
that batch size. A row whose drafts were accepted at rate a emits E(k) = 1 + a + .. + a^k tokens
in expectation; a is the row's own counts so far with one accepted draft credited before its first,
(accepted + 1) / (drafted + 1), so a prompt starts at a = 1 and drafts wherever a round of k costs
less than k + 1 plain ones, until its own acceptance says otherwise. A neutral prior (a = 0.5) let a
run that measured one draft at more than 1.5 plain rounds never draft at all: no row drafted, so no
row's acceptance was ever seen (480 Spec-Bench questions under continuous batching drafted next to
nothing in one run and 39,079 tokens, 64% kept, in the next). Under continuous batching
every token counts (a row that ends takes the next prompt), so the round takes

    k* = argmax_k  sum over live rows of E(k)  /  costs[k];

under static batching the batch ends with its last row, so a token counts only where it brings
that end nearer: the round takes the k that least prolongs the row furthest from its end,

    k* = argmin_k  max over live rows of (tokens it may still emit / E(k))  x  costs[k],

and every row drafts at most k* (its controller may stop it sooner). A longer draft has to pay
by more than float32's rounding (`TIE`): ties go to the shorter. Priced rounds are lossless as any
round is: they change how much is drafted, never what is accepted. Where verifying k + 1 positions
costs k + 1 plain steps the round is a plain step (a <= 1, so E(k) <= k + 1); where every k costs
the same it drafts K.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError

TIMINGS = 3  # calls timed at each draft length and number of rounds: the fastest counts
SPAN = 3  # the rounds a length's cost is the time of, beyond a call's first
CHOICES = ("auto", "on", "off")
TIE = 1e-5  # a longer draft's tokens per second must beat a shorter one's by this fraction


def resolve(pricing, lossless: bool, max_draft: int, continuous: bool, batch_size: int, chooses: bool):
    """What `pricing` (generate's option) asks of a run: None (rounds unpriced), "measure", or the
    costs [K+1] it gives. "auto" prices a lossless method's rounds under continuous batching
    (above batch size 1), where a verification over B x (K + 1) positions stops being nearly free,
    and a method that `chooses` (`--method auto`, which promises the fastest lossless choice at
    every batch size) above batch size 1 under static batching too: unpriced, its static batches
    of 8 and 32 ran at 0.57-0.58x `ar`. At batch size 1 the methods ship settings measured to pay
    there, and a named method's static batches keep their old behaviour."""
    if isinstance(pricing, str) and pricing not in CHOICES:
        raise JspecError(f"--pricing must be one of {', '.join(CHOICES)} or K + 1 costs, got {pricing!r}")
    if isinstance(pricing, str) and pricing in ("auto", "off") or not max_draft:
        by_default = continuous or chooses and batch_size > 1
        return "measure" if pricing == "auto" and by_default and lossless and max_draft else None
    if not lossless:  # a lossy method's rule may judge drafts the round would cut (MJSD's beams)
        raise JspecError("--pricing prices the rounds of lossless methods; this one is lossy")
    if isinstance(pricing, str):  # "on"
        return "measure"
    costs = np.asarray(pricing, np.float32)
    if costs.shape != (max_draft + 1,) or not np.all(costs > 0):
        raise JspecError(f"pricing costs must be {max_draft + 1} positive seconds (a round at each draft length "
                         f"0..{max_draft}), got {pricing!r}")
    return costs


def draft_length(costs: jax.Array, accepted: jax.Array, drafted: jax.Array, live: jax.Array,
                 remaining: jax.Array | None = None) -> jax.Array:
    """k* (0-d int32) for rows with `accepted` of `drafted` [B] drafts kept so far, over costs [K+1]:
    for the batch's tokens per second, or, given the tokens each row may still emit `remaining` [B]
    (static batching), for the batch's end."""
    rate = (accepted.astype(jnp.float32) + 1) / (drafted.astype(jnp.float32) + 1)  # <= 1: accepted <= drafted
    k = jnp.arange(costs.shape[0], dtype=jnp.float32)
    expected = jnp.cumsum(rate[:, None] ** k, axis=1)  # [B, K+1]; exact k + 1 at rate 1
    if remaining is None:
        tokens = jnp.sum(jnp.where(live[:, None], expected, 0.0), axis=0)
        return _first_best(tokens / costs)
    rounds = jnp.max(jnp.where(live[:, None], remaining[:, None] / expected, 0.0), axis=0)
    return _first_best(1 / (rounds * costs))


def _first_best(value: jax.Array) -> jax.Array:
    """The first index whose value is within `TIE` of the largest (0-d int32)."""
    return jnp.argmax(value >= jnp.max(value) * (1 - TIE)).astype(jnp.int32)


def forcing(k: int, max_draft: int) -> np.ndarray:
    """Costs under which every round drafts k: what `measure` times each length with. Their price
    of zero marks a measured round (`measured`)."""
    return np.where(np.arange(max_draft + 1) == k, 0.0, np.inf).astype(np.float32)


def measured(costs: jax.Array, budget: jax.Array) -> jax.Array:
    """Whether a round of `budget` under `costs` is one of `measure`'s (0-d bool). Such a round drafts
    its budget whatever the rows' controllers say and verifies budget + 1 positions whatever they
    proposed (an n-gram lookup that found no match proposes nothing), so that it costs what a round
    of that length does: timed otherwise, the fastest of its timings was a round that drafted less."""
    return costs[budget] == 0


@dataclasses.dataclass(frozen=True)
class Unstopped:
    """`controller` with its rows kept drafting where `forced` (0-d bool: a measured round), inside
    a round (the loop's start takes the controller's own `init`)."""
    controller: object
    forced: jax.Array

    def keep(self, state, j, confidence, key):
        go, state = self.controller.keep(state, j, confidence, key)
        return go | self.forced, state

    def update(self, state, n_draft, n_accepted, live):
        return self.controller.update(state, n_draft, n_accepted, live)


def timed(fill: Callable, advance: Callable, s, costs, rounds: int) -> tuple[object, float]:
    """(s, seconds): `rounds` rounds under `costs` from s, timed (fill and advance as `measure`
    takes them). A call that ran fewer rounds than asked (every row done) is timed again from a
    new fill."""
    began = time.perf_counter()
    s, ran = advance(s, costs, rounds)
    if ran < rounds:
        s = fill()
        began = time.perf_counter()
        s, _ = advance(s, costs, rounds)
    return s, time.perf_counter() - began


def measure(fill: Callable, advance: Callable, max_draft: int) -> tuple[np.ndarray, object]:
    """costs [K+1]: the seconds of one round at each draft length, timed on the run's own programs.

    fill() -> a LoopState of the batch's prompts; advance(s, costs, rounds) -> (s, rounds run):
    at most `rounds` rounds under `costs`. A length's cost is what SPAN more rounds add to a call:
    the fastest of TIMINGS calls of 1 + SPAN rounds less the fastest of TIMINGS calls of one (the
    least disturbed by whatever else the machine does), each round drafting and verifying its whole
    length (`measured`). The difference leaves out what a call costs whatever its rounds, which a
    run pays once for many rounds: timed inside single rounds it made drafting look cheap (a call
    of the default model's bfloat16 program cost 36 ms more than its rounds until
    `weights.take_rows` stopped widening the whole embedding, against rounds of 22-80 ms), each
    call by `timed`. A round that may draft more costs at least as much as one that may draft less
    (more draft steps, a verification as wide or wider), so the costs are made non-decreasing.
    Returns them and the last state (its cache is the run's)."""
    s = fill()
    s, _ = advance(s, forcing(0, max_draft), 1)  # the first call of a program pays for more than its round
    out = np.zeros(max_draft + 1, np.float32)
    for k in range(max_draft + 1):
        fastest = {}
        for _ in range(TIMINGS):
            for rounds in (1, 1 + SPAN):
                s, seconds = timed(fill, advance, s, forcing(k, max_draft), rounds)
                fastest[rounds] = min(fastest.get(rounds, np.inf), seconds)
        out[k] = max(fastest[1 + SPAN] - fastest[1], fastest[1] / 100) / SPAN
    return np.maximum.accumulate(out), s
