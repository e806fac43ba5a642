"""What goes around a method's own drafter: prompt lookup in front (--lookup), or its top C side by
side instead of a chain (--candidates). A recipe says it takes them (Method.lookup,
Method.candidates); jspec.methods.build applies them."""

from __future__ import annotations

from jspec.drafters.lookup import Lookup
from jspec.errors import JspecError
from jspec.methods.options import shortest_repeat
from jspec.parts import datastore

LOOKUP_MAX_DRAFT = 4  # tokens a lookup copies at most, by default (docs/methods.md, "Prompt lookup first")


def check(method, o) -> None:
    """What the lookup and candidates options need of each other (o: method.given's)."""
    if method.lookup and o.lookup is None:
        if o.lookup_draft is not None:
            raise JspecError("--lookup-draft goes with --lookup N")
        if o.datastore is not None:
            raise JspecError("--datastore goes with --method ngram or with --lookup")
    if method.candidates and o.candidates is not None and (o.max_draft is not None or o.controller is not None):
        raise JspecError("--candidates drafts one position, its top C side by side: "
                         "it takes no --max-draft or --controller")


def lookup_first(model, drafter, dparams, o):
    """`drafter` (its params `dparams`) behind prompt lookup (jspec.drafters.lookup), with the
    model's datastore behind the prompt's repeats."""
    k = max(LOOKUP_MAX_DRAFT, drafter.max_draft) if o.lookup_draft is None else o.lookup_draft
    if not drafter.max_draft <= k <= 64:
        raise JspecError(f"--lookup-draft must be between --max-draft ({drafter.max_draft}) and 64, got {k}")
    wrapped = Lookup(inner=drafter, max_draft=k, min_ngram=shortest_repeat(o.lookup))
    return wrapped, wrapped.params(dparams, datastore.load_for(model, o.datastore))
