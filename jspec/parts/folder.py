"""What every part's folder shares: a marker file, a format, the model it was made for, an atomic
write, a guarded read, and a load that takes a path or the folder shipped for the default model.

A part's folder (a trained head, SpecEE's predictors, a datastore, a KNN-SSD folder) holds its
data beside one JSON file, the marker (`head.json`, `predictors.json`, ...): the format version,
the `fingerprint` of the model it was made for, and how it was made. `PartFolder` names one kind of
folder; `read_meta` refuses, in one line, a folder that is not of the kind, of another format or
(`check_model`) of another model; `writing` writes one under a temporary name that replaces the
destination only when complete (jspec.files.writing_folder). `resolve` finds the folder a
method runs with (the user's path, else the one shipped for the default model) and `cached` keeps
each folder's loaded arrays once per version and mesh: every `generate` call builds its method.

A folder a user hands jspec may be damaged or crafted, so every reader checks what it reads before
using it, each refusal a JspecError naming the file: `require` each key of the marker a loader
uses (present, of its type), `read_npz` the arrays of an .npz (each array's header against its
size in the archive, before anything is allocated), `check_arrays` the saved arrays' shapes and
dtypes against the ones the model and the marker imply (before they are read); the orbax side is
jspec.convert.store's (`saved_tree`, `reading`, `check_finite`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np

from jspec.convert import store
from jspec.errors import JspecError
from jspec.files import replacing, write_text, writing_folder
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
    if not isinstance(meta, dict) or not _is(meta.get("format"), int) or meta["format"] not in folder.formats:
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
        write_text(tmp / folder.marker, json.dumps({"format": folder.format, **meta}, indent=1) + "\n")


def save_npz(path: Path, compressed: bool = False, **arrays: np.ndarray) -> None:
    """Write `arrays` as the .npz `path`, on disk when it returns."""
    with replacing(path) as f:
        (np.savez_compressed if compressed else np.savez)(f, **arrays)


# -- reading what a user hands jspec -------------------------------------------------------------

_TYPES = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list"}
_MISSING = object()


def _is(value, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):  # JSON's true is no layer number
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def require(meta, key: str, kind: type, where: Path, items: type | None = None):
    """meta[key], refused in one line naming `where` (the file read) unless `meta` is an object
    holding `key` as a `kind` (a list: of `items`, when given). An int or a float is never a bool."""
    value = meta.get(key, _MISSING) if isinstance(meta, dict) else _MISSING
    if value is _MISSING:
        raise JspecError(f"{where} is damaged: it has no {key!r}")
    if not _is(value, kind) or (items is not None and not all(_is(v, items) for v in value)):
        want = _TYPES[kind] + (f" of {_TYPES[items].split(' ', 1)[1]}s" if items else "")
        shown = json.dumps(value)
        raise JspecError(f"{where} is damaged: its {key!r} must be {want}, not "
                         f"{shown if len(shown) <= 40 else shown[:37] + '...'}")
    return value


def read_npz(path: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The arrays `names` of the .npz `path`, refused in one line if one is missing, is not a plain
    array (no pickled objects), or its header claims more data than the archive holds for it."""
    with store.reading(path), zipfile.ZipFile(path) as z:
        members = {info.filename: info for info in z.infolist()}
        out = {}
        for name in names:
            info = members.get(f"{name}.npy")
            if info is None:
                raise JspecError(f"{path} is damaged: it holds no array {name!r}")
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                size = f.tell() + math.prod(shape) * dtype.itemsize
            if dtype.hasobject:
                raise JspecError(f"{path} is damaged: array {name!r} holds Python objects, which jspec never loads")
            if size != info.file_size:
                raise JspecError(f"{path} is damaged: array {name!r} ({list(shape)} {dtype}) does not match "
                                 f"its {info.file_size} bytes")
            with z.open(info) as f:
                out[name] = np.lib.format.read_array(f, allow_pickle=False)
        return out


def check_arrays(got, want, where: Path) -> None:
    """Refuse the arrays `got` (a pytree of anything with a shape and a dtype: what an orbax
    checkpoint's metadata or an .npz holds) unless they are the arrays `want` describes, by name,
    shape and dtype; the message names `where` and each difference."""
    got, want = store.named_leaves(got), store.named_leaves(want)
    diff = [f"no {k}" for k in want if k not in got] + [f"an unexpected {k}" for k in got if k not in want]
    diff += [f"{k} is {list(got[k].shape)} {np.dtype(got[k].dtype)}, not {list(w.shape)} {np.dtype(w.dtype)}"
             for k, w in want.items() if k in got and (tuple(got[k].shape) != tuple(w.shape)
                                                       or np.dtype(got[k].dtype) != np.dtype(w.dtype))]
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise JspecError(f"{where} holds the wrong arrays: {'; '.join(diff[:3])}{more}")


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
