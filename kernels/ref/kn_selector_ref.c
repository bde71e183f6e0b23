/* kernels/ref/kn_selector_ref.c — reference candidate selector of DFlash2 (semantics and shapes in
 * kn_backend.h, kn_selector_params). Forward, per row: the candidates (the top-K, the label put
 * into slot K − 1 when it is missing and miss = KN_SEL_INJECT), score = z + Σ_r P[pred]·u·S[cand]
 * in double rounded once on store, then choice and ce from the stored F32 scores (softmax in
 * double). Backward: d = gscale·(softmax − onehot) in double from the stored scores; du and dh
 * per row; dP and dS by a stable counting sort of the contributions by target row, each touched
 * row one double sum over its contributions in ascending (i, c), added to the old value and
 * rounded once. Rows and touched rows run in parallel under OpenMP, each summed by one thread in
 * one order, so any thread count gives the same bits. Token ids are validated to lie in [0, V). */
#include "kn_ref.h"

#include <stdlib.h>

cm_status kn_selector_check(const char *op, kn_ctx *ctx, const kn_selector_params *p, int bwd) {
    KN_REF_CHECK(ctx && p, "%s: ctx or params is NULL", op);
    KN_REF_CHECK(p->n >= 0, "%s: n=%lld rows is negative", op, (long long)p->n);
    KN_REF_CHECK(p->K >= 1 && p->K <= KN_TOPK_MAX, "%s: K=%d candidates is outside [1, KN_TOPK_MAX=%d]", op,
                 p->K, KN_TOPK_MAX);
    KN_REF_CHECK(p->V >= p->K, "%s: K=%d candidates is above the vocabulary V=%lld", op, p->K,
                 (long long)p->V);
    KN_REF_CHECK(p->V <= INT32_MAX, "%s: V=%lld does not fit the I32 token ids", op, (long long)p->V);
    KN_REF_CHECK(p->Rk >= 1, "%s: selector rank Rk=%d is below 1", op, p->Rk);
    KN_REF_CHECK(p->D >= 1, "%s: hidden size D=%d is below 1", op, p->D);
    KN_REF_CHECK(p->miss == KN_SEL_INJECT || p->miss == KN_SEL_DROP,
                 "%s: miss=%d is neither KN_SEL_INJECT nor KN_SEL_DROP", op, (int)p->miss);
    const int64_t widest = p->D > p->Rk ? p->D : p->Rk;
    KN_REF_CHECK(p->n <= INT64_MAX / 8 / (widest > KN_TOPK_MAX ? widest : KN_TOPK_MAX) &&
                     p->V <= INT64_MAX / 8 / widest,
                 "%s: n=%lld rows or V=%lld overflows", op, (long long)p->n, (long long)p->V);
    if (bwd && p->wdt != CM_DTYPE_F32 && p->wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: LM head dtype %s is not supported (use F32 or BF16)", op,
                       cm_dtype_name(p->wdt));
    if (p->n == 0)
        return CM_OK;
    if (bwd) {
        KN_REF_CHECK(p->pred && p->u && p->P && p->S, "%s: pred, u, P or S is NULL", op);
        KN_REF_CHECK(p->cand && p->score && p->lab_pos && p->gscale,
                     "%s: cand, score, lab_pos or gscale is NULL", op);
        KN_REF_CHECK(p->du && p->dP && p->dS, "%s: du, dP or dS is NULL", op);
        KN_REF_CHECK(p->dP != p->dS, "%s: dP and dS are the same buffer", op);
        KN_REF_CHECK(!p->dh || p->w, "%s: dh is asked for but the LM head w is NULL", op);
    } else {
        KN_REF_CHECK(p->topk_idx && p->topk_val && p->label_logit && p->labels && p->pred,
                     "%s: topk_idx, topk_val, label_logit, labels or pred is NULL", op);
        KN_REF_CHECK(p->u && p->P && p->S, "%s: u, P or S is NULL", op);
        KN_REF_CHECK(p->cand && p->score && p->ce && p->lab_pos && p->choice,
                     "%s: cand, score, ce, lab_pos or choice is NULL", op);
    }
    return CM_OK;
}

// ----------------------------------------------------------------------------
// forward

