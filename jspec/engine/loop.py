"""The decoding loop: prefill, then draft / verify / accept rounds, all in one jitted while loop.

Every method is this loop with a different drafter: autoregressive decoding is the drafter that
proposes nothing (K = 0), so each round verifies one position and emits the target's token.

Per row b the loop keeps `length[b]`, the number of committed positions in the cache, and
`last[b]`, the newest committed token, which sits at position length[b] but is not yet in the
cache. A round feeds [last, draft_1 .. draft_K] at positions length .. length+K, accepts
n_accepted[b] drafts plus one target token, and advances length by n_accepted + 1. Entries
past a row's length are stale and never attended to, so rejected drafts need no rollback.
Rows advance independently; rows that are done keep computing (shapes are static) but their
results are masked out. A drafter with `candidates` instead feeds C alternatives for the one
position after `last` (jspec.drafters.base), and the accepted one becomes the round's chain.
A drafter that verified its own draft (MJSD's tree of beams) hands the round the target's states
and logits in its Draft, and the round runs no verification of its own.
`seq[b, p]` is the token at position p (prompt, then generated).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.engine import acceptance, pricing
from jspec.engine.sampling import Sampling, next_token
from jspec.engine.state import LoopState
from jspec.engine.width import verify_widths, width_index
from jspec.model import decoder, numerics, sharding
from jspec.model.config import ModelConfig
from jspec.model.numerics import Numerics, tracing


# Positions a chunk of a prefill holds. On a CPU a chunk's products are bound by arithmetic and
# run faster the more rows they hold, up to about 256 (0.80 ms a position at 32, 0.60 at 128,
# 0.56 at 256: docs/design.md, "Chunked prefill"), so a prefill of few rows goes in chunks of
# CHUNK_ROWS / rows positions (at most MAX_CHUNK) while a whole one fits before the longest
# prompt ends, then in chunks of CHUNK (what pads a prompt least). On an accelerator chunks of
# ACCELERATOR_CHUNK keep its matrix units busy.
CHUNK = 32
CHUNK_ROWS = 256
MAX_CHUNK = 128
ACCELERATOR_CHUNK = 256


def prefill_chunk(platform: str, length: int) -> int:
    """The last (or only) chunk of a prefill into a cache of `length` positions: the platform's, or
    the largest power of two below it that divides `length` (these chunks tile the cache)."""
    return math.gcd(CHUNK if platform == "cpu" else ACCELERATOR_CHUNK, length)


def prefill_chunks(platform: str, length: int, rows: int) -> tuple[int, ...]:
    """The chunks of a prefill of `rows` prompts into a cache of `length` positions, longest first
    (jspec.engine.loop.prefill): powers of two, the last one prefill_chunk's."""
    small = prefill_chunk(platform, length)
    if platform != "cpu":
        return (small,)
    big = min(MAX_CHUNK, power_below(max(CHUNK_ROWS // rows, 1)), power_below(length))
    return (big, small) if big > small else (small,)


def power_below(n: int) -> int:
    """The largest power of two at most n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def prefill(drafter, params, dparams, cfg: ModelConfig, tokens, lens, cache: decoder.KVCache,
            chunks: tuple[int, ...]):
    """Prompts tokens [B, S] (row b's the first lens[b]) through `drafter`'s prefill, in chunks of
    positions, each of `chunks` (longest first, each a multiple of the next, the last dividing S)
    in a loop of its own: every size but the last while a whole chunk fits before the longest
    prompt ends, the last as long as the longest prompt needs. Returns the target's last-layer
    state at each prompt's last token [B, D], the cache and the drafter's state."""
    b, longest = tokens.shape[0], jnp.max(lens)

    def step(chunk, carry):
        start, cache, dstate, h_last = carry
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        h, cache, dstate = drafter.prefill(params, dparams, cfg, jax.lax.dynamic_slice_in_dim(tokens, start, chunk, 1),
                                           positions, lens, cache, dstate)
        return start + chunk, cache, dstate, decoder.prompt_last(h, positions, lens, h_last)

    h_last = jnp.zeros((b, cfg.hidden_size), numerics.activation_dtype())
    carry = (jnp.zeros((), jnp.int32), cache, drafter.begin(params, dparams, cfg, b, cache), h_last)
    for chunk in chunks[:-1]:
        fits = lambda c, chunk=chunk: c[0] + chunk <= longest  # noqa: E731
        carry = jax.lax.while_loop(fits, functools.partial(step, chunk), carry)
    _, cache, dstate, h_last = jax.lax.while_loop(lambda c: c[0] < longest, functools.partial(step, chunks[-1]), carry)
    return h_last, cache, dstate


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """logits [..., V] -> the k most likely ids [..., k] and their untempered log-probabilities."""
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return ids.astype(jnp.int32), logp


def _emit(s: LoopState, tokens: jax.Array, count: jax.Array, eos_ids, max_new_tokens: int, top=None) -> LoopState:
    """Append tokens[b, :count[b]] to each live row, stopping at EOS and at max_new_tokens (and
    `top`, the target's top-k [B, K+1, k] behind each token, when the loop keeps them)."""
    k1 = tokens.shape[1]
    slot = jnp.arange(k1)[None, :]
    is_eos = jnp.isin(tokens, eos_ids) & (slot < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, slot, k1), axis=1)
    count = jnp.minimum(jnp.minimum(count, first_eos + 1), max_new_tokens - s.n)
    count = jnp.where(s.done, 0, count)
    pos = s.length[:, None] + 1 + slot
    rows = jnp.arange(tokens.shape[0])[:, None]
    seq = s.seq.at[rows, jnp.where(slot < count[:, None], pos, s.seq.shape[1])].set(tokens, mode="drop")
    last = jnp.where(count > 0, jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0], s.last)
    if top is not None:
        at = jnp.where(slot < count[:, None], s.n[:, None] + slot, max_new_tokens)
        top = tuple(kept.at[rows, at].set(new, mode="drop") for kept, new in zip(s.top, top))
    n = s.n + count
    done = s.done | (first_eos < count) | (n >= max_new_tokens)
    return dataclasses.replace(s, seq=seq, last=last, length=s.length + count, n=n, done=done, top=top)


def _chain_rule(drafter, d, target_logits, sampling: Sampling, key):
    """(n_accepted, next_token) of a chain of drafts: the drafter's own rule if it has one, else
    the target's lossless one (greedy match, or rejection sampling)."""
    if drafter.accept is not None:
        return drafter.accept(d, target_logits, sampling, key)
    if sampling.greedy:
        return acceptance.greedy(d.tokens, d.n, target_logits)
    return acceptance.rejection(d.tokens, d.probs, d.n, target_logits, sampling, key)


@dataclasses.dataclass(frozen=True)
class Run:
    """The static half of a decoding program (what it is compiled for); its three stages are
    `start` (prefill and first token), `round` (one draft / verify / accept round) and `finish`
    (the outputs). `generate` chains them for one batch; jspec.engine.slots runs them for a batch
    whose rows are refilled as they finish."""

    cfg: ModelConfig
    sampling: Sampling
    max_new_tokens: int
    drafter: object
    controller: object
    logprobs: int = 0
    numerics: Numerics = Numerics()
    platform: str = "cpu"
    mesh: Mesh | None = None

    def tracing(self):
        """The context a program of this Run is traced in (jspec.model.numerics.tracing)."""
        return tracing(self.numerics, self.platform, self.mesh)

    def start(self, params, dparams, cache, tokens, lens, eos_ids, key) -> LoopState:
        """Prefill B prompts into `cache` (B rows of S positions) and emit each one's first token:
        row b's prompt is tokens[b, :lens[b]] of tokens [B, S] (past it: anything).

        The prompts go through the model a chunk of positions at a time, every row the same chunk,
        in a loop as long as the longest prompt needs: the program is the same for every prompt
        length (docs/design.md, "Chunked prefill")."""
        drafter, cfg, max_new_tokens, logprobs = self.drafter, self.cfg, self.max_new_tokens, self.logprobs
        (b, length), k = tokens.shape, drafter.max_draft
        seq = jnp.where(jnp.arange(length)[None, :] < lens[:, None], tokens, 0)
        h, cache, dstate = prefill(drafter, params, dparams, cfg, seq, lens, cache,
                                   prefill_chunks(self.platform, length, b))
        key, sub = jax.random.split(key)
        first_logits = decoder.logits(params, cfg, h)
        first = next_token(first_logits, self.sampling, sub)
        zeros = jnp.zeros((b,), jnp.int32)
        top = None
        if logprobs:
            top = tuple(jnp.zeros((b, max_new_tokens, logprobs), x.dtype).at[:, 0].set(x)
                        for x in top_logprobs(first_logits, logprobs))
        # "finite": whether each row's first logits were all finite numbers (NaN weights decode one
        # token over and over, without a word otherwise).
        return LoopState(cache=cache, seq=seq.at[jnp.arange(b), lens].set(first), last=first,
                         length=lens, n=jnp.ones((b,), jnp.int32),
                         done=jnp.isin(first, eos_ids) | (max_new_tokens == 1), key=key,
                         rounds=jnp.ones((b,), jnp.int32), drafted=zeros, accepted=zeros, dstate=dstate,
                         cstate=self.controller.init(b, k), prompt=lens,
                         finite=jnp.isfinite(first_logits).all(axis=-1), steps=jnp.zeros((), jnp.int32),
                         budget=jnp.asarray(k, jnp.int32), top=top)

    def round(self, params, dparams, eos_ids, costs, s: LoopState, whole_batch: bool = False) -> LoopState:
        """One round: draft, verify, accept, emit, in every row (a done row's results are dropped).
        With `costs` [K+1] (jspec.engine.pricing) the round drafts as many tokens as they say pays:
        for the batch's end where the batch runs as a `whole_batch` (static batching)."""
        cfg, sampling, drafter, controller = self.cfg, self.sampling, self.drafter, self.controller
        b, k = s.last.shape[0], drafter.max_draft
        key, k_draft, k_accept = jax.random.split(s.key, 3)
        live = ~s.done
        if costs is not None:
            remaining = self.max_new_tokens - s.n if whole_batch else None
            s = dataclasses.replace(s, budget=pricing.draft_length(costs, s.accepted, s.drafted, live, remaining))
            measured = pricing.measured(costs, s.budget)
            controller = pricing.Unstopped(controller, measured)
        d = drafter.draft(params, dparams, cfg, s, controller, sampling, k_draft)
        longest = jnp.max(jnp.where(live, d.n, 0))
        if costs is not None:  # a drafter that proposes all at once (n-gram lookup) proposed past it
            d = dataclasses.replace(d, n=jnp.minimum(d.n, s.budget))
            longest = jnp.where(measured, s.budget, jnp.minimum(longest, s.budget))
        positions = s.length[:, None] + jnp.arange(k + 1)[None, :]
        fed = jnp.concatenate([s.last[:, None], d.tokens], axis=1)

        judge = functools.partial(self._judge, params, dparams, d, k_accept)
        if d.verified is not None:
            (h, target_logits), cache = d.verified, d.cache
            n_acc, pick, nxt, top = judge(h, target_logits)
        else:
            widths = verify_widths(k, self.platform, plain=costs is not None)
            width = decoder.Width(widths, width_index(widths, longest))
            at = positions
            if drafter.candidates:  # alternatives all sit at length + 1; chains too only where the Draft says
                side = jnp.minimum(positions, s.length[:, None] + 1)
                at = side if d.alternatives is None else jnp.where(d.alternatives[:, None], side, positions)
            h, cache = drafter.verify(params, dparams, cfg, fed, at, d.cache, d.dstate, width)
            n_acc, pick, nxt, top = width.apply(judge, h)
        dstate = d.dstate
        if drafter.candidates:
            # From here on the round is the chain [last, accepted candidate, ...]: the accepted one
            # swapped into slot 1 and its cache entries moved to position length + 1.
            slot = jnp.arange(k + 1)[None, :]
            chosen = 1 + pick[:, None]
            order = jnp.where(slot == 1, chosen, jnp.where(slot == chosen, 1, slot))
            fed = jnp.take_along_axis(fed, order, axis=1)
            h = jnp.take_along_axis(h, order[..., None], axis=1)
            if top is not None:
                top = tuple(jnp.take_along_axis(x, order[..., None], axis=1) for x in top)
            cache, dstate = drafter.keep_candidate(params, dparams, cfg, cache, dstate, s.length + 1 + pick,
                                                   s.length + 1)
        emitted = jnp.concatenate([fed[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = emitted.at[jnp.arange(b), n_acc].set(nxt)
        cstate = controller.update(d.cstate, d.n, n_acc, live)
        dstate = drafter.accepted(params, dparams, cfg, dstate, fed, positions, h, n_acc)
        s = dataclasses.replace(s, cache=cache, key=key, dstate=dstate, cstate=cstate, steps=s.steps + 1,
                                rounds=s.rounds + live, drafted=s.drafted + live * d.n,
                                accepted=s.accepted + live * n_acc)
        return _emit(s, emitted, n_acc + 1, eos_ids, self.max_new_tokens, top)

    def _judge(self, params, dparams, d, key, h, target_logits=None):
        """What the target keeps of draft d, from its states h [B, W, D] at the first W positions
        of the round (W <= K + 1: a verification's width, every live row's draft within it) or its
        logits there: (n_accepted [B], the accepted candidate [B] (drafters with candidates, else
        None), next token [B], the top logprobs [B, K+1, k] or None). The logits are taken at W
        positions and judged there, never padded to K + 1: padded, a round that verified one
        position cost 1.19x `ar`'s step at batch 32 in bfloat16 (docs/design.md)."""
        drafter, sampling, logprobs, k = self.drafter, self.sampling, self.logprobs, self.drafter.max_draft
        if target_logits is None:
            target_logits = drafter.target_logits(params, dparams, self.cfg, h, d.dstate, sampling)
        d = d.first(h.shape[1] - 1)
        pick = None
        if not drafter.candidates:
            n_acc, nxt = _chain_rule(drafter, d, target_logits, sampling, key)
        else:
            n_acc, pick, nxt = acceptance.candidates(d.tokens, d.n, target_logits, sampling, key)
            if d.alternatives is not None:
                n_chain, nxt_chain = _chain_rule(drafter, d, target_logits, sampling, key)
                alt = d.alternatives
                n_acc, nxt, pick = (jnp.where(alt, n_acc, n_chain), jnp.where(alt, nxt, nxt_chain),
                                    jnp.where(alt, pick, 0))
        top = None
        if logprobs:
            pad = [(0, 0), (0, k + 1 - h.shape[1]), (0, 0)]
            top = tuple(jnp.pad(x, pad) for x in top_logprobs(target_logits, logprobs))
        return n_acc, pick, nxt, top

    def finish(self, s: LoopState):
        """(out [B, max_new_tokens] with -1 past each row's end, stats dict of [B] arrays)."""
        max_new_tokens = self.max_new_tokens
        idx = s.prompt[:, None] + jnp.arange(max_new_tokens)[None, :]
        out = jnp.take_along_axis(s.seq, jnp.minimum(idx, s.seq.shape[1] - 1), axis=1)
        out = jnp.where(jnp.arange(max_new_tokens)[None, :] < s.n[:, None], out, -1)
        stats = {"new_tokens": s.n, "finite": s.finite, "rounds": s.rounds, "drafted": s.drafted,
                 "accepted": s.accepted, "batch_rounds": jnp.broadcast_to(s.steps, s.n.shape), **self.drafter.stats(s.dstate),
                 **(dict(zip(("top_ids", "top_logprobs"), s.top)) if self.logprobs else {})}
        return out, stats


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("cache",))
def generate(params, dparams, cache: decoder.KVCache, tokens, lens, eos_ids, key, costs, *, run: Run):
    """tokens [B, S] and lens [B]: B prompts, row b's the first lens[b] tokens of tokens[b] (S: the
    cache's length); eos_ids [E]; costs [K+1] prices the rounds (jspec.engine.pricing), or None.

    Returns (out [B, max_new_tokens] with -1 past each row's end, stats dict of [B] arrays, cache).
    The cache needs the longest prompt + max_new_tokens + K + 1 positions. With `run.logprobs` =
    k > 0 stats also hold "top_ids" and "top_logprobs" [B, max_new_tokens, k]: the target's k most
    likely next tokens behind each generated token, from the logits the round verified with (what a
    teacher-forced forward over prompt + output would give, without running one). `run.platform`,
    the one the program is for, chooses the verification widths (jspec.engine.width.verify_widths)
    and the decoder's paths; `run.numerics` its activation dtype and matmul precision (the cache's
    dtype is the cache's own). On `run.mesh` the returned cache is split as
    jspec.model.sharding.cache_sharding splits it: the next batch of its shape takes it back
    (donated) as that batch's program expects.
    """
    with run.tracing():
        s = run.start(params, dparams, cache, tokens, lens, eos_ids, key)
        one_round = functools.partial(run.round, params, dparams, eos_ids, costs, whole_batch=True)
        s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), one_round, s)
        return (*run.finish(s), sharding.pin_cache(s.cache, run.mesh))
