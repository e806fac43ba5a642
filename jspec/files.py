"""Writing files and folders so that a crash, a full disk or a second run never leaves one torn.

A file is written under a temporary name beside it, fsynced and renamed over the old one
(`replacing`, `write_text`); a folder is filled under a temporary name and swapped in whole (`writing_folder`):
the old one is renamed aside, the new one renamed in, and only then is the old one removed, so a
process that opened the old folder keeps reading it and no moment exists without a complete one.
A file appended to line by line (records, trial logs) is read back by `complete_lines`, which
leaves out the last line a crash tore.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from jspec.errors import JspecError


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in the folder `path` durable (where the file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike):
    """Yield a binary file whose contents replace the file `path`, all or nothing: written under a
    temporary name beside it, fsynced and renamed over it when the block completes, removed if
    it fails. A symlink at `path` is replaced, never followed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file `path` with `text` (UTF-8), as `replacing` does."""
    with replacing(path) as f:
        f.write(text.encode("utf-8"))


def check_output(path: str | os.PathLike, marker: str) -> None:
    """Refuse `path` as an output folder unless it is absent, empty, or an earlier output of the
    same kind (it holds `marker`, e.g. head.json): writing replaces it whole, and must never
    delete anything else (a checkout, a data folder, a home directory)."""
    path = Path(path)
    if path.is_symlink():
        raise JspecError(f"{path} is a symbolic link; name the folder itself")
    if path.is_dir() and (path / marker).is_file():
        return
    if path.exists() and not path.is_dir():
        raise JspecError(f"{path} is a file, not a folder to write")
    if path.exists() and any(path.iterdir()):
        raise JspecError(f"{path} exists, is not empty and holds no earlier output of this command "
                         f"(no {marker}); name a new or empty folder")


@contextlib.contextmanager
def writing_folder(path: str | os.PathLike, marker: str):
    """Yield an empty temporary folder beside `path`; when the block completes it replaces `path`,
    and if the block fails it is removed, so `path` is never half-written. `path` must pass
    `check_output` with `marker`, before the block and again when it is replaced."""
    path = Path(path)
    check_output(path, marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        check_output(path, marker)
        publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, path: Path) -> None:
    """Swap the complete folder `tmp` in as `path`: the old `path` (if any) is renamed aside first
    and removed last, so a reader of the old one is never left with half of it."""
    aside = None
    if path.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
        os.replace(path, aside / path.name)
    try:
        os.rename(tmp, path)
    except BaseException:
        if aside is not None and not path.exists():
            os.replace(aside / path.name, path)  # put the old one back rather than leave none
        raise
    finally:
        fsync_dir(path.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def complete_lines(data: bytes, parse, refuse) -> tuple[list, int]:
    """(what `parse` makes of each complete line, the bytes those lines fill) of an append-only
    file's `data`: `parse(line)` gives the line's object, None for one to leave out, or raises
    ValueError for a damaged line. A damaged last line (torn by a crash) and an unterminated tail
    are left out, for the writer to cut off and redo; an earlier damaged line raises `refuse(its
    line number)`."""
    lines = data.split(b"\n")
    objects, keep = [], 0
    for i, line in enumerate(lines[:-1]):  # the last piece has no newline: torn, or empty
        try:
            obj = parse(line)
        except ValueError:
            if i == len(lines) - 2 and not lines[-1]:
                break  # the last line is garbage (torn by a crash): redo it
            raise refuse(i + 1) from None
        keep += len(line) + 1
        if obj is not None:
            objects.append(obj)
    return objects, keep
