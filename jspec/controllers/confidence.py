from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Confidence:
    """Stop after a token whose top-1 probability is below `threshold` (Kangaroo: 0.6)."""

    threshold: float = 0.6

    def init(self, batch, max_draft):
        return ()

    def keep(self, state, j, confidence, key):
        return confidence >= self.threshold, state

    def update(self, state, n_draft, n_accepted, live):
        return state
