"""What a method is, and the options it takes: the records everything else is derived from.

A `Method` is a recipe over the one engine loop: its name, whether its output is `ar`'s, its
default controller and draft length K, the `Option`s it takes, and `build`, which makes its drafter
and drafter params for a model. An `Option` is one keyword of `jspec.methods.build`: its type, its
command-line flag and help, and the check of its value that needs no model. From these records
come which method takes which option (`jspec.methods.TAKES`), the command line's flags
(jspec.cli.common), the one check every caller runs (`jspec.methods.check`: the command line before
the model loads, the API, bench's method specs) and bench's listing of a method's options. A check
that needs the model (an exit layer inside its layers) is the recipe's, in `build`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from typing import Any, Callable

import jax
import numpy as np

from jspec.controllers import CONTROLLERS, check_ranges
from jspec.drafters.ngram import MAX_NGRAM
from jspec.errors import JspecError

TYPES = ("int", "float", "bool", "str", "layers", "model")
DRAFTING_GROUP = "speculative decoding (methods other than ar)"


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# What each type admits, as the API takes values: an int goes where a float does, a pathlib.Path
# where a path does; "model" is a path or a loaded jspec model.
_ADMITS = {"int": ("an integer", _integer),
           "float": ("a number", lambda x: _integer(x) or isinstance(x, (float, np.floating))),
           "bool": ("true or false", lambda x: isinstance(x, bool)),
           "str": ("a string", lambda x: isinstance(x, (str, os.PathLike))),
           "layers": ("a list of layer numbers",
                      lambda x: isinstance(x, (list, tuple, np.ndarray)) and all(map(_integer, x))),
           "model": ("a path or a loaded jspec model", lambda x: isinstance(x, (str, os.PathLike)) or hasattr(x, "cfg"))}


@dataclasses.dataclass(frozen=True)
class Option:
    """One keyword of jspec.methods.build."""

    name: str  # the keyword: max_draft
    type: str  # one of TYPES
    help: str  # the command line's help, without the methods that take it (the CLI adds them)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], None] | None = None  # the value's range, where it needs no model
    flag: bool = True  # False: the Python API only, no command-line flag
    group: str = DRAFTING_GROUP  # the command line's help group

    def __post_init__(self):
        assert self.type in TYPES, self.type

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def label(self) -> str:
        """How messages name it: its flag, or its keyword where it has none."""
        return self.flag_name if self.flag else self.name

    def validate(self, value) -> None:
        """Refuse a value of the wrong type, outside its choices or its range, in one line."""
        what, admits = _ADMITS[self.type]
        if not admits(value):
            raise JspecError(f"{self.name} takes {what}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise JspecError(f"unknown {self.label} {value!r}; choose one of {', '.join(self.choices)}")
        if self.check is not None:
            self.check(value)


def between(flag: str, low, high) -> Callable[[Any], None]:
    """A check that the value lies in low..high (inclusive)."""
    def check(value):
        if not low <= value <= high:
            raise JspecError(f"{flag} must be between {low} and {high}, got {value}")
    return check


def _exit_threshold(value) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise JspecError(f"--exit-threshold must be a number >= 0 (above 1: never exit), got {value}")


def _controller_option(field: str):
    return lambda value: check_ranges(**{field: value})


# The options of every method that drafts: how long a draft may grow, and what stops it.
MAX_DRAFT = Option("max_draft", "int", "most tokens drafted per round", "K", check=between("--max-draft", 1, 64))
CONTROLLER = Option("controller", "str", "draft-length controller (default: the method's own, see docs/methods.md)",
                    choices=tuple(CONTROLLERS))
THRESHOLD = Option("threshold", "float", "confidence threshold of the confidence and dv controllers",
                   check=_controller_option("threshold"))
THOMPSON_VARIANT = Option("thompson_variant", "str", "Thompson-sampling controller variant (default: beta)",
                          choices=("beta", "calibration"))
DRAFT_COST = Option("draft_cost", "float", "Thompson controller: one draft step's cost relative to one verification",
                    "C", check=_controller_option("cost"))
DRAFTING = (MAX_DRAFT, CONTROLLER, THRESHOLD, THOMPSON_VARIANT, DRAFT_COST)
# Options several recipes share.
EXIT_LAYER = Option("exit_layer", "int", "draft with the first N layers (early-exit default: a quarter of them; "
                    "a head's own for the trained heads)", "N")
HEAD = Option("head", "str", "a head from jspec train-head (default: the one shipped for the default model); mjsd: "
              "the head its beams run (any of the three kinds); specee: the head its predictors were trained over",
              "PATH")
# Prompt lookup in front of a model drafter, and candidates side by side (jspec.methods.wrappers).
LOOKUP_MIN_NGRAM = 2  # copy a repeat of at least 2 tokens (docs/methods.md, "Prompt lookup first")
MAX_CANDIDATES = 16


def shortest_repeat(n: int | None) -> int:
    """--lookup: the shortest repeat prompt lookup copies (ngram's, or in front of a drafter)."""
    n = LOOKUP_MIN_NGRAM if n is None else n
    if not 1 <= n <= MAX_NGRAM:
        raise JspecError(f"--lookup (the shortest repeat that is copied) must be 1 to {MAX_NGRAM}, got {n}")
    return n


LOOKUP = Option("lookup", "int", "copy what followed an earlier repeat of the last N tokens (1-3) instead of "
                "drafting (specee: instead of exiting early), when there is one (above batch 1: when every row has "
                "one; default: off); ngram: the shortest repeat it copies (default: 2)", "N", check=shortest_repeat)
LOOKUP_DRAFT = Option("lookup_draft", "int", "with --lookup: most tokens copied per round (default: 4, at least "
                      "--max-draft)", "K")
DATASTORE = Option("datastore", "str", "where the text has no repeat, copy what the model itself wrote after the same "
                   "2-3 tokens, from a table of jspec build-datastore (default: the one shipped for the default "
                   "model; 'off': none)", "PATH")
LOOKUP_OPTIONS = (LOOKUP, LOOKUP_DRAFT, DATASTORE)
CANDIDATES = Option("candidates", "int", "draft one position, the head's top C verified side by side in one "
                    "forward (instead of a chain of --max-draft tokens); lossless", "C",
                    check=between("--candidates", 2, MAX_CANDIDATES))
EXIT_THRESHOLD = Option("exit_threshold", "float", "exit when a layer's predictor says more than P (default: 0.95, "
                        "measured; above 1: never)", "P", check=_exit_threshold,
                        group="specee (lossy: the output differs from ar's)")


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method: a recipe over the engine loop."""

    name: str
    # build(model, options) -> (drafter, drafter params): options has every option the method
    # takes as an attribute (None where not given), max_draft already its default where not given.
    build: Callable
    summary: str  # how it drafts, in a line (the docs' and bench's listing)
    lossless: bool = True
    controller: str = "fixed"  # the default draft-length controller
    max_draft: tuple[int, int] = (8, 8)  # the default K on a CPU, and on a GPU or TPU
    options: tuple[Option, ...] = ()  # its own, beyond those below
    drafts: bool = True  # takes DRAFTING
    lookup: bool = False  # takes --lookup: prompt lookup in front (jspec.methods.wrappers)
    candidates: bool = False  # takes --candidates (jspec.methods.wrappers)
    threshold: float | None = None  # the default controller's threshold, where not the controller's own
    chooses: str | None = None  # the method it decodes with, for one that chooses (auto): what records name

    def default_max_draft(self) -> int:
        return self.max_draft[0] if jax.default_backend() == "cpu" else self.max_draft[1]

    def takes(self) -> tuple[Option, ...]:
        """Every option it takes."""
        return (DRAFTING if self.drafts else ()) + self.options + (LOOKUP_OPTIONS if self.lookup else ()) + \
            ((CANDIDATES,) if self.candidates else ())

    def given(self, values: dict) -> types.SimpleNamespace:
        """Every option it takes, as attributes: the value given, else None."""
        return types.SimpleNamespace(**{o.name: values.get(o.name) for o in self.takes()})
