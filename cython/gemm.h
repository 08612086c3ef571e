/* Prefill kernels of pyinfer: a register-tiled GEMM for quantized weights (q8_0, q4_0, Q4_1,
 * Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and a batched causal attention. Included by kernels.pyx after
 * simd.h (it uses simd.h's and qtypes.h's helpers).
 *
 * GEMM (issue 11): out[t][r] = row_r . x_t, the activations quantized to 8 bits per 32-block
 * (pi_quantize_q8, as llama.cpp quantizes them to q8_0). Groups of 8 weight rows are repacked per
 * call into a small per-thread buffer with the rows interleaved 4 bytes at a time (the idea of
 * llama.cpp's repacked q4_0 8x8 layout, ggml-cpu/repack.cpp, done at run time so the file keeps
 * ggml's layout): one 32-byte load then holds 4 values of each of the 8 rows, a broadcast 4 bytes
 * of the token meet them in one maddubs, and each lane of the integer sum belongs to one row, so
 * no horizontal sums are needed and the block scales of 8 rows are applied in one FMA. A register
 * tile is 8 rows x 4 tokens (PI_GEMM_RM x PI_GEMM_RN); the repack costs 1/n_tok of the work.
 * Every type is unpacked at repack time to one byte per value in 32-value groups with an f32
 * scale (and offset) per row and group, so one tile serves them all: K-quant super-blocks leave
 * as 8 groups with their six-bit sub-block scales decoded, Q5 high bits are merged in, and the
 * offsets (q4_0's -8 d, Q5_0's -16 d, Q4_1/Q5_1's m, the K-quants' -dmin m) come from the
 * activation's block sums, as the decode dots of simd.h/qtypes.h take them.
 *
 * Attention: causal grouped-query attention for a block of queries that share one KV head (the
 * group's query heads x a few consecutive tokens). Each K and V row is read from L2 once per block
 * instead of once per query; scores come 8 keys to a vector (keys transposed once per block), the
 * softmax uses an 8-lane exp, and each query's output stays in registers across the keys. Decode
 * (attend.h, with _attend_head's operations in kernels.pyx) sums the scores and the softmax in
 * another f32 order and with expf's bits: the two agree within 1e-5 (tests/test_prefill_gemm.py).
 *
 * The GEMM's numerics: per (row, token), s = sum over blocks in order of
 * fma(a_w * d_x, isum_b, s) (then fma(off_w / 8, s_x, s) for types with an offset) with isum_b
 * the exact integer dot of the block. That is the order of the decode GEMV and one-row dots of
 * gemv.h for every quantized type (the K-quants since session 8), so decode and prefill give the
 * same bits. All are within
 * (nb + 4) 2^-23 sum|w x| of the exact sum, (2 nb + 8) 2^-23 sum (|a v| + |off|)|x| with
 * offsets (tests/test_prefill_gemm.py).
 */
#ifndef PYINFER_GEMM_H
#define PYINFER_GEMM_H

#include "simd.h"

#define PI_GEMM_RM 8 /* weight rows per register tile: one f32 lane each */
#define PI_GEMM_RN 4 /* tokens per register tile */
/* Most bytes of the per-thread repack buffer per 32-block of a row group (pi_gemm_block_bytes
 * gives each type's own stride): 8 row scales (f32), then 8 chunks x 32 bytes of values
 * (q4_0: unsigned nibbles; q8_0 and Q6_K: |w|, then 8 x 32 bytes of w itself; Q4_1, Q5_0, Q5_1,
 * Q4_K, Q5_K: unsigned values, then 8 row offsets), Q6_K then 8 scales of the block's second
 * half. */
#define PI_GEMM_BUF_PER_BLOCK (32 + 2 * 256 + 32)

/* Bytes per 32-block of a packed row group, by type (see PI_GEMM_BUF_PER_BLOCK): the packed
 * group stays small so it stays in L1 while every token passes over it. */
static inline int pi_gemm_block_bytes(int qtype) {
    switch (qtype) {
    case PI_Q8_0: return 32 + 2 * 256;
    case PI_Q6_K: return 32 + 2 * 256 + 32;
    default: return 32 + 256 + 32;
    }
}

#if PI_SIMD

