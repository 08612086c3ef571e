/* The indices of the k largest of n floats, for the two-stage lm head (pyinfer.input_sparse:
 * a copy of the head picks K candidates among n_vocab logits, the exact head computes them).
 *
 * Order: value descending, then index ascending (ties at the boundary keep the lower index);
 * NaNs are never taken, so the set is a function of x alone. The indices come out ascending.
 *
 * pi_topk_heap: one pass with a min-heap of k (value, index) entries: the first k non-NaN
 * values fill it, a later value enters only when strictly greater than the root (a later index
 * ranks below an equal value), then the indices are sorted.
 *
 * pi_topk: the same set with a bound first, for n much larger than k. Cut x into G interleaved
 * groups (x[g], x[g + G], ...), take each group's maximum (a vectorizable elementwise max over
 * rows of G values) and t0 = the k-th largest of those G maxima (quickselect): k groups hold a
 * value >= t0, so the k-th largest of x is >= t0 and every member of the answer is among the
 * values >= t0.
 * One vectorized compare pass lists them in index order (on SmolLM2's logits a few hundred of
 * 49,152); the heap runs over that list only, and instead of a sort the list is walked once more
 * keeping the entries that do not rank below the heap's root. Where the bound does not help
 * (n < 4 G, t0 = -inf, or more than PI_TOPK_CAND_MULT k values >= t0) it returns -1 and the
 * caller runs pi_topk_heap. Same set as pi_topk_heap on every input (tests/test_ibsum.py).
 */
#ifndef PYINFER_TOPK_H
#define PYINFER_TOPK_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PI_TOPK_CAND_MULT 16

/* (va, ia) ranks below (vb, ib): a smaller value, or the same value at a higher index */
static inline int pi_tk_less(float va, int32_t ia, float vb, int32_t ib) {
    return va < vb || (va == vb && ia > ib);
}

/* restore the min-heap (hv, hi) of k entries below root r */
static inline void pi_tk_sift(float *hv, int32_t *hi, int64_t k, int64_t r) {
    for (;;) {
        int64_t c = 2 * r + 1;
        if (c >= k) return;
        if (c + 1 < k && pi_tk_less(hv[c + 1], hi[c + 1], hv[c], hi[c])) c += 1;
        if (!pi_tk_less(hv[c], hi[c], hv[r], hi[r])) return;
        float v = hv[r]; int32_t i = hi[r];
        hv[r] = hv[c]; hi[r] = hi[c];
        hv[c] = v; hi[c] = i;
        r = c;
    }
}

/* The heap over the values x[idx[0..n)] (idx ascending; idx NULL: idx[j] = j). Returns the
 * number of entries m = min(k, non-NaN count) left in (hv, hi). */
static inline int64_t pi_tk_fill(const float *x, const int32_t *idx, int64_t n, int64_t k,
                                 float *hv, int32_t *hi) {
    int64_t m = 0, j = 0;
    for (; j < n && m < k; j++) {  /* the first k non-NaN values */
        int32_t i = idx ? idx[j] : (int32_t)j;
        float v = x[i];
        if (v == v) { hv[m] = v; hi[m] = i; m++; }
    }
    for (int64_t r = m / 2 - 1; r >= 0; r--) pi_tk_sift(hv, hi, m, r);
    if (m < k) return m;
    for (; j < n; j++) {  /* strictly greater only: a later index ranks below an equal value */
        int32_t i = idx ? idx[j] : (int32_t)j;
        if (x[i] > hv[0]) { hv[0] = x[i]; hi[0] = i; pi_tk_sift(hv, hi, m, 0); }
    }
    return m;
}

static int pi_tk_cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The k-th largest (1 <= k <= n) of a[0..n), none NaN, by quickselect (Hoare's partition
 * around a median of three); permutes a. */
static inline float pi_kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;  /* a[want] once a is sorted descending */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        float p0 = a[lo], p1 = a[mid], p2 = a[hi];
        float p = p0 > p1 ? (p1 > p2 ? p1 : (p0 > p2 ? p2 : p0))
                          : (p0 > p2 ? p0 : (p1 > p2 ? p2 : p1));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* hv, hi: k entries each. Returns m; out[0..m) ascending. */
static inline int64_t pi_topk_heap(const float *x, int64_t n, int64_t k, int32_t *out,
                                   float *hv, int32_t *hi) {
    int64_t m = pi_tk_fill(x, NULL, n, k, hv, hi);
    qsort(hi, (size_t)m, sizeof(int32_t), pi_tk_cmp_i32);
    memcpy(out, hi, (size_t)m * sizeof(int32_t));
    return m;
}

/* The bounded form (module comment). gm: G floats; hv, hi: k entries each (k <= G); cand:
 * PI_TOPK_CAND_MULT * k int32. Returns k with out[0..k) ascending, or -1 where the caller must
 * run pi_topk_heap. */
static inline int64_t pi_topk(const float *x, int64_t n, int64_t k, int32_t *out, int64_t G,
                              float *gm, float *hv, int32_t *hi, int32_t *cand) {
    if (k <= 0 || k > G || n < 4 * G) return -1;
    for (int64_t g = 0; g < G; g++) gm[g] = -INFINITY;
    int64_t base = 0;
    for (; base + G <= n; base += G) {
        const float *r = x + base;
        for (int64_t g = 0; g < G; g++) gm[g] = r[g] > gm[g] ? r[g] : gm[g];  /* NaN: kept out */
    }
    for (int64_t g = 0; base + g < n; g++) gm[g] = x[base + g] > gm[g] ? x[base + g] : gm[g];
    float t0 = pi_kth_largest(gm, G, k);  /* permutes gm */
    if (!(t0 > -INFINITY)) return -1;
    int64_t cap = PI_TOPK_CAND_MULT * k, c = 0, j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 tv = _mm512_set1_ps(t0);
    for (; j + 16 <= n; j += 16) {
        __mmask16 mk = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), tv, _CMP_GE_OQ);
        if (!mk) continue;
        if (c + 16 > cap) return -1;
        while (mk) { int b = __builtin_ctz(mk); cand[c++] = (int32_t)(j + b); mk &= mk - 1; }
    }
#elif defined(__AVX2__)
    __m256 tv = _mm256_set1_ps(t0);
    for (; j + 8 <= n; j += 8) {
        unsigned mk = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(x + j), tv, _CMP_GE_OQ));
        if (!mk) continue;
        if (c + 8 > cap) return -1;
        while (mk) { int b = __builtin_ctz(mk); cand[c++] = (int32_t)(j + b); mk &= mk - 1; }
    }
#endif
    for (; j < n; j++) {
        if (x[j] >= t0) {
            if (c >= cap) return -1;
            cand[c++] = (int32_t)j;
        }
    }
    /* c >= k: each of the k groups behind t0 has its maximum among the candidates */
    pi_tk_fill(x, cand, c, k, hv, hi);  /* k entries: c >= k */
    float rv = hv[0]; int32_t ri = hi[0];  /* the answer's lowest-ranked member */
    int64_t o = 0;
    for (int64_t q = 0; q < c; q++) {
        int32_t i = cand[q];
        if (!pi_tk_less(x[i], i, rv, ri)) out[o++] = i;
    }
    return o;
}

#endif
