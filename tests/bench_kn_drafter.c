/* tests/bench_kn_drafter.c — wall time of the cuda drafter kernels at training sizes (not a
 * test): the fused DFlash attention forward and backward, and the chunked LM head + CE, on
 * random data. Each figure is the median of REPS synchronised runs after one warm-up; the
 * attention's rate counts 4·hd flops per visible (query, key) pair and head for the forward
 * (scores and P·V) and 10·hd for the backward (scores, dp, dq, dk, dv), the LM head 2·R·V·D
 * per GEMM (the logits; with dh also dh = coef·W; W is frozen, so there is no third). The
 * attention runs in F32 mode, in BF16 mode (mma.sync), and in BF16 mode with
 * TANDEM_DFLASH_KERNEL=wgmma (the wgmma kernels on compute capability 9.0), one context each.
 *   bench_kn_drafter            (needs a cuda device; exits 77 without one)
 *   bench_kn_drafter attn27b    the Qwen3.6-27B drafter's sliding layer only, bf16 modes only (for a
 *                               profiler: fewer launches to skip) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kn_backend.h"

#define REPS 5

static const kn_backend *gpu;
static kn_ctx           *g32, *g16, *g16w; /* g16w: bf16 with TANDEM_DFLASH_KERNEL=wgmma */
static int               first_mode;       /* 1: skip the F32 kernels */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rs = 0x243f6a8885a308d3ull;
static double   urand(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (double)(rs >> 11) / 9007199254740992.0;
}

static void die(const char *what) {
    fprintf(stderr, "%s: %s\n", what, cm_last_error());
    exit(1);
}

