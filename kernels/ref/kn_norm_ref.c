/* kernels/ref/kn_norm_ref.c — reference norms, one row of C at a time: rmsnorm (the
 * zero-centred Qwen3.5 form with scale 1 + w, or plain w), the GDN output norm rmsnorm_gated
 * (w · norm(x) · silu(z), plain w) and l2norm (x / sqrt(Σx² + eps)). Statistics are summed in
 * double; each output is evaluated in double and rounded once, so out may alias the input. */
#include "kn_ref.h"

static double sum_sq(const float *x, int64_t C) {
    double s = 0;
    for (int64_t c = 0; c < C; c++) s += (double)x[c] * (double)x[c];
    return s;
}

cm_status kn_ref_rmsnorm(kn_ctx *ctx, float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                         float eps, int one_plus) {
    KN_REF_CHECK(ctx, "rmsnorm: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    KN_REF_CHECK(eps >= 0, "rmsnorm: eps=%g must be >= 0", (double)eps);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(out && inp && w, "rmsnorm: out, inp or w is NULL");
    for (int64_t r = 0; r < rows; r++) {
        const float *x    = inp + r * C;
        float       *y    = out + r * C;
        double       rstd = 1.0 / sqrt(sum_sq(x, C) / (double)C + (double)eps);
        for (int64_t c = 0; c < C; c++) {
            double scale = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            y[c]         = (float)((double)x[c] * rstd * scale);
        }
    }
    return CM_OK;
}

cm_status kn_ref_rmsnorm_gated(kn_ctx *ctx, float *out, const float *x, const float *z, const float *w,
                               int64_t rows, int64_t C, float eps) {
    KN_REF_CHECK(ctx, "rmsnorm_gated: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm_gated: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    KN_REF_CHECK(eps >= 0, "rmsnorm_gated: eps=%g must be >= 0", (double)eps);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(out && x && z && w, "rmsnorm_gated: out, x, z or w is NULL");
    for (int64_t r = 0; r < rows; r++) {
        const float *xr   = x + r * C;
        const float *zr   = z + r * C;
        float       *y    = out + r * C;
        double       rstd = 1.0 / sqrt(sum_sq(xr, C) / (double)C + (double)eps);
        for (int64_t c = 0; c < C; c++)
            y[c] = (float)((double)w[c] * ((double)xr[c] * rstd) * kn_ref_silu(zr[c]));
    }
    return CM_OK;
}

cm_status kn_ref_l2norm(kn_ctx *ctx, float *out, const float *inp, int64_t rows, int64_t C, float eps) {
    KN_REF_CHECK(ctx, "l2norm: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "l2norm: bad shape rows=%lld C=%lld (rows >= 0, C > 0)", (long long)rows,
                 (long long)C);
    KN_REF_CHECK(eps >= 0, "l2norm: eps=%g must be >= 0", (double)eps);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(out && inp, "l2norm: out or inp is NULL");
    for (int64_t r = 0; r < rows; r++) {
        const float *x   = inp + r * C;
        float       *y   = out + r * C;
        double       inv = 1.0 / sqrt(sum_sq(x, C) + (double)eps);
        for (int64_t c = 0; c < C; c++) y[c] = (float)((double)x[c] * inv);
    }
    return CM_OK;
}
