"""Trained draft heads for self-speculation: EESD's exit layer, Kangaroo's adapter, EAGLE's head.

A head turns a state of the target into draft logits through the target's frozen LM head. Its
own parameters (D hidden, F MLP width, M draft vocabulary):

    eesd      layers = full decoder blocks (attention + MLP), norm [D]     (EESD's early-exit layer)
    kangaroo  layers = the attention half only (norm, attention, residual), norm [D]   (no MLP)
    eagle     layers = full decoder blocks, norm [D], fuse [D, 2D]          (EAGLE's feature head)
    all       vocab [M] int32: the draft-only vocabulary (FR-Spec), the M tokens the head may propose

EESD and Kangaroo read the layer-N state of the token being drafted from (exit layer N: the
target's first N layers run for every draft). An EAGLE head runs none of the target's layers: it
reads the target's last state (final-normed) at the previous position, which verification has
already computed, fused with the embedding of the token (`fuse_input`); its exit layer is recorded
as L, the model's depth. While drafting, a drafted token's own state is not known yet, and the
head's output for the previous draft stands in for it (jspec.drafters.eagle).

A head has one layer unless trained with more (`--head-layers`); its layers start as copies of the
target's layers N, N+1, ... (the first layers a draft skips), its norm as the final norm.
Drafting scores only the M vocabulary rows of the LM head, which is what makes a draft step cheap
(the full 49,152-token head is a fifth of SmolLM2-135M); tokens outside get zero draft
probability. Verification always uses the full head, so the output stays the target's.

The head attends over its own KV cache (one entry per head layer), filled from the prompt at prefill and one
position per draft step; like the target's cache, stale entries past a row's position are
masked, never copied.

A saved head is a folder: head.json (kind, exit layer, the model it was trained for, training
summary) and params/ (orbax). `load` refuses a head whose model does not match, and reads the
one-layer heads of format 2 (params `layer`, not `layers`) as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec import model, sharding
from jspec.config import ModelConfig
from jspec.convert import store
from jspec.errors import JspecError

KINDS = ("eesd", "kangaroo", "eagle")
FORMAT = 3
META = "head.json"  # what marks a head folder
_ATTENTION = ("attn_norm", "wqkv", "bqkv", "wo")
_MLP = ("mlp_norm", "w_gate_up", "w_down")


def exit_layers(kind: str, cfg: ModelConfig) -> range:
    """The exit layers a head of `kind` may record: 1 .. L-1, the layer whose state it reads, or L
    for an eagle head, which reads the last layer's."""
    return range(cfg.num_layers, cfg.num_layers + 1) if kind == "eagle" else range(1, cfg.num_layers)


def init(params, cfg: ModelConfig, kind: str, exit_layer: int, vocab: jax.Array, depth: int = 1) -> dict:
    """Head parameters: `depth` layers copied from the target's layers exit_layer, exit_layer + 1, ...
    (for an EAGLE head, exit_layer = L: its last `depth` layers) and its final norm. An EAGLE
    head's `fuse` starts as the sum of the state and the embedding."""
    if kind not in KINDS:
        raise JspecError(f"unknown head kind {kind!r}; choose one of {', '.join(KINDS)}")
    if exit_layer not in exit_layers(kind, cfg):
        raise JspecError(f"an eagle head reads the last layer's state: exit layer {cfg.num_layers}, not {exit_layer}"
                         if kind == "eagle" else
                         f"{kind} heads exit at layers 1 to {cfg.num_layers - 1}, not {exit_layer}")
    first = cfg.num_layers - depth if kind == "eagle" else exit_layer
    most = cfg.num_layers - (0 if kind == "eagle" else exit_layer)
    if not 1 <= depth <= most:
        raise JspecError(f"{kind} heads exiting at layer {exit_layer} have 1 to {most} layers, not {depth}")
    names = _ATTENTION + (_MLP if kind != "kangaroo" else ())
    layers = [{k: jnp.array(src[k], jnp.float32) for k in names if k in src}
              for src in params["layers"][first:first + depth]]
    hp = {"layers": layers, "norm": jnp.array(params["final_norm"], jnp.float32),
          "vocab": jnp.asarray(vocab, jnp.int32)}
    if kind == "eagle":
        eye = jnp.eye(cfg.hidden_size, dtype=jnp.float32)
        hp["fuse"] = jnp.concatenate([eye, eye], axis=1)
    return hp


def grow(params, cfg: ModelConfig, kind: str, exit_layer: int, hp: dict, depth: int) -> dict:
    """A trained head `hp` with layers appended up to `depth`, each what `init` would put there but
    with its output projections (wo, and w_down for a full block) zero: a residual branch that adds
    nothing, so the grown head computes exactly what `hp` did until training moves them."""
    have = len(hp["layers"])
    if have > depth:
        raise JspecError(f"a head of {have} layers cannot grow to {depth}")
    added = init(params, cfg, kind, exit_layer, hp["vocab"], depth)["layers"][have:]
    added = [{k: jnp.zeros_like(v) if k in ("wo", "w_down") else v for k, v in lp.items()} for lp in added]
    return {**hp, "layers": [*hp["layers"], *added]}


def fuse_input(params, hp: dict, tokens: jax.Array, prev: jax.Array) -> jax.Array:
    """An EAGLE head's input [B, T, D]: tokens [B, T] embedded, beside prev [B, T, D], the target's
    final-normed state at each token's previous position, through `fuse` [D, 2D]."""
    return model.linear(jnp.concatenate([prev.astype(jnp.float32), model.embed(params, tokens)], axis=-1),
                        hp["fuse"])


