/* Input-sparse projections in the input-block layout (issue 12, session 11):
 *
 *     out[0:n_out] = W xm,   xm = x with the dropped input channels set to 0
 *
 * for a matrix W (n_out, n_in) whose q8_0, q4_0, q4_1, q5_0 or q5_1 weights are stored per block
 * of 32 input channels instead of per output row. The numbers are those of the row-major matrix
 * (ggml's blocks: one f16 scale d[i, b] per output i and input block b, for q4_1 and q5_1 also an
 * f16 min m[i, b], and 32 values q[i, 32b + c]), only moved: input block b of the tensor holds
 *
 *     d[0:n_out, b] as f16 (2 n_out bytes), for q4_1 / q5_1 then m[0:n_out, b] (2 n_out bytes),
 *     then the 32 value rows of channels 32b .. 32b + 31, each n_out bytes (q8_0: q ^ 0x80, i.e.
 *     q + 128 as an unsigned byte), n_out / 2 bytes (q4_0: the unsigned nibble u = q + 8; q4_1:
 *     its nibble u, w = d u + m; two outputs per byte) or 5 n_out / 8 bytes (q5_0: u = q + 16 in
 *     0..31; q5_1: u, w = d u + m; per 64-output tile the 32 bytes of its low nibbles as q4_0's,
 *     then a 64-bit little-endian word whose bit 8 (p % 8) + p / 8 is the fifth bit of position
 *     p: 40 bytes a tile).
 *
 * A kept channel j is one contiguous value row, so the bytes read shrink with the sparsity
 * (plus the scale row of each block with a kept channel, 1/17 of a q8_0 block). The products
 * are the GEMV's (gemv.h, simd.h pi_quantize_q8; llama.cpp's q8_0 x q8_0 dot): per block the
 * kept x_j are quantized to int8 with s_b = max |x_j| / 127, the integer sums
 *
 *     acc[i, b] = sum_{kept j in b} xq_j q[i, j]
 *
 * are exact, and out_i = sum over blocks in order of (s_b d[i, b]) * acc[i, b] (one f32 FMA per
 * block). For q8_0 that is the GEMV of the masked x bit for bit (same quantized activation,
 * same integer sums, same f32 order: tests/test_ibsum.py checks it against cpu.matvec); for
 * q4_0 (q5_0) the integer offset 8 sum(xq) (16 sum(xq)) is taken off inside the integer sum (the
 * GEMV subtracts it in f32), so the two differ by f32 rounding. q4_1 and q5_1 add their min term
 * as the GEMV does (gemv.h:
 * out_i = fma(m[i, b] / 8, 8 s_b sum(xq), fma(s_b d[i, b], acc[i, b], out_i)) per block, acc over
 * the unsigned nibbles), so it too has the masked GEMV's bits. Error against the exact product, per output i:
 * |err_i| <= sum_b s_b / 2 * sum_{kept j in b} |d[i, b] q[i, j]| (+ f32 rounding): the int8
 * activation of the dense GEMV.
 *
 * Kernel. Outputs go in tiles of 64. Four kept rows at a time: their 64 bytes of the tile are
 * interleaved by two rounds of byte/word unpacks so that each 32-bit lane holds the four rows'
 * bytes of one output, and one dpbusd (AVX512-VNNI; u8 values x s8 xq) adds the four products
 * into int32 (q8_0's +128 and q4_0's +8 come off as corr = 128 or 8 times sum(xq) per block).
 * The unpacks work inside 128-bit lanes, so the file stores each 64-byte tile permuted: byte
 * position p = 16 L + 4 s + m holds output 16 s + 4 L + m (L, s, m in 0..3), which makes lane k
 * of the s-th sum output 16 s + k (and for a 256-bit half h of the tile, lane k of the s-th sum
 * output 16 s + 8 h + k). A q4_0 tile is 32 bytes: byte p's low nibble is position p, its high
 * nibble position 32 + p; a q5 tile adds the fifth bits as 16 where set. The fifth-bit word is
 * stored transposed so that, broadcast to every 64-bit lane, byte p % 8 of lane p / 8 holds
 * position p's bit at bit p / 8: one variable shift per lane (by 4 - p / 8) brings every
 * position's bit to bit 4 of its own byte, and an and with 16 leaves the value to add (three
 * operations with the or; AVX-512: the shift, then and-or in one ternary-logic operation).
 * Rows of fewer than four kept channels are padded with xq = 0. The 4-bit types (q4_0, q4_1)
 * interleave a row's packed bytes instead of its values: byte p holds positions p and 32 + p,
 * so one interleave serves both halves (low nibbles, and high ones entering dpbusd as 16 u and
 * shifted back once a block), and the AVX-512 build takes two tiles' 64 bytes a load
 * (pi_ib_tile_q4, pi_ib_tile2_q4: the same integers).
 * An AVX2 CPU with AVX-VNNI (the VEX form: Intel Alder Lake and later, Zen 5) runs the 256-bit
 * paths with the same dpbusd (simd.h PI_VNNI256). Without VNNI (AVX2) the same four-row lanes
 * go through maddubs / madd (q8_0 with the sign trick: |q| x sign(xq, q), at most 2 * 128 * 127
 * per pair); without SIMD a scalar loop. All give the same integers and the same f32
 * operations, so the same bits.
 *
 * Threads split the 32-output half tiles (every output's sum runs over the same blocks in the
 * same order: the bits do not depend on the thread count; SmolLM2's 576 outputs are 18 halves,
 * 9/9 on two threads where whole tiles split 5/4); a thread's range may start or end in the
 * middle of a tile, and that lone half goes through the 256-bit path (VNNI: 256-bit dpbusd
 * on the same four-row lanes; AVX2: its usual half) in a private copy of the tile. Every thread
 * quantizes every block itself (AVX-512: 32 lanes per block) into its own stack arrays, so the
 * team needs no barrier. Block-outer, tile-inner: a block's kept rows stream together. Prefetch (into L2, session 11,
 * measured on 30 matrices streamed from memory: tools/ab_input_kernels.py --evict-mib): the
 * VNNI path prefetches, while doing tile u of block b, tile u + 16 (PI_IB_PF_DIST; 8 until session 38) of the thread's (block, tile)
 * sequence (the current block's rows, or the next non-empty block's past the range; at most one
 * block ahead) and the next block's scale row of tile u; the AVX2 path the next block's kept
 * rows of tile u, one prefetch per tile. On the VNNI path one prefetch per 32 bytes (two per
 * 64-byte line, although the rows are line-aligned) measured faster from memory than one per
 * line, and slower from cache (pi_ib_halves' stream 0 keeps the lighter prefetch, for a caller
 * that reads the same matrix again and again).
 *
 * Prefill (pi_ib_matmul) is a GEMM over the dense masked input with decode's integers and
 * decode's flush, so each token gets decode's bits: chunks of tokens share each loaded group of
 * four rows, every row of a block enters (a dropped channel has coefficient 0), and a tile's
 * blocks are unpacked once per call (see there).
 *
 * Included by rowsum_team.h (after simd.h).
 */
#ifndef PYINFER_IBSUM_H
#define PYINFER_IBSUM_H

#include <stdint.h>
#include <string.h>
#include <math.h>

/* pyinfer's own type ids for the layout (not ggml's: the file stores these tensors as Q8_0 /
 * Q4_0 rows of 32 n_out values, one row per input block, under names of their own) */
#define PI_Q8_0_IB 1008
#define PI_Q4_0_IB 1002
#define PI_Q4_1_IB 1003
#define PI_Q5_0_IB 1006
#define PI_Q5_1_IB 1007
#define PI_IB_TILE 64

static inline int pi_is_ib(int t) {
    return t == PI_Q8_0_IB || t == PI_Q4_0_IB || t == PI_Q4_1_IB || t == PI_Q5_0_IB ||
           t == PI_Q5_1_IB;
}

/* 1 for the types with a min per output and block (w = d u + m: q4_1, q5_1) */
static inline int pi_ib_has_min(int t) { return t == PI_Q4_1_IB || t == PI_Q5_1_IB; }

/* 1 for the 4-bit types. Their products u xq (u <= 15, |xq| <= 127) come in pairs of at most
 * 2 * 15 * 127 = 3810 from maddubs, so the int16 sums of a block's 8 groups stay under 30480 <
 * 2^15: the AVX2 path adds them in int16 and widens once a block (the same integers). */
static inline int pi_ib_is_q4(int t) { return t == PI_Q4_0_IB || t == PI_Q4_1_IB; }

/* 1 for the 5-bit types (a tile's 32 nibble bytes, then 8 bytes of fifth bits) */
static inline int pi_ib_is_q5(int t) { return t == PI_Q5_0_IB || t == PI_Q5_1_IB; }

/* value bytes of one kept row (n_out outputs, a multiple of 64) */
static inline size_t pi_ib_row_bytes(int t, long n_out) {
    return t == PI_Q8_0_IB   ? (size_t)n_out
           : pi_ib_is_q5(t) ? (size_t)n_out / 8 * 5
                            : (size_t)n_out / 2;
}

/* bytes of one tile (64 outputs) of a value row: 64 (q8_0), 32 (q4_0, q4_1), 40 (q5_0, q5_1) */
static inline size_t pi_ib_tile_bytes(int t) {
    return t == PI_Q8_0_IB ? 64 : pi_ib_is_q5(t) ? 40 : 32;
}

/* bytes of a block's scale rows: the f16 scales d, and for q4_1 / q5_1 then the f16 mins m */
static inline size_t pi_ib_scale_bytes(int t, long n_out) {
    return (pi_ib_has_min(t) ? 4 : 2) * (size_t)n_out;
}

/* bytes of one input block: the scale rows and 32 value rows */
static inline size_t pi_ib_block_bytes(int t, long n_out) {
    return pi_ib_scale_bytes(t, n_out) + 32 * pi_ib_row_bytes(t, n_out);
}

/* The outputs a tensor's layout holds, from its block bytes `stride`: n_out, or more where the
 * file appends zero outputs (pi_ib_pad_outs) so that the value rows are not a multiple of 2 KiB
 * apart. Every address in a block (the mins row, the value rows and their pitch) follows this
 * count; the sums run over the first n_out outputs only. */
static inline long pi_ib_layout_outs(int t, size_t stride) {
    return (long)(stride / pi_ib_block_bytes(t, PI_IB_TILE) * PI_IB_TILE);
}

