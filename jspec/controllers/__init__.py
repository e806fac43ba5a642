"""Draft-length controllers: after each drafted token, should this row draft another?

A controller is a static, hashable config with three pure functions over a state pytree that
the engine carries through its jitted loop (PRNG keys come from the loop):

    init(batch, max_draft)            -> state
    keep(state, j, confidence, key)   -> (continue [B] bool, state)   after draft token j (0-based)
    update(state, n_draft, n_accepted, live) -> state                 after verification

`confidence` [B] is the top-1 probability of the draft distribution for the token just drafted.
The drafted token itself is always verified; `keep` only decides whether to draft one more.

A new controller is one file here plus its entry in CONTROLLERS.
"""

from __future__ import annotations

import dataclasses

from jspec.controllers.confidence import Confidence
from jspec.controllers.dv import DraftVerify
from jspec.controllers.fixed import Fixed
from jspec.controllers.heuristic import Heuristic
from jspec.controllers.thompson import Thompson
from jspec.errors import JspecError

CONTROLLERS = {"fixed": Fixed, "confidence": Confidence, "heuristic": Heuristic, "dv": DraftVerify,
               "thompson": Thompson}


# The command line's name for each controller option.
FLAGS = {"threshold": "--threshold", "variant": "--thompson-variant", "cost": "--draft-cost"}
# What the numeric options can mean: a top-1 probability to stop below, and one draft step's time
# over one verification's (Thompson continues while the chance of acceptance exceeds it).
RANGES = {"threshold": (0.0, 1.0), "cost": (0.0, 1.0)}


def make_controller(name: str, **options):
    """`options` left None are the controller's defaults; one it does not have is refused, so that
    no run silently measures something other than what it names."""
    if name not in CONTROLLERS:
        raise JspecError(f"unknown controller {name!r}; choose one of {', '.join(CONTROLLERS)}")
    fields = {f.name for f in dataclasses.fields(CONTROLLERS[name])}
    given = {k: v for k, v in options.items() if v is not None}
    stray = sorted(given.keys() - fields)
    if stray:
        raise JspecError(f"{FLAGS.get(stray[0], stray[0])} does not go with the {name} controller")
    check_ranges(**given)
    return CONTROLLERS[name](**given)


def check_ranges(**options) -> None:
    """Refuse a numeric option outside what it can mean (NaN too); the command line calls this
    before the model loads."""
    for k, (lo, hi) in RANGES.items():
        if options.get(k) is not None and not lo <= options[k] <= hi:
            raise JspecError(f"{FLAGS[k]} must be in {lo:g}..{hi:g}, got {options[k]}")
