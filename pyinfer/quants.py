"""Quantize float32 weights to ggml block types, in NumPy.

``gguf.quants.quantize`` writes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; it has no quantizer
for the K-quants. This module adds Q4_K, Q5_K and Q6_K, following ggml's reference quantizers
(``ggml-quants.c``: ``quantize_row_q4_K_ref`` and ``quantize_row_q5_K_ref`` over
``make_qkx2_quants``, ``quantize_row_q6_K_ref`` over ``make_qx_quants`` with rmse_type 1),
vectorized over all blocks at once; ``quantize`` runs the same algorithm compiled
(cython/kquant.h), 5-7 ms a 1024x4096 matrix against 0.7-1.4 s here. The search steps and weightings are ggml's; the arithmetic is
NumPy float32 (round half to even, as ggml's ``nearest_int``), so a block can differ from
llama.cpp's output where two candidates tie to float rounding. The converter needs these for the
transposed down projection (``ffn_down_t``) of a K-quant source: its rows are new rows, so they
must be quantized again, at the source's type.

Block layouts: ggml-common.h (see cython/qtypes.h for the same in C).
"""
from __future__ import annotations

import gguf
import numpy as np

try:  # the C quantizers (setup.py builds them with the kernels)
    from pyinfer.ops import _quantize as _kq
except ImportError:  # a source tree not built yet: the NumPy twin, slower
    _kq = None

