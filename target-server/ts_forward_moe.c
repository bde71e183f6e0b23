/* target-server/ts_forward_moe.c — the sparse MoE block of Qwen3.5-MoE and Qwen3-Next layers
 * (docs/moe.md): from the block's normed input h [T, D] into ws.o [T, D].
 *
 *   router logits = h · Wrᵀ [T, E]; moe_route: softmax in fp32, top K, renormalised (always on
 *   Qwen3.5-MoE, as norm_topk_prob says on Qwen3-Next);
 *   moe_group sorts the T·K (token, choice) pairs by expert; then the experts' gate and up
 *   GEMMs over their rows (the grouped GEMM reads each sorted row's token from h through
 *   moe_group's src; one GEMM per expert needs moe_gather's copy first), swiglu, the down
 *   GEMMs;
 *   the shared expert as a dense MLP of shared_expert_intermediate_size, and its gate's logit
 *   h · w_sgᵀ [T, 1];
 *   moe_combine: o[t] = Σ_k w[t, k] · y[row of (t, k)] + sigmoid(gate[t]) · shared[t].
 *
 * Every routed token is computed (no capacity limit, nothing dropped). The experts' GEMMs run
 * grouped (every expert in one launch, the row counts read on the device, nothing waits) on the
 * fused path: moe_gemm when the experts are BF16 and the widths multiples of 8, moe_gemm_fp8
 * when they are FP8 (the block's quantized input rows read through src, swiglu_fp8 between the
 * two products, the same W8A8 products as one gemm_fp8q per expert). Otherwise one GEMM per
 * expert over its rows, which needs each expert's row count on the host: one small download per
 * layer (E + 1 integers) that waits for the router. TANDEM_MOE_GEMM=loop forces the second, to
 * measure one beside the other. */
#include "ts_model_int.h"

#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

/* A config's experts are the kernels' to route. */
_Static_assert(CM_CFG_MAX_EXPERTS == KN_MOE_MAX_EXPERTS, "the config's and the kernels' expert limits differ");

static int has_moe(const ts_model *m) {
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].moe) return 1;
    return 0;
}

void ts_moe_release(ts_model *m) {
    ts_ws *w      = &m->ws;
    void  *bufs[] = {w->rlogits, w->ridx, w->roff, w->rsrc, w->rdst, w->rw, w->xg, w->eg, w->eu, w->eact, w->ey,
                     w->sh, w->shg, w->eact8, w->eact8s};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) m->be->free(m->ctx, bufs[i]);
    free(w->roff_host);
    w->rlogits = w->rw = w->eg = w->eu = w->ey = w->sh = w->shg = NULL;
    w->ridx = w->roff = w->rsrc = w->rdst = w->roff_host = NULL;
    w->xg = w->eact = NULL;
    w->eact8 = NULL;
    w->eact8s = NULL;
}

static int grouped(const ts_model *m, const ts_layer *L);

