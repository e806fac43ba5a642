from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.errors import JspecError


@dataclasses.dataclass(frozen=True)
class Thompson:
    """EESD's Thompson-sampling controller (see docs/methods.md).

    beta: acceptance of a draft token ~ Bernoulli(theta), theta ~ Beta(a, b) from prior (1, 1);
    before drafting token k+1, sample theta and continue iff theta^(k+1) > cost, where cost is
    one draft step's time over one verification's. After verification a += accepted and
    b += 1 if a token was rejected.
    calibration: one Beta posterior per bin of the draft's top-1 confidence; theta is sampled
    from the bin of the token just drafted and the round continues while the product of the
    sampled thetas (the chance the whole draft so far is accepted) exceeds cost. Each verified
    token updates its own bin. `decay` < 1 shrinks posteriors toward the prior every round.
    """

    variant: str = "beta"
    cost: float = 0.25
    bins: int = 10
    decay: float = 1.0

    def __post_init__(self):
        if self.variant not in ("beta", "calibration"):
            raise JspecError(f"unknown Thompson variant {self.variant!r}; choose beta or calibration")

    def init(self, batch, max_draft):
        shape = (batch,) if self.variant == "beta" else (batch, self.bins)
        state = {"a": jnp.ones(shape, jnp.float32), "b": jnp.ones(shape, jnp.float32)}
        if self.variant == "calibration":
            state["drafted_bins"] = jnp.zeros((batch, max(max_draft, 1)), jnp.int32)
            state["chance"] = jnp.ones((batch,), jnp.float32)
        return state

    def keep(self, state, j, confidence, key):
        if self.variant == "beta":
            theta = jax.random.beta(key, state["a"], state["b"])
            return theta ** (j + 2) > self.cost, state
        bin_ = jnp.clip((confidence * self.bins).astype(jnp.int32), 0, self.bins - 1)
        a = jnp.take_along_axis(state["a"], bin_[:, None], axis=1)[:, 0]
        b = jnp.take_along_axis(state["b"], bin_[:, None], axis=1)[:, 0]
        chance = jnp.where(j == 0, 1.0, state["chance"]) * jax.random.beta(key, a, b)
        drafted_bins = state["drafted_bins"].at[:, j].set(bin_)
        return chance > self.cost, {**state, "chance": chance, "drafted_bins": drafted_bins}

    def update(self, state, n_draft, n_accepted, live):
        a = 1 + self.decay * (state["a"] - 1)
        b = 1 + self.decay * (state["b"] - 1)
        if self.variant == "beta":
            a = a + n_accepted
            b = b + (n_accepted < n_draft)
        else:
            k = state["drafted_bins"].shape[1]
            slot = jnp.arange(k)[None, :]
            one_hot = jax.nn.one_hot(state["drafted_bins"], self.bins)  # [B, K, bins]
            accepted = (slot < n_accepted[:, None])[..., None] * one_hot
            rejected = ((slot == n_accepted[:, None]) & (slot < n_draft[:, None]))[..., None] * one_hot
            a = a + accepted.sum(1)
            b = b + rejected.sum(1)
        keep = live[:, None] if a.ndim == 2 else live
        return {**state, "a": jnp.where(keep, a, state["a"]), "b": jnp.where(keep, b, state["b"])}