QT = gguf.GGMLQuantizationType
QK_K = 256
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _f16(v: np.ndarray) -> np.ndarray:
    """f32 -> (f16 bit pattern as uint16 (..., 1) uint8 pairs, the f16 value back in f32)."""
    h = np.asarray(v, np.float32).astype(np.float16)
    return h, h.astype(np.float32)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
               nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml make_qkx2_quants (squared error) for every row of x (B, n): returns (scale, the_min),
    both (B,) f32, with x ~ scale * L - the_min, L in 0..nmax. As in ggml, each candidate scale
    is taken against the best offset found so far (min is updated inside the loop)."""
    f = np.float32
    mn = np.minimum(x.min(axis=1), f(0))
    mx = x.max(axis=1)
    sum_w = w.sum(axis=1, dtype=f)
    sum_x = (w * x).sum(axis=1, dtype=f)
    flat = mx == mn
    span = np.where(flat, f(1), mx - mn)
    iscale = f(nmax) / span
    scale = f(1) / iscale
    L = np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(axis=1, dtype=f)
    for step in range(nstep + 1):
        span = np.where(flat, f(1), mx - mn)
        isc = (f(rmin) + f(rdelta) * f(step) + f(nmax)) / span
        la = np.clip(np.rint(isc[:, None] * (x - mn[:, None])), 0, nmax).astype(f)
        sl = (w * la).sum(axis=1, dtype=f)
        sl2 = (w * la * la).sum(axis=1, dtype=f)
        sxl = (w * la * x).sum(axis=1, dtype=f)
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, f(1))
        ts = (sum_w * sxl - sum_x * sl) / Ds
        tm = (sl2 * sum_x - sl * sxl) / Ds
        pos = tm > 0
        tm = np.where(pos, f(0), tm)
        ts = np.where(pos, sxl / np.where(sl2 > 0, sl2, f(1)), ts)
        err = (w * (ts[:, None] * la + tm[:, None] - x) ** 2).sum(axis=1, dtype=f)
        better = ok & (err < best)
        best = np.where(better, err, best)
        scale = np.where(better, ts, scale)
        mn = np.where(better, tm, mn)
    scale = np.where(flat, f(0), scale)
    return scale.astype(f), (-mn).astype(f)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block (S, 8) -> ggml's 12 bytes (S, 12)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _quantize_qk(x: np.ndarray, nmax: int) -> np.ndarray:
    """Q4_K (nmax 15) or Q5_K (nmax 31): x (S, 256) f32 -> (S, 144 or 176) uint8."""
    f = np.float32
    S = x.shape[0]
    xs = x.reshape(S * 8, 32)
    av_x = np.sqrt((xs * xs).sum(axis=1, dtype=f) / f(32))
    w = av_x[:, None] + np.abs(xs)
    if nmax == 15:
        scales, mins = _make_qkx2(xs, w, 15, -1.0, 0.1, 20)
    else:
        scales, mins = _make_qkx2(xs, w, 31, -0.5, 0.1, 15)
    scales, mins = scales.reshape(S, 8), mins.reshape(S, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_s = np.where(max_scale > 0, f(63) / np.where(max_scale > 0, max_scale, f(1)), f(0))
    inv_m = np.where(max_min > 0, f(63) / np.where(max_min > 0, max_min, f(1)), f(0))
    ls = np.minimum(63, np.rint(inv_s[:, None] * scales))
    lm = np.minimum(63, np.rint(inv_m[:, None] * mins))
    d16, d = _f16(max_scale / f(63))
    m16, dmin = _f16(max_min / f(63))
    dj = (d[:, None] * ls.astype(f)).reshape(S * 8)
    mj = (dmin[:, None] * lm.astype(f)).reshape(S * 8)
    safe = np.where(dj != 0, dj, f(1))
    L = np.clip(np.rint((xs + mj[:, None]) / safe[:, None]), 0, nmax)
    L = np.where((dj != 0)[:, None], L, 0).astype(np.uint8).reshape(S, 4, 2, 32)
    lo, hi = L[:, :, 0, :], L[:, :, 1, :]  # sub-blocks 2j and 2j+1 of each 64-value chunk
    qs = ((lo & 15) | ((hi & 15) << 4)).reshape(S, 128)
    parts = [d16.view(np.uint8).reshape(S, 2), m16.view(np.uint8).reshape(S, 2),
             _pack_k4_scales(ls, lm)]
    if nmax == 31:
        bit = np.arange(4, dtype=np.uint8)[None, :, None]
        qh = (((lo >> 4) << (2 * bit)) | ((hi >> 4) << (2 * bit + 1))).sum(axis=1, dtype=np.uint8)
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _make_qx_rmse1(x: np.ndarray, nmax: int) -> np.ndarray:
    """ggml make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) for rows of x (B, n): the scale (B,)
    (weights x^2, 19 candidate scales around -nmax/max)."""
    f = np.float32
    idx = np.argmax(np.abs(x), axis=1)
    mx = x[np.arange(x.shape[0]), idx]
    zero = np.abs(mx) < f(1e-15)
    mxs = np.where(zero, f(1), mx)
    w = x * x

    def sums(iscale):
        lv = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)
        return (w * x * lv).sum(axis=1, dtype=f), (w * lv * lv).sum(axis=1, dtype=f)

    sumlx, suml2 = sums(f(-nmax) / mxs)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f(1)), f(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        slx, sl2 = sums(-(f(nmax) + f(0.1) * f(step)) / mxs)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        new = slx / np.where(sl2 > 0, sl2, f(1))
        scale = np.where(better, new, scale)
        best = np.where(better, new * slx, best)
    return np.where(zero, f(0), scale).astype(f)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: x (S, 256) f32 -> (S, 210) uint8."""
    f = np.float32
    S = x.shape[0]
    xs = x.reshape(S * 16, 16)
    scales = _make_qx_rmse1(xs, 32).reshape(S, 16)
    pick = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(S), pick]
    empty = np.abs(max_scale) < f(1e-15)
    iscale = f(-128) / np.where(empty, f(1), max_scale)
    d16, d = _f16(np.where(empty, f(0), f(1) / iscale))
    sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
    sc[empty] = 0
    dj = (d[:, None] * sc.astype(f)).reshape(S * 16)
    safe = np.where(dj != 0, dj, f(1))
    L = np.clip(np.rint(xs / safe[:, None]), -32, 31) + 32
    L = np.where((dj != 0)[:, None], L, 32).astype(np.uint8).reshape(S, 2, 4, 32)
    ql = np.concatenate([(L[:, :, 0] & 15) | ((L[:, :, 2] & 15) << 4),
                         (L[:, :, 1] & 15) | ((L[:, :, 3] & 15) << 4)], axis=2).reshape(S, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(S, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(S, 2)], axis=1)
    out[empty] = 0
    return out


