"""Hot neurons on a device, cold ones on the CPU: the split and merge change nothing but where
the work runs.

- On the CPU, with NumpyDevice standing in for the GPU: for any placement (none, random, all hot)
  the HybridFFN forward pass equals the all-CPU SparseFFN one, decode and prefill; the layer
  offload baseline equals DenseFFN; the budget and device options fail clearly.
- Every CUDA source compiles with nvcc (skipped without nvcc).
- With a CUDA device (``-m gpu``; skipped without one): every RawKernel equals its NumPy twin and
  the CupyDevice HybridFFN equals SparseFFN.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pyinfer.device import GiB, NumpyDevice, dequantize_rows
from pyinfer.engine import Engine
from pyinfer.errors import PyinferError
from pyinfer.ffn import DenseFFN, Predictor, SparseFFN
from pyinfer.hybrid import HybridFFN, LayerOffloadFFN, place_ffn
from pyinfer.ops import cpu, cuda
from pyinfer.ops.cpu import QT, QTensor
from tests._models import make_random_llama

PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250]
NO_GPU = f"no CUDA device: {cuda.unavailable_reason()}"
# f32/f16: both sides dot in f32. q8_0/q4_0: the CPU kernels dot against 8-bit-quantized
# activations (ops/cpu.py numerics), the device kernels against f32 ones.
TOL = {"f32": 1e-4, "f16": 1e-4, "q8_0": 2e-2, "q4_0": 2e-2}


def engine_for(tmp_path, hidden_act, outtype):
    """A random 3-layer Llama converted to ``outtype`` (needs torch + transformers: the kernel
    tests below do not, so a GPU image without them still runs those)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convert.cli import main as convert_main

    model_dir = make_random_llama(tmp_path / "hf", hidden_act=hidden_act, tied=False, n_kv_heads=2,
                                  tokenizer="bpe", intermediate_size=256, n_layers=3)
    out = tmp_path / "m.gguf"
    assert convert_main([str(model_dir), str(out), "--outtype", outtype, "--dense"]) == 0
    return Engine(str(out), n_ctx=64, n_threads=2, dense=True, device="cpu")


def sparse_ffn(cfg, hidden_act, with_predictor=True, seed=0):
    rng = np.random.default_rng(seed)
    preds = None
    if with_predictor:
        rank = 16
        preds = [Predictor(rng.normal(size=(rank, cfg.n_embd)).astype(np.float32),
                           rng.normal(size=(cfg.n_ff, rank)).astype(np.float32), 0.5)
                 for _ in range(cfg.n_layer)]
    thr = np.full(cfg.n_layer, 0.01 if hidden_act == "silu" else 0.0, np.float32)
    return SparseFFN(cfg, preds, thr)