/* Transpose 8 rows of 8 dwords: c[k] lane i = dword k of r[i]. */
static inline void pi_transpose8x8_epi32(const __m256i r[8], __m256i c[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);     /* dword 0 / 4 of rows h..h+3 */
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]); /* dword 1 / 5 */
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]); /* dword 2 / 6 */
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]); /* dword 3 / 7 */
    }
    for (int k = 0; k < 4; k++) {
        c[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
        c[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
    }
}

/* q8_0: repack rows r0 .. r0+rm-1 (rm <= 8; missing rows are zero) into buf, block by block:
 * the 8 row scales, then chunk k = elements 4k..4k+3 of every row (lane = row) as |w|, then the
 * same chunks as w (for the sign of the activation's bytes). */
static inline void pi_gemm_pack_q8_0(const uint8_t *w, size_t ws, int rm, int nb, uint8_t *buf) {
    const size_t bstride = (size_t)pi_gemm_block_bytes(PI_Q8_0);
    for (int b = 0; b < nb; b++) {
        uint8_t *o = buf + (size_t)b * bstride;
        float *d = (float *)o;
        __m256i r[8], c[8];
        for (int i = 0; i < 8; i++) {
            if (i >= rm) {
                d[i] = 0.0f;
                r[i] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *blk = w + i * ws + (size_t)34 * b;
            d[i] = pi_load_d(blk);
            r[i] = _mm256_loadu_si256((const __m256i *)(blk + 2));
        }
        pi_transpose8x8_epi32(r, c);
        for (int k = 0; k < 8; k++) {
            _mm256_storeu_si256((__m256i *)(o + 32 + 32 * k), _mm256_sign_epi8(c[k], c[k]));
            _mm256_storeu_si256((__m256i *)(o + 32 + 256 + 32 * k), c[k]);
        }
    }
}

/* Write a tile's RN accumulators: token j's rm (<= 8) row results to out[j * ldo + 0:rm]. */
static inline __attribute__((always_inline)) void pi_tile8_store(const __m256 *acc, int RN,
                                                                 float *out, long ldo, int rm) {
    for (int j = 0; j < RN; j++) {
        if (rm == 8) {
            _mm256_storeu_ps(out + j * ldo, acc[j]);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[j]);
            for (int i = 0; i < rm; i++) out[j * ldo + i] = tmp[i];
        }
    }
}

/* One packed q8_0 row group x RN tokens: acc[j] lane i = row i . token j. Per block and token
 * the integer dot of every row is exact (|w| x sign(y, w) pairs by maddubs, widened per chunk:
 * one pair sum reaches 2 * 128 * 127), then s = fma(d_w * d_x, isum, s) in block order. */
static inline __attribute__((always_inline)) void pi_tile8_q8_0(
    const uint8_t *buf, const float *xd, long xds, const int8_t *xq, long xqs, int nb,
    float *out, long ldo, int rm, const int RN) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t bstride = (size_t)pi_gemm_block_bytes(PI_Q8_0);
    __m256 acc[PI_GEMM_RN];
    for (int j = 0; j < RN; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *o = buf + (size_t)b * bstride;
        const __m256 dw = _mm256_loadu_ps((const float *)o);
        __m256i is[PI_GEMM_RN];
        for (int j = 0; j < RN; j++) is[j] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            const __m256i aw = _mm256_loadu_si256((const __m256i *)(o + 32 + 32 * k));
            const __m256i sw = _mm256_loadu_si256((const __m256i *)(o + 32 + 256 + 32 * k));
            for (int j = 0; j < RN; j++) {
                int32_t y4;
                memcpy(&y4, xq + j * xqs + 32 * b + 4 * k, 4);
                const __m256i sy = _mm256_sign_epi8(_mm256_set1_epi32(y4), sw);
#if PI_VNNI256
                (void)ones;
                is[j] = pi_dpbusd256(is[j], aw, sy);
#else
                is[j] = _mm256_add_epi32(is[j], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), ones));
#endif
            }
        }
        for (int j = 0; j < RN; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[j * xds + b])),
                                     _mm256_cvtepi32_ps(is[j]), acc[j]);
    }
    pi_tile8_store(acc, RN, out, ldo, rm);
}

/* ---- the other types users hold: Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K ----
 * Each 32-value group of a row is value_j = a_h v_j + off (qtypes.h: h the half of the group,
 * a_0 = a_1 except for Q6_K), v_j unpacked to one byte at pack time, so the tile runs the same
 * int8 dot as q4_0 whatever the bit width or block size: Q4_1/Q4_K nibbles and Q5_0/Q5_1/Q5_K
 * five-bit values unsigned (the offset, Q5_0's -16 d, Q4_1's m, the K-quant -dmin m, comes from
 * the activation's block sum s = 8 dx sum y as the decode dots take it), Q6_K's signed
 * v = q - 32 with q8_0's sign trick and the two half scales. Super-blocks are repacked into
 * 32-value groups with their decoded six-bit sub-block scales, so the tile never sees them.
 * Packed block: [0, 32) a (Q6_K: a_0) of the 8 rows, [32, 288) the values as 8 chunks of 4 per
 * row, then [288, 320) off / 8 of the 8 rows, or for Q6_K [288, 544) the signed values and
 * [544, 576) a_1. */
