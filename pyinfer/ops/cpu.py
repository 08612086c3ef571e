"""CPU kernels: thin Python wrappers over the compiled ``pyinfer.ops._kernels`` (cython/kernels.pyx).

Every kernel takes float32 C-contiguous activations, accumulates in f32, writes into a caller-owned
``out`` (buffers are allocated once by the model) and releases the GIL; ``n_threads`` is passed on
every call (no global thread setting). Weights are ``QTensor`` views of the GGUF memmap, never copies.
Each kernel has a NumPy twin of the same name and signature in ``pyinfer/ops/reference.py``.

Numerics: f32, f16 and bf16 weights are dotted in f32. Block-quantized weights (q4_0, q4_1, q5_0,
q5_1, q8_0, q4_k, q5_k, q6_k) are dotted against the activation quantized to 8 bits per 32-block
(llama.cpp's ggml_vec_dot_q4_0_q8_0 scheme; ``matvec``, ``matmul``, ``gather_matvec``): relative
error of the output vector about 1e-3, tested at 1e-2.
``matvec_t``, ``matmul_t``, ``axpy_rows`` and ``get_rows`` dequantize weights exactly to f32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import gguf
import numpy as np

from pyinfer.errors import KernelsMissing
from pyinfer.quants import Q5_TYPES, block_values, values_to_blocks

try:
    from pyinfer.ops import _kernels as _k
except ImportError as _e:  # `make clean` removes the build; a fresh clone has none yet
    raise KernelsMissing(f"pyinfer's compiled kernels (pyinfer.ops._kernels) do not load: {_e}. Build "
                         "them: `make install` (or `pip install -e .`, or `python setup.py build_ext "
                         "--inplace` in the source tree)") from None

QT = gguf.GGMLQuantizationType
#: the weight types the kernels run (ggml block layouts: cython/simd.h, cython/qtypes.h)
SUPPORTED = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K,
             QT.Q6_K)
#: numpy dtype GGUFReader gives each type's data (block types and BF16: raw bytes)
_STORAGE_DTYPE = {t: np.uint8 for t in SUPPORTED} | {QT.F32: np.float32, QT.F16: np.float16}


def openmp_enabled() -> bool:
    """True when the kernels were built with OpenMP (otherwise n_threads is ignored)."""
    return _k.openmp_enabled()


def simd_enabled() -> bool:
    """True when the AVX2/FMA/F16C paths were compiled in (else portable scalar C)."""
    return _k.simd_enabled()


def simd_features() -> tuple[str, ...]:
    """The SIMD paths the kernels were built with: any of "AVX2", "AVX512" (the 512-bit paths),
    "VNNI256" (the 256-bit VNNI dot: AVX512-VNNI with VL, or AVX-VNNI), "AVX_VNNI" (the latter's
    VEX form, Intel Alder Lake and later). setup.py picks them from this CPU's flags."""
    return _k.simd_features()


def system_info(n_threads: int) -> str:
    """llama.cpp's ``system_info`` line for this build: the threads asked for against the
    machine's logical CPUs, then each SIMD path (``simd_features``) and OpenMP as 0 / 1, e.g.
    "n_threads = 2 / 2 | AVX2 = 1 | AVX512 = 1 | VNNI256 = 1 | AVX_VNNI = 0 | OPENMP = 1"."""
    feats = simd_features()
    parts = [f"n_threads = {n_threads} / {os.cpu_count() or 1}"]
    parts += [f"{n} = {int(n in feats)}" for n in ("AVX2", "AVX512", "VNNI256", "AVX_VNNI")]
    return " | ".join(parts + [f"OPENMP = {int(openmp_enabled())}"])


def default_n_threads() -> int:
    """Kernel threads when the user gives none: the physical cores this process may run on, as
    llama.cpp picks its default (common.cpp ``cpu_get_num_physical_cores``: one thread per set of
    hyperthread siblings, since a sibling adds no arithmetic to a GEMV; without the topology files,
    all logical CPUs up to 4, else half of them). Counts only the CPUs in the affinity mask
    (``taskset``, container cpusets), which llama.cpp does not."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores = None
            break
    if cores:
        return len(cores)
    n = len(cpus)
    return n if n <= 4 else n // 2


@dataclass(frozen=True)
class QTensor:
    """A 2-D weight as GGUFReader stores it.

    data: F32 -> float32 (rows, cols); F16 -> float16 (rows, cols); BF16 and the block types
    (Q4_0 ... Q6_K) -> uint8 (rows, bytes_per_row) with ggml's blocks (32 values; 256 for K-quants). May be a read-only memmap; it is never
    copied unless it is not C-contiguous. ``raw`` is the same memory as uint8 (rows, bytes_per_row).
    """

    data: np.ndarray
    qtype: gguf.GGMLQuantizationType
    rows: int
    cols: int
    raw: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        qtype = QT(self.qtype)
        if qtype not in SUPPORTED:
            raise ValueError(f"unsupported weight type {qtype.name}")
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        if self.cols % block:
            raise ValueError(f"{qtype.name} row length {self.cols} is not a multiple of {block}")
        data = self.data
        if data.dtype != _STORAGE_DTYPE[qtype] or data.ndim != 2:
            raise ValueError(f"{qtype.name} weight must be a 2-D {np.dtype(_STORAGE_DTYPE[qtype])} "
                             f"array, got {data.ndim}-D {data.dtype}")
        row_bytes = self.cols // block * nbytes
        if data.shape[0] != self.rows or data.shape[1] * data.itemsize != row_bytes:
            raise ValueError(f"{qtype.name} weight data {data.shape} does not hold "
                             f"({self.rows}, {self.cols})")
        data = np.ascontiguousarray(data)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "qtype", qtype)
        object.__setattr__(self, "raw", data.view(np.uint8).reshape(self.rows, row_bytes))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @classmethod
    def from_reader_tensor(cls, t) -> "QTensor":
        """Wrap a gguf ReaderTensor (t.shape is ggml order (cols, rows); t.data numpy order)."""
        qtype = QT(t.tensor_type)
        cols, rows = int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1
        return cls(np.asarray(t.data).reshape(rows, -1), qtype, rows, cols)

    @classmethod
    def from_array(cls, a: np.ndarray, qtype) -> "QTensor":
        """Quantize a float32 (rows, cols) array with ``pyinfer.quants.quantize`` (gguf's quantizers
        plus ggml's reference K-quant quantizers; for tests, tools and the converter)."""
        from pyinfer.quants import quantize

        qtype = QT(qtype)
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype == QT.F32:
            data = a.copy()
        elif qtype == QT.F16:
            data = a.astype(np.float16)
        else:
            data = quantize(a, qtype).view(np.uint8).reshape(a.shape[0], -1)
        return cls(data, qtype, a.shape[0], a.shape[1])


#: pyinfer's type ids of the input-block layout (cython/ibsum.h), not ggml's
Q8_0_IB, Q4_0_IB, Q4_1_IB, Q5_0_IB, Q5_1_IB = _k.ib_types()
#: outputs per tile of the input-block layout (the output count must be a multiple)
IB_TILE = 64
_IB_BASE = {Q8_0_IB: QT.Q8_0, Q4_0_IB: QT.Q4_0, Q4_1_IB: QT.Q4_1, Q5_0_IB: QT.Q5_0,
            Q5_1_IB: QT.Q5_1}
#: ggml's block bytes of the types that take the layout: per output and input block, the layout
#: holds the same bytes (f16 scale, q4_1's / q5_1's f16 min, 32 values, q5's 4 bytes of fifth bits)
_BLOCK_BYTES = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q5_1: 24}


