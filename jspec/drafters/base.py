"""What every drafter provides, the wrapper base, and the token-by-token drafting loop most share.

A drafter is a static, hashable config (`max_draft` = K and its own options); its weights, if
any, travel separately as `dparams`, and its state between rounds as `dstate` (a pytree of its own
type). It implements

    begin(params, dparams, cfg, rows, cache) -> dstate before any prompt token
    prefill(params, dparams, cfg, tokens [B, C], positions [B, C], lens [B], cache, dstate)
        -> (h [B, C, D], cache, dstate): one chunk of the prompts (jspec.engine.loop.Run.start)
    draft(params, dparams, cfg, state: LoopState, controller, sampling, key) -> Draft
    verify(params, dparams, cfg, tokens [B, K+1], positions [B, K+1], cache, dstate) -> (h, cache)

and may override the other hooks of `Drafter`: `target_logits` (what the loop accepts against),
`accepted` (what it keeps of a round's verification), `stats` (extra counters), those a wrapper
asks of the drafter it wraps (`room`, `feed`: prompt lookup in front of it) and those MJSD's beams
ask of theirs (`beam_stack`, `beam_drafted`, `tree_verified`).

A drafter with `candidates` = C > 0 proposes C alternatives for the one position after the last
committed token instead of a chain (its top C, `draft_candidates`), in every row, or behind
prompt lookup in the rows its Draft marks as `alternatives` (a round that copied is a chain): such
a row feeds [last, c_1 .. c_C] at positions [p, p+1, .., p+1], every forward over a round's tokens
attends with `siblings` (attention.block_attention, which the positions tell what each token sees),
and after acceptance `keep_candidate` moves the accepted one's cache entries to p + 1.

`verify` returns the target's final hidden states for the fed tokens; the default runs the whole
target, and self-speculative drafters override it to reuse work done while drafting.

A `Wrapper` runs another drafter (`inner`) and adds to it (prompt lookup in front, MJSD's beams):
its params and state are `Wrapped` (the inner drafter's, and its own), and every hook it does not
override forwards to the inner drafter, so a wrapper states only what it changes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jspec.engine.sampling import Sampling, argmax, probabilities, sample
from jspec.model import decoder
from jspec.model.config import ModelConfig


class Drafter:
    """The hooks every drafter has; each subclass is a frozen dataclass (a static jit argument)."""

    max_draft: int = 0
    candidates: int = 0  # > 0: that many alternatives side by side (max_draft = candidates), not a chain
    # The drafter's own acceptance rule, accept(draft, target_logits, sampling, key) -> (n_accepted,
    # next_token); None is the target's lossless rule (greedy match, or rejection sampling).
    accept = None

    def begin(self, params, dparams, cfg, rows: int, cache):
        """The state of `rows` rows before their prompts: the drafter's own caches empty, as long
        as the target's `cache`. None by default."""
        return ()

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        """A chunk of the prompts through the target and into the drafter's state: tokens [B, C] at
        positions [B, C] (consecutive, from a multiple of C), of which those at lens [B] and on are
        padding. Padding writes cache entries at positions a row's decoding writes again before
        anything reads them, and must leave what else the state holds as it was. Returns the
        target's last-layer states [B, C, D] (pre-norm), the cache and the state."""
        h, cache = decoder.forward(params, cfg, tokens, positions, cache)
        return h, cache, dstate

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        """The target's states [B, W, D] for the fed tokens [B, W] (the newest committed token, then
        the drafts) and the cache, computed at `width` (a decoder.Width: its leading positions)."""
        return decoder.forward(params, cfg, tokens, positions, cache, width, siblings=self.candidates > 0)

    def keep_candidate(self, params, dparams, cfg, cache, dstate, src, dst):
        """(cache, dstate) after a candidates round accepted the candidate whose entries sit at
        position src [B]: its entries copied to dst [B], where the accepted path has it. The
        drafter's own caches (an early exit's head) move with the target's."""
        k, v = decoder.move_entry(cache.k, cache.v, src, dst)
        return decoder.KVCache(k, v), dstate

    def room(self, dstate, max_draft: int):
        """dstate with space for max_draft drafts, for a wrapper that may propose more tokens than
        this drafter's own K (jspec.drafters.lookup). Nothing to do by default."""
        return dstate

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        """(cache, dstate) as if this drafter had drafted tokens [B, T] (the newest committed
        token, then another proposer's draft) at positions [B, T], for a wrapper whose other
        proposer drafted them. Nothing to do by default: verification runs the whole target."""
        return cache, dstate

    def accepted(self, params, dparams, cfg, dstate, fed, positions, h, n_acc):
        """dstate after a round that fed tokens [B, W] at positions [B, W] (the newest committed
        token, then the drafts), for which verification computed the target's states h [B, W, D],
        and accepted n_acc [B] drafts. Nothing to do by default."""
        return dstate

    def target_logits(self, params, dparams, cfg, h, dstate, sampling):
        """The target's logits [B, K+1, V] from verify's states: its final norm and LM head, which
        a lossy drafter (SpecEE) may replace."""
        return decoder.logits(params, cfg, h)

    def stats(self, dstate) -> dict:
        """The drafter's own counters for the records, [B, ...] arrays (none by default)."""
        return {}

    def record_stats(self, stats: dict) -> dict:
        """What a record's `stats` adds from one row's counters (as Python values), e.g. a name for
        an index."""
        return {}

    # -- what MJSD's beams (jspec.drafters.beam) ask of the drafter they run -----------------------

    def beam_stack(self, params, dparams, cfg, cache, dstate) -> "Stack":
        """The layers a beam step runs, over this drafter's committed prefix."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft beams")

    def beam_drafted(self, params, dparams, cfg, cache, dstate, written, exits, final, final_pos):
        """(cache, dstate) once beams chose their draft, as drafting it token by token would have
        left the round's `cache` and `dstate`: `written`, per stack layer, its (k, v) with the chosen
        beam's entries written at their positions; exits [B, K, D] the chosen beam's step states of
        slots 0..K-1; final [B] its last token, at final_pos [B, 1], which still needs the pass the
        token-by-token drafter gives it after its loop."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft beams")

    def tree_verified(self, params, dparams, cfg, cache, dstate, fed, positions, layer_input):
        """dstate after the target verified a tree of beams and wrote the chosen beam's entries
        (tokens fed [B, K+1] at positions [B, K+1]) into `cache`; layer_input(i) gives the states
        [B, K+1, D] that entered the target's layer i along that beam. Nothing to do by default."""
        return dstate


