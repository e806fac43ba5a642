"""Hugging Face's tensor names and shapes -> jspec's parameter layout (jspec.model.decoder).

`outer_from_hf` and `layer_from_hf` reorder a checkpoint's tensors a piece at a time (the [out,
in] orientation stays; q, k and v become one projection per kv group; gate and up interleave);
`param_shapes` is every parameter's expected shape, which refuses a checkpoint of another model
and gives sharding the tree to place before loading.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from jspec.model.config import ModelConfig

Params = dict


def outer_from_hf(tensors: Mapping[str, np.ndarray], names: Sequence[str], dtype=np.float32) -> Params:
    """The parameters outside the layers that `names` lists (of embed, final_norm and an untied
    model's lm_head), cast to `dtype`."""
    hf_names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    return {name: np.asarray(tensors[hf_names[name]]).astype(dtype) for name in names}


def layer_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], i: int, dtype=np.float32) -> Params:
    """Layer i's parameters in jspec's layout (the orientation, [out, in], stays), read from
    `tensors` (a `jspec.convert.tensors.Tensors` reads just these) and cast to `dtype`."""
    d, k, g, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    p = f"model.layers.{i}."

    def get(name: str) -> np.ndarray:
        return np.asarray(tensors[name])

    def qkv(kind, tail):
        q = get(p + f"self_attn.q_proj.{kind}").reshape(k, g, hd, *tail)
        kk = get(p + f"self_attn.k_proj.{kind}").reshape(k, 1, hd, *tail)
        v = get(p + f"self_attn.v_proj.{kind}").reshape(k, 1, hd, *tail)
        return np.concatenate([q, kk, v], axis=1).reshape(-1, *tail)

    layer = {
        "attn_norm": get(p + "input_layernorm.weight"),
        "wqkv": qkv("weight", (d,)),
        # HF's head order is already kv-group major (head i reads kv head i // G).
        "wo": get(p + "self_attn.o_proj.weight"),
        "mlp_norm": get(p + "post_attention_layernorm.weight"),
        "w_gate_up": gate_up(get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")),
        "w_down": get(p + "mlp.down_proj.weight"),
    }
    if cfg.attention_bias:
        layer["bqkv"] = qkv("bias", ())
    return {name: x.astype(dtype) for name, x in layer.items()}


def gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The MLP's two input projections [F, D] as one [2F, D], interleaved: row 2i is gate row i,
    row 2i + 1 up row i. Any even split of its rows over the model axis then holds the gate and up
    rows of the same units, so the MLP runs with no exchange between devices
    (jspec.model.decoder.mlp_block)."""
    return np.stack([gate, up], axis=1).reshape(-1, *gate.shape[1:])


def interleave_gate_up(w):
    """A [2F, D] w_gate_up in the order before interleaving (gate rows 0..F-1, then up rows) ->
    `gate_up`'s interleaved order (NumPy or jax arrays): what heads saved before the interleaving
    hold (jspec.parts.heads, formats 2 and 3). Converted models of that time are converted again
    instead (jspec.convert.store.FORMAT 6)."""
    return w.reshape(2, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)


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
