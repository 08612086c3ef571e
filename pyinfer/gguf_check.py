"""A structural check of a GGUF file before ``gguf.GGUFReader`` parses it.

GGUFReader trusts every count and length in the header: an array count of 2**32 in a 400 KB file
makes it loop over reads past the end of the file (each a zero-length view) while it builds one
Python object per element, and a nested array or a string length near 2**64 does the same. It also
builds about 0.7 KB of Python objects and spends about 15 us per metadata array element (1.4 KB and
30 us per string), so even in-bounds counts need a ceiling. ``check_gguf`` walks the header once
with ``struct`` over a read-only memory map, bounds every count and length by the bytes that are
left, and raises ``PyinferError`` with a one-line message naming the file and the problem.

Layout (GGUF v2/v3, ggml ``docs/gguf.md``; the ``gguf`` package's ``gguf_reader.py`` reads it):
    magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
    kv_count x (string key, u32 value_type, value),
    tensor_count x (string name, u32 n_dims, n_dims x u64 dims, u32 ggml_type, u64 offset),
    padding to ``general.alignment`` (default 32), then the tensor data; each tensor's offset is
    relative to the start of the data and a multiple of the alignment.
    string = u64 length + that many UTF-8 bytes; array = u32 element type, u64 count, elements.
A file whose version reads with its low 16 bits zero was written big-endian (gguf's reader makes
the same guess); it is checked in that byte order.
"""
from __future__ import annotations

import mmap
import os
import struct

import gguf

from pyinfer.errors import PyinferError

VT = gguf.GGUFValueType
#: bytes of each fixed-size value type
SCALAR_BYTES = {VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4,
                VT.FLOAT32: 4, VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}
SUPPORTED_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
MAX_DIMS = 4  # GGML_MAX_DIMS
ALIGNMENT_KEY = "general.alignment"
#: Metadata values (key/value pairs plus array elements) gguf's reader may be asked to build:
#: about 2.7x the largest vocabulary files in use (a 256k-token BPE vocabulary with its merges and
#: token types is about 0.77 M), and at most about 3 GB of Python objects in gguf's reader.
MAX_METADATA_VALUES = 1 << 21
#: Tensors: a Llama file has about 16 per layer; gguf builds several objects for each.
MAX_TENSORS = 1 << 16
_INT64_MAX = (1 << 63) - 1
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


