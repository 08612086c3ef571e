/* Integer-accumulating row sums over transposed matrices (issues 11 and 12):
 *
 *     out[0:cols] += sum_k coef[k] * W[row_k, 0:cols]
 *
 * the kernel of the down projection over ffn_down_t and of every input-sparse projection
 * (attn_qkv_t, attn_output_t, ffn_gate_up_t). Included by simd.h; pi_axpy_rows_range sends the
 * types of pi_axpyq_supported here (except a dense q8_0/q4_0 sum over every row, measured faster
 * on the f32 path) and keeps its f32 path (each weight converted to f32 and multiplied-added,
 * about 15 operations per 32 weights) for the others.
 *
 * Method. A quantized row is, per 32-column block b, W[j, 32b + i] = a[j,b] * v[j,b,i] + off[j,b]
 * with integer values v (qtypes.h's pi_group_scales / pi_group_values; q8_0: a = d, v = q signed,
 * off = 0; q4_0: v = q unsigned, off = -8 d). The rows are taken in groups of PI_AXQ_G (16)
 * consecutive kept rows, counted from the start of the caller's range (so a group never depends
 * on the thread count: _axpy_rows cuts its ranges by the number of rows alone). For each group
 * and block the row coefficients c[j] = coef[j] * a[j,b] are quantized to int16 with one scale
 *
 *     s = max_j |c[j]| / 32767,   c16[j] = round(c[j] / s),   |c16[j] * s - c[j]| <= s / 2,
 *
 * two rows' value bytes are interleaved and widened to int16 pairs, and _mm256_madd_epi16
 * against the broadcast pair (c16[j], c16[j+1]) sums two rows per instruction into int32 (no
 * overflow: |sum| <= 16 * 32767 * 255 < 2^31). At the end of the group the int32 sums are
 * converted to f32 and scaled by s (an FMA per 8 columns). Offsets that are a multiple of a
 * (q4_0: -8 a, Q5_0: -16 a) are subtracted as integers from the same quantized coefficients;
 * the others (the mins of Q4_1, Q5_1, Q4_K, Q5_K) are summed in f32 from the exact coefficients.
 * About 8 integer operations per 32 weights plus the per-block scale (as the int8 GEMV dots).
 * With 256-bit VNNI (PI_AXQ_VNNI: simd.h PI_VNNI256) four rows' bytes are transposed into each int32 lane instead
 * and each c16 is split into its bytes, c16 = 256 hi + lo (hi = c16 >> 8 signed, lo = c16 & 255
 * unsigned): one dpbusd sums lo times four rows' values, another the values times
 * hi (q8_0's signed values enter that one as v + 128, and 128 * sum(hi) is taken off), and the
 * two int32 sums combine as (hi sum << 8) + lo sum: the same integers, so the same bits, as the
 * madd path (|hi sum| <= 16 * 128 * 255, shifted < 2^28).
 *
 * Error bound against the exact f32 sum, for column i of block b:
 *
 *     |err_i| <= (max_j |coef[j] a[j,b]| / 65534) * sum_j |v'[j,b,i]|  (+ f32 rounding)
 *
 * with v' the value the offset is taken from (q8_0: q; q4_0: q - 8; Q5_0: q - 16; Q4_1/Q5_1/
 * Q4_K/Q5_K: v) and the max over the rows of one group (so at most the max over all summed
 * rows): 2^-16 of the largest term per block, against 2^-8 for the int8 activation of the GEMV
 * dots (llama.cpp's q8 blocks). tests/test_kernels.py checks this bound against the NumPy twin.
 * Q6_K (two scales per 32 values) and the float types keep the f32 path.
 */
#ifndef PYINFER_AXPYQ_H
#define PYINFER_AXPYQ_H

#define PI_AXQ_G 16 /* rows per group (two 8-float coefficient vectors) */

/* 256-bit VNNI (AVX512-VNNI with VL, or AVX-VNNI: simd.h PI_VNNI256): four rows per dpbusd
 * on each int16 coefficient split into its bytes (see pi_axq_group); the same integer sums, so
 * the same bits, as the madd path of an AVX2 build. */
#if PI_VNNI256
#define PI_AXQ_VNNI 1
#else
#define PI_AXQ_VNNI 0
#endif

