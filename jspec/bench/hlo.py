"""Reading a model's compiled decoding programs: the copies of the KV cache and of the weights
they make.

XLA copies a buffer that a conditional's branch updates in place, and a copy of the cache inside
the decoding loop is paid every round (docs/design.md, "No cache inside a conditional"). The
tests assert none is left; benchmarks/probes/cache_copies.py prints the counts per method. On an
accelerator, benchmarks/device_check.py counts what its compiler made of the numerics: float32
copies of bfloat16 weights, and layouts of the cache other than its own.
"""

from __future__ import annotations

import itertools
import re

import jax

HLO_TYPES = {"float32": "f32", "bfloat16": "bf16"}


def computations(text: str):
    """(name, whether it is the entry computation, lines) of each computation of an optimized HLO
    module's text, fused ones (a fusion's body, whose values stay in registers) left out."""
    name, entry, lines = None, False, []
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            entry = line.startswith("ENTRY")
            name, lines = line.split()[1 if entry else 0].lstrip("%"), []
        elif line.startswith("}") and name is not None:
            if not name.startswith(("fused", "wrapped")):
                yield name, entry, lines
            name = None
        elif name is not None:
            lines.append(line)


def cache_copies(cfg, programs: dict) -> list[tuple[int, int, int]]:
    """For each of a model's compiled programs (jspec.Model.programs()): (rows, copies of one
    layer's cache [rows, S, K, H] in the entry computation, copies elsewhere: the loop and its
    branches)."""
    out = []
    for sig, compiled in programs.items():
        rows, length, numerics = sig.rows, sig.length, sig.run.numerics
        copy = re.compile(r"= %s\[%d,%d,%d,%d\]\S* copy\(" % (HLO_TYPES[numerics.kv_cache], rows, length,
                                                              cfg.num_kv_heads, cfg.head_dim))
        entry = inner = 0
        for _, is_entry, lines in computations(compiled.as_text()):
            found = sum(bool(copy.search(line)) for line in lines)
            entry, inner = (entry + found, inner) if is_entry else (entry, inner + found)
        out.append((rows, entry, inner))
    return out


def _results(lines, kind: str, dims: set[tuple[int, ...]], ops: tuple[str, ...] | None = None) -> int:
    """Instructions among `lines` whose result is a `kind` array of one of `dims` (by `ops`, when given)."""
    found = 0
    for line in lines:
        m = re.search(r"= %s\[([\d,]*)\]\S* (\w[\w-]*)\(" % kind, line)
        if m and tuple(int(d) for d in m.group(1).split(",") if d) in dims and (ops is None or m.group(2) in ops):
            found += 1
    return found


def weight_copies(compiled, params) -> int:
    """Wider arrays of a narrow weight's shape that the program writes to memory (outside a
    fusion): float32 of a bfloat16 weight, float32 or bfloat16 of an int8 one (jspec.model.weights)
    -- a widened copy of a weight, made once (hoisted) or every step."""
    leaves = jax.tree.leaves(params)
    bf16 = {tuple(x.shape) for x in leaves if x.ndim == 2 and str(x.dtype) == "bfloat16"}
    int8 = {tuple(x.shape) for x in leaves if x.ndim == 2 and str(x.dtype) == "int8"}
    return sum(_results(lines, "f32", bf16 | int8) + _results(lines, "bf16", int8)
               for _, _, lines in computations(compiled.as_text()))


def cache_relayouts(compiled, cfg, rows: int, length: int, dtype: str) -> int:
    """Transposes and copies of one layer's cache [rows, S, K, H] (or its dims in another order)
    that the program writes outside a fusion: a decode step that moves its cache."""
    dims = set(itertools.permutations((rows, length, cfg.num_kv_heads, cfg.head_dim)))
    return sum(_results(lines, HLO_TYPES[dtype], dims, ("transpose", "copy"))
               for _, _, lines in computations(compiled.as_text()))

