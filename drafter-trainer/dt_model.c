/* drafter-trainer/dt_model.c — the DFlash drafter on the kernel backend table: parameters
 * (one allocation for the fp32 masters, one for their grads, carved per tensor in the
 * serving-key order), the borrowed frozen embedding and LM head, and one training step
 * (docs/drafter.md): host-side block layout, labels and weights, then forward, loss and backward.
 *
 * Activations the backward needs are saved per layer in one backend allocation, planned
 * for the largest batch seen and reused. They are stored in the activation dtype: F32, or
 * BF16 when the backend's gemm rounds its inputs to bf16 anyway (cuda --precision bf16), so
 * a saved GEMM input costs half and feeds the GEMM without a conversion pass. Everything the
 * forward saves in BF16 it also goes on with as rounded (the residual stream at each save,
 * q/k before their norms, v), so the backward's recomputations see the forward's exact
 * values. Only what needs a GEMM to rebuild is saved: the norms' outputs (input and
 * post-attention layernorm, q/k norm and RoPE) are recomputed in the backward from their
 * saved inputs, the SwiGLU product too, and the MLP backward writes dgate/dup over the saved
 * gate/up. Each layer's gate/up span is also the attention scratch of that layer (the
 * forward's attention runs before the MLP writes it, the backward's after the MLP backward
 * has consumed it); what does not fit there, and the other phases' temporaries, share one
 * work region. Context rows pass only through fc, hidden_norm and each layer's k/v
 * projections, so their key and value gradients from every layer sum into one dctx. One
 * thread; every op is CM_TRY'd. */
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

/* What layer l saved in the forward for the backward, in the activation dtype (adt).
 * R = n_anchors · B block rows. */
typedef struct dt_layer_acts {
    void  *x;              /* [R, D] residual stream into the layer */
    void  *q_pre;          /* [R, nq·hd] q_proj(input_layernorm(x)) */
    void  *kc_pre, *vc;    /* [T, nkv·hd] context: k_proj(ctx), v_proj(ctx) */
    void  *kb_pre, *vb;    /* [R, nkv·hd] the same for the block rows */
    void  *attn;           /* [R, nq·hd] attention output */
    float *lse;            /* [R, nq] */
    void  *x_mid;          /* [R, D] x + o_proj(attn) */
    void  *gate, *up;      /* [R, I] gate_proj(h2), up_proj(h2), one span (up follows gate);
                              the backward overwrites them with their gradients */
} dt_layer_acts;

/* The F32 temporaries of the attention of one layer (forward: q, k, v after their norms and
 * RoPE and the output; backward: those again, the output gradient and the five input
 * gradients, later the pre-norm q/k and their gradients), placed first-fit in the layer's
 * gate/up span, the rest in the work region. */
enum {
    AS_Q = 0, /* [R, Q] q; then q_pre (backward) */
    AS_O,     /* [R, Q] attention output; then dq_pre */
    AS_DO,    /* [R, Q] dattn */
    AS_DQ,    /* [R, Q] */
    AS_KC,    /* [T, KV] k of the context rows; then kc_pre */
    AS_VC,    /* [T, KV] v; then dkc_pre */
    AS_KB,    /* [R, KV] k of the block rows; then kb_pre */
    AS_VB,    /* [R, KV] v; then dkb_pre */
    AS_DKC,
    AS_DVC,   /* [T, KV] */
    AS_DKB,
    AS_DVB,   /* [R, KV] */
    AS_COUNT
};
/* The fc/hidden_norm temporaries (forward start, backward end), in layer 0's span or the
 * work region: ctx_pre and ctx in F32; then ctx_pre again and dctx_pre. */
enum { FS_PRE = 0, FS_OUT, FS_COUNT };

typedef struct dt_slot {
    int    in_span; /* 1: offset into a layer's gate/up span; 0: into the work region */
    size_t off;     /* bytes */
} dt_slot;

/* Backend buffers for one step, sized for T_cap context rows and R_cap block rows. */
typedef struct dt_acts {
    int64_t        T_cap, R_cap;
    void          *base;
    size_t         bytes;                       /* of base */
    int32_t       *blk_ids, *blk_pos, *ctx_pos; /* [R], [R], [T] */
    int32_t       *anchors, *ctx_lo;            /* [n_anchors] */
    int32_t       *labels, *argmax;             /* [R] (first n_sel used) */
    int32_t       *sel, *inv;                   /* [R] selected row → block row; block row → selected
                                                   row or n_sel (the zero row of dhsel) */
    float         *gscale, *ce;                 /* [R] */
    float         *F;                           /* [T, n·D] F32: target features (adt F32 only; BF16
                                                   reads the taps where they are, see dt_model.tap) */
    void          *ctx_pre, *ctx;               /* [T, D] adt: F·fcᵀ; hidden_norm of it */
    dt_layer_acts *layer;                       /* [L] (host array of pointers into base) */
    /* F32 [R, D] buffers of both passes: xw the residual stream (forward; x_out at the end),
     * then the widened saved x / x_mid (backward with BF16 storage) or the recomputed normed
     * rows (F32 storage); dx its gradient (the forward's normed rows and the selected rows of
     * the loss before that); dh the gradient of a norm's output (the forward's o_proj/down
     * outputs, the final norm's output, the backward's normed rows before their BF16 copy) */
    float         *xw, *dx, *dh;
    void          *H;                           /* [R, D] BF16: normed rows as GEMM input (adt BF16 only) */
    float         *dctx;                        /* [T, D] */
    void          *work;                        /* the work region (see dt_slot) */
    size_t         span_bytes, work_bytes;
    dt_slot        as[AS_COUNT], fs[FS_COUNT];
} dt_acts;

