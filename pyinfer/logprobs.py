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


class LogprobRecorder:
    """Collects (token, logprob, [(alt token, alt logprob)] best first) per generated token.

    Args:
        tokenizer: the model's ``pyinfer.tokenizer.Tokenizer`` (for token text and bytes).
        n_top: alternatives kept per token, 0..MAX_TOP_LOGPROBS.
    """

    def __init__(self, tokenizer, n_top: int = 0):
        self.tok = tokenizer
        self.n_top = int(n_top)
        self._last = None
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._taken = 0

    def on_token(self, logits: np.ndarray, token: int) -> None:
        lp = log_softmax(logits)  # (n_vocab,) float64
        top: list[tuple[int, float]] = []
        if self.n_top > 0:
            ids = np.argpartition(-lp, self.n_top - 1)[:self.n_top]
            ids = ids[np.argsort(-lp[ids], kind="stable")]
            top = [(int(i), float(lp[i])) for i in ids]
        self._last = (int(token), float(lp[token]), top)

    def commit(self) -> None:
        if self._last is not None:
            self.entries.append(self._last)
            self._last = None

    def take(self) -> list:
        """Entries committed since the previous ``take``."""
        out = self.entries[self._taken:]
        self._taken = len(self.entries)
        return out

    def trim(self, n_chars: int) -> None:
        """Drop the last entries not yet taken while the committed tokens' text is longer than
        ``n_chars``, the answer's length after a stop string cut it: the stop string's tokens get
        no log-probabilities (llama.cpp's server trims them too), so the tokens' text is the
        answer's (or, where a token straddles the cut, a prefix of it)."""
        total = sum(len(self._text(t)) for t, _, _ in self.entries)
        while len(self.entries) > self._taken and total > n_chars:
            total -= len(self._text(self.entries.pop()[0]))

    # ---- OpenAI shapes ----------------------------------------------------------------------
    def _text(self, t: int) -> str:
        return self.tok.token_to_piece(t)

    def chat_content(self, entries) -> list[dict]:
        """Chat completions' ``logprobs.content``: ``[{"token", "logprob", "bytes",
        "top_logprobs": [{"token", "logprob", "bytes"}]}]``."""
        def one(t, lp):
            return {"token": self._text(t), "logprob": lp, "bytes": list(self.tok.token_to_bytes(t))}

        return [dict(one(t, lp), top_logprobs=[one(a, alp) for a, alp in top]) for t, lp, top in entries]

    def completion(self, entries, text_offset: int = 0) -> dict:
        """Completions' (legacy) ``logprobs``: ``{"tokens", "token_logprobs", "top_logprobs",
        "text_offset"}``; offsets count characters from ``text_offset``."""
        tokens = [self._text(t) for t, _, _ in entries]
        offsets, pos = [], text_offset
        for piece in tokens:
            offsets.append(pos)
            pos += len(piece)
        top = []
        for _, _, alts in entries:  # best first; tokens that print alike keep the best one's value
            d: dict[str, float] = {}
            for a, alp in alts:
                d.setdefault(self._text(a), alp)
            top.append(d)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": top, "text_offset": offsets}
