"""The Llama-family decoder (Llama / SmolLM2, Mistral, Qwen2) as pure functions over a parameter pytree.

Parameters are a dict; `layers` is a list with one dict per decoder layer (D hidden, V vocab,
K kv heads, G query heads per kv head, H head dim, F MLP width):

    embed        [V, D]
    layers[i]    attn_norm [D], mlp_norm [D]
                 wqkv [K*(G+2)*H, D]   per kv group its G query heads, then its k and v: one
                                       matmul, and a K-way split of the rows keeps a group together
                 bqkv [K*(G+2)*H]      (Qwen2 only)
                 wo [D, K*G*H], w_down [D, F]
                 w_gate_up [2*F, D]    gate and up interleaved, row 2i gate row i and 2i+1 up
                                       row i: a split of the rows over `model` keeps each unit's
                                       pair together, and the MLP runs without moving activations
    final_norm   [D]
    lm_head      [V, D]                (untied models only: a tied model's head is `embed`)

Every matrix keeps Hugging Face's [out, in] orientation and is read by `linear`.

Why a list and 2-D weights rather than arrays stacked for `lax.scan`: XLA on CPU copies every
dynamically sliced (scanned) weight and every weight whose dot needs a reshape before it can
multiply, which doubled the time of a decode step (45 ms vs 23 ms for SmolLM2-135M here). With
one buffer per weight the dots read parameters in place; activations are reshaped instead.
Running a prefix of the layers (early exit) or a subset (layer skipping) is a static choice of
list entries, so it costs nothing either.

Every forward reads and writes a preallocated `KVCache` at per-row positions: row b's T new
tokens sit at positions[b] (contiguous), and a query at position p sees cache entries 0..p.
Entries beyond a row's position are stale (padding, rejected drafts) and are never attended to,
which is what makes speculative rollback free. A prompt goes in the same way, a chunk of
positions at a time (jspec.engine.loop.Run.start); whole texts from position 0 (positions None:
training, scoring) attend in blocks instead (attention.prefill_attention).

Because the LM head is [V, D] like the rest, a tied model uses its embedding and holds no second
copy (28M parameters, a fifth of SmolLM2-135M).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

from jspec.model import kernels, numerics, weights
from jspec.model.kernels import gpu_int8
from jspec.model.attention import attention, block_attention, prefill_attention
from jspec.model.config import ModelConfig, rope_inv_freq

Params = dict
SMALL_ROWS = 64  # from 2 to this many float32 rows on a CPU, linear multiplies and sums instead of a matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, S, K, H]
    v: list[jax.Array]  # per layer [B, S, K, H]
    # [n]: row i of a forward of n rows reads and writes the cache's row rows[i] (a continuous
    # batch's admit prefills new prompts in place, into their slots: jspec.engine.slots); None:
    # row i is row i.
    rows: jax.Array | None = None

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        return cls([jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
                   [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)])

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    @property
    def dtype(self):
        return self.k[0].dtype


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * x32.astype(x.dtype)).astype(x.dtype)


def rope(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, H] for integer positions [B, T] (rotate-half layout, as HF)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rope_at(cfg: ModelConfig, h: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """rope() for h [B, T, ...] at positions [B, T], or 0..T-1 in every row when None."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(h.shape[1], dtype=jnp.int32), h.shape[:2])
    return rope(cfg, positions)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of x [..., H] at the angles of cos, sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array,
             rows: jax.Array | None = None):
    """One layer's cache k_cache, v_cache [B, S, K, H] <- k, v [B, T, K, H] at per-row offsets
    start [B] (into cache rows `rows` [B] when given: KVCache.rows). Never call it inside a
    conditional's branch: XLA would copy the cache (docs/design.md, "No cache inside a conditional")."""
    if rows is None:
        put = jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0)))
        return put(k_cache, k, start), put(v_cache, v, start)
    at = (rows[:, None], start[:, None] + jnp.arange(k.shape[1]))
    return k_cache.at[at].set(k.astype(k_cache.dtype)), v_cache.at[at].set(v.astype(v_cache.dtype))


def move_entry(ks: list[jax.Array], vs: list[jax.Array], src: jax.Array, dst: jax.Array):
    """Per layer, each row b's cache entry at position src[b] copied to dst[b]: a candidate's
    entries moved to where the accepted path puts it (jspec.engine.loop). (ks, vs) of [B, S, K, H]."""
    take = lambda c: jnp.take_along_axis(c, src[:, None, None, None], axis=1)  # noqa: E731
    moved = [write_kv(k, v, take(k), take(v), dst) for k, v in zip(ks, vs)]
    return [k for k, _ in moved], [v for _, v in moved]


