/* target-server/ts_cache.c — the decoding cache of the target (docs/target.md, "Decoding"): per
 * sequence slot, what a forward over its earlier tokens leaves behind, so that the next tokens
 * cost a forward over themselves alone. Attention layers keep every position's keys and values;
 * GDN layers keep their last K − 1 conv inputs and their recurrent state, which is all they carry
 * from the past. A verification step must not move the GDN states past its accepted prefix,
 * which is known only after its logits: the step keeps its GDN inputs (conv input, k, v, g,
 * beta; a few hundred KB per token at the 27B shape) and ts_cache_commit then advances the
 * states by the accepted tokens alone. Keeping the states after every position instead would
 * cost dk·dv floats per v-head per position (3 MB per GDN layer per token at the 27B shape), so
 * the inputs are kept and the short recurrence is run again. Attention needs no roll-back: the
 * keys past the committed length are overwritten by the next step. */
#include "ts_model_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

/* The floats of one layer's buffers: kv for an attention layer's keys (as many for values),
 * conv/state/keep for a GDN layer's conv state, recurrent state and kept inputs per step token. */
typedef struct cache_sizes {
    int64_t kv, conv, state, keep_x, keep_k, keep_v, keep_nv;
} cache_sizes;

static cache_sizes sizes_of(const cm_target_cfg *c, int n_slots, int64_t max_len, int64_t max_step) {
    const int64_t nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t C  = 2 * nk * dk + nv * dv;
    cache_sizes   z  = {0};
    z.kv             = (int64_t)n_slots * max_len * c->n_kv_heads * c->head_dim;
    z.conv           = (int64_t)n_slots * (c->lin_conv_kernel - 1) * C;
    z.state          = (int64_t)n_slots * nv * dk * dv;
    z.keep_x         = max_step * C;
    z.keep_k         = max_step * nk * dk;
    z.keep_v         = max_step * nv * dv;
    z.keep_nv        = max_step * nv;
    return z;
}

size_t ts_cache_bytes(const cm_target_cfg *c, int n_slots, int64_t max_len, int64_t max_step) {
    const cache_sizes z = sizes_of(c, n_slots, max_len, max_step);
    size_t            floats = 0;
    for (int i = 0; i < c->n_layers; i++) {
        if (c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION)
            floats += (size_t)(z.conv + z.state + z.keep_x + z.keep_k + z.keep_v + 2 * z.keep_nv);
        else
            floats += 2 * (size_t)z.kv;
    }
    return floats * sizeof(float) + (size_t)(4 * n_slots + 1) * sizeof(int32_t);
}

int     ts_cache_slots(const ts_cache *c) { return c->n_slots; }
int64_t ts_cache_max_len(const ts_cache *c) { return c->max_len; }

void ts_cache_destroy(ts_cache **pc) {
    ts_cache *c = pc ? *pc : NULL;
    if (!c) return;
    const kn_backend *be = c->m->be;
    kn_ctx           *cx = c->m->ctx;
    ts_model_bind(c->m); /* frees on the model's device */
    float **per[] = {c->kc, c->vc, c->conv, c->state, c->sx, c->sk, c->sv, c->sg, c->sb};
    for (size_t j = 0; j < sizeof per / sizeof per[0]; j++) {
        if (!per[j]) continue;
        for (int i = 0; i < c->m->n_layers; i++) be->free(cx, per[j][i]);
        free(per[j]);
    }
    void *idx[] = {c->d_slots, c->d_base, c->d_adv, c->d_cu};
    for (size_t j = 0; j < sizeof idx / sizeof idx[0]; j++) be->free(cx, idx[j]);
    free(c->pend_cu);
    free(c);
    *pc = NULL;
}

static cm_status alloc_f(ts_cache *c, float **p, int64_t n) {
    if (n <= 0) return CM_OK;
    return c->m->be->alloc(c->m->ctx, (void **)p, (size_t)n * sizeof(float));
}

