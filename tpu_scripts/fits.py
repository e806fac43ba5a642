"""What fits where: bfloat16 weights + jspec's KV cache per chip, for Llama shapes on TPU meshes.

Computed from jspec's own parameter shapes (`jspec.model.layout.param_shapes`) and sharding rules
(`jspec.model.sharding.RULES`, `CACHE_RULE`): a dimension splits over its mesh axis only when the axis
size divides it, as in jspec. The KV cache is float32 (jspec keeps activations and the cache in
float32, docs/design.md "Batch invariance"), sized for `--batch-size` rows per data shard and a
context of prompt + new tokens + the verification's K + 1.

    python tpu_scripts/fits.py                  # the table in tpu_scripts/README.md
    python tpu_scripts/fits.py --context 8192 --rows 16
"""

from __future__ import annotations

import argparse
import math

import jax

from jspec.model import sharding
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


def weights_bytes(cfg: ModelConfig, mesh: dict[str, int]) -> int:
    def leaves(tree, name=None):
        if isinstance(tree, dict):
            for k, v in tree.items():
                yield from leaves(v, k)
        elif isinstance(tree, list):
            for v in tree:
                yield from leaves(v, name)
        else:
            yield name, tree

    return sum(2 * per_chip(shape, sharding.RULES[name], mesh) for name, shape in leaves(param_shapes(cfg)))


def cache_bytes(cfg: ModelConfig, mesh: dict[str, int], rows: int, context: int) -> int:
    shape = (rows * mesh["data"], context, cfg.num_kv_heads, cfg.head_dim)
    return 2 * cfg.num_layers * 4 * per_chip(shape, sharding.CACHE_RULE, mesh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8, help="batch rows per data shard (default: 8)")
    p.add_argument("--context", type=int, default=4096, help="cache positions per row (default: 4096)")
    args = p.parse_args()
    print(f"bfloat16 weights + float32 KV cache for {args.rows} rows per data shard x {args.context} positions, "
          f"GiB per chip (jax {jax.__version__}); 'yes' where it leaves 10% of HBM free\n")
    print("| model | mesh (data x model) | chips | weights | KV cache | total | " + " | ".join(CHIPS) + " |")
    print("| --- | --- | ---: | ---: | ---: | ---: | " + " | ".join("---" for _ in CHIPS) + " |")
    for name, shape in LLAMAS.items():
        cfg = config(shape)
        for data, model in MESHES:
            mesh = {"data": data, "model": model}
            w, kv = weights_bytes(cfg, mesh) / GIB, cache_bytes(cfg, mesh, args.rows, args.context) / GIB
            fits = ["yes" if w + kv <= 0.9 * hbm else "no" for hbm in CHIPS.values()]
            print(f"| {name} | {data} x {model} | {data * model} | {w:.1f} | {kv:.1f} | {w + kv:.1f} | "
                  + " | ".join(fits) + " |")


if __name__ == "__main__":
    main()
