"""The GPU-resident hybrid model computes what the CPU model computes, wherever the work runs.

- On the CPU, with NumpyDevice standing in for the GPU (the same GpuModel code, NumPy arrays):
  for every plan (all neurons cold, a random split, all hot, only some layers resident, output on
  the CPU) and every sparse rule (relu, cats, glu; predictor on some layers only) the GpuModel's
  decode and prefill logits equal the CPU Model's and the same neurons are active; whole-layer
  offload equals the dense CPU model; the budget accounting counts exactly what is allocated;
  a ``pyinfer-convert --dense`` file (ffn_down in row layout) placed on the device equals the
  CPU model running its rows as stored.
- Every CUDA source compiles with nvcc (skipped without nvcc).
- With a CUDA device (``-m gpu``; skipped without one): every RawKernel equals its NumPy twin, the
  CupyDevice GpuModel equals the CPU model, and CuPy's memory pool holds what the plan says.
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
from pyinfer.gpu_model import GpuModel, GpuPlan
from pyinfer.hybrid import place_model
from pyinfer.model import Model
from pyinfer.ops import cpu, cuda, reference
from pyinfer.ops import xp as X
from pyinfer.ops.cpu import QT, QTensor
from tests._models import make_random_llama

PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250]
NO_GPU = f"no CUDA device: {cuda.unavailable_reason()}"
# f32/f16: both sides dot in f32. q8_0/q4_0: both dot against the activation's q8 form (ops/cpu.py
# numerics; cuda.quantize_q8, xp.quantize_act_q8), so NumpyDevice gives the CPU's logits within
# float rounding (TOL_SAME); the wider bound is for a device copy of ffn_down quantized again
# (row-layout files) and for a GPU, whose float rounding of an activation can move one of its
# quantized values by a step.
TOL = {"f32": 1e-4, "f16": 1e-4, "q8_0": 6e-2, "q4_0": 6e-2, "q4_1": 6e-2, "q5_0": 6e-2, "q5_1": 6e-2}
TOL_SAME = 1e-4


def engine_for(tmp_path, hidden_act, outtype, n_layers=3, rows=False):
    """A random Llama converted to ``outtype`` without the offline stage (needs torch +
    transformers: the kernel tests below do not, so a GPU image without them still runs those):
    neuron-major ffn_down_t (the tests give it sparse FFNs), or with ``rows`` what
    ``pyinfer-convert --dense`` writes (ffn_down in row layout)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convert.cli import convert, main as convert_main

    model_dir = make_random_llama(tmp_path / "hf", hidden_act=hidden_act, tied=False, n_kv_heads=2,
                                  tokenizer="bpe", intermediate_size=256, n_layers=n_layers)
    out = tmp_path / "m.gguf"
    if rows:
        assert convert_main([str(model_dir), str(out), "--outtype", outtype, "--dense"]) == 0
    else:
        convert(str(model_dir), str(out), outtype, progress=False)
    return Engine(str(out), n_ctx=64, n_threads=2, dense=True)


def sparse_ffn(cfg, hidden_act, mode=None, with_predictor=True, seed=0):
    """A SparseFFN with random predictors that run on layers 0 and 2 only (as a file's
    ``pyinfer.predictor.cpu`` can say)."""
    rng = np.random.default_rng(seed)
    preds = None
    if with_predictor:
        rank = 16
        preds = [Predictor(rng.normal(size=(rank, cfg.n_embd)).astype(np.float32),
                           rng.normal(size=(cfg.n_ff, rank)).astype(np.float16), 0.5)
                 for _ in range(cfg.n_layer)]
    thr = np.full(cfg.n_layer, 0.01 if hidden_act == "silu" else 0.0, np.float32)
    use = [i % 2 == 0 for i in range(cfg.n_layer)] if with_predictor else None
    return SparseFFN(cfg, preds, thr, mode, use_predictor=use)


def hot_for(kind, cfg, seed=1):
    rng = np.random.default_rng(seed)
    if kind in ("none", "partial"):
        return [np.zeros(0, np.int32)] * cfg.n_layer
    if kind == "all":
        return [np.arange(cfg.n_ff, dtype=np.int32)] * cfg.n_layer
    # random: layer 0 split at random, layer 1 all hot, layer 2 all cold
    return [np.sort(rng.choice(cfg.n_ff, cfg.n_ff // 3, replace=False)).astype(np.int32),
            np.arange(cfg.n_ff, dtype=np.int32), np.zeros(0, np.int32)][:cfg.n_layer]


def plan_for(kind, cfg, dense=False):
    if kind == "partial":  # layer 0 resident, its FFN on the CPU; layers 1.. and logits on the CPU
        return GpuPlan(1, False, hot_for("none", cfg), dense=dense)
    if kind == "layers":  # llama.cpp -ngl 2
        hot = [np.arange(cfg.n_ff, dtype=np.int32)] * 2 + [np.zeros(0, np.int32)] * (cfg.n_layer - 2)
        return GpuPlan(2, False, hot, dense=dense)
    return GpuPlan(cfg.n_layer, True, hot_for(kind, cfg), dense=dense)


def decode_all(model, tokens):
    return np.stack([model.forward([t], i) for i, t in enumerate(tokens)])


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def compare(eng, make_ffn, plan, outtype, dev, exact_counts, tol=None):
    """GpuModel vs the CPU Model over the same FFN rule: decode then prefill logits (within
    ``tol``, default TOL[outtype]), active neuron counts."""
    tol = TOL[outtype] if tol is None else tol
    cfg, w = eng.cfg, eng.weights
    ref_ffn = make_ffn()
    ref_model = Model(cfg, w, eng.n_ctx, 2, ffn=ref_ffn, cache_type="f32")  # the device's cache
    ref = decode_all(ref_model, PROMPT)
    gm = GpuModel(cfg, w, eng.n_ctx, 2, make_ffn(), dev, plan)
    got = decode_all(gm, PROMPT)
    assert rel_err(got, ref) < tol
    assert gm.stats.total == ref_ffn.stats.total
    if exact_counts:
        assert gm.stats.active == ref_ffn.stats.active
        assert gm.stats.candidates == ref_ffn.stats.candidates
    else:
        assert abs(gm.stats.sparsity - ref_ffn.stats.sparsity) < 0.02
    # prefill (batched on the device) computes the same function
    gm.stats.reset()
    ref_ffn.stats.reset()
    pre = gm.forward(PROMPT, 0, all_logits=True)
    assert rel_err(pre, ref) < tol
    last = gm.forward(PROMPT[:5], 0)  # last-token logits through the device output GEMV
    assert rel_err(last, ref[4]) < tol
    return gm


@pytest.mark.parametrize("hidden_act,outtype,mode", [("relu", "f32", "relu"), ("silu", "f16", "glu"),
                                                     ("silu", "f32", "cats"), ("relu", "q8_0", "relu"),
                                                     ("silu", "q4_0", "glu")])
@pytest.mark.parametrize("kind", ["none", "random", "all", "partial"])
def test_gpu_model_equals_cpu_model_numpy_device(tmp_path, hidden_act, outtype, mode, kind):
    eng = engine_for(tmp_path, hidden_act, outtype)
    gm = compare(eng, lambda: sparse_ffn(eng.cfg, hidden_act, mode), plan_for(kind, eng.cfg),
                 outtype, NumpyDevice(), exact_counts=True,
                 # partial: the CPU prefills layers 1.. (its q8_0/q4_0 sparse prefill is not its
                 # decode bit for bit: 0.8% on this model)
                 tol=None if kind == "partial" else TOL_SAME)
    n_hot = {"none": 0, "partial": 0, "random": eng.cfg.n_ff // 3 + eng.cfg.n_ff,
             "all": eng.cfg.n_ff * eng.cfg.n_layer}[kind]
    assert gm.n_hot == n_hot


def test_gpu_model_without_predictor(tmp_path):
    eng = engine_for(tmp_path, "relu", "f32")
    compare(eng, lambda: sparse_ffn(eng.cfg, "relu", with_predictor=False),
            plan_for("random", eng.cfg), "f32", NumpyDevice(), exact_counts=True)


@pytest.mark.parametrize("kind", ["layers", "all", "random"])
def test_dense_plans_equal_dense_cpu(tmp_path, kind):
    eng = engine_for(tmp_path, "silu", "f16")
    gm = compare(eng, lambda: DenseFFN(eng.cfg), plan_for(kind, eng.cfg, dense=True), "f16",
                 NumpyDevice(), exact_counts=True)
    assert gm.stats.sparsity == 0.0


def _device(kind):
    if kind == "numpy":
        return NumpyDevice()
    from pyinfer.device import CupyDevice

    return CupyDevice()


DEVICES = ["numpy", pytest.param("cupy", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not cuda.available(), reason=NO_GPU)])]