static inline __attribute__((always_inline)) void pi_gemm_pack_x(const int t, const uint8_t *w,
                                                                 size_t ws, int rm, int nb,
                                                                 uint8_t *buf) {
    const size_t bstride = (size_t)pi_gemm_block_bytes(t);
    for (int g = 0; g < nb; g++) {
        uint8_t *o = buf + (size_t)g * bstride;
        float *a0v = (float *)o, *a1v = (float *)(o + (t == PI_Q6_K ? 544 : 288));
        __m256i r[8], c[8];
        for (int i = 0; i < 8; i++) {
            float a0, a1, off;
            if (i >= rm) {
                a0v[i] = a1v[i] = 0.0f;
                r[i] = _mm256_setzero_si256();
                continue;
            }
            if (t == PI_Q4_0) { /* d (q - 8): unsigned nibbles and an offset of -8 d */
                const uint8_t *blk = w + i * ws + 18 * (size_t)g;
                a0 = a1 = pi_load_d(blk);
                off = -8.0f * a0;
                r[i] = pi_nib16(blk + 2);
            } else {
                const uint8_t *blk = pi_group_scales(t, w + i * ws, g, &a0, &a1, &off);
                r[i] = pi_group_values(t, blk, g);
            }
            a0v[i] = a0;
            a1v[i] = t == PI_Q6_K ? a1 : 0.125f * off;
        }
        pi_transpose8x8_epi32(r, c);
        for (int k = 0; k < 8; k++) {
            if (t == PI_Q6_K) {
                _mm256_storeu_si256((__m256i *)(o + 32 + 32 * k), _mm256_sign_epi8(c[k], c[k]));
                _mm256_storeu_si256((__m256i *)(o + 288 + 32 * k), c[k]);
            } else {
                _mm256_storeu_si256((__m256i *)(o + 32 + 32 * k), c[k]);
            }
        }
    }
}

/* One packed row group of pi_gemm_pack_x x RN tokens: acc[j] lane i = row i . token j. Per
 * block the integer dots are exact: unsigned values by maddubs into 16 bits (nibbles: a pair
 * sum is at most 2 * 15 * 127, 8 chunks stay under 2^15; five-bit values: 4 chunks, then widened;
 * Q6_K |v| <= 32 against sign(y, v): 4 chunks per half), or with the 256-bit VNNI dot by dpbusd
 * straight into int32 (the same integers, no int16 step: one pass over the block). Then, in
 * block order, s = fma(a dx, isum, s) and s = fma(off / 8, s_x, s) (Q6_K: s = fma(a_0 dx,
 * isum_0, s), s = fma(a_1 dx, isum_1, s)), one f32 accumulator per (row, token). */
static inline __attribute__((always_inline)) void pi_tile8_x(
    const int t, const uint8_t *buf, const float *xd, long xds, const int8_t *xq, long xqs,
    int nb, float *out, long ldo, int rm, const int RN) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t bstride = (size_t)pi_gemm_block_bytes(t);
    const int five = t == PI_Q5_0 || t == PI_Q5_1 || t == PI_Q5_K;
    __m256 acc[PI_GEMM_RN];
    for (int j = 0; j < RN; j++) acc[j] = _mm256_setzero_ps();
    /* the partial sums ip: int16 chunks (AVX2, widened by madd) or int32 (VNNI) */
#if PI_VNNI256
#define PI_X_ADD(ip, u, y) pi_dpbusd256(ip, u, y)
#define PI_X_WIDE(ip) (ip)
#else
#define PI_X_ADD(ip, u, y) _mm256_add_epi16(ip, _mm256_maddubs_epi16(u, y))
#define PI_X_WIDE(ip) _mm256_madd_epi16(ip, ones)
#endif
    (void)ones;
    for (int b = 0; b < nb; b++) {
        const uint8_t *o = buf + (size_t)b * bstride;
        const __m256 dw = _mm256_loadu_ps((const float *)o);
        __m256i is[PI_GEMM_RN], ip[PI_GEMM_RN];
        for (int j = 0; j < RN; j++) is[j] = _mm256_setzero_si256();
        if (t == PI_Q6_K) {
            for (int h = 0; h < 2; h++) {
                for (int j = 0; j < RN; j++) ip[j] = _mm256_setzero_si256();
                for (int k = 4 * h; k < 4 * h + 4; k++) {
                    const __m256i aw = _mm256_loadu_si256((const __m256i *)(o + 32 + 32 * k));
                    const __m256i sw = _mm256_loadu_si256((const __m256i *)(o + 288 + 32 * k));
                    for (int j = 0; j < RN; j++) {
                        int32_t y4;
                        memcpy(&y4, xq + j * xqs + 32 * b + 4 * k, 4);
                        ip[j] = PI_X_ADD(ip[j], aw, _mm256_sign_epi8(_mm256_set1_epi32(y4), sw));
                    }
                }
                const __m256 dh = h ? _mm256_loadu_ps((const float *)(o + 544)) : dw;
                for (int j = 0; j < RN; j++)
                    acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dh, _mm256_set1_ps(xd[j * xds + b])),
                                             _mm256_cvtepi32_ps(PI_X_WIDE(ip[j])), acc[j]);
            }
            continue;
        }
        const int halves = five && !PI_VNNI256 ? 2 : 1;  /* int16 room: 4 five-bit chunks */
        for (int h = 0; h < halves; h++) {
            for (int j = 0; j < RN; j++) ip[j] = _mm256_setzero_si256();
            for (int k = 8 / halves * h; k < 8 / halves * (h + 1); k++) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(o + 32 + 32 * k));
                for (int j = 0; j < RN; j++) {
                    int32_t y4;
                    memcpy(&y4, xq + j * xqs + 32 * b + 4 * k, 4);
                    ip[j] = PI_X_ADD(ip[j], u, _mm256_set1_epi32(y4));
                }
            }
            for (int j = 0; j < RN; j++) is[j] = _mm256_add_epi32(is[j], PI_X_WIDE(ip[j]));
        }
        const __m256 offv = _mm256_loadu_ps((const float *)(o + 288));
        for (int j = 0; j < RN; j++) {
            const float *dx = xd + j * xds;
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx[b])),
                                     _mm256_cvtepi32_ps(is[j]), acc[j]);
            acc[j] = _mm256_fmadd_ps(offv, _mm256_set1_ps(dx[nb + b]), acc[j]);
        }
    }
