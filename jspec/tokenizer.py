"""Text <-> token ids, and chat templates, without transformers.

A `Tokenizer` is a `tokenizers.Tokenizer` (the Rust library behind Hugging Face's fast
tokenizers) plus what `tokenizer_config.json` adds to it: the named special tokens and the
Jinja chat template. It reads and writes Hugging Face's files, so a converted checkpoint holds

    tokenizer.json          the whole pipeline: normalizer, pre-tokenizer, BPE model, added tokens
    tokenizer_config.json   bos/eos/unk/pad tokens and the chat template

which transformers loads too. GGUF files carry their vocabulary as metadata instead;
`jspec.convert.gguf` builds the pipeline from it. Chat templates render as transformers renders
them (same sandboxed Jinja environment, filters, globals but `lipsum`, and variables), so the
prompt text is identical.

The files come with a model, so they are untrusted: a damaged or mistyped one is a JspecError
naming it, transformers (for slow tokenizers only) never runs a folder's own code, and a chat
template renders within a bound (jspec.chat_template).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Sequence

import tokenizers

from jspec import chat_template
from jspec.errors import JspecError, first_line

CONFIG = "tokenizer_config.json"
PIPELINE = "tokenizer.json"
# Tokenizers saved by older libraries: only transformers can turn these into a tokenizer.json.
SLOW_FILES = ("tokenizer.model", "vocab.json")


class Tokenizer:
    """A model's tokenizer: `encode`/`decode` token ids, `render_chat` for chat prompts."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str], chat_template: str | None = None):
        self.backend = backend
        # {"bos_token": "<s>", "eos_token": "</s>", ...}: a chat template sees each as a variable.
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template

    def __len__(self) -> int:
        """The vocabulary size, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token(self) -> int:
        """The longest entry of the vocabulary, in characters."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.backend.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids [T] of `text`; `add_special_tokens` adds what the model wraps text in (BOS for Llama 2)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: what undecodable bytes in argv or JSON become
            raise JspecError(f"the prompt is not valid Unicode text ({e.reason} at character {e.start})") from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, as transformers' `apply_chat_template(messages,
        tokenize=False, add_generation_prompt=...)` writes it."""
        if self.chat_template is None:
            raise JspecError("this tokenizer has no chat template")
        # transformers drops keys set to None (an API's `content: null`); templates test for presence.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return chat_template.render(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Token ids [T] of a conversation followed by the assistant's turn header."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)  # the template wrote them

    def save(self, folder: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (which `load` and transformers read)."""
        folder = Path(folder)
        self.backend.save(str(folder / PIPELINE))
        # The pipeline in tokenizer.json is the whole truth; the class name makes transformers use it as is.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  **self.special_tokens}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / CONFIG).write_text(json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Tokenizer | None:
        """The tokenizer in a Hugging Face (or converted) folder, or None if it has none.

        Reads tokenizer.json and tokenizer_config.json, plus special_tokens_map.json and
        chat_template.jinja / chat_template.json where present. A folder with only a slow
        tokenizer (tokenizer.model, vocab.json) is converted by transformers if installed.
        """
        folder = Path(folder)
        config = _read_json(folder / CONFIG)
        if (folder / PIPELINE).is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(folder / PIPELINE))
            except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a file it cannot parse
                raise JspecError(f"{folder / PIPELINE} is not a tokenizer jspec can read: {first_line(e)}") from None
            special = _special_tokens(config)
            if "added_tokens_decoder" not in config:
                # Older folders: transformers lets special_tokens_map.json override the config here.
                special |= _special_tokens(_read_json(folder / "special_tokens_map.json"))
        elif any((folder / f).is_file() for f in SLOW_FILES):
            converted = _convert_slow(folder)
            if converted is None:
                return None
            backend, special = converted
        else:
            return None
        return cls(backend, special, _chat_template(folder, config))


def _read_json(path: Path) -> dict:
    """A JSON object from `path` ({} where there is no such file), or a JspecError naming it."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8; nesting past the parser's depth
        raise JspecError(f"{path} is not valid JSON: {first_line(e)}") from None
    if not isinstance(value, dict):
        raise JspecError(f"{path} is not a JSON object")
    return value


def _special_tokens(config: dict) -> dict[str, str]:
    """The `*_token` entries of a tokenizer config, each a string or a serialized AddedToken."""
    found = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items() if k.endswith("_token")}
    return {k: v for k, v in found.items() if isinstance(v, str)}


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja wins over the config's entry (as in transformers), then chat_template.json
    (where processors keep theirs). Several named templates: the one called "default"."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise JspecError(f"{jinja} is not UTF-8 text") from None
    where, template = folder / CONFIG, config.get("chat_template")
    if not template:
        where = folder / "chat_template.json"
        template = _read_json(where).get("chat_template")
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise JspecError(f"{where}: chat_template is a list whose entries are not named templates")
        template = {t["name"]: t.get("template") for t in template}
    if isinstance(template, dict):
        template = template.get("default")
    if template is not None and not isinstance(template, str):
        raise JspecError(f"{where}: chat_template is {type(template).__name__}, not a template's text")
    return template or None


def _convert_slow(folder: Path) -> tuple[tokenizers.Tokenizer, dict[str, str]] | None:
    """The pipeline and special tokens of a slow tokenizer, converted by transformers (imported
    only here); None, with a warning, where that cannot be done."""
    log = logging.getLogger("jspec")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("%s has a tokenizer without tokenizer.json; converting it needs transformers "
                    "(pip install transformers sentencepiece): token ids only", folder)
        return None
    try:
        # Never the folder's own Python (an auto_map's tokenizer class), and never the network.
        slow = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
        return slow.backend_tokenizer, dict(slow.special_tokens_map)  # with the class's defaults (<s>, </s>)
    except Exception as e:  # noqa: BLE001 - whatever the conversion lacks (sentencepiece, protobuf, a file)
        log.warning("could not convert the tokenizer in %s (%s): token ids only", folder, first_line(e))
        return None
