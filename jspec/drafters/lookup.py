"""Prompt lookup first: a round whose text so far already holds its last n tokens (n >=
min_ngram) proposes what followed them, as n-gram drafting does, and only the other rounds run
the wrapped drafter (a head, layer skipping, a draft model).

A round without a repeat of its own asks the model's datastore, if given (jspec.datastore: what
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

from jspec.drafters.base import Draft, Drafter, only_if
from jspec.drafters.ngram import MAX_NGRAM, propose


@dataclasses.dataclass(frozen=True)
class Lookup(Drafter):
    """dparams: {"inner": the wrapped drafter's, "table": the datastore's table or None}."""
    inner: Drafter
    max_draft: int = 4  # tokens a lookup proposes; the wrapped drafter keeps its own K (<= this)
    min_ngram: int = 2
    max_ngram: int = MAX_NGRAM

    def prefill(self, params, dparams, cfg, tokens, packing, cache):
        h, cache, dstate = self.inner.prefill(params, dparams["inner"], cfg, tokens, packing, cache)
        rounds = jnp.zeros(packing.lens.shape, jnp.int32)
        return h, cache, {"inner": self.inner.room(dstate, self.max_draft), "lookup_rounds": rounds}

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        k, live = self.max_draft, ~s.done
        copied, found = propose(s.seq, s.length, k, self.min_ngram, self.max_ngram, dparams["table"])

        # Each proposer reads the cache and states from the carry it is given, never from s:
        # whichever runs then updates them in place.
        def by_inner(carry):
            *_, cache, dstate, cstate, _ = carry
            inner_s = dataclasses.replace(s, cache=cache, dstate=dstate, cstate=cstate)
            d = self.inner.draft(params, dparams["inner"], cfg, inner_s, controller, sampling, key)
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
            cache, dstate = self.inner.feed(params, dparams["inner"], cfg, cache, dstate, fed, positions)
            probs = None if sampling.greedy else jax.nn.one_hot(copied, cfg.vocab_size, dtype=jnp.float32)
            return copied, probs, jnp.where(live, found, 0), cache, dstate, cstate, alternatives

        use = jnp.all((found > 0) | ~live)
        probs = None if sampling.greedy else jnp.zeros((*copied.shape, cfg.vocab_size), jnp.float32)
        chains = jnp.zeros(found.shape, jnp.bool_) if self.candidates else ()  # a copy is a chain
        carry = (copied, probs, found, s.cache, s.dstate["inner"], s.cstate, chains)
        tokens, probs, n, cache, dstate, cstate, alternatives = only_if(~use, by_inner,
                                                                       only_if(use, by_lookup, carry))
        dstate = {"inner": dstate, "lookup_rounds": s.dstate["lookup_rounds"] + (use & live)}
        return Draft(tokens, probs, n, cache, dstate, cstate, alternatives=alternatives if self.candidates else None)

    @property
    def candidates(self) -> int:
        return self.inner.candidates

    def keep_candidate(self, params, dparams, cfg, cache, dstate, src, dst):
        cache, inner = self.inner.keep_candidate(params, dparams["inner"], cfg, cache, dstate["inner"], src, dst)
        return cache, {**dstate, "inner": inner}

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        return self.inner.verify(params, dparams["inner"], cfg, tokens, positions, cache, dstate["inner"], width)

    def accepted(self, params, dparams, cfg, dstate, fed, positions, h, n_acc):
        inner = self.inner.accepted(params, dparams["inner"], cfg, dstate["inner"], fed, positions, h, n_acc)
        return {**dstate, "inner": inner}

    def target_logits(self, params, dparams, cfg, h, dstate, sampling):
        return self.inner.target_logits(params, dparams["inner"], cfg, h, dstate["inner"], sampling)

    def stats(self, dstate):
        return {**self.inner.stats(dstate["inner"]), "lookup_rounds": dstate["lookup_rounds"]}

    def record_stats(self, stats):
        return {**self.inner.record_stats(stats), "lookup_rounds": stats["lookup_rounds"]}
