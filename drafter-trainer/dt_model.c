/* drafter-trainer/dt_model.c — the DFlash drafter on the kernel backend table: parameters
 * (one allocation for the fp32 masters, one for their grads, carved per tensor in the
 * serving-key order), the borrowed frozen embedding and LM head, and one training step
 * (DESIGN §5): host-side block layout, labels and weights, then forward, loss and backward.
 *
 * Activations the backward needs are saved per layer in one backend allocation, planned
 * for the largest batch seen and reused; backward scratch is shared by the layers. Context
 * rows pass only through fc, hidden_norm and each layer's k/v projections, so their key and
 * value gradients from every layer sum into one dctx. One thread; every op is CM_TRY'd. */
#include "dt_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_rng.h"
#include "cm_safetensors.h"

#define DT_MAX_BLOCK 64   /* dt_step_stats holds 64 slots */
#define DT_ALIGN     64   /* bytes: every carved buffer starts on this boundary */

/* Per-layer parameters, in serving-key order after fc.weight and hidden_norm.weight. */
enum {
    LP_INPUT_LN = 0,
    LP_Q,
    LP_K,
    LP_V,
    LP_O,
    LP_Q_NORM,
    LP_K_NORM,
    LP_POST_LN,
    LP_GATE,
    LP_UP,
    LP_DOWN,
    LP_COUNT
};
#define P_FC          0
#define P_HIDDEN_NORM 1
#define P_LAYER0      2

/* What layer l saved in the forward for the backward. R = n_anchors · B block rows. */
typedef struct dt_layer_acts {
    float *x;                /* [R, D] residual stream into the layer */
    float *h;                /* [R, D] input_layernorm(x) */
    float *q_pre, *q;        /* [R, nq·hd] q_proj(h); after q_norm and rope */
    float *kc_pre, *kc, *vc; /* [T, nkv·hd] context: k_proj(ctx); after k_norm and rope; v_proj(ctx) */
    float *kb_pre, *kb, *vb; /* [R, nkv·hd] the same for the block rows, from h */
    float *attn, *lse;       /* [R, nq·hd], [R, nq] */
    float *x_mid;            /* [R, D] x + o_proj(attn) */
    float *h2;               /* [R, D] post_attention_layernorm(x_mid) */
    float *gate, *up;        /* [R, I] gate_proj(h2), up_proj(h2) */
} dt_layer_acts;

/* Backend buffers for one step, sized for T_cap context rows and R_cap block rows. */
typedef struct dt_acts {
    int64_t        T_cap, R_cap;
    void          *base;
    int32_t       *blk_ids, *blk_pos, *ctx_pos; /* [R], [R], [T] */
    int32_t       *anchors, *ctx_lo;            /* [n_anchors] */
    int32_t       *labels, *argmax;             /* [R] (first n_sel used) */
    int32_t       *iota;                        /* [T] 0, 1, ...: row ids for widening device taps */
    int32_t       *sel, *inv;                   /* [R] selected row → block row; block row → selected
                                                   row or n_sel (the zero row of dhsel) */
    float         *gscale, *ce;                 /* [R] */
    float         *F;                           /* [T, n·D] target features */
    float         *ctx_pre, *ctx;               /* [T, D] F·fcᵀ; hidden_norm of it */
    dt_layer_acts *layer;                       /* [L] (host array of pointers into base) */
    float         *x_out, *hf;                  /* [R, D] after the last layer; norm(x_out) */
    float         *hsel, *dhsel;                /* [R, D] rows with weight > 0, compacted; their grads
                                                   ([R + 1, D]: row n_sel is kept zero) */
    /* backward scratch shared by the layers */
    float *dx, *dtmp, *dh;           /* [R, D] */
    float *act, *dact, *dgate, *dup; /* [R, I] swiglu(gate, up) recomputed; its grad; the inputs' grads */
    float *dattn, *dq, *dq_pre;      /* [R, nq·hd] */
    float *dkb, *dvb, *dkb_pre;      /* [R, nkv·hd] */
    float *dkc, *dvc, *dkc_pre;      /* [T, nkv·hd] */
    float *dctx, *dctx_pre;          /* [T, D] */
} dt_acts;

/* Host-side layout of the current batch (grown with the plan). */
typedef struct dt_host {
    int32_t *blk_ids, *blk_pos, *ctx_pos, *ctx_lo; /* [R], [R], [T], [n_anchors] */
    int32_t *sel_row, *labels, *argmax;            /* [R]: selected row → block row, label, argmax */
    int32_t *iota;                                 /* [T] 0, 1, ... */
    int32_t *inv;                                  /* [R] block row → selected row, or n_sel */
    double  *weight;                               /* [R] w of each selected row */
    float   *gscale, *ce;                          /* [R] */
} dt_host;

struct dt_model {
    cm_drafter_cfg    cfg;
    const kn_backend *be;
    kn_ctx           *ctx;
    int               n_params;
    dt_param         *params;
    char (*names)[80];
    float  *data_base, *grad_base; /* backend; carved into params */
    size_t  n_slab;                /* floats in each slab (with alignment padding) */
    /* frozen target embedding and LM head, [V, D] */
    void    *embed, *lm_head;
    cm_dtype embed_dt, lm_head_dt;
    int      lm_head_shared; /* lm_head aliases embed */
    int64_t  V;
    dt_acts  acts;
    dt_host  host;
    /* the current batch */
    int64_t T, n_anchors, R, n_sel;
    double  weight_sum;
};

static size_t align_floats(size_t n) {
    const size_t a = DT_ALIGN / sizeof(float);
    return (n + a - 1) / a * a;
}

// ----------------------------------------------------------------------------
// parameters

static dt_param *lp(dt_model *m, int l, int j) {
    return &m->params[P_LAYER0 + l * LP_COUNT + j];
}

