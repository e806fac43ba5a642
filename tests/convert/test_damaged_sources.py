"""Model files a user hands jspec, damaged or crafted: every reader refuses them in one line naming
the file (a JspecError, or `jspec: error:` from the CLI), before any loop, allocation or code the
file could steer, and leaves the file as it was."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import pathlib
import struct
import time

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from support.cli import assert_one_error, run
from tokenizers import Tokenizer as Pipeline, models

from jspec.convert import store
from jspec.convert.gguf import read_gguf
from jspec.convert.hf import read_hf
from jspec.errors import JspecError
from jspec.model.config import ModelConfig
from jspec.chat_template import TEMPLATE_SECONDS
from jspec.tokenizer import Tokenizer

# A one-layer Llama small enough to write by hand: head dim 4, two query heads over one kv head.
HIDDEN, FF, HEADS, KV_HEADS, VOCAB = 8, 16, 2, 1, 16
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
             "hidden_size": HIDDEN, "intermediate_size": FF, "num_hidden_layers": 1,
             "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 32,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
GGUF_METADATA = {"llama.block_count": 1, "llama.context_length": 32, "llama.embedding_length": HIDDEN,
                 "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS,
                 "llama.attention.head_count_kv": KV_HEADS, "llama.attention.layer_norm_rms_epsilon": 1e-5}
REQUIRED_GGUF_KEYS = sorted(set(GGUF_METADATA) - {"llama.attention.head_count_kv"})


def gguf_tensors() -> dict[str, np.ndarray]:
    """GGUF-named tensors of the tiny Llama, in HF orientation ([out, in])."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HEADS * 4, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * 4, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * 4, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HEADS * 4),
              "blk.0.ffn_gate.weight": (FF, HIDDEN), "blk.0.ffn_up.weight": (FF, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FF)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf_file(path: pathlib.Path, metadata: dict | None = None, tensors: dict | None = None) -> pathlib.Path:
    """The tiny Llama as a GGUF file, with `metadata` for its llama.* keys (a value None: left out)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**GGUF_METADATA, **(metadata or {})}.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif value is not None:
            writer.add_uint32(key, value)
    for name, values in (gguf_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patched(path: pathlib.Path, after: bytes, skip: int, fmt: str, value) -> pathlib.Path:
    """`path` with `value` packed (little-endian `fmt`) `skip` bytes after the first `after` in it."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<" + fmt, data, data.index(after) + len(after) + skip, value)
    path.write_bytes(bytes(data))
    return path


@contextlib.contextmanager
def unchanged(*paths: pathlib.Path):
    """Asserts that every file under `paths` holds the same bytes after the block as before."""
    def snapshot():
        return {p: p.read_bytes() for root in paths for p in ([root] if root.is_file() else sorted(root.rglob("*")))
                if p.is_file()}

    before = snapshot()
    yield
    assert snapshot() == before


def refused(path: pathlib.Path, phrase: str, read=read_gguf) -> str:
    """The one-line JspecError `read(path)` gives, which names `path` and says `phrase`."""
    with unchanged(path), pytest.raises(JspecError) as caught:
        read(str(path))
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and phrase in message, message
    return message


# -- GGUF -------------------------------------------------------------------------------------------

def test_the_tiny_gguf_is_read(tmp_path):
    """The file the crafted ones start from is sound, so each refusal below is the damage's doing."""
    config, tensors, tokenizer = read_gguf(str(write_gguf_file(tmp_path / "m.gguf")))
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (1, HIDDEN, VOCAB)
    assert tensors["model.norm.weight"].shape == (HIDDEN,) and tokenizer is None


@pytest.mark.parametrize("what, after, skip", [
    ("an array", b"test.array", 8),  # key, then the value type and the item type
    ("an array of strings", b"test.strings", 8),
    ("the metadata", b"GGUF", 12),  # magic, then the version and the tensor count
])
def test_gguf_claiming_2_62_items_is_refused_at_once(tmp_path, what, after, skip):
    """gguf.GGUFReader would loop over the 2**62 items, its memory growing, on a file of a few KB."""
    path = write_gguf_file(tmp_path / "huge.gguf", {"test.array": [1, 2, 3], "test.strings": ["a", "b"]})
    patched(path, after, skip, "Q", 2**62)
    start = time.perf_counter()
    refused(path, f"claims {2**62} items")
    assert time.perf_counter() - start < 5


