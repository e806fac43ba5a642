"""ar: plain autoregressive decoding, the reference every lossless method reproduces: the engine
loop with a drafter that proposes nothing."""

from jspec.drafters.none import NoDraft
from jspec.methods.options import Method


def build(model, o):
    return NoDraft(), ()


METHOD = Method("ar", build, "nothing: plain decoding", drafts=False, max_draft=(0, 0))