static void param_def(dt_model *m, int i, const char *name, int64_t rows, int64_t cols) {
    dt_param *p = &m->params[i];
    snprintf(m->names[i], sizeof m->names[i], "%s", name);
    p->name = m->names[i];
    p->n_dims = cols ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols;
    p->numel = rows * (cols ? cols : 1);
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
    for (int l = 0; l < c->n_layers; l++)
        for (int j = 0; j < LP_COUNT; j++) {
            char name[80];
            snprintf(name, sizeof name, "layers.%d.%s", l, suffix[j]);
            param_def(m, P_LAYER0 + l * LP_COUNT + j, name, shape[j][0], shape[j][1]);
        }
    param_def(m, m->n_params - 1, "norm.weight", D, 0);
}

static cm_status check_cfg(const cm_drafter_cfg *c) {
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

static cm_status check_backend(const kn_backend *be) {
    // clang-format off
#define DT_NEED(fn) {#fn, be->fn != NULL}
    const struct {
        const char *name;
        int         present;
    } need[] = {
        DT_NEED(alloc),    DT_NEED(free),       DT_NEED(upload),  DT_NEED(download),        DT_NEED(sync),
        DT_NEED(zero),
        DT_NEED(copy2d),   DT_NEED(add),        DT_NEED(swiglu),  DT_NEED(embed),           DT_NEED(gemm),
        DT_NEED(rmsnorm),  DT_NEED(rope),       DT_NEED(gemm_dx), DT_NEED(gemm_dw),         DT_NEED(rmsnorm_bwd),
        DT_NEED(rope_bwd), DT_NEED(swiglu_bwd), DT_NEED(lm_ce),   DT_NEED(dflash_attn_fwd), DT_NEED(dflash_attn_bwd),
    };
    // clang-format on
#undef DT_NEED
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (!need[i].present)
            return CM_FAIL(CM_ERR_UNSUPPORTED,
                           "the %s backend has no drafter kernels yet (no %s; use --device cpu)", be->name,
                           need[i].name);
    return CM_OK;
}

/* Clears n floats of backend memory. */
static cm_status dev_zero(dt_model *m, float *p, int64_t n) {
    return m->be->zero(m->ctx, p, (size_t)n * sizeof(float));
}

cm_status dt_model_create(dt_model **out, const cm_drafter_cfg *cfg, const kn_backend *be, kn_ctx *ctx) {
    if (!out || !cfg || !be || !ctx)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_model_create: NULL argument");
    *out = NULL;
    CM_TRY(check_cfg(cfg));
    CM_TRY(check_backend(be));
    cm_status st;
    dt_model *m = calloc(1, sizeof *m);
    if (!m)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the drafter");
    m->cfg = *cfg;
    m->be = be;
    m->ctx = ctx;
    m->n_params = P_LAYER0 + cfg->n_layers * LP_COUNT + 1;
    m->params = calloc((size_t)m->n_params, sizeof *m->params);
    m->names = calloc((size_t)m->n_params, sizeof *m->names);
    if (!m->params || !m->names) {
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
    *out = m;
    return CM_OK;
fail:
    dt_model_destroy(&m);
    return st;
}

static void acts_release(dt_model *m) {
    if (m->acts.base)
        m->be->free(m->ctx, m->acts.base);
    free(m->acts.layer);
    free(m->host.blk_ids);
    free(m->host.blk_pos);
    free(m->host.ctx_pos);
    free(m->host.ctx_lo);
    free(m->host.sel_row);
    free(m->host.labels);
    free(m->host.argmax);
    free(m->host.weight);
    free(m->host.gscale);
    free(m->host.ce);
    free(m->host.iota);
    free(m->host.inv);
    memset(&m->acts, 0, sizeof m->acts);
    memset(&m->host, 0, sizeof m->host);
}

void dt_model_destroy(dt_model **mp) {
    if (!mp || !*mp)
        return;
    dt_model *m = *mp;
    acts_release(m);
    if (m->be) {
        m->be->free(m->ctx, m->data_base);
        m->be->free(m->ctx, m->grad_base);
        if (!m->lm_head_shared)
            m->be->free(m->ctx, m->lm_head);
        m->be->free(m->ctx, m->embed);
    }
    free(m->params);
    free(m->names);
    free(m);
    *mp = NULL;
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

const dt_param *dt_model_find_param(const dt_model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0)
            return &m->params[i];
    return NULL;
}

// ----------------------------------------------------------------------------
// initialisation and loading

cm_status dt_model_init_random(dt_model *m, uint64_t seed) {
    int64_t widest = 0;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].numel > widest)
            widest = m->params[i].numel;
    float *host = malloc((size_t)widest * sizeof *host);
    if (!host)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld floats for the initialisation", (long long)widest);
    cm_rng rng; /* one stream over the parameters in serving-key order */
    cm_rng_seed(&rng, seed);
    cm_status st = CM_OK;
    for (int i = 0; i < m->n_params && st == CM_OK; i++) {
        const dt_param *p = &m->params[i];
        for (int64_t e = 0; e < p->numel; e++)
            host[e] = p->n_dims == 2 ? (float)(0.02 * cm_rng_normal(&rng)) : 1.0f;
        st = m->be->upload(m->ctx, p->data, host, (size_t)p->numel * sizeof(float));
    }
    free(host);
    return st;
}

