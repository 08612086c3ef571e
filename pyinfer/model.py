"""The Llama forward pass on the CPU: embed -> layers (attention, FFN) -> norm -> logits.

Reads top to bottom like llama2.c ``run.c: forward()`` and gpt-fast ``model.py``. The FFN is a
separate object (``pyinfer.ffn``: dense, or sparse over predicted-active neurons) so the
attention half never changes when the FFN does.
"""
from __future__ import annotations

import numpy as np

from pyinfer.config import ModelConfig
from pyinfer.ffn import DenseFFN, linear
from pyinfer.kv_cache import KVCache
from pyinfer.ops import cpu
from pyinfer.weights import ModelWeights


class Model:
    """A Llama-family transformer over memory-mapped weights with a preallocated KV cache."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_ctx: int, n_threads: int = 1,
                 ffn=None, fused: bool = True):
        self.fused = fused  # one-token steps through the fused half-layer kernels
        self.cfg = cfg
        self.w = weights
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.cache = KVCache(cfg, n_ctx)
        self.ffn = ffn if ffn is not None else DenseFFN(cfg)
        # sparse mode "input" (pyinfer.input_sparse): the FFN object also runs q/k/v/o
        self.input_sparse = self.ffn if getattr(self.ffn, "is_input_sparse", False) else None

    def embed(self, tokens, n_past: int) -> np.ndarray:
        """(n_tok, n_embd) f32 embeddings of ``tokens``; ValueError when they do not fit after
        n_past tokens in the context."""
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        T = ids.shape[0]
        if T == 0 or n_past + T > self.n_ctx:
            raise ValueError(f"{n_past} + {T} tokens do not fit in a context of {self.n_ctx}")
        x = np.empty((T, self.cfg.n_embd), np.float32)  # (n_tok, n_embd) residual stream
        cpu.get_rows(self.w.token_embd, ids, x)
        return x

    def forward(self, tokens, n_past: int, all_logits: bool = False) -> np.ndarray:
        """Evaluate ``tokens`` at positions n_past.. and return logits.

        tokens: int sequence (n_tok,). Returns (n_vocab,) float32 logits of the last token, or
        (n_tok, n_vocab) with ``all_logits``. The KV cache rows n_past..n_past+n_tok-1 are written.
        Raises ValueError when the tokens do not fit in the context.
        """
        x = self.embed(tokens, n_past)
        self.run_layers(x, n_past, 0)
        return self.logits(x, all_logits)

    def run_layers(self, x: np.ndarray, n_past: int, first: int = 0) -> np.ndarray:
        """Layers ``first``.. on the residual stream x (n_tok, n_embd) f32, in place; returns x.
        (A GPU model runs its leading layers on the device and hands the rest to this.)"""
        cfg, w, nt = self.cfg, self.w, self.n_threads
        T = x.shape[0]
        if T == 1 and self.fused:
            return self._decode_fused(x, n_past, first)
        positions = np.arange(n_past, n_past + T, dtype=np.int32)
        h = np.empty_like(x)  # (n_tok, n_embd) normed input of a sublayer
        q = np.empty((T, cfg.n_embd_q), np.float32)  # (n_tok, n_head * head_dim)
        k = np.empty((T, cfg.n_embd_kv), np.float32)  # (n_tok, n_head_kv * head_dim)
        v = np.empty((T, cfg.n_embd_kv), np.float32)
        attn = np.empty((T, cfg.n_head, cfg.head_dim), np.float32)
        y = np.empty_like(x)  # (n_tok, n_embd) sublayer output
        isp = self.input_sparse
        for i in range(first, cfg.n_layer):
            lw = w.layers[i]
            # attention
            cpu.rmsnorm(x, lw.attn_norm, cfg.rms_eps, h)
            if isp is None:
                linear(lw.wq, h, q, nt)
                linear(lw.wk, h, k, nt)
                linear(lw.wv, h, v, nt)
            else:  # input sparsity: q, k, v from the transposed [wq; wk; wv]
                isp.qkv(lw, i, h, q, k, v, nt)
            q3 = q.reshape(T, cfg.n_head, cfg.head_dim)
            k3 = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
            cpu.rope_neox(q3, positions, cfg.rope_freq_base, cfg.head_dim)
            cpu.rope_neox(k3, positions, cfg.rope_freq_base, cfg.head_dim)
            self.cache.k[i, n_past:n_past + T] = k3
            self.cache.v[i, n_past:n_past + T] = v.reshape(T, cfg.n_head_kv, cfg.head_dim)
            cpu.attention(q3, self.cache.k[i], self.cache.v[i], n_past, attn, nt)
            if isp is None:
                linear(lw.wo, attn.reshape(T, cfg.n_embd_q), y, nt)
            else:
                isp.attn_out(lw, i, attn.reshape(T, cfg.n_embd_q), y, nt)
            x += y
            # feed-forward
            cpu.rmsnorm(x, lw.ffn_norm, cfg.rms_eps, h)
            self.ffn(lw, i, x, h, y, nt)
            x += y
        return x

    def _decode_fused(self, x: np.ndarray, n_past: int, first: int = 0) -> np.ndarray:
        """One token: per layer, the attention half in one kernel call (``cpu.decode_attn``) and
        the FFN half in one (``ffn.decode``) where the FFN supports it; the same function as the
        step-by-step loop in ``run_layers``."""
        cfg, w, nt = self.cfg, self.w, self.n_threads
        xv = x[0]
        ffn_decode = getattr(self.ffn, "decode", None)
        h = y = None
        for i in range(first, cfg.n_layer):
            lw = w.layers[i]
            if self.input_sparse is None:
                cpu.decode_attn(xv, lw.attn_norm, cfg.rms_eps, lw.wq, lw.wk, lw.wv, lw.wo,
                                self.cache.k[i], self.cache.v[i], n_past, cfg.n_head,
                                cfg.rope_freq_base, nt)
            else:
                self.input_sparse.decode_attn(lw, i, xv, self.cache.k[i], self.cache.v[i],
                                              n_past, nt)
            if ffn_decode is None or not ffn_decode(lw, i, xv, cfg.rms_eps, nt):
                if h is None:
                    h, y = np.empty_like(x), np.empty_like(x)
                cpu.rmsnorm(x, lw.ffn_norm, cfg.rms_eps, h)
                self.ffn(lw, i, x, h, y, nt)
                x += y
        return x

    def logits(self, x: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Final norm and output projection: (n_vocab,) of the last row, or (n_tok, n_vocab)."""
        cfg, w, nt = self.cfg, self.w, self.n_threads
        if not all_logits:
            x = x[-1:]
        h = np.empty_like(x)
        cpu.rmsnorm(x, w.output_norm, cfg.rms_eps, h)
        logits = np.empty((h.shape[0], cfg.n_vocab), np.float32)  # (n_tok, n_vocab)
        linear(w.output, h, logits, nt)
        return logits if all_logits else logits[0]
