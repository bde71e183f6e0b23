/* kernels/kn_elementwise.cu — add (x += y) and SwiGLU (out = silu(gate)·up) over flat F32
 * arrays. One thread per element in a grid-stride loop with int64 indices: a pure
 * streaming pattern (coalesced loads of each input once, one coalesced store), fp32 math;
 * silu is kn_silu (kn_device.h: __expf and a fast division, within a few ulp of the cpu
 * reference where |gate| is small, the error growing with |gate|). add
 * accumulates into x (the one accumulating entry of the table); swiglu writes out, which may
 * alias gate or up (each element is read before it is written by the same thread).
 * swiglu_bf16 writes the down projection's bf16 input itself (float4 loads), which removes
 * the GEMM's conversion pass and the f32 round trip of the [T, I] product. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cuda_bf16.h>

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
        out[i] = kn_silu(g) * up[i];
    }
}

/* out = bf16(silu(gate)·up): the MLP's down-projection input written directly (the f32 math
 * of swiglu_kernel, then one rounding). vec: n % 4 == 0 and 16-byte aligned inputs, so
 * each thread moves two float4 in and 8 bytes out. */
static __global__ void swiglu_bf16_kernel(__nv_bfloat16 *out, const float *gate, const float *up, int64_t n,
                                          int vec) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        const float4 *g4 = (const float4 *)gate, *u4 = (const float4 *)up;
        for (int64_t i = i0; i < n / 4; i += stride) {
            float4 g = g4[i], u = u4[i];
            ((__nv_bfloat162 *)out)[2 * i] =
                __floats2bfloat162_rn(kn_silu(g.x) * u.x, kn_silu(g.y) * u.y);
            ((__nv_bfloat162 *)out)[2 * i + 1] =
                __floats2bfloat162_rn(kn_silu(g.z) * u.z, kn_silu(g.w) * u.w);
        }
    } else {
        for (int64_t i = i0; i < n; i += stride) {
            float g = gate[i];
            out[i] = __float2bfloat16_rn(kn_silu(g) * up[i]);
        }
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

cm_status kn_cuda_swiglu_bf16(kn_ctx *ctx, uint16_t *out, const float *gate, const float *up, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "swiglu_bf16: ctx is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "swiglu_bf16: n=%lld must be >= 0", (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && gate && up, "swiglu_bf16: out, gate or up is NULL");
    const int vec =
        n % 4 == 0 && (uintptr_t)gate % 16 == 0 && (uintptr_t)up % 16 == 0 && (uintptr_t)out % 8 == 0;
    swiglu_bf16_kernel<<<ew_grid(vec ? n / 4 : n), KN_EW_BLOCK, 0, ctx->stream>>>((__nv_bfloat16 *)out, gate,
                                                                                  up, n, vec);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
