/* drafter-trainer/model/dt_model_bwd.c — the loss (final norm, LM head, cross-entropy on the selected
 * rows) and the backward. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// loss and backward

/* The final norm, the LM head and cross-entropy on the selected rows only (compacted), then
 * the gradient through the final norm into acts.dx (rows without a label get zero gradient). */
static cm_status loss_fwd_bwd(dt_model *m) {
    const kn_backend *be = m->be;
    dt_acts          *a = &m->acts;
    const int64_t     D = m->cfg.hidden_size, n = m->n_sel;
    dt_param         *norm = &m->params[m->p_norm];
    float            *hsel = a->dx, *dhsel = a->work; /* [n, D], [n + 1, D] */
    CM_TRY(be->rmsnorm(m->ctx, a->dh, a->xw, norm->data, m->R, D, m->cfg.rms_norm_eps, 0));
    /* gathers as row lookups (the embed op on an F32 table): two launches instead of one
     * copy per run of selected rows (~1000 at 512 anchors) */
    CM_TRY(be->embed(m->ctx, hsel, a->sel, a->dh, CM_DTYPE_F32, n, D));
    if (dt_model_is_v2(m)) { /* the unary pass also takes each row's top-K for the selector */
        const kn_lm_topk_params p = {.R = n, .V = m->V, .D = D, .K = m->cfg.selector_top_k, .h = hsel,
                                     .labels = a->labels, .gscale = a->gscale, .w = m->lm_head,
                                     .wdt = m->lm_head_dt, .dh = dhsel, .ce = a->ce, .argmax = a->argmax,
                                     .topk_idx = a->topk_idx, .topk_val = a->topk_val,
                                     .label_logit = a->lab_logit};
        CM_TRY(be->lm_ce_topk(m->ctx, &p));
    } else {
        CM_TRY(be->lm_ce(m->ctx, dhsel, a->ce, a->argmax, hsel, a->labels, a->gscale, m->lm_head, m->lm_head_dt,
                         n, m->V, D));
    }
    CM_TRY(be->download(m->ctx, m->host.ce, a->ce, (size_t)n * sizeof(float)));
    CM_TRY(be->download(m->ctx, m->host.argmax, a->argmax, (size_t)n * sizeof(int32_t)));
    if (dt_model_is_v2(m))
        CM_TRY(dt_model_selector(m, hsel, dhsel));
    CM_TRY(dt_model_dev_zero(m, dhsel + n * D, D)); /* the row unselected block rows read */
    CM_TRY(be->embed(m->ctx, a->dh, a->inv, dhsel, CM_DTYPE_F32, m->R, D));
    return dt_model_norm_bwd(m, a->dx, norm->grad, a->dh, a->xw, CM_DTYPE_F32, norm->data, m->R, 0,
                             dt_model_is_v2(m) ? NULL : dt_model_dx_op_out(m));
}

/* acts.dx holds ∂/∂x_next on entry and ∂/∂x_mid on return. */
static cm_status mlp_bwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const dt_layer_acts  *A = &a->layer[l];
    const int64_t         D = g->hidden_size, I = g->intermediate_size, R = m->R;
    const cm_dtype        t = m->adt;
    dt_param             *gate = dt_model_lp(m, l, LP_GATE), *up = dt_model_lp(m, l, LP_UP),
             *down = dt_model_lp(m, l, LP_DOWN), *ln = dt_model_lp(m, l, LP_POST_LN);
    const void *hop, *dxop;
    if (dt_model_is_v2(m)) { /* ∂/∂(down's output) through the output-side convolution, in dh */
        CM_TRY(dt_model_conv_out_bwd(m, l, 1, &dxop));
    } else {
        CM_TRY(dt_model_dx_op(m, &dxop));
    }
    /* ∂/∂h into work; then one pass recomputes the SwiGLU product h over it (down's weight
     * gradient needs h) and writes h's gradient over the saved gate and up */
    CM_TRY(dt_model_mm_dx(m, a->work, t, dxop, t, down, R, D, I, 0));
    CM_TRY(be->swiglu_fwd_bwd_typed(m->ctx, a->work, A->gate, A->up, a->work, A->gate, A->up, t, R * I));
    CM_TRY(dt_model_mm_dw(m, down, dxop, t, a->work, t, R, D, I));
    if (dt_model_is_v2(m)) /* h2' (the convolved h2), recomputed (over dxop) from the saved x_mid */
        CM_TRY(dt_model_conv_in_recompute(m, l, 1, A->x_mid, t, &hop));
    else /* h2, recomputed (over dxop) from the saved x_mid */
        CM_TRY(dt_model_norm_saved(m, &hop, A->x_mid, ln->data, R));
    CM_TRY(dt_model_mm_dw(m, gate, A->gate, t, hop, t, R, I, D));
    CM_TRY(dt_model_mm_dw(m, up, A->up, t, hop, t, R, I, D));
    CM_TRY(dt_model_mm_dx(m, a->dh, CM_DTYPE_F32, A->gate, t, gate, R, I, D, 0));
    CM_TRY(dt_model_mm_dx(m, a->dh, CM_DTYPE_F32, A->up, t, up, R, I, D, 1));
    if (dt_model_is_v2(m))
        return dt_model_conv_in_bwd(m, l, 1, A->x_mid, t);
    return dt_model_norm_bwd(m, a->dx, ln->grad, a->dh, A->x_mid, t, ln->data, R, 1, dt_model_dx_op_out(m));
}

