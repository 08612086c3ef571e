/* Row kernels for the ggml weight types users hold beyond f32/f16/q8_0/q4_0: Q4_1, Q5_0, Q5_1,
 * Q4_K, Q5_K, Q6_K (integer dots against the per-32-block q8 activation of simd.h) and BF16.
 * Included by simd.h (which defines the type ids, pi_load_d, pi_hsum).
 *
 * Block layouts (ggml-common.h; every f16 is IEEE half, little endian):
 *   Q4_1 (20 B / 32): f16 d, f16 m, u8 qs[16];  x[j] = d*(qs[j]&15) + m, x[j+16] = d*(qs[j]>>4) + m
 *   Q5_0 (22 B / 32): f16 d, u32 qh, u8 qs[16]; x[j] = d*((qs[j]&15 | bit j of qh << 4) - 16),
 *                     x[j+16] = d*((qs[j]>>4 | bit j+16 of qh << 4) - 16)
 *   Q5_1 (24 B / 32): f16 d, f16 m, u32 qh, u8 qs[16]; as Q5_0 without the -16, plus m
 *   Q4_K (144 B / 256): f16 d, f16 dmin, u8 scales[12] (8 six-bit scales and mins), u8 qs[128];
 *                     sub-block s (32 values) = d*sc_s*q - dmin*m_s, q = nibbles of qs[32*(s/2)..]
 *                     (low nibbles for even s, high for odd s)
 *   Q5_K (176 B / 256): f16 d, f16 dmin, scales[12], u8 qh[32], u8 qs[128]; as Q4_K with the fifth
 *                     bit of value l of sub-block s at bit s of qh[l]
 *   Q6_K (210 B / 256): u8 ql[128], u8 qh[64], i8 scales[16], f16 d; 16-value sub-blocks,
 *                     x = d*sc*(q - 32), q six bits (four from ql, two from qh)
 *   BF16 (2 B): the high half of an f32.
 *
 * Every quantized type is read in groups of 32 values ("group" g = values 32g..32g+31 of the
 * row, whatever the block size): value j = a_h * v_j + off with h = j / 16 (the two halves of a
 * Q6_K group have their own scales; other types have a_0 = a_1). v_j is a signed byte for Q6_K
 * (offset folded in) and an unsigned one otherwise (Q5_0: q with off = -16 d). A group of the row dotted with the
 * activation's q8 block g (scale dx, int8 y, s = 8 dx sum y from pi_quantize_q8) is then
 * dx * (a_0 sum_{j<16} v_j y_j + a_1 sum_{j>=16} v_j y_j) + off * s / 8, all integer inside the
 * sums, as llama.cpp's ggml_vec_dot_q4_1_q8_1 uses the block sum of y for the min term.
 */
#ifndef PYINFER_QTYPES_H
#define PYINFER_QTYPES_H

/* six-bit scale and min j (0..7) of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4) */
static inline void pi_k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Scales of group g: *a0, *a1 (halves) and *off; returns the group's block start. */
static inline __attribute__((always_inline)) const uint8_t *
pi_group_scales(const int t, const uint8_t *row, int g, float *a0, float *a1, float *off) {
    const uint8_t *blk;
    int sc, m;
    switch (t) {
    case PI_Q4_1:
        blk = row + 20 * (size_t)g;
        *a0 = *a1 = pi_load_d(blk);
        *off = pi_load_d(blk + 2);
        return blk;
    case PI_Q5_0: /* unsigned v = q (0..31) and the -16 as an offset, as Q4_1's min */
        blk = row + 22 * (size_t)g;
        *a0 = *a1 = pi_load_d(blk);
        *off = -16.0f * *a0;
        return blk;
    case PI_Q5_1:
        blk = row + 24 * (size_t)g;
        *a0 = *a1 = pi_load_d(blk);
        *off = pi_load_d(blk + 2);
        return blk;
    case PI_Q4_K:
    case PI_Q5_K:
        blk = row + (t == PI_Q4_K ? 144 : 176) * (size_t)(g / 8);
        pi_k4_scale_min(g % 8, blk + 4, &sc, &m);
        *a0 = *a1 = pi_load_d(blk) * (float)sc;
        *off = -(pi_load_d(blk + 2) * (float)m);
        return blk;
    default: { /* Q6_K */
        blk = row + 210 * (size_t)(g / 8);
        const int8_t *s = (const int8_t *)(blk + 192) + 8 * ((g % 8) / 4) + 2 * (g % 4);
        const float d = pi_load_d(blk + 208);
        *a0 = d * (float)s[0];
        *a1 = d * (float)s[1];
        *off = 0.0f;
        return blk;
    }
    }
}

