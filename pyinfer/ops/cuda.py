"""GPU kernels for the hot neurons: CuPy RawKernels over CUDA sources kept here as raw strings.

Five sources, one ``cupy.RawModule`` each, compiled once per device on first use (CuPy
``examples/gemm``, ``cupyx/scipy/signal/_upfirdn.py``):

- ``PREDICTOR_SRC``: PowerInfer's per-layer predictor, ``mask = fc2 @ relu(fc1 @ x) >= threshold``
  (fc1 GEMV with relu, fc2 GEMV with the threshold), f32 weights.
- ``GATHER_SRC``: warp-per-row GEMV over rows gathered onto the GPU (``gather_gemv_*``) and the
  fused hot-neuron kernel ``ffn_gate_up_*``: a row runs only where the prediction mask is set, then
  ``coef = act(gate . x) * (up . x)`` where ``|act(gate . x)| > act_thr`` (else 0), exactly the rule
  of ``pyinfer.ffn.SparseFFN``.
- ``AXPY_SRC``: ``out = sum_k coef[k] * down_t[k]`` over the hot down rows (zero coefficients are
  skipped), and ``merge_add`` (the CPU's partial FFN output added into the GPU's).

Weights are f32, f16, q8_0 or q4_0 rows of ``row_bytes`` bytes, the GGUF's bytes with each
quantized row's blocks split into quants then scales (``pyinfer.device.device_layout``: aligned
128-bit loads). Float rows dot the f32 activation; q8_0/q4_0 rows dot its q8 form (int8 per
32-block and an f32 scale, ``quantize_q8``: the CPU kernels' quantization, bit for bit) with
``__dp4a``, an exact integer per quant word, and sum in f32 (session 19: 1.3-1.44x the f32
version's q4_0 GEMV on an H200, ``tools/gemv_variants_gpu.py``). ``ATTN_SRC`` holds the norms,
RoPE, attention and ``quantize_q8``; ``INPUT_SRC`` sparse mode input's kernels: the mask of an
activation (the CPU's selection rule, with the masked activation's q8 form and kept bits) and a
GEMV over the kept input channels of a matrix in an input-block layout (``ib_gemv``: TEAL's
column-skipping GEMV, the CPU's input-block sums). Sizes and strides are passed explicitly (RawKernel ignores strides). f16 is converted with the PTX ``cvt.f32.f16``
instruction so the sources need no header (NVRTC and nvcc both compile them as they are).

Whether a GPU is there is decided once, at import (``available()``); ``PYINFER_DEVICE=cpu`` in the
environment forces the CPU path (tests). Every kernel has a NumPy twin: ``pyinfer.device.NumpyDevice``.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import numpy as np

from pyinfer.ops import cpu as _cpu
from pyinfer.ops.cpu import QT

try:  # CuPy is the optional extra ``pyinfer[cuda]``
    import cupy
except Exception as e:  # ImportError, or a broken CUDA install raising at import
    cupy = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}".splitlines()[0]
else:
    _IMPORT_ERROR = ""


def _probe() -> tuple[bool, str]:
    if os.environ.get("PYINFER_DEVICE", "").strip().lower() == "cpu":
        return False, "PYINFER_DEVICE=cpu"
    if cupy is None:
        return False, (f"CuPy is not installed (pip install -e '.[cuda]' in the pyinfer checkout; "
                       f"{_IMPORT_ERROR})")
    try:
        if not cupy.cuda.is_available():
            return False, "CuPy sees no CUDA device"
    except Exception as e:  # pragma: no cover - driver errors
        return False, f"CUDA error: {e}"
    return True, ""


_AVAILABLE, _REASON = _probe()


def available() -> bool:
    """True when CuPy imports and sees a CUDA device (decided once, at import)."""
    return _AVAILABLE


def unavailable_reason() -> str:
    """Why ``available()`` is False, in a few words ('' when it is True)."""
    return _REASON


# ---- CUDA sources -------------------------------------------------------------------------------
COMMON_SRC = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float ld_half(const u8* p) { return h2f(*(const u16*)p); }  // p 2-aligned

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Partial dot of one stored row with x for lane `lane` of a warp (the warp sums the partials).
__device__ __forceinline__ float dot_f32(const u8* row, int cols, const float* x, int lane) {
    const float* r = (const float*)row;
    float s = 0.f;
    for (int i = lane; i < cols; i += 32) s += r[i] * x[i];
    return s;
}
__device__ __forceinline__ float dot8_f16(uint4 v, float4 a, float4 b) {
    return h2f(v.x & 0xffff) * a.x + h2f(v.x >> 16) * a.y + h2f(v.y & 0xffff) * a.z
         + h2f(v.y >> 16) * a.w + h2f(v.z & 0xffff) * b.x + h2f(v.z >> 16) * b.y
         + h2f(v.w & 0xffff) * b.z + h2f(v.w >> 16) * b.w;
}
__device__ __forceinline__ float dot_f16(const u8* row, int cols, const float* x, int lane) {
    float s = 0.f;
    if ((cols & 7) == 0) {  // rows are 16-byte multiples: 8 halves per 128-bit load
        const uint4* r = (const uint4*)row;
        const float4* x4 = (const float4*)x;
        const int n8 = cols >> 3;
        int i = lane;
        // four loads in flight per lane before any arithmetic: a warp-per-row GEMV is
        // latency-bound when only a few rows are active (sparse rows, small grids)
        for (; i + 96 < n8; i += 128) {
            const uint4 v0 = r[i], v1 = r[i + 32], v2 = r[i + 64], v3 = r[i + 96];
            s += dot8_f16(v0, x4[2 * i], x4[2 * i + 1]);
            s += dot8_f16(v1, x4[2 * i + 64], x4[2 * i + 65]);
            s += dot8_f16(v2, x4[2 * i + 128], x4[2 * i + 129]);
            s += dot8_f16(v3, x4[2 * i + 192], x4[2 * i + 193]);
        }
        for (; i < n8; i += 32) s += dot8_f16(r[i], x4[2 * i], x4[2 * i + 1]);
    } else {
        const u16* r = (const u16*)row;
        for (int i = lane; i < cols; i += 32) s += h2f(r[i]) * x[i];
    }
    return s;
}
// Quantized rows on the device are in the "split" layout (pyinfer.device.device_layout): a row
// of nb blocks holds the nb blocks' quants first (q8_0: 32 int8 each, q4_0: 16 bytes of nibbles
// in GGML's order), then the nb f16 scales. Same bytes per row as the GGUF, but a block's quants
// are whole aligned words: 32-bit loads where the row starts on 4 bytes (nb even), 128-bit ones
// (the AXPY) where it starts on 16 (nb % 8 == 0, every 256-column multiple); GGUF's 18- and
// 34-byte blocks allow only 16-bit loads. Odd widths (small test shapes) take 16-bit loads.
__device__ __forceinline__ unsigned int ld_w32(const u8* p, bool al4) {  // p 2-aligned
    if (al4) return *(const unsigned int*)p;
    const u16* h = (const u16*)p;
    return h[0] | ((unsigned int)h[1] << 16);
}
__device__ __forceinline__ uint4 ld_w128(const u8* p, bool al16) {  // p 2-aligned
    if (al16) return *(const uint4*)p;
    const u16* h = (const u16*)p;
    return make_uint4(h[0] | ((unsigned int)h[1] << 16), h[2] | ((unsigned int)h[3] << 16),
                      h[4] | ((unsigned int)h[5] << 16), h[6] | ((unsigned int)h[7] << 16));
}
__device__ __forceinline__ float sb(unsigned int w, int k) {  // signed byte k of w
    return (float)((int)(w << (24 - 8 * k)) >> 24);
}
__device__ __forceinline__ float nib(unsigned int w, int sh) { return (float)((int)((w >> sh) & 15) - 8); }
// A quantized row's dot reads its activation quantized too, once per vector (quantize_q8, or
// the q8 epilogue of rmsnorm_f32 / norm_fc1 / attn_decode): per 32-block d = max|x| / 127 (f32)
// and q = rint(x * (1 / d)) as int8 (0 where d is 0): simd.h pi_quantize_q8, llama.cpp's q8_0,
// so the GPU's quantized dots see the CPU kernels' activation bit for bit. Lane `lane` of a warp
// holds value v = x[32 b + lane] of block b; q, d point at the block's 32 int8 and its scale.
// The block's max|x| compares fabsf's bits as unsigned integers: for non-negative floats the
// order of the values, and a NaN's bits lie above inf's, so a NaN in the block gives d = NaN and
// NaN dots, as simd.h's NaN-keeping maximum does (fmaxf drops a NaN: the dots were finite garbage).
__device__ __forceinline__ void warp_quantize_q8(float v, int lane, signed char* q, float* d) {
    unsigned int m = __float_as_uint(fabsf(v));
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float db = __uint_as_float(m) / 127.f;
    const float id = db != 0.f ? 1.f / db : 0.f;
    q[lane] = (signed char)__float2int_rn(v * id);
    if (lane == 0) *d = db;
}
// Word w (quant bytes 4i..4i+3 of a block) against the block's quantized activation xb (its 32
// int8 as 8 words): the exact integer sum of the 4 (q8_0) or 8 (q4_0) products, by __dp4a. q4_0's
// low nibbles are values 4i..4i+3, its high nibbles 16+4i..16+4i+3, each minus 8.
template <int QB>
__device__ __forceinline__ int word_i8(unsigned int w, const int* xb, int i) {
    if (QB == 16) {
        const int xl = xb[i], xh = xb[4 + i];
        const int lo = (int)(w & 0x0f0f0f0fu), hi = (int)((w >> 4) & 0x0f0f0f0fu);
        return __dp4a(lo, xl, __dp4a(hi, xh, 0)) - 8 * __dp4a(0x01010101, xl, __dp4a(0x01010101, xh, 0));
    }
    return __dp4a((int)w, xb[i], 0);
}
// Partial dots of one split-layout row with the quantized activation (xq: n int8 as words, xd:
// n/32 block scales), lane per 32-bit quant word, so a warp's weight loads are 128 contiguous
// bytes: QB quant bytes per block (q4_0 16: four lanes per block, eight blocks per step; q8_0 32:
// eight lanes, four blocks), U steps' loads in flight per lane (q4_0 4, q8_0 8: the fastest of
// 4/8/16 on an H200, tools/gemv_variants_gpu.py). Each word adds (dw * dx) * its integer. The
// alignment test is per row (warp-uniform) and outside the loops.
template <int QB, bool AL, int U>
__device__ __forceinline__ float dot_split_t(const u8* row, int nb, const int* xq, const float* xd, int lane) {
    const int lpb = QB / 4, step = 32 / lpb;  // lanes per block, blocks per step
    const u8* ds = row + QB * nb;
    const int i = lane % lpb;
    float s = 0.f;
    int b = lane / lpb;
    for (; b + (U - 1) * step < nb; b += U * step) {
        unsigned int w[U];
        float d[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) w[u] = ld_w32(row + QB * (b + u * step) + 4 * i, AL);
        #pragma unroll
        for (int u = 0; u < U; ++u) d[u] = ld_half(ds + 2 * (b + u * step)) * xd[b + u * step];
        #pragma unroll
        for (int u = 0; u < U; ++u) s += d[u] * (float)word_i8<QB>(w[u], xq + 8 * (b + u * step), i);
    }
    for (; b < nb; b += step)
        s += ld_half(ds + 2 * b) * xd[b] * (float)word_i8<QB>(ld_w32(row + QB * b + 4 * i, AL), xq + 8 * b, i);
    return s;
}
template <int QB, int U>
__device__ __forceinline__ float dot_split(const u8* row, int cols, const int* xq, const float* xd, int lane) {
    return ((u64)row & 3) == 0 ? dot_split_t<QB, true, U>(row, cols >> 5, xq, xd, lane)
                               : dot_split_t<QB, false, U>(row, cols >> 5, xq, xd, lane);
}
// Row . x for every weight type, one signature (the kernel templates below): float rows read
// x, quantized rows its q8 form (xq, xd).
__device__ __forceinline__ float dotx_f32(const u8* row, int cols, const float* x, const int* xq,
                                          const float* xd, int lane) { return dot_f32(row, cols, x, lane); }
__device__ __forceinline__ float dotx_f16(const u8* row, int cols, const float* x, const int* xq,
                                          const float* xd, int lane) { return dot_f16(row, cols, x, lane); }
__device__ __forceinline__ float dotx_q8_0(const u8* row, int cols, const float* x, const int* xq,
                                           const float* xd, int lane) { return dot_split<32, 8>(row, cols, xq, xd, lane); }
__device__ __forceinline__ float dotx_q4_0(const u8* row, int cols, const float* x, const int* xq,
                                           const float* xd, int lane) { return dot_split<16, 4>(row, cols, xq, xd, lane); }

// Wide forms of the dots, for rows that few warps read at once (the hot-neuron kernel's predicted
// rows: a sparse token's warps mostly stop after the predictor, so each candidate row's latency,
// not the bandwidth, sets the kernel's time). dot_split_t issues a row's loads U steps at a time:
// nb / (8 U) memory round trips per q4_0 row (4 for a 4096-wide row), and a candidate reads its
// gate row, then its up row. dot_wide_t reads NR rows (gate and up: 2; a GEMV's row: 1) against
// the same activation with every load of up to 32 MAXB blocks per row in flight before any
// arithmetic: lane l takes whole blocks l, l + 32, ... (a 16-byte quant load per q4_0 block, two
// per q8_0 block, and its f16 scale), so one round trip per row where 32 MAXB >= nb. Each
// block's integer sum is one __dp4a chain (word_i8 per word, as dot_split_t), scaled once:
// (dw * dx) * sum. s[k] = lane's partial of row r[k]. XS (q4_0): x's block sums given (xs[b] =
// the sum of block b's 32 int8), a quant word's integer is two __dp4a (its low and high nibbles
// against x's two halves) and the "- 8" offset comes off once a block as 8 xs[b], where
// word_i8 spends two more __dp4a a word summing x. The same integers.
template <int QB, bool AL, int MAXB, int NR, bool XS = false>
__device__ __forceinline__ void dot_wide_t(const u8* const* r, int nb, const int* xq,
        const float* xd, int lane, float* s, const int* xs = nullptr) {
    const int NW = QB / 16;  // 128-bit loads per block's quants
    float a[NR];
    #pragma unroll
    for (int k = 0; k < NR; ++k) a[k] = 0.f;
    for (int b0 = 0; b0 < nb; b0 += 32 * MAXB) {
        uint4 w[MAXB][QB / 16][NR];
        u16 h[MAXB][NR];
        #pragma unroll
        for (int u = 0; u < MAXB; ++u) {
            const int b = b0 + lane + 32 * u;
            if (b < nb) {
                #pragma unroll
                for (int q = 0; q < NW; ++q) {
                    #pragma unroll
                    for (int k = 0; k < NR; ++k) w[u][q][k] = ld_w128(r[k] + QB * b + 16 * q, AL);
                }
                #pragma unroll
                for (int k = 0; k < NR; ++k) h[u][k] = *(const u16*)(r[k] + QB * nb + 2 * b);
            }
        }
        #pragma unroll
        for (int u = 0; u < MAXB; ++u) {
            const int b = b0 + lane + 32 * u;
            if (b < nb) {
                const int* xb = xq + 8 * b;
                int i[NR];
                #pragma unroll
                for (int k = 0; k < NR; ++k) i[k] = XS ? -8 * xs[b] : 0;
                #pragma unroll
                for (int q = 0; q < NW; ++q) {
                    #pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        #pragma unroll
                        for (int k = 0; k < NR; ++k) {
                            const uint4 v = w[u][q][k];
                            const unsigned int wd = c == 0 ? v.x : c == 1 ? v.y
                                                  : c == 2 ? v.z : v.w;
                            if (XS) {
                                const int lo = (int)(wd & 0x0f0f0f0fu);
                                const int hi = (int)((wd >> 4) & 0x0f0f0f0fu);
                                i[k] = __dp4a(lo, xb[c], __dp4a(hi, xb[4 + c], i[k]));
                            } else {
                                i[k] += word_i8<QB>(wd, xb, 4 * q + c);
                            }
                        }
                    }
                }
                const float dx = xd[b];
                #pragma unroll
                for (int k = 0; k < NR; ++k) a[k] += h2f(h[u][k]) * dx * (float)i[k];
            }
        }
    }
    #pragma unroll
    for (int k = 0; k < NR; ++k) s[k] = a[k];
}
template <int QB, int MAXB, int NR>
__device__ __forceinline__ void dot_wide(const u8* const* r, int cols, const int* xq,
        const float* xd, int lane, float* s) {
    u64 any = 0;
    #pragma unroll
    for (int k = 0; k < NR; ++k) any |= (u64)r[k];
    if ((any & 15) == 0)
        dot_wide_t<QB, true, MAXB, NR>(r, cols >> 5, xq, xd, lane, s);
    else
        dot_wide_t<QB, false, MAXB, NR>(r, cols >> 5, xq, xd, lane, s);
}
// Two rows . x (lane partials) for every weight type, one signature: quantized rows the wide
// form (q4_0: 4 blocks a lane in flight, a 4096-wide row in one round trip, 71 registers a thread
// on sm_90 against the GEMV dot's 56; q8_0: 2), float rows their two dots in turn.
__device__ __forceinline__ void dot2x_f32(const u8* r0, const u8* r1, int cols, const float* x,
        const int* xq, const float* xd, int lane, float* s0, float* s1) {
    *s0 = dot_f32(r0, cols, x, lane);
    *s1 = dot_f32(r1, cols, x, lane);
}
__device__ __forceinline__ void dot2x_f16(const u8* r0, const u8* r1, int cols, const float* x,
        const int* xq, const float* xd, int lane, float* s0, float* s1) {
    *s0 = dot_f16(r0, cols, x, lane);
    *s1 = dot_f16(r1, cols, x, lane);
}
template <int QB, int MAXB>
__device__ __forceinline__ void dot2_wide(const u8* r0, const u8* r1, int cols, const int* xq,
        const float* xd, int lane, float* s0, float* s1) {
    const u8* r[2] = {r0, r1};
    float s[2];
    dot_wide<QB, MAXB, 2>(r, cols, xq, xd, lane, s);
    *s0 = s[0];
    *s1 = s[1];
}
__device__ __forceinline__ void dot2x_q8_0(const u8* r0, const u8* r1, int cols, const float* x,
        const int* xq, const float* xd, int lane, float* s0, float* s1) {
    dot2_wide<32, 2>(r0, r1, cols, xq, xd, lane, s0, s1);
}
__device__ __forceinline__ void dot2x_q4_0(const u8* r0, const u8* r1, int cols, const float* x,
        const int* xq, const float* xd, int lane, float* s0, float* s1) {
    dot2_wide<16, 4>(r0, r1, cols, xq, xd, lane, s0, s1);
}
// One row . x, the wide form for quantized rows (a dense GEMV's rows, gather_gemv_w_*: a lane's
// MAXB blocks as 16-byte loads, a 4096-wide q4_0 row in one round trip; q8_0 MAXB 4, 2048
// columns a round trip), the GEMV's dot for float rows.
template <int QB, int MAXB>
__device__ __forceinline__ float dot1_wide(const u8* row, int cols, const int* xq, const float* xd,
                                           int lane) {
    const u8* r[1] = {row};
    float s[1];
    dot_wide<QB, MAXB, 1>(r, cols, xq, xd, lane, s);
    return s[0];
}
__device__ __forceinline__ float dot1x_f32(const u8* row, int cols, const float* x,
        const int* xq, const float* xd, int lane) {
    return dot_f32(row, cols, x, lane);
}
__device__ __forceinline__ float dot1x_f16(const u8* row, int cols, const float* x,
        const int* xq, const float* xd, int lane) {
    return dot_f16(row, cols, x, lane);
}
__device__ __forceinline__ float dot1x_q8_0(const u8* row, int cols, const float* x,
        const int* xq, const float* xd, int lane) {
    return dot1_wide<32, 4>(row, cols, xq, xd, lane);
}
__device__ __forceinline__ float dot1x_q4_0(const u8* row, int cols, const float* x,
        const int* xq, const float* xd, int lane) {
    return dot1_wide<16, 4>(row, cols, xq, xd, lane);
}
// q4_0's wide one-row dot (AL: 16-byte aligned row) with x's block sums xs given
// (dot_wide_t's XS form): the same integers as dot1_wide<16, MAXB>, two __dp4a a quant word.
template <bool AL, int MAXB>
__device__ __forceinline__ float dot_q4_sums(const u8* row, int nb, const int* xq, const float* xd,
                                             const int* xs, int lane) {
    const u8* r[1] = {row};
    float s[1];
    dot_wide_t<16, AL, MAXB, 1, true>(r, nb, xq, xd, lane, s, xs);
    return s[0];
}
// An f16 row . x (cols % 8 == 0: 16-byte rows) with every load of up to 32 MAXU 8-half units in
// flight before any arithmetic: the predictor's fc2 row (rank <= 256 MAXU) in one round trip.
template <int MAXU>
__device__ __forceinline__ float dot_f16_wide(const u8* row, int cols, const float* x, int lane) {
    if (cols & 7) return dot_f16(row, cols, x, lane);
    const uint4* r = (const uint4*)row;
    const float4* x4 = (const float4*)x;
    const int n8 = cols >> 3;
    float s = 0.f;
    for (int i0 = 0; i0 < n8; i0 += 32 * MAXU) {
        uint4 v[MAXU];
        #pragma unroll
        for (int u = 0; u < MAXU; ++u) {
            const int i = i0 + lane + 32 * u;
            if (i < n8) v[u] = r[i];
        }
        #pragma unroll
        for (int u = 0; u < MAXU; ++u) {
            const int i = i0 + lane + 32 * u;
            if (i < n8) s += dot8_f16(v[u], x4[2 * i], x4[2 * i + 1]);
        }
    }
    return s;
}

__device__ __forceinline__ float block_sum(float v, float* red) {  // blockDim multiple of 32
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; ++i) s += red[i];
    return s;
}
// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i] for one row of n, by the whole block.
__device__ __forceinline__ void block_rmsnorm(const float* x, const float* w, int n, float eps,
                                              float* out, float* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i] * x[i];
    const float scale = rsqrtf(block_sum(s, red) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * scale * w[i];
}
// The q8 form of h (n values, n % 32 == 0, written by this block before the call) into xq, xd,
// by the whole block, warp per 32-block.
__device__ __forceinline__ void block_quantize_q8(const float* h, int n, signed char* xq, float* xd) {
    __syncthreads();  // h's values were written by other threads of the block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int b = warp; b < (n >> 5); b += nw) warp_quantize_q8(h[32 * b + lane], lane, xq + 32 * b, xd + b);
}
// block_rmsnorm (and with do_q8 block_quantize_q8 after it) with each value loaded once: thread
// t keeps float4s t, t + blockDim, ... (at most MAXV) of x and of w in registers, so a row costs
// one round of loads, one block reduction and the stores (block_rmsnorm reads x twice and the
// q8 epilogue reads the output back, each thread looping over n / blockDim values: about 10 us a
// 4096-value row on an H200, session 28). n % 4 == 0, n <= 4 MAXV blockDim; x, w, out (and oq)
// 16-byte aligned. The q8 form comes from the registers: a 32-block is the float4s of 8
// neighbouring threads of one warp (blockDim a multiple of 32), its max |h| by three shuffles,
// then warp_quantize_q8's rule (d = max / 127, q = rint(h * (1 / d))).
template <int MAXV>
__device__ __forceinline__ void block_rmsnorm_vec(const float* x, const float* w, int n, float eps,
        float* out, int do_q8, signed char* oq, float* od, float* red) {
    const int n4 = n >> 2;
    float4 v[MAXV], g[MAXV];
    #pragma unroll
    for (int u = 0; u < MAXV; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        v[u] = g[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < n4) {
            v[u] = ((const float4*)x)[i];
            g[u] = ((const float4*)w)[i];
        }
    }
    float s = 0.f;
    #pragma unroll
    for (int u = 0; u < MAXV; ++u)
        s += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
    const float scale = rsqrtf(block_sum(s, red) / n + eps);
    #pragma unroll
    for (int u = 0; u < MAXV; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        const float4 o = make_float4(v[u].x * scale * g[u].x, v[u].y * scale * g[u].y,
                                     v[u].z * scale * g[u].z, v[u].w * scale * g[u].w);
        if (i < n4) ((float4*)out)[i] = o;
        if (do_q8) {  // every lane shuffles; a 32-block's 8 threads are all in or all out
            unsigned int m = max(max(__float_as_uint(fabsf(o.x)), __float_as_uint(fabsf(o.y))),
                                 max(__float_as_uint(fabsf(o.z)), __float_as_uint(fabsf(o.w))));
            for (int k = 1; k < 8; k <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, k));
            const float db = __uint_as_float(m) / 127.f;  // NaN kept, as warp_quantize_q8
            const float id = db != 0.f ? 1.f / db : 0.f;
            if (i < n4) {
                const unsigned int q = (unsigned int)(__float2int_rn(o.x * id) & 255)
                                     | (unsigned int)(__float2int_rn(o.y * id) & 255) << 8
                                     | (unsigned int)(__float2int_rn(o.z * id) & 255) << 16
                                     | (unsigned int)(__float2int_rn(o.w * id) & 255) << 24;
                ((unsigned int*)oq)[i] = q;
                if ((i & 7) == 0) od[i >> 3] = db;
            }
        }
    }
}
#define PI_NORM_VEC 4  // MAXV of the kernels' block_rmsnorm_vec (1024 threads: n <= 16384)
// Element c of one device row of cols columns, dequantized (quantized rows: split layout).
__device__ __forceinline__ float el_f32(const u8* row, int c, int cols) { return ((const float*)row)[c]; }
__device__ __forceinline__ float el_f16(const u8* row, int c, int cols) { return h2f(((const u16*)row)[c]); }
__device__ __forceinline__ float el_q8_0(const u8* row, int c, int cols) {
    return ld_half(row + 32 * (cols >> 5) + 2 * (c >> 5)) * (float)((const signed char*)row)[c];
}
__device__ __forceinline__ float el_q4_0(const u8* row, int c, int cols) {
    const int j = c & 31, q = row[16 * (c >> 5) + (j & 15)];
    return ld_half(row + 16 * (cols >> 5) + 2 * (c >> 5)) * (float)((j < 16 ? (q & 15) : (q >> 4)) - 8);
}
"""

