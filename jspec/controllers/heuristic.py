from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Heuristic:
    """Hugging Face's schedule: draft length +2 after a fully accepted round, -1 otherwise."""

    def init(self, batch, max_draft):
        return {"length": jnp.full((batch,), max(1, max_draft // 2), jnp.int32), "max": max_draft}

    def keep(self, state, j, confidence, key):
        return j + 1 < state["length"], state

    def update(self, state, n_draft, n_accepted, live):
        grown = jnp.where(n_accepted >= n_draft, state["length"] + 2, state["length"] - 1)
        length = jnp.where(live, jnp.clip(grown, 1, state["max"]), state["length"])
        return {**state, "length": length}
