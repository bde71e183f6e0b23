/* kernels/kn_matmul.cu — the typed data movement and GEMM of drafter training with BF16 saved
 * activations (kn_backend.h cast2d and matmul).
 * - cast2d: one thread per element over a (column-tiles × rows) grid, F32 ↔ BF16 (nearest
 *   even) or a same-type copy, each side with its own leading dimension; streaming. Packed
 *   arrays of a multiple of 4 elements on aligned buffers go four elements per access.
 * - matmul: C[M, N] (= or +=) op(A)·op(B) in row-major terms, run as the column-major
 *   Cᵀ = op(B)ᵀ·op(A)ᵀ through kn_cuda_lt_matmul_ct (kn_gemm_plan.cu). In BF16 mode an operand
 *   that is already BF16 is used as stored: no conversion pass, half the operand traffic,
 *   which is why dt_model saves GEMM inputs in BF16; an F32 operand is rounded into the ctx
 *   scratch first, as gemm does. A BF16 C comes straight out of cuBLASLt's epilogue (fp32
 *   accumulate, one rounding). In F32 mode BF16 operands are widened into scratch and the
 *   math is fp32 (no TF32); a BF16 C is then written through an F32 scratch. With packed F32
 *   operands and C this makes the very cuBLASLt call of gemm, gemm_dx or gemm_dw, so the
 *   results are those bits. */
#include "kn_cuda.h"
#include "kn_cuda_lt.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

static __global__ void cast2d_kernel(void *dst, int dbf, int64_t dld, const void *src, int sbf, int64_t sld,
                                     int64_t rows, int64_t cols) {
    const int64_t cstride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += cstride)
            st_f(dst, dbf, r * dld + c, ld_f(src, sbf, r * sld + c));
}

/* cast2d of a packed array, four elements per thread and iteration: 16-byte F32 and 8-byte BF16
 * accesses where the one-element kernel made 4- and 2-byte ones (the drafter's widened
 * activations: tens of MB per call). The same conversion per element. */
template <int SBF, int DBF> static __global__ void cast_vec4_kernel(void *dst, const void *src, int64_t n4) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 v = ld_f4(src, SBF, i);
        if (DBF)
            st_bf16x4(dst, i, v);
        else
            ((float4 *)dst)[i] = v;
    }
}

/* cast2d with cols and both leading dimensions multiples of 4 (aligned rows): four elements per
 * thread as above, a block row per matrix row. The fc projection's per-tap slices of its F32
 * weight (5120 × 5120 inside rows of 25600) went at 1.1 TB/s one element a thread. */
template <int SBF, int DBF>
static __global__ void cast2d_vec4_kernel(void *dst, int64_t dld4, const void *src, int64_t sld4,
                                          int64_t rows, int64_t cols4) {
    const int64_t cstride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols4; c += cstride) {
            const float4 v = ld_f4(src, SBF, r * sld4 + c);
            if (DBF)
                st_bf16x4(dst, r * dld4 + c, v);
            else
                ((float4 *)dst)[r * dld4 + c] = v;
        }
}

// ----------------------------------------------------------------------------
// launchers

static int typed_ok(cm_dtype dt) {
    return dt == CM_DTYPE_F32 || dt == CM_DTYPE_BF16;
}

static size_t round_up_256(size_t x) {
    return (x + 255) / 256 * 256;
}