/* The fields that decide the parameter shapes and the step's semantics must agree. */
static cm_status cfg_agrees(const cm_drafter_cfg *want, const cm_drafter_cfg *got, const char *dir) {
#define DT_SAME(field, label)                                                                                \
    if (want->field != got->field)                                                                           \
        return CM_FAIL(CM_ERR_INVALID_ARG, "'%s/config.json' has %s %g but the model was created with %g",   \
                       dir, label, (double)got->field, (double)want->field);
    DT_SAME(hidden_size, "hidden_size")
    DT_SAME(n_layers, "num_hidden_layers")
    DT_SAME(intermediate_size, "intermediate_size")
    DT_SAME(vocab_size, "vocab_size")
    DT_SAME(n_heads, "num_attention_heads")
    DT_SAME(n_kv_heads, "num_key_value_heads")
    DT_SAME(head_dim, "head_dim")
    DT_SAME(rms_norm_eps, "rms_norm_eps")
    DT_SAME(rope_theta, "rope_theta")
    DT_SAME(sliding_window, "sliding_window")
    DT_SAME(block_size, "block_size")
    DT_SAME(mask_token_id, "mask_token_id")
    DT_SAME(n_taps, "the number of target_layer_ids")
#undef DT_SAME
    for (int l = 0; l < want->n_layers; l++)
        if (want->layer_types[l] != got->layer_types[l])
            return CM_FAIL(CM_ERR_INVALID_ARG, "'%s/config.json': layer_types[%d] differs from the model's",
                           dir, l);
    for (int i = 0; i < want->n_taps; i++)
        if (want->target_layer_ids[i] != got->target_layer_ids[i])
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "'%s/config.json': target_layer_ids[%d] is %d, the model's is %d", dir, i,
                           got->target_layer_ids[i], want->target_layer_ids[i]);
    return CM_OK;
}

cm_status dt_model_load(dt_model *m, const char *dir) {
    cm_drafter_cfg file_cfg;
    CM_TRY(cm_drafter_cfg_load(&file_cfg, dir));
    CM_TRY(cfg_agrees(&m->cfg, &file_cfg, dir));
    cm_status st;
    cm_st    *sts = NULL;
    float    *host = NULL;
    CM_TRY_GOTO(cm_st_open_dir(&sts, dir), st, fail);
    int64_t widest = 0;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].numel > widest)
            widest = m->params[i].numel;
    host = malloc((size_t)widest * sizeof *host);
    if (!host) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld floats to load '%s'", (long long)widest, dir);
        goto fail;
    }
    for (int i = 0; i < m->n_params; i++) {
        const dt_param *p = &m->params[i];
        const char     *key = p->name; /* SGLang also accepts the keys with a "model." prefix */
        char            prefixed[96];
        if (!cm_st_find(sts, p->name)) {
            snprintf(prefixed, sizeof prefixed, "model.%s", p->name);
            if (cm_st_find(sts, prefixed))
                key = prefixed;
        }
        CM_TRY_GOTO(cm_st_read(sts, key, p->n_dims, p->shape, host, CM_DTYPE_F32), st, fail);
        CM_TRY_GOTO(m->be->upload(m->ctx, p->data, host, (size_t)p->numel * sizeof(float)), st, fail);
    }
    st = CM_OK;
fail:
    free(host);
    cm_st_destroy(&sts);
    return st;
}

cm_status dt_model_set_frozen(dt_model *m, const void *embed, cm_dtype embed_dt, const void *lm_head,
                              cm_dtype lm_head_dt, int64_t V, int64_t D) {
    if (!embed || !lm_head)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_model_set_frozen: embedding or LM head is NULL");
    if (D != m->cfg.hidden_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "the target embedding is %lld wide but the drafter's hidden_size is %d; a DFlash drafter "
            "must have its target's hidden size",
            (long long)D, m->cfg.hidden_size);
    if (V != m->cfg.vocab_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "the target embedding has %lld rows but the drafter's vocab_size is %d; set vocab_size to "
            "the target's",
            (long long)V, m->cfg.vocab_size);
    const cm_dtype dts[2] = {embed_dt, lm_head_dt};
    for (int i = 0; i < 2; i++)
        if (dts[i] != CM_DTYPE_F32 && dts[i] != CM_DTYPE_BF16)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "the frozen %s is %s; convert it to F32 or BF16",
                           i ? "LM head" : "embedding", cm_dtype_name(dts[i]));
    if (!m->lm_head_shared)
        m->be->free(m->ctx, m->lm_head);
    m->be->free(m->ctx, m->embed);
    m->embed = m->lm_head = NULL;
    m->lm_head_shared = 0;
    const size_t n = (size_t)V * (size_t)D;
    CM_TRY(m->be->alloc(m->ctx, &m->embed, n * cm_dtype_size(embed_dt)));
    CM_TRY(m->be->upload(m->ctx, m->embed, embed, n * cm_dtype_size(embed_dt)));
    m->embed_dt = embed_dt;
    if (lm_head == embed && lm_head_dt == embed_dt) {
        m->lm_head = m->embed;
        m->lm_head_shared = 1;
    } else {
        CM_TRY(m->be->alloc(m->ctx, &m->lm_head, n * cm_dtype_size(lm_head_dt)));
        CM_TRY(m->be->upload(m->ctx, m->lm_head, lm_head, n * cm_dtype_size(lm_head_dt)));
    }
    m->lm_head_dt = lm_head_dt;
    m->V = V;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// batch validation and layout