/* Every token id the forward reads lies in [0, V). */
static cm_status sel_fwd_ids(const char *op, const kn_selector_params *p) {
    for (int64_t i = 0; i < p->n; i++) {
        KN_REF_CHECK(p->labels[i] >= 0 && p->labels[i] < p->V,
                     "%s: label %d of row %lld is outside [0, V=%lld)", op, (int)p->labels[i], (long long)i,
                     (long long)p->V);
        KN_REF_CHECK(p->pred[i] >= 0 && p->pred[i] < p->V,
                     "%s: predecessor %d of row %lld is outside [0, V=%lld)", op, (int)p->pred[i],
                     (long long)i, (long long)p->V);
        for (int c = 0; c < p->K; c++) {
            const int32_t v = p->topk_idx[i * p->K + c];
            KN_REF_CHECK(v >= 0 && v < p->V, "%s: topk_idx %d of row %lld, slot %d is outside [0, V=%lld)",
                         op, (int)v, (long long)i, c, (long long)p->V);
        }
    }
    return CM_OK;
}

cm_status kn_ref_selector_fwd(kn_ctx *ctx, const kn_selector_params *p) {
    CM_TRY(kn_selector_check("selector_fwd", ctx, p, 0));
    CM_TRY(sel_fwd_ids("selector_fwd", p));
    const int K = p->K, Rk = p->Rk;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < p->n; i++) {
        const int32_t lab = p->labels[i];
        int           lp = -1;
        for (int c = 0; c < K && lp < 0; c++)
            if (p->topk_idx[i * K + c] == lab)
                lp = c;
        const int    inject = lp < 0 && p->miss == KN_SEL_INJECT;
        const int    li = lp >= 0 ? lp : inject ? K - 1 : -1;
        const float *pr = p->P + (int64_t)p->pred[i] * Rk, *ur = p->u + i * Rk;
        float       *sc = p->score + i * K;
        for (int c = 0; c < K; c++) {
            const int     injected = inject && c == K - 1;
            const int32_t v = injected ? lab : p->topk_idx[i * K + c];
            const float  *sr = p->S + (int64_t)v * Rk;
            double        t = injected ? (double)p->label_logit[i] : (double)p->topk_val[i * K + c];
            double        dot = 0;
            for (int r = 0; r < Rk; r++)
                dot += (double)pr[r] * (double)ur[r] * (double)sr[r];
            p->cand[i * K + c] = v;
            sc[c] = (float)(t + dot);
        }
        int ch = 0;
        for (int c = 1; c < K; c++)
            if (sc[c] > sc[ch])
                ch = c;
        double s = 0;
        for (int c = 0; c < K; c++)
            s += exp((double)sc[c] - (double)sc[ch]);
        p->ce[i] = li < 0 ? 0.0f : (float)((double)sc[ch] + log(s) - (double)sc[li]);
        p->lab_pos[i] = lp;
        p->choice[i] = ch;
    }
    return CM_OK;
}

// ----------------------------------------------------------------------------
// backward

static cm_status sel_bwd_ids(const char *op, const kn_selector_params *p) {
    for (int64_t i = 0; i < p->n; i++) {
        KN_REF_CHECK(p->pred[i] >= 0 && p->pred[i] < p->V,
                     "%s: predecessor %d of row %lld is outside [0, V=%lld)", op, (int)p->pred[i],
                     (long long)i, (long long)p->V);
        KN_REF_CHECK(p->lab_pos[i] >= -1 && p->lab_pos[i] < p->K,
                     "%s: lab_pos %d of row %lld is outside [-1, K=%d)", op, (int)p->lab_pos[i], (long long)i,
                     p->K);
        for (int c = 0; c < p->K; c++) {
            const int32_t v = p->cand[i * p->K + c];
            KN_REF_CHECK(v >= 0 && v < p->V, "%s: cand %d of row %lld, slot %d is outside [0, V=%lld)", op,
                         (int)v, (long long)i, c, (long long)p->V);
        }
    }
    return CM_OK;
}

/* d[c] of row i into d[0..K); returns 0 (and d ≡ 0) for a row that adds nothing: no label, or
 * gscale 0. */
static int sel_row_d(const kn_selector_params *p, int64_t i, double *d) {
    const int    K = p->K, lp = p->lab_pos[i];
    const int    li = lp >= 0 ? lp : p->miss == KN_SEL_INJECT ? K - 1 : -1;
    const double g = (double)p->gscale[i];
    const float *sc = p->score + i * K;
    for (int c = 0; c < K; c++)
        d[c] = 0;
    if (li < 0 || g == 0)
        return 0;
    double m = sc[0], s = 0;
    for (int c = 1; c < K; c++)
        m = (double)sc[c] > m ? (double)sc[c] : m;
    for (int c = 0; c < K; c++)
        s += exp((double)sc[c] - m);
    for (int c = 0; c < K; c++)
        d[c] = g * (exp((double)sc[c] - m) / s - (c == li ? 1.0 : 0.0));
    return 1;
}

/* The n_items contributions stably sorted by target row (key[j] in [0, V)): order[start[v] ..
 * start[v + 1]) are the j with key[j] = v, ascending. Counting sort; the caller frees both. */
