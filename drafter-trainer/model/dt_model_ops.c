/* drafter-trainer/model/dt_model_ops.c — typed helpers of both passes: saved activations in the activation
 * dtype, temporaries in F32, the GEMMs and norms on them. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// typed helpers: saved activations in adt, temporaries in F32

/* acts.dx as the GEMM operand that starts a layer half's backward (DFlash): itself (F32 storage),
 * or acts.H, where the norm backward that finished acts.dx wrote its bf16 (dt_model_norm_bwd into
 * dt_model_dx_op_out), so no GEMM rounds it on its own. */
cm_status dt_model_dx_op(dt_model *m, const void **op) {
    *op = m->adt == CM_DTYPE_F32 ? (const void *)m->acts.dx : m->acts.H;
    return CM_OK;
}

/* x [rows, D] (F32) saved into save (adt; NULL: not saved) and normed with w, *hop the normed rows
 * as a GEMM input. F32 storage: a copy, and rmsnorm into h32 (*hop = h32). BF16 storage: one pass
 * rounds x in place to the values it saves (the forward goes on with them, so the backward's
 * recomputations see them exactly), and writes the normed rows' bf16 into hb (*hop = hb) and, when
 * h32 is given, their F32 into h32. */
cm_status dt_model_save_norm(dt_model *m, const void **hop, void *save, float *x, const float *w, int64_t rows,
                             float *h32, void *hb) {
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         n = rows * g->hidden_size;
    if (m->adt == CM_DTYPE_F32) {
        if (save)
            CM_TRY(m->be->cast2d(m->ctx, save, CM_DTYPE_F32, n, x, CM_DTYPE_F32, n, 1, n));
        *hop = h32;
        return m->be->rmsnorm(m->ctx, h32, x, w, rows, g->hidden_size, g->rms_norm_eps, 0);
    }
    const kn_norm_typed_params p = {.rows = rows, .C = g->hidden_size, .eps = g->rms_norm_eps, .w = w, .x = x,
                                    .x_dt = CM_DTYPE_F32, .round = 1, .x_bf16 = save, .out = h32, .out_bf16 = hb};
    *hop = hb;
    return m->be->rmsnorm_typed(m->ctx, &p);
}

/* The normed rows of a saved x [rows, D] (adt) as a GEMM input *hop: F32 storage norms into acts.xw
 * (free in the backward), BF16 storage writes their bf16 into acts.H straight from the saved rows. */
cm_status dt_model_norm_saved(dt_model *m, const void **hop, const void *x, const float *w, int64_t rows) {
    const cm_drafter_cfg *g = &m->cfg;
    if (m->adt == CM_DTYPE_F32) {
        *hop = m->acts.xw;
        return m->be->rmsnorm(m->ctx, m->acts.xw, x, w, rows, g->hidden_size, g->rms_norm_eps, 0);
    }
    const kn_norm_typed_params p = {.rows = rows, .C = g->hidden_size, .eps = g->rms_norm_eps, .w = w,
                                    .x = (void *)x, .x_dt = m->adt, .out_bf16 = m->acts.H};
    *hop = m->acts.H;
    return m->be->rmsnorm_typed(m->ctx, &p);
}

/* dinp [rows, D] (= or += when acc) the norm backward of dout through the norm with w of x (x_dt: a
 * saved row in adt, or F32), dw +=; dinp_bf16 (NULL: none) gets the bf16 of dinp's final value in the
 * same pass, for GEMMs that take it next (acts.H: the operand dt_model_dx_op gives the next layer
 * half). */
cm_status dt_model_norm_bwd(dt_model *m, float *dinp, float *dw, const float *dout, const void *x,
                            cm_dtype x_dt, const float *w, int64_t rows, int acc, void *dinp_bf16) {
    const cm_drafter_cfg          *g = &m->cfg;
    const kn_norm_bwd_typed_params p = {.rows = rows,
                                        .C = g->hidden_size,
                                        .eps = g->rms_norm_eps,
                                        .w = w,
                                        .dw = dw,
                                        .x = x,
                                        .x_dt = x_dt,
                                        .dout = dout,
                                        .dinp = dinp,
                                        .accumulate = acc,
                                        .dinp_bf16 = dinp_bf16};
    return m->be->rmsnorm_bwd_typed(m->ctx, &p);
}

