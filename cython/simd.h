/* SIMD row kernels for pyinfer (dot products, axpy, activation quantization).
 *
 * Cython cannot express F16C conversion or FMA, so the inner loops live here as static inline
 * functions. With AVX2+FMA+F16C (setup.py passes -mavx2 -mfma -mf16c when the CPU has them) the
 * intrinsic paths are used; otherwise a portable scalar path with the same numerics (up to f32
 * summation order) is compiled.
 *
 * Weight rows are raw bytes as ggml stores them; qtype is the ggml type id:
 *   PI_F32 (0): float32[n]; PI_F16 (1): IEEE half[n];
 *   PI_Q4_0 (2): blocks of 18 bytes = f16 d + uint8 qs[16], x[j] = d*((qs[j]&15)-8),
 *                x[j+16] = d*((qs[j]>>4)-8);
 *   PI_Q8_0 (8): blocks of 34 bytes = f16 d + int8 qs[32], x[j] = d*qs[j]   (ggml-common.h).
 * Quantized rows are dotted against the activation quantized to 8 bits per 32-block with an f32
 * scale (as llama.cpp's ggml_vec_dot_q4_0_q8_0 / q8_0_q8_0 do), so the inner loop is integer;
 * the dots of the 32-block types (q8_0, q4_0, Q4_1, Q5_0, Q5_1) are in gemv.h.
 */
#ifndef PYINFER_SIMD_H
#define PYINFER_SIMD_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PI_SIMD 1
#else
#define PI_SIMD 0
#endif

/* The 512-bit paths: AVX-512 F and BW (setup.py adds both or neither). */
#if PI_SIMD && defined(__AVX512F__) && defined(__AVX512BW__)
#define PI_AVX512 1
#else
#define PI_AVX512 0
#endif

/* The 256-bit VNNI dot, pi_dpbusd256(acc, u, s): acc + the sums of four products of unsigned
 * bytes u and signed bytes s per 32-bit lane, in int32 (no int16 step). AVX512-VNNI with VL
 * (its EVEX form), or AVX-VNNI (the VEX form: Intel Alder Lake and later without AVX-512, and
 * Zen 5). AVX-VNNI has 16 ymm registers, so a path that keeps more live also tests PI_AVX512
 * (gemmt.h PI_GEMMT_TN). */
#if PI_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PI_VNNI256 1
#define pi_dpbusd256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif PI_SIMD && defined(__AVXVNNI__)
#define PI_VNNI256 1
#define pi_dpbusd256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define PI_VNNI256 0
#endif

#define PI_F32 0
#define PI_F16 1
#define PI_Q4_0 2
#define PI_Q8_0 8
#define PI_Q4_1 3
#define PI_Q5_0 6
#define PI_Q5_1 7
#define PI_Q4_K 12
#define PI_Q5_K 13
#define PI_Q6_K 14
#define PI_BF16 30
#define PI_QK 32
#define PI_QK_K 256

static inline int pi_simd_enabled(void) { return PI_SIMD; }

/* The SIMD paths compiled in, as bits: 1 AVX2/FMA/F16C, 2 the 512-bit paths (PI_AVX512), 4 the
 * 256-bit VNNI dot (PI_VNNI256), 8 that dot in AVX-VNNI's VEX form */
static inline int pi_simd_features(void) {
    int f = PI_SIMD | 2 * PI_AVX512 | 4 * PI_VNNI256;
#if PI_VNNI256 && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
    f |= 8;
#endif
    return f;
}