/* No argument checks: the callers have made them. Packed arrays go as one long row. */
static cm_status cast2d_launch(kn_ctx *ctx, void *dst, cm_dtype ddt, int64_t dld, const void *src,
                               cm_dtype sdt, int64_t sld, int64_t rows, int64_t cols) {
    if (rows == 0 || cols == 0 || (dst == src && ddt == sdt && dld == sld))
        return CM_OK;
    if (dld == cols && sld == cols) {
        cols *= rows;
        rows = 1;
        dld = sld = cols;
    }
    const int sbf = sdt == CM_DTYPE_BF16, dbf = ddt == CM_DTYPE_BF16;
    if (rows == 1 && cols % 4 == 0 && (uintptr_t)src % (sbf ? 8 : 16) == 0 &&
        (uintptr_t)dst % (dbf ? 8 : 16) == 0) {
        const int64_t      n4 = cols / 4, blocks = (n4 + 255) / 256;
        const unsigned int g = (unsigned int)(blocks < 8192 ? blocks : 8192);
        if (sbf && dbf)
            cast_vec4_kernel<1, 1><<<g, 256, 0, ctx->stream>>>(dst, src, n4);
        else if (sbf)
            cast_vec4_kernel<1, 0><<<g, 256, 0, ctx->stream>>>(dst, src, n4);
        else if (dbf)
            cast_vec4_kernel<0, 1><<<g, 256, 0, ctx->stream>>>(dst, src, n4);
        else
            cast_vec4_kernel<0, 0><<<g, 256, 0, ctx->stream>>>(dst, src, n4);
        KN_CUDA_LAUNCHED(ctx);
        return CM_OK;
    }
    if (cols % 4 == 0 && dld % 4 == 0 && sld % 4 == 0 && (uintptr_t)src % (sbf ? 8 : 16) == 0 &&
        (uintptr_t)dst % (dbf ? 8 : 16) == 0) {
        const int64_t gx = (cols / 4 + 255) / 256;
        dim3 grid((unsigned int)(gx < 65535 ? gx : 65535), (unsigned int)(rows < 65535 ? rows : 65535));
        if (sbf && dbf)
            cast2d_vec4_kernel<1, 1>
                <<<grid, 256, 0, ctx->stream>>>(dst, dld / 4, src, sld / 4, rows, cols / 4);
        else if (sbf)
            cast2d_vec4_kernel<1, 0>
                <<<grid, 256, 0, ctx->stream>>>(dst, dld / 4, src, sld / 4, rows, cols / 4);
        else if (dbf)
            cast2d_vec4_kernel<0, 1>
                <<<grid, 256, 0, ctx->stream>>>(dst, dld / 4, src, sld / 4, rows, cols / 4);
        else
            cast2d_vec4_kernel<0, 0>
                <<<grid, 256, 0, ctx->stream>>>(dst, dld / 4, src, sld / 4, rows, cols / 4);
        KN_CUDA_LAUNCHED(ctx);
        return CM_OK;
    }
    int64_t gx = (cols + 255) / 256;
    dim3    grid((unsigned int)(gx < 65535 ? gx : 65535), (unsigned int)(rows < 65535 ? rows : 65535));
    cast2d_kernel<<<grid, 256, 0, ctx->stream>>>(dst, ddt == CM_DTYPE_BF16, dld, src, sdt == CM_DTYPE_BF16,
                                                 sld, rows, cols);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_cast2d(kn_ctx *ctx, void *dst, cm_dtype ddt, int64_t dst_ld, const void *src, cm_dtype sdt,
                         int64_t src_ld, int64_t rows, int64_t cols) {
    KN_CUDA_CHECK_ARG(ctx, "cast2d: ctx is NULL");
    if (!typed_ok(ddt) || !typed_ok(sdt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "cast2d: %s to %s is not supported (F32 or BF16)",
                       cm_dtype_name(sdt), cm_dtype_name(ddt));
    KN_CUDA_CHECK_ARG(rows >= 0 && cols >= 0 && dst_ld >= cols && src_ld >= cols,
                      "cast2d: bad shape rows=%lld cols=%lld dst_ld=%lld src_ld=%lld (lds >= cols >= 0)",
                      (long long)rows, (long long)cols, (long long)dst_ld, (long long)src_ld);
    if (rows == 0 || cols == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dst && src, "cast2d: dst or src is NULL");
    return cast2d_launch(ctx, dst, ddt, dst_ld, src, sdt, src_ld, rows, cols);
}

cm_status kn_cuda_matmul(kn_ctx *ctx, const kn_matmul_params *p) {
    KN_CUDA_CHECK_ARG(ctx && p, "matmul: ctx or params is NULL");
    if (!typed_ok(p->a_dt) || !typed_ok(p->b_dt) || !typed_ok(p->c_dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "matmul: operand types %s, %s -> %s are not supported (F32 or BF16)",
                       cm_dtype_name(p->a_dt), cm_dtype_name(p->b_dt), cm_dtype_name(p->c_dt));
    const int64_t M = p->M, N = p->N, K = p->K;
    KN_CUDA_CHECK_ARG(M >= 0 && N >= 0 && K >= 0,
                      "matmul: bad shape M=%lld N=%lld K=%lld (each must be >= 0)", (long long)M,
                      (long long)N, (long long)K);
    KN_CUDA_CHECK_ARG(
        p->lda >= (p->trans_a ? M : K) && p->ldb >= (p->trans_b ? K : N) && p->ldc >= N,
        "matmul: leading dimensions lda=%lld ldb=%lld ldc=%lld are shorter than the rows they hold",
        (long long)p->lda, (long long)p->ldb, (long long)p->ldc);
    KN_CUDA_CHECK_ARG(!p->accumulate || p->c_dt == CM_DTYPE_F32, "matmul: accumulate needs an F32 C");
    if (M == 0 || N == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->c && (K == 0 || (p->a && p->b)), "matmul: a, b or c is NULL");
    const size_t c_esz = p->c_dt == CM_DTYPE_BF16 ? 2 : 4;
    if (K == 0) { /* an empty sum: zeros, or nothing to add */
        if (!p->accumulate)
            KN_CUDA(cudaMemset2DAsync(p->c, (size_t)p->ldc * c_esz, 0, (size_t)N * c_esz, (size_t)M,
                                      ctx->stream));
        return CM_OK;
    }
    const int            bf = ctx->gemm_mode == KN_GEMM_MODE_BF16;
    const cm_dtype       op_dt = bf ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    const cudaDataType_t ab = bf ? CUDA_R_16BF : CUDA_R_32F;
    const size_t         op_esz = bf ? 2 : 4;
    const int64_t        a_rows = p->trans_a ? K : M, a_cols = p->trans_a ? M : K;
    const int64_t        b_rows = p->trans_b ? N : K, b_cols = p->trans_b ? K : N;
    const size_t         sa = p->a_dt != op_dt ? round_up_256((size_t)(a_rows * a_cols) * op_esz) : 0;
    const size_t         sb = p->b_dt != op_dt ? round_up_256((size_t)(b_rows * b_cols) * op_esz) : 0;
    const int            c_direct = p->c_dt == CM_DTYPE_F32 || bf; /* cuBLASLt's bf16 C needs bf16 operands */
    const size_t         sc = c_direct ? 0 : round_up_256((size_t)(M * N) * 4);
    if (sa + sb + sc > 0)
        CM_TRY(kn_cuda_scratch_reserve(ctx, sa + sb + sc));
    char       *scr = (char *)ctx->scratch;
    const void *A = p->a, *B = p->b;
    int64_t     lda = p->lda, ldb = p->ldb, ldc = p->ldc;
    if (sa) {
        CM_TRY(cast2d_launch(ctx, scr, op_dt, a_cols, p->a, p->a_dt, p->lda, a_rows, a_cols));
        A = scr;
        lda = a_cols;
    }
    if (sb) {
        CM_TRY(cast2d_launch(ctx, scr + sa, op_dt, b_cols, p->b, p->b_dt, p->ldb, b_rows, b_cols));
        B = scr + sa;
        ldb = b_cols;
    }
    void          *C = p->c;
    cudaDataType_t ct = p->c_dt == CM_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    if (!c_direct) {
        C = scr + sa + sb;
        ct = CUDA_R_32F;
        ldc = N;
    }
    /* row-major C = op(A)·op(B)  <=>  column-major Cᵀ (N×M) = op(B)ᵀ·op(A)ᵀ: cuBLAS's A is our
     * B and its B our A, each with the same transpose flag */
    CM_TRY(kn_cuda_lt_matmul_ct(ctx, "matmul", ab, p->trans_b, p->trans_a, N, M, K, B, ldb, A, lda,
                                p->accumulate ? 1.0f : 0.0f, C, ct, ldc));
    if (!c_direct)
        CM_TRY(cast2d_launch(ctx, p->c, CM_DTYPE_BF16, p->ldc, C, CM_DTYPE_F32, N, M, N));
    return CM_OK;
}