#undef PI_X_ADD
#undef PI_X_WIDE
    pi_tile8_store(acc, RN, out, ldo, rm);
}

/* pi_gemm_rows for the types of pi_gemm_pack_x (t a constant in each copy) */
static inline __attribute__((always_inline)) void pi_gemm_rows_x(
    const int t, const uint8_t *w, size_t ws, long r0, long r1, const float *xd,
    const int8_t *xq, long xqs, int nb, long n_tok, float *out, long ldo, uint8_t *buf) {
    const long xds = 2L * nb;
    for (long r = r0; r < r1; r += PI_GEMM_RM) {
        const int rm = (int)(r1 - r < PI_GEMM_RM ? r1 - r : PI_GEMM_RM);
        pi_gemm_pack_x(t, w + r * ws, ws, rm, nb, buf);
        long tk = 0;
        for (; tk + PI_GEMM_RN <= n_tok; tk += PI_GEMM_RN)
            pi_tile8_x(t, buf, xd + tk * xds, xds, xq + tk * xqs, xqs, nb, out + tk * ldo + r,
                       ldo, rm, PI_GEMM_RN);
        for (; tk < n_tok; tk++)
            pi_tile8_x(t, buf, xd + tk * xds, xds, xq + tk * xqs, xqs, nb, out + tk * ldo + r,
                       ldo, rm, 1);
    }
}
#endif /* PI_SIMD */

/* 1 for the types pi_gemm_rows handles (every quantized type: q8_0, q4_0, Q4_1, Q5_0, Q5_1,
 * Q4_K, Q5_K, Q6_K, with the SIMD build); the others go through the per-token loop of
 * kernels.pyx matmul. */
static inline int pi_gemm_supported(int qtype) {
    return PI_SIMD && pi_is_quant(qtype);
}

/* out[t * ldo + r] = row_r . x_t for rows r0 <= r < r1 of w (stride ws bytes) and all n_tok
 * tokens, token t quantized at (xd + t * 2nb, xq + t * xqs) by pi_quantize_q8. Rows go in groups
 * of 8, each repacked into buf (nb * PI_GEMM_BUF_PER_BLOCK bytes, stays in L1) and then dotted
 * with every token, PI_GEMM_RN tokens at a time. */
