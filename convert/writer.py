"""Streams a pyinfer GGUF file to disk, one tensor at a time, atomically.

A source (Hugging Face directory or llama.cpp GGUF) describes the output as a `Metadata` table and a
list of `TensorJob`s whose ``load`` produces the float32 array only when it is written. The tensor
infos are declared first (their byte sizes are known from the shapes), so the data of at most one
tensor, plus its encoded copy, is in memory at any time.

The file goes to a temporary file of a unique name next to ``out`` (``.<name>.<random>.tmp``, made
by `tempfile.mkstemp`, so a user's own ``out.tmp`` is never touched) and is renamed over ``out``
with `os.replace` only when complete; on any exception (KeyboardInterrupt included) the temporary
file is removed. An ``out`` that is a symbolic link is written through, as llama.cpp's tools do: the
file it points to is replaced and the link stays.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import gguf
import numpy as np

from pyinfer.constants import ARCH, K_ARCH, K_QUANT_FALLBACK, OUTTYPES, QK_BLOCK, QT
from pyinfer.errors import PyinferError
from pyinfer.options import signals_held, temp_path_beside  # noqa: F401  (callers import them from here)

VT = gguf.GGUFValueType

#: outtype name -> general.file_type
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,  # every matrix Q4_K, as llama.cpp's Q4_K_S nearly is
    "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}


class Metadata:
    """Ordered GGUF key/value table: key -> (value, value type, array element type)."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[Any, VT, VT | None]] = {}

    def set(self, key: str, value: Any, vtype: VT, sub_type: VT | None = None) -> None:
        self.items[key] = (value, vtype, sub_type)

    def u32(self, key: str, value: int) -> None:
        self.set(key, int(value), VT.UINT32)

    def i32(self, key: str, value: int) -> None:
        self.set(key, int(value), VT.INT32)

    def f32(self, key: str, value: float) -> None:
        self.set(key, float(value), VT.FLOAT32)

    def boolean(self, key: str, value: bool) -> None:
        self.set(key, bool(value), VT.BOOL)

    def string(self, key: str, value: str) -> None:
        self.set(key, str(value), VT.STRING)

    def array(self, key: str, values: Sequence[Any], sub_type: VT) -> None:
        if len(values) == 0:  # GGUF cannot store an empty array
            return
        self.set(key, list(values), VT.ARRAY, sub_type)

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def get(self, key: str, default: Any = None) -> Any:
        item = self.items.get(key)
        return default if item is None else item[0]


@dataclass
class TensorJob:
    """One output tensor: ``load()`` returns a float32 array of ``shape`` (numpy order, rows first),
    or, when ``raw``, the tensor's bytes already encoded as ``qtype`` (copied as stored: a
    quantized source tensor kept at its type is never requantized)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]
    raw: bool = False


def job_floats(job: TensorJob) -> np.ndarray:
    """A job's tensor as float32 of ``job.shape`` (a job copied as stored holds its encoded
    bytes: decoded with ``gguf.quants.dequantize``)."""
    a = job.load()
    if not job.raw:
        return a
    return gguf.quants.dequantize(np.asarray(a), job.qtype).astype(np.float32).reshape(job.shape)


def matrix_qtype(cols: int, outtype) -> gguf.GGMLQuantizationType:
    """The type a 2-D weight with rows of ``cols`` elements gets for ``outtype`` (a name of
    OUTTYPES or a type).

    Block types need rows that are a whole number of blocks: a K-quant falls back as llama.cpp
    does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and a row that still does not fit becomes
    f16 (design.md, "Weight types").
    """
    qtype = OUTTYPES[outtype] if isinstance(outtype, str) else QT(outtype)
    if cols % QK_BLOCK[qtype][0] != 0 and qtype in K_QUANT_FALLBACK:
        qtype = K_QUANT_FALLBACK[qtype]
    if cols % QK_BLOCK[qtype][0] != 0:
        return QT.F16
    return qtype


def tensor_nbytes(shape: Sequence[int], qtype: gguf.GGMLQuantizationType) -> int:
    """Bytes a tensor of ``shape`` (numpy order) takes when stored as ``qtype``."""
    if qtype == QT.I32:  # offline-stage index/count tensors (gpu_idx, gpu_bucket, act_count)
        return int(np.prod(shape, dtype=np.int64)) * 4
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64))
    assert shape[-1] % block == 0, (shape, qtype)
    return n // block * block_bytes


class F16RangeError(ValueError):
    """A finite value too large for f16 (|x| > 65504): ``value`` is the largest one."""

    def __init__(self, value: float):
        super().__init__(f"values beyond f16's range (largest |value| {value:.4g} > 65504)")
        self.value = value


def encode(arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 array -> the array GGUFWriter stores for ``qtype`` (f32, f16, or uint8 blocks).
    Raises F16RangeError where a finite value would become infinite in f16.

    I32 tensors take an integer array as it is (never through float32, which would round
    counts above 2**24)."""
    if qtype == QT.I32:
        return np.ascontiguousarray(arr, dtype=np.int32)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == QT.F32:
        return arr
    if qtype == QT.F16:
        with np.errstate(over="ignore"):
            out = arr.astype(np.float16)
        over = np.isinf(out) & np.isfinite(arr)
        if over.any():
            raise F16RangeError(float(np.abs(arr[over]).max()))
        return out
    from pyinfer.quants import quantize  # gguf's quantizers plus ggml's reference K-quants

    return np.ascontiguousarray(quantize(arr, qtype))


