/* kernels/ref/kn_gemm_ref.c — reference GEMM: out[M, N] = inp[M, K] · W[N, K]ᵀ, W in F32 or
 * BF16. Every output is one kn_ref_dot over K of F32 values (BF16 widened exactly): exact
 * products, a double sum, one rounding. Work is split into tiles of GEMM_MB inp rows ×
 * GEMM_NB W rows, run in parallel under OpenMP; a BF16 tile of W is widened once per tile
 * into a per-thread buffer, so the inner loop is F32 × F32. Fast enough for CPU training of
 * small drafters; not a tuned BLAS. */
#include "kn_ref.h"

#include <stdlib.h>

#define GEMM_MB 16
#define GEMM_NB 16

cm_status kn_ref_gemm(kn_ctx *ctx, float *out, const float *inp, const void *w, cm_dtype wdt, int64_t M,
                      int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "gemm: ctx is NULL");
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                 (long long)M, (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (M == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(out && inp && (w || K == 0), "gemm: out, inp or w is NULL");

    const int64_t n_mt    = (M + GEMM_MB - 1) / GEMM_MB;
    const int64_t n_nt    = (N + GEMM_NB - 1) / GEMM_NB;
    const int64_t n_tiles = n_mt * n_nt;
    const int     widen   = wdt == CM_DTYPE_BF16;
    int           failed  = 0;

#ifdef _OPENMP
#pragma omp parallel
#endif
    {
        float *wbuf = NULL;
        if (widen) {
            wbuf = malloc((size_t)GEMM_NB * (size_t)(K > 0 ? K : 1) * sizeof(float));
            if (!wbuf) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
                failed = 1;
            }
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t tile = 0; tile < n_tiles; tile++) {
            if (widen && !wbuf) continue;
            const int64_t m0 = (tile / n_nt) * GEMM_MB, m1 = m0 + GEMM_MB < M ? m0 + GEMM_MB : M;
            const int64_t n0 = (tile % n_nt) * GEMM_NB, n1 = n0 + GEMM_NB < N ? n0 + GEMM_NB : N;
            const float  *wt;
            if (widen) {
                const uint16_t *src = (const uint16_t *)w + n0 * K;
                for (int64_t i = 0; i < (n1 - n0) * K; i++) wbuf[i] = cm_bf16_to_f32(src[i]);
                wt = wbuf;
            } else {
                wt = (const float *)w + n0 * K;
            }
            for (int64_t m = m0; m < m1; m++) {
                const float *a = inp + m * K;
                for (int64_t n = n0; n < n1; n++) out[m * N + n] = (float)kn_ref_dot(a, wt + (n - n0) * K, K);
            }
        }
        free(wbuf);
    }
    if (failed)
        return CM_FAIL(CM_ERR_NOMEM, "gemm: cannot allocate a %d x %lld widening buffer", GEMM_NB,
                       (long long)K);
    return CM_OK;
}