def buckets_for(kind, cfg, seed=1):
    rng = np.random.default_rng(seed)
    if kind == "none":
        return [np.zeros(0, np.int32)] * cfg.n_layer
    if kind == "all":
        return [np.arange(cfg.n_ff, dtype=np.int32)] * cfg.n_layer
    # random: layer 0 split at random, layer 1 all hot, layer 2 all cold
    return [np.sort(rng.choice(cfg.n_ff, cfg.n_ff // 3, replace=False)).astype(np.int32),
            np.arange(cfg.n_ff, dtype=np.int32), np.zeros(0, np.int32)][:cfg.n_layer]


def decode_all(eng, tokens):
    eng.reset()
    return np.stack([eng.model.forward([t], i) for i, t in enumerate(tokens)])


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_hybrid_vs_sparse(eng, hidden_act, outtype, placement, dev, with_predictor=True):
    cfg = eng.cfg
    eng.model.ffn = ref_ffn = sparse_ffn(cfg, hidden_act, with_predictor)
    ref = decode_all(eng, PROMPT)
    hyb = HybridFFN(sparse_ffn(cfg, hidden_act, with_predictor), eng.weights, dev,
                    buckets_for(placement, cfg))
    eng.model.ffn = hyb
    got = decode_all(eng, PROMPT)
    assert rel_err(got, ref) < TOL[outtype]
    assert hyb.stats.total == ref_ffn.stats.total
    assert abs(hyb.stats.sparsity - ref_ffn.stats.sparsity) < 0.01
    if outtype in ("f32", "f16"):
        assert hyb.stats.active == ref_ffn.stats.active
    # prefill runs the same token-at-a-time split
    eng.reset()
    pre = eng.model.forward(PROMPT, 0, all_logits=True)
    assert rel_err(pre, ref) < TOL[outtype]
    return hyb


@pytest.mark.parametrize("hidden_act,outtype", [("relu", "f32"), ("silu", "f16"),
                                                ("relu", "q8_0"), ("silu", "q4_0")])
@pytest.mark.parametrize("placement", ["none", "random", "all"])
def test_hybrid_equals_sparse_numpy_device(tmp_path, hidden_act, outtype, placement):
    eng = engine_for(tmp_path, hidden_act, outtype)
    hyb = run_hybrid_vs_sparse(eng, hidden_act, outtype, placement, NumpyDevice())
    n_hot = {"none": 0, "random": eng.cfg.n_ff // 3 + eng.cfg.n_ff,
             "all": eng.cfg.n_ff * eng.cfg.n_layer}[placement]
    assert hyb.n_hot == n_hot


def test_hybrid_without_predictor(tmp_path):
    eng = engine_for(tmp_path, "relu", "f32")
    run_hybrid_vs_sparse(eng, "relu", "f32", "random", NumpyDevice(), with_predictor=False)


def test_layer_offload_equals_dense(tmp_path):
    eng = engine_for(tmp_path, "silu", "f16")
    eng.model.ffn = DenseFFN(eng.cfg)
    ref = decode_all(eng, PROMPT)
    eng.model.ffn = LayerOffloadFFN(DenseFFN(eng.cfg), eng.weights, NumpyDevice(), 2)
    assert rel_err(decode_all(eng, PROMPT), ref) < 1e-4
    eng.reset()
    assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) < 1e-4
    assert eng.model.ffn.stats.sparsity == 0.0


def test_numpy_twins_match_cpu_kernels():
    rng = np.random.default_rng(0)
    dev = NumpyDevice()
    for qt in (QT.F32, QT.F16, QT.Q8_0, QT.Q4_0):
        w = QTensor.from_array(rng.normal(size=(40, 96)).astype(np.float32), qt)
        ids = np.array([3, 0, 39, 17], np.int32)
        ref = np.empty((4, 96), np.float32)
        cpu.get_rows(w, ids, ref)
        rows = dev.rows(w, ids)
        assert rows.data.flags.c_contiguous and rows.nbytes == 4 * w.raw.shape[1]
        np.testing.assert_array_equal(rows.f32, ref)
        np.testing.assert_array_equal(dequantize_rows(w.raw[ids], qt, 96), ref)
        coef = rng.normal(size=4).astype(np.float32)
        coef[1] = 0.0
        out, want = np.full(96, np.nan, np.float32), np.empty(96, np.float32)
        dev.axpy_rows(rows, coef, out)
        cpu.axpy_rows(w, coef, ids, want)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_place_ffn_options(tmp_path, capsys):
    eng = engine_for(tmp_path, "relu", "f16")
    cfg, w = eng.cfg, eng.weights
    ffn = sparse_ffn(cfg, "relu")
    with pytest.raises(PyinferError, match="more than the free device memory"):
        place_ffn(eng.reader, cfg, w, ffn, device="cuda", vram_budget=2.0,
                  backend=NumpyDevice(free_bytes=1 * GiB))
    with pytest.raises(PyinferError, match="unknown device"):
        place_ffn(eng.reader, cfg, w, ffn, device="tpu")
    assert place_ffn(eng.reader, cfg, w, ffn, device="cpu") is ffn
    if not cuda.available():
        with pytest.raises(PyinferError, match="no CUDA device"):
            place_ffn(eng.reader, cfg, w, ffn, device="cuda")
        capsys.readouterr()
        assert place_ffn(eng.reader, cfg, w, ffn, device="auto") is ffn
        assert "running on the CPU" in capsys.readouterr().err
    # a budget that holds everything: every neuron hot (no activation counts in a --dense file)
    hyb = place_ffn(eng.reader, cfg, w, ffn, device="cuda", vram_budget=1.0, backend=NumpyDevice())
    assert isinstance(hyb, HybridFFN) and hyb.n_hot == cfg.n_ff * cfg.n_layer
    # -ngl and disable_gpu_index give whole layers
    lo = place_ffn(eng.reader, cfg, w, ffn, device="cuda", n_gpu_layers=2, backend=NumpyDevice())
    assert isinstance(lo, LayerOffloadFFN) and lo.n_gpu_layers == 2
    lo = place_ffn(eng.reader, cfg, w, ffn, device="cuda", disable_gpu_index=True,
                   backend=NumpyDevice())
    assert isinstance(lo, LayerOffloadFFN) and lo.n_gpu_layers == cfg.n_layer
    with pytest.raises(PyinferError, match="do not fit"):
        place_ffn(eng.reader, cfg, w, ffn, device="cuda", n_gpu_layers=3, vram_budget=1e-6,
                  backend=NumpyDevice())


def test_device_env_override():
    code = "from pyinfer.ops import cuda; print(cuda.available(), cuda.unavailable_reason())"
    env = dict(os.environ, PYINFER_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False PYINFER_DEVICE=cpu"


@pytest.mark.parametrize("name", sorted(cuda.SOURCES))
def test_cuda_source_compiles_with_nvcc(tmp_path, name):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / f"{name}.cu"
    src.write_text(cuda.SOURCES[name])
    r = subprocess.run([nvcc, "-arch=sm_90", "--ptx", "-Werror", "all-warnings", "-o",
                        str(tmp_path / f"{name}.ptx"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / f"{name}.ptx").read_text()
    assert ptx.count(".entry") >= {"predictor": 2, "gather": 8, "axpy": 6}[name]


# ---- on a CUDA device ---------------------------------------------------------------------------


@pytest.mark.parametrize("qt", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0])
@pytest.mark.parametrize("rows,cols", [(300, 256), (77, 96), (1000, 4096)])
@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
def test_gpu_kernels_match_numpy_twins(qt, rows, cols):
    from pyinfer.device import CupyDevice

    cp = cuda.cupy
    rng = np.random.default_rng(rows + cols)
    g = CupyDevice()
    n = NumpyDevice()
    n_ff = 2 * rows
    gate_w = QTensor.from_array(rng.normal(size=(n_ff, cols)).astype(np.float32), qt)
    up_w = QTensor.from_array(rng.normal(size=(n_ff, cols)).astype(np.float32), qt)
    down_w = QTensor.from_array(rng.normal(size=(n_ff, cols)).astype(np.float32), qt)
    ids = np.sort(rng.choice(n_ff, rows, replace=False)).astype(np.int32)
    x = rng.normal(size=cols).astype(np.float32)
    mask = (rng.random(n_ff) < 0.3).astype(np.uint8)
    rtol = 1e-4 if qt != QT.F16 else 2e-4
    gd = {k: g.rows(w, ids) for k, w in (("gate", gate_w), ("up", up_w), ("down", down_w))}
    nd = {k: n.rows(w, ids) for k, w in (("gate", gate_w), ("up", up_w), ("down", down_w))}
    np.testing.assert_array_equal(cp.asnumpy(gd["gate"].data), nd["gate"].data)
    xd, idd, md = cp.asarray(x), cp.asarray(ids), cp.asarray(mask)
    for use_mask in (False, True):
        out = cp.full(rows, cp.nan, cp.float32)
        want = np.empty(rows, np.float32)
        g.gather_gemv(gd["gate"], xd, out, idd if use_mask else None, md if use_mask else None)
        n.gather_gemv(nd["gate"], x, want, ids if use_mask else None, mask if use_mask else None)
        np.testing.assert_allclose(out.get(), want, rtol=rtol, atol=rtol * np.abs(want).max())
    for act, thr in (("relu", 0.0), ("silu", 0.05), ("relu", -1.0)):
        coef = cp.full(rows, cp.nan, cp.float32)
        cnt = cp.zeros(2, cp.uint64)
        want, wcnt = np.empty(rows, np.float32), np.zeros(2, np.uint64)
        g.ffn_gate_up(gd["gate"], gd["up"], xd, coef, cnt, act, thr, idd, md)
        n.ffn_gate_up(nd["gate"], nd["up"], x, want, wcnt, act, thr, ids, mask)
        scale = np.abs(want).max() or 1.0
        np.testing.assert_allclose(coef.get(), want, rtol=1e-3, atol=1e-3 * scale)
        assert abs(int(cnt.get()[1]) - int(wcnt[1])) <= 1 and int(cnt.get()[0]) == int(wcnt[0])
        for skip in (True, False):
            o = cp.full(cols, cp.nan, cp.float32)
            w2 = np.empty(cols, np.float32)
            g.axpy_rows(gd["down"], cp.asarray(want), o, skip)
            n.axpy_rows(nd["down"], want, w2, skip)
            np.testing.assert_allclose(o.get(), w2, rtol=1e-4, atol=1e-4 * np.abs(w2).max())
    # predictor and merge
    rank = 24
    fc1 = rng.normal(size=(rank, cols)).astype(np.float32)
    fc2 = rng.normal(size=(n_ff, rank)).astype(np.float32)
    m_d = cp.full(n_ff, 7, cp.uint8)
    m_h = np.empty(n_ff, np.uint8)
    g.predict(cp.asarray(fc1), cp.asarray(fc2), 0.5, xd, cp.empty(rank, cp.float32), m_d)
    n.predict(fc1, fc2, 0.5, x, np.empty(rank, np.float32), m_h)
    assert np.mean(m_d.get() != m_h) < 0.01
    part = rng.normal(size=cols).astype(np.float32)
    out_h = np.empty(cols, np.float32)
    g.merge(cp.asarray(x), part, out_h)
    np.testing.assert_allclose(out_h, x + part, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("hidden_act,outtype", [("relu", "f32"), ("silu", "f16"), ("relu", "q4_0")])
@pytest.mark.parametrize("placement", ["random", "all"])
def test_gpu_hybrid_equals_sparse(tmp_path, hidden_act, outtype, placement):
    from pyinfer.device import CupyDevice

    eng = engine_for(tmp_path, hidden_act, outtype)
    run_hybrid_vs_sparse(eng, hidden_act, outtype, placement, CupyDevice())


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
def test_gpu_engine_auto_device(tmp_path):
    eng = engine_for(tmp_path, "relu", "f16")
    gpu_eng = Engine(eng.path, n_ctx=64, n_threads=2, dense=True, device="auto", n_gpu_layers=2)
    assert isinstance(gpu_eng.model.ffn, LayerOffloadFFN)
    assert rel_err(decode_all(gpu_eng, PROMPT), decode_all(eng, PROMPT)) < 1e-4
