/* Integer GEMM over transposed weights for prefill (issues 11 and 12):
 *
 *     out[t, 0:cols] = sum_r a[t, r] * W[r, 0:cols]      (out = a @ W, W stored as `rows` rows)
 *
 * the batched form of axpyq.h's row sums: ffn_down_t of every sparse file and all of q/k/v/o/
 * gate/up/down in `--sparse-mode input` files. Included by kernels.pyx after gemm.h; matmul_t
 * sends the types of pi_gemmt_supported here and keeps gemm.h's f32 strips (each weight
 * dequantized to f32, then f32 FMA tiles) for the others.
 *
 * Method. A block b (32 columns) of row r is W[r, 32b + i] = d[r,b] * (v[r,b,i] - k) with
 * integer values v (q8_0: v = q signed, k = 0; q4_0: v = nibble 0..15, k = 8). The work item is
 * one 32-column strip (one block b of every row). Its rows are taken PI_GEMMT_KC at a time; the
 * values of those rows are transposed once into a per-thread panel, four consecutive rows' bytes
 * to each int32 lane (as axpyq.h's VNNI path and gemm.h's repack do), and that panel serves
 * every token. Per token, tile of PI_GEMMT_R (32) rows and block, the row scale is folded into
 * the activation, c[r] = a[t, r] * d[r, b], and c is quantized to int8 with one scale
 *
 *     s = max_r |c[r]| / 127,   c8[r] = round(c[r] / s),   |c8[r] * s - c[r]| <= s / 2,
 *
 * the integer sums isum[i] = sum_r c8[r] * (v[r,i] - k) of the tile run in int32 (|isum| <=
 * 32 * 127 * 255 < 2^31), and out[t, i] += s * isum[i] in f32 (an FMA per 8 columns).
 * With 256-bit VNNI (simd.h PI_VNNI256) one dpbusd sums four rows for 8 columns: the coefficient
 * is the unsigned operand, biased (c8 + 128, 1 .. 255), the weight the signed one (v' = v - k,
 * q8_0's q or q4_0's q - 8), and the bias comes off through 128 * sum_r v'[r, i], a column sum
 * of the tile computed once when the panel is made (it starts the int32 accumulator), so no
 * correction costs anything per token. An AVX2 build has _mm256_maddubs_epi16 (unsigned x
 * signed bytes, pairs summed to int16 with saturation): q4_0 takes the same biased form (a pair
 * is at most 2 * 255 * 8); q8_0 takes llama.cpp's sign trick (|v| unsigned, c8 with v's sign
 * applied: a pair is at most 2 * 128 * 127 < 2^15, and v = -128 still works) with no bias.
 * Both builds compute the same integers, hence the same bits.
 *
 * Error bound against the exact sum, for token t and column i of block b (f32 rounding aside):
 *
 *     |err[t, i]| <= sum_tiles (max_{r in tile} |a[t,r] d[r,b]| / 254) * sum_{r in tile} |v'[r,i]|
 *
 * with v' = v - k (q8_0: q; q4_0: q - 8): 2^-8 of the largest term per tile, like the int8
 * activation of the GEMV dots (llama.cpp's q8 blocks), against axpyq.h's 2^-16 (decode): prefill
 * and decode of the same projection agree within this bound, not bit for bit. The f32 part adds
 * a recursive sum of one term per tile: (n_tiles + 5) 2^-23 sum_r |a W| covers it.
 * tests/test_prefill_gemm.py checks the bound against float64 over gguf's dequantization.
 */
#ifndef PYINFER_GEMMT_H
#define PYINFER_GEMMT_H

#include "simd.h"

#define PI_GEMMT_R 32   /* rows per tile: one int8 scale per token, tile and block */
#define PI_GEMMT_KC 256 /* rows per panel (8 KiB of values, in L1 while every token passes) */

#if PI_VNNI256
#define PI_GEMMT_VNNI 1
#else
#define PI_GEMMT_VNNI 0
#endif
#if PI_VNNI256 && PI_AVX512
#define PI_GEMMT_TN 2 /* tokens per pass: 8 int32 + 8 f32 accumulators (AVX-512: 32 ymm registers) */
#else
#define PI_GEMMT_TN 1 /* 16 ymm registers: one token's 4 + 4 accumulators and the sign work */
#endif

/* 1 where pi_gemmt_strip handles qtype; 0: gemm.h's f32 strips */
static inline int pi_gemmt_supported(int qtype) {
#if PI_SIMD
    return qtype == PI_Q8_0 || qtype == PI_Q4_0;
#else
    (void)qtype;
    return 0;
#endif
}

#if PI_SIMD

