/* target-server/ts_model.c — loading a Qwen3.5/3.6 checkpoint onto a kernel backend, and the
 * checks of a batch (docs/target.md); the forward itself is in ts_forward.c, the FP8 weights'
 * part of the load in ts_load_fp8.c (docs/fp8.md).
 *
 * Weights: GEMM matrices and the embedding stay BF16 when stored BF16 (or when bf16_weights
 * asks for it), else F32; under fp8 the projections are FP8 (as stored, or quantized on load),
 * and without it FP8 tensors are dequantized on load; every small parameter (norms, conv,
 * A_log, dt_bias) is widened to F32 at load, whatever the checkpoint stored. Activations are F32; the backend's GEMM mode
 * decides the precision of matrix products. When the backend's gemm rounds its inputs to
 * bf16 anyway (cuda, --precision bf16) the forward takes the fused path: the producers of
 * GEMM inputs (the norms, swiglu, the gated norm) write them as bf16 themselves, the residual
 * add runs inside the norm that follows it, and the GDN conv, q/k/v split and q/k l2norms are
 * one op: the same products without the conversion passes (TANDEM_TARGET_FUSED=0 turns it
 * off, for comparison; =1 forces it, so the cpu emulates the cuda bf16 path). The workspace
 * is sized for the largest batch seen and reused. */
#include "ts_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_safetensors.h"
#include "cm_time.h"

// ----------------------------------------------------------------------------
// loading

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

