/* drafter-trainer/cmd/dt_plan.h — `train --dry-run`: the plan of a run, computed from the target's
 * config (cm_target_cfg), the drafter's (cm_drafter_cfg) and the run's numbers, before anything
 * is loaded: parameter counts, memory per trainer GPU, hidden-state bytes per token on the wire
 * and on disk, and how many target GPUs keep one trainer GPU busy at a sequence length.
 * Pure arithmetic (no allocation, no I/O but the print); every estimate names its assumption in
 * the printed table. Formulas, per packed batch of T tokens (documents of S tokens), A anchors,
 * block B, Q = A·B query rows, K = T + Q key rows, D hidden, n taps, V vocab:
 *   drafter forward  fc 2·T·nD·D; per layer q,o 2·2·Q·D·H·hd, k,v 2·2·K·D·Hkv·hd, MLP 2·3·Q·D·I,
 *                    attention 4·Q·H·hd·vis (vis = visible keys per query: context rows of the
 *                    anchor's document before it, E = S/2 for full layers, E[min(p, W)] for
 *                    sliding ones, plus B (full) or (B+1)/2 (sliding) block rows; the fused
 *                    kernel skips masked tiles), LM head over the A·(B−1) trained slots 2·A(B−1)·D·V;
 *   drafter backward 2× the trainable linears (dX and dW), 2.5× attention (FlashAttention's
 *                    convention), 1× the frozen LM head (dX only), 1× fc (dW only; its input is
 *                    the target's hidden states);
 *   target prefill   per token 2 × the linear parameters of layers 0..last tap a token multiplies
 *                    (the forward stops there; a sparse MoE layer: its router [E, D], its K routed
 *                    experts 3·Ie·D each and the shared expert 3·Is·D + its gate [1, D], not all
 *                    E experts) + 2·S·H·hd per full-attention layer (causal: S/2 keys on average)
 *                    + 8·dk·dv·nv per Gated DeltaNet layer (chunked delta rule) + 2·Kc·C conv.
 * docs/goals.md checks the same method against SpecForge's measured FLOPs (48 vs 45 TFLOP). */
#ifndef DT_PLAN_H
#define DT_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "cm_cfg.h"
#include "cm_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The run's numbers and the assumed rates (DT_PLAN_RUN_DEFAULT gives the defaults). */
typedef struct dt_plan_run {
    int64_t     token_budget;   /* T: tokens per packed batch (one step per batch) */
    int64_t     max_anchors;    /* A */
    int64_t     seq_len;        /* S: document length; ≤ token_budget; 0 = token_budget */
    int         dp_size;        /* trainer GPUs (data parallel; each holds a full replica) */
    int         credits;        /* hidden-state requests in flight per trainer (--credits) */
    cm_encoding encoding;       /* how hidden states travel and are stored */
    double      ratio;          /* > 0: the compression ratio to assume instead of the measured range */
    double      target_tflops;  /* achieved TF/s of one target GPU in prefill (of the FLOPs a token
                                   multiplies); 0: DT_PLAN_TARGET_TFLOPS, or DT_PLAN_TARGET_TFLOPS_MOE
                                   for a MoE target */
    double      drafter_tflops; /* achieved dense TF/s of one trainer GPU in the drafter step */
    int64_t     lm_chunk_rows;  /* rows per LM-head row tile (kn_lm_ce: at most 4096) */
    int64_t     dataset_tokens; /* > 0: tokens of one epoch, for the disk total; 0 = unknown */
} dt_plan_run;

/* Achieved rates: target 550 TF/s ≈ 11k tok/s of the 27B at 8k on an H200 (docs/goals.md "realistic
 * 11–13k tok/s", 55–65 % MFU; docs/goals.md asks ≥ 12.5k); drafter 430 TF/s (docs/goals.md, SpecForge's
 * measured 43.5 % MFU; the design's PyTorch step, 0.305 s for ~138 TFLOP, is ~450). */
#define DT_PLAN_TARGET_TFLOPS  550.0
/* The 27B target forward at --precision fp8 over bf16, measured on an H200 in one run (15447 against
 * 10884 tokens/s, bench/results/fp8-2026-12-02.md): the plan's fp8 rate is the bf16 one times this. */
#define DT_PLAN_FP8_SPEEDUP    1.42
/* A MoE target, measured at the Qwen3.5-35B-A3B shape on an H200 (bench/results/moe35-2026-12-02.md,
 * run 5): 42.3 TFLOP per 8192-token pack in 153.6 ms with the grouped expert GEMMs on wgmma, 275 TF/s;
 * --precision fp8 with the grouped FP8 experts (run 7): 140.5 against 152.0 ms in one run, 1.08. */
#define DT_PLAN_TARGET_TFLOPS_MOE 275.0
#define DT_PLAN_FP8_SPEEDUP_MOE   1.08
#define DT_PLAN_DRAFTER_TFLOPS 430.0
/* One H200 as nvidia-smi reports it (143771 MiB; bench/results/drafter2-step-2026-12-02.md), and
 * what a target GPU keeps free beside the weights: the 27B server peaked 4.1 GiB above its 50.1 GiB
 * of weights at 8192-token forwards (55555 MiB, bench/results/pipeline-2gpu-2026-11-30.md: workspace,
 * kernel scratch, CUDA context); 8 GiB leaves room for an MoE target's routing buffers (about 1-2
 * GiB more at 8192 tokens, ts_moe_reserve). */
