/* Row sums over transposed matrices with the parallel region written out (issue 12, session 9):
 *
 *     out[0:cols] = sum_k coef[k] * W[idx ? idx[k] : k, 0:cols]
 *
 * the work of kernels.pyx's _axpy_rows and of the fused input-sparse half-layers (decode_ffn_in,
 * decode_attn_in), each in ONE parallel region with only the barriers the data needs. Cython emits a prange inside a parallel block as "omp for nowait" whose loop index
 * is firstprivate and lastprivate, and GCC puts a barrier before each such loop: on the 2-core
 * box a barrier costs about 1 us, and a region of four pranges plus the barriers the data needs
 * had about seven per call, more than the work they split on SmolLM2's short sums.
 *
 * Determinism (issue 9): the sum is cut into chunks by n and the row length alone
 * (pi_axpy_nchunks, pi_axpy_bound), each chunk summed in row order into its own accumulator, and
 * every column adds the chunks' partial sums in chunk order, so the result has the same bits at
 * any thread count; which thread sums which chunk, or adds which columns, does not matter. Long rows of the integer sums
 * (axpyq.h) are split by columns instead (each column's sum runs over every row in the same
 * groups, whatever the split). The activation's kept list is compacted in index order whatever
 * the split of its parts.
 *
 * Included by kernels.pyx after simd.h. Every function named *_team must be called by every
 * thread of the team with the same arguments (it contains barriers); with t = 0, T = 1 it runs
 * serially outside any region.
 */
#ifndef PYINFER_ROWSUM_TEAM_H
#define PYINFER_ROWSUM_TEAM_H

#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#define PI_BARRIER() _Pragma("omp barrier")
#else
#define PI_BARRIER() ((void)0)
#endif

/* the row sums are cut into 24, 12, 6, 4, 2 or 1 chunks of at least PI_AXPY_MIN_ROWS rows, by the
 * number of rows alone: 24 splits evenly over 1, 2, 3, 4, 6, 8 and 12 threads, and fewer chunks
 * on fewer rows save adding their partial sums (session 8: 128-row chunks took 20-40% off
 * SmolLM2's q/k/v and down sums on two threads against 32-row ones). */
#define PI_AXPY_CHUNKS 24
#define PI_AXPY_MIN_ROWS 128
/* rows of at least PI_AXPY_LONG_ROW_BYTES (a 7B model's 8 KiB f16 ffn_down_t rows; every
 * SmolLM2 row is shorter) are cut into chunks of PI_AXPY_MIN_CHUNK_BYTES, at least PI_AXPY_ALIGN
 * rows: with 128-row chunks the few hundred cold rows a hybrid GPU layer leaves the host were
 * summed by two of 16 threads (issue 10, session 10: the 7B f16 cold neurons took 2.6x longer
 * than in session 4) */
#define PI_AXPY_LONG_ROW_BYTES 4096
#define PI_AXPY_MIN_CHUNK_BYTES 131072
/* chunk boundaries fall on multiples of 16 rows: the integer kernel (axpyq.h) sums rows in groups
 * of 16 and a chunk of 24 rows cost a second, half-empty group */
#define PI_AXPY_ALIGN 16
/* columns are handed out for the reductions in slices of multiples of 16 floats (a cache line) */
#define PI_AXPY_RED_ALIGN 16
/* rows of at least this many bytes take the column split of the integer sums (no partial sums);
 * shorter rows (SmolLM2's 612-byte ffn_down_t rows) streamed from memory up to 1.7x slower on two
 * threads when each thread read half of every row (docs/benchmarks.md, session 8) */
#define PI_AXPY_SPLIT_COLS_BYTES 2048

/* An explicit team barrier for Cython's parallel blocks: Cython compiles each prange inside a
 * `with parallel()` block as `omp for nowait`, so the OpenMP standard puts no barrier between two
 * such loops (GCC happens to add one before a loop whose index is first- and lastprivate). Call
 * it between two loops where the second reads what the first wrote. An orphaned barrier binds to
 * the innermost enclosing parallel region; outside any region it does nothing. */