/* Host-side layout of the current batch (grown with the plan). */
typedef struct dt_host {
    int32_t *blk_ids, *blk_pos, *ctx_pos, *ctx_lo; /* [R], [R], [T], [n_anchors] */
    int32_t *sel_row, *labels, *argmax;            /* [R]: selected row → block row, label, argmax */
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
    dt_grad_hook grad_hook;        /* dt_model_set_grad_hook, or NULL */
    void        *grad_hook_user;
    size_t  n_slab;                /* floats in each slab (with alignment padding) */
    /* frozen target embedding and LM head, [V, D] */
    void    *embed, *lm_head;
    cm_dtype embed_dt, lm_head_dt;
    int      lm_head_shared; /* lm_head aliases embed */
    int64_t  V;
    cm_dtype adt; /* saved activations: F32, or BF16 when gemm rounds its inputs (see the top) */
    /* With BF16 storage fc multiplies tap by tap (F · fcᵀ = Σ_k tap_k · fc[:, kD:(k+1)D]ᵀ) from
     * where the taps are: the batch's device taps, or Fh, the host features rounded to BF16 on
     * upload, tap by tap like device taps ([n_taps][T_cap, D], each tap 256-byte aligned; a
     * separate allocation made by the first host-fed step). Both paths run the same GEMMs with
     * the same layout on the same values, so they give the same bits. */
    const void *tap[DT_MAX_TAPS];
    cm_dtype    tap_dt;
    int64_t     tap_ld;
    void       *Fh;
    int64_t     Fh_T;
    dt_acts  acts;
    dt_host  host;
    /* the current batch */
    int64_t T, n_anchors, R, n_sel;
    double  weight_sum;
};

static cm_status ensure_capacity(dt_model *m, int64_t T, int64_t R);

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
        DT_NEED(cast2d),   DT_NEED(add),        DT_NEED(swiglu_typed), DT_NEED(embed),      DT_NEED(gemm),
        DT_NEED(rmsnorm),  DT_NEED(rope),       DT_NEED(gemm_dx), DT_NEED(gemm_dw),         DT_NEED(rmsnorm_bwd),
        DT_NEED(rope_bwd), DT_NEED(swiglu_bwd_typed), DT_NEED(lm_ce), DT_NEED(dflash_attn_fwd),
        DT_NEED(dflash_attn_bwd), DT_NEED(rmsnorm_bwd_acc),
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
    /* BF16 storage only where the GEMMs would round these inputs anyway */
    m->adt = be->gemm_rounds_input && be->matmul && be->gemm_rounds_input(ctx) ? CM_DTYPE_BF16 : CM_DTYPE_F32;
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
    m->be->free(m->ctx, m->Fh);
    m->Fh = NULL;
    m->Fh_T = 0;
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

cm_status dt_model_set_act_dtype(dt_model *m, cm_dtype dt) {
    if (dt != CM_DTYPE_F32 && dt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "saved activations in %s are not supported (F32 or BF16)",
                       cm_dtype_name(dt));
    if (dt == CM_DTYPE_BF16 && !m->be->matmul)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "the %s backend has no matmul entry for BF16 saved activations",
                       m->be->name);
    if (dt != m->adt) {
        const int64_t T = m->acts.T_cap, R = m->acts.R_cap;
        acts_release(m);
        m->adt = dt;
        if (T > 0 && R > 0)
            CM_TRY(ensure_capacity(m, T, R));
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
        const int i = b == 0 ? m->n_params - 1 : b <= m->cfg.n_layers ? P_LAYER0 + (m->cfg.n_layers - b) * LP_COUNT : 0;
        off[b] = (size_t)(m->params[i].grad - m->grad_base);
    }
    return n;
}

