"""The device behind ``pyinfer.gpu_model``: one small interface, two implementations.

- ``CupyDevice``: the RawKernels of ``pyinfer.ops.cuda`` on a CUDA device, all work queued on one
  non-blocking stream, host buffers for transfers pinned (page-locked) so copies are asynchronous.
- ``NumpyDevice``: the same methods with NumPy on host arrays. Each method is the NumPy twin of
  the kernel of the same name (the one-token kernels' twins are the batched ``pyinfer.ops.xp``
  functions the GPU runs for prefill), so the GPU forward runs and is tested on a machine without
  a GPU.

Both count the bytes of every array they allocate for the model (``allocated_bytes``), so VRAM
budget accounting is exact and testable. Device arrays are whatever the backend holds (cupy or
numpy arrays); ``xp`` is the array module. Kernel methods are asynchronous on a GPU; ``wait``
(an event recorded after a download) and ``to_host`` are the points where the host waits.
"""
from __future__ import annotations

import contextlib

import gguf
import numpy as np

from pyinfer.ops import cuda
from pyinfer.ops import xp as X
from pyinfer.ops.cpu import QT, IBTensor, QTensor
from pyinfer.ops.cuda import DeviceRows
from pyinfer.quants import Q5_TYPES, block_values

GiB = 1 << 30


def dequantize_rows(raw: np.ndarray, qtype: QT, cols: int) -> np.ndarray:
    """(n, row_bytes) uint8 rows as stored -> (n, cols) float32 (exact)."""
    raw = np.ascontiguousarray(raw)
    if qtype == QT.F32:
        return raw.view(np.float32).reshape(-1, cols).copy()
    if qtype == QT.F16:
        return raw.view(np.float16).reshape(-1, cols).astype(np.float32)
    if raw.shape[0] == 0:
        return np.zeros((0, cols), np.float32)
    return gguf.quants.dequantize(raw, qtype).reshape(-1, cols).astype(np.float32)


def gathered(tensors: list[QTensor], ids: np.ndarray | None = None) -> np.ndarray:
    """The rows ``ids`` (all when None) of each tensor, stacked: one new contiguous (n, row_bytes)
    uint8 array (tensors of one type and width, e.g. wq, wk and wv fused into one matrix)."""
    parts = [t.raw if ids is None else t.raw[np.asarray(ids, np.intp)] for t in tensors]
    return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts))


#: bytes per 32-column block of the types whose device rows are split (quants, then scales)
_SPLIT_BLOCK = {QT.Q8_0: 34, QT.Q4_0: 18}


