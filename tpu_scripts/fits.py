"""What fits where: bfloat16 or int8 weights + jspec's KV cache per chip, for Llama shapes on TPU meshes.

Computed from jspec's own parameter shapes (`jspec.model.layout.param_shapes`) and sharding rules
(`jspec.model.sharding.RULES`, `CACHE_RULE`): a dimension splits over its mesh axis only when the axis
size divides it, as in jspec. The KV cache is float32 by default (jspec's default numerics keep
activations and the cache in float32, docs/design.md "Batch invariance"; `--kv-cache-dtype
bfloat16` halves it), sized for `--rows` rows per data shard and a context of prompt + new
tokens + the verification's K + 1. Int8 weights (`--dtype int8`, jspec.model.weights) are a byte
a parameter and a float32 scale a matrix row, split with their rows.

    python tpu_scripts/fits.py                  # the table in tpu_scripts/README.md
    python tpu_scripts/fits.py --context 8192 --rows 16 --kv-cache-dtype bfloat16

A second table gives the host memory that converting and loading take, from the checkpoint's
pieces (`jspec.convert.store.pieces`): conversion and loading stream a piece at a time.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np

from jspec.convert import store
from jspec.model import numerics, sharding, weights
from jspec.model.config import ModelConfig
from jspec.model.layout import param_shapes

GIB = 1024 ** 3
# Llama 3.2 1B, Llama 3.1 8B and 70B (their config.json values).
LLAMAS = {
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                         head_dim=64, tie_word_embeddings=True),
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, tie_word_embeddings=False),
    "Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                          head_dim=128, tie_word_embeddings=False),
}
MESHES = [(1, 1), (1, 4), (1, 8), (4, 8), (1, 16)]
CHIPS = {"v5e": 16, "v4 / v6e": 32, "v5p": 95}  # HBM per chip, GiB


def config(shape: dict) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=131072, attention_bias=False, **shape)


def per_chip(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: dict[str, int]) -> int:
    """Elements one chip holds of an array of `shape` split by `axes` over `mesh` sizes."""
    return math.prod(d // mesh[a] if a is not None and d % mesh[a] == 0 else d for d, a in zip(shape, axes))


def weights_bytes(cfg: ModelConfig, mesh: dict[str, int], dtype: str = "bfloat16") -> int:
    """Bytes of the weights stored in `dtype` one chip holds, each array split by its rule (an
    int8 matrix's scale by its rows' axis)."""
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(weights.abstract(param_shapes(cfg), dtype))[0]:
        total += np.dtype(x.dtype).itemsize * per_chip(x.shape, sharding.rule(path, len(x.shape)), mesh)
    return total


def cache_bytes(cfg: ModelConfig, mesh: dict[str, int], rows: int, context: int, dtype: str = "float32") -> int:
    shape = (rows * mesh["data"], context, cfg.num_kv_heads, cfg.head_dim)
    return 2 * cfg.num_layers * np.dtype(numerics.DTYPES[dtype]).itemsize * per_chip(shape, sharding.CACHE_RULE, mesh)


# A converting or loading process before its first piece: jax, orbax and tensorstore. Calibrated on
# the 1.56B model of docs/benchmarks.md ("Big models"): 1.05 GB converting, whose largest piece
# is 0.23 GiB, where this predicts 0.95 GiB (1.02 GB).
PROCESS = 0.5 * GIB


def largest_piece(cfg: ModelConfig, dtype: str = "bfloat16") -> int:
    """Bytes of the largest piece of a converted checkpoint (jspec.convert.store.pieces)."""
    stored = weights.abstract(param_shapes(cfg), dtype)
    per_piece = store.layers_per_piece(cfg, dtype)
    return max(weights.nbytes([stored[name] for name in part] if isinstance(part, tuple)
                              else stored["layers"][part.start:part.stop])
               for _, part in store.pieces(cfg, per_piece))


def host_memory(cfg: ModelConfig) -> tuple[int, int]:
    """(converting, loading onto accelerators): a host's peak memory, from how jspec streams. A
    conversion holds a piece and the source tensor it is cast from; a load reads a piece at a
    time and hands each array to the devices, keeping at most the host's share of one piece."""
    piece = largest_piece(cfg)
    return PROCESS + 2 * piece, PROCESS + piece


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8, help="batch rows per data shard (default: 8)")
    p.add_argument("--context", type=int, default=4096, help="cache positions per row (default: 4096)")
    p.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    print(f"bfloat16 or int8 weights + {args.kv_cache_dtype} KV cache for {args.rows} rows per data shard x "
          f"{args.context} positions, GiB per chip (jax {jax.__version__}); a chip's column says whether bfloat16 / "
          "int8 weights fit, leaving 10% of HBM free\n")
    print("| model | mesh (data x model) | chips | weights bf16 | weights int8 | KV cache | "
          + " | ".join(CHIPS) + " |")
    print("| --- | --- | ---: | ---: | ---: | ---: | " + " | ".join("---" for _ in CHIPS) + " |")
    for name, shape in LLAMAS.items():
        cfg = config(shape)
        for data, model in MESHES:
            mesh = {"data": data, "model": model}
            bf16, int8 = (weights_bytes(cfg, mesh, d) / GIB for d in ("bfloat16", "int8"))
            kv = cache_bytes(cfg, mesh, args.rows, args.context, args.kv_cache_dtype) / GIB
            fits = [" / ".join("yes" if w + kv <= 0.9 * hbm else "no" for w in (bf16, int8)) for hbm in CHIPS.values()]
            print(f"| {name} | {data} x {model} | {data * model} | {bf16:.1f} | {int8:.1f} | {kv:.1f} | "
                  + " | ".join(fits) + " |")
    print("\nConverting (`jspec convert`, on any host) and loading (per host, onto its accelerators), bfloat16, "
          "GiB of host memory\n")
    print("| model | checkpoint | largest piece | converting | loading, per host |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, shape in LLAMAS.items():
        cfg = config(shape)
        convert, load = host_memory(cfg)
        print(f"| {name} | {weights_bytes(cfg, {'data': 1, 'model': 1}) / GIB:.1f} | {largest_piece(cfg) / GIB:.2f} "
              f"| {convert / GIB:.1f} | {load / GIB:.1f} |")


if __name__ == "__main__":
    main()
