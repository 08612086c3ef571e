/* Decode GEMV for the quantized weight types: the 32-block ones (q8_0, q4_0, Q4_1, Q5_0, Q5_1)
 * and the K-quants (Q4_K, Q5_K, Q6_K; section at the end), eight weight rows against one
 * activation per pass. Included by simd.h after qtypes.h.
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
 * AVX-512 VNNI builds run q8_0, Q5_0 and the K-quants through 512-bit versions of the eight-row
 * kernel (pi_dot8_leg512, pi_dot8_k512, pi_dot8_q6k512: two blocks or groups per register) with
 * the same per-lane numbers.
 *
 * Integer ranges: maddubs pairs of a 5-bit value and |y| <= 127 stay under 2^13, so sums of up
 * to 8 products are added in 16 bits (4-bit values: 16 products) before widening; q8_0's pairs
 * (|w| <= 128) are widened at once; K-quant values (<= 63) are widened at once (VNNI: dpbusd).
 */
#ifndef PYINFER_GEMV_H
#define PYINFER_GEMV_H

/* how far ahead matvec prefetches its groups, in bytes (rounded down to whole groups, at least
 * one). 8 KiB: on the Zen 4 box of session 9, SmolLM2 q4_0 decode 1.05-1.09x and q8_0 0.98-1.04x
 * at one thread against 16 KiB (ab_decode, three runs); only groups under 8 KiB (rows under
 * 1 KiB: 576- and 640-wide models) see a difference. Session 7's AVX2 box measured 8, 16 and
 * 32 KiB alike. */
#ifndef PI_GEMV_AHEAD
#define PI_GEMV_AHEAD 8192
#endif
#ifndef PI_GEMV_HINT
#define PI_GEMV_HINT _MM_HINT_T0
#endif
/* bytes of L1 the group being read plus the range prefetched ahead may take (of 32 KiB) */
#ifndef PI_GEMV_L1_BUDGET
#define PI_GEMV_L1_BUDGET 24576
#endif

/* 1 for the types pi_gemv8 handles: the 32-block types (pi_dot8_leg) and the K-quants
 * (pi_dot8_k, below) */
static inline int pi_gemv8_supported(int qtype) {
    return qtype == PI_Q8_0 || qtype == PI_Q4_0 || qtype == PI_Q4_1 || qtype == PI_Q5_0 ||
           qtype == PI_Q5_1 || qtype == PI_Q4_K || qtype == PI_Q5_K || qtype == PI_Q6_K;
}

static inline __attribute__((always_inline)) int pi_is_k(const int t) {
    return t == PI_Q4_K || t == PI_Q5_K || t == PI_Q6_K;
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
#if PI_VNNI256
        /* int32 lanes: 8 products each, four sums a row */
        v[i] = pi_dpbusd256(pi_dpbusd256(_mm256_setzero_si256(), lo, ylo), hi, yhi);
#else
        /* 16-bit lanes: 4 products each (<= 4 * 31 * 127) */
        v[i] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
#endif
    }
#if PI_VNNI256
    /* lanes (row i, row i + 4) of v[i] -> [r0 r1 r2 r3 | r4 r5 r6 r7]: the same integers */
    (void)ones;
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
#else
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
#endif
}

/* 8 f16 at rw[i] + off -> f32 lanes */
static inline __attribute__((always_inline)) __m256 pi_f16x8(const uint8_t *const *rw, size_t off) {
    return _mm256_cvtph_ps(_mm_setr_epi16(
        (short)pi_ld16(rw[0] + off), (short)pi_ld16(rw[1] + off), (short)pi_ld16(rw[2] + off),
        (short)pi_ld16(rw[3] + off), (short)pi_ld16(rw[4] + off), (short)pi_ld16(rw[5] + off),
        (short)pi_ld16(rw[6] + off), (short)pi_ld16(rw[7] + off)));
}

/* The rows a later group will read, prefetched while this group is dotted: n byte ranges
 * [p[i], p[i] + len) (one contiguous range for matvec's group ahead, up to eight scattered rows
 * for a gather), their cache lines issued `step` per block so the prefetches spread over the
 * group's blocks instead of queueing behind each other at its start (a burst of 50-100 line
 * prefetches stalls the loads that follow it: docs/benchmarks.md, session 8). */
typedef struct {
    const uint8_t *p[16];
    size_t len;
    int n, r, step, l2; /* bit i of l2: range i with hint T1 (to L2) instead of PI_GEMV_HINT */
    uintptr_t a, end;
} pi_pf_t;

/* set up pf over its n ranges for nb blocks (n = 0: nothing to fetch) */
static inline void pi_pf_init(pi_pf_t *pf, int nb) {
    size_t lines = 0;
    for (int i = 0; i < pf->n; i++)
        lines += (((uintptr_t)pf->p[i] + pf->len + 63) >> 6) - ((uintptr_t)pf->p[i] >> 6);
    pf->step = (int)((lines + (size_t)nb - 1) / (size_t)nb);
    pf->r = 0;
    pf->a = pf->n ? (uintptr_t)pf->p[0] & ~(uintptr_t)63 : 0;
    pf->end = pf->n ? (uintptr_t)pf->p[0] + pf->len : 0;
}

/* the next step lines of pf */
static inline __attribute__((always_inline)) void pi_pf_next(pi_pf_t *pf) {
    for (int k = 0; k < pf->step; k++) {
        if (pf->a >= pf->end) {
            if (++pf->r >= pf->n) {
                pf->step = 0;
                return;
            }
            pf->a = (uintptr_t)pf->p[pf->r] & ~(uintptr_t)63;
            pf->end = (uintptr_t)pf->p[pf->r] + pf->len;
        }
        if ((pf->l2 >> pf->r) & 1)
            _mm_prefetch((const char *)pf->a, _MM_HINT_T1);
        else
            _mm_prefetch((const char *)pf->a, PI_GEMV_HINT);
        pf->a += 64;
    }
}