/* 1 where pi_axpyq_rows_range handles qtype (integer sums); 0: the f32 path */
static inline int pi_axpyq_supported(int qtype) {
#if PI_SIMD
    return qtype == PI_Q8_0 || qtype == PI_Q4_0 || qtype == PI_Q4_1 || qtype == PI_Q5_0 ||
           qtype == PI_Q5_1 || qtype == PI_Q4_K || qtype == PI_Q5_K;
#else
    (void)qtype;
    return 0;
#endif
}

#if PI_SIMD

/* Scale a of block g of a row and its f32 offset (0 where pi_axq_int_offset covers it); returns
 * the pointer pi_axq_values reads the block's values from. */
static inline __attribute__((always_inline)) const uint8_t *
pi_axq_scale(const int t, const uint8_t *row, int g, float *a, float *off) {
    float a1;
    switch (t) {
    case PI_Q8_0:
        *off = 0.0f;
        *a = pi_load_d(row + 34 * (size_t)g);
        return row + 34 * (size_t)g;
    case PI_Q4_0:
        *off = 0.0f;
        *a = pi_load_d(row + 18 * (size_t)g);
        return row + 18 * (size_t)g;
    case PI_Q5_0: {
        const uint8_t *blk = pi_group_scales(t, row, g, a, &a1, off);
        *off = 0.0f; /* -16 a: pi_axq_int_offset */
        return blk;
    }
    default:
        return pi_group_scales(t, row, g, a, &a1, off);
    }
}

/* Where block g of a row starts (what pi_axq_values reads) */
static inline __attribute__((always_inline)) const uint8_t *pi_axq_block(const int t,
                                                                         const uint8_t *row, int g) {
    switch (t) {
    case PI_Q8_0: return row + 34 * (size_t)g;
    case PI_Q4_0: return row + 18 * (size_t)g;
    case PI_Q4_1: return row + 20 * (size_t)g;
    case PI_Q5_0: return row + 22 * (size_t)g;
    case PI_Q5_1: return row + 24 * (size_t)g;
    case PI_Q4_K: return row + 144 * (size_t)(g / 8);
    default: return row + 176 * (size_t)(g / 8); /* Q5_K */
    }
}

/* The integer offset k of types whose offset is -k * a (0: none, or an f32 offset) */
static inline int pi_axq_int_offset(const int t) {
    return t == PI_Q4_0 ? 8 : (t == PI_Q5_0 ? 16 : 0);
}

/* The 32 values of block g as bytes, signed for q8_0 and unsigned otherwise. */
static inline __attribute__((always_inline)) __m256i pi_axq_values(const int t,
                                                                    const uint8_t *blk, int g) {
    switch (t) {
    case PI_Q8_0: return _mm256_loadu_si256((const __m256i *)(blk + 2));
    case PI_Q4_0: return pi_nib16(blk + 2);
    default: return pi_group_values(t, blk, g);
    }
}

/* Blocks per pass of pi_axq_group: the group's coefficients for PI_AXQ_NB blocks are quantized
 * first (a throughput loop over small arrays in L1), then summed block by block, so the scale
 * computation's latency chain (max, divide, round) never stalls the integer sums. */
#define PI_AXQ_NB 32

/* Bytes per block of the types whose block starts with its f16 scale and has no f32 offset (their
 * scales are read eight blocks at a time); 0 for the others. */
static inline int pi_axq_dfirst_bytes(const int t) {
    return t == PI_Q8_0 ? 34 : (t == PI_Q4_0 ? 18 : (t == PI_Q5_0 ? 22 : 0));
}