@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_0"])
def test_dense_rows_file_on_the_device(tmp_path, outtype, backend):
    """A --dense file keeps ffn_down in row layout; placed on a device (NumpyDevice, and CuPy
    where there is a GPU) with a dense FFN, the device runs the down projection as a GEMV over
    the rows as stored, as the CPU does (a q8 activation for block types): whole-layer, all-hot
    and -ngl plans give the CPU model's logits to float rounding (the same weights, no second
    quantization). A sparse run of such a file needs neuron rows: ``neuron_major_down``
    transposes the rows at load (f16 exactly, block types quantized again)."""
    eng = engine_for(tmp_path, "silu", outtype, rows=True)
    cfg, w = eng.cfg, eng.weights
    assert all(lw.ffn_down_t is None and lw.ffn_down is not None for lw in w.layers)
    eng.model.set_cache_type("f32")  # the device keeps f32 keys and values
    ref = decode_all(eng.model, PROMPT)  # the CPU: GEMVs over the rows as stored
    gm = place_model(eng.reader, cfg, w, DenseFFN(cfg), 64, 2, device="cuda",
                     disable_gpu_index=True, backend=_device(backend))
    assert isinstance(gm, GpuModel) and gm.plan.n_resident == cfg.n_layer
    assert all(ly.down is None and ly.down_rows.rows == cfg.n_embd for ly in gm.layers)
    assert gm.device_bytes == gm.plan.planned_bytes  # the budget counts the rows' q8 input too
    assert all(lw.ffn_down_t is None for lw in w.layers)  # the engine's weights stay as mapped
    assert rel_err(decode_all(gm, PROMPT), ref) < TOL_SAME
    assert rel_err(gm.forward(PROMPT, 0, all_logits=True), ref) < TOL_SAME
    from pyinfer.hybrid import neuron_major_down
    from pyinfer.ops.reference import dequantize

    t = neuron_major_down(w).layers[0]
    assert t.ffn_down is None and t.ffn_down_t.qtype == w.layers[0].ffn_down.qtype
    want = dequantize(w.layers[0].ffn_down).T
    err = np.abs(dequantize(t.ffn_down_t) - want).max() / np.abs(want).max()
    assert err == 0.0 if outtype == "f16" else err < 0.2
    # -ngl 1: layer 0 on the device, the others on the CPU, all over the rows as stored
    lo = place_model(eng.reader, cfg, w, DenseFFN(cfg), 64, 2, device="cuda", n_gpu_layers=1,
                     backend=_device(backend))
    assert lo.plan.n_resident == 1 and lo.device_bytes == lo.plan.planned_bytes
    assert rel_err(decode_all(lo, PROMPT), ref) < TOL_SAME


def test_numpy_twins_match_cpu_kernels():
    rng = np.random.default_rng(0)
    dev = NumpyDevice()
    for qt in (QT.F32, QT.F16, QT.Q8_0, QT.Q4_0):
        w = QTensor.from_array(rng.normal(size=(40, 96)).astype(np.float32), qt)
        ids = np.array([3, 0, 39, 17], np.int32)
        ref = np.empty((4, 96), np.float32)
        cpu.get_rows(w, ids, ref)
        rows = dev.rows([w], ids)
        assert rows.data.flags.c_contiguous and rows.nbytes == 4 * w.raw.shape[1]
        np.testing.assert_array_equal(rows.f32, ref)
        np.testing.assert_array_equal(dequantize_rows(w.raw[ids], qt, 96), ref)
        coef = rng.normal(size=4).astype(np.float32)
        coef[1] = 0.0
        out, want = np.full(96, np.nan, np.float32), np.empty(96, np.float32)
        dev.axpy_rows(rows, coef, out)
        cpu.axpy_rows(w, coef, ids, want)
        atol = 1e-5
        if qt in (QT.Q8_0, QT.Q4_0):
            # the CPU sums q8_0/q4_0 rows with int16 coefficients (cython/axpyq.h), the twin in
            # f32 as the CUDA kernel does: axpyq.h's stated bound per column i of block b,
            # max_j |coef[j] d[j,b]| / 65534 * sum_j |v[j,i]| (v = w / d, the integer value)
            d = np.asarray(w.raw[ids]).reshape(4, 3, -1)[:, :, :2].copy().view(np.float16)
            d = np.repeat(d[:, :, 0].astype(np.float64), 32, axis=1)  # (4, 96)
            v = np.abs(rows.f32 / np.where(d == 0, 1, d))
            atol = np.max(np.abs(coef[:, None] * d), axis=0) / 65534 * v.sum(axis=0) + 1e-6
        assert np.all(np.abs(out - want) <= atol), (qt, np.max(np.abs(out - want) / atol))
    # the one-token twins against the CPU kernels: rmsnorm, RoPE, attention
    x = rng.normal(size=(3, 64)).astype(np.float32)
    wn = rng.normal(size=64).astype(np.float32)
    want = np.empty_like(x)
    cpu.rmsnorm(x, wn, 1e-5, want)
    got = np.full_like(x, np.nan)
    dev.rmsnorm(x, wn, 1e-5, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    n_ctx, n_head, n_kv, hd = 16, 4, 2, 32
    cs = X.rope_cos_sin(n_ctx, hd, 1e4)
    ck, cv = rng.normal(size=(2, n_ctx, n_kv, hd)).astype(np.float32)
    ck_ref, cv_ref = ck.copy(), cv.copy()
    q = rng.normal(size=(n_head, hd)).astype(np.float32)
    k = rng.normal(size=(n_kv, hd)).astype(np.float32)
    v = rng.normal(size=(n_kv, hd)).astype(np.float32)
    q_ref, k_ref = q.copy()[None], k.copy()[None]
    cpu.rope_neox(q_ref, [9], 1e4, hd)
    cpu.rope_neox(k_ref, [9], 1e4, hd)
    ck_ref[9], cv_ref[9] = k_ref[0], v
    dev.rope_store(q, k, v, ck, cv, cs, np.array([9], np.int32))
    np.testing.assert_allclose(q, q_ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ck, ck_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cv, cv_ref)
    out, want = np.full((n_head, hd), np.nan, np.float32), np.empty((1, n_head, hd), np.float32)
    dev.attn_decode(q, ck, cv, np.array([9], np.int32), out, 10)
    reference.attention(q[None].copy(), ck, cv, 9, want)  # the device cache stays f32 (the CPU kernel takes f16)
    np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-5)