def _scale_bytes(qtype) -> int:
    """Bytes of a ggml block of ``qtype`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) before its values: the
    f16 scale, and Q4_1's / Q5_1's f16 min (the 32 values take 32 bytes, 16 as nibbles, or 20 as
    ggml's qh word of fifth bits and 16 bytes of nibbles)."""
    return _BLOCK_BYTES[qtype] - (32 if qtype == QT.Q8_0 else 20 if qtype in Q5_TYPES else 16)


def ib_type(qtype) -> int:
    """The input-block type id holding the numbers of ggml ``qtype`` (Q8_0, Q4_0, Q4_1, Q5_0 or
    Q5_1); ValueError for another type."""
    for ib, base in _IB_BASE.items():
        if QT(qtype) == base:
            return ib
    raise ValueError(f"no input-block layout for {QT(qtype).name} (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1)")


def _ib_block_bytes(qtype: int, n_out: int) -> int:
    """Bytes of one 32-channel block row of an input-block matrix with n_out outputs (f16 scales,
    q4_1's / q5_1's f16 mins and 32 value rows: 34 n_out for q8_0, 18 n_out for q4_0, 20 n_out for
    q4_1, 22 n_out for q5_0, 24 n_out for q5_1); qtype an input-block id."""
    return _BLOCK_BYTES[_IB_BASE[qtype]] * n_out


def _ib_tile_perm() -> np.ndarray:
    """src[p]: the output (0..63) a 64-output tile stores at byte position p = 16 L + 4 s + m,
    namely 16 s + 4 L + m (cython/ibsum.h: undoes the 128-bit lanes of the kernel's unpacks)."""
    p = np.arange(64)
    return 16 * ((p % 16) // 4) + 4 * (p // 16) + p % 4


def _transpose8(bits: np.ndarray) -> np.ndarray:
    """A q5 tile's 64 fifth bits (last axis) between position order p and the stored word's order
    8 (p % 8) + p / 8 (cython/ibsum.h: every position's bit reaches bit 4 of its byte with one
    shift per 64-bit lane); its own inverse."""
    return bits.reshape(*bits.shape[:-1], 8, 8).swapaxes(-1, -2).reshape(bits.shape)


def ib_supported(qtype, n_out: int, n_in: int) -> bool:
    """True where a matrix of ``qtype`` (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1) and shape (n_out, n_in) can take the
    input-block layout: outputs a multiple of 64, inputs of 32."""
    return QT(qtype) in _BLOCK_BYTES and n_out % IB_TILE == 0 and n_in % 32 == 0 and n_out > 0


def ib_pad_outs(qtype, n_out: int) -> int:
    """Zero outputs a file appends to an input-block matrix of n_out outputs (ibsum.h
    pi_ib_pad_outs): 64 where its value rows (n_out bytes for q8_0, n_out / 2 for q4_0 / q4_1,
    5 n_out / 8 for q5_0 / q5_1) would be a multiple of 2 KiB long, else 0. A block's 32 rows are read side by side, and at
    such a stride they share cache sets: 1.5-2.1x slower than the row-major GEMV for 4096-16384
    outputs on the 2-core Zen 4 box, 0.74-0.97x with the 64 zero outputs (docs/benchmarks.md,
    session 22). qtype: ggml Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 or an input-block id."""
    base = QT(_IB_BASE.get(int(qtype), qtype))
    row = n_out if base == QT.Q8_0 else n_out // 8 * 5 if base in Q5_TYPES else n_out // 2
    return IB_TILE if row % 2048 == 0 else 0


def ib_padded_from_rows(raw: np.ndarray, qtype, n_out: int, n_in: int) -> np.ndarray:
    """``ib_from_rows`` of W (n_out, n_in) with ``ib_pad_outs`` zero outputs appended (their
    ggml blocks all zero bytes: scale 0, values 0): the layout a file stores."""
    pad = ib_pad_outs(qtype, n_out)
    rows = np.asarray(raw, np.uint8).reshape(n_out, -1)
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, rows.shape[1]), np.uint8)])
    return ib_from_rows(rows, qtype, n_out + pad, n_in)