cm_status dt_batch_validate(const dt_model *m, const dt_batch *b) {
    if (!b)
        return CM_FAIL(CM_ERR_INVALID_ARG, "no batch given");
    if (b->T < 1 || b->T > INT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch has %lld tokens; expected 1 to %d", (long long)b->T,
                       INT32_MAX);
    if (b->n_seq < 1 || b->n_seq > b->T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch has %d sequences for %lld tokens; expected 1 to T",
                       b->n_seq, (long long)b->T);
    if (!b->cu_seqlens || !b->input_ids || !b->loss_mask)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch lacks cu_seqlens, input_ids or loss_mask");
    if (!b->target_hidden) {
        if (m->cfg.n_taps > DT_MAX_TAPS)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "%d taps in device memory; at most %d", m->cfg.n_taps, DT_MAX_TAPS);
        for (int k = 0; k < m->cfg.n_taps; k++)
            if (!b->dev_taps[k])
                return CM_FAIL(CM_ERR_INVALID_ARG, "the batch has no target_hidden and no device tap %d", k);
        if (b->dev_taps_dt != CM_DTYPE_BF16 && b->dev_taps_dt != CM_DTYPE_F32)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "device taps in %s; expected BF16 or F32",
                           cm_dtype_name(b->dev_taps_dt));
    }
    if (b->cu_seqlens[0] != 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens[0] is %d; it must be 0", b->cu_seqlens[0]);
    for (int s = 0; s < b->n_seq; s++)
        if (b->cu_seqlens[s + 1] <= b->cu_seqlens[s])
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "cu_seqlens must increase strictly (no empty sequence): cu_seqlens[%d] = %d follows %d",
                s + 1, b->cu_seqlens[s + 1], b->cu_seqlens[s]);
    if (b->cu_seqlens[b->n_seq] != b->T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens ends at %d but the batch has %lld tokens",
                       b->cu_seqlens[b->n_seq], (long long)b->T);
    const int V = m->cfg.vocab_size;
    for (int64_t t = 0; t < b->T; t++) {
        if (b->input_ids[t] < 0 || b->input_ids[t] >= V)
            return CM_FAIL(CM_ERR_INVALID_ARG, "input_ids[%lld] = %d is outside the vocabulary [0, %d)",
                           (long long)t, b->input_ids[t], V);
        if (b->loss_mask[t] != 0 && b->loss_mask[t] != 1)
            return CM_FAIL(CM_ERR_INVALID_ARG, "loss_mask[%lld] = %d; it must be 0 or 1", (long long)t,
                           b->loss_mask[t]);
    }
    if (b->n_anchors < 0 || b->n_anchors > INT32_MAX / m->cfg.block_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%lld anchors is out of range (0 to %d with block size %d)",
                       (long long)b->n_anchors, INT32_MAX / m->cfg.block_size, m->cfg.block_size);
    if (b->n_anchors > 0 && !b->anchors)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch lacks anchors");
    for (int64_t j = 0; j < b->n_anchors; j++) {
        if (b->anchors[j] < 0 || b->anchors[j] >= b->T)
            return CM_FAIL(CM_ERR_INVALID_ARG, "anchors[%lld] = %d is outside the batch's tokens [0, %lld)",
                           (long long)j, b->anchors[j], (long long)b->T);
        if (j > 0 && b->anchors[j] < b->anchors[j - 1])
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "anchors are not sorted: anchors[%lld] = %d follows %d; sort them "
                           "ascending",
                           (long long)j, b->anchors[j], b->anchors[j - 1]);
    }
    return CM_OK;
}

/* Carves buffers out of one allocation: a first pass with base NULL measures, a second
 * assigns. Every buffer starts on a DT_ALIGN boundary. */
typedef struct carver {
    char  *base;
    size_t off;
} carver;

static void *carve(carver *c, int64_t n, size_t esize) {
    size_t at = c->off;
    c->off += ((size_t)n * esize + DT_ALIGN - 1) / DT_ALIGN * DT_ALIGN;
    return c->base ? c->base + at : NULL;
}
#define CARVE_F(c, n) ((float *)carve((c), (n), sizeof(float)))
#define CARVE_I(c, n) ((int32_t *)carve((c), (n), sizeof(int32_t)))

static void acts_layout(dt_model *m, carver *c, int64_t T, int64_t R) {
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, I = g->intermediate_size, Q = (int64_t)g->n_heads * g->head_dim;
    const int64_t         KV = (int64_t)g->n_kv_heads * g->head_dim, NA = R / g->block_size;
    dt_acts              *a = &m->acts;
    a->blk_ids = CARVE_I(c, R);
    a->blk_pos = CARVE_I(c, R);
    a->ctx_pos = CARVE_I(c, T);
    a->anchors = CARVE_I(c, NA);
    a->ctx_lo = CARVE_I(c, NA);
    a->labels = CARVE_I(c, R);
    a->argmax = CARVE_I(c, R);
    a->iota = CARVE_I(c, T);
    a->sel = CARVE_I(c, R);
    a->inv = CARVE_I(c, R);
    a->gscale = CARVE_F(c, R);
    a->ce = CARVE_F(c, R);
    a->F = CARVE_F(c, T * g->n_taps * D);
    a->ctx_pre = CARVE_F(c, T * D);
    a->ctx = CARVE_F(c, T * D);
    for (int l = 0; l < g->n_layers; l++) {
        dt_layer_acts *A = &a->layer[l];
        A->x = CARVE_F(c, R * D);
        A->h = CARVE_F(c, R * D);
        A->q_pre = CARVE_F(c, R * Q);
        A->q = CARVE_F(c, R * Q);
        A->kc_pre = CARVE_F(c, T * KV);
        A->kc = CARVE_F(c, T * KV);
        A->vc = CARVE_F(c, T * KV);
        A->kb_pre = CARVE_F(c, R * KV);
        A->kb = CARVE_F(c, R * KV);
        A->vb = CARVE_F(c, R * KV);
        A->attn = CARVE_F(c, R * Q);
        A->lse = CARVE_F(c, R * g->n_heads);
        A->x_mid = CARVE_F(c, R * D);
        A->h2 = CARVE_F(c, R * D);
        A->gate = CARVE_F(c, R * I);
        A->up = CARVE_F(c, R * I);
    }
    a->x_out = CARVE_F(c, R * D);
    a->hf = CARVE_F(c, R * D);
    a->hsel = CARVE_F(c, R * D);
    a->dhsel = CARVE_F(c, (R + 1) * D);
    a->dx = CARVE_F(c, R * D);
    a->dtmp = CARVE_F(c, R * D);
    a->dh = CARVE_F(c, R * D);
    a->act = CARVE_F(c, R * I);
    a->dact = CARVE_F(c, R * I);
    a->dgate = CARVE_F(c, R * I);
    a->dup = CARVE_F(c, R * I);
    a->dattn = CARVE_F(c, R * Q);
    a->dq = CARVE_F(c, R * Q);
    a->dq_pre = CARVE_F(c, R * Q);
    a->dkb = CARVE_F(c, R * KV);
    a->dvb = CARVE_F(c, R * KV);
    a->dkb_pre = CARVE_F(c, R * KV);
    a->dkc = CARVE_F(c, T * KV);
    a->dvc = CARVE_F(c, T * KV);
    a->dkc_pre = CARVE_F(c, T * KV);
    a->dctx = CARVE_F(c, T * D);
    a->dctx_pre = CARVE_F(c, T * D);
}

