/* target-server/ts_split.c — a target over several contexts as pipeline stages (ts_split.h). */
#include "ts_split.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ts_split {
    const kn_backend *be;
    kn_ctx           *ctx[TS_SPLIT_MAX_STAGES]; /* borrowed */
    int       n;
    int       bounds[TS_SPLIT_MAX_STAGES + 1];
    ts_model *stage[TS_SPLIT_MAX_STAGES];
    pthread_mutex_t lock[TS_SPLIT_MAX_STAGES]; /* one pack in a stage at a time */
    ts_split_handover *ho;                     /* ts_split_forward's own */
    int       has_head;
};

struct ts_split_handover {
    ts_split *s;
    float    *dx[TS_SPLIT_MAX_STAGES]; /* stage i's input (i ≥ 1) [cap], on stage i's context */
    int64_t   cap;                     /* floats */
};

struct ts_split_cache {
    ts_split          *s;
    ts_cache          *c[TS_SPLIT_MAX_STAGES]; /* stage i's, on its context */
    ts_split_handover *ho;
};

/* A layer's weight count: its mixer and its MLP (dense or sparse), the norms left out. */
static double layer_weights(const cm_target_cfg *c, int i) {
    const double D = c->hidden_size;
    double       w;
    if (c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION) {
        const double nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
        w = D * (2 * nk * dk + nv * dv) + D * nv * dv * 2 + 2 * D * nv;
    } else {
        const double nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
        w = D * nq * hd * (c->attn_output_gate ? 2 : 1) + 2 * D * nkv * hd + D * nq * hd;
    }
    if (cm_target_layer_moe(c, i))
        w += 3 * D * c->moe_intermediate_size * (double)c->n_experts + 3 * D * c->shared_expert_intermediate_size +
             D * c->n_experts + D;
    else
        w += 3 * D * c->intermediate_size;
    return w;
}

void ts_split_even(const cm_target_cfg *cfg, int n_layers, int n, int *bounds) {
    double total = 0, acc = 0;
    for (int i = 0; i < n_layers; i++) total += layer_weights(cfg, i);
    bounds[0] = 0;
    int s = 1;
    for (int i = 0; i < n_layers && s < n; i++) {
        acc += layer_weights(cfg, i);
        /* stage s starts after the layer that takes the sum past s/n of the weights, leaving every
           later stage at least one layer */
        if ((acc >= total * s / n && i + 1 > bounds[s - 1]) || n_layers - (i + 1) == n - s) bounds[s++] = i + 1;
    }
    bounds[n] = n_layers;
}

/* The stage's device current on this thread (contexts on several GPUs, one thread). */
static cm_status bind(const kn_backend *be, kn_ctx *ctx) { return be->ctx_bind ? be->ctx_bind(ctx) : CM_OK; }

// ----------------------------------------------------------------------------
// hand-overs: each stage's input buffer on that stage's context, touched under the stage's lock
// (allocating and freeing use the context, which another pack may be using)

cm_status ts_split_handover_create(ts_split *s, ts_split_handover **out) {
    if (!(*out = calloc(1, sizeof **out))) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a stage hand-over");
    (*out)->s = s;
    return CM_OK;
}

static void handover_free(ts_split_handover *h) {
    ts_split *s = h->s;
    for (int i = 1; i < s->n; i++)
        if (h->dx[i]) {
            pthread_mutex_lock(&s->lock[i]);
            if (bind(s->be, s->ctx[i]) == CM_OK) s->be->free(s->ctx[i], h->dx[i]);
            pthread_mutex_unlock(&s->lock[i]);
            h->dx[i] = NULL;
        }
    h->cap = 0;
}

void ts_split_handover_destroy(ts_split_handover **ph) {
    if (!ph || !*ph) return;
    handover_free(*ph);
    free(*ph);
    *ph = NULL;
}

/* Every stage input of h holds T·D floats (allocated, zero-filled and synced before the stage
 * before it copies in). */
