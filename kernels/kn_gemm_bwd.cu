/* kernels/kn_gemm_bwd.cu — the GEMM backward pair through cuBLASLt, and the general matmul
 * helper the drafter ops share (kn_cuda_lt.h).
 *   gemm_dx: dinp[M, K] (= or +=) dout[M, N] · W[N, K]
 *   gemm_dw: dw[N, K] += dout[M, N]ᵀ · inp[M, K]
 * cuBLAS is column-major, so each computes the transpose of its row-major output:
 *   gemm_dx: dinpᵀ (K×M, ld K) = W (stored K×N col-major, op N) · doutᵀ (stored N×M, op N)
 *   gemm_dw: dwᵀ   (K×N, ld K) = inpᵀ (stored K×M, op N) · dout (stored N×M, op T)
 * Modes follow gemm (kn_gemm.cu): BF16 rounds every F32 operand to bf16 (nearest even) into
 * the ctx scratch and uses BF16 weights as stored; F32 widens BF16 weights into scratch and
 * runs true fp32 math (CUBLAS_COMPUTE_32F, no TF32). Accumulation is fp32 in both; the
 * accumulate flag is cuBLASLt's beta = 1 (C read and written by the same kernel), so no
 * separate add pass. The algorithm is the heuristic's first answer for the shape and the
 * operands' alignment: for a fixed shape and alignment the same kernel runs every time,
 * which keeps results reproducible run to run. */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "kn_cuda_ops.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

static __global__ void f32_to_bf16_kernel(__nv_bfloat16 *dst, const float *src, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __float2bfloat16_rn(src[i]);
}

static __global__ void bf16_to_f32_kernel(float *dst, const uint16_t *src, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __uint_as_float((unsigned int)src[i] << 16);
}

// ----------------------------------------------------------------------------
// shared helpers (kn_cuda_lt.h)

static unsigned int conv_grid(int64_t n) {
    int64_t blocks = (n + 255) / 256;
    return (unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20));
}

cm_status kn_cuda_f32_to_bf16(kn_ctx *ctx, void *dst, const float *src, int64_t n) {
    if (n <= 0)
        return CM_OK;
    f32_to_bf16_kernel<<<conv_grid(n), 256, 0, ctx->stream>>>((__nv_bfloat16 *)dst, src, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_bf16_to_f32(kn_ctx *ctx, float *dst, const void *src, int64_t n) {
    if (n <= 0)
        return CM_OK;
    bf16_to_f32_kernel<<<conv_grid(n), 256, 0, ctx->stream>>>(dst, (const uint16_t *)src, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

/* Largest power of two (up to 256) that divides the address: what cuBLASLt may assume. */
static uint32_t ptr_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t  al = 256;
    while (al > 1 && (a & (al - 1)))
        al >>= 1;
    return al;
}

typedef struct lt_descs {
    cublasLtMatmulDesc_t       op;
    cublasLtMatrixLayout_t     a, b, c;
    cublasLtMatmulPreference_t pref;
} lt_descs;

static void lt_descs_release(lt_descs *d) {
    if (d->pref)
        cublasLtMatmulPreferenceDestroy(d->pref);
    if (d->c)
        cublasLtMatrixLayoutDestroy(d->c);
    if (d->b)
        cublasLtMatrixLayoutDestroy(d->b);
    if (d->a)
        cublasLtMatrixLayoutDestroy(d->a);
    if (d->op)
        cublasLtMatmulDescDestroy(d->op);
}

static cm_status lt_run(kn_ctx *ctx, lt_descs *d, const char *opname, cudaDataType_t ab_type, int trans_a,
                        int trans_b, int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                        int64_t ldb, float beta, void *C, cudaDataType_t c_type, int64_t ldc) {
    cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    KN_CUBLAS(cublasLtMatmulDescCreate(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    KN_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KN_CUBLAS(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    /* stored shapes: op(A) is m×k, so A is k×m when transposed */
    KN_CUBLAS(cublasLtMatrixLayoutCreate(&d->a, ab_type, (uint64_t)(trans_a ? k : m), (uint64_t)(trans_a ? m : k),
                                         lda));
    KN_CUBLAS(cublasLtMatrixLayoutCreate(&d->b, ab_type, (uint64_t)(trans_b ? n : k), (uint64_t)(trans_b ? k : n),
                                         ldb));
    KN_CUBLAS(cublasLtMatrixLayoutCreate(&d->c, c_type, (uint64_t)m, (uint64_t)n, ldc));

    KN_CUBLAS(cublasLtMatmulPreferenceCreate(&d->pref));
    uint64_t ws = ctx->lt_ws_bytes;
    uint32_t al_a = ptr_align(A), al_b = ptr_align(B), al_c = ptr_align(C);
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                   sizeof ws));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                                   sizeof al_a));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                                   sizeof al_b));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                                   sizeof al_c));
    KN_CUBLAS(cublasLtMatmulPreferenceSetAttribute(d->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                                   sizeof al_c));
    cublasLtMatmulHeuristicResult_t heur;
    int                             n_found = 0;
    KN_CUBLAS(
        cublasLtMatmulAlgoGetHeuristic(ctx->lt, d->op, d->a, d->b, d->c, d->c, d->pref, 1, &heur, &n_found));
    if (n_found == 0)
        return CM_FAIL(CM_ERR_CUBLAS, "%s: cuBLASLt has no algorithm for m=%lld n=%lld k=%lld (%s operands)",
                       opname, (long long)m, (long long)n, (long long)k, ab_type == CUDA_R_16BF ? "bf16" : "f32");
    const float alpha = 1.0f;
    KN_CUBLAS(cublasLtMatmul(ctx->lt, d->op, &alpha, A, d->a, B, d->b, &beta, C, d->c, C, d->c, &heur.algo,
                             ctx->lt_ws, ctx->lt_ws_bytes, ctx->stream));
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_lt_matmul(kn_ctx *ctx, const char *op, cudaDataType_t ab_type, int trans_a, int trans_b,
                            int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                            int64_t ldb, float beta, float *C, int64_t ldc) {
    lt_descs  d = {0};
    cm_status st = lt_run(ctx, &d, op, ab_type, trans_a, trans_b, m, n, k, A, lda, B, ldb, beta, C, CUDA_R_32F, ldc);
    lt_descs_release(&d);
    return st;
}

