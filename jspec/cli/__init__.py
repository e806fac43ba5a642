"""The `jspec` command line (jspec.cli.main): `main` is the `jspec` script's entry point."""

from jspec.cli.main import main

__all__ = ["main"]
