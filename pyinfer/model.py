"""The Llama forward pass on the CPU: embed -> layers (attention, FFN) -> norm -> logits.

Reads top to bottom like llama2.c ``run.c: forward()`` and gpt-fast ``model.py``. The FFN is a
separate object (``pyinfer.ffn``: dense, or sparse over predicted-active neurons) so the
attention half never changes when the FFN does.
"""
from __future__ import annotations

import numpy as np

from pyinfer.config import ModelConfig
from pyinfer.errors import PyinferError
from pyinfer.ffn import DenseFFN, linear, linear_many
from pyinfer.kv_cache import CACHE_TYPE_AUTO, KVCache, cache_dtype
from pyinfer.ops import cpu
from pyinfer.ops import families as fam
from pyinfer.weights import ModelWeights, fused_model


def weights_are_f32(weights: ModelWeights) -> bool:
    """True where the first layer's attention weights are f32 (the reference-accuracy file:
    ``--cache-type auto`` then keeps the KV cache in f32)."""
    lw = weights.layers[0]
    t = lw.wq if lw.wq is not None else lw.attn_qkv_t
    return t is not None and int(t.qtype) == int(cpu.QT.F32)


class Model:
    """A decoder-only transformer over memory-mapped weights with a preallocated KV cache.

    Llama files run the compiled Llama kernels (fused per half-layer when decoding); the other
    families (``ModelConfig`` fields after ``name``: LayerNorm, biases, learned positions, scaled
    RoPE, sliding windows, parallel blocks, Gemma 3's extra norms and scales) run the kernel-by-kernel
    loop of ``run_layers``, where one token's attention half is one kernel call too wherever
    ``attn_fusable`` says so (Gemma 3, Mistral's and Qwen2's sliding windows). A dense file whose
    ffn_down is in row layout (a llama.cpp or ``--dense`` file) decodes a token's layers in one
    kernel call instead (``_dense_rows_plan``), sparse mode input likewise (its own plan)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_ctx: int, n_threads: int = 1,
                 ffn=None, fused: bool = True, cache_type: str = CACHE_TYPE_AUTO, lm_head=None):
        self.fused = fused  # one-token steps through the fused half-layer kernels
        self.cfg = cfg
        self.w = weights
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.cache = KVCache(cfg, n_ctx, cache_dtype(cache_type, weights_are_f32(weights)))
        self.ffn = ffn if ffn is not None else DenseFFN(cfg)
        # sparse mode "input" (pyinfer.input_sparse): the FFN object also runs q/k/v/o
        self.input_sparse = self.ffn if getattr(self.ffn, "is_input_sparse", False) else None
        # the lm head over output_ib (input_sparse.InputSparseHead: sparse mode input's own, or
        # a two-stage head given for a file of another mode); None: the dense head
        self.lm_head = lm_head if lm_head is not None else self.input_sparse
        self.llama_plain = cfg.llama_plain and weights.llama_plain  # the fused kernels fit
        # one-token steps through the fused CPU kernels, which also take Llama 3's RoPE divisors
        # and Qwen2's q/k/v biases (the GPU engine takes them too; sparse mode input likewise)
        self.llama_fused = fused_model(cfg, weights)
        # the other families' one-token attention half in one kernel call (Gemma 3's norms,
        # scale and window included); their FFN half stays the loop's unless the dense plan
        # (_dense_rows_plan) takes the whole token
        self.attn_fused = not self.llama_fused and attn_fusable(cfg, weights)
        # the factor folded into Q where the family's score scale (Gemma 3's
        # query_pre_attn_scalar^-0.5) differs from the kernels' head_dim^-0.5; 1: none
        self.q_scale = (np.float32(cfg.attn_scale * np.sqrt(cfg.head_dim)) if cfg.attn_scale
                        else np.float32(1.0))
        if self.input_sparse is not None:
            self.input_sparse.rope_freqs = weights.rope_freqs
        # a dense model's token in one kernel call (``cpu.decode_layers_rows``; built at the first
        # token, False where it does not apply); a tool that wraps the half-layer methods sets
        # whole_token False
        self.whole_token = True
        self._rows_plan = None
        if cfg.positions == "learned" and n_ctx > weights.pos_embd.rows:
            raise PyinferError(f"a context of {n_ctx} exceeds the {weights.pos_embd.rows} learned "
                               "positions of this model (-c/--ctx-size)")

    @property
    def head_stats(self):
        """The lm head's input counts (``InputSparseHead.head_stats``), or None (dense head)."""
        return None if self.lm_head is None else self.lm_head.head_stats

    def embed(self, tokens, n_past: int) -> np.ndarray:
        """(n_tok, n_embd) f32 embeddings of ``tokens``; ValueError when they do not fit after
        n_past tokens in the context."""
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
        T = ids.shape[0]
        if T == 0 or n_past + T > self.n_ctx:
            raise ValueError(f"{n_past} + {T} tokens do not fit in a context of {self.n_ctx}")
        x = np.empty((T, self.cfg.n_embd), np.float32)  # (n_tok, n_embd) residual stream
        cpu.get_rows(self.w.token_embd, ids, x)
        if self.w.pos_embd is not None:  # learned positions (OPT; the converter removed its offset)
            pos = np.empty_like(x)
            cpu.get_rows(self.w.pos_embd, np.arange(n_past, n_past + T, dtype=np.int32), pos)
            x += pos
        if self.cfg.embd_scale != 1.0:  # Gemma: embeddings times sqrt(n_embd), in f32 as HF does
            x *= np.float32(self.cfg.embd_scale)
        return x

    def set_cache_type(self, cache_type: str) -> None:
        """A fresh, empty KV cache of ``cache_type`` ("auto", "f16", "f32": ``kv_cache.cache_dtype``)
        in place of the current one (what it held is gone). ValueError for another name."""
        self.cache = KVCache(self.cfg, self.n_ctx, cache_dtype(cache_type, weights_are_f32(self.w)))

    def forward(self, tokens, n_past: int, all_logits: bool = False) -> np.ndarray:
        """Evaluate ``tokens`` at positions n_past.. and return logits.

        tokens: int sequence (n_tok,). Returns (n_vocab,) float32 logits of the last token, or
        (n_tok, n_vocab) with ``all_logits``. The KV cache rows n_past..n_past+n_tok-1 are written.
        Raises ValueError when the tokens do not fit in the context.
        """
        x = self.embed(tokens, n_past)
        isp = self.input_sparse
        if (x.shape[0] == 1 and not all_logits and self._whole_token_input()
                and isp.head_fits(self.w)):  # layers and head in one kernel call
            logits = np.empty(self.cfg.n_vocab, np.float32)
            isp.decode_layers(self.w.layers, x[0], self.cache.k, self.cache.v, n_past, 0,
                              self.n_threads, self.w, logits)
            if not np.isfinite(x[0].sum()):  # see logits(): a broken hidden state says so
                logits.fill(np.nan)
            return logits
        self.run_layers(x, n_past, 0)
        return self.logits(x, all_logits)

    def _whole_token_input(self) -> bool:
        """True where one token's layers go through ``InputSparseFFN.decode_layers`` (one kernel
        call): the fused Llama path of an input-sparse model with ``whole_token`` set and its
        own FFN decode (a tool that wraps the half-layer methods turns it off)."""
        isp = self.input_sparse
        return (self.fused and self.llama_fused and isp is not None and isp.whole_token
                and getattr(self.ffn, "decode", None) == isp.decode)

    def run_layers(self, x: np.ndarray, n_past: int, first: int = 0) -> np.ndarray:
        """Layers ``first``.. on the residual stream x (n_tok, n_embd) f32, in place; returns x.
        (A GPU model runs its leading layers on the device and hands the rest to this.)"""
        cfg, w, nt = self.cfg, self.w, self.n_threads
        T = x.shape[0]
        if T == 1 and self.fused and self.whole_token and self._dense_rows_plan():
            # every layer in one kernel call: _decode_attn and the FFN half of each
            cpu.decode_layers_rows(self._rows_plan, x[0], self.cache.k, self.cache.v, n_past,
                                   first, nt)
            self.ffn.stats.count_dense(cfg.n_layer - first, cfg.n_ff)
            return x
        if T == 1 and self.fused and self.llama_fused:
            return self._decode_fused(x, n_past, first)
        positions = np.arange(n_past, n_past + T, dtype=np.int32)
        h = np.empty_like(x)  # (n_tok, n_embd) normed input of a sublayer
        q = np.empty((T, cfg.n_embd_q), np.float32)  # (n_tok, n_head * head_dim)
        k = np.empty((T, cfg.n_embd_kv), np.float32)  # (n_tok, n_head_kv * head_dim)
        v = np.empty((T, cfg.n_embd_kv), np.float32)
        attn = np.empty((T, cfg.n_head, cfg.head_dim), np.float32)
        y = np.empty_like(x)  # (n_tok, n_embd) sublayer output
        y2 = np.empty_like(x) if cfg.parallel_block else None  # (n_tok, n_embd) parallel FFN
        angles = {}  # RoPE base -> rope_table of the positions: computed once for every layer
        isp = self.input_sparse
        one = T == 1 and self.fused and self.attn_fused and isp is None
        for i in range(first, cfg.n_layer):
            lw = w.layers[i]
            if one:  # the attention half in one kernel call, x += its output
                self._decode_attn(lw, i, x[0], n_past)
            else:
                self._attention(lw, i, x, h, q, k, v, attn, y, positions, angles, n_past)
                if cfg.parallel_block:  # Falcon: the FFN reads the layer's input too
                    fam.norm(cfg, x, lw.ffn_norm, lw.ffn_norm_b, h)
                    self.ffn(lw, i, x, h, y2, nt)
                    x += y
                    x += y2
                    continue
                x += y
            # feed-forward
            fam.norm(cfg, x, lw.ffn_norm, lw.ffn_norm_b, h)
            self.ffn(lw, i, x, h, y, nt)
            if lw.ffn_post_norm is not None:
                _rmsnorm_inplace(y, lw.ffn_post_norm, cfg.rms_eps)
            x += y
        return x

    def _attention(self, lw, i: int, x: np.ndarray, h: np.ndarray, q: np.ndarray, k: np.ndarray,
                   v: np.ndarray, attn: np.ndarray, y: np.ndarray, positions: np.ndarray,
                   angles: dict, n_past: int) -> None:
        """Layer i's attention half kernel by kernel: y (n_tok, n_embd) = its output for the
        residual x (n_tok, n_embd), the tokens' K/V written to the cache; h, q, k, v, attn are
        (n_tok, ...) scratch as ``run_layers`` allocates them, angles its RoPE tables."""
        cfg, nt, isp = self.cfg, self.n_threads, self.input_sparse
        T = x.shape[0]
        fam.norm(cfg, x, lw.attn_norm, lw.attn_norm_b, h)
        if isp is None:
            linear_many((lw.wq, lw.wk, lw.wv), h, (q, k, v), nt)  # h quantized once
            for proj, b in ((q, lw.bq), (k, lw.bk), (v, lw.bv)):  # Qwen2's biases
                if b is not None:
                    proj += b
        else:  # input sparsity (Llama-shaped files only): q, k, v from the transposed [wq; wk; wv]
            isp.qkv(lw, i, h, q, k, v, nt)
        q3 = q.reshape(T, cfg.n_head, cfg.head_dim)
        k3 = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
        fam.head_norms(q3, k3, lw, cfg.rms_eps)  # Gemma 3, Qwen3: per head, before RoPE
        if cfg.positions == "rope":
            self._rope(q3, positions, cfg.rope_base(i), angles)
            self._rope(k3, positions, cfg.rope_base(i), angles)
        if cfg.attn_scale:  # the kernels scale scores by head_dim^-0.5: fold the rest into Q
            q3 *= self.q_scale
        _kv_store(self.cache.k[i, n_past:n_past + T], k3)  # k3: what the norm and RoPE wrote
        _kv_store(self.cache.v[i, n_past:n_past + T], v)
        window = cfg.window(i)
        if window and n_past + T > window:
            fam.attention_window(q3, self.cache.k[i], self.cache.v[i], n_past, window, attn, nt)
        else:
            cpu.attention(q3, self.cache.k[i], self.cache.v[i], n_past, attn, nt)
        if isp is None:
            _linear_b(lw.wo, lw.bo, attn.reshape(T, cfg.n_embd_q), y, nt)
        else:
            isp.attn_out(lw, i, attn.reshape(T, cfg.n_embd_q), y, nt)
        if lw.attn_post_norm is not None:  # Gemma 3: the sublayer's output is normed too
            _rmsnorm_inplace(y, lw.attn_post_norm, cfg.rms_eps)

    def _decode_attn(self, lw, i: int, xv: np.ndarray, n_past: int) -> None:
        """Layer i's attention half for one token in one kernel call (``cpu.decode_attn``), in
        place on the residual xv (n_embd,): the same bits as ``_attention`` and ``x += y``
        (with RoPE divisors, Llama 3's, its angles come from C's libm, not NumPy's: within
        float rounding)."""
        cfg = self.cfg
        cpu.decode_attn(xv, lw.attn_norm, cfg.rms_eps, lw.wq, lw.wk, lw.wv, lw.wo,
                        self.cache.k[i], self.cache.v[i], n_past, cfg.n_head, cfg.rope_base(i),
                        self.n_threads, self.w.rope_freqs, lw.bq, lw.bk, lw.bv, lw.attn_q_norm,
                        lw.attn_k_norm, self.q_scale, cfg.window(i), lw.attn_post_norm)

    def _rope(self, x: np.ndarray, positions: np.ndarray, base: float, angles: dict) -> None:
        """RoPE in place on x (n_tok, n_heads, head_dim) with frequency base ``base`` and the
        file's frequency divisors; angles: base -> ``cpu.rope_table`` of the positions, filled
        here (the bits of ``cpu.rope_neox``, the cosines and sines once a forward)."""
        if self.w.rope_freqs is None:
            table = angles.get(base)
            if table is None:
                table = angles[base] = cpu.rope_table(positions, base, self.cfg.head_dim)
            cpu.rope_apply(x, table, self.n_threads)
        else:
            fam.rope_scaled(x, positions, base, self.w.rope_freqs)

    def _decode_fused(self, x: np.ndarray, n_past: int, first: int = 0) -> np.ndarray:
        """One token: per layer, the attention half in one kernel call (``cpu.decode_attn``) and
        the FFN half in one (``ffn.decode``) where the FFN supports it; the same function as the
        step-by-step loop in ``run_layers``."""
        cfg, w, nt = self.cfg, self.w, self.n_threads
        xv = x[0]
        ffn_decode = getattr(self.ffn, "decode", None)
        if self._whole_token_input():  # one kernel call
            self.input_sparse.decode_layers(w.layers, xv, self.cache.k, self.cache.v, n_past,
                                            first, nt)
            return x
        h = y = None
        for i in range(first, cfg.n_layer):
            lw = w.layers[i]
            if self.input_sparse is None:
                self._decode_attn(lw, i, xv, n_past)
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

    def _dense_rows_plan(self):
        """``cpu.dense_decode_plan`` of a dense model whose every layer's one-token step is
        ``_decode_attn`` and a gated FFN over ffn_down's rows (a llama.cpp or ``--dense`` file of
        a Llama-shaped model, Gemma 3, a windowed Mistral or Qwen2), made once; False where
        that is not the case. The FFN object is checked at every call (a tool may swap it: the
        profiler's recording FFN), the plan of the weights made once."""
        if type(self.ffn) is not DenseFFN or self.input_sparse is not None:
            return False
        if self._rows_plan is None:
            cfg, w = self.cfg, self.w
            ok = ((self.llama_fused or self.attn_fused)
                  and cfg.hidden_act in cpu.DENSE_ACTS and not cfg.ffn_up_act
                  and all(lw.ffn_gate is not None and lw.ffn_down_t is None
                          and lw.ffn_norm_b is None and lw.ffn_up_b is None
                          and lw.ffn_down_b is None for lw in w.layers))
            self._rows_plan = ok and cpu.dense_decode_plan(
                [(lw.attn_norm, lw.wq, lw.wk, lw.wv, lw.wo, lw.ffn_norm, lw.ffn_gate, lw.ffn_up,
                  lw.ffn_down, lw.bq, lw.bk, lw.bv, lw.attn_q_norm, lw.attn_k_norm,
                  lw.attn_post_norm, lw.ffn_post_norm, cfg.window(i))
                 for i, lw in enumerate(w.layers)], cfg.n_head, cfg.n_head_kv, cfg.head_dim,
                cfg.rms_eps, [cfg.rope_base(i) for i in range(cfg.n_layer)], cfg.hidden_act,
                self.q_scale, w.rope_freqs)
        return self._rows_plan

    def logits(self, x: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Final norm and output projection: (n_vocab,) of the last row, or (n_tok, n_vocab).
        A row whose hidden state holds NaN or inf gets NaN logits, for Engine._check_finite to
        report, whatever the head makes of it (an input-sparse head keeps NaN channels, but a
        two-stage head's candidate pick among NaN logits is arbitrary)."""
        cfg, w, nt = self.cfg, self.w, self.n_threads
        if not all_logits:
            x = x[-1:]
        h = np.empty_like(x)
        fam.norm(cfg, x, w.output_norm, w.output_norm_b, h)
        broken = ~np.isfinite(h.sum(axis=1))  # (n_tok,) a NaN anywhere in x spreads over h
        logits = np.empty((h.shape[0], cfg.n_vocab), np.float32)  # (n_tok, n_vocab)
        head = self.lm_head
        if head is not None and head.head_on(w):
            head.lm_head(w, h, logits, nt)  # input sparsity and/or the two-stage head
        else:
            linear(w.output, h, logits, nt)
        if cfg.final_softcap:  # Gemma: cap * tanh(logits / cap)
            fam.softcap(logits, cfg.final_softcap)
        if broken.any():
            logits[broken] = np.nan
        return logits if all_logits else logits[0]


def attn_fusable(cfg: ModelConfig, weights: ModelWeights) -> bool:
    """True where ``cpu.decode_attn`` computes every layer's attention half of one token as
    ``Model._attention`` does (bit for bit without RoPE divisors): RMSNorm, RoPE, a sequential
    block, separate q/k/v/o matrices without an output bias (Gemma 3's head norms, score
    scale, sliding window and post-norm, and Qwen2's q/k/v biases, are the kernel's own)."""
    return (cfg.norm == "rms" and cfg.positions == "rope" and not cfg.parallel_block
            and all(lw.wq is not None and lw.wk is not None and lw.wv is not None
                    and lw.wo is not None and lw.attn_norm_b is None and lw.bo is None
                    and (lw.attn_q_norm is None) == (lw.attn_k_norm is None)
                    for lw in weights.layers))


def _rmsnorm_inplace(y: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y (n_tok, n) f32 replaced by its RMSNorm with ``weight`` (n,) (the kernel reads a row's
    sum of squares before writing the row: out may be y)."""
    cpu.rmsnorm(y, weight, eps, y)
    return y


def _kv_store(dst: np.ndarray, src: np.ndarray) -> None:
    """dst (n_tok, n_head_kv, head_dim) cache rows = src f32 of as many values ((n_tok,
    n_head_kv, head_dim) or (n_tok, n_head_kv * head_dim)): into an f16 cache through
    ``cpu.f32_to_f16`` (F16C, NumPy's astype bits for every non-NaN value, about 20x faster),
    otherwise copied by NumPy."""
    if dst.dtype == np.float16 and dst.flags.c_contiguous:
        cpu.f32_to_f16(np.ascontiguousarray(src, np.float32).reshape(-1),
                       dst.reshape(-1).view(np.uint16))
    else:
        dst[...] = src.reshape(dst.shape)


def _linear_b(w: cpu.QTensor, b: np.ndarray | None, x: np.ndarray, out: np.ndarray,
              n_threads: int) -> np.ndarray:
    """out = x @ w.T (+ b): ``linear`` with an optional (rows,) f32 bias."""
    linear(w, x, out, n_threads)
    if b is not None:
        out += b
    return out
