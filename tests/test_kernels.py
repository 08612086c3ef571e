"""Compiled CPU kernels (pyinfer/ops/cpu.py) against their NumPy twins (pyinfer/ops/reference.py),
and the twins against code nobody here wrote (gguf.quants.dequantize, torch).

Outputs are poisoned with NaN before every kernel call and all inputs are read-only, as the
memory-mapped weights are. Quantized dot products (matvec, matmul, gather_matvec on q8_0/q4_0)
quantize the activation to 8 bits per block: they are checked tightly against the twin fed the
same quantized activation, and against the exact f32 product at relative error 1e-2.
"""
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer.ops import cpu
from pyinfer.ops import reference as ref
from tests._gemmt_bound import GEMMT_TYPES, gemmt_bound
from tests._kernel_arrays import nan as _nan, readonly as _ro

QT = gguf.GGMLQuantizationType
QTYPES = list(cpu.SUPPORTED)
QUANT = ref.QUANT  # types dotted against the 8-bit activation
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)  # 256-value super-blocks
THREADS = [1, 2]


def _block(qtype):
    return 256 if qtype in K_QUANTS else 32


def _rand(rng, *shape):
    return _ro(rng.standard_normal(shape).astype(np.float32))


def _cols(rng, qtype):
    if qtype in QUANT:
        return _block(qtype) * int(rng.integers(1, 10 if qtype not in K_QUANTS else 4))
    return int(rng.choice([1, 7, 8, 31, 33, 100, 257]))


