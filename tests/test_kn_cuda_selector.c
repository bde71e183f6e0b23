/* tests/test_kn_cuda_selector.c — the CUDA candidate selector (kn_selector.cu) against the cpu
 * reference, forward and backward, on odd shapes (n 1, 37, 3001; K 4, 16, 64; Rk 1, 33, 256; small
 * vocabularies where a few ids fill thousands of candidate slots, so runs of contributions cross
 * many reduction tiles, and the full 248320 one), then a timing line at the training shape.
 * Exact: cand, lab_pos; choice except near-ties (the two scores within their tolerance); rows of
 * dP and dS that no pred or cand names keep their sentinel bits on both backends; a second
 * backward gives the same bits, and one without dh the same du, dP, dS. Tolerances, fp32 sums
 * against double ones, each as a fraction of the element's Σ|term| bound (meaningful near 0):
 *   score 1e-5 of |z| + Σ_r |P·u·S|; ce 3e-5 of max_c(score bound) + 1 (two scores and the lse);
 *   du, dh, dP, dS 1e-5 of their sums with |d[i, c]| widened by gscale_i (the absolute error of
 *   an fp32 softmax), plus |old value| for the += outputs.
 * Ids outside [0, V) give NaN and no fault on cuda. Label gpu; exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

typedef struct {
    const char *name;
    int         n, K, Rk, D, V;
    kn_sel_miss miss;
    int         bf16; /* LM head in BF16 */
    double      skew; /* ids drawn as V·u^skew: 1 uniform, larger piles them on the low ids */
} sel_case;

#define W_NAME 84

static int32_t draw_id(int V, double skew) {
    const int v = (int)(V * pow(tst_urand(), skew));
    return v < V ? v : V - 1;
}

static int in_row(const int32_t *row, int k, int32_t v) {
    for (int c = 0; c < k; c++)
        if (row[c] == v)
            return 1;
    return 0;
}

/* Top-K ids distinct per row (skewed), labels at slot 0, the middle, K − 1 or absent by i % 5,
 * row 5 one id K times (all scores tie), pred skewed, gscale 0 on row 6. */
static void make_ids(const sel_case *c, int32_t *topk, int32_t *labels, int32_t *pred, float *gscale) {
    for (int i = 0; i < c->n; i++) {
        int32_t *row = topk + (long)i * c->K;
        for (int k = 0; k < c->K; k++) {
            int32_t v = draw_id(c->V, c->skew);
            while (in_row(row, k, v))
                v = (v + 1) % c->V;
            row[k] = v;
        }
        const int where = i % 5, pos = where == 0 ? 0 : where == 1 ? c->K / 2 : c->K - 1;
        if (where <= 2 || c->V == c->K)
            labels[i] = row[pos];
        else {
            int32_t v = draw_id(c->V, c->skew);
            while (in_row(row, c->K, v))
                v = (v + 1) % c->V;
            labels[i] = v;
        }
        if (i == 5)
            for (int k = 0; k < c->K; k++)
                row[k] = labels[i];
        pred[i] = draw_id(c->V, c->skew);
        gscale[i] = i == 6 ? 0.0f : (float)(0.3 + tst_urand());
    }
}

