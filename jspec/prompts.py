"""Prompts, as users give them (a string, chat messages, a dict, token ids), made into Requests:
encoded with the model's tokenizer and chat template, and refused in one line where they cannot
run (empty, longer than the context can hold, ids outside the vocabulary)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jspec.batching import Request
from jspec.errors import JspecError
from jspec.jsonl import check_messages
from jspec.tokenizer import Tokenizer

Prompt = str | Sequence[dict] | dict


def is_conversation(prompts: Any) -> bool:
    """A list of chat messages is one prompt, not a list of prompts: prompt dicts never have a role."""
    return (isinstance(prompts, (list, tuple)) and bool(prompts)
            and all(isinstance(m, dict) and "role" in m for m in prompts))


def encode(tokenizer: Tokenizer | None, model: str, context: int, prompt: Prompt, chat: bool = True) -> list[int]:
    """Token ids of a prompt (a string, a list of chat messages, or a dict with one of them) for
    the model named `model` with this tokenizer and a context of `context` tokens."""
    if isinstance(prompt, dict):
        if "messages" not in prompt and "prompt" not in prompt:
            raise JspecError(f"a prompt dict needs 'prompt', 'messages' or 'token_ids'; got keys {sorted(prompt)}")
        prompt = prompt.get("messages", prompt.get("prompt"))
    if not (isinstance(prompt, str) or
            isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)):
        raise JspecError("a prompt is a string, a list of chat messages ({'role': ..., 'content': ...}) or a "
                         f"dict with 'prompt', 'messages' or 'token_ids'; got {type(prompt).__name__}")
    if isinstance(prompt, str) and not prompt.strip():
        raise JspecError("a prompt is empty")  # as in a prompts file (jspec.jsonl.read_prompts)
    if tokenizer is None:
        raise JspecError(f"model {model} has no tokenizer: pass token ids instead of text")
    text = prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in prompt)
    # A token covers at most the vocabulary's longest entry in characters (times 4, for what a
    # normalizer may compose): a text no tokenization could fit fails at once, not after minutes.
    if len(text) > 4 * context * tokenizer.longest_token:
        raise JspecError(f"a prompt of {len(text)} characters is far longer than the model's context of "
                         f"{context} tokens can hold")
    if isinstance(prompt, str) and not chat:
        return tokenizer.encode(prompt)
    if not chat:
        raise JspecError("chat messages need the chat template; give plain prompts to use --no-chat")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        check_messages(list(prompt), "chat messages")
    if tokenizer.chat_template is None:
        raise JspecError(f"model {model} has no chat template: use --no-chat")
    return tokenizer.encode_chat(messages)


def requests(prompts: Iterable[Prompt], encoder: Callable[[Prompt, bool], list[int]], vocab_size: int,
             chat: bool = True, start: int = 0) -> list[Request]:
    """Requests of prompts (token ids as given, the rest through `encoder`); `start` is the index
    of the first one in the caller's full list."""
    out = []
    for i, p in enumerate(prompts, start):
        pid = p.get("id", i) if isinstance(p, dict) else i
        if isinstance(p, dict) and "token_ids" in p:
            ids = list(p["token_ids"])
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
                raise JspecError(f"prompt {pid!r}: token_ids must be integers")
        else:
            ids = encoder(p, chat)
        if not ids:
            raise JspecError(f"prompt {pid!r} is empty")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise JspecError(f"prompt {pid!r} holds token ids outside the model's vocabulary (0..{vocab_size - 1})")
        out.append(Request(pid, ids, i))
    return out