/* out[0:32*nb] += sum_{j < ng} coef[j] * rows[j] for one group of ng <= PI_AXQ_G rows. */
static inline __attribute__((always_inline)) void
pi_axq_group(const int t, const uint8_t *const *rows, const float *coef, int ng, float *out,
             int nb, const uint8_t *const *pf) {
    const int ioff = pi_axq_int_offset(t), bb = pi_axq_dfirst_bytes(t);
    const size_t b32 = pi_col_offset(t, 256) / 8; /* bytes per 32 values */
    const __m256i zero = _mm256_setzero_si256();
    const int np = (ng + 1) / 2;
    float cf[PI_AXQ_G][PI_AXQ_NB] __attribute__((aligned(32)));  /* coef[j] * a[j, b] */
#if PI_AXQ_VNNI
    /* bytes of c16[4p..4p+3]: low bytes (unsigned) and high bytes (signed, c16 >> 8) */
    int32_t qlo[PI_AXQ_G / 4][PI_AXQ_NB] __attribute__((aligned(32)));
    int32_t qhi[PI_AXQ_G / 4][PI_AXQ_NB] __attribute__((aligned(32)));
    const int nq = (ng + 3) / 4;
    (void)np;
#else
    int32_t pair[PI_AXQ_G / 2][PI_AXQ_NB] __attribute__((aligned(32)));  /* (c16[2p], c16[2p+1]) */
#endif
    float sc[PI_AXQ_NB] __attribute__((aligned(32)));    /* s of each block */
    float offs[PI_AXQ_NB] __attribute__((aligned(32)));  /* f32 offset sum of each block */
    int32_t corr[PI_AXQ_NB] __attribute__((aligned(32)));  /* ioff * sum_j c16[j] */
    const uint8_t *rw[PI_AXQ_G];
    for (int j = 0; j < PI_AXQ_G; j++) rw[j] = rows[j < ng ? j : 0];
    for (int b0 = 0; b0 < nb; b0 += PI_AXQ_NB) {
        const int nbc = nb - b0 < PI_AXQ_NB ? nb - b0 : PI_AXQ_NB;
        const int nbv = (nbc + 7) & ~7;  /* the vector loops below run over whole eights */
        /* 1. c = coef * a per row and block (and the f32 offsets) */
        for (int b = 0; b < nbv; b++) offs[b] = 0.0f;
        for (int j = 0; j < PI_AXQ_G; j++) {
            int b = 0;
            if (j >= ng) {
                for (; b < nbv; b++) cf[j][b] = 0.0f;
                continue;
            }
            if (bb) {
                const __m256 cj = _mm256_set1_ps(coef[j]);
                const uint8_t *d = rows[j] + (size_t)bb * b0;
                for (; b + 8 <= nbc; b += 8) {
                    /* eight scalar loads into one vector (vpinsrw): a gather measured slower,
                     * and eight 2-byte stores read back as one 16-byte load stall */
                    const uint8_t *db = d + (size_t)bb * b;
                    uint16_t h0, h1, h2, h3, h4, h5, h6, h7;
                    memcpy(&h0, db, 2);
                    memcpy(&h1, db + bb, 2);
                    memcpy(&h2, db + 2 * bb, 2);
                    memcpy(&h3, db + 3 * bb, 2);
                    memcpy(&h4, db + 4 * bb, 2);
                    memcpy(&h5, db + 5 * bb, 2);
                    memcpy(&h6, db + 6 * bb, 2);
                    memcpy(&h7, db + 7 * bb, 2);
                    const __m256 a = _mm256_cvtph_ps(_mm_setr_epi16(
                        (short)h0, (short)h1, (short)h2, (short)h3, (short)h4, (short)h5,
                        (short)h6, (short)h7));
                    _mm256_store_ps(&cf[j][b], _mm256_mul_ps(cj, a));
                }
            }
            for (; b < nbc; b++) {
                float a, off;
                pi_axq_scale(t, rows[j], b0 + b, &a, &off);
                cf[j][b] = coef[j] * a;
                offs[b] += coef[j] * off;
            }
            for (; b < nbv; b++) cf[j][b] = 0.0f;
        }
        /* 2. per block: s = max_j |c| / 32767, c16 = round(c / s), packed as int16 pairs */
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int b = 0; b < nbv; b += 8) {
            __m256 mx = _mm256_setzero_ps();
            for (int j = 0; j < PI_AXQ_G; j++)
                mx = pi_absmax8(mx, _mm256_andnot_ps(sign, _mm256_load_ps(&cf[j][b])));  /* NaN stays */
            const __m256 pos = _mm256_cmp_ps(mx, _mm256_setzero_ps(), _CMP_GT_OQ);
            const __m256 inv = _mm256_and_ps(pos, _mm256_div_ps(_mm256_set1_ps(32767.0f), mx));
            _mm256_store_ps(sc + b, _mm256_mul_ps(mx, _mm256_set1_ps(1.0f / 32767.0f)));
            __m256i isum = zero;
#if PI_AXQ_VNNI
            /* c16 = 256 hi + lo with hi = c16 >> 8 (signed byte) and lo = c16 & 255 (unsigned
             * byte), four rows' bytes per int32 (row 4p + r in byte r) */
            const __m256i m8 = _mm256_set1_epi32(0xff);
            for (int p = 0; p < nq; p++) {
                __m256i c[4];
                for (int r = 0; r < 4; r++)
                    c[r] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(&cf[4 * p + r][b]), inv));
                for (int r = 0; r < 4; r++)  /* q8_0: sum of the high bytes (see step 3) */
                    isum = _mm256_add_epi32(isum, t == PI_Q8_0 ? _mm256_srai_epi32(c[r], 8) : c[r]);
                const __m256i lo = _mm256_or_si256(
                    _mm256_or_si256(_mm256_and_si256(c[0], m8),
                                    _mm256_slli_epi32(_mm256_and_si256(c[1], m8), 8)),
                    _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c[2], m8), 16),
                                    _mm256_slli_epi32(c[3], 24)));
                const __m256i hi = _mm256_or_si256(
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c[0], 8), m8),
                                    _mm256_and_si256(c[1], _mm256_set1_epi32(0xff00))),
                    _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(c[2], 8), _mm256_set1_epi32(0xff0000)),
                                    _mm256_and_si256(_mm256_slli_epi32(c[3], 16),
                                                     _mm256_set1_epi32((int)0xff000000u))));
                _mm256_store_si256((__m256i *)&qlo[p][b], lo);
                _mm256_store_si256((__m256i *)&qhi[p][b], hi);
            }
            _mm256_store_si256((__m256i *)(corr + b),
                               _mm256_mullo_epi32(isum, _mm256_set1_epi32(t == PI_Q8_0 ? 32768 : ioff)));
