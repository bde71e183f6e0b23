/* kernels/ref/kn_moe_ref.c — the mixture-of-experts ops (kn_backend.h, "mixture of experts"):
 * routing (softmax, top-K, renormalisation), grouping the T·K assignments by expert, the
 * gather of each token's row to its sorted rows and the weighted combine. Unlike the rest of
 * ref/, the arithmetic is fp32 in the order the header states (a router's choice must be the
 * choice the CUDA kernel makes, so the reference does the kernel's operations, not more exact
 * ones). The combine's products and sums are separate roundings where the compiler does not
 * contract them into FMAs (x86-64 without -mfma); its tests allow either. The index tables (idx,
 * src, dst) are host memory here and validated. Tokens run in parallel under OpenMP, each computed by one
 * thread, so any thread count gives the same bits; the grouping is one serial pass. */
#include "kn_ref.h"

#include <stdlib.h>
#include <string.h>

static cm_status moe_rows_check(const char *op, int64_t T, int K) {
    KN_REF_CHECK(T >= 0 && K >= 1, "%s: bad shape T=%lld K=%d (T must be >= 0, K >= 1)", op, (long long)T, K);
    KN_REF_CHECK(T <= INT32_MAX / K, "%s: T=%lld x K=%d assignments do not fit the I32 tables", op, (long long)T,
                 K);
    return CM_OK;
}

/* a ranks above b: the larger probability; a NaN (from a NaN or infinite logit) ranks below
 * every number, so the choice stays K distinct experts whatever the logits */
static int moe_above(float a, float b) {
    return !isnan(a) && (isnan(b) || a > b);
}

cm_status kn_ref_moe_route(kn_ctx *ctx, int32_t *idx, float *w, const float *logits, int64_t T, int E, int K,
                           int renorm) {
    KN_REF_CHECK(ctx, "moe_route: ctx is NULL");
    KN_REF_CHECK(T >= 0, "moe_route: T=%lld must be >= 0", (long long)T);
    KN_REF_CHECK(K >= 1 && K <= E && E <= KN_MOE_MAX_EXPERTS,
                 "moe_route: bad experts E=%d K=%d (need 1 <= K <= E <= %d)", E, K, KN_MOE_MAX_EXPERTS);
    if (T == 0) return CM_OK;
    KN_REF_CHECK(idx && w && logits, "moe_route: idx, w or logits is NULL");
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float        p[KN_MOE_MAX_EXPERTS];
        char         taken[KN_MOE_MAX_EXPERTS] = {0};
        float        m = l[0], sum = 0.0f;
        for (int e = 1; e < E; e++)
            if (l[e] > m) m = l[e];
        for (int e = 0; e < E; e++) {
            p[e] = expf(l[e] - m);
            sum += p[e];
        }
        for (int e = 0; e < E; e++) p[e] = p[e] / sum;
        /* K rounds of selection; the scan keeps the first of equals, so ties go to the lower index */
        int32_t *ti = idx + t * K;
        float   *tw = w + t * K;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || moe_above(p[e], p[best]))) best = e;
            taken[best] = 1;
            ti[k] = best;
            tw[k] = p[best];
        }
        if (renorm) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += tw[k];
            for (int k = 0; k < K; k++) tw[k] = tw[k] / s;
        }
    }
    return CM_OK;
}

