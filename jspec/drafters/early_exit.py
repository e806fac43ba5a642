"""Early exit (EESD, Kangaroo): the target's first N layers, then a head, draft.

The shallow layers write the target's own cache while drafting, and the layer-N hidden state of
every fed token is kept, so verification runs only layers N..L-1 (Kangaroo's "double early
exit" reuse). The last drafted token gets one more shallow pass after the loop, because the
verifier needs its layer-N state too.

`head` turns a layer-N hidden state into draft logits. None means the target's own final norm
and LM head (untrained early exit); trained heads (jspec.parts.heads) plug in here with their
weights in `dparams`.

With `candidates` the step on the last token proposes its top C side by side, and all C go
through the shallow layers and the head's cache at once, each seeing only the committed text
(jspec.drafters.base).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import Drafter, Stack, draft_candidates, draft_loop, newest
from jspec.engine.state import Draft
from jspec.model import decoder, numerics


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EarlyExitState:
    hidden: jax.Array  # [B, K+1, D] the layer-N state of each token fed this round
    head: decoder.KVCache | None = None  # a trained head's own cache


@dataclasses.dataclass(frozen=True)
class EarlyExit(Drafter):
    max_draft: int = 8
    exit_layer: int = 8
    head: object = None
    candidates: int = 0

    @property
    def shallow(self) -> range:
        """The target's layers the draft runs."""
        return range(self.exit_layer)

    def _deep(self, cfg):
        return range(self.exit_layer, cfg.num_layers)

    def begin(self, params, dparams, cfg, rows, cache):
        hidden = jnp.zeros((rows, self.max_draft + 1, cfg.hidden_size), numerics.activation_dtype())
        return EarlyExitState(hidden, None if self.head is None else self.head.empty(dparams, cfg, rows, cache.length))

    def prefill(self, params, dparams, cfg, tokens, positions, lens, cache, dstate):
        h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, tokens, positions)
        h, cache = decoder.run_layers(params, cfg, h, positions, cache, self._deep(cfg))
        return h, cache, dstate

    def _draft_logits(self, params, dparams, cfg, h, positions, dstate):
        if self.head is None:
            return decoder.logits(params, cfg, h[:, 0]), dstate
        logits, head = self.head.logits(params, dparams, cfg, h, positions, dstate.head)
        return logits[:, 0], dataclasses.replace(dstate, head=head)

    def _enter(self, params, dparams, cfg, cache, dstate, tokens, positions, siblings: bool = False):
        """Tokens [B, T] through the shallow layers and into the head's cache, drafting nothing:
        (their layer-N states, cache, dstate)."""
        h, cache = decoder.run_layers(params, cfg, decoder.embed(params, tokens), positions, cache, self.shallow,
                                      siblings=siblings)
        if self.head is not None:
            dstate = dataclasses.replace(dstate, head=self.head.advance(dparams, cfg, h, positions, dstate.head,
                                                                        siblings))
        return h, cache, dstate

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        def step(carry, j, x, positions):
            cache, dstate = carry
            h, cache = decoder.run_layers(params, cfg, decoder.embed(params, x[:, None]), positions, cache,
                                          self.shallow)
            dstate = dataclasses.replace(dstate, hidden=dstate.hidden.at[:, j].set(h[:, 0]))
            logits, dstate = self._draft_logits(params, dparams, cfg, h, positions, dstate)
            return logits, (cache, dstate)

        if self.candidates:
            tokens, n, (cache, dstate) = draft_candidates(step, (s.cache, s.dstate), s, self.candidates)
            at = jnp.broadcast_to((s.length + 1)[:, None], tokens.shape)
            h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, tokens, at, siblings=True)
            hidden = dstate.hidden.at[:, 1:1 + self.candidates].set(h)
            return Draft(tokens, None, n, cache, dataclasses.replace(dstate, hidden=hidden), s.cstate)
        tokens, probs, n, (cache, dstate), cstate = draft_loop(
            step, (s.cache, s.dstate), s, controller, sampling, key, self.max_draft)
        # The last proposed token of each row, at slot n, still needs its layer-N state.
        rows = jnp.arange(tokens.shape[0])
        final = newest(tokens, n, s.last)
        h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, final[:, None], (s.length + n)[:, None])
        dstate = dataclasses.replace(dstate, hidden=dstate.hidden.at[rows, n].set(h[:, 0]))
        return Draft(tokens, probs, n, cache, dstate, cstate)

    def room(self, dstate, max_draft):
        pad = max_draft + 1 - dstate.hidden.shape[1]
        return dataclasses.replace(dstate, hidden=jnp.pad(dstate.hidden, ((0, 0), (0, pad), (0, 0))))

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, tokens, positions)
        return cache, dataclasses.replace(dstate, hidden=h)

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        return decoder.run_layers(params, cfg, dstate.hidden, positions, cache, self._deep(cfg), width,
                                  siblings=self.candidates > 0)

    def keep_candidate(self, params, dparams, cfg, cache, dstate, src, dst):
        cache, dstate = super().keep_candidate(params, dparams, cfg, cache, dstate, src, dst)
        if self.head is None:
            return cache, dstate
        k, v = decoder.move_entry(dstate.head.k, dstate.head.v, src, dst)
        return cache, dataclasses.replace(dstate, head=decoder.KVCache(k, v))

    def beam_stack(self, params, dparams, cfg, cache, dstate) -> Stack:
        """The shallow layers over the target's cache, then the trained head's layers over its own
        (its final norm and draft vocabulary), or the target's own LM head."""
        trunk = [(params["layers"][i], cache.k[i], cache.v[i]) for i in self.shallow]
        if self.head is None:
            return Stack(cfg, params, trunk, [], lambda h: decoder.logits(params, cfg, h))
        return Stack(cfg, params, trunk, list(zip(dparams["layers"], dstate.head.k, dstate.head.v)),
                     lambda h: self.head.readout(cfg, dparams, h))

    def beam_drafted(self, params, dparams, cfg, cache, dstate, written, exits, final, final_pos):
        shallow = list(self.shallow)
        ck, cv = list(cache.k), list(cache.v)
        for i, (wk, wv) in zip(shallow, written):
            ck[i], cv[i] = wk, wv
        # The last drafted token, at slot K, still needs its exit state (as `draft` gives it).
        h, cache = decoder.run_layers(params, cfg, decoder.embed(params, final[:, None]), final_pos,
                                      decoder.KVCache(ck, cv), shallow)
        dstate = dataclasses.replace(dstate, hidden=jnp.concatenate([exits, h], axis=1))
        if self.head is not None:
            hk, hv = zip(*written[len(shallow):])
            head = self.head.advance(dparams, cfg, h, final_pos, decoder.KVCache(list(hk), list(hv)))
            dstate = dataclasses.replace(dstate, head=head)
        return cache, dstate

    def tree_verified(self, params, dparams, cfg, cache, dstate, fed, positions, layer_input):
        if self.head is None:
            return dstate
        head = self.head.advance(dparams, cfg, layer_input(self.exit_layer), positions, dstate.head)
        return dataclasses.replace(dstate, head=head)
