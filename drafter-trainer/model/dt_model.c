/* drafter-trainer/model/dt_model.c — the drafter's parameter table (one slab of fp32 masters, one of
 * grads, carved per tensor in serving-key order), create/destroy and the accessors of dt_model.h. The
 * design: dt_model_int.h. */
#include "dt_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// parameters

dt_param *dt_model_lp(dt_model *m, int l, int j) {
    return &m->params[P_LAYER0 + l * m->n_lp + j];
}

/* A parameter of shape [d0], [d0, d1] or [d0, d1, d2] (trailing zeros end the shape). */
static void param_def3(dt_model *m, int i, const char *name, int64_t d0, int64_t d1, int64_t d2) {
    dt_param *p = &m->params[i];
    snprintf(m->names[i], sizeof m->names[i], "%s", name);
    p->name = m->names[i];
    p->n_dims = d2 ? 3 : d1 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->shape[2] = d2;
    p->numel = d0 * (d1 ? d1 : 1) * (d2 ? d2 : 1);
}

static void param_def(dt_model *m, int i, const char *name, int64_t rows, int64_t cols) {
    param_def3(m, i, name, rows, cols, 0);
}

static void params_define(dt_model *m) {
    const cm_drafter_cfg *c = &m->cfg;
    const int64_t         D = c->hidden_size, I = c->intermediate_size, hd = c->head_dim;
    const int64_t         nq = c->n_heads, nkv = c->n_kv_heads;
    param_def(m, P_FC, "fc.weight", D, (int64_t)c->n_taps * D);
    param_def(m, P_HIDDEN_NORM, "hidden_norm.weight", D, 0);
    static const char *const suffix[LP_COUNT] = {"input_layernorm.weight",  "self_attn.q_proj.weight",
                                                 "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                                 "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                                 "self_attn.k_norm.weight", "post_attention_layernorm.weight",
                                                 "mlp.gate_proj.weight",    "mlp.up_proj.weight",
                                                 "mlp.down_proj.weight"};
    const int64_t            shape[LP_COUNT][2] = {{D, 0},       {nq * hd, D}, {nkv * hd, D}, {nkv * hd, D},
                                                   {D, nq * hd}, {hd, 0},      {hd, 0},       {D, 0},
                                                   {I, D},       {I, D},       {D, I}};
    for (int l = 0; l < c->n_layers; l++) {
        char name[80];
        for (int j = 0; j < LP_COUNT; j++) {
            snprintf(name, sizeof name, "layers.%d.%s", l, suffix[j]);
            param_def(m, P_LAYER0 + l * m->n_lp + j, name, shape[j][0], shape[j][1]);
        }
        if (m->n_lp == LP_COUNT)
            continue;
        const int64_t Kc = c->conv_kernel_size, proj = 2 * Kc * m->ng;
        static const char *const conv[2] = {"attention_conv", "mlp_conv"};
        for (int k = 0; k < 2; k++) {
            snprintf(name, sizeof name, "layers.%d.%s.base_kernel", l, conv[k]);
            param_def3(m, P_LAYER0 + l * m->n_lp + LP_ACONV_BASE + 2 * k, name, 2, Kc, D);
            snprintf(name, sizeof name, "layers.%d.%s.kernel_projection.weight", l, conv[k]);
            param_def(m, P_LAYER0 + l * m->n_lp + LP_ACONV_PROJ + 2 * k, name, proj, D);
        }
    }
    param_def(m, m->p_norm, "norm.weight", D, 0);
    if (m->p_sel < 0)
        return;
    const int64_t V = c->vocab_size, Rk = c->selector_rank;
    param_def(m, m->p_sel + SP_PRED, "candidate_selector.predecessor_codebook", V, Rk);
    param_def(m, m->p_sel + SP_SUCC, "candidate_selector.successor_codebook", V, Rk);
    param_def(m, m->p_sel + SP_HPROJ, "candidate_selector.hidden_projection.weight", Rk, D);
}

const char *const dt_selector_miss_names[3] = {"inject", "drop", NULL};

cm_status dt_model_set_selector(dt_model *m, const dt_selector_opts *o) {
    if (!(o->alpha >= 0) || !isfinite(o->alpha))
        return CM_FAIL(CM_ERR_INVALID_ARG, "the selector loss weight alpha %g must be finite and >= 0", o->alpha);
    if (o->miss != KN_SEL_INJECT && o->miss != KN_SEL_DROP)
        return CM_FAIL(CM_ERR_INVALID_ARG, "unknown selector miss policy %d", (int)o->miss);
    m->sel = *o;
    return CM_OK;
}

