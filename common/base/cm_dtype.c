/* common/base/cm_dtype.c — dtype names, sizes, bit-exact scalar conversions and shape strings. */
#include "cm_dtype.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    size_t      size;
    int         is_float;
} dtype_info[CM_DTYPE_COUNT] = {
    [CM_DTYPE_F32] = {"F32", 4, 1},    [CM_DTYPE_F64] = {"F64", 8, 1},
    [CM_DTYPE_BF16] = {"BF16", 2, 1},  [CM_DTYPE_F16] = {"F16", 2, 1},
    [CM_DTYPE_F8_E4M3] = {"F8_E4M3", 1, 1},
    [CM_DTYPE_I64] = {"I64", 8, 0},    [CM_DTYPE_I32] = {"I32", 4, 0},
    [CM_DTYPE_I16] = {"I16", 2, 0},    [CM_DTYPE_I8] = {"I8", 1, 0},
    [CM_DTYPE_U8] = {"U8", 1, 0},      [CM_DTYPE_BOOL] = {"BOOL", 1, 0},
};

size_t cm_dtype_size(cm_dtype dt) { return (unsigned)dt < CM_DTYPE_COUNT ? dtype_info[dt].size : 0; }

const char *cm_dtype_name(cm_dtype dt) { return (unsigned)dt < CM_DTYPE_COUNT ? dtype_info[dt].name : "?"; }

int cm_dtype_is_float(cm_dtype dt) { return (unsigned)dt < CM_DTYPE_COUNT && dtype_info[dt].is_float; }

