"""NumPy twins of the CPU kernels in pyinfer/ops/cpu.py: same names, same signatures, plain and slow.

They are the specification the compiled kernels are tested against (tests/test_kernels.py).
``dequantize`` decodes ggml blocks itself (ggml-common.h layout) and is itself checked against
``gguf.quants.dequantize``. ``n_threads`` arguments are accepted and ignored.
"""
from __future__ import annotations

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
#: types whose dot products see the activation quantized to 8 bits per 32-block
QUANT = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _is_ib(w) -> bool:
    return hasattr(w, "base_qtype")  # cpu.IBTensor


def dequantize(w) -> np.ndarray:
    """A QTensor's values as float32 (rows, cols); an IBTensor's as W^T (n_in, n_out), the
    row-major matrix it regroups (``IBTensor.to_rows``) transposed.

    q8_0 block: f16 d + int8 qs[32], x = d*q. q4_0 block: f16 d + uint8 qs[16],
    x[j] = d*((qs[j] & 15) - 8), x[j+16] = d*((qs[j] >> 4) - 8)."""
    if _is_ib(w):
        return np.ascontiguousarray(dequantize(w.to_rows()).T)
    if w.qtype == QT.F32:
        return np.asarray(w.data, dtype=np.float32)
    if w.qtype == QT.F16:
        return np.asarray(w.data).astype(np.float32)
    if w.qtype not in (QT.Q8_0, QT.Q4_0):  # the other types: gguf's own decoder is the twin
        return gguf.quants.dequantize(np.asarray(w.raw), w.qtype).astype(np.float32).reshape(
            w.rows, w.cols)
    nbytes = 34 if w.qtype == QT.Q8_0 else 18
    blocks = np.asarray(w.data).reshape(w.rows, w.cols // 32, nbytes)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    if w.qtype == QT.Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
    else:
        qs = blocks[..., 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32) - 8.0
    return (d * q).reshape(w.rows, w.cols)


def quantize_act_q8(x: np.ndarray) -> np.ndarray:
    """x (..., n) f32 as the quantized kernels see it: per 32-block d = amax/127 (f32),
    q = rint(x / d) as int8, returned dequantized (d*q) in f32. Mirrors simd.h pi_quantize_q8."""
    xb = np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv)
    return (q * d).reshape(x.shape).astype(np.float32)


def matmul_multi(ws, x, outs, n_threads=1):
    for w, out in zip(ws, outs):
        matmul(w, x, out)
    return outs


def matmul_glu(gate, up, x, out, silu=True, n_threads=1):
    g = x @ dequantize(gate).T
    with np.errstate(over="ignore"):  # exp(-g) = inf for g << 0: silu -> -0, as it should
        a = g / (1.0 + np.exp(-g)) if silu else np.maximum(g, 0.0)
    out[...] = a * (x @ dequantize(up).T)
    return out


def matvec(w, x, out, n_threads=1):
    out[...] = dequantize(w) @ x
    return out


def matmul(w, x, out, n_threads=1):
    out[...] = x @ dequantize(w).T
    return out


def matvec_t(w, a, out, n_threads=1):
    out[...] = a @ dequantize(w)
    return out


def matmul_t(w, a, out, n_threads=1):
    """an IBTensor's product sees a quantized as the GEMV sees it (ibsum.h)"""
    out[...] = (quantize_act_q8(a) if _is_ib(w) else a) @ dequantize(w)
    return out


def gather_matvec(w, x, idx, out, n_threads=1):
    out[...] = dequantize(w)[np.asarray(idx, dtype=np.int64)] @ x
    return out


def axpy_rows(w, coef, idx, out, n_threads=1):
    if _is_ib(w):  # the masked input, quantized per 32 channels as the GEMV's (ibsum.h)
        x = np.zeros(w.rows, np.float32)
        x[np.asarray(idx, dtype=np.int64)] = coef
        out[...] = quantize_act_q8(x) @ dequantize(w)
        return out
    out[...] = np.asarray(coef, dtype=np.float32) @ dequantize(w)[np.asarray(idx, dtype=np.int64)]
    return out


