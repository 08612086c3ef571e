"""Token sampling: a pure function of (logits, params, rng, recent tokens).

Order as llama.cpp's default chain (common/sampling.cpp): repetition penalty -> DRY -> top-k ->
top-p -> min-p -> temperature -> draw. Temperature <= 0 is greedy (argmax after the penalties).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from pyinfer.errors import PyinferError
from pyinfer.ops import cpu


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; top_k <= 0 and top_p >= 1 and min_p <= 0 disable those filters."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1.0 is off
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at (-1: all, 0: none)
    # DRY ("don't repeat yourself", see dry_penalty); llama.cpp's defaults, multiplier 0 is off
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # tokens of history DRY scans; -1: the whole context

    def __post_init__(self):
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        if self.dry_multiplier < 0 or self.dry_base < 1 or self.dry_allowed_length < 1 \
                or self.dry_penalty_last_n < -1:
            raise ValueError("DRY needs multiplier >= 0, base >= 1, allowed_length >= 1 and "
                             "penalty_last_n >= -1")
        if not 0.0 <= self.min_p <= 1.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1] and min_p in [0, 1]")


def _penalty_applies(recent, penalty: float) -> bool:
    return penalty != 1.0 and len(recent) > 0


def _dry_applies(history, params: SamplingParams) -> bool:
    return params.dry_multiplier > 0 and params.dry_penalty_last_n != 0 and len(history) >= 2


def apply_repeat_penalty(logits: np.ndarray, recent, penalty: float) -> np.ndarray:
    """CTRL-style penalty (Keskar et al. 2019, as llama.cpp applies it): for each token seen in
    ``recent``, a positive logit is divided by ``penalty`` and a negative one multiplied by it.
    Returns a new array; ``logits`` (n_vocab,) float32 is not modified."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if _penalty_applies(recent, penalty):
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        vals = out[ids]
        # an extreme penalty (1e-300 rounds to 0 in f32, 1e300 to inf) saturates at the largest
        # f32 instead of making inf logits, whose differences are NaN probabilities
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            new = np.where(vals > 0, vals / penalty, vals * penalty)
        f32_max = np.finfo(np.float32).max
        out[ids] = np.clip(new, -f32_max, f32_max)
    return out


def dry_match_lengths(history, breakers=frozenset()) -> dict[int, int]:
    """For each token t that would continue a repetition, the length n of the longest run of
    tokens at the end of ``history`` that occurred earlier followed by t; n counts the repeated
    tokens before t, not t itself.

    That is DRY's match length (p-e-w, text-generation-webui PR #5677; llama.cpp
    ``llama_sampler_dry``): for an earlier position i with history[i-k] == history[-1-k] for
    k = 0..n-1, the token after it, t = history[i+1], gets n. Matching never crosses a sequence
    breaker (a token in ``breakers``), and a breaker is never penalised. Computed in O(len) with
    the Z-function of the reversed history: z[j] is how far the history read backwards from its
    end and from position len-1-j agree.
    """
    h = [int(t) for t in history]
    L = len(h)
    if L < 2 or h[-1] in breakers:
        return {}
    tail = 0  # tokens at the end before the last breaker: a match is at most this long
    while tail < L and h[L - 1 - tail] not in breakers:
        tail += 1
    r = h[::-1]
    z = [0] * L  # Z-function of r (Gusfield): z[j] = longest common prefix of r and r[j:]
    left = right = 0
    for j in range(1, L):
        if j < right:
            z[j] = min(right - j, z[j - left])
        while j + z[j] < L and r[z[j]] == r[j + z[j]]:
            z[j] += 1
        if j + z[j] > right:
            left, right = j, j + z[j]
    out: dict[int, int] = {}
    for j in range(1, L):  # position i = L-1-j; the token after it is h[i+1] = r[j-1]
        n = min(z[j], tail)
        t = r[j - 1]
        if n > 0 and t not in breakers and n > out.get(t, 0):
            out[t] = n
    return out


def apply_dry(logits: np.ndarray, history, params: SamplingParams,
              breakers=frozenset()) -> np.ndarray:
    """DRY in place on ``logits`` (n_vocab,) float32: each token whose match length n
    (``dry_match_lengths`` over the last ``dry_penalty_last_n`` tokens of ``history``, all with
    -1) is at least ``dry_allowed_length`` loses ``dry_multiplier * dry_base ** (n -
    dry_allowed_length)`` (the formula of p-e-w's DRY, as llama.cpp applies it). A multiplier of
    0 or a window of 0 does nothing. The exponent is capped so the penalty stays finite in f32."""
    if not _dry_applies(history, params):
        return logits
    if params.dry_penalty_last_n > 0:
        history = history[-params.dry_penalty_last_n:]
    # the penalty in logs, capped at 3e38 (f32's range): a tiny multiplier with a large base
    # overflowed (3e38 / 1e-300 to inf, then base ** e itself: OverflowError)
    log_m, log_b, log_max = np.log(params.dry_multiplier), np.log(params.dry_base), np.log(3e38)
    for t, n in _match_lengths(history, breakers, logits.shape[0]):
        if n >= params.dry_allowed_length and t < logits.shape[0]:
            e = n - params.dry_allowed_length
            logits[t] -= np.float32(np.exp(min(log_m + e * log_b, log_max)))
    return logits


