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


IMPLS = ("c", "numpy")


def _quantize(a, qtype, impl="c"):
    if impl == "numpy":
        return quants.quantize_numpy(a, qtype)
    if quants._kq is None:
        pytest.skip("pyinfer.ops._quantize is not built")
    return quants.quantize(a, qtype)


def _roundtrip(a, qtype, impl="c"):
    blocks = _quantize(a, qtype, impl)
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1] * a.shape[1] // gguf.GGML_QUANT_SIZES[qtype][0]
    assert blocks.dtype == np.uint8 and blocks.shape == (a.shape[0], nbytes)
    return gguf.quants.dequantize(blocks, qtype).reshape(a.shape)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype,legacy,bound", [(QT.Q4_K, QT.Q4_1, 0.09), (QT.Q5_K, QT.Q5_1, 0.045),
                                                (QT.Q6_K, QT.Q5_1, 0.03)])
def test_round_trip_error(qtype, legacy, bound, impl):
    rng = np.random.default_rng(int(qtype))
    a = _data(rng, 24, 768)
    got = _roundtrip(a, qtype, impl)
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


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_and_one_signed_blocks(impl):
    """A super-block whose values are all equal and positive (min 0 after clamping, one scale)."""
    a = np.full((2, 256), 0.5, np.float32)
    a[1] = np.linspace(1.0, 2.0, 256, dtype=np.float32)
    for qtype in quants.K_QUANTS:
        got = _roundtrip(a, qtype, impl)
        assert np.abs(got - a).max() < 0.1 * np.abs(a).max(), qtype


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype", quants.K_QUANTS)
def test_rejects_rows_not_multiple_of_256(qtype, impl):
    with pytest.raises(ValueError, match="multiple of 256"):
        _quantize(np.ones((2, 288), np.float32), qtype, impl)


@pytest.mark.parametrize("qtype", quants.K_QUANTS)
def test_c_quantizer_against_numpy_twin(qtype):
    """The C search (cython/kquant.h) and the NumPy one run the same algorithm with their f32
    sums in other orders: nearly every super-block is byte-identical, the rest are other near-tie
    choices whose total error is within 0.1%; the bytes do not depend on the thread count."""
    if quants._kq is None:
        pytest.skip("pyinfer.ops._quantize is not built")
    rng = np.random.default_rng(7 + int(qtype))
    a = _data(rng, 64, 1024)
    c = [quants.quantize(a, qtype, n_threads=t) for t in (1, 2, 3)]
    assert c[0].tobytes() == c[1].tobytes() == c[2].tobytes()
    n = quants.quantize_numpy(a, qtype)
    bb = c[0].shape[1] // 4  # bytes per super-block
    same = (c[0].reshape(-1, bb) == n.reshape(-1, bb)).all(axis=1).mean()
    assert same >= 0.95, same  # measured 0.97-0.996 on larger data
    err = [np.sum((gguf.quants.dequantize(q, qtype).reshape(a.shape) - a) ** 2) for q in (c[0], n)]
    assert err[0] <= err[1] * 1.001 and err[1] <= err[0] * 1.001, err