def device_layout(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """(n, row_bytes) uint8 rows as GGUF stores them -> the layout the GPU kernels read
    (``pyinfer.ops.cuda``): q8_0 and q4_0 rows of nb blocks become the nb blocks' quants (32 or
    16 bytes each, in order) followed by the nb f16 scales, so a block's quants are aligned
    128-bit loads on the device; same shape, same bytes per row. Other types are returned as they
    are. Inverse: ``gguf_layout``."""
    bs = _SPLIT_BLOCK.get(qtype)
    if bs is None or raw.size == 0:
        return raw
    n, rb = raw.shape
    b = raw.reshape(n, rb // bs, bs)
    return np.ascontiguousarray(np.concatenate([b[:, :, 2:].reshape(n, -1),
                                                b[:, :, :2].reshape(n, -1)], axis=1))


def gguf_layout(dev_raw: np.ndarray, qtype: QT) -> np.ndarray:
    """The inverse of ``device_layout``: device rows back to GGUF's interleaved blocks."""
    bs = _SPLIT_BLOCK.get(qtype)
    if bs is None or dev_raw.size == 0:
        return dev_raw
    n, rb = dev_raw.shape
    nb = rb // bs
    q = dev_raw[:, :nb * (bs - 2)].reshape(n, nb, bs - 2)
    d = dev_raw[:, nb * (bs - 2):].reshape(n, nb, 2)
    return np.ascontiguousarray(np.concatenate([d, q], axis=2).reshape(n, rb))


def device_ib_layout(t: IBTensor) -> np.ndarray:
    """An input-block matrix W (n_out, n_in) (sparse mode input's ``IBTensor``: the file's layout,
    tiles permuted for the CPU's unpacks) -> the layout ``cuda.ib_gemv`` reads, uint8 (n_in / 32,
    block bytes): per 32-channel block b the f16 scales d[0:n_out, b], for q4_1 / q5_1 the f16
    mins m[0:n_out, b], then 32 value rows, one per channel, of the outputs in order: int8 q
    (q8_0) or unsigned nibbles u (q4_0, q4_1; output o in byte o/2, low nibble for even o), for
    q5_0 / q5_1 the low nibbles so, then n_out / 8 bytes of fifth bits (output o's in bit o % 8 of
    byte o / 8). The same numbers and bytes as the file's, moved."""
    n_out, n_in, base = t.cols, t.rows, t.base_qtype
    nb = n_in // 32
    hb = 4 if base in (QT.Q4_1, QT.Q5_1) else 2  # scale (and min) bytes
    blk = t.to_rows().raw.reshape(n_out, nb, -1)  # ggml's blocks, row-major
    parts = [blk[:, :, o:o + 2].transpose(1, 0, 2).reshape(nb, 2 * n_out) for o in range(0, hb, 2)]
    if base == QT.Q8_0:
        v = blk[:, :, hb:].transpose(1, 2, 0).reshape(nb, 32 * n_out)
    else:
        u = block_values(blk, base, hb).transpose(1, 2, 0)  # (nb, 32, n_out), 0..15 or 0..31
        v = (u[..., 0::2] & 15) | ((u[..., 1::2] & 15) << 4)  # (nb, 32, n_out / 2)
        if base in Q5_TYPES:
            v = np.concatenate([v, np.packbits(u >> 4, axis=-1, bitorder="little")], axis=-1)
        v = v.reshape(nb, -1)
    return np.ascontiguousarray(np.concatenate([*parts, v], axis=1))


def as_qtensor(a: np.ndarray) -> QTensor:
    """A predictor matrix (f32 or f16 ndarray) as a QTensor of its own type."""
    a = np.ascontiguousarray(a)
    if a.dtype != np.float16:
        a = np.ascontiguousarray(a, np.float32)
    return QTensor(a, QT.F16 if a.dtype == np.float16 else QT.F32, *a.shape)


def quantize_q8(x: np.ndarray, q8) -> None:
    """NumPy twin of ``pyinfer.ops.cuda.quantize_q8``: q8 = (xq int8, xd f32) <- x (n,) f32 per
    32-block (``xp.quantize_q8_parts``: d = max|x| / 127, q = rint(x * (1 / d)))."""
    xq, xd = q8
    q, d = X.quantize_q8_parts(np.asarray(x, np.float32).reshape(-1))
    xq[:q.size] = q.astype(np.int8).reshape(-1)
    xd[:d.size] = d.reshape(-1)


def _act_for(w: DeviceRows, x: np.ndarray) -> np.ndarray:
    """The activation w's kernels read: q8(x) dequantized for q8_0/q4_0 rows, else x."""
    return X.quantize_act_q8(x) if cuda.reads_q8(w) else x


class NumpyDevice:
    """Host NumPy stand-in for a GPU (the kernels' twins). ``free_bytes`` is what it reports as
    free device memory (bytes), so budget logic can be tested too."""

    name = "numpy"
    xp = np
    graphs = False  # no CUDA graphs: every step runs eagerly

    def __init__(self, free_bytes: int = 64 * GiB):
        self._free = int(free_bytes)
        self.allocated_bytes = 0  # bytes of every array allocated through this device

    def free_bytes(self) -> int:
        return self._free

    def describe(self) -> str:
        return f"NumPy stand-in device ({self._free / GiB:.1f} GiB reported free)"

    def activate(self):
        """Context in which kernels go to this device's stream (nothing to do on the host)."""
        return contextlib.nullcontext()

    # -- memory ------------------------------------------------------------------------------
    def rows(self, tensors: list[QTensor], ids: np.ndarray | None = None) -> DeviceRows:
        """Rows ``ids`` of the tensors (same type and width), stacked (module ``gathered``),
        copied to the device in its layout (``device_layout``); ``f32`` dequantizes them."""
        raw = gathered(tensors, ids)
        t = tensors[0]
        data = device_layout(raw, t.qtype)
        self.allocated_bytes += data.nbytes
        return DeviceRows(data, t.qtype, data.shape[0], t.cols, dequantize_rows(raw, t.qtype, t.cols))

    def ib_rows(self, t: IBTensor) -> DeviceRows:
        """An input-block matrix in the device's layout (``device_ib_layout``); ``f32`` is W^T
        (n_in, n_out) dequantized (rows = input channels, as ``dequant`` reads them)."""
        data = device_ib_layout(t)
        self.allocated_bytes += data.nbytes
        w = t.to_rows()
        return DeviceRows(data, t.qtype, t.rows, t.cols,
                          np.ascontiguousarray(dequantize_rows(w.raw, w.qtype, w.cols).T))

    def array(self, a: np.ndarray) -> np.ndarray:
        a = np.array(a, copy=True)
        self.allocated_bytes += a.nbytes
        return a

    def empty(self, shape, dtype) -> np.ndarray:
        a = np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype)
        self.allocated_bytes += a.nbytes
        return a

    def pinned(self, shape, dtype) -> np.ndarray:
        """A host buffer for transfers (page-locked on a GPU)."""
        return np.zeros(shape, dtype)

    def upload(self, host: np.ndarray, dev: np.ndarray) -> np.ndarray:
        """dev[:host.size] = host (asynchronous on a GPU when host is pinned)."""
        dev.reshape(-1)[:host.size] = host.reshape(-1)
        return dev

    def download(self, dev: np.ndarray, host: np.ndarray) -> np.ndarray:
        """host = dev, queued (``record`` + ``wait`` tell when it has landed on a GPU)."""
        host.reshape(-1)[...] = dev.reshape(-1)[:host.size]
        return host

    def to_host(self, dev, out: np.ndarray) -> np.ndarray:
        """out = dev, waiting for it."""
        return self.download(dev, out)

    def record(self):
        return None

    def wait(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    # -- kernels' twins ----------------------------------------------------------------------
    def predict(self, fc1: DeviceRows, fc2: DeviceRows, threshold: float, x, hid, mask) -> None:
        self.norm_fc1(fc1, x, hid)
        self.predict_fc2(fc2, hid, threshold, mask)

    def norm_fc1(self, fc1: DeviceRows, x, hid, norm_w=None, eps: float = 0.0, h=None,
                 q8=None) -> None:
        """hid[:rank] = relu(fc1 @ x); with norm_w also h = rmsnorm(x) * norm_w (and with q8
        h's q8 form)."""
        hid[:fc1.rows] = np.maximum(fc1.f32 @ x.reshape(-1), 0.0)
        if norm_w is not None:
            X.rmsnorm(x.reshape(1, -1), norm_w, eps, h.reshape(1, -1))
            if q8 is not None:
                quantize_q8(h.reshape(-1), q8)

    def predict_fc2(self, fc2: DeviceRows, hid, threshold: float, mask) -> None:
        mask[...] = (fc2.f32 @ hid[:fc2.cols] >= threshold).astype(np.uint8)

    def quantize_q8(self, x, q8) -> None:
        """The twin of ``cuda.quantize_q8``: q8 = (xq, xd) <- x (n,) f32."""
        quantize_q8(x, q8)

    def gemv(self, w: DeviceRows, x, out, ids=None, mask=None, accumulate: bool = False,
             q8=None) -> None:
        """out (+)= w @ x; quantized rows read q8(x), as the kernels (``q8`` is not needed:
        the twin quantizes x itself)."""
        y = (w.f32 @ _act_for(w, x)).astype(np.float32)
        if mask is not None:
            y[mask[ids] == 0] = 0.0
        if accumulate:
            out += y
        else:
            out[...] = y

    def ffn_gate_up(self, gate: DeviceRows, up: DeviceRows, x, coef, counts, act: str,
                    act_thr: float, ids=None, mask=None, glu: bool = False, pred=None,
                    q8=None, scratch=None) -> None:
        """The twin of both forms of ``cuda.ffn_gate_up`` (scratch: their candidate list, unused
        here)."""
        x = _act_for(gate, x)
        if pred is not None:  # the predictor inline: fc2 rows of the neurons ids
            fc2, hid, thr = pred
            cand = fc2.f32[ids] @ hid[:fc2.cols] >= thr
        else:
            cand = np.ones(gate.rows, bool) if mask is None else mask[ids] != 0
        a = X.act(gate.f32[cand] @ x, act == "silu")
        if glu:
            c = a * (up.f32[cand] @ x)
            keep = ~(np.abs(c) <= act_thr)  # NaN kept
            c = np.where(keep, c, 0.0)
        else:
            keep = ~(np.abs(a) <= act_thr)
            c = np.zeros(int(cand.sum()), np.float32)
            c[keep] = a[keep] * (up.f32[cand][keep] @ x)
        coef[...] = 0.0
        coef[cand] = c
        counts[0] += int(cand.sum())
        counts[1] += int(keep.sum())

    def axpy_rows(self, w: DeviceRows, coef, out, skip_zero: bool = True,
                  accumulate: bool = False, scratch=None) -> None:
        nz = coef != 0 if skip_zero else np.ones(coef.size, bool)
        y = coef[nz] @ w.f32[nz] if nz.any() else np.zeros(w.cols, np.float32)
        if accumulate:
            out += y
        else:
            out[...] = y

    def dequant(self, w: DeviceRows, r0: int, n_rows: int, out) -> None:
        out[:n_rows * w.cols] = w.f32[r0:r0 + n_rows].reshape(-1)

    def rmsnorm(self, x, w, eps: float, out, q8=None) -> None:
        X.rmsnorm(x, w, eps, out)
        if q8 is not None:
            quantize_q8(out.reshape(-1), q8)

    def rope_store(self, q, k, v, cache_k, cache_v, cos_sin, pos) -> None:
        p = int(pos[0])  # pos: (1,) int32 device array (what a CUDA graph reads)
        X.rope(q[None], cos_sin, p)
        kk = k.copy()[None]
        X.rope(kk, cos_sin, p)
        cache_k[p] = kk[0]
        cache_v[p] = v

    def attn_decode(self, q, cache_k, cache_v, pos, out, n_att: int, q8=None) -> None:
        """n_att = pos + 1 rows (the host's copy of pos, which CupyDevice needs for sizing)."""
        out[...] = X.attention(q[None], cache_k, cache_v, n_att - 1)[0]
        if q8 is not None:
            quantize_q8(out.reshape(-1), q8)

    def mask_inputs(self, x, scale, thr: float, kept=None, q8=None, kmask=None) -> None:
        """x[j] = 0 in place where |x[j]| * scale[j] <= thr (``cpu.mask_inputs``' rule); kept
        (1,) uint64 += the channels kept; with q8 the masked x's q8 form (``kmask``, the kept
        bits the kernel writes for ``ib_gemv``, is not needed by the twins)."""
        v = x.reshape(-1)
        s = np.abs(v) if scale is None else np.abs(v) * scale
        keep = ~(s <= np.float32(thr))  # NaN kept, as the kernels
        v[~keep] = 0.0
        if kept is not None:
            kept[0] += np.uint64(keep.sum())
        if q8 is not None:
            quantize_q8(v, q8)

    def glu_mask(self, gu, n: int, act: str, scale, thr: float, out, kept=None, q8=None,
                 kmask=None) -> None:
        """out (n,) = act(gu[:n]) * gu[n:2n], masked as ``mask_inputs``."""
        out[...] = X.act(gu[:n], act == "silu") * gu[n:2 * n]
        self.mask_inputs(out, scale, thr, kept, q8)

    def ib_gemv(self, w: DeviceRows, x, out, q8=None, kmask=None, accumulate: bool = False,
                scratch=None) -> None:
        """out (+)= W x for the masked x, against x's q8 form (the kernel reads q8 and kmask)."""
        y = (X.quantize_act_q8(x.reshape(-1)) @ w.f32).astype(np.float32)
        if accumulate:
            out += y
        else:
            out[...] = y

    def copy(self, out, a) -> None:
        """out = a (device to device, queued)."""
        out[...] = a

    def add(self, out, a) -> None:
        out += a


class CupyDevice:
    """The current CUDA device through CuPy RawKernels (``pyinfer.ops.cuda``), one stream.

    Raises PyinferError when no CUDA device is usable (see ``pyinfer.ops.cuda.available``)."""

    name = "cuda"
    graphs = True  # decode is captured as CUDA graphs (pyinfer.gpu_model.GpuModel._capture)

    def __init__(self):
        from pyinfer.errors import PyinferError

        if not cuda.available():
            raise PyinferError(f"no CUDA device: {cuda.unavailable_reason()}")
        self.cp = self.xp = cuda.cupy
        self.stream = self.cp.cuda.Stream(non_blocking=True)
        self.allocated_bytes = 0

    def free_bytes(self) -> int:
        free, _total = self.cp.cuda.runtime.memGetInfo()
        # memory CuPy's pool holds but does not use is free for us too
        pool = self.cp.get_default_memory_pool()
        return int(free + pool.free_bytes())

    def describe(self) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(self.cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        free, total = self.cp.cuda.runtime.memGetInfo()
        return f"{name}, {free / GiB:.1f} of {total / GiB:.1f} GiB free"

    def activate(self):
        return self.stream

    # -- memory ------------------------------------------------------------------------------
    def _alloc(self, fn):
        try:
            with self.stream:
                return fn()
        except self.cp.cuda.memory.OutOfMemoryError as e:
            from pyinfer.errors import PyinferError

            raise PyinferError(f"out of GPU memory ({e}); lower --vram-budget or -ngl") from None

    def ib_rows(self, t: IBTensor) -> DeviceRows:
        host = device_ib_layout(t)
        data = self._alloc(lambda: self.cp.asarray(host))
        self.allocated_bytes += data.nbytes
        return DeviceRows(data, t.qtype, t.rows, t.cols)

    def rows(self, tensors: list[QTensor], ids: np.ndarray | None = None) -> DeviceRows:
        t = tensors[0]
        host = device_layout(gathered(tensors, ids), t.qtype)  # one host gather, one upload
        data = self._alloc(lambda: self.cp.asarray(host))
        self.allocated_bytes += data.nbytes
        return DeviceRows(data, t.qtype, int(data.shape[0]), t.cols)

    def array(self, a: np.ndarray):
        a = self._alloc(lambda: self.cp.asarray(np.ascontiguousarray(a)))
        self.allocated_bytes += a.nbytes
        return a

    def empty(self, shape, dtype):
        a = self._alloc(lambda: self.cp.zeros(shape, dtype))
        self.allocated_bytes += a.nbytes
        return a

    def pinned(self, shape, dtype) -> np.ndarray:
        import cupyx

        a = cupyx.empty_pinned(shape, dtype)
        a[...] = 0
        return a

    # Copies go through cudaMemcpyAsync on the stream (CuPy's get/set refuse device-to-host
    # copies while a stream captures a CUDA graph); host buffers are pinned where it matters.
    def _memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            self.cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, self.stream.ptr)

    def upload(self, host: np.ndarray, dev):
        """dev[:host.size] = host: dev C-contiguous, host C-contiguous of dev's dtype."""
        assert dev.flags.c_contiguous and host.flags.c_contiguous and host.dtype == dev.dtype
        assert host.size <= dev.size
        self._memcpy(dev.data.ptr, host.ctypes.data, host.nbytes, 1)  # cudaMemcpyHostToDevice
        return dev

    def download(self, dev, host: np.ndarray) -> np.ndarray:
        """host = dev[:host.size], queued on the stream (``record``/``wait`` tell when done)."""
        assert dev.flags.c_contiguous and host.flags.c_contiguous and host.dtype == dev.dtype
        assert host.size <= dev.size
        self._memcpy(host.ctypes.data, dev.data.ptr, host.nbytes, 2)  # cudaMemcpyDeviceToHost
        return host

    def to_host(self, dev, out: np.ndarray) -> np.ndarray:
        self.download(dev, out)
        self.stream.synchronize()
        return out

    def record(self):
        return self.stream.record()

    def wait(self, event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    # -- kernels (``pyinfer.ops.cuda``; call inside ``activate()``) ---------------------------
    def predict(self, fc1, fc2, threshold: float, x, hid, mask) -> None:
        cuda.predictor_mask(fc1, fc2, x, hid, mask, threshold)

    def norm_fc1(self, fc1, x, hid, norm_w=None, eps: float = 0.0, h=None, q8=None) -> None:
        cuda.norm_fc1(fc1, x, hid, norm_w, eps, h, q8)

    def predict_fc2(self, fc2, hid, threshold: float, mask) -> None:
        cuda.predictor_fc2(fc2, hid, mask, threshold)

    def quantize_q8(self, x, q8) -> None:
        cuda.quantize_q8(x, q8)

    def gemv(self, w, x, out, ids=None, mask=None, accumulate: bool = False, q8=None) -> None:
        cuda.gather_gemv(w, x, out, ids, mask, accumulate, q8)

    def ffn_gate_up(self, gate, up, x, coef, counts, act, act_thr, ids=None, mask=None,
                    glu: bool = False, pred=None, q8=None, scratch=None) -> None:
        cuda.ffn_gate_up(gate, up, x, coef, counts, act, act_thr, ids, mask, glu, pred, q8,
                         scratch)

    def axpy_rows(self, w, coef, out, skip_zero: bool = True, accumulate: bool = False,
                  scratch=None) -> None:
        cuda.axpy_rows(w, coef, out, skip_zero, accumulate, scratch)

    def dequant(self, w, r0: int, n_rows: int, out) -> None:
        if cuda.is_ib(w):  # rows of W^T: input channels
            cuda.ib_dequant_t(w, r0, n_rows, out)
        else:
            cuda.dequant(w, r0, n_rows, out)

    def rmsnorm(self, x, w, eps: float, out, q8=None) -> None:
        cuda.rmsnorm(x.reshape(-1, x.shape[-1]), w, eps, out, q8)

    def rope_store(self, q, k, v, cache_k, cache_v, cos_sin, pos) -> None:
        cuda.rope_store(q, k, v, cache_k, cache_v, cos_sin, pos)

    def attn_decode(self, q, cache_k, cache_v, pos, out, n_att: int, q8=None) -> None:
        """n_att: pos + 1, or any bound of it (a captured graph passes n_ctx)."""
        if n_att > cuda.MAX_DECODE_ATTN_ROWS:  # scores do not fit in shared memory
            out[...] = X.attention(q[None], cache_k, cache_v, int(pos.get()[0]))[0]
            if q8 is not None:
                cuda.quantize_q8(out.reshape(-1), q8)
        else:
            cuda.attn_decode(q, cache_k, cache_v, pos, out, n_att, q8)

    def mask_inputs(self, x, scale, thr: float, kept=None, q8=None, kmask=None) -> None:
        cuda.mask_inputs(x, scale, thr, kept, q8, kmask)

    def glu_mask(self, gu, n: int, act: str, scale, thr: float, out, kept=None, q8=None,
                 kmask=None) -> None:
        cuda.glu_mask(gu, n, act, scale, thr, out, kept, q8, kmask)

    def ib_gemv(self, w, x, out, q8=None, kmask=None, accumulate: bool = False,
                scratch=None) -> None:
        cuda.ib_gemv(w, out, q8, kmask, accumulate, scratch)

    def copy(self, out, a) -> None:
        assert out.flags.c_contiguous and a.flags.c_contiguous and out.nbytes >= a.nbytes
        self._memcpy(out.data.ptr, a.data.ptr, a.nbytes, 3)  # cudaMemcpyDeviceToDevice

    def add(self, out, a) -> None:
        cuda.add(out, a)


def default_device():
    """CupyDevice when ``pyinfer.ops.cuda.available()``, else None (run on the CPU)."""
    return CupyDevice() if cuda.available() else None
