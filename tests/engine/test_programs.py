"""The decoding program each platform gets, lowered with jax.export (no device needed): on a GPU or
a TPU a speculative round verifies its K + 1 positions with no conditional (each branch index
would be a copy to the host on a GPU, two a layer), where a CPU keeps one branch per width; the
one width decodes the tokens the branches do; and the program holds the numerics asked for
(jspec.model.numerics): float32 activations multiply at HIGHEST precision, and a bfloat16 policy
keeps its cache in bfloat16 and widens no weight inside the loop."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import all_bfloat16, in_bfloat16, in_int8
from support.spec import DAMP, damped, repetitive_prompts

from jspec import methods
from jspec.api import Model
from jspec.engine import loop, slots
from jspec.engine.sampling import Sampling
from jspec.model import attention, decoder, kernels
from jspec.model.kernels import gpu_attention
from jspec.model.numerics import Numerics

OPTIONS = {"ngram": {"datastore": "off", "max_draft": 4}, "layer-skip": {"skip_layers": [1], "max_draft": 4}}
SPECULATIVE = sorted(OPTIONS)
OPTIONS["ar"] = {}
ACCELERATORS = ("cuda", "tpu")
ALL_BF16 = Numerics("bfloat16", "bfloat16")
# The cache's length in the lowered programs: longer than an accelerator's prefill chunk, so that no
# array of a chunk has the cache's shape.
LENGTH = 2 * loop.ACCELERATOR_CHUNK
NEW = 12


@pytest.fixture(scope="module")
def model(tiny_llama) -> Model:
    """The tiny Llama with its skipped layer damped, so that layer-skip's drafts are often right."""
    return Model(tiny_llama.cfg, damped(tiny_llama.params, [1], DAMP), name="tiny")


@pytest.fixture(scope="module")
def program(model):
    """program(method, platform, numerics): the StableHLO of `model`'s decoding program for one
    prompt, lowered for `platform`; bfloat16 activations come with bfloat16 weights."""
    return functools.cache(lambda method, platform, numerics=Numerics(): lowered(
        model if numerics.activations == "float32" else all_bfloat16(model), method, platform, numerics))


def lowered(model: Model, method: str, platform: str, numerics: Numerics = Numerics(), length: int = LENGTH) -> str:
    """The StableHLO of `model`'s decoding program for one prompt with `method` on `platform`,
    with a cache of `length` entries. A CPU program is lowered without jspec's native kernels (a
    foreign call cannot be exported); a GPU's holds its Pallas attention (a Triton call, which
    jax.export asks to be named: its compatibility is jax's and Triton's, not export's)."""
    drafter, dparams, controller = methods.build(method, model, **OPTIONS[method])
    tokens, lens = model.prompt_rows(model.requests([{"token_ids": [5, 6, 7, 5, 6, 7]}]), 1, length)
    cache = decoder.KVCache.zeros(model.cfg, 1, length, numerics.kv_cache_dtype)
    args = jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(model.cfg.eos_token_ids or (-1,))
    triton = [jax.export.DisabledSafetyCheck.custom_call(gpu_attention.TARGET)]
    with kernels.off() if platform == "cpu" else contextlib.nullcontext():
        run = loop.Run(model.cfg, Sampling(), NEW, drafter, controller, numerics=numerics, platform=platform)
        exported = jax.export.export(loop.generate, platforms=[platform], disabled_checks=triton)(
            model.params, dparams, cache, *args, jax.random.key(0), None, run=run)
    return exported.mlir_module()


def in_loops(text: str) -> list[str]:
    """The lines inside `while` ops (a `while` runs from its line until the braces come back to
    the depth before it; braces inside strings, such as a kernel's serialized IR, do not count)."""
    depth, loops, inside = 0, [], []
    for line in text.splitlines():
        starts = "stablehlo.while" in line
        if starts:
            loops.append(depth)
        if loops:
            inside.append(line)
        code = re.sub(r'"(?:[^"\\]|\\.)*"', "", line)
        depth += code.count("{") - code.count("}")
        while loops and not starts and depth <= loops[-1]:
            loops.pop()
    return inside


def conditionals_in_loops(text: str) -> int:
    return sum("stablehlo.case" in line for line in in_loops(text))


@pytest.mark.parametrize("method", SPECULATIVE)
def test_an_accelerator_round_has_no_conditional_where_a_cpu_has_one_a_layer(model, program, method):
    assert conditionals_in_loops(lowered(model, method, "cpu")) >= 2 * model.cfg.num_layers
    for platform in ACCELERATORS:
        assert conditionals_in_loops(program(method, platform)) == 0, platform


