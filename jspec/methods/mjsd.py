"""mjsd: W beams of K drafts over a head, accepted by joint likelihood (MJSD); lossy.

The beams run over --draft-model, else over --head, else over the target's first --exit-layer
layers and its own LM head, else over the shipped EESD head (default model), else over early exit
at a quarter of the layers. --exit-layer may name every layer: the target drafting for itself, the
MJGD approximation (slow, a quality reference)."""

from jspec.drafters.beam import Beam
from jspec.drafters.early_exit import EarlyExit
from jspec.errors import JspecError
from jspec.methods import draft, early_exit, trained_head
from jspec.methods.options import EXIT_LAYER, HEAD, Method, Option
from jspec.parts import heads, shipped

GROUP = "mjsd (lossy: the output differs from ar's)"
# K = 4 drafts in W = 4 beams with tau = 0.5, the reference's settings (docs/methods.md).
MAX_DRAFT = 4
BEAM_WIDTH = 4
ACCEPT_THRESHOLD = 0.5

WIDTH = Option("beam_width", "int", "beams drafted per round (default: 4)", "W", group=GROUP)
TAU = Option("accept_threshold", "float", "keep the longest draft prefix whose target/draft likelihood ratio exceeds "
             "TAU (default: 0.5)", "TAU", group=GROUP)
TREE = Option("tree", "bool", "verify every beam in one forward (the reference's tree attention) and keep the longest "
              "prefix of any beam that passes, each judged against the draft's best beam, instead of verifying the "
              "best beam by draft score alone", group=GROUP)


def build(model, o):
    if o.controller not in (None, "fixed"):
        raise JspecError("--method mjsd always drafts --max-draft tokens: it takes no --controller")
    width = BEAM_WIDTH if o.beam_width is None else o.beam_width
    tau = ACCEPT_THRESHOLD if o.accept_threshold is None else o.accept_threshold
    most = min(64, model.cfg.vocab_size)
    if not 1 <= width <= most:
        raise JspecError(f"--beam-width must be between 1 and {most}, got {width}")
    if not (0 < tau < float("inf")):
        raise JspecError(f"--accept-threshold must be a positive number, got {tau}")
    layers = model.cfg.num_layers
    if o.exit_layer is not None and not 1 <= o.exit_layer <= layers:
        raise JspecError(f"--exit-layer must be between 1 and {layers} for --method mjsd "
                         f"({layers}: the target drafts for itself), got {o.exit_layer}")
    k = o.max_draft
    if o.draft_model is not None:
        inner, dparams = draft.drafter(model, o.draft_model, k)
    elif o.head is not None or (o.exit_layer is None and shipped.find(model, "eesd") is not None):
        kind = heads.read_meta(o.head)["kind"] if o.head is not None else "eesd"
        inner, dparams = trained_head.drafter(model, kind, o.head, k, o.exit_layer)
    elif o.exit_layer == layers:
        inner, dparams = EarlyExit(max_draft=k, exit_layer=layers), ()
    else:
        inner, dparams = early_exit.drafter(model, o.exit_layer, k)
    beam = Beam(inner=inner, width=width, threshold=tau, tree=bool(o.tree))
    return beam, beam.params(dparams)


METHOD = Method("mjsd", build, "beams over a head, accepted by joint likelihood", lossless=False,
                max_draft=(MAX_DRAFT, MAX_DRAFT), options=(EXIT_LAYER, draft.DRAFT_MODEL, HEAD, WIDTH, TAU, TREE))