class _Scanner:
    """A cursor over the file's bytes; every read checks that the bytes are there."""

    def __init__(self, buf, size: int, path: str, magic: bytes = b"GGUF", allow_empty: bool = False):
        self.buf, self.size, self.path, self.magic = buf, size, path, magic
        self.allow_empty = allow_empty
        self.pos = 0
        self.order = "<"
        self.n_values = 0

    def fail(self, problem: str):
        kind = "GGUF" if self.magic == b"GGUF" else f"{self.magic.decode()} (GGUF)"
        raise PyinferError(f"{self.path} is not a valid {kind} file: {problem}")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str):
        if n > self.left():
            self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, but the file "
                      f"ends {self.left()} bytes later")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("I", what)

    def u64(self, what: str) -> int:
        return self.unpack("Q", what)

    def skip_string(self, what: str) -> int:
        """Skip a string; returns its length."""
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        self.pos += n
        return n

    def name(self, what: str) -> str:
        """Read a key or tensor name: gguf decodes these as UTF-8 when it opens the file."""
        start = self.pos + 8
        n = self.skip_string(what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at offset {start} is not UTF-8")

    def count_values(self, n: int, what: str):
        self.n_values += n
        if self.n_values > MAX_METADATA_VALUES:
            self.fail(f"{what}: more than {MAX_METADATA_VALUES} metadata values in all "
                      f"(pyinfer's limit; gguf's reader builds Python objects for each)")

    # ---- metadata --------------------------------------------------------------------------
    def value_type(self, what: str, in_array: bool = False) -> int:
        raw = self.u32(f"the element type of {what}" if in_array else f"the type of {what}")
        if raw == VT.ARRAY and in_array:
            self.fail(f"{what} is an array of arrays (nested arrays are not supported)")
        if raw not in SCALAR_BYTES and raw not in (VT.STRING, VT.ARRAY):
            self.fail(f"{what} is an array of unknown value type {raw}" if in_array
                      else f"{what} has unknown value type {raw}")
        return raw

    def skip_value(self, vtype: int, what: str):
        if vtype in SCALAR_BYTES:
            self.need(SCALAR_BYTES[vtype], what)
            self.pos += SCALAR_BYTES[vtype]
        elif vtype == VT.STRING:
            self.skip_string(what)
        else:
            etype = self.value_type(what, in_array=True)
            n = self.u64(f"the element count of {what}")
            item = SCALAR_BYTES.get(etype, 8)  # a string takes at least its u64 length
            if n > self.left() // item:
                self.fail(f"{what} claims {n} elements of {VT(etype).name}, more than the "
                          f"{self.left()} bytes left in the file can hold")
            self.count_values(n, what)
            if etype in SCALAR_BYTES:
                self.pos += n * item
            else:
                self.skip_strings(n, what)

    def skip_strings(self, n: int, what: str):
        """Skip n strings in a row (``what``[0..n-1]): skip_string's checks and messages in one
        loop over local names (a 262,144-token vocabulary: about 1 s through skip_string, 0.1 s
        here)."""
        length = struct.Struct(self.order + "Q").unpack_from
        buf, pos, size = self.buf, self.pos, self.size
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.skip_string(f"{what}[{i}]")  # fails with skip_string's message
            m = length(buf, pos)[0]
            if m > size - pos - 8:
                self.pos = pos
                self.skip_string(f"{what}[{i}]")
            pos += 8 + m
        self.pos = pos

    def scalar_u32(self, vtype: int, key: str) -> int:
        if vtype != VT.UINT32:
            self.fail(f"{key} must be a UINT32, not {VT(vtype).name}")
        return self.u32(key)

    # ---- the whole file --------------------------------------------------------------------
    def run(self):
        self.need(24, "the header (magic, version, tensor and key/value counts)")
        if bytes(self.buf[:4]) != self.magic:
            self.fail(f"bad magic {bytes(self.buf[:4])!r}")
        self.pos = 4
        if struct.unpack_from("<I", self.buf, 4)[0] & 0xFFFF == 0:
            self.order = ">"  # written on a big-endian machine (gguf's reader guesses the same)
        version = self.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            self.fail(f"GGUF version {version} is not supported (only "
                      f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = self.u64("the tensor count")
        n_kv = self.u64("the key/value count")
        if n_kv > self.left() // _MIN_KV_BYTES:
            self.fail(f"the header claims {n_kv} key/value pairs, more than the "
                      f"{self.left()} bytes left in the file can hold")
        if n_tensors > MAX_TENSORS:
            self.fail(f"the header claims {n_tensors} tensors (pyinfer's limit is {MAX_TENSORS})")
        self.count_values(n_kv, "the key/value count")

        alignment = 32  # GGUF_DEFAULT_ALIGNMENT
        keys = set()
        for i in range(n_kv):
            key = self.name(f"key {i}")
            if key in keys:
                self.fail(f"duplicate key {key!r}")
            keys.add(key)
            vtype = self.value_type(f"key {key!r}")
            if key == ALIGNMENT_KEY:
                alignment = self.scalar_u32(vtype, key)
                if alignment == 0 or alignment & (alignment - 1):
                    self.fail(f"{key} is {alignment}, not a power of two")
            else:
                self.skip_value(vtype, f"key {key!r}")

        if n_tensors > self.left() // _MIN_TENSOR_INFO_BYTES:
            self.fail(f"the header claims {n_tensors} tensors, more than the "
                      f"{self.left()} bytes left in the file can describe")
        tensors = []  # (name, offset, nbytes)
        names = set()
        for i in range(n_tensors):
            name = self.name(f"the name of tensor {i}")
            if name in names:
                self.fail(f"duplicate tensor {name!r}")
            names.add(name)
            tensors.append((name,) + self.tensor_info(name, alignment))

        data_start = -(-self.pos // alignment) * alignment
        data_size = self.size - data_start
        for name, offset, nbytes in tensors:
            if offset + nbytes > data_size:  # Python ints: no wrap-around
                self.fail(f"tensor {name!r}: data at offset {offset} + {nbytes} bytes extends "
                          f"past the end of the file ({max(data_size, 0)} bytes of tensor data; "
                          "truncated?)")
        # no two tensors share bytes (llama.cpp's reader requires each tensor to start where the
        # one before it ends, aligned: a type or a shape changed after the fact overlaps)
        by_offset = sorted(tensors, key=lambda t: (t[1], t[2]))  # (empty ones first)
        for (a, a_off, a_n), (b, b_off, _) in zip(by_offset, by_offset[1:]):
            if a_off + a_n > b_off:
                self.fail(f"tensor {a!r} (offset {a_off}, {a_n} bytes) overlaps tensor {b!r} "
                          f"(offset {b_off}): a damaged file")

    def tensor_info(self, name: str, alignment: int) -> tuple[int, int]:
        """Check one tensor's dims, type and offset; returns (offset, nbytes)."""
        what = f"tensor {name!r}"
        n_dims = self.u32(f"the number of dimensions of {what}")
        if not 1 <= n_dims <= MAX_DIMS:
            self.fail(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [self.u64(f"dimension {d} of {what}") for d in range(n_dims)]
        n_elements = 1
        for d in dims:
            if d == 0 and not self.allow_empty:
                self.fail(f"{what} has a dimension of 0 {tuple(dims)}")
            n_elements *= d
        if n_elements > _INT64_MAX:
            self.fail(f"{what} has dimensions {tuple(dims)} whose product overflows 64 bits")
        raw = self.u32(f"the type of {what}")
        try:
            qtype = gguf.GGMLQuantizationType(raw)
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self.fail(f"{what} has unknown tensor type {raw}")
        if dims[0] % block:
            self.fail(f"{what}: row length {dims[0]} is not a multiple of the {qtype.name} "
                      f"block size {block}")
        offset = self.u64(f"the data offset of {what}")
        if offset % alignment:
            self.fail(f"{what}: data offset {offset} is not a multiple of the alignment "
                      f"{alignment}")
        return offset, n_elements // block * type_bytes


def check_gguf(path: str, magic: bytes = b"GGUF", allow_empty: bool = False) -> None:
    """Raise PyinferError unless ``path`` is a structurally sound GGUF file.

    ``magic``: the 4 bytes the file must start with (upstream PowerInfer's files carry ``PWRI``
    in place of ``GGUF`` and are GGUF in every other byte: convert/powerinfer.py).
    ``allow_empty``: tensors of 0 elements pass (upstream's GPU split files write an empty
    ``gpu_bucket`` for a layer without GPU neurons; ggml reads them).

    Checks, each against the bytes the file really has: magic and version; key/value and tensor
    counts; every key (UTF-8, unique), value type (known, no nested arrays), string length and
    array count; ``general.alignment`` (a UINT32 power of two); every tensor's name (UTF-8,
    unique), 1 to 4 dimensions, none 0 and their product within 64 bits, a known ggml type whose
    block divides the row, an aligned offset and data that lies inside the file and overlaps no
    other tensor's. Reads only the
    header (a memory map; nothing is copied but names). Does not check what the values mean
    (``pyinfer.config`` and ``pyinfer.weights`` do) nor that metadata strings are UTF-8 (read
    lazily; ``pyinfer.config.read_field`` checks the ones pyinfer reads).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size == 0:
            raise PyinferError(f"{path} is not a valid GGUF file: the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _Scanner(buf, size, path, magic, allow_empty).run()
