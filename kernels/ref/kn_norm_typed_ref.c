/* kernels/ref/kn_norm_typed_ref.c — the drafter's norms on typed storage, as compositions of the
 * references they fuse: rmsnorm_typed = (round: cast2d to BF16 and back,) widen, rmsnorm, cast2d;
 * rmsnorm_bwd_typed = widen, rmsnorm_bwd or rmsnorm_bwd_acc, cast2d; head_norm_rope = widen,
 * rmsnorm per head row, rope (, cast2d); head_norm_rope_bwd = rope_bwd, widen, rmsnorm_bwd (, cast2d). Each
 * runs those very functions on F32 temporaries, so it gives the bits of the chain it stands for. */
#include "kn_ref.h"

#include <stdlib.h>
#include <string.h>

static int typed_ok(cm_dtype dt) {
    return dt == CM_DTYPE_F32 || dt == CM_DTYPE_BF16;
}

/* x [n] (F32 or BF16) as F32: x itself, or its exact widening in *tmp (the caller frees it). */
static cm_status widen(const char *op, const void *x, cm_dtype dt, int64_t n, const float **out, float **tmp) {
    *tmp = NULL;
    if (dt == CM_DTYPE_F32) {
        *out = x;
        return CM_OK;
    }
    float *t = malloc((size_t)n * sizeof *t);
    if (!t) return CM_FAIL(CM_ERR_NOMEM, "%s: cannot allocate %lld floats", op, (long long)n);
    const uint16_t *b = x;
    for (int64_t i = 0; i < n; i++) t[i] = cm_bf16_to_f32(b[i]);
    *out = *tmp = t;
    return CM_OK;
}

static void to_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = cm_f32_to_bf16(src[i]);
}

cm_status kn_ref_rmsnorm_typed(kn_ctx *ctx, const kn_norm_typed_params *p) {
    KN_REF_CHECK(ctx && p, "rmsnorm_typed: ctx or params is NULL");
    if (!typed_ok(p->x_dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "rmsnorm_typed: x in %s is not supported (F32 or BF16)",
                       cm_dtype_name(p->x_dt));
    const int64_t rows = p->rows, C = p->C, n = rows * C;
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm_typed: bad shape rows=%lld C=%lld (rows >= 0, C > 0)", (long long)rows,
                 (long long)C);
    KN_REF_CHECK(p->eps >= 0, "rmsnorm_typed: eps=%g must be >= 0", (double)p->eps);
    KN_REF_CHECK(!p->round || p->x_dt == CM_DTYPE_F32, "rmsnorm_typed: round needs x in F32");
    KN_REF_CHECK(!p->x_bf16 || p->round, "rmsnorm_typed: x_bf16 is written only with round");
    KN_REF_CHECK(p->out || p->out_bf16, "rmsnorm_typed: no output (out or out_bf16)");
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(p->x && p->w, "rmsnorm_typed: x or w is NULL");
    if (p->round) {
        float *x = p->x;
        for (int64_t i = 0; i < n; i++) {
            const uint16_t b = cm_f32_to_bf16(x[i]);
            if (p->x_bf16) p->x_bf16[i] = b;
            x[i] = cm_bf16_to_f32(b);
        }
    }
    const float *xf = NULL;
    float       *xt = NULL, *yt = NULL, *y = p->out;
    CM_TRY(widen("rmsnorm_typed", p->x, p->x_dt, n, &xf, &xt));
    if (!y) y = yt = malloc((size_t)n * sizeof *yt);
    cm_status st = y ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "rmsnorm_typed: cannot allocate %lld floats", (long long)n);
    if (st == CM_OK) st = kn_ref_rmsnorm(ctx, y, xf, p->w, rows, C, p->eps, p->one_plus);
    if (st == CM_OK && p->out_bf16) to_bf16(p->out_bf16, y, n);
    free(xt);
    free(yt);
    return st;
}

