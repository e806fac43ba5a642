"""The prompt sets jspec ships, and reading a prompts file, gzip-compressed or not.

The sets are gzip-compressed JSONL under jspec/data/ (sources and licences in its README.md),
package data read through importlib.resources, so the commands that default to one (`jspec bench`:
Spec-Bench; `jspec distill-data`: the training prompts) work from any directory once jspec is
installed. `--prompts` takes a set's name or a file.
"""

from __future__ import annotations

import gzip
import importlib.resources
import os
import zlib
from pathlib import Path

from jspec.errors import JspecError

SPEC_BENCH = "spec_bench"  # Spec-Bench's questions: evaluation only
TRAIN_PROMPTS = "train_prompts"
DOMAINS = ("translation", "summarization", "qa", "text_to_sql", "story_writing", "rag")
SETS = (SPEC_BENCH, TRAIN_PROMPTS) + tuple(f"domains/{d}" for d in DOMAINS)


def resolve(value: str | os.PathLike):
    """What a `--prompts` value names: a shipped set's file (an importlib.resources Traversable) for
    a set's name, else the path."""
    if value in SETS:
        return importlib.resources.files("jspec").joinpath("data", f"{value}.jsonl.gz")
    return Path(value)


def read_text(source, kind: str = "prompts") -> str:
    """The text of a `kind` file ("prompts", "records"): a path or a shipped set's file, gunzipped
    when its name ends in .gz."""
    if isinstance(source, (str, os.PathLike)):
        source = Path(source)
    if not source.is_file():
        raise JspecError(f"{kind} file {source} " + ("is a directory" if source.is_dir() else "does not exist"))
    data = source.read_bytes()
    if source.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise JspecError(f"{kind} file {source} is not a readable gzip file ({e})") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as e:
        raise JspecError(f"{kind} file {source} is not UTF-8 text ({str(e).splitlines()[0]})") from None
