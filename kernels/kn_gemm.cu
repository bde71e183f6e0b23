/* kernels/kn_gemm.cu — out[M, N] = inp[M, K] · W[N, K]ᵀ through cuBLASLt. cuBLAS is
 * column-major, so it computes the transpose: outᵀ (N×M, ld N) = Wᵀ·inpᵀ with A = W (stored
 * K×N, ld K, op T) and B = inp (stored K×M, ld K, op N). Modes (ctx->gemm_mode):
 * - BF16: inp is rounded to bf16 (nearest even) into the ctx scratch by a streaming kernel,
 *   BF16 weights are used as stored (F32 weights are rounded into scratch too); bf16
 *   products with fp32 accumulation (CUBLAS_COMPUTE_32F) and fp32 output.
 * - F32: fp32 operands (BF16 weights widened exactly into scratch), CUBLAS_COMPUTE_32F: true
 *   fp32 math, no TF32.
 * gemm_bf16in takes a BF16 input written by its producer: used as is in BF16 mode (the same
 * product as gemm on its F32 source, without the conversion pass), widened in F32 mode.
 * The product is kn_cuda_lt_matmul (kn_gemm_plan.cu): the context's plan for the shape and the
 * operands' actual alignment, made on the first call (descriptors and
 * cublasLtMatmulAlgoGetHeuristic's first answer) and reused after (no run-time compilation,
 * no on-disk cache). Writes out (beta = 0; K = 0 gives zeros), or adds onto it (gemm_bf16in_acc:
 * beta = 1). */
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
// conversions (kn_cuda_lt.h)

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

// ----------------------------------------------------------------------------
// launchers

static size_t round_up_256(size_t x) {
    return (x + 255) / 256 * 256;
}

/* The common body of gemm, gemm_bf16in and gemm_bf16in_acc: exactly one of inp (F32) and inp16
 * (BF16) is set; beta 1 adds the product onto out (cuBLASLt reads and writes out in one kernel). */
static cm_status gemm_run(kn_ctx *ctx, const char *op, float *out, const float *inp,
                          const __nv_bfloat16 *inp16, const void *w, cm_dtype wdt, int64_t M, int64_t N,
                          int64_t K, float beta) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0, "%s: bad shape M=%lld N=%lld K=%lld (must be >= 0)", op,
                      (long long)M, (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: weight dtype %s is not supported (use F32 or BF16)", op,
                       cm_dtype_name(wdt));
    if (M == 0 || N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out, "%s: out is NULL", op);
    if (K == 0) {
        if (beta == 0.0f)
            KN_CUDA(cudaMemsetAsync(out, 0, (size_t)M * (size_t)N * sizeof(float), ctx->stream));
        return CM_OK;
    }
    KN_CUDA_CHECK_ARG((inp || inp16) && w, "%s: inp or w is NULL", op);

    size_t         n_in = (size_t)M * (size_t)K, n_w = (size_t)N * (size_t)K;
    const void    *in_op = inp16 ? (const void *)inp16 : (const void *)inp, *w_op = w;
    cudaDataType_t ab_type;
    if (ctx->gemm_mode == KN_GEMM_MODE_BF16) {
        ab_type = CUDA_R_16BF;
        size_t in_size = inp16 ? 0 : round_up_256(n_in * sizeof(__nv_bfloat16));
        size_t w_size = wdt == CM_DTYPE_F32 ? n_w * sizeof(__nv_bfloat16) : 0;
        if (in_size + w_size)
            CM_TRY(kn_cuda_scratch_reserve(ctx, in_size + w_size));
        if (!inp16) {
            __nv_bfloat16 *in_bf = (__nv_bfloat16 *)ctx->scratch;
            CM_TRY(kn_cuda_f32_to_bf16(ctx, in_bf, inp, (int64_t)n_in));
            in_op = in_bf;
        }
        if (wdt == CM_DTYPE_F32) {
            __nv_bfloat16 *w_bf = (__nv_bfloat16 *)((char *)ctx->scratch + in_size);
            CM_TRY(kn_cuda_f32_to_bf16(ctx, w_bf, (const float *)w, (int64_t)n_w));
            w_op = w_bf;
        }
    } else {
        /* F32 mode: a BF16 input is widened exactly, like a BF16 weight */
        ab_type = CUDA_R_32F;
        size_t in_size = inp16 ? round_up_256(n_in * sizeof(float)) : 0;
        size_t w_size = wdt == CM_DTYPE_BF16 ? n_w * sizeof(float) : 0;
        if (in_size + w_size)
            CM_TRY(kn_cuda_scratch_reserve(ctx, in_size + w_size));
        if (inp16) {
            float *in_f = (float *)ctx->scratch;
            CM_TRY(kn_cuda_bf16_to_f32(ctx, in_f, inp16, (int64_t)n_in));
            in_op = in_f;
        }
        if (wdt == CM_DTYPE_BF16) {
            float *w_f = (float *)((char *)ctx->scratch + in_size);
            CM_TRY(kn_cuda_bf16_to_f32(ctx, w_f, w, (int64_t)n_w));
            w_op = w_f;
        }
    }

    /* outᵀ (N×M, ld N) = op(W)·inpᵀ: A = W stored K×N (op T), B = inp stored K×M */
    return kn_cuda_lt_matmul(ctx, op, ab_type, 1, 0, N, M, K, w_op, K, in_op, K, beta, out, N);
}

cm_status kn_cuda_gemm(kn_ctx *ctx, float *out, const float *inp, const void *w, cm_dtype wdt, int64_t M,
                       int64_t N, int64_t K) {
    return gemm_run(ctx, "gemm", out, inp, NULL, w, wdt, M, N, K, 0.0f);
}

int kn_cuda_gemm_rounds_input(const kn_ctx *ctx) {
    return ctx && ctx->gemm_mode == KN_GEMM_MODE_BF16;
}

cm_status kn_cuda_gemm_bf16in(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                              int64_t M, int64_t N, int64_t K) {
    return gemm_run(ctx, "gemm_bf16in", out, NULL, (const __nv_bfloat16 *)inp, w, wdt, M, N, K, 0.0f);
}

cm_status kn_cuda_gemm_bf16in_acc(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                                  int64_t M, int64_t N, int64_t K) {
    return gemm_run(ctx, "gemm_bf16in_acc", out, NULL, (const __nv_bfloat16 *)inp, w, wdt, M, N, K, 1.0f);
}
