"""Read (and export) llama.cpp GGUF files as an HF-style config plus HF-named float32 tensors.

Three things differ from a Hugging Face checkpoint, and are undone here:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on;
- quantization: Q4_1, Q8_0, ... blocks are dequantized to float32 (`gguf.quants.dequantize`);
- llama-arch q/k rows: llama.cpp's converter reorders each head's rows from HF's
  rotate-half layout (first half, second half) to interleaved pairs, because ggml's rope
  rotates adjacent elements. Qwen2 files use ggml's NeoX rope and are not reordered.
Shapes need no work: GGUF lists dimensions innermost first, and `gguf.GGUFReader` already
reverses them, so a Linear weight arrives as HF's [out_features, in_features].

The vocabulary is metadata too; `jspec.convert.gguf_vocab.read_tokenizer` builds the `tokenizers`
pipeline it describes. What a file holds is checked before it is used (`jspec.convert.gguf_checks`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np

from jspec.convert.gguf_checks import Metadata, check_layout
from jspec.convert.gguf_vocab import read_tokenizer
from jspec.convert.tensors import Tensors
from jspec.errors import JspecError
from jspec.model.config import ModelConfig
from jspec.tokenizer import Tokenizer

# GGUF general.architecture -> (HF architectures entry, HF model_type).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
# llama.cpp exports Mistral as "llama"; both get the q/k row interleaving.
_EXPORT_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_INTERLEAVED_ARCHS = {"llama", "mistral"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_GLOBAL = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_HF_LAYER = {hf: g for g, hf in _LAYER_NAMES.items()}
_ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x's rope scaling constants; GGUF keeps only the per-frequency factors they produce.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def read_gguf(path: str) -> tuple[dict, Tensors, Tokenizer | None]:
    """An HF-style config dict, HF-named tensors (HF orientation and row order, dequantized to
    float32 one at a time when read) and the tokenizer (None, with a warning, for a file without a
    vocabulary jspec can build). A damaged or crafted file (truncated, counts or offsets past its
    end, missing or mistyped metadata, tensors the config does not describe) is a JspecError
    naming the file, raised before any tensor is read (`jspec.convert.gguf_checks`)."""
    check_layout(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - whatever the reader still finds wrong in a file check_layout passed
        raise JspecError(f"'{path}' is not a readable GGUF file: {str(e).strip()[:200] or type(e).__name__}") from None
    meta = Metadata(reader, path)
    arch = meta.require("general.architecture", "str")
    if arch not in _ARCHITECTURES:
        raise JspecError(f"GGUF architecture '{arch}' is not supported; jspec reads {', '.join(_ARCHITECTURES)}")

    found = {t.name: t for t in reader.tensors}
    for kind in {t.tensor_type for t in found.values()}:
        try:  # one block of zeros: whether gguf can dequantize this type at all
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except NotImplementedError:
            name = next(n for n, t in found.items() if t.tensor_type == kind)
            raise JspecError(f"GGUF file '{path}': tensor {name} is {kind.name}, "
                             "which jspec cannot dequantize") from None
    rope_freqs = found.pop(_ROPE_FREQS, None)
    shapes = {name: tuple(int(n) for n in reversed(t.shape)) for name, t in found.items()}
    config = _read_config(meta, arch, shapes, None if rope_freqs is None else _dequantize(rope_freqs))
    heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}

    def reader_of(name: str, tensor: gguf.ReaderTensor):
        n_head = next((n for part, n in heads.items() if part in name), None)
        if arch not in _INTERLEAVED_ARCHS or n_head is None:
            return lambda: _dequantize(tensor)
        return lambda: _deinterleave(_dequantize(tensor), n_head)

    tensors = Tensors({_hf_name(name): reader_of(name, t) for name, t in found.items()},
                      {_hf_name(name): shape for name, shape in shapes.items()})
    tensors.check(ModelConfig.from_hf(config, f"GGUF file '{path}'"), f"GGUF file '{path}'")
    return config, tensors, read_tokenizer(reader)


def write_gguf(path: str | Path, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """Export HF-named tensors as an unquantized (F32) GGUF that `read_gguf` and llama.cpp's
    loader understand; no tokenizer vocabulary is embedded."""
    model_type = config.get("model_type")
    if model_type not in _EXPORT_ARCH:
        raise JspecError(f"cannot export model_type '{model_type}' to GGUF; jspec exports {', '.join(_EXPORT_ARCH)}")
    arch = _EXPORT_ARCH[model_type]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    theta, scaling = _rope_settings(config)
    tied = config.get("tie_word_embeddings", False)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        token = config.get(key)
        if isinstance(token, list):  # GGUF holds one id; the first is the conventional end-of-text
            token = token[0] if token else None
        if token is not None:
            add(token)

    for name, values in tensors.items():
        if tied and name == "lm_head.weight":
            continue  # a missing output.weight is how GGUF says "tied"
        values = np.ascontiguousarray(values, dtype=np.float32)
        if arch in _INTERLEAVED_ARCHS and ".q_proj." in name:
            values = _interleave(values, heads)
        elif arch in _INTERLEAVED_ARCHS and ".k_proj." in name:
            values = _interleave(values, kv_heads)
        writer.add_tensor(_gguf_name(name), values)
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise JspecError(f"cannot export rope scaling {scaling!r} to GGUF; jspec exports default and llama3")
        writer.add_tensor(_ROPE_FREQS, _llama3_rope_factors(theta, _head_dim(config), scaling))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved rows, per head (llama.cpp's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _deinterleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `_interleave`: rows of pairs (x0, y0, x1, y1, ...) back to (x..., y...)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """float32 values of one tensor, copied out of the file's memory map."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
        values = values.copy()  # F32 "dequantization" is a view into the memory map
    return values