static cm_status check_cfg(const cm_drafter_cfg *c) {
    if (c->kind == CM_DRAFTER_DFLASH2) {
        if (c->selector_top_k < 1 || c->selector_top_k > KN_TOPK_MAX)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "selector_top_k %d is not supported (1 to %d)", c->selector_top_k,
                           KN_TOPK_MAX);
        if (c->conv_kernel_size < 1 || c->conv_kernel_size > c->block_size || c->conv_group_size < 1 ||
            c->hidden_size % c->conv_group_size != 0 || c->selector_rank < 1)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "DFlash2 config: conv_kernel_size %d (1 to block_size %d), conv_group_size %d (must "
                           "divide hidden_size %d), selector_rank %d (>= 1)",
                           c->conv_kernel_size, c->block_size, c->conv_group_size, c->hidden_size,
                           c->selector_rank);
    }
    if (c->block_size < 2 || c->block_size > DT_MAX_BLOCK)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "block_size %d is not supported (2 to %d)", c->block_size,
                       DT_MAX_BLOCK);
    if (c->hidden_size < 1 || c->n_layers < 1 || c->intermediate_size < 1 || c->vocab_size < 1 ||
        c->n_taps < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "drafter config has a non-positive size (hidden %d, layers %d, "
                       "intermediate %d, vocab %d, taps %d)",
                       c->hidden_size, c->n_layers, c->intermediate_size, c->vocab_size, c->n_taps);
    if (c->n_heads < 1 || c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads != 0)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "num_attention_heads %d must be a positive multiple of "
                       "num_key_value_heads %d",
                       c->n_heads, c->n_kv_heads);
    if (c->head_dim < 2 || c->head_dim % 2 != 0)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "head_dim %d must be even (RoPE rotates half-split pairs)",
                       c->head_dim);
    if (c->attention_bias)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention_bias is not supported by the drafter (no q/k/v biases in "
                       "DFlash checkpoints); set attention_bias false");
    if (c->mask_token_id < 0 || c->mask_token_id >= c->vocab_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "mask_token_id %d is outside the vocabulary [0, %d)",
                       c->mask_token_id, c->vocab_size);
    for (int l = 0; l < c->n_layers; l++)
        if (c->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION && c->sliding_window < 1)
            return CM_FAIL(CM_ERR_INVALID_ARG, "layer %d is sliding_attention but sliding_window is %d", l,
                           c->sliding_window);
        else if (c->layer_types[l] != CM_LAYER_TYPE_SLIDING_ATTENTION &&
                 c->layer_types[l] != CM_LAYER_TYPE_FULL_ATTENTION)
            return CM_FAIL(CM_ERR_INVALID_ARG, "layer %d has a layer type the drafter does not have", l);
    return CM_OK;
}

static cm_status check_backend(const kn_backend *be, int v2) {
    // clang-format off
#define DT_NEED(fn) {#fn, be->fn != NULL}
    const struct {
        const char *name;
        int         present;
    } need[] = {
        DT_NEED(alloc),    DT_NEED(free),       DT_NEED(upload),  DT_NEED(download),        DT_NEED(sync),
        DT_NEED(zero),
        DT_NEED(cast2d),   DT_NEED(add),        DT_NEED(swiglu_typed), DT_NEED(embed),      DT_NEED(gemm),
        DT_NEED(rmsnorm),  DT_NEED(rope), DT_NEED(gemm_dx), DT_NEED(gemm_dw), DT_NEED(swiglu_fwd_bwd_typed), DT_NEED(lm_ce),
        DT_NEED(dflash_attn_fwd), DT_NEED(dflash_attn_bwd), DT_NEED(matmul),
        DT_NEED(rmsnorm_typed), DT_NEED(rmsnorm_bwd_typed), DT_NEED(head_norm_rope), DT_NEED(head_norm_rope_bwd),
    };
    const struct {
        const char *name;
        int         present;
    } need2[] = {DT_NEED(dynconv_fwd), DT_NEED(dynconv_bwd), DT_NEED(lm_ce_topk), DT_NEED(selector_fwd),
                 DT_NEED(selector_bwd)};
    // clang-format on
#undef DT_NEED
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (!need[i].present)
            return CM_FAIL(CM_ERR_UNSUPPORTED,
                           "the %s backend has no drafter kernels yet (no %s; use --device cpu)", be->name,
                           need[i].name);
    for (size_t i = 0; v2 && i < sizeof need2 / sizeof need2[0]; i++)
        if (!need2[i].present)
            return CM_FAIL(CM_ERR_UNSUPPORTED,
                           "the %s backend has no DFlash2 kernels yet (no %s; use --device cpu)", be->name,
                           need2[i].name);
    return CM_OK;
}

