"""Turning logits into next-token distributions and tokens.

`Sampling` is static (part of the compiled shape): greedy vs sampled, top-k and whether top-p is
on change the program; the values of temperature and top-p do not need to, but keeping them
static costs one compile per setting and keeps the hot loop free of dead sorting work.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError

MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise JspecError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool):
            raise JspecError(f"top_k must be an integer, got {self.top_k!r}")
        # Near 0, logits / temperature overflows float32 (1e-40 gave token 0 at every step); such a
        # temperature is greedy decoding in all but name, which 0 asks for exactly.
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise JspecError(f"--temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE:g}, "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise JspecError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise JspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.greedy and (self.top_k or self.top_p < 1):  # greedy takes the top token: nothing to cut
            raise JspecError("--top-k and --top-p shape sampling: give them with a --temperature above 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: jax.Array, s: Sampling) -> jax.Array:
    """The distribution sampling draws from, after temperature, top-k and top-p. [..., V] -> [..., V].

    Speculative acceptance compares target and draft through this same function, which is what
    keeps sampled speculative output distributed exactly as sampled target output.
    """
    logits = logits.astype(jnp.float32) / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if s.top_p < 1.0:
        sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = jnp.where(before < s.top_p, sorted_probs, jnp.inf)
        cutoff = jnp.min(keep, axis=-1, keepdims=True)
        probs = jnp.where(probs >= cutoff, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def argmax(logits: jax.Array) -> jax.Array:
    """The first index of the largest value over the last axis, int32: jnp.argmax's result for
    logits without NaN.

    XLA's CPU backend lowers jnp.argmax to a reduction over (value, index) pairs that does not
    vectorise: 0.24 ms for one row of SmolLM2's 49,152 logits, 0.7 ms for the five positions a
    round verifies, 4.5 ms for eight rows of five. A max, then the smallest index that holds it,
    are two plain reductions, 2-4.5x faster (benchmarks/probes/argmax_cost.py). Every greedy token
    passes through one."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)
    return jnp.minimum(first, logits.shape[-1] - 1)  # a row holding a NaN matches nowhere: still a valid id


def next_token(logits: jax.Array, s: Sampling, key: jax.Array) -> jax.Array:
    """One token per row from logits [B, V] -> [B] int32."""
    if s.greedy:
        return argmax(logits)
    return sample(probabilities(logits, s), key)


def sample(probs: jax.Array, key: jax.Array) -> jax.Array:
    """Draw from normalised probs [..., V] -> [...] int32."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
