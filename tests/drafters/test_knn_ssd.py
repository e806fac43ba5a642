"""KNN-SSD: per-row sublayer skip sets chosen by nearest anchor, lossless like every method.

The target is test_spec's damped tiny Llama (4 layers whose layers 1..3 change the residual
stream little), so skipping sublayers still drafts well enough to exercise accepts and rejects.
The anchors are the features of the test prompts themselves, mapped to domains so that the rows
of one batch choose different skip sets.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_NEW, all_bfloat16, in_bfloat16, on_mesh
from support.spec import (DAMP, LENGTHS, SAMPLE_ROWS, SAMPLES, SPROMPT, SV, assert_sampled_from, check_stats,
                          convert_tiny, damped, exact_marginals, ids, repetitive_prompts)

from jspec.api import Model
from jspec.bench.hlo import cache_copies
from jspec.drafters.knn_ssd import nearest_anchor, prompt_feature
from jspec.engine.sampling import Sampling
from jspec.errors import JspecError
from jspec.methods import knn_ssd as knn_recipe
from jspec.model import decoder as jmodel
from jspec.parts import knn, shipped
from jspec.parts.folder import fingerprint
from jspec.training import search_skip as skip_search

NEW = 32
SETS = [knn.SkipSet("both-1-2", (1, 2), (1, 2)),  # = layer-skip of layers 1 and 2
        knn.SkipSet("mixed", (2,), (1, 3)),
        knn.SkipSet("attention-3", (3,), ())]
CHOICE = [0, 1, 2, 1]  # the domain each test prompt's own anchor maps to


def hidden(m: Model, prompts) -> tuple[jax.Array, jax.Array]:
    """The prefill's last hidden states [N, 32, D] of prompts right-padded to 32 tokens, and their lengths."""
    tokens = np.zeros((len(prompts), 32), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p["token_ids"])] = p["token_ids"]
    return _prefill(m.params, jnp.asarray(tokens), cfg=m.cfg), jnp.asarray([len(p["token_ids"]) for p in prompts])


_prefill = jax.jit(lambda params, t, cfg: jmodel.forward(params, cfg, t, None, jmodel.KVCache.zeros(cfg, *t.shape))[0],
                   static_argnames="cfg")


def features(m: Model, prompts) -> np.ndarray:
    """The prompts' features [N, D]."""
    return np.asarray(prompt_feature(m.params, m.cfg, *hidden(m, prompts)))


@dataclasses.dataclass
class Setup:
    target: Model
    prompts: list
    ar: list
    folder: str


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    _, cfg, params = convert_tiny(tmp_path_factory, "knn-target", seed=3, num_hidden_layers=4)
    params = damped(params, range(1, 4), DAMP)
    target = Model(dataclasses.replace(cfg, eos_token_ids=()), params, name="target")
    prompts = repetitive_prompts(LENGTHS, cfg.vocab_size, seed=0)
    ar = ids(target.generate(prompts, max_new_tokens=NEW))
    folder = knn.save(tmp_path_factory.mktemp("knn") / "folder",
                      knn.Knn(fingerprint(cfg), SETS, features(target, prompts), np.asarray(CHOICE)))
    return Setup(target, prompts, ar, str(folder))


