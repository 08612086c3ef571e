"""``gguf.GGUFReader`` with its metadata arrays built in one pass instead of element by element.

gguf's reader (``gguf_reader.py``, 0.17-0.19) builds a metadata array by calling its field parser
once per element: for every element it slices the ``np.memmap`` (whose ``__array_finalize__`` runs
in Python), views it and byte-swaps the view, about 20-40 us a string and 15 us a number. A
tokenizer's arrays are most of a file's metadata: SmolLM2's 49,152 tokens, 48,900 merges and
49,152 token types took 2.1 s to open, Gemma 3's 262,144 tokens, scores and types 9.6 s, every
time a model was loaded (docs/benchmarks.md, session 21).

``GGUFReader`` here overrides the one parser method, for the two array kinds that make up nearly
all of it (arrays of strings, arrays of numbers) in a file of the host's byte order, and returns
exactly the structure gguf's own method does: the same ``ReaderField`` parts (a u32 item type, a
u64 count, then per string a u64 length and its bytes, or per number a 1-element array), the same
data indices and types, every part a view of the same memory map (so mode ``"r+"`` writes through
as before). Everything else (the header, scalars, single strings, nested arrays, big-endian
files, tensors) is gguf's own code. ``tests/test_gguf_reader.py`` compares every field of both
readers on real and written files.
"""
from __future__ import annotations

import struct
import sys

import gguf
import numpy as np

VT = gguf.GGUFValueType
_U64 = struct.Struct("<Q")


class GGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader(path, mode)`` (same arguments, fields, tensors and errors), faster to
    open a file with large metadata arrays. Raises what gguf's reader raises (ValueError on a
    damaged file); bound the file's counts first (``pyinfer.gguf_check.check_gguf``)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != VT.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n = int(alen[0])
        try:
            itype = VT(int(raw_itype[0]))
        except ValueError:
            return super()._get_field_parts(orig_offs, raw_type)
        # gguf's loop adds the item's type from the first element: an empty array has none
        types = [VT.ARRAY, itype] if n else [VT.ARRAY]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            items = self._get(orig_offs + 12, nptype, n).view(np.ndarray)
            if len(items) != n:
                raise ValueError(f"array of {n} items runs past the end of the file")
            parts = [raw_itype, alen] + [items[i:i + 1] for i in range(n)]
            return 12 + items.nbytes, parts, list(range(2, n + 2)), types
        if itype != VT.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        u8 = self.data.view(np.ndarray)  # plain views: no memmap __array_finalize__ per slice
        buf, unpack, end = memoryview(u8), _U64.unpack_from, len(u8)
        parts = [raw_itype, alen]
        offs = orig_offs + 12
        for _ in range(n):
            if offs + 8 > end:
                raise ValueError("string array runs past the end of the file")
            (slen,) = unpack(buf, offs)
            if offs + 8 + slen > end:
                raise ValueError("string array runs past the end of the file")
            parts.append(u8[offs:offs + 8].view(np.uint64))
            parts.append(u8[offs + 8:offs + 8 + slen])
            offs += 8 + slen
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types
