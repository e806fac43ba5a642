"""JSONL prompts in, JSONL records out, and an output file that is never half-written.

Prompts: one JSON object a line, with `prompt` (a string), `messages` (a list of
{role, content}) or `token_ids` (already tokenized, used as they are), and optionally `id`
(default: the 0-based index among the prompt lines).
A file whose name ends in .gz is read gzip-compressed, and an output so named is written so.

Records go to `OUT.partial`, appended and fsynced batch by batch as the batches finish;
`finish()` puts them in the prompts' order and renames the file to `OUT` atomically. An
interrupted run leaves `OUT` untouched and the partial file in place, and
`RecordWriter(OUT, resume=True)` keeps what it holds, so the next run only does the rest (with
the settings the partial file was written with: they are kept beside it).
`read_records` reads an output back (for `jspec compare`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from jspec import prompt_sets
from jspec.errors import JspecError


def read_prompts(path) -> list[dict]:
    """The prompts of a JSONL file (a path, .gz too, or a shipped set's file from
    `prompt_sets.resolve`), as dicts with `id` and `prompt`, `messages` or `token_ids`, in file order."""
    prompts: list[dict] = []
    seen: dict[Any, int] = {}
    for lineno, where, obj in _objects(path, "prompts", 'with "prompt", "messages" or "token_ids"'):
        prompt = {"id": _check_id(obj.get("id", len(prompts)), where, lineno, seen)}
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise JspecError(f"{where}: \"prompt\" must be a string")
            if not obj["prompt"].strip():
                raise JspecError(f"{where}: \"prompt\" is empty")
            _check_unicode(obj["prompt"], where)
            prompt["prompt"] = obj["prompt"]
        elif "messages" in obj:
            prompt["messages"] = check_messages(obj["messages"], where)
        elif "token_ids" in obj:
            ids = obj["token_ids"]
            if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
                raise JspecError(f"{where}: \"token_ids\" must be a non-empty list of token ids (integers >= 0)")
            prompt["token_ids"] = ids
        else:
            raise JspecError(f"{where}: has none of \"prompt\", \"messages\" and \"token_ids\"")
        prompts.append(prompt)
    if not prompts:
        raise JspecError(f"prompts file {path} has no prompts")
    return prompts


def check_not_prompts(output: str | os.PathLike, prompts: str | os.PathLike) -> None:
    """Refuse an output file that is the prompts file: the results would replace the prompts."""
    if os.path.exists(output) and os.path.exists(prompts) and os.path.samefile(output, prompts):
        raise JspecError(f"--output {output} is the --prompts file: the results would replace the prompts")


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a `jspec generate` output file, in file order; each has an `id` and its
    generated `token_ids` (a list of token ids), checked here, and whatever else it holds."""
    records: list[dict] = []
    seen: dict[Any, int] = {}
    for lineno, where, obj in _objects(path, "records", 'with "id" and "token_ids"'):
        for field in ("id", "token_ids"):
            if field not in obj:
                raise JspecError(f"{where}: has no \"{field}\"")
        _check_id(obj["id"], where, lineno, seen)
        ids = obj["token_ids"]
        if not (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)):
            raise JspecError(f"{where}: \"token_ids\" must be a list of token ids (integers >= 0)")
        records.append(obj)
    if not records:
        raise JspecError(f"records file {path} has no records")
    return records


def _objects(path, kind: str, expected: str) -> Iterator[tuple[int, str, dict]]:
    """(line number, `PATH line N`, object) for each non-blank line of a JSONL file of `kind`
    ("prompts", "records"), gzip-compressed or not, or of a shipped prompt set (`prompt_sets.resolve`);
    `expected` says what an object holds, for a line that holds none."""
    text = prompt_sets.read_text(path, kind)
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: text may hold U+2028
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise JspecError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise JspecError(f"{where}: expected a JSON object {expected}, got {type(obj).__name__}")
        yield lineno, where, obj


def _check_id(value: Any, where: str, lineno: int, seen: dict[Any, int]) -> Any:
    """A string or integer id not seen before in the file (`seen` maps ids to their lines)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise JspecError(f"{where}: \"id\" must be a string or an integer, got {json.dumps(value)}")
    if value in seen:
        raise JspecError(f"{where}: duplicate id {json.dumps(value)} (first on line {seen[value]})")
    seen[value] = lineno
    return value


def check_messages(messages: Any, where: str) -> list[dict]:
    """A prompt's chat messages: a non-empty list of {role, content} with string values."""
    if not isinstance(messages, list) or not messages:
        raise JspecError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise JspecError(f"{where}: message {i} must be an object with string \"role\" and \"content\"")
        _check_unicode(m["content"], where)
    return messages


