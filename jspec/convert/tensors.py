"""A checkpoint's tensors by Hugging Face name, each read from its file only when asked for.

Conversion streams: it asks for the few tensors of one layer, fuses and casts them, writes them
and lets them go, so a checkpoint is never in host memory whole (`jspec.convert.store`). A
tensor comes back in the dtype its file holds it in (bfloat16 as `ml_dtypes.bfloat16`, a GGUF
quantization dequantized to float32), a new array each time, tied to no memory map.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from jspec.errors import JspecError
from jspec.model.config import ModelConfig


class Tensors(Mapping):
    """name -> array, read when looked up; `shape(name)` without reading."""

    def __init__(self, readers: Mapping[str, Callable[[], np.ndarray]], shapes: Mapping[str, tuple[int, ...]]):
        self._readers, self._shapes = dict(readers), dict(shapes)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def check(self, cfg: ModelConfig, where: str) -> None:
        """Refuse, naming `where` (the checkpoint), a checkpoint that lacks a tensor a model of `cfg`
        needs or holds one in another shape, before any is read. Others (a tied model's lm_head,
        rotary buffers of old checkpoints) are let be."""
        for name, shape in hf_shapes(cfg).items():
            if name not in self._shapes:
                raise JspecError(f"{where} lacks tensor {name}, which its config asks for")
            if tuple(self._shapes[name]) != shape:
                raise JspecError(f"tensor {name} in {where} has shape {tuple(self._shapes[name])}; "
                                 f"its config makes it {shape}")


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every tensor a checkpoint of `cfg` must hold."""
    d, v, f, heads = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (heads, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, heads),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (heads,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes
