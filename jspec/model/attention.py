"""Attention over the KV cache: decode steps, verifications, blocks of alternatives, prefills.

A query at position p sees cache entries 0..p of its row (entries past a row's position are stale
and never seen). On a CPU the few-position cases go through jspec's native kernel
(jspec/model/kernels), which reads the cache in place where XLA transposes all of it first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.model import kernels

PREFILL_BLOCK = 64  # queries per block of prefill attention
PREFILL_SPANS = 8  # attentions a layer of a prefill holds at most (prefill_attention)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array | None = None,
              prefix: jax.Array | None = None) -> jax.Array:
    """q [B, T, K, G, H] over cache k, v [B, S, K, H]; query at position p sees keys 0..p, and of
    those only the `valid` [B, S] ones when given (SpecEE leaves skipped layers' entries out).
    With `prefix` [B, T] a query sees keys j < prefix and its own key q_pos only (block_attention).

    On a CPU this is jspec's native kernel, which reads the cache in place where XLA transposes
    all of it first, and gives a query the same bits whatever else the call holds (jspec/model/kernels)."""
    if kernels.takes_attention(q, k, v):
        valid = jnp.ones(k.shape[:2], jnp.bool_) if valid is None else valid
        return _native_attention(q, k, v, q_pos, valid, q_pos + 1 if prefix is None else prefix)
    return xla_attention(q, k, v, q_pos, valid, prefix)[0]


def attention_and_lse(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array | None = None):
    """attention() and the log of each query's softmax denominator [B, T, K, G], which merging it
    with attention over keys kept elsewhere needs (MJSD's beams: jspec/drafters/beam.py). Not
    differentiable on the kernel's path."""
    if kernels.takes_attention(q, k, v):
        valid = jnp.ones(k.shape[:2], jnp.bool_) if valid is None else valid
        return kernels.attention(q, k, v, q_pos, valid, q_pos + 1)
    return xla_attention(q, k, v, q_pos, valid)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _native_attention(q, k, v, q_pos, valid, prefix):
    return kernels.attention(q, k, v, q_pos, valid, prefix)[0]


@_native_attention.defjvp
def _native_attention_jvp(q_pos, valid, prefix, primals, tangents):
    # XLA cannot differentiate a foreign call: training a draft head differentiates the JAX path.
    return jax.jvp(lambda q, k, v: xla_attention(q, k, v, q_pos, valid, prefix)[0], primals, tangents)


def block_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                    valid: jax.Array | None = None) -> jax.Array:
    """Attention for a block of T tokens that may hold alternatives rather than one sequence: q
    [B, T, K, G, H] at positions [B, T], written to the cache side by side from the block's first
    position on. Each token sees the cache before the block, the block's tokens at earlier
    positions, and itself: causal attention for a chain (positions p, p+1, ..); for a round's
    last token at p and candidates all at p + 1, each candidate sees the last token and not the
    others (jspec.engine.loop). A block's tokens at earlier positions come first in it, so each
    token sees a prefix of the cache and its own entry."""
    t = positions.shape[1]
    start = positions[:, :1]
    earlier = jnp.sum(positions[:, None, :] < positions[:, :, None], axis=-1)  # [B, T]
    return attention(q, k_cache, v_cache, start + jnp.arange(t), valid, start + earlier)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array | None,
               prefix: jax.Array | None = None):
    """attention_and_lse() in XLA (a caller that drops the lse leaves XLA nothing of it to compute),
    with attention()'s `prefix`."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    key = jnp.arange(k.shape[1])[None, None, :]
    if prefix is None:
        visible = key <= q_pos[:, :, None]  # [B, T, S]
    else:
        visible = (key < prefix[:, :, None]) | (key == q_pos[:, :, None])
    if valid is not None:
        visible = visible & valid[:, None, :]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    # The weights in the wider of the activations' and the cache's dtype: bfloat16 with both so,
    # where a float32 cache or float32 activations keep float32 products.
    probs = jax.nn.softmax(scores, axis=-1).astype(jnp.promote_types(q.dtype, v.dtype))
    # Heads-major output, transposed after: XLA's CPU dot writing [B, T, K, G, H] directly
    # took a quarter longer on a long prompt.
    out = jnp.einsum("bkgts,bskh->bkgth", probs, v.astype(probs.dtype),
                     preferred_element_type=jnp.float32).transpose(0, 3, 1, 2, 4)
    return out.astype(q.dtype), jax.nn.logsumexp(scores, axis=-1).transpose(0, 3, 1, 2)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """attention() for queries at positions 0..P-1 of every row, over k, v [B, P, K, H].

    The queries go in blocks of PREFILL_BLOCK, gathered into at most PREFILL_SPANS spans of
    consecutive blocks. A span's blocks read the keys up to the span's end, a static bound, so a
    long prompt does little more than half the work of the full causal square (at most
    1 / PREFILL_SPANS more than block by block), and a span of several blocks runs them as a loop:
    the program holds PREFILL_SPANS attentions a layer whatever the prompt's length, where one per
    block made an 8k prompt 128 a layer (a compile of minutes; 512 aborted XLA's compiler)."""
    b, p = q.shape[:2]
    blocks = -(-p // PREFILL_BLOCK)
    per_span = -(-blocks // PREFILL_SPANS)
    out = []
    for first in range(0, blocks, per_span):
        start, end = first * PREFILL_BLOCK, min((first + per_span) * PREFILL_BLOCK, p)
        ks, vs = k[:, :end], v[:, :end]
        if end - start <= PREFILL_BLOCK:  # one block: read only its own prefix
            q_pos = jnp.broadcast_to(jnp.arange(start, end), (b, end - start))
            out.append(attention(q[:, start:end], ks, vs, q_pos))
            continue
        n = (end - start) // PREFILL_BLOCK  # whole blocks; a prompt's last, partial one is its own span
        span = q[:, start:start + n * PREFILL_BLOCK].reshape(b, n, PREFILL_BLOCK, *q.shape[2:]).swapaxes(0, 1)
        offsets = start + PREFILL_BLOCK * jnp.arange(n)

        def block(args, ks=ks, vs=vs):
            qb, offset = args
            return attention(qb, ks, vs, jnp.broadcast_to(offset + jnp.arange(PREFILL_BLOCK), (b, PREFILL_BLOCK)))

        out.append(jax.lax.map(block, (span, offsets)).swapaxes(0, 1).reshape(b, n * PREFILL_BLOCK, *q.shape[2:]))
        if start + n * PREFILL_BLOCK < end:
            rest = start + n * PREFILL_BLOCK
            q_pos = jnp.broadcast_to(jnp.arange(rest, end), (b, end - rest))
            out.append(attention(q[:, rest:end], ks, vs, q_pos))
    return jnp.concatenate(out, axis=1)
