"""GPU kernels for the hot neurons: CuPy RawKernels over CUDA sources kept here as raw strings.

Three sources, one ``cupy.RawModule`` each, compiled once per device on first use (CuPy
``examples/gemm``, ``cupyx/scipy/signal/_upfirdn.py``):

- ``PREDICTOR_SRC``: PowerInfer's per-layer predictor, ``mask = fc2 @ relu(fc1 @ x) >= threshold``
  (fc1 GEMV with relu, fc2 GEMV with the threshold), f32 weights.
- ``GATHER_SRC``: warp-per-row GEMV over rows gathered onto the GPU (``gather_gemv_*``) and the
  fused hot-neuron kernel ``ffn_gate_up_*``: a row runs only where the prediction mask is set, then
  ``coef = act(gate . x) * (up . x)`` where ``|act(gate . x)| > act_thr`` (else 0), exactly the rule
  of ``pyinfer.ffn.SparseFFN``.
- ``AXPY_SRC``: ``out = sum_k coef[k] * down_t[k]`` over the hot down rows (zero coefficients are
  skipped), and ``merge_add`` (the CPU's partial FFN output added into the GPU's).

Weights are stored as in the GGUF: f32, f16, q8_0 or q4_0 rows of ``row_bytes`` bytes, dequantized
inside the kernels; activations are f32 and every dot accumulates in f32. Sizes and strides are
passed explicitly (RawKernel ignores strides). f16 is converted with the PTX ``cvt.f32.f16``
instruction so the sources need no header (NVRTC and nvcc both compile them as they are).

Whether a GPU is there is decided once, at import (``available()``); ``PYINFER_DEVICE=cpu`` in the
environment forces the CPU path (tests). Every kernel has a NumPy twin: ``pyinfer.device.NumpyDevice``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

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
        return False, f"CuPy is not installed (pip install pyinfer[cuda]; {_IMPORT_ERROR})"
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
__device__ __forceinline__ float dot_f16(const u8* row, int cols, const float* x, int lane) {
    float s = 0.f;
    if ((cols & 7) == 0) {  // rows are 16-byte multiples: 8 halves per 128-bit load
        const uint4* r = (const uint4*)row;
        const float4* x4 = (const float4*)x;
        for (int i = lane; i < cols / 8; i += 32) {
            uint4 v = r[i];
            float4 a = x4[2 * i], b = x4[2 * i + 1];
            s += h2f(v.x & 0xffff) * a.x + h2f(v.x >> 16) * a.y
               + h2f(v.y & 0xffff) * a.z + h2f(v.y >> 16) * a.w
               + h2f(v.z & 0xffff) * b.x + h2f(v.z >> 16) * b.y
               + h2f(v.w & 0xffff) * b.z + h2f(v.w >> 16) * b.w;
        }
    } else {
        const u16* r = (const u16*)row;
        for (int i = lane; i < cols; i += 32) s += h2f(r[i]) * x[i];
    }
    return s;
}
// q8_0 block: f16 d, int8 q[32]; x = d * q (34 bytes). Eight lanes share a block, 4 values each.
__device__ __forceinline__ float dot_q8_0(const u8* row, int cols, const float* x, int lane) {
    const int nb = cols >> 5, sub = lane & 7;
    float s = 0.f;
    for (int b = lane >> 3; b < nb; b += 4) {
        const u8* blk = row + 34 * b;
        const signed char* q = (const signed char*)(blk + 2) + 4 * sub;
        const float* xx = x + 32 * b + 4 * sub;
        s += ld_half(blk) * (q[0] * xx[0] + q[1] * xx[1] + q[2] * xx[2] + q[3] * xx[3]);
    }
    return s;
}
// q4_0 block: f16 d, u8 qs[16]; x[j] = d*((qs[j] & 15) - 8), x[j+16] = d*((qs[j] >> 4) - 8).
__device__ __forceinline__ float dot_q4_0(const u8* row, int cols, const float* x, int lane) {
    const int nb = cols >> 5, sub = lane & 7;
    float s = 0.f;
    for (int b = lane >> 3; b < nb; b += 4) {
        const u8* blk = row + 18 * b;
        const int q0 = blk[2 + 2 * sub], q1 = blk[3 + 2 * sub];
        const float* xx = x + 32 * b + 2 * sub;
        s += ld_half(blk) * ((float)((q0 & 15) - 8) * xx[0] + (float)((q1 & 15) - 8) * xx[1]
                           + (float)((q0 >> 4) - 8) * xx[16] + (float)((q1 >> 4) - 8) * xx[17]);
    }
    return s;
}

// Element c of one stored row, dequantized.
__device__ __forceinline__ float el_f32(const u8* row, int c) { return ((const float*)row)[c]; }
__device__ __forceinline__ float el_f16(const u8* row, int c) { return h2f(((const u16*)row)[c]); }
__device__ __forceinline__ float el_q8_0(const u8* row, int c) {
    const u8* blk = row + 34 * (c >> 5);
    return ld_half(blk) * (float)((const signed char*)blk)[2 + (c & 31)];
}
__device__ __forceinline__ float el_q4_0(const u8* row, int c) {
    const u8* blk = row + 18 * (c >> 5);
    const int j = c & 31, q = blk[2 + (j & 15)];
    return ld_half(blk) * (float)((j < 16 ? (q & 15) : (q >> 4)) - 8);
}
"""

