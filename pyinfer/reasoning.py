"""A chat answer's thinking block apart from its content, as llama.cpp's server returns them.

Reasoning models (Qwen3, DeepSeek-R1 and its distillations, SmolLM3 ...) write their thoughts
between ``<think>`` and ``</think>`` before the answer; some chat templates open the block in
the prompt itself (the generation prompt ends with ``<think>``), so the answer holds only the
closing tag. llama.cpp's server (``--reasoning-format deepseek``, and ``auto``, its default)
returns the block's text as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``) and the rest as ``content``, both with the whitespace around the
tags trimmed; ``none`` leaves the text as the model wrote it.

``ReasoningSplitter`` does this on a stream of text pieces: it holds back only what could still
be part of a tag (or whitespace that trimming may drop), so the reasoning streams as it is
written.
"""
from __future__ import annotations

from pyinfer.errors import PyinferError

OPEN, CLOSE = "<think>", "</think>"
#: the whitespace trimmed around the tags: ASCII's, as llama.cpp's parser (``std::isspace`` over
#: UTF-8 bytes) trims it; Python's ``str.strip()`` would drop U+3000, U+00A0 ... too
_WS = " \t\n\v\f\r"
#: --reasoning-format / ``reasoning_format`` values (llama.cpp's names): "none" leaves the text
#: as it is, "deepseek" and "auto" split the thinking block off
REASONING_FORMATS = ("none", "deepseek", "auto")


def check_format(value) -> str:
    """``value`` if it is one of REASONING_FORMATS; PyinferError (one line) otherwise."""
    if value not in REASONING_FORMATS:
        raise PyinferError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, "
                           f"got {value!r}")
    return value


def opens_thinking(prompt_text: str) -> bool:
    """True where a rendered prompt ends inside an open thinking block (its generation prompt
    ends with ``<think>`` and whitespace, as DeepSeek-R1's template writes it)."""
    return prompt_text.rstrip(_WS).endswith(OPEN)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag cut by the stream)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits a streamed answer into (kind, text) pieces, kind "reasoning" or "content".

    in_thinking: the prompt opened the block (``opens_thinking``). ``feed(piece)`` returns the
    pieces now decided; ``flush()`` those left at the end of the answer (an unclosed block is
    all reasoning). ``consumed``: characters of the answer decided so far (given out or
    dropped: tags, trimmed whitespace), for aligning logprobs with what was sent."""

    def __init__(self, in_thinking: bool = False):
        self.state = "think" if in_thinking else "start"
        self.buf = ""  # undecided characters of the answer
        self.consumed = 0
        self.think_started = False  # a non-space character of the reasoning was given out
        self.content_started = False  # (after the block) a non-space character of the content
        self.ws_only = True  # buf is only whitespace: more whitespace decides nothing
        self.ws_run: list[str] = []  # whitespace pieces after buf, joined when something comes

    def _take(self, n: int) -> str:
        out, self.buf = self.buf[:n], self.buf[n:]
        self.consumed += n
        return out

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if self.ws_only and self.state != "content" and not piece.strip(_WS):
            self.ws_run.append(piece)  # (held, not scanned again: a long run stays linear)
            return []
        self.buf += "".join(self.ws_run) + piece
        self.ws_run = []
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":  # before the answer's first non-space character
                s = self.buf.lstrip(_WS)
                if not s or (len(s) < len(OPEN) and OPEN.startswith(s)):
                    break  # could still be "<think>"
                if s.startswith(OPEN):
                    self._take(len(self.buf) - len(s) + len(OPEN))
                    self.state = "think"
                else:
                    self.state = "content"
                    self.content_started = True  # no block: the answer as written
            elif self.state == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    text = self._take(i).rstrip(_WS)
                    self._take(len(CLOSE))
                    self.state = "content"
                else:  # all but a possible cut tag, and the whitespace a tag may follow
                    keep = partial_suffix(self.buf, CLOSE)
                    body = self.buf[:len(self.buf) - keep]
                    text = self._take(len(body.rstrip(_WS)))
                    if not text:
                        break
                if not self.think_started:
                    text = text.lstrip(_WS)
                    self.think_started = bool(text)
                if text:
                    out.append(("reasoning", text))
                if self.state == "think":
                    break
            else:
                if not self.content_started:  # whitespace after the block is trimmed
                    s = self.buf.lstrip(_WS)
                    self._take(len(self.buf) - len(s))
                    if not s:
                        break
                    self.content_started = True
                out.append(("content", self._take(len(self.buf))))
        # (what is held after a piece with other characters is short: a cut tag, the piece's
        # trailing whitespace)
        self.ws_only = not self.buf.strip(_WS)
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is left at the end of the answer: held-back text as written ("start": the
        answer was only spaces or the start of a tag), the rest of an unclosed block."""
        self.buf += "".join(self.ws_run)
        self.ws_run = []
        rest = self._take(len(self.buf))
        if self.state == "think":
            text = rest.rstrip(_WS) if self.think_started else rest.strip(_WS)
            return [("reasoning", text)] if text else []
        if self.state == "start":
            return [("content", rest)] if rest else []
        return [("content", rest)] if rest and self.content_started else []


def split_reasoning(text: str, in_thinking: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole answer (``ReasoningSplitter`` over one piece)."""
    sp = ReasoningSplitter(in_thinking)
    parts = sp.feed(text) + sp.flush()
    return ("".join(t for k, t in parts if k == "reasoning"),
            "".join(t for k, t in parts if k == "content"))
