/* tests/test_kn_selector.c — the cpu reference of DFlash2's candidate selector (kn_backend.h,
 * kn_selector_params) on tiny shapes: the forward against a second, straightforward implementation
 * (cand, lab_pos, choice exactly; score and ce to 1e-6); the backward against central finite
 * differences in double of L = Σ_i gscale_i·ce_i over u, P, S and h, where the harness recomputes
 * z = h·W[c] (topk_val, label_logit) from h so that dh = Σ_c d·W[cand] is checked as a real
 * gradient; K 1, 4, 16, odd Rk, inject and drop, labels at slot 0, the middle, K − 1 and absent,
 * repeated pred and cand ids, a row of one repeated candidate (ties), gscale 0, F32 and BF16 heads,
 * dh NULL; += into dh, dP, dS with untouched rows bit-equal; each bad argument refused. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_fd.h"
#include "tst_kn.h"

static const kn_backend *be;
static kn_ctx           *ctx;

typedef struct {
    const char *name;
    int         n, K, Rk, D, V;
    kn_sel_miss miss;
    int         bf16; /* LM head stored as BF16 */
} sel_case;

/* The FD harness: everything the forward reads, with z recomputed from h and W before each run. */
typedef struct {
    kn_selector_params p;
    const sel_case    *c;
    float             *h;       /* [n, D] */
    float             *wf;      /* [V, D] the head as F32 values (BF16 widened) */
    int32_t           *topk;    /* [n, K] */
    float             *tv, *ll; /* topk_val, label_logit (recomputed) */
} sel_st;

static void recompute_z(sel_st *s) {
    const sel_case *c = s->c;
    for (int i = 0; i < c->n; i++) {
        for (int k = 0; k <= c->K; k++) {
            const int32_t v = k < c->K ? s->topk[i * c->K + k] : s->p.labels[i];
            double        z = 0;
            for (int d = 0; d < c->D; d++)
                z += (double)s->h[i * c->D + d] * (double)s->wf[(long)v * c->D + d];
            if (k < c->K)
                s->tv[i * c->K + k] = (float)z;
            else
                s->ll[i] = (float)z;
        }
    }
}

static double sel_loss(void *vs) {
    sel_st *s = vs;
    recompute_z(s);
    if (be->selector_fwd(ctx, &s->p) != CM_OK) {
        fprintf(stderr, "selector_fwd failed: %s\n", cm_last_error());
        exit(1);
    }
    double l = 0;
    for (int i = 0; i < s->c->n; i++)
        l += (double)s->p.gscale[i] * (double)s->p.ce[i];
    return l;
}

/* The forward written out plainly: the label's first slot by scanning backwards, the injection,
 * scores in double, argmax and ce without a shift. Compares everything the op wrote. */
static void check_forward(const sel_st *s, const char *name) {
    const kn_selector_params *p = &s->p;
    const int                 K = p->K, Rk = p->Rk;
    int                       bad_ids = 0;
    float                    *ref_sc = tst_zeros_f32((long)p->n * K), *ref_ce = tst_zeros_f32(p->n);
    for (int64_t i = 0; i < p->n; i++) {
        int lp = -1;
        for (int c = K - 1; c >= 0; c--)
            if (p->topk_idx[i * K + c] == p->labels[i])
                lp = c;
        int32_t cand[KN_TOPK_MAX];
        double  sc[KN_TOPK_MAX], z[KN_TOPK_MAX];
        for (int c = 0; c < K; c++)
            cand[c] = p->topk_idx[i * K + c], z[c] = p->topk_val[i * K + c];
        int li = lp;
        if (lp < 0 && p->miss == KN_SEL_INJECT)
            li = K - 1, cand[K - 1] = p->labels[i], z[K - 1] = p->label_logit[i];
        int best = 0;
        for (int c = 0; c < K; c++) {
            sc[c] = z[c];
            for (int r = 0; r < Rk; r++)
                sc[c] +=
                    (double)p->P[(long)p->pred[i] * Rk + r] * p->u[i * Rk + r] * p->S[(long)cand[c] * Rk + r];
            if (sc[c] > sc[best])
                best = c;
            ref_sc[i * K + c] = (float)sc[c];
            bad_ids += cand[c] != p->cand[i * K + c];
        }
        double se = 0;
        for (int c = 0; c < K; c++)
            se += exp(sc[c]);
        ref_ce[i] = li < 0 ? 0.0f : (float)(log(se) - sc[li]);
        bad_ids += lp != p->lab_pos[i];
        bad_ids += best != p->choice[i];
    }
    char what[200];
    snprintf(what, sizeof what, "%s score", name);
    TST_CHECK(TST_CLOSE(what, p->score, ref_sc, (long)p->n * K, 1e-6, 1e-6));
    snprintf(what, sizeof what, "%s ce", name);
    TST_CHECK(TST_CLOSE(what, p->ce, ref_ce, p->n, 1e-6, 1e-6));
    if (bad_ids)
        fprintf(stderr, "%s: %d of cand, lab_pos, choice differ from the plain forward\n", name, bad_ids);
    TST_CHECK(bad_ids == 0);
    free(ref_sc);
    free(ref_ce);
}