/* Zero outputs a file appends to a matrix of n_out outputs (python: cpu.ib_pad_outs): 64 where
 * its value rows would be a multiple of 2 KiB long. The 32 rows of a block are then read side by
 * side at a stride that maps them all to the same L1 sets (and fewer L2 sets): on the 2-core
 * Zen 4 box a q8_0 or q4_0 matrix of 4096, 8192 or 16384 outputs ran 1.5-2.1x slower than the
 * row-major GEMV, one of 16448 at 0.74-0.97x (docs/benchmarks.md, session 22). */
static inline long pi_ib_pad_outs(int t, long n_out) {
    return pi_ib_row_bytes(t, n_out) % 2048 == 0 ? 64 : 0;
}

/* what pi_ib_prep stores in corr per unit of the block's sum(xq): the offset of the unsigned
 * values (q8_0 128, q4_0 8, q5_0 16), taken off the integer sums in the flush; q4_1 and q5_1
 * keep sum(xq) itself for their min term (their values need no offset) */
static inline int pi_ib_corr_unit(int t) {
    return t == PI_Q8_0_IB ? 128 : t == PI_Q4_0_IB ? 8 : t == PI_Q5_0_IB ? 16 : 1;
}

/* 1 where a stride of `stride` bytes for `cols` outputs is that of an input-block tensor,
 * padded (pi_ib_pad_outs) or not (the row layouts have at most 4 bytes per value) */
static inline int pi_ib_stride(size_t stride, long cols) {
    if (cols <= 0) return 0;
    for (int k = 0; k < 5; k++) {
        const size_t per = k == 0 ? 34 : k == 1 ? 18 : k == 2 ? 20 : k == 3 ? 22 : 24;
        if (stride == per * (size_t)cols || stride == per * (size_t)(cols + 64)) return 1;
    }
    return 0;
}


/* Quantize the kept entries k0..k1 of block b (coef[k] at channel idx[k], all in block b) as
 * pi_quantize_q8 quantizes a block, and lay out their rows in groups of four (n_out: the
 * layout's outputs, pi_ib_layout_outs: the value rows' pitch). */
static inline void pi_ib_prep(int t, long n_out, const float *coef, const int32_t *idx, long k0,
                              long k1, long b, int32_t *off, int32_t *cf, int32_t *ng, float *sb,
                              int32_t *corr) {
    const size_t rb = pi_ib_row_bytes(t, n_out);
#if PI_SIMD && defined(__AVX512F__) && defined(__AVX512BW__)
    {
        /* the scalar loop below, 16 lanes at a time (as simd.h pi_quantize_q8: max |x| in any
         * order, one f32 product per value, cvtps rounds to nearest-even as lrintf does in the
         * default rounding mode); lanes past n load 0 and give q = 0 and offset 0 */
        const int n = (int)(k1 - k0);
        const __mmask32 m = n >= 32 ? 0xffffffffu : ((1u << n) - 1u);
        const __mmask16 m0 = (__mmask16)m, m1 = (__mmask16)(m >> 16);
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, coef + k0);
        const __m512 x1 = _mm512_maskz_loadu_ps(m1, coef + k0 + 16);
        /* max |x| as int32 bit patterns: a NaN stays (simd.h pi_absmax8) */
        const int amax_bits = _mm512_reduce_max_epi32(_mm512_max_epi32(
            _mm512_castps_si512(_mm512_abs_ps(x0)), _mm512_castps_si512(_mm512_abs_ps(x1))));
        float amax;
        memcpy(&amax, &amax_bits, sizeof amax);
        const float d = amax / 127.0f;
        const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
        int8_t q[32];
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
        memcpy(cf + 8 * b, q, 32);
        const __m512i base = _mm512_set1_epi32((int32_t)(32 * b)), vrb = _mm512_set1_epi32((int32_t)rb);
        const __m512i j0 = _mm512_maskz_loadu_epi32(m0, idx + k0);
        const __m512i j1 = _mm512_maskz_loadu_epi32(m1, idx + k0 + 16);
        _mm512_storeu_si512((void *)(off + 32 * b),
                            _mm512_mullo_epi32(_mm512_maskz_sub_epi32(m0, j0, base), vrb));
        _mm512_storeu_si512((void *)(off + 32 * b + 16),
                            _mm512_mullo_epi32(_mm512_maskz_sub_epi32(m1, j1, base), vrb));
        ng[b] = (n + 3) / 4;
        sb[b] = d;
        corr[b] = pi_ib_corr_unit(t) * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        return;
    }
#elif PI_SIMD
    {
        /* the same at 8 lanes (AVX2, session 27; the scalar loop below cost 256-bit builds
         * about 3% of an input-sparse token: every thread quantizes every block). Lanes past n
         * load 0 (q 0) and store offset 0; the 32 int8 go out in order (the packs work per
         * 128-bit lane, the permute puts the dwords back). */
        const int n = (int)(k1 - k0);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vn = _mm256_set1_epi32(n);
        __m256i m[4];
        __m256 x[4];
        __m256 amax = _mm256_setzero_ps();
        const __m256 nz = _mm256_set1_ps(-0.0f);
        for (int r = 0; r < 4; r++) {
            m[r] = _mm256_cmpgt_epi32(vn, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * r)));
            x[r] = _mm256_maskload_ps(coef + k0 + 8 * r, m[r]);
            amax = pi_absmax8(amax, _mm256_andnot_ps(nz, x[r]));
        }
        __m128 a4 = pi_absmax4(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        a4 = pi_absmax4(a4, _mm_movehl_ps(a4, a4));
        a4 = pi_absmax4(a4, _mm_movehdup_ps(a4));
        const float d = _mm_cvtss_f32(a4) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4], sum = _mm256_setzero_si256();
        const __m256i base = _mm256_set1_epi32((int32_t)(32 * b)), vrb = _mm256_set1_epi32((int32_t)rb);
        for (int r = 0; r < 4; r++) {
            q[r] = _mm256_cvtps_epi32(_mm256_mul_ps(x[r], id));
            sum = _mm256_add_epi32(sum, q[r]);
            const __m256i j = _mm256_maskload_epi32(idx + k0 + 8 * r, m[r]);
            _mm256_storeu_si256((__m256i *)(off + 32 * b + 8 * r),
                                _mm256_and_si256(m[r], _mm256_mullo_epi32(_mm256_sub_epi32(j, base), vrb)));
        }
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(cf + 8 * b),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        ng[b] = (n + 3) / 4;
        sb[b] = d;
        corr[b] = pi_ib_corr_unit(t) * _mm_cvtsi128_si32(s4);
        return;
    }
#endif
    float amax = 0.0f;
    for (long k = k0; k < k1; k++) amax = pi_absmax1(amax, fabsf(coef[k]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t q[32];
    int s = 0, n = (int)(k1 - k0);
    int32_t *o = off + 32 * b;
    for (int i = 0; i < n; i++) {
        const int v = (int)lrintf(coef[k0 + i] * id);
        q[i] = (int8_t)v;
        s += v;
        o[i] = (int32_t)((size_t)(idx[k0 + i] - 32 * b) * rb);
    }
    for (; n & 3; n++) {
        q[n] = 0;
        o[n] = 0;
    }
    for (int g = 0; g < n / 4; g++) memcpy(cf + 8 * b + g, q + 4 * g, 4);
    ng[b] = n / 4;
    sb[b] = d;
    corr[b] = pi_ib_corr_unit(t) * s;
}

/* Position in a 64-output tile of output o (0..63): see the header comment. */
static inline int pi_ib_pos(int o) { return 16 * ((o & 15) >> 2) + 4 * (o >> 4) + (o & 3); }

/* The 64 bytes of tile u of a value row, as unsigned values in permuted position order
 * (scalar: value at position p). */
static inline int pi_ib_val(int t, const uint8_t *row, long u, int p) {
    if (t == PI_Q8_0_IB) return row[64 * u + p];
    const uint8_t *tile = row + pi_ib_tile_bytes(t) * u;
    const int lo = p < 32 ? (tile[p & 31] & 15) : (tile[p & 31] >> 4);
    return pi_ib_is_q5(t) ? lo | (((tile[32 + p % 8] >> (p / 8)) & 1) << 4) : lo;
}

#if PI_SIMD
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PI_IB_VNNI512 1
#else
#define PI_IB_VNNI512 0
#endif

/* half h (positions 32h .. 32h + 31) of tile u of row p, unsigned */
static inline __attribute__((always_inline)) __m256i pi_ib_load256(const int t, const uint8_t *p,
                                                                   long u, int h) {
    if (t == PI_Q8_0_IB) return _mm256_loadu_si256((const __m256i *)(p + 64 * u + 32 * h));
    const uint8_t *tile = p + pi_ib_tile_bytes(t) * u;
    const __m256i v = _mm256_loadu_si256((const __m256i *)tile);
    const __m256i lo = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    if (!pi_ib_is_q5(t)) return lo;
    /* the fifth-bit word in every 64-bit lane; lane q holds positions 32 h + 8 q + (0..7) at bit
     * 4 h + q of their bytes: to bit 4 by a left shift of 4 - q (h 0) or a right one of q (h 1) */
    int64_t bits;
    memcpy(&bits, tile + 32, 8);
    const __m256i w = _mm256_set1_epi64x(bits);
    const __m256i at4 = h ? _mm256_srlv_epi64(w, _mm256_setr_epi64x(0, 1, 2, 3))
                          : _mm256_sllv_epi64(w, _mm256_setr_epi64x(4, 3, 2, 1));
    return _mm256_or_si256(lo, _mm256_and_si256(at4, _mm256_set1_epi8(16)));
}

#if PI_IB_VNNI512
/* the 64 unsigned values of tile u of row p */
static inline __attribute__((always_inline)) __m512i pi_ib_load512(const int t, const uint8_t *p,
                                                                   long u) {
    if (t == PI_Q8_0_IB) return _mm512_loadu_si512((const void *)(p + 64 * u));
    const uint8_t *tile = p + pi_ib_tile_bytes(t) * u;
    const __m256i v = _mm256_loadu_si256((const __m256i *)tile);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi8(15));
    if (!pi_ib_is_q5(t)) return lo;
    /* lane q (positions 8 q .. 8 q + 7) has their bits at bit q: rotated to bit 4 (no bit that
     * wraps around reaches a bit 4), then lo | (that & 16) in one ternary-logic operation */
    int64_t bits;
    memcpy(&bits, tile + 32, 8);
    const __m512i at4 = _mm512_rolv_epi64(_mm512_set1_epi64(bits),
                                          _mm512_setr_epi64(4, 3, 2, 1, 0, 63, 62, 61));
    return _mm512_ternarylogic_epi64(lo, at4, _mm512_set1_epi8(16), 0xf8);  /* a | (b & c) */
}
#endif
#if !PI_VNNI256
/* sum of the four products of each 32-bit lane: unsigned values w (q8_0: q + 128) times the
 * signed coefficients c, into int32, as dpbusd computes it */
