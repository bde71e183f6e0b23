/* drafter-trainer/model/dt_model_fwd.c — the forward: fc and hidden_norm over the context, then each
 * layer's attention and MLP on the block rows. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// forward

kn_dflash_attn_params dt_attn_shape(const cm_drafter_cfg *g, int l, int64_t T, int64_t n_blocks, int B) {
    kn_dflash_attn_params p = {0};
    p.T = T;
    p.n_blocks = n_blocks;
    p.B = B;
    p.nq = g->n_heads;
    p.nkv = g->n_kv_heads;
    p.hd = g->head_dim;
    p.window = g->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION ? g->sliding_window : 0;
    p.causal = cm_drafter_layer_causal(g, l);
    p.scale = (float)(1.0 / sqrt((double)g->head_dim));
    return p;
}

/* Layer l's attention on the saved activations' dtype: q and the joint k from their slots, v and
 * the output the saved activations themselves. */
kn_dflash_attn_params dt_model_attn_params(const dt_model *m, int l) {
    const dt_layer_acts  *A = &m->acts.layer[l];
    kn_dflash_attn_params p = dt_attn_shape(&m->cfg, l, m->T, m->n_anchors, m->cfg.block_size);
    const int64_t         KV = (int64_t)m->cfg.n_kv_heads * m->cfg.head_dim;
    p.anchors = m->acts.anchors;
    p.ctx_lo = m->acts.ctx_lo;
    p.io_dt = m->adt;
    p.q = dt_model_slot_ptr(m, l, AS_Q);
    p.k_ctx = dt_model_slot_ptr(m, l, AS_K);
    p.k_blk = (const char *)p.k_ctx + (size_t)(m->T * KV) * cm_dtype_size(m->adt);
    p.v_ctx = A->vc;
    p.v_blk = A->vb;
    p.out = A->attn;
    p.lse = A->lse;
    return p;
}

/* acts.xw += inp [R, K] (adt) · W[N = D, K]ᵀ: with BF16 storage one GEMM adding into the
 * residual (cuBLASLt's beta = 1: the fp32 sum the add kernel would make); with F32 storage
 * gemm into acts.dh and add, as always. */
static cm_status residual_add(dt_model *m, const void *inp, const dt_param *w, int64_t N, int64_t K) {
    if (m->adt == CM_DTYPE_F32) {
        CM_TRY(dt_model_mm_fwd(m, m->acts.dh, CM_DTYPE_F32, inp, CM_DTYPE_F32, w, m->R, N, K));
        return m->be->add(m->ctx, m->acts.xw, m->acts.dh, m->R * N);
    }
    const void *wp;
    cm_dtype    wdt;
    CM_TRY(dt_model_weight(m, w, &wp, &wdt));
    kn_matmul_params p = {.M = m->R, .N = N, .K = K, .a = inp, .a_dt = m->adt, .lda = K, .b = wp,
                          .b_dt = wdt, .ldb = K, .trans_b = 1, .c = m->acts.xw, .c_dt = CM_DTYPE_F32,
                          .ldc = N, .accumulate = 1};
    return m->be->matmul(m->ctx, &p);
}

/* k [rows, nkv·hd] (adt) = RoPE(k_norm per head(k_pre)), k_pre the saved k_proj output (adt). */
cm_status dt_model_k_post(dt_model *m, int l, void *k, const void *k_pre, int64_t rows, const int32_t *pos) {
    const cm_drafter_cfg *g = &m->cfg;
    return m->be->head_norm_rope(m->ctx, k, m->adt, k_pre, m->adt, dt_model_lp(m, l, LP_K_NORM)->data, pos,
                                 rows, g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta,
                                 g->rms_norm_eps);
}

/* q [R, nq·hd] (adt) = RoPE(q_norm per head(q_pre)), q_pre the saved q_proj output (adt). */
cm_status dt_model_q_post(dt_model *m, int l, void *q, const void *q_pre) {
    const cm_drafter_cfg *g = &m->cfg;
    return m->be->head_norm_rope(m->ctx, q, m->adt, q_pre, m->adt, dt_model_lp(m, l, LP_Q_NORM)->data,
                                 m->acts.blk_pos, m->R, g->n_heads, g->head_dim, g->head_dim,
                                 (float)g->rope_theta, g->rms_norm_eps);
}

/* Keys and values of `rows` rows of inp [rows, D] (adt) at positions pos: k_proj's output saved
 * (written there by the GEMM, in adt), then k_norm and RoPE from it into k (adt); v_proj's saved
 * in v_s, which the attention reads. */
static cm_status kv_fwd(dt_model *m, int l, const void *inp, int64_t rows, const int32_t *pos, void *k_pre_s,
                        void *k, void *v_s) {
    const int64_t D = m->cfg.hidden_size, KV = (int64_t)m->cfg.n_kv_heads * m->cfg.head_dim;
    CM_TRY(dt_model_mm_fwd(m, k_pre_s, m->adt, inp, m->adt, dt_model_lp(m, l, LP_K), rows, KV, D));
    CM_TRY(dt_model_k_post(m, l, k, k_pre_s, rows, pos));
    return dt_model_mm_fwd(m, v_s, m->adt, inp, m->adt, dt_model_lp(m, l, LP_V), rows, KV, D);
}

/* acts.xw: x on entry (saved as A->x), x_mid = x + o_proj(attention(q from the block rows;
 * k, v from [ctx ; block rows])) on return (saved as A->x_mid). */