def _check_unicode(text: str, where: str) -> None:
    """JSON may escape a lone surrogate (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JspecError(f"{where}: not valid Unicode text ({e.reason} at character {e.start})") from None


class RecordWriter:
    """Append records to `OUT.partial`; `finish()` renames it to `OUT`.

    `done_ids` holds the ids already written (from a previous run, with `resume`), and
    `complete` is True when `OUT` already exists and `resume` asks only to finish what is left.
    `settings` (a JSON-able dict: model, method, options) go beside the partial file, in
    `OUT.partial.settings`, while it exists; a resume with other settings is refused, so that no
    output mixes records of two configurations.
    """

    def __init__(self, path: str | os.PathLike, resume: bool = False, settings: dict | None = None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._settings_path = self.path.with_name(self.partial.name + ".settings")
        self._settings = None if settings is None else json.loads(json.dumps(settings))
        self.done_ids: set = set()
        self.count = 0
        self._file = None
        if self.path.is_dir():
            raise JspecError(f"output {self.path} is a directory")
        self.complete = resume and self.path.exists() and not self.partial.exists()
        if self.complete:
            return
        self._check_writable()
        if resume and self.partial.exists():
            self._check_settings()
            self._recover()
        else:
            self.partial.unlink(missing_ok=True)
            self._settings_path.unlink(missing_ok=True)

    def _check_writable(self) -> None:
        """Fail now, not after the first batch has been computed, where the output cannot go."""
        above = next(p for p in self.path.absolute().parents if p.exists())
        if not above.is_dir():
            raise JspecError(f"cannot write {self.path}: {above} is a file, not a folder")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.path.parent).close()
        except OSError as e:
            raise JspecError(f"cannot write {self.path}: {e.strerror or e}") from None

    def _check_settings(self) -> None:
        if self._settings is None or not self._settings_path.exists():  # a partial file of an older jspec
            return
        before = json.loads(self._settings_path.read_text())
        other = {k: before.get(k) for k in sorted(before.keys() | self._settings.keys())
                 if before.get(k) != self._settings.get(k)}
        if other:
            said = ", ".join(f"{k}={v!r}" for k, v in other.items())
            raise JspecError(f"{self.partial} was written with other settings ({said}); resume with those, "
                             "or run without --resume to start over")

    def _recover(self) -> None:
        """Keep the complete records of the partial file; cut off a truncated last line."""
        data = self.partial.read_bytes()
        keep = 0
        lines = data.split(b"\n")
        for i, line in enumerate(lines[:-1]):  # the last piece has no newline: truncated (or empty)
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "id" not in record:
                    raise ValueError("not a record")
            except ValueError:
                if i == len(lines) - 2 and not lines[-1]:
                    break  # the last line is garbage (torn by a crash): redo it
                raise JspecError(f"{self.partial} line {i + 1} is corrupt; delete it or run without --resume") from None
            self.done_ids.add(record["id"])
            self.count += 1
            keep += len(line) + 1
        if keep < len(data):
            with open(self.partial, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())

    def write(self, records: Iterable[dict]) -> None:
        """Append one batch of records and make it durable before returning."""
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if not lines:
            return
        if self._file is None:
            if self._settings is not None and not self._settings_path.exists():
                self._settings_path.write_text(json.dumps(self._settings, sort_keys=True) + "\n")
            self._file = open(self.partial, "a", encoding="utf-8")
        self._file.write(lines)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.count += lines.count("\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self, order: Sequence | None = None) -> Path:
        """Publish the output: rename `OUT.partial` to `OUT` (atomic on one file system), its
        records first sorted into `order` (their ids) if given."""
        self.close()
        if self.complete:
            return self.path
        if not self.partial.exists():  # nothing was written (and nothing to resume): an empty output
            self.partial.touch()
        if order is not None:
            self._sort(order)
        if self.path.name.endswith(".gz"):  # the partial file stays plain: appends and resumes need it so
            self._compress()
        os.replace(self.partial, self.path)
        self._settings_path.unlink(missing_ok=True)
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return self.path
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
        return self.path

    def _sort(self, order: Sequence) -> None:
        lines = self.partial.read_bytes().split(b"\n")[:-1]  # every record ends with a newline
        rank = {json.dumps(i): n for n, i in enumerate(order)}
        ordered = sorted(lines, key=lambda line: rank.get(json.dumps(json.loads(line)["id"]), len(rank)))
        if ordered == lines:
            return
        sorting = self.partial.with_name(self.partial.name + ".sorting")
        with open(sorting, "wb") as f:
            f.write(b"".join(line + b"\n" for line in ordered))
            f.flush()
            os.fsync(f.fileno())
        os.replace(sorting, self.partial)  # a crash here leaves a complete partial file either way

    def _compress(self) -> None:
        packed = self.partial.with_name(self.partial.name + ".gz")
        with open(self.partial, "rb") as src, open(packed, "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
                shutil.copyfileobj(src, f)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(packed, self.partial)

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoWriter:
    """The RecordWriter of a process that computes rows but does not write them (every process
    of a multi-process run but process 0): it has written nothing and keeps nothing."""

    done_ids: frozenset = frozenset()
    complete = False
    count = 0

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def write(self, records: Iterable[dict]) -> None:
        pass

    def close(self) -> None:
        pass

    def finish(self, order: Sequence | None = None) -> Path:
        return self.path
