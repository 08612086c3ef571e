"""The GPU backend behind ``pyinfer.hybrid``: one small interface, two implementations.

- ``CupyDevice``: the RawKernels of ``pyinfer.ops.cuda`` on a CUDA device (needs CuPy and a GPU).
- ``NumpyDevice``: the same methods with NumPy on host arrays. It is the NumPy twin of every
  kernel (the GPU tests compare them) and lets the hybrid split and merge be tested on a machine
  without a GPU.

Device arrays are whatever the backend holds (cupy or numpy arrays). Every method that launches
work is asynchronous on a GPU; ``to_host`` and ``merge`` are the points that wait. Only
activations (x, h, the prediction mask, partial outputs) cross between host and device after
``rows`` has uploaded the weights once.
"""
from __future__ import annotations

import gguf
import numpy as np

from pyinfer.ops import cuda
from pyinfer.ops.cpu import QT, QTensor
from pyinfer.ops.cuda import DeviceRows

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


def _gathered(w: QTensor, ids: np.ndarray | None) -> np.ndarray:
    """The rows ``ids`` of w (all rows when None) as one new contiguous (n, row_bytes) uint8 copy."""
    return np.ascontiguousarray(w.raw if ids is None else w.raw[np.asarray(ids, np.intp)])


class NumpyDevice:
    """Host NumPy stand-in for a GPU (the kernels' twins). ``free_bytes`` is what it reports as
    free device memory (bytes), so budget logic can be tested too."""

    name = "numpy"

    def __init__(self, free_bytes: int = 64 * GiB):
        self._free = int(free_bytes)

    def free_bytes(self) -> int:
        return self._free

    def describe(self) -> str:
        return f"NumPy stand-in device ({self._free / GiB:.1f} GiB reported free)"

    # -- memory ------------------------------------------------------------------------------
    def rows(self, w: QTensor, ids: np.ndarray | None = None) -> DeviceRows:
        data = _gathered(w, ids)
        return DeviceRows(data, w.qtype, data.shape[0], w.cols, dequantize_rows(data, w.qtype, w.cols))

    def array(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True)

    def empty(self, n: int, dtype) -> np.ndarray:
        return np.full(n, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.zeros(n, dtype)

    def upload(self, host: np.ndarray, dev: np.ndarray) -> np.ndarray:
        dev[:host.size] = host.reshape(-1)
        return dev

    def to_host(self, dev: np.ndarray, out: np.ndarray) -> np.ndarray:
        out[...] = dev.reshape(out.shape)
        return out

    def synchronize(self) -> None:
        pass

    # -- kernels' twins ----------------------------------------------------------------------
    def predict(self, fc1, fc2, threshold: float, x, hid, mask) -> None:
        h = np.maximum(fc1 @ x, 0.0)
        hid[:h.size] = h
        mask[...] = (fc2 @ h >= threshold).astype(np.uint8)

    def gather_gemv(self, w: DeviceRows, x, out, ids=None, mask=None) -> None:
        out[...] = w.f32 @ x
        if mask is not None:
            out[mask[ids] == 0] = 0.0

    def ffn_gate_up(self, gate: DeviceRows, up: DeviceRows, x, coef, counts, act: str,
                    act_thr: float, ids=None, mask=None) -> None:
        cand = np.ones(gate.rows, bool) if mask is None else mask[ids] != 0
        g = gate.f32[cand] @ x
        a = g / (1.0 + np.exp(-g)) if act == "silu" else np.maximum(g, 0.0)
        keep = np.abs(a) > act_thr
        c = np.zeros(int(cand.sum()), np.float32)
        c[keep] = a[keep] * (up.f32[cand][keep] @ x)
        coef[...] = 0.0
        coef[cand] = c
        counts[0] += int(cand.sum())
        counts[1] += int(keep.sum())

    def axpy_rows(self, w: DeviceRows, coef, out, skip_zero: bool = True) -> None:
        nz = coef != 0 if skip_zero else np.ones(coef.size, bool)
        out[...] = coef[nz] @ w.f32[nz] if nz.any() else 0.0

    def merge(self, dev_out, partial: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (host) = dev_out + partial: the CPU's partial FFN output merged into the device's."""
        dev_out += partial.reshape(-1)
        out[...] = dev_out.reshape(out.shape)
        return out


class CupyDevice:
    """The current CUDA device through CuPy RawKernels (``pyinfer.ops.cuda``).

    Raises PyinferError when no CUDA device is usable (see ``pyinfer.ops.cuda.available``)."""

    name = "cuda"

    def __init__(self):
        from pyinfer.errors import PyinferError

        if not cuda.available():
            raise PyinferError(f"no CUDA device: {cuda.unavailable_reason()}")
        self.cp = cuda.cupy
        self._partial = {}  # size -> device scratch for merge

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

    def rows(self, w: QTensor, ids: np.ndarray | None = None) -> DeviceRows:
        data = self.cp.asarray(_gathered(w, ids))  # one host gather, one upload
        return DeviceRows(data, w.qtype, int(data.shape[0]), w.cols)

    def array(self, a: np.ndarray):
        return self.cp.asarray(np.ascontiguousarray(a))

    def empty(self, n: int, dtype):
        return self.cp.zeros(n, dtype)

    def upload(self, host: np.ndarray, dev):
        dev[:host.size].set(np.ascontiguousarray(host).reshape(-1))
        return dev

    def to_host(self, dev, out: np.ndarray) -> np.ndarray:
        dev.get(out=out.reshape(-1))  # out must be C-contiguous (the model's buffers are)
        return out

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def predict(self, fc1, fc2, threshold: float, x, hid, mask) -> None:
        cuda.predictor_mask(fc1, fc2, x, hid, mask, threshold)

    def gather_gemv(self, w, x, out, ids=None, mask=None) -> None:
        cuda.gather_gemv(w, x, out, ids, mask)

    def ffn_gate_up(self, gate, up, x, coef, counts, act, act_thr, ids=None, mask=None) -> None:
        cuda.ffn_gate_up(gate, up, x, coef, counts, act, act_thr, ids, mask)

    def axpy_rows(self, w, coef, out, skip_zero: bool = True) -> None:
        cuda.axpy_rows(w, coef, out, skip_zero)

    def merge(self, dev_out, partial: np.ndarray, out: np.ndarray) -> np.ndarray:
        n = dev_out.size
        buf = self._partial.get(n)
        if buf is None:
            buf = self._partial[n] = self.cp.empty(n, self.cp.float32)
        buf.set(np.ascontiguousarray(partial, np.float32).reshape(-1))
        cuda.merge_add(dev_out, buf)
        return self.to_host(dev_out, out)


def default_device():
    """CupyDevice when ``pyinfer.ops.cuda.available()``, else None (run on the CPU)."""
    return CupyDevice() if cuda.available() else None
