/* kernels/ref/kn_optim_multi_ref.c — the reference multi-tensor optimizer step: the squared
 * global gradient norm of a table of tensors and AdamW over all of them with the clip factor
 * taken from that norm. Specified through kn_ref_sumsq and kn_ref_adamw, so the cpu optimizer
 * computes exactly what its per-tensor calls did: each tensor's sum of squares (fixed chunks),
 * added in table order; the clip factor min(1, clip / (norm + 1e-6)) in double, rounded to
 * F32 as kn_adamw_params.grad_scale; a tensor's w16 copy, the updated values rounded to bf16.
 * The table is host memory like every cpu buffer. */
#include "kn_ref.h"

static cm_status table_check(const char *op, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks) {
    KN_REF_CHECK(n_tensors >= 0 && (table || n_tensors == 0), "%s: table is NULL or n_tensors=%d < 0", op,
                 n_tensors);
    int64_t chunks = 0;
    for (int t = 0; t < n_tensors; t++) {
        KN_REF_CHECK(table[t].n >= 0 && table[t].chunk0 == chunks,
                     "%s: tensor %d has n=%lld and chunk0=%lld; expected n >= 0 and chunk0=%lld", op, t,
                     (long long)table[t].n, (long long)table[t].chunk0, (long long)chunks);
        chunks += (table[t].n + KN_MT_CHUNK - 1) / KN_MT_CHUNK;
    }
    KN_REF_CHECK(chunks == n_chunks, "%s: the table has %lld chunks, not n_chunks=%lld", op, (long long)chunks,
                 (long long)n_chunks);
    return CM_OK;
}

cm_status kn_ref_sumsq_multi(kn_ctx *ctx, double *out, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks) {
    KN_REF_CHECK(ctx && out, "sumsq_multi: ctx or out is NULL");
    CM_TRY(table_check("sumsq_multi", table, n_tensors, n_chunks));
    double total = 0;
    for (int t = 0; t < n_tensors; t++) {
        double s = 0;
        CM_TRY(kn_ref_sumsq(ctx, &s, table[t].grad, table[t].n));
        total += s;
    }
    *out = total;
    return CM_OK;
}

cm_status kn_ref_adamw_multi(kn_ctx *ctx, const kn_mt_tensor *table, int n_tensors, int64_t n_chunks,
                             const kn_adamw_params *p, const double *sumsq, double clip) {
    KN_REF_CHECK(ctx && p && sumsq, "adamw_multi: ctx, params or sumsq is NULL");
    KN_REF_CHECK(isfinite(clip), "adamw_multi: clip=%g must be finite", clip);
    CM_TRY(table_check("adamw_multi", table, n_tensors, n_chunks));
    const double norm = sqrt(*sumsq);
    if (!isfinite(norm))
        return CM_OK;
    double scale = 1.0;
    if (clip > 0) {
        scale = clip / (norm + 1e-6);
        scale = scale < 1.0 ? scale : 1.0;
    }
    kn_adamw_params q = *p;
    q.grad_scale = (float)scale;
    for (int t = 0; t < n_tensors; t++) {
        CM_TRY(kn_ref_adamw(ctx, table[t].param, table[t].grad, table[t].m, table[t].v, table[t].n, &q));
        if (table[t].w16)
            for (int64_t i = 0; i < table[t].n; i++)
                table[t].w16[i] = cm_f32_to_bf16(table[t].param[i]);
    }
    return CM_OK;
}