def qkv(cfg: ModelConfig, lp: Mapping[str, jax.Array], h: jax.Array, cos: jax.Array, sin: jax.Array):
    """The attention block's input side: h [B, T, D] -> rotated queries [B, T, K, G, H], rotated
    keys and values [B, T, K, H]. G is what lp's projection holds: a projection of only the K and V
    rows (SpecEE's fill) gives G = 0 queries."""
    g = lp["wqkv"].shape[0] // (cfg.num_kv_heads * cfg.head_dim) - 2
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = linear(x, lp["wqkv"])
    if "bqkv" in lp:
        qkv = (qkv + lp["bqkv"]).astype(qkv.dtype)
    qkv = qkv.reshape(*qkv.shape[:2], cfg.num_kv_heads, g + 2, cfg.head_dim)
    q = rotate(qkv[:, :, :, :g], cos[:, :, None, None], sin[:, :, None, None])
    k = rotate(qkv[:, :, :, g], cos[:, :, None], sin[:, :, None])
    return q, k, qkv[:, :, :, g + 1]


def attend(lp: Mapping[str, jax.Array], h: jax.Array, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
           positions: jax.Array, valid: jax.Array | None = None, siblings: bool = False,
           rows: jax.Array | None = None) -> jax.Array:
    """The attention block's output side, residual included: queries q at positions [B, T] over a
    cache that already holds their own keys and values (in its rows `rows`: KVCache.rows) -> h
    [B, T, D]. `siblings` lets the block hold alternatives (block_attention)."""
    out = (block_attention if siblings else attention)(q, k_cache, v_cache, positions, valid, rows=rows)
    return h + linear(out.reshape(*out.shape[:2], -1), lp["wo"], split_depth=True)


def attention_block(cfg: ModelConfig, lp: Mapping[str, jax.Array], h: jax.Array,
                    positions: jax.Array | None, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
                    v_cache: jax.Array, valid: jax.Array | None = None, siblings: bool = False,
                    rows: jax.Array | None = None):
    """The attention half of a decoder block, residual included: h [B, T, D] -> h, k_cache, v_cache.
    Positions None: h is whole texts, from position 0 of each row (training, scoring).
    `siblings`: the T tokens may be alternatives, at the same position (block_attention).
    `rows`: the cache rows h's rows are (KVCache.rows)."""
    q, k, v = qkv(cfg, lp, h, cos, sin)
    if positions is None:
        out = prefill_attention(q, k, v)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, jnp.zeros(k_cache.shape[:1], jnp.int32))
        return h + linear(out.reshape(*out.shape[:2], -1), lp["wo"], split_depth=True), k_cache, v_cache
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, positions[:, 0], rows)
    return attend(lp, h, q, k_cache, v_cache, positions, valid, siblings, rows), k_cache, v_cache


def mlp_block(cfg: ModelConfig, lp: Mapping[str, jax.Array], h: jax.Array) -> jax.Array:
    """The MLP half of a decoder block, residual included."""
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    gate_up = linear(x, lp["w_gate_up"])  # interleaved (jspec.model.layout.gate_up): local on every shard
    gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
    gate, up = gate_up[..., 0], gate_up[..., 1]
    return h + linear(jax.nn.silu(gate) * up, lp["w_down"], split_depth=True)


