/* drafter-trainer/model/dt_model_conv.c — DFlash2's grouped dynamic causal convolutions around each
 * layer's attention (module 0) and MLP (module 1), on the block rows (docs/drafter.md). For the
 * sublayer input u (the normed rows), δ = u · kernel_projectionᵀ gives each row's coefficients of
 * both sides; the input side turns u into u' = conv(u), the sublayer runs on u', and the output side
 * convolves its output s into the residual stream. Saved per module: δ (F32) and s (adt, written by
 * the sublayer's last GEMM and read by the convolution in both passes as it is); u and u' are
 * recomputed in the backward from the saved residual stream, read as stored. The convolutions write the next
 * GEMM's bf16 operand themselves (no conversion pass) and add into the residual stream. Scratch: acts.cu (u),
 * acts.cup (u', then ∂/∂u), acts.cdd (∂/∂δ of both sides), acts.dh (∂/∂s on the way down). The
 * design: dt_model_int.h. */
#include "dt_model_int.h"

static float *conv_delta(dt_model *m, int l, int mod) {
    return mod ? m->acts.layer[l].dM : m->acts.layer[l].dA;
}

static kn_dynconv_params conv_params(dt_model *m, int l, int mod, int side) {
    const cm_drafter_cfg *g = &m->cfg;
    kn_dynconv_params     p = {0};
    p.rows = m->R;
    p.B = g->block_size;
    p.D = g->hidden_size;
    p.G = g->conv_group_size;
    p.Kc = g->conv_kernel_size;
    p.side = side;
    p.base = dt_model_lp(m, l, mod ? LP_MCONV_BASE : LP_ACONV_BASE)->data;
    p.delta = conv_delta(m, l, mod);
    return p;
}

static int64_t conv_np(const dt_model *m) {
    return 2 * (int64_t)m->cfg.conv_kernel_size * m->ng;
}

static const float *conv_ln(dt_model *m, int l, int mod) {
    return dt_model_lp(m, l, mod ? LP_POST_LN : LP_INPUT_LN)->data;
}

/* u' = the input-side convolution of u (F32) into acts.cup and, with BF16 storage, its bf16 copy into
 * acts.H (the GEMM operand, made in the same pass); *hop = the operand. */
static cm_status conv_in(dt_model *m, int l, int mod, const float *u, const void **hop) {
    kn_dynconv_params p = conv_params(m, l, mod, 0);
    p.x = u;
    p.out = m->acts.cup;
    p.out_bf16 = m->adt == CM_DTYPE_BF16 ? m->acts.H : NULL;
    *hop = p.out_bf16 ? (const void *)p.out_bf16 : (const void *)p.out;
    return m->be->dynconv_fwd(m->ctx, &p);
}

/* acts.dx holds u (F32) and *hop its GEMM operand on entry: δ = u · Wpᵀ (saved), u' = the input-side
 * convolution of u into acts.cup, and *hop becomes u' as a GEMM operand. */
cm_status dt_model_conv_in_fwd(dt_model *m, int l, int mod, const void **hop) {
    const int64_t D = m->cfg.hidden_size, R = m->R;
    const dt_param *wp = dt_model_lp(m, l, mod ? LP_MCONV_PROJ : LP_ACONV_PROJ);
    CM_TRY(dt_model_mm_fwd(m, conv_delta(m, l, mod), CM_DTYPE_F32, *hop, m->adt, wp, R, conv_np(m), D));
    return conv_in(m, l, mod, m->acts.dx, hop);
}

/* The module's saved sublayer output s (adt, written there by the sublayer's last GEMM): xw += its
 * output-side convolution, in one pass. */
cm_status dt_model_conv_out_fwd(dt_model *m, int l, int mod) {
    const dt_layer_acts *A = &m->acts.layer[l];
    kn_dynconv_params    p = conv_params(m, l, mod, 1);
    p.x = mod ? A->sM : A->sA;
    p.x_dt = m->adt;
    p.out = m->acts.xw;
    p.accumulate = 1;
    return m->be->dynconv_fwd(m->ctx, &p);
}

