"""Self-distillation data: the target's own answers to training prompts, and its distributions.

`make(model, prompts, out, ...)` picks prompts (a seeded shuffle, prompts longer than
`max_prompt_tokens` left out, the first `skip` of that order left to another folder), lets the
target answer them with jspec's own decoding (greedy, or sampled with `temperature`), and keeps
the top-k next-token log-probabilities behind every answer token, which the decoding loop returns
with the tokens (`logprobs`; a second forward over prompt + answer used to compute them again,
half of the run's time). Heads train against those, so a
head for any exit layer trains from the same data (the frozen first N layers are recomputed in
training; they cost less than storing hidden states for every candidate layer).

OUT/meta.json          what was asked for (a rerun must ask for the same to resume)
OUT/shard-00000.npz    tokens [N, P+A] (prompt then answer, zero padded), prompt_lens [N],
                       answer_lens [N], top_ids [N, A, k] int32, top_logp [N, A, k] float32

The teacher-forced kind (jspec.training.teacher_forced: one forward over existing text) writes
the same arrays, prompt_lens being the first target position, plus prompt_key; `load` gives both
kinds alike, with `prompt_key` (which prompt a row came from, for splitting by prompt).

Shards and meta.json are written whole (a temporary name, fsynced, then renamed, never through a
symbolic link); a rerun skips the shards that exist,
so an interrupted run resumes losing at most one shard, and a rerun with a larger count extends
the folder (the last shard of the smaller run answered again if it was short).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jspec import files
from jspec.convert import store
from jspec.engine.loop import top_logprobs
from jspec.engine.sampling import Sampling
from jspec.errors import JspecError
from jspec.model import decoder as M

log = logging.getLogger("jspec")

FORMAT = 1
MIN_WIDTH = 32  # the narrowest padded width of a forward (padded_widths)


def make(lm, prompts: list[dict], out: str | os.PathLike, *, count: int = 512, max_prompt_tokens: int = 256,
         max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 32, shard_size: int = 64,
         batch_size: int = 32, seed: int = 0, skip: int = 0, source: str | None = None,
         progress: bool = True) -> Path:
    """Write self-distillation shards for `count` of `prompts` (dicts as jspec.jsonl reads them),
    those after the first `skip` of the seeded order: one run split over folders or machines
    (`skip` 0 and `count` N, then `skip` N) makes what one run would. `source` names where the
    prompts came from (the --prompts values), recorded in meta.json."""
    from tqdm import tqdm

    if count < 1 or max_new_tokens < 1 or top_k < 1 or shard_size < 1 or batch_size < 1:
        raise JspecError("--count, --max-new-tokens, --top-k, --shard-size and --batch-size must all be >= 1")
    if skip < 0:
        raise JspecError(f"--skip must be >= 0, got {skip}")
    context = lm.cfg.max_position_embeddings
    if not 1 <= max_prompt_tokens <= context - max_new_tokens:
        raise JspecError(f"--max-prompt-tokens must be in 1..{context - max_new_tokens} (the model's context of "
                         f"{context} less --max-new-tokens {max_new_tokens}), got {max_prompt_tokens}")
    Sampling(temperature)  # refuses a bad temperature before meta.json records it
    out = Path(out)
    meta = {"format": FORMAT, "model": lm.name, "prompts": source, "count": count, "max_prompt_tokens": max_prompt_tokens,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
            "shard_size": shard_size, "seed": seed}
    if skip:  # only when used, so that folders made before it resume
        meta["skip"] = skip
    chosen = choose(lm, prompts, count, max_prompt_tokens, seed, skip)
    if len(chosen) < count:  # the prompts ran out: meta.json records what the folder holds
        log.warning(f"only {len(chosen)} prompts fit in {max_prompt_tokens} tokens (after skipping {skip}): "
                    f"distilling {len(chosen)}, not --count {count}")
        meta["count"] = len(chosen)
    check_or_write_meta(out, meta, grows="count")
    shards = [chosen[i:i + shard_size] for i in range(0, len(chosen), shard_size)]
    # A shard is done when it holds all its prompts: a smaller count's last shard may be short.
    todo = [i for i in range(len(shards))
            if not shard_path(out, i).exists() or len(np.load(shard_path(out, i))["prompt_lens"]) != len(shards[i])]
    with tqdm(total=len(chosen), initial=len(chosen) - sum(len(shards[i]) for i in todo), unit="prompt",
              disable=not progress, dynamic_ncols=True) as bar:
        for i in todo:
            _write_shard(lm, shards[i], out, i, max_prompt_tokens, max_new_tokens, top_k, temperature, batch_size,
                         seed)
            bar.update(len(shards[i]))
    return out


def check_or_write_meta(out: Path, meta: dict, grows: str | None = None) -> None:
    """Write meta.json in a new folder; in an existing one, the settings must be those it was made
    with, except that `grows` may increase (a larger --count extends a folder of answers: the
    seeded order is the same whatever the count, so what it holds stays a prefix)."""
    path = out / "meta.json"
    if path.exists():
        old = read_meta(out)
        changed = [k for k in meta if old.get(k) != meta[k]] + [k for k in old if k not in meta]
        if changed == [grows] and meta[grows] > old[grows]:
            files.write_text(path, json.dumps(meta, indent=1) + "\n")
        elif changed:
            said = ", ".join(f"{k} {old.get(k)!r} -> {meta.get(k)!r}" for k in changed)
            raise JspecError(f"{out} holds data made with other settings ({said}); use another folder")
        return
    if out.exists() and any(out.iterdir()):
        raise JspecError(f"{out} exists, is not empty and holds no distillation data")
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(path, json.dumps(meta, indent=1) + "\n")


def choose(lm, prompts, count, max_prompt_tokens, seed, skip=0):
    """The first `count` requests after the first `skip`, in a seeded shuffle of `prompts`, whose
    prompt fits in `max_prompt_tokens` tokens: the same seed gives the same order whatever the
    count and skip."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chosen = []
    for i in order:
        [req] = lm.requests([prompts[i]], start=i)
        if len(req.token_ids) <= max_prompt_tokens:
            chosen.append(req)
            if len(chosen) == skip + count:
                break
    chosen = chosen[skip:]
    if not chosen:
        raise JspecError(f"no prompt is left after skipping {skip}: the prompts hold fewer that fit" if skip
                         else f"no prompt fits in {max_prompt_tokens} tokens")
    return chosen


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.npz"


