"""MJSD's beam drafter: W beams over K draft tokens, verified by joint likelihood (jspec.acceptance.joint).

It wraps a drafter that runs a stack of layers token by token: the early-exit drafter (the target's
first N layers, then a trained head or the target's own LM head), an EAGLE head (no target layer:
each beam's token fused with the state its parent beam's step left, as jspec.drafters.eagle drafts)
or a separate draft model. All W beams go through the stack as W rows of one forward at the same
position. Each layer attends over

    the committed prefix, kept once: the drafter's own cache, positions < length (read only), and
    the beam's draft entries [B, W, K, kv heads, H]: slot j is the token fed at position length + j.

After each step the W best (beam, token) pairs become the new beams, and the draft entries follow
their parent beam: W x K entries per layer are reordered, never the prefix. A beam's queries see
its own entries only. At the end the best beam is the draft: its entries are written into the
drafter's cache at their positions, as the token-by-token drafter would have left them, and its last
token gets the one pass the token-by-token drafter gives it after its loop.

Greedy: beam search, the top W of beam score + log q (untempered). Sampling: beam sampling, W
(beam, token) pairs drawn without replacement with probability proportional to the beam's and the
token's processed draft probabilities (Gumbel top-k). Every live row drafts K tokens (no controller).

With `tree` (the reference's tree attention) every beam is verified: the whole target runs once
over the newest committed token and the W x K beam tokens (tree_forward: the same two-softmax
attention, each beam token seeing the committed prefix, that token and its own beam's earlier
tokens), the reference's tree rule picks a beam and how much of it to keep (acceptance.tree_joint),
and only that beam's entries are written to the target's cache; the loop then verifies nothing
more (Draft.verified, Draft.kept).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jspec import acceptance, heads, model
from jspec.config import ModelConfig
from jspec.drafters.base import Draft, Drafter
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle import Eagle
from jspec.drafters.early_exit import EarlyExit
from jspec.sampling import Sampling, probabilities


@dataclasses.dataclass
class Feedback:
    """An EAGLE head's input: each token fused with a state (jspec.heads.fuse_input), the target's
    before the first drafted token, then the head's own output for the token before it."""

    fuse: Callable  # (tokens [B, W], states [B, W, D]) -> inputs [B, W, D]
    state: Callable  # the head's output h [B, W, D] -> the state the next token is fused with
    first: jax.Array  # [B, D] the state before the first drafted token


@dataclasses.dataclass
class Stack:
    """What one beam step runs: embedding, the trunk (whose output is the exit state an early-exit
    verifier continues from), the head layers, and the readout to draft logits. With `feedback` (an
    EAGLE head) the input is the token fused with its parent beam's state, and the step's state is
    the one the next token is fused with."""

    cfg: ModelConfig
    embed: dict  # params holding "embed"
    trunk: list  # [(layer params, prefix k [B, S, KV, H], prefix v)]
    head: list  # the same, for layers after the exit state
    readout: Callable  # h [B, W, D] -> logits [B, W, V]
    feedback: Feedback | None = None


def _prefix(q, pk, pv, length):
    """q [B, N, KV, G, H] over the committed prefix pk, pv [B, S, KV, H] (positions < length [B])
    through model.attention_and_lse (the CPU kernel, which reads only up to length, where XLA
    would transpose the whole cache at every step): (output, log softmax denominator [B, N, KV, G])."""
    return model.attention_and_lse(q, pk, pv, jnp.broadcast_to((length - 1)[:, None], q.shape[:2]))


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
    q, k, v = model.qkv(cfg, lp, h, cos, sin)
    bk = bk.at[:, :, j].set(k.astype(bk.dtype))
    bv = bv.at[:, :, j].set(v.astype(bv.dtype))
    prefix = [x[:, :, None] for x in _prefix(q, pk, pv, length)]
    out = _attend(q[:, :, None], prefix, bk, bv, (jnp.arange(bk.shape[2]) <= j)[None])[:, :, 0]
    h = h + model.linear(out.reshape(b, w, -1), lp["wo"])
    if "w_down" in lp:
        h = model.mlp_block(cfg, lp, h)
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
    h = model.embed(stack.embed, x) if stack.feedback is None else stack.feedback.fuse(x, prev)
    cos, sin = model.rope(cfg, jnp.broadcast_to((length + j)[:, None], x.shape))
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


def _by_beam(x, index):
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
        tokens = _by_beam(tokens, parent).at[:, :, j].set(tok)
        logq = _by_beam(logq, parent).at[:, :, j].set(tok_lq)
        exits = _by_beam(exits, parent)
        entries = [(_by_beam(bk, parent), _by_beam(bv, parent)) for bk, bv in entries]
        best = best.at[:, j].set(jnp.max(score, axis=1))
        return tok, exits[:, :, j], score, best, tokens, logq, exits, entries, key

    # Step 0 expands the one beam `last` into W: one row through the stack, not W equal ones.
    first = jnp.zeros((b, d)) if stack.feedback is None else stack.feedback.first
    start = (last[:, None], first[:, None].astype(jnp.float32), jnp.zeros((b, 1)), jnp.zeros((b, k)),
             jnp.zeros((b, 1, k), jnp.int32), jnp.zeros((b, 1, k), jnp.float32), jnp.zeros((b, 1, k, d), jnp.float32),
             empty_entries(stack, b, 1, k), key)
    _, _, score, best, tokens, logq, exits, entries, _ = jax.lax.fori_loop(1, k, body, body(0, start))
    return tokens, logq, score, exits, entries, best