@dataclasses.dataclass
class Feedback:
    """An EAGLE head's input in a beam step: each token fused with a state (heads.fuse_input), the
    target's before the first drafted token, then the head's own output for the token before it."""

    fuse: Callable  # (tokens [B, W], states [B, W, D]) -> inputs [B, W, D]
    state: Callable  # the head's output h [B, W, D] -> the state the next token is fused with
    first: jax.Array  # [B, D] the state before the first drafted token


@dataclasses.dataclass
class Stack:
    """What one beam step runs: embedding, the trunk (whose output is the exit state an early-exit
    verifier continues from), the head layers, and the readout to draft logits. With `feedback` (an
    EAGLE head) the input is the token fused with its parent beam's state, and the step's state is
    the one the next token is fused with."""

    cfg: ModelConfig
    embed: dict  # params holding "embed"
    trunk: list  # [(layer params, prefix k [B, S, KV, H], prefix v)]
    head: list  # the same, for layers after the exit state
    readout: Callable  # h [B, W, D] -> logits [B, W, V]
    feedback: Feedback | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Wrapped:
    """A wrapper's params or state: the inner drafter's, and the wrapper's own (() if none)."""

    inner: object
    own: object = ()


class Wrapper(Drafter):
    """A drafter around `inner` (a dataclass field of each subclass). Every hook forwards to the
    inner drafter with its part of the params and state; a subclass overrides what it changes."""

    inner: Drafter

    @property
    def max_draft(self) -> int:
        return self.inner.max_draft

    @property
    def candidates(self) -> int:
        return self.inner.candidates

    def params(self, inner_params, own=()) -> Wrapped:
        """This wrapper's params around the inner drafter's."""
        return Wrapped(inner_params, own)

    def begin(self, params, dparams, cfg, rows, cache):
        return Wrapped(self.inner.begin(params, dparams.inner, cfg, rows, cache))

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        h, cache, inner = self.inner.prefill(params, dparams.inner, cfg, tokens, positions, lens, cache, dstate.inner)
        return h, cache, dataclasses.replace(dstate, inner=inner)

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        return self.inner.verify(params, dparams.inner, cfg, tokens, positions, cache, dstate.inner, width)

    def keep_candidate(self, params, dparams, cfg, cache, dstate, src, dst):
        cache, inner = self.inner.keep_candidate(params, dparams.inner, cfg, cache, dstate.inner, src, dst)
        return cache, dataclasses.replace(dstate, inner=inner)

    def room(self, dstate, max_draft: int):
        return dataclasses.replace(dstate, inner=self.inner.room(dstate.inner, max_draft))

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        cache, inner = self.inner.feed(params, dparams.inner, cfg, cache, dstate.inner, tokens, positions)
        return cache, dataclasses.replace(dstate, inner=inner)

    def accepted(self, params, dparams, cfg, dstate, fed, positions, h, n_acc):
        inner = self.inner.accepted(params, dparams.inner, cfg, dstate.inner, fed, positions, h, n_acc)
        return dataclasses.replace(dstate, inner=inner)

    def target_logits(self, params, dparams, cfg, h, dstate, sampling):
        return self.inner.target_logits(params, dparams.inner, cfg, h, dstate.inner, sampling)

    def stats(self, dstate) -> dict:
        return self.inner.stats(dstate.inner)

    def record_stats(self, stats: dict) -> dict:
        return self.inner.record_stats(stats)