_PREDICTOR_TEMPLATE = r"""
// hid[r] = relu(fc1[r] . x), warp per row; fc1 (rank, n_embd) @T@, rows of row_bytes bytes.
// Fused with the FFN's RMSNorm, which reads the same x: with do_norm, the last block (beyond
// the fc1 rows) writes h = rmsnorm(x) * norm_w, and with do_q8 also h's q8 form (hq, hd) for
// the quantized rows that read h. One launch instead of two or three per layer. vec: the norm
// block in registers (block_rmsnorm_vec; n_embd <= 4 PI_NORM_VEC blockDim, aligned rows).
extern "C" __global__ void __launch_bounds__(1024) norm_fc1_@T@(const u8* fc1,
        long long row_bytes, int rank, int n_embd, const float* x, float* hid, int do_norm,
        const float* norm_w, float eps, float* h, int do_q8, signed char* hq, float* hd, int vec) {
    __shared__ float red[32];
    if (do_norm && blockIdx.x == gridDim.x - 1) {
        if (vec) {
            block_rmsnorm_vec<PI_NORM_VEC>(x, norm_w, n_embd, eps, h, do_q8, hq, hd, red);
        } else {
            block_rmsnorm(x, norm_w, n_embd, eps, h, red);
            if (do_q8) block_quantize_q8(h, n_embd, hq, hd);
        }
        return;
    }
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (r >= rank) return;
    const float s = warp_sum(dot_@T@(fc1 + r * row_bytes, n_embd, x, lane));
    if (lane == 0) hid[r] = fmaxf(s, 0.f);
}
// mask[n] = (fc2[n] . hid >= threshold), warp per row. fc2 (n_ff, rank) @T@.
extern "C" __global__ void predictor_fc2_@T@(const u8* fc2, long long row_bytes, int n_ff,
                                             int rank, const float* hid, float threshold, u8* mask) {
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (n >= n_ff) return;
    const float s = warp_sum(dot_@T@(fc2 + n * row_bytes, rank, hid, lane));
    if (lane == 0) mask[n] = s >= threshold ? 1 : 0;
}
"""