/* s + lane i = row rw[i]'s block b . activation block b (and the block's offset term): one step
 * of pi_dot8_leg256's per-lane chain, also the odd last block of the 512-bit kernel */
static inline __attribute__((always_inline)) __m256 pi_dot8_leg_block(const int t,
                                                                   const uint8_t *const *rw,
                                                                   const float *xd,
                                                                   const int8_t *xq, int nb,
                                                                   int b, pi_pf_t *pf, __m256 s) {
    const size_t off = (size_t)pi_leg_bytes(t) * b;
    pi_pf_next(pf);
    const __m256i is = pi_isum8_leg(t, rw, off, xq + 32 * b);
    const __m256 dw = pi_f16x8(rw, off);
    s = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[b])), _mm256_cvtepi32_ps(is), s);
    if (t == PI_Q4_1 || t == PI_Q5_1)
        s = _mm256_fmadd_ps(_mm256_mul_ps(pi_f16x8(rw, off + 2), _mm256_set1_ps(0.125f)),
                            _mm256_set1_ps(xd[nb + b]), s);
    else if (t != PI_Q8_0)
        s = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(0.125f * pi_leg_offk(t))),
                            _mm256_set1_ps(xd[nb + b]), s);
    return s;
}

/* lane i = row rw[i] . activation (xd, xq), nb blocks */
static inline __attribute__((always_inline)) __m256 pi_dot8_leg256(const int t,
                                                                const uint8_t *const *rw,
                                                                const float *xd, const int8_t *xq,
                                                                int nb, pi_pf_t *pf) {
    __m256 s = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) s = pi_dot8_leg_block(t, rw, xd, xq, nb, b, pf, s);
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PI_GEMV512 1
#ifndef PI_GEMV512_MASK
#define PI_GEMV512_MASK \
    ((1 << PI_Q8_0) | (1 << PI_Q5_0) | (1 << PI_Q4_K) | (1 << PI_Q5_K) | (1 << PI_Q6_K))
#endif
/* The 512-bit eight-row kernel (AVX-512 F/BW/VL/VNNI builds): two blocks per pass, each zmm
 * holding one row's blocks b (low 256 bits) and b + 1 (high), so the activation's two int8
 * blocks are one 64-byte load and one _mm512_dpbusd_epi32 does a row's 64 products; the eight
 * rows' lane sums are reduced by one unpack/add tree for both blocks (the 256-bit path pays
 * maddubs + madd per block and hadd trees of 3 uops each on Zen 4). The per-lane float chain is
 * pi_dot8_leg256's, block by block, so the bits are the same (the odd last block goes through
 * pi_isum8_leg). q8_0 is signed and AVX-512 has no vpsignb: dpbusd of (w xor 0x80) = w + 128
 * against y, started from -128 sum y (exact in int32). Nibbles: each 16-byte run of packed
 * values is broadcast to two 128-bit lanes and the second shifted right by 4, so the lanes are
 * [lo b, hi b, lo b+1, hi b+1], the order of the activation's 64 bytes; Q5's fifth bits are
 * one 64-bit mask (block b's qh word low, b + 1's high) that sets 0x10.
 * On Zen 4 (512-bit ops split in two 256-bit halves) this measured, cache-resident, 1536 x 576:
 * q8_0 1.21x, Q5_0 1.09x, Q5_1 0.98-1.0x, q4_0 0.90x, Q4_1 0.88x the 256-bit kernel (whose
 * 16-bit sums of two rows per register are cheaper than a 32-bit reduction); Q4_K 1.13x and
 * Q5_K 1.06x, Q6_K 1.05x (1024 x 2048, pi_dot8_k512 and pi_dot8_q6k512 below). So by default
 * q8_0, Q5_0 and the K-quants take the 512-bit kernels (PI_GEMV512_MASK, bit t for type id t);
 * docs/benchmarks.md, session 9. */

/* 8 zmm of 16 int32 (row i: lanes 0-7 block b, 8-15 block b + 1) -> lanes 0-7 = rows 0-7 of
 * block b, lanes 8-15 = rows 0-7 of block b + 1 (each the sum of its row's eight lanes) */
