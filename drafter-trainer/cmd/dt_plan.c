/* drafter-trainer/cmd/dt_plan.c — the --dry-run plan (formulas in dt_plan.h). Counts are exact
 * integers from the configs; memory and time are estimates whose assumptions the printed table
 * states next to the numbers. */
#include "dt_plan.h"

#include <math.h>
#include <string.h>

#include "kn_backend.h" /* kn_fp8_scale_ld */

/* The fp32 logits the fused LM head + CE holds per vocabulary chunk (kernels/kn_lm_ce.cu,
 * LMCE_CHUNK_FLOATS). */
#define DT_PLAN_LM_FLOATS ((double)(32 << 20))

void dt_plan_ratio_range(cm_encoding enc, double *lo, double *hi) {
    switch (enc) {
    case CM_ENCODING_ZSTD:
        *lo = 1.26, *hi = 1.29;
        return;
    case CM_ENCODING_ZSTD_BYTEPLANE:
        *lo = 1.34, *hi = 1.51;
        return;
    case CM_ENCODING_FP8_ZSTD:
        *lo = 2.13, *hi = 2.43;
        return;
    default: /* raw, nccl: the elements as they are */
        *lo = *hi = 1.0;
        return;
    }
}

// ---- parameter counts

static int64_t drafter_layer_params(const cm_drafter_cfg *d) {
    const int64_t D = d->hidden_size, hd = d->head_dim, H = d->n_heads, KV = d->n_kv_heads,
                  I = d->intermediate_size;
    int64_t n = D * H * hd * 2 + D * KV * hd * 2 + 3 * D * I + 2 * D + 2 * hd;
    if (d->attention_bias)
        n += H * hd + 2 * KV * hd;
    if (d->kind == CM_DRAFTER_DFLASH2) /* two convolutions: base_kernel [2, Kc, D], projection [2·Kc·n_g, D] */
        n += 2 * (2 * (int64_t)d->conv_kernel_size * D + 2 * (int64_t)d->conv_kernel_size * (D / d->conv_group_size) * D);
    return n;
}

/* DFlash2's candidate selector: two [V, R] codebooks and the [R, D] hidden projection; 0 for DFlash. */
static int64_t drafter_selector_params(const cm_drafter_cfg *d) {
    if (d->kind != CM_DRAFTER_DFLASH2)
        return 0;
    return 2 * (int64_t)d->vocab_size * d->selector_rank + (int64_t)d->selector_rank * d->hidden_size;
}

/* Target layer l's parameters: linear (every matrix), active (the matrices one token multiplies)
 * and all (with the norms, the GDN's conv1d, dt_bias, A_log and gated norm). A sparse MoE layer's
 * MLP is its router [E, D], E experts of 3·Ie·D and the shared expert 3·Is·D with its gate [1, D]
 * (none when Is = 0); a token multiplies the router, its K experts and the shared expert. A
 * dense layer's MLP is 3·D·I. */
static void target_layer_params(const cm_target_cfg *t, int l, int64_t *linear, int64_t *active,
                                int64_t *all) {
    const int64_t D = t->hidden_size, I = t->intermediate_size;
    int64_t       lin = 3 * D * I, act = lin, other = 2 * D; /* MLP; input + post-attention norms */
    if (cm_target_layer_moe(t, l)) {
        const int64_t E = t->n_experts, K = t->n_experts_per_tok, Ie = t->moe_intermediate_size,
                      Is = t->shared_expert_intermediate_size;
        const int64_t shared = Is > 0 ? 3 * D * Is + D : 0; /* shared expert + its sigmoid gate */
        lin = E * D + E * 3 * Ie * D + shared;
        act = E * D + K * 3 * Ie * D + shared;
    }
    if (t->layer_types[l] == CM_LAYER_TYPE_LINEAR_ATTENTION) {
        const int64_t nk = t->lin_n_k_heads, nv = t->lin_n_v_heads, dk = t->lin_k_head_dim,
                      dv = t->lin_v_head_dim;
        const int64_t conv = 2 * nk * dk + nv * dv;
        /* in_proj_qkv, _z, _b, _a; out_proj */
        const int64_t gdn = D * conv + D * nv * dv + 2 * D * nv + nv * dv * D;
        lin += gdn, act += gdn;
        other += conv * t->lin_conv_kernel + 2 * nv + dv; /* conv1d, dt_bias + A_log, norm */
    } else {
        const int64_t H = t->n_heads, KV = t->n_kv_heads, hd = t->head_dim;
        const int64_t attn =
            D * H * hd * (t->attn_output_gate ? 2 : 1) + 2 * D * KV * hd + H * hd * D; /* q(+gate), k, v, o */
        lin += attn, act += attn;
        other += 2 * hd; /* q_norm, k_norm */
    }
    *linear = lin;
    *active = act;
    *all = lin + other;
}

