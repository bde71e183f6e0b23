/* tests/test_cm_dtype.c — cm_dtype names and the bf16/f16/f8 conversions, against references
 * computed here independently of the bit tricks in cm_dtype.c: every code of each format is
 * decoded from its sign/exponent/mantissa fields in double and must re-encode to itself;
 * rounding is checked against a nearest-value search over the code table (ties to the even
 * code) at every midpoint, just either side of it, and at random points; plus NaN, infinity,
 * saturation, subnormals and cm_convert between all float dtype pairs. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cm_dtype.h"
#include "tst.h"

// ---- reference decoders: value of a code from its fields (NaN for NaN codes)

static double ref_bf16(unsigned c) {
    int      s = (c >> 15) & 1, e = (c >> 7) & 0xff;
    unsigned m = c & 0x7f;
    double   v;
    if (e == 0xff)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, -126 - 7);
    else
        v = ldexp(1.0 + m / 128.0, e - 127);
    return s ? -v : v;
}

static double ref_f16(unsigned c) {
    int      s = (c >> 15) & 1, e = (c >> 10) & 0x1f;
    unsigned m = c & 0x3ff;
    double   v;
    if (e == 0x1f)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, -24);
    else
        v = ldexp(1.0 + m / 1024.0, e - 15);
    return s ? -v : v;
}

static double ref_f8(unsigned c) { /* E4M3 "fn": no infinities, S.1111.111 is NaN, max 448 */
    int      s = (c >> 7) & 1, e = (c >> 3) & 0xf;
    unsigned m = c & 0x7;
    double   v;
    if (e == 0xf && m == 7)
        v = NAN;
    else if (e == 0)
        v = ldexp((double)m, -9);
    else
        v = ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

/* Nearest code to a ≥ 0 among the monotonic positive codes [0, top], ties to the even code;
 * requires a < value(top). */
static unsigned ref_nearest(double a, double (*val)(unsigned), unsigned top) {
    unsigned lo = 0, hi = top;
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (val(mid) <= a)
            lo = mid;
        else
            hi = mid;
    }
    double dl = a - val(lo), dh = val(hi) - a;
    if (dl < dh)
        return lo;
    if (dh < dl)
        return hi;
    return (lo & 1) ? hi : lo;
}

/* For rounding, infinity sits where the next exponent would start (RNE overflows past the
 * midpoint between the largest finite value and that power of two). */
static double bf16_ext(unsigned c) {
    return c == 0x7f80u ? ldexp(1.0, 128) : ref_bf16(c);
}
static double f16_ext(unsigned c) {
    return c == 0x7c00u ? 65536.0 : ref_f16(c);
}

static unsigned ref_to_bf16(float f) {
    unsigned sign = signbit(f) ? 0x8000u : 0;
    double   a = fabs((double)f);
    if (isinf(a))
        return sign | 0x7f80u;
    return sign | ref_nearest(a, bf16_ext, 0x7f80u);
}

static unsigned ref_to_f16(float f) {
    unsigned sign = signbit(f) ? 0x8000u : 0;
    double   a = fabs((double)f);
    if (a >= 65536.0)
        return sign | 0x7c00u;
    return sign | ref_nearest(a, f16_ext, 0x7c00u);
}