def decoder_layer(cfg: ModelConfig, lp: Mapping[str, jax.Array], h: jax.Array, positions: jax.Array | None,
                  cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                  valid: jax.Array | None = None, width: "Width | None" = None, siblings: bool = False,
                  rows: jax.Array | None = None):
    """One pre-norm decoder block. h [B, T, D]; k_cache, v_cache [B, S, K, H] of this layer. With
    a `width`, only its leading positions are computed (their outputs padded back to T);
    `siblings` and `rows` as in attention_block."""
    if width is None:
        h, k_cache, v_cache = attention_block(cfg, lp, h, positions, cos, sin, k_cache, v_cache, valid, siblings, rows)
        return mlp_block(cfg, lp, h), k_cache, v_cache
    q, k, v = width.run(functools.partial(qkv, cfg, lp), h, cos, sin)
    # The cache is written here, between the two branches, never inside one: a conditional
    # whose branch updates the cache makes XLA copy every layer's cache (docs/design.md).
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, positions[:, 0], rows)
    h = width.run(lambda h, q, pos: mlp_block(cfg, lp, attend(lp, h, q, k_cache, v_cache, pos, valid, siblings, rows)),
                  h, q, positions)
    return h, k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class Width:
    """Which leading positions of a block of W = sizes[-1] a forward computes: sizes[index] (sizes
    static and ascending, index traced). Each size is one branch of a lax.switch; a verification
    whose drafts stopped early runs the narrowest that holds them (jspec.engine.loop). The
    positions past the size come back as zeros, and the cache entries written there as zeros too,
    which nothing reads: a later round writes from its own first position on."""

    sizes: tuple[int, ...]
    index: jax.Array

    def run(self, fn, *xs):
        """fn over xs [B, W, ...] at the chosen size -> its outputs padded back to [B, W, ...]."""
        def padded(*xs):
            pad = lambda y: jnp.pad(y, [(0, 0), (0, self.sizes[-1] - y.shape[1])] + [(0, 0)] * (y.ndim - 2))  # noqa: E731
            return jax.tree.map(pad, fn(*xs))

        return self.apply(padded, *xs)

    def apply(self, fn, *xs):
        """fn over xs [B, W, ...] at the chosen size -> its outputs as they are, which must have the
        same shapes at every size (what a round decides from its verification: jspec.engine.loop)."""
        if len(self.sizes) == 1:
            return fn(*xs)
        return jax.lax.switch(self.index, [functools.partial(_leading, fn, size) for size in self.sizes], *xs)


def _leading(fn, size: int, *xs):
    return fn(*(x[:, :size] for x in xs))


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """The residual stream, in the activation dtype of the program being traced: float32 unless
    its Numerics say otherwise (jspec.model.numerics says why). Every later activation keeps it."""
    return weights.as_float(weights.take_rows(params["embed"], tokens), numerics.activation_dtype())


def run_layers(params: Params, cfg: ModelConfig, h: jax.Array, positions: jax.Array | None, cache: KVCache,
               layers: Sequence[int] | None = None, width: Width | None = None, siblings: bool = False):
    """Run the given layers (default: all, in order) on hidden states h [B, T, D] at positions
    [B, T] (None: whole texts, as in attention_block). Layers not listed neither change
    h nor write the cache: a contiguous range is an early exit, a range with holes is layer
    skipping. A `width` computes only leading positions (decoder_layer); `siblings` lets the T
    tokens be alternatives (attention_block). Returns the new h and cache."""
    cos, sin = rope_at(cfg, h, positions)
    k, v = list(cache.k), list(cache.v)
    for i in range(cfg.num_layers) if layers is None else layers:
        h, k[i], v[i] = decoder_layer(cfg, params["layers"][i], h, positions, cos, sin, k[i], v[i], width=width,
                                      siblings=siblings, rows=cache.rows)
    return h, KVCache(k, v, cache.rows)


def run_masked_layers(params: Params, cfg: ModelConfig, h: jax.Array, positions: jax.Array, cache: KVCache,
                      skip: jax.Array):
    """run_layers over every layer with sublayers skipped per row, as data: skip [B, 2, L] bool,
    [:, 0] the attention and [:, 1] the MLP of each layer. A skipped sublayer is the identity on
    the residual stream. It is computed only when some row needs it (lax.cond); the rows that
    skip it keep their input. Its cache entries at these positions are written either way (zeros
    when no row computed them), and never read by a row that skips them: only a verification
    reads them, after overwriting them. Being data, a new skip set compiles nothing."""
    cos, sin = rope_at(cfg, h, positions)
    k, v = list(cache.k), list(cache.v)
    for i, lp in enumerate(params["layers"]):
        project = functools.partial(qkv, cfg, lp, cos=cos, sin=sin)
        q, new_k, new_v = jax.lax.cond(jnp.all(skip[:, 0, i]), functools.partial(zeros_of, project), project, h)
        # Written between the conditionals, as in decoder_layer, so that XLA copies no cache.
        k[i], v[i] = write_kv(k[i], v[i], new_k, new_v, positions[:, 0], cache.rows)
        h = _sublayer(skip[:, 0, i], lambda h, q, lp=lp, kc=k[i], vc=v[i]: attend(lp, h, q, kc, vc, positions,
                                                                                   rows=cache.rows), h, q)
        h = _sublayer(skip[:, 1, i], lambda h, lp=lp: mlp_block(cfg, lp, h), h)
    return h, KVCache(k, v, cache.rows)


