from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DraftVerify:
    """Draft & Verify's adaptive confidence threshold: m <- 0.5 m + 0.5 (accepted / drafted);
    th' = th + 0.01 if m < 0.9 else th - 0.01 (unchanged when the draft hit its maximum
    length); th <- 0.9 th + 0.1 th'. Stop below th."""

    threshold: float = 0.8

    def init(self, batch, max_draft):
        return {"m": jnp.ones((batch,), jnp.float32), "th": jnp.full((batch,), self.threshold, jnp.float32),
                "max": max_draft}

    def keep(self, state, j, confidence, key):
        return confidence >= state["th"], state

    def update(self, state, n_draft, n_accepted, live):
        m = 0.5 * state["m"] + 0.5 * n_accepted / jnp.maximum(n_draft, 1)
        step = jnp.where(m < 0.9, 0.01, -0.01)
        th_new = jnp.where(n_draft >= state["max"], state["th"], state["th"] + step)
        th = 0.9 * state["th"] + 0.1 * th_new
        return {**state, "m": jnp.where(live, m, state["m"]), "th": jnp.where(live, th, state["th"])}
