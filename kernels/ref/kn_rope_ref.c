/* kernels/ref/kn_rope_ref.c — reference rotary embedding, NeoX half-split, in place on
 * x [T, n_heads, head_dim]. Matches Hugging Face Qwen3.5 (docs/target.md):
 * inv_freq[i] = 1 / theta^((2i)/rot_dim) rounded to F32 as torch computes it, the angle
 * pos·inv_freq rounded to F32 (HF's float32 product, which matters at large positions), and
 * then cos, sin and x' = x·cos + rotate_half(x)·sin in double, rounded once. Pair (i, i +
 * rot_dim/2) for i < rot_dim/2; dims [rot_dim, head_dim) pass through untouched. The
 * backward (rope_bwd, the transpose of this orthogonal map) rotates by the negative angle.
 * Also qk_prep, the attention's q/k split, head norms and rope in one pass per token. */
#include "kn_ref.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* 1 when [a, a + na) and [b, b + nb) (floats) share an address. */
static int spans_overlap(const float *a, int64_t na, const float *b, int64_t nb) {
    const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a0 < b0 + (uintptr_t)nb * sizeof(float) && b0 < a0 + (uintptr_t)na * sizeof(float);
}

/* The attention's q/k prep, one token at a time: each head row is copied out of qg (and its
 * gate half copied), rmsnorm'ed and rotated while it is in cache. Every value goes through the
 * expressions of kn_ref_copy2d, kn_ref_rmsnorm and rope_apply above in the same order (sum
 * of squares in double, one rounding per output, the angle's float product, cos and sin in
 * double), so the result is bit-identical to that chain. */
cm_status kn_ref_qk_prep(kn_ctx *ctx, float *q, float *gate, float *k, const float *qg, const float *q_norm,
                         const float *k_norm, const int32_t *pos, int64_t T, int nq, int nkv, int hd, int rot_dim,
                         float theta, float eps, int one_plus) {
    KN_REF_CHECK(ctx, "qk_prep: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nq > 0 && nkv > 0 && hd > 0, "qk_prep: bad shape T=%lld nq=%d nkv=%d hd=%d",
                 (long long)T, nq, nkv, hd);
    KN_REF_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= hd,
                 "qk_prep: rot_dim=%d must be even, > 0 and <= head_dim=%d", rot_dim, hd);
    KN_REF_CHECK(theta > 0 && isfinite(theta), "qk_prep: theta=%g must be finite and > 0", (double)theta);
    KN_REF_CHECK(eps >= 0, "qk_prep: eps=%g must be >= 0", (double)eps);
    if (T == 0) return CM_OK;
    KN_REF_CHECK(q && k && qg && q_norm && k_norm && pos, "qk_prep: q, k, qg, q_norm, k_norm or pos is NULL");
    const int64_t qs = gate ? 2 * (int64_t)hd : hd, nqe = T * nq * (int64_t)hd, nke = T * nkv * (int64_t)hd;
    KN_REF_CHECK(!spans_overlap(qg, T * nq * qs, k, nke) && (!gate || !spans_overlap(qg, T * nq * qs, gate, nqe)) &&
                     (qg == q ? !gate : !spans_overlap(qg, T * nq * qs, q, nqe)),
                 "qk_prep: qg overlaps q, gate or k (only an ungated q may equal qg)");

    const int half = rot_dim / 2;
    double   *cs   = malloc((size_t)half * 2 * sizeof *cs);
    if (!cs) return CM_FAIL(CM_ERR_NOMEM, "qk_prep: cannot allocate %d angles", half);
    double *sn = cs + half;
    for (int64_t t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            float expo     = (float)(2 * i) / (float)rot_dim;
            float inv_freq = 1.0f / powf(theta, expo);
            float angle    = (float)pos[t] * inv_freq;
            cs[i]          = cos((double)angle);
            sn[i]          = sin((double)angle);
        }
        for (int h = 0; h < nq + nkv; h++) {
            const int    isq = h < nq;
            float       *y   = isq ? q + (t * nq + h) * (int64_t)hd : k + (t * nkv + h - nq) * (int64_t)hd;
            const float *w   = isq ? q_norm : k_norm;
            if (isq) {
                const float *src = qg + (t * nq + h) * qs;
                if (src != y) memmove(y, src, (size_t)hd * sizeof(float));
                if (gate) memcpy(gate + (t * nq + h) * (int64_t)hd, src + hd, (size_t)hd * sizeof(float));
            }
            double ss = 0;
            for (int c = 0; c < hd; c++) ss += (double)y[c] * (double)y[c];
            double rstd = 1.0 / sqrt(ss / (double)hd + (double)eps);
            for (int c = 0; c < hd; c++) {
                double scale = one_plus ? 1.0 + (double)w[c] : (double)w[c];
                y[c]         = (float)((double)y[c] * rstd * scale);
            }
            for (int i = 0; i < half; i++) {
                double x1 = y[i], x2 = y[i + half];
                y[i]        = (float)(x1 * cs[i] - x2 * sn[i]);
                y[i + half] = (float)(x2 * cs[i] + x1 * sn[i]);
            }
        }
    }
    free(cs);
    return CM_OK;
}
