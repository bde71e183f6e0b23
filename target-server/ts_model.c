/* target-server/ts_model.c — loading a Qwen3.5/3.6 checkpoint onto a kernel backend and the
 * frozen forward over packed sequences (docs/target.md).
 *
 * Weights: GEMM matrices and the embedding stay BF16 when stored BF16 (or when bf16_weights
 * asks for it), else F32; every small parameter (norms, conv, A_log, dt_bias) is widened to
 * F32 at load, whatever the checkpoint stored. Activations are F32; the backend's GEMM mode
 * decides the precision of matrix products. When the backend's gemm rounds its inputs to
 * bf16 anyway (cuda, --precision bf16) the forward takes the fused path: the producers of
 * GEMM inputs (the norms, swiglu, the gated norm) write them as bf16 themselves, the residual
 * add runs inside the norm that follows it, and the GDN conv, q/k/v split and q/k l2norms are
 * one op: the same products without the conversion passes (TANDEM_TARGET_FUSED=0 turns it
 * off, for comparison; =1 forces it, so the cpu emulates the cuda bf16 path). The workspace
 * is sized for the largest batch seen and reused. */
#include "ts_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_safetensors.h"
#include "cm_time.h"

typedef struct ts_mat {
    void    *data; /* backend memory, [rows, cols] */
    cm_dtype dtype;
} ts_mat;

typedef struct ts_layer {
    cm_layer_type type;
    float        *input_norm; /* [D] */
    float        *post_norm;  /* [D] */
    ts_mat        gate_proj, up_proj, down_proj;
    /* gated deltanet */
    ts_mat in_qkv, in_z, in_b, in_a, out_proj;
    float *conv_w;  /* [conv_dim, K] */
    float *A_log;   /* [nv] */
    float *dt_bias; /* [nv] */
    float *gdn_norm;/* [dv] */
    /* gated attention */
    ts_mat q_proj, k_proj, v_proj, o_proj;
    float *q_norm, *k_norm; /* [hd] */
} ts_layer;

typedef struct ts_ws {
    int64_t T; /* capacity in tokens */
    int32_t *ids, *cu, *pos;
    int32_t *pos_host; /* host staging of the positions (no allocation per forward) */
    float   *x, *h, *o, *big0, *big1, *big2, *q, *k, *v, *gate, *z, *a, *b, *g, *beta, *attn, *logits;
    uint16_t *h16;   /* fused path: bf16 [T, D], the normed input of the projections */
    uint16_t *act16; /* fused path: bf16 [T, max(I, nv·dv)], swiglu / gated-norm output */
} ts_ws;

struct ts_model {
    cm_target_cfg     cfg;
    const kn_backend *be;
    kn_ctx           *ctx;
    int               n_layers; /* loaded */
    int               has_head;
    ts_mat            embed;
    ts_mat            lm_head;  /* aliases embed when tied */
    float            *final_norm;
    ts_layer         *layers;
    ts_ws             ws;
    int               fused; /* the bf16 fast path (see the top of this file) */
    int               timing;
    ts_timing         tm;
    double           *gemm_acc; /* while timing: the sum the running block's GEMMs add to */
};

// ----------------------------------------------------------------------------
// loading

typedef struct loader {
    ts_model   *m;
    const cm_st *st;
    const char *prefix; /* "model.language_model." or "model." */
    const char *dir;
    int         bf16_weights;
    int         random; /* init_random: fill instead of read */
    uint64_t    seed;
} loader;

/* --init random: the value range of a tensor, by name, uniform with these bounds. Matrices and
 * the embedding get std 0.02 (Hugging Face's initializer_range; bound 0.02·√3); the (1 + w)
 * norms small w around 0; the GDN output norm (plain w) around 1; the conv as PyTorch's
 * Conv1d default for fan-in 4 (±1/2); A_log in [0, ln 16] (A ∈ [1, 16], as Qwen3-Next inits
 * A); dt_bias around 1. Inputs to every matrix are RMS-normed, so each block adds O(1) to
 * the residual and 64 layers stay far from bf16 overflow. */
static void init_range(const char *name, float *lo, float *hi) {
    static const struct {
        const char *suffix;
        float       lo, hi;
    } table[] = {
        {"linear_attn.norm.weight", 0.9f, 1.1f}, {"norm.weight", -0.1f, 0.1f},  {"layernorm.weight", -0.1f, 0.1f},
        {"conv1d.weight", -0.5f, 0.5f},          {"A_log", 0.0f, 2.7725887f},  {"dt_bias", 0.5f, 1.5f},
    };
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        size_t k = strlen(table[i].suffix);
        if (n >= k && strcmp(name + n - k, table[i].suffix) == 0) {
            *lo = table[i].lo;
            *hi = table[i].hi;
            return;
        }
    }
    *lo = -0.034641016f; /* 0.02·√3 */
    *hi = 0.034641016f;
}

/* One seed per tensor from the run's seed and the tensor's name (FNV-1a), so a tensor's
 * values do not depend on what else is loaded. */
static uint64_t tensor_seed(uint64_t seed, const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return h ^ (seed * 0x9E3779B97F4A7C15ull);
}

