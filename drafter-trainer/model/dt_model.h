/* drafter-trainer/model/dt_model.h — the DFlash and DFlash2 drafters (docs/drafter.md): its
 * parameters (fp32 masters and fp32 gradients in backend memory), the frozen target
 * embedding and LM head it borrows from the target, and one training step: forward and
 * backward over a packed batch with given anchors, written once against the kernel backend
 * table (so the whole step runs on the cpu reference).
 *
 * Parameter names are the serving-checkpoint keys ("fc.weight", "hidden_norm.weight",
 * "norm.weight", "layers.{l}.self_attn.q_proj.weight", ...; DFlash2 adds each layer's two convolutions and,
 * after norm.weight, the candidate selector), in a fixed order. The model
 * owns its memory; it borrows the backend and context, which must outlive it. One thread. */
#ifndef DT_MODEL_H
#define DT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "cm_cfg.h"
#include "cm_safetensors.h"
#include "cm_status.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_model dt_model;

typedef struct dt_param {
    const char *name;     /* serving key */
    int         n_dims;   /* 1, 2 or 3 (DFlash2's base_kernel [2, Kc, D]) */
    int64_t     shape[3];
    int64_t     numel;
    float      *data;     /* backend memory, fp32 master */
    float      *grad;     /* backend memory, fp32, this step's after every dt_model_step */
} dt_param;

/* A packed batch on the host (docs/drafter.md, docs/checks.md). target_hidden is F32 [T, n_taps·D] on the
 * host. When it is NULL the taps come one array per tap, tap k (target_layer_ids order) [T, D] in
 * taps_dt (BF16 or F32), borrowed until dt_model_step returns: host_taps[k] in host memory as a
 * server answered them (the ZeroMQ data path: uploaded as they are, no widening on the host), or,
 * when host_taps[0] is NULL, dev_taps[k] already in backend memory (the NCCL data path, a
 * benchmark). */
#define DT_MAX_TAPS CM_CFG_MAX_TAPS
typedef struct dt_batch {
    int64_t        T;
    int            n_seq;
    const int32_t *cu_seqlens;    /* [n_seq + 1] */
    const int32_t *input_ids;     /* [T] */
    const int32_t *loss_mask;     /* [T], 0 or 1 */
    const float   *target_hidden; /* [T, n_taps·D] */
    int64_t        n_anchors;
    const int32_t *anchors;       /* [n_anchors], sorted ascending, each in [0, T) */
    const void    *host_taps[DT_MAX_TAPS]; /* host memory, used when target_hidden is NULL */
    const void    *dev_taps[DT_MAX_TAPS];  /* backend memory, used when both above are NULL */
    cm_dtype       taps_dt;                /* of host_taps or dev_taps */
} dt_batch;

/* What a step measured. acc_hits[k] / acc_count[k] is the accuracy of slot k (k ≥ 1, over
 * slots with weight > 0); tau is the mean over blocks of 1 + the number of leading slots
 * k = 1, 2, ... whose argmax equals the label (a slot without a label stops the run); 0 when
 * there are no blocks, 1 when there are blocks but no labels. loss uses the fp32 CE values of
 * the LM-head op, summed in double. */
typedef struct dt_step_stats {
    double  loss;         /* Σ w·CE / Σ w (0 when Σ w = 0); DFlash2: loss_unary + α·loss_selector */
    double  weight_sum;   /* Σ w */
    int64_t n_blocks;
    double  tau;
    int64_t acc_hits[64], acc_count[64]; /* indexed by slot, [0, B) */
    /* DFlash2 (0 for DFlash): the two terms, α, and the selector's figures per slot over the
     * trained slots: sel_in_topk[k] of acc_count[k] have their label in the unary top-K (recall@K),
     * sel_hits[k] of those the selector's choice right (teacher forced); sel_tau is τ of the
     * greedy selector path (1 + the leading run of slots whose label is in the top-K and chosen);
     * sel_weight_sum is the selector term's Σ w (the kept slots' under KN_SEL_DROP). */
    double  loss_unary, loss_selector, alpha, sel_weight_sum, sel_tau;
    int64_t sel_in_topk[64], sel_hits[64];
} dt_step_stats;