cm_status ts_cache_create(ts_model *m, int n_slots, int64_t max_len, int64_t max_step, ts_cache **out) {
    *out = NULL;
    const cm_target_cfg *cfg = &m->cfg;
    const kn_backend    *be  = m->be;
    if (n_slots < 1 || max_len < 1 || max_step < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a decoding cache needs ≥ 1 slot, length and step tokens (got %d, %lld, %lld)",
                       n_slots, (long long)max_len, (long long)max_step);
    CM_TRY(ts_model_bind(m));
    if (!be->kv_cache_write || !be->attention_cached || !be->conv1d_silu_cached || !be->gdn_cached || !be->lm_ce)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "the %s backend has no decoding ops (kv_cache_write, attention_cached, "
                                           "conv1d_silu_cached, gdn_cached, lm_ce)",
                       be->name);
    ts_cache *c = calloc(1, sizeof *c);
    if (!c) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a decoding cache");
    c->m        = m;
    c->n_slots  = n_slots;
    c->max_len  = max_len;
    c->max_step = max_step;
    const int nl = m->n_layers;
    float ***per[] = {&c->kc, &c->vc, &c->conv, &c->state, &c->sx, &c->sk, &c->sv, &c->sg, &c->sb};
    cm_status st = CM_OK;
    for (size_t j = 0; j < sizeof per / sizeof per[0] && st == CM_OK; j++)
        if (!(*per[j] = calloc((size_t)nl, sizeof(float *))))
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the cache's layer table");
    c->pend_cu = calloc((size_t)n_slots + 1, sizeof *c->pend_cu);
    if (st == CM_OK && !c->pend_cu) st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the cache's step table");
    const cache_sizes z = sizes_of(cfg, n_slots, max_len, max_step);
    for (int i = m->first_layer; i < nl && st == CM_OK; i++) { /* a stage's layers only */
        if (cfg->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION) {
            st = alloc_f(c, &c->conv[i], z.conv);
            if (st == CM_OK) st = alloc_f(c, &c->state[i], z.state);
            if (st == CM_OK) st = alloc_f(c, &c->sx[i], z.keep_x);
            if (st == CM_OK) st = alloc_f(c, &c->sk[i], z.keep_k);
            if (st == CM_OK) st = alloc_f(c, &c->sv[i], z.keep_v);
            if (st == CM_OK) st = alloc_f(c, &c->sg[i], z.keep_nv);
            if (st == CM_OK) st = alloc_f(c, &c->sb[i], z.keep_nv);
        } else {
            st = alloc_f(c, &c->kc[i], z.kv);
            if (st == CM_OK) st = alloc_f(c, &c->vc[i], z.kv);
        }
    }
    if (st == CM_OK) st = be->alloc(m->ctx, (void **)&c->d_slots, (size_t)n_slots * 4);
    if (st == CM_OK) st = be->alloc(m->ctx, (void **)&c->d_base, (size_t)n_slots * 4);
    if (st == CM_OK) st = be->alloc(m->ctx, (void **)&c->d_adv, (size_t)n_slots * 4);
    if (st == CM_OK) st = be->alloc(m->ctx, (void **)&c->d_cu, ((size_t)n_slots + 1) * 4);
    if (st != CM_OK) {
        const size_t bytes = ts_cache_bytes(cfg, n_slots, max_len, max_step);
        ts_cache_destroy(&c);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a decoding cache of %.1f MB (%d sequences × %lld tokens): %s; "
                                     "ask for fewer sessions or a shorter length",
                       (double)bytes / 1e6, n_slots, (long long)max_len, cm_last_error());
    }
    *out = c;
    return CM_OK;
}

cm_status ts_cache_clear(ts_cache *c, int slot) {
    if (slot < 0 || slot >= c->n_slots)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cache slot %d is outside [0, %d)", slot, c->n_slots);
    CM_TRY(ts_model_bind(c->m));
    const cm_target_cfg *cfg = &c->m->cfg;
    const cache_sizes    z   = sizes_of(cfg, 1, c->max_len, c->max_step);
    for (int i = 0; i < c->m->n_layers; i++)
        if (c->conv[i]) { /* keys and values need no clearing: positions past the length are never read */
            CM_TRY(c->m->be->zero(c->m->ctx, c->conv[i] + (int64_t)slot * z.conv, (size_t)z.conv * sizeof(float)));
            CM_TRY(c->m->be->zero(c->m->ctx, c->state[i] + (int64_t)slot * z.state, (size_t)z.state * sizeof(float)));
        }
    return CM_OK;
}

/* The step's sequences against the cache: slots distinct and in range, lengths within max_len,
 * n_adv within the sequence, a kept step within max_step tokens. */
