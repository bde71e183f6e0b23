/* kernels/ref/kn_conv1d_ref.c — reference causal depthwise conv1d + SiLU over packed
 * sequences (the GDN short conv, docs/target.md): out[t, c] = silu(Σ_{j<K} w[c, j] ·
 * x[t − (K−1) + j, c]) where taps before the sequence start read 0, so w[c, K−1] multiplies
 * the current token and a sequence's first token sees only itself. Double accumulation.
 * out must not overlap x (the op reads earlier tokens after writing later rows). Also
 * gdn_conv_qkv, the conv with the q/k/v split and q/k l2norm, defined by composition. */
#include "kn_ref.h"

#include <stdlib.h>

cm_status kn_ref_conv1d_silu(kn_ctx *ctx, float *out, const float *x, const float *w,
                             const int32_t *cu_seqlens, int n_seq, int64_t T, int64_t C, int K) {
    KN_REF_CHECK(ctx, "conv1d_silu: ctx is NULL");
    KN_REF_CHECK(T >= 0 && C > 0 && K > 0, "conv1d_silu: bad shape T=%lld C=%lld K=%d (T >= 0, C > 0, K > 0)",
                 (long long)T, (long long)C, K);
    CM_TRY(kn_ref_seqlens_check("conv1d_silu", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(out && x && w, "conv1d_silu: out, x or w is NULL");
    const uintptr_t o0 = (uintptr_t)out, x0 = (uintptr_t)x, bytes = (uintptr_t)(T * C) * sizeof(float);
    KN_REF_CHECK(o0 + bytes <= x0 || x0 + bytes <= o0, "conv1d_silu: out overlaps x (use a separate buffer)");

    for (int s = 0; s < n_seq; s++) {
        const int64_t bos = cu_seqlens[s], eos = cu_seqlens[s + 1];
        for (int64_t t = bos; t < eos; t++) {
            for (int64_t c = 0; c < C; c++) {
                double acc = 0;
                for (int j = 0; j < K; j++) {
                    int64_t src = t - (K - 1) + j;
                    if (src < bos) continue;
                    acc += (double)w[c * K + j] * (double)x[src * C + c];
                }
                out[t * C + c] = (float)kn_ref_silu(acc);
            }
        }
    }
    return CM_OK;
}

/* The GDN short-conv block: literally conv1d_silu, the q/k/v column splits and the q/k head
 * l2norms, through a [T, C] scratch. */
cm_status kn_ref_gdn_conv_qkv(kn_ctx *ctx, float *q, float *k, float *v, const float *x, const float *w,
                              const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv, int dk, int dv,
                              int K, float eps) {
    KN_REF_CHECK(ctx, "gdn_conv_qkv: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0 && K > 0,
                 "gdn_conv_qkv: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d K=%d (T >= 0, the others > 0)",
                 (long long)T, nk, nv, dk, dv, K);
    KN_REF_CHECK(eps >= 0, "gdn_conv_qkv: eps=%g must be >= 0", (double)eps);
    CM_TRY(kn_ref_seqlens_check("gdn_conv_qkv", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(q && k && v && x && w, "gdn_conv_qkv: q, k, v, x or w is NULL");
    const int64_t qk = (int64_t)nk * dk, C = 2 * qk + (int64_t)nv * dv;
    float        *y  = malloc((size_t)(T * C) * sizeof(float));
    if (!y) return CM_FAIL(CM_ERR_NOMEM, "gdn_conv_qkv: cannot allocate %lld floats of scratch", (long long)(T * C));
    cm_status st = kn_ref_conv1d_silu(ctx, y, x, w, cu_seqlens, n_seq, T, C, K);
    if (st == CM_OK) st = kn_ref_copy2d(ctx, q, qk, y, C, T, qk);
    if (st == CM_OK) st = kn_ref_copy2d(ctx, k, qk, y + qk, C, T, qk);
    if (st == CM_OK) st = kn_ref_copy2d(ctx, v, (int64_t)nv * dv, y + 2 * qk, C, T, (int64_t)nv * dv);
    if (st == CM_OK) st = kn_ref_l2norm(ctx, q, q, T * nk, dk, eps);
    if (st == CM_OK) st = kn_ref_l2norm(ctx, k, k, T * nk, dk, eps);
    free(y);
    return st;
}

cm_status kn_ref_gdn_conv_qkv_bf16(kn_ctx *ctx, uint16_t *q, uint16_t *k, uint16_t *v, const float *x,
                                   const float *w, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk, int nv,
                                   int dk, int dv, int K, float eps, float q_scale) {
    KN_REF_CHECK(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                 "gdn_conv_qkv_bf16: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d (T >= 0, the others > 0)",
                 (long long)T, nk, nv, dk, dv);
    if (T == 0)
        return kn_ref_gdn_conv_qkv(ctx, NULL, NULL, NULL, x, w, cu_seqlens, n_seq, T, nk, nv, dk, dv, K, eps);
    KN_REF_CHECK(q && k && v, "gdn_conv_qkv_bf16: q, k or v is NULL");
    const int64_t nq = T * nk * dk, nvv = T * nv * dv;
    float        *f = malloc((size_t)(2 * nq + nvv) * sizeof(float));
    if (!f)
        return CM_FAIL(CM_ERR_NOMEM, "gdn_conv_qkv_bf16: cannot allocate %lld floats of scratch",
                       (long long)(2 * nq + nvv));
    cm_status st =
        kn_ref_gdn_conv_qkv(ctx, f, f + nq, f + 2 * nq, x, w, cu_seqlens, n_seq, T, nk, nv, dk, dv, K, eps);
    if (st == CM_OK) {
        for (int64_t i = 0; i < nq; i++) q[i] = cm_f32_to_bf16(f[i] * q_scale);
        for (int64_t i = 0; i < nq; i++) k[i] = cm_f32_to_bf16(f[nq + i]);
        for (int64_t i = 0; i < nvv; i++) v[i] = cm_f32_to_bf16(f[2 * nq + i]);
    }
    free(f);
    return st;
}
