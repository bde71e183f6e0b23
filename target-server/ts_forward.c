/* target-server/ts_forward.c — the frozen forward over packed sequences (docs/target.md), from
 * scratch (ts_model_forward) or continued from a decoding cache (ts_model_forward_cached, whose
 * cache ts_cache.c owns), with per-layer capture and the head at all rows or at chosen ones.
 *
 * Activations are F32; the backend's GEMM mode decides the precision of matrix products. When
 * the backend's gemm rounds its inputs to bf16 anyway (cuda, --precision bf16) the forward takes
 * the fused path: the producers of GEMM inputs (the norms, swiglu, the gated norm) write them as
 * bf16 themselves, the residual add runs inside the norm that follows it, and the GDN conv,
 * q/k/v split and q/k l2norms are one op: the same products without the conversion passes. The
 * workspace is sized for the largest batch seen and reused. */
#include "ts_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_time.h"

void ts_ws_release(ts_model *m) {
    ts_ws *w = &m->ws;
    void  *bufs[] = {w->ids, w->cu, w->pos, w->x, w->h, w->o, w->big0, w->big1, w->big2, w->q, w->k, w->v,
                     w->gate, w->z, w->a, w->b, w->g, w->beta, w->attn, w->logits, w->h16, w->act16, w->h8, w->h8s, w->act8, w->act8s};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) m->be->free(m->ctx, bufs[i]);
    ts_moe_release(m);
    free(w->pos_host);
    memset(w, 0, sizeof *w);
}