static inline int pi_openmp_enabled(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The types of qtypes.h read in 32-value groups (Q4_1, Q5_0, Q5_1 and the K-quants). */
static inline int pi_is_xquant(int qtype) {
    return qtype == PI_Q4_1 || qtype == PI_Q5_0 || qtype == PI_Q5_1 || qtype == PI_Q4_K ||
           qtype == PI_Q5_K || qtype == PI_Q6_K;
}

/* Types whose rows are dotted against the q8-quantized activation. */
static inline int pi_is_quant(int qtype) {
    return qtype == PI_Q4_0 || qtype == PI_Q8_0 || pi_is_xquant(qtype);
}

/* Values per block and bytes per block of a type (ggml-common.h); 0 bytes: not supported. */
static inline int pi_block_elems(int qtype) {
    switch (qtype) {
    case PI_F32: case PI_F16: case PI_BF16: return 1;
    case PI_Q4_K: case PI_Q5_K: case PI_Q6_K: return PI_QK_K;
    default: return PI_QK;
    }
}

static inline int pi_block_bytes(int qtype) {
    switch (qtype) {
    case PI_F32: return 4;
    case PI_F16: case PI_BF16: return 2;
    case PI_Q4_0: return 18;
    case PI_Q4_1: return 20;
    case PI_Q5_0: return 22;
    case PI_Q5_1: return 24;
    case PI_Q8_0: return 34;
    case PI_Q4_K: return 144;
    case PI_Q5_K: return 176;
    case PI_Q6_K: return 210;
    default: return 0;
    }
}

/* Bytes from the start of a row to column col (col a multiple of the type's block size). */
static inline size_t pi_col_offset(int qtype, int col) {
    return (size_t)(col / pi_block_elems(qtype)) * (size_t)pi_block_bytes(qtype);
}

static inline float pi_f16_to_f32(uint16_t h) {
#if PI_SIMD
    return _cvtsh_ss(h);
#else
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) {
        f = ldexpf((float)mant, -24); /* zero or subnormal */
        return sign ? -f : f;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* f32 -> f16 bits, rounded to nearest even (IEEE 754 binary16: overflow past 65504 to inf,
 * results below 2^-14 to subnormals), the conversion numpy's astype(float16) makes: F16C's
 * vcvtps2ph on the SIMD build, the same rounding spelled out otherwise. (The KV cache: prefill
 * writes its rows through numpy, decode through this, and both must store the same bits.) */
static inline uint16_t pi_f32_to_f16(float f) {
#if PI_SIMD
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf, or NaN (kept quiet, top payload bits) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) { /* normal half: drop 13 mantissa bits, ties to even */
        const uint32_t m = ax - 0x38000000u; /* exponent rebiased 127 -> 15 */
        return (uint16_t)(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
    }
    if (ax < 0x33000000u) return (uint16_t)sign; /* below 2^-25 (or exactly: a tie to 0) */
    /* subnormal half: value / 2^-24 rounded to an integer, ties to even */
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u, sh = 126u - (ax >> 23);
    uint32_t r = mant >> sh;
    const uint32_t rem = mant & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    r += rem > half || (rem == half && (r & 1u));
    return (uint16_t)(sign | r);
#endif
}

/* o[0:n] = f16 bits of x[0:n] (pi_f32_to_f16, 8 at a time on the SIMD build) */
static inline void pi_f32_to_f16_row(const float *x, uint16_t *o, long n) {
    long i = 0;
#if PI_SIMD
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(o + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) o[i] = pi_f32_to_f16(x[i]);
}

/* o[0:n] = the f32 values of the f16 bits h[0:n] (exact) */
static inline void pi_f16_to_f32_row(const uint16_t *h, float *o, long n) {
    long i = 0;
#if PI_SIMD
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) o[i] = pi_f16_to_f32(h[i]);
}

static inline float pi_load_d(const uint8_t *blk) {
    uint16_t h;
    memcpy(&h, blk, 2);
    return pi_f16_to_f32(h);
}

#if PI_SIMD
static inline float pi_hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

#endif

/* ---- f32 / f16 dots ---- */

#if PI_SIMD
/* pi_dot_f32's sums before its horizontal one, over the first n (a multiple of 8) values:
 * (s0 + s1) + (s2 + s3), four FMA chains from zero (attend.h's batched scores reduce 8 of them
 * together and get pi_dot_f32's bits) */
static inline __attribute__((always_inline)) __m256 pi_dot8_f32(const float *a, const float *b,
                                                                int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
}
#endif

static inline float pi_dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#if PI_SIMD
    i = n & ~7;
    s = pi_hsum(pi_dot8_f32(a, b, i));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float pi_dot_f16(const uint16_t *w, const float *x, int n) {
    int i = 0;
    float s = 0.0f;
#if PI_SIMD
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
#define PI_H(k) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + (k))))
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(PI_H(0), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(PI_H(8), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(PI_H(16), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(PI_H(24), _mm256_loadu_ps(x + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(PI_H(0), _mm256_loadu_ps(x + i), s0);
#undef PI_H
    s = pi_hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#endif
    for (; i < n; i++) s += pi_f16_to_f32(w[i]) * x[i];
    return s;
}

/* ---- activation quantization: x (n, a multiple of 32) -> per-block f32 scale d, int8 q ----
 * d is laid out as [d_0 .. d_{nb-1} | s_0 .. s_{nb-1}] with s_b = 8 * d_b * sum_j q_bj: the q4_0
 * dot multiplies the unsigned nibbles (0..15) directly and subtracts the offset 8 once per block
 * through s_b, which saves the sign tricks and the subtraction (2nb floats needed in d). */

/* Maxima of absolute values (sign bits clear) that keep a NaN: such floats' bit patterns order
 * as int32 and a NaN's lies above +inf's, so an integer max returns NaN wherever one is there.
 * max_ps keeps a NaN only when it is the second operand: a block's NaN was dropped and the
 * block quantized into finite garbage (about 1e8) that Engine._check_finite could not see.
 * For finite values it is the same maximum, bit for bit. */
#if PI_SIMD
static inline __m256 pi_absmax8(__m256 a, __m256 b) {
    return _mm256_castsi256_ps(_mm256_max_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}
static inline __m128 pi_absmax4(__m128 a, __m128 b) {
    return _mm_castsi128_ps(_mm_max_epi32(_mm_castps_si128(a), _mm_castps_si128(b)));
}
#endif
/* the scalar form: a NaN |v| (or one already in amax) wins */
static inline float pi_absmax1(float amax, float v) {
    return (v > amax || v != v) ? v : amax;
}

/* One block of 32: d = max |x| / 127, q[j] = rint(x[j] / d) (0 where d is 0); returns the sum
 * of q. The SIMD path gives the scalar loop's numbers, 8 lanes at a time: max |x| in any order,
 * one f32 product per value, and cvtps rounds to nearest-even as lrintf does in the default
 * rounding mode. (Also ibsum.h's per-token quantization of a prefill.) */
static inline int pi_quantize_q8_block(const float *xb, int8_t *q, float *d) {
#if PI_SIMD
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
    const __m256 m = pi_absmax8(
        pi_absmax8(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        pi_absmax8(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = pi_absmax4(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = pi_absmax4(m4, _mm_movehl_ps(m4, m4));
    m4 = pi_absmax4(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(db != 0.0f ? 1.0f / db : 0.0f);
    __m256i i[4];
    for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
    /* |i| <= 127: the packs do not saturate; packs interleave 128-bit lanes, undone by the
     * permute */
    const __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *d = db;
    return _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int j = 0; j < PI_QK; j++) amax = pi_absmax1(amax, fabsf(xb[j]));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int j = 0; j < PI_QK; j++) {
        const int v = (int)lrintf(xb[j] * id);
        q[j] = (int8_t)v;
        sum += v;
    }
    *d = db;
    return sum;
#endif
}

static inline void pi_quantize_q8(const float *x, int n, float *d, int8_t *q) {
    const int nb = n / PI_QK;
    for (int b = 0; b < nb; b++) {
        const int sum = pi_quantize_q8_block(x + b * PI_QK, q + b * PI_QK, d + b);
        d[nb + b] = 8.0f * d[b] * (float)sum;
    }
}

#include "qtypes.h"
#include "gemv.h"

/* Row . activation for any type: x is used for f32/f16/bf16, (xd, xq) from pi_quantize_q8 for
 * quantized rows (the 32-block types with gemv.h's numerics, the same bits as its 8-row GEMV). */
static inline float pi_dot_row(int qtype, const uint8_t *row, const float *x, const float *xd,
                               const int8_t *xq, int n) {
    switch (qtype) {
    case PI_F32: return pi_dot_f32((const float *)row, x, n);
    case PI_F16: return pi_dot_f16((const uint16_t *)row, x, n);
    case PI_BF16: return pi_dot_bf16((const uint16_t *)row, x, n);
    case PI_Q4_0: return pi_dot1_leg(PI_Q4_0, row, xd, xq, n / PI_QK);
    case PI_Q4_1: return pi_dot1_leg(PI_Q4_1, row, xd, xq, n / PI_QK);
    case PI_Q5_0: return pi_dot1_leg(PI_Q5_0, row, xd, xq, n / PI_QK);
    case PI_Q5_1: return pi_dot1_leg(PI_Q5_1, row, xd, xq, n / PI_QK);
    case PI_Q4_K: return pi_dot_x(PI_Q4_K, row, xd, xq, n / PI_QK);
    case PI_Q5_K: return pi_dot_x(PI_Q5_K, row, xd, xq, n / PI_QK);
    case PI_Q6_K: return pi_dot_x(PI_Q6_K, row, xd, xq, n / PI_QK);
    default: return pi_dot1_leg(PI_Q8_0, row, xd, xq, n / PI_QK);
    }
}

/* ---- out[0:n] += a * row[0:n] (row dequantized in f32) ---- */

static inline void pi_axpy_f32(float a, const float *w, float *out, int n) {
    int i = 0;
#if PI_SIMD
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(w + i), _mm256_loadu_ps(out + i)));
        _mm256_storeu_ps(out + i + 8,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(out + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(w + i), _mm256_loadu_ps(out + i)));
#endif
    for (; i < n; i++) out[i] += a * w[i];
}

static inline void pi_axpy_f16(float a, const uint16_t *w, float *out, int n) {
    int i = 0;
#if PI_SIMD
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) {
        __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(va, wv, _mm256_loadu_ps(out + i)));
    }
#endif
    for (; i < n; i++) out[i] += a * pi_f16_to_f32(w[i]);
}

#if PI_SIMD
/* out[0:8] += s * (float)q[0:8] for 8 int8 in the low half of a 128-bit register */
static inline void pi_fma8_i8(__m256 s, __m128i q8, float *out) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(out)));
}
#endif

static inline void pi_axpy_q8_0(float a, const uint8_t *row, float *out, int nb) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + 34 * b;
        const float s = a * pi_load_d(blk);
        float *o = out + 32 * b;
#if PI_SIMD
        const __m256 vs = _mm256_set1_ps(s);
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        pi_fma8_i8(vs, q0, o);
        pi_fma8_i8(vs, _mm_srli_si128(q0, 8), o + 8);
        pi_fma8_i8(vs, q1, o + 16);
        pi_fma8_i8(vs, _mm_srli_si128(q1, 8), o + 24);
#else
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < PI_QK; j++) o[j] += s * (float)q[j];
#endif
    }
}