#else
            for (int p = 0; p < np; p++) {
                const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(&cf[2 * p][b]), inv));
                const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(&cf[2 * p + 1][b]), inv));
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(lo, hi));
                _mm256_store_si256((__m256i *)&pair[p][b],
                                   _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA));
            }
            _mm256_store_si256((__m256i *)(corr + b), _mm256_mullo_epi32(isum, _mm256_set1_epi32(ioff)));
#endif
        }
        /* 3. integer sums, two rows per madd, and the f32 flush of each block */
        for (int b = 0; b < nbc; b++) {
            const int g = b0 + b;
            __m256i acc0 = zero, acc1 = zero, acc2 = zero, acc3 = zero;
            /* block g of the rows about 16 KiB ahead into L2, one line per row and block, spread
             * over the integer sums (a burst of whole rows per group, as the f32 path issues,
             * left the miss buffers idle during the sums: 12 against 16.4 GB/s from DRAM) */
            for (int j = 0; j < PI_AXQ_G; j++)  /* (pf[j] is never NULL: no test per line) */
                _mm_prefetch((const char *)(pf[j] + b32 * g), _MM_HINT_T1);
#if PI_AXQ_VNNI
            /* four rows per dpbusd (u8 x s8, sums of four products into int32): the rows' bytes
             * transposed so that each int32 holds one column of rows 4p..4p+3; the low
             * coefficient bytes (u8) times the values (s8), the values (u8) times the high
             * bytes (s8). q8_0's signed values enter the second as v + 128 (v ^ 0x80), whose
             * extra 128 * sum(hi) corr takes off; the other types' values are 0..31. */
            __m256i hac0 = zero, hac1 = zero, hac2 = zero, hac3 = zero;
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            for (int p = 0; p < nq; p++) {
                const __m256i v0 = pi_axq_values(t, pi_axq_block(t, rw[4 * p], g), g);
                const __m256i v1 = pi_axq_values(t, pi_axq_block(t, rw[4 * p + 1], g), g);
                const __m256i v2 = pi_axq_values(t, pi_axq_block(t, rw[4 * p + 2], g), g);
                const __m256i v3 = pi_axq_values(t, pi_axq_block(t, rw[4 * p + 3], g), g);
                const __m256i a01l = _mm256_unpacklo_epi8(v0, v1), a01h = _mm256_unpackhi_epi8(v0, v1);
                const __m256i a23l = _mm256_unpacklo_epi8(v2, v3), a23h = _mm256_unpackhi_epi8(v2, v3);
                /* columns 0-3|16-19, 4-7|20-23, 8-11|24-27, 12-15|28-31 (the layout below) */
                const __m256i t0 = _mm256_unpacklo_epi16(a01l, a23l), t1 = _mm256_unpackhi_epi16(a01l, a23l);
                const __m256i t2 = _mm256_unpacklo_epi16(a01h, a23h), t3 = _mm256_unpackhi_epi16(a01h, a23h);
                const __m256i cl = _mm256_set1_epi32(qlo[p][b]), ch = _mm256_set1_epi32(qhi[p][b]);
                acc0 = pi_dpbusd256(acc0, cl, t0);
                acc1 = pi_dpbusd256(acc1, cl, t1);
                acc2 = pi_dpbusd256(acc2, cl, t2);
                acc3 = pi_dpbusd256(acc3, cl, t3);
                if (t == PI_Q8_0) {
                    hac0 = pi_dpbusd256(hac0, _mm256_xor_si256(t0, flip), ch);
                    hac1 = pi_dpbusd256(hac1, _mm256_xor_si256(t1, flip), ch);
                    hac2 = pi_dpbusd256(hac2, _mm256_xor_si256(t2, flip), ch);
                    hac3 = pi_dpbusd256(hac3, _mm256_xor_si256(t3, flip), ch);
                } else {
                    hac0 = pi_dpbusd256(hac0, t0, ch);
                    hac1 = pi_dpbusd256(hac1, t1, ch);
                    hac2 = pi_dpbusd256(hac2, t2, ch);
                    hac3 = pi_dpbusd256(hac3, t3, ch);
                }
            }
            acc0 = _mm256_add_epi32(acc0, _mm256_slli_epi32(hac0, 8));
            acc1 = _mm256_add_epi32(acc1, _mm256_slli_epi32(hac1, 8));
            acc2 = _mm256_add_epi32(acc2, _mm256_slli_epi32(hac2, 8));
            acc3 = _mm256_add_epi32(acc3, _mm256_slli_epi32(hac3, 8));
            if (ioff || t == PI_Q8_0) {
#else
            for (int p = 0; p < np; p++) {
                const uint8_t *blk0 = pi_axq_block(t, rw[2 * p], g);
                const uint8_t *blk1 = pi_axq_block(t, rw[2 * p + 1], g);
                const __m256i v0 = pi_axq_values(t, blk0, g), v1 = pi_axq_values(t, blk1, g);
                /* bytes (row 2p, row 2p+1) per column: lane 0 columns 0-7 | lane 1 16-23 (lo),
                 * 8-15 | 24-31 (hi) */
                const __m256i lo = _mm256_unpacklo_epi8(v0, v1), hi = _mm256_unpackhi_epi8(v0, v1);
                const __m256i slo = t == PI_Q8_0 ? _mm256_cmpgt_epi8(zero, lo) : zero;
                const __m256i shi = t == PI_Q8_0 ? _mm256_cmpgt_epi8(zero, hi) : zero;
                const __m256i cp = _mm256_set1_epi32(pair[p][b]);
                /* int16 pairs, columns 0-3|16-19, 4-7|20-23, 8-11|24-27, 12-15|28-31 */
                acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, slo), cp));
                acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, slo), cp));
                acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, shi), cp));
                acc3 = _mm256_add_epi32(acc3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, shi), cp));
            }
            if (ioff) {
#endif
                const __m256i c = _mm256_set1_epi32(corr[b]);
                acc0 = _mm256_sub_epi32(acc0, c);
                acc1 = _mm256_sub_epi32(acc1, c);
                acc2 = _mm256_sub_epi32(acc2, c);
                acc3 = _mm256_sub_epi32(acc3, c);
            }
            const __m256 f0 = _mm256_cvtepi32_ps(acc0), f1 = _mm256_cvtepi32_ps(acc1);
            const __m256 f2 = _mm256_cvtepi32_ps(acc2), f3 = _mm256_cvtepi32_ps(acc3);
            const __m256 s = _mm256_set1_ps(sc[b]);
            float *o = out + 32 * g;
            __m256 r[4];
            r[0] = _mm256_permute2f128_ps(f0, f1, 0x20);
            r[1] = _mm256_permute2f128_ps(f2, f3, 0x20);
            r[2] = _mm256_permute2f128_ps(f0, f1, 0x31);
            r[3] = _mm256_permute2f128_ps(f2, f3, 0x31);
            for (int k = 0; k < 4; k++) {
                __m256 acc = _mm256_loadu_ps(o + 8 * k);
                if (!bb) acc = _mm256_add_ps(acc, _mm256_set1_ps(offs[b]));
                _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(s, r[k], acc));
            }
        }
    }
}

