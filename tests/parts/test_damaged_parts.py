"""Damaged and crafted part folders (a head, SpecEE's predictors, a datastore, a KNN-SSD folder):
each is refused as it loads, in one line naming the folder and what is wrong, never a traceback,
arrays of the wrong shape or NaN weights that decode without a word."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cli import assert_one_error, run

from jspec.errors import JspecError
from jspec.parts import datastore, heads, knn, predictors
from jspec.parts.folder import fingerprint

EXIT = 1
MODULES = {"head": heads, "predictors": predictors, "datastore": datastore, "knn": knn}


@pytest.fixture(scope="module")
def sound(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """One sound folder of each kind for tiny_llama, made with the public API."""
    cfg, params = tiny_llama.cfg, tiny_llama.params
    root, model = tmp_path_factory.mktemp("parts"), fingerprint(cfg)
    head = heads.save(root / "head", heads.init(params, cfg, "kangaroo", EXIT, np.arange(7, 60, dtype=np.int32)),
                      {"kind": "kangaroo", "exit_layer": EXIT, "model": model})
    depths = list(range(EXIT, cfg.num_layers))
    pred = predictors.save(root / "predictors", predictors.init(jax.random.key(0), len(depths)),
                           {"model": model, "head": {"kind": "kangaroo", "exit_layer": EXIT}, "depths": depths,
                            "schedule": depths}, head)
    table = datastore.build([([1, 5, 6, 7, 5, 6, 7, 5, 6, 7], 2), ([1, 4, 5, 6, 7, 5, 6, 7], 2)], min_count=1)
    anchors = np.random.default_rng(0).normal(size=(4, cfg.hidden_size)).astype(np.float32)
    sets = [knn.SkipSet("a", (1,), (2,)), knn.SkipSet("b", (2,), (1,))]
    return {"head": head, "predictors": pred, "datastore": datastore.save(root / "datastore", table, {"model": model}),
            "knn": knn.save(root / "knn", knn.Knn(model, sets, anchors, np.array([0, 1, 0, 1])))}


def load(kind: str, path: Path, cfg):
    """Load the folder as the method that runs with it does (KNN-SSD's model check is at dparams)."""
    return knn.load(path).dparams(cfg) if kind == "knn" else MODULES[kind].load(path, cfg)


# -- damage, each applied to a copy of a sound folder: damage(path, tiny_llama) ------------------

def marker(change):
    """The marker rewritten with `change` applied (the copy's folder is named by its kind)."""
    def damage(path, lm):
        file = path / MODULES[path.name].FOLDER.marker
        meta = json.loads(file.read_text())
        change(meta)
        file.write_text(json.dumps(meta))
    return damage


def truncated(*parts):
    """Cut the file in half, or the largest file of the folder `parts` names."""
    def damage(path, lm):
        target = path.joinpath(*parts)
        if target.is_dir():
            target = max((f for f in target.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        target.write_bytes(target.read_bytes()[:target.stat().st_size // 2])
    return damage


def meta_of(path: Path) -> dict:
    """The marker's metadata as `save` takes it (it adds the format)."""
    meta = json.loads((path / MODULES[path.name].FOLDER.marker).read_text())
    return {k: v for k, v in meta.items() if k != "format"}


def head_arrays(change, depth=1, **meta):
    """The head saved again, `depth` layers, with `change` applied to its parameters and `meta` to
    its marker."""
    def damage(path, lm):
        hp = heads.init(lm.params, lm.cfg, "kangaroo", EXIT, np.arange(7, 60, dtype=np.int32), depth=depth)
        heads.save(path, change(hp), {**meta_of(path), **meta})
    return damage


def predictor_arrays(change):
    """The predictors saved again with `change` applied to their parameters."""
    def damage(path, lm):
        pp = predictors.init(jax.random.key(0), lm.cfg.num_layers - EXIT)
        predictors.save(path, change(pp), meta_of(path), path / "head")
    return damage


def npz(name, change):
    """The .npz `name` written again with `change` applied to its arrays."""
    def damage(path, lm):
        with np.load(path / name) as z:
            arrays = dict(z)
        np.savez(path / name, **change(arrays, lm.cfg))
    return damage


def claims_more(path, lm):
    """ngram_next's header claims 2**40 entries; the archive holds its real few."""
    with np.load(path / "table.npz") as z:
        arrays = dict(z)
    with zipfile.ZipFile(path / "table.npz", "w") as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w") as f:
                if name == "ngram_next":
                    np.lib.format.write_array_header_1_0(f, {"descr": "<i4", "fortran_order": False, "shape": (2**40,)})
                    f.write(a.tobytes())
                else:
                    np.lib.format.write_array(f, a)


def with_nan(x) -> np.ndarray:
    """A copy of the array x with a NaN first."""
    x = np.array(x)
    x.flat[0] = np.nan
    return x


def set_key(key, value):
    def change(meta):
        meta[key] = value
    return change


CASES = [
    # the marker: keys the loaders use, and their types
    ("head", marker(lambda m: m.pop("model")), "head.json is damaged: it has no 'model'"),
    ("head", marker(set_key("exit_layer", "1")), "'exit_layer' must be an integer, not \"1\""),
    ("head", marker(set_key("exit_layer", True)), "'exit_layer' must be an integer, not true"),
    ("head", marker(set_key("kind", "medusa")), "'kind' must be one of eesd, kangaroo, eagle"),
    ("head", marker(set_key("format", "4")), "has format 4"),
    ("head", truncated("head.json"), "head.json is unreadable"),
    ("predictors", marker(set_key("depths", "1,2")), "'depths' must be a list of integers"),
    ("predictors", marker(lambda m: m["head"].pop("kind")), "predictors.json is damaged: it has no 'kind'"),
    ("predictors", marker(set_key("schedule", [1, 9])), "schedule depths [1, 9] outside the depths"),
    ("datastore", marker(set_key("model", [])), "'model' must be an object, not []"),
    ("knn", marker(lambda m: m.pop("sets")), "knn.json is damaged: it has no 'sets'"),
    ("knn", marker(set_key("sets", [])), "names no skip set"),
    ("knn", marker(lambda m: m["sets"][0].update(skip_attention=[1.5])),
     "'skip_attention' must be a list of integers"),
    ("knn", marker(lambda m: m["sets"][1].update(skip_mlp=[99])), "skip set 'b' names layers outside 0..2"),
    ("knn", marker(lambda m: m["model"].update(hidden_size="64")), "'hidden_size' must be an integer"),
    # orbax checkpoints: damaged files, and arrays of the wrong shape, dtype or values
    ("head", truncated("params", "_METADATA"), "params is damaged or not an orbax checkpoint: its metadata cannot be"),
    ("head", truncated("params", "ocdbt.process_0", "d"), "params is damaged or unreadable"),
    ("head", head_arrays(lambda hp: {**hp, "layers": [{**lp, "wqkv": with_nan(lp["wqkv"])} for lp in hp["layers"]]}),
     "non-finite numbers (NaN or infinity) in layers/0/wqkv"),
    ("head", head_arrays(lambda hp: {**hp, "norm": jnp.ones(65)}), "wrong arrays: norm is [65] float32, not [64]"),
    ("head", head_arrays(lambda hp: {k: v for k, v in hp.items() if k != "norm"}), "wrong arrays: no norm"),
    ("head", head_arrays(lambda hp: {**hp, "vocab": hp["vocab"].astype(jnp.float32)}),
     "vocab is [53] float32, not [53] int32"),
    ("head", head_arrays(lambda hp: {**hp, "vocab": hp["vocab"].at[0].set(300)}), "ids outside this model's 0..255"),
    ("head", head_arrays(lambda hp: {**hp, "vocab": np.arange(257, dtype=np.int32) % 256}),
     "a draft vocabulary of 257 tokens; this model has 256"),
    ("head", head_arrays(lambda hp: hp, depth=2, exit_layer=2),
     "has 2 layers; a kangaroo head exiting at layer 2 has at most 1"),
    ("predictors", truncated("params", "ocdbt.process_0", "d"), "params is damaged or unreadable"),
    ("predictors", predictor_arrays(lambda pp: {**pp, "b2": with_nan(pp["b2"])}),
     "non-finite numbers (NaN or infinity) in b2"),
    ("predictors", predictor_arrays(lambda pp: {**pp, "w1": pp["w1"][:, :11]}),
     "w1 is [2, 11, 512] float32, not [2, 12, 512]"),
    ("predictors", marker(lambda m: m.update(depths=[2], schedule=[2])),
     "w1 is [2, 12, 512] float32, not [1, 12, 512]"),
    # .npz arrays: damaged archives, crafted headers, wrong shapes, ranges and values
    ("datastore", truncated("table.npz"), "table.npz is damaged or unreadable"),
    ("datastore", claims_more, "array 'ngram_next' ([1099511627776] int32) does not match its"),
    ("datastore", npz("table.npz", lambda a, cfg: {k: v for k, v in a.items() if k != "ngram_hash"}),
     "holds no array 'ngram_hash'"),
    ("datastore", npz("table.npz", lambda a, cfg: {**a, "ngram_next": a["ngram_next"].astype(object)}),
     "array 'ngram_next'"),
    ("datastore", npz("table.npz", lambda a, cfg: {**a, "ngram_keys": a["ngram_keys"].astype(np.int64)}),
     "ngram_keys is [16, 3] int64, not [16, 3] int32"),
    ("datastore", npz("table.npz", lambda a, cfg: {**a, "ngram_next": a["ngram_next"][1:]}),
     "wrong arrays: ngram_hash is [16] int32, not [15] int32; ngram_keys is [16, 3] int32, not [15, 3] int32"),
    ("datastore", npz("table.npz", lambda a, cfg: {**a, "ngram_next": a["ngram_next"] + cfg.vocab_size}),
     "token ids beyond this model's vocabulary (256)"),
    ("datastore", npz("table.npz", lambda a, cfg: {**a, "ngram_hash": a["ngram_hash"][::-1]}),
     "ngram_hash is not its keys' hashes in ascending order"),
    ("datastore", npz("table.npz", lambda a, cfg: {k: v[:0] for k, v in a.items()}), "holds no entries"),
    ("knn", truncated("anchors.npz"), "anchors.npz is damaged or unreadable"),
    ("knn", npz("anchors.npz", lambda a, cfg: {**a, "anchors": with_nan(a["anchors"])}),
     "anchors.npz holds non-finite numbers (NaN or infinity) in anchors"),
    ("knn", npz("anchors.npz", lambda a, cfg: {**a, "anchors": a["anchors"][:, :-1]}),
     "anchors is [4, 63] float32, not [4, 64] float32"),
    ("knn", npz("anchors.npz", lambda a, cfg: {**a, "domain": a["domain"] + 5}), "each of a domain 0..1"),
]


def test_sound_folders_load(sound, tiny_llama):
    for kind, path in sound.items():
        load(kind, path, tiny_llama.cfg)


@pytest.mark.parametrize("kind, damage, phrase", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_damaged_folder_is_refused_in_one_line(sound, tiny_llama, tmp_path, kind, damage, phrase):
    path = Path(shutil.copytree(sound[kind], tmp_path / kind))
    damage(path, tiny_llama)
    with pytest.raises(JspecError) as e:
        load(kind, path, tiny_llama.cfg)
    message = str(e.value)
    assert str(path) in message and phrase in message and "\n" not in message, message


@pytest.mark.parametrize("method, flag, kind, damage, phrase", [
    ("kangaroo", "--head", "head", truncated("params", "ocdbt.process_0", "d"), "head/params is damaged or unreadable"),
    ("specee", "--predictors", "predictors", predictor_arrays(lambda pp: {**pp, "w1": with_nan(pp["w1"])}),
     "predictors/params holds non-finite numbers"),
    ("specee", "--predictors", "predictors", truncated("head", "params", "_METADATA"),
     "predictors/head/params is damaged or not an orbax checkpoint"),
    ("ngram", "--datastore", "datastore", truncated("table.npz"), "table.npz is damaged or unreadable"),
    ("knn-ssd", "--knn", "knn", marker(lambda m: m["sets"][0].update(name=None)), "'name' must be a string"),
])
def test_generate_with_a_damaged_folder_ends_in_one_line(sound, tiny_llama, tmp_path, capsys, method, flag, kind,
                                                         damage, phrase):
    path = Path(shutil.copytree(sound[kind], tmp_path / kind))
    damage(path, tiny_llama)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n")
    code, out, err = run(capsys, "generate", "--model", tiny_llama.path, "--prompts", prompts, "--output",
                         tmp_path / "out.jsonl", "--max-new-tokens", "2", "--method", method, flag, path)
    # specee says it is lossy before it loads anything
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("jspec: warning: "))
    assert_one_error(code, out, err, phrase)
    assert not (tmp_path / "out.jsonl").exists()
