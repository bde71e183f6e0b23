/* kernels/ref/kn_dynconv_ref.c — reference grouped dynamic causal convolution of DFlash2
 * (docs/drafter.md; semantics and shapes in kn_backend.h, kn_dynconv_params): one side of one
 * module over the block rows, taps bounded by the block's start.
 *   out[i, c] = Σ_{t ≤ min(Kc − 1, slot(i))} (base[s, t, c] + delta[i, s, t, c / G]) · x[i − t, c]
 * Backward (L = Σ r·out):
 *   dx[m, c]            = Σ_{t ≤ min(Kc − 1, B − 1 − slot(m))} coef(m + t, t, c) · dout[m + t, c]
 *   dbase[s, t, c]      = Σ_{i: slot(i) ≥ t} x[i − t, c] · dout[i, c]
 *   ddelta[i, s, t, g]  = [slot(i) ≥ t] · Σ_{c in group g} x[i − t, c] · dout[i, c]
 * Sums in double, rounded once on store (accumulate: the old out is the sum's first term); x is F32 or
 * BF16 (widened); the optional bf16 copies of out and dx round the stored F32 to nearest even. Fixed
 * orders, so any thread count gives the same bits. */
#include "kn_ref.h"

#include <stdlib.h>

cm_status kn_dynconv_check(const char *op, kn_ctx *ctx, const kn_dynconv_params *p, int bwd) {
    KN_REF_CHECK(ctx && p, "%s: ctx or params is NULL", op);
    KN_REF_CHECK(p->rows >= 0 && p->B > 0 && p->D > 0 && p->G > 0 && p->Kc > 0,
                 "%s: bad shape rows=%lld B=%d D=%d G=%d Kc=%d", op, (long long)p->rows, p->B, p->D, p->G,
                 p->Kc);
    KN_REF_CHECK(p->rows % p->B == 0, "%s: rows=%lld is not a whole number of blocks of B=%d", op,
                 (long long)p->rows, p->B);
    KN_REF_CHECK(p->D % p->G == 0, "%s: conv_group_size G=%d does not divide the hidden size D=%d", op, p->G,
                 p->D);
    KN_REF_CHECK(p->Kc <= p->B, "%s: conv_kernel_size Kc=%d is above the block size B=%d", op, p->Kc, p->B);
    KN_REF_CHECK(p->side == 0 || p->side == 1, "%s: side=%d must be 0 (input side) or 1 (output side)", op,
                 p->side);
    KN_REF_CHECK(p->rows <= INT64_MAX / 2 / p->Kc / p->D, "%s: rows=%lld overflows", op, (long long)p->rows);
    KN_REF_CHECK(p->x_dt == CM_DTYPE_F32 || p->x_dt == CM_DTYPE_BF16, "%s: x in %s; expected F32 or BF16", op,
                 cm_dtype_name(p->x_dt));
    if (p->rows == 0)
        return CM_OK;
    KN_REF_CHECK(p->x && p->base && p->delta, "%s: x, base or delta is NULL", op);
    if (bwd)
        KN_REF_CHECK(p->dout && p->dx && p->dbase && p->ddelta, "%s: dout, dx, dbase or ddelta is NULL", op);
    else
        KN_REF_CHECK(p->out && (const void *)p->out != p->x, "%s: out is NULL or aliases x", op);
    return CM_OK;
}

/* x[k] widened to double. */
static double xv(const kn_dynconv_params *p, int64_t k) {
    if (p->x_dt == CM_DTYPE_BF16)
        return (double)cm_bf16_to_f32(((const uint16_t *)p->x)[k]);
    return (double)((const float *)p->x)[k];
}

/* The coefficient of tap t for row i, channel c, on side s. */
static double coef(const kn_dynconv_params *p, int64_t i, int t, int c) {
    const int     ng = p->D / p->G;
    const int64_t di = ((i * 2 + p->side) * p->Kc + t) * ng + c / p->G;
    return (double)p->base[((int64_t)p->side * p->Kc + t) * p->D + c] + (double)p->delta[di];
}

cm_status kn_ref_dynconv_fwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    CM_TRY(kn_dynconv_check("dynconv_fwd", ctx, p, 0));
    const int D = p->D;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < p->rows; i++) {
        const int taps = (int)(i % p->B) + 1 < p->Kc ? (int)(i % p->B) + 1 : p->Kc;
        for (int c = 0; c < D; c++) {
            double acc = p->accumulate ? (double)p->out[i * D + c] : 0;
            for (int t = 0; t < taps; t++)
                acc += coef(p, i, t, c) * xv(p, (i - t) * D + c);
            p->out[i * D + c] = (float)acc;
            if (p->out_bf16)
                p->out_bf16[i * D + c] = cm_f32_to_bf16(p->out[i * D + c]);
        }
    }
    return CM_OK;
}

cm_status kn_ref_dynconv_bwd(kn_ctx *ctx, const kn_dynconv_params *p) {
    CM_TRY(kn_dynconv_check("dynconv_bwd", ctx, p, 1));
    if (p->rows == 0)
        return CM_OK;
    const int     D = p->D, B = p->B, Kc = p->Kc, G = p->G, ng = D / G, s = p->side;
    const int64_t rows = p->rows;
    /* dx: row m is tapped by rows m + t of its block */
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t m = 0; m < rows; m++) {
        const int after = B - 1 - (int)(m % B); /* rows after m in its block */
        const int taps = after + 1 < Kc ? after + 1 : Kc;
        for (int c = 0; c < D; c++) {
            double acc = 0;
            for (int t = 0; t < taps; t++)
                acc += coef(p, m + t, t, c) * (double)p->dout[(m + t) * D + c];
            p->dx[m * D + c] = (float)acc;
            if (p->dx_bf16)
                p->dx_bf16[m * D + c] = cm_f32_to_bf16(p->dx[m * D + c]);
        }
    }
    /* ddelta: this side's slice of every row; taps that reach before the block's start are 0 */
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t i = 0; i < rows; i++) {
        const int slot = (int)(i % B);
        for (int t = 0; t < Kc; t++)
            for (int g = 0; g < ng; g++) {
                double acc = 0;
                if (t <= slot)
                    for (int c = g * G; c < (g + 1) * G; c++)
                        acc += xv(p, (i - t) * D + c) * (double)p->dout[i * D + c];
                p->ddelta[((i * 2 + s) * Kc + t) * ng + g] = (float)acc;
            }
    }
    /* dbase: this side's [Kc, D], a sum over rows in row order */
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t tc = 0; tc < (int64_t)Kc * D; tc++) {
        const int t = (int)(tc / D), c = (int)(tc % D);
        double    acc = 0;
        for (int64_t i = 0; i < rows; i++)
            if ((int)(i % B) >= t)
                acc += xv(p, (i - t) * D + c) * (double)p->dout[i * D + c];
        p->dbase[((int64_t)s * Kc + t) * D + c] = (float)acc;
    }
    return CM_OK;
}
