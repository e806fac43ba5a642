"""early-exit: the target's first N layers and its own LM head draft, untrained; verification runs
only the layers after N, reusing the draft's work (lossless)."""

from jspec.drafters.early_exit import EarlyExit
from jspec.errors import JspecError
from jspec.methods.options import EXIT_LAYER, Method


def drafter(model, exit_layer: int | None, max_draft: int, candidates: int | None = None):
    layers = model.cfg.num_layers
    n = layers // 4 if exit_layer is None else exit_layer
    if not 1 <= n < layers:
        raise JspecError(f"--exit-layer must be between 1 and {layers - 1}, got {n}")
    return EarlyExit(max_draft=max_draft, exit_layer=n, candidates=candidates or 0), ()


def build(model, o):
    return drafter(model, o.exit_layer, o.max_draft, o.candidates)


METHOD = Method("early-exit", build, "the first N layers and the LM head; verification reuses their work",
                controller="confidence", options=(EXIT_LAYER,), lookup=True, candidates=True)