cm_status kn_ref_moe_group(kn_ctx *ctx, int32_t *offsets, int32_t *src, int32_t *dst, const int32_t *idx, int64_t T,
                           int E, int K) {
    KN_REF_CHECK(ctx, "moe_group: ctx is NULL");
    CM_TRY(moe_rows_check("moe_group", T, K));
    KN_REF_CHECK(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "moe_group: E=%d experts is outside [1, %d]", E,
                 KN_MOE_MAX_EXPERTS);
    KN_REF_CHECK(offsets, "moe_group: offsets is NULL");
    const int64_t n = T * K;
    if (n > 0) KN_REF_CHECK(src && dst && idx, "moe_group: src, dst or idx is NULL");
    for (int64_t a = 0; a < n; a++)
        KN_REF_CHECK(idx[a] >= 0 && idx[a] < E, "moe_group: idx[%lld]=%d is outside [0, E=%d)", (long long)a,
                     (int)idx[a], E);
    /* a counting sort: counts, their exclusive sum, then one pass in a order (stable) */
    int32_t next[KN_MOE_MAX_EXPERTS] = {0};
    for (int64_t a = 0; a < n; a++) next[idx[a]]++;
    int32_t run = 0;
    for (int e = 0; e < E; e++) {
        offsets[e] = run;
        run += next[e];
        next[e] = offsets[e];
    }
    offsets[E] = run;
    for (int64_t a = 0; a < n; a++) {
        const int32_t j = next[idx[a]]++;
        src[j] = (int32_t)a;
        dst[a] = j;
    }
    return CM_OK;
}

cm_status kn_ref_moe_gather(kn_ctx *ctx, void *out, const void *in, cm_dtype dt, const int32_t *src, int64_t T, int K,
                            int64_t D) {
    KN_REF_CHECK(ctx, "moe_gather: ctx is NULL");
    CM_TRY(moe_rows_check("moe_gather", T, K));
    KN_REF_CHECK(D >= 0, "moe_gather: D=%lld must be >= 0", (long long)D);
    if (dt != CM_DTYPE_F32 && dt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "moe_gather: dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(dt));
    const int64_t n = T * K;
    if (n == 0 || D == 0) return CM_OK;
    KN_REF_CHECK(out && in && src, "moe_gather: out, in or src is NULL");
    for (int64_t j = 0; j < n; j++)
        KN_REF_CHECK(src[j] >= 0 && src[j] < n, "moe_gather: src[%lld]=%d is outside [0, T*K=%lld)", (long long)j,
                     (int)src[j], (long long)n);
    const size_t row = (size_t)D * cm_dtype_size(dt);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t j = 0; j < n; j++)
        memcpy((char *)out + (size_t)j * row, (const char *)in + (size_t)(src[j] / K) * row, row);
    return CM_OK;
}

cm_status kn_ref_moe_combine(kn_ctx *ctx, float *out, const float *y, const int32_t *dst, const float *w,
                             const float *shared, const float *sgate, int64_t T, int K, int64_t D) {
    KN_REF_CHECK(ctx, "moe_combine: ctx is NULL");
    CM_TRY(moe_rows_check("moe_combine", T, K));
    KN_REF_CHECK(D >= 0, "moe_combine: D=%lld must be >= 0", (long long)D);
    const int64_t n = T * K;
    if (n == 0 || D == 0) return CM_OK;
    KN_REF_CHECK(out && y && dst && w, "moe_combine: out, y, dst or w is NULL");
    KN_REF_CHECK(!shared || sgate, "moe_combine: shared is given without sgate");
    for (int64_t a = 0; a < n; a++)
        KN_REF_CHECK(dst[a] >= 0 && dst[a] < n, "moe_combine: dst[%lld]=%d is outside [0, T*K=%lld)", (long long)a,
                     (int)dst[a], (long long)n);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t t = 0; t < T; t++) {
        float      *o = out + t * D;
        const float g = shared ? 1.0f / (1.0f + expf(-sgate[t])) : 0.0f;
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                const float term = w[t * K + k] * y[(int64_t)dst[t * K + k] * D + d];
                acc = acc + term;
            }
            if (shared) acc = acc + g * shared[t * D + d];
            o[d] = acc;
        }
    }
    return CM_OK;
}

