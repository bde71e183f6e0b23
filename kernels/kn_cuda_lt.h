/* kernels/kn_cuda_lt.h — internal helpers of the CUDA GEMM ops (kn_gemm.cu, kn_gemm_bwd.cu,
 * kn_matmul.cu, kn_lm_ce.cu): one general cuBLASLt matmul in the column-major BLAS convention
 * (kn_gemm_plan.cu) and the bf16 <-> f32 conversion launchers (kn_gemm.cu). Not part of the backend table; compiles as C and as
 * CUDA C++. */
#ifndef KN_CUDA_LT_H
#define KN_CUDA_LT_H

#include "kn_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* C (m×n, column-major, ldc, F32) = op(A)·op(B) + beta·C with op(A) m×k and op(B) k×n;
 * trans_a / trans_b select op = transpose, A and B are stored (before op) column-major with
 * leading dimensions lda, ldb, both of ab_type (CUDA_R_32F or CUDA_R_16BF); fp32 accumulation
 * (CUBLAS_COMPUTE_32F, no TF32). op names the caller in error messages. */
cm_status kn_cuda_lt_matmul(kn_ctx *ctx, const char *op, cudaDataType_t ab_type, int trans_a, int trans_b,
                            int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                            int64_t ldb, float beta, float *C, int64_t ldc);

/* The same with C (and D) of c_type: CUDA_R_32F, or CUDA_R_16BF with bf16 operands (the fp32
 * result rounded by cuBLASLt's epilogue). */
cm_status kn_cuda_lt_matmul_ct(kn_ctx *ctx, const char *op, cudaDataType_t ab_type, int trans_a, int trans_b,
                               int64_t m, int64_t n, int64_t k, const void *A, int64_t lda, const void *B,
                               int64_t ldb, float beta, void *C, cudaDataType_t c_type, int64_t ldc);

/* The block-scaled FP8 product in the same convention (cuBLASLt on sm_90, CUDA 12.9 or later):
 * C (m×n, c_type CUDA_R_32F or CUDA_R_16BF, ldc) = Aᵀ·B with A stored k×m (ld k, e4m3, 128 × 128
 * block scales a_scale, K-major: [ceil(m/128)][kn_fp8_scale_ld(k)]) and B stored k×n (ld k,
 * e4m3, 1 × 128 scales b_scale, [ceil(k/128)][n], n-contiguous); fp32 accumulation, a bf16 C
 * rounded by the epilogue. */
cm_status kn_cuda_lt_matmul_fp8(kn_ctx *ctx, const char *op, int64_t m, int64_t n, int64_t k, const void *A,
                                const float *a_scale, const void *B, const float *b_scale, float beta, void *C,
                                cudaDataType_t c_type, int64_t ldc);

/* dst[i] = bf16(src[i]) (nearest even) and dst[i] = f32(src[i]) (exact), on ctx's stream. */
cm_status kn_cuda_f32_to_bf16(kn_ctx *ctx, void *dst, const float *src, int64_t n);
cm_status kn_cuda_bf16_to_f32(kn_ctx *ctx, float *dst, const void *src, int64_t n);

#ifdef __cplusplus
}
#endif
#endif /* KN_CUDA_LT_H */