PREDICTOR_SRC = COMMON_SRC + r"""
// hid[r] = relu(fc1[r] . x), warp per row. fc1 (rank, n_embd) f32 row-major.
extern "C" __global__ void predictor_fc1(const float* fc1, int rank, int n_embd,
                                         const float* x, float* hid) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (r >= rank) return;
    const float s = warp_sum(dot_f32((const u8*)(fc1 + (long long)r * n_embd), n_embd, x, lane));
    if (lane == 0) hid[r] = fmaxf(s, 0.f);
}
// mask[n] = (fc2[n] . hid >= threshold), warp per row. fc2 (n_ff, rank) f32 row-major.
extern "C" __global__ void predictor_fc2(const float* fc2, int n_ff, int rank, const float* hid,
                                         float threshold, u8* mask) {
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (n >= n_ff) return;
    const float s = warp_sum(dot_f32((const u8*)(fc2 + (long long)n * rank), rank, hid, lane));
    if (lane == 0) mask[n] = s >= threshold ? 1 : 0;
}
"""

_GATHER_TEMPLATE = r"""
// out[k] = w[k] . x for the n_rows rows of w (row_bytes apart), warp per row; where use_mask,
// rows whose neuron ids[k] is not in the prediction mask are skipped and give 0.
extern "C" __global__ void gather_gemv_@T@(const u8* w, long long row_bytes, int n_rows, int cols,
        const float* x, const int* ids, const u8* mask, int use_mask, float* out) {
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (k >= n_rows) return;
    if (use_mask && !mask[ids[k]]) { if (lane == 0) out[k] = 0.f; return; }
    const float s = warp_sum(dot_@T@(w + k * row_bytes, cols, x, lane));
    if (lane == 0) out[k] = s;
}
// The hot neurons of one layer, fused: for row k (neuron ids[k]) predicted active (or every row
// when !use_mask), a = act(gate[k] . x) (act 0: relu, 1: silu); where |a| > act_thr,
// coef[k] = a * (up[k] . x), else 0 (up is not read). counts[0] += candidates, counts[1] += active.
extern "C" __global__ void ffn_gate_up_@T@(const u8* gate, const u8* up, long long row_bytes,
        int n_rows, int cols, const float* x, const int* ids, const u8* mask, int use_mask,
        int act, float act_thr, float* coef, u64* counts) {
    __shared__ unsigned int n_cand, n_act;
    if (threadIdx.x == 0) { n_cand = 0; n_act = 0; }
    __syncthreads();
    const int k = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (k < n_rows) {  // no early return: the block meets at __syncthreads below
        float c = 0.f;
        if (!use_mask || mask[ids[k]]) {
            const float g = warp_sum(dot_@T@(gate + k * row_bytes, cols, x, lane));
            const float a = act ? g / (1.f + expf(-g)) : fmaxf(g, 0.f);
            const bool keep = fabsf(a) > act_thr;
            if (keep) c = a * warp_sum(dot_@T@(up + k * row_bytes, cols, x, lane));
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
"""

_AXPY_TEMPLATE = r"""
// out[c] += sum_{k in chunk} coef[k] * w[k][c]: thread per column c, grid.y over chunks of
// rows_per_chunk rows (so a 4096-wide row set still fills the GPU); zero coefs are skipped
// when skip_zero (the test is uniform across the block: no divergence). out is zeroed first.
extern "C" __global__ void axpy_rows_@T@(const u8* w, long long row_bytes, int n_rows, int cols,
        const float* coef, int rows_per_chunk, int skip_zero, float* out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const int k0 = blockIdx.y * rows_per_chunk;
    const int k1 = min(n_rows, k0 + rows_per_chunk);
    float s = 0.f;
    for (int k = k0; k < k1; ++k) {
        const float a = coef[k];
        if (skip_zero && a == 0.f) continue;
        s += a * el_@T@(w + k * row_bytes, c);
    }
    if (s != 0.f) atomicAdd(out + c, s);
}
"""

_TYPES = ("f32", "f16", "q8_0", "q4_0")
GATHER_SRC = COMMON_SRC + "".join(_GATHER_TEMPLATE.replace("@T@", t) for t in _TYPES)
AXPY_SRC = COMMON_SRC + "".join(_AXPY_TEMPLATE.replace("@T@", t) for t in _TYPES) + r"""
extern "C" __global__ void merge_add(float* out, const float* partial, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += partial[i];
}
extern "C" __global__ void zero_f32(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 0.f;
}
"""

#: name -> CUDA source; one RawModule each (tests compile every one with nvcc).
SOURCES = {"predictor": PREDICTOR_SRC, "gather": GATHER_SRC, "axpy": AXPY_SRC}
_TYPE_NAME = {QT.F32: "f32", QT.F16: "f16", QT.Q8_0: "q8_0", QT.Q4_0: "q4_0"}

