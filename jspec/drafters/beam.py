"""MJSD's beam drafter: W beams over K draft tokens, verified by joint likelihood (jspec.engine.acceptance.joint).

It wraps a drafter that runs a stack of layers token by token and says which (its `beam_stack`
hook): the early-exit drafter (the target's first N layers, then a trained head or the target's
own LM head), an EAGLE head (no target layer: each beam's token fused with the state its parent
beam's step left, as jspec.drafters.eagle drafts) or a separate draft model. All W beams go
through the stack as W rows of one forward at the same position. Each layer attends over

    the committed prefix, kept once: the drafter's own cache, positions < length (read only), and
    the beam's draft entries [B, W, K, kv heads, H]: slot j is the token fed at position length + j.

After each step the W best (beam, token) pairs become the new beams, and the draft entries follow
their parent beam: W x K entries per layer are reordered, never the prefix. A beam's queries see
its own entries only. At the end the best beam is the draft: its entries are written into the
drafter's cache at their positions, and the wrapped drafter takes it back (`beam_drafted`) as its
token-by-token draft would have left it, its last token given the pass that draft gives it after
its loop.

Greedy: beam search, the top W of beam score + log q (untempered). Sampling: beam sampling, W
(beam, token) pairs drawn without replacement with probability proportional to the beam's and the
token's processed draft probabilities (Gumbel top-k). Every live row drafts K tokens (no controller).

With `tree` (the reference's tree attention) every beam is verified: the whole target runs once
over the newest committed token and the W x K beam tokens (tree_forward: the same two-softmax
attention, each beam token seeing the committed prefix, that token and its own beam's earlier
tokens), the reference's tree rule picks a beam and how much of it to keep (acceptance.tree_joint),
and only that beam's entries are written to the target's cache (the wrapped drafter updates its
own state from them: `tree_verified`); the loop then verifies nothing more (Draft.verified,
Draft.kept).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter, Stack, Wrapped, Wrapper
from jspec.engine import acceptance
from jspec.engine.sampling import Sampling, probabilities
from jspec.engine.state import Draft
from jspec.model import attention, decoder
from jspec.model.config import ModelConfig


def _prefix(q, pk, pv, length):
    """q [B, N, KV, G, H] over the committed prefix pk, pv [B, S, KV, H] (positions < length [B])
    through attention.attention_and_lse (the CPU kernel, which reads only up to length, where XLA
    would transpose the whole cache at every step): (output, log softmax denominator [B, N, KV, G])."""
    return attention.attention_and_lse(q, pk, pv, jnp.broadcast_to((length - 1)[:, None], q.shape[:2]))


def _attend(q, prefix, bk, bv, visible):
    """q [B, W, T, KV, G, H], with its attention over the committed prefix (_prefix's output and
    denominator, laid out as q), merged by their denominators with its attention over its beam's
    own entries bk, bv [B, W, E, KV, H] (query slot t sees entry e where visible [T, E])."""
    out_p, lse_p = prefix
    sb = jnp.einsum("bwtkgh,bwekh->bwtkge", q, bk, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    sb = jnp.where(visible[:, None, None, :], sb, -jnp.inf)
    lse_b = jax.nn.logsumexp(sb, axis=-1)  # [B, W, T, KV, G]
    out_b = jnp.einsum("bwtkge,bwekh->bwtkgh", jnp.exp(sb - lse_b[..., None]), bv)
    lse = jnp.logaddexp(lse_p, lse_b)[..., None]
    return out_p * jnp.exp(lse_p[..., None] - lse) + out_b * jnp.exp(lse_b[..., None] - lse)


def beam_layer(cfg: ModelConfig, lp, h, cos, sin, pk, pv, length, bk, bv, j):
    """One decoder layer (attention, then the MLP if lp has one) on the beams' h [B, W, D] at slot j.
    Returns h and the beams' entries with slot j written."""
    b, w, _ = h.shape
    q, k, v = decoder.qkv(cfg, lp, h, cos, sin)
    bk = bk.at[:, :, j].set(k.astype(bk.dtype))
    bv = bv.at[:, :, j].set(v.astype(bv.dtype))
    prefix = [x[:, :, None] for x in _prefix(q, pk, pv, length)]
    out = _attend(q[:, :, None], prefix, bk, bv, (jnp.arange(bk.shape[2]) <= j)[None])[:, :, 0]
    h = h + decoder.linear(out.reshape(b, w, -1), lp["wo"], split_depth=True)
    if "w_down" in lp:
        h = decoder.mlp_block(cfg, lp, h)
    return h, bk, bv