/* 1: the weight enters dpbusd as the signed operand v' = v - k and the coefficient as the
 * unsigned one, c8 + 128 (1 .. 255); the bias comes off through 128 * sum_r v'[r, i], a column
 * sum of the panel made once per tile at pack time (no per-token work). 0 (AVX2 q8_0): the
 * sign trick, no correction. AVX2 q4_0 takes the biased form too: |v'| <= 8, so a maddubs pair
 * is at most 2 * 255 * 8 and never saturates. */
static inline int pi_gemmt_biased(const int t) {
#if PI_GEMMT_VNNI
    (void)t;
    return 1;
#else
    return t == PI_Q4_0;
#endif
}

/* Rows r0 .. r0+n-1 (n <= PI_GEMMT_KC) of block b into the panel: for each group of four rows
 * (4q .. 4q+3) four vectors of 8 columns each (columns 0-7, 8-15, 16-23, 24-31 in order), each
 * int32 lane the four rows' signed values v' of one column; dp[j] = d[r0 + j, b]; init: per
 * tile four vectors, -128 * sum over the tile's rows of v' per column (0 unless biased). Missing
 * rows of the last tile get values 0 and d = 0 (their coefficient quantizes to 0). */
static inline __attribute__((always_inline)) void
pi_gemmt_pack(const int t, const uint8_t *w, size_t ws, long r0, int n, int b, __m256i *panel,
              float *dp, __m256i *init) {
    const int np = (n + PI_GEMMT_R - 1) / PI_GEMMT_R * PI_GEMMT_R;
    const size_t bb = t == PI_Q8_0 ? 34 : 18;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int j = 0; j < np; j += 4) {
        __m256i v[4];
        for (int i = 0; i < 4; i++) {
            if (j + i >= n) {
                v[i] = _mm256_setzero_si256();
                dp[j + i] = 0.0f;
                continue;
            }
            const uint8_t *blk = w + (size_t)(r0 + j + i) * ws + bb * (size_t)b;
            dp[j + i] = pi_load_d(blk);
            v[i] = t == PI_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
                                : _mm256_sub_epi8(pi_nib16(blk + 2), _mm256_set1_epi8(8));
        }
        /* bytes -> 4-byte groups: per 128-bit lane, u0 holds columns 0-3 (lane 1: 16-19), u1
         * 4-7 (20-23), u2 8-11 (24-27), u3 12-15 (28-31); the lane swaps put them in order */
        const __m256i t0 = _mm256_unpacklo_epi8(v[0], v[1]), t1 = _mm256_unpackhi_epi8(v[0], v[1]);
        const __m256i t2 = _mm256_unpacklo_epi8(v[2], v[3]), t3 = _mm256_unpackhi_epi8(v[2], v[3]);
        const __m256i u0 = _mm256_unpacklo_epi16(t0, t2), u1 = _mm256_unpackhi_epi16(t0, t2);
        const __m256i u2 = _mm256_unpacklo_epi16(t1, t3), u3 = _mm256_unpackhi_epi16(t1, t3);
        __m256i *o = panel + j; /* 4 vectors per 4 rows */
        o[0] = _mm256_permute2x128_si256(u0, u1, 0x20);
        o[1] = _mm256_permute2x128_si256(u2, u3, 0x20);
        o[2] = _mm256_permute2x128_si256(u0, u1, 0x31);
        o[3] = _mm256_permute2x128_si256(u2, u3, 0x31);
        if (j % PI_GEMMT_R == 0)
            for (int q = 0; q < 4; q++) init[j / 8 + q] = _mm256_setzero_si256();
        if (pi_gemmt_biased(t))
            for (int q = 0; q < 4; q++) /* -128 * (sum of the lane's four signed bytes) */
                init[(j / PI_GEMMT_R) * 4 + q] = _mm256_sub_epi32(
                    init[(j / PI_GEMMT_R) * 4 + q],
                    _mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, o[q]), ones16), 7));
    }
}

/* The coefficients of one token for the nt (<= 8) tiles of a panel: c = a * dp per tile,
 * quantized to int8 with the tile's scale s[k] (0 for an all-zero tile), stored biased (+128)
 * or not, as int32 groups in packs order (cq[8k + e]: rows 4 pos(e) .. of tile k, pos below).
 * The maxima of the eight tiles are reduced together and divided once, as one vector, so no
 * per-tile latency chain (horizontal max, divide) stalls the loop. */