def zeros_of(fn, *xs):
    """Zeros shaped as fn(*xs)'s outputs, computing nothing: a skipped branch's result."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(fn, *xs))


def _sublayer(skip_rows: jax.Array, fn, h: jax.Array, *rest) -> jax.Array:
    """fn(h, *rest) -> h, skipped when every row's skip_rows [B] is set, and each skipping row's h
    kept as it was."""
    def run(h, *rest):
        out = fn(h, *rest)
        return out if h.shape[0] == 1 else jnp.where(skip_rows[:, None, None], h, out)

    return jax.lax.cond(jnp.all(skip_rows), lambda h, *rest: h, run, h, *rest)


def linear(x: jax.Array, w, dtype=None, split_depth: bool = False) -> jax.Array:
    """x [..., D] times w [N, D] transposed -> [..., N], accumulated in float32 and returned in
    `dtype` (default: x's). Every weight matrix, the LM head included, is read this way; w is a
    float array or an `Int8` (jspec.model.weights), whose values are multiplied as stored and
    whose scale multiplies each output after its sum. `split_depth` says the mesh splits w's D
    rather than its N (a projection out: jspec.model.sharding.RULES), for the one product that
    splits itself (the GPU's int8 kernel); XLA's products follow the weight's own sharding.

    A bfloat16 or int8 weight times float32 rows is widened as it is read. On a CPU a few rows (a
    decode step, a verification, a step of a batch) take a faster path than XLA's matmul, which
    for so few rows repacks (or, for a narrower weight, converts) the whole weight first
    (docs/design.md): jspec's native kernel for the float32 rows where it wins
    (jspec/model/kernels, where it is built), else a multiply-and-sum over D, which XLA fuses into
    one loop over w. Their rounding differs from the matmul's near 1e-6 of a logit, which has
    not changed a token in any measured run. On a GPU an int8 weight goes through jspec's Pallas
    kernel (kernels/gpu_int8.py), which widens each tile of it in registers."""
    dtype = x.dtype if dtype is None else dtype
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, -1)
    if kernels.takes(x, w, rows):
        return kernels.matmul(flat, w).reshape(*x.shape[:-1], -1).astype(dtype)
    values = w.values if weights.is_int8(w) else w
    # A float32 row alone takes XLA's matrix-vector kernel; a narrower weight needs the
    # multiply-and-sum even then, as XLA's product with it converts the whole weight first.
    if (2 <= rows or values.dtype != x.dtype) and rows <= SMALL_ROWS and numerics.platform() == "cpu":
        # Rows major, so the result needs no transpose: faster than [N, rows] transposed after.
        out = jnp.sum(values[None].astype(jnp.float32) * flat[:, None].astype(jnp.float32), axis=-1)
    elif weights.is_int8(w) and kernels.takes_gpu_int8(flat, values, split_depth):
        # jax's CUDA lowering would convert the values before the dot, into a widened copy.
        out = gpu_int8.matmul(flat, values, split_depth)
    elif weights.is_int8(w):
        # The int8 values go to the dot as they are: a TPU multiplies mixed operands so.
        out = jax.lax.dot_general(flat, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("rd,nd->rn", flat, w, preferred_element_type=jnp.float32)
    if weights.is_int8(w):
        out = out * w.scale
    return out.reshape(*x.shape[:-1], -1).astype(dtype)


def head_weight(params: Params) -> jax.Array:
    """The LM head [V, D]; a tied model's is its embedding."""
    return params.get("lm_head", params["embed"])


def logits(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Final norm and LM head: h [..., D] -> float32 logits [..., V]."""
    return linear(rms_norm(h, params["final_norm"], cfg.rms_norm_eps), head_weight(params), jnp.float32)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None,
            cache: KVCache, width: Width | None = None, siblings: bool = False):
    """The whole model: tokens [B, T] at positions [B, T] (or None, as in run_layers) ->
    hidden [B, T, D] (pre-norm), cache."""
    return run_layers(params, cfg, embed(params, tokens), positions, cache, width=width, siblings=siblings)


def prompt_last(x: jax.Array, positions: jax.Array, lens: jax.Array, before: jax.Array) -> jax.Array:
    """What a chunk of prompts leaves of x [B, C, ...] (computed at positions [B, C], consecutive;
    prompt lengths lens [B]): each row's value at its prompt's last token if the chunk holds it,
    at the chunk's last if the prompt goes on past it, and `before` [B, ...] (what the chunks
    before left) if the prompt ended earlier."""
    at = jnp.minimum(lens - 1 - positions[:, 0], x.shape[1] - 1)
    taken = jnp.take_along_axis(x, jnp.maximum(at, 0).reshape(-1, *[1] * (x.ndim - 1)), axis=1)[:, 0]
    return jnp.where((at >= 0).reshape(-1, *[1] * (x.ndim - 2)), taken, before.astype(x.dtype))
