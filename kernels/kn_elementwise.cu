/* kernels/kn_elementwise.cu — add (x += y) and SwiGLU (out = silu(gate)·up) over flat F32
 * arrays. One thread per element in a grid-stride loop with int64 indices: a pure
 * streaming pattern (coalesced loads of each input once, one coalesced store), fp32 math;
 * silu is gate / (1 + exp(-gate)) with expf, within a few ulp of the double reference. add
 * accumulates into x (the one accumulating entry of the table); swiglu writes out, which may
 * alias gate or up (each element is read before it is written by the same thread). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

// ----------------------------------------------------------------------------
// kernels

static __global__ void add_kernel(float *x, const float *y, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] += y[i];
}

static __global__ void swiglu_kernel(float *out, const float *gate, const float *up, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// ----------------------------------------------------------------------------
// launchers

#define KN_EW_BLOCK 256

static unsigned int ew_grid(int64_t n) {
    int64_t blocks = (n + KN_EW_BLOCK - 1) / KN_EW_BLOCK;
    return (unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20));
}

cm_status kn_cuda_add(kn_ctx *ctx, float *x, const float *y, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "add: ctx is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "add: n=%lld must be >= 0", (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(x && y, "add: x or y is NULL");
    add_kernel<<<ew_grid(n), KN_EW_BLOCK, 0, ctx->stream>>>(x, y, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_swiglu(kn_ctx *ctx, float *out, const float *gate, const float *up, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "swiglu: ctx is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "swiglu: n=%lld must be >= 0", (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && gate && up, "swiglu: out, gate or up is NULL");
    swiglu_kernel<<<ew_grid(n), KN_EW_BLOCK, 0, ctx->stream>>>(out, gate, up, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
