"""Verification widths: on a CPU a round verifies the narrowest of a few static widths that holds
its longest live draft (each width one branch of a lax.switch, decoder.Width); on an accelerator
it verifies all K + 1 positions, with no switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def verify_widths(max_draft: int, platform: str = "cpu", plain: bool = False) -> tuple[int, ...]:
    """The widths a verification can take on `platform` (a jax platform name: cpu, cuda, rocm,
    tpu). On a CPU: 1 + each power of two below K, and K + 1; a round verifies the narrowest that
    holds its longest live draft, so a round whose drafting stopped early does not pay for K + 1
    positions (each width is one more compiled branch per layer; two positions cost about one, so
    a round that proposed nothing still verifies two). Elsewhere K + 1 alone: a forward over K + 1
    positions reads the same weights as one over two, and each branch index would be a copy to
    the host on a GPU, two a layer (docs/journal/2026-12-02_export-programs.md). `plain` adds
    width 1 on every platform: priced rounds (jspec.engine.pricing) that draft nothing are plain
    decoding steps."""
    if not max_draft:
        return (1,)
    one = {1} if plain else set()
    if platform != "cpu":
        return tuple(sorted(one | {1 + max_draft}))
    return tuple(sorted(one | {1 + min(2 ** i, max_draft) for i in range(max_draft.bit_length())} | {1 + max_draft}))


def width_index(widths: tuple[int, ...], longest: jax.Array) -> jax.Array:
    """Index of the narrowest of widths that verifies `longest` drafted tokens (and the last one)."""
    return jnp.sum(jnp.asarray(widths)[:-1] < longest + 1).astype(jnp.int32)
