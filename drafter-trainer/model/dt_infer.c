/* drafter-trainer/model/dt_infer.c — the drafter's own inference (dt_infer.h): per-slot caches of
 * the context rows' keys and values, and one block forward for several sequences, written against
 * the backend table with the training forward's ops in the training forward's order
 * (dt_model_fwd.c, dt_model_conv.c, dt_model_bwd.c's loss head), so that on the cpu backend a draft
 * computes exactly what the training step computes for the same anchor.
 *
 * Layout. Slot s's cached rows are rows [s · max_len, s · max_len + len_s) of one [n_slots ·
 * max_len, nkv, hd] key array and one value array per layer. The block attention then needs no
 * copy: the caches are its context rows, block i has anchor s · max_len + len_s and context start
 * s · max_len, so the kernel's rule (rows ctx_lo ≤ p < anchor, the window counted in rows) is the
 * sequence's rule in positions. One dflash_attn_fwd per layer serves all sequences. Block rows are
 * sequence-major (row i·B + k), as the training's blocks; the LM head's rows are slot-major
 * (row (k − 1)·n + i, gathered with the embed op as the training's loss head gathers), so that the
 * selector walk takes slot k of every sequence as one contiguous run.
 *
 * The DFlash2 selector walk goes slot by slot: slot k's predecessors (the anchors, then the tokens
 * chosen at slot k − 1) go up, selector_fwd scores that slot's K candidates for every sequence, the
 * choices come down: B − 2 small round trips per draft after the unary pass, with the exact op the
 * training step scores its selector with. */
#include "dt_infer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_model_int.h"

#define DT_INFER_CHUNK 256

/* A weight matrix as a GEMM operand: the F32 master, or its bf16 copy. */
typedef struct inf_w {
    const void *w;
    cm_dtype    dt;
} inf_w;

/* The matrices of one layer the forward multiplies by, in LP_* order (unused entries empty). */
typedef struct inf_layer {
    inf_w w[LP_COUNT2];
} inf_layer;

struct dt_infer {
    const dt_model       *m;
    const cm_drafter_cfg *g;
    const kn_backend     *be;
    kn_ctx               *ctx;
    int                   n_slots, B, v2, Kt; /* Kt: the top-K the LM head takes (1 for DFlash) */
    int64_t               max_len, chunk;
    int64_t               D, Q, KV, I, NP, nD, Rk;
    inf_w                 fc, hproj;
    inf_layer            *lw;    /* [L] */
    void                 *wcopy; /* bf16 copies of the matrices (one allocation), or NULL */
    size_t                wcopy_bytes;
    float                *cache; /* [L][2][n_slots · max_len, KV]: keys then values per layer */
    size_t                cache_bytes;
    void                 *base; /* everything else, carved */
    size_t                bytes;
    /* the block (backend memory) */
    int32_t *d_ids, *d_pos, *d_anchor, *d_lo, *d_gather, *d_zero, *d_pred;
    int32_t *argmax, *topk_idx, *cand, *lab_pos, *choice;
    float   *x, *h, *hc, *q, *kb, *vb, *att, *lse, *s, *gate, *up, *delta;
    float   *hsel, *ce, *topk_val, *lab_logit, *su, *score, *sce;
    /* context projection (backend memory), chunk rows; the chunk's segments for kv_cache_write */
    float   *F, *pre, *cx, *kt, *vt;
    int32_t *d_cpos, *d_sslot, *d_sbase, *d_scu;
    /* host */
    int64_t *len;                                                 /* [n_slots] */
    float   *hF;                                                  /* [chunk, nD] */
    int32_t *h_cpos;                                              /* [chunk] */
    int32_t *h_ids, *h_pos, *h_anchor, *h_lo, *h_gather, *h_pred; /* [Rc], [Rc], [S], [S], [Sc], [S] */
    int32_t *h_choice, *h_topk;                                   /* [S], [Sc, Kt] */
    float   *h_val, *h_ce, *h_lab, *h_score;                      /* [Sc], [Sc], [Sc], [S, Kt] */
    int32_t *h_seg;  /* [S, 4]: slot, chunk row, position, rows */
    int32_t *h_sarg; /* [3 S + 1]: the segments' slots, positions and chunk rows (cu) for kv_cache_write */
    uint8_t *h_seen; /* [S] */
};

static const dt_param *lp(const dt_model *m, int l, int j) {
    return &m->params[P_LAYER0 + l * m->n_lp + j];
}

// ----------------------------------------------------------------------------
// memory

typedef struct carver {
    char  *base;
    size_t off;
} carver;

static void *carve(carver *c, int64_t n, size_t esize) {
    const size_t at = c->off;
    c->off += ((size_t)n * esize + DT_ALIGN - 1) / DT_ALIGN * DT_ALIGN;
    return c->base ? c->base + at : NULL;
}
#define CARVE_F(c, n) ((float *)carve((c), (n), sizeof(float)))
#define CARVE_I(c, n) ((int32_t *)carve((c), (n), sizeof(int32_t)))