static cm_status fill_new(loader *ld, const char *name, void **dst, cm_dtype dt, size_t n) {
    ts_model *m = ld->m;
    float     lo, hi;
    init_range(name, &lo, &hi);
    CM_TRY(m->be->alloc(m->ctx, dst, n * cm_dtype_size(dt)));
    return m->be->fill_uniform(m->ctx, *dst, dt, (int64_t)n, tensor_seed(ld->seed, name), lo, hi);
}

static cm_status upload_new(ts_model *m, void **dst, const void *host, size_t bytes) {
    CM_TRY(m->be->alloc(m->ctx, dst, bytes));
    return m->be->upload(m->ctx, *dst, host, bytes);
}

/* Loads a [rows, cols] matrix named prefix+name (or exactly name when raw). */
static cm_status load_mat(loader *ld, const char *name, int raw, int64_t rows, int64_t cols, ts_mat *out) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", raw ? "" : ld->prefix, name);
    if (ld->random) {
        out->dtype = ld->bf16_weights ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        return fill_new(ld, full, &out->data, out->dtype, (size_t)rows * (size_t)cols);
    }
    const int64_t       shape[2] = {rows, cols};
    const cm_st_tensor *t;
    CM_TRY(cm_st_expect(ld->st, full, 2, shape, &t));
    if (!cm_dtype_is_float(t->dtype))
        return CM_FAIL(CM_ERR_FORMAT, "tensor '%s' in '%s' has dtype %s; expected a float dtype (BF16, F32)",
                       full, t->file, cm_dtype_name(t->dtype));
    cm_dtype dt    = (t->dtype == CM_DTYPE_BF16 || ld->bf16_weights) ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    size_t   n     = (size_t)rows * (size_t)cols;
    size_t   bytes = n * cm_dtype_size(dt);
    void    *host  = malloc(bytes ? bytes : 1);
    if (!host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for '%s'", bytes, full);
    cm_status st = cm_st_read(ld->st, full, 2, shape, host, dt);
    if (st == CM_OK) st = upload_new(ld->m, &out->data, host, bytes);
    free(host);
    out->dtype = dt;
    return st;
}

/* Loads a small parameter of n_dims/shape as F32. */
static cm_status load_vec(loader *ld, const char *name, int n_dims, const int64_t *shape, float **out) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", ld->prefix, name);
    size_t n = 1;
    for (int i = 0; i < n_dims; i++) n *= (size_t)shape[i];
    if (ld->random) return fill_new(ld, full, (void **)out, CM_DTYPE_F32, n);
    float *host = malloc(n * sizeof(float));
    if (!host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu floats for '%s'", n, full);
    cm_status st = cm_st_read(ld->st, full, n_dims, shape, host, CM_DTYPE_F32);
    if (st == CM_OK) st = upload_new(ld->m, (void **)out, host, n * sizeof(float));
    free(host);
    return st;
}

static cm_status load_vec1(loader *ld, const char *name, int64_t n, float **out) {
    return load_vec(ld, name, 1, &n, out);
}

static cm_status load_layer(loader *ld, int i, ts_layer *L) {
    const cm_target_cfg *c = &ld->m->cfg;
    const int64_t        D = c->hidden_size, I = c->intermediate_size;
    char                 nm[128];
#define LNAME(s) (snprintf(nm, sizeof nm, "layers.%d.%s", i, (s)), nm)
    L->type = c->layer_types[i];
    CM_TRY(load_vec1(ld, LNAME("input_layernorm.weight"), D, &L->input_norm));
    CM_TRY(load_vec1(ld, LNAME("post_attention_layernorm.weight"), D, &L->post_norm));
    CM_TRY(load_mat(ld, LNAME("mlp.gate_proj.weight"), 0, I, D, &L->gate_proj));
    CM_TRY(load_mat(ld, LNAME("mlp.up_proj.weight"), 0, I, D, &L->up_proj));
    CM_TRY(load_mat(ld, LNAME("mlp.down_proj.weight"), 0, D, I, &L->down_proj));
    if (L->type == CM_LAYER_TYPE_LINEAR_ATTENTION) {
        const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
        const int64_t conv_dim = 2 * nk * dk + nv * dv;
        const int64_t conv_shape[3] = {conv_dim, 1, c->lin_conv_kernel};
        CM_TRY(load_mat(ld, LNAME("linear_attn.in_proj_qkv.weight"), 0, conv_dim, D, &L->in_qkv));
        CM_TRY(load_mat(ld, LNAME("linear_attn.in_proj_z.weight"), 0, nv * dv, D, &L->in_z));
        CM_TRY(load_mat(ld, LNAME("linear_attn.in_proj_b.weight"), 0, nv, D, &L->in_b));
        CM_TRY(load_mat(ld, LNAME("linear_attn.in_proj_a.weight"), 0, nv, D, &L->in_a));
        CM_TRY(load_mat(ld, LNAME("linear_attn.out_proj.weight"), 0, D, nv * dv, &L->out_proj));
        CM_TRY(load_vec(ld, LNAME("linear_attn.conv1d.weight"), 3, conv_shape, &L->conv_w));
        CM_TRY(load_vec1(ld, LNAME("linear_attn.A_log"), nv, &L->A_log));
        CM_TRY(load_vec1(ld, LNAME("linear_attn.dt_bias"), nv, &L->dt_bias));
        CM_TRY(load_vec1(ld, LNAME("linear_attn.norm.weight"), dv, &L->gdn_norm));
    } else {
        const int64_t nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
        const int64_t q_rows = nq * hd * (c->attn_output_gate ? 2 : 1);
        CM_TRY(load_mat(ld, LNAME("self_attn.q_proj.weight"), 0, q_rows, D, &L->q_proj));
        CM_TRY(load_mat(ld, LNAME("self_attn.k_proj.weight"), 0, nkv * hd, D, &L->k_proj));
        CM_TRY(load_mat(ld, LNAME("self_attn.v_proj.weight"), 0, nkv * hd, D, &L->v_proj));
        CM_TRY(load_mat(ld, LNAME("self_attn.o_proj.weight"), 0, D, nq * hd, &L->o_proj));
        CM_TRY(load_vec1(ld, LNAME("self_attn.q_norm.weight"), hd, &L->q_norm));
        CM_TRY(load_vec1(ld, LNAME("self_attn.k_norm.weight"), hd, &L->k_norm));
    }
#undef LNAME
    return CM_OK;
}

