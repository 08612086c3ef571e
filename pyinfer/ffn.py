"""The feed-forward half of a layer: dense, or sparse over the neurons predicted active.

All FFNs compute ``down_t^T (act(gate h) * up h)`` over PowerInfer's neuron-major layout (one row
per neuron in ffn_gate, ffn_up and ffn_down_t). They differ only in which neurons they touch:

- ``DenseFFN``: every neuron.
- ``SparseFFN`` (PowerInfer, arXiv 2312.12456 §4-5): a per-layer predictor picks candidate
  neurons from the residual x before the FFN norm; a candidate then counts as active by the
  file's sparse mode: "relu" where relu(gate) > 0 (exact zeros; only active neurons' up rows are
  read), "cats" where |silu(gate)| exceeds the layer's calibrated threshold (CATS, Lee et al.
  2024; up rows only for active neurons), "glu" where |silu(gate) * up| exceeds it (the GLU
  output's magnitude, as TEAL/R-Sparse rank neurons; gate and up rows of every candidate are read,
  down rows only for active ones). On SmolLM2 at 40% sparsity "glu" costs 1% perplexity where
  "cats" costs 13% (docs/benchmarks.md).

The other families (``ModelConfig.llama_plain`` false) go through ``ffn_coef`` and
``sparse_step_general``: non-gated FFNs (OPT, Falcon: ``down_t^T act(up h + b) + b``, the up
projection selecting neurons and each neuron's bias applied with its row), dReLU
(``relu(gate h) * relu(up h)``, TurboSparse), ProSparse's fatrelu and GELU. An inactive neuron's
bias is skipped with its row: its activation is exactly 0 after the bias (relu/fatrelu).

Both count neurons so the engine can report the measured activation sparsity.
"""
from __future__ import annotations

import numpy as np

from pyinfer.config import ModelConfig
from pyinfer.ops import cpu
from pyinfer.ops import families as fam
from pyinfer.weights import LayerWeights


# Fraction of kept neurons above which fused decode streams the whole down projection (zero
# coefficients for the rest) instead of gathering the kept rows. Measured in the model (SmolLM2
# q8_0, 2 threads, docs/benchmarks.md): with 58% of rows kept the stream was as fast as or 3-5%
# faster than the gather (the micro-benchmark's break-even, 65%, does not hold once the rows come
# from memory between other layers' weights); well below it (ReLU models, 10%) gathers win.
DENSE_DOWN_ABOVE = 0.4


