"""What every drafter provides, and the token-by-token drafting loop most of them share.

A drafter is a static, hashable config (`max_draft` = K and its own options); its weights, if
any, travel separately as `dparams`. It implements

    prefill(params, dparams, cfg, tokens, packing, cache) -> (h_last [B, D], cache, dstate)
    draft(params, dparams, cfg, state: LoopState, controller, sampling, key) -> Draft
    verify(params, dparams, cfg, tokens [B, K+1], positions [B, K+1], cache, dstate) -> (h, cache)

and may override `target_logits` (what the loop accepts against), `accepted` (what it keeps of a
round's verification) and `stats` (extra counters).

A drafter with `candidates` = C > 0 proposes C alternatives for the one position after the last
committed token instead of a chain (its top C, `draft_candidates`), in every row, or behind
prompt lookup in the rows its Draft marks as `alternatives` (a round that copied is a chain): such
a row feeds [last, c_1 .. c_C] at positions [p, p+1, .., p+1], every forward over a round's tokens
attends with `siblings` (model.block_attention, which the positions tell what each token sees),
and after acceptance `keep_candidate` moves the accepted one's cache entries to p + 1.

`verify` returns the target's final hidden states for the fed tokens; the default runs the whole
target, and self-speculative drafters override it to reuse work done while drafting.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import model
from jspec.sampling import Sampling, argmax, probabilities, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    tokens: jax.Array  # [B, K]
    probs: jax.Array | None  # [B, K, V] draft distributions (sampling), None if deterministic
    n: jax.Array  # [B] how many of tokens are proposed
    cache: model.KVCache
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


def target_prefill(params, cfg, tokens, packing: model.Packing, cache):
    """Run the packed prompts tokens [R, T] through the target; the hidden state at each row's
    last prompt token [B, D]."""
    h, cache = model.forward(params, cfg, tokens, packing, cache)
    return packing.last(h), cache


class Drafter:
    max_draft: int = 0
    candidates: int = 0  # > 0: that many alternatives side by side (max_draft = candidates), not a chain
    # The drafter's own acceptance rule, accept(draft, target_logits, sampling, key) -> (n_accepted,
    # next_token); None is the target's lossless rule (greedy match, or rejection sampling).
    accept = None

    def prefill(self, params, dparams, cfg, tokens, packing, cache):
        h, cache = target_prefill(params, cfg, tokens, packing, cache)
        return h, cache, ()

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        """The target's states [B, W, D] for the fed tokens [B, W] (the newest committed token, then
        the drafts) and the cache, computed at `width` (a model.Width: its leading positions)."""
        return model.forward(params, cfg, tokens, positions, cache, width, siblings=self.candidates > 0)

    def keep_candidate(self, params, dparams, cfg, cache, dstate, src, dst):
        """(cache, dstate) after a candidates round accepted the candidate whose entries sit at
        position src [B]: its entries copied to dst [B], where the accepted path has it. The
        drafter's own caches (an early exit's head) move with the target's."""
        k, v = model.move_entry(cache.k, cache.v, src, dst)
        return model.KVCache(k, v), dstate

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
        return model.logits(params, cfg, h)

    def stats(self, dstate) -> dict:
        """The drafter's own counters for the records, [B, ...] arrays (none by default)."""
        return {}

    def record_stats(self, stats: dict) -> dict:
        """What a record's `stats` adds from one row's counters (as Python values), e.g. a name for
        an index."""
        return {}


def only_if(pred, fn, carry):
    """fn(carry) if pred else carry, as a while loop of at most one trip rather than lax.cond:
    XLA copies every buffer a conditional's branch updates (the KV cache here), while a loop
    updates its carry in place (docs/design.md, "No cache inside a conditional")."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), fn(c[1])), (pred, carry))[1]


def draft_loop(step, carry, s, controller, sampling: Sampling, key, max_draft: int):
    """Draft up to max_draft tokens one at a time, while any live row's controller says go on.

    step(carry, j, x [B], positions [B, 1]) -> (logits [B, V], carry) runs the drafter on token
    x at draft slot j. Rows whose controller stopped keep computing (their extra tokens are
    ignored), so the loop ends when every row has stopped or K tokens exist.
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
        return j + 1, tok, active & keep, n + active, tokens.at[:, j].set(tok), probs, carry, cstate, key

    if not sampling.greedy:
        probs = jnp.zeros((b, max_draft, _vocab(step, carry, s)), jnp.float32)
    start = (0, s.last, ~s.done, jnp.zeros((b,), jnp.int32), tokens, probs, carry, s.cstate, key)
    _, _, _, n, tokens, probs, carry, cstate, _ = jax.lax.while_loop(
        lambda st: (st[0] < max_draft) & jnp.any(st[2]), body, start)
    return tokens, probs, n, carry, cstate


def draft_candidates(step, carry, s, count: int):
    """The drafter's `count` most likely tokens for the position after the last committed one, side
    by side (Drafter.candidates), from one step (as in draft_loop) on the last token. Deterministic
    given the text, in greedy and sampling mode alike (jspec.acceptance.candidates).
    Returns (tokens [B, count], n [B]: count, 0 in rows that are done, carry)."""
    logits, carry = step(carry, 0, s.last, s.length[:, None])
    tokens = jax.lax.top_k(logits, count)[1].astype(jnp.int32)
    return tokens, jnp.where(s.done, 0, count).astype(jnp.int32), carry


def _vocab(step, carry, s):
    shape = jax.eval_shape(lambda: step(carry, 0, s.last, s.length[:, None])[0])
    return shape.shape[-1]
