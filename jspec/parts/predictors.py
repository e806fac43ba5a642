"""SpecEE's exit predictors: one tiny MLP per checkable depth, saying "this layer's token is final".

A predictor reads 12 numbers about the C = 4 candidate tokens at depth d (d layers run):

    logits   z_d times the candidates' LM-head rows, z_d the final norm of the depth-d state  [C]
    probs    their softmax over the C candidates only                                          [C]
    change   probs minus the previous depth's probs (at the first depth: probs itself)         [C]

and maps them through Linear(12 -> 512) -> ReLU -> Linear(512 -> 1) -> sigmoid. The P predictors
of a set (depths `depths[0] .. depths[P-1]`, consecutive) are stacked:

    w1 [P, 12, 512], b1 [P, 512], w2 [P, 512], b2 [P]

The reference takes the change since the previous *checked* layer; here features exist at every
depth from the candidates' layer on (they cost a norm and 4 dot products, nothing beside a layer
of even a 135M model), so the change is always against the previous depth, in training and in
decoding alike, whichever depths the schedule checks.

A saved set is a folder: predictors.json (the model and head it was trained for, its depths,
the offline schedule, training summary) and params/ (orbax). `load` refuses another model's, and
a folder whose arrays are not one predictor per depth or hold non-finite numbers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.convert import store
from jspec.errors import JspecError
from jspec.model import sharding
from jspec.model.config import ModelConfig
from jspec.parts import folder, heads

CANDIDATES = 4
FEATURES = 3 * CANDIDATES
HIDDEN = 512
FOLDER = folder.PartFolder("set of SpecEE predictors", "predictors.json", (1,), "jspec train-predictors")
# Replicated: every row's exit check may read any depth's predictor (a few MB in all).
RULES = {"w1": (None, None, None), "b1": (None, None), "w2": (None, None), "b2": (None,)}


def init(key: jax.Array, count: int, features: int = FEATURES) -> dict:
    """`count` predictors, PyTorch's default Linear initialisation (uniform in +-1/sqrt(fan_in)).
    `features` other than 12 only for experiments (benchmarks/probes/specee_features.py): decoding reads 12."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    u = lambda k, shape, fan_in: jax.random.uniform(k, shape, jnp.float32, -fan_in ** -0.5, fan_in ** -0.5)
    return {"w1": u(k1, (count, features, HIDDEN), features), "b1": u(k2, (count, HIDDEN), features),
            "w2": u(k3, (count, HIDDEN), HIDDEN), "b2": u(k4, (count,), HIDDEN)}


def features(cand_logits: jax.Array, prev_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cand_logits [..., C], prev_probs [..., C] (zeros at the first depth) -> (features [..., 12], probs)."""
    probs = jax.nn.softmax(cand_logits.astype(jnp.float32), axis=-1)
    return jnp.concatenate([cand_logits, probs, probs - prev_probs], axis=-1), probs


def logit(pp: dict, index, x: jax.Array) -> jax.Array:
    """Predictor `index`'s pre-sigmoid output for features x [..., 12] -> [...]."""
    hidden = jax.nn.relu(x @ pp["w1"][index] + pp["b1"][index])
    return hidden @ pp["w2"][index] + pp["b2"][index]


def score(pp: dict, index, x: jax.Array) -> jax.Array:
    """The probability that the depth's token is final, [...] in (0, 1)."""
    return jax.nn.sigmoid(logit(pp, index, x))


# -- saving and loading --------------------------------------------------------------------------

def save(path: str | os.PathLike, pp: dict, meta: dict, head: str | os.PathLike) -> Path:
    """Write the predictors with a copy of the head they were trained over (`head/`): its
    candidates are their inputs, so they stay right when another head replaces a shipped one."""
    with folder.writing(path, FOLDER, meta) as tmp:
        store.save_params(tmp / "params", pp)
        shutil.copytree(head, tmp / "head", ignore=shutil.ignore_patterns("README.md"))
    return Path(path).absolute()


def read_meta(path: str | os.PathLike) -> dict:
    """The marker of the predictors at `path`, refused in one line unless it is a set's: its model
    and head objects (the head's kind one of heads.KINDS), its depths and schedule integer lists."""
    meta = folder.read_meta(path, FOLDER)
    where = Path(path) / FOLDER.marker
    folder.require(meta, "model", dict, where)
    if folder.require(folder.require(meta, "head", dict, where), "kind", str, where) not in heads.KINDS:
        raise JspecError(f"{where} is damaged: its head's 'kind' must be one of {', '.join(heads.KINDS)}")
    folder.require(meta, "depths", list, where, items=int)
    folder.require(meta, "schedule", list, where, items=int)
    return meta


def load(path: str | os.PathLike, cfg: ModelConfig, mesh: Mesh | None = None) -> tuple[dict, dict]:
    """(predictor params, meta), refused unless trained for a model like `cfg`, over consecutive
    depths inside it with a schedule among them, holding one predictor of the shapes of `init`
    per depth, all finite; replicated over `mesh` when given."""
    path = Path(path).absolute()
    meta = read_meta(path)
    folder.check_model(meta["model"], cfg, f"predictors {path} were trained")
    depths = meta["depths"]
    if not depths or depths[0] < 1 or depths[-1] >= cfg.num_layers or depths != list(range(depths[0], depths[-1] + 1)):
        raise JspecError(f"predictors {path} cover depths {depths}, not consecutive depths inside this model")
    if not set(meta["schedule"]) <= set(depths):
        raise JspecError(f"predictors {path} schedule depths {meta['schedule']} outside the depths they cover")
    target = store.saved_tree(path / "params")
    folder.check_arrays(target, jax.eval_shape(lambda: init(jax.random.key(0), len(depths))), path / "params")
    with store.reading(path / "params"):
        pp = store.restore(path / "params", target, None if mesh is None else sharding.shardings(target, mesh, RULES))
    store.check_finite(pp, path / "params")
    return pp, meta


@folder.cached(FOLDER)
def _loaded(path: Path, cfg: ModelConfig, mesh: Mesh | None):
    return load(path, cfg, mesh)


def load_for(model, path: str | os.PathLike | None = None) -> tuple[Path, dict, dict]:
    """(folder, predictor params, meta) SpecEE runs with: those at `path`, else those shipped for
    the default model. Loaded once per folder version."""
    path = folder.resolve(model, path, "specee", "--method specee needs --predictors PATH: predictors ship only "
                                                 "for the default model (train them with jspec train-predictors)")
    return (path, *_loaded(path, model.cfg, model.mesh))