static cm_status step_check(const ts_cache *c, const ts_cache_step *st, int64_t T, const int32_t *cu) {
    if (st->n_seq < 1 || st->n_seq > c->n_slots)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a cached forward of %d sequences; the cache holds 1 to %d", st->n_seq,
                       c->n_slots);
    for (int s = 0; s < st->n_seq; s++) {
        const int32_t len = cu[s + 1] - cu[s];
        if (st->slots[s] < 0 || st->slots[s] >= c->n_slots)
            return CM_FAIL(CM_ERR_INVALID_ARG, "sequence %d's slot %d is outside [0, %d)", s, st->slots[s], c->n_slots);
        for (int r = 0; r < s; r++)
            if (st->slots[r] == st->slots[s])
                return CM_FAIL(CM_ERR_INVALID_ARG, "sequences %d and %d share slot %d", r, s, st->slots[s]);
        if (st->base[s] < 0 || (int64_t)st->base[s] + len > c->max_len)
            return CM_FAIL(CM_ERR_INVALID_ARG, "sequence %d would reach %lld tokens; the cache holds %lld per sequence",
                           s, (long long)st->base[s] + len, (long long)c->max_len);
        if (st->n_adv && (st->n_adv[s] < 0 || st->n_adv[s] > len))
            return CM_FAIL(CM_ERR_INVALID_ARG, "sequence %d advances by %d of its %d tokens", s, st->n_adv[s], len);
    }
    if (!st->n_adv && T > c->max_step)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a step to verify of %lld tokens; the cache keeps at most %lld",
                       (long long)T, (long long)c->max_step);
    return CM_OK;
}

cm_status ts_model_forward_cached(ts_model *m, ts_cache *c, const ts_cache_step *st, const int32_t *ids, int64_t T,
                                  const int32_t *cu, const ts_capture *cap) {
    if (c->m != m) return CM_FAIL(CM_ERR_INVALID_ARG, "the decoding cache belongs to another model");
    CM_TRY(ts_batch_validate(&m->cfg, ids, T, cu, st->n_seq));
    CM_TRY(step_check(c, st, T, cu));
    CM_TRY(ts_model_bind(m));
    const kn_backend *be = m->be;
    const size_t      n4 = (size_t)st->n_seq * 4;
    CM_TRY(be->upload(m->ctx, c->d_slots, st->slots, n4));
    CM_TRY(be->upload(m->ctx, c->d_base, st->base, n4));
    if (st->n_adv) CM_TRY(be->upload(m->ctx, c->d_adv, st->n_adv, n4));
    CM_TRY(be->upload(m->ctx, c->d_cu, cu, n4 + 4));
    c->pending = 0; /* a new step replaces whatever was kept */
    m->cache   = c;
    m->step    = st;
    cm_status rc = ts_forward_run(m, ids, T, cu, st->n_seq, cap);
    m->cache = NULL;
    m->step  = NULL;
    if (rc != CM_OK) return rc;
    if (!st->n_adv) {
        c->pending    = 1;
        c->pend_n_seq = st->n_seq;
        c->pend_T     = T;
        memcpy(c->pend_cu, cu, n4 + 4);
    }
    return CM_OK;
}

cm_status ts_cache_commit(ts_cache *c, const int32_t *n_adv) {
    if (!c->pending)
        return CM_FAIL(CM_ERR_INVALID_ARG, "nothing to commit: the last cached forward advanced its states itself, or "
                                           "was committed already");
    CM_TRY(ts_model_bind(c->m));
    const int n_seq = c->pend_n_seq;
    for (int s = 0; s < n_seq; s++)
        if (n_adv[s] < 0 || n_adv[s] > c->pend_cu[s + 1] - c->pend_cu[s])
            return CM_FAIL(CM_ERR_INVALID_ARG, "sequence %d commits %d of its %d tokens", s, n_adv[s],
                           c->pend_cu[s + 1] - c->pend_cu[s]);
    ts_model            *m   = c->m;
    const kn_backend    *be  = m->be;
    kn_ctx              *cx  = m->ctx;
    const cm_target_cfg *cfg = &m->cfg;
    const int nk = cfg->lin_n_k_heads, nv = cfg->lin_n_v_heads, dk = cfg->lin_k_head_dim, dv = cfg->lin_v_head_dim;
    const int64_t C = 2 * (int64_t)nk * dk + (int64_t)nv * dv, T = c->pend_T;
    CM_TRY(be->upload(cx, c->d_adv, n_adv, (size_t)n_seq * 4));
    for (int i = 0; i < m->n_layers; i++) {
        if (!c->conv[i]) continue;
        CM_TRY(be->conv1d_silu_cached(cx, NULL, c->sx[i], m->layers[i].conv_w, c->conv[i], c->d_slots, c->d_adv,
                                      c->d_cu, n_seq, T, C, cfg->lin_conv_kernel));
        CM_TRY(be->gdn_cached(cx, NULL, NULL, c->sk[i], c->sv[i], c->sg[i], c->sb[i], c->state[i], c->d_slots,
                              c->d_adv, c->d_cu, n_seq, T, nk, nv, dk, dv, 1.0f / sqrtf((float)dk)));
    }
    c->pending = 0;
    return be->sync(cx);
}
