"""Log-probabilities of generated tokens in OpenAI's two shapes.

The log-probability of a token is log softmax of the model's logits at that step, before any
sampling filter, penalty or grammar (what OpenAI's ``logprobs`` report; llama.cpp's server reports
the same with ``post_sampling_probs`` off). ``LogprobRecorder.on_token`` is the engine's hook
(``Engine.generate(on_token=...)``); ``commit`` keeps the entry of a token that was yielded (the
stop token is never committed), ``take`` hands over what was committed since the last call.
"""
from __future__ import annotations

import numpy as np

from pyinfer.sampler import log_softmax

#: Most alternatives per token (OpenAI's top_logprobs maximum).
MAX_TOP_LOGPROBS = 20


def token_text(tokenizer, token: int) -> str:
    """A token's text for the ``token`` fields: its UTF-8 text, or, where its bytes are not
    whole UTF-8 characters (one byte of an emoji), ``"bytes:\\xf0\\x9f"`` (OpenAI's form for
    such tokens; the ``bytes`` fields hold the numbers)."""
    b = tokenizer.token_to_bytes(token)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


class LogprobRecorder:
    """Collects (token, logprob, [(alt token, alt logprob)] best first) per generated token, and
    where each token's text lies in the answer.

    Args:
        tokenizer: the model's ``pyinfer.tokenizer.Tokenizer`` (for token text and bytes).
        n_top: alternatives kept per token, 0..MAX_TOP_LOGPROBS.
    """

    def __init__(self, tokenizer, n_top: int = 0):
        self.tok = tokenizer
        self.n_top = int(n_top)
        self._last = None
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        # characters of the answer before and after each entry's token, as the decoder that
        # makes the answer's text gave them (a split character counts where its last byte
        # arrives)
        self.spans: list[tuple[int, int]] = []
        self._chars = 0
        self._taken = 0

    def on_token(self, logits: np.ndarray, token: int) -> None:
        lp = log_softmax(logits)  # (n_vocab,) float64
        top: list[tuple[int, float]] = []
        if self.n_top > 0:
            ids = np.argpartition(-lp, self.n_top - 1)[:self.n_top]
            ids = ids[np.argsort(-lp[ids], kind="stable")]
            top = [(int(i), float(lp[i])) for i in ids]
        self._last = (int(token), float(lp[token]), top)

    def commit(self, n_chars: int) -> None:
        """Keep the entry of the token just yielded; ``n_chars``: the characters of answer text
        its decoding gave (``StreamDecoder.feed``, 0 for part of a character)."""
        if self._last is not None:
            self.entries.append(self._last)
            self.spans.append((self._chars, self._chars + n_chars))
            self._chars += n_chars
            self._last = None

    def take(self, upto: int | None = None) -> list:
        """Entries committed since the previous ``take``, each with its (start, end) span; with
        ``upto`` (characters of the answer sent so far) only those whose text ends within it: a
        stream must not hand out a token whose text is still held back (it may be cut by a stop
        string, and ``trim`` then drops it)."""
        end = len(self.entries)
        if upto is not None:
            end = self._taken
            while end < len(self.entries) and self.spans[end][1] <= upto:
                end += 1
        out = list(zip(self.entries[self._taken:end], self.spans[self._taken:end]))
        self._taken = end
        return out

    def trim(self, n_chars: int) -> None:
        """Drop the last entries not yet taken whose text does not lie within the first
        ``n_chars`` characters, the answer's length after a stop string cut it: the stop string's
        tokens get no log-probabilities (llama.cpp's server trims them too), so the tokens' text is
        the answer's (or, where a token straddles the cut, a prefix of it)."""
        while len(self.entries) > self._taken and (self.spans[-1][1] > n_chars
                                                   or self.spans[-1][0] >= n_chars):
            self.entries.pop()
            self.spans.pop()

    # ---- OpenAI shapes ----------------------------------------------------------------------
    def _text(self, t: int) -> str:
        return token_text(self.tok, t)

    def chat_content(self, taken) -> list[dict]:
        """Chat completions' ``logprobs.content`` of ``take()``'s entries: ``[{"token",
        "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]``."""
        def one(t, lp):
            return {"token": self._text(t), "logprob": lp, "bytes": list(self.tok.token_to_bytes(t))}

        return [dict(one(t, lp), top_logprobs=[one(a, alp) for a, alp in top])
                for (t, lp, top), _ in taken]

    def completion(self, taken) -> dict:
        """Completions' (legacy) ``logprobs`` of ``take()``'s entries: ``{"tokens",
        "token_logprobs", "top_logprobs", "text_offset"}``; an offset is the character of the
        answer where the token's text begins (the tokens of a split character share one)."""
        top = []
        for (t, lp, alts), _ in taken:  # best first; tokens that print alike keep the best one's
            d: dict[str, float] = {}
            for a, alp in alts:
                d.setdefault(self._text(a), alp)
            # OpenAI: "the API will always return the logprob of the sampled token, so there may
            # be up to logprobs+1 elements" (llama-cpp-python adds it too)
            d.setdefault(self._text(t), lp)
            top.append(d)
        return {"tokens": [self._text(t) for (t, _, _), _ in taken],
                "token_logprobs": [lp for (_, lp, _), _ in taken],
                "top_logprobs": top, "text_offset": [start for _, (start, _) in taken]}
