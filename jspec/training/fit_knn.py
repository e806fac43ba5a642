"""Anchors for knn-ssd, gathered with the searched skip sets into one folder (`jspec fit-knn`).

    jspec fit-knn --sets sets/ --out knn-folder/ --count 1000 --centres 10

Each `sets/<domain>.json` (from jspec search-skip) names its prompts; for up to --count of them
the feature is computed as the drafter computes it at prefill (the mean over the prompt's tokens
of the final-normed last hidden state), and scikit-learn's KMeans (optional extra `knn`) keeps
--centres centres per domain: the anchors. Sets named by --no-anchors (a set searched on all
domains pooled, say) join the folder without anchors, to be run with `knn-ssd:domain=NAME`.
Features are cached in DIR/.features/ (per domain, keyed by everything they depend on), so
fitting again after a new search runs no forward.
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path

import jax
import numpy as np

from jspec import files
from jspec.errors import JspecError
from jspec.parts import folder, knn
from jspec.training.search_skip import domain_prompts

BATCH = 8


@functools.partial(jax.jit, static_argnames="cfg")
def _features(params, tokens, prompt_lens, cfg):
    from jspec.drafters.knn_ssd import prompt_feature
    from jspec.model import decoder

    h, _ = decoder.forward(params, cfg, tokens, None, decoder.KVCache.zeros(cfg, *tokens.shape))
    return prompt_feature(params, cfg, h, prompt_lens)


def features(m, requests) -> np.ndarray:
    """[N, D] features of requests, batched by length (one program per batch size and bucket)."""
    import jax.numpy as jnp

    from jspec.batching import batches, prompt_bucket

    out = {}
    for batch in batches(requests, BATCH):
        p = prompt_bucket(max(len(r.token_ids) for r in batch))
        tokens = np.zeros((BATCH, p), np.int32)
        lens = np.ones((BATCH,), np.int32)
        for i, r in enumerate(batch):
            tokens[i, :len(r.token_ids)] = r.token_ids
            lens[i] = len(r.token_ids)
        f = np.asarray(_features(m.params, jnp.asarray(tokens), jnp.asarray(lens), cfg=m.cfg))
        out.update({r.index: f[i] for i, r in enumerate(batch)})
    return np.stack([out[r.index] for r in requests])


def cached_features(model, path: Path, s: knn.SkipSet, count: int, max_prompt_tokens: int, seed: int) -> np.ndarray:
    """The features of up to `count` of the set's prompts (a seeded choice), cached at `path`."""
    key = json.dumps({"model": folder.fingerprint(model.cfg), "prompts": s.info["prompts"],
                      "category": s.info.get("category"), "seed": seed,
                      "max_prompt_tokens": max_prompt_tokens}, sort_keys=True)
    if path.is_file():  # the features of a larger count begin with those of a smaller one
        with np.load(path) as f:
            if str(f["key"]) == key and len(f["features"]) >= count:
                return f["features"][:count]
    rows = domain_prompts(s.info["prompts"], s.info.get("category"))
    random.Random(seed).shuffle(rows)
    requests = [r for r in model.requests(rows[:2 * count]) if len(r.token_ids) <= max_prompt_tokens]
    x = features(model, requests[:count])
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.replacing(path) as f:
        np.savez(f, features=x, key=np.asarray(key))
    return x


def centres(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    try:
        from sklearn.cluster import KMeans
    except ModuleNotFoundError:
        raise JspecError("jspec fit-knn needs scikit-learn: pip install 'jspec[knn]'") from None
    if len(x) < k:
        raise JspecError(f"{len(x)} prompts cannot make {k} centres")
    return KMeans(n_clusters=k, n_init=4, random_state=seed).fit(x).cluster_centers_.astype(np.float32)


def fit(model, sets: list[knn.SkipSet], bare: set[str], features_dir: Path, out, *, count: int = 1000,
        centres_per_domain: int = 10, max_prompt_tokens: int = 1024, seed: int = 0) -> tuple[Path, int, int]:
    """Anchors for each set not in `bare` (features cached under `features_dir`), saved with every
    set to the knn-ssd folder `out`; returns (path, anchors, domains with anchors)."""
    from tqdm import tqdm

    for s in sets:
        s.mask(model.cfg.num_layers)  # refuses layers the model has not, before any feature is computed
        if s.name not in bare and not isinstance(s.info.get("prompts"), str):
            raise JspecError(f"skip set {s.name} names no prompts file (\"prompts\"), which its anchors are "
                             "computed from: make it with jspec search-skip, or name it in --no-anchors")
    anchors, owner = [], []
    for d, s in enumerate(tqdm(sets, unit="domain", file=sys.stderr)):
        if s.name in bare:
            s.info["anchors"] = 0
            continue
        x = cached_features(model, features_dir / f"{s.name}.npz", s, count, max_prompt_tokens, seed)
        c = centres(x, centres_per_domain, seed)
        anchors.append(c)
        owner += [d] * len(c)
        s.info["anchors"] = len(c)
        s.info["anchor_prompts"] = len(x)
    path = knn.save(out, knn.Knn(folder.fingerprint(model.cfg), sets, np.concatenate(anchors),
                                 np.asarray(owner, np.int32)))
    return path, len(owner), len(anchors)