def _spread(x, w: int):
    """[B, 1 + W*K, ...] (the newest committed token, then each beam's K tokens) -> [B, W, K+1, ...],
    the committed token at slot 0 of every beam."""
    b = x.shape[0]
    first = jnp.broadcast_to(x[:, None, :1], (b, w, 1, *x.shape[2:]))
    return jnp.concatenate([first, x[:, 1:].reshape(b, w, -1, *x.shape[2:])], axis=2)


def _gather(y):
    """_spread's inverse: [B, W, K+1, ...] -> [B, 1 + W*K, ...], slot 0 read from beam 0."""
    b, w = y.shape[:2]
    return jnp.concatenate([y[:, 0, :1], y[:, :, 1:].reshape(b, -1, *y.shape[3:])], axis=1)


def tree_forward(params, cfg: ModelConfig, last, tokens, length, cache: model.KVCache):
    """The whole target over a tree: last [B] at position length [B], then each beam's tokens
    [B, W, K] at length + 1 .. length + K, each token seeing the cache below length, `last`, and
    the tokens before it in its own beam. The tree's 1 + W*K tokens go through every layer as one
    block ([last, beam 0's K, beam 1's K, ..]); the cache is read, not written. Returns (final
    hidden [B, 1 + W*K, D] (pre-norm), each layer's (k, v) [B, 1 + W*K, KV, H], each layer's input
    [B, 1 + W*K, D])."""
    b, w, k = tokens.shape
    fed = jnp.concatenate([last[:, None], tokens.reshape(b, w * k)], axis=1)
    slot = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.tile(jnp.arange(1, k + 1, dtype=jnp.int32), w)])
    cos, sin = model.rope(cfg, length[:, None] + slot[None, :])
    causal = jnp.tril(jnp.ones((k + 1, k + 1), jnp.bool_))
    h = model.embed(params, fed)
    kv, states = [], []
    for lp, pk, pv in zip(params["layers"], cache.k, cache.v):
        states.append(h)
        q, nk, nv = model.qkv(cfg, lp, h, cos, sin)
        # The prefix once per token ([last] is every beam's slot 0), then spread over the beams.
        prefix = [_spread(x, w) for x in _prefix(q, pk, pv, length)]
        out = _gather(_attend(_spread(q, w), prefix, _spread(nk, w), _spread(nv, w), causal))
        h = model.mlp_block(cfg, lp, h + model.linear(out.reshape(b, 1 + w * k, -1), lp["wo"]))
        kv.append((nk, nv))
    return h, kv, states