def _weight(rng, qtype, rows=None, cols=None):
    rows = int(rng.integers(1, 90)) if rows is None else rows
    cols = _cols(rng, qtype) if cols is None else cols
    w = cpu.QTensor.from_array(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    w.data.setflags(write=False)  # like a GGUFReader memmap
    return w


def _rel(got, want):
    assert np.all(np.isfinite(got)), "kernel left NaN in its output"
    scale = max(float(np.linalg.norm(want)), 1e-30)
    return float(np.linalg.norm(got - want)) / scale


def _close_kv(got, want, qtype):
    """An f16 cache row written by a kernel against the reference's: ``_close`` of the f32
    values, widened by one f16 rounding step (2^-10 relative), since values that differ in the
    last f32 bits may round to neighbouring halves."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got)), "kernel left NaN in the cache row"
    np.testing.assert_allclose(got, want, rtol=1e-4 + 2**-10,
                               atol=1e-4 * (1 + np.abs(want).max(initial=0)))


def _close(got, want, qtype):
    """Exact-dequantization kernels: f32 accumulation differences only."""
    assert np.all(np.isfinite(got)), "kernel left NaN in its output"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * (1 + np.abs(want).max(initial=0)))


def _check_dot(got, w, x, ref_fn, *args):
    """Dot-product kernels: tight against the twin on the same (possibly quantized) activation,
    and within 1e-2 relative of the exact product for quantized weights."""
    want = ref_fn(w, x, *args)
    if w.qtype in QUANT:
        want_q = ref_fn(w, ref.quantize_act_q8(x), *args)
        assert _rel(got, want_q) < 1e-5
        if got.size < 16:  # the statistical bound below needs a few outputs to average over
            return
        # 1e-2 of the typical output size (the norm of a few outputs may be cancellation-small)
        typical = np.sqrt(np.mean(ref.dequantize(w) ** 2) * np.sum(x.astype(np.float64) ** 2))
        err = np.sqrt(np.mean((got.astype(np.float64) - want) ** 2))
        assert err < 1e-2 * max(typical, np.sqrt(np.mean(want.astype(np.float64) ** 2)))
    else:
        _close(got, want, w.qtype)


# ------------------------------------------------------------------ dequantization / layout

@pytest.mark.parametrize("qtype", (QT.Q8_0, QT.Q4_0))  # the twin's own decoder (others: gguf's)
def test_reference_dequantize_matches_gguf(qtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((17, 96)).astype(np.float32) * rng.uniform(0.01, 100, (17, 1))
    data = gguf.quants.quantize(a, qtype)
    w = cpu.QTensor(data, qtype, 17, 96)
    want = gguf.quants.dequantize(data, qtype)
    np.testing.assert_array_equal(ref.dequantize(w), want)
    assert np.abs(want - a).max() <= np.abs(a).max() / 4  # the format round-trips sensibly


@pytest.mark.parametrize("qtype", QTYPES)
def test_get_rows_exact(qtype):
    rng = np.random.default_rng(2)
    w = _weight(rng, qtype, rows=40)
    ids = _ro(np.array([0, 39, 5, 5, 17], dtype=np.int32))
    out = _nan((5, w.cols))
    cpu.get_rows(w, ids, out)
    if qtype in QUANT or qtype == QT.BF16:
        want = gguf.quants.dequantize(w.data, qtype).reshape(w.rows, w.cols)[ids]
    else:
        want = w.data.astype(np.float32)[ids]
    np.testing.assert_array_equal(out, want)
    out0 = np.zeros((0, w.cols), np.float32)
    cpu.get_rows(w, np.zeros(0, np.int32), out0)


@pytest.mark.parametrize("qtype", QTYPES)
def test_from_reader_tensor(tmp_path, qtype):
    rng = np.random.default_rng(3)
    cols = 2 * _block(qtype)
    a = rng.standard_normal((6, cols)).astype(np.float32)
    w = cpu.QTensor.from_array(a, qtype)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    if qtype in QUANT or qtype == QT.BF16:
        writer.add_tensor("w", w.data, raw_dtype=qtype)
    else:
        writer.add_tensor("w", w.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf.GGUFReader(str(path)).tensors[0]
    wr = cpu.QTensor.from_reader_tensor(t)
    assert (wr.rows, wr.cols, wr.qtype) == (6, cols, qtype)
    assert np.shares_memory(wr.raw, t.data)  # a view of the memmap, not a copy
    np.testing.assert_array_equal(ref.dequantize(wr), ref.dequantize(w))
    x = rng.standard_normal(cols).astype(np.float32)
    np.testing.assert_array_equal(cpu.matvec(wr, x, _nan(6)), cpu.matvec(w, x, _nan(6)))


def test_qtensor_rejects_bad_shapes():
    with pytest.raises(ValueError):
        cpu.QTensor(np.zeros((4, 30), np.uint8), QT.Q8_0, 4, 30)
    with pytest.raises(ValueError):
        cpu.QTensor(np.zeros((4, 8), np.float16), QT.F32, 4, 8)
    with pytest.raises(ValueError):
        cpu.QTensor(np.zeros((4, 34), np.uint8), QT.Q8_0, 4, 64)


# ------------------------------------------------------------------ GEMV family

@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_matvec(qtype, n_threads):
    rng = np.random.default_rng(10 + int(qtype))
    for _ in range(4):
        w = _weight(rng, qtype)
        x = _rand(rng, w.cols)
        out = _nan(w.rows)
        cpu.matvec(w, x, out, n_threads)
        _check_dot(out, w, x, lambda w_, x_: ref.matvec(w_, x_, _nan(w.rows)))


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul(qtype, n_threads):
    rng = np.random.default_rng(20 + int(qtype))
    for n_tok in (1, 3, 4, 9, 19):  # four-token groups and the remainder
        w = _weight(rng, qtype)
        x = _rand(rng, n_tok, w.cols)
        out = _nan((n_tok, w.rows))
        cpu.matmul(w, x, out, n_threads)
        _check_dot(out, w, x, lambda w_, x_: ref.matmul(w_, x_, _nan((n_tok, w.rows))))
        # prefill and decode agree token by token: bit for bit (same per-block order), except
        # the quantized types' prefill GEMM, which sums the same exact block products in another f32
        # order (tests/test_prefill_gemm.py states and checks its bound)
        if not cpu.prefill_gemm(qtype):
            for t in range(n_tok):
                np.testing.assert_array_equal(out[t], cpu.matvec(w, x[t], _nan(w.rows), n_threads))


def _active_sets(rng, rows):
    return {
        "empty": np.zeros(0, np.int32),
        "one": np.array([rows - 1], np.int32),
        "all": np.arange(rows, dtype=np.int32),
        "random": np.sort(rng.choice(rows, max(1, rows // 3), replace=False)).astype(np.int32),
        "repeat": rng.integers(0, rows, 2 * rows).astype(np.int32),
    }


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_gather_matvec(qtype, n_threads):
    rng = np.random.default_rng(30 + int(qtype))
    w = _weight(rng, qtype, rows=int(rng.integers(40, 120)))
    x = _rand(rng, w.cols)
    for name, idx in _active_sets(rng, w.rows).items():
        idx = _ro(idx)
        out = _nan(idx.size)
        cpu.gather_matvec(w, x, idx, out, n_threads)
        if idx.size == 0:
            continue
        _check_dot(out, w, x, lambda w_, x_: ref.gather_matvec(w_, x_, idx, _nan(idx.size)))


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_axpy_rows(qtype, n_threads):
    rng = np.random.default_rng(40 + int(qtype))
    w = _weight(rng, qtype, rows=int(rng.integers(40, 120)))
    for name, idx in _active_sets(rng, w.rows).items():
        idx = _ro(idx)
        coef = _rand(rng, idx.size)
        out = _nan(w.cols)
        cpu.axpy_rows(w, coef, idx, out, n_threads)
        _close(out, ref.axpy_rows(w, coef, idx, _nan(w.cols)), qtype)
        if name == "empty":
            assert not out.any()


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_matvec_t(qtype, n_threads):
    rng = np.random.default_rng(50 + int(qtype))
    for rows in (1, 7, 300):
        w = _weight(rng, qtype, rows=rows)
        a = _rand(rng, rows)
        out = _nan(w.cols)
        cpu.matvec_t(w, a, out, n_threads)
        _close(out, ref.matvec_t(w, a, _nan(w.cols)), qtype)


INT_AXPY = {QT.Q8_0: (34, 0, 0), QT.Q4_0: (18, 8, 0), QT.Q5_0: (22, 16, 0),  # block bytes,
             QT.Q4_1: (20, 0, 1), QT.Q5_1: (24, 0, 1)}  # value offset k (x = d (v - k)), min at 2


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", list(INT_AXPY))
def test_axpy_rows_int16_bound(qtype, n_threads):
    """axpy_rows / matvec_t quantize each group's coefficients coef[j] * d[j, b] to int16 per
    32-column block b (cython/axpyq.h). Stated bound, per column i of block b, against the exact
    sum: max_j |coef[j] d[j,b]| / 65534 * sum_j |v[j,i]| (v the value d multiplies, from the raw
    blocks) plus f32 rounding. Rows scaled over three decades and coefficients over six, so one
    row dominates a group's scale; the error must also stay above nothing a float path would
    miss: it is checked against float64, not the f32 twin."""
    rng = np.random.default_rng(90 + int(qtype))
    nbytes, k_off, has_min = INT_AXPY[qtype]
    rows, cols = 150, 96
    a = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-2, 1, (rows, 1))
    w = cpu.QTensor.from_array(a.astype(np.float32), qtype)
    w.data.setflags(write=False)
    blocks = np.asarray(w.data).reshape(rows, cols // 32, nbytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)  # (rows, nb)
    wd = ref.dequantize(w).astype(np.float64)  # (rows, cols), gguf's decoding (the twin's)
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64) if has_min else 0 * d
    # the integer value v each weight is d * v (+ min) of: q8_0 q, q4_0 q - 8, Q4_1 q ...
    dd = np.repeat(d, 32, axis=1)
    v = (wd - np.repeat(m, 32, axis=1)) / np.where(dd == 0, 1, dd)
    assert np.allclose(v, np.round(v), atol=1e-3) and np.abs(v).max() <= 128
    for name, idx in _active_sets(rng, rows).items():
        if idx.size == 0:
            continue
        coef = rng.standard_normal(idx.size) * 10.0 ** rng.uniform(-3, 3, idx.size)
        coef = _ro(coef.astype(np.float32))
        c64 = coef.astype(np.float64)
        out = _nan(cols)
        if name == "all":
            cpu.matvec_t(w, coef, out, n_threads)
        else:
            cpu.axpy_rows(w, coef, _ro(idx), out, n_threads)
        exact = c64 @ wd[idx]
        mag = np.abs(c64) @ np.abs(wd[idx])
        mx = np.repeat(np.max(np.abs(c64[:, None] * d[idx]), axis=0), 32)  # per block, all rows
        bound = mx / 65534 * (np.abs(v[idx]).sum(axis=0)) + (idx.size / 16 + 4) * 2.0 ** -23 * mag
        assert np.all(np.isfinite(out))
        assert np.all(np.abs(out - exact) <= bound), (name, np.max(np.abs(out - exact) / bound))
        # and far inside what 8-bit coefficients (the GEMV's activation precision) would give
        assert np.max(np.abs(out - exact)) <= mx.max() / 254 * np.abs(v[idx]).sum(axis=0).max()


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_1, QT.Q4_K])
def test_axpy_rows_long_rows_any_threads(qtype):
    """Rows of 2 KiB and more (kernels.pyx AXPY_SPLIT_COLS_BYTES) take the integer sums split
    among the threads by columns, shorter ones the row chunks: both must give the same bits at
    every thread count (issue 9), and agree with the NumPy twin as test_axpy_rows asks."""
    rng = np.random.default_rng(97 + int(qtype))
    for cols in (4096, 512):  # 2304-4352 bytes per row (column split), then 288-544 (row chunks)
        w = _weight(rng, qtype, rows=300, cols=cols)
        assert (w.raw.shape[1] >= 2048) == (cols == 4096)
        for name, idx in _active_sets(rng, w.rows).items():
            idx = _ro(idx)
            coef = _rand(rng, idx.size)
            outs = []
            for nt in (1, 2, 3, 5):
                out = _nan(w.cols)
                cpu.axpy_rows(w, coef, idx, out, nt)
                outs.append(out)
            for out in outs[1:]:
                np.testing.assert_array_equal(out, outs[0], err_msg=name)
            _close(outs[0], ref.axpy_rows(w, coef, idx, _nan(w.cols)), qtype)


@pytest.mark.parametrize("qtype", [QT.F16, QT.F32])
def test_axpy_rows_float_long_rows_any_threads(qtype):
    """Float rows of 4 KiB and more (a 7B model's ffn_down_t in f16) are summed in chunks of at
    least 16 rows rather than 128 (rowsum_team.h PI_AXPY_LONG_ROW_BYTES), so the few hundred cold
    rows a hybrid GPU layer leaves the host spread over many threads: the same bits at 1, 2, 3, 5
    and 16 threads, and the NumPy twin's sum."""
    rng = np.random.default_rng(11 + int(qtype))
    w = _weight(rng, qtype, rows=600, cols=2048)
    assert w.raw.shape[1] >= 4096
    for n in (0, 15, 40, 300, 460):
        idx = _ro(np.sort(rng.choice(w.rows, n, replace=False)).astype(np.int32))
        coef = _rand(rng, n)
        outs = []
        for nt in (1, 2, 3, 5, 16):
            out = _nan(w.cols)
            cpu.axpy_rows(w, coef, idx, out, nt)
            outs.append(out)
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0], err_msg=str(n))
        _close(outs[0], ref.axpy_rows(w, coef, idx, _nan(w.cols)), qtype)


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_t(qtype, n_threads):
    rng = np.random.default_rng(60 + int(qtype))
    for n_tok in (1, 5):
        cols = (int(rng.choice([32, 96, 160])) if qtype in QUANT else 130) * _block(qtype) // 32
        w = _weight(rng, qtype, cols=cols)
        a = rng.standard_normal((n_tok, w.rows)).astype(np.float32)
        a[a < 0] = 0.0  # ReLU-like zeros take the skip path
        a = _ro(a)
        out = _nan((n_tok, w.cols))
        cpu.matmul_t(w, a, out, n_threads)
        if qtype in GEMMT_TYPES:  # int8 coefficients (cython/gemmt.h): its stated bound
            exact, bound = gemmt_bound(w, a)
            assert np.all(np.isfinite(out)) and np.all(np.abs(out - exact) <= bound)
            continue
        _close(out, ref.matmul_t(w, a, _nan((n_tok, w.cols))), qtype)


