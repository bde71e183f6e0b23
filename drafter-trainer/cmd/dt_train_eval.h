/* drafter-trainer/cmd/dt_train_eval.h — `train --eval-every N`: the evaluation `drafter-trainer eval`
 * runs (dt_eval.h: its decoding loop, greedy), made during training with the drafter of the current
 * training weights, against a target-server's decoding endpoint (the live --server the run trains
 * from, or --eval-server; found through its STATUS), and its figures as one metrics.jsonl record,
 * TensorBoard scalars and one line on the progress stream.
 *
 * Everything is made once, at create: the prompts, the target's EOS ids, the decoding client and a
 * dt_infer over the training model. The dt_infer borrows the model and only reads it: the F32 masters
 * the optimizer has just written are the weights it drafts with, and the bf16 copies it keeps where
 * the backend's GEMMs round their inputs (cuda, bf16) are refreshed at the start of every evaluation.
 * An evaluation writes only its own memory (the dt_infer's caches and block, the loop's buffers,
 * freed before it returns), draws no random number and reads no batch, so the training run's losses
 * and checkpoints are the same bits with and without it (tests/test_dt_train_eval.c). The first
 * evaluation also decodes the prompts with the target alone (the baseline: its tokens/s and tokens,
 * against which each evaluation counts the prompts whose tokens are identical; greedy decoding must
 * be lossless). One thread: the trainer's. */
#ifndef DT_TRAIN_EVAL_H
#define DT_TRAIN_EVAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cm_status.h"
#include "cm_tb.h"
#include "dt_eval.h"
#include "dt_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_train_eval dt_train_eval;

typedef struct dt_train_eval_config {
    const char *data;    /* tokenized documents (.jsonl or .safetensors, as dt_docs_read reads) */
    int64_t     prompts; /* the first K prompts of data (0: all) */
    int64_t     max_new; /* tokens generated per prompt, EOS included (≥ 1) */
    int         batch;   /* sequences per verify step (≥ 1; at most the number of prompts is used) */
    const char *target;  /* the target's model directory, for its EOS ids; NULL: none (max_new only) */
    /* the verifier: a target-server whose STATUS names its decoding endpoint ... */
    const char *server;
    const char *curve_server_key, *curve_secret_key; /* as cm_dec_client_config; NULL: none */
    int         timeout_ms;                          /* longest wait for one step's answer */
    uint64_t    weights_id; /* the run's target weights, checked against the server's (0: not checked) */
    const char *hint; /* ends the refusal of a server without decoding (e.g. the flag to use instead) */
    /* ... or, for tests, an in-process one (borrowed; then server is not used) */
    const dt_eval_target *verifier;
} dt_train_eval_config;

/* One evaluation's figures. done = 0: the target failed it (said as a warning); nothing else is set. */
typedef struct dt_train_eval_result {
    int             done;
    int64_t         step;  /* the training step whose weights drafted */
    int             block; /* B */
    dt_eval_summary all;   /* the speculative run over every prompt */
    int             have_base;
    double          base_tokens_per_s; /* the target alone (the first evaluation's run) */
    int64_t         identical;         /* prompts whose tokens equal the target-only run's */
} dt_train_eval_result;

/* Reads the prompts (refusing a file without any, or a token outside the model's vocabulary), finds
 * the decoding endpoint (CM_ERR_UNSUPPORTED when the server decodes nothing), checks what the server's
 * STATUS lists (CM_ERR_INVALID_ARG naming the flag: other weights than weights_id, fewer sequences at
 * once than batch, sequences shorter than the longest prompt + max_new), connects, and makes the dt_infer over m (borrowed, read only; it must
 * outlive the evaluator and have its frozen embedding and LM head). Caller destroys with
 * dt_train_eval_destroy. */
cm_status dt_train_eval_create(dt_train_eval **out, const dt_train_eval_config *cfg, const dt_model *m);
void      dt_train_eval_destroy(dt_train_eval **ev); /* NULL-safe; sets *ev = NULL */

/* The backend memory the evaluator holds (its dt_infer), and its number of prompts. */
size_t  dt_train_eval_bytes(const dt_train_eval *ev);
int64_t dt_train_eval_n_prompts(const dt_train_eval *ev);

/* Decodes every prompt with the model's current weights (and, the first time, with the target
 * alone); the figures into *res. A failure of the target (unreachable, a timeout, an ERROR, an answer
 * that breaks the DECODE contract) is logged as a warning and leaves res->done = 0 and CM_OK: the
 * next evaluation reconnects. A failure of the drafter (its backend) is returned. */
cm_status dt_train_eval_run(dt_train_eval *ev, int64_t step, dt_train_eval_result *res);

/* Reports a done evaluation (nothing for one the target failed): one record appended to metrics
 * (path: for messages) and flushed, {"step", "eval_tau", "eval_accept_hist" [B] (steps that accepted
 * a = 0 .. B − 1 drafts), "eval_accept_by_slot" [B − 1] (share of steps whose draft k was accepted),
 * "eval_accept_rate" (accepted drafts / drafts sent), "eval_prompts", "eval_generated", "eval_steps",
 * "eval_drafted", "eval_eos", "eval_wall_s", "eval_tokens_per_s", "eval_drafter_s", "eval_target_s",
 * and with the baseline "eval_target_only_tokens_per_s", "eval_speedup", "eval_identical"}: every key
 * but "step" starts with "eval_", so readers of the step records pass it over; the TensorBoard scalars
 * at r->step when tb is not NULL: eval/tau, eval/accept_rate, eval/tokens_per_s, with the baseline
 * eval/target_only_tokens_per_s, eval/speedup and eval/identical (a share of the prompts), then
 * eval/accept_slot_<k> (k = 1 .. B − 1, as many as fit one event); and the line of
 * dt_train_eval_format on out when it is not NULL. */
cm_status dt_train_eval_report(const dt_train_eval_result *r, FILE *metrics, const char *path, cm_tb *tb,
                               FILE *out);
/* The progress line (no newline): "eval step 120: tau 2.310 | accepted by slot 0.71 0.48 ... | 8 prompts,
 * 192 tokens in 83 steps | 48.2 tok/s, target alone 30.1 (x1.60) | identical 8/8 | 3.9 s". The length
 * written (< cap, cut short if cap is). */
size_t dt_train_eval_format(char *buf, size_t cap, const dt_train_eval_result *r);

#ifdef __cplusplus
}
#endif
#endif /* DT_TRAIN_EVAL_H */
