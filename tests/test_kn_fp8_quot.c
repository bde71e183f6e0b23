/* tests/test_kn_fp8_quot.c — kn_fp8_quot (the CUDA quantizers' quotient without a division per
 * value) against the IEEE quotient the cpu reference divides out, over every case the 1 × 128
 * input quantization meets: every finite bf16 amax, its scale s = max(amax, 1e-10)·(1/448) as
 * the quantizers round it, and every bf16 v with |v| ≤ amax (both signs on every 7th amax; the
 * rounding is symmetric). The e4m3 bytes must be equal for all 5.3e8 pairs. Also counted: the
 * pairs whose fp32 quotients differ (expected only where |v / s| < 2^-71) and the bytes the
 * plain product v·r gets wrong, which must be some, or this test could not tell the forms apart. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cm_dtype.h"
#include "kn_backend.h"
#include "kn_fp8_quot.h"
#include "tst.h"

static float bf16_value(uint32_t code) {
    return cm_bf16_to_f32((uint16_t)code);
}

static uint8_t byte_of(float q) {
    return cm_f32_to_f8e4m3(fminf(fmaxf(q, -KN_FP8_MAX), KN_FP8_MAX));
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

int main(void) {
    long long         pairs = 0, bytes_differ = 0, f32_differ = 0, plain_wrong = 0;
    float             worst = 0; /* largest |v / s| whose fp32 quotients differ */
    const volatile float inv = 1.0f / KN_FP8_MAX; /* the constant as the quantizers round it */
    for (uint32_t a = 0; a < 0x7f80; a++) { /* every finite amax ≥ 0 */
        const float amax = bf16_value(a);
        const float s = (amax > 1e-10f ? amax : 1e-10f) * inv, r = 1.0f / s;
        for (int sign = 0; sign < (a % 7 == 0 ? 2 : 1); sign++)
            for (uint32_t h = 0; h <= a; h++) {
                const float v = bf16_value(h | (sign ? 0x8000u : 0)), ref = v / s, q = kn_fp8_quot(v, s, r);
                const float p = v * r;
                pairs++;
                if (bits(q) != bits(ref)) { /* equal quotients have equal bytes */
                    f32_differ++;
                    worst = fabsf(ref) > worst ? fabsf(ref) : worst;
                    if (byte_of(q) != byte_of(ref) && bytes_differ++ < 5)
                        fprintf(stderr, "amax %a v %a: quotient %a, IEEE %a\n", amax, v, q, ref);
                }
                plain_wrong += bits(p) != bits(ref) && byte_of(p) != byte_of(ref);
            }
    }
    printf("%lld pairs: e4m3 bytes differ %lld; fp32 quotients differ %lld (largest |v/s| among them %a); "
           "the plain product v*r gets %lld bytes wrong\n",
           pairs, bytes_differ, f32_differ, worst, plain_wrong);
    TST_CHECK(pairs > 500000000LL);
    TST_CHECK(bytes_differ == 0);
    TST_CHECK(worst < 0x1p-70f);
    TST_CHECK(plain_wrong > 0);
    return tst_report();
}
