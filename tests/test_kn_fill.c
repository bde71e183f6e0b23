/* tests/test_kn_fill.c — fill_uniform (target-server --init random) on the cpu backend, and on
 * the cuda backend when there is one: values in [lo, hi), mean and variance of a uniform,
 * a pure function of (seed, index) (a slice filled alone equals the same slice of a longer
 * fill), different seeds give different streams, BF16 is the nearest-even rounding of the F32
 * value, cuda bit-identical to cpu, and bad arguments refused. Label unit (the cuda part is
 * skipped without a device). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_cuda.h"
#include "tst_kn.h"

#define N 100003

/* Fills n values on backend be and brings them to the host (F32 or BF16 by dt). */
static int fill_host(const kn_backend *be, kn_ctx *ctx, cm_dtype dt, int64_t n, uint64_t seed, float lo, float hi,
                     void *host) {
    size_t bytes = (size_t)n * (dt == CM_DTYPE_F32 ? 4 : 2);
    void  *dev = NULL;
    if (be->alloc(ctx, &dev, bytes) != CM_OK) return 0;
    cm_status st = be->fill_uniform(ctx, dev, dt, n, seed, lo, hi);
    if (st == CM_OK) st = be->download(ctx, host, dev, bytes);
    be->free(ctx, dev);
    if (st != CM_OK) fprintf(stderr, "  %s fill_uniform: %s: %s\n", be->name, cm_status_str(st), cm_last_error());
    return st == CM_OK;
}

static void test_cpu(const kn_backend *cpu, kn_ctx *ctx) {
    float    *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float)), *s = malloc(1000 * sizeof(float));
    uint16_t *h = malloc(N * sizeof(uint16_t));
    TST_CHECK(a && b && s && h);
    TST_CHECK(fill_host(cpu, ctx, CM_DTYPE_F32, N, 42, -0.5f, 1.5f, a));
    double sum = 0, sq = 0;
    int    in_range = 1;
    for (int i = 0; i < N; i++) {
        if (!(a[i] >= -0.5f && a[i] < 1.5f)) in_range = 0;
        sum += a[i];
        sq += (double)a[i] * a[i];
    }
    double mean = sum / N, var = sq / N - mean * mean;
    /* uniform on [-0.5, 1.5): mean 0.5, variance 4/12; 5 standard errors of N samples */
    printf("f32 fill: mean %.5f (0.5)  variance %.5f (0.33333)\n", mean, var);
    TST_CHECK(in_range);
    TST_CHECK(fabs(mean - 0.5) < 5 * sqrt(var / N));
    TST_CHECK(fabs(var - 1.0 / 3.0) < 0.01);

    TST_CHECK(fill_host(cpu, ctx, CM_DTYPE_F32, N, 42, -0.5f, 1.5f, b));
    TST_CHECK(memcmp(a, b, N * sizeof(float)) == 0); /* deterministic */
    TST_CHECK(fill_host(cpu, ctx, CM_DTYPE_F32, 1000, 42, -0.5f, 1.5f, s));
    TST_CHECK(memcmp(a, s, 1000 * sizeof(float)) == 0); /* a prefix is the same stream */
    TST_CHECK(fill_host(cpu, ctx, CM_DTYPE_F32, N, 43, -0.5f, 1.5f, b));
    int same = 0;
    for (int i = 0; i < N; i++) same += a[i] == b[i];
    printf("seeds 42 and 43: %d of %d values equal\n", same, N);
    TST_CHECK(same < N / 1000); /* another seed, another stream */

    TST_CHECK(fill_host(cpu, ctx, CM_DTYPE_BF16, N, 42, -0.5f, 1.5f, h));
    int bf_ok = 1;
    for (int i = 0; i < N; i++)
        if (h[i] != tst_bf16_round(a[i]))
            bf_ok = 0;
    TST_CHECK(bf_ok);

    void *dev = NULL;
    TST_CHECK(cpu->alloc(ctx, &dev, 64) == CM_OK);
    TST_CHECK(cpu->fill_uniform(ctx, dev, CM_DTYPE_F16, 4, 1, 0, 1) == CM_ERR_INVALID_ARG);
    TST_CHECK(cpu->fill_uniform(ctx, dev, CM_DTYPE_F32, -1, 1, 0, 1) == CM_ERR_INVALID_ARG);
    TST_CHECK(cpu->fill_uniform(ctx, NULL, CM_DTYPE_F32, 4, 1, 0, 1) == CM_ERR_INVALID_ARG);
    TST_CHECK(cpu->fill_uniform(ctx, NULL, CM_DTYPE_F32, 0, 1, 0, 1) == CM_OK);
    cpu->free(ctx, dev);
    free(a);
    free(b);
    free(s);
    free(h);
}

static void test_cuda(const kn_backend *cpu, kn_ctx *cctx) {
    const kn_backend *gpu = kn_backend_cuda();
    kn_ctx           *g   = NULL;
    kn_ctx_config     cfg = KN_CTX_CONFIG_DEFAULT;
    if (!gpu || gpu->ctx_create(&g, &cfg) != CM_OK) {
        printf("cuda: no backend or no device; cpu part only\n");
        return;
    }
    float    *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    uint16_t *ha = malloc(N * sizeof(uint16_t)), *hb = malloc(N * sizeof(uint16_t));
    TST_CHECK(a && b && ha && hb);
    TST_CHECK(fill_host(cpu, cctx, CM_DTYPE_F32, N, 7, -0.03f, 0.03f, a));
    TST_CHECK(fill_host(gpu, g, CM_DTYPE_F32, N, 7, -0.03f, 0.03f, b));
    TST_CHECK(memcmp(a, b, N * sizeof(float)) == 0);
    TST_CHECK(fill_host(cpu, cctx, CM_DTYPE_BF16, N, 9, 0.9f, 1.1f, ha));
    TST_CHECK(fill_host(gpu, g, CM_DTYPE_BF16, N, 9, 0.9f, 1.1f, hb));
    TST_CHECK(memcmp(ha, hb, N * sizeof(uint16_t)) == 0);
    printf("cuda fill_uniform: bit-identical to cpu (F32 and BF16, %d values)\n", N);
    free(a);
    free(b);
    free(ha);
    free(hb);
    gpu->ctx_destroy(&g);
}

int main(void) {
    const kn_backend *cpu = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    TST_CHECK(cpu->ctx_create(&ctx, NULL) == CM_OK);
    test_cpu(cpu, ctx);
    test_cuda(cpu, ctx);
    cpu->ctx_destroy(&ctx);
    return tst_report();
}
