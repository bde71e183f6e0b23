/* tests/test_kn_cuda_lm_topk.c — the CUDA lm_ce_topk (kernels/kn_lm_ce.cu) against the cpu
 * reference through the kn_backend tables, in both GEMM modes, on odd shapes: one logit; a few
 * rows; K = V; R > 2048 (two row tiles) with V large enough for several vocabulary chunks of
 * 8192 (a last chunk narrower than K included); logits that grow with the index (every chunk
 * overturns the running list: the worst case of the merge); equal rows of W in three chunks and
 * all-zero rows of h (exact ties, lower index first). Per row and rank k:
 * - the list itself: indices in [0, V) and distinct, values non-increasing, equal values in
 *   ascending index order (the kernel's order on its own fp32 logits);
 * - values within tol of the reference's, tol = c·Σ_d |h_d|·max|W| (a bound of Σ|h·w|, the
 *   rounding scale of a logit): c = 1e-5 in F32 mode (fp32 products and sums), 1e-2 in BF16 mode
 *   (h and W rounded to 8 bits of mantissa); the label logit likewise;
 * - the returned index's logit (in double on the host) within tol of the reference's value at
 *   that rank, so a swap is only ever between near-equal logits;
 * - F32 mode: the index equal to the reference's wherever the reference's value at k is more
 *   than tol from its neighbours at k − 1 and k + 1 (k = K: the (K+1)-th logit);
 * - ce, argmax and dh: lm_ce's bits on the same context (and ce near the reference's);
 * - a second run: every output bit-identical.
 * Then bad K refused with the cpu's message, and, informational (not a verdict), the time of
 * lm_ce and lm_ce_topk at the training shape R 7680 (tiles of 2048), V 248320, D 5120, K 16.
 * Label gpu; exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kn_backend.h"
#include "tst.h"

#define TST_KN_SEED 0xbb67ae8584caa73bull
#include "tst_kn.h"
#include "tst_kn_pair.h"

// ----------------------------------------------------------------------------
// inputs

typedef enum topk_layout {
    LAYOUT_RANDOM = 0, /* h and W uniform in [-1, 1) */
    LAYOUT_ASCENDING,  /* W[v] = u·(v + 1)/V: a row's logits grow (or fall) with v */
    LAYOUT_TIES,       /* random, plus W[77] = W[8269] = W[16461] dominant for h rows 0..9, and
                        * h rows 10..19 zero (every logit 0: the top-K is 0, 1, ..., K − 1) */
} topk_layout;

static const char *layout_name[] = {"random", "ascending", "ties"};

typedef struct topk_case {
    long        R, V, D;
    int         K, w_bf16, with_dh;
    topk_layout layout;
} topk_case;

static void make_inputs(const topk_case *c, float *h, float *wf) {
    const long R = c->R, V = c->V, D = c->D;
    tst_fill(h, R * D, -1, 1);
    tst_fill(wf, V * D, -1, 1);
    if (c->layout == LAYOUT_ASCENDING) {
        float *u = tst_rand_f32(D, -1, 1);
        for (long v = 0; v < V; v++)
            for (long d = 0; d < D; d++)
                wf[v * D + d] = u[d] * (float)(v + 1) / (float)V;
        free(u);
    } else if (c->layout == LAYOUT_TIES) {
        const long tied[3] = {77, 8192 + 77, 16384 + 77};
        for (long d = 0; d < D; d++) {
            const float x = (float)(1.5 + 0.5 * tst_urand()); /* |other w| < 1 ≤ x: dominant */
            for (int j = 0; j < 3; j++)
                if (tied[j] < V)
                    wf[tied[j] * D + d] = x;
            for (long r = 0; r < 10 && r < R; r++)
                h[r * D + d] = x;
        }
        for (long r = 10; r < 20 && r < R; r++)
            for (long d = 0; d < D; d++)
                h[r * D + d] = 0.0f;
    }
}

// ----------------------------------------------------------------------------
// one case

typedef struct topk_out {
    float   *ce, *dh, *val, *ll;
    int32_t *am, *idx;
} topk_out;

static topk_out out_new(long R, long D, int K) {
    topk_out o = {tst_zeros_f32(R), tst_zeros_f32(R * D),       tst_zeros_f32(R * K),
                  tst_zeros_f32(R), tst_xcalloc((size_t)R * 4), tst_xcalloc((size_t)(R * K) * 4)};
    return o;
}

