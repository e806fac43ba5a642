"""Attention's softmax one block of keys at a time (a running softmax), for the loops that read only
the filled part of the KV cache: the TPU's (attention.filled_attention) and the GPU kernel's
(kernels/gpu_attention.py), whose splits of the keys combine the same way.

A query's state is (m, l, acc): the largest score it has seen, its sum of exp(score - m), and its
sum of those weights times the values, all float32 and keys on the last axis of the scores. A
query that has seen no key keeps m = -inf; a block it sees nothing of (scores all -inf) adds
exactly 0 and scales by exactly 1, so its result does not depend on how many such blocks a loop ran.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def empty(shape: tuple[int, ...], h: int):
    """(m, l, acc) of queries of `shape` that have seen no key yet, values of size h."""
    return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, h), jnp.float32)


def _shift(m: jax.Array) -> jax.Array:
    """What scores are taken from: m, or 0 for a query that has seen no key (so no -inf - -inf)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def step(state, scores: jax.Array, weigh_values):
    """state after one block: scores [..., N] (-inf where a query does not see the key), and
    weigh_values(p) -> p's weighted sum of the block's values [..., H] for weights p [..., N]."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    shift = _shift(m_new)
    p = jnp.exp(scores - shift[..., None])
    correction = jnp.exp(m - shift)
    return m_new, l * correction + jnp.sum(p, axis=-1), acc * correction[..., None] + weigh_values(p)


def combine(state, axis: int):
    """The states of one query's parts of the keys, along `axis`, as one."""
    m, l, acc = state
    peak = jnp.max(m, axis=axis, keepdims=True)
    weight = jnp.exp(m - _shift(peak))
    return (jnp.squeeze(peak, axis), jnp.sum(l * weight, axis=axis),
            jnp.sum(acc * jnp.expand_dims(weight, -1), axis=axis))


def result(state):
    """(output [..., H], log of the softmax denominator [...]): 0 and -inf where no key was seen."""
    m, l, acc = state
    return jnp.where(l[..., None] > 0, acc / l[..., None], 0.0), m + jnp.log(l)
