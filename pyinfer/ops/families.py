"""NumPy pieces that the non-Llama families need on the CPU, beside the compiled Llama kernels.

LayerNorm with bias (OPT, Falcon), the exact (erf) GELU (Falcon), RoPE with per-frequency divisors
(Llama 3 and linear scaling, llama.cpp's ``rope_freqs``) and sliding-window attention (Mistral,
Qwen2). Each follows the transformers code the converter reads the model from; the compiled
``pyinfer.ops.cpu`` kernels do the heavy work (matrix products, attention over a window's rows).
"""
from __future__ import annotations

import numpy as np

from pyinfer.ops import cpu


def layernorm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float,
              out: np.ndarray) -> np.ndarray:
    """out = (x - mean) / sqrt(var + eps) * weight + bias over the last axis (torch.nn.LayerNorm,
    biased variance). x, out (n_tok, n) f32; weight, bias (n,) f32 (bias may be None)."""
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x64 - mu) / np.sqrt(var + eps) * weight
    if bias is not None:
        y += bias
    out[...] = y
    return out


def norm(cfg, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
         out: np.ndarray) -> np.ndarray:
    """The model's norm (cfg.norm "rms" or "layer") of x (n_tok, n_embd) into out."""
    if cfg.norm == "layer":
        return layernorm(x, weight, bias, cfg.rms_eps, out)
    cpu.rmsnorm(x, weight, cfg.rms_eps, out)
    if bias is not None:
        out += bias
    return out


def erf(x: np.ndarray) -> np.ndarray:
    """erf elementwise, f64 inside: Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), since NumPy
    has no erf and the runtime takes no SciPy."""
    x = np.asarray(x, np.float64)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                         + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def act(name: str, g: np.ndarray, shift: float = 0.0, n_threads: int = 1) -> np.ndarray:
    """The FFN activation by its config name, as f32: silu, relu, gelu (exact: 0.5 g (1 +
    erf(g / sqrt 2)), torch.nn.GELU()) or fatrelu (g where g > shift, else 0; ProSparse, as vLLM's
    FatreluAndMul uses torch's F.threshold) or gelu_tanh (0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715
    g^3))), torch.nn.GELU(approximate="tanh"), in C over n_threads: ``cpu.gelu_tanh``)."""
    g = np.asarray(g, np.float32)
    if name == "silu":
        return g / (np.float32(1.0) + np.exp(-g))
    if name == "relu":
        return np.maximum(g, np.float32(0.0))
    if name == "gelu":
        return (0.5 * g * (1.0 + erf(g / np.sqrt(2.0)))).astype(np.float32)
    if name == "fatrelu":
        return np.where(g > shift, g, np.float32(0.0)).astype(np.float32)
    if name == "gelu_tanh":  # torch's gelu(approximate="tanh"), Gemma's gelu_pytorch_tanh
        return cpu.gelu_tanh(np.ascontiguousarray(g), np.empty(g.shape, np.float32), n_threads)
    raise ValueError(f"unknown activation {name!r}")


def head_rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of every head in place: x (n_tok, n_heads, head_dim) f32, weight (head_dim,) f32
    (Gemma 3's q_norm / k_norm, with its +1 in the weight). (The kernel reads a row's sum of
    squares before writing it, so out may be x.)"""
    flat = x.reshape(-1, x.shape[-1])
    cpu.rmsnorm(flat, weight, eps, flat)
    return x


def head_norms(q3: np.ndarray, k3: np.ndarray, lw, eps: float) -> None:
    """Layer ``lw``'s per-head RMSNorms of Q (n_tok, n_head, head_dim) and K (n_tok, n_head_kv,
    head_dim) in place, before RoPE, where it has them (Gemma 3, Qwen3); nothing otherwise."""
    if lw.attn_q_norm is not None:
        head_rmsnorm(q3, lw.attn_q_norm, eps)
        head_rmsnorm(k3, lw.attn_k_norm, eps)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap) in place on f32 x (Gemma's final_logit_softcapping)."""
    np.tanh(x / np.float32(cap), out=x)
    x *= np.float32(cap)
    return x


def rope_scaled(x: np.ndarray, positions: np.ndarray, freq_base: float,
                freq_divisors: np.ndarray) -> np.ndarray:
    """RoPE in place (rotate_half layout) with theta_i = pos * base^(-2i/d) / freq_divisors[i].

    x (n_tok, n_heads, head_dim) f32; positions (n_tok,) ints; freq_divisors (head_dim/2,) f32
    (llama.cpp's ``rope_freqs``: the converter stores default inv_freq / scaled inv_freq, so this
    equals transformers' llama3/linear inverse frequencies)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = float(freq_base) ** (-2.0 * np.arange(half) / d) / freq_divisors.astype(np.float64)
    theta = np.asarray(positions, np.float64)[:, None] * inv_freq  # (n_tok, half)
    cos = np.cos(theta)[:, None, :].astype(np.float32)
    sin = np.sin(theta)[:, None, :].astype(np.float32)
    x0 = x[..., :half].copy()
    x1 = x[..., half:].copy()
    x[..., :half] = x0 * cos - x1 * sin
    x[..., half:] = x1 * cos + x0 * sin
    return x


def attention_window(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int,
                     window: int, out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """Causal attention where the query at position p sees keys p-window+1..p only
    (transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window).

    q (n_tok, n_head, head_dim); caches (n_ctx, n_head_kv, head_dim); out like q. Queries whose
    window reaches back to 0 go through one ``cpu.attention`` call; the rest one token each over
    their window's cache rows. A batch's lone such query runs as the first of two (the second's
    row thrown away): a one-query call takes the decode path, whose bits differ, and a batch
    must give each position the same bits however it is split (``Engine.eval_prompt``)."""
    T = q.shape[0]
    full = max(0, min(T, window - n_past))  # tokens whose window still starts at row 0
    if full == 1 and T > 1:
        two = np.empty_like(out[:2])
        cpu.attention(q[:2], k_cache, v_cache, n_past, two, n_threads)
        out[0] = two[0]
    elif full:
        cpu.attention(q[:full], k_cache, v_cache, n_past, out[:full], n_threads)
    for t in range(full, T):
        p = n_past + t
        s = p - window + 1
        cpu.attention(q[t:t + 1], k_cache[s:], v_cache[s:], p - s, out[t:t + 1], n_threads)
    return out
