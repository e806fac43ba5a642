"""Text <-> token ids, and chat templates, without transformers.

A `Tokenizer` is a `tokenizers.Tokenizer` (the Rust library behind Hugging Face's fast
tokenizers) plus what `tokenizer_config.json` adds to it: the named special tokens and the
Jinja chat template. It reads and writes Hugging Face's files, so a converted checkpoint holds

    tokenizer.json          the whole pipeline: normalizer, pre-tokenizer, BPE model, added tokens
    tokenizer_config.json   bos/eos/unk/pad tokens and the chat template

which transformers loads too. GGUF files carry their vocabulary as metadata instead;
`jspec.convert.gguf` builds the pipeline from it. Chat templates render as transformers renders
them (same sandboxed Jinja environment, filters, globals and variables), so the prompt text is
identical.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jspec.errors import JspecError

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
        try:
            return _compile(self.chat_template).render(messages=messages, tools=None, documents=None,
                                                        add_generation_prompt=add_generation_prompt,
                                                        **self.special_tokens)
        except jinja2.TemplateError as e:
            raise JspecError(f"the chat template refused the messages: {e}") from None

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
                raise JspecError(f"{folder / PIPELINE} is not a tokenizer jspec can read: {e}") from None
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
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise JspecError(f"{path} is not valid JSON: {e}") from None


def _special_tokens(config: dict) -> dict[str, str]:
    """The `*_token` entries of a tokenizer config, each a string or a serialized AddedToken."""
    found = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items() if k.endswith("_token")}
    return {k: v for k, v in found.items() if isinstance(v, str)}


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja wins over the config's entry (as in transformers), then chat_template.json
    (where processors keep theirs). Several named templates: the one called "default"."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        template = template.get("default")
    return template


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
        slow = AutoTokenizer.from_pretrained(str(folder))
        return slow.backend_tokenizer, dict(slow.special_tokens_map)  # with the class's defaults (<s>, </s>)
    except Exception as e:  # noqa: BLE001 - whatever the conversion lacks (sentencepiece, protobuf, a file)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("could not convert the tokenizer in %s (%s): token ids only", folder, reason)
        return None


# -- chat templates: the Jinja environment transformers renders them in ----------------------------

class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps its body (transformers' AssistantTracker does the same when not tracking)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _compile(template: str) -> jinja2.Template:
    # Templates come with model files: the sandbox keeps them from reaching Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise JspecError(f"the model's chat template is not valid Jinja: {e}") from None
