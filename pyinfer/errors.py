"""The one exception type for mistakes a user can make (bad file, bad flag, prompt too long).

CLIs catch it and print ``error: <message>`` on one line with exit status 1, never a traceback.
"""


class PyinferError(Exception):
    """A user-facing error with a one-line message."""


class KernelsMissing(PyinferError, ImportError):
    """The compiled kernels are not built (or do not load); the message says how to build them.
    An ImportError too, so code that guards an optional import still catches it."""


def exit_code_of(fn, *args) -> int:
    """Run a CLI body ``fn(*args)``; turn a PyinferError, Ctrl-C or MemoryError into
    ``error: ...`` on stderr and exit status 1 (never a traceback for a user mistake). Returns
    fn's status otherwise."""
    import sys

    try:
        return fn(*args)
    except PyinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    except MemoryError:
        print("error: out of memory", file=sys.stderr)
        return 1
