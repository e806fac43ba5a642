"""KNN-SSD folders: a sublayer skip set per domain and the anchors that choose between them.

A folder holds
    knn.json      format, the model it fits (heads.fingerprint), and per domain its name, skipped
                  attention and MLP layers, anchor count and how the set was found
    anchors.npz   anchors [N, D] float32 (k-means centres of prompt features) and domain [N] int32

Domains without anchors (a set searched on all domains pooled, say) are never chosen by the
lookup; `--method knn-ssd:domain=NAME` runs any domain's set on every prompt.
`load` checks the two files against each other and against the model knn.json names (its layers,
its width, finite anchors) before anything uses them. Reading a folder needs only numpy and jax;
fitting anchors (jspec.training.fit_knn) needs scikit-learn.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec.convert import store
from jspec.errors import JspecError
from jspec.model import sharding
from jspec.model.config import ModelConfig
from jspec.parts import folder

FOLDER = folder.PartFolder("KNN-SSD folder", "knn.json", (1,), "jspec search-skip and jspec fit-knn")
# Replicated: every row's nearest anchor and skip mask may index any of them.
RULES = {"anchors": (None, None), "anchor_domain": (None,), "skip": (None, None, None)}


@dataclasses.dataclass
class SkipSet:
    """Layers whose attention / MLP sublayer a draft skips, and how the set was found."""

    name: str
    attention: tuple[int, ...]
    mlp: tuple[int, ...]
    info: dict = dataclasses.field(default_factory=dict)

    def mask(self, num_layers: int) -> np.ndarray:
        """[2, L] bool: attention row, MLP row."""
        if any(not 0 <= i < num_layers for i in self.attention + self.mlp):
            raise JspecError(f"skip set {self.name} names layers outside 0..{num_layers - 1}")
        if set(self.attention) == set(self.mlp) == set(range(num_layers)):
            raise JspecError(f"skip set {self.name} skips every layer: its draft would be no model at all")
        out = np.zeros((2, num_layers), bool)
        out[0, list(self.attention)] = True
        out[1, list(self.mlp)] = True
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "skip_attention": list(self.attention), "skip_mlp": list(self.mlp), **self.info}

    @classmethod
    def from_json(cls, obj, where: Path) -> "SkipSet":
        """The set `obj` describes, refused in one line naming `where` unless it has a name and
        integer lists skip_attention and skip_mlp."""
        name = folder.require(obj, "name", str, where)
        attention = folder.require(obj, "skip_attention", list, where, items=int)
        mlp = folder.require(obj, "skip_mlp", list, where, items=int)
        info = {k: v for k, v in obj.items() if k not in ("name", "skip_attention", "skip_mlp")}
        return cls(name, tuple(attention), tuple(mlp), info)


def read_set(path: str | os.PathLike) -> SkipSet:
    """The skip set of a jspec search-skip output file, refused in one line if it is not one."""
    try:
        return SkipSet.from_json(json.loads(Path(path).read_text()), Path(path))
    except (OSError, ValueError, JspecError):
        raise JspecError(f"{path} is not a skip set of jspec search-skip (it needs a name and the layer lists "
                         "skip_attention and skip_mlp)") from None


@dataclasses.dataclass
class Knn:
    model: dict  # folder.fingerprint of the model the sets were searched on
    sets: list[SkipSet]
    anchors: np.ndarray  # [N, D] float32
    anchor_domain: np.ndarray  # [N] int32, an index into sets

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sets)

    def dparams(self, cfg: ModelConfig, domain: str | None = None, mesh: Mesh | None = None) -> dict:
        """The knn-ssd drafter's data, replicated over `mesh` when given; `domain` forces that
        domain's set on every prompt."""
        folder.check_model(self.model, cfg, "these KNN-SSD anchors and skip sets were made")
        names = self.names()
        if domain is not None and domain not in names:
            raise JspecError(f"no domain {domain!r} in the KNN-SSD folder; it has {', '.join(names)}")
        chosen = self.anchor_domain if domain is None else np.full_like(self.anchor_domain, names.index(domain))
        unit = self.anchors / np.maximum(np.linalg.norm(self.anchors, axis=-1, keepdims=True), 1e-12)
        data = {"anchors": jnp.asarray(unit, jnp.float32), "anchor_domain": jnp.asarray(chosen, jnp.int32),
                "skip": jnp.asarray(np.stack([s.mask(cfg.num_layers) for s in self.sets]))}
        return sharding.place(data, mesh, RULES)


def save(path: str | os.PathLike, knn: Knn) -> Path:
    """Write the folder atomically (a temporary folder renamed into place)."""
    if not len(knn.anchors):
        raise JspecError("a KNN-SSD folder needs at least one anchor")
    with folder.writing(path, FOLDER, {"model": knn.model, "sets": [s.to_json() for s in knn.sets]}) as tmp:
        folder.save_npz(tmp / "anchors.npz", anchors=knn.anchors.astype(np.float32),
                        domain=knn.anchor_domain.astype(np.int32))
    return Path(path).absolute()


def load(path: str | os.PathLike) -> Knn:
    """The folder at `path`, refused in one line unless knn.json names its model and at least one
    set, each of that model's layers, and anchors.npz holds at least one finite anchor of the
    model's width, each of a domain among the sets."""
    path = Path(path)
    meta = folder.read_meta(path, FOLDER)
    where = path / FOLDER.marker
    model = folder.require(meta, "model", dict, where)
    layers, width = folder.require(model, "num_layers", int, where), folder.require(model, "hidden_size", int, where)
    sets = [SkipSet.from_json(s, where) for s in folder.require(meta, "sets", list, where)]
    if not sets:
        raise JspecError(f"{where} is damaged: it names no skip set")
    for s in sets:
        if any(not 0 <= i < layers for i in s.attention + s.mlp):
            raise JspecError(f"{where} is damaged: skip set {s.name[:40]!r} names layers outside 0..{layers - 1}")
    arrays = folder.read_npz(path / "anchors.npz", ("anchors", "domain"))
    count = arrays["domain"].shape[0] if arrays["domain"].ndim == 1 else 0
    folder.check_arrays(arrays, {"anchors": jax.ShapeDtypeStruct((count, width), jnp.float32),
                                 "domain": jax.ShapeDtypeStruct((count,), jnp.int32)}, path / "anchors.npz")
    anchors, domain = arrays["anchors"], arrays["domain"]
    if not count or not np.all((0 <= domain) & (domain < len(sets))):
        raise JspecError(f"{path / 'anchors.npz'} does not match knn.json: it needs at least one anchor, each of a "
                         f"domain 0..{len(sets) - 1}")
    store.check_finite(arrays, path / "anchors.npz")
    return Knn(model, sets, anchors, domain)


@folder.cached(FOLDER)
def _loaded(path: Path) -> Knn:
    return load(path)


def load_for(model, path: str | os.PathLike | None = None) -> Knn:
    """The folder knn-ssd runs with: the one at `path`, else the one shipped for the default model.
    Loaded once per folder version."""
    path = folder.resolve(model, path, "knn-ssd", "--method knn-ssd needs --knn PATH: anchors and skip sets ship "
                                                  "only for the default model (make them with jspec search-skip "
                                                  "and jspec fit-knn)")
    return _loaded(path)