/* acts.dx holds ∂/∂(the residual after the module): ∂/∂s into acts.dh and *dop (its GEMM operand:
 * dh, or its bf16 copy in acts.H), the output side's base gradient and its half of ∂/∂δ into
 * acts.cdd. */
cm_status dt_model_conv_out_bwd(dt_model *m, int l, int mod, const void **dop) {
    const dt_layer_acts *A = &m->acts.layer[l];
    kn_dynconv_params    p = conv_params(m, l, mod, 1);
    p.x = mod ? A->sM : A->sA;
    p.x_dt = m->adt;
    p.dout = m->acts.dx;
    p.dx = m->acts.dh;
    p.dx_bf16 = m->adt == CM_DTYPE_BF16 ? m->acts.H : NULL;
    p.dbase = dt_model_lp(m, l, mod ? LP_MCONV_BASE : LP_ACONV_BASE)->grad;
    p.ddelta = m->acts.cdd;
    *dop = p.dx_bf16 ? (const void *)p.dx_bf16 : (const void *)p.dx;
    return m->be->dynconv_bwd(m->ctx, &p);
}

/* The forward's u' again from the module's input x (x_dt: a saved row in adt, or F32) read as stored:
 * u = its norm into acts.cu, u' into acts.cup, *hop = u' as a GEMM operand. */
cm_status dt_model_conv_in_recompute(dt_model *m, int l, int mod, const void *x, cm_dtype x_dt,
                                     const void **hop) {
    const cm_drafter_cfg      *g = &m->cfg;
    const kn_norm_typed_params p = {.rows = m->R,
                                    .C = g->hidden_size,
                                    .eps = g->rms_norm_eps,
                                    .w = conv_ln(m, l, mod),
                                    .x = (void *)x,
                                    .x_dt = x_dt,
                                    .out = m->acts.cu};
    CM_TRY(m->be->rmsnorm_typed(m->ctx, &p));
    return conv_in(m, l, mod, m->acts.cu, hop);
}

/* acts.dh holds ∂/∂u' (u and u' as dt_model_conv_in_recompute left them): through the input-side
 * convolution and the kernel projection to ∂/∂u, then the norm's backward adds ∂/∂x into acts.dx
 * (x as dt_model_conv_in_recompute read it). */
cm_status dt_model_conv_in_bwd(dt_model *m, int l, int mod, const void *x, cm_dtype x_dt) {
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, R = m->R, NP = conv_np(m);
    dt_param             *wp = dt_model_lp(m, l, mod ? LP_MCONV_PROJ : LP_ACONV_PROJ);
    dt_param             *ln = dt_model_lp(m, l, mod ? LP_POST_LN : LP_INPUT_LN);
    kn_dynconv_params     p = conv_params(m, l, mod, 0);
    p.x = m->acts.cu;
    p.dout = m->acts.dh;
    p.dx = m->acts.cup;
    p.dbase = dt_model_lp(m, l, mod ? LP_MCONV_BASE : LP_ACONV_BASE)->grad;
    p.ddelta = m->acts.cdd;
    CM_TRY(m->be->dynconv_bwd(m->ctx, &p));
    /* δ = u · Wpᵀ: both sides' ∂/∂δ back into u and Wp */
    CM_TRY(dt_model_mm_dx(m, m->acts.cup, CM_DTYPE_F32, m->acts.cdd, CM_DTYPE_F32, wp, R, NP, D, 1));
    CM_TRY(dt_model_mm_dw(m, wp, m->acts.cdd, CM_DTYPE_F32, m->acts.cu, CM_DTYPE_F32, R, NP, D));
    return dt_model_norm_bwd(m, m->acts.dx, ln->grad, m->acts.cup, x, x_dt, ln->data, R, 1, NULL);
}
