"""Every GPU wrapper of ``pyinfer.ops.cuda`` launches a kernel that exists with the arguments that
kernel takes, checked without a GPU. CuPy is replaced by a stand-in: its modules' kernels are the
entry points NVRTC finds in the real sources (``tools/nvrtc_check.ptx_signatures``: each entry's
PTX parameter list and ``.maxntid`` launch bound), its arrays are NumPy's. A launch fails here
when it names a kernel the source lacks, passes a different count of arguments, passes anything
but a NumPy int32 where the kernel takes a 32-bit int (CuPy would pass a Python int as 64 bits),
anything but a float32 for a float, anything but an array or a 64-bit int for a pointer or long
long, or a block larger than 1024 threads or than the kernel's launch bound. The kernels do not
run, so no value is checked here: the GPU tests (``-m gpu``) do that on a device. Skipped where
NVRTC is not installed (the test extra's ``nvidia-cuda-nvrtc-cu12``, x86-64 Linux)."""
import ctypes
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from pyinfer.ops import cuda
from pyinfer.ops.cpu import QT

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import nvrtc_check  # noqa: E402

pytestmark = pytest.mark.skipif(nvrtc_check.find_nvrtc() is None,
                                reason="libnvrtc not found (nvidia-cuda-nvrtc-cu12, x86-64 Linux)")


class Arr(np.ndarray):
    """A NumPy array standing in for a CuPy one (``.data.ptr`` and ``.get()`` as CuPy's)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self):
        return np.array(self)


class Pinned(np.ndarray):
    """A host array from the stand-in's ``cupyx.empty_pinned``: never a kernel argument."""


def arr(a) -> Arr:
    return np.ascontiguousarray(a).view(Arr)


def _dev(r):
    return r.view(Arr) if isinstance(r, np.ndarray) and not isinstance(r, Arr) else r


_SCALARS = {"u32": (np.int32, np.uint32), "s32": (np.int32, np.uint32), "f32": (np.float32,),
            "u64": (np.int64, np.uint64), "s64": (np.int64, np.uint64), "f64": (np.float64,)}


class FakeKernel:
    def __init__(self, name, sig, launches):
        self.name, self.sig, self.launches = name, sig, launches

    def __call__(self, grid, block, args, shared_mem=0):
        assert isinstance(grid, tuple) and 1 <= len(grid) <= 3 and all(
            isinstance(g, int) and g >= 1 for g in grid), (self.name, grid)
        assert isinstance(block, tuple) and 1 <= len(block) <= 3, (self.name, block)
        threads = int(np.prod(block))
        assert 1 <= threads <= 1024, (self.name, block)
        assert not self.sig.max_threads or threads <= self.sig.max_threads, (self.name, block)
        assert 0 <= shared_mem <= 48 * 1024, (self.name, shared_mem)
        assert len(args) == len(self.sig.params), (self.name, len(args), self.sig.params)
        for i, (a, p) in enumerate(zip(args, self.sig.params)):
            if isinstance(a, np.ndarray):
                assert p in ("u64", "s64"), (self.name, i, p, "an array for a scalar")
                assert not isinstance(a, Pinned), (self.name, i, "a host array passed to a kernel")
            else:
                assert type(a) in _SCALARS[p], (self.name, i, p, type(a))
        self.launches.append(SimpleNamespace(name=self.name, grid=grid, block=block,
                                             args=args))


_SIGS: dict = {}  # source -> its signatures (NVRTC runs once per source in the session)


class _Event:
    def record(self, stream=None):
        return self

    def synchronize(self):
        pass


class _Graph:
    def __init__(self, n):
        self.n = n  # launches captured

    def launch(self, stream=None):
        pass


