/* kernels/ref/kn_conv1d_ref.c — reference causal depthwise conv1d + SiLU over packed
 * sequences (the GDN short conv, qwen_hybrid.md §3.4): out[t, c] = silu(Σ_{j<K} w[c, j] ·
 * x[t − (K−1) + j, c]) where taps before the sequence start read 0, so w[c, K−1] multiplies
 * the current token and a sequence's first token sees only itself. Double accumulation.
 * out must not overlap x (the op reads earlier tokens after writing later rows). */
#include "kn_ref.h"

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
