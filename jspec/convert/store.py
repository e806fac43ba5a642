"""Converted checkpoints: one folder per model, written once, loaded fast.

    OUT/jspec.json   format version, ModelConfig, dtype, where it came from, layers per piece
    OUT/params/embed/          embed and final_norm: one orbax checkpoint
    OUT/params/lm_head/        an untied model's LM head
    OUT/params/layers_00000/   layers 0 .. n-1, a list of layer dicts: one orbax checkpoint
    OUT/params/layers_0000n/   ... (n layers a piece, about PIECE_BYTES each)
    OUT/tokenizer.json, OUT/tokenizer_config.json
                     the tokenizer, its special tokens and chat template (`jspec.tokenizer`)

Conversion streams: it reads, fuses, casts and writes one piece at a time on the host (NumPy; no
accelerator is touched), so its peak memory is a piece and a few source tensors, not the model.
Each array is stored in chunks of at most CHUNK_BYTES, so a sharded load reads, for each
device, little more than the chunks that hold its shard, and loading too goes piece by piece.
A folder is written under a temporary name and renamed when complete, so an interrupted
conversion never leaves something that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError, first_line
from jspec.files import writing_folder
from jspec.model import layout, weights
from jspec.model.config import ModelConfig
from jspec.tokenizer import Tokenizer

# 6: parameters in pieces of chunked arrays, gate and up interleaved (jspec.model.layout.gate_up).
FORMAT = 6
# A piece is as many whole layers as fit here (at least one): what conversion holds at a time.
PIECE_BYTES = 256 * 2**20
# Chunks this size or smaller: a device of a model=M mesh reads about its 1/M of an array.
CHUNK_BYTES = 4 * 2**20


META = "jspec.json"  # what marks a folder as a converted checkpoint


def is_converted(path: str | os.PathLike) -> bool:
    return (Path(path) / META).is_file()


def is_current(path: str | os.PathLike) -> bool:
    """Whether `path` is a converted folder this jspec reads (not an older format, not damaged)."""
    try:
        read_meta(path)
    except JspecError:
        return False
    return True


def _read_source(src: str) -> tuple[dict, Mapping[str, np.ndarray], Tokenizer | None, str]:
    """(HF config dict, HF-named tensors read on demand, tokenizer or None, the source's own dtype)
    from a GGUF file or an HF source."""
    if str(src).endswith(".gguf"):
        from jspec.convert.gguf import read_gguf

        return (*read_gguf(src), "float32")  # dequantized values are exact in float32 only
    from jspec.convert.hf import read_config, read_hf, resolve_hf_dir, source_dtype

    folder = resolve_hf_dir(src)
    ModelConfig.from_hf(read_config(folder), str(folder / "config.json"))  # refuse early, before the weights
    hf_config, tensors = read_hf(str(folder))
    return hf_config, tensors, Tokenizer.load(folder), source_dtype(hf_config)


def convert(src: str, out: str | os.PathLike, dtype: str | None = None) -> Path:
    """Convert a GGUF file, an HF folder or a cached hub id into a jspec checkpoint at `out`, in
    `dtype` (None: the source's own, `jspec.convert.hf.source_dtype`; float32 for GGUF)."""
    if dtype is not None and dtype not in weights.DTYPES:
        raise JspecError(f"unknown dtype {dtype!r}; choose {', '.join(weights.DTYPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise JspecError(f"output folder {out} exists and is not empty" if out.is_dir() else f"{out} is a file")
    if is_converted(src):
        raise JspecError(f"{src} is a converted jspec folder already: give it as --model as it is")
    if jax.process_count() > 1:
        return _convert_apart(src, out, dtype)
    hf_config, tensors, tokenizer, own = _read_source(src)
    dtype = dtype or own
    cfg = ModelConfig.from_hf(hf_config)
    if tokenizer is not None:
        # Chat models end turns with their own token (<|im_end|>, <|eot_id|>): stop there too.
        eos = {tokenizer.eos_token_id, *cfg.eos_token_ids} - {None}
        cfg = ModelConfig.from_json({**cfg.to_json(), "eos_token_ids": sorted(eos)})
    # Quantized (int8) after fusing, in float32: a fused matrix's rows keep their own scales.
    kind = weights.FLOATS.get(dtype, np.float32)

    def piece(part: tuple[str, ...] | range):
        if isinstance(part, tuple):
            return layout.outer_from_hf(tensors, part, kind)
        return [layout.layer_from_hf(cfg, tensors, i, kind) for i in part]

    return _write(out, cfg, piece, tokenizer, dtype, str(src))


def _convert_apart(src: str, out: Path, dtype: str | None) -> Path:
    """`jspec convert` in a child process, for a process of a multi-process run: a conversion is
    one host's work (on its own disk, or once on a shared one: jspec.convert.cache.resolve), and
    inside the run orbax would either wait for every process to save with it or, for host data,
    write only from process 0. The child runs on the CPU, leaving the run's accelerators alone."""
    command = [sys.executable, "-m", "jspec.cli", "convert", str(src), str(out), *(["--dtype", dtype] if dtype else [])]
    done = subprocess.run(command, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise JspecError(f"converting {src} failed: {lines[-1].removeprefix('jspec: error: ')}")
    return out


def save(out: str | os.PathLike, cfg: ModelConfig, params, tokenizer: Tokenizer | None, dtype: str,
         source: str) -> Path:
    """Write a parameter tree (NumPy or jax arrays, on any devices of this process) as a
    checkpoint folder, piece by piece."""

    def piece(part: tuple[str, ...] | range):
        return jax.tree.map(np.asarray, _part(params, part))

    return _write(out, cfg, piece, tokenizer, dtype, source)


def pieces(cfg: ModelConfig, layers_per_piece: int):
    """(folder name, part) of every piece of a checkpoint: a part is the names of parameters
    outside the layers, or a range of layers."""
    yield "embed", ("embed", "final_norm")
    if not cfg.tie_word_embeddings:
        yield "lm_head", ("lm_head",)
    for first in range(0, cfg.num_layers, layers_per_piece):
        yield f"layers_{first:05d}", range(first, min(first + layers_per_piece, cfg.num_layers))


def _part(tree, part: tuple[str, ...] | range):
    """A piece's part of a parameter tree (or of a tree matching it)."""
    if isinstance(part, tuple):
        return {name: tree[name] for name in part}
    return tree["layers"][part.start:part.stop]


def layers_per_piece(cfg: ModelConfig, dtype: str) -> int:
    """How many whole layers a piece holds: as many as fit PIECE_BYTES, at least one."""
    layer = layout.param_shapes(cfg)["layers"][0]
    layer_bytes = weights.nbytes(weights.abstract(layer, dtype))
    return max(1, min(cfg.num_layers, PIECE_BYTES // layer_bytes))


def _write(out, cfg: ModelConfig, piece, tokenizer: Tokenizer | None, dtype: str, source: str) -> Path:
    """Write a checkpoint folder (under a temporary name, renamed when complete); `piece(part)`
    gives each piece's tree, made only when it is written."""
    per_piece = layers_per_piece(cfg, dtype)
    with writing_folder(out, META) as tmp:
        for name, part in pieces(cfg, per_piece):
            tree = weights.cast(jax.tree.map(np.asarray, piece(part)), dtype)
            _save_piece(tmp / "params" / name, tree)
            del tree
        if tokenizer is not None:
            tokenizer.save(tmp)
        meta = {"format": FORMAT, "config": cfg.to_json(), "dtype": dtype, "source": source,
                "layers_per_piece": per_piece}
        (tmp / META).write_text(json.dumps(meta, indent=1))
    return Path(out)


def _save_piece(path: Path, tree) -> None:
    """One piece's NumPy tree, in chunks."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path.absolute(), tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree))
    ckpt.wait_until_finished()


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


@contextlib.contextmanager
def reading(where: Path):
    """Run a reader of the file or folder `where` (orbax, tensorstore, numpy): whatever it raises
    on a damaged or crafted file, an undocumented range of types (ValueError, KeyError, zipfile's
    BadZipFile, tensorstore's errors...), becomes one line naming `where`. Orbax's own log (absl)
    is held back meanwhile: where it cannot read a checkpoint it logs a warning before failing,
    a second line beside the one that says so."""
    absl, silent = logging.getLogger("absl"), lambda record: False
    absl.addFilter(silent)
    try:
        yield
    except JspecError:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        while e.__cause__ is not None:  # orbax wraps tensorstore's error, which says what is wrong
            e = e.__cause__
        raise JspecError(f"{where} is damaged or unreadable ({type(e).__name__}: {first_line(e)})") from None
    finally:
        absl.removeFilter(silent)


def saved_tree(path: Path):
    """The arrays (jax.ShapeDtypeStructs) the orbax checkpoint `path` holds, from its metadata,
    for checking before any is read (a head's draft vocabulary, say); refused in one line where
    the metadata is damaged or missing (orbax then reports no metadata at all rather than an error)."""
    import orbax.checkpoint as ocp

    with reading(path):
        meta = ocp.StandardCheckpointer().metadata(path.absolute()).item_metadata
        if meta is None:
            raise JspecError(f"{path} is damaged or not an orbax checkpoint: its metadata cannot be read")
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta.tree)


def named_leaves(tree) -> dict[str, object]:
    """Each leaf of `tree` under its slash-separated name ("layers/0/wqkv")."""
    name = lambda key: str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))  # noqa: E731
    return {"/".join(map(name, path)): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@jax.jit
def _all_finite(x):
    return jnp.all(jnp.isfinite(x))


def _finite(x) -> bool:
    """Whether the array `x` (NumPy, or jax on any devices) holds only finite numbers: on a CPU,
    NumPy over each shard this process holds, in place (a tenth of the time of compiling a program
    for each shape); elsewhere a small program run where the array lives."""
    if not isinstance(x, jax.Array):
        return bool(np.isfinite(x).all())
    if all(d.platform == "cpu" for d in x.devices()):
        return all(bool(np.isfinite(np.asarray(shard.data)).all()) for shard in x.addressable_shards)
    return bool(_all_finite(x))


def check_finite(tree, where: Path) -> None:
    """Refuse float arrays (NumPy or jax, on any devices) that hold a NaN or an infinity, naming
    `where` and the arrays: such weights decode without a word, one token over and over."""
    floats = {k: x for k, x in named_leaves(tree).items() if jnp.issubdtype(x.dtype, jnp.floating)}
    # One at a time: programs with collectives in flight together can deadlock XLA:CPU's
    # in-process all-reduce on a mesh (each waits for threads the other holds).
    bad = [k for k, x in floats.items() if not _finite(x)]
    if bad:
        raise JspecError(f"{where} holds non-finite numbers (NaN or infinity) in {', '.join(bad[:3])}"
                         f"{' ...' if len(bad) > 3 else ''}")


def load(path: str | os.PathLike, dtype: str | None = None, shardings=None):
    """Load a converted checkpoint: (ModelConfig, params, tokenizer or None).

    `dtype` casts on load (e.g. a float32 checkpoint run in bfloat16); `shardings`, a pytree of
    `jax.sharding.Sharding` matching the parameters, places each array directly where it lives
    (None: on the default device). Piece by piece: each piece is read, placed, checked to hold
    only finite numbers and cast before the next is read. A damaged folder, or one whose weights
    hold a NaN or an infinity, is refused in one line.
    """
    path = Path(path).absolute()
    cfg, meta = read_meta(path)
    target = weights.abstract(layout.param_shapes(cfg), meta["dtype"])
    cast = (lambda x: x) if dtype is None or dtype == meta["dtype"] else (lambda x: weights.cast(x, dtype))
    params = {"layers": []}
    for name, part in pieces(cfg, meta["layers_per_piece"]):
        placed = None if shardings is None else _part(shardings, part)
        with reading(path / "params" / name):
            restored = restore(path / "params" / name, _part(target, part), placed)
        check_finite(restored, path / "params" / name)
        restored = cast(restored)
        if isinstance(part, tuple):
            params.update(restored)
        else:
            params["layers"].extend(restored)
    return cfg, params, Tokenizer.load(path)


def read_meta(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The ModelConfig and metadata of a converted checkpoint, refusing another format version and,
    in one line, a damaged or crafted jspec.json."""
    where = Path(path) / META
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise JspecError(f"{where} is unreadable ({first_line(e)}); convert the model again") from None
    if not isinstance(meta, dict):
        raise JspecError(f"{where} is not a JSON object; convert the model again")
    if meta.get("format") != FORMAT:
        raise JspecError(f"{path} was written by another jspec version (format {meta.get('format')}); convert again")
    if meta.get("dtype") not in weights.DTYPES:
        raise JspecError(f"{where}: dtype {meta.get('dtype')!r} is not one of {', '.join(weights.DTYPES)}")
    per_piece = meta.get("layers_per_piece")
    if type(per_piece) is not int or per_piece < 1:
        raise JspecError(f"{where}: layers_per_piece must be a whole number >= 1, got {per_piece!r}")
    if not isinstance(meta.get("config"), dict):
        raise JspecError(f"{where} has no model config; convert the model again")
    return ModelConfig.from_json(meta["config"], str(where)), meta
