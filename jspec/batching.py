"""Requests, and how they become batches: prompt buckets, batches by length and their rows.

Prompts of similar length are batched together (`batch_size` rows per compiled call, a short
last batch padded to a power of two: `batches`, `batch_rows`), in a cache as long as their
bucket needs (`prompt_bucket`), so a program is compiled once per (batch rows, cache length,
max_new_tokens, sampling, method) and never per prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

MIN_PROMPT_BUCKET = 32
PROMPT_STEP = 128


@dataclasses.dataclass
class Request:
    """A prompt ready to run: its id, the text or messages it came from, and its token ids."""

    id: Any
    token_ids: list[int]
    index: int = 0  # position in the caller's full prompt list: seeds follow it across resumes


def prompt_bucket(n: int) -> int:
    """Padded prompt length: powers of two from 32, and past 128 also the midpoints 1.5 x 2^k
    (192, 384, 768, ...): 15 buckets up to 8192 where steps of 128 past 128 made 66, each a
    compile of its own. Prefill is compute bound on a CPU, so a bucket pads a prompt by at most half (a power of
    two alone would pad a 600-token prompt 70%, to 1024)."""
    if n <= MIN_PROMPT_BUCKET:
        return MIN_PROMPT_BUCKET
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power > PROMPT_STEP and n <= power * 3 // 4 else power


def prompt_rows(prompts: Sequence[Sequence[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """B prompts as a prefill takes them (jspec.engine.loop.Run.start): tokens [B, length], each
    prompt from position 0 of its row and zeros after it, and their lengths [B], as NumPy."""
    tokens = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    return tokens, np.asarray([len(p) for p in prompts], np.int32)


def shortest_first(requests: Sequence[Request]) -> list[Request]:
    """requests by prompt length, ties in the given order: the order batches are cut in and slots
    take prompts in. Prompts prefilled together run at the longest one's chunks, so neighbours of
    like length waste the least; and a resumed run's remaining prompts sort as they did in the
    uninterrupted run."""
    return sorted(requests, key=lambda r: len(r.token_ids))


def admit_groups(lengths: Sequence[int], chunk: int) -> list[list[int]]:
    """Indices of prompts that take free slots (their lengths in tokens) grouped for continuous
    batching's admits: prompts of as many `chunk`-position chunks together, in groups of a power
    of two (7 -> 4, 2, 1), so no admit prefills a row longer than its prompt or a padding row. An
    admit prefills its rows for as many chunks as its longest prompt needs, and on a CPU a chunk
    costs by its rows: five prompts of 65-769 tokens freed together, in one admit of 8 rows, took
    11.9 s, and the whole run takes 5.8-7.0 s admitting them by their chunks (docs/design.md,
    "Continuous batching")."""
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        classes.setdefault(-(-n // chunk), []).append(i)
    groups = []
    for members in classes.values():
        while members:
            size = 1 << (len(members).bit_length() - 1)
            groups.append(members[:size])
            members = members[size:]
    return groups


# Prompts a continuous batch prefills ahead together on a CPU (stage_rows): a chunk's products
# there are bound by arithmetic and cost less a position the more rows they hold.
STAGE_ROWS = 4


def stage_rows(platform: str, rows: int) -> int:
    """How many prompts a continuous batch of `rows` slots prefills ahead together, to hand them to
    slots as they free (jspec.engine.slots.admit_staged), or 0: each admit prefills its own prompts
    in place. On a CPU a prefill of one row takes 0.81 ms a position in chunks of 128 and 1.09 in
    chunks of 32, where 4 rows take 0.72 (docs/design.md, "Continuous batching"); the staged rows
    cost a cache of their own, STAGE_ROWS rows at most and half the batch's. An accelerator's
    chunk of one row already fills its matrix units (loop.ACCELERATOR_CHUNK)."""
    n = min(STAGE_ROWS, rows // 2)
    return n if platform == "cpu" and n >= 2 else 0


def stage_alike(lengths: Sequence[int], n: int, chunk: int) -> bool:
    """Whether the queue's next prompts (their lengths, shortest first) are n prompts to prefill
    ahead together (stage_rows): a stage's rows run as many chunks (of `chunk` positions) as its
    longest prompt needs, so its longest may need at most a quarter more than its shortest.
    Otherwise the next prompt is admitted in place, alone or with prompts of as many chunks
    (admit_groups), rather than prefilled as far as a prompt several times its length (one
    Spec-Bench question a category, 20 to 1,600 tokens, staged four at a time regardless ran
    1.7x as long). Spec-Bench's 480, shortest first, are alike but for 4 of the 472 admitted."""
    chunks = [-(-length // chunk) for length in lengths]
    return len(chunks) == n and chunks[-1] <= chunks[0] + chunks[0] // 4


def batches(requests: Sequence[Request], batch_size: int) -> list[list[Request]]:
    """Split requests into batches, shortest prompts first (ties in the given order); at batch
    size 1, in the given order.

    A batch is prefilled at its longest prompt's padded length and decodes until its last row
    stops, so a short prompt batched with a long one pays for the long one.
    """
    ordered = shortest_first(requests) if batch_size > 1 else list(requests)
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


def batch_rows(n: int, batch_size: int, shards: int = 1) -> int:
    """Rows of the program that runs a batch of n requests: batch_size, or for a last batch short
    of it the next power of two (a multiple of the data shards). Padding rows are not free: each
    reads its cache every step, which a batch of long prompts pays for as much as for the weights;
    powers of two keep the extra programs to log2(batch_size)."""
    rows = 1 << (n - 1).bit_length()
    return rows if rows < batch_size and rows % shards == 0 else batch_size