def test_gguf_string_longer_than_the_file_is_refused(tmp_path):
    path = patched(write_gguf_file(tmp_path / "s.gguf", {"test.name": "tiny"}), b"test.name", 4, "Q", 2**40)
    refused(path, "it ends inside metadata 'test.name'")


@pytest.mark.parametrize("keep", [0, 7, 40, 0.3, 0.6, 0.9, 0.999])  # bytes, or a share of the file
def test_truncated_gguf_is_refused(tmp_path, keep):
    path = write_gguf_file(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    refused(path, "is not a readable GGUF file")


def test_gguf_tensor_data_past_the_end_is_refused(tmp_path):
    # After the name: the dimension count (4 bytes), two dimensions (8 each), the type (4), the offset.
    path = patched(write_gguf_file(tmp_path / "m.gguf"), b"blk.0.ffn_down.weight", 4 + 16 + 4, "Q", 2**40)
    refused(path, "tensor blk.0.ffn_down.weight (dimensions [16, 8]) has data past the end of the file")


def test_gguf_absurd_dimensions_are_refused(tmp_path):
    """2**32 x 2**32 elements wrap to 0 in the reader's uint64 product; Python's integers do not."""
    path = write_gguf_file(tmp_path / "m.gguf")
    patched(path, b"blk.0.ffn_down.weight", 4, "Q", 2**32)
    patched(path, b"blk.0.ffn_down.weight", 12, "Q", 2**32)
    refused(path, "has data past the end of the file")


def test_every_reader_error_becomes_one_line(tmp_path, monkeypatch):
    def failing(path, *args, **kwargs):
        raise IndexError("index 7 is out of bounds for axis 0 with size 3")

    path = write_gguf_file(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf, "GGUFReader", failing)
    refused(path, "is not a readable GGUF file: index 7 is out of bounds")


@pytest.mark.parametrize("key", REQUIRED_GGUF_KEYS)
def test_gguf_missing_metadata_is_named(tmp_path, key):
    """A missing epsilon made NaN norms (np.float32(None)); the others a KeyError."""
    refused(write_gguf_file(tmp_path / "m.gguf", {key: None}), f"lacks metadata '{key}'")


def test_gguf_metadata_of_another_type_is_named(tmp_path):
    path = write_gguf_file(tmp_path / "m.gguf", {"llama.block_count": "one"})
    refused(path, "metadata 'llama.block_count' is string; jspec expects int")


def test_gguf_absurd_sizes_are_refused(tmp_path):
    path = write_gguf_file(tmp_path / "m.gguf", {"llama.block_count": 10**6})
    refused(path, "'num_hidden_layers' is 1000000; expected a whole number from 1 to 1024")


def test_gguf_without_a_norm_or_with_a_misshapen_tensor_is_refused(tmp_path):
    tensors = gguf_tensors()
    del tensors["output_norm.weight"]
    refused(write_gguf_file(tmp_path / "m.gguf", tensors=tensors), "lacks tensor model.norm.weight")
    tensors = {**gguf_tensors(), "blk.0.ffn_down.weight": np.zeros((HIDDEN, FF - 1), np.float32)}
    refused(write_gguf_file(tmp_path / "n.gguf", tensors=tensors),
            "tensor model.layers.0.mlp.down_proj.weight in GGUF file")


def test_gguf_tensor_of_a_type_jspec_cannot_dequantize_is_refused(tmp_path):
    tensors = {**gguf_tensors(), "output_norm.weight": np.ones(HIDDEN, np.int8)}
    refused(write_gguf_file(tmp_path / "m.gguf", tensors=tensors), "tensor output_norm.weight is I8")


def test_gguf_damaged_vocabulary_is_refused(tmp_path):
    vocabulary = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                  "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 99}
    refused(write_gguf_file(tmp_path / "m.gguf", vocabulary), "eos_token id 99 is not one of its 3 tokens")


def test_cli_convert_of_a_crafted_gguf_is_one_line(tmp_path, capsys):
    path = patched(write_gguf_file(tmp_path / "huge.gguf", {"test.array": [1, 2, 3]}), b"test.array", 8, "Q", 2**62)
    with unchanged(path):
        assert_one_error(*run(capsys, "convert", path, tmp_path / "out"), str(path))
    assert not (tmp_path / "out").exists()


# -- safetensors and PyTorch pickles ----------------------------------------------------------------

def hf_folder(root: pathlib.Path, config: dict | None = None) -> pathlib.Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config or HF_CONFIG))
    return root


def safetensors_file(path: pathlib.Path, header, data: bytes = b"\0" * 32, length: int | None = None) -> pathlib.Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


