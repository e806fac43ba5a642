"""Read a Hugging Face checkpoint (local directory or cached hub id): its config and its tensors,
each read from disk when asked for (`jspec.convert.tensors.Tensors`), in the dtype it is stored in.

Safetensors files are parsed directly (an 8-byte header length, a JSON header, then raw
little-endian data) instead of through `safetensors.safe_open`: its numpy backend cannot
represent bfloat16, which is how most modern checkpoints are stored, and the flax/torch
backends would pull a framework (and a device) into what is plain file reading.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from huggingface_hub import snapshot_download

from jspec.convert.tensors import Tensors
from jspec.errors import JspecError, first_line
from jspec.model.config import ModelConfig

_SAFETENSORS_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit on a header
# (index file, glob for the weight files) in order of preference: safetensors, then PyTorch pickles.
_WEIGHT_FORMATS = (
    ("model.safetensors.index.json", "model*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


def resolve_hf_dir(src: str) -> Path:
    """The directory holding `src`'s config.json (a readable JSON object), weights and tokenizer files.

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
    read_config(path)  # refused here, in one line, before any caller parses it
    return path


def read_config(directory: Path) -> dict:
    """A model directory's config.json, parsed: a JSON object, or a JspecError naming the file."""
    return _read_json_object(directory / "config.json")


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8; nesting past the parser's depth
        raise JspecError(f"{path} is not valid JSON ({first_line(e)})") from None
    except OSError as e:
        raise JspecError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(value, dict):
        raise JspecError(f"{path} is not a JSON object")
    return value


def read_hf(src: str) -> tuple[dict, Tensors]:
    """The parsed config.json and the checkpoint's tensors by HF name, read one at a time: every
    tensor the config asks for, in its shape (`Tensors.check`), every file's layout checked
    against its size before any is read.

    Tied models keep whatever the files hold (usually no `lm_head.weight`); the config's
    `tie_word_embeddings` says how to treat that.
    """
    directory = resolve_hf_dir(src)
    config = read_config(directory)
    readers, shapes, files = {}, {}, {}
    for file in _weight_files(directory):
        read = _read_safetensors if file.suffix == ".safetensors" else _read_torch_bin
        for name, (shape, reader) in read(file).items():
            if name in files:
                raise JspecError(f"tensor {name} is in both {files[name]} and {file.name} in '{directory}'")
            readers[name], shapes[name], files[name] = reader, shape, file.name
    tensors = Tensors(readers, shapes)
    tensors.check(ModelConfig.from_hf(config, str(directory / "config.json")), f"'{directory}'")
    return config, tensors


def source_dtype(config: dict) -> str:
    """The dtype a conversion keeps by default: a checkpoint's own where jspec has it (bfloat16
    for Llama-3's), float32 for float16 and float32 checkpoints (float16 has no exact bfloat16)."""
    return "bfloat16" if str(config.get("torch_dtype") or config.get("dtype")) == "bfloat16" else "float32"


def _weight_files(directory: Path) -> list[Path]:
    """The weight files to read: those an index lists, else those matching the usual names."""
    for index_name, pattern in _WEIGHT_FORMATS:
        index = directory / index_name
        if index.is_file():
            files = _indexed_files(index)
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


def _indexed_files(index: Path) -> list[Path]:
    """The weight files an index's weight_map names, each a plain file name in the index's folder."""
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise JspecError(f"{index} has no weight_map of tensor names to file names")
    for name in set(weight_map.values()):
        if Path(name).name != name or name in ("", ".", ".."):
            raise JspecError(f"{index} names {name!r}, which is not a file in its folder")
    return sorted({index.parent / name for name in weight_map.values()})


def _read_safetensors(path: Path) -> dict:
    """name -> (shape, reader) for every tensor of one safetensors file, its header checked against
    the file: a JSON object of float tensors whose shapes and byte ranges agree and lie inside the
    data. A reader reads its bytes with a plain file read (not a memory map, whose pages would stay
    resident)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if size < 8 or not 2 <= header_len <= min(size - 8, _MAX_HEADER):  # else garbage read as a length
            raise JspecError(f"{path} is not a valid safetensors file: its header length ({header_len} bytes) "
                             f"does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError) as e:
            raise JspecError(f"{path} is not a valid safetensors file: "
                             f"its header is not JSON ({first_line(e)})") from None
    if not isinstance(header, dict):
        raise JspecError(f"{path} is not a valid safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    tensors = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = _checked_entry(path, name, info, data_len)

        def read(begin=begin, count=math.prod(shape), dtype=dtype, shape=shape, name=name):
            with open(path, "rb") as f:
                f.seek(8 + header_len + begin)
                values = np.fromfile(f, dtype, count)
            if values.size != count:
                raise JspecError(f"{path} ended inside tensor {name}: the file changed after it was opened")
            return values.astype(dtype.newbyteorder("="), copy=False).reshape(shape)

        tensors[name] = shape, read
    return tensors


def _checked_entry(path: Path, name: str, info, data_len: int) -> tuple[np.dtype, tuple[int, ...], tuple[int, int]]:
    """(little-endian dtype, shape, data offsets) of one safetensors header entry, each checked."""
    def bad(what: str) -> JspecError:
        return JspecError(f"tensor {name} in {path} {what}")

    if not isinstance(info, dict):
        raise bad("has no dtype, shape and data_offsets")
    kind, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(kind, str):
        raise bad(f"has dtype {kind!r}, which is not a safetensors dtype")
    if kind not in _SAFETENSORS_FLOATS:
        raise bad(f"has dtype {kind[:20]}; jspec reads float checkpoints only")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_count(n) for n in shape):
        raise bad(f"has shape {str(shape)[:60]}; expected a list of at most 8 non-negative whole numbers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(n) for n in offsets):
        raise bad(f"has data_offsets {str(offsets)[:60]}; expected [begin, end]")
    dtype = np.dtype(_SAFETENSORS_FLOATS[kind]).newbyteorder("<")
    (begin, end), nbytes = offsets, math.prod(shape) * dtype.itemsize
    if not begin <= end <= data_len:
        raise bad(f"has data_offsets [{begin}, {end}] outside the file's {data_len} bytes of data")
    if end - begin != nbytes:
        raise bad(f"has {end - begin} bytes of data; its shape {tuple(shape)} in {kind} needs {nbytes}")
    return dtype, tuple(shape), (begin, end)


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _read_torch_bin(path: Path) -> dict:
    """name -> (shape, reader) for one PyTorch pickle, memory-mapped; torch is imported only for
    this format. A reader gives float32 (numpy has no bfloat16 for torch to hand over)."""
    try:
        import torch
    except ImportError:
        raise JspecError("reading PyTorch .bin checkpoints needs torch: pip install torch==2.13.0") from None
    try:
        # weights_only: tensors and plain containers only; a pickle that names any other callable is refused.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - a damaged zip, a refused or broken pickle: torch raises many kinds
        raise JspecError(f"{path} is not a PyTorch checkpoint jspec can read ({first_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise JspecError(f"{path} does not hold a state dict of tensor names to tensors")
    tensors = {}
    for name, value in state.items():
        if not value.is_floating_point():
            raise JspecError(f"tensor {name} in {path.name} has dtype {value.dtype}; jspec reads float checkpoints only")
        tensors[name] = tuple(value.shape), lambda value=value: value.float().numpy()
    return tensors
