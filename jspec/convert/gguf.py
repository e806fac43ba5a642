"""Read (and export) llama.cpp GGUF files as an HF-style config plus HF-named float32 tensors.

Three things differ from a Hugging Face checkpoint, and are undone here:
- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on;
- quantization: Q4_1, Q8_0, ... blocks are dequantized to float32 (`gguf.quants.dequantize`);
- llama-arch q/k rows: llama.cpp's converter reorders each head's rows from HF's
  rotate-half layout (first half, second half) to interleaved pairs, because ggml's rope
  rotates adjacent elements. Qwen2 files use ggml's NeoX rope and are not reordered.
Shapes need no work: GGUF lists dimensions innermost first, and `gguf.GGUFReader` already
reverses them, so a Linear weight arrives as HF's [out_features, in_features].

The vocabulary is metadata too (`tokenizer.ggml.*`: tokens, merges or scores, token types,
special token ids, the pre-tokenizer's name, the chat template); `read_tokenizer` builds the
`tokenizers` pipeline it describes, as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from pathlib import Path

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer as Pipeline, decoders, models, pre_tokenizers, processors

from jspec.convert.tensors import Tensors
from jspec.errors import JspecError
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
    vocabulary jspec can build)."""
    try:
        reader = gguf.GGUFReader(path)
    except FileNotFoundError:
        raise JspecError(f"GGUF file '{path}' not found") from None
    except ValueError as e:
        raise JspecError(f"'{path}' is not a readable GGUF file: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise JspecError(f"GGUF architecture '{arch}' is not supported; jspec reads {', '.join(_ARCHITECTURES)}")

    found = {t.name: t for t in reader.tensors}
    rope_freqs = found.pop(_ROPE_FREQS, None)
    shapes = {name: tuple(int(n) for n in reversed(t.shape)) for name, t in found.items()}
    config = _read_config(reader, arch, shapes, None if rope_freqs is None else _dequantize(rope_freqs))
    heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}

    def reader_of(name: str, tensor: gguf.ReaderTensor):
        n_head = next((n for part, n in heads.items() if part in name), None)
        if arch not in _INTERLEAVED_ARCHS or n_head is None:
            return lambda: _dequantize(tensor)
        return lambda: _deinterleave(_dequantize(tensor), n_head)

    tensors = Tensors({_hf_name(name): reader_of(name, t) for name, t in found.items()},
                      {_hf_name(name): shape for name, shape in shapes.items()})
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


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _float(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _read_config(reader: gguf.GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]],
                 rope_freqs: np.ndarray | None) -> dict:
    """The HF config.json fields jspec needs, from the `{arch}.*` and tokenizer metadata and the
    tensors' GGUF names and (HF-ordered) shapes."""

    def meta(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hf_arch, model_type = _ARCHITECTURES[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": meta("embedding_length"),
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "rms_norm_eps": _float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": meta("context_length"),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
    }
    if meta("attention.key_length") is not None:
        config["head_dim"] = meta("attention.key_length")
    for key in ("bos_token_id", "eos_token_id"):
        token = _field(reader, f"tokenizer.ggml.{key}")
        if token is not None:
            config[key] = token
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        # Passed on as found; the model config decides whether it can honour it.
        config["rope_scaling"] = {"rope_type": scaling_type, "factor": _float(meta("rope.scaling.factor", 1.0))}
    if rope_freqs is not None:
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


# -- the tokenizer ---------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 6 byte)
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}
# How byte-level vocabularies split text before BPE, by `tokenizer.ggml.pre` (llama.cpp's names).
# GPT-2's own split is also what files that name none get.
_GPT2_SPLITS = {"default", "gpt-2", "gpt2", "mpt", "olmo"}
# StarCoder's family puts every digit on its own first (SmolLM2's tokenizer.json: a Digits
# pre-tokenizer), then splits as GPT-2 does. transformers' GGUF loader misses this and lets
# whitespace before a digit split differently ("\n\n1": two newline tokens instead of one).
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