_GATHER_TEMPLATE = r"""
// out[k] = (accumulate ? out[k] : 0) + w[k] . x for the n_rows rows of w (row_bytes apart),
// warp per row; where use_mask, rows whose neuron ids[k] is not in the prediction mask are
// skipped (0 added). accumulate=1 adds a projection into the residual stream in place.
// Quantized rows read x's q8 form (xq, xd; see warp_quantize_q8), float rows x itself.
// gather_gemv_w_@T@: the wide dot (dot1x_@T@: a row's loads in flight at once).
template <bool WIDE>
__device__ __forceinline__ void gather_gemv_body_@T@(const u8* w, long long row_bytes,
        int n_rows, int cols, const float* x, const int* xq, const float* xd, const int* ids,
        const u8* mask, int use_mask, int accumulate, float* out) {
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (k >= n_rows) return;
    float s = 0.f;
    if (!use_mask || mask[ids[k]]) {
        const u8* row = w + k * row_bytes;
        s = warp_sum(WIDE ? dot1x_@T@(row, cols, x, xq, xd, lane)
                          : dotx_@T@(row, cols, x, xq, xd, lane));
    }
    if (lane == 0) out[k] = accumulate ? out[k] + s : s;
}
#define PI_GATHER_ARGS const u8* w, long long row_bytes, int n_rows, int cols, const float* x, \
        const int* xq, const float* xd, const int* ids, const u8* mask, int use_mask, \
        int accumulate, float* out
#define PI_GATHER_PASS w, row_bytes, n_rows, cols, x, xq, xd, ids, mask, use_mask, accumulate, out
extern "C" __global__ void gather_gemv_@T@(PI_GATHER_ARGS) {
    gather_gemv_body_@T@<false>(PI_GATHER_PASS);
}
extern "C" __global__ void gather_gemv_w_@T@(PI_GATHER_ARGS) {
    gather_gemv_body_@T@<true>(PI_GATHER_PASS);
}
#undef PI_GATHER_ARGS
#undef PI_GATHER_PASS
// One hot neuron's coefficient, by a whole warp: a = act(gate_row . x) (act 0: relu, 1: silu),
//   glu 0: kept where |a| > act_thr (up read only then), c = a * (up_row . x)
//   glu 1: kept where |a * u| > act_thr, c = a * u
// else c = 0 (pyinfer.ffn.SparseFFN's rules). Every lane returns c; *keep likewise.
// WIDE: both rows' loads in flight together (dot2x_@T@: one round trip for a quantized
// candidate); up is then read where glu 0 drops the neuron too (a predicted candidate is mostly
// kept). The same c up to the order of the sums.
template <bool WIDE>
__device__ __forceinline__ float gate_up_one_@T@(const u8* g_row, const u8* u_row, int cols,
        const float* x, const int* xq, const float* xd, int act, int glu, float act_thr, int lane,
        bool* keep) {
    float g, u = 0.f;
    if (WIDE) {
        float pg, pu;
        dot2x_@T@(g_row, u_row, cols, x, xq, xd, lane, &pg, &pu);
        g = warp_sum(pg);
        u = warp_sum(pu);
    } else {
        g = warp_sum(dotx_@T@(g_row, cols, x, xq, xd, lane));
    }
    const float a = act ? g / (1.f + expf(-g)) : fmaxf(g, 0.f);
    float c = 0.f;
    if (glu) {
        if (!WIDE) u = warp_sum(dotx_@T@(u_row, cols, x, xq, xd, lane));
        c = a * u;
        *keep = !(fabsf(c) <= act_thr);  // NaN kept, as the CPU
        if (!*keep) c = 0.f;
    } else {
        *keep = !(fabsf(a) <= act_thr);
        if (*keep) c = a * (WIDE ? u : warp_sum(dotx_@T@(u_row, cols, x, xq, xd, lane)));
    }
    return c;
}
// The hot neurons of one layer, fused: for row k (neuron ids[k]) that is a candidate, coef[k] =
// gate_up_one's c, else coef[k] = 0. act_thr < 0 keeps every row (dense). Candidates: cand 0
// every row; 1 where mask[ids[k]]; 2 where the predictor says so, computed here from neuron
// ids[k]'s fc2 row (fc2 (n_ff, rank), f16 when fc2_half else f32) and the hidden layer hid:
// fc2[ids[k]] . hid >= pred_thr (PowerInfer's predictor, as predictor_fc2 computes it, without a
// mask round trip). counts[0] += candidates, [1] += kept. Quantized rows read x's q8 form (xq,
// xd), float rows x. ffn_gate_up_w_@T@: the WIDE form (gate_up_one, and the fc2 row's loads in
// flight at once).
template <bool WIDE>
__device__ __forceinline__ void ffn_gate_up_body_@T@(const u8* gate, const u8* up,
        long long row_bytes, int n_rows, int cols, const float* x, const int* xq, const float* xd,
        const int* ids, const u8* mask, int cand,
        const u8* fc2, long long fc2_row_bytes, int rank, int fc2_half, const float* hid,
        float pred_thr, int act, int glu, float act_thr, float* coef, u64* counts) {
    __shared__ unsigned int n_cand, n_act;
    if (threadIdx.x == 0) { n_cand = 0; n_act = 0; }
    __syncthreads();
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (k < n_rows) {  // no early return: the block meets at __syncthreads below
        float c = 0.f;
        bool is_cand = true;
        if (cand == 1) {
            is_cand = mask[ids[k]] != 0;
        } else if (cand == 2) {
            const u8* f = fc2 + (long long)ids[k] * fc2_row_bytes;
            const float p = warp_sum(fc2_half ? (WIDE ? dot_f16_wide<2>(f, rank, hid, lane)
                                                      : dot_f16(f, rank, hid, lane))
                                              : dot_f32(f, rank, hid, lane));
            is_cand = p >= pred_thr;
        }
        if (is_cand) {
            bool keep;
            c = gate_up_one_@T@<WIDE>(gate + k * row_bytes, up + k * row_bytes, cols, x, xq, xd,
                                      act, glu, act_thr, lane, &keep);
            if (lane == 0) { atomicAdd(&n_cand, 1u); if (keep) atomicAdd(&n_act, 1u); }
        }
        if (lane == 0) coef[k] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0 && n_cand) {
        atomicAdd(counts, (u64)n_cand);
        atomicAdd(counts + 1, (u64)n_act);
    }
}
#define PI_GATE_UP_ARGS const u8* gate, const u8* up, long long row_bytes, int n_rows, int cols, \
        const float* x, const int* xq, const float* xd, const int* ids, const u8* mask, int cand, \
        const u8* fc2, long long fc2_row_bytes, int rank, int fc2_half, const float* hid, \
        float pred_thr, int act, int glu, float act_thr, float* coef, u64* counts
#define PI_GATE_UP_PASS gate, up, row_bytes, n_rows, cols, x, xq, xd, ids, mask, cand, fc2, \
        fc2_row_bytes, rank, fc2_half, hid, pred_thr, act, glu, act_thr, coef, counts
extern "C" __global__ void ffn_gate_up_@T@(PI_GATE_UP_ARGS) {
    ffn_gate_up_body_@T@<false>(PI_GATE_UP_PASS);
}
extern "C" __global__ void ffn_gate_up_w_@T@(PI_GATE_UP_ARGS) {
    ffn_gate_up_body_@T@<true>(PI_GATE_UP_PASS);
}
#undef PI_GATE_UP_ARGS
#undef PI_GATE_UP_PASS
// The second launch of the two-launch form of ffn_gate_up's predictor case (hot_candidates
// first): warp i takes the i-th listed candidate k = list[1 + i] (i < list[0]) and writes its
// coef[k] (the same c as ffn_gate_up computes); counts[1] += kept. Warps beyond the list do
// nothing, so every warp that reads rows is a candidate's (the fused kernel's candidates are
// scattered over warps that mostly stop after the predictor's dot). _w: the WIDE form.
template <bool WIDE>
__device__ __forceinline__ void ffn_gate_up_list_body_@T@(const u8* gate, const u8* up,
        long long row_bytes, int cols, const float* x, const int* xq, const float* xd,
        const int* list, int act, int glu, float act_thr, float* coef, u64* counts) {
    __shared__ unsigned int n_act;
    if (threadIdx.x == 0) n_act = 0;
    __syncthreads();
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (i < list[0]) {  // no early return: the block meets at __syncthreads below
        const int k = list[1 + i];
        bool keep;
        const float c = gate_up_one_@T@<WIDE>(gate + k * row_bytes, up + k * row_bytes, cols,
                                              x, xq, xd, act, glu, act_thr, lane, &keep);
        if (lane == 0) { coef[k] = c; if (keep) atomicAdd(&n_act, 1u); }
    }
    __syncthreads();
    if (threadIdx.x == 0 && n_act) atomicAdd(counts + 1, (u64)n_act);
}
#define PI_GATE_UP_LIST_ARGS const u8* gate, const u8* up, long long row_bytes, int cols, \
        const float* x, const int* xq, const float* xd, const int* list, int act, int glu, \
        float act_thr, float* coef, u64* counts
#define PI_GATE_UP_LIST_PASS gate, up, row_bytes, cols, x, xq, xd, list, act, glu, act_thr, \
        coef, counts
extern "C" __global__ void ffn_gate_up_list_@T@(PI_GATE_UP_LIST_ARGS) {
    ffn_gate_up_list_body_@T@<false>(PI_GATE_UP_LIST_PASS);
}
extern "C" __global__ void ffn_gate_up_list_w_@T@(PI_GATE_UP_LIST_ARGS) {
    ffn_gate_up_list_body_@T@<true>(PI_GATE_UP_LIST_PASS);
}
#undef PI_GATE_UP_LIST_ARGS
#undef PI_GATE_UP_LIST_PASS
"""