#define DT_PLAN_GPU_BYTES       (143771.0 * 1024 * 1024)
#define DT_PLAN_TARGET_RESERVE  (8.0 * 1024 * 1024 * 1024)
#define DT_PLAN_RUN_DEFAULT                                                                                  \
    {                                                                                                        \
        8192, 512, 0, 1, 4, CM_ENCODING_ZSTD_BYTEPLANE, 0, 0, DT_PLAN_DRAFTER_TFLOPS,                        \
            4096, 0                                                                                          \
    }

/* Lossless ratios measured on BF16 hidden states (bench/results/compress-2026-11-30.md): zstd
 * without the split 1.26–1.29, zstd-byteplane 1.34–1.51; fp8-zstd (lossy) 2.13–2.43 vs BF16. */
void dt_plan_ratio_range(cm_encoding enc, double *lo, double *hi);

typedef struct dt_plan {
    dt_plan_run run; /* as given, seq_len filled */
    /* parameters (elements) */
    int64_t p_drafter;       /* trainable: fc, hidden_norm, norm, every layer */
    int64_t p_drafter_layer; /* one drafter layer (DFlash2: with its two convolutions) */
    int64_t p_selector;      /* DFlash2's candidate selector (codebooks, hidden projection); 0 for DFlash */
    int64_t p_fc;            /* fc: n·D → D */
    int64_t p_frozen;        /* embed_tokens + lm_head (one matrix when the target ties them) */
    int64_t p_target;        /* every target parameter (text model; MoE: all E experts) */
    int64_t p_target_run;    /* linear parameters of layers 0..last tap that a token multiplies (MoE:
                                router, K routed experts, shared expert): what prefill multiplies */
    int     target_layers_run;
    /* memory per trainer GPU (bytes) */
    double m_weights, m_master, m_adam, m_grads, m_frozen; /* 0 (no bf16 working copy), fp32, 2×fp32,
                                                              fp32, bf16 */
    double m_act;                                          /* saved for backward, all layers */
    double m_act_transient;                                /* one layer's gradients in backward */
    double m_loss;                                         /* one LM-head logits chunk + its row tile */
    double m_hidden_gpu;                                   /* this batch's and the next's hidden states */
    double m_total;                                        /* sum of the above */
    double m_hidden_host;                                  /* credits × (decoded + encoded) on the host */
    /* one target GPU's weights (every layer and the head; activations and caches not counted):
     * bf16 (--precision bf16: matrices 2 bytes, small parameters widened to fp32) and fp8
     * (--precision fp8, docs/fp8.md: the projections 1 byte plus fp32 scales per 128 × 128 block,
     * in rows of kn_fp8_scale_ld; in_proj_a/b, the embedding and lm_head bf16) */
    double m_target_bf16, m_target_fp8;
    /* GPUs of DT_PLAN_GPU_BYTES that hold one copy of those weights, DT_PLAN_TARGET_RESERVE kept
     * free on each (more than 1: a replica over that many GPUs, serve --stages) */
    int target_gpus_bf16, target_gpus_fp8;
    /* hidden states */
    double wire_raw;         /* bytes per token before encoding: n · D · 2 (bf16) */
    double wire_lo, wire_hi; /* bytes per token after encoding (range of the assumed ratio) */
    double ratio_lo, ratio_hi;
    double disk_lo, disk_hi; /* bytes of one epoch on disk (dataset_tokens > 0), else 0 */
    /* compute */
    double f_target_token;           /* target prefill FLOPs per token at S */
    double f_step_fwd, f_step;       /* drafter FLOPs per step: forward, forward + backward */
    double f_step_attn, f_step_lm;   /* of which attention (fwd+bwd) and the LM head (fwd+bwd) */
    double f_drafter_token;          /* f_step / T */
    double s_step;                   /* drafter seconds per step at drafter_tflops */
    double trainer_tok_s;            /* tokens per second one trainer GPU consumes */
    double target_tok_s;             /* tokens per second one target GPU produces */
    double target_tok_s_fp8;         /* the same at --precision fp8 (× fp8_speedup) */
    double target_tflops;            /* the target rate the plan used (the run's, or the default) */
    double fp8_speedup;              /* DT_PLAN_FP8_SPEEDUP, or DT_PLAN_FP8_SPEEDUP_MOE for a MoE target */
    double target_per_trainer;       /* target GPUs that keep one trainer GPU busy */
    double wire_bps_lo, wire_bps_hi; /* hidden-state bytes/s into one trainer GPU */
} dt_plan;

/* Fills p. CM_ERR_INVALID_ARG for impossible numbers (no anchors, S > T, rates ≤ 0, a tap
 * outside the target's layers, mismatched hidden or vocab), naming the flag to change. */
cm_status dt_plan_compute(dt_plan *p, const cm_target_cfg *t, const cm_drafter_cfg *d,
                          const dt_plan_run *run);

/* Prints the plan as a readable table to f, with the assumptions and a row per sequence length
 * (1k..32k up to the token budget) of target GPUs per trainer GPU. */
void dt_plan_print(FILE *f, const dt_plan *p, const cm_target_cfg *t, const cm_drafter_cfg *d);

#ifdef __cplusplus
}
#endif
#endif /* DT_PLAN_H */
