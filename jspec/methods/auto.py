"""auto: the fastest lossless method for the model, device and batch size, from what was measured
(docs/benchmarks.md, "Priced rounds"): n-gram lookup with its defaults, which needs nothing
trained (a model's datastore is used where one ships) and was the fastest lossless method at
batch size 1 on Spec-Bench and the held-out prompts; above batch size 1 priced rounds
(jspec.engine.pricing) shorten or stop its drafts where they do not pay. A record names the
method that decoded it."""

from jspec.methods import ngram
from jspec.methods.options import Method

CHOICE = ngram.METHOD

METHOD = Method("auto", ngram.build, f"the fastest lossless choice measured: {CHOICE.name} with its defaults, "
                "rounds priced above batch size 1", max_draft=CHOICE.max_draft, options=CHOICE.options,
                chooses=CHOICE.name)