_HOT_CANDIDATES = r"""
// The first launch of the two-launch form of ffn_gate_up's predictor case: warp per hot row k,
// p = fc2[ids[k]] . hid (fc2 f16 when fc2_half else f32, as in ffn_gate_up); rows with p >=
// pred_thr are appended to list (list[0]: their count, zeroed before this launch; list[1..]: the
// rows k, in no fixed order: each candidate's coefficient depends on nothing else), coef[k] = 0
// for every row (ffn_gate_up_list_* then writes the candidates'), counts[0] += candidates.
extern "C" __global__ void hot_candidates(const int* ids, int n_rows, const u8* fc2,
        long long fc2_row_bytes, int rank, int fc2_half, const float* hid, float pred_thr,
        float* coef, int* list, u64* counts) {
    __shared__ unsigned int n_cand;
    if (threadIdx.x == 0) n_cand = 0;
    __syncthreads();
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (k < n_rows) {  // no early return: the block meets at __syncthreads below
        const u8* f = fc2 + (long long)ids[k] * fc2_row_bytes;
        const float p = warp_sum(fc2_half ? dot_f16(f, rank, hid, lane) : dot_f32(f, rank, hid, lane));
        if (lane == 0) {
            coef[k] = 0.f;
            if (p >= pred_thr) {
                list[1 + atomicAdd(list, 1)] = k;
                atomicAdd(&n_cand, 1u);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && n_cand) atomicAdd(counts, (u64)n_cand);
}
"""

_AXPY_UNITS = r"""
// AXPY units: a thread owns V consecutive columns of every row (f32 4 = one float4, f16 8 = one
// 128-bit load, q8_0 and q4_0 one 32-column block) and accumulates coef * row into V registers.
// load() fetches unit u of a row of nb 32-column blocks (quantized rows in the split layout: the
// block's quants are 128-bit loads where the row starts on 16 bytes, and its scale one f16),
// fma() adds a * unit into acc.
struct UnitF32 {
    enum { V = 4 };
    typedef float4 Raw;
    template <bool AL>
    __device__ static Raw load(const u8* row, int u, int nb) { return ((const float4*)row)[u]; }
    __device__ static void fma(float* acc, float a, const Raw& r) {
        acc[0] += a * r.x; acc[1] += a * r.y; acc[2] += a * r.z; acc[3] += a * r.w;
    }
};
struct UnitF16 {
    enum { V = 8 };
    typedef uint4 Raw;
    template <bool AL>
    __device__ static Raw load(const u8* row, int u, int nb) { return ((const uint4*)row)[u]; }
    __device__ static void fma(float* acc, float a, const Raw& r) {
        const unsigned int w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[2 * i] += a * h2f(w[i] & 0xffff);
            acc[2 * i + 1] += a * h2f(w[i] >> 16);
        }
    }
};
struct UnitQ8_0 {  // block u: int8 q[32] at 32u (two words of 16), f16 d at 32 nb + 2u
    enum { V = 32 };
    struct Raw { uint4 q0, q1; u16 d; };
    template <bool AL>
    __device__ static Raw load(const u8* row, int u, int nb) {
        Raw r;
        r.q0 = ld_w128(row + 32 * u, AL);
        r.q1 = ld_w128(row + 32 * u + 16, AL);
        r.d = *(const u16*)(row + 32 * nb + 2 * u);
        return r;
    }
    __device__ static void fma(float* acc, float a, const Raw& r) {
        const float s = a * h2f(r.d);
        const unsigned int w[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            #pragma unroll
            for (int k = 0; k < 4; ++k) acc[4 * i + k] += s * sb(w[i], k);
        }
    }
};
struct UnitQ4_0 {  // block u: qs[16] at 16u (one word of 16), f16 d at 16 nb + 2u;
    enum { V = 32 };  // x[j] = d*((qs[j] & 15) - 8), x[j+16] = d*((qs[j] >> 4) - 8)
    struct Raw { uint4 q; u16 d; };
    template <bool AL>
    __device__ static Raw load(const u8* row, int u, int nb) {
        Raw r;
        r.q = ld_w128(row + 16 * u, AL);
        r.d = *(const u16*)(row + 16 * nb + 2 * u);
        return r;
    }
    __device__ static void fma(float* acc, float a, const Raw& r) {
        const float s = a * h2f(r.d);
        const unsigned int w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[4 * i + k] += s * nib(w[i], 8 * k);
                acc[16 + 4 * i + k] += s * nib(w[i], 8 * k + 4);
            }
        }
    }
};

// Stage 1 of out = sum_k coef[k] * w[k] (the down projection over ffn_down_t rows):
// partial[chunk][c] = sum over the chunk's rows k (rows_per_chunk <= blockDim.x rows, in row
// order) of coef[k] * w[k][c]. grid (column tiles of blockDim.x units, chunks). The block first
// lists its chunk's nonzero coefficients in row order (warp ballots: no atomics), so a sparse
// chunk reads only its active rows, UNROLL rows' loads in flight per thread, each row's unit a
// 16-byte load for f32/f16 (the old thread-per-column kernel issued 2-byte loads and tested every
// coefficient). skip_zero 0 keeps every row (dense). Fixed order: reproducible sums.
template <class U, int UNROLL, bool AL>
__device__ __forceinline__ void axpy_part(const u8* w, long long row_bytes, int n_rows, int cols,
        const float* coef, int rows_per_chunk, int skip_zero, float* partial) {
    __shared__ int s_idx[256];
    __shared__ float s_coef[256];
    __shared__ int s_count[8];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
    const int k0 = blockIdx.y * rows_per_chunk, n = min(n_rows - k0, rows_per_chunk);
    float a = 0.f;
    bool keep = false;
    if (t < n) {
        a = coef[k0 + t];
        keep = !skip_zero || a != 0.f;
    }
    const unsigned int m = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) s_count[warp] = __popc(m);
    __syncthreads();
    int off = 0, total = 0;
    for (int i = 0; i < nw; ++i) {
        off += i < warp ? s_count[i] : 0;
        total += s_count[i];
    }
    if (keep) {
        const int p = off + __popc(m & ((1u << lane) - 1u));
        s_idx[p] = k0 + t;
        s_coef[p] = a;
    }
    __syncthreads();
    const int u = blockIdx.x * blockDim.x + t;
    if (u * U::V >= cols) return;
    const int nb = cols >> 5;
    float acc[U::V];
    #pragma unroll
    for (int i = 0; i < U::V; ++i) acc[i] = 0.f;
    int j = 0;
    for (; j + UNROLL <= total; j += UNROLL) {
        typename U::Raw r[UNROLL];
        #pragma unroll
        for (int q = 0; q < UNROLL; ++q) r[q] = U::template load<AL>(w + (long long)s_idx[j + q] * row_bytes, u, nb);
        #pragma unroll
        for (int q = 0; q < UNROLL; ++q) U::fma(acc, s_coef[j + q], r[q]);
    }
    for (; j < total; ++j) U::fma(acc, s_coef[j], U::template load<AL>(w + (long long)s_idx[j] * row_bytes, u, nb));
    float4* o = (float4*)(partial + (long long)blockIdx.y * cols + u * U::V);
    #pragma unroll
    for (int i = 0; i < U::V / 4; ++i)
        o[i] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
}
"""

_AXPY_TEMPLATE = r"""
extern "C" __global__ void axpy_part_@T@(const u8* w, long long row_bytes, int n_rows, int cols,
        const float* coef, int rows_per_chunk, int skip_zero, float* partial) {
    // every row starts on 16 bytes (quantized rows: 128-bit quant loads) or none is assumed to
    if (((u64)w & 15) == 0 && (row_bytes & 15) == 0)
        axpy_part<@U@, @UNROLL@, true>(w, row_bytes, n_rows, cols, coef, rows_per_chunk, skip_zero, partial);
    else
        axpy_part<@U@, @UNROLL@, false>(w, row_bytes, n_rows, cols, coef, rows_per_chunk, skip_zero, partial);
}
// out[(r - r0) * cols + c] = w[r][c] for rows r0 <= r < r0 + n_rows: dequantize to f32 (prefill
// runs its GEMMs through cuBLAS on these).
extern "C" __global__ void dequant_@T@(const u8* w, long long row_bytes, int r0, int n_rows,
                                       int cols, float* out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * cols) return;
    const int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = el_@T@(w + (long long)(r0 + r) * row_bytes, c, cols);
}
"""