static inline __attribute__((always_inline)) __m512i pi_reduce8x2(const __m512i *p) {
    __m512i t[4];
    for (int k = 0; k < 4; k++) /* per 128-bit lane: [r0 (a0+a2), r1 (..), r0 (a1+a3), r1 (..)] */
        t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * k], p[2 * k + 1]),
                                _mm512_unpackhi_epi32(p[2 * k], p[2 * k + 1]));
    /* per 128-bit lane j: [r0 r1 r2 r3] (u) and [r4 r5 r6 r7] (v), each the sum of lane j */
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]),
                                       _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]),
                                       _mm512_unpackhi_epi64(t[2], t[3]));
    /* lanes 0, 1 of a row are block b, 2, 3 block b + 1: [u0+u1, u2+u3, v0+v1, v2+v3] */
    const __m512i z = _mm512_add_epi32(_mm512_shuffle_i32x4(u, v, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_shuffle_i32x4(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

/* the 32 unsigned values of blocks b and b + 1 (packed nibbles at q0 and q1; Q5: fifth bits
 * h0, h1) in the activation's byte order */
static inline __attribute__((always_inline)) __m512i pi_nib2x(const int t, const uint8_t *q0,
                                                              const uint8_t *q1, const uint8_t *h0,
                                                              const uint8_t *h1) {
    __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q0));
    z = _mm512_mask_broadcast_i32x4(z, 0xff00, _mm_loadu_si128((const __m128i *)q1));
    /* 32-bit lanes 4-7 and 12-15: the high nibbles */
    z = _mm512_and_si512(_mm512_mask_srli_epi32(z, 0xf0f0, z, 4), _mm512_set1_epi8(15));
    if (t == PI_Q5_0 || t == PI_Q5_1) {
        uint32_t a, b;
        memcpy(&a, h0, 4);
        memcpy(&b, h1, 4);
        const uint64_t k = (uint64_t)a | ((uint64_t)b << 32);
        z = _mm512_mask_blend_epi8(_cvtu64_mask64(k), z,
                                   _mm512_or_si512(z, _mm512_set1_epi8(0x10)));
    }
    return z;
}

/* the f16 at rw[i] + off (lanes 0-7) and rw[i] + off + bs (lanes 8-15) as f32: packed four
 * to a 64-bit word in general registers (the scalar pipes are idle here), so the vector side
 * takes 2 moves, 2 inserts and one conversion instead of 14 word inserts */
static inline __attribute__((always_inline)) __m512 pi_f16x16(const uint8_t *const *rw, size_t off,
                                                              size_t bs) {
    uint64_t q[4];
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 2; k++) {
            const size_t o = off + bs * h;
            q[2 * h + k] = (uint64_t)pi_ld16(rw[4 * k] + o) |
                           ((uint64_t)pi_ld16(rw[4 * k + 1] + o) << 16) |
                           ((uint64_t)pi_ld16(rw[4 * k + 2] + o) << 32) |
                           ((uint64_t)pi_ld16(rw[4 * k + 3] + o) << 48);
        }
    return _mm512_cvtph_ps(_mm256_setr_epi64x((long long)q[0], (long long)q[1], (long long)q[2],
                                              (long long)q[3]));
}

static inline __attribute__((always_inline)) __m256 pi_dot8_leg512(const int t,
                                                                   const uint8_t *const *rw,
                                                                   const float *xd,
                                                                   const int8_t *xq, int nb,
                                                                   pi_pf_t *pf) {
    const int bs = pi_leg_bytes(t);
    __m256 s = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const size_t off = (size_t)bs * b;
        pi_pf_next(pf);
        pi_pf_next(pf);
        const __m512i y = _mm512_loadu_si512((const void *)(xq + 32 * b));
        __m512i p[8];
        if (t == PI_Q8_0) {
            /* (w + 128) . y - 128 sum y: the correction rides in as the accumulator's start
             * (lane sums of a block's eight lanes = -128 sum y of the block) */
            const __m512i c = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                      _mm512_set1_epi8(1), y), 7));
            const __m512i sg = _mm512_set1_epi8((char)0x80);
            for (int i = 0; i < 8; i++) {
                const __m512i w = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rw[i] + off + 2))),
                    _mm256_loadu_si256((const __m256i *)(rw[i] + off + bs + 2)), 1);
                p[i] = _mm512_dpbusd_epi32(c, _mm512_xor_si512(w, sg), y);
            }
        } else {
            const int qs = pi_leg_qs(t), qh = pi_leg_qh(t);
            for (int i = 0; i < 8; i++)
                p[i] = _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(),
                    pi_nib2x(t, rw[i] + off + qs, rw[i] + off + bs + qs, rw[i] + off + qh,
                             rw[i] + off + bs + qh),
                    y);
        }
        const __m512 f = _mm512_cvtepi32_ps(pi_reduce8x2(p));
        const __m512 d16 = pi_f16x16(rw, off, bs);
        const __m512 m16 = t == PI_Q4_1 || t == PI_Q5_1 ? pi_f16x16(rw, off + 2, bs)
                                                        : _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const __m256 dw = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d16), 1))
                                : _mm512_castps512_ps256(d16);
            const __m256 is = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))
                                : _mm512_castps512_ps256(f);
            s = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[b + h])), is, s);
            if (t == PI_Q4_1 || t == PI_Q5_1) {
                const __m256 m = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m16), 1))
                                   : _mm512_castps512_ps256(m16);
                s = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_set1_ps(0.125f)),
                                    _mm256_set1_ps(xd[nb + b + h]), s);
            } else if (t != PI_Q8_0)
                s = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(0.125f * pi_leg_offk(t))),
                                    _mm256_set1_ps(xd[nb + b + h]), s);
        }
    }
    if (b < nb) /* the last block of an odd count */
        s = pi_dot8_leg_block(t, rw, xd, xq, nb, b, pf, s);
    return s;
}

/* lane i = row rw[i] . activation: the 512-bit kernel for the types of PI_GEMV512_MASK (bit t
 * for type id t) */
static inline __attribute__((always_inline)) __m256 pi_dot8_leg(const int t,
                                                                const uint8_t *const *rw,
                                                                const float *xd, const int8_t *xq,
                                                                int nb, pi_pf_t *pf) {
    if ((PI_GEMV512_MASK >> t) & 1) return pi_dot8_leg512(t, rw, xd, xq, nb, pf);
    return pi_dot8_leg256(t, rw, xd, xq, nb, pf);
}
#else
#define PI_GEMV512 0
#define pi_dot8_leg pi_dot8_leg256
#endif

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

