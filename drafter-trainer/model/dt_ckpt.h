/* drafter-trainer/model/dt_ckpt.h — training checkpoints: the DFlash serving format plus the state
 * for an exact resume (docs/drafter.md, docs/formats.md).
 *
 * Layout under RUN_DIR/checkpoints/:
 *   step-<N>/config.json                 the drafter config as SGLang/vLLM read it (below)
 *   step-<N>/model.safetensors           BF16 (round to nearest even of the fp32 masters), one tensor
 *                                        per parameter under its serving key, in parameter order
 *                                        (fc.weight, hidden_norm.weight, norm.weight, layers.{l}.*);
 *                                        no embed_tokens, no lm_head; __metadata__ {"format": "pt"}
 *   step-<N>/training_state.safetensors  (below)
 *   latest                               one line "step-<N>": the newest complete checkpoint
 *   step-<N>/checksums.json              XXH64 of every file, header and tensor (dt_ckpt_sum.h)
 * N is the number of optimizer steps taken. A checkpoint is written into step-<N>.tmp/ (each
 * file written to a temporary name, fsync'd and renamed; checksums.json last), the directory
 * is fsync'd and renamed to step-<N>, the parent fsync'd, then latest is replaced the same
 * way. A save that fails removes its step-<N>.tmp/; one left by a crash is never read, and is
 * removed by dt_ckpt_clean when the next trainer takes the run directory (or by the next save
 * of step N). A resume checks the step against its checksums first (dt_ckpt_verify).
 *
 * Test only: with the environment variable TANDEM_FAULT=kill-in-checkpoint[:STEP] a save raises
 * SIGKILL after every file of step-<N>.tmp/ is written and synced and before the rename (at step
 * STEP, or at the first save without it), so tests/test_faults.c can show that --resume loads the
 * previous checkpoint and never the half-written one. Never set it in a real run.
 *
 * config.json fields, in this order: architectures ["DFlashDraftModel"], model_type "qwen3",
 * block_size, num_target_layers, dflash_config {block_size, mask_token_id, target_layer_ids},
 * hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
 * num_key_value_heads, head_dim, hidden_act "silu", rms_norm_eps, rope_theta, rope_scaling
 * null, attention_bias, attention_dropout 0.0, max_position_embeddings, layer_types,
 * use_sliding_window, sliding_window (null without sliding layers), initializer_range 0.02,
 * use_cache true, tie_word_embeddings, vocab_size, dtype "bfloat16". (No auto_map: we ship
 * no dflash.py remote code.) Floats are printed in their shortest round-trip form.
 *
 * training_state.safetensors:
 *   master.<key>   F32 [shape of <key>]  fp32 master weights (what training continues from)
 *   adam_m.<key>   F32 [shape]           Adam first moment
 *   adam_v.<key>   F32 [shape]           Adam second moment
 *   step           I64 [1]               optimizer steps taken (= N)
 *   cursor         I64 [2]               data cursor of the next step: (epoch, index in epoch)
 *   rng            I64 [4]               xoshiro256** words (bit patterns) of the next step's
 *                                        anchor stream, dt_anchor_rng(seed, epoch, batch id);
 *                                        checked against the derivation on resume
 *   __metadata__   format "tandem.dflash.training_state", version "1",
 *                  hparams: JSON object with lr, warmup_ratio, beta1, beta2, eps, weight_decay,
 *                  clip, loss_decay_gamma (%.17g numbers), epochs, max_anchors, n_batches,
 *                  total_steps, warmup_steps (integers), seed (decimal string),
 *                  data_hash: 16 hex digits (dt_data_hash of the batch file list),
 *                  target_weights: 16 hex digits, the fingerprint of the target whose hidden
 *                  states the run trains on (cm_weights_id; absent when not known, as
 *                  from batch files)
 * One thread; borrows everything it is given. */
#ifndef DT_CKPT_H
#define DT_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "cm_cfg.h"
#include "cm_rng.h"
#include "cm_status.h"
#include "dt_model.h"
#include "dt_optim.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_CKPT_FORMAT  "tandem.dflash.training_state"
#define DT_CKPT_VERSION "1"

