/* kernels/ref/kn_rope_ref.c — reference rotary embedding, NeoX half-split, in place on
 * x [T, n_heads, head_dim]. Matches Hugging Face Qwen3.5 (qwen_hybrid.md §2.2):
 * inv_freq[i] = 1 / theta^((2i)/rot_dim) rounded to F32 as torch computes it, the angle
 * pos·inv_freq rounded to F32 (HF's float32 product, which matters at large positions), and
 * then cos, sin and x' = x·cos + rotate_half(x)·sin in double, rounded once. Pair (i, i +
 * rot_dim/2) for i < rot_dim/2; dims [rot_dim, head_dim) pass through untouched. The
 * backward (rope_bwd, the transpose of this orthogonal map) rotates by the negative angle. */
#include "kn_ref.h"

/* Rotates x by sign·angle: sign +1 is the forward, −1 its transpose (the backward). The
 * angle, cos and sin are the same for both; negating sin is exact, so rope_bwd∘rope is the
 * identity up to the two roundings of the stored values. */
static cm_status rope_apply(const char *op, kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int n_heads,
                            int head_dim, int rot_dim, float theta, double sign) {
    KN_REF_CHECK(ctx, "%s: ctx is NULL", op);
    KN_REF_CHECK(T >= 0 && n_heads > 0 && head_dim > 0, "%s: bad shape T=%lld n_heads=%d head_dim=%d", op,
                 (long long)T, n_heads, head_dim);
    KN_REF_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_dim,
                 "%s: rot_dim=%d must be even, > 0 and <= head_dim=%d", op, rot_dim, head_dim);
    KN_REF_CHECK(theta > 0 && isfinite(theta), "%s: theta=%g must be finite and > 0", op, (double)theta);
    if (T == 0) return CM_OK;
    KN_REF_CHECK(x && pos, "%s: x or pos is NULL", op);

    const int half = rot_dim / 2;
    for (int64_t t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            float  expo     = (float)(2 * i) / (float)rot_dim;
            float  inv_freq = 1.0f / powf(theta, expo);
            float  angle    = (float)pos[t] * inv_freq;
            double c = cos((double)angle), s = sign * sin((double)angle);
            for (int h = 0; h < n_heads; h++) {
                float *xh = x + (t * n_heads + h) * (int64_t)head_dim;
                double x1 = xh[i], x2 = xh[i + half];
                xh[i]        = (float)(x1 * c - x2 * s);
                xh[i + half] = (float)(x2 * c + x1 * s);
            }
        }
    }
    return CM_OK;
}

cm_status kn_ref_rope(kn_ctx *ctx, float *x, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                      int rot_dim, float theta) {
    return rope_apply("rope", ctx, x, pos, T, n_heads, head_dim, rot_dim, theta, 1.0);
}

cm_status kn_ref_rope_bwd(kn_ctx *ctx, float *dx, const int32_t *pos, int64_t T, int n_heads, int head_dim,
                          int rot_dim, float theta) {
    return rope_apply("rope_bwd", ctx, dx, pos, T, n_heads, head_dim, rot_dim, theta, -1.0);
}