def test_shape_and_index_errors():
    rng = np.random.default_rng(70)
    w = _weight(rng, QT.Q8_0, rows=8, cols=64)
    with pytest.raises(ValueError):
        cpu.matvec(w, _rand(rng, 63), _nan(8))
    with pytest.raises(ValueError):
        cpu.matvec(w, _rand(rng, 64), _nan(7))
    with pytest.raises(IndexError):
        cpu.gather_matvec(w, _rand(rng, 64), np.array([8], np.int32), _nan(1))
    with pytest.raises(IndexError):
        cpu.axpy_rows(w, _rand(rng, 1), np.array([-1], np.int32), _nan(64))
    with pytest.raises(ValueError):  # read-only output
        cpu.matvec(w, _rand(rng, 64), _ro(_nan(8)))


# ------------------------------------------------------------------ norm, rope, attention, act

def test_rmsnorm():
    rng = np.random.default_rng(80)
    for shape in [(37,), (4, 576), (3, 5)]:
        x = _rand(rng, *shape)
        wt = _rand(rng, shape[-1])
        out = _nan(shape)
        cpu.rmsnorm(x, wt, 1e-5, out)
        np.testing.assert_allclose(out, ref.rmsnorm(x, wt, 1e-5, _nan(shape)), rtol=1e-5, atol=1e-6)


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_neox(n_rot):
    rng = np.random.default_rng(90)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 8000])
    got = cpu.rope_neox(x.copy(), pos, 1e5, n_rot)
    want = ref.rope_neox(x.copy(), pos, 1e5, n_rot)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])
    # Hugging Face's rotate_half formula, written out in torch (float64 angles)
    torch = _torch()
    half = n_rot // 2
    inv = 1.0 / (1e5 ** (torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot))
    emb = torch.cat([torch.outer(torch.tensor(pos, dtype=torch.float64), inv)] * 2, dim=-1)
    xt = torch.tensor(x[..., :n_rot], dtype=torch.float64)
    rot = torch.cat([-xt[..., half:], xt[..., :half]], dim=-1)
    hf = xt * emb.cos()[:, None, :] + rot * emb.sin()[:, None, :]
    np.testing.assert_allclose(got[..., :n_rot], hf.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_threads", THREADS)
def test_attention(n_threads):
    rng = np.random.default_rng(100)
    torch = _torch()
    for n_head, n_kv, hd, n_past, n_tok in [(9, 3, 64, 0, 1), (9, 3, 64, 0, 6), (4, 4, 16, 11, 3),
                                            (8, 2, 32, 30, 1), (6, 1, 8, 5, 4)]:
        n_ctx = n_past + n_tok + 3
        q = _rand(rng, n_tok, n_head, hd)
        kv_dtype = np.float16 if n_tok % 2 else np.float32  # both cache types
        k = rng.standard_normal((n_ctx, n_kv, hd)).astype(kv_dtype)
        v = rng.standard_normal((n_ctx, n_kv, hd)).astype(kv_dtype)
        k[n_past + n_tok:] = np.nan  # rows past the new tokens must never be read
        v[n_past + n_tok:] = np.nan
        k, v = _ro(k), _ro(v)
        out = _nan((n_tok, n_head, hd))
        cpu.attention(q, k, v, n_past, out, n_threads)
        want = ref.attention(q, k, v, n_past, _nan((n_tok, n_head, hd)))
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        # torch SDPA with an explicit causal mask over the whole prefix
        n_all = n_past + n_tok
        g = n_head // n_kv
        qt = torch.tensor(q).transpose(0, 1)  # (n_head, n_tok, hd)
        kt = torch.tensor(k[:n_all].astype(np.float32)).repeat_interleave(g, dim=1).transpose(0, 1)
        vt = torch.tensor(v[:n_all].astype(np.float32)).repeat_interleave(g, dim=1).transpose(0, 1)
        mask = torch.arange(n_all)[None, :] <= (n_past + torch.arange(n_tok))[:, None]
        sd = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        np.testing.assert_allclose(out, sd.transpose(0, 1).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_attention_one_query(n_threads):
    """One query (the fused decode's attention, ``attend_one``): attend.h's kernel (every head's
    scores from one pass over the cache rows, rows split between threads) gives the
    one-head-at-a-time loop's bits (``attention`` under set_old_prefill(1)) and agrees with torch
    SDPA. Scores spread to large negative
    differences so that some exponentials fall outside pi_expf_safe's range."""
    rng = np.random.default_rng(101 + n_threads)
    torch = _torch()
    for n_head, n_kv, hd, n_att, spread in [(9, 3, 64, 1, 1), (9, 3, 64, 37, 1), (9, 3, 64, 481, 1),
                                            (4, 4, 128, 100, 4), (8, 2, 32, 16, 30),
                                            (6, 1, 8, 5, 1), (5, 5, 40, 70, 8),
                                            (4, 2, 128, 99, 2), (8, 2, 32, 17, 1),
                                            # GQA groups of 8, 7 and 6 (TinyLlama, Qwen2.5): the per-head scores path
                                            (16, 2, 64, 41, 1), (14, 2, 64, 30, 1), (12, 2, 128, 25, 2),
                                            # a group of 16: past the 256-bit scores' 8
                                            (16, 1, 32, 23, 1)]:
        n_ctx = n_att + 2
        q = _ro((spread * rng.standard_normal((1, n_head, hd))).astype(np.float32))
        # the f16 cache (the default) and the f32 one (--cache-type f32): both kernels' paths
        kv_dtype = np.float16 if (n_att + hd) % 2 else np.float32
        k = rng.standard_normal((n_ctx, n_kv, hd)).astype(kv_dtype)
        v = rng.standard_normal((n_ctx, n_kv, hd)).astype(kv_dtype)
        k[n_att:] = v[n_att:] = np.nan  # rows past the query must never be read
        k, v = _ro(k), _ro(v)
        got = _nan((1, n_head, hd))
        cpu._k.attend_one(q[0], *cpu.kv_pair(k, v), n_att - 1, got[0], n_threads)
        old = cpu._k.set_old_prefill(1)
        try:
            want = _nan((1, n_head, hd))
            cpu.attention(q, k, v, n_att - 1, want, 1)
        finally:
            cpu._k.set_old_prefill(old)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n_head, n_kv, hd, n_att)
        g = n_head // n_kv
        qt = torch.tensor(q).transpose(0, 1)  # (n_head, 1, hd)
        kt = torch.tensor(k[:n_att].astype(np.float32)).repeat_interleave(g, dim=1).transpose(0, 1)
        vt = torch.tensor(v[:n_att].astype(np.float32)).repeat_interleave(g, dim=1).transpose(0, 1)
        sd = torch.nn.functional.scaled_dot_product_attention(qt.double(), kt.double(), vt.double())
        np.testing.assert_allclose(got, sd.transpose(0, 1).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["silu_mul", "relu_mul"])
def test_activations(name):
    rng = np.random.default_rng(110)
    for shape in [(1536,), (3, 77), (0,)]:
        g, u = _rand(rng, *shape) * 4, _rand(rng, *shape)
        out = _nan(shape)
        getattr(cpu, name)(g, u, out)
        np.testing.assert_allclose(out, getattr(ref, name)(g, u, _nan(shape)), rtol=1e-5, atol=1e-6)
    # in place over the gate buffer, as the FFN does it
    g = rng.standard_normal(100).astype(np.float32)
    want = getattr(ref, name)(g, g * 2, _nan(100))
    getattr(cpu, name)(g, g * 2, g)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("with_up,with_ids", [(True, False), (False, True), (True, True)])
def test_select_active(silu, with_up, with_ids):
    """Kept values and ids equal the NumPy twin's (entries past the count are scratch)."""
    rng = np.random.default_rng(7)
    for n, thr in [(1536, 0.3), (5, 0.0), (0, 0.1), (64, 1e9)]:
        g = _rand(rng, n) * 3
        up = _rand(rng, n) if with_up else None
        ids = np.sort(rng.choice(10 * n + 1, n, replace=False)).astype(np.int32) if with_ids else None
        coef, idx = _nan((n,)), np.full(n, -7, np.int32)
        want_c, want_i = _nan((n,)), np.full(n, -7, np.int32)
        k = cpu.select_active(g, up, ids, silu, thr, coef, idx)
        assert k == ref.select_active(g, up, ids, silu, thr, want_c, want_i)
        np.testing.assert_array_equal(idx[:k], want_i[:k])
        np.testing.assert_allclose(coef[:k], want_c[:k], rtol=1e-5, atol=1e-7)
    assert 0 < cpu.select_active(_rand(rng, 100), None, None, silu, 0.05, _nan((100,)),
                                 np.zeros(100, np.int32)) < 100


@pytest.mark.parametrize("silu", [True, False])
def test_select_active_keeps_nan(silu):
    """A NaN activation is kept (|a| > thr is false for NaN, so it used to vanish from the FFN's
    sum and the token came out finite), in the C selection and its NumPy twin alike."""
    rng = np.random.default_rng(8)
    g, up = _rand(rng, 40) * 3, _rand(rng, 40).copy()  # writable (_rand's are read-only)
    up[[3, 17]] = np.nan
    if silu:
        g[29] = np.nan
    for kernel in (cpu.select_active, ref.select_active):
        coef, idx = _nan((40,)), np.full(40, -7, np.int32)
        k = kernel(g, up, None, silu, 0.3, coef, idx)
        want = [3, 17, 29] if silu else [3, 17]
        assert set(want) <= set(idx[:k].tolist()), kernel
        assert np.isnan(coef[:k]).sum() == len(want)


def test_select_inputs_matches_numpy():
    """``select_inputs`` (the decode's input selection; AVX-512: 16 channels a step packed by
    compress instructions, a scalar tail) keeps exactly NumPy's not |x| * scale <= thr, in order,
    with their values: NaN scores kept (a NaN must reach the output, not vanish from the sum),
    -0 and ties at the threshold dropped, every length around the 16-lane steps."""
    rng = np.random.default_rng(17)
    for n in (0, 1, 15, 16, 17, 33, 576, 1539):
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.random(n) < 0.05] = np.nan
        x[rng.random(n) < 0.05] = -0.0
        x[rng.random(n) < 0.05] = np.float32(-0.5)  # ties with thr below (scale None)
        for scale, thr in ((None, 0.5), (rng.uniform(0, 2, n).astype(np.float32), 0.7),
                           (None, -1.0), (None, 1e9)):
            s = np.abs(x) if scale is None else np.abs(x) * scale
            keep = np.flatnonzero(~(s <= np.float32(thr)))
            assert np.isnan(x[keep]).sum() == np.isnan(x).sum()
            coef, idx = _nan((n,)), np.full(n, -7, np.int32)
            k = cpu.select_inputs(x, scale, thr, coef, idx)
            assert k == keep.size, (n, thr)
            np.testing.assert_array_equal(idx[:k], keep)
            assert np.array_equal(coef[:k].view(np.uint32), x[keep].view(np.uint32))


