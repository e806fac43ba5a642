"""No drafter: plain autoregressive decoding is the loop with K = 0."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec.drafters.base import Drafter
from jspec.engine.state import Draft


@dataclasses.dataclass(frozen=True)
class NoDraft(Drafter):
    max_draft: int = 0

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        b = s.last.shape[0]
        return Draft(jnp.zeros((b, 0), jnp.int32), None, jnp.zeros((b,), jnp.int32), s.cache, s.dstate, s.cstate)