static inline __attribute__((always_inline)) __m256i pi_ib_dot4(const int t, __m256i w, __m256i c) {
    if (t == PI_Q8_0_IB) {
        /* q = w - 128 signed; |q| <= 128 times sign(c, q): pairs within int16 (|c| <= 127);
         * the +128 correction is then not needed, so add it back: 128 * sum(c) per lane */
        const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(c, q));
        return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, c), _mm256_set1_epi16(1));
}
#endif

/* y[16 k + 8 h + 0..7] += (s d) * float(acc[k] - corr) for half h of tile u (y: the tile's 64
 * outputs; dsc: the block's f16 scales). q4_1 (cr = sum(xq), no offset; msc: the block's f16
 * mins): y = fma(s d, float(acc), y), then y = fma(m / 8, xs, y) with xs = 8 s sum(xq): the two
 * FMAs per block of the GEMV (gemv.h), so the masked GEMV's bits. */
static inline __attribute__((always_inline)) void pi_ib_flush256(const int t, const uint16_t *dsc,
                                                                 const uint16_t *msc, long u, int h,
                                                                 float s, int32_t cr,
                                                                 const __m256i acc[4], float *y) {
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i vc = _mm256_set1_epi32(pi_ib_has_min(t) ? 0 : cr);
    const __m256 xs = _mm256_set1_ps(8.0f * s * (float)cr);
    for (int k = 0; k < 4; k++) {
        float *yk = y + 16 * k + 8 * h;
        const long a = PI_IB_TILE * u + 16 * k + 8 * h;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dsc + a)));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[k], vc));
        __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(vs, d), f, _mm256_loadu_ps(yk));
        if (pi_ib_has_min(t)) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(msc + a)));
            r = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_set1_ps(0.125f)), xs, r);
        }
        _mm256_storeu_ps(yk, r);
    }
}

/* halves h0 .. h1 - 1 of tile u over one block's G groups of four kept rows (val + o[.],
 * coefficients c), y the tile's 64 outputs. Both halves in one pass read each group's row
 * offsets and coefficient once, and a 4-bit row's 32 bytes (both halves' nibbles) once: 3-10%
 * faster input-sparse decode halves on the 256-bit paths for q4_0 (session 26; q8_0 on AVX2
 * alone ran 1.01-1.03x slower, the sign trick's registers, so pi_ib_halves_t keeps its halves
 * apart there). Whole tiles of the 4-bit types now take pi_ib_tile_q4 (fewer operations); this
 * serves the q5 and q8_0 tiles and every lone half. */
static inline __attribute__((always_inline)) void pi_ib_span256(const int t, const uint8_t *val,
                                                                const int32_t *o, const int32_t *c,
                                                                int G, const uint16_t *dsc,
                                                                const uint16_t *msc, float s,
                                                                int32_t cr, long u, const int h0,
                                                                const int h1, float *y) {
    __m256i a[2][4];
    for (int h = h0; h < h1; h++)
        for (int k = 0; k < 4; k++) a[h][k] = _mm256_setzero_si256();
    for (int g = 0; g < G; g++) {
        const uint8_t *p[4] = {val + o[4 * g], val + o[4 * g + 1], val + o[4 * g + 2],
                               val + o[4 * g + 3]};
        const __m256i cc = _mm256_set1_epi32(c[g]);
#pragma GCC unroll 2
        for (int h = h0; h < h1; h++) {
            const __m256i r0 = pi_ib_load256(t, p[0], u, h), r1 = pi_ib_load256(t, p[1], u, h);
            const __m256i r2 = pi_ib_load256(t, p[2], u, h), r3 = pi_ib_load256(t, p[3], u, h);
            const __m256i l01 = _mm256_unpacklo_epi8(r0, r1), h01 = _mm256_unpackhi_epi8(r0, r1);
            const __m256i l23 = _mm256_unpacklo_epi8(r2, r3), h23 = _mm256_unpackhi_epi8(r2, r3);
            const __m256i v[4] = {_mm256_unpacklo_epi16(l01, l23), _mm256_unpackhi_epi16(l01, l23),
                                  _mm256_unpacklo_epi16(h01, h23), _mm256_unpackhi_epi16(h01, h23)};
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
#if PI_VNNI256
                a[h][k] = pi_dpbusd256(a[h][k], v[k], cc);
#else  /* the 4-bit types: int16 sums over the block (pi_ib_is_q4), widened once below */
                a[h][k] = pi_ib_is_q4(t) ? _mm256_add_epi16(a[h][k], _mm256_maddubs_epi16(v[k], cc))
                                         : _mm256_add_epi32(a[h][k], pi_ib_dot4(t, v[k], cc));
#endif
            }
        }
    }
    for (int h = h0; h < h1; h++) {
#if !PI_VNNI256
        if (pi_ib_is_q4(t))
            for (int k = 0; k < 4; k++) a[h][k] = _mm256_madd_epi16(a[h][k], _mm256_set1_epi16(1));
#endif
        /* q8_0 through pi_ib_dot4 (AVX2) is already signed: no correction */
        pi_ib_flush256(t, dsc, msc, u, h, s, (!PI_VNNI256 && t == PI_Q8_0_IB) ? 0 : cr, a[h], y);
    }
}

/* Both halves of tile u of a 4-bit type (q4_0, q4_1) in one pass over its packed bytes: the four
 * rows' 32 bytes are interleaved once (byte p of a row holds position p in its low nibble and
 * position 32 + p in its high one, so the interleaved bytes put both halves' values in the lanes
 * pi_ib_span256 gives them), then the low nibbles go to half 0 and the high ones to half 1. VNNI:
 * the high nibble enters as it lies (16 u; at most 4 * 240 * 128 a lane and group, 8 groups a
 * block: far inside int32) and the sum is shifted right by 4 before the flush, exact since every
 * term is a multiple of 16. AVX2: its maddubs pairs would pass int16 with 16 u, so the high
 * nibble is shifted down first. Same integers as pi_ib_span256, so the same bits, in 28 vector
 * operations a group of four rows against 41 (VNNI: 8 byte unpacks instead of 16, no shifts). */
static inline __attribute__((always_inline)) void pi_ib_tile_q4(const int t, const uint8_t *val,
                                                                const int32_t *o, const int32_t *c,
                                                                int G, const uint16_t *dsc,
                                                                const uint16_t *msc, float s,
                                                                int32_t cr, long u, float *y) {
    /* named accumulators, each operand consumed as it is made (0.90-1.00x the time of arrays
     * from cache on the proxy build). GCC still copies the dpbusd accumulators between
     * registers every group and keeps some values on the stack (the AVX-VNNI loop: 63
     * instructions a group, 46 with an inline-asm dpbusd that ties them; that asm measured
     * 1.05x on q4_0 and 0.98-1.00x on q4_1 decode on the proxy build: not kept, session 27). */
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a03 = a00;
    __m256i a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    const __m256i lo4 = _mm256_set1_epi8(15);
    const size_t at = 32 * (size_t)u;
#if PI_VNNI256
#define PI_IB_Q4_STEP(A0, A1, V)                                                                  \
    do {                                                                                          \
        const __m256i v_ = (V);                                                                   \
        A0 = pi_dpbusd256(A0, _mm256_and_si256(v_, lo4), cc);                                     \
        A1 = pi_dpbusd256(A1, _mm256_andnot_si256(lo4, v_), cc);                                  \
    } while (0)
#else
#define PI_IB_Q4_STEP(A0, A1, V)                                                                  \
    do {                                                                                          \
        const __m256i v_ = (V);                                                                   \
        A0 = _mm256_add_epi16(A0, _mm256_maddubs_epi16(_mm256_and_si256(v_, lo4), cc));          \
        A1 = _mm256_add_epi16(                                                                    \
            A1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v_, 4), lo4), cc));       \
    } while (0)
#endif
    for (int g = 0; g < G; g++) {
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(val + o[4 * g] + at));
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(val + o[4 * g + 1] + at));
        const __m256i r2 = _mm256_loadu_si256((const __m256i *)(val + o[4 * g + 2] + at));
        const __m256i r3 = _mm256_loadu_si256((const __m256i *)(val + o[4 * g + 3] + at));
        const __m256i cc = _mm256_set1_epi32(c[g]);
        const __m256i l01 = _mm256_unpacklo_epi8(r0, r1), l23 = _mm256_unpacklo_epi8(r2, r3);
        PI_IB_Q4_STEP(a00, a10, _mm256_unpacklo_epi16(l01, l23));
        PI_IB_Q4_STEP(a01, a11, _mm256_unpackhi_epi16(l01, l23));
        const __m256i h01 = _mm256_unpackhi_epi8(r0, r1), h23 = _mm256_unpackhi_epi8(r2, r3);
        PI_IB_Q4_STEP(a02, a12, _mm256_unpacklo_epi16(h01, h23));
        PI_IB_Q4_STEP(a03, a13, _mm256_unpackhi_epi16(h01, h23));
    }
#undef PI_IB_Q4_STEP
#if PI_VNNI256
    const __m256i f0[4] = {a00, a01, a02, a03};
    const __m256i f1[4] = {_mm256_srai_epi32(a10, 4), _mm256_srai_epi32(a11, 4),
                           _mm256_srai_epi32(a12, 4), _mm256_srai_epi32(a13, 4)};
#else
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i f0[4] = {_mm256_madd_epi16(a00, one), _mm256_madd_epi16(a01, one),
                           _mm256_madd_epi16(a02, one), _mm256_madd_epi16(a03, one)};
    const __m256i f1[4] = {_mm256_madd_epi16(a10, one), _mm256_madd_epi16(a11, one),
                           _mm256_madd_epi16(a12, one), _mm256_madd_epi16(a13, one)};
#endif
    pi_ib_flush256(t, dsc, msc, u, 0, s, cr, f0, y);
    pi_ib_flush256(t, dsc, msc, u, 1, s, cr, f1, y);
}

