"""Sharded generation over the 8 simulated CPU devices (see conftest.py) equals unsharded
generation token for token, with the parameters and the KV cache really split over the mesh;
converted models and trained heads restore onto whatever devices the model uses now, not those
they were saved from."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_NEW, save_source, tiny_hf_model
from jax.sharding import Mesh

import jspec
from jspec import methods
from jspec.convert import store
from jspec.errors import JspecError
from jspec.model import decoder, kernels, layout, sharding
from jspec.model.config import ModelConfig
from jspec.model.sharding import make_mesh
from jspec.parts import heads
from jspec.parts.folder import fingerprint

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


@pytest.fixture(scope="module")
def bfloat16_reference(converted, prompts):
    return [r["token_ids"] for r in jspec.load(converted, "bfloat16").generate(prompts, max_new_tokens=NEW)]


@pytest.mark.parametrize("method", ["ar", "ngram", "layer-skip"])
def test_bfloat16_sharded_generation_equals_unsharded_batch1(converted, prompts, bfloat16_reference, method):
    """bfloat16, where a rounding difference would show: every row on a data=2,model=4 mesh at
    batch 4 equals the unsharded ar run at batch 1."""
    m = jspec.load(converted, "bfloat16", mesh="data=2,model=4")
    options = {} if method == "ar" else {"max_draft": 3}
    records = m.generate(prompts, method, max_new_tokens=NEW, batch_size=4, **options)
    assert [r["token_ids"] for r in records] == bfloat16_reference


@pytest.fixture(scope="module")
def int8_reference(converted, prompts):
    return [r["token_ids"] for r in jspec.load(converted, "int8").generate(prompts, max_new_tokens=NEW)]


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_int8_sharded_generation_equals_unsharded_batch1(converted, prompts, int8_reference, method):
    """int8 weights shard like float ones, each row's scale with its row: on a data=2,model=4 mesh
    at batch 4 every row equals the unsharded ar run at batch 1."""
    m = jspec.load(converted, "int8", mesh="data=2,model=4")
    wqkv = m.params["layers"][0]["wqkv"]
    assert m.dtype == "int8" and wqkv.values.dtype == jnp.int8
    assert spec(wqkv.values) == ("model", None) and spec(wqkv.scale) == ("model",)
    wo = m.params["layers"][0]["wo"]
    assert spec(wo.values) == (None, "model") and spec(wo.scale) == (None,)
    options = {} if method == "ar" else {"max_draft": 3}
    records = m.generate(prompts, method, max_new_tokens=NEW, batch_size=4, **options)
    assert [r["token_ids"] for r in records] == int8_reference


def test_sharded_sampling_equals_unsharded(converted, prompts, unsharded):
    """Sampling draws the same tokens whatever the mesh (jax's partitionable random keys)."""
    options = dict(max_new_tokens=NEW, batch_size=4, temperature=1.0, seed=3)
    expected = [r["token_ids"] for r in unsharded.generate(prompts, **options)]
    m = jspec.load(converted, mesh="data=2,model=4")
    assert [r["token_ids"] for r in m.generate(prompts, **options)] == expected


def on_one_device(tree) -> bool:
    return all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(tree))


def same_values(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_converted_model_restores_onto_any_mesh_whatever_it_was_saved_from(converted, unsharded, tmp_path):
    sharded = jspec.load(converted, mesh="data=2,model=4")
    assert len(sharded.params["layers"][0]["wqkv"].sharding.device_set) == 8
    resaved = store.save(tmp_path / "resaved", sharded.cfg, sharded.params, None, "float32", "a mesh")
    single = jspec.load(str(resaved))
    assert on_one_device(single.params) and same_values(single.params, unsharded.params)
    other = jspec.load(str(resaved), mesh="model=8")
    assert spec(other.params["layers"][0]["wqkv"]) == ("model", None) and dict(other.mesh.shape)["model"] == 8
    assert same_values(other.params, unsharded.params)


def test_draft_model_loaded_apart_drafts_on_the_mesh(converted, prompts, reference):
    """--method draft loads the draft model on its own; its parameters join the target's mesh."""
    m = jspec.load(converted, mesh="data=2,model=4")
    records = m.generate(prompts[:2], method="draft", draft_model=converted, max_new_tokens=NEW, batch_size=2,
                         batching="static")
    assert [r["token_ids"] for r in records] == reference[:2]
    assert all(r["stats"]["accepted"] == r["stats"]["drafted"] > 0 for r in records)  # the target drafts itself


# Heads copied from the last layer (exit at layer 1 of 2) and the final norm, nudged so they are
# not the target's own computation, over a draft vocabulary of 240 tokens (divisible by 4 and 8).
HEAD_VOCAB = np.arange(16, 256, dtype=np.int32)


def save_head(folder, lm, kind: str) -> tuple[str, dict]:
    exit_layer = lm.cfg.num_layers if kind == "eagle" else 1
    hp = heads.init(lm.params, lm.cfg, kind, exit_layer, HEAD_VOCAB)
    rng = np.random.default_rng(0)
    hp["layers"] = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(np.float32), hp["layers"])
    meta = {"kind": kind, "exit_layer": exit_layer, "model": fingerprint(lm.cfg)}
    return str(heads.save(folder / kind, hp, meta)), hp