static inline void pi_axpy_q4_0(float a, const uint8_t *row, float *out, int nb) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + 18 * b;
        const float s = a * pi_load_d(blk);
        float *o = out + 32 * b;
#if PI_SIMD
        const __m256 vs = _mm256_set1_ps(s);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i m = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, m), eight);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), m), eight);
        pi_fma8_i8(vs, lo, o);
        pi_fma8_i8(vs, _mm_srli_si128(lo, 8), o + 8);
        pi_fma8_i8(vs, hi, o + 16);
        pi_fma8_i8(vs, _mm_srli_si128(hi, 8), o + 24);
#else
        const uint8_t *qs = blk + 2;
        for (int j = 0; j < 16; j++) {
            o[j] += s * (float)((int)(qs[j] & 15) - 8);
            o[j + 16] += s * (float)((int)(qs[j] >> 4) - 8);
        }
#endif
    }
}

/* out[0:n] += a * (columns c0 .. c0+n-1 of row); c0 and n multiples of 32 for quantized types */
static inline void pi_axpy_cols(int qtype, float a, const uint8_t *row, int c0, float *out, int n) {
    const int g0 = c0 / PI_QK, ng = n / PI_QK;
    switch (qtype) {
    case PI_F32: pi_axpy_f32(a, (const float *)row + c0, out, n); break;
    case PI_F16: pi_axpy_f16(a, (const uint16_t *)row + c0, out, n); break;
    case PI_BF16: pi_axpy_bf16(a, (const uint16_t *)row + c0, out, n); break;
    case PI_Q4_0: pi_axpy_q4_0(a, row + 18 * (size_t)g0, out, ng); break;
    case PI_Q4_1: pi_axpy_x(PI_Q4_1, a, row, out, g0, ng); break;
    case PI_Q5_0: pi_axpy_x(PI_Q5_0, a, row, out, g0, ng); break;
    case PI_Q5_1: pi_axpy_x(PI_Q5_1, a, row, out, g0, ng); break;
    case PI_Q4_K: pi_axpy_x(PI_Q4_K, a, row, out, g0, ng); break;
    case PI_Q5_K: pi_axpy_x(PI_Q5_K, a, row, out, g0, ng); break;
    case PI_Q6_K: pi_axpy_x(PI_Q6_K, a, row, out, g0, ng); break;
    default: pi_axpy_q8_0(a, row + 34 * (size_t)g0, out, ng); break;
    }
}