ATTN_SRC = COMMON_SRC + r"""
__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float m = red[0];
    for (int i = 1; i < nw; ++i) m = fmaxf(m, red[i]);
    return m;
}
// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, block per row t; with do_q8 also out[t]'s q8
// form (oq + t n, od + t n / 32) for the quantized rows that read it. vec: block_rmsnorm_vec
// (n <= 4 PI_NORM_VEC blockDim, n % 4 == 0, aligned rows).
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32(const float* x, const float* w,
        int n, float eps, float* out, int do_q8, signed char* oq, float* od, int vec) {
    __shared__ float red[32];
    const long long t = blockIdx.x;
    if (vec) {
        block_rmsnorm_vec<PI_NORM_VEC>(x + t * n, w, n, eps, out + t * n, do_q8, oq + t * n,
                                       od + t * (n >> 5), red);
        return;
    }
    block_rmsnorm(x + t * n, w, n, eps, out + t * n, red);
    if (do_q8) block_quantize_q8(out + t * n, n, oq + t * n, od + t * (n >> 5));
}
// (xq, xd) = the q8 form of x (n values, n % 32 == 0), warp per 32-block.
extern "C" __global__ void quantize_q8(const float* x, int n, signed char* xq, float* xd) {
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (32 * b < n) warp_quantize_q8(x[32 * b + lane], lane, xq + 32 * b, xd + b);
}
// One token at position pos = *pos_p: NeoX rotary embedding (rotate_half) of q (n_head, hd) in
// place and of k (n_kv, hd) into cache_k[pos]; v copied to cache_v[pos]. Caches (n_ctx, n_kv, hd)
// f32. cos_sin (n_ctx, hd/2, 2) f32: cos and sin of pos * base^(-2i/hd), computed once in f64.
// The position is read from device memory so a captured CUDA graph replays for any position.
extern "C" __global__ void rope_store(float* q, const float* k, const float* v, float* cache_k,
        float* cache_v, const float* cos_sin, int n_head, int n_kv, int hd, const int* pos_p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, half = hd >> 1, pos = *pos_p;
    const long long row = (long long)pos * n_kv * hd;
    if (i < (n_head + n_kv) * half) {
        const int head = i / half, j = i % half;
        const float c = cos_sin[((long long)pos * half + j) * 2], s = cos_sin[((long long)pos * half + j) * 2 + 1];
        if (head < n_head) {
            float* p = q + head * hd;
            const float a = p[j], b = p[j + half];
            p[j] = a * c - b * s;
            p[j + half] = b * c + a * s;
        } else {
            const int h = head - n_head;
            const float* p = k + h * hd;
            const float a = p[j], b = p[j + half];
            cache_k[row + h * hd + j] = a * c - b * s;
            cache_k[row + h * hd + j + half] = b * c + a * s;
        }
    }
    if (i < n_kv * hd) cache_v[row + i] = v[i];
}
// One query token at position *pos_p, block per query head: out[h] = softmax(q[h] . k_j * scale)
// @ v_j over the n_att = *pos_p + 1 cache rows (grouped-query: head h reads KV head
// h / (n_head / n_kv)). Dynamic shared memory: at least n_att floats of scores. With do_q8
// (hd % 32 == 0: a warp's 32 values are one block) also out's q8 form (oq, od) for wo.
extern "C" __global__ void attn_decode(const float* q, const float* cache_k, const float* cache_v,
        const int* pos_p, int n_head, int n_kv, int hd, float scale, float* out, int do_q8,
        signed char* oq, float* od) {
    extern __shared__ float sc[];
    __shared__ float red[32];
    const int n_att = *pos_p + 1;
    const int h = blockIdx.x, kvh = h / (n_head / n_kv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* qh = q + h * hd;
    const long long stride = (long long)n_kv * hd;
    for (int j = warp; j < n_att; j += nw) {
        const float* kj = cache_k + j * stride + kvh * hd;
        float s = 0.f;
        for (int d = lane; d < hd; d += 32) s += qh[d] * kj[d];
        s = warp_sum(s);
        if (lane == 0) sc[j] = s * scale;
    }
    __syncthreads();
    float m = -3.402823466e38f;  // -FLT_MAX (NVRTC has no math.h INFINITY)
    for (int j = threadIdx.x; j < n_att; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, red);
    float l = 0.f;
    for (int j = threadIdx.x; j < n_att; j += blockDim.x) { const float e = expf(sc[j] - m); sc[j] = e; l += e; }
    l = block_sum(l, red);  // its __syncthreads also publishes sc
    const float inv = 1.f / l;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float* vd = cache_v + kvh * hd + d;
        float o = 0.f;
        for (int j = 0; j < n_att; ++j) o += sc[j] * vd[j * stride];
        const int e = h * hd + d;
        out[e] = o * inv;
        if (do_q8) warp_quantize_q8(o * inv, lane, oq + (e & ~31), od + (e >> 5));
    }
}
// out[i] += a[i] (the CPU's partial FFN output merged into the residual stream).
extern "C" __global__ void add_f32(float* out, const float* a, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += a[i];
}
"""

_TYPES = ("f32", "f16", "q8_0", "q4_0")
PREDICTOR_SRC = COMMON_SRC + "".join(_PREDICTOR_TEMPLATE.replace("@T@", t) for t in ("f32", "f16"))
_GATHER_SUMS = r"""
// gather_gemv over q4_0 rows with the wide dot and x's block sums (dot_q4_sums): each thread
// block first sums x's int8 per 32-block into shared memory (nb <= 512: 16384 columns), once for
// its 8 rows, then warp per row as gather_gemv.
extern "C" __global__ void gather_gemv_ws_q4_0(const u8* w, long long row_bytes, int n_rows,
        int cols, const float* x, const int* xq, const float* xd, const int* ids, const u8* mask,
        int use_mask, int accumulate, float* out) {
    __shared__ int xs[512];
    const int nb = cols >> 5;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        int t = 0;
        #pragma unroll
        for (int c = 0; c < 8; ++c) t = __dp4a(0x01010101, xq[8 * b + c], t);
        xs[b] = t;
    }
    __syncthreads();
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (k >= n_rows) return;
    float s = 0.f;
    if (!use_mask || mask[ids[k]]) {
        const u8* row = w + k * row_bytes;
        s = warp_sum(((u64)row & 15) == 0 ? dot_q4_sums<true, 4>(row, nb, xq, xd, xs, lane)
                                          : dot_q4_sums<false, 4>(row, nb, xq, xd, xs, lane));
    }
    if (lane == 0) out[k] = accumulate ? out[k] + s : s;
}
"""
GATHER_SRC = (COMMON_SRC + _HOT_CANDIDATES
              + "".join(_GATHER_TEMPLATE.replace("@T@", t) for t in _TYPES) + _GATHER_SUMS)
_AXPY_TYPES = {"f32": ("UnitF32", 4), "f16": ("UnitF16", 4), "q8_0": ("UnitQ8_0", 2),
               "q4_0": ("UnitQ4_0", 4)}  # unit, rows in flight per thread
AXPY_SRC = COMMON_SRC + _AXPY_UNITS + "".join(
    _AXPY_TEMPLATE.replace("@T@", t).replace("@U@", u).replace("@UNROLL@", str(n))
    for t, (u, n) in _AXPY_TYPES.items()) + r"""
// Stage 2: out[c] (+)= sum_j partial[j][c]. Block (32 columns, 8 rows of threads): thread row y
// sums the chunks j = y, y + 8, ... in order, then the 8 sums are added in order through shared
// memory: a fixed order (reproducible) with 8 loads in flight per column instead of one.
extern "C" __global__ void axpy_sum(const float* partial, int n_chunks, int cols, int accumulate,
                                    float* out) {
    __shared__ float s[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x, y = threadIdx.y;
    float v = 0.f;
    if (c < cols)
        for (int j = y; j < n_chunks; j += 8) v += partial[(long long)j * cols + c];
    s[y][threadIdx.x] = v;
    __syncthreads();
    if (y == 0 && c < cols) {
        float t = 0.f;
        #pragma unroll
        for (int i = 0; i < 8; ++i) t += s[i][threadIdx.x];
        out[c] = accumulate ? out[c] + t : t;
    }
}
"""

INPUT_SRC = COMMON_SRC + r"""
// ---- sparse mode "input" (pyinfer.input_sparse: TEAL-style input sparsity) ----------------------
// Channel j of warp-block b (lane = j % 32): keep v where |v| * scale[j] > thr or NaN (scale only with
// has_scale; thr < 0 keeps all: the CPU's mask_inputs rule), store it or 0 to out[j], add the
// kept count to *kept; with do_q8 also the block's q8 form of the masked values (xq, xd: the
// activation the CPU's input-block sums quantize) and its kept channels as a bit mask kmask[b].
__device__ __forceinline__ void mask_store(float v, int j, int n, int b, int lane,
        const float* scale, int has_scale, float thr, float* out, u64* kept, int do_q8,
        signed char* xq, float* xd, unsigned int* kmask) {
    float s = fabsf(v);
    if (has_scale && j < n) s = s * scale[j];
    const bool keep = j < n && !(s <= thr);  // NaN kept
    v = keep ? v : 0.f;
    if (j < n) out[j] = v;
    const unsigned int ball = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) {
        if (ball) atomicAdd(kept, (u64)__popc(ball));
        if (do_q8) kmask[b] = ball;
    }
    if (do_q8) warp_quantize_q8(v, lane, xq + 32 * b, xd + b);
}
// x (n,) f32 masked in place (mask_store), warp per 32 channels.
extern "C" __global__ void mask_q8(float* x, int n, const float* scale, int has_scale, float thr,
        u64* kept, int do_q8, signed char* xq, float* xd, unsigned int* kmask) {
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int j = 32 * b + lane;
    if (32 * b >= n) return;  // the whole warp
    mask_store(j < n ? x[j] : 0.f, j, n, b, lane, scale, has_scale, thr, x, kept, do_q8, xq, xd,
               kmask);
}
// out (n,) = act(gu[0:n]) * gu[n:2n] (act 1: SiLU g / (1 + exp(-g)), 0: ReLU), masked
// (mask_store): the down projection's input, as the CPU's glu_mask / decode_ffn_in make it.
extern "C" __global__ void glu_mask_q8(const float* gu, int n, int act, const float* scale,
        int has_scale, float thr, float* out, u64* kept, int do_q8, signed char* xq, float* xd,
        unsigned int* kmask) {
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int j = 32 * b + lane;
    if (32 * b >= n) return;
    float v = 0.f;
    if (j < n) {
        const float g = gu[j];
        v = (act ? g / (1.f + expf(-g)) : fmaxf(g, 0.f)) * gu[n + j];
    }
    mask_store(v, j, n, b, lane, scale, has_scale, thr, out, kept, do_q8, xq, xd, kmask);
}
// A projection W (n_out, n_in) over the kept input channels only, in the device's input-block
// layout (pyinfer.device.device_ib_layout): per 32-channel block b (bb bytes) the f16 scales
// d[0:n_out, b], for q4_1 / q5_1 then the f16 mins m[0:n_out, b], then 32 value rows, one per
// channel, of n_out int8 q (q8_0) or n_out nibbles u (q4_0: q = u - 8; q4_1: w = d u + m; output o
// in the low nibble of byte o/2 when o is even, the high one when odd), for q5_0 (q = u - 16) and
// q5_1 (w = d u + m) followed by n_out / 8 bytes of fifth bits (bit o % 8 of byte o / 8: 16 added
// to u). A kept channel is one contiguous row, so the bytes read shrink with the sparsity. Sums as
// the CPU's (cython/ibsum.h): per block the exact integer acc[o] = sum over kept c of xq[c] q[o, c]
// (kmask[b]'s bits; xq, xd the masked activation's q8 form), then s[o] += (xd[b] d[o, b]) acc[o]
// (q4_0: acc - 8 sum(xq), q5_0: acc - 16 sum(xq); q4_1, q5_1: plus m[o, b] xd[b] sum(xq)). Thread
// per 32-bit word of a value row (T 8: q8_0, 4 outputs; 4: q4_0, 5: q4_1, 6: q5_0 and 7: q5_1, 8
// outputs, the q5 ones with their byte of fifth bits), so a warp reads 128 contiguous bytes of each
// kept row; grid.y splits the blocks into chunks of bpc, each writing its partial sums (axpy_sum
// adds them up).
template <int T>
__device__ __forceinline__ void ib_gemv_body(const u8* w, int n_blocks, int n_out,
        const signed char* xq, const float* xd, const unsigned int* kmask, int bpc,
        float* partial) {
    const int OPW = T == 8 ? 4 : 8;   // outputs per 32-bit word
    const bool Q5 = T == 6 || T == 7, MIN = T == 5 || T == 7;
    const int HB = MIN ? 4 : 2;       // scale (and min) bytes per output and block
    const int wi = blockIdx.x * blockDim.x + threadIdx.x;
    if (wi * OPW >= n_out) return;
    const long long vrow = T == 8 ? n_out : Q5 ? (long long)n_out / 8 * 5 : n_out / 2;
    const long long bb = (long long)HB * n_out + 32 * vrow;
    const int b0 = blockIdx.y * bpc, b1 = min(n_blocks, b0 + bpc);
    float s[OPW];
    #pragma unroll
    for (int k = 0; k < OPW; ++k) s[k] = 0.f;
    for (int b = b0; b < b1; ++b) {
        unsigned int km = kmask[b];
        if (!km) continue;
        const u8* blk = w + b * bb;
        const u8* vals = blk + (long long)HB * n_out + 4 * wi;
        const signed char* xb = xq + 32 * b;
        int acc[OPW];
        #pragma unroll
        for (int k = 0; k < OPW; ++k) acc[k] = 0;
        int xs = 0;
        while (km) {  // four kept rows' loads in flight before their arithmetic
            unsigned int v[4], h[4];
            int x[4];
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                v[u] = h[u] = 0u;
                x[u] = 0;
                if (km) {
                    const int c = __ffs(km) - 1;
                    km &= km - 1;
                    v[u] = *(const unsigned int*)(vals + c * vrow);
                    if (Q5) h[u] = vals[c * vrow + n_out / 2 - 3 * wi];  // byte n_out / 2 + wi
                    x[u] = xb[c];
                }
            }
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                xs += x[u];
                #pragma unroll
                for (int k = 0; k < OPW; ++k)
                    acc[k] += x[u] * (T == 8 ? (int)(signed char)(v[u] >> (8 * k))
                                             : (int)(((v[u] >> (4 * k)) & 15u) | (((h[u] >> k) & 1u) << 4)));
            }
        }
        const float sb = xd[b];
        const u16* d = (const u16*)blk + OPW * wi;
        #pragma unroll
        for (int k = 0; k < OPW; ++k) {
            const float f = sb * h2f(d[k]);
            if (T == 8) s[k] += f * (float)acc[k];
            else if (T == 4) s[k] += f * (float)(acc[k] - 8 * xs);
            else if (T == 6) s[k] += f * (float)(acc[k] - 16 * xs);
            else s[k] += f * (float)acc[k] + h2f(d[n_out + k]) * (sb * (float)xs);
        }
    }
    float* p = partial + (long long)blockIdx.y * n_out + OPW * wi;
    #pragma unroll
    for (int k = 0; k < OPW; ++k) p[k] = s[k];
}
// The entries, one a type (T as ib_gemv_body's); cuda.IB_KERNELS names them.
#define PI_IB_GEMV(NAME, T)                                                                    \
    extern "C" __global__ void ib_gemv_##NAME(const u8* w, int n_blocks, int n_out,           \
            const signed char* xq, const float* xd, const unsigned int* kmask, int bpc,       \
            float* partial) {                                                                  \
        ib_gemv_body<T>(w, n_blocks, n_out, xq, xd, kmask, bpc, partial);                      \
    }
PI_IB_GEMV(q8_0, 8)
PI_IB_GEMV(q4_0, 4)
PI_IB_GEMV(q4_1, 5)
PI_IB_GEMV(q5_0, 6)
PI_IB_GEMV(q5_1, 7)
// Element (j, o) of W^T, dequantized: rows j0 .. j0 + n_rows of out (n_rows, n_out) f32 (prefill's
// GEMM over the masked batch: the same numbers).
extern "C" __global__ void ib_dequant_t(const u8* w, int qt, int n_out, int j0, int n_rows,
                                        float* out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * n_out) return;
    const int j = j0 + (int)(i / n_out), o = (int)(i % n_out), b = j >> 5, c = j & 31;
    const bool q5 = qt == 6 || qt == 7, has_min = qt == 5 || qt == 7;
    const int HB = has_min ? 4 : 2;
    const long long vrow = qt == 8 ? n_out : q5 ? (long long)n_out / 8 * 5 : n_out / 2;
    const u8* blk = w + (long long)b * ((long long)HB * n_out + 32 * vrow);
    const float d = h2f(((const u16*)blk)[o]);
    const u8* row = blk + (long long)HB * n_out + c * vrow;
    if (qt == 8) { out[i] = d * (float)(signed char)row[o]; return; }
    int u = (row[o >> 1] >> (4 * (o & 1))) & 15;
    if (q5) u |= ((row[n_out / 2 + (o >> 3)] >> (o & 7)) & 1) << 4;
    out[i] = has_min ? d * (float)u + h2f(((const u16*)blk)[n_out + o])
                     : d * (float)(u - (qt == 4 ? 8 : 16));
}
"""