/* Inputs: labels at slot 0, the middle, K − 1 or absent by row (i % 5), distinct top-K ids except
 * row 5 (one id K times: every score ties, choice 0), pred from a third of the vocabulary, gscale
 * 0 on row 6. Small V makes cand and pred ids repeat across rows. */
static void make_ids(const sel_case *c, int32_t *topk, int32_t *labels, int32_t *pred, float *gscale) {
    int32_t *perm = tst_xcalloc(sizeof(int32_t) * (size_t)c->V);
    for (int i = 0; i < c->n; i++) {
        for (int v = 0; v < c->V; v++)
            perm[v] = v;
        for (int v = c->V - 1; v > 0; v--) {
            const int     j = (int)(tst_urand() * (v + 1));
            const int32_t t = perm[v];
            perm[v] = perm[j], perm[j] = t;
        }
        for (int k = 0; k < c->K; k++)
            topk[i * c->K + k] = perm[k];
        const int where = i % 5, pos = where == 0 ? 0 : where == 1 ? c->K / 2 : c->K - 1;
        labels[i] = where <= 2 ? perm[pos] : perm[c->K + (i % (c->V - c->K))];
        if (i == 5)
            for (int k = 0; k < c->K; k++)
                topk[i * c->K + k] = labels[i];
        pred[i] = (int32_t)(tst_urand() * (c->V / 3 + 1));
        gscale[i] = i == 6 ? 0.0f : (float)(0.3 + tst_urand());
    }
    free(perm);
}

