"""Decoding methods: a name, a drafter, a controller and their defaults.

Each method is a recipe over the one engine loop (jspec.engine.loop). Options not given fall
back to the method's defaults, which are documented in docs/methods.md.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec import heads, knn as knn_folder, sharding
from jspec.controllers import make_controller
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.early_exit import EarlyExit
from jspec.drafters.knn_ssd import KnnSsd
from jspec.drafters.layer_skip import LayerSkip
from jspec.drafters.ngram import NGram
from jspec.drafters.none import NoDraft
from jspec.errors import JspecError

METHODS = ("ar", "draft", "early-exit", "eesd", "kangaroo", "knn-ssd", "layer-skip", "ngram")
LOSSLESS = METHODS
DEFAULT_CONTROLLER = {"ar": "fixed", "draft": "fixed", "early-exit": "confidence", "eesd": "thompson",
                      "kangaroo": "confidence", "knn-ssd": "confidence", "layer-skip": "dv", "ngram": "fixed"}
MAX_DRAFT = 8
# KNN-SSD's reference drafts until a token below 0.8 confidence (kept) or 12 drafts.
KNN_MAX_DRAFT = 12
KNN_THRESHOLD = 0.8
HEAD_METHODS = heads.KINDS


# K fixes the verification width (K + 1 positions every round, whatever the controller stops at).
# On a CPU a forward over 2 or 3 positions costs 1.5 decode steps and over 5 about 2.1
# (benchmarks/forward_cost.py), so with the trained heads' agreement (about 0.45) K = 1 is the
# fastest there, a little ahead of K = 2 (docs/heads.md); accelerators verify a few positions for
# about one step's price.
def default_max_draft(method: str) -> int:
    if method in HEAD_METHODS:
        return 1 if jax.default_backend() == "cpu" else 4
    if method == "knn-ssd":
        return KNN_MAX_DRAFT
    return MAX_DRAFT


# What ships for the default model (trained heads, the searched layer-skip set): used when no
# --head / --skip-layers is given (see checkpoints/README.md).
SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints"
DEFAULT_MODEL_KEY = "smollm2-135m-instruct"


def shipped(model, name: str) -> Path | None:
    """checkpoints/<default model>/<name>, if `model` is the default model and it is there."""
    from jspec.convert.cache import DEFAULT_MODEL

    path = SHIPPED / DEFAULT_MODEL_KEY / name
    return path if model.name == DEFAULT_MODEL and path.exists() else None


def default_skip_layers(model) -> tuple[int, ...]:
    """The set searched for the default model (docs/methods.md, "Layer-skip default"); for other models every
    other layer of the middle half (first and last quarter kept), SWIFT's starting point."""
    searched = shipped(model, "layer-skip.json")
    if searched is not None:
        return tuple(json.loads(searched.read_text())["skip_layers"])
    n = model.cfg.num_layers
    return tuple(range(n // 4 + 1, n - n // 4, 2))


def build(method: str, model, *, max_draft: int | None = None, controller: str | None = None,
          exit_layer: int | None = None, skip_layers=None, draft_model=None, threshold: float | None = None,
          thompson_variant: str | None = None, draft_cost: float | None = None, head: str | None = None,
          knn: str | None = None, domain: str | None = None):
    """(drafter, drafter params, controller) for `method` on `model` (a jspec.api.Model)."""
    if method not in METHODS:
        raise JspecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    cfg = model.cfg
    k = default_max_draft(method) if max_draft is None else max_draft
    if method != "ar" and not 1 <= k <= 64:
        raise JspecError(f"--max-draft must be between 1 and 64, got {k}")
    if method == "knn-ssd" and threshold is None and controller in (None, "confidence"):
        threshold = KNN_THRESHOLD
    ctrl = make_controller(controller or DEFAULT_CONTROLLER[method], threshold=threshold,
                           variant=thompson_variant, cost=draft_cost)
    if head is not None and method not in HEAD_METHODS:
        raise JspecError(f"--head goes with --method {' or '.join(HEAD_METHODS)}")
    if method == "ar":
        return NoDraft(), (), ctrl
    if method == "ngram":
        return NGram(max_draft=k), (), ctrl
    if (knn is not None or domain is not None) and method != "knn-ssd":
        raise JspecError("--knn and --domain go with --method knn-ssd")
    if method == "knn-ssd":
        folder = _load_knn(model, knn)
        return KnnSsd(max_draft=k, domains=folder.names()), _placed(folder.dparams(cfg, domain), model), ctrl
    if method == "layer-skip":
        skip = default_skip_layers(model) if skip_layers is None else tuple(sorted(set(skip_layers)))
        bad = [i for i in skip if not 0 <= i < cfg.num_layers]
        if bad or len(skip) >= cfg.num_layers:
            raise JspecError(f"--skip-layers must name some (not all) of layers 0..{cfg.num_layers - 1}")
        return LayerSkip(max_draft=k, skip=skip), (), ctrl
    if method in HEAD_METHODS:
        hp, meta = _load_head(method, model, head)
        if exit_layer is not None and exit_layer != meta["exit_layer"]:
            raise JspecError(f"the {method} head exits at layer {meta['exit_layer']}, not --exit-layer {exit_layer}")
        dtype = model.params["embed"].dtype
        dparams = jax.tree.map(lambda x: x if x.dtype == jnp.int32 else x.astype(dtype),
                               heads.draft_params(model.params, hp))
        drafter = EarlyExit(max_draft=k, exit_layer=meta["exit_layer"], head=heads.Head())
        return drafter, _placed(dparams, model), ctrl
    if method == "early-exit":
        n = cfg.num_layers // 4 if exit_layer is None else exit_layer
        if not 1 <= n < cfg.num_layers:
            raise JspecError(f"--exit-layer must be between 1 and {cfg.num_layers - 1}, got {n}")
        return EarlyExit(max_draft=k, exit_layer=n), (), ctrl
    if draft_model is None:
        raise JspecError("--method draft needs --draft-model")
    if draft_model.cfg.vocab_size != cfg.vocab_size:
        raise JspecError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) differs from the "
                         f"target's ({cfg.vocab_size}); they must share a tokenizer")
    return DraftModel(draft_cfg=draft_model.cfg, max_draft=k), _placed(draft_model.params, model), ctrl


