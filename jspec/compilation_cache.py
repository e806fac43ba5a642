"""XLA's persistent compilation cache: on by default on GPUs and TPUs, one setting away on a CPU.

jspec's programs unroll the model's layers (docs/design.md), so each takes seconds to compile,
and a new process compiles them again. JAX can keep compiled programs on disk; jspec points it at
`$JSPEC_CACHE/xla` unless the user chose otherwise. Not on a CPU: there XLA's loader rejects every
cached program on some Intel CPUs (jax-ml/jax#38445), logging an error each time, so there the
user opts in with JAX's own `JAX_COMPILATION_CACHE_DIR`.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jspec.convert import cache


def default_dir() -> Path:
    return cache.cache_dir() / "xla"


def use_default() -> None:
    """Point JAX's compilation cache at `default_dir()` on an accelerator, unless the user set a
    folder of their own or turned the cache off (`JAX_ENABLE_COMPILATION_CACHE=false`)."""
    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return
    if jax.default_backend() != "cpu":
        jax.config.update("jax_compilation_cache_dir", str(default_dir()))


def describe() -> str:
    """Where compiled programs are kept, for `jspec env` (call after `use_default`)."""
    if not jax.config.jax_enable_compilation_cache:
        return "off (JAX_ENABLE_COMPILATION_CACHE=false)"
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    return "off on a CPU (set JAX_COMPILATION_CACHE_DIR to a folder to keep compiled programs)"
