"""EAGLE: a one-layer head over the target's own last states drafts, with none of the target's
layers run while drafting.

The head's input at position t is the embedding of token t fused with the target's final-normed
state at t - 1 (jspec.parts.heads.fuse_input); from it the head predicts token t + 1. The newest
committed token's previous state is what verification computed last round, so the first draft
of a round costs one head layer and the draft vocabulary's LM-head rows (about 0.04 of a decode
step here, against 0.16 for a Kangaroo adapter at N = 4, which runs four of the target's layers).
Later drafts of the round read the head's own output for the previous draft in place of the
state verification has not computed yet (EAGLE's feature-level drafting).

The head keeps a cache of its own (one entry per position, like the target's). After each round
`accepted` writes the entries of the round's fed tokens again with the states verification
computed, so every committed position's entry is the one training saw, whichever proposer (the
head, or prompt lookup in front of it) drafted the round. Lossless: verification is the target's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter, Feedback, Stack, draft_candidates, draft_loop
from jspec.engine.state import Draft
from jspec.model import decoder, numerics
from jspec.parts import heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleState:
    head: decoder.KVCache  # the head's own cache
    prev: jax.Array  # [B, D] the target's final-normed state before the newest committed token


@dataclasses.dataclass(frozen=True)
class Eagle(Drafter):
    """dparams: heads.draft_params of an eagle head."""
    max_draft: int = 1
    candidates: int = 0

    def begin(self, params, dparams, cfg, rows, cache):
        prev = jnp.zeros((rows, cfg.hidden_size), numerics.activation_dtype())
        return EagleState(heads.empty_kv(cfg, dparams, rows, cache.length), prev)

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        h, cache = decoder.forward(params, cfg, tokens, positions, cache)
        f = heads.final_state(params, cfg, h)
        kv = self._head_entries(params, dparams, cfg, dstate, tokens, positions, f)
        return h, cache, EagleState(kv, decoder.prompt_last(f, positions, lens, dstate.prev))

    def _head_entries(self, params, dparams, cfg, dstate, tokens, positions, f):
        """The head's cache with the entries of tokens [B, T] at positions [B, T] written, from the
        target's final-normed states f [B, T, D] there. Each token's previous state is the one
        before it, dstate.prev for the first, and none at a prompt's first token (zeros, as in
        training)."""
        prev = jnp.concatenate([dstate.prev[:, None].astype(f.dtype), f[:, :-1]], axis=1)
        prev = jnp.where((positions > 0)[..., None], prev, 0.0)
        return heads.block(cfg, dparams, heads.fuse_input(params, dparams, tokens, prev), positions, dstate.head)[1]

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        def step(carry, j, x, positions):
            kv, prev = carry
            out, kv = heads.block(cfg, dparams, heads.fuse_input(params, dparams, x[:, None], prev[:, None]),
                                  positions, kv)
            return heads.vocab_logits(cfg, dparams, out[:, 0]), (kv, out[:, 0])

        carry = (s.dstate.head, s.dstate.prev)
        if self.candidates:  # the top C of one step; `accepted` writes the head's entries for the accepted one
            tokens, n, (kv, _) = draft_candidates(step, carry, s, self.candidates)
            return Draft(tokens, None, n, s.cache, dataclasses.replace(s.dstate, head=kv), s.cstate)
        tokens, probs, n, (kv, _), cstate = draft_loop(step, carry, s, controller, sampling, key, self.max_draft)
        return Draft(tokens, probs, n, s.cache, dataclasses.replace(s.dstate, head=kv), cstate)

    def accepted(self, params, dparams, cfg, dstate, fed, positions, h, n_acc):
        f = heads.final_state(params, cfg, h)  # [B, W, D]; zeros past the verified width
        kv = self._head_entries(params, dparams, cfg, dstate, fed, positions, f)
        rows = jnp.arange(fed.shape[0])
        return EagleState(kv, f[rows, n_acc])

    def beam_stack(self, params, dparams, cfg, cache, dstate) -> Stack:
        """No target layer: the head's layers over its own cache, each beam's token fused with the
        state its parent beam's step left (as `draft` fuses a draft with the head's previous output)."""
        norm = lambda h: decoder.rms_norm(h, dparams["norm"], cfg.rms_norm_eps)  # noqa: E731
        feedback = Feedback(lambda x, prev: heads.fuse_input(params, dparams, x, prev), norm, dstate.prev)
        return Stack(cfg, params, [], list(zip(dparams["layers"], dstate.head.k, dstate.head.v)),
                     lambda h: heads.readout(cfg, dparams, h), feedback)

    def beam_drafted(self, params, dparams, cfg, cache, dstate, written, exits, final, final_pos):
        # Verification runs the whole target: no exit state to leave; `accepted` rewrites the
        # head's entries from the target's states.
        hk, hv = zip(*written)
        return cache, dataclasses.replace(dstate, head=decoder.KVCache(list(hk), list(hv)))
