"""The Llama forward pass on the CPU: embed -> layers (attention, FFN) -> norm -> logits.

Reads top to bottom like llama2.c ``run.c: forward()`` and gpt-fast ``model.py``. The FFN is a
separate object (``DenseFFN`` here; the sparse, predictor-driven FFN slots in beside it) so the
attention half never changes when the FFN does.
"""
from __future__ import annotations

import numpy as np

from pyinfer.config import ModelConfig
from pyinfer.kv_cache import KVCache
from pyinfer.ops import cpu
from pyinfer.weights import LayerWeights, ModelWeights


def linear(w: cpu.QTensor, x: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
    """out = x @ w.T for x (n_tok, cols) -> out (n_tok, rows); GEMV when n_tok is 1."""
    if x.shape[0] == 1:
        cpu.matvec(w, x[0], out[0], n_threads)
    else:
        cpu.matmul(w, x, out, n_threads)
    return out


def linear_t(w: cpu.QTensor, a: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
    """out = a @ w for a (n_tok, rows) -> out (n_tok, cols): the neuron-major down projection."""
    if a.shape[0] == 1:
        cpu.matvec_t(w, a[0], out[0], n_threads)
    else:
        cpu.matmul_t(w, a, out, n_threads)
    return out


class DenseFFN:
    """Every neuron of the FFN: down_t^T (act(gate x) * up x), PowerInfer's layout with all rows.

    Counts the neurons it computes so the engine can report the fraction of FFN work done.
    """

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.mul = cpu.silu_mul if cfg.hidden_act == "silu" else cpu.relu_mul
        self.neurons_computed = 0
        self.neurons_total = 0

    def __call__(self, lw: LayerWeights, layer: int, x: np.ndarray, h: np.ndarray,
                 out: np.ndarray, n_threads: int) -> np.ndarray:
        """x: (n_tok, n_embd) residual before the FFN norm (predictors read it); h: normed x.

        Writes the FFN output (n_tok, n_embd) into ``out`` and returns it.
        """
        n_tok, n_ff = h.shape[0], self.cfg.n_ff
        gate = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
        up = np.empty((n_tok, n_ff), np.float32)  # (n_tok, n_ff)
        linear(lw.ffn_gate, h, gate, n_threads)
        linear(lw.ffn_up, h, up, n_threads)
        self.mul(gate, up, gate)
        linear_t(lw.ffn_down_t, gate, out, n_threads)
        self.neurons_computed += n_tok * n_ff
        self.neurons_total += n_tok * n_ff
        return out


class Model:
    """A Llama-family transformer over memory-mapped weights with a preallocated KV cache."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_ctx: int, n_threads: int = 1,
                 ffn=None):
        self.cfg = cfg
        self.w = weights
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.cache = KVCache(cfg, n_ctx)
        self.ffn = ffn if ffn is not None else DenseFFN(cfg)

    def forward(self, tokens, n_past: int, all_logits: bool = False) -> np.ndarray:
        """Evaluate ``tokens`` at positions n_past.. and return logits.

        tokens: int sequence (n_tok,). Returns (n_vocab,) float32 logits of the last token, or
        (n_tok, n_vocab) with ``all_logits``. The KV cache rows n_past..n_past+n_tok-1 are written.
        Raises ValueError when the tokens do not fit in the context.
        """
        cfg, w, nt = self.cfg, self.w, self.n_threads
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        T = ids.shape[0]
        if T == 0 or n_past + T > self.n_ctx:
            raise ValueError(f"{n_past} + {T} tokens do not fit in a context of {self.n_ctx}")
        positions = np.arange(n_past, n_past + T, dtype=np.int32)

        x = np.empty((T, cfg.n_embd), np.float32)  # (n_tok, n_embd) residual stream
        cpu.get_rows(w.token_embd, ids, x)
        h = np.empty_like(x)  # (n_tok, n_embd) normed input of a sublayer
        q = np.empty((T, cfg.n_embd_q), np.float32)  # (n_tok, n_head * head_dim)
        k = np.empty((T, cfg.n_embd_kv), np.float32)  # (n_tok, n_head_kv * head_dim)
        v = np.empty((T, cfg.n_embd_kv), np.float32)
        attn = np.empty((T, cfg.n_head, cfg.head_dim), np.float32)
        y = np.empty_like(x)  # (n_tok, n_embd) sublayer output
        for i, lw in enumerate(w.layers):
            # attention
            cpu.rmsnorm(x, lw.attn_norm, cfg.rms_eps, h)
            linear(lw.wq, h, q, nt)
            linear(lw.wk, h, k, nt)
            linear(lw.wv, h, v, nt)
            q3 = q.reshape(T, cfg.n_head, cfg.head_dim)
            k3 = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
            cpu.rope_neox(q3, positions, cfg.rope_freq_base, cfg.head_dim)
            cpu.rope_neox(k3, positions, cfg.rope_freq_base, cfg.head_dim)
            self.cache.k[i, n_past:n_past + T] = k3
            self.cache.v[i, n_past:n_past + T] = v.reshape(T, cfg.n_head_kv, cfg.head_dim)
            cpu.attention(q3, self.cache.k[i], self.cache.v[i], n_past, attn, nt)
            linear(lw.wo, attn.reshape(T, cfg.n_embd_q), y, nt)
            x += y
            # feed-forward
            cpu.rmsnorm(x, lw.ffn_norm, cfg.rms_eps, h)
            self.ffn(lw, i, x, h, y, nt)
            x += y

        if not all_logits:
            x = x[-1:]
            h = h[-1:]
        cpu.rmsnorm(x, w.output_norm, cfg.rms_eps, h)
        logits = np.empty((h.shape[0], cfg.n_vocab), np.float32)  # (n_tok, n_vocab)
        linear(w.output, h, logits, nt)
        return logits if all_logits else logits[0]