static void out_free(topk_out *o) {
    free(o->ce), free(o->dh), free(o->val), free(o->ll), free(o->am), free(o->idx);
}

static void download(kn_ctx *ctx, const kn_backend *be, void *dst, const void *src, size_t bytes) {
    if (be->sync(ctx) != CM_OK || be->download(ctx, dst, src, bytes) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

/* The device buffers of one call's outputs, on both backends. */
typedef struct topk_bufs {
    dbuf ce, dh, val, ll, am, idx;
} topk_bufs;

static void fetch(kn_ctx *ctx, const kn_backend *be, int gpu_side, const topk_bufs *b, topk_out *o, long R,
                  long D, int K) {
#define SIDE(x) (gpu_side ? b->x.g : b->x.c)
    download(ctx, be, o->ce, SIDE(ce), (size_t)R * 4);
    download(ctx, be, o->dh, SIDE(dh), (size_t)(R * D) * 4);
    download(ctx, be, o->val, SIDE(val), (size_t)(R * K) * 4);
    download(ctx, be, o->ll, SIDE(ll), (size_t)R * 4);
    download(ctx, be, o->am, SIDE(am), (size_t)R * 4);
    download(ctx, be, o->idx, SIDE(idx), (size_t)(R * K) * 4);
#undef SIDE
}

static int same_bits(const topk_out *a, const topk_out *b, long R, long D, int K, int with_dh) {
    return memcmp(a->ce, b->ce, (size_t)R * 4) == 0 && memcmp(a->am, b->am, (size_t)R * 4) == 0 &&
           (!with_dh || memcmp(a->dh, b->dh, (size_t)(R * D) * 4) == 0) &&
           memcmp(a->val, b->val, (size_t)(R * K) * 4) == 0 &&
           memcmp(a->idx, b->idx, (size_t)(R * K) * 4) == 0 && memcmp(a->ll, b->ll, (size_t)R * 4) == 0;
}

static double dot_d(const float *a, const float *b, long n) {
    double s = 0;
    for (long i = 0; i < n; i++)
        s += (double)a[i] * (double)b[i];
    return s;
}

static void run_case(const topk_case *c) {
    const long R = c->R, V = c->V, D = c->D;
    const int  K = c->K;
    float     *h = tst_zeros_f32(R * D), *wf = tst_zeros_f32(V * D), *gs = tst_rand_f32(R, 0.1, 2);
    uint16_t  *w16 = tst_xcalloc((size_t)(V * D) * 2);
    int32_t   *lab = tst_xcalloc((size_t)R * 4);
    make_inputs(c, h, wf);
    for (long i = 0; i < V * D; i++) {
        w16[i] = tst_bf16_round(wf[i]);
        if (c->w_bf16)
            wf[i] = tst_bf16_widen(w16[i]); /* the host copy holds what the kernels see */
    }
    for (long r = 0; r < R; r++)
        lab[r] = (int32_t)(tst_urand() * (double)V);
    lab[R - 1] = (int32_t)(V - 1);
    const cm_dtype    wdt = c->w_bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    dbuf              bh = dbuf_put(h, (size_t)(R * D) * 4), bl = dbuf_put(lab, (size_t)R * 4);
    dbuf              bg = dbuf_put(gs, (size_t)R * 4);
    dbuf              bw = c->w_bf16 ? dbuf_put(w16, (size_t)(V * D) * 2) : dbuf_put(wf, (size_t)(V * D) * 4);
    topk_bufs         b = {dbuf_put(NULL, (size_t)R * 4),       dbuf_put(NULL, (size_t)(R * D) * 4),
                           dbuf_put(NULL, (size_t)(R * K) * 4), dbuf_put(NULL, (size_t)R * 4),
                           dbuf_put(NULL, (size_t)R * 4),       dbuf_put(NULL, (size_t)(R * K) * 4)};
    kn_lm_topk_params pc = {.R = R,
                            .V = V,
                            .D = D,
                            .K = K,
                            .wdt = wdt,
                            .h = bh.c,
                            .labels = bl.c,
                            .gscale = bg.c,
                            .w = bw.c,
                            .dh = c->with_dh ? b.dh.c : NULL,
                            .ce = b.ce.c,
                            .argmax = b.am.c,
                            .topk_idx = b.idx.c,
                            .topk_val = b.val.c,
                            .label_logit = b.ll.c};
    kn_lm_topk_params pg = {.R = R,
                            .V = V,
                            .D = D,
                            .K = K,
                            .wdt = wdt,
                            .h = bh.g,
                            .labels = bl.g,
                            .gscale = bg.g,
                            .w = bw.g,
                            .dh = c->with_dh ? b.dh.g : NULL,
                            .ce = b.ce.g,
                            .argmax = b.am.g,
                            .topk_idx = b.idx.g,
                            .topk_val = b.val.g,
                            .label_logit = b.ll.g};
    topk_out          ref = out_new(R, D, K), got = out_new(R, D, K), again = out_new(R, D, K),
             base = out_new(R, D, K);
    tst_ok(cpu->lm_ce_topk(cctx, &pc), "cpu lm_ce_topk");
    fetch(cctx, cpu, 0, &b, &ref, R, D, K);

    /* per row: the rounding scale of a logit, and the reference's (K+1)-th logit (host, double) */
    double *scale = tst_xcalloc((size_t)R * 8), *next = tst_xcalloc((size_t)R * 8);
    double  wmax = tst_max_abs(wf, V * D);
    char   *in_ref = tst_xcalloc((size_t)V);
    for (long r = 0; r < R; r++) {
        double sh = 0;
        for (long d = 0; d < D; d++)
            sh += fabs((double)h[r * D + d]);
        scale[r] = sh * wmax + 1e-30;
        for (int k = 0; k < K; k++)
            in_ref[ref.idx[r * K + k]] = 1;
        next[r] = -INFINITY;
        for (long v = 0; v < V; v++)
            if (!in_ref[v]) {
                const double l = dot_d(h + r * D, wf + v * D, D);
                next[r] = l > next[r] ? l : next[r];
            }
        for (int k = 0; k < K; k++)
            in_ref[ref.idx[r * K + k]] = 0;
    }

    for (int mode = 0; mode < 2; mode++) {
        kn_ctx      *g = mode ? gctx16 : gctx;
        const double cm = mode ? 1e-2 : 1e-5;
        tst_ok(gpu->lm_ce_topk(g, &pg), "cuda lm_ce_topk");
        fetch(g, gpu, 1, &b, &got, R, D, K);
        tst_ok(gpu->lm_ce_topk(g, &pg), "cuda lm_ce_topk again");
        fetch(g, gpu, 1, &b, &again, R, D, K);
        tst_ok(gpu->lm_ce(g, pg.dh, b.ce.g, b.am.g, bh.g, bl.g, bg.g, bw.g, wdt, R, V, D), "cuda lm_ce");
        fetch(g, gpu, 1, &b, &base, R, D, K); /* its top-K buffers are left as the last call wrote them */
        memcpy(base.val, got.val, (size_t)(R * K) * 4);
        memcpy(base.idx, got.idx, (size_t)(R * K) * 4);
        memcpy(base.ll, got.ll, (size_t)R * 4);
        const int repeat_ok = same_bits(&got, &again, R, D, K, c->with_dh);
        const int lmce_ok = same_bits(&got, &base, R, D, K, c->with_dh);
        TST_CHECK(repeat_ok);
        TST_CHECK(lmce_ok);

        long   bad_list = 0, exact = 0, near = 0, wrong = 0, bad_val = 0, bad_lab = 0, bad_pick = 0;
        double worst_val = 0, worst_lab = 0, worst_pick = 0;
        for (long r = 0; r < R; r++) {
            const float   *gv = got.val + r * K, *rv = ref.val + r * K;
            const int32_t *gi = got.idx + r * K, *ri = ref.idx + r * K;
            const double   tol = cm * scale[r];
            for (int k = 0; k < K; k++) { /* the list is a list */
                int ok = gi[k] >= 0 && gi[k] < V && !isnan(gv[k]);
                for (int j = 0; ok && j < k; j++)
                    ok = gi[j] != gi[k];
                if (ok && k > 0)
                    ok = gv[k - 1] > gv[k] || (gv[k - 1] == gv[k] && gi[k - 1] < gi[k]);
                if (!ok && bad_list++ < 5)
                    fprintf(stderr, "  row %ld rank %d: (%d, %.9g) breaks the list's order or range\n", r, k,
                            gi[k], gv[k]);
            }
            for (int k = 0; k < K; k++) {
                const double dv = fabs((double)gv[k] - (double)rv[k]) / tol;
                worst_val = dv > worst_val || isnan(dv) ? (isnan(dv) ? INFINITY : dv) : worst_val;
                if (!(dv <= 1) && bad_val++ < 5)
                    fprintf(stderr, "  row %ld rank %d: value %.9g, reference %.9g (tol %.3g)\n", r, k, gv[k],
                            rv[k], tol);
                const double pick = gi[k] >= 0 && gi[k] < V ? dot_d(h + r * D, wf + (long)gi[k] * D, D) : NAN;
                const double dp = fabs(pick - (double)rv[k]) / tol;
                worst_pick = dp > worst_pick || isnan(dp) ? (isnan(dp) ? INFINITY : dp) : worst_pick;
                if (!(dp <= 1) && bad_pick++ < 5)
                    fprintf(stderr,
                            "  row %ld rank %d: index %d has logit %.9g, the reference's value %.9g\n", r, k,
                            gi[k], pick, rv[k]);
                const double up = k > 0 ? (double)rv[k - 1] : INFINITY,
                             down = k + 1 < K ? (double)rv[k + 1] : next[r];
                if (up - rv[k] > tol && rv[k] - down > tol) {
                    if (gi[k] == ri[k])
                        exact++;
                    else if (mode == 1)
                        near++; /* bf16 rounding may reorder what fp32 separates: the value checks decide */
                    else if (wrong++ < 5)
                        fprintf(stderr, "  row %ld rank %d: index %d, reference %d (separated by > %.3g)\n",
                                r, k, gi[k], ri[k], tol);
                } else {
                    exact += gi[k] == ri[k];
                    near += gi[k] != ri[k];
                }
            }
            const double dl = fabs((double)got.ll[r] - (double)ref.ll[r]) / tol;
            worst_lab = dl > worst_lab || isnan(dl) ? (isnan(dl) ? INFINITY : dl) : worst_lab;
            if (!(dl <= 1) && bad_lab++ < 5)
                fprintf(stderr, "  row %ld: label logit %.9g, reference %.9g\n", r, got.ll[r], ref.ll[r]);
        }
        if (wrong > 5)
            fprintf(stderr, "  ... %ld wrong indices in all\n", wrong);
        TST_CHECK(bad_list == 0 && bad_val == 0 && bad_pick == 0 && wrong == 0 && bad_lab == 0);
        /* the planted ties: the tied rows first (as a set), zero rows give 0..K-1 exactly */
        int ties_ok = 1;
        if (c->layout == LAYOUT_TIES) {
            long n_tied = 0;
            for (long j = 77; j < V && j < 16384 + 78; j += 8192)
                n_tied++;
            for (long r = 0; r < 10 && r < R; r++)
                for (int k = 0; k < K && k < n_tied; k++)
                    ties_ok &= got.idx[r * K + k] % 8192 == 77;
            for (long r = 10; r < 20 && r < R; r++)
                for (int k = 0; k < K; k++)
                    ties_ok &= got.idx[r * K + k] == k && got.val[r * K + k] == 0.0f;
            TST_CHECK(ties_ok);
        }
        printf(
            "lm_topk %s-mode R=%ld V=%ld D=%ld K=%d W=%s %s%s: values err/tol %.3f, picks err/tol %.3f, "
            "label "
            "err/tol %.3f; indices %ld equal, %ld near-tie swaps, %ld wrong; list order %s%s; lm_ce bits %s; "
            "repeat %s  %s\n",
            mode ? "BF16" : "F32", R, V, D, K, c->w_bf16 ? "BF16" : "F32", layout_name[c->layout],
            c->with_dh ? " +dh" : "", worst_val, worst_pick, worst_lab, exact, near, wrong,
            bad_list ? "BAD" : "ok", c->layout == LAYOUT_TIES ? (ties_ok ? ", ties ok" : ", ties WRONG") : "",
            lmce_ok ? "same" : "DIFFER", repeat_ok ? "bit-identical" : "DIFFERS",
            bad_list || bad_val || bad_pick || wrong || bad_lab || !ties_ok || !lmce_ok || !repeat_ok ? "FAIL"
                                                                                                      : "ok");
        /* ce near the reference's, as test_kn_cuda_drafter checks lm_ce */
        char   name[128];
        double smax = 0;
        for (long r = 0; r < R; r++)
            smax = scale[r] > smax ? scale[r] : smax;
        snprintf(name, sizeof name, "lm_topk %s-mode ce R=%ld V=%ld K=%d", mode ? "BF16" : "F32", R, V, K);
        tst_compare(name, 64, got.ce, ref.ce, R, cm * smax, mode ? 2e-2 : 1e-5, NULL);
    }
    dbuf *all[] = {&bh, &bl, &bg, &bw, &b.ce, &b.dh, &b.val, &b.ll, &b.am, &b.idx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
    out_free(&ref), out_free(&got), out_free(&again), out_free(&base);
    free(h), free(wf), free(gs), free(w16), free(lab), free(scale), free(next), free(in_ref);
}

// ----------------------------------------------------------------------------
// bad arguments

static void test_bad_args(void) {
    void *buf = NULL;
    if (!tst_ok(gpu->alloc(gctx, &buf, 4096), "cuda alloc"))
        return;
    kn_lm_topk_params good = {.R = 2,
                              .V = 8,
                              .D = 4,
                              .K = 4,
                              .h = buf,
                              .labels = buf,
                              .gscale = buf,
                              .w = buf,
                              .wdt = CM_DTYPE_F32,
                              .dh = NULL,
                              .ce = buf,
                              .argmax = buf,
                              .topk_idx = buf,
                              .topk_val = buf,
                              .label_logit = buf};
    kn_lm_topk_params p = good;
    p.K = 0;
    TST_FAILS(gpu->lm_ce_topk(gctx, &p), CM_ERR_INVALID_ARG,
              "lm_ce_topk: K=0 is outside [1, KN_TOPK_MAX=64]");
    p.K = 65, p.V = 100;
    TST_FAILS(gpu->lm_ce_topk(gctx, &p), CM_ERR_INVALID_ARG,
              "lm_ce_topk: K=65 is outside [1, KN_TOPK_MAX=64]");
    p = good, p.K = 9;
    TST_FAILS(gpu->lm_ce_topk(gctx, &p), CM_ERR_INVALID_ARG,
              "lm_ce_topk: K=9 exceeds the vocabulary size V=8");
    p = good, p.topk_val = NULL;
    TST_FAILS(gpu->lm_ce_topk(gctx, &p), CM_ERR_INVALID_ARG, "topk_idx, topk_val or label_logit is NULL");
    p = good, p.dh = buf;
    p.gscale = NULL;
    TST_FAILS(gpu->lm_ce_topk(gctx, &p), CM_ERR_INVALID_ARG,
              "lm_ce_topk: gscale is NULL but dh is requested");
    TST_FAILS(gpu->lm_ce_topk(gctx, NULL), CM_ERR_INVALID_ARG, "lm_ce_topk: params are NULL");
    p = good, p.R = 0;
    TST_CHECK(tst_ok(gpu->lm_ce_topk(gctx, &p), "cuda lm_ce_topk R=0"));
    printf("%-64s %s\n", "lm_topk bad K and NULL outputs refused", "checked");
    gpu->free(gctx, buf);
}

// ----------------------------------------------------------------------------
// timing at the training shape (informational)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void time_training_shape(void) {
    const int64_t R = 7680, V = 248320, D = 5120;
    const int     K = 16;
    float        *h = NULL, *gs = NULL, *dh = NULL, *ce = NULL, *val = NULL, *ll = NULL;
    int32_t      *lab = NULL, *am = NULL, *idx = NULL;
    void         *w = NULL;
    int32_t      *hlab = tst_xcalloc((size_t)R * 4);
    float        *hgs = tst_xcalloc((size_t)R * 4);
    for (int64_t r = 0; r < R; r++)
        hlab[r] = (int32_t)(tst_urand() * (double)V), hgs[r] = 1.0f / (float)R;
    kn_ctx *g = gctx16;
    if (gpu->alloc(g, (void **)&h, (size_t)(R * D) * 4) != CM_OK ||
        gpu->alloc(g, (void **)&dh, (size_t)(R * D) * 4) != CM_OK ||
        gpu->alloc(g, &w, (size_t)(V * D) * 2) != CM_OK ||
        gpu->alloc(g, (void **)&gs, (size_t)R * 4) != CM_OK ||
        gpu->alloc(g, (void **)&ce, (size_t)R * 4) != CM_OK ||
        gpu->alloc(g, (void **)&ll, (size_t)R * 4) != CM_OK ||
        gpu->alloc(g, (void **)&lab, (size_t)R * 4) != CM_OK ||
        gpu->alloc(g, (void **)&am, (size_t)R * 4) != CM_OK ||
        gpu->alloc(g, (void **)&val, (size_t)(R * K) * 4) != CM_OK ||
        gpu->alloc(g, (void **)&idx, (size_t)(R * K) * 4) != CM_OK ||
        gpu->upload(g, lab, hlab, (size_t)R * 4) != CM_OK ||
        gpu->upload(g, gs, hgs, (size_t)R * 4) != CM_OK ||
        gpu->fill_uniform(g, h, CM_DTYPE_F32, R * D, 1, -1.0f, 1.0f) != CM_OK ||
        gpu->fill_uniform(g, w, CM_DTYPE_BF16, V * D, 2, -0.03f, 0.03f) != CM_OK || gpu->sync(g) != CM_OK) {
        printf("lm_topk timing skipped: %s\n", cm_last_error());
        goto done;
    }
    for (int with_dh = 1; with_dh >= 0; with_dh--) {
        kn_lm_topk_params p = {.R = R,
                               .V = V,
                               .D = D,
                               .K = K,
                               .h = h,
                               .labels = lab,
                               .gscale = gs,
                               .w = w,
                               .wdt = CM_DTYPE_BF16,
                               .dh = with_dh ? dh : NULL,
                               .ce = ce,
                               .argmax = am,
                               .topk_idx = idx,
                               .topk_val = val,
                               .label_logit = ll};
        enum { REPS = 3 };
        double t_ce[REPS], t_tk[REPS];
        for (int rep = -1; rep < REPS; rep++) { /* rep −1 warms up (plans, scratch) */
            double t0 = now_s();
            if (!tst_ok(gpu->lm_ce(g, p.dh, ce, am, h, lab, gs, w, CM_DTYPE_BF16, R, V, D),
                        "lm_ce (timing)") ||
                !tst_ok(gpu->sync(g), "sync"))
                goto done;
            double t1 = now_s();
            if (!tst_ok(gpu->lm_ce_topk(g, &p), "lm_ce_topk (timing)") || !tst_ok(gpu->sync(g), "sync"))
                goto done;
            double t2 = now_s();
            if (rep >= 0)
                t_ce[rep] = t1 - t0, t_tk[rep] = t2 - t1;
        }
        qsort(t_ce, REPS, sizeof t_ce[0], cmp_double);
        qsort(t_tk, REPS, sizeof t_tk[0], cmp_double);
        const double a = t_ce[REPS / 2], b = t_tk[REPS / 2];
        printf("lm_topk timing BF16-mode R=%lld V=%lld D=%lld K=%d W=BF16 %s (median of %d): lm_ce %.2f ms, "
               "lm_ce_topk %.2f ms (%+.2f%%)\n",
               (long long)R, (long long)V, (long long)D, K, with_dh ? "ce+dh" : "ce only", REPS, a * 1e3,
               b * 1e3, 100.0 * (b - a) / a);
    }
done:
    gpu->free(g, h), gpu->free(g, dh), gpu->free(g, w), gpu->free(g, gs), gpu->free(g, ce), gpu->free(g, ll);
    gpu->free(g, lab), gpu->free(g, am), gpu->free(g, val), gpu->free(g, idx);
    free(hlab), free(hgs);
}

int main(void) {
    if (!tst_pair_open())
        return tst_report();
    static const topk_case cases[] = {
        /* R     V      D   K  bf16 dh  layout */
        {1, 1, 1, 1, 0, 1, LAYOUT_RANDOM},            /* one logit */
        {7, 300, 33, 16, 0, 1, LAYOUT_RANDOM},        /* a few rows, one chunk */
        {33, 64, 17, 64, 1, 1, LAYOUT_RANDOM},        /* K = V = KN_TOPK_MAX */
        {300, 9000, 8, 1, 1, 0, LAYOUT_RANDOM},       /* K = 1, one wide chunk */
        {2100, 20011, 16, 16, 1, 1, LAYOUT_RANDOM},   /* tiles 2048 + 52; chunks 8192, 8192, 3627 */
        {2100, 8197, 24, 64, 0, 0, LAYOUT_RANDOM},    /* a last chunk of 5 columns < K */
        {2049, 16411, 20, 5, 0, 1, LAYOUT_ASCENDING}, /* every chunk overturns the list; tiles 2048 + 1 */
        {2100, 24600, 16, 16, 0, 1, LAYOUT_TIES},     /* equal logits in three chunks; zero rows */
        {2100, 24600, 12, 3, 1, 0, LAYOUT_TIES},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
    test_bad_args();
    time_training_shape();
    tst_pair_close();
    return tst_report();
}