static inline void pi_axpy_row(int qtype, float a, const uint8_t *row, float *out, int n) {
    pi_axpy_cols(qtype, a, row, 0, out, n);
}

/* Software prefetch of every cache line of [p, p + nbytes), p not necessarily line-aligned.
 * Gathered rows are short (SmolLM2's q8_0 rows are 612 bytes, not line-aligned) and in no pattern
 * the hardware prefetcher follows, so without it every row costs a DRAM latency. Two levels
 * (measured on the 2-core EPYC box, docs/benchmarks.md): rows far ahead go to L2 (hint T1: the L2
 * has more miss buffers than the L1, so more lines are in flight), the next rows to L1 (T0).
 * Prefetching from p itself instead of its line start missed a row's last line about half the
 * time, and each missed line stalled the row on a full DRAM latency.
 * always_inline: to GCC's IPA a function that only prefetches is "pure" (a prefetch is no side
 * effect to it), and where such a call is not inlined early it is deleted as unused (session 28
 * found pi_axq_range's call gone from the build that way). */
static inline __attribute__((always_inline)) void pi_prefetch_l1(const uint8_t *p, size_t nbytes) {
#if PI_SIMD
    const uint8_t *a = (const uint8_t *)((uintptr_t)p & ~(uintptr_t)63);
    for (; a < p + nbytes; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T0);
#else
    (void)p;
    (void)nbytes;
#endif
}

