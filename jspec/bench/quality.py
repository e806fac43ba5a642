"""What a lossy method's output costs in quality: its likelihood under the full model.

A lossy method (SpecEE, MJSD) writes tokens the target would not have written greedily. The
measure jspec reports beside its speed is the mean negative log-likelihood of the generated
tokens under the full target, teacher-forced over prompt + output in one forward, next to the
same number for `ar`'s output on the same prompts (docs/methods.md, "MJSD (lossy)" and "SpecEE (lossy)").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.batching import prompt_bucket
from jspec.errors import JspecError
from jspec.model import decoder as M


def token_nll(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray:
    """-log p(output_t | prompt, output_<t) under the full model, one float per output token."""
    if not output_ids:
        return np.zeros((0,), np.float32)
    tokens = list(prompt_ids) + list(output_ids)
    if max(tokens) >= model.cfg.vocab_size or min(tokens) < 0:
        raise JspecError(f"token ids must lie in 0..{model.cfg.vocab_size - 1} (the model's vocabulary)")
    padded = np.zeros((1, prompt_bucket(len(tokens))), np.int32)
    padded[0, :len(tokens)] = tokens
    nll = _nll(model.params, jnp.asarray(padded), cfg=model.cfg)
    # The logits at position t predict token t + 1: the outputs are predicted from len(prompt) - 1 on.
    start = len(prompt_ids) - 1
    return np.asarray(jax.device_get(nll))[0, start:start + len(output_ids)]


def mean_nll(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Mean NLL per generated token over (prompt ids, output ids) pairs: every token weighs the same."""
    per_token = [token_nll(model, p, o) for p, o in pairs]
    total = sum(len(x) for x in per_token)
    if total == 0:
        raise JspecError("no generated tokens to score")
    return float(sum(x.sum(dtype=np.float64) for x in per_token) / total)


@functools.partial(jax.jit, static_argnames="cfg")
def _nll(params, tokens, *, cfg):
    """[1, T] tokens -> [1, T] NLL of tokens[t + 1] given tokens[:t + 1] (the last one is junk).
    Right padding is never attended to by the real positions before it (causal mask)."""
    h, _ = M.forward(params, cfg, tokens, None, M.KVCache.zeros(cfg, 1, tokens.shape[1]))
    logp = jax.nn.log_softmax(M.logits(params, cfg, h), axis=-1)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    return -jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