/* DFlash2's selector term in the step: loss = unary + alpha · selector (alpha 0: the selector is
 * scored for the metrics but nothing flows back from it); miss: a label outside the unary top-K
 * is injected at rank K (default) or the slot leaves the term; stop_grad: the selector's gradient
 * reaches its own parameters only, not the drafter's hidden states. */
typedef struct dt_selector_opts {
    double      alpha;
    kn_sel_miss miss;
    int         stop_grad;
} dt_selector_opts;
#define DT_SELECTOR_OPTS_DEFAULT {1.0, KN_SEL_INJECT, 0}
/* The --selector-miss names in kn_sel_miss order ("inject", "drop"), NULL-terminated (cm_args_choice). */
extern const char *const dt_selector_miss_names[3];

/* Creates a drafter of cfg (block_size ≤ 64, even head_dim, no attention_bias, ...) on the
 * backend with parameters zeroed: one backend allocation for all parameters and one for all
 * gradients. CM_ERR_UNSUPPORTED ("the cuda backend has no drafter kernels yet ...") when the
 * backend table lacks an entry the step needs. The frozen embedding and LM head are attached
 * separately. Caller destroys with dt_model_destroy. */
cm_status dt_model_create(dt_model **out, const cm_drafter_cfg *cfg, const kn_backend *be, kn_ctx *ctx);
/* Sets DFlash2's selector options for the next steps (ignored by a DFlash drafter). CM_ERR_INVALID_ARG
 * for alpha < 0 or not finite. */
cm_status dt_model_set_selector(dt_model *m, const dt_selector_opts *o);
void      dt_model_destroy(dt_model **m); /* NULL-safe */
const cm_drafter_cfg *dt_model_cfg(const dt_model *m);

/* Hugging Face Qwen3 initialisation: every weight matrix ~ normal(0, 0.02), each block of 2^20
 * values from its own cm_rng stream of (seed, parameter, block), drawn on the host's cores (the
 * same values for any thread count and on every machine), every norm weight 1. DFlash2's
 * convolutions start as the identity (base tap 0 = 1, the other taps and the kernel projection
 * 0), so an untrained DFlash2 computes what a DFlash does; its codebooks and hidden projection
 * are weight matrices. */
cm_status dt_model_init_random(dt_model *m, uint64_t seed);
/* Loads the parameters from a serving checkpoint directory (config.json must match cfg;
 * model.safetensors with every key, optionally "model."-prefixed, any float dtype; extra keys
 * are ignored). Missing or misshapen tensors name the key. */
cm_status dt_model_load(dt_model *m, const char *dir);
/* Attaches the frozen target embedding and LM head ([V, D] each, host data in F32 or BF16,
 * copied to the backend). lm_head may equal embed (tied). Checks V and D against cfg. */
cm_status dt_model_set_frozen(dt_model *m, const void *embed, cm_dtype embed_dt, const void *lm_head,
                              cm_dtype lm_head_dt, int64_t V, int64_t D);
/* dt_model_set_frozen from a target checkpoint: the embedding under
 * model.language_model.embed_tokens.weight or model.embed_tokens.weight, the LM head under
 * lm_head.weight unless `tied` and absent; each [V, D]. F32 and BF16 are read in place from
 * the open checkpoint, other float dtypes widened into owned[0] (embedding) / owned[1] (head),
 * which the caller frees. */
cm_status dt_model_set_frozen_from(dt_model *m, const cm_st *target, int64_t V, int64_t D, int tied,
                                   float *owned[2]);

int             dt_model_n_params(const dt_model *m);
const dt_param *dt_model_param(const dt_model *m, int i);
const dt_param *dt_model_find_param(const dt_model *m, const char *name); /* NULL if absent */

/* Plans the activation memory for batches of up to T tokens and n_anchors anchors now (one
 * backend allocation), so the training loop allocates nothing and a batch that cannot fit
 * fails before the first step. Later larger batches still grow it (dt_model_step). With BF16
 * storage, device taps are read where they are; the first step fed host features
 * (target_hidden or host_taps) adds one allocation that keeps them as BF16 (T · n_taps · D · 2
 * bytes). */
cm_status dt_model_reserve(dt_model *m, int64_t T, int64_t n_anchors);