def _write_shard(lm, requests, out, index, max_prompt, max_new, top_k, temperature, batch_size, seed):
    # Sorted as `batching.batches` sorts (stably, by length), so the records come back in this order at
    # any batch size. The teacher's top-k come from the decoding loop itself (`logprobs`): the
    # logits each token was chosen from, what a forward over prompt + answer would give again.
    requests = sorted(requests, key=lambda r: len(r.token_ids))
    records = list(lm.stream(requests, "ar", max_new_tokens=max_new, batch_size=batch_size,
                             temperature=temperature, seed=seed, logprobs=top_k))
    n, length = len(requests), max_prompt + max_new
    tokens = np.zeros((n, length), np.int32)
    top_ids = np.zeros((n, max_new, top_k), np.int32)
    top_logp = np.zeros((n, max_new, top_k), np.float32)
    prompt_lens = np.array([len(r.token_ids) for r in requests], np.int32)
    answer_lens = np.array([rec["new_tokens"] for rec in records], np.int32)
    for row, (r, rec) in enumerate(zip(requests, records)):
        seq = r.token_ids + rec["token_ids"]
        tokens[row, :len(seq)] = seq
        top_ids[row, :answer_lens[row]] = rec["top_ids"]
        top_logp[row, :answer_lens[row]] = rec["top_logprobs"]
    write_npz(shard_path(out, index), tokens=tokens, prompt_lens=prompt_lens, answer_lens=answer_lens,
              top_ids=top_ids, top_logp=top_logp)


def write_npz(path: Path, **arrays) -> None:
    """A whole shard or nothing (jspec.files.replacing)."""
    with files.replacing(path) as f:
        np.savez(f, **arrays)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """x [n, ...] with n <= rows, filled up to `rows` by repeating its first row."""
    return np.concatenate([x, np.repeat(x[:1], rows - len(x), axis=0)]) if len(x) < rows else x


def padded_widths(lens: np.ndarray, max_len: int) -> np.ndarray:
    """The width each sequence of length `lens` [N] pads to for a forward: the power of two (from
    MIN_WIDTH) at or above it, at most `max_len`. A handful of widths, one compilation each, and
    no sequence more than half padding (beyond MIN_WIDTH)."""
    return np.minimum(2 ** np.ceil(np.log2(np.maximum(lens, MIN_WIDTH))).astype(np.int64), max_len)


def teacher_top_k(params, tokens, prompt_lens, *, cfg, answer: int, k: int):
    """Top-k log-probs of the target's next-token distribution at each answer position [B, A, k]."""
    b, length = tokens.shape
    h, _ = M.forward(params, cfg, tokens, None, M.KVCache.zeros(cfg, b, length))
    at = jnp.minimum(prompt_lens[:, None] - 1 + jnp.arange(answer)[None], length - 1)  # [B, A]
    h = jnp.take_along_axis(h, at[:, :, None], axis=1)
    return top_logprobs(M.logits(params, cfg, h), k)


def read_meta(path: str | os.PathLike) -> dict:
    """The meta.json of a distillation folder."""
    path = Path(path)
    if not path.is_dir():
        raise JspecError(f"data folder {path} " + ("is a file" if path.exists() else "does not exist"))
    if not (path / "meta.json").is_file():
        raise JspecError(f"{path} holds no distillation data (no meta.json); run jspec distill-data first")
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise JspecError(f"{path / 'meta.json'} is not valid: make the folder again with jspec distill-data")
    return meta


def check_distinct(folders) -> None:
    """Refuse a data folder given twice: its rows would count twice (or train on what evaluates)."""
    seen = set()
    for folder in folders:
        key = Path(folder).resolve()
        if key in seen:
            raise JspecError(f"data folder {folder} is given twice")
        seen.add(key)


def load(path: str | os.PathLike) -> tuple[dict, dict]:
    """(meta, arrays concatenated over all shards, with prompt_key [N]) of a distillation folder."""
    path = Path(path)
    meta = read_meta(path)
    shards = sorted(path.glob("shard-*[0-9].npz"))
    if not shards:
        raise JspecError(f"{path} has no shards yet; run jspec distill-data first")
    parts = []
    for f in shards:
        with store.reading(f), np.load(f, allow_pickle=False) as z:
            parts.append(dict(z))
        if parts[-1].keys() != parts[0].keys():
            raise JspecError(f"{f} is damaged: it holds {sorted(parts[-1])}, {shards[0].name} {sorted(parts[0])}")
    with store.reading(path):  # shards of other widths or dtypes than the others
        data = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    if "prompt_key" not in data:  # the generating path's rows start with their prompt
        data["prompt_key"] = np.array([prompt_key(row[:p]) for row, p in zip(data["tokens"], data["prompt_lens"])],
                                      np.uint64)
    return meta, data


def prompt_key(token_ids) -> int:
    """A stable 64-bit name of a prompt (its token ids), the same in every kind of data."""
    return int.from_bytes(hashlib.blake2b(np.asarray(token_ids, np.int32).tobytes(), digest_size=8).digest(), "little")
