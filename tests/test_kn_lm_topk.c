/* tests/test_kn_lm_topk.c — the cpu reference of lm_ce_topk (kn_backend.h, kn_lm_topk_params)
 * against a brute-force second implementation written here (the full [R, V] logits in double,
 * each row sorted by value, larger first, then lower index) on odd shapes (R 1, 7, 33; V from 1
 * to 300, V = K included; odd D), K in {1, 4, 16, 64}, F32 and BF16 weights. Planted exact ties
 * (equal rows of W, and an all-zero h row where every logit ties) must come lower index first,
 * also across the K-th place. ce, argmax and dh must be lm_ce's bits; bad K and missing outputs
 * are refused with their message. Label unit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"

#define TST_KN_SEED 0x6a09e667f3bcc909ull
#include "tst_kn.h"

static const kn_backend *be;
static kn_ctx           *ctx;

// ----------------------------------------------------------------------------
// the brute force

typedef struct ranked {
    double  v;
    int32_t i;
} ranked;

static int ranked_cmp(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Row r's logits sorted, and the label's logit (both in double). */
static void brute_row(const float *h, const float *wf, int64_t V, int64_t D, int32_t lab, ranked *out,
                      double *lab_logit) {
    for (int64_t v = 0; v < V; v++) {
        double s = 0;
        for (int64_t d = 0; d < D; d++)
            s += (double)h[d] * (double)wf[v * D + d];
        out[v] = (ranked){s, (int32_t)v};
        if (v == lab)
            *lab_logit = s;
    }
    qsort(out, (size_t)V, sizeof *out, ranked_cmp);
}

// ----------------------------------------------------------------------------
// one case

typedef struct topk_case {
    int64_t R, V, D;
} topk_case;

/* W with planted ties: rows 1, 2 and V − 1 equal, in [1.5, 2), and h row 0 equal to them, so
 * their logit Σ w² beats every other row's (|w| < 1: Σ h·w < Σ h ≤ Σ h²/1.5) and their order
 * is 1, 2, V − 1 whatever K cuts; h row 1 (when R > 1) all zero, so every logit is 0 and the
 * top-K is 0, 1, ..., K − 1. */
static void plant(float *h, float *wf, int64_t R, int64_t V, int64_t D) {
    if (V >= 4)
        for (int64_t d = 0; d < D; d++) {
            wf[1 * D + d] = (float)(1.5 + 0.5 * tst_urand());
            wf[2 * D + d] = wf[(V - 1) * D + d] = wf[1 * D + d];
            h[d] = wf[1 * D + d];
        }
    if (R > 1)
        for (int64_t d = 0; d < D; d++)
            h[D + d] = 0.0f;
}