static inline void pi_gemm_rows(int qtype, const uint8_t *w, size_t ws, long r0, long r1,
                                const float *xd, const int8_t *xq, long xqs, int nb, long n_tok,
                                float *out, long ldo, uint8_t *buf) {
#if PI_SIMD
    switch (qtype) {
    case PI_Q4_0: pi_gemm_rows_x(PI_Q4_0, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    case PI_Q4_1: pi_gemm_rows_x(PI_Q4_1, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    case PI_Q5_0: pi_gemm_rows_x(PI_Q5_0, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    case PI_Q5_1: pi_gemm_rows_x(PI_Q5_1, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    case PI_Q4_K: pi_gemm_rows_x(PI_Q4_K, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    case PI_Q5_K: pi_gemm_rows_x(PI_Q5_K, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    case PI_Q6_K: pi_gemm_rows_x(PI_Q6_K, w, ws, r0, r1, xd, xq, xqs, nb, n_tok, out, ldo, buf); return;
    default: break;
    }
    const long xds = 2L * nb;
    for (long r = r0; r < r1; r += PI_GEMM_RM) { /* q8_0 */
        const int rm = (int)(r1 - r < PI_GEMM_RM ? r1 - r : PI_GEMM_RM);
        pi_gemm_pack_q8_0(w + r * ws, ws, rm, nb, buf);
        long t = 0;
        for (; t + PI_GEMM_RN <= n_tok; t += PI_GEMM_RN)
            pi_tile8_q8_0(buf, xd + t * xds, xds, xq + t * xqs, xqs, nb, out + t * ldo + r, ldo,
                          rm, PI_GEMM_RN);
        for (; t < n_tok; t++)
            pi_tile8_q8_0(buf, xd + t * xds, xds, xq + t * xqs, xqs, nb, out + t * ldo + r, ldo,
                          rm, 1);
    }
#else
    (void)qtype; (void)w; (void)ws; (void)r0; (void)r1; (void)xd; (void)xq; (void)xqs; (void)nb;
    (void)n_tok; (void)out; (void)ldo; (void)buf;
#endif
}

/* ---- down projection over the neuron-major ffn_down_t: out = a @ W ----
 * W (rows = n_ff neurons, cols = n_embd) is quantized along cols, the sum runs over rows, so the
 * int8 dot above does not apply (each row has its own block scale). A strip of 32 columns of every
 * row is dequantized once into an f32 panel (rows x 32, per thread), then a register tile of 6
 * tokens x 16 columns (12 accumulators) runs down the rows in blocks of PI_GEMM_T_KC, the a values
 * broadcast from the token rows. Each output is one FMA chain over the rows in order (as the
 * four-row AXPY of simd.h sums them), whatever the thread count. */
#define PI_GEMM_T_KC 256

#define PI_GEMM_T_TN 6 /* tokens per register tile: 6 x 16 columns = 12 accumulators, enough
                             * independent FMA chains to cover the FMA latency (5 cycles x 2 ports) */

#if PI_SIMD
static inline __attribute__((always_inline)) void pi_tile_t(
    const float *panel, long k0, long k1, const float *a, long lda, float *out, long ldo,
    int first, const int TN) {
    __m256 acc[PI_GEMM_T_TN][2];
    for (int t = 0; t < TN; t++) {
        acc[t][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + t * ldo);
        acc[t][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + t * ldo + 8);
    }
    for (long k = k0; k < k1; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + 32 * k), w1 = _mm256_loadu_ps(panel + 32 * k + 8);
        for (int t = 0; t < TN; t++) {
            const __m256 av = _mm256_broadcast_ss(a + t * lda + k);
            acc[t][0] = _mm256_fmadd_ps(av, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(av, w1, acc[t][1]);
        }
    }
    for (int t = 0; t < TN; t++) {
        _mm256_storeu_ps(out + t * ldo, acc[t][0]);
        _mm256_storeu_ps(out + t * ldo + 8, acc[t][1]);
    }
}
#endif

/* Columns c0 .. c0+cn-1 (cn <= 32; c0 a multiple of 32) of out (n_tok, ldo) = a (n_tok, lda) @ W,
 * W's rows w + r * ws (rows of them). panel: rows * 32 floats of scratch. */
static inline void pi_gemm_t_strip(int qtype, const uint8_t *w, size_t ws, long rows, int c0,
                                   int cn, const float *a, long lda, long n_tok, float *out,
                                   long ldo, float *panel) {
    for (long r = 0; r < rows; r++) {
        pi_dequant_cols(qtype, w + r * ws, c0, panel + 32 * r, cn);
        for (int c = cn; c < 32; c++) panel[32 * r + c] = 0.0f;
    }
#if PI_SIMD
    float tmp[PI_GEMM_T_TN * 32];
    for (long k0 = 0; k0 < rows; k0 += PI_GEMM_T_KC) {
        const long k1 = rows - k0 < PI_GEMM_T_KC ? rows : k0 + PI_GEMM_T_KC;
        for (long t = 0; t < n_tok; t += PI_GEMM_T_TN) {
            const int tn = (int)(n_tok - t < PI_GEMM_T_TN ? n_tok - t : PI_GEMM_T_TN);
            if (tn == PI_GEMM_T_TN && cn == 32) {
                for (int h = 0; h < 32; h += 16)
                    pi_tile_t(panel + h, k0, k1, a + t * lda, lda, out + t * ldo + c0 + h, ldo,
                              k0 == 0, PI_GEMM_T_TN);
                continue;
            }
            /* an edge tile: through a TN x 32 copy of its outputs */
            for (int i = 0; i < tn; i++)
                for (int c = 0; c < 32; c++)
                    tmp[32 * i + c] = (k0 == 0 || c >= cn) ? 0.0f : out[(t + i) * ldo + c0 + c];
            for (int h = 0; h < 32; h += 16)
                switch (tn) {
                case 1: pi_tile_t(panel + h, k0, k1, a + t * lda, lda, tmp + h, 32, 0, 1); break;
                case 2: pi_tile_t(panel + h, k0, k1, a + t * lda, lda, tmp + h, 32, 0, 2); break;
                case 3: pi_tile_t(panel + h, k0, k1, a + t * lda, lda, tmp + h, 32, 0, 3); break;
                case 4: pi_tile_t(panel + h, k0, k1, a + t * lda, lda, tmp + h, 32, 0, 4); break;
                case 5: pi_tile_t(panel + h, k0, k1, a + t * lda, lda, tmp + h, 32, 0, 5); break;
                default: pi_tile_t(panel + h, k0, k1, a + t * lda, lda, tmp + h, 32, 0, 6); break;
                }
            for (int i = 0; i < tn; i++)
                for (int c = 0; c < cn; c++) out[(t + i) * ldo + c0 + c] = tmp[32 * i + c];
        }
    }
#else
    for (long t = 0; t < n_tok; t++)
        for (int c = 0; c < cn; c++) {
            float s = 0.0f;
            for (long r = 0; r < rows; r++) s += a[t * lda + r] * panel[32 * r + c];
            out[t * ldo + c0 + c] = s;
        }
#endif
}

/* Keys 0 .. n-1 (rows k + j * rs, hd floats) into kt as blocks of 8 keys transposed: block jb
 * holds hd rows of 8 floats (lane = key 8 jb + lane; missing keys zero). Plain C: it runs once
 * per key and call, not once per block of queries. */
static inline void pi_transpose_keys(const float *k, long rs, int hd, long n, float *kt) {
    for (long j0 = 0; j0 < n; j0 += 8) {
        const int jn = (int)(n - j0 < 8 ? n - j0 : 8);
        float *o = kt + (j0 / 8) * 8 * (long)hd;
        for (int d = 0; d < hd; d++)
            for (int l = 0; l < 8; l++) o[8 * d + l] = l < jn ? k[(j0 + l) * rs + d] : 0.0f;
    }
}

#define PI_ATT_MAX_HD 256

#if PI_SIMD
/* Scores of up to 6 queries against 16 keys held transposed in two blocks (kb0, kb1: hd rows of
 * 8 floats, lane = key): two vectors of 8 scores per query, 12 accumulators (enough independent
 * FMA chains for the FMA latency) and 2 key loads + QN broadcasts per 2 QN FMAs. jn (1 .. 16)
 * scores are stored per query; with jn <= 8 kb1 may repeat kb0 (its lanes are not stored). */
static inline __attribute__((always_inline)) void pi_scores_q(
    const float *const *q, const float *kb0, const float *kb1, int hd, float scale, float *sc,
    long sc_stride, int jn, const int QN) {
    __m256 s0[6], s1[6];
    for (int i = 0; i < QN; i++) s0[i] = s1[i] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        const __m256 k0 = _mm256_loadu_ps(kb0 + 8 * d), k1 = _mm256_loadu_ps(kb1 + 8 * d);
        for (int i = 0; i < QN; i++) {
            const __m256 qd = _mm256_broadcast_ss(q[i] + d);
            s0[i] = _mm256_fmadd_ps(qd, k0, s0[i]);
            s1[i] = _mm256_fmadd_ps(qd, k1, s1[i]);
        }
    }
    const __m256 vs = _mm256_set1_ps(scale);
    for (int i = 0; i < QN; i++) {
        const __m256 r0 = _mm256_mul_ps(s0[i], vs), r1 = _mm256_mul_ps(s1[i], vs);
        if (jn == 16) {
            _mm256_storeu_ps(sc + i * sc_stride, r0);
            _mm256_storeu_ps(sc + i * sc_stride + 8, r1);
        } else {
            float tmp[16];
            _mm256_storeu_ps(tmp, r0);
            _mm256_storeu_ps(tmp + 8, r1);
            for (int j = 0; j < jn; j++) sc[i * sc_stride + j] = tmp[j];
        }
    }
}

/* sc[i][j] = (q_i . k_j) * scale for every query i < nq and key j < n_max: keys 16 at a time from
 * kt (pi_transpose_keys of the head's keys, done once per call and shared by every block of
 * queries), each pair of key blocks used by every query (the causal mask is applied by the
 * caller reading only j < n_att[i]). */
static inline void pi_scores_keys8(const float *const *q, int nq, const float *kt, int hd,
                                   float scale, long n_max, float *sc, long sc_stride) {
    for (long j0 = 0; j0 < n_max; j0 += 16) {
        const int jn = (int)(n_max - j0 < 16 ? n_max - j0 : 16);
        const float *kb0 = kt + (j0 / 8) * 8 * (long)hd, *kb1 = jn > 8 ? kb0 + 8 * hd : kb0;
        float *o = sc + j0;
        int i = 0;
        for (; i + 6 <= nq; i += 6) pi_scores_q(q + i, kb0, kb1, hd, scale, o + i * sc_stride, sc_stride, jn, 6);
        switch (nq - i) {
        case 5: pi_scores_q(q + i, kb0, kb1, hd, scale, o + i * sc_stride, sc_stride, jn, 5); break;
        case 4: pi_scores_q(q + i, kb0, kb1, hd, scale, o + i * sc_stride, sc_stride, jn, 4); break;
        case 3: pi_scores_q(q + i, kb0, kb1, hd, scale, o + i * sc_stride, sc_stride, jn, 3); break;
        case 2: pi_scores_q(q + i, kb0, kb1, hd, scale, o + i * sc_stride, sc_stride, jn, 2); break;
        case 1: pi_scores_q(q + i, kb0, kb1, hd, scale, o + i * sc_stride, sc_stride, jn, 1); break;
        default: break;
        }
    }
}
#endif

#if PI_SIMD
/* exp of 8 floats: x = n ln2 + r, |r| <= ln2/2, exp(r) by Cephes expf's degree-6 polynomial
 * (cephes/single/expf.c; about 1 ulp), times 2^n built in the exponent field. Inputs are clamped
 * to [-87.3, 88.7] (softmax feeds it s - max <= 0: below the clamp the terms are < 1e-37 of the
 * largest one, which is 1). */
static inline __m256 pi_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* s[0:n] = softmax(s[0:n]) in place (max subtracted), 8 lanes at a time. */
static inline void pi_softmax8(float *s, long n) {
    __m256 vmx = _mm256_set1_ps(-3.4e38f);
    long j = 0;
    for (; j + 8 <= n; j += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + j));
    float tmp[8], mx;
    _mm256_storeu_ps(tmp, vmx);
    mx = tmp[0];
    for (int l = 1; l < 8; l++) mx = tmp[l] > mx ? tmp[l] : mx;
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const __m256 m = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = pi_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    if (j < n) { /* the tail through the same exp, padded with -inf -> 0 */
        for (int l = 0; l < 8; l++) tmp[l] = j + l < n ? s[j + l] - mx : -1e30f;
        __m256 e = pi_exp8(_mm256_loadu_ps(tmp));
        e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_loadu_ps(tmp), _mm256_set1_ps(-1e29f), _CMP_GT_OQ));
        _mm256_storeu_ps(tmp, e);
        for (int l = 0; j + l < n; l++) s[j + l] = tmp[l];
        vs = _mm256_add_ps(vs, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / pi_hsum(vs));
    for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
    for (; j < n; j++) s[j] *= _mm256_cvtss_f32(inv);
}
#endif

/* ---- attention for a block of queries sharing one KV head ----
 * nq queries q[i] (hd floats), query i attends to keys 0 .. n_att[i]-1 (rows k + j * rs, likewise
 * v), n_att non-decreasing in i is NOT required. kt: the keys through pi_transpose_keys (SIMD
 * build, hd a multiple of 8 and at most PI_ATT_MAX_HD), or NULL for the scalar loop. sc: scratch
 * of nq * sc_stride floats (sc_stride
 * >= max n_att). out[i] (hd floats) = softmax(q_i . k_j * scale) @ v_j; on the SIMD build with
 * the 8-key scores and pi_softmax8, in another f32 order than decode's (see the top of this
 * file). */
static inline void pi_attend_block(const float *const *q, int nq, const long *n_att,
                                   const float *k, const float *kt, const float *v, long rs,
                                   int hd, float scale, float *sc, long sc_stride,
                                   float *const *out) {
    long n_max = 0, n_min = n_att[0];
    for (int i = 0; i < nq; i++) {
        n_max = n_att[i] > n_max ? n_att[i] : n_max;
        n_min = n_att[i] < n_min ? n_att[i] : n_min;
    }
    /* scores */
#if PI_SIMD
    if (kt != NULL) {
        pi_scores_keys8(q, nq, kt, hd, scale, n_max, sc, sc_stride);
    } else
#endif
    {
        for (long j = 0; j < n_max; j++) { /* key-major: each K row fetched once for the block */
            const float *kj = k + j * rs;
            for (int i = 0; i < nq; i++)
                if (j < n_att[i]) sc[i * sc_stride + j] = pi_dot_f32(q[i], kj, hd) * scale;
        }
    }
#if PI_SIMD
    if (hd % 8 == 0 && hd <= PI_ATT_MAX_HD) {
        for (int i = 0; i < nq; i++) pi_softmax8(sc + i * sc_stride, n_att[i]);
    } else
#endif
    for (int i = 0; i < nq; i++) {
        float *s = sc + i * sc_stride;
        float mx = -3.4e38f, ssum = 0.0f, inv;
        for (long j = 0; j < n_att[i]; j++)
            if (s[j] > mx) mx = s[j];
        for (long j = 0; j < n_att[i]; j++) {
            s[j] = expf(s[j] - mx);
            ssum = ssum + s[j];
        }
        inv = (float)(1.0 / (double)ssum); /* as Cython compiles _attend_head's 1.0 / ssum */
        for (long j = 0; j < n_att[i]; j++) s[j] = s[j] * inv;
    }
    /* out_i = sum_j p_ij v_j, keys in order for every query (decode's order) */
#if PI_SIMD
    if (hd % 32 == 0) {
        int i = 0;
        for (; i + 3 <= nq; i += 3) { /* three queries x 32 columns: 12 accumulators */
            const float *s0 = sc + i * sc_stride, *s1 = s0 + sc_stride, *s2 = s1 + sc_stride;
            const long m = n_att[i] < n_att[i + 1] ? (n_att[i] < n_att[i + 2] ? n_att[i] : n_att[i + 2])
                                                   : (n_att[i + 1] < n_att[i + 2] ? n_att[i + 1] : n_att[i + 2]);
            for (int c = 0; c < hd; c += 32) {
                __m256 a[3][4];
                for (int u = 0; u < 3; u++)
                    for (int h = 0; h < 4; h++) a[u][h] = _mm256_setzero_ps();
                for (long j = 0; j < m; j++) {
                    const float *vj = v + j * rs + c;
                    const __m256 p0 = _mm256_set1_ps(s0[j]), p1 = _mm256_set1_ps(s1[j]);
                    const __m256 p2 = _mm256_set1_ps(s2[j]);
                    for (int h = 0; h < 4; h++) {
                        const __m256 vv = _mm256_loadu_ps(vj + 8 * h);
                        a[0][h] = _mm256_fmadd_ps(p0, vv, a[0][h]);
                        a[1][h] = _mm256_fmadd_ps(p1, vv, a[1][h]);
                        a[2][h] = _mm256_fmadd_ps(p2, vv, a[2][h]);
                    }
                }
                for (int u = 0; u < 3; u++) { /* each query's remaining keys */
                    const float *s = sc + (i + u) * sc_stride;
                    for (long j = m; j < n_att[i + u]; j++) {
                        const __m256 p = _mm256_set1_ps(s[j]);
                        for (int h = 0; h < 4; h++)
                            a[u][h] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + j * rs + c + 8 * h), a[u][h]);
                    }
                    for (int h = 0; h < 4; h++) _mm256_storeu_ps(out[i + u] + c + 8 * h, a[u][h]);
                }
            }
        }
        for (; i < nq; i++) {
            const float *s = sc + i * sc_stride;
            for (int c = 0; c < hd; c += 32) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (long j = 0; j < n_att[i]; j++) {
                    const float *vj = v + j * rs + c;
                    const __m256 p = _mm256_set1_ps(s[j]);
                    a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), a0);
                    a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), a1);
                    a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), a2);
                    a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), a3);
                }
                _mm256_storeu_ps(out[i] + c, a0);
                _mm256_storeu_ps(out[i] + c + 8, a1);
                _mm256_storeu_ps(out[i] + c + 16, a2);
                _mm256_storeu_ps(out[i] + c + 24, a3);
            }
        }
        return;
    }
