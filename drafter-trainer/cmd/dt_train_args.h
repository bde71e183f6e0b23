/* drafter-trainer/cmd/dt_train_args.h — the flags of `drafter-trainer train` (dt_train.c): their
 * values, --help, and the checks between them, parsed with cm_args.h after dt_runcfg.h has
 * expanded a --run-config file into the argument list. */
#ifndef DT_TRAIN_ARGS_H
#define DT_TRAIN_ARGS_H

#include <stdint.h>

#include "cm_proto.h"
#include "dt_progress.h"

typedef struct train_args {
    const char *config, *init_from, *target, *data, *data_dir, *dataset, *out, *device, *shards, *server;
    const char *curve_server_key, *curve_secret_key; /* --server on another host (CURVE) */
    int64_t     epochs, steps, max_anchors, save_every, log_every, credits, timeout_ms, prefetch;
    int64_t     token_budget, dp_rank, dp_size; /* dp: -1 = from RANK / WORLD_SIZE, else 0 / 1 */
    int64_t     gpu;       /* cuda device; -1 = LOCAL_RANK modulo the visible devices, else 0 */
    const char *precision; /* "bf16" or "fp32" GEMMs on cuda; NULL = bf16 */
    cm_encoding encoding;
    double      lr, warmup_ratio, gamma, weight_decay, clip;
    int         have_gamma, resume;
    int         verify_lazy; /* --verify-shards lazy: a record is checked only when a step reads it */
    int         target_random; /* --target-init random: no checkpoint; random frozen matrices */
    uint64_t    target_seed;
    uint64_t    seed;
    dt_progress_mode progress;
    int              dry_run, no_tensorboard;
    int64_t          plan_seq_len;
    double           plan_target_tflops, plan_drafter_tflops, plan_ratio;
    /* --eval-every: speculative decoding of held-out prompts during training (dt_train_eval.h) */
    int64_t     eval_every, eval_prompts, eval_max_new, eval_batch; /* eval_every 0: off */
    const char *eval_data, *eval_server;
    /* DFlash2's selector term (dt_hparams) */
    double sel_alpha, sel_warmup_ratio, sel_ramp_ratio;
    int    sel_miss, sel_stop_grad;
} train_args;

/* Parses argv (the arguments after `train`, strings borrowed) into a. 0 ok, 1 help printed,
 * 2 usage error (one message printed on stderr). */
int dt_train_args_parse(int argc, char **argv, train_args *a);

#endif /* DT_TRAIN_ARGS_H */
