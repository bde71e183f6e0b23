/* tests/bench_dt_feed.c — the trainer's host work per step for one live answer (not a test):
 * a ZeroMQ answer of n_taps BF16 [T, D] taps, as the cm_chan client lends it, into the model's
 * tap buffers. Two forms, timed side by side in one run on the cpu backend (its upload is a
 * memcpy; on cuda the same bytes cross PCIe):
 *   widened  what `train --server` did before dt_live_get_taps: every row of every tap widened
 *            to F32 into [T, n_taps·D] (cm_convert), the whole buffer scanned for NaN/Inf and
 *            all-zero taps (the client had already scanned the answer), then uploaded as F32
 *            (2 bytes per value more than the answer);
 *   as sent  what it does now with BF16 activation storage (dt_model_upload_batch, host taps):
 *            one upload per tap of the answer's own bytes.
 * Prints ms per step and the host bytes each form moves, at the Qwen3.6-27B drafter's shape
 * by default (8192 tokens, 5 taps, hidden 5120).
 *   bench_dt_feed [--tokens T] [--taps N] [--hidden D] [--reps R] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_dtype.h"
#include "cm_time.h"
#include "kn_backend.h"

static int arg_int(int argc, char **argv, const char *name, int def) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return atoi(argv[i + 1]);
    return def;
}

/* the removed path's scan: any non-finite value, or a tap that is all zeros, fails */
static int scan(const float *F, int64_t T, int taps, int64_t D) {
    const int64_t W = (int64_t)taps * D;
    for (int64_t k = 0; k < T * W; k++)
        if (!isfinite(F[k]))
            return 1;
    for (int tap = 0; tap < taps; tap++) {
        int nonzero = 0;
        for (int64_t t = 0; t < T && !nonzero; t++)
            for (int64_t c = 0; c < D && !nonzero; c++)
                nonzero = F[t * W + tap * D + c] != 0.0f;
        if (!nonzero)
            return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const int64_t     T = arg_int(argc, argv, "--tokens", 8192), D = arg_int(argc, argv, "--hidden", 5120);
    const int         taps = arg_int(argc, argv, "--taps", 5), reps = arg_int(argc, argv, "--reps", 3);
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    if (T < 1 || D < 1 || taps < 1 || reps < 1 || be->ctx_create(&ctx, NULL) != CM_OK) {
        fprintf(stderr, "bench_dt_feed: bad arguments or no cpu context\n");
        return 1;
    }
    const int64_t W = (int64_t)taps * D;
    uint16_t    **ans = calloc((size_t)taps, sizeof *ans);
    float        *F = malloc((size_t)(T * W) * sizeof *F);
    void         *dev32 = NULL, *dev16 = NULL;
    if (!ans || !F || be->alloc(ctx, &dev32, (size_t)(T * W) * 4) != CM_OK ||
        be->alloc(ctx, &dev16, (size_t)(T * W) * 2) != CM_OK) {
        fprintf(stderr, "bench_dt_feed: out of memory\n");
        return 1;
    }
    for (int k = 0; k < taps; k++) {
        ans[k] = malloc((size_t)(T * D) * 2);
        if (!ans[k])
            return 1;
        for (int64_t i = 0; i < T * D; i++)
            ans[k][i] = cm_f32_to_bf16((float)((i * 2654435761u + (uint64_t)k) % 1000) * 0.01f - 5.0f + 0.001f);
    }
    double best[2] = {1e30, 1e30};
    int    bad = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = cm_now_s();
        for (int k = 0; k < taps; k++)
            for (int64_t t = 0; t < T; t++)
                cm_convert(F + t * W + k * D, CM_DTYPE_F32, ans[k] + t * D, CM_DTYPE_BF16, (size_t)D);
        bad |= scan(F, T, taps, D);
        bad |= be->upload(ctx, dev32, F, (size_t)(T * W) * 4) != CM_OK;
        double t1 = cm_now_s();
        for (int k = 0; k < taps; k++)
            bad |= be->upload(ctx, (char *)dev16 + (size_t)(k * T * D) * 2, ans[k], (size_t)(T * D) * 2) != CM_OK;
        double t2 = cm_now_s();
        best[0] = t1 - t0 < best[0] ? t1 - t0 : best[0];
        best[1] = t2 - t1 < best[1] ? t2 - t1 : best[1];
    }
    const double mb = (double)(T * W) * 2 / 1e6;
    printf("## trainer host work per live answer: %lld tokens x %d taps x %lld (BF16 answer %.0f MB), best of %d\n\n",
           (long long)T, taps, (long long)D, mb, reps);
    printf("| form | ms per step | host bytes moved | uploaded |\n| --- | ---: | ---: | ---: |\n");
    printf("| widened to F32, scanned, uploaded F32 (before) | %.1f | %.0f MB | %.0f MB |\n", best[0] * 1e3,
           mb + 2 * mb + 2 * mb + 2 * mb, 2 * mb);
    printf("| as sent: one upload per tap (now) | %.1f | %.0f MB | %.0f MB |\n", best[1] * 1e3, mb, mb);
    printf("\nratio %.1fx%s\n", best[0] / best[1], bad ? " (a scan or upload failed)" : "");
    for (int k = 0; k < taps; k++)
        free(ans[k]);
    free(ans);
    free(F);
    be->free(ctx, dev32);
    be->free(ctx, dev16);
    be->ctx_destroy(&ctx);
    return bad;
}