NORM = "model.norm.weight"


@pytest.mark.parametrize("header, length, phrase", [
    ({NORM: {"dtype": "F32", "shape": [8], "data_offsets": [0, 3200]}}, None, "outside the file's 32 bytes of data"),
    ({NORM: {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}}, None, "has 16 bytes of data"),
    ({NORM: {"dtype": "F32", "shape": [-8], "data_offsets": [0, 32]}}, None, "expected a list of at most 8"),
    ({NORM: {"dtype": "F32", "shape": "8", "data_offsets": [0, 32]}}, None, "expected a list of at most 8"),
    ({NORM: {"dtype": "Q9", "shape": [8], "data_offsets": [0, 32]}}, None, "has dtype Q9"),
    ({NORM: [0, 32]}, None, "has no dtype, shape and data_offsets"),
    ({NORM: {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, 2**40, "header length"),
    (b"{not json at all", None, "its header is not JSON"),
    (b"[1, 2, 3]", None, "its header is not a JSON object"),
])
def test_damaged_safetensors_header_is_refused(tmp_path, header, length, phrase):
    folder = hf_folder(tmp_path / "hf")
    path = safetensors_file(folder / "model.safetensors", header, length=length)
    with unchanged(folder), pytest.raises(JspecError) as caught:
        read_hf(str(folder))
    assert str(path) in str(caught.value) and phrase in str(caught.value), caught.value
    if isinstance(header, dict) and length is None:
        assert NORM in str(caught.value)


def test_safetensors_missing_a_tensor_is_refused_before_reading(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    save_file({NORM: np.ones(HIDDEN, np.float32)}, str(folder / "model.safetensors"))
    with unchanged(folder), pytest.raises(JspecError, match="lacks tensor model.embed_tokens.weight"):
        read_hf(str(folder))


def test_damaged_or_crafted_pytorch_bin_is_refused(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    path = folder / "pytorch_model.bin"
    torch.save({NORM: torch.ones(HIDDEN)}, path)
    path.write_bytes(path.read_bytes()[:-40])  # a truncated zip
    refused(folder, f"{path} is not a PyTorch checkpoint jspec can read", read_hf)

    marker = tmp_path / "ran"

    class Crafted:  # unpickled without weights_only, this would touch the marker
        def __reduce__(self):
            return pathlib.Path.touch, (marker,)

    torch.save({NORM: torch.ones(HIDDEN), "extra": Crafted()}, path)
    refused(folder, f"{path} is not a PyTorch checkpoint jspec can read", read_hf)
    assert not marker.exists()


# -- config.json ------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, phrase", [
    ({"hidden_size": "64"}, "'hidden_size' is '64'; expected a whole number from 1 to 131072"),
    ({"num_hidden_layers": -1}, "'num_hidden_layers' is -1"),
    ({"num_hidden_layers": 10**9}, "'num_hidden_layers' is 1000000000"),
    ({"vocab_size": True}, "'vocab_size' is True"),
    ({"num_attention_heads": 3}, "num_attention_heads (3) does not divide hidden_size (8)"),
    ({"num_key_value_heads": 3, "head_dim": 4}, "the key/value heads (3) do not divide the attention heads (2)"),
    ({"rms_norm_eps": -1.0}, "'rms_norm_eps' is -1.0; expected a finite positive number"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' is 'false'; expected true or false"),
    ({"architectures": "LlamaForCausalLM"}, "'architectures' is 'LlamaForCausalLM'"),
    ({"rope_scaling": "llama3"}, "the rope scaling is 'llama3'"),
    ({"intermediate_size": None}, "lacks 'intermediate_size'"),
])
def test_bad_config_values_are_named(tmp_path, change, phrase):
    config = {k: v for k, v in {**HF_CONFIG, **change}.items() if v is not None}
    with pytest.raises(JspecError) as caught:
        ModelConfig.from_hf(config, "somewhere/config.json")
    assert str(caught.value).startswith("somewhere/config.json") and phrase in str(caught.value), caught.value


def test_converted_config_is_checked_as_well():
    saved = ModelConfig.from_hf(HF_CONFIG).to_json()
    assert ModelConfig.from_json(saved) == ModelConfig.from_hf(HF_CONFIG)
    with pytest.raises(JspecError, match="^out/jspec.json: 'num_layers' is 0; expected"):
        ModelConfig.from_json({**saved, "num_layers": 0}, "out/jspec.json")
    with pytest.raises(JspecError, match="has an unknown key 'evil'"):
        ModelConfig.from_json({**saved, "evil": 1})


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", json.dumps({**HF_CONFIG, "hidden_size": "8"}), b"\xff\xfe"])
def test_cli_convert_of_a_bad_config_is_one_line(tmp_path, capsys, text):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with unchanged(folder):
        assert_one_error(*run(capsys, "convert", folder, tmp_path / "out"), "config.json")
    assert not (tmp_path / "out").exists()


# -- remote code ------------------------------------------------------------------------------------

def test_a_folder_with_remote_code_never_runs_it(tmp_path, capsys, monkeypatch):
    """A Llama (by `architectures`) of an unknown model_type, whose config and tokenizer name a
    class in the folder's own Python: transformers offers to run it, and stdin answers yes.
    Converting must neither ask nor run it."""
    marker = tmp_path / "ran"
    folder = hf_folder(tmp_path / "hf", {**HF_CONFIG, "model_type": "evil_llama",
                                          "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                       "AutoTokenizer": ["evil.EvilTokenizer", None]}})
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
                                    "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_llama'\n"
                                    "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    (folder / "vocab.json").write_text('{"a": 0, "b": 1}')  # a slow tokenizer: only transformers converts it
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tensors = {"model." + name.replace("token_embd", "embed_tokens").replace("output_norm", "norm"): values
               for name, values in gguf_tensors().items() if not name.startswith("blk.")}
    tensors |= {f"model.layers.0.{hf}.weight": gguf_tensors()[f"blk.0.{g}.weight"] for g, hf in [
        ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"), ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
        ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]}
    save_file(tensors, str(folder / "model.safetensors"))
    prompts = []
    monkeypatch.setattr(builtins, "input", lambda *a: prompts.append(a) or "y")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))

    with unchanged(folder):
        code, out, err = run(capsys, "convert", folder, tmp_path / "out")
    assert not marker.exists() and prompts == [] and "Do you wish to run the custom code" not in err + out
    if code == 0:  # a clean result: the model, with token ids only
        assert store.is_converted(tmp_path / "out") and Tokenizer.load(tmp_path / "out") is None
    else:
        assert_one_error(code, out, err, str(folder))


# -- tokenizer files and chat templates -------------------------------------------------------------

def tokenizer_folder(root: pathlib.Path) -> pathlib.Path:
    root.mkdir()
    Pipeline(models.BPE({"a": 0, "b": 1}, [])).save(str(root / "tokenizer.json"))
    return root


@pytest.mark.parametrize("name, content, phrase", [
    ("tokenizer_config.json", b"[1, 2]", "is not a JSON object"),
    ("tokenizer_config.json", b'{"eos_token": "\xff"}', "is not valid JSON"),
    ("tokenizer_config.json", b'{"chat_template": 42}', "chat_template is int, not a template's text"),
    ("tokenizer_config.json", b'{"chat_template": [{"template": "x"}]}', "entries are not named templates"),
    ("special_tokens_map.json", b"{", "is not valid JSON"),
    ("chat_template.json", b'{"chat_template": {"default": ["x"]}}', "chat_template is list"),
    ("chat_template.jinja", b"{{ '\xff' }}", "is not UTF-8 text"),
    ("tokenizer.json", b"\xff\xfe{", "is not a tokenizer jspec can read"),
])
def test_damaged_tokenizer_files_are_named(tmp_path, name, content, phrase):
    folder = tokenizer_folder(tmp_path / "tok")
    (folder / name).write_bytes(content)
    with unchanged(folder), pytest.raises(JspecError) as caught:
        Tokenizer.load(folder)
    assert str(folder / name) in str(caught.value) and phrase in str(caught.value), caught.value


@pytest.mark.parametrize("template", [
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}{{ '' }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{{ 'x' * 10 ** 10 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ ('x' * 2000000)|replace('', 'yyyyyyyyyy') }}",
    "{{ 'x'|center(10 ** 12) }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
])
def test_runaway_chat_template_is_refused_within_seconds(template):
    tokenizer = Tokenizer(Pipeline(models.BPE({"a": 0}, [])), {}, template)
    start = time.perf_counter()
    with pytest.raises(JspecError, match="^the chat template went past jspec's bound: [^\n]*$"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < TEMPLATE_SECONDS + 3
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    long = [{"role": "user", "content": f"message {i} " * 20} for i in range(5000)]
    assert tokenizer.render_chat(long).count("\n") == 5000  # the bound is per render, and spares real ones
