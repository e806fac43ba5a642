"""Decoding methods: a name, a drafter, a controller and their defaults.

Each method is a recipe over the one engine loop (jspec.engine.loop). Options not given fall
back to the method's defaults, which are documented in docs/methods.md.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec import datastore as datastore_io, heads, knn as knn_folder, sharding
from jspec import predictors as predictors_io
from jspec.controllers import make_controller
from jspec.drafters.beam import Beam
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle import Eagle
from jspec.drafters.early_exit import EarlyExit
from jspec.drafters.knn_ssd import KnnSsd
from jspec.drafters.layer_skip import LayerSkip
from jspec.drafters.lookup import Lookup
from jspec.drafters import specee
from jspec.drafters.ngram import MAX_NGRAM, NGram
from jspec.drafters.none import NoDraft
from jspec.errors import JspecError

LOSSLESS = ("ar", "draft", "eagle", "early-exit", "eesd", "kangaroo", "knn-ssd", "layer-skip", "ngram")
LOSSY = ("mjsd", "specee")  # output differs from ar's: jspec bench reports their quality (jspec.quality)
METHODS = LOSSLESS + LOSSY
DEFAULT_CONTROLLER = {"ar": "fixed", "draft": "fixed", "eagle": "confidence", "early-exit": "confidence",
                      "eesd": "thompson", "kangaroo": "confidence", "knn-ssd": "confidence", "layer-skip": "dv",
                      "ngram": "fixed", "mjsd": "fixed", "specee": "fixed"}
MAX_DRAFT = 8
# MJSD drafts K = 4 tokens in W = 4 beams with tau = 0.5, the reference's settings (docs/methods.md).
MJSD_MAX_DRAFT = 4
BEAM_WIDTH = 4
ACCEPT_THRESHOLD = 0.5
# KNN-SSD's reference drafts until a token below 0.8 confidence (kept) or 12 drafts.
KNN_MAX_DRAFT = 12
KNN_THRESHOLD = 0.8
HEAD_METHODS = heads.KINDS
# Prompt lookup in front of a model drafter (--lookup): copy a repeat of at least 2 tokens, up to
# 4 tokens at a time (docs/methods.md, "Prompt lookup first").
LOOKUP_METHODS = ("draft", "eagle", "early-exit", "eesd", "kangaroo", "knn-ssd", "layer-skip", "specee")
LOOKUP_MIN_NGRAM = 2
LOOKUP_MAX_DRAFT = 4
# --candidates C: a head's top C for one position, verified side by side (jspec.drafters.base).
CANDIDATE_METHODS = ("eagle", "early-exit", "eesd", "kangaroo")
MAX_CANDIDATES = 16
SPECEE_CHOICES = specee.CHOICES
_DRAFTING = tuple(m for m in METHODS if m not in ("ar", "specee"))  # specee exits early; it drafts nothing
# Which methods take each of build's options: any other is refused, so that no run silently
# measures something other than what it names (jspec bench lists a method's options from here).
TAKES = {"max_draft": _DRAFTING, "controller": _DRAFTING, "threshold": _DRAFTING, "thompson_variant": _DRAFTING,
         "draft_cost": _DRAFTING, "exit_layer": ("early-exit", "mjsd") + HEAD_METHODS,
         "skip_layers": ("layer-skip",), "draft_model": ("draft", "mjsd"), "head": HEAD_METHODS + ("mjsd", "specee"),
         "beam_width": ("mjsd",), "accept_threshold": ("mjsd",), "tree": ("mjsd",),
         "exit_threshold": ("specee",), "predictors": ("specee",), "exit_choice": ("specee",),
         "exit_kv": ("specee",), "knn": ("knn-ssd",), "domain": ("knn-ssd",),
         "lookup": ("ngram",) + LOOKUP_METHODS, "lookup_draft": LOOKUP_METHODS,
         "datastore": ("ngram",) + LOOKUP_METHODS, "candidates": CANDIDATE_METHODS}
API_ONLY = ("exit_choice", "exit_kv")  # options the command line has no flag for
# The reference's 0.5 lets SmolLM2-135M's predictors (held-out precision 0.57-0.70 below depth 21)
# exit on tokens the full model would not write: output NLL 3.5x ar's. 0.9 costs +14-15% in every
# run; 0.95 +4.1-4.4% alone and -1.0 to -2.3% behind --lookup 2 (docs/benchmarks.md, "SpecEE"),
# the one setting measured within SpecEE's quality bound of +5%.
EXIT_THRESHOLD = 0.95


# K fixes the widest verification (a round verifies its longest live draft, rounded
# up to 1 + a power of two: jspec.engine.loop.verify_widths). On a CPU, before the native kernel,
# a forward over 2 or 3 positions cost 1.5 decode steps and over 5 about 2.1
# (benchmarks/forward_cost.py), so with the trained heads' agreement (about 0.45) K = 1 was the
# fastest there, a little ahead of K = 2 (docs/heads.md). With the native kernels
# (2 positions at 1.06-1.28 steps) K = 1 is still the fastest, now by 0.13-0.17x `ar` over K = 2
# (docs/heads.md, "Draft length"), and with verification as wide as the draft K = 4 under the
# heads' controllers still measured 1.07-1.10x against K = 1's 1.20x (docs/benchmarks.md, "A
# verification as wide as the round's drafts"). With the kernel prefetching into L2 (2026-11-27) a
# verification of 2-4 drafts costs about 1.1 steps, and K = 2 and 4 still lost 0-0.06x to K = 1
# (docs/benchmarks.md, "Prefetching into L2"). Accelerators verify a few positions for about one
# step's price.
def default_max_draft(method: str) -> int:
    if method in HEAD_METHODS:
        return 1 if jax.default_backend() == "cpu" else 4
    if method == "mjsd":
        return MJSD_MAX_DRAFT
    if method == "knn-ssd":
        return KNN_MAX_DRAFT
    if method == "ngram":  # as prompt lookup in front of a drafter (docs/benchmarks.md, "n-gram defaults")
        return LOOKUP_MAX_DRAFT if jax.default_backend() == "cpu" else MAX_DRAFT
    return MAX_DRAFT


# What ships for the default model (trained heads, the searched layer-skip set): used when no
# --head / --skip-layers is given (see jspec/checkpoints/README.md).
SHIPPED = Path(__file__).resolve().parent / "checkpoints"  # package data: in every install
DEFAULT_MODEL_KEY = "smollm2-135m-instruct"


def shipped(model, name: str) -> Path | None:
    """jspec/checkpoints/<default model>/<name>, if `model` is the default model and it is there."""
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
          exit_layer: int | None = None, skip_layers: Sequence[int] | None = None, draft_model=None,
          threshold: float | None = None, thompson_variant: str | None = None, draft_cost: float | None = None,
          head: str | None = None, beam_width: int | None = None, accept_threshold: float | None = None,
          tree: bool | None = None, exit_threshold: float | None = None, predictors: str | None = None,
          exit_choice: str | None = None, exit_kv: str | None = None, knn: str | None = None,
          domain: str | None = None, lookup: int | None = None, lookup_draft: int | None = None,
          datastore: str | None = None, candidates: int | None = None):
    """(drafter, drafter params, controller) for `method` on `model` (a jspec.api.Model)."""
    if method not in METHODS:
        raise JspecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    given = {k: v for k, v in locals().items() if k in TAKES and v is not None}
    check_belongs(method, given)
    check_types(given)
    if lookup_draft is not None and lookup is None:
        raise JspecError("--lookup-draft goes with --lookup N")
    if method == "ngram":  # n-gram drafting is lookup: --lookup is its shortest repeat
        ngram, lookup = _shortest_repeat(lookup), None
    if lookup is not None:
        options = {k: v for k, v in given.items() if k not in ("lookup", "lookup_draft", "datastore")}
        drafter, dparams, ctrl = build(method, model, **options)
        lookup_first = _lookup_first(drafter, lookup, lookup_draft)
        return lookup_first, {"inner": dparams, "table": _load_datastore(model, datastore)}, ctrl
    if datastore is not None and method != "ngram":
        raise JspecError("--datastore goes with --method ngram or with --lookup")
    if candidates is not None:
        _check_candidates(candidates, max_draft, controller)
        max_draft = candidates
    cfg = model.cfg
    k = default_max_draft(method) if max_draft is None else max_draft
    if method != "ar" and not 1 <= k <= 64:
        raise JspecError(f"--max-draft must be between 1 and 64, got {k}")
    if method == "knn-ssd" and threshold is None and controller in (None, "confidence"):
        threshold = KNN_THRESHOLD
    ctrl = make_controller(controller or DEFAULT_CONTROLLER[method], threshold=threshold,
                           variant=thompson_variant, cost=draft_cost)
    if method == "mjsd":
        if controller not in (None, "fixed"):
            raise JspecError("--method mjsd always drafts --max-draft tokens: it takes no --controller")
        return _mjsd(model, k, exit_layer, draft_model, head, beam_width, accept_threshold, tree)
    if method == "specee":
        return _build_specee(model, head, predictors, exit_threshold, exit_choice, exit_kv) + (ctrl,)
    if method == "ar":
        return NoDraft(), (), ctrl
    if method == "ngram":
        return NGram(max_draft=k, min_ngram=ngram), _load_datastore(model, datastore) or (), ctrl
    if method == "knn-ssd":
        folder = _load_knn(model, knn)
        return KnnSsd(max_draft=k, domains=folder.names()), _placed(folder.dparams(cfg, domain), model.mesh), ctrl
    if method == "layer-skip":
        skip = default_skip_layers(model) if skip_layers is None else tuple(sorted(set(skip_layers)))
        bad = [i for i in skip if not 0 <= i < cfg.num_layers]
        if bad or not skip or len(skip) >= cfg.num_layers:
            raise JspecError(f"--skip-layers must name some (not all) of layers 0..{cfg.num_layers - 1}")
        return LayerSkip(max_draft=k, skip=skip), (), ctrl
    if method in HEAD_METHODS:
        hp, meta = _load_head(method, model, head)
        if exit_layer is not None and exit_layer != meta["exit_layer"]:
            raise JspecError(f"the {method} head exits at layer {meta['exit_layer']}, not --exit-layer {exit_layer}")
        dtype = model.params["embed"].dtype
        dparams = jax.tree.map(lambda x: x if x.dtype == jnp.int32 else x.astype(dtype),
                               heads.draft_params(model.params, hp))
        drafter = (Eagle(max_draft=k, candidates=candidates or 0) if method == "eagle" else
                   EarlyExit(max_draft=k, exit_layer=meta["exit_layer"], head=heads.Head(),
                             candidates=candidates or 0))
        return drafter, _placed(dparams, model.mesh), ctrl
    if method == "early-exit":
        n = cfg.num_layers // 4 if exit_layer is None else exit_layer
        if not 1 <= n < cfg.num_layers:
            raise JspecError(f"--exit-layer must be between 1 and {cfg.num_layers - 1}, got {n}")
        return EarlyExit(max_draft=k, exit_layer=n, candidates=candidates or 0), (), ctrl
    if draft_model is None:
        raise JspecError("--method draft needs --draft-model")
    if draft_model.cfg.vocab_size != cfg.vocab_size:
        raise JspecError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) differs from the "
                         f"target's ({cfg.vocab_size}); they must share a tokenizer")
    return DraftModel(draft_cfg=draft_model.cfg, max_draft=k), _placed(draft_model.params, model.mesh), ctrl


def check_belongs(method: str, given: dict) -> None:
    """Refuse an option (those given, none of them None) that `method` does not take (TAKES)."""
    for name in given:
        if method not in TAKES[name]:
            flag = name if name in API_ONLY else "--" + name.replace("_", "-")
            why = ": it drafts nothing" if method == "ar" else f"; it goes with --method {', '.join(TAKES[name])}"
            raise JspecError(f"{flag} does not go with --method {method}{why}")


# build's options and the kind of value each takes, from its annotations ("int", "float", "bool",
# "str" (a name or a path), "Sequence[int]"; "" for draft_model, a loaded model).
KINDS = {n: "" if p.annotation is p.empty else str(p.annotation).split(" ")[0]
         for n, p in inspect.signature(build).parameters.items() if p.kind is p.KEYWORD_ONLY}


def check_types(given: dict) -> None:
    """Refuse an option of the wrong type in one line (the API and bench's method specs take them
    as values; an int goes where a float does, a pathlib.Path where a path does)."""
    def integer(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    for name, value in given.items():
        what, ok = {"int": ("an integer", integer(value)),
                    "float": ("a number", integer(value) or isinstance(value, (float, np.floating))),
                    "bool": ("true or false", isinstance(value, bool)),
                    "str": ("a string", isinstance(value, (str, os.PathLike))),
                    "Sequence[int]": ("a list of layer numbers",
                                      isinstance(value, (list, tuple, np.ndarray)) and all(map(integer, value))),
                    "": ("a path or a loaded jspec model", hasattr(value, "cfg"))}[KINDS[name]]
        if value is not None and not ok:
            raise JspecError(f"{name} takes {what}, got {value!r}")


def _check_candidates(candidates, max_draft: int | None, controller: str | None) -> None:
    if not 2 <= candidates <= MAX_CANDIDATES:
        raise JspecError(f"--candidates must be between 2 and {MAX_CANDIDATES}, got {candidates}")
    if max_draft is not None or controller is not None:
        raise JspecError("--candidates drafts one position, its top C side by side: "
                         "it takes no --max-draft or --controller")


def _lookup_first(drafter, min_ngram: int | None, k: int | None) -> Lookup:
    """`drafter` behind prompt lookup (jspec.drafters.lookup)."""
    if isinstance(drafter, specee.SpecEE) and drafter.kv != "fill":
        # A copying round runs every layer at its positions, which "mask"'s map of missing entries
        # does not follow.
        raise JspecError("--lookup goes with SpecEE's exit_kv='fill' (the default), not 'mask'")
    min_ngram = _shortest_repeat(min_ngram)
    k = max(LOOKUP_MAX_DRAFT, drafter.max_draft) if k is None else k
    if not drafter.max_draft <= k <= 64:
        raise JspecError(f"--lookup-draft must be between --max-draft ({drafter.max_draft}) and 64, got {k}")
    return Lookup(inner=drafter, max_draft=k, min_ngram=min_ngram)


def _shortest_repeat(n: int | None) -> int:
    """--lookup: the shortest repeat prompt lookup copies (ngram's, or in front of a drafter)."""
    n = LOOKUP_MIN_NGRAM if n is None else n
    if not 1 <= n <= MAX_NGRAM:
        raise JspecError(f"--lookup (the shortest repeat that is copied) must be 1 to {MAX_NGRAM}, got {n}")
    return n


def _mjsd(model, k, exit_layer, draft_model, head, beam_width, accept_threshold, tree):
    """Beams over --draft-model, else over --head, else over the target's first --exit-layer layers
    and its own LM head, else over the shipped EESD head (default model), else over early exit at a
    quarter of the layers. --exit-layer may name every layer: the target drafting for itself, the
    MJGD approximation (slow, a quality reference)."""
    width = BEAM_WIDTH if beam_width is None else beam_width
    tau = ACCEPT_THRESHOLD if accept_threshold is None else accept_threshold
    most = min(64, model.cfg.vocab_size)
    if not 1 <= width <= most:
        raise JspecError(f"--beam-width must be between 1 and {most}, got {width}")
    if not (0 < tau < float("inf")):
        raise JspecError(f"--accept-threshold must be a positive number, got {tau}")
    layers = model.cfg.num_layers
    if exit_layer is not None and not 1 <= exit_layer <= layers:
        raise JspecError(f"--exit-layer must be between 1 and {layers} for --method mjsd "
                         f"({layers}: the target drafts for itself), got {exit_layer}")
    if draft_model is not None:
        inner, dparams, ctrl = build("draft", model, max_draft=k, controller="fixed", draft_model=draft_model)
    elif head is not None or (exit_layer is None and shipped(model, "eesd") is not None):
        kind = heads.read_meta(head)["kind"] if head is not None else "eesd"
        inner, dparams, ctrl = build(kind, model, max_draft=k, controller="fixed", exit_layer=exit_layer, head=head)
    elif exit_layer == model.cfg.num_layers:
        inner, dparams, ctrl = EarlyExit(max_draft=k, exit_layer=exit_layer), (), make_controller("fixed")
    else:
        inner, dparams, ctrl = build("early-exit", model, max_draft=k, controller="fixed", exit_layer=exit_layer)
    return Beam(inner=inner, width=width, threshold=tau, tree=bool(tree)), dparams, ctrl


def check_exit_threshold(threshold: float) -> None:
    if not (math.isfinite(threshold) and threshold >= 0):
        raise JspecError(f"--exit-threshold must be a number >= 0 (above 1: never exit), got {threshold}")


def _build_specee(model, head: str | None, path: str | None, threshold: float | None, choice: str | None,
                  kv: str | None):
    """SpecEE's drafter and params: its predictors, the head they were trained over (its candidates:
    the copy in the predictors' folder unless --head names another), and the K/V rows of the layers
    an exit may skip."""
    threshold = EXIT_THRESHOLD if threshold is None else threshold
    check_exit_threshold(threshold)
    choice = choice or "candidates"
    if choice not in SPECEE_CHOICES:
        raise JspecError(f"unknown exit choice {choice!r}; choose one of {', '.join(SPECEE_CHOICES)}")
    kv = kv or "fill"
    if kv not in specee.KV_MODES:
        raise JspecError(f"unknown exit KV handling {kv!r}; choose one of {', '.join(specee.KV_MODES)}")
    path = path or shipped(model, "specee")
    if path is None:
        raise JspecError("--method specee needs --predictors PATH: predictors ship only for the default model "
                         "(train them with jspec train-predictors)")
    if not Path(path).exists():
        raise JspecError(f"predictors {path} do not exist")
    stamp = (Path(path) / "predictors.json").stat().st_mtime_ns if (Path(path) / "predictors.json").exists() else None
    pp, meta = _read_predictors(str(Path(path).resolve()), stamp, model.cfg)
    kind = meta["head"]["kind"]
    if head is not None and heads.read_meta(head).get("kind") != kind:
        raise JspecError(f"the predictors {path} were trained over a head of kind {kind}: give --head one of "
                         "that kind, or --predictors trained over this one")
    hp, head_meta = _load_head(kind, model, head or str(Path(path) / "head"))
    n = head_meta["exit_layer"]
    if meta["depths"][0] != n or meta["depths"][-1] != model.cfg.num_layers - 1:
        raise JspecError(f"predictors {path} cover depths {meta['depths'][0]}..{meta['depths'][-1]}, but their "
                         f"head exits at layer {n} and the model has {model.cfg.num_layers} layers")
    dtype = model.params["embed"].dtype
    head_params = jax.tree.map(lambda x: x if x.dtype == jnp.int32 else x.astype(dtype),
                               heads.draft_params(model.params, hp))
    layers = _placed({"head": head_params, "kv": specee.kv_weights(model.params, model.cfg, n)}, model.mesh)
    if model.mesh is not None:
        pp = jax.device_put(pp, sharding.NamedSharding(model.mesh, sharding.P()))
    drafter = specee.SpecEE(exit_layer=n, schedule=tuple(meta["schedule"]), choice=choice, kv=kv)
    return drafter, {**layers, "pred": pp, "threshold": jnp.float32(threshold)}


@functools.lru_cache(maxsize=8)
def _read_predictors(path: str, stamp: int | None, cfg):
    return predictors_io.load(path, cfg)


def _placed(dparams, mesh):
    """Drafter parameters on the target's mesh (None: one device), split by the same rules (jit
    refuses arguments on different devices): a draft model is loaded on its own, and a head's
    gathered LM head rows come out replicated."""
    if mesh is None:
        return dparams
    return jax.device_put(dparams, sharding.param_shardings(dparams, mesh))


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
        raise JspecError(f"head {path} is of kind {meta['kind']}, not {method}")
    return hp, meta


@functools.lru_cache(maxsize=8)
def _read_datastore(path: str, stamp: int, cfg, mesh) -> dict:
    """datastore.load, placed where the model lives, once per folder, version and mesh (as heads)."""
    return _placed(jax.tree.map(jnp.asarray, datastore_io.load(path, cfg)), mesh)


def _load_datastore(model, path: str | None) -> dict | None:
    """The table prompt lookup falls back on: --datastore PATH, 'off', or the one shipped for the
    default model (docs/methods.md, "The datastore")."""
    if path == "off":
        return None
    path = path or shipped(model, "datastore")
    if path is None:
        return None
    meta = Path(path) / "datastore.json"
    return _read_datastore(str(Path(path).resolve()), meta.stat().st_mtime_ns if meta.exists() else 0, model.cfg,
                           model.mesh)


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