cm_status kn_cuda_lt_matmul_ct(kn_ctx *ctx, const char *op, cudaDataType_t ab_type, int trans_a, int trans_b,
                               int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                               int64_t ldb, float beta, void *C, cudaDataType_t c_type, int64_t ldc) {
    lt_descs  d = {0};
    cm_status st = lt_run(ctx, &d, op, ab_type, trans_a, trans_b, m, n, k, A, lda, B, ldb, beta, C, c_type, ldc);
    lt_descs_release(&d);
    return st;
}

// ----------------------------------------------------------------------------
// launchers

static size_t round_up_256(size_t x) {
    return (x + 255) / 256 * 256;
}

/* The operands of one backward GEMM in the ctx's mode: `act` is an F32 activation (always
 * F32), `w` an F32 or BF16 second operand. Converted copies live in ctx->scratch. */
static cm_status operands(kn_ctx *ctx, const float *act, int64_t n_act, const void *w, cm_dtype wdt, int64_t n_w,
                          const void **act_op, const void **w_op, cudaDataType_t *ab_type) {
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
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0, "gemm_dx: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                      (long long)M, (long long)N, (long long)K);
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
    return kn_cuda_lt_matmul(ctx, "gemm_dx", ab, 0, 0, K, M, N, w_op, K, d_op, N, accumulate ? 1.0f : 0.0f, dinp,
                             K);
}

cm_status kn_cuda_gemm_dw(kn_ctx *ctx, float *dw, const float *dout, const float *inp, int64_t M, int64_t N,
                          int64_t K) {
    KN_CUDA_CHECK_ARG(ctx, "gemm_dw: ctx is NULL");
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0, "gemm_dw: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                      (long long)M, (long long)N, (long long)K);
    if (M == 0 || N == 0 || K == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dw && dout && inp, "gemm_dw: dw, dout or inp is NULL");
    /* both operands are activations: in BF16 mode both are rounded (inp as the "weight") */
    const void    *d_op, *i_op;
    cudaDataType_t ab;
    CM_TRY(operands(ctx, dout, M * N, inp, CM_DTYPE_F32, M * K, &d_op, &i_op, &ab));
    return kn_cuda_lt_matmul(ctx, "gemm_dw", ab, 0, 1, K, N, M, i_op, K, d_op, N, 1.0f, dw, K);
}