/* half h of tile u (pi_ib_span256) */
static inline __attribute__((always_inline)) void pi_ib_half(const int t, const uint8_t *val,
                                                             const int32_t *o, const int32_t *c,
                                                             int G, const uint16_t *dsc,
                                                             const uint16_t *msc, float s,
                                                             int32_t cr, long u, int h, float *y) {
    pi_ib_span256(t, val, o, c, G, dsc, msc, s, cr, u, h, h + 1, y);
}

#if PI_IB_VNNI512
/* y[0..15] += (s d) * float(acc) for the 16 outputs at a (= 64 u + 16 k) of a block (acc: the
 * integer sums with the correction taken off; vs = s, xs = 8 s sum(xq)): pi_ib_flush256's
 * operations, 16 lanes at a time (q4_1 / q5_1: then the min term) */
static inline __attribute__((always_inline)) void pi_ib_flush512(const int t, const uint16_t *dsc,
                                                                 const uint16_t *msc, long a,
                                                                 __m512 vs, __m512 xs,
                                                                 __m512i acc, float *yk) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dsc + a)));
    __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(vs, d), _mm512_cvtepi32_ps(acc), _mm512_loadu_ps(yk));
    if (pi_ib_has_min(t)) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(msc + a)));
        r = _mm512_fmadd_ps(_mm512_mul_ps(m, _mm512_set1_ps(0.125f)), xs, r);
    }
    _mm512_storeu_ps(yk, r);
}

/* the whole tile u (both halves in one 512-bit pass) */
static inline __attribute__((always_inline)) void pi_ib_tile512(const int t, const uint8_t *val,
                                                                const int32_t *o, const int32_t *c,
                                                                int G, const uint16_t *dsc,
                                                                const uint16_t *msc, float s,
                                                                int32_t cr, long u, float *y) {
    /* the correction enters at the start: the same integers as subtracting it at the end */
    __m512i a0 = _mm512_set1_epi32(pi_ib_has_min(t) ? 0 : -cr), a1 = a0, a2 = a0, a3 = a0;
    for (int g = 0; g < G; g++) {
        const __m512i r0 = pi_ib_load512(t, val + o[4 * g], u);
        const __m512i r1 = pi_ib_load512(t, val + o[4 * g + 1], u);
        const __m512i r2 = pi_ib_load512(t, val + o[4 * g + 2], u);
        const __m512i r3 = pi_ib_load512(t, val + o[4 * g + 3], u);
        const __m512i l01 = _mm512_unpacklo_epi8(r0, r1), h01 = _mm512_unpackhi_epi8(r0, r1);
        const __m512i l23 = _mm512_unpacklo_epi8(r2, r3), h23 = _mm512_unpackhi_epi8(r2, r3);
        const __m512i cc = _mm512_set1_epi32(c[g]);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_unpacklo_epi16(l01, l23), cc);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_unpackhi_epi16(l01, l23), cc);
        a2 = _mm512_dpbusd_epi32(a2, _mm512_unpacklo_epi16(h01, h23), cc);
        a3 = _mm512_dpbusd_epi32(a3, _mm512_unpackhi_epi16(h01, h23), cc);
    }
    const __m512 vs = _mm512_set1_ps(s);
    const __m512 xs = _mm512_set1_ps(8.0f * s * (float)cr);
    const __m512i acc[4] = {a0, a1, a2, a3};
    for (int k = 0; k < 4; k++)
        pi_ib_flush512(t, dsc, msc, PI_IB_TILE * u + 16 * k, vs, xs, acc[k], y + 16 * k);
}
/* Tiles u and u + 1 of a 4-bit type (pi_ib_tile_q4 at 512 bits): a row's 64 packed bytes of the
 * two tiles are interleaved once, in 128-bit lanes, so that lanes 0-1 hold tile u's bytes as
 * pi_ib_tile_q4's 256-bit vectors do and lanes 2-3 tile u + 1's; low nibbles to half 0, high ones
 * (as 16 u, shifted back before the flush) to half 1. 28 operations a group of four rows for 128
 * outputs, where two pi_ib_tile512 take 56. Same integers, same flush, so the same bits. */
static inline __attribute__((always_inline)) void pi_ib_tile2_q4(const int t, const uint8_t *val,
                                                                 const int32_t *o, const int32_t *c,
                                                                 int G, const uint16_t *dsc,
                                                                 const uint16_t *msc, float s,
                                                                 int32_t cr, long u, float *y) {
    /* the correction enters at the start (half 1's as 16 corr: shifted back with the sums) */
    const int32_t c0 = pi_ib_has_min(t) ? 0 : cr;
    __m512i a0[4], a1[4];
    for (int k = 0; k < 4; k++) {
        a0[k] = _mm512_set1_epi32(-c0);
        a1[k] = _mm512_set1_epi32(-16 * c0);
    }
    const __m512i lo4 = _mm512_set1_epi8(15);
    const size_t at = 32 * (size_t)u;
    for (int g = 0; g < G; g++) {
        const __m512i r0 = _mm512_loadu_si512((const void *)(val + o[4 * g] + at));
        const __m512i r1 = _mm512_loadu_si512((const void *)(val + o[4 * g + 1] + at));
        const __m512i r2 = _mm512_loadu_si512((const void *)(val + o[4 * g + 2] + at));
        const __m512i r3 = _mm512_loadu_si512((const void *)(val + o[4 * g + 3] + at));
        const __m512i l01 = _mm512_unpacklo_epi8(r0, r1), h01 = _mm512_unpackhi_epi8(r0, r1);
        const __m512i l23 = _mm512_unpacklo_epi8(r2, r3), h23 = _mm512_unpackhi_epi8(r2, r3);
        const __m512i v[4] = {_mm512_unpacklo_epi16(l01, l23), _mm512_unpackhi_epi16(l01, l23),
                              _mm512_unpacklo_epi16(h01, h23), _mm512_unpackhi_epi16(h01, h23)};
        const __m512i cc = _mm512_set1_epi32(c[g]);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            a0[k] = _mm512_dpbusd_epi32(a0[k], _mm512_and_si512(v[k], lo4), cc);
            a1[k] = _mm512_dpbusd_epi32(a1[k], _mm512_andnot_si512(lo4, v[k]), cc);
        }
    }
    /* the flush per tile: outputs 16 k .. 16 k + 15 of tile u + j are half 0's lanes of sum k,
     * then half 1's: 128-bit lanes 2 j, 2 j + 1 of a0[k] and of a1[k] >> 4 */
    const __m512 vs = _mm512_set1_ps(s);
    const __m512 xs = _mm512_set1_ps(8.0f * s * (float)cr);
    for (int k = 0; k < 4; k++) {
        const __m512i hi = _mm512_srai_epi32(a1[k], 4);
        pi_ib_flush512(t, dsc, msc, PI_IB_TILE * u + 16 * k, vs, xs,
                       _mm512_shuffle_i64x2(a0[k], hi, 0x44), y + 16 * k);
        pi_ib_flush512(t, dsc, msc, PI_IB_TILE * (u + 1) + 16 * k, vs, xs,
                       _mm512_shuffle_i64x2(a0[k], hi, 0xee), y + PI_IB_TILE + 16 * k);
    }
}
#endif
#else
/* halves h0..h1-1 of tile u, one output at a time (output i is in half (i >> 3) & 1) */
static inline void pi_ib_scalar(const int t, const uint8_t *val, const int32_t *o, const int32_t *c,
                                int G, const uint16_t *dsc, const uint16_t *msc, float s,
                                int32_t cr, long u, int h0, int h1, float *y) {
    for (int i = 0; i < PI_IB_TILE; i++) {
        const int h = (i >> 3) & 1;
        if (h < h0 || h >= h1) continue;
        const int p = pi_ib_pos(i);
        int32_t acc = 0;
        for (int g = 0; g < G; g++) {
            int8_t q4[4];
            memcpy(q4, c + g, 4);
            for (int r = 0; r < 4; r++) acc += q4[r] * pi_ib_val(t, val + o[4 * g + r], u, p);
        }
        const float d = pi_f16_to_f32(dsc[PI_IB_TILE * u + i]);
        if (pi_ib_has_min(t))  /* pi_ib_flush256 */
            y[i] = fmaf(0.125f * pi_f16_to_f32(msc[PI_IB_TILE * u + i]), 8.0f * s * (float)cr,
                        fmaf(s * d, (float)acc, y[i]));
        else
            y[i] = fmaf(s * d, (float)(acc - cr), y[i]);
    }
}
#endif /* PI_SIMD */

/* 4-bit tiles from one interleave of their packed bytes (session 27; 0: the older paths, for A/B
 * builds): the AVX-512 build two whole tiles at a time (pi_ib_tile2_q4), the 256-bit builds both
 * halves of a tile (pi_ib_tile_q4) */
#ifndef PI_IB_Q4_PAIR
#define PI_IB_Q4_PAIR 1
#endif
#ifndef PI_IB_Q4_256
#define PI_IB_Q4_256 1
#endif

/* Prefetch (PI_IB_PF_HINT, into L2) the line of half h of tile u of the n kept rows o[0..n) of
 * the value rows valn */
#ifndef PI_IB_PF_HINT
#define PI_IB_PF_HINT _MM_HINT_T1
#endif
#ifndef PI_IB_PF_LINES
#define PI_IB_PF_LINES 2
#endif
/* tiles ahead (>= 1). 16 since session 38 (8 before): SmolLM2's default input files, decode in
 * one process with the distance switched round by round: 1 thread q4_0 / q4_1 / q8_0 1.056 /
 * 1.050 / 1.047x, 2 threads (rounds with two cores' compute) 1.030 / 1.011 / 0.998x; 24 and 32
 * no better (docs/benchmarks.md, session 38) */
#ifndef PI_IB_PF_DIST
#define PI_IB_PF_DIST 16
#endif
#ifndef PI_IB_PF_SCALES
#define PI_IB_PF_SCALES 1
#endif
#ifndef PI_IB_PF_AHEAD
#define PI_IB_PF_AHEAD 1
#endif
static inline __attribute__((always_inline)) void pi_ib_pf(const int t, const uint8_t *valn,
                                                           const int32_t *on, int n, long u, int h) {
#if PI_SIMD
    const size_t at = t == PI_Q8_0_IB ? 64 * (size_t)u + 32 * (size_t)h : pi_ib_tile_bytes(t) * (size_t)u;
    for (int g = 0; g < n; g++) _mm_prefetch((const char *)(valn + on[g] + at), PI_IB_PF_HINT);
    if (pi_ib_is_q5(t))  /* a 40-byte tile may end in the next line */
        for (int g = 0; g < n; g++) _mm_prefetch((const char *)(valn + on[g] + at + 39), PI_IB_PF_HINT);
#else
    (void)t; (void)valn; (void)on; (void)n; (void)u; (void)h;
#endif
}

