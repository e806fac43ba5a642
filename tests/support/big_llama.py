"""A random-weight Llama checkpoint of about 1.56B parameters, written as Hugging Face writes one
(bfloat16 safetensors in several shards, an index, config.json): the stand-in for the 8B-70B
models jspec's users run, at the largest size this 24 GiB machine converts and loads on a mesh
of 8 simulated devices. Never shipped; written when a benchmark or test asks for it.

    python tests/support/big_llama.py OUT [--layers 24] [--shards 5]

Tensors are written one at a time as raw little-endian bfloat16 (no torch, no safetensors
package), so writing it takes a tensor's memory, not the model's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

# SmolLM2's vocabulary, Llama-3.2-1B's widths: 1.56B parameters with 24 layers (3.12 GB in bf16).
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=49152, max_position_embeddings=4096)


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    d, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = SHAPE["num_key_value_heads"] * d // SHAPE["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    return shapes


def write(out: str | Path, layers: int = 24, shards: int = 5, seed: int = 0) -> Path:
    """Write the checkpoint into the folder `out` (created); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(layers)
    total = sum(math.prod(s) for s in shapes.values()) * 2
    rng = np.random.default_rng(seed)
    names, groups, size = list(shapes), [[]], 0
    for name in names:  # consecutive tensors, about total / shards bytes a file
        if size >= total / shards * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(name)
        size += math.prod(shapes[name]) * 2
    weight_map = {}
    for k, group in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {}, 0
        for name in group:
            nbytes = math.prod(shapes[name]) * 2
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name in group:
                shape = shapes[name]
                fan_in = shape[-1] if len(shape) == 2 else None
                values = (np.ones(shape, np.float32) if fan_in is None
                          else rng.standard_normal(shape, np.float32) / np.sqrt(fan_in))
                f.write(values.astype(ml_dtypes.bfloat16).tobytes())
                del values
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, **SHAPE}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--shards", type=int, default=5)
    args = p.parse_args()
    out = write(args.out, args.layers, args.shards)
    print(f"wrote {out}: {sum(f.stat().st_size for f in out.glob('*.safetensors')) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
