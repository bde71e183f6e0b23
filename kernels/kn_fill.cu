/* kernels/kn_fill.cu — fill_uniform on the cuda backend: dst[i] = kn_fill_value(seed, i, lo, hi)
 * as F32 or BF16, one grid-stride pass (kn_fill.h; bit-identical to the cpu backend's). Used by
 * target-server --init random to make a 27B-shaped model on the device in seconds. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_fill.h"

static __global__ void fill_f32_kernel(float *dst, int64_t n, uint64_t seed, float lo, float hi) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = kn_fill_value(seed, (uint64_t)i, lo, hi);
}

static __global__ void fill_bf16_kernel(uint16_t *dst, int64_t n, uint64_t seed, float lo, float hi) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = kn_fill_bf16(kn_fill_value(seed, (uint64_t)i, lo, hi));
}

cm_status kn_cuda_fill_uniform(kn_ctx *ctx, void *dst, cm_dtype dt, int64_t n, uint64_t seed, float lo,
                               float hi) {
    KN_CUDA_CHECK_ARG(ctx, "fill_uniform: ctx is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "fill_uniform: n=%lld must be >= 0", (long long)n);
    if (dt != CM_DTYPE_F32 && dt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "fill_uniform: dtype %s is not supported (F32 or BF16)",
                       cm_dtype_name(dt));
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dst, "fill_uniform: dst is NULL");
    int64_t      blocks = (n + 255) / 256;
    unsigned int grid = (unsigned int)(blocks < (1 << 16) ? blocks : (1 << 16));
    if (dt == CM_DTYPE_F32)
        fill_f32_kernel<<<grid, 256, 0, ctx->stream>>>((float *)dst, n, seed, lo, hi);
    else
        fill_bf16_kernel<<<grid, 256, 0, ctx->stream>>>((uint16_t *)dst, n, seed, lo, hi);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
