/* Decode attention, one query token (session 13):
 *
 *     out_h = sum_j softmax_j(q_h . k_j * scale) v_j,   j = 0 .. n_att - 1
 *
 * for every query head h, reading KV head h / (n_head / n_kv) (grouped-query attention, Ainslie
 * et al. 2023), cache rows laid out (n_ctx, n_kv, hd), f16 (f16 = 1: pyinfer/kv_cache.py's default
 * since session 15, converted exactly to f32 as read) or f32. The loop it replaces (kernels.pyx
 * _attend_head, still the one-query reference) took one head at a time and read hd floats of
 * each cache row: a strided walk that the hardware prefetchers follow badly (at 480 cached
 * tokens SmolLM2's f32 cache is 737 KB a layer, 22 MB a token, and that walk read it at 7-8 GB/s
 * on a core that streams 25 GB/s). Here the scores of all heads come from one pass over whole
 * rows, the rows split between the threads; the exponentials go 8 (AVX-512) or 4 (AVX2) lanes
 * at a time through pi_expf_safe8/4 (rowsum_team.h: the bits of glibc's expf; lanes it cannot
 * vouch for call expf).
 *
 * Session 21: with AVX-512 and head_dim a multiple of 32 (at most 128), the scores of 8 rows come
 * at a time (pi_scores8): a KV head's keys converted once for the query heads that share them,
 * the 8 rows' horizontal sums together (pi_hsum8), and the value pass converts a KV head's values
 * once for its neighbouring query heads: at 480 cached tokens (SmolLM2, f16 cache, one thread)
 * the attention of a token's 30 layers took 719 us against 1003 (docs/benchmarks.md, session 21).
 *
 * Session 26: the 256-bit builds (CPUs without AVX-512) take the same two steps: pi_scores8_256
 * (a row's keys converted once per KV head, 8 rows' reductions together) and pi_attend_v8 (a
 * head's sums in registers over the rows instead of out loaded and stored per row).
 *
 * Every head's operations and their order are those of _attend_head over the f32 values of the
 * rows (kernels.pyx `attention` converts them once per call): scores pi_dot_f32(q_h, k_j) *
 * scale in f32 (pi_dot_f16 on an f16 cache: the same FMAs); the max; e_j = expf(s_j - max); their sum in
 * order j = 0, 1, ...; inv = (float)(1.0 / sum); out_h = 0, then out_h += (e_j inv) v_j for j in
 * order (pi_axpy_f32; with AVX-512 and head_dim 64 or 128, pi_attend_v16 keeps the heads'
 * sums in registers, the same FMAs). So the result has the bits of _attend_head at any thread
 * count.
 *
 * Included by kernels.pyx after rowsum_team.h.
 */
#ifndef PYINFER_ATTEND_H
#define PYINFER_ATTEND_H

#include <string.h>
#include <math.h>
#include "rowsum_team.h"

/* s[0:n] = expf(s[0:n] - mx), 8 or 4 lanes at a time (rowsum_team.h pi_expf8/4: expf's bits) */
static inline void pi_exp_shifted(float *s, long n, float mx) {
    long j = 0;
#if PI_AVX512
    const __m256 m8 = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(s + j, pi_expf8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8)));
#endif
#if PI_SIMD
    const __m128 m4 = _mm_set1_ps(mx);
    for (; j + 4 <= n; j += 4)
        _mm_storeu_ps(s + j, pi_expf4(_mm_sub_ps(_mm_loadu_ps(s + j), m4)));
#endif
    for (; j < n; j++) s[j] = expf(s[j] - mx);
}

/* s[0:n] max: the value of the sequential `if (s[j] > mx) mx = s[j]` from mx0 (max_ps(a, b) is
 * a > b ? a : b lane by lane, so NaNs are skipped as there; of +0 and -0 either may come back
 * where the loop returns the first, and s - mx then differs at most in the sign of a zero, which
 * expf maps to 1 either way) */
static inline float pi_max_f32(const float *s, long n, float mx0) {
    long j = 0;
    float mx = mx0;
#if PI_SIMD
    __m256 m = _mm256_set1_ps(mx0);
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + j), m);
    float mv[8];
    _mm256_storeu_ps(mv, m);
    for (int l = 0; l < 8; l++)
        if (mv[l] > mx) mx = mv[l];
#endif
    for (; j < n; j++)
        if (s[j] > mx) mx = s[j];
    return mx;
}

#if PI_AVX512
/* out_h = sum_j (e_hj inv_h) v_j for the NH heads hp .. hp + NH - 1 (hd = 16 NC; e: their rows of
 * exponentials, n_att apart), j = 0, 1, ... in order, as pi_axpy_f16 row after row computes it
 * (p = e inv rounded to f32, then one FMA per value from 0: the same bits) with the NH NC
 * accumulators in registers: the cache rows stream once, and no output is loaded and stored
 * again per row. */
