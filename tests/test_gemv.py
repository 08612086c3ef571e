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

from pyinfer.ops import _kernels as K
from pyinfer.ops import cpu
from pyinfer.ops import reference as ref
from tests._kernel_arrays import nan as _nan, quantized_weight as _weight, readonly as _ro

QT = gguf.GGMLQuantizationType
TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)


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


# ---------------------------------------------------------------- K-quants (Q4_K, Q5_K, Q6_K)
# gemv.h's eight-row K-quant GEMV takes the prefill GEMM's order (gemm.h pi_tile8_x): per 32-value
# group, s = fma(a dx, I, s) then s = fma(off / 8, xs, s) (Q6_K: one fma per 16-value half). So
# its results lie within (2 nb + 8) 2^-23 sum (|a v| + |off|) |x| of the float64 sum over
# gguf's dequantization (2 nb terms, Higham section 4.2; off = -dmin m, read by dequantizing the
# blocks with their quants zeroed), and equal prefill's bit for bit.

K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# super-block bytes and the byte range of its quants (zeroed to read the offsets); Q6_K has none
K_LAYOUT = {QT.Q4_K: (144, 16, 144), QT.Q5_K: (176, 16, 176), QT.Q6_K: (210, 0, 0)}


def _kweight(rng, qtype, rows, cols):
    """gguf quantizes no K-quant: the project's quantizer (ggml's reference algorithm)."""
    a = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1))
    return cpu.QTensor.from_array(a, qtype)


def _kbound_check(got, w, xs):
    """got (n_tok, rows) against the float64 sums of the tokens xs (n_tok, cols)."""
    wd = gguf.quants.dequantize(w.raw, w.qtype).reshape(w.rows, w.cols).astype(np.float64)
    off = np.zeros_like(wd)
    bb, q0, q1 = K_LAYOUT[w.qtype]
    if q1:
        blocks = np.array(w.raw).reshape(w.rows, -1, bb)
        blocks[:, :, q0:q1] = 0
        off = gguf.quants.dequantize(blocks.reshape(w.rows, -1), w.qtype).reshape(
            w.rows, w.cols).astype(np.float64)
    xq = ref.quantize_act_q8(xs).astype(np.float64)
    exact, scale = xq @ wd.T, np.abs(xq) @ (np.abs(wd - off) + np.abs(off)).T
    assert np.all(np.isfinite(got)), "kernel left NaN in its output"
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= (2 * (w.cols // 32) + 8) * 2.0 ** -23 * scale + 1e-30), \
        float((err / scale).max())


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("qtype", K_QUANTS)
def test_gemv_k_against_gguf(qtype, n_threads):
    """Row counts around the 8-row group (tails repeat the last row), 1 to 8 super-blocks."""
    rng = np.random.default_rng(int(qtype) + 5 * n_threads)
    for rows, cols in [(1, 256), (7, 512), (8, 256), (9, 1536), (17, 768), (203, 512), (24, 2048)]:
        w = _kweight(rng, qtype, rows, cols)
        x = _ro(rng.standard_normal(cols).astype(np.float32))
        _kbound_check(cpu.matvec(w, x, _nan(rows), n_threads)[None], w, x[None])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_gemv_k_extreme_codes(qtype):
    """Every value at an end of its range (Q4_K 0/15, Q5_K 0/31, Q6_K v = -32/31 with every
    sub-block scale at -128/127) and the six-bit scales and mins at 63, against activations at
    +-127 after quantization: no 16-bit partial sum may saturate."""
    rng = np.random.default_rng(4)
    rows, cols = 19, 512
    w = _kweight(rng, qtype, rows, cols)
    bb = K_LAYOUT[qtype][0]
    raw = w.raw.copy().reshape(rows, cols // 256, bb)
    hi = rng.random((rows, cols // 256, 1)) < 0.5  # per super-block: all high or all low codes
    if qtype == QT.Q6_K:
        raw[:, :, :192] = np.where(hi, 0xFF, 0)  # q = 63 or 0: v = 31 or -32
        raw[:, :, 192:208] = rng.choice(np.array([0x80, 0x7F], np.uint8), (rows, cols // 256, 16))
    else:
        raw[:, :, 4:16] = 0xFF  # six-bit scales and mins 63
        raw[:, :, 16:] = np.where(hi, 0xFF, 0)  # nibbles (and Q5_K's fifth bits) all set or clear
    w = cpu.QTensor(_ro(raw.reshape(rows, -1)), qtype, rows, cols)
    for x in (np.ones(cols), -np.ones(cols), np.where(rng.random(cols) < 0.5, -1.0, 1.0)):
        x = _ro(x.astype(np.float32))
        for nt in (1, 2):
            _kbound_check(cpu.matvec(w, x, _nan(rows), nt)[None], w, x[None])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_gemv_k_rows_are_independent(qtype):
    """A row's bits do not depend on its group, the thread count or gathering, and decode equals
    prefill: the tiled GEMM and the per-token path of set_old_prefill (the one-row K-quant dot,
    pi_dot_row), so every path that dots a K-quant row gives the same bits."""
    rng = np.random.default_rng(13 + int(qtype))
    rows, cols, n_tok = 45, 768, 6
    w = _kweight(rng, qtype, rows, cols)
    x = _ro(rng.standard_normal((n_tok, cols)).astype(np.float32))
    full = cpu.matvec(w, x[0], _nan(rows), 1)
    np.testing.assert_array_equal(full, cpu.matvec(w, x[0], _nan(rows), 2))
    for r0, r1 in [(3, 4), (5, 18), (40, 45)]:
        sub = cpu.QTensor(_ro(w.raw[r0:r1]), qtype, r1 - r0, cols)
        np.testing.assert_array_equal(cpu.matvec(sub, x[0], _nan(r1 - r0), 1), full[r0:r1])
    idx = _ro(rng.integers(0, rows, 2 * rows + 3).astype(np.int32))
    for nt in (1, 2):
        np.testing.assert_array_equal(cpu.gather_matvec(w, x[0], idx, _nan(idx.size), nt), full[idx])
    dec = np.stack([cpu.matvec(w, x[t], _nan(rows), 1) for t in range(n_tok)])
    _kbound_check(dec, w, x)
    np.testing.assert_array_equal(cpu.matmul(w, x, _nan((n_tok, rows)), 2), dec)
    prev = K.set_old_prefill(1)
    try:  # four-token passes, then one token: pi_dot4_x and pi_dot_row
        np.testing.assert_array_equal(cpu.matmul(w, x, _nan((n_tok, rows)), 2), dec)
    finally:
        K.set_old_prefill(prev)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_gemv_k_rows_must_hold_whole_super_blocks(qtype):
    """No kernel path takes a K-quant row that is not a multiple of 256 values (the converter
    falls back to Q5_0/Q5_1/Q8_0 for those, as llama.cpp does): both the tensor and the kernel
    refuse one."""
    rng = np.random.default_rng(2)
    w = _kweight(rng, qtype, 8, 512)
    with pytest.raises(ValueError):
        cpu.QTensor(_ro(w.raw[:, : w.raw.shape[1] // 2 + 1]), qtype, 8, 288)
    with pytest.raises(ValueError):  # 288 columns: 1.125 super-blocks
        K.matvec(w.raw, int(qtype), 288, np.zeros(288, np.float32), _nan(8), 1)