def empty_entries(stack: Stack, batch: int, width: int, k: int):
    """Zeroed draft entries, (k, v) [B, W, K, KV, H] per trunk and head layer."""
    shape = (batch, width, k, stack.cfg.num_kv_heads, stack.cfg.head_dim)
    return [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
            for _ in stack.trunk + stack.head]


def beam_step(stack: Stack, x, length, j, entries, prev=None):
    """Feed x [B, W] (one token per beam) at position length + j, slot j; prev [B, W, D] is each
    beam's state with `feedback`. Returns (logits [B, W, V], the step's state [B, W, D]: the exit
    state, or with feedback the state the next token is fused with, entries)."""
    cfg = stack.cfg
    h = decoder.embed(stack.embed, x) if stack.feedback is None else stack.feedback.fuse(x, prev)
    cos, sin = decoder.rope(cfg, jnp.broadcast_to((length + j)[:, None], x.shape))
    out, exit_state = [], None
    for i, (lp, pk, pv) in enumerate(stack.trunk + stack.head):
        if i == len(stack.trunk):
            exit_state = h
        h, bk, bv = beam_layer(cfg, lp, h, cos, sin, pk, pv, length, *entries[i], j)
        out.append((bk, bv))
    if stack.feedback is not None:
        exit_state = stack.feedback.state(h)
    elif exit_state is None:
        exit_state = h
    return stack.readout(h), exit_state, out


def by_beam(x, index):
    """x [B, W, ...] with beams picked by index [B, W'] (or [B] for one beam)."""
    if index.ndim == 1:
        return jnp.take_along_axis(x, index.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]
    return jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)


def beam_search(stack: Stack, last, length, width: int, k: int, sampling: Sampling, key):
    """W beams over K tokens from last [B] at position length [B]. Returns every beam's (tokens
    [B, W, K], log q [B, W, K], beam score [B, W]: the sum of log q, exit states [B, W, K, D] of slots
    0..K-1, entries (k, v) [B, W, K, KV, H] per layer), and the best score after each step [B, K]
    (of the beams alive then, which later steps may have dropped)."""
    b = last.shape[0]
    d = stack.cfg.hidden_size

    def body(j, st):
        x, prev, score, best, tokens, logq, exits, entries, key = st
        logits, exit_state, entries = beam_step(stack, x, length, j, entries, prev)
        exits = exits.at[:, :, j].set(exit_state)
        key, sub = jax.random.split(key)
        if sampling.greedy:
            lq = jax.nn.log_softmax(logits, axis=-1)  # [B, W, V]
        else:
            lq = jnp.log(probabilities(logits, sampling))
        joint = score[:, :, None] + lq  # [B, W_in, V]
        rank = joint if sampling.greedy else joint + jax.random.gumbel(sub, joint.shape)
        # The W best of W_in x V are among each beam's own W best: two small top-k, not one over W_in x V.
        rank_w, tok_w = jax.lax.top_k(rank, width)  # [B, W_in, W]
        _, pick = jax.lax.top_k(rank_w.reshape(b, -1), width)  # [B, W] into the W_in x W
        parent = pick // width
        tok = jnp.take_along_axis(tok_w.reshape(b, -1), pick, axis=1).astype(jnp.int32)
        flat = parent * lq.shape[-1] + tok
        score = jnp.take_along_axis(joint.reshape(b, -1), flat, axis=1)
        tok_lq = jnp.take_along_axis(lq.reshape(b, -1), flat, axis=1)
        tokens = by_beam(tokens, parent).at[:, :, j].set(tok)
        logq = by_beam(logq, parent).at[:, :, j].set(tok_lq)
        exits = by_beam(exits, parent)
        entries = [(by_beam(bk, parent), by_beam(bv, parent)) for bk, bv in entries]
        best = best.at[:, j].set(jnp.max(score, axis=1))
        return tok, exits[:, :, j], score, best, tokens, logq, exits, entries, key

    # Step 0 expands the one beam `last` into W: one row through the stack, not W equal ones.
    first = jnp.zeros((b, d)) if stack.feedback is None else stack.feedback.first
    start = (last[:, None], first[:, None].astype(jnp.float32), jnp.zeros((b, 1)), jnp.zeros((b, k)),
             jnp.zeros((b, 1, k), jnp.int32), jnp.zeros((b, 1, k), jnp.float32), jnp.zeros((b, 1, k, d), jnp.float32),
             empty_entries(stack, b, 1, k), key)
    _, _, score, best, tokens, logq, exits, entries, _ = jax.lax.fori_loop(1, k, body, body(0, start))
    return tokens, logq, score, exits, entries, best


