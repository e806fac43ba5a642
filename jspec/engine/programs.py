"""The compiled decoding programs a process keeps, under one budget for all its models.

A compiled program holds its machine code until JAX lets go of it, and JAX's own in-memory caches
keep every program a process compiled (up to thousands) for as long as the process lives, whether
or not anything still calls it. On XLA:CPU each jspec program also maps 200-600 regions of
memory, and Linux gives a process 65530 (`vm.max_map_count`): about 150 programs, say a benchmark
over every method and cache length, and the next compile dies with a segmentation fault. So
jspec keeps at most `LIMIT` programs alive across every Model of the process. Past it, the least
recently run are dropped, down to `KEEP`, and JAX's caches are cleared (`jax.clear_caches`: JAX
frees nothing else), so their memory goes. A dropped program is compiled again if it is needed
again; the persistent compilation cache (jspec.compilation_cache) makes that cheap where it is on.
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Callable, NamedTuple

import jax

LIMIT = 64  # at about 530 maps for the largest CPU program: half of vm.max_map_count's default
KEEP = 48  # after a sweep: a sweep clears all of JAX's caches, so it frees some room at once

_tables: weakref.WeakSet = weakref.WeakSet()  # every live Programs
_clock = itertools.count()  # when a program was last asked for, across tables


class Signature(NamedTuple):
    """What a decoding program is compiled for, beside its parameters: a Model's programs are
    told apart by it."""

    program: str  # loop.generate, or one of jspec.engine.slots' programs, by name
    rows: int
    length: int  # the cache's
    run: object  # jspec.engine.loop.Run: the static half
    dparams: tuple  # the drafter's parameters' tree structure, shapes and dtypes
    # the same of the program's own arguments: an admit's batch, whether rounds are priced (costs)
    args: tuple


class Programs:
    """One Model's compiled programs, by Signature."""

    def __init__(self):
        self._entries: dict = {}  # signature -> [last use, jax.stages.Compiled]
        self.build_seconds = 0.0  # spent compiling, in all: what a clock that leaves compiles out subtracts
        self.builds = 0  # programs compiled, in all (one dropped and compiled again counts twice)
        _tables.add(self)

    def get(self, signature, build: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The program of `signature`, compiled by `build()` the first time it is asked for (and
        again after it was dropped)."""
        entry = self._entries.get(signature)
        if entry is not None:
            entry[0] = next(_clock)
            return entry[1]
        began = time.perf_counter()
        compiled = build()
        self.build_seconds += time.perf_counter() - began
        self.builds += 1
        self._entries[signature] = [next(_clock), compiled]
        _sweep()
        return compiled

    def compiled(self) -> dict:
        """Signature -> jax.stages.Compiled of the programs kept."""
        return {signature: compiled for signature, (_, compiled) in self._entries.items()}


def alive() -> int:
    """Programs kept by every Model of this process."""
    return sum(len(table._entries) for table in list(_tables))


def _sweep() -> None:
    if alive() <= LIMIT:
        return
    by_age = sorted(((used, signature, t) for t in list(_tables) for signature, (used, _) in t._entries.items()),
                    key=lambda entry: entry[0])
    for _, signature, table in by_age[:len(by_age) - KEEP]:
        del table._entries[signature]
    jax.clear_caches()


def steady_run(model, run):
    """`run()`, and once more if it compiled a program: a program's first run pays for its first
    execution (a second or more on a long prompt's bucket), so the second run is the one to time.
    For scripts that time runs one by one; jspec.bench.run.run_jspec warms each program before its clock instead."""
    programs = len(model.programs())
    out = run()
    return run() if len(model.programs()) > programs else out