/* ---- K-quants (Q4_K, Q5_K, Q6_K): 256-value super-blocks of eight 32-value groups ----
 *
 * The prefill GEMM's numerics (gemm.h pi_tile8_x), so decode and prefill give the same bits for
 * these types too: with a_g the group's f32 scale (Q4_K/Q5_K: d * sc_g; Q6_K: d * sc per 16-value
 * half), I_g the exact integer dot of its values with the activation's q8 block g (scale dx_g,
 * xs_g = 8 dx_g sum y), one accumulator in group order:
 *     Q4_K, Q5_K: s = fma(a_g dx_g, I_g, s);  s = fma(off_g / 8, xs_g, s),  off_g = -(dmin * m_g)
 *     Q6_K:       s = fma(a_g0 dx_g, I_g0, s); s = fma(a_g1 dx_g, I_g1, s)  (halves of group g)
 * The eight-row kernel keeps one lane per row; the one-row dot reduces the eight groups of a
 * super-block into one vector (lane = group) and then runs the same chain in scalar order. */

/* bytes per super-block, and where a Q4_K/Q5_K super-block's quants start */
static inline __attribute__((always_inline)) int pi_k_bytes(const int t) {
    return t == PI_Q4_K ? 144 : t == PI_Q5_K ? 176 : 210;
}

/* One row, plain C (the no-SIMD build and the reference of the SIMD paths). */
static inline __attribute__((always_inline)) float pi_dot1_k_ref(const int t, const uint8_t *row,
                                                                 const float *xd,
                                                                 const int8_t *xq, int nb) {
    float s = 0.0f, a0, a1, off;
    int v[32];
    for (int g = 0; g < nb; g++) {
        const uint8_t *blk = pi_group_scales(t, row, g, &a0, &a1, &off);
        pi_group_values_ref(t, blk, g, v);
        const int8_t *y = xq + 32 * g;
        int i0 = 0, i1 = 0;
        for (int j = 0; j < 16; j++) {
            i0 += v[j] * y[j];
            i1 += v[j + 16] * y[j + 16];
        }
        if (t == PI_Q6_K) {
            s = fmaf(a0 * xd[g], (float)i0, s);
            s = fmaf(a1 * xd[g], (float)i1, s);
        } else {
            s = fmaf(a0 * xd[g], (float)(i0 + i1), s);
            s = fmaf(0.125f * off, xd[nb + g], s);
        }
    }
    return s;
}

#if PI_SIMD
/* 8 int32: sums of 4 products of unsigned bytes u (<= 63) and signed y (|y| <= 127) */
static inline __attribute__((always_inline)) __m256i pi_dot_u8(__m256i u, __m256i y) {
#if PI_VNNI256
    return pi_dpbusd256(_mm256_setzero_si256(), u, y);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
#endif
}

/* Eight vectors of 8 int32 -> (lo, hi): lane i of lo = sum of the four low-128 lanes of p[i],
 * lane i of hi = sum of its four high-128 lanes (the two 16-value halves of a group). */
static inline __attribute__((always_inline)) void pi_reduce8_halves(const __m256i *p, __m256i *lo,
                                                                    __m256i *hi) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                        _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]),
                                        _mm256_hadd_epi32(p[6], p[7]));
    *lo = _mm256_permute2x128_si256(a, b, 0x20);
    *hi = _mm256_permute2x128_si256(a, b, 0x31);
}

/* The unsigned values of group g (0..7) of a super-block at blk: Q4_K/Q5_K v (0..31), Q6_K
 * q = v + 32 (0..63); layouts in qtypes.h */
static inline __attribute__((always_inline)) __m256i pi_k_values(const int t, const uint8_t *blk,
                                                                 const int g) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (t == PI_Q6_K) {
        const int n = g / 4, r = g % 4;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32 * (r & 1)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        /* bits 2r, 2r+1 of each qh byte to bits 4, 5 (the 16-bit shifts move bits across bytes
         * only into positions the mask drops) */
        const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, 2 * r), 4),
                                            _mm256_set1_epi8(0x30));
        return _mm256_or_si256(_mm256_and_si256(r >= 2 ? _mm256_srli_epi16(l, 4) : l, m4), hi);
    }
    const __m256i b = _mm256_loadu_si256(
        (const __m256i *)(blk + (t == PI_Q4_K ? 16 : 48) + 32 * (g / 2)));
    __m256i v = _mm256_and_si256((g & 1) ? _mm256_srli_epi16(b, 4) : b, m4);
    if (t == PI_Q5_K) { /* bit g of qh[j] is value j's fifth bit: move it to bit 4 */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const __m256i h = g <= 4 ? _mm256_slli_epi16(qh, 4 - g) : _mm256_srli_epi16(qh, g - 4);
        v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    return v;
}

/* 8 unaligned 32-bit words at rw[i] + off -> int32 lanes */
static inline __attribute__((always_inline)) __m256i pi_ld32x8(const uint8_t *const *rw,
                                                               size_t off) {
    uint32_t u[8];
    for (int i = 0; i < 8; i++) memcpy(&u[i], rw[i] + off, 4);
    return _mm256_loadu_si256((const __m256i *)u);
}

/* byte k (0..3) of each int32 lane, unsigned / signed, as f32 */
static inline __attribute__((always_inline)) __m256 pi_byte_u(__m256i v, const int k) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(255)));
}
static inline __attribute__((always_inline)) __m256 pi_byte_s(__m256i v, const int k) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * k), 24));
}

/* Six-bit scales (*scl: groups 0-3, *sch: 4-7, byte g % 4 of each lane) and mins (*mnl, *mnh)
 * of eight Q4_K/Q5_K super-blocks from their 12 scale bytes as three words per lane u0, u1, u2
 * (ggml's get_scale_min_k4, qtypes.h pi_k4_scale_min, for four groups at once). */
