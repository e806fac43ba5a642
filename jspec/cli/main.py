"""The `jspec` command line: one file per command here (`add_arguments(parser)`, `run(args)`), the
options several share in common.py; this file parses, dispatches, and turns every error into one
line.

Every user or input error ends as one line, `jspec: error: ...`, on stderr, with exit status 2
(1 for other I/O failures, 130 on Ctrl-C): no tracebacks. Cheap checks run before the model is
loaded, so bad input fails in a second. Set JSPEC_DEBUG=1 to see the traceback anyway.
Anything else (running out of memory, or a bug: an exception jspec did not expect) also ends in
one line, which names the exception and JSPEC_DEBUG=1, with exit status 1. In a multi-process run
an error on one process ends every process, each with one line and that process's exit status
(jspec.distributed.fail). `jspec compare` also exits 1 when the outputs differ, like `diff`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Sequence

from jspec import distributed
from jspec.cli import (bench, build_datastore, calibrate, compare, convert, distill_data, env, fit_knn, generate,
                       search_skip, train_head, train_predictors)
from jspec.cli.common import UsageError, one_line, with_hint
from jspec.errors import JspecError

PROG = "jspec"
EXIT_USAGE = 2
EXIT_IO = 1  # and out of memory, and an unexpected exception
EXIT_INTERRUPTED = 130
# name -> the module with its add_arguments and run, in the order `jspec --help` lists them
COMMANDS = {"generate": generate, "compare": compare, "convert": convert, "distill-data": distill_data,
            "train-head": train_head, "train-predictors": train_predictors, "env": env, "search-skip": search_skip,
            "build-datastore": build_datastore, "fit-knn": fit_knn, "bench": bench, "calibrate": calibrate}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage and exit; we want one line
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from jspec import __version__

    parser = _Parser(prog=PROG, description="Speculative decoding for Llama-family models in JAX.")
    parser.add_argument("--version", action="version", version=f"jspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return with_hint(f"{e.strerror}: {e.filename}", e)
    return one_line(e)


class _OneLineHandler(logging.Handler):
    """jspec's warnings as `jspec: warning: ...` lines on the current stderr (which tests may swap)."""

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(line.strip() for line in record.getMessage().splitlines() if line.strip())
        print(f"{PROG}: {record.levelname.lower()}: {text}", file=sys.stderr)


def _error(message: str, code: int) -> int:
    distributed.fail(message, code)  # a process of a multi-process run ends here, and ends the others
    try:
        sys.stdout.flush()
    except OSError:
        pass
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the `jspec` script exits with it)."""
    whole_process = argv is None  # the `jspec` script, not a caller in a process of its own
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("JSPEC_DEBUG"))
    handler, log = _OneLineHandler(logging.WARNING), logging.getLogger("jspec")
    # Not to the root logger too: absl (under orbax) gives it a handler of its own, which would
    # print each warning a second time.
    log.addHandler(handler)
    log.propagate = False
    try:
        code = _main(argv, debug)
    finally:
        log.removeHandler(handler)
        log.propagate = True
    if code and whole_process and not debug:
        # A library's work left pending by the error (orbax's other reads of a damaged checkpoint)
        # may report itself as "Exception ignored in ..." tracebacks as the process ends: after the
        # one line, nothing more is worth saying.
        sys.unraisablehook = lambda unraisable: None
    return code


def _main(argv: list[str], debug: bool) -> int:
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse would blame the top-level parser; the command's help lists its options
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (see {PROG} {args.command} --help)")
        return int(args.func(args) or 0)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    except UsageError as e:
        return _error(str(e), EXIT_USAGE)
    except KeyboardInterrupt as e:
        return _error(with_hint("interrupted", e), EXIT_INTERRUPTED)
    except BrokenPipeError:  # `jspec generate ... | head`: the reader left, which is not an error to report
        try:  # and keep Python's exit-time flush of stdout from raising again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_IO
    except Exception as e:
        message, code = _describe(e)
        if debug:
            if distributed.joined():  # raised on, it would leave the other processes waiting for this one
                traceback.print_exc()
                distributed.fail(message, code)
            raise
        return _error(message, code)


def _describe(e: Exception) -> tuple[str, int]:
    """The one line an exception ends the command with, and the exit status."""
    if isinstance(e, JspecError):
        return one_line(e), EXIT_USAGE
    if isinstance(e, OSError):
        user_path = isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError))
        return _os_message(e), EXIT_USAGE if user_path else EXIT_IO
    if isinstance(e, MemoryError):
        return with_hint("out of memory: give the command less to hold at once (a smaller model, batch or file), "
                         "or free some", e), EXIT_IO
    return f"{one_line(e)} (an unexpected error: {type(e).__name__}; set JSPEC_DEBUG=1 for the traceback)", EXIT_IO


if __name__ == "__main__":
    raise SystemExit(main())