/* Tells the hook that the gradients of parameter i and every later one are final. */
static cm_status grads_final_from(dt_model *m, int i) {
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
#define CARVE_A(c, n) carve((c), (n), es)

static size_t align_bytes(size_t n) {
    return (n + DT_ALIGN - 1) / DT_ALIGN * DT_ALIGN;
}

/* First fit of slots of the given byte sizes into a span of span_bytes (in order), the rest
 * packed into the work region; returns the work bytes they need. */
static size_t slots_place(dt_slot *slot, const size_t *bytes, int n, size_t span_bytes) {
    size_t span_used = 0, work_used = 0;
    for (int i = 0; i < n; i++) {
        const size_t b = align_bytes(bytes[i]);
        if (span_used + b <= span_bytes) {
            slot[i] = (dt_slot){1, span_used};
            span_used += b;
        } else {
            slot[i] = (dt_slot){0, work_used};
            work_used += b;
        }
    }
    return work_used;
}

static size_t max_sz(size_t a, size_t b) {
    return a > b ? a : b;
}

static void acts_layout(dt_model *m, carver *c, int64_t T, int64_t R) {
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, I = g->intermediate_size, Q = (int64_t)g->n_heads * g->head_dim;
    const int64_t         KV = (int64_t)g->n_kv_heads * g->head_dim, NA = R / g->block_size;
    const size_t          es = cm_dtype_size(m->adt);
    dt_acts              *a = &m->acts;
    a->blk_ids = CARVE_I(c, R);
    a->blk_pos = CARVE_I(c, R);
    a->ctx_pos = CARVE_I(c, T);
    a->anchors = CARVE_I(c, NA);
    a->ctx_lo = CARVE_I(c, NA);
    a->labels = CARVE_I(c, R);
    a->argmax = CARVE_I(c, R);
    a->sel = CARVE_I(c, R);
    a->inv = CARVE_I(c, R);
    a->gscale = CARVE_F(c, R);
    a->ce = CARVE_F(c, R);
    a->F = m->adt == CM_DTYPE_F32 ? CARVE_F(c, T * g->n_taps * D) : NULL;
    a->ctx_pre = CARVE_A(c, T * D);
    a->ctx = CARVE_A(c, T * D);
    for (int l = 0; l < g->n_layers; l++) {
        dt_layer_acts *A = &a->layer[l];
        /* BF16: layer 0's input is the embedding of the block tokens, looked up again */
        A->x = l > 0 || m->adt == CM_DTYPE_F32 ? CARVE_A(c, R * D) : NULL;
        A->q_pre = CARVE_A(c, R * Q);
        A->kc_pre = CARVE_A(c, T * KV);
        A->vc = CARVE_A(c, T * KV);
        A->kb_pre = CARVE_A(c, R * KV);
        A->vb = CARVE_A(c, R * KV);
        A->attn = CARVE_A(c, R * Q);
        A->lse = CARVE_F(c, R * g->n_heads);
        A->x_mid = CARVE_A(c, R * D);
        A->gate = CARVE_A(c, R * I);
        A->up = CARVE_A(c, R * I); /* right after gate: one span */
    }
    a->xw = CARVE_F(c, R * D);
    a->dx = CARVE_F(c, R * D);
    a->dh = CARVE_F(c, R * D);
    a->H = m->adt == CM_DTYPE_F32 ? NULL : CARVE_A(c, R * D);
    a->dctx = CARVE_F(c, T * D);
    /* the work region: the largest of the phases' needs beyond the spans */
    a->span_bytes = 2 * align_bytes((size_t)(R * I) * es);
    const size_t qb = (size_t)(R * Q) * 4, kcb = (size_t)(T * KV) * 4, kbb = (size_t)(R * KV) * 4;
    const size_t as_bytes[AS_COUNT] = {qb, qb, qb, qb, kcb, kcb, kbb, kbb, kcb, kcb, kbb, kbb};
    const size_t fs_bytes[FS_COUNT] = {(size_t)(T * D) * 4, (size_t)(T * D) * 4};
    size_t       work = slots_place(a->as, as_bytes, AS_COUNT, a->span_bytes);
    work = max_sz(work, slots_place(a->fs, fs_bytes, FS_COUNT, a->span_bytes));
    work = max_sz(work, (size_t)(R * I) * es);                  /* the SwiGLU product / its gradient */
    work = max_sz(work, (size_t)((R + 1) * D) * 4);             /* dhsel */
    work = max_sz(work, (size_t)((int64_t)g->n_taps * D) * 4); /* a row of host features to widen */
    a->work = carve(c, (int64_t)work, 1);
    a->work_bytes = work;
}

/* Layer l's attention slot s (F32). */
static float *slot_ptr(const dt_model *m, int l, int s) {
    const dt_acts *a = &m->acts;
    const dt_slot *t = &a->as[s];
    return (float *)((char *)(t->in_span ? a->layer[l].gate : a->work) + t->off);
}

/* The fc slot s (F32; in layer 0's span or the work region). */
static float *fc_slot(const dt_model *m, int s) {
    const dt_acts *a = &m->acts;
    const dt_slot *t = &a->fs[s];
    return (float *)((char *)(t->in_span ? a->layer[0].gate : a->work) + t->off);
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
    h->inv = malloc((size_t)R * sizeof *h->inv);
    if (!a->layer || !h->blk_ids || !h->blk_pos || !h->ctx_pos || !h->ctx_lo || !h->sel_row || !h->labels ||
        !h->argmax || !h->weight || !h->gscale || !h->ce || !h->inv) {
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
    a->bytes = c.off;
    c = (carver){a->base, 0};
    acts_layout(m, &c, T, R);
    a->T_cap = T;
    a->R_cap = R;
    return CM_OK;
}

cm_status dt_model_reserve(dt_model *m, int64_t T, int64_t n_anchors) {
    if (T < 1 || n_anchors < 1 || n_anchors > INT32_MAX / m->cfg.block_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_model_reserve: %lld tokens and %lld anchors are out of range",
                       (long long)T, (long long)n_anchors);
    return ensure_capacity(m, T, n_anchors * m->cfg.block_size);
}

/* Host side of docs/drafter.md: block tokens and positions, context positions restarting at
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
    if (m->adt == CM_DTYPE_F32) {
        if (b->target_hidden)
            CM_TRY(be->upload(m->ctx, a->F, b->target_hidden, (size_t)T * (size_t)nD * sizeof(float)));
        else /* taps in device memory: each into its columns of F */
            for (int k = 0; k < m->cfg.n_taps; k++)
                CM_TRY(be->cast2d(m->ctx, a->F + k * D, CM_DTYPE_F32, nD, b->dev_taps[k], b->dev_taps_dt, D, T, D));
    } else if (b->target_hidden) {
        const size_t es = cm_dtype_size(m->adt), tap_bytes = ((size_t)(a->T_cap * D) * es + 255) / 256 * 256;
        if (m->Fh_T < a->T_cap) { /* the first host-fed step (or a grown plan) */
            be->free(m->ctx, m->Fh);
            m->Fh = NULL;
            m->Fh_T = 0;
            CM_TRY(be->alloc(m->ctx, &m->Fh, tap_bytes * (size_t)m->cfg.n_taps));
            m->Fh_T = a->T_cap;
        }
        for (int k = 0; k < m->cfg.n_taps; k++)
            m->tap[k] = (const char *)m->Fh + tap_bytes * (size_t)k;
        /* through the larger of layer 0's span and the work region, free until the forward, in
         * chunks of rows rounded as they land */
        const int     in_span = a->span_bytes > a->work_bytes;
        float        *stage = in_span ? (float *)a->layer[0].gate : (float *)a->work;
        const size_t  stage_bytes = in_span ? a->span_bytes : a->work_bytes;
        const int64_t rows = (int64_t)(stage_bytes / ((size_t)nD * sizeof(float)));
        for (int64_t r0 = 0; r0 < T; r0 += rows) {
            const int64_t n = T - r0 < rows ? T - r0 : rows;
            CM_TRY(be->upload(m->ctx, stage, b->target_hidden + r0 * nD, (size_t)(n * nD) * sizeof(float)));
            for (int k = 0; k < m->cfg.n_taps; k++)
                CM_TRY(be->cast2d(m->ctx, (char *)m->tap[k] + (size_t)(r0 * D) * es, m->adt, D, stage + k * D,
                                  CM_DTYPE_F32, nD, n, D));
        }
        m->tap_dt = m->adt;
        m->tap_ld = D;
    } else {
        for (int k = 0; k < m->cfg.n_taps; k++)
            m->tap[k] = b->dev_taps[k];
        m->tap_dt = b->dev_taps_dt;
        m->tap_ld = D;
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
// typed helpers: saved activations in adt, temporaries in F32

/* dst (adt) = src [n] (F32). With BF16 storage src is rounded in place to the stored values,
 * so the forward goes on with exactly what the backward will read. */
static cm_status save_act(dt_model *m, void *dst, float *src, int64_t n) {
    CM_TRY(m->be->cast2d(m->ctx, dst, m->adt, n, src, CM_DTYPE_F32, n, 1, n));
    if (m->adt != CM_DTYPE_F32)
        CM_TRY(m->be->cast2d(m->ctx, src, CM_DTYPE_F32, n, dst, m->adt, n, 1, n));
    return CM_OK;
}

/* x [n] (F32, R·D) rounded in place to its BF16 values through acts.H, as save_act would
 * leave it, for the layer input that is not saved. */
static cm_status round_x(dt_model *m, float *x, int64_t n) {
    if (m->adt == CM_DTYPE_F32)
        return CM_OK;
    CM_TRY(m->be->cast2d(m->ctx, m->acts.H, m->adt, n, x, CM_DTYPE_F32, n, 1, n));
    return m->be->cast2d(m->ctx, x, CM_DTYPE_F32, n, m->acts.H, m->adt, n, 1, n);
}

/* acts.dx as a GEMM operand: itself (F32 storage), or rounded once into acts.H (BF16), which
 * every GEMM would otherwise do on its own, in its own scratch. H is free until the layer's
 * normed rows are recomputed. */
static cm_status dx_op(dt_model *m, const void **op) {
    *op = m->acts.dx;
    if (m->adt == CM_DTYPE_F32)
        return CM_OK;
    const int64_t n = m->R * m->cfg.hidden_size;
    CM_TRY(m->be->cast2d(m->ctx, m->acts.H, m->adt, n, m->acts.dx, CM_DTYPE_F32, n, 1, n));
    *op = m->acts.H;
    return CM_OK;
}

/* Where the backward recomputes normed rows in F32: xw when the saved inputs are F32 (xw is
 * free then, and the rows serve as the GEMM input until the layer is done), else dh (only
 * until their BF16 copy in acts.H is made; dh is free until the layer's first dx GEMM). */
static float *h_buf(dt_model *m) {
    return m->adt == CM_DTYPE_F32 ? m->acts.xw : m->acts.dh;
}

/* dst (F32) = src [n] (adt). */
static cm_status load_act(dt_model *m, float *dst, const void *src, int64_t n) {
    return m->be->cast2d(m->ctx, dst, CM_DTYPE_F32, n, src, m->adt, n, 1, n);
}

/* The saved activation src [n] as F32: itself when adt is F32, else widened into buf. */
static cm_status act_f32(dt_model *m, const float **out, const void *src, float *buf, int64_t n) {
    if (m->adt == CM_DTYPE_F32) {
        *out = src;
        return CM_OK;
    }
    CM_TRY(load_act(m, buf, src, n));
    *out = buf;
    return CM_OK;
}

/* rows × C of inp normed with w into h32 (F32), and as a GEMM input (adt): h32 itself, or its
 * BF16 rounding in acts.H. */
static cm_status norm_op(dt_model *m, const void **hop, float *h32, const float *inp, const float *w, int64_t rows) {
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
static cm_status mm_fwd(dt_model *m, void *out, cm_dtype odt, const void *inp, cm_dtype idt, const float *w,
                        int64_t M, int64_t N, int64_t K) {
    if (odt == CM_DTYPE_F32 && idt == CM_DTYPE_F32)
        return m->be->gemm(m->ctx, out, inp, w, CM_DTYPE_F32, M, N, K);
    kn_matmul_params p = {.M = M, .N = N, .K = K, .a = inp, .a_dt = idt, .lda = K, .b = w, .b_dt = CM_DTYPE_F32,
                          .ldb = K, .trans_b = 1, .c = out, .c_dt = odt, .ldc = N};
    return m->be->matmul(m->ctx, &p);
}

/* dinp[M, K] (odt; = or += when acc) = dout[M, N] (ddt) · W[N, K] */
static cm_status mm_dx(dt_model *m, void *dinp, cm_dtype odt, const void *dout, cm_dtype ddt, const float *w,
                       int64_t M, int64_t N, int64_t K, int acc) {
    if (odt == CM_DTYPE_F32 && ddt == CM_DTYPE_F32)
        return m->be->gemm_dx(m->ctx, dinp, dout, w, CM_DTYPE_F32, M, N, K, acc);
    kn_matmul_params p = {.M = M, .N = K, .K = N, .a = dout, .a_dt = ddt, .lda = N, .b = w, .b_dt = CM_DTYPE_F32,
                          .ldb = K, .c = dinp, .c_dt = odt, .ldc = K, .accumulate = acc};
    return m->be->matmul(m->ctx, &p);
}

/* dw[N, K] += dout[M, N]ᵀ (ddt) · inp[M, K] (idt) */
static cm_status mm_dw(dt_model *m, float *dw, const void *dout, cm_dtype ddt, const void *inp, cm_dtype idt,
                       int64_t M, int64_t N, int64_t K) {
    if (ddt == CM_DTYPE_F32 && idt == CM_DTYPE_F32)
        return m->be->gemm_dw(m->ctx, dw, dout, inp, M, N, K);
    kn_matmul_params p = {.M = N, .N = K, .K = M, .a = dout, .a_dt = ddt, .lda = N, .trans_a = 1, .b = inp,
                          .b_dt = idt, .ldb = K, .c = dw, .c_dt = CM_DTYPE_F32, .ldc = K, .accumulate = 1};
    return m->be->matmul(m->ctx, &p);
}

// ----------------------------------------------------------------------------
// forward

static kn_dflash_attn_params attn_params(const dt_model *m, int l) {
    const cm_drafter_cfg *g = &m->cfg;
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
    p.q = slot_ptr(m, l, AS_Q);
    p.k_ctx = slot_ptr(m, l, AS_KC);
    p.v_ctx = slot_ptr(m, l, AS_VC);
    p.k_blk = slot_ptr(m, l, AS_KB);
    p.v_blk = slot_ptr(m, l, AS_VB);
    p.out = slot_ptr(m, l, AS_O);
    p.lse = m->acts.layer[l].lse;
    return p;
}

/* acts.xw += inp [R, K] (adt) · W[N = D, K]ᵀ: with BF16 storage one GEMM adding into the
 * residual (cuBLASLt's beta = 1: the fp32 sum the add kernel would make); with F32 storage
 * gemm into acts.dh and add, as always. */
static cm_status residual_add(dt_model *m, const void *inp, const float *w, int64_t N, int64_t K) {
    if (m->adt == CM_DTYPE_F32) {
        CM_TRY(mm_fwd(m, m->acts.dh, CM_DTYPE_F32, inp, CM_DTYPE_F32, w, m->R, N, K));
        return m->be->add(m->ctx, m->acts.xw, m->acts.dh, m->R * N);
    }
    kn_matmul_params p = {.M = m->R, .N = N, .K = K, .a = inp, .a_dt = m->adt, .lda = K, .b = w,
                          .b_dt = CM_DTYPE_F32, .ldb = K, .trans_b = 1, .c = m->acts.xw, .c_dt = CM_DTYPE_F32,
                          .ldc = N, .accumulate = 1};
    return m->be->matmul(m->ctx, &p);
}

/* k_norm per head and RoPE, in place on k [rows, nkv·hd] (F32). */
static cm_status k_post(dt_model *m, int l, float *k, int64_t rows, const int32_t *pos) {
    const cm_drafter_cfg *g = &m->cfg;
    CM_TRY(m->be->rmsnorm(m->ctx, k, k, lp(m, l, LP_K_NORM)->data, rows * g->n_kv_heads, g->head_dim,
                          g->rms_norm_eps, 0));
    return m->be->rope(m->ctx, k, pos, rows, g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta);
}

/* q_norm per head and RoPE, in place on q [R, nq·hd] (F32). */
static cm_status q_post(dt_model *m, int l, float *q) {
    const cm_drafter_cfg *g = &m->cfg;
    CM_TRY(m->be->rmsnorm(m->ctx, q, q, lp(m, l, LP_Q_NORM)->data, m->R * g->n_heads, g->head_dim,
                          g->rms_norm_eps, 0));
    return m->be->rope(m->ctx, q, m->acts.blk_pos, m->R, g->n_heads, g->head_dim, g->head_dim,
                       (float)g->rope_theta);
}

/* Keys and values of `rows` rows of inp [rows, D] (adt) at positions pos through layer l's
 * k_proj (saved, then k_norm and RoPE into k) and v_proj (saved, and into v). */
static cm_status kv_fwd(dt_model *m, int l, const void *inp, int64_t rows, const int32_t *pos, void *k_pre_s,
                        float *k, void *v_s, float *v) {
    const int64_t D = m->cfg.hidden_size, KV = (int64_t)m->cfg.n_kv_heads * m->cfg.head_dim;
    CM_TRY(mm_fwd(m, k, CM_DTYPE_F32, inp, m->adt, lp(m, l, LP_K)->data, rows, KV, D));
    CM_TRY(save_act(m, k_pre_s, k, rows * KV));
    CM_TRY(k_post(m, l, k, rows, pos));
    CM_TRY(mm_fwd(m, v, CM_DTYPE_F32, inp, m->adt, lp(m, l, LP_V)->data, rows, KV, D));
    CM_TRY(save_act(m, v_s, v, rows * KV));
    return CM_OK;
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
    if (A->x)
        CM_TRY(save_act(m, A->x, a->xw, R * D));
    else
        CM_TRY(round_x(m, a->xw, R * D));
    CM_TRY(norm_op(m, &hop, a->dx, a->xw, lp(m, l, LP_INPUT_LN)->data, R));
    float *q = slot_ptr(m, l, AS_Q);
    CM_TRY(mm_fwd(m, q, CM_DTYPE_F32, hop, m->adt, lp(m, l, LP_Q)->data, R, Q, D));
    CM_TRY(save_act(m, A->q_pre, q, R * Q));
    CM_TRY(q_post(m, l, q));
    CM_TRY(kv_fwd(m, l, a->ctx, m->T, a->ctx_pos, A->kc_pre, slot_ptr(m, l, AS_KC), A->vc, slot_ptr(m, l, AS_VC)));
    CM_TRY(kv_fwd(m, l, hop, R, a->blk_pos, A->kb_pre, slot_ptr(m, l, AS_KB), A->vb, slot_ptr(m, l, AS_VB)));
    kn_dflash_attn_params p = attn_params(m, l);
    CM_TRY(be->dflash_attn_fwd(m->ctx, &p));
    CM_TRY(be->cast2d(m->ctx, A->attn, m->adt, R * Q, p.out, CM_DTYPE_F32, R * Q, 1, R * Q));
    CM_TRY(residual_add(m, A->attn, lp(m, l, LP_O)->data, D, Q));
    CM_TRY(save_act(m, A->x_mid, a->xw, R * D));
    return CM_OK;
}

/* acts.xw: x_mid on entry, x_next = x_mid + down(silu(gate(h2)) · up(h2)) on return,
 * h2 = post_attention_layernorm(x_mid). */
static cm_status mlp_fwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    dt_layer_acts        *A = &a->layer[l];
    const int64_t         D = g->hidden_size, I = g->intermediate_size, R = m->R;
    const void           *hop;
    CM_TRY(norm_op(m, &hop, a->dx, a->xw, lp(m, l, LP_POST_LN)->data, R));
    CM_TRY(mm_fwd(m, A->gate, m->adt, hop, m->adt, lp(m, l, LP_GATE)->data, R, I, D));
    CM_TRY(mm_fwd(m, A->up, m->adt, hop, m->adt, lp(m, l, LP_UP)->data, R, I, D));
    CM_TRY(be->swiglu_typed(m->ctx, a->work, m->adt, A->gate, A->up, m->adt, R * I));
    CM_TRY(residual_add(m, a->work, lp(m, l, LP_DOWN)->data, D, I));
    return CM_OK;
}

static cm_status forward(dt_model *m) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const int64_t         D = g->hidden_size, nD = (int64_t)g->n_taps * D, T = m->T;
    /* ctx = hidden_norm(F · fcᵀ), shared by every layer */
    float *pre = fc_slot(m, FS_PRE), *out = fc_slot(m, FS_OUT);
    if (m->adt == CM_DTYPE_F32)
        CM_TRY(mm_fwd(m, pre, CM_DTYPE_F32, a->F, CM_DTYPE_F32, m->params[P_FC].data, T, D, nD));
    else
        for (int k = 0; k < g->n_taps; k++) {
            kn_matmul_params p = {.M = T, .N = D, .K = D, .a = m->tap[k], .a_dt = m->tap_dt, .lda = m->tap_ld,
                                  .b = m->params[P_FC].data + k * D, .b_dt = CM_DTYPE_F32, .ldb = nD, .trans_b = 1,
                                  .c = pre, .c_dt = CM_DTYPE_F32, .ldc = D, .accumulate = k > 0};
            CM_TRY(be->matmul(m->ctx, &p));
        }
    CM_TRY(save_act(m, a->ctx_pre, pre, T * D));
    CM_TRY(be->rmsnorm(m->ctx, out, pre, m->params[P_HIDDEN_NORM].data, T, D, g->rms_norm_eps, 0));
    CM_TRY(be->cast2d(m->ctx, a->ctx, m->adt, T * D, out, CM_DTYPE_F32, T * D, 1, T * D));
    CM_TRY(be->embed(m->ctx, a->xw, a->blk_ids, m->embed, m->embed_dt, m->R, D));
    for (int l = 0; l < g->n_layers; l++) {
        CM_TRY(attn_fwd(m, l));
        CM_TRY(mlp_fwd(m, l));
    }
    return CM_OK; /* x_out in acts.xw */
}

// ----------------------------------------------------------------------------
// loss and backward

/* The final norm, the LM head and cross-entropy on the selected rows only (compacted), then
 * the gradient through the final norm into acts.dx (rows without a label get zero gradient). */
static cm_status loss_fwd_bwd(dt_model *m) {
    const kn_backend *be = m->be;
    dt_acts          *a = &m->acts;
    const int64_t     D = m->cfg.hidden_size, n = m->n_sel;
    dt_param         *norm = &m->params[m->n_params - 1];
    float            *hsel = a->dx, *dhsel = a->work; /* [n, D], [n + 1, D] */
    CM_TRY(be->rmsnorm(m->ctx, a->dh, a->xw, norm->data, m->R, D, m->cfg.rms_norm_eps, 0));
    /* gathers as row lookups (the embed op on an F32 table): two launches instead of one
     * copy per run of selected rows (~1000 at 512 anchors) */
    CM_TRY(be->embed(m->ctx, hsel, a->sel, a->dh, CM_DTYPE_F32, n, D));
    CM_TRY(be->lm_ce(m->ctx, dhsel, a->ce, a->argmax, hsel, a->labels, a->gscale, m->lm_head, m->lm_head_dt, n,
                     m->V, D));
    CM_TRY(be->download(m->ctx, m->host.ce, a->ce, (size_t)n * sizeof(float)));
    CM_TRY(be->download(m->ctx, m->host.argmax, a->argmax, (size_t)n * sizeof(int32_t)));
    CM_TRY(dev_zero(m, dhsel + n * D, D)); /* the row unselected block rows read */
    CM_TRY(be->embed(m->ctx, a->dh, a->inv, dhsel, CM_DTYPE_F32, m->R, D));
    CM_TRY(be->rmsnorm_bwd(m->ctx, a->dx, norm->grad, a->dh, a->xw, norm->data, m->R, D, m->cfg.rms_norm_eps,
                           0));
    return CM_OK;
}

/* acts.dx holds ∂/∂x_next on entry and ∂/∂x_mid on return. */
static cm_status mlp_bwd(dt_model *m, int l) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const dt_layer_acts  *A = &a->layer[l];
    const int64_t         D = g->hidden_size, I = g->intermediate_size, R = m->R;
    const cm_dtype        t = m->adt;
    dt_param             *gate = lp(m, l, LP_GATE), *up = lp(m, l, LP_UP), *down = lp(m, l, LP_DOWN),
             *ln = lp(m, l, LP_POST_LN);
    const float *x_mid;
    const void  *hop, *dxop;
    CM_TRY(dx_op(m, &dxop));
    /* the SwiGLU product, recomputed, then its gradient in the same place */
    CM_TRY(be->swiglu_typed(m->ctx, a->work, t, A->gate, A->up, t, R * I));
    CM_TRY(mm_dw(m, down->grad, dxop, t, a->work, t, R, D, I));
    CM_TRY(mm_dx(m, a->work, t, dxop, t, down->data, R, D, I, 0));
    CM_TRY(be->swiglu_bwd_typed(m->ctx, A->gate, A->up, a->work, A->gate, A->up, t, R * I));
    CM_TRY(act_f32(m, &x_mid, A->x_mid, a->xw, R * D));
    CM_TRY(norm_op(m, &hop, h_buf(m), x_mid, ln->data, R)); /* h2, recomputed (over dxop) */
    CM_TRY(mm_dw(m, gate->grad, A->gate, t, hop, t, R, I, D));
    CM_TRY(mm_dw(m, up->grad, A->up, t, hop, t, R, I, D));
    CM_TRY(mm_dx(m, a->dh, CM_DTYPE_F32, A->gate, t, gate->data, R, I, D, 0));
    CM_TRY(mm_dx(m, a->dh, CM_DTYPE_F32, A->up, t, up->data, R, I, D, 1));
    CM_TRY(be->rmsnorm_bwd_acc(m->ctx, a->dx, ln->grad, a->dh, x_mid, ln->data, R, D, g->rms_norm_eps, 0));
    return CM_OK;
}

