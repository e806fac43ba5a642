"""Attention over the KV cache: decode steps, verifications, blocks of alternatives, prompt
chunks, and whole texts (training, scoring).

A query at position p sees cache entries 0..p of its row (entries past a row's position are stale
and never seen). Each platform gets its own path behind `attention` (docs/design.md, "Attention on
a CPU" and "Attention on a GPU and a TPU"):
- a CPU: jspec's native kernel for the few-position cases (jspec/model/kernels), which reads the
  cache in place where XLA transposes all of it first; XLA's einsums otherwise;
- an NVIDIA GPU: a Pallas kernel that reads each row's filled part of the cache only
  (kernels/gpu_attention.py); XLA's einsums over the whole cache where it does not apply (a GPU
  would copy the trip test of an XLA loop to the host every iteration);
- a TPU: `filled_attention`, an XLA loop over the key blocks up to the batch's furthest query,
  with a running softmax (a TPU runs a loop's control on the device).
A whole text's spans (`prefill_attention`) read only their own keys already: on a GPU and a TPU
they keep XLA's einsums.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jspec.model import kernels, numerics, online_softmax
from jspec.model.kernels import gpu_attention

PREFILL_BLOCK = 64  # queries per block of a whole text's attention
PREFILL_SPANS = 8  # attentions a layer of a whole text holds at most (prefill_attention)
KEY_BLOCK = 512  # keys a step of filled_attention's loop reads at most (a divisor of the cache's length)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array | None = None,
              prefix: jax.Array | None = None, filled: bool = False, rows: jax.Array | None = None) -> jax.Array:
    """q [B, T, K, G, H] over cache k, v [B, S, K, H]; query at position p sees keys 0..p, and of
    those only the `valid` [B, S] ones when given (SpecEE leaves skipped layers' entries out).
    With `prefix` [B, T] a query sees keys j < prefix and its own key q_pos only (block_attention).
    With `rows` [B] the cache holds R rows and row b of the queries reads its row rows[b] (an
    admit's prompts prefilled in place: decoder.KVCache.rows).

    The path is the platform's (this module's docstring); each gives a query the same result
    whatever else the call holds, up to float rounding. `filled` says every key given is filled
    (a whole text's span): a GPU or TPU then has no unfilled part to leave out, and takes XLA's
    einsums."""
    if rows is not None:
        if kernels.takes_attention(q, k, v):  # reads the rows in place (never differentiated: an admit)
            valid = jnp.ones((q.shape[0], k.shape[1]), jnp.bool_) if valid is None else valid
            return kernels.attention(q, k, v, q_pos, valid, q_pos + 1 if prefix is None else prefix, rows)[0]
        k, v = k[rows], v[rows]
    return _on_platform(q, k, v, q_pos, valid, prefix, filled)[0]


def attention_and_lse(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array | None = None):
    """attention() and the log of each query's softmax denominator [B, T, K, G], which merging it
    with attention over keys kept elsewhere needs (MJSD's beams: jspec/drafters/beam.py)."""
    return _on_platform(q, k, v, q_pos, valid, None)


def _on_platform(q, k, v, q_pos, valid, prefix, filled=False):
    """(output, lse) by the path of the platform being traced."""
    if kernels.takes_attention(q, k, v):
        path = kernels.attention
    elif kernels.takes_gpu_attention(q, k) and not filled:
        path = gpu_attention.attention
    elif numerics.platform() == "tpu" and not filled:
        path = filled_attention
    else:
        return xla_attention(q, k, v, q_pos, valid, prefix)
    valid = jnp.ones(k.shape[:2], jnp.bool_) if valid is None else valid
    return _differentiable(path, q, k, v, q_pos, valid, q_pos + 1 if prefix is None else prefix)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 4, 5, 6))
def _differentiable(path, q, k, v, q_pos, valid, prefix):
    """path(q, k, v, q_pos, valid, prefix): the CPU's native kernel, the GPU's Pallas kernel or the
    TPU's filled_attention, with the einsums' derivative."""
    return path(q, k, v, q_pos, valid, prefix)


@_differentiable.defjvp
def _differentiable_jvp(path, q_pos, valid, prefix, primals, tangents):
    # XLA cannot differentiate a foreign call, nor reverse a loop of unknown length: training a
    # draft head differentiates the einsums, which compute the same function.
    return jax.jvp(lambda q, k, v: xla_attention(q, k, v, q_pos, valid, prefix), primals, tangents)


def filled_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, valid: jax.Array,
                     prefix: jax.Array):
    """xla_attention() reading only the key blocks up to the batch's furthest query: a loop over
    blocks of KEY_BLOCK keys (or fewer, dividing the cache's length) with a running softmax
    (jspec.model.online_softmax), so a row's result does not depend on the other rows' lengths."""
    b, t, kv, g, h = q.shape
    size = math.gcd(k.shape[1], KEY_BLOCK)
    probs_dtype = jnp.promote_types(q.dtype, v.dtype)

    def block(i, state):
        start = i * size
        kb, vb, ok = (jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in (k, v, valid))
        key = start + jnp.arange(size)
        seen = ((key < prefix[:, :, None]) | (key == q_pos[:, :, None])) & ok[:, None, :]  # [B, T, size]
        scores = jnp.einsum("btkgh,bskh->bkgts", q, kb, preferred_element_type=jnp.float32) * h ** -0.5
        scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
        return online_softmax.step(state, scores, lambda p: jnp.einsum(
            "bkgts,bskh->bkgth", p.astype(probs_dtype), vb.astype(probs_dtype), preferred_element_type=jnp.float32))

    blocks = jnp.minimum(jnp.max(q_pos) // size + 1, k.shape[1] // size)  # through the furthest query's block
    out, lse = online_softmax.result(jax.lax.fori_loop(0, blocks, block, online_softmax.empty((b, kv, g, t), h)))
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse.transpose(0, 3, 1, 2)


def block_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                    valid: jax.Array | None = None, rows: jax.Array | None = None) -> jax.Array:
    """Attention for a block of T tokens that may hold alternatives rather than one sequence: q
    [B, T, K, G, H] at positions [B, T], written to the cache side by side from the block's first
    position on. Each token sees the cache before the block, the block's tokens at earlier
    positions, and itself: causal attention for a chain (positions p, p+1, ..); for a round's
    last token at p and candidates all at p + 1, each candidate sees the last token and not the
    others (jspec.engine.loop). A block's tokens at earlier positions come first in it, so each
    token sees a prefix of the cache and its own entry. `rows` as in attention()."""
    t = positions.shape[1]
    start = positions[:, :1]
    earlier = jnp.sum(positions[:, None, :] < positions[:, :, None], axis=-1)  # [B, T]
    return attention(q, k_cache, v_cache, start + jnp.arange(t), valid, start + earlier, rows=rows)


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
            out.append(attention(q[:, start:end], ks, vs, q_pos, filled=True))
            continue
        n = (end - start) // PREFILL_BLOCK  # whole blocks; a prompt's last, partial one is its own span
        span = q[:, start:start + n * PREFILL_BLOCK].reshape(b, n, PREFILL_BLOCK, *q.shape[2:]).swapaxes(0, 1)
        offsets = start + PREFILL_BLOCK * jnp.arange(n)

        def block(args, ks=ks, vs=vs):
            qb, offset = args
            return attention(qb, ks, vs, jnp.broadcast_to(offset + jnp.arange(PREFILL_BLOCK), (b, PREFILL_BLOCK)),
                             filled=True)

        out.append(jax.lax.map(block, (span, offsets)).swapaxes(0, 1).reshape(b, n * PREFILL_BLOCK, *q.shape[2:]))
        if start + n * PREFILL_BLOCK < end:
            rest = start + n * PREFILL_BLOCK
            q_pos = jnp.broadcast_to(jnp.arange(rest, end), (b, end - rest))
            out.append(attention(q[:, rest:end], ks, vs, q_pos, filled=True))
    return jnp.concatenate(out, axis=1)