class FakeCupy:
    """What pyinfer.ops.cuda's wrappers, pyinfer.device.CupyDevice and pyinfer.gpu_model use of
    CuPy, over NumPy, with NVRTC's signatures: streams, events and CUDA graphs that do nothing
    (a captured graph counts its launches), copies by memmove, NumPy's functions for the rest
    (their arrays standing in for device arrays)."""

    def __init__(self):
        self.launches = []
        cp = self

        class Stream:
            ptr = 0

            def __init__(self, non_blocking=False):
                self.capturing = None

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

            def record(self):
                return _Event()

            def begin_capture(self):
                self.capturing = len(cp.launches)

            def end_capture(self):
                g, self.capturing = _Graph(len(cp.launches) - self.capturing), None
                return g

            def is_capturing(self):
                return self.capturing is not None

        def memcpy_async(dst, src, nbytes, kind, stream):
            ctypes.memmove(dst, src, nbytes)

        class Device:
            id = 0

            def __init__(self, i=0):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class RawModule:
            def __init__(self, code, options=()):
                if code not in _SIGS:
                    _SIGS[code] = nvrtc_check.ptx_signatures(code, options=tuple(options))
                self.sigs = _SIGS[code]

            def get_function(self, name):
                assert name in self.sigs, f"no kernel {name} in the source"
                return FakeKernel(name, self.sigs[name], cp.launches)

        self.cuda = SimpleNamespace(
            Device=Device, Stream=Stream, Event=_Event, is_available=lambda: True,
            get_elapsed_time=lambda a, b: 1.0,
            memory=SimpleNamespace(OutOfMemoryError=MemoryError),
            runtime=SimpleNamespace(memGetInfo=lambda: (64 << 30, 80 << 30),
                                    memcpyAsync=memcpy_async,
                                    getDeviceProperties=lambda i: {"name": b"stand-in"}))
        self.RawModule = RawModule

    def empty(self, shape, dtype):
        return arr(np.zeros(shape, dtype))

    zeros = empty

    def asarray(self, a, dtype=None):
        return arr(np.asarray(a, dtype))

    @staticmethod
    def asnumpy(a):
        return np.array(a)

    @staticmethod
    def get_default_memory_pool():
        return SimpleNamespace(free_bytes=lambda: 0, used_bytes=lambda: 0,
                               free_all_blocks=lambda: None)

    def __getattr__(self, name):  # the rest of NumPy, its arrays as device arrays
        fn = getattr(np, name)
        if not callable(fn) or isinstance(fn, type):
            return fn
        return lambda *a, **k: _dev(fn(*a, **k))


@pytest.fixture
def cp(monkeypatch):
    fake = FakeCupy()
    caches = (cuda._module, cuda._function, cuda._dummy_for, cuda._q8_scratch,
              cuda._list_scratch, cuda._kmask_scratch)
    for c in caches:
        c.cache_clear()
    monkeypatch.setattr(cuda, "cupy", fake)
    monkeypatch.setattr(cuda, "_AVAILABLE", True)
    monkeypatch.setitem(sys.modules, "cupyx", SimpleNamespace(
        empty_pinned=lambda shape, dtype: np.zeros(shape, dtype).view(Pinned)))
    yield fake
    for c in caches:
        c.cache_clear()