static void get(const kn_backend *be, kn_ctx *ctx, void *host, const void *src, size_t bytes) {
    if (be->sync(ctx) != CM_OK || be->download(ctx, host, src, bytes) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

static void put(void *dst_g, void *dst_c, const void *host, size_t bytes) {
    if ((dst_g && gpu->upload(gctx, dst_g, host, bytes) != CM_OK) ||
        (dst_c && cpu->upload(cctx, dst_c, host, bytes) != CM_OK)) {
        fprintf(stderr, "upload failed: %s\n", cm_last_error());
        exit(1);
    }
}

/* Runs one case on both backends and compares. */
static void run_case(const sel_case *c) {
    const long n = c->n, K = c->K, Rk = c->Rk, D = c->D, V = c->V, nk = n * K;
    char       name[160];
    snprintf(name, sizeof name, "selector %s (n %ld K %ld Rk %ld D %ld V %ld %s %s)", c->name, n, K, Rk, D, V,
             c->miss == KN_SEL_INJECT ? "inject" : "drop", c->bf16 ? "bf16" : "f32");
    printf("%s\n", name);
    int32_t *topk = tst_xcalloc(4 * (size_t)nk), *labels = tst_xcalloc(4 * (size_t)n),
            *pred = tst_xcalloc(4 * (size_t)n);
    float *gscale = tst_zeros_f32(n);
    make_ids(c, topk, labels, pred, gscale);
    float *tv = tst_rand_f32(nk, -2, 2), *ll = tst_rand_f32(n, -2, 2), *u = tst_rand_f32(n * Rk, -1, 1);
    float *P = tst_rand_f32(V * Rk, -1, 1), *S = tst_rand_f32(V * Rk, -1, 1),
          *wf = tst_rand_f32(V * D, -1, 1);
    uint16_t *w16 = tst_xcalloc(2 * (size_t)V * D);
    for (long e = 0; e < V * D; e++) {
        w16[e] = tst_bf16_round(wf[e]);
        wf[e] = c->bf16 ? tst_bf16_widen(w16[e]) : wf[e];
    }
    /* dP, dS start as a sentinel: nowhere 0, small beside the sums (it widens their bounds) */
    float *sent = tst_zeros_f32(V * Rk), *dh0 = tst_rand_f32(n * D, -1, 1),
          *junk = tst_rand_f32(n * Rk, 5, 6);
    for (long e = 0; e < V * Rk; e++)
        sent[e] = (float)(0.01 * (double)(e % 97 - 48) + 0.00123);

    dbuf btk = dbuf_put(topk, 4 * nk), btv = dbuf_put(tv, 4 * nk), bll = dbuf_put(ll, 4 * n);
    dbuf blab = dbuf_put(labels, 4 * n), bpred = dbuf_put(pred, 4 * n), bu = dbuf_put(u, 4 * n * Rk);
    dbuf bP = dbuf_put(P, 4 * V * Rk), bS = dbuf_put(S, 4 * V * Rk), bgs = dbuf_put(gscale, 4 * n);
    dbuf bw = c->bf16 ? dbuf_put(w16, 2 * V * D) : dbuf_put(wf, 4 * V * D);
    dbuf bcand = dbuf_put(NULL, 4 * nk), bsc = dbuf_put(NULL, 4 * nk), bce = dbuf_put(NULL, 4 * n);
    dbuf blp = dbuf_put(NULL, 4 * n), bch = dbuf_put(NULL, 4 * n), bdu = dbuf_put(NULL, 4 * n * Rk);
    dbuf bdP = dbuf_put(sent, 4 * V * Rk), bdS = dbuf_put(sent, 4 * V * Rk), bdh = dbuf_put(dh0, 4 * n * D);
    kn_selector_params pc = {.n = n, .V = V, .K = c->K, .Rk = c->Rk, .D = c->D, .miss = c->miss};
    pc.wdt = c->bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    kn_selector_params pg = pc;
#define SIDE(p, s)                                                                                           \
    p.topk_idx = btk.s, p.topk_val = btv.s, p.label_logit = bll.s, p.labels = blab.s, p.pred = bpred.s,      \
    p.u = bu.s, p.P = bP.s, p.S = bS.s, p.cand = bcand.s, p.score = bsc.s, p.ce = bce.s, p.lab_pos = blp.s,  \
    p.choice = bch.s, p.gscale = bgs.s, p.w = bw.s, p.dh = bdh.s, p.du = bdu.s, p.dP = bdP.s, p.dS = bdS.s
    SIDE(pc, c);
    SIDE(pg, g);
#undef SIDE
    tst_ok(cpu->selector_fwd(cctx, &pc), "cpu selector_fwd");
    tst_ok(cpu->selector_bwd(cctx, &pc), "cpu selector_bwd");
    tst_ok(gpu->selector_fwd(gctx, &pg), "cuda selector_fwd");
    tst_ok(gpu->selector_bwd(gctx, &pg), "cuda selector_bwd");

    /* the forward */
    int32_t *cand_c = tst_xcalloc(4 * (size_t)nk), *cand_g = tst_xcalloc(4 * (size_t)nk),
            *lp_c = tst_xcalloc(4 * (size_t)n), *lp_g = tst_xcalloc(4 * (size_t)n);
    int32_t *ch_c = tst_xcalloc(4 * (size_t)n), *ch_g = tst_xcalloc(4 * (size_t)n);
    float   *sc_c = tst_zeros_f32(nk), *sc_g = tst_zeros_f32(nk), *ce_c = tst_zeros_f32(n),
          *ce_g = tst_zeros_f32(n);
    get(cpu, cctx, cand_c, bcand.c, 4 * nk), get(gpu, gctx, cand_g, bcand.g, 4 * nk);
    get(cpu, cctx, lp_c, blp.c, 4 * n), get(gpu, gctx, lp_g, blp.g, 4 * n);
    get(cpu, cctx, ch_c, bch.c, 4 * n), get(gpu, gctx, ch_g, bch.g, 4 * n);
    get(cpu, cctx, sc_c, bsc.c, 4 * nk), get(gpu, gctx, sc_g, bsc.g, 4 * nk);
    get(cpu, cctx, ce_c, bce.c, 4 * n), get(gpu, gctx, ce_g, bce.g, 4 * n);
    double *b_sc = tst_xcalloc(8 * nk), *b_ce = tst_xcalloc(8 * n);
    for (long i = 0; i < n; i++) {
        double bmax = 0;
        for (long k = 0; k < K; k++) {
            const int32_t v = cand_c[i * K + k];
            const int     injected = lp_c[i] < 0 && c->miss == KN_SEL_INJECT && k == K - 1;
            double        b = fabs(injected ? ll[i] : tv[i * K + k]);
            for (long r = 0; r < Rk; r++)
                b += fabs((double)P[(long)pred[i] * Rk + r] * u[i * Rk + r] * S[(long)v * Rk + r]);
            b_sc[i * K + k] = b;
            bmax = b > bmax ? b : bmax;
        }
        b_ce[i] = bmax + 1;
    }
    const int cand_bad = memcmp(cand_c, cand_g, 4 * nk) != 0, lp_bad = memcmp(lp_c, lp_g, 4 * n) != 0;
    int       ch_bad = 0, near_ties = 0;
    for (long i = 0; i < n; i++)
        if (ch_c[i] != ch_g[i]) {
            const long a = i * K + ch_c[i], b = i * K + ch_g[i];
            const int  near =
                ch_g[i] >= 0 && ch_g[i] < K &&
                fabs((double)sc_c[a] - sc_c[b]) <= 2e-5 * (b_sc[a] > b_sc[b] ? b_sc[a] : b_sc[b]);
            near_ties += near;
            if (!near && ch_bad++ < 5)
                fprintf(stderr, "  choice of row %ld: cpu %d (score %.8g) cuda %d\n", i, ch_c[i], sc_c[a],
                        ch_g[i]);
        }
    TST_CHECK(!cand_bad && !lp_bad && ch_bad == 0);
    printf("  %-*s %s\n", W_NAME - 2, "cand, lab_pos, choice",
           !cand_bad && !lp_bad && !ch_bad ? "equal" : "DIFFER");
    if (near_ties)
        printf("  %d rows' choices differ at a near-tie (scores within tolerance)\n", near_ties);
    tst_compare_bound("  score", W_NAME, sc_g, sc_c, b_sc, nk, 1e-5, NULL);
    tst_compare_bound("  ce", W_NAME, ce_g, ce_c, b_ce, n, 3e-5, NULL);

    /* the backward: d from the cpu's scores, in double, for the bounds */
    double *dd = tst_xcalloc(8 * nk), *gl = tst_xcalloc(8 * n);
    for (long i = 0; i < n; i++) {
        const int li = lp_c[i] >= 0 ? lp_c[i] : c->miss == KN_SEL_INJECT ? (int)K - 1 : -1;
        if (li < 0 || gscale[i] == 0)
            continue;
        double m = sc_c[i * K], s = 0;
        for (long k = 1; k < K; k++)
            m = sc_c[i * K + k] > m ? sc_c[i * K + k] : m;
        for (long k = 0; k < K; k++)
            s += exp(sc_c[i * K + k] - m);
        gl[i] = gscale[i];
        for (long k = 0; k < K; k++)
            dd[i * K + k] = fabs(gscale[i] * (exp(sc_c[i * K + k] - m) / s - (k == li))) + gl[i];
    }
    double        *b_du = tst_xcalloc(8 * n * Rk), *b_dh = tst_xcalloc(8 * n * D);
    double        *b_dP = tst_xcalloc(8 * V * Rk), *b_dS = tst_xcalloc(8 * V * Rk);
    unsigned char *named_P = tst_xcalloc(V), *named_S = tst_xcalloc(V);
    for (long e = 0; e < V * Rk; e++)
        b_dP[e] = b_dS[e] = fabs(sent[e]);
    for (long i = 0; i < n; i++) {
        const long pv = pred[i];
        named_P[pv] = 1;
        for (long r = 0; r < Rk; r++) {
            double t = 0;
            for (long k = 0; k < K; k++)
                t += dd[i * K + k] * fabs(S[(long)cand_c[i * K + k] * Rk + r]);
            b_du[i * Rk + r] = fabs(P[pv * Rk + r]) * t;
            b_dP[pv * Rk + r] += fabs(u[i * Rk + r]) * t;
        }
        for (long k = 0; k < K; k++) {
            const long v = cand_c[i * K + k];
            named_S[v] = 1;
            for (long r = 0; r < Rk; r++)
                b_dS[v * Rk + r] += dd[i * K + k] * fabs((double)P[pv * Rk + r] * u[i * Rk + r]);
        }
        for (long col = 0; col < D; col++) {
            double b = fabs(dh0[i * D + col]);
            for (long k = 0; gl[i] != 0 && k < K; k++)
                b += dd[i * K + k] * fabs(wf[(long)cand_c[i * K + k] * D + col]);
            b_dh[i * D + col] = b;
        }
    }
    const dbuf   *outs[4] = {&bdu, &bdh, &bdP, &bdS};
    const long    ns[4] = {n * Rk, n * D, V * Rk, V * Rk};
    const double *bds[4] = {b_du, b_dh, b_dP, b_dS};
    const char   *what[4] = {"  du", "  dh", "  dP", "  dS"};
    float        *first[4];
    for (int t = 0; t < 4; t++) {
        float *hc = tst_zeros_f32(ns[t]), *hg = tst_zeros_f32(ns[t]);
        get(cpu, cctx, hc, outs[t]->c, 4 * ns[t]), get(gpu, gctx, hg, outs[t]->g, 4 * ns[t]);
        tst_compare_bound(what[t], W_NAME, hg, hc, bds[t], ns[t], 1e-5, NULL);
        if (t >= 2) { /* rows nobody names: the sentinel's bits on both backends */
            const unsigned char *named = t == 2 ? named_P : named_S;
            long                 bad = 0, rows = 0;
            for (long v = 0; v < V; v++) {
                rows += !named[v];
                if (!named[v])
                    bad += memcmp(hc + v * Rk, sent + v * Rk, 4 * Rk) != 0 ||
                           memcmp(hg + v * Rk, sent + v * Rk, 4 * Rk) != 0;
            }
            TST_CHECK(bad == 0);
            printf("  %-*s %ld of %ld rows, %s\n", W_NAME - 2,
                   t == 2 ? "dP rows not named by pred" : "dS rows not named by cand", rows, V,
                   bad ? "CHANGED" : "untouched");
        }
        first[t] = hg;
        free(hc);
    }

    /* determinism: the same inputs again, the same bits; without dh, the same du, dP, dS */
    for (int rep = 0; rep < 2; rep++) {
        put(bdP.g, NULL, sent, 4 * V * Rk), put(bdS.g, NULL, sent, 4 * V * Rk),
            put(bdh.g, NULL, dh0, 4 * n * D);
        put(bdu.g, NULL, junk, 4 * n * Rk);
        kn_selector_params pr = pg;
        if (rep == 1)
            pr.dh = NULL, pr.w = NULL;
        tst_ok(gpu->selector_bwd(gctx, &pr), "cuda selector_bwd again");
        int same = 1;
        for (int t = 0; t < 4; t++) {
            float *hg = tst_zeros_f32(ns[t]);
            get(gpu, gctx, hg, outs[t]->g, 4 * ns[t]);
            same &= memcmp(hg, t == 1 && rep == 1 ? dh0 : first[t], 4 * ns[t]) == 0;
            free(hg);
        }
        TST_CHECK(same);
        printf("  %-*s %s\n", W_NAME - 2,
               rep ? "backward without dh (du, dP, dS; dh untouched)" : "backward repeated",
               same ? "bit-identical" : "DIFFERS");
    }
    for (int t = 0; t < 4; t++)
        free(first[t]);
    dbuf *all[] = {&btk,   &btv, &bll, &blab, &bpred, &bu,  &bP,  &bS,  &bgs, &bw,
                   &bcand, &bsc, &bce, &blp,  &bch,   &bdu, &bdP, &bdS, &bdh};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
        dbuf_free(all[k]);
    free(topk), free(labels), free(pred), free(gscale), free(tv), free(ll), free(u), free(P), free(S),
        free(wf);
    free(w16), free(sent), free(dh0), free(junk), free(cand_c), free(cand_g), free(lp_c), free(lp_g),
        free(ch_c), free(ch_g);
    free(sc_c), free(sc_g), free(ce_c), free(ce_g), free(b_sc), free(b_ce), free(dd), free(gl), free(b_du);
    free(b_dh), free(b_dP), free(b_dS), free(named_P), free(named_S);
}

/* Ids outside [0, V) on cuda (the cpu refuses them; a device cannot look without a copy): the rows
 * that hold one get NaN, nothing faults, rows nobody names stay as they were. */
static void test_bad_ids(void) {
    enum { n = 4, K = 4, Rk = 5, D = 6, V = 10 };
    int32_t topk[n * K] = {0, 1, 2, 3, 0, 1, 2, 3, 0, -5, 2, 3, 0, 1, 2, 3}, labels[n] = {1, 2, 3, 0};
    int32_t pred[n] = {4, V + 3, 4, 4};
    float   f[V * D], sent[V * Rk], gs[n] = {1, 1, 1, 1};
    for (int e = 0; e < V * D; e++)
        f[e] = 0.1f * (float)(e % 7);
    for (int e = 0; e < V * Rk; e++)
        sent[e] = 0.5f + (float)e;
    void        *b[17] = {0};
    const size_t by[17] = {sizeof topk, sizeof f,  sizeof f,   sizeof labels, sizeof pred, sizeof f,
                           sizeof f,    sizeof f,  4 * n * K,  4 * n * K,     4 * n,       4 * n,
                           4 * n,       sizeof gs, 4 * n * Rk, sizeof sent,   sizeof sent};
    const void  *src[17] = {topk, f,    f,    labels, pred, f,    f,    f,   NULL,
                            NULL, NULL, NULL, NULL,   gs,   NULL, sent, sent};
    for (int k = 0; k < 17; k++) {
        if (gpu->alloc(gctx, &b[k], by[k]) != CM_OK) {
            fprintf(stderr, "alloc failed: %s\n", cm_last_error());
            exit(1);
        }
        if (src[k])
            put(b[k], NULL, src[k], by[k]);
    }
    kn_selector_params p = {
        .n = n, .V = V, .K = K, .Rk = Rk, .D = D, .miss = KN_SEL_INJECT, .wdt = CM_DTYPE_F32};
    p.topk_idx = b[0], p.topk_val = b[1], p.label_logit = b[2], p.labels = b[3], p.pred = b[4], p.u = b[5];
    p.P = b[6], p.S = b[7], p.cand = b[8], p.score = b[9], p.ce = b[10], p.lab_pos = b[11], p.choice = b[12];
    p.gscale = b[13], p.du = b[14], p.dP = b[15], p.dS = b[16], p.w = b[1], p.dh = NULL;
    tst_ok(gpu->selector_fwd(gctx, &p), "cuda selector_fwd with bad ids");
    tst_ok(gpu->selector_bwd(gctx, &p), "cuda selector_bwd with bad ids");
    float ce[n], dP[V * Rk], dS[V * Rk];
    tst_ok(gpu->sync(gctx), "sync after bad ids (no fault)");
    get(gpu, gctx, ce, b[10], sizeof ce), get(gpu, gctx, dP, b[15], sizeof dP),
        get(gpu, gctx, dS, b[16], sizeof dS);
    TST_CHECK(isfinite(ce[0]) && isnan(ce[1]) && isnan(ce[2]) && isfinite(ce[3]));
    int untouched = 1; /* pred names only row 4 (and 13, outside); cand only rows 0..3 */
    for (int v = 0; v < V; v++)
        for (int r = 0; r < Rk; r++) {
            if (v != 4)
                untouched &= dP[v * Rk + r] == sent[v * Rk + r];
            if (v > 3)
                untouched &= dS[v * Rk + r] == sent[v * Rk + r];
        }
    TST_CHECK(untouched);
    printf("%-*s ce %g %g %g %g, unnamed rows %s\n", W_NAME, "selector with ids outside [0, V) on cuda",
           ce[0], ce[1], ce[2], ce[3], untouched ? "untouched" : "CHANGED");
    for (int k = 0; k < 17; k++)
        gpu->free(gctx, b[k]);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The training shape (Qwen3.8-27B DFlash2: 7680 rows of K 16, Rk 256, D 5120, V 248320, BF16 head):
 * wall time of fwd and bwd on the device (informational; no verdict). */
static void timing(void) {
    const long     n = 7680, K = 16, Rk = 256, D = 5120, V = 248320, nk = n * K;
    const sel_case c = {"timing", (int)n, (int)K, (int)Rk, (int)D, (int)V, KN_SEL_INJECT, 1, 4.0};
    int32_t       *topk = tst_xcalloc(4 * (size_t)nk), *labels = tst_xcalloc(4 * (size_t)n),
            *pred = tst_xcalloc(4 * (size_t)n);
    float *gscale = tst_zeros_f32(n);
    make_ids(&c, topk, labels, pred, gscale);
    const size_t by[13] = {4 * nk,     4 * nk,    4 * n,     4 * n,      4 * n,      4 * n * Rk, 4 * V * Rk,
                           4 * V * Rk, 2 * V * D, 4 * n * D, 4 * n * Rk, 4 * V * Rk, 4 * V * Rk};
    void        *b[13] = {0}, *o[5] = {0};
    for (int k = 0; k < 13; k++)
        if (gpu->alloc(gctx, &b[k], by[k]) != CM_OK) {
            printf("%-*s skipped: %s\n", W_NAME, "selector timing", cm_last_error());
            for (int j = 0; j < k; j++)
                gpu->free(gctx, b[j]);
            free(topk), free(labels), free(pred), free(gscale);
            return;
        }
    const size_t oby[5] = {4 * nk, 4 * nk, 4 * n, 4 * n, 4 * n};
    for (int k = 0; k < 5; k++)
        tst_ok(gpu->alloc(gctx, &o[k], oby[k]), "alloc");
    put(b[0], NULL, topk, 4 * nk), put(b[3], NULL, labels, 4 * n), put(b[4], NULL, pred, 4 * n);
    tst_ok(gpu->fill_uniform(gctx, b[1], CM_DTYPE_F32, nk, 1, -2, 2), "fill");
    tst_ok(gpu->fill_uniform(gctx, b[2], CM_DTYPE_F32, n, 2, -2, 2), "fill");
    tst_ok(gpu->fill_uniform(gctx, b[5], CM_DTYPE_F32, n * Rk, 3, -1, 1), "fill");
    tst_ok(gpu->fill_uniform(gctx, b[6], CM_DTYPE_F32, V * Rk, 4, -0.1f, 0.1f), "fill");
    tst_ok(gpu->fill_uniform(gctx, b[7], CM_DTYPE_F32, V * Rk, 5, -0.1f, 0.1f), "fill");
    tst_ok(gpu->fill_uniform(gctx, b[8], CM_DTYPE_BF16, V * D, 6, -0.05f, 0.05f), "fill");
    kn_selector_params p = {
        .n = n, .V = V, .K = K, .Rk = Rk, .D = D, .miss = KN_SEL_INJECT, .wdt = CM_DTYPE_BF16};
    p.topk_idx = b[0], p.topk_val = b[1], p.label_logit = b[2], p.labels = b[3], p.pred = b[4], p.u = b[5];
    p.P = b[6], p.S = b[7], p.w = b[8], p.dh = b[9], p.du = b[10], p.dP = b[11], p.dS = b[12];
    p.cand = o[0], p.score = o[1], p.ce = o[2], p.lab_pos = o[3], p.choice = o[4];
    float *gs = tst_zeros_f32(n);
    for (long i = 0; i < n; i++)
        gs[i] = 1.0f / (float)n;
    void *bgs = NULL;
    tst_ok(gpu->alloc(gctx, &bgs, 4 * n), "alloc");
    put(bgs, NULL, gs, 4 * n);
    p.gscale = bgs;
    const int reps = 10;
    double    t_f = 0, t_b = 0;
    for (int pass = 0; pass < 2; pass++) { /* pass 0 warms up (and sizes the scratch) */
        double t0 = now_s();
        for (int r = 0; r < (pass ? reps : 1); r++)
            tst_ok(gpu->selector_fwd(gctx, &p), "selector_fwd (timing)");
        tst_ok(gpu->sync(gctx), "sync");
        double t1 = now_s();
        for (int r = 0; r < (pass ? reps : 1); r++)
            tst_ok(gpu->selector_bwd(gctx, &p), "selector_bwd (timing)");
        tst_ok(gpu->sync(gctx), "sync");
        t_f = (t1 - t0) / (pass ? reps : 1), t_b = (now_s() - t1) / (pass ? reps : 1);
    }
    printf("selector timing n %ld K %ld Rk %ld D %ld V %ld bf16 head, skewed ids: fwd %.3f ms, bwd %.3f ms "
           "(informational)\n",
           n, K, Rk, D, V, 1e3 * t_f, 1e3 * t_b);
    for (int k = 0; k < 13; k++)
        gpu->free(gctx, b[k]);
    for (int k = 0; k < 5; k++)
        gpu->free(gctx, o[k]);
    gpu->free(gctx, bgs);
    free(topk), free(labels), free(pred), free(gscale), free(gs);
}

int main(void) {
    if (!tst_pair_open())
        return tst_report();
    static const sel_case cases[] = {
        {"one row", 1, 4, 1, 7, 5, KN_SEL_INJECT, 0, 1.0},
        {"small V", 37, 16, 33, 65, 40, KN_SEL_DROP, 1, 2.0},
        {"K 64 over V 70", 37, 64, 33, 33, 70, KN_SEL_INJECT, 0, 1.0},
        {"skewed V 50, long runs", 3001, 16, 256, 129, 50, KN_SEL_INJECT, 1, 3.0},
        {"K 64 over V 70, runs of ~2700", 3001, 64, 33, 40, 70, KN_SEL_DROP, 0, 1.0},
        {"K 4 Rk 256 V 1000", 3001, 4, 256, 17, 1000, KN_SEL_DROP, 1, 2.0},
        {"full vocabulary, skewed", 3001, 16, 33, 24, 248320, KN_SEL_INJECT, 1, 4.0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
    /* bad arguments: the same rule and message as on the cpu */
    kn_selector_params bad = {.n = 3, .V = 3, .K = 4, .Rk = 2, .D = 2};
    cm_clear_error();
    TST_CHECK(gpu->selector_fwd(gctx, &bad) == CM_ERR_INVALID_ARG &&
              strstr(cm_last_error(), "selector_fwd: K=4 candidates is above the vocabulary V=3"));
    bad.V = 8, bad.wdt = CM_DTYPE_F16;
    TST_CHECK(gpu->selector_bwd(gctx, &bad) == CM_ERR_UNSUPPORTED &&
              strstr(cm_last_error(), "selector_bwd: LM head dtype"));
    test_bad_ids();
    timing();
    tst_pair_close();
    return tst_report();
}