def dots(text: str) -> list[str]:
    return [line for line in text.splitlines() if "stablehlo.dot_general" in line]


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_float32_activations_multiply_at_highest_precision(model, program, method):
    """The default policy's every product, attention's included, asks for HIGHEST precision on a
    GPU and a TPU: float32 there, not TF32 or bfloat16 passes."""
    for platform in ACCELERATORS:
        text = program(method, platform)
        assert dots(text) and all("precision = [HIGHEST, HIGHEST]" in line for line in dots(text)), platform
        assert f"tensor<1x{LENGTH}x{model.cfg.num_kv_heads}x{model.cfg.head_dim}xf32>" in text  # the float32 cache


def tensors(line: str) -> list[tuple[str, str]]:
    """(shape, element type) of each tensor type on an HLO line: ("64x128", "bf16")."""
    return re.findall(r"tensor<((?:\d+x)*)(\w+)>", line)


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_a_bfloat16_policy_keeps_cache_and_weights_in_bfloat16(model, program, method):
    """With weights, activations and cache in bfloat16 the cache is bfloat16 throughout the loop
    (no float32 array of its shape), its products run at DEFAULT precision, and no weight is
    converted inside the loop: a widened copy of a weight would be written each step."""
    cache = f"1x{LENGTH}x{model.cfg.num_kv_heads}x{model.cfg.head_dim}x"
    for platform in ACCELERATORS:
        text = program(method, platform, ALL_BF16)
        body = in_loops(text)
        assert not any((cache, "f32") in tensors(line) for line in body), platform
        assert any((cache, "bf16") in tensors(line) for line in body), platform
        assert dots(text) and not any("precision" in line for line in dots(text)), platform
        assert not widened(text, model), platform


def widened(text: str, model: Model) -> list[str]:
    """The converts to float32 of an array of a weight's shape inside the loop."""
    weights = {"x".join(map(str, x.shape)) + "x" for x in jax.tree.leaves(model.params) if x.ndim == 2}
    return [line for line in in_loops(text) if "stablehlo.convert" in line
            and any(shape in weights and kind == "f32" for shape, kind in tensors(line))]


def test_float32_activations_widen_bfloat16_weights(model):
    """What the default policy pays for float32 over bfloat16 weights: each weight widened as the
    loop reads it (XLA may fuse the convert into the product), as the test above would see."""
    assert len(widened(lowered(in_bfloat16(model), "ar", "cuda"), model)) >= 4 * model.cfg.num_layers


def test_int8_weights_reach_an_accelerators_product_as_stored(model):
    """On a TPU an int8 weight goes into its product as int8 (float32 or bfloat16 rows times int8
    values, the per-row scale applied to the product's outputs); on a GPU into jspec's Pallas
    kernel (kernels/gpu_int8.py), as jax's own lowering would convert the values first. Either
    way no convert of it inside the loop: no wider copy of a weight is made."""
    m8 = in_int8(model)
    shapes = {"x".join(map(str, x.shape)) + "x" for x in jax.tree.leaves(m8.params) if x.ndim == 2}
    int8_weight = lambda line: any(s in shapes and kind == "i8" for s, kind in tensors(line))  # noqa: E731
    product = {"tpu": "stablehlo.dot_general", "cuda": f"@{gpu_attention.TARGET}"}
    for platform, numerics in itertools.product(ACCELERATORS, (Numerics(), ALL_BF16)):
        body = in_loops(lowered(m8, "ar", platform, numerics))
        products = [line for line in body if product[platform] in line and int8_weight(line)]
        assert len(products) >= 4 * model.cfg.num_layers + 1, (platform, numerics)  # every matrix, the LM head
        assert not [line for line in body if "stablehlo.convert" in line and int8_weight(line)], (platform, numerics)


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_accelerators_read_only_the_filled_part_of_the_cache(model, method):
    """With a cache of 1,024 entries, a CPU's attention multiplies the whole cache each step; a
    TPU's reads it in blocks of KEY_BLOCK in a loop that stops at the furthest query, and a GPU's
    is its Pallas kernel, one a layer, with no product over the cache left to XLA."""
    length = 2 * attention.KEY_BLOCK
    whole, block = (f"1x{n}x{model.cfg.num_kv_heads}x{model.cfg.head_dim}x" for n in (length, attention.KEY_BLOCK))
    over = lambda shape, text: [line for line in in_loops(text) if "stablehlo.dot_general" in line  # noqa: E731
                                and any(s == shape for s, _ in tensors(line))]
    assert over(whole, lowered(model, method, "cpu", length=length))
    tpu, cuda = (lowered(model, method, platform, length=length) for platform in ("tpu", "cuda"))
    assert not over(whole, tpu) and over(block, tpu)
    assert not over(whole, cuda) and not over(block, cuda)
    assert sum(f"@{gpu_attention.TARGET}" in line for line in in_loops(cuda)) >= model.cfg.num_layers


