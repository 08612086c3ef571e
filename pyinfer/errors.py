"""The one exception type for mistakes a user can make (bad file, bad flag, prompt too long).

CLIs catch it and print ``error: <message>`` on one line with exit status 1, never a traceback.
"""


class PyinferError(Exception):
    """A user-facing error with a one-line message."""