/* One target GPU's weight bytes as target-server keeps them (dt_plan.h: m_target_bf16/fp8). The
 * router and the shared expert's gate stay bf16 under fp8, as in_proj_a/b do (ts_load_moe.c). */
static double target_weight_bytes(const cm_target_cfg *t, int fp8) {
    const int64_t D = t->hidden_size, I = t->intermediate_size, V = t->vocab_size;
#define MAT(N, K) (fp8 ? (double)(N) * (K) + 4.0 * (double)(((N) + 127) / 128) * (double)kn_fp8_scale_ld(K) \
                       : 2.0 * (double)(N) * (K))
    double b = 2.0 * (double)V * D * (t->tie_word_embeddings ? 1 : 2) + 4.0 * D; /* embed, lm_head, norm */
    for (int l = 0; l < t->n_layers; l++) {
        int64_t lin, act, all;
        target_layer_params(t, l, &lin, &act, &all);
        b += 4.0 * (double)(all - lin); /* small parameters (fp32) */
        if (cm_target_layer_moe(t, l)) {
            const int64_t E = t->n_experts, Ie = t->moe_intermediate_size,
                          Is = t->shared_expert_intermediate_size;
            b += 2.0 * (double)E * D + (double)E * (2 * MAT(Ie, D) + MAT(D, Ie)); /* router, experts */
            if (Is > 0)
                b += 2 * MAT(Is, D) + MAT(D, Is) + 2.0 * D; /* shared expert, its gate */
        } else
            b += 2 * MAT(I, D) + MAT(D, I); /* MLP */
        if (t->layer_types[l] == CM_LAYER_TYPE_LINEAR_ATTENTION) {
            const int64_t nk = t->lin_n_k_heads, nv = t->lin_n_v_heads, dk = t->lin_k_head_dim,
                          dv = t->lin_v_head_dim;
            b += MAT(2 * nk * dk + nv * dv, D) + MAT(nv * dv, D) + MAT(D, nv * dv) + 2.0 * 2 * nv * D;
        } else {
            const int64_t H = t->n_heads, KV = t->n_kv_heads, hd = t->head_dim;
            b += MAT(H * hd * (t->attn_output_gate ? 2 : 1), D) + 2 * MAT(KV * hd, D) + MAT(D, H * hd);
        }
    }
#undef MAT
    return b;
}

/* GPUs that hold one copy of weights of the given bytes, each keeping DT_PLAN_TARGET_RESERVE free. */
static int target_gpus(double bytes) {
    const double usable = DT_PLAN_GPU_BYTES - DT_PLAN_TARGET_RESERVE;
    return (int)ceil(bytes / usable);
}

// ---- FLOPs

/* E[visible context rows] for an anchor uniform in a document of S tokens, window W (0 = full). */
static double visible_context(double S, double W) {
    if (W <= 0 || S <= W)
        return S / 2;
    return W - W * W / (2 * S);
}

