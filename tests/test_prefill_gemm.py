"""The prefill kernels of issue 11 (cython/gemm.h): the tiled int8 GEMM behind ``cpu.matmul`` for
every quantized type (q8_0, q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), the down-projection GEMM
behind ``cpu.matmul_t`` and the batched causal attention.

References nobody here wrote: ``gguf.quants.dequantize`` for the weights, float64 NumPy for the
sums. Stated tolerance of the GEMM: the block products d_w * d_x * sum(q_w q_x) are the same in
prefill and decode, only the f32 order of their sum differs, so both lie within
(nb + 4) * 2^-23 * sum_k |w_k x_k| of the float64 sum (nb = 32-blocks per row; the usual bound
on a recursive f32 sum of nb terms with a few roundings per term, Higham, Accuracy and Stability
of Numerical Algorithms, 2nd ed., section 4.2). Types with an offset per block (value = a v + off:
q4_0's -8 d, Q5_0's -16 d, Q4_1/Q5_1's m, the K-quants' -dmin m) add 2 nb terms, a v x and off x
(the offset through the activation's block sum, as the decode dots and llama.cpp take it), so
their bound is (2 nb + 8) * 2^-23 * sum_k (|a v_k| + |off_k|) |x_k|, off read by dequantizing the
blocks with their quants zeroed. Shapes cover token counts that are not multiples of the 4-token
tile and row counts that are not multiples of the 8-row tile.
"""
import gguf
import numpy as np
import pytest

from pyinfer.ops import _kernels as K
from pyinfer.ops import cpu
from pyinfer.ops import reference as ref
from tests._gemmt_bound import GEMMT_TYPES, gemmt_bound
from tests._kernel_arrays import nan as _nan, quantized_weight as _weight, readonly as _ro

QT = gguf.GGMLQuantizationType
GEMM_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# per type: (block bytes, byte range of the quants within a block) for the offset of each block;
# q8_0 and Q6_K (signed values) have none
OFFSET_QUANTS = {QT.Q4_0: (18, 2, 18), QT.Q4_1: (20, 4, 20), QT.Q5_0: (22, 2, 22),
                 QT.Q5_1: (24, 4, 24), QT.Q4_K: (144, 16, 144), QT.Q5_K: (176, 16, 176)}


def _deq(w):
    return gguf.quants.dequantize(w.raw, w.qtype).reshape(w.rows, w.cols).astype(np.float64)


def _offsets(w):
    """(rows, cols) float64: each value's block offset off (value = a v + off), from gguf's
    dequantization of the blocks with their quant bytes zeroed (v = 0); zeros for q8_0/Q6_K."""
    if w.qtype not in OFFSET_QUANTS:
        return np.zeros((w.rows, w.cols))
    bb, q0, q1 = OFFSET_QUANTS[w.qtype]
    blocks = np.array(w.raw).reshape(w.rows, -1, bb)
    blocks[:, :, q0:q1] = 0
    return gguf.quants.dequantize(blocks.reshape(w.rows, -1), w.qtype).reshape(
        w.rows, w.cols).astype(np.float64)


