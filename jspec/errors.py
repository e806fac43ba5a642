"""The one exception type users see: the CLI prints its message on one line and exits 2."""


class JspecError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def first_line(e: BaseException) -> str:
    """What a library's exception says, cut to its first line (at most 200 characters), for a
    one-line message that names it; its type where it says nothing."""
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__
