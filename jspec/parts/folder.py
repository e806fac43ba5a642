"""What every part's folder shares: a marker file, a format, the model it was made for, an atomic
write, and a load that takes a path or the folder shipped for the default model.

A part's folder (a trained head, SpecEE's predictors, a datastore, a KNN-SSD folder) holds its
data beside one JSON file, the marker (`head.json`, `predictors.json`, ...): the format version,
the `fingerprint` of the model it was made for, and how it was made. `PartFolder` names one kind of
folder; `read_meta` refuses, in one line, a folder that is not of the kind, of another format or
(`check_model`) of another model; `writing` writes one under a temporary name that replaces the
destination only when complete (jspec.files.writing_folder). `resolve` finds the folder a
method runs with (the user's path, else the one shipped for the default model) and `cached` keeps
each folder's loaded arrays once per version and mesh: every `generate` call builds its method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from pathlib import Path

from jspec.files import writing_folder
from jspec.errors import JspecError
from jspec.model.config import ModelConfig
from jspec.parts import shipped


@dataclasses.dataclass(frozen=True)
class PartFolder:
    """One kind of part folder."""

    what: str  # how messages name it: "head", "datastore", ...
    marker: str  # the JSON file that marks a folder of this kind
    formats: tuple[int, ...]  # the formats read; the last is the one written
    made_by: str  # the command that makes one, for messages

    @property
    def format(self) -> int:
        return self.formats[-1]


def fingerprint(cfg: ModelConfig) -> dict:
    """What a part depends on: a head trained on one model is meaningless on another."""
    return {"arch": cfg.arch, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size}


def check_model(got: dict, cfg: ModelConfig, lead: str) -> None:
    """Refuse what was made for another model than `cfg`, naming each difference: `lead` says what
    and how, e.g. "head H was trained"."""
    want = fingerprint(cfg)
    diff = [f"{k} {got.get(k)} (this model: {want.get(k)})" for k in sorted(want.keys() | got.keys())
            if got.get(k) != want.get(k)]
    if diff:
        raise JspecError(f"{lead} for another model: " + ", ".join(diff))


def read_meta(path: str | os.PathLike, folder: PartFolder) -> dict:
    """The marker's metadata, refused unless `path` is such a folder in a format this jspec reads."""
    path = Path(path)
    if not (path / folder.marker).is_file():
        raise JspecError(f"{path} is not a jspec {folder.what} (no {folder.marker}); make one with {folder.made_by}")
    try:
        meta = json.loads((path / folder.marker).read_text())
    except (OSError, ValueError) as e:
        raise JspecError(f"{path / folder.marker} is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in folder.formats:
        *earlier, last = map(str, folder.formats)
        reads = f"{', '.join(earlier)} and {last}" if earlier else last
        raise JspecError(f"{folder.what} {path} has format {meta.get('format') if isinstance(meta, dict) else None}; "
                         f"this jspec reads format{'s' if len(folder.formats) > 1 else ''} {reads} "
                         f"(make it again with {folder.made_by})")
    return meta


@contextlib.contextmanager
def writing(path: str | os.PathLike, folder: PartFolder, meta: dict):
    """Yield an empty temporary folder for the part's data; when the block completes the marker
    (`meta` and the current format) is written and the folder replaces `path`, which must be new,
    empty or an earlier folder of the same kind."""
    with writing_folder(Path(path).absolute(), folder.marker) as tmp:
        yield tmp
        (tmp / folder.marker).write_text(json.dumps({"format": folder.format, **meta}, indent=1) + "\n")


def resolve(model, path: str | os.PathLike | None, name: str, missing: str) -> Path:
    """The folder a method runs with: `path`, else the one shipped for `model` under `name`; a
    model nothing ships for is refused with `missing`, which says how to make one."""
    path = path or shipped.find(model, name)
    if path is None:
        raise JspecError(missing)
    return Path(path)


def cached(folder: PartFolder):
    """Decorate `load(path: Path, *key)` to run once per folder, version of its marker and key
    (the model's config, its mesh): a part is read from disk and placed on devices once, not at
    every generate call. A path that does not exist is refused in one line."""
    def wrap(load):
        @functools.lru_cache(maxsize=8)
        def by_version(path: str, marker_stamp, *key):
            return load(Path(path), *key)

        @functools.wraps(load)
        def read(path: str | os.PathLike, *key):
            if not Path(path).exists():
                raise JspecError(f"{folder.what} {path} does not exist")
            marker = Path(path).resolve() / folder.marker
            return by_version(str(marker.parent), marker.stat().st_mtime_ns if marker.is_file() else None, *key)

        return read
    return wrap
