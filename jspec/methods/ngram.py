"""ngram: prompt lookup (copy what followed an earlier repeat), else the model's datastore, else
a free one-token guess; no model drafts (lossless)."""

from jspec.drafters.ngram import NGram
from jspec.methods.options import DATASTORE, LOOKUP, Method, shortest_repeat
from jspec.methods.wrappers import LOOKUP_MAX_DRAFT
from jspec.parts import datastore

# On a CPU K = 4, as prompt lookup in front of a drafter (docs/journal/2026-11-26_ngram-defaults.md).
MAX_DRAFT = (LOOKUP_MAX_DRAFT, 8)


def build(model, o):
    return NGram(max_draft=o.max_draft, min_ngram=shortest_repeat(o.lookup)), datastore.load_for(model, o.datastore) or ()


METHOD = Method("ngram", build, "prompt lookup, else a datastore of what the model writes after 2-3 tokens, else a "
                "free guess", max_draft=MAX_DRAFT, options=(LOOKUP, DATASTORE))
