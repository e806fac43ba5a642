"""What ships for the default model (jspec/checkpoints/, package data: in every install): trained
heads, SpecEE's predictors, the datastore, KNN-SSD's sets and anchors, the searched layer-skip
set. A method uses them when the user names none (jspec/checkpoints/README.md)."""

from __future__ import annotations

from pathlib import Path

from jspec.convert.cache import DEFAULT_MODEL

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DEFAULT_MODEL_KEY = "smollm2-135m-instruct"


def find(model, name: str) -> Path | None:
    """jspec/checkpoints/<default model>/<name>, if `model` (a jspec.api.Model) is the default
    model and it is there."""
    path = CHECKPOINTS / DEFAULT_MODEL_KEY / name
    return path if model.name == DEFAULT_MODEL and path.exists() else None
