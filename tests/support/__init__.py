"""Helpers several test files share (tests/ is on sys.path: `from support.cli import run`)."""