static void *dev_rand(kn_ctx *ctx, size_t n, double lo, double hi) {
    float *h = malloc(n * sizeof *h);
    void  *d = NULL;
    if (!h)
        die("host alloc");
    for (size_t i = 0; i < n; i++)
        h[i] = (float)(lo + (hi - lo) * urand());
    if (gpu->alloc(ctx, &d, n * 4) != CM_OK || gpu->upload(ctx, d, h, n * 4) != CM_OK)
        die("device alloc/upload");
    free(h);
    return d;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef cm_status (*attn_fn)(kn_ctx *, const kn_dflash_attn_params *);

static double time_attn(kn_ctx *ctx, attn_fn f, const kn_dflash_attn_params *p) {
    double t[REPS];
    if (f(ctx, p) != CM_OK || gpu->sync(ctx) != CM_OK)
        die("dflash");
    for (int r = 0; r < REPS; r++) {
        double t0 = now_s();
        if (f(ctx, p) != CM_OK || gpu->sync(ctx) != CM_OK)
            die("dflash");
        t[r] = now_s() - t0;
    }
    qsort(t, REPS, sizeof t[0], cmp_d);
    return t[REPS / 2];
}

/* nq heads of hd, nkv kv heads, block B, n_docs documents of doc_len tokens, n_anchors spread
 * evenly over each document, window W (0 = full). */
static void bench_attn(int nq, int nkv, int hd, int B, int n_docs, int doc_len, int per_doc, int W) {
    const int64_t T = (int64_t)n_docs * doc_len, nb = (int64_t)n_docs * per_doc, R = nb * B;
    int32_t      *anchors = malloc((size_t)nb * 4), *lo = malloc((size_t)nb * 4);
    double        pairs = 0;
    for (int64_t j = 0; j < nb; j++) {
        const int64_t d = j / per_doc, i = j % per_doc;
        anchors[j] = (int32_t)(d * doc_len + (i * (doc_len - 1)) / (per_doc > 1 ? per_doc - 1 : 1));
        lo[j] = (int32_t)(d * doc_len);
        for (int k = 0; k < B; k++) { /* visible keys of slot k */
            int64_t c0 = lo[j], c1 = anchors[j];
            if (W > 0 && c1 + k - (W - 1) > c0)
                c0 = c1 + k - (W - 1) < c1 ? c1 + k - (W - 1) : c1;
            pairs += (double)(c1 - c0) + (W > 0 ? k + 1 : B);
        }
    }
    void *da = NULL, *dl = NULL;
    if (gpu->alloc(g32, &da, (size_t)nb * 4) != CM_OK || gpu->alloc(g32, &dl, (size_t)nb * 4) != CM_OK ||
        gpu->upload(g32, da, anchors, (size_t)nb * 4) != CM_OK || gpu->upload(g32, dl, lo, (size_t)nb * 4) != CM_OK)
        die("alloc");
    kn_dflash_attn_params p = {0};
    p.T = T;
    p.n_blocks = nb;
    p.B = B;
    p.nq = nq;
    p.nkv = nkv;
    p.hd = hd;
    p.window = W;
    p.causal = W > 0;
    p.scale = 1.0f / sqrtf((float)hd);
    p.anchors = da;
    p.ctx_lo = dl;
    p.q = dev_rand(g32, (size_t)(R * nq * hd), -2, 2);
    p.k_ctx = dev_rand(g32, (size_t)(T * nkv * hd), -1, 1);
    p.v_ctx = dev_rand(g32, (size_t)(T * nkv * hd), -1, 1);
    p.k_blk = dev_rand(g32, (size_t)(R * nkv * hd), -1, 1);
    p.v_blk = dev_rand(g32, (size_t)(R * nkv * hd), -1, 1);
    p.dout = dev_rand(g32, (size_t)(R * nq * hd), -1, 1);
    p.out = dev_rand(g32, (size_t)(R * nq * hd), 0, 0);
    p.lse = dev_rand(g32, (size_t)(R * nq), 0, 0);
    p.dq = dev_rand(g32, (size_t)(R * nq * hd), 0, 0);
    p.dk_ctx = dev_rand(g32, (size_t)(T * nkv * hd), 0, 0);
    p.dv_ctx = dev_rand(g32, (size_t)(T * nkv * hd), 0, 0);
    p.dk_blk = dev_rand(g32, (size_t)(R * nkv * hd), 0, 0);
    p.dv_blk = dev_rand(g32, (size_t)(R * nkv * hd), 0, 0);
    const double ff = 4.0 * hd * pairs * nq, fb = 10.0 * hd * pairs * nq;
    /* F32: fp32 CUDA-core kernels; BF16: tensor cores (mma.sync); then BF16 with
     * TANDEM_DFLASH_KERNEL=wgmma (the wgmma kernels on compute capability 9.0) */
    static const char *modes[3] = {"F32 ", "BF16", "BF16 wgmma"};
    for (int mode = first_mode; mode < 3; mode++) {
        kn_ctx      *ctx = mode == 0 ? g32 : mode == 1 ? g16 : g16w;
        const double tf = time_attn(ctx, gpu->dflash_attn_fwd, &p), tb = time_attn(ctx, gpu->dflash_attn_bwd, &p);
        printf("dflash %s nq=%d nkv=%d hd=%d B=%d T=%lld (%d docs) blocks=%lld W=%d: %.3g Mpairs/head; fwd "
               "%.3f ms "
               "(%.1f TFLOP/s), bwd %.3f ms (%.1f TFLOP/s)\n",
               modes[mode], nq, nkv, hd, B, (long long)T, n_docs, (long long)nb, W, pairs / 1e6, tf * 1e3,
               ff / tf / 1e12, tb * 1e3, fb / tb / 1e12);
    }
    void *bufs[] = {da,       dl,       (void *)p.q,  (void *)p.k_ctx,  (void *)p.v_ctx,  (void *)p.k_blk,
                    (void *)p.v_blk, (void *)p.dout, p.out, p.lse, p.dq, p.dk_ctx, p.dv_ctx, p.dk_blk, p.dv_blk};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        gpu->free(g32, bufs[i]);
    free(anchors);
    free(lo);
}

static void bench_lm_ce(kn_ctx *ctx, const char *mode, int64_t R, int64_t V, int64_t D, int with_dh) {
    float   *h = dev_rand(ctx, (size_t)(R * D), -1, 1), *gs = dev_rand(ctx, (size_t)R, 0, 1);
    float   *dh = dev_rand(ctx, (size_t)(R * D), 0, 0), *ce = dev_rand(ctx, (size_t)R, 0, 0);
    int32_t *lab = malloc((size_t)R * 4), *dlab = NULL, *am = NULL;
    void    *w = NULL;
    for (int64_t r = 0; r < R; r++)
        lab[r] = (int32_t)(urand() * (double)V);
    if (gpu->alloc(ctx, (void **)&dlab, (size_t)R * 4) != CM_OK || gpu->alloc(ctx, (void **)&am, (size_t)R * 4) != CM_OK ||
        gpu->upload(ctx, dlab, lab, (size_t)R * 4) != CM_OK || gpu->alloc(ctx, &w, (size_t)(V * D) * 2) != CM_OK ||
        gpu->fill_uniform(ctx, w, CM_DTYPE_BF16, V * D, 2, 0.0078f, 0.0156f) != CM_OK)
        die("alloc");
    double t[REPS];
    for (int r = -1; r < REPS; r++) {
        double t0 = now_s();
        if (gpu->lm_ce(ctx, with_dh ? dh : NULL, ce, am, h, dlab, gs, w, CM_DTYPE_BF16, R, V, D) != CM_OK ||
            gpu->sync(ctx) != CM_OK)
            die("lm_ce");
        if (r >= 0)
            t[r] = now_s() - t0;
    }
    qsort(t, REPS, sizeof t[0], cmp_d);
    const double tm = t[REPS / 2],
                 fl = 2.0 * (double)R * (double)V * (double)D * (with_dh ? 2 : 1); /* W frozen: no dW */
    printf("lm_ce %s-mode R=%lld V=%lld D=%lld W=BF16 %s: %.3f ms (%.1f TFLOP/s)\n", mode, (long long)R,
           (long long)V, (long long)D, with_dh ? "ce+dh" : "ce only", tm * 1e3, fl / tm / 1e12);
    gpu->free(ctx, h);
    gpu->free(ctx, gs);
    gpu->free(ctx, dh);
    gpu->free(ctx, ce);
    gpu->free(ctx, dlab);
    gpu->free(ctx, am);
    gpu->free(ctx, w);
    free(lab);
}

int main(int argc, char **argv) {
    gpu = kn_backend_cuda();
    if (!gpu) {
        fprintf(stderr, "skipped: this build has no cuda backend\n");
        return 77;
    }
    kn_ctx_config c = {0, KN_GEMM_MODE_F32};
    if (gpu->ctx_create(&g32, &c) != CM_OK) {
        fprintf(stderr, "skipped: %s\n", cm_last_error());
        return 77;
    }
    c.gemm_mode = KN_GEMM_MODE_BF16;
    if (gpu->ctx_create(&g16, &c) != CM_OK)
        die("ctx_create");
    setenv("TANDEM_DFLASH_KERNEL", "wgmma", 1); /* read at ctx_create */
    if (gpu->ctx_create(&g16w, &c) != CM_OK)
        die("ctx_create");
    unsetenv("TANDEM_DFLASH_KERNEL");
    if (argc > 1 && strcmp(argv[1], "attn27b") == 0) {
        first_mode = 1;
        bench_attn(32, 8, 128, 16, 4, 2048, 128, 2048);
        return 0;
    }
    /* the test_dt_grad random drafter's layer, then Qwen3-8B-class drafter layers at 8k tokens */
    bench_attn(8, 2, 64, 16, 5, 300, 13, 0);
    bench_attn(32, 8, 128, 16, 4, 2048, 128, 0);
    bench_attn(32, 8, 128, 16, 4, 2048, 128, 2048);
    bench_attn(32, 8, 128, 16, 1, 8192, 512, 0);
    bench_lm_ce(g32, "F32", 4096, 151936, 4096, 1);
    bench_lm_ce(g16, "BF16", 4096, 151936, 4096, 1);
    bench_lm_ce(g16, "BF16", 4096, 151936, 4096, 0);
    bench_lm_ce(g16, "BF16", 7680, 248320, 5120, 1); /* the Qwen3.6-27B drafter step's selected rows */
    gpu->ctx_destroy(&g16w);
    gpu->ctx_destroy(&g16);
    gpu->ctx_destroy(&g32);
    return 0;
}
