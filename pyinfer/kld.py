"""KL divergence of a model's next-token distributions from a base model's, on the same tokens:
llama.cpp's ``perplexity --kl-divergence-base FILE`` (score a text with the base model and save
its log-probabilities) then ``--kl-divergence-base FILE --kl-divergence`` (score the same chunks
with another model and compare), the measure llama.cpp's quantization tables use. It says more
than a perplexity ratio: a sparse or quantized model can keep its perplexity while moving
probability between tokens, which the KL divergence and the top-token agreement show.

Per scored position (llama.cpp's: the second half of each chunk, pyinfer/perplexity.py) with base
log-probabilities log p and the model's log q over the whole vocabulary and the text's next token t:
KLD = sum_i p_i (log p_i - log q_i) in nats; dp = q_t - p_t; "same top" when both distributions
have the same most likely token.

The file is pyinfer's own (llama.cpp's logits files are not read or written), version 1::

    magic  b"PYINFER-KLD1"                      12 bytes
    uint32 length of the header, then the header, JSON (UTF-8):
           {"version", "n_ctx", "n_vocab", "n_chunks", "first", "window", "model"}
    int32  tokens (n_chunks, n_ctx): each chunk as the base evaluated it (BOS in front where its
           tokenizer adds one), so the comparison evaluates exactly these
    per chunk, n_rows = n_ctx - 1 - first scored positions:
           float32 top (n_rows,): the largest log-probability of each position
           float32 lp_next (n_rows,): the log-probability of the text's next token (exact, so
                   that the base's perplexity is the one its own run printed)
           uint16  q (n_rows, n_vocab): log p_i = top - window + q_i * window / 65535

i.e. the log-probabilities of the ``window`` (32) nats below each position's most likely token in
65,536 steps (0.00049 nats), two bytes a vocabulary entry a position: 96 KiB a position for a
vocabulary of 49,152. Lower ones are clamped to the bottom: e**-32 of the top's probability each,
1e-9 together over 150,000 tokens (a window of 16 nats, as first written, gave SmolLM2's tail
0.5% of the probability and a model 0.006 nats of KL divergence from itself).
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from pyinfer.errors import PyinferError
from pyinfer.perplexity import first_scored

MAGIC = b"PYINFER-KLD1"
VERSION = 1
WINDOW = 32.0  # nats below the most likely token kept (what lies lower adds under 1e-9 to p)
LEVELS = 65535


def quantize(lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, n_vocab) f64 log-probabilities -> (top (n,) f32, q (n, n_vocab) uint16), the file's
    encoding (module docstring)."""
    top = lp.max(axis=1).astype(np.float32)
    q = np.rint((lp - (top[:, None].astype(np.float64) - WINDOW)) * (LEVELS / WINDOW))
    return top, np.clip(q, 0, LEVELS).astype(np.uint16)


