"""pyinfer-chat (``pyinfer-run -i``): an interactive chat in the terminal.

Each turn renders the whole conversation with the GGUF's chat template; the engine keeps the
previous turns in its KV cache and evaluates only the new tokens (the previous answer's rows as
the decode kernels wrote them: a replay of the same conversation through the API, which
evaluates them again batched, can answer differently). Answers stream as they are
generated and end at the model's end-of-turn token. Ctrl-C stops an answer (and clears a half-typed
line), Ctrl-D or /exit leaves; readline gives line editing and history. When the conversation
outgrows the context the oldest turns are dropped (the system message stays). Text typed while
an answer streams is kept (neither echoed into the answer nor dropped by Ctrl-C) and starts the
next message.
"""
from __future__ import annotations

import io
import os
import signal
import sys
from contextlib import contextmanager

from pyinfer.api import LLM, GenerationStats
from pyinfer.errors import PyinferError

HELP = """commands:
  /help    this text
  /reset   start a new conversation (the system message stays)
  /stats   speed and sparsity of the last answer
  /exit    leave (or Ctrl-D)
Ctrl-C stops the current answer. End a line with \\ to continue it on the next line;
start it with // to send a message that begins with /."""
PROMPT = "> "


class ChatSession:
    """A conversation over an ``LLM``: the messages, fitted into the context turn by turn.

    Args:
        llm: the loaded model.
        system: system message kept at the start of every prompt (None: the template's default).
        max_tokens: longest answer in tokens (None: until end of turn or a full context).
        sampling: keyword arguments for ``LLM.stream_text`` (temperature, top_k, ...).
    """

    def __init__(self, llm: LLM, system: str | None = None, max_tokens: int | None = None,
                 **sampling):
        self.llm = llm
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.messages: list[dict] = []
        self.last_dropped = 0
        self.reset()
        if system is not None:  # a system message that leaves no room for any message
            n = len(llm.chat_tokens(self.messages + [{"role": "user", "content": ""}]))
            if n >= llm.n_ctx:
                raise PyinferError(f"the system message is {n} tokens with the template, more "
                                   f"than the context ({llm.n_ctx}); raise -c/--ctx-size or "
                                   "shorten it")

    def reset(self) -> None:
        """Forget the conversation. The KV cache is kept: the next prompt reuses the shared
        prefix (template header, system message) and overwrites the rest."""
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def _reserve(self) -> int:
        """Tokens kept free for the answer when fitting the prompt."""
        n_ctx = self.llm.n_ctx
        want = self.max_tokens if self.max_tokens else n_ctx // 4
        return max(1, min(want, n_ctx // 2))

    def fit(self, messages: list[dict]) -> tuple[list[int], int]:
        """Token ids of ``messages`` with room for an answer, dropping the oldest turns (never the
        system message nor the last user message) until they fit. Returns (ids, messages dropped)
        and trims ``messages`` in place. Raises PyinferError when the last message alone is too long."""
        n_sys = 1 if messages and messages[0]["role"] == "system" else 0
        dropped = 0
        limit = self.llm.n_ctx - self._reserve()
        while True:
            ids = self.llm.chat_tokens(messages)
            if len(ids) <= limit:
                return ids, dropped
            if len(messages) - n_sys <= 1:
                if len(ids) < self.llm.n_ctx:  # no room for a full answer, but some
                    return ids, dropped
                what = "the system message and the message are" if n_sys else "the message is"
                than = "more than" if len(ids) > self.llm.n_ctx else "as long as"
                raise PyinferError(f"{what} {len(ids)} tokens with the template, {than} "
                                   f"the context ({self.llm.n_ctx}), which leaves no room for an "
                                   "answer; raise -c/--ctx-size")
            # drop the oldest turn: a user message and the assistant answers after it
            del messages[n_sys]
            dropped += 1
            while len(messages) - n_sys > 1 and messages[n_sys]["role"] != "user":
                del messages[n_sys]
                dropped += 1

    def ask(self, text: str, on_text=lambda s: None, should_stop=None) -> GenerationStats:
        """Add a user message, stream the answer through ``on_text``, keep it in the conversation.

        ``should_stop`` (callable) ends the answer early; the part said so far is kept.
        Returns the answer's GenerationStats; ``self.last_dropped`` says how many old messages
        were dropped to fit it.
        Raises PyinferError (conversation unchanged) when the message cannot fit at all; a
        KeyboardInterrupt before the first token (rendering, evaluating the prompt) leaves the
        conversation unchanged too, and the KV cache holds the prompt's batches evaluated so
        far (the next turn reuses them).
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids, dropped = self.fit(messages)
        parts = []
        early = False
        # the turn reuses the previous answer's cache rows as the decode kernels wrote them: the
        # answer starts sooner, but may differ from a fresh replay of the conversation (the
        # LLM's other callers keep the exact rule)
        engine = self.llm.engine
        engine.reuse_decoded_rows = True
        try:  # the answer ends at -n or where the context is full, as pyinfer-run's does
            for piece in self.llm.stream_text(ids, max_tokens=self.max_tokens,
                                              should_stop=should_stop, **self.sampling):
                parts.append(piece)
                on_text(piece)
        except KeyboardInterrupt:
            early = not parts  # (before any text: see _sigint_sets_flag; after, the turn is kept)
            raise
        finally:
            engine.reuse_decoded_rows = False
            if not early:  # kept even when interrupted, so the conversation matches what was said
                messages.append({"role": "assistant", "content": "".join(parts)})
                self.messages = messages
        self.last_dropped = dropped
        return self.llm.last_stats


def cut_notice(session: ChatSession, s: GenerationStats) -> str:
    """Why an answer ended before its end-of-turn token: the -n cap or a full context."""
    if session.max_tokens and s.completion_tokens >= session.max_tokens:
        return (f"[answer cut at {s.completion_tokens} tokens (-n {session.max_tokens}); "
                "say 'go on' to continue, or raise -n]")
    return f"[answer cut: the context ({session.llm.n_ctx} tokens) is full; /reset or raise -c]"


def format_stats(s: GenerationStats) -> str:
    reused = s.prompt_tokens - s.prompt_evaluated
    return (f"[prompt: {s.prompt_evaluated} tokens evaluated, {reused} reused from the cache; "
            f"answer: {s.completion_tokens} tokens, {s.tokens_per_second:.1f} tokens/s; "
            f"{s.sparsity_label} {100 * s.ffn_sparsity:.1f}%]")


@contextmanager
def _sigint_sets_flag(flag: list, generating: list | None = None):
    """While inside, Ctrl-C sets ``flag[0]`` instead of raising, so an answer stops between two
    tokens and the engine's cache bookkeeping is never cut in half. Until ``generating[0]`` is
    True (rendering the template, evaluating the prompt) there is no token to stop at: Ctrl-C
    raises KeyboardInterrupt there: the message is not sent (``ChatSession.ask`` leaves the
    conversation unchanged; the cache keeps the prompt batches already evaluated)."""
    def handler(signum, frame):
        if generating is not None and not generating[0]:
            raise KeyboardInterrupt
        flag[0] = True
    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no signal handling, nothing to restore
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextmanager
def _keep_typeahead(stream=None):
    """While an answer streams, text the user types is kept for the next message: the terminal
    stops echoing it into the answer (``ECHO`` off), Ctrl-C no longer discards it (``NOFLSH``:
    without it the terminal flushes pending input on SIGINT, POSIX termios), and it is raw
    (``ICANON`` off: a canonical line holds at most 4,095 bytes, and a longer paste was cut).
    It waits in the terminal's queue, and readline reads it as the start of the next message;
    a Ctrl-D typed meanwhile is a byte there, which readline reads as the end of input on an
    empty line (the chat ends after the answer, as at the prompt). The settings are restored
    with ``TCSADRAIN``, which keeps pending input (``TCSAFLUSH`` would drop it). Does nothing
    when ``stream`` (default stdin) is not a terminal or termios is missing (Windows).

    Yields ``eof``, a one-item list set to True at the end where the terminal holds a canonical
    end of input (``_eof_pending``: a terminal whose mode another program left canonical); in
    the raw mode set here Ctrl-D reaches readline instead."""
    stream = sys.stdin if stream is None else stream
    eof = [False]
    try:
        import termios

        fd = stream.fileno()
        if not os.isatty(fd):
            raise OSError
        old = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):  # io.UnsupportedOperation too
        yield eof
        return
    new = list(old)
    # (ICANON off too: in canonical mode the terminal keeps at most 4,095 bytes of a line and
    # dropped the rest of a longer paste; raw, a full queue holds the writer back instead)
    new[3] = (new[3] & ~(termios.ECHO | termios.ICANON)) | termios.NOFLSH  # lflag
    new[6] = list(new[6])
    new[6][termios.VMIN], new[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSADRAIN, new)
    try:
        yield eof
    finally:
        try:
            eof[0] = _eof_pending(fd)
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _eof_pending(fd: int) -> bool:
    """True (and the end of input consumed) where the terminal, in canonical mode, holds an end of
    input and nothing before it: ``fd`` is readable (select) with no byte queued (FIONREAD 0).
    Typed text, a whole line or a part ended by Ctrl-D, stays for readline."""
    import fcntl
    import select
    import struct
    import termios

    try:
        if not select.select([fd], [], [], 0)[0]:
            return False
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        return queued == 0 and os.read(fd, 1) == b""
    except OSError:
        return False


def _input(prompt: str) -> str:
    """``input(prompt)`` on a terminal (readline's editing); from a pipe or file, one line of
    bytes decoded alone, so that a line that is not UTF-8 (UnicodeDecodeError) costs only
    itself (the text layer decodes 8 KiB blocks: the lines around it went too)."""
    if not isinstance(sys.stdin, io.TextIOWrapper) or sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    raw = sys.stdin.buffer.readline()
    if not raw:
        raise EOFError
    return raw.decode("utf-8").removesuffix("\n").removesuffix("\r")  # (CRLF as input() reads it)


def _read_message(prompt: str) -> str:
    """One message from the terminal; a line ending with a backslash continues on the next (end
    of input there ends the message: it is not dropped)."""
    lines = []
    line = _input(prompt)
    while line.endswith("\\"):
        lines.append(line[:-1])
        try:
            line = _input("")
        except EOFError:
            return "\n".join(lines)
    lines.append(line)
    return "\n".join(lines)


def repl(session: ChatSession, verbose: bool = False, out=sys.stdout, err=sys.stderr) -> int:
    """Read-eval-print loop over ``session`` until /exit or end of input. Returns 0."""
    try:
        import readline  # noqa: F401 - importing it gives input() line editing and history
    except ImportError:  # not on every platform (Windows)
        pass
    last: GenerationStats | None = None
    while True:
        try:
            text = _read_message(PROMPT)
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as a shell does
            print("^C", file=out)
            continue
        except UnicodeDecodeError:  # a strict stdin decoder met bytes that are not UTF-8
            print("error: the message is not valid UTF-8", file=err)
            continue
        cmd = text.strip()
        if not cmd:
            continue
        if cmd.startswith("//"):  # an escaped slash: the message itself begins with "/"
            text = text.lstrip()[1:]
        elif cmd.startswith("/"):
            name = cmd.split()[0]
            if name in ("/exit", "/quit"):
                return 0
            if name == "/help":
                print(HELP, file=err)
            elif name == "/reset":
                session.reset()
                print("[new conversation]", file=err)
            elif name == "/stats":
                print(format_stats(last) if last else "[no answer yet]", file=err)
            else:
                print(f"[unknown command {name}; /help lists them; start a message with // to "
                      "send text that begins with /]", file=err)
            continue
        stop, generating = [False], [False]

        def show(piece):
            out.write(piece)
            out.flush()

        def should_stop():  # called after every token: from the first one on, Ctrl-C only sets stop
            generating[0] = True
            return stop[0]
        typed_eof = [False]  # end of input typed while the answer streamed (_keep_typeahead)
        try:
            with _sigint_sets_flag(stop, generating), _keep_typeahead() as typed_eof:
                last = session.ask(text, show, should_stop=should_stop)
        except PyinferError as e:
            print(f"error: {e}", file=err)
            if typed_eof[0]:
                return 0
            continue
        except KeyboardInterrupt:  # while rendering or evaluating the prompt: nothing said
            print("\n[interrupted: the message was not sent]", file=err)
            if typed_eof[0]:
                return 0
            continue
        print(file=out)
        if session.last_dropped:
            print(f"[the conversation outgrew the context ({session.llm.n_ctx} tokens): dropped the "
                  f"{session.last_dropped} oldest messages]", file=err)
        if last.interrupted:
            print("[interrupted]", file=err)
        elif last.finish_reason == "length":
            print(cut_notice(session, last), file=err)
        if verbose:
            print(format_stats(last), file=err)
        if typed_eof[0]:  # Ctrl-D typed while the answer streamed: end, as at the prompt
            return 0


def describe_settings(session: ChatSession) -> str:
    """One line with the sampling chain's settings and the answer cap, as llama.cpp prints its
    sampler parameters at start-up."""
    sp = session.sampling
    if sp.get("temperature", 0.8) <= 0:
        chain = "greedy (temp 0)"
    elif sp.get("top_p", 0.95) <= 0:  # (options.sampling: top-p 0 is greedy, as OpenAI's)
        chain = "greedy (top-p 0)"
    else:
        chain = (f"temp {sp.get('temperature', 0.8):.2f}, top-k {sp.get('top_k', 40)}, "
                 f"top-p {sp.get('top_p', 0.95):.2f}, min-p {sp.get('min_p', 0.05):.2f}")
    rp = sp.get("repeat_penalty", 1.0)
    rn = sp.get("repeat_last_n", 64)
    penalty = (f"repeat-penalty {rp:.2f} over "
               f"{'the whole context' if rn < 0 else f'the last {rn} tokens'}"
               if rp != 1.0 and rn != 0 else "no repeat penalty")
    dm = sp.get("dry_multiplier", 0.0)
    if dm > 0 and sp.get("dry_penalty_last_n", -1) != 0:  # (last-n 0: DRY off, as llama.cpp)
        last_n = sp.get("dry_penalty_last_n", -1)
        penalty += (f", DRY {dm:g} (base {sp.get('dry_base', 1.75):g}, allowed length "
                    f"{sp.get('dry_allowed_length', 2)}, "
                    f"{'whole context' if last_n < 0 else f'last {last_n} tokens'})")
    else:
        penalty += ", no DRY"
    cap = f"answers capped at {session.max_tokens} tokens (-n)" if session.max_tokens else \
        "answers not capped (-n -1)"
    if sp.get("stop"):
        cap += "; halted at " + ", ".join(repr(s) for s in sp["stop"]) + " (-r)"
    return f"sampling: {chain}, {penalty}; {cap}"


if __name__ == "__main__":  # python -m pyinfer.repl is pyinfer-chat (its flags live in cli.py)
    from pyinfer.cli import chat_main

    sys.exit(chat_main())