def test_budget_counts_what_is_allocated(tmp_path, capsys):
    """The plan's bytes are exactly what the device allocates, within the budget; a larger budget
    holds more hot neurons; a budget below the fixed parts keeps only some layers' attention."""
    from pyinfer.hybrid import _Sizes

    eng = engine_for(tmp_path, "relu", "f16")
    cfg, w = eng.cfg, eng.weights
    sizes = _Sizes(cfg, w, sparse_ffn(cfg, "relu"), 64, dense=False)
    all_neurons = sum(sizes.neuron) * cfg.n_ff
    prev = -1
    for frac in (0.4, 0.7, 1.1):  # the solver puts at least 256 neurons in a layer it splits
        budget = sizes.fixed() + frac * all_neurons
        dev = NumpyDevice(free_bytes=1 * GiB)
        gm = place_model(None, cfg, w, sparse_ffn(cfg, "relu"), 64, 2, device="cuda",
                         vram_budget=budget / GiB, backend=dev)
        assert gm.plan.n_resident == cfg.n_layer and gm.plan.output
        assert gm.device_bytes == dev.allocated_bytes == gm.plan.planned_bytes
        assert gm.device_bytes + sizes.reserve <= budget
        assert gm.n_hot > prev
        prev = gm.n_hot
    assert prev == cfg.n_ff * cfg.n_layer  # the last budget holds everything
    budget = sizes.buffers + sizes.reserve + sizes.layer[0] + sizes.layer[1] // 2
    tiny = place_model(None, cfg, w, sparse_ffn(cfg, "relu"), 64, 2, device="cuda",
                       vram_budget=budget / GiB, backend=NumpyDevice(free_bytes=1 * GiB))
    assert tiny.plan.n_resident == 1 and tiny.n_hot == 0 and not tiny.plan.output
    assert tiny.device_bytes == tiny.plan.planned_bytes
    assert "holds the attention of 1/3 layers" in capsys.readouterr().err
    ref = decode_all(Model(cfg, w, 64, 2, ffn=sparse_ffn(cfg, "relu"), cache_type="f32"), PROMPT[:4])
    assert rel_err(decode_all(tiny, PROMPT[:4]), ref) < 1e-4
    # whole layers at the same rules
    lo = place_model(None, cfg, w, DenseFFN(cfg), 64, 2, device="cuda", n_gpu_layers=2,
                     backend=NumpyDevice(free_bytes=1 * GiB))
    assert lo.plan.n_resident == 2 and lo.device_bytes == lo.plan.planned_bytes
    # llama.cpp's -ngl 99 (more than the model's layers): every layer, not "99 do not fit"
    every = place_model(None, cfg, w, DenseFFN(cfg), 64, 2, device="cuda", n_gpu_layers=99,
                        backend=NumpyDevice(free_bytes=1 * GiB))
    assert every.plan.n_resident == cfg.n_layer and every.plan.output
    with pytest.raises(PyinferError, match="do not fit"):
        place_model(None, cfg, w, DenseFFN(cfg), 64, 2, device="cuda", n_gpu_layers=3,
                    vram_budget=budget / GiB, backend=NumpyDevice(free_bytes=1 * GiB))
    with pytest.raises(PyinferError, match=f"^-ngl 99: {cfg.n_layer} whole layers do not fit"):
        place_model(None, cfg, w, DenseFFN(cfg), 64, 2, device="cuda", n_gpu_layers=99,
                    vram_budget=budget / GiB, backend=NumpyDevice(free_bytes=1 * GiB))


def test_place_model_options(tmp_path, capsys):
    eng = engine_for(tmp_path, "relu", "f16")
    cfg, w = eng.cfg, eng.weights
    ffn = sparse_ffn(cfg, "relu")
    assert type(eng.model) is Model  # Engine defaults to the CPU (tests and the offline stage)
    with pytest.raises(PyinferError, match="more than the free device memory"):
        place_model(eng.reader, cfg, w, ffn, 64, 2, device="cuda", vram_budget=2.0,
                    backend=NumpyDevice(free_bytes=1 * GiB))
    with pytest.raises(PyinferError, match="must be > 0"):
        place_model(eng.reader, cfg, w, ffn, 64, 2, device="cuda", vram_budget=-1.0,
                    backend=NumpyDevice())
    with pytest.raises(PyinferError, match="unknown device"):
        place_model(eng.reader, cfg, w, ffn, 64, 2, device="tpu")
    with pytest.raises(PyinferError, match="for a GPU device"):
        place_model(eng.reader, cfg, w, ffn, 64, 2, device="cpu", vram_budget=1.0)
    assert type(place_model(eng.reader, cfg, w, ffn, 64, 2, device="cpu")) is Model
    if not cuda.available():
        with pytest.raises(PyinferError, match="no CUDA device"):
            place_model(eng.reader, cfg, w, ffn, 64, 2, device="cuda")
        capsys.readouterr()
        assert type(place_model(eng.reader, cfg, w, ffn, 64, 2, device="auto")) is Model
        assert "running on the CPU" in capsys.readouterr().err
    # disable_gpu_index: whole layers, every one fits here
    gm = place_model(eng.reader, cfg, w, ffn, 64, 2, device="cuda", disable_gpu_index=True,
                     backend=NumpyDevice())
    assert gm.plan.n_resident == cfg.n_layer and gm.n_hot == cfg.n_ff * cfg.n_layer


def test_a_layer_with_gate_and_up_of_two_types_stays_off_the_gpu(tmp_path, capsys):
    """The device's gate/up kernel reads both rows with the gate's type and row size; a file
    whose ffn_up has another type (a llama.cpp mix under --outtype auto) decoded wrong numbers
    on the GPU. Such a file is refused (--device cuda) or runs on the CPU (auto)."""
    import dataclasses

    eng = engine_for(tmp_path, "relu", "q4_0")
    cfg, w = eng.cfg, eng.weights
    lw = w.layers[1]
    mixed = dataclasses.replace(w, layers=[*w.layers[:1], dataclasses.replace(
        lw, ffn_up=QTensor.from_array(reference.dequantize(lw.ffn_up), QT.Q8_0)), *w.layers[2:]])
    ffn = sparse_ffn(cfg, "relu")
    with pytest.raises(PyinferError, match="layer 1's are q4_0 and q8_0"):
        place_model(eng.reader, cfg, mixed, ffn, 64, 2, device="cuda", backend=NumpyDevice())
    assert type(place_model(eng.reader, cfg, w, ffn, 64, 2, device="cuda",
                            backend=NumpyDevice())) is not Model  # one type: on the device


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
    assert ptx.count(".entry") == cuda.N_KERNELS[name]


def _nvrtc_check():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tools"))
    import nvrtc_check

    if nvrtc_check.find_nvrtc() is None:
        pytest.skip("libnvrtc not found (the test extra's nvidia-cuda-nvrtc-cu12, x86-64 Linux)")
    return nvrtc_check


