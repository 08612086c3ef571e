"""The numeric options a user can set, checked once for the CLI, the Python API and the server.

One range per option (``Range``); ``check(option, value, name)`` returns the value or raises
PyinferError naming the option as the caller spells it (``-t/--threads`` at the CLI, ``n_threads``
in the API, ``'temperature'`` in a server request). ``arg_type(option)`` is the same check as an
argparse ``type=``. Bounds that are not the option's own meaning are there to keep a typo from
crashing a process: OpenMP segfaults when asked for 100,000 threads, and a context of 10**19 tokens
overflows the KV cache's size arithmetic.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import numbers
import os
import string
import sys
import tempfile
from dataclasses import dataclass

from pyinfer.errors import PyinferError

#: llama.cpp's GGML_MAX_N_THREADS (ggml/include/ggml.h): more threads than any CPU has.
MAX_THREADS = 512
#: 16 Mi tokens: beyond every released model's context; a KV cache that size is terabytes already.
MAX_CTX = 1 << 24
#: A prompt file may hold at most this many bytes per context token (English text averages about 4;
#: 64 leaves room for long whitespace and code tokens) before it is refused unread.
PROMPT_BYTES_PER_TOKEN = 64
#: Context used to size that bound when -c is 0 (the engine's default is min(4096, the model's)).
DEFAULT_CTX_FOR_LIMIT = 4096
#: Largest text file pyinfer-perplexity scores (wikitext-2's test set is 1.3 MB).
MAX_TEXT_FILE_BYTES = 64 << 20
#: A seed is a 64-bit unsigned integer (numpy's default_rng takes any; the bound keeps it printable).
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Range:
    """Accepted values of one option: an integer or a finite float within [lo, hi]
    (``lo_open``: lo itself excluded). ``hi`` None: no upper bound."""

    integer: bool
    lo: float
    hi: float | None = None
    lo_open: bool = False
    extra: tuple = ()  # values accepted outside the range (e.g. -1 = random seed)

    def describe(self) -> str:
        def num(x) -> str:
            return str(int(x)) if self.integer or float(x).is_integer() else f"{x:g}"

        if self.integer:
            rng = f">= {num(self.lo)}" if self.hi is None else f"in {num(self.lo)}..{num(self.hi)}"
            kind = "an integer"
        else:
            lo = f"{'>' if self.lo_open else '>='} {num(self.lo)}"
            rng = lo if self.hi is None else f"{lo} and <= {num(self.hi)}"
            kind = "a finite number"
        also = "".join(f" (or {e})" for e in self.extra)
        return f"{kind} {rng}{also}"

    def accepts(self, v) -> bool:
        """``v`` is a number of the right kind in range (NumPy's integers and floats count, as
        Python's; bools do not)."""
        if isinstance(v, bool):  # (NumPy's bool_ is no numbers.Integral either)
            return False
        if isinstance(v, numbers.Integral) and v in self.extra:
            return True
        if self.integer:
            ok_type = isinstance(v, numbers.Integral)
        else:
            ok_type = isinstance(v, numbers.Real) and math.isfinite(v)
        if not ok_type:
            return False
        if v < self.lo or (self.lo_open and v == self.lo):
            return False
        return self.hi is None or v <= self.hi


OPTIONS: dict[str, Range] = {
    "threads": Range(integer=True, lo=1, hi=MAX_THREADS),
    "ctx_size": Range(integer=True, lo=0, hi=MAX_CTX),  # 0: the default context
    "n_predict": Range(integer=True, lo=-1, hi=MAX_CTX),  # -1: until end of text or a full context
    "keep": Range(integer=True, lo=-1, hi=MAX_CTX),  # --keep: -1 the whole prompt
    "max_tokens": Range(integer=True, lo=1, hi=MAX_CTX),  # the server's (OpenAI: positive)
    "temperature": Range(integer=False, lo=0.0),
    "top_k": Range(integer=True, lo=0, hi=2**31 - 1, extra=(-1,)),  # 0 or -1: off (llama.cpp)
    "top_p": Range(integer=False, lo=0.0, hi=1.0),  # 0: only the most likely token (OpenAI)
    "min_p": Range(integer=False, lo=0.0, hi=1.0),
    "repeat_penalty": Range(integer=False, lo=0.0, lo_open=True),
    "repeat_last_n": Range(integer=True, lo=0, hi=MAX_CTX, extra=(-1,)),  # -1: the whole context
    "dry_multiplier": Range(integer=False, lo=0.0, hi=1e6),  # 0: off
    "dry_base": Range(integer=False, lo=1.0, hi=1e6),
    "dry_allowed_length": Range(integer=True, lo=1, hi=MAX_CTX),
    "dry_penalty_last_n": Range(integer=True, lo=-1, hi=MAX_CTX),  # -1: the whole context
    "seed": Range(integer=True, lo=0, hi=MAX_SEED, extra=(-1,)),  # -1: random, as llama.cpp
    "vram_budget": Range(integer=False, lo=0.0, lo_open=True, hi=1 << 20),  # GiB
    "n_gpu_layers": Range(integer=True, lo=0, hi=1 << 20),
    "chunks": Range(integer=True, lo=-1, hi=1 << 31),  # -1, 0: all (llama.cpp's -1)
    "top_logprobs": Range(integer=True, lo=0, hi=20),  # OpenAI's bound
}


def check(option: str, value, name: str | None = None):
    """``value`` when it is in ``option``'s range (see OPTIONS), else PyinferError
    ``"<name> must be <range>, got <value>"``. ``name``: how the caller spells the option."""
    r = OPTIONS[option]
    if not r.accepts(value):
        raise PyinferError(f"{name or option} must be {r.describe()}, got {value!r}")
    return int(value) if isinstance(value, numbers.Integral) else value


def check_optional(option: str, value, name: str | None = None):
    """As ``check``, with None passed through (None means "the default")."""
    return None if value is None else check(option, value, name)


def seed_or_none(seed):
    """A checked seed, with -1 (random, as llama.cpp spells it) turned into None."""
    seed = check_optional("seed", seed)
    return None if seed == -1 else seed


def sampling(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n=64,
             dry_multiplier=0.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1) -> dict:
    """Checked sampling parameters as ``SamplingParams`` keyword arguments. top_p 0 is accepted
    (OpenAI's spelling of "only the most likely token") and becomes greedy decoding."""
    out = dict(temperature=float(check("temperature", temperature)), top_k=int(check("top_k", top_k)),
               top_p=float(check("top_p", top_p)), min_p=float(check("min_p", min_p)),
               repeat_penalty=float(check("repeat_penalty", repeat_penalty)),
               repeat_last_n=int(check("repeat_last_n", repeat_last_n)),
               dry_multiplier=float(check("dry_multiplier", dry_multiplier)),
               dry_base=float(check("dry_base", dry_base)),
               dry_allowed_length=int(check("dry_allowed_length", dry_allowed_length)),
               dry_penalty_last_n=int(check("dry_penalty_last_n", dry_penalty_last_n)))
    if out["top_p"] == 0.0:
        out["top_p"], out["temperature"] = 1.0, 0.0
    return out


def arg_type(option: str):
    """An argparse ``type=`` that parses and range-checks ``option`` (ArgumentTypeError otherwise)."""
    r = OPTIONS[option]

    def parse(text: str):
        try:
            v = int(text, 10) if r.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {r.describe()}, got {text!r}") from None
        if not r.accepts(v):
            raise argparse.ArgumentTypeError(f"must be {r.describe()}, got {text}")
        return v

    parse.__name__ = option
    return parse


def threads_arg(text: str) -> int | None:
    """argparse ``type=`` of ``-t/--threads``: a count in 1..MAX_THREADS, or None (the default)
    for 0 and negative counts, which llama.cpp's tools also read as "pick for me"."""
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {OPTIONS['threads'].describe()} (0 or less: "
                                         f"the default), got {text!r}") from None
    if v <= 0:
        return None
    if not OPTIONS["threads"].accepts(v):
        raise argparse.ArgumentTypeError(f"must be {OPTIONS['threads'].describe()}, got {text}")
    return v


def temperature_arg(text: str) -> float:
    """argparse ``type=`` of ``--temp``: a finite number; below 0 is 0 (greedy), as llama.cpp's
    ``--temp`` clamps it."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return max(v, 0.0)


def process_escapes(text: str) -> str:
    """llama.cpp's ``string_process_escapes`` (common.cpp), which its tools apply to -p/-f prompts
    and reverse prompts unless ``--no-escape``: ``\\n``, ``\\r``, ``\\t``, ``\\'``, ``\\"``,
    ``\\\\`` and ``\\xNN`` (a byte, two hex digits) are replaced; any other backslash, and one
    at the very end, stays as written. The bytes are read back as UTF-8 (a ``\\xNN`` that
    leaves an incomplete character becomes U+FFFD)."""
    if "\\" not in text:
        return text
    src = text.encode("utf-8", "surrogatepass")
    out = bytearray()
    simple = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"',
              ord("\\"): b"\\"}
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == 0x5C and i + 1 < n:
            i += 1
            e = src[i]
            if e in simple:
                out += simple[e]
            elif e == ord("x") and i + 2 < n and all(chr(h) in string.hexdigits for h in src[i + 1:i + 3]):
                out.append(int(src[i + 1:i + 3], 16))
                i += 2
            else:
                out += bytes((0x5C, e))
        else:
            out.append(c)
        i += 1
    return out.decode("utf-8", "replace")


def prompt_file_limit(ctx_size: int | None) -> int:
    """Most bytes a prompt file for a context of ``ctx_size`` tokens (0/None: the default) may hold."""
    return PROMPT_BYTES_PER_TOKEN * max(ctx_size or DEFAULT_CTX_FOR_LIMIT, DEFAULT_CTX_FOR_LIMIT)


def read_text_file(path: str, limit: int, what: str = "file",
                   hint: str = "shorten it or raise -c/--ctx-size") -> str:
    """The UTF-8 text of ``path``, reading at most ``limit`` bytes (a file such as /dev/zero never
    ends). Raises PyinferError when it cannot be read, is not UTF-8 or holds more than ``limit``."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise PyinferError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise PyinferError(f"{what} {path} is larger than {limit} bytes; {hint}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PyinferError(f"cannot read {what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@contextlib.contextmanager
def stop_signals_interrupt():
    """While inside (main thread), SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does, so
    that a ``kill`` or a closed terminal runs the same cleanup (a temporary file removed) instead
    of ending the process where it stands; signals the caller ignores stay ignored. Yields a
    one-item list that holds the signal's number once one came (its exit status: 128 + it)."""
    import signal
    import threading

    came: list = [None]
    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        came[0] = signum
        raise KeyboardInterrupt

    old = [signal.getsignal(s) for s in sigs]
    for s, was in zip(sigs, old):
        if was is not signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield came
    finally:
        for s, was in zip(sigs, old):
            signal.signal(s, was)


@contextlib.contextmanager
def signals_held():
    """SIGINT, SIGTERM and SIGHUP held back (blocked) for the block, in the main thread; one that came
    meanwhile is delivered as the block ends. Elsewhere (another thread) a plain block."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM} | ({signal.SIGHUP} if hasattr(signal, "SIGHUP") else set())
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def temp_path_beside(path: str, suffix: str = ".tmp") -> str:
    """A new, empty file of a unique name in ``path``'s directory (``.<name>.<random><suffix>``),
    so that a rename onto ``path`` is atomic and no file of the user's is overwritten or removed.
    Its mode is what a plain ``open(path, "w")`` would give (mkstemp's is 0600).
    Raises PyinferError when the directory does not take a new file."""
    directory, name = os.path.split(os.path.abspath(path))
    # (a name near the 255-byte limit: the temporary one is cut, so that any legal name works)
    room = 255 - len(".") - len(".") - 8 - len(suffix.encode())
    while len(name.encode("utf-8", "surrogateescape")) > room:
        name = name[:-1]
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix, dir=directory)
    except OSError as e:
        raise PyinferError(f"cannot create a file in {directory}: {e.strerror or e}") from None
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return tmp


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``error:`` line and exit status 1 (not usage + 2),
    and takes no abbreviated flags (llama.cpp takes none: ``--chat-template`` was read as
    pyinfer's ``--chat-template-kwargs``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(1, f"error: {message} (see {self.prog} --help)\n")


def add_version(p: argparse.ArgumentParser) -> None:
    """``--version``: print ``<prog> <pyinfer version>`` and exit 0 (as llama.cpp's tools do)."""
    from pyinfer import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__} (pyinfer)")


def add_model(p: argparse.ArgumentParser, what: str = "GGUF written by pyinfer-convert") -> None:
    """The model as a positional argument or ``-m/--model`` (llama.cpp spells it -m); read it
    back with ``model_path(args)``."""
    p.add_argument("model", nargs="?", help=what)
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="same as the positional MODEL")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The device and FFN flags shared by pyinfer-run/-chat and pyinfer-serve (llama.cpp's names
    where llama.cpp has the flag: -ngl)."""
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="auto: the GPU when CuPy sees one (default), cpu, or cuda")
    p.add_argument("--vram-budget", type=arg_type("vram_budget"), default=None,
                   help="GiB of GPU memory for hot neurons")
    p.add_argument("--reset-gpu-index", action="store_true",
                   help="re-solve the hot-neuron split from the file's activation counts")
    p.add_argument("--disable-gpu-index", action="store_true",
                   help="ignore the stored hot-neuron split; offload whole layers instead")
    p.add_argument("-ngl", "--n-gpu-layers", type=arg_type("n_gpu_layers"), default=None,
                   help="llama.cpp-style baseline: the first N layers' FFNs dense on the GPU")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up pass at load (llama.cpp's flag: without it the first "
                        "prompt's timing includes the memory map's page faults)")
    p.add_argument("--dense", action="store_true",
                   help="no sparsity: every FFN neuron (the file's predictors unused) and, in a "
                        "sparse mode input file, every input channel of every projection and "
                        "of the lm head")


def model_path(args, usage: str) -> str:
    """The model path given as ``-m`` or positionally. Raises PyinferError when both name
    different files or neither is given (``usage`` is shown as the fix)."""
    pos, opt = getattr(args, "model", None), getattr(args, "model_opt", None)
    if pos and opt and pos != opt:
        raise PyinferError(f"two models given ({opt} with -m and {pos}); give one")
    if not (pos or opt):
        raise PyinferError(f"no model given: {usage}")
    return opt or pos


def warn_past_training(n_ctx: int, n_train: int) -> None:
    """The notice llama.cpp gives for a context longer than the model's training context
    (positions past it are extrapolated), on stderr; nothing otherwise."""
    if n_ctx > n_train:
        print(f"pyinfer: -c {n_ctx} is more than the {n_train} tokens the model was trained "
              "on; text past that may degrade", file=sys.stderr)
