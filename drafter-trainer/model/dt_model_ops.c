/* drafter-trainer/model/dt_model_ops.c — typed helpers of both passes: saved activations in the activation
 * dtype, temporaries in F32, the GEMMs and norms on them. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// typed helpers: saved activations in adt, temporaries in F32

/* dst (adt) = src [n] (F32). With BF16 storage src is rounded in place to the stored values,
 * so the forward goes on with exactly what the backward will read. */
cm_status dt_model_save_act(dt_model *m, void *dst, float *src, int64_t n) {
    CM_TRY(m->be->cast2d(m->ctx, dst, m->adt, n, src, CM_DTYPE_F32, n, 1, n));
    if (m->adt != CM_DTYPE_F32)
        CM_TRY(m->be->cast2d(m->ctx, src, CM_DTYPE_F32, n, dst, m->adt, n, 1, n));
    return CM_OK;
}

/* x [n] (F32, R·D) rounded in place to its BF16 values through acts.H, as save_act would
 * leave it, for the layer input that is not saved. */
cm_status dt_model_round_x(dt_model *m, float *x, int64_t n) {
    if (m->adt == CM_DTYPE_F32)
        return CM_OK;
    CM_TRY(m->be->cast2d(m->ctx, m->acts.H, m->adt, n, x, CM_DTYPE_F32, n, 1, n));
    return m->be->cast2d(m->ctx, x, CM_DTYPE_F32, n, m->acts.H, m->adt, n, 1, n);
}

/* acts.dx as a GEMM operand: itself (F32 storage), or rounded once into acts.H (BF16), which
 * every GEMM would otherwise do on its own, in its own scratch. H is free until the layer's
 * normed rows are recomputed. */
cm_status dt_model_dx_op(dt_model *m, const void **op) {
    return dt_model_f32_op(m, op, m->acts.dx, m->R * m->cfg.hidden_size);
}

/* src [n ≤ R·D] (F32) as a GEMM operand: itself (F32 storage), or rounded once into acts.H. */
cm_status dt_model_f32_op(dt_model *m, const void **op, const float *src, int64_t n) {
    *op = src;
    if (m->adt == CM_DTYPE_F32)
        return CM_OK;
    CM_TRY(m->be->cast2d(m->ctx, m->acts.H, m->adt, n, src, CM_DTYPE_F32, n, 1, n));
    *op = m->acts.H;
    return CM_OK;
}

/* Where the backward recomputes normed rows in F32: xw when the saved inputs are F32 (xw is
 * free then, and the rows serve as the GEMM input until the layer is done), else dh (only
 * until their BF16 copy in acts.H is made; dh is free until the layer's first dx GEMM). */
float *dt_model_h_buf(dt_model *m) {
    return m->adt == CM_DTYPE_F32 ? m->acts.xw : m->acts.dh;
}

/* dst (F32) = src [n] (adt). */
cm_status dt_model_load_act(dt_model *m, float *dst, const void *src, int64_t n) {
    return m->be->cast2d(m->ctx, dst, CM_DTYPE_F32, n, src, m->adt, n, 1, n);
}

/* The saved activation src [n] as F32: itself when adt is F32, else widened into buf. */
cm_status dt_model_act_f32(dt_model *m, const float **out, const void *src, float *buf, int64_t n) {
    if (m->adt == CM_DTYPE_F32) {
        *out = src;
        return CM_OK;
    }
    CM_TRY(dt_model_load_act(m, buf, src, n));
    *out = buf;
    return CM_OK;
}

/* rows × C of inp normed with w into h32 (F32), and as a GEMM input (adt): h32 itself, or its
 * BF16 rounding in acts.H. */
cm_status dt_model_norm_op(dt_model *m, const void **hop, float *h32, const float *inp, const float *w,
                           int64_t rows) {
    const cm_drafter_cfg *g = &m->cfg;
    CM_TRY(m->be->rmsnorm(m->ctx, h32, inp, w, rows, g->hidden_size, g->rms_norm_eps, 0));
    *hop = h32;
    if (m->adt != CM_DTYPE_F32) {
        const int64_t n = rows * g->hidden_size;
        CM_TRY(m->be->cast2d(m->ctx, m->acts.H, m->adt, n, h32, CM_DTYPE_F32, n, 1, n));
        *hop = m->acts.H;
    }
    return CM_OK;
}

/* The three GEMMs with typed activations against the F32 master W; the F32 cases go through
 * gemm, gemm_dx and gemm_dw (the same cuBLASLt call on cuda, the tiled reference on cpu). */
/* out[M, N] (odt) = inp[M, K] (idt) · W[N, K]ᵀ */
cm_status dt_model_mm_fwd(dt_model *m, void *out, cm_dtype odt, const void *inp, cm_dtype idt, const float *w,
                          int64_t M, int64_t N, int64_t K) {
    if (odt == CM_DTYPE_F32 && idt == CM_DTYPE_F32)
        return m->be->gemm(m->ctx, out, inp, w, CM_DTYPE_F32, M, N, K);
    kn_matmul_params p = {.M = M, .N = N, .K = K, .a = inp, .a_dt = idt, .lda = K, .b = w, .b_dt = CM_DTYPE_F32,
                          .ldb = K, .trans_b = 1, .c = out, .c_dt = odt, .ldc = N};
    return m->be->matmul(m->ctx, &p);
}

/* dinp[M, K] (odt; = or += when acc) = dout[M, N] (ddt) · W[N, K] */
cm_status dt_model_mm_dx(dt_model *m, void *dinp, cm_dtype odt, const void *dout, cm_dtype ddt,
                         const float *w, int64_t M, int64_t N, int64_t K, int acc) {
    if (odt == CM_DTYPE_F32 && ddt == CM_DTYPE_F32)
        return m->be->gemm_dx(m->ctx, dinp, dout, w, CM_DTYPE_F32, M, N, K, acc);
    kn_matmul_params p = {.M = M, .N = K, .K = N, .a = dout, .a_dt = ddt, .lda = N, .b = w, .b_dt = CM_DTYPE_F32,
                          .ldb = K, .c = dinp, .c_dt = odt, .ldc = K, .accumulate = acc};
    return m->be->matmul(m->ctx, &p);
}

/* dw[N, K] += dout[M, N]ᵀ (ddt) · inp[M, K] (idt) */
cm_status dt_model_mm_dw(dt_model *m, float *dw, const void *dout, cm_dtype ddt, const void *inp,
                         cm_dtype idt, int64_t M, int64_t N, int64_t K) {
    if (ddt == CM_DTYPE_F32 && idt == CM_DTYPE_F32)
        return m->be->gemm_dw(m->ctx, dw, dout, inp, M, N, K);
    kn_matmul_params p = {.M = N, .N = K, .K = M, .a = dout, .a_dt = ddt, .lda = N, .trans_a = 1, .b = inp,
                          .b_dt = idt, .ldb = K, .c = dw, .c_dt = CM_DTYPE_F32, .ldc = K, .accumulate = 1};
    return m->be->matmul(m->ctx, &p);
}
