/* tests/tst_kn_cmp.h — what test_kn_cuda and test_kn_cuda_seq share beside the cpu/cuda pair
 * (tst_kn_pair.h): downloads of both sides of a paired buffer (f32, and bf16 widened), the
 * elementwise and relative-L2 comparisons that print one line each, NaN poisoning of a device
 * buffer so that an element a kernel never writes fails, the packed sequence table, and the
 * check of a call that must fail with a given status.
 * Header-only; include once, after tst_kn_pair.h. */
#ifndef TST_KN_CMP_H
#define TST_KN_CMP_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

/* Downloads both sides of b (n floats from element offset off) into fresh host arrays. */
static inline void dbuf_get(const dbuf *b, long off, long n, float **c_out, float **g_out) {
    *c_out = tst_zeros_f32(n);
    *g_out = tst_zeros_f32(n);
    if (cpu->download(cctx, *c_out, (const float *)b->c + off, (size_t)n * sizeof(float)) != CM_OK ||
        gpu->download(gctx, *g_out, (const float *)b->g + off, (size_t)n * sizeof(float)) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

/* |got − ref| ≤ atol + rtol·|ref| elementwise; prints the max abs error and the worst
 * error/tolerance ratio (≤ 1 passes) for every comparison. */
static inline void compare(const char *name, const float *got, const float *ref, long n, double atol,
                           double rtol) {
    tst_compare(name, 58, got, ref, n, atol, rtol, NULL);
}

/* Compares dbuf b (n floats) between the backends. */
static inline void compare_buf(const char *name, const dbuf *b, long n, double atol, double rtol) {
    float *c, *g;
    dbuf_get(b, 0, n, &c, &g);
    compare(name, g, c, n, atol, rtol);
    free(c);
    free(g);
}

/* Packed sequence table for lens; returns T. cu has n + 1 entries. */
static inline long make_seqs(const int *lens, int n, int32_t *cu) {
    cu[0] = 0;
    for (int i = 0; i < n; i++)
        cu[i + 1] = cu[i] + lens[i];
    return cu[n];
}

/* ||got − ref|| / ||ref|| ≤ rel_l2 and max|got − ref| ≤ rel_max · max|ref| (NaN fails): for the
 * bf16 tensor-core kernels, whose error is spread over every element rather than bounded per
 * element by fp32 rounding. */
static inline void compare_rel(const char *name, const float *got, const float *ref, long n, double rel_l2,
                               double rel_max) {
    double num = 0, den = 0, max_abs = 0, max_ref = 0;
    int    nan = 0;
    for (long i = 0; i < n; i++) {
        double d = (double)got[i] - (double)ref[i];
        if (isnan(d) || isinf(d))
            nan = 1;
        num += d * d;
        den += (double)ref[i] * ref[i];
        if (fabs(d) > max_abs)
            max_abs = fabs(d);
        if (fabs((double)ref[i]) > max_ref)
            max_ref = fabs((double)ref[i]);
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    int    ok = !nan && rel <= rel_l2 && max_abs <= rel_max * max_ref;
    TST_CHECK(ok);
    printf("%-58s n=%-8ld max|ref| %.2e  max_abs %.2e  rel_l2 %.2e  %s\n", name, n, max_ref, max_abs, rel,
           ok ? "ok" : "FAIL");
}

/* Poisons a device buffer with NaN so that an element the kernel never writes fails. */
static inline void poison(void *dev, long n) {
    float *nan = malloc((size_t)n * sizeof(float));
    if (!nan) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    for (long i = 0; i < n; i++)
        nan[i] = NAN;
    TST_CHECK(tst_ok(gpu->upload(gctx, dev, nan, (size_t)n * sizeof(float)), "poison upload"));
    free(nan);
}

/* Downloads n bf16 values of b from element offset off on both sides, widened. */
static inline void dbuf_get16(const dbuf *b, long off, long n, float **c_out, float **g_out) {
    uint16_t *c16 = malloc((size_t)(n > 0 ? n : 1) * 2), *g16 = malloc((size_t)(n > 0 ? n : 1) * 2);
    if (!c16 || !g16)
        exit(1);
    if (cpu->download(cctx, c16, (const uint16_t *)b->c + off, (size_t)n * 2) != CM_OK ||
        gpu->download(gctx, g16, (const uint16_t *)b->g + off, (size_t)n * 2) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
    *c_out = tst_zeros_f32(n);
    *g_out = tst_zeros_f32(n);
    for (long i = 0; i < n; i++) {
        (*c_out)[i] = tst_bf16_widen(c16[i]);
        (*g_out)[i] = tst_bf16_widen(g16[i]);
    }
    free(c16);
    free(g16);
}

/* Both sides round an f32 value that agrees to ~1e-6 relative, so their bf16 outputs agree
 * or differ by one bf16 ulp (≤ 2^-7 relative) where the value lies next to a rounding
 * boundary: rtol 2^-7. */
#define BF16_RTOL 0.0078125

static inline void compare_buf16(const char *name, const dbuf *b, long off, long n) {
    float *c, *g;
    dbuf_get16(b, off, n, &c, &g);
    compare(name, g, c, n, 1e-30, BF16_RTOL);
    free(c);
    free(g);
}

/* Fills a bf16 device buffer with NaN (0xffff) so that an element the kernel skips fails. */
static inline void poison16(void *dev, long n) {
    uint16_t *nan = malloc((size_t)(n > 0 ? n : 1) * 2);
    if (!nan)
        exit(1);
    for (long i = 0; i < n; i++)
        nan[i] = 0xffffu;
    TST_CHECK(tst_ok(gpu->upload(gctx, dev, nan, (size_t)n * 2), "poison16 upload"));
    free(nan);
}

/* A call that must fail with status want: prints the message it left, or what it returned. */
static inline void expect(cm_status got, cm_status want, const char *what) {
    if (got != want)
        fprintf(stderr, "  %s: got %s, want %s (%s)\n", what, cm_status_str(got), cm_status_str(want),
                cm_last_error());
    else
        printf("%-58s -> %s: %s\n", what, cm_status_str(got), cm_last_error());
    TST_CHECK(got == want);
}

#endif /* TST_KN_CMP_H */