class _DryScratch:
    """The compiled match's buffers for one vocabulary size: best (n_vocab,) int32 kept all
    zero between calls, and the breakers' mask of the last breaker set."""

    def __init__(self, n_vocab: int):
        self.best = np.zeros(n_vocab, np.int32)
        self.breakers = None
        self.mask = np.zeros(n_vocab, np.uint8)
        self.breakers_fit = True  # every breaker id is inside the vocabulary

    def use(self, breakers) -> bool:
        """The mask of ``breakers`` (rebuilt only when another set comes: an engine keeps its
        own, so once); False where a breaker lies outside the vocabulary (the reference then)."""
        if self.breakers is not breakers:
            b = np.fromiter(breakers, np.int64, len(breakers))
            self.breakers_fit = bool(b.size == 0 or (b.min() >= 0 and b.max() < self.mask.size))
            self.mask[:] = 0
            if self.breakers_fit and b.size:
                self.mask[b] = 1
            self.breakers = breakers
        return self.breakers_fit


_SCRATCH = threading.local()  # per thread: best is written during a call


def _match_lengths(history, breakers, n_vocab: int):
    """(token, match length) pairs of ``dry_match_lengths``, from the compiled match
    (``cpu.dry_match``: 11x the Python at 4,096 tokens of history, docs/benchmarks.md session
    40) where every id is inside the vocabulary, else from the reference."""
    h = np.asarray(history, dtype=np.int64)
    per_size = getattr(_SCRATCH, "by_size", None)
    if per_size is None:
        per_size = _SCRATCH.by_size = {}
    sc = per_size.get(n_vocab)
    if sc is None:
        sc = per_size[n_vocab] = _DryScratch(n_vocab)
    # (the breakers' range checked once per set, not a Python loop over them every token)
    if h.size < 2 or h.min() < 0 or h.max() >= n_vocab or not sc.use(breakers):
        return dry_match_lengths(history, breakers).items()
    toks = np.empty(h.size, np.int32)
    m = 0
    try:
        m = cpu.dry_match(h.astype(np.int32), sc.mask, sc.best, toks)
        lengths = sc.best[toks[:m]].copy()
    finally:  # (left dirty, every later step of this thread would read stale lengths)
        sc.best[toks[:m]] = 0
    return zip(toks[:m].tolist(), lengths.tolist())


def distribution(logits: np.ndarray, params: SamplingParams, recent=(),
                 allowed: np.ndarray | None = None, history=(),
                 breakers=frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """The distribution the sampler draws from: (token ids (k,) int64 best first, probabilities
    (k,) float64 summing to 1). Greedy (temperature <= 0) gives the one best token.

    The chain is llama.cpp's (``common/sampling.cpp``, ``src/llama-sampling.cpp``): the repetition
    penalty on ``recent``; top-k; softmax; top-p keeps the smallest prefix whose mass reaches
    top_p; min-p keeps tokens with p >= min_p * p_max; then softmax of logit / temperature over
    what is left. ``allowed`` (n_vocab,) bool: a grammar's mask, applied first (tokens outside it
    are never drawn). ``history``: the tokens DRY scans (``apply_dry``; the whole context so
    far), ``breakers``: DRY's sequence-breaker ids. Raises PyinferError for a mask that allows
    no token, or only tokens whose logit is -inf (e.g. the end of generation ignore_eos bans).
    """
    if allowed is None and not _penalty_applies(recent, params.repeat_penalty) and not _dry_applies(
            history, params):
        z = np.asarray(logits, np.float32)  # nothing changes them: no copy (only read below)
    else:
        z = apply_repeat_penalty(logits, recent, params.repeat_penalty)
        apply_dry(z, history, params, breakers)
    if allowed is not None:
        if not allowed.any():
            raise PyinferError("the grammar allows no token")
        z[~allowed] = -np.inf
        if not z.max() > -np.inf:  # argmax would pick token 0 whatever the mask; softmax NaN
            raise PyinferError("no token the grammar allows can be drawn (with ignore_eos: the "
                               "grammar can only end here, and the end is banned)")
    if params.temperature <= 0:
        return np.array([int(np.argmax(z))]), np.ones(1)

    # Candidates sorted by logit, best first; the filters only ever cut the tail.
    n_ok = z.shape[0] if allowed is None else int(np.count_nonzero(allowed))
    if 0 < params.top_k < n_ok:
        # the compiled top-k (ascending ids, ties at the boundary to the lower index): NumPy's
        # argpartition over the vocabulary took 0.7 ms a token on SmolLM2 (49,152), 4-6 ms on
        # Gemma 3 (262,144)
        cand = np.empty(params.top_k, np.int32)
        m = cpu.topk_indices(np.ascontiguousarray(z, np.float32), params.top_k, cand)
        cand = cand[:m].astype(np.int64)
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
    kept = cz[:keep]
    with np.errstate(over="ignore", invalid="ignore"):
        cz = kept / params.temperature
        if np.isfinite(cz).all():
            p = np.exp(cz - cz[0])
        else:  # a temperature so small that logit / temperature overflows: the limit, greedy
            p = np.exp((kept - kept[0]) / params.temperature)
    return cand[:keep].astype(np.int64), p / p.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           recent=(), allowed: np.ndarray | None = None, history=(),
           breakers=frozenset()) -> int:
    """Pick the next token id from ``logits`` (n_vocab,) float32: a draw from ``distribution``.

    ``recent`` holds the ids the repetition penalty applies to (the caller passes the last
    ``params.repeat_last_n`` tokens); ``allowed``: a grammar's mask; ``history``, ``breakers``:
    DRY's (see ``distribution``). Deterministic for a seeded ``rng``.
    """
    ids, p = distribution(logits, params, recent, allowed, history, breakers)
    if params.temperature <= 0:
        return int(ids[0])
    return int(ids[rng.choice(ids.shape[0], p=p)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of every token under the model, before any sampling filter: (n_vocab,) float64.
    What OpenAI's ``logprobs`` report."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))
