# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled CPU kernels of pyinfer (wrapped by pyinfer/ops/cpu.py; NumPy twins in ops/reference.py).

Layout follows scikit-learn's Cython kernels: each ``def`` checks shapes and raises ValueError,
then runs a loop without the GIL under ``prange(..., schedule='static', num_threads=n_threads)``.
Weights arrive as raw row bytes: ``w`` is a C-contiguous uint8 (rows, bytes_per_row) view (a
read-only memmap is fine: every weight memoryview is ``const``), ``qtype`` is the ggml type id
(0 f32, 1 f16, 2 q4_0, 3 q4_1, 6 q5_0, 7 q5_1, 8 q8_0, 12 q4_k, 13 q5_k, 14 q6_k, 30 bf16) and ``cols`` the logical row length. The row loops are in simd.h and qtypes.h.

Quantized (q4_0 / q8_0) dot products quantize the activation to 8 bits per 32-block first, as
llama.cpp's ggml_vec_dot_q4_0_q8_0 does: relative error about 1e-3 against an f32 dot.
"""
from cython.parallel cimport prange, parallel
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int8_t, int32_t, int64_t
from cython cimport view
from libc.stdlib cimport malloc, free, calloc

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)
from libc.string cimport memset, memcpy
from libc.math cimport expf, sqrtf, fabsf, cos, sin, pow

cdef extern from "simd.h" nogil:
    int pi_openmp_enabled()
    int pi_simd_enabled()
    int pi_simd_features()
    int pi_is_quant(int qtype)
    size_t pi_col_offset(int qtype, int col)
    int pi_block_elems(int qtype)
    int pi_block_bytes(int qtype)
    void pi_dequant_cols(int qtype, const uint8_t *row, int c0, float *out, int n)
    float pi_dot_f32(const float *a, const float *b, int n)
    float pi_dot_row(int qtype, const uint8_t *row, const float *x, const float *xd,
                     const int8_t *xq, int n)
    void pi_quantize_q8(const float *x, int n, float *d, int8_t *q)
    int pi_gemv8_supported(int qtype)
    void pi_gemv8(int qtype, const uint8_t *w, size_t stride, const int32_t *idx, long g, long n,
                  const float *xd, const int8_t *xq, int nb, float *out, long pd)
    void pi_dot4_q8_0(const uint8_t *row, const float *xd, long xd_stride, const int8_t *xq,
                      long xq_stride, int nb, float *out, long out_stride)
    void pi_dot4_q4_0(const uint8_t *row, const float *xd, long xd_stride, const int8_t *xq,
                      long xq_stride, int nb, float *out, long out_stride)
    int PI_Q8_0_ID "PI_Q8_0"
    int PI_Q4_0_ID "PI_Q4_0"
    int pi_is_xquant(int qtype)
    void pi_dot4_xrow(int qtype, const uint8_t *row, const float *xd, long xd_stride,
                      const int8_t *xq, long xq_stride, int nb, float *out, long out_stride)
    void pi_axpy_f32(float a, const float *w, float *out, int n)
    void pi_f32_to_f16_row(const float *x, uint16_t *o, long n)
    void pi_f16_to_f32_row(const uint16_t *h, float *o, long n)
    void pi_axpy_row(int qtype, float a, const uint8_t *row, float *out, int n)
    void pi_dequant_row(int qtype, const uint8_t *row, float *out, int n)
    void pi_add_f32(float *out, const float *a, int n)
    void pi_prefetch_l1(const uint8_t *p, size_t nbytes)
    void pi_prefetch_l2(const uint8_t *p, size_t nbytes)
    int pi_prefetch_dist(size_t row_bytes)
    int PI_L1_PREFETCH_MAX_ROW
    int pi_gather_pf_mode
    void pi_axpy4_strip64(const float *a, long a_stride, const float *buf, float *out,
                          long out_stride, long n_tok)
    void pi_axpy4_row(int qtype, const float *a, const uint8_t *r0, const uint8_t *r1,
                      const uint8_t *r2, const uint8_t *r3, float *out, int n)
    void pi_axpy_rows_range(int qtype, const uint8_t *w, size_t stride, const float *coef,
                            const int32_t *idx, long k0, long k1, long kp, float *out, int cols)
    int pi_axpy_rows_int(int qtype, const int32_t *idx)
    int pi_axpyq_unit_cols(int qtype)
    void pi_axpyq_rows_cols(int qtype, const uint8_t *w, size_t stride, const float *coef,
                            const int32_t *idx, long n, float *out, int c0, int c1)

cdef extern from "rowsum_team.h" nogil:
    void pi_gelu_tanh(const float *g, float *out, long n)
    void pi_team_barrier()
    int pi_team_thread()
    int pi_team_size()
    long pi_axpy_rows_threads(int qtype, const int32_t *idx, size_t stride, long n, int cols)
    void pi_axpy_rows_team(int t, int T, int qtype, const uint8_t *w, size_t stride,
                           const float *coef, const int32_t *idx, long n, float *out, int cols,
                           float *tmp, float *add)
    float pi_act1(float g, int silu)  # silu(g) = g / (1 + exp(-g)) if silu, else relu(g)
    long pi_axpy_nchunks(long n, size_t stride)
    long pi_axpy_split_cols_bytes
    size_t pi_axpy_tmp_floats(long n, int cols, size_t stride)
    int pi_is_ib(int qtype)
    void pi_ib_pf_first(int t, int T, int qtype, const uint8_t *w, size_t stride, int cols)
    size_t pi_ib_block_bytes(int qtype, long n_out)
    void pi_ib_matmul(int qtype, const uint8_t *w, size_t stride, long n_in, const float *a,
                      long lda, long n_tok, float *out, long ldo, int cols, int n_threads)
    int PI_Q8_0_IB_ID "PI_Q8_0_IB"
    int PI_Q4_0_IB_ID "PI_Q4_0_IB"
    int PI_Q4_1_IB_ID "PI_Q4_1_IB"
    int PI_Q5_0_IB_ID "PI_Q5_0_IB"
    int PI_Q5_1_IB_ID "PI_Q5_1_IB"
    int PI_IB_TILE
    void pi_axpy_rows_par(int qtype, const uint8_t *w, size_t stride, const float *coef,
                          const int32_t *idx, long n, float *out, int cols, float *tmp,
                          int n_threads)
    long pi_select_kept(const float *x, const float *scale, float thr, long n, long j0,
                        float *coef, int32_t *idx)
    long pi_act_select(const float *gu, long n_ff, long j0, long j1, int silu, const float *sd,
                       float thr, float *coef, int32_t *idx)
    void pi_act_values(const float *gu, long n_ff, long j0, long j1, int silu, float *out)
    void pi_act_span(int t, int T, long n_ff, long *j0, long *j1)
    long pi_act_gather(int T, long n_ff, const long *cnt, const float *ctmp,
                       const int32_t *itmp, float *coef, int32_t *idx)

cdef extern from "attend.h" nogil:
    void pi_attend_team(int t, int T, const float *q, const void *k, const void *v, int f16, long rs,
                        long n_att, int hd, int n_head, int n_kv, float scale, float *sc,
                        float *out)

cdef extern from "gemm.h" nogil:
    int pi_gemm_supported(int qtype)
    void pi_gemm_rows(int qtype, const uint8_t *w, size_t ws, long r0, long r1, const float *xd,
                      const int8_t *xq, long xqs, int nb, long n_tok, float *out, long ldo,
                      uint8_t *buf)
    int PI_GEMM_BUF_PER_BLOCK
    void pi_gemm_t_strip(int qtype, const uint8_t *w, size_t ws, long rows, int c0, int cn,
                         const float *a, long lda, long n_tok, float *out, long ldo, float *panel)
    void pi_glu_rows(int qtype_g, const uint8_t *wg, size_t wgs, int qtype_u, const uint8_t *wu,
                     size_t wus, long r0, long r1, const float *xd, const int8_t *xq, long xqs,
                     int nb, long n_tok, float *out, long ldo, int silu, uint8_t *buf,
                     float *scratch)
    int PI_GLU_RM
    void pi_attend_block(const float *const *q, int nq, const long *n_att, const float *k,
                         const float *kt, const float *v, long rs, int hd, float scale, float *sc,
                         long sc_stride, float *const *out)
    void pi_transpose_keys(const float *k, long rs, int hd, long n, float *kt)
    int PI_ATT_MAX_HD

cdef extern from "gemmt.h" nogil:
    int pi_gemmt_supported(int qtype)
    void pi_gemmt_strip(int qtype, const uint8_t *w, size_t ws, long rows, int c0, const float *a,
                        long lda, long n_tok, float *out, long ldo)

# rows per parallel work item in matmul (prefill): a tile of weight rows stays in L1 while every
# token is dotted with it, and each output row gets a contiguous run of writes.
DEF ROW_TILE = 16
# columns per work item in matmul_t (a multiple of 32 so quantized blocks are never split)
DEF COL_TILE = 64
# the row sums over transposed matrices (_axpy_rows, the FFN tail of decode_ffn_in): chunking,
# column split and the one parallel region of each are in rowsum_team.h
# tokens per work item of the batched attention: with the group's query heads, the queries that
# share each K/V row read from L2 (SmolLM2: 3 heads x 4 tokens)
DEF ATT_TOKENS = 4

# tokens per pass of matmul_t's integer strips (gemmt.h): every strip reads all its tokens'
# activations, so a pass over 128 tokens keeps them in L2/L3 for all strips (7B down projection
# 11008 rows x 512 tokens: 22 MB of activations streamed per strip without it; 128-token passes
# were 1.1-1.3x faster there, 1536x576 unchanged: session 9)
DEF GEMMT_TOKENS = 128
# 0: matmul_t runs gemm.h's f32 strips for q8_0/q4_0 too (set_int8_matmul_t)
cdef int _int8_matmul_t = 1

# 1: prefill runs the kernels from before issue 11's GEMM (per-row four-token dots, 64-column AXPY
# strips, attention one query at a time). Only for benchmarking the change (tools/bench.py
# --old-prefill).
cdef int _old_prefill = 0


def prefill_gemm_supported(int qtype):
    """True when matmul runs gemm.h's tiled int8 GEMM for this ggml type id."""
    return bool(pi_gemm_supported(qtype))


def set_gather_mode(int mode):
    """How gather_matvec reads scattered rows of the 8-row types (benchmarks only; every mode
    gives the same bits): 1 (default) eight rows per pass, the rows of a group ahead prefetched
    to L2 line by line across the blocks; 0 the same with session 7's burst prefetch (pd rows ahead to
    L2, the next group to L1); 2 one row per pass with the one-row loop's prefetch. Returns the
    previous mode."""
    global pi_gather_pf_mode
    cdef int prev = pi_gather_pf_mode
    pi_gather_pf_mode = mode
    return prev


def set_axpy_split_cols_bytes(long nbytes):
    """Rows of at least nbytes take the column split of the integer row sums (rowsum_team.h);
    returns the previous setting. For A/B benchmarks (the split changes f32 summation order)."""
    global pi_axpy_split_cols_bytes
    cdef long prev = pi_axpy_split_cols_bytes
    pi_axpy_split_cols_bytes = nbytes
    return prev


def set_int8_matmul_t(int on):
    """matmul_t's q8_0/q4_0 path: gemmt.h's int8 sums (on=1, the default) or gemm.h's f32 strips
    (0, exact dequantization: prefill then matches decode's axpyq.h sums within f32 order);
    returns the previous setting. For tests and A/B benchmarks."""
    global _int8_matmul_t
    cdef int prev = _int8_matmul_t
    _int8_matmul_t = 1 if on else 0
    return prev


def set_old_prefill(int on):
    """Select the pre-GEMM prefill kernels (on=1) or the tiled ones (0, the default) of matmul,
    matmul_t and attention; returns the previous setting. For A/B benchmarks only: the results
    agree within f32 summation order (tests/test_prefill_gemm.py)."""
    global _old_prefill
    cdef int prev = _old_prefill
    _old_prefill = 1 if on else 0
    return prev


def openmp_enabled():
    """True when the kernels were compiled with OpenMP (n_threads > 1 has an effect)."""
    return bool(pi_openmp_enabled())


def simd_enabled():
    """True when the AVX2/FMA/F16C paths of simd.h were compiled in."""
    return bool(pi_simd_enabled())


def simd_features():
    """The SIMD paths compiled in (simd.h pi_simd_features), as a tuple of names: "AVX2"
    (AVX2/FMA/F16C), "AVX512" (the 512-bit paths: AVX-512 F and BW), "VNNI256" (the 256-bit
    u8 x s8 dot of AVX512-VNNI with VL, or of AVX-VNNI), "AVX_VNNI" (that dot in AVX-VNNI's VEX
    form); () for the portable scalar build."""
    cdef int f = pi_simd_features()
    return tuple(n for b, n in ((1, "AVX2"), (2, "AVX512"), (4, "VNNI256"), (8, "AVX_VNNI"))
                 if f & b)


