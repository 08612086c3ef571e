"""The CUDA kernels' per-block arithmetic, checked on the host: the device functions of
``pyinfer.ops.cuda`` that read quantized rows in the device layout (``dotx_q8_0``/``dotx_q4_0``
against the activation's q8 form through ``__dp4a``, the wide one- and two-row forms, q4_0's
with x's block sums, the AXPY units, ``el_*``) compiled as plain
C++ with g++ (a warp emulated by a loop over its 32 lanes, ``__dp4a`` by its definition: four
signed byte products added to an int), against ``gguf``'s dequantization of the same rows and
the q8 activation of ``pyinfer.ops.reference.quantize_act_q8``. CI has no GPU; this is what catches
an indexing slip in the split layout (``pyinfer.device.device_layout``) there. Rows at 16-, 8-,
4- and 2-byte offsets take both the aligned and the 16-bit-load paths. Skipped without g++ or
F16C (the shim converts halves with it)."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from pyinfer.device import dequantize_rows, device_layout, gguf_layout, quantize_q8
from pyinfer.ops import cuda
from pyinfer.ops import reference as ref
from pyinfer.ops.cpu import QT, QTensor

SHIM = r"""
#include <immintrin.h>
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline float h2f(u16 h) { return _cvtsh_ss(h); }
static inline float ld_half(const u8* p) { return h2f(*(const u16*)p); }
static inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; ++k) c += (int)(signed char)(a >> 8 * k) * (int)(signed char)(b >> 8 * k);
    return c;
}
// compiled, never called on the host (warp_quantize_q8 needs a real warp)
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
static inline unsigned __shfl_xor_sync(unsigned, unsigned v, int) { return v; }
static inline unsigned __float_as_uint(float v) { unsigned u; __builtin_memcpy(&u, &v, 4); return u; }
static inline float __uint_as_float(unsigned u) { float v; __builtin_memcpy(&v, &u, 4); return v; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline int __float2int_rn(float v) { return (int)__builtin_rintf(v); }
#include <cmath>
"""
DRIVER = r"""
extern "C" {
float emu_dot(int t, int wide, const u8* row, int cols, const signed char* xq, const float* xd) {
    float s = 0.f;  // the warp's 32 lanes, summed (warp_sum's order does not matter here)
    const int* q = (const int*)xq;
    for (int lane = 0; lane < 32; ++lane) {
        if (wide)  // gather_gemv_w_*'s one-row wide dot
            s += t == 8 ? dot1x_q8_0(row, cols, nullptr, q, xd, lane) : dot1x_q4_0(row, cols, nullptr, q, xd, lane);
        else
            s += t == 8 ? dotx_q8_0(row, cols, nullptr, q, xd, lane) : dotx_q4_0(row, cols, nullptr, q, xd, lane);
    }
    return s;
}
void emu_dot2(int t, const u8* r0, const u8* r1, int cols, const signed char* xq, const float* xd,
              float* out) {  // the wide form's two dots (ffn_gate_up's WIDE kernels)
    const int* q = (const int*)xq;
    out[0] = out[1] = 0.f;
    for (int lane = 0; lane < 32; ++lane) {
        float s0, s1;
        if (t == 8) dot2x_q8_0(r0, r1, cols, nullptr, q, xd, lane, &s0, &s1);
        else dot2x_q4_0(r0, r1, cols, nullptr, q, xd, lane, &s0, &s1);
        out[0] += s0;
        out[1] += s1;
    }
}
float emu_dot_sums(const u8* row, int cols, const signed char* xq, const float* xd,
                   const int* xs) {  // gather_gemv_ws_q4_0's dot, x's block sums given
    float s = 0.f;
    const bool al = ((u64)row & 15) == 0;
    for (int lane = 0; lane < 32; ++lane)
        s += al ? dot_q4_sums<true, 4>(row, cols >> 5, (const int*)xq, xd, xs, lane)
                : dot_q4_sums<false, 4>(row, cols >> 5, (const int*)xq, xd, xs, lane);
    return s;
}
float emu_dot_f16(int wide, const u8* row, int cols, const float* x) {
    float s = 0.f;
    for (int lane = 0; lane < 32; ++lane)
        s += wide ? dot_f16_wide<2>(row, cols, x, lane) : dot_f16(row, cols, x, lane);
    return s;
}
float emu_el(int t, const u8* row, int c, int cols) {
    return t == 8 ? el_q8_0(row, c, cols) : el_q4_0(row, c, cols);
}
void emu_axpy(int t, const u8* row, int cols, float a, float* acc) {  // acc += a * row
    const int nb = cols >> 5;
    const bool al = ((u64)row & 15) == 0;
    for (int u = 0; u < nb; ++u) {
        if (t == 8) UnitQ8_0::fma(acc + 32 * u, a, al ? UnitQ8_0::load<true>(row, u, nb) : UnitQ8_0::load<false>(row, u, nb));
        else UnitQ4_0::fma(acc + 32 * u, a, al ? UnitQ4_0::load<true>(row, u, nb) : UnitQ4_0::load<false>(row, u, nb));
    }
}
}
"""


def _f16c() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " f16c" in f.read()
    except OSError:
        return False


def _build(tmp_path_factory, name: str, source: str) -> ctypes.CDLL:
    """``source`` compiled by g++ as a shared library (skips without g++ or F16C)."""
    gxx = shutil.which("g++")
    if gxx is None or not _f16c():
        pytest.skip("needs g++ and an F16C CPU")
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.cpp").write_text(source)
    r = subprocess.run([gxx, "-O1", "-mf16c", "-shared", "-fPIC", "-o", str(d / f"{name}.so"),
                        str(d / f"{name}.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(d / f"{name}.so"))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    c = cuda.COMMON_SRC
    body = c[c.index("// Partial dot of one stored row"):c.index("__device__ __forceinline__ float block_sum(")]
    body += c[c.index("// Element c of one device row"):]
    u = cuda._AXPY_UNITS
    units = u[u.index("struct UnitF32"):u.index("// Stage 1 of out")]
    so = _build(tmp_path_factory, "emu", SHIM + body + units + DRIVER)
    so.emu_dot.restype = ctypes.c_float
    so.emu_el.restype = ctypes.c_float
    so.emu_dot_f16.restype = ctypes.c_float
    so.emu_dot_sums.restype = ctypes.c_float
    return so


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q8_0])
@pytest.mark.parametrize("cols", [96, 256, 4096, 11008])
def test_device_functions_on_the_host(lib, qt, cols):
    rng = np.random.default_rng(cols)
    t = 8 if qt == QT.Q8_0 else 4
    w = QTensor.from_array(rng.normal(size=(3, cols)).astype(np.float32), qt)
    raw = np.ascontiguousarray(w.raw)
    dev = device_layout(raw, qt)
    assert dev.shape == raw.shape and not np.array_equal(dev, raw)
    np.testing.assert_array_equal(gguf_layout(dev, qt), raw)
    f = dequantize_rows(raw, qt, cols)  # gguf's dequantization
    x = rng.normal(size=cols).astype(np.float32)
    xq, xd = np.zeros(cols, np.int8), np.zeros(cols // 32, np.float32)
    quantize_q8(x, (xq, xd))  # the kernels' q8 activation (NumPy twin of cuda.quantize_q8)
    xdq = ref.quantize_act_q8(x)
    np.testing.assert_array_equal(xq.astype(np.float32) * np.repeat(xd, 32), xdq)
    xs = xq.reshape(-1, 32).astype(np.int32).sum(axis=1).astype(np.int32)  # x's block sums
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    for off in (0, 2, 4, 8):
        buf = np.zeros(dev.nbytes + 64, np.uint8)
        start = (-buf.ctypes.data) % 16 + off
        d2 = buf[start:start + dev.nbytes].reshape(dev.shape)
        d2[...] = dev
        for r in range(3):
            row = d2[r]
            want = float(f[r].astype(np.float64) @ xdq)
            for wide in (0, 1):
                got = lib.emu_dot(t, wide, ptr(row), cols, ptr(xq), ptr(xd))
                assert abs(got - want) <= 1e-5 * float(np.abs(f[r]) @ np.abs(xdq)), (off, r, wide)
            if qt == QT.Q4_0:
                got = lib.emu_dot_sums(ptr(row), cols, ptr(xq), ptr(xd), ptr(xs))
                assert abs(got - want) <= 1e-5 * float(np.abs(f[r]) @ np.abs(xdq)), (off, r)
            r2 = (r + 1) % 3  # the wide form: this row as gate, the next as up
            two = np.zeros(2, np.float32)
            lib.emu_dot2(t, ptr(row), ptr(d2[r2]), cols, ptr(xq), ptr(xd), ptr(two))
            for g, k in zip(two, (r, r2)):
                w_k = float(f[k].astype(np.float64) @ xdq)
                assert abs(g - w_k) <= 1e-5 * float(np.abs(f[k]) @ np.abs(xdq)), (off, k, g, w_k)
            el = np.array([lib.emu_el(t, ptr(row), c, cols) for c in range(0, cols, 7)], np.float32)
            np.testing.assert_array_equal(el, f[r, ::7])
            acc = np.zeros(cols, np.float32)
            lib.emu_axpy(t, ptr(row), cols, ctypes.c_float(0.7), ptr(acc))
            np.testing.assert_allclose(acc, np.float32(0.7) * f[r], rtol=1e-6, atol=1e-7)


IB_SHIM = r"""
#include <algorithm>
using std::min;
struct dim3 { unsigned int x, y, z; };
static dim3 blockIdx, blockDim, threadIdx;
#define __global__
static inline int __ffs(unsigned int v) { return __builtin_ffs((int)v); }
"""
IB_DRIVER = r"""
extern "C" {
// every thread of the grid (words / 256 blocks x n_chunks), one after another
void emu_ib(int t, const u8* w, int n_blocks, int n_out, const signed char* xq, const float* xd,
            const unsigned int* kmask, int bpc, int n_chunks, float* partial) {
    const int words = n_out / (t == 8 ? 4 : 8);
    blockDim.x = 256;
    for (unsigned y = 0; y < (unsigned)n_chunks; ++y)
        for (unsigned bx = 0; bx * 256 < (unsigned)words; ++bx)
            for (unsigned tx = 0; tx < 256; ++tx) {
                blockIdx.x = bx; blockIdx.y = y; threadIdx.x = tx;
                if (t == 8) ib_gemv_q8_0(w, n_blocks, n_out, xq, xd, kmask, bpc, partial);
                else if (t == 4) ib_gemv_q4_0(w, n_blocks, n_out, xq, xd, kmask, bpc, partial);
                else if (t == 5) ib_gemv_q4_1(w, n_blocks, n_out, xq, xd, kmask, bpc, partial);
                else if (t == 6) ib_gemv_q5_0(w, n_blocks, n_out, xq, xd, kmask, bpc, partial);
                else ib_gemv_q5_1(w, n_blocks, n_out, xq, xd, kmask, bpc, partial);
            }
}
void emu_ib_deq(int t, const u8* w, int n_out, int j0, int n_rows, float* out) {
    blockDim.x = 256;
    for (long long i = 0; i < (long long)n_rows * n_out; ++i) {
        blockIdx.x = (unsigned)(i / 256); threadIdx.x = (unsigned)(i % 256);
        ib_dequant_t(w, t, n_out, j0, n_rows, out);
    }
}
}
"""


@pytest.fixture(scope="module")
def ib_lib(tmp_path_factory):
    s = cuda.INPUT_SRC
    body = s[s.index("// A projection W (n_out, n_in)"):]
    return _build(tmp_path_factory, "ib", SHIM + IB_SHIM + body + IB_DRIVER)


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1])
@pytest.mark.parametrize("n_out,n_in,n_chunks", [(128, 96, 1), (192, 256, 3), (1024, 4096, 16)])
def test_input_block_gemv_on_the_host(ib_lib, qt, n_out, n_in, n_chunks):
    """cuda.ib_gemv's kernel (sparse mode input's GEMV over the kept channels) over
    device.device_ib_layout, run as host C++: the partial sums of its chunks add up to gguf's
    dequantized W times the masked activation's q8 form (kept bits: random, one block all dropped,
    one all kept), and ib_dequant_t gives W^T, the NumPy twin's numbers, exactly."""
    from pyinfer.device import NumpyDevice, device_ib_layout
    from pyinfer.ops.cpu import IBTensor

    rng = np.random.default_rng(n_out + n_in)
    w = QTensor.from_array(rng.normal(size=(n_out, n_in)).astype(np.float32), qt)
    ib = IBTensor.from_rows(w)
    dev = device_ib_layout(ib)
    assert dev.nbytes == ib.raw.nbytes and dev.shape[0] == n_in // 32
    f = dequantize_rows(np.ascontiguousarray(w.raw), qt, n_in)  # (n_out, n_in), gguf's
    keep = rng.random(n_in) < 0.55
    keep[:32] = False
    keep[32:64] = n_in > 32
    x = np.where(keep, rng.normal(size=n_in), 0.0).astype(np.float32)
    xq, xd = np.zeros(n_in, np.int8), np.zeros(n_in // 32, np.float32)
    quantize_q8(x, (xq, xd))
    bits = keep.reshape(-1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    kmask = bits.sum(axis=1).astype(np.uint32)
    t = {QT.Q8_0: 8, QT.Q4_0: 4, QT.Q4_1: 5, QT.Q5_0: 6, QT.Q5_1: 7}[qt]
    assert t == cuda.IB_KERNELS[ib.qtype][2]
    nb = n_in // 32
    bpc = -(-nb // n_chunks)
    n_chunks = -(-nb // bpc)
    partial = np.full(n_chunks * n_out, np.nan, np.float32)
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    ib_lib.emu_ib(t, ptr(dev), nb, n_out, ptr(xq), ptr(xd), ptr(kmask), bpc, n_chunks,
                  ptr(partial))
    got = partial.reshape(n_chunks, n_out).sum(axis=0)
    xdq = ref.quantize_act_q8(x)
    want = f.astype(np.float64) @ xdq
    bound = 1e-5 * (np.abs(f) @ np.abs(xdq)) + 1e-30
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
    twin = NumpyDevice().ib_rows(ib)
    out = np.zeros(n_out, np.float32)
    NumpyDevice().ib_gemv(twin, x, out)
    assert np.all(np.abs(out - want) <= bound)
    deq = np.full(3 * n_out, np.nan, np.float32)
    ib_lib.emu_ib_deq(t, ptr(dev), n_out, 33, 3, ptr(deq))
    np.testing.assert_array_equal(deq.reshape(3, n_out), twin.f32[33:36])
    np.testing.assert_array_equal(twin.f32, f.T)


@pytest.mark.parametrize("cols", [96, 264, 512, 600, 1032])
def test_wide_f16_dot_is_the_gemv_dot(lib, cols):
    """The predictor's fc2 row in the wide kernels (``dot_f16_wide``: every load of up to 64
    16-byte units in flight first, more in rounds) sums each lane's units in the order
    ``dot_f16`` does up to 96 units (rank 768): the same float, so the wide hot-neuron kernel
    and ``predictor_fc2`` pick the same candidates; past that, the same dot within rounding."""
    rng = np.random.default_rng(cols)
    row = rng.normal(size=cols).astype(np.float16)
    x = rng.normal(size=cols).astype(np.float32)
    buf = np.zeros(row.nbytes + 32, np.uint8)
    start = (-buf.ctypes.data) % 16
    r = buf[start:start + row.nbytes]
    r[...] = row.view(np.uint8)
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    wide, old = (lib.emu_dot_f16(w, ptr(r), cols, ptr(x)) for w in (1, 0))
    want = float(row.astype(np.float64) @ x)
    assert abs(wide - want) <= 1e-5 * float(np.abs(row.astype(np.float64)) @ np.abs(x))
    if cols // 8 <= 96:
        assert wide == old