static inline __attribute__((always_inline)) void pi_attend_v16(
    const float *e, long n_att, const float *inv, const void *v, long rs, int hd, int group,
    int hp, float *out, const int NH, const int NC, const int F16) {
    __m512 acc[6][8];
    long vh[6]; /* element offset of head hp + g's KV head in a row */
    for (int g = 0; g < NH; g++) {
        for (int c = 0; c < NC; c++) acc[g][c] = _mm512_setzero_ps();
        vh[g] = (long)((hp + g) / group) * hd;
    }
    for (long j = 0; j < n_att; j++) {
        const long o = j * rs;
        __m512 vv[8];
        long last = -1; /* heads of one KV head are neighbours: convert its values once */
        for (int g = 0; g < NH; g++) {
            const __m512 p = _mm512_set1_ps(e[(long)g * n_att + j] * inv[g]);
            if (vh[g] != last) {
                last = vh[g];
                for (int c = 0; c < NC; c++) {
                    const long a = o + vh[g] + 16 * c;
                    vv[c] = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + a)))
                                : _mm512_loadu_ps((const float *)v + a);
                }
            }
            for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < NH; g++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + (long)g * hd + 16 * c, acc[g][c]);
}
#endif

#if PI_SIMD
/* The sums of 8 dots, each reduced exactly as pi_dot_f16/f32 reduce one: t[r] holds row r's
 * (s0 + s1) + (s2 + s3) (8 lanes l0..l7), and pi_hsum takes ((l0 + l4) + (l1 + l5)) + ((l2 + l6) +
 * (l3 + l7)); here the same additions for 8 rows at once (f32 addition commutes, so hadd's operand
 * order is no change), returned in row order. */
static inline __m256 pi_hsum8(const __m256 t[8]) {
    __m256 p[4];
    for (int i = 0; i < 4; i++)
        p[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31));
    /* p[i] = [lo + hi of t[2i] | lo + hi of t[2i+1]]; two hadds leave rows 0 2 4 6 | 1 3 5 7 */
    const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

#if PI_AVX512
static inline __m256 pi_hi256(__m512 a) { /* lanes 8-15 (AVX-512F; extractf32x8 is DQ) */
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}


/* Scores of every head over rows j .. j + 7 (hd a multiple of 32, at most 128): per KV head, each
 * row's keys converted once and dotted with the NG query heads that read them, each dot as
 * pi_dot_f16/f32 computes it (lanes 0-7 and 8-15 of A are their s0 and s1, of B s2 and s3: the
 * same FMAs in the same order, from zero), the 8 rows' reductions of a head together (pi_hsum8)
 * and one store of its 8 scores. */
static inline __attribute__((always_inline)) void pi_scores8(
    const float *q, const void *k, long rs, long j, long n_att, int hd, int n_kv, float scale,
    float *sc, const int NG, const int F16) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int g = 0; g < n_kv; g++) {
        const float *qg = q + (long)g * NG * hd;
        __m256 t[4][8];
        for (int r = 0; r < 8; r++) {
            __m512 A[4], B[4];
            for (int h = 0; h < NG; h++) A[h] = B[h] = _mm512_setzero_ps();
            const long o = (j + r) * rs + (long)g * hd;
            for (int i = 0; i < hd; i += 32) {
                const __m512 k0 = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + o + i)))
                                      : _mm512_loadu_ps((const float *)k + o + i);
                const __m512 k1 = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + o + i + 16)))
                                      : _mm512_loadu_ps((const float *)k + o + i + 16);
                for (int h = 0; h < NG; h++) {
                    A[h] = _mm512_fmadd_ps(k0, _mm512_loadu_ps(qg + (long)h * hd + i), A[h]);
                    B[h] = _mm512_fmadd_ps(k1, _mm512_loadu_ps(qg + (long)h * hd + i + 16), B[h]);
                }
            }
            for (int h = 0; h < NG; h++)
                t[h][r] = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(A[h]), pi_hi256(A[h])),
                                        _mm256_add_ps(_mm512_castps512_ps256(B[h]), pi_hi256(B[h])));
        }
        for (int h = 0; h < NG; h++)
            _mm256_storeu_ps(sc + (long)(g * NG + h) * n_att + j, _mm256_mul_ps(pi_hsum8(t[h]), vscale));
    }
}
#endif

#if PI_SIMD && !PI_AVX512
/* The 256-bit paths (AVX2 builds) of the same two steps, session 26. */