def test_f16_rounding_of_the_c_quantizer():
    """Super-block scales go to f16 as NumPy's astype(float16) does (nearest, ties to even),
    subnormals and overflow included."""
    if quants._kq is None:
        pytest.skip("pyinfer.ops._quantize is not built")
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 5, 20000)).astype(np.float32)
    ties = (np.arange(1, 2000, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    v = np.concatenate([v, ties, np.float32([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, 6.1e-5])])
    got = np.array([quants._kq.f32_to_f16_bits(float(x)) for x in v], np.uint16)
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_other_types_go_to_gguf():
    a = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for qtype in (QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        np.testing.assert_array_equal(quants.quantize(a, qtype), gguf.quants.quantize(a, qtype))


# ---- importance-weighted q4_0 / q5_0 scales (quants.quantize_weighted) against gguf's own
# round-to-nearest quantizer and decoder

def _inputs(rng, n_tok, scale):
    """Calibration-like inputs (n_tok, cols) with per-channel scales ``scale``: spread over
    decades, as a transformer's projection inputs are (a few channels carry most energy)."""
    return (rng.standard_normal((n_tok, scale.shape[0])) * scale).astype(np.float32)


def _weighted(a, qtype, im, impl):
    """quants.quantize_weighted through the C search or its NumPy twin."""
    if impl == "c":
        if quants._kq is None:
            pytest.skip("pyinfer.ops._quantize is not built")
        return quants.quantize_weighted(a, qtype, im)
    w = (im / im.mean() + 1e-3).astype(np.float32)
    return quants.quantize_weighted_numpy(a, qtype, w, gguf.quants.quantize(a, qtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0])
def test_weighted_scales_beat_round_to_nearest(qtype, impl):
    """Valid blocks of the type (gguf decodes them), no block with a larger importance-weighted
    error than gguf's round-to-nearest block, and on held-out inputs of the calibration's
    distribution a clearly smaller output error, E[(x . (W_q - W))^2], than gguf's
    quantization of the same W."""
    rng = np.random.default_rng(int(qtype))
    a = _data(rng, 24, 768)
    scale = np.exp(1.2 * rng.standard_normal(768))
    im = (_inputs(rng, 2048, scale).astype(np.float64) ** 2).mean(0)
    blocks = _weighted(a, qtype, im, impl)
    ref = gguf.quants.quantize(a, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == ref.shape
    got = gguf.quants.dequantize(blocks, qtype).reshape(a.shape)
    want = gguf.quants.dequantize(ref, qtype).reshape(a.shape)
    assert np.all(got[2] == 0)  # an all-zero row stays zeros
    w = im / im.mean() + 1e-3
    blk_err = lambda q: (w * (q - a) ** 2).reshape(a.shape[0], -1, 32).sum(-1)  # noqa: E731
    assert np.all(blk_err(got) <= blk_err(want) * (1 + 1e-5) + 1e-30)
    held = _inputs(np.random.default_rng(7), 1024, scale)
    rows = [r for r in range(a.shape[0]) if r != 2]
    ratio = np.array([((held @ (got[r] - a[r])) ** 2).mean() / ((held @ (want[r] - a[r])) ** 2).mean()
                      for r in rows])
    assert ratio.mean() < 0.8 and ratio.max() < 1.05, ratio


@pytest.mark.parametrize("impl", IMPLS)
def test_weighted_scales_uniform_importance(impl):
    """A flat imatrix weighs every channel alike: the search still never loses to
    round-to-nearest on the plain squared error of any block."""
    rng = np.random.default_rng(3)
    a = _data(rng, 8, 256)
    got = gguf.quants.dequantize(_weighted(a, QT.Q4_0, np.ones(256), impl), QT.Q4_0)
    want = gguf.quants.dequantize(gguf.quants.quantize(a, QT.Q4_0), QT.Q4_0)
    e = lambda q: ((q.reshape(a.shape) - a) ** 2).reshape(8, -1, 32).sum(-1)  # noqa: E731
    assert np.all(e(got) <= e(want) * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("args,match", [
    ((np.zeros((2, 64), np.float32), QT.Q8_0, np.ones(64)), "not one of"),
    ((np.zeros((2, 48), np.float32), QT.Q4_0, np.ones(48)), "multiple of 32"),
    ((np.zeros((2, 64), np.float32), QT.Q4_0, np.ones(32)), "32 values for a row of 64"),
    ((np.zeros((2, 64), np.float32), QT.Q4_0, -np.ones(64)), "finite and >= 0"),
])
def test_weighted_scales_errors(args, match):
    with pytest.raises(ValueError, match=match):
        quants.quantize_weighted(*args)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0])
def test_weighted_scales_c_matches_numpy(qtype):
    """The C search and its NumPy twin pick the same blocks (but where two candidates tie to
    float rounding), at any thread count."""
    if quants._kq is None:
        pytest.skip("pyinfer.ops._quantize is not built")
    rng = np.random.default_rng(11)
    a = _data(rng, 64, 512)
    im = (_inputs(rng, 512, np.exp(rng.standard_normal(512))).astype(np.float64) ** 2).mean(0)
    c = [quants.quantize_weighted(a, qtype, im, n_threads=t) for t in (1, 3)]
    np.testing.assert_array_equal(c[0], c[1])
    n = _weighted(a, qtype, im, "numpy")
    nb = gguf.GGML_QUANT_SIZES[qtype][1]
    same = (c[0].reshape(-1, nb) == n.reshape(-1, nb)).all(1)
    assert same.mean() >= 0.995, same.mean()