def only_if(pred, fn, carry):
    """fn(carry) if pred else carry, as a while loop of at most one trip rather than lax.cond:
    XLA copies every buffer a conditional's branch updates (the KV cache here), while a loop
    updates its carry in place (docs/design.md, "No cache inside a conditional")."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), fn(c[1])), (pred, carry))[1]


def draft_loop(step, carry, s, controller, sampling: Sampling, key, max_draft: int):
    """Draft up to max_draft tokens one at a time (the round's s.budget at most, which may be
    none), while any live row's controller says go on.

    step(carry, j, x [B], positions [B, 1]) -> (logits [B, V], carry) runs the drafter on token
    x at draft slot j. Rows whose controller stopped keep computing (their extra tokens are
    ignored), so the loop ends when every row has stopped or the budget's tokens exist.
    Returns (tokens [B, K], probs [B, K, V] or None, n [B], carry, controller state).
    """
    b = s.last.shape[0]
    tokens = jnp.zeros((b, max_draft), jnp.int32)
    probs = None

    def body(st):
        j, x, active, n, tokens, probs, carry, cstate, key = st
        logits, carry = step(carry, j, x, (s.length + j)[:, None])
        key, k_pick, k_keep = jax.random.split(key, 3)
        if sampling.greedy:
            tok = argmax(logits)
            confidence = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
        else:
            q = probabilities(logits, sampling)
            tok = sample(q, k_pick)
            confidence = jnp.max(q, axis=-1)
            probs = probs.at[:, j].set(q)
        keep, cstate = controller.keep(cstate, j, confidence, k_keep)
        return j + 1, tok, active & keep & (j + 1 < s.budget), n + active, tokens.at[:, j].set(tok), probs, carry, \
            cstate, key

    if not sampling.greedy:
        probs = jnp.zeros((b, max_draft, _vocab(step, carry, s)), jnp.float32)
    start = (0, s.last, ~s.done & (s.budget > 0), jnp.zeros((b,), jnp.int32), tokens, probs, carry, s.cstate, key)
    _, _, _, n, tokens, probs, carry, cstate, _ = jax.lax.while_loop(
        lambda st: (st[0] < max_draft) & jnp.any(st[2]), body, start)
    return tokens, probs, n, carry, cstate


def newest(tokens: jax.Array, n: jax.Array, last: jax.Array) -> jax.Array:
    """Each row's last drafted token of tokens [B, K] (n [B] of them), or its newest committed
    one, `last` [B], where it drafted none: the token a drafter's own cache still needs fed."""
    return jnp.where(n > 0, tokens[jnp.arange(tokens.shape[0]), jnp.maximum(n - 1, 0)], last)


def draft_candidates(step, carry, s, count: int):
    """The drafter's `count` most likely tokens for the position after the last committed one, side
    by side (Drafter.candidates), from one step (as in draft_loop) on the last token. Deterministic
    given the text, in greedy and sampling mode alike (jspec.engine.acceptance.candidates).
    Returns (tokens [B, count], n [B]: count, 0 in rows that are done, carry)."""
    logits, carry = step(carry, 0, s.last, s.length[:, None])
    tokens = jax.lax.top_k(logits, count)[1].astype(jnp.int32)
    return tokens, jnp.where(s.done, 0, count).astype(jnp.int32), carry


def _vocab(step, carry, s):
    shape = jax.eval_shape(lambda: step(carry, 0, s.last, s.length[:, None])[0])
    return shape.shape[-1]