/* Target prefill FLOPs per token for documents of S tokens, layers 0..n_run-1. */
static double target_flops_token(const cm_target_cfg *t, int n_run, double S) {
    double f = 0;
    for (int l = 0; l < n_run; l++) {
        int64_t lin, act, all;
        target_layer_params(t, l, &lin, &act, &all);
        f += 2.0 * (double)act;
        if (t->layer_types[l] == CM_LAYER_TYPE_LINEAR_ATTENTION) {
            const double conv =
                2.0 * t->lin_n_k_heads * t->lin_k_head_dim + (double)t->lin_n_v_heads * t->lin_v_head_dim;
            f += 8.0 * t->lin_k_head_dim * t->lin_v_head_dim * t->lin_n_v_heads +
                 2.0 * t->lin_conv_kernel * conv;
        } else
            f += 2.0 * S * t->n_heads * t->head_dim;
    }
    return f;
}

/* Drafter FLOPs per step: forward, total, and the attention and LM-head shares of the total. */
static void drafter_flops_step(const cm_drafter_cfg *d, double T, double A, double S, double *fwd,
                               double *total, double *attn_total, double *lm_total) {
    const double D = d->hidden_size, hd = d->head_dim, H = d->n_heads, KV = d->n_kv_heads,
                 I = d->intermediate_size;
    const double B = d->block_size, V = d->vocab_size, nD = (double)d->n_taps * D;
    const double Q = A * B, K = T + Q;
    const double fc = 2 * T * nD * D;
    double       lin = 0, attn = 0;
    for (int l = 0; l < d->n_layers; l++) {
        const int    sliding = d->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION;
        const double vis =
            visible_context(S, sliding ? d->sliding_window : 0) + (cm_drafter_layer_causal(d, l) ? (B + 1) / 2 : B);
        lin += 2 * 2 * Q * D * H * hd + 2 * 2 * K * D * KV * hd + 2 * 3 * Q * D * I;
        attn += 4 * Q * H * hd * vis;
    }
    if (d->kind == CM_DRAFTER_DFLASH2) { /* per layer and module: δ's GEMM and both sides' convolution;
                                            then the selector's projection and scores per trained slot */
        const double np = 2.0 * d->conv_kernel_size * (D / d->conv_group_size);
        lin += d->n_layers * 2 * (2 * Q * D * np + 2 * 2 * Q * D * d->conv_kernel_size);
        lin += A * (B - 1) * (2 * D * d->selector_rank + 2.0 * d->selector_top_k * d->selector_rank);
    }
    const double lm = 2 * A * (B - 1) * D * V;
    *fwd = fc + lin + attn + lm;
    *total = *fwd + fc + 2 * lin + 2.5 * attn + lm;
    *attn_total = 3.5 * attn;
    *lm_total = 2 * lm;
}

// ---- the plan