/* Values v_j of group g (plain C; the SIMD path below must agree with it). */
static inline void pi_group_values_ref(const int t, const uint8_t *blk, int g, int *v) {
    int j;
    uint32_t qh;
    switch (t) {
    case PI_Q4_1:
        for (j = 0; j < 16; j++) {
            v[j] = blk[4 + j] & 15;
            v[j + 16] = blk[4 + j] >> 4;
        }
        return;
    case PI_Q5_0:
    case PI_Q5_1: {
        const uint8_t *qs = blk + (t == PI_Q5_0 ? 6 : 8);
        memcpy(&qh, blk + (t == PI_Q5_0 ? 2 : 4), 4);
        for (j = 0; j < 16; j++) {
            v[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
            v[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        return;
    }
    case PI_Q4_K:
    case PI_Q5_K: {
        const int k = g % 8;
        const uint8_t *qs = blk + (t == PI_Q4_K ? 16 : 48) + 32 * (k / 2);
        for (j = 0; j < 32; j++) {
            v[j] = (k & 1) ? qs[j] >> 4 : qs[j] & 15;
            if (t == PI_Q5_K) v[j] |= ((blk[16 + j] >> k) & 1) << 4;
        }
        return;
    }
    default: { /* Q6_K */
        const int k = g % 8, n = k / 4, r = k % 4;
        const uint8_t *ql = blk + 64 * n + 32 * (r & 1), *qh6 = blk + 128 + 32 * n;
        for (j = 0; j < 32; j++)
            v[j] = (((r >= 2) ? ql[j] >> 4 : ql[j] & 15) | (((qh6[j] >> (2 * r)) & 3) << 4)) - 32;
        return;
    }
    }
}

#if PI_SIMD
/* 16 bytes -> their 32 nibbles, low halves first (the Q4_1/Q5 order) */
static inline __m256i pi_nib16(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b),
                                                    _mm_srli_epi16(b, 4), 1),
                            _mm256_set1_epi8(15));
}

/* byte j = 0x10 where bit j of bits is set, else 0 */
static inline __m256i pi_bit4_32(uint32_t bits) {
    /* each 128-bit lane holds the four bytes of bits repeated; lane 0 picks bytes 0 and 1 (8
     * times each), lane 1 bytes 2 and 3 */
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10));
}

/* The 32 values v_j of group g as bytes (signed for Q6_K, unsigned otherwise). */
static inline __attribute__((always_inline)) __m256i pi_group_values(const int t,
                                                                      const uint8_t *blk, int g) {
    const __m256i m4 = _mm256_set1_epi8(15);
    uint32_t qh;
    switch (t) {
    case PI_Q4_1:
        return pi_nib16(blk + 4);
    case PI_Q5_0:
        memcpy(&qh, blk + 2, 4);
        return _mm256_or_si256(pi_nib16(blk + 6), pi_bit4_32(qh));
    case PI_Q5_1:
        memcpy(&qh, blk + 4, 4);
        return _mm256_or_si256(pi_nib16(blk + 8), pi_bit4_32(qh));
    case PI_Q4_K:
    case PI_Q5_K: {
        const int k = g % 8;
        const __m256i b = _mm256_loadu_si256(
            (const __m256i *)(blk + (t == PI_Q4_K ? 16 : 48) + 32 * (k / 2)));
        __m256i v = _mm256_and_si256((k & 1) ? _mm256_srli_epi16(b, 4) : b, m4);
        if (t == PI_Q5_K) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << k));
            const __m256i h = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(blk + 16)), bit);
            v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(h, bit), _mm256_set1_epi8(0x10)));
        }
        return v;
    }
    default: { /* Q6_K */
        const int k = g % 8, n = k / 4, r = k % 4;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32 * (r & 1)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        const __m256i lo = _mm256_and_si256(r >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * r)),
                                            _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    }
    }
}
#endif

/* Q5_0 reads as unsigned values with an offset of -16 d (pi_group_scales): the dot then takes
 * maddubs straight on the values (no sign trick) and the offset from the activation's block sum,
 * as q4_0's dot does; only Q6_K (two scales per group) keeps signed values. */
static inline int pi_signed_values(int t) { return t == PI_Q6_K; }

/* The 32-block types (Q4_1, Q5_0, Q5_1 with q8_0 and q4_0) are dotted by gemv.h, included
 * after this file; pi_dot_x / pi_dot4_x forward to it. */
static inline __attribute__((always_inline)) void pi_dot4t_leg(const int t, const uint8_t *row,
                                                               const float *xd, long xd_stride,
                                                               const int8_t *xq, long xq_stride,
                                                               int nb, float *out,
                                                               long out_stride);
static inline __attribute__((always_inline)) float pi_dot1_leg_ref(const int t, const uint8_t *row,
                                                                   const float *xd,
                                                                   const int8_t *xq, int nb);