static inline __attribute__((always_inline)) void
pi_axq_range(const int t, const uint8_t *w, size_t stride, const float *coef, const int32_t *idx,
             long k0, long k1, long kp, float *out, int cols) {
    /* prefetch distance: about 16 KiB of rows ahead, in whole groups */
    const long pd = PI_AXQ_G * ((pi_prefetch_dist(pi_col_offset(t, cols)) + PI_AXQ_G - 1) / PI_AXQ_G);
    const uint8_t *rows[PI_AXQ_G], *pf[PI_AXQ_G];
#define PI_AXQ_ROW(j) (w + (idx ? (size_t)idx[j] : (size_t)(j)) * stride)
    /* nothing ran ahead of the range's first pd rows (a thread's first chunk, or its columns of
     * a column split): ask for them all now rather than at the pace of the first groups */
    for (long j = k0; j < k0 + pd && j < kp; j++)
        pi_prefetch_l2(PI_AXQ_ROW(j), pi_col_offset(t, cols));
    for (long k = k0; k < k1; k += PI_AXQ_G) {
        const int ng = (int)(k1 - k < PI_AXQ_G ? k1 - k : PI_AXQ_G);
        for (int j = 0; j < PI_AXQ_G; j++) {
            rows[j] = j < ng ? PI_AXQ_ROW(k + j) : NULL;
            /* past the last row: the group's first row, whose lines are read now anyway (a
             * harmless prefetch instead of a NULL test on each of 16 lines per block) */
            pf[j] = k + pd + j < kp ? PI_AXQ_ROW(k + pd + j) : PI_AXQ_ROW(k);
        }
        pi_axq_group(t, rows, coef + k, ng, out, cols / PI_QK, pf);
    }
#undef PI_AXQ_ROW
}