/* out += the products of the prepared blocks over the half tiles v0 .. v1 - 1 (half v: tile v / 2,
 * positions 32 (v % 2) .. + 31, i.e. outputs 64 (v / 2) + 16 s + 8 (v % 2) + k, s in 0..3, k in
 * 0..7). Every output gets the same operations whichever range holds it: an odd v0 or v1 makes a
 * lone half tile, which the VNNI build sums with 256-bit dpbusd, the AVX2 build as always.
 * stream: 1 for a decode (the weights come from memory: the prefetch of the header comment),
 * 0 where they are read again right after (prefill, token after token: only the next block's
 * rows of the same tile, one prefetch per tile, as a0af1f5 did; the decode prefetch measured
 * 1.14-1.39x slower there on one thread). Bits do not depend on it. */
static inline __attribute__((always_inline)) void
pi_ib_halves_t(const int t, const uint8_t *w, size_t stride, long n_out, long nb,
               const int32_t *off, const int32_t *cf, const int32_t *ng, const float *sb,
               const int32_t *corr, long v0, long v1, float *out, int stream) {
    const long ua = (v0 + 1) / 2, ub = v1 / 2;  /* whole tiles */
    const int head = (int)(v0 & 1) && v0 < v1, tail = (int)(v1 & 1) && v1 - 1 >= v0 + head;
    /* a lone half's outputs share cache lines with the other half (another thread's): sum them in
     * a private copy of the tile and write them back at the end (same operations, same bits) */
    float yh[PI_IB_TILE] __attribute__((aligned(64))), yt[PI_IB_TILE] __attribute__((aligned(64)));
    float *oh = out + PI_IB_TILE * (v0 / 2), *ot = out + PI_IB_TILE * (v1 / 2);
    for (int k = 0; k < 4; k++) {
        if (head) memcpy(yh + 16 * k + 8, oh + 16 * k + 8, 8 * sizeof(float));
        if (tail) memcpy(yt + 16 * k, ot + 16 * k, 8 * sizeof(float));
    }
    (void)n_out;
    const long lo = pi_ib_layout_outs(t, stride);  /* the layout's outputs (addresses) */
    for (long b = 0; b < nb; b++) {
        const int G = ng[b];
        if (!G) continue;
        const uint8_t *blk = w + stride * (size_t)b;
        const uint16_t *dsc = (const uint16_t *)blk, *msc = dsc + lo; /* msc: q4_1's mins */
        const uint8_t *val = blk + pi_ib_scale_bytes(t, lo);
        const int32_t *o = off + 32 * b, *c = cf + 8 * b;
        long bn = b + 1;
        while (bn < nb && !ng[bn]) bn++;
#if PI_IB_PF_AHEAD == 2
        if (bn < nb) {
            long b2 = bn + 1;
            while (b2 < nb && !ng[b2]) b2++;
            if (b2 < nb) bn = b2;
        }
#endif
        const int Nn = bn < nb ? 4 * ng[bn] : 0;
        const uint8_t *valn = bn < nb ? w + stride * (size_t)bn + pi_ib_scale_bytes(t, lo) : val;
        const int32_t *on = off + 32 * (bn < nb ? bn : b);
        const float s = sb[b];
        const int32_t cr = corr[b];
#if PI_SIMD
        if (head) {
            pi_ib_half(t, val, o, c, G, dsc, msc, s, cr, v0 / 2, 1, yh);
            pi_ib_pf(t, valn, on, Nn, v0 / 2, 1);
        }
        for (long u = ua; u < ub; u++) {
            float *y = out + PI_IB_TILE * u;
            /* one prefetch per 64-byte line (PI_IB_PF_LINES 1) or per 32 bytes (2); a q4_0 tile is
             * half a line */
            const int pf = t == PI_Q8_0_IB || !(u & 1) || u == ua || PI_IB_PF_LINES == 2;
#if PI_IB_VNNI512
            /* two tiles of a 4-bit type at once where both are whole (pi_ib_tile2_q4) */
            const int pair = PI_IB_Q4_PAIR && pi_ib_is_q4(t) && u + 1 < ub;
            for (long up = u; stream && up <= u + pair; up++) {  /* each tile's prefetches */
                /* D tiles ahead in the thread's (block, tile) order; at most one block ahead */
                const long ud = up + (PI_IB_PF_DIST < ub - ua ? PI_IB_PF_DIST : ub - ua);
                if (ud < ub) {
                    pi_ib_pf(t, val, o, 4 * G, ud, 0);
                    if (PI_IB_PF_LINES == 2 && t == PI_Q8_0_IB) pi_ib_pf(t, val, o, 4 * G, ud, 1);
                } else if (ud - ub < ub - ua) {
                    pi_ib_pf(t, valn, on, Nn, ua + ud - ub, 0);
                    if (PI_IB_PF_LINES == 2 && t == PI_Q8_0_IB) pi_ib_pf(t, valn, on, Nn, ua + ud - ub, 1);
                }
                if (PI_IB_PF_SCALES && bn < nb) {  /* the next block's 64 f16 scales of the tile */
                    const char *dn = (const char *)(w + stride * (size_t)bn) + 2 * PI_IB_TILE * up;
                    _mm_prefetch(dn, PI_IB_PF_HINT);
                    _mm_prefetch(dn + 64, PI_IB_PF_HINT);
                    if (pi_ib_has_min(t)) {  /* and its mins */
                        _mm_prefetch(dn + 2 * lo, PI_IB_PF_HINT);
                        _mm_prefetch(dn + 2 * lo + 64, PI_IB_PF_HINT);
                    }
                }
            }
            if (pair) pi_ib_tile2_q4(t, val, o, c, G, dsc, msc, s, cr, u, y);
            else pi_ib_tile512(t, val, o, c, G, dsc, msc, s, cr, u, y);
            if (!stream) {  /* a0af1f5's: the next block's rows, same tile, once per tile */
                pi_ib_pf(t, valn, on, Nn, u, 0);
                if (pair) pi_ib_pf(t, valn, on, Nn, u + 1, 0);
            }
            u += pair;
            (void)pf;
#else
            /* AVX2: a0af1f5's prefetch (two per line measured 0.87-1.10x from memory and up to
             * 1.17x slower from cache on this build) */
            if (pi_ib_is_q4(t) && PI_IB_Q4_256) {  /* both halves from one interleave */
                pi_ib_tile_q4(t, val, o, c, G, dsc, msc, s, cr, u, y);
                pi_ib_pf(t, valn, on, Nn, u, 0);
            } else if (PI_VNNI256 || t != PI_Q8_0_IB) {  /* both halves in one pass */
                pi_ib_span256(t, val, o, c, G, dsc, msc, s, cr, u, 0, 2, y);
                pi_ib_pf(t, valn, on, Nn, u, 0);
            } else {
                pi_ib_half(t, val, o, c, G, dsc, msc, s, cr, u, 0, y);
                pi_ib_pf(t, valn, on, Nn, u, 0);
                pi_ib_half(t, val, o, c, G, dsc, msc, s, cr, u, 1, y);
            }
            (void)pf;
            (void)stream;
#endif
        }
        if (tail) {
            pi_ib_half(t, val, o, c, G, dsc, msc, s, cr, v1 / 2, 0, yt);
            pi_ib_pf(t, valn, on, Nn, v1 / 2, 0);
        }
#else
        (void)valn; (void)on; (void)Nn;
        if (head) pi_ib_scalar(t, val, o, c, G, dsc, msc, s, cr, v0 / 2, 1, 2, yh);
        for (long u = ua; u < ub; u++) pi_ib_scalar(t, val, o, c, G, dsc, msc, s, cr, u, 0, 2, out + PI_IB_TILE * u);
        if (tail) pi_ib_scalar(t, val, o, c, G, dsc, msc, s, cr, v1 / 2, 0, 1, yt);
#endif
    }
    for (int k = 0; k < 4; k++) {
        if (head) memcpy(oh + 16 * k + 8, yh + 16 * k + 8, 8 * sizeof(float));
        if (tail) memcpy(ot + 16 * k, yt + 16 * k, 8 * sizeof(float));
    }
}

/* pi_ib_halves_t with the type a constant (its loads, sums and flush have no type test left) */
static void pi_ib_halves(int t, const uint8_t *w, size_t stride, long n_out, long nb,
                         const int32_t *off, const int32_t *cf, const int32_t *ng, const float *sb,
                         const int32_t *corr, long v0, long v1, float *out, int stream) {
    if (t == PI_Q8_0_IB)
        pi_ib_halves_t(PI_Q8_0_IB, w, stride, n_out, nb, off, cf, ng, sb, corr, v0, v1, out, stream);
    else if (t == PI_Q4_0_IB)
        pi_ib_halves_t(PI_Q4_0_IB, w, stride, n_out, nb, off, cf, ng, sb, corr, v0, v1, out, stream);
    else if (t == PI_Q4_1_IB)
        pi_ib_halves_t(PI_Q4_1_IB, w, stride, n_out, nb, off, cf, ng, sb, corr, v0, v1, out, stream);
    else if (t == PI_Q5_0_IB)
        pi_ib_halves_t(PI_Q5_0_IB, w, stride, n_out, nb, off, cf, ng, sb, corr, v0, v1, out, stream);
    else
        pi_ib_halves_t(PI_Q5_1_IB, w, stride, n_out, nb, off, cf, ng, sb, corr, v0, v1, out, stream);
}


/* The outputs of half tiles v0 .. v1 - 1 as runs of contiguous floats: out[.] = 0 (add NULL) or
 * add[.] += out[.] */
static void pi_ib_halves_span(long v0, long v1, float *out, float *add) {
    long v = v0;
    while (v < v1) {
        if ((v & 1) || v + 1 >= v1) {  /* a lone half: four runs of 8 */
            for (int k = 0; k < 4; k++) {
                const long a = PI_IB_TILE * (v / 2) + 16 * k + 8 * (v & 1);
                if (add) pi_add_f32(add + a, out + a, 8); else memset(out + a, 0, 8 * sizeof(float));
            }
            v++;
        } else {  /* whole tiles */
            const long e = v + ((v1 - v) & ~1L);
            const long a = PI_IB_TILE * (v / 2), n = PI_IB_TILE * ((e - v) / 2);
            if (add) pi_add_f32(add + a, out + a, (int)n); else memset(out + a, 0, (size_t)n * sizeof(float));
            v = e;
        }
    }
}

