"""What the command line's tests share: a tiny model folder, running `jspec` in-process, JSONL
files, and the one-line error every bad input must give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jspec.cli import main
from jspec.convert import store


def tiny_model(root: Path, tokenizer, **overrides) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, **overrides)
    LlamaForCausalLM(config).save_pretrained(root / "hf")
    out = store.convert(str(root / "hf"), root / "jspec")
    tokenizer.save(out)  # the random model has none: borrow SmolLM2's (same vocabulary size)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_tokenizer) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"), default_tokenizer)


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the test printed before
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def write_lines(path: Path, *lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: records may hold U+2028
    return [json.loads(line) for line in lines if line]


PROMPTS = [{"prompt": "Name three primes."},
           {"id": "greeting", "messages": [{"role": "user", "content": "Say hello."}]},
           {"prompt": "What is JAX?"}]


def assert_one_error(code: int, out: str, err: str, phrase: str) -> None:
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    [line] = err.splitlines()
    assert line.startswith("jspec: error: ") and phrase in line, line
