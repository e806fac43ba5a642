"""Output files that cannot lose records (issue 72): an interrupted run's partial file outlives a
rerun that fails, one run at a time writes an output, an arbitrary file is replaced only with
--overwrite, no file is written through a symbolic link or over the prompts, a resume refuses
answers to edited prompts, and small state files are whole or absent."""

from __future__ import annotations

import json
import os

import pytest
from support.cli import PROMPTS, assert_one_error, read_jsonl, run, tiny, write_lines  # noqa: F401

import jspec.files
from jspec.errors import JspecError
from jspec.jsonl import RecordWriter
from jspec.training import distill, search_skip

GEN = ["--max-new-tokens", "3"]


def snapshot(folder) -> dict:
    """Every file under `folder` (links as links), by name: what a refused run must leave as it was."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() for p in sorted(folder.iterdir())}


def untimed(lines) -> list[dict]:
    """Records without their timings, which differ from run to run."""
    return [{k: v for k, v in json.loads(x).items() if k not in ("seconds", "tokens_per_second")} for x in lines]


def generate(capsys, tiny, prompts, out, *more):
    return run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, *GEN, *more)


@pytest.fixture(scope="module")
def answered(tiny, tmp_path_factory):
    """The prompts file and a complete output of it, made once for the tests that resume."""
    from jspec.cli import main

    folder = tmp_path_factory.mktemp("answered")
    prompts = write_lines(folder / "in.jsonl", *PROMPTS)
    assert main(["generate", "--prompts", str(prompts), "--output", str(folder / "ref.jsonl"), "--model", tiny,
                 *GEN]) == 0
    return prompts, (folder / "ref.jsonl").read_text().splitlines(keepends=True)


def test_a_rerun_that_fails_keeps_the_interrupted_runs_records(capsys, tiny, answered, tmp_path):
    prompts, ref = answered
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.partial").write_text(ref[0])  # what an interrupted run kept
    (tmp_path / "out.jsonl.partial.settings").write_text('{"model": "earlier"}\n')
    before = snapshot(tmp_path)
    # A mistyped option that only the loaded model can check: the records outlive it.
    code, stdout, err = generate(capsys, tiny, prompts, out, "--method", "early-exit", "--exit-layer", "5")
    warning, error = err.splitlines()
    assert code == 2 and stdout == "" and "Traceback" not in err
    assert "holds records of an interrupted run" in warning and "--resume" in warning
    assert error.startswith("jspec: error: ") and "--exit-layer must be between" in error
    assert snapshot(tmp_path) == before
    # A rerun that writes its first batch replaces them, and leaves no partial, settings or lock file.
    code, _, err = generate(capsys, tiny, prompts, out)
    assert code == 0, err
    assert untimed(out.read_text().splitlines()) == untimed(ref) and sorted(snapshot(tmp_path)) == ["out.jsonl"]


def test_a_second_run_on_a_locked_output_is_refused(capsys, tiny, answered, tmp_path):
    prompts, ref = answered
    out = tmp_path / "out.jsonl"
    first = RecordWriter(out, settings={"model": "the first run"})  # a run in progress, in this process
    first.write([json.loads(ref[0])])
    before = snapshot(tmp_path)
    for resume in ([], ["--resume"]):
        assert_one_error(*generate(capsys, tiny, prompts, out, *resume), f"{out} is being written by another run")
        assert snapshot(tmp_path) == before
    first.write([json.loads(ref[1])])
    first.finish()
    assert out.read_text() == "".join(ref[:2]) and sorted(snapshot(tmp_path)) == ["out.jsonl"]

    # The lock file of a run that was killed (flock let go of it with the process) holds nothing back.
    (tmp_path / "out.jsonl.lock").touch()
    code, _, err = generate(capsys, tiny, prompts, out)
    assert code == 0, err
    assert untimed(out.read_text().splitlines()) == untimed(ref) and sorted(snapshot(tmp_path)) == ["out.jsonl"]


def test_an_output_of_something_else_is_replaced_only_with_overwrite(capsys, tiny, answered, tmp_path):
    prompts, ref = answered
    out = tmp_path / "out.jsonl"
    # Notes, and JSON lines that are not records.
    for text in ("my notes\n", '{"id": 0, "prompt": "Hi."}\n'):
        out.write_text(text)
        assert_one_error(*generate(capsys, tiny, prompts, out), "give --overwrite to replace it")
        assert snapshot(tmp_path) == {"out.jsonl": text.encode()}
    code, _, err = generate(capsys, tiny, prompts, out, "--overwrite")
    assert code == 0, err
    assert untimed(out.read_text().splitlines()) == untimed(ref)


@pytest.mark.parametrize("name", ["out.jsonl.partial", "out.jsonl.partial.settings", "out.jsonl.lock"])
def test_no_file_is_written_through_a_symbolic_link(capsys, tiny, answered, tmp_path, name):
    prompts, ref = answered
    (tmp_path / "mine.txt").write_text(ref[0])  # a user's file, which even looks like a record
    (tmp_path / name).symlink_to(tmp_path / "mine.txt")
    before = snapshot(tmp_path)
    for resume in ([], ["--resume"]):
        assert_one_error(*generate(capsys, tiny, prompts, tmp_path / "out.jsonl", *resume),
                         f"{tmp_path / name} is a symbolic link")
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("suffix", [".partial", ".partial.settings", ".lock"])
def test_prompts_named_as_a_file_of_the_output_are_refused(capsys, tiny, tmp_path, suffix):
    prompts = write_lines(tmp_path / f"x.jsonl{suffix}", *[{"id": i, **p} for i, p in enumerate(PROMPTS)])
    before = snapshot(tmp_path)
    for resume in ([], ["--resume"]):
        assert_one_error(*generate(capsys, tiny, prompts, tmp_path / "x.jsonl", *resume), "is the --prompts file")
        assert snapshot(tmp_path) == before


def test_resume_refuses_the_answer_to_an_edited_prompt(capsys, tiny, answered, tmp_path):
    prompts, ref = answered
    edited = write_lines(tmp_path / "edited.jsonl", {"prompt": "Name four primes."}, *PROMPTS[1:])
    complete = tmp_path / "complete.jsonl"
    complete.write_text("".join(ref))
    (tmp_path / "out.jsonl.partial").write_text(ref[0])
    before = snapshot(tmp_path)
    for out in (tmp_path / "out.jsonl", complete):
        assert_one_error(*generate(capsys, tiny, edited, out, "--resume"), f"prompt 0 of {edited} was edited after")
        assert snapshot(tmp_path) == before
    # The records of an older jspec carry no digest: they resume as they did.
    old = {k: v for k, v in json.loads(ref[0]).items() if k != "prompt_sha256"}
    (tmp_path / "out.jsonl.partial").write_text(json.dumps(old) + "\n")
    code, _, err = generate(capsys, tiny, edited, tmp_path / "out.jsonl", "--resume")
    assert code == 0 and "1 of 3 prompts already in" in err, err
    records = read_jsonl(tmp_path / "out.jsonl")
    assert records[0] == old and [r["id"] for r in records] == [0, "greeting", 2]


def test_settings_of_a_partial_file_that_was_being_replaced_are_not_trusted(tmp_path, monkeypatch):
    """A crash between a new run's settings and the rename of its first batch over the old partial
    file: the old records are whole, and resuming them under the new run's settings is refused."""
    out = tmp_path / "out.jsonl"
    old = RecordWriter(out, settings={"seed": 1})
    old.write([{"id": 0, "token_ids": [5]}])
    old.close()
    partial = (tmp_path / "out.jsonl.partial").read_bytes()
    replace = os.replace

    def crash_before_the_partial_is_replaced(src, dst):
        if str(dst).endswith(".partial"):
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_before_the_partial_is_replaced)
    new = RecordWriter(out, settings={"seed": 2})
    with pytest.raises(KeyboardInterrupt):
        new.write([{"id": 0, "token_ids": [7]}])
    new.close()
    monkeypatch.undo()
    assert (tmp_path / "out.jsonl.partial").read_bytes() == partial
    assert sorted(snapshot(tmp_path)) == ["out.jsonl.partial", "out.jsonl.partial.settings"]
    with pytest.raises(JspecError, match="is not the settings of .*run without --resume"):
        RecordWriter(out, resume=True, settings={"seed": 2})


