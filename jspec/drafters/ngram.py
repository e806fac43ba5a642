"""Prompt lookup (n-gram) drafting: no model. Find the most recent earlier occurrence of the
last n tokens (n = max_ngram down to min_ngram, 2 by default: a single recurring token was copied
more often wrongly than rightly) in the prompt and the text so far, and propose the tokens that
followed it; a round without such a repeat asks the model's datastore, if it has one
(jspec.parts.datastore: what the model itself wrote after the last two or three tokens). A round that
finds neither guesses one token: what followed the newest token's most recent earlier occurrence,
else the datastore's most frequent continuation of it. The guess is right about a fifth of the
time, and free: one drafted token is verified at two positions, which cost about what a round
without drafts costs at one (docs/journal/2026-11-26_free-guess.md). The proposal
is deterministic, so sampled acceptance treats q as one-hot on the proposed token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter
from jspec.engine.state import Draft
from jspec.parts import datastore

MAX_NGRAM = 3  # the longest repeat looked up, by n-gram drafting and by lookup in front of a drafter


def lookup(seq: jax.Array, end: jax.Array, max_draft: int, min_ngram: int, max_ngram: int):
    """seq [B, S] (the newest token of row b at end[b]) -> (tokens [B, max_draft], found [B]): what
    followed the most recent earlier occurrence of the row's last n tokens, for the longest n in
    min_ngram..max_ngram that occurs, and how many of those tokens exist (0: no match)."""
    b, length = seq.shape
    pos = jnp.arange(length)[None, :]
    best = jnp.full((b,), -1, jnp.int32)
    for n in range(min_ngram, max_ngram + 1):  # longer n-grams override shorter ones
        match = (pos >= n - 1) & (pos < end[:, None])
        for t in range(n):
            earlier = jnp.take_along_axis(seq, jnp.maximum(pos - t, 0), axis=1)
            match &= earlier == jnp.take_along_axis(seq, (end - t)[:, None], axis=1)
        found = jnp.max(jnp.where(match, pos, -1), axis=1)
        best = jnp.where(found >= 0, found, best)
    slots = jnp.arange(max_draft)[None, :]
    tokens = jnp.take_along_axis(seq, jnp.minimum(best[:, None] + 1 + slots, length - 1), axis=1)
    return tokens, jnp.where(best >= 0, jnp.minimum(end - best, max_draft), 0)


def propose(seq, end, max_draft: int, min_ngram: int, max_ngram: int, table, guess: bool = False):
    """lookup's (tokens, found); where a row has no repeat, the datastore `table`'s (or None); and
    with `guess`, where neither has a draft, one token: the one that followed the newest token's
    most recent earlier occurrence, else the table's most frequent continuation of it."""
    tokens, found = lookup(seq, end, max_draft, min_ngram, max_ngram)
    if table is not None:
        stored, known = datastore.lookup(table, seq, end, max_draft)
        repeat = found > 0
        tokens, found = jnp.where(repeat[:, None], tokens, stored), jnp.where(repeat, found, known)
    if guess:
        guessed, seen = lookup(seq, end, 1, 1, 1)
        guessed, seen = guessed[:, 0], seen > 0
        if table is not None:
            stored, known = datastore.guess(table, seq, end)
            guessed, seen = jnp.where(seen, guessed, stored), seen | known
        none = found == 0
        tokens = tokens.at[:, 0].set(jnp.where(none, guessed, tokens[:, 0]))
        found = jnp.where(none, seen.astype(found.dtype), found)
    return tokens, found


@dataclasses.dataclass(frozen=True)
class NGram(Drafter):
    """dparams: the datastore's table, or () without one."""
    max_draft: int = 8
    min_ngram: int = 2
    max_ngram: int = MAX_NGRAM

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        b = s.seq.shape[0]
        tokens, n_found = propose(s.seq, s.length, self.max_draft, self.min_ngram, self.max_ngram, dparams or None,
                                  guess=True)
        cap = jnp.full((b,), self.max_draft, jnp.int32)
        cstate = s.cstate
        ones = jnp.ones((b,), jnp.float32)
        for j in range(self.max_draft - 1):
            keep, cstate = controller.keep(cstate, j, ones, jax.random.fold_in(key, j))
            cap = jnp.where(~keep & (cap > j + 1), j + 1, cap)
        n = jnp.where(s.done, 0, jnp.minimum(n_found, cap))
        return Draft(tokens, None, n, s.cache, s.dstate, cstate)