static inline __attribute__((always_inline)) void pi_k4_scales8(__m256i u0, __m256i u1, __m256i u2,
                                                                __m256i *scl, __m256i *sch,
                                                                __m256i *mnl, __m256i *mnh) {
    const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), t2 = _mm256_set1_epi8(0x30);
    *scl = _mm256_and_si256(u0, m6);
    *mnl = _mm256_and_si256(u1, m6);
    /* the top two bits of bytes 0-3 (4-7) are bits 4, 5 of the high scales (mins) */
    *sch = _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), t2));
    *mnh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi32(u1, 2), t2));
}

/* s + group g of a Q4_K/Q5_K super-block for eight rows (the chain of pi_dot8_k and
 * pi_dot8_k512, one place): isum the rows' integer sums of the group, x = xd[8 sb + g] its
 * activation scale, xm = xd[nb + 8 sb + g] its activation sum for the mins. */
static inline __attribute__((always_inline)) __m256 pi_k4_group(__m256 s, __m256 d, __m256 dmin,
                                                                __m256i scl, __m256i sch,
                                                                __m256i mnl, __m256i mnh, int g,
                                                                __m256 isum, float x, float xm) {
    const __m256 a = _mm256_mul_ps(d, pi_byte_u(g < 4 ? scl : sch, g % 4));
    /* off / 8 = -(dmin m) / 8, exact as 0.125 * off */
    const __m256 o8 = _mm256_mul_ps(_mm256_mul_ps(dmin, pi_byte_u(g < 4 ? mnl : mnh, g % 4)),
                                    _mm256_set1_ps(-0.125f));
    s = _mm256_fmadd_ps(_mm256_mul_ps(a, _mm256_set1_ps(x)), isum, s);
    return _mm256_fmadd_ps(o8, _mm256_set1_ps(xm), s);
}

/* s + group g of a Q6_K super-block for eight rows (pi_dot8_k and pi_dot8_q6k512): lo, hi the
 * integer sums of its two 16-value halves, y0, y1 32 times the activation sum of each half
 * (v = q - 32), sc the scale bytes 4k..4k+3 of the rows, x = xd[8 sb + g]. */
static inline __attribute__((always_inline)) __m256 pi_q6k_group(__m256 s, __m256 d,
                                                                 const __m256i *sc, int g,
                                                                 __m256i lo, __m256i hi,
                                                                 __m256i y0, __m256i y1, float x) {
    const __m256 dx = _mm256_set1_ps(x);
    const __m256 a0 = _mm256_mul_ps(d, pi_byte_s(sc[g / 2], (2 * g) % 4));
    const __m256 a1 = _mm256_mul_ps(d, pi_byte_s(sc[g / 2], (2 * g + 1) % 4));
    s = _mm256_fmadd_ps(_mm256_mul_ps(a0, dx), _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, y0)), s);
    return _mm256_fmadd_ps(_mm256_mul_ps(a1, dx), _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, y1)), s);
}

/* lane i = row rw[i] . activation (xd, xq), nb groups of 32 (nb / 8 super-blocks) */
static inline __attribute__((always_inline)) __m256 pi_dot8_k(const int t,
                                                              const uint8_t *const *rw,
                                                              const float *xd, const int8_t *xq,
                                                              int nb, pi_pf_t *pf) {
    const int bs = pi_k_bytes(t);
    __m256 s = _mm256_setzero_ps();
    for (int sb = 0; sb < nb / 8; sb++) {
        const size_t off = (size_t)bs * sb;
        const uint8_t *blk[8];
        for (int i = 0; i < 8; i++) blk[i] = rw[i] + off;
        if (t == PI_Q6_K) {
            const __m256 d = pi_f16x8(rw, off + 208);
            __m256i sc[4]; /* scale bytes 4k..4k+3 of the eight rows */
            for (int k = 0; k < 4; k++) sc[k] = pi_ld32x8(rw, off + 192 + 4 * k);
            for (int g = 0; g < 8; g++) {
                pi_pf_next(pf);
                const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + 256 * sb + 32 * g));
                __m256i p[8], lo, hi;
                for (int i = 0; i < 8; i++) p[i] = pi_dot_u8(pi_k_values(t, blk[i], g), y);
                pi_reduce8_halves(p, &lo, &hi);
                /* v = q - 32: subtract 32 sum y of each half (the same for all rows) */
                const __m256i ys = pi_dot_u8(_mm256_set1_epi8(1), y);
                const __m256i y2 = _mm256_hadd_epi32(ys, ys), y4 = _mm256_hadd_epi32(y2, y2);
                const __m256i y0 = _mm256_slli_epi32(_mm256_permute2x128_si256(y4, y4, 0x00), 5);
                const __m256i y1 = _mm256_slli_epi32(_mm256_permute2x128_si256(y4, y4, 0x11), 5);
                s = pi_q6k_group(s, d, sc, g, lo, hi, y0, y1, xd[8 * sb + g]);
            }
        } else {
            const __m256 d = pi_f16x8(rw, off), dmin = pi_f16x8(rw, off + 2);
            __m256i scl, sch, mnl, mnh;
            pi_k4_scales8(pi_ld32x8(rw, off + 4), pi_ld32x8(rw, off + 8), pi_ld32x8(rw, off + 12),
                          &scl, &sch, &mnl, &mnh);
            for (int g = 0; g < 8; g++) {
                pi_pf_next(pf);
                const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + 256 * sb + 32 * g));
                __m256i p[8], lo, hi;
                for (int i = 0; i < 8; i++) p[i] = pi_dot_u8(pi_k_values(t, blk[i], g), y);
                pi_reduce8_halves(p, &lo, &hi);
                s = pi_k4_group(s, d, dmin, scl, sch, mnl, mnh, g,
                                _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), xd[8 * sb + g],
                                xd[nb + 8 * sb + g]);
            }
        }
    }
    return s;
}

