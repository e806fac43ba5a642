"""Converted checkpoints that cannot go stale, tear or decode garbage: the cache key follows the
source's files, a damaged or older folder is redone and swapped in whole, and weights or first
logits that are not finite numbers are refused in one line."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import save_source, tiny_hf_model
from support.cli import assert_one_error, run

import jspec
from jspec.convert import cache, store
from jspec.errors import JspecError

# A damaged orbax file fails one read while orbax has others in flight: their coroutines, closed
# when collected (in whichever test runs then), report "Exception ignored" through Python's
# unraisable hook. The `jspec` script silences them after its one line; here they are expected.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny float32 Llama saved as Hugging Face saves one."""
    return save_source(tiny_hf_model("llama", seed=3), tmp_path_factory.mktemp("safety") / "source", "safetensors")


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def files_of(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def embed(folder):
    return np.asarray(store.load(folder)[1]["embed"])


def test_weights_rewritten_in_place_are_converted_again(source, tmp_path, own_cache):
    """The same folder with its weights file rewritten in place (same name, same size): a new
    conversion of the new weights, not the old one reused."""
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    first = cache.resolve(str(folder))
    assert cache.resolve(str(folder)) == first  # unchanged: reused
    before = (folder / "model.safetensors").stat().st_size
    tiny_hf_model("llama", seed=4).save_pretrained(folder)
    assert (folder / "model.safetensors").stat().st_size == before
    second = cache.resolve(str(folder))
    assert second != first and not np.array_equal(embed(second), embed(first))
    assert np.array_equal(embed(second), embed(store.convert(str(folder), tmp_path / "fresh")))


def test_a_damaged_or_older_cached_folder_is_converted_again(source, own_cache):
    """A cached folder whose jspec.json is torn, or of another format, is redone and swapped in."""
    out = cache.resolve(source)
    want = embed(out)
    for torn in ('{"format": ', '{"format": 5}'):
        (out / store.META).write_text(torn)
        assert not store.is_current(out)
        assert cache.resolve(source) == out and store.is_current(out)
        assert np.array_equal(embed(out), want)
    assert sorted(p.name for p in own_cache.iterdir() if not p.name.endswith(".lock")) == [out.name]


@pytest.mark.parametrize("damage", ["meta", "array"])
def test_a_damaged_converted_folder_is_one_line(source, tmp_path, capsys, damage):
    """A converted folder given as --model with a torn jspec.json or array file: one line that names
    it, and the folder left as it was."""
    out = store.convert(source, tmp_path / "converted")
    if damage == "meta":
        (out / store.META).write_text('{"format": 6, "dtype": "float32", "config": {"vocab_size": "many"}')
        phrase = "jspec.json is unreadable"
    else:
        # the largest file: the one holding the arrays' bytes (by name, another may come last)
        data = max((p for p in (out / "params" / "layers_00000").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[:100])
        phrase = "params/layers_00000 is damaged or unreadable"
    kept = files_of(out)
    assert_one_error(*run(capsys, "generate", "--model", out, "--no-chat", "--max-new-tokens", 2, "hi"), phrase)
    assert files_of(out) == kept


def test_a_crafted_meta_is_refused_in_one_line(source, tmp_path):
    out = store.convert(source, tmp_path / "converted")
    (out / store.META).write_text('{"format": 6, "dtype": "float32", "layers_per_piece": 1, "config": {"x": 1}}')
    with pytest.raises(JspecError, match="jspec.json: the model config"):
        store.read_meta(out)


def test_non_finite_weights_are_refused(tmp_path, capsys):
    """A checkpoint with a NaN in one weight converts (conversion copies), but loading it is
    refused in one line naming the piece and the weight."""
    import torch

    hf = tiny_hf_model("llama", seed=6)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    out = store.convert(save_source(hf, tmp_path / "source", "safetensors"), tmp_path / "converted")
    with pytest.raises(JspecError, match=r"params/layers_00000 holds non-finite numbers \(NaN or infinity\) in 1/w_down"):
        jspec.load(str(out))
    assert_one_error(*run(capsys, "generate", "--model", out, "--no-chat", "hi"), "non-finite numbers")


def test_non_finite_first_logits_are_refused(tiny_llama):
    """A Model built by hand from weights no load checked, here a NaN final norm: the first batch
    is refused in one line, not decoded into one token over and over."""
    params = {**tiny_llama.params, "final_norm": tiny_llama.params["final_norm"] * np.nan}
    model = jspec.Model(tiny_llama.cfg, params)
    with pytest.raises(JspecError, match="first logits for prompt 0 are not finite"):
        model.generate([{"token_ids": [1, 2, 3]}], max_new_tokens=2)
