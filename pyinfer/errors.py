"""The one exception type for mistakes a user can make (bad file, bad flag, prompt too long).

CLIs catch it and print ``error: <message>`` on one line with exit status 1, never a traceback.
"""


class PyinferError(Exception):
    """A user-facing error with a one-line message."""


class KernelsMissing(PyinferError, ImportError):
    """The compiled kernels are not built (or do not load); the message says how to build them.
    An ImportError too, so code that guards an optional import still catches it."""


#: exit status after Ctrl-C (128 + SIGINT, as a shell reports it and llama.cpp exits)
EXIT_INTERRUPTED = 130
#: exit status when the reader of stdout went away (``| head``): 128 + SIGPIPE, as Unix tools
EXIT_BROKEN_PIPE = 141


def exit_code_of(fn, *args) -> int:
    """Run a CLI body ``fn(*args)``; turn a PyinferError or MemoryError into ``error: ...`` on
    stderr and exit status 1 (never a traceback for a user mistake), Ctrl-C into ``error:
    interrupted`` and EXIT_INTERRUPTED, and a closed stdout (``pyinfer-run ... | head``) into a
    quiet EXIT_BROKEN_PIPE. Returns fn's status otherwise."""
    import os
    import sys

    try:
        status = fn(*args)
        sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at exit
        return status
    except PyinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except MemoryError:
        print("error: out of memory", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that no second
        # BrokenPipeError is printed (the Python documentation's recipe, signal module notes)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_BROKEN_PIPE