cm_status cm_dtype_parse(const char *name, cm_dtype *out) {
    for (int i = 0; i < CM_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_info[i].name) == 0) {
            *out = (cm_dtype)i;
            return CM_OK;
        }
    }
    return CM_FAIL(CM_ERR_FORMAT, "unknown dtype '%s' (known: F32 F64 BF16 F16 F8_E4M3 I64 I32 I16 I8 U8 BOOL)",
                   name);
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float cm_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t cm_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float cm_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp  = (h >> 10) & 0x1f;
    uint32_t man  = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t cm_f32_to_f16(float f) {
    uint32_t u    = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a    = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
        float v = bits_f32(a) * 16777216.0f;     /* in units of 2^-24, exact */
        return sign | (uint16_t)nearbyintf(v);   /* default rounding mode: nearest even */
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

float cm_f8e4m3_to_f32(uint8_t b) {
    uint32_t sign = b & 0x80u;
    uint32_t exp  = (b >> 3) & 0xf;
    uint32_t man  = b & 0x7u;
    float    v;
    if (exp == 0xf && man == 0x7) return bits_f32(0x7fc00000u | (sign << 24));
    if (exp == 0)
        v = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        v = ldexpf(1.0f + (float)man / 8.0f, (int)exp - 7);
    return sign ? -v : v;
}

uint8_t cm_f32_to_f8e4m3(float f) {
    uint8_t sign = (f32_bits(f) >> 24) & 0x80u;
    float   a    = fabsf(f);
    if (isnan(f)) return sign | 0x7f;
    if (a >= 448.0f) return sign | 0x7e; /* saturate (fn variant has no inf) */
    if (a < ldexpf(1.0f, -6)) {          /* subnormal: units of 2^-9 */
        int m = (int)nearbyintf(a * 512.0f);
        return sign | (uint8_t)m;        /* m == 8 becomes the smallest normal, same bits */
    }
    int   e;
    float fr = frexpf(a, &e);            /* a = fr * 2^e, fr in [0.5, 1) */
    int   m  = (int)nearbyintf((fr * 2.0f - 1.0f) * 8.0f);
    int   be = e - 1 + 7;
    if (m == 8) { m = 0; be++; }
    if (be > 15 || (be == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)((be << 3) | m);
}

static double load_float(const void *src, cm_dtype dt, size_t i) {
    switch (dt) {
    case CM_DTYPE_F32:     return ((const float *)src)[i];
    case CM_DTYPE_F64:     return ((const double *)src)[i];
    case CM_DTYPE_BF16:    return cm_bf16_to_f32(((const uint16_t *)src)[i]);
    case CM_DTYPE_F16:     return cm_f16_to_f32(((const uint16_t *)src)[i]);
    case CM_DTYPE_F8_E4M3: return cm_f8e4m3_to_f32(((const uint8_t *)src)[i]);
    default:               CM_ASSERT(0);
    }
    return 0;
}

static void store_float(void *dst, cm_dtype dt, size_t i, double v) {
    switch (dt) {
    case CM_DTYPE_F32:     ((float *)dst)[i] = (float)v; break;
    case CM_DTYPE_F64:     ((double *)dst)[i] = v; break;
    case CM_DTYPE_BF16:    ((uint16_t *)dst)[i] = cm_f32_to_bf16((float)v); break;
    case CM_DTYPE_F16:     ((uint16_t *)dst)[i] = cm_f32_to_f16((float)v); break;
    case CM_DTYPE_F8_E4M3: ((uint8_t *)dst)[i] = cm_f32_to_f8e4m3((float)v); break;
    default:               CM_ASSERT(0);
    }
}

cm_status cm_convert(void *dst, cm_dtype dst_dt, const void *src, cm_dtype src_dt, size_t n) {
    if (!cm_dtype_is_float(dst_dt) || !cm_dtype_is_float(src_dt))
        return CM_FAIL(CM_ERR_INVALID_ARG, "cannot convert %s to %s: both must be float dtypes",
                       cm_dtype_name(src_dt), cm_dtype_name(dst_dt));
    if (dst_dt == src_dt) {
        memcpy(dst, src, n * cm_dtype_size(dst_dt));
        return CM_OK;
    }
    if (src_dt == CM_DTYPE_BF16 && dst_dt == CM_DTYPE_F32) { /* the hot case: weights to f32 */
        const uint16_t *s = src;
        float          *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = cm_bf16_to_f32(s[i]);
        return CM_OK;
    }
    for (size_t i = 0; i < n; i++) store_float(dst, dst_dt, i, load_float(src, src_dt, i));
    return CM_OK;
}

char *cm_shape_str(char *buf, size_t len, int n_dims, const int64_t *ne) {
    size_t off = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n_dims && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, i ? ", %lld" : "%lld", (long long)ne[i]);
    if (off < len)
        snprintf(buf + off, len - off, "]");
    return buf;
}

/* Whether any value is NaN/Inf and whether every value is zero. The exponent test is
 * branch-free ((x & EXP) + EXP_LSB carries into the sign bit only for an all-ones exponent)
 * and runs in fixed blocks of 64 so the compiler vectorises it even at -O2. */
#define SCAN_BLOCK 64
#define SCAN_LOOP(T, EXP, LSB, SIGN)                                                                         \
    do {                                                                                                     \
        const T *v = data;                                                                                   \
        T        bad = 0, nz = 0;                                                                            \
        size_t   i = 0;                                                                                      \
        for (; i + SCAN_BLOCK <= n; i += SCAN_BLOCK)                                                         \
            for (int k = 0; k < SCAN_BLOCK; k++) {                                                           \
                bad |= (T)((v[i + k] & EXP) + LSB);                                                          \
                nz |= (T)(v[i + k] & (T)~SIGN);                                                              \
            }                                                                                                \
        for (; i < n; i++) {                                                                                 \
            bad |= (T)((v[i] & EXP) + LSB);                                                                  \
            nz |= (T)(v[i] & (T)~SIGN);                                                                      \
        }                                                                                                    \
        *any_bad = (bad & SIGN) != 0;                                                                        \
        *all_zero = n > 0 && nz == 0;                                                                        \
    } while (0)

void cm_scan_values(cm_dtype dt, const void *data, size_t n, int *any_bad, int *all_zero) {
    if (dt == CM_DTYPE_BF16)
        SCAN_LOOP(uint16_t, 0x7F80u, 0x0080u, 0x8000u);
    else
        SCAN_LOOP(uint32_t, 0x7F800000u, 0x00800000u, 0x80000000u);
}