def _placed(dparams, model):
    """Drafter parameters on the target's mesh, split by the same rules (jit refuses arguments on
    different devices): a draft model is loaded on its own, and a head's gathered LM head rows
    come out replicated."""
    if model.mesh is None:
        return dparams
    return jax.device_put(dparams, sharding.param_shardings(dparams, model.mesh))


@functools.lru_cache(maxsize=8)
def _read_head(path: str, stamp: int | None, cfg, mesh):
    """heads.load, once per head folder, version and mesh: every generate call builds its method."""
    return heads.load(path, cfg, mesh)


def _load_head(method: str, model, head: str | None):
    path = head or shipped(model, method)
    if path is None:
        raise JspecError(f"--method {method} needs --head PATH: heads ship only for the default model "
                         f"(train one with jspec train-head --kind {method})")
    if not Path(path).exists():
        raise JspecError(f"head {path} does not exist")
    stamp = (Path(path) / "head.json").stat().st_mtime_ns if (Path(path) / "head.json").exists() else None
    hp, meta = _read_head(str(Path(path).resolve()), stamp, model.cfg, model.mesh)
    if meta["kind"] != method:
        raise JspecError(f"head {path} is a {meta['kind']} head, not a {method} head")
    return hp, meta


@functools.lru_cache(maxsize=8)
def _read_knn(path: str, stamp: int) -> knn_folder.Knn:
    return knn_folder.load(path)


def _load_knn(model, path: str | None) -> knn_folder.Knn:
    path = path or shipped(model, "knn-ssd")
    if path is None:
        raise JspecError("--method knn-ssd needs --knn PATH: anchors and skip sets ship only for the default "
                         "model (make them with jspec search-skip and jspec fit-knn)")
    meta = Path(path) / "knn.json"
    return _read_knn(str(Path(path).resolve()), meta.stat().st_mtime_ns if meta.exists() else 0)