static inline __attribute__((always_inline)) void
pi_gemmt_coef(const float *a, const float *dp, int n, int nt, int biased, int32_t *cq, float *s) {
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    float ap[PI_GEMMT_KC] __attribute__((aligned(32)));
    if (n < PI_GEMMT_R * nt) { /* the last, partial tile: a's row ends at n */
        memcpy(ap, a, n * sizeof(float));
        memset(ap + n, 0, (PI_GEMMT_R * nt - n) * sizeof(float));
        a = ap;
    }
    __m256 m[8];
    for (int k = 0; k < 8; k++) {
        if (k >= nt) {
            m[k] = _mm256_setzero_ps();
            continue;
        }
        __m256 c[4];
        for (int i = 0; i < 4; i++)
            c[i] = _mm256_andnot_ps(sgn, _mm256_mul_ps(_mm256_loadu_ps(a + 32 * k + 8 * i),
                                                       _mm256_load_ps(dp + 32 * k + 8 * i)));
        m[k] = pi_absmax8(pi_absmax8(c[0], c[1]), pi_absmax8(c[2], c[3]));
    }
    /* eight horizontal maxima at once: lane k of mx = max of m[k] (pi_absmax8: a NaN stays) */
    const __m256 a01 = pi_absmax8(_mm256_unpacklo_ps(m[0], m[1]), _mm256_unpackhi_ps(m[0], m[1]));
    const __m256 a23 = pi_absmax8(_mm256_unpacklo_ps(m[2], m[3]), _mm256_unpackhi_ps(m[2], m[3]));
    const __m256 a45 = pi_absmax8(_mm256_unpacklo_ps(m[4], m[5]), _mm256_unpackhi_ps(m[4], m[5]));
    const __m256 a67 = pi_absmax8(_mm256_unpacklo_ps(m[6], m[7]), _mm256_unpackhi_ps(m[6], m[7]));
    const __m256 b0 = pi_absmax8(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xee));
    const __m256 b1 = pi_absmax8(_mm256_shuffle_ps(a45, a67, 0x44), _mm256_shuffle_ps(a45, a67, 0xee));
    const __m256 mx = pi_absmax8(_mm256_permute2f128_ps(b0, b1, 0x20),
                                 _mm256_permute2f128_ps(b0, b1, 0x31));
    const __m256 v127 = _mm256_set1_ps(127.0f);
    _mm256_storeu_ps(s, _mm256_div_ps(mx, v127));
    /* 127 / max, 0 for an all-zero tile (a NaN max gives 0 too: its s carries the NaN) */
    float inv[8];
    _mm256_storeu_ps(inv, _mm256_and_ps(_mm256_cmp_ps(mx, _mm256_setzero_ps(), _CMP_GT_OQ),
                                        _mm256_div_ps(v127, mx)));
    const __m256i bias = _mm256_set1_epi8(biased ? (char)0x80 : 0);
    for (int k = 0; k < nt; k++) {
        const __m256 vi = _mm256_set1_ps(inv[k]);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(
                _mm256_mul_ps(_mm256_loadu_ps(a + 32 * k + 8 * i), _mm256_load_ps(dp + 32 * k + 8 * i)),
                vi));
        /* packs: lane 0 = rows 0-3, 8-11, 16-19, 24-27 as int32 groups; lane 1 = 4-7, 12-15, ... */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(cq + 8 * k), _mm256_xor_si256(p, bias));
    }
}

/* One tile (8 four-row groups) of TN tokens: acc[i][v] (f32, columns 8v .. 8v+7 of token i) +=
 * s[i] * (init[v] + sum_g c8 . values); cq[i * cqs + e] the int32 groups of pi_gemmt_coef */
static inline __attribute__((always_inline)) void
pi_gemmt_tile(const int t, const __m256i *pan, const __m256i *init, const int32_t *cq, long cqs,
              const float *s, long ss, __m256 acc[][4], const int TN) {
    /* packs order: group g (rows 4g .. 4g+3) is int32 element pos[g] */
    static const int pos[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    __m256i ia[PI_GEMMT_TN][4];
    for (int i = 0; i < TN; i++)
        for (int v = 0; v < 4; v++) ia[i][v] = init[v];
    /* one token a pass (16 ymm registers): its four dpbusd chains of 8 groups would wait on
     * dpbusd's latency, so the odd groups sum apart (ib) and join at the end (the same integers) */
    __m256i ib[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                     _mm256_setzero_si256()};
    for (int g = 0; g < PI_GEMMT_R / 4; g++) {
        const __m256i *pg = pan + 4 * g;
#if PI_GEMMT_VNNI
        (void)t;
        for (int i = 0; i < TN; i++) {
            const __m256i cb = _mm256_set1_epi32(cq[i * cqs + pos[g]]);
            if (PI_GEMMT_TN == 1 && (g & 1))  /* the odd groups' own chains */
                for (int v = 0; v < 4; v++) ib[v] = pi_dpbusd256(ib[v], cb, pg[v]);
            else
                for (int v = 0; v < 4; v++) ia[i][v] = pi_dpbusd256(ia[i][v], cb, pg[v]);
        }
#else
        const __m256i ones = _mm256_set1_epi16(1);
        for (int i = 0; i < TN; i++) {
            const __m256i cb = _mm256_set1_epi32(cq[i * cqs + pos[g]]);
            for (int v = 0; v < 4; v++) {
                const __m256i wv = pg[v];
                const __m256i p = t == PI_Q8_0
                    ? _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(cb, wv))
                    : _mm256_maddubs_epi16(cb, wv);
                ia[i][v] = _mm256_add_epi32(ia[i][v], _mm256_madd_epi16(p, ones));
            }
        }
#endif
    }
    if (PI_GEMMT_VNNI && PI_GEMMT_TN == 1)
        for (int v = 0; v < 4; v++) ia[0][v] = _mm256_add_epi32(ia[0][v], ib[v]);
    for (int i = 0; i < TN; i++) {
        const __m256 vs = _mm256_set1_ps(s[i * ss]);
        for (int v = 0; v < 4; v++)
            acc[i][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i][v]), vs, acc[i][v]);
    }
}