/* Scores of every head over rows j .. j + 7 (hd a multiple of 8, at most 128; n_head / n_kv at
 * most 8): per row and KV head the keys converted to f32 once (an f16 cache), then dotted with
 * each query head that reads them as pi_dot_f16/f32 computes the dot (simd.h pi_dot8_f32: the
 * same FMAs; products commute), the 8 rows' reductions of a head together (pi_hsum8) and one store of its 8 scores.
 * The AVX2 path before it converted a KV head's keys once per query head and reduced each dot
 * alone. */
static inline void pi_scores8_256(const float *q, const void *k, int f16, long rs, long j,
                                  long n_att, int hd, int n_kv, int group, float scale, float *sc) {
    const __m256 vscale = _mm256_set1_ps(scale);
    float kf[128] __attribute__((aligned(32)));
    __m256 t[8][8];
    for (int g = 0; g < n_kv; g++) {
        for (int r = 0; r < 8; r++) {
            const long o = (j + r) * rs + (long)g * hd;
            const float *kr = (const float *)k + o;
            if (f16) {
                for (int i = 0; i < hd; i += 8)
                    _mm256_store_ps(kf + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                                (const __m128i *)((const uint16_t *)k + o + i))));
                kr = kf;
            }
            for (int h = 0; h < group; h++)
                t[h][r] = pi_dot8_f32(q + (long)(g * group + h) * hd, kr, hd);
        }
        for (int h = 0; h < group; h++)
            _mm256_storeu_ps(sc + (long)(g * group + h) * n_att + j,
                             _mm256_mul_ps(pi_hsum8(t[h]), vscale));
    }
}

/* out[0 : 8 NC] = sum_j (e_j inv) v_j (e: the head's exponentials; v + vo: its KV head's first
 * value of the NC vectors), j = 0, 1, ... in order, as pi_axpy_f16/f32 row after row computes
 * it (p = e inv rounded to f32, then one FMA per value from 0: the same bits), with the NC
 * (<= 8) accumulators in registers instead of out loaded and stored per row. */
static inline __attribute__((always_inline)) void pi_attend_v8(const float *e, long n_att,
                                                               float inv, const void *v, long rs,
                                                               long vo, float *out, const int NC,
                                                               const int F16) {
    __m256 acc[8];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (long j = 0; j < n_att; j++) {
        const __m256 p = _mm256_set1_ps(e[j] * inv);
        const long o = j * rs + vo;
        for (int c = 0; c < NC; c++) {
            const __m256 vv = F16 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                        (const __m128i *)((const uint16_t *)v + o + 8 * c)))
                                  : _mm256_loadu_ps((const float *)v + o + 8 * c);
            acc[c] = _mm256_fmadd_ps(p, vv, acc[c]);
        }
    }
    for (int c = 0; c < NC; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}
#endif

/* Thread t of T's share of one token's attention over every head (call it from every thread of
 * the team with the same arguments: it has one barrier; t = 0, T = 1 runs serially).
 * q (n_head, hd) f32; k, v: cache row 0 (row j at k + j rs, KV head g at + g hd); sc: n_head
 * n_att floats shared by the team; out (n_head, hd): this thread's heads written (the caller's
 * barrier before anyone reads them).
 *   1. the scores of every head over cache rows j0 .. j1 - 1 (the thread's share of the rows, cut
 *      at multiples of 16): one pass over contiguous rows, all KV heads;
 *   2. (barrier) the thread's query heads h0 .. h1 - 1: softmax over all rows, then
 *      out_h = sum_j p_hj v_j, one pass over the rows (the KV heads of h0 .. h1 - 1).
 * Step 1 reads K as one stream of whole rows where one head at a time read hd floats of each
 * row: at 480 rows, about 2x faster (docs/benchmarks.md, session 13). */
static void pi_attend_team(int t, int T, const float *q, const void *k, const void *v, int f16,
                           long rs, long n_att, int hd, int n_head, int n_kv, float scale,
                           float *sc, float *out) {
    const int group = n_head / n_kv;
    const long j0 = t == 0 ? 0 : (t * n_att / T) & ~15L;
    const long j1 = t == T - 1 ? n_att : ((t + 1) * n_att / T) & ~15L;
    long j = j0;
#if PI_AVX512
    if (hd % 32 == 0 && hd <= 128)
        for (; j + 8 <= j1 && group <= 4; j += 8) {
#define PI_S8(NG) (f16 ? pi_scores8(q, k, rs, j, n_att, hd, n_kv, scale, sc, NG, 1) \
                       : pi_scores8(q, k, rs, j, n_att, hd, n_kv, scale, sc, NG, 0))
            switch (group) {
            case 1: PI_S8(1); break; case 2: PI_S8(2); break; case 3: PI_S8(3); break;
            default: PI_S8(4); break;
            }
#undef PI_S8
        }
#elif PI_SIMD
    if (hd % 8 == 0 && hd <= 128 && group <= 8)
        for (; j + 8 <= j1; j += 8)
            pi_scores8_256(q, k, f16, rs, j, n_att, hd, n_kv, group, scale, sc);
