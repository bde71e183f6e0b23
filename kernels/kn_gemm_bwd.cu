/* kernels/kn_gemm_bwd.cu — the GEMM backward pair through cuBLASLt (kn_cuda_lt_matmul,
 * kn_gemm_plan.cu).
 *   gemm_dx: dinp[M, K] (= or +=) dout[M, N] · W[N, K]
 *   gemm_dw: dw[N, K] += dout[M, N]ᵀ · inp[M, K]
 * cuBLAS is column-major, so each computes the transpose of its row-major output:
 *   gemm_dx: dinpᵀ (K×M, ld K) = W (stored K×N col-major, op N) · doutᵀ (stored N×M, op N)
 *   gemm_dw: dwᵀ   (K×N, ld K) = inpᵀ (stored K×M, op N) · dout (stored N×M, op T)
 * Modes follow gemm (kn_gemm.cu): BF16 rounds every F32 operand to bf16 (nearest even) into
 * the ctx scratch and uses BF16 weights as stored; F32 widens BF16 weights into scratch and
 * runs true fp32 math (CUBLAS_COMPUTE_32F, no TF32). Accumulation is fp32 in both; the
 * accumulate flag is cuBLASLt's beta = 1 (C read and written by the same kernel), so no
 * separate add pass. */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "kn_cuda_ops.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// launchers

static size_t round_up_256(size_t x) {
    return (x + 255) / 256 * 256;
}

/* The operands of one backward GEMM in the ctx's mode: `act` is an F32 activation (always
 * F32), `w` an F32 or BF16 second operand. Converted copies live in ctx->scratch. */
static cm_status operands(kn_ctx *ctx, const float *act, int64_t n_act, const void *w, cm_dtype wdt,
                          int64_t n_w, const void **act_op, const void **w_op, cudaDataType_t *ab_type) {
    *act_op = act;
    *w_op = w;
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16) {
        *ab_type = CUDA_R_16BF;
        size_t act_size = round_up_256((size_t)n_act * sizeof(__nv_bfloat16));
        size_t w_size = wdt == CM_DTYPE_F32 ? (size_t)n_w * sizeof(__nv_bfloat16) : 0;
        CM_TRY(kn_cuda_scratch_reserve(ctx, act_size + w_size));
        CM_TRY(kn_cuda_f32_to_bf16(ctx, ctx->scratch, act, n_act));
        *act_op = ctx->scratch;
        if (wdt == CM_DTYPE_F32) {
            void *w_bf = (char *)ctx->scratch + act_size;
            CM_TRY(kn_cuda_f32_to_bf16(ctx, w_bf, (const float *)w, n_w));
            *w_op = w_bf;
        }
    } else {
        *ab_type = CUDA_R_32F;
        if (wdt == CM_DTYPE_BF16) {
            CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)n_w * sizeof(float)));
            CM_TRY(kn_cuda_bf16_to_f32(ctx, (float *)ctx->scratch, w, n_w));
            *w_op = ctx->scratch;
        }
    }
    return CM_OK;
}

cm_status kn_cuda_gemm_dx(kn_ctx *ctx, float *dinp, const float *dout, const void *w, cm_dtype wdt, int64_t M,
                          int64_t N, int64_t K, int accumulate) {
    KN_CUDA_CHECK_ARG(ctx, "gemm_dx: ctx is NULL");
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0,
                      "gemm_dx: bad shape M=%lld N=%lld K=%lld (each must be >= 0)", (long long)M,
                      (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm_dx: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (M == 0 || K == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dinp && (N == 0 || (dout && w)), "gemm_dx: dinp, dout or w is NULL");
    if (N == 0) { /* an empty sum: zeros, or nothing to add */
        if (!accumulate)
            KN_CUDA(cudaMemsetAsync(dinp, 0, (size_t)M * (size_t)K * sizeof(float), ctx->stream));
        return CM_OK;
    }
    const void    *d_op, *w_op;
    cudaDataType_t ab;
    CM_TRY(operands(ctx, dout, M * N, w, wdt, N * K, &d_op, &w_op, &ab));
    return kn_cuda_lt_matmul(ctx, "gemm_dx", ab, 0, 0, K, M, N, w_op, K, d_op, N, accumulate ? 1.0f : 0.0f,
                             dinp, K);
}

cm_status kn_cuda_gemm_dw(kn_ctx *ctx, float *dw, const float *dout, const float *inp, int64_t M, int64_t N,
                          int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "gemm_dw: ctx is NULL");
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0,
                      "gemm_dw: bad shape M=%lld N=%lld K=%lld (each must be >= 0)", (long long)M,
                      (long long)N, (long long)K);
    if (M == 0 || N == 0 || K == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dw && dout && inp, "gemm_dw: dw, dout or inp is NULL");
    /* both operands are activations: in BF16 mode both are rounded (inp as the "weight") */
    const void    *d_op, *i_op;
    cudaDataType_t ab;
    CM_TRY(operands(ctx, dout, M * N, inp, CM_DTYPE_F32, M * K, &d_op, &i_op, &ab));
    return kn_cuda_lt_matmul(ctx, "gemm_dw", ab, 0, 1, K, N, M, i_op, K, d_op, N, 1.0f, dw, K);
}