#ifndef PI_IB_PF_START
#define PI_IB_PF_START 1
#endif
#ifndef PI_IB_PF_EARLY
#define PI_IB_PF_EARLY 1
#endif
/* Thread t of T's half tiles v0 .. v1 - 1 of a matrix of cols outputs: pi_ib_rows_team's split,
 * which the decode's prefetches (pi_ib_pf_first) follow */
static inline void pi_ib_team_halves(int t, int T, int cols, long *v0, long *v1) {
    const long nv = cols / (PI_IB_TILE / 2);
    *v0 = t * nv / T;
    *v1 = (t + 1) * nv / T;
}

/* Prefetch (into L2) this thread's first tiles (those pi_ib_halves' own prefetch, PI_IB_PF_DIST
 * tiles ahead of the tile it sums, never reaches) of block b's rows: the rows of channels
 * idx[0 ..] while they fall in block b (idx NULL: all 32 rows), and their f16 scales (and
 * mins). Half tiles v0 .. v1 - 1 (pi_ib_team_halves).
 * always_inline: as simd.h's pi_prefetch_l2 (GCC deletes a call to a prefetch-only function). */
static inline __attribute__((always_inline)) void
pi_ib_pf_rows(int t, const uint8_t *w, size_t stride, const int32_t *idx, long n, long b,
              long v0, long v1) {
#if PI_SIMD
    const long lo = pi_ib_layout_outs(t, stride), ua = v0 / 2, ue = (v1 + 1) / 2;
    const long ub = ue - ua > PI_IB_PF_DIST ? ua + PI_IB_PF_DIST : ue;
    const size_t rb = pi_ib_row_bytes(t, lo), tb = pi_ib_tile_bytes(t);
    const uint8_t *blk = w + stride * (size_t)b;
    const uint8_t *val = blk + pi_ib_scale_bytes(t, lo);
    const size_t a0 = tb * (size_t)ua & ~(size_t)63, a1 = tb * (size_t)ub;
    for (long k = 0; k < n; k++) {
        const long r = idx ? idx[k] - 32 * b : k;
        if (r >= 32) break;
        const uint8_t *row = val + rb * (size_t)r;
        for (size_t a = a0; a < a1; a += 64) _mm_prefetch((const char *)(row + a), PI_IB_PF_HINT);
    }
    for (int m = 0; m <= pi_ib_has_min(t); m++) {  /* the scales (then the mins) of those tiles */
        const uint8_t *sc = blk + 2 * (size_t)lo * (size_t)m;
        const size_t s0 = 2 * PI_IB_TILE * (size_t)ua & ~(size_t)63, s1 = 2 * PI_IB_TILE * (size_t)ub;
        for (size_t a = s0; a < s1; a += 64) _mm_prefetch((const char *)(sc + a), PI_IB_PF_HINT);
    }
#else
    (void)t; (void)w; (void)stride; (void)idx; (void)n; (void)b; (void)v0; (void)v1;
#endif
}

/* Thread t of T's first tiles of block 0's 32 rows of an input-block matrix (qtype, w, stride,
 * cols outputs as pi_ib_rows_team takes them; any other type: nothing), whichever channels will
 * be kept: called by a decode a step before the projection (while it norms, selects or attends,
 * the memory is otherwise idle), so that its sums do not start on a cold block. */
static inline __attribute__((always_inline)) void
pi_ib_pf_first(int t, int T, int qtype, const uint8_t *w, size_t stride, int cols) {
    if (!PI_IB_PF_EARLY || !pi_is_ib(qtype)) return;
    long v0, v1;
    pi_ib_team_halves(t, T, cols, &v0, &v1);
    if (v1 > v0) pi_ib_pf_rows(qtype, w, stride, NULL, 32, 0, v0, v1);
}

/* Thread t of T's share of out = W xm (overwrites out), xm holding coef[k] at channel idx[k]
 * (idx ascending, n entries) and 0 elsewhere; then, if add is not NULL, add += out. w: the
 * input blocks, `stride` bytes each. Every thread quantizes every block itself into its own
 * stack arrays (43 ints per block; about a microsecond for SmolLM2's 48 blocks with the
 * AVX-512 pi_ib_prep), so the team needs no barrier: a barrier costs about as much on an idle
 * box and a scheduler time slice when another process holds a core (session 11). Each thread
 * then writes only its own half tiles of out and add (split by 32-output halves: SmolLM2's 576
 * outputs are 18 halves, 9/9 on two threads, where whole tiles split 5/4). */
static void pi_ib_rows_team(int t, int T, int qtype, const uint8_t *w, size_t stride,
                            const float *coef, const int32_t *idx, long n, float *out, int cols,
                            float *add) {
    const long nb = n > 0 ? idx[n - 1] / 32 + 1 : 0;
    long v0, v1;
    pi_ib_team_halves(t, T, cols, &v0, &v1);
    if (v1 <= v0) return;
    int32_t off[32 * nb + 1], cf[8 * nb + 1], ng[nb + 1], corr[nb + 1];
    float sb[nb + 1];
    /* the first kept block's first tiles, fetched while every block is quantized (step 1) */
    if (PI_IB_PF_START && n > 0) pi_ib_pf_rows(qtype, w, stride, idx, n, idx[0] / 32, v0, v1);
    /* 1. the kept channels of every block, quantized per block */
    for (long b = 0, k = 0; b < nb; b++) {
        long k1 = k;
        while (k1 < n && idx[k1] < 32 * (b + 1)) k1++;
        pi_ib_prep(qtype, pi_ib_layout_outs(qtype, stride), coef, idx, k, k1, b, off, cf, ng, sb,
                   corr);
        k = k1;
    }
    /* 2. this thread's half tiles over every block */
    pi_ib_halves_span(v0, v1, out, NULL);
    pi_ib_halves(qtype, w, stride, cols, nb, off, cf, ng, sb, corr, v0, v1, out, 1);
    if (add) pi_ib_halves_span(v0, v1, out, add);
}

/* Prefill (matmul_t over an input-block tensor): a GEMM over the dense masked input.
 *
 * A token's dropped channels are 0 in its input row, and a 0 coefficient changes no integer sum,
 * no block scale (the max of the kept |x|) and no correction (128 or 8 times sum(xq)). So per
 * block b, 64-output tile u and chunk of up to PI_IB_NT tokens, the kernel takes all 32 rows of
 * the block in 8 groups of four, loads and unpacks each group once, and adds each token's four
 * products with that token's broadcast coefficients (its xq of the group's four channels, 0 for
 * a dropped one): the integer sums acc - corr of decode (pi_ib_halves), grouped differently but
 * exact. Each token's flush is decode's: y += (s_b d) * float(acc - corr), one FMA per block,
 * in block order, skipped where the token kept nothing in the block (decode skips such blocks).
 * So every row of out has the bits of pi_ib_rows_team on that token's nonzero inputs.
 * Groups whose coefficients are 0 for every token of the chunk are skipped. */

/* tokens per chunk: 6 x 4 zmm int32 accumulators (VNNI-512), 3 x 4 ymm per half (AVX2: 2 measured
 * 3-5% slower, 4 within 2%, on 3072 x 576 and 576 x 576 q8_0/q4_0 at 128 tokens) */
#if PI_SIMD && PI_IB_VNNI512
#define PI_IB_NT 6
#elif PI_SIMD
#define PI_IB_NT 3
#else
#define PI_IB_NT 4
#endif

/* One token's block of 32 inputs x (the dropped ones 0), quantized as pi_ib_prep quantizes its
 * nonzero entries (pi_quantize_q8_block: a 0 raises no max and quantizes to 0) at their
 * channel positions: cf8 the 8 packed words (channel 4g + r in byte r of word g). Returns 1
 * where some x is not 0 (a NaN counts as kept, as in the test x != 0). */
static inline int pi_ib_prep_dense(int t, const float *x, int32_t *cf8, float *sb, int32_t *corr) {
    int8_t q[32];
    *corr = pi_ib_corr_unit(t) * pi_quantize_q8_block(x, q, sb);
    memcpy(cf8, q, sizeof(q));
    int any = 0;
    for (int j = 0; j < 32; j++) any |= x[j] != 0.0f;
    return any;
}

#if PI_SIMD
#if PI_IB_VNNI512
/* group g's four dpbusd operands of tile u (the four-row lanes of pi_ib_halves), from the rows
 * p, p + rb, p + 2 rb, p + 3 rb */
static inline __attribute__((always_inline)) void pi_ib_ops512(const int t, const uint8_t *p,
                                                               size_t rb, long u, __m512i v[4]) {
    const __m512i r0 = pi_ib_load512(t, p, u), r1 = pi_ib_load512(t, p + rb, u);
    const __m512i r2 = pi_ib_load512(t, p + 2 * rb, u), r3 = pi_ib_load512(t, p + 3 * rb, u);
    const __m512i l01 = _mm512_unpacklo_epi8(r0, r1), h01 = _mm512_unpackhi_epi8(r0, r1);
    const __m512i l23 = _mm512_unpacklo_epi8(r2, r3), h23 = _mm512_unpackhi_epi8(r2, r3);
    v[0] = _mm512_unpacklo_epi16(l01, l23);
    v[1] = _mm512_unpackhi_epi16(l01, l23);
    v[2] = _mm512_unpacklo_epi16(h01, h23);
    v[3] = _mm512_unpackhi_epi16(h01, h23);
}
#endif
/* the same for half h of the tile (256-bit operands) */
static inline __attribute__((always_inline)) void pi_ib_ops256(const int t, const uint8_t *p,
                                                               size_t rb, long u, int h,
                                                               __m256i v[4]) {
    const __m256i r0 = pi_ib_load256(t, p, u, h), r1 = pi_ib_load256(t, p + rb, u, h);
    const __m256i r2 = pi_ib_load256(t, p + 2 * rb, u, h), r3 = pi_ib_load256(t, p + 3 * rb, u, h);
    const __m256i l01 = _mm256_unpacklo_epi8(r0, r1), h01 = _mm256_unpackhi_epi8(r0, r1);
    const __m256i l23 = _mm256_unpacklo_epi8(r2, r3), h23 = _mm256_unpackhi_epi8(r2, r3);
    v[0] = _mm256_unpacklo_epi16(l01, l23);
    v[1] = _mm256_unpackhi_epi16(l01, l23);
    v[2] = _mm256_unpacklo_epi16(h01, h23);
    v[3] = _mm256_unpackhi_epi16(h01, h23);
}

