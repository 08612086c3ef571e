# cython: language_level=3
"""K-quant quantizers in C (cython/kquant.h) for pyinfer.quants: Q4_K, Q5_K and Q6_K rows,
super-blocks shared out to threads (each super-block's bytes depend on its 256 values only, so
the result does not depend on the thread count)."""
from cython.parallel cimport prange
from libc.stdint cimport uint8_t


cdef extern from "kquant.h" nogil:
    void kq_quantize_q45_k(const float *x, uint8_t *out, int nmax)
    void kq_quantize_q6_k(const float *x, uint8_t *out)
    unsigned short kq_f32_to_f16(float f)
    void kq_quantize_w32(const float *x, const float *w, int nmax, const uint8_t *ref,
                         uint8_t *out)

cdef enum:  # ggml type ids (gguf.GGMLQuantizationType)
    Q4_0 = 2
    Q5_0 = 6
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


def block_bytes(int qtype):
    """Bytes of one super-block of ``qtype`` (Q4_K 144, Q5_K 176, Q6_K 210); ValueError else."""
    if qtype == Q4_K:
        return 144
    if qtype == Q5_K:
        return 176
    if qtype == Q6_K:
        return 210
    raise ValueError(f"no C quantizer for ggml type {qtype}")


def quantize_k(const float[:, ::1] x, int qtype, uint8_t[:, ::1] out, int n_threads=1):
    """x (n_blocks, 256) f32 -> out (n_blocks, block_bytes(qtype)) uint8, one super-block a row.
    Raises ValueError for a type without a C quantizer or shapes that do not fit."""
    cdef Py_ssize_t nb = x.shape[0], b
    cdef int bb = block_bytes(qtype)
    if x.shape[1] != 256 or out.shape[0] != nb or out.shape[1] != bb:
        raise ValueError(f"quantize_k: x {x.shape[0]}x{x.shape[1]} and out "
                         f"{out.shape[0]}x{out.shape[1]} do not fit type {qtype}")
    if nb == 0:
        return
    cdef int nmax = 15 if qtype == Q4_K else 31
    with nogil:
        if qtype == Q6_K:
            for b in prange(nb, schedule='static', num_threads=n_threads):
                kq_quantize_q6_k(&x[b, 0], &out[b, 0])
        else:
            for b in prange(nb, schedule='static', num_threads=n_threads):
                kq_quantize_q45_k(&x[b, 0], &out[b, 0], nmax)


def quantize_weighted(const float[:, ::1] x, const float[::1] w, const uint8_t[:, ::1] ref,
                      int qtype, uint8_t[:, ::1] out, int n_threads=1):
    """Importance-weighted q4_0 / q5_0 scales (kquant.h kq_quantize_w32): x (n_blocks, 32) f32,
    the blocks of a row-major matrix in order; w (cols,) f32 the weight of each column, block b
    taking w[32 (b % (cols / 32)):][:32]; ref (n_blocks, block bytes) gguf's round-to-nearest
    blocks of x; out (n_blocks, block bytes). Each block depends on its own values alone (any
    thread count gives the same bytes). Raises ValueError for another type or shapes that do not
    fit."""
    cdef Py_ssize_t nb = x.shape[0], b, per_row
    cdef int nmax, bb
    if qtype == Q4_0:
        nmax, bb = 8, 18
    elif qtype == Q5_0:
        nmax, bb = 16, 22
    else:
        raise ValueError(f"no weighted quantizer for ggml type {qtype}")
    if (x.shape[1] != 32 or ref.shape[0] != nb or out.shape[0] != nb or ref.shape[1] != bb
            or out.shape[1] != bb or w.shape[0] % 32 or w.shape[0] == 0):
        raise ValueError(f"quantize_weighted: x {x.shape[0]}x{x.shape[1]}, w {w.shape[0]}, ref "
                         f"{ref.shape[0]}x{ref.shape[1]} and out {out.shape[0]}x{out.shape[1]} do "
                         f"not fit type {qtype}")
    per_row = w.shape[0] // 32
    if nb == 0:
        return
    with nogil:
        for b in prange(nb, schedule='static', num_threads=n_threads):
            kq_quantize_w32(&x[b, 0], &w[32 * (b % per_row)], nmax, &ref[b, 0], &out[b, 0])


def f32_to_f16_bits(float f):
    """kq_f32_to_f16 (for tests): the f16 bit pattern of f, round to nearest even."""
    return kq_f32_to_f16(f)
