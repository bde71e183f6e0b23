/* kernels/kn_gdn_gate.cu — the Gated DeltaNet gate: g = −e^{A_log}·softplus(a + dt_bias),
 * beta = sigmoid(b), one thread per (token, v-head), fp32 (the function of kn_backend.h). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

// ----------------------------------------------------------------------------
// kernels

static __global__ void gdn_gate_kernel(float *g, float *beta, const float *a, const float *b,
                                       const float *A_log, const float *dt_bias, int64_t n, int nv) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int   h = (int)(i % nv);
        float x = a[i] + dt_bias[h];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(A_log[h]) * sp;
        beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_gdn_gate(kn_ctx *ctx, float *g, float *beta, const float *a, const float *b,
                           const float *A_log, const float *dt_bias, int64_t T, int nv) {
    KN_CUDA_CHECK_ARG(ctx, "gdn_gate: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nv > 0, "gdn_gate: bad shape T=%lld nv=%d (T >= 0, nv > 0)", (long long)T,
                      nv);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(g && beta && a && b && A_log && dt_bias,
                      "gdn_gate: g, beta, a, b, A_log or dt_bias is NULL");
    int64_t n = T * nv;
    int64_t blocks = (n + 255) / 256;
    gdn_gate_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        g, beta, a, b, A_log, dt_bias, n, nv);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