/* TN tokens (rows of a and out, lda / ldo apart) over the panel's nt tiles (n rows); out's 32
 * columns are stored (first: overwritten, else added to). */
static inline __attribute__((always_inline)) void
pi_gemmt_tokens(const int t, const __m256i *panel, const __m256i *init, const float *dp, int n,
                int nt, const float *a, long lda, float *out, long ldo, int first, const int TN) {
    int32_t cq[PI_GEMMT_TN][PI_GEMMT_KC / 4];
    float s[PI_GEMMT_TN][8];
    for (int i = 0; i < TN; i++)
        pi_gemmt_coef(a + i * lda, dp, n, nt, pi_gemmt_biased(t), cq[i], s[i]);
    __m256 acc[PI_GEMMT_TN][4];
    for (int i = 0; i < TN; i++)
        for (int v = 0; v < 4; v++)
            acc[i][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + i * ldo + 8 * v);
    for (int k = 0; k < nt; k++)
        pi_gemmt_tile(t, panel + PI_GEMMT_R * k, init + 4 * k, cq[0] + 8 * k, PI_GEMMT_KC / 4,
                      s[0] + k, 8, acc, TN);
    for (int i = 0; i < TN; i++)
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(out + i * ldo + 8 * v, acc[i][v]);
}

static inline __attribute__((always_inline)) void
pi_gemmt_strip_t(const int t, const uint8_t *w, size_t ws, long rows, int c0, const float *a,
                 long lda, long n_tok, float *out, long ldo) {
    __m256i panel[PI_GEMMT_KC] __attribute__((aligned(32))); /* KC/4 groups x 4 vectors */
    __m256i init[PI_GEMMT_KC / PI_GEMMT_R * 4] __attribute__((aligned(32)));
    float dp[PI_GEMMT_KC] __attribute__((aligned(32)));
    const int b = c0 / 32;
    for (long k0 = 0; k0 < rows; k0 += PI_GEMMT_KC) {
        const int n = (int)(rows - k0 < PI_GEMMT_KC ? rows - k0 : PI_GEMMT_KC);
        const int nt = (n + PI_GEMMT_R - 1) / PI_GEMMT_R;
        pi_gemmt_pack(t, w, ws, k0, n, b, panel, dp, init);
        long i = 0;
        for (; i + PI_GEMMT_TN <= n_tok; i += PI_GEMMT_TN)
            pi_gemmt_tokens(t, panel, init, dp, n, nt, a + i * lda + k0, lda, out + i * ldo + c0,
                            ldo, k0 == 0, PI_GEMMT_TN);
        for (; i < n_tok; i++)
            pi_gemmt_tokens(t, panel, init, dp, n, nt, a + i * lda + k0, lda, out + i * ldo + c0,
                            ldo, k0 == 0, 1);
    }
}

#endif /* PI_SIMD */

/* Columns c0 .. c0+31 (c0 a multiple of 32) of out (n_tok, ldo) = a (n_tok, lda) @ W, W's rows
 * w + r * ws (rows of them), for the types of pi_gemmt_supported (a no-op for the others). */
static void pi_gemmt_strip(int qtype, const uint8_t *w, size_t ws, long rows, int c0,
                                  const float *a, long lda, long n_tok, float *out, long ldo) {
#if PI_SIMD
    if (qtype == PI_Q8_0)
        pi_gemmt_strip_t(PI_Q8_0, w, ws, rows, c0, a, lda, n_tok, out, ldo);
    else if (qtype == PI_Q4_0)
        pi_gemmt_strip_t(PI_Q4_0, w, ws, rows, c0, a, lda, n_tok, out, ldo);
#else
    (void)qtype; (void)w; (void)ws; (void)rows; (void)c0; (void)a; (void)lda; (void)n_tok;
    (void)out; (void)ldo;
#endif
}

#endif /* PYINFER_GEMMT_H */