/* The checkpoint layout decides the key prefix: Qwen3_5ForConditionalGeneration saves
 * model.language_model.*, Qwen3_5ForCausalLM saves model.*. */
static cm_status detect_prefix(const cm_st *st, const char *dir, const char **prefix) {
    static const char *prefixes[] = {"model.language_model.", "model."};
    for (int i = 0; i < 2; i++) {
        char name[128];
        snprintf(name, sizeof name, "%sembed_tokens.weight", prefixes[i]);
        if (cm_st_find(st, name)) {
            *prefix = prefixes[i];
            return CM_OK;
        }
    }
    return CM_FAIL(CM_ERR_FORMAT,
                   "missing tensor 'model.language_model.embed_tokens.weight' (Qwen3_5ForConditionalGeneration "
                   "layout) or 'model.embed_tokens.weight' (Qwen3_5ForCausalLM layout) in '%s': is this a Qwen3.5/3.6 "
                   "checkpoint?",
                   dir);
}

cm_status ts_model_load(ts_model **out, const ts_model_config *mc) {
    *out = NULL;
    cm_status st;
    cm_st    *sts = NULL;
    ts_model *m   = calloc(1, sizeof *m);
    if (!m) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the model");
    m->be  = mc->backend;
    m->ctx = mc->ctx;
    CM_TRY_GOTO(cm_target_cfg_load(&m->cfg, mc->dir), st, fail);
    const cm_target_cfg *c = &m->cfg;
    if (mc->n_layers > c->n_layers) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "%d layers asked for, but '%s' has %d", mc->n_layers, mc->dir, c->n_layers);
        goto fail;
    }
    m->n_layers = mc->n_layers < 0 ? c->n_layers : mc->n_layers;
    loader ld = {.m = m, .dir = mc->dir, .bf16_weights = mc->bf16_weights, .random = mc->init_random,
                 .seed = mc->seed, .prefix = "model.language_model."};
    if (mc->init_random) {
        if (!m->be->fill_uniform) {
            st = CM_FAIL(CM_ERR_UNSUPPORTED, "--init random needs fill_uniform, which the %s backend lacks",
                         m->be->name);
            goto fail;
        }
    } else {
        CM_TRY_GOTO(cm_st_open_dir(&sts, mc->dir), st, fail);
        ld.st = sts;
        CM_TRY_GOTO(detect_prefix(sts, mc->dir, &ld.prefix), st, fail);
    }

    const int64_t D = c->hidden_size, V = c->vocab_size;
    CM_TRY_GOTO(load_mat(&ld, "embed_tokens.weight", 0, V, D, &m->embed), st, fail);
    m->layers = calloc((size_t)m->n_layers, sizeof *m->layers);
    if (!m->layers) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d layers", m->n_layers);
        goto fail;
    }
    for (int i = 0; i < m->n_layers; i++) CM_TRY_GOTO(load_layer(&ld, i, &m->layers[i]), st, fail);
    if (mc->load_head) {
        CM_TRY_GOTO(load_vec1(&ld, "norm.weight", D, &m->final_norm), st, fail);
        if (c->tie_word_embeddings)
            m->lm_head = m->embed;
        else
            CM_TRY_GOTO(load_mat(&ld, "lm_head.weight", 1, V, D, &m->lm_head), st, fail);
        m->has_head = 1;
    }
    cm_st_destroy(&sts);
    if (mc->init_random) CM_TRY_GOTO(m->be->sync(m->ctx), st, fail); /* the fills ran */
    CM_LOG_INFO("%s '%s': %s, %d of %d layers, hidden %d, vocab %d, backend %s%s",
                mc->init_random ? "random weights for" : "loaded", mc->dir, c->model_type, m->n_layers, c->n_layers,
                c->hidden_size, c->vocab_size, m->be->name, m->has_head ? ", with lm head" : "");
    /* TANDEM_TARGET_FUSED: unset = the fused path where gemm rounds its inputs anyway, 0 = never,
     * 1 = also elsewhere (on the cpu it then rounds the GEMM inputs as cuda bf16 does) */
    const char *fenv     = getenv("TANDEM_TARGET_FUSED");
    const int   has_ops  = m->be->gemm_bf16in && m->be->add_rmsnorm_bf16 && m->be->rmsnorm_gated_bf16 &&
                        m->be->swiglu_bf16 && m->be->gdn_conv_qkv;
    const int   rounds   = m->be->gemm_rounds_input && m->be->gemm_rounds_input(m->ctx);
    m->fused = has_ops && (fenv && strcmp(fenv, "1") == 0 ? 1 : fenv && strcmp(fenv, "0") == 0 ? 0 : rounds);
    const char *tenv = getenv("TANDEM_LAYER_TIMING");
    if (tenv && strcmp(tenv, "1") == 0) ts_model_set_timing(m, 1);
    *out = m;
    return CM_OK;
