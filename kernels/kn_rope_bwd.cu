/* kernels/kn_rope_bwd.cu — backward of the NeoX half-split RoPE (kn_rope.cu): the transpose
 * of the rotation, i.e. the same angle with sin negated (exact), applied in place to the
 * gradient dx [T, n_heads, head_dim]. Numerics as the forward and the reference: inv_freq in
 * float32 on the host by the reference's expression, angle = one float32 product
 * (__fmul_rn), cos/sin and the rotation in double, rounded once. One thread per (token,
 * pair), looping over heads; dims [rot_dim, head_dim) untouched. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"

#include <math.h>

#define KN_ROPE_BWD_MAX_HALF 512 /* rot_dim <= 1024, as the forward */

typedef struct rope_bwd_freqs {
    float inv[KN_ROPE_BWD_MAX_HALF];
} rope_bwd_freqs;

static __global__ void rope_bwd_kernel(float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                                       int half, const rope_bwd_freqs freqs) {
    int64_t n = T * half;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
        int64_t t = idx / half;
        int     i = (int)(idx % half);
        float   angle = __fmul_rn((float)pos[t], freqs.inv[i]);
        double  s, c;
        sincos((double)angle, &s, &c);
        s = -s;
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + (t * n_heads + h) * (int64_t)head_dim;
            double x1 = xh[i], x2 = xh[i + half];
            xh[i] = (float)(x1 * c - x2 * s);
            xh[i + half] = (float)(x2 * c + x1 * s);
        }
    }
}

cm_status kn_cuda_rope_bwd(kn_ctx *ctx, float *dx, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                           int rot_dim, float theta) {
    KN_CUDA_CHECK_ARG(ctx, "rope_bwd: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && n_heads > 0 && head_dim > 0, "rope_bwd: bad shape T=%lld n_heads=%d head_dim=%d",
                      (long long)T, n_heads, head_dim);
    KN_CUDA_CHECK_ARG(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_dim,
                      "rope_bwd: rot_dim=%d must be even, > 0 and <= head_dim=%d", rot_dim, head_dim);
    KN_CUDA_CHECK_ARG(theta > 0 && isfinite(theta), "rope_bwd: theta=%g must be finite and > 0", (double)theta);
    if (rot_dim / 2 > KN_ROPE_BWD_MAX_HALF)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "rope_bwd: rot_dim=%d is not supported by the cuda backend (max %d)",
                       rot_dim, 2 * KN_ROPE_BWD_MAX_HALF);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(dx && pos, "rope_bwd: dx or pos is NULL");
    const int      half = rot_dim / 2;
    rope_bwd_freqs freqs;
    for (int i = 0; i < half; i++) {
        float expo = (float)(2 * i) / (float)rot_dim;
        freqs.inv[i] = 1.0f / powf(theta, expo);
    }
    int64_t n = T * half, blocks = (n + 255) / 256;
    rope_bwd_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, ctx->stream>>>(
        dx, pos, T, n_heads, head_dim, half, freqs);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