def _in_product(w, x, keep):
    """sum over kept j of x_j w[j] (w transposed, one row per input): exact for the transposed
    layouts, over the int8-quantized masked input for an IBTensor"""
    if _is_ib(w):
        return quantize_act_q8(np.where(keep, x, np.float32(0)).astype(np.float32)) @ dequantize(w)
    return x[keep] @ dequantize(w)[keep]


def get_rows(w, ids, out):
    out[...] = dequantize(w)[np.asarray(ids, dtype=np.int64)]
    return out


def rmsnorm(x, weight, eps, out):
    x = np.asarray(x, dtype=np.float32)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    out[...] = x / np.sqrt(ms + np.float32(eps)) * weight
    return out


def rope_neox(x, positions, freq_base, n_rot, n_threads=1):
    half = n_rot // 2
    inv_freq = float(freq_base) ** (-2.0 * np.arange(half) / n_rot)  # (half,) f64
    theta = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq  # (n_tok, half)
    cos = np.cos(theta)[:, None, :].astype(np.float32)
    sin = np.sin(theta)[:, None, :].astype(np.float32)
    x0 = x[..., :half].copy()
    x1 = x[..., half:n_rot].copy()
    x[..., :half] = x0 * cos - x1 * sin
    x[..., half:n_rot] = x1 * cos + x0 * sin
    return x