static inline void pi_team_barrier(void) { PI_BARRIER(); }

/* This thread's number and the team's size inside a parallel region (0 and 1 outside one, or
 * without OpenMP): for the *_team functions called from a Cython `with parallel()` block. */
static inline int pi_team_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int pi_team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

#include "ibsum.h"

/* Fewest rows in a chunk of a sum over rows of `stride` bytes (PI_AXPY_LONG_ROW_BYTES). */
static inline long pi_axpy_min_rows(size_t stride) {
    if (stride < PI_AXPY_LONG_ROW_BYTES) return PI_AXPY_MIN_ROWS;
    const long r = (long)(PI_AXPY_MIN_CHUNK_BYTES / stride);
    return r < PI_AXPY_ALIGN ? PI_AXPY_ALIGN : (r > PI_AXPY_MIN_ROWS ? PI_AXPY_MIN_ROWS : r);
}

/* Chunks of an n-row sum over rows of `stride` bytes: the largest of 24, 12, 6, 4, 2, 1 with at
 * least pi_axpy_min_rows(stride) rows each (by n and stride alone: the same at any thread count). */
static inline long pi_axpy_nchunks(long n, size_t stride) {
    const long m = n / pi_axpy_min_rows(stride);
    if (m >= PI_AXPY_CHUNKS) return PI_AXPY_CHUNKS;
    if (m >= 12) return 12;
    if (m >= 6) return 6;
    if (m >= 4) return 4;
    if (m >= 2) return 2;
    return 1;
}

/* First row of chunk c of an n-row sum in nc chunks (n for c == nc): c n / nc rounded to the
 * nearest multiple of 16 (rounding down gave the last of two chunks up to 15 rows more: 7% longer
 * on two threads). */
static inline long pi_axpy_bound(long c, long n, long nc) {
    if (c >= nc) return n;
    const long b = (c * n / nc + PI_AXPY_ALIGN / 2) & ~(long)(PI_AXPY_ALIGN - 1);
    return b < n ? b : n;
}

/* 1 where the sum of n rows of `stride` bytes is split by columns (the integer sums of long rows,
 * or a sum too short to cut into chunks) */
static long pi_axpy_split_cols_bytes = PI_AXPY_SPLIT_COLS_BYTES;
static inline int pi_axpy_col_split(int qtype, const int32_t *idx, size_t stride, long n) {
    return pi_axpy_rows_int(qtype, idx) &&
           ((long)stride >= pi_axpy_split_cols_bytes || pi_axpy_nchunks(n, stride) == 1);
}

/* Floats of scratch the sum of n rows of `stride` bytes needs (the partial sums of chunks
 * 1..nc-1; fewer rows never need more). */
static inline size_t pi_axpy_tmp_floats(long n, int cols, size_t stride) {
    if (pi_ib_stride(stride, cols)) return 0; /* the input-block team needs none (ibsum.h) */
    return (size_t)(pi_axpy_nchunks(n, stride) - 1) * (size_t)cols;
}

/* Thread t of T: columns [*c0, *c1) of a slice of cols split in T parts of whole lines. */
static inline void pi_team_cols(int t, int T, int cols, int *c0, int *c1) {
    const long nr = (cols + PI_AXPY_RED_ALIGN - 1) / PI_AXPY_RED_ALIGN;
    long a = (long)t * nr / T * PI_AXPY_RED_ALIGN, b = (long)(t + 1) * nr / T * PI_AXPY_RED_ALIGN;
    *c0 = (int)(a < cols ? a : cols);
    *c1 = (int)(b < cols ? b : cols);
}

/* Thread t of T's share of out = sum_k coef[k] w[idx ? idx[k] : k] (overwrites out), then, if
 * add is not NULL, add[0:cols] += out. tmp: pi_axpy_tmp_floats(n, cols, stride) floats. A barrier
 * separates the sums from the reduction (and from the add); the caller's region ends with the
 * last one. */