#if PI_GEMV512
/* Q4_K / Q5_K, 512-bit (see pi_dot8_leg512): groups 2k and 2k + 1 of a super-block are the low
 * and high nibbles of the same 32 bytes, so one broadcast 32-byte load gives a row's zmm of
 * both groups ([v of 2k | v of 2k + 1], the activation's 64 bytes in order) and one dpbusd their
 * products; Q5_K's fifth bits (bit g of qh[j]) are rotated to bit 4 in each 32-bit lane by
 * 4 - g. The per-lane chain is pi_dot8_k's, group by group (the same bits). */
static inline __attribute__((always_inline)) __m512i pi_k_values2(const int t, const uint8_t *blk,
                                                                  const int k) {
    const __m512i b = _mm512_broadcast_i64x4(
        _mm256_loadu_si256((const __m256i *)(blk + (t == PI_Q4_K ? 16 : 48) + 32 * k)));
    __m512i v = _mm512_and_si512(_mm512_mask_srli_epi32(b, 0xff00, b, 4), _mm512_set1_epi8(15));
    if (t == PI_Q5_K) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        const __m512i r = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32((4 - 2 * k) & 31),
                                                  _mm512_set1_epi32((3 - 2 * k) & 31));
        v = _mm512_or_si512(v, _mm512_and_si512(_mm512_rolv_epi32(qh, r), _mm512_set1_epi8(0x10)));
    }
    return v;
}

/* Q6_K, 512-bit: groups 2k and 2k + 1 take the two adjacent 32-byte runs of ql (one 64-byte
 * load, the same nibble for both) and the same 32 bytes of qh (bits 2r, 2r + 1 of qh for group
 * g = 2k, r = g % 4, in the low half; 2r + 2, 2r + 3 in the high half); the four 16-value half sums of each row stay apart, as
 * pi_dot8_k's Q6_K chain needs them (same bits). */
static inline __attribute__((always_inline)) __m256 pi_dot8_q6k512(const uint8_t *const *rw,
                                                                   const float *xd,
                                                                   const int8_t *xq, int nb,
                                                                   pi_pf_t *pf) {
    __m256 s = _mm256_setzero_ps();
    for (int sb = 0; sb < nb / 8; sb++) {
        const size_t off = (size_t)210 * sb;
        const __m256 d = pi_f16x8(rw, off + 208);
        __m256i sc[4];
        for (int k = 0; k < 4; k++) sc[k] = pi_ld32x8(rw, off + 192 + 4 * k);
        for (int k = 0; k < 4; k++) {
            pi_pf_next(pf);
            pi_pf_next(pf);
            const int n = k / 2, r = 2 * (k % 2);
            const __m512i y = _mm512_loadu_si512((const void *)(xq + 256 * sb + 64 * k));
            const __m512i cnt = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi16((short)(2 * r)),
                                                        _mm512_set1_epi16((short)(2 * r + 2)));
            __m512i p[8];
            for (int i = 0; i < 8; i++) {
                const uint8_t *blk = rw[i] + off;
                __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * n));
                if (r >= 2) l = _mm512_srli_epi16(l, 4);
                const __m512i h = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
                const __m512i v = _mm512_or_si512(
                    _mm512_and_si512(l, _mm512_set1_epi8(15)),
                    _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(h, cnt), 4),
                                     _mm512_set1_epi8(0x30)));
                p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, y);
            }
            /* per 128-bit lane j (j = half of group: g lo, g hi, g+1 lo, g+1 hi): rows 0-3 (u),
             * rows 4-7 (v) */
            __m512i t4[4];
            for (int q = 0; q < 4; q++)
                t4[q] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * q], p[2 * q + 1]),
                                         _mm512_unpackhi_epi32(p[2 * q], p[2 * q + 1]));
            const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t4[0], t4[1]),
                                               _mm512_unpackhi_epi64(t4[0], t4[1]));
            const __m512i w = _mm512_add_epi32(_mm512_unpacklo_epi64(t4[2], t4[3]),
                                               _mm512_unpackhi_epi64(t4[2], t4[3]));
            __m512i a = _mm512_shuffle_i32x4(u, w, _MM_SHUFFLE(1, 0, 1, 0));
            __m512i b = _mm512_shuffle_i32x4(u, w, _MM_SHUFFLE(3, 2, 3, 2));
            a = _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(3, 1, 2, 0)); /* [g lo | g hi] */
            b = _mm512_shuffle_i32x4(b, b, _MM_SHUFFLE(3, 1, 2, 0)); /* [g+1 lo | g+1 hi] */
            /* 32 sum y of each 16-value half (v = q - 32) */
            const __m512i ys = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), y);
            int32_t hs[16];
            _mm512_storeu_si512((void *)hs, ys);
            for (int h = 0; h < 2; h++) {
                const int g = 2 * k + h;
                const __m512i z = h ? b : a;
                const __m256i lo = _mm512_castsi512_si256(z);
                const __m256i hi = _mm512_extracti64x4_epi64(z, 1);
                const int j0 = 8 * h, j1 = 8 * h + 4;
                const __m256i y0 = _mm256_set1_epi32(32 * (hs[j0] + hs[j0 + 1] + hs[j0 + 2] + hs[j0 + 3]));
                const __m256i y1 = _mm256_set1_epi32(32 * (hs[j1] + hs[j1 + 1] + hs[j1 + 2] + hs[j1 + 3]));
                s = pi_q6k_group(s, d, sc, g, lo, hi, y0, y1, xd[8 * sb + g]);
            }
        }
    }
    return s;
}