def spread(x, w: int):
    """[B, 1 + W*K, ...] (the newest committed token, then each beam's K tokens) -> [B, W, K+1, ...],
    the committed token at slot 0 of every beam."""
    b = x.shape[0]
    first = jnp.broadcast_to(x[:, None, :1], (b, w, 1, *x.shape[2:]))
    return jnp.concatenate([first, x[:, 1:].reshape(b, w, -1, *x.shape[2:])], axis=2)


def gather(y):
    """spread's inverse: [B, W, K+1, ...] -> [B, 1 + W*K, ...], slot 0 read from beam 0."""
    b, w = y.shape[:2]
    return jnp.concatenate([y[:, 0, :1], y[:, :, 1:].reshape(b, -1, *y.shape[3:])], axis=1)


def tree_forward(params, cfg: ModelConfig, last, tokens, length, cache: decoder.KVCache):
    """The whole target over a tree: last [B] at position length [B], then each beam's tokens
    [B, W, K] at length + 1 .. length + K, each token seeing the cache below length, `last`, and
    the tokens before it in its own beam. The tree's 1 + W*K tokens go through every layer as one
    block ([last, beam 0's K, beam 1's K, ..]); the cache is read, not written. Returns (final
    hidden [B, 1 + W*K, D] (pre-norm), each layer's (k, v) [B, 1 + W*K, KV, H], each layer's input
    [B, 1 + W*K, D])."""
    b, w, k = tokens.shape
    fed = jnp.concatenate([last[:, None], tokens.reshape(b, w * k)], axis=1)
    slot = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.tile(jnp.arange(1, k + 1, dtype=jnp.int32), w)])
    cos, sin = decoder.rope(cfg, length[:, None] + slot[None, :])
    causal = jnp.tril(jnp.ones((k + 1, k + 1), jnp.bool_))
    h = decoder.embed(params, fed)
    kv, states = [], []
    for lp, pk, pv in zip(params["layers"], cache.k, cache.v):
        states.append(h)
        q, nk, nv = decoder.qkv(cfg, lp, h, cos, sin)
        # The prefix once per token ([last] is every beam's slot 0), then spread over the beams.
        prefix = [spread(x, w) for x in _prefix(q, pk, pv, length)]
        out = gather(_attend(spread(q, w), prefix, spread(nk, w), spread(nv, w), causal))
        h = decoder.mlp_block(cfg, lp, h + decoder.linear(out.reshape(b, 1 + w * k, -1), lp["wo"], split_depth=True))
        kv.append((nk, nv))
    return h, kv, states


