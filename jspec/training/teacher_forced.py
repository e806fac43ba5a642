"""Teacher-forced distillation data: the target's distributions over text that already exists.

`make(model, sequences, out, ...)` runs the target once over each sequence (no generation: one
forward, an order of magnitude faster per token than answering) and keeps its top-k next-token
log-probabilities at every target position, in the shard format of jspec.training.distill, so
`train-head` reads both kinds alike. Sequences come from

- `from_prompts`: the prompt text through the chat template, every token of it after the
  template's shared head (the system turn, identical in every prompt: a head would learn it
  for nothing and it would inflate agreement), and
- `from_answers`: the rows of a generating `distill-data` folder, prompt + the model's answer,
  with the answer as targets (the equality the tests check against the generating path).

Within a shard the sequences are grouped by padded width (distill.padded_widths, as training
batches its rows) and batched by a token budget, so short texts cost what they are.

OUT/meta.json          what was asked for and a digest of the sequences (a rerun must match)
OUT/shard-00000.npz    tokens [N, L], prompt_lens [N] (first target position), answer_lens [N]
                       (targets), prompt_key [N] uint64, top_ids [N, L-1, k], top_logp [N, L-1, k]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError
from jspec.training import distill

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Sequence:
    token_ids: tuple[int, ...]
    start: int  # the first position whose token is a target (>= 1)
    prompt_key: int  # which prompt it came from, for splitting by prompt (distill.prompt_key)


def from_prompts(lm, prompts: list[dict]) -> list[Sequence]:
    """One sequence per prompt: its chat-templated text, targets after the template's shared head."""
    head = _template_head(lm) if any("token_ids" not in p for p in prompts) else 0
    out = []
    for req, p in zip(lm.requests(prompts), prompts):
        start = 1 if "token_ids" in p else max(1, min(head, len(req.token_ids) - 1))
        out.append(Sequence(tuple(req.token_ids), start, distill.prompt_key(req.token_ids)))
    return out


def from_answers(folder: str | os.PathLike) -> list[Sequence]:
    """The prompt + answer rows of a generating distill-data folder, the answers as targets."""
    meta, d = distill.load(folder)
    if meta.get("source") == "text":
        raise JspecError(f"{folder} holds teacher-forced data already; give a folder of the model's answers")
    return [Sequence(tuple(row[:p + a].tolist()), int(p), int(key))
            for row, p, a, key in zip(d["tokens"], d["prompt_lens"], d["answer_lens"], d["prompt_key"])]


def _template_head(lm) -> int:
    """Tokens the chat template puts before every user message (the common head of two probes)."""
    a, b = (lm.encode(text) for text in ("Hello.", "Why?"))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def make(lm, sequences: list[Sequence], out: str | os.PathLike, *, max_tokens: int = 256, top_k: int = 32,
         shard_size: int = 256, batch_tokens: int = 4096, progress: bool = True) -> Path:
    """Write teacher-forced shards for `sequences`, each cut to `max_tokens`; resumes by shard."""
    from tqdm import tqdm

    if max_tokens < 2 or top_k < 1 or shard_size < 1 or batch_tokens < max_tokens:
        raise JspecError("--max-tokens must be >= 2, --top-k and --shard-size >= 1, "
                         "--batch-tokens >= --max-tokens")
    seqs = [s for s in sequences if min(len(s.token_ids), max_tokens) > s.start]
    if not seqs:
        raise JspecError("no sequence has a target token within --max-tokens")
    digest = hashlib.blake2b(repr([(s.token_ids, s.start) for s in seqs]).encode(), digest_size=8).hexdigest()
    out = Path(out)
    distill.check_or_write_meta(out, {"format": distill.FORMAT, "source": "text", "text_format": FORMAT,
                                      "model": lm.name, "sequences": len(seqs), "digest": digest,
                                      "max_tokens": max_tokens, "top_k": top_k, "shard_size": shard_size})
    shards = [seqs[i:i + shard_size] for i in range(0, len(seqs), shard_size)]
    todo = [i for i in range(len(shards)) if not distill.shard_path(out, i).exists()]
    teacher = jax.jit(functools.partial(_teacher_all, cfg=lm.cfg, k=top_k))
    targets = lambda ss: sum(min(len(s.token_ids), max_tokens) - s.start for s in ss)
    done = targets(seqs) - sum(targets(shards[i]) for i in todo)
    with tqdm(total=targets(seqs), initial=done, unit="tok", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        for i in todo:
            _write_shard(lm, shards[i], out, i, teacher, max_tokens, top_k, batch_tokens, bar)
    return out


def _write_shard(lm, seqs, out, index, teacher, max_tokens, top_k, batch_tokens, bar):
    # Shards keep the given (seeded) order, so that a partial run is a sample of every kind of text.
    n = len(seqs)
    lens = np.array([min(len(s.token_ids), max_tokens) for s in seqs], np.int32)
    tokens = np.zeros((n, max_tokens), np.int32)
    for row, s in enumerate(seqs):
        tokens[row, :lens[row]] = s.token_ids[:lens[row]]
    starts = np.array([s.start for s in seqs], np.int32)
    top_ids = np.zeros((n, max_tokens - 1, top_k), np.int32)
    top_logp = np.zeros((n, max_tokens - 1, top_k), np.float32)
    bucket = distill.padded_widths(lens, max_tokens)  # [n]
    for length in np.unique(bucket):
        rows = max(1, batch_tokens // length)
        members = np.flatnonzero(bucket == length)
        for chunk in (members[i:i + rows] for i in range(0, len(members), rows)):
            batch = distill.pad_rows(tokens[chunk, :length], rows)
            ids, logp = jax.device_get(teacher(lm.params, jnp.asarray(batch)))  # [rows, length - 1, k]
            for r, row in enumerate(chunk):  # targets start..len-1, from the states at start-1..len-2
                a = lens[row] - starts[row]
                top_ids[row, :a] = ids[r, starts[row] - 1:lens[row] - 1]
                top_logp[row, :a] = logp[r, starts[row] - 1:lens[row] - 1]
            bar.update(int((lens[chunk] - starts[chunk]).sum()))
    distill.write_npz(distill.shard_path(out, index), tokens=tokens, prompt_lens=starts, answer_lens=lens - starts,
                      prompt_key=np.array([s.prompt_key for s in seqs], np.uint64), top_ids=top_ids,
                      top_logp=top_logp)


def _teacher_all(params, tokens, *, cfg, k: int):
    """Top-k log-probs of the next token after every position but the last [B, T-1, k]."""
    b, length = tokens.shape
    prompt_lens = jnp.ones((b,), jnp.int32)
    return distill.teacher_top_k(params, tokens, prompt_lens, cfg=cfg, answer=length - 1, k=k)
