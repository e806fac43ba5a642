"""The decoding program each platform gets, lowered with jax.export (no device needed): on a GPU or
a TPU a speculative round verifies its K + 1 positions with no conditional (each branch index
would be a copy to the host on a GPU, two a layer), where a CPU keeps one branch per width; and
the one width decodes the tokens the branches do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from support.spec import DAMP, damped, repetitive_prompts

from jspec import methods
from jspec.api import Model
from jspec.engine import loop
from jspec.engine.sampling import Sampling
from jspec.model import decoder, kernels

OPTIONS = {"ngram": {"datastore": "off", "max_draft": 4}, "layer-skip": {"skip_layers": [1], "max_draft": 4}}
NEW = 12


@pytest.fixture(scope="module")
def model(tiny_llama) -> Model:
    """The tiny Llama with its skipped layer damped, so that layer-skip's drafts are often right."""
    return Model(tiny_llama.cfg, damped(tiny_llama.params, [1], DAMP), name="tiny")


def lowered(model: Model, method: str, platform: str) -> str:
    """The StableHLO of `model`'s decoding program for one prompt with `method` on `platform`."""
    drafter, dparams, controller = methods.build(method, model, **OPTIONS[method])
    tokens, packing = model.pack(model.requests([{"token_ids": [5, 6, 7, 5, 6, 7]}]), 1)
    cache = decoder.KVCache.zeros(model.cfg, 1, 64)
    args = jnp.asarray(tokens), jax.tree.map(jnp.asarray, packing), jnp.asarray(model.cfg.eos_token_ids or (-1,))
    with kernels.off():  # jspec's native kernels are CPU code: a GPU or TPU program never has them
        exported = jax.export.export(loop.generate, platforms=[platform])(
            model.params, dparams, cache, *args, jax.random.key(0), cfg=model.cfg, sampling=Sampling(),
            max_new_tokens=NEW, drafter=drafter, controller=controller, platform=platform)
    return exported.mlir_module()


def conditionals_in_loops(text: str) -> int:
    """`stablehlo.case` ops inside `while` ops (a `while` runs from its line until the braces
    come back to the depth before it)."""
    depth, loops, count = 0, [], 0
    for line in text.splitlines():
        starts = "stablehlo.while" in line
        if starts:
            loops.append(depth)
        count += bool(loops) and "stablehlo.case" in line
        depth += line.count("{") - line.count("}")
        while loops and not starts and depth <= loops[-1]:
            loops.pop()
    return count


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_an_accelerator_round_has_no_conditional_where_a_cpu_has_one_a_layer(model, method):
    assert conditionals_in_loops(lowered(model, method, "cpu")) >= 2 * model.cfg.num_layers
    for platform in ("cuda", "tpu"):
        assert conditionals_in_loops(lowered(model, method, platform)) == 0, platform


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_one_width_decodes_what_the_widths_do(model, method, monkeypatch):
    """The single width of an accelerator, run on this CPU: the same tokens and the same accepted
    drafts as the narrowest-width branches, at batch 1 and 3 (rows of different acceptance)."""
    prompts = repetitive_prompts((9, 30, 14), model.cfg.vocab_size, seed=4)
    for batch in (1, 3):
        want = model.generate(prompts, method=method, batch_size=batch, max_new_tokens=NEW, **OPTIONS[method])
        with monkeypatch.context() as m:
            m.setattr(Model, "platform", property(lambda self: "cuda"))
            got = model.generate(prompts, method=method, batch_size=batch, max_new_tokens=NEW, **OPTIONS[method])
            assert {sig[-1] for sig in model.programs()} == {"cpu", "cuda"}
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
        assert [r["stats"]["accepted"] for r in got] == [r["stats"]["accepted"] for r in want]
    assert sum(r["stats"]["accepted"] for r in want) > 0  # the drafts were tried, and some kept