/* The grouping both moe_gemm entries read: offsets ascending within [0, R], src within [0, R). */
static cm_status rows_check(const char *op, const int32_t *offsets, const int32_t *src, int64_t R, int E) {
    KN_REF_CHECK(offsets[0] >= 0 && offsets[E] <= R, "%s: offsets run from %d to %d, outside [0, R=%lld]", op,
                 (int)offsets[0], (int)offsets[E], (long long)R);
    for (int e = 0; e < E; e++)
        KN_REF_CHECK(offsets[e] <= offsets[e + 1], "%s: offsets[%d]=%d > offsets[%d]=%d (not ascending)", op, e,
                     (int)offsets[e], e + 1, (int)offsets[e + 1]);
    for (int64_t j = 0; src && j < offsets[E]; j++)
        KN_REF_CHECK(src[j] >= 0 && src[j] < R, "%s: src[%lld]=%d is outside [0, R=%lld)", op, (long long)j,
                     (int)src[j], (long long)R);
    return CM_OK;
}

cm_status kn_ref_moe_gemm(kn_ctx *ctx, float *out0, float *out1, const uint16_t *inp, const int32_t *src, int topk,
                          const uint16_t *const *w0, const uint16_t *const *w1, const int32_t *offsets, int64_t R,
                          int E, int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "moe_gemm: ctx is NULL");
    KN_REF_CHECK(R >= 0 && N >= 0 && K >= 0 && R <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
                 "moe_gemm: bad shape R=%lld N=%lld K=%lld (each in [0, 2^31))", (long long)R, (long long)N,
                 (long long)K);
    KN_REF_CHECK(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "moe_gemm: E=%d experts is outside [1, %d]", E,
                 KN_MOE_MAX_EXPERTS);
    KN_REF_CHECK(!out1 == !w1, "moe_gemm: out1 and w1 go together (both or neither)");
    KN_REF_CHECK(!src || topk >= 1, "moe_gemm: topk=%d must be >= 1 with src", topk);
    if (R == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(out0 && inp && w0 && offsets, "moe_gemm: out0, inp, w0 or offsets is NULL");
    KN_REF_CHECK(K % 8 == 0, "moe_gemm: K=%lld must be a multiple of 8 (rows are read 16 bytes at a time); use "
                 "gemm_bf16in per expert otherwise", (long long)K);
    CM_TRY(rows_check("moe_gemm", offsets, src, R, E));
    for (int s = 0; s < (out1 ? 2 : 1); s++) {
        float                 *out = s ? out1 : out0;
        const uint16_t *const *w   = s ? w1 : w0;
        for (int e = 0; e < E; e++) {
            const int64_t r0 = offsets[e], r1 = offsets[e + 1];
            if (r1 > r0) KN_REF_CHECK(w[e], "moe_gemm: expert %d has rows but no weights", e);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
            for (int64_t r = r0; r < r1; r++)
                for (int64_t n = 0; n < N; n++) {
                    const uint16_t *x   = inp + (src ? src[r] / topk : r) * K;
                    double          acc = 0.0;
                    for (int64_t k = 0; k < K; k++)
                        acc += (double)cm_bf16_to_f32(x[k]) * (double)cm_bf16_to_f32(w[e][n * K + k]);
                    out[r * N + n] = (float)acc;
                }
        }
    }
    return CM_OK;
}

cm_status kn_ref_moe_gemm_swiglu(kn_ctx *ctx, uint16_t *act, const uint16_t *inp, const int32_t *src, int topk,
                                 const uint16_t *const *wg, const uint16_t *const *wu, const int32_t *offsets,
                                 int64_t R, int E, int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "moe_gemm_swiglu: ctx is NULL");
    KN_REF_CHECK(R >= 0 && N >= 0 && R <= INT32_MAX && N <= INT32_MAX, "moe_gemm_swiglu: bad shape R=%lld N=%lld",
                 (long long)R, (long long)N);
    KN_REF_CHECK(wu || R == 0 || N == 0, "moe_gemm_swiglu: out, inp, w0, w1 or offsets is NULL (wu)");
    if (R == 0 || N == 0) return kn_ref_moe_gemm(ctx, NULL, NULL, inp, src, topk, wg, NULL, offsets, R, E, N, K);
    const size_t n = (size_t)R * (size_t)N;
    float       *g = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float));
    cm_status    st = g && u ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "moe_gemm_swiglu: cannot allocate 2 x %zu floats", n);
    if (st == CM_OK) st = kn_ref_moe_gemm(ctx, g, u, inp, src, topk, wg, wu, offsets, R, E, N, K);
    /* rows past offsets[E] are not written: act there is left as it was */
    if (st == CM_OK) st = kn_ref_swiglu_bf16(ctx, act, g, u, (int64_t)offsets[E] * N);
    free(g);
    free(u);
    return st;
}

