"""The KV cache's memory: one cache alive at a time however many shapes a run goes through, and a
batch whose cache cannot fit the device refused with a clear error before anything is allocated.

A tiny random model (3 layers, 2 kv heads of 16) is enough: the cache's arrays are told apart
from the weights by their shape, [rows, length, kv heads, head dim]."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import TINY

from jspec import memory
from jspec.batching import prompt_bucket
from jspec.errors import JspecError
from jspec.model import sharding

GIB = 1 << 30
NEW = 4
# Prompt lengths in six prompt buckets (32, 64, 128, 256, 384, 512), so six cache lengths.
LENGTHS = (20, 50, 100, 200, 300, 400)


def cache_length(n: int) -> int:
    """The cache length `Model.run_batch` gives a one-row `ar` batch of an n-token prompt."""
    return -(-(prompt_bucket(n) + NEW + 1) // memory.CACHE_ALIGN) * memory.CACHE_ALIGN


def cache_arrays(model) -> list[jax.Array]:
    """The live arrays shaped like a layer's k or v cache of one row (no weight is 4-D)."""
    kv = (model.cfg.num_kv_heads, model.cfg.head_dim)
    return [x for x in jax.live_arrays() if x.ndim == 4 and x.shape[0] == 1 and x.shape[2:] == kv]


def test_one_cache_alive_across_shapes(tiny_llama):
    model = tiny_llama.jspec_model(eos_token_ids=())
    lengths = [cache_length(n) for n in LENGTHS]
    assert len(set(lengths)) == len(LENGTHS)  # six shapes: the old per-shape dict kept six caches
    before = cache_arrays(model)
    rng = np.random.default_rng(0)
    prompts = [{"token_ids": rng.integers(0, TINY["vocab_size"], n).tolist()} for n in LENGTHS]
    records = model.generate(prompts, max_new_tokens=NEW)
    assert [r["new_tokens"] for r in records] == [NEW] * len(LENGTHS)
    after = [x for x in cache_arrays(model) if not any(x is y for y in before)]
    # What is left is one cache, the last batch's: k and v of each layer, of its length.
    layers = model.cfg.num_layers
    assert len(after) == 2 * layers, sorted(x.shape[1] for x in after)
    assert {x.shape[1] for x in after} == {lengths[-1]}
    assert sum(x.nbytes for x in after) == memory.cache_bytes(model.cfg, 1, lengths[-1])
    # A batch of a shape seen before reuses the kept cache or replaces it; still one alive.
    model.generate(prompts[:1], max_new_tokens=NEW)
    after = [x for x in cache_arrays(model) if not any(x is y for y in before)]
    assert len(after) == 2 * layers and {x.shape[1] for x in after} == {lengths[0]}


def test_cache_bytes(tiny_llama):
    cfg = tiny_llama.cfg
    # k and v, per layer, [rows, length, kv heads, head dim] in float32.
    assert memory.cache_bytes(cfg, 4, 128) == 2 * cfg.num_layers * 4 * 128 * cfg.num_kv_heads * cfg.head_dim * 4
    # On a mesh, a device holds its share: rows split over data, kv heads (2) over model.
    for spec, share in (("data=2", 2), ("model=2", 2), ("data=2,model=2", 4), ("data=4,model=2", 8)):
        mesh = sharding.make_mesh(spec)
        assert memory.cache_bytes(cfg, 4, 128, mesh) * share == memory.cache_bytes(cfg, 4, 128), spec
    # Rows or kv heads that do not divide over an axis are kept whole on each device.
    assert memory.cache_bytes(cfg, 3, 128, sharding.make_mesh("data=2")) == memory.cache_bytes(cfg, 3, 128)
    assert memory.cache_bytes(cfg, 4, 128, sharding.make_mesh("model=4")) == memory.cache_bytes(cfg, 4, 128)


def test_fit_check():
    stats = {"bytes_limit": 16 * GIB, "bytes_in_use": 10 * GIB}
    memory.check_cache_fits(8, 4096, 6 * GIB, stats)  # exactly what is free
    memory.check_cache_fits(8, 4096, 9 * GIB, stats, freed=3 * GIB)  # once the kept cache is freed
    memory.check_cache_fits(8, 4096, 1000 * GIB, None)  # a CPU reports no memory: nothing to check
    memory.check_cache_fits(8, 4096, 1000 * GIB, {"bytes_in_use": 10 * GIB})  # nor without a limit
    with pytest.raises(JspecError) as e:
        memory.check_cache_fits(8, 4096, 9 * GIB, stats, freed=2 * GIB)
    message = str(e.value)
    assert "\n" not in message
    assert "8 rows x 4096 positions" in message and "9.00 GiB" in message and "8.00 GiB free" in message
    for advice in ("--batch-size", "--max-new-tokens", "--mesh", "bfloat16"):
        assert advice in message


def test_too_large_cache_refused_before_allocating(tiny_llama, monkeypatch):
    """With the device reporting too little memory, a batch fails with the fit error, and neither a
    cache nor a program is made for it."""
    model = tiny_llama.jspec_model(eos_token_ids=())
    need = memory.cache_bytes(model.cfg, 1, cache_length(20))
    stats = {"bytes_limit": need - 1, "bytes_in_use": 0}
    monkeypatch.setattr(memory, "memory_stats", lambda mesh: [stats])
    before = cache_arrays(model)
    with pytest.raises(JspecError, match="1 row x 64 positions"):
        model.generate([{"token_ids": [1] * 20}], max_new_tokens=NEW)
    assert model.programs() == {}
    assert len(cache_arrays(model)) == len(before)


def test_a_cpu_cache_is_checked_against_the_hosts_memory(tiny_llama, monkeypatch):
    """A CPU reports no memory stats: the host's available memory, shared by the process's CPU
    devices, is what a cache must fit (a batch too large fails in one line, not in the OOM killer)."""
    model = tiny_llama.jspec_model(eos_token_ids=())
    need = memory.cache_bytes(model.cfg, 1, cache_length(20))
    monkeypatch.setattr(memory, "host_memory_available", lambda: need - 1)
    with pytest.raises(JspecError, match="1 row x 64 positions"):
        model.generate([{"token_ids": [1] * 20}], max_new_tokens=NEW)
    monkeypatch.setattr(memory, "host_memory_available", lambda: need)
    assert len(model.generate([{"token_ids": [1] * 20}], max_new_tokens=NEW)[0]["token_ids"]) == NEW