#: name -> CUDA source; one RawModule each (tests compile every one with nvcc).
SOURCES = {"predictor": PREDICTOR_SRC, "gather": GATHER_SRC, "axpy": AXPY_SRC, "attn": ATTN_SRC,
           "input": INPUT_SRC}
#: kernels each source must define (the nvcc and NVRTC tests count them)
N_KERNELS = {"predictor": 4, "gather": 26, "axpy": 9, "attn": 5, "input": 8}
_TYPE_NAME = {QT.F32: "f32", QT.F16: "f16", QT.Q8_0: "q8_0", QT.Q4_0: "q4_0"}
#: weight types the kernels read (the QT names, lower case)
GPU_TYPES = tuple(t.name.lower() for t in _TYPE_NAME)

_BLOCK = 256  # threads per block: 8 warps (8 rows) for the warp-per-row kernels
_ROWS_PER_CHUNK = 64  # AXPY rows per grid.y chunk
_ATTN_BLOCK = 128
#: attention scores per query head live in shared memory: at most this many cache rows on the
#: decode kernel (48 KiB, the default dynamic shared memory limit); longer contexts use the
#: batched (cuBLAS) path
MAX_DECODE_ATTN_ROWS = 48 * 1024 // 4 - 64


@functools.lru_cache(maxsize=None)
def _module(name: str, device_id: int):
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=SOURCES[name], options=("-std=c++14",))


@functools.lru_cache(maxsize=None)
def _function(module: str, fn: str, device_id: int):
    return _module(module, device_id).get_function(fn)


def _kernel(module: str, fn: str):
    """The compiled kernel ``fn`` of source ``module`` on the current device (looked up once)."""
    return _function(module, fn, cupy.cuda.Device().id)