/* Backward of kv_fwd given dk (after RoPE and k_norm; rotated back in place) and dv: the k/v
 * weight grads and the input gradient into dinp (= or += as accumulate says). dk_pre a free slot
 * sized for [rows, KV] in F32: it holds ∂/∂k_pre in dt_model_gemm_op_dt, the GEMMs' operand, and
 * when that is BF16 dv rounded once for both of v's GEMMs in its second half. */
static cm_status kv_bwd(dt_model *m, int l, const void *inp, int64_t rows, const int32_t *pos,
                        const void *k_pre_s, float *dk, const float *dv, void *dk_pre, float *dinp,
                        int accumulate) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, KV = (int64_t)g->n_kv_heads * g->head_dim;
    const cm_dtype        gdt = dt_model_gemm_op_dt(m);
    dt_param *wk = dt_model_lp(m, l, LP_K), *wv = dt_model_lp(m, l, LP_V), *kn = dt_model_lp(m, l, LP_K_NORM);
    CM_TRY(be->head_norm_rope_bwd(m->ctx, dk_pre, gdt, kn->grad, dk, k_pre_s, m->adt, kn->data, pos, rows,
                                  g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta,
                                  g->rms_norm_eps));
    const void *dv_op = dv;
    if (gdt != CM_DTYPE_F32) {
        void *dvr = (char *)dk_pre + (size_t)(rows * KV) * cm_dtype_size(gdt);
        CM_TRY(be->cast2d(m->ctx, dvr, gdt, rows * KV, dv, CM_DTYPE_F32, rows * KV, 1, rows * KV));
        dv_op = dvr;
    }
    CM_TRY(dt_model_mm_dw(m, wk, dk_pre, gdt, inp, m->adt, rows, KV, D));
    CM_TRY(dt_model_mm_dw(m, wv, dv_op, gdt, inp, m->adt, rows, KV, D));
    CM_TRY(dt_model_mm_dx(m, dinp, CM_DTYPE_F32, dk_pre, gdt, wk, rows, KV, D, accumulate));
    CM_TRY(dt_model_mm_dx(m, dinp, CM_DTYPE_F32, dv_op, gdt, wv, rows, KV, D, 1));
    return CM_OK;
}

/* acts.dx holds ∂/∂x_mid on entry and ∂/∂x (the layer's input) on return; the context
 * key/value gradients of this layer go into acts.dctx (written by the last layer, the first
 * one the backward visits, and summed by the others). */
