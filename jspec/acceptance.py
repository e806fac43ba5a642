"""Deciding how much of a draft the target keeps.

Shapes: B rows, K draft slots, V vocab. Row b drafted tokens draft[b, :n_draft[b]]; slots beyond
are ignored. The target's logits [B, K+1, V] come from one forward over [last, draft...], so
position i predicts the token after draft i (position 0: after the last committed token).
The chain rules (greedy, rejection, MJSD's joint) return (n_accepted [B], next_token [B]): the
row emits draft[:n_accepted] and then next_token, the target's own token at the first rejection
or the bonus after a full accept. `candidates` is the rule for alternatives side by side at one
position, which also says which one it accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling import Sampling, argmax, next_token, probabilities, sample


def _leading_true(ok: jax.Array) -> jax.Array:
    """Length of the run of True at the start of each row: [B, K] -> [B]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for x [B, N, ...]."""
    return jnp.take_along_axis(x, index.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def greedy(draft: jax.Array, n_draft: jax.Array, target_logits: jax.Array):
    """Keep the longest prefix equal to the target's argmax, then the target's token."""
    choice = argmax(target_logits)  # [B, K+1]
    k = draft.shape[1]
    ok = (draft == choice[:, :k]) & (jnp.arange(k) < n_draft[:, None])
    n_acc = _leading_true(ok)
    return n_acc, _at(choice, n_acc)


def rejection(draft: jax.Array, draft_probs: jax.Array | None, n_draft: jax.Array, target_logits: jax.Array,
              sampling: Sampling, key: jax.Array):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft token x with
    probability min(1, p(x)/q(x)); at the first rejection draw from normalize(max(p - q, 0));
    after a full accept draw the bonus from p. The emitted tokens are distributed exactly as
    sampling from the target. `draft_probs` [B, K, V] is q; None means a deterministic drafter
    (q is one-hot on the drafted token, as for n-gram lookup)."""
    p = probabilities(target_logits, sampling)  # [B, K+1, V]
    b, k = draft.shape
    p_x = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(draft, p.shape[-1], dtype=p.dtype)
    q_x = jnp.take_along_axis(draft_probs, draft[..., None], axis=-1)[..., 0]
    key_accept, key_next = jax.random.split(key)
    u = jax.random.uniform(key_accept, (b, k))
    ok = (u * q_x < p_x) & (jnp.arange(k) < n_draft[:, None])
    n_acc = _leading_true(ok)
    p_next = _at(p, n_acc)
    q_next = _at(jnp.concatenate([draft_probs, jnp.zeros_like(p[:, :1])], axis=1), n_acc)
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = residual.sum(-1, keepdims=True)
    rejected = (n_acc < n_draft)[:, None] & (mass > 0)
    dist = jnp.where(rejected, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    return n_acc, sample(dist, key_next)


def joint_logp(target_logits: jax.Array, sampling: Sampling) -> jax.Array:
    """log p [..., V] as MJSD judges a draft by it: the untempered log-softmax when greedy, the log
    of the processed (temperature, top-k, top-p) distribution when sampling."""
    if sampling.greedy:
        return jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    return jnp.log(probabilities(target_logits, sampling))


def joint(draft: jax.Array, draft_logq: jax.Array, n_draft: jax.Array, target_logits: jax.Array,
          sampling: Sampling, log_tau: float, key: jax.Array):
    """MJSD's joint-likelihood rule: with r_d = sum_{t<=d} log p(x_t) - log q(x_t) over the draft,
    keep the largest d <= n_draft with r_d > log_tau (not the first failure: a longer prefix may
    pass after a shorter one fails), then the target's token after it (argmax, or a sample from
    p). `draft_logq` [B, K] is log q of each drafted token. p and q are the untempered softmaxes
    when greedy, the processed (temperature, top-k, top-p) distributions when sampling. Lossy:
    the output is no longer the target's own."""
    k = draft.shape[1]
    logp = joint_logp(target_logits, sampling)  # [B, K+1, V]
    logp_x = jnp.take_along_axis(logp[:, :k], draft[..., None], axis=-1)[..., 0]  # [B, K]
    ratio = jnp.cumsum(logp_x - draft_logq, axis=1)  # r_1 .. r_K
    d = jnp.arange(1, k + 1)[None, :]
    ok = (ratio > log_tau) & (d <= n_draft[:, None])
    n_acc = jnp.max(jnp.where(ok, d, 0), axis=1).astype(jnp.int32)
    if sampling.greedy:
        return n_acc, argmax(_at(target_logits, n_acc))
    return n_acc, jax.random.categorical(key, _at(logp, n_acc), axis=-1).astype(jnp.int32)  # sample(p)


def candidates(cands: jax.Array, n_cands: jax.Array, target_logits: jax.Array, sampling: Sampling,
               key: jax.Array):
    """Candidates side by side: cands [B, C] are alternatives for the one position after the last
    committed token, deterministic given the text (a head's top C), with the target's logits
    [B, 1 + C, V] at the last token, then at each candidate. The target's own next token (argmax,
    or a sample from p) is drawn first; if it is one of the first n_cands candidates, that one is
    accepted and the token after it drawn from that candidate's logits. Every emitted token is
    the target's own draw given the text before it, so greedy output is ar's and sampled output
    has the target's distribution, with no ratio to test.

    Returns (n_accepted [B] (0 or 1), pick [B]: the accepted candidate's index, next_token [B])."""
    first_key, next_key = jax.random.split(key)
    first = next_token(target_logits[:, 0], sampling, first_key)
    match = (cands == first[:, None]) & (jnp.arange(cands.shape[1]) < n_cands[:, None])
    pick = jnp.argmax(match, axis=1).astype(jnp.int32)
    after = next_token(_at(target_logits, 1 + pick), sampling, next_key)
    hit = jnp.any(match, axis=1)
    return hit.astype(jnp.int32), pick, jnp.where(hit, after, first)