static cm_status sel_sort(const int32_t *key, int64_t n_items, int64_t V, int64_t **order_out,
                          int64_t **start_out) {
    int64_t *order = malloc((size_t)n_items * sizeof(int64_t)),
            *start = calloc((size_t)V + 2, sizeof(int64_t));
    if (!order || !start) {
        free(order);
        free(start);
        return CM_FAIL(CM_ERR_NOMEM,
                       "selector_bwd: cannot allocate the sort of %lld contributions over V=%lld",
                       (long long)n_items, (long long)V);
    }
    for (int64_t j = 0; j < n_items; j++)
        start[key[j] + 2]++;
    for (int64_t v = 0; v < V; v++)
        start[v + 2] += start[v + 1];
    for (int64_t j = 0; j < n_items; j++) /* start[v + 1] runs over row v's slots, ending at its end */
        order[start[key[j] + 1]++] = j;
    *order_out = order;
    *start_out = start;
    return CM_OK;
}

/* Σ_c d[i, c]·S[cand[i, c], r] in double, c ascending. */
static double sel_dS_sum(const kn_selector_params *p, const double *d, int64_t i, int r) {
    double t = 0;
    for (int c = 0; c < p->K; c++)
        t += d[i * p->K + c] * (double)p->S[(int64_t)p->cand[i * p->K + c] * p->Rk + r];
    return t;
}

cm_status kn_ref_selector_bwd(kn_ctx *ctx, const kn_selector_params *p) {
    CM_TRY(kn_selector_check("selector_bwd", ctx, p, 1));
    if (p->n == 0)
        return CM_OK;
    CM_TRY(sel_bwd_ids("selector_bwd", p));
    const int64_t  n = p->n, V = p->V, D = p->D;
    const int      K = p->K, Rk = p->Rk;
    double        *d = malloc((size_t)(n * K) * sizeof(double));
    unsigned char *live = malloc((size_t)n);
    if (!d || !live) {
        free(d);
        free(live);
        return CM_FAIL(CM_ERR_NOMEM, "selector_bwd: cannot allocate d for %lld rows", (long long)n);
    }
    /* d, du and dh: one row per task */
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < n; i++) {
        live[i] = (unsigned char)sel_row_d(p, i, d + i * K);
        const float *pr = p->P + (int64_t)p->pred[i] * Rk;
        for (int r = 0; r < Rk; r++)
            p->du[i * Rk + r] = (float)((double)pr[r] * sel_dS_sum(p, d, i, r));
        if (!p->dh || !live[i])
            continue;
        for (int64_t col = 0; col < D; col++) {
            double s = 0;
            for (int c = 0; c < K; c++) {
                const int64_t e = (int64_t)p->cand[i * K + c] * D + col;
                const double w = p->wdt == CM_DTYPE_BF16 ? (double)cm_bf16_to_f32(((const uint16_t *)p->w)[e])
                                                         : (double)((const float *)p->w)[e];
                s += d[i * K + c] * w;
            }
            p->dh[i * D + col] = (float)((double)p->dh[i * D + col] + s);
        }
    }
    free(live);
    /* dP: rows i by pred; dS: contributions j = i·K + c by cand */
    int64_t  *order = NULL, *start = NULL;
    cm_status st = sel_sort(p->pred, n, V, &order, &start);
    if (st != CM_OK)
        goto fail;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 64)
#endif
    for (int64_t v = 0; v < V; v++)
        for (int r = 0; r < Rk && start[v] < start[v + 1]; r++) {
            double acc = 0;
            for (int64_t k = start[v]; k < start[v + 1]; k++)
                acc += (double)p->u[order[k] * Rk + r] * sel_dS_sum(p, d, order[k], r);
            p->dP[v * Rk + r] = (float)((double)p->dP[v * Rk + r] + acc);
        }
    free(order);
    free(start);
    order = start = NULL;
    st = sel_sort(p->cand, n * K, V, &order, &start);
    if (st != CM_OK)
        goto fail;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 64)
#endif
    for (int64_t v = 0; v < V; v++)
        for (int r = 0; r < Rk && start[v] < start[v + 1]; r++) {
            double acc = 0;
            for (int64_t k = start[v]; k < start[v + 1]; k++) {
                const int64_t j = order[k], i = j / K;
                acc += d[j] * ((double)p->P[(int64_t)p->pred[i] * Rk + r] * (double)p->u[i * Rk + r]);
            }
            p->dS[v * Rk + r] = (float)((double)p->dS[v * Rk + r] + acc);
        }
fail:
    free(order);
    free(start);
    free(d);
    return st;
}
