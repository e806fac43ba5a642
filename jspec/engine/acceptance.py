"""Deciding how much of a draft the target keeps.

Shapes: B rows, K draft slots, V vocab. Row b drafted tokens draft[b, :n_draft[b]]; slots beyond
are ignored. The target's logits [B, K+1, V] come from one forward over [last, draft...], so
position i predicts the token after draft i (position 0: after the last committed token).
The chain rules (greedy, rejection, MJSD's joint) return (n_accepted [B], next_token [B]): the
row emits draft[:n_accepted] and then next_token, the target's own token at the first rejection
or the bonus after a full accept. `tree_joint` is MJSD's rule over W beams verified together.
`candidates` is the rule for alternatives side by side at one position, which also says which one
it accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.engine.sampling import Sampling, argmax, next_token, probabilities, sample


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
    logp = joint_logp(target_logits[:, :k], sampling)  # [B, K, V]
    logp_x = jnp.take_along_axis(logp, draft[..., None], axis=-1)[..., 0]  # [B, K]
    ratio = jnp.cumsum(logp_x - draft_logq, axis=1)  # r_1 .. r_K
    d = jnp.arange(1, k + 1)[None, :]
    ok = (ratio > log_tau) & (d <= n_draft[:, None])
    n_acc = jnp.max(jnp.where(ok, d, 0), axis=1).astype(jnp.int32)
    return n_acc, target_token(target_logits, n_acc, sampling, key)


def tree_joint(logp_x: jax.Array, best_logq: jax.Array, log_tau: float):
    """MJSD's rule over a tree of W beams, as the reference verifies one: logp_x [B, W, K] is log p
    of each beam's tokens (joint_logp), best_logq [B, K] the highest beam score (sum of log q) the
    beam search had after each step. A beam's first d tokens pass when their joint log p exceeds
    log_tau + best_logq[d]: the test is against the drafter's best, not the beam's own q, so a
    beam the drafter found unlikely gains nothing by it. Keep the largest d at which some beam
    passes (not the first failure's), and of the beams passing there the one the target finds
    likeliest. Returns (pick [B], n_accepted [B]); with no d passing, n_accepted is 0 and pick 0."""
    k = logp_x.shape[-1]
    joint_p = jnp.cumsum(logp_x, axis=-1)  # [B, W, K]
    ok = joint_p - best_logq[:, None, :] > log_tau
    n_acc = jnp.max(jnp.where(jnp.any(ok, axis=1), jnp.arange(1, k + 1)[None, :], 0), axis=1).astype(jnp.int32)
    at = jnp.maximum(n_acc - 1, 0)[:, None, None]
    passing = jnp.take_along_axis(ok, at, axis=2)[..., 0]  # [B, W]
    pick = jnp.argmax(jnp.where(passing, jnp.take_along_axis(joint_p, at, axis=2)[..., 0], -jnp.inf), axis=1)
    return pick.astype(jnp.int32), n_acc


def target_token(target_logits: jax.Array, n_acc: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """The target's own token after a kept prefix of n_acc [B] drafts, from target_logits [B, K+1, V]:
    its argmax when greedy, else a sample from p (no residual distribution: MJSD's rules)."""
    logits = _at(target_logits, n_acc)
    if sampling.greedy:
        return argmax(logits)
    return jax.random.categorical(key, joint_logp(logits, sampling), axis=-1).astype(jnp.int32)


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
    if not cands.shape[1]:  # a verification of the last token alone (a round that drafted nothing)
        return jnp.zeros_like(n_cands), jnp.zeros_like(n_cands), first
    match = (cands == first[:, None]) & (jnp.arange(cands.shape[1]) < n_cands[:, None])
    pick = jnp.argmax(match, axis=1).astype(jnp.int32)
    after = next_token(_at(target_logits, 1 + pick), sampling, next_key)
    hit = jnp.any(match, axis=1)
    return hit.astype(jnp.int32), pick, jnp.where(hit, after, first)
