"""Generate on a multi-host TPU pod: every host runs this; jax.distributed joins them."""

import sys

import jax


def main() -> int:
    jax.distributed.initialize()
    from jspec.cli import main as cli_main

    argv = ["generate", *sys.argv[1:]]
    if jax.process_index() != 0:  # every host computes; one writes
        if "--output" in argv:
            i = argv.index("--output")
            argv[i + 1] = f"/tmp/jspec-process-{jax.process_index()}.jsonl"
    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
