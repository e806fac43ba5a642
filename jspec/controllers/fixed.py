from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Always draft the maximum."""

    def init(self, batch, max_draft):
        return ()

    def keep(self, state, j, confidence, key):
        return jnp.ones(confidence.shape, bool), state

    def update(self, state, n_draft, n_accepted, live):
        return state