#endif
    for (int i = 0; i < nq; i++) {
        const float *s = sc + i * sc_stride;
        memset(out[i], 0, (size_t)hd * sizeof(float));
        for (long j = 0; j < n_att[i]; j++) pi_axpy_f32(s[j], v + j * rs, out[i], hd);
    }
}

/* ---- the gated FFN's two GEMMs with the activation applied on the way out ----
 * out[t][r] = act(gate_r . x_t) * (up_r . x_t) for rows r0 <= r < r1 (r1 - r0 <= PI_GLU_RM) of
 * gate and up: both through pi_gemm_rows into a scratch of 2 * n_tok * PI_GLU_RM floats (stays in
 * L2), then act(g) * u 8 lanes at a time. act is SiLU g / (1 + exp(-g)) with pi_exp8 in f32
 * (decode's _act1 takes libm's expf and divides in double: the two differ by a few ulp of the
 * activation, tests/test_prefill_gemm.py) or ReLU max(g, 0) (exact). Saves the separate
 * silu_mul pass over 2 n_tok n_ff floats, and quantizes x once for both matrices. */
#define PI_GLU_RM 16

static inline void pi_glu_rows(int qtype_g, const uint8_t *wg, size_t wgs, int qtype_u,
                               const uint8_t *wu, size_t wus, long r0, long r1, const float *xd,
                               const int8_t *xq, long xqs, int nb, long n_tok, float *out,
                               long ldo, int silu, uint8_t *buf, float *scratch) {
#if PI_SIMD
    float *g = scratch, *u = scratch + n_tok * PI_GLU_RM;
    const int rm = (int)(r1 - r0);
    pi_gemm_rows(qtype_g, wg + r0 * wgs, wgs, 0, rm, xd, xq, xqs, nb, n_tok, g, PI_GLU_RM, buf);
    pi_gemm_rows(qtype_u, wu + r0 * wus, wus, 0, rm, xd, xq, xqs, nb, n_tok, u, PI_GLU_RM, buf);
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long t = 0; t < n_tok; t++) {
        float a[PI_GLU_RM];
        for (int h = 0; h < PI_GLU_RM; h += 8) {
            const __m256 gv = _mm256_loadu_ps(g + t * PI_GLU_RM + h);
            const __m256 uv = _mm256_loadu_ps(u + t * PI_GLU_RM + h);
            const __m256 av = silu ? _mm256_div_ps(gv, _mm256_add_ps(one, pi_exp8(_mm256_xor_ps(gv, sign))))
                                   : _mm256_max_ps(gv, zero);
            _mm256_storeu_ps(a + h, _mm256_mul_ps(av, uv));
        }
        for (int i = 0; i < rm; i++) out[t * ldo + r0 + i] = a[i];
    }
#else
    (void)qtype_g; (void)wg; (void)wgs; (void)qtype_u; (void)wu; (void)wus; (void)r0; (void)r1;
    (void)xd; (void)xq; (void)xqs; (void)nb; (void)n_tok; (void)out; (void)ldo; (void)silu;
    (void)buf; (void)scratch;
#endif
}

#endif /* PYINFER_GEMM_H */
