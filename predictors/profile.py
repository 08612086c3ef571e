"""Activation profiler: runs pyinfer's own engine over calibration tokens and records, per layer,
the FFN input and every neuron's activation magnitude.

A ``RecordingFFN`` (a ``DenseFFN`` that also writes what it sees) is installed as the model's FFN;
calibration sequences are evaluated as batched prefill chunks, each from an empty cache
(``engine.forward(chunk, 0)``). Recorded per layer l and token t:

- ``x[l, t]``: the residual stream *before* the FFN norm, the predictor's input (f32, n_embd);
- ``act[l, t]``: every neuron's activation magnitude (f16 to halve memory, n_ff): ``relu(gate)``
  for ReLU models, ``|silu(gate) * up|`` (the GLU output) for SwiGLU models.

From these, :func:`activity` derives which neurons count as active: ReLU models where
``relu(gate) > 0`` (sparse mode "relu"), SwiGLU models where ``|silu(gate) * up|`` exceeds the
layer's target-sparsity quantile (sparse mode "glu"), the per-layer threshold SparseFFN applies at
run time. (Ranking by ``|silu(gate)|`` alone, CATS, cost 13% perplexity on SmolLM2 at 40% sparsity
against 1% for the GLU output: docs/benchmarks.md.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyinfer import constants as C
from pyinfer.errors import PyinferError
from pyinfer.ffn import DenseFFN, _llama_ffn, down_b, down_proj, ffn_coef, linear


class RecordingFFN(DenseFFN):
    """DenseFFN that copies x and |act(gate)| of every token into preallocated buffers.

    x_rec: (n_layer, n_tokens, n_embd) f32; act_rec: (n_layer, n_tokens, n_ff) f16. Layers write
    at their own cursor, so tokens are recorded in evaluation order."""

    def __init__(self, cfg, n_tokens: int):
        super().__init__(cfg)
        self.x_rec = np.empty((cfg.n_layer, n_tokens, cfg.n_embd), np.float32)
        self.act_rec = np.empty((cfg.n_layer, n_tokens, cfg.n_ff), np.float16)
        self.cursor = np.zeros(cfg.n_layer, np.int64)
        self.silu = cfg.hidden_act == "silu"

    def decode(self, lw, layer, x, eps, n_threads) -> bool:
        """Never fused: a one-token piece must pass through ``__call__`` to be recorded."""
        return False

    def __call__(self, lw, layer, x, h, out, n_threads):
        n_tok, n_ff = h.shape[0], self.cfg.n_ff
        if not _llama_ffn(self.cfg, lw):
            return self._other_family(lw, layer, x, h, out, n_threads)
        gate = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
        up = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
        linear(lw.ffn_gate, h, gate, n_threads)
        linear(lw.ffn_up, h, up, n_threads)
        s = int(self.cursor[layer])
        if s + n_tok > self.x_rec.shape[1]:
            raise AssertionError("RecordingFFN: more tokens than allocated")
        self.x_rec[layer, s:s + n_tok] = x
        a = gate / (1.0 + np.exp(-gate)) * up if self.silu else np.maximum(gate, 0.0)
        np.abs(a, out=a)
        self.act_rec[layer, s:s + n_tok] = a
        self.cursor[layer] = s + n_tok
        self.mul(gate, up, gate)  # the same kernel the dense FFN uses
        down_proj(lw, gate, out, n_threads)  # ffn_down_t, or ffn_down in row layout (--dense)
        self.stats.total += n_tok * n_ff
        self.stats.active += n_tok * n_ff
        self.stats.candidates += n_tok * n_ff
        return out

    def _other_family(self, lw, layer, x, h, out, n_threads):
        """Non-gated FFNs (the up projection + bias selects), dReLU, fatrelu, GELU: records |a|
        (exact zeros of relu/fatrelu; the "relu" sparse mode) or |coef| (GELU: the "glu" mode)."""
        n_tok, n_ff = h.shape[0], self.cfg.n_ff
        a, coef = ffn_coef(self.cfg, lw, h, n_threads)
        s = int(self.cursor[layer])
        if s + n_tok > self.x_rec.shape[1]:
            raise AssertionError("RecordingFFN: more tokens than allocated")
        self.x_rec[layer, s:s + n_tok] = x
        self.act_rec[layer, s:s + n_tok] = np.abs(a if sparse_mode(self.cfg) == C.SPARSE_MODE_RELU
                                                  else coef)
        self.cursor[layer] = s + n_tok
        down_b(lw, coef, out, n_threads)
        self.stats.total += n_tok * n_ff
        self.stats.active += n_tok * n_ff
        self.stats.candidates += n_tok * n_ff
        return out


def sparse_mode(cfg) -> str:
    """The sparse mode the offline stage calibrates: "relu" for activations with exact zeros
    (relu, dReLU, fatrelu; the neuron is active where its activation is non-zero), "glu" else."""
    return C.SPARSE_MODE_RELU if cfg.hidden_act in ("relu", "fatrelu") else C.SPARSE_MODE_GLU


@dataclass
class Profile:
    """What the profiler recorded: x (n_layer, n_tok, n_embd) f32, act (n_layer, n_tok, n_ff) f16
    = |act(gate)|, and the tokens evaluated, in order."""

    x: np.ndarray
    act: np.ndarray  # relu(gate) (ReLU models) or |silu(gate) * up| (SwiGLU models)
    tokens: list[int]

    @property
    def n_tokens(self) -> int:
        return self.x.shape[1]


def chunks(sequences: list[list[int]], chunk_len: int) -> list[list[int]]:
    """Each sequence cut into pieces of at most ``chunk_len`` tokens (each evaluated from pos 0)."""
    out = []
    for seq in sequences:
        for i in range(0, len(seq), chunk_len):
            out.append(list(seq[i:i + chunk_len]))
    return out


def profile(engine, sequences: list[list[int]], chunk_len: int = 512,
            progress: bool | None = None) -> Profile:
    """Evaluate ``sequences`` (token ids) with ``engine`` and record every layer's FFN input and
    activations (see the module docstring). chunk_len <= engine.n_ctx. The engine's FFN is
    restored afterwards."""
    from pyinfer.progress import progress_bar

    if chunk_len > engine.n_ctx:
        raise ValueError(f"chunk_len {chunk_len} > engine context {engine.n_ctx}")
    pieces = chunks(sequences, chunk_len)
    n = sum(len(p) for p in pieces)
    if n == 0:
        raise PyinferError("no calibration tokens to profile")
    rec = RecordingFFN(engine.cfg, n)
    saved = engine.model.ffn
    engine.model.ffn = rec
    tokens: list[int] = []
    try:
        for piece in progress_bar(pieces, desc="profiling", unit="chunk", enabled=progress):
            engine.reset()
            engine.forward(piece, 0, all_logits=False)
            tokens += piece
    finally:
        engine.model.ffn = saved
        engine.reset()
    return Profile(rec.x_rec, rec.act_rec, tokens)


def activity(act: np.ndarray, mode: str, target_sparsity: float) -> tuple[np.ndarray, float]:
    """One layer's (active mask (n_tok, n_ff) bool, activation threshold).

    act: (n_tok, n_ff) magnitudes (f16). mode "relu": active where act > 0, threshold 0.
    modes "glu"/"cats": threshold = the ``target_sparsity`` quantile of act over all (token, neuron)
    pairs, active where act > threshold (SparseFFN's strict comparison)."""
    if mode == C.SPARSE_MODE_RELU:
        return act > 0, 0.0
    a = act.astype(np.float32)
    thr = float(np.float32(np.quantile(a, target_sparsity)))
    return a > np.float32(thr), thr
