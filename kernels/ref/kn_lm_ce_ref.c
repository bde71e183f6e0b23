/* kernels/ref/kn_lm_ce_ref.c — reference fused LM head + cross-entropy: for each of R rows,
 * logits = h·Wᵀ in double (one kn_ref_dot per vocabulary entry), lse = max + log Σ exp(· −
 * max), ce = lse − logits[label], argmax (the lowest index among equal largest logits), and
 * dh = gscale·(softmax − onehot)·W summed in double over the vocabulary in order. Rows go in
 * chunks of KN_REF_LM_CE_ROWS that run in parallel; a chunk shares each row of W (widened
 * once when BF16) between its rows, and its per-thread scratch is KN_REF_LM_CE_ROWS × V
 * logits plus KN_REF_LM_CE_ROWS × D accumulators, never R × V. Each row is computed by one
 * thread in a fixed order, so results do not depend on the thread count. */
#include "kn_ref.h"

#include <stdlib.h>

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

static void lm_ce_chunk(float *dh, float *ce, int32_t *argmax, const float *h, const int32_t *labels,
                        const float *gscale, const void *w, cm_dtype wdt, int64_t r0, int64_t nr, int64_t V,
                        int64_t D, const lm_ce_scratch *s) {
    for (int64_t v = 0; v < V; v++) {
        const float *wr = w_row(w, wdt, v, D, s->wrow);
        for (int64_t i = 0; i < nr; i++) s->logits[i * V + v] = kn_ref_dot(h + (r0 + i) * D, wr, D);
    }
    for (int64_t i = 0; i < nr; i++) {
        double *lg   = s->logits + i * V;
        int64_t best = 0;
        for (int64_t v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v;
        double sum = 0;
        for (int64_t v = 0; v < V; v++) sum += exp(lg[v] - lg[best]);
        const double  lse = lg[best] + log(sum);
        const int64_t r   = r0 + i;
        ce[r]             = (float)(lse - lg[labels[r]]);
        argmax[r]         = (int32_t)best;
        if (dh) /* the logits become the dh coefficients gscale·(softmax − onehot) */
            for (int64_t v = 0; v < V; v++)
                lg[v] = (double)gscale[r] * (exp(lg[v] - lse) - (v == labels[r] ? 1.0 : 0.0));
    }
    if (!dh) return;
    for (int64_t j = 0; j < nr * D; j++) s->acc[j] = 0;
    for (int64_t v = 0; v < V; v++) {
        const float *wr = w_row(w, wdt, v, D, s->wrow);
        for (int64_t i = 0; i < nr; i++) {
            const double cf = s->logits[i * V + v];
            double      *ac = s->acc + i * D;
            for (int64_t d = 0; d < D; d++) ac[d] += cf * (double)wr[d];
        }
    }
    for (int64_t i = 0; i < nr; i++)
        for (int64_t d = 0; d < D; d++) dh[(r0 + i) * D + d] = (float)s->acc[i * D + d];
}

cm_status kn_ref_lm_ce(kn_ctx *ctx, float *dh, float *ce, int32_t *argmax, const float *h,
                       const int32_t *labels, const float *gscale, const void *w, cm_dtype wdt, int64_t R,
                       int64_t V, int64_t D) {
    KN_REF_CHECK(ctx, "lm_ce: ctx is NULL");
    KN_REF_CHECK(R >= 0 && V > 0 && D > 0, "lm_ce: bad shape R=%lld V=%lld D=%lld (R >= 0, V > 0, D > 0)",
                 (long long)R, (long long)V, (long long)D);
    KN_REF_CHECK(V <= INT32_MAX, "lm_ce: V=%lld does not fit the I32 argmax", (long long)V);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "lm_ce: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (R == 0) return CM_OK;
    KN_REF_CHECK(ce && argmax && h && labels && w, "lm_ce: ce, argmax, h, labels or w is NULL");
    KN_REF_CHECK(!dh || gscale, "lm_ce: gscale is NULL but dh is requested");
    for (int64_t r = 0; r < R; r++)
        KN_REF_CHECK(labels[r] >= 0 && labels[r] < V, "lm_ce: label %d of row %lld is outside [0, V=%lld)",
                     (int)labels[r], (long long)r, (long long)V);

    const int64_t n_chunks = (R + KN_REF_LM_CE_ROWS - 1) / KN_REF_LM_CE_ROWS;
    int           failed   = 0;
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
        lm_ce_scratch s = {
            malloc((size_t)KN_REF_LM_CE_ROWS * (size_t)V * sizeof(double)),
            dh ? malloc((size_t)KN_REF_LM_CE_ROWS * (size_t)D * sizeof(double)) : NULL,
            wdt == CM_DTYPE_BF16 ? malloc((size_t)D * sizeof(float)) : NULL,
        };
        const int ok = s.logits && (!dh || s.acc) && (wdt != CM_DTYPE_BF16 || s.wrow);
        if (!ok) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t chunk = 0; chunk < n_chunks; chunk++) {
            if (!ok) continue;
            const int64_t r0 = chunk * KN_REF_LM_CE_ROWS;
            const int64_t nr = R - r0 < KN_REF_LM_CE_ROWS ? R - r0 : KN_REF_LM_CE_ROWS;
            lm_ce_chunk(dh, ce, argmax, h, labels, gscale, w, wdt, r0, nr, V, D, &s);
        }
        free(s.wrow);
        free(s.acc);
        free(s.logits);
    }
    if (failed)
        return CM_FAIL(CM_ERR_NOMEM, "lm_ce: cannot allocate scratch for %d x %lld logits", KN_REF_LM_CE_ROWS,
                       (long long)V);
    return CM_OK;
}