static void layout(dt_infer *f, carver *c) {
    const int64_t Rc = (int64_t)f->n_slots * f->B, Sc = (int64_t)f->n_slots * (f->B - 1), S = f->n_slots;
    const int64_t C = f->chunk, D = f->D;
    f->d_ids = CARVE_I(c, Rc);
    f->d_pos = CARVE_I(c, Rc);
    f->d_anchor = CARVE_I(c, S);
    f->d_lo = CARVE_I(c, S);
    f->d_gather = CARVE_I(c, Sc);
    f->d_zero = CARVE_I(c, Sc);
    f->d_pred = CARVE_I(c, Sc);
    f->argmax = CARVE_I(c, Sc);
    f->topk_idx = CARVE_I(c, Sc * f->Kt);
    f->cand = f->v2 ? CARVE_I(c, Sc * f->Kt) : NULL;
    f->lab_pos = f->v2 ? CARVE_I(c, Sc) : NULL;
    f->choice = f->v2 ? CARVE_I(c, Sc) : NULL;
    f->d_cpos = CARVE_I(c, C);
    f->d_sslot = CARVE_I(c, S);
    f->d_sbase = CARVE_I(c, S);
    f->d_scu = CARVE_I(c, S + 1);
    f->x = CARVE_F(c, Rc * D);
    f->h = CARVE_F(c, Rc * D);
    f->hc = f->v2 ? CARVE_F(c, Rc * D) : NULL;
    f->q = CARVE_F(c, Rc * f->Q);
    f->kb = CARVE_F(c, Rc * f->KV);
    f->vb = CARVE_F(c, Rc * f->KV);
    f->att = CARVE_F(c, Rc * f->Q);
    f->lse = CARVE_F(c, Rc * f->g->n_heads);
    f->s = CARVE_F(c, Rc * D);
    f->gate = CARVE_F(c, Rc * f->I);
    f->up = CARVE_F(c, Rc * f->I);
    f->delta = f->v2 ? CARVE_F(c, Rc * f->NP) : NULL;
    f->hsel = CARVE_F(c, Sc * D);
    f->ce = CARVE_F(c, Sc);
    f->topk_val = CARVE_F(c, Sc * f->Kt);
    f->lab_logit = CARVE_F(c, Sc);
    f->su = f->v2 ? CARVE_F(c, Sc * f->Rk) : NULL;
    f->score = f->v2 ? CARVE_F(c, Sc * f->Kt) : NULL;
    f->sce = f->v2 ? CARVE_F(c, Sc) : NULL;
    f->F = CARVE_F(c, C * f->nD);
    f->pre = CARVE_F(c, C * D);
    f->cx = CARVE_F(c, C * D);
    f->kt = CARVE_F(c, C * f->KV);
    f->vt = CARVE_F(c, C * f->KV);
}

static float *cache_k(const dt_infer *f, int l) {
    return f->cache + (size_t)(2 * l) * (size_t)(f->n_slots * f->max_len * f->KV);
}
static float *cache_v(const dt_infer *f, int l) {
    return f->cache + (size_t)(2 * l + 1) * (size_t)(f->n_slots * f->max_len * f->KV);
}

static cm_status check_backend(const kn_backend *be, int v2) {
    // clang-format off
#define DT_NEED(fn) {#fn, be->fn != NULL}
    const struct {
        const char *name;
        int         present;
    } need[] = {
        DT_NEED(alloc), DT_NEED(free), DT_NEED(upload), DT_NEED(download), DT_NEED(sync), DT_NEED(copy2d),
        DT_NEED(add), DT_NEED(swiglu_typed), DT_NEED(embed), DT_NEED(gemm), DT_NEED(rmsnorm), DT_NEED(rope),
        DT_NEED(dflash_attn_fwd), DT_NEED(lm_ce_topk),
        {"dynconv_fwd", !v2 || be->dynconv_fwd}, {"selector_fwd", !v2 || be->selector_fwd},
    };
    // clang-format on
#undef DT_NEED
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (!need[i].present)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "the %s backend cannot draft: it has no %s (use --device cpu)",
                           be->name, need[i].name);
    return CM_OK;
}

/* The forward's matrices: the masters, or bf16 copies when the backend's gemm rounds its input to
 * bf16 anyway (then the product is the same and no conversion runs per call). */
static const int inf_mats[] = {LP_Q, LP_K, LP_V, LP_O, LP_GATE, LP_UP, LP_DOWN, LP_ACONV_PROJ, LP_MCONV_PROJ};
#define N_INF_MATS ((int)(sizeof inf_mats / sizeof inf_mats[0]))

static int use_copies(const dt_infer *f) {
    return f->be->gemm_rounds_input && f->be->cast2d && f->be->gemm_rounds_input(f->ctx);
}

