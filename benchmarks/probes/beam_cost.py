"""What MJSD's beam drafter costs: `beam_search` alone (the default model's MJSD drafter, the
shipped EESD head, K = 4, greedy) for one and four beams over a cache of a given size, timed as
the median of interleaved jitted calls, next to a decode step's time over the same cache.

    python benchmarks/probes/beam_cost.py
    git show REV:jspec/drafters/beam.py > /tmp/beam_before.py
    python benchmarks/probes/beam_cost.py --against /tmp/beam_before.py   # another version side by side

With --against, the other version's `beam_search` runs beside this one in the same process (it
must draft the same tokens, which is checked). docs/journal/2026-11-23_mjsd.md, "MJSD": "Cheaper beams".
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import methods
from jspec.drafters import beam
from jspec.engine.sampling import Sampling
from jspec.model import decoder as M
from jspec.parts import heads


def best_beam(out):
    """The best beam's tokens [B, K]: beam_search returned only that beam until 2026-11-28, and since
    then every beam's tokens [B, W, K] and scores [B, W]."""
    tokens = out[0]
    if tokens.ndim == 2:
        return tokens
    return jnp.take_along_axis(tokens, jnp.argmax(out[2], axis=1)[:, None, None], axis=1)[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="another version of jspec/drafters/beam.py to time beside this one")
    ap.add_argument("--sizes", default="512:300,2048:1500", help="cache positions:prefix length, comma-separated")
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()

    versions = {"now": beam}
    if args.against:
        spec = importlib.util.spec_from_file_location("beam_against", args.against)
        versions["against"] = sys.modules["beam_against"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(versions["against"])
    m = jspec.load()
    cfg = m.cfg
    drafter, dparams, _ = methods.build("mjsd", m)
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    entry = lambda s: jax.random.normal(next(keys), (1, s, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    readout = lambda h: heads.vocab_logits(cfg, dparams, M.rms_norm(h, dparams["norm"], cfg.rms_norm_eps))
    last = jnp.asarray([5], jnp.int32)
    for size in args.sizes.split(","):
        s, used = map(int, size.split(":"))
        trunk = [(m.params["layers"][i], entry(s), entry(s)) for i in drafter.inner.shallow]
        head = [(lp, entry(s), entry(s)) for lp in dparams["layers"]]
        length = jnp.asarray([used], jnp.int32)
        calls = {}
        for name, mod in versions.items():
            for width in (1, 4):
                calls[f"{name}, W = {width}"] = jax.jit(
                    lambda trunk, head, mod=mod, width=width: best_beam(mod.beam_search(
                        mod.Stack(cfg, m.params, trunk, head, readout), last, length, width, drafter.max_draft,
                        Sampling(), jax.random.key(0))))
        cache = M.KVCache([entry(s) for _ in range(cfg.num_layers)], [entry(s) for _ in range(cfg.num_layers)])
        step = jax.jit(lambda cache: M.logits(m.params, cfg, M.forward(m.params, cfg, last[:, None],
                                                                       length[:, None], cache)[0]))
        drafts = {label: np.asarray(f(trunk, head)) for label, f in calls.items()}
        for width in (1, 4):
            assert all(np.array_equal(drafts[f"now, W = {width}"], drafts[f"{n}, W = {width}"]) for n in versions)
        times = {label: [] for label in [*calls, "decode step"]}
        step(cache)
        for _ in range(args.calls):
            for label, f in calls.items():
                t = time.perf_counter()
                jax.block_until_ready(f(trunk, head))
                times[label].append(time.perf_counter() - t)
            t = time.perf_counter()
            jax.block_until_ready(step(cache))
            times["decode step"].append(time.perf_counter() - t)
        for label, ts in times.items():
            print(f"cache {s}, prefix {used}: {label}: {np.median(ts) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