static inline __attribute__((always_inline)) void pi_prefetch_l2(const uint8_t *p, size_t nbytes) {
#if PI_SIMD
    const uint8_t *a = (const uint8_t *)((uintptr_t)p & ~(uintptr_t)63);
    for (; a < p + nbytes; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T1);
#else
    (void)p;
    (void)nbytes;
#endif
}

/* Rows longer than this are not prefetched into L1: the hardware prefetcher follows a long row
 * once it is in it, and four 8 KB rows would fill a 32 KB L1. */
#define PI_L1_PREFETCH_MAX_ROW 2048

/* How many rows ahead the L2 prefetch runs: about 16 KiB ahead, 2 to 32 rows. */
static inline int pi_prefetch_dist(size_t row_bytes) {
    size_t d = 16384 / (row_bytes ? row_bytes : 1);
    return d < 2 ? 2 : (d > 32 ? 32 : (int)d);
}

/* ---- out[0:n] += sum_{r<4} a[r] * row_r[0:n]: four rows per pass, so the accumulator is loaded
 * and stored once per four rows (the down projection's inner loop). ---- */

#if PI_AVX512
/* 512-bit versions of the quantized and f16 four-row AXPY: int8 -> f32 conversion is the inner
 * loop's cost, and one 512-bit convert does the work of two 256-bit ones. Returns 0 for a type
 * it does not handle. */
static inline int pi_axpy4_row_512(int qtype, const float *a, const uint8_t *const *rw, float *out,
                                   int n) {
    const int nb = n / PI_QK;
    if (qtype == PI_Q8_0) {
        for (int b = 0; b < nb; b++) {
            float *o = out + 32 * b;
            __m512 acc0 = _mm512_loadu_ps(o), acc1 = _mm512_loadu_ps(o + 16);
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = rw[r] + 34 * b;
                const __m512 sc = _mm512_set1_ps(a[r] * pi_load_d(blk));
                const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
                const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
                acc0 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), acc0);
                acc1 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), acc1);
            }
            _mm512_storeu_ps(o, acc0);
            _mm512_storeu_ps(o + 16, acc1);
        }
        return 1;
    }
    if (qtype == PI_Q4_0) {
        const __m128i m = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
        for (int b = 0; b < nb; b++) {
            float *o = out + 32 * b;
            __m512 acc0 = _mm512_loadu_ps(o), acc1 = _mm512_loadu_ps(o + 16);
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = rw[r] + 18 * b;
                const __m512 sc = _mm512_set1_ps(a[r] * pi_load_d(blk));
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2));
                const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, m), eight);
                const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), m), eight);
                acc0 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), acc0);
                acc1 = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), acc1);
            }
            _mm512_storeu_ps(o, acc0);
            _mm512_storeu_ps(o + 16, acc1);
        }
        return 1;
    }
    if (qtype == PI_F16 && n % 16 == 0) {
        const __m512 a0 = _mm512_set1_ps(a[0]), a1 = _mm512_set1_ps(a[1]);
        const __m512 a2 = _mm512_set1_ps(a[2]), a3 = _mm512_set1_ps(a[3]);
        const uint16_t *w0 = (const uint16_t *)rw[0], *w1 = (const uint16_t *)rw[1];
        const uint16_t *w2 = (const uint16_t *)rw[2], *w3 = (const uint16_t *)rw[3];
#define PI_H16(w) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((w) + i)))
        for (int i = 0; i < n; i += 16) {
            __m512 acc = _mm512_loadu_ps(out + i);
            acc = _mm512_fmadd_ps(a0, PI_H16(w0), acc);
            acc = _mm512_fmadd_ps(a1, PI_H16(w1), acc);
            acc = _mm512_fmadd_ps(a2, PI_H16(w2), acc);
            acc = _mm512_fmadd_ps(a3, PI_H16(w3), acc);
            _mm512_storeu_ps(out + i, acc);
        }
#undef PI_H16
        return 1;
    }
    return 0;
}
#endif

