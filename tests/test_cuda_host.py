"""The CUDA kernels' per-block arithmetic, checked on the host: the device functions of
``pyinfer.ops.cuda`` that read quantized rows in the device layout (``dot_q8_0``/``dot_q4_0``,
the AXPY units, ``el_*``) compiled as plain C++ with g++ (a warp emulated by a loop over its 32
lanes), against ``gguf``'s dequantization of the same rows. CI has no GPU; this is what catches
an indexing slip in the split layout (``pyinfer.device.device_layout``) there. Rows at 16-, 8-,
4- and 2-byte offsets take both the aligned and the 16-bit-load paths. Skipped without g++ or
F16C (the shim converts halves with it)."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from pyinfer.device import dequantize_rows, device_layout, gguf_layout
from pyinfer.ops import cuda
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
"""
DRIVER = r"""
extern "C" {
float emu_dot(int t, const u8* row, int cols, const float* x) {
    float s = 0.f;  // the warp's 32 lanes, summed (warp_sum's order does not matter here)
    for (int lane = 0; lane < 32; ++lane)
        s += t == 8 ? dot_q8_0(row, cols, x, lane) : dot_q4_0(row, cols, x, lane);
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


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None or not _f16c():
        pytest.skip("needs g++ and an F16C CPU")
    c = cuda.COMMON_SRC
    body = c[c.index("__device__ __forceinline__ unsigned int ld_w32"):c.index("__device__ __forceinline__ float block_sum(")]
    body += c[c.index("// Element c of one device row"):]
    u = cuda._AXPY_UNITS
    units = u[u.index("struct UnitF32"):u.index("// Stage 1 of out")]
    d = tmp_path_factory.mktemp("cudahost")
    (d / "emu.cpp").write_text(SHIM + body + units + DRIVER)
    r = subprocess.run([gxx, "-O1", "-mf16c", "-shared", "-fPIC", "-o", str(d / "emu.so"),
                        str(d / "emu.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    so = ctypes.CDLL(str(d / "emu.so"))
    so.emu_dot.restype = ctypes.c_float
    so.emu_el.restype = ctypes.c_float
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
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    for off in (0, 2, 4, 8):
        buf = np.zeros(dev.nbytes + 64, np.uint8)
        start = (-buf.ctypes.data) % 16 + off
        d2 = buf[start:start + dev.nbytes].reshape(dev.shape)
        d2[...] = dev
        for r in range(3):
            row = d2[r]
            got = lib.emu_dot(t, ptr(row), cols, ptr(x))
            want = float(f[r].astype(np.float64) @ x)
            assert abs(got - want) <= 1e-5 * float(np.abs(f[r]) @ np.abs(x)), (off, r, got, want)
            el = np.array([lib.emu_el(t, ptr(row), c, cols) for c in range(0, cols, 7)], np.float32)
            np.testing.assert_array_equal(el, f[r, ::7])
            acc = np.zeros(cols, np.float32)
            lib.emu_axpy(t, ptr(row), cols, ctypes.c_float(0.7), ptr(acc))
            np.testing.assert_allclose(acc, np.float32(0.7) * f[r], rtol=1e-6, atol=1e-7)