static void pi_axpy_rows_team(int t, int T, int qtype, const uint8_t *w, size_t stride,
                              const float *coef, const int32_t *idx, long n, float *out, int cols,
                              float *tmp, float *add) {
    if (pi_is_ib(qtype)) {  /* the input-block layout (ibsum.h) */
        pi_ib_rows_team(t, T, qtype, w, stride, coef, idx, n, out, cols, add);
        return;
    }
    if (pi_axpy_col_split(qtype, idx, stride, n)) {
        const int unit = pi_axpyq_unit_cols(qtype);
        const long nu = cols / unit, np = T < nu ? T : (nu > 0 ? nu : 1);
        if (t < np) {
            const int c0 = (int)(t * nu / np * unit), c1 = (int)((t + 1) * nu / np * unit);
            memset(out + c0, 0, (size_t)(c1 - c0) * sizeof(float));
            if (n > 0) pi_axpyq_rows_cols(qtype, w, stride, coef, idx, n, out, c0, c1);
        }
        if (add) {
            int c0, c1;
            PI_BARRIER();
            pi_team_cols(t, T, cols, &c0, &c1);
            pi_add_f32(add + c0, out + c0, c1 - c0);
        }
        return;
    }
    const long nc = pi_axpy_nchunks(n, stride);
    for (long c = (long)t * nc / T; c < (long)(t + 1) * nc / T; c++) {
        float *acc = c == 0 ? out : tmp + (size_t)(c - 1) * cols;
        memset(acc, 0, (size_t)cols * sizeof(float));
        const long k0 = pi_axpy_bound(c, n, nc), k1 = pi_axpy_bound(c + 1, n, nc);
        if (k1 > k0) pi_axpy_rows_range(qtype, w, stride, coef, idx, k0, k1, n, acc, cols);
    }
    if (nc == 1 && !add) return;
    PI_BARRIER();
    int c0, c1;
    pi_team_cols(t, T, cols, &c0, &c1);
    for (long cc = 1; cc < nc; cc++) pi_add_f32(out + c0, tmp + (size_t)(cc - 1) * cols + c0, c1 - c0);
    if (add) pi_add_f32(add + c0, out + c0, c1 - c0);
}

/* The most threads pi_axpy_rows_team can use on a sum of n rows (1: run it on one thread, as
 * pi_axpy_rows_team(0, 1, ...), which then meets no barrier when called without add). */
static inline long pi_axpy_rows_threads(int qtype, const int32_t *idx, size_t stride, long n,
                                        int cols) {
    return pi_is_ib(qtype) ? cols / (PI_IB_TILE / 2)
           : !pi_axpy_col_split(qtype, idx, stride, n) ? pi_axpy_nchunks(n, stride)
           : n < 2 * PI_AXPY_ALIGN ? 1 : cols / pi_axpyq_unit_cols(qtype);
}

/* out = sum_k coef[k] w[idx ? idx[k] : k] (overwrites out) on up to n_threads threads; tmp as
 * pi_axpy_rows_team. Same bits at any n_threads. */
