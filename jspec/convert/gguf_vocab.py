"""The vocabulary of a GGUF file, as the `tokenizers` pipeline it describes.

llama.cpp keeps a model's tokenizer as metadata (`tokenizer.ggml.*`: tokens, merges or scores,
token types, special token ids, the pre-tokenizer's name, the chat template); `read_tokenizer`
builds from it what transformers' GGUF loader builds, and refuses, naming the file, a vocabulary
of mistyped or inconsistent parts.
"""

from __future__ import annotations

import functools
import logging

import gguf
from tokenizers import AddedToken, Regex, Tokenizer as Pipeline, decoders, models, pre_tokenizers, processors

from jspec.convert.gguf_checks import Metadata
from jspec.errors import JspecError
from jspec.tokenizer import Tokenizer

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
    without a vocabulary, give None and a warning: the model then takes and gives token ids. A
    vocabulary of mistyped or inconsistent parts is a JspecError naming the file."""
    log = logging.getLogger("jspec")
    meta = Metadata(reader)
    kind = meta.get("tokenizer.ggml.model", "str")
    tokens = meta.get("tokenizer.ggml.tokens", "list[str]")
    if kind is None or not tokens:
        log.warning("%s has no vocabulary: token ids only", meta.path)
        return None
    if kind not in ("gpt2", "llama"):
        log.warning("GGUF tokenizer '%s' is not supported (jspec builds gpt2 and llama): token ids only", kind)
        return None
    types = meta.get("tokenizer.ggml.token_type", "list[int]") or []
    merges = meta.get("tokenizer.ggml.merges", "list[str]")
    scores = meta.get("tokenizer.ggml.scores", "list[float]")
    special_ids = {name: meta.get(f"tokenizer.ggml.{key}", "int") for name, key in _SPECIAL_IDS.items()}
    bad_merge = next((m for m in merges or () if len(m.split(" ")) != 2), None)
    bad_id = next(((name, i) for name, i in special_ids.items() if i is not None and not 0 <= i < len(tokens)), None)
    if len(types) not in (0, len(tokens)):
        wrong = f"{len(types)} token types for {len(tokens)} tokens"
    elif scores is not None and len(scores) != len(tokens):
        wrong = f"{len(scores)} scores for {len(tokens)} tokens"
    elif bad_merge is not None:
        wrong = f"merge {bad_merge[:40]!r} is not two tokens"
    elif bad_id is not None:
        wrong = f"{bad_id[0]} id {bad_id[1]} is not one of its {len(tokens)} tokens"
    else:
        wrong = None
    if wrong:
        raise JspecError(f"GGUF file '{meta.path}' has a damaged vocabulary: {wrong}")
    try:
        return _tokenizer(meta, kind, tokens, types, merges, scores, special_ids)
    except Exception as e:  # noqa: BLE001 - tokenizers refuses what it cannot build with plain Exceptions
        raise JspecError(f"GGUF file '{meta.path}' has a vocabulary jspec cannot build: {str(e)[:200]}") from None


def _tokenizer(meta: Metadata, kind: str, tokens: list[str], types: list[int], merges: list[str] | None,
               scores: list[float] | None, special_ids: dict[str, int | None]) -> Tokenizer:
    if kind == "gpt2":
        pipeline = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre", "str"))
    else:
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", "bool", True)
        pipeline = _sentencepiece_bpe(tokens, merges, scores, add_prefix)

    # Control tokens (<|im_end|>) are special, user-defined ones (<think>) plain added tokens: both
    # are matched whole in text. A "control" token outside the byte alphabet of a byte-level
    # vocabulary is a llama.cpp mislabel, not a token the model knows.
    spelled = set(_byte_alphabet().values()) if kind == "gpt2" else None
    pipeline.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                                 if k == _CONTROL and (spelled is None or set(t) <= spelled)])
    vocab = pipeline.get_vocab()
    pipeline.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                         if k == _USER_DEFINED and t in vocab])
    special = {name: tokens[i] for name, i in special_ids.items() if i is not None}
    pipeline.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()])

    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", "bool", kind == "llama") and "bos_token" in special
    add_eos = meta.get("tokenizer.ggml.add_eos_token", "bool", False) and "eos_token" in special
    pipeline.post_processor = _wrapping(special.get("bos_token") if add_bos else None,
                                        special.get("eos_token") if add_eos else None, pipeline)
    return Tokenizer(pipeline, special, meta.get("tokenizer.chat_template", "str"))


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
