"""The input-block layout of input-sparse q8_0 / q4_0 / q4_1 projections (cython/ibsum.h, issue
12): the regrouping is a pure permutation of gguf's row-major quantization, the sum over the kept
input channels is the int8 GEMV of the masked input (q8_0 and q4_1: the project's GEMV bit for
bit; all within the int8-activation bound of the exact product of gguf's dequantized weights),
the same bits at any thread count, prefill equals decode, and the converter writes it."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from convert.cli import convert
from convert.cli import main as convert_main
from pyinfer import constants as C
from pyinfer.config import read_field
from pyinfer.engine import Engine
from pyinfer.errors import PyinferError
from pyinfer.ops import cpu
from pyinfer.ops import reference as ref
from tests._models import load_hf_state_dict, make_random_llama
from tests.test_input_sparse import reference_logits

QT = gguf.GGMLQuantizationType
TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
BLOCK_BYTES = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q5_1: 24}  # ggml's
MIN_TYPES = (QT.Q4_1, QT.Q5_1)  # w = d u + m
SHAPES = [(64, 32), (192, 96), (960, 576), (576, 1536)]  # (n_out, n_in)


def _pair(rng, qtype, n_out, n_in):
    """(row-major QTensor W (n_out, n_in), its IBTensor) from gguf's quantizer"""
    w = cpu.QTensor.from_array(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype)
    return w, cpu.IBTensor.from_rows(w)


def _kept(rng, x, frac):
    """(idx int32 ascending, coef) of a random fraction of x's channels"""
    idx = np.sort(rng.choice(x.size, int(round(frac * x.size)), replace=False)).astype(np.int32)
    return idx, np.ascontiguousarray(x[idx])