cm_status kn_ref_rmsnorm_bwd_typed(kn_ctx *ctx, const kn_norm_bwd_typed_params *p) {
    KN_REF_CHECK(ctx && p, "rmsnorm_bwd_typed: ctx or params is NULL");
    if (!typed_ok(p->x_dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED, "rmsnorm_bwd_typed: x in %s is not supported (F32 or BF16)",
                       cm_dtype_name(p->x_dt));
    const int64_t rows = p->rows, C = p->C, n = rows * C;
    KN_REF_CHECK(rows >= 0 && C > 0, "rmsnorm_bwd_typed: bad shape rows=%lld C=%lld (rows >= 0, C > 0)",
                 (long long)rows, (long long)C);
    if (rows == 0) return CM_OK;
    KN_REF_CHECK(p->x && p->dout && p->dinp && p->dinp != p->dout && (const void *)p->dinp != p->x,
                 "rmsnorm_bwd_typed: x, dout or dinp is NULL, or dinp aliases dout or x");
    const float *xf = NULL;
    float       *xt = NULL;
    CM_TRY(widen("rmsnorm_bwd_typed", p->x, p->x_dt, n, &xf, &xt));
    cm_status st = p->accumulate ? kn_ref_rmsnorm_bwd_acc(ctx, p->dinp, p->dw, p->dout, xf, p->w, rows, C, p->eps,
                                                          p->one_plus)
                                 : kn_ref_rmsnorm_bwd(ctx, p->dinp, p->dw, p->dout, xf, p->w, rows, C, p->eps,
                                                      p->one_plus);
    if (st == CM_OK && p->dinp_bf16) to_bf16(p->dinp_bf16, p->dinp, n);
    free(xt);
    return st;
}

cm_status kn_ref_head_norm_rope(kn_ctx *ctx, void *out, cm_dtype out_dt, const void *x, cm_dtype x_dt,
                                const float *w, const int32_t *pos, int64_t T, int nh, int hd, int rot_dim,
                                float theta, float eps) {
    KN_REF_CHECK(ctx, "head_norm_rope: ctx is NULL");
    if (!typed_ok(x_dt) || !typed_ok(out_dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "head_norm_rope: x in %s or out in %s is not supported (F32 or BF16)",
                       cm_dtype_name(x_dt), cm_dtype_name(out_dt));
    KN_REF_CHECK(T >= 0 && nh > 0 && hd > 0, "head_norm_rope: bad shape T=%lld nh=%d hd=%d", (long long)T, nh, hd);
    KN_REF_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= hd && theta > 0 && isfinite(theta) && eps >= 0,
                 "head_norm_rope: rot_dim=%d (even, <= hd=%d), theta=%g (> 0) or eps=%g (>= 0) out of range", rot_dim,
                 hd, (double)theta, (double)eps);
    if (T == 0) return CM_OK;
    KN_REF_CHECK(out && x, "head_norm_rope: out or x is NULL");
    KN_REF_CHECK(out != x || out_dt == x_dt, "head_norm_rope: out may equal x only in the same dtype");
    const int64_t n = T * nh * (int64_t)hd;
    float        *y = out_dt == CM_DTYPE_F32 ? out : malloc((size_t)n * sizeof *y);
    if (!y)
        return CM_FAIL(CM_ERR_NOMEM, "head_norm_rope: cannot allocate %lld floats", (long long)n);
    if (x_dt == CM_DTYPE_F32) {
        if ((const void *)y != x)
            memmove(y, x, (size_t)n * sizeof *y);
    } else {
        const uint16_t *b = x;
        for (int64_t i = 0; i < n; i++)
            y[i] = cm_bf16_to_f32(b[i]);
    }
    cm_status st = kn_ref_rmsnorm(ctx, y, y, w, T * nh, hd, eps, 0);
    if (st == CM_OK)
        st = kn_ref_rope(ctx, y, pos, T, nh, hd, rot_dim, theta);
    if (st == CM_OK && out_dt != CM_DTYPE_F32)
        to_bf16(out, y, n);
    if ((void *)y != out)
        free(y);
    return st;
}

cm_status kn_ref_head_norm_rope_bwd(kn_ctx *ctx, void *dinp, cm_dtype dinp_dt, float *dw, float *dout,
                                    const void *x, cm_dtype x_dt, const float *w, const int32_t *pos,
                                    int64_t T, int nh, int hd, int rot_dim, float theta, float eps) {
    KN_REF_CHECK(ctx, "head_norm_rope_bwd: ctx is NULL");
    if (!typed_ok(x_dt) || !typed_ok(dinp_dt))
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "head_norm_rope_bwd: x in %s or dinp in %s is not supported (F32 or BF16)",
                       cm_dtype_name(x_dt), cm_dtype_name(dinp_dt));
    KN_REF_CHECK(T >= 0 && nh > 0 && hd > 0, "head_norm_rope_bwd: bad shape T=%lld nh=%d hd=%d", (long long)T, nh,
                 hd);
    KN_REF_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= hd && theta > 0 && isfinite(theta) && eps >= 0,
                 "head_norm_rope_bwd: rot_dim=%d (even, <= hd=%d), theta=%g (> 0) or eps=%g (>= 0) out of range",
                 rot_dim, hd, (double)theta, (double)eps);
    if (T == 0) return CM_OK;
    KN_REF_CHECK(dinp && dout && x && dinp != (void *)dout && (const void *)dinp != x,
                 "head_norm_rope_bwd: dinp, dout or x is NULL, or dinp aliases dout or x");
    const int64_t n = T * nh * (int64_t)hd;
    CM_TRY(kn_ref_rope_bwd(ctx, dout, pos, T, nh, hd, rot_dim, theta));
    const float *xf = NULL;
    float       *xt = NULL, *dt = dinp_dt == CM_DTYPE_F32 ? dinp : malloc((size_t)n * sizeof *dt);
    cm_status    st =
        dt ? widen("head_norm_rope_bwd", x, x_dt, n, &xf, &xt)
              : CM_FAIL(CM_ERR_NOMEM, "head_norm_rope_bwd: cannot allocate %lld floats", (long long)n);
    if (st == CM_OK)
        st = kn_ref_rmsnorm_bwd(ctx, dt, dw, dout, xf, w, T * nh, hd, eps, 0);
    if (st == CM_OK && dinp_dt != CM_DTYPE_F32)
        to_bf16(dinp, dt, n);
    if (dt != dinp)
        free(dt);
    free(xt);
    return st;
}
