"""Decoding methods: a name -> a drafter, its params and a controller, over the one engine loop.

Each method is a recipe in this folder (jspec.methods.options.Method), registered below, and
`build` checks the options given (`check`, the one place they are checked), applies the draft
length and controller defaults, the recipe's `build` and the wrappers it takes (--lookup,
--candidates: jspec.methods.wrappers). A new method is a drafter in jspec/drafters/, a recipe here
and its name in the registering line below (docs/design.md, "Adding a method").
"""

from __future__ import annotations

from typing import NamedTuple

from jspec.controllers import make_controller
from jspec.errors import JspecError
from jspec.methods import (ar, auto, draft, eagle, early_exit, eesd, kangaroo, knn_ssd, layer_skip, mjsd, ngram,
                           specee, wrappers)
from jspec.methods.options import Method, Option

REGISTRY: dict[str, Method] = {}


def _options() -> dict[str, Option]:
    return {o.name: o for m in REGISTRY.values() for o in m.takes()}


def register(method: Method) -> None:
    """Make `method` one that `build`, the command line and bench know (a method of another package
    registers itself this way)."""
    clash = [o.name for o in method.takes() if o.name in _options() and _options()[o.name] != o]
    if clash:
        raise ValueError(f"method {method.name} declares option {clash[0]} unlike the method that declared it first")
    REGISTRY[method.name] = method


for _recipe in (ar, draft, eagle, early_exit, eesd, kangaroo, knn_ssd, layer_skip, ngram, mjsd, specee, auto):
    register(_recipe.METHOD)


def __getattr__(name: str):
    """What is derived from REGISTRY, as of now: METHODS, LOSSLESS, LOSSY (their names), OPTIONS
    (every option, once, in the order the command line lists them) and TAKES (which methods take
    each: any other is refused, so that no run silently measures something other than it names)."""
    if name == "METHODS":
        return tuple(REGISTRY)
    if name == "LOSSLESS":
        return tuple(n for n, m in REGISTRY.items() if m.lossless)
    if name == "LOSSY":  # jspec bench reports their quality
        return tuple(n for n, m in REGISTRY.items() if not m.lossless)
    if name == "OPTIONS":
        return _options()
    if name == "TAKES":
        return {o: tuple(m.name for m in REGISTRY.values() if option in m.takes()) for o, option in _options().items()}
    raise AttributeError(f"module 'jspec.methods' has no attribute {name!r}")


class Plan(NamedTuple):
    """What the engine loop runs: the drafter (static), its params (a pytree) and the controller."""

    drafter: object
    dparams: object
    controller: object


def get(name: str) -> Method:
    if name not in REGISTRY:
        raise JspecError(f"unknown method {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def check(name: str, given: dict) -> None:
    """Refuse, in one line, an option (those given, none None) whose value is of the wrong type or
    out of its range, or that the method does not take. Needs no model: the command line calls it
    before loading one, the API and bench's method specs through `build`."""
    method, options = get(name), _options()
    for key, value in given.items():
        if key not in options:
            raise JspecError(f"unknown option {key!r}; the methods' options are {', '.join(options)}")
        options[key].validate(value)
    for key in given:
        if options[key] not in method.takes():
            takers = [m.name for m in REGISTRY.values() if options[key] in m.takes()]
            why = ": it drafts nothing" if not method.drafts and not method.takes() else \
                f"; it goes with --method {', '.join(takers)}"
            raise JspecError(f"{options[key].label} does not go with --method {name}{why}")


def build(name: str, model, **options) -> Plan:
    """The plan of method `name` on `model` (a jspec.api.Model) with `options` (those of its
    recipe, by keyword; None: the method's default)."""
    given = {k: v for k, v in options.items() if v is not None}
    check(name, given)
    method = get(name)
    o = method.given(given)
    wrappers.check(method, o)
    if method.candidates and o.candidates is not None:
        o.max_draft = o.candidates
    if method.drafts:
        threshold = o.threshold
        if threshold is None and o.controller in (None, method.controller):
            threshold = method.threshold
        controller = make_controller(o.controller or method.controller, threshold=threshold,
                                     variant=o.thompson_variant, cost=o.draft_cost)
        o.max_draft = method.default_max_draft() if o.max_draft is None else o.max_draft
    else:
        controller = make_controller(method.controller)
    drafter, dparams = method.build(model, o)
    if method.lookup and o.lookup is not None:
        drafter, dparams = wrappers.lookup_first(model, drafter, dparams, o)
    return Plan(drafter, dparams, controller)
