/* Decode GEMV for the 32-block weight types (q8_0, q4_0, Q4_1, Q5_0, Q5_1): eight weight rows
 * against one activation per pass. Included by simd.h after qtypes.h.
 *
 * Why eight rows: a one-row dot pays, per 32-value block, a scale conversion, a broadcast and an
 * int->float conversion, and per row a horizontal sum; on an AVX2 core without VNNI those cost
 * about as much as the integer products. Here the eight rows' integer block sums are reduced
 * into one vector (lane i = row i) with horizontal adds, so the int->float conversion, the scale
 * product and the FMA are done once per block for eight rows and no horizontal sum is left at
 * the end (the idea of llama.cpp's interleaved q4_0x8 GEMV, ggml-cpu/repack.cpp, without
 * repacking the rows: the file is read as stored). Four-bit rows are read two at a time: one
 * 32-byte register holds the 16 packed bytes of row a and of row a+4, so one shift and two masks
 * unpack two rows against the activation's halves broadcast to both lanes.
 *
 * Numerics (one definition for every path: the 8-row kernel, the one-row kernel and the tails;
 * and the same as the prefill GEMM of gemm.h for these five types, so decode and prefill give the
 * same bits): with I_b the exact integer dot of block b (unsigned values u for the 4/5-bit
 * types, signed q for q8_0) and (dx_b, xs_b) the activation's block scale and 8 dx_b sum y,
 * one accumulator in block order:
 *     s = fma(dw_b * dx_b, I_b, s);  s = fma(off_b / 8, xs_b, s)     (the second not for q8_0)
 *     off_b = -8 dw_b (q4_0), -16 dw_b (Q5_0), m_b (Q4_1, Q5_1); off_b / 8 is exact.
 * Each row's result depends only on its own blocks, never on the rows it shares a pass with, the
 * thread count or the row order (matvec, gather_matvec and the one-row dot agree bit for bit).
 *
 * Integer ranges: maddubs pairs of a 5-bit value and |y| <= 127 stay under 2^13, so sums of up
 * to 8 products are added in 16 bits (4-bit values: 16 products) before widening; q8_0's pairs
 * (|w| <= 128) are widened at once.
 */
#ifndef PYINFER_GEMV_H
#define PYINFER_GEMV_H

#ifndef PI_GEMV_AHEAD
#define PI_GEMV_AHEAD 16384
#endif
#ifndef PI_GEMV_HINT
#define PI_GEMV_HINT _MM_HINT_T0
#endif

/* 1 for the types pi_gemv8 / pi_dot1_leg handle */
static inline int pi_gemv8_supported(int qtype) {
    return qtype == PI_Q8_0 || qtype == PI_Q4_0 || qtype == PI_Q4_1 || qtype == PI_Q5_0 ||
           qtype == PI_Q5_1;
}

static inline __attribute__((always_inline)) int pi_leg_bytes(const int t) {
    return t == PI_Q8_0 ? 34 : t == PI_Q4_0 ? 18 : t == PI_Q4_1 ? 20 : t == PI_Q5_0 ? 22 : 24;
}

/* offset of the packed nibbles and of the fifth bits (Q5) in a block */
static inline __attribute__((always_inline)) int pi_leg_qs(const int t) {
    return t == PI_Q4_0 ? 2 : t == PI_Q4_1 ? 4 : t == PI_Q5_0 ? 6 : 8;
}
static inline __attribute__((always_inline)) int pi_leg_qh(const int t) {
    return t == PI_Q5_0 ? 2 : 4;
}

/* off_b / dw_b of the types whose offset is a multiple of the scale (0: the offset is m_b) */
static inline __attribute__((always_inline)) float pi_leg_offk(const int t) {
    return t == PI_Q4_0 ? -8.0f : t == PI_Q5_0 ? -16.0f : 0.0f;
}