cm_status kn_ref_moe_gemm_fp8(kn_ctx *ctx, float *out0, float *out1, const uint8_t *q, const float *s, int64_t Mq,
                              const int32_t *src, int topk, const uint8_t *const *w0, const float *const *s0,
                              const uint8_t *const *w1, const float *const *s1, const int32_t *offsets, int64_t R,
                              int E, int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "moe_gemm_fp8: ctx is NULL");
    KN_REF_CHECK(R >= 0 && N >= 0 && K >= 0 && R <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
                 "moe_gemm_fp8: bad shape R=%lld N=%lld K=%lld (each in [0, 2^31))", (long long)R, (long long)N,
                 (long long)K);
    KN_REF_CHECK(E >= 1 && E <= KN_MOE_MAX_EXPERTS, "moe_gemm_fp8: E=%d experts is outside [1, %d]", E,
                 KN_MOE_MAX_EXPERTS);
    KN_REF_CHECK(!out1 == !w1 && !w1 == !s1, "moe_gemm_fp8: out1, w1 and s1 go together (all or none)");
    KN_REF_CHECK(!src || topk >= 1, "moe_gemm_fp8: topk=%d must be >= 1 with src", topk);
    if (R == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(out0 && q && s && w0 && s0 && offsets, "moe_gemm_fp8: out0, q, s, w0, s0 or offsets is NULL");
    CM_TRY(rows_check("moe_gemm_fp8", offsets, src, R, E));
    const int64_t L = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    for (int64_t j = 0; j < offsets[E]; j++) {
        const int64_t r = src ? src[j] / topk : j;
        KN_REF_CHECK(r < Mq, "moe_gemm_fp8: row %lld of the input is past its Mq=%lld quantized rows", (long long)r,
                     (long long)Mq);
    }
    /* the largest expert's rows, gathered as fp8_quantize_rows would have written them */
    int64_t most = 0;
    for (int e = 0; e < E; e++) most = offsets[e + 1] - offsets[e] > most ? offsets[e + 1] - offsets[e] : most;
    const int64_t mp = kn_fp8_rows(most);
    uint8_t      *gq = malloc((size_t)(mp * K) + 1);
    float        *gs = malloc((size_t)(mp * L + 1) * sizeof *gs);
    cm_status     st = gq && gs ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "moe_gemm_fp8: cannot allocate %lld gathered rows",
                                                  (long long)most);
    for (int e = 0; e < E && st == CM_OK; e++) {
        const int64_t r0 = offsets[e], n = offsets[e + 1] - r0, np = kn_fp8_rows(n);
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = src ? src[r0 + i] / topk : r0 + i;
            memcpy(gq + i * K, q + r * K, (size_t)K);
            for (int64_t g = 0; g < L; g++) gs[g * np + i] = s[g * Mq + r];
        }
        for (int set = 0; set < (out1 ? 2 : 1) && st == CM_OK; set++) {
            const uint8_t *w  = (set ? w1 : w0)[e];
            const float   *ws = (set ? s1 : s0)[e];
            KN_REF_CHECK(w && ws, "moe_gemm_fp8: expert %d has rows but no weights", e);
            st = kn_ref_gemm_fp8q(ctx, (set ? out1 : out0) + r0 * N, CM_DTYPE_F32, gq, gs, w, ws, n, N, K);
        }
    }
    free(gq);
    free(gs);
    return st;
}