static void run_case(const topk_case *c, int K, int w_bf16) {
    const int64_t R = c->R, V = c->V, D = c->D;
    float    *h = tst_rand_f32(R * D, -1, 1), *wf = tst_rand_f32(V * D, -1, 1), *gs = tst_rand_f32(R, 0.1, 2);
    uint16_t *w16 = tst_xcalloc((size_t)(V * D) * 2);
    int32_t  *lab = tst_xcalloc((size_t)R * 4);
    plant(h, wf, R, V, D);
    for (int64_t i = 0; i < V * D; i++) {
        w16[i] = tst_bf16_round(wf[i]);
        if (w_bf16)
            wf[i] = tst_bf16_widen(w16[i]); /* the values the reference sees */
    }
    for (int64_t r = 0; r < R; r++)
        lab[r] = (int32_t)((r * 7 + 3) % V);
    const void    *w = w_bf16 ? (const void *)w16 : (const void *)wf;
    const cm_dtype wdt = w_bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32;

    float *dh = tst_zeros_f32(R * D), *ce = tst_zeros_f32(R), *dh0 = tst_zeros_f32(R * D),
          *ce0 = tst_zeros_f32(R);
    float   *ce1 = tst_zeros_f32(R), *val = tst_zeros_f32(R * K), *ll = tst_zeros_f32(R);
    float   *val1 = tst_zeros_f32(R * K), *ll1 = tst_zeros_f32(R);
    int32_t *am = tst_xcalloc((size_t)R * 4), *am0 = tst_xcalloc((size_t)R * 4),
            *am1 = tst_xcalloc((size_t)R * 4);
    int32_t          *idx = tst_xcalloc((size_t)(R * K) * 4), *idx1 = tst_xcalloc((size_t)(R * K) * 4);
    kn_lm_topk_params p = {.R = R,
                           .V = V,
                           .D = D,
                           .K = K,
                           .h = h,
                           .labels = lab,
                           .gscale = gs,
                           .w = w,
                           .wdt = wdt,
                           .dh = dh,
                           .ce = ce,
                           .argmax = am,
                           .topk_idx = idx,
                           .topk_val = val,
                           .label_logit = ll};
    tst_ok(be->lm_ce_topk(ctx, &p), "lm_ce_topk");
    tst_ok(be->lm_ce(ctx, dh0, ce0, am0, h, lab, gs, w, wdt, R, V, D), "lm_ce");
    /* lm_ce's outputs, bit for bit; without dh (and gscale) the same ce, argmax and top-K */
    TST_CHECK(memcmp(ce, ce0, (size_t)R * 4) == 0);
    TST_CHECK(memcmp(am, am0, (size_t)R * 4) == 0);
    TST_CHECK(memcmp(dh, dh0, (size_t)(R * D) * 4) == 0);
    kn_lm_topk_params p1 = p;
    p1.dh = NULL, p1.gscale = NULL, p1.ce = ce1, p1.argmax = am1, p1.topk_idx = idx1, p1.topk_val = val1;
    p1.label_logit = ll1;
    tst_ok(be->lm_ce_topk(ctx, &p1), "lm_ce_topk without dh");
    TST_CHECK(memcmp(ce, ce1, (size_t)R * 4) == 0 && memcmp(am, am1, (size_t)R * 4) == 0);
    TST_CHECK(memcmp(idx, idx1, (size_t)(R * K) * 4) == 0 && memcmp(val, val1, (size_t)(R * K) * 4) == 0);
    TST_CHECK(memcmp(ll, ll1, (size_t)R * 4) == 0);

    /* against the brute force: the indices exactly, the values and the label logit as the
     * double rounded to float (up to an ulp for the different order of the dot's sum) */
    ranked *sorted = tst_xcalloc((size_t)V * sizeof(ranked));
    long    bad_idx = 0, bad_val = 0, bad_lab = 0;
    for (int64_t r = 0; r < R; r++) {
        double lab_logit = 0;
        brute_row(h + r * D, wf, V, D, lab[r], sorted, &lab_logit);
        for (int k = 0; k < K; k++) {
            const float want = (float)sorted[k].v, got = val[r * K + k];
            if (idx[r * K + k] != sorted[k].i) {
                if (bad_idx++ < 5)
                    fprintf(stderr, "  row %lld rank %d: index %d, brute force %d (%.17g vs %.17g)\n",
                            (long long)r, k, idx[r * K + k], sorted[k].i, got, sorted[k].v);
            }
            if (!(fabsf(got - want) <= 2e-7f * fabsf(want) + 1e-30f) && bad_val++ < 5)
                fprintf(stderr, "  row %lld rank %d: value %.9g, brute force %.9g\n", (long long)r, k, got,
                        want);
        }
        if (!(fabs((double)ll[r] - lab_logit) <= 2e-7 * fabs(lab_logit) + 1e-30) && bad_lab++ < 5)
            fprintf(stderr, "  row %lld: label logit %.9g, brute force %.9g\n", (long long)r, ll[r],
                    lab_logit);
    }
    TST_CHECK(bad_idx == 0 && bad_val == 0 && bad_lab == 0);
    /* the planted ties, spelled out */
    int ties_ok = 1;
    if (V >= 4) {
        const int32_t want[3] = {1, 2, (int32_t)(V - 1)};
        for (int k = 0; k < K && k < 3; k++)
            ties_ok &= idx[k] == want[k] && val[k] == val[0];
    }
    if (R > 1)
        for (int k = 0; k < K; k++)
            ties_ok &= idx[K + k] == k && val[K + k] == 0.0f;
    TST_CHECK(ties_ok);
    printf("lm_topk R=%-3lld V=%-4lld D=%-3lld K=%-2d W=%-4s %ld wrong indices, %ld wrong values, %ld wrong "
           "label "
           "logits, ties %s, lm_ce bits %s\n",
           (long long)R, (long long)V, (long long)D, K, w_bf16 ? "BF16" : "F32", bad_idx, bad_val, bad_lab,
           ties_ok ? "ok" : "WRONG",
           memcmp(ce, ce0, (size_t)R * 4) == 0 && memcmp(am, am0, (size_t)R * 4) == 0 &&
                   memcmp(dh, dh0, (size_t)(R * D) * 4) == 0
               ? "same"
               : "DIFFER");
    free(sorted);
    free(h), free(wf), free(gs), free(w16), free(lab), free(dh), free(ce), free(dh0), free(ce0), free(ce1);
    free(val), free(ll), free(val1), free(ll1), free(am), free(am0), free(am1), free(idx), free(idx1);
}