/* acts.H where BF16 storage makes it the next layer half's dx operand (dt_model_dx_op), else NULL. */
void *dt_model_dx_op_out(dt_model *m) {
    return m->adt == CM_DTYPE_F32 ? NULL : m->acts.H;
}

/* The three GEMMs with typed activations against W: its bf16 copy where it has one
 * (dt_model_weight), else the F32 master. The all-F32 cases go through gemm, gemm_dx and gemm_dw
 * (the same cuBLASLt call on cuda, the tiled reference on cpu). */
/* out[M, N] (odt) = inp[M, K] (idt) · W[N, K]ᵀ */
cm_status dt_model_mm_fwd(dt_model *m, void *out, cm_dtype odt, const void *inp, cm_dtype idt,
                          const dt_param *w, int64_t M, int64_t N, int64_t K) {
    const void *wp;
    cm_dtype    wdt;
    CM_TRY(dt_model_weight(m, w, &wp, &wdt));
    if (odt == CM_DTYPE_F32 && idt == CM_DTYPE_F32 && wdt == CM_DTYPE_F32)
        return m->be->gemm(m->ctx, out, inp, (const float *)wp, CM_DTYPE_F32, M, N, K);
    kn_matmul_params p = {.M = M, .N = N, .K = K, .a = inp, .a_dt = idt, .lda = K, .b = wp, .b_dt = wdt,
                          .ldb = K, .trans_b = 1, .c = out, .c_dt = odt, .ldc = N};
    return m->be->matmul(m->ctx, &p);
}

/* dinp[M, K] (odt; = or += when acc) = dout[M, N] (ddt) · W[N, K] */
cm_status dt_model_mm_dx(dt_model *m, void *dinp, cm_dtype odt, const void *dout, cm_dtype ddt,
                         const dt_param *w, int64_t M, int64_t N, int64_t K, int acc) {
    const void *wp;
    cm_dtype    wdt;
    CM_TRY(dt_model_weight(m, w, &wp, &wdt));
    if (odt == CM_DTYPE_F32 && ddt == CM_DTYPE_F32 && wdt == CM_DTYPE_F32)
        return m->be->gemm_dx(m->ctx, dinp, dout, (const float *)wp, CM_DTYPE_F32, M, N, K, acc);
    kn_matmul_params p = {.M = M, .N = K, .K = N, .a = dout, .a_dt = ddt, .lda = N, .b = wp, .b_dt = wdt,
                          .ldb = K, .c = dinp, .c_dt = odt, .ldc = K, .accumulate = acc};
    return m->be->matmul(m->ctx, &p);
}

/* w's grad [N, K] += dout[M, N]ᵀ (ddt) · inp[M, K] (idt), or = for the step's first product
 * into it (dt_model_grad_first: the grad was not zeroed; F32 operands zero it first, gemm_dw
 * always accumulating). */
cm_status dt_model_mm_dw(dt_model *m, dt_param *w, const void *dout, cm_dtype ddt, const void *inp,
                         cm_dtype idt, int64_t M, int64_t N, int64_t K) {
    const int acc = !dt_model_grad_first(m, w);
    if (ddt == CM_DTYPE_F32 && idt == CM_DTYPE_F32) {
        if (!acc)
            CM_TRY(dt_model_dev_zero(m, w->grad, N * K));
        return m->be->gemm_dw(m->ctx, w->grad, dout, inp, M, N, K);
    }
    kn_matmul_params p = {.M = N, .N = K, .K = M, .a = dout, .a_dt = ddt, .lda = N, .trans_a = 1, .b = inp,
                          .b_dt = idt, .ldb = K, .c = w->grad, .c_dt = CM_DTYPE_F32, .ldc = K, .accumulate = acc};
    return m->be->matmul(m->ctx, &p);
}