def test_info():
    assert isinstance(cpu.openmp_enabled(), bool)
    assert isinstance(cpu.simd_enabled(), bool)


def _f16_cases():
    """f32 values for the f32 -> f16 rounding: every boundary of the half format (ties to even
    around 1, the largest half and the overflow point, subnormals and the ties below them,
    infinities, NaN) and 2^20 random bit patterns (any exponent)."""
    t = 2.0 ** -24  # the smallest half subnormal
    edge = [0.0, -0.0, 1.0, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, 2048.0 + 1.0,
            65504.0, 65519.0, 65519.996, 65520.0, 65536.0, 1e10, np.inf, -np.inf, np.nan,
            t, t / 2, t / 2 * 1.0001, 1.5 * t, 2.5 * t, 3 * t / 2 * 1.0000001, 2.0**-14,
            2.0**-14 - t / 2, 2.0**-14 * (1 - 2**-12), 6e-8, 3e-8, 1e-30, -1e-30]
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([np.array(edge, np.float32), -np.array(edge, np.float32), bits])
    return x.astype(np.float32)


def test_f16_rounding():
    """The KV cache's f32 -> f16 (the decode kernels' pi_f32_to_f16) gives numpy's astype bits
    (round to nearest even, subnormals, overflow to inf) for every non-NaN value, NaN for NaN."""
    x = _f16_cases()
    h = np.empty(x.size, np.uint16)
    cpu._k.f32_to_f16(x, h)
    want, nan = x.astype(np.float16).view(np.uint16), np.isnan(x)
    assert np.array_equal(h[~nan], want[~nan])
    assert np.isnan(h.view(np.float16)[nan]).all()
    # odd lengths take the scalar tail after the 8-lane loop
    h7 = np.empty(7, np.uint16)
    cpu._k.f32_to_f16(x[3:10].copy(), h7)
    assert np.array_equal(h7, h[3:10])