def ib_from_rows(raw: np.ndarray, qtype, n_out: int, n_in: int) -> np.ndarray:
    """Row-major q8_0 / q4_0 / q4_1 / q5_0 / q5_1 bytes of W (n_out, n_in) -> the input-block
    layout, uint8 (n_in / 32, block bytes): per block of 32 input channels the f16 scales d[:, b]
    (2 n_out bytes), for q4_1 / q5_1 then the f16 mins m[:, b] (2 n_out bytes), then 32 value rows
    of n_out bytes (q8_0: q ^ 0x80), n_out / 2 (q4_0 / q4_1: nibbles u, position p and 32 + p of
    each 64-output tile in one byte) or 5 n_out / 8 (q5_0 / q5_1: each tile's 32 nibble bytes as
    q4's, then a little-endian 64-bit word whose bit 8 (p % 8) + p / 8 is position p's fifth
    bit), outputs of each
    tile in ``_ib_tile_perm`` order. The same numbers, moved (``ib_to_rows`` inverts it).
    ValueError where ``ib_supported`` is False."""
    qtype = QT(qtype)
    if not ib_supported(qtype, n_out, n_in):
        raise ValueError(f"no input-block layout for {qtype.name} ({n_out}, {n_in})")
    nb, nt = n_in // 32, n_out // IB_TILE
    bb = _BLOCK_BYTES[qtype]
    hb = _scale_bytes(qtype)
    blk = np.asarray(raw, np.uint8).reshape(n_out, nb, bb)
    # d[:, b] then (q4_1) m[:, b], each 2 n_out bytes
    scales = [blk[:, :, o:o + 2].transpose(1, 0, 2).reshape(nb, 2 * n_out) for o in range(0, hb, 2)]
    if qtype == QT.Q8_0:
        v = blk[:, :, hb:] ^ np.uint8(0x80)  # (n_out, nb, 32)
    else:
        v = block_values(blk, qtype, hb)
    v = v.transpose(1, 2, 0).reshape(nb, 32, nt, IB_TILE)[..., _ib_tile_perm()]
    if qtype != QT.Q8_0:
        nib = (v[..., :32] & 15) | ((v[..., 32:] & 15) << 4)
        v = nib if qtype not in Q5_TYPES else np.concatenate(
            [nib, np.packbits(_transpose8((v >> 4) & 1), axis=-1, bitorder="little")], axis=-1)
    return np.ascontiguousarray(np.concatenate([*scales, v.reshape(nb, -1)], axis=1))


def ib_to_rows(ib: np.ndarray, qtype, n_out: int, n_in: int) -> np.ndarray:
    """The inverse of ``ib_from_rows``: ggml row-major bytes (n_out, n_in / 32 * block bytes)."""
    qtype = QT(qtype)
    nb, nt = n_in // 32, n_out // IB_TILE
    hb = _scale_bytes(qtype)
    ib = np.asarray(ib, np.uint8).reshape(nb, -1)
    scales = [ib[:, o * n_out:(o + 2) * n_out].reshape(nb, n_out, 2).transpose(1, 0, 2)
              for o in range(0, hb, 2)]
    v = ib[:, hb * n_out:]
    if qtype != QT.Q8_0:
        v = v.reshape(nb, 32, nt, 40 if qtype in Q5_TYPES else 32)
        u = np.concatenate([v[..., :32] & 15, v[..., :32] >> 4], axis=3)
        if qtype in Q5_TYPES:
            u |= _transpose8(np.unpackbits(v[..., 32:], axis=-1, bitorder="little")) << 4
        v = u
    v = v.reshape(nb, 32, nt, IB_TILE)
    inv = np.argsort(_ib_tile_perm())
    v = v[..., inv].reshape(nb, 32, n_out).transpose(2, 0, 1)  # (n_out, nb, 32)
    if qtype == QT.Q8_0:
        vals = v ^ np.uint8(0x80)
    else:
        vals = values_to_blocks(v, qtype)
    return np.ascontiguousarray(np.concatenate([*scales, vals], axis=2).reshape(n_out, -1))