/* Calls fn for every matrix the forward reads (the layers', fc's and the selector's hidden projection). */
static cm_status each_matrix(dt_infer *f,
                             cm_status (*fn)(dt_infer *f, const dt_param *p, inf_w *slot, void *u), void *u) {
    const dt_model *m = f->m;
    CM_TRY(fn(f, &m->params[P_FC], &f->fc, u));
    for (int l = 0; l < f->g->n_layers; l++)
        for (int i = 0; i < N_INF_MATS; i++)
            if (inf_mats[i] < m->n_lp)
                CM_TRY(fn(f, lp(m, l, inf_mats[i]), &f->lw[l].w[inf_mats[i]], u));
    if (f->v2)
        CM_TRY(fn(f, &m->params[m->p_sel + SP_HPROJ], &f->hproj, u));
    return CM_OK;
}

static cm_status mat_master(dt_infer *f, const dt_param *p, inf_w *slot, void *u) {
    (void)f, (void)u;
    *slot = (inf_w){p->data, CM_DTYPE_F32};
    return CM_OK;
}

static cm_status mat_measure(dt_infer *f, const dt_param *p, inf_w *slot, void *u) {
    (void)f, (void)slot;
    *(size_t *)u += ((size_t)p->numel * 2 + DT_ALIGN - 1) / DT_ALIGN * DT_ALIGN;
    return CM_OK;
}

static cm_status mat_copy(dt_infer *f, const dt_param *p, inf_w *slot, void *u) {
    size_t *off = u;
    void   *dst = (char *)f->wcopy + *off;
    CM_TRY(f->be->cast2d(f->ctx, dst, CM_DTYPE_BF16, p->shape[1], p->data, CM_DTYPE_F32, p->shape[1],
                         p->shape[0], p->shape[1]));
    *slot = (inf_w){dst, CM_DTYPE_BF16};
    *off += ((size_t)p->numel * 2 + DT_ALIGN - 1) / DT_ALIGN * DT_ALIGN;
    return CM_OK;
}

cm_status dt_infer_refresh(dt_infer *f) {
    if (!f->wcopy)
        return CM_OK;
    size_t off = 0;
    CM_TRY(each_matrix(f, mat_copy, &off));
    return f->be->sync(f->ctx);
}

cm_status dt_infer_create(dt_infer **out, const dt_model *m, const dt_infer_config *cfg) {
    if (!out || !m || !cfg)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_infer_create: NULL argument");
    *out = NULL;
    const cm_drafter_cfg *g = &m->cfg;
    const int             B = cfg->block ? cfg->block : g->block_size;
    if (!m->embed || !m->lm_head)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the drafter has no frozen embedding and LM head (dt_model_set_frozen)");
    if (B < 2 || B > g->block_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "block size %d is outside 2 .. the drafter's block_size %d", B,
                       g->block_size);
    if (g->kind == CM_DRAFTER_DFLASH2 && B < g->conv_kernel_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "block size %d is below the DFlash2 drafter's conv_kernel_size %d",
                       B, g->conv_kernel_size);
    if (cfg->n_slots < 1 || cfg->max_len < 1 || cfg->chunk_rows < 0 ||
        cfg->max_len > INT32_MAX / cfg->n_slots - 1)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "a drafting cache of %d sequences of %lld rows is out of range (at least 1 and 1; rows in "
            "all below 2^31)",
            cfg->n_slots, (long long)cfg->max_len);
    CM_TRY(check_backend(m->be, g->kind == CM_DRAFTER_DFLASH2));
    cm_status st;
    dt_infer *f = calloc(1, sizeof *f);
    if (!f)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the drafting state");
    f->m = m;
    f->g = g;
    f->be = m->be;
    f->ctx = m->ctx;
    f->n_slots = cfg->n_slots;
    f->B = B;
    f->v2 = g->kind == CM_DRAFTER_DFLASH2;
    f->Kt = f->v2 ? g->selector_top_k : 1;
    f->max_len = cfg->max_len;
    f->chunk = cfg->chunk_rows ? cfg->chunk_rows : DT_INFER_CHUNK;
    f->D = g->hidden_size;
    f->Q = (int64_t)g->n_heads * g->head_dim;
    f->KV = (int64_t)g->n_kv_heads * g->head_dim;
    f->I = g->intermediate_size;
    f->NP = f->v2 ? 2 * (int64_t)g->conv_kernel_size * m->ng : 0;
    f->nD = (int64_t)g->n_taps * f->D;
    f->Rk = f->v2 ? g->selector_rank : 0;
    const int64_t S = f->n_slots, Rc = S * B, Sc = S * (B - 1), C = f->chunk;
    f->lw = calloc((size_t)g->n_layers, sizeof *f->lw);
    f->len = calloc((size_t)S, sizeof *f->len);
    f->hF = malloc((size_t)(C * f->nD) * sizeof *f->hF);
    f->h_cpos = malloc((size_t)C * sizeof(int32_t));
    f->h_ids = malloc((size_t)Rc * sizeof(int32_t));
    f->h_pos = malloc((size_t)Rc * sizeof(int32_t));
    f->h_anchor = malloc((size_t)S * sizeof(int32_t));
    f->h_lo = malloc((size_t)S * sizeof(int32_t));
    f->h_gather = malloc((size_t)Sc * sizeof(int32_t));
    f->h_pred = malloc((size_t)S * sizeof(int32_t));
    f->h_choice = malloc((size_t)S * sizeof(int32_t));
    f->h_topk = malloc((size_t)(Sc * f->Kt) * sizeof(int32_t));
    f->h_val = malloc((size_t)Sc * sizeof(float));
    f->h_ce = malloc((size_t)Sc * sizeof(float));
    f->h_lab = malloc((size_t)Sc * sizeof(float));
    f->h_score = malloc((size_t)(S * f->Kt) * sizeof(float));
    f->h_seg = malloc((size_t)(4 * S) * sizeof(int32_t));
    f->h_sarg = malloc((size_t)(3 * S + 1) * sizeof(int32_t));
    f->h_seen = calloc((size_t)S, 1);
    if (!f->lw || !f->len || !f->hF || !f->h_cpos || !f->h_ids || !f->h_pos || !f->h_anchor || !f->h_lo ||
        !f->h_gather || !f->h_pred || !f->h_choice || !f->h_topk || !f->h_val || !f->h_ce || !f->h_lab ||
        !f->h_score || !f->h_seg || !f->h_sarg || !f->h_seen) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the drafting state's host buffers");
        goto fail;
    }
    /* the caches, then one allocation for the block and the context projection */
    f->cache_bytes = (size_t)(2 * g->n_layers) * (size_t)(S * f->max_len * f->KV) * sizeof(float);
    CM_TRY_GOTO(f->be->alloc(f->ctx, (void **)&f->cache, f->cache_bytes), st, fail);
    carver c = {NULL, 0};
    layout(f, &c);
    f->bytes = c.off;
    CM_TRY_GOTO(f->be->alloc(f->ctx, &f->base, f->bytes), st, fail);
    c = (carver){f->base, 0};
    layout(f, &c);
    /* the matrices: masters, or bf16 copies */
    CM_TRY_GOTO(each_matrix(f, mat_master, NULL), st, fail);
    if (use_copies(f)) {
        CM_TRY_GOTO(each_matrix(f, mat_measure, &f->wcopy_bytes), st, fail);
        CM_TRY_GOTO(f->be->alloc(f->ctx, &f->wcopy, f->wcopy_bytes), st, fail);
        CM_TRY_GOTO(dt_infer_refresh(f), st, fail);
    }
    *out = f;
    return CM_OK;