# ------------------------------------------------------------------ optional builds

def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")),
                            []))
    except OSError:
        return set()


def _cpu_has_vnni() -> bool:
    flags = _cpu_flags()
    return "avx_vnni" in flags or {"avx512_vnni", "avx512vl"} <= flags


@pytest.mark.slow
@pytest.mark.parametrize("env", ["PYINFER_NO_OPENMP", "PYINFER_NO_SIMD", "PYINFER_NO_AVX512",
                                 "PYINFER_AVX2_VNNI"])
def test_build_variants(tmp_path, env):
    """The package builds and computes right without OpenMP, without SIMD, with AVX2 alone (the
    256-bit AXPY and dot paths, which a CPU with AVX-512 otherwise never runs), and with AVX2 and
    the 256-bit VNNI dot (what an AVX-VNNI CPU such as Intel's Alder Lake builds; on an AVX-512
    VNNI CPU its EVEX form without the 512-bit paths). About 40 s each."""
    if env == "PYINFER_AVX2_VNNI" and not _cpu_has_vnni():
        pytest.skip("this CPU has no VNNI")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for item in ("setup.py", "pyproject.toml", "cython", "pyinfer"):
        src = os.path.join(root, item)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(
            src, tmp_path / item, **({"ignore": shutil.ignore_patterns("*.so", "*.c")}
                                     if os.path.isdir(src) else {}))
    envv = dict(os.environ, **{env: "1"})
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, env=envv,
                   check=True, capture_output=True)
    # the input-block sums (ibsum.h) of this build's VNNI/AVX2/scalar path: bits to match
    ib_want = {}
    rng = np.random.default_rng(5)
    for qt in (QT.Q8_0, QT.Q4_0):
        w = cpu.QTensor.from_array(rng.standard_normal((192, 96)).astype(np.float32), qt)
        X = rng.standard_normal((13, 96)).astype(np.float32)  # chunks of 6 (2 on AVX2) and a rest
        X[rng.random(X.shape) < 0.3] = 0.0
        out = np.empty((13, 192), np.float32)
        cpu.matmul_t(cpu.IBTensor.from_rows(w), X, out, 2)
        ib_want[f"{qt.name}_w"], ib_want[f"{qt.name}_x"], ib_want[f"{qt.name}_y"] = w.raw, X, out
        # decode_ffn_in over input-block gate/up (256, 64) and down (64, 128): its activations'
        # exp (pi_expf_safe, 8, 4 or 1 lanes) and the team split must not show in the bits
        # (act_mul: in every build; decode_ffn_in: in every SIMD build)
        gu = cpu.QTensor.from_array(0.3 * rng.standard_normal((256, 64)).astype(np.float32), qt)
        dn = cpu.QTensor.from_array(rng.standard_normal((64, 128)).astype(np.float32), qt)
        x = rng.standard_normal(64).astype(np.float32)
        ib_want[f"{qt.name}_gu"], ib_want[f"{qt.name}_dn"] = gu.raw, dn.raw
        ib_want[f"{qt.name}_x0"] = x
        x = x.copy()
        cpu.decode_ffn_in(x, np.ones(64, np.float32), 1e-5, cpu.IBTensor.from_rows(gu),
                          cpu.IBTensor.from_rows(dn), None, 0.3, None, 0.05, True, 2)
        ib_want[f"{qt.name}_x1"] = x
    g_u = np.concatenate([rng.uniform(-90, 90, 4099), rng.standard_normal(4099)]).astype(np.float32)
    act = np.empty(4099, np.float32)
    cpu._k.act_mul(g_u, 1, act)
    ib_want["gu"], ib_want["act"] = g_u, act
    ib_want["gelu"] = cpu.gelu_tanh(g_u, np.empty_like(g_u))  # this build's GELU, 8/4/1 lanes
    np.savez(tmp_path / "ib.npz", **ib_want)
    np.save(tmp_path / "f16.npy", _f16_cases())  # the KV cache's rounding in this build
    code = ("import numpy as np, gguf; from pyinfer.ops import cpu, reference as ref\n"
            "rng=np.random.default_rng(0)\n"
            "for qt in cpu.SUPPORTED:\n"
            "    w=cpu.QTensor.from_array(rng.standard_normal((50,512)).astype(np.float32), qt)\n"
            "    x=rng.standard_normal(512).astype(np.float32); o=np.empty(50,np.float32)\n"
            "    cpu.matvec(w,x,o,2)\n"
            "    r=ref.matvec(w,ref.quantize_act_q8(x) if qt in ref.QUANT else x,o*0)\n"
            "    assert np.allclose(o,r,rtol=1e-4,atol=1e-3), qt\n"
            "    a=rng.standard_normal(50).astype(np.float32); o=np.empty(512,np.float32)\n"
            "    assert np.allclose(cpu.matvec_t(w,a,o,2), ref.matvec_t(w,a,o*0), atol=1e-3)\n"
            "    X=rng.standard_normal((9,512)).astype(np.float32); M=np.empty((9,50),np.float32)\n"
            "    cpu.matmul(w,X,M,2)  # four-token passes equal decode's dots bit for bit; the\n"
            "    D=np.stack([cpu.matvec(w,X[t],np.empty(50,np.float32),2) for t in range(9)])\n"
            "    # the GEMM sums the same block products in another order (test_prefill_gemm)\n"
            "    assert (np.allclose(M,D,rtol=1e-5,atol=1e-4) if cpu.prefill_gemm(qt)\n"
            "            else np.array_equal(M,D)), qt\n"
            "ib=np.load('ib.npz')\n"
            "for qt in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):\n"
            "    w=cpu.IBTensor.from_rows(cpu.QTensor(ib[qt.name+'_w'], qt, 192, 96)); X=ib[qt.name+'_x']\n"
            "    Y=np.empty((13,192),np.float32); cpu.matmul_t(w,X,Y,2)\n"
            "    assert np.array_equal(Y, ib[qt.name+'_y']), qt  # every path: the same bits\n"
            "    for t in range(13):\n"
            "        i=np.flatnonzero(X[t]).astype(np.int32)\n"
            "        assert np.array_equal(cpu.axpy_rows(w,X[t,i].copy(),i,np.empty(192,np.float32),3), Y[t])\n"
            "    gu=cpu.IBTensor.from_rows(cpu.QTensor(ib[qt.name+'_gu'], qt, 256, 64))\n"
            "    dn=cpu.IBTensor.from_rows(cpu.QTensor(ib[qt.name+'_dn'], qt, 64, 128))\n"
            "    for nt in (1, 2, 3):\n"
            "        x=ib[qt.name+'_x0'].copy()\n"
            "        cpu.decode_ffn_in(x,np.ones(64,np.float32),1e-5,gu,dn,None,0.3,None,0.05,True,nt)\n"
            "        # (the scalar build's rmsnorm dot sums in another order: rounding apart)\n"
            "        assert (np.array_equal(x, ib[qt.name+'_x1']) if cpu.simd_enabled() else\n"
            "                np.allclose(x, ib[qt.name+'_x1'], rtol=1e-4, atol=1e-4)), (qt, nt)\n"
            "# one-query attention (attend.h, this build's path) against the one-head loop's bits\n"
            "for nh,nkv,hd,na,dt in ((9,3,64,37,np.float16),(8,2,128,21,np.float32),(16,2,64,17,np.float16)):\n"
            "    q=rng.standard_normal((1,nh,hd)).astype(np.float32)\n"
            "    k=rng.standard_normal((na,nkv,hd)).astype(dt); v=rng.standard_normal((na,nkv,hd)).astype(dt)\n"
            "    got=np.empty((1,nh,hd),np.float32); cpu._k.attend_one(q[0],*cpu.kv_pair(k,v),na-1,got[0],2)\n"
            "    old=cpu._k.set_old_prefill(1); want=np.empty((1,nh,hd),np.float32)\n"
            "    cpu.attention(q,k,v,na-1,want,1); cpu._k.set_old_prefill(old)\n"
            "    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (nh, hd)\n"
            "x=np.load('f16.npy'); h=np.empty(x.size,np.uint16); cpu._k.f32_to_f16(x,h)\n"
            "want=x.astype(np.float16).view(np.uint16); nan=np.isnan(x)\n"
            "assert np.array_equal(h[~nan], want[~nan]) and np.isnan(h.view(np.float16)[nan]).all()\n"
            "act=np.empty(4099,np.float32); cpu._k.act_mul(ib['gu'], 1, act)\n"
            "assert np.array_equal(act, ib['act'])\n"
            "assert np.array_equal(cpu.gelu_tanh(ib['gu'], np.empty(8198, np.float32), 2), ib['gelu'])\n"
            "print(cpu.openmp_enabled(), cpu.simd_enabled(), ','.join(cpu.simd_features()))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=envv, check=True,
                         capture_output=True, text=True)
    omp, simd, feats = (res.stdout.split() + [""])[:3]
    if env == "PYINFER_NO_AVX512":
        assert simd == "True" and feats == "AVX2"
    elif env == "PYINFER_AVX2_VNNI":  # the 256-bit VNNI paths, no 512-bit one; the VEX form
        assert feats.split(",")[:2] == ["AVX2", "VNNI256"]  # where the CPU has AVX-VNNI
        assert ("AVX_VNNI" in feats.split(",")) == ("avx_vnni" in _cpu_flags())
    else:
        assert (omp if env == "PYINFER_NO_OPENMP" else simd) == "False"


