"""A table of what the model itself writes after two or three tokens, for drafting by lookup.

Prompt lookup (jspec.drafters.ngram) copies what followed an earlier repeat in the prompt and the
text so far, and most rounds find none. The model's answers to training prompts repeat across
prompts too ("Here are some", "I hope this helps"), so a round without a repeat of its own can
ask this table instead: for each bigram and trigram of those answers, the token the model wrote
next most often, kept where it followed at least `min_count` times and in at least `min_share`
of them (REST, He et al. 2024, retrieves from a corpus; this corpus is the model's own greedy
output, so a lookup proposes what the target is likely to write again). A draft chains lookups,
the trigram's entry preferred. Verification keeps decoding lossless whatever the table says.

The table also keeps, for each single token, the token that most often followed it (at least
`min_count` times), whatever its share: not for chains, but for `guess`, the one token n-gram
drafting proposes in a round that has nothing better.

`jspec build-datastore --data ANSWERS... --out DIR` writes DIR/datastore.json (the model it
belongs to, the data, the settings) and DIR/table.npz:

    ngram_keys [E, 3] int32  the n-gram, right-aligned; a bigram's first slot is -1, a single
                             token's first two
    ngram_hash [E]    int32  key_hash of each key, ascending: a lookup is a binary search
    ngram_next [E]    int32  the token written next most often

Inside the jitted loop a lookup is one binary search per n-gram length and draft position (17
steps for 100,000 entries); a hash collision only loses an entry (the key is compared).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec.errors import JspecError
from jspec.model import sharding
from jspec.model.config import ModelConfig
from jspec.parts import folder, shipped

FOLDER = folder.PartFolder("datastore", "datastore.json", (1,), "jspec build-datastore")
# Replicated: every row's binary search may land anywhere in the table.
RULES = {"ngram_keys": (None, None), "ngram_hash": (None,), "ngram_next": (None,)}
ORDER = 3  # the longest n-gram looked up; bigrams fill in where no trigram is known
# Odd multipliers below 2**31: the hash is their dot product with the key, wrapping in int32
# exactly as numpy's int64 arithmetic reduced mod 2**32 does.
MULTIPLIERS = (0x2545F491, 0x6C8E9CF5, 0x1B873593)


def key_hash(keys):
    """keys [..., 3] int32 (numpy or jax) -> [...] int32, the same bits either way."""
    if isinstance(keys, np.ndarray):
        full = (keys.astype(np.int64) * np.array(MULTIPLIERS, np.int64)).sum(-1) & 0xFFFFFFFF
        return full.astype(np.uint32).view(np.int32)
    keys = keys.astype(jnp.int32)
    return sum(keys[..., i] * jnp.int32(m) for i, m in enumerate(MULTIPLIERS))


def build(sequences, min_count: int = 2, min_share: float = 0.5) -> dict[str, np.ndarray]:
    """The table of `sequences`, (token ids, first answer position) pairs: every answer token
    counts as a continuation of the token, the bigram and the trigram before it (prompt tokens
    included). A single token's entry (a guess) needs no share."""
    counts = collections.defaultdict(collections.Counter)
    for tokens, start in sequences:
        tokens = [int(t) for t in tokens]
        for i in range(max(start, 2), len(tokens)):
            counts[(-1, -1, tokens[i - 1])][tokens[i]] += 1
            counts[(-1, *tokens[i - 2:i])][tokens[i]] += 1
            if i >= ORDER:
                counts[tuple(tokens[i - ORDER:i])][tokens[i]] += 1
    keys, nexts = [], []
    for key, after in counts.items():
        token, n = after.most_common(1)[0]
        share = 0.0 if key[1] == -1 else min_share
        if n >= min_count and n >= share * sum(after.values()):
            keys.append(key)
            nexts.append(token)
    keys = np.array(keys, np.int32).reshape(-1, ORDER)
    order = np.argsort(key_hash(keys), kind="stable")
    keys = keys[order]
    return {"ngram_keys": keys, "ngram_hash": key_hash(keys), "ngram_next": np.array(nexts, np.int32)[order]}


def _find(table, keys: jax.Array):
    """(next token [B], found [B]) of keys [B, 3]."""
    hashes = key_hash(keys)
    i = jnp.clip(jnp.searchsorted(table["ngram_hash"], hashes), 0, table["ngram_hash"].shape[0] - 1)
    found = (table["ngram_hash"][i] == hashes) & jnp.all(table["ngram_keys"][i] == keys, axis=-1)
    return table["ngram_next"][i], found