cm_status ts_moe_reserve(ts_model *m, int64_t T) {
    if (!has_moe(m)) return CM_OK;
    const kn_backend    *be = m->be;
    const cm_target_cfg *c  = &m->cfg;
    if (!be->moe_route || !be->moe_group || !be->moe_gather || !be->moe_combine)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "the %s backend has no mixture-of-experts kernels (moe_route, moe_group, "
                       "moe_gather, moe_combine)", be->name);
    ts_ws        *w  = &m->ws;
    const int64_t D = c->hidden_size, E = c->n_experts, K = c->n_experts_per_tok, Ie = c->moe_intermediate_size;
    const int64_t R = T * K;
    const size_t  act = m->fused ? 2 : 4; /* bf16 on the fused path */
    /* the grouped FP8 kernel may not run on this device: then the FP8 experts go one GEMM each
     * (a call with no rows tells, kn_backend.h) */
    for (int i = 0; i < m->n_layers && !m->moe_fp8_loop; i++)
        if (m->layers[i].moe && m->layers[i].ex_fp8 &&
            be->moe_gemm_fp8(m->ctx, NULL, NULL, NULL, NULL, 0, NULL, 1, NULL, NULL, NULL, NULL, NULL, 0, 1, 0, 0) ==
                CM_ERR_UNSUPPORTED) {
            CM_LOG_INFO("routed experts: %s", cm_last_error());
            m->moe_fp8_loop = 1;
        }
    /* the gathered rows, and gate and up in f32, only where some layer needs them: one GEMM per
     * expert reads xg and writes eg and eu; the grouped GEMMs write eg, eu unless moe_gemm_swiglu
     * does the bf16 ones; the grouped FP8 ones write swiglu quantized into eact8 */
    int loop = 0, fp8 = 0;
    for (int i = 0; i < m->n_layers; i++) {
        const int g = m->layers[i].moe ? grouped(m, &m->layers[i]) : -1;
        loop |= g == 0;
        fp8 |= g == 2;
    }
    const size_t  gu = loop || fp8 || !be->moe_gemm_swiglu ? 4 : 0, xg = loop ? act : 0;
    const int64_t Rp = kn_fp8_rows(R), Lq = (Ie + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    struct {
        void  **p;
        int64_t n;
        size_t  el;
    } plan[] = {
        {(void **)&w->rlogits, T * E, 4}, {(void **)&w->ridx, R, 4}, {(void **)&w->roff, E + 1, 4},
        {(void **)&w->rsrc, R, 4},        {(void **)&w->rdst, R, 4}, {(void **)&w->rw, R, 4},
        {&w->xg, R * D, xg},              {(void **)&w->eg, R * Ie, gu}, {(void **)&w->eu, R * Ie, gu},
        {&w->eact, R * Ie, act},          {(void **)&w->ey, R * D, 4}, {(void **)&w->sh, T * D, 4},
        {(void **)&w->shg, T, 4},         {(void **)&w->eact8, Rp * Ie, fp8 ? 1 : 0},
        {(void **)&w->eact8s, Rp * Lq, fp8 ? 4 : 0},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        if (plan[i].el) CM_TRY(be->alloc(m->ctx, plan[i].p, (size_t)(plan[i].n > 0 ? plan[i].n : 1) * plan[i].el));
    w->roff_host = malloc((size_t)(E + 1) * sizeof *w->roff_host);
    if (!w->roff_host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %lld expert offsets", (long long)(E + 1));
    return CM_OK;
}

/* The shared expert into ws.sh and its gate's logit into ws.shg (a dense MLP on the normed
 * input, as forward_mlp, with its own sizes). */
static cm_status shared_expert(ts_model *m, const ts_layer *L, int64_t T) {
    const kn_backend *be = m->be;
    ts_ws            *w  = &m->ws;
    const int64_t     D = m->cfg.hidden_size, Is = m->cfg.shared_expert_intermediate_size;
    CM_TRY(ts_gemm_h(m, w->big0, &L->sh_gate, T, Is, D));
    CM_TRY(ts_gemm_h(m, w->big1, &L->sh_up, T, Is, D));
    if (m->fused && L->sh_down.dtype == CM_DTYPE_F8_E4M3 && w->act8) {
        CM_TRY(be->swiglu_fp8(m->ctx, w->act8, w->act8s, w->big0, w->big1, CM_DTYPE_F32, T, Is));
        CM_TRY(ts_gemm(m, w->sh, (gemm_in){.q8 = w->act8, .s8 = w->act8s}, &L->sh_down, T, D, Is));
    } else if (m->fused) {
        CM_TRY(be->swiglu_bf16(m->ctx, w->act16, w->big0, w->big1, T * Is));
        CM_TRY(ts_gemm(m, w->sh, (gemm_in){.bf16 = w->act16}, &L->sh_down, T, D, Is));
    } else {
        CM_TRY(be->swiglu(m->ctx, w->big2, w->big0, w->big1, T * Is));
        CM_TRY(ts_gemm(m, w->sh, (gemm_in){.f32 = w->big2}, &L->sh_down, T, D, Is));
    }
    return ts_gemm_h(m, w->shg, &L->sh_router, T, 1, D);
}

/* A GEMM input starting at row r of a [rows, cols] matrix that is bf16 on the fused path, else
 * f32. */
static gemm_in rows_at(const ts_model *m, const void *base, int64_t r, int64_t cols) {
    if (m->fused) return (gemm_in){.bf16 = (const uint16_t *)base + r * cols};
    return (gemm_in){.f32 = (const float *)base + r * cols};
}

/* How this layer's experts run: 0 one GEMM per expert, 1 moe_gemm (BF16), 2 moe_gemm_fp8 (FP8). */
static int grouped(const ts_model *m, const ts_layer *L) {
    if (!m->fused || !m->moe_grouped || !L->ex_ptrs) return 0;
    if (L->ex_fp8) return !m->moe_fp8_loop && m->be->fp8_quantize_rows && m->be->swiglu_fp8 ? 2 : 0;
    return m->cfg.hidden_size % 8 == 0 && m->cfg.moe_intermediate_size % 8 == 0;
}

void ts_moe_log_plan(const ts_model *m) {
    const ts_layer *L = NULL;
    for (int i = 0; i < m->n_layers && !L; i++)
        if (m->layers[i].moe) L = &m->layers[i];
    if (!L) return;
    const int   g   = grouped(m, L);
    const char *why = g                                ? NULL
                      : !m->moe_grouped                ? "TANDEM_MOE_GEMM=loop"
                      : !m->fused                      ? "not the fused bf16 path"
                      : !L->ex_ptrs                    ? "the experts are not all BF16 or all FP8, or the backend has "
                                                         "no grouped kernel for them"
                      : L->ex_fp8                      ? "the grouped FP8 kernel does not run here"
                                                       : "hidden_size or moe_intermediate_size is not a multiple of 8";
    if (why)
        CM_LOG_INFO("routed experts: one GEMM per expert (%s)", why);
    else
        CM_LOG_INFO("routed experts: grouped, every expert's GEMMs in one %s call", g == 2 ? "moe_gemm_fp8" : "moe_gemm");
}

/* be->moe_gemm (act: be->moe_gemm_swiglu into act from w0 and w1) timed into *m->gemm_acc as
 * ts_gemm times a GEMM. */
static cm_status moe_gemm(ts_model *m, float *out0, float *out1, uint16_t *act, const void *inp, const int32_t *src,
                          void *const *w0, void *const *w1, int64_t R, int64_t N, int64_t K) {
    const uint16_t *const *a = (const uint16_t *const *)w0, *const *b = (const uint16_t *const *)w1;
    const int              E = m->cfg.n_experts, tk = m->cfg.n_experts_per_tok;
    double                 t0, t1;
    CM_TRY(ts_mark(m, &t0));
    CM_TRY(act ? m->be->moe_gemm_swiglu(m->ctx, act, inp, src, tk, a, b, m->ws.roff, R, E, N, K)
               : m->be->moe_gemm(m->ctx, out0, out1, inp, src, tk, a, b, m->ws.roff, R, E, N, K));
    CM_TRY(ts_mark(m, &t1));
    if (m->gemm_acc) *m->gemm_acc += t1 - t0;
    return CM_OK;
}

/* The experts through moe_gemm, reading each sorted row's token from the normed input itself
 * (no gathered copy): gate, up and swiglu in one call where the backend has moe_gemm_swiglu
 * (else gate and up in one call, then swiglu to bf16), then down. */
static cm_status experts_grouped(ts_model *m, const ts_layer *L, int64_t T) {
    ts_ws        *w = &m->ws;
    const int64_t D = m->cfg.hidden_size, Ie = m->cfg.moe_intermediate_size, E = m->cfg.n_experts;
    const int64_t R = T * m->cfg.n_experts_per_tok;
    if (m->be->moe_gemm_swiglu) {
        CM_TRY(moe_gemm(m, NULL, NULL, (uint16_t *)w->eact, w->h16, w->rsrc, L->ex_ptrs, L->ex_ptrs + E, R, Ie, D));
    } else {
        CM_TRY(moe_gemm(m, w->eg, w->eu, NULL, w->h16, w->rsrc, L->ex_ptrs, L->ex_ptrs + E, R, Ie, D));
        CM_TRY(m->be->swiglu_bf16(m->ctx, (uint16_t *)w->eact, w->eg, w->eu, R * Ie));
    }
    return moe_gemm(m, w->ey, NULL, NULL, w->eact, NULL, L->ex_ptrs + 2 * E, NULL, R, D, Ie);
}

/* be->moe_gemm_fp8 from (q, s) of mq quantized rows, timed as moe_gemm. t: the layer's table (the
 * 3E matrices, then their 3E scales), set j0 (and j1 ≥ 0: a second set into out1). */
static cm_status moe_gemm8(ts_model *m, float *out0, float *out1, const uint8_t *q, const float *s, int64_t mq,
                           const int32_t *src, void *const *t, int j0, int j1, int64_t R, int64_t N, int64_t K) {
    const int E = m->cfg.n_experts, tk = m->cfg.n_experts_per_tok;
    double    t0, t1;
    CM_TRY(ts_mark(m, &t0));
    CM_TRY(m->be->moe_gemm_fp8(m->ctx, out0, out1, q, s, mq, src, tk, (const uint8_t *const *)(t + j0 * E),
                               (const float *const *)(t + (3 + j0) * E),
                               j1 < 0 ? NULL : (const uint8_t *const *)(t + j1 * E),
                               j1 < 0 ? NULL : (const float *const *)(t + (3 + j1) * E), m->ws.roff, R, E, N, K));
    CM_TRY(ts_mark(m, &t1));
    if (m->gemm_acc) *m->gemm_acc += t1 - t0;
    return CM_OK;
}

/* FP8 experts through moe_gemm_fp8: gate and up from the block's quantized input (rows read
 * through src), swiglu_fp8 into eact8, then down. The same products as one gemm_fp8q per expert
 * on the gathered rows (quantization is per row, so gathering commutes with it). */
static cm_status experts_grouped8(ts_model *m, const ts_layer *L, int64_t T) {
    ts_ws        *w = &m->ws;
    const int64_t D = m->cfg.hidden_size, Ie = m->cfg.moe_intermediate_size, R = T * m->cfg.n_experts_per_tok;
    CM_TRY(ts_quant_h(m, T, D));
    CM_TRY(moe_gemm8(m, w->eg, w->eu, w->h8, w->h8s, kn_fp8_rows(T), w->rsrc, L->ex_ptrs, 0, 1, R, Ie, D));
    CM_TRY(m->be->swiglu_fp8(m->ctx, w->eact8, w->eact8s, w->eg, w->eu, CM_DTYPE_F32, R, Ie));
    return moe_gemm8(m, w->ey, NULL, w->eact8, w->eact8s, kn_fp8_rows(R), NULL, L->ex_ptrs, 2, -1, R, D, Ie);
}

/* The experts one GEMM each over its rows, from the row counts downloaded to the host. */
static cm_status experts_loop(ts_model *m, const ts_layer *L, int64_t T) {
    const kn_backend *be = m->be;
    kn_ctx           *cx = m->ctx;
    ts_ws            *w  = &m->ws;
    const int64_t     D = m->cfg.hidden_size, Ie = m->cfg.moe_intermediate_size, R = T * m->cfg.n_experts_per_tok;
    const int         E = m->cfg.n_experts;
    CM_TRY(be->moe_gather(cx, w->xg, m->fused ? (const void *)w->h16 : (const void *)w->h,
                          m->fused ? CM_DTYPE_BF16 : CM_DTYPE_F32, w->rsrc, T, m->cfg.n_experts_per_tok, D));
    CM_TRY(be->download(cx, w->roff_host, w->roff, (size_t)(E + 1) * sizeof(int32_t)));
    const int32_t *off = w->roff_host;
    for (int e = 0; e < E; e++) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        CM_TRY(ts_gemm(m, w->eg + r0 * Ie, rows_at(m, w->xg, r0, D), &L->ex_gate[e], n, Ie, D));
        CM_TRY(ts_gemm(m, w->eu + r0 * Ie, rows_at(m, w->xg, r0, D), &L->ex_up[e], n, Ie, D));
    }
    if (m->fused)
        CM_TRY(be->swiglu_bf16(cx, (uint16_t *)w->eact, w->eg, w->eu, R * Ie));
    else
        CM_TRY(be->swiglu(cx, (float *)w->eact, w->eg, w->eu, R * Ie));
    for (int e = 0; e < E; e++) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        CM_TRY(ts_gemm(m, w->ey + r0 * D, rows_at(m, w->eact, r0, Ie), &L->ex_down[e], n, D, Ie));
    }
    return CM_OK;
}