fail:
    dt_infer_destroy(&f);
    return st;
}

void dt_infer_destroy(dt_infer **fp) {
    if (!fp || !*fp)
        return;
    dt_infer *f = *fp;
    f->be->free(f->ctx, f->wcopy);
    f->be->free(f->ctx, f->base);
    f->be->free(f->ctx, f->cache);
    void *host[] = {f->lw,    f->len,      f->hF,     f->h_cpos,   f->h_ids,  f->h_pos, f->h_anchor,
                    f->h_lo,  f->h_gather, f->h_pred, f->h_choice, f->h_topk, f->h_val, f->h_ce,
                    f->h_lab, f->h_score,  f->h_seg,  f->h_sarg,   f->h_seen};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; k++)
        free(host[k]);
    free(f);
    *fp = NULL;
}

void dt_infer_reset(dt_infer *f, int slot) {
    if (slot >= 0 && slot < f->n_slots)
        f->len[slot] = 0;
}

int64_t dt_infer_len(const dt_infer *f, int slot) {
    return slot >= 0 && slot < f->n_slots ? f->len[slot] : -1;
}

int dt_infer_block(const dt_infer *f) {
    return f->B;
}

int dt_infer_n_slots(const dt_infer *f) {
    return f->n_slots;
}

size_t dt_infer_bytes(const dt_infer *f) {
    return f->cache_bytes + f->bytes + f->wcopy_bytes;
}

// ----------------------------------------------------------------------------
// the context rows

static cm_status mm(dt_infer *f, float *out, const float *inp, inf_w w, int64_t M, int64_t N, int64_t K) {
    return f->be->gemm(f->ctx, out, inp, w.w, w.dt, M, N, K);
}

/* Checks the slots of n sequences: in range and distinct. */
static cm_status check_slots(dt_infer *f, int n, const int32_t *slots, const char *what) {
    memset(f->h_seen, 0, (size_t)f->n_slots);
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= f->n_slots)
            return CM_FAIL(CM_ERR_INVALID_ARG, "%s: slot %d of sequence %d is outside [0, %d)", what,
                           slots[i], i, f->n_slots);
        if (f->h_seen[slots[i]])
            return CM_FAIL(CM_ERR_INVALID_ARG, "%s: slot %d is given twice", what, slots[i]);
        f->h_seen[slots[i]] = 1;
    }
    return CM_OK;
}

/* The n chunk rows in f->F (their positions in f->d_cpos) through fc and hidden_norm, then each
 * layer's k/v projections, k_norm and RoPE, into the caches at the segments h_seg[0 .. n_seg): one
 * kv_cache_write per layer where the backend has it, else two copies per segment. */
