/* drafter-trainer/model/dt_model_act.c — activation planning: the saved activations and temporaries carved
 * out of one backend allocation, sized for the largest batch and reused. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    const int64_t         NP = 2 * (int64_t)g->conv_kernel_size * m->ng; /* δ per row (DFlash2) */
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
        A->kb_pre = CARVE_A(c, R * KV);
        A->vc = CARVE_A(c, (T + R) * KV); /* v_proj's output: the context rows, then the block rows */
        A->vb = A->vc ? (char *)A->vc + (size_t)(T * KV) * es : NULL;
        A->attn = CARVE_A(c, R * Q);
        A->lse = CARVE_F(c, R * g->n_heads);
        A->x_mid = CARVE_A(c, R * D);
        A->gate = CARVE_A(c, R * I);
        A->up = CARVE_A(c, R * I); /* right after gate: one span */
        if (dt_model_is_v2(m)) {
            A->dA = CARVE_F(c, R * NP);
            A->dM = CARVE_F(c, R * NP);
            A->sA = CARVE_A(c, R * D);
            A->sM = CARVE_A(c, R * D);
        }
    }
    if (dt_model_is_v2(m)) {
        const int64_t K = g->selector_top_k, Rk = g->selector_rank;
        a->cu = CARVE_F(c, R * D);
        a->cup = CARVE_F(c, R * D);
        a->cdd = CARVE_F(c, R * NP);
        a->topk_idx = CARVE_I(c, R * K);
        a->cand = CARVE_I(c, R * K);
        a->pred = CARVE_I(c, R);
        a->lab_pos = CARVE_I(c, R);
        a->choice = CARVE_I(c, R);
        a->topk_val = CARVE_F(c, R * K);
        a->score = CARVE_F(c, R * K);
        a->lab_logit = CARVE_F(c, R);
        a->sce = CARVE_F(c, R);
        a->sgs = CARVE_F(c, R);
        a->su = CARVE_F(c, R * Rk);
        a->sdu = CARVE_F(c, R * Rk);
    }
    a->xw = CARVE_F(c, R * D);
    a->dx = CARVE_F(c, R * D);
    a->dh = CARVE_F(c, R * D);
    a->H = m->adt == CM_DTYPE_F32 ? NULL : CARVE_A(c, R * D);
    a->dctx = CARVE_F(c, T * D);
    /* the work region: the largest of the phases' needs beyond the spans */
    a->span_bytes = 2 * align_bytes((size_t)(R * I) * es);
    const size_t qb = (size_t)(R * Q) * 4, kcb = (size_t)(T * KV) * 4, kbb = (size_t)(R * KV) * 4;
    const size_t kb = (size_t)((T + R) * KV) * es;
    const size_t as_bytes[AS_COUNT] = {qb, qb, qb, qb, kb, kcb, kbb, kcb, kcb, kbb, kbb};
    const size_t fs_bytes[FS_COUNT] = {(size_t)(T * D) * 4, (size_t)(T * D) * 4};
    size_t       work = slots_place(a->as, as_bytes, AS_COUNT, a->span_bytes);
    work = max_sz(work, slots_place(a->fs, fs_bytes, FS_COUNT, a->span_bytes));
    work = max_sz(work, (size_t)(R * I) * es);                  /* the SwiGLU product / its gradient */
    work = max_sz(work, (size_t)((R + 1) * D) * 4);             /* dhsel */
    work = max_sz(work, (size_t)((int64_t)g->n_taps * D) * 4); /* a row of host features to widen */
    a->work = carve(c, (int64_t)work, 1);
    a->work_bytes = work;
}

/* Layer l's attention slot s (F32, or as its comment in dt_model_int.h says). */
float *dt_model_slot_ptr(const dt_model *m, int l, int s) {
    const dt_acts *a = &m->acts;
    const dt_slot *t = &a->as[s];
    return (float *)((char *)(t->in_span ? a->layer[l].gate : a->work) + t->off);
}

/* The fc slot s (F32; in layer 0's span or the work region). */
float *dt_model_fc_slot(const dt_model *m, int s) {
    const dt_acts *a = &m->acts;
    const dt_slot *t = &a->fs[s];
    return (float *)((char *)(t->in_span ? a->layer[0].gate : a->work) + t->off);
}

/* Grows the activation and host buffers to hold T context rows and R block rows. */
cm_status dt_model_ensure_capacity(dt_model *m, int64_t T, int64_t R) {
    if (m->acts.base && T <= m->acts.T_cap && R <= m->acts.R_cap)
        return CM_OK;
    if (T < m->acts.T_cap)
        T = m->acts.T_cap;
    if (R < m->acts.R_cap)
        R = m->acts.R_cap;
    dt_model_acts_release(m);
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
    const size_t r2 = dt_model_is_v2(m) ? (size_t)R : 1; /* DFlash: a token allocation */
    h->pred = malloc(r2 * sizeof *h->pred);
    h->lab_pos = malloc(r2 * sizeof *h->lab_pos);
    h->choice = malloc(r2 * sizeof *h->choice);
    h->sce = malloc(r2 * sizeof *h->sce);
    h->sgs = malloc(r2 * sizeof *h->sgs);
    if (!a->layer || !h->blk_ids || !h->blk_pos || !h->ctx_pos || !h->ctx_lo || !h->sel_row || !h->labels ||
        !h->argmax || !h->weight || !h->gscale || !h->ce || !h->inv || !h->pred || !h->lab_pos || !h->choice ||
        !h->sce || !h->sgs) {
        dt_model_acts_release(m);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate host buffers for %lld tokens and %lld block rows",
                       (long long)T, (long long)R);
    }
    carver c = {NULL, 0};
    acts_layout(m, &c, T, R);
    cm_status st = m->be->alloc(m->ctx, &a->base, c.off);
    if (st != CM_OK) {
        dt_model_acts_release(m);
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
    return dt_model_ensure_capacity(m, T, n_anchors * m->cfg.block_size);
}
