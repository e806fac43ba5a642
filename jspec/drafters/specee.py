"""SpecEE: the target exits early when per-layer predictors say its token is settled (lossy).

Nothing is drafted or verified (K = 0): each round decodes one token, and `draft` does the work.
For the token fed at position p:

1. Layers 0..N-1 run as usual; at depth N a trained early-exit head (Kangaroo's or EESD's, over
   its draft vocabulary) proposes C = 4 candidates for the next token: its top 4.
2. At every later depth d < L the final norm of the state times the candidates' LM-head rows
   gives C candidate logits; at the depths the schedule checks, a predictor (jspec.parts.predictors)
   reads them, and a row exits when it says > threshold and the depth's choice is a candidate.
   `choice` "candidates" takes the argmax among the candidates (always one: 4 dot products);
   "full" takes the full-vocabulary argmax (the paper's rule: a whole LM head per check).
3. Each remaining layer runs under `lax.cond`: while any row is still going, the layer runs for
   all rows and the exited rows keep their state (masked); once none is, only the layer's K/V
   projection runs. Either way an exited row's K/V at the deeper layers are those of its exit
   state, so every cache entry below a row's position is written ("fill"). The reference's way,
   "mask", computes nothing for skipped layers (zeros are written) and keeps a [L - N, B, S] map
   of which deep-layer entries exist, which later tokens' attention respects; a layer no row
   needs is then skipped outright. docs/methods.md measures the two. The cache is written
   between a layer's two conditionals (projection, then the rest), never inside one, where XLA
   would copy it every token.

Behind prompt lookup (`--lookup N`, jspec.drafters.lookup; `copies`) a round that copies a repeat is a
plain lossless verification: `feed` runs the copied tokens through layers 0..N-1 and the head's
cache, and `verify` runs the deep layers from those depth-N states at full depth, so every copied
token the target keeps is the full model's own (no exit in those rounds).

The exit threshold travels in `dparams` (a traced scalar), so a threshold sweep compiles once.
The exited row's token is its depth's choice (greedy), or a sample from the exit state's
full-vocabulary distribution. The schedule: the offline depths (where exits were frequent in
training) and, per row, e - 2, e, e + 2 around each of its last 5 exit depths e (the
reference's online rule). The prefill runs at full depth.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter, only_if
from jspec.engine.sampling import argmax
from jspec.engine.state import Draft
from jspec.model import decoder, numerics, weights
from jspec.parts import heads, predictors

RECENT = 5  # exit depths remembered per row for the online schedule
CHOICES = ("candidates", "full")
KV_MODES = ("fill", "mask")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    head: dict  # heads.draft_params of the head whose top 4 are the candidates
    kv: list  # kv_weights: per layer from the head's on, its K and V rows
    pred: dict  # the predictors (jspec.parts.predictors)
    threshold: jax.Array  # float32 scalar: a threshold sweep compiles once


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecEEState:
    head: decoder.KVCache  # the head's own cache
    # [B, 1, D] the emitting state; [B, K+1, D] behind lookup (room), where a copying round keeps
    # its fed tokens' depth-N states
    hidden: jax.Array
    token: jax.Array  # [B] the exit depth's choice
    exited: jax.Array  # [B] bool
    recent: jax.Array  # [B, RECENT] the last exit depths
    exits: jax.Array  # [B, L + 1] tokens per exit depth
    valid: jax.Array | None = None  # "mask": [B, L - N, S] which deep-layer entries exist
    fed: jax.Array | None = None  # behind lookup (`copies`): bool scalar, this round copied


@dataclasses.dataclass(frozen=True)
class SpecEE(Drafter):
    max_draft: int = 0
    exit_layer: int = 4  # N: the head reads the depth-N state; predictors cover depths N .. L-1
    schedule: tuple[int, ...] = ()  # offline checked depths
    choice: str = "candidates"
    kv: str = "fill"  # or "mask": skipped layers write nothing, later tokens attend only to what exists
    copies: bool = False  # behind prompt lookup: a round that copied verifies at full depth

    def begin(self, params, dparams, cfg, rows, cache):
        b, n = rows, self.exit_layer
        # Positions past a row's are masked anyway: every entry of "mask"'s map starts as present.
        valid = jnp.ones((b, cfg.num_layers - n, cache.length), bool) if self.kv == "mask" else None
        return SpecEEState(head=heads.Head().empty(dparams.head, cfg, b, cache.length),
                           hidden=jnp.zeros((b, 1, cfg.hidden_size), numerics.activation_dtype()),
                           token=jnp.zeros((b,), jnp.int32), exited=jnp.zeros((b,), bool),
                           recent=jnp.full((b, RECENT), -100, jnp.int32),
                           exits=jnp.zeros((b, cfg.num_layers + 1), jnp.int32), valid=valid,
                           fed=jnp.zeros((), bool) if self.copies else None)

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        n = self.exit_layer
        h, cache = decoder.run_layers(params, cfg, decoder.embed(params, tokens), positions, cache, range(n))
        head_kv = heads.Head().advance(dparams.head, cfg, h, positions, dstate.head)
        h, cache = decoder.run_layers(params, cfg, h, positions, cache, range(n, cfg.num_layers))
        return h, cache, dataclasses.replace(dstate, head=head_kv)

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        b, n, depth_count = s.last.shape[0], self.exit_layer, cfg.num_layers
        positions = s.length[:, None]  # [B, 1]
        cos, sin = decoder.rope(cfg, positions)
        h, cache = decoder.run_layers(params, cfg, decoder.embed(params, s.last[:, None]), positions, s.cache, range(n))
        cand, rows, head_kv = candidates(cfg, dparams.head, h, positions, s.dstate.head)
        k, v = list(cache.k), list(cache.v)
        live = ~s.done
        going = live
        token = jnp.zeros((b,), jnp.int32)
        depth = jnp.full((b,), depth_count, jnp.int32)
        prev = jnp.zeros((b, predictors.CANDIDATES), jnp.float32)
        recent = s.dstate.recent
        valid = []
        for d in range(n, depth_count):
            z = decoder.rms_norm(h[:, 0], params["final_norm"], cfg.rms_norm_eps)  # [B, D]
            cand_logits = jnp.einsum("bd,bcd->bc", z, rows, preferred_element_type=jnp.float32)
            x, prev = predictors.features(cand_logits, prev)
            checked = jnp.any((recent[:, :, None] + jnp.array([-2, 0, 2])) == d, axis=(1, 2))
            if d in self.schedule:
                checked = jnp.ones_like(checked)
            choice = jnp.take_along_axis(cand, jnp.argmax(cand_logits, axis=-1)[:, None], axis=1)[:, 0]
            ok = jnp.ones_like(checked)
            if self.choice == "full":
                choice = argmax(decoder.logits(params, cfg, h[:, 0]))
                ok = jnp.any(cand == choice[:, None], axis=1)
            leave = going & checked & ok & (predictors.score(dparams.pred, d - n, x) > dparams.threshold)
            token = jnp.where(leave, choice, token)
            depth = jnp.where(leave, d, depth)
            going = going & ~leave
            lp, anyone = params["layers"][d], jnp.any(going)
            project = functools.partial(decoder.qkv, cfg, lp, cos=cos, sin=sin)
            if self.kv == "mask":
                valid.append(s.dstate.valid[:, d - n].at[jnp.arange(b), s.length].set(going))
                skipped = functools.partial(decoder.zeros_of, project)
            else:
                skipped = functools.partial(_kv_only, cfg, lp, dparams.kv[d - n], cos, sin)
            q, new_k, new_v = jax.lax.cond(anyone, project, skipped, h)
            # Written between the conditionals, never inside one, so that XLA copies no cache.
            k[d], v[d] = decoder.write_kv(k[d], v[d], new_k, new_v, s.length)
            rest = functools.partial(_rest, cfg, lp, positions, k[d], v[d], valid[-1] if valid else None)
            h = jax.lax.cond(anyone, rest, lambda going, h, q: h, going, h, q)
        recent = jnp.where(live[:, None], jnp.concatenate([recent[:, 1:], depth[:, None]], axis=1), recent)
        exits = s.dstate.exits + live[:, None] * jax.nn.one_hot(depth, depth_count + 1, dtype=jnp.int32)
        # Finished rows count as exited: their token is dropped anyway, and they must not make
        # the batch pay for the LM head.
        dstate = dataclasses.replace(
            s.dstate, head=head_kv, hidden=s.dstate.hidden.at[:, 0].set(h[:, 0]), token=token,
            exited=(depth < depth_count) | ~live, recent=recent, exits=exits,
            valid=jnp.stack(valid, axis=1) if valid else s.dstate.valid,
            fed=None if s.dstate.fed is None else jnp.zeros((), bool))
        return Draft(jnp.zeros((b, 0), jnp.int32), None, jnp.zeros((b,), jnp.int32), decoder.KVCache(k, v),
                     dstate, s.cstate)

    def room(self, dstate, max_draft):
        """Room for a lookup round's K + 1 fed states."""
        pad = max_draft + 1 - dstate.hidden.shape[1]
        return dataclasses.replace(dstate, hidden=jnp.pad(dstate.hidden, ((0, 0), (0, pad), (0, 0))))

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        """A copying round: tokens [B, K+1] through layers 0..N-1 and the head's cache; verify then
        finishes them at full depth. No row exits, so target_logits is the full model's."""
        h, cache = decoder.run_layers(params, cfg, decoder.embed(params, tokens), positions, cache,
                                    range(self.exit_layer))
        head_kv = heads.Head().advance(dparams.head, cfg, h, positions, dstate.head)
        return cache, dataclasses.replace(dstate, head=head_kv, hidden=h, exited=jnp.zeros_like(dstate.exited),
                                          fed=jnp.ones((), bool))

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        """The emitting state of SpecEE's own round; after a lookup copy, the deep layers' states."""
        if not self.copies:
            return dstate.hidden, cache
        deep = range(self.exit_layer, cfg.num_layers)
        return only_if(dstate.fed, lambda c: decoder.run_layers(params, cfg, c[0], positions, c[1], deep, width),
                       (dstate.hidden, cache))

    def target_logits(self, params, dparams, cfg, h, dstate, sampling):
        """The exit state's distribution; a greedy exited row's token is its depth's choice, and
        when every row has one the LM head (a fifth of SmolLM2-135M's work per token) is skipped."""
        if not sampling.greedy:
            return decoder.logits(params, cfg, h)  # [B, W, V]
        forced = jnp.where(jnp.arange(cfg.vocab_size) == dstate.token[:, None], 0.0, -jnp.inf)[:, None]
        forced = jnp.broadcast_to(forced, (*h.shape[:2], cfg.vocab_size))
        exited = dstate.exited[:, None, None]
        return jax.lax.cond(jnp.all(exited), lambda: forced,
                            lambda: jnp.where(exited, forced, decoder.logits(params, cfg, h)))

    def stats(self, dstate) -> dict:
        return {"exits": dstate.exits}

    def record_stats(self, stats: dict) -> dict:
        """Tokens per exit depth (the last entry: full depth, no exit) -> the mean layers run per
        decoded token (the prefill's token, always at full depth, left out) and the histogram of
        the depths that exited."""
        exits = stats["exits"]
        decoded = sum(exits)
        mean = sum(d * c for d, c in enumerate(exits)) / decoded if decoded else None
        return {"mean_layers": round(mean, 3) if mean is not None else None,
                "exit_layers": {str(d): c for d, c in enumerate(exits) if c}}