# ------------------------------------------------------------------ fused one-token decode

def _gap_threshold(a):
    """A threshold in the widest gap between sorted |a| near the median, so that rounding
    differences between kernel and twin cannot move a neuron across it."""
    s = np.sort(np.abs(a))
    lo, hi = len(s) // 4, 3 * len(s) // 4
    i = lo + int(np.argmax(np.diff(s[lo:hi + 1])))
    return float((s[i] + s[i + 1]) / 2)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n_threads", THREADS)
def test_decode_attn(qtype, n_threads):
    rng = np.random.default_rng(int(qtype) * 10 + n_threads)
    n_embd, n_head, n_kv, hd, n_ctx, n_past = 64, 4, 2, 16, 12, 7
    if qtype in K_QUANTS:
        n_embd, hd = 256, 64
    ws = [_weight(rng, qtype, r, c) for r, c in ((n_head * hd, n_embd), (n_kv * hd, n_embd),
                                                 (n_kv * hd, n_embd), (n_embd, n_head * hd))]
    norm = _ro(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    caches = []
    for _ in range(2):
        k = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
        v = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
        caches.append((k, v))
    (k1, v1), (k2, v2) = caches
    k2[:], v2[:] = k1, v1
    k1[n_past:] = v1[n_past:] = np.nan  # the kernel writes row n_past and reads no row after it
    got = cpu.decode_attn(x0.copy(), norm, 1e-5, *ws, k1, v1, n_past, n_head, 1e4, n_threads)
    want = ref.decode_attn(x0.copy(), norm, 1e-5, *ws, k2, v2, n_past, n_head, 1e4)
    tol = 1e-3 if qtype in QUANT else 1e-5
    assert _rel(got, want) < tol
    # the f16 cache rows: values within tol may round to neighbouring halves (2^-10 apart)
    assert _rel(k1[n_past], k2[n_past]) < tol + 2**-10 and _rel(v1[n_past], v2[n_past]) < tol + 2**-10
    assert np.isnan(k1[n_past + 1:]).all()
    with pytest.raises(ValueError):
        cpu.decode_attn(x0.copy(), norm, 1e-5, *ws, k1, v1, n_ctx, n_head, 1e4, n_threads)


def test_decode_attn_window():
    """A sliding window reads the last W cache rows only: bit for bit the window's rows as a
    cache of their own; a window the position has not reached, however large (a file may store
    up to 2^32 - 1), is no window."""
    rng = np.random.default_rng(3)
    n_embd, n_head, n_kv, hd, n_ctx, n_past, w = 64, 4, 2, 16, 12, 9, 4
    ws = [_weight(rng, QT.F32, r, c) for r, c in ((n_head * hd, n_embd), (n_kv * hd, n_embd),
                                                  (n_kv * hd, n_embd), (n_embd, n_head * hd))]
    norm = _ro(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    k, v = (rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16) for _ in range(2))

    def run(window, kc, vc, pos):
        kc, vc = kc.copy(), vc.copy()
        return cpu.decode_attn(x0.copy(), norm, 1e-5, *ws, kc, vc, pos, n_head, 1e4, 1,
                               window=window)

    # RoPE turns by the position: the window's rows as their own cache, at the same position,
    # need a cache that long; pad in front with rows the window must never read (NaN)
    k2, v2 = np.full_like(k, np.nan), np.full_like(v, np.nan)
    k2[n_past + 1 - w:n_past] = k[n_past + 1 - w:n_past]
    v2[n_past + 1 - w:n_past] = v[n_past + 1 - w:n_past]
    got = run(w, k, v, n_past)
    np.testing.assert_array_equal(got, run(w, k2, v2, n_past))
    assert np.isfinite(got).all() and not np.array_equal(got, run(0, k, v, n_past))
    k3 = k.copy()
    k3[n_past + 1 - w] = np.nan  # the window's first row is read (a window one short passes above)
    assert np.isnan(run(w, k3, v, n_past)).all()
    for big in (n_past + 1, n_ctx, 2**31 + 5, 2**32 - 1):
        np.testing.assert_array_equal(run(big, k, v, n_past), run(0, k, v, n_past))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("mode,silu", [(cpu.FFN_DENSE, True), (cpu.FFN_DENSE, False),
                                       (cpu.FFN_GLU, True), (cpu.FFN_ACT, True),
                                       (cpu.FFN_ACT, False)])
def test_decode_ffn(qtype, n_threads, mode, silu):
    """Every mode against the twin; active sets empty, one, about half and all; the down
    projection gathered (dense_above 1) or streamed with zeros (dense_above 0)."""
    rng = np.random.default_rng(int(qtype) + 7 * n_threads + 31 * mode)
    n_embd, n_ff = (256 if qtype in K_QUANTS else 64), 96
    gate, up, down = (_weight(rng, qtype, n_ff, n_embd) for _ in range(3))
    norm = _ro(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    h = ref.rmsnorm(x0[None], norm, 1e-5, np.empty((1, n_embd), np.float32))[0]
    a = ref._act(ref.dequantize(gate) @ ref._dot_input(gate, h), silu)
    if mode == cpu.FFN_GLU:
        a = a * (ref.dequantize(up) @ ref._dot_input(up, h))
    top = np.sort(np.abs(a))
    thresholds = [1e30, float((top[-1] + top[-2]) / 2), _gap_threshold(a), -1.0]
    tol = 1e-3 if qtype in QUANT else 1e-5
    for thr in thresholds if mode != cpu.FFN_DENSE else [0.0]:
        want_x = x0.copy()
        want_n = ref.decode_ffn(want_x, norm, 1e-5, gate, up, down, mode, silu, thr)
        for dense_above in (1.0, 0.0):
            got_x = x0.copy()
            n = cpu.decode_ffn(got_x, norm, 1e-5, gate, up, down, mode, silu, thr, n_threads,
                               dense_above)
            assert n == want_n
            assert np.abs(got_x - want_x).max() <= tol * (1 + np.abs(want_x - x0).max())
    if mode != cpu.FFN_DENSE:
        assert [ref.decode_ffn(x0.copy(), norm, 1e-5, gate, up, down, mode, silu, t)
                for t in thresholds[:2]] == [0, 1]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("silu", [True, False])
def test_decode_ffn_rows(qtype, n_threads, silu):
    """The dense FFN over ffn_down in row layout (n_embd, n_ff) against the twin, and against the
    unfused kernels it replaces (rmsnorm, matvec, silu_mul / relu_mul, matvec): the same bits."""
    rng = np.random.default_rng(int(qtype) + 7 * n_threads + 3 * silu)
    n_embd, n_ff = (256, 512) if qtype in K_QUANTS else (64, 96)
    gate, up = (_weight(rng, qtype, n_ff, n_embd) for _ in range(2))
    down = _weight(rng, qtype, n_embd, n_ff)
    norm = _ro(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    want_x = x0.copy()
    ref.decode_ffn_rows(want_x, norm, 1e-5, gate, up, down, silu)
    got_x = x0.copy()
    cpu.decode_ffn_rows(got_x, norm, 1e-5, gate, up, down, silu, n_threads)
    tol = 1e-3 if qtype in QUANT else 1e-5
    assert np.abs(got_x - want_x).max() <= tol * (1 + np.abs(want_x - x0).max())
    h = np.empty((1, n_embd), np.float32)
    cpu.rmsnorm(x0[None], norm, 1e-5, h)
    g, u, y = np.empty(n_ff, np.float32), np.empty(n_ff, np.float32), np.empty(n_embd, np.float32)
    cpu.matvec(gate, h[0], g, n_threads)
    cpu.matvec(up, h[0], u, n_threads)
    (cpu.silu_mul if silu else cpu.relu_mul)(g, u, g)
    cpu.matvec(down, g, y, n_threads)
    np.testing.assert_array_equal(got_x, x0 + y)
    with pytest.raises(ValueError):  # ffn_down_t's shape (n_ff, n_embd) is not the row layout
        cpu.decode_ffn_rows(x0.copy(), norm, 1e-5, gate, up, _weight(rng, qtype, n_ff, n_embd),
                            silu, n_threads)


# ------------------------------------------------------------------ input sparsity (TEAL / WINA)

@pytest.mark.parametrize("with_scale", [False, True])
def test_select_inputs(with_scale):
    rng = np.random.default_rng(5 + with_scale)
    x = _rand(rng, 300)
    scale = _ro(rng.uniform(0.1, 3.0, 300).astype(np.float32)) if with_scale else None
    for thr in (-1.0, 0.0, _gap_threshold(np.abs(x) * (1 if scale is None else scale)), 1e30):
        got_c, got_i = _nan(300), np.full(300, -7, np.int32)
        want_c, want_i = np.zeros(300, np.float32), np.zeros(300, np.int32)
        n = cpu.select_inputs(x, scale, thr, got_c, got_i)
        assert n == ref.select_inputs(x, scale, thr, want_c, want_i)
        np.testing.assert_array_equal(got_i[:n], want_i[:n])
        np.testing.assert_array_equal(got_c[:n], want_c[:n])
    assert cpu.select_inputs(x, scale, -1.0, got_c, got_i) == 300
    assert cpu.select_inputs(x, scale, 1e30, got_c, got_i) == 0


def _in_thresholds(v, scale):
    """Thresholds for a selection on |v| * scale: none kept, one, about half (at a gap), all."""
    s = np.unique(np.abs(v) * (1 if scale is None else scale))  # sorted, ties merged
    return [1e30, float((s[-1] + s[-2]) / 2), _gap_threshold(s), -1.0]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
def test_decode_ffn_in(qtype, with_scale):
    """Against the twin at four thresholds per selection; the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(int(qtype) + 3 * with_scale)
    n_embd, n_ff = (256, 128) if qtype in K_QUANTS else (64, 96)  # rows of whole blocks
    gate_up = _weight(rng, qtype, n_embd, 2 * n_ff)
    down = _weight(rng, qtype, n_ff, n_embd)
    norm = _ro(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    s_gu = _ro(rng.uniform(0.2, 2.0, n_embd).astype(np.float32)) if with_scale else None
    s_d = _ro(rng.uniform(0.2, 2.0, n_ff).astype(np.float32)) if with_scale else None
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    h = ref.rmsnorm(x0[None], norm, 1e-5, np.empty((1, n_embd), np.float32))[0]
    for t_gu in _in_thresholds(h, s_gu):
        k = np.abs(h) * (1 if s_gu is None else s_gu) > t_gu
        gu = h[k] @ ref.dequantize(gate_up)[k]
        a = ref._act(gu[:n_ff], True) * gu[n_ff:]
        for t_d in _in_thresholds(a, s_d) if k.any() else [-1.0]:
            want_x = x0.copy()
            want_n = ref.decode_ffn_in(want_x, norm, 1e-5, gate_up, down, s_gu, t_gu, s_d, t_d, True)
            outs = []
            for n_threads in THREADS:
                got_x = x0.copy()
                assert cpu.decode_ffn_in(got_x, norm, 1e-5, gate_up, down, s_gu, t_gu, s_d, t_d,
                                         True, n_threads) == want_n
                _close(got_x, want_x, qtype)
                outs.append(got_x)
            np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError):
        cpu.decode_ffn_in(x0.copy(), norm, 1e-5, down, down, None, 0.0, None, 0.0, True)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
def test_decode_attn_in(qtype, with_scale):
    rng = np.random.default_rng(40 + int(qtype) + 3 * with_scale)
    n_embd, n_head, n_kv, hd, n_ctx, n_past = 64, 4, 2, 16, 12, 7
    if qtype in K_QUANTS:
        n_embd, hd = 256, 64
    nq, nkv = n_head * hd, n_kv * hd
    # small q/k weights: scores of order 1, so no softmax saturates onto one cached row
    qkv = cpu.QTensor.from_array(0.1 * rng.standard_normal((n_embd, nq + 2 * nkv)), qtype)
    wo = _weight(rng, qtype, nq, n_embd)
    norm = _ro(rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
    s_q = _ro(rng.uniform(0.2, 2.0, n_embd).astype(np.float32)) if with_scale else None
    s_o = _ro(rng.uniform(0.2, 2.0, nq).astype(np.float32)) if with_scale else None
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    k0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
    v0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
    h = ref.rmsnorm(x0[None], norm, 1e-5, np.empty((1, n_embd), np.float32))[0]
    for t_q in _in_thresholds(h, s_q)[1:]:
        # the attention output of the reference decides the o thresholds
        kc, vc = k0.copy(), v0.copy()
        ref.decode_attn_in(x0.copy(), norm, 1e-5, qkv, wo, kc, vc, n_past, n_head, 1e4, s_q, t_q,
                           None, 1e30)
        q = np.zeros((1, n_head, hd), np.float32)
        kk = np.abs(h) * (1 if s_q is None else s_q) > t_q
        q[0] = (h[kk] @ ref.dequantize(qkv)[kk])[:nq].reshape(n_head, hd)
        ref.rope_neox(q, [n_past], 1e4, hd)
        att = ref.attention(q, kc, vc, n_past, np.empty_like(q)).reshape(-1)
        for t_o in _in_thresholds(att, s_o):
            kw, vw = k0.copy(), v0.copy()
            want_x = x0.copy()
            want_n = ref.decode_attn_in(want_x, norm, 1e-5, qkv, wo, kw, vw, n_past, n_head, 1e4,
                                        s_q, t_q, s_o, t_o)
            outs = []
            for n_threads in THREADS:
                kg, vg = k0.copy(), v0.copy()
                kg[n_past:] = vg[n_past:] = np.nan
                got_x = x0.copy()
                assert cpu.decode_attn_in(got_x, norm, 1e-5, qkv, wo, kg, vg, n_past, n_head, 1e4,
                                          s_q, t_q, s_o, t_o, n_threads) == want_n
                # the new K/V row may round to neighbouring halves here and there (_close_kv):
                # one f16 step of that row moves the output by up to about 2^-11 of its scale
                np.testing.assert_allclose(got_x, want_x, rtol=1e-4,
                                           atol=(1e-4 + 2**-11) * (1 + np.abs(want_x).max()))
                _close_kv(kg[n_past], kw[n_past], qtype)
                _close_kv(vg[n_past], vw[n_past], qtype)
                assert np.isnan(kg[n_past + 1:]).all()
                outs.append(got_x)
            np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_nan_input_gives_nan_outputs(qtype):
    """A NaN activation (or AXPY coefficient) anywhere but a block's last place came out of the
    quantized kernels as finite garbage (about 1e8): the 8-bit quantizer's max |x| (max_ps)
    dropped it, so Engine._check_finite could not see a broken model. NumPy's float products,
    and the f32/f16 kernels, give NaN; now every type does, and a prefill's other tokens keep
    their own numbers."""
    rng = np.random.default_rng(11)
    cols = 2 * _block(qtype) if qtype in QUANT else 64
    w = _weight(rng, qtype, rows=24, cols=cols)
    x = _rand(rng, 5, cols)
    clean = cpu.matmul(w, x, _nan((5, 24)), 1)
    for pos in (0, 3, 8, cols - 1):
        xn = np.array(x)
        xn[2, pos] = np.nan
        assert np.isnan(cpu.matvec(w, xn[2], _nan(24), 1)).all(), pos
        got = cpu.matmul(w, _ro(xn), _nan((5, 24)), 2)
        assert np.isnan(got[2]).all(), pos
        np.testing.assert_array_equal(np.delete(got, 2, 0), np.delete(clean, 2, 0))
        idx = np.array([1, 5, 7], np.int32)
        assert np.isnan(cpu.gather_matvec(w, xn[2], idx, _nan(3), 1)).all(), pos
    coef = np.ones(24, np.float32)
    coef[4] = np.nan
    idx = np.arange(24, dtype=np.int32)
    assert np.isnan(cpu.axpy_rows(w, coef, idx, _nan(cols), 1)).all()
    assert np.isnan(cpu.matvec_t(w, coef, _nan(cols), 1)).all()
    a = np.ones((3, 24), np.float32)
    a[1, 4] = np.nan
    got = cpu.matmul_t(w, a, _nan((3, cols)), 1)
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()
    if cpu.ib_supported(qtype, 64, 64):  # sparse mode input's layout (rows = input channels)
        ib = cpu.IBTensor.from_rows(_weight(rng, qtype, rows=64, cols=64))
        c = np.ones(64, np.float32)
        c[5] = np.nan
        assert np.isnan(cpu.axpy_rows(ib, c, np.arange(64, dtype=np.int32), _nan(64), 1)).all()


def test_gelu_tanh_against_torch():
    """cpu.gelu_tanh (Gemma's GeGLU activation, f32 as g * sigmoid(2t)) against torch's
    gelu(approximate="tanh") in f64: within 2e-6 relative where |GELU| > 1e-6 (torch's own f32
    form is 7e-2 off near g = -5, where 1 + tanh t cancels), 1e-11 absolute below; torch's
    values at 0, +-inf, NaN and huge magnitudes; a value's bits do not depend on where it sits
    or on the threads (test_build_variants: nor on the build)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=20000) * 3, rng.normal(size=1000) * 30,
                        np.linspace(-60, 60, 20001)]).astype(np.float32)
    got = cpu.gelu_tanh(x, np.empty_like(x)).astype(np.float64)
    want = torch.nn.functional.gelu(torch.from_numpy(x.astype(np.float64)),
                                    approximate="tanh").numpy()
    big = np.abs(want) > 1e-6
    assert (np.abs(got - want)[big] / np.abs(want[big])).max() < 2e-6
    assert np.abs(got - want)[~big].max() < 1e-11
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 3e38, -3e38, np.inf, -np.inf,
                        np.nan], np.float32)
    want_s = torch.nn.functional.gelu(torch.from_numpy(special), approximate="tanh").numpy()
    np.testing.assert_array_equal(cpu.gelu_tanh(special, np.empty_like(special)), want_s)
    for n, off in ((1, 0), (7, 3), (9, 5), (2049, 1)):
        seg = x[off:off + n].copy()
        np.testing.assert_array_equal(cpu.gelu_tanh(seg, seg), got[off:off + n].astype(np.float32))
    for n_threads in (2, 3):  # 4096-value pieces over threads
        np.testing.assert_array_equal(cpu.gelu_tanh(x, np.empty_like(x), n_threads),
                                      got.astype(np.float32))