def quantize(a: np.ndarray, qtype, n_threads: int | None = None) -> np.ndarray:
    """float32 (rows, cols) -> ggml blocks of ``qtype``, as uint8 (rows, bytes_per_row) (F16: float16
    (rows, cols)). K-quants need cols % 256 == 0 and run in C (cython/kquant.h, ``n_threads``
    threads, default the physical cores) when the compiled module is there, else in NumPy
    (``quantize_numpy``); other types go to ``gguf.quants.quantize``.

    Raises ValueError for a row length the type's blocks do not divide, NotImplementedError for a
    type neither this module nor gguf quantizes."""
    qtype = QT(qtype)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype not in K_QUANTS or _kq is None:
        return quantize_numpy(a, qtype)
    rows, cols = a.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} row length {cols} is not a multiple of {QK_K}")
    if n_threads is None:
        from pyinfer.ops.cpu import default_n_threads

        n_threads = default_n_threads()
    out = np.empty((rows * cols // QK_K, _kq.block_bytes(int(qtype))), np.uint8)
    _kq.quantize_k(a.reshape(-1, QK_K), int(qtype), out, n_threads)
    return out.reshape(rows, -1)


def quantize_numpy(a: np.ndarray, qtype) -> np.ndarray:
    """``quantize`` in NumPy: the twin of the C K-quant quantizers (and gguf's for other types)."""
    qtype = QT(qtype)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(a, qtype)
    rows, cols = a.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} row length {cols} is not a multiple of {QK_K}")
    x = a.reshape(-1, QK_K)
    if qtype == QT.Q4_K:
        blocks = _quantize_qk(x, 15)
    elif qtype == QT.Q5_K:
        blocks = _quantize_qk(x, 31)
    else:
        blocks = _quantize_q6_k(x)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


#: the 32-value types with a fifth bit per value (ggml's block_q5_0 / block_q5_1: qh, then qs)
Q5_TYPES = (QT.Q5_0, QT.Q5_1)

#: the symmetric 32-value types ``quantize_weighted`` searches, with their value range
#: (q in -nmax .. nmax - 1, stored as q + nmax)
WEIGHTED_TYPES = {QT.Q4_0: 8, QT.Q5_0: 16}
#: the divisors m / div tried for a block's scale, m its value of largest magnitude:
#: round-to-nearest is div = -nmax; llama.cpp's imatrix quantizers search a similar range
_WEIGHTED_DIVS = {n: np.concatenate([np.arange(-(n + 1.0), -(n - 1.5) + 1e-6, 0.25),
                                     np.arange(n - 1.5, n + 0.5 + 1e-6, 0.25)]).astype(np.float32)
                  for n in WEIGHTED_TYPES.values()}


def quantize_weighted(a: np.ndarray, qtype, imatrix: np.ndarray,
                      n_threads: int | None = None) -> np.ndarray:
    """float32 (rows, cols) -> ``qtype`` blocks (uint8 (rows, bytes_per_row), ggml's layout, what
    ``quantize`` returns) whose scales minimise the importance-weighted squared error of each
    32-value block, sum_j w_j (a_j - d q_j)^2, instead of round-to-nearest at d = m / -nmax.

    qtype: Q4_0 or Q5_0 (``WEIGHTED_TYPES``). imatrix (cols,) >= 0: the mean square of input
    channel j of the matrix over calibration tokens, E[x_j^2] (llama.cpp's importance matrix:
    the output error of a weight error e_j is e_j x_j, so E[(sum_j e_j x_j)^2] ~ sum_j e_j^2
    E[x_j^2] for uncorrelated channels); w_j = imatrix_j / mean(imatrix) + 1e-3 (every channel
    keeps some weight). Per block: for each divisor in ``_WEIGHTED_DIVS`` the values
    q = clamp(round(a / d), -nmax, nmax - 1) at d = m / div (m the value of largest magnitude),
    then the least-squares scale for those q, rounded to f16, and q again at that scale; the block
    keeps the candidate of least weighted error, or gguf's own round-to-nearest block
    (``gguf.quants.quantize``) where that is no worse, so no block's weighted error exceeds
    round-to-nearest's. SmolLM2 q4_0: perplexity -10 to -14% against round-to-nearest on two
    held-out texts (docs/benchmarks.md, session 30). The search runs in C (cython/kquant.h
    ``kq_quantize_w32``, ``n_threads`` threads, default the physical cores) where the compiled
    module is there, else in NumPy (``quantize_weighted_numpy``; the two can differ in a block
    where two candidates tie to float rounding).

    Raises ValueError for another type, a row length that is not a multiple of 32, or an imatrix
    of the wrong length or with negative or non-finite values."""
    qtype = QT(qtype)
    if qtype not in WEIGHTED_TYPES:
        raise ValueError(f"quantize_weighted: {qtype.name} is not one of "
                         f"{', '.join(t.name for t in WEIGHTED_TYPES)}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    rows, cols = a.shape
    if cols % 32:
        raise ValueError(f"{qtype.name} row length {cols} is not a multiple of 32")
    im = np.asarray(imatrix, np.float64).reshape(-1)
    if im.shape[0] != cols:
        raise ValueError(f"imatrix has {im.shape[0]} values for a row of {cols}")
    if not np.isfinite(im).all() or (im < 0).any():
        raise ValueError("imatrix values must be finite and >= 0")
    mean = float(im.mean())
    w_row = ((im / mean if mean > 0 else np.ones(cols)) + 1e-3).astype(np.float32)
    nb = cols // 32
    ref = np.asarray(gguf.quants.quantize(a, qtype), np.uint8).reshape(rows * nb, -1)
    if _kq is None or not hasattr(_kq, "quantize_weighted"):
        return quantize_weighted_numpy(a, qtype, w_row, ref)
    if n_threads is None:
        from pyinfer.ops.cpu import default_n_threads

        n_threads = default_n_threads()
    out = np.empty_like(ref)
    _kq.quantize_weighted(a.reshape(-1, 32), w_row, ref, int(qtype), out, n_threads)
    return out.reshape(rows, -1)


def quantize_weighted_numpy(a: np.ndarray, qtype, w_row: np.ndarray, ref: np.ndarray,
                            chunk: int = 1 << 16) -> np.ndarray:
    """``quantize_weighted`` in NumPy: a (rows, cols) f32, w_row (cols,) f32 the weights (not the
    imatrix), ref gguf's round-to-nearest blocks of a (rows * cols / 32 blocks, any 2-D shape).
    Returns uint8 (rows, bytes_per_row)."""
    f = np.float32
    qtype = QT(qtype)
    nmax = WEIGHTED_TYPES[qtype]
    rows, cols = a.shape
    nb = cols // 32
    w_blk = np.asarray(w_row, f).reshape(-1, 32)  # (cols / 32, 32): block b of every row
    ref = np.asarray(ref, np.uint8).reshape(rows * nb, -1)
    ref_x = np.asarray(gguf.quants.dequantize(ref, qtype), f).reshape(rows * nb, 32)
    x_all = a.reshape(rows * nb, 32)
    hb = 2  # the f16 scale, then (q5) qh and qs
    out = ref.copy()
    for s in range(0, rows * nb, chunk):
        x = x_all[s:s + chunk]
        n = x.shape[0]
        w = w_blk[(np.arange(s, s + n) % nb)]  # (n, 32)
        m = x[np.arange(n), np.abs(x).argmax(1)]
        best = (w * (ref_x[s:s + n] - x) ** 2).sum(1, dtype=f)
        best_d = np.zeros(n, np.float16)
        found = np.zeros(n, bool)
        for div in _WEIGHTED_DIVS[nmax]:
            d = m / div
            inv = np.divide(f(1), d, out=np.zeros(n, f), where=d != 0)
            q = np.clip(np.rint(x * inv[:, None]), -nmax, nmax - 1)
            wq = w * q
            den = (wq * q).sum(1, dtype=f)
            dl = np.divide((wq * x).sum(1, dtype=f), den, out=np.zeros(n, f), where=den > 0)
            d16 = dl.astype(np.float16)
            d32 = d16.astype(f)
            inv = np.divide(f(1), d32, out=np.zeros(n, f), where=d32 != 0)
            q = np.clip(np.rint(x * inv[:, None]), -nmax, nmax - 1)
            err = (w * (d32[:, None] * q - x) ** 2).sum(1, dtype=f)
            better = np.isfinite(d32) & (err < best)
            best = np.where(better, err, best)
            best_d = np.where(better, d16, best_d)
            found |= better
        if not found.any():
            continue
        d16 = best_d[found]
        d32 = d16.astype(f)
        inv = np.divide(f(1), d32, out=np.zeros(d32.shape, f), where=d32 != 0)
        u = (np.clip(np.rint(x[found] * inv[:, None]), -nmax, nmax - 1) + nmax).astype(np.uint8)
        blk = out[s:s + n][found]
        blk[:, :hb] = d16.view(np.uint8).reshape(-1, 2)
        blk[:, hb:] = values_to_blocks(u[None], qtype)[0]
        out[s:s + n][found] = blk
    return out.reshape(rows, -1)


def block_values(blk: np.ndarray, qtype, hb: int) -> np.ndarray:
    """ggml blocks (n_out, nb, block bytes) of a 4- or 5-bit type -> their unsigned values u
    (n_out, nb, 32) uint8 (ggml's dequantize_row_q4_0 / q5_0: value c < 16 in the low nibble of
    qs[c], c + 16 in the high one; q5's fifth bit of value c is bit c of the little-endian qh)."""
    if qtype not in Q5_TYPES:
        qs = blk[:, :, hb:]
        return np.concatenate([qs & 15, qs >> 4], axis=2)
    qh = blk[:, :, hb:hb + 4].copy().view("<u4")  # (n_out, nb, 1)
    qs = blk[:, :, hb + 4:hb + 20]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.concatenate([qs & 15, qs >> 4], axis=2) | (high << 4)


def values_to_blocks(u: np.ndarray, qtype) -> np.ndarray:
    """The inverse of ``block_values`` for the value bytes: u (n_out, nb, 32) -> (n_out, nb,
    16 or 20) (q5: qh then qs)."""
    qs = (u[:, :, :16] & 15) | ((u[:, :, 16:] & 15) << 4)
    if qtype not in Q5_TYPES:
        return qs
    qh = (((u >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(2, dtype=np.uint32)
    return np.concatenate([qh[..., None].astype("<u4").view(np.uint8), qs], axis=2)


def _k_sub_blocks(b: np.ndarray, name: str):
    """The eight 32-value sub-blocks' f16 scale and min of K-quant super-blocks b (S, bytes)
    that start as ggml's ``block_q4_K`` / ``block_q5_K`` do (f16 d, f16 dmin, 12 bytes of eight
    6-bit scales sc_s and mins m_s, ggml-quants.c ``get_scale_min_k4``): (d', m') (S, 8) f16 with
    w = d' q + m', d' = f16(d sc_s), m' = f16(-dmin m_s). ValueError where f16 cannot hold one."""
    S = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (S, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc = b[:, 4:16].astype(np.uint8)
    ls = np.empty((S, 8), np.uint8)  # the inverse of _pack_k4_scales
    lm = np.empty((S, 8), np.uint8)
    ls[:, 0:4], lm[:, 0:4] = sc[:, 0:4] & 63, sc[:, 4:8] & 63
    ls[:, 4:8] = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    lm[:, 4:8] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    with np.errstate(over="ignore"):
        dd = (d * ls.astype(np.float32)).astype(np.float16)  # (S, 8)
        mm = (-(dmin * lm.astype(np.float32))).astype(np.float16)
    if not (np.isfinite(dd).all() and np.isfinite(mm).all()):
        raise ValueError(f"a {name} scale or min does not fit in f16")
    return dd, mm


def q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows -> Q4_1 rows of the same 4-bit values: uint8 (rows, 144 * n / 256) -> uint8
    (rows, 20 * n / 32), for n values a row.

    A Q4_K super-block (ggml-common.h ``block_q4_K``: f16 d, f16 dmin, 12 bytes of eight 6-bit
    scales sc_s and mins m_s, 128 bytes of nibbles) decodes its 32-value sub-block s as
    w = (d sc_s) q - (dmin m_s), q in 0..15 (ggml-quants.c ``dequantize_row_q4_K``): the form of a
    Q4_1 block, w = d' q + m'. So each sub-block becomes one Q4_1 block with the same nibbles and
    d' = f16(d sc_s), m' = f16(-dmin m_s): the two f16 roundings (2^-11 of the scale and of the
    min, relative; less precision below f16's smallest normal, 6.1e-5) are the only change, where
    requantizing the decoded values to Q4_1 would move them by up to half a step. Q4_1 takes 20
    bytes per 32 values against Q4_K's 18. Sparse mode input stores Q4_K matrices so
    (predictors/input_sparse.py ``transposed_jobs``): the input-block kernels read Q4_1.
    Raises ValueError for rows that are not whole super-blocks, or a scale or min that f16
    cannot hold."""
    rows, b, out = _k_to_x_1(raw, 144, "Q4_K", 20)
    L = _k_low_nibbles(b[:, 16:144])
    out[:, :, 4:20] = values_to_blocks(L, QT.Q4_1)
    return out.reshape(rows, -1)


def q5_k_to_q5_1(raw: np.ndarray) -> np.ndarray:
    """Q5_K rows -> Q5_1 rows of the same 5-bit values: uint8 (rows, 176 * n / 256) -> uint8
    (rows, 24 * n / 32), for n values a row.

    A Q5_K super-block (ggml-common.h ``block_q5_K``: f16 d, f16 dmin, the 12 scale bytes of
    Q4_K, 32 bytes qh, 128 bytes of low nibbles ql) decodes value l of sub-block s (64-value
    chunk c = s / 2: the low nibbles of ql[32 c + l] for even s, the high ones for odd s) as
    w = (d sc_s) (q + 16 bit_s(qh[l])) - (dmin m_s) (ggml-quants.c ``dequantize_row_q5_K``): a
    Q5_1 block's form, w = d' u + m' with u in 0..31, so each sub-block becomes one Q5_1 block
    (f16 d', f16 m', u32 qh with bit l the fifth bit of value l, 16 bytes with values l and l + 16
    in the low and high nibble of byte l) of the same values; d' and m' as ``q4_k_to_q4_1``'s (the
    two f16 roundings are the only change). Q5_1 takes 24 bytes per 32 values against Q5_K's 22.
    Raises ValueError for rows that are not whole super-blocks, or a scale or min that f16
    cannot hold."""
    rows, b, out = _k_to_x_1(raw, 176, "Q5_K", 24)
    L = _k_low_nibbles(b[:, 48:176])
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (S, 8, 32):
    # bit s of qh byte l is the fifth bit of value l of sub-block s
    out[:, :, 4:24] = values_to_blocks(L | (high << 4), QT.Q5_1)
    return out.reshape(rows, -1)


def _k_to_x_1(raw: np.ndarray, k_bytes: int, name: str, x_bytes: int):
    """The common part of ``q4_k_to_q4_1`` / ``q5_k_to_q5_1``: raw K-quant rows checked and cut
    into super-blocks b (S, k_bytes), and the output blocks (S, 8, x_bytes) uint8 with each
    sub-block's f16 scale and min (``_k_sub_blocks``) in bytes 0:4. Returns (rows, b, out)."""
    raw = np.ascontiguousarray(raw, np.uint8)
    if raw.ndim != 2 or raw.shape[1] % k_bytes:
        raise ValueError(f"{name} rows must be (rows, a multiple of {k_bytes} bytes), got {raw.shape}")
    b = raw.reshape(-1, k_bytes)
    S = b.shape[0]
    dd, mm = _k_sub_blocks(b, name)
    out = np.empty((S, 8, x_bytes), np.uint8)
    out[:, :, 0:2] = dd.view(np.uint8).reshape(S, 8, 2)
    out[:, :, 2:4] = mm.view(np.uint8).reshape(S, 8, 2)
    return raw.shape[0], b, out


def _k_low_nibbles(q: np.ndarray) -> np.ndarray:
    """A K-quant super-block's 128 bytes of nibbles (S, 128) -> its values' low 4 bits (S, 8, 32)
    per sub-block in order (64-value chunk c: sub-block 2c in the low nibbles, 2c + 1 the high)."""
    q = q.reshape(-1, 4, 32)
    return np.stack([q & 15, q >> 4], axis=2).reshape(-1, 8, 32)