static int has_fp8(const ts_model *m);

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Sizes the workspace for T tokens (cu_seqlens fits in T + 1 since sequences are non-empty). */
static cm_status ws_reserve(ts_model *m, int64_t T, int want_logits) {
    ts_ws *w = &m->ws;
    if (T <= w->T && (!want_logits || w->logits)) return CM_OK;
    ts_ws_release(m);
    const cm_target_cfg *c  = &m->cfg;
    const int64_t        D  = c->hidden_size;
    /* the dense MLP's and the shared expert's hidden rows use the same buffers */
    const int64_t I = c->intermediate_size > c->shared_expert_intermediate_size ? c->intermediate_size
                                                                                 : c->shared_expert_intermediate_size;
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
    if (has_fp8(m) && m->be->fp8_quantize_rows) { /* the normed input, quantized (gemm_h) */
        const int64_t Tp = kn_fp8_rows(T), L = (D + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
        CM_TRY(m->be->alloc(m->ctx, (void **)&w->h8, (size_t)(Tp * D)));
        CM_TRY(m->be->alloc(m->ctx, (void **)&w->h8s, (size_t)(Tp * L) * sizeof(float)));
        if (m->be->swiglu_fp8) { /* the down projection's (and out_proj's) input, written quantized */
            const int64_t K8 = max3(I, nv * dv, 1);
            CM_TRY(m->be->alloc(m->ctx, (void **)&w->act8, (size_t)(Tp * K8)));
            CM_TRY(m->be->alloc(m->ctx, (void **)&w->act8s, (size_t)(Tp * ((K8 + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK)) * 4));
        }
    }
    CM_TRY(ts_moe_reserve(m, T));
    w->pos_host = malloc((size_t)T * sizeof *w->pos_host);
    if (!w->pos_host) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate positions for %lld tokens", (long long)T);
    w->T = T;
    return CM_OK;
}

// ---- timing (TANDEM_LAYER_TIMING / ts_model_set_timing): host clock after a device sync

cm_status ts_mark(ts_model *m, double *t) {
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

/* The backend's GEMM for the weight's type and the input's form. FP8 weights quantize an F32 or
 * BF16 input inside (1 × 128 groups). */
static cm_status gemm_call(ts_model *m, void *out, gemm_in in, const ts_mat *w, int64_t M, int64_t N, int64_t K) {
    if (in.acc && in.q8)
        return m->be->gemm_fp8q_acc(m->ctx, out, in.q8, in.s8, w->data, w->scale, M, N, K);
    if (in.acc) return m->be->gemm_bf16in_acc(m->ctx, out, in.bf16, w->data, w->dtype, M, N, K);
    if (in.q8)
        return m->be->gemm_fp8q(m->ctx, out, in.out_bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32, in.q8, in.s8, w->data,
                                w->scale, M, N, K);
    if (in.out_bf16 && in.bf16 && m->be->matmul && (w->dtype == CM_DTYPE_BF16 || w->dtype == CM_DTYPE_F32)) {
        const kn_matmul_params p = {.M = M, .N = N, .K = K, .a = in.bf16, .a_dt = CM_DTYPE_BF16, .lda = K,
                                    .b = w->data, .b_dt = w->dtype, .ldb = K, .trans_b = 1,
                                    .c = out, .c_dt = CM_DTYPE_BF16, .ldc = N};
        return m->be->matmul(m->ctx, &p);
    }
    if (in.out_bf16)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a bf16 product is written from a quantized input, or from a bf16 one "
                                           "through matmul with a BF16 or F32 weight");
    if (w->dtype == CM_DTYPE_F8_E4M3)
        return m->be->gemm_fp8(m->ctx, out, in.bf16 ? (const void *)in.bf16 : (const void *)in.f32,
                               in.bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32, w->data, w->scale, M, N, K);
    if (in.bf16) return m->be->gemm_bf16in(m->ctx, out, in.bf16, w->data, w->dtype, M, N, K);
    return m->be->gemm(m->ctx, out, in.f32, w->data, w->dtype, M, N, K);
}

/* gemm_call, timed into *m->gemm_acc when timing is on (an input's quantization, done before,
 * is the producer's work, not the GEMM's). */
cm_status ts_gemm(ts_model *m, void *out, gemm_in in, const ts_mat *w, int64_t M, int64_t N, int64_t K) {
    if (!m->timing) return gemm_call(m, out, in, w, M, N, K);
    double t0, t1;
    CM_TRY(ts_mark(m, &t0));
    CM_TRY(gemm_call(m, out, in, w, M, N, K));
    CM_TRY(ts_mark(m, &t1));
    if (m->gemm_acc) *m->gemm_acc += t1 - t0;
    return CM_OK;
}

static cm_status gemm(ts_model *m, float *out, const float *inp, const ts_mat *w, int64_t M, int64_t N, int64_t K) {
    return ts_gemm(m, out, (gemm_in){.f32 = inp}, w, M, N, K);
}

static cm_status gemm16(ts_model *m, float *out, const uint16_t *inp, const ts_mat *w, int64_t M, int64_t N,
                        int64_t K) {
    return ts_gemm(m, out, (gemm_in){.bf16 = inp}, w, M, N, K);
}

static cm_status gemm8q(ts_model *m, float *out, const uint8_t *q, const float *s, const ts_mat *w, int64_t M,
                        int64_t N, int64_t K) {
    return ts_gemm(m, out, (gemm_in){.q8 = q, .s8 = s}, w, M, N, K);
}

/* A block's output projection (out_proj, down_proj) from its bf16 or quantized input: on the
 * fused path added onto the residual stream x by the GEMM itself where the backend can
 * (m->residual_gemm, which implies m->fused; ws.o_added: the next norm then reads x alone), else
 * written to ws.o for the caller or the next norm to add. */
static cm_status out_gemm(ts_model *m, gemm_in in, const ts_mat *wt, int64_t T, int64_t N, int64_t K) {
    ts_ws    *w   = &m->ws;
    const int can = in.q8 ? m->be->gemm_fp8q_acc != NULL
                          : in.bf16 && wt->dtype != CM_DTYPE_F8_E4M3 && m->be->gemm_bf16in_acc != NULL;
    if (!m->residual_gemm || !can) return ts_gemm(m, w->o, in, wt, T, N, K);
    in.acc     = 1;
    w->o_added = 1;
    return ts_gemm(m, w->x, in, wt, T, N, K);
}

/* The projections' GEMM: from the bf16 normed input on the fused path, else from h. With an FP8
 * weight the normed input is quantized once (ws.h8, until the next norm rewrites it) for every
 * projection that reads it, and the product runs from there. */
cm_status ts_quant_h(ts_model *m, int64_t M, int64_t K) {
    ts_ws *ws = &m->ws;
    if (!ws->h8_valid) {
        CM_TRY(m->be->fp8_quantize_rows(m->ctx, ws->h8, ws->h8s, m->fused ? (const void *)ws->h16 : (const void *)ws->h,
                                        m->fused ? CM_DTYPE_BF16 : CM_DTYPE_F32, M, K));
        ws->h8_valid = 1;
    }
    return CM_OK;
}

cm_status ts_gemm_h(ts_model *m, float *out, const ts_mat *w, int64_t M, int64_t N, int64_t K) {
    ts_ws *ws = &m->ws;
    if (w->dtype != CM_DTYPE_F8_E4M3 || !m->be->gemm_fp8q || !ws->h8)
        return m->fused ? gemm16(m, out, ws->h16, w, M, N, K) : gemm(m, out, ws->h, w, M, N, K);
    CM_TRY(ts_quant_h(m, M, K));
    return gemm8q(m, out, ws->h8, ws->h8s, w, M, N, K);
}

/* Whether any GEMM weight of the loaded layers is FP8 (then the workspace holds ws.h8). */
static int has_fp8(const ts_model *m) {
    for (int i = 0; i < m->n_layers; i++) {
        const ts_layer *L = &m->layers[i];
        const ts_mat   *w[] = {&L->gate_proj, &L->up_proj, &L->in_qkv, &L->in_z, &L->q_proj, &L->k_proj, &L->v_proj,
                               &L->sh_gate, &L->sh_up};
        for (size_t j = 0; j < sizeof w / sizeof w[0]; j++)
            if (w[j]->dtype == CM_DTYPE_F8_E4M3) return 1;
        if (L->moe && L->ex_fp8) return 1;
    }
    return 0;
}

static int fp8w(const ts_mat *w) { return w->dtype == CM_DTYPE_F8_E4M3; }

/* Whether the bf16 output of layer L's input norm (post = 0) or post-attention norm (post = 1)
 * has a reader once ws.h8 holds it quantized: a projection from it that is not FP8 (ts_gemm_h),
 * or a MoE block (its router and experts read ws.h16). */
static int reads_h16(const ts_layer *L, int post) {
    if (post) return L->moe || !fp8w(&L->gate_proj) || !fp8w(&L->up_proj);
    if (L->type == CM_LAYER_TYPE_LINEAR_ATTENTION)
        return !fp8w(&L->in_qkv) || !fp8w(&L->in_z) || !fp8w(&L->in_a) || !fp8w(&L->in_b);
    return !fp8w(&L->q_proj) || !fp8w(&L->k_proj) || !fp8w(&L->v_proj);
}

/* A block's input norm into ws.h (unfused) or ws.h16, the residual y added to x first on the
 * fused path (the unfused one has added it). With FP8 weights the fused norm also writes ws.h8
 * where the backend fuses it (and leaves ws.h16 unwritten when nothing reads it, per
 * reads_h16); otherwise ts_quant_h quantizes h on first use. */
static cm_status block_norm(ts_model *m, const float *y, const float *weight, int64_t T, const ts_layer *L,
                            int post) {
    const cm_target_cfg *c = &m->cfg;
    ts_ws               *w = &m->ws;
    const int64_t        D = c->hidden_size;
    w->h8_valid = 0;
    if (!m->fused) return m->be->rmsnorm(m->ctx, w->h, w->x, weight, T, D, c->rms_norm_eps, 1);
    if (w->h8 && m->be->add_rmsnorm_fp8) {
        uint16_t *h16 = m->be->gemm_fp8q && !reads_h16(L, post) ? NULL : w->h16;
        cm_status st =
            m->be->add_rmsnorm_fp8(m->ctx, h16, w->h8, w->h8s, w->x, y, weight, T, D, c->rms_norm_eps, 1);
        if (st != CM_ERR_UNSUPPORTED) {
            w->h8_valid = st == CM_OK;
            return st;
        }
    }
    return m->be->add_rmsnorm_bf16(m->ctx, w->h16, w->x, y, weight, T, D, c->rms_norm_eps, 1);
}

/* The GDN short conv, the q/k/v split and the q/k l2norms, from a decoding cache: the conv
 * continues from the cache's state (advanced now when the step says how far, else the conv
 * input is kept for ts_cache_commit). */
static cm_status gdn_conv_cached(ts_model *m, const ts_layer *L, int li, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    ts_cache            *ch = m->cache;
    const int nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t conv_dim = 2 * (int64_t)nk * dk + (int64_t)nv * dv;
    const int32_t *adv = m->step->n_adv ? ch->d_adv : NULL;
    CM_TRY(be->conv1d_silu_cached(cx, w->big1, w->big0, L->conv_w, ch->conv[li], ch->d_slots, adv, w->cu, n_seq, T,
                                  conv_dim, c->lin_conv_kernel));
    if (!adv) CM_TRY(be->copy2d(cx, ch->sx[li], conv_dim, w->big0, conv_dim, T, conv_dim));
    CM_TRY(be->copy2d(cx, w->q, (int64_t)nk * dk, w->big1, conv_dim, T, (int64_t)nk * dk));
    CM_TRY(be->copy2d(cx, w->k, (int64_t)nk * dk, w->big1 + (int64_t)nk * dk, conv_dim, T, (int64_t)nk * dk));
    CM_TRY(be->copy2d(cx, w->v, (int64_t)nv * dv, w->big1 + 2 * (int64_t)nk * dk, conv_dim, T, (int64_t)nv * dv));
    CM_TRY(be->l2norm(cx, w->q, w->q, T * nk, dk, 1e-6f));
    return be->l2norm(cx, w->k, w->k, T * nk, dk, 1e-6f);
}

/* The gated delta rule from a decoding cache's states; a step without n_adv keeps k, v, g and
 * beta for ts_cache_commit. */
static cm_status gdn_core_cached(ts_model *m, int li, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    ts_cache            *ch = m->cache;
    const int nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int32_t *adv = m->step->n_adv ? ch->d_adv : NULL;
    CM_TRY(be->gdn_cached(cx, w->attn, w->q, w->k, w->v, w->g, w->beta, ch->state[li], ch->d_slots, adv, w->cu, n_seq,
                          T, nk, nv, dk, dv, 1.0f / sqrtf((float)dk)));
    if (adv) return CM_OK;
    CM_TRY(be->copy2d(cx, ch->sk[li], (int64_t)nk * dk, w->k, (int64_t)nk * dk, T, (int64_t)nk * dk));
    CM_TRY(be->copy2d(cx, ch->sv[li], (int64_t)nv * dv, w->v, (int64_t)nv * dv, T, (int64_t)nv * dv));
    CM_TRY(be->copy2d(cx, ch->sg[li], nv, w->g, nv, T, nv));
    return be->copy2d(cx, ch->sb[li], nv, w->beta, nv, T, nv);
}

/* The gated delta rule from the bf16 q (with its scale), k and v of gdn_conv_qkv_bf16; where the
 * backend refuses the shape, from them widened to F32 (scale 1). */
static cm_status gdn_core16(ts_model *m, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    const int nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const uint16_t *q = (const uint16_t *)w->q, *k = (const uint16_t *)w->k, *v = (const uint16_t *)w->v;
    cm_status st = be->gated_delta_rule_bf16(cx, w->attn, q, k, v, w->g, w->beta, w->cu, n_seq, T, nk, nv, dk, dv);
    if (st != CM_ERR_UNSUPPORTED) return st;
    const int64_t qk = (int64_t)nk * dk, vd = (int64_t)nv * dv;
    float        *qf = w->big1, *kf = w->big1 + T * qk, *vf = w->big2;
    CM_TRY(be->cast2d(cx, qf, CM_DTYPE_F32, qk, q, CM_DTYPE_BF16, qk, T, qk));
    CM_TRY(be->cast2d(cx, kf, CM_DTYPE_F32, qk, k, CM_DTYPE_BF16, qk, T, qk));
    CM_TRY(be->cast2d(cx, vf, CM_DTYPE_F32, vd, v, CM_DTYPE_BF16, vd, T, vd));
    return be->gated_delta_rule(cx, w->attn, qf, kf, vf, w->g, w->beta, w->cu, n_seq, T, nk, nv, dk, dv, 1.0f);
}

static cm_status forward_gdn(ts_model *m, const ts_layer *L, int li, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    const int64_t        D  = c->hidden_size;
    const int nk = c->lin_n_k_heads, nv = c->lin_n_v_heads, dk = c->lin_k_head_dim, dv = c->lin_v_head_dim;
    const int64_t conv_dim = 2 * (int64_t)nk * dk + (int64_t)nv * dv;
    CM_TRY(ts_gemm_h(m, w->big0, &L->in_qkv, T, conv_dim, D));
    CM_TRY(ts_gemm_h(m, w->z, &L->in_z, T, (int64_t)nv * dv, D));
    CM_TRY(ts_gemm_h(m, w->b, &L->in_b, T, nv, D));
    CM_TRY(ts_gemm_h(m, w->a, &L->in_a, T, nv, D));
    /* the fused op may refuse a shape (a long conv kernel, very wide heads): then the chain. On
     * the fused path it writes q·scale, k and v in bf16, the operands the chunked core rounds
     * to bf16 anyway, and the core reads them so (the same bits, without its own copies) */
    const float scale = 1.0f / sqrtf((float)dk);
    int         qkv16 = 0;
    cm_status   cst   = CM_ERR_UNSUPPORTED;
    if (m->cache)
        cst = gdn_conv_cached(m, L, li, T, n_seq);
    else if (m->fused && be->gdn_conv_qkv_bf16 && be->gated_delta_rule_bf16 && be->cast2d) {
        cst   = be->gdn_conv_qkv_bf16(cx, (uint16_t *)w->q, (uint16_t *)w->k, (uint16_t *)w->v, w->big0, L->conv_w,
                                      w->cu, n_seq, T, nk, nv, dk, dv, c->lin_conv_kernel, 1e-6f, scale);
        qkv16 = cst == CM_OK;
    } else if (m->fused)
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
    CM_TRY(ts_mark(m, &t0));
    if (m->cache)
        CM_TRY(gdn_core_cached(m, li, T, n_seq));
    else if (qkv16)
        CM_TRY(gdn_core16(m, T, n_seq));
    else
        CM_TRY(be->gated_delta_rule(cx, w->attn, w->q, w->k, w->v, w->g, w->beta, w->cu, n_seq, T, nk, nv, dk, dv,
                                    scale));
    CM_TRY(ts_mark(m, &t1));
    m->tm.gdn_core_ms += t1 - t0;
    if (m->fused && L->out_proj.dtype == CM_DTYPE_F8_E4M3 && w->act8 && be->rmsnorm_gated_fp8 && be->gemm_fp8q) {
        /* the norm writes out_proj's input quantized, where the backend fuses the shape */
        cm_status st = be->rmsnorm_gated_fp8(cx, w->act8, w->act8s, w->attn, w->z, L->gdn_norm, T, nv, dv,
                                             c->rms_norm_eps);
        if (st == CM_OK)
            return out_gemm(m, (gemm_in){.q8 = w->act8, .s8 = w->act8s}, &L->out_proj, T, D, (int64_t)nv * dv);
        if (st != CM_ERR_UNSUPPORTED) return st;
    }
    if (m->fused) {
        CM_TRY(be->rmsnorm_gated_bf16(cx, w->act16, w->attn, w->z, L->gdn_norm, T * nv, dv, c->rms_norm_eps));
        return out_gemm(m, (gemm_in){.bf16 = w->act16}, &L->out_proj, T, D, (int64_t)nv * dv);
    }
    CM_TRY(be->rmsnorm_gated(cx, w->attn, w->attn, w->z, L->gdn_norm, T * nv, dv, c->rms_norm_eps));
    return gemm(m, w->o, w->attn, &L->out_proj, T, D, (int64_t)nv * dv);
}

static cm_status forward_attention(ts_model *m, const ts_layer *L, int li, int64_t T, int n_seq) {
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    const cm_target_cfg *c  = &m->cfg;
    ts_ws               *w  = &m->ws;
    const int64_t        D  = c->hidden_size;
    const int            nq = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim;
    const float         *gate = c->attn_output_gate ? w->gate : NULL;
    if (gate) /* q_proj rows interleave [q_h | gate_h] per head */
        CM_TRY(ts_gemm_h(m, w->big0, &L->q_proj, T, 2 * (int64_t)nq * hd, D));
    else
        CM_TRY(ts_gemm_h(m, w->q, &L->q_proj, T, (int64_t)nq * hd, D));
    CM_TRY(ts_gemm_h(m, w->k, &L->k_proj, T, (int64_t)nkv * hd, D));
    CM_TRY(ts_gemm_h(m, w->v, &L->v_proj, T, (int64_t)nkv * hd, D));
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
    CM_TRY(ts_mark(m, &t0));
    if (m->cache) { /* the new keys and values join the cache, and the queries see all of it */
        ts_cache *ch = m->cache;
        CM_TRY(be->kv_cache_write(cx, ch->kc[li], ch->vc[li], w->k, w->v, ch->d_slots, ch->d_base, w->cu, n_seq, T,
                                  nkv, hd, ch->max_len));
        CM_TRY(be->attention_cached(cx, w->attn, w->q, ch->kc[li], ch->vc[li], gate, ch->d_slots, ch->d_base, w->cu,
                                    n_seq, T, nq, nkv, hd, ch->max_len, 1.0f / sqrtf((float)hd)));
    } else {
        CM_TRY(be->attention(cx, w->attn, w->q, w->k, w->v, gate, w->cu, n_seq, T, nq, nkv, hd,
                             1.0f / sqrtf((float)hd)));
    }
    CM_TRY(ts_mark(m, &t1));
    m->tm.attn_core_ms += t1 - t0;
    return gemm(m, w->o, w->attn, &L->o_proj, T, D, (int64_t)nq * hd);
}

/* The MLP. With FP8 weights the gate and up products are written in bf16, as a serving
 * engine's FP8 linear writes them (half the bytes for SwiGLU to read), and SwiGLU writes the
 * down projection's input quantized. */
static cm_status forward_mlp(ts_model *m, const ts_layer *L, int64_t T) {
    const cm_target_cfg *c = &m->cfg;
    ts_ws               *w = &m->ws;
    const int64_t        D = c->hidden_size, I = c->intermediate_size;
    const int            fp8 = L->gate_proj.dtype == CM_DTYPE_F8_E4M3 && L->up_proj.dtype == CM_DTYPE_F8_E4M3 &&
                    L->down_proj.dtype == CM_DTYPE_F8_E4M3 && w->h8 && w->act8 && m->be->gemm_fp8q;
    if (fp8) {
        CM_TRY(ts_quant_h(m, T, D));
        const gemm_in in = {.q8 = w->h8, .s8 = w->h8s, .out_bf16 = 1};
        CM_TRY(ts_gemm(m, w->big0, in, &L->gate_proj, T, I, D));
        CM_TRY(ts_gemm(m, w->big1, in, &L->up_proj, T, I, D));
        CM_TRY(m->be->swiglu_fp8(m->ctx, w->act8, w->act8s, w->big0, w->big1, CM_DTYPE_BF16, T, I));
        return out_gemm(m, (gemm_in){.q8 = w->act8, .s8 = w->act8s}, &L->down_proj, T, D, I);
    }
    if (m->bf16_products && !fp8w(&L->gate_proj) && !fp8w(&L->up_proj) && !fp8w(&L->down_proj)) {
        /* gate and up written bf16 (the rounding a bf16 Linear does), swiglu reads them at half the bytes */
        const gemm_in in = {.bf16 = w->h16, .out_bf16 = 1};
        CM_TRY(ts_gemm(m, w->big0, in, &L->gate_proj, T, I, D));
        CM_TRY(ts_gemm(m, w->big1, in, &L->up_proj, T, I, D));
        CM_TRY(m->be->swiglu_typed(m->ctx, w->act16, CM_DTYPE_BF16, w->big0, w->big1, CM_DTYPE_BF16, T * I));
        return out_gemm(m, (gemm_in){.bf16 = w->act16}, &L->down_proj, T, D, I);
    }
    CM_TRY(ts_gemm_h(m, w->big0, &L->gate_proj, T, I, D));
    CM_TRY(ts_gemm_h(m, w->big1, &L->up_proj, T, I, D));
    if (m->fused && L->down_proj.dtype == CM_DTYPE_F8_E4M3 && w->act8) { /* swiglu writes it quantized */
        CM_TRY(m->be->swiglu_fp8(m->ctx, w->act8, w->act8s, w->big0, w->big1, CM_DTYPE_F32, T, I));
        return out_gemm(m, (gemm_in){.q8 = w->act8, .s8 = w->act8s}, &L->down_proj, T, D, I);
    }
    if (m->fused) {
        CM_TRY(m->be->swiglu_bf16(m->ctx, w->act16, w->big0, w->big1, T * I));
        return out_gemm(m, (gemm_in){.bf16 = w->act16}, &L->down_proj, T, D, I);
    }
    CM_TRY(m->be->swiglu(m->ctx, w->big2, w->big0, w->big1, T * I));
    return gemm(m, w->o, w->big2, &L->down_proj, T, D, I);
}

/* The head at cap->head_rows: the final norm of x (all rows, into h), those rows gathered, then
 * their argmax (through lm_ce, which never holds a row of logits) and/or their logits. */
static cm_status head_rows(ts_model *m, int64_t T, const ts_capture *cap) {
    const cm_target_cfg *c  = &m->cfg;
    const kn_backend    *be = m->be;
    kn_ctx              *cx = m->ctx;
    ts_ws               *w  = &m->ws;
    const int64_t        D = c->hidden_size, V = c->vocab_size, R = cap->n_head_rows;
    for (int64_t r = 0; r < R; r++)
        if (cap->head_rows[r] < 0 || cap->head_rows[r] >= T)
            return CM_FAIL(CM_ERR_INVALID_ARG, "head row %lld is token %d, outside the batch's %lld tokens",
                           (long long)r, cap->head_rows[r], (long long)T);
    const int want_logits = cap->head_logits != NULL;
    if (R > m->head_cap || (want_logits && !m->head_has_logits)) {
        void *old[] = {m->head_ids, m->head_am, m->head_lab, m->head_h, m->head_ce, m->head_logits};
        for (size_t j = 0; j < sizeof old / sizeof old[0]; j++) be->free(cx, old[j]);
        m->head_ids = m->head_am = m->head_lab = NULL;
        m->head_h = m->head_ce = m->head_logits = NULL;
        m->head_cap = m->head_has_logits = 0;
        const int64_t n = R > 64 ? R : 64;
        CM_TRY(be->alloc(cx, (void **)&m->head_ids, (size_t)n * 4));
        CM_TRY(be->alloc(cx, (void **)&m->head_am, (size_t)n * 4));
        CM_TRY(be->alloc(cx, (void **)&m->head_lab, (size_t)n * 4)); /* zeros: lm_ce wants labels */
        CM_TRY(be->alloc(cx, (void **)&m->head_ce, (size_t)n * 4));
        CM_TRY(be->alloc(cx, (void **)&m->head_h, (size_t)(n * D) * 4));
        if (want_logits) CM_TRY(be->alloc(cx, (void **)&m->head_logits, (size_t)n * (size_t)V * 4));
        m->head_cap = n;
        m->head_has_logits = want_logits;
    }
    CM_TRY(be->rmsnorm(cx, w->h, w->x, m->final_norm, T, D, c->rms_norm_eps, 1));
    CM_TRY(be->upload(cx, m->head_ids, cap->head_rows, (size_t)R * 4));
    CM_TRY(be->embed(cx, m->head_h, m->head_ids, w->h, CM_DTYPE_F32, R, D)); /* a gather of rows */
    if (cap->head_argmax) {
        CM_TRY(be->lm_ce(cx, NULL, m->head_ce, m->head_am, m->head_h, m->head_lab, NULL, m->lm_head.data,
                         m->lm_head.dtype, R, V, D));
        CM_TRY(be->download(cx, cap->head_argmax, m->head_am, (size_t)R * 4));
    }
    if (want_logits) {
        CM_TRY(gemm(m, m->head_logits, m->head_h, &m->lm_head, R, V, D));
        CM_TRY(be->download(cx, cap->head_logits, m->head_logits, (size_t)R * (size_t)V * 4));
    }
    return CM_OK;
}

cm_status ts_forward_run(ts_model *m, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                             const ts_capture *cap) {
    const cm_target_cfg *c         = &m->cfg;
    const kn_backend    *be        = m->be;
    kn_ctx              *cx        = m->ctx;
    const int64_t        D         = c->hidden_size;
    const int            rows_head = cap->n_head_rows > 0;
    const int            want_head = cap->final_norm || cap->logits || rows_head;
    CM_TRY(ts_batch_validate(c, ids, T, cu, n_seq));
    CM_TRY(ts_model_bind(m)); /* this thread may have run another GPU's context last */
    const int first = m->first_layer;
    for (int i = 0; i < cap->n_layers; i++)
        if (cap->layers[i] < first || cap->layers[i] >= m->n_layers || (i && cap->layers[i] <= cap->layers[i - 1]))
            return CM_FAIL(CM_ERR_INVALID_ARG, "capture layer %d is out of range [%d, %d) or out of order",
                           cap->layers[i], first, m->n_layers);
    if ((first > 0) != (cap->x_in || cap->x_in_dev) || (cap->x_in && cap->x_in_dev))
        return CM_FAIL(CM_ERR_INVALID_ARG, first > 0 ? "a stage from layer %d needs one input (x_in or x_in_dev)"
                                                     : "an input (x_in) given to the model's first stage (layer %d)",
                       first);
    if (cap->x_out_dev && !cap->x_out_ctx)
        return CM_FAIL(CM_ERR_INVALID_ARG, "x_out_dev needs its context (x_out_ctx)");
    if (want_head && !m->has_head)
        return CM_FAIL(CM_ERR_INVALID_ARG, "final norm or logits asked for, but the lm head was not loaded");
    if (rows_head && (cap->final_norm || cap->logits || !cap->head_rows || (!cap->head_argmax && !cap->head_logits)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "the head at chosen rows needs head_rows and an output (argmax or logits), "
                                           "and no final_norm or logits of every row");
    /* a cached forward runs every layer: each one's cache must see the new tokens */
    /* and a stage that hands its output on runs all its layers */
    int last = want_head || m->cache || cap->x_out || cap->x_out_dev ? m->n_layers - 1
                                                   : (cap->n_layers ? cap->layers[cap->n_layers - 1] : first - 1);

    double tf0, ta, tb;
    CM_TRY(ts_mark(m, &tf0));
    CM_TRY(ws_reserve(m, T, cap->logits != NULL));
    ts_ws   *w   = &m->ws;
    int32_t *pos = w->pos_host;
    for (int s = 0; s < n_seq; s++) /* positions restart at 0 in every packed sequence (or go on from the cache) */
        for (int32_t t = cu[s]; t < cu[s + 1]; t++) pos[t] = t - cu[s] + (m->cache ? m->step->base[s] : 0);
    CM_TRY(be->upload(cx, w->pos, pos, (size_t)T * sizeof *pos));
    CM_TRY(be->upload(cx, w->ids, ids, (size_t)T * sizeof *ids));
    CM_TRY(be->upload(cx, w->cu, cu, (size_t)(n_seq + 1) * sizeof *cu));

    if (cap->x_in)
        CM_TRY(be->upload(cx, w->x, cap->x_in, (size_t)(T * D) * sizeof(float)));
    else if (cap->x_in_dev)
        CM_TRY(be->copy_peer(cx, cx, w->x, cap->x_in_dev, (size_t)(T * D) * sizeof(float)));
    else
        CM_TRY(be->embed(cx, w->x, w->ids, m->embed.data, m->embed.dtype, T, D));
    int next_cap = 0;
    /* fused path: the MLP output still to be added to x, by the next layer's input norm */
    const float *pending = NULL;
    CM_TRY(ts_mark(m, &ta));
    m->tm.other_ms += ta - tf0;
    for (int i = first; i <= last; i++) {
        const ts_layer *L   = &m->layers[i];
        const int       gdn = L->type == CM_LAYER_TYPE_LINEAR_ATTENTION;
        m->gemm_acc         = gdn ? &m->tm.gdn_gemm_ms : &m->tm.attn_gemm_ms;
        CM_TRY(block_norm(m, pending, L->input_norm, T, L, 0));
        pending    = NULL;
        w->o_added = 0;
        if (gdn)
            CM_TRY(forward_gdn(m, L, i, T, n_seq));
        else
            CM_TRY(forward_attention(m, L, i, T, n_seq));
        if (!m->fused) CM_TRY(be->add(cx, w->x, w->o, T * D));
        CM_TRY(ts_mark(m, &tb));
        *(gdn ? &m->tm.gdn_ms : &m->tm.attn_ms) += tb - ta;
        *(gdn ? &m->tm.gdn_layers : &m->tm.attn_layers) += 1;
        m->gemm_acc = &m->tm.mlp_gemm_ms;
        CM_TRY(block_norm(m, m->fused && !w->o_added ? w->o : NULL, L->post_norm, T, L, 1));
        w->o_added = 0;
        CM_TRY(L->moe ? ts_forward_moe(m, L, i, T, cap) : forward_mlp(m, L, T));
        /* the fused path leaves the add to the next input norm, unless x is read before it (or
         * the down projection has added itself) */
        const int x_read = i == last || (next_cap < cap->n_layers && cap->layers[next_cap] == i);
        if (w->o_added)
            ; /* x holds the layer's output */
        else if (!m->fused || x_read)
            CM_TRY(be->add(cx, w->x, w->o, T * D));
        else
            pending = w->o;
        CM_TRY(ts_mark(m, &ta));
        m->tm.mlp_ms += ta - tb;
        m->tm.mlp_layers++;
        m->gemm_acc = NULL;
        if (next_cap < cap->n_layers && cap->layers[next_cap] == i) {
            if (cap->on_layer)
                CM_TRY(cap->on_layer(cap->user, next_cap++, w->x));
            else if (cap->layer_dev && cap->layer_dev_ctx && cap->layer_dev_ctx != cx)
                CM_TRY(be->copy_peer(cx, cap->layer_dev_ctx, cap->layer_dev[next_cap++], w->x,
                                     (size_t)(T * D) * sizeof(float)));
            else if (cap->layer_dev)
                CM_TRY(be->copy2d(cx, cap->layer_dev[next_cap++], D, w->x, D, T, D));
            else
                CM_TRY(be->download(cx, cap->layer_out[next_cap++], w->x, (size_t)(T * D) * sizeof(float)));
            double tc;
            CM_TRY(ts_mark(m, &tc));
            m->tm.other_ms += tc - ta;
            ta = tc;
        }
    }
    if (cap->x_out) CM_TRY(be->download(cx, cap->x_out, w->x, (size_t)(T * D) * sizeof(float)));
    if (cap->x_out_dev) CM_TRY(be->copy_peer(cx, cap->x_out_ctx, cap->x_out_dev, w->x, (size_t)(T * D) * sizeof(float)));
    if (rows_head) {
        CM_TRY(head_rows(m, T, cap));
    } else if (want_head) {
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

cm_status ts_model_forward(ts_model *m, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                           const ts_capture *cap) {
    m->cache = NULL;
    m->step = NULL;
    return ts_forward_run(m, ids, T, cu, n_seq, cap);
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
        st = ts_model_bind(m);
    if (st == CM_OK)
        st = ws_reserve(m, T, 0);
    float *x_in = m->first_layer > 0 ? calloc((size_t)(T * m->cfg.hidden_size), sizeof *x_in) : NULL;
    if (st == CM_OK && m->first_layer > 0 && !x_in)
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate a %lld-token warm-up input", (long long)T);
    if (st == CM_OK && m->n_layers > 0) {
        const int  last = m->n_layers - 1;
        ts_capture cap = {.n_layers = 1, .layers = &last, .on_layer = warmup_sink, .x_in = x_in};
        int        timing = m->timing;
        ts_timing  sums = m->tm; /* the warm-up is not one of the timed forwards */
        m->timing = 0;
        st = ts_model_forward(m, ids, T, cu, n_seq, &cap);
        m->timing = timing;
        m->tm = sums;
    }
    free(x_in);
    free(ids);
    free(cu);
    return st;
}