def dequantize(top: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The file's (top, q) -> (n, n_vocab) f64 log-probabilities, renormalized (the clamped tail
    and the rounding leave the sum of p a hair off 1)."""
    lp = (top[:, None].astype(np.float64) - WINDOW) + q * (WINDOW / LEVELS)
    m = lp.max(axis=1, keepdims=True)
    return lp - (m + np.log(np.exp(lp - m).sum(axis=1, keepdims=True)))


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw


class BaseWriter:
    """Writes a base file: ``rows(logprobs, targets)`` for each scored batch of positions in
    order (perplexity.estimate's ``sink``), then ``close()``; written to a temporary file beside
    ``path`` and renamed over it by ``close`` only once every position has come (``abort``
    removes it). chunks: (n_chunks, n_ctx) int the tokens as evaluated. Raises PyinferError
    when the file cannot be written."""

    def __init__(self, path: str, chunks: np.ndarray, n_vocab: int, model: str):
        from pyinfer.options import temp_path_beside

        self.path = path
        n_chunks, n_ctx = chunks.shape
        first = first_scored(n_ctx)
        self.expected = n_chunks * (n_ctx - 1 - first)
        self.written = 0
        self.n_vocab = n_vocab
        self.tmp = temp_path_beside(path)
        header = {"version": VERSION, "n_ctx": int(n_ctx), "n_vocab": int(n_vocab),
                  "n_chunks": int(n_chunks), "first": int(first), "window": WINDOW,
                  "model": os.path.basename(model)}
        try:
            self.f = open(self.tmp, "wb")
            self.f.write(_header_bytes(header))
            self.f.write(np.ascontiguousarray(chunks, dtype="<i4").tobytes())
        except OSError as e:
            self.abort()
            raise PyinferError(f"cannot write {path}: {e.strerror or e}") from None
        self._tops: list[np.ndarray] = []
        self._next: list[np.ndarray] = []
        self._qs: list[np.ndarray] = []
        self.rows_per_chunk = n_ctx - 1 - first

    @staticmethod
    def nbytes(n_chunks: int, n_ctx: int, n_vocab: int) -> int:
        """The data bytes of a file of these sizes (tokens and log-probabilities)."""
        return 4 * n_chunks * n_ctx + n_chunks * (n_ctx - 1 - first_scored(n_ctx)) * (
            8 + 2 * n_vocab)

    def rows(self, lp: np.ndarray, targets: np.ndarray) -> None:
        top, q = quantize(lp)
        self._tops.append(top)
        self._next.append(lp[np.arange(lp.shape[0]), np.asarray(targets)])
        self._qs.append(q)
        self.written += top.shape[0]
        if sum(t.shape[0] for t in self._tops) == self.rows_per_chunk:  # a chunk complete
            try:
                self.f.write(np.concatenate(self._tops).astype("<f4").tobytes())
                self.f.write(np.concatenate(self._next).astype("<f4").tobytes())
                for q in self._qs:
                    self.f.write(q.astype("<u2").tobytes())
            except OSError as e:
                self.abort()
                raise PyinferError(f"cannot write {self.path}: {e.strerror or e}") from None
            self._tops, self._next, self._qs = [], [], []

    def close(self) -> None:
        if self.written != self.expected:
            self.abort()
            raise PyinferError(f"{self.path}: {self.written} of {self.expected} positions scored")
        try:
            self.f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise PyinferError(f"cannot write {self.path}: {e.strerror or e}") from None

    def abort(self) -> None:
        """Remove the temporary file (the path named by the user is left as it was); SIGINT and
        SIGTERM are held meanwhile, so a second Ctrl-C cannot leave it behind."""
        from pyinfer.options import signals_held

        with signals_held():
            f = getattr(self, "f", None)
            if f is not None:
                f.close()
            try:
                os.remove(self.tmp)
            except FileNotFoundError:
                pass


class BaseFile:
    """A base file opened for reading (memory-mapped). Attributes: n_ctx, n_vocab, n_chunks,
    first, model (the base's file name), tokens (n_chunks, n_ctx) int32. Raises PyinferError for
    a file that is not one or is cut short."""

    def __init__(self, path: str):
        try:
            with open(path, "rb") as f:
                magic = f.read(len(MAGIC))
                if magic != MAGIC:
                    raise PyinferError(f"{path} is not a pyinfer KL-divergence base file "
                                       "(write one with --kl-divergence-base FILE -f TEXT)")
                (n,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(n).decode())
        except OSError as e:
            raise PyinferError(f"cannot read {path}: {e.strerror or e}") from None
        except (struct.error, UnicodeDecodeError, ValueError):
            raise PyinferError(f"{path}: a damaged KL-divergence base file") from None
        try:
            if header["version"] != VERSION:
                raise PyinferError(f"{path}: version {header['version']} of the KL-divergence "
                                   f"base file; this pyinfer reads version {VERSION}")
            self.n_ctx, self.n_vocab = int(header["n_ctx"]), int(header["n_vocab"])
            self.n_chunks, self.first = int(header["n_chunks"]), int(header["first"])
            self.window, self.model = float(header["window"]), str(header["model"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise PyinferError(f"{path}: a damaged KL-divergence base file") from None
        if (self.window != WINDOW or not 0 <= self.first < self.n_ctx - 1 or self.n_chunks < 1
                or self.n_vocab < 1 or self.first != first_scored(self.n_ctx)):
            raise PyinferError(f"{path}: a damaged KL-divergence base file")
        start = len(MAGIC) + 4 + n
        size = start + BaseWriter.nbytes(self.n_chunks, self.n_ctx, self.n_vocab)
        if os.path.getsize(path) != size:
            raise PyinferError(f"{path}: {os.path.getsize(path)} bytes where its header says "
                               f"{size}; a damaged or unfinished KL-divergence base file")
        self._map = np.memmap(path, np.uint8, "r")
        self.tokens = self._map[start:start + 4 * self.n_chunks * self.n_ctx].view("<i4").reshape(
            self.n_chunks, self.n_ctx)
        self._data = start + 4 * self.n_chunks * self.n_ctx
        self.n_rows = self.n_ctx - 1 - self.first
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() >= self.n_vocab):
            raise PyinferError(f"{path}: a token id outside the vocabulary of {self.n_vocab}; a "
                               "damaged KL-divergence base file")

    def chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(top (n_rows,) f32, lp_next (n_rows,) f32, q (n_rows, n_vocab) uint16) of chunk c."""
        at = self._data + c * self.n_rows * (8 + 2 * self.n_vocab)
        top = self._map[at:at + 4 * self.n_rows].view("<f4")
        at += 4 * self.n_rows
        lp_next = self._map[at:at + 4 * self.n_rows].view("<f4")
        at += 4 * self.n_rows
        q = self._map[at:at + 2 * self.n_rows * self.n_vocab].view("<u2").reshape(
            self.n_rows, self.n_vocab)
        return top, lp_next, q


class Comparison:
    """The per-position figures of a model against a base file, as perplexity.estimate's
    ``sink``: ``rows(logprobs, targets)`` for each scored batch in order. Arrays after the run
    (each (n,) over the scored positions): nll (the model's -log q_t), nll_base, kld, dp,
    same_top (bool)."""

    def __init__(self, base: BaseFile):
        self.base = base
        self.chunk, self.row = 0, 0
        self._parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                                    ("nll", "nll_base", "kld", "dp", "same_top")}

    def rows(self, lq: np.ndarray, targets: np.ndarray) -> None:
        t = np.asarray(targets)
        top, lp_next, q = self.base.chunk(self.chunk)
        n = lq.shape[0]
        lp = dequantize(top[self.row:self.row + n], q[self.row:self.row + n])
        lp_t = lp_next[self.row:self.row + n].astype(np.float64)
        self.row += n
        if self.row == self.base.n_rows:
            self.chunk, self.row = self.chunk + 1, 0
        i = np.arange(n)
        p = np.exp(lp)
        self._parts["kld"].append((p * (lp - lq)).sum(axis=1))
        self._parts["nll"].append(-lq[i, t])
        self._parts["nll_base"].append(-lp_t)
        self._parts["dp"].append(np.exp(lq[i, t]) - np.exp(lp_t))
        self._parts["same_top"].append(lq.argmax(axis=1) == lp.argmax(axis=1))

    def __getattr__(self, name):
        parts = self.__dict__.get("_parts", {})
        if name in parts:
            return np.concatenate(parts[name]) if parts[name] else np.zeros(0)
        raise AttributeError(name)


def _mean_err(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error."""
    n = x.shape[0]
    return float(x.mean()), (float(x.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0)


def report(cmp: Comparison) -> str:
    """llama.cpp's summary of a --kl-divergence run (its labels and order: perplexity ratio, KL
    divergence percentiles, token-probability change, same top token), each mean with its
    standard error; the ratio's error by the delta method. Raises PyinferError with no position."""
    nll, nllb, kld, dp = cmp.nll, cmp.nll_base, cmp.kld, cmp.dp
    n = nll.shape[0]
    if n < 2:
        raise PyinferError("fewer than two positions scored; nothing to compare")
    ln_ratio, ln_err = _mean_err(nll - nllb)
    ppl_q, ppl_b = math.exp(nll.mean()), math.exp(nllb.mean())
    q_err, b_err = _mean_err(nll)[1] * ppl_q, _mean_err(nllb)[1] * ppl_b
    cov = float(np.cov(nll, nllb)[0, 1]) / n
    diff_err = math.sqrt(max(q_err ** 2 + b_err ** 2 - 2 * ppl_q * ppl_b * cov, 0.0))
    cor = float(np.corrcoef(nll, nllb)[0, 1]) if nll.std() > 0 and nllb.std() > 0 else float("nan")
    k_mean, k_err = _mean_err(kld)
    d_mean, d_err = _mean_err(dp)
    rms = math.sqrt(float((dp ** 2).mean()))
    rms_err = _mean_err(dp ** 2)[1] / (2 * rms) if rms > 0 else 0.0
    same = float(cmp.same_top.mean())
    same_err = math.sqrt(same * (1 - same) / n)
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {ppl_q:10.6f} ± {q_err:10.6f}",
             f"Mean PPL(base)                : {ppl_b:10.6f} ± {b_err:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {ln_ratio:10.6f} ± {ln_err:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {math.exp(ln_ratio):10.6f} ± "
             f"{math.exp(ln_ratio) * ln_err:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {ppl_q - ppl_b:10.6f} ± {diff_err:10.6f}",
             "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {k_mean:10.6f} ± {k_err:10.6f}"]
    for label, pct in (("Maximum", 100), ("99.9%  ", 99.9), ("99.0%  ", 99), ("Median ", 50),
                       ("10.0%  ", 10), (" 5.0%  ", 5), (" 1.0%  ", 1), ("Minimum", 0)):
        lines.append(f"{label} KLD: {float(np.percentile(kld, pct)):10.6f}")
    lines += ["", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * d_mean:8.3f} ± {100 * d_err:5.3f} %"]
    for label, pct in (("Maximum", 100), ("99.9%  ", 99.9), ("99.0%  ", 99), ("95.0%  ", 95),
                       ("90.0%  ", 90), ("75.0%  ", 75), ("Median ", 50), ("25.0%  ", 25),
                       ("10.0%  ", 10), (" 5.0%  ", 5), (" 1.0%  ", 1), (" 0.1%  ", 0.1),
                       ("Minimum", 0)):
        lines.append(f"{label} Δp: {100 * float(np.percentile(dp, pct)):8.3f}%")
    lines += [f"RMS Δp    : {100 * rms:8.3f} ± {100 * rms_err:5.3f} %",
              f"Same top p: {100 * same:8.3f} ± {100 * same_err:5.3f} %"]
    return "\n".join(lines)
