"""specee: no draft; the target exits early when per-layer predictors say its token is settled
(SpecEE); lossy."""

from pathlib import Path

import jax.numpy as jnp

from jspec.drafters import specee
from jspec.errors import JspecError
from jspec.methods.options import EXIT_THRESHOLD, HEAD, Method, Option
from jspec.model import sharding
from jspec.parts import heads, predictors

GROUP = "specee (lossy: the output differs from ar's)"
# The reference's 0.5 lets SmolLM2-135M's predictors (held-out precision 0.57-0.70 below depth 21)
# exit on tokens the full model would not write: output NLL 3.5x ar's. 0.9 costs +14-15% in every
# run; 0.95 +4.1-4.4% alone and -1.0 to -2.3% behind --lookup 2 (docs/journal/2026-11-23_specee.md),
# the one setting measured within SpecEE's quality bound of +5%.
DEFAULT_EXIT_THRESHOLD = 0.95

PREDICTORS = Option("predictors", "str", "exit predictors from jspec train-predictors (default: those shipped for the "
                    "default model)", "PATH", group=GROUP)
EXIT_CHOICE = Option("exit_choice", "str", "the token an exit emits: the argmax among the head's candidates, or over "
                     "the whole vocabulary", choices=specee.CHOICES, flag=False, group=GROUP)
EXIT_KV = Option("exit_kv", "str", "the deeper layers' cache entries of an exited token: filled from its exit "
                 "state, or left out and masked", choices=specee.KV_MODES, flag=False, group=GROUP)


def build(model, o):
    """SpecEE's drafter and params: its predictors, the head they were trained over (its candidates:
    the copy in the predictors' folder unless --head names another), and the K/V rows of the layers
    an exit may skip."""
    threshold = DEFAULT_EXIT_THRESHOLD if o.exit_threshold is None else o.exit_threshold
    kv = o.exit_kv or "fill"
    if o.lookup is not None and kv != "fill":
        # A copying round runs every layer at its positions, which "mask"'s map of missing entries
        # does not follow.
        raise JspecError("--lookup goes with SpecEE's exit_kv='fill' (the default), not 'mask'")
    path, pp, meta = predictors.load_for(model, o.predictors)
    kind = meta["head"]["kind"]
    if o.head is not None and heads.read_meta(o.head).get("kind") != kind:
        raise JspecError(f"the predictors {path} were trained over a head of kind {kind}: give --head one of "
                         "that kind, or --predictors trained over this one")
    hp, head_meta = heads.load_for(model, kind, o.head or Path(path) / "head")
    n = head_meta["exit_layer"]
    if meta["depths"][0] != n or meta["depths"][-1] != model.cfg.num_layers - 1:
        raise JspecError(f"predictors {path} cover depths {meta['depths'][0]}..{meta['depths'][-1]}, but their "
                         f"head exits at layer {n} and the model has {model.cfg.num_layers} layers")
    drafter = specee.SpecEE(exit_layer=n, schedule=tuple(meta["schedule"]), choice=o.exit_choice or "candidates",
                            kv=kv, copies=o.lookup is not None)
    dparams = specee.Params(head=heads.drafting(model, hp),
                            kv=sharding.place(specee.kv_weights(model.params, model.cfg, n), model.mesh),
                            pred=pp, threshold=jnp.float32(threshold))
    return drafter, dparams


METHOD = Method("specee", build, "none: the model exits early when per-layer predictors say its token is settled",
                lossless=False, drafts=False, max_draft=(0, 0), lookup=True,
                options=(HEAD, EXIT_THRESHOLD, PREDICTORS, EXIT_CHOICE, EXIT_KV))
