"""A head's training data: distill-data folders padded together, split by prompt into training and
held-out rows, and the frozen target's states the head reads, computed once (jspec.training.train_head)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError
from jspec.model import decoder as M
from jspec.parts import heads
from jspec.training import distill


def draft_vocabulary(tokens, prompt_lens, answer_lens, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent answer tokens (all tokens if size is 0 or covers them), ascending."""
    if size == 0 or size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int32)
    counts = np.zeros(vocab_size, np.int64)
    for row, p, a in zip(tokens, prompt_lens, answer_lens):
        np.add.at(counts, row[p:p + a], 1)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def prepare(data: dict, vocab: np.ndarray, vocab_size: int) -> dict:
    """Training arrays with teacher ids mapped into the draft vocabulary (-1 outside it)."""
    index = np.full(vocab_size, -1, np.int32)
    index[vocab] = np.arange(len(vocab), dtype=np.int32)
    answer = data["top_ids"].shape[1]
    at = np.minimum(data["prompt_lens"][:, None] + np.arange(answer)[None], data["tokens"].shape[1] - 1)
    return {"prompt_lens": data["prompt_lens"], "answer_lens": data["answer_lens"],
            "top_sub": index[data["top_ids"]], "top_logp": data["top_logp"],
            "gen_sub": index[np.take_along_axis(data["tokens"], at, axis=1)]}


def load_data(folders) -> tuple[list[dict], dict]:
    """(each folder's meta, its arrays concatenated) with tokens and the per-position arrays padded
    to the longest folder's, and `folder` [N]: which folder each row came from."""
    metas, parts = zip(*(distill.load(f) for f in folders))
    length = max(p["tokens"].shape[1] for p in parts)
    answer = max(p["top_ids"].shape[1] for p in parts)
    k = {p["top_ids"].shape[2] for p in parts}
    if len(k) > 1:
        raise JspecError(f"the data folders keep different top-k ({sorted(k)}); make them with one --top-k")

    def pad(x, width):
        return np.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    data = {"tokens": np.concatenate([pad(p["tokens"], length) for p in parts]),
            "top_ids": np.concatenate([pad(p["top_ids"], answer) for p in parts]),
            "top_logp": np.concatenate([pad(p["top_logp"], answer) for p in parts]),
            **{k: np.concatenate([p[k] for p in parts]) for k in ("prompt_lens", "answer_lens", "prompt_key")},
            "folder": np.concatenate([np.full(len(p["tokens"]), i, np.int32) for i, p in enumerate(parts)])}
    return list(metas), data


def split(keys: np.ndarray, fraction: float, seed: int, held_keys: np.ndarray | None = None):
    """(training rows, held-out rows) of rows named by their prompt keys [N]: every row of a prompt
    on one side. Held out: the prompts of `held_keys` when given, else a seeded `fraction` of them,
    at least one where there are two or more (a small data set would often hold out none)."""
    if held_keys is None:
        salted = np.array([distill.prompt_key(np.array([seed, k >> 32, k & 0xFFFFFFFF], np.int64).view(np.int32))
                           for k in keys.tolist()], np.uint64)
        held = salted < np.uint64(fraction * 2.0 ** 64)
        if fraction > 0 and not held.any() and len(np.unique(keys)) > 1:
            held = salted == salted.min()
    else:
        held = np.isin(keys, held_keys)
    return np.flatnonzero(~held), np.flatnonzero(held)