def _float(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _read_config(meta: Metadata, arch: str, shapes: dict[str, tuple[int, ...]],
                 rope_freqs: np.ndarray | None) -> dict:
    """The HF config.json fields jspec needs, from the `{arch}.*` and tokenizer metadata and the
    tensors' GGUF names and (HF-ordered) shapes."""

    def need(key: str, kind: str = "int"):
        return meta.require(f"{arch}.{key}", kind)

    def get(key: str, kind: str = "int", default=None):
        return meta.get(f"{arch}.{key}", kind, default)

    if "token_embd.weight" not in shapes or len(shapes["token_embd.weight"]) != 2:
        raise JspecError(f"GGUF file '{meta.path}' has no two-dimensional token_embd.weight (the embeddings)")
    heads = need("attention.head_count")
    hf_arch, model_type = _ARCHITECTURES[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": need("embedding_length"),
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", default=heads),
        "rms_norm_eps": _float(need("attention.layer_norm_rms_epsilon", "float")),
        "rope_theta": _float(get("rope.freq_base", "float", 10000.0)),
        "max_position_embeddings": need("context_length"),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
    }
    if get("attention.key_length") is not None:
        config["head_dim"] = get("attention.key_length")
    for key in ("bos_token_id", "eos_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}", "int")
        if token is not None:
            config[key] = token
    scaling_type = get("rope.scaling.type", "str")
    if scaling_type not in (None, "none"):
        # Passed on as found; the model config decides whether it can honour it.
        config["rope_scaling"] = {"rope_type": scaling_type, "factor": _float(get("rope.scaling.factor", "float", 1.0))}
    if rope_freqs is not None:
        ModelConfig.from_hf(config, f"GGUF file '{meta.path}'")  # sizes sound before the rope uses them
        config["rope_scaling"] = _llama3_scaling(config, rope_freqs)
    return config


def _llama3_scaling(config: dict, rope_freqs: np.ndarray) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency factors.

    The factors only pin down the scaling factor (their maximum); the other constants are
    taken as Llama 3.x's and checked by recomputing the factors from them.
    """
    scaling = {"rope_type": "llama3", "factor": _float(rope_freqs.max()), **_LLAMA3_DEFAULTS}
    expected = _llama3_rope_factors(config["rope_theta"], _head_dim(config), scaling)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
        raise JspecError("GGUF has rope_freqs that are not Llama 3.x rope scaling; jspec cannot use them")
    return scaling


def _llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling, as llama.cpp stores them in rope_freqs."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factors = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, non-default scaling or None) from either config.json style:
    legacy `rope_theta`/`rope_scaling`, or transformers 5's `rope_parameters`."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if kind != "default" else None)


def _hf_name(name: str) -> str:
    """GGUF tensor name -> HF name, e.g. blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    match = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if match and match[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match[1]]}.{match[2]}"
    raise JspecError(f"unexpected tensor '{name}' in GGUF file; jspec reads plain llama/mistral/qwen2 models")


def _gguf_name(name: str) -> str:
    """HF tensor name -> GGUF name; the inverse of `_hf_name`."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)", name)
    if match and match[2] in _HF_LAYER:
        return f"blk.{match[1]}.{_HF_LAYER[match[2]]}.{match[3]}"
    match = re.fullmatch(r"([\w.]+)\.(weight|bias)", name)
    if match and match[1] in _HF_GLOBAL:
        return f"{_HF_GLOBAL[match[1]]}.{match[2]}"
    raise JspecError(f"cannot export tensor '{name}' to GGUF; it is not part of a llama/mistral/qwen2 model")
