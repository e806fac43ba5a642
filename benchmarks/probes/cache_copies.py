"""How many copies of a layer's KV cache each method's compiled program makes.

XLA copies a buffer that a conditional's branch updates in place (docs/design.md, "No cache
inside a conditional"). This compiles each method's decoding program for one short prompt with
the default model and counts, in the optimised HLO, the copies shaped like one layer's cache:
those at the program's entry (from the prefill, once per batch) and those inside the decoding
loop, which a round pays each time it runs them. Prints a Markdown table.

    python benchmarks/probes/cache_copies.py --methods "ar,eesd:max_draft=4,knn-ssd,specee" --batch-size 1
"""

from __future__ import annotations

import argparse

import jspec
from jspec.bench import parse_methods
from jspec.bench.hlo import cache_copies

PROMPT = "Name three primes."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,eesd,eesd:max_draft=4,kangaroo:max_draft=4,knn-ssd,specee,mjsd,"
                                             "eesd:lookup=2")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    m = jspec.load()
    print("| method | batch | cache copies at entry | cache copies in the loop |")
    print("| --- | ---: | ---: | ---: |")
    for spec in parse_methods(args.methods):
        before = m.programs()
        m.generate([PROMPT] * args.batch_size, max_new_tokens=512, batch_size=args.batch_size, method=spec.name,
                   **dict(spec.options))
        new = {sig: program for sig, program in m.programs().items() if sig not in before}
        ((rows, entry, inner),) = cache_copies(m.cfg, new)
        print(f"| `{spec.label}` | {rows} | {entry} | {inner} |")


if __name__ == "__main__":
    main()