/* One row, plain C (the no-SIMD build and the reference of the SIMD paths). */
static inline __attribute__((always_inline)) float pi_dot1_leg_ref(const int t, const uint8_t *row,
                                                                   const float *xd,
                                                                   const int8_t *xq, int nb) {
    const int bs = pi_leg_bytes(t);
    float s = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)bs * b;
        const int8_t *y = xq + 32 * b;
        const float dw = pi_load_d(blk);
        int isum = 0;
        if (t == PI_Q8_0) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++) isum += (int)q[j] * (int)y[j];
        } else {
            const uint8_t *qs = blk + pi_leg_qs(t);
            uint32_t qh = 0;
            if (t == PI_Q5_0 || t == PI_Q5_1) memcpy(&qh, blk + pi_leg_qh(t), 4);
            for (int j = 0; j < 16; j++) {
                isum += (int)((qs[j] & 15) | (((qh >> j) & 1) << 4)) * (int)y[j];
                isum += (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * (int)y[j + 16];
            }
        }
        s = fmaf(dw * xd[b], (float)isum, s);
        if (t != PI_Q8_0) {
            const float off = (t == PI_Q4_1 || t == PI_Q5_1) ? pi_load_d(blk + 2)
                                                              : pi_leg_offk(t) * dw;
            s = fmaf(0.125f * off, xd[nb + b], s);
        }
    }
    return s;
}

#if PI_SIMD

static inline __attribute__((always_inline)) uint16_t pi_ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* 32 bytes, 0x10 at byte j where bit (lo ? j : j + 16) of a (lane 0) or of b (lane 1) is set:
 * the fifth bits of the low (lo) or high nibbles of two Q5 blocks, in the pair layout */
static inline __m256i pi_bit4_pair(uint32_t a, uint32_t b, const int lo) {
    const __m256i pick = lo ? _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                            : _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtsi32_si128((int)a)),
                                              _mm_cvtsi32_si128((int)b), 1);
    const __m256i m = _mm256_and_si256(_mm256_shuffle_epi8(v, pick), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(m, bit), _mm256_set1_epi8(0x10));
}

/* Exact integer block dots of 8 rows (block at rw[i] + off) with one 32-value activation block
 * y: lane i = row i. */
static inline __attribute__((always_inline)) __m256i pi_isum8_leg(const int t,
                                                                  const uint8_t *const *rw,
                                                                  size_t off, const int8_t *y) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (t == PI_Q8_0) {
        const __m256i yv = _mm256_loadu_si256((const __m256i *)y);
        __m256i p[8];
        for (int i = 0; i < 8; i++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(rw[i] + off + 2));
            p[i] = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(yv, w)), ones);
        }
        /* hadd tree: h[k] lanes = rows 4(k/?)...: [r0 r1 r2 r3 | r0 r1 r2 r3] and rows 4..7 */
        const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                            _mm256_hadd_epi32(p[2], p[3]));
        const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]),
                                            _mm256_hadd_epi32(p[6], p[7]));
        return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                _mm256_permute2x128_si256(a, b, 0x31));
    }
    /* pairs (row i, row i+4) share a register: lane 0 row i, lane 1 row i+4 */
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)y));
    const __m256i yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(y + 16)));
    const int qs = pi_leg_qs(t);
    __m256i v[4];
    for (int i = 0; i < 4; i++) {
        const __m256i q = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rw[i] + off + qs))),
            _mm_loadu_si128((const __m128i *)(rw[i + 4] + off + qs)), 1);
        __m256i lo = _mm256_and_si256(q, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (t == PI_Q5_0 || t == PI_Q5_1) {
            uint32_t ha, hb;
            memcpy(&ha, rw[i] + off + pi_leg_qh(t), 4);
            memcpy(&hb, rw[i + 4] + off + pi_leg_qh(t), 4);
            lo = _mm256_or_si256(lo, pi_bit4_pair(ha, hb, 1));
            hi = _mm256_or_si256(hi, pi_bit4_pair(ha, hb, 0));
        }
        /* 16-bit lanes: 4 products each (<= 4 * 31 * 127) */
        v[i] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
    }
    if (t == PI_Q4_0 || t == PI_Q4_1) {
        /* 4-bit: 16 products (<= 16 * 15 * 127 < 2^15) in 16 bits, then widened once */
        const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(v[0], v[1]),
                                            _mm256_hadd_epi16(v[2], v[3]));
        return _mm256_madd_epi16(h, ones);
    }
    /* 5-bit: 8 products in 16 bits, then 32 */
    const __m256i a = _mm256_madd_epi16(_mm256_hadd_epi16(v[0], v[1]), ones);
    const __m256i b = _mm256_madd_epi16(_mm256_hadd_epi16(v[2], v[3]), ones);
    return _mm256_hadd_epi32(a, b);
}

