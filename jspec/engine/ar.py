"""Plain autoregressive decoding: prefill and every decode step inside one jitted while loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec import model
from jspec.config import ModelConfig
from jspec.sampling import Sampling, next_token


def prefill(params, cfg: ModelConfig, tokens, prompt_lens, cache):
    """Run right-padded prompts tokens [B, P]; return the hidden state of each row's last prompt
    token [B, D] (pre-norm) and the filled cache."""
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    h, cache = model.forward(params, cfg, tokens, positions, cache)
    last = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    return last, cache


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_new_tokens"), donate_argnames=("cache",))
def generate(params, cache: model.KVCache, tokens, prompt_lens, eos_ids, key, *, cfg: ModelConfig,
             sampling: Sampling, max_new_tokens: int):
    """tokens [B, P] right-padded prompts of lengths prompt_lens [B]; eos_ids [E].

    Returns (out [B, max_new_tokens] with -1 after a row's end, new_tokens [B], rounds [B], cache).
    The cache needs room for P + max_new_tokens positions.
    """
    b = tokens.shape[0]
    h, cache = prefill(params, cfg, tokens, prompt_lens, cache)
    key, sub = jax.random.split(key)
    first = next_token(model.logits(params, cfg, h), sampling, sub)
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids) | (max_new_tokens == 1)
    state = (cache, out, first, prompt_lens, jnp.ones((b,), jnp.int32), done, jnp.zeros((b,), jnp.int32), key)

    def cond(state):
        return ~jnp.all(state[5])

    def step(state):
        cache, out, last, lengths, n, done, rounds, key = state
        key, sub = jax.random.split(key)
        h, cache = model.forward(params, cfg, last[:, None], lengths[:, None], cache)
        tok = next_token(model.logits(params, cfg, h[:, 0]), sampling, sub)
        out = out.at[jnp.arange(b), n].set(jnp.where(done, out[jnp.arange(b), n], tok), mode="drop")
        live = ~done
        n = n + live
        rounds = rounds + live
        done = done | jnp.isin(tok, eos_ids) | (n >= max_new_tokens)
        return cache, out, tok, lengths + 1, n, done, rounds, key

    cache, out, _, _, n, _, rounds, _ = jax.lax.while_loop(cond, step, state)
    return out, n, rounds + 1, cache