@dataclasses.dataclass(frozen=True)
class Beam(Drafter):
    """`inner` (an EarlyExit, an Eagle or a DraftModel) drafting W = `width` beams; acceptance by joint
    likelihood with threshold tau = `threshold`, of the best beam by draft score, or with `tree` of
    every beam (acceptance.tree_joint)."""

    inner: Drafter
    width: int = 4
    threshold: float = 0.5
    tree: bool = False  # verify every beam in one forward (MMTAD), not only the best by draft score

    @property
    def max_draft(self) -> int:
        return self.inner.max_draft

    def prefill(self, params, dparams, cfg, tokens, packing, cache):
        return self.inner.prefill(params, dparams, cfg, tokens, packing, cache)

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        return self.inner.verify(params, dparams, cfg, tokens, positions, cache, dstate, width)

    def accepted(self, params, dparams, cfg, dstate, fed, positions, h, n_acc):
        return self.inner.accepted(params, dparams, cfg, dstate, fed, positions, h, n_acc)

    def accept(self, d: Draft, target_logits, sampling, key):
        if d.kept is not None:  # the tree's rule, decided over every beam (_verified)
            return d.kept, acceptance.target_token(target_logits, d.kept, sampling, key)
        return acceptance.joint(d.tokens, d.logq, d.n, target_logits, sampling, math.log(self.threshold), key)

    def stack(self, params, dparams, cfg, cache: model.KVCache, dstate) -> Stack:
        """The inner drafter's layers over its committed prefix."""
        inner = self.inner
        if isinstance(inner, DraftModel):
            dc = dstate["cache"]
            trunk = [(dparams["layers"][i], dc.k[i], dc.v[i]) for i in range(inner.draft_cfg.num_layers)]
            return Stack(inner.draft_cfg, dparams, trunk, [], lambda h: model.logits(dparams, inner.draft_cfg, h))
        eagle = isinstance(inner, Eagle)
        trunk = [(params["layers"][i], cache.k[i], cache.v[i]) for i in (() if eagle else inner.shallow)]
        if not eagle and inner.head is None:
            return Stack(cfg, params, trunk, [], lambda h: model.logits(params, cfg, h))
        # A trained head: its layers over its own cache, its final norm, its draft vocabulary.
        head = list(zip(dparams["layers"], dstate["head"]["k"], dstate["head"]["v"]))
        norm = lambda h: model.rms_norm(h, dparams["norm"], cfg.rms_norm_eps)
        feedback = (Feedback(lambda x, prev: heads.fuse_input(params, dparams, x, prev), norm, dstate["prev"])
                    if eagle else None)
        return Stack(cfg, params, trunk, head, lambda h: heads.vocab_logits(cfg, dparams, norm(h)), feedback)

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        k = self.max_draft
        stack = self.stack(params, dparams, cfg, s.cache, s.dstate)
        tokens, logq, score, exits, entries, best_logq = beam_search(stack, s.last, s.length, self.width, k,
                                                                      sampling, key)
        n = jnp.full(s.length.shape, k, jnp.int32)
        if self.tree:
            return self._verified(params, dparams, cfg, s, tokens, best_logq, n, sampling)
        best = jnp.argmax(score, axis=1)
        tokens, logq, exits = _by_beam(tokens, best), _by_beam(logq, best), _by_beam(exits, best)
        final = tokens[:, -1]
        final_pos = (s.length + k)[:, None]
        written = [model.write_kv(pk, pv, _by_beam(bk, best), _by_beam(bv, best), s.length)
                   for (_, pk, pv), (bk, bv) in zip(stack.trunk + stack.head, entries)]
        inner = self.inner
        if isinstance(inner, DraftModel):
            dcache = model.KVCache([kv[0] for kv in written], [kv[1] for kv in written])
            _, dcache = model.forward(dparams, inner.draft_cfg, final[:, None], final_pos, dcache)
            return Draft(tokens, None, n, s.cache, {"cache": dcache}, s.cstate, logq)
        if isinstance(inner, Eagle):  # verification runs the whole target: no exit state to leave
            hk, hv = zip(*written)
            return Draft(tokens, None, n, s.cache, {**s.dstate, "head": {"k": list(hk), "v": list(hv)}}, s.cstate, logq)
        shallow = list(inner.shallow)
        ck, cv = list(s.cache.k), list(s.cache.v)
        for i, (wk, wv) in zip(shallow, written):
            ck[i], cv[i] = wk, wv
        # The last drafted token, at slot K, still needs its exit state (EarlyExit.draft does the same).
        h, cache = model.run_layers(params, cfg, model.embed(params, final[:, None]), final_pos,
                                    model.KVCache(ck, cv), shallow)
        dstate = {**s.dstate, "hidden": jnp.concatenate([exits, h], axis=1)}
        if inner.head is not None:
            hk, hv = zip(*written[len(shallow):])
            dstate["head"] = inner.head.advance(dparams, cfg, h, final_pos, {"k": list(hk), "v": list(hv)})
        return Draft(tokens, None, n, cache, dstate, s.cstate, logq)

    def _verified(self, params, dparams, cfg, s, tokens, best_logq, n, sampling):
        """Every beam verified in one forward of the whole target over the tree (tree_forward) and
        judged by acceptance.tree_joint; the draft is the beam it picks, with how much of it to keep
        (Draft.kept). The Draft carries the target's states and logits along that beam, so the loop
        verifies nothing more, and the drafter's own state as if it had drafted that beam."""
        b, w, k = tokens.shape
        h, kv, states = tree_forward(params, cfg, s.last, tokens, s.length, s.cache)
        logits = _spread(model.logits(params, cfg, h), w)  # [B, W, K+1, V]
        logp = acceptance.joint_logp(logits[:, :, :k], sampling)
        logp_x = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]  # [B, W, K]
        pick, kept = acceptance.tree_joint(logp_x, best_logq, math.log(self.threshold))
        along = lambda x: _by_beam(_spread(x, w), pick)  # noqa: E731  [B, 1 + W*K, ...] -> the pick's [B, K+1, ...]
        written = [model.write_kv(ck, cv, along(nk), along(nv), s.length)
                   for ck, cv, (nk, nv) in zip(s.cache.k, s.cache.v, kv)]
        cache = model.KVCache([x[0] for x in written], [x[1] for x in written])
        tokens = _by_beam(tokens, pick)
        fed = jnp.concatenate([s.last[:, None], tokens], axis=1)
        positions = s.length[:, None] + jnp.arange(k + 1)[None, :]
        inner, dstate = self.inner, s.dstate
        if isinstance(inner, DraftModel):
            _, dstate = inner.feed(params, dparams, cfg, cache, dstate, fed, positions)
        elif isinstance(inner, EarlyExit) and inner.head is not None:
            exit_states = along(states[inner.exit_layer])
            dstate = {**dstate, "head": inner.head.advance(dparams, cfg, exit_states, positions, dstate["head"])}
        # (An EAGLE head's entries are written again from the target's states after acceptance.)
        # No log q: the rule is decided (kept), and only the chain rule reads Draft.logq.
        return Draft(tokens, None, n, cache, dstate, s.cstate, verified=(along(h), _by_beam(logits, pick)), kept=kept)