def attention(q, k_cache, v_cache, n_past, out, n_threads=1):
    n_tok, n_head, head_dim = q.shape
    group = n_head // k_cache.shape[1]
    n_kv = n_past + n_tok
    # (n_kv, n_head, head_dim) f32: an f16 cache's values exactly
    k = np.repeat(k_cache[:n_kv].astype(np.float32), group, axis=1)
    v = np.repeat(v_cache[:n_kv].astype(np.float32), group, axis=1)
    scores = np.einsum("thd,jhd->thj", q, k) / np.float32(np.sqrt(head_dim))
    mask = np.arange(n_kv)[None, :] > (n_past + np.arange(n_tok))[:, None]  # (n_tok, n_kv)
    scores = np.where(mask[:, None, :], -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    out[...] = np.einsum("thj,jhd->thd", scores, v)
    return out


def silu_mul(gate, up, out):
    g = np.asarray(gate, dtype=np.float32)
    out[...] = g / (np.float32(1.0) + np.exp(-g)) * up
    return out


def relu_mul(gate, up, out):
    out[...] = np.maximum(gate, np.float32(0.0)) * up
    return out


def _act(g, silu):
    g = np.asarray(g, dtype=np.float32)
    return g / (np.float32(1.0) + np.exp(-g)) if silu else np.maximum(g, np.float32(0.0))


def select_active(g, up, ids, silu, threshold, coef, idx):
    a = _act(g, silu)
    if up is not None:
        a = a * up
    keep = np.flatnonzero(~(np.abs(a) <= np.float32(threshold)))  # NaN kept
    n = keep.size
    coef[:n] = a[keep]
    idx[:n] = keep if ids is None else np.asarray(ids)[keep]
    return n


def _dot_input(w, x):
    """The activation a dot-product kernel sees: quantized to 8-bit blocks for q4_0/q8_0 rows."""
    return quantize_act_q8(x) if w.qtype in QUANT else np.asarray(x, np.float32)


def decode_attn(x, attn_norm, eps, wq, wk, wv, wo, k_cache, v_cache, n_past, n_head, freq_base,
                n_threads=1):
    n_kv, hd = k_cache.shape[1], k_cache.shape[2]
    h = rmsnorm(x[None], attn_norm, eps, np.empty((1, x.size), np.float32))[0]
    q = (dequantize(wq) @ _dot_input(wq, h)).astype(np.float32).reshape(1, n_head, hd)
    k = (dequantize(wk) @ _dot_input(wk, h)).astype(np.float32).reshape(1, n_kv, hd)
    v = (dequantize(wv) @ _dot_input(wv, h)).astype(np.float32).reshape(n_kv, hd)
    rope_neox(q, [n_past], freq_base, hd)
    rope_neox(k, [n_past], freq_base, hd)
    k_cache[n_past] = k[0]
    v_cache[n_past] = v
    att = attention(q, k_cache, v_cache, n_past, np.empty((1, n_head, hd), np.float32))
    x += (dequantize(wo) @ _dot_input(wo, att.reshape(-1))).astype(np.float32)
    return x


def decode_ffn(x, ffn_norm, eps, gate, up, down_t, mode, silu, threshold, n_threads=1,
               dense_above=1.0):
    n_ff = gate.rows
    h = rmsnorm(x[None], ffn_norm, eps, np.empty((1, x.size), np.float32))[0]
    a = _act(dequantize(gate) @ _dot_input(gate, h), silu)
    if mode != 2:
        a = a * (dequantize(up) @ _dot_input(up, h))
    keep = np.ones(n_ff, bool) if mode == 0 else ~(np.abs(a) <= np.float32(threshold))
    if mode == 2:
        a[keep] *= dequantize(up)[keep] @ _dot_input(up, h)
    x += (a[keep] @ dequantize(down_t)[keep]).astype(np.float32)
    return int(keep.sum())


def decode_ffn_rows(x, ffn_norm, eps, gate, up, down, silu, n_threads=1):
    h = rmsnorm(x[None], ffn_norm, eps, np.empty((1, x.size), np.float32))[0]
    a = (_act(dequantize(gate) @ _dot_input(gate, h), silu)
         * (dequantize(up) @ _dot_input(up, h))).astype(np.float32)
    x += (dequantize(down) @ _dot_input(down, a)).astype(np.float32)


def select_inputs(x, scale, threshold, coef, idx):
    s = np.abs(np.asarray(x, np.float32))
    if scale is not None:
        s = s * np.asarray(scale, np.float32)
    keep = np.flatnonzero(~(s <= np.float32(threshold)))
    coef[:keep.size] = np.asarray(x, np.float32)[keep]
    idx[:keep.size] = keep
    return keep.size


def _keep(x, scale, thr):
    s = np.abs(x) if scale is None else np.abs(x) * np.asarray(scale, np.float32)
    return ~(s <= np.float32(thr))  # NaN kept, as the kernels


def decode_ffn_in(x, ffn_norm, eps, gate_up_t, down_t, scale_gu, thr_gu, scale_d, thr_d, silu,
                  n_threads=1):
    n_ff = down_t.rows
    h = rmsnorm(x[None], ffn_norm, eps, np.empty((1, x.size), np.float32))[0]
    k1 = _keep(h, scale_gu, thr_gu)
    gu = _in_product(gate_up_t, h, k1)
    a = (_act(gu[:n_ff], silu) * gu[n_ff:]).astype(np.float32)
    k2 = _keep(a, scale_d, thr_d)
    x += _in_product(down_t, a, k2).astype(np.float32)
    return int(k1.sum()), int(k2.sum())


def decode_attn_in(x, attn_norm, eps, qkv_t, o_t, k_cache, v_cache, n_past, n_head, freq_base,
                   scale_qkv, thr_qkv, scale_o, thr_o, n_threads=1):
    n_kv, hd = k_cache.shape[1], k_cache.shape[2]
    nq, nkv = n_head * hd, n_kv * hd
    h = rmsnorm(x[None], attn_norm, eps, np.empty((1, x.size), np.float32))[0]
    k1 = _keep(h, scale_qkv, thr_qkv)
    qkv = _in_product(qkv_t, h, k1).astype(np.float32)
    q = qkv[:nq].reshape(1, n_head, hd).copy()
    k = qkv[nq:nq + nkv].reshape(1, n_kv, hd).copy()
    rope_neox(q, [n_past], freq_base, hd)
    rope_neox(k, [n_past], freq_base, hd)
    k_cache[n_past] = k[0]
    v_cache[n_past] = qkv[nq + nkv:].reshape(n_kv, hd)
    att = attention(q, k_cache, v_cache, n_past, np.empty((1, n_head, hd), np.float32)).reshape(-1)
    k2 = _keep(att, scale_o, thr_o)
    x += _in_product(o_t, att, k2).astype(np.float32)
    return int(k1.sum()), int(k2.sum())