class InOrder:
    """A stand-in sampler: trial i sets the variables to i's bits."""

    def __init__(self, variables):
        self.variables, self.i = variables, 0

    def replay(self, done):
        self.i = len(done)

    def ask(self):
        params = {v: (self.i >> b) & 1 for b, v in enumerate(self.variables)}
        self.i += 1
        return params

    def tell(self, value):
        pass


def test_a_torn_trial_log_resumes_and_a_damaged_one_is_refused(tmp_path):
    variables, log, header = search_skip.names(2), tmp_path / "qa.trials.jsonl", {"prompts": "qa"}
    trial = lambda params: (float(sum(params.values())), {})  # noqa: E731
    search_skip.search(trial, InOrder(variables), variables, 3, log, header)
    kept = log.read_bytes()
    log.write_bytes(kept + b'{"trial": 3, "params": {"atten')  # killed while appending trial 3
    done = search_skip.search(trial, InOrder(variables), variables, 5, log, header)
    assert [row["trial"] for _, _, row in done] == [0, 1, 2, 3, 4]
    assert log.read_bytes().startswith(kept) and len(log.read_bytes().splitlines()) == 1 + 5
    damaged = kept.replace(b'"trial": 1', b'"trial": 1,,', 1)
    log.write_bytes(damaged)
    with pytest.raises(JspecError, match="line 3 is damaged"):
        search_skip.search(trial, InOrder(variables), variables, 5, log, header)
    assert log.read_bytes() == damaged


def test_a_state_file_whose_write_dies_keeps_the_old_one(tmp_path, monkeypatch):
    """meta.json grown by a larger --count, its write dying before the rename (a kill, a full
    disk): the old file is whole, and no temporary file is left beside it."""
    meta = {"format": distill.FORMAT, "count": 4}
    distill.check_or_write_meta(tmp_path, meta, grows="count")
    before = snapshot(tmp_path)

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jspec.files.os, "replace", full_disk)
    with pytest.raises(OSError):
        distill.check_or_write_meta(tmp_path, {**meta, "count": 8}, grows="count")
    assert snapshot(tmp_path) == before
