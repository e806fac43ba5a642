"""Early exit (EESD, Kangaroo): the target's first N layers, then a head, draft.

The shallow layers write the target's own cache while drafting, and the layer-N hidden state of
every fed token is kept, so verification runs only layers N..L-1 (Kangaroo's "double early
exit" reuse). The last drafted token gets one more shallow pass after the loop, because the
verifier needs its layer-N state too.

`head` turns a layer-N hidden state into draft logits. None means the target's own final norm
and LM head (untrained early exit); trained heads (jspec.heads) plug in here with their
weights in `dparams`.

With `candidates` the step on the last token proposes its top C side by side, and all C go
through the shallow layers and the head's cache at once, each seeing only the committed text
(jspec.drafters.base).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec import model
from jspec.drafters.base import Draft, Drafter, draft_candidates, draft_loop


@dataclasses.dataclass(frozen=True)
class EarlyExit(Drafter):
    max_draft: int = 8
    exit_layer: int = 8
    head: object = None
    candidates: int = 0

    @property
    def shallow(self) -> range:
        """The target's layers the draft runs (MJSD's beams run them too)."""
        return range(self.exit_layer)

    def _deep(self, cfg):
        return range(self.exit_layer, cfg.num_layers)

    def prefill(self, params, dparams, cfg, tokens, packing, cache):
        h, cache = model.run_layers(params, cfg, model.embed(params, tokens), packing, cache, self.shallow)
        dstate = {"hidden": jnp.zeros((packing.lens.shape[0], self.max_draft + 1, cfg.hidden_size), h.dtype)}
        if self.head is not None:
            dstate["head"] = self.head.prefill(dparams, cfg, h, packing, cache.length)
        h, cache = model.run_layers(params, cfg, h, packing, cache, self._deep(cfg))
        return packing.last(h), cache, dstate

    def _draft_logits(self, params, dparams, cfg, h, positions, dstate):
        if self.head is None:
            return model.logits(params, cfg, h[:, 0]), dstate
        logits, head_state = self.head.logits(params, dparams, cfg, h, positions, dstate["head"])
        return logits[:, 0], {**dstate, "head": head_state}

    def _enter(self, params, dparams, cfg, cache, dstate, tokens, positions, siblings: bool = False):
        """Tokens [B, T] through the shallow layers and into the head's cache, drafting nothing:
        (their layer-N states, cache, dstate)."""
        h, cache = model.run_layers(params, cfg, model.embed(params, tokens), positions, cache, self.shallow,
                                    siblings=siblings)
        if self.head is not None:
            dstate = {**dstate, "head": self.head.advance(dparams, cfg, h, positions, dstate["head"], siblings)}
        return h, cache, dstate

    def draft(self, params, dparams, cfg, s, controller, sampling, key):
        def step(carry, j, x, positions):
            cache, dstate = carry
            h, cache = model.run_layers(params, cfg, model.embed(params, x[:, None]), positions, cache, self.shallow)
            dstate = {**dstate, "hidden": dstate["hidden"].at[:, j].set(h[:, 0])}
            logits, dstate = self._draft_logits(params, dparams, cfg, h, positions, dstate)
            return logits, (cache, dstate)

        if self.candidates:
            tokens, n, (cache, dstate) = draft_candidates(step, (s.cache, s.dstate), s, self.candidates)
            at = jnp.broadcast_to((s.length + 1)[:, None], tokens.shape)
            h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, tokens, at, siblings=True)
            hidden = dstate["hidden"].at[:, 1:1 + self.candidates].set(h)
            return Draft(tokens, None, n, cache, {**dstate, "hidden": hidden}, s.cstate)
        tokens, probs, n, (cache, dstate), cstate = draft_loop(
            step, (s.cache, s.dstate), s, controller, sampling, key, self.max_draft)
        # The last proposed token of each row, at slot n, still needs its layer-N state.
        rows = jnp.arange(tokens.shape[0])
        final = tokens[rows, jnp.maximum(n - 1, 0)]
        h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, final[:, None], (s.length + n)[:, None])
        dstate = {**dstate, "hidden": dstate["hidden"].at[rows, n].set(h[:, 0])}
        return Draft(tokens, probs, n, cache, dstate, cstate)

    def room(self, dstate, max_draft):
        hidden = dstate["hidden"]
        return {**dstate, "hidden": jnp.pad(hidden, ((0, 0), (0, max_draft + 1 - hidden.shape[1]), (0, 0)))}

    def feed(self, params, dparams, cfg, cache, dstate, tokens, positions):
        h, cache, dstate = self._enter(params, dparams, cfg, cache, dstate, tokens, positions)
        return cache, {**dstate, "hidden": h}

    def verify(self, params, dparams, cfg, tokens, positions, cache, dstate, width):
        return model.run_layers(params, cfg, dstate["hidden"], positions, cache, self._deep(cfg), width,
                                siblings=self.candidates > 0)

    def keep_candidate(self, params, dparams, cfg, cache, dstate, src, dst):
        cache, dstate = super().keep_candidate(params, dparams, cfg, cache, dstate, src, dst)
        if self.head is None:
            return cache, dstate
        k, v = model.move_entry(dstate["head"]["k"], dstate["head"]["v"], src, dst)
        return cache, {**dstate, "head": {"k": k, "v": v}}