def final_state(params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The target's last-layer states h [..., D] as an EAGLE head reads them: final-normed."""
    return model.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def block(cfg: ModelConfig, hp: dict, h: jax.Array, positions: jax.Array | model.Packing | None, kv: dict,
          siblings: bool = False):
    """The head's layers on h [B, T, D] (layer-N states) -> (normed features [B, T, D], kv);
    `siblings` as in model.attention_block."""
    cos, sin = model.rope_at(cfg, h, positions)
    ks, vs = [], []
    for lp, k, v in zip(hp["layers"], kv["k"], kv["v"]):
        h, k, v = model.attention_block(cfg, lp, h, positions, cos, sin, k, v, siblings=siblings)
        if "w_down" in lp:
            h = model.mlp_block(cfg, lp, h)
        ks.append(k)
        vs.append(v)
    return model.rms_norm(h, hp["norm"], cfg.rms_norm_eps), {"k": ks, "v": vs}


def empty_kv(cfg: ModelConfig, hp: dict, batch: int, length: int) -> dict:
    """The head's cache [depth x [B, S, KV, Dh]], all empty."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: [jnp.zeros(shape, jnp.float32) for _ in hp["layers"]]
    return {"k": zeros(), "v": zeros()}


def draft_params(params, hp: dict) -> dict:
    """What drafting needs: the head and the LM head's rows of its vocabulary [M, D]."""
    return {**hp, "lm_head": jnp.take(model.head_weight(params), hp["vocab"], axis=0)}


def vocab_logits(cfg: ModelConfig, dparams: dict, x: jax.Array) -> jax.Array:
    """Draft logits [..., V] from the head's normed features x [..., D]: the M draft-vocabulary
    rows scored, every other token at the lowest float."""
    sub = model.linear(x, dparams["lm_head"], jnp.float32)  # [..., M]
    full = jnp.full((*sub.shape[:-1], cfg.vocab_size), jnp.finfo(jnp.float32).min, jnp.float32)
    return full.at[..., dparams["vocab"]].set(sub)


@dataclasses.dataclass(frozen=True)
class Head:
    """The `head` hook of the early-exit drafter (jspec.drafters.early_exit), over `dparams` made
    by `draft_params`."""

    def prefill(self, dparams, cfg, h, packing: model.Packing, cache_len):
        """The head's cache over the prompts, from the packed layer-N states h [R, T, D]."""
        _, kv = block(cfg, dparams, h, packing, empty_kv(cfg, dparams, packing.lens.shape[0], cache_len))
        return kv

    def logits(self, params, dparams, cfg, h, positions, kv):
        x, kv = block(cfg, dparams, h, positions, kv)
        return vocab_logits(cfg, dparams, x), kv

    def advance(self, dparams, cfg, h, positions, kv, siblings: bool = False):
        return block(cfg, dparams, h, positions, kv, siblings)[1]


# -- saving and loading --------------------------------------------------------------------------

def fingerprint(cfg: ModelConfig) -> dict:
    """What a head depends on: a head trained on one model is meaningless on another."""
    return {"arch": cfg.arch, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size}


def check_fingerprint(got: dict, cfg: ModelConfig, lead: str) -> None:
    """Refuse what was made for another model than `cfg` (a head, predictors, KNN-SSD sets), naming
    each difference: `lead` says what and how, e.g. "head H was trained"."""
    want = fingerprint(cfg)
    diff = [f"{k} {got.get(k)} (this model: {want.get(k)})" for k in sorted(want.keys() | got.keys())
            if got.get(k) != want.get(k)]
    if diff:
        raise JspecError(f"{lead} for another model: " + ", ".join(diff))


def save(path: str | os.PathLike, hp: dict, meta: dict) -> Path:
    """Write the head folder atomically (a temporary folder renamed into place)."""
    path = Path(path).absolute()
    with store.writing_folder(path, META) as tmp:
        store.save_params(tmp / "params", hp)
        (tmp / META).write_text(json.dumps({"format": FORMAT, **meta}, indent=1) + "\n")
    return path


def read_meta(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not (path / META).is_file():
        raise JspecError(f"{path} is not a jspec head (no head.json)")
    meta = json.loads((path / META).read_text())
    if meta.get("format") not in (2, FORMAT):
        raise JspecError(f"head {path} has format {meta.get('format')}; this jspec reads formats 2 and {FORMAT} "
                         "(train it again)")
    return meta


def load(path: str | os.PathLike, cfg: ModelConfig, mesh: Mesh | None = None) -> tuple[dict, dict]:
    """(head params, meta) of a saved head, refused unless it was trained for a model like `cfg`.

    The parameters land where the model lives: split over `mesh` by jspec.sharding's rules when
    the model is sharded, on the default device otherwise, whatever devices the head was saved from.
    """
    path = Path(path).absolute()
    meta = read_meta(path)
    check_fingerprint(meta["model"], cfg, f"head {path} was trained")
    if meta["exit_layer"] not in exit_layers(meta["kind"], cfg):
        raise JspecError(f"head {path} exits at layer {meta['exit_layer']}, outside this model's layers")
    target = store.saved_tree(path / "params")
    shardings = sharding.param_shardings(target, mesh) if mesh is not None else None
    hp = store.restore(path / "params", target, shardings)
    if meta["format"] == 2:
        hp = {"layers": [hp.pop("layer")], **hp}
    return hp, meta
