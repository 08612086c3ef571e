/* K-quant quantizers (Q4_K, Q5_K, Q6_K) for one 256-value super-block, in C.
 *
 * The same algorithm as pyinfer/quants.py (its NumPy twin), which follows ggml's reference
 * quantizers (ggml-quants.c quantize_row_q4_K_ref / q5_K_ref over make_qkx2_quants, and
 * quantize_row_q6_K_ref over make_qx_quants with rmse_type 1): per 32-value (Q4_K/Q5_K) or
 * 16-value (Q6_K) sub-block a search over candidate scales for the least weighted squared error,
 * then 6-bit (8-bit for Q6_K) sub-block scales under an f16 super-block scale, then the values
 * rounded against the stored scales. Sums run in f32 in element order, as ggml's do; the NumPy
 * twin sums pairwise, so a block can differ where two candidates tie to the last bit
 * (tests/test_quants.py bounds how often). Rounding is to nearest, ties to even (lrintf in the
 * default rounding mode: ggml's nearest_int). Block layouts: ggml-common.h, cython/qtypes.h.
 *
 * The converter needs these for the transposed down projection (ffn_down_t) of a K-quant model:
 * the NumPy search took 4-8 CPU minutes for a 7B model's ffn_down_t.
 */
#ifndef PI_KQUANT_H
#define PI_KQUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h" /* pi_f16_to_f32, pi_hsum, PI_SIMD (AVX2 + FMA + F16C) */

#define KQ_QK 256

/* f32 -> f16 bits, round to nearest even (as NumPy's astype(float16) and ggml's FP32_TO_FP16) */
static inline uint16_t kq_f32_to_f16(float f) {
#if PI_SIMD
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x, sign, ax, h, rest;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) { /* below 2^-14: a count of 2^-24 units (subnormal, or the first normal) */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
    }
    h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
#endif
}

static inline int kq_clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* The least-squares scale and offset of x ~ ts * l + tm from the weighted sums (sum_w, sum_x,
 * sl = sum w l, sl2 = sum w l^2, sxl = sum w l x), the offset kept <= 0 (refit without it when it
 * comes out positive). Returns 0 when the system is singular (D <= 0). */
static inline int kq_fit(float sum_w, float sum_x, float sl, float sl2, float sxl, float *ts,
                         float *tm) {
    float D = sum_w * sl2 - sl * sl;
    if (!(D > 0)) return 0;
    *ts = (sum_w * sxl - sum_x * sl) / D;
    *tm = (sl2 * sum_x - sl * sxl) / D;
    if (*tm > 0) {
        *tm = 0;
        *ts = sxl / sl2;
    }
    return 1;
}

/* make_qkx2 (squared error): x ~ scale * L - the_min with L in 0..nmax over n values weighted
 * by w; returns scale, writes the_min. The offset found best so far is the one the next
 * candidate scales are taken against (ggml's loop updates min as it goes). */
static inline float kq_qkx2(const float *x, const float *w, int n, int nmax, float rmin, float rdelta,
                     int nstep, float *the_min) {
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        *the_min = -lo;
        return 0.0f;
    }
    float iscale = nmax / (hi - lo), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp((int)lrintf(iscale * (x[i] - lo)), 0, nmax);
        float diff = scale * l + lo - x[i];
        best += w[i] * (diff * diff);
    }
    uint8_t la[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (hi - lo);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; i++) {
            int l = kq_clamp((int)lrintf(iscale * (x[i] - lo)), 0, nmax);
            la[i] = (uint8_t)l;
            sl += w[i] * l;
            sl2 += w[i] * l * l;
            sxl += w[i] * l * x[i];
        }
        float ts, tm;
        if (kq_fit(sum_w, sum_x, sl, sl2, sxl, &ts, &tm)) {
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = ts * la[i] + tm - x[i];
                err += w[i] * (diff * diff);
            }
            if (err < best) {
                best = err;
                scale = ts;
                lo = tm;
            }
        }
    }
    *the_min = -lo;
    return scale;
}


