"""Token sampling: a pure function of (logits, params, rng, recent tokens).

Order as llama.cpp's default chain (common/sampling.cpp): repetition penalty -> top-k -> top-p ->
min-p -> temperature -> draw. Temperature <= 0 is greedy (argmax after the penalty).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; top_k <= 0 and top_p >= 1 and min_p <= 0 disable those filters."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1.0 is off
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at

    def __post_init__(self):
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        if not 0.0 <= self.min_p <= 1.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1] and min_p in [0, 1]")


def apply_repeat_penalty(logits: np.ndarray, recent, penalty: float) -> np.ndarray:
    """CTRL-style penalty (Keskar et al. 2019, as llama.cpp applies it): for each token seen in
    ``recent``, a positive logit is divided by ``penalty`` and a negative one multiplied by it.
    Returns a new array; ``logits`` (n_vocab,) float32 is not modified."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty != 1.0 and len(recent):
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        vals = out[ids]
        out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def distribution(logits: np.ndarray, params: SamplingParams, recent=(),
                 allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The distribution the sampler draws from: (token ids (k,) int64 best first, probabilities
    (k,) float64 summing to 1). Greedy (temperature <= 0) gives the one best token.

    The chain is llama.cpp's (``common/sampling.cpp``, ``src/llama-sampling.cpp``): the repetition
    penalty on ``recent``; top-k; softmax; top-p keeps the smallest prefix whose mass reaches
    top_p; min-p keeps tokens with p >= min_p * p_max; then softmax of logit / temperature over
    what is left. ``allowed`` (n_vocab,) bool: a grammar's mask, applied first (tokens outside it
    are never drawn). Raises ValueError for a mask that allows no token.
    """
    z = apply_repeat_penalty(logits, recent, params.repeat_penalty)
    if allowed is not None:
        if not allowed.any():
            raise ValueError("the grammar allows no token")
        z[~allowed] = -np.inf
    if params.temperature <= 0:
        return np.array([int(np.argmax(z))]), np.ones(1)

    # Candidates sorted by logit, best first; the filters only ever cut the tail.
    n_ok = z.shape[0] if allowed is None else int(np.count_nonzero(allowed))
    if 0 < params.top_k < n_ok:
        cand = np.argpartition(-z, params.top_k - 1)[:params.top_k]
    elif allowed is not None:
        cand = np.flatnonzero(allowed)
    else:
        cand = np.arange(z.shape[0])
    cand = cand[np.argsort(-z[cand], kind="stable")]
    cz = z[cand].astype(np.float64)
    p = np.exp(cz - cz[0])
    p /= p.sum()
    keep = cand.shape[0]
    if params.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(p), params.top_p) + 1))
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(p[:keep] >= params.min_p * p[0]))))
    cz = cz[:keep] / params.temperature
    p = np.exp(cz - cz[0])
    return cand[:keep].astype(np.int64), p / p.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           recent=(), allowed: np.ndarray | None = None) -> int:
    """Pick the next token id from ``logits`` (n_vocab,) float32: a draw from ``distribution``.

    ``recent`` holds the ids the repetition penalty applies to (the caller passes the last
    ``params.repeat_last_n`` tokens); ``allowed``: a grammar's mask (see ``distribution``).
    Deterministic for a seeded ``rng``.
    """
    ids, p = distribution(logits, params, recent, allowed)
    if params.temperature <= 0:
        return int(ids[0])
    return int(ids[rng.choice(ids.shape[0], p=p)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of every token under the model, before any sampling filter: (n_vocab,) float64.
    What OpenAI's ``logprobs`` report."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))
