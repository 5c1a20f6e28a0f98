/* The quant kernels' division-free quotient (fp8/kernels.py `_quotient`) against IEEE division, in C's exact fmaf.
 *
 *   gcc -O2 -ffp-contract=off -o /tmp/quotient_check bench/quotient_check.c -lm && /tmp/quotient_check 1000000000
 *
 * q0 = x*r, e = fma(q0, s, -x), q = fma(-e, r, q0) with r = 1/s correctly rounded, over the kernels' domain: scales
 * s = max(amax, eps)/448 from 2^-76 (amax_eps >= 1e-20) to 2^117, values |x| <= 448.1 s down to subnormals and signed
 * zeros. Counts FP32 quotient mismatches (expected only for |x| near FLT_MIN, where the residual underflows) and E4M3
 * code mismatches (must be 0). Exit status 1 on any code mismatch or a mismatch at a normal x of magnitude >= 2^-100.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t u_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint64_t state = 88172645463325252ull;
static uint64_t rnd(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }

/* E4M3 round-to-nearest-even of clamp(y, +-448), as a signed rank (the code's order), NaN apart */
static int e4m3_rank(float y) {
    if (isnan(y)) return 100000;
    float a = fabsf(y) > 448.0f ? 448.0f : fabsf(y);
    int code;
    if (a < 0x1p-6f) {
        code = (int)nearbyintf(a / 0x1p-9f);           /* subnormals: steps of 2^-9 */
    } else {
        int e;
        frexpf(a, &e);                                  /* a in [2^(e-1), 2^e): 3 mantissa bits -> step 2^(e-4) */
        float step = ldexpf(1.0f, e - 4);
        code = (int)(nearbyintf(a / step) * step / 0x1p-9f);
    }
    return signbit(y) ? -code - 1 : code;
}

static long n, bad32, bad32_big, bad8;
static void check(float x, float s) {
    volatile float one = 1.0f;
    float r = one / s;
    float q0 = x * r;
    float e = fmaf(q0, s, -x);
    float q = fmaf(-e, r, q0);
    float want = x / s;
    n++;
    if (u_of(q) == u_of(want)) return;
    bad32++;
    if (fabsf(x) >= 0x1p-100f && bad32_big++ < 5) printf("FP32 mismatch x=%a s=%a: %a, IEEE %a\n", x, s, q, want);
    if (e4m3_rank(q) != e4m3_rank(want) && bad8++ < 5) printf("CODE mismatch x=%a s=%a: %a, IEEE %a\n", x, s, q, want);
}

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 100000000;
    for (long i = 0; i < pairs; i++) {              /* random pairs over the domain */
        uint32_t es = 127 - 76 + (uint32_t)(rnd() % (254 - 9 - 51));
        float s = f_of((es << 23) | (uint32_t)(rnd() & 0x7FFFFF));
        int ex = (int)es + 9 - (int)(rnd() % 200);
        uint32_t sign = (uint32_t)(rnd() & 1) << 31;
        float x = ex <= 0 ? f_of(sign | (uint32_t)(rnd() & 0x7FFFFF))
                          : f_of(sign | ((uint32_t)ex << 23) | (uint32_t)(rnd() & 0x7FFFFF));
        if (fabsf(x) <= 448.1f * s) check(x, s);
    }
    uint32_t hard[] = {0, 0x7FFFFF, 0x400001, 0x123457};  /* every mantissa of x, both signs, x/s in [2^-12, 2^9) */
    for (int j = 0; j < 4; j++)
        for (int off = -12; off <= 8; off += 4)
            for (uint32_t m = 0; m < (1u << 23); m++) {
                float s = f_of((120u << 23) | hard[j]);
                float x = f_of(((uint32_t)(120 + off) << 23) | m);
                if (fabsf(x) <= 448.1f * s) { check(x, s); check(-x, s); }
            }
    check(0.0f, 1.0f); check(-0.0f, 1.0f); check(-0.0f, 3e-13f); check(f_of(1), 3e-13f); check(-f_of(1), 3e-13f);
    printf("checked %ld pairs: FP32 quotient mismatches %ld (|x| >= 2^-100: %ld), E4M3 code mismatches %ld\n",
           n, bad32, bad32_big, bad8);
    return bad8 != 0 || bad32_big != 0;
}