#endif
    for (; j < j1; j++) {
        if (f16) {
            const uint16_t *kr = (const uint16_t *)k + j * rs;
            for (int h = 0; h < n_head; h++)
                sc[(long)h * n_att + j] =
                    pi_dot_f16(kr + (long)(h / group) * hd, q + (long)h * hd, hd) * scale;
        } else {
            const float *kr = (const float *)k + j * rs;
            for (int h = 0; h < n_head; h++)
                sc[(long)h * n_att + j] =
                    pi_dot_f32(q + (long)h * hd, kr + (long)(h / group) * hd, hd) * scale;
        }
    }
    if (T > 1) pi_team_barrier();
    const int h0 = t * n_head / T, h1 = (t + 1) * n_head / T, H = h1 - h0;
    if (H <= 0) return;
    float ssum[H];
    float *s0 = sc + (long)h0 * n_att;
    for (int g = 0; g < H; g++) {
        float *s = s0 + (long)g * n_att;
        pi_exp_shifted(s, n_att, pi_max_f32(s, n_att, -3.4e38f));
        ssum[g] = 0.0f;
    }
    for (long j = 0; j < n_att; j++)  /* the G sums interleaved, each in order j = 0, 1, ... */
        for (int g = 0; g < H; g++) ssum[g] = ssum[g] + s0[(long)g * n_att + j];
    float inv[H];
    for (int g = 0; g < H; g++) inv[g] = (float)(1.0 / ssum[g]);
#if PI_AVX512
    if (hd == 64 || hd == 128) {
        const int NC = hd / 16, per = NC == 4 ? 6 : 3; /* heads a pass keeps in 24 registers */
        for (int g0 = 0; g0 < H; g0 += per) {
            const int nh = H - g0 < per ? H - g0 : per;
            const float *sp = s0 + (long)g0 * n_att;
            float *op = out + (long)(h0 + g0) * hd;
            const int hp = h0 + g0;
#define PI_AV(NH, C) (f16 ? pi_attend_v16(sp, n_att, inv + g0, v, rs, hd, group, hp, op, NH, C, 1) \
                           : pi_attend_v16(sp, n_att, inv + g0, v, rs, hd, group, hp, op, NH, C, 0))
            if (NC == 4) {
                switch (nh) {
                case 1: PI_AV(1, 4); break; case 2: PI_AV(2, 4); break; case 3: PI_AV(3, 4); break;
                case 4: PI_AV(4, 4); break; case 5: PI_AV(5, 4); break; default: PI_AV(6, 4); break;
                }
            } else {
                switch (nh) {
                case 1: PI_AV(1, 8); break; case 2: PI_AV(2, 8); break; default: PI_AV(3, 8); break;
                }
            }
#undef PI_AV
        }
        return;
    }
#elif PI_SIMD
    if (hd % 8 == 0 && hd <= 128) {  /* a head at a time, 8 value vectors a pass */
        for (int g = 0; g < H; g++) {
            const long vo = (long)((h0 + g) / group) * hd;
            const float *sp = s0 + (long)g * n_att;
            for (int c0 = 0; c0 < hd / 8; c0 += 8) {
                const int nc = hd / 8 - c0 < 8 ? hd / 8 - c0 : 8;
                float *op = out + (long)(h0 + g) * hd + 8 * c0;
#define PI_AV8(C) (f16 ? pi_attend_v8(sp, n_att, inv[g], v, rs, vo + 8 * c0, op, C, 1) \
                       : pi_attend_v8(sp, n_att, inv[g], v, rs, vo + 8 * c0, op, C, 0))
                switch (nc) {
                case 1: PI_AV8(1); break; case 2: PI_AV8(2); break; case 3: PI_AV8(3); break;
                case 4: PI_AV8(4); break; case 5: PI_AV8(5); break; case 6: PI_AV8(6); break;
                case 7: PI_AV8(7); break; default: PI_AV8(8); break;
                }
#undef PI_AV8
            }
        }
        return;
    }
#endif
    for (int g = 0; g < H; g++) {
        float *s = s0 + (long)g * n_att;
        for (long j = 0; j < n_att; j++) s[j] = s[j] * inv[g];
        memset(out + (long)(h0 + g) * hd, 0, (size_t)hd * sizeof(float));
    }
    for (long j = 0; j < n_att; j++) {
        for (int h = h0; h < h1; h++) {
            const float a = s0[(long)(h - h0) * n_att + j];
            const long o = j * rs + (long)(h / group) * hd;
            if (f16) pi_axpy_f16(a, (const uint16_t *)v + o, out + (long)h * hd, hd);
            else pi_axpy_f32(a, (const float *)v + o, out + (long)h * hd, hd);
        }
    }
}

#endif /* PYINFER_ATTEND_H */