static void pi_axpy_rows_par(int qtype, const uint8_t *w, size_t stride, const float *coef,
                             const int32_t *idx, long n, float *out, int cols, float *tmp,
                             int n_threads) {
    const long most = pi_axpy_rows_threads(qtype, idx, stride, n, cols);
    const int nt = (int)(n_threads < most ? n_threads : (most > 0 ? most : 1));
    if (nt <= 1) {
        pi_axpy_rows_team(0, 1, qtype, w, stride, coef, idx, n, out, cols, tmp, NULL);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    pi_axpy_rows_team(omp_get_thread_num(), omp_get_num_threads(), qtype, w, stride, coef, idx, n,
                      out, cols, tmp, NULL);
#else
    pi_axpy_rows_team(0, 1, qtype, w, stride, coef, idx, n, out, cols, tmp, NULL);
#endif
}

/* act(g) = silu(g) = g / (1 + exp(-g)) (the division in double) or relu(g): the activation of
 * every fused decode and selection in kernels.pyx too, so all paths give the same bits (the
 * input-sparse FFN's pi_act_select through pi_expf_safe: the same under glibc, see there). */
static inline float pi_act1(float g, int silu) {
    if (silu) return (float)(g / (1.0 + expf(-g)));
    return g > 0.0f ? g : 0.0f;
}

/* e^x for a float x in double (issue 12, session 12): x = k ln2 + r, |r| <= ln2/2, e^r by its
 * Taylor series through r^11/11! (truncation below 1e-14 relative), 2^k through the exponent
 * bits; then rounded to float where that rounding is safe, i.e. the double times 1 - 2^-31 and
 * times 1 + 2^-31 round to the same float. The double is within 1e-14 relative of e^x, and a
 * float's ulp is at most 2^-23 of it, so e^x then lies more than 0.002 ulp from a rounding
 * midpoint, and any expf within 0.502 ulp returns that same float (glibc's since 2.28 states
 * that bound: e_expf.c). Lanes that are not safe (about 1 in 100), |x| > 87 and NaN call expf.
 * So under glibc the value is expf(x) bit for bit (tests/test_ibsum.py checks 2^20 inputs; all
 * floats in [-87, 87] were checked once: docs/benchmarks.md), and on any libm it is the same in
 * every build, lane and split. pi_expf_safe is the scalar twin of pi_expf_safe4/8, operation
 * for operation (explicit FMAs: no contraction differs). */
#define PI_EXP_LOG2E 1.4426950408889634
#define PI_EXP_LN2 0.6931471805599453
#define PI_EXP_LO (1.0 - 4.656612873077393e-10) /* 1 -+ 2^-31, exact in double */
#define PI_EXP_HI (1.0 + 4.656612873077393e-10)
#define PI_EXP_C(n) (1.0 / (n))
#define PI_EXP_POLY(FMA, SET, p, r)                                                             \
    do {                                                                                        \
        p = FMA(SET(PI_EXP_C(39916800.0)), r, SET(PI_EXP_C(3628800.0)));                         \
        p = FMA(p, r, SET(PI_EXP_C(362880.0)));                                                 \
        p = FMA(p, r, SET(PI_EXP_C(40320.0)));                                                  \
        p = FMA(p, r, SET(PI_EXP_C(5040.0)));                                                   \
        p = FMA(p, r, SET(PI_EXP_C(720.0)));                                                    \
        p = FMA(p, r, SET(PI_EXP_C(120.0)));                                                    \
        p = FMA(p, r, SET(PI_EXP_C(24.0)));                                                     \
        p = FMA(p, r, SET(PI_EXP_C(6.0)));                                                      \
        p = FMA(p, r, SET(0.5));                                                                \
        p = FMA(p, r, SET(1.0));                                                                \
        p = FMA(p, r, SET(1.0));                                                                \
    } while (0)
#define PI_EXP_ID(v) (v)

static inline float pi_expf_safe(float x) {
    if (!(fabsf(x) <= 87.0f)) return expf(x);
    const double xd = (double)x, kd = nearbyint(xd * PI_EXP_LOG2E), r = fma(-kd, PI_EXP_LN2, xd);
    const uint64_t bits = (uint64_t)((int64_t)kd + 1023) << 52;
    double s, p;
    memcpy(&s, &bits, sizeof(s));
    PI_EXP_POLY(fma, PI_EXP_ID, p, r);
    const double e = p * s;
    const float lo = (float)(e * PI_EXP_LO), hi = (float)(e * PI_EXP_HI);
    return lo == hi ? lo : expf(x);
}

#if PI_SIMD
/* pi_expf_safe of 4 floats (x: the negated gates); the lanes not safe (bits of *bad) still to be replaced by expf */
static inline __m128 pi_expf_safe4(__m128 x, int *bad) {
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d kd = _mm256_round_pd(_mm256_mul_pd(xd, _mm256_set1_pd(PI_EXP_LOG2E)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256d r = _mm256_fnmadd_pd(kd, _mm256_set1_pd(PI_EXP_LN2), xd);
    const __m256i bits = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(kd)), _mm256_set1_epi64x(1023)),
        52);
    __m256d p;
    PI_EXP_POLY(_mm256_fmadd_pd, _mm256_set1_pd, p, r);
    const __m256d e = _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
    const __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(e, _mm256_set1_pd(PI_EXP_LO)));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(e, _mm256_set1_pd(PI_EXP_HI)));
    const __m128 ax = _mm_andnot_ps(_mm_set1_ps(-0.0f), x);
    const __m128 ok = _mm_and_ps(_mm_cmp_ps(lo, hi, _CMP_EQ_OQ),
                                 _mm_cmp_ps(ax, _mm_set1_ps(87.0f), _CMP_LE_OQ));
    *bad = ~_mm_movemask_ps(ok) & 15;
    return lo;
}
#if PI_AVX512
/* pi_expf_safe4 over 8 floats (the same operations in 512-bit registers) */
static inline __m256 pi_expf_safe8(__m256 x, int *bad) {
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d kd = _mm512_roundscale_pd(_mm512_mul_pd(xd, _mm512_set1_pd(PI_EXP_LOG2E)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(PI_EXP_LN2), xd);
    const __m512i bits = _mm512_slli_epi64(
        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(kd)), _mm512_set1_epi64(1023)),
        52);
    __m512d p;
    PI_EXP_POLY(_mm512_fmadd_pd, _mm512_set1_pd, p, r);
    const __m512d e = _mm512_mul_pd(p, _mm512_castsi512_pd(bits));
    const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(e, _mm512_set1_pd(PI_EXP_LO)));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_mul_pd(e, _mm512_set1_pd(PI_EXP_HI)));
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(lo, hi, _CMP_EQ_OQ),
                                    _mm256_cmp_ps(ax, _mm256_set1_ps(87.0f), _CMP_LE_OQ));
    *bad = ~_mm256_movemask_ps(ok) & 255;
    return lo;
}
#endif
#endif

