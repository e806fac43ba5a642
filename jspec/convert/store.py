"""Converted checkpoints: one folder per model, written once, loaded fast.

    OUT/jspec.json   format version, ModelConfig, dtype, where it came from
    OUT/params/      the parameter pytree, saved with orbax
    OUT/tokenizer.json, OUT/tokenizer_config.json
                     the tokenizer, its special tokens and chat template (`jspec.tokenizer`)

A folder is written under a temporary name and renamed when complete, so an interrupted
conversion never leaves something that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec.errors import JspecError
from jspec.model import layout
from jspec.model.config import ModelConfig
from jspec.tokenizer import Tokenizer

# 5: jspec's own tokenizer files, loaded without transformers (and SmolLM2 splits digits as it should).
FORMAT = 5
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


META = "jspec.json"  # what marks a folder as a converted checkpoint


def is_converted(path: str | os.PathLike) -> bool:
    return (Path(path) / META).is_file()


def is_current(path: str | os.PathLike) -> bool:
    return json.loads((Path(path) / META).read_text()).get("format") == FORMAT


def _read_source(src: str) -> tuple[dict, dict, Tokenizer | None]:
    """(HF config dict, HF-named tensors, tokenizer or None) from a GGUF file or an HF source."""
    if str(src).endswith(".gguf"):
        from jspec.convert.gguf import read_gguf

        return read_gguf(src)
    from jspec.convert.hf import read_hf, resolve_hf_dir

    folder = resolve_hf_dir(src)
    ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))  # refuse early, before the weights
    hf_config, tensors = read_hf(str(folder))
    return hf_config, tensors, Tokenizer.load(folder)


def convert(src: str, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """Convert a GGUF file, an HF folder or a cached hub id into a jspec checkpoint at `out`."""
    if dtype not in DTYPES:
        raise JspecError(f"unknown dtype {dtype!r}; choose float32 or bfloat16")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise JspecError(f"output folder {out} exists and is not empty" if out.is_dir() else f"{out} is a file")
    if is_converted(src):
        raise JspecError(f"{src} is a converted jspec folder already: give it as --model as it is")
    hf_config, tensors, tokenizer = _read_source(src)
    cfg = ModelConfig.from_hf(hf_config)
    if tokenizer is not None:
        # Chat models end turns with their own token (<|im_end|>, <|eot_id|>): stop there too.
        eos = {tokenizer.eos_token_id, *cfg.eos_token_ids} - {None}
        cfg = ModelConfig.from_json({**cfg.to_json(), "eos_token_ids": sorted(eos)})
    params = layout.params_from_hf(cfg, tensors, DTYPES[dtype])
    del tensors
    return save(out, cfg, params, tokenizer, dtype, str(src))


def save(out: str | os.PathLike, cfg: ModelConfig, params, tokenizer: Tokenizer | None, dtype: str,
         source: str) -> Path:
    """Write a checkpoint folder (under a temporary name, renamed when complete)."""
    with writing_folder(out, META) as tmp:
        save_params(tmp / "params", params)
        if tokenizer is not None:
            tokenizer.save(tmp)
        meta = {"format": FORMAT, "config": cfg.to_json(), "dtype": dtype, "source": source}
        (tmp / META).write_text(json.dumps(meta, indent=1))
    return Path(out)


def check_output(path: str | os.PathLike, marker: str) -> None:
    """Refuse `path` as an output folder unless it is absent, empty, or an earlier output of the
    same kind (it holds `marker`, e.g. head.json): writing replaces it whole, and must never
    delete anything else (a checkout, a data folder, a home directory)."""
    path = Path(path)
    if path.is_dir() and (path / marker).is_file():
        return
    if path.exists() and not path.is_dir():
        raise JspecError(f"{path} is a file, not a folder to write")
    if path.exists() and any(path.iterdir()):
        raise JspecError(f"{path} exists, is not empty and holds no earlier output of this command "
                         f"(no {marker}); name a new or empty folder")


@contextlib.contextmanager
def writing_folder(path: str | os.PathLike, marker: str):
    """Yield an empty temporary folder beside `path`; when the block completes it replaces `path`,
    and if the block fails it is removed, so `path` is never half-written. `path` must pass
    `check_output` with `marker`, before the block and again when it is replaced."""
    path = Path(path)
    check_output(path, marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        check_output(path, marker)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_params(path: Path, params) -> None:
    """Write a parameter pytree with orbax (and wait until it is on disk)."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path.absolute(), jax.tree.map(jnp.asarray, params))
    ckpt.wait_until_finished()


def restore(path: Path, target, shardings=None):
    """Restore the orbax pytree at `path` as `target` describes it (arrays or jax.ShapeDtypeStructs:
    the tree, shapes and dtypes), each leaf onto its `jax.sharding.Sharding` in `shardings` (a
    matching pytree), or onto the default device when `shardings` is None.

    Never onto the sharding the checkpoint recorded: that names the devices it was saved from
    (cpu:0, or a mesh of 8), which another machine may lack (orbax's "Topology mismatch" on a GPU)
    and which need not be where the model lives now.
    """
    import orbax.checkpoint as ocp

    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: default, target)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, shardings)
    return ocp.StandardCheckpointer().restore(Path(path).absolute(), abstract)


def saved_tree(path: Path):
    """The tree of jax.ShapeDtypeStructs an orbax checkpoint holds (from its metadata), for a
    `restore` target whose shapes are not known in advance (a head's draft vocabulary)."""
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().metadata(Path(path).absolute()).item_metadata.tree
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)


def load(path: str | os.PathLike, dtype: str | None = None, shardings=None):
    """Load a converted checkpoint: (ModelConfig, params, tokenizer or None).

    `dtype` casts on load (e.g. a float32 checkpoint run in bfloat16); `shardings`, a pytree of
    `jax.sharding.Sharding` matching the parameters, places each array directly where it lives
    (None: on the default device).
    """
    path = Path(path).absolute()
    cfg, meta = read_meta(path)
    stored = DTYPES[meta["dtype"]]
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, stored), layout.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    params = restore(path / "params", target, shardings)
    if dtype is not None and DTYPES[dtype] != stored:
        params = jax.tree.map(lambda x: x.astype(DTYPES[dtype]), params)
    return cfg, params, Tokenizer.load(path)


def read_meta(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The ModelConfig and metadata of a converted checkpoint, refusing other format versions."""
    meta = json.loads((Path(path) / META).read_text())
    if meta.get("format") != FORMAT:
        raise JspecError(f"{path} was written by another jspec version (format {meta.get('format')}); convert again")
    return ModelConfig.from_json(meta["config"]), meta