@pytest.fixture(scope="module")
def one_device_heads(unsharded, tmp_path_factory) -> dict:
    """A head of each kind, saved from the unsharded model (so recorded on one device)."""
    folder = tmp_path_factory.mktemp("one-device-heads")
    return {kind: save_head(folder, unsharded, kind)[0] for kind in heads.KINDS}


@pytest.mark.parametrize("kind", heads.KINDS)
def test_head_saved_on_one_device_drafts_on_a_mesh(converted, prompts, reference, unsharded, one_device_heads,
                                                   kind):
    m = jspec.load(converted, mesh="data=2,model=4")
    for batch_size in (1, 2):
        options = dict(method=kind, head=one_device_heads[kind], max_new_tokens=NEW, batch_size=batch_size,
                       batching="static")
        expected = unsharded.generate(prompts[:2], **options)
        got = m.generate(prompts[:2], **options)
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected] == reference[:2]
        # The head drafts on the mesh what it drafts on one device.
        assert [r["stats"] for r in got] == [r["stats"] for r in expected]
        assert sum(r["stats"]["accepted"] for r in got) > 0
    _, dparams, _ = methods.build(kind, m, head=one_device_heads[kind])
    assert all(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(dparams))
    assert spec(dparams["layers"][0]["wqkv"]) == ("model", None)
    assert spec(dparams["lm_head"]) == ("model", None)  # the draft vocabulary's rows [M, D], split over M
    assert dparams["vocab"].sharding.is_fully_replicated and dparams["norm"].sharding.is_fully_replicated
    assert kind != "eagle" or dparams["fuse"].sharding.is_fully_replicated


@pytest.mark.parametrize("kind", ["eagle", "eesd"])
def test_candidates_on_a_mesh(converted, prompts, reference, unsharded, one_device_heads, kind):
    """A head's top 3 side by side at batch 2 on a data=2,model=4 mesh: the same tokens, rounds and
    accepted candidates as on one device (the moved cache entries are split over the model axis)."""
    m = jspec.load(converted, mesh="data=2,model=4")
    options = dict(method=kind, head=one_device_heads[kind], candidates=3, max_new_tokens=NEW, batch_size=2,
                   batching="static")
    expected = unsharded.generate(prompts[:2], **options)
    got = m.generate(prompts[:2], **options)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected] == reference[:2]
    assert [r["stats"] for r in got] == [r["stats"] for r in expected]
    assert sum(r["stats"]["accepted"] for r in got) > 0


def test_lookup_first_on_a_mesh(converted, prompts, reference, unsharded, one_device_heads):
    """Prompt lookup in front of a head (batch 1: a model-parallel mesh): the same tokens and the
    same rounds on a mesh as on one device."""
    m = jspec.load(converted, mesh="model=8")
    options = dict(method="kangaroo", head=one_device_heads["kangaroo"], lookup=1, max_new_tokens=NEW, batch_size=1)
    expected = unsharded.generate(prompts[:2], **options)
    got = m.generate(prompts[:2], **options)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected] == reference[:2]
    assert [r["stats"] for r in got] == [r["stats"] for r in expected]
    assert sum(r["stats"]["lookup_rounds"] for r in got) > 0


def test_datastore_on_a_mesh(converted, prompts, reference, unsharded, tmp_path):
    """`ngram` with a datastore (of the model's own output) on a data=2,model=4 mesh: its table is
    replicated, and the tokens and rounds are one device's."""
    from jspec.parts import datastore

    table = datastore.build([(p["token_ids"] + row, len(p["token_ids"])) for p, row in zip(prompts, reference)])
    path = str(datastore.save(tmp_path / "ds", table, {"model": fingerprint(unsharded.cfg)}))
    m = jspec.load(converted, mesh="data=2,model=4")
    _, dparams, _ = methods.build("ngram", m, datastore=path)
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8 for x in dparams.values())
    options = dict(method="ngram", datastore=path, max_new_tokens=NEW, batch_size=8, batching="static")
    expected = unsharded.generate(prompts, **options)
    got = m.generate(prompts, **options)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected] == reference
    assert [r["stats"] for r in got] == [r["stats"] for r in expected]
    assert sum(r["stats"]["accepted"] for r in got) > 0


def test_head_saved_on_a_mesh_loads_on_one_device(converted, prompts, reference, unsharded, tmp_path):
    sharded = jspec.load(converted, mesh="data=2,model=4")
    path, hp = save_head(tmp_path, sharded, "kangaroo")
    assert len(hp["layers"][0]["wqkv"].sharding.device_set) == 8  # saved from the mesh
    restored, _ = heads.load(path, unsharded.cfg)
    assert on_one_device(restored)
    records = unsharded.generate(prompts[:2], method="kangaroo", head=path, max_new_tokens=NEW)
    assert [r["token_ids"] for r in records] == reference[:2]


