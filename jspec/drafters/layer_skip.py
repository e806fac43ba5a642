"""Layer skipping (Draft & Verify, SWIFT): the target itself with some layers left out drafts.

Drafting writes the kept layers' cache entries at the draft positions; verification runs the
whole target over the same positions and overwrites them, so nothing needs undoing.
"""

from __future__ import annotations

import dataclasses

from jspec.drafters.base import Drafter, draft_loop
from jspec.engine.state import Draft
from jspec.model import decoder


@dataclasses.dataclass(frozen=True)
class LayerSkip(Drafter):
    max_draft: int = 8
    skip: tuple[int, ...] = ()

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        kept = [i for i in range(cfg.num_layers) if i not in self.skip]

        def step(cache, j, x, positions):
            h, cache = decoder.run_layers(params, cfg, decoder.embed(params, x[:, None]), positions, cache, kept)
            return decoder.logits(params, cfg, h[:, 0]), cache

        tokens, probs, n, cache, cstate = draft_loop(step, s.cache, s, controller, sampling, key, self.max_draft)
        return Draft(tokens, probs, n, cache, s.dstate, cstate)
