"""Converted checkpoints: streamed a piece at a time, written in chunks, loaded piece by piece
onto any mesh, in the source's own dtype unless asked otherwise, converted once per cache."""

from __future__ import annotations

import json
import threading

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from conftest import save_source, tiny_hf_model

from jspec import cli
from jspec.convert import cache, hf, store
from jspec.convert.tensors import Tensors
from jspec.model import layout, sharding


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny float32 Llama of 4 layers, saved as Hugging Face saves one."""
    hf_model = tiny_hf_model("llama", seed=5, num_hidden_layers=4)
    return save_source(hf_model, tmp_path_factory.mktemp("store") / "source", "safetensors")


def leaves(params):
    return jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, params))


def test_conversion_streams_a_piece_at_a_time(source, tmp_path, monkeypatch):
    """With one layer a piece, each piece is written before any tensor of a later layer is read;
    the folder loads back to what one piece of everything would hold."""
    whole = store.load(store.convert(source, tmp_path / "whole"))[1]
    read, reads_at_save = [], []  # tensor names in the order read; (piece, names read so far) at each save
    real_read_hf = hf.read_hf

    def recording_read_hf(src):
        config, tensors = real_read_hf(src)
        readers = {name: (lambda name=name: read.append(name) or tensors[name]) for name in tensors}
        return config, Tensors(readers, {name: tensors.shape(name) for name in tensors})

    real_save = ocp.StandardCheckpointer.save

    def recording_save(self, path, *args, **kwargs):
        reads_at_save.append((path.name, list(read)))
        return real_save(self, path, *args, **kwargs)

    monkeypatch.setattr(hf, "read_hf", recording_read_hf)
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", recording_save)
    monkeypatch.setattr(store, "PIECE_BYTES", 1)
    out = store.convert(source, tmp_path / "pieces")
    cfg = store.read_meta(out)[0]
    outer = ["embed"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
    assert [name for name, _ in reads_at_save] == outer + [f"layers_{i:05d}" for i in range(4)]
    for k, (name, names) in enumerate(reads_at_save[len(outer):]):
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(range(k + 1)), name  # this piece's layer and the earlier ones, none later
    assert json.loads((out / store.META).read_text())["layers_per_piece"] == 1
    pieces = store.load(out)[1]
    assert [p for p, _ in leaves(pieces)] == [p for p, _ in leaves(whole)]
    for (path, a), (_, b) in zip(leaves(pieces), leaves(whole)):
        np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_arrays_are_chunked_and_load_sharded(source, tmp_path, monkeypatch):
    """Arrays over CHUNK_BYTES are stored in several chunks, and a mesh load puts each device's
    share where it belongs, the values those of the unsharded load."""
    monkeypatch.setattr(store, "CHUNK_BYTES", 4096)
    out = store.convert(source, tmp_path / "chunked")
    meta = ocp.StandardCheckpointer().metadata((out / "params" / "layers_00000").absolute()).item_metadata.tree
    w = meta[0]["w_gate_up"]
    assert np.prod(w.storage.chunk_shape) * 4 <= 4096 < np.prod(w.shape) * 4
    cfg, plain, _ = store.load(out)
    mesh = sharding.make_mesh("data=2,model=4")
    _, sharded, _ = store.load(out, shardings=sharding.shardings(layout.param_shapes(cfg), mesh))
    w = sharded["layers"][0]["w_gate_up"]
    assert tuple(w.sharding.spec) == ("model", None) and {s.data.shape[0] for s in w.addressable_shards} == {w.shape[0] // 4}
    for (path, a), (_, b) in zip(leaves(sharded), leaves(plain)):
        np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_gate_and_up_interleave():
    gate, up = np.arange(6.0).reshape(3, 2), -np.arange(6.0).reshape(3, 2)
    w = layout.gate_up(gate, up)
    np.testing.assert_array_equal(w[0::2], gate)
    np.testing.assert_array_equal(w[1::2], up)


def test_the_default_dtype_is_the_sources_own(tmp_path):
    model = tiny_hf_model("llama", seed=6)
    f32 = store.convert(save_source(model, tmp_path / "f32", "safetensors"), tmp_path / "f32-out")
    bf16 = store.convert(save_source(model.to(torch.bfloat16), tmp_path / "bf16", "safetensors"), tmp_path / "bf16-out")
    assert store.read_meta(f32)[1]["dtype"] == "float32" and store.read_meta(bf16)[1]["dtype"] == "bfloat16"
    params = store.load(bf16)[1]
    assert params["embed"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(params["embed"]),  # the checkpoint's bits, not rounded twice
                                  model.model.embed_tokens.weight.detach().float().numpy().astype(ml_dtypes.bfloat16))
    asked = store.convert(str(tmp_path / "bf16"), tmp_path / "asked", "float32")
    assert store.read_meta(asked)[1]["dtype"] == "float32"
    assert cache.own_dtype(str(tmp_path / "bf16")) == "bfloat16" and cache.own_dtype(str(bf16)) == "bfloat16"


def test_convert_without_out_fills_the_cache(source, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    assert cli.main(["convert", source]) == 0
    [folder] = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert store.is_converted(folder) and str(folder) in capsys.readouterr().out
    assert cache.resolve(source) == folder  # what --model SOURCE then loads, with nothing converted again


def test_concurrent_first_uses_convert_once(source, tmp_path, monkeypatch):
    """Two threads resolving one unconverted source into one cache: one conversion, one folder."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    calls, real = [], store.convert
    monkeypatch.setattr(store, "convert", lambda *a: calls.append(a) or real(*a))
    found = []
    threads = [threading.Thread(target=lambda: found.append(cache.resolve(source))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(found)) == 1 and store.is_converted(found[0])
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [found[0].name]
