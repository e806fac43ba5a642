"""Sharded generation over the 8 simulated CPU devices (see conftest.py) equals unsharded
generation token for token, with the parameters and the KV cache really split over the mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jspec
from conftest import save_source, tiny_hf_model
from jspec.convert import store
from jspec.errors import JspecError
from jspec.sharding import make_mesh

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS from conftest.py)")

# Every sharded dimension divides by 8: kv heads 4 (x (G + 2 = 4) x H 16 = 256 qkv columns),
# hidden 128, MLP 256, vocab 256.
SHARDABLE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, vocab_size=256)
NEW = 16
LENGTHS = [3, 30, 12, 25, 7, 18, 5, 28]  # one prompt bucket (32): one program per batch size


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("shardable")
    hf = tiny_hf_model("llama", seed=3, **SHARDABLE)
    return str(store.convert(save_source(hf, root / "source", "safetensors"), root / "converted"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [{"token_ids": rng.integers(0, 256, n).tolist()} for n in LENGTHS]


@pytest.fixture(scope="module")
def unsharded(converted):
    m = jspec.load(converted)
    assert m.mesh is None and len(m.params["embed"].sharding.device_set) == 1
    return m


@pytest.fixture(scope="module")
def reference(unsharded, prompts):
    records = unsharded.generate(prompts, max_new_tokens=NEW)
    assert len({tuple(r["token_ids"]) for r in records}) == len(prompts)
    return [r["token_ids"] for r in records]


def spec(x) -> tuple:
    """A parameter's PartitionSpec as a tuple padded with None to its rank."""
    s = tuple(x.sharding.spec)
    return s + (None,) * (x.ndim - len(s))


@pytest.mark.parametrize("mesh, batch_size", [("data=2,model=4", 4), ("model=8", 2), ("data=8", 8)])
def test_sharded_generation_equals_unsharded(converted, prompts, reference, mesh, batch_size):
    m = jspec.load(converted, mesh=mesh)
    sizes = dict(m.mesh.shape)
    assert m.mesh.devices.size == 8 and set(m.mesh.axis_names) == {"data", "model"}
    layer = m.params["layers"][0]
    # The parameters live split over the mesh, not on one device.
    assert len(layer["wqkv"].sharding.device_set) == 8
    if sizes["model"] > 1:
        assert spec(layer["wqkv"]) == ("model", None)  # [out, in]: column parallel
        assert spec(layer["w_gate_up"]) == ("model", None)
        assert spec(layer["wo"]) == (None, "model")  # row parallel
        assert spec(layer["w_down"]) == (None, "model")
        assert spec(m.params["embed"]) == ("model", None)
        assert spec(m.params["lm_head"]) == ("model", None)  # [V, D], split over the vocabulary
        assert layer["wqkv"].addressable_shards[0].data.shape == (256 // sizes["model"], 128)
        assert layer["w_down"].addressable_shards[0].data.shape == (128, 256 // sizes["model"])
    else:
        assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(m.params))
    assert spec(layer["attn_norm"]) == (None,) and spec(m.params["final_norm"]) == (None,)

    records = m.generate(prompts, max_new_tokens=NEW, batch_size=batch_size)
    assert [r["token_ids"] for r in records] == reference
    # The KV cache kept for the next batch is split too: rows over data, kv heads over model
    # (4 kv heads do not divide over 8 devices: replicated there).
    [cache] = m._caches.values()
    k = cache.k[0]
    assert k.shape[0] == batch_size
    expected = ("data" if sizes["data"] > 1 else None, None, "model" if sizes["model"] == 4 else None, None)
    assert tuple(a if a is None or sizes[a] > 1 else None for a in spec(k)) == expected


def test_sharded_sampling_equals_unsharded(converted, prompts, unsharded):
    """Sampling draws the same tokens whatever the mesh (jax's partitionable random keys)."""
    options = dict(max_new_tokens=NEW, batch_size=4, temperature=1.0, seed=3)
    expected = [r["token_ids"] for r in unsharded.generate(prompts, **options)]
    m = jspec.load(converted, mesh="data=2,model=4")
    assert [r["token_ids"] for r in m.generate(prompts, **options)] == expected


def test_make_mesh():
    assert make_mesh(None) is None
    mesh = make_mesh("data=2,model=4")
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]
    assert dict(make_mesh("model=8").shape) == {"data": 1, "model": 8}
    assert dict(make_mesh(" data = 2 ").shape) == {"data": 2, "model": 1}
    assert dict(make_mesh("model=2,data=3").shape) == {"data": 3, "model": 2}  # uses 6 of the 8
    assert make_mesh(mesh) is mesh
    custom = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    assert make_mesh(custom) is custom


@pytest.mark.parametrize("bad", ["data:2", "data=two", "data=0", "data=-1", "rows=2", "data=2;model=4", "model"])
def test_make_mesh_bad_syntax(bad):
    with pytest.raises(JspecError, match="bad --mesh .*: write it as data=N,model=M"):
        make_mesh(bad)


@pytest.mark.parametrize("too_big, need", [("data=16", 16), ("data=2,model=8", 16), ("data=3,model=3", 9)])
def test_make_mesh_more_devices_than_exist(too_big, need):
    with pytest.raises(JspecError, match=f"needs {need} devices but only 8 are available"):
        make_mesh(too_big)


def test_load_refuses_a_bad_mesh_before_loading(tmp_path):
    with pytest.raises(JspecError, match="needs 16 devices"):
        jspec.load(str(tmp_path / "not-even-a-model"), mesh="model=16")