static cm_status project_chunk(dt_infer *f, int64_t n, int n_seg) {
    const kn_backend     *be = f->be;
    const cm_drafter_cfg *g = f->g;
    const dt_model       *m = f->m;
    if (be->kv_cache_write) {
        int32_t *sl = f->h_sarg, *ba = sl + n_seg, *cu = ba + n_seg;
        cu[0] = 0;
        for (int s = 0; s < n_seg; s++) {
            sl[s] = f->h_seg[4 * s], ba[s] = f->h_seg[4 * s + 2];
            cu[s + 1] = f->h_seg[4 * s + 1] + f->h_seg[4 * s + 3];
        }
        CM_TRY(be->upload(f->ctx, f->d_sslot, sl, (size_t)n_seg * sizeof(int32_t)));
        CM_TRY(be->upload(f->ctx, f->d_sbase, ba, (size_t)n_seg * sizeof(int32_t)));
        CM_TRY(be->upload(f->ctx, f->d_scu, cu, (size_t)(n_seg + 1) * sizeof(int32_t)));
    }
    CM_TRY(mm(f, f->pre, f->F, f->fc, n, f->D, f->nD));
    CM_TRY(be->rmsnorm(f->ctx, f->cx, f->pre, m->params[P_HIDDEN_NORM].data, n, f->D, g->rms_norm_eps, 0));
    for (int l = 0; l < g->n_layers; l++) {
        CM_TRY(mm(f, f->kt, f->cx, f->lw[l].w[LP_K], n, f->KV, f->D));
        CM_TRY(be->rmsnorm(f->ctx, f->kt, f->kt, lp(m, l, LP_K_NORM)->data, n * g->n_kv_heads, g->head_dim,
                           g->rms_norm_eps, 0));
        CM_TRY(be->rope(f->ctx, f->kt, f->d_cpos, n, g->n_kv_heads, g->head_dim, g->head_dim,
                        (float)g->rope_theta));
        CM_TRY(mm(f, f->vt, f->cx, f->lw[l].w[LP_V], n, f->KV, f->D));
        if (be->kv_cache_write) {
            CM_TRY(be->kv_cache_write(f->ctx, cache_k(f, l), cache_v(f, l), f->kt, f->vt, f->d_sslot,
                                      f->d_sbase, f->d_scu, n_seg, n, g->n_kv_heads, g->head_dim,
                                      f->max_len));
            continue;
        }
        for (int s = 0; s < n_seg; s++) {
            const int32_t *sg = f->h_seg + 4 * s; /* slot, chunk row, position, rows */
            const int64_t  dst = ((int64_t)sg[0] * f->max_len + sg[2]) * f->KV, src = (int64_t)sg[1] * f->KV;
            CM_TRY(be->copy2d(f->ctx, cache_k(f, l) + dst, f->KV, f->kt + src, f->KV, sg[3], f->KV));
            CM_TRY(be->copy2d(f->ctx, cache_v(f, l) + dst, f->KV, f->vt + src, f->KV, sg[3], f->KV));
        }
    }
    return CM_OK;
}

cm_status dt_infer_append(dt_infer *f, const dt_infer_rows *r) {
    const int64_t D = f->D, nD = f->nD;
    if (!r || r->n_seq < 0 || (r->n_seq > 0 && (!r->slots || !r->n_rows)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_infer_append: no rows given");
    CM_TRY(check_slots(f, r->n_seq, r->slots, "dt_infer_append"));
    int64_t total = 0;
    for (int i = 0; i < r->n_seq; i++) {
        const int s = r->slots[i];
        if (r->n_rows[i] < 0 || f->len[s] + r->n_rows[i] > f->max_len)
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "dt_infer_append: %d rows for slot %d, which holds %lld of at most %lld; raise max_len",
                r->n_rows[i], s, (long long)f->len[s], (long long)f->max_len);
        total += r->n_rows[i];
    }
    if (total == 0)
        return CM_OK;
    if (r->dt != CM_DTYPE_F32 && r->dt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "dt_infer_append: taps in %s; expected F32 or BF16",
                       cm_dtype_name(r->dt));
    if (r->ld < D)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_infer_append: row stride %lld is below the hidden size %lld",
                       (long long)r->ld, (long long)D);
    for (int k = 0; k < f->g->n_taps; k++)
        if (!r->tap[k])
            return CM_FAIL(CM_ERR_INVALID_ARG, "dt_infer_append: tap %d is NULL", k);
    const size_t es = cm_dtype_size(r->dt);
    int          i = 0;      /* the sequence of the next row */
    int64_t      in_seq = 0; /* rows of sequence i already taken */
    int64_t      packed = 0; /* packed row of the next row */
    while (packed < total) {
        int64_t n = 0;
        int     n_seg = 0;
        while (n < f->chunk && packed < total) {
            while (in_seq == r->n_rows[i]) /* skip finished (and empty) sequences */
                i++, in_seq = 0;
            const int     s = r->slots[i];
            const int64_t take = r->n_rows[i] - in_seq < f->chunk - n ? r->n_rows[i] - in_seq : f->chunk - n;
            int32_t      *sg = f->h_seg + 4 * n_seg++;
            sg[0] = s, sg[1] = (int32_t)n, sg[2] = (int32_t)(f->len[s] + in_seq), sg[3] = (int32_t)take;
            for (int64_t t = 0; t < take; t++, n++, packed++) {
                f->h_cpos[n] = (int32_t)(f->len[s] + in_seq + t);
                for (int k = 0; k < f->g->n_taps; k++) {
                    const char *src = (const char *)r->tap[k] + (size_t)(packed * r->ld) * es;
                    float      *dst = f->hF + n * nD + k * D;
                    if (r->dt == CM_DTYPE_F32)
                        memcpy(dst, src, (size_t)D * sizeof(float));
                    else
                        for (int64_t d = 0; d < D; d++) {
                            uint16_t v;
                            memcpy(&v, src + 2 * d, 2);
                            dst[d] = cm_bf16_to_f32(v);
                        }
                }
            }
            in_seq += take;
        }
        CM_TRY(f->be->upload(f->ctx, f->F, f->hF, (size_t)(n * nD) * sizeof(float)));
        CM_TRY(f->be->upload(f->ctx, f->d_cpos, f->h_cpos, (size_t)n * sizeof(int32_t)));
        CM_TRY(project_chunk(f, n, n_seg));
        CM_TRY(f->be->sync(f->ctx)); /* the host staging is refilled next */
    }
    for (int j = 0; j < r->n_seq; j++)
        f->len[r->slots[j]] += r->n_rows[j];
    return CM_OK;
}