/* expf of 4 / 8 floats with expf's bits: pi_expf_safe4/8, the lanes they cannot vouch for
 * through expf itself */
#if PI_SIMD
static inline __m128 pi_expf4(__m128 x) {
    int bad;
    __m128 e = pi_expf_safe4(x, &bad);
    if (bad) {
        float xv[4], ev[4];
        _mm_storeu_ps(xv, x);
        _mm_storeu_ps(ev, e);
        for (int l = 0; l < 4; l++)
            if ((bad >> l) & 1) ev[l] = expf(xv[l]);
        e = _mm_loadu_ps(ev);
    }
    return e;
}
#if PI_AVX512
static inline __m256 pi_expf8(__m256 x) {
    int bad;
    __m256 e = pi_expf_safe8(x, &bad);
    if (bad) {
        float xv[8], ev[8];
        _mm256_storeu_ps(xv, x);
        _mm256_storeu_ps(ev, e);
        for (int l = 0; l < 8; l++)
            if ((bad >> l) & 1) ev[l] = expf(xv[l]);
        e = _mm256_loadu_ps(ev);
    }
    return e;
}
#endif
#endif

/* GELU-tanh (torch's gelu(approximate="tanh"), Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh t),
 * t = sqrt(2/pi) (g + 0.044715 g^3), computed in f32 as g * sigmoid(2t) (the same function:
 * 0.5 (1 + tanh t) = 1 / (1 + e^{-2t})) with z = e^{-2|t|} <= 1 through pi_expf_safe (expf's
 * bits), sigmoid(2t) = 1 / (1 + z) for t >= 0, z / (1 + z) below: nothing overflows, no 1 + tanh
 * cancels (torch's f32 form is 7e-2 off near g = -5; this one within 2e-6 of f64), NaN stays
 * NaN and -inf gives NaN as in torch. The 1-, 4- and 8-lane forms are the same operations
 * (explicit FMAs), so a value's bits depend on nothing but the value in every build. */
static inline float pi_gelu_tanh1(float g) {
    const float t = 0.7978845608028654f * fmaf(0.044715f * g, g * g, g);
    const float z = pi_expf_safe(-2.0f * fabsf(t));
    return g * ((t >= 0.0f ? 1.0f : z) / (1.0f + z));
}

