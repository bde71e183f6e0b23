/* drafter-trainer/model/dt_model_load.c — parameters from the Qwen3 init or a drafter checkpoint, and the
 * borrowed frozen embedding and LM head. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_pool.h"
#include "cm_rng.h"
#include "cm_safetensors.h"

// ----------------------------------------------------------------------------
// initialisation and loading

/* The random initialisation of one parameter, in blocks of INIT_BLOCK values with their own
 * streams, filled on a pool (the 27B drafter's 1.7 G normal draws took about a minute on one
 * thread). */
enum { INIT_BLOCK = 1 << 20 };

typedef struct init_job {
    const dt_model *m;
    uint64_t        seed;
    int             i; /* the parameter */
    float          *host;
} init_job;

static cm_status init_block(void *ctx, int worker, int64_t b) {
    (void)worker;
    const init_job *jb = ctx;
    const dt_param *p = &jb->m->params[jb->i];
    const int       j = jb->i >= P_LAYER0 && jb->i < jb->m->p_norm ? (jb->i - P_LAYER0) % jb->m->n_lp : -1;
    const int64_t   e0 = b * INIT_BLOCK, e1 = e0 + INIT_BLOCK < p->numel ? e0 + INIT_BLOCK : p->numel;
    float          *h = jb->host;
    if (j == LP_ACONV_BASE || j == LP_MCONV_BASE) { /* identity: tap 0 = 1 on both sides */
        const int64_t Kc = p->shape[1], D = p->shape[2];
        for (int64_t e = e0; e < e1; e++)
            h[e] = (e / D) % Kc == 0 ? 1.0f : 0.0f;
    } else if (j == LP_ACONV_PROJ || j == LP_MCONV_PROJ) { /* so an untrained DFlash2 is a DFlash */
        for (int64_t e = e0; e < e1; e++)
            h[e] = 0.0f;
    } else if (p->n_dims != 2) {
        for (int64_t e = e0; e < e1; e++)
            h[e] = 1.0f;
    } else {
        cm_rng rng;
        cm_rng_seed_stream(&rng, jb->seed, (uint64_t)jb->i, (uint64_t)b);
        for (int64_t e = e0; e < e1; e++)
            h[e] = (float)(0.02 * cm_rng_normal(&rng));
    }
    return CM_OK;
}

cm_status dt_model_init_random(dt_model *m, uint64_t seed) {
    m->w16_written = 0; /* new weights: no copy of the old ones is current */
    int64_t widest = 0;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].numel > widest)
            widest = m->params[i].numel;
    init_job jb = {.m = m, .seed = seed, .host = malloc((size_t)widest * sizeof(float))};
    if (!jb.host)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld floats for the initialisation", (long long)widest);
    cm_pool  *pool = NULL;
    int       failed = 0;
    cm_status st = cm_pool_create(&pool, cm_pool_cpu_threads(32), "the drafter's initialisation");
    for (int i = 0; i < m->n_params && st == CM_OK; i++) {
        const dt_param *p = &m->params[i];
        jb.i = i;
        st = cm_pool_run(pool, init_block, &jb, (p->numel + INIT_BLOCK - 1) / INIT_BLOCK, &failed);
        if (st == CM_OK)
            st = m->be->upload(m->ctx, p->data, jb.host, (size_t)p->numel * sizeof(float));
    }
    cm_pool_destroy(&pool);
    free(jb.host);
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
    DT_SAME(kind, "the drafter kind (0 DFlash, 1 DFlash2)")
    DT_SAME(conv_kernel_size, "conv_kernel_size")
    DT_SAME(conv_group_size, "conv_group_size")
    DT_SAME(selector_rank, "selector_rank")
    DT_SAME(selector_top_k, "selector_top_k")
#undef DT_SAME
    for (int l = 0; l < want->n_layers; l++) {
        if (want->layer_types[l] != got->layer_types[l])
            return CM_FAIL(CM_ERR_INVALID_ARG, "'%s/config.json': layer_types[%d] differs from the model's",
                           dir, l);
        if (cm_drafter_layer_causal(want, l) != cm_drafter_layer_causal(got, l))
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "'%s/config.json': layer %d is %scausal (is_causal %s) but the model's is %scausal",
                           dir, l, cm_drafter_layer_causal(got, l) ? "" : "non-",
                           got->is_causal == CM_CAUSAL_BY_LAYER_TYPE ? "absent"
                           : got->is_causal == CM_CAUSAL_ALL        ? "true"
                                                                    : "false",
                           cm_drafter_layer_causal(want, l) ? "" : "non-");
    }
    for (int i = 0; i < want->n_taps; i++)
        if (want->target_layer_ids[i] != got->target_layer_ids[i])
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "'%s/config.json': target_layer_ids[%d] is %d, the model's is %d", dir, i,
                           got->target_layer_ids[i], want->target_layer_ids[i]);
    return CM_OK;
}

cm_status dt_model_load(dt_model *m, const char *dir) {
    m->w16_written = 0;
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
    if (D != m->cfg.hidden_size || V != m->cfg.vocab_size)
        return D != m->cfg.hidden_size
                   ? CM_FAIL(CM_ERR_INVALID_ARG,
                             "the target embedding is %lld wide but the drafter's hidden_size is %d; a DFlash "
                             "drafter must have its target's hidden size",
                             (long long)D, m->cfg.hidden_size)
                   : CM_FAIL(CM_ERR_INVALID_ARG,
                             "the target embedding has %lld rows but the drafter's vocab_size is %d; set "
                             "vocab_size to the target's",
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

/* A frozen [V, D] matrix as dt_model_set_frozen takes it: F32 or BF16 in place (borrowed from
 * the mmapped checkpoint), any other float dtype widened into *owned. */
static cm_status frozen_matrix(const cm_st *st, const cm_st_tensor *t, const void **data, cm_dtype *dt,
                               float **owned) {
    if (t->dtype == CM_DTYPE_F32 || t->dtype == CM_DTYPE_BF16) {
        *data = t->data;
        *dt = t->dtype;
        return CM_OK;
    }
    const size_t n = (size_t)t->shape[0] * (size_t)t->shape[1];
    if (!(*owned = malloc(n * sizeof **owned)))
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu floats for '%s'", n, t->name);
    CM_TRY(cm_st_read(st, t->name, 2, t->shape, *owned, CM_DTYPE_F32));
    *data = *owned;
    *dt = CM_DTYPE_F32;
    return CM_OK;
}

cm_status dt_model_set_frozen_from(dt_model *m, const cm_st *target, int64_t V, int64_t D, int tied,
                                   float *owned[2]) {
    const int64_t       shape[2] = {V, D};
    const cm_st_tensor *emb = NULL, *head = NULL;
    const char         *key = cm_st_find(target, "model.language_model.embed_tokens.weight")
                                  ? "model.language_model.embed_tokens.weight"
                                  : "model.embed_tokens.weight";
    CM_TRY(cm_st_expect(target, key, 2, shape, &emb));
    if (tied && !cm_st_find(target, "lm_head.weight"))
        head = emb;
    else
        CM_TRY(cm_st_expect(target, "lm_head.weight", 2, shape, &head));
    const void *e = NULL, *h = NULL;
    cm_dtype    edt = CM_DTYPE_F32, hdt = CM_DTYPE_F32;
    CM_TRY(frozen_matrix(target, emb, &e, &edt, &owned[0]));
    if (head == emb) {
        h = e;
        hdt = edt;
    } else {
        CM_TRY(frozen_matrix(target, head, &h, &hdt, &owned[1]));
    }
    return dt_model_set_frozen(m, e, edt, h, hdt, V, D);
}