static void run_case(const sel_case *c) {
    const long n = c->n, K = c->K, Rk = c->Rk, D = c->D, V = c->V;
    char       name[160];
    snprintf(name, sizeof name, "selector %s (n %ld K %ld Rk %ld D %ld V %ld %s %s)", c->name, n, K, Rk, D, V,
             c->miss == KN_SEL_INJECT ? "inject" : "drop", c->bf16 ? "bf16" : "f32");
    sel_st   s = {.c = c};
    int32_t *labels = tst_xcalloc(4 * (size_t)n), *pred = tst_xcalloc(4 * (size_t)n);
    float   *gscale = tst_zeros_f32(n);
    s.topk = tst_xcalloc(4 * (size_t)n * K);
    make_ids(c, s.topk, labels, pred, gscale);
    s.h = tst_rand_f32(n * D, -1, 1);
    s.wf = tst_rand_f32(V * D, -1, 1);
    uint16_t *w16 = tst_xcalloc(2 * (size_t)V * D);
    for (long e = 0; e < V * D; e++) {
        w16[e] = tst_bf16_round(s.wf[e]);
        if (c->bf16)
            s.wf[e] = tst_bf16_widen(w16[e]);
    }
    s.tv = tst_zeros_f32(n * K), s.ll = tst_zeros_f32(n);
    float *u = tst_rand_f32(n * Rk, -1, 1), *P = tst_rand_f32(V * Rk, -1, 1),
          *S = tst_rand_f32(V * Rk, -1, 1);
    kn_selector_params *p = &s.p;
    *p = (kn_selector_params){.n = n, .V = V, .K = c->K, .Rk = c->Rk, .D = c->D, .miss = c->miss};
    p->topk_idx = s.topk, p->topk_val = s.tv, p->label_logit = s.ll, p->labels = labels, p->pred = pred;
    p->u = u, p->P = P, p->S = S, p->gscale = gscale;
    p->w = c->bf16 ? (const void *)w16 : (const void *)s.wf, p->wdt = c->bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    p->cand = tst_xcalloc(4 * (size_t)n * K), p->score = tst_zeros_f32(n * K), p->ce = tst_zeros_f32(n);
    p->lab_pos = tst_xcalloc(4 * (size_t)n), p->choice = tst_xcalloc(4 * (size_t)n);
    float *du = tst_zeros_f32(n * Rk), *dP = tst_zeros_f32(V * Rk), *dS = tst_zeros_f32(V * Rk),
          *dh = tst_zeros_f32(n * D);
    p->du = du, p->dP = dP, p->dS = dS, p->dh = dh;

    /* forward against the plain one; the tie row and the dropped rows */
    const double L0 = sel_loss(&s);
    check_forward(&s, name);
    if (n > 5)
        TST_CHECK(p->lab_pos[5] == 0 && p->choice[5] == 0 &&
                  fabs((double)p->ce[5] - log((double)K)) <= 1e-6 * (1 + log((double)K)));
    int dropped = 0;
    for (long i = 0; i < n; i++)
        if (c->miss == KN_SEL_DROP && p->lab_pos[i] < 0) {
            dropped++;
            TST_CHECK(p->ce[i] == 0.0f);
        }
    printf("%-70s L %.6f, %d dropped rows\n", name, L0, dropped);

    /* backward against finite differences */
    TST_CHECK(tst_ok(be->selector_bwd(ctx, p), name));
    char what[220];
    snprintf(what, sizeof what, "%s du", name);
    fd_check(what, sel_loss, &s, u, du, n * Rk);
    snprintf(what, sizeof what, "%s dP", name);
    fd_check(what, sel_loss, &s, P, dP, V * Rk);
    snprintf(what, sizeof what, "%s dS", name);
    fd_check(what, sel_loss, &s, S, dS, V * Rk);
    snprintf(what, sizeof what, "%s dh", name);
    fd_check(what, sel_loss, &s, s.h, dh, n * D);

    /* += into dh, dP, dS (rows nobody names bit-equal), du written, and dh NULL changes nothing else */
    sel_loss(&s);
    float *pre = tst_rand_f32(V * Rk > n * D ? V * Rk : n * D, -2, 2);
    float *du2 = tst_rand_f32(n * Rk, 5, 6), *dP2 = tst_zeros_f32(V * Rk), *dS2 = tst_zeros_f32(V * Rk),
          *dh2 = tst_zeros_f32(n * D);
    memcpy(dP2, pre, 4 * V * Rk), memcpy(dS2, pre, 4 * V * Rk), memcpy(dh2, pre, 4 * n * D);
    p->du = du2, p->dP = dP2, p->dS = dS2, p->dh = dh2;
    TST_CHECK(tst_ok(be->selector_bwd(ctx, p), "selector_bwd +="));
    int named_p[256] = {0}, named_s[256] = {0}, bad = 0, live_rows = 0;
    for (long i = 0; i < n; i++) {
        named_p[pred[i]] = 1;
        for (long k = 0; k < K; k++)
            named_s[p->cand[i * K + k]] = 1;
    }
    for (long e = 0; e < V * Rk; e++) {
        const float *got[2] = {dP2, dS2}, *g1[2] = {dP, dS};
        const int    named[2] = {named_p[e / Rk], named_s[e / Rk]};
        for (int t = 0; t < 2; t++)
            bad += named[t] ? !(fabs((double)got[t][e] - ((double)pre[e] + g1[t][e])) <=
                                1e-6 * (fabs(pre[e]) + fabs(g1[t][e])))
                            : memcmp(&got[t][e], &pre[e], 4) != 0;
    }
    for (long i = 0; i < n; i++) {
        const int li = p->lab_pos[i] >= 0 ? p->lab_pos[i] : c->miss == KN_SEL_INJECT ? c->K - 1 : -1;
        const int live = li >= 0 && gscale[i] != 0;
        live_rows += live;
        for (long d = 0; d < D; d++)
            bad += live ? !(fabs((double)dh2[i * D + d] - ((double)pre[i * D + d] + dh[i * D + d])) <=
                            1e-6 * (fabs(pre[i * D + d]) + fabs(dh[i * D + d])))
                        : memcmp(&dh2[i * D + d], &pre[i * D + d], 4) != 0;
    }
    bad += memcmp(du2, du, 4 * n * Rk) != 0;
    memset(dP2, 0, 4 * V * Rk), memset(dS2, 0, 4 * V * Rk);
    p->dh = NULL, p->w = NULL;
    TST_CHECK(tst_ok(be->selector_bwd(ctx, p), "selector_bwd without dh"));
    bad += memcmp(dP2, dP, 4 * V * Rk) != 0 || memcmp(dS2, dS, 4 * V * Rk) != 0 ||
           memcmp(du2, du, 4 * n * Rk) != 0;
    if (bad)
        fprintf(stderr, "%s: %d accumulation / untouched / dh NULL mismatches\n", name, bad);
    TST_CHECK(bad == 0);
    printf("%-70s bwd: %d rows with a gradient, += and dh NULL ok\n", name, live_rows);

    free(labels), free(pred), free(gscale), free(s.topk), free(s.h), free(s.wf), free(w16), free(s.tv);
    free(s.ll), free(u), free(P), free(S), free(p->cand), free(p->score), free(p->ce), free(p->lab_pos);
    free(p->choice), free(du), free(dP), free(dS), free(dh), free(pre), free(du2), free(dP2), free(dS2),
        free(dh2);
}