static cm_status fill_new(ts_loader *ld, const char *name, void **dst, cm_dtype dt, size_t n) {
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

cm_dtype ts_load_dtype(const ts_loader *ld, cm_dtype stored) {
    return stored == CM_DTYPE_BF16 || ld->bf16_weights ? CM_DTYPE_BF16 : CM_DTYPE_F32;
}

cm_status ts_load_mat_host(ts_loader *ld, const char *name, const void *host, cm_dtype dt, ts_mat_role role,
                           int64_t rows, int64_t cols, ts_mat *out) {
    CM_TRY(upload_new(ld->m, &out->data, host, (size_t)rows * (size_t)cols * cm_dtype_size(dt)));
    out->dtype = dt;
    return ld->fp8 && role == TS_MAT_ROLE_QUANT ? ts_fp8_quantize(ld, name, rows, cols, out) : CM_OK;
}

cm_status ts_load_mat(ts_loader *ld, const char *name, int raw, ts_mat_role role, int64_t rows, int64_t cols,
                      ts_mat *out) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", raw ? "" : ld->prefix, name);
    const int quantize = ld->fp8 && role == TS_MAT_ROLE_QUANT;
    if (ld->random) {
        out->dtype = ld->bf16_weights ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        CM_TRY(fill_new(ld, full, &out->data, out->dtype, (size_t)rows * (size_t)cols));
        return quantize ? ts_fp8_quantize(ld, full, rows, cols, out) : CM_OK;
    }
    const int64_t       shape[2] = {rows, cols};
    const cm_st_tensor *t;
    CM_TRY(cm_st_expect(ld->st, full, 2, shape, &t));
    char scale_name[280];
    snprintf(scale_name, sizeof scale_name, "%s_scale_inv", full);
    const cm_st_tensor *s = cm_st_find(ld->st, scale_name);
    if (role == TS_MAT_ROLE_TABLE) CM_TRY(ts_fp8_refuse_table(t));
    if (t->dtype == CM_DTYPE_F8_E4M3 || s) return ts_fp8_load_stored(ld, full, t, s, rows, cols, role, out);
    if (!cm_dtype_is_float(t->dtype))
        return CM_FAIL(CM_ERR_FORMAT, "tensor '%s' in '%s' has dtype %s; expected a float dtype (BF16, F32)",
                       full, t->file, cm_dtype_name(t->dtype));
    cm_dtype dt    = ts_load_dtype(ld, t->dtype);
    size_t   n     = (size_t)rows * (size_t)cols;
    size_t   bytes = n * cm_dtype_size(dt);
    void    *host  = malloc(bytes ? bytes : 1);
    if (!host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for '%s'", bytes, full);
    cm_status st = cm_st_read(ld->st, full, 2, shape, host, dt);
    if (st == CM_OK) st = ts_load_mat_host(ld, full, host, dt, role, rows, cols, out);
    free(host);
    return st;
}

/* Loads a small parameter of n_dims/shape as F32. */
static cm_status load_vec(ts_loader *ld, const char *name, int n_dims, const int64_t *shape, float **out) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", ld->prefix, name);
    size_t n = 1;
    for (int i = 0; i < n_dims; i++) n *= (size_t)shape[i];
    if (ld->random) return fill_new(ld, full, (void **)out, CM_DTYPE_F32, n);
    const cm_st_tensor *t = cm_st_find(ld->st, full);
    if (t) CM_TRY(ts_fp8_refuse_table(t));
    float *host = malloc(n * sizeof(float));
    if (!host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu floats for '%s'", n, full);
    cm_status st = cm_st_read(ld->st, full, n_dims, shape, host, CM_DTYPE_F32);
    if (st == CM_OK) st = upload_new(ld->m, (void **)out, host, n * sizeof(float));
    free(host);
    return st;
}

static cm_status load_vec1(ts_loader *ld, const char *name, int64_t n, float **out) {
    return load_vec(ld, name, 1, &n, out);
}

static cm_status load_layer(ts_loader *ld, int i, ts_layer *L) {
    const cm_target_cfg *c = &ld->m->cfg;
    const int64_t        D = c->hidden_size, I = c->intermediate_size;
    char                 nm[128];
#define LNAME(s) (snprintf(nm, sizeof nm, "layers.%d.%s", i, (s)), nm)
    L->type = c->layer_types[i];
    CM_TRY(load_vec1(ld, LNAME("input_layernorm.weight"), D, &L->input_norm));
    CM_TRY(load_vec1(ld, LNAME("post_attention_layernorm.weight"), D, &L->post_norm));
    if (cm_target_layer_moe(c, i)) {
        CM_TRY(ts_load_moe(ld, i, L));
    } else {
        CM_TRY(ts_load_mat(ld, LNAME("mlp.gate_proj.weight"), 0, TS_MAT_ROLE_QUANT, I, D, &L->gate_proj));
        CM_TRY(ts_load_mat(ld, LNAME("mlp.up_proj.weight"), 0, TS_MAT_ROLE_QUANT, I, D, &L->up_proj));
        CM_TRY(ts_load_mat(ld, LNAME("mlp.down_proj.weight"), 0, TS_MAT_ROLE_QUANT, D, I, &L->down_proj));
    }
    if (L->type == CM_LAYER_TYPE_LINEAR_ATTENTION) {
        const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
        const int64_t conv_dim = 2 * nk * dk + nv * dv;
        const int64_t conv_shape[3] = {conv_dim, 1, c->lin_conv_kernel};
        if (c->family == CM_TARGET_FAMILY_QWEN3_NEXT) {
            CM_TRY(ts_load_next_gdn(ld, i, L));
        } else {
            CM_TRY(ts_load_mat(ld, LNAME("linear_attn.in_proj_qkv.weight"), 0, TS_MAT_ROLE_QUANT, conv_dim, D,
                               &L->in_qkv));
            CM_TRY(ts_load_mat(ld, LNAME("linear_attn.in_proj_z.weight"), 0, TS_MAT_ROLE_QUANT, nv * dv, D, &L->in_z));
            CM_TRY(ts_load_mat(ld, LNAME("linear_attn.in_proj_b.weight"), 0, TS_MAT_ROLE_GEMM, nv, D, &L->in_b));
            CM_TRY(ts_load_mat(ld, LNAME("linear_attn.in_proj_a.weight"), 0, TS_MAT_ROLE_GEMM, nv, D, &L->in_a));
        }
        CM_TRY(ts_load_mat(ld, LNAME("linear_attn.out_proj.weight"), 0, TS_MAT_ROLE_QUANT, D, nv * dv, &L->out_proj));
        CM_TRY(load_vec(ld, LNAME("linear_attn.conv1d.weight"), 3, conv_shape, &L->conv_w));
        CM_TRY(load_vec1(ld, LNAME("linear_attn.A_log"), nv, &L->A_log));
        CM_TRY(load_vec1(ld, LNAME("linear_attn.dt_bias"), nv, &L->dt_bias));
        CM_TRY(load_vec1(ld, LNAME("linear_attn.norm.weight"), dv, &L->gdn_norm));
    } else {
        const int64_t nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
        const int64_t q_rows = nq * hd * (c->attn_output_gate ? 2 : 1);
        CM_TRY(ts_load_mat(ld, LNAME("self_attn.q_proj.weight"), 0, TS_MAT_ROLE_QUANT, q_rows, D, &L->q_proj));
        CM_TRY(ts_load_mat(ld, LNAME("self_attn.k_proj.weight"), 0, TS_MAT_ROLE_QUANT, nkv * hd, D, &L->k_proj));
        CM_TRY(ts_load_mat(ld, LNAME("self_attn.v_proj.weight"), 0, TS_MAT_ROLE_QUANT, nkv * hd, D, &L->v_proj));
        CM_TRY(ts_load_mat(ld, LNAME("self_attn.o_proj.weight"), 0, TS_MAT_ROLE_QUANT, D, nq * hd, &L->o_proj));
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
                   "missing tensor 'model.language_model.embed_tokens.weight' (the ForConditionalGeneration "
                   "layout) or 'model.embed_tokens.weight' (the ForCausalLM layout) in '%s': is this a Qwen3.5/3.6 or "
                   "Qwen3-Next checkpoint?",
                   dir);
}

cm_status ts_model_load(ts_model **out, const ts_model_config *mc) {
    *out = NULL;
    cm_status st;
    cm_st       *sts   = NULL;
    cm_quant_cfg quant = {0};
    ts_model    *m     = calloc(1, sizeof *m);
    if (!m) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the model");
    m->be  = mc->backend;
    m->ctx = mc->ctx;
    CM_TRY_GOTO(ts_model_bind(m), st, fail);
    CM_TRY_GOTO(cm_target_cfg_load(&m->cfg, mc->dir), st, fail);
    const cm_target_cfg *c = &m->cfg;
    if (mc->n_layers > c->n_layers) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "%d layers asked for, but '%s' has %d", mc->n_layers, mc->dir, c->n_layers);
        goto fail;
    }
    m->n_layers    = mc->n_layers < 0 ? c->n_layers : mc->n_layers;
    m->first_layer = mc->first_layer;
    if (m->first_layer < 0 || m->first_layer >= m->n_layers) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "first layer %d is outside the %d layers asked for of '%s'", m->first_layer,
                     m->n_layers, mc->dir);
        goto fail;
    }
    CM_TRY_GOTO(cm_quant_cfg_load(&quant, mc->dir), st, fail);
    ts_loader ld = {.m = m, .dir = mc->dir, .bf16_weights = mc->bf16_weights, .fp8 = mc->fp8,
                    .random = mc->init_random, .seed = mc->seed, .quant = &quant, .prefix = "model.language_model."};
    if (mc->fp8) CM_TRY_GOTO(ts_fp8_check_backend(m), st, fail);
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
        CM_TRY_GOTO(ts_fp8_scan(&ld, m->n_layers, mc->load_head && !c->tie_word_embeddings), st, fail);
    }

    const int64_t D = c->hidden_size, V = c->vocab_size;
    const int need_embed = m->first_layer == 0 || (mc->load_head && c->tie_word_embeddings); /* tied: the head */
    if (need_embed)
        CM_TRY_GOTO(ts_load_mat(&ld, "embed_tokens.weight", 0, TS_MAT_ROLE_TABLE, V, D, &m->embed), st, fail);
    m->layers = calloc((size_t)m->n_layers, sizeof *m->layers);
    if (!m->layers) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d layers", m->n_layers);
        goto fail;
    }
    for (int i = m->first_layer; i < m->n_layers; i++) CM_TRY_GOTO(load_layer(&ld, i, &m->layers[i]), st, fail);
    if (mc->load_head) {
        CM_TRY_GOTO(load_vec1(&ld, "norm.weight", D, &m->final_norm), st, fail);
        if (c->tie_word_embeddings)
            m->lm_head = m->embed;
        else
            CM_TRY_GOTO(ts_load_mat(&ld, "lm_head.weight", 1, TS_MAT_ROLE_TABLE, V, D, &m->lm_head), st, fail);
        m->has_head = 1;
    }
    cm_st_destroy(&sts);
    if (mc->init_random) CM_TRY_GOTO(m->be->sync(m->ctx), st, fail); /* the fills ran */
    if (m->first_layer > 0)
        CM_LOG_INFO("%s '%s': %s, layers %d to %d of %d, hidden %d, backend %s%s",
                    mc->init_random ? "random weights for" : "loaded", mc->dir, c->model_type, m->first_layer,
                    m->n_layers - 1, c->n_layers, c->hidden_size, m->be->name, m->has_head ? ", with lm head" : "");
    else
        CM_LOG_INFO("%s '%s': %s, %d of %d layers, hidden %d, vocab %d, backend %s%s",
                    mc->init_random ? "random weights for" : "loaded", mc->dir, c->model_type, m->n_layers,
                    c->n_layers, c->hidden_size, c->vocab_size, m->be->name, m->has_head ? ", with lm head" : "");
    if (ld.n_fp8_stored || ld.n_fp8_quantized || ld.n_fp8_dequantized)
        CM_LOG_INFO("FP8 weights (docs/fp8.md): %d matrices as stored, %d quantized on load, %d dequantized to %s",
                    ld.n_fp8_stored, ld.n_fp8_quantized, ld.n_fp8_dequantized, mc->bf16_weights ? "bf16" : "f32");
    if (ld.n_fp8_quantized && !mc->init_random)
        CM_LOG_WARN("'%s' is served with FP8 rounding of its projections, but its weights fingerprint (the identity "
                    "trainers check) is the checkpoint's as stored: a trainer cannot tell these hidden states from "
                    "the unquantized target's",
                    mc->dir);
    cm_quant_cfg_release(&quant);
    /* TANDEM_TARGET_FUSED: unset = the fused path where gemm rounds its inputs anyway, 0 = never,
     * 1 = also elsewhere (on the cpu it then rounds the GEMM inputs as cuda bf16 does) */
    const char *fenv     = getenv("TANDEM_TARGET_FUSED");
    const int   has_ops  = m->be->gemm_bf16in && m->be->add_rmsnorm_bf16 && m->be->rmsnorm_gated_bf16 &&
                        m->be->swiglu_bf16 && m->be->gdn_conv_qkv;
    const int   rounds   = m->be->gemm_rounds_input && m->be->gemm_rounds_input(m->ctx);
    m->fused = has_ops && (fenv && strcmp(fenv, "1") == 0 ? 1 : fenv && strcmp(fenv, "0") == 0 ? 0 : rounds);
    /* TANDEM_TARGET_RESIDUAL_GEMM: unset or 1 = on the fused path, the output projections add
     * their product onto the residual stream in the GEMM (gemm_bf16in_acc, gemm_fp8q_acc) instead
     * of writing it for the next norm to add; 0 = never (the same values: measured beside) */
    const char *renv = getenv("TANDEM_TARGET_RESIDUAL_GEMM");
    m->residual_gemm = m->fused && !(renv && strcmp(renv, "0") == 0);
    /* TANDEM_TARGET_BF16_PRODUCTS: unset or 1 = on the fused path, the dense MLP's gate and up
     * projections write bf16 (as a bf16 Linear does) and swiglu reads that, half the bytes of
     * their F32 products; 0 = F32 products (for measuring one beside the other) */
    const char *penv = getenv("TANDEM_TARGET_BF16_PRODUCTS");
    m->bf16_products = m->fused && m->be->matmul && m->be->swiglu_typed && !(penv && strcmp(penv, "0") == 0);
    /* TANDEM_MOE_GEMM: unset or "grouped" = the experts' GEMMs in one moe_gemm call where it
     * applies, "loop" = one GEMM per expert (for measuring one beside the other) */
    const char *genv = getenv("TANDEM_MOE_GEMM");
    m->moe_grouped   = !(genv && strcmp(genv, "loop") == 0);
    if (genv && m->moe_grouped && strcmp(genv, "grouped") != 0)
        CM_LOG_WARN("TANDEM_MOE_GEMM='%s' is neither 'grouped' nor 'loop'; the experts' GEMMs run grouped", genv);
    ts_moe_log_plan(m);
    const char *tenv = getenv("TANDEM_LAYER_TIMING");
    if (tenv && strcmp(tenv, "1") == 0) ts_model_set_timing(m, 1);
    *out = m;
    return CM_OK;
