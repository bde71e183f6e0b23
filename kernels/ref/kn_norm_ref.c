/* kernels/ref/kn_norm_ref.c — reference norms, one row of C at a time: rmsnorm (the
 * zero-centred Qwen3.5 form with scale 1 + w, or plain w), the GDN output norm rmsnorm_gated
 * (w · norm(x) · silu(z), plain w) and l2norm (x / sqrt(Σx² + eps)). Statistics are summed in
 * double; each output is evaluated in double and rounded once, so out may alias the input.
 * Also rmsnorm_bwd (dinp written, dw accumulated), deterministic for any thread count, and the
 * BF16-output forms add_rmsnorm_bf16 and rmsnorm_gated_bf16 (composition, then rounding). */
#include "kn_ref.h"

#include <stdlib.h>

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

// ---- backward of rmsnorm
// y = x·r·s with r = (Σx²/C + eps)^(-1/2) and s = w or 1 + w, so
//   dx = r·s⊙dy − x·(r³/C)·Σ_c dy·s·x,   dw[c] = Σ_rows dy·x·r.
// dinp is one row per task (parallel over rows); dw is summed per column over the rows in
// order (parallel over chunks of NORM_BWD_CB columns), from the per-row r kept in a scratch
// array.

#define NORM_BWD_CB 64

cm_status kn_ref_rmsnorm_bwd(kn_ctx *ctx, float *dinp, float *dw, const float *dout, const float *inp,
                             const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    KN_REF_CHECK(ctx, "rmsnorm_bwd: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm_bwd: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    KN_REF_CHECK(eps >= 0, "rmsnorm_bwd: eps=%g must be >= 0", (double)eps);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(dinp && dw && dout && inp && w, "rmsnorm_bwd: dinp, dw, dout, inp or w is NULL");
    KN_REF_CHECK(dinp != dout, "rmsnorm_bwd: dinp may not alias dout");

    double *rstd = malloc((size_t)rows * sizeof(double));
    if (!rstd) return CM_FAIL(CM_ERR_NOMEM, "rmsnorm_bwd: cannot allocate %lld row scales", (long long)rows);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *x  = inp + r * C;
        const float *dy = dout + r * C;
        float       *dx = dinp + r * C;
        const double rs = 1.0 / sqrt(sum_sq(x, C) / (double)C + (double)eps);
        double       g  = 0;
        for (int64_t c = 0; c < C; c++) {
            double s = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            g += (double)dy[c] * s * (double)x[c];
        }
        const double k = rs * rs * rs / (double)C * g;
        for (int64_t c = 0; c < C; c++) {
            double s = one_plus ? 1.0 + (double)w[c] : (double)w[c];
            dx[c]    = (float)(rs * s * (double)dy[c] - (double)x[c] * k);
        }
        rstd[r] = rs;
    }
    const int64_t n_chunks = (C + NORM_BWD_CB - 1) / NORM_BWD_CB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t chunk = 0; chunk < n_chunks; chunk++) {
        const int64_t c0 = chunk * NORM_BWD_CB, nc = C - c0 < NORM_BWD_CB ? C - c0 : NORM_BWD_CB;
        double        acc[NORM_BWD_CB] = {0};
        for (int64_t r = 0; r < rows; r++) {
            const float *dy = dout + r * C + c0, *x = inp + r * C + c0;
            for (int64_t c = 0; c < nc; c++) acc[c] += (double)dy[c] * (double)x[c] * rstd[r];
        }
        for (int64_t c = 0; c < nc; c++) dw[c0 + c] = (float)((double)dw[c0 + c] + acc[c]);
    }
    free(rstd);
    return CM_OK;
}

// ---- bf16 outputs for the next GEMM: the norms above, one row at a time into a scratch
// row, rounded to BF16

cm_status kn_ref_add_rmsnorm_bf16(kn_ctx *ctx, uint16_t *out, float *x, const float *y, const float *w,
                                  int64_t rows, int64_t C, float eps, int one_plus) {
    KN_REF_CHECK(ctx, "add_rmsnorm_bf16: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "add_rmsnorm_bf16: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    KN_REF_CHECK(eps >= 0, "add_rmsnorm_bf16: eps=%g must be >= 0", (double)eps);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(out && x && w, "add_rmsnorm_bf16: out, x or w is NULL");
    if (y) CM_TRY(kn_ref_add(ctx, x, y, rows * C));
    float *row = malloc((size_t)C * sizeof(float));
    if (!row) return CM_FAIL(CM_ERR_NOMEM, "add_rmsnorm_bf16: cannot allocate a row of %lld floats", (long long)C);
    cm_status st = CM_OK;
    for (int64_t r = 0; r < rows && st == CM_OK; r++) {
        st = kn_ref_rmsnorm(ctx, row, x + r * C, w, 1, C, eps, one_plus);
        for (int64_t c = 0; c < C; c++) out[r * C + c] = cm_f32_to_bf16(row[c]);
    }
    free(row);
    return st;
}

cm_status kn_ref_rmsnorm_gated_bf16(kn_ctx *ctx, uint16_t *out, const float *x, const float *z, const float *w,
                                    int64_t rows, int64_t C, float eps) {
    KN_REF_CHECK(ctx, "rmsnorm_gated_bf16: ctx is NULL");
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm_gated_bf16: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    KN_REF_CHECK(eps >= 0, "rmsnorm_gated_bf16: eps=%g must be >= 0", (double)eps);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(out && x && z && w, "rmsnorm_gated_bf16: out, x, z or w is NULL");
    float *row = malloc((size_t)C * sizeof(float));
    if (!row)
        return CM_FAIL(CM_ERR_NOMEM, "rmsnorm_gated_bf16: cannot allocate a row of %lld floats", (long long)C);
    cm_status st = CM_OK;
    for (int64_t r = 0; r < rows && st == CM_OK; r++) {
        st = kn_ref_rmsnorm_gated(ctx, row, x + r * C, z + r * C, w, 1, C, eps);
        for (int64_t c = 0; c < C; c++) out[r * C + c] = cm_f32_to_bf16(row[c]);
    }
    free(row);
    return st;
}
