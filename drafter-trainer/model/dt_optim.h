/* drafter-trainer/model/dt_optim.h — the drafter optimizer (docs/drafter.md):
 * AdamW on the fp32 master parameters through the backend's adamw entry, global grad-norm
 * clipping through its sumsq entry, and SpecForge's CosineAnnealingWarmupLR schedule.
 *
 * Schedule, for the optimizer step with 0-based index t (t steps already taken), total
 * steps N and warmup steps W = floor(warmup_ratio · N) (SpecForge: int(ratio · total)):
 *     t < W:       lr(t) = lr · (t + 1) / W
 *     W ≤ t < N:   lr(t) = lr · ½ · (1 + cos(π · (t − W) / (N − W)))
 *     t ≥ N:       lr(t) = 0
 * (PyTorch's CosineAnnealingLR(T_max = N − W, eta_min = 0) after the warmup, in closed form;
 * lr(W) = lr exactly.) Clipping: norm = sqrt(Σ over every grad element of g²) in double,
 * grad_scale = min(1, clip / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_, applied inside
 * the AdamW update (g ← grad · grad_scale); clip ≤ 0 disables it.
 *
 * A dt_optim borrows the parameters (their data and grad pointers, in backend memory) and
 * owns the Adam moments m and v (fp32, backend memory, one allocation each, zeroed at
 * create). One thread, the backend context's. */
#ifndef DT_OPTIM_H
#define DT_OPTIM_H

#include <stdint.h>

#include "cm_status.h"
#include "dt_model.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_optim_config {
    double  lr;           /* peak learning rate */
    double  beta1, beta2; /* Adam moment decays */
    double  eps;          /* Adam denominator term */
    double  weight_decay; /* decoupled (AdamW); 0 by default as in SpecForge */
    double  clip;         /* global grad-norm bound; ≤ 0 disables clipping */
    int64_t total_steps;  /* N, schedule length in optimizer steps (≥ 1) */
    int64_t warmup_steps; /* W, 0 ≤ W ≤ N */
} dt_optim_config;
#define DT_OPTIM_CONFIG_DEFAULT                                                                              \
    { 6e-4, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, 0 }

/* W = floor(ratio · N) (ratio in [0, 1]). */
int64_t dt_optim_warmup_steps(int64_t total_steps, double warmup_ratio);
/* lr(t) of the schedule above. */
double dt_optim_lr(const dt_optim_config *cfg, int64_t t);
/* min(1, clip / (norm + 1e-6)); 1 when clip ≤ 0. */
double dt_optim_clip_scale(double norm, double clip);

typedef struct dt_optim dt_optim;

/* What one step did. */
typedef struct dt_optim_stats {
    int64_t step;       /* 1-based index of the step just taken */
    double  lr;         /* lr(step − 1) */
    double  grad_norm;  /* global norm before clipping */
    double  grad_scale; /* clip factor applied */
    int     copies;     /* 1: the update wrote the bf16 copies (dt_optim_set_copies) */
} dt_optim_stats;

/* Checks cfg (lr ≥ 0, betas in [0, 1), eps ≥ 0, weight_decay ≥ 0, 0 ≤ W ≤ N, N ≥ 1) and that
 * the backend has sumsq and adamw; allocates m and v for the n_params parameters (borrowed;
 * they must outlive the optimizer). Caller destroys with dt_optim_destroy. */
cm_status dt_optim_create(dt_optim **out, const kn_backend *be, kn_ctx *ctx, const dt_param *const *params,
                          int n_params, const dt_optim_config *cfg);
void      dt_optim_destroy(dt_optim **o); /* NULL-safe; sets *o = NULL */

/* bf16 copies written by the update (kn_mt_tensor.w16): after each step's AdamW, parameter i's
 * new values rounded to bf16 go to dst[i] (NULL: none; dt_model_w16.c places the drafter's weight
 * copies). A copy may lie in memory that holds another parameter's gradient, so the update runs
 * in groups, in increasing group[i] ≥ 0, and a copy of group k may overlap only the gradients of
 * groups below k, which that step has read by then; it may overlap no parameter, moment or
 * other copy. Both arrays are in parameter order and copied. Needs the backend's multi-tensor
 * entries. Fails with CM_ERR_INVALID_ARG naming the parameters whose memory clashes. */
cm_status dt_optim_set_copies(dt_optim *o, uint16_t *const *dst, const int *group);
/* dt_optim_set_copies with the drafter's weight copies (dt_model_w16_targets) for an optimizer
 * made over the model's parameters in model order; nothing to do where the model has none or the
 * backend lacks the multi-tensor entries (the forward then rounds its weights itself). A
 * step that wrote them reports stats.copies: pass that on with dt_model_w16_written. */
cm_status dt_optim_copies_of_model(dt_optim *o, const dt_model *m);

/* Global gradient norm over every parameter's grad (sums of squares in parameter order). */
cm_status dt_optim_grad_norm(dt_optim *o, double *norm);
/* One step: norm, clip factor, lr(t) with t = steps taken, AdamW (bias-correction step t + 1)
 * on every parameter; then t increases. A non-finite gradient norm changes nothing and fails
 * with CM_ERR_INVALID_ARG naming the step. Fills stats when non-NULL. */
cm_status dt_optim_step(dt_optim *o, dt_optim_stats *stats);

const dt_optim_config *dt_optim_cfg(const dt_optim *o);
int64_t                dt_optim_steps_done(const dt_optim *o);
void                   dt_optim_set_steps_done(dt_optim *o, int64_t t); /* resume */
int                    dt_optim_n_params(const dt_optim *o);
const dt_param        *dt_optim_param(const dt_optim *o, int i);
/* The moments of parameter i (backend memory, numel floats each), for checkpoints. */
float *dt_optim_m(const dt_optim *o, int i);
float *dt_optim_v(const dt_optim *o, int i);

#ifdef __cplusplus
}
#endif
#endif /* DT_OPTIM_H */
