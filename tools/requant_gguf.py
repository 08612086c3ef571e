#!/usr/bin/env python3
"""Copy a llama.cpp GGUF with some 2-D tensors re-quantized, keeping llama.cpp's layout.

    python tools/requant_gguf.py SRC.gguf OUT.gguf 'ffn_down:Q4_K,Q6_K' ['attn_output:Q8_0' ...]

Each NAME:TYPES rule re-encodes the tensors whose name contains NAME (dequantized by
``gguf.quants``, quantized by ``pyinfer.quants``, ggml's reference algorithms) to TYPES, cycling
through them by layer (``Q4_K,Q6_K``: even layers Q4_K, odd layers Q6_K, a stand-in for
llama-quantize's Q4_K_M mix where no llama.cpp build is at hand). Metadata and every other
tensor are copied as stored, so pyinfer runs the result as a llama.cpp file (``ffn_down`` is not
transposed: dense decode reads it with the GEMV). Rows must hold whole blocks of the new type.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from pyinfer.quants import quantize  # noqa: E402

QT = gguf.GGMLQuantizationType


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("rules", nargs="+", metavar="NAME:TYPES")
    args = ap.parse_args(argv)
    rules = [(n, [QT[t] for t in ts.split(",")]) for n, _, ts in (r.partition(":") for r in args.rules)]
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(args.out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), field.types[0], field.types[-1])
        else:
            w.add_key_value(name, field.contents(), field.types[0])
    for t in reader.tensors:
        new = None
        for n, types in rules:
            if n in t.name and len(t.shape) == 2:
                m = re.search(r"blk\.(\d+)\.", t.name)
                new = types[(int(m.group(1)) if m else 0) % len(types)]
        shape = tuple(int(v) for v in reversed(t.shape))  # numpy order (rows, cols)
        if new is None:
            plain = t.tensor_type in (QT.F32, QT.F16)  # data (rows, cols); else uint8 (rows, bytes)
            w.add_tensor(t.name, t.data, raw_dtype=None if plain else t.tensor_type)
        else:
            a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            w.add_tensor(t.name, quantize(a, new), raw_dtype=new)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