/* The K-quants' one-row dot (gemv.h, the numerics of its 8-row GEMV and of the prefill GEMM) */
static inline __attribute__((always_inline)) float pi_dot1_k_ref(const int t, const uint8_t *row,
                                                                 const float *xd,
                                                                 const int8_t *xq, int nb);
#if PI_SIMD
static inline __attribute__((always_inline)) float pi_dot1_leg(const int t, const uint8_t *row,
                                                               const float *xd, const int8_t *xq,
                                                               int nb);
static inline __attribute__((always_inline)) float pi_dot1_k(const int t, const uint8_t *row,
                                                             const float *xd, const int8_t *xq,
                                                             int nb);

#endif

/* row . activation for the types above: nb groups of 32, (xd, xq) from pi_quantize_q8;
 * the K-quants by gemv.h's pi_dot1_k, the 32-block types by its pi_dot1_leg. */
static inline __attribute__((always_inline)) float pi_dot_x(const int t, const uint8_t *row,
                                                            const float *xd, const int8_t *xq,
                                                            int nb) {
    if (t == PI_Q4_K || t == PI_Q5_K || t == PI_Q6_K)
#if PI_SIMD
        return pi_dot1_k(t, row, xd, xq, nb);
    return pi_dot1_leg(t, row, xd, xq, nb);
#else
        return pi_dot1_k_ref(t, row, xd, xq, nb);
    return pi_dot1_leg_ref(t, row, xd, xq, nb);
#endif
}

/* row . four tokens' activations (prefill's per-token path), bit-identical to four pi_dot_x
 * calls (the K-quants: four one-row dots). */
static inline __attribute__((always_inline)) void
pi_dot4_x(const int t, const uint8_t *row, const float *xd, long xd_stride, const int8_t *xq,
          long xq_stride, int nb, float *out, long out_stride) {
    if (t == PI_Q4_K || t == PI_Q5_K || t == PI_Q6_K)
        for (int i = 0; i < 4; i++)
            out[i * out_stride] = pi_dot_x(t, row, xd + i * xd_stride, xq + i * xq_stride, nb);
    else
        pi_dot4t_leg(t, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride);
}

/* out[0 : 32*ng] += a * (groups g0 .. g0+ng-1 of row, dequantized) */
static inline __attribute__((always_inline)) void pi_axpy_x(const int t, float a,
                                                            const uint8_t *row, float *out,
                                                            int g0, int ng) {
    float a0, a1, off;
    for (int g = g0; g < g0 + ng; g++) {
        const uint8_t *blk = pi_group_scales(t, row, g, &a0, &a1, &off);
        float *o = out + 32 * (g - g0);
#if PI_SIMD
        const __m256i v = pi_group_values(t, blk, g);
        const __m128i vl = _mm256_castsi256_si128(v), vh = _mm256_extracti128_si256(v, 1);
        const __m256 s0 = _mm256_set1_ps(a * a0), s1 = _mm256_set1_ps(a * a1);
        const __m256 c = _mm256_set1_ps(a * off);
        __m256 f[4];
        if (pi_signed_values(t)) {
            f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(vl));
            f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(vl, 8)));
            f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(vh));
            f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(vh, 8)));
        } else {
            f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(vl));
            f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(vl, 8)));
            f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(vh));
            f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(vh, 8)));
        }
        for (int k = 0; k < 4; k++) {
            __m256 acc = _mm256_loadu_ps(o + 8 * k);
            if (!pi_signed_values(t)) acc = _mm256_add_ps(acc, c);
            _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(k < 2 ? s0 : s1, f[k], acc));
        }
#else
        int v[32];
        pi_group_values_ref(t, blk, g, v);
        for (int j = 0; j < 32; j++) o[j] += a * ((j < 16 ? a0 : a1) * (float)v[j] + off);
#endif
    }
}

/* out[0 : 32*nb] += sum_{r<4} a[r] * rw[r] (whole rows, dequantized): four rows per pass over
 * each group, so the 32 outputs are loaded and stored once per four rows (as pi_axpy4_row does
 * for q8_0/q4_0) and the offsets of the four rows (Q4_1/Q5_1 m, K-quant mins) are added as one
 * scalar per group. With AVX-512 one 512-bit convert takes a half group, which is also where
 * Q6_K's two sub-block scales change. */
