"""Decoding methods: a name, a drafter, a controller and their defaults.

Each method is a recipe over the one engine loop (jspec.engine.loop). Options not given fall
back to the method's defaults, which are documented in docs/methods.md.
"""

from __future__ import annotations

from jspec.controllers import make_controller
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.early_exit import EarlyExit
from jspec.drafters.layer_skip import LayerSkip
from jspec.drafters.ngram import NGram
from jspec.drafters.none import NoDraft
from jspec.errors import JspecError

METHODS = ("ar", "draft", "early-exit", "layer-skip", "ngram")
LOSSLESS = METHODS
DEFAULT_CONTROLLER = {"ar": "fixed", "draft": "fixed", "early-exit": "confidence", "layer-skip": "dv",
                      "ngram": "fixed"}
DEFAULT_MAX_DRAFT = 8


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """Skip every other layer of the middle half (first and last quarter kept), SWIFT-style."""
    return tuple(range(num_layers // 4 + 1, num_layers - num_layers // 4, 2))


def build(method: str, model, *, max_draft: int | None = None, controller: str | None = None,
          exit_layer: int | None = None, skip_layers=None, draft_model=None, threshold: float | None = None,
          thompson_variant: str | None = None, draft_cost: float | None = None):
    """(drafter, drafter params, controller) for `method` on `model` (a jspec.api.Model)."""
    if method not in METHODS:
        raise JspecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    cfg = model.cfg
    k = DEFAULT_MAX_DRAFT if max_draft is None else max_draft
    if method != "ar" and not 1 <= k <= 64:
        raise JspecError(f"--max-draft must be between 1 and 64, got {k}")
    ctrl = make_controller(controller or DEFAULT_CONTROLLER[method], threshold=threshold,
                           variant=thompson_variant, cost=draft_cost)
    if method == "ar":
        return NoDraft(), (), ctrl
    if method == "ngram":
        return NGram(max_draft=k), (), ctrl
    if method == "layer-skip":
        skip = default_skip_layers(cfg.num_layers) if skip_layers is None else tuple(sorted(set(skip_layers)))
        bad = [i for i in skip if not 0 <= i < cfg.num_layers]
        if bad or len(skip) >= cfg.num_layers:
            raise JspecError(f"--skip-layers must name some (not all) of layers 0..{cfg.num_layers - 1}")
        return LayerSkip(max_draft=k, skip=skip), (), ctrl
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
    return DraftModel(draft_cfg=draft_model.cfg, max_draft=k), draft_model.params, ctrl
