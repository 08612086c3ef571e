"""pyinfer.gguf_reader.GGUFReader against the reference, gguf's own GGUFReader: every field of a
file (name, offset, parts with their dtypes and bytes, data indices, types, contents) and every
tensor must come out the same, on the real model and on files gguf's writer makes with each
kind of metadata array."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from pyinfer.gguf_reader import GGUFReader
from tests._paths import gemma3_gguf_path, smollm2_gguf_path


def assert_same_reader(path: str):
    ref, new = gguf.GGUFReader(path), GGUFReader(path)
    assert list(new.fields) == list(ref.fields)
    for key, f in ref.fields.items():
        g = new.fields[key]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), key
        assert len(g.parts) == len(f.parts), key
        for a, b in zip(f.parts, g.parts):
            assert (b.dtype, b.shape) == (a.dtype, a.shape) and b.tobytes() == a.tobytes(), key
        assert g.contents() == f.contents(), key
    assert new.data_offset == ref.data_offset and new.alignment == ref.alignment
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in new.tensors] == \
           [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ref.tensors]
    for a, b in zip(ref.tensors, new.tensors):
        assert np.array_equal(a.data, b.data)
    return new


def write(path, endianess=gguf.GGUFEndian.LITTLE):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_string("general.name", "t\u00e9st")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "", "\u2581caf\u00e9", "\u00e9\u00e8\U0001f600", "a" * 300])
    w.add_array("floats", [0.5, -1.25, 3e38])
    w.add_array("ints", [1, -2, 2**31 - 1])
    w.add_array("bools", [True, False, True])
    w.add_array("nested", [[1, 2], [3]])
    w.add_array("strings.one", ["only"])
    w.add_key_value("u8s", [1, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_key_value("u64s", [2**63], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    w.add_key_value("f64s", [1.5, -2.0], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)
    w.add_uint32("scalar", 7)
    w.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    splice_empty_arrays(str(path), endianess)
    return str(path)


def splice_empty_arrays(path, endianess):
    """Put two empty arrays (which gguf's writer refuses) first in the metadata: 64 bytes, two
    alignments, so the tensor data stays aligned. Layout: ggml docs/gguf.md."""
    o = "<" if endianess == gguf.GGUFEndian.LITTLE else ">"
    kvs = b"".join(struct.pack(o + "Q", len(k)) + k + struct.pack(o + "IIQ", 9, t, 0)
                   for k, t in ((b"e.string", 8), (b"e.int16s", 5)))
    assert len(kvs) == 64
    data = bytearray(open(path, "rb").read())
    (n_kv,) = struct.unpack_from(o + "Q", data, 16)
    struct.pack_into(o + "Q", data, 16, n_kv + 2)
    open(path, "wb").write(bytes(data[:24] + kvs + data[24:]))


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_kind_of_metadata_array(tmp_path, endian):
    r = assert_same_reader(write(tmp_path / "t.gguf", endian))
    assert r.fields["e.string"].contents() == [] and r.fields["e.int16s"].types == [gguf.GGUFValueType.ARRAY]
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    assert toks == ["<s>", "", "\u2581caf\u00e9", "\u00e9\u00e8\U0001f600", "a" * 300]


def test_the_real_model(tmp_path):
    src = smollm2_gguf_path()
    if src is None:
        pytest.skip("SmolLM2 GGUF not found (tools/fetch_smollm2.sh)")
    r = assert_same_reader(src)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 49152
    assert len(r.fields["tokenizer.ggml.merges"].data) == 48900


def test_gemma3_if_present():
    src = gemma3_gguf_path()
    if src is None:
        pytest.skip("Gemma-3-270M not fetched (tools/fetch_gemma3.sh)")
    assert len(assert_same_reader(src).fields["tokenizer.ggml.scores"].data) == 262144


def test_views_write_through(tmp_path):
    """Mode r+: a part is a view of the file's map, as gguf's parts are."""
    path = write(tmp_path / "t.gguf")
    r = GGUFReader(path, "r+")
    r.fields["ints"].parts[r.fields["ints"].data[0]][0] = 42
    r.fields["tokenizer.ggml.tokens"].parts[r.fields["tokenizer.ggml.tokens"].data[0]][1] = ord("S")
    r.data.flush()
    del r
    ref = gguf.GGUFReader(path)
    assert ref.fields["ints"].contents() == [42, -2, 2**31 - 1]
    assert ref.fields["tokenizer.ggml.tokens"].contents()[0] == "<S>"


def test_a_string_array_cut_short_raises(tmp_path):
    path = write(tmp_path / "t.gguf")
    data = open(path, "rb").read()
    cut = data.index(b"a" * 300) + 100  # inside the last token of the array
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(ValueError):
        GGUFReader(str(short))