@dataclass(frozen=True)
class IBTensor:
    """A projection W (n_out, n_in) stored for input sparsity in the input-block layout
    (cython/ibsum.h): the row-major q8_0 / q4_0 / q4_1 / q5_0 / q5_1 numbers regrouped so that input channel j
    is one contiguous row. It stands where the transposed ``*_t`` QTensors stand (rows = n_in input
    channels, cols = n_out), for ``decode_attn_in``, ``decode_ffn_in``, ``axpy_rows`` and
    ``matmul_t``. raw: uint8 (n_in / 32, block bytes), e.g. a view of the GGUF memmap."""

    raw: np.ndarray
    qtype: int  # Q8_0_IB, Q4_0_IB, Q4_1_IB, Q5_0_IB or Q5_1_IB
    rows: int  # n_in
    cols: int  # n_out

    def __post_init__(self):
        if self.qtype not in _IB_BASE:
            raise ValueError(f"unknown input-block type {self.qtype}")
        if not ib_supported(self.base_qtype, self.cols, self.rows):
            raise ValueError(f"no input-block layout for ({self.cols}, {self.rows})")
        bb = _ib_block_bytes(self.qtype, self.cols)
        raw = np.asarray(self.raw)
        padded = (self.rows // 32, _ib_block_bytes(self.qtype, self.cols + IB_TILE))
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape not in ((self.rows // 32, bb), padded):
            raise ValueError(f"input-block data {raw.shape} {raw.dtype} does not hold "
                             f"({self.rows}, {self.cols}): expected uint8 ({self.rows // 32}, {bb})")
        object.__setattr__(self, "raw", np.ascontiguousarray(raw))

    @property
    def device_nbytes(self) -> int:
        """Bytes of the layout without appended zero outputs: what ``device.device_ib_layout``
        puts on a GPU."""
        return (self.rows // 32) * _ib_block_bytes(self.qtype, self.cols)

    @property
    def layout_cols(self) -> int:
        """Outputs the layout holds: cols, or cols + 64 where zero outputs were appended
        (``ib_pad_outs``)."""
        return self.raw.shape[1] // _BLOCK_BYTES[_IB_BASE[self.qtype]]

    @property
    def base_qtype(self) -> gguf.GGMLQuantizationType:
        """The ggml type whose numbers the layout holds (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1)."""
        return _IB_BASE[self.qtype]

    shape = QTensor.shape
    nbytes = QTensor.nbytes

    def to_rows(self) -> QTensor:
        """W (n_out, n_in) as a row-major QTensor (a copy; appended zero outputs dropped)."""
        L = self.layout_cols
        rows = ib_to_rows(self.raw, self.base_qtype, L, self.rows).reshape(L, -1)
        return QTensor(np.ascontiguousarray(rows[:self.cols]), self.base_qtype, self.cols, self.rows)

    @classmethod
    def from_rows(cls, w: QTensor, pad: bool = False) -> "IBTensor":
        """The input-block layout of a row-major Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 QTensor W (n_out, n_in);
        with ``pad`` the file's (``ib_padded_from_rows``)."""
        f = ib_padded_from_rows if pad else ib_from_rows
        return cls(f(w.raw, w.qtype, w.rows, w.cols), ib_type(w.qtype), w.cols, w.rows)


@dataclass(frozen=True)
class IBChunks:
    """A wide projection W (n_out, n_in) (the lm head: n_out = n_vocab) in the input-block layout
    cut into output chunks of ``chunk`` outputs (the last one the rest), each its own IBTensor
    over W[c0:c1]: a chunk's f32 sums stay in L1/L2 while its kept rows stream in (one IBTensor
    over all 49,152 outputs of SmolLM2's head ran 1.5x slower than the dense GEMV on one thread;
    chunks of 6,144 faster than it, docs/benchmarks.md "lm-head input sparsity"). The stored
    bytes (``ib_chunked_from_rows``) are the chunks' layouts one after the other."""

    parts: tuple  # ((c0, IBTensor over outputs c0 .. c0 + cols), ...)
    rows: int  # n_in
    cols: int  # n_out
    chunk: int  # outputs per chunk
    raw: np.ndarray  # uint8 (all bytes,), the chunks' layouts one after the other

    @classmethod
    def from_raw(cls, raw: np.ndarray, qtype: int, n_in: int, n_out: int, chunk: int) -> "IBChunks":
        """raw: uint8, the bytes of ``ib_chunked_from_rows`` (any shape, C order; e.g. the GGUF
        memmap); qtype an input-block id. ValueError where the sizes do not match."""
        flat = np.asarray(raw).reshape(-1)
        if flat.size != n_in // 32 * _ib_block_bytes(qtype, n_out):
            raise ValueError(f"{flat.size} bytes do not hold a ({n_out}, {n_in}) input-block matrix "
                             f"in chunks of {chunk}")
        parts = []
        for c0, c1 in ib_chunks(n_out, chunk):  # chunk c starts after the c0 outputs before it
            off = n_in // 32 * _ib_block_bytes(qtype, c0)
            size = n_in // 32 * _ib_block_bytes(qtype, c1 - c0)
            parts.append((c0, IBTensor(flat[off:off + size].reshape(n_in // 32, -1), qtype, n_in,
                                       c1 - c0)))
        return cls(tuple(parts), n_in, n_out, chunk, flat)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def axpy_rows(self, coef: np.ndarray, idx: np.ndarray, out: np.ndarray, n_threads: int = 1):
        """out (n_out,) f32 = sum_k coef[k] * W[:, idx[k]] (idx strictly ascending), chunk by
        chunk in one parallel region (``_kernels.ib_chunks_axpy``; the bits of ``axpy_rows``
        on each chunk's IBTensor)."""
        _k.ib_chunks_axpy(self.raw, self.parts[0][1].qtype, self.rows, self.cols, self.chunk,
                          coef, idx, out, n_threads)
        return out

    def matmul_t(self, a: np.ndarray, out: np.ndarray, n_threads: int = 1):
        """out (n_tok, n_out) f32 = a (n_tok, n_in) @ W^T, chunk by chunk (``matmul_t``)."""
        for c0, t in self.parts:
            tmp = np.empty((a.shape[0], t.cols), np.float32)
            _k.matmul_t(*_wargs(t), a, tmp, n_threads)
            out[:, c0:c0 + t.cols] = tmp
        return out


def ib_chunks(n_out: int, chunk: int) -> list[tuple[int, int]]:
    """The output ranges [(c0, c1), ...] of ``IBChunks``: ``chunk`` outputs each (a positive
    multiple of 64), the last one the rest."""
    if chunk <= 0 or chunk % IB_TILE:
        raise ValueError(f"an output chunk must be a positive multiple of {IB_TILE}, got {chunk}")
    return [(c0, min(c0 + chunk, n_out)) for c0 in range(0, n_out, chunk)]


def ib_chunked_from_rows(raw: np.ndarray, qtype, n_out: int, n_in: int, chunk: int) -> np.ndarray:
    """Row-major q8_0 / q4_0 / q4_1 / q5_0 / q5_1 bytes of W (n_out, n_in) -> ``IBChunks``' bytes: each chunk's
    ``ib_from_rows`` in turn, uint8 (n_in / 32, block bytes of all n_out outputs) (the shape of
    one unchunked input-block tensor, the GGUF tensor's). ValueError where ``ib_supported`` is
    False."""
    if not ib_supported(qtype, n_out, n_in):
        raise ValueError(f"no input-block layout for {QT(qtype).name} ({n_out}, {n_in})")
    rows = np.asarray(raw, np.uint8).reshape(n_out, -1)
    parts = [ib_from_rows(rows[c0:c1], qtype, c1 - c0, n_in).reshape(-1)
             for c0, c1 in ib_chunks(n_out, chunk)]
    return np.concatenate(parts).reshape(n_in // 32, -1)


def _wargs(w: QTensor):
    return w.raw, int(w.qtype), w.cols


def matvec(w: QTensor, x: np.ndarray, out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """out[r] = w[r] . x. x (cols,) f32, out (rows,) f32. Returns out."""
    _k.matvec(*_wargs(w), x, out, n_threads)
    return out


def matmul(w: QTensor, x: np.ndarray, out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """out = x @ w.T (prefill). x (n_tok, cols) f32, out (n_tok, rows) f32. Returns out.

    Quantized types (``prefill_gemm``: q8_0, q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): tiles
    of 8 rows x 4 tokens over rows repacked to one byte per value and the activation quantized
    per 32-block as ``matvec`` quantizes it (llama.cpp's q8_0 activations, llamafile
    tinyBLAS-style tiling); other types: the single-token dots, four tokens per pass."""
    _k.matmul(*_wargs(w), x, out, n_threads)
    return out


def matmul_multi(ws, x: np.ndarray, outs, n_threads: int = 1):
    """outs[m] = x @ ws[m].T for 1 to 3 quantized weights that read the same x (q, k and v of a
    prefill): x (n_tok, cols) f32, outs[m] (n_tok, rows_m) f32. The same numbers as ``matmul`` on
    each, with x quantized once and one parallel region. ValueError unless every weight has
    ``prefill_gemm``. Returns outs."""
    _k.matmul_multi(tuple(w.raw for w in ws), tuple(int(w.qtype) for w in ws), ws[0].cols, x,
                    tuple(outs), n_threads)
    return outs


def matmul_glu(gate: QTensor, up: QTensor, x: np.ndarray, out: np.ndarray, silu: bool = True,
               n_threads: int = 1) -> np.ndarray:
    """out = act(x @ gate.T) * (x @ up.T), act SiLU (g / (1 + exp(-g))) or ReLU: the gated FFN's
    prefill up to the down projection in one call (x quantized once, the activation applied as
    the tiles are written). gate, up quantized (n_ff, cols); x (n_tok, cols) f32; out (n_tok,
    n_ff) f32. The GEMMs are ``matmul``'s; SiLU's exp is an 8-lane polynomial in f32 (a few ulp
    from ``silu_mul``). ValueError unless both weights have ``prefill_gemm``. Returns out."""
    _k.matmul_glu(gate.raw, int(gate.qtype), up.raw, int(up.qtype), gate.cols, x, out, int(silu),
                  n_threads)
    return out


def prefill_gemm(qtype) -> bool:
    """True when ``matmul`` runs the register-tiled int8 GEMM for this weight type (cython/gemm.h:
    every quantized type with the SIMD build). Its outputs equal ``matvec``'s token by token up
    to the order of the f32 sum over blocks and block offsets (each block's integer product is
    exact in both; tests/test_prefill_gemm.py states the bound)."""
    return bool(_k.prefill_gemm_supported(int(QT(qtype))))


def matvec_t(w: QTensor, a: np.ndarray, out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """out = a @ w (dense down projection over neuron-major ffn_down_t). a (rows,), out (cols,)."""
    _k.matvec_t(*_wargs(w), a, out, n_threads)
    return out


def matmul_t(w: QTensor, a: np.ndarray, out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """out = a @ w. a (n_tok, rows) f32, out (n_tok, cols) f32. Returns out."""
    _k.matmul_t(*_wargs(w), a, out, n_threads)
    return out


def gather_matvec(w: QTensor, x: np.ndarray, idx: np.ndarray, out: np.ndarray,
                  n_threads: int = 1) -> np.ndarray:
    """out[k] = w[idx[k]] . x (sparse up/gate). idx int32 (n_active,), out (n_active,) f32.

    Raises IndexError for an index outside [0, rows)."""
    _k.gather_matvec(*_wargs(w), x, idx, out, n_threads)
    return out


def axpy_rows(w: QTensor, coef: np.ndarray, idx: np.ndarray, out: np.ndarray,
              n_threads: int = 1) -> np.ndarray:
    """out = sum_k coef[k] * w[idx[k]] (sparse down over ffn_down_t); overwrites out (cols,).

    coef f32 (n_active,), idx int32 (n_active,); an empty set gives zeros."""
    _k.axpy_rows(*_wargs(w), coef, idx, out, n_threads)
    return out


def get_rows(w: QTensor, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = w[ids[i]] dequantized to f32 (embedding lookup). ids int32, out (n_ids, cols)."""
    _k.get_rows(*_wargs(w), ids, out)
    return out


def f32_to_f16(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (n,) uint16 = the f16 bits of x (n,) f32, rounded to nearest even (F16C; numpy's
    astype(float16) bits for every non-NaN value). Both C-contiguous. Returns out."""
    _k.f32_to_f16(x, out)
    return out


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """out = x / sqrt(mean(x^2, axis=-1) + eps) * weight; x, out (n_tok, n) or (n,)."""
    if x.ndim == 1:
        _k.rmsnorm(x.reshape(1, -1), weight, eps, out.reshape(1, -1))
    else:
        _k.rmsnorm(x, weight, eps, out)
    return out


def rope_neox(x: np.ndarray, positions, freq_base: float, n_rot: int,
              n_threads: int = 1) -> np.ndarray:
    """Rotary embedding in place, Hugging Face rotate_half (NeoX) layout, on the first n_rot dims.

    x (n_tok, n_heads, head_dim) f32; positions (n_tok,) ints. theta_i = pos * base^(-2i/n_rot).
    Tokens are split over n_threads (the same bits at any count). ``rope_apply`` of
    ``rope_table``."""
    return rope_apply(x, rope_table(positions, freq_base, n_rot), n_threads)


def rope_table(positions, freq_base: float, n_rot: int) -> np.ndarray:
    """(n_tok, n_rot) f32: per token [cos theta_i | sin theta_i], theta_i = pos *
    base^(-2i/n_rot) in double (i < n_rot/2), for ``rope_apply``: a forward's layers share one
    table per RoPE base. positions (n_tok,) ints. ValueError for an odd n_rot."""
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    out = np.empty((pos.shape[0], int(n_rot)), np.float32)
    _k.rope_table(pos, float(freq_base), int(n_rot), out)
    return out


def rope_apply(x: np.ndarray, table: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """RoPE in place by ``rope_table``'s angles (n_tok, n_rot) on x (n_tok, n_heads, head_dim)
    f32, rotate_half layout over the first n_rot dims; the bits of ``rope_neox``."""
    _k.rope_apply(x, table, n_threads)
    return x


def kv_pair(k_cache: np.ndarray, v_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The key and value caches as the kernels take them: (k's memory as uint16, v's, 1 for f16
    values / 0 for f32). Both float16 or both float32, C-contiguous (an f32 array's last axis
    doubles as uint16). TypeError for any other dtype or a mixed pair."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (np.float16, np.float32):
        raise TypeError(f"the KV caches are both float16 or both float32, not {k_cache.dtype} "
                        f"and {v_cache.dtype}")
    return k_cache.view(np.uint16), v_cache.view(np.uint16), int(k_cache.dtype == np.float16)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int,
              out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """Causal grouped-query attention; see cython/kernels.pyx ``attention`` for shapes. q and
    out f32; the caches float16 or float32 (both the same)."""
    _k.attention(q, *kv_pair(k_cache, v_cache), n_past, out, n_threads)
    return out


def _flat(a: np.ndarray) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError("elementwise kernels need C-contiguous arrays")
    return a.reshape(-1)


def decode_attn(x: np.ndarray, attn_norm: np.ndarray, eps: float, wq: QTensor, wk: QTensor,
                wv: QTensor, wo: QTensor, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int,
                n_head: int, freq_base: float, n_threads: int = 1, rope_div: np.ndarray | None = None,
                bq: np.ndarray | None = None, bk: np.ndarray | None = None,
                bv: np.ndarray | None = None, q_norm: np.ndarray | None = None,
                k_norm: np.ndarray | None = None, q_scale: float = 1.0, window: int = 0,
                post_norm: np.ndarray | None = None) -> np.ndarray:
    """One token's attention half-layer in one call, in place: x += wo @ attn(rope(wq rmsnorm(x)
    + bq), cache), the token's K (roped) and V written to cache row n_past. x (n_embd,) f32; caches
    (n_ctx, n_head_kv, head_dim) float16 (the row rounded to nearest even, as numpy's astype) or
    float32. rope_div (head_dim/2,) f32: RoPE's frequency divisors (``families.rope_scaled``,
    Llama 3); bq/bk/bv: the projections' f32 biases (Qwen2); None: none. Gemma 3: q_norm /
    k_norm (head_dim,) f32 per-head RMSNorm of Q and K before rope, q_scale (f32) on Q after it,
    window W > 0 (the last W cache rows seen), post_norm (n_embd,) f32 RMSNorm of the output
    before it is added. Equals rmsnorm, matvec (+ bias), the head norms, rope, the scale,
    attention and rmsnorm called one by one (``Model.run_layers``). Raises ValueError on shapes
    that do not fit."""
    _k.decode_attn(x, attn_norm, float(eps), wq.raw, int(wq.qtype), wk.raw, int(wk.qtype), wv.raw,
                   int(wv.qtype), wo.raw, int(wo.qtype), *kv_pair(k_cache, v_cache), int(n_past),
                   int(n_head), float(freq_base), n_threads, _f32_or_none(rope_div),
                   _f32_or_none(bq), _f32_or_none(bk), _f32_or_none(bv), _f32_or_none(q_norm),
                   _f32_or_none(k_norm), float(q_scale), int(window), _f32_or_none(post_norm))
    return x


def _f32_or_none(a):
    return None if a is None else np.ascontiguousarray(a, np.float32)


FFN_DENSE, FFN_GLU, FFN_ACT = 0, 1, 2


def decode_ffn(x: np.ndarray, ffn_norm: np.ndarray, eps: float, gate: QTensor, up: QTensor,
               down_t: QTensor, mode: int, silu: bool, threshold: float, n_threads: int = 1,
               dense_above: float = 1.0) -> int:
    """One token's FFN half-layer in one call, in place: x += down_t^T a over h = rmsnorm(x).

    mode FFN_DENSE: every neuron, a = act(gate h) * (up h). FFN_GLU: neurons with
    |act(gate h) * (up h)| > threshold. FFN_ACT: neurons with |act(gate h)| > threshold (up rows
    read for those only). x (n_embd,) f32; gate, up, down_t (n_ff, n_embd). When more than
    ``dense_above`` of the neurons are kept (sparse modes), the down projection streams all rows
    with the others' coefficients at 0 (same sums). Returns the number of neurons kept. Equals
    DenseFFN / SparseFFN without a predictor."""
    return _k.decode_ffn(x, ffn_norm, float(eps), gate.raw, int(gate.qtype), up.raw,
                         int(up.qtype), down_t.raw, int(down_t.qtype), int(mode), int(silu),
                         float(threshold), float(dense_above), n_threads)


def decode_ffn_rows(x: np.ndarray, ffn_norm: np.ndarray, eps: float, gate: QTensor, up: QTensor,
                    down: QTensor, silu: bool, n_threads: int = 1) -> None:
    """One token's dense FFN half-layer in one call, in place, over ``ffn_down`` in llama.cpp's
    row layout (a ``--dense`` file or a llama.cpp file): x += down (act(gate h) * (up h)), h =
    rmsnorm(x). x (n_embd,) f32; gate, up (n_ff, n_embd); down (n_embd, n_ff). The same bits as
    DenseFFN's unfused calls (``rmsnorm``, ``matvec``, ``silu_mul``/``relu_mul``, ``matvec``);
    ValueError for shapes that do not fit."""
    _k.decode_ffn_rows(x, ffn_norm, float(eps), gate.raw, int(gate.qtype), up.raw,
                       int(up.qtype), down.raw, int(down.qtype), int(gate.rows), int(silu),
                       n_threads)


def select_active(g: np.ndarray, up: np.ndarray | None, ids: np.ndarray | None, silu: bool,
                  threshold: float, coef: np.ndarray, idx: np.ndarray) -> int:
    """One pass of the sparse FFN's selection: a = act(g) (* up), kept where |a| > threshold or NaN.

    g, up (n_cand,) f32; ids (n_cand,) int32 neuron ids of the candidates, or None for 0..n-1;
    act = silu if ``silu`` else relu. Writes kept a into coef[:n] (f32) and their neuron ids into
    idx[:n] (int32), both (n_cand,); returns n. Entries from n on are scratch (the compaction is
    branch-free and writes each candidate before deciding whether to keep it)."""
    return _k.select_active(g, up, ids, int(silu), float(threshold), coef, idx)


def gelu_tanh(g: np.ndarray, out: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """out = GELU-tanh(g) elementwise (torch's gelu(approximate="tanh")): any shape, f32,
    C-contiguous, out may be g. In f32 as g * sigmoid(2t), t = sqrt(2/pi) (g + 0.044715 g^3)
    (cython/rowsum_team.h pi_gelu_tanh: expf's bits in every lane and build); NaN stays NaN.
    The same bits at any n_threads."""
    _k.gelu_tanh(_flat(g), _flat(out), n_threads)
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = silu(gate) * up elementwise (any shape, f32, C-contiguous; out may alias gate)."""
    _k.silu_mul(_flat(gate), _flat(up), _flat(out))
    return out


def relu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = relu(gate) * up elementwise (any shape, f32, C-contiguous; out may alias gate)."""
    _k.relu_mul(_flat(gate), _flat(up), _flat(out))
    return out


def select_inputs(x: np.ndarray, scale: np.ndarray | None, threshold: float, coef: np.ndarray,
                  idx: np.ndarray) -> int:
    """Input sparsity's selection (TEAL, Liu et al. 2024; WINA 2025 with ``scale``): channel j is
    kept where |x[j]| * scale[j] > threshold or NaN (scale None: 1; threshold < 0 keeps all). x (n,) f32;
    writes the kept x[j] into coef[:k] (f32) and j into idx[:k] (int32), both (n,); returns k."""
    return _k.select_inputs(x, scale, float(threshold), coef, idx)


def topk_indices(x: np.ndarray, k: int, out: np.ndarray) -> int:
    """The indices of the k largest values of x (n,) f32, ascending, into out[:m] (int32, at
    least min(k, n) long); returns m = min(k, count of non-NaN values). Ties at the boundary keep
    the lower index and NaNs are never taken: the set depends on x alone. ValueError for k < 0
    or a short out."""
    return _k.topk_indices(x, int(k), out)


def dry_match(hist: np.ndarray, is_breaker: np.ndarray, best: np.ndarray, toks: np.ndarray) -> int:
    """DRY's match lengths over hist (L,) int32 into best (n_vocab,) int32 (zero on entry) for
    the tokens listed in toks[:m] (int32, at least L); is_breaker (n_vocab,) uint8. Returns m.
    ``pyinfer.sampler.dry_match_lengths`` is the reference."""
    return _k.dry_match(hist, is_breaker, best, toks)


def mask_inputs(x: np.ndarray, scale: np.ndarray | None, threshold: float, out: np.ndarray,
                n_threads: int = 1) -> int:
    """``select_inputs`` over a batch as a mask: out (n_tok, n) f32 = x (n_tok, n) f32 with the
    dropped channels (|x_j| * scale_j <= threshold) set to 0. Returns the kept count."""
    return _k.mask_inputs(x, scale, float(threshold), out, n_threads)


def glu_mask(gu: np.ndarray, silu: bool, scale: np.ndarray | None, threshold: float,
             out: np.ndarray, n_threads: int = 1) -> int:
    """out (n_tok, n_ff) f32 = act(g) * u of gu = [g | u] (n_tok, 2 n_ff) f32 (decode's
    activation bits), masked as ``mask_inputs``. Returns the kept count."""
    return _k.glu_mask(gu, int(silu), scale, float(threshold), out, n_threads)


def decode_ffn_in(x: np.ndarray, ffn_norm: np.ndarray, eps: float, gate_up_t: QTensor,
                  down_t: QTensor, scale_gu: np.ndarray | None, thr_gu: float,
                  scale_d: np.ndarray | None, thr_d: float, silu: bool,
                  n_threads: int = 1) -> tuple[int, int]:
    """One token's FFN half-layer with input sparsity, in place: x += down over the kept channels
    of a = act(g) * u, [g, u] = gate_up_t^T over the kept channels of h = rmsnorm(x).

    x (n_embd,) f32; gate_up_t (n_embd, 2 n_ff) = [ffn_gate; ffn_up] transposed; down_t
    (n_ff, n_embd); scales (n_embd,) / (n_ff,) f32 or None (see ``select_inputs``). Weights are
    dequantized exactly to f32. Returns (gate/up rows read, down rows read). ValueError on shapes."""
    return _k.decode_ffn_in(x, ffn_norm, float(eps), gate_up_t.raw, int(gate_up_t.qtype),
                            down_t.raw, int(down_t.qtype), scale_gu, float(thr_gu), scale_d,
                            float(thr_d), int(silu), n_threads)


def decode_attn_in(x: np.ndarray, attn_norm: np.ndarray, eps: float, qkv_t: QTensor, o_t: QTensor,
                   k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, n_head: int,
                   freq_base: float, scale_qkv: np.ndarray | None, thr_qkv: float,
                   scale_o: np.ndarray | None, thr_o: float, n_threads: int = 1,
                   rope_div: np.ndarray | None = None, bqkv: np.ndarray | None = None,
                   q_norm: np.ndarray | None = None,
                   k_norm: np.ndarray | None = None) -> tuple[int, int]:
    """One token's attention half-layer with input sparsity, in place on x (n_embd,) f32, as
    ``decode_attn`` but [q, k, v] = qkv_t^T over the kept channels of h = rmsnorm(x) (+ bqkv,
    the f32 [bq; bk; bv] or None) and the output projection over the kept channels of the
    attention output. qkv_t (n_embd, n_embd_q + 2 n_embd_kv) = [wq; wk; wv] transposed; o_t
    (n_embd_q, n_embd) = wo transposed; rope_div, q_norm and k_norm (Qwen3's per-head norms,
    both or neither) as ``decode_attn``'s. Returns (qkv rows read, output rows read); caches
    float16 as ``decode_attn``'s. ValueError on shapes that do not fit."""
    return _k.decode_attn_in(x, attn_norm, float(eps), qkv_t.raw, int(qkv_t.qtype), o_t.raw,
                             int(o_t.qtype), *kv_pair(k_cache, v_cache), int(n_past), int(n_head),
                             float(freq_base), scale_qkv, float(thr_qkv), scale_o, float(thr_o),
                             n_threads, _f32_or_none(rope_div), _f32_or_none(bqkv),
                             _f32_or_none(q_norm), _f32_or_none(k_norm))


def input_decode_plan(layers, n_head: int, n_head_kv: int, head_dim: int, eps: float,
                      freq_base: float, silu: bool, head=None, rope_div: np.ndarray | None = None):
    """The raw pointers of an input-sparse model's layers, checked once, for ``decode_layers_in``.
    layers: per layer (attn_norm, attn_qkv_t, attn_output_t, ffn_norm, ffn_gate_up_t, ffn_down_t,
    scale_qkv, scale_o, scale_gu, scale_d[, bqkv[, q_norm, k_norm]]), the QTensors and (n,) f32
    vectors (scales, bqkv and the head norms may be None) of ``decode_attn_in`` /
    ``decode_ffn_in``. head: None, or (output_norm
    (n_embd,) f32, the lm head's IBChunks, its channel scale (n_embd,) f32 or None) for the logits
    of ``decode_layers_in``; rope_div as ``decode_attn_in``'s. ValueError on shapes that do not
    fit."""
    rows = [(an, qkv.raw, int(qkv.qtype), o.raw, int(o.qtype), fn, gu.raw, int(gu.qtype), d.raw,
             int(d.qtype), sq, so, sgu, sd,
             *(_f32_or_none(v) for v in (list(rest) + [None] * 3)[:3]))
            for an, qkv, o, fn, gu, d, sq, so, sgu, sd, *rest in layers]
    plan = _k.InputDecodePlan(rows, int(n_head), int(n_head_kv), int(head_dim), float(eps),
                              float(freq_base), int(silu), _f32_or_none(rope_div))
    if head is not None:
        norm, ib, scale = head
        plan.set_head(norm, ib.raw, int(ib.parts[0][1].qtype), ib.cols, ib.chunk, scale)
    return plan


def decode_layers_in(plan, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int,
                     thr: np.ndarray, counts: np.ndarray | None = None, first: int = 0,
                     n_threads: int = 1, logits: np.ndarray | None = None,
                     head_thr: float = -1.0) -> tuple[int, int, int, int, int]:
    """Layers first .. n_layer - 1 of one token with input sparsity, in place on x (n_embd,) f32:
    ``decode_attn_in`` then ``decode_ffn_in`` per layer (the same bits) in one call and one
    parallel region. k_cache, v_cache (n_layer, n_ctx, n_head_kv, head_dim) float16 or float32;
    thr (4, n_layer) f32 (attn_qkv, attn_output, ffn_gate_up, ffn_down); counts (n_layer, 4) int64 or None
    receives the rows read per projection. logits (n_vocab,) f32 or None: with a plan made with
    ``head``, the lm head's logits of the output-normed x in the same region, input channels of
    score <= head_thr skipped (the bits of ``rmsnorm``, ``select_inputs`` and
    ``IBChunks.axpy_rows``). Returns the rows read: (qkv, output, gate_up, down) summed over the
    layers, and the head's kept channels (-1 without logits). ValueError on shapes that do not
    fit."""
    return _k.decode_layers_in(plan, x, *kv_pair(k_cache, v_cache), int(n_past), thr, counts,
                               int(first), n_threads, logits, float(head_thr))


#: ``dense_decode_plan``'s activations (cython/kernels.pyx ACT_RELU, ACT_SILU, ACT_GELU_TANH)
DENSE_ACTS = {"relu": 0, "silu": 1, "gelu_tanh": 2}


def dense_decode_plan(layers, n_head: int, n_head_kv: int, head_dim: int, eps: float,
                      freq_base, act: str, q_scale: float = 1.0,
                      rope_div: np.ndarray | None = None):
    """The raw pointers of a dense model's layers (ffn_down in row layout), checked once, for
    ``decode_layers_rows``. layers: per layer (attn_norm, wq, wk, wv, wo, ffn_norm, gate, up,
    down, bq, bk, bv, q_norm, k_norm, attn_post_norm, ffn_post_norm, window): the QTensors, (n,)
    f32 vectors (biases, head norms and post-norms may be None) and sliding window (0: none) of
    ``decode_attn`` and the FFN half; freq_base: each layer's RoPE base (n_layer,); act a key of
    DENSE_ACTS; q_scale and rope_div as ``decode_attn``'s. ValueError on shapes that do not fit."""
    rows = [(_f32_or_none(an), wq.raw, int(wq.qtype), wk.raw, int(wk.qtype), wv.raw, int(wv.qtype),
             wo.raw, int(wo.qtype), _f32_or_none(fn), g.raw, int(g.qtype), u.raw, int(u.qtype),
             d.raw, int(d.qtype), *(_f32_or_none(v) for v in vecs), int(window))
            for an, wq, wk, wv, wo, fn, g, u, d, *vecs, window in layers]
    return _k.DenseDecodePlan(rows, int(n_head), int(n_head_kv), int(head_dim), float(eps),
                              np.ascontiguousarray(freq_base, np.float64), DENSE_ACTS[act],
                              float(q_scale), _f32_or_none(rope_div))


def decode_layers_rows(plan, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                       n_past: int, first: int = 0, n_threads: int = 1) -> np.ndarray:
    """Layers first .. n_layer - 1 of one token of a dense model, in place on x (n_embd,) f32:
    ``decode_attn`` then the FFN half (``decode_ffn_rows``; Gemma's GELU-tanh and post-norm as
    ``Model.run_layers`` computes them) per layer, the same bits, in one call. k_cache,
    v_cache (n_layer, n_ctx, n_head_kv, head_dim) float16 or float32. ValueError on shapes that
    do not fit."""
    _k.decode_layers_rows(plan, x, *kv_pair(k_cache, v_cache), int(n_past), int(first),
                          n_threads)
    return x


def cold_ffn(gate: QTensor, up: QTensor, down_t: QTensor, h: np.ndarray, ids: np.ndarray,
             mask: np.ndarray | None, silu: bool, glu: bool, threshold: float, out: np.ndarray,
             n_threads: int = 1) -> tuple[int, int]:
    """The FFN of one token over the candidates among ``ids`` (sorted int32; candidates where
    ``mask`` (n_ff,) uint8 is set, or all), SparseFFN's rule, into out (n_embd,) f32; returns
    (n_candidates, n_kept). Equal to ``pyinfer.ffn.sparse_step`` on ids[mask[ids] != 0]."""
    return _k.cold_ffn(*_wargs(gate)[:2], *_wargs(up)[:2], *_wargs(down_t)[:2], h, ids, mask,
                       int(silu), int(glu), threshold, out, n_threads)
