"""Prompt lookup first: a round whose text so far already holds its last n tokens (n >=
min_ngram) proposes what followed them, as n-gram drafting does, and only the other rounds run
the wrapped drafter (a head, layer skipping, a draft model).

A round without a repeat of its own asks the model's datastore, if given (jspec.parts.datastore: what
the model itself wrote after the same two or three tokens), before the wrapped drafter.

Copying is free and, where the text repeats itself (extraction, summaries, code, lists), right
for several tokens at once, while a model drafter pays a draft step per token and is accepted
for about one. Lookup tokens are fed through the wrapped drafter afterwards (`Drafter.feed`:
the shallow layers and the head's cache for an early exit, the draft model's cache), so its
state has no holes and an early exit's verification still reuses the shallow layers' work.
Lossless like both parts: verification and acceptance are the target's. A drafter with
candidates side by side (jspec.drafters.base) keeps them: a round is then either a copied chain
or the drafter's candidates, and its Draft says which.

At batch > 1 a round copies only when every live row found a repeat (a round has one
verification), and otherwise every row runs the drafter. The choice is a one-trip while loop,
not lax.cond, so whichever runs updates the cache in place (docs/design.md, "No cache inside a
conditional"). The controller sees every round's counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter, Wrapped, Wrapper, only_if
from jspec.drafters.ngram import MAX_NGRAM, propose
from jspec.engine.state import Draft


@dataclasses.dataclass(frozen=True)
class Lookup(Wrapper):
    """dparams: Wrapped(the wrapped drafter's, the datastore's table or None); dstate: Wrapped(the
    wrapped drafter's, the rounds that copied [B])."""
    inner: Drafter
    max_draft: int = 4  # tokens a lookup proposes; the wrapped drafter keeps its own K (<= this)
    min_ngram: int = 2
    max_ngram: int = MAX_NGRAM

    def begin(self, params, dparams, cfg, rows, cache):
        inner = self.inner.begin(params, dparams.inner, cfg, rows, cache)
        return Wrapped(self.inner.room(inner, self.max_draft), jnp.zeros((rows,), jnp.int32))

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        k, live = self.max_draft, ~s.done
        copied, found = propose(s.seq, s.length, k, self.min_ngram, self.max_ngram, dparams.own)

        # Each proposer reads the cache and states from the carry it is given, never from s:
        # whichever runs then updates them in place.
        def by_inner(carry):
            *_, cache, dstate, cstate, _ = carry
            inner_s = dataclasses.replace(s, cache=cache, dstate=dstate, cstate=cstate)
            d = self.inner.draft(params, dparams.inner, cfg, inner_s, controller, sampling, key)
            pad = k - d.tokens.shape[1]
            probs = d.probs
            if probs is None and not sampling.greedy:  # a deterministic proposal (SpecEE's: none): q one-hot
                probs = jax.nn.one_hot(d.tokens, cfg.vocab_size, dtype=jnp.float32)
            probs = None if probs is None else jnp.pad(probs, ((0, 0), (0, pad), (0, 0)))
            alternatives = jnp.ones(d.n.shape, jnp.bool_) if self.candidates else ()
            return jnp.pad(d.tokens, ((0, 0), (0, pad))), probs, d.n, d.cache, d.dstate, d.cstate, alternatives

        def by_lookup(carry):
            *_, cache, dstate, cstate, alternatives = carry
            fed = jnp.concatenate([s.last[:, None], copied], axis=1)
            positions = s.length[:, None] + jnp.arange(k + 1)[None, :]
            cache, dstate = self.inner.feed(params, dparams.inner, cfg, cache, dstate, fed, positions)
            probs = None if sampling.greedy else jax.nn.one_hot(copied, cfg.vocab_size, dtype=jnp.float32)
            return copied, probs, jnp.where(live, found, 0), cache, dstate, cstate, alternatives

        use = jnp.all((found > 0) | ~live)
        probs = None if sampling.greedy else jnp.zeros((*copied.shape, cfg.vocab_size), jnp.float32)
        chains = jnp.zeros(found.shape, jnp.bool_) if self.candidates else ()  # a copy is a chain
        carry = (copied, probs, found, s.cache, s.dstate.inner, s.cstate, chains)
        tokens, probs, n, cache, dstate, cstate, alternatives = only_if(~use, by_inner,
                                                                       only_if(use, by_lookup, carry))
        dstate = Wrapped(dstate, s.dstate.own + (use & live))
        return Draft(tokens, probs, n, cache, dstate, cstate, alternatives=alternatives if self.candidates else None)

    def stats(self, dstate):
        return {**self.inner.stats(dstate.inner), "lookup_rounds": dstate.own}

    def record_stats(self, stats):
        return {**self.inner.record_stats(stats), "lookup_rounds": stats["lookup_rounds"]}
