"""`jspec fit-knn`: anchors for knn-ssd, gathered with the searched skip sets into one folder.

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

import argparse
import functools
import json
import random
import sys
from pathlib import Path

import jax
import numpy as np

from jspec import heads, knn
from jspec.convert import store
from jspec.errors import JspecError
from jspec.skip_search import domain_prompts

BATCH = 8


@functools.partial(jax.jit, static_argnames="cfg")
def _features(params, tokens, prompt_lens, cfg):
    from jspec import model
    from jspec.drafters.knn_ssd import prompt_feature

    h, _ = model.forward(params, cfg, tokens, None, model.KVCache.zeros(cfg, *tokens.shape))
    return prompt_feature(params, cfg, h, prompt_lens)


def features(m, requests) -> np.ndarray:
    """[N, D] features of requests, batched by length (one program per batch size and bucket)."""
    import jax.numpy as jnp

    from jspec.api import batches, prompt_bucket

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


def cached_features(model, path: Path, s: knn.SkipSet, args) -> np.ndarray:
    key = json.dumps({"model": heads.fingerprint(model.cfg), "prompts": s.info["prompts"],
                      "category": s.info.get("category"), "seed": args.seed,
                      "max_prompt_tokens": args.max_prompt_tokens}, sort_keys=True)
    if path.is_file():  # the features of a larger count begin with those of a smaller one
        with np.load(path) as f:
            if str(f["key"]) == key and len(f["features"]) >= args.count:
                return f["features"][:args.count]
    rows = domain_prompts(s.info["prompts"], s.info.get("category"))
    random.Random(args.seed).shuffle(rows)
    requests = [r for r in model.requests(rows[:2 * args.count]) if len(r.token_ids) <= args.max_prompt_tokens]
    x = features(model, requests[:args.count])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, features=x, key=np.asarray(key))
    tmp.replace(path)
    return x


def centres(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    try:
        from sklearn.cluster import KMeans
    except ModuleNotFoundError:
        raise JspecError("jspec fit-knn needs scikit-learn: pip install 'jspec[knn]'") from None
    if len(x) < k:
        raise JspecError(f"{len(x)} prompts cannot make {k} centres")
    return KMeans(n_clusters=k, n_init=4, random_state=seed).fit(x).cluster_centers_.astype(np.float32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jspec.cli import add_model_options

    p.add_argument("--sets", required=True, metavar="DIR", help="the domains' sets from jspec search-skip (*.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="the knn-ssd folder to write")
    p.add_argument("--count", type=int, default=1000, help="prompts per domain at most (default: %(default)s)")
    p.add_argument("--centres", type=int, default=10, help="anchors per domain (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N",
                   help="leave out longer prompts (default: %(default)s)")
    p.add_argument("--no-anchors", default="", metavar="NAME,...", help="sets kept without anchors")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and k-means seed (default: %(default)s)")
    add_model_options(p)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from jspec.cli import load_model

    paths = sorted(Path(args.sets).glob("*.json"))
    if not paths:
        raise JspecError(f"{args.sets} holds no skip sets (*.json from jspec search-skip)")
    if args.count < 1 or args.centres < 1:
        raise JspecError(f"--count and --centres must be >= 1, got {args.count} and {args.centres}")
    sets = [knn.read_set(p) for p in paths]
    bare = {n for n in args.no_anchors.split(",") if n}
    if bare - {s.name for s in sets}:
        raise JspecError(f"--no-anchors names no set in {args.sets}: {', '.join(sorted(bare - {s.name for s in sets}))}")
    if bare == {s.name for s in sets}:
        raise JspecError("--no-anchors names every set: the nearest-neighbour lookup would have nothing to find")
    store.check_output(args.out, knn.META)
    model = load_model(args)
    for s in sets:
        s.mask(model.cfg.num_layers)  # refuses layers the model has not, before any feature is computed
    anchors, owner = [], []
    for d, s in enumerate(tqdm(sets, unit="domain", file=sys.stderr)):
        if s.name in bare:
            s.info["anchors"] = 0
            continue
        x = cached_features(model, Path(args.sets) / ".features" / f"{s.name}.npz", s, args)
        c = centres(x, args.centres, args.seed)
        anchors.append(c)
        owner += [d] * len(c)
        s.info["anchors"] = len(c)
        s.info["anchor_prompts"] = len(x)
    out = knn.save(args.out, knn.Knn(heads.fingerprint(model.cfg), sets, np.concatenate(anchors),
                                     np.asarray(owner, np.int32)))
    print(f"{out}: {len(owner)} anchors over {len(anchors)} domains, {len(sets)} skip sets", file=sys.stderr)
    return 0
