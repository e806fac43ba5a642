"""Random attention inputs, for the tests of every attention path (the CPU kernel's, the GPU's, the
TPU's loop over filled blocks) against the einsums of attention.xla_attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def attention_inputs(b, t, kv, g, h, s, seed):
    """q [B, T, K, G, H], k and v [B, S, K, H], query positions [B, T] and a valid mask [B, S]."""
    rng = np.random.default_rng(seed)
    q, k, v = random((b, t, kv, g, h), seed), random((b, s, kv, h), seed + 1), random((b, s, kv, h), seed + 2)
    q_pos = jnp.asarray(rng.integers(0, s + 2, (b, t)), jnp.int32)  # past the cache's end sees all of it
    valid = jnp.asarray(rng.random((b, s)) > 0.3).at[:, 0].set(True)
    return q, k, v, q_pos, valid