#if PI_SIMD
/* kq_qkx2 for n = 32 in AVX2: the same search; sums run per lane (i mod 8) over the four
 * vectors, then across lanes, so a block can differ from the scalar order where candidates tie. */
static float kq_qkx2_32(const float *x, const float *w, int nmax, float rmin, float rdelta,
                        int nstep, float *the_min) {
    __m256 X[4], W[4], La[4];
    __m256 vlo = _mm256_loadu_ps(x), vhi = vlo, vsw = _mm256_setzero_ps(), vsx = vsw;
    for (int k = 0; k < 4; k++) {
        X[k] = _mm256_loadu_ps(x + 8 * k);
        W[k] = _mm256_loadu_ps(w + 8 * k);
        vlo = _mm256_min_ps(vlo, X[k]);
        vhi = _mm256_max_ps(vhi, X[k]);
        vsw = _mm256_add_ps(vsw, W[k]);
        vsx = _mm256_add_ps(vsx, _mm256_mul_ps(W[k], X[k]));
    }
    float lo = x[0], hi = x[0];
    {
        float t[8], u[8];
        _mm256_storeu_ps(t, vlo);
        _mm256_storeu_ps(u, vhi);
        for (int i = 0; i < 8; i++) {
            if (t[i] < lo) lo = t[i];
            if (u[i] > hi) hi = u[i];
        }
    }
    float sum_w = pi_hsum(vsw), sum_x = pi_hsum(vsx);
    if (lo > 0) lo = 0;
    if (hi == lo) {
        *the_min = -lo;
        return 0.0f;
    }
    const __m256 zero = _mm256_setzero_ps(), vmax = _mm256_set1_ps((float)nmax);
    float iscale = nmax / (hi - lo), scale = 1 / iscale;
    __m256 vis = _mm256_set1_ps(iscale), vlo1 = _mm256_set1_ps(lo), vsc = _mm256_set1_ps(scale);
    __m256 verr = zero;
    for (int k = 0; k < 4; k++) {
        __m256 l = _mm256_round_ps(_mm256_mul_ps(vis, _mm256_sub_ps(X[k], vlo1)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        l = _mm256_min_ps(_mm256_max_ps(l, zero), vmax);
        __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(vsc, l), vlo1), X[k]);
        verr = _mm256_add_ps(verr, _mm256_mul_ps(W[k], _mm256_mul_ps(d, d)));
    }
    float best = pi_hsum(verr);
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (hi - lo);
        vis = _mm256_set1_ps(iscale);
        vlo1 = _mm256_set1_ps(lo);
        __m256 sl = zero, sl2 = zero, sxl = zero;
        for (int k = 0; k < 4; k++) {
            __m256 l = _mm256_round_ps(_mm256_mul_ps(vis, _mm256_sub_ps(X[k], vlo1)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            l = _mm256_min_ps(_mm256_max_ps(l, zero), vmax);
            La[k] = l;
            __m256 wl = _mm256_mul_ps(W[k], l);
            sl = _mm256_add_ps(sl, wl);
            sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(wl, l));
            sxl = _mm256_add_ps(sxl, _mm256_mul_ps(wl, X[k]));
        }
        float ts, tm;
        if (kq_fit(sum_w, sum_x, pi_hsum(sl), pi_hsum(sl2), pi_hsum(sxl), &ts, &tm)) {
            __m256 vts = _mm256_set1_ps(ts), vtm = _mm256_set1_ps(tm), ve = zero;
            for (int k = 0; k < 4; k++) {
                __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(vts, La[k]), vtm), X[k]);
                ve = _mm256_add_ps(ve, _mm256_mul_ps(W[k], _mm256_mul_ps(d, d)));
            }
            float err = pi_hsum(ve);
            if (err < best) {
                best = err;
                scale = ts;
                lo = tm;
            }
        }
    }
    *the_min = -lo;
    return scale;
}

