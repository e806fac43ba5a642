"""What the three methods over a trained head (eesd, kangaroo, eagle) share: the head a method
drafts with, the user's or the one shipped for the default model, as a drafter."""

from jspec.drafters.eagle import Eagle
from jspec.drafters.early_exit import EarlyExit
from jspec.errors import JspecError
from jspec.methods.options import EXIT_LAYER, HEAD, Method
from jspec.parts import heads

# K = 1 on a CPU: with the native kernels a verification of 2-4 positions costs about 1.1 decode
# steps, and K = 2 and 4 still lost 0-0.06x `ar` to K = 1 under the heads' controllers
# (docs/journal/2026-11-27_prefetching-into-l2.md; docs/heads.md, "Draft length"). Accelerators
# verify a few positions for about one step's price.
MAX_DRAFT = (1, 4)


def drafter(model, kind: str, head: str | None, max_draft: int, exit_layer: int | None = None,
            candidates: int | None = None):
    """The drafter and params of head `head` (of `kind`; None: the shipped one)."""
    hp, meta = heads.load_for(model, kind, head)
    if exit_layer is not None and exit_layer != meta["exit_layer"]:
        raise JspecError(f"the {kind} head exits at layer {meta['exit_layer']}, not --exit-layer {exit_layer}")
    if kind == "eagle":
        return Eagle(max_draft=max_draft, candidates=candidates or 0), heads.drafting(model, hp)
    return (EarlyExit(max_draft=max_draft, exit_layer=meta["exit_layer"], head=heads.Head(),
                      candidates=candidates or 0), heads.drafting(model, hp))


def method(kind: str, summary: str, controller: str) -> Method:
    def build(model, o):
        return drafter(model, kind, o.head, o.max_draft, o.exit_layer, o.candidates)

    return Method(kind, build, summary, controller=controller, max_draft=MAX_DRAFT, options=(EXIT_LAYER, HEAD),
                  lookup=True, candidates=True)