cdef inline int _bytes_per_row(int qtype, int cols) except -1:
    cdef int nbytes = pi_block_bytes(qtype), block = pi_block_elems(qtype)
    if nbytes == 0:
        raise ValueError(f"unsupported weight type {qtype}")
    if cols % block:
        raise ValueError(f"row length {cols} is not a multiple of {block} (type {qtype})")
    return (cols // block) * nbytes


cdef inline int _check_w(const uint8_t[:, ::1] w, int qtype, int cols) except -1:
    if pi_is_ib(qtype):  # input-block layout (ibsum.h): one row per 32 input channels, the
        # outputs' own or with 64 zero outputs appended (pi_ib_pad_outs; files before it: none)
        if cols % PI_IB_TILE or (w.shape[1] != <Py_ssize_t> pi_ib_block_bytes(qtype, cols) and
                                 w.shape[1] != <Py_ssize_t> pi_ib_block_bytes(qtype, cols + 64)):
            raise ValueError(f"input-block weight rows have {w.shape[1]} bytes for {cols} "
                             f"outputs (type {qtype}; outputs must be a multiple of {PI_IB_TILE})")
        return 0
    if w.shape[1] != _bytes_per_row(qtype, cols):
        raise ValueError(f"weight rows have {w.shape[1]} bytes, expected "
                         f"{_bytes_per_row(qtype, cols)} for type {qtype} and {cols} columns")
    return 0


cdef inline Py_ssize_t _in_rows(const uint8_t[:, ::1] w, int qtype) noexcept:
    """Input channels (rows of the transposed matrix) of w: 32 per row of an input-block tensor."""
    return w.shape[0] * 32 if pi_is_ib(qtype) else w.shape[0]


def ib_types():
    """(q8_0, q4_0, q4_1, q5_0, q5_1) type ids of the input-block layout (ibsum.h; pyinfer's own,
    not ggml's)."""
    return PI_Q8_0_IB_ID, PI_Q4_0_IB_ID, PI_Q4_1_IB_ID, PI_Q5_0_IB_ID, PI_Q5_1_IB_ID


cdef inline void _quantize_x(const float *x, int cols, float **xd, int8_t **xq) noexcept nogil:
    """x (cols,) -> malloc'd q8 blocks of 32 (scales/sums xd, codes xq) for pi_dot_row's int8
    dots on quantized rows; the caller frees both."""
    xd[0] = <float *> malloc((2 * (cols // 32) + 1) * sizeof(float))
    xq[0] = <int8_t *> malloc(cols + 32)
    pi_quantize_q8(x, cols, xd[0], xq[0])


cdef inline int _check_len(Py_ssize_t got, Py_ssize_t want, str what) except -1:
    if got != want:
        raise ValueError(f"{what}: got length {got}, expected {want}")
    return 0


cdef int _check_ascending(const int32_t[::1] idx, str what) except -1:
    """ValueError unless idx is strictly ascending (the input-block sums' order)."""
    cdef Py_ssize_t k
    for k in range(1, idx.shape[0]):
        if idx[k] <= idx[k - 1]:
            raise ValueError(f"{what} needs idx strictly ascending")
    return 0


cdef int _check_idx(const int32_t[::1] idx, Py_ssize_t rows) except -1:
    """IndexError unless every idx is in [0, rows). The scan is one OR over the whole list (a loop
    without an exit vectorizes; the hybrid engine checks n_ff / 2 ids per layer and token)."""
    cdef Py_ssize_t k, n = idx.shape[0]
    cdef uint32_t bad = 0
    cdef uint32_t lim = <uint32_t> min(rows, 0x7fffffff)
    cdef const int32_t *p = &idx[0] if n > 0 else NULL
    with nogil:
        for k in range(n):
            bad |= <uint32_t> ((<uint32_t> p[k]) >= lim)
    if bad:
        for k in range(n):
            if idx[k] < 0 or idx[k] >= rows:
                raise IndexError(f"row index {idx[k]} out of range for {rows} rows")
    return 0


# ---------------------------------------------------------------- dense and sparse GEMV

def matvec(const uint8_t[:, ::1] w, int qtype, int cols, const float[::1] x, float[::1] out,
           int n_threads):
    """out[r] = w[r] . x for every row r. x (cols,) f32, out (rows,) f32."""
    _check_w(w, qtype, cols)
    _check_len(x.shape[0], cols, "matvec x")
    _check_len(out.shape[0], w.shape[0], "matvec out")
    cdef Py_ssize_t rows = w.shape[0], r, stride = w.shape[1], g
    cdef int quant = pi_is_quant(qtype)
    cdef float *xd = NULL
    cdef int8_t *xq = NULL
    if rows == 0:
        return
    with nogil:
        if quant:
            _quantize_x(&x[0], cols, &xd, &xq)
        if pi_gemv8_supported(qtype):  # eight rows per pass (gemv.h), the same bits per row
            for g in prange((rows + 7) // 8, schedule='static', num_threads=n_threads):
                pi_gemv8(qtype, &w[0, 0], stride, NULL, g, rows, xd, xq, cols // 32, &out[0], 0)
        else:
            for r in prange(rows, schedule='static', num_threads=n_threads):
                out[r] = pi_dot_row(qtype, &w[0, 0] + r * stride, &x[0], xd, xq, cols)
        free(xd)
        free(xq)


def gather_matvec(const uint8_t[:, ::1] w, int qtype, int cols, const float[::1] x,
                  const int32_t[::1] idx, float[::1] out, int n_threads):
    """out[k] = w[idx[k]] . x (PowerInfer's sparse up/gate operator). idx int32 (n_active,)."""
    _check_w(w, qtype, cols)
    _check_len(x.shape[0], cols, "gather_matvec x")
    _check_len(out.shape[0], idx.shape[0], "gather_matvec out")
    _check_idx(idx, w.shape[0])
    cdef Py_ssize_t n = idx.shape[0], k, stride = w.shape[1], g
    cdef Py_ssize_t pd = pi_prefetch_dist(stride)
    cdef int near = stride <= PI_L1_PREFETCH_MAX_ROW
    cdef int quant = pi_is_quant(qtype)
    cdef float *xd = NULL
    cdef int8_t *xq = NULL
    if n == 0:
        return
    with nogil:
        if quant:
            _quantize_x(&x[0], cols, &xd, &xq)
        if pi_gemv8_supported(qtype) and pi_gather_pf_mode != 2:  # eight rows per pass
            for g in prange((n + 7) // 8, schedule='static', num_threads=n_threads):
                pi_gemv8(qtype, &w[0, 0], stride, &idx[0], g, n, xd, xq, cols // 32, &out[0], pd)
        else:
            for k in prange(n, schedule='static', num_threads=n_threads):
                if k + pd < n:
                    pi_prefetch_l2(&w[0, 0] + idx[k + pd] * stride, stride)
                if near and k + 2 < n:
                    pi_prefetch_l1(&w[0, 0] + idx[k + 2] * stride, stride)
                out[k] = pi_dot_row(qtype, &w[0, 0] + idx[k] * stride, &x[0], xd, xq, cols)
        free(xd)
        free(xq)


def matmul(const uint8_t[:, ::1] w, int qtype, int cols, const float[:, ::1] x,
           float[:, ::1] out, int n_threads):
    """out = x @ w.T (prefill). x (n_tok, cols) f32, out (n_tok, rows) f32.

    Parallel over tiles of weight rows; each tile is read from memory once and dotted with every
    token (tokens are quantized once for quantized weights)."""
    _check_w(w, qtype, cols)
    _check_len(x.shape[1], cols, "matmul x columns")
    _check_len(out.shape[0], x.shape[0], "matmul out rows")
    _check_len(out.shape[1], w.shape[0], "matmul out columns")
    cdef Py_ssize_t rows = w.shape[0], n_tok = x.shape[0], stride = w.shape[1]
    cdef Py_ssize_t n_tiles = (rows + ROW_TILE - 1) // ROW_TILE, tile, t, tq, r, r1
    cdef int quant = pi_is_quant(qtype)
    cdef int nb = cols // 32
    cdef float *xd = NULL
    cdef int8_t *xq = NULL
    if rows == 0 or n_tok == 0:
        return
    cdef int gemm = pi_gemm_supported(qtype) and not _old_prefill
    cdef const uint8_t *wp = &w[0, 0]
    cdef float *op = &out[0, 0]
    if gemm:  # 8 rows x 4 tokens per register tile over repacked rows (gemm.h)
        with nogil:
            _gemm_multi(1, &wp, &qtype, &stride, &rows, cols, &x[0, 0], n_tok, &op, n_threads)
        return
    with nogil:
        if quant:
            xd = <float *> malloc((2 * n_tok * nb + 1) * sizeof(float))
            xq = <int8_t *> malloc(n_tok * cols + 32)
            for tq in prange(n_tok, schedule='static', num_threads=n_threads):
                pi_quantize_q8(&x[tq, 0], cols, xd + 2 * tq * nb, xq + tq * cols)
        for tile in prange(n_tiles, schedule='static', num_threads=n_threads):
            r1 = min(rows, (tile + 1) * ROW_TILE)
            t = 0
            if qtype == PI_Q8_0_ID or qtype == PI_Q4_0_ID or pi_is_xquant(qtype):
                while t + 4 <= n_tok:  # four tokens per pass over a row
                    for r in range(tile * ROW_TILE, r1):
                        if pi_is_xquant(qtype):
                            pi_dot4_xrow(qtype, &w[0, 0] + r * stride, xd + 2 * t * nb, 2 * nb,
                                         xq + t * cols, cols, nb, &out[t, r], out.shape[1])
                        elif qtype == PI_Q8_0_ID:
                            pi_dot4_q8_0(&w[0, 0] + r * stride, xd + 2 * t * nb, 2 * nb,
                                         xq + t * cols, cols, nb, &out[t, r], out.shape[1])
                        else:
                            pi_dot4_q4_0(&w[0, 0] + r * stride, xd + 2 * t * nb, 2 * nb,
                                         xq + t * cols, cols, nb, &out[t, r], out.shape[1])
                    t = t + 4
            while t < n_tok:
                for r in range(tile * ROW_TILE, r1):
                    out[t, r] = pi_dot_row(qtype, &w[0, 0] + r * stride, &x[t, 0],
                                           xd + 2 * t * nb, xq + t * cols, cols)
                t = t + 1
        free(xd)
        free(xq)


cdef void _gemm_multi(int n_mat, const uint8_t **w, const int *qt, const Py_ssize_t *stride,
                      const Py_ssize_t *rows, int cols, const float *x, Py_ssize_t n_tok,
                      float **out, int n_threads) noexcept nogil:
    """out[m] (n_tok, rows[m]) = x (n_tok, cols) @ w[m].T for up to 3 quantized matrices sharing
    x (gemm.h pi_gemm_rows): x is quantized once for all of them, and the quantization and every
    matrix's row tiles run in one parallel region (one fork, two barriers)."""
    cdef int nb = cols // 32, m
    cdef Py_ssize_t off[4]
    cdef Py_ssize_t tq, tile, r0
    cdef float *xd = <float *> malloc((2 * n_tok * nb + 1) * sizeof(float))
    cdef int8_t *xq = <int8_t *> malloc(n_tok * cols + 32)
    cdef uint8_t *pack
    off[0] = 0
    for m in range(n_mat):
        off[m + 1] = off[m] + (rows[m] + ROW_TILE - 1) // ROW_TILE
    with parallel(num_threads=n_threads):
        pack = <uint8_t *> malloc(nb * PI_GEMM_BUF_PER_BLOCK + 64)
        for tq in prange(n_tok, schedule='static'):
            pi_quantize_q8(x + tq * cols, cols, xd + 2 * tq * nb, xq + tq * cols)
        pi_team_barrier()  # every token quantized before any tile reads it
        for tile in prange(off[n_mat], schedule='static'):
            m = 0 if tile < off[1] else (1 if tile < off[2] else 2)
            r0 = (tile - off[m]) * ROW_TILE
            pi_gemm_rows(qt[m], w[m], stride[m], r0, min(rows[m], r0 + ROW_TILE), xd, xq, cols,
                         nb, n_tok, out[m], rows[m], pack)
        free(pack)
    free(xd)
    free(xq)


def matmul_multi(tuple ws, tuple qtypes, int cols, const float[:, ::1] x, tuple outs,
                 int n_threads):
    """outs[m] = x @ ws[m].T for 1 to 3 quantized matrices that read the same x (prefill of q, k
    and v): ws[m] uint8 (rows_m, bytes_per_row), outs[m] f32 (n_tok, rows_m), x f32 (n_tok, cols).
    The same numbers as ``matmul`` on each matrix, with x quantized once and one parallel region.
    ValueError for another type (``prefill_gemm_supported``) or shapes that do not fit."""
    cdef int n_mat = len(ws), m
    if n_mat < 1 or n_mat > 3 or len(qtypes) != n_mat or len(outs) != n_mat:
        raise ValueError("matmul_multi takes 1 to 3 matrices, one type and one output each")
    cdef const uint8_t *wp[3]
    cdef int qt[3]
    cdef Py_ssize_t strides[3]
    cdef Py_ssize_t rows[3]
    cdef float *op[3]
    cdef const uint8_t[:, ::1] wv
    cdef float[:, ::1] ov
    cdef Py_ssize_t n_tok = x.shape[0]
    _check_len(x.shape[1], cols, "matmul_multi x columns")
    for m in range(n_mat):
        wv = ws[m]
        ov = outs[m]
        qt[m] = qtypes[m]
        if not pi_gemm_supported(qt[m]):
            raise ValueError(f"matmul_multi: weight type {qt[m]} has no prefill GEMM")
        _check_w(wv, qt[m], cols)
        _check_len(ov.shape[0], n_tok, "matmul_multi out rows")
        _check_len(ov.shape[1], wv.shape[0], "matmul_multi out columns")
        if wv.shape[0] == 0 or n_tok == 0:
            raise ValueError("matmul_multi: empty weight or input")
        wp[m] = &wv[0, 0]
        strides[m] = wv.shape[1]
        rows[m] = wv.shape[0]
        op[m] = &ov[0, 0]
    with nogil:
        _gemm_multi(n_mat, wp, qt, strides, rows, cols, &x[0, 0], n_tok, op, n_threads)


def matmul_glu(const uint8_t[:, ::1] gate, int qtype_g, const uint8_t[:, ::1] up, int qtype_u,
               int cols, const float[:, ::1] x, float[:, ::1] out, int silu, int n_threads):
    """out = act(x @ gate.T) * (x @ up.T) (the gated FFN's prefill up to the down projection):
    gate, up quantized uint8 (n_ff, bytes_per_row); x f32 (n_tok, cols); out f32 (n_tok, n_ff);
    act SiLU (silu=1) or ReLU. x is quantized once; tiles of PI_GLU_RM rows of both matrices
    run in one parallel region and the activation is applied on the way out (gemm.h
    pi_glu_rows). ValueError for another type or shapes that do not fit."""
    if not pi_gemm_supported(qtype_g) or not pi_gemm_supported(qtype_u):
        raise ValueError(f"matmul_glu: weight types {qtype_g}/{qtype_u} have no prefill GEMM")
    _check_w(gate, qtype_g, cols)
    _check_w(up, qtype_u, cols)
    _check_len(up.shape[0], gate.shape[0], "matmul_glu up rows")
    _check_len(x.shape[1], cols, "matmul_glu x columns")
    _check_len(out.shape[0], x.shape[0], "matmul_glu out rows")
    _check_len(out.shape[1], gate.shape[0], "matmul_glu out columns")
    cdef Py_ssize_t rows = gate.shape[0], n_tok = x.shape[0], tq, tile
    cdef Py_ssize_t n_tiles = (rows + PI_GLU_RM - 1) // PI_GLU_RM
    cdef int nb = cols // 32
    cdef float *xd
    cdef int8_t *xq
    cdef uint8_t *pack
    cdef float *scratch
    if rows == 0 or n_tok == 0:
        return
    with nogil:
        xd = <float *> malloc((2 * n_tok * nb + 1) * sizeof(float))
        xq = <int8_t *> malloc(n_tok * cols + 32)
        with parallel(num_threads=n_threads):
            pack = <uint8_t *> malloc(nb * PI_GEMM_BUF_PER_BLOCK + 64)
            scratch = <float *> malloc((2 * n_tok * PI_GLU_RM + 8) * sizeof(float))
            for tq in prange(n_tok, schedule='static'):
                pi_quantize_q8(&x[tq, 0], cols, xd + 2 * tq * nb, xq + tq * cols)
            pi_team_barrier()  # every token quantized before any tile reads it
            for tile in prange(n_tiles, schedule='static'):
                pi_glu_rows(qtype_g, &gate[0, 0], gate.shape[1], qtype_u, &up[0, 0], up.shape[1],
                            tile * PI_GLU_RM, min(rows, (tile + 1) * PI_GLU_RM), xd, xq, cols, nb,
                            n_tok, &out[0, 0], rows, silu, pack, scratch)
            free(pack)
            free(scratch)
        free(xd)
        free(xq)


# ---------------------------------------------------------------- transposed (down) products

cdef void _axpy_rows(const uint8_t *w, Py_ssize_t stride, int qtype, int cols, const float *coef,
                     const int32_t *idx, Py_ssize_t n, float *out, int n_threads) noexcept nogil:
    """out = sum_k coef[k] * w[idx[k] or k] (rowsum_team.h: the integer sums of long rows split by
    columns; otherwise chunks cut by n alone, each summed in row order, and their partial sums
    added in chunk order, all in one parallel region). The result has the same bits at any
    n_threads (issue 9: a thread-count split once changed greedy tokens on the sparse path)."""
    cdef float *tmp = NULL
    cdef size_t nt = pi_axpy_tmp_floats(n, cols, stride)
    if nt:
        tmp = <float *> malloc(nt * sizeof(float))
    pi_axpy_rows_par(qtype, w, stride, coef, idx, n, out, cols, tmp, n_threads)
    free(tmp)


def axpy_rows(const uint8_t[:, ::1] w, int qtype, int cols, const float[::1] coef,
              const int32_t[::1] idx, float[::1] out, int n_threads):
    """out = sum_k coef[k] * w[idx[k]] (sparse down projection over ffn_down_t); overwrites out."""
    _check_w(w, qtype, cols)
    _check_len(coef.shape[0], idx.shape[0], "axpy_rows coef")
    _check_len(out.shape[0], cols, "axpy_rows out")
    _check_idx(idx, _in_rows(w, qtype))
    if pi_is_ib(qtype):
        _check_ascending(idx, "axpy_rows: an input-block weight")
    cdef Py_ssize_t n = idx.shape[0]
    cdef const float *cp = &coef[0] if n > 0 else NULL
    cdef const int32_t *ip = &idx[0] if n > 0 else NULL
    if cols == 0:
        return
    with nogil:
        _axpy_rows(&w[0, 0] if w.shape[0] > 0 else NULL, w.shape[1], qtype, cols, cp, ip, n,
                   &out[0], n_threads)


def matvec_t(const uint8_t[:, ::1] w, int qtype, int cols, const float[::1] a, float[::1] out,
             int n_threads):
    """out = a @ w = sum_r a[r] * w[r]. a (rows,) f32, out (cols,) f32."""
    _check_w(w, qtype, cols)
    if pi_is_ib(qtype):
        raise ValueError("matvec_t: input-block weights take axpy_rows or matmul_t")
    _check_len(a.shape[0], w.shape[0], "matvec_t a")
    _check_len(out.shape[0], cols, "matvec_t out")
    cdef Py_ssize_t n = w.shape[0]
    if cols == 0:
        return
    with nogil:
        _axpy_rows(&w[0, 0] if n > 0 else NULL, w.shape[1], qtype, cols,
                   &a[0] if n > 0 else NULL, NULL, n, &out[0], n_threads)


def matmul_t(const uint8_t[:, ::1] w, int qtype, int cols, const float[:, ::1] a,
             float[:, ::1] out, int n_threads):
    """out = a @ w. a (n_tok, rows) f32, out (n_tok, cols) f32.

    Parallel over 32-column strips, so no reduction between threads. q8_0 and q4_0 run gemmt.h's
    integer sums (each row's block scale folded into the activation, quantized to int8 per
    32 rows: within 2^-8 of the largest term per tile, see gemmt.h); the other types dequantize
    each strip to f32 and run gemm.h's f32 tiles. set_old_prefill(1): the pre-GEMM f32 loop."""
    _check_w(w, qtype, cols)
    _check_len(a.shape[1], _in_rows(w, qtype), "matmul_t a columns")
    _check_len(out.shape[0], a.shape[0], "matmul_t out rows")
    _check_len(out.shape[1], cols, "matmul_t out columns")
    if pi_is_ib(qtype):  # a GEMM with each token's decode bits (ibsum.h pi_ib_matmul)
        if a.shape[0] > 0:
            with nogil:
                pi_ib_matmul(qtype, &w[0, 0], w.shape[1], a.shape[1], &a[0, 0], a.shape[1],
                             a.shape[0], &out[0, 0], out.shape[1], cols, n_threads)
        return
    cdef Py_ssize_t rows = w.shape[0], n_tok = a.shape[0], stride = w.shape[1]
    cdef Py_ssize_t n_strips = (cols + COL_TILE - 1) // COL_TILE, s, t, r, j, r4 = rows - rows % 4
    cdef int c0, cn
    cdef float *buf
    cdef float *av
    if n_tok == 0 or cols == 0:
        return
    cdef float *panel
    cdef Py_ssize_t t0, tn
    if not _old_prefill and _int8_matmul_t and rows > 0 and pi_gemmt_supported(qtype):
        # int8 sums over 32-column strips, GEMMT_TOKENS tokens at a time (see GEMMT_TOKENS)
        with nogil:
            for t0 in range(0, n_tok, GEMMT_TOKENS):
                tn = min(GEMMT_TOKENS, n_tok - t0)
                for s in prange(cols // 32, schedule='static', num_threads=n_threads):
                    pi_gemmt_strip(qtype, &w[0, 0], stride, rows, s * 32, &a[t0, 0], a.shape[1],
                                   tn, &out[t0, 0], out.shape[1])
        return
    if not _old_prefill and rows > 0:  # 32-column strips, 6 tokens x 16 columns per tile (gemm.h)
        with nogil, parallel(num_threads=n_threads):
            panel = <float *> malloc((32 * rows + 8) * sizeof(float))
            for s in prange((cols + 31) // 32, schedule='static'):
                pi_gemm_t_strip(qtype, &w[0, 0], stride, rows, s * 32, min(32, cols - s * 32),
                                &a[0, 0], a.shape[1], n_tok, &out[0, 0], out.shape[1], panel)
            free(panel)
        return
    with nogil, parallel(num_threads=n_threads):
        # 4 dequantized row strips, then 4 coefficients per token: out loaded/stored once per 4 rows
        buf = <float *> malloc((4 * COL_TILE + 4 * n_tok) * sizeof(float))
        av = buf + 4 * COL_TILE
        for s in prange(n_strips, schedule='static'):
            c0 = s * COL_TILE
            cn = min(cols - c0, COL_TILE)
            for t in range(n_tok):
                memset(&out[t, c0], 0, cn * sizeof(float))
            for r in range(0, r4, 4):
                for j in range(4):
                    pi_dequant_cols(qtype, &w[0, 0] + (r + j) * stride, c0, buf + j * COL_TILE, cn)
                for t in range(n_tok):
                    for j in range(4):
                        av[4 * t + j] = a[t, r + j]
                if cn == COL_TILE:  # full strip: two tokens per pass, outputs in registers
                    pi_axpy4_strip64(av, 4, buf, &out[0, c0], out.shape[1], n_tok)
                else:
                    for t in range(n_tok):
                        pi_axpy4_row(0, av + 4 * t, <uint8_t *> buf, <uint8_t *> (buf + COL_TILE),
                                     <uint8_t *> (buf + 2 * COL_TILE),
                                     <uint8_t *> (buf + 3 * COL_TILE), &out[t, c0], cn)
            for r in range(r4, rows):
                pi_dequant_cols(qtype, &w[0, 0] + r * stride, c0, buf, cn)
                for t in range(n_tok):
                    pi_axpy_f32(a[t, r], buf, &out[t, c0], cn)
        free(buf)


def get_rows(const uint8_t[:, ::1] w, int qtype, int cols, const int32_t[::1] ids,
             float[:, ::1] out):
    """out[i] = w[ids[i]] dequantized to f32 (embedding lookup). out (n_ids, cols)."""
    _check_w(w, qtype, cols)
    _check_len(out.shape[0], ids.shape[0], "get_rows out rows")
    _check_len(out.shape[1], cols, "get_rows out columns")
    _check_idx(ids, w.shape[0])
    cdef Py_ssize_t i, stride = w.shape[1]
    if cols == 0:
        return
    with nogil:
        for i in range(ids.shape[0]):
            pi_dequant_row(qtype, &w[0, 0] + ids[i] * stride, &out[i, 0], cols)


# ---------------------------------------------------------------- norms, rope, attention, act

cdef void _rmsnorm1(const float *x, const float *weight, float eps, float *out, int n) noexcept nogil:
    cdef float scale = 1.0 / sqrtf(pi_dot_f32(x, x, n) / n + eps)
    cdef int i
    for i in range(n):
        out[i] = x[i] * scale * weight[i]


cdef inline void _add_bias(float *y, const float *b, Py_ssize_t n) noexcept nogil:
    """y += b over n values (b NULL: nothing), f32 as NumPy's out += b."""
    cdef Py_ssize_t i
    if b != NULL:
        for i in range(n):
            y[i] += b[i]


cdef void _rope_rotate(float *x, int n_heads, int head_dim, int half, const float *cs,
                       const float *sn) noexcept nogil:
    """Rotate dims (i, i + half) of every head by the angle whose cos/sin are cs[i], sn[i]."""
    cdef int h, i
    cdef float x0, x1
    for h in range(n_heads):
        for i in range(half):
            x0 = x[h * head_dim + i]
            x1 = x[h * head_dim + i + half]
            x[h * head_dim + i] = x0 * cs[i] - x1 * sn[i]
            x[h * head_dim + i + half] = x1 * cs[i] + x0 * sn[i]


cdef void _rope1(float *x, int n_heads, int head_dim, int pos, double freq_base, int n_rot,
                 float *cs, float *sn) noexcept nogil:
    cdef int i, half = n_rot // 2
    cdef double theta
    for i in range(half):
        theta = pos * pow(freq_base, -2.0 * i / n_rot)
        cs[i] = <float> cos(theta)
        sn[i] = <float> sin(theta)
    _rope_rotate(x, n_heads, head_dim, half, cs, sn)


cdef inline void _rope_angles(int pos, const double *inv_freq, int half, float *cs,
                              float *sn) noexcept nogil:
    """cs[i], sn[i] = cos, sin of theta = pos * inv_freq[i] in double, rounded to f32, i < half."""
    cdef int i
    cdef double theta
    for i in range(half):
        theta = pos * inv_freq[i]
        cs[i] = <float> cos(theta)
        sn[i] = <float> sin(theta)


cdef void _rope1_tab(float *x, int n_heads, int head_dim, int pos, const double *inv_freq,
                     int n_rot, float *cs, float *sn) noexcept nogil:
    """_rope1 with the frequencies freq_base^(-2i/n_rot) computed once per call (inv_freq,
    n_rot/2 doubles): the same theta = pos * inv_freq[i] in double, so the same bits."""
    _rope_angles(pos, inv_freq, n_rot // 2, cs, sn)
    _rope_rotate(x, n_heads, head_dim, n_rot // 2, cs, sn)


cdef void _attend_head(const float *q, const float *k, const float *v, Py_ssize_t row_stride,
                       Py_ssize_t n_att, Py_ssize_t hd, float scale, float *sc,
                       float *out) noexcept nogil:
    """One head, one query: out (hd,) = softmax(q . k_j * scale) @ v_j over the n_att cache rows
    k_j = k + j * row_stride (likewise v); f32 softmax with max subtraction; sc (n_att,) scratch."""
    cdef Py_ssize_t j
    cdef float mx = -3.4e38, ssum = 0.0, inv
    for j in range(n_att):
        sc[j] = pi_dot_f32(q, k + j * row_stride, hd) * scale
        if sc[j] > mx:
            mx = sc[j]
    for j in range(n_att):
        sc[j] = expf(sc[j] - mx)
        ssum = ssum + sc[j]
    inv = 1.0 / ssum
    memset(out, 0, hd * sizeof(float))
    for j in range(n_att):
        pi_axpy_f32(sc[j] * inv, v + j * row_stride, out, hd)


def rmsnorm(const float[:, ::1] x, const float[::1] weight, float eps, float[:, ::1] out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight. x, out (n_tok, n); weight (n,)."""
    cdef Py_ssize_t n_tok = x.shape[0], n = x.shape[1], t, i
    _check_len(weight.shape[0], n, "rmsnorm weight")
    _check_len(out.shape[0], n_tok, "rmsnorm out rows")
    _check_len(out.shape[1], n, "rmsnorm out columns")
    if n == 0:
        return
    with nogil:
        for t in range(n_tok):
            _rmsnorm1(&x[t, 0], &weight[0], eps, &out[t, 0], n)


def rope_table(const int32_t[::1] positions, double freq_base, int n_rot, float[:, ::1] out):
    """RoPE's angles once for every layer of a forward: out (n_tok, n_rot) f32 = per token
    [cos theta_i | sin theta_i], i < n_rot/2, theta_i = pos * freq_base^(-2i/n_rot) in double,
    each rounded to f32 (the values ``_rope1`` computes per call, the same bits)."""
    cdef Py_ssize_t n_tok = positions.shape[0], t, i, half = n_rot // 2
    if n_rot % 2 or n_rot < 0:
        raise ValueError(f"rope_table: n_rot {n_rot} must be even and >= 0")
    _check_len(out.shape[0], n_tok, "rope_table out rows")
    _check_len(out.shape[1], n_rot, "rope_table out columns")
    if half == 0 or n_tok == 0:
        return
    cdef double *inv_freq
    with nogil:
        inv_freq = <double *> malloc(half * sizeof(double))
        for i in range(half):
            inv_freq[i] = pow(freq_base, -2.0 * i / n_rot)  # as _rope1 computes it
        for t in range(n_tok):
            _rope_angles(positions[t], inv_freq, <int> half, &out[t, 0], &out[t, half])
        free(inv_freq)


def rope_apply(float[:, :, ::1] x, const float[:, ::1] table, int n_threads=1):
    """Rotate the first n_rot dims of each head in place, Hugging Face rotate_half (NeoX) style,
    by the angles of ``rope_table`` (n_tok, n_rot): (x[i], x[i+n_rot/2]) -> (x[i]cos -
    x[i+h]sin, x[i+h]cos + x[i]sin). x (n_tok, n_heads, head_dim) f32; tokens split over
    n_threads (the same bits at any count)."""
    cdef Py_ssize_t n_tok = x.shape[0], n_heads = x.shape[1], head_dim = x.shape[2]
    cdef Py_ssize_t t, n_rot = table.shape[1], half = table.shape[1] // 2
    _check_len(table.shape[0], n_tok, "rope_apply table rows")
    if n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"rope_apply: n_rot {n_rot} must be even and <= head_dim {head_dim}")
    if half == 0 or n_tok == 0:
        return
    with nogil:
        for t in prange(n_tok, schedule='static', num_threads=n_threads if n_tok >= 8 else 1):
            _rope_rotate(&x[t, 0, 0], <int> n_heads, <int> head_dim, <int> half, &table[t, 0],
                         &table[t, half])


cdef inline Py_ssize_t _kv_width(int kv_f16) noexcept nogil:
    """uint16 per cached value: 1 for an f16 cache, 2 for an f32 one (``cpu.kv_pair``)."""
    return 1 if kv_f16 else 2


cdef inline void _kv_store(const float *src, void *cache, Py_ssize_t off, int f16,
                           Py_ssize_t n) noexcept nogil:
    """cache values off .. off + n - 1 = src[0:n]: rounded to nearest even into an f16 cache
    (pi_f32_to_f16_row, numpy's astype bits), copied into an f32 one."""
    if f16:
        pi_f32_to_f16_row(src, <uint16_t *> cache + off, n)
    else:
        memcpy(<float *> cache + off, src, n * sizeof(float))


def attention(const float[:, :, ::1] q, const uint16_t[:, :, ::1] k_cache,
              const uint16_t[:, :, ::1] v_cache, int kv_f16, int n_past, float[:, :, ::1] out,
              int n_threads):
    """Causal grouped-query attention for n_tok new tokens at positions n_past .. n_past+n_tok-1.

    q, out (n_tok, n_head, head_dim) f32; k_cache, v_cache (n_ctx, n_head_kv, head_dim) already
    holding the new tokens' K/V, as uint16 (``cpu.kv_pair``): kv_f16 1, f16 values (their rows
    read are copied to f32 once per call, exactly); kv_f16 0, f32 values (the last axis 2
    head_dim uint16). Head h reads kv head h // (n_head // n_head_kv); token t attends to cache
    rows 0 .. n_past+t; scale 1/sqrt(head_dim); softmax in f32 with max subtraction. One token
    (n_tok 1, the model families' decode) goes through attend.h as the fused decode half-layers
    and ``attend_one`` do, reading an f16 cache as it is (the copy to f32 of every row read, per
    layer and token, made a Gemma-3 token at 480 cached tokens 1.5x slower than at 8;
    docs/benchmarks.md, session 21); set_old_prefill(1) keeps the one-head loop for it."""
    cdef Py_ssize_t n_tok = q.shape[0], n_head = q.shape[1], hd = q.shape[2]
    cdef Py_ssize_t n_kv = k_cache.shape[1], n_ctx = k_cache.shape[0], w = _kv_width(kv_f16)
    if (k_cache.shape[2] != hd * w or v_cache.shape[0] != n_ctx or v_cache.shape[1] != n_kv
            or v_cache.shape[2] != hd * w):
        raise ValueError("attention: k_cache/v_cache shapes do not match q")
    if n_kv == 0 or n_head % n_kv:
        raise ValueError(f"attention: n_head {n_head} is not a multiple of n_head_kv {n_kv}")
    if out.shape[0] != n_tok or out.shape[1] != n_head or out.shape[2] != hd:
        raise ValueError("attention: out shape differs from q")
    if n_past < 0 or n_past + n_tok > n_ctx:
        raise ValueError(f"attention: positions {n_past}..{n_past + n_tok} exceed n_ctx {n_ctx}")
    if n_tok == 0 or hd == 0:
        return
    if n_tok == 1 and not _old_prefill:  # one query: attend.h over the cache as it is stored
        with nogil:
            _attend_decode(&q[0, 0, 0], &k_cache[0, 0, 0], &v_cache[0, 0, 0], kv_f16, n_past + 1,
                           <int> hd, <int> n_head, <int> n_kv, 1.0 / sqrtf(<float> hd),
                           &out[0, 0, 0], n_threads)
        return
    cdef Py_ssize_t n_keys = n_past + n_tok
    cdef float[:, :, ::1] kf
    cdef float[:, :, ::1] vf
    if not kv_f16:
        kf = <float[:n_keys, :n_kv, :hd]> <float *> &k_cache[0, 0, 0]
        vf = <float[:n_keys, :n_kv, :hd]> <float *> &v_cache[0, 0, 0]
    else:
        kf = view.array((n_keys, n_kv, hd), sizeof(float), "f")
        vf = view.array((n_keys, n_kv, hd), sizeof(float), "f")
        with nogil:
            pi_f16_to_f32_row(&k_cache[0, 0, 0], &kf[0, 0, 0], n_keys * n_kv * hd)
            pi_f16_to_f32_row(&v_cache[0, 0, 0], &vf[0, 0, 0], n_keys * n_kv * hd)
    _attention_f32(q, kf, vf, n_past, out, n_threads)


cdef _attention_f32(const float[:, :, ::1] q, const float[:, :, ::1] k_cache,
                    const float[:, :, ::1] v_cache, int n_past, float[:, :, ::1] out,
                    int n_threads):
    """``attention`` over f32 copies of the cache rows 0 .. n_past + n_tok - 1 (checked there)."""
    cdef Py_ssize_t n_tok = q.shape[0], n_head = q.shape[1], hd = q.shape[2]
    cdef Py_ssize_t n_kv = k_cache.shape[1]
    cdef Py_ssize_t group = n_head // n_kv, item, t, h, kvh
    cdef float scale = 1.0 / sqrtf(<float> hd)
    cdef float *sc
    if n_tok == 0 or hd == 0:
        return
    if not _old_prefill:
        _attention_blocks(q, k_cache, v_cache, n_past, out, scale, n_threads)
        return
    with nogil, parallel(num_threads=n_threads):
        sc = <float *> malloc((n_past + n_tok) * sizeof(float))
        for item in prange(n_tok * n_head, schedule='static'):
            t = item // n_head
            h = item % n_head
            kvh = h // group
            _attend_head(&q[t, h, 0], &k_cache[0, kvh, 0], &v_cache[0, kvh, 0], n_kv * hd,
                         n_past + t + 1, hd, scale, sc, &out[t, h, 0])
        free(sc)


def attend_one(const float[:, ::1] q, const uint16_t[:, :, ::1] k_cache,
               const uint16_t[:, :, ::1] v_cache, int kv_f16, int n_past, float[:, ::1] out,
               int n_threads):
    """One query's attention as the fused decode half-layers compute it (attend.h
    pi_attend_team: the bits of the one-head loop _attend_head, ``attention`` under
    set_old_prefill(1), at any n_threads). q, out (n_head, head_dim) f32; k_cache, v_cache
    (n_ctx, n_head_kv, head_dim) as ``attention`` takes them (uint16; f16 values with kv_f16, else
    f32) holding the query's own row n_past; rows 0 .. n_past read.
    ValueError on shapes that do not fit."""
    cdef Py_ssize_t n_head = q.shape[0], hd = q.shape[1], n_kv = k_cache.shape[1]
    cdef Py_ssize_t w = _kv_width(kv_f16)
    if (k_cache.shape[2] != hd * w or v_cache.shape[0] != k_cache.shape[0]
            or v_cache.shape[1] != n_kv or v_cache.shape[2] != hd * w or out.shape[0] != n_head
            or out.shape[1] != hd):
        raise ValueError("attend_one: shapes of q, the caches and out do not match")
    if n_kv == 0 or n_head % n_kv or hd == 0:
        raise ValueError(f"attend_one: n_head {n_head} is not a multiple of n_head_kv {n_kv}")
    if n_past < 0 or n_past >= k_cache.shape[0]:
        raise ValueError(f"attend_one: position {n_past} outside the cache ({k_cache.shape[0]})")
    with nogil:
        _attend_decode(&q[0, 0], &k_cache[0, 0, 0], &v_cache[0, 0, 0], kv_f16, n_past + 1, <int> hd,
                       <int> n_head, <int> n_kv, 1.0 / sqrtf(<float> hd), &out[0, 0], n_threads)


cdef void _attend_decode(const float *q, const void *k, const void *v, int f16, Py_ssize_t n_att, int hd,
                         int n_head, int n_kv, float scale, float *out,
                         int n_threads) noexcept nogil:
    """One query over cache rows 0 .. n_att - 1 (k, v: row 0 of (n_ctx, n_kv, hd) caches, f16 values
    or f32 as f16 says), every
    head into out (n_head, hd): attend.h pi_attend_team on up to n_threads threads, its scores in
    a scratch of n_head n_att floats."""
    cdef float *sc = <float *> malloc(n_head * n_att * sizeof(float))
    if n_threads <= 1:
        pi_attend_team(0, 1, q, k, v, f16, n_kv * hd, n_att, hd, n_head, n_kv, scale, sc, out)
    else:
        with parallel(num_threads=n_threads):
            pi_attend_team(pi_team_thread(), pi_team_size(), q, k, v, f16, n_kv * hd, n_att, hd,
                           n_head, n_kv, scale, sc, out)
    free(sc)


cdef void _attention_blocks(const float[:, :, ::1] q, const float[:, :, ::1] k_cache,
                            const float[:, :, ::1] v_cache, int n_past, float[:, :, ::1] out,
                            float scale, int n_threads) noexcept nogil:
    """``attention`` over work items of (KV head, ATT_TOKENS consecutive tokens): the group's
    query heads of those tokens share every K/V row read (gemm.h pi_attend_block: on the SIMD
    build its scores and softmax are summed in another f32 order than decode's, within 1e-5 of
    it, tests/test_prefill_gemm.py). Items are dealt round-robin (chunksize 1) since later tokens
    attend to more keys."""
    cdef Py_ssize_t n_tok = q.shape[0], n_head = q.shape[1], hd = q.shape[2]
    cdef Py_ssize_t n_kv = k_cache.shape[1], group = n_head // n_kv
    cdef Py_ssize_t n_blk = (n_tok + ATT_TOKENS - 1) // ATT_TOKENS, item, blk, kvh, t, t1, g
    cdef Py_ssize_t nq_max = group * ATT_TOKENS, sc_stride = n_past + n_tok
    cdef int nq
    cdef float *sc
    cdef const float **qp
    cdef float **op
    cdef long *n_att
    # every KV head's keys transposed 8 at a time once per call, shared by all blocks of queries
    # (as many floats as the keys read: n_kv * n_keys * hd)
    cdef Py_ssize_t n_keys = n_past + n_tok, nkb = (n_keys + 7) // 8, jb
    cdef int simd = pi_simd_enabled() and hd % 8 == 0 and hd <= PI_ATT_MAX_HD
    cdef float *kt = <float *> malloc((n_kv * nkb * 8 * hd + 1) * sizeof(float)) if simd else NULL
    cdef float *ktp
    with parallel(num_threads=n_threads):
        sc = <float *> malloc((nq_max * sc_stride + 1) * sizeof(float))
        if simd:
            for item in prange(n_kv * nkb, schedule='static'):
                kvh = item // nkb
                jb = item % nkb
                pi_transpose_keys(&k_cache[jb * 8, kvh, 0], n_kv * hd, <int> hd,
                                  min(8, n_keys - jb * 8), kt + (kvh * nkb + jb) * 8 * hd)
        qp = <const float **> malloc(nq_max * sizeof(float *))
        op = <float **> malloc(nq_max * sizeof(float *))
        n_att = <long *> malloc(nq_max * sizeof(long))
        pi_team_barrier()  # every key block transposed before any query block reads kt
        for item in prange(n_kv * n_blk, schedule='static', chunksize=1):
            kvh = item % n_kv
            blk = item // n_kv
            t1 = min(n_tok, (blk + 1) * ATT_TOKENS)
            nq = 0
            for t in range(blk * ATT_TOKENS, t1):
                for g in range(group):
                    qp[nq] = &q[t, kvh * group + g, 0]
                    op[nq] = &out[t, kvh * group + g, 0]
                    n_att[nq] = n_past + t + 1
                    nq = nq + 1
            ktp = kt + kvh * nkb * 8 * hd if simd else NULL
            pi_attend_block(qp, nq, n_att, &k_cache[0, kvh, 0], ktp, &v_cache[0, kvh, 0],
                            n_kv * hd, <int> hd, scale, sc, sc_stride, op)
        free(sc)
        free(qp)
        free(op)
        free(n_att)
    free(kt)


def gelu_tanh(const float[::1] g, float[::1] out, int n_threads=1):
    """out = GELU-tanh(g) elementwise (flat f32 arrays; out may be g): 0.5 g (1 + tanh(sqrt(2/pi)
    (g + 0.044715 g^3))), torch's gelu(approximate="tanh"), as g * sigmoid(2t) in f32
    (rowsum_team.h pi_gelu_tanh), in 4096-value pieces over n_threads. A value's bits depend on
    the value alone (position, length, threads, SIMD width, build)."""
    cdef Py_ssize_t n = g.shape[0], c, n_ch = (n + 4095) // 4096
    _check_len(out.shape[0], n, "gelu_tanh out")
    if n == 0:
        return
    with nogil:
        if n_threads <= 1 or n_ch < 2:
            pi_gelu_tanh(&g[0], &out[0], n)
        else:
            for c in prange(n_ch, num_threads=n_threads, schedule='static'):
                pi_gelu_tanh(&g[c * 4096], &out[c * 4096], min(4096, n - c * 4096))


def silu_mul(const float[::1] gate, const float[::1] up, float[::1] out):
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise (flat f32 arrays)."""
    cdef Py_ssize_t n = gate.shape[0], i
    _check_len(up.shape[0], n, "silu_mul up")
    _check_len(out.shape[0], n, "silu_mul out")
    cdef float g
    with nogil:
        for i in range(n):
            g = gate[i]
            out[i] = g / (1.0 + expf(-g)) * up[i]


def relu_mul(const float[::1] gate, const float[::1] up, float[::1] out):
    """out = max(gate, 0) * up, elementwise (flat f32 arrays)."""
    cdef Py_ssize_t n = gate.shape[0], i
    _check_len(up.shape[0], n, "relu_mul up")
    _check_len(out.shape[0], n, "relu_mul out")
    cdef float g
    with nogil:
        for i in range(n):
            g = gate[i]
            out[i] = (g if g > 0.0 else 0.0) * up[i]


def f32_to_f16(const float[::1] x, uint16_t[::1] out):
    """out = the f16 bits of x (n,) f32 as the decode kernels write KV cache rows (simd.h
    pi_f32_to_f16_row: round to nearest even, overflow to inf; numpy's astype(float16) bits for
    every non-NaN value). out (n,) uint16."""
    cdef Py_ssize_t n = x.shape[0]
    _check_len(out.shape[0], n, "f32_to_f16 out")
    if n == 0:
        return
    with nogil:
        pi_f32_to_f16_row(&x[0], &out[0], n)


def act_mul(const float[::1] gu, int silu, float[::1] out):
    """out = act(g) * u for gu = [g | u] (2 n,) f32, out (n,) f32, as decode_ffn_in computes its
    activations (rowsum_team.h pi_act_values: silu's exp through pi_expf_safe, the bits of
    select_active's act(g) * u under glibc; relu: max(g, 0) * u)."""
    cdef Py_ssize_t n = out.shape[0]
    _check_len(gu.shape[0], 2 * n, "act_mul gu")
    if n == 0:
        return
    with nogil:
        pi_act_values(&gu[0], n, 0, n, silu, &out[0])


def select_active(const float[::1] g, const float[::1] u, const int32_t[::1] ids, int silu,
                  float thr, float[::1] coef, int32_t[::1] idx):
    """The sparse FFN's neuron selection, one pass: a = act(g[j]) (* u[j] when u is given),
    kept where |a| > thr or a is NaN. Writes the kept a into coef[:n] and their neuron ids (ids[j], or j when
    ids is None) into idx[:n]; returns n (entries from n on are scratch). g, u (n_cand,) f32;
    coef, idx (n_cand,) f32 / int32;
    act = silu (g / (1 + exp(-g))) if silu else relu."""
    cdef Py_ssize_t n = g.shape[0], j, k = 0
    cdef int has_u = u is not None, has_ids = ids is not None
    if has_u:
        _check_len(u.shape[0], n, "select_active u")
    if has_ids:
        _check_len(ids.shape[0], n, "select_active ids")
    _check_len(coef.shape[0], n, "select_active coef")
    _check_len(idx.shape[0], n, "select_active idx")
    cdef float a
    with nogil:
        for j in range(n):
            a = pi_act1(g[j], silu)
            if has_u:
                a = a * u[j]
            coef[k] = a  # branch-free compaction (see decode_ffn)
            idx[k] = ids[j] if has_ids else <int32_t> j
            k += <int> (not (fabsf(a) <= thr))
    return k


# ---------------------------------------------------------------- fused single-token decode
# One call per half-layer instead of about eight kernel calls and as many NumPy temporaries: at
# SmolLM2's size each call's Python and thread wake-up overhead (about 4 us) is a sixth of decode.
# The loops are the same as the separate kernels' (same activation quantization, same row order,
# same reductions), so results equal the unfused path's.

cdef void _multi_matvec(int n_mat, const uint8_t **w, const int *qt, const Py_ssize_t *stride,
                        const Py_ssize_t *rows, int cols, const float *x, float **out,
                        int n_threads) noexcept nogil:
    """out[m][r] = w[m][r] . x for up to 3 matrices sharing x, in one parallel loop; x is
    quantized once for the quantized ones (as matvec does per matrix)."""
    cdef float *xd = NULL
    cdef int8_t *xq = NULL
    cdef Py_ssize_t off[4]
    cdef int g8[3]
    cdef Py_ssize_t u, total
    cdef int m, any_quant = 0
    off[0] = 0
    for m in range(n_mat):  # work units: groups of 8 rows (gemv.h types) or single rows
        g8[m] = pi_gemv8_supported(qt[m])
        off[m + 1] = off[m] + ((rows[m] + 7) // 8 if g8[m] else rows[m])
        any_quant = any_quant | pi_is_quant(qt[m])
    total = off[n_mat]
    if any_quant:
        _quantize_x(x, cols, &xd, &xq)
    for u in prange(total, schedule='static', num_threads=n_threads):
        m = 0 if u < off[1] else (1 if u < off[2] else 2)
        if g8[m]:
            pi_gemv8(qt[m], w[m], stride[m], NULL, u - off[m], rows[m], xd, xq, cols // 32,
                     out[m], 0)
        else:
            out[m][u - off[m]] = pi_dot_row(qt[m], w[m] + (u - off[m]) * stride[m], x, xd, xq,
                                            cols)
    free(xd)
    free(xq)



cdef void _matvec1(const uint8_t *w, int qt, Py_ssize_t stride, Py_ssize_t rows, int cols,
                   const float *x, float *out, int n_threads) noexcept nogil:
    """out[r] = w[r] . x for one matrix, through _multi_matvec (the fused calls' single GEMVs)."""
    _multi_matvec(1, &w, &qt, &stride, &rows, cols, x, &out, n_threads)


cdef void _gate_up_matvec(int n_mat, const uint8_t *wg, int tg, Py_ssize_t sg, const uint8_t *wu,
                          int tu, Py_ssize_t su, Py_ssize_t n_ff, int n_embd, const float *h,
                          float *g, float *u, int n_threads) noexcept nogil:
    """g = gate h and (n_mat 2) u = up h, gate and up (n_ff, n_embd), in one _multi_matvec."""
    cdef const uint8_t *ws[2]
    cdef int qts[2]
    cdef Py_ssize_t strides[2]
    cdef Py_ssize_t rows[2]
    cdef float *outs[2]
    ws[0] = wg
    ws[1] = wu
    qts[0] = tg
    qts[1] = tu
    strides[0] = sg
    strides[1] = su
    rows[0] = n_ff
    rows[1] = n_ff
    outs[0] = g
    outs[1] = u
    _multi_matvec(n_mat, ws, qts, strides, rows, n_embd, h, outs, n_threads)

def decode_attn(float[::1] x, const float[::1] attn_norm, float eps,
                const uint8_t[:, ::1] wq, int tq, const uint8_t[:, ::1] wk, int tk,
                const uint8_t[:, ::1] wv, int tv, const uint8_t[:, ::1] wo, int to,
                uint16_t[:, :, ::1] k_cache, uint16_t[:, :, ::1] v_cache, int kv_f16, int n_past,
                int n_head, double freq_base, int n_threads, const float[::1] rope_div=None,
                const float[::1] bq=None, const float[::1] bk=None, const float[::1] bv=None,
                const float[::1] q_norm=None, const float[::1] k_norm=None, float q_scale=1.0,
                Py_ssize_t window=0, const float[::1] post_norm=None):
    """The attention half of one layer for one token, in place on the residual x (n_embd,) f32:
    x += wo @ attention(rope(wq h + bq), cache), h = rmsnorm(x); K and V of the token (rope on K)
    are written to k_cache/v_cache row n_past ((n_ctx, n_head_kv, head_dim) as ``attention``
    takes them; f16 values rounded to nearest even as numpy's astype(float16)). Rope over the
    whole head (NeoX layout), as ``Model.forward``; rope_div (head_dim/2,) f32 or None: the
    frequencies' divisors (llama.cpp's rope_freqs, Llama 3's scaling: theta_i = pos *
    base^(-2i/d) / rope_div[i], as ``families.rope_scaled``). bq, bk, bv: the projections'
    biases (Qwen2) or None. Gemma 3's departures (``Model.run_layers``): q_norm / k_norm
    (head_dim,) the per-head RMSNorm of Q and K before rope; q_scale multiplies Q after rope
    (1: not at all); window W > 0: the query sees the last W cache rows only; post_norm (n_embd,)
    the RMSNorm of the output before the residual add. Same numerics as rmsnorm, matvec
    (+ bias), the head norms, rope, the scale, attention (over the window's rows) and rmsnorm
    called one by one."""
    cdef int n_embd = x.shape[0]
    cdef Py_ssize_t w = _kv_width(kv_f16)
    cdef Py_ssize_t n_ctx = k_cache.shape[0], n_kv = k_cache.shape[1], hd = k_cache.shape[2] // w
    cdef Py_ssize_t nq = n_head * hd, nkv = n_kv * hd
    _check_w(wq, tq, n_embd)
    _check_w(wk, tk, n_embd)
    _check_w(wv, tv, n_embd)
    _check_w(wo, to, nq)
    _check_len(attn_norm.shape[0], n_embd, "decode_attn attn_norm")
    _check_len(wq.shape[0], nq, "decode_attn wq rows")
    _check_len(wk.shape[0], nkv, "decode_attn wk rows")
    _check_len(wv.shape[0], nkv, "decode_attn wv rows")
    _check_len(wo.shape[0], n_embd, "decode_attn wo rows")
    if (v_cache.shape[0] != n_ctx or v_cache.shape[1] != n_kv or v_cache.shape[2] != hd * w
            or k_cache.shape[2] != hd * w or n_kv == 0 or n_head % n_kv or hd % 2):
        raise ValueError("decode_attn: cache shapes do not match the heads")
    if n_past < 0 or n_past >= n_ctx:
        raise ValueError(f"decode_attn: position {n_past} outside the cache ({n_ctx})")
    cdef const float *div = _opt_ptr(rope_div, hd // 2, "decode_attn rope_div")
    cdef const float *pbq = _opt_ptr(bq, nq, "decode_attn bq")
    cdef const float *pbk = _opt_ptr(bk, nkv, "decode_attn bk")
    cdef const float *pbv = _opt_ptr(bv, nkv, "decode_attn bv")
    cdef const float *pqn = _opt_ptr(q_norm, hd, "decode_attn q_norm")
    cdef const float *pkn = _opt_ptr(k_norm, hd, "decode_attn k_norm")
    cdef const float *ppost = _opt_ptr(post_norm, n_embd, "decode_attn post_norm")
    if window < 0:
        raise ValueError(f"decode_attn: window {window} < 0")
    cdef const uint8_t *ws[4]
    cdef int qts[4]
    cdef Py_ssize_t strides[4]
    ws[0], ws[1], ws[2], ws[3] = &wq[0, 0], &wk[0, 0], &wv[0, 0], &wo[0, 0]
    qts[0], qts[1], qts[2], qts[3] = tq, tk, tv, to
    strides[0], strides[1], strides[2], strides[3] = wq.shape[1], wk.shape[1], wv.shape[1], wo.shape[1]
    with nogil:
        _decode_attn_raw(&x[0], &attn_norm[0], eps, n_embd, ws, qts, strides, &k_cache[0, 0, 0],
                         &v_cache[0, 0, 0], kv_f16, n_kv, hd, n_past, n_head, freq_base,
                         n_threads, div, pbq, pbk, pbv, pqn, pkn, q_scale, window, ppost)


cdef void _decode_attn_raw(float *x, const float *attn_norm, float eps, int n_embd,
                           const uint8_t **ws, const int *qts, const Py_ssize_t *strides,
                           uint16_t *kc, uint16_t *vc, int kv_f16, Py_ssize_t n_kv, Py_ssize_t hd,
                           Py_ssize_t n_past, int n_head, double freq_base, int n_threads,
                           const float *div, const float *pbq, const float *pbk, const float *pbv,
                           const float *pqn, const float *pkn, float q_scale, Py_ssize_t window,
                           const float *ppost) noexcept nogil:
    """decode_attn's work over checked pointers (decode_layers_rows runs it for every layer):
    ws / qts / strides the raw rows, types and row bytes of wq, wk, wv, wo; kc, vc row 0 of the
    layer's caches (uint16 units, _kv_width values a float); optional vectors NULL."""
    # the rows the query sees: 0..n_past, or the window's last ones (families.attention_window)
    cdef Py_ssize_t first_row = n_past + 1 - window if 0 < window <= n_past else 0
    cdef Py_ssize_t nq = n_head * hd, nkv = n_kv * hd, kvw = _kv_width(kv_f16)
    cdef double *inv_freq = NULL
    cdef Py_ssize_t rows[3]
    cdef float *outs[3]
    cdef float *buf
    cdef float *h
    cdef float *q
    cdef float *att
    cdef float *y
    cdef float *kv
    cdef Py_ssize_t i, n_att = n_past + 1 - first_row
    cdef float scale = 1.0 / sqrtf(<float> hd)
    buf = <float *> malloc((2 * n_embd + 2 * nq + hd + 2 * nkv) * sizeof(float))
    h = buf
    y = h + n_embd
    q = y + n_embd
    att = q + nq
    kv = att + nq + hd
    _rmsnorm1(x, attn_norm, eps, h, n_embd)
    rows[0] = nq
    rows[1] = nkv
    rows[2] = nkv
    outs[0] = q
    outs[1] = kv
    outs[2] = kv + nkv
    _multi_matvec(3, ws, qts, strides, rows, n_embd, h, outs, n_threads)
    _add_bias(q, pbq, nq)
    _add_bias(kv, pbk, nkv)
    _add_bias(kv + nkv, pbv, nkv)
    if pqn != NULL:
        for i in range(n_head):
            _rmsnorm1(q + i * hd, pqn, eps, q + i * hd, <int> hd)
    if pkn != NULL:
        for i in range(n_kv):
            _rmsnorm1(kv + i * hd, pkn, eps, kv + i * hd, <int> hd)
    if div == NULL:
        _rope1(q, n_head, hd, n_past, freq_base, hd, att, att + hd // 2)
    else:
        inv_freq = <double *> malloc((hd // 2) * sizeof(double))
        for i in range(hd // 2):  # families.rope_scaled's frequencies, in double
            inv_freq[i] = pow(freq_base, -2.0 * i / hd) / <double> div[i]
        _rope1_tab(q, n_head, hd, n_past, inv_freq, hd, att, att + hd // 2)
        free(inv_freq)
    # K turns by the same angles: reuse the cos/sin the rope left in att (same bits, half
    # the libm calls)
    _rope_rotate(kv, n_kv, hd, hd // 2, att, att + hd // 2)
    if q_scale != 1.0:
        for i in range(nq):
            q[i] *= q_scale
    _kv_store(kv, kc, n_past * nkv, kv_f16, nkv)
    _kv_store(kv + nkv, vc, n_past * nkv, kv_f16, nkv)
    # one pass over the cache rows for the scores, then each thread's heads (attend.h)
    _attend_decode(q, kc + first_row * nkv * kvw, vc + first_row * nkv * kvw, kv_f16, n_att,
                   <int> hd, n_head, <int> n_kv, scale, att, n_threads)
    _matvec1(ws[3], qts[3], strides[3], n_embd, nq, att, y, n_threads)
    if ppost != NULL:
        _rmsnorm1(y, ppost, eps, y, n_embd)
    for i in range(n_embd):
        x[i] += y[i]
    free(buf)


def decode_ffn(float[::1] x, const float[::1] ffn_norm, float eps,
               const uint8_t[:, ::1] wg, int tg, const uint8_t[:, ::1] wu, int tu,
               const uint8_t[:, ::1] wd, int td, int mode, int silu, float thr,
               float dense_above, int n_threads):
    """The FFN half of one layer for one token, in place on the residual x (n_embd,) f32:
    x += down_t^T a, h = rmsnorm(x), g = gate h, u = up h (one row per neuron, (n_ff, n_embd)).
    mode 0 (dense): a = act(g) * u over every neuron. mode 1 ("glu" without a predictor): a =
    act(g) * u kept where |a| > thr or NaN. mode 2 ("relu"/"cats" without a predictor): neurons with
    |act(g)| > thr, whose up rows alone are then read. act = silu if silu else relu. In modes 1
    and 2, when more than dense_above * n_ff neurons are kept, the down projection streams every
    row with the dropped neurons' coefficients at 0 (the same sums: in a model, a stream reads
    faster per byte than a gather of most rows). Returns the number of neurons kept. Same numerics
    as the unfused DenseFFN/SparseFFN."""
    cdef int n_embd = x.shape[0]
    cdef Py_ssize_t n_ff = wg.shape[0]
    _check_w(wg, tg, n_embd)
    _check_w(wu, tu, n_embd)
    _check_w(wd, td, n_embd)
    _check_len(ffn_norm.shape[0], n_embd, "decode_ffn ffn_norm")
    _check_len(wu.shape[0], n_ff, "decode_ffn up rows")
    _check_len(wd.shape[0], n_ff, "decode_ffn down rows")
    if mode < 0 or mode > 2:
        raise ValueError(f"decode_ffn: unknown mode {mode}")
    cdef float *buf
    cdef float *h
    cdef float *y
    cdef float *g
    cdef float *u
    cdef float *coef
    cdef int32_t *idx
    cdef float *xd = NULL
    cdef int8_t *xq = NULL
    cdef Py_ssize_t j, k, n = 0
    cdef float a
    cdef Py_ssize_t su = wu.shape[1]
    with nogil:
        buf = <float *> malloc((2 * n_embd + 3 * n_ff) * sizeof(float))
        idx = <int32_t *> malloc((n_ff + 1) * sizeof(int32_t))
        h = buf
        y = h + n_embd
        g = y + n_embd
        u = g + n_ff
        coef = u + n_ff
        _rmsnorm1(&x[0], &ffn_norm[0], eps, h, n_embd)
        _gate_up_matvec(1 if mode == 2 else 2, &wg[0, 0], tg, wg.shape[1], &wu[0, 0], tu, su, n_ff,
                        n_embd, h, g, u, n_threads)
        for j in range(n_ff):
            a = pi_act1(g[j], silu)
            if mode != 2:
                a = a * u[j]
            if mode == 0:
                coef[j] = a
            else:  # branch-free compaction: a kept/dropped branch mispredicts half the time
                coef[n] = a
                idx[n] = <int32_t> j
                n += <int> (not (fabsf(a) <= thr))  # NaN kept
        if mode == 0:
            n = n_ff
            _axpy_rows(&wd[0, 0], wd.shape[1], td, n_embd, coef, NULL, n_ff, y, n_threads)
        else:
            if mode == 2 and n > 0:
                if pi_is_quant(tu):
                    _quantize_x(h, n_embd, &xd, &xq)
                if pi_gemv8_supported(tu):  # the kept up rows eight per pass, as gather_matvec
                    for k in prange((n + 7) // 8, schedule='static', num_threads=n_threads):
                        pi_gemv8(tu, &wu[0, 0], su, idx, k, n, xd, xq, n_embd // 32, u,
                                 pi_prefetch_dist(su))
                    for k in range(n):  # u is free in mode 2 (only the gate was dotted)
                        coef[k] = coef[k] * u[k]
                else:
                    for k in prange(n, schedule='static', num_threads=n_threads):
                        coef[k] = coef[k] * pi_dot_row(tu, &wu[0, 0] + idx[k] * su, h, xd, xq,
                                                       n_embd)
                free(xd)
                free(xq)
            if n > dense_above * n_ff:
                memset(g, 0, n_ff * sizeof(float))
                for k in range(n):
                    g[idx[k]] = coef[k]
                _axpy_rows(&wd[0, 0], wd.shape[1], td, n_embd, g, NULL, n_ff, y, n_threads)
            else:
                _axpy_rows(&wd[0, 0], wd.shape[1], td, n_embd, coef, idx, n, y, n_threads)
        for j in range(n_embd):
            x[j] += y[j]
        free(buf)
        free(idx)
    return n


DEF ACT_RELU = 0  # _decode_ffn_rows_raw's activations (pyinfer.ops.cpu.DENSE_ACTS: the same numbers)
DEF ACT_SILU = 1
DEF ACT_GELU_TANH = 2


def decode_ffn_rows(float[::1] x, const float[::1] ffn_norm, float eps,
                    const uint8_t[:, ::1] wg, int tg, const uint8_t[:, ::1] wu, int tu,
                    const uint8_t[:, ::1] wd, int td, int n_ff, int silu, int n_threads):
    """The dense FFN half of one layer for one token over ffn_down in llama.cpp's row layout, in
    place on the residual x (n_embd,) f32: h = rmsnorm(x), a = act(gate h) * (up h) with gate,
    up (n_ff, n_embd), x += down a with wd = ffn_down (n_embd, n_ff): two parallel GEMV passes
    (gate and up together, then down), the same bits as the unfused DenseFFN (rmsnorm, matvec,
    silu_mul or relu_mul, matvec). act = silu if silu else relu."""
    cdef int n_embd = x.shape[0]
    _check_w(wg, tg, n_embd)
    _check_w(wu, tu, n_embd)
    _check_w(wd, td, n_ff)
    _check_len(ffn_norm.shape[0], n_embd, "decode_ffn_rows ffn_norm")
    _check_len(wg.shape[0], n_ff, "decode_ffn_rows gate rows")
    _check_len(wu.shape[0], n_ff, "decode_ffn_rows up rows")
    _check_len(wd.shape[0], n_embd, "decode_ffn_rows down rows")
    with nogil:
        _decode_ffn_rows_raw(&x[0], &ffn_norm[0], eps, n_embd, &wg[0, 0], tg, wg.shape[1],
                             &wu[0, 0], tu, wu.shape[1], &wd[0, 0], td, wd.shape[1], n_ff,
                             ACT_SILU if silu else ACT_RELU, NULL, n_threads)


cdef void _decode_ffn_rows_raw(float *x, const float *ffn_norm, float eps, int n_embd,
                               const uint8_t *wg, int tg, Py_ssize_t sg, const uint8_t *wu, int tu,
                               Py_ssize_t su, const uint8_t *wd, int td, Py_ssize_t sd,
                               Py_ssize_t n_ff, int act, const float *post,
                               int n_threads) noexcept nogil:
    """decode_ffn_rows' work over checked pointers (s*: the matrices' row bytes); act ACT_RELU,
    ACT_SILU or ACT_GELU_TANH (Gemma's: pi_gelu_tanh, ``cpu.gelu_tanh``'s bits, times up as
    ``ffn_coef``'s ``up *= a``); post (n_embd,) or NULL: Gemma 3's RMSNorm of the output before
    the residual add (``Model.run_layers``' ffn_post_norm)."""
    cdef float *buf
    cdef float *h
    cdef float *y
    cdef float *g
    cdef float *u
    cdef float a
    cdef Py_ssize_t j
    buf = <float *> malloc((2 * n_embd + 2 * n_ff) * sizeof(float))
    h = buf
    y = h + n_embd
    g = y + n_embd
    u = g + n_ff
    _rmsnorm1(x, ffn_norm, eps, h, n_embd)
    _gate_up_matvec(2, wg, tg, sg, wu, tu, su, n_ff, n_embd, h, g, u, n_threads)
    if act == ACT_GELU_TANH:
        pi_gelu_tanh(g, g, n_ff)
        for j in range(n_ff):
            g[j] = u[j] * g[j]
    else:
        for j in range(n_ff):  # silu_mul's / relu_mul's expressions, so the same bits
            a = g[j]
            if act == ACT_SILU:
                g[j] = a / (1.0 + expf(-a)) * u[j]
            else:
                g[j] = (a if a > 0.0 else 0.0) * u[j]
    _matvec1(wd, td, sd, n_embd, <int> n_ff, g, y, n_threads)
    if post != NULL:
        _rmsnorm1(y, post, eps, y, n_embd)
    for j in range(n_embd):
        x[j] += y[j]
    free(buf)


DEF DENSE_MATS = 7  # wq, wk, wv, wo, gate, up, down
DEF DENSE_VECS = 9  # attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm, attn_post, ffn_post


cdef inline int _check_plan_heads(int n, int n_head, int n_kv, int hd, str what) except -1:
    """ValueError unless a decode plan has layers and heads its kernels take."""
    if n == 0 or n_kv <= 0 or n_head % n_kv or hd % 2:
        raise ValueError(f"{what}: no layers, or heads that do not fit")
    return 0


cdef int _check_plan_caches(uint16_t[:, :, :, ::1] k_cache, uint16_t[:, :, :, ::1] v_cache,
                            int kv_f16, int n_past, int L, int n_kv, int hd, str what) except -1:
    """ValueError unless the (n_layer, n_ctx, n_head_kv, head_dim) caches fit a decode plan of L
    layers (uint16: f16 values with kv_f16, else f32, the last axis 2 head_dim) and hold row
    n_past."""
    if (k_cache.shape[0] != L or v_cache.shape[0] != L or k_cache.shape[1] != v_cache.shape[1]
            or k_cache.shape[2] != n_kv or v_cache.shape[2] != n_kv
            or k_cache.shape[3] != hd * _kv_width(kv_f16) or v_cache.shape[3] != k_cache.shape[3]):
        raise ValueError(f"{what}: cache shapes do not match the plan")
    if n_past < 0 or n_past >= k_cache.shape[1]:
        raise ValueError(f"{what}: position {n_past} outside the cache ({k_cache.shape[1]})")
    return 0


cdef class DenseDecodePlan:
    """The per-layer weights of a dense model whose ffn_down is in llama.cpp's row layout (a
    llama.cpp file, a ``--dense`` file: Llama-shaped, or Gemma 3 / windowed Mistral and Qwen2,
    whose attention half ``decode_attn`` computes) as raw pointers, checked once, for
    ``decode_layers_rows``: one call per token instead of two calls (Gemma: about ten) and about
    17 memoryview acquisitions per layer (about 7 us a layer of Python and argument work,
    session 37). Holds references to every array it points into.

    layers: one tuple per layer (attn_norm (n_embd,) f32, wq raw, type, wk raw, type, wv raw,
    type, wo raw, type, ffn_norm (n_embd,) f32, gate raw, type, up raw, type, down raw, type,
    bq, bk, bv (f32 or None), q_norm, k_norm ((head_dim,) f32 or None), attn_post_norm,
    ffn_post_norm ((n_embd,) f32 or None), window (int, 0: none)): the arguments of decode_attn
    and decode_ffn_rows; freq_base (n_layer,) f64 each layer's RoPE base; act 0 relu, 1 silu, 2
    GELU-tanh; q_scale decode_attn's; rope_div (hd/2,) f32 or None. ValueError on shapes that do
    not fit (those two functions' checks)."""
    cdef readonly int n_layer, n_embd, n_head, n_kv, hd, n_ff
    cdef float eps, q_scale
    cdef int act
    cdef const float *div
    cdef const uint8_t **w
    cdef Py_ssize_t *stride
    cdef int *qtype
    cdef const float **vec
    cdef double *base
    cdef Py_ssize_t *window
    cdef list _keep

    def __cinit__(self, list layers, int n_head, int n_kv, int hd, float eps,
                  const double[::1] freq_base, int act, float q_scale=1.0,
                  const float[::1] rope_div=None):
        cdef int n = len(layers), i, k
        cdef const uint8_t[:, ::1] wv
        cdef const float[::1] fv
        self.w = NULL
        self.stride = NULL
        self.qtype = NULL
        self.vec = NULL
        self.base = NULL
        self.window = NULL
        _check_plan_heads(n, n_head, n_kv, hd, "DenseDecodePlan")
        if act not in (ACT_RELU, ACT_SILU, ACT_GELU_TANH):
            raise ValueError(f"DenseDecodePlan: unknown activation {act}")
        _check_len(freq_base.shape[0], n, "DenseDecodePlan freq_base")
        self.n_layer, self.n_head, self.n_kv, self.hd = n, n_head, n_kv, hd
        self.eps, self.act, self.q_scale = eps, act, q_scale
        self._keep = [list(layers), rope_div]
        self.div = _opt_ptr(rope_div, hd // 2, "DenseDecodePlan rope_div")
        self.w = <const uint8_t **> malloc(DENSE_MATS * n * sizeof(uint8_t *))
        self.stride = <Py_ssize_t *> malloc(DENSE_MATS * n * sizeof(Py_ssize_t))
        self.qtype = <int *> malloc(DENSE_MATS * n * sizeof(int))
        self.vec = <const float **> malloc(DENSE_VECS * n * sizeof(float *))
        self.base = <double *> malloc(n * sizeof(double))
        self.window = <Py_ssize_t *> malloc(n * sizeof(Py_ssize_t))
        if not (self.w and self.stride and self.qtype and self.vec and self.base and self.window):
            raise MemoryError()
        cdef Py_ssize_t nq = n_head * hd, nkv = n_kv * hd, n_embd = -1, n_ff = -1
        cdef Py_ssize_t outs[DENSE_MATS]
        for i in range(n):
            lt = layers[i]
            if len(lt) != 24:
                raise ValueError("DenseDecodePlan: each layer needs 24 entries")
            fv = lt[0]
            if n_embd < 0:
                n_embd = fv.shape[0]
                wv = lt[10]  # gate (n_ff, ...)
                n_ff = wv.shape[0]
            _check_len(fv.shape[0], n_embd, "DenseDecodePlan attn_norm")
            self.vec[DENSE_VECS * i] = &fv[0]
            fv = lt[9]
            _check_len(fv.shape[0], n_embd, "DenseDecodePlan ffn_norm")
            self.vec[DENSE_VECS * i + 1] = &fv[0]
            outs[0], outs[1], outs[2], outs[3] = nq, nkv, nkv, n_embd
            outs[4], outs[5], outs[6] = n_ff, n_ff, n_embd
            for k in range(DENSE_MATS):  # (raw, type) pairs at 1, 3, 5, 7 and 10, 12, 14
                wv = lt[(1, 3, 5, 7, 10, 12, 14)[k]]
                self.qtype[DENSE_MATS * i + k] = int(lt[(2, 4, 6, 8, 11, 13, 15)[k]])
                _check_w(wv, self.qtype[DENSE_MATS * i + k],
                         <int> (nq if k == 3 else (n_ff if k == 6 else n_embd)))
                _check_len(wv.shape[0], outs[k], "DenseDecodePlan matrix rows")
                self.w[DENSE_MATS * i + k] = &wv[0, 0]
                self.stride[DENSE_MATS * i + k] = wv.shape[1]
            self.vec[DENSE_VECS * i + 2] = _opt_ptr(lt[16], nq, "DenseDecodePlan bq")
            self.vec[DENSE_VECS * i + 3] = _opt_ptr(lt[17], nkv, "DenseDecodePlan bk")
            self.vec[DENSE_VECS * i + 4] = _opt_ptr(lt[18], nkv, "DenseDecodePlan bv")
            self.vec[DENSE_VECS * i + 5] = _opt_ptr(lt[19], hd, "DenseDecodePlan q_norm")
            self.vec[DENSE_VECS * i + 6] = _opt_ptr(lt[20], hd, "DenseDecodePlan k_norm")
            if (self.vec[DENSE_VECS * i + 5] == NULL) != (self.vec[DENSE_VECS * i + 6] == NULL):
                raise ValueError("DenseDecodePlan: q_norm and k_norm go together")
            self.vec[DENSE_VECS * i + 7] = _opt_ptr(lt[21], n_embd, "DenseDecodePlan attn_post_norm")
            self.vec[DENSE_VECS * i + 8] = _opt_ptr(lt[22], n_embd, "DenseDecodePlan ffn_post_norm")
            self.window[i] = lt[23]
            if self.window[i] < 0:
                raise ValueError(f"DenseDecodePlan: window {self.window[i]} < 0")
            self.base[i] = freq_base[i]
        if n_embd <= 0 or n_ff <= 0:
            raise ValueError("DenseDecodePlan: empty layers")
        self.n_embd, self.n_ff = <int> n_embd, <int> n_ff

    def __dealloc__(self):
        free(self.w)
        free(self.stride)
        free(self.qtype)
        free(self.vec)
        free(self.base)
        free(self.window)


def decode_layers_rows(DenseDecodePlan plan not None, float[::1] x,
                       uint16_t[:, :, :, ::1] k_cache, uint16_t[:, :, :, ::1] v_cache, int kv_f16,
                       int n_past, int first, int n_threads):
    """Layers first .. n_layer - 1 of one token of a dense model, in place on x (n_embd,) f32:
    per layer decode_attn then decode_ffn_rows over the plan's pointers (the same work, so the
    same bits) in one call. k_cache, v_cache (n_layer, n_ctx, n_head_kv, head_dim) as
    ``decode_attn`` takes each layer's (uint16: f16 values with kv_f16, else f32, the last axis
    2 head_dim), row n_past of each layer written. ValueError on shapes that do not fit."""
    cdef int L = plan.n_layer, l
    cdef Py_ssize_t hd = plan.hd, n_kv = plan.n_kv, layer
    _check_len(x.shape[0], plan.n_embd, "decode_layers_rows x")
    _check_plan_caches(k_cache, v_cache, kv_f16, n_past, L, <int> n_kv, <int> hd,
                       "decode_layers_rows")
    if first < 0 or first > L:
        raise ValueError(f"decode_layers_rows: first layer {first} outside 0..{L}")
    if first == L:
        return
    layer = k_cache.shape[1] * n_kv * hd * _kv_width(kv_f16)  # uint16 units a layer
    cdef uint16_t *kc = &k_cache[0, 0, 0, 0]
    cdef uint16_t *vc = &v_cache[0, 0, 0, 0]
    cdef const uint8_t **w = plan.w
    cdef Py_ssize_t *st = plan.stride
    cdef int *qt = plan.qtype
    cdef const float **vec = plan.vec
    with nogil:
        for l in range(first, L):
            _decode_attn_raw(&x[0], vec[DENSE_VECS * l], plan.eps, plan.n_embd,
                             w + DENSE_MATS * l, qt + DENSE_MATS * l, st + DENSE_MATS * l,
                             kc + l * layer, vc + l * layer, kv_f16, n_kv, hd, n_past,
                             plan.n_head, plan.base[l], n_threads, plan.div,
                             vec[DENSE_VECS * l + 2], vec[DENSE_VECS * l + 3],
                             vec[DENSE_VECS * l + 4], vec[DENSE_VECS * l + 5],
                             vec[DENSE_VECS * l + 6], plan.q_scale, plan.window[l],
                             vec[DENSE_VECS * l + 7])
            _decode_ffn_rows_raw(&x[0], vec[DENSE_VECS * l + 1], plan.eps, plan.n_embd,
                                 w[DENSE_MATS * l + 4], qt[DENSE_MATS * l + 4],
                                 st[DENSE_MATS * l + 4], w[DENSE_MATS * l + 5],
                                 qt[DENSE_MATS * l + 5], st[DENSE_MATS * l + 5],
                                 w[DENSE_MATS * l + 6], qt[DENSE_MATS * l + 6],
                                 st[DENSE_MATS * l + 6], plan.n_ff, plan.act,
                                 vec[DENSE_VECS * l + 8], n_threads)


# ---------------------------------------------------------------- input sparsity (TEAL / WINA)
# A projection y = W x whose input channel j is dropped never reads column j of W. The file stores
# such matrices transposed (one row per input channel: attn_qkv_t, attn_output_t, ffn_gate_up_t,
# and ffn_down_t as before), so y is an AXPY over the rows of the kept channels (_axpy_rows: the
# row sum is cut into chunks by the number of kept rows alone, never by the thread count).

cdef inline Py_ssize_t _select_inputs(const float *x, const float *scale, float thr, Py_ssize_t n,
                                      float *coef, int32_t *idx) noexcept nogil:
    """Keep channel j where |x[j]| * scale[j] > thr or is NaN (scale NULL: 1): writes x[j] into coef[:k]
    and j into idx[:k], returns k. thr < 0 keeps every channel (rowsum_team.h pi_select_kept)."""
    return pi_select_kept(x, scale, thr, n, 0, coef, idx)


cdef inline const float *_opt_ptr(const float[::1] a, Py_ssize_t n, str what) except? NULL:
    if a is None:
        return NULL
    _check_len(a.shape[0], n, what)
    return &a[0]


def select_inputs(const float[::1] x, const float[::1] scale, float thr, float[::1] coef,
                  int32_t[::1] idx):
    """Input channels kept: |x[j]| * scale[j] > thr or NaN (scale None: 1). Writes x[j] of the kept
    channels into coef[:k] and j into idx[:k] (both (n,)); returns k."""
    cdef Py_ssize_t n = x.shape[0], k
    cdef const float *sp = _opt_ptr(scale, n, "select_inputs scale")
    _check_len(coef.shape[0], n, "select_inputs coef")
    _check_len(idx.shape[0], n, "select_inputs idx")
    if n == 0:
        return 0
    with nogil:
        k = _select_inputs(&x[0], sp, thr, n, &coef[0], &idx[0])
    return k


cdef void _ffn_in_team(int t, int T, float *x, const float *ffn_norm, float eps, int n_embd,
                       const uint8_t *wgu, size_t sgu, int tgu, const uint8_t *wd, size_t sd_,
                       int td, Py_ssize_t n_ff, const float *scale_gu, float thr_gu,
                       const float *scale_d, float thr_d, int silu, float *gu, float *y,
                       float *ctmp, int32_t *itmp, float *tmp_gu, float *tmp_d, long *cnt,
                       float *priv, Py_ssize_t n_priv, Py_ssize_t *counts) noexcept nogil:
    """Thread t of T's share of decode_ffn_in in one parallel region (every thread calls it with
    the same arguments; rowsum_team.h's conventions). gu (2 n_ff), y (n_embd), ctmp/itmp (n_ff):
    shared; cnt: T longs; priv: T blocks of n_priv floats, one per thread (its normed input, its
    copies of both kept lists). Two barriers: gate/up complete before the activations, every
    thread's kept activations before the down sums. Each step's split of the work (half tiles,
    chunks, columns) leaves every result the same as one thread computes it."""
    cdef float *h = priv + t * n_priv
    cdef float *cin = h + n_embd
    cdef int32_t *iin = <int32_t *> (cin + n_embd)
    cdef float *cd = <float *> (iin + n_embd)
    cdef int32_t *idd = <int32_t *> (cd + n_ff)
    cdef Py_ssize_t n_in, n_mid
    cdef long j0, j1
    # 1. every thread its own norm and kept list of the gate/up inputs (no barrier, and no line
    # of them written by another core)
    pi_ib_pf_first(t, T, tgu, wgu, sgu, <int> (2 * n_ff))  # (while this step runs)
    _rmsnorm1(x, ffn_norm, eps, h, n_embd)
    n_in = _select_inputs(h, scale_gu, thr_gu, n_embd, cin, iin)
    # 2. [g, u] = the kept rows of ffn_gate_up_t (summing g and u as two spans, so that a
    # thread's activations read only its own lines, measured 1-3% slower on 2 threads and 5%
    # on one: each row is then streamed in two passes)
    pi_axpy_rows_team(t, T, tgu, wgu, sgu, cin, iin, n_in, gu, <int> (2 * n_ff), tmp_gu, NULL)
    pi_team_barrier()
    # 3. a = act(g) u over this thread's span, its kept ones compacted at the span's start
    pi_ib_pf_first(t, T, td, wd, sd_, n_embd)  # (while this step runs)
    pi_act_span(t, T, n_ff, &j0, &j1)
    cnt[t] = pi_act_select(gu, n_ff, j0, j1, silu, scale_d, thr_d, ctmp + j0, itmp + j0)
    pi_team_barrier()
    # 4. x += the kept rows of ffn_down_t over this thread's copy of the whole kept list
    n_mid = pi_act_gather(T, n_ff, cnt, ctmp, itmp, cd, idd)
    pi_axpy_rows_team(t, T, td, wd, sd_, cd, idd, n_mid, y, n_embd, tmp_d, x)
    if t == 0:
        counts[0] = n_in
        counts[1] = n_mid


def decode_ffn_in(float[::1] x, const float[::1] ffn_norm, float eps,
                  const uint8_t[:, ::1] wgu, int tgu, const uint8_t[:, ::1] wd, int td,
                  const float[::1] scale_gu, float thr_gu, const float[::1] scale_d, float thr_d,
                  int silu, int n_threads):
    """The FFN half of one layer for one token with input sparsity, in place on the residual x
    (n_embd,) f32: h = rmsnorm(x); [g, u] = sum over kept j (|h_j| scale_gu_j > thr_gu) of
    h_j * wgu[j], wgu = ffn_gate_up_t (n_embd, 2 n_ff); a = act(g) * u; x += sum over kept i
    (|a_i| scale_d_i > thr_d) of a_i * wd[i], wd = ffn_down_t (n_ff, n_embd). Weights are
    dequantized exactly (no activation quantization) in the transposed row layouts; input-block
    layouts take the int8 sums of ibsum.h. One parallel region (_ffn_in_team; was two, with the
    norm and selection before them on one thread). Returns (gate/up rows read, down rows read)."""
    cdef int n_embd = x.shape[0]
    _check_len(ffn_norm.shape[0], n_embd, "decode_ffn_in ffn_norm")
    cdef Py_ssize_t n_ff = _check_ffn_in(wgu, tgu, wd, td, n_embd, "decode_ffn_in")
    cdef const float *sgu = _opt_ptr(scale_gu, n_embd, "decode_ffn_in scale_gu")
    cdef const float *sd = _opt_ptr(scale_d, n_ff, "decode_ffn_in scale_d")
    cdef int T = max(n_threads, 1)
    # per thread: h, the gate/up kept list (coef, idx), the down kept list (coef, idx); whole
    # cache lines each, so no thread writes a line another one reads
    cdef Py_ssize_t n_priv = (3 * n_embd + 2 * n_ff + 15) // 16 * 16
    cdef Py_ssize_t nt_gu = pi_axpy_tmp_floats(n_embd, <int> (2 * n_ff), wgu.shape[1])
    cdef Py_ssize_t nt_d = pi_axpy_tmp_floats(n_ff, n_embd, wd.shape[1])
    cdef Py_ssize_t counts[2]
    cdef float *buf
    cdef float *priv
    cdef long *cnt
    cdef FfnBufs b
    with nogil:
        # (at most n_embd gate/up rows and n_ff down rows are kept: tmp sized for every row)
        buf = <float *> malloc((_ffn_bufs(NULL, &b, n_embd, n_ff, nt_gu, nt_d) + 1)
                               * sizeof(float))
        _ffn_bufs(buf, &b, n_embd, n_ff, nt_gu, nt_d)
        priv = <float *> aligned_alloc(64, T * n_priv * sizeof(float))
        cnt = <long *> malloc(T * sizeof(long))
        if T == 1:
            _ffn_in_team(0, 1, &x[0], &ffn_norm[0], eps, n_embd, &wgu[0, 0], wgu.shape[1], tgu,
                         &wd[0, 0], wd.shape[1], td, n_ff, sgu, thr_gu, sd, thr_d, silu, b.gu,
                         b.y, b.ctmp, b.itmp, b.tmp_gu, b.tmp_d, cnt, priv, n_priv, counts)
        else:
            with parallel(num_threads=T):
                _ffn_in_team(pi_team_thread(), pi_team_size(), &x[0], &ffn_norm[0], eps, n_embd,
                             &wgu[0, 0], wgu.shape[1], tgu, &wd[0, 0], wd.shape[1], td, n_ff, sgu,
                             thr_gu, sd, thr_d, silu, b.gu, b.y, b.ctmp, b.itmp, b.tmp_gu,
                             b.tmp_d, cnt, priv, n_priv, counts)
        free(buf)
        free(priv)
        free(cnt)
    return counts[0], counts[1]


cdef int _check_attn_in(const uint8_t[:, ::1] wqkv, int tqkv, const uint8_t[:, ::1] wo, int to,
                        Py_ssize_t n_embd, Py_ssize_t nq, Py_ssize_t nkv, str what) except -1:
    """ValueError unless wqkv is attn_qkv_t (n_embd inputs, nq + 2 nkv outputs) and wo
    attn_output_t (nq inputs, n_embd outputs), transposed or input-block."""
    _check_w(wqkv, tqkv, <int> (nq + 2 * nkv))
    _check_w(wo, to, <int> n_embd)
    _check_len(_in_rows(wqkv, tqkv), n_embd, what + " qkv rows")
    _check_len(_in_rows(wo, to), nq, what + " output rows")
    return 0


cdef Py_ssize_t _check_ffn_in(const uint8_t[:, ::1] wgu, int tgu, const uint8_t[:, ::1] wd,
                              int td, Py_ssize_t n_embd, str what) except -1:
    """n_ff, the down projection's inputs; ValueError unless wgu is ffn_gate_up_t (n_embd inputs,
    2 n_ff outputs) and wd ffn_down_t (n_ff inputs, n_embd outputs), transposed or input-block."""
    _check_len(_in_rows(wgu, tgu), n_embd, what + " gate_up rows")
    cdef Py_ssize_t n_ff = _in_rows(wd, td)
    _check_w(wgu, tgu, <int> (2 * n_ff))
    _check_w(wd, td, <int> n_embd)
    return n_ff


cdef struct AttnBufs:  # decode_attn_in's shared scratch (see _attn_bufs)
    float *y
    float *qkv
    float *att
    float *cs
    float *sc
    float *tmp_qkv
    float *tmp_o


cdef struct HeadArgs:  # decode_layers_in's lm head (InputDecodePlan.set_head, the threshold)
    const float *norm
    const uint8_t *raw
    const float *scale
    int qtype
    int n_out
    int chunk
    float thr


cdef struct FfnBufs:  # decode_ffn_in's shared scratch (see _ffn_bufs)
    float *gu
    float *y
    float *ctmp
    int32_t *itmp
    float *tmp_gu
    float *tmp_d


cdef inline Py_ssize_t _attn_bufs(float *buf, AttnBufs *b, int n_embd, Py_ssize_t nq,
                                  Py_ssize_t nkv, int hd, int n_head, Py_ssize_t n_att,
                                  Py_ssize_t nt_qkv, Py_ssize_t nt_o) noexcept nogil:
    """Floats of _attn_in_team's shared scratch: y (n_embd), qkv (nq + 2 nkv), att (nq), cs (hd),
    sc (n_head n_att), tmp_qkv (nt_qkv), tmp_o (nt_o); with buf not NULL, b points into it."""
    if buf != NULL:
        b.y = buf
        b.qkv = b.y + n_embd
        b.att = b.qkv + nq + 2 * nkv
        b.cs = b.att + nq
        b.sc = b.cs + hd
        b.tmp_qkv = b.sc + n_head * n_att
        b.tmp_o = b.tmp_qkv + nt_qkv
    return n_embd + nq + 2 * nkv + nq + hd + n_head * n_att + nt_qkv + nt_o


cdef inline Py_ssize_t _ffn_bufs(float *buf, FfnBufs *b, int n_embd, Py_ssize_t n_ff,
                                 Py_ssize_t nt_gu, Py_ssize_t nt_d) noexcept nogil:
    """Floats of _ffn_in_team's shared scratch: gu (2 n_ff), y (n_embd), ctmp (n_ff), itmp (n_ff
    int32), tmp_gu (nt_gu), tmp_d (nt_d); with buf not NULL, b points into it."""
    if buf != NULL:
        b.gu = buf
        b.y = b.gu + 2 * n_ff
        b.ctmp = b.y + n_embd
        b.itmp = <int32_t *> (b.ctmp + n_ff)
        b.tmp_gu = <float *> (b.itmp + n_ff)
        b.tmp_d = b.tmp_gu + nt_gu
    return 2 * n_ff + n_embd + 2 * n_ff + nt_gu + nt_d


cdef inline void _rope_table_share(int t, int T, int n_past, double freq_base, int hd,
                                   float *cs, const float *div) noexcept nogil:
    """Thread t of T's share of the rope's table for position n_past: cs[i] = cos(theta_i),
    cs[hd/2 + i] = sin(theta_i), theta_i = n_past freq_base^(-2i/hd) (_rope1's expressions: the
    same cos/sin for q and k), divided by div[i] where div is not NULL (Llama 3's frequency
    divisors: decode_attn's expression). The team reads it after a barrier."""
    cdef int i, half = hd // 2
    cdef double theta
    for i in range(t * half // T, (t + 1) * half // T):
        if div == NULL:
            theta = n_past * pow(freq_base, -2.0 * i / hd)
        else:
            theta = n_past * (pow(freq_base, -2.0 * i / hd) / <double> div[i])
        cs[i] = <float> cos(theta)
        cs[half + i] = <float> sin(theta)


cdef void _attn_in_team(int t, int T, float *x, const float *attn_norm, float eps, int n_embd,
                        const uint8_t *wqkv, size_t sqkv, int tqkv, const uint8_t *wo,
                        size_t so_, int to, void *k_cache, void *v_cache, int f16, Py_ssize_t rs,
                        int n_past, int n_head, int n_kv, int hd, double freq_base,
                        const float *sq, float thr_qkv, const float *so, float thr_o,
                        float *qkv, float *att, float *cs, float *sc, float *tmp_qkv,
                        float *tmp_o, float *y, float *priv, Py_ssize_t n_priv,
                        Py_ssize_t *counts, const float *bqkv, const float *div,
                        int rope_ready=0, const float *qn=NULL,
                        const float *kn=NULL) noexcept nogil:
    """Thread t of T's share of decode_attn_in in one parallel region (every thread calls it with
    the same arguments; rowsum_team.h's conventions). rs: values per cache row (n_kv hd); k_cache,
    v_cache: row 0 of the caches (f16 values with f16, else f32); cs: hd floats shared (the rope's cos | sin); sc: n_head
    (n_past + 1) floats shared (the attention scores); priv: T blocks of n_priv floats, one per
    thread (its copy of the output's kept list, its normed input and its copy of the q/k/v
    inputs' kept list); bqkv: [bq; bk; bv] (nq + 2 nkv) f32 or NULL, added to q, k, v before the
    rope; div: the rope's frequency divisors or NULL (_rope_table_share); qn, kn: (hd,) f32 or
    NULL, the per-head RMSNorms of Q and K between the biases and the rope (Qwen3). Each step's split of the
    work (heads, chunks, columns) leaves every result the same as one thread computes it, so
    the bits do not depend on T."""
    cdef Py_ssize_t nq = n_head * hd, nkv = n_kv * hd, n_att = n_past + 1, n_mid, n_in, i
    cdef int half = hd // 2, group = n_head // n_kv, hh, h0, h1
    cdef float scale = 1.0 / sqrtf(<float> hd)
    cdef float *mine = priv + t * n_priv
    cdef int32_t *midx = <int32_t *> mine
    cdef float *mcoef = mine + nq
    cdef float *h = mcoef + nq
    cdef float *cin = h + n_embd
    cdef int32_t *iin = <int32_t *> (cin + n_embd)
    # 1. every thread its own norm and kept list of the q/k/v inputs (no barrier: the kept list
    # was thread 0's, the others waiting), and its share of the rope's table for this position
    # (_rope1's expressions: the same cos/sin for q and k; read after step 2's barrier)
    pi_ib_pf_first(t, T, tqkv, wqkv, sqkv, <int> (nq + 2 * nkv))  # (while this step runs)
    _rmsnorm1(x, attn_norm, eps, h, n_embd)
    n_in = _select_inputs(h, sq, thr_qkv, n_embd, cin, iin)
    if not rope_ready:  # (decode_layers_in makes the table once per token: rope_ready 1)
        _rope_table_share(t, T, n_past, freq_base, hd, cs, div)
    # 2. [q, k, v] = the kept rows of attn_qkv_t (chunks by count, then column slices)
    pi_axpy_rows_team(t, T, tqkv, wqkv, sqkv, cin, iin, n_in, qkv, <int> (nq + 2 * nkv),
                      tmp_qkv, NULL)
    pi_team_barrier()
    # 3. rope on this thread's share of the q and k heads; its k heads' K and V to the cache
    pi_ib_pf_first(t, T, to, wo, so_, n_embd)  # (while steps 3 and 4 run)
    h0 = t * (n_head + n_kv) // T
    h1 = (t + 1) * (n_head + n_kv) // T
    for hh in range(h0, h1):
        if bqkv != NULL:  # (q heads, then k heads: hd values each, in qkv's order)
            _add_bias(qkv + hh * hd, bqkv + hh * hd, hd)
        if qn != NULL:  # (decode_attn's head norms: _rmsnorm1 over each head)
            _rmsnorm1(qkv + hh * hd, qn if hh < n_head else kn, eps, qkv + hh * hd, hd)
        _rope_rotate(qkv + hh * hd, 1, hd, half, cs, cs + half)
        if hh >= n_head:
            if bqkv != NULL:
                _add_bias(qkv + nq + nkv + (hh - n_head) * hd,
                          bqkv + nq + nkv + (hh - n_head) * hd, hd)
            _kv_store(qkv + hh * hd, k_cache, n_past * rs + (hh - n_head) * hd, f16, hd)
            _kv_store(qkv + nq + nkv + (hh - n_head) * hd, v_cache,
                      n_past * rs + (hh - n_head) * hd, f16, hd)
    pi_team_barrier()
    # 4. attention: the scores of every head over this thread's cache rows, then this thread's
    # query heads (attend.h; one barrier inside)
    pi_attend_team(t, T, qkv, k_cache, v_cache, f16, rs, n_att, hd, n_head, n_kv, scale, sc, att)
    pi_team_barrier()
    # 5. every thread selects the output's inputs into its own list (the same list), then
    # x += the kept rows of attn_output_t, the residual added by column slices
    n_mid = _select_inputs(att, so, thr_o, nq, mcoef, midx)
    if t == 0:
        counts[0] = n_in
        counts[1] = n_mid
    pi_axpy_rows_team(t, T, to, wo, so_, mcoef, midx, n_mid, y, n_embd, tmp_o, x)


def decode_attn_in(float[::1] x, const float[::1] attn_norm, float eps,
                   const uint8_t[:, ::1] wqkv, int tqkv, const uint8_t[:, ::1] wo, int to,
                   uint16_t[:, :, ::1] k_cache, uint16_t[:, :, ::1] v_cache, int kv_f16, int n_past,
                   int n_head, double freq_base, const float[::1] scale_qkv, float thr_qkv,
                   const float[::1] scale_o, float thr_o, int n_threads,
                   const float[::1] rope_div=None, const float[::1] bqkv=None,
                   const float[::1] q_norm=None, const float[::1] k_norm=None):
    """The attention half-layer of one token with input sparsity, in place on x (n_embd,):
    h = rmsnorm(x); [q, k, v] = sum over kept j (|h_j| scale_qkv_j > thr_qkv) of h_j * wqkv[j],
    wqkv = attn_qkv_t (n_embd, n_head*hd + 2 n_head_kv*hd); rope on q and k, K and V to cache row
    n_past; att = attention; x += sum over kept i (|att_i| scale_o_i > thr_o) of att_i * wo[i],
    wo = attn_output_t (n_head*hd, n_embd). One parallel region (_attn_in_team; was three, with
    the selections and rope between them on one thread), three barriers. Returns (qkv rows
    read, output rows read). The caches as ``decode_attn`` takes them; rope_div (hd/2,) and bqkv
    ([bq; bk; bv], n_head*hd + 2 n_head_kv*hd) f32 or None as ``decode_attn``'s rope_div and
    biases; q_norm, k_norm (hd,) f32 or None (both or neither) as its head norms (Qwen3)."""
    cdef int n_embd = x.shape[0]
    cdef Py_ssize_t w = _kv_width(kv_f16)
    cdef Py_ssize_t n_ctx = k_cache.shape[0], n_kv = k_cache.shape[1], hd = k_cache.shape[2] // w
    cdef Py_ssize_t nq = n_head * hd, nkv = n_kv * hd
    _check_attn_in(wqkv, tqkv, wo, to, n_embd, nq, nkv, "decode_attn_in")
    _check_len(attn_norm.shape[0], n_embd, "decode_attn_in attn_norm")
    if (v_cache.shape[0] != n_ctx or v_cache.shape[1] != n_kv or v_cache.shape[2] != hd * w
            or k_cache.shape[2] != hd * w or n_kv == 0 or n_head % n_kv or hd % 2):
        raise ValueError("decode_attn_in: cache shapes do not match the heads")
    if n_past < 0 or n_past >= n_ctx:
        raise ValueError(f"decode_attn_in: position {n_past} outside the cache ({n_ctx})")
    cdef const float *sq = _opt_ptr(scale_qkv, n_embd, "decode_attn_in scale_qkv")
    cdef const float *so = _opt_ptr(scale_o, nq, "decode_attn_in scale_o")
    cdef const float *div = _opt_ptr(rope_div, hd // 2, "decode_attn_in rope_div")
    cdef const float *pb = _opt_ptr(bqkv, nq + 2 * nkv, "decode_attn_in bqkv")
    cdef const float *pqn = _opt_ptr(q_norm, hd, "decode_attn_in q_norm")
    cdef const float *pkn = _opt_ptr(k_norm, hd, "decode_attn_in k_norm")
    if (pqn == NULL) != (pkn == NULL):
        raise ValueError("decode_attn_in: q_norm and k_norm go together")
    cdef int T = max(n_threads, 1)
    cdef Py_ssize_t n_att = n_past + 1
    # per thread: the output's kept list (idx | coef), h, the q/k/v kept list (coef | idx);
    # whole cache lines each
    cdef Py_ssize_t n_priv = (2 * nq + 3 * n_embd + 15) // 16 * 16
    cdef Py_ssize_t nt_qkv = pi_axpy_tmp_floats(n_embd, <int> (nq + 2 * nkv), wqkv.shape[1])
    cdef Py_ssize_t nt_o = pi_axpy_tmp_floats(nq, n_embd, wo.shape[1])
    cdef float *buf
    cdef float *priv
    cdef Py_ssize_t counts[2]
    cdef AttnBufs b
    with nogil:
        # (at most n_embd qkv rows and nq output rows are kept: tmp sized for every row)
        buf = <float *> malloc((_attn_bufs(NULL, &b, n_embd, nq, nkv, <int> hd, n_head, n_att,
                                           nt_qkv, nt_o) + 1) * sizeof(float))
        _attn_bufs(buf, &b, n_embd, nq, nkv, <int> hd, n_head, n_att, nt_qkv, nt_o)
        priv = <float *> aligned_alloc(64, T * n_priv * sizeof(float))
        if T == 1:
            _attn_in_team(0, 1, &x[0], &attn_norm[0], eps, n_embd, &wqkv[0, 0], wqkv.shape[1],
                          tqkv, &wo[0, 0], wo.shape[1], to, &k_cache[0, 0, 0], &v_cache[0, 0, 0],
                          kv_f16, nkv, n_past, n_head, <int> n_kv, <int> hd, freq_base, sq, thr_qkv, so,
                          thr_o, b.qkv, b.att, b.cs, b.sc, b.tmp_qkv, b.tmp_o, b.y, priv, n_priv,
                          counts, pb, div, 0, pqn, pkn)
        else:
            with parallel(num_threads=T):
                _attn_in_team(pi_team_thread(), pi_team_size(), &x[0], &attn_norm[0], eps,
                              n_embd, &wqkv[0, 0], wqkv.shape[1], tqkv, &wo[0, 0], wo.shape[1],
                              to, &k_cache[0, 0, 0], &v_cache[0, 0, 0], kv_f16, nkv, n_past, n_head,
                              <int> n_kv, <int> hd, freq_base, sq, thr_qkv, so, thr_o, b.qkv,
                              b.att, b.cs, b.sc, b.tmp_qkv, b.tmp_o, b.y, priv, n_priv, counts,
                              pb, div, 0, pqn, pkn)
        free(buf)
        free(priv)
    return counts[0], counts[1]


# ---------------------------------------------------------------- input-sparse decode, whole token

#: f32 vectors an InputDecodePlan holds per layer: attn_norm, ffn_norm, the four groups' channel
#: scales, bqkv, q_norm, k_norm
DEF PLAN_VECS = 9




cdef class InputDecodePlan:
    """The per-layer weights of an input-sparse model as raw pointers, checked once, for
    ``decode_layers_in`` (one call and one parallel region per token instead of two calls, two
    regions and about 15 memoryview acquisitions per layer: session 13 measured 5-7 us of fixed
    cost per half-layer call with nothing kept). Holds references to every array it points into.

    layers: one tuple per layer (attn_norm (n_embd,) f32, attn_qkv_t raw, type, attn_output_t raw,
    type, ffn_norm (n_embd,) f32, ffn_gate_up_t raw, type, ffn_down_t raw, type, scale_qkv,
    scale_o, scale_gu, scale_d (f32 or None), bqkv (f32 [bq; bk; bv] or None), q_norm, k_norm
    ((head_dim,) f32 or None, both or neither)), the arguments of decode_attn_in / decode_ffn_in; rope_div (hd/2,) f32 or None: the rope's frequency
    divisors (decode_attn_in's). ValueError on shapes that do not fit (the checks of those two
    functions)."""
    cdef readonly int n_layer, n_embd, n_head, n_kv, hd, n_ff
    cdef float eps
    cdef double freq_base
    cdef const float *div
    cdef int silu
    cdef const uint8_t **w
    cdef size_t *stride
    cdef int *qtype
    cdef const float **vec
    cdef Py_ssize_t nt_qkv, nt_o, nt_gu, nt_d
    cdef list _keep
    cdef HeadArgs head  # the lm head (set_head; raw NULL: none), its thr set per call
    cdef tuple _keep_head

    def __cinit__(self, list layers, int n_head, int n_kv, int hd, float eps, double freq_base,
                  int silu, const float[::1] rope_div=None):
        cdef int n = len(layers), i, k
        cdef const uint8_t[:, ::1] wv
        cdef const float[::1] fv
        self.w = NULL
        self.stride = NULL
        self.qtype = NULL
        self.vec = NULL
        self.head.raw = NULL
        _check_plan_heads(n, n_head, n_kv, hd, "InputDecodePlan")
        self.n_layer, self.n_head, self.n_kv, self.hd = n, n_head, n_kv, hd
        self.eps, self.freq_base, self.silu = eps, freq_base, silu
        self._keep = [list(layers), rope_div]
        self.div = _opt_ptr(rope_div, hd // 2, "InputDecodePlan rope_div")
        self.w = <const uint8_t **> malloc(4 * n * sizeof(uint8_t *))
        self.stride = <size_t *> malloc(4 * n * sizeof(size_t))
        self.qtype = <int *> malloc(4 * n * sizeof(int))
        self.vec = <const float **> malloc(PLAN_VECS * n * sizeof(float *))
        if not (self.w and self.stride and self.qtype and self.vec):
            raise MemoryError()
        cdef Py_ssize_t nq = n_head * hd, nkv = n_kv * hd, n_embd = -1, n_ff = -1, nf
        self.nt_qkv = self.nt_o = self.nt_gu = self.nt_d = 0
        for i in range(n):
            lt = layers[i]
            if len(lt) != 17:
                raise ValueError("InputDecodePlan: each layer needs 17 entries")
            for k in range(4):  # qkv, o, gate_up, down
                wv = lt[(1, 3, 6, 8)[k]]
                self.w[4 * i + k] = &wv[0, 0]
                self.stride[4 * i + k] = wv.shape[1]
                self.qtype[4 * i + k] = int(lt[(2, 4, 7, 9)[k]])
            fv = lt[0]
            if n_embd < 0:
                n_embd = fv.shape[0]
            _check_len(fv.shape[0], n_embd, "InputDecodePlan attn_norm")
            self.vec[PLAN_VECS * i] = &fv[0]
            fv = lt[5]
            _check_len(fv.shape[0], n_embd, "InputDecodePlan ffn_norm")
            self.vec[PLAN_VECS * i + 1] = &fv[0]
            _check_attn_in(lt[1], self.qtype[4 * i], lt[3], self.qtype[4 * i + 1], n_embd, nq,
                           nkv, "InputDecodePlan")
            nf = _check_ffn_in(lt[6], self.qtype[4 * i + 2], lt[8], self.qtype[4 * i + 3], n_embd,
                               "InputDecodePlan")
            if n_ff < 0:
                n_ff = nf
            _check_len(nf, n_ff, "InputDecodePlan down rows")
            self.vec[PLAN_VECS * i + 2] = _opt_ptr(lt[10], n_embd, "InputDecodePlan scale_qkv")
            self.vec[PLAN_VECS * i + 3] = _opt_ptr(lt[11], nq, "InputDecodePlan scale_o")
            self.vec[PLAN_VECS * i + 4] = _opt_ptr(lt[12], n_embd, "InputDecodePlan scale_gu")
            self.vec[PLAN_VECS * i + 5] = _opt_ptr(lt[13], n_ff, "InputDecodePlan scale_d")
            self.vec[PLAN_VECS * i + 6] = _opt_ptr(lt[14], nq + 2 * nkv, "InputDecodePlan bqkv")
            self.vec[PLAN_VECS * i + 7] = _opt_ptr(lt[15], hd, "InputDecodePlan q_norm")
            self.vec[PLAN_VECS * i + 8] = _opt_ptr(lt[16], hd, "InputDecodePlan k_norm")
            if (self.vec[PLAN_VECS * i + 7] == NULL) != (self.vec[PLAN_VECS * i + 8] == NULL):
                raise ValueError("InputDecodePlan: q_norm and k_norm go together")
            self.nt_qkv = max(self.nt_qkv, pi_axpy_tmp_floats(n_embd, <int> (nq + 2 * nkv),
                                                              self.stride[4 * i]))
            self.nt_o = max(self.nt_o, pi_axpy_tmp_floats(nq, <int> n_embd, self.stride[4 * i + 1]))
            self.nt_gu = max(self.nt_gu, pi_axpy_tmp_floats(n_embd, <int> (2 * n_ff),
                                                            self.stride[4 * i + 2]))
            self.nt_d = max(self.nt_d, pi_axpy_tmp_floats(n_ff, <int> n_embd,
                                                          self.stride[4 * i + 3]))
        self.n_embd, self.n_ff = <int> n_embd, <int> n_ff

    def set_head(self, const float[::1] norm, const uint8_t[::1] raw, int qtype, int n_out,
                 int chunk, const float[::1] scale):
        """The lm head for decode_layers_in's logits: norm (n_embd,) f32 the output norm's
        weight; raw the chunked input-block matrix (pyinfer.ops.cpu.IBChunks: n_out outputs in
        chunks of ``chunk``, as ib_chunks_axpy takes it); scale (n_embd,) f32 or None, the
        channel scores' factor. ValueError on shapes that do not fit."""
        cdef int n_embd = self.n_embd
        if (not pi_is_ib(qtype) or n_embd % 32 or n_out <= 0 or n_out % PI_IB_TILE or chunk <= 0
                or chunk % PI_IB_TILE):
            raise ValueError(f"InputDecodePlan.set_head: no chunked input-block matrix ({n_out}, "
                             f"{n_embd}) in chunks of {chunk}")
        _check_len(norm.shape[0], n_embd, "InputDecodePlan.set_head norm")
        _check_len(raw.shape[0], <Py_ssize_t> ((n_embd // 32) * pi_ib_block_bytes(qtype, n_out)),
                   "InputDecodePlan.set_head raw")
        self.head.scale = _opt_ptr(scale, n_embd, "InputDecodePlan.set_head scale")
        self.head.norm = &norm[0]
        self.head.raw = &raw[0]
        self.head.qtype, self.head.n_out, self.head.chunk = qtype, n_out, chunk
        self._keep_head = (norm, raw, scale)

    def __dealloc__(self):
        free(self.w)
        free(self.stride)
        free(self.qtype)
        free(self.vec)


cdef void _layers_in_team(int t, int T, int first, int L, float *x, uint16_t *kc, uint16_t *vc, int f16,
                          Py_ssize_t layer_rows, int n_past, const float *thr,
                          const uint8_t **w, size_t *st, int *qt, const float **vec, float eps,
                          int n_embd, int n_head, int n_kv, int hd, Py_ssize_t n_ff, double fb,
                          int silu, AttnBufs *a, FfnBufs *f, long *cnt, float *priv,
                          Py_ssize_t n_priv, Py_ssize_t *cts, const HeadArgs *hd_,
                          float *logits, const float *div) noexcept nogil:
    """Thread t of T's share of decode_layers_in: layers first .. L - 1, each _attn_in_team then
    _ffn_in_team with a barrier after each (x complete before every thread norms it); then, with
    logits not NULL, the lm head of plan.set_head: every thread the output norm and the kept list
    of its own (as the half-layers do), its half tiles of each chunk (ib_chunks_axpy's split, no
    barrier), into logits (hd_.n_out,). thr (4, L) row-major; cts: 4 counts a layer, then the head's. t = 0, T = 1 runs
    serially (rowsum_team.h's conventions)."""
    cdef int l
    cdef Py_ssize_t rs = n_kv * hd, n
    cdef float *h
    cdef float *cin
    cdef int32_t *iin
    # the rope's table once per token (every layer turns by the same angles; layer first's
    # barrier after its q/k/v sums comes before any rope reads it)
    _rope_table_share(t, T, n_past, fb, hd, a.cs, div)
    for l in range(first, L):
        _attn_in_team(t, T, x, vec[PLAN_VECS * l], eps, n_embd, w[4 * l], st[4 * l], qt[4 * l],
                      w[4 * l + 1], st[4 * l + 1], qt[4 * l + 1], kc + l * layer_rows * _kv_width(f16),
                      vc + l * layer_rows * _kv_width(f16), f16, rs, n_past, n_head, n_kv, hd, fb, vec[PLAN_VECS * l + 2],
                      thr[l], vec[PLAN_VECS * l + 3], thr[L + l], a.qkv, a.att, a.cs, a.sc, a.tmp_qkv,
                      a.tmp_o, a.y, priv, n_priv, cts + 4 * l, vec[PLAN_VECS * l + 6], div, 1,
                      vec[PLAN_VECS * l + 7], vec[PLAN_VECS * l + 8])
        pi_team_barrier()
        _ffn_in_team(t, T, x, vec[PLAN_VECS * l + 1], eps, n_embd, w[4 * l + 2], st[4 * l + 2],
                     qt[4 * l + 2], w[4 * l + 3], st[4 * l + 3], qt[4 * l + 3], n_ff,
                     vec[PLAN_VECS * l + 4], thr[2 * L + l], vec[PLAN_VECS * l + 5], thr[3 * L + l], silu, f.gu,
                     f.y, f.ctmp, f.itmp, f.tmp_gu, f.tmp_d, cnt, priv, n_priv, cts + 4 * l + 2)
        pi_team_barrier()
    if logits == NULL:
        return
    h = priv + t * n_priv
    cin = h + n_embd
    iin = <int32_t *> (cin + n_embd)
    _rmsnorm1(x, hd_.norm, eps, h, n_embd)
    n = _select_inputs(h, hd_.scale, hd_.thr, n_embd, cin, iin)
    _ib_chunks_team(t, T, hd_.qtype, hd_.raw, n_embd, hd_.n_out, hd_.chunk, cin, iin, n, logits)
    if t == 0:
        cts[4 * L] = n


def decode_layers_in(InputDecodePlan plan not None, float[::1] x,
                     uint16_t[:, :, :, ::1] k_cache, uint16_t[:, :, :, ::1] v_cache, int kv_f16,
                     int n_past, const float[:, ::1] thr, int64_t[:, ::1] counts, int first, int n_threads, float[::1] logits=None,
                     float head_thr=-1.0):
    """Layers first .. n_layer - 1 of one token with input sparsity, in place on x (n_embd,) f32:
    per layer decode_attn_in then decode_ffn_in (the same team functions, so the same bits), in
    ONE parallel region with a barrier after each half-layer. k_cache, v_cache (n_layer, n_ctx,
    n_head_kv, head_dim) as ``decode_attn`` takes them (uint16: f16 values with kv_f16, else f32,
    the last axis 2 head_dim), row n_past of each layer written; thr (4, n_layer) f32: the
    thresholds of attn_qkv, attn_output, ffn_gate_up, ffn_down; counts (n_layer, 4) int64 or
    None: the rows each projection read (as the two calls return them; rows before `first`
    untouched). logits (n_vocab,) f32 or None: with the plan's set_head, the same region then
    writes the lm head's logits of the output-normed x, channels of score <= head_thr skipped
    (the bits of rmsnorm, select_inputs and ib_chunks_axpy). Returns (qkv, output, gate_up, down,
    head) rows read, the first four summed over the layers, head -1 without logits. ValueError
    on shapes that do not fit."""
    cdef int L = plan.n_layer, n_embd = plan.n_embd, n_head = plan.n_head, n_kv = plan.n_kv
    cdef int hd = plan.hd, T = max(n_threads, 1), l, t
    cdef Py_ssize_t n_ff = plan.n_ff, nq = n_head * hd, nkv = n_kv * hd, rs = nkv
    _check_len(x.shape[0], n_embd, "decode_layers_in x")
    _check_plan_caches(k_cache, v_cache, kv_f16, n_past, L, n_kv, hd, "decode_layers_in")
    if (thr.shape[0] != 4 or thr.shape[1] != L
            or (counts is not None and (counts.shape[0] != L or counts.shape[1] != 4))):
        raise ValueError("decode_layers_in: thr must be (4, n_layer), counts (n_layer, 4)")
    if first < 0 or first > L:
        raise ValueError(f"decode_layers_in: first layer {first} outside 0..{L}")
    cdef HeadArgs ha
    cdef float *lp = NULL
    if logits is not None:
        if plan.head.raw == NULL:
            raise ValueError("decode_layers_in: logits asked of a plan without set_head")
        _check_len(logits.shape[0], plan.head.n_out, "decode_layers_in logits")
        lp = &logits[0]
        ha = plan.head
        ha.thr = head_thr
    cdef Py_ssize_t n_att = n_past + 1, layer_rows = k_cache.shape[1] * rs
    cdef Py_ssize_t n_priv = (max(2 * nq + 3 * n_embd, 3 * n_embd + 2 * n_ff) + 15) // 16 * 16
    cdef AttnBufs a
    cdef FfnBufs f
    cdef Py_ssize_t n_abuf = _attn_bufs(NULL, &a, n_embd, nq, nkv, hd, n_head, n_att,
                                        plan.nt_qkv, plan.nt_o)
    cdef float *buf
    cdef float *priv
    cdef long *cnt
    cdef Py_ssize_t *cts
    cdef Py_ssize_t sums[5]
    cdef uint16_t *kc = &k_cache[0, 0, 0, 0]
    cdef uint16_t *vc = &v_cache[0, 0, 0, 0]
    cdef const uint8_t **w = plan.w
    cdef size_t *st = plan.stride
    cdef int *qt = plan.qtype
    cdef const float **vec = plan.vec
    cdef float eps = plan.eps
    cdef double fb = plan.freq_base
    cdef int silu = plan.silu
    cdef int has_counts = counts is not None
    with nogil:
        buf = <float *> malloc((n_abuf + _ffn_bufs(NULL, &f, n_embd, n_ff, plan.nt_gu, plan.nt_d)
                                + 1) * sizeof(float))
        _attn_bufs(buf, &a, n_embd, nq, nkv, hd, n_head, n_att, plan.nt_qkv, plan.nt_o)
        _ffn_bufs(buf + n_abuf, &f, n_embd, n_ff, plan.nt_gu, plan.nt_d)
        priv = <float *> aligned_alloc(64, T * n_priv * sizeof(float))
        cnt = <long *> malloc(T * sizeof(long))
        cts = <Py_ssize_t *> malloc((4 * L + 1) * sizeof(Py_ssize_t))
        cts[4 * L] = -1
        if T == 1:
            _layers_in_team(0, 1, first, L, &x[0], kc, vc, kv_f16, layer_rows, n_past, &thr[0, 0], w, st,
                            qt, vec, eps, n_embd, n_head, n_kv, hd, n_ff, fb, silu, &a, &f, cnt,
                            priv, n_priv, cts, &ha, lp, plan.div)
        else:
            with parallel(num_threads=T):
                _layers_in_team(pi_team_thread(), pi_team_size(), first, L, &x[0], kc, vc, kv_f16,
                                layer_rows, n_past, &thr[0, 0], w, st, qt, vec, eps, n_embd,
                                n_head, n_kv, hd, n_ff, fb, silu, &a, &f, cnt, priv, n_priv, cts,
                                &ha, lp, plan.div)
        for t in range(4):
            sums[t] = 0
        for l in range(first, L):
            for t in range(4):
                sums[t] += cts[4 * l + t]
                if has_counts:
                    counts[l, t] = cts[4 * l + t]
        sums[4] = cts[4 * L]
        free(buf)
        free(priv)
        free(cnt)
        free(cts)
    return sums[0], sums[1], sums[2], sums[3], sums[4]


# ---------------------------------------------------------------- the CPU's part of a split layer

cdef void _cold_team(int t, int T, const uint8_t *wg, int tg, Py_ssize_t sg, const uint8_t *wu,
                     int tu, Py_ssize_t su, const uint8_t *wd, int td, Py_ssize_t sd_, int cols,
                     const float *xd, const int8_t *xq, const int32_t *cand, Py_ssize_t n_cand,
                     int silu, int glu, float thr, Py_ssize_t pd, float *gv, float *uv,
                     float *coef, int32_t *idx, Py_ssize_t *nk, float *tmp,
                     float *out) noexcept nogil:
    """Thread t of T's share of cold_ffn for types of pi_gemv8 in one parallel region (every
    thread calls it with the same arguments; rowsum_team.h's conventions): the candidates' gate
    (and, "glu", up) dots eight rows per pass, groups cut by T; thread 0 selects and compacts in
    neuron order; the kept neurons' up rows (not "glu"); the down rows' sum (rowsum_team.h: split
    by the row count and length alone). Each dot and the sum are the ones one thread computes,
    so the result has the same bits at any T. nk: the kept count, shared."""
    cdef Py_ssize_t ng = (n_cand + 7) // 8, j, j1, k = 0, r
    cdef float a
    cdef int nb = cols // 32
    for j in range(t * ng // T, (t + 1) * ng // T):
        pi_gemv8(tg, wg, sg, cand, j, n_cand, xd, xq, nb, gv, pd)
        if glu:
            pi_gemv8(tu, wu, su, cand, j, n_cand, xd, xq, nb, uv, pd)
    pi_team_barrier()
    if t == 0:  # selection and compaction in neuron order: the sum's row order
        for j in range(n_cand):
            a = pi_act1(gv[j], silu)
            if glu:
                a = a * uv[j]
            coef[k] = a
            idx[k] = cand[j]
            k += <int> (not (fabsf(a) <= thr))  # branch-free, as decode_ffn
        nk[0] = k
    pi_team_barrier()
    k = nk[0]
    if not glu and k > 0:  # the kept neurons' up rows, eight per pass
        ng = (k + 7) // 8
        for j in range(t * ng // T, (t + 1) * ng // T):
            pi_gemv8(tu, wu, su, idx, j, k, xd, xq, nb, uv, pd)
            j1 = min(8 * j + 8, k)
            for r in range(8 * j, j1):
                coef[r] = coef[r] * uv[r]
        pi_team_barrier()
    if pi_axpy_rows_threads(td, idx, sd_, k, cols) > 1:
        pi_axpy_rows_team(t, T, td, wd, sd_, coef, idx, k, out, cols, tmp, NULL)
    elif t == 0:  # a sum too short to split (as pi_axpy_rows_par: no barrier inside)
        pi_axpy_rows_team(0, 1, td, wd, sd_, coef, idx, k, out, cols, tmp, NULL)


def cold_ffn(const uint8_t[:, ::1] wg, int tg, const uint8_t[:, ::1] wu, int tu,
             const uint8_t[:, ::1] wd, int td, const float[::1] h, const int32_t[::1] ids,
             const uint8_t[::1] mask, int silu, int glu, float thr, float[::1] out,
             int n_threads):
    """One token's FFN over the neurons ``ids`` (sorted int32, e.g. a hybrid layer's cold
    neurons) that ``mask`` ((n_ff,) uint8, or None: all) marks as candidates, under SparseFFN's
    rule: "glu" keeps |act(gate h) * up h| > thr, otherwise |act(gate h)| > thr (up rows read
    only for those kept). out (n_embd,) f32 = their down projection over ffn_down_t rows.
    Returns (n_candidates, n_kept). Same dots, selection and row-ordered AXPY as
    ``pyinfer.ffn.sparse_step`` on ids[mask[ids] != 0] (equal results), in one parallel region
    (``_cold_team``, for the types of pi_gemv8; was three, and sparse_step's three plus NumPy
    temporaries before that), the up rows prefetched with the gate rows: the hybrid GPU engine
    calls this once per layer and token while the GPU works on the hot neurons, so fixed costs
    per call matter (issue 10)."""
    cdef int cols = h.shape[0]
    _check_w(wg, tg, cols)
    _check_w(wu, tu, cols)
    _check_w(wd, td, cols)
    _check_len(out.shape[0], cols, "cold_ffn out")
    _check_len(wu.shape[0], wg.shape[0], "cold_ffn up rows")
    _check_len(wd.shape[0], wg.shape[0], "cold_ffn down rows")
    _check_idx(ids, wg.shape[0])
    cdef int has_mask = mask is not None
    if has_mask:
        _check_len(mask.shape[0], wg.shape[0], "cold_ffn mask")
    cdef Py_ssize_t n = ids.shape[0], j, k = 0, n_cand = 0, sg = wg.shape[1], su = wu.shape[1]
    cdef Py_ssize_t pd = pi_prefetch_dist(sg)
    cdef float *coef
    cdef int32_t *idx
    cdef int32_t *cand
    cdef uint8_t *kept
    cdef float *xd = NULL
    cdef int8_t *xq = NULL
    cdef float g, a
    cdef int32_t r
    cdef float *gv
    cdef float *uv
    cdef int g8 = pi_gemv8_supported(tg) and pi_gemv8_supported(tu)
    cdef Py_ssize_t sd_ = wd.shape[1]
    cdef const uint8_t *pg = &wg[0, 0] if wg.shape[0] > 0 else NULL
    cdef const uint8_t *pu = &wu[0, 0] if wu.shape[0] > 0 else NULL
    cdef const uint8_t *pw = &wd[0, 0] if wd.shape[0] > 0 else NULL
    cdef float *tmp
    cdef int T
    with nogil:
        coef = <float *> malloc((n + 1) * sizeof(float))
        idx = <int32_t *> malloc((n + 1) * sizeof(int32_t))
        cand = <int32_t *> malloc((n + 1) * sizeof(int32_t))
        kept = <uint8_t *> malloc(n + 1)
        gv = <float *> malloc((n + 1) * sizeof(float))
        uv = <float *> malloc((n + 1) * sizeof(float))
        if has_mask:  # the candidates, in neuron order (branch-free: the mask is random)
            for j in range(n):
                r = ids[j]
                cand[n_cand] = r
                n_cand += mask[r] != 0
        else:
            memcpy(cand, &ids[0], n * sizeof(int32_t))
            n_cand = n
        if pi_is_quant(tg) or pi_is_quant(tu):  # h quantized once, as gather_matvec does
            _quantize_x(&h[0], cols, &xd, &xq)
        # rows come from memory, not cache (the cold rows of 32 layers outgrow L3): prefetch
        # the gate and up rows pd candidates ahead, as gather_matvec does. Every neuron's result
        # depends on nothing else, so the thread count cannot change it.
        if g8:  # eight rows per pass (gemv.h; the same bits as pi_dot_row), one region
            tmp = <float *> malloc((pi_axpy_tmp_floats(n_cand, cols, sd_) + 1) * sizeof(float))
            T = min(n_threads, max(1, <int> ((n_cand + 7) // 8)))
            if T <= 1 or n_cand == 0:
                _cold_team(0, 1, pg, tg, sg, pu, tu, su, pw, td, sd_, cols, xd, xq,
                           cand, n_cand, silu, glu, thr, pd, gv, uv, coef, idx, &k, tmp, &out[0])
            else:
                with parallel(num_threads=T):
                    _cold_team(pi_team_thread(), pi_team_size(), pg, tg, sg, pu, tu, su, pw, td, sd_, cols, xd, xq, cand, n_cand, silu, glu, thr, pd,
                               gv, uv, coef, idx, &k, tmp, &out[0])
            free(tmp)
        else:
            for j in prange(n_cand, schedule='static', num_threads=n_threads):
                if j + pd < n_cand:
                    pi_prefetch_l2(pg + cand[j + pd] * sg, sg)
                    pi_prefetch_l2(pu + cand[j + pd] * su, su)
                r = cand[j]
                g = pi_dot_row(tg, pg + r * sg, &h[0], xd, xq, cols)
                a = pi_act1(g, silu)
                kept[j] = 0
                if glu:
                    a = a * pi_dot_row(tu, pu + r * su, &h[0], xd, xq, cols)
                    if not (fabsf(a) <= thr):  # NaN kept
                        kept[j] = 1
                elif not (fabsf(a) <= thr):
                    kept[j] = 1
                    a = a * pi_dot_row(tu, pu + r * su, &h[0], xd, xq, cols)
                coef[j] = a
            for j in range(n_cand):  # compaction in neuron order: the AXPY's row order
                if kept[j]:
                    coef[k] = coef[j]
                    idx[k] = cand[j]
                    k += 1
            _axpy_rows(pw, sd_, td, cols, coef, idx, k, &out[0], n_threads)
        free(coef)
        free(idx)
        free(cand)
        free(kept)
        free(gv)
        free(uv)
        free(xd)
        free(xq)
    return n_cand, k


# ---------------------------------------------------------------- input sparsity, a batch (prefill)
def mask_inputs(const float[:, ::1] x, const float[::1] scale, float thr, float[:, ::1] out,
                int n_threads):
    """Input sparsity's mask over a batch: out (n_tok, n) f32 = x (n_tok, n) with channel j of a
    row set to 0 where |x_j| * scale_j <= thr (scale None: 1; thr < 0 keeps all), the channels
    ``select_inputs`` drops for that row. Rows in parallel. Returns the kept count (all rows)."""
    cdef Py_ssize_t T = x.shape[0], n = x.shape[1]
    if out.shape[0] != T or out.shape[1] != n:
        raise ValueError(f"mask_inputs: out {tuple(out.shape)[:2]} is not x's ({T}, {n})")
    cdef const float *sp = _opt_ptr(scale, n, "mask_inputs scale")
    cdef long long kept = 0
    if T == 0 or n == 0:
        return 0
    with nogil:
        kept = _mask_rows(&x[0, 0], n, 0, 0, sp, thr, T, n, &out[0, 0], n_threads)
    return kept


cdef long long _mask_rows(const float *x, Py_ssize_t ldx, int glu, int silu, const float *sp,
                          float thr, Py_ssize_t T, Py_ssize_t n, float *out,
                          int n_threads) noexcept nogil:
    """T rows (x ldx floats apart, out n apart) of _mask_row in parallel; the kept count."""
    cdef long long kept = 0
    cdef Py_ssize_t t
    for t in prange(T, schedule='static', num_threads=n_threads):
        kept += _mask_row(x + t * ldx, glu, silu, sp, thr, n, out + t * n)
    return kept


cdef inline long _mask_row(const float *x, int glu, int silu, const float *sp, float thr,
                           Py_ssize_t n, float *out) noexcept nogil:
    """One row of mask_inputs (glu 0: x (n,)) or of glu_mask (glu 1: x = [g | u] (2 n,));
    returns its kept count. The activations first (pi_act_values, decode's bits), then a
    branch-free mask."""
    cdef Py_ssize_t j
    cdef long k = 0
    cdef float s, v
    cdef bint keep
    if glu:
        pi_act_values(x, n, 0, n, silu, out)
        x = out
    for j in range(n):
        v = x[j]
        s = fabsf(v)
        if sp != NULL:
            s = s * sp[j]
        keep = not (s <= thr)  # NaN kept
        out[j] = v if keep else 0.0
        k += keep
    return k


def glu_mask(const float[:, ::1] gu, int silu, const float[::1] scale, float thr,
             float[:, ::1] out, int n_threads):
    """The GLU product of a batch and its input-sparsity mask in one pass: with gu = [g | u]
    (n_tok, 2 n_ff) f32, a = act(g) * u (act: SiLU g / (1 + exp(-g)) if silu else ReLU, as
    decode's ``decode_ffn_in`` computes it, pi_act_values), out (n_tok, n_ff) = a with a_j set to 0
    where |a_j| * scale_j <= thr (``mask_inputs``). Rows in parallel. Returns the kept count."""
    cdef Py_ssize_t T = gu.shape[0], n = out.shape[1]
    if gu.shape[1] != 2 * n or out.shape[0] != T:
        raise ValueError(f"glu_mask: gu {tuple(gu.shape)[:2]} and out {tuple(out.shape)[:2]} "
                         "are not (n_tok, 2 n_ff) and (n_tok, n_ff)")
    cdef const float *sp = _opt_ptr(scale, n, "glu_mask scale")
    cdef long long kept = 0
    if T == 0 or n == 0:
        return 0
    with nogil:
        kept = _mask_rows(&gu[0, 0], 2 * n, 1, silu, sp, thr, T, n, &out[0, 0], n_threads)
    return kept


cdef void _ib_chunks_team(int t, int T, int qtype, const uint8_t *raw, int n_in, int n_out,
                          int chunk, const float *coef, const int32_t *idx, Py_ssize_t n,
                          float *out) noexcept nogil:
    """Thread t of T's share of out (n_out,) = sum_k coef[k] W[:, idx[k]] over a chunked
    input-block matrix (ib_chunks_axpy): its half tiles of each chunk in turn
    (pi_axpy_rows_team, no barrier: the chunks' outputs are disjoint)."""
    cdef int c0 = 0, cols
    while c0 < n_out:
        cols = n_out - c0 if n_out - c0 < chunk else chunk
        pi_axpy_rows_team(t, T, qtype, raw + (n_in // 32) * pi_ib_block_bytes(qtype, c0),
                          pi_ib_block_bytes(qtype, cols), coef, idx, n, out + c0, cols, NULL,
                          NULL)
        c0 = c0 + chunk


def ib_chunks_axpy(const uint8_t[::1] raw, int qtype, int n_in, int n_out, int chunk,
                   const float[::1] coef, const int32_t[::1] idx, float[::1] out, int n_threads):
    """``axpy_rows`` over a chunked input-block matrix (pyinfer.ops.cpu.IBChunks: W (n_out, n_in)
    as chunks of ``chunk`` outputs, the last the rest, each chunk's input-block layout after the
    other in ``raw``) in one parallel region: every thread takes its half tiles of each chunk in
    turn (pi_axpy_rows_team, no barrier: the chunks' outputs are disjoint). out (n_out,) f32 is
    overwritten; idx strictly ascending channels < n_in. The bits of ``axpy_rows`` per chunk."""
    if not pi_is_ib(qtype) or n_in % 32 or n_out % PI_IB_TILE or chunk <= 0 or chunk % PI_IB_TILE:
        raise ValueError(f"ib_chunks_axpy: no chunked input-block matrix ({n_out}, {n_in}) in "
                         f"chunks of {chunk}")
    _check_len(raw.shape[0], <Py_ssize_t> ((n_in // 32) * pi_ib_block_bytes(qtype, n_out)),
               "ib_chunks_axpy raw")
    _check_len(coef.shape[0], idx.shape[0], "ib_chunks_axpy coef")
    _check_len(out.shape[0], n_out, "ib_chunks_axpy out")
    _check_idx(idx, n_in)
    _check_ascending(idx, "ib_chunks_axpy")
    cdef Py_ssize_t n = idx.shape[0]
    cdef const float *cp = &coef[0] if n > 0 else NULL
    cdef const int32_t *ip = &idx[0] if n > 0 else NULL
    cdef const uint8_t *base = &raw[0]
    with nogil, parallel(num_threads=n_threads):
        _ib_chunks_team(pi_team_thread(), pi_team_size(), qtype, base, n_in, n_out, chunk, cp, ip,
                        n, &out[0])


cdef extern from "topk.h" nogil:
    Py_ssize_t pi_topk_heap(const float *x, Py_ssize_t n, Py_ssize_t k, int32_t *out, float *hv,
                            int32_t *hi)
    Py_ssize_t pi_topk(const float *x, Py_ssize_t n, Py_ssize_t k, int32_t *out, Py_ssize_t G,
                       float *gm, float *hv, int32_t *hi, int32_t *cand)
    int PI_TOPK_CAND_MULT


def topk_indices(const float[::1] x, int k, int32_t[::1] out):
    """The indices of the k largest values of x, ascending, into out[:m]; returns m = min(k,
    number of non-NaN values). Ties at the boundary keep the lower index, NaNs are never taken,
    so the set is a function of x alone (cython/topk.h: a bound from the maxima of 4k
    interleaved groups (at least 1,024), one vectorized pass listing the values over it, a
    min-heap of k over that list; the heap over all of x where the bound does not help).
    SmolLM2's logits, k = 256: 88 -> 23 us (docs/benchmarks.md, session 23)."""
    cdef Py_ssize_t n = x.shape[0], m = -1, G
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if out.shape[0] < min(k, n):
        raise ValueError(f"topk_indices: out holds {out.shape[0]} indices, needs {min(k, n)}")
    if k == 0 or n == 0:
        return 0
    G = max(1024, 4 * <Py_ssize_t> k)
    G = (G + 15) // 16 * 16
    cdef float *hv = <float *> malloc(k * sizeof(float))
    cdef int32_t *hi = <int32_t *> malloc(k * sizeof(int32_t))
    cdef float *gm = <float *> malloc(G * sizeof(float))
    cdef int32_t *cand = <int32_t *> malloc(PI_TOPK_CAND_MULT * k * sizeof(int32_t))
    if hv == NULL or hi == NULL or gm == NULL or cand == NULL:
        free(hv)
        free(hi)
        free(gm)
        free(cand)
        raise MemoryError()
    with nogil:
        m = pi_topk(&x[0], n, k, &out[0], G, gm, hv, hi, cand)
        if m < 0:
            m = pi_topk_heap(&x[0], n, k, &out[0], hv, hi)
    free(hv)
    free(hi)
    free(gm)
    free(cand)
    return m


def dry_match(const int32_t[::1] hist, const uint8_t[::1] is_breaker, int32_t[::1] best,
              int32_t[::1] toks):
    """DRY's match lengths (``pyinfer.sampler.dry_match_lengths``, its pure-Python reference)
    over ``hist`` (L,) int32: for each token t that would continue a repetition of the history's
    end, best[t] = the longest such run (the Z-function of the reversed history, Gusfield;
    matching never crosses a sequence breaker and a breaker is never listed). ``is_breaker``
    (n_vocab,) uint8; ``best`` (n_vocab,) int32 all zero on entry (the caller zeroes the
    entries it read); ``toks`` (>= L,) int32 receives the listed tokens. Returns their count.
    The Python reference took 1.35 ms on a 4,096-token history, this 0.12 ms with its caller's
    conversions (docs/benchmarks.md, session 40). ValueError for a ``best`` or ``is_breaker``
    shorter than the vocabulary the history's ids need."""
    cdef Py_ssize_t L = hist.shape[0], nv = best.shape[0], nb = is_breaker.shape[0]
    cdef Py_ssize_t j, k, left = 0, right = 0, tail = 0, m = 0
    cdef int32_t t, n
    if toks.shape[0] < L:
        raise ValueError(f"dry_match: toks holds {toks.shape[0]}, needs {L}")
    if is_breaker.shape[0] != best.shape[0]:
        raise ValueError(f"dry_match: is_breaker ({is_breaker.shape[0]}) and best "
                         f"({best.shape[0]}) must both be the vocabulary's size")
    if L < 2:
        return 0
    t = hist[L - 1]
    if 0 <= t < nb and is_breaker[t]:
        return 0
    cdef int32_t *z = <int32_t *> calloc(L, sizeof(int32_t))
    if z == NULL:
        raise MemoryError()
    with nogil:
        while tail < L:
            t = hist[L - 1 - tail]
            if 0 <= t < nb and is_breaker[t]:
                break
            tail += 1
        # r[k] = hist[L-1-k]: z[j] = longest common prefix of r and r[j:]
        for j in range(1, L):
            if j < right:
                z[j] = min(right - j, z[j - left])
            while j + z[j] < L and hist[L - 1 - z[j]] == hist[L - 1 - j - z[j]]:
                z[j] += 1
            if j + z[j] > right:
                left = j
                right = j + z[j]
        for j in range(1, L):  # the token after position L-1-j is r[j-1] = hist[L-j]
            n = <int32_t> min(<Py_ssize_t> z[j], tail)
            t = hist[L - j]
            if n <= 0 or t < 0 or t >= nv or (t < nb and is_breaker[t]):
                continue
            if n > best[t]:
                if best[t] == 0:
                    toks[m] = t
                    m += 1
                best[t] = n
    free(z)
    return m