@dataclasses.dataclass(frozen=True)
class Beam(Wrapper):
    """`inner` (a drafter with the beam hooks: early exit, an EAGLE head, a draft model) drafting W =
    `width` beams; acceptance by joint likelihood with threshold tau = `threshold`, of the best beam
    by draft score, or with `tree` of every beam (acceptance.tree_joint)."""

    inner: Drafter
    width: int = 4
    threshold: float = 0.5
    tree: bool = False  # verify every beam in one forward (MMTAD), not only the best by draft score

    def accept(self, d: Draft, target_logits, sampling, key):
        if d.kept is not None:  # the tree's rule, decided over every beam (_verified)
            return d.kept, acceptance.target_token(target_logits, d.kept, sampling, key)
        return acceptance.joint(d.tokens, d.logq, d.n, target_logits, sampling, math.log(self.threshold), key)

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        k, inner = self.max_draft, self.inner
        stack = inner.beam_stack(params, dparams.inner, cfg, s.cache, s.dstate.inner)
        tokens, logq, score, exits, entries, best_logq = beam_search(stack, s.last, s.length, self.width, k,
                                                                      sampling, key)
        n = jnp.full(s.length.shape, k, jnp.int32)
        if self.tree:
            return self._verified(params, dparams, cfg, s, tokens, best_logq, n, sampling)
        best = jnp.argmax(score, axis=1)
        tokens, logq, exits = by_beam(tokens, best), by_beam(logq, best), by_beam(exits, best)
        written = [decoder.write_kv(pk, pv, by_beam(bk, best), by_beam(bv, best), s.length)
                   for (_, pk, pv), (bk, bv) in zip(stack.trunk + stack.head, entries)]
        cache, dstate = inner.beam_drafted(params, dparams.inner, cfg, s.cache, s.dstate.inner, written, exits,
                                           tokens[:, -1], (s.length + k)[:, None])
        return Draft(tokens, None, n, cache, Wrapped(dstate), s.cstate, logq)

    def _verified(self, params, dparams, cfg, s, tokens, best_logq, n, sampling):
        """Every beam verified in one forward of the whole target over the tree (tree_forward) and
        judged by acceptance.tree_joint; the draft is the beam it picks, with how much of it to keep
        (Draft.kept). The Draft carries the target's states and logits along that beam, so the loop
        verifies nothing more, and the drafter's own state as if it had drafted that beam."""
        b, w, k = tokens.shape
        h, kv, states = tree_forward(params, cfg, s.last, tokens, s.length, s.cache)
        logits = spread(decoder.logits(params, cfg, h), w)  # [B, W, K+1, V]
        logp = acceptance.joint_logp(logits[:, :, :k], sampling)
        logp_x = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]  # [B, W, K]
        pick, kept = acceptance.tree_joint(logp_x, best_logq, math.log(self.threshold))
        along = lambda x: by_beam(spread(x, w), pick)  # noqa: E731  [B, 1 + W*K, ...] -> the pick's [B, K+1, ...]
        written = [decoder.write_kv(ck, cv, along(nk), along(nv), s.length)
                   for ck, cv, (nk, nv) in zip(s.cache.k, s.cache.v, kv)]
        cache = decoder.KVCache([x[0] for x in written], [x[1] for x in written])
        tokens = by_beam(tokens, pick)
        fed = jnp.concatenate([s.last[:, None], tokens], axis=1)
        positions = s.length[:, None] + jnp.arange(k + 1)[None, :]
        dstate = self.inner.tree_verified(params, dparams.inner, cfg, cache, s.dstate.inner, fed, positions,
                                          lambda i: along(states[i]))
        # No log q: the rule is decided (kept), and only the chain rule reads Draft.logq.
        return Draft(tokens, None, n, cache, Wrapped(dstate), s.cstate, verified=(along(h), by_beam(logits, pick)),
                     kept=kept)
