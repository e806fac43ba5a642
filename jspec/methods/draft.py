"""draft: a separate, smaller draft model that shares the target's tokenizer (classic speculative
decoding); lossless."""

from jspec.drafters.draft_model import DraftModel
from jspec.errors import JspecError
from jspec.methods.options import Method, Option
from jspec.model import sharding

DRAFT_MODEL = Option("draft_model", "model", "a smaller model sharing the target's tokenizer", "PATH_OR_ID")


def drafter(model, draft_model, max_draft: int):
    """The draft model's drafter and params, placed on the target's mesh (jit refuses arguments on
    other devices: a draft model is loaded on its own)."""
    if draft_model is None:
        raise JspecError("--method draft needs --draft-model")
    if draft_model.cfg.vocab_size != model.cfg.vocab_size:
        raise JspecError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) differs from the "
                         f"target's ({model.cfg.vocab_size}); they must share a tokenizer")
    return DraftModel(draft_cfg=draft_model.cfg, max_draft=max_draft), sharding.place(draft_model.params, model.mesh)


def build(model, o):
    return drafter(model, o.draft_model, o.max_draft)


METHOD = Method("draft", build, "a separate draft model (--draft-model)", options=(DRAFT_MODEL,), lookup=True)