static inline void pi_axpy4_row(int qtype, const float *a, const uint8_t *r0, const uint8_t *r1,
                                const uint8_t *r2, const uint8_t *r3, float *out, int n) {
    if (pi_is_xquant(qtype)) {  /* qtypes.h */
        const uint8_t *rx[4] = {r0, r1, r2, r3};
        pi_axpy4_xrow(qtype, a, rx, out, n);
        return;
    }
    if (qtype == PI_BF16) {  /* one row at a time (qtypes.h) */
        pi_axpy_row(qtype, a[0], r0, out, n);
        pi_axpy_row(qtype, a[1], r1, out, n);
        pi_axpy_row(qtype, a[2], r2, out, n);
        pi_axpy_row(qtype, a[3], r3, out, n);
        return;
    }
#if PI_SIMD
    const uint8_t *rw[4] = {r0, r1, r2, r3};
#if PI_AVX512
    if (pi_axpy4_row_512(qtype, a, rw, out, n)) return;
#endif
    if (qtype == PI_F32 || qtype == PI_F16) {
        const __m256 a0 = _mm256_set1_ps(a[0]), a1 = _mm256_set1_ps(a[1]);
        const __m256 a2 = _mm256_set1_ps(a[2]), a3 = _mm256_set1_ps(a[3]);
        int i = 0;
        if (qtype == PI_F32) {
            const float *w0 = (const float *)r0, *w1 = (const float *)r1;
            const float *w2 = (const float *)r2, *w3 = (const float *)r3;
            for (; i + 8 <= n; i += 8) {
                __m256 acc = _mm256_loadu_ps(out + i);
                acc = _mm256_fmadd_ps(a0, _mm256_loadu_ps(w0 + i), acc);
                acc = _mm256_fmadd_ps(a1, _mm256_loadu_ps(w1 + i), acc);
                acc = _mm256_fmadd_ps(a2, _mm256_loadu_ps(w2 + i), acc);
                acc = _mm256_fmadd_ps(a3, _mm256_loadu_ps(w3 + i), acc);
                _mm256_storeu_ps(out + i, acc);
            }
            for (; i < n; i++) out[i] += a[0] * w0[i] + a[1] * w1[i] + a[2] * w2[i] + a[3] * w3[i];
        } else {
            const uint16_t *w0 = (const uint16_t *)r0, *w1 = (const uint16_t *)r1;
            const uint16_t *w2 = (const uint16_t *)r2, *w3 = (const uint16_t *)r3;
#define PI_H(w) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((w) + i)))
            for (; i + 8 <= n; i += 8) {
                __m256 acc = _mm256_loadu_ps(out + i);
                acc = _mm256_fmadd_ps(a0, PI_H(w0), acc);
                acc = _mm256_fmadd_ps(a1, PI_H(w1), acc);
                acc = _mm256_fmadd_ps(a2, PI_H(w2), acc);
                acc = _mm256_fmadd_ps(a3, PI_H(w3), acc);
                _mm256_storeu_ps(out + i, acc);
            }
#undef PI_H
            for (; i < n; i++)
                out[i] += a[0] * pi_f16_to_f32(w0[i]) + a[1] * pi_f16_to_f32(w1[i]) +
                          a[2] * pi_f16_to_f32(w2[i]) + a[3] * pi_f16_to_f32(w3[i]);
        }
        return;
    }
    const int nb = n / PI_QK;
    if (qtype == PI_Q8_0) {
        for (int b = 0; b < nb; b++) {
            __m256 sc[4];
            const uint8_t *q[4];
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = rw[r] + 34 * b;
                sc[r] = _mm256_set1_ps(a[r] * pi_load_d(blk));
                q[r] = blk + 2;
            }
            float *o = out + 32 * b;
            for (int j = 0; j < 4; j++) {
                __m256 acc = _mm256_loadu_ps(o + 8 * j);
                for (int r = 0; r < 4; r++) {
                    __m256 v = _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q[r] + 8 * j))));
                    acc = _mm256_fmadd_ps(sc[r], v, acc);
                }
                _mm256_storeu_ps(o + 8 * j, acc);
            }
        }
        return;
    }
    /* q4_0 */
    const __m128i m = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    for (int b = 0; b < nb; b++) {
        __m256 sc[4];
        __m128i lo[4], hi[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = rw[r] + 18 * b;
            sc[r] = _mm256_set1_ps(a[r] * pi_load_d(blk));
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2));
            lo[r] = _mm_sub_epi8(_mm_and_si128(bytes, m), eight);
            hi[r] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), m), eight);
        }
        float *o = out + 32 * b;
        __m256 acc0 = _mm256_loadu_ps(o), acc1 = _mm256_loadu_ps(o + 8);
        __m256 acc2 = _mm256_loadu_ps(o + 16), acc3 = _mm256_loadu_ps(o + 24);
        for (int r = 0; r < 4; r++) {
            acc0 = _mm256_fmadd_ps(sc[r], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo[r])), acc0);
            acc1 = _mm256_fmadd_ps(sc[r], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                              _mm_srli_si128(lo[r], 8))), acc1);
            acc2 = _mm256_fmadd_ps(sc[r], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi[r])), acc2);
            acc3 = _mm256_fmadd_ps(sc[r], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                              _mm_srli_si128(hi[r], 8))), acc3);
        }
        _mm256_storeu_ps(o, acc0);
        _mm256_storeu_ps(o + 8, acc1);
        _mm256_storeu_ps(o + 16, acc2);
        _mm256_storeu_ps(o + 24, acc3);
    }