def linear(w: cpu.QTensor, x: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
    """out = x @ w.T for x (n_tok, cols) -> out (n_tok, rows); GEMV when n_tok is 1."""
    if x.shape[0] == 1:
        cpu.matvec(w, x[0], out[0], n_threads)
    else:
        cpu.matmul(w, x, out, n_threads)
    return out


def linear_many(ws, x: np.ndarray, outs, n_threads: int):
    """outs[m] = x @ ws[m].T for weights that read the same x (n_tok, cols): one call with x
    quantized once (``cpu.matmul_multi``) when every weight has the prefill GEMM and n_tok > 1,
    else ``linear`` on each (a single token keeps decode's GEMV)."""
    if x.shape[0] > 1 and all(cpu.prefill_gemm(w.qtype) for w in ws):
        return cpu.matmul_multi(ws, x, outs, n_threads)
    for w, out in zip(ws, outs):
        linear(w, x, out, n_threads)
    return outs


def linear_t(w: cpu.QTensor, a: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
    """out = a @ w for a (n_tok, rows) -> out (n_tok, cols): the neuron-major down projection."""
    if a.shape[0] == 1:
        cpu.matvec_t(w, a[0], out[0], n_threads)
    else:
        cpu.matmul_t(w, a, out, n_threads)
    return out


def ffn_coef(cfg: ModelConfig, lw: LayerWeights, h: np.ndarray,
             n_threads: int) -> tuple[np.ndarray, np.ndarray]:
    """Every neuron's activation and down-projection coefficient for h (n_tok, n_embd) f32.

    Returns (a, coef), both (n_tok, n_ff) f32: gated FFNs a = act(gate h), coef = a * up h
    (up h through relu first for dReLU); non-gated a = coef = act(up h + b). The FFN output is
    ``coef @ down`` (+ the down bias)."""
    n_tok, n_ff = h.shape[0], cfg.n_ff
    up = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
    linear(lw.ffn_up, h, up, n_threads)
    if lw.ffn_up_b is not None:
        up += lw.ffn_up_b
    if lw.ffn_gate is None:
        a = fam.act(cfg.hidden_act, up, cfg.act_shift, n_threads)
        return a, a
    gate = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
    linear(lw.ffn_gate, h, gate, n_threads)
    a = fam.act(cfg.hidden_act, gate, cfg.act_shift, n_threads)
    if cfg.ffn_up_act == "relu":
        np.maximum(up, 0.0, out=up)
    up *= a  # coef = a * up, in place (f32 products commute: the same bits)
    return a, up


def down_proj(lw: LayerWeights, coef: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
    """out = coef @ down: coef (n_tok, n_ff), out (n_tok, n_embd) f32. Over ``ffn_down_t``
    (neuron-major) or, for a llama.cpp file run as it is, a GEMV over the rows of its ``ffn_down``
    (n_embd, n_ff) as stored (no copy of the memory map)."""
    if lw.ffn_down_t is None:
        return linear(lw.ffn_down, coef, out, n_threads)
    return linear_t(lw.ffn_down_t, coef, out, n_threads)


def down_b(lw: LayerWeights, coef: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
    """out = coef @ down (+ the down bias): coef (n_tok, n_ff), out (n_tok, n_embd) f32."""
    down_proj(lw, coef, out, n_threads)
    if lw.ffn_down_b is not None:
        out += lw.ffn_down_b
    return out


def sparse_step_general(cfg: ModelConfig, lw: LayerWeights, h: np.ndarray, ids: np.ndarray | None,
                        glu: bool, threshold: float, out: np.ndarray, n_threads: int) -> int:
    """``sparse_step`` for the families ``cpu.select_active`` does not cover (see the module
    docstring): the selecting rows (gate, or up + its bias for a non-gated FFN) of the candidates
    ``ids`` (sorted int32, None for all) are read; a neuron is kept where |a| > threshold (or NaN)
    (|coef| with ``glu``), then only kept neurons' up rows (gated) and down rows are read.
    h (n_embd,) f32; writes (n_embd,) f32 into out; returns the number kept."""
    gated = lw.ffn_gate is not None
    n_cand = cfg.n_ff if ids is None else ids.shape[0]
    g = np.empty(n_cand, np.float32)  # (n_candidates,) selecting pre-activation
    _dot_rows(lw.ffn_gate if gated else lw.ffn_up, h, ids, g, n_threads)
    if not gated and lw.ffn_up_b is not None:
        g += lw.ffn_up_b if ids is None else lw.ffn_up_b[ids]
    a = fam.act(cfg.hidden_act, g, cfg.act_shift, n_threads)
    cand = np.arange(n_cand, dtype=np.int32) if ids is None else ids
    if gated and glu:
        u = np.empty(n_cand, np.float32)
        _dot_rows(lw.ffn_up, h, ids, u, n_threads)
        if cfg.ffn_up_act == "relu":
            np.maximum(u, 0.0, out=u)
        val = a * u
        keep = ~(np.abs(val) <= threshold)  # NaN kept
        coef, idx = val[keep], cand[keep]
    else:
        keep = ~(np.abs(a) <= threshold)
        coef, idx = a[keep], np.ascontiguousarray(cand[keep])
        if gated:
            u = np.empty(idx.shape[0], np.float32)
            cpu.gather_matvec(lw.ffn_up, h, idx, u, n_threads)
            if cfg.ffn_up_act == "relu":
                np.maximum(u, 0.0, out=u)
            coef = coef * u
    coef = np.ascontiguousarray(coef, np.float32)
    cpu.axpy_rows(lw.ffn_down_t, coef, np.ascontiguousarray(idx, np.int32), out, n_threads)
    if lw.ffn_down_b is not None:
        out += lw.ffn_down_b
    return int(idx.shape[0])


class FFNStats:
    """Neuron counts since the last reset: ``active`` neurons had up/down rows read,
    ``candidates`` had their gate row read, ``total`` = tokens x n_ff."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.active = self.candidates = self.total = 0

    @property
    def sparsity(self) -> float:
        """Fraction of FFN neurons skipped (0 for dense)."""
        return 1.0 - self.active / self.total if self.total else 0.0

    def count_dense(self, n_layers: int, n_ff: int) -> None:
        """One token's layers with every neuron computed (``DenseFFN.decode`` per layer)."""
        self.total += n_layers * n_ff
        self.active += n_layers * n_ff
        self.candidates += n_layers * n_ff


class DenseFFN:
    """Every neuron of every token."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.mul = cpu.silu_mul if cfg.hidden_act == "silu" else cpu.relu_mul
        self.stats = FFNStats()

    def __call__(self, lw: LayerWeights, layer: int, x: np.ndarray, h: np.ndarray,
                 out: np.ndarray, n_threads: int) -> np.ndarray:
        """x: (n_tok, n_embd) residual before the FFN norm; h: normed x. Writes (n_tok, n_embd)
        FFN output into ``out`` and returns it."""
        n_tok, n_ff = h.shape[0], self.cfg.n_ff
        if not _llama_ffn(self.cfg, lw):
            down_b(lw, ffn_coef(self.cfg, lw, h, n_threads)[1], out, n_threads)
            self.stats.total += n_tok * n_ff
            self.stats.active += n_tok * n_ff
            self.stats.candidates += n_tok * n_ff
            return out
        gate = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
        if n_tok > 1 and cpu.prefill_gemm(lw.ffn_gate.qtype) and cpu.prefill_gemm(lw.ffn_up.qtype):
            # both GEMMs and the activation in one call (x quantized once, no silu_mul pass)
            cpu.matmul_glu(lw.ffn_gate, lw.ffn_up, h, gate, self.cfg.hidden_act == "silu", n_threads)
        else:
            up = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
            linear(lw.ffn_gate, h, gate, n_threads)
            linear(lw.ffn_up, h, up, n_threads)
            self.mul(gate, up, gate)
        down_proj(lw, gate, out, n_threads)
        self.stats.total += n_tok * n_ff
        self.stats.active += n_tok * n_ff
        self.stats.candidates += n_tok * n_ff
        return out

    def decode(self, lw: LayerWeights, layer: int, x: np.ndarray, eps: float,
               n_threads: int) -> bool:
        """One token's whole FFN half-layer in one fused call, in place on the residual x
        (n_embd,) (``cpu.decode_ffn``). Returns False where this FFN cannot (the other families)."""
        if not _llama_ffn(self.cfg, lw) or self.cfg.norm != "rms":
            return False
        n_ff = self.cfg.n_ff
        if lw.ffn_down_t is None:  # ffn_down in row layout: GEMVs (a --dense or llama.cpp file)
            cpu.decode_ffn_rows(x, lw.ffn_norm, eps, lw.ffn_gate, lw.ffn_up, lw.ffn_down,
                                self.cfg.hidden_act == "silu", n_threads)
        else:
            cpu.decode_ffn(x, lw.ffn_norm, eps, lw.ffn_gate, lw.ffn_up, lw.ffn_down_t,
                           cpu.FFN_DENSE, self.cfg.hidden_act == "silu", 0.0, n_threads)
        self.stats.count_dense(1, n_ff)
        return True


class Predictor:
    """One layer's activation predictor, PowerInfer's tensor form: a neuron is a candidate where
    ``fc2 @ relu(fc1 @ x) >= threshold``. fc1 (rank, n_embd), fc2 (n_ff, rank), f32 or f16 (as the
    file stores them; f16 halves the bytes read per token), dotted in f32 by pyinfer's kernels."""

    def __init__(self, fc1: np.ndarray, fc2: np.ndarray, threshold: float):
        self.fc1 = _pred_tensor(fc1)
        self.fc2 = _pred_tensor(fc2)
        self.threshold = float(threshold)
        self._hid = np.empty(fc1.shape[0], np.float32)  # (rank,)
        self._logits = np.empty(fc2.shape[0], np.float32)  # (n_ff,)

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes

    def active(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        """Candidate neuron ids (int32, sorted) for one token's x (n_embd,)."""
        cpu.matvec(self.fc1, x, self._hid, n_threads)
        np.maximum(self._hid, 0.0, out=self._hid)
        cpu.matvec(self.fc2, self._hid, self._logits, n_threads)
        return np.flatnonzero(self._logits >= self.threshold).astype(np.int32)

    def mask(self, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
        """Candidate mask (n_tok, n_ff) bool for x (n_tok, n_embd)."""
        x = np.ascontiguousarray(x, np.float32)
        hid = np.empty((x.shape[0], self.fc1.rows), np.float32)
        logits = np.empty((x.shape[0], self.fc2.rows), np.float32)
        linear(self.fc1, x, hid, n_threads)
        np.maximum(hid, 0.0, out=hid)
        linear(self.fc2, hid, logits, n_threads)
        return logits >= self.threshold


def _llama_ffn(cfg: ModelConfig, lw: LayerWeights) -> bool:
    """True where the compiled GLU kernels compute this layer's FFN (gated silu/relu, no bias)."""
    return (lw.ffn_gate is not None and cfg.hidden_act in ("silu", "relu") and not cfg.ffn_up_act
            and lw.ffn_up_b is None and lw.ffn_down_b is None)


def _pred_tensor(a: np.ndarray) -> cpu.QTensor:
    a = np.ascontiguousarray(a)
    if a.dtype != np.float16:
        a = np.ascontiguousarray(a, np.float32)
    return cpu.QTensor(a, cpu.QT.F16 if a.dtype == np.float16 else cpu.QT.F32, *a.shape)


def sparse_step(lw: LayerWeights, h: np.ndarray, ids: np.ndarray | None, silu: bool, glu: bool,
                threshold: float, out: np.ndarray, n_threads: int) -> int:
    """One token's FFN over the candidate neurons ``ids`` (sorted int32, or None for all n_ff,
    read with the dense GEMV) under SparseFFN's rule: "glu" keeps |act(gate h) * up h| >
    threshold (gate and up rows of every candidate read), otherwise |act(gate h)| > threshold
    (up rows only of those kept). glu with threshold < 0 keeps every candidate (dense).
    h (n_embd,) f32; writes their down projection into out (n_embd,) f32; returns how many
    neurons were kept. The hybrid GPU model computes its cold neurons with this too."""
    n_cand = lw.ffn_gate.rows if ids is None else ids.shape[0]
    g = np.empty(n_cand, np.float32)  # (n_candidates,)
    _dot_rows(lw.ffn_gate, h, ids, g, n_threads)
    coef = np.empty_like(g)  # (n_candidates,) then [:n_active]
    idx = np.empty(n_cand, np.int32)
    if glu:  # rank by the GLU output: every candidate's up row is needed first
        u = np.empty_like(g)
        _dot_rows(lw.ffn_up, h, ids, u, n_threads)
        n = cpu.select_active(g, u, ids, silu, threshold, coef, idx)
        coef, idx = coef[:n], idx[:n]
    else:  # up rows only for neurons whose activation passed
        n = cpu.select_active(g, None, ids, silu, threshold, coef, idx)
        coef, idx = coef[:n], idx[:n]
        u = np.empty(n, np.float32)
        cpu.gather_matvec(lw.ffn_up, h, idx, u, n_threads)
        coef *= u
    cpu.axpy_rows(lw.ffn_down_t, coef, idx, out, n_threads)
    return n


def _dot_rows(w: cpu.QTensor, h: np.ndarray, ids, out: np.ndarray, n_threads: int) -> None:
    if ids is None:
        cpu.matvec(w, h, out, n_threads)
    else:
        cpu.gather_matvec(w, h, ids, out, n_threads)


class SparseFFN:
    """Only the neurons predicted and found active (see the module docstring).

    predictors: one ``Predictor`` per layer, or None to read every gate row (then only the
    activation threshold prunes). act_threshold: (n_layer,) f32, the magnitude (see ``mode``)
    must exceed it (0 for ReLU models, whose inactive neurons are exact zeros). mode: "relu",
    "cats" or "glu" (module docstring); default "relu" for ReLU models, "cats" otherwise.
    use_predictor: (n_layer,) bool, where token-at-a-time decode runs the predictor (default:
    every layer that has one). The offline stage turns it off where the predictor costs more
    bytes than it saves (``predictors.offline.predictor_pays``); those layers read every gate
    (and, in "glu" mode, up) row with the dense GEMV, which streams faster than a gather. Either
    way the same neurons count as active: prefill applies the predictor's mask only where decode
    does, so both paths compute one function.
    """

    def __init__(self, cfg: ModelConfig, predictors: list[Predictor] | None,
                 act_threshold: np.ndarray, mode: str | None = None,
                 use_predictor=None):
        self.cfg = cfg
        self.mode = mode or ("relu" if cfg.hidden_act in ("relu", "fatrelu") else "cats")
        self.glu = self.mode == "glu"
        self.predictors = predictors
        n_layer = len(act_threshold)
        if predictors is None:
            use_predictor = [False] * n_layer
        elif use_predictor is None:
            use_predictor = [True] * n_layer
        self.use_predictor = np.asarray(use_predictor, bool)  # (n_layer,)
        self.act_threshold = np.asarray(act_threshold, np.float32)
        self.silu = cfg.hidden_act == "silu"
        self.dense_down_above = DENSE_DOWN_ABOVE
        self.stats = FFNStats()

    def __call__(self, lw: LayerWeights, layer: int, x: np.ndarray, h: np.ndarray,
                 out: np.ndarray, n_threads: int) -> np.ndarray:
        if h.shape[0] > 1:
            return self._batch(lw, layer, x, h, out, n_threads)
        n_ff = self.cfg.n_ff
        # every neuron is a candidate without the predictor: the dense GEMV streams faster
        ids = self.predictors[layer].active(x[0], n_threads) if self.use_predictor[layer] else None
        if _llama_ffn(self.cfg, lw):
            n = sparse_step(lw, h[0], ids, self.silu, self.glu, float(self.act_threshold[layer]),
                            out[0], n_threads)
        else:
            n = sparse_step_general(self.cfg, lw, h[0], ids, self.glu,
                                    float(self.act_threshold[layer]), out[0], n_threads)
        self.stats.total += n_ff
        self.stats.candidates += n_ff if ids is None else ids.shape[0]
        self.stats.active += n
        return out

    def decode(self, lw: LayerWeights, layer: int, x: np.ndarray, eps: float,
               n_threads: int) -> bool:
        """One token's FFN half-layer fused into one call (``cpu.decode_ffn``) where the layer
        runs no predictor; returns False (nothing done) where it does or where the fused kernel
        does not compute this family's FFN."""
        if self.use_predictor[layer] or not _llama_ffn(self.cfg, lw) or self.cfg.norm != "rms":
            return False
        n_ff = self.cfg.n_ff
        mode = cpu.FFN_GLU if self.glu else cpu.FFN_ACT
        n = cpu.decode_ffn(x, lw.ffn_norm, eps, lw.ffn_gate, lw.ffn_up, lw.ffn_down_t, mode,
                           self.silu, self.act_threshold[layer], n_threads, self.dense_down_above)
        self.stats.total += n_ff
        self.stats.candidates += n_ff
        self.stats.active += n
        return True

    def _batch(self, lw, layer, x, h, out, n_threads):
        """Prefill: dense GEMMs (the union of active neurons over a batch is most of the layer),
        masked to exactly the neurons the token-at-a-time path would compute."""
        n_tok, n_ff = h.shape[0], self.cfg.n_ff
        a, coef = ffn_coef(self.cfg, lw, h, n_threads)
        if self.glu:
            a = coef
        mask = ~(np.abs(a) <= self.act_threshold[layer])  # NaN kept
        if self.use_predictor[layer]:
            cand = self.predictors[layer].mask(x, n_threads)
            mask &= cand
            self.stats.candidates += int(cand.sum())
        else:
            self.stats.candidates += n_tok * n_ff
        a = np.where(mask, coef, 0.0).astype(np.float32)
        down_b(lw, a, out, n_threads)
        self.stats.total += n_tok * n_ff
        self.stats.active += int(mask.sum())
        return out