#if PI_SIMD
static inline __m128 pi_gelu_tanh4(__m128 g) {
    const __m128 t = _mm_mul_ps(_mm_set1_ps(0.7978845608028654f),
                                _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(0.044715f), g), _mm_mul_ps(g, g), g));
    const __m128 z = pi_expf4(_mm_mul_ps(_mm_set1_ps(-2.0f), _mm_andnot_ps(_mm_set1_ps(-0.0f), t)));
    const __m128 num = _mm_blendv_ps(z, _mm_set1_ps(1.0f), _mm_cmp_ps(t, _mm_setzero_ps(), _CMP_GE_OQ));
    return _mm_mul_ps(g, _mm_div_ps(num, _mm_add_ps(_mm_set1_ps(1.0f), z)));
}
#if PI_AVX512
static inline __m256 pi_gelu_tanh8(__m256 g) {
    const __m256 t = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g),
                                                   _mm256_mul_ps(g, g), g));
    const __m256 z = pi_expf8(_mm256_mul_ps(_mm256_set1_ps(-2.0f),
                                            _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t)));
    const __m256 num = _mm256_blendv_ps(z, _mm256_set1_ps(1.0f),
                                        _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), z)));
}
#endif
#endif

/* out[0:n] = GELU-tanh(g[0:n]) (out may be g): 8 lanes at a time with AVX-512, 4 with AVX2, the
 * rest one by one, all with pi_gelu_tanh1's bits. */
static inline void pi_gelu_tanh(const float *g, float *out, long n) {
    long j = 0;
#if PI_SIMD
#if PI_AVX512
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, pi_gelu_tanh8(_mm256_loadu_ps(g + j)));
#endif
    for (; j + 4 <= n; j += 4) _mm_storeu_ps(out + j, pi_gelu_tanh4(_mm_loadu_ps(g + j)));
#endif
    for (; j < n; j++) out[j] = pi_gelu_tanh1(g[j]);
}

/* out[j - j0] = act(g_j) u_j for j0 <= j < j1 (gu = [g, u], (2 n_ff,)): silu through
 * pi_expf_safe (the same bits as pi_act1 under glibc), 8 lanes at a time with AVX-512, 4 with
 * AVX2 (the 1536 expf calls of a SmolLM2 layer took 5.4 us on one core, most of the activation
 * step; 8 lanes: ~1.5 us, 4 lanes: ~3.1 us) */
static inline void pi_act_values(const float *gu, long n_ff, long j0, long j1, int silu,
                                 float *out) {
    long j = j0;
    if (!silu) {
        for (; j < j1; j++) out[j - j0] = (gu[j] > 0.0f ? gu[j] : 0.0f) * gu[n_ff + j];
        return;
    }
#if PI_AVX512
    for (; j + 8 <= j1; j += 8) {
        const __m256 g = _mm256_loadu_ps(gu + j);
        const __m256 e = pi_expf8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
        const __m512d q = _mm512_div_pd(_mm512_cvtps_pd(g),
                                        _mm512_add_pd(_mm512_set1_pd(1.0), _mm512_cvtps_pd(e)));
        _mm256_storeu_ps(out + j - j0,
                         _mm256_mul_ps(_mm512_cvtpd_ps(q), _mm256_loadu_ps(gu + n_ff + j)));
    }
#endif
#if PI_SIMD
    for (; j + 4 <= j1; j += 4) {
        const __m128 g = _mm_loadu_ps(gu + j);
        const __m128 e = pi_expf4(_mm_xor_ps(g, _mm_set1_ps(-0.0f)));
        const __m256d q = _mm256_div_pd(_mm256_cvtps_pd(g),
                                        _mm256_add_pd(_mm256_set1_pd(1.0), _mm256_cvtps_pd(e)));
        _mm_storeu_ps(out + j - j0, _mm_mul_ps(_mm256_cvtpd_ps(q), _mm_loadu_ps(gu + n_ff + j)));
    }
#endif
    for (; j < j1; j++) {
        const float g = gu[j];
        out[j - j0] = (float)(g / (1.0 + (double)pi_expf_safe(-g))) * gu[n_ff + j];
    }
}