@pytest.mark.parametrize("arch", ["sm_75", "sm_86", "sm_90"])
@pytest.mark.parametrize("name", sorted(cuda.SOURCES))
def test_cuda_source_compiles_with_nvrtc(name, arch):
    """Every CUDA source compiles with NVRTC, the compiler CuPy runs on a device, with CuPy's
    options as pyinfer passes them, through ptxas for Turing, consumer Ampere and Hopper: the
    kernel count the module declares, no spills, and the 1024-thread RMSNorm kernels
    (``__launch_bounds__(1024)``) within 64 registers."""
    nv = _nvrtc_check()
    kernels = {k.name: k for k in nv.compile_source(cuda.SOURCES[name], f"{name}.cu", arch)}
    assert len(kernels) == cuda.N_KERNELS[name], sorted(kernels)
    assert [k for k in kernels.values() if k.spill_stores or k.spill_loads] == []
    for k in kernels.values():
        if k.name == "rmsnorm_f32" or k.name.startswith("norm_fc1_"):
            assert 0 < k.registers <= 64, k


def test_kernel_forms_switch_and_restore():
    """cuda.kernel_forms sets the forms for its block only (also when the block raises), rejects
    an unknown name, and RMSNorm's register form is sized as its source says (PI_NORM_VEC float4s
    a thread, at most 1024 threads, a multiple of 32: every row it takes fits), as is the
    block-sum GEMV's shared array."""
    before = (cuda.gemv_wide(), cuda.norm_vec(), cuda.gate_up_wide())
    with pytest.raises(KeyError):
        with cuda.kernel_forms(gemv_wide=not before[0], norm_vec=not before[1]):
            assert (cuda.gemv_wide(), cuda.norm_vec()) == (not before[0], not before[1])
            raise KeyError
    assert (cuda.gemv_wide(), cuda.norm_vec(), cuda.gate_up_wide()) == before
    with pytest.raises(TypeError, match="unknown kernel form"):
        with cuda.kernel_forms(gemv_wider=True):
            pass
    assert f"#define PI_NORM_VEC {cuda._NORM_VEC_PER} " in cuda.ATTN_SRC
    assert f"__shared__ int xs[{cuda._GEMV_SUMS_BLOCKS}];" in cuda.GATHER_SRC
    for n in (32, 96, 576, 4096, 5120, 8192, 16384):
        t = cuda._norm_vec_block(n)
        assert t % 32 == 0 and t <= 1024 and cuda._NORM_VEC_PER * 4 * t >= n, (n, t)


def test_nvrtc_check_reports_a_compile_error():
    """A source with an error raises CompileError with NVRTC's message (the check above cannot
    pass a source NVRTC rejects)."""
    nv = _nvrtc_check()
    with pytest.raises(nv.CompileError, match="undefined"):
        nv.compile_source(cuda.COMMON_SRC + "__global__ void k(float* x) { x[0] = nope; }")


# ---- on a CUDA device ---------------------------------------------------------------------------


#: the kernel forms other than the defaults that are not yet the default (session 29: the wide
#: one-row GEMV dots and RMSNorm in registers; q4_0's GEMV with x's block sums), for the GPU
#: tests to run every way
OTHER_FORMS = {"gemv_wide": True, "norm_vec": True}
SUMS_FORMS = {"gemv_sums": True}


@pytest.mark.parametrize("qt", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0])
@pytest.mark.parametrize("rows,cols", [(300, 256), (77, 96), (1000, 4096)])
@pytest.mark.parametrize("forms", [{}, OTHER_FORMS, SUMS_FORMS],
                         ids=["default", "other_forms", "gemv_sums"])
@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
def test_gpu_kernels_match_numpy_twins(qt, rows, cols, forms):
    with cuda.kernel_forms(**forms):
        _gpu_kernels_match_numpy_twins(qt, rows, cols)


