#!/usr/bin/env python3
"""Which warp-per-row quantized GEMV reads a q4_0 / q8_0 matrix fastest on this GPU (issue 10).

Times the engine's ``gather_gemv_{q4_0,q8_0}`` against variants of the same warp-per-row kernel
over the same split-layout rows (``pyinfer.device.device_layout``), a lane per 32-bit quant word:

- ``f32 uU`` (``--f32``): the dot the engine ran until session 19, against the f32 activation (eight
  conversions and FMAs per q4_0 word), U words in flight per lane (the engine had 4);
- ``engine, wide``: the engine's wide one-row dot (``gather_gemv_w_*``, session 29, off by
  default: ``cuda.set_gemv_wide``); ``engine, wide + x sums`` (q4_0): with x's block sums made
  per thread block (``gather_gemv_ws_q4_0``, off by default: ``kernel_forms(gemv_sums=True)``);
  ``wideN mM``: the same dot (``dot_wide_t``) with M blocks a lane in flight and N rows a warp;
  ``wide1 mM, x sums`` (q4_0): with the activation's block sums given, two ``__dp4a`` a quant
  word instead of four (against the engine's form, what making the sums in the kernel costs);
- ``q8 uU``: the engine's dot since session 19 (``dot_split_t``): the activation quantized once
  per vector to int8 per 32-block (``cuda.quantize_q8``: d = max|x| / 127, q = rint(x * (1 / d)), the
  CPU kernels' ``pi_quantize_q8``, llama.cpp's q8_0), each quant word dotted with ``__dp4a`` (an
  exact integer per word, one float multiply-add), U words in flight per lane (the engine runs
  q4_0 at 4 and q8_0 at 8: the fastest here on an H200, session 19).

Each matrix is replicated so that the timed launches cycle over more bytes than the L2 holds (a
model's layers never share weights). Reports microseconds per call and GB/s of weight bytes, and
checks every variant against a float64 reference (the f32 variants against W @ x, the q8 ones
against W @ dequant(quantized x)).

    python tools/gemv_variants_gpu.py [--reps 50]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyinfer.device import dequantize_rows, gguf_layout  # noqa: E402
from pyinfer.ops import cuda  # noqa: E402
from pyinfer.ops.cpu import QT  # noqa: E402

VARIANT_SRC = r"""
// The f32-activation dot the engine ran before session 19: word w (quant bytes 4i..4i+3) of a
// block against the block's 32 f32 values xb, eight conversions and FMAs (q4_0) or four (q8_0).
template <int QB>
__device__ __forceinline__ float word_f32(unsigned int w, const float* xb, int i) {
    if (QB == 16) {
        const float4 lo = ((const float4*)xb)[i], hi = ((const float4*)xb)[4 + i];
        return nib(w, 0) * lo.x + nib(w, 8) * lo.y + nib(w, 16) * lo.z + nib(w, 24) * lo.w
             + nib(w, 4) * hi.x + nib(w, 12) * hi.y + nib(w, 20) * hi.z + nib(w, 28) * hi.w;
    }
    const float4 a = ((const float4*)xb)[i];
    return sb(w, 0) * a.x + sb(w, 1) * a.y + sb(w, 2) * a.z + sb(w, 3) * a.w;
}
template <int QB, int U>
__device__ __forceinline__ float dot_f32x(const u8* row, int nb, const float* x, int lane) {
    const int lpb = QB / 4, step = 32 / lpb;
    const u8* ds = row + QB * nb;
    const int i = lane % lpb;
    float s = 0.f;
    int b = lane / lpb;
    for (; b + (U - 1) * step < nb; b += U * step) {
        unsigned int w[U];
        float d[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) w[u] = *(const unsigned int*)(row + QB * (b + u * step) + 4 * i);
        #pragma unroll
        for (int u = 0; u < U; ++u) d[u] = ld_half(ds + 2 * (b + u * step));
        float t = 0.f;
        #pragma unroll
        for (int u = 0; u < U; ++u) t += d[u] * word_f32<QB>(w[u], x + 32 * (b + u * step), i);
        s += t;
    }
    for (; b < nb; b += step) s += ld_half(ds + 2 * b) * word_f32<QB>(*(const unsigned int*)(row + QB * b + 4 * i), x + 32 * b, i);
    return s;
}
// U words in flight: the f32-activation dot above, and the engine's q8 dot (dot_split_t).
#define VARIANTS(QB, NAME, U) \
extern "C" __global__ void gemv_##NAME##_f32_u##U(const u8* w, long long row_bytes, int n_rows, \
        int cols, const float* x, float* out) { \
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31; \
    if (k >= n_rows) return; \
    const float s = warp_sum(dot_f32x<QB, U>(w + k * row_bytes, cols >> 5, x, lane)); \
    if (lane == 0) out[k] = s; \
} \
extern "C" __global__ void gemv_##NAME##_q8_u##U(const u8* w, long long row_bytes, int n_rows, \
        int cols, const int* xq, const float* xd, float* out) { \
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31; \
    if (k >= n_rows) return; \
    const float s = warp_sum(dot_split_t<QB, true, U>(w + k * row_bytes, cols >> 5, xq, xd, lane)); \
    if (lane == 0) out[k] = s; \
}
VARIANTS(16, q4_0, 4) VARIANTS(16, q4_0, 8) VARIANTS(16, q4_0, 16)
VARIANTS(32, q8_0, 4) VARIANTS(32, q8_0, 8) VARIANTS(32, q8_0, 16)
// The wide dots (dot_wide_t, session 29): a lane's whole blocks as 16-byte loads, MAXB blocks a
// lane in flight; NR rows a warp (rows NR k .. NR k + NR - 1), their loads in flight together.
#define WIDE(QB, NAME, MAXB, NR) \
extern "C" __global__ void gemv_##NAME##_wide##NR##_m##MAXB(const u8* w, long long row_bytes, \
        int n_rows, int cols, const int* xq, const float* xd, float* out) { \
    const int k = NR * ((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31; \
    if (k >= n_rows) return; \
    const u8* r[NR]; \
    float s[NR]; \
    for (int j = 0; j < NR; ++j) r[j] = w + (k + j < n_rows ? k + j : k) * row_bytes; \
    dot_wide_t<QB, true, MAXB, NR>(r, cols >> 5, xq, xd, lane, s); \
    for (int j = 0; j < NR; ++j) { \
        const float t = warp_sum(s[j]); \
        if (lane == 0 && k + j < n_rows) out[k + j] = t; \
    } \
}
WIDE(16, q4_0, 1, 1) WIDE(16, q4_0, 2, 1) WIDE(16, q4_0, 4, 1) WIDE(16, q4_0, 8, 1)
WIDE(16, q4_0, 2, 2) WIDE(16, q4_0, 4, 2)
WIDE(32, q8_0, 1, 1) WIDE(32, q8_0, 2, 1) WIDE(32, q8_0, 4, 1) WIDE(32, q8_0, 8, 1)
WIDE(32, q8_0, 2, 2) WIDE(32, q8_0, 4, 2)
// q4_0 with the activation's block sums given in memory (the engine's dot_q4_sums; the engine's
// gather_gemv_ws_q4_0 makes them per thread block in shared memory: "engine, wide + x sums").
#define WIDE_SX(MAXB) \
extern "C" __global__ void gemv_q4_0_sx_m##MAXB(const u8* w, long long row_bytes, int n_rows, \
        int cols, const int* xq, const float* xd, const int* xs, float* out) { \
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31; \
    if (k >= n_rows) return; \
    const float s = warp_sum(dot_q4_sums<true, MAXB>(w + k * row_bytes, cols >> 5, xq, xd, xs, lane)); \
    if (lane == 0) out[k] = s; \
}
WIDE_SX(2) WIDE_SX(4)
"""
#: MAXB of the q4_0 variants with the activation's block sums given
SX_VARIANTS = (2, 4)
#: (MAXB, rows a warp) of the wide variants compiled above
WIDE_VARIANTS = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2))
SOURCE = cuda.COMMON_SRC + VARIANT_SRC
UNROLLS = (4, 8, 16)
QB = {"q4_0": 16, "q8_0": 32}
QTYPE = {"q4_0": QT.Q4_0, "q8_0": QT.Q8_0}


def random_rows(rng, n_rows, cols, qtype):
    """Split-layout rows (device_layout) of random quants with f16 scales around 0.01."""
    nb = cols // 32
    q = rng.integers(0, 256, (n_rows, QB[qtype] * nb), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (n_rows, nb)) * 0.01).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([q, d.reshape(n_rows, 2 * nb)], axis=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--l2-bytes", type=float, default=512e6, help="bytes cycled over per shape")
    ap.add_argument("--f32", action="store_true",
                    help="also the f32-activation dots (session 19: 1.2-1.44x slower than q8)")
    args = ap.parse_args(argv)
    cp = cuda.cupy
    mod = cp.RawModule(code=SOURCE, options=("-std=c++14",))
    gather = cp.RawModule(code=cuda.GATHER_SRC, options=("-std=c++14",))
    dummy_i, dummy_u = cp.zeros(1, cp.int32), cp.zeros(1, cp.uint8)
    rng = np.random.default_rng(0)
    shapes = [(12288, 4096), (4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096),
              (15360, 5120), (13824, 5120)]
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for qtype in ("q4_0", "q8_0"):
        for rows, cols in shapes:
            raw = random_rows(rng, rows, cols, qtype)
            x = rng.standard_normal(cols).astype(np.float32)
            ncopy = max(1, int(args.l2_bytes // raw.nbytes))
            ws = [cp.asarray(raw) for _ in range(ncopy)]
            xg = cp.asarray(x)
            xq, xd = cuda.q8_buffers(cols)
            cuda.quantize_q8(xg, (xq, xd))  # the engine's kernel
            wd = dequantize_rows(gguf_layout(raw, QTYPE[qtype]), QTYPE[qtype], cols).astype(np.float64)
            ref_f = wd @ x.astype(np.float64)
            xqd = cp.asnumpy(xq).astype(np.float64) * np.repeat(cp.asnumpy(xd).astype(np.float64), 32)
            ref_q = wd @ xqd
            scale = np.abs(wd) @ np.abs(x.astype(np.float64))
            out = cp.empty(rows, cp.float32)
            rb = np.int64(raw.shape[1])
            runs = {"engine": (gather.get_function(f"gather_gemv_{qtype}"),
                               lambda w: (w, rb, np.int32(rows), np.int32(cols), xg, xq, xd, dummy_i,
                                          dummy_u, np.int32(0), np.int32(0), out), ref_q)}
            runs["engine, wide"] = (gather.get_function(f"gather_gemv_w_{qtype}"),
                                    runs["engine"][1], ref_q)
            if qtype == "q4_0":
                runs["engine, wide + x sums"] = (gather.get_function("gather_gemv_ws_q4_0"),
                                                 runs["engine"][1], ref_q)
            for u in UNROLLS:
                if args.f32:
                    runs[f"f32 u{u}"] = (mod.get_function(f"gemv_{qtype}_f32_u{u}"),
                                         lambda w: (w, rb, np.int32(rows), np.int32(cols), xg, out), ref_f)
                runs[f"q8 u{u}"] = (mod.get_function(f"gemv_{qtype}_q8_u{u}"),
                                    lambda w: (w, rb, np.int32(rows), np.int32(cols), xq, xd, out), ref_q)
            if qtype == "q4_0":
                xs = cp.asarray(cp.asnumpy(xq).reshape(-1, 32).astype(np.int32).sum(axis=1))
                for m in SX_VARIANTS:
                    runs[f"wide1 m{m}, x sums"] = (
                        mod.get_function(f"gemv_q4_0_sx_m{m}"),
                        lambda w: (w, rb, np.int32(rows), np.int32(cols), xq, xd, xs, out), ref_q)
            for m, nr in WIDE_VARIANTS:
                runs[f"wide{nr} m{m}"] = (mod.get_function(f"gemv_{qtype}_wide{nr}_m{m}"),
                                          lambda w: (w, rb, np.int32(rows), np.int32(cols), xq, xd, out),
                                          ref_q, nr)
            print(f"\n{qtype} {rows} x {cols}: {raw.nbytes / 1e6:.1f} MB per call, {ncopy} copies cycled")
            for block in (256, 128):
                for name, (fn, args_of, ref, *nr) in runs.items():
                    warps = -(-rows // (nr[0] if nr else 1))
                    grid = ((warps * 32 + block - 1) // block,)
                    fn(grid, (block,), args_of(ws[0]))
                    got = cp.asnumpy(out).astype(np.float64)
                    err = float(np.max(np.abs(got - ref) / scale))
                    for j in range(5):
                        fn(grid, (block,), args_of(ws[j % ncopy]))
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record()
                    for j in range(args.reps):
                        fn(grid, (block,), args_of(ws[j % ncopy]))
                    e1.record()
                    e1.synchronize()
                    us = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / args.reps
                    print(f"  block {block:>3} {name:<26} {us:8.1f} us  {raw.nbytes / us / 1e3:7.0f} GB/s"
                          f"  max err {err:.1e}")
            del ws
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
