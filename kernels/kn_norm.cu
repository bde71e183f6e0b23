/* kernels/kn_norm.cu — the row norms: rmsnorm (y = x·rsqrt(mean(x²) + eps)·(w or 1 + w)),
 * the GDN output norm rmsnorm_gated (y = w·(x·rsqrt(mean(x²) + eps))·silu(z)) and l2norm
 * (y = x·rsqrt(sum(x²) + eps)). One block per row (grid-stride over rows), 32..256 threads
 * by C: pass 1 reads the row with coalesced loads and sums x² in fp32 per thread, reduced by
 * warp shuffles and a 32-slot shared array; pass 2 re-reads the row (L1/L2 hits) and writes
 * y. The scale is 1/sqrtf (correctly rounded), so results are within a few ulp of the
 * double reference for rows up to ~10⁴. out may equal inp: each element is read, then
 * written, by the same thread. Writes out (=). */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

// ----------------------------------------------------------------------------
// kernels

/* Sum over the block (blockDim.x a multiple of 32); every thread gets the total. sh holds
 * 32 floats; the leading barrier makes back-to-back calls safe. */
static __device__ float block_sum(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0)
        sh[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? sh[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float row_sumsq(const float *x, int64_t C, float *sh) {
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += x[c] * x[c];
    return block_sum(s, sh);
}

static __global__ void rmsnorm_kernel(float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                                      float eps, int one_plus) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = inp + r * C;
        float       *y = out + r * C;
        float        scale = 1.0f / sqrtf(row_sumsq(x, C, sh) / (float)C + eps);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float wc = one_plus ? 1.0f + w[c] : w[c];
            y[c] = x[c] * scale * wc;
        }
    }
}

static __global__ void rmsnorm_gated_kernel(float *out, const float *xs, const float *zs, const float *w,
                                            int64_t rows, int64_t C, float eps) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = xs + r * C;
        const float *z = zs + r * C;
        float       *y = out + r * C;
        float        scale = 1.0f / sqrtf(row_sumsq(x, C, sh) / (float)C + eps);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float zc = z[c];
            y[c] = w[c] * (x[c] * scale) * (zc / (1.0f + expf(-zc)));
        }
    }
}

static __global__ void l2norm_kernel(float *out, const float *inp, int64_t rows, int64_t C, float eps) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = inp + r * C;
        float       *y = out + r * C;
        float        scale = 1.0f / sqrtf(row_sumsq(x, C, sh) + eps);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            y[c] = x[c] * scale;
    }
}

// ----------------------------------------------------------------------------
// launchers

static int norm_block(int64_t C) {
    int64_t b = (C + 31) / 32 * 32;
    return (int)(b < 256 ? b : 256);
}

static unsigned int norm_grid(int64_t rows) {
    return (unsigned int)(rows < (1 << 20) ? rows : (1 << 20));
}

cm_status kn_cuda_rmsnorm(kn_ctx *ctx, float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                          float eps, int one_plus) {
    KN_CUDA_CHECK_ARG(ctx, "rmsnorm: ctx is NULL");
    KN_CUDA_CHECK_ARG(rows >= 0 && C > 0, "rmsnorm: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                      (long long)rows, (long long)C);
    KN_CUDA_CHECK_ARG(eps >= 0.0f, "rmsnorm: eps=%g must be >= 0", (double)eps);
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && inp && w, "rmsnorm: out, inp or w is NULL");
    rmsnorm_kernel<<<norm_grid(rows), norm_block(C), 0, ctx->stream>>>(out, inp, w, rows, C, eps,
                                                                       one_plus ? 1 : 0);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm_gated(kn_ctx *ctx, float *out, const float *x, const float *z, const float *w,
                                int64_t rows, int64_t C, float eps) {
    KN_CUDA_CHECK_ARG(ctx, "rmsnorm_gated: ctx is NULL");
    KN_CUDA_CHECK_ARG(rows >= 0 && C > 0, "rmsnorm_gated: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                      (long long)rows, (long long)C);
    KN_CUDA_CHECK_ARG(eps >= 0.0f, "rmsnorm_gated: eps=%g must be >= 0", (double)eps);
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && z && w, "rmsnorm_gated: out, x, z or w is NULL");
    rmsnorm_gated_kernel<<<norm_grid(rows), norm_block(C), 0, ctx->stream>>>(out, x, z, w, rows, C, eps);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_l2norm(kn_ctx *ctx, float *out, const float *inp, int64_t rows, int64_t C, float eps) {
    KN_CUDA_CHECK_ARG(ctx, "l2norm: ctx is NULL");
    KN_CUDA_CHECK_ARG(rows >= 0 && C > 0, "l2norm: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                      (long long)rows, (long long)C);
    KN_CUDA_CHECK_ARG(eps >= 0.0f, "l2norm: eps=%g must be >= 0", (double)eps);
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && inp, "l2norm: out or inp is NULL");
    l2norm_kernel<<<norm_grid(rows), norm_block(C), 0, ctx->stream>>>(out, inp, rows, C, eps);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