/* The kept channels of x[0:n]: x[i] where not |x[i]| * scale[i] <= thr (scale NULL: |x[i]|),
 * i.e. above thr or NaN (a NaN is kept, so it reaches the output and the engine's NaN check
 * instead of vanishing from the sum), written in order to coef[0:k] and their channels j0 + i to idx[0:k];
 * returns k. coef may be x itself (compaction in place). AVX-512: 16 channels a step, the kept
 * ones packed by vcompressps / vpcompressd in registers and written with a masked store (the
 * memory form is microcoded on AMD Zen 4); otherwise branch-free scalar compaction (kept or
 * dropped mispredicts half the time). The same comparisons either way, so the same list. */
static inline long pi_select_kept(const float *x, const float *scale, float thr, long n, long j0,
                                  float *coef, int32_t *idx) {
    long i = 0, k = 0;
#if PI_AVX512
    const __m512 t = _mm512_set1_ps(thr);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i ch = _mm512_add_epi32(_mm512_set1_epi32((int)j0),
                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                    14, 15));
    for (; i + 16 <= n; i += 16, ch = _mm512_add_epi32(ch, step)) {
        const __m512 v = _mm512_loadu_ps(x + i);
        __m512 s = _mm512_abs_ps(v);
        if (scale) s = _mm512_mul_ps(s, _mm512_loadu_ps(scale + i));
        const __mmask16 m = _mm512_cmp_ps_mask(s, t, _CMP_NLE_UQ);
        const int c = __builtin_popcount((unsigned)m);
        const __mmask16 w = (__mmask16)((1u << c) - 1u);
        _mm512_mask_storeu_ps(coef + k, w, _mm512_maskz_compress_ps(m, v));
        _mm512_mask_storeu_epi32(idx + k, w, _mm512_maskz_compress_epi32(m, ch));
        k += c;
    }
#endif
    for (; i < n; i++) {
        const float a = x[i];
        float s = fabsf(a);
        if (scale) s = s * scale[i];
        coef[k] = a;
        idx[k] = (int32_t)(j0 + i);
        k += !(s <= thr);
    }
    return k;
}

/* a_j = act(g_j) u_j for j0 <= j < j1 (gu = [g, u], (2 n_ff,)); the kept ones (|a_j| sd_j > thr,
 * sd NULL: 1) written in order to coef/idx (room for j1 - j0 each); returns their count. Two
 * steps: the activations first (pi_act_values), then the compaction in place (pi_select_kept). */
static inline long pi_act_select(const float *gu, long n_ff, long j0, long j1, int silu,
                                 const float *sd, float thr, float *coef, int32_t *idx) {
    pi_act_values(gu, n_ff, j0, j1, silu, coef);
    return pi_select_kept(coef, sd ? sd + j0 : NULL, thr, j1 - j0, j0, coef, idx);
}

/* Thread t of T's activations j0 <= j < j1 in decode_ffn_in's team (kernels.pyx _ffn_in_team).
 * The kept list they make, in thread order, is the same for any split. */
static inline void pi_act_span(int t, int T, long n_ff, long *j0, long *j1) {
    *j0 = t * n_ff / T;
    *j1 = (t + 1) * n_ff / T;
}

/* The kept activations of all T threads in thread order (thread p's cnt[p] entries at ctmp and
 * itmp + its j0) copied into coef/idx; returns their count. Each thread of the team makes its own
 * copy: that costs less than a shared list and the barrier after it. */
static inline long pi_act_gather(int T, long n_ff, const long *cnt, const float *ctmp,
                                 const int32_t *itmp, float *coef, int32_t *idx) {
    long n = 0, j0, j1;
    for (int p = 0; p < T; p++) {
        pi_act_span(p, T, n_ff, &j0, &j1);
        memcpy(coef + n, ctmp + j0, (size_t)cnt[p] * sizeof(float));
        memcpy(idx + n, itmp + j0, (size_t)cnt[p] * sizeof(int32_t));
        n += cnt[p];
    }
    return n;
}

#endif /* PYINFER_ROWSUM_TEAM_H */