/* 8 f16 at rw[i] + off -> f32 lanes */
static inline __attribute__((always_inline)) __m256 pi_f16x8(const uint8_t *const *rw, size_t off) {
    return _mm256_cvtph_ps(_mm_setr_epi16(
        (short)pi_ld16(rw[0] + off), (short)pi_ld16(rw[1] + off), (short)pi_ld16(rw[2] + off),
        (short)pi_ld16(rw[3] + off), (short)pi_ld16(rw[4] + off), (short)pi_ld16(rw[5] + off),
        (short)pi_ld16(rw[6] + off), (short)pi_ld16(rw[7] + off)));
}

/* lane i = row rw[i] . activation (xd, xq), nb blocks */
static inline __attribute__((always_inline)) __m256 pi_dot8_leg(const int t,
                                                                const uint8_t *const *rw,
                                                                const float *xd, const int8_t *xq,
                                                                int nb, const uint8_t *pf,
                                                                size_t pf_len) {
    const int bs = pi_leg_bytes(t);
    __m256 s = _mm256_setzero_ps();
    /* prefetch [pf, pf + pf_len) spread over the blocks, a few lines per block */
    const uintptr_t pf0 = (uintptr_t)pf & ~(uintptr_t)63, pf1 = (uintptr_t)pf + pf_len;
    const size_t pf_step = pf ? ((pf1 - pf0) / (size_t)nb + 63) & ~(size_t)63 : 0;
    for (int b = 0; b < nb; b++) {
        const size_t off = (size_t)bs * b;
        if (pf)
            for (uintptr_t a = pf0 + pf_step * b; a < pf0 + pf_step * (b + 1) && a < pf1; a += 64)
                _mm_prefetch((const char *)a, PI_GEMV_HINT);
        const __m256i is = pi_isum8_leg(t, rw, off, xq + 32 * b);
        const __m256 dw = pi_f16x8(rw, off);
        s = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[b])), _mm256_cvtepi32_ps(is), s);
        if (t == PI_Q4_1 || t == PI_Q5_1)
            s = _mm256_fmadd_ps(_mm256_mul_ps(pi_f16x8(rw, off + 2), _mm256_set1_ps(0.125f)),
                                _mm256_set1_ps(xd[nb + b]), s);
        else if (t != PI_Q8_0)
            s = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(0.125f * pi_leg_offk(t))),
                                _mm256_set1_ps(xd[nb + b]), s);
    }
    return s;
}

/* One row, SIMD: the same per-block numbers as pi_dot8_leg's lanes */
static inline __attribute__((always_inline)) float pi_dot1_leg(const int t, const uint8_t *row,
                                                               const float *xd, const int8_t *xq,
                                                               int nb) {
    const int bs = pi_leg_bytes(t);
    const __m256i ones = _mm256_set1_epi16(1);
    float s = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)bs * b;
        const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
        __m256i p;
        if (t == PI_Q8_0) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
        } else {
            __m256i u = pi_nib16(blk + pi_leg_qs(t));
            if (t == PI_Q5_0 || t == PI_Q5_1) {
                uint32_t qh;
                memcpy(&qh, blk + pi_leg_qh(t), 4);
                u = _mm256_or_si256(u, pi_bit4_32(qh));
            }
            p = _mm256_maddubs_epi16(u, y);
        }
        const __m256i p32 = _mm256_madd_epi16(p, ones);
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(p32), _mm256_extracti128_si256(p32, 1));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4e));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1));
        const float dw = pi_load_d(blk);
        s = fmaf(dw * xd[b], (float)_mm_cvtsi128_si32(q), s);
        if (t == PI_Q4_1 || t == PI_Q5_1)
            s = fmaf(0.125f * pi_load_d(blk + 2), xd[nb + b], s);
        else if (t != PI_Q8_0)
            s = fmaf(0.125f * pi_leg_offk(t) * dw, xd[nb + b], s);
    }
    return s;
}