/* Clears n floats of backend memory. */
cm_status dt_model_dev_zero(dt_model *m, float *p, int64_t n) {
    return m->be->zero(m->ctx, p, (size_t)n * sizeof(float));
}

cm_status dt_model_create(dt_model **out, const cm_drafter_cfg *cfg, const kn_backend *be, kn_ctx *ctx) {
    if (!out || !cfg || !be || !ctx)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_model_create: NULL argument");
    *out = NULL;
    CM_TRY(check_cfg(cfg));
    CM_TRY(check_backend(be, cfg->kind == CM_DRAFTER_DFLASH2));
    cm_status st;
    dt_model *m = calloc(1, sizeof *m);
    if (!m)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the drafter");
    m->cfg = *cfg;
    m->be = be;
    m->ctx = ctx;
    /* BF16 storage only where the GEMMs would round these inputs anyway */
    m->adt = be->gemm_rounds_input && be->matmul && be->gemm_rounds_input(ctx) ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    const int v2 = cfg->kind == CM_DRAFTER_DFLASH2;
    m->n_lp = v2 ? LP_COUNT2 : LP_COUNT;
    m->ng = v2 ? cfg->hidden_size / cfg->conv_group_size : 0;
    m->p_norm = P_LAYER0 + cfg->n_layers * m->n_lp;
    m->p_sel = v2 ? m->p_norm + 1 : -1;
    m->n_params = m->p_norm + 1 + (v2 ? SP_COUNT : 0);
    m->sel = (dt_selector_opts)DT_SELECTOR_OPTS_DEFAULT;
    m->params = calloc((size_t)m->n_params, sizeof *m->params);
    m->names = calloc((size_t)m->n_params, sizeof *m->names);
    m->grad_unset = calloc((size_t)m->n_params, 1);
    if (!m->params || !m->names || !m->grad_unset) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d parameter descriptors", m->n_params);
        goto fail;
    }
    params_define(m);
    for (int i = 0; i < m->n_params; i++)
        m->n_slab += align_floats((size_t)m->params[i].numel);
    CM_TRY_GOTO(be->alloc(ctx, (void **)&m->data_base, m->n_slab * sizeof(float)), st, fail);
    CM_TRY_GOTO(be->alloc(ctx, (void **)&m->grad_base, m->n_slab * sizeof(float)), st, fail);
    size_t off = 0;
    for (int i = 0; i < m->n_params; i++) {
        m->params[i].data = m->data_base + off;
        m->params[i].grad = m->grad_base + off;
        off += align_floats((size_t)m->params[i].numel);
    }
    /* once: the alignment padding is never written after this, and dt_dp reduces the whole slab */
    CM_TRY_GOTO(dt_model_dev_zero(m, m->grad_base, (int64_t)m->n_slab), st, fail);
    CM_TRY_GOTO(dt_model_w16_plan(m), st, fail);
    *out = m;
    return CM_OK;
fail:
    dt_model_destroy(&m);
    return st;
}

void dt_model_acts_release(dt_model *m) {
    if (m->acts.base)
        m->be->free(m->ctx, m->acts.base);
    m->be->free(m->ctx, m->Fh);
    m->Fh = NULL;
    m->Fh_T = 0;
    free(m->acts.layer);
    dt_host *h = &m->host;
    void    *host[] = {h->blk_ids, h->blk_pos, h->ctx_pos, h->ctx_lo, h->sel_row, h->labels, h->argmax,
                       h->weight,  h->gscale,  h->ce,      h->inv,    h->pred,    h->lab_pos, h->choice,
                       h->sce,     h->sgs};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++)
        free(host[k]);
    memset(&m->acts, 0, sizeof m->acts);
    memset(&m->host, 0, sizeof m->host);
}

void dt_model_destroy(dt_model **mp) {
    if (!mp || !*mp)
        return;
    dt_model *m = *mp;
    dt_model_acts_release(m);
    if (m->be) {
        m->be->free(m->ctx, m->data_base);
        m->be->free(m->ctx, m->grad_base);
        if (!m->lm_head_shared)
            m->be->free(m->ctx, m->lm_head);
        m->be->free(m->ctx, m->embed);
    }
    free(m->params);
    free(m->names);
    free(m->grad_unset);
    dt_model_w16_release(m);
    free(m);
    *mp = NULL;
}