ROW_BYTES = {QT.F32: lambda c: 4 * c, QT.F16: lambda c: 2 * c, QT.Q8_0: lambda c: 34 * c // 32,
             QT.Q4_0: lambda c: 18 * c // 32}


def rows(qt, n, cols) -> cuda.DeviceRows:
    return cuda.DeviceRows(arr(np.zeros((n, ROW_BYTES[qt](cols)), np.uint8)), qt, n, cols)


def f32(*shape):
    return arr(np.zeros(shape, np.float32))


def names(cp):
    out = [launch.name for launch in cp.launches]
    cp.launches.clear()
    return out


FORMS = [{}, {"gemv_wide": True, "norm_vec": True}, {"gemv_sums": True}]
FORM_IDS = ["default", "wide_norm_vec", "gemv_sums"]


def gemv_suffix(qt, forms) -> str:
    """The dense GEMV kernel's suffix under ``forms``."""
    if forms.get("gemv_sums") and qt == QT.Q4_0:
        return "_ws"
    return "_w" if forms.get("gemv_wide") and qt in cuda.Q8_TYPES else ""


@pytest.mark.parametrize("forms", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("qt", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0])
def test_dense_and_hot_neuron_kernels_launch_as_declared(cp, qt, forms):
    t = qt.name.lower()
    n_ff, cols, rank = 96, 256, 24
    gate, up, down = rows(qt, n_ff, cols), rows(qt, n_ff, cols), rows(qt, n_ff, cols)
    x, out, coef = f32(cols), f32(n_ff), f32(n_ff)
    ids = arr(np.arange(n_ff, dtype=np.int32))
    mask = arr(np.ones(2 * n_ff, np.uint8))
    counts = arr(np.zeros(2, np.uint64))
    q8 = cuda.q8_buffers(cols)
    wide = "_w" if forms.get("gemv_wide") and qt in cuda.Q8_TYPES else ""
    with cuda.kernel_forms(**forms):
        cuda.gather_gemv(gate, x, out)
        cuda.gather_gemv(gate, x, out, ids, mask, accumulate=True, q8=q8)
        got = names(cp)
        gemv = f"gather_gemv{gemv_suffix(qt, forms)}_{t}"
        assert got == ([gemv, gemv] if qt not in cuda.Q8_TYPES else ["quantize_q8", gemv, gemv])
        fc2 = rows(QT.F16, n_ff, rank)
        hid = f32(rank)
        for listed in (False, True):
            with cuda.kernel_forms(gate_up_list=listed):
                cuda.ffn_gate_up(gate, up, x, coef, counts, "relu", -1.0, q8=q8)
                cuda.ffn_gate_up(gate, up, x, coef, counts, "silu", 0.1, ids, mask, glu=True,
                                 q8=q8)
                cuda.ffn_gate_up(gate, up, x, coef, counts, "relu", 0.0, ids, pred=(fc2, hid, 0.5),
                                 q8=q8, scratch=arr(np.zeros(cuda.gate_up_list_len(n_ff),
                                                             np.int32)))
            w_cand = "_w" if cuda.gate_up_wide() and qt in cuda.Q8_TYPES else ""
            assert names(cp) == [f"ffn_gate_up{wide}_{t}", f"ffn_gate_up{w_cand}_{t}"] + (
                ["hot_candidates", f"ffn_gate_up_list{w_cand}_{t}"] if listed
                else [f"ffn_gate_up{w_cand}_{t}"])
        cuda.axpy_rows(down, coef, x, skip_zero=True, accumulate=True)
        cuda.dequant(down, 3, 5, f32(5 * cols))
        assert names(cp) == [f"axpy_part_{t}", "axpy_sum", f"dequant_{t}"]


@pytest.mark.parametrize("norm_vec", [False, True])
@pytest.mark.parametrize("n_embd", [96, 576, 4096, 5120, 20480])
def test_norm_and_attention_kernels_launch_as_declared(cp, n_embd, norm_vec):
    """The RMSNorm kernels in both forms (the register form takes rows up to 16384 values in up
    to 1024 threads; a longer row keeps the other form), norm_fc1 with and without the norm and
    its q8 form, the predictor, RoPE, attention (head_dim a multiple of 32 or not), add."""
    rank = 24
    x, w, h = f32(2, n_embd), f32(n_embd), f32(2, n_embd)
    q8 = cuda.q8_buffers(2 * n_embd)
    with cuda.kernel_forms(norm_vec=norm_vec):
        cuda.rmsnorm(x, w, 1e-5, h)
        cuda.rmsnorm(x, w, 1e-5, h, q8=q8)
        for fc1_t in (QT.F32, QT.F16):
            fc1 = rows(fc1_t, rank, n_embd)
            cuda.norm_fc1(fc1, x[0], f32(rank), w, 1e-5, h[0], q8=q8)
            cuda.norm_fc1(fc1, x[0], f32(rank))
            cuda.predictor_fc2(rows(fc1_t, 64, rank), f32(rank), arr(np.zeros(64, np.uint8)), 0.5)
    vec = norm_vec and n_embd <= 16384
    # rmsnorm twice, then per fc1 type: norm_fc1 with the norm, without it, predictor_fc2
    assert names(cp)[:2] == ["rmsnorm_f32"] * 2
    with cuda.kernel_forms(norm_vec=norm_vec):
        cuda.rmsnorm(x, w, 1e-5, h, q8=q8)
        fc1 = rows(QT.F16, rank, n_embd)
        cuda.norm_fc1(fc1, x[0], f32(rank), w, 1e-5, h[0], q8=q8)
        cuda.norm_fc1(fc1, x[0], f32(rank))
    (norm, with_norm, without) = cp.launches
    assert [norm.args[-1], with_norm.args[-1], without.args[-1]] == [vec, vec, 0]
    assert without.block == (256,) and without.grid == (-(-rank * 32 // 256),)
    for launch in (norm, with_norm):
        threads = launch.block[0]
        if vec:  # every float4 of a row held by a thread, at most 4 a thread
            assert threads == min(1024, 32 * -(-n_embd // 128)) and 4 * 4 * threads >= n_embd
        else:
            assert threads == 256
    assert with_norm.grid == (-(-rank * 32 // with_norm.block[0]) + 1,)  # fc1's warps, the norm
    cp.launches.clear()
    for n_head, hd in ((8, 64), (4, 48)):
        n_ctx = 16
        q, kv = f32(n_head, hd), f32(2, hd)
        ck, cv = f32(n_ctx, 2, hd), f32(n_ctx, 2, hd)
        pos = arr(np.array([5], np.int32))
        cuda.rope_store(q, kv, kv, ck, cv, f32(n_ctx, hd // 2, 2), pos)
        q8a = cuda.q8_buffers(n_head * hd)
        cuda.attn_decode(q, ck, cv, pos, f32(n_head, hd), n_ctx, q8=q8a)
    cuda.add(f32(64), f32(64))
    assert names(cp) == ["rope_store", "attn_decode", "rope_store", "attn_decode", "quantize_q8",
                         "add_f32"]


def test_unaligned_rows_keep_the_other_norm(cp):
    """RMSNorm's register form needs 16-byte aligned rows: an array 4 bytes off keeps the other
    form, as does a row length not a multiple of 4."""
    base = f32(4096 + 4)
    x = base[1:4097].reshape(1, 4096)
    with cuda.kernel_forms(norm_vec=True):
        cuda.rmsnorm(x, f32(4096), 1e-5, f32(1, 4096))
        cuda.rmsnorm(f32(1, 4098), f32(4098), 1e-5, f32(1, 4098))
        cuda.rmsnorm(f32(1, 4096), f32(4096), 1e-5, f32(1, 4096))
    assert [launch.args[-1] for launch in cp.launches] == [0, 0, 1]


@pytest.mark.parametrize("ib", sorted(cuda.IB_KERNELS))
def test_input_sparse_kernels_launch_as_declared(cp, ib):
    """Sparse mode input's mask kernels (with and without the q8 form, scale and counter) and the
    input-block GEMV and dequantization of every input-block type."""
    n_in, n_out = 256, 128
    x = f32(n_in)
    q8 = cuda.q8_buffers(n_in)
    kmask = arr(np.zeros(n_in // 32, np.uint32))
    kept = arr(np.zeros(1, np.uint64))
    cuda.mask_inputs(x, None, 0.1)
    cuda.mask_inputs(x, f32(n_in), 0.1, kept, q8, kmask)
    cuda.glu_mask(f32(2 * n_in), n_in, "silu", f32(n_in), 0.1, f32(n_in), kept, q8, kmask)
    w = cuda.DeviceRows(arr(np.zeros((n_in, n_out), np.uint8)), ib, n_in, n_out)
    cuda.ib_gemv(w, f32(n_out), q8, kmask, accumulate=True)
    cuda.ib_dequant_t(w, 32, 64, f32(64 * n_out))
    name = cuda.IB_KERNELS[ib][0]
    assert names(cp) == ["mask_q8", "mask_q8", "glu_mask_q8", f"ib_gemv_{name}", "axpy_sum",
                         "ib_dequant_t"]


def test_a_wrong_launch_fails_here(cp):
    """The stand-in catches what it is for: a Python int where a kernel takes an int32, a
    missing argument, a kernel the source lacks, a block over the launch bound."""
    fn = cuda._kernel("attn", "add_f32")
    with pytest.raises(AssertionError):
        fn((1,), (256,), (f32(8), f32(8), 8))
    with pytest.raises(AssertionError):
        fn((1,), (256,), (f32(8), f32(8)))
    with pytest.raises(AssertionError, match="no kernel"):
        cuda._kernel("attn", "add_f16")
    with pytest.raises(AssertionError):
        cuda._kernel("attn", "rmsnorm_f32")((1,), (2048,), ())
    fn((1,), (256,), (f32(8), f32(8), np.int32(8)))
    assert names(cp) == ["add_f32"]


@pytest.mark.parametrize("forms", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("hidden_act,outtype,mode,kind", [
    ("relu", "q4_0", "relu", "all"), ("relu", "q4_0", "relu", "random"),
    ("silu", "q8_0", "glu", "partial"), ("silu", "f16", "glu", "random"),
    ("relu", "f32", "relu", "layers")])
def test_gpu_model_launches_as_declared(cp, tmp_path, hidden_act, outtype, mode, kind, forms):
    """The whole GPU model on CupyDevice over the stand-in (prefill, the first decode token eager,
    the next ones captured as CUDA graphs and replayed; hot neurons on the device and cold ones
    on the host, whole layers, the CPU's layers after the device's): every launch as declared."""
    from pyinfer.device import CupyDevice
    from pyinfer.gpu_model import GpuModel
    from tests.test_hybrid import PROMPT, engine_for, plan_for, sparse_ffn

    eng = engine_for(tmp_path, hidden_act, outtype)
    cfg = eng.cfg
    with cuda.kernel_forms(**forms):
        gm = GpuModel(cfg, eng.weights, eng.n_ctx, 2, sparse_ffn(cfg, hidden_act, mode),
                      CupyDevice(), plan_for(kind, cfg))
        gm.forward(PROMPT, 0, all_logits=True)
        n_prefill = len(cp.launches)
        for i, t in enumerate(PROMPT[:4]):
            gm.forward([t], len(PROMPT) + i)
    got = {launch.name for launch in cp.launches[n_prefill:]}
    assert "rmsnorm_f32" in got and "rope_store" in got and "attn_decode" in got
    assert f"gather_gemv{gemv_suffix(QT[outtype.upper()], forms)}_{outtype}" in got
    if kind in ("all", "random"):
        assert any(n.startswith("ffn_gate_up") for n in got) and f"axpy_part_{outtype}" in got
    if gm.plan.n_resident == cfg.n_layer and gm.plan.output:  # decode as CUDA graphs
        assert gm._graphs is not None and sum(g.n for g in gm._graphs) > 0
    vecs = [launch.args[-1] for launch in cp.launches
            if launch.name == "rmsnorm_f32" or launch.name.startswith("norm_fc1")]
    assert vecs and set(vecs) == {np.int32(bool(forms.get("norm_vec")))}


@pytest.mark.parametrize("outtype", ["q4_0", "q8_0", "f16"])
def test_input_sparse_gpu_model_launches_as_declared(cp, tmp_path, outtype):
    """Sparse mode input's GPU model over the stand-in (masks, the input-block GEMVs or the AXPY
    over a float file's rows, the input-sparse head), prefill and decode through graphs."""
    from convert.cli import main as convert_main
    from pyinfer.device import CupyDevice
    from pyinfer.engine import Engine
    from pyinfer.gpu_model import GpuModel
    from pyinfer.hybrid import place_model
    from pyinfer.input_sparse import InputSparseFFN, thresholds_from_reader
    from tests._models import make_random_llama

    src = make_random_llama(tmp_path / "hf", hidden_act="silu", tokenizer="bpe",
                            intermediate_size=128, n_layers=2, name="silu")
    out = str(tmp_path / "in.gguf")
    assert convert_main([str(src), out, "--outtype", outtype, "--target-sparsity", "0.5",
                         "--sparse-mode", "input", "--sparse-alloc", "uniform",
                         "--calib-tokens", "128", "-t", "1"]) == 0
    eng = Engine(out, n_ctx=32, n_threads=2, cache_type="f32")
    cfg = eng.cfg
    gm = place_model(eng.reader, cfg, eng.weights,
                     InputSparseFFN(cfg, thresholds_from_reader(eng.reader, cfg)), 32, 2,
                     device="cuda", backend=CupyDevice())
    assert isinstance(gm, GpuModel) and gm.plan.n_resident == cfg.n_layer
    toks = [1, 17, 42, 7, 99, 3]
    gm.forward(toks, 0, all_logits=True)
    for i, t in enumerate(toks):
        gm.forward([t], len(toks) + i)
    got = {launch.name for launch in cp.launches}
    assert {"mask_q8", "glu_mask_q8", "rmsnorm_f32", "attn_decode"} <= got
    if outtype == "f16":
        assert "axpy_part_f16" in got
    else:
        assert f"ib_gemv_{outtype}" in got


@pytest.mark.parametrize("outtype", ["q4_0", "f16"])
def test_dense_rows_file_launches_as_declared(cp, tmp_path, outtype):
    """A --dense file (ffn_down in row layout) on CupyDevice over the stand-in: the dense layers'
    down projection is the GEMV over the rows (the q8 form of its input made first for block
    types), in prefill and decode."""
    from pyinfer.device import CupyDevice
    from pyinfer.ffn import DenseFFN
    from pyinfer.hybrid import place_model
    from tests.test_hybrid import PROMPT, engine_for

    eng = engine_for(tmp_path, "silu", outtype, rows=True)
    cfg = eng.cfg
    gm = place_model(eng.reader, cfg, eng.weights, DenseFFN(cfg), 64, 2, device="cuda",
                     disable_gpu_index=True, backend=CupyDevice())
    gm.forward(PROMPT, 0, all_logits=True)
    cp.launches.clear()
    gm.forward([5], len(PROMPT))  # the first decode token: eager
    got = list(cp.launches)
    rows = [launch for launch in got if launch.name == f"gather_gemv_{outtype}"
            and launch.args[2] == np.int32(cfg.n_embd) and launch.args[3] == np.int32(cfg.n_ff)]
    assert len(rows) == cfg.n_layer  # one down GEMV a layer, n_ff columns into n_embd rows
    assert not any(launch.name.startswith("axpy_part") for launch in got)
    n_quant = sum(launch.name == "quantize_q8" and launch.args[1] == np.int32(cfg.n_ff)
                  for launch in got)
    assert n_quant == (cfg.n_layer if outtype == "q4_0" else 0)