/* Tile u of a block's 32 rows (values val), unpacked once: group g's four dpbusd operands (the
 * four-row lanes of pi_ib_halves) at pk + 256 g + 64 k, 2 KiB in all, 64-byte aligned. The
 * unpacks work inside 128-bit lanes, so the AVX2 path's operands for half h of the tile are
 * bytes 32 h .. 32 h + 31 of the same 64. */
static inline void pi_ib_unpack(const int t, const uint8_t *val, size_t rb, long u, uint8_t *pk) {
    for (int g = 0; g < 8; g++) {
        const uint8_t *p = val + (size_t)(4 * g) * rb;
#if PI_IB_VNNI512
        __m512i v[4];
        pi_ib_ops512(t, p, rb, u, v);
        for (int k = 0; k < 4; k++) _mm512_store_si512((__m512i *)(pk + 256 * g + 64 * k), v[k]);
#else
        for (int h = 0; h < 2; h++) {
            __m256i v[4];
            pi_ib_ops256(t, p, rb, u, h, v);
            for (int k = 0; k < 4; k++)
                _mm256_store_si256((__m256i *)(pk + 256 * g + 64 * k + 32 * h), v[k]);
        }
#endif
    }
}
#endif /* PI_SIMD */

/* Chunk of NT tokens, block (scales dsc; q4_1's mins msc, flushed as pi_ib_flush256), tile u: y + ldo i (token i's row of out, at tile u)
 * += the block's products, the operands unpacked here from the values val (rows rb bytes apart;
 * packed 0) or read from pi_ib_unpack's pk (packed 1: same integers, same flush). cf: token
 * i's 8 words at cf + 8 i; sb, corr: token i's at [i]; nz[i]: not 0 where token i kept
 * something in the block (else no flush, as decode skips the block); gm: bit g set where group
 * g has a nonzero coefficient for some token. */
static inline __attribute__((always_inline)) void
pi_ib_chunk_src(const int t, const int NT, const int packed, const uint8_t *val, size_t rb,
                const uint8_t *pk, const uint16_t *dsc, const uint16_t *msc, long u,
                const int32_t *cf, const float *sb, const int32_t *corr, const int32_t *nz,
                unsigned gm, float *y, long ldo) {
#if PI_SIMD && PI_IB_VNNI512
    __m512i acc[PI_IB_NT][4];
#pragma GCC unroll 8
    for (int i = 0; i < NT; i++)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) acc[i][k] = _mm512_set1_epi32(pi_ib_has_min(t) ? 0 : -corr[i]);
    for (int g = 0; g < 8; g++) {
        if (!((gm >> g) & 1)) continue;
        __m512i v[4];
        if (packed) {
            const __m512i *o = (const __m512i *)(pk + 256 * g);
            v[0] = _mm512_load_si512(o);
            v[1] = _mm512_load_si512(o + 1);
            v[2] = _mm512_load_si512(o + 2);
            v[3] = _mm512_load_si512(o + 3);
        } else
            pi_ib_ops512(t, val + (size_t)(4 * g) * rb, rb, u, v);
#pragma GCC unroll 8
        for (int i = 0; i < NT; i++) {
            const __m512i cc = _mm512_set1_epi32(cf[8 * i + g]);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], v[0], cc);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], v[1], cc);
            acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], v[2], cc);
            acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], v[3], cc);
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512 d = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(dsc + PI_IB_TILE * u + 16 * k)));
        const __m512 m = pi_ib_has_min(t) ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                               (const __m256i *)(msc + PI_IB_TILE * u + 16 * k)))
                                         : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < NT; i++) {
            if (!nz[i]) continue;
            float *yk = y + ldo * i + 16 * k;
            const __m512 f = _mm512_cvtepi32_ps(acc[i][k]);  /* acc - corr */
            __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(sb[i]), d), f, _mm512_loadu_ps(yk));
            if (pi_ib_has_min(t))
                r = _mm512_fmadd_ps(_mm512_mul_ps(m, _mm512_set1_ps(0.125f)),
                                    _mm512_set1_ps(8.0f * sb[i] * (float)corr[i]), r);
            _mm512_storeu_ps(yk, r);
        }
    }
#elif PI_SIMD
    for (int h = 0; h < 2; h++) {
        __m256i acc[PI_IB_NT][4];
#pragma GCC unroll 8
        for (int i = 0; i < NT; i++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)  /* q8_0 through pi_ib_dot4 is signed: no correction; */
                acc[i][k] = _mm256_set1_epi32(  /* the 4-bit types' int16 sums start at 0 */
                    (!PI_VNNI256 && (t == PI_Q8_0_IB || pi_ib_is_q4(t))) || pi_ib_has_min(t)
                        ? 0 : -corr[i]);
        for (int g = 0; g < 8; g++) {
            if (!((gm >> g) & 1)) continue;
            __m256i v[4];
            if (packed) {
                const uint8_t *o = pk + 256 * g + 32 * h;
                v[0] = _mm256_load_si256((const __m256i *)o);
                v[1] = _mm256_load_si256((const __m256i *)(o + 64));
                v[2] = _mm256_load_si256((const __m256i *)(o + 128));
                v[3] = _mm256_load_si256((const __m256i *)(o + 192));
            } else
                pi_ib_ops256(t, val + (size_t)(4 * g) * rb, rb, u, h, v);
#pragma GCC unroll 8
            for (int i = 0; i < NT; i++) {
                const __m256i cc = _mm256_set1_epi32(cf[8 * i + g]);
#if PI_VNNI256
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) acc[i][k] = pi_dpbusd256(acc[i][k], v[k], cc);
#else
                if (pi_ib_is_q4(t)) {  /* int16 over the block, as pi_ib_half */
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++)
                        acc[i][k] = _mm256_add_epi16(acc[i][k], _mm256_maddubs_epi16(v[k], cc));
                } else {
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++)
                        acc[i][k] = _mm256_add_epi32(acc[i][k], pi_ib_dot4(t, v[k], cc));
                }
#endif
            }
        }
        if (!PI_VNNI256 && pi_ib_is_q4(t))  /* widened, then the correction */
#pragma GCC unroll 8
            for (int i = 0; i < NT; i++)
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    acc[i][k] = _mm256_add_epi32(_mm256_madd_epi16(acc[i][k], _mm256_set1_epi16(1)),
                                                 _mm256_set1_epi32(pi_ib_has_min(t) ? 0 : -corr[i]));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256 d = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(dsc + PI_IB_TILE * u + 16 * k + 8 * h)));
            const __m256 m = pi_ib_has_min(t)
                                 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                       (const __m128i *)(msc + PI_IB_TILE * u + 16 * k + 8 * h)))
                                 : _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int i = 0; i < NT; i++) {
                if (!nz[i]) continue;
                float *yk = y + ldo * i + 16 * k + 8 * h;
                const __m256 f = _mm256_cvtepi32_ps(acc[i][k]);  /* acc - corr */
                __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(sb[i]), d), f,
                                           _mm256_loadu_ps(yk));
                if (pi_ib_has_min(t))
                    r = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_set1_ps(0.125f)),
                                        _mm256_set1_ps(8.0f * sb[i] * (float)corr[i]), r);
                _mm256_storeu_ps(yk, r);
            }
        }
    }
#else
    (void)packed;
    (void)pk;
    (void)gm;
    for (int o = 0; o < PI_IB_TILE; o++) {
        const int p = pi_ib_pos(o);
        int w32[32];
        for (int j = 0; j < 32; j++) w32[j] = pi_ib_val(t, val + (size_t)j * rb, u, p);
        const float d = pi_f16_to_f32(dsc[PI_IB_TILE * u + o]);
        for (int i = 0; i < NT; i++) {
            if (!nz[i]) continue;
            int8_t q[32];
            memcpy(q, cf + 8 * i, sizeof(q));
            int32_t a = 0;
            for (int j = 0; j < 32; j++) a += q[j] * w32[j];
            float *yo = y + ldo * i + o;
            if (pi_ib_has_min(t))
                *yo = fmaf(0.125f * pi_f16_to_f32(msc[PI_IB_TILE * u + o]),
                           8.0f * sb[i] * (float)corr[i], fmaf(sb[i] * d, (float)a, *yo));
            else
                *yo = fmaf(sb[i] * d, (float)(a - corr[i]), *yo);
        }
    }
#endif
}

/* the chunk from the values (pi_ib_chunk_src, packed 0) */
static inline __attribute__((always_inline)) void
pi_ib_chunk(const int t, const int NT, const uint8_t *val, size_t rb, const uint16_t *dsc,
            const uint16_t *msc, long u, const int32_t *cf, const float *sb, const int32_t *corr,
            const int32_t *nz, unsigned gm, float *y, long ldo) {
    pi_ib_chunk_src(t, NT, 0, val, rb, NULL, dsc, msc, u, cf, sb, corr, nz, gm, y, ldo);
}

#if PI_SIMD
/* the chunk over a block unpacked by pi_ib_unpack (pi_ib_chunk_src, packed 1) */
static inline __attribute__((always_inline)) void
pi_ib_chunk_pk(const int t, const int NT, const uint8_t *pk, const uint16_t *dsc,
               const uint16_t *msc, long u, const int32_t *cf, const float *sb,
               const int32_t *corr, const int32_t *nz, unsigned gm, float *y, long ldo) {
    pi_ib_chunk_src(t, NT, 1, NULL, 0, pk, dsc, msc, u, cf, sb, corr, nz, gm, y, ldo);
}
#endif /* PI_SIMD */

/* A switch over the type (q8_0 / q4_0 / q4_1 / q5_0 / q5_1) and the chunk's token count nt
 * (1 .. PI_IB_NT) that
 * calls CALL(T_, N_) with both as constants (the chunk kernels unroll over them). */
#define PI_IB_CASE(CALL, T_, N_)                                                              \
    case N_:                                                                                  \
        if (N_ <= PI_IB_NT) CALL(T_, (N_ <= PI_IB_NT ? N_ : 1));                              \
        break;