# ---- device-resident weights ---------------------------------------------------------------------
@dataclass
class DeviceRows:
    """Rows of one weight copied to a device: ``data`` (n_rows, row_bytes) uint8 (a cupy array,
    or a numpy array for ``NumpyDevice``) in ``pyinfer.device.device_layout`` (f32/f16 as stored,
    q8_0/q4_0 rows split into quants then scales), ``qtype`` f32/f16/q8_0/q4_0, ``cols`` the
    dequantized row length. ``f32`` is NumpyDevice's dequantized copy (None on a GPU)."""

    data: object
    qtype: QT
    rows: int
    cols: int
    f32: np.ndarray | None = None

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1]) if self.rows else 0

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _grid_rows(n_rows: int) -> tuple[int]:
    return (max(1, (n_rows * 32 + _BLOCK - 1) // _BLOCK),)


def _grid(n: int, block: int = _BLOCK) -> tuple[int]:
    return (max(1, (n + block - 1) // block),)


# ---- wrappers (cupy arrays in, cupy arrays out; all asynchronous on the current stream) ----------
def norm_fc1(fc1: DeviceRows, x, hid, norm_w=None, eps: float = 0.0, h=None, q8=None) -> None:
    """hid[:rank] = relu(fc1 @ x), and with ``norm_w`` also h = rmsnorm(x) * norm_w in the same
    launch (one extra block), and with ``q8`` = (hq, hd) also h's q8 form (``quantize_q8``).
    fc1 (rank, n_embd) f32 or f16; x, h, norm_w (n_embd,) f32."""
    t = _TYPE_NAME[fc1.qtype]
    do_norm = norm_w is not None
    do_q8, hq, hd = _q8_out(q8)
    vec = do_norm and _norm_vec_ok(fc1.cols, x, norm_w, h, *((hq,) if do_q8 else ()))
    block = _norm_vec_block(fc1.cols) if vec else _BLOCK
    grid = _grid(32 * fc1.rows, block)[0] + do_norm
    f32 = _dummy()["f32"]
    _kernel("predictor", f"norm_fc1_{t}")(
        (grid,), (block,),
        (fc1.data, np.int64(fc1.row_bytes), np.int32(fc1.rows), np.int32(fc1.cols), x, hid,
         np.int32(do_norm), norm_w if do_norm else f32, np.float32(eps), h if do_norm else f32,
         np.int32(do_q8 and do_norm), hq, hd, np.int32(vec)))


def predictor_fc2(fc2: DeviceRows, hid, mask, threshold: float) -> None:
    """mask[n] = (fc2 @ hid)[n] >= threshold: fc2 (n_ff, rank) f32 or f16, hid (rank,) f32,
    mask (n_ff,) uint8 out."""
    _kernel("predictor", f"predictor_fc2_{_TYPE_NAME[fc2.qtype]}")(
        _grid_rows(fc2.rows), (_BLOCK,),
        (fc2.data, np.int64(fc2.row_bytes), np.int32(fc2.rows), np.int32(fc2.cols), hid,
         np.float32(threshold), mask))


def predictor_mask(fc1: DeviceRows, fc2: DeviceRows, x, hid, mask, threshold: float) -> None:
    """mask[n] = (fc2 @ relu(fc1 @ x))[n] >= threshold. fc1 (rank, n_embd), fc2 (n_ff, rank),
    f32 or f16 as the file stores them; x (n_embd,) f32, hid (>= rank,) f32 scratch, mask (n_ff,)
    uint8 out."""
    norm_fc1(fc1, x, hid)
    predictor_fc2(fc2, hid, mask, threshold)


#: weight types whose dots read the activation's q8 form (int8 per 32-block + f32 scales)
Q8_TYPES = (QT.Q8_0, QT.Q4_0)


def reads_q8(w: DeviceRows) -> bool:
    """True when w's kernels read the q8 form of their activation (``quantize_q8``)."""
    return w.qtype in Q8_TYPES


def q8_buffers(n: int):
    """Device buffers (xq (n,) int8, xd (n/32,) f32) for the q8 form of an n-value activation."""
    return cupy.empty(n, cupy.int8), cupy.empty(max(1, n // 32), cupy.float32)


def quantize_q8(x, q8) -> None:
    """q8 = (xq, xd) <- x (n,) f32 quantized per 32-block as the CPU kernels quantize it
    (simd.h pi_quantize_q8: d = max|x| / 127, q = rint(x * (1 / d))): xq (>= n,) int8, xd
    (>= n/32,) f32. Raises ValueError unless n is a multiple of 32."""
    n = x.size
    _check_q8_len(n)
    xq, xd = q8
    _kernel("attn", "quantize_q8")(_grid_rows(n // 32), (_BLOCK,), (x, np.int32(n), xq, xd))


def _check_q8_len(n: int) -> None:
    if n % 32:
        raise ValueError(f"q8 activations need a multiple of 32 values, got {n}")


def _q8_out(q8):
    """Kernel arguments (do_q8, xq, xd) of a kernel that can also write its output's q8 form."""
    if q8 is None:
        d = _dummy()
        return 0, d["u8"], d["f32"]
    return 1, q8[0], q8[1]


def _q8_in(w: DeviceRows, x, q8):
    """(xq, xd) a kernel over w's rows reads: for quantized rows ``q8`` when given (already
    holding x's q8 form), else x quantized here into a scratch pair; dummies for float rows."""
    if not reads_q8(w):
        d = _dummy()
        return d["u8"], d["f32"]
    if q8 is None:
        q8 = _q8_scratch(cupy.cuda.Device().id, x.size)
        quantize_q8(x, q8)
    return q8


@functools.lru_cache(maxsize=None)
def _q8_scratch(device_id: int, n: int):
    return q8_buffers(n)


def _mask_args(ids, mask):
    if mask is None:
        dummy = _dummy()
        return dummy["i32"], dummy["u8"], np.int32(0)
    return ids, mask, np.int32(1)


@functools.lru_cache(maxsize=None)
def _dummy_for(device_id: int):
    return {"i32": cupy.zeros(1, cupy.int32), "u8": cupy.zeros(1, cupy.uint8),
            "f32": cupy.zeros(1, cupy.float32), "u64": cupy.zeros(1, cupy.uint64),
            "u32": cupy.zeros(1, cupy.uint32)}


def _dummy():
    return _dummy_for(cupy.cuda.Device().id)


def gather_gemv(w: DeviceRows, x, out, ids=None, mask=None, accumulate: bool = False,
                q8=None) -> None:
    """out[k] (+)= w[k] . x; with ``mask`` (n_ff,) uint8 and ``ids`` (n_rows,) int32, rows whose
    neuron ids[k] is unmasked add 0 without being read. x (cols,) f32, out (n_rows,) f32.
    q8/q4_0 rows compute w[k] . q8(x) (``quantize_q8``; ``q8`` = (xq, xd) when x's q8 form is
    already there, else it is made here first), as the CPU kernels do."""
    if w.rows == 0:
        return
    xq, xd = _q8_in(w, x, q8)
    ids, mask, use = _mask_args(ids, mask)
    wide = "_w" if _GEMV_WIDE and w.qtype in Q8_TYPES else ""
    if _GEMV_SUMS and w.qtype == QT.Q4_0 and w.cols <= 32 * _GEMV_SUMS_BLOCKS:
        wide = "_ws"
    _kernel("gather", f"gather_gemv{wide}_{_TYPE_NAME[w.qtype]}")(
        _grid_rows(w.rows), (_BLOCK,),
        (w.data, np.int64(w.row_bytes), np.int32(w.rows), np.int32(w.cols), x, xq, xd, ids,
         mask, use, np.int32(bool(accumulate)), out))


#: ffn_gate_up's predictor case in two launches (``hot_candidates`` listing the candidates, then
#: ``ffn_gate_up_list_*`` over the list only) instead of one; off until measured on a GPU
#: (``set_gate_up_list``; tools/bench_gpu.py --gate-up-ab times both)
_GATE_UP_LIST = False


def set_gate_up_list(on: bool) -> None:
    """Choose ffn_gate_up's form when a predictor is given: two launches (True) or the fused one
    (False, the default). Both compute the same coefficients and counts. Measured on an H200
    (docs/benchmarks.md, session 23; 7B q4_0): the same GPU work, 0.98x the fused form's tokens/s
    with every neuron on the GPU, so the fused form stays the default."""
    global _GATE_UP_LIST
    _GATE_UP_LIST = bool(on)


#: ffn_gate_up's WIDE form for quantized rows where rows are candidates (a mask or a predictor):
#: a candidate's gate and up loads in flight together (``dot2x_*``), one memory round trip a row
#: instead of about 2 nb / (8 U). On by default since an H200 measured it (docs/benchmarks.md,
#: session 28: 7B / 13B q4_0 with every neuron on the GPU 1.09x / 1.10x tokens/s, at 50% of the
#: FFN 1.03x / 1.01x); ``set_gate_up_wide``; tools/bench_gpu.py --wide-ab and
#: tools/ffn_variants_gpu.py time both
_GATE_UP_WIDE = True


def gate_up_wide() -> bool:
    """Whether ffn_gate_up's candidate cases take the wide dots (``set_gate_up_wide``)."""
    return _GATE_UP_WIDE


def set_gate_up_wide(on: bool) -> None:
    """Choose the dots of ffn_gate_up's candidate cases (a mask or a predictor; both launch
    forms) for q8_0/q4_0 rows: the wide form (True: every load of a candidate's gate and up rows
    in flight before any arithmetic, up read even where a ReLU gate drops the neuron; the
    default) or the GEMV's dot (False). The same coefficients up to the order of the sums; the
    dense case (every row) takes the GEMV's form (``set_gemv_wide``)."""
    global _GATE_UP_WIDE
    _GATE_UP_WIDE = bool(on)


#: the dense GEMVs' dot for q8_0/q4_0 rows (``gather_gemv``: q/k/v, the attention output, the
#: logits; ``ffn_gate_up`` with every row): the wide one-row form (``dot1x_*``: a lane's blocks
#: as 16-byte loads, a row's loads in flight at once) instead of the GEMV's (a lane per 32-bit
#: word, U steps in flight). Written in session 29 without a GPU: off until measured
#: (``set_gemv_wide``; tools/ffn_variants_gpu.py and tools/bench_gpu.py --forms-ab time both)
_GEMV_WIDE = False
#: q4_0's dense GEMVs (``gather_gemv``) with the wide dot and x's block sums made once per thread
#: block in shared memory (``gather_gemv_ws_q4_0``: two ``__dp4a`` a quant word instead of four;
#: rows of at most 32 _GEMV_SUMS_BLOCKS columns). Written in session 29 without a GPU: off until
#: measured (``kernel_forms(gemv_sums=True)``; tools/gemv_variants_gpu.py "x sums smem")
_GEMV_SUMS = False
_GEMV_SUMS_BLOCKS = 512  # the kernel's shared array
#: RMSNorm (``rmsnorm``, ``norm_fc1``'s norm block) in registers (``block_rmsnorm_vec``: one
#: load of each value, the q8 form from registers, up to 1024 threads a row) instead of three
#: passes over memory by 256 threads. Written in session 29 without a GPU: off until measured
#: (``set_norm_vec``)
_NORM_VEC = False
#: float4s a thread holds in block_rmsnorm_vec (PI_NORM_VEC in the source) and its most threads
_NORM_VEC_PER, _NORM_VEC_THREADS = 4, 1024


def gemv_wide() -> bool:
    """Whether the dense GEMVs take the wide one-row dot (``set_gemv_wide``)."""
    return _GEMV_WIDE


def set_gemv_wide(on: bool) -> None:
    """Choose the dot of the dense GEMVs over q8_0/q4_0 rows (``gather_gemv``, and
    ``ffn_gate_up`` without candidates): the wide one-row form (True) or the GEMV's (False, the
    default). The same values up to the order of the sums."""
    global _GEMV_WIDE
    _GEMV_WIDE = bool(on)


def norm_vec() -> bool:
    """Whether RMSNorm runs in registers (``set_norm_vec``)."""
    return _NORM_VEC


def set_norm_vec(on: bool) -> None:
    """Choose RMSNorm's form (``rmsnorm``, ``norm_fc1``): in registers (True; rows of at most
    16384 values, a multiple of 4, on 16-byte aligned arrays, else the other form) or three
    passes over memory (False, the default). The same values up to the order of the sum of
    squares; the q8 form is the same function of them."""
    global _NORM_VEC
    _NORM_VEC = bool(on)


@contextlib.contextmanager
def kernel_forms(**forms):
    """Within the block, the kernel forms given (``gate_up_list``, ``gate_up_wide``,
    ``gemv_wide``, ``gemv_sums``, ``norm_vec``: True or False), each set back afterwards. For
    tests and benchmarks; raises TypeError for another name."""
    names = {"gate_up_list": "_GATE_UP_LIST", "gate_up_wide": "_GATE_UP_WIDE",
             "gemv_wide": "_GEMV_WIDE", "gemv_sums": "_GEMV_SUMS", "norm_vec": "_NORM_VEC"}
    bad = sorted(set(forms) - set(names))
    if bad:
        raise TypeError(f"unknown kernel form(s): {', '.join(bad)}")
    g = globals()
    old = {k: g[names[k]] for k in forms}
    try:
        for k, v in forms.items():
            g[names[k]] = bool(v)
        yield
    finally:
        for k, v in old.items():
            g[names[k]] = v


def _norm_vec_ok(n: int, *arrays) -> bool:
    """Whether RMSNorm of rows of n values over ``arrays`` (x, w, out and the q8 values it
    writes as 32-bit words) runs in registers."""
    return (_NORM_VEC and n % 4 == 0 and n <= 4 * _NORM_VEC_PER * _NORM_VEC_THREADS
            and all(a.data.ptr % 16 == 0 for a in arrays))


def _norm_vec_block(n: int) -> int:
    """Threads of a block_rmsnorm_vec row: a float4 each where that fits, a multiple of 32."""
    return min(_NORM_VEC_THREADS, 32 * -(-n // 128))


def _gate_up_kernel(base: str, qtype: QT, cand: int) -> str:
    """The kernel name of ffn_gate_up's form ``base`` for rows of qtype (``_w`` for the wide
    form: quantized rows only; with candidates where ``gate_up_wide()``, for every row where
    ``gemv_wide()``)."""
    wide = (_GATE_UP_WIDE if cand else _GEMV_WIDE) and qtype in Q8_TYPES
    return f"{base}{'_w' if wide else ''}_{_TYPE_NAME[qtype]}"


def gate_up_list_len(n_rows: int) -> int:
    """int32 entries of the candidate list ffn_gate_up's two-launch form needs (count + rows)."""
    return n_rows + 1


def ffn_gate_up(gate: DeviceRows, up: DeviceRows, x, coef, counts, act: str, act_thr: float,
                ids=None, mask=None, glu: bool = False, pred=None, q8=None, scratch=None) -> None:
    """coef[k] = act(gate[k].x) * (up[k].x) where neuron ids[k] is a candidate and the magnitude
    passes (|act| > act_thr, or |act * up| with ``glu``), else 0. Candidates: every row; or
    where ``mask`` (n_ff,) uint8 is set at ids[k]; or, with ``pred`` = (fc2 DeviceRows (n_ff,
    rank), hid (rank,) f32, threshold), where fc2[ids[k]] . hid >= threshold (the predictor
    computed inline, or, after ``set_gate_up_list(True)``, by a first launch that lists the
    candidates into ``scratch``: int32 of >= gate_up_list_len(n_rows), allocated here when None).
    x (cols,) f32, ids (n_rows,) int32, coef (n_rows,) f32, counts (2,) uint64 accumulates
    [candidates, kept]. act "relu" | "silu"; act_thr < 0 computes every row (dense). q8/q4_0
    rows read q8(x), as ``gather_gemv``."""
    if gate.rows == 0:
        return
    if up.qtype != gate.qtype or up.row_bytes != gate.row_bytes:  # one kernel reads both
        raise ValueError(f"ffn_gate_up: gate {gate.qtype.name} and up {up.qtype.name} rows differ "
                         "(hybrid.place_model refuses such a file)")
    xq, xd = _q8_in(gate, x, q8)
    dummy = _dummy()
    fc2, hid, pred_thr, rank, half, fc2_rb = dummy["u8"], dummy["f32"], 0.0, 0, 0, 0
    if pred is not None:
        f2, hid, pred_thr = pred
        fc2, rank, half, fc2_rb = f2.data, f2.cols, int(f2.qtype == QT.F16), f2.row_bytes
        cand, mask = 2, dummy["u8"]
        if _GATE_UP_LIST:
            if scratch is None:
                scratch = _list_scratch(cupy.cuda.Device().id, gate_up_list_len(gate.rows))
            scratch[:1].fill(0)
            _kernel("gather", "hot_candidates")(
                _grid_rows(gate.rows), (_BLOCK,),
                (ids, np.int32(gate.rows), fc2, np.int64(fc2_rb), np.int32(rank), np.int32(half),
                 hid, np.float32(pred_thr), coef, scratch, counts))
            _kernel("gather", _gate_up_kernel("ffn_gate_up_list", gate.qtype, cand))(
                _grid_rows(gate.rows), (_BLOCK,),
                (gate.data, up.data, np.int64(gate.row_bytes), np.int32(gate.cols), x, xq, xd,
                 scratch, np.int32(act == "silu"), np.int32(bool(glu)), np.float32(act_thr),
                 coef, counts))
            return
    elif mask is not None:
        cand = 1
    else:
        cand, ids, mask = 0, dummy["i32"], dummy["u8"]
    _kernel("gather", _gate_up_kernel("ffn_gate_up", gate.qtype, cand))(
        _grid_rows(gate.rows), (_BLOCK,),
        (gate.data, up.data, np.int64(gate.row_bytes), np.int32(gate.rows), np.int32(gate.cols),
         x, xq, xd, ids, mask, np.int32(cand), fc2, np.int64(fc2_rb), np.int32(rank), np.int32(half),
         hid, np.float32(pred_thr), np.int32(act == "silu"), np.int32(bool(glu)),
         np.float32(act_thr), coef, counts))


@functools.lru_cache(maxsize=None)
def _list_scratch(device_id: int, n: int):
    return cupy.empty(n, cupy.int32)


def axpy_chunks(n_rows: int) -> int:
    """Row chunks of an AXPY over n_rows rows (the partial-sum scratch holds this many rows of
    cols floats)."""
    return (n_rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK


#: columns per AXPY thread (one unit: ``_AXPY_UNITS`` in the source) and threads per block
_AXPY_UNIT_COLS = {QT.F32: 4, QT.F16: 8, QT.Q8_0: 32, QT.Q4_0: 32}
_AXPY_BLOCK = 64  # >= _ROWS_PER_CHUNK: one thread lists each row of the chunk


def axpy_rows(w: DeviceRows, coef, out, skip_zero: bool = True, accumulate: bool = False,
              scratch=None) -> None:
    """out (+)= sum_k coef[k] * w[k]: out (cols,) f32 is overwritten unless ``accumulate``.
    coef (n_rows,) f32. scratch: f32 device buffer of >= axpy_chunks(n_rows) * cols (allocated
    here when None). Raises ValueError when cols is not a multiple of the type's unit (4 f32,
    8 f16, 32 quantized columns)."""
    cols = w.cols
    if w.rows == 0:
        if not accumulate:
            out.fill(0)
        return
    v = _AXPY_UNIT_COLS[w.qtype]
    if cols % v:
        raise ValueError(f"AXPY over {w.qtype.name} rows needs a multiple of {v} columns, got {cols}")
    n_chunks = axpy_chunks(w.rows)
    if scratch is None:
        scratch = cupy.empty(n_chunks * cols, cupy.float32)
    tile = _AXPY_BLOCK * v
    grid = ((cols + tile - 1) // tile, n_chunks)
    _kernel("axpy", f"axpy_part_{_TYPE_NAME[w.qtype]}")(
        grid, (_AXPY_BLOCK,),
        (w.data, np.int64(w.row_bytes), np.int32(w.rows), np.int32(cols), coef,
         np.int32(_ROWS_PER_CHUNK), np.int32(bool(skip_zero)), scratch))
    _sum_partials(scratch, n_chunks, cols, accumulate, out)


def _sum_partials(scratch, n_chunks: int, cols: int, accumulate: bool, out) -> None:
    """out (cols,) (+)= the sum of the n_chunks rows of partial sums in scratch (``axpy_sum``)."""
    _kernel("axpy", "axpy_sum")(((cols + 31) // 32,), (32, 8),
                                (scratch, np.int32(n_chunks), np.int32(cols),
                                 np.int32(bool(accumulate)), out))


def dequant(w: DeviceRows, r0: int, n_rows: int, out) -> None:
    """out[:n_rows * cols] = rows r0 .. r0+n_rows of w dequantized to f32 (row-major)."""
    n = n_rows * w.cols
    if n == 0:
        return
    _kernel("axpy", f"dequant_{_TYPE_NAME[w.qtype]}")(
        _grid(n), (_BLOCK,),
        (w.data, np.int64(w.row_bytes), np.int32(r0), np.int32(n_rows), np.int32(w.cols), out))


def rmsnorm(x, w, eps: float, out, q8=None) -> None:
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. x, out (n_tok, n) f32, w (n,) f32; with
    ``q8`` = (xq (n_tok n,) int8, xd (n_tok n / 32,) f32) also out's q8 form (``quantize_q8``;
    n a multiple of 32)."""
    n_tok, n = x.shape
    do_q8, xq, xd = _q8_out(q8)
    if do_q8:
        _check_q8_len(n)
    vec = _norm_vec_ok(n, x, w, out, *((xq,) if do_q8 else ()))
    _kernel("attn", "rmsnorm_f32")((n_tok,), (_norm_vec_block(n) if vec else _BLOCK,),
                                   (x, w, np.int32(n), np.float32(eps), out, np.int32(do_q8), xq,
                                    xd, np.int32(vec)))


def rope_store(q, k, v, cache_k, cache_v, cos_sin, pos) -> None:
    """One token: RoPE (NeoX) of q (n_head, hd) in place and of k into cache_k[pos]; v to
    cache_v[pos]. Caches (n_ctx, n_kv, hd) f32; cos_sin (n_ctx, hd/2, 2) f32; pos (1,) int32 on
    the device."""
    n_head, hd = q.shape
    n_kv = k.shape[0]
    n = max((n_head + n_kv) * (hd // 2), n_kv * hd)
    _kernel("attn", "rope_store")(_grid(n), (_BLOCK,),
                                  (q, k, v, cache_k, cache_v, cos_sin, np.int32(n_head),
                                   np.int32(n_kv), np.int32(hd), pos))


def attn_decode(q, cache_k, cache_v, pos, out, max_att: int, q8=None) -> None:
    """out (n_head, hd) = causal attention of one query q (n_head, hd) at position pos ((1,)
    int32 on the device) over cache rows <= pos (caches (n_ctx, n_kv, hd) f32), scale
    1/sqrt(hd). max_att >= pos + 1 sizes the shared memory; <= MAX_DECODE_ATTN_ROWS. With
    ``q8`` = (xq, xd) also out's q8 form (``quantize_q8``): in the same launch where hd is a
    multiple of 32, else by a second one."""
    n_head, hd = q.shape
    n_kv = cache_k.shape[1]
    fused = q8 is not None and hd % 32 == 0
    do_q8, xq, xd = _q8_out(q8 if fused else None)
    _kernel("attn", "attn_decode")((n_head,), (_ATTN_BLOCK,),
                                   (q, cache_k, cache_v, pos, np.int32(n_head),
                                    np.int32(n_kv), np.int32(hd), np.float32(1.0 / np.sqrt(hd)),
                                    out, np.int32(do_q8), xq, xd), shared_mem=4 * max_att)
    if q8 is not None and not fused:
        quantize_q8(out.reshape(-1), q8)


def add(out, a) -> None:
    """out += a, both (n,) f32 on the device."""
    n = out.size
    _kernel("attn", "add_f32")(_grid(n), (_BLOCK,), (out, a, np.int32(n)))


# ---- sparse mode "input" -------------------------------------------------------------------------
#: input-block type id (pyinfer.ops.cpu) -> (kernel suffix, outputs per 32-bit word, the
#: kernels' T: 8 q8_0, 4 q4_0, 5 q4_1, 6 q5_0, 7 q5_1)
IB_KERNELS = {_cpu.Q8_0_IB: ("q8_0", 4, 8), _cpu.Q4_0_IB: ("q4_0", 8, 4),
              _cpu.Q4_1_IB: ("q4_1", 8, 5), _cpu.Q5_0_IB: ("q5_0", 8, 6), _cpu.Q5_1_IB: ("q5_1", 8, 7)}
#: warps an input-block GEMV aims to keep busy (grid.y chunks of blocks make up for few outputs)
IB_TARGET_WARPS = 2048


def is_ib(w: DeviceRows) -> bool:
    """True for a matrix in the device's input-block layout (``ib_gemv``): rows = input
    channels, cols = outputs."""
    return w.qtype in IB_KERNELS


def ib_n_chunks(n_in: int, n_out: int, qtype: int) -> int:
    """Chunks of input blocks (grid.y) of ``ib_gemv`` over a (n_out, n_in) matrix: enough warps
    for IB_TARGET_WARPS, at most one per block. The partial sums take n_chunks * n_out floats."""
    warps = -(-n_out // (32 * IB_KERNELS[qtype][1]))
    return max(1, min(n_in // 32, -(-IB_TARGET_WARPS // warps)))


def ib_scratch_len(n_in: int, n_out: int) -> int:
    """Floats of partial sums ``ib_gemv`` needs for a (n_out, n_in) matrix of any input-block type."""
    return max(ib_n_chunks(n_in, n_out, t) for t in IB_KERNELS) * n_out


def mask_inputs(x, scale, thr: float, kept=None, q8=None, kmask=None) -> None:
    """Input sparsity's mask in place on x (n,) f32: x[j] = 0 where |x[j]| * scale[j] <= thr
    (``scale`` (n,) f32 or None for 1; thr < 0 keeps all), the CPU's ``cpu.mask_inputs`` rule;
    ``kept`` ((1,) uint64 on the device, or None) += the channels kept. With ``q8`` = (xq, xd) and
    ``kmask`` ((n / 32,) uint32) also the masked x's q8 form (``quantize_q8``) and each block's
    kept channels as bits, what ``ib_gemv`` reads. ValueError unless n % 32 == 0 with q8."""
    _mask_launch("mask_q8", x.size, (x,), scale, thr, kept, q8, kmask)


def glu_mask(gu, n: int, act: str, scale, thr: float, out, kept=None, q8=None, kmask=None) -> None:
    """out (n,) f32 = act(gu[:n]) * gu[n:2n] (act "silu" or "relu"), masked as ``mask_inputs``
    (the down projection's input in sparse mode input)."""
    _mask_launch("glu_mask_q8", n, (gu, np.int32(n), np.int32(act == "silu")), scale, thr, kept,
                 q8, kmask, out)


def _mask_launch(fn, n, head, scale, thr, kept, q8, kmask, out=None):
    do_q8, xq, xd = _q8_out(q8)
    if do_q8:
        _check_q8_len(n)
    d = _dummy()
    if do_q8 and kmask is None:  # the kernel writes a block's kept bits with its q8 form
        kmask = _kmask_scratch(cupy.cuda.Device().id, n // 32)
    args = head if fn == "glu_mask_q8" else (head[0], np.int32(n))
    args += (d["f32"] if scale is None else scale, np.int32(scale is not None), np.float32(thr))
    if out is not None:
        args += (out,)
    args += (d["u64"] if kept is None else kept, np.int32(do_q8), xq, xd,
             d["u32"] if kmask is None else kmask)
    _kernel("input", fn)(_grid_rows(-(-n // 32)), (_BLOCK,), args)


@functools.lru_cache(maxsize=None)
def _kmask_scratch(device_id: int, n_blocks: int):
    return cupy.empty(max(1, n_blocks), cupy.uint32)


def ib_gemv(w: DeviceRows, out, q8, kmask, accumulate: bool = False, scratch=None) -> None:
    """out (n_out,) f32 (+)= W xm over the kept channels of the masked activation xm whose q8
    form ``q8`` = (xq, xd) and kept bits ``kmask`` ``mask_inputs`` wrote; w: a (n_out, n_in)
    matrix in the device's input-block layout (``is_ib``; rows n_in, cols n_out). scratch: f32
    device buffer of >= ib_scratch_len(n_in, n_out) (allocated here when None)."""
    name, opw, _t = IB_KERNELS[w.qtype]
    n_in, n_out = w.rows, w.cols
    n_chunks = ib_n_chunks(n_in, n_out, w.qtype)
    bpc = -(-(n_in // 32) // n_chunks)
    n_chunks = -(-(n_in // 32) // bpc)
    if scratch is None:
        scratch = cupy.empty(n_chunks * n_out, cupy.float32)
    words = n_out // opw
    _kernel("input", f"ib_gemv_{name}")(
        ((words + _BLOCK - 1) // _BLOCK, n_chunks), (_BLOCK,),
        (w.data, np.int32(n_in // 32), np.int32(n_out), q8[0], q8[1], kmask, np.int32(bpc),
         scratch))
    _sum_partials(scratch, n_chunks, n_out, accumulate, out)


def ib_dequant_t(w: DeviceRows, r0: int, n_rows: int, out) -> None:
    """out[:n_rows * n_out] = rows r0 .. r0 + n_rows of W^T (input channels) dequantized, f32."""
    n = n_rows * w.cols
    if n == 0:
        return
    _kernel("input", "ib_dequant_t")(
        _grid(n), (_BLOCK,),
        (w.data, np.int32(IB_KERNELS[w.qtype][2]), np.int32(w.cols), np.int32(r0),
         np.int32(n_rows), out))