/* One row . four tokens (prefill's per-token path): token i's activation (xd + i * xd_stride,
 * xq + i * xq_stride), result out[i * out_stride]. The row's block is unpacked once for the four
 * tokens and their integer sums reduced into one vector (lane = token); each lane gets the same
 * fma sequence as pi_dot1_leg, so prefill and decode agree bit for bit. */
static inline __attribute__((always_inline)) void pi_dot4t_leg(const int t, const uint8_t *row,
                                                               const float *xd, long xd_stride,
                                                               const int8_t *xq, long xq_stride,
                                                               int nb, float *out,
                                                               long out_stride) {
    const int bs = pi_leg_bytes(t);
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 s = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)bs * b;
        __m256i p[4], u = _mm256_setzero_si256(), w = _mm256_setzero_si256();
        if (t == PI_Q8_0) {
            w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            u = _mm256_sign_epi8(w, w);
        } else {
            u = pi_nib16(blk + pi_leg_qs(t));
            if (t == PI_Q5_0 || t == PI_Q5_1) {
                uint32_t qh;
                memcpy(&qh, blk + pi_leg_qh(t), 4);
                u = _mm256_or_si256(u, pi_bit4_32(qh));
            }
        }
        for (int i = 0; i < 4; i++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + i * xq_stride + 32 * b));
            p[i] = t == PI_Q8_0 ? _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(y, w)), ones)
                                : _mm256_maddubs_epi16(u, y);
        }
        __m256i h;
        if (t == PI_Q8_0) /* lanes [t0 t1 t2 t3 | t0 t1 t2 t3] of int32 */
            h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        else /* 16 bits: 8 products (<= 8 * 31 * 127) per lane, then widened */
            h = _mm256_madd_epi16(
                _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])),
                ones);
        const __m128i is = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        const float dw = pi_load_d(blk);
        const __m128 dx = _mm_setr_ps(xd[b], xd[xd_stride + b], xd[2 * xd_stride + b],
                                      xd[3 * xd_stride + b]);
        s = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(dw), dx), _mm_cvtepi32_ps(is), s);
        if (t != PI_Q8_0) {
            const float off = (t == PI_Q4_1 || t == PI_Q5_1) ? pi_load_d(blk + 2)
                                                              : pi_leg_offk(t) * dw;
            const __m128 xs = _mm_setr_ps(xd[nb + b], xd[xd_stride + nb + b],
                                          xd[2 * xd_stride + nb + b], xd[3 * xd_stride + nb + b]);
            s = _mm_fmadd_ps(_mm_set1_ps(0.125f * off), xs, s);
        }
    }
    float r[4];
    _mm_storeu_ps(r, s);
    for (int i = 0; i < 4; i++) out[i * out_stride] = r[i];
}

#else
#define pi_dot1_leg pi_dot1_leg_ref
static inline __attribute__((always_inline)) void pi_dot4t_leg(const int t, const uint8_t *row,
                                                               const float *xd, long xd_stride,
                                                               const int8_t *xq, long xq_stride,
                                                               int nb, float *out,
                                                               long out_stride) {
    for (int i = 0; i < 4; i++)
        out[i * out_stride] = pi_dot1_leg_ref(t, row, xd + i * xd_stride, xq + i * xq_stride, nb);
}
#endif /* PI_SIMD */

/* rows 8g .. min(8g + 8, n) - 1 of a GEMV (row k = w + (idx ? idx[k] : k) * stride):
 * out[k] = row . activation. Missing rows of the last group repeat its last row (results
 * dropped), which cannot change the others' lanes. */