#else
    pi_axpy_row(qtype, a[0], r0, out, n);
    pi_axpy_row(qtype, a[1], r1, out, n);
    pi_axpy_row(qtype, a[2], r2, out, n);
    pi_axpy_row(qtype, a[3], r3, out, n);
#endif
}

/* Prefill's down projection (matmul_t): out_t[0:64] += sum_{j<4} a_t[j] * buf_j[0:64] for the
 * tokens t of a strip, with the four dequantized row strips (buf, 4 x 64 floats) loaded once per
 * token pair and both tokens' 64 outputs kept in registers across the four rows. Same sums in
 * the same order as pi_axpy4_row over each token. */
static inline void pi_axpy4_strip64(const float *a, long a_stride, const float *buf, float *out,
                                    long out_stride, long n_tok) {
#if PI_SIMD
    long t = 0;
    for (; t + 2 <= n_tok; t += 2) {
        float *o0 = out + t * out_stride, *o1 = o0 + out_stride;
        const float *c0 = a + t * a_stride, *c1 = c0 + a_stride;
        for (int h = 0; h < 64; h += 32) {  /* 2 tokens x 32 columns = 8 accumulators */
            __m256 p0 = _mm256_loadu_ps(o0 + h), p1 = _mm256_loadu_ps(o0 + h + 8);
            __m256 p2 = _mm256_loadu_ps(o0 + h + 16), p3 = _mm256_loadu_ps(o0 + h + 24);
            __m256 q0 = _mm256_loadu_ps(o1 + h), q1 = _mm256_loadu_ps(o1 + h + 8);
            __m256 q2 = _mm256_loadu_ps(o1 + h + 16), q3 = _mm256_loadu_ps(o1 + h + 24);
            for (int j = 0; j < 4; j++) {
                const float *bj = buf + j * 64 + h;
                const __m256 w0 = _mm256_loadu_ps(bj), w1 = _mm256_loadu_ps(bj + 8);
                const __m256 w2 = _mm256_loadu_ps(bj + 16), w3 = _mm256_loadu_ps(bj + 24);
                const __m256 s = _mm256_set1_ps(c0[j]), u = _mm256_set1_ps(c1[j]);
                p0 = _mm256_fmadd_ps(s, w0, p0);
                p1 = _mm256_fmadd_ps(s, w1, p1);
                p2 = _mm256_fmadd_ps(s, w2, p2);
                p3 = _mm256_fmadd_ps(s, w3, p3);
                q0 = _mm256_fmadd_ps(u, w0, q0);
                q1 = _mm256_fmadd_ps(u, w1, q1);
                q2 = _mm256_fmadd_ps(u, w2, q2);
                q3 = _mm256_fmadd_ps(u, w3, q3);
            }
            _mm256_storeu_ps(o0 + h, p0);
            _mm256_storeu_ps(o0 + h + 8, p1);
            _mm256_storeu_ps(o0 + h + 16, p2);
            _mm256_storeu_ps(o0 + h + 24, p3);
            _mm256_storeu_ps(o1 + h, q0);
            _mm256_storeu_ps(o1 + h + 8, q1);
            _mm256_storeu_ps(o1 + h + 16, q2);
            _mm256_storeu_ps(o1 + h + 24, q3);
        }
    }
    for (; t < n_tok; t++)
        pi_axpy4_row(PI_F32, a + t * a_stride, (const uint8_t *)buf, (const uint8_t *)(buf + 64),
                     (const uint8_t *)(buf + 128), (const uint8_t *)(buf + 192),
                     out + t * out_stride, 64);
#else
    for (long t = 0; t < n_tok; t++)
        pi_axpy4_row(PI_F32, a + t * a_stride, (const uint8_t *)buf, (const uint8_t *)(buf + 64),
                     (const uint8_t *)(buf + 128), (const uint8_t *)(buf + 192),
                     out + t * out_stride, 64);
#endif
}

