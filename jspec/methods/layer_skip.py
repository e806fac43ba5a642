"""layer-skip: the target with some layers left out drafts (Draft & Verify, SWIFT); lossless."""

import json

from jspec.drafters.layer_skip import LayerSkip
from jspec.errors import JspecError
from jspec.methods.options import Method, Option
from jspec.parts import shipped

SKIP_LAYERS = Option("skip_layers", "layers", "comma-separated layers to skip (default: see docs/methods.md)",
                     "I,J,...")


def default_skip_layers(model) -> tuple[int, ...]:
    """The set searched for the default model (docs/methods.md, "Layer-skip default"); for other models every
    other layer of the middle half (first and last quarter kept), SWIFT's starting point."""
    searched = shipped.find(model, "layer-skip.json")
    if searched is not None:
        return tuple(json.loads(searched.read_text())["skip_layers"])
    n = model.cfg.num_layers
    return tuple(range(n // 4 + 1, n - n // 4, 2))


def build(model, o):
    layers = model.cfg.num_layers
    skip = default_skip_layers(model) if o.skip_layers is None else tuple(sorted(set(o.skip_layers)))
    bad = [i for i in skip if not 0 <= i < layers]
    if bad or not skip or len(skip) >= layers:
        raise JspecError(f"--skip-layers must name some (not all) of layers 0..{layers - 1}")
    return LayerSkip(max_draft=o.max_draft, skip=skip), ()


METHOD = Method("layer-skip", build, "the model with layers skipped", controller="dv", options=(SKIP_LAYERS,),
                lookup=True)