cm_status dt_plan_compute(dt_plan *p, const cm_target_cfg *t, const cm_drafter_cfg *d,
                          const dt_plan_run *run) {
    memset(p, 0, sizeof *p);
    p->run = *run;
    dt_plan_run *r = &p->run;
    if (r->seq_len <= 0)
        r->seq_len = r->token_budget;
    if (r->token_budget < 1 || r->max_anchors < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the plan needs a token budget and anchors >= 1 (got %lld and %lld)",
                       (long long)r->token_budget, (long long)r->max_anchors);
    if (r->seq_len > r->token_budget)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "sequence length %lld is longer than the token budget %lld: a document must fit one "
                       "packed batch; lower --plan-seq-len or raise --token-budget",
                       (long long)r->seq_len, (long long)r->token_budget);
    if (!(r->target_tflops >= 0) || !(r->drafter_tflops > 0) || r->dp_size < 1 || r->credits < 0 ||
        r->lm_chunk_rows < 1 || r->ratio < 0)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "the plan needs rates > 0 (--plan-target-tflops, --plan-drafter-tflops), --dp-size >= 1, "
            "credits >= 0 and a ratio >= 0");
    if (d->hidden_size != t->hidden_size || d->vocab_size != t->vocab_size)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the drafter has hidden %d and vocab %d but the target %d and %d; use the target the "
                       "drafter is for",
                       d->hidden_size, d->vocab_size, t->hidden_size, t->vocab_size);
    int last_tap = -1;
    for (int i = 0; i < d->n_taps; i++) {
        if (d->target_layer_ids[i] < 0 || d->target_layer_ids[i] >= t->n_layers)
            return CM_FAIL(CM_ERR_INVALID_ARG, "target_layer_ids[%d] = %d is outside the target's %d layers",
                           i, d->target_layer_ids[i], t->n_layers);
        if (d->target_layer_ids[i] > last_tap)
            last_tap = d->target_layer_ids[i];
    }

    const int64_t D = d->hidden_size, V = d->vocab_size, n = d->n_taps;
    p->p_drafter_layer = drafter_layer_params(d);
    p->p_fc = n * D * D;
    p->p_selector = drafter_selector_params(d);
    p->p_drafter = p->p_fc + 2 * D + (int64_t)d->n_layers * p->p_drafter_layer + p->p_selector;
    const int tied = t->tie_word_embeddings;
    p->p_frozen = (tied ? 1 : 2) * V * D;
    p->p_target = (tied ? 1 : 2) * V * D + D; /* embeddings, lm_head, final norm */
    p->target_layers_run = last_tap + 1;
    for (int l = 0; l < t->n_layers; l++) {
        int64_t lin, act, all;
        target_layer_params(t, l, &lin, &act, &all);
        p->p_target += all;
        if (l <= last_tap)
            p->p_target_run += act;
    }

    /* memory: mixed precision as the CUDA path keeps it (fp32 masters and gradients, Adam m and
     * v in fp32; no bf16 working copy of its own: a step's bf16 copies of the layer weights live in
     * gradients not yet written, drafter-trainer/model/dt_model_w16.c);
     * activations in bf16 */
    const double P = (double)p->p_drafter, T = (double)r->token_budget, A = (double)r->max_anchors;
    const double B = d->block_size, Q = A * B, K = T + Q, Hd = (double)d->n_heads * d->head_dim;
    const double KVd = (double)d->n_kv_heads * d->head_dim, I = d->intermediate_size;
    p->m_weights = 0;
    p->m_master = 4 * P;
    p->m_adam = 8 * P;
    p->m_grads = 4 * P;
    p->m_frozen = 2.0 * (double)p->p_frozen;
    p->m_target_bf16 = target_weight_bytes(t, 0);
    p->m_target_fp8 = target_weight_bytes(t, 1);
    p->target_gpus_bf16 = target_gpus(p->m_target_bf16);
    p->target_gpus_fp8 = target_gpus(p->m_target_fp8);
    /* As dt_model plans it (bf16 storage; norms, RoPE and SwiGLU recomputed in the backward).
     * Per layer, saved for backward: block rows' residual in and mid (2D; not layer 0's input,
     * looked up again), q before its norm and the attention output (2Hd), gate and up (2I),
     * the attention's log-sum-exp (fp32 per head); key rows' k before its norm and v; plus the
     * shared context (fc output and its norm) */
    const double per_layer = 2 * Q * (2 * (double)D + 2 * Hd + 2 * I) + 4 * Q * d->n_heads + 2 * K * 2 * KVd;
    p->m_act = d->n_layers * per_layer - 2 * Q * (double)D + 2 * 2 * T * (double)D;
    double conv_tmp = 0;
    if (d->kind == CM_DRAFTER_DFLASH2) { /* per layer: both modules' δ (fp32) and sublayer outputs (bf16);
                                            shared: u, u', s and ∂/∂δ (fp32), the selector's rows */
        const double np = 2.0 * d->conv_kernel_size * (D / d->conv_group_size), Rk = d->selector_rank;
        p->m_act += d->n_layers * 2 * (4 * Q * np + 2 * Q * (double)D);
        conv_tmp = 2 * 4 * Q * (double)D + 4 * Q * np + 8 * Q * Rk + 4 * Q * (4.0 * d->selector_top_k + 6);
    }
    /* shared by the layers: the residual stream, its gradient and a norm's output gradient
     * (fp32), the normed rows as bf16 GEMM input, the context's gradient (fp32), and the work
     * region: the SwiGLU product (bf16), the loss gradient rows (fp32) or the attention's fp32
     * temporaries beyond what a layer's gate/up span holds, the largest */
    const double attn_tmp = 16 * Q * Hd + 16 * K * KVd, spill = attn_tmp > 4 * Q * I ? attn_tmp - 4 * Q * I : 0;
    double       work = 2 * Q * I;
    work = work > 4 * (Q + 1) * (double)D ? work : 4 * (Q + 1) * (double)D;
    work = work > spill ? work : spill;
    p->m_act_transient = 3 * 4 * Q * (double)D + 2 * Q * (double)D + 4 * T * (double)D + work + conv_tmp;
    /* kn_lm_ce: row tiles of lm_chunk_rows (bf16 copies), logits of at most DT_PLAN_LM_FLOATS
     * per vocabulary chunk in fp32 and their bf16 coefficients */
    const double lm_rows = (double)r->lm_chunk_rows < Q ? (double)r->lm_chunk_rows : Q;
    const double lm_chunk = lm_rows * (double)V < DT_PLAN_LM_FLOATS ? lm_rows * (double)V : DT_PLAN_LM_FLOATS;
    p->m_loss = 4 * lm_chunk + 2 * lm_chunk + 2 * lm_rows * (double)D;
    p->wire_raw = 2.0 * (double)n * (double)D;
    p->m_hidden_gpu = 2 * T * p->wire_raw; /* this batch and the next, decoded bf16 */
    p->m_total = p->m_weights + p->m_master + p->m_adam + p->m_grads + p->m_frozen + p->m_act +
                 p->m_act_transient + p->m_loss + p->m_hidden_gpu;

    if (r->ratio > 0)
        p->ratio_lo = p->ratio_hi = r->ratio;
    else
        dt_plan_ratio_range(r->encoding, &p->ratio_lo, &p->ratio_hi);
    p->wire_lo = p->wire_raw / p->ratio_hi; /* fewest bytes: the best ratio */
    p->wire_hi = p->wire_raw / p->ratio_lo;
    p->m_hidden_host = (double)r->credits * T * (p->wire_raw + p->wire_hi);
    if (r->dataset_tokens > 0) {
        p->disk_lo = (double)r->dataset_tokens * p->wire_lo;
        p->disk_hi = (double)r->dataset_tokens * p->wire_hi;
    }

    p->f_target_token = target_flops_token(t, p->target_layers_run, (double)r->seq_len);
    drafter_flops_step(d, T, A, (double)r->seq_len, &p->f_step_fwd, &p->f_step, &p->f_step_attn,
                       &p->f_step_lm);
    p->f_drafter_token = p->f_step / T;
    p->s_step = p->f_step / (r->drafter_tflops * 1e12);
    p->trainer_tok_s = T / p->s_step;
    int moe = 0; /* a sparse layer anywhere: the MoE rates */
    for (int l = 0; l < t->n_layers; l++) moe |= t->n_experts > 0 && t->layer_moe[l];
    p->target_tflops = r->target_tflops > 0 ? r->target_tflops : moe ? DT_PLAN_TARGET_TFLOPS_MOE : DT_PLAN_TARGET_TFLOPS;
    p->fp8_speedup = moe ? DT_PLAN_FP8_SPEEDUP_MOE : DT_PLAN_FP8_SPEEDUP;
    p->target_tok_s = p->target_tflops * 1e12 / p->f_target_token;
    p->target_tok_s_fp8 = p->target_tok_s * p->fp8_speedup;
    p->target_per_trainer = p->trainer_tok_s / p->target_tok_s;
    p->wire_bps_lo = p->trainer_tok_s * p->wire_lo;
    p->wire_bps_hi = p->trainer_tok_s * p->wire_hi;
    return CM_OK;
}