/* The hyperparameters a resume must match exactly. */
typedef struct dt_hparams {
    double   lr, warmup_ratio;
    double   beta1, beta2, eps, weight_decay, clip;
    double   loss_decay_gamma;
    int64_t  epochs, max_anchors;
    int64_t  n_batches, total_steps, warmup_steps;
    uint64_t seed;
    uint64_t data_hash;
    uint64_t target_weights; /* 0: not known (not written) */
    /* DFlash2's selector term: loss = unary + α(step)·selector, α ramped from 0 after a warm-up (see
     * dt_hparams_selector_alpha); miss and stop_grad as dt_selector_opts. Checkpoints written before
     * these existed read as the defaults (1, 0, 0, inject, 0). */
    double   selector_alpha, selector_warmup_ratio, selector_ramp_ratio;
    int      selector_miss, selector_stop_grad;
} dt_hparams;

/* α at the step that follows `steps` optimizer steps: 0 for the first floor(warmup_ratio·N) steps,
 * then rising linearly over floor(ramp_ratio·N) steps (α·(i + 1)/ramp at the i-th of them), then α;
 * N = total_steps. */
double dt_hparams_selector_alpha(const dt_hparams *h, int64_t steps);

/* Where training stands after a step. */
typedef struct dt_train_state {
    int64_t step;         /* optimizer steps taken */
    int64_t epoch, index; /* data cursor of the next step */
    cm_rng  rng;          /* anchor stream of the next step */
} dt_train_state;

/* The serving config.json text of cfg (malloc'd, NUL-terminated; caller frees). */
cm_status dt_ckpt_config_json(const cm_drafter_cfg *cfg, char **out);

/* Writes config.json and model.safetensors (serving format) into dir, which must exist. */
cm_status dt_ckpt_write_model(const char *dir, const dt_model *m, const kn_backend *be, kn_ctx *ctx);

/* Saves checkpoint step-<ts->step> of RUN_DIR atomically as described above and updates
 * latest. The optimizer's parameters must be the model's. step_dir (cap bytes) receives the
 * final directory path when non-NULL. */
cm_status dt_ckpt_save(const char *run_dir, const dt_model *m, const dt_optim *o, const kn_backend *be,
                       kn_ctx *ctx, const dt_hparams *hp, const dt_train_state *ts, char *step_dir,
                       size_t cap);

/* The directory latest names (RUN_DIR/checkpoints/step-<N>) into dir; *found = 0 (and CM_OK)
 * when RUN_DIR has no latest. CM_ERR_FORMAT if latest is malformed or names a missing dir. */
cm_status dt_ckpt_latest(const char *run_dir, char *dir, size_t cap, int *found);

/* Removes what an unfinished save left in RUN_DIR/checkpoints: step-<N>.tmp/ directories and
 * latest.tmp, logging each. Only for the holder of the run directory's lock (another trainer's
 * save in progress looks the same). */
cm_status dt_ckpt_clean(const char *run_dir);

/* Checks step_dir against its checksums.json before anything of it is read (dt_ckpt_sum.h):
 * CM_ERR_FORMAT, one line naming the file and the tensor and what to do, on any mismatch.
 * A checkpoint without checksums.json (saved before they existed) is resumed with a warning
 * that it cannot be verified, once its model.safetensors opens as a whole file. */
cm_status dt_ckpt_verify(const char *step_dir);
/* The fingerprint of the target whose hidden states trained the checkpoint in step_dir
 * (training_state.safetensors' target_weights), or 0 when it is not known (a serving-format
 * directory without the training state, or a run trained from batch files). */
uint64_t  dt_ckpt_target_weights(const char *step_dir);

/* Loads the training state of step_dir into the model's parameters (masters), the
 * optimizer's moments and step, and ts. Refuses (CM_ERR_INVALID_ARG, "cannot resume: ...")
 * when any hyperparameter or the data hash differs from want, naming the field and both
 * values; CM_ERR_FORMAT for a malformed or incomplete state. */
cm_status dt_ckpt_load(const char *step_dir, const dt_hparams *want, const dt_model *m, dt_optim *o,
                       const kn_backend *be, kn_ctx *ctx, dt_train_state *ts);

#ifdef __cplusplus
}
#endif
#endif /* DT_CKPT_H */
