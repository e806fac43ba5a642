"""Hugging Face's tensor names and shapes -> jspec's parameter layout (jspec.model.decoder).

`params_from_hf` reorders a checkpoint's tensors (the [out, in] orientation stays; q, k and v
become one projection per kv group); `param_shapes` is every parameter's expected shape, which
refuses a checkpoint of another model and gives sharding the tree to place before loading.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jspec.model.config import ModelConfig

Params = dict


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=np.float32) -> Params:
    """Hugging Face tensor names -> jspec's layout (the orientation, [out, in], stays)."""
    d, k, g, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.group_size, cfg.head_dim

    def get(name):
        if name not in tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return np.asarray(tensors[name], np.float32)

    def qkv_weight(p):
        q = get(p + "self_attn.q_proj.weight").reshape(k, g, hd, d)
        kk = get(p + "self_attn.k_proj.weight").reshape(k, 1, hd, d)
        v = get(p + "self_attn.v_proj.weight").reshape(k, 1, hd, d)
        return np.concatenate([q, kk, v], axis=1).reshape(-1, d)

    def qkv_bias(p):
        q = get(p + "self_attn.q_proj.bias").reshape(k, g, hd)
        kk = get(p + "self_attn.k_proj.bias").reshape(k, 1, hd)
        v = get(p + "self_attn.v_proj.bias").reshape(k, 1, hd)
        return np.concatenate([q, kk, v], axis=1).reshape(-1)

    fields = {
        "attn_norm": lambda p: get(p + "input_layernorm.weight"),
        "wqkv": qkv_weight,
        # HF's head order is already kv-group major (head i reads kv head i // G).
        "wo": lambda p: get(p + "self_attn.o_proj.weight"),
        "mlp_norm": lambda p: get(p + "post_attention_layernorm.weight"),
        "w_gate_up": lambda p: np.concatenate(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], axis=0),
        "w_down": lambda p: get(p + "mlp.down_proj.weight"),
    }
    if cfg.attention_bias:
        fields["bqkv"] = qkv_bias
    layers = [{name: fn(f"model.layers.{i}.").astype(dtype) for name, fn in fields.items()}
              for i in range(cfg.num_layers)]
    params = {
        "embed": get("model.embed_tokens.weight").astype(dtype),
        "layers": layers,
        "final_norm": get("model.norm.weight").astype(dtype),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").astype(dtype)
    return params


def param_shapes(cfg: ModelConfig) -> dict:
    """Expected shape of every parameter, used to refuse checkpoints of another model."""
    D, V, F = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    qkv, heads = cfg.num_kv_heads * (cfg.group_size + 2) * cfg.head_dim, cfg.num_heads * cfg.head_dim
    layer = {"attn_norm": (D,), "wqkv": (qkv, D), "wo": (D, heads), "mlp_norm": (D,),
             "w_gate_up": (2 * F, D), "w_down": (D, F)}
    if cfg.attention_bias:
        layer["bqkv"] = (qkv,)
    shapes = {"embed": (V, D), "layers": [dict(layer) for _ in range(cfg.num_layers)], "final_norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, D)
    return shapes