/* Backward of kv_fwd given dk (after RoPE and k_norm; rotated in place) and dv: the k/v
 * weight grads and the input gradient into dinp (= or += as accumulate says). k is the
 * attention slot that held the keys (it gets k_pre back), dk_pre a free slot. */
static cm_status kv_bwd(dt_model *m, int l, const void *inp, int64_t rows, const int32_t *pos, const void *k_pre_s,
                        float *k, float *dk, const float *dv, float *dk_pre, float *dinp, int accumulate) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    const int64_t         D = g->hidden_size, KV = (int64_t)g->n_kv_heads * g->head_dim;
    dt_param             *wk = lp(m, l, LP_K), *wv = lp(m, l, LP_V), *kn = lp(m, l, LP_K_NORM);
    CM_TRY(
        be->rope_bwd(m->ctx, dk, pos, rows, g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(load_act(m, k, k_pre_s, rows * KV));
    CM_TRY(be->rmsnorm_bwd(m->ctx, dk_pre, kn->grad, dk, k, kn->data, rows * g->n_kv_heads, g->head_dim,
                           g->rms_norm_eps, 0));
    CM_TRY(mm_dw(m, wk->grad, dk_pre, CM_DTYPE_F32, inp, m->adt, rows, KV, D));
    CM_TRY(mm_dw(m, wv->grad, dv, CM_DTYPE_F32, inp, m->adt, rows, KV, D));
    CM_TRY(mm_dx(m, dinp, CM_DTYPE_F32, dk_pre, CM_DTYPE_F32, wk->data, rows, KV, D, accumulate));
    CM_TRY(mm_dx(m, dinp, CM_DTYPE_F32, dv, CM_DTYPE_F32, wv->data, rows, KV, D, 1));
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
    const int64_t         KV = (int64_t)g->n_kv_heads * g->head_dim;
    dt_param             *wq = lp(m, l, LP_Q), *wo = lp(m, l, LP_O), *qn = lp(m, l, LP_Q_NORM),
             *ln = lp(m, l, LP_INPUT_LN);
    kn_dflash_attn_params p = attn_params(m, l);
    float *q = (float *)p.q, *kc = (float *)p.k_ctx, *vc = (float *)p.v_ctx, *kb = (float *)p.k_blk,
          *vb = (float *)p.v_blk, *o = p.out;
    const void *dxop;
    CM_TRY(dx_op(m, &dxop));
    CM_TRY(mm_dw(m, wo->grad, dxop, m->adt, A->attn, m->adt, R, D, Q));
    p.dout = slot_ptr(m, l, AS_DO);
    CM_TRY(mm_dx(m, (float *)p.dout, CM_DTYPE_F32, dxop, m->adt, wo->data, R, D, Q, 0));
    /* the attention's inputs and output again: q and k through their norms and RoPE */
    CM_TRY(load_act(m, q, A->q_pre, R * Q));
    CM_TRY(q_post(m, l, q));
    CM_TRY(load_act(m, kc, A->kc_pre, T * KV));
    CM_TRY(k_post(m, l, kc, T, a->ctx_pos));
    CM_TRY(load_act(m, vc, A->vc, T * KV));
    CM_TRY(load_act(m, kb, A->kb_pre, R * KV));
    CM_TRY(k_post(m, l, kb, R, a->blk_pos));
    CM_TRY(load_act(m, vb, A->vb, R * KV));
    CM_TRY(load_act(m, o, A->attn, R * Q));
    p.dq = slot_ptr(m, l, AS_DQ);
    p.dk_ctx = slot_ptr(m, l, AS_DKC);
    p.dv_ctx = slot_ptr(m, l, AS_DVC);
    p.dk_blk = slot_ptr(m, l, AS_DKB);
    p.dv_blk = slot_ptr(m, l, AS_DVB);
    CM_TRY(be->dflash_attn_bwd(m->ctx, &p));
    /* queries: q gets q_pre back, o takes dq_pre */
    CM_TRY(be->rope_bwd(m->ctx, p.dq, a->blk_pos, R, g->n_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(load_act(m, q, A->q_pre, R * Q));
    CM_TRY(be->rmsnorm_bwd(m->ctx, o, qn->grad, p.dq, q, qn->data, R * g->n_heads, g->head_dim, g->rms_norm_eps,
                           0));
    const float *x;
    const void  *hop;
    if (A->x)
        CM_TRY(act_f32(m, &x, A->x, a->xw, R * D));
    else { /* layer 0 with BF16 storage: the embedding again, rounded as the forward rounded it */
        CM_TRY(be->embed(m->ctx, a->xw, a->blk_ids, m->embed, m->embed_dt, R, D));
        CM_TRY(round_x(m, a->xw, R * D));
        x = a->xw;
    }
    CM_TRY(norm_op(m, &hop, h_buf(m), x, ln->data, R)); /* h, recomputed */
    CM_TRY(mm_dw(m, wq->grad, o, CM_DTYPE_F32, hop, m->adt, R, Q, D));
    CM_TRY(mm_dx(m, a->dh, CM_DTYPE_F32, o, CM_DTYPE_F32, wq->data, R, Q, D, 0));
    /* block keys and values feed dh; context keys and values feed dctx */
    CM_TRY(kv_bwd(m, l, hop, R, a->blk_pos, A->kb_pre, kb, p.dk_blk, p.dv_blk, vb, a->dh, 1));
    CM_TRY(kv_bwd(m, l, a->ctx, T, a->ctx_pos, A->kc_pre, kc, p.dk_ctx, p.dv_ctx, vc, a->dctx,
                  l != g->n_layers - 1));
    CM_TRY(be->rmsnorm_bwd_acc(m->ctx, a->dx, ln->grad, a->dh, x, ln->data, R, D, g->rms_norm_eps, 0));
    return CM_OK;
}

static cm_status backward(dt_model *m) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    const int64_t         D = g->hidden_size, nD = (int64_t)g->n_taps * D, T = m->T;
    CM_TRY(loss_fwd_bwd(m));
    CM_TRY(grads_final_from(m, m->n_params - 1)); /* the final norm */
    for (int l = g->n_layers - 1; l >= 0; l--) {
        CM_TRY(mlp_bwd(m, l));
        CM_TRY(attn_bwd(m, l));
        CM_TRY(grads_final_from(m, P_LAYER0 + l * LP_COUNT)); /* layer l's */
    }
    /* acts.dx now holds the gradient of the (frozen) embedding output: dropped. */
    dt_param *hn = &m->params[P_HIDDEN_NORM], *fc = &m->params[P_FC];
    float    *pre = fc_slot(m, FS_PRE), *dpre = fc_slot(m, FS_OUT);
    CM_TRY(load_act(m, pre, a->ctx_pre, T * D));
    CM_TRY(be->rmsnorm_bwd(m->ctx, dpre, hn->grad, a->dctx, pre, hn->data, T, D, g->rms_norm_eps, 0));
    if (m->adt == CM_DTYPE_F32)
        CM_TRY(mm_dw(m, fc->grad, dpre, CM_DTYPE_F32, a->F, CM_DTYPE_F32, T, D, nD));
    else
        for (int k = 0; k < g->n_taps; k++) {
            kn_matmul_params p = {.M = D, .N = D, .K = T, .a = dpre, .a_dt = CM_DTYPE_F32, .lda = D, .trans_a = 1,
                                  .b = m->tap[k], .b_dt = m->tap_dt, .ldb = m->tap_ld, .c = fc->grad + k * D,
                                  .c_dt = CM_DTYPE_F32, .ldc = nD, .accumulate = 1};
            CM_TRY(be->matmul(m->ctx, &p));
        }
    return grads_final_from(m, 0); /* fc and hidden_norm: all of them */
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