fail:
    cm_st_destroy(&sts);
    cm_quant_cfg_release(&quant);
    ts_model_destroy(&m);
    return st;
}

void ts_model_destroy(ts_model **pm) {
    ts_model *m = pm ? *pm : NULL;
    if (!m) return;
    const kn_backend *be = m->be;
    ts_model_bind(m); /* frees on the model's device */
    ts_ws_release(m);
    if (m->layers) {
        for (int i = 0; i < m->n_layers; i++) {
            ts_layer *L     = &m->layers[i];
            void     *p[]  = {L->input_norm, L->post_norm, L->conv_w, L->A_log, L->dt_bias, L->gdn_norm,
                              L->q_norm, L->k_norm};
            ts_mat   *w[]  = {&L->gate_proj, &L->up_proj, &L->down_proj, &L->in_qkv, &L->in_z, &L->in_b,
                              &L->in_a, &L->out_proj, &L->q_proj, &L->k_proj, &L->v_proj, &L->o_proj};
            for (size_t j = 0; j < sizeof p / sizeof p[0]; j++) be->free(m->ctx, p[j]);
            for (size_t j = 0; j < sizeof w / sizeof w[0]; j++) ts_mat_free(m, w[j]);
            ts_moe_free(m, L);
        }
        free(m->layers);
    }
    void *head[] = {m->head_ids, m->head_am, m->head_lab, m->head_h, m->head_ce, m->head_logits};
    for (size_t j = 0; j < sizeof head / sizeof head[0]; j++) be->free(m->ctx, head[j]);
    if (m->lm_head.data != m->embed.data) ts_mat_free(m, &m->lm_head);
    ts_mat_free(m, &m->embed);
    be->free(m->ctx, m->final_norm);
    free(m);
    *pm = NULL;
}

const cm_target_cfg *ts_model_cfg(const ts_model *m) { return &m->cfg; }

int ts_model_n_loaded_layers(const ts_model *m) { return m->n_layers; }

int ts_model_first_layer(const ts_model *m) { return m->first_layer; }

int ts_model_has_head(const ts_model *m) { return m->has_head; }

cm_status ts_model_bind(const ts_model *m) {
    return m->ctx && m->be->ctx_bind ? m->be->ctx_bind(m->ctx) : CM_OK;
}

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