// ----------------------------------------------------------------------------
// the block

static kn_dynconv_params conv(dt_infer *f, int l, int mod, int side, const float *x, float *out, int acc) {
    const cm_drafter_cfg *g = f->g;
    kn_dynconv_params     p = {0};
    p.B = f->B;
    p.D = g->hidden_size;
    p.G = g->conv_group_size;
    p.Kc = g->conv_kernel_size;
    p.side = side;
    p.base = lp(f->m, l, mod ? LP_MCONV_BASE : LP_ACONV_BASE)->data;
    p.delta = f->delta;
    p.x = x;
    p.out = out;
    p.accumulate = acc;
    return p;
}

/* h = the sublayer's normed input of R rows; DFlash2: δ and the input-side convolution into hc.
 * Returns the rows the sublayer reads. */
static cm_status sub_in(dt_infer *f, int l, int mod, int64_t R, const float **op) {
    const dt_model *m = f->m;
    CM_TRY(f->be->rmsnorm(f->ctx, f->h, f->x, lp(m, l, mod ? LP_POST_LN : LP_INPUT_LN)->data, R, f->D,
                          f->g->rms_norm_eps, 0));
    *op = f->h;
    if (!f->v2)
        return CM_OK;
    CM_TRY(mm(f, f->delta, f->h, f->lw[l].w[mod ? LP_MCONV_PROJ : LP_ACONV_PROJ], R, f->NP, f->D));
    kn_dynconv_params p = conv(f, l, mod, 0, f->h, f->hc, 0);
    p.rows = R;
    CM_TRY(f->be->dynconv_fwd(f->ctx, &p));
    *op = f->hc;
    return CM_OK;
}

/* x += the sublayer's output s (DFlash2: its output-side convolution). */
static cm_status sub_out(dt_infer *f, int l, int mod, int64_t R) {
    if (!f->v2)
        return f->be->add(f->ctx, f->x, f->s, R * f->D);
    kn_dynconv_params p = conv(f, l, mod, 1, f->s, f->x, 1);
    p.rows = R;
    return f->be->dynconv_fwd(f->ctx, &p);
}