def _gpu_kernels_match_numpy_twins(qt, rows, cols):
    from pyinfer.device import CupyDevice

    cp = cuda.cupy
    rng = np.random.default_rng(rows + cols)
    g = CupyDevice()
    n = NumpyDevice()
    n_ff = 2 * rows
    W = {k: QTensor.from_array(rng.normal(size=(n_ff, cols)).astype(np.float32), qt)
         for k in ("gate", "up", "down")}
    ids = np.sort(rng.choice(n_ff, rows, replace=False)).astype(np.int32)
    x = rng.normal(size=cols).astype(np.float32)
    mask = (rng.random(n_ff) < 0.3).astype(np.uint8)
    rtol = 1e-4 if qt != QT.F16 else 2e-4
    gd = {k: g.rows([w], ids) for k, w in W.items()}
    nd = {k: n.rows([w], ids) for k, w in W.items()}
    np.testing.assert_array_equal(cp.asnumpy(gd["gate"].data), nd["gate"].data)
    xd, idd, md = cp.asarray(x), cp.asarray(ids), cp.asarray(mask)
    with g.activate():
        for use_mask in (False, True):
            for acc in (False, True):
                base = rng.normal(size=rows).astype(np.float32)
                out = cp.asarray(base) if acc else cp.full(rows, cp.nan, cp.float32)
                want = base.copy()
                g.gemv(gd["gate"], xd, out, idd if use_mask else None, md if use_mask else None, acc)
                n.gemv(nd["gate"], x, want, ids if use_mask else None, mask if use_mask else None, acc)
                np.testing.assert_allclose(out.get(), want, rtol=rtol, atol=rtol * np.abs(want).max())
        # (the last case: every row a candidate, no mask: the dense FFN's form, gemv_wide's)
        for act, thr, glu, use_mask in (("relu", 0.0, False, True), ("silu", 0.05, False, True),
                                        ("relu", -1.0, False, True), ("silu", 0.5, True, True),
                                        ("silu", -1.0, False, False)):
            coef = cp.full(rows, cp.nan, cp.float32)
            cnt = cp.zeros(2, cp.uint64)
            want, wcnt = np.empty(rows, np.float32), np.zeros(2, np.uint64)
            g.ffn_gate_up(gd["gate"], gd["up"], xd, coef, cnt, act, thr, idd,
                          md if use_mask else None, glu)
            n.ffn_gate_up(nd["gate"], nd["up"], x, want, wcnt, act, thr, ids,
                          mask if use_mask else None, glu)
            scale = np.abs(want).max() or 1.0
            np.testing.assert_allclose(coef.get(), want, rtol=1e-3, atol=1e-3 * scale)
            assert abs(int(cnt.get()[1]) - int(wcnt[1])) <= 1 and int(cnt.get()[0]) == int(wcnt[0])
            for skip, acc in ((True, False), (False, True)):
                base = rng.normal(size=cols).astype(np.float32)
                o = cp.asarray(base) if acc else cp.full(cols, cp.nan, cp.float32)
                w2 = base.copy()
                g.axpy_rows(gd["down"], cp.asarray(want), o, skip, acc)
                n.axpy_rows(nd["down"], want, w2, skip, acc)
                np.testing.assert_allclose(o.get(), w2, rtol=1e-4, atol=1e-4 * np.abs(w2).max())
        deq = cp.full(rows * cols, cp.nan, cp.float32)
        g.dequant(gd["down"], 5, rows - 5, deq)
        np.testing.assert_array_equal(deq[:(rows - 5) * cols].get(), nd["down"].f32[5:].reshape(-1))
        # predictor, f32 and f16 as files store it
        rank = 24
        for dt in (np.float32, np.float16):
            fc1 = QTensor(rng.normal(size=(rank, cols)).astype(dt), QT.F32 if dt == np.float32 else QT.F16, rank, cols)
            fc2 = QTensor(rng.normal(size=(n_ff, rank)).astype(dt), fc1.qtype, n_ff, rank)
            m_d = cp.full(n_ff, 7, cp.uint8)
            m_h = np.empty(n_ff, np.uint8)
            g.predict(g.rows([fc1]), g.rows([fc2]), 0.5, xd, cp.empty(rank, cp.float32), m_d)
            n.predict(n.rows([fc1]), n.rows([fc2]), 0.5, x, np.empty(rank, np.float32), m_h)
            assert np.mean(m_d.get() != m_h) < 0.01
        # rmsnorm, RoPE + KV store, attention, add
        xs = rng.normal(size=(3, cols)).astype(np.float32)
        wn = rng.normal(size=cols).astype(np.float32)
        o = cp.full((3, cols), cp.nan, cp.float32)
        g.rmsnorm(cp.asarray(xs), cp.asarray(wn), 1e-5, o)
        np.testing.assert_allclose(o.get(), X.rmsnorm(xs, wn, 1e-5), rtol=1e-5, atol=1e-5)
        n_ctx, n_head, n_kv, hd = 40, 8, 2, 64
        cs = X.rope_cos_sin(n_ctx, hd, 1e4)
        ck, cv = rng.normal(size=(2, n_ctx, n_kv, hd)).astype(np.float32)
        q, k, v = (rng.normal(size=(h_, hd)).astype(np.float32) for h_ in (n_head, n_kv, n_kv))
        qd, ckd, cvd = cp.asarray(q), cp.asarray(ck), cp.asarray(cv)
        g.rope_store(qd, cp.asarray(k), cp.asarray(v), ckd, cvd, cp.asarray(cs),
                     cp.asarray([30], cp.int32))
        n.rope_store(q, k, v, ck, cv, cs, np.array([30], np.int32))
        np.testing.assert_allclose(qd.get(), q, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ckd.get(), ck, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(cvd.get(), cv)
        od = cp.full((n_head, hd), cp.nan, cp.float32)
        oh = np.empty((n_head, hd), np.float32)
        g.attn_decode(qd, ckd, cvd, cp.asarray([30], cp.int32), od, n_ctx)  # any bound >= 31
        n.attn_decode(q, ck, cv, np.array([30], np.int32), oh, 31)
        np.testing.assert_allclose(od.get(), oh, rtol=1e-4, atol=1e-5)
        a, b = rng.normal(size=(2, cols)).astype(np.float32)
        ad = cp.asarray(a)
        g.add(ad, cp.asarray(b))
        np.testing.assert_allclose(ad.get(), a + b, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("qt", [QT.F16, QT.Q8_0, QT.Q4_0])
def test_gpu_gate_up_with_predictor_both_forms(qt):
    """ffn_gate_up with a predictor, fused (one launch) and listed (hot_candidates, then
    ffn_gate_up_list_*): the same coefficients bit for bit and the same counts, and the NumPy
    twin's within float rounding; the list form run twice (its count is zeroed per call). The
    wide forms (``set_gate_up_wide``, both launch forms): the same candidates, the same
    coefficients up to the order of the sums."""
    from pyinfer.device import CupyDevice

    cp = cuda.cupy
    rng = np.random.default_rng(int(qt))
    g, n = CupyDevice(), NumpyDevice()
    n_ff, rows, cols, rank = 2000, 1500, 512, 40
    W = {k: QTensor.from_array(rng.normal(size=(n_ff, cols)).astype(np.float32), qt)
         for k in ("gate", "up")}
    ids = np.sort(rng.choice(n_ff, rows, replace=False)).astype(np.int32)
    fc2 = QTensor(rng.normal(size=(n_ff, rank)).astype(np.float16), QT.F16, n_ff, rank)
    x = rng.normal(size=cols).astype(np.float32)
    hid = np.maximum(rng.normal(size=rank), 0).astype(np.float32)
    thr = 1.0  # about a third of the rows are candidates
    gd = {k: g.rows([w], ids) for k, w in W.items()}
    nd = {k: n.rows([w], ids) for k, w in W.items()}
    with g.activate():
        f2d, hd, xd, idd = g.rows([fc2]), cp.asarray(hid), cp.asarray(x), cp.asarray(ids)
        for act, act_thr, glu in (("relu", 0.0, False), ("silu", 0.05, False), ("silu", 0.5, True)):
            got = {}
            wide0 = cuda.gate_up_wide()
            for form in ((False, False), (True, False), (True, False), (False, True), (True, True)):
                cuda.set_gate_up_list(form[0])
                cuda.set_gate_up_wide(form[1])
                try:
                    coef, cnt = cp.full(rows, cp.nan, cp.float32), cp.zeros(2, cp.uint64)
                    g.ffn_gate_up(gd["gate"], gd["up"], xd, coef, cnt, act, act_thr, idd,
                                  glu=glu, pred=(f2d, hd, thr))
                    got.setdefault(form, []).append((coef.get(), cnt.get()))
                finally:
                    cuda.set_gate_up_list(False)
                    cuda.set_gate_up_wide(wide0)
            (c0, n0), (c1, n1), (c2, n2) = got[False, False][0], *got[True, False]
            np.testing.assert_array_equal(c1, c0)
            np.testing.assert_array_equal(c2, c0)
            assert list(n1) == list(n0) == list(n2)
            for c_w, n_w in (got[False, True][0], got[True, True][0]):
                assert n_w[0] == n0[0] and abs(int(n_w[1]) - int(n0[1])) <= 2
                scale = np.abs(c0).max() or 1.0
                assert (np.abs(c_w - c0) <= 1e-5 * scale).mean() > 0.99
            want, wcnt = np.empty(rows, np.float32), np.zeros(2, np.uint64)
            n.ffn_gate_up(nd["gate"], nd["up"], x, want, wcnt, act, act_thr, ids, glu=glu,
                          pred=(n.rows([fc2]), hid, thr))
            assert 0 < int(wcnt[0]) < rows and abs(int(n0[0]) - int(wcnt[0])) <= 2
            scale = np.abs(want).max() or 1.0
            close = np.abs(c0 - want) <= 1e-3 * scale
            assert close.mean() > 0.99  # a candidate at the predictor's threshold may differ


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("norm_vec", [False, True])
def test_gpu_q8_activation_is_the_cpu_kernels(norm_vec):
    """cuda.quantize_q8 and the q8 epilogues of rmsnorm, norm_fc1 (both RMSNorm forms:
    ``set_norm_vec``) and attn_decode (fused where head_dim is a multiple of 32, a second launch
    where not) give, bit for bit, the q8 form the CPU kernels' quantization (simd.h
    pi_quantize_q8, its NumPy twin) gives the same f32 values; the norms' values are
    X.rmsnorm's within float rounding."""
    with cuda.kernel_forms(norm_vec=norm_vec):
        _gpu_q8_activation_is_the_cpu_kernels()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("norm_vec", [False, True])
def test_gpu_q8_activation_keeps_nan(norm_vec):
    """A NaN in a 32-block gives that block's q8 scale NaN (its dots NaN), as the CPU kernels'
    NaN-keeping maximum (simd.h) and the NumPy twin do, in cuda.quantize_q8 and in the RMSNorm
    q8 epilogue (a NaN norm weight makes one output NaN); the other blocks are the twin's."""
    from pyinfer.device import CupyDevice, quantize_q8

    cp = cuda.cupy
    rng = np.random.default_rng(6)
    n = 4096
    x = rng.normal(size=n).astype(np.float32)
    x[40] = np.nan  # block 1
    twin_q, twin_d = np.zeros(n, np.int8), np.zeros(n // 32, np.float32)
    quantize_q8(x, (twin_q, twin_d))
    assert np.isnan(twin_d[1])
    g = CupyDevice()
    with cuda.kernel_forms(norm_vec=norm_vec), g.activate():
        q8 = cuda.q8_buffers(n)
        cuda.quantize_q8(cp.asarray(x), q8)
        d = q8[1].get()[:n // 32]
        assert np.isnan(d[1]) and np.isfinite(np.delete(d, 1)).all()
        np.testing.assert_array_equal(np.delete(d, 1), np.delete(twin_d, 1))
        wn = rng.normal(size=n).astype(np.float32)
        wn[40] = np.nan
        xf = rng.normal(size=n).astype(np.float32)
        h = cp.full((1, n), cp.nan, cp.float32)
        hq8 = cuda.q8_buffers(n)
        g.rmsnorm(cp.asarray(xf).reshape(1, n), cp.asarray(wn), 1e-5, h, q8=hq8)
        hd = hq8[1].get()[:n // 32]
        assert np.isnan(hd[1]) and np.isfinite(np.delete(hd, 1)).all()


def _gpu_q8_activation_is_the_cpu_kernels():
    from pyinfer.device import CupyDevice, quantize_q8

    cp = cuda.cupy
    rng = np.random.default_rng(5)
    g = CupyDevice()

    def check(vals, q8):
        v = vals.get().reshape(-1)
        q, d = np.zeros(v.size, np.int8), np.zeros(v.size // 32, np.float32)
        quantize_q8(v, (q, d))
        np.testing.assert_array_equal(q8[0].get()[:q.size], q)
        np.testing.assert_array_equal(q8[1].get()[:d.size], d)

    n = 4096
    with g.activate():
        q8 = cuda.q8_buffers(n)
        x = rng.normal(size=n).astype(np.float32)
        x[:32] = 0.0  # a zero block: d = 0, q = 0
        x[32:64] *= 1e-30  # tiny values: 1 / d is large but finite
        xd = cp.asarray(x)
        cuda.quantize_q8(xd, q8)
        check(xd, q8)
        wn_h = rng.normal(size=n).astype(np.float32)
        wn = cp.asarray(wn_h)
        h = cp.full((1, n), cp.nan, cp.float32)
        g.rmsnorm(xd.reshape(1, n), wn, 1e-5, h, q8=q8)
        check(h, q8)
        np.testing.assert_allclose(h.get(), X.rmsnorm(x.reshape(1, n), wn_h, 1e-5), rtol=1e-5,
                                   atol=1e-6)
        fc1 = g.rows([QTensor(rng.normal(size=(16, n)).astype(np.float16), QT.F16, 16, n)])
        h2 = cp.full(n, cp.nan, cp.float32)
        x2 = rng.normal(size=n).astype(np.float32)
        g.norm_fc1(fc1, cp.asarray(x2), cp.empty(16, cp.float32), wn, 1e-5, h2, q8=q8)
        check(h2, q8)
        np.testing.assert_allclose(h2.get(), X.rmsnorm(x2.reshape(1, n), wn_h, 1e-5)[0],
                                   rtol=1e-5, atol=1e-6)
        for rows_, m in ((3, 576), (2, 5120)):  # a row under a block's float4s, one over
            xs = rng.normal(size=(rows_, m)).astype(np.float32)
            wm = rng.normal(size=m).astype(np.float32)
            hq8 = cuda.q8_buffers(rows_ * m)
            hs = cp.full((rows_, m), cp.nan, cp.float32)
            g.rmsnorm(cp.asarray(xs), cp.asarray(wm), 1e-5, hs, q8=hq8)
            check(hs, hq8)
            np.testing.assert_allclose(hs.get(), X.rmsnorm(xs, wm, 1e-5), rtol=1e-5, atol=1e-6)
        for n_head, hd in ((8, 64), (8, 48)):
            ck, cv = (cp.asarray(rng.normal(size=(20, 2, hd)).astype(np.float32)) for _ in range(2))
            q = cp.asarray(rng.normal(size=(n_head, hd)).astype(np.float32))
            out = cp.full((n_head, hd), cp.nan, cp.float32)
            g.attn_decode(q, ck, cv, cp.asarray([12], cp.int32), out, 20, q8=q8)
            check(out, q8)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("hidden_act,outtype,mode", [("relu", "f32", "relu"), ("silu", "f16", "glu"),
                                                     ("relu", "q4_0", "relu")])
@pytest.mark.parametrize("kind", ["random", "all", "partial"])
def test_gpu_model_equals_cpu_model(tmp_path, hidden_act, outtype, mode, kind):
    from pyinfer.device import CupyDevice

    eng = engine_for(tmp_path, hidden_act, outtype)
    compare(eng, lambda: sparse_ffn(eng.cfg, hidden_act, mode), plan_for(kind, eng.cfg), outtype,
            CupyDevice(), exact_counts=False)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("hidden_act,outtype,mode", [("relu", "q4_0", "relu"), ("silu", "q8_0", "glu")])
@pytest.mark.parametrize("listed", [False, True])
def test_gpu_model_with_other_gate_up_dots_equals_cpu_model(tmp_path, hidden_act, outtype, mode,
                                                            listed):
    """The hot neurons' gate/up dots other than the default (``cuda.set_gate_up_wide``: the
    GEMV's dots, since the wide ones are the default), fused and listed, in the whole GPU model,
    decode through CUDA graphs included: the CPU model's logits, as the default form."""
    from pyinfer.device import CupyDevice

    eng = engine_for(tmp_path, hidden_act, outtype)
    wide0 = cuda.gate_up_wide()
    cuda.set_gate_up_wide(not wide0)
    cuda.set_gate_up_list(listed)
    try:
        compare(eng, lambda: sparse_ffn(eng.cfg, hidden_act, mode), plan_for("partial", eng.cfg),
                outtype, CupyDevice(), exact_counts=False)
    finally:
        cuda.set_gate_up_wide(wide0)
        cuda.set_gate_up_list(False)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("hidden_act,outtype,mode", [("relu", "q4_0", "relu"), ("silu", "q8_0", "glu")])
@pytest.mark.parametrize("kind", ["all", "partial"])
@pytest.mark.parametrize("forms", [OTHER_FORMS, SUMS_FORMS], ids=["other_forms", "gemv_sums"])
def test_gpu_model_with_other_forms_equals_cpu_model(tmp_path, hidden_act, outtype, mode, kind,
                                                     forms):
    """The kernel forms not yet the default (``OTHER_FORMS``: the wide one-row GEMV dots,
    RMSNorm in registers; ``SUMS_FORMS``: q4_0's GEMV with x's block sums) in the whole GPU
    model, decode through CUDA graphs and prefill included: the CPU model's logits, as the
    default forms."""
    from pyinfer.device import CupyDevice

    eng = engine_for(tmp_path, hidden_act, outtype)
    with cuda.kernel_forms(**forms):
        compare(eng, lambda: sparse_ffn(eng.cfg, hidden_act, mode), plan_for(kind, eng.cfg),
                outtype, CupyDevice(), exact_counts=False)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
def test_gpu_memory_pool_holds_the_plan(tmp_path):
    """CuPy's pool grows by exactly the plan's bytes (up to its 512-byte rounding), and stays
    within the budget through a prefill and decode."""
    from pyinfer.hybrid import _Sizes

    cp = cuda.cupy
    eng = engine_for(tmp_path, "relu", "f16")
    cfg, w = eng.cfg, eng.weights
    sizes = _Sizes(cfg, w, sparse_ffn(cfg, "relu"), 64, dense=False)
    budget = (sizes.fixed() + 0.7 * cfg.n_ff * sum(sizes.neuron)) / GiB
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    used0 = pool.used_bytes()
    gm = place_model(None, cfg, w, sparse_ffn(cfg, "relu"), 64, 2, device="cuda", vram_budget=budget)
    assert isinstance(gm, GpuModel) and 0 < gm.n_hot < cfg.n_ff * cfg.n_layer
    grown = pool.used_bytes() - used0
    n_arrays = 64  # every allocation rounds up to 512 bytes
    assert gm.plan.planned_bytes <= grown <= gm.plan.planned_bytes + 512 * n_arrays
    gm.forward(PROMPT, 0)
    gm.forward([5], len(PROMPT))
    gm.dev.synchronize()
    assert pool.total_bytes() - used0 <= budget * GiB


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
def test_gpu_engine_auto_device(tmp_path):
    eng = engine_for(tmp_path, "relu", "f16")
    gpu_eng = Engine(eng.path, n_ctx=64, n_threads=2, dense=True, device=None)
    eng.model.set_cache_type("f32")  # the device keeps f32 keys and values
    assert isinstance(gpu_eng.model, GpuModel) and gpu_eng.model.plan.n_resident == eng.cfg.n_layer
    assert rel_err(decode_all(gpu_eng.model, PROMPT), decode_all(eng.model, PROMPT)) < 1e-4
    lo = Engine(eng.path, n_ctx=64, n_threads=2, dense=True, device="cuda", n_gpu_layers=2)
    assert lo.model.plan.n_resident == 2
    assert rel_err(decode_all(lo.model, PROMPT), decode_all(eng.model, PROMPT)) < 1e-4


def test_types_the_gpu_cannot_read(tmp_path, capsys):
    """A file at a type without GPU kernels (q4_1: what --outtype auto keeps for SmolLM2) runs on
    the CPU with a notice under --device auto and is a clear error under --device cuda."""
    eng = engine_for(tmp_path, "relu", "q4_1", n_layers=2)
    cfg, w = eng.cfg, eng.weights
    with pytest.raises(PyinferError, match="not q4_1"):
        place_model(None, cfg, w, sparse_ffn(cfg, "relu"), 64, 2, device="cuda",
                    backend=NumpyDevice())
    m = place_model(None, cfg, w, sparse_ffn(cfg, "relu"), 64, 2, device="auto")
    assert not isinstance(m, GpuModel)
    if cuda.available():
        assert "not q4_1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory):
    """A random SwiGLU Llama whose shapes take the input-block layout (outputs multiples of 64,
    n_vocab too, so q8_0/q4_0 files get an input-sparse lm head)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_random_llama(tmp_path_factory.mktemp("gpu_in"), hidden_act="silu", tokenizer="bpe",
                             intermediate_size=128, n_layers=2, vocab_size=576, name="silu")


def input_engine(input_dir, tmp_path, outtype):
    """An Engine (CPU, f32 cache: the device's) over ``input_dir`` converted with sparse mode
    input at 50%. Round-to-nearest scales (``--no-imatrix``): with the default's weighted q4_0
    scales one channel's input lands on its threshold at the prompt's eighth position, where the
    NumPy twin's float sums and the CPU's integer sums (1e-7 apart) fall on either side of it;
    these tests compare engines on one set of numbers, and these keep the kept channels clear
    of their thresholds."""
    from convert.cli import main as convert_main

    out = str(tmp_path / f"in.{outtype}.gguf")
    assert convert_main([input_dir, out, "--outtype", outtype, "--sparse-mode", "input",
                         "--target-sparsity", "0.5", "--calib-tokens", "128", "-t", "1",
                         "--no-imatrix"]) == 0
    eng = Engine(out, n_ctx=64, n_threads=2)
    eng.model.set_cache_type("f32")
    return eng


@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_input_sparse_file_on_the_device(input_dir, tmp_path, outtype, backend):
    """Sparse mode input (issue 12) on the device: a mask before every projection, which reads
    only the kept channels' rows (input-block GEMV, f16 AXPY). All layers resident, -ngl 1, and
    all resident with a dense lm head (q4_1, q5_0, q5_1: on the CPU, no GEMV of theirs) give the CPU model's
    logits (decode and prefill) with the same input channels kept (NumpyDevice: exactly; a GPU:
    within 1%), the input-sparse lm head's too (two-stage: the copy on the device, the exact
    candidates on the host); the plan's bytes are what is allocated."""
    from pyinfer.input_sparse import InputSparseFFN, thresholds_from_reader

    eng = input_engine(input_dir, tmp_path, outtype)
    cfg, w = eng.cfg, eng.weights
    assert eng.model.ffn.lm_head_thr is not None  # n_vocab % 64 == 0: the head is input-sparse
    tol, exact = (TOL_SAME, True) if backend == "numpy" else (TOL[outtype], False)
    for ngl, dense_head in ((None, False), (1, False), (None, True)):
        thr = thresholds_from_reader(eng.reader, cfg)
        if dense_head:
            del thr["output"]
        ref_ffn = InputSparseFFN(cfg, thr)
        ref = decode_all(Model(cfg, w, 64, 2, ffn=ref_ffn, cache_type="f32"), PROMPT)
        dev = _device(backend)
        gm = place_model(eng.reader, cfg, w, InputSparseFFN(cfg, thr), 64, 2, device="cuda",
                         n_gpu_layers=ngl, backend=dev)
        assert isinstance(gm, GpuModel) and gm.is_input_sparse and gm.is_sparse
        assert gm.plan.n_resident == (ngl or cfg.n_layer)
        # the head on the device: input-sparse (input-block GEMVs), or dense where the GPU reads
        # its type (not q4_1, q5_0, q5_1)
        assert gm.plan.output == (ngl is None and (not dense_head or outtype in cuda.GPU_TYPES))
        assert gm.device_bytes == gm.plan.planned_bytes
        if backend == "numpy":
            assert dev.allocated_bytes == gm.plan.planned_bytes
        got = decode_all(gm, PROMPT)
        assert rel_err(got, ref) < tol
        assert gm.stats.total == ref_ffn.stats.total
        if exact:
            assert gm.stats.active == ref_ffn.stats.active
        else:
            assert abs(gm.stats.sparsity - ref_ffn.stats.sparsity) < 0.01
        assert 0.3 < gm.stats.sparsity < 0.7
        assert (gm.head_stats.total > 0) == (not dense_head)
        if not dense_head:
            assert gm.head_stats.total == ref_ffn.head_stats.total
            if exact:
                assert gm.head_stats.active == ref_ffn.head_stats.active
        gm.stats.reset()
        assert gm.stats.total == gm.stats.active == 0
        pre = gm.forward(PROMPT, 0, all_logits=True)
        assert rel_err(pre, ref) < tol
        assert abs(gm.stats.sparsity - ref_ffn.stats.sparsity) < 0.01


def test_input_sparse_types_the_gpu_cannot_read(tmp_path, capsys):
    """A q8_0 input file whose outputs are not multiples of 64 keeps some matrices transposed
    (no input-block layout): no GPU kernel sums those as the CPU does, so --device auto runs the
    CPU and --device cuda is a one-line error."""
    pytest.importorskip("torch")
    d = make_random_llama(tmp_path, hidden_act="silu", tokenizer="bpe", hidden_size=96,
                          n_heads=4, intermediate_size=128, n_layers=2, name="odd")
    eng = input_engine(d, tmp_path, "q8_0")
    with pytest.raises(PyinferError, match="transposed q8_0"):
        place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, 64, 2, device="cuda",
                    backend=NumpyDevice())
    m = place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, 64, 2, device="auto")
    assert not isinstance(m, GpuModel)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda.available(), reason=NO_GPU)
@pytest.mark.parametrize("n,with_scale,do_q8", [(4096, False, True), (4096, True, True),
                                                (100, True, False)])
def test_gpu_mask_inputs_is_the_twin(n, with_scale, do_q8):
    """cuda.mask_inputs (input sparsity's mask, sparse mode input) against NumpyDevice's twin:
    the same channels zeroed and counted, the masked activation's q8 form bit for bit."""
    cp = cuda.cupy
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, n).astype(np.float32) if with_scale else None
    thr = float(np.quantile(np.abs(x), 0.4))
    want, kept = x.copy(), np.zeros(1, np.uint64)
    q8 = (np.zeros(n, np.int8), np.zeros(max(1, n // 32), np.float32)) if do_q8 else None
    NumpyDevice().mask_inputs(want, scale, thr, kept, q8)
    gx, gk = cp.asarray(x), cp.zeros(1, cp.uint64)
    gq8 = cuda.q8_buffers(n) if do_q8 else None
    cuda.mask_inputs(gx, None if scale is None else cp.asarray(scale), thr, gk, gq8)
    np.testing.assert_array_equal(gx.get(), want)
    assert int(gk.get()[0]) == int(kept[0]) == int((want != 0).sum())
    if do_q8:
        np.testing.assert_array_equal(gq8[0].get(), q8[0])
        np.testing.assert_array_equal(gq8[1].get(), q8[1])


def input_model_in_memory(qt, wina: bool, head=None, n_layer: int = 2, seed: int = 0):
    """A random SwiGLU model of sparse mode input built in memory (no torch, no file): cfg,
    weights (q8_0/q4_0/q4_1 matrices in the input-block layout, f16 ones transposed; WINA column
    scales with ``wina``), thresholds skipping roughly 30-60% of each group's inputs. head: None
    (dense), "ib" (input-sparse, the head's own q8_0 numbers in chunks) or "two_stage" (a q4_1
    copy picks 16 candidates, the exact q8_0 head computes them)."""
    from pyinfer.config import ModelConfig
    from pyinfer.ops.cpu import IBTensor
    from pyinfer.weights import LayerWeights, ModelWeights

    E, F, H, V = 128, 256, 4, 256
    cfg = ModelConfig(n_vocab=V, n_embd=E, n_layer=n_layer, n_ff=F, n_head=H, n_head_kv=2,
                      head_dim=E // H, n_ctx_train=256, rope_freq_base=1e4, rms_eps=1e-5,
                      hidden_act="silu", tied_embeddings=True)
    rng = np.random.default_rng(seed)

    def mat(n_out, n_in):
        a = rng.standard_normal((n_out, n_in)).astype(np.float32) / np.sqrt(n_in)
        if qt == QT.F16:
            return QTensor.from_array(a.T, QT.F16)
        return IBTensor.from_rows(QTensor.from_array(a, qt))

    nq = cfg.n_embd_q + 2 * cfg.n_embd_kv
    n_in = {"attn_qkv": E, "attn_output": cfg.n_embd_q, "ffn_gate_up": E, "ffn_down": F}
    layers = []
    for _ in range(n_layer):
        scale = ({g: rng.uniform(0.5, 1.5, n).astype(np.float32) for g, n in n_in.items()}
                 if wina else None)
        layers.append(LayerWeights(
            attn_norm=rng.uniform(0.8, 1.2, E).astype(np.float32), wq=None, wk=None, wv=None,
            wo=None, ffn_norm=rng.uniform(0.8, 1.2, E).astype(np.float32), ffn_gate=None,
            ffn_up=None, ffn_down_t=mat(E, F), attn_qkv_t=mat(nq, E),
            attn_output_t=mat(E, cfg.n_embd_q), ffn_gate_up_t=mat(2 * F, E), in_scale=scale))
    emb = QTensor.from_array(rng.standard_normal((V, E)).astype(np.float32),
                             QT.Q8_0 if qt == QT.Q8_0 else QT.F16)
    w = ModelWeights(token_embd=emb, output_norm=np.ones(E, np.float32), output=emb,
                     layers=layers)
    thr = {"attn_qkv": 0.5, "attn_output": 0.2, "ffn_gate_up": 0.5, "ffn_down": 0.08}
    thr = {g: np.full(n_layer, v, np.float32) for g, v in thr.items()}
    if head is not None:
        from pyinfer.ops.cpu import IBChunks, ib_chunked_from_rows, ib_type

        copy = emb if head == "ib" else QTensor.from_array(reference.dequantize(emb), QT.Q4_1)
        raw = ib_chunked_from_rows(copy.raw, copy.qtype, V, E, 128)  # two chunks
        w.output_ib = IBChunks.from_raw(raw, ib_type(copy.qtype), E, V, 128)
        if wina:
            w.output_in_scale = rng.uniform(0.5, 1.5, E).astype(np.float32)
        thr["output"] = 0.4
        if head == "two_stage":
            thr["output_candidates"] = 16
    return cfg, w, thr


@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("qt,wina,head", [(QT.Q8_0, False, "two_stage"),
                                          (QT.Q4_0, True, "two_stage"), (QT.Q4_1, False, None),
                                          (QT.F16, True, None), (QT.Q8_0, True, "ib")])
def test_input_sparse_in_memory_on_the_device(qt, wina, head, backend):
    """The device's sparse mode input (mask kernels, input-block GEMV, f16 AXPY, WINA scales on
    the device, the input-sparse lm head with and without the two-stage rescoring) against the
    CPU model on an in-memory model (runs on a GPU image without torch or transformers): decode
    and prefill logits, the same input channels kept (NumpyDevice: exactly; a GPU: within 1%),
    -ngl 1 too."""
    from pyinfer.input_sparse import InputSparseFFN

    cfg, w, thr = input_model_in_memory(qt, wina, head)
    ref_ffn = InputSparseFFN(cfg, thr)
    ref = decode_all(Model(cfg, w, 64, 2, ffn=ref_ffn, cache_type="f32"), PROMPT)
    want = ref_ffn.stats
    assert 0.25 < want.sparsity < 0.75
    tol = TOL_SAME if backend == "numpy" else TOL[qt.name.lower()]
    for ngl in (None, 1):
        ffn = InputSparseFFN(cfg, thr)
        gm = place_model(None, cfg, w, ffn, 64, 2, device="cuda", n_gpu_layers=ngl,
                         backend=_device(backend))
        assert gm.plan.n_resident == (ngl or cfg.n_layer) and gm.plan.output == (ngl is None)
        got = decode_all(gm, PROMPT)
        assert rel_err(got, ref) < tol
        assert gm.stats.total == want.total
        if backend == "numpy":
            assert gm.stats.active == want.active
        else:
            assert abs(gm.stats.sparsity - want.sparsity) < 0.01
        if head is not None:
            assert gm.head_stats.total == ref_ffn.head_stats.total
            assert abs(gm.head_stats.sparsity - ref_ffn.head_stats.sparsity) < 0.01
            assert 0.1 < gm.head_stats.sparsity < 0.9
        gm.stats.reset()
        # prefill's norms and GEMMs round in another order: a channel at its threshold may flip
        # (a token's logits then move by that channel's share), so most tokens match closely
        pre = gm.forward(PROMPT, 0, all_logits=True)
        errs = [rel_err(p, r) for p, r in zip(pre, ref)]
        assert max(errs) < 3e-2 and sorted(errs)[-3] < max(tol, 1e-3), errs
        assert abs(gm.stats.sparsity - want.sparsity) < 0.01
