"""The error bound of the integer transposed GEMM (cython/gemmt.h) that ``cpu.matmul_t`` runs for
q8_0 and q4_0 weights, computed in float64 from gguf's dequantization (the reference).

For token t and column i of block b, with c[r] = a[t, r] d[r, b] and v' = v - k the block's
integer values (q8_0: q; q4_0: q - 8), the kernel quantizes c over each tile of 32 rows to int8
with scale s = max|c| / 127 (|error| <= s / 2 per coefficient), so

    |out - exact| <= sum_tiles (max_{r in tile} |c[r]| / 254) * sum_{r in tile} |v'[r, i]|
                     + (n_tiles + 5) 2^-23 sum_r |a[t, r] w[r, i]|      (the f32 sums)
"""
from __future__ import annotations

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
GEMMT_TYPES = (QT.Q8_0, QT.Q4_0)
TILE = 32  # rows per int8 scale (PI_GEMMT_R)
_BLOCK_BYTES = {QT.Q8_0: 34, QT.Q4_0: 18}


def gemmt_bound(w, a) -> tuple[np.ndarray, np.ndarray]:
    """(exact, bound), both (n_tok, cols) float64, for out = a @ w with w a q8_0/q4_0 QTensor
    (rows, cols) and a (n_tok, rows) f32. Raises KeyError for other types."""
    bb = _BLOCK_BYTES[w.qtype]
    wd = gguf.quants.dequantize(w.raw, w.qtype).reshape(w.rows, w.cols).astype(np.float64)
    blocks = np.array(w.raw).reshape(w.rows, -1, bb)
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)  # (rows, nb)
    if w.qtype == QT.Q8_0:
        vp = blocks[:, :, 2:].view(np.int8).reshape(w.rows, -1).astype(np.float64)
    else:
        qs = blocks[:, :, 2:]
        vp = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(w.rows, -1).astype(np.float64) - 8
    a64 = a.astype(np.float64)
    bound = np.zeros((a.shape[0], w.cols))
    for k0 in range(0, w.rows, TILE):
        c = np.abs(a64[:, k0:k0 + TILE, None] * d[None, k0:k0 + TILE, :])  # (n_tok, r, nb)
        bound += np.repeat(c.max(axis=1) / 254, 32, axis=1) * np.abs(vp[k0:k0 + TILE]).sum(0)
    n_tiles = -(-w.rows // TILE)
    bound += (n_tiles + 5) * 2.0 ** -23 * (np.abs(a64) @ np.abs(wd))
    return a64 @ wd, bound