static cm_status handover_reserve(ts_split_handover *h, int64_t T) {
    ts_split     *s  = h->s;
    const int64_t TD = T * ts_split_cfg(s)->hidden_size;
    if (s->n == 1 || TD <= h->cap) return CM_OK;
    handover_free(h);
    cm_status st = CM_OK;
    for (int i = 1; i < s->n && st == CM_OK; i++) {
        pthread_mutex_lock(&s->lock[i]);
        st = bind(s->be, s->ctx[i]);
        if (st == CM_OK) st = s->be->alloc(s->ctx[i], (void **)&h->dx[i], (size_t)TD * sizeof(float));
        if (st == CM_OK) st = s->be->sync(s->ctx[i]);
        pthread_mutex_unlock(&s->lock[i]);
        if (st != CM_OK) {
            char why[768];
            snprintf(why, sizeof why, "%s", cm_last_error());
            st = CM_FAIL(st, "stage %d's input of %lld tokens: %s", i, (long long)T, why);
        }
    }
    if (st != CM_OK) {
        handover_free(h);
        return st;
    }
    h->cap = TD;
    return CM_OK;
}

void ts_split_destroy(ts_split **ps) {
    ts_split *s = ps ? *ps : NULL;
    if (!s) return;
    ts_split_handover_destroy(&s->ho);
    for (int i = 0; i < s->n; i++) {
        if (s->stage[i]) bind(s->be, s->ctx[i]);
        ts_model_destroy(&s->stage[i]);
    }
    for (int i = 0; i < s->n; i++) pthread_mutex_destroy(&s->lock[i]);
    free(s);
    *ps = NULL;
}

cm_status ts_split_load(ts_split **out, const ts_model_config *base, int n, kn_ctx *const *ctxs, const int *bounds) {
    *out = NULL;
    cm_target_cfg cfg;
    CM_TRY(cm_target_cfg_load(&cfg, base->dir));
    const int end = base->n_layers < 0 ? cfg.n_layers : base->n_layers;
    if (n < 1 || n > TS_SPLIT_MAX_STAGES || n > end)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d stages for %d layers of '%s': give 1 to %d stages, at most one per layer",
                       n, end, base->dir, end < TS_SPLIT_MAX_STAGES ? end : TS_SPLIT_MAX_STAGES);
    ts_split *s = calloc(1, sizeof *s);
    if (!s) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a split target");
    s->n        = n;
    s->be       = base->backend;
    s->has_head = base->load_head;
    for (int i = 0; i < n; i++) pthread_mutex_init(&s->lock[i], NULL);
    memcpy(s->ctx, ctxs, (size_t)n * sizeof *ctxs);
    if (bounds)
        memcpy(s->bounds, bounds, (size_t)(n + 1) * sizeof *bounds);
    else
        ts_split_even(&cfg, end, n, s->bounds);
    cm_status st = CM_OK;
    for (int i = 0; i < n && st == CM_OK; i++)
        if (s->bounds[i] >= s->bounds[i + 1])
            st = CM_FAIL(CM_ERR_INVALID_ARG, "stage %d would hold layers [%d, %d): every stage needs at least one layer",
                         i, s->bounds[i], s->bounds[i + 1]);
    if (st == CM_OK && (s->bounds[0] != 0 || s->bounds[n] != end))
        st = CM_FAIL(CM_ERR_INVALID_ARG, "the stages hold layers [%d, %d): they must cover [0, %d) exactly",
                     s->bounds[0], s->bounds[n], end);
    for (int i = 0; i < n && st == CM_OK; i++) {
        ts_model_config mc = *base;
        mc.ctx             = ctxs[i];
        mc.first_layer     = s->bounds[i];
        mc.n_layers        = s->bounds[i + 1];
        mc.load_head       = base->load_head && i == n - 1;
        st                 = bind(base->backend, ctxs[i]);
        if (st == CM_OK) st = ts_model_load(&s->stage[i], &mc);
        if (st != CM_OK && n > 1) { /* which stage, when there are several */
            char why[768];
            snprintf(why, sizeof why, "%s", cm_last_error());
            st = CM_FAIL(st, "stage %d of %d (layers %d to %d): %s", i, n, s->bounds[i], s->bounds[i + 1] - 1, why);
        }
    }
    if (st != CM_OK) {
        ts_split_destroy(&s);
        return st;
    }
    *out = s;
    return CM_OK;
}

