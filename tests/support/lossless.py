"""The greedy lossless tests' shared target: a damped tiny Llama whose drafts are often accepted,
prompts of very different lengths, an EOS id some rows reach, heads, and `ar`'s tokens to match
(tests/methods/test_lossless.py, test_bfloat16.py; test_sampling.py saves its heads with
`save_heads`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from support.spec import DAMP, LENGTHS, check_stats, convert_tiny, damped, ids, repetitive_prompts

from jspec.api import Model
from jspec.parts import heads
from jspec.parts.folder import fingerprint

NEW = 32  # max_new_tokens of the greedy tests
FREE_NEW = NEW + 8  # the run without EOS goes further: the oracle drafter reads past NEW
K = 4  # max_draft of the drafter x controller product

DRAFTERS = {
    "draft": dict(method="draft"),  # the target's first two layers as a separate model
    "early-exit-1": dict(method="early-exit", exit_layer=1),
    "early-exit-2": dict(method="early-exit", exit_layer=2),
    "layer-skip": dict(method="layer-skip", skip_layers=(1, 2)),
    "ngram": dict(method="ngram"),
    "eesd": dict(method="eesd"),  # heads copied from layer 1 (untrained), draft vocabulary with gaps
    "kangaroo": dict(method="kangaroo"),
    "eagle": dict(method="eagle"),  # an untrained head: the target's last layer over state + embedding
}
HEAD_EXIT = 1
CONTROLLERS = {
    "fixed": dict(controller="fixed"),
    "confidence": dict(controller="confidence"),
    "heuristic": dict(controller="heuristic"),
    "dv": dict(controller="dv"),
    "thompson-beta": dict(controller="thompson", thompson_variant="beta"),
    "thompson-calibration": dict(controller="thompson", thompson_variant="calibration"),
}


@dataclasses.dataclass
class Spec:
    target: Model  # EOS = `eos`
    draft: Model  # the target's first two layers
    free: Model  # the target without EOS ids
    prompts: list
    ar: list  # greedy `ar` token ids of `prompts` under `target`
    free_ar: list  # ... under `free`: always FREE_NEW tokens
    eos: int
    heads: dict  # method -> saved head folder


def save_heads(folder, cfg, params, vocab) -> dict:
    """Untrained eesd and kangaroo heads (copies of layer HEAD_EXIT) and an eagle head (a copy of
    the last layer) over draft vocabulary `vocab`."""
    exit_layer = lambda kind: cfg.num_layers if kind == "eagle" else HEAD_EXIT
    meta = lambda kind: {"kind": kind, "exit_layer": exit_layer(kind), "model": fingerprint(cfg),
                         "draft_vocab": len(vocab)}
    return {kind: str(heads.save(folder / kind, heads.init(params, cfg, kind, exit_layer(kind), vocab), meta(kind)))
            for kind in heads.KINDS}


def make_spec(tmp_path_factory) -> Spec:
    """The target, its draft model, prompts and ar's output (the tests' module-scoped `spec`)."""
    _, cfg, params = convert_tiny(tmp_path_factory, "spec-target", seed=3, num_hidden_layers=4)
    params = damped(params, range(1, 4), DAMP)
    free = Model(dataclasses.replace(cfg, eos_token_ids=()), params, name="free")
    prompts = repetitive_prompts(LENGTHS, cfg.vocab_size, seed=0)
    free_ar = ids(free.generate(prompts, max_new_tokens=FREE_NEW, batch_size=4, batching="static"))
    assert all(len(t) == FREE_NEW for t in free_ar)
    # An EOS id the model produces mid-generation (first at index >= 5) in some rows but not all,
    # preferring one that appears in more rows.
    first_at = [{t: row.index(t) for t in set(row[:NEW])} for row in free_ar]
    candidates = [t for t in set().union(*first_at)
                  if all(f.get(t, NEW) >= 5 for f in first_at) and any(t not in f for f in first_at)]
    eos = max(candidates, key=lambda t: (sum(t in f for f in first_at), -min(f.get(t, NEW) for f in first_at)))
    target = Model(dataclasses.replace(cfg, eos_token_ids=(eos,)), params, name="target")
    dcfg = dataclasses.replace(target.cfg, num_layers=2)
    draft = Model(dcfg, {**params, "layers": params["layers"][:2]}, name="draft")
    ar = ids(target.generate(prompts, max_new_tokens=NEW))
    assert ids(target.generate(prompts, max_new_tokens=NEW, batch_size=4, batching="static")) == ar
    for row, full in zip(ar, free_ar):  # EOS cuts the free run right after its first EOS
        full = full[:NEW]
        assert row == (full[:full.index(eos) + 1] if eos in full else full)
    assert any(len(row) < NEW for row in ar) and any(len(row) == NEW for row in ar)
    # The heads' draft vocabulary leaves out one token the target emits: it can never be drafted.
    emitted = sorted({t for row in free_ar for t in row})
    vocab = np.array([t for t in emitted if t != ar[0][1]], np.int32)
    head_paths = save_heads(tmp_path_factory.mktemp("spec-heads"), cfg, params, vocab)
    return Spec(target, draft, free, prompts, ar, free_ar, eos, head_paths)


def method_options(spec: Spec, drafter: str, options: dict) -> tuple[str, dict]:
    """A DRAFTERS entry with `options` over it, as (method, generate's keyword arguments): its draft
    model or head is spec's unless `options` names one."""
    opts = {**DRAFTERS[drafter], **options}
    method = opts.pop("method")
    if method == "draft":
        opts.setdefault("draft_model", spec.draft)
    if method in heads.KINDS:
        opts.setdefault("head", spec.heads[method])
    return method, opts


def run(spec: Spec, drafter: str, controller: str = "fixed", *, batch_size: int = 4, max_new_tokens: int = NEW,
        max_draft: int = K, batching: str = "static", **options):
    """Greedy records of spec.prompts under spec.target with a DRAFTERS entry and a CONTROLLERS entry.
    Static batching by default: one program a run, where continuous batching compiles two, and
    tests/engine/test_slots.py holds every drafter's identity under continuous batching."""
    method, opts = method_options(spec, drafter, {**CONTROLLERS[controller], **options})
    return spec.target.generate(spec.prompts, method=method, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                max_draft=max_draft, batching=batching, **opts)


def check_lossless(spec: Spec, records, k: int = K, fixed_model_drafter: bool = False):
    assert ids(records) == spec.ar
    for r in records:
        t = r["token_ids"]
        assert (t[-1] == spec.eos and spec.eos not in t[:-1]) if len(t) < NEW else spec.eos not in t
    check_stats(records, k, fixed_model_drafter)


CANDIDATES = 3


def run_candidates(spec: Spec, drafter: str, batch_size: int, candidates: int = CANDIDATES):
    method, opts = method_options(spec, drafter, {})
    return spec.target.generate(spec.prompts, method=method, max_new_tokens=NEW, batch_size=batch_size,
                                candidates=candidates, batching="static", **opts)