static inline __attribute__((always_inline)) void pi_axpy4_x(const int t, const float *a,
                                                             const uint8_t *const *rw, float *out,
                                                             int nb) {
#if PI_SIMD
    const int sgn = pi_signed_values(t);
    for (int g = 0; g < nb; g++) {
        float *o = out + 32 * g;
        float a0, a1, off, c = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 acc0 = _mm512_loadu_ps(o), acc1 = _mm512_loadu_ps(o + 16);
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = pi_group_scales(t, rw[r], g, &a0, &a1, &off);
            const __m256i v = pi_group_values(t, blk, g);
            const __m128i vl = _mm256_castsi256_si128(v), vh = _mm256_extracti128_si256(v, 1);
            const __m512 f0 = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(vl) : _mm512_cvtepu8_epi32(vl));
            const __m512 f1 = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(vh) : _mm512_cvtepu8_epi32(vh));
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(a[r] * a0), f0, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(a[r] * a1), f1, acc1);
            c += a[r] * off;
        }
        if (!sgn) {
            acc0 = _mm512_add_ps(acc0, _mm512_set1_ps(c));
            acc1 = _mm512_add_ps(acc1, _mm512_set1_ps(c));
        }
        _mm512_storeu_ps(o, acc0);
        _mm512_storeu_ps(o + 16, acc1);
#else
        __m256 acc[4];
        for (int k = 0; k < 4; k++) acc[k] = _mm256_loadu_ps(o + 8 * k);
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = pi_group_scales(t, rw[r], g, &a0, &a1, &off);
            const __m256i v = pi_group_values(t, blk, g);
            const __m128i vl = _mm256_castsi256_si128(v), vh = _mm256_extracti128_si256(v, 1);
            const __m128i part[4] = {vl, _mm_srli_si128(vl, 8), vh, _mm_srli_si128(vh, 8)};
            const __m256 s0 = _mm256_set1_ps(a[r] * a0), s1 = _mm256_set1_ps(a[r] * a1);
            for (int k = 0; k < 4; k++) {
                const __m256 f = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(part[k])
                                                        : _mm256_cvtepu8_epi32(part[k]));
                acc[k] = _mm256_fmadd_ps(k < 2 ? s0 : s1, f, acc[k]);
            }
            c += a[r] * off;
        }
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(o + 8 * k, sgn ? acc[k] : _mm256_add_ps(acc[k], _mm256_set1_ps(c)));
#endif
    }
#else
    for (int r = 0; r < 4; r++) pi_axpy_x(t, a[r], rw[r], out, 0, nb);
#endif
}

/* pi_dot4_x for a run-time type id (one copy per type) */
static inline void pi_dot4_xrow(int qtype, const uint8_t *row, const float *xd, long xd_stride,
                                const int8_t *xq, long xq_stride, int nb, float *out,
                                long out_stride) {
    switch (qtype) {
    case PI_Q4_1: pi_dot4_x(PI_Q4_1, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride); break;
    case PI_Q5_0: pi_dot4_x(PI_Q5_0, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride); break;
    case PI_Q5_1: pi_dot4_x(PI_Q5_1, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride); break;
    case PI_Q4_K: pi_dot4_x(PI_Q4_K, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride); break;
    case PI_Q5_K: pi_dot4_x(PI_Q5_K, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride); break;
    default: pi_dot4_x(PI_Q6_K, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride); break;
    }
}

/* pi_axpy4_x for a run-time type id (one copy per type, the type a constant in each) */
static inline void pi_axpy4_xrow(int qtype, const float *a, const uint8_t *const *rw, float *out,
                                 int n) {
    switch (qtype) {
    case PI_Q4_1: pi_axpy4_x(PI_Q4_1, a, rw, out, n / PI_QK); break;
    case PI_Q5_0: pi_axpy4_x(PI_Q5_0, a, rw, out, n / PI_QK); break;
    case PI_Q5_1: pi_axpy4_x(PI_Q5_1, a, rw, out, n / PI_QK); break;
    case PI_Q4_K: pi_axpy4_x(PI_Q4_K, a, rw, out, n / PI_QK); break;
    case PI_Q5_K: pi_axpy4_x(PI_Q5_K, a, rw, out, n / PI_QK); break;
    default: pi_axpy4_x(PI_Q6_K, a, rw, out, n / PI_QK); break;
    }
}

/* ---- BF16 ---- */

static inline float pi_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float pi_dot_bf16(const uint16_t *w, const float *x, int n) {
    int i = 0;
    float s = 0.0f;
#if PI_SIMD
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
#define PI_B(k) _mm256_castsi256_ps(_mm256_slli_epi32(                                        \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i + (k)))), 16))
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(PI_B(0), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(PI_B(8), _mm256_loadu_ps(x + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(PI_B(0), _mm256_loadu_ps(x + i), s0);
    s = pi_hsum(_mm256_add_ps(s0, s1));
#endif
    for (; i < n; i++) s += pi_bf16_to_f32(w[i]) * x[i];
    return s;
}

static inline void pi_axpy_bf16(float a, const uint16_t *w, float *out, int n) {
    int i = 0;
#if PI_SIMD
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(va, PI_B(0), _mm256_loadu_ps(out + i)));
#undef PI_B
#endif
    for (; i < n; i++) out[i] += a * pi_bf16_to_f32(w[i]);
}

#endif /* PYINFER_QTYPES_H */
