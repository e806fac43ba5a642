"""Draft-length controllers: after each drafted token, should this row draft another?

A controller is a static, hashable config with three pure functions over a state pytree that
the engine carries through its jitted loop (PRNG keys come from the loop):

    init(batch, max_draft)            -> state
    keep(state, j, confidence, key)   -> (continue [B] bool, state)   after draft token j (0-based)
    update(state, n_draft, n_accepted, live) -> state                 after verification

`confidence` [B] is the top-1 probability of the draft distribution for the token just drafted.
The drafted token itself is always verified; `keep` only decides whether to draft one more.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.errors import JspecError


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Always draft the maximum."""

    def init(self, batch, max_draft):
        return ()

    def keep(self, state, j, confidence, key):
        return jnp.ones(confidence.shape, bool), state

    def update(self, state, n_draft, n_accepted, live):
        return state


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


CONTROLLERS = {"fixed": Fixed, "confidence": Confidence, "heuristic": Heuristic, "dv": DraftVerify,
               "thompson": Thompson}


def make_controller(name: str, **options):
    if name not in CONTROLLERS:
        raise JspecError(f"unknown controller {name!r}; choose one of {', '.join(CONTROLLERS)}")
    fields = {f.name for f in dataclasses.fields(CONTROLLERS[name])}
    return CONTROLLERS[name](**{k: v for k, v in options.items() if k in fields and v is not None})