def held_out(data: dict, data_folders: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) of `load_data`'s arrays whose first `data_folders` folders are
    training data and the rest held-out data (then the training rows of their prompts go to
    neither side), or, without held-out folders, split by `split`."""
    if data_folders == data["folder"].max() + 1:
        return split(data["prompt_key"], fraction, seed)
    is_eval = data["folder"] >= data_folders
    train_rows, held = split(data["prompt_key"], 0, 0, data["prompt_key"][is_eval])
    return train_rows, held[is_eval[held]]


def widths(data: dict) -> np.ndarray:
    """The padded width each row [N] trains at: the power of two (from 32) at or above where its
    text ends, at most the data's length. Batches of one width compile once; most rows are far
    shorter than the longest, which sets the length (answers to prompts of up to 512 tokens: 208
    on average of 640)."""
    return distill.padded_widths(data["prompt_lens"] + data["answer_lens"], data["tokens"].shape[1])


@dataclasses.dataclass(frozen=True)
class ExitStates:
    """The frozen layers' states of every row, each kept up to its own width only: [sum of widths, D]
    instead of [rows, longest, D] (12,000 answers padded to 640 positions would take 17.7 GB in
    float32, where their widths sum to 43% of that)."""
    flat: np.ndarray  # [sum(width), D]
    start: np.ndarray  # [N] where each row begins in flat
    width: np.ndarray  # [N]

    def rows(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width, D], zero after each row's own width."""
        out = np.zeros((len(rows), width, self.flat.shape[1]), self.flat.dtype)
        for i, r in enumerate(rows):
            w = min(int(self.width[r]), width)
            out[i, :w] = self.flat[self.start[r]:self.start[r] + w]
        return out


def head_inputs(params, cfg, kind: str, exit_layer: int, tokens: np.ndarray, width: np.ndarray,
                batch_size: int, progress: bool = False) -> dict:
    """What the head reads besides its own parameters: `hidden`, the states of `exit_states`, and
    for an EAGLE head the `tokens` it embeds."""
    hidden = exit_states(params, cfg, exit_layer, tokens, width, batch_size, previous_final=kind == "eagle",
                         progress=progress)
    return {"hidden": hidden, **({"tokens": tokens} if kind == "eagle" else {})}


def exit_states(params, cfg, exit_layer: int, tokens: np.ndarray, width: np.ndarray, batch_size: int,
                previous_final: bool = False, progress: bool = False) -> ExitStates:
    """The frozen target's layer-N hidden states of every sequence up to its `width`, computed
    once: the head trains for many epochs on them, and they are most of a step's work otherwise.
    With `previous_final` (an EAGLE head; N = L), each position holds the final-normed state of
    the position before it, zeros at the first. Rows run in order of width, each batch at its
    widest row's. `progress` shows a bar over the tokens: on the default model this pass runs at
    a few hundred tokens a second on a CPU, minutes before training's first step."""
    from tqdm import tqdm

    @jax.jit
    def run(tokens):
        cache = M.KVCache.zeros(cfg, *tokens.shape)
        h, _ = M.run_layers(params, cfg, M.embed(params, tokens), None, cache, range(exit_layer))
        if previous_final:
            h = jnp.pad(heads.final_state(params, cfg, h)[:, :-1], ((0, 0), (1, 0), (0, 0)))
        return h.astype(jnp.float32)

    width = np.asarray(width, np.int64)
    start = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    flat = np.zeros((int(width.sum()), cfg.hidden_size), np.float32)
    order = np.argsort(width, kind="stable")
    with tqdm(total=int(width.sum()), desc="frozen states", unit="tok", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        for first in range(0, len(order), batch_size):
            rows = order[first:first + batch_size]
            w = int(width[rows].max())
            h = np.asarray(run(jnp.asarray(distill.pad_rows(tokens[rows, :w], batch_size))))
            for i, r in enumerate(rows):
                flat[start[r]:start[r] + width[r]] = h[i, :width[r]]
            bar.update(int(width[rows].sum()))
    return ExitStates(flat, start, width)


def batch(arrays: dict, rows: np.ndarray, width: int) -> dict:
    """Rows `rows` of the training arrays at `width` positions, on the device."""
    def take(k, v):
        if k == "hidden":
            return v.rows(rows, width)
        return v[rows, :width] if k == "tokens" else v[rows]
    return {k: jnp.asarray(take(k, v)) for k, v in arrays.items()}
