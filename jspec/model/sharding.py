"""Sharding over a `Mesh` with a `data` axis (batch rows) and a `model` axis (tensor parallel).

A rules table maps each parameter name to the mesh axis of each of its dimensions: RULES for the
target's, and each part a drafter carries declares its own (jspec.parts: a head's extend these). A dimension that does not divide evenly by its axis size stays replicated
(SmolLM2's 3 kv heads on 4 devices, say): correct, only less parallel. jit's sharding propagation
does the rest.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.errors import JspecError

# Parameter name -> mesh axis of each dimension of the [out, in] weights (Megatron style: the
# projections in split their outputs, the projections out split their inputs).
RULES: dict[str, tuple[str | None, ...]] = {
    "embed": ("model", None),
    "lm_head": ("model", None),
    "final_norm": (None,),
    "attn_norm": (None,),
    "mlp_norm": (None,),
    "wqkv": ("model", None),
    "bqkv": ("model",),
    "wo": (None, "model"),
    "w_gate_up": ("model", None),
    "w_down": (None, "model"),
}
# KV cache per layer [B, S, K, H]: rows over data, kv heads over model.
CACHE_RULE = ("data", None, "model", None)


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,model=4' -> {"data": 2, "model": 4}; an axis left out has size 1."""
    given = {}
    for part in spec.replace(" ", "").split(","):
        name, _, value = part.partition("=")
        if name not in ("data", "model") or name in given or not value.isdigit() or int(value) < 1:
            raise JspecError(f"bad --mesh {spec!r}: write it as data=N,model=M, each axis at most once")
        given[name] = int(value)
    return {"data": 1, "model": 1, **given}


def make_mesh(spec: str | Mesh | None) -> Mesh | None:
    """'data=2,model=4' -> Mesh over the first data*model devices; either axis may be left out."""
    if isinstance(spec, Mesh):
        if set(spec.axis_names) != {"data", "model"}:  # the sharding rules name these two axes
            raise JspecError(f"a mesh needs the axes 'data' and 'model', this one has {spec.axis_names}")
        return spec
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise JspecError(f"mesh takes 'data=N,model=M' or a jax.sharding.Mesh, got {spec!r}")
    sizes = parse_mesh(spec)
    need, have = sizes["data"] * sizes["model"], len(jax.devices())
    if need > have:
        raise JspecError(f"--mesh {spec} needs {need} devices but only {have} are available")
    return Mesh(device_grid((sizes["data"], sizes["model"]), jax.devices()[:need]), ("data", "model"))


def device_grid(shape: tuple[int, int], devices: list) -> np.ndarray:
    """`devices` as a [data, model] array laid out along the physical topology (a TPU slice's
    torus): `mesh_utils.create_device_mesh` puts the `model` axis, whose all-reduces run twice a
    layer, on neighbouring chips, where jax.devices()' order would reach across the slice.
    Devices that are not a whole slice (the first 4 of 8, say), which it may refuse, are laid
    out splitting physical axes, else in jax.devices()' order. On CPUs that order is what it gives
    (on GPUs, by device id)."""
    for split in (False, True):
        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
        except (AssertionError, NotImplementedError, ValueError):
            pass
    return np.array(devices).reshape(shape)


def spec(mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
    """The PartitionSpec of an array of `shape` split by `axes`, each only where it divides the dimension."""
    return P(*(a if a is not None and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))


def rule(path, ndim: int, rules: dict[str, tuple[str | None, ...]] = RULES) -> tuple[str | None, ...]:
    """The mesh axis of each dimension of the leaf at tree path `path`: the rules entry of the name
    it is stored under (its dict key). An int8 matrix's scale (jspec.model.weights.Int8, a leaf
    under the matrix's name) follows its rows: the rule's first axis."""
    key = next(k for k in reversed(path) if not isinstance(k, jax.tree_util.GetAttrKey))
    return rules[re.sub(r"\W", "", str(key))][:ndim]


def shardings(tree, mesh: Mesh, rules: dict[str, tuple[str | None, ...]] = RULES):
    """A NamedSharding for every leaf of `tree` (arrays, ShapeDtypeStructs, or shapes as tuples),
    split as `rule` says."""

    def one(path, leaf):
        shape = leaf if isinstance(leaf, tuple) else leaf.shape
        return NamedSharding(mesh, spec(mesh, rule(path, len(shape), rules), shape))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, tuple))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds all of it."""
    return NamedSharding(mesh, P())


def cache_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, spec(mesh, CACHE_RULE, shape))


def rows_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Per-row inputs ([B, ...]) are split over the data axis."""
    return NamedSharding(mesh, spec(mesh, ("data",) + (None,) * (len(shape) - 1), shape))


def pin_rows(tree, mesh: Mesh | None):
    """Inside a program: every array of `tree` split by rows over the data axis (a 0-d one, shared
    by the rows, replicated), whatever sharding propagation chose. A program's outputs that the
    next program takes (jspec.engine.slots' LoopState) are pinned so, so the layout that program
    was compiled for is the one it gets."""
    if mesh is None:
        return tree
    def pin(x):
        if not isinstance(x, jax.Array):  # a constant a drafter keeps in its state (a Python number)
            return x
        return jax.lax.with_sharding_constraint(x, replicated(mesh) if x.ndim == 0 else rows_sharding(mesh, x.shape))
    return jax.tree.map(pin, tree)


def pin_cache(cache, mesh: Mesh | None):
    """Inside a program: a KVCache's arrays split as `cache_sharding` splits them."""
    if mesh is None:
        return cache
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding(mesh, x.shape)), cache)


def place(tree, mesh: Mesh | None, rules: dict[str, tuple[str | None, ...]] = RULES):
    """`tree` on `mesh`, split by `rules` (None: left where it is, one device)."""
    return tree if mesh is None else jax.device_put(tree, shardings(tree, mesh, rules))