def test_make_mesh():
    assert make_mesh(None) is None
    mesh = make_mesh("data=2,model=4")
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]
    assert dict(make_mesh("model=8").shape) == {"data": 1, "model": 8}
    assert dict(make_mesh(" data = 2 ").shape) == {"data": 2, "model": 1}
    assert dict(make_mesh("model=2,data=3").shape) == {"data": 3, "model": 2}  # uses 6 of the 8
    assert dict(make_mesh("model=2").shape) == {"data": 1, "model": 2}  # 2 of the 8
    assert list(make_mesh("model=2").devices.flat) == jax.devices()[:2]
    assert make_mesh(mesh) is mesh
    custom = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    assert make_mesh(custom) is custom
    with pytest.raises(JspecError, match=r"a mesh needs the axes 'data' and 'model', this one has \('x', 'y'\)"):
        make_mesh(Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("x", "y")))
    with pytest.raises(JspecError, match="mesh takes 'data=N,model=M' or a jax.sharding.Mesh, got 8"):
        make_mesh(8)


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def collectives(fn, *args) -> dict[str, int]:
    """How many of each collective the compiled program of fn(*args) runs (async ones by their start)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {op: n for op in COLLECTIVES if (n := len(re.findall(rf"\s{op}(?:-start)?\(", text)))}


def concatenated_mlp(cfg, lp, h):
    """The MLP as it was with w_gate_up's gate rows then its up rows, split in halves."""
    x = decoder.rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    gate, up = jnp.split(decoder.linear(x, lp["w_gate_up"]), 2, axis=-1)
    return h + decoder.linear(jax.nn.silu(gate) * up, lp["w_down"])


@pytest.mark.parametrize("mesh", ["model=2", "model=4", "model=8", "data=2,model=4"])
@pytest.mark.parametrize("rows", [1, 8, 128])  # one row, the CPU's multiply-and-sum rows, a matmul
def test_the_mlp_moves_nothing_but_its_all_reduce(mesh, rows):
    """w_gate_up interleaved and split over `model`: each device holds the gate and up rows of the
    same units, so the MLP's only collective is the all-reduce after w_down. Gate rows then up
    rows, split in halves, needed collective-permutes to bring each gate to its up."""
    mesh = make_mesh(mesh)
    D, F = SHARDABLE["hidden_size"], SHARDABLE["intermediate_size"]
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=D, intermediate_size=F, num_layers=1, num_heads=8,
                      num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512,
                      attention_bias=False, tie_word_embeddings=True)  # the MLP reads only rms_norm_eps
    rng = np.random.default_rng(rows)
    gate, up, down = (rng.standard_normal(s, np.float32) / 8 for s in ((F, D), (F, D), (D, F)))
    norm, h = 1 + rng.standard_normal(D, np.float32) / 8, rng.standard_normal((2, rows, D), np.float32)
    place = lambda w_gate_up: sharding.place(  # noqa: E731
        {"mlp_norm": norm, "w_gate_up": w_gate_up, "w_down": down}, mesh)
    new, old = place(layout.gate_up(gate, up)), place(np.concatenate([gate, up]))
    on_mesh = jax.device_put(h, sharding.rows_sharding(mesh, h.shape))
    with kernels.off():  # as on any mesh (jspec.api): XLA cannot split the native kernel
        assert collectives(functools.partial(decoder.mlp_block, cfg), new, on_mesh) == {"all-reduce": 1}
        got = collectives(functools.partial(concatenated_mlp, cfg), old, on_mesh)
        assert got.get("collective-permute", 0) + got.get("all-to-all", 0) + got.get("all-gather", 0) > 0, got
        out = np.asarray(jax.jit(functools.partial(decoder.mlp_block, cfg))(new, on_mesh))
    # Hugging Face's MLP on the same weights: down(silu(gate(x)) * up(x)).
    x = h * norm / np.sqrt(np.mean(h ** 2, axis=-1, keepdims=True) + 1e-6)
    g, u = x @ gate.T, x @ up.T
    np.testing.assert_allclose(out, h + (g / (1 + np.exp(-g)) * u) @ down.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(layout.interleave_gate_up(np.concatenate([gate, up]))),
                                  layout.gate_up(gate, up))


@pytest.mark.parametrize("bad", ["data:2", "data=two", "data=0", "data=-1", "rows=2", "data=2;model=4", "model",
                                 "data=1,data=2", "", "data=2,"])
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


@pytest.mark.slow
def test_shipped_heads_on_a_mesh_give_the_unsharded_tokens(default_model):
    """The issue's command, `--method eesd --mesh data=2,model=4`, on the default model: the
    unsharded tokens (those of `ar`: the heads are lossless, test_heads.py checks it unsharded).
    Kangaroo's shipped head has the same kinds of leaves; test_head_saved_on_one_device_drafts_on_a_mesh
    places both kinds."""
    m = jspec.load(mesh="data=2,model=4")
    prompts = ["Name three primes.", "What is 12 times 7?"]
    expected = [r["token_ids"] for r in default_model.generate(prompts, max_new_tokens=DEFAULT_NEW)]
    got = m.generate(prompts, method="eesd", max_new_tokens=DEFAULT_NEW)
    assert [r["token_ids"] for r in got] == expected
    assert sum(r["stats"]["accepted"] for r in got) > 0