fail:
    cm_st_destroy(&sts);
    ts_model_destroy(&m);
    return st;
}

static void ws_release(ts_model *m) {
    ts_ws *w = &m->ws;
    void  *bufs[] = {w->ids, w->cu, w->pos, w->x, w->h, w->o, w->big0, w->big1, w->big2, w->q, w->k, w->v,
                     w->gate, w->z, w->a, w->b, w->g, w->beta, w->attn, w->logits, w->h16, w->act16};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) m->be->free(m->ctx, bufs[i]);
    free(w->pos_host);
    memset(w, 0, sizeof *w);
}

void ts_model_destroy(ts_model **pm) {
    ts_model *m = pm ? *pm : NULL;
    if (!m) return;
    const kn_backend *be = m->be;
    ws_release(m);
    if (m->layers) {
        for (int i = 0; i < m->n_layers; i++) {
            ts_layer *L    = &m->layers[i];
            void     *p[] = {L->input_norm, L->post_norm, L->gate_proj.data, L->up_proj.data, L->down_proj.data,
                             L->in_qkv.data, L->in_z.data, L->in_b.data, L->in_a.data, L->out_proj.data,
                             L->conv_w, L->A_log, L->dt_bias, L->gdn_norm, L->q_proj.data, L->k_proj.data,
                             L->v_proj.data, L->o_proj.data, L->q_norm, L->k_norm};
            for (size_t j = 0; j < sizeof p / sizeof p[0]; j++) be->free(m->ctx, p[j]);
        }
        free(m->layers);
    }
    if (m->lm_head.data != m->embed.data) be->free(m->ctx, m->lm_head.data);
    be->free(m->ctx, m->embed.data);
    be->free(m->ctx, m->final_norm);
    free(m);
    *pm = NULL;
}

const cm_target_cfg *ts_model_cfg(const ts_model *m) { return &m->cfg; }

int ts_model_n_loaded_layers(const ts_model *m) { return m->n_layers; }

int ts_model_fused(const ts_model *m) { return m->fused; }

// ----------------------------------------------------------------------------
// forward

cm_status ts_tokens_validate(const cm_target_cfg *cfg, const int32_t *ids, int64_t T) {
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= cfg->vocab_size)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "input_ids[%lld] = %d is out of range for vocab_size %d (was the data tokenized for "
                           "another model?)",
                           (long long)t, ids[t], cfg->vocab_size);
    return CM_OK;
}

cm_status ts_batch_validate(const cm_target_cfg *cfg, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq) {
    if (T <= 0) return CM_FAIL(CM_ERR_INVALID_ARG, "empty batch: input_ids has no tokens");
    if (n_seq <= 0) return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens must hold at least 2 values (0 and T)");
    CM_TRY(ts_tokens_validate(cfg, ids, T));
    if (cu[0] != 0) return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens[0] = %d; it must be 0", cu[0]);
    for (int i = 1; i <= n_seq; i++)
        if (cu[i] <= cu[i - 1])
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "cu_seqlens is not strictly increasing: cu_seqlens[%d] = %d after cu_seqlens[%d] = %d", i,
                           cu[i], i - 1, cu[i - 1]);
    if (cu[n_seq] != T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens ends at %d but input_ids holds %lld tokens; the last value "
                                           "must equal the token count",
                       cu[n_seq], (long long)T);
    return CM_OK;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Sizes the workspace for T tokens (cu_seqlens fits in T + 1 since sequences are non-empty). */