int ts_split_stages(const ts_split *s) { return s->n; }

const cm_target_cfg *ts_split_cfg(const ts_split *s) { return ts_model_cfg(s->stage[0]); }

cm_status ts_split_warmup(ts_split *s, int64_t max_tokens) {
    for (int i = 0; i < s->n; i++) {
        CM_TRY(bind(s->be, s->ctx[i]));
        CM_TRY(ts_model_warmup(s->stage[i], max_tokens));
    }
    return CM_OK;
}

int ts_split_bound(const ts_split *s, int i) { return s->bounds[i]; }

/* One stage of a pack under its lock, on its device; cached: over that stage's cache. */
static cm_status run_stage(ts_split *s, int i, ts_cache *cache, const ts_cache_step *cs, const int32_t *ids, int64_t T,
                           const int32_t *cu, int n_seq, const ts_capture *sc) {
    pthread_mutex_lock(&s->lock[i]);
    cm_status st = bind(s->be, s->ctx[i]);
    if (st == CM_OK)
        st = cache ? ts_model_forward_cached(s->stage[i], cache, cs, ids, T, cu, sc)
                   : ts_model_forward(s->stage[i], ids, T, cu, n_seq, sc);
    pthread_mutex_unlock(&s->lock[i]);
    return st;
}

/* Stage i's part of cap: the captures of its layers, from cap->layers[*next] on (*next moves past
 * them), its input from h and its output into the next stage's (unless it runs last), and the
 * head when i is the split's last stage and runs last. */
static ts_capture stage_capture(const ts_split *s, int i, const ts_capture *cap, int *next, const ts_split_handover *h,
                                int runs_last) {
    int k = *next;
    while (k < cap->n_layers && cap->layers[k] < s->bounds[i + 1]) k++;
    ts_capture sc = {.n_layers = k - *next,
                     .layers = cap->layers + *next,
                     .layer_out = cap->layer_out ? cap->layer_out + *next : NULL,
                     .layer_dev = cap->layer_dev ? cap->layer_dev + *next : NULL,
                     .layer_dev_ctx = cap->layer_dev_ctx,
                     .experts = cap->experts,
                     .x_in_dev = i > 0 ? h->dx[i] : NULL,
                     .x_out_dev = runs_last ? NULL : h->dx[i + 1],
                     .x_out_ctx = runs_last ? NULL : s->ctx[i + 1]};
    if (runs_last && i == s->n - 1) {
        sc.final_norm  = cap->final_norm;
        sc.logits      = cap->logits;
        sc.n_head_rows = cap->n_head_rows;
        sc.head_rows   = cap->head_rows;
        sc.head_argmax = cap->head_argmax;
        sc.head_logits = cap->head_logits;
    }
    *next = k;
    return sc;
}

static cm_status captures_inside(const ts_split *s, const ts_capture *cap, int next) {
    if (next != cap->n_layers)
        return CM_FAIL(CM_ERR_INVALID_ARG, "capture layer %d is outside the split target's layers [0, %d)",
                       cap->layers[next], s->bounds[s->n]);
    return CM_OK;
}

static int handover_given(const ts_capture *cap) { return cap->x_in || cap->x_out || cap->x_in_dev || cap->x_out_dev; }

cm_status ts_split_forward_with(ts_split *s, ts_split_handover *h, const int32_t *ids, int64_t T, const int32_t *cu,
                                int n_seq, const ts_capture *cap) {
    if (cap->on_layer || cap->n_head_rows || handover_given(cap) || (cap->layer_dev && !cap->layer_dev_ctx))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "a split target gathers captures in host memory (layer_out, final_norm, "
                       "logits, experts) or in the memory of one context (layer_dev with layer_dev_ctx)");
    const int want_head = cap->final_norm || cap->logits;
    const int need = want_head ? s->bounds[s->n] - 1 : cap->n_layers ? cap->layers[cap->n_layers - 1] : -1;
    int       next = 0; /* the caller's next capture */
    CM_TRY(handover_reserve(h, T));
    for (int i = 0; i < s->n && s->bounds[i] <= need; i++) {
        const int  last_stage = i == s->n - 1 || s->bounds[i + 1] > need;
        ts_capture sc         = stage_capture(s, i, cap, &next, h, last_stage);
        CM_TRY(run_stage(s, i, NULL, NULL, ids, T, cu, n_seq, &sc));
        if (last_stage) break;
    }
    return captures_inside(s, cap, next);
}

