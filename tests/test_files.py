"""Files and folders written all or nothing (jspec.files): a failed or second write never tears
what a reader holds, never follows a symlink, never replaces a folder of something else."""

from __future__ import annotations

import os

import pytest

from jspec import files
from jspec.errors import JspecError


def test_an_output_folder_replaces_only_an_output_of_its_kind(tmp_path):
    """writing_folder replaces a folder only when it is absent, empty, or holds the same kind's
    marker file: never a folder of anything else (once it took a whole checkout), never a file."""
    def write(path, text):
        with files.writing_folder(path, "kind.json") as tmp:
            (tmp / "kind.json").write_text(text)

    write(tmp_path / "new" / "out", "1")                       # absent, parents made
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", "1")
    write(tmp_path / "empty", "2")                              # an earlier output of its kind
    assert (tmp_path / "empty" / "kind.json").read_text() == "2"

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for path, phrase in [(other, "holds no earlier output of this command \\(no kind.json\\)"),
                         (tmp_path / "file", "is a file")]:
        with pytest.raises(JspecError, match=phrase):
            write(path, "1")
    assert (other / "keep.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "new", "other"]  # no temporary left


def test_a_folder_is_swapped_in_whole(tmp_path):
    """The old folder stays whole for a reader that opened it while the new one is renamed in, and
    nothing of either is left beside it afterwards."""
    out = tmp_path / "out"
    for text in ("old", "new"):
        with files.writing_folder(out, "kind.json") as tmp:
            (tmp / "kind.json").write_text(text)
            (tmp / "data").write_text(text * 1000)
        if text == "old":
            reader = open(out / "data")
    assert reader.read() == "old" * 1000  # the reader's folder was moved aside, not emptied under it
    reader.close()
    assert (out / "data").read_text() == "new" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "settings.json"
    files.write_text(path, "old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        files.write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["settings.json"]


def test_a_symlink_is_replaced_not_followed(tmp_path):
    (tmp_path / "users-file").write_text("mine")
    (tmp_path / "state").symlink_to(tmp_path / "users-file")
    files.write_text(tmp_path / "state", "state")
    assert (tmp_path / "users-file").read_text() == "mine"
    assert not (tmp_path / "state").is_symlink() and (tmp_path / "state").read_text() == "state"
    (tmp_path / "folder").symlink_to(tmp_path)
    with pytest.raises(JspecError, match="is a symbolic link"):
        files.check_output(tmp_path / "folder", "kind.json")