/* The dtype of the activations the step saves for its backward: F32, or BF16 by default
 * where the backend's gemm rounds its inputs to bf16 anyway (cuda with KN_GEMM_MODE_BF16:
 * half the activation memory, and GEMM inputs that need no conversion pass; see dt_model.c).
 * Setting it (F32 or BF16; BF16 needs the backend's matmul entry) re-plans the activation
 * memory at its current size; a cpu model with BF16 storage computes what the cuda one does
 * with it, in fp32 GEMMs (tests). */
cm_status dt_model_set_act_dtype(dt_model *m, cm_dtype dt);
cm_dtype  dt_model_act_dtype(const dt_model *m);
/* Bytes of backend memory the activation plan holds now (0 before the first reserve/step). */
size_t dt_model_act_bytes(const dt_model *m);

/* The bf16 weight copies an optimizer can write for the next step (dt_optim_set_copies; the
 * placement: dt_model_w16.c): for the parameters in model order, dst[i] (NULL where parameter i
 * has none: F32 GEMMs, the cpu, a copy that finds no room) and group[i], the launch group that
 * keeps every copy off gradients the update has not read yet. Returns how many copies there are. */
int dt_model_w16_targets(const dt_model *m, uint16_t **dst, int *group);
/* An optimizer step has just written every copy dt_model_w16_targets names from the parameters
 * as they now are: the next step's forward reads them instead of rounding its weights again.
 * Call it right after that update; dt_model_init_random and dt_model_load forget it. */
void dt_model_w16_written(dt_model *m);

/* Every gradient as one backend array of n floats, in parameter order (alignment padding
 * between tensors is zeroed with them): what a data-parallel all-reduce takes at once. */
void dt_model_grad_slab(const dt_model *m, float **grad, size_t *n);
/* Called during dt_model_step's backward, in the backend context's stream order, each time
 * the gradients from slab offset off (floats) to the slab's end are final (off decreases over
 * the calls: the final norm, then each layer from the last, then fc and hidden_norm, ending
 * at 0); weight_sum is the step's Σ w. Not called when the batch has nothing to train on.
 * Data parallelism reduces each such bucket while the backward goes on (dt_dp). */
typedef cm_status (*dt_grad_hook)(void *user, size_t off, double weight_sum);
void dt_model_set_grad_hook(dt_model *m, dt_grad_hook fn, void *user);
/* The offsets the hook is called with, in call order (n_layers + 2 of them, the last 0):
 * writes up to cap, returns how many there are. */
int dt_model_grad_buckets(const dt_model *m, size_t *off, int cap);

/* Checks a batch against the model: cu_seqlens 0 … T strictly increasing, ids < vocab,
 * loss_mask 0/1, anchors sorted and in range. CM_ERR_INVALID_ARG naming the first problem. */
cm_status dt_batch_validate(const dt_model *m, const dt_batch *b);

/* One forward + backward: validates the batch, zeroes every grad, then accumulates
 * ∂loss/∂param for loss = Σ w·CE / Σ w with w = exp(−(k − 1)/gamma) (docs/drafter.md; gamma > 0).
 * Fills stats when non-NULL. Needs dt_model_set_frozen first. A batch with no anchors or
 * Σ w = 0 runs no kernel besides the zeroing: zero gradients and loss 0 (so a rank with
 * nothing to learn can still join the gradient all-reduce). Activation buffers are sized
 * for the largest batch seen (T tokens, n_anchors · B block rows), grown when a larger one
 * arrives and reused; results do not depend on that history. Synchronises before return. */
cm_status dt_model_step(dt_model *m, const dt_batch *b, float gamma, dt_step_stats *stats);

/* The acceptance of every block of the last successful step: out[j] (j < that batch's n_anchors) = the
 * leading run of slots k = 1, 2, ... of the block at anchors[j] that have a label and predict it; path
 * 0 the unary argmax (whose mean + 1 is stats.tau), path 1 DFlash2's greedy selector path (the label
 * in the top-K and chosen; mean + 1 is stats.sel_tau). The chain a decoder walks over them:
 * dt_tau_chain.h. CM_ERR_INVALID_ARG for path 1 on a DFlash drafter or another path. */
cm_status dt_model_accepted(const dt_model *m, int path, int32_t *out);

#ifdef __cplusplus
}
#endif
#endif /* DT_MODEL_H */