cm_status dt_model_set_act_dtype(dt_model *m, cm_dtype dt) {
    if (dt != CM_DTYPE_F32 && dt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "saved activations in %s are not supported (F32 or BF16)",
                       cm_dtype_name(dt));
    if (dt == CM_DTYPE_BF16 && !m->be->matmul)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "the %s backend has no matmul entry for BF16 saved activations",
                       m->be->name);
    if (dt != m->adt) {
        const int64_t T = m->acts.T_cap, R = m->acts.R_cap;
        dt_model_acts_release(m);
        m->adt = dt;
        if (T > 0 && R > 0)
            CM_TRY(dt_model_ensure_capacity(m, T, R));
    }
    return CM_OK;
}

cm_dtype dt_model_act_dtype(const dt_model *m) {
    return m->adt;
}

size_t dt_model_act_bytes(const dt_model *m) {
    return m->acts.bytes;
}

const cm_drafter_cfg *dt_model_cfg(const dt_model *m) {
    return &m->cfg;
}
int dt_model_n_params(const dt_model *m) {
    return m->n_params;
}

const dt_param *dt_model_param(const dt_model *m, int i) {
    return i >= 0 && i < m->n_params ? &m->params[i] : NULL;
}

void dt_model_grad_slab(const dt_model *m, float **grad, size_t *n) {
    *grad = m->grad_base;
    *n = m->n_slab;
}

void dt_model_set_grad_hook(dt_model *m, dt_grad_hook fn, void *user) {
    m->grad_hook = fn;
    m->grad_hook_user = user;
}

int dt_model_grad_buckets(const dt_model *m, size_t *off, int cap) {
    const int n = m->cfg.n_layers + 2;
    for (int b = 0; b < n && b < cap; b++) {
        const int i = b == 0                 ? m->p_norm
                      : b <= m->cfg.n_layers ? P_LAYER0 + (m->cfg.n_layers - b) * m->n_lp
                                             : 0;
        off[b] = (size_t)(m->params[i].grad - m->grad_base);
    }
    return n;
}

// ----------------------------------------------------------------------------
// the gradients of a step

/* Is parameter i's gradient made by dW matmuls only, every one through dt_model_mm_dw or a
 * caller of dt_model_grad_first (the attention and MLP projections, fc)? Those are all but the
 * norms' ~60 K of the Qwen3.6-27B drafter's 1.73 B; the step does not zero them (6.9 GB of
 * stores, ~2 ms on an H100) but lets the first product write them. The norms' weights (their
 * kernels add into dw, k_norm's twice) and DFlash2's convolutions and selector keep the zeroing. */
static int grad_by_matmul(const dt_model *m, int i) {
    if (i == P_FC)
        return 1;
    if (i < P_LAYER0 || i >= m->p_norm)
        return 0;
    return dt_lp_is_projection((i - P_LAYER0) % m->n_lp);
}

/* The start of a step's gradients: every other parameter's grad zeroed (runs of neighbours, with
 * their padding, in one call), the matmul-made ones marked unset. */
cm_status dt_model_grads_begin(dt_model *m) {
    dt_model_w16_begin(m); /* the copies live in matmul-made gradients: made again this step */
    for (int i = 0; i < m->n_params;) {
        if (grad_by_matmul(m, i)) {
            m->grad_unset[i++] = 1;
            continue;
        }
        int j = i + 1;
        while (j < m->n_params && !grad_by_matmul(m, j))
            j++;
        const float *end = j < m->n_params ? m->params[j].grad : m->grad_base + m->n_slab;
        CM_TRY(dt_model_dev_zero(m, m->params[i].grad, (int64_t)(end - m->params[i].grad)));
        i = j;
    }
    return CM_OK;
}

/* 1 (and marks it set) when p's grad is unset: the caller's product must write it, not add. */
int dt_model_grad_first(dt_model *m, const dt_param *p) {
    const ptrdiff_t i = p - m->params;
    const int       first = m->grad_unset[i];
    m->grad_unset[i] = 0;
    return first;
}

/* Zeroes the grads of parameters from..n_params-1 that no product wrote this step (a batch with
 * no selected row runs no backward), so that every gradient read afterwards is this step's. */
cm_status dt_model_grads_settle(dt_model *m, int from) {
    for (int i = from; i < m->n_params; i++)
        if (m->grad_unset[i]) {
            CM_TRY(dt_model_dev_zero(m, m->params[i].grad, m->params[i].numel));
            m->grad_unset[i] = 0;
        }
    return CM_OK;
}

/* Tells the hook that the gradients of parameter i and every later one are final. */
cm_status dt_model_grads_final_from(dt_model *m, int i) {
    CM_TRY(dt_model_grads_settle(m, i));
    if (!m->grad_hook)
        return CM_OK;
    return m->grad_hook(m->grad_hook_user, (size_t)(m->params[i].grad - m->grad_base), m->weight_sum);
}

const dt_param *dt_model_find_param(const dt_model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0)
            return &m->params[i];
    return NULL;
}
