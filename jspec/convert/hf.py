"""Read a Hugging Face checkpoint (local directory or cached hub id): its config and its tensors,
each read from disk when asked for (`jspec.convert.tensors.Tensors`), in the dtype it is stored in.

Safetensors files are parsed directly (an 8-byte header length, a JSON header, then raw
little-endian data) instead of through `safetensors.safe_open`: its numpy backend cannot
represent bfloat16, which is how most modern checkpoints are stored, and the flax/torch
backends would pull a framework (and a device) into what is plain file reading.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from huggingface_hub import snapshot_download

from jspec.convert.tensors import Tensors
from jspec.errors import JspecError

_SAFETENSORS_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
# (index file, glob for the weight files) in order of preference: safetensors, then PyTorch pickles.
_WEIGHT_FORMATS = (
    ("model.safetensors.index.json", "model*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


def resolve_hf_dir(src: str) -> Path:
    """The directory holding `src`'s config.json, weights and tokenizer files.

    `src` is a local directory, or a hub id already in the local Hugging Face cache:
    jspec never downloads, so a missing model fails here rather than stalling on the network.
    """
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise JspecError(f"'{src}' is a file; expected a Hugging Face model directory (config.json + weights)")
    else:
        try:
            path = Path(snapshot_download(src, local_files_only=True))
        except (ValueError, FileNotFoundError):  # invalid repo id, or not in the cache
            raise JspecError(
                f"model '{src}' is neither a local path nor a hub id in the local Hugging Face cache "
                "(jspec never downloads)"
            ) from None
    if not (path / "config.json").is_file():
        raise JspecError(f"'{path}' has no config.json; is it a Hugging Face model directory?")
    return path


def read_config(directory: Path) -> dict:
    """A model directory's config.json, parsed."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise JspecError(f"{directory / 'config.json'} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise JspecError(f"{directory / 'config.json'} is not a JSON object")
    return config


def read_hf(src: str) -> tuple[dict, Tensors]:
    """The parsed config.json and the checkpoint's tensors by HF name, read one at a time.

    Tied models keep whatever the files hold (usually no `lm_head.weight`); the config's
    `tie_word_embeddings` says how to treat that.
    """
    directory = resolve_hf_dir(src)
    config = read_config(directory)
    readers, shapes = {}, {}
    for file in _weight_files(directory):
        read = _read_safetensors if file.suffix == ".safetensors" else _read_torch_bin
        for name, (shape, reader) in read(file).items():
            readers[name], shapes[name] = reader, shape
    return config, Tensors(readers, shapes)


def source_dtype(config: dict) -> str:
    """The dtype a conversion keeps by default: a checkpoint's own where jspec has it (bfloat16
    for Llama-3's), float32 for float16 and float32 checkpoints (float16 has no exact bfloat16)."""
    return "bfloat16" if str(config.get("torch_dtype") or config.get("dtype")) == "bfloat16" else "float32"


def _weight_files(directory: Path) -> list[Path]:
    """The weight files to read: those an index lists, else those matching the usual names."""
    for index_name, pattern in _WEIGHT_FORMATS:
        index = directory / index_name
        if index.is_file():
            files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise JspecError(f"'{directory}' lacks weight files listed in {index_name}: {', '.join(missing)}")
            return files
        files = sorted(directory.glob(pattern))
        if files:
            return files
    raise JspecError(
        f"'{directory}' has no weight files (model.safetensors, model-*-of-*.safetensors or pytorch_model*.bin)"
    )


def _read_safetensors(path: Path) -> dict:
    """name -> (shape, reader) for every tensor of one safetensors file. A reader reads its bytes
    with a plain file read (not a memory map, whose pages would stay resident)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            if not 2 <= header_len <= size - 8:  # else garbage read as a length
                raise ValueError("header length")
            header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("header")
        except ValueError:
            raise JspecError(f"{path} is not a valid safetensors file") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _SAFETENSORS_FLOATS:
            raise JspecError(f"tensor {name} in {path.name} has dtype {info['dtype']}; jspec reads float checkpoints only")
        dtype = np.dtype(_SAFETENSORS_FLOATS[info["dtype"]]).newbyteorder("<")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])

        def read(begin=begin, count=(end - begin) // dtype.itemsize, dtype=dtype, shape=shape):
            with open(path, "rb") as f:
                f.seek(8 + header_len + begin)
                return np.fromfile(f, dtype, count).astype(dtype.newbyteorder("="), copy=False).reshape(shape)

        tensors[name] = shape, read
    return tensors


def _read_torch_bin(path: Path) -> dict:
    """name -> (shape, reader) for one PyTorch pickle, memory-mapped; torch is imported only for
    this format. A reader gives float32 (numpy has no bfloat16 for torch to hand over)."""
    try:
        import torch
    except ImportError:
        raise JspecError("reading PyTorch .bin checkpoints needs torch: pip install torch==2.13.0") from None
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    tensors = {}
    for name, value in state.items():
        if not value.is_floating_point():
            raise JspecError(f"tensor {name} in {path.name} has dtype {value.dtype}; jspec reads float checkpoints only")
        tensors[name] = tuple(value.shape), lambda value=value: value.float().numpy()
    return tensors