/* Grows the activation and host buffers to hold T context rows and R block rows. */
static cm_status ensure_capacity(dt_model *m, int64_t T, int64_t R) {
    if (m->acts.base && T <= m->acts.T_cap && R <= m->acts.R_cap)
        return CM_OK;
    if (T < m->acts.T_cap)
        T = m->acts.T_cap;
    if (R < m->acts.R_cap)
        R = m->acts.R_cap;
    acts_release(m);
    dt_acts *a = &m->acts;
    dt_host *h = &m->host;
    a->layer = calloc((size_t)m->cfg.n_layers, sizeof *a->layer);
    h->blk_ids = malloc((size_t)R * sizeof *h->blk_ids);
    h->blk_pos = malloc((size_t)R * sizeof *h->blk_pos);
    h->ctx_pos = malloc((size_t)T * sizeof *h->ctx_pos);
    h->ctx_lo = malloc((size_t)(R / m->cfg.block_size + 1) * sizeof *h->ctx_lo);
    h->sel_row = malloc((size_t)R * sizeof *h->sel_row);
    h->labels = malloc((size_t)R * sizeof *h->labels);
    h->argmax = malloc((size_t)R * sizeof *h->argmax);
    h->weight = malloc((size_t)R * sizeof *h->weight);
    h->gscale = malloc((size_t)R * sizeof *h->gscale);
    h->ce = malloc((size_t)R * sizeof *h->ce);
    h->iota = malloc((size_t)T * sizeof *h->iota);
    h->inv = malloc((size_t)R * sizeof *h->inv);
    if (!a->layer || !h->blk_ids || !h->blk_pos || !h->ctx_pos || !h->ctx_lo || !h->sel_row || !h->labels ||
        !h->argmax || !h->weight || !h->gscale || !h->ce || !h->iota || !h->inv) {
        acts_release(m);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate host buffers for %lld tokens and %lld block rows",
                       (long long)T, (long long)R);
    }
    carver c = {NULL, 0};
    acts_layout(m, &c, T, R);
    cm_status st = m->be->alloc(m->ctx, &a->base, c.off);
    if (st != CM_OK) {
        acts_release(m);
        return st;
    }
    c = (carver){a->base, 0};
    acts_layout(m, &c, T, R);
    a->T_cap = T;
    a->R_cap = R;
    for (int64_t t = 0; t < T; t++)
        h->iota[t] = (int32_t)t;
    return m->be->upload(m->ctx, a->iota, h->iota, (size_t)T * sizeof(int32_t));
}

cm_status dt_model_reserve(dt_model *m, int64_t T, int64_t n_anchors) {
    if (T < 1 || n_anchors < 1 || n_anchors > INT32_MAX / m->cfg.block_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_model_reserve: %lld tokens and %lld anchors are out of range",
                       (long long)T, (long long)n_anchors);
    return ensure_capacity(m, T, n_anchors * m->cfg.block_size);
}

/* Host side of DESIGN §5: block tokens and positions, context positions restarting at
 * every document, and for every slot k ≥ 1 inside the anchor's document with loss_mask 1
 * the label ids[a + k] and weight exp(−(k − 1)/γ). Selected rows are listed in order. */
static void layout_batch(dt_model *m, const dt_batch *b, float gamma) {
    const int B = m->cfg.block_size;
    dt_host  *h = &m->host;
    for (int s = 0; s < b->n_seq; s++)
        for (int32_t p = b->cu_seqlens[s]; p < b->cu_seqlens[s + 1]; p++)
            h->ctx_pos[p] = p - b->cu_seqlens[s];
    int    s = 0;
    double wsum = 0;
    m->n_sel = 0;
    for (int64_t j = 0; j < b->n_anchors; j++) {
        const int32_t a = b->anchors[j];
        while (b->cu_seqlens[s + 1] <= a)
            s++; /* anchors are sorted */
        const int32_t lo = b->cu_seqlens[s], hi = b->cu_seqlens[s + 1];
        h->ctx_lo[j] = lo;
        for (int k = 0; k < B; k++) {
            const int64_t r = j * B + k;
            h->blk_ids[r] = k == 0 ? b->input_ids[a] : m->cfg.mask_token_id;
            h->blk_pos[r] = a - lo + k;
            if (k >= 1 && (int64_t)a + k < hi && b->loss_mask[a + k]) {
                const double w = exp(-(double)(k - 1) / (double)gamma);
                h->sel_row[m->n_sel] = (int32_t)r;
                h->labels[m->n_sel] = b->input_ids[a + k];
                h->weight[m->n_sel] = w;
                wsum += w;
                m->n_sel++;
            }
        }
    }
    for (int64_t i = 0; i < m->n_sel; i++)
        h->gscale[i] = (float)(h->weight[i] / wsum);
    for (int64_t r = 0; r < m->R; r++)
        h->inv[r] = (int32_t)m->n_sel;
    for (int64_t i = 0; i < m->n_sel; i++)
        h->inv[h->sel_row[i]] = (int32_t)i;
    m->weight_sum = wsum;
}

