/* kernels/kn_elementwise_bwd.cu — backward of SwiGLU (out = silu(gate)·up):
 *   dup = dout·silu(g),  dgate = dout·up·σ(g)·(1 + g·(1 − σ(g))).
 * One thread per element (grid-stride, int64 indices), evaluated in double and rounded once
 * like the reference: the factor 1 + g·(1 − σ) crosses zero near g ≈ −1.28, where fp32
 * would lose the relative accuracy the reference has. Streaming; outputs written (=). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

static __global__ void swiglu_bwd_kernel(float *dgate, float *dup, const float *dout, const float *gate,
                                         const float *up, int64_t n) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double d = dout[i], g = gate[i], u = up[i];
        const double sg = 1.0 / (1.0 + exp(-g));
        dup[i] = (float)(d * (g / (1.0 + exp(-g))));
        dgate[i] = (float)(d * u * sg * (1.0 + g * (1.0 - sg)));
    }
}

cm_status kn_cuda_swiglu_bwd(kn_ctx *ctx, float *dgate, float *dup, const float *dout, const float *gate,
                             const float *up, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx, "swiglu_bwd: ctx is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "swiglu_bwd: n=%lld must be >= 0", (long long)n);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dgate && dup && dout && gate && up, "swiglu_bwd: dgate, dup, dout, gate or up is NULL");
    KN_CUDA_CHECK_ARG(dgate != dup, "swiglu_bwd: dgate and dup must be different buffers");
    int64_t blocks = (n + 255) / 256;
    swiglu_bwd_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        dgate, dup, dout, gate, up, n);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