def test_mask_equals_static_layer_skip(setup):
    """Rows with different masks in one forward each get what the static layer list gives them."""
    m = setup.target
    cfg, params = m.cfg, m.params
    tokens = jnp.asarray([p["token_ids"][:3] for p in setup.prompts[:3]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32) + 5, (3, 3))
    _, filled = jax.jit(lambda p, t: jmodel.forward(p, cfg, t, None, jmodel.KVCache.zeros(cfg, 3, 16)))(
        params, jnp.asarray(np.arange(15).reshape(3, 5) % cfg.vocab_size, jnp.int32))
    masks = np.stack([SETS[0].mask(4), SETS[0].mask(4), np.zeros((2, 4), bool)])
    masked = jax.jit(lambda p, t, pos, c, m: jmodel.run_masked_layers(p, cfg, jmodel.embed(p, t), pos, c, m))
    h, out = masked(params, tokens, pos, filled, jnp.asarray(masks))
    kept = [0, 3]
    want, want_cache = jax.jit(lambda p, t, pos, c: jmodel.run_layers(p, cfg, jmodel.embed(p, t), pos, c, kept))(
        params, tokens, pos, filled)
    want_all = jax.jit(lambda p, t, pos, c: jmodel.forward(p, cfg, t, pos, c)[0])(params, tokens, pos, filled)
    np.testing.assert_allclose(h[:2], want[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h[2], want_all[2], rtol=1e-5, atol=1e-5)
    for i in kept:
        np.testing.assert_allclose(out.k[i][:2], want_cache.k[i][:2], rtol=1e-5, atol=1e-5)
    # batch 1: a skipped attention writes nothing
    h1, out1 = masked(params, tokens[:1], pos[:1], jax.tree.map(lambda x: x[:1], filled), jnp.asarray(masks[:1]))
    np.testing.assert_allclose(h1[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out1.k[1], filled.k[1][:1])


def test_forced_set_equals_layer_skip(setup):
    """The set skipping both sublayers of layers 1 and 2 decodes as layer-skip (1, 2) does."""
    opts = dict(max_new_tokens=NEW, batch_size=4, batching="static")  # test_greedy_equals_ar's program at batch 4
    ls = setup.target.generate(setup.prompts, method="layer-skip", skip_layers=(1, 2), max_draft=knn_recipe.MAX_DRAFT,
                               controller="confidence", threshold=knn_recipe.THRESHOLD, **opts)
    forced = setup.target.generate(setup.prompts, method="knn-ssd", knn=setup.folder, domain="both-1-2", **opts)
    assert ids(ls) == ids(forced) == setup.ar
    assert [r["stats"]["drafted"] for r in ls] == [r["stats"]["drafted"] for r in forced]
    assert [r["stats"]["accepted"] for r in ls] == [r["stats"]["accepted"] for r in forced]
    assert {r["stats"]["domain"] for r in forced} == {"both-1-2"}


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_equals_ar(setup, batch_size, count_compiles):
    records = setup.target.generate(setup.prompts, method="knn-ssd", knn=setup.folder, max_new_tokens=NEW,
                                    batch_size=batch_size, batching="static")
    assert ids(records) == setup.ar
    assert [r["stats"]["domain"] for r in records] == [SETS[c].name for c in CHOICE]
    check_stats(records, knn_recipe.MAX_DRAFT)
    assert sum(r["stats"]["accepted"] for r in records) >= 4
    if batch_size == 1:  # four prompts of one bucket, three skip sets: one program
        assert len(count_compiles) <= 1


@pytest.mark.parametrize("batch_size", [1, 4])
def test_pure_jax_path_equals_ar(setup, pure_jax_path, batch_size):
    """Without the native kernels too: they change no token (issue 13)."""
    target = Model(setup.target.cfg, setup.target.params, name="jax-path")
    records = target.generate(setup.prompts, method="knn-ssd", knn=setup.folder, max_new_tokens=NEW,
                              batch_size=batch_size, batching="static")
    assert ids(records) == setup.ar


def test_no_cache_copy_in_the_loop(setup):
    """A skippable sublayer is computed under lax.cond, and the cache written outside it: inside,
    XLA would copy the cache every draft step (docs/design.md)."""
    fresh = Model(setup.target.cfg, setup.target.params)
    fresh.generate(setup.prompts[:1], method="knn-ssd", knn=setup.folder, max_new_tokens=NEW)
    ((rows, _, in_loop),) = cache_copies(fresh.cfg, fresh.programs())
    assert rows == 1 and in_loop == 0


def test_nearest_anchor_matches_numpy(setup):
    rng = np.random.default_rng(0)
    f, a = rng.normal(size=(64, 8)), rng.normal(size=(30, 8))
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    want = np.argmax(unit(f) @ unit(a).T, axis=-1)
    assert (np.asarray(nearest_anchor(jnp.asarray(f, jnp.float32), jnp.asarray(unit(a), jnp.float32))) == want).all()
    # The prompts' features, by NumPy from the model's hidden states, against random anchors.
    m = setup.target
    anchors = rng.normal(size=(6, m.cfg.hidden_size)).astype(np.float32)
    h, lens = hidden(m, setup.prompts)
    got = nearest_anchor(prompt_feature(m.params, m.cfg, h, lens), jnp.asarray(unit(anchors)))
    for i, n in enumerate(np.asarray(lens)):
        x = np.asarray(h[i, :n], np.float64)
        normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + m.cfg.rms_norm_eps) * np.asarray(m.params["final_norm"])
        assert int(got[i]) == np.argmax(unit(anchors) @ unit(normed.mean(0)))


def test_anchors_of_another_model_refused(setup, tmp_path):
    other = dataclasses.replace(setup.target.cfg, hidden_size=32)
    folder = knn.save(tmp_path / "other", knn.Knn(fingerprint(other), SETS, np.ones((3, 32), np.float32),
                                                  np.arange(3)))
    with pytest.raises(JspecError, match="another model"):
        setup.target.generate(setup.prompts[:1], method="knn-ssd", knn=str(folder))
    with pytest.raises(JspecError, match="KNN-SSD folder .*missing does not exist"):
        setup.target.generate(setup.prompts[:1], method="knn-ssd", knn=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JspecError, match="empty is not a jspec KNN-SSD folder .no knn.json.; make one with jspec"):
        setup.target.generate(setup.prompts[:1], method="knn-ssd", knn=str(tmp_path / "empty"))
    with pytest.raises(JspecError, match="no domain"):
        setup.target.generate(setup.prompts[:1], method="knn-ssd", knn=setup.folder, domain="nope")


def test_search_times_only_runs_that_compiled_nothing(setup, monkeypatch):
    """search-skip's objective: ar and each trial are timed on a run that compiled no program; a
    program's first run (ar's, the first trial's) is repeated, later trials run once."""
    model = Model(setup.target.cfg, setup.target.params, name="fresh")  # no program compiled yet
    runs = []
    run_batch = model.run_batch
    monkeypatch.setattr(model, "run_batch", lambda reqs, *a: runs.append(reqs[0].token_ids) or run_batch(reqs, *a))
    requests = model.requests(setup.prompts[:2])  # one prompt bucket
    first, second = (r.token_ids for r in requests)
    measure = skip_search.Measure(model, requests, 8)
    assert runs == [first, first, second] and measure.ar == [a[:8] for a in setup.ar[:2]]
    for trial in (SETS[0], SETS[1]):
        runs.clear()
        speed, extra = measure(trial)
        assert runs == ([first, first, second] if trial is SETS[0] else [first, second])
        assert speed > 0 and extra["same_as_ar"]


@pytest.mark.slow
def test_sampling_matches_target_distribution(tmp_path_factory):
    _, cfg, params = convert_tiny(tmp_path_factory, "knn-small", seed=5, vocab_size=SV, num_hidden_layers=3)
    target = Model(dataclasses.replace(cfg, eos_token_ids=()), params, name="small")
    sets = [knn.SkipSet("a", (1,), (2,)), knn.SkipSet("b", (2,), (1,))]
    anchors = np.random.default_rng(1).normal(size=(4, cfg.hidden_size)).astype(np.float32)
    folder = knn.save(tmp_path_factory.mktemp("knn-small") / "f",
                      knn.Knn(fingerprint(cfg), sets, anchors, np.array([0, 1, 0, 1])))
    p1, p12, p3 = exact_marginals(target.cfg, params, SPROMPT, Sampling(1.0))
    records = target.generate([{"token_ids": SPROMPT}] * SAMPLES, method="knn-ssd", knn=str(folder), max_draft=3,
                              max_new_tokens=3, batch_size=SAMPLE_ROWS, batching="static", temperature=1.0, seed=17)
    out = np.array(ids(records))
    assert_sampled_from(np.bincount(out[:, 0], minlength=SV), p1, "first token")
    assert_sampled_from(np.bincount(out[:, 0] * SV + out[:, 1], minlength=SV * SV), p12, "first two tokens")
    assert_sampled_from(np.bincount(out[:, 2], minlength=SV), p3, "third token")
    drafted = sum(r["stats"]["drafted"] for r in records)
    accepted = sum(r["stats"]["accepted"] for r in records)
    assert 200 < accepted < 0.95 * drafted, (accepted, drafted)


@pytest.mark.slow
def test_default_model_uses_shipped_folder(default_model):
    """On the default model --method knn-ssd loads jspec/checkpoints/.../knn-ssd: lossless, and each
    record names the domain its prompt chose."""
    folder = shipped.find(default_model, "knn-ssd")
    assert folder is not None, "no knn-ssd folder in jspec/checkpoints/"
    names = knn.load(folder).names()
    prompts = ["Translate German to English: Das Haus ist klein.", "Write a Python function that reverses a list."]
    ar = default_model.generate(prompts, max_new_tokens=DEFAULT_NEW)
    records = default_model.generate(prompts, method="knn-ssd", max_new_tokens=DEFAULT_NEW)
    assert ids(records) == ids(ar)
    assert all(r["stats"]["domain"] in names for r in records)


def test_mesh_equals_one_device(setup):
    """Per-row skip masks and the anchor lookup on a data=2, model=4 mesh at batch 4 (rows choosing
    different sets) and on a model-parallel mesh at batch 1 (the sublayers under lax.cond)."""
    for mesh, batch in (("data=2,model=4", 4), ("data=1,model=4", 1)):
        records = on_mesh(setup.target, mesh).generate(setup.prompts, method="knn-ssd", knn=setup.folder,
                                                       max_new_tokens=NEW, batch_size=batch, batching="static")
        assert ids(records) == setup.ar
        assert [r["stats"]["domain"] for r in records] == [SETS[c].name for c in CHOICE]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_bfloat16_greedy_equals_ar(setup, batch_size):
    """The same target in bfloat16 against its own ar: masked sublayers and the anchor lookup
    round no activation or cache entry that ar does not."""
    bf16 = in_bfloat16(setup.target)
    ar = ids(bf16.generate(setup.prompts, max_new_tokens=NEW))
    records = bf16.generate(setup.prompts, method="knn-ssd", knn=setup.folder, max_new_tokens=NEW,
                            batch_size=batch_size, batching="static")
    assert ids(records) == ar
    assert sum(r["stats"]["accepted"] for r in records) >= 4


def test_bfloat16_activations_and_cache_run(setup):
    """KNN-SSD's masked sublayers with weights, activations and cache in bfloat16: every row
    decodes, drafts accepted."""
    records = all_bfloat16(setup.target).generate(setup.prompts, method="knn-ssd", knn=setup.folder,
                                                  max_new_tokens=NEW, batch_size=4, batching="static")
    assert all(r["new_tokens"] > 0 for r in records) and sum(r["stats"]["accepted"] for r in records) > 0
