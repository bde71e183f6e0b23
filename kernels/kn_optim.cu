/* kernels/kn_optim.cu — the optimizer pieces of the drafter step:
 * - sumsq: Σx² in double, deterministic: the input is cut into fixed chunks of
 *   SUMSQ_CHUNK elements (one block each; per-thread strided double sums, then a fixed
 *   shuffle/shared tree), and one block adds the chunk partials in a fixed order. The
 *   partition depends on n only, never on the device, so the bits are the same on every
 *   GPU and every run. The result is downloaded (the call blocks).
 * - adamw: one fused elementwise pass per tensor (PyTorch AdamW, decoupled weight decay, the
 *   clip factor applied to the gradient first): fp32 masters, m and v read once and written
 *   once, the update evaluated in double like the reference; the bias corrections
 *   1 − β^step are computed once on the host in double. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

#include <math.h>

#define SUMSQ_CHUNK   8192
#define SUMSQ_THREADS 256

// ----------------------------------------------------------------------------
// kernels

/* Block-wide double sum with a fixed tree (blockDim.x == SUMSQ_THREADS); thread 0 gets it. */
static __device__ double block_sum_fixed(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0)
        sh[threadIdx.x / 32] = v;
    __syncthreads();
    double t = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < SUMSQ_THREADS / 32; w++)
            t += sh[w];
    return t;
}

static __global__ void sumsq_partial_kernel(double *partial, const float *x, int64_t n) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    const int64_t     i0 = (int64_t)blockIdx.x * SUMSQ_CHUNK;
    const int64_t     i1 = i0 + SUMSQ_CHUNK < n ? i0 + SUMSQ_CHUNK : n;
    double            s = 0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += SUMSQ_THREADS)
        s += (double)x[i] * (double)x[i];
    s = block_sum_fixed(s, sh);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = s;
}

static __global__ void sumsq_final_kernel(double *out, const double *partial, int64_t n_part) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    double            s = 0;
    for (int64_t i = threadIdx.x; i < n_part; i += SUMSQ_THREADS)
        s += partial[i];
    s = block_sum_fixed(s, sh);
    if (threadIdx.x == 0)
        *out = s;
}

static __global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, int64_t n, double lr,
                                    double b1, double b2, double eps, double wd, double gs, double bc1,
                                    double bc2) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double g = (double)grad[i] * gs;
        double       pv = param[i];
        pv -= lr * wd * pv;
        const double mi = b1 * (double)m[i] + (1.0 - b1) * g;
        const double vi = b2 * (double)v[i] + (1.0 - b2) * g * g;
        pv -= lr * (mi / bc1) / (sqrt(vi / bc2) + eps);
        param[i] = (float)pv;
        m[i] = (float)mi;
        v[i] = (float)vi;
    }
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_sumsq(kn_ctx *ctx, double *out, const float *x, int64_t n) {
    KN_CUDA_CHECK_ARG(ctx && out, "sumsq: ctx or out is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "sumsq: n=%lld must be >= 0", (long long)n);
    *out = 0;
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(x, "sumsq: x is NULL");
    const int64_t n_part = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    KN_CUDA_CHECK_ARG(n_part < ((int64_t)1 << 31), "sumsq: n=%lld is too large", (long long)n);
    CM_TRY(kn_cuda_scratch_reserve(ctx, (size_t)(n_part + 1) * sizeof(double)));
    double *partial = (double *)ctx->scratch, *total = partial + n_part;
    sumsq_partial_kernel<<<(unsigned int)n_part, SUMSQ_THREADS, 0, ctx->stream>>>(partial, x, n);
    KN_CUDA_LAUNCHED(ctx);
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, ctx->stream>>>(total, partial, n_part);
    KN_CUDA_LAUNCHED(ctx);
    return kn_cuda_download(ctx, out, total, sizeof(double));
}

cm_status kn_cuda_adamw(kn_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                        const kn_adamw_params *p) {
    KN_CUDA_CHECK_ARG(ctx && p, "adamw: ctx or params is NULL");
    KN_CUDA_CHECK_ARG(n >= 0, "adamw: n=%lld must be >= 0", (long long)n);
    KN_CUDA_CHECK_ARG(p->step >= 1, "adamw: step=%lld must be >= 1 (it is 1-based)", (long long)p->step);
    KN_CUDA_CHECK_ARG(p->lr >= 0 && isfinite(p->lr), "adamw: lr=%g must be finite and >= 0", (double)p->lr);
    KN_CUDA_CHECK_ARG(p->beta1 >= 0 && p->beta1 < 1 && p->beta2 >= 0 && p->beta2 < 1,
                      "adamw: betas (%g, %g) must be in [0, 1)", (double)p->beta1, (double)p->beta2);
    KN_CUDA_CHECK_ARG(p->eps >= 0 && isfinite(p->eps), "adamw: eps=%g must be finite and >= 0", (double)p->eps);
    KN_CUDA_CHECK_ARG(p->weight_decay >= 0 && isfinite(p->weight_decay),
                      "adamw: weight_decay=%g must be finite and >= 0", (double)p->weight_decay);
    KN_CUDA_CHECK_ARG(isfinite(p->grad_scale), "adamw: grad_scale=%g must be finite", (double)p->grad_scale);
    if (n == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(param && grad && m && v, "adamw: param, grad, m or v is NULL");
    const double bc1 = 1.0 - pow((double)p->beta1, (double)p->step);
    const double bc2 = 1.0 - pow((double)p->beta2, (double)p->step);
    int64_t      blocks = (n + 255) / 256;
    adamw_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        param, grad, m, v, n, p->lr, p->beta1, p->beta2, p->eps, p->weight_decay, p->grad_scale, bc1, bc2);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