static cm_status upload_batch(dt_model *m, const dt_batch *b) {
    const kn_backend *be = m->be;
    dt_acts          *a = &m->acts;
    const int64_t     NA = m->n_anchors, R = m->R, T = m->T;
    const int64_t     D = m->cfg.hidden_size, nD = (int64_t)m->cfg.n_taps * D;
    if (b->target_hidden)
        CM_TRY(be->upload(m->ctx, a->F, b->target_hidden, (size_t)T * (size_t)nD * sizeof(float)));
    else /* taps in device memory: widened row by row into their columns of F (ctx_pre is free
          * until the fc GEMM writes it) */
        for (int k = 0; k < m->cfg.n_taps; k++) {
            const float *src = b->dev_taps[k];
            if (b->dev_taps_dt == CM_DTYPE_BF16) {
                CM_TRY(be->embed(m->ctx, a->ctx_pre, a->iota, b->dev_taps[k], CM_DTYPE_BF16, T, D));
                src = a->ctx_pre;
            }
            CM_TRY(be->copy2d(m->ctx, a->F + k * D, nD, src, D, T, D));
        }
    CM_TRY(be->upload(m->ctx, a->blk_ids, m->host.blk_ids, (size_t)R * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->blk_pos, m->host.blk_pos, (size_t)R * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->ctx_pos, m->host.ctx_pos, (size_t)T * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->anchors, b->anchors, (size_t)NA * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->ctx_lo, m->host.ctx_lo, (size_t)NA * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->labels, m->host.labels, (size_t)m->n_sel * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->gscale, m->host.gscale, (size_t)m->n_sel * sizeof(float)));
    CM_TRY(be->upload(m->ctx, a->sel, m->host.sel_row, (size_t)m->n_sel * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->inv, m->host.inv, (size_t)R * sizeof(int32_t)));
    return CM_OK;
}

// ----------------------------------------------------------------------------
// forward

static kn_dflash_attn_params attn_params(const dt_model *m, int l) {
    const cm_drafter_cfg *g = &m->cfg;
    const dt_layer_acts  *A = &m->acts.layer[l];
    kn_dflash_attn_params p = {0};
    p.T = m->T;
    p.n_blocks = m->n_anchors;
    p.B = g->block_size;
    p.nq = g->n_heads;
    p.nkv = g->n_kv_heads;
    p.hd = g->head_dim;
    p.window = g->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION ? g->sliding_window : 0;
    p.scale = (float)(1.0 / sqrt((double)g->head_dim));
    p.anchors = m->acts.anchors;
    p.ctx_lo = m->acts.ctx_lo;
    p.q = A->q;
    p.k_ctx = A->kc;
    p.v_ctx = A->vc;
    p.k_blk = A->kb;
    p.v_blk = A->vb;
    p.out = A->attn;
    p.lse = A->lse;
    return p;
}

/* Keys and values of `rows` rows of inp [rows, D] at positions pos, through layer l's
 * k_proj (then k_norm per head and RoPE) and v_proj. */
static cm_status kv_fwd(dt_model *m, int l, const float *inp, int64_t rows, const int32_t *pos, float *k_pre,
                        float *k, float *v) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, KV = (int64_t)g->n_kv_heads * g->head_dim;
    CM_TRY(be->gemm(m->ctx, k_pre, inp, lp(m, l, LP_K)->data, CM_DTYPE_F32, rows, KV, D));
    CM_TRY(be->rmsnorm(m->ctx, k, k_pre, lp(m, l, LP_K_NORM)->data, rows * g->n_kv_heads, g->head_dim,
                       g->rms_norm_eps, 0));
    CM_TRY(be->rope(m->ctx, k, pos, rows, g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(be->gemm(m->ctx, v, inp, lp(m, l, LP_V)->data, CM_DTYPE_F32, rows, KV, D));
    return CM_OK;
}

/* x_mid = x + o_proj(attention(q from the block rows; k, v from [ctx ; block rows])). */
static cm_status attn_fwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    dt_layer_acts        *A = &a->layer[l];
    const int64_t         D = g->hidden_size, Q = (int64_t)g->n_heads * g->head_dim, R = m->R;
    CM_TRY(be->rmsnorm(m->ctx, A->h, A->x, lp(m, l, LP_INPUT_LN)->data, R, D, g->rms_norm_eps, 0));
    CM_TRY(be->gemm(m->ctx, A->q_pre, A->h, lp(m, l, LP_Q)->data, CM_DTYPE_F32, R, Q, D));
    CM_TRY(be->rmsnorm(m->ctx, A->q, A->q_pre, lp(m, l, LP_Q_NORM)->data, R * g->n_heads, g->head_dim,
                       g->rms_norm_eps, 0));
    CM_TRY(be->rope(m->ctx, A->q, a->blk_pos, R, g->n_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(kv_fwd(m, l, a->ctx, m->T, a->ctx_pos, A->kc_pre, A->kc, A->vc));
    CM_TRY(kv_fwd(m, l, A->h, R, a->blk_pos, A->kb_pre, A->kb, A->vb));
    kn_dflash_attn_params p = attn_params(m, l);
    CM_TRY(be->dflash_attn_fwd(m->ctx, &p));
    CM_TRY(be->gemm(m->ctx, A->x_mid, A->attn, lp(m, l, LP_O)->data, CM_DTYPE_F32, R, D, Q));
    CM_TRY(be->add(m->ctx, A->x_mid, A->x, R * D));
    return CM_OK;
}

/* x_next = x_mid + down(silu(gate(h2)) · up(h2)), h2 = post_attention_layernorm(x_mid). */
static cm_status mlp_fwd(dt_model *m, int l, float *x_next) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_layer_acts        *A = &m->acts.layer[l];
    const int64_t         D = g->hidden_size, I = g->intermediate_size, R = m->R;
    CM_TRY(be->rmsnorm(m->ctx, A->h2, A->x_mid, lp(m, l, LP_POST_LN)->data, R, D, g->rms_norm_eps, 0));
    CM_TRY(be->gemm(m->ctx, A->gate, A->h2, lp(m, l, LP_GATE)->data, CM_DTYPE_F32, R, I, D));
    CM_TRY(be->gemm(m->ctx, A->up, A->h2, lp(m, l, LP_UP)->data, CM_DTYPE_F32, R, I, D));
    CM_TRY(be->swiglu(m->ctx, m->acts.act, A->gate, A->up, R * I));
    CM_TRY(be->gemm(m->ctx, x_next, m->acts.act, lp(m, l, LP_DOWN)->data, CM_DTYPE_F32, R, D, I));
    CM_TRY(be->add(m->ctx, x_next, A->x_mid, R * D));
    return CM_OK;
}

static cm_status forward(dt_model *m) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const int64_t         D = g->hidden_size, nD = (int64_t)g->n_taps * D;
    /* ctx = hidden_norm(F · fcᵀ), shared by every layer */
    CM_TRY(be->gemm(m->ctx, a->ctx_pre, a->F, m->params[P_FC].data, CM_DTYPE_F32, m->T, D, nD));
    CM_TRY(
        be->rmsnorm(m->ctx, a->ctx, a->ctx_pre, m->params[P_HIDDEN_NORM].data, m->T, D, g->rms_norm_eps, 0));
    CM_TRY(be->embed(m->ctx, a->layer[0].x, a->blk_ids, m->embed, m->embed_dt, m->R, D));
    for (int l = 0; l < g->n_layers; l++) {
        CM_TRY(attn_fwd(m, l));
        CM_TRY(mlp_fwd(m, l, l + 1 < g->n_layers ? a->layer[l + 1].x : a->x_out));
    }
    CM_TRY(
        be->rmsnorm(m->ctx, a->hf, a->x_out, m->params[m->n_params - 1].data, m->R, D, g->rms_norm_eps, 0));
    return CM_OK;
}

