"""The one exception type users see: the CLI prints its message on one line and exits 2."""


class JspecError(Exception):
    """A problem with the user's input or environment, explained in one line."""
