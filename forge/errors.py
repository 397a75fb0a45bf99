"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class ForgeError(Exception):
    """A user-facing failure: bad input, unsupported model, refused operation.

    The message is printed as one line, prefixed with ``error:``; no traceback.
    """
