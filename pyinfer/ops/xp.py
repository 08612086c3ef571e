"""Transformer pieces written once over an array module ``xp`` (NumPy or CuPy).

The GPU-resident forward (``pyinfer.gpu_model``) runs its batched steps (prefill) with these on
CuPy arrays; ``pyinfer.device.NumpyDevice`` runs the same functions on NumPy arrays as the twins
of the one-token RawKernels (rmsnorm, rope_store, attn_decode), so the tests on a machine without
a GPU exercise the code the GPU runs. Formulas are those of ``pyinfer.ops.reference`` (the CPU
kernels' twins): RMSNorm (Zhang & Sennrich 2019), rotary embedding in Hugging Face's rotate_half
(NeoX) layout (Su et al. 2021), causal grouped-query softmax attention with scale 1/sqrt(head_dim).
Every function takes and returns float32 arrays.
"""
from __future__ import annotations

import numpy as np


def array_module(a):
    """``cupy`` for a CuPy array, else ``numpy`` (CuPy's ``get_array_module`` without importing
    CuPy on machines that lack it)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def rmsnorm(x, w, eps: float, out=None):
    """out = x / sqrt(mean(x^2, axis=-1) + eps) * w. x (n_tok, n), w (n,)."""
    xp = array_module(x)
    ms = xp.mean(x * x, axis=-1, keepdims=True, dtype=xp.float32)
    y = (x * (1.0 / xp.sqrt(ms + xp.float32(eps)))) * w
    if out is None:
        return y.astype(xp.float32, copy=False)
    out[...] = y
    return out


def rope_cos_sin(n_ctx: int, head_dim: int, freq_base: float,
                 divisors: np.ndarray | None = None) -> np.ndarray:
    """(n_ctx, head_dim/2, 2) f32 table of cos and sin of pos * base^(-2i/head_dim), computed in
    f64 as the CPU kernel does (cython/kernels.pyx ``_rope1``); with ``divisors`` (head_dim/2,)
    the frequencies divided by them (Llama 3's rope_freqs, ``families.rope_scaled``)."""
    half = head_dim // 2
    inv = float(freq_base) ** (-2.0 * np.arange(half) / head_dim)
    if divisors is not None:
        inv = inv / np.asarray(divisors, np.float64)
    theta = np.arange(n_ctx, dtype=np.float64)[:, None] * inv  # (n_ctx, half)
    return np.stack([np.cos(theta), np.sin(theta)], axis=-1).astype(np.float32)


def rope(x, cos_sin, pos0: int):
    """NeoX rotary embedding of x (n_tok, n_heads, head_dim) in place for positions pos0.., with
    the table of :func:`rope_cos_sin` (on x's device). Returns x."""
    T, _, hd = x.shape
    half = hd // 2
    cs = cos_sin[pos0:pos0 + T]  # (T, half, 2)
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    a = x[..., :half].copy()
    b = x[..., half:].copy()
    x[..., :half] = a * c - b * s
    x[..., half:] = b * c + a * s
    return x


def attention(q, cache_k, cache_v, n_past: int, q_chunk: int = 64):
    """Causal grouped-query attention of q (n_tok, n_head, hd) at positions n_past.. over cache
    rows < n_past + n_tok (caches (n_ctx, n_kv, hd), already holding this batch's keys and
    values). Returns (n_tok, n_head, hd). Queries go in chunks of ``q_chunk`` so the score block
    (chunk, n_head, n_att) stays bounded."""
    xp = array_module(q)
    T, H, hd = q.shape
    n_kv = cache_k.shape[1]
    g = H // n_kv
    n_att = n_past + T
    k = cache_k[:n_att].transpose(1, 0, 2)  # (n_kv, n_att, hd)
    v = cache_v[:n_att].transpose(1, 0, 2)
    out = xp.empty((T, H, hd), xp.float32)
    scale = xp.float32(1.0 / np.sqrt(hd))
    for t0 in range(0, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        qc = q[t0:t1].reshape(t1 - t0, n_kv, g, hd).transpose(1, 0, 2, 3)  # (n_kv, t, g, hd)
        qc = qc.reshape(n_kv, (t1 - t0) * g, hd)
        s = xp.matmul(qc, k.transpose(0, 2, 1)) * scale  # (n_kv, t*g, n_att)
        s = s.reshape(n_kv, t1 - t0, g, n_att)
        pos = n_past + xp.arange(t0, t1)[:, None]  # (t, 1)
        masked = xp.arange(n_att)[None, :] > pos  # (t, n_att)
        s = xp.where(masked[None, :, None, :], xp.float32(-np.inf), s)
        s = xp.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = xp.matmul(s.reshape(n_kv, (t1 - t0) * g, n_att), v)  # (n_kv, t*g, hd)
        out[t0:t1] = o.reshape(n_kv, t1 - t0, g, hd).transpose(1, 0, 2, 3).reshape(t1 - t0, H, hd)
    return out


def act(g, silu: bool):
    """silu(g) = g / (1 + exp(-g)) if ``silu``, else relu(g); f32."""
    xp = array_module(g)
    if silu:
        return g / (xp.float32(1.0) + xp.exp(-g))
    return xp.maximum(g, xp.float32(0.0))


def quantize_q8_parts(x):
    """x (..., n) f32 -> (q, d): q (..., n/32, 32) the int8 values (as f32), d (..., n/32, 1) f32
    the block scales, per 32-block d = max|x| / 127, q = rint(x * (1 / d)) (0 where d is 0): the
    quantized kernels' activation (simd.h pi_quantize_q8; ``pyinfer.ops.cuda.quantize_q8``)."""
    xp = array_module(x)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    d = (xp.abs(xb).max(axis=-1, keepdims=True) / xp.float32(127.0)).astype(xp.float32)
    safe = xp.where(d != 0, d, xp.float32(1.0))
    inv = xp.where(d != 0, xp.float32(1.0) / safe, xp.float32(0.0)).astype(xp.float32)
    return xp.rint(xb * inv), d


def quantize_act_q8(x):
    """x (..., n) f32 as the quantized kernels see it, dequantized (d * q) in f32
    (``quantize_q8_parts``; ``reference.quantize_act_q8`` on the CPU side)."""
    xp = array_module(x)
    q, d = quantize_q8_parts(x)
    return (q * d).reshape(x.shape).astype(xp.float32)


def mask_inputs(x, scale, thr: float):
    """Input sparsity's mask (sparse mode "input"; ``cpu.mask_inputs``): (x with x[..., j] set to 0
    where |x[..., j]| * scale[j] <= thr (a NaN is kept), the number of channels kept (an xp scalar)). x (..., n)
    f32, scale (n,) f32 or None (1); thr < 0 keeps every channel."""
    xp = array_module(x)
    s = xp.abs(x) if scale is None else xp.abs(x) * scale
    keep = ~(s <= xp.float32(thr))  # NaN kept, as the kernels
    return xp.where(keep, x, xp.float32(0.0)).astype(xp.float32), keep.sum()
