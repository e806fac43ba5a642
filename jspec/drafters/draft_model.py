"""A separate, smaller draft model that shares the target's tokenizer (classic speculative decoding).

It keeps its own cache at the same positions as the target's. After the loop it also reads the
last proposed token, so that when a whole draft is accepted its cache has no hole.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec import model
from jspec.config import ModelConfig
from jspec.drafters.base import Draft, Drafter, draft_loop, target_prefill


@dataclasses.dataclass(frozen=True)
class DraftModel(Drafter):
    draft_cfg: ModelConfig
    max_draft: int = 8

    def prefill(self, params, dparams, cfg, tokens, packing, cache):
        h, cache = target_prefill(params, cfg, tokens, packing, cache)
        dcache = model.KVCache.zeros(self.draft_cfg, packing.lens.shape[0], cache.length)
        _, dcache = target_prefill(dparams, self.draft_cfg, tokens, packing, dcache)
        return h, cache, {"cache": dcache}

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        dcfg = self.draft_cfg

        def step(dcache, j, x, positions):
            h, dcache = model.forward(dparams, dcfg, x[:, None], positions, dcache)
            return model.logits(dparams, dcfg, h[:, 0]), dcache

        tokens, probs, n, dcache, cstate = draft_loop(step, s.dstate["cache"], s, controller, sampling, key,
                                                      self.max_draft)
        final = tokens[jnp.arange(tokens.shape[0]), jnp.maximum(n - 1, 0)]
        _, dcache = model.forward(dparams, dcfg, final[:, None], (s.length + n)[:, None], dcache)
        return Draft(tokens, probs, n, s.cache, {"cache": dcache}, cstate)

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        _, dcache = model.forward(dparams, self.draft_cfg, tokens, positions, dstate["cache"])
        return cache, {"cache": dcache}
