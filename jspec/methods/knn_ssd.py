"""knn-ssd: layer skipping with a sublayer skip set per domain, picked per prompt by the nearest
anchor of its prefill (KNN-SSD); lossless."""

from jspec.drafters.knn_ssd import KnnSsd
from jspec.methods.options import Method, Option
from jspec.parts import knn

KNN = Option("knn", "str", "a folder from jspec fit-knn (default: the one shipped for the default model)", "PATH")
DOMAIN = Option("domain", "str", "run this domain's skip set on every prompt instead of choosing by anchor", "NAME")
# The reference drafts until a token below 0.8 confidence (kept) or 12 drafts.
MAX_DRAFT = 12
THRESHOLD = 0.8


def build(model, o):
    folder = knn.load_for(model, o.knn)
    return KnnSsd(max_draft=o.max_draft, domains=folder.names()), folder.dparams(model.cfg, o.domain, model.mesh)


METHOD = Method("knn-ssd", build, "a sublayer skip set per domain, picked per prompt by the nearest anchor of its "
                "prefill", controller="confidence", max_draft=(MAX_DRAFT, MAX_DRAFT), options=(KNN, DOMAIN),
                lookup=True, threshold=THRESHOLD)
