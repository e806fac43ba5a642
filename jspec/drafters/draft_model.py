"""A separate, smaller draft model that shares the target's tokenizer (classic speculative decoding).

It keeps its own cache at the same positions as the target's. After the loop it also reads the
last proposed token, so that when a whole draft is accepted its cache has no hole.
"""

from __future__ import annotations

import dataclasses

import jax

from jspec.drafters.base import Drafter, Stack, draft_loop, newest
from jspec.engine.state import Draft
from jspec.model import decoder
from jspec.model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftModelState:
    cache: decoder.KVCache  # the draft model's own, at the target's positions


@dataclasses.dataclass(frozen=True)
class DraftModel(Drafter):
    draft_cfg: ModelConfig
    max_draft: int = 8

    def begin(self, params, dparams, cfg, rows, cache):
        return DraftModelState(decoder.KVCache.zeros(self.draft_cfg, rows, cache.length, cache.dtype))

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        h, cache = decoder.forward(params, cfg, tokens, positions, cache)
        _, dcache = decoder.forward(dparams, self.draft_cfg, tokens, positions, dstate.cache)
        return h, cache, DraftModelState(dcache)

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        dcfg = self.draft_cfg

        def step(dcache, j, x, positions):
            h, dcache = decoder.forward(dparams, dcfg, x[:, None], positions, dcache)
            return decoder.logits(dparams, dcfg, h[:, 0]), dcache

        tokens, probs, n, dcache, cstate = draft_loop(step, s.dstate.cache, s, controller, sampling, key,
                                                      self.max_draft)
        final = newest(tokens, n, s.last)
        _, dcache = decoder.forward(dparams, dcfg, final[:, None], (s.length + n)[:, None], dcache)
        return Draft(tokens, probs, n, s.cache, DraftModelState(dcache), cstate)

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        _, dcache = decoder.forward(dparams, self.draft_cfg, tokens, positions, dstate.cache)
        return cache, DraftModelState(dcache)

    def beam_stack(self, params, dparams, cfg, cache, dstate) -> Stack:
        dc, dcfg = dstate.cache, self.draft_cfg
        trunk = [(dparams["layers"][i], dc.k[i], dc.v[i]) for i in range(dcfg.num_layers)]
        return Stack(dcfg, dparams, trunk, [], lambda h: decoder.logits(dparams, dcfg, h))

    def beam_drafted(self, params, dparams, cfg, cache, dstate, written, exits, final, final_pos):
        dcache = decoder.KVCache([k for k, _ in written], [v for _, v in written])
        _, dcache = decoder.forward(dparams, self.draft_cfg, final[:, None], final_pos, dcache)
        return cache, DraftModelState(dcache)

    def tree_verified(self, params, dparams, cfg, cache, dstate, fed, positions, layer_input):
        return self.feed(params, dparams, cfg, cache, dstate, fed, positions)[1]