cm_status ts_forward_moe(ts_model *m, const ts_layer *L, int li, int64_t T, const ts_capture *cap) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    const int64_t        D = c->hidden_size;
    const int            E = c->n_experts, K = c->n_experts_per_tok;

    CM_TRY(ts_gemm_h(m, w->rlogits, &L->router, T, E, D));
    CM_TRY(be->moe_route(cx, w->ridx, w->rw, w->rlogits, T, E, K, c->norm_topk_prob));
    if (cap && cap->experts)
        CM_TRY(be->download(cx, cap->experts + (size_t)li * (size_t)T * (size_t)K, w->ridx,
                            (size_t)(T * K) * sizeof(int32_t)));
    CM_TRY(be->moe_group(cx, w->roff, w->rsrc, w->rdst, w->ridx, T, E, K));
    double *const acc    = m->gemm_acc; /* the experts' GEMMs are timed apart too */
    const double  before = m->tm.expert_gemm_ms;
    m->gemm_acc          = &m->tm.expert_gemm_ms;
    const int g = grouped(m, L);
    CM_TRY(g == 2 ? experts_grouped8(m, L, T) : g ? experts_grouped(m, L, T) : experts_loop(m, L, T));
    if (m->timing) {
        m->tm.moe_layers++;
        m->tm.moe_grouped_layers += g > 0;
    }
    m->gemm_acc = acc;
    if (acc) *acc += m->tm.expert_gemm_ms - before;
    const int shared = c->shared_expert_intermediate_size > 0;
    if (shared) CM_TRY(shared_expert(m, L, T));
    return be->moe_combine(cx, w->o, w->ey, w->rdst, w->rw, shared ? w->sh : NULL, shared ? w->shg : NULL, T, K, D);
}