static cm_status attn_fwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    dt_layer_acts        *A = &a->layer[l];
    const int64_t         D = g->hidden_size, Q = (int64_t)g->n_heads * g->head_dim, R = m->R;
    const void           *hop;
    /* x saved (layer 0 with BF16 storage: only rounded) and normed; DFlash2's convolution reads the
     * normed rows in F32 from dx */
    CM_TRY(dt_model_save_norm(m, &hop, A->x, a->xw, dt_model_lp(m, l, LP_INPUT_LN)->data, R,
                              m->adt == CM_DTYPE_F32 || dt_model_is_v2(m) ? a->dx : NULL, a->H));
    if (dt_model_is_v2(m))
        CM_TRY(dt_model_conv_in_fwd(m, l, 0, &hop));
    kn_dflash_attn_params p = dt_model_attn_params(m, l);
    CM_TRY(dt_model_mm_fwd(m, A->q_pre, m->adt, hop, m->adt, dt_model_lp(m, l, LP_Q), R, Q, D));
    CM_TRY(dt_model_q_post(m, l, (void *)p.q, A->q_pre));
    CM_TRY(kv_fwd(m, l, a->ctx, m->T, a->ctx_pos, A->kc_pre, (void *)p.k_ctx, A->vc));
    CM_TRY(kv_fwd(m, l, hop, R, a->blk_pos, A->kb_pre, (void *)p.k_blk, A->vb));
    CM_TRY(be->dflash_attn_fwd(m->ctx, &p)); /* into A->attn */
    if (dt_model_is_v2(m)) { /* o_proj's output s, then the output-side convolution of s */
        CM_TRY(dt_model_mm_fwd(m, A->sA, m->adt, A->attn, m->adt, dt_model_lp(m, l, LP_O), R, D, Q));
        CM_TRY(dt_model_conv_out_fwd(m, l, 0));
    } else {
        CM_TRY(residual_add(m, A->attn, dt_model_lp(m, l, LP_O), D, Q));
    }
    return CM_OK;
}

/* acts.xw: x_mid on entry (saved as A->x_mid), x_next = x_mid + down(silu(gate(h2)) · up(h2)) on
 * return, h2 = post_attention_layernorm(x_mid). */
static cm_status mlp_fwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    dt_layer_acts        *A = &a->layer[l];
    const int64_t         D = g->hidden_size, I = g->intermediate_size, R = m->R;
    const void           *hop;
    CM_TRY(dt_model_save_norm(m, &hop, A->x_mid, a->xw, dt_model_lp(m, l, LP_POST_LN)->data, R,
                              m->adt == CM_DTYPE_F32 || dt_model_is_v2(m) ? a->dx : NULL, a->H));
    if (dt_model_is_v2(m))
        CM_TRY(dt_model_conv_in_fwd(m, l, 1, &hop));
    CM_TRY(dt_model_mm_fwd(m, A->gate, m->adt, hop, m->adt, dt_model_lp(m, l, LP_GATE), R, I, D));
    CM_TRY(dt_model_mm_fwd(m, A->up, m->adt, hop, m->adt, dt_model_lp(m, l, LP_UP), R, I, D));
    CM_TRY(be->swiglu_typed(m->ctx, a->work, m->adt, A->gate, A->up, m->adt, R * I));
    if (!dt_model_is_v2(m))
        return residual_add(m, a->work, dt_model_lp(m, l, LP_DOWN), D, I);
    CM_TRY(dt_model_mm_fwd(m, A->sM, m->adt, a->work, m->adt, dt_model_lp(m, l, LP_DOWN), R, D, I));
    return dt_model_conv_out_fwd(m, l, 1);
}

cm_status dt_model_forward(dt_model *m) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const int64_t         D = g->hidden_size, nD = (int64_t)g->n_taps * D, T = m->T;
    /* ctx = hidden_norm(F · fcᵀ), shared by every layer */
    float *pre = dt_model_fc_slot(m, FS_PRE);
    if (m->adt == CM_DTYPE_F32)
        CM_TRY(dt_model_mm_fwd(m, pre, CM_DTYPE_F32, a->F, CM_DTYPE_F32, &m->params[P_FC], T, D, nD));
    else
        for (int k = 0; k < g->n_taps; k++) {
            kn_matmul_params p = {.M = T, .N = D, .K = D, .a = m->tap[k], .a_dt = m->tap_dt, .lda = m->tap_ld,
                                  .b = m->params[P_FC].data + k * D, .b_dt = CM_DTYPE_F32, .ldb = nD, .trans_b = 1,
                                  .c = pre, .c_dt = CM_DTYPE_F32, .ldc = D, .accumulate = k > 0};
            CM_TRY(be->matmul(m->ctx, &p));
        }
    const void *ctx_op; /* = a->ctx */
    CM_TRY(dt_model_save_norm(m, &ctx_op, a->ctx_pre, pre, m->params[P_HIDDEN_NORM].data, T,
                              m->adt == CM_DTYPE_F32 ? (float *)a->ctx : NULL, a->ctx));
    CM_TRY(be->embed(m->ctx, a->xw, a->blk_ids, m->embed, m->embed_dt, m->R, D));
    for (int l = 0; l < g->n_layers; l++) {
        CM_TRY(attn_fwd(m, l));
        CM_TRY(mlp_fwd(m, l));
    }
    return CM_OK; /* x_out in acts.xw */
}
