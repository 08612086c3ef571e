"""The eight-row decode GEMV of the 32-block types (cython/gemv.h: q8_0, q4_0, Q4_1, Q5_0, Q5_1).

References nobody here wrote: ``gguf.quants.dequantize`` for the weights, float64 NumPy for the
sums (the activation quantized by the NumPy twin ``reference.quantize_act_q8``). gemv.h states
its numerics: exact integer block sums, then s = fma(dw dx, I, s) and c = fma(off, xs, c) in
block order, dot = s + c/8. So every result lies within (nb + 4) 2^-23 sum (|w| + 2|off|) |x|
of the float64 sum (off: the block offset; a recursive f32 sum of nb terms with a few roundings each; Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., section 4.2), and each row's bits cannot depend on the rows it
shares a pass with, on the thread count, on gathering, or on prefill vs decode.
"""
import gguf
import numpy as np
import pytest

from pyinfer.ops import cpu
from pyinfer.ops import reference as ref

QT = gguf.GGMLQuantizationType
TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)


def _nan(shape):
    return np.full(shape, np.nan, np.float32)


def _ro(a):
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _weight(rng, qtype, rows, cols):
    a = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1))
    data = gguf.quants.quantize(a, qtype).view(np.uint8).reshape(rows, -1)
    return cpu.QTensor(_ro(data), qtype, rows, cols)


def _offsets(w):
    """(rows, cols) float64: each value's block offset off_b (ggml-common.h layouts: q4_0 -8 d,
    Q5_0 -16 d, Q4_1/Q5_1 the f16 min m after d; q8_0 none)."""
    blocks = w.raw.reshape(w.rows, w.cols // 32, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if w.qtype in (QT.Q4_1, QT.Q5_1):
        off = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    else:
        off = {QT.Q8_0: 0.0, QT.Q4_0: -8.0, QT.Q5_0: -16.0}[w.qtype] * d
    return np.repeat(off, 32, axis=1)


def _bound_check(got, w, x):
    """|got - exact| <= (nb + 4) 2^-23 sum (|w| + 2 |off|) |x|, exact in float64 over gguf's
    dequantization: the value part d u and the offset part are summed in two f32 chains, each
    rounding relative to its own size, and |d u| + |off| <= |w| + 2 |off|."""
    wd = gguf.quants.dequantize(w.raw, w.qtype).reshape(w.rows, w.cols).astype(np.float64)
    xq = ref.quantize_act_q8(x[None, :])[0].astype(np.float64)
    exact, scale = wd @ xq, (np.abs(wd) + 2 * np.abs(_offsets(w))) @ np.abs(xq)
    assert np.all(np.isfinite(got)), "kernel left NaN in its output"
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= (w.cols // 32 + 4) * 2.0 ** -23 * scale + 1e-30), float((err / scale).max())


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_against_gguf(qtype, n_threads):
    """Row counts around the 8-row group (tails repeat the last row), one block to 48 blocks."""
    rng = np.random.default_rng(int(qtype) + 7 * n_threads)
    for rows, cols in [(1, 32), (7, 64), (8, 96), (9, 576), (17, 32), (203, 576), (24, 1536)]:
        w = _weight(rng, qtype, rows, cols)
        x = _ro(rng.standard_normal(cols).astype(np.float32))
        _bound_check(cpu.matvec(w, x, _nan(rows), n_threads), w, x)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_extreme_codes(qtype):
    """Every value at its largest magnitude (4-bit 15, 5-bit 31, q8_0 -128 and 127) against
    activations at +-127 after quantization: the 16-bit partial sums must not saturate."""
    rng = np.random.default_rng(3)
    rows, cols = 19, 128
    w = _weight(rng, qtype, rows, cols)
    raw = w.raw.copy().reshape(rows, cols // 32, -1)
    if qtype == QT.Q8_0:
        raw[:, :, 2:] = rng.choice(np.array([-128, 127], np.int8), raw[:, :, 2:].shape).view(np.uint8)
    else:
        qs = {QT.Q4_0: 2, QT.Q4_1: 4, QT.Q5_0: 6, QT.Q5_1: 8}[qtype]
        raw[:, :, qs:] = 0xFF  # every nibble 15
        if qtype in (QT.Q5_0, QT.Q5_1):
            raw[:, :, qs - 4:qs] = 0xFF  # every fifth bit set: 31
        raw[rows // 2:, :, qs:] = 0  # and some rows at the other end (0; Q5: 16 with the bit)
    w = cpu.QTensor(_ro(raw.reshape(rows, -1)), qtype, rows, cols)
    for x in (np.ones(cols), -np.ones(cols), np.where(rng.random(cols) < 0.5, -1.0, 1.0)):
        x = _ro(x.astype(np.float32))  # every activation +-127 after quantization
        _bound_check(cpu.matvec(w, x, _nan(rows), 1), w, x)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_rows_are_independent(qtype):
    """A row's bits do not depend on its group, the thread count, gathering or prefill."""
    rng = np.random.default_rng(11 + int(qtype))
    rows, cols = 45, 160
    w = _weight(rng, qtype, rows, cols)
    x = _ro(rng.standard_normal((5, cols)).astype(np.float32))
    full = cpu.matvec(w, x[0], _nan(rows), 1)
    np.testing.assert_array_equal(full, cpu.matvec(w, x[0], _nan(rows), 2))
    for r0, r1 in [(3, 4), (5, 18), (40, 45)]:  # other groupings of the same rows
        sub = cpu.QTensor(_ro(w.raw[r0:r1]), qtype, r1 - r0, cols)
        np.testing.assert_array_equal(cpu.matvec(sub, x[0], _nan(r1 - r0), 1), full[r0:r1])
    idx = _ro(rng.integers(0, rows, 2 * rows + 3).astype(np.int32))  # repeats, any order
    for nt in (1, 2):
        np.testing.assert_array_equal(cpu.gather_matvec(w, x[0], idx, _nan(idx.size), nt), full[idx])
    pre = cpu.matmul(w, x, _nan((5, rows)), 2)  # prefill (GEMM or four-token path)
    dec = np.stack([cpu.matvec(w, x[t], _nan(rows), 1) for t in range(5)])
    np.testing.assert_array_equal(pre, dec)