#endif /* PI_SIMD */

/* out[0:cols] += sum_{k0 <= k < k1} coef[k] * w[idx ? idx[k] : k] for a type of
 * pi_axpyq_supported (the rows' prefetches run ahead up to row kp, as pi_axpy_rows_range's). */
static inline void pi_axpyq_rows_range(int qtype, const uint8_t *w, size_t stride,
                                       const float *coef, const int32_t *idx, long k0, long k1,
                                       long kp, float *out, int cols) {
#if PI_SIMD
    switch (qtype) {
    case PI_Q8_0: pi_axq_range(PI_Q8_0, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    case PI_Q4_0: pi_axq_range(PI_Q4_0, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    case PI_Q4_1: pi_axq_range(PI_Q4_1, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    case PI_Q5_0: pi_axq_range(PI_Q5_0, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    case PI_Q5_1: pi_axq_range(PI_Q5_1, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    case PI_Q4_K: pi_axq_range(PI_Q4_K, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    case PI_Q5_K: pi_axq_range(PI_Q5_K, w, stride, coef, idx, k0, k1, kp, out, cols); break;
    default: break;
    }
#else
    (void)qtype; (void)w; (void)stride; (void)coef; (void)idx; (void)k0; (void)k1; (void)kp;
    (void)out; (void)cols;
#endif
}

/* Columns per unit of a column split of pi_axpyq_rows_range (one block; a K-quant super-block):
 * every column's sum is the same whatever the split (the groups run over rows only). */
static inline int pi_axpyq_unit_cols(int qtype) {
    return qtype == PI_Q4_K || qtype == PI_Q5_K ? 256 : 32;
}

/* out[c0:c1] += sum_{k < n} coef[k] * w[idx ? idx[k] : k][c0:c1], c0 and c1 multiples of
 * pi_axpyq_unit_cols: one thread's share of a row sum split by columns. */
static inline void pi_axpyq_rows_cols(int qtype, const uint8_t *w, size_t stride,
                                      const float *coef, const int32_t *idx, long n, float *out,
                                      int c0, int c1) {
    pi_axpyq_rows_range(qtype, w + pi_col_offset(qtype, c0), stride, coef, idx, 0, n, n, out + c0,
                        c1 - c0);
}

#endif /* PYINFER_AXPYQ_H */