// ----------------------------------------------------------------------------
// loss and backward

/* The LM head and cross-entropy on the selected rows only (compacted), then the gradient
 * through the final norm into acts.dx (rows without a label get zero gradient). */
static cm_status loss_fwd_bwd(dt_model *m) {
    const kn_backend *be = m->be;
    dt_acts          *a = &m->acts;
    const int64_t     D = m->cfg.hidden_size, n = m->n_sel;
    /* gathers as row lookups (the embed op on an F32 table): two launches instead of one
     * copy per run of selected rows (~1000 at 512 anchors) */
    CM_TRY(be->embed(m->ctx, a->hsel, a->sel, a->hf, CM_DTYPE_F32, n, D));
    CM_TRY(be->lm_ce(m->ctx, a->dhsel, a->ce, a->argmax, a->hsel, a->labels, a->gscale, m->lm_head,
                     m->lm_head_dt, n, m->V, D));
    CM_TRY(be->download(m->ctx, m->host.ce, a->ce, (size_t)n * sizeof(float)));
    CM_TRY(be->download(m->ctx, m->host.argmax, a->argmax, (size_t)n * sizeof(int32_t)));
    CM_TRY(dev_zero(m, a->dhsel + n * D, D)); /* the row unselected block rows read */
    CM_TRY(be->embed(m->ctx, a->dtmp, a->inv, a->dhsel, CM_DTYPE_F32, m->R, D));
    dt_param *norm = &m->params[m->n_params - 1];
    CM_TRY(be->rmsnorm_bwd(m->ctx, a->dx, norm->grad, a->dtmp, a->x_out, norm->data, m->R, D,
                           m->cfg.rms_norm_eps, 0));
    return CM_OK;
}

/* acts.dx holds ∂/∂x_next on entry and ∂/∂x_mid on return. */
static cm_status mlp_bwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const dt_layer_acts  *A = &a->layer[l];
    const int64_t         D = g->hidden_size, I = g->intermediate_size, R = m->R;
    dt_param             *gate = lp(m, l, LP_GATE), *up = lp(m, l, LP_UP), *down = lp(m, l, LP_DOWN),
             *ln = lp(m, l, LP_POST_LN);
    CM_TRY(be->swiglu(m->ctx, a->act, A->gate, A->up, R * I)); /* recomputed rather than saved */
    CM_TRY(be->gemm_dw(m->ctx, down->grad, a->dx, a->act, R, D, I));
    CM_TRY(be->gemm_dx(m->ctx, a->dact, a->dx, down->data, CM_DTYPE_F32, R, D, I, 0));
    CM_TRY(be->swiglu_bwd(m->ctx, a->dgate, a->dup, a->dact, A->gate, A->up, R * I));
    CM_TRY(be->gemm_dw(m->ctx, gate->grad, a->dgate, A->h2, R, I, D));
    CM_TRY(be->gemm_dw(m->ctx, up->grad, a->dup, A->h2, R, I, D));
    CM_TRY(be->gemm_dx(m->ctx, a->dh, a->dgate, gate->data, CM_DTYPE_F32, R, I, D, 0));
    CM_TRY(be->gemm_dx(m->ctx, a->dh, a->dup, up->data, CM_DTYPE_F32, R, I, D, 1));
    CM_TRY(be->rmsnorm_bwd(m->ctx, a->dtmp, ln->grad, a->dh, A->x_mid, ln->data, R, D, g->rms_norm_eps, 0));
    CM_TRY(be->add(m->ctx, a->dx, a->dtmp, R * D));
    return CM_OK;
}

/* Backward of kv_fwd: dk (after RoPE and k_norm) and dv into the k/v weight grads, and
 * the input gradient into dinp (= or += as accumulate says). dk is rotated in place. */
