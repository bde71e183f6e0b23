/* kernels/ref/kn_lm_ce_ref.c — reference fused LM head + cross-entropy (lm_ce) and its top-K
 * variant (lm_ce_topk), one implementation: for each of R rows, logits = h·Wᵀ in double (one
 * kn_ref_dot per vocabulary entry), lse = max + log Σ exp(· − max), ce = lse − logits[label],
 * argmax (the lowest index among equal largest logits), and dh = gscale·(softmax − onehot)·W
 * summed in double over the vocabulary in order; lm_ce_topk adds the K largest logits (ordered
 * by the double value, larger first, then lower index; stored rounded to float) and the label's
 * logit. Rows go in chunks of KN_REF_LM_CE_ROWS that run in parallel; a chunk shares each row
 * of W (widened once when BF16) between its rows, and its per-thread scratch is
 * KN_REF_LM_CE_ROWS × V logits plus KN_REF_LM_CE_ROWS × D accumulators, never R × V. Each row
 * is computed by one thread in a fixed order, so results do not depend on the thread count. */
#include "kn_ref.h"

typedef struct lm_ce_scratch {
    double *logits; /* [KN_REF_LM_CE_ROWS, V] */
    double *acc;    /* [KN_REF_LM_CE_ROWS, D] */
    float  *wrow;   /* [D], a widened BF16 row of W */
} lm_ce_scratch;

static const float *w_row(const void *w, cm_dtype wdt, int64_t v, int64_t D, float *wrow) {
    if (wdt == CM_DTYPE_F32) return (const float *)w + v * D;
    const uint16_t *src = (const uint16_t *)w + v * D;
    for (int64_t d = 0; d < D; d++) wrow[d] = cm_bf16_to_f32(src[d]);
    return wrow;
}

// ----------------------------------------------------------------------------
// top-K of one row

/* The top-K order: a larger logit first, then the lower index. NaN is never better than
 * anything, so NaN logits never enter the list. */
static int topk_better(double a, int64_t ia, double b, int64_t ib) { return a > b || (a == b && ia < ib); }

/* The K best of lg[0, V) in order, by insertion in ascending v (an equal later logit stays
 * behind). Slots that no logit filled (only with NaN logits) are (−1, NaN). */
static void topk_row(const double *lg, int64_t V, int K, int32_t *idx, float *val) {
    double  tv[KN_TOPK_MAX];
    int64_t ti[KN_TOPK_MAX];
    for (int k = 0; k < K; k++) tv[k] = -INFINITY, ti[k] = INT64_MAX; /* sentinels lose to every logit */
    for (int64_t v = 0; v < V; v++) {
        if (!topk_better(lg[v], v, tv[K - 1], ti[K - 1])) continue;
        int k = K - 1;
        for (; k > 0 && topk_better(lg[v], v, tv[k - 1], ti[k - 1]); k--)
            tv[k] = tv[k - 1], ti[k] = ti[k - 1];
        tv[k] = lg[v], ti[k] = v;
    }
    for (int k = 0; k < K; k++) {
        idx[k] = ti[k] == INT64_MAX ? -1 : (int32_t)ti[k];
        val[k] = ti[k] == INT64_MAX ? NAN : (float)tv[k];
    }
}

// ----------------------------------------------------------------------------
// the chunked pass (p->K = 0: lm_ce without the top-K outputs)

