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
 * And a shard record of the same taps in the default encoding (zstd-byteplane), as `train
 * --shards` reads it on its loader thread:
 *   widened  before: each tap decoded on one thread into a scratch buffer, widened into the F32
 *            [T, n_taps·D] buffer, the buffer scanned;
 *   as sent  now: each tap decoded on cm_chan_default_threads() threads straight into its own
 *            array of the batch, each tap scanned in its dtype (cm_scan_values).
 * With --device cuda the answer's uploads also run from page-locked memory, as the trainer's
 * live clients now decode into (cm_chan_client_config host_lock), beside the pageable form.
 * Prints ms per step and the host bytes each form moves, at the Qwen3.6-27B drafter's shape
 * by default (8192 tokens, 5 taps, hidden 5120).
 *   bench_dt_feed [--tokens T] [--taps N] [--hidden D] [--reps R] [--device cpu|cuda] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_chan.h"
#include "cm_compress.h"
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
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--device") == 0 && kn_backend_get(argv[i + 1], &be) != CM_OK)
            return 1;
    if (T < 1 || D < 1 || taps < 1 || reps < 1 || be->ctx_create(&ctx, NULL) != CM_OK) {
        fprintf(stderr, "bench_dt_feed: bad arguments or no %s context\n", be->name);
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
        uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(k + 1);
        for (int64_t i = 0; i < T * D; i++) { /* about N(0, 1): compresses like hidden states (~1.5x) */
            float g = -2.0f;
            for (int j = 0; j < 4; j++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                g += (float)(x >> 40) / (float)(1ull << 24);
            }
            ans[k][i] = cm_f32_to_bf16(g * 1.7320508f + 1e-3f);
        }
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
    /* the same uploads from page-locked answers (a backend that can lock host memory) */
    double pinned = -1;
    if (be->host_pin && be->host_unpin) {
        int locked = 1;
        for (int k = 0; k < taps; k++)
            locked &= be->host_pin(ctx, ans[k], (size_t)(T * D) * 2) == CM_OK;
        for (int r = 0; r < reps && locked; r++) {
            double t0 = cm_now_s();
            for (int k = 0; k < taps; k++)
                bad |= be->upload(ctx, (char *)dev16 + (size_t)(k * T * D) * 2, ans[k],
                                  (size_t)(T * D) * 2) != CM_OK;
            double t = cm_now_s() - t0;
            pinned = pinned < 0 || t < pinned ? t : pinned;
        }
        bad |= !locked;
        for (int k = 0; k < taps; k++)
            be->host_unpin(ctx, ans[k]);
    }
    /* the shard path: one encoded record per tap */
    cm_compress       *c1 = NULL, *cn = NULL;
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    if (cm_compress_create(&c1, &cc) != CM_OK)
        return 1;
    cc.n_threads = cm_chan_default_threads();
    if (cm_compress_create(&cn, &cc) != CM_OK)
        return 1;
    uint8_t **enc = calloc((size_t)taps, sizeof *enc);
    size_t   *len = calloc((size_t)taps, sizeof *len), enc_total = 0;
    uint8_t  *scratch = malloc((size_t)(T * D) * 2);
    if (!enc || !len || !scratch)
        return 1;
    for (int k = 0; k < taps; k++) {
        const size_t cap = cm_compress_bound(c1, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, T, D);
        enc[k] = malloc(cap);
        if (!enc[k] || cm_compress_encode(cn, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, ans[k], T, D, enc[k], cap,
                                          &len[k]) != CM_OK)
            return 1;
        enc_total += len[k];
    }
    double sbest[2] = {1e30, 1e30};
    for (int r = 0; r < reps; r++) {
        double t0 = cm_now_s();
        for (int k = 0; k < taps; k++) {
            bad |= cm_compress_decode(c1, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, enc[k], len[k], T, D, scratch,
                                      (size_t)(T * D) * 2) != CM_OK;
            for (int64_t t = 0; t < T; t++)
                cm_convert(F + t * W + k * D, CM_DTYPE_F32, (uint16_t *)scratch + t * D, CM_DTYPE_BF16, (size_t)D);
        }
        bad |= scan(F, T, taps, D);
        double t1 = cm_now_s();
        for (int k = 0; k < taps; k++) {
            int any_bad, zero;
            bad |= cm_compress_decode(cn, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, enc[k], len[k], T, D, ans[k],
                                      (size_t)(T * D) * 2) != CM_OK;
            cm_scan_values(CM_DTYPE_BF16, ans[k], (size_t)(T * D), &any_bad, &zero);
            bad |= any_bad || zero;
        }
        double t2 = cm_now_s();
        sbest[0] = t1 - t0 < sbest[0] ? t1 - t0 : sbest[0];
        sbest[1] = t2 - t1 < sbest[1] ? t2 - t1 : sbest[1];
    }
    const double mb = (double)(T * W) * 2 / 1e6;
    printf("## trainer host work per live answer: %lld tokens x %d taps x %lld (BF16 answer %.0f MB), best "
           "of %d, %s\n\n",
           (long long)T, taps, (long long)D, mb, reps, be->name);
    printf("| form | ms per step | host bytes moved | uploaded |\n| --- | ---: | ---: | ---: |\n");
    printf("| widened to F32, scanned, uploaded F32 (before) | %.1f | %.0f MB | %.0f MB |\n", best[0] * 1e3,
           mb + 2 * mb + 2 * mb + 2 * mb, 2 * mb);
    printf("| as sent: one upload per tap | %.1f | %.0f MB | %.0f MB |\n", best[1] * 1e3, mb, mb);
    if (pinned >= 0)
        printf("| as sent, from page-locked answers (now, %s) | %.1f | %.0f MB | %.0f MB |\n", be->name,
               pinned * 1e3, mb, mb);
    printf("\nratio %.1fx (before / as sent)%s\n", best[0] / best[1],
           pinned >= 0 ? "" : "; no page-locking on this backend");
    printf("\n## a shard record of the same taps (zstd-byteplane, %.0f MB stored): the loader thread's work\n\n",
           (double)enc_total / 1e6);
    printf("| form | ms per step | decode threads |\n| --- | ---: | ---: |\n");
    printf("| decoded, widened to F32, scanned (before) | %.1f | 1 |\n", sbest[0] * 1e3);
    printf("| decoded into the batch's tap arrays, scanned as BF16 (now) | %.1f | %d |\n", sbest[1] * 1e3,
           cm_chan_default_threads());
    printf("\nratio %.1fx; after either, the step uploads %.0f MB before and %.0f MB now%s\n", sbest[0] / sbest[1],
           2 * mb, mb, bad ? " (a decode, scan or upload failed)" : "");
    for (int k = 0; k < taps; k++)
        free(ans[k]), free(enc[k]);
    free(ans), free(enc), free(len), free(scratch);
    cm_compress_destroy(&c1);
    cm_compress_destroy(&cn);
    free(F);
    be->free(ctx, dev32);
    be->free(ctx, dev16);
    be->ctx_destroy(&ctx);
    return bad;
}