#define PI_IB_NTS(CALL, T_, nt)                                                               \
    switch (nt) {                                                                             \
        PI_IB_CASE(CALL, T_, 1) PI_IB_CASE(CALL, T_, 2) PI_IB_CASE(CALL, T_, 3)               \
        PI_IB_CASE(CALL, T_, 4) PI_IB_CASE(CALL, T_, 5) PI_IB_CASE(CALL, T_, 6)               \
    }
#define PI_IB_SWITCH(t, nt, CALL)                                                             \
    do {                                                                                      \
        if ((t) == PI_Q8_0_IB) {                                                              \
            PI_IB_NTS(CALL, PI_Q8_0_IB, nt)                                                   \
        } else if ((t) == PI_Q4_0_IB) {                                                       \
            PI_IB_NTS(CALL, PI_Q4_0_IB, nt)                                                   \
        } else if ((t) == PI_Q4_1_IB) {                                                       \
            PI_IB_NTS(CALL, PI_Q4_1_IB, nt)                                                   \
        } else if ((t) == PI_Q5_0_IB) {                                                       \
            PI_IB_NTS(CALL, PI_Q5_0_IB, nt)                                                   \
        } else {                                                                              \
            PI_IB_NTS(CALL, PI_Q5_1_IB, nt)                                                   \
        }                                                                                     \
    } while (0)

#if PI_SIMD
/* pi_ib_chunk_pk with the type and the token count as constants */
static void pi_ib_chunk_pk_any(int t, int nt, const uint8_t *pk, const uint16_t *dsc,
                               const uint16_t *msc, long u, const int32_t *cf, const float *sb,
                               const int32_t *corr, const int32_t *nz, unsigned gm, float *y,
                               long ldo) {
#define PI_IB_PK(T_, N_) pi_ib_chunk_pk(T_, N_, pk, dsc, msc, u, cf, sb, corr, nz, gm, y, ldo)
    PI_IB_SWITCH(t, nt, PI_IB_PK);
#undef PI_IB_PK
}
#endif /* PI_SIMD */

/* pi_ib_chunk with the type and the token count as constants */
static void pi_ib_chunk_any(int t, int nt, const uint8_t *val, size_t rb, const uint16_t *dsc,
                            const uint16_t *msc, long u, const int32_t *cf, const float *sb,
                            const int32_t *corr, const int32_t *nz, unsigned gm, float *y,
                            long ldo) {
#define PI_IB_VAL(T_, N_) pi_ib_chunk(T_, N_, val, rb, dsc, msc, u, cf, sb, corr, nz, gm, y, ldo)
    PI_IB_SWITCH(t, nt, PI_IB_VAL);
#undef PI_IB_VAL
}

/* One token's out = W a (a: n_in f32, the dropped channels 0) by the decode kernel over its
 * nonzero inputs (their rows only: at one token the GEMM's dense rows cost more than the
 * shared loads save), on n_threads threads. */
static void pi_ib_matmul_one(int qtype, const uint8_t *w, size_t stride, long n_in,
                             const float *a, float *out, int cols, int n_threads) {
    const long nv = cols / (PI_IB_TILE / 2);  /* half tiles, as pi_ib_rows_team splits them */
    int32_t *idx = (int32_t *)malloc((size_t)(n_in > 0 ? n_in : 1) * sizeof(int32_t));
    float *coef = (float *)malloc((size_t)(n_in > 0 ? n_in : 1) * sizeof(float));
    if (!idx || !coef) {
        free(idx);
        free(coef);
        return;
    }
    long n = 0;
    for (long j = 0; j < n_in; j++)
        if (a[j] != 0.0f) {
            coef[n] = a[j];
            idx[n++] = (int32_t)j;
        }
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > nv) nt = nv > 0 ? (int)nv : 1;
    if (n == 0) {
        memset(out, 0, (size_t)cols * sizeof(float));
    } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        pi_ib_rows_team(pi_team_thread(), pi_team_size(), qtype, w, stride, coef, idx, n, out,
                        cols, NULL);
    }
    free(idx);
    free(coef);
}

/* Prefill: out[k] (row k of out, ldo apart) = W a[k] for n_tok tokens, a (n_tok, lda) f32 with
 * the dropped channels already 0 (kept: the nonzero ones, as decode's kept list gives them
 * after its selection; a kept 0 changes neither the block scale nor the sums), on n_threads
 * threads. Each token's result has the bits of pi_ib_rows_team on that token. One token goes
 * through pi_ib_rows_team itself (pi_ib_matmul_one). Otherwise threads split the tiles as
 * decode does; each thread runs its tiles, chunk of tokens by chunk, over every block in order
 * (with more than one chunk, from a 2 KiB per block copy of the tile unpacked once, which stays
 * in L1/L2 across chunks). The per-token coefficients take 44 bytes per token and block. */
static void pi_ib_matmul(int qtype, const uint8_t *w, size_t stride, long n_in, const float *a,
                         long lda, long n_tok, float *out, long ldo, int cols, int n_threads) {
    if (n_tok == 1) {
        pi_ib_matmul_one(qtype, w, stride, n_in, a, out, cols, n_threads);
        return;
    }
    const long nb = (n_in + 31) / 32, nu = cols / PI_IB_TILE;
    const size_t nbt = (size_t)nb * (size_t)n_tok;  /* (block, token) pairs, block-major */
    int32_t *cfw = (int32_t *)malloc(nbt * 11 * sizeof(int32_t));
    if (!cfw) return;
    float *sbt = (float *)(cfw + 8 * nbt);
    int32_t *crt = (int32_t *)(sbt + nbt), *nzt = crt + nbt;
    const long lo = pi_ib_layout_outs(qtype, stride);  /* the layout's outputs (addresses) */
    const size_t rb = pi_ib_row_bytes(qtype, lo);
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > nu) nt = nu > 0 ? (int)nu : 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        const int t = pi_team_thread(), T = pi_team_size();
        /* 1. per token and block: the coefficients (tokens split over threads) */
        for (long k = t; k < n_tok; k += T)
            for (long b = 0; b < nb; b++) {
                const size_t e = (size_t)b * n_tok + k;
                const int kept = pi_ib_prep_dense(qtype, a + lda * k + 32 * b, cfw + 8 * e,
                                                  sbt + e, crt + e);
                /* bit 8: kept something; bit g: group g has a nonzero coefficient */
                int32_t f = kept << 8;
                for (int g = 0; g < 8; g++) f |= (cfw[8 * e + g] != 0) << g;
                nzt[e] = f;
            }
        PI_BARRIER();
        /* 2. this thread's tiles: chunks of tokens, every block in order */
        const long u0 = t * nu / T, u1 = (t + 1) * nu / T;
        /* a chunk's sums go to yb (contiguous: rows of out ldo floats apart would alias in L1
         * and in the store-to-load check), then to out */
        float yb[PI_IB_NT * PI_IB_TILE] __attribute__((aligned(64)));
#if PI_SIMD
        /* more than one chunk: each tile's blocks unpacked once into pk, then read by every
         * chunk (contiguous: no cache-set aliasing of rows n_out bytes apart) */
        uint8_t *pk = n_tok > PI_IB_NT && u1 > u0
                          ? (uint8_t *)aligned_alloc(64, 2048 * (size_t)nb) : NULL;
#endif
        const size_t sbytes = pi_ib_scale_bytes(qtype, lo);  /* the values' offset in a block */
        for (long u = u0; u < u1; u++) {
#if PI_SIMD
            if (pk)
                for (long b = 0; b < nb; b++) {
                    const uint8_t *blk = w + stride * (size_t)b;
                    pi_ib_unpack(qtype, blk + sbytes, rb, u, pk + 2048 * (size_t)b);
                    /* the next tile's rows and scales of this block, into L2 by its turn */
                    if (u + 1 < u1) {
                        const uint8_t *nx = blk + sbytes + pi_ib_tile_bytes(qtype) * (u + 1);
                        const char *ds = (const char *)(blk + 2 * PI_IB_TILE * (u + 1));
                        for (int j = 0; j < 32; j++) {
                            _mm_prefetch((const char *)(nx + (size_t)j * rb), _MM_HINT_T1);
                            if (pi_ib_is_q5(qtype))  /* a 40-byte tile's end */
                                _mm_prefetch((const char *)(nx + (size_t)j * rb + 39), _MM_HINT_T1);
                        }
                        _mm_prefetch(ds, _MM_HINT_T1);
                        _mm_prefetch(ds + 64, _MM_HINT_T1);
                        if (pi_ib_has_min(qtype)) {  /* and its mins */
                            _mm_prefetch(ds + 2 * (size_t)lo, _MM_HINT_T1);
                            _mm_prefetch(ds + 2 * (size_t)lo + 64, _MM_HINT_T1);
                        }
                    }
                }
#endif
            for (long k0 = 0; k0 < n_tok; k0 += PI_IB_NT) {
                const int n = n_tok - k0 < PI_IB_NT ? (int)(n_tok - k0) : PI_IB_NT;
                memset(yb, 0, sizeof(yb));
                for (long b = 0; b < nb; b++) {
                    const size_t e = (size_t)b * n_tok + k0;
                    int32_t any = 0;
                    for (int i = 0; i < n; i++) any |= nzt[e + i];
                    if (!any) continue;
                    const unsigned gm = (unsigned)any & 255;
                    const uint8_t *blk = w + stride * (size_t)b;
#if PI_SIMD
                    if (pk) {
                        pi_ib_chunk_pk_any(qtype, n, pk + 2048 * (size_t)b,
                                           (const uint16_t *)blk, (const uint16_t *)blk + lo, u,
                                           cfw + 8 * e, sbt + e, crt + e, nzt + e, gm, yb,
                                           PI_IB_TILE);
                        continue;
                    }
#endif
                    pi_ib_chunk_any(qtype, n, blk + sbytes, rb, (const uint16_t *)blk,
                                    (const uint16_t *)blk + lo, u, cfw + 8 * e, sbt + e, crt + e,
                                    nzt + e, gm, yb, PI_IB_TILE);
                }
                for (int i = 0; i < n; i++)
                    memcpy(out + ldo * (k0 + i) + PI_IB_TILE * u, yb + PI_IB_TILE * i,
                           PI_IB_TILE * sizeof(float));
            }
        }
#if PI_SIMD
        free(pk);
#endif
    }
    free(cfw);
}

#endif /* PYINFER_IBSUM_H */