static cm_status ws_reserve(ts_model *m, int64_t T, int want_logits) {
    ts_ws *w = &m->ws;
    if (T <= w->T && (!want_logits || w->logits)) return CM_OK;
    ws_release(m);
    const cm_target_cfg *c  = &m->cfg;
    const int64_t        D  = c->hidden_size, I = c->intermediate_size;
    const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
    const int64_t conv_dim = 2 * nk * dk + nv * dv;
    const int64_t wide     = max3(conv_dim, 2 * nq * hd, I);
    const int64_t qdim     = max3(nq * hd, nk * dk, 1);
    const int64_t kdim     = max3(nkv * hd, nk * dk, 1);
    const int64_t vdim     = max3(nkv * hd, nv * dv, 1);
    const int64_t odim     = max3(nq * hd, nv * dv, 1);
    struct {
        void  **p;
        int64_t n;
        size_t  el;
    } plan[] = {
        {(void **)&w->ids, T, 4},           {(void **)&w->cu, T + 1, 4},        {(void **)&w->pos, T, 4},
        {(void **)&w->x, T * D, 4},         {(void **)&w->h, T * D, 4},         {(void **)&w->o, T * D, 4},
        {(void **)&w->big0, T * wide, 4},   {(void **)&w->big1, T * wide, 4},   {(void **)&w->big2, T * wide, 4},
        {(void **)&w->q, T * qdim, 4},      {(void **)&w->k, T * kdim, 4},      {(void **)&w->v, T * vdim, 4},
        {(void **)&w->gate, T * odim, 4},   {(void **)&w->z, T * odim, 4},      {(void **)&w->a, T * nv, 4},
        {(void **)&w->b, T * nv, 4},        {(void **)&w->g, T * nv, 4},        {(void **)&w->beta, T * nv, 4},
        {(void **)&w->attn, T * odim, 4},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        CM_TRY(m->be->alloc(m->ctx, plan[i].p, (size_t)(plan[i].n > 0 ? plan[i].n : 1) * plan[i].el));
    if (want_logits) CM_TRY(m->be->alloc(m->ctx, (void **)&w->logits, (size_t)T * (size_t)c->vocab_size * 4));
    if (m->fused) {
        CM_TRY(m->be->alloc(m->ctx, (void **)&w->h16, (size_t)(T * D) * 2));
        CM_TRY(m->be->alloc(m->ctx, (void **)&w->act16, (size_t)(T * max3(I, nv * dv, 1)) * 2));
    }
    w->pos_host = malloc((size_t)T * sizeof *w->pos_host);
    if (!w->pos_host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate positions for %lld tokens", (long long)T);
    w->T = T;
    return CM_OK;
}

// ---- timing (TANDEM_LAYER_TIMING / ts_model_set_timing): host clock after a device sync

/* The time now once the device has finished everything queued; 0 when timing is off. */
static cm_status mark(ts_model *m, double *t) {
    if (!m->timing) {
        *t = 0;
        return CM_OK;
    }
    CM_TRY(m->be->sync(m->ctx));
    *t = 1e3 * cm_now_s();
    return CM_OK;
}

void ts_model_set_timing(ts_model *m, int on) {
    m->timing = on;
    memset(&m->tm, 0, sizeof m->tm);
}

void ts_model_get_timing(const ts_model *m, ts_timing *out) { *out = m->tm; }

/* The backend's GEMM from an f32 input, or from a bf16 one (inp16) written by its producer
 * (fused path). */
static cm_status gemm_call(ts_model *m, float *out, const float *inp, const uint16_t *inp16, const ts_mat *w,
                           int64_t M, int64_t N, int64_t K) {
    if (inp16) return m->be->gemm_bf16in(m->ctx, out, inp16, w->data, w->dtype, M, N, K);
    return m->be->gemm(m->ctx, out, inp, w->data, w->dtype, M, N, K);
}

/* gemm_call, timed into *m->gemm_acc when timing is on. */
static cm_status gemm_any(ts_model *m, float *out, const float *inp, const uint16_t *inp16, const ts_mat *w,
                          int64_t M, int64_t N, int64_t K) {
    if (!m->timing) return gemm_call(m, out, inp, inp16, w, M, N, K);
    double t0, t1;
    CM_TRY(mark(m, &t0));
    CM_TRY(gemm_call(m, out, inp, inp16, w, M, N, K));
    CM_TRY(mark(m, &t1));
    if (m->gemm_acc) *m->gemm_acc += t1 - t0;
    return CM_OK;
}

static cm_status gemm(ts_model *m, float *out, const float *inp, const ts_mat *w, int64_t M, int64_t N, int64_t K) {
    return gemm_any(m, out, inp, NULL, w, M, N, K);
}

static cm_status gemm16(ts_model *m, float *out, const uint16_t *inp, const ts_mat *w, int64_t M, int64_t N,
                        int64_t K) {
    return gemm_any(m, out, NULL, inp, w, M, N, K);
}

/* The projections' GEMM: from the bf16 normed input on the fused path, else from h. */
static cm_status gemm_h(ts_model *m, float *out, const ts_mat *w, int64_t M, int64_t N, int64_t K) {
    return m->fused ? gemm16(m, out, m->ws.h16, w, M, N, K) : gemm(m, out, m->ws.h, w, M, N, K);
}

static cm_status forward_gdn(ts_model *m, const ts_layer *L, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    const int64_t        D  = c->hidden_size;
    const int nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t conv_dim = 2 * (int64_t)nk * dk + (int64_t)nv * dv;
    CM_TRY(gemm_h(m, w->big0, &L->in_qkv, T, conv_dim, D));
    CM_TRY(gemm_h(m, w->z, &L->in_z, T, (int64_t)nv * dv, D));
    CM_TRY(gemm_h(m, w->b, &L->in_b, T, nv, D));
    CM_TRY(gemm_h(m, w->a, &L->in_a, T, nv, D));
    /* the fused op may refuse a shape (a long conv kernel, very wide heads): then the chain */
    cm_status cst = CM_ERR_UNSUPPORTED;
    if (m->fused)
        cst = be->gdn_conv_qkv(cx, w->q, w->k, w->v, w->big0, L->conv_w, w->cu, n_seq, T, nk, nv, dk, dv,
                               c->lin_conv_kernel, 1e-6f);
    if (cst != CM_OK && cst != CM_ERR_UNSUPPORTED) return cst;
    if (cst == CM_ERR_UNSUPPORTED) {
        CM_TRY(be->conv1d_silu(cx, w->big1, w->big0, L->conv_w, w->cu, n_seq, T, conv_dim, c->lin_conv_kernel));
        CM_TRY(be->copy2d(cx, w->q, (int64_t)nk * dk, w->big1, conv_dim, T, (int64_t)nk * dk));
        CM_TRY(be->copy2d(cx, w->k, (int64_t)nk * dk, w->big1 + (int64_t)nk * dk, conv_dim, T, (int64_t)nk * dk));
        CM_TRY(be->copy2d(cx, w->v, (int64_t)nv * dv, w->big1 + 2 * (int64_t)nk * dk, conv_dim, T,
                          (int64_t)nv * dv));
        CM_TRY(be->l2norm(cx, w->q, w->q, T * nk, dk, 1e-6f));
        CM_TRY(be->l2norm(cx, w->k, w->k, T * nk, dk, 1e-6f));
    }
    CM_TRY(be->gdn_gate(cx, w->g, w->beta, w->a, w->b, L->A_log, L->dt_bias, T, nv));
    double t0, t1;
    CM_TRY(mark(m, &t0));
    CM_TRY(be->gated_delta_rule(cx, w->attn, w->q, w->k, w->v, w->g, w->beta, w->cu, n_seq, T, nk, nv, dk, dv,
                                1.0f / sqrtf((float)dk)));
    CM_TRY(mark(m, &t1));
    m->tm.gdn_core_ms += t1 - t0;
    if (m->fused) {
        CM_TRY(be->rmsnorm_gated_bf16(cx, w->act16, w->attn, w->z, L->gdn_norm, T * nv, dv, c->rms_norm_eps));
        return gemm16(m, w->o, w->act16, &L->out_proj, T, D, (int64_t)nv * dv);
    }
    CM_TRY(be->rmsnorm_gated(cx, w->attn, w->attn, w->z, L->gdn_norm, T * nv, dv, c->rms_norm_eps));
    return gemm(m, w->o, w->attn, &L->out_proj, T, D, (int64_t)nv * dv);
}

static cm_status forward_attention(ts_model *m, const ts_layer *L, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    const int64_t        D  = c->hidden_size;
    const int            nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
    const float         *gate = c->attn_output_gate ? w->gate : NULL;
    if (gate) /* q_proj rows interleave [q_h | gate_h] per head */
        CM_TRY(gemm_h(m, w->big0, &L->q_proj, T, 2 * (int64_t)nq * hd, D));
    else
        CM_TRY(gemm_h(m, w->q, &L->q_proj, T, (int64_t)nq * hd, D));
    CM_TRY(gemm_h(m, w->k, &L->k_proj, T, (int64_t)nkv * hd, D));
    CM_TRY(gemm_h(m, w->v, &L->v_proj, T, (int64_t)nkv * hd, D));
    /* fused path: the q/gate split, q/k norms and rope in one pass; the op may refuse a shape
     * (very wide heads), and then the chain runs */
    cm_status cst = CM_ERR_UNSUPPORTED;
    if (m->fused && be->qk_prep)
        cst = be->qk_prep(cx, w->q, gate ? w->gate : NULL, w->k, gate ? w->big0 : w->q, L->q_norm, L->k_norm,
                          w->pos, T, nq, nkv, hd, c->rotary_dim, (float)c->rope_theta, c->rms_norm_eps, 1);
    if (cst != CM_OK && cst != CM_ERR_UNSUPPORTED) return cst;
    if (cst == CM_ERR_UNSUPPORTED) {
        if (gate) {
            CM_TRY(be->copy2d(cx, w->q, hd, w->big0, 2 * (int64_t)hd, T * nq, hd));
            CM_TRY(be->copy2d(cx, w->gate, hd, w->big0 + hd, 2 * (int64_t)hd, T * nq, hd));
        }
        CM_TRY(be->rmsnorm(cx, w->q, w->q, L->q_norm, T * nq, hd, c->rms_norm_eps, 1));
        CM_TRY(be->rmsnorm(cx, w->k, w->k, L->k_norm, T * nkv, hd, c->rms_norm_eps, 1));
        CM_TRY(be->rope(cx, w->q, w->pos, T, nq, hd, c->rotary_dim, (float)c->rope_theta));
        CM_TRY(be->rope(cx, w->k, w->pos, T, nkv, hd, c->rotary_dim, (float)c->rope_theta));
    }
    double t0, t1;
    CM_TRY(mark(m, &t0));
    CM_TRY(be->attention(cx, w->attn, w->q, w->k, w->v, gate, w->cu, n_seq, T, nq, nkv, hd,
                         1.0f / sqrtf((float)hd)));
    CM_TRY(mark(m, &t1));
    m->tm.attn_core_ms += t1 - t0;
    return gemm(m, w->o, w->attn, &L->o_proj, T, D, (int64_t)nq * hd);
}

static cm_status forward_mlp(ts_model *m, const ts_layer *L, int64_t T) {
    const cm_target_cfg *c = &m->cfg;
    ts_ws               *w = &m->ws;
    const int64_t        D = c->hidden_size, I = c->intermediate_size;
    CM_TRY(gemm_h(m, w->big0, &L->gate_proj, T, I, D));
    CM_TRY(gemm_h(m, w->big1, &L->up_proj, T, I, D));
    if (m->fused) {
        CM_TRY(m->be->swiglu_bf16(m->ctx, w->act16, w->big0, w->big1, T * I));
        return gemm16(m, w->o, w->act16, &L->down_proj, T, D, I);
    }
    CM_TRY(m->be->swiglu(m->ctx, w->big2, w->big0, w->big1, T * I));
    return gemm(m, w->o, w->big2, &L->down_proj, T, D, I);
}

cm_status ts_model_forward(ts_model *m, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                           const ts_capture *cap) {
    const cm_target_cfg *c         = &m->cfg;
    const kn_backend    *be        = m->be;
    kn_ctx              *cx        = m->ctx;
    const int64_t        D         = c->hidden_size;
    const int            want_head = cap->final_norm || cap->logits;
    CM_TRY(ts_batch_validate(c, ids, T, cu, n_seq));
    for (int i = 0; i < cap->n_layers; i++)
        if (cap->layers[i] < 0 || cap->layers[i] >= m->n_layers || (i && cap->layers[i] <= cap->layers[i - 1]))
            return CM_FAIL(CM_ERR_INVALID_ARG, "capture layer %d is out of range [0, %d) or out of order",
                           cap->layers[i], m->n_layers);
    if (want_head && !m->has_head)
        return CM_FAIL(CM_ERR_INVALID_ARG, "final norm or logits asked for, but the lm head was not loaded");
    int last = want_head ? m->n_layers - 1 : (cap->n_layers ? cap->layers[cap->n_layers - 1] : -1);

    double tf0, ta, tb;
    CM_TRY(mark(m, &tf0));
    CM_TRY(ws_reserve(m, T, cap->logits != NULL));
    ts_ws   *w   = &m->ws;
    int32_t *pos = w->pos_host;
    for (int s = 0; s < n_seq; s++) /* positions restart at 0 in every packed sequence */
        for (int32_t t = cu[s]; t < cu[s + 1]; t++) pos[t] = t - cu[s];
    CM_TRY(be->upload(cx, w->pos, pos, (size_t)T * sizeof *pos));
    CM_TRY(be->upload(cx, w->ids, ids, (size_t)T * sizeof *ids));
    CM_TRY(be->upload(cx, w->cu, cu, (size_t)(n_seq + 1) * sizeof *cu));

    CM_TRY(be->embed(cx, w->x, w->ids, m->embed.data, m->embed.dtype, T, D));
    int next_cap = 0;
    /* fused path: the MLP output still to be added to x, by the next layer's input norm */
    const float *pending = NULL;
    CM_TRY(mark(m, &ta));
    m->tm.other_ms += ta - tf0;
    for (int i = 0; i <= last; i++) {
        const ts_layer *L   = &m->layers[i];
        const int       gdn = L->type == CM_LAYER_TYPE_LINEAR_ATTENTION;
        m->gemm_acc         = gdn ? &m->tm.gdn_gemm_ms : &m->tm.attn_gemm_ms;
        if (m->fused)
            CM_TRY(be->add_rmsnorm_bf16(cx, w->h16, w->x, pending, L->input_norm, T, D, c->rms_norm_eps, 1));
        else
            CM_TRY(be->rmsnorm(cx, w->h, w->x, L->input_norm, T, D, c->rms_norm_eps, 1));
        pending = NULL;
        if (gdn)
            CM_TRY(forward_gdn(m, L, T, n_seq));
        else
            CM_TRY(forward_attention(m, L, T, n_seq));
        if (!m->fused) CM_TRY(be->add(cx, w->x, w->o, T * D));
        CM_TRY(mark(m, &tb));
        *(gdn ? &m->tm.gdn_ms : &m->tm.attn_ms) += tb - ta;
        *(gdn ? &m->tm.gdn_layers : &m->tm.attn_layers) += 1;
        m->gemm_acc = &m->tm.mlp_gemm_ms;
        if (m->fused) {
            CM_TRY(be->add_rmsnorm_bf16(cx, w->h16, w->x, w->o, L->post_norm, T, D, c->rms_norm_eps, 1));
        } else {
            CM_TRY(be->rmsnorm(cx, w->h, w->x, L->post_norm, T, D, c->rms_norm_eps, 1));
        }
        CM_TRY(forward_mlp(m, L, T));
        /* the fused path leaves the add to the next input norm, unless x is read before it */
        const int x_read = i == last || (next_cap < cap->n_layers && cap->layers[next_cap] == i);
        if (!m->fused || x_read)
            CM_TRY(be->add(cx, w->x, w->o, T * D));
        else
            pending = w->o;
        CM_TRY(mark(m, &ta));
        m->tm.mlp_ms += ta - tb;
        m->tm.mlp_layers++;
        m->gemm_acc = NULL;
        if (next_cap < cap->n_layers && cap->layers[next_cap] == i) {
            if (cap->on_layer)
                CM_TRY(cap->on_layer(cap->user, next_cap++, w->x));
            else if (cap->layer_dev)
                CM_TRY(be->copy2d(cx, cap->layer_dev[next_cap++], D, w->x, D, T, D));
            else
                CM_TRY(be->download(cx, cap->layer_out[next_cap++], w->x, (size_t)(T * D) * sizeof(float)));
            double tc;
            CM_TRY(mark(m, &tc));
            m->tm.other_ms += tc - ta;
            ta = tc;
        }
    }
    if (want_head) {
        CM_TRY(be->rmsnorm(cx, w->h, w->x, m->final_norm, T, D, c->rms_norm_eps, 1));
        if (cap->final_norm) CM_TRY(be->download(cx, cap->final_norm, w->h, (size_t)(T * D) * sizeof(float)));
        if (cap->logits) {
            CM_TRY(gemm(m, w->logits, w->h, &m->lm_head, T, c->vocab_size, D));
            CM_TRY(be->download(cx, cap->logits, w->logits, (size_t)T * (size_t)c->vocab_size * sizeof(float)));
        }
    }
    CM_TRY(be->sync(cx));
    if (m->timing) {
        double tend = 1e3 * cm_now_s();
        m->tm.other_ms += tend - ta;
        m->tm.total_ms += tend - tf0;
        m->tm.forwards++;
        const ts_timing *t = &m->tm;
        CM_LOG_INFO("timing after %d forwards (ms per forward): total %.2f; gdn %d x %.3f (core %.3f, gemm %.3f); "
                    "attention %d x %.3f (core %.3f, gemm %.3f); mlp %d x %.3f (gemm %.3f); other %.2f",
                    t->forwards, t->total_ms / t->forwards, t->gdn_layers / t->forwards,
                    t->gdn_layers ? t->gdn_ms / t->gdn_layers : 0, t->gdn_layers ? t->gdn_core_ms / t->gdn_layers : 0,
                    t->gdn_layers ? t->gdn_gemm_ms / t->gdn_layers : 0, t->attn_layers / t->forwards,
                    t->attn_layers ? t->attn_ms / t->attn_layers : 0,
                    t->attn_layers ? t->attn_core_ms / t->attn_layers : 0,
                    t->attn_layers ? t->attn_gemm_ms / t->attn_layers : 0, t->mlp_layers / t->forwards,
                    t->mlp_layers ? t->mlp_ms / t->mlp_layers : 0, t->mlp_layers ? t->mlp_gemm_ms / t->mlp_layers : 0,
                    t->other_ms / t->forwards);
    }
    return CM_OK;
}

/* The warm-up forward's capture: the last layer, looked at by nobody (the forward runs every
 * layer only up to the last one captured). */
static cm_status warmup_sink(void *user, int i, const float *x) {
    (void)user;
    (void)i;
    (void)x;
    return CM_OK;
}

cm_status ts_model_warmup(ts_model *m, int64_t max_tokens) {
    if (max_tokens < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "warm-up for %lld tokens: expected at least 1", (long long)max_tokens);
    const int64_t T = max_tokens;
    const int     n_seq = (int)((T + 63) / 64);
    int32_t      *ids = calloc((size_t)T, sizeof *ids); /* token 0: every vocabulary has it */
    int32_t      *cu = malloc(((size_t)n_seq + 1) * sizeof *cu);
    cm_status     st = ids && cu ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate a %lld-token warm-up batch", (long long)T);
    for (int s = 0; st == CM_OK && s <= n_seq; s++)
        cu[s] = (int32_t)(64 * (int64_t)s < T ? 64 * (int64_t)s : T);
    if (st == CM_OK)
        st = ws_reserve(m, T, 0);
    if (st == CM_OK && m->n_layers > 0) {
        const int  last = m->n_layers - 1;
        ts_capture cap = {.n_layers = 1, .layers = &last, .on_layer = warmup_sink};
        int        timing = m->timing;
        ts_timing  sums = m->tm; /* the warm-up is not one of the timed forwards */
        m->timing = 0;
        st = ts_model_forward(m, ids, T, cu, n_seq, &cap);
        m->timing = timing;
        m->tm = sums;
    }
    free(ids);
    free(cu);
    return st;
}
