"""XLA's persistent compilation cache: where jspec points it, and programs that come back from it."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from jspec import compilation_cache


@pytest.fixture
def jax_settings(monkeypatch, tmp_path):
    """JAX's cache settings as a new process without JAX_COMPILATION_CACHE_DIR has them, restored
    after: a folder left set would cache the programs of every later test in this process."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_enable_compilation_cache", saved[1])


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_accelerators_keep_programs_in_the_jspec_cache(jax_settings, monkeypatch, tmp_path, backend):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    compilation_cache.use_default()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache" / "xla")
    assert compilation_cache.describe() == str(tmp_path / "cache" / "xla")


def test_a_cpu_keeps_none_unless_asked(jax_settings):
    assert jax.default_backend() == "cpu"
    compilation_cache.use_default()
    assert jax.config.jax_compilation_cache_dir is None
    assert compilation_cache.describe().startswith("off on a CPU (set JAX_COMPILATION_CACHE_DIR")


def test_the_users_choice_stands(jax_settings, monkeypatch, tmp_path):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    compilation_cache.use_default()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")

    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.use_default()
    assert jax.config.jax_compilation_cache_dir is None
    assert compilation_cache.describe() == "off (JAX_ENABLE_COMPILATION_CACHE=false)"


def test_a_new_process_runs_the_cached_programs(tiny_chat_model, tmp_path):
    """A second `jspec generate` loads every program the first compiled and prints the same text:
    the native kernel's calls and the donated caches survive serialization."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"), "JSPEC_CACHE": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # the tiny model's programs compile fast
           "JAX_LOG_COMPILES": "1", "JAX_EXPLAIN_CACHE_MISSES": "1"}  # each hit and miss, logged
    argv = [sys.executable, "-m", "jspec.cli", "generate", "Name three primes.", "--model", tiny_chat_model,
            "--method", "ngram", "--max-draft", "2", "--max-new-tokens", "12"]
    miss, hit = "PERSISTENT COMPILATION CACHE MISS for 'jit_generate'", "cache hit for 'jit_generate'"

    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0 and first.stdout.strip(), first.stderr
    assert miss in first.stderr and hit not in first.stderr
    second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert hit in second.stderr and "PERSISTENT COMPILATION CACHE MISS" not in second.stderr
    assert second.stdout == first.stdout