cm_status ts_split_forward(ts_split *s, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                           const ts_capture *cap) {
    if (!s->ho) CM_TRY(ts_split_handover_create(s, &s->ho));
    return ts_split_forward_with(s, s->ho, ids, T, cu, n_seq, cap);
}

// ----------------------------------------------------------------------------
// decoding

void ts_split_cache_destroy(ts_split_cache **pc) {
    ts_split_cache *c = pc ? *pc : NULL;
    if (!c) return;
    for (int i = 0; i < c->s->n; i++)
        if (c->c[i]) {
            bind(c->s->be, c->s->ctx[i]);
            ts_cache_destroy(&c->c[i]);
        }
    ts_split_handover_destroy(&c->ho);
    free(c);
    *pc = NULL;
}

cm_status ts_split_cache_create(ts_split *s, int n_slots, int64_t max_len, int64_t max_step, ts_split_cache **out) {
    *out = NULL;
    const cm_target_cfg *cfg = ts_split_cfg(s);
    if (s->bounds[s->n] != cfg->n_layers || !s->has_head)
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding needs every layer and the head loaded (%d of %d layers%s)",
                       s->bounds[s->n], cfg->n_layers, s->has_head ? "" : ", no head");
    ts_split_cache *c = calloc(1, sizeof *c);
    if (!c) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a split decoding cache");
    c->s         = s;
    cm_status st = ts_split_handover_create(s, &c->ho);
    for (int i = 0; i < s->n && st == CM_OK; i++) {
        st = bind(s->be, s->ctx[i]);
        if (st == CM_OK) st = ts_cache_create(s->stage[i], n_slots, max_len, max_step, &c->c[i]);
        if (st != CM_OK && s->n > 1) {
            char why[768];
            snprintf(why, sizeof why, "%s", cm_last_error());
            st = CM_FAIL(st, "stage %d of %d: %s", i, s->n, why);
        }
    }
    if (st != CM_OK) {
        ts_split_cache_destroy(&c);
        return st;
    }
    *out = c;
    return CM_OK;
}

cm_status ts_split_forward_cached(ts_split_cache *c, const ts_cache_step *cs, const int32_t *ids, int64_t T,
                                  const int32_t *cu, const ts_capture *cap) {
    ts_split *s = c->s;
    if (cap->layer_dev || cap->on_layer || handover_given(cap))
        return CM_FAIL(CM_ERR_INVALID_ARG, "a split target gathers captures in host memory only (layer_out, "
                       "final_norm, logits, the head's rows, experts)");
    CM_TRY(handover_reserve(c->ho, T));
    int next = 0;
    for (int i = 0; i < s->n; i++) { /* every stage: each one's cache must see the new tokens */
        ts_capture sc = stage_capture(s, i, cap, &next, c->ho, i == s->n - 1);
        CM_TRY(run_stage(s, i, c->c[i], cs, ids, T, cu, cs->n_seq, &sc));
    }
    return captures_inside(s, cap, next);
}

cm_status ts_split_cache_commit(ts_split_cache *c, const int32_t *n_adv) {
    for (int i = 0; i < c->s->n; i++) {
        pthread_mutex_lock(&c->s->lock[i]);
        cm_status st = bind(c->s->be, c->s->ctx[i]);
        if (st == CM_OK) st = ts_cache_commit(c->c[i], n_adv);
        pthread_mutex_unlock(&c->s->lock[i]);
        CM_TRY(st);
    }
    return CM_OK;
}

cm_status ts_split_cache_clear(ts_split_cache *c, int slot) {
    for (int i = 0; i < c->s->n; i++) {
        pthread_mutex_lock(&c->s->lock[i]);
        cm_status st = bind(c->s->be, c->s->ctx[i]);
        if (st == CM_OK) st = ts_cache_clear(c->c[i], slot);
        pthread_mutex_unlock(&c->s->lock[i]);
        CM_TRY(st);
    }
    return CM_OK;
}