static cm_status attn_bwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const dt_layer_acts  *A = &a->layer[l];
    const int64_t         D = g->hidden_size, Q = (int64_t)g->n_heads * g->head_dim, R = m->R, T = m->T;
    dt_param *wq = dt_model_lp(m, l, LP_Q), *wo = dt_model_lp(m, l, LP_O), *qn = dt_model_lp(m, l, LP_Q_NORM),
             *ln = dt_model_lp(m, l, LP_INPUT_LN);
    kn_dflash_attn_params p = dt_model_attn_params(m, l);
    void                 *dq_pre = dt_model_slot_ptr(m, l, AS_DQP);
    const void           *dxop;
    if (dt_model_is_v2(m)) { /* ∂/∂(o_proj's output) through the output-side convolution, in dh */
        CM_TRY(dt_model_conv_out_bwd(m, l, 0, &dxop));
    } else {
        CM_TRY(dt_model_dx_op(m, &dxop));
    }
    CM_TRY(dt_model_mm_dw(m, wo, dxop, m->adt, A->attn, m->adt, R, D, Q));
    p.dout = dt_model_slot_ptr(m, l, AS_DO);
    CM_TRY(dt_model_mm_dx(m, (float *)p.dout, CM_DTYPE_F32, dxop, m->adt, wo, R, D, Q, 0));
    /* the attention's inputs again: q and k through their norms and RoPE (v and out are saved) */
    CM_TRY(dt_model_q_post(m, l, (void *)p.q, A->q_pre));
    CM_TRY(dt_model_k_post(m, l, (void *)p.k_ctx, A->kc_pre, T, a->ctx_pos));
    CM_TRY(dt_model_k_post(m, l, (void *)p.k_blk, A->kb_pre, R, a->blk_pos));
    p.dq = dt_model_slot_ptr(m, l, AS_DQ);
    p.dk_ctx = dt_model_slot_ptr(m, l, AS_DKC);
    p.dv_ctx = dt_model_slot_ptr(m, l, AS_DVC);
    p.dk_blk = dt_model_slot_ptr(m, l, AS_DKB);
    p.dv_blk = dt_model_slot_ptr(m, l, AS_DVB);
    CM_TRY(be->dflash_attn_bwd(m->ctx, &p));
    /* queries: dq rotated back and through q_norm into dq_pre (in the GEMMs' operand dtype) */
    const cm_dtype gdt = dt_model_gemm_op_dt(m);
    CM_TRY(be->head_norm_rope_bwd(m->ctx, dq_pre, gdt, qn->grad, p.dq, A->q_pre, m->adt, qn->data, a->blk_pos,
                                  R, g->n_heads, g->head_dim, g->head_dim, (float)g->rope_theta,
                                  g->rms_norm_eps));
    /* the layer input x: saved (adt), or (layer 0 with BF16 storage) the embedding again in xw,
     * rounded as the forward rounded it, and h = its norm recomputed (DFlash: as the GEMM input) */
    const void *x = A->x, *hop = NULL;
    cm_dtype    x_dt = m->adt;
    if (!A->x) {
        CM_TRY(be->embed(m->ctx, a->xw, a->blk_ids, m->embed, m->embed_dt, R, D));
        CM_TRY(dt_model_save_norm(m, &hop, NULL, a->xw, ln->data, R, NULL, a->H));
        x = a->xw, x_dt = CM_DTYPE_F32;
    } else if (!dt_model_is_v2(m)) {
        CM_TRY(dt_model_norm_saved(m, &hop, A->x, ln->data, R));
    }
    if (dt_model_is_v2(m)) /* h' (the convolved h), recomputed */
        CM_TRY(dt_model_conv_in_recompute(m, l, 0, x, x_dt, &hop));
    CM_TRY(dt_model_mm_dw(m, wq, dq_pre, gdt, hop, m->adt, R, Q, D));
    CM_TRY(dt_model_mm_dx(m, a->dh, CM_DTYPE_F32, dq_pre, gdt, wq, R, Q, D, 0));
    /* block keys and values feed dh; context keys and values feed dctx */
    CM_TRY(kv_bwd(m, l, hop, R, a->blk_pos, A->kb_pre, p.dk_blk, p.dv_blk, dt_model_slot_ptr(m, l, AS_DKPB),
                  a->dh, 1));
    CM_TRY(kv_bwd(m, l, a->ctx, T, a->ctx_pos, A->kc_pre, p.dk_ctx, p.dv_ctx,
                  dt_model_slot_ptr(m, l, AS_DKPC), a->dctx, l != g->n_layers - 1));
    if (dt_model_is_v2(m))
        return dt_model_conv_in_bwd(m, l, 0, x, x_dt);
    return dt_model_norm_bwd(m, a->dx, ln->grad, a->dh, x, x_dt, ln->data, R, 1,
                             l > 0 ? dt_model_dx_op_out(m) : NULL);
}

cm_status dt_model_backward(dt_model *m) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const int64_t         D = g->hidden_size, nD = (int64_t)g->n_taps * D, T = m->T;
    CM_TRY(loss_fwd_bwd(m));
    CM_TRY(dt_model_grads_final_from(m, m->p_norm)); /* the final norm (and the selector) */
    for (int l = g->n_layers - 1; l >= 0; l--) {
        CM_TRY(mlp_bwd(m, l));
        CM_TRY(attn_bwd(m, l));
        CM_TRY(dt_model_grads_final_from(m, P_LAYER0 + l * m->n_lp)); /* layer l's */
    }
    /* acts.dx now holds the gradient of the (frozen) embedding output: dropped. */
    dt_param *hn = &m->params[P_HIDDEN_NORM], *fc = &m->params[P_FC];
    /* dpre in F32, and for the tap GEMMs in their operand dtype (bf16 into the free FS_PRE slot where
     * they round their operands anyway) */
    float         *dpre = dt_model_fc_slot(m, FS_OUT);
    const cm_dtype gdt = dt_model_gemm_op_dt(m);
    const void    *dpre_op =
        gdt == CM_DTYPE_F32 ? (const void *)dpre : (const void *)dt_model_fc_slot(m, FS_PRE);
    CM_TRY(dt_model_norm_bwd(m, dpre, hn->grad, a->dctx, a->ctx_pre, m->adt, hn->data, T, 0,
                             gdt == CM_DTYPE_F32 ? NULL : (void *)dpre_op));
    if (m->adt == CM_DTYPE_F32) {
        CM_TRY(dt_model_mm_dw(m, fc, dpre, CM_DTYPE_F32, a->F, CM_DTYPE_F32, T, D, nD));
    } else {
        const int acc = !dt_model_grad_first(m, fc); /* one product per tap, each its own column block */
        for (int k = 0; k < g->n_taps; k++) {
            kn_matmul_params p = {.M = D,
                                  .N = D,
                                  .K = T,
                                  .a = dpre_op,
                                  .a_dt = gdt,
                                  .lda = D,
                                  .trans_a = 1,
                                  .b = m->tap[k],
                                  .b_dt = m->tap_dt,
                                  .ldb = m->tap_ld,
                                  .c = fc->grad + k * D,
                                  .c_dt = CM_DTYPE_F32,
                                  .ldc = nD,
                                  .accumulate = acc};
            CM_TRY(be->matmul(m->ctx, &p));
        }
    }
    return dt_model_grads_final_from(m, 0); /* fc and hidden_norm: all of them */
}
