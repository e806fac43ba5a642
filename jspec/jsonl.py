"""JSONL prompts in, JSONL records out, and an output file that is never half-written.

Prompts: one JSON object a line, with `prompt` (a string), `messages` (a list of
{role, content}) or `token_ids` (already tokenized, used as they are), and optionally `id`
(default: the 0-based index among the prompt lines).
A file whose name ends in .gz is read gzip-compressed, and an output so named is written so.

Records go to `OUT.partial`, appended and fsynced batch by batch as the batches finish;
`finish()` puts them in the prompts' order and renames the file to `OUT` atomically. An
interrupted run leaves `OUT` untouched and the partial file in place, and
`RecordWriter(OUT, resume=True)` keeps what it holds, so the next run only does the rest (with
the settings the partial file was written with, kept beside it in `OUT.partial.settings`).
A run without `resume` keeps an earlier partial file until its own first batch is durable in
a new file renamed over it, so a run that fails first (a bad option) loses nothing. One run at a
time writes an output (it holds `OUT.lock` with flock, released however the process ends). `OUT`
is replaced only when it is an earlier output (empty, or every line an object with "id" and
"token_ids", as records and bench's rows are) or with `overwrite`. The partial, settings and lock
files are never followed through a symbolic link. A record's `prompt_sha256`, where it has one,
is kept in `prompt_digests` for resumes.
`read_records` reads an output back (for `jspec compare`).
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import logging
import os
import tempfile
import types
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from jspec import files, prompt_sets
from jspec.errors import JspecError

log = logging.getLogger("jspec")
HEAD = "partial_first_line_sha256"  # a settings file's key: the first line of the partial file it belongs to


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
    """Refuse an output one of whose files (`output_files`: OUT, its partial, settings and lock
    files) is the prompts file: the run would replace the prompts, or adopt them as records."""
    for path in output_files(output):
        if os.path.exists(path) and os.path.exists(prompts) and os.path.samefile(path, prompts):
            what = f"--output {output}" if path == Path(output) else f"{path} (a file of --output {output})"
            raise JspecError(f"{what} is the --prompts file: the results would replace the prompts")


def output_files(output: str | os.PathLike) -> tuple[Path, Path, Path, Path]:
    """The files a RecordWriter of `output` writes: OUT, OUT.partial, OUT.partial.settings, OUT.lock."""
    path = Path(output)
    return (path, path.with_name(path.name + ".partial"), path.with_name(path.name + ".partial.settings"),
            path.with_name(path.name + ".lock"))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


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


def _record(line: bytes) -> dict:
    record = json.loads(line)
    if not isinstance(record, dict) or "id" not in record:
        raise ValueError("not a record")
    return record


def prompt_digest(prompt: dict) -> str:
    """The first 16 hex digits of the sha256 of a prompt's text: the JSON of its "prompt",
    "messages" or "token_ids" (keys sorted, no spaces, UTF-8), what its record's `prompt_sha256` holds."""
    text = {k: prompt[k] for k in ("prompt", "messages", "token_ids") if k in prompt}
    return _digest(json.dumps(text, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


class RecordWriter:
    """Append records to `OUT.partial`; `finish()` renames it to `OUT`.

    `done_ids` holds the ids already written (by a previous run, with `resume`), `prompt_digests`
    their `prompt_sha256`s, and `complete` is True when `OUT` exists and `resume` asks only to
    finish what is left. `settings` (JSON-able: model, method, options) go beside the partial file;
    a resume with others is refused, so that no output mixes two configurations. `overwrite`: `OUT`
    may be any file. `extend` (with `resume`): a complete `OUT` is extended, not kept as it is.
    """

    def __init__(self, path: str | os.PathLike, resume: bool = False, settings: dict | None = None,
                 overwrite: bool = False, extend: bool = False):
        self.path, self.partial, self._settings_path, self.lock_path = output_files(path)
        self._settings = None if settings is None else json.loads(json.dumps(settings))
        self._overwrite = overwrite
        self.done_ids: set = set()
        self.prompt_digests: dict = {}
        self.count = 0
        self._file = self._head = None  # _head: the partial file's first line, which its settings name
        if self.path.is_dir():
            raise JspecError(f"output {self.path} is a directory")
        self._check_writable()
        for p in (self.partial, self._settings_path, self.lock_path):
            if p.is_symlink():
                raise JspecError(f"{p} is a symbolic link, which jspec does not write through; remove it")
        self._lock = _lock(self.lock_path, self.path)
        try:
            if resume and extend and self.path.is_file() and not self.partial.exists():
                files.write_text(self.partial, prompt_sets.read_text(self.path, "records"))
            self.complete = resume and self.path.exists() and not self.partial.exists()
            if not self.complete:
                self._check_replaceable()
                if resume and self.partial.exists():
                    self._recover()
                elif self.partial.exists():
                    log.warning(f"{self.partial} holds records of an interrupted run: this run replaces them when "
                                "it writes its first batch (stop it now and add --resume to keep them)")
        except BaseException:
            self.close()
            raise

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

    def _check_replaceable(self) -> None:
        """Unless `overwrite`, refuse an `OUT` that finishing would replace and that is not an
        earlier output: empty, or every line a JSON object with "id" and "token_ids"."""
        try:
            ours = self._overwrite or not self.path.exists() or all(
                "id" in obj and "token_ids" in obj for _, _, obj in _objects(self.path, "records", ""))
        except JspecError:
            ours = False
        if not ours:
            raise JspecError(f"{self.path} exists and is not an earlier output (records with \"id\" and "
                             "\"token_ids\"); give --overwrite to replace it, or another --output")

    def _check_settings(self) -> None:
        if self._settings is None or not self._settings_path.exists():  # a partial file of an older jspec
            return
        try:
            before = json.loads(self._settings_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            before = None
        if not isinstance(before, dict):
            raise JspecError(f"{self._settings_path} is damaged; run without --resume to start over")
        head = before.pop(HEAD, None)  # absent from an older jspec's
        if head is not None and self._head is not None and head != _digest(self._head):
            raise JspecError(f"{self._settings_path} is not the settings of {self.partial} (a run stopped while "
                             "replacing it); run without --resume to start over")
        other = {k: before.get(k) for k in sorted(before.keys() | self._settings.keys())
                 if before.get(k) != self._settings.get(k)}
        if other:
            said = ", ".join(f"{k}={v!r}" for k, v in other.items())
            raise JspecError(f"{self.partial} was written with other settings ({said}); resume with those, "
                             "or run without --resume to start over")

    def _recover(self) -> None:
        """Keep the complete records of the partial file, its settings checked; cut a torn last line."""
        with open(self.partial, "r+b", opener=_no_follow) as f:
            data = f.read()
            records, keep = files.complete_lines(data, _record, lambda n: JspecError(
                f"{self.partial} line {n} is corrupt; delete it or run without --resume"))
            for record in records:
                self.done_ids.add(record["id"])
                if "prompt_sha256" in record:
                    self.prompt_digests[record["id"]] = record["prompt_sha256"]
            self.count = len(records)
            self._head = data.split(b"\n", 1)[0] if self.count else None
            self._check_settings()
            if keep < len(data):
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())

    def write(self, records: Iterable[dict]) -> None:
        """Append one batch of records and make it durable before returning."""
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if not lines:
            return
        written = lines.count("\n")
        if self._file is None:
            lines = self._start(lines)
        self._file.write(lines)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.count += written

    def _start(self, lines: str) -> str:
        """Open the partial file a resume keeps, or a new one holding `lines` renamed over any earlier
        one once it and its settings are durable; returns what is left to append."""
        if self._head is None:
            self._head = lines.split("\n", 1)[0].encode("utf-8")
            with files.replacing(self.partial) as f:
                f.write(lines.encode("utf-8"))
                # The settings name the new first line, and are durable before it replaces the old
                # file: a crash in between is seen (_check_settings).
                self._write_settings()
            lines = ""
        elif not self._settings_path.exists():  # a partial file of an older jspec
            self._write_settings()
        self._file = open(self.partial, "a", encoding="utf-8", opener=_no_follow)
        return lines

    def _write_settings(self) -> None:
        if self._settings is None:
            self._settings_path.unlink(missing_ok=True)
        else:  # named by the partial file's first line, the one it belongs to
            files.write_text(self._settings_path,
                             json.dumps({**self._settings, HEAD: _digest(self._head)}, sort_keys=True) + "\n")

    def close(self) -> None:
        """Close the partial file and release the output: the writer is done."""
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # a full disk fails the flush again: the write said so already
                file.close()
        if self._lock is not None:
            with contextlib.suppress(FileNotFoundError):  # only while it is the file this writer holds
                if os.path.samestat(os.lstat(self.lock_path), os.fstat(self._lock.fileno())):
                    self.lock_path.unlink()
            self._lock.close()
            self._lock = None

    def finish(self, order: Sequence | None = None) -> Path:
        """Publish the output: rename `OUT.partial` to `OUT` (atomic on one file system), its records
        first sorted into `order` (their ids) if given, and release it (empty if nothing was written)."""
        try:
            if not self.complete:
                if self._file is None:
                    self._start("")  # a new empty partial file, or the one resumed
                self._file.close()
                if order is not None:
                    self._sort(order)
                self._check_replaceable()  # again: OUT may have appeared while the run ran
                if self.path.name.endswith(".gz"):  # the partial file stays plain: appends and resumes need it so
                    with files.replacing(self.path) as f:
                        f.write(gzip.compress(self.partial.read_bytes(), mtime=0))
                    self.partial.unlink()
                else:
                    os.replace(self.partial, self.path)
                self._settings_path.unlink(missing_ok=True)
                files.fsync_dir(self.path.parent)
        finally:
            self.close()
        return self.path

    def _sort(self, order: Sequence) -> None:
        lines = self.partial.read_bytes().split(b"\n")[:-1]  # every record ends with a newline
        rank = {json.dumps(i): n for n, i in enumerate(order)}
        ordered = sorted(lines, key=lambda line: rank.get(json.dumps(json.loads(line)["id"]), len(rank)))
        if ordered != lines:  # a crash before the rename leaves the complete partial file either way
            with files.replacing(self.partial) as f:
                f.write(b"".join(line + b"\n" for line in ordered))

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _no_follow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)


def _lock(path: Path, output: Path):
    """The lock file `path` of `output`, open and held (flock: released when the process ends,
    however it ends), or a one-line refusal when another run holds it."""
    for _ in range(10):  # another try only when the run that held it ended in between
        try:
            f = open(path, "a+b", opener=_no_follow)
        except OSError as e:
            raise JspecError(f"cannot lock {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise JspecError(f"{output} is being written by another run (it holds {path}); wait for it to end, "
                             "or give another --output") from None
        held = os.fstat(f.fileno())
        try:
            current = os.path.samestat(held, os.lstat(path))
        except FileNotFoundError:
            current = False
        if current and not held.st_size:
            return f
        f.close()
        if current:
            raise JspecError(f"{path} is not a jspec lock file (it is not empty); move it away")
        # else the run that held it removed it after this one opened it: lock the one there now
    raise JspecError(f"cannot lock {path}: other runs keep replacing it")


class NoWriter:
    """The RecordWriter of a process that computes rows but does not write them (every process
    of a multi-process run but process 0): it has written nothing and keeps nothing."""

    done_ids: frozenset = frozenset()
    prompt_digests = types.MappingProxyType({})
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