/* kq_qx_rmse1 for n = 16 (Q6_K's sub-blocks), nmax 32, in AVX2 (lane sums as above). */
static float kq_qx_rmse1_16(const float *x) {
    const int nmax = 32;
    float amax = 0, mx = 0;
    for (int i = 0; i < 16; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            mx = x[i];
        }
    }
    if (amax < 1e-15f) return 0.0f;
    __m256 X0 = _mm256_loadu_ps(x), X1 = _mm256_loadu_ps(x + 8);
    __m256 WX0 = _mm256_mul_ps(_mm256_mul_ps(X0, X0), X0), WX1 = _mm256_mul_ps(_mm256_mul_ps(X1, X1), X1);
    __m256 W0 = _mm256_mul_ps(X0, X0), W1 = _mm256_mul_ps(X1, X1);
    const __m256 lo = _mm256_set1_ps((float)-nmax), hi = _mm256_set1_ps((float)(nmax - 1));
    float scale = 0, best = 0;
    for (int is = 0; is <= 18; is++) {  /* is 0 first (the start), then -9..9 without 0 */
        int step = is == 0 ? 0 : (is <= 9 ? is - 10 : is - 9);
        float iscale = step == 0 ? -nmax / mx : -(nmax + 0.1f * step) / mx;
        __m256 vis = _mm256_set1_ps(iscale);
        __m256 l0 = _mm256_round_ps(_mm256_mul_ps(vis, X0), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 l1 = _mm256_round_ps(_mm256_mul_ps(vis, X1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        l0 = _mm256_min_ps(_mm256_max_ps(l0, lo), hi);
        l1 = _mm256_min_ps(_mm256_max_ps(l1, lo), hi);
        float sumlx = pi_hsum(_mm256_add_ps(_mm256_mul_ps(WX0, l0), _mm256_mul_ps(WX1, l1)));
        float suml2 = pi_hsum(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(W0, l0), l0),
                                            _mm256_mul_ps(_mm256_mul_ps(W1, l1), l1)));
        if (step == 0) {
            scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
            best = scale * sumlx;
        } else if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}
#define KQ_QKX2(x, w, nmax, rmin, rdelta, nstep, mn) kq_qkx2_32(x, w, nmax, rmin, rdelta, nstep, mn)
#define KQ_QX16(x) kq_qx_rmse1_16(x)
#else
#define KQ_QKX2(x, w, nmax, rmin, rdelta, nstep, mn) kq_qkx2(x, w, 32, nmax, rmin, rdelta, nstep, mn)
#define KQ_QX16(x) kq_qx_rmse1(x, 16, 32)
#endif

/* Q4_K (nmax 15: 144 bytes) or Q5_K (nmax 31: 176 bytes) of x[0..255] into out. */
static void kq_quantize_q45_k(const float *x, uint8_t *out, int nmax) {
    float scales[8], mins[8], w[32];
    uint8_t ls[8], lm[8], L[KQ_QK];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        scales[j] = nmax == 15 ? KQ_QKX2(xs, w, 15, -1.0f, 0.1f, 20, &mins[j])
                               : KQ_QKX2(xs, w, 31, -0.5f, 0.1f, 15, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_s = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    float inv_m = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < 8; j++) {
        int a = (int)lrintf(inv_s * scales[j]), b = (int)lrintf(inv_m * mins[j]);
        ls[j] = (uint8_t)(a < 63 ? a : 63);
        lm[j] = (uint8_t)(b < 63 ? b : 63);
    }
    uint16_t d16 = kq_f32_to_f16(max_scale / 63), m16 = kq_f32_to_f16(max_min / 63);
    float d = pi_f16_to_f32(d16), dmin = pi_f16_to_f32(m16);
    for (int j = 0; j < 8; j++) {
        float dj = d * ls[j], mj = dmin * lm[j];
        for (int l = 0; l < 32; l++)
            L[32 * j + l] = dj != 0 ? (uint8_t)kq_clamp((int)lrintf((x[32 * j + l] + mj) / dj), 0, nmax)
                                    : 0;
    }
    memcpy(out, &d16, 2);
    memcpy(out + 2, &m16, 2);
    uint8_t *sc = out + 4;
    for (int j = 0; j < 4; j++) {  /* 6-bit scales and mins, ggml's 12-byte packing */
        sc[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        sc[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        sc[j + 8] = (uint8_t)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
    }
    uint8_t *qs = out + 16;
    if (nmax == 31) {
        uint8_t *qh = out + 16;
        memset(qh, 0, 32);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                qh[l] |= (uint8_t)(((L[64 * j + l] >> 4) << (2 * j))
                                   | ((L[64 * j + 32 + l] >> 4) << (2 * j + 1)));
        qs = out + 48;
    }
    for (int j = 0; j < 4; j++)  /* sub-blocks 2j (low nibble) and 2j+1 (high) */
        for (int l = 0; l < 32; l++)
            qs[32 * j + l] = (uint8_t)((L[64 * j + l] & 15) | ((L[64 * j + 32 + l] & 15) << 4));
}

/* make_qx_quants with rmse_type 1 (weights x^2) for n values, L in -nmax..nmax-1: the scale. */
static inline float kq_qx_rmse1(const float *x, int n, int nmax) {
    float amax = 0, mx = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            mx = x[i];
        }
    }
    if (amax < 1e-15f) return 0.0f;
    float iscale = -nmax / mx, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = kq_clamp((int)lrintf(iscale * x[i]), -nmax, nmax - 1);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / mx;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = kq_clamp((int)lrintf(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q6_K (210 bytes) of x[0..255] into out. */
static void kq_quantize_q6_k(const float *x, uint8_t *out) {
    float scales[16], max_scale = 0, max_abs = 0;
    uint8_t L[KQ_QK];
    for (int ib = 0; ib < 16; ib++) {
        scales[ib] = KQ_QX16(x + 16 * ib);
        if (fabsf(scales[ib]) > max_abs) {
            max_abs = fabsf(scales[ib]);
            max_scale = scales[ib];
        }
    }
    if (max_abs < 1e-15f) {
        memset(out, 0, 210);
        return;
    }
    float iscale = -128.0f / max_scale;
    uint16_t d16 = kq_f32_to_f16(1 / iscale);
    float d = pi_f16_to_f32(d16);
    int8_t *sc = (int8_t *)(out + 192);
    for (int ib = 0; ib < 16; ib++) {
        int s = (int)lrintf(iscale * scales[ib]);
        sc[ib] = (int8_t)(s < 127 ? s : 127);
        float dj = d * sc[ib];
        for (int l = 0; l < 16; l++)
            L[16 * ib + l] = dj != 0 ? (uint8_t)(kq_clamp((int)lrintf(x[16 * ib + l] / dj), -32, 31) + 32)
                                     : 32;
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int n = 0; n < 2; n++) {  /* each half of 128 values: four rows of 32 */
        const uint8_t *Lh = L + 128 * n;
        for (int l = 0; l < 32; l++) {
            ql[64 * n + l] = (uint8_t)((Lh[l] & 15) | ((Lh[64 + l] & 15) << 4));
            ql[64 * n + 32 + l] = (uint8_t)((Lh[32 + l] & 15) | ((Lh[96 + l] & 15) << 4));
            qh[32 * n + l] = (uint8_t)((Lh[l] >> 4) | ((Lh[32 + l] >> 4) << 2)
                                       | ((Lh[64 + l] >> 4) << 4) | ((Lh[96 + l] >> 4) << 6));
        }
    }
    memcpy(out + 208, &d16, 2);
}

/* ---- importance-weighted scales for the symmetric 32-value types (pyinfer.quants.
 * quantize_weighted's C twin): q4_0 (nmax 8, 18-byte blocks) and q5_0 (nmax 16, 22 bytes).
 * x: the block's 32 values, w: their weights, ref: gguf's round-to-nearest block of x (the
 * baseline, kept unless a candidate has a smaller weighted error), out: the block written.
 * Candidates: d = m / div for the divisors -(nmax + 1) .. -(nmax - 1.5) and nmax - 1.5 ..
 * nmax + 0.5 in steps of 0.25 (m the first value of largest magnitude), then the least-squares
 * scale for those values, rounded to f16, and the values again at that scale. ---- */

/* value k (0..31) of a q4_0 / q5_0 block, unsigned (0 .. 2 nmax - 1) */
static inline int kq_w32_value(const uint8_t *blk, int nmax, int k) {
    const uint8_t *qs = blk + (nmax == 16 ? 6 : 2);
    int u = k < 16 ? (qs[k] & 15) : (qs[k - 16] >> 4);
    if (nmax == 16) {
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        u |= (int)((qh >> k) & 1u) << 4;
    }
    return u;
}

static inline float kq_w32_err(const float *x, const float *w, float d, const int *q) {
    float e = 0.0f;
    for (int k = 0; k < 32; k++) {
        const float r = d * (float)q[k] - x[k];
        e += w[k] * r * r;
    }
    return e;
}

static inline void kq_w32_round(const float *x, float d, int nmax, int *q) {
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int k = 0; k < 32; k++) q[k] = kq_clamp((int)rintf(x[k] * inv), -nmax, nmax - 1);
}

static void kq_quantize_w32(const float *x, const float *w, int nmax, const uint8_t *ref,
                            uint8_t *out) {
    const int bytes = nmax == 16 ? 22 : 18;
    int q[32];
    uint16_t h;
    memcpy(&h, ref, 2);
    const float dref = pi_f16_to_f32(h);
    for (int k = 0; k < 32; k++) q[k] = kq_w32_value(ref, nmax, k) - nmax;
    float best = kq_w32_err(x, w, dref, q);
    int found = 0;
    uint16_t best16 = 0;
    int imax = 0;
    for (int k = 1; k < 32; k++)
        if (fabsf(x[k]) > fabsf(x[imax])) imax = k;
    const float m = x[imax];
    for (int c = 0; c < 20; c++) {
        const float div = c < 11 ? -(float)(nmax + 1) + 0.25f * (float)c
                                 : (float)nmax - 1.5f + 0.25f * (float)(c - 11);
        kq_w32_round(x, m / div, nmax, q);
        float num = 0.0f, den = 0.0f;
        for (int k = 0; k < 32; k++) {
            num += w[k] * (float)q[k] * x[k];
            den += w[k] * (float)q[k] * (float)q[k];
        }
        const uint16_t d16 = kq_f32_to_f16(den > 0.0f ? num / den : 0.0f);
        const float d = pi_f16_to_f32(d16);
        if (!isfinite(d)) continue;
        kq_w32_round(x, d, nmax, q);
        const float e = kq_w32_err(x, w, d, q);
        if (e < best) {
            best = e;
            best16 = d16;
            found = 1;
        }
    }
    if (!found) {
        memcpy(out, ref, (size_t)bytes);
        return;
    }
    kq_w32_round(x, pi_f16_to_f32(best16), nmax, q);
    memcpy(out, &best16, 2);
    uint8_t *qs = out + (nmax == 16 ? 6 : 2);
    uint32_t qh = 0;
    for (int k = 0; k < 16; k++) {
        const int lo = q[k] + nmax, hi = q[k + 16] + nmax;
        qs[k] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
        qh |= (uint32_t)(lo >> 4) << k;
        qh |= (uint32_t)(hi >> 4) << (k + 16);
    }
    if (nmax == 16) memcpy(out + 2, &qh, 4);
}

#endif
