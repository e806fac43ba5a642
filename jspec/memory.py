"""A batch's KV cache on the devices: how long it is, what it costs a device, whether a device has
room for it, and making one. A new cache is checked before it is made (`replace_cache`), so a batch
too large for the device is refused with what to change, not an allocator's error mid-run."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jspec.errors import JspecError
from jspec.model import sharding
from jspec.model.config import ModelConfig
from jspec.model.decoder import KVCache

GIB = 1 << 30
CACHE_ALIGN = 64  # cache lengths are multiples of this: fewer programs


def cache_length(bucket: int, max_new_tokens: int, max_draft: int) -> int:
    """Positions of the cache of a batch whose prompts' bucket is `bucket`: the prompt, the new
    tokens and one round's draft and its target token, rounded up to CACHE_ALIGN."""
    return -(-(bucket + max_new_tokens + max_draft + 1) // CACHE_ALIGN) * CACHE_ALIGN


def cache_bytes(cfg: ModelConfig, rows: int, length: int, mesh: jax.sharding.Mesh | None = None,
                dtype=jnp.float32) -> int:
    """Bytes one device holds of a batch's KV cache (`KVCache.zeros`: k and v of each layer,
    [rows, length, kv heads, head dim] in `dtype`), split over `mesh` as `sharding.cache_sharding`
    splits it."""
    leaves = jax.tree.leaves(jax.eval_shape(functools.partial(KVCache.zeros, cfg, rows, length, dtype)))
    share = lambda x: x.shape if mesh is None else sharding.cache_sharding(mesh, x.shape).shard_shape(x.shape)
    return sum(math.prod(share(x)) * x.dtype.itemsize for x in leaves)


def check_cache_fits(rows: int, length: int, need: int, stats: dict | None, freed: int = 0) -> None:
    """Refuse a KV cache of `need` bytes per device that the memory left free on a device (its
    `memory_stats()`, once `freed` bytes, the cache kept from the last batch, are freed) cannot
    hold. A device that reports no limit is not checked. The program's own temporaries, a
    drafter's cache among them, come on top: passing is no promise that it runs."""
    if not stats or "bytes_limit" not in stats:
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) + freed
    if need > free:
        raise JspecError(
            f"the KV cache of {rows} row{'s' * (rows != 1)} x {length} positions needs {need / GIB:.2f} GiB per "
            f"device but the device has {max(free, 0) / GIB:.2f} GiB free: use a smaller --batch-size or "
            "--max-new-tokens, shorter prompts, a --mesh with more data or model shards, --kv-cache-dtype bfloat16 or "
            "--dtype bfloat16 or int8 weights")


def memory_stats(mesh: jax.sharding.Mesh | None) -> list[dict | None]:
    """The memory stats of each device of this process that a cache goes to. A CPU device reports
    none: its memory is the host's, shared by this process's CPU devices, so each gets its part of
    what the host has available."""
    devices = jax.local_devices()[:1] if mesh is None else list(mesh.local_devices)
    stats = [d.memory_stats() for d in devices]
    cpus = sum(s is None and d.platform == "cpu" for d, s in zip(devices, stats))
    host = host_memory_available() if cpus else None
    return [{"bytes_limit": host // cpus, "bytes_in_use": 0} if s is None and d.platform == "cpu" and host else s
            for d, s in zip(devices, stats)]


def host_memory_available() -> int | None:
    """Bytes the host can still give this process without swapping (Linux's MemAvailable), or None
    where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def replace_cache(cfg: ModelConfig, rows: int, length: int, mesh: jax.sharding.Mesh | None, dtype,
                  kept: dict) -> KVCache:
    """A new cache of `rows` x `length` in `dtype`, checked to fit each device it goes to once the
    caches `kept` ({(rows, length): KVCache}, the last batch's) are freed, and made after they are."""
    need = cache_bytes(cfg, rows, length, mesh, dtype)
    freed = sum(cache_bytes(cfg, *shape, mesh, dtype) for shape in kept)
    for stats in memory_stats(mesh):
        check_cache_fits(rows, length, need, stats, freed)
    for old in kept.values():
        for x in jax.tree.leaves(old):
            x.delete()  # now, not whenever the last reference goes: before the new one is made
    zeros = functools.partial(KVCache.zeros, cfg, rows, length, dtype)
    if mesh is None:
        return zeros()
    # made in place on each device: a multi-process mesh has devices this process cannot feed
    shape = (rows, length, cfg.num_kv_heads, cfg.head_dim)
    return jax.jit(zeros, out_shardings=sharding.cache_sharding(mesh, shape))()