def _bound_check(got, wd, xq, nb, off=None):
    """|got - exact| <= (nb + 4) 2^-23 sum |w x| elementwise (exact in float64); with block
    offsets off: (2 nb + 8) 2^-23 sum (|w - off| + |off|) |x| (module docstring)."""
    exact = xq.astype(np.float64) @ wd.T
    if off is None or not off.any():
        scale, k = np.abs(xq.astype(np.float64)) @ np.abs(wd).T, nb + 4
    else:
        scale, k = np.abs(xq.astype(np.float64)) @ (np.abs(wd - off) + np.abs(off)).T, 2 * nb + 8
    assert np.all(np.isfinite(got)), "kernel left NaN in its output"
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= k * 2.0 ** -23 * scale + 1e-30), float((err / scale).max())


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("qtype", GEMM_TYPES)
def test_gemm_against_gguf_and_decode(qtype, n_threads):
    rng = np.random.default_rng(int(qtype) + 10 * n_threads)
    shapes = [(13, 96, 1), (8, 32, 3), (203, 576, 7), (37, 160, 130), (1, 64, 5), (64, 1536, 4)]
    if qtype in K_QUANTS:  # whole 256-value super-blocks
        shapes = [(13, 256, 1), (8, 256, 3), (203, 512, 7), (37, 256, 130), (1, 768, 5),
                  (64, 1536, 4)]
    for rows, cols, n_tok in shapes:
        w = _weight(rng, qtype, rows, cols)
        x = _ro(rng.standard_normal((n_tok, cols)).astype(np.float32))
        out = _nan((n_tok, rows))
        cpu.matmul(w, x, out, n_threads)
        xq = ref.quantize_act_q8(x)
        off = _offsets(w)
        _bound_check(out, _deq(w), xq, cols // 32, off)
        dec = np.stack([cpu.matvec(w, x[t], _nan(rows), n_threads) for t in range(n_tok)])
        _bound_check(dec, _deq(w), xq, cols // 32, off)
        # decode's GEMV (gemv.h) sums in the GEMM's order for every quantized type: same bits
        np.testing.assert_array_equal(out, dec)
        # the same bits at every thread count
        np.testing.assert_array_equal(out, cpu.matmul(w, x, _nan((n_tok, rows)), 3 - n_threads))


def test_gemm_q8_0_extreme_codes():
    """q8_0 codes -128 and 127 (a hostile or foreign file) and activations at +-127 after
    quantization: the u8 x s8 pair sums must not saturate."""
    rng = np.random.default_rng(5)
    rows, cols, n_tok = 11, 128, 6
    blocks = np.zeros((rows, cols // 32), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"] = rng.uniform(0.5, 2, blocks.shape)
    blocks["qs"] = rng.choice(np.array([-128, 127, -127, 1], np.int8), (rows, cols // 32, 32))
    w = cpu.QTensor(_ro(blocks.view(np.uint8).reshape(rows, -1)), QT.Q8_0, rows, cols)
    x = _ro(np.where(rng.random((n_tok, cols)) < 0.5, -1.0, 1.0).astype(np.float32))
    out = cpu.matmul(w, x, _nan((n_tok, rows)), 1)
    _bound_check(out, _deq(w), ref.quantize_act_q8(x), cols // 32)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K,
                                   QT.Q6_K])
def test_gemm_extreme_codes(qtype):
    """Largest codes (nibbles 15, five-bit 31, Q6_K q = 0, i.e. v = -32) against activations at
    +-127 after quantization, all of one sign in some tokens: the 16-bit partial sums of the
    tile (8 chunks of nibbles, 4 of five-bit values or of |v| <= 32) must not saturate."""
    rng = np.random.default_rng(6)
    rows, n_tok = 11, 6
    cols = 512 if qtype in K_QUANTS else 128
    w = _weight(rng, qtype, rows, cols)
    bb = gguf.constants.GGML_QUANT_SIZES[qtype][1]
    blocks = np.array(w.raw).reshape(rows, -1, bb)
    if qtype == QT.Q6_K:
        blocks[:, :, :192] = 0  # ql, qh: q = 0, v = -32; the scales stay
    else:
        _, q0, q1 = OFFSET_QUANTS[qtype]
        blocks[:, :, q0:q1] = 0xFF  # every quant bit set (qh too for the five-bit types)
    w = cpu.QTensor(_ro(blocks.reshape(rows, -1)), qtype, rows, cols)
    x = np.where(rng.random((n_tok, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[:2] = 1.0
    x[2] = -1.0
    x = _ro(x)
    xq = ref.quantize_act_q8(x)
    for n_threads in (1, 2):
        out = cpu.matmul(w, x, _nan((n_tok, rows)), n_threads)
        _bound_check(out, _deq(w), xq, cols // 32, _offsets(w))


@pytest.mark.parametrize("qtype", GEMM_TYPES)
def test_old_prefill_switch(qtype):
    """The benchmarking switch selects the pre-GEMM kernels, which stay bit-equal to decode."""
    rng = np.random.default_rng(7)
    w = _weight(rng, qtype, 45, 256 if qtype in K_QUANTS else 192)
    x = _ro(rng.standard_normal((9, w.cols)).astype(np.float32))
    new = cpu.matmul(w, x, _nan((9, 45)), 2)
    prev = K.set_old_prefill(1)
    try:
        old = cpu.matmul(w, x, _nan((9, 45)), 2)
    finally:
        K.set_old_prefill(prev)
    dec = np.stack([cpu.matvec(w, x[t], _nan(45), 1) for t in range(9)])
    np.testing.assert_array_equal(old, dec)
    np.testing.assert_allclose(new, dec, rtol=1e-5, atol=1e-5 * np.abs(dec).max())


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.F16, QT.F32, QT.Q4_K, QT.Q6_K, QT.BF16])
def test_down_gemm(qtype, n_threads):
    """matmul_t (a @ ffn_down_t) against float64 over gguf's dequantization: row counts and
    column counts off the 32-column strip and 4-token tile, both kernel generations (q8_0 and
    q4_0's integer path within its own bound, tests/_gemmt_bound.py)."""
    rng = np.random.default_rng(int(qtype) + 100)
    col_choices = [256, 512] if qtype in (QT.Q4_K, QT.Q6_K) else [32, 96, 576]
    if qtype in (QT.F16, QT.F32, QT.BF16):
        col_choices = [7, 33, 100]
    for rows, n_tok in [(5, 1), (203, 3), (130, 7), (600, 130)]:
        cols = int(rng.choice(col_choices))
        w = cpu.QTensor.from_array(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        a = _ro(rng.standard_normal((n_tok, rows)).astype(np.float32))
        wd = ref.dequantize(w).astype(np.float64)
        exact = a.astype(np.float64) @ wd
        scale = np.abs(a.astype(np.float64)) @ np.abs(wd)
        got = {}
        for old in (1, 0):
            prev = K.set_old_prefill(old)
            try:
                got[old] = cpu.matmul_t(w, a, _nan((n_tok, cols)), n_threads)
            finally:
                K.set_old_prefill(prev)
            assert np.all(np.isfinite(got[old]))
            if old or qtype not in GEMMT_TYPES:
                assert np.all(np.abs(got[old] - exact) <= (rows + 4) * 2.0 ** -23 * scale + 1e-30)
            else:  # gemmt.h's int8 coefficients (test_down_gemm_int8)
                assert np.all(np.abs(got[old] - exact) <= gemmt_bound(w, a)[1])
        np.testing.assert_array_equal(
            got[0], cpu.matmul_t(w, a, _nan((n_tok, cols)), 3 - n_threads))


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("qtype", GEMMT_TYPES)
def test_down_gemm_int8(qtype, n_threads):
    """gemmt.h's integer matmul_t (q8_0, q4_0) within its stated bound of float64 over gguf's
    dequantization (tests/_gemmt_bound.py): rows off the 32-row tile and the 256-row panel,
    token counts off the 2-token pass, rows scaled by U(0.1, 10), activations with zero tiles,
    NaN-poisoned outputs; the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(300 + int(qtype) + 7 * n_threads)
    worst = 0.0
    for rows, cols, n_tok in [(1, 32, 1), (31, 64, 2), (33, 32, 3), (257, 96, 5), (600, 576, 130),
                              (1536, 64, 9)]:
        w = _weight(rng, qtype, rows, cols)
        a = (rng.standard_normal((n_tok, rows)) * rng.uniform(0.01, 100, rows)).astype(np.float32)
        a[:, :min(rows, 32)][:, ::2] *= rng.uniform(0, 1e-3)  # small terms beside large ones
        if rows >= 64:
            a[0, 32:64] = 0.0  # an all-zero tile (scale 0)
        a = _ro(a)
        exact, bound = gemmt_bound(w, a)
        got = cpu.matmul_t(w, a, _nan((n_tok, cols)), n_threads)
        assert np.all(np.isfinite(got)), "kernel left NaN in its output"
        err = np.abs(got - exact)
        assert np.all(err <= bound), f"rows={rows}: max err/bound {np.max(err / bound):.3g}"
        worst = max(worst, np.max(err[bound > 0] / bound[bound > 0]))
        np.testing.assert_array_equal(got, cpu.matmul_t(w, a, _nan((n_tok, cols)), 3 - n_threads))
    assert worst > 0.01  # the bound is not vacuous: the error reaches a sizeable part of it


@pytest.mark.parametrize("n_threads", [1, 2])
def test_batched_attention(n_threads):
    """The batched attention (keys 8 to a vector, vectorized exp) against float64 softmax
    attention and the one-query-at-a-time loop that decode uses (kernels.pyx _attend_head):
    within 1e-5, the same bits at 1 and 2 threads, rows past the new tokens never read."""
    rng = np.random.default_rng(200 + n_threads)
    for n_head, n_kv, hd, n_past, n_tok in [(9, 3, 64, 0, 130), (9, 3, 64, 17, 7), (4, 4, 16, 3, 5),
                                            (8, 2, 32, 0, 1), (6, 1, 96, 2, 3), (2, 1, 8, 0, 9)]:
        n_ctx = n_past + n_tok + 2
        q = _ro(rng.standard_normal((n_tok, n_head, hd)).astype(np.float32))
        k = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
        v = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
        k[n_past + n_tok:] = np.nan  # never read
        v[n_past + n_tok:] = np.nan
        k, v = _ro(k), _ro(v)
        new = cpu.attention(q, k, v, n_past, _nan(q.shape), n_threads)
        prev = K.set_old_prefill(1)
        try:
            old = cpu.attention(q, k, v, n_past, _nan(q.shape), n_threads)
        finally:
            K.set_old_prefill(prev)
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(new, cpu.attention(q, k, v, n_past, _nan(q.shape),
                                                         3 - n_threads))
        g = n_head // n_kv
        want = np.empty(q.shape)
        for t in range(n_tok):
            n = n_past + t + 1
            for h in range(n_head):
                s = k[:n, h // g].astype(np.float64) @ q[t, h] / np.sqrt(hd)
                p = np.exp(s - s.max())
                want[t, h] = (p / p.sum()) @ v[:n, h // g]
        np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-5)


def test_windowed_attention_gives_the_same_bits_however_a_batch_is_split():
    """Sliding-window attention (Gemma 3, Mistral) over a batch starting anywhere gives each
    position the bits of the whole batch: a batch starting at window - 1 has one query whose
    window still reaches row 0, and that lone query went through the one-query (decode) path,
    whose bits differ (Gemma-3-270M's shapes: 4 heads, 1 KV head, head_dim 256)."""
    from pyinfer.ops.families import attention_window

    rng = np.random.default_rng(5)
    window, n_tok, n_head, hd = 12, 30, 4, 256
    q = _ro(rng.standard_normal((n_tok, n_head, hd)).astype(np.float32))
    k = _ro(rng.standard_normal((n_tok, 1, hd)).astype(np.float16))
    v = _ro(rng.standard_normal((n_tok, 1, hd)).astype(np.float16))
    whole = attention_window(q, k, v, 0, window, _nan(q.shape))
    for start in range(1, n_tok - 1):
        part = attention_window(q[start:], k, v, start, window, _nan(q[start:].shape))
        np.testing.assert_array_equal(part, whole[start:], err_msg=f"batch from {start}")


@pytest.mark.parametrize("n_threads", [1, 2])
def test_matmul_multi_equals_matmul(n_threads):
    """q, k and v from one call (x quantized once, one parallel region): the same bits as three
    ``matmul`` calls, for mixed q8_0/q4_0/Q5_0 (llama.cpp's Q4_K_M mixes Q5_0 and Q8_0 in attn_v)
    and row counts off the tiles; unquantized types refused."""
    rng = np.random.default_rng(300 + n_threads)
    cols, n_tok = 192, 11
    ws = [_weight(rng, QT.Q8_0, 45, cols), _weight(rng, QT.Q4_0, 16, cols),
          _weight(rng, QT.Q5_0, 7, cols)]
    x = _ro(rng.standard_normal((n_tok, cols)).astype(np.float32))
    for k in (1, 2, 3):
        outs = [_nan((n_tok, w.rows)) for w in ws[:k]]
        cpu.matmul_multi(ws[:k], x, outs, n_threads)
        for w, o in zip(ws[:k], outs):
            np.testing.assert_array_equal(o, cpu.matmul(w, x, _nan((n_tok, w.rows)), 1))
    f16 = cpu.QTensor.from_array(rng.standard_normal((8, cols)).astype(np.float32), QT.F16)
    with pytest.raises(ValueError):
        cpu.matmul_multi([ws[0], f16], x, [_nan((n_tok, 45)), _nan((n_tok, 8))], n_threads)
    with pytest.raises(ValueError):
        cpu.matmul_multi([ws[0]], x, [_nan((n_tok, 44))], n_threads)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("silu", [True, False])
def test_matmul_glu(silu, n_threads):
    """act(x gate^T) * (x up^T) in one call: the GEMMs are matmul's (same bits), the activation
    within 4e-7 relative of float64 SiLU / ReLU applied to them (decode's _act1 is within 1 ulp
    of float64 too), against gguf's dequantization within the activation quantization's error
    (ref.matmul_glu), and the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(400 + n_threads + 10 * silu)
    for qg, qu, rows, cols, n_tok in [(QT.Q8_0, QT.Q4_0, 37, 96, 5), (QT.Q4_0, QT.Q4_0, 200, 576, 133),
                                      (QT.Q8_0, QT.Q8_0, 16, 32, 2), (QT.Q5_0, QT.Q5_0, 45, 576, 9),
                                      (QT.Q4_1, QT.Q5_1, 17, 64, 4), (QT.Q4_K, QT.Q6_K, 24, 256, 6),
                                      (QT.Q5_K, QT.Q5_0, 9, 256, 3)]:
        gate, up = _weight(rng, qg, rows, cols), _weight(rng, qu, rows, cols)
        x = _ro(rng.standard_normal((n_tok, cols)).astype(np.float32))
        out = cpu.matmul_glu(gate, up, x, _nan((n_tok, rows)), silu, n_threads)
        g = cpu.matmul(gate, x, _nan((n_tok, rows)), 1).astype(np.float64)
        u = cpu.matmul(up, x, _nan((n_tok, rows)), 1).astype(np.float64)
        with np.errstate(over="ignore"):
            want = (g / (1.0 + np.exp(-g)) if silu else np.maximum(g, 0.0)) * u
        np.testing.assert_allclose(out, want, rtol=4e-7, atol=1e-30)
        r = ref.matmul_glu(gate, up, x, np.empty((n_tok, rows)), silu)
        np.testing.assert_allclose(out, r, rtol=0, atol=0.05 * np.abs(r).max())
        np.testing.assert_array_equal(
            out, cpu.matmul_glu(gate, up, x, _nan((n_tok, rows)), silu, 3 - n_threads))
    f32 = cpu.QTensor.from_array(rng.standard_normal((8, 32)).astype(np.float32), QT.F32)
    with pytest.raises(ValueError):
        cpu.matmul_glu(f32, f32, _ro(np.ones((2, 32), np.float32)), _nan((2, 8)), silu, n_threads)


def test_rope_threads_same_bits():
    """rope_neox split over tokens gives the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((37, 5, 64)).astype(np.float32)
    pos = np.arange(3, 40, dtype=np.int32)
    a = cpu.rope_neox(x.copy(), pos, 1e5, 64, 1)
    b = cpu.rope_neox(x.copy(), pos, 1e5, 64, 2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, ref.rope_neox(x.copy(), pos, 1e5, 64), rtol=1e-5, atol=1e-5)