def read_tokenizer(reader: gguf.GGUFReader) -> Tokenizer | None:
    """The tokenizer a GGUF's metadata describes: byte-level BPE ("gpt2": Llama 3, Qwen2, SmolLM2)
    or SentencePiece BPE with byte fallback ("llama": Llama 2, Mistral). Other kinds, and files
    without a vocabulary, give None and a warning: the model then takes and gives token ids."""
    log = logging.getLogger("jspec")
    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        log.warning("%s has no vocabulary: token ids only", getattr(reader.data, "filename", "the GGUF file"))
        return None
    if kind not in ("gpt2", "llama"):
        log.warning("GGUF tokenizer '%s' is not supported (jspec builds gpt2 and llama): token ids only", kind)
        return None
    types = _field(reader, "tokenizer.ggml.token_type") or []
    merges = _field(reader, "tokenizer.ggml.merges")
    if kind == "gpt2":
        pipeline = _byte_level_bpe(tokens, merges, _field(reader, "tokenizer.ggml.pre"))
    else:
        add_prefix = _field(reader, "tokenizer.ggml.add_space_prefix", True)
        pipeline = _sentencepiece_bpe(tokens, merges, _field(reader, "tokenizer.ggml.scores"), add_prefix)

    # Control tokens (<|im_end|>) are special, user-defined ones (<think>) plain added tokens: both
    # are matched whole in text. A "control" token outside the byte alphabet of a byte-level
    # vocabulary is a llama.cpp mislabel, not a token the model knows.
    spelled = set(_byte_alphabet().values()) if kind == "gpt2" else None
    pipeline.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                                 if k == _CONTROL and (spelled is None or set(t) <= spelled)])
    vocab = pipeline.get_vocab()
    pipeline.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                         if k == _USER_DEFINED and t in vocab])
    special = {name: tokens[i] for name, key in _SPECIAL_IDS.items()
               if (i := _field(reader, f"tokenizer.ggml.{key}")) is not None}
    pipeline.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()])

    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", kind == "llama") and "bos_token" in special
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", False) and "eos_token" in special
    pipeline.post_processor = _wrapping(special.get("bos_token") if add_bos else None,
                                        special.get("eos_token") if add_eos else None, pipeline)
    return Tokenizer(pipeline, special, _field(reader, "tokenizer.chat_template"))


def _wrapping(bos: str | None, eos: str | None, pipeline: Pipeline) -> processors.TemplateProcessing:
    """What `encode(..., add_special_tokens=True)` puts around text: BOS before, EOS after, if set."""
    def part(sequence: str, type_id: int) -> list[str]:
        return [f"{bos}:{type_id}"] * bool(bos) + [f"{sequence}:{type_id}"] + [f"{eos}:{type_id}"] * bool(eos)

    ids = {t: pipeline.token_to_id(t) for t in (bos, eos) if t}
    return processors.TemplateProcessing(single=part("$A", 0), pair=part("$A", 0) + part("$B", 1),
                                         special_tokens=list(ids.items()))


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str | None) -> Pipeline:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens outside the byte alphabet (a few files keep raw spaces) are respelled in it.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges or ()]
    pipeline = Pipeline(models.BPE(vocab, pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    if pre in _REGEX_SPLITS:
        pipeline.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGITS_FIRST:
        pipeline.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        if pre is not None and pre not in _GPT2_SPLITS:
            logging.getLogger("jspec").warning(
                "GGUF pre-tokenizer '%s' is unknown to jspec; splitting text as GPT-2 does, which may "
                "tokenize some text differently from the model's own tokenizer", pre)
        pipeline.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    pipeline.decoder = decoders.ByteLevel()
    return pipeline


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None,
                       add_prefix: bool) -> Pipeline:
    """SentencePiece BPE as Hugging Face's Llama tokenizer rebuilds it: "▁" for spaces (one
    prepended to the text), byte tokens (<0x0A>) for characters outside the vocabulary."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    else:  # llama.cpp's SentencePiece files keep scores, not merges
        pairs = _merges_from_scores(tokens, scores or [0.0] * len(tokens))
    pipeline = Pipeline(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    prepend = "first" if add_prefix else "never"
    pipeline.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    pipeline.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * add_prefix)
    return pipeline


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that SentencePiece's scores imply (transformers' `generate_merges`): every split of a
    token into two tokens, the best-scoring token first, then the longer left, then the longer right piece."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep their order
    return [(left, right) for left, right, _ in merges]


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (space is "Ġ", newline "Ċ")."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}
