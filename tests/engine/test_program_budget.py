"""A process keeps at most programs.LIMIT compiled programs across its models: past it the least
recently run go, and their memory with them (on XLA:CPU each holds hundreds of memory maps, and a
process that kept every program died at Linux's map limit)."""

from __future__ import annotations

from pathlib import Path

from jspec.engine import programs

MAPS = Path("/proc/self/maps")


def maps() -> int:
    return len(MAPS.read_text().splitlines())


def test_least_recently_run_programs_are_dropped_and_freed(tiny_llama, monkeypatch):
    a, b = tiny_llama.jspec_model(), tiny_llama.jspec_model()
    prompt = [{"token_ids": [5, 6, 7]}]
    tokens = lambda model, n: model.generate(prompt, max_new_tokens=n)[0]["token_ids"]  # noqa: E731
    monkeypatch.setattr(programs, "LIMIT", 0)
    monkeypatch.setattr(programs, "KEEP", 0)
    first = tokens(a, 3)  # no room: every program of the process goes, this one too
    assert programs.alive() == 0 and a.programs() == {}
    monkeypatch.setattr(programs, "LIMIT", 3)
    monkeypatch.setattr(programs, "KEEP", 2)
    assert tokens(a, 3) == first  # compiled again, the same program
    assert a.compiling[0] == 2  # a compile each time, the one dropped counted again
    tokens(a, 3)
    assert a.compiling[0] == 2  # kept: run, not compiled
    tokens(b, 4)
    tokens(a, 5)
    assert (len(a.programs()), len(b.programs())) == (2, 1)
    tokens(a, 3)  # run again: now the most recent
    before = maps()
    tokens(b, 6)  # a fourth program: the two least recently run (b's 4 and a's 5) go
    max_new = lambda model: [sig.run.max_new_tokens for sig in model.programs()]  # noqa: E731
    assert max_new(a) == [3] and max_new(b) == [6]
    assert programs.alive() == programs.KEEP
    # The new program's maps came, and two programs' maps went (hundreds each on a CPU).
    assert maps() < before
    assert tokens(a, 5)[:3] == first