static inline __attribute__((always_inline)) void pi_gemv8_t(const int t, const uint8_t *w,
                                                             size_t stride, const int32_t *idx,
                                                             long g, long n, const float *xd,
                                                             const int8_t *xq, int nb,
                                                             float *out) {
    const long k0 = 8 * g, m = n - k0 < 8 ? n - k0 : 8;
#if PI_SIMD
    const uint8_t *rw[8];
    for (int i = 0; i < 8; i++) {
        const long k = k0 + (i < m ? i : m - 1);
        rw[i] = w + (size_t)(idx ? idx[k] : k) * stride;
    }
    const uint8_t *pf = NULL;
    size_t pf_len = 0;
    if (!idx) {
        /* eight rows read side by side are eight streams that the hardware prefetcher follows
         * badly (measured: 0.6-0.9x the one-row loop from DRAM without this); the group's rows
         * are contiguous, so fetch the group about PI_GEMV_AHEAD bytes ahead, spread over the
         * blocks of this one */
        const size_t gb = 8 * stride;
        const long ahead = gb >= PI_GEMV_AHEAD ? 1 : (long)(PI_GEMV_AHEAD / gb);
        const long k1 = 8 * (g + ahead);
        if (k1 < n) {
            pf = w + (size_t)k1 * stride;
            pf_len = (size_t)(n - k1 < 8 ? n - k1 : 8) * stride;
        }
    }
    const __m256 r = pi_dot8_leg(t, rw, xd, xq, nb, pf, pf_len);
    if (m == 8) {
        _mm256_storeu_ps(out + k0, r);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, r);
        for (long i = 0; i < m; i++) out[k0 + i] = tmp[i];
    }
#else
    for (long i = 0; i < m; i++) {
        const long k = k0 + i;
        out[k] = pi_dot1_leg_ref(t, w + (size_t)(idx ? idx[k] : k) * stride, xd, xq, nb);
    }
#endif
}

static inline void pi_prefetch_l2(const uint8_t *p, size_t nbytes); /* simd.h, below */
static inline void pi_prefetch_l1(const uint8_t *p, size_t nbytes);

/* pi_gemv8_t for a run-time type id (one copy per type) */
static inline void pi_gemv8(int qtype, const uint8_t *w, size_t stride, const int32_t *idx,
                            long g, long n, const float *xd, const int8_t *xq, int nb,
                            float *out, long pd) {
    /* gathered rows come from memory in no order the hardware can guess: fetch the rows pd
     * entries ahead into L2 (as gather_matvec's one-row loop did) */
    if (idx && pd > 0) {
        for (long k = 8 * g + pd; k < 8 * g + 8 + pd && k < n; k++)
            pi_prefetch_l2(w + (size_t)idx[k] * stride, stride);
        /* and the next group's rows to L1, as the one-row loop fetched the row two ahead */
        if (stride <= 2048)
            for (long k = 8 * g + 8; k < 8 * g + 16 && k < n; k++)
                pi_prefetch_l1(w + (size_t)idx[k] * stride, stride);
    }
    switch (qtype) {
    case PI_Q4_0: pi_gemv8_t(PI_Q4_0, w, stride, idx, g, n, xd, xq, nb, out); break;
    case PI_Q4_1: pi_gemv8_t(PI_Q4_1, w, stride, idx, g, n, xd, xq, nb, out); break;
    case PI_Q5_0: pi_gemv8_t(PI_Q5_0, w, stride, idx, g, n, xd, xq, nb, out); break;
    case PI_Q5_1: pi_gemv8_t(PI_Q5_1, w, stride, idx, g, n, xd, xq, nb, out); break;
    default: pi_gemv8_t(PI_Q8_0, w, stride, idx, g, n, xd, xq, nb, out); break;
    }
}

/* The names kernels.pyx's prefill (matmul, its --old-prefill path) calls for q8_0 and q4_0 */
static inline void pi_dot4_q8_0(const uint8_t *row, const float *xd, long xd_stride,
                                const int8_t *xq, long xq_stride, int nb, float *out,
                                long out_stride) {
    pi_dot4t_leg(PI_Q8_0, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride);
}
static inline void pi_dot4_q4_0(const uint8_t *row, const float *xd, long xd_stride,
                                const int8_t *xq, long xq_stride, int nb, float *out,
                                long out_stride) {
    pi_dot4t_leg(PI_Q4_0, row, xd, xd_stride, xq, xq_stride, nb, out, out_stride);
}

#endif /* PYINFER_GEMV_H */
