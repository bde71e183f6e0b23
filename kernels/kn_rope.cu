/* kernels/kn_rope.cu — NeoX half-split rotary embedding in place on x [T, n_heads, head_dim]:
 * pair (i, i + rot_dim/2) for i < rot_dim/2, dims [rot_dim, head_dim) untouched, and its
 * backward: the transpose of the rotation, i.e. the same angle with sin negated (exact), applied
 * in place to the gradient dx. Numerics follow Hugging Face and the reference exactly:
 * inv_freq[i] = 1 / theta^((2i)/rot_dim) is computed on the host in float32 by the same
 * expression as ref/kn_rope_ref.c and passed as a kernel argument, the angle pos·inv_freq is one
 * float32 product (__fmul_rn, never fused), and cos, sin and the rotation run in double,
 * rounded once. One thread per (token, pair), looping over heads so the angle is computed
 * once; x is read and written once. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

#include "kn_rope_int.h"

// ----------------------------------------------------------------------------
// kernels

/* BWD: the backward (sin negated); the forward's code has no trace of it. */
template <bool BWD>
static __global__ void rope_kernel(float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                                   int half, const kn_rope_freqs freqs) {
    int64_t n = T * half;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
        int64_t t = idx / half;
        int     i = (int)(idx % half);
        float   angle = __fmul_rn((float)pos[t], freqs.inv[i]);
        double  s, c;
        sincos((double)angle, &s, &c);
        if (BWD)
            s = -s;
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + (t * n_heads + h) * (int64_t)head_dim;
            double x1 = xh[i], x2 = xh[i + half];
            xh[i] = (float)(x1 * c - x2 * s);
            xh[i + half] = (float)(x2 * c + x1 * s);
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

/* The common body of rope and rope_bwd; op and xname name the call and x in messages. */
template <bool BWD>
static cm_status rope_run(kn_ctx *ctx, const char *op, const char *xname, float *x, const int32_t *pos,
                          int64_t T, int n_heads, int head_dim, int rot_dim, float theta) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(T >= 0 && n_heads > 0 && head_dim > 0, "%s: bad shape T=%lld n_heads=%d head_dim=%d",
                      op, (long long)T, n_heads, head_dim);
    KN_CUDA_CHECK_ARG(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_dim,
                      "%s: rot_dim=%d must be even, > 0 and <= head_dim=%d", op, rot_dim, head_dim);
    KN_CUDA_CHECK_ARG(theta > 0 && isfinite(theta), "%s: theta=%g must be finite and > 0", op, (double)theta);
    if (rot_dim / 2 > KN_ROPE_MAX_HALF)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%s: rot_dim=%d is not supported by the cuda backend (max %d)", op,
                       rot_dim, 2 * KN_ROPE_MAX_HALF);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(x && pos, "%s: %s or pos is NULL", op, xname);

    const int     half = rot_dim / 2;
    kn_rope_freqs freqs;
    kn_rope_freqs_fill(&freqs, rot_dim, theta);
    int64_t n = T * half;
    int64_t blocks = (n + 255) / 256;
    rope_kernel<BWD><<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        x, pos, T, n_heads, head_dim, half, freqs);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rope(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                       int rot_dim, float theta) {
    return rope_run<false>(ctx, "rope", "x", x, pos, T, n_heads, head_dim, rot_dim, theta);
}

cm_status kn_cuda_rope_bwd(kn_ctx *ctx, float *dx, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                           int rot_dim, float theta) {
    return rope_run<true>(ctx, "rope_bwd", "dx", dx, pos, T, n_heads, head_dim, rot_dim, theta);
}