static void lm_ce_chunk(const kn_lm_topk_params *p, int64_t r0, int64_t nr, const lm_ce_scratch *s) {
    const int64_t V = p->V, D = p->D;
    for (int64_t v = 0; v < V; v++) {
        const float *wr = w_row(p->w, p->wdt, v, D, s->wrow);
        for (int64_t i = 0; i < nr; i++) s->logits[i * V + v] = kn_ref_dot(p->h + (r0 + i) * D, wr, D);
    }
    for (int64_t i = 0; i < nr; i++) {
        double  *lg   = s->logits + i * V;
        int64_t  best = 0;
        for (int64_t v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v;
        double sum = 0;
        for (int64_t v = 0; v < V; v++) sum += exp(lg[v] - lg[best]);
        const double  lse = lg[best] + log(sum);
        const int64_t r   = r0 + i, lab = p->labels[r];
        p->ce[r]          = (float)(lse - lg[lab]);
        p->argmax[r]      = (int32_t)best;
        if (p->K > 0) {
            topk_row(lg, V, p->K, p->topk_idx + r * p->K, p->topk_val + r * p->K);
            p->label_logit[r] = (float)lg[lab];
        }
        if (p->dh) /* the logits become the dh coefficients gscale·(softmax − onehot) */
            for (int64_t v = 0; v < V; v++)
                lg[v] = (double)p->gscale[r] * (exp(lg[v] - lse) - (v == lab ? 1.0 : 0.0));
    }
    if (!p->dh) return;
    for (int64_t j = 0; j < nr * D; j++) s->acc[j] = 0;
    for (int64_t v = 0; v < V; v++) {
        const float *wr = w_row(p->w, p->wdt, v, D, s->wrow);
        for (int64_t i = 0; i < nr; i++) {
            const double cf = s->logits[i * V + v];
            double      *ac = s->acc + i * D;
            for (int64_t d = 0; d < D; d++) ac[d] += cf * (double)wr[d];
        }
    }
    for (int64_t i = 0; i < nr; i++)
        for (int64_t d = 0; d < D; d++) p->dh[(r0 + i) * D + d] = (float)s->acc[i * D + d];
}

/* Chunk `chunk` of KN_REF_LM_CE_ROWS rows, its scratch laid out as lm_ce_run sizes it. */
static void lm_ce_task(int64_t chunk, void *scratch, const void *user) {
    const kn_lm_topk_params *p = user;
    const int64_t            r0 = chunk * KN_REF_LM_CE_ROWS;
    const int64_t            nr = p->R - r0 < KN_REF_LM_CE_ROWS ? p->R - r0 : KN_REF_LM_CE_ROWS;
    double                  *logits = scratch, *acc = logits + (size_t)KN_REF_LM_CE_ROWS * p->V;
    const lm_ce_scratch      s = {logits, p->dh ? acc : NULL,
                                  (float *)(acc + (p->dh ? (size_t)KN_REF_LM_CE_ROWS * p->D : 0))};
    lm_ce_chunk(p, r0, nr, &s);
}

/* Validates what lm_ce and lm_ce_topk share (op names the entry in messages), then runs the
 * chunks in parallel. The caller has checked p->K and the top-K pointers. */
static cm_status lm_ce_run(const char *op, const kn_lm_topk_params *p) {
    const int64_t R = p->R, V = p->V, D = p->D;
    if (R == 0) return CM_OK;
    KN_REF_CHECK(p->ce && p->argmax && p->h && p->labels && p->w, "%s: ce, argmax, h, labels or w is NULL",
                 op);
    KN_REF_CHECK(!p->dh || p->gscale, "%s: gscale is NULL but dh is requested", op);
    for (int64_t r = 0; r < R; r++)
        KN_REF_CHECK(p->labels[r] >= 0 && p->labels[r] < V, "%s: label %d of row %lld is outside [0, V=%lld)",
                     op, (int)p->labels[r], (long long)r, (long long)V);

    /* per thread: logits, then the dh accumulators when dh is wanted, then a widened BF16 row of W */
    const size_t bytes = (size_t)KN_REF_LM_CE_ROWS * (size_t)(V + (p->dh ? D : 0)) * sizeof(double) +
                         (p->wdt == CM_DTYPE_BF16 ? (size_t)D * sizeof(float) : 0);
    return kn_ref_parallel(op, (R + KN_REF_LM_CE_ROWS - 1) / KN_REF_LM_CE_ROWS, 1, bytes, lm_ce_task, p);
}

/* The checks that come before R = 0 returns: context, shape, dtype. */
static cm_status lm_ce_check_shape(const char *op, kn_ctx *ctx, int64_t R, int64_t V, int64_t D,
                                   cm_dtype wdt) {
    KN_REF_CHECK(ctx, "%s: ctx is NULL", op);
    KN_REF_CHECK(R >= 0 && V > 0 && D > 0, "%s: bad shape R=%lld V=%lld D=%lld (R >= 0, V > 0, D > 0)", op,
                 (long long)R, (long long)V, (long long)D);
    KN_REF_CHECK(V <= INT32_MAX, "%s: V=%lld does not fit the I32 argmax", op, (long long)V);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: weight dtype %s is not supported (use F32 or BF16)", op,
                       cm_dtype_name(wdt));
    return CM_OK;
}

// ----------------------------------------------------------------------------
// entries

cm_status kn_ref_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h,
                       const int32_t *labels, const float *gscale, const void *w, cm_dtype wdt, int64_t R,
                       int64_t V, int64_t D) {
    CM_TRY(lm_ce_check_shape("lm_ce", ctx, R, V, D, wdt));
    const kn_lm_topk_params p = {
        .R = R, .V = V, .D = D, .K = 0, .h = h, .labels = labels, .gscale = gscale, .w = w, .wdt = wdt,
        .dh = dh, .ce = ce, .argmax = argmax,
    };
    return lm_ce_run("lm_ce", &p);
}

cm_status kn_ref_lm_ce_topk(kn_ctx *ctx, const kn_lm_topk_params *p) {
    KN_REF_CHECK(p, "lm_ce_topk: params are NULL");
    CM_TRY(lm_ce_check_shape("lm_ce_topk", ctx, p->R, p->V, p->D, p->wdt));
    KN_REF_CHECK(p->K >= 1 && p->K <= KN_TOPK_MAX, "lm_ce_topk: K=%d is outside [1, KN_TOPK_MAX=%d]", p->K,
                 KN_TOPK_MAX);
    KN_REF_CHECK(p->K <= p->V, "lm_ce_topk: K=%d exceeds the vocabulary size V=%lld", p->K, (long long)p->V);
    if (p->R == 0) return CM_OK;
    KN_REF_CHECK(p->topk_idx && p->topk_val && p->label_logit,
                 "lm_ce_topk: topk_idx, topk_val or label_logit is NULL");
    return lm_ce_run("lm_ce_topk", p);
}