static inline __attribute__((always_inline)) __m256 pi_dot8_k512(const int t,
                                                                 const uint8_t *const *rw,
                                                                 const float *xd, const int8_t *xq,
                                                                 int nb, pi_pf_t *pf) {
    const int bs = pi_k_bytes(t);
    __m256 s = _mm256_setzero_ps();
    for (int sb = 0; sb < nb / 8; sb++) {
        const size_t off = (size_t)bs * sb;
        const uint8_t *blk[8];
        for (int i = 0; i < 8; i++) blk[i] = rw[i] + off;
        const __m256 d = pi_f16x8(rw, off), dmin = pi_f16x8(rw, off + 2);
        __m256i scl, sch, mnl, mnh;
        pi_k4_scales8(pi_ld32x8(rw, off + 4), pi_ld32x8(rw, off + 8), pi_ld32x8(rw, off + 12),
                      &scl, &sch, &mnl, &mnh);
        for (int k = 0; k < 4; k++) {
            pi_pf_next(pf);
            pi_pf_next(pf);
            const __m512i y = _mm512_loadu_si512((const void *)(xq + 256 * sb + 64 * k));
            __m512i p[8];
            for (int i = 0; i < 8; i++)
                p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pi_k_values2(t, blk[i], k), y);
            const __m512 f = _mm512_cvtepi32_ps(pi_reduce8x2(p));
            for (int h = 0; h < 2; h++) {
                const int g = 2 * k + h;
                const __m256 is = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))
                                    : _mm512_castps512_ps256(f);
                s = pi_k4_group(s, d, dmin, scl, sch, mnl, mnh, g, is, xd[8 * sb + g],
                                xd[nb + 8 * sb + g]);
            }
        }
    }
    return s;
}
#endif

/* One row, SIMD: the eight groups of a super-block as the eight lanes (their integer sums and
 * scales computed side by side), then pi_dot8_k's chain lane by lane in group order. Q6_K's
 * signed values use the sign trick (|v| against sign(y, v)), which gives the same exact sums. */
static inline __attribute__((always_inline)) float pi_dot1_k(const int t, const uint8_t *row,
                                                             const float *xd, const int8_t *xq,
                                                             int nb) {
    const int bs = pi_k_bytes(t);
    float s = 0.0f;
    for (int sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = row + (size_t)bs * sb;
        const int8_t *y = xq + 256 * sb;
        __m256i p[8], lo, hi;
        float ad0[8], ad1[8], i0[8], i1[8], o8[8];
        const __m256 dx = _mm256_loadu_ps(xd + 8 * sb);
        if (t == PI_Q6_K) {
            const __m256i m32 = _mm256_set1_epi8(32);
            for (int g = 0; g < 8; g++) {
                const __m256i v = _mm256_sub_epi8(pi_k_values(t, blk, g), m32);
                const __m256i yg = _mm256_loadu_si256((const __m256i *)(y + 32 * g));
                p[g] = pi_dot_u8(_mm256_sign_epi8(v, v), _mm256_sign_epi8(yg, v));
            }
            pi_reduce8_halves(p, &lo, &hi);
            /* scale 2g of lane g: the 16 signed bytes split into even and odd ones */
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const __m256 d = _mm256_set1_ps(pi_load_d(blk + 208));
            const __m256i ev = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16), 16);
            const __m256i od = _mm256_srai_epi32(sc, 16);
            _mm256_storeu_ps(ad0, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(ev)), dx));
            _mm256_storeu_ps(ad1, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(od)), dx));
            _mm256_storeu_ps(i0, _mm256_cvtepi32_ps(lo));
            _mm256_storeu_ps(i1, _mm256_cvtepi32_ps(hi));
            for (int g = 0; g < 8; g++) {
                s = fmaf(ad0[g], i0[g], s);
                s = fmaf(ad1[g], i1[g], s);
            }
        } else {
            for (int g = 0; g < 8; g++)
                p[g] = pi_dot_u8(pi_k_values(t, blk, g),
                                 _mm256_loadu_si256((const __m256i *)(y + 32 * g)));
            pi_reduce8_halves(p, &lo, &hi);
            int sc[8], m[8];
            for (int g = 0; g < 8; g++) pi_k4_scale_min(g, blk + 4, &sc[g], &m[g]);
            const __m256 a = _mm256_mul_ps(_mm256_set1_ps(pi_load_d(blk)),
                                           _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sc)));
            _mm256_storeu_ps(ad0, _mm256_mul_ps(a, dx));
            _mm256_storeu_ps(i0, _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)));
            _mm256_storeu_ps(o8, _mm256_mul_ps(
                _mm256_mul_ps(_mm256_set1_ps(pi_load_d(blk + 2)),
                              _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)m))),
                _mm256_set1_ps(-0.125f)));
            const float *xs = xd + nb + 8 * sb;
            for (int g = 0; g < 8; g++) {
                s = fmaf(ad0[g], i0[g], s);
                s = fmaf(o8[g], xs[g], s);
            }
        }
    }
    return s;
}
#else
#define pi_dot1_k pi_dot1_k_ref
#endif /* PI_SIMD */

static inline void pi_prefetch_l2(const uint8_t *p, size_t nbytes); /* simd.h, below */
static inline void pi_prefetch_l1(const uint8_t *p, size_t nbytes);

/* gather_matvec's reading of scattered rows, chosen at run time for A/B runs (kernels.pyx
 * set_gather_mode; the same bits in every mode): 1 (default) eight rows per pass, the rows ahead
 * spread over the blocks; 0 the session-7 bursts; 2 one row per pass (kernels.pyx). */
static int pi_gather_pf_mode = 1;