class WriteError(PyinferError):
    """A file could not be written: ``path`` (as the user named it) and the OS's ``reason``."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot write {path}: {reason}")
        self.path, self.reason = path, reason


def _write_reason(e: OSError, tmp_path: str, size: int) -> str:
    """The OS's words for a failed write. NumPy's ``tofile`` reports a short write as "N requested
    and M written" with no errno: one more byte appended to the file then gets the errno the
    short write stopped at (ENOSPC, EFBIG, EDQUOT). A full disk also says how much the file needs
    (``size`` bytes of tensors)."""
    code, reason = e.errno, e.strerror or str(e)
    if code is None and "requested and" in reason:
        try:
            with open(tmp_path, "ab") as f:
                f.write(b"\0")
                f.flush()
        except OSError as probe:
            code, reason = probe.errno, probe.strerror or reason
    if code in (errno.ENOSPC, errno.EDQUOT):
        reason += f" (the file needs {size / 2**20:.1f} MiB)"
    return reason


#: Absolute paths write_gguf has renamed a finished file onto, in this process: a Ctrl-C handler
#: that arrives after the rename reads it (convert/cli.py: the conversion has succeeded).
COMPLETED: set = set()


def write_gguf(out_path: str, meta: Metadata, jobs: Sequence[TensorJob], progress: bool | None = None) -> None:
    """Write ``meta`` and the tensors of ``jobs`` to ``out_path`` via a unique temporary file in
    the same directory (``temp_path_beside``), renamed over ``out_path`` when complete (over the
    file a symbolic link ``out_path`` points to, the link kept).

    ``progress``: progress over tensors on stderr (``pyinfer.progress``; False: none).
    Raises WriteError (a PyinferError naming ``out_path``) for an OSError on the way (disk full,
    file too large, a source that cannot be read), and whatever else a job's ``load`` raises;
    the temporary file is removed and ``out_path`` is left untouched in every case.
    """
    from pyinfer.progress import progress_bar

    target = os.path.realpath(out_path) if os.path.islink(out_path) else out_path
    COMPLETED.discard(os.path.abspath(out_path))
    renamed = False
    tmp_path = temp_path_beside(target)
    try:
        writer = gguf.GGUFWriter(tmp_path, ARCH)
    except BaseException:
        os.remove(tmp_path)
        raise
    try:
        for key, (value, vtype, sub_type) in meta.items.items():
            if key == K_ARCH:  # GGUFWriter writes general.architecture itself
                continue
            writer.add_key_value(key, value, vtype, sub_type)
        for job in jobs:
            # dtype float32 + raw_dtype: the shape is taken as the element shape, not a byte shape
            writer.add_tensor_info(job.name, job.shape, np.dtype(np.float32),
                                   tensor_nbytes(job.shape, job.qtype), raw_dtype=job.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = progress_bar(jobs, desc="converting", unit="tensor", enabled=progress)
        for job in bar:
            arr = job.load()
            if job.raw:
                data = np.ascontiguousarray(arr)
                if data.nbytes != tensor_nbytes(job.shape, job.qtype):
                    raise AssertionError(f"{job.name}: {data.nbytes} bytes, declared "
                                         f"{tensor_nbytes(job.shape, job.qtype)}")
                writer.write_tensor_data(data)
                continue
            if tuple(arr.shape) != tuple(job.shape):
                raise AssertionError(f"{job.name}: produced shape {arr.shape}, declared {job.shape}")
            try:
                data = encode(arr, job.qtype)
            except F16RangeError as e:
                raise PyinferError(f"{job.name} has {e}: convert with --outtype bf16 or f32, "
                                   "which hold it") from None
            del arr
            writer.write_tensor_data(data)
        bar.close()
        writer.close()
        with signals_held():  # the rename and its record are one step for a signal handler
            os.replace(tmp_path, target)
            renamed = True
            COMPLETED.add(os.path.abspath(out_path))
    except BaseException as e:
        if renamed:
            raise  # (an interrupt after the rename: the output is whole, nothing to remove)
        with signals_held():  # a second Ctrl-C must not leave the temporary file behind
            reason = None
            if isinstance(e, OSError):
                size = sum(tensor_nbytes(j.shape, j.qtype) for j in jobs)
                reason = _write_reason(e, tmp_path, size)
            try:
                try:
                    writer.close()
                except OSError:
                    pass
            finally:  # (removed even when closing fails)
                try:
                    os.remove(tmp_path)
                except FileNotFoundError:
                    pass
        if reason is not None:
            raise WriteError(out_path, reason) from None
        raise
