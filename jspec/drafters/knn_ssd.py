"""KNN-SSD: layer skipping with a skip set per domain, picked per prompt by nearest neighbour.

At prefill each row's feature (the mean over its prompt tokens of the final-normed last hidden
state, which the prefill computes anyway, summed chunk by chunk) is compared by cosine with the
anchors (k-means centres of each domain's prompts); the nearest anchor's domain gives the row
its sublayer skip set. The sets, the anchors and the anchor -> domain map travel in `dparams` as
data, so a prompt never recompiles anything. Drafting runs the target with those sublayers skipped
(`decoder.run_masked_layers`); verification is the full target, so decoding stays lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter, draft_loop
from jspec.engine.state import Draft
from jspec.model import decoder


def prompt_feature(params, cfg, h, prompt_lens):
    """h [B, P, D] (pre-norm, right-padded), prompt_lens [B] -> [B, D]: the mean over each row's
    prompt tokens of the final-normed hidden state."""
    inside = jnp.arange(h.shape[1])[None, :] < prompt_lens[:, None]
    return feature_sum(params, cfg, h, inside) / prompt_lens[:, None].astype(jnp.float32)


def feature_sum(params, cfg, h, inside):
    """The sum over the positions `inside` [B, T] of h [B, T, D]'s final-normed states, float32 [B, D]."""
    normed = decoder.rms_norm(h, params["final_norm"], cfg.rms_norm_eps).astype(jnp.float32)
    return jnp.sum(jnp.where(inside[..., None], normed, 0.0), axis=1)


def nearest_anchor(features, anchors):
    """Cosine 1-nearest neighbour: features [B, D], anchors [N, D] (unit rows) -> [B] int32."""
    unit = features / jnp.maximum(jnp.linalg.norm(features, axis=-1, keepdims=True), 1e-12)
    return jnp.argmax(unit @ anchors.T, axis=-1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KnnState:
    skip: jax.Array  # [B, 2, L] bool: each row's domain's skip set, attention then MLP
    domain: jax.Array  # [B] int32: the domain each row's prompt was matched to
    feature: jax.Array  # [B, D] float32: the sum of prompt_feature's states over the prompt so far


@dataclasses.dataclass(frozen=True)
class KnnSsd(Drafter):
    """dparams: anchors [N, D] unit rows, anchor_domain [N] int32, skip [M, 2, L] bool (per domain,
    attention then MLP). `domains` names the M domains for the records' stats."""

    max_draft: int = 12
    domains: tuple[str, ...] = ()

    def begin(self, params, dparams, cfg, rows, cache):
        domain = jnp.zeros((rows,), jnp.int32)
        return KnnState(dparams["skip"][domain], domain, jnp.zeros((rows, cfg.hidden_size), jnp.float32))

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        h, cache = decoder.forward(params, cfg, tokens, positions, cache)
        total = dstate.feature + feature_sum(params, cfg, h, positions < lens[:, None])
        # Matched again after every chunk: the last chunk of a row's prompt decides.
        anchor = nearest_anchor(total / lens[:, None].astype(jnp.float32), dparams["anchors"])
        domain = dparams["anchor_domain"][anchor]
        return h, cache, KnnState(dparams["skip"][domain], domain, total)

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        skip = s.dstate.skip

        def step(cache, j, x, positions):
            h, cache = decoder.run_masked_layers(params, cfg, decoder.embed(params, x[:, None]), positions, cache, skip)
            return decoder.logits(params, cfg, h[:, 0]), cache

        tokens, probs, n, cache, cstate = draft_loop(step, s.cache, s, controller, sampling, key, self.max_draft)
        return Draft(tokens, probs, n, cache, s.dstate, cstate)

    def stats(self, dstate):
        return {"domain": dstate.domain}

    def record_stats(self, stats):
        return {"domain": self.domains[stats["domain"]]}