/* rows 8g .. min(8g + 8, n) - 1 of a GEMV (row k = w + (idx ? idx[k] : k) * stride):
 * out[k] = row . activation. Missing rows of the last group repeat its last row (results
 * dropped), which cannot change the others' lanes. pd: for a gather, how many rows ahead its
 * rows are prefetched (0: none). */
static inline __attribute__((always_inline)) void pi_gemv8_t(const int t, const uint8_t *w,
                                                             size_t stride, const int32_t *idx,
                                                             long g, long n, const float *xd,
                                                             const int8_t *xq, int nb,
                                                             float *out, long pd) {
    const long k0 = 8 * g, m = n - k0 < 8 ? n - k0 : 8;
#if PI_SIMD
    const uint8_t *rw[8];
    for (int i = 0; i < 8; i++) {
        const long k = k0 + (i < m ? i : m - 1);
        rw[i] = w + (size_t)(idx ? idx[k] : k) * stride;
    }
    pi_pf_t pf;
    pf.n = 0;
    pf.l2 = 0;
    pf.len = stride;
    if (!idx) {
        /* eight rows read side by side are eight streams that the hardware prefetcher follows
         * badly (measured: 0.6-0.9x the one-row loop from DRAM without this); the group's rows
         * are contiguous, so fetch the group about PI_GEMV_AHEAD bytes ahead, spread over the
         * blocks of this one */
        const size_t gb = 8 * stride;
        const long ahead = gb >= PI_GEMV_AHEAD ? 1 : (long)(PI_GEMV_AHEAD / gb);
        const long k1 = 8 * (g + ahead);
        if (k1 < n) {
            pf.n = 1;
            pf.p[0] = w + (size_t)k1 * stride;
            pf.len = (size_t)(n - k1 < 8 ? n - k1 : 8) * stride;
            /* K-quant rows of 2048+ values make 13-18 KiB groups: the group being read and the
             * range ahead then overflow a 32 KiB L1 and evict each other, so fetch to L2
             * (measured 1.1-1.5x on Q6_K 640x2048 and Q4_K 4096x4096; session 8) */
            pf.l2 = (size_t)(ahead + 1) * gb > PI_GEMV_L1_BUDGET ? 1 : 0;
        }
    } else if (pd > 0 && pi_gather_pf_mode != 0) {
        /* gathered rows come in no order the hardware can guess: the rows of the group about
         * pd rows ahead to L2, their lines spread over this group's blocks. Session 7 fetched
         * them in two bursts at the group start (below: the rows pd ahead to L2, the next
         * group's to L1), 160 prefetches for q8_0 rows, most of them to lines already on their
         * way when half the rows are read, and the loads behind them waited: at 56% of the rows
         * the spread read 1.0-1.3x the bursts (docs/benchmarks.md, session 8) */
        const long k1 = k0 + 8 * ((pd + 7) / 8);
        for (long k = k1; k < k1 + 8 && k < n; k++) pf.p[pf.n++] = w + (size_t)idx[k] * stride;
        pf.l2 = 0xffff;
    } else if (pd > 0) {
        for (long k = k0 + pd; k < k0 + 8 + pd && k < n; k++)
            pi_prefetch_l2(w + (size_t)idx[k] * stride, stride);
        if (stride <= 2048)
            for (long k = k0 + 8; k < k0 + 16 && k < n; k++)
                pi_prefetch_l1(w + (size_t)idx[k] * stride, stride);
    }
    pi_pf_init(&pf, nb);
#if PI_GEMV512
    if (pi_is_k(t) && ((PI_GEMV512_MASK >> t) & 1)) {
        const __m256 r5 = t == PI_Q6_K ? pi_dot8_q6k512(rw, xd, xq, nb, &pf)
                                       : pi_dot8_k512(t, rw, xd, xq, nb, &pf);
        if (m == 8) {
            _mm256_storeu_ps(out + k0, r5);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, r5);
            for (long i = 0; i < m; i++) out[k0 + i] = tmp[i];
        }
        return;
    }
#endif
    const __m256 r = pi_is_k(t) ? pi_dot8_k(t, rw, xd, xq, nb, &pf)
                                : pi_dot8_leg(t, rw, xd, xq, nb, &pf);
    if (m == 8) {
        _mm256_storeu_ps(out + k0, r);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, r);
        for (long i = 0; i < m; i++) out[k0 + i] = tmp[i];
    }
#else
    (void)pd;
    for (long i = 0; i < m; i++) {
        const long k = k0 + i;
        const uint8_t *row = w + (size_t)(idx ? idx[k] : k) * stride;
        out[k] = pi_is_k(t) ? pi_dot1_k_ref(t, row, xd, xq, nb) : pi_dot1_leg_ref(t, row, xd, xq, nb);
    }
#endif
}

/* pi_gemv8_t for a run-time type id (one copy per type) */
static inline void pi_gemv8(int qtype, const uint8_t *w, size_t stride, const int32_t *idx,
                            long g, long n, const float *xd, const int8_t *xq, int nb,
                            float *out, long pd) {
    switch (qtype) {
    case PI_Q4_0: pi_gemv8_t(PI_Q4_0, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    case PI_Q4_1: pi_gemv8_t(PI_Q4_1, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    case PI_Q5_0: pi_gemv8_t(PI_Q5_0, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    case PI_Q5_1: pi_gemv8_t(PI_Q5_1, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    case PI_Q4_K: pi_gemv8_t(PI_Q4_K, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    case PI_Q5_K: pi_gemv8_t(PI_Q5_K, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    case PI_Q6_K: pi_gemv8_t(PI_Q6_K, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
    default: pi_gemv8_t(PI_Q8_0, w, stride, idx, g, n, xd, xq, nb, out, pd); break;
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