// ----------------------------------------------------------------------------
// bad arguments

static void expect_refused(kn_selector_params p, int bwd, cm_status want_st, const char *want) {
    cm_clear_error();
    const cm_status st = bwd ? be->selector_bwd(ctx, &p) : be->selector_fwd(ctx, &p);
    const char     *op = bwd ? "selector_bwd: " : "selector_fwd: ";
    const int       good = st == want_st && strstr(cm_last_error(), want) && strstr(cm_last_error(), op);
    if (!good)
        fprintf(stderr, "  expected a refusal with '%s%s', got %s: %s\n", op, want, cm_status_str(st),
                cm_last_error());
    TST_CHECK(good);
}

static void test_bad_args(void) {
    enum { n = 3, K = 4, Rk = 3, D = 2, V = 8 };
    int32_t topk[n * K] = {0, 1, 2, 3, 4, 5, 6, 7, 1, 3, 5, 7}, labels[n] = {2, 0, 7}, pred[n] = {1, 1, 6};
    int32_t cand[n * K], lab_pos[n], choice[n];
    float   f[256] = {0}, o1[64], o2[64], o3[64], o4[64], o5[64], gs[n] = {1, 1, 1};
    kn_selector_params good = {.n = n,
                               .V = V,
                               .K = K,
                               .Rk = Rk,
                               .D = D,
                               .miss = KN_SEL_INJECT,
                               .topk_idx = topk,
                               .topk_val = f,
                               .label_logit = f,
                               .labels = labels,
                               .pred = pred,
                               .u = f,
                               .P = f,
                               .S = f,
                               .cand = cand,
                               .score = o1,
                               .ce = o2,
                               .lab_pos = lab_pos,
                               .choice = choice,
                               .gscale = gs,
                               .w = f,
                               .wdt = CM_DTYPE_F32,
                               .dh = o3,
                               .du = o4,
                               .dP = o5,
                               .dS = f + 128};
    TST_CHECK(tst_ok(be->selector_fwd(ctx, &good), "selector_fwd good"));
    TST_CHECK(lab_pos[0] == 2 && lab_pos[1] == -1 && lab_pos[2] == 3 && cand[K + 3] == 0);
    TST_CHECK(tst_ok(be->selector_bwd(ctx, &good), "selector_bwd good"));
    kn_selector_params p = good;
    p.n = -1;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "n=-1 rows is negative");
    p = good, p.K = 0;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "K=0 candidates is outside [1, KN_TOPK_MAX=64]");
    p = good, p.K = KN_TOPK_MAX + 1, p.V = 100;
    expect_refused(p, 1, CM_ERR_INVALID_ARG, "K=65 candidates is outside [1, KN_TOPK_MAX=64]");
    p = good, p.V = 3;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "K=4 candidates is above the vocabulary V=3");
    p = good, p.Rk = 0;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "selector rank Rk=0 is below 1");
    p = good, p.D = 0;
    expect_refused(p, 1, CM_ERR_INVALID_ARG, "hidden size D=0 is below 1");
    p = good, p.miss = (kn_sel_miss)2;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "miss=2 is neither KN_SEL_INJECT nor KN_SEL_DROP");
    p = good, p.label_logit = NULL;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "topk_idx, topk_val, label_logit, labels or pred is NULL");
    p = good, p.S = NULL;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "u, P or S is NULL");
    p = good, p.choice = NULL;
    expect_refused(p, 0, CM_ERR_INVALID_ARG, "cand, score, ce, lab_pos or choice is NULL");
    p = good, p.gscale = NULL;
    expect_refused(p, 1, CM_ERR_INVALID_ARG, "cand, score, lab_pos or gscale is NULL");
    p = good, p.dS = NULL;
    expect_refused(p, 1, CM_ERR_INVALID_ARG, "du, dP or dS is NULL");
    p = good, p.dS = p.dP;
    expect_refused(p, 1, CM_ERR_INVALID_ARG, "dP and dS are the same buffer");
    p = good, p.w = NULL;
    expect_refused(p, 1, CM_ERR_INVALID_ARG, "dh is asked for but the LM head w is NULL");
    p = good, p.wdt = CM_DTYPE_F16;
    expect_refused(p, 1, CM_ERR_UNSUPPORTED, "LM head dtype F16 is not supported (use F32 or BF16)");
    p = good, p.dh = NULL, p.w = NULL; /* dh is optional, and w with it */
    TST_CHECK(tst_ok(be->selector_bwd(ctx, &p), "selector_bwd without dh"));
    p = good, p.n = 0, p.topk_idx = NULL, p.cand = NULL, p.du = NULL; /* nothing to do, nothing read */
    TST_CHECK(tst_ok(be->selector_fwd(ctx, &p), "selector_fwd n = 0") &&
              tst_ok(be->selector_bwd(ctx, &p), "selector_bwd n = 0"));
    /* token ids (the cpu looks at them; cuda cannot without a copy) */
    labels[1] = 8;
    expect_refused(good, 0, CM_ERR_INVALID_ARG, "label 8 of row 1 is outside [0, V=8)");
    labels[1] = 0, pred[2] = -1;
    expect_refused(good, 0, CM_ERR_INVALID_ARG, "predecessor -1 of row 2 is outside [0, V=8)");
    expect_refused(good, 1, CM_ERR_INVALID_ARG, "predecessor -1 of row 2 is outside [0, V=8)");
    pred[2] = 6, topk[6] = 9;
    expect_refused(good, 0, CM_ERR_INVALID_ARG, "topk_idx 9 of row 1, slot 2 is outside [0, V=8)");
    topk[6] = 6, cand[5] = -3;
    expect_refused(good, 1, CM_ERR_INVALID_ARG, "cand -3 of row 1, slot 1 is outside [0, V=8)");
    cand[5] = 5, lab_pos[0] = K;
    expect_refused(good, 1, CM_ERR_INVALID_ARG, "lab_pos 4 of row 0 is outside [-1, K=4)");
    cm_clear_error();
    TST_CHECK(be->selector_fwd(NULL, &good) == CM_ERR_INVALID_ARG &&
              strstr(cm_last_error(), "ctx or params"));
}

int main(void) {
    be = kn_backend_cpu();
    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    if (be->ctx_create(&ctx, &cfg) != CM_OK) {
        fprintf(stderr, "cannot create a cpu context: %s\n", cm_last_error());
        return 1;
    }
    static const sel_case cases[] = {
        {"K 1", 10, 1, 3, 4, 6, KN_SEL_INJECT, 0}, /* one candidate: ce and every gradient 0 */
        {"K 1", 10, 1, 3, 4, 6, KN_SEL_DROP, 0},        {"K 4", 12, 4, 5, 3, 9, KN_SEL_INJECT, 1},
        {"K 4", 12, 4, 5, 3, 9, KN_SEL_DROP, 0},        {"K 16", 11, 16, 3, 3, 21, KN_SEL_INJECT, 0},
        {"K 16 Rk 1", 9, 16, 1, 2, 19, KN_SEL_DROP, 1}, {"K 16 Rk 7", 8, 16, 7, 3, 17, KN_SEL_INJECT, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
    test_bad_args();
    be->ctx_destroy(&ctx);
    return tst_report();
}
