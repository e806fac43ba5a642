"""Reading a model's compiled decoding programs: the copies of the KV cache they make.

XLA copies a buffer that a conditional's branch updates in place, and a copy of the cache inside
the decoding loop is paid every round (docs/design.md, "No cache inside a conditional"). The
tests assert none is left; benchmarks/probes/cache_copies.py prints the counts per method.
"""

from __future__ import annotations

import re


def cache_copies(cfg, programs: dict) -> list[tuple[int, int, int]]:
    """For each of a model's compiled programs (jspec.Model.programs()): (rows, copies of one
    layer's cache [rows, S, K, H] in the entry computation, copies elsewhere: the loop and its
    branches)."""
    out = []
    for sig, compiled in programs.items():
        rows, length = sig[0], sig[2]
        copy = re.compile(r"= f32\[%d,%d,%d,%d\]\S* copy\(" % (rows, length, cfg.num_kv_heads, cfg.head_dim))
        entry = inner = 0
        in_entry = False
        for line in compiled.as_text().splitlines():
            if line and not line.startswith(" ") and line.rstrip().endswith("{"):
                in_entry = line.startswith("ENTRY")
            if copy.search(line):
                entry, inner = (entry + 1, inner) if in_entry else (entry, inner + 1)
        out.append((rows, entry, inner))
    return out