static cm_status kv_bwd(dt_model *m, int l, const float *inp, int64_t rows, const int32_t *pos,
                        const float *k_pre, float *dk, const float *dv, float *dk_pre, float *dinp,
                        int accumulate) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, KV = (int64_t)g->n_kv_heads * g->head_dim;
    dt_param             *wk = lp(m, l, LP_K), *wv = lp(m, l, LP_V), *kn = lp(m, l, LP_K_NORM);
    CM_TRY(
        be->rope_bwd(m->ctx, dk, pos, rows, g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(be->rmsnorm_bwd(m->ctx, dk_pre, kn->grad, dk, k_pre, kn->data, rows * g->n_kv_heads, g->head_dim,
                           g->rms_norm_eps, 0));
    CM_TRY(be->gemm_dw(m->ctx, wk->grad, dk_pre, inp, rows, KV, D));
    CM_TRY(be->gemm_dw(m->ctx, wv->grad, dv, inp, rows, KV, D));
    CM_TRY(be->gemm_dx(m->ctx, dinp, dk_pre, wk->data, CM_DTYPE_F32, rows, KV, D, accumulate));
    CM_TRY(be->gemm_dx(m->ctx, dinp, dv, wv->data, CM_DTYPE_F32, rows, KV, D, 1));
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
    const int64_t         D = g->hidden_size, Q = (int64_t)g->n_heads * g->head_dim, R = m->R;
    dt_param             *wq = lp(m, l, LP_Q), *wo = lp(m, l, LP_O), *qn = lp(m, l, LP_Q_NORM),
             *ln = lp(m, l, LP_INPUT_LN);
    CM_TRY(be->gemm_dw(m->ctx, wo->grad, a->dx, A->attn, R, D, Q));
    CM_TRY(be->gemm_dx(m->ctx, a->dattn, a->dx, wo->data, CM_DTYPE_F32, R, D, Q, 0));
    kn_dflash_attn_params p = attn_params(m, l);
    p.dout = a->dattn;
    p.dq = a->dq;
    p.dk_ctx = a->dkc;
    p.dv_ctx = a->dvc;
    p.dk_blk = a->dkb;
    p.dv_blk = a->dvb;
    CM_TRY(be->dflash_attn_bwd(m->ctx, &p));
    /* queries */
    CM_TRY(be->rope_bwd(m->ctx, a->dq, a->blk_pos, R, g->n_heads, g->head_dim, g->head_dim,
                        (float)g->rope_theta));
    CM_TRY(be->rmsnorm_bwd(m->ctx, a->dq_pre, qn->grad, a->dq, A->q_pre, qn->data, R * g->n_heads,
                           g->head_dim, g->rms_norm_eps, 0));
    CM_TRY(be->gemm_dw(m->ctx, wq->grad, a->dq_pre, A->h, R, Q, D));
    CM_TRY(be->gemm_dx(m->ctx, a->dh, a->dq_pre, wq->data, CM_DTYPE_F32, R, Q, D, 0));
    /* block keys and values feed dh; context keys and values feed dctx */
    CM_TRY(kv_bwd(m, l, A->h, R, a->blk_pos, A->kb_pre, a->dkb, a->dvb, a->dkb_pre, a->dh, 1));
    CM_TRY(kv_bwd(m, l, a->ctx, m->T, a->ctx_pos, A->kc_pre, a->dkc, a->dvc, a->dkc_pre, a->dctx,
                  l != g->n_layers - 1));
    CM_TRY(be->rmsnorm_bwd(m->ctx, a->dtmp, ln->grad, a->dh, A->x, ln->data, R, D, g->rms_norm_eps, 0));
    CM_TRY(be->add(m->ctx, a->dx, a->dtmp, R * D));
    return CM_OK;
}

static cm_status backward(dt_model *m) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const int64_t         D = g->hidden_size, nD = (int64_t)g->n_taps * D;
    CM_TRY(loss_fwd_bwd(m));
    for (int l = g->n_layers - 1; l >= 0; l--) {
        CM_TRY(mlp_bwd(m, l));
        CM_TRY(attn_bwd(m, l));
    }
    /* acts.dx now holds the gradient of the (frozen) embedding output: dropped. */
    dt_param *hn = &m->params[P_HIDDEN_NORM], *fc = &m->params[P_FC];
    CM_TRY(be->rmsnorm_bwd(m->ctx, a->dctx_pre, hn->grad, a->dctx, a->ctx_pre, hn->data, m->T, D,
                           g->rms_norm_eps, 0));
    CM_TRY(be->gemm_dw(m->ctx, fc->grad, a->dctx_pre, a->F, m->T, D, nD));
    return CM_OK;
}

// ----------------------------------------------------------------------------
// step

static void fill_stats(const dt_model *m, dt_step_stats *s) {
    const dt_host *h = &m->host;
    const int      B = m->cfg.block_size;
    memset(s, 0, sizeof *s);
    s->weight_sum = m->weight_sum;
    s->n_blocks = m->n_anchors;
    double num = 0;
    for (int64_t i = 0; i < m->n_sel; i++) {
        const int k = h->sel_row[i] % B, hit = h->argmax[i] == h->labels[i];
        num += h->weight[i] * (double)h->ce[i];
        s->acc_count[k]++;
        s->acc_hits[k] += hit;
    }
    s->loss = m->n_sel > 0 ? num / m->weight_sum : 0.0;
    /* τ: 1 + the leading run of slots 1, 2, ... that have a label and predict it */
    double  tau_sum = 0;
    int64_t i = 0;
    for (int64_t j = 0; j < m->n_anchors; j++) {
        int run = 0, alive = 1;
        for (int k = 1; k < B; k++) {
            const int64_t r = j * B + k;
            while (i < m->n_sel && h->sel_row[i] < r)
                i++;
            alive = alive && i < m->n_sel && h->sel_row[i] == r && h->argmax[i] == h->labels[i];
            run += alive;
        }
        tau_sum += 1 + run;
    }
    s->tau = m->n_anchors > 0 ? tau_sum / (double)m->n_anchors : 0.0;
}

cm_status dt_model_step(dt_model *m, const dt_batch *b, float gamma, dt_step_stats *stats) {
    if (!(gamma > 0) || !isfinite(gamma))
        return CM_FAIL(CM_ERR_INVALID_ARG, "loss decay gamma %g must be positive and finite", (double)gamma);
    if (!m->embed || !m->lm_head)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the drafter has no frozen embedding and LM head (dt_model_set_frozen)");
    CM_TRY(dt_batch_validate(m, b));
    CM_TRY(dev_zero(m, m->grad_base, (int64_t)m->n_slab));
    m->T = b->T;
    m->n_anchors = b->n_anchors;
    m->R = b->n_anchors * m->cfg.block_size;
    m->n_sel = 0;
    m->weight_sum = 0;
    if (m->R > 0) {
        CM_TRY(ensure_capacity(m, m->T, m->R));
        layout_batch(m, b, gamma);
    }
    if (m->n_sel > 0) {
        CM_TRY(upload_batch(m, b));
        CM_TRY(forward(m));
        CM_TRY(backward(m));
        CM_TRY(m->be->sync(m->ctx));
    }
    if (stats)
        fill_stats(m, stats);
    return CM_OK;
}
