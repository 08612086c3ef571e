"""Arrays the kernel tests share: NaN-poisoned outputs, read-only inputs, quantized weights."""
from __future__ import annotations

import gguf
import numpy as np

from pyinfer.ops import cpu

QT = gguf.GGMLQuantizationType
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def nan(shape) -> np.ndarray:
    """f32 output buffer full of NaN: a kernel that skips an element leaves it visible."""
    return np.full(shape, np.nan, np.float32)


def readonly(a) -> np.ndarray:
    """A C-contiguous read-only copy or view (as the memory-mapped weights are)."""
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def quantized_weight(rng, qtype, rows: int, cols: int) -> cpu.QTensor:
    """(rows, cols) normal values, each row scaled by U(0.1, 10), quantized to ``qtype``: by
    gguf.quants where it quantizes the type, by the project's ggml-reference quantizer for the
    K-quants (gguf quantizes none)."""
    a = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1))
    if qtype in K_QUANTS:
        return cpu.QTensor.from_array(a, qtype)
    data = gguf.quants.quantize(a, qtype).view(np.uint8).reshape(rows, -1)
    return cpu.QTensor(readonly(data), qtype, rows, cols)