def lookup(table, seq: jax.Array, end: jax.Array, max_draft: int):
    """seq [B, S] (the newest token of row b at end[b]) -> (tokens [B, max_draft], found [B]): the
    chain of the table's continuations after each row's last tokens, and how many of them lead
    without a gap (0: the table knows nothing after them)."""
    offsets = jnp.arange(1 - ORDER, 1)[None, :]
    at = end[:, None] + offsets
    context = jnp.where(at >= 0, jnp.take_along_axis(seq, jnp.maximum(at, 0), axis=1), -1)  # [B, 3]
    tokens, found, chained = [], jnp.zeros(end.shape, jnp.int32), jnp.ones(end.shape, bool)
    for _ in range(max_draft):
        by_trigram, tri = _find(table, context)
        by_bigram, bi = _find(table, context.at[:, 0].set(-1))
        token = jnp.where(tri, by_trigram, by_bigram)
        chained &= tri | bi
        found += chained
        tokens.append(token)
        context = jnp.concatenate([context[:, 1:], token[:, None]], axis=1)
    return jnp.stack(tokens, axis=1), found


def guess(table, seq: jax.Array, end: jax.Array):
    """(token [B], found [B]): the table's most frequent continuation of each row's newest token
    seq[b, end[b]], whatever its share."""
    last = jnp.take_along_axis(seq, end[:, None], axis=1)
    return _find(table, jnp.concatenate([jnp.full((seq.shape[0], 2), -1, jnp.int32), last], axis=1))


# -- saving and loading --------------------------------------------------------------------------

def save(path: str | os.PathLike, table: dict[str, np.ndarray], meta: dict) -> Path:
    with folder.writing(path, FOLDER, meta) as tmp:
        folder.save_npz(tmp / "table.npz", compressed=True, **table)
    return Path(path).absolute()


def load(path: str | os.PathLike, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The table of a datastore folder, refused unless it was built for a model like `cfg` and is
    a table a lookup can search: at least one entry, the three arrays of one length and of the
    shapes and dtypes above, token ids of this model, each hash its key's, in ascending order."""
    path = Path(path)
    meta = folder.read_meta(path, FOLDER)
    folder.check_model(folder.require(meta, "model", dict, path / FOLDER.marker), cfg, f"datastore {path} was built")
    where = path / "table.npz"
    table = folder.read_npz(where, ("ngram_keys", "ngram_hash", "ngram_next"))
    entries = table["ngram_next"].shape[0] if table["ngram_next"].ndim == 1 else 0
    folder.check_arrays(table, {"ngram_keys": jax.ShapeDtypeStruct((entries, ORDER), jnp.int32),
                                "ngram_hash": jax.ShapeDtypeStruct((entries,), jnp.int32),
                                "ngram_next": jax.ShapeDtypeStruct((entries,), jnp.int32)}, where)
    keys, hashes, nexts = table["ngram_keys"], table["ngram_hash"], table["ngram_next"]
    if not entries:
        raise JspecError(f"datastore {path} holds no entries (build it again from more answers)")
    if keys.min() < -1 or keys.max() >= cfg.vocab_size or nexts.min() < 0 or nexts.max() >= cfg.vocab_size:
        raise JspecError(f"datastore {path} holds token ids beyond this model's vocabulary ({cfg.vocab_size})")
    if not (np.array_equal(hashes, key_hash(keys)) and np.all(hashes[1:] >= hashes[:-1])):
        raise JspecError(f"{where} is damaged: its ngram_hash is not its keys' hashes in ascending order")
    return table


@folder.cached(FOLDER)
def _loaded(path: Path, cfg: ModelConfig, mesh: Mesh | None) -> dict:
    table = load(path, cfg)
    return jax.tree.map(jnp.asarray, table) if mesh is None else \
        jax.device_put(table, sharding.shardings(table, mesh, RULES))


def load_for(model, path: str | os.PathLike | None = None) -> dict | None:
    """The table prompt lookup falls back on: the one at `path`, none for 'off', else the one
    shipped for the default model (none for another model). Loaded once per folder version."""
    if path == "off":
        return None
    path = path or shipped.find(model, "datastore")
    return None if path is None else _loaded(path, model.cfg, model.mesh)
