/* Every float x with |x| <= 100: rowsum_team.h's pi_expf_safe (scalar), pi_expf_safe4 and
 * pi_expf_safe8 (where built) against the libm's expf, bit for bit (issue 12, session 12).
 *
 *     cc -O2 -mavx2 -mfma -mf16c [-mavx512f] -Icython -o /tmp/chk tools/check_expf_safe.c -lm
 *     /tmp/chk        # about 45 s; exit status 1 on any difference
 */
#include "simd.h"
#include "rowsum_team.h"
#include <stdio.h>

int main(void) {
    unsigned long long n = 0, bad_s = 0, bad_v = 0, fall = 0;
    for (uint64_t b = 0; b < (1ull << 32); b += 4) {
        float xs[4], ev[4];
        for (int l = 0; l < 4; l++) {
            const uint32_t u = (uint32_t)(b + l);
            memcpy(&xs[l], &u, 4);
        }
        int bad = 15;
#if PI_SIMD
        _mm_storeu_ps(ev, pi_expf_safe4(_mm_loadu_ps(xs), &bad));
#if defined(__AVX512F__)
        float x8[8], e8[8];
        int bad8;
        memcpy(x8, xs, 16);
        memcpy(x8 + 4, xs, 16);
        _mm256_storeu_ps(e8, pi_expf_safe8(_mm256_loadu_ps(x8), &bad8));
        for (int l = 0; l < 4; l++)
            if (((bad8 >> l) & 1) != ((bad >> l) & 1) || ((bad8 >> (l + 4)) & 1) != ((bad >> l) & 1)
                || (!((bad >> l) & 1) && (memcmp(&e8[l], &ev[l], 4) || memcmp(&e8[l + 4], &ev[l], 4))))
                bad_v++;
#endif
#endif
        for (int l = 0; l < 4; l++) {
            const float x = xs[l];
            if (!(fabsf(x) <= 100.0f)) continue;
            const float ref = expf(x), sc = pi_expf_safe(x);
            const float v = ((bad >> l) & 1) ? expf(x) : ev[l];
            n++;
            fall += (bad >> l) & 1;
            if (memcmp(&ref, &sc, 4)) bad_s++;
            if (memcmp(&ref, &v, 4)) bad_v++;
        }
    }
    printf("%llu floats with |x| <= 100: scalar differs %llu, vector differs %llu, "
           "expf fallbacks %llu (%.3f%%)\n", n, bad_s, bad_v, fall, 100.0 * fall / n);
    return bad_s || bad_v;
}