// ---- printing

/* "1.73 GFLOP", "51.2 kB"; with no unit "1.73G", "512". */
static const char *human(char *buf, size_t cap, double v, const char *unit) {
    static const char *pre[] = {"", "k", "M", "G", "T", "P", "E"};
    int                i = 0;
    while (fabs(v) >= 999.95 && i < 6) {
        v /= 1000;
        i++;
    }
    const int digits = i ? (fabs(v) < 9.995 ? 2 : fabs(v) < 99.95 ? 1 : 0) : 0;
    snprintf(buf, cap, unit[0] ? "%.*f %s%s" : "%.*f%s%s", digits, v, pre[i], unit);
    return buf;
}

static const char *gib(char *buf, size_t cap, double bytes) {
    snprintf(buf, cap, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
    return buf;
}

void dt_plan_print(FILE *f, const dt_plan *p, const cm_target_cfg *t, const cm_drafter_cfg *d) {
    const dt_plan_run *r = &p->run;
    char               a[48], b[48], c[48];
    int                n_sliding = 0;
    for (int l = 0; l < d->n_layers; l++)
        n_sliding += d->layer_types[l] == CM_LAYER_TYPE_SLIDING_ATTENTION;
    fprintf(f, "plan (--dry-run: nothing is loaded or trained)\n\n");
    fprintf(f,
            "drafter   hidden %d, %d layers (%d sliding %d + %d full), %d/%d heads x %d, MLP %d, vocab %d,\n",
            d->hidden_size, d->n_layers, n_sliding, d->sliding_window, d->n_layers - n_sliding, d->n_heads,
            d->n_kv_heads, d->head_dim, d->intermediate_size, d->vocab_size);
    fprintf(f, "          %d taps (last %d), block %d\n", d->n_taps, p->target_layers_run - 1, d->block_size);
    fprintf(f, "target    hidden %d, %d layers, forward stops after layer %d (%d layers run)\n",
            t->hidden_size, t->n_layers, p->target_layers_run - 1, p->target_layers_run);
    if (t->n_experts > 0) {
        int n_sparse = 0;
        for (int l = 0; l < t->n_layers; l++)
            n_sparse += cm_target_layer_moe(t, l);
        fprintf(f,
                "          mixture of experts: %d of %d layers sparse, %d experts top-%d (expert MLP %d, "
                "shared %d)\n",
                n_sparse, t->n_layers, t->n_experts, t->n_experts_per_tok, t->moe_intermediate_size,
                t->shared_expert_intermediate_size);
    }
    fprintf(
        f,
        "run       %lld tokens per batch, %lld anchors x %d = %lld query rows, documents of %lld tokens,\n",
        (long long)r->token_budget, (long long)r->max_anchors, d->block_size,
        (long long)(r->max_anchors * d->block_size), (long long)r->seq_len);
    fprintf(f, "          %d trainer GPU(s), %d credits, encoding %s\n\n", r->dp_size, r->credits,
            cm_encoding_name(r->encoding));

    fprintf(f, "parameters\n");
    fprintf(f, "  %-40s %16lld  (%s)\n", "drafter, trainable", (long long)p->p_drafter,
            human(a, sizeof a, (double)p->p_drafter, ""));
    fprintf(f, "  %-40s %16lld\n", "  one layer", (long long)p->p_drafter_layer);
    fprintf(f, "  %-40s %16lld\n", "  fc (taps x hidden -> hidden)", (long long)p->p_fc);
    if (p->p_selector)
        fprintf(f, "  %-40s %16lld\n", "  DFlash2 candidate selector", (long long)p->p_selector);
    fprintf(f, "  %-40s %16lld  (%s)\n",
            t->tie_word_embeddings ? "frozen embedding = LM head (tied)" : "frozen embedding + LM head",
            (long long)p->p_frozen, human(b, sizeof b, (double)p->p_frozen, ""));
    fprintf(f, "  %-40s %16lld  (%s)\n", "target", (long long)p->p_target,
            human(c, sizeof c, (double)p->p_target, ""));
    fprintf(f, "  %-40s %16lld\n\n",
            t->n_experts > 0 ? "  linear per token, layers run in prefill" : "  linear, layers run in prefill",
            (long long)p->p_target_run);

    fprintf(f, "memory per trainer GPU (estimate)\n");
    const struct {
        const char *what;
        double      bytes;
    } mem[] = {
        {"master weights, fp32", p->m_master},
        {"Adam moments, 2 x fp32", p->m_adam},
        {"gradients, fp32", p->m_grads},
        {"frozen embedding/LM head, bf16", p->m_frozen},
        {"activations saved for backward, bf16", p->m_act},
        {"temporaries shared by the layers", p->m_act_transient},
        {"chunked LM-head loss (one logits chunk)", p->m_loss},
        {"hidden states: this batch + next, bf16", p->m_hidden_gpu},
    };
    for (size_t i = 0; i < sizeof mem / sizeof mem[0]; i++)
        fprintf(f, "  %-40s %12s\n", mem[i].what, gib(a, sizeof a, mem[i].bytes));
    fprintf(f, "  %-40s %12s\n", "total", gib(a, sizeof a, p->m_total));
    fprintf(f, "  %-40s %12s\n\n", "host: hidden states for the credits", gib(b, sizeof b, p->m_hidden_host));

    fprintf(f, "target weights per target GPU (every layer and the head; no activations or caches)\n");
    fprintf(f, "  %-40s %12s\n", "--precision bf16", gib(a, sizeof a, p->m_target_bf16));
    fprintf(f, "  %-40s %12s  (the default for an FP8 checkpoint)\n", "--precision fp8 (docs/fp8.md)",
            gib(b, sizeof b, p->m_target_fp8));
    snprintf(c, sizeof c, "%d / %d", p->target_gpus_bf16, p->target_gpus_fp8);
    fprintf(f, "  %-40s %12s  (%.1f GiB each, %.0f GiB of it kept for the workspace)\n",
            "H200s that hold them, bf16 / fp8", c, DT_PLAN_GPU_BYTES / (1024.0 * 1024 * 1024),
            DT_PLAN_TARGET_RESERVE / (1024.0 * 1024 * 1024));
    if (p->target_gpus_bf16 > 1 || p->target_gpus_fp8 > 1)
        fprintf(f, "  a replica over N GPUs: target-server serve --stages N (tandem-launch --server-gpus 0+1+...), "
                   "N = %d at bf16, %d at fp8\n",
                p->target_gpus_bf16, p->target_gpus_fp8);
    fprintf(f, "\n");

    fprintf(f, "hidden states per token (taps x hidden x 2 bytes bf16)\n");
    fprintf(f, "  %-40s %12s\n", "raw", human(a, sizeof a, p->wire_raw, "B"));
    if (p->ratio_lo == p->ratio_hi)
        fprintf(f, "  %-40s %12s  (ratio %.2f)\n", "on the wire and on disk",
                human(b, sizeof b, p->wire_lo, "B"), p->ratio_lo);
    else
        fprintf(f, "  %-40s %s .. %s  (ratio %.2f..%.2f)\n", "on the wire and on disk",
                human(b, sizeof b, p->wire_lo, "B"), human(c, sizeof c, p->wire_hi, "B"), p->ratio_lo,
                p->ratio_hi);
    if (p->disk_hi > 0)
        fprintf(f, "  %-40s %s .. %s\n", "one epoch on disk (shards)", human(a, sizeof a, p->disk_lo, "B"),
                human(b, sizeof b, p->disk_hi, "B"));
    fprintf(f, "  %-40s %s .. %s/s\n\n", "into one trainer GPU at full speed",
            human(a, sizeof a, p->wire_bps_lo, "B"), human(b, sizeof b, p->wire_bps_hi, "B"));

    fprintf(f, "compute\n");
    fprintf(f, "  %-40s %12s\n", "drafter step, forward", human(a, sizeof a, p->f_step_fwd, "FLOP"));
    fprintf(f, "  %-40s %12s  (attention %.0f%%, LM head %.0f%%)\n", "drafter step, forward + backward",
            human(b, sizeof b, p->f_step, "FLOP"), 100 * p->f_step_attn / p->f_step,
            100 * p->f_step_lm / p->f_step);
    fprintf(f, "  %-40s %12s\n", "drafter per context token", human(a, sizeof a, p->f_drafter_token, "FLOP"));
    fprintf(f, "  %-40s %12s\n", "target prefill per token", human(b, sizeof b, p->f_target_token, "FLOP"));
    fprintf(f, "  %-40s %9.3f s  (%s tok/s per trainer GPU)\n", "drafter step time", p->s_step,
            human(a, sizeof a, p->trainer_tok_s, ""));
    fprintf(f, "  %-40s %12s tok/s\n", "one target GPU produces", human(b, sizeof b, p->target_tok_s, ""));
    fprintf(f, "  %-40s %12s tok/s  (x %.2f, the %s fp8/bf16 forward on an H200)\n",
            "  at --precision fp8", human(a, sizeof a, p->target_tok_s_fp8, ""), p->fp8_speedup,
            p->fp8_speedup == DT_PLAN_FP8_SPEEDUP_MOE ? "35B-A3B's" : "27B's");
    fprintf(f, "  %-40s %12.2f  (%.1f for %d trainer GPU(s))\n\n", "target GPUs per trainer GPU",
            p->target_per_trainer, p->target_per_trainer * r->dp_size, r->dp_size);

    /* packed: the run's budget holds documents of S tokens; alone: one document of S tokens per
     * step (the same anchors), which is where short documents make the drafter the bottleneck */
    fprintf(f, "target GPUs per trainer GPU by document length S\n");
    fprintf(f, "  %8s  %22s  %22s\n", "S", "packed in the budget", "one document per step");
    for (int64_t s = 1024; s <= 32768; s *= 2) {
        dt_plan     q;
        dt_plan_run rr = *r;
        rr.seq_len = s;
        char packed[32] = "-", alone[32] = "-";
        if (s <= r->token_budget && dt_plan_compute(&q, t, d, &rr) == CM_OK)
            snprintf(packed, sizeof packed, "%.2f", q.target_per_trainer);
        rr.token_budget = s;
        if (rr.max_anchors > s - 1)
            rr.max_anchors = s - 1;
        if (dt_plan_compute(&q, t, d, &rr) == CM_OK)
            snprintf(alone, sizeof alone, "%.2f", q.target_per_trainer);
        fprintf(f, "  %8lld  %22s  %22s\n", (long long)s, packed, alone);
    }
    fprintf(f, "\nassumptions\n");
    fprintf(f,
            "  achieved rates: target %g TF/s, drafter %g TF/s per GPU (--plan-target-tflops,\n"
            "    --plan-drafter-tflops; defaults for an H200: target 550 dense from docs/goals.md, 275 MoE\n"
            "    as measured at the 35B-A3B shape; drafter from docs/goals.md)\n",
            p->target_tflops, r->drafter_tflops);
    if (r->ratio > 0)
        fprintf(f, "  compression ratio %.2f as given (--plan-ratio)\n", r->ratio);
    else
        fprintf(f,
                "  compression ratio of %s: %.2f..%.2f, measured on tiny-model and synthetic BF16 hidden\n"
                "    states (bench/results/compress-2026-11-30.md), not yet on a trained 27B target\n",
                cm_encoding_name(r->encoding), p->ratio_lo, p->ratio_hi);
    fprintf(f, "  anchors uniform over each document; every batch full (T tokens, A anchors)\n");
    fprintf(f,
            "  memory: bf16 activations, fused attention (no score matrix), LM-head loss in chunks of %lld "
            "rows,\n"
            "    no allocator slack or CUDA context (~0.5-1 GiB)\n",
            (long long)r->lm_chunk_rows);
}