def test_an_accelerator_admit_prefills_its_rows_through_the_platforms_attention(model):
    """Continuous batching's admit (jspec.engine.slots) prefills a prompt into its slot of the
    batch's cache on an accelerator too (its rows taken out for the platform's attention): a GPU's
    prefill chunks attend through the Pallas kernel, a TPU's read the cache in blocks."""
    drafter, dparams, controller = methods.build("ar", model)
    tokens, lens = map(jnp.asarray, model.prompt_rows(model.requests([{"token_ids": [5, 6, 7]}] * 2), 2, LENGTH))
    eos, key = jnp.asarray(model.cfg.eos_token_ids or (-1,)), jax.random.key(0)
    block = f"1x{attention.KEY_BLOCK}x{model.cfg.num_kv_heads}x{model.cfg.head_dim}x"
    for platform in ACCELERATORS:
        run = loop.Run(model.cfg, Sampling(), NEW, drafter, controller, platform=platform)
        s = jax.eval_shape(functools.partial(slots.fill, run=run), model.params, dparams,
                           decoder.KVCache.zeros(model.cfg, 2, LENGTH), tokens, lens, jnp.ones(2, bool), eos, key)
        text = jax.export.export(slots.admit, platforms=[platform],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(gpu_attention.TARGET)])(
            model.params, dparams, s, tokens[:1], lens[:1], jnp.asarray([1], jnp.int32), eos, key,
            run=run).mlir_module()
        if platform == "cuda":
            assert sum(f"@{gpu_attention.TARGET}" in line for line in in_loops(text)) >= model.cfg.num_layers
        else:
            assert [line for line in in_loops(text) if "stablehlo.dot_general" in line
                    and any(shape == block for shape, _ in tensors(line))]


@pytest.mark.parametrize("method", SPECULATIVE)
def test_one_width_decodes_what_the_widths_do(model, method, monkeypatch):
    """The single width of an accelerator (and the GPU's attention kernel, interpreted), run on this
    CPU: the same tokens and the same accepted drafts as the narrowest-width branches, at batch 1
    and 3 (rows of different acceptance)."""
    prompts = repetitive_prompts((9, 30, 14), model.cfg.vocab_size, seed=4)
    for batch in (1, 3):
        want = model.generate(prompts, method=method, batch_size=batch, batching="static", max_new_tokens=NEW,
                              **OPTIONS[method])
        with monkeypatch.context() as m:
            m.setattr(Model, "platform", property(lambda self: "cuda"))
            m.setattr(gpu_attention, "attention", functools.partial(gpu_attention.attention, interpret=True))
            jax.clear_caches()  # jit's traces of the exports above hold the kernel uninterpreted
            got = model.generate(prompts, method=method, batch_size=batch, batching="static", max_new_tokens=NEW,
                                 **OPTIONS[method])
            assert {sig.run.platform for sig in model.programs()} == {"cpu", "cuda"}
        jax.clear_caches()
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
        assert [r["stats"]["accepted"] for r in got] == [r["stats"]["accepted"] for r in want]
    assert sum(r["stats"]["accepted"] for r in want) > 0  # the drafts were tried, and some kept


def conditional_outputs(jaxpr) -> list[tuple[int, ...]]:
    """The shapes of what every conditional in a jaxpr and the jaxprs inside it returns."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    shapes += conditional_outputs(inner)
    return shapes


@pytest.mark.parametrize("method, logprobs", [("ngram", 0), ("ngram", 3), ("layer-skip", 0)])
def test_a_round_judges_its_drafts_at_the_width_it_verified(model, method, logprobs):
    """A CPU round verifies at one of a few widths (a conditional each); the target's logits there
    are judged in the same branch, never padded to K + 1 positions: no conditional of a priced
    program (which has width 1, a plain step) returns an array of the vocabulary's size (padded,
    such a round cost 1.19x `ar`'s step at batch 32 in bfloat16)."""
    drafter, dparams, controller = methods.build(method, model, **OPTIONS[method])
    tokens, lens = model.prompt_rows(model.requests([{"token_ids": [5, 6, 7, 5, 6, 7]}] * 2), 2, LENGTH)
    cache = decoder.KVCache.zeros(model.cfg, 2, LENGTH, jnp.float32)
    run = loop.Run(model.cfg, Sampling(), NEW, drafter, controller, logprobs=logprobs)
    costs = jnp.ones(drafter.max_draft + 1, jnp.float32)
    traced = jax.make_jaxpr(functools.partial(loop.generate, run=run))(
        model.params, dparams, cache, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray([-1]), jax.random.key(0),
        costs)
    shapes = conditional_outputs(traced.jaxpr)
    assert len(shapes) >= 2 * model.cfg.num_layers  # the widths' branches are there
    assert not [s for s in shapes if model.cfg.vocab_size in s]