static unsigned ref_to_f8(float f) {
    unsigned sign = signbit(f) ? 0x80u : 0;
    double   a = fabs((double)f);
    if (a >= 448.0)
        return sign | 0x7eu; /* saturate */
    return sign | ref_nearest(a, ref_f8, 0x7eu);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int same_value(double got, double ref) { /* NaN matches NaN; zeros compare signs */
    if (isnan(ref))
        return isnan(got);
    return got == ref && signbit(got) == signbit(ref);
}

// ---- tests

static void test_names(void) {
    for (int i = 0; i < CM_DTYPE_COUNT; i++) {
        cm_dtype dt = CM_DTYPE_COUNT;
        TST_CHECK(cm_dtype_parse(cm_dtype_name((cm_dtype)i), &dt) == CM_OK && dt == (cm_dtype)i);
    }
    static const struct {
        cm_dtype dt;
        size_t   size;
        int      is_float;
    } want[] = {
        {CM_DTYPE_F32, 4, 1},     {CM_DTYPE_F64, 8, 1}, {CM_DTYPE_BF16, 2, 1}, {CM_DTYPE_F16, 2, 1},
        {CM_DTYPE_F8_E4M3, 1, 1}, {CM_DTYPE_I64, 8, 0}, {CM_DTYPE_I32, 4, 0},  {CM_DTYPE_I16, 2, 0},
        {CM_DTYPE_I8, 1, 0},      {CM_DTYPE_U8, 1, 0},  {CM_DTYPE_BOOL, 1, 0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        TST_CHECK(cm_dtype_size(want[i].dt) == want[i].size);
        TST_CHECK(cm_dtype_is_float(want[i].dt) == want[i].is_float);
    }
    TST_CHECK(strcmp(cm_dtype_name(CM_DTYPE_BF16), "BF16") == 0);
    TST_CHECK(strcmp(cm_dtype_name(CM_DTYPE_F8_E4M3), "F8_E4M3") == 0);
    cm_dtype dt;
    cm_clear_error();
    TST_CHECK(cm_dtype_parse("F8_E5M2", &dt) == CM_ERR_FORMAT);
    TST_CHECK(strstr(cm_last_error(), "unknown dtype 'F8_E5M2'") != NULL);
    TST_CHECK(cm_dtype_parse("bf16", &dt) == CM_ERR_FORMAT); /* names are case-sensitive */
}

static void test_bf16(void) {
    int bad_dec = 0, bad_enc = 0;
    for (unsigned c = 0; c < 0x10000u; c++) {
        float f = cm_bf16_to_f32((uint16_t)c);
        if (!same_value(f, ref_bf16(c)))
            bad_dec++;
        uint16_t back = cm_f32_to_bf16(f);
        if (isnan(ref_bf16(c)) ? !(isnan(cm_bf16_to_f32(back)) && (back & 0x8000u) == (c & 0x8000u))
                               : back != c)
            bad_enc++;
    }
    TST_CHECK(bad_dec == 0);
    TST_CHECK(bad_enc == 0);

    // every midpoint between neighbours (ties to even) and the floats on either side of it
    int bad_mid = 0;
    for (unsigned c = 0; c < 0x7f7fu; c++) {
        float    lo = cm_bf16_to_f32((uint16_t)c), hi = cm_bf16_to_f32((uint16_t)(c + 1));
        float    mid = (float)(((double)lo + (double)hi) / 2); /* 9 significant bits: exact */
        float    below = nextafterf(mid, 0.0f), above = nextafterf(mid, INFINITY);
        unsigned even = (c & 1) ? c + 1 : c;
        if (cm_f32_to_bf16(mid) != even || ref_to_bf16(mid) != even)
            bad_mid++;
        if (cm_f32_to_bf16(below) != c || cm_f32_to_bf16(above) != c + 1)
            bad_mid++;
        if (cm_f32_to_bf16(-mid) != (even | 0x8000u))
            bad_mid++;
    }
    TST_CHECK(bad_mid == 0);

    // random finite floats against the reference
    int bad_rand = 0;
    for (int i = 0; i < 200000; i++) {
        float f = f32_of(rng_u32());
        if (isnan(f))
            continue;
        if (cm_f32_to_bf16(f) != ref_to_bf16(f))
            bad_rand++;
    }
    TST_CHECK(bad_rand == 0);

    // specials: overflow to inf, NaN stays NaN (quiet), signed zero, subnormal input
    TST_CHECK(cm_f32_to_bf16(FLT_MAX) == 0x7f80u); /* above the last bf16 midpoint */
    TST_CHECK(cm_f32_to_bf16(INFINITY) == 0x7f80u && cm_f32_to_bf16(-INFINITY) == 0xff80u);
    TST_CHECK(isnan(cm_bf16_to_f32(cm_f32_to_bf16(NAN))));
    TST_CHECK(isnan(cm_bf16_to_f32(cm_f32_to_bf16(f32_of(0x7f800001u))))); /* sNaN with low payload only */
    TST_CHECK(cm_f32_to_bf16(-0.0f) == 0x8000u);
    TST_CHECK(cm_f32_to_bf16(f32_of(0x00000001u)) == 0x0000u);         /* tiniest f32 subnormal rounds to 0 */
    TST_CHECK(cm_f32_to_bf16(f32_of(0x00018000u)) == 0x0002u);         /* 1.5 × 2^-133: tie, to even (2) */
    TST_CHECK(cm_f32_to_bf16(1.0f + ldexpf(1.0f, -8)) == 0x3f80u);     /* tie at 1 + 2^-8 → 1.0 (even) */
    TST_CHECK(cm_f32_to_bf16(1.0f + 3 * ldexpf(1.0f, -8)) == 0x3f82u); /* tie → 1 + 2^-6 (even) */
}

static void test_f16(void) {
    int bad_dec = 0, bad_enc = 0;
    for (unsigned c = 0; c < 0x10000u; c++) {
        float f = cm_f16_to_f32((uint16_t)c);
        if (!same_value(f, ref_f16(c)))
            bad_dec++;
        uint16_t back = cm_f32_to_f16(f);
        if (isnan(ref_f16(c)) ? !(isnan(cm_f16_to_f32(back)) && (back & 0x8000u) == (c & 0x8000u))
                              : back != c)
            bad_enc++;
    }
    TST_CHECK(bad_dec == 0);
    TST_CHECK(bad_enc == 0);

    int bad_mid = 0;
    for (unsigned c = 0; c < 0x7bffu; c++) {
        double   lo = ref_f16(c), hi = ref_f16(c + 1);
        float    mid = (float)((lo + hi) / 2);
        float    below = nextafterf(mid, 0.0f), above = nextafterf(mid, INFINITY);
        unsigned even = (c & 1) ? c + 1 : c;
        if (cm_f32_to_f16(mid) != even || ref_to_f16(mid) != even)
            bad_mid++;
        if (cm_f32_to_f16(below) != c || cm_f32_to_f16(above) != c + 1)
            bad_mid++;
        if (cm_f32_to_f16(-mid) != (even | 0x8000u))
            bad_mid++;
    }
    TST_CHECK(bad_mid == 0);

    int bad_rand = 0;
    for (int i = 0; i < 200000; i++) {
        /* exponents near the f16 range, where all the cases are */
        uint32_t u = (rng_u32() & 0x807fffffu) | ((uint32_t)(100 + rng_u32() % 50) << 23);
        float    f = f32_of(u);
        if (cm_f32_to_f16(f) != ref_to_f16(f))
            bad_rand++;
    }
    TST_CHECK(bad_rand == 0);

    TST_CHECK(cm_f32_to_f16(65504.0f) == 0x7bffu);
    TST_CHECK(cm_f32_to_f16(nextafterf(65520.0f, 0.0f)) == 0x7bffu);
    TST_CHECK(cm_f32_to_f16(65520.0f) == 0x7c00u); /* tie with the odd max: to inf */
    TST_CHECK(cm_f32_to_f16(1e9f) == 0x7c00u && cm_f32_to_f16(-1e9f) == 0xfc00u);
    TST_CHECK(cm_f32_to_f16(INFINITY) == 0x7c00u);
    TST_CHECK(isnan(cm_f16_to_f32(cm_f32_to_f16(NAN))));
    TST_CHECK(isnan(cm_f16_to_f32(cm_f32_to_f16(f32_of(0x7f800001u)))));
    TST_CHECK(cm_f32_to_f16(ldexpf(1.0f, -24)) == 0x0001u); /* smallest subnormal */
    TST_CHECK(cm_f32_to_f16(ldexpf(1.0f, -25)) == 0x0000u); /* half of it: tie, to 0 */
    TST_CHECK(cm_f32_to_f16(ldexpf(3.0f, -25)) == 0x0002u); /* 1.5 units: tie, to 2 */
    TST_CHECK(cm_f32_to_f16(nextafterf(ldexpf(1.0f, -25), 1.0f)) == 0x0001u);
    TST_CHECK(cm_f32_to_f16(ldexpf(1023.5f, -24)) == 0x0400u); /* rounds up into the normals */
    TST_CHECK(cm_f32_to_f16(-ldexpf(1.0f, -30)) == 0x8000u);   /* underflow keeps the sign */
    TST_CHECK(cm_f16_to_f32(0x3c00u) == 1.0f && cm_f16_to_f32(0xc000u) == -2.0f);
}

static void test_f8(void) {
    int bad = 0;
    for (unsigned c = 0; c < 256; c++) {
        float  f = cm_f8e4m3_to_f32((uint8_t)c);
        double ref = ref_f8(c);
        if (!same_value(f, ref)) {
            bad++;
            fprintf(stderr, "  f8 0x%02x decodes to %g, expected %g\n", c, f, ref);
        }
        uint8_t back = cm_f32_to_f8e4m3(f);
        if (back != c) { /* every code, including ±0 and both NaNs, re-encodes to itself */
            bad++;
            fprintf(stderr, "  f8 0x%02x re-encodes to 0x%02x\n", c, back);
        }
    }
    TST_CHECK(bad == 0);
    TST_CHECK(ref_f8(0x7e) == 448.0 && ref_f8(0x01) == ldexp(1.0, -9) && ref_f8(0x08) == ldexp(1.0, -6));

    int bad_mid = 0;
    for (unsigned c = 0; c < 0x7eu; c++) {
        double   lo = ref_f8(c), hi = ref_f8(c + 1);
        float    mid = (float)((lo + hi) / 2);
        float    below = nextafterf(mid, 0.0f), above = nextafterf(mid, INFINITY);
        unsigned even = (c & 1) ? c + 1 : c;
        if (cm_f32_to_f8e4m3(mid) != even || ref_to_f8(mid) != even)
            bad_mid++;
        if (cm_f32_to_f8e4m3(below) != c || cm_f32_to_f8e4m3(above) != c + 1)
            bad_mid++;
        if (cm_f32_to_f8e4m3(-mid) != (even | 0x80u))
            bad_mid++;
    }
    TST_CHECK(bad_mid == 0);

    int bad_rand = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (rng_u32() & 0x807fffffu) | ((uint32_t)(110 + rng_u32() % 30) << 23);
        float    f = f32_of(u);
        if (cm_f32_to_f8e4m3(f) != ref_to_f8(f))
            bad_rand++;
    }
    TST_CHECK(bad_rand == 0);

    // saturation (the fn variant has no infinity), NaN, subnormals
    TST_CHECK(cm_f32_to_f8e4m3(448.0f) == 0x7e);
    TST_CHECK(cm_f32_to_f8e4m3(463.0f) == 0x7e);
    TST_CHECK(cm_f32_to_f8e4m3(1e6f) == 0x7e && cm_f32_to_f8e4m3(-1e6f) == 0xfe);
    TST_CHECK(cm_f32_to_f8e4m3(INFINITY) == 0x7e && cm_f32_to_f8e4m3(-INFINITY) == 0xfe);
    TST_CHECK(cm_f32_to_f8e4m3(NAN) == 0x7f || cm_f32_to_f8e4m3(NAN) == 0xff);
    TST_CHECK(isnan(cm_f8e4m3_to_f32(cm_f32_to_f8e4m3(NAN))));
    TST_CHECK(cm_f32_to_f8e4m3(ldexpf(1.0f, -10)) == 0x00); /* half the smallest subnormal: to 0 */
    TST_CHECK(cm_f32_to_f8e4m3(ldexpf(3.0f, -10)) == 0x02); /* 1.5 units: tie, to 2 */
    TST_CHECK(cm_f32_to_f8e4m3(ldexpf(7.5f, -9)) == 0x08);  /* rounds up into the normals */
    TST_CHECK(cm_f32_to_f8e4m3(-ldexpf(1.0f, -12)) == 0x80);
    TST_CHECK(cm_f32_to_f8e4m3(1.0625f) == 0x38); /* tie between 1 and 1.125: even */
    TST_CHECK(cm_f32_to_f8e4m3(1.1875f) == 0x3a); /* tie between 1.125 and 1.25: even */
}

static void test_convert(void) {
    // values exact in every float dtype (all are f8 codes), so every pair converts losslessly
    static const float vals[] = {0.0f,    -0.0f,        1.0f,      -1.5f, 448.0f,
                                 -448.0f, 0.001953125f, 0.015625f, 3.25f, 240.0f};
    enum { N = sizeof vals / sizeof vals[0] };
    static const cm_dtype fl[] = {CM_DTYPE_F32, CM_DTYPE_F64, CM_DTYPE_BF16, CM_DTYPE_F16, CM_DTYPE_F8_E4M3};
    int                   bad = 0;
    for (int a = 0; a < 5; a++) {
        for (int b = 0; b < 5; b++) {
            _Alignas(8) unsigned char src[N * 8], mid[N * 8];
            float                     back[N];
            TST_CHECK(cm_convert(src, fl[a], vals, CM_DTYPE_F32, N) == CM_OK);
            TST_CHECK(cm_convert(mid, fl[b], src, fl[a], N) == CM_OK);
            TST_CHECK(cm_convert(back, CM_DTYPE_F32, mid, fl[b], N) == CM_OK);
            for (int i = 0; i < N; i++)
                bad += !same_value(back[i], vals[i]);
        }
    }
    TST_CHECK(bad == 0);

    // rounding happens once, in the narrowing step
    double   d[3] = {1.0 + ldexp(1.0, -9), 65519.0, 1e300};
    uint16_t h[3];
    TST_CHECK(cm_convert(h, CM_DTYPE_BF16, d, CM_DTYPE_F64, 3) == CM_OK);
    TST_CHECK(h[0] == 0x3f80u && h[2] == 0x7f80u);
    TST_CHECK(cm_convert(h, CM_DTYPE_F16, d, CM_DTYPE_F64, 3) == CM_OK);
    TST_CHECK(h[1] == 0x7bffu && h[2] == 0x7c00u);

    int32_t i32[2] = {1, 2};
    float   f[2];
    cm_clear_error();
    TST_CHECK(cm_convert(f, CM_DTYPE_F32, i32, CM_DTYPE_I32, 2) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "I32") != NULL);
    TST_CHECK(cm_convert(i32, CM_DTYPE_I32, f, CM_DTYPE_F32, 2) == CM_ERR_INVALID_ARG);
}

int main(void) {
    test_names();
    test_bf16();
    test_f16();
    test_f8();
    test_convert();
    return tst_report();
}