def _exact_and_bound(w, x):
    """gguf's dequantization of W times x in float64, and the int8-activation error bound per
    output: sum over 32-channel blocks b of (max_b |x| / 127 / 2) * sum_{j in b} |W[i, j]|"""
    deq = gguf.quants.dequantize(w.raw, w.qtype).reshape(w.rows, w.cols).astype(np.float64)
    xb = np.abs(x.astype(np.float64)).reshape(-1, 32)
    half_step = xb.max(1) / 127.0 / 2  # (nb,)
    bound = (np.abs(deq).reshape(w.rows, -1, 32) * (xb > 0)).sum(2) @ half_step
    return deq @ x.astype(np.float64), bound


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layout_is_a_permutation_of_the_row_major_blocks(qtype, shape):
    rng = np.random.default_rng(int(qtype) + shape[0])
    w, ib = _pair(rng, qtype, *shape)
    n_out, n_in = shape
    assert ib.raw.shape == (n_in // 32, BLOCK_BYTES[qtype] * n_out)
    np.testing.assert_array_equal(ib.to_rows().raw, w.raw)
    # every byte (or nibble) of the blocks lands somewhere: same multiset of scale words (and of
    # q4_1's min words)
    blocks = w.raw.reshape(n_out, n_in // 32, -1)
    for o in range(0, 4 if qtype in MIN_TYPES else 2, 2):
        d_rows = np.sort(blocks[:, :, o:o + 2].copy().view(np.uint16).ravel())
        d_ib = np.sort(ib.raw[:, o * n_out:(o + 2) * n_out].copy().view(np.uint16).ravel())
        np.testing.assert_array_equal(d_rows, d_ib)
    # the NumPy twin's W^T is gguf's dequantization transposed
    np.testing.assert_array_equal(
        ref.dequantize(ib), gguf.quants.dequantize(w.raw, qtype).reshape(n_out, n_in).T)


def test_layout_refuses_shapes_and_data():
    rng = np.random.default_rng(0)
    w = cpu.QTensor.from_array(rng.standard_normal((96, 64)).astype(np.float32), QT.Q8_0)
    assert not cpu.ib_supported(QT.Q8_0, 96, 64) and not cpu.ib_supported(QT.Q5_K, 64, 256)
    assert not cpu.ib_supported(QT.Q4_K, 64, 256) and cpu.ib_supported(QT.Q4_1, 64, 64)
    with pytest.raises(ValueError, match="input-block"):
        cpu.ib_from_rows(w.raw, QT.Q8_0, 96, 64)
    with pytest.raises(ValueError, match="does not hold"):
        cpu.IBTensor(np.zeros((2, 100), np.uint8), cpu.Q8_0_IB, 64, 64)
    w, ib = _pair(rng, QT.Q8_0, 64, 64)
    with pytest.raises(ValueError, match="ascending"):
        cpu.axpy_rows(ib, np.ones(2, np.float32), np.array([5, 3], np.int32), np.zeros(64, np.float32))
    with pytest.raises(IndexError):
        cpu.axpy_rows(ib, np.ones(1, np.float32), np.array([64], np.int32), np.zeros(64, np.float32))
    with pytest.raises(ValueError):
        cpu.matvec_t(ib, np.ones(64, np.float32), np.zeros(64, np.float32))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_sum_of_kept_channels(qtype, shape):
    """Against gguf's dequantized product of the masked input (the int8-activation bound), the
    GEMV of the masked input (q8_0 and q4_1: the same bits), and the same bits at 1, 2, 3 and 5
    threads."""
    rng = np.random.default_rng(7 * int(qtype) + shape[1])
    w, ib = _pair(rng, qtype, *shape)
    x = rng.standard_normal(shape[1]).astype(np.float32)
    for frac in (0.0, 0.03, 0.5, 0.7, 1.0):
        idx, coef = _kept(rng, x, frac)
        xm = np.zeros_like(x)
        xm[idx] = coef
        outs = []
        for n_threads in (1, 2, 3, 5):
            out = np.full(shape[0], np.nan, np.float32)
            cpu.axpy_rows(ib, coef, idx, out, n_threads)
            outs.append(out)
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        got = outs[0].astype(np.float64)
        exact, bound = _exact_and_bound(w, xm)
        slack = 1e-5 * (np.abs(exact).max(initial=0) + 1)
        assert np.all(np.abs(got - exact) <= bound + slack), frac
        gemv = cpu.matvec(w, xm, np.empty(shape[0], np.float32), 1)
        if qtype in (QT.Q8_0, *MIN_TYPES):
            np.testing.assert_array_equal(outs[0], gemv)
        else:  # q4_0: the offset 8 comes off in the integers here, in f32 in the GEMV
            np.testing.assert_allclose(outs[0], gemv, rtol=1e-5, atol=1e-5 * (np.abs(gemv).max(initial=0) + 1))
        if frac == 0.0:
            assert not outs[0].any()
        # and the NumPy twin (the GEMV's quantized activation)
        np.testing.assert_allclose(got, ref.axpy_rows(ib, coef, idx, np.empty(shape[0], np.float32)),
                                   rtol=1e-5, atol=1e-5 * (np.abs(exact).max(initial=0) + 1))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", [(4096, 64), (2048, 96), (3072, 32), (16384, 32)])
def test_padded_layout_has_the_same_bits(qtype, shape):
    """Where a value row would be a multiple of 2 KiB long (q8_0: n_out bytes; q4_0/q4_1: n_out
    / 2; q5_0/q5_1: 5 n_out / 8) a file appends 64 zero outputs (cpu.ib_pad_outs; ibsum.h reads the rows' pitch from the
    block bytes): the padded layout holds the same numbers, and its kept-channel sums (1, 2, 3
    threads) and batched products have the unpadded layout's bits; other shapes get none."""
    rng = np.random.default_rng(int(qtype) + shape[0])
    w, ib = _pair(rng, qtype, *shape)
    row = {QT.Q8_0: shape[0], QT.Q5_0: shape[0] * 5 // 8, QT.Q5_1: shape[0] * 5 // 8}.get(qtype, shape[0] // 2)
    pad = cpu.ib_pad_outs(qtype, shape[0])
    assert pad == (64 if row % 2048 == 0 else 0)
    padded = cpu.IBTensor.from_rows(w, pad=True)
    assert padded.layout_cols == shape[0] + pad
    assert padded.raw.shape == (shape[1] // 32, BLOCK_BYTES[qtype] * (shape[0] + pad))
    np.testing.assert_array_equal(padded.to_rows().raw, w.raw)
    x = rng.standard_normal(shape[1]).astype(np.float32)
    for frac in (0.03, 0.5, 1.0):
        idx, coef = _kept(rng, x, frac)
        want = cpu.axpy_rows(ib, coef, idx, np.full(shape[0], np.nan, np.float32), 1)
        for n_threads in (1, 2, 3):
            got = cpu.axpy_rows(padded, coef, idx, np.full(shape[0], np.nan, np.float32), n_threads)
            np.testing.assert_array_equal(got, want)
    a = rng.standard_normal((9, shape[1])).astype(np.float32)
    a[:, rng.random(shape[1]) < 0.4] = 0.0
    want = cpu.matmul_t(ib, a, np.empty((9, shape[0]), np.float32), 2)
    np.testing.assert_array_equal(cpu.matmul_t(padded, a, np.empty((9, shape[0]), np.float32), 2), want)


def test_converter_pads_aliasing_rows(tmp_path):
    """A q8_0 model whose gate/up has 2048 outputs (value rows of 2 KiB) stores that matrix with
    64 zero outputs appended, the others as they are; its decode (one kernel call a token) has
    the bits of the same weights unpadded, and its logits follow the masked float64 reference
    within the quantization error."""
    d = make_random_llama(tmp_path / "hf", hidden_act="silu", tokenizer="bpe", hidden_size=128,
                          intermediate_size=1024, n_heads=2, n_kv_heads=1, n_layers=2, name="pad")
    out = str(tmp_path / "pad.q8_0.gguf")
    assert convert_main([d, out, "--outtype", "q8_0", "--target-sparsity", "0.3", "--sparse-mode",
                         "input", "--sparse-alloc", "uniform", "--calib-tokens", "128", "-t", "1"]) == 0
    shapes = {t.name: tuple(int(v) for v in t.shape[::-1]) for t in gguf.GGUFReader(out).tensors}
    assert shapes[C.IB["ffn_gate_up"].format(bid=0)] == (128 // 32, 32 * (2048 + 64))
    assert shapes[C.IB["ffn_down"].format(bid=0)] == (1024 // 32, 32 * 128)
    eng = Engine(out, n_ctx=64, n_threads=2)
    gu = eng.weights.layers[0].ffn_gate_up_t
    assert isinstance(gu, cpu.IBTensor) and (gu.cols, gu.layout_cols) == (2048, 2112)
    tokens = np.random.default_rng(3).integers(3, eng.cfg.n_vocab, 16).tolist()
    got = eng.model.forward(tokens, 0, all_logits=True)
    steps = {}
    for padded in (True, False):
        if not padded:  # the same numbers in the unpadded layout
            for lw in eng.weights.layers:
                lw.ffn_gate_up_t = cpu.IBTensor.from_rows(lw.ffn_gate_up_t.to_rows())
                assert lw.ffn_gate_up_t.layout_cols == 2048
            eng.model.ffn._plan = None  # the whole-token plan holds the tensors' pointers
        eng.reset()
        steps[padded] = np.stack([eng.eval_token(t) for t in tokens])
    np.testing.assert_array_equal(steps[True], steps[False])
    np.testing.assert_allclose(steps[True][:8], got[:8], rtol=1e-4, atol=1e-4 * np.abs(got).max())
    want = reference_logits(load_hf_state_dict(d), eng.cfg, tokens, eng.model.ffn.thr, None,
                            (eng.model.ffn.lm_head_thr, None))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


@pytest.mark.parametrize("qtype", TYPES)
def test_prefill_equals_decode(qtype):
    """matmul_t over masked rows (dropped channels 0) gives each token decode's bits."""
    rng = np.random.default_rng(3 + int(qtype))
    w, ib = _pair(rng, qtype, 192, 96)
    X = rng.standard_normal((7, 96)).astype(np.float32)
    X[rng.random(X.shape) < 0.4] = 0.0
    X[3] = 0.0  # a token with nothing kept
    for n_threads in (1, 2, 3):
        out = np.full((7, 192), np.nan, np.float32)
        cpu.matmul_t(ib, X, out, n_threads)
        for t in range(7):
            idx = np.flatnonzero(X[t]).astype(np.int32)
            one = cpu.axpy_rows(ib, np.ascontiguousarray(X[t, idx]), idx,
                                np.empty(192, np.float32), 1)
            np.testing.assert_array_equal(out[t], one)
    np.testing.assert_allclose(out, ref.matmul_t(ib, X, np.empty_like(out)), rtol=1e-5,
                               atol=1e-5 * np.abs(out).max())



@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n_tok", [1, 5, 6, 7, 13])
def test_prefill_chunks_equal_decode(qtype, n_tok):
    """The GEMM prefill (chunks of up to 6 tokens; whole blocks unpacked once per tile when there
    is more than one chunk) gives each token decode's bits for token counts around the chunk
    size, with blocks where a token kept nothing, and groups of four channels that no token of a
    chunk kept (skipped), at 1-3 threads."""
    rng = np.random.default_rng(40 + n_tok + int(qtype))
    n_out, n_in = 320, 128
    w, ib = _pair(rng, qtype, n_out, n_in)
    X = (rng.standard_normal((n_tok, n_in)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    X[rng.random(X.shape) < 0.3] = 0.0
    X[:, 8:16] = 0.0             # groups 2-3 of block 0: nobody's
    X[::2, 32:64] = 0.0          # block 1 empty for every other token
    X[-1, :] = 0.0 if n_tok > 1 else X[-1, :]
    for n_threads in (1, 2, 3):
        out = np.full((n_tok, n_out), np.nan, np.float32)
        cpu.matmul_t(ib, X, out, n_threads)
        for t in range(n_tok):
            idx = np.flatnonzero(X[t]).astype(np.int32)
            one = cpu.axpy_rows(ib, np.ascontiguousarray(X[t, idx]), idx,
                                np.empty(n_out, np.float32), 1)
            np.testing.assert_array_equal(out[t], one)
    np.testing.assert_allclose(out, ref.matmul_t(ib, X, np.empty_like(out)), rtol=1e-5,
                               atol=1e-5 * np.abs(out).max())

def _gap(a):
    s = np.sort(np.abs(a))
    lo, hi = len(s) // 4, 3 * len(s) // 4
    i = lo + int(np.argmax(np.diff(s[lo:hi + 1])))
    return float((s[i] + s[i + 1]) / 2)


@pytest.mark.parametrize("qtype", TYPES)
def test_fused_half_layers(qtype):
    """decode_ffn_in and decode_attn_in over input-block weights against the NumPy twin (the
    int8 GEMV of the masked inputs), at thresholds in wide gaps; the same bits at 1-3 threads."""
    rng = np.random.default_rng(11 + int(qtype))
    n_embd, n_ff, n_head, n_kv, hd, n_ctx, n_past = 128, 256, 2, 1, 64, 9, 5
    nq, nkv = n_head * hd, n_kv * hd
    gu = cpu.IBTensor.from_rows(cpu.QTensor.from_array(rng.standard_normal((2 * n_ff, n_embd)), qtype))
    down = cpu.IBTensor.from_rows(cpu.QTensor.from_array(rng.standard_normal((n_embd, n_ff)), qtype))
    qkv = cpu.IBTensor.from_rows(cpu.QTensor.from_array(0.1 * rng.standard_normal((nq + 2 * nkv, n_embd)), qtype))
    wo = cpu.IBTensor.from_rows(cpu.QTensor.from_array(rng.standard_normal((n_embd, nq)), qtype))
    norm = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    h = ref.rmsnorm(x0[None], norm, 1e-5, np.empty((1, n_embd), np.float32))[0]
    t_in = _gap(h)
    g_u = ref.quantize_act_q8(np.where(np.abs(h) > t_in, h, 0).astype(np.float32)) @ ref.dequantize(gu)
    a = ref._act(g_u[:n_ff], True) * g_u[n_ff:]
    for t_d in (-1.0, _gap(a), 1e30):
        want = x0.copy()
        n_want = ref.decode_ffn_in(want, norm, 1e-5, gu, down, None, t_in, None, t_d, True)
        outs = []
        for n_threads in (1, 2, 3):
            got = x0.copy()
            assert cpu.decode_ffn_in(got, norm, 1e-5, gu, down, None, t_in, None, t_d, True,
                                     n_threads) == n_want
            outs.append(got)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
    k0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
    v0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
    for t_o in (-1.0, 1e30):
        kw, vw, want = k0.copy(), v0.copy(), x0.copy()
        n_want = ref.decode_attn_in(want, norm, 1e-5, qkv, wo, kw, vw, n_past, n_head, 1e4, None,
                                    t_in, None, t_o)
        outs = []
        for n_threads in (1, 2, 3):
            kc, vc, got = k0.copy(), v0.copy(), x0.copy()
            assert cpu.decode_attn_in(got, norm, 1e-5, qkv, wo, kc, vc, n_past, n_head, 1e4, None,
                                      t_in, None, t_o, n_threads) == n_want
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
            np.testing.assert_allclose(kc, kw, rtol=1e-4, atol=1e-4 * np.abs(kw).max())
            outs.append(got)
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    # every projection's outputs a multiple of 64 and inputs of 32: the layout applies to all
    return make_random_llama(tmp_path_factory.mktemp("ib"), hidden_act="silu", tokenizer="bpe",
                             hidden_size=128, intermediate_size=256, n_heads=2, n_kv_heads=1,
                             n_layers=2, name="ib")


def test_gguf_source_with_auto_outtype(wide_dir, tmp_path):
    """A q4_0 GGUF source converted in sparse mode input with the default ``--outtype auto``
    keeps each projection's source type (q4_0, so the input-block layout) where session 13's
    first try on the 7B-shaped file ended in a KeyError traceback; the same matrices as
    converting the HF source to q4_0 directly."""
    src = str(tmp_path / "src.q4_0.gguf")
    assert convert_main([wide_dir, src, "--outtype", "q4_0", "--dense"]) == 0
    out = str(tmp_path / "auto.gguf")
    args = ["--target-sparsity", "0.4", "--sparse-mode", "input", "--sparse-alloc", "uniform",
            "--calib-tokens", "128", "-t", "1"]
    assert convert_main([src, out, *args]) == 0
    ref = str(tmp_path / "direct.gguf")
    assert convert_main([src, ref, "--outtype", "q4_0", *args]) == 0
    got = {t.name: t for t in gguf.GGUFReader(out).tensors}
    want = {t.name: t for t in gguf.GGUFReader(ref).tensors}
    for i in range(2):
        for g in C.IN_GROUPS:
            name = C.IB[g].format(bid=i)
            assert got[name].tensor_type == gguf.GGMLQuantizationType.Q4_0
            np.testing.assert_array_equal(got[name].data, want[name].data)


@pytest.mark.parametrize("mode", ["input", "glu"])
def test_down_type_in_sparse_modes(wide_dir, tmp_path, mode):
    """``--down-type q8_0`` beside ``--outtype q4_0`` reaches the down projection of a sparse
    file (until session 31 only the staging file took it: sparse mode input stored ffn_down_ib
    at q4_0, glu ffn_down_t): the down projection is q8_0, its bytes those of the same
    conversion at ``--outtype q8_0`` (round-to-nearest from the same floats), every other
    projection q4_0; the file runs."""
    args = ["--target-sparsity", "0.4", "--sparse-mode", mode, "--calib-tokens", "128", "-t", "1",
            *(["--sparse-alloc", "uniform"] if mode == "input" else [])]
    out = str(tmp_path / "d8.gguf")
    assert convert_main([wide_dir, out, "--outtype", "q4_0", "--down-type", "q8_0", *args]) == 0
    ref8 = str(tmp_path / "q8.gguf")
    assert convert_main([wide_dir, ref8, "--outtype", "q8_0", *args]) == 0
    got = {t.name: t for t in gguf.GGUFReader(out).tensors}
    want = {t.name: t for t in gguf.GGUFReader(ref8).tensors}
    QT = gguf.GGMLQuantizationType
    for i in range(2):
        if mode == "input":
            down = C.IB["ffn_down"].format(bid=i)
            rest = [C.IB[g].format(bid=i) for g in C.IN_GROUPS if g != "ffn_down"]
        else:
            down = C.FFN_DOWN_T.format(bid=i)
            rest = [t.format(bid=i) for t in (C.ATTN_Q, C.ATTN_K, C.ATTN_V, C.ATTN_OUT,
                                              C.FFN_GATE, C.FFN_UP)]
        assert got[down].tensor_type == QT.Q8_0
        np.testing.assert_array_equal(got[down].data, want[down].data)
        assert {got[n].tensor_type for n in rest} == {QT.Q4_0}
    eng = Engine(out, n_ctx=32, n_threads=1)
    assert np.isfinite(eng.model.forward([3, 4, 5], 0)).all()
    if mode == "input":  # an input-mode file is not a source (its rows are by input channel)
        with pytest.raises(PyinferError, match="re-converting a sparse mode input file"):
            convert(out, str(tmp_path / "again.gguf"), "q8_0", progress=False)


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0", "q4_1"])
def test_converter_writes_the_layout(wide_dir, tmp_path, outtype):
    """A q8_0 / q4_0 / q4_1 input-sparse file stores the four matrices in the input-block layout (and
    no transposed copies); prefill agrees with token-by-token decode (their projections give the
    same bits, test_prefill_equals_decode; attention and norms are batched differently); the logits follow the masked
    float64 reference (transformers' weights) within the quantization error, and (q8_0) the
    masks matter more than that error."""
    out = str(tmp_path / f"ib.{outtype}.gguf")
    assert convert_main([wide_dir, out, "--outtype", outtype, "--target-sparsity", "0.4",
                         "--sparse-mode", "input", "--sparse-alloc", "uniform", "--calib-tokens",
                         "128", "-t", "1"]) == 0
    r = gguf.GGUFReader(out)
    names = {t.name: t for t in r.tensors}
    for i in range(2):
        for g in C.IN_GROUPS:
            t = names[C.IB[g].format(bid=i)]
            assert gguf.GGMLQuantizationType(t.tensor_type).name.lower() == outtype
        for gone in (C.ATTN_QKV_T, C.ATTN_OUT_T, C.FFN_GATE_UP_T, C.FFN_DOWN_T, C.ATTN_Q, C.FFN_UP):
            assert gone.format(bid=i) not in names
    eng = Engine(out, n_ctx=64, n_threads=2)
    assert all(isinstance(lw.ffn_gate_up_t, cpu.IBTensor) and isinstance(lw.ffn_down_t, cpu.IBTensor)
               for lw in eng.weights.layers)
    cfg = eng.cfg
    tokens = np.random.default_rng(2).integers(3, cfg.n_vocab, 20).tolist()
    eng.reset_stats()
    got = eng.model.forward(tokens, 0, all_logits=True)
    assert 0.2 < eng.ffn_sparsity() < 0.6
    eng.reset()
    steps = np.stack([eng.eval_token(t) for t in tokens])
    np.testing.assert_allclose(steps, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())
    thr = eng.model.ffn.thr
    sd = load_hf_state_dict(wide_dir)
    want = reference_logits(sd, cfg, tokens, thr, None, (eng.model.ffn.lm_head_thr, None))
    err = np.abs(got - want).max()
    assert err < (0.1 if outtype == "q8_0" else 0.3) * np.abs(want).max()
    dense = reference_logits(sd, cfg, tokens, {g: np.full(2, -1.0) for g in C.IN_GROUPS}, None)
    if outtype == "q8_0":  # (q4_0's rounding here is as large as what the masks change)
        assert np.abs(dense - want).max() > 2 * err, (np.abs(dense - want).max(), err)


@pytest.mark.parametrize("qtype", TYPES)
def test_chunked_head_is_the_gemv_of_the_masked_input(qtype):
    """The lm head's chunked layout (``IBChunks``): each chunk holds its rows' numbers (the
    inverse gives them back), and the kept-channel sum of one token and the batched product are
    the dense GEMV of the masked input (q8_0, q4_1: the same bits; all within the int8-activation
    bound around gguf's dequantization), with a last chunk shorter than the others."""
    rng = np.random.default_rng(7)
    n_out, n_in, chunk = 320, 96, 128  # chunks of 128, 128 and 64 outputs
    w = cpu.QTensor.from_array(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype)
    raw = cpu.ib_chunked_from_rows(w.raw, qtype, n_out, n_in, chunk)
    assert raw.shape == (n_in // 32, BLOCK_BYTES[qtype] * n_out)
    ib = cpu.IBChunks.from_raw(raw, cpu.ib_type(qtype), n_in, n_out, chunk)
    assert [(c0, t.cols) for c0, t in ib.parts] == [(0, 128), (128, 128), (256, 64)]
    for c0, t in ib.parts:
        np.testing.assert_array_equal(t.to_rows().raw, w.raw[c0:c0 + t.cols])
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    x[:, rng.random(n_in) < 0.4] = 0.0
    batch = ib.matmul_t(x, np.empty((3, n_out), np.float32), 2)
    for i in range(3):
        idx = np.nonzero(x[i])[0].astype(np.int32)
        one = ib.axpy_rows(np.ascontiguousarray(x[i, idx]), idx, np.empty(n_out, np.float32), 2)
        np.testing.assert_array_equal(one, batch[i])
        if qtype in (QT.Q8_0, *MIN_TYPES):
            np.testing.assert_array_equal(one, cpu.matvec(w, x[i], np.empty(n_out, np.float32)))
        exact, bound = _exact_and_bound(w, x[i])
        assert np.all(np.abs(one - exact) <= bound * 1.01 + 1e-4), np.abs(one - exact).max()
    with pytest.raises(ValueError, match="do not hold"):
        cpu.IBChunks.from_raw(raw[:, :-34], cpu.Q8_0_IB, n_in, n_out, chunk)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu.ib_chunks(n_out, 100)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    # the layout everywhere, a vocabulary of 576 = 9 tiles of 64 (the tokenizer has 513), tied
    return make_random_llama(tmp_path_factory.mktemp("ibh"), hidden_act="silu", tokenizer="bpe",
                             hidden_size=128, intermediate_size=256, n_heads=2, n_kv_heads=1,
                             n_layers=2, vocab_size=576, tied=True, name="ibhead")


@pytest.mark.parametrize("score", ["magnitude", "wina"])
def test_lm_head_sparsity(head_dir, tmp_path, score):
    """``--lm-head-sparsity``: the file stores the head in the chunked layout with its threshold
    (token_embd stays for the lookup); prefill and decode skip the head's small inputs as the
    float64 reference with the same mask (transformers' weights) does, and the calibrated
    fraction is what the calibration text skips."""
    out = str(tmp_path / f"head.{score}.gguf")
    assert convert_main([head_dir, out, "--outtype", "q8_0", "--target-sparsity", "0.3",
                         "--sparse-mode", "input", "--sparse-alloc", "uniform", "--sparsity-score",
                         score, "--lm-head-sparsity", "0.4", "--lm-head-candidates", "0",
                         "--calib-tokens", "128", "-t", "1"]) == 0
    r = gguf.GGUFReader(out)
    names = {t.name for t in r.tensors}
    assert {C.OUTPUT_IB, C.TOKEN_EMBD} <= names and C.OUTPUT not in names
    assert read_field(r, C.K_LM_HEAD_CANDIDATES) is None
    assert (C.OUTPUT_IN_SCALE in names) == (score == "wina")
    assert abs(read_field(r, C.K_LM_HEAD_SPARSITY) - 0.4) < 1e-6
    # f32 keys and values, as the float64 reference keeps them
    eng = Engine(out, n_ctx=64, n_threads=2, cache_type="f32")
    isp, cfg = eng.model.ffn, eng.cfg
    assert isp.lm_head_thr is not None and isp.lm_head_thr > 0
    scale = eng.weights.output_in_scale
    tokens = np.random.default_rng(3).integers(3, cfg.n_vocab, 20).tolist()
    eng.reset_stats()
    got = eng.model.forward(tokens, 0, all_logits=True)
    assert 0.2 < isp.head_stats.sparsity < 0.65, isp.head_stats.sparsity
    eng.reset()
    eng.reset_stats()
    steps = np.stack([eng.eval_token(t) for t in tokens])
    np.testing.assert_allclose(steps, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())
    # a token's layers and head in one kernel call (decode_layers with logits) give the bits
    # and the head's counts of the layer calls followed by lm_head, at any thread count
    assert isp.head_fits(eng.weights) and isp.whole_token
    head_counts = (isp.head_stats.total, isp.head_stats.active)
    for nt, whole in ((2, False), (1, True), (3, True)):
        e = eng if nt == 2 else Engine(out, n_ctx=64, n_threads=nt, cache_type="f32")
        e.model.ffn.whole_token = whole
        e.reset()
        e.reset_stats()
        again = np.stack([e.eval_token(t) for t in tokens])
        assert np.array_equal(again.view(np.uint32), steps.view(np.uint32)), (nt, whole)
        assert (e.model.ffn.head_stats.total, e.model.ffn.head_stats.active) == head_counts
    isp.whole_token = True
    sd = load_hf_state_dict(head_dir)
    scales = [lw.in_scale for lw in eng.weights.layers] if score == "wina" else None
    want = reference_logits(sd, cfg, tokens, isp.thr, scales, (isp.lm_head_thr, scale))
    err = np.abs(got - want).max()
    assert err < 0.1 * np.abs(want).max()
    # what the head's mask changes, in the file (the same run with the head's every input kept)
    # and in the reference, agrees (the rest of the error is the body's quantization)
    full = reference_logits(sd, cfg, tokens, isp.thr, scales)
    isp.lm_head_thr = -1.0
    eng.reset()
    got_full = eng.model.forward(tokens, 0, all_logits=True)
    d_got, d_want = (got - got_full).ravel(), (want - full).ravel()
    assert np.abs(d_got).max() > 0.05 * np.abs(got).max()
    assert np.corrcoef(d_got, d_want)[0, 1] > 0.9
    # --dense runs the same file with every input kept: the dense head's logits
    d = Engine(out, n_ctx=64, n_threads=2, dense=True)
    assert d.model.ffn.lm_head_thr == -1.0


def test_topk_indices():
    """The two-stage head's candidate set against NumPy's sort (value descending, then index
    ascending): ties, NaNs, infinities, k past the non-NaN count, k = 0; small vectors (the
    heap alone) and vocabulary-sized ones (cython/topk.h's bound from group maxima, and its
    fallback where ties put too many values at the bound)."""
    rng = np.random.default_rng(4)
    for trial in range(200):
        big = trial >= 120
        n = int(rng.integers(4096, 70000)) if big else int(rng.integers(1, 3000))
        k = int(rng.integers(0, 300))
        x = rng.standard_normal(n).astype(np.float32)
        if big and trial % 5 == 1:
            x = np.sort(x)  # ascending: every value would enter a plain heap
        if trial % 3 == 0:
            x = np.round(x * 2).astype(np.float32)  # many ties at the boundary
        if trial % 4 == 0:
            x[rng.random(n) < 0.2] = np.nan
        if big and trial % 7 == 0:
            x[rng.random(n) < 0.01] = np.inf
            x[rng.random(n) < 0.3] = -np.inf
        out = np.full(max(k, 1), -1, np.int32)
        m = cpu.topk_indices(x, k, out)
        ok = np.flatnonzero(~np.isnan(x))
        want = np.sort(ok[np.lexsort((ok, -x[ok]))][:k])
        assert m == want.size
        np.testing.assert_array_equal(out[:m], want)
    with pytest.raises(ValueError):
        cpu.topk_indices(np.zeros(10, np.float32), 5, np.empty(4, np.int32))
    with pytest.raises(ValueError):
        cpu.topk_indices(np.zeros(10, np.float32), -1, np.empty(4, np.int32))


def _final_normed(eng, tokens) -> np.ndarray:
    """The output-normed final residual (n_tok, n_embd) of ``tokens`` from an empty cache: the
    lm head's input, by the engine's own layers."""
    eng.reset()
    x = eng.model.embed(tokens, 0)
    eng.model.run_layers(x, 0)
    h = np.empty_like(x)
    cpu.rmsnorm(x, eng.weights.output_norm, eng.cfg.rms_eps, h)
    return h


def _check_two_stage(got, approx, exact, k: int) -> None:
    """Each token's two-stage logits (n_tok, n_vocab): the k largest of the copy's (ties to the
    lower index) are the exact head's, the rest the copy's, and the argmax is the exact head's."""
    for t in range(got.shape[0]):
        cand = np.zeros(got.shape[1], bool)
        cand[np.argsort(-approx[t], kind="stable")[:k]] = True
        np.testing.assert_array_equal(got[t][cand], exact[t][cand])
        np.testing.assert_array_equal(got[t][~cand], approx[t][~cand])
        assert int(np.argmax(got[t])) == int(np.argmax(exact[t]))


def test_two_stage_lm_head(head_dir, tmp_path, capsys):
    """A q8_0 head converts by default to the two-stage head: a q4_1 input-sparse copy
    (``output_ib``) whose K largest logits are replaced by the exact head's (the dense GEMV of
    the same output-normed h, bit for bit) and the rest kept, in prefill (all logits) and in
    decode (the whole-token kernel) alike; greedy tokens are the exact head's; ``--dense`` runs
    the exact head alone; ``--lm-head-candidates`` is checked."""
    from pyinfer.model import linear

    out = str(tmp_path / "two.gguf")
    args = [head_dir, out, "--outtype", "q8_0", "--target-sparsity", "0.3", "--sparse-mode",
            "input", "--sparse-alloc", "uniform", "--calib-tokens", "128", "-t", "1"]
    assert convert_main(args) == 0
    assert "a q4_1 copy picks 256 candidates" in capsys.readouterr().err
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_LM_HEAD_CANDIDATES) == 256
    names = {t.name: t for t in r.tensors}
    assert names[C.OUTPUT_IB].tensor_type == QT.Q4_1 and names[C.TOKEN_EMBD].tensor_type == QT.Q8_0
    eng = Engine(out, n_ctx=64, n_threads=2, cache_type="f32")
    isp, cfg, w = eng.model.ffn, eng.cfg, eng.weights
    assert isp.head_candidates == 256 and isp.lm_head_thr > 0
    tokens = np.random.default_rng(5).integers(3, cfg.n_vocab, 12).tolist()
    got = eng.model.forward(tokens, 0, all_logits=True)
    # the two stages by hand: the final residual, its norm, the copy's and the exact logits
    h = _final_normed(eng, tokens)
    approx = np.empty_like(got)
    isp.head_candidates = 0
    isp.lm_head(w, h, approx, 2)
    isp.head_candidates = 256
    exact = linear(w.output, h, np.empty_like(got), 2)
    _check_two_stage(got, approx, exact, 256)
    eng.reset()
    steps = np.stack([eng.eval_token(t) for t in tokens])  # the whole-token kernel
    np.testing.assert_allclose(steps, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())
    assert (steps.argmax(1) == got.argmax(1)).all()
    d = Engine(out, n_ctx=64, n_threads=2, cache_type="f32", dense=True)
    assert d.model.ffn.lm_head_thr is None and d.model.ffn.head_candidates == 0
    full = d.model.forward(tokens, 0, all_logits=True)
    hd = _final_normed(d, tokens)
    np.testing.assert_array_equal(full, linear(d.weights.output, hd, np.empty_like(full), 2))
    # K asked for: stored as given; 0: the copy in the head's own type, as before
    assert convert_main(args + ["--lm-head-candidates", "32"]) == 0
    assert read_field(gguf.GGUFReader(out), C.K_LM_HEAD_CANDIDATES) == 32
    capsys.readouterr()
    assert convert_main(args + ["--lm-head-candidates", "-1"]) != 0
    err = capsys.readouterr().err
    assert "--lm-head-candidates must be >= 0" in err and "Traceback" not in err


def test_lm_head_sparsity_needs_q8_0_or_q4_0(head_dir, tmp_path, capsys):
    """An f32 head takes the two-stage head by default (its q4_1 copy); without candidates it has
    no chunked head: the head stays dense, and asked for, a one-line error."""
    out = str(tmp_path / "f32.gguf")
    args = [head_dir, out, "--outtype", "f32", "--target-sparsity", "0.3", "--sparse-mode", "input",
            "--sparse-alloc", "uniform", "--calib-tokens", "128", "-t", "1"]
    assert convert_main(args) == 0
    t = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert t[C.OUTPUT_IB].tensor_type == QT.Q4_1 and t[C.TOKEN_EMBD].tensor_type == QT.F32
    assert Engine(out, n_ctx=32).model.ffn.head_candidates == 256
    args += ["--lm-head-candidates", "0"]
    assert convert_main(args) == 0
    assert C.OUTPUT_IB not in {t.name for t in gguf.GGUFReader(out).tensors}
    assert Engine(out, n_ctx=32).model.ffn.lm_head_thr is None
    capsys.readouterr()
    assert convert_main(args + ["--lm-head-sparsity", "0.2"]) != 0
    err = capsys.readouterr().err
    assert "--lm-head-sparsity needs the lm head in q8_0, q4_0, q4_1, q5_0 or q5_1" in err and "Traceback" not in err


def _unfused_ffn(x, norm, gu, down, t_in, t_d, n_threads):
    """decode_ffn_in by the separate kernels: rmsnorm, select_inputs, axpy_rows (gate/up),
    select_active (a = act(g) u, every j), select_inputs, axpy_rows (down), the residual add."""
    n_embd, n_ff = x.size, down.rows
    h = cpu.rmsnorm(x, norm, 1e-5, np.empty_like(x))
    coef, idx = np.empty(n_embd, np.float32), np.empty(n_embd, np.int32)
    n_in = cpu.select_inputs(h, None, t_in, coef, idx)
    g_u = cpu.axpy_rows(gu, coef[:n_in], idx[:n_in], np.empty(2 * n_ff, np.float32), n_threads)
    a, ia = np.empty(n_ff, np.float32), np.empty(n_ff, np.int32)
    assert cpu.select_active(g_u[:n_ff].copy(), g_u[n_ff:].copy(), None, True, -1.0, a, ia) == n_ff
    cd, idd = np.empty(n_ff, np.float32), np.empty(n_ff, np.int32)
    n_mid = cpu.select_inputs(a, None, t_d, cd, idd)
    y = cpu.axpy_rows(down, cd[:n_mid], idd[:n_mid], np.empty(n_embd, np.float32), n_threads)
    return x + y, (n_in, n_mid)


def _unfused_attn(x, norm, qkv, wo, kc, vc, n_past, n_head, t_in, t_o, n_threads):
    """decode_attn_in by the separate kernels: rmsnorm, select_inputs, axpy_rows (q/k/v),
    rope_neox, the cache write, attention, select_inputs, axpy_rows (output), the residual;
    x, kc, vc: f32 (n_embd,), (n_ctx, n_kv, hd) (the caches written in place)."""
    n_embd, (n_kv, hd) = x.size, kc.shape[1:]
    nq, nkv = n_head * hd, n_kv * hd
    h = cpu.rmsnorm(x, norm, 1e-5, np.empty_like(x))
    coef, idx = np.empty(n_embd, np.float32), np.empty(n_embd, np.int32)
    n_in = cpu.select_inputs(h, None, t_in, coef, idx)
    out = cpu.axpy_rows(qkv, coef[:n_in], idx[:n_in], np.empty(nq + 2 * nkv, np.float32),
                        n_threads)
    q = np.ascontiguousarray(out[:nq].reshape(1, n_head, hd))
    k = np.ascontiguousarray(out[nq:nq + nkv].reshape(1, n_kv, hd))
    cpu.rope_neox(q, [n_past], 1e4, hd)
    cpu.rope_neox(k, [n_past], 1e4, hd)
    kc[n_past], vc[n_past] = k[0], out[nq + nkv:].reshape(n_kv, hd)
    # the one-query-at-a-time kernel (_attend_head, the fused call's): the batched one that
    # prefill runs (pi_attend_block) rounds differently by a few ulp
    prev = cpu._k.set_old_prefill(1)
    try:
        att = cpu.attention(q, kc, vc, n_past, np.empty_like(q), n_threads).reshape(-1)
    finally:
        cpu._k.set_old_prefill(prev)
    co, io = np.empty(nq, np.float32), np.empty(nq, np.int32)
    n_mid = cpu.select_inputs(att, None, t_o, co, io)
    y = cpu.axpy_rows(wo, co[:n_mid], io[:n_mid], np.empty(n_embd, np.float32), n_threads)
    return x + y, (n_in, n_mid)


@pytest.mark.parametrize("layout,qtype", [("ib", QT.Q8_0), ("ib", QT.Q4_0), ("ib", QT.Q4_1), ("ib", QT.Q5_0), ("ib", QT.Q5_1), ("t", QT.Q8_0),
                                          ("t", QT.Q4_0), ("t", QT.F16)])
def test_fused_halves_equal_unfused_kernels(layout, qtype):
    """decode_ffn_in and decode_attn_in (one parallel region each, issue 12) give the bits of
    their steps run as separate kernels, at 1, 2 and 3 threads, over the input-block tensors
    and the transposed row tensors (``*_t``: one row per input channel, quantized along it).
    Sizes give the row sums several chunks (256 / 512 kept rows) and every threshold between
    none and all kept."""
    rng = np.random.default_rng(5 + int(qtype) + len(layout))
    n_embd, n_ff, n_head, n_kv, hd, n_ctx, n_past = 256, 512, 4, 2, 64, 12, 7
    nq, nkv = n_head * hd, n_kv * hd

    def weight(n_out, n_in, scale=1.0):
        w = (scale * rng.standard_normal((n_out, n_in))).astype(np.float32)
        if layout == "ib":
            return cpu.IBTensor.from_rows(cpu.QTensor.from_array(w, qtype))
        return cpu.QTensor.from_array(np.ascontiguousarray(w.T), qtype)

    gu, down = weight(2 * n_ff, n_embd, 0.1), weight(n_embd, n_ff, 0.1)
    qkv, wo = weight(nq + 2 * nkv, n_embd, 0.1), weight(n_embd, nq, 0.1)
    norm = rng.uniform(0.5, 1.5, n_embd).astype(np.float32)
    x0 = rng.standard_normal(n_embd).astype(np.float32)
    k0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
    v0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
    h = np.abs(cpu.rmsnorm(x0, norm, 1e-5, np.empty_like(x0)))
    for t_in, t_mid in ((-1.0, -1.0), (np.quantile(h, 0.3), 0.02), (np.quantile(h, 0.7), 0.1),
                        (1e30, -1.0), (-1.0, 1e30)):
        for n_threads in (1, 2, 3):
            want, n_want = _unfused_ffn(x0, norm, gu, down, t_in, t_mid, n_threads)
            got = x0.copy()
            assert cpu.decode_ffn_in(got, norm, 1e-5, gu, down, None, t_in, None, t_mid, True,
                                     n_threads) == n_want
            np.testing.assert_array_equal(got, want)
            kw, vw = k0.copy(), v0.copy()
            want, n_want = _unfused_attn(x0, norm, qkv, wo, kw, vw, n_past, n_head, t_in, t_mid,
                                         n_threads)
            kc, vc, got = k0.copy(), v0.copy(), x0.copy()
            assert cpu.decode_attn_in(got, norm, 1e-5, qkv, wo, kc, vc, n_past, n_head, 1e4,
                                      None, t_in, None, t_mid, n_threads) == n_want
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(kc, kw)
            np.testing.assert_array_equal(vc, vw)


def test_act_values_equal_select_active():
    """decode_ffn_in's activations (act_mul: silu's exp in double, 4 lanes, rounded where safe,
    else expf) have the bits of select_active's act(g) * u (libm expf) on 2^20 inputs from
    -100 to 100 (beyond +-87 expf itself), exact halves, +-0, +-inf and NaN, and relu's too."""
    rng = np.random.default_rng(3)
    g = np.concatenate([rng.uniform(-100, 100, 1 << 19), rng.standard_normal(1 << 19) * 4,
                        np.arange(-200, 201) / 2, [0.0, -0.0, np.inf, -np.inf, np.nan, 87.0,
                                                   -87.0, 88.7, -103.9]]).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    for silu in (True, False):
        coef, idx = np.empty_like(g), np.empty(g.size, np.int32)
        with np.errstate(invalid="ignore"):
            n = cpu.select_active(g, u, None, silu, -1.0, coef, idx)  # keeps all but NaN
        want = np.full_like(g, np.nan)
        want[idx[:n]] = coef[:n]
        got = np.full_like(g, 1.0)
        cpu._k.act_mul(np.concatenate([g, u]), int(silu), got)
        np.testing.assert_array_equal(got, want)  # NaN where want is NaN


def test_two_stage_head_in_other_modes(head_dir, tmp_path):
    """The two-stage head without sparse mode input: a --dense file asked for it
    (--lm-head-candidates) and a glu file by default store a q4_1 copy of the q8_0 head that reads
    every input; its K largest logits are the exact head's (the dense GEMV, bit for bit), the
    rest the copy's, in prefill and decode; --dense at run time runs the exact head; the GPU
    engine (NumpyDevice) computes the head on the device with the same result."""
    from pyinfer.device import NumpyDevice
    from pyinfer.ffn import DenseFFN
    from pyinfer.hybrid import place_model
    from pyinfer.model import linear

    out = str(tmp_path / "dense2.gguf")
    assert convert_main([head_dir, out, "--outtype", "q8_0", "--dense"]) == 0
    assert C.OUTPUT_IB not in {t.name for t in gguf.GGUFReader(out).tensors}  # asked for only
    assert convert_main([head_dir, out, "--outtype", "q8_0", "--dense",
                         "--lm-head-candidates", "32"]) == 0
    r = gguf.GGUFReader(out)
    names = {t.name: t for t in r.tensors}
    assert names[C.OUTPUT_IB].tensor_type == QT.Q4_1 and names[C.TOKEN_EMBD].tensor_type == QT.Q8_0
    assert read_field(r, C.K_LM_HEAD_CANDIDATES) == 32
    assert read_field(r, C.K_LM_HEAD_THRESHOLD) is None
    eng = Engine(out, n_ctx=64, n_threads=2, cache_type="f32")
    head, cfg, w = eng.model.lm_head, eng.cfg, eng.weights
    assert head.head_candidates == 32 and head.lm_head_thr == -1.0 and not eng.is_sparse
    tokens = np.random.default_rng(6).integers(3, cfg.n_vocab, 10).tolist()
    got = eng.model.forward(tokens, 0, all_logits=True)
    h = _final_normed(eng, tokens)
    exact = linear(w.output, h, np.empty_like(got), 2)
    head.head_candidates = 0
    approx = head.lm_head(w, h, np.empty_like(got), 2)
    head.head_candidates = 32
    assert head.head_stats.active == head.head_stats.total > 0  # every input read
    _check_two_stage(got, approx, exact, 32)
    eng.reset()
    steps = np.stack([eng.eval_token(t) for t in tokens])
    np.testing.assert_allclose(steps, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())
    d = Engine(out, n_ctx=64, n_threads=2, cache_type="f32", dense=True)
    assert d.model.lm_head is None
    np.testing.assert_array_equal(d.model.forward(tokens, 0, all_logits=True), exact)
    # the GPU engine: the copy on the device, the candidates rescored on the host
    gm = place_model(eng.reader, cfg, w, DenseFFN(cfg), 64, 2, device="cuda",
                     backend=NumpyDevice(), lm_head=head)
    assert gm.plan.output and gm.head_parts is not None
    assert gm.device_bytes == gm.plan.planned_bytes
    gm.head_stats.reset()  # the head object is the CPU engine's too
    dev = np.stack([gm.forward([t], i) for i, t in enumerate(tokens)])
    # the device's dense layers read ffn_down in row layout as stored: the CPU's function
    assert np.abs(dev - steps).max() < 1e-4 * np.abs(steps).max()
    assert (dev.argmax(1) == steps.argmax(1)).all()
    assert gm.head_stats.total == len(tokens) * cfg.n_embd == gm.head_stats.active
    # a glu file takes the two-stage head by default (its head is wider than 4 bits)
    glu = str(tmp_path / "glu.gguf")
    fast = ["--calib-tokens", "128", "--epochs", "2", "-t", "1"]
    assert convert_main([head_dir, glu, "--outtype", "q8_0", "--sparse-mode", "glu", *fast]) == 0
    g = Engine(glu, n_ctx=64, n_threads=2)
    assert g.is_sparse and g.model.lm_head is not None and g.model.lm_head.head_candidates == 256
    assert convert_main([head_dir, glu, "--outtype", "q8_0", "--sparse-mode", "glu",
                         "--lm-head-candidates", "0", *fast]) == 0
    assert Engine(glu, n_ctx=64, n_threads=2).model.lm_head is None
