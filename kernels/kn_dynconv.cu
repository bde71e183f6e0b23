/* kernels/kn_dynconv.cu — DFlash2's grouped dynamic causal convolution (semantics and shapes in
 * kn_backend.h, kn_dynconv_params; the specification in ref/kn_dynconv_ref.c), forward and
 * backward, fp32. Every output element is one thread's sum in a fixed order (no atomics), so
 * results are the same run to run:
 *   forward   one thread per (row, channel), the taps of its own block;
 *   dx        one thread per (row, channel), the rows after it in its block that tap it;
 *   ddelta    one thread per (row, tap, group), the G channels of the group;
 *   dbase     one thread per (tap, channel), a loop over the rows in row order (coalesced across
 *             channels).
 * A first version: correct and deterministic, not tuned (the module is elementwise next to the
 * projection GEMM that makes delta). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

// ----------------------------------------------------------------------------
// kernels

static __device__ __forceinline__ float dc_coef(const kn_dynconv_params &p, int64_t i, int t, int c) {
    const int ng = p.D / p.G;
    return p.base[((int64_t)p.side * p.Kc + t) * p.D + c] +
           p.delta[((i * 2 + p.side) * p.Kc + t) * ng + c / p.G];
}

static __global__ void dynconv_fwd_kernel(kn_dynconv_params p) {
    const int64_t n = p.rows * p.D;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e / p.D;
        const int     c = (int)(e % p.D), slot = (int)(i % p.B);
        const int     taps = slot + 1 < p.Kc ? slot + 1 : p.Kc;
        float         acc = 0.0f;
        for (int t = 0; t < taps; t++)
            acc = fmaf(dc_coef(p, i, t, c), p.x[(i - t) * p.D + c], acc);
        p.out[e] = acc;
    }
}

static __global__ void dynconv_dx_kernel(kn_dynconv_params p) {
    const int64_t n = p.rows * p.D;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = e / p.D;
        const int     c = (int)(e % p.D), after = p.B - 1 - (int)(m % p.B);
        const int     taps = after + 1 < p.Kc ? after + 1 : p.Kc;
        float         acc = 0.0f;
        for (int t = 0; t < taps; t++)
            acc = fmaf(dc_coef(p, m + t, t, c), p.dout[(m + t) * p.D + c], acc);
        p.dx[e] = acc;
    }
}

static __global__ void dynconv_ddelta_kernel(kn_dynconv_params p) {
    const int     ng = p.D / p.G;
    const int64_t n = p.rows * p.Kc * ng;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = e / ((int64_t)p.Kc * ng);
        const int     t = (int)(e / ng % p.Kc), g = (int)(e % ng);
        float         acc = 0.0f;
        if (t <= (int)(i % p.B))
            for (int c = g * p.G; c < (g + 1) * p.G; c++)
                acc = fmaf(p.x[(i - t) * p.D + c], p.dout[i * p.D + c], acc);
        p.ddelta[((i * 2 + p.side) * p.Kc + t) * ng + g] = acc;
    }
}

static __global__ void dynconv_dbase_kernel(kn_dynconv_params p) {
    const int64_t n = (int64_t)p.Kc * p.D;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(e / p.D), c = (int)(e % p.D);
        float     acc = 0.0f;
        for (int64_t i = 0; i < p.rows; i++)
            if ((int)(i % p.B) >= t)
                acc = fmaf(p.x[(i - t) * p.D + c], p.dout[i * p.D + c], acc);
        p.dbase[((int64_t)p.side * p.Kc + t) * p.D + c] = acc;
    }
}

// ----------------------------------------------------------------------------
// launchers

static unsigned int dc_grid(int64_t n, int block) {
    const int64_t g = (n + block - 1) / block;
    return (unsigned int)(g < 65535 * 8 ? (g > 0 ? g : 1) : 65535 * 8);
}

cm_status kn_cuda_dynconv_fwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    CM_TRY(kn_dynconv_check("dynconv_fwd", ctx, p, 0));
    if (p->rows == 0)
        return CM_OK;
    dynconv_fwd_kernel<<<dc_grid(p->rows * p->D, 256), 256, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_dynconv_bwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    CM_TRY(kn_dynconv_check("dynconv_bwd", ctx, p, 1));
    if (p->rows == 0)
        return CM_OK;
    dynconv_dx_kernel<<<dc_grid(p->rows * p->D, 256), 256, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    dynconv_ddelta_kernel<<<dc_grid(p->rows * p->Kc * (p->D / p->G), 256), 256, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    dynconv_dbase_kernel<<<dc_grid((int64_t)p->Kc * p->D, 128), 128, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