_BLOCK = 256  # threads per block: 8 warps (8 rows) for the warp-per-row kernels
_ROWS_PER_CHUNK = 64  # AXPY rows per grid.y chunk


@functools.lru_cache(maxsize=None)
def _module(name: str, device_id: int):
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=SOURCES[name], options=("-std=c++14",))


def _kernel(module: str, fn: str):
    return _module(module, cupy.cuda.Device().id).get_function(fn)


# ---- device-resident weights ---------------------------------------------------------------------
@dataclass
class DeviceRows:
    """Rows of one weight copied to a device as stored: ``data`` (n_rows, row_bytes) uint8 (a
    cupy array, or a numpy array for ``NumpyDevice``), ``qtype`` f32/f16/q8_0/q4_0, ``cols`` the
    dequantized row length. ``f32`` is NumpyDevice's dequantized copy (None on a GPU)."""

    data: object
    qtype: QT
    rows: int
    cols: int
    f32: np.ndarray | None = None

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.rows * self.row_bytes)


def _grid_rows(n_rows: int) -> tuple[int]:
    return ((n_rows * 32 + _BLOCK - 1) // _BLOCK,)


# ---- wrappers (cupy arrays in, cupy arrays out; all asynchronous on the current stream) ----------
def predictor_mask(fc1, fc2, x, hid, mask, threshold: float) -> None:
    """mask[n] = (fc2 @ relu(fc1 @ x))[n] >= threshold. fc1 (rank, n_embd) f32, fc2 (n_ff, rank)
    f32, x (n_embd,) f32, hid (>= rank,) f32 scratch, mask (n_ff,) uint8 out."""
    rank, n_embd = fc1.shape
    n_ff = fc2.shape[0]
    _kernel("predictor", "predictor_fc1")(_grid_rows(rank), (_BLOCK,),
                                          (fc1, np.int32(rank), np.int32(n_embd), x, hid))
    _kernel("predictor", "predictor_fc2")(_grid_rows(n_ff), (_BLOCK,),
                                          (fc2, np.int32(n_ff), np.int32(rank), hid,
                                           np.float32(threshold), mask))


def _mask_args(ids, mask):
    if mask is None:
        dummy = _dummy()
        return dummy["i32"], dummy["u8"], np.int32(0)
    return ids, mask, np.int32(1)


@functools.lru_cache(maxsize=None)
def _dummy_for(device_id: int):
    return {"i32": cupy.zeros(1, cupy.int32), "u8": cupy.zeros(1, cupy.uint8)}


def _dummy():
    return _dummy_for(cupy.cuda.Device().id)


def gather_gemv(w: DeviceRows, x, out, ids=None, mask=None) -> None:
    """out[k] = w[k] . x; with ``mask`` (n_ff,) uint8 and ``ids`` (n_rows,) int32, rows whose
    neuron ids[k] is unmasked give 0 without being read. x (cols,) f32, out (n_rows,) f32."""
    ids, mask, use = _mask_args(ids, mask)
    _kernel("gather", f"gather_gemv_{_TYPE_NAME[w.qtype]}")(
        _grid_rows(w.rows), (_BLOCK,),
        (w.data, np.int64(w.row_bytes), np.int32(w.rows), np.int32(w.cols), x, ids, mask, use, out))


def ffn_gate_up(gate: DeviceRows, up: DeviceRows, x, coef, counts, act: str, act_thr: float,
                ids=None, mask=None) -> None:
    """coef[k] = act(gate[k].x) * (up[k].x) where predicted (mask[ids[k]]) and |act| > act_thr,
    else 0. x (cols,) f32, coef (n_rows,) f32, counts (2,) uint64 accumulates [candidates, active].
    act "relu" | "silu"; act_thr < 0 computes every row (dense)."""
    ids, mask, use = _mask_args(ids, mask)
    _kernel("gather", f"ffn_gate_up_{_TYPE_NAME[gate.qtype]}")(
        _grid_rows(gate.rows), (_BLOCK,),
        (gate.data, up.data, np.int64(gate.row_bytes), np.int32(gate.rows), np.int32(gate.cols),
         x, ids, mask, use, np.int32(act == "silu"), np.float32(act_thr), coef, counts))


def axpy_rows(w: DeviceRows, coef, out, skip_zero: bool = True) -> None:
    """out = sum_k coef[k] * w[k] (overwrites out (cols,) f32). coef (n_rows,) f32."""
    cols = w.cols
    _kernel("axpy", "zero_f32")(((cols + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (out, np.int32(cols)))
    if w.rows == 0:
        return
    grid = ((cols + _BLOCK - 1) // _BLOCK, (w.rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK)
    _kernel("axpy", f"axpy_rows_{_TYPE_NAME[w.qtype]}")(
        grid, (_BLOCK,),
        (w.data, np.int64(w.row_bytes), np.int32(w.rows), np.int32(cols), coef,
         np.int32(_ROWS_PER_CHUNK), np.int32(bool(skip_zero)), out))


def merge_add(out, partial) -> None:
    """out += partial (both (n,) f32 on the device): the CPU's partial FFN output merged in."""
    n = out.size
    _kernel("axpy", "merge_add")(((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (out, partial, np.int32(n)))