static cm_status layer_fwd(dt_infer *f, int l, int n, int64_t T) {
    const kn_backend     *be = f->be;
    const cm_drafter_cfg *g = f->g;
    const dt_model       *m = f->m;
    const inf_layer      *w = &f->lw[l];
    const int64_t         R = (int64_t)n * f->B;
    const float          *op;
    /* attention: q, k, v of the block rows; k, v of the context rows from the caches */
    CM_TRY(sub_in(f, l, 0, R, &op));
    CM_TRY(mm(f, f->q, op, w->w[LP_Q], R, f->Q, f->D));
    CM_TRY(be->rmsnorm(f->ctx, f->q, f->q, lp(m, l, LP_Q_NORM)->data, R * g->n_heads, g->head_dim,
                       g->rms_norm_eps, 0));
    CM_TRY(be->rope(f->ctx, f->q, f->d_pos, R, g->n_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(mm(f, f->kb, op, w->w[LP_K], R, f->KV, f->D));
    CM_TRY(be->rmsnorm(f->ctx, f->kb, f->kb, lp(m, l, LP_K_NORM)->data, R * g->n_kv_heads, g->head_dim,
                       g->rms_norm_eps, 0));
    CM_TRY(
        be->rope(f->ctx, f->kb, f->d_pos, R, g->n_kv_heads, g->head_dim, g->head_dim, (float)g->rope_theta));
    CM_TRY(mm(f, f->vb, op, w->w[LP_V], R, f->KV, f->D));
    kn_dflash_attn_params p = dt_attn_shape(g, l, T, n, f->B);
    p.anchors = f->d_anchor;
    p.ctx_lo = f->d_lo;
    p.q = f->q;
    p.k_ctx = cache_k(f, l);
    p.v_ctx = cache_v(f, l);
    p.k_blk = f->kb;
    p.v_blk = f->vb;
    p.out = f->att;
    p.lse = f->lse;
    CM_TRY(be->dflash_attn_fwd(f->ctx, &p));
    CM_TRY(mm(f, f->s, f->att, w->w[LP_O], R, f->D, f->Q));
    CM_TRY(sub_out(f, l, 0, R));
    /* the MLP */
    CM_TRY(sub_in(f, l, 1, R, &op));
    CM_TRY(mm(f, f->gate, op, w->w[LP_GATE], R, f->I, f->D));
    CM_TRY(mm(f, f->up, op, w->w[LP_UP], R, f->I, f->D));
    CM_TRY(be->swiglu_typed(f->ctx, f->gate, CM_DTYPE_F32, f->gate, f->up, CM_DTYPE_F32, R * f->I));
    CM_TRY(mm(f, f->s, f->gate, w->w[LP_DOWN], R, f->D, f->I));
    return sub_out(f, l, 1, R);
}

/* DFlash2's selector walk over the unary top-K of the n_sel = n · (B − 1) slot-major rows: slot by
 * slot, the predecessors up, the choices down. */
static cm_status selector_walk(dt_infer *f, int n, const int32_t *anchor, int32_t *drafts, float *probs) {
    const kn_backend *be = f->be;
    const dt_model   *m = f->m;
    const int         B = f->B, K = f->Kt;
    const int64_t     n_sel = (int64_t)n * (B - 1);
    CM_TRY(mm(f, f->su, f->hsel, f->hproj, n_sel, f->Rk, f->D)); /* u = h · W_hᵀ */
    CM_TRY(be->download(f->ctx, f->h_topk, f->topk_idx, (size_t)(n_sel * K) * sizeof(int32_t)));
    for (int k = 1; k < B; k++) {
        const int64_t r0 = (int64_t)(k - 1) * n;
        for (int i = 0; i < n; i++)
            f->h_pred[i] = k == 1 ? anchor[i] : drafts[i * (B - 1) + k - 2];
        CM_TRY(be->upload(f->ctx, f->d_pred + r0, f->h_pred, (size_t)n * sizeof(int32_t)));
        /* no labels at inference: a zero label and KN_SEL_DROP leave the candidates the top-K */
        kn_selector_params sp = {.n = n,
                                 .V = m->V,
                                 .K = K,
                                 .Rk = (int)f->Rk,
                                 .D = (int)f->D,
                                 .miss = KN_SEL_DROP,
                                 .topk_idx = f->topk_idx + r0 * K,
                                 .topk_val = f->topk_val + r0 * K,
                                 .label_logit = f->lab_logit + r0,
                                 .labels = f->d_zero + r0,
                                 .pred = f->d_pred + r0,
                                 .u = f->su + r0 * f->Rk,
                                 .P = m->params[m->p_sel + SP_PRED].data,
                                 .S = m->params[m->p_sel + SP_SUCC].data,
                                 .cand = f->cand + r0 * K,
                                 .score = f->score + r0 * K,
                                 .ce = f->sce + r0,
                                 .lab_pos = f->lab_pos + r0,
                                 .choice = f->choice + r0};
        CM_TRY(be->selector_fwd(f->ctx, &sp));
        CM_TRY(be->download(f->ctx, f->h_choice, f->choice + r0, (size_t)n * sizeof(int32_t)));
        if (probs)
            CM_TRY(be->download(f->ctx, f->h_score, f->score + r0 * K, (size_t)n * K * sizeof(float)));
        for (int i = 0; i < n; i++) {
            const int c = f->h_choice[i] >= 0 && f->h_choice[i] < K ? f->h_choice[i] : 0;
            drafts[i * (B - 1) + k - 1] = f->h_topk[(r0 + i) * K + c];
            if (probs) {
                const float *sc = f->h_score + (int64_t)i * K;
                double       z = 0;
                for (int j = 0; j < K; j++)
                    z += exp((double)sc[j] - (double)sc[c]);
                probs[i * (B - 1) + k - 1] = (float)(1.0 / z);
            }
        }
    }
    return CM_OK;
}

cm_status dt_infer_draft(dt_infer *f, int n, const int32_t *slots, const int32_t *anchor, int32_t *drafts,
                         float *probs) {
    const kn_backend     *be = f->be;
    const cm_drafter_cfg *g = f->g;
    const dt_model       *m = f->m;
    const int             B = f->B;
    if (n < 1 || n > f->n_slots || !slots || !anchor || !drafts)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "dt_infer_draft: %d sequences (1 to %d, with slots, anchors and room "
                       "for the drafts)",
                       n, f->n_slots);
    CM_TRY(check_slots(f, n, slots, "dt_infer_draft"));
    int64_t T = 0;
    for (int i = 0; i < n; i++) {
        const int     s = slots[i];
        const int64_t L = f->len[s];
        if (L >= f->max_len)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "dt_infer_draft: slot %d holds %lld rows, max_len %lld; raise max_len", s,
                           (long long)L, (long long)f->max_len);
        if (anchor[i] < 0 || anchor[i] >= m->V)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "dt_infer_draft: anchor token %d is outside the vocabulary [0, %lld)", anchor[i],
                           (long long)m->V);
        for (int k = 0; k < B; k++) {
            f->h_ids[i * B + k] = k == 0 ? anchor[i] : g->mask_token_id;
            f->h_pos[i * B + k] = (int32_t)(L + k);
        }
        f->h_lo[i] = (int32_t)(s * f->max_len);
        f->h_anchor[i] = (int32_t)(s * f->max_len + L);
        T = f->h_anchor[i] + 1 > T ? f->h_anchor[i] + 1 : T;
        for (int k = 1; k < B; k++)
            f->h_gather[(k - 1) * n + i] = i * B + k;
    }
    const int64_t R = (int64_t)n * B, n_sel = (int64_t)n * (B - 1), D = f->D;
    CM_TRY(be->upload(f->ctx, f->d_ids, f->h_ids, (size_t)R * sizeof(int32_t)));
    CM_TRY(be->upload(f->ctx, f->d_pos, f->h_pos, (size_t)R * sizeof(int32_t)));
    CM_TRY(be->upload(f->ctx, f->d_anchor, f->h_anchor, (size_t)n * sizeof(int32_t)));
    CM_TRY(be->upload(f->ctx, f->d_lo, f->h_lo, (size_t)n * sizeof(int32_t)));
    CM_TRY(be->upload(f->ctx, f->d_gather, f->h_gather, (size_t)n_sel * sizeof(int32_t)));
    CM_TRY(be->embed(f->ctx, f->x, f->d_ids, m->embed, m->embed_dt, R, D));
    for (int l = 0; l < g->n_layers; l++)
        CM_TRY(layer_fwd(f, l, n, T));
    /* the final norm, slots 1 .. B − 1 gathered slot-major, the LM head with its top-K */
    CM_TRY(be->rmsnorm(f->ctx, f->h, f->x, m->params[m->p_norm].data, R, D, g->rms_norm_eps, 0));
    CM_TRY(be->embed(f->ctx, f->hsel, f->d_gather, f->h, CM_DTYPE_F32, n_sel, D));
    const kn_lm_topk_params lp_ = {.R = n_sel,
                                   .V = m->V,
                                   .D = D,
                                   .K = f->Kt,
                                   .h = f->hsel,
                                   .labels = f->d_zero,
                                   .w = m->lm_head,
                                   .wdt = m->lm_head_dt,
                                   .ce = f->ce,
                                   .argmax = f->argmax,
                                   .topk_idx = f->topk_idx,
                                   .topk_val = f->topk_val,
                                   .label_logit = f->lab_logit};
    CM_TRY(be->lm_ce_topk(f->ctx, &lp_));
    if (f->v2)
        return selector_walk(f, n, anchor, drafts, probs);
    CM_TRY(be->download(f->ctx, f->h_topk, f->argmax, (size_t)n_sel * sizeof(int32_t)));
    if (probs) { /* p_max = exp(z_max − lse), lse = ce + z[label] of the zero label */
        CM_TRY(be->download(f->ctx, f->h_val, f->topk_val, (size_t)n_sel * sizeof(float)));
        CM_TRY(be->download(f->ctx, f->h_ce, f->ce, (size_t)n_sel * sizeof(float)));
        CM_TRY(be->download(f->ctx, f->h_lab, f->lab_logit, (size_t)n_sel * sizeof(float)));
    }
    for (int k = 1; k < B; k++)
        for (int i = 0; i < n; i++) {
            const int64_t r = (int64_t)(k - 1) * n + i;
            drafts[i * (B - 1) + k - 1] = f->h_topk[r];
            if (probs)
                probs[i * (B - 1) + k - 1] =
                    (float)exp((double)f->h_val[r] - ((double)f->h_ce[r] + (double)f->h_lab[r]));
        }
    return CM_OK;
}

cm_status dt_infer_draft_block(dt_infer *f, int block, int n, const int32_t *slots, const int32_t *anchor,
                               int32_t *drafts, float *probs) {
    if (block < 2 || block > f->B || (f->v2 && block < f->g->conv_kernel_size))
        return CM_FAIL(CM_ERR_INVALID_ARG, "a block of %d slots: this drafter drafts blocks of 2%s to %d", block,
                       f->v2 ? " (its conv_kernel_size)" : "", f->B);
    const int B = f->B; /* the buffers are sized for B; a shorter block uses their start */
    f->B        = block;
    cm_status st = dt_infer_draft(f, n, slots, anchor, drafts, probs);
    f->B        = B;
    return st;
}