#include "axpyq.h" /* integer row sums for the quantized types (issues 11/12) */

/* out[0:cols] += sum_{k0 <= k < k1} coef[k] * w[idx ? idx[k] : k] (rows stride bytes apart).
 * Prefetches run ahead up to row kp (>= k1): a caller that sums consecutive ranges (the chunks of
 * _axpy_rows) passes the end of all of them, so each range starts with its rows already coming. */
/* 1 where pi_axpy_rows_range takes the integer sums (axpyq.h): every type of
 * pi_axpyq_supported, except for the dense q8_0/q4_0 sum over every row (idx NULL: the down
 * projection of a dense decode), where the f32 path streamed SmolLM2's 612-byte rows from memory
 * faster (docs/benchmarks.md, "Integer AXPY kernels", session 7) */
static inline int pi_axpy_rows_int(int qtype, const int32_t *idx) {
    return pi_axpyq_supported(qtype) && (idx || (qtype != PI_Q8_0 && qtype != PI_Q4_0));
}

static inline void pi_axpy_rows_range(int qtype, const uint8_t *w, size_t stride, const float *coef,
                                      const int32_t *idx, long k0, long k1, long kp, float *out,
                                      int cols) {
    if (pi_axpy_rows_int(qtype, idx)) {
        pi_axpyq_rows_range(qtype, w, stride, coef, idx, k0, k1, kp, out, cols);
        return;
    }
    long k = k0;
    const size_t nbytes = pi_col_offset(qtype, cols);
    const long pd = 4 * ((pi_prefetch_dist(nbytes) + 3) / 4);
#define PI_ROW(j) (w + (idx ? (size_t)idx[j] : (size_t)(j)) * stride)
    const int near = nbytes <= PI_L1_PREFETCH_MAX_ROW;
    for (long j = k; near && j < k + 4 && j < kp; j++) pi_prefetch_l1(PI_ROW(j), nbytes);
    for (; k + 4 <= k1; k += 4) {
        for (long j = k + pd; j < k + pd + 4 && j < kp; j++) pi_prefetch_l2(PI_ROW(j), nbytes);
        for (long j = k + 4; near && j < k + 8 && j < kp; j++) pi_prefetch_l1(PI_ROW(j), nbytes);
        pi_axpy4_row(qtype, coef + k, PI_ROW(k), PI_ROW(k + 1), PI_ROW(k + 2), PI_ROW(k + 3), out,
                     cols);
    }
#undef PI_ROW
    for (; k < k1; k++)
        pi_axpy_row(qtype, coef[k], w + (idx ? (size_t)idx[k] : (size_t)k) * stride, out, cols);
}

/* out[0:n] = columns c0 .. c0+n-1 of row dequantized (q4_0/q8_0: exactly d*q in f32, as
 * gguf.quants.dequantize gives it; the types of qtypes.h within an f32 rounding of it). */
static inline void pi_dequant_cols(int qtype, const uint8_t *row, int c0, float *out, int n) {
    if (qtype == PI_F32) {
        memcpy(out, (const float *)row + c0, (size_t)n * 4);
        return;
    }
    memset(out, 0, (size_t)n * 4);
    pi_axpy_cols(qtype, 1.0f, row, c0, out, n);
}

static inline void pi_dequant_row(int qtype, const uint8_t *row, float *out, int n) {
    pi_dequant_cols(qtype, row, 0, out, n);
}

static inline void pi_add_f32(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] += a[i];
}

#endif /* PYINFER_SIMD_H */
