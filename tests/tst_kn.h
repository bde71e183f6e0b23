/* tests/tst_kn.h — the kernel tests' inputs and verdicts: deterministic random numbers
 * (xorshift64 from TST_KN_SEED, which a test may define before including this), random and
 * zeroed host arrays, bf16 rounding (nearest even) and widening written independently of
 * cm_dtype, a skip without a usable cuda device, and comparisons that print their errors whatever the
 * verdict: elementwise against atol + rtol·|ref| (TST_CLOSE) and against a per-element bound (the rounding
 * bound of a dot product). Header-only; include once, after tst.h. */
#ifndef TST_KN_H
#define TST_KN_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"

#ifndef TST_KN_SEED
#define TST_KN_SEED 0x9e3779b97f4a7c15ull
#endif

/* Uniform in [0, 1), 53 bits. */
static inline double tst_urand(void) {
    static uint64_t state = TST_KN_SEED;
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (double)(state >> 11) / 9007199254740992.0;
}

/* Exits 77 (skipped) unless this build has a cuda backend and a context opens on a device. */
static inline void tst_need_cuda(void) {
    const kn_backend *be = kn_backend_cuda();
    if (!be)
        TST_SKIP("this build has no cuda backend");
    kn_ctx       *ctx = NULL;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    if (be->ctx_create(&ctx, &kc) != CM_OK)
        TST_SKIP("no usable cuda device: %s", cm_last_error());
    be->ctx_destroy(&ctx);
}

/* Zeroed host memory (at least 1 byte); exits 1 when there is none. */
static inline void *tst_xcalloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static inline float *tst_zeros_f32(long n) {
    return tst_xcalloc((size_t)(n > 0 ? n : 0) * sizeof(float));
}

/* x[0..n) uniform in [lo, hi). */
static inline void tst_fill(float *x, long n, double lo, double hi) {
    for (long i = 0; i < n; i++)
        x[i] = (float)(lo + (hi - lo) * tst_urand());
}

/* A fresh host array of n floats uniform in [lo, hi); the caller frees it. */
static inline float *tst_rand_f32(long n, double lo, double hi) {
    float *x = tst_zeros_f32(n);
    tst_fill(x, n, lo, hi);
    return x;
}

/* Each of rows rows of n floats divided by its L2 norm (sum of squares in double, + 1e-6 under
 * the root), as the GDN's q and k are. */
static inline void tst_l2norm_rows(float *x, long rows, int n) {
    for (long r = 0; r < rows; r++) {
        double s = 0;
        for (int i = 0; i < n; i++)
            s += (double)x[r * n + i] * x[r * n + i];
        for (int i = 0; i < n; i++)
            x[r * n + i] = (float)(x[r * n + i] / sqrt(s + 1e-6));
    }
}

/* f rounded to bf16, nearest even (finite inputs). */
static inline uint16_t tst_bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float tst_bf16_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float    f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* New arrays: x [n] each rounded to bf16, and h [n] widened. */
static inline uint16_t *tst_bf16_round_n(const float *x, long n) {
    uint16_t *y = tst_xcalloc((size_t)n * 2);
    for (long i = 0; i < n; i++)
        y[i] = tst_bf16_round(x[i]);
    return y;
}

static inline float *tst_bf16_widen_n(const uint16_t *h, long n) {
    float *y = tst_xcalloc((size_t)n * 4);
    for (long i = 0; i < n; i++)
        y[i] = tst_bf16_widen(h[i]);
    return y;
}

/* The largest |x[i]| (0 for n = 0). */
static inline double tst_max_abs(const float *x, long n) {
    double m = 0;
    for (long i = 0; i < n; i++)
        m = fabs((double)x[i]) > m ? fabs((double)x[i]) : m;
    return m;
}

/* What a comparison found: the max abs error, the worst error/tolerance ratio (≤ 1 passes;
 * inf for an error where the tolerance is 0; a NaN counts as an infinite error) and max|ref|. */
typedef struct tst_err {
    double max_abs, worst, max_ref;
} tst_err;

/* TST_CLOSE(name, got, ref, n, atol, rtol), and a line of name (padded to width), n, max|ref|,
 * the max abs error and the worst ratio, ok or FAIL; the errors into *err (may be NULL).
 * Returns the verdict. */
static inline int tst_compare(const char *name, int width, const float *got, const float *ref, long n,
                              double atol, double rtol, tst_err *err) {
    tst_err e = {0, 0, 0};
    for (long i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        if (isnan(d))
            d = INFINITY;
        double tol = atol + rtol * fabs((double)ref[i]);
        if (fabs((double)ref[i]) > e.max_ref)
            e.max_ref = fabs((double)ref[i]);
        if (d > e.max_abs)
            e.max_abs = d;
        if (tol > 0 ? d / tol > e.worst : d > 0)
            e.worst = tol > 0 ? d / tol : INFINITY;
    }
    int ok = TST_CLOSE(name, got, ref, n, atol, rtol);
    printf("%-*s n=%-8ld max|ref| %.2e  max_abs %.2e  err/tol %.3f  %s\n", width, name, n, e.max_ref,
           e.max_abs, e.worst, ok ? "ok" : "FAIL");
    if (err)
        *err = e;
    return ok;
}

/* |got − ref| ≤ tol·bound[i] + 1e-30 elementwise (bound: Σ_k |a·b| of each output, the
 * rounding-error bound of a dot product, meaningful even where ref ≈ 0) as one check; prints
 * up to 5 mismatches and a line as tst_compare. */
static inline int tst_compare_bound(const char *name, int width, const float *got, const float *ref,
                                    const double *bound, long n, double tol, tst_err *err) {
    tst_err e = {0, 0, 0};
    int     bad = 0;
    for (long i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        if (isnan(d))
            d = INFINITY;
        double lim = tol * bound[i] + 1e-30;
        if (fabs((double)ref[i]) > e.max_ref)
            e.max_ref = fabs((double)ref[i]);
        if (d > e.max_abs)
            e.max_abs = d;
        if (d / lim > e.worst)
            e.worst = d / lim;
        if (!(d <= lim)) {
            if (bad < 5)
                fprintf(stderr, "  %s[%ld]: got %.8g ref %.8g (limit %.3g)\n", name, i, got[i], ref[i], lim);
            bad++;
        }
    }
    TST_CHECK(bad == 0);
    printf("%-*s n=%-8ld max|ref| %.2e  max_abs %.2e  err/tol %.3f  %s\n", width, name, n, e.max_ref,
           e.max_abs, e.worst, bad ? "FAIL" : "ok");
    if (err)
        *err = e;
    return bad == 0;
}

#endif /* TST_KN_H */