// ----------------------------------------------------------------------------
// bad arguments

static void test_bad_args(void) {
    float             buf[64] = {0};
    int32_t           ibuf[64] = {0};
    kn_lm_topk_params good = {.R = 2,
                              .V = 8,
                              .D = 4,
                              .K = 4,
                              .h = buf,
                              .labels = ibuf,
                              .gscale = buf,
                              .w = buf,
                              .wdt = CM_DTYPE_F32,
                              .dh = buf + 32,
                              .ce = buf + 40,
                              .argmax = ibuf + 8,
                              .topk_idx = ibuf + 16,
                              .topk_val = buf + 48,
                              .label_logit = buf + 56};
    TST_CHECK(tst_ok(be->lm_ce_topk(ctx, &good), "lm_ce_topk good"));
    kn_lm_topk_params p = good;
    p.K = 0;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "lm_ce_topk: K=0 is outside [1, KN_TOPK_MAX=64]");
    p.K = 65, p.V = 100;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "lm_ce_topk: K=65 is outside [1, KN_TOPK_MAX=64]");
    p = good, p.K = 9;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "lm_ce_topk: K=9 exceeds the vocabulary size V=8");
    p = good, p.K = 0, p.R = 0; /* K is checked even when there are no rows */
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "K=0");
    p = good, p.R = 0, p.topk_idx = NULL;
    TST_CHECK(tst_ok(be->lm_ce_topk(ctx, &p), "lm_ce_topk R=0"));
    p = good, p.topk_val = NULL;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "topk_idx, topk_val or label_logit is NULL");
    p = good, p.label_logit = NULL;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "topk_idx, topk_val or label_logit is NULL");
    p = good, p.gscale = NULL;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG, "lm_ce_topk: gscale is NULL but dh is requested");
    p = good, ibuf[1] = 8;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_INVALID_ARG,
              "lm_ce_topk: label 8 of row 1 is outside [0, V=8)");
    ibuf[1] = 0;
    p = good, p.wdt = CM_DTYPE_I32;
    TST_FAILS(be->lm_ce_topk(ctx, &p), CM_ERR_UNSUPPORTED, "lm_ce_topk: weight dtype");
    TST_FAILS(be->lm_ce_topk(ctx, NULL), CM_ERR_INVALID_ARG, "lm_ce_topk: params are NULL");
    /* lm_ce keeps its own name in its messages */
    TST_FAILS(be->lm_ce(ctx, buf, buf, ibuf, buf, ibuf, NULL, buf, CM_DTYPE_F32, 2, 8, 4), CM_ERR_INVALID_ARG,
              "lm_ce: gscale is NULL but dh is requested");
}

int main(void) {
    be = kn_backend_cpu();
    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    if (be->ctx_create(&ctx, &cfg) != CM_OK) {
        fprintf(stderr, "cannot create a cpu context: %s\n", cm_last_error());
        return 1;
    }
    static const topk_case cases[] = {
        {1, 1, 1},                  /* one logit: K = V = 1 */
        {1, 300, 7},                /* one row */
        {7, 300, 5},                /* a partial row chunk */
        {7, 16, 3},                 /* V = K = 16 */
        {33, 64, 9},                /* several row chunks; V = K = 64 */
        {33, 257, 13}, {7, 131, 1}, /* D = 1 */
        {33, 299, 31},
    };
    static const int ks[] = {1, 4, 16, 64};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (size_t j = 0; j < sizeof ks / sizeof ks[0]; j++)
            for (int bf = 0; bf < 2; bf++)
                if (ks[j] <= cases[i].V)
                    run_case(&cases[i], ks[j], bf);
    test_bad_args();
    be->ctx_destroy(&ctx);
    return tst_report();
}
