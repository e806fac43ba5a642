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
summary) and params/ (orbax). `load` refuses a head whose model does not match, or whose folder
holds other arrays than such a head's (`saved_arrays`) or non-finite weights, reads the
one-layer heads of format 2 (params `layer`, not `layers`) as they are, and interleaves the
w_gate_up rows of heads of formats 2 and 3, saved gate rows then up rows, as the model's now are
(jspec.model.layout.gate_up).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.convert import store
from jspec.errors import JspecError
from jspec.model import decoder, layout, sharding, weights
from jspec.model.config import ModelConfig
from jspec.parts import folder

KINDS = ("eesd", "kangaroo", "eagle")
# 4: w_gate_up interleaved, gate row i then up row i (jspec.model.layout.gate_up); 2 and 3 hold gate then up.
FOLDER = folder.PartFolder("head", "head.json", (2, 3, 4), "jspec train-head")
GATE_UP_INTERLEAVED = 4  # the first format whose w_gate_up rows are interleaved
# A head's weights split as the target's of the same names; its `lm_head` is the LM head's rows of
# the draft vocabulary [M, D], split over M like the full head. Its final `norm` [D] is replicated
# like the model's, and so is `vocab` [M]: the gather and the scatter of draft logits index with
# all of it on every device (M int32s, 32 KiB for 8,192 tokens). An EAGLE head's `fuse` [D, 2D]
# (state and embedding into its input) is replicated too: 1.3 MB at D = 576.
RULES = {**sharding.RULES, "norm": (None,), "vocab": (None,), "fuse": (None, None)}
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
    layers = [{k: jnp.array(weights.as_float(src[k])) for k in names if k in src}
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
    embedded = decoder.embed(params, tokens)
    return decoder.linear(jnp.concatenate([prev.astype(embedded.dtype), embedded], axis=-1), hp["fuse"])


def final_state(params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The target's last-layer states h [..., D] as an EAGLE head reads them: final-normed."""
    return decoder.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def block(cfg: ModelConfig, hp: dict, h: jax.Array, positions: jax.Array | None,
          kv: decoder.KVCache, siblings: bool = False):
    """The head's layers on h [B, T, D] (layer-N states) -> (normed features [B, T, D], kv);
    `siblings` as in decoder.attention_block."""
    cos, sin = decoder.rope_at(cfg, h, positions)
    ks, vs = [], []
    for lp, k, v in zip(hp["layers"], kv.k, kv.v):
        h, k, v = decoder.attention_block(cfg, lp, h, positions, cos, sin, k, v, siblings=siblings)
        if "w_down" in lp:
            h = decoder.mlp_block(cfg, lp, h)
        ks.append(k)
        vs.append(v)
    return decoder.rms_norm(h, hp["norm"], cfg.rms_norm_eps), decoder.KVCache(ks, vs)


def empty_kv(cfg: ModelConfig, hp: dict, batch: int, length: int) -> decoder.KVCache:
    """The head's own cache, one layer per head layer [B, S, KV, Dh], all empty."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: [jnp.zeros(shape, jnp.float32) for _ in hp["layers"]]  # noqa: E731
    return decoder.KVCache(zeros(), zeros())


def draft_params(params, hp: dict) -> dict:
    """What drafting needs: the head and the LM head's rows of its vocabulary [M, D]."""
    return {**hp, "lm_head": weights.take_rows(decoder.head_weight(params), hp["vocab"])}


def readout(cfg: ModelConfig, dparams: dict, h: jax.Array) -> jax.Array:
    """Draft logits [..., V] from the head's last layer's output h [..., D]: its final norm, then
    vocab_logits."""
    return vocab_logits(cfg, dparams, decoder.rms_norm(h, dparams["norm"], cfg.rms_norm_eps))


def vocab_logits(cfg: ModelConfig, dparams: dict, x: jax.Array) -> jax.Array:
    """Draft logits [..., V] from the head's normed features x [..., D]: the M draft-vocabulary
    rows scored, every other token at the lowest float."""
    sub = decoder.linear(x, dparams["lm_head"], jnp.float32)  # [..., M]
    full = jnp.full((*sub.shape[:-1], cfg.vocab_size), jnp.finfo(jnp.float32).min, jnp.float32)
    return full.at[..., dparams["vocab"]].set(sub)


@dataclasses.dataclass(frozen=True)
class Head:
    """The `head` hook of the early-exit drafter (jspec.drafters.early_exit), over `dparams` made
    by `draft_params`."""

    def empty(self, dparams, cfg, rows, length):
        """The head's cache before any prompt token (`advance` fills it)."""
        return empty_kv(cfg, dparams, rows, length)

    def logits(self, params, dparams, cfg, h, positions, kv):
        x, kv = block(cfg, dparams, h, positions, kv)
        return vocab_logits(cfg, dparams, x), kv

    def advance(self, dparams, cfg, h, positions, kv, siblings: bool = False):
        return block(cfg, dparams, h, positions, kv, siblings)[1]

    def readout(self, cfg, dparams, h):
        """Draft logits from the output of the head's last layer (MJSD's beams run its layers)."""
        return readout(cfg, dparams, h)


# -- saving and loading --------------------------------------------------------------------------

def save(path: str | os.PathLike, hp: dict, meta: dict) -> Path:
    """Write the head folder atomically (a temporary folder renamed into place)."""
    with folder.writing(path, FOLDER, meta) as tmp:
        store.save_params(tmp / "params", hp)
    return Path(path).absolute()


def read_meta(path: str | os.PathLike) -> dict:
    """The marker of the head at `path`, refused in one line unless it is a head's: its kind one of
    KINDS, its exit layer an integer, its model an object."""
    meta = folder.read_meta(path, FOLDER)
    where = Path(path) / FOLDER.marker
    if folder.require(meta, "kind", str, where) not in KINDS:
        raise JspecError(f"{where} is damaged: its 'kind' must be one of {', '.join(KINDS)}, not {meta['kind'][:40]!r}")
    folder.require(meta, "exit_layer", int, where)
    folder.require(meta, "model", dict, where)
    return meta


def saved_arrays(cfg: ModelConfig, meta: dict, saved) -> dict:
    """The arrays (jax.ShapeDtypeStructs) a head of `meta`'s kind and format holds for a model like
    `cfg`, with as many layers and as long a vocabulary as `saved` (its checkpoint's tree) has:
    each layer the target's sublayers of its kind, in float32, and vocab int32."""
    shapes = layout.param_shapes(cfg)["layers"][0]
    names = _ATTENTION + (_MLP if meta["kind"] != "kangaroo" else ())
    layer = {k: jax.ShapeDtypeStruct(shapes[k], jnp.float32) for k in names if k in shapes}
    saved = saved if isinstance(saved, dict) else {}
    vocab = saved.get("vocab")
    length = vocab.shape[0] if getattr(vocab, "shape", None) and len(vocab.shape) == 1 else 1
    depth = len(saved["layers"]) if isinstance(saved.get("layers"), list) and saved["layers"] else 1
    D = cfg.hidden_size
    want = {"layer": layer} if meta["format"] == 2 else {"layers": [layer] * depth}
    want.update(norm=jax.ShapeDtypeStruct((D,), jnp.float32), vocab=jax.ShapeDtypeStruct((length,), jnp.int32))
    if meta["kind"] == "eagle":
        want["fuse"] = jax.ShapeDtypeStruct((D, 2 * D), jnp.float32)
    return want


def load(path: str | os.PathLike, cfg: ModelConfig, mesh: Mesh | None = None) -> tuple[dict, dict]:
    """(head params, meta) of a saved head, refused unless it was trained for a model like `cfg`
    and holds what such a head holds: the arrays `saved_arrays` names, a layer count its exit layer
    allows, a draft vocabulary of this model's token ids, finite weights.

    The parameters land where the model lives: split over `mesh` by RULES when the model is
    sharded, on the default device otherwise, whatever devices the head was saved from. A head of
    an older format is read onto the default device, its layers' w_gate_up rows interleaved, and
    then placed.
    """
    path = Path(path).absolute()
    meta = read_meta(path)
    folder.check_model(meta["model"], cfg, f"head {path} was trained")
    kind, exit_layer = meta["kind"], meta["exit_layer"]
    if exit_layer not in exit_layers(kind, cfg):
        raise JspecError(f"head {path} exits at layer {exit_layer}, outside this model's layers")
    target = store.saved_tree(path / "params")
    folder.check_arrays(target, saved_arrays(cfg, meta, target), path / "params")
    depth = 1 if meta["format"] == 2 else len(target["layers"])
    most = cfg.num_layers - (0 if kind == "eagle" else exit_layer)
    if depth > most:
        raise JspecError(f"head {path} has {depth} layers; a {kind} head exiting at layer {exit_layer} has at "
                         f"most {most}")
    if not 1 <= target["vocab"].shape[0] <= cfg.vocab_size:
        raise JspecError(f"head {path} has a draft vocabulary of {target['vocab'].shape[0]} tokens; this model has "
                         f"{cfg.vocab_size}")
    old = meta["format"] < GATE_UP_INTERLEAVED
    shardings = sharding.shardings(target, mesh, RULES) if mesh is not None and not old else None
    with store.reading(path / "params"):
        hp = store.restore(path / "params", target, shardings)
    store.check_finite(hp, path / "params")
    if not bool(jnp.all((hp["vocab"] >= 0) & (hp["vocab"] < cfg.vocab_size))):
        raise JspecError(f"head {path} has draft-vocabulary ids outside this model's 0..{cfg.vocab_size - 1}")
    if meta["format"] == 2:
        hp = {"layers": [hp.pop("layer")], **hp}
    if old:
        hp["layers"] = [{**lp, "w_gate_up": layout.interleave_gate_up(lp["w_gate_up"])} if "w_gate_up" in lp else lp
                        for lp in hp["layers"]]
        hp = sharding.place(hp, mesh, RULES)
    return hp, meta


@folder.cached(FOLDER)
def _loaded(path: Path, cfg: ModelConfig, mesh: Mesh | None):
    return load(path, cfg, mesh)


def load_for(model, kind: str, path: str | os.PathLike | None = None) -> tuple[dict, dict]:
    """(head params, meta) a method drafts with: the head at `path`, else the one of `kind` shipped
    for the default model; refused unless it is of `kind`. Loaded once per folder version."""
    path = folder.resolve(model, path, kind, f"--method {kind} needs --head PATH: heads ship only for the "
                                            f"default model (train one with jspec train-head --kind {kind})")
    hp, meta = _loaded(path, model.cfg, model.mesh)
    if meta["kind"] != kind:
        raise JspecError(f"head {path} is of kind {meta['kind']}, not {kind}")
    return hp, meta


def drafting(model, hp: dict) -> dict:
    """What a drafter runs of head `hp` on `model` (draft_params), in the model's dtype (the
    vocabulary's ids stay int32), on the model's mesh. On an int8 model the head's own weights,
    trained in float, stay float32 (a few MB), and the LM head's rows stay int8 with their scales."""
    dtype = weights.FLOATS.get(model.dtype, jnp.float32)
    keep = lambda x: weights.is_int8(x) or x.dtype == jnp.int32  # noqa: E731
    dparams = jax.tree.map(lambda x: x if keep(x) else x.astype(dtype), draft_params(model.params, hp),
                           is_leaf=weights.is_int8)
    return sharding.place(dparams, model.mesh, RULES)
