"""pyinfer.quants (NumPy K-quant quantizers after ggml's reference) against gguf's decoder.

Round trips go through ``gguf.quants.dequantize`` (code nobody here wrote). The error bounds
compare each K-quant with gguf's own quantizer of the legacy type at the same bits per value
(Q4_1 ~ Q4_K, Q5_1 ~ Q5_K): a K-quant, with its searched scales, must not do worse on the same
data. Q6_K is bounded against gguf's Q8_0 and Q5_1 (between them).
"""
import gguf
import numpy as np
import pytest

from pyinfer import quants

QT = gguf.GGMLQuantizationType


def _data(rng, rows, cols):
    """Gaussian rows at scales over six decades, with an outlier and an all-zero row."""
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    a *= np.float32(10.0) ** rng.uniform(-4, 2, (rows, 1)).astype(np.float32)
    a[1, 7] *= 30  # an outlier inside one super-block
    a[2] = 0.0
    a[3, :256] = np.abs(a[3, :256])  # a one-signed super-block (the min term matters)
    return a


def _rel_rms(q, a):
    """RMS error relative to each row's RMS, averaged over rows that are not all zero."""
    err = np.sqrt(np.mean((q - a) ** 2, axis=1))
    scale = np.sqrt(np.mean(a ** 2, axis=1))
    keep = scale > 0
    return float(np.mean(err[keep] / scale[keep]))


def _roundtrip(a, qtype):
    blocks = quants.quantize(a, qtype)
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1] * a.shape[1] // gguf.GGML_QUANT_SIZES[qtype][0]
    assert blocks.dtype == np.uint8 and blocks.shape == (a.shape[0], nbytes)
    return gguf.quants.dequantize(blocks, qtype).reshape(a.shape)


@pytest.mark.parametrize("qtype,legacy,bound", [(QT.Q4_K, QT.Q4_1, 0.09), (QT.Q5_K, QT.Q5_1, 0.045),
                                                (QT.Q6_K, QT.Q5_1, 0.03)])
def test_round_trip_error(qtype, legacy, bound):
    rng = np.random.default_rng(int(qtype))
    a = _data(rng, 24, 768)
    got = _roundtrip(a, qtype)
    assert np.all(got[2] == 0)  # an all-zero super-block decodes to zeros
    err = _rel_rms(got, a)
    want = _rel_rms(gguf.quants.dequantize(gguf.quants.quantize(a, legacy), legacy), a)
    assert err <= want * (1.0 if qtype != QT.Q6_K else 0.7), (err, want)  # Q6_K: 0.61 measured
    assert err < bound  # measured on this data: Q4_K 0.07, Q5_K 0.036, Q6_K 0.023
    # no value moves by more than its block's spread (a wrong scale or packing would)
    blockwise = np.abs(a).reshape(24, -1, 32).max(axis=2, keepdims=True)
    assert np.all(np.abs(got - a).reshape(24, -1, 32) <= blockwise * 0.6 + 1e-30)
    if qtype == QT.Q6_K:
        q8 = gguf.quants.dequantize(gguf.quants.quantize(a, QT.Q8_0), QT.Q8_0)
        assert err > _rel_rms(q8, a)  # six bits stay coarser than eight


def test_constant_and_one_signed_blocks():
    """A super-block whose values are all equal and positive (min 0 after clamping, one scale)."""
    a = np.full((2, 256), 0.5, np.float32)
    a[1] = np.linspace(1.0, 2.0, 256, dtype=np.float32)
    for qtype in quants.K_QUANTS:
        got = _roundtrip(a, qtype)
        assert np.abs(got - a).max() < 0.1 * np.abs(a).max(), qtype


@pytest.mark.parametrize("qtype", quants.K_QUANTS)
def test_rejects_rows_not_multiple_of_256(qtype):
    with pytest.raises(ValueError, match="multiple of 256"):
        quants.quantize(np.ones((2, 288), np.float32), qtype)


def test_other_types_go_to_gguf():
    a = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for qtype in (QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        np.testing.assert_array_equal(quants.quantize(a, qtype), gguf.quants.quantize(a, qtype))