def candidates(cfg, hp, h, positions, head_kv):
    """The head's top C tokens after the depth-N state h [B, 1, D]: (ids [B, C], their LM-head rows
    [B, C, D], the head's cache)."""
    x, head_kv = heads.block(cfg, hp, h, positions, head_kv)
    sub = decoder.linear(x[:, 0], hp["lm_head"], jnp.float32)  # [B, M]
    _, idx = jax.lax.top_k(sub, predictors.CANDIDATES)
    return hp["vocab"][idx], weights.as_float(weights.take_rows(hp["lm_head"], idx)), head_kv


def _rest(cfg, lp, positions, k, v, valid, going, h, q):
    """The layer after its projection, for every row; rows no longer going keep their state (their
    K/V, computed from it, are the fill; under "mask" they are written but marked missing)."""
    out = decoder.mlp_block(cfg, lp, decoder.attend(lp, h, q, k, v, positions, valid))
    return jnp.where(going[:, None, None], out, h)


def _kv_only(cfg, lp, kv, cos, sin, h):
    """Only the layer's K/V of h (the fill), when no row needs the layer's output; no queries."""
    _, k, v = decoder.qkv(cfg, {"attn_norm": lp["attn_norm"], **kv}, h, cos, sin)
    q = jnp.zeros((*h.shape[:2], cfg.num_kv_heads, cfg.group_size, cfg.head_dim), k.dtype)
    return q, k, v


def kv_weights(params, cfg, first: int) -> list[dict]:
    """Each layer from `first` on: the K and V rows of its QKV projection ([K*2*H, D], per kv
    group its k then its v), so the fill need not compute the queries."""
    g, hd = cfg.group_size, cfg.head_dim

    def kv_rows(a):  # of a matrix [N, D], or of a bias or an int8 matrix's scale [N]
        return a.reshape(cfg.num_kv_heads, g + 2, hd, *a.shape[1:])[:, g:].reshape(-1, *a.shape[1:])

    out = []
    for lp in params["layers"][first:]:
        entry = {"wqkv": lp["wqkv"].rows(kv_rows) if weights.is_int8(lp["wqkv"]) else kv_rows(lp["wqkv"])}
        if "bqkv" in lp:
            entry["bqkv"] = kv_rows(lp["bqkv"])
        out.append(entry)
    return out
