/* drafter-trainer/cmd/dt_eval.h — `drafter-trainer eval`: speculative decoding of held-out prompts
 * with a trained drafter against a target-server's decoding endpoint (cm_dec.h, the DECODE message of
 * cm_proto.h), and the target's own decoding as the baseline. The pieces, so that tests can run them
 * without a server:
 *   dt_eval.c         the command: flags, the drafter and its frozen matrices, the endpoint, the run
 *   dt_eval_loop.c    the decoding loop over a verifier and a drafter given as interfaces
 *   dt_eval_report.c  prompts from a tokenized dataset, the target's EOS ids, the statistics, the table
 *                     and the JSON report
 *
 * The loop (docs/drafter.md "Inference"). Up to `batch` sequences are active; each STEP carries all of
 * them. A new sequence's record has handle 0, n_ctx = its prompt and no drafts (the prefill: the answer
 * gives its first token and the prompt's taps). A running sequence's record has n_ctx = 1 (the anchor:
 * the token the previous answer returned) and n_draft = B − 1 drafts the drafter proposed after it
 * (fewer near max_new; none with target_only). The answer says a drafts were accepted: the 1 + a
 * committed tokens' taps go to the drafter's cache, the sequence emits a + 1 tokens (the accepted
 * drafts and the next token), and stops at max_new generated tokens or at an EOS token (kept, and
 * counted); a finished sequence's handle is CLOSEd after that step, and the next prompt takes its
 * place. One thread. */
#ifndef DT_EVAL_H
#define DT_EVAL_H

#include <stdint.h>
#include <stdio.h>

#include "cm_proto.h"
#include "cm_status.h"
#include "dt_dataset.h"
#include "dt_infer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_EVAL_MAX_BLOCK 64
#define DT_EVAL_MAX_EOS   16

// ----------------------------------------------------------------------------
// prompts and the target's end-of-sequence tokens (dt_eval_report.c)

/* A prompt: the tokens of document doc before its first supervised token (loss mask 1). */
typedef struct dt_eval_prompt {
    int64_t        doc;
    const int32_t *ids; /* borrowed from the dt_docs */
    int64_t        n;
} dt_eval_prompt;

/* The prompts of docs in document order, at most max of them (0: all). A document whose first token
 * is supervised, or that has no supervised token, has no prompt; *skipped counts those passed over.
 * *out is malloc'd (caller frees) and borrows docs. */
cm_status dt_eval_prompts(const dt_docs *docs, int64_t max, dt_eval_prompt **out, int64_t *n,
                          int64_t *skipped);

/* The target's end-of-sequence ids: eos_token_id (an integer or a list) of MODEL_DIR/config.json (its
 * top level and text_config) and MODEL_DIR/generation_config.json (when present), without repeats.
 * *n = 0 when none names any (decoding then stops at max_new only). CM_ERR_FORMAT for a malformed
 * file or value, naming it. */
cm_status dt_eval_eos_ids(const char *model_dir, int32_t *ids, int cap, int *n);

// ----------------------------------------------------------------------------
// statistics (dt_eval_report.c)

/* One prompt's decoding. */
typedef struct dt_eval_seq {
    int64_t  doc, prompt_len;
    int64_t  generated; /* tokens emitted, the prefill's first token included, cut at EOS and max_new */
    int64_t  steps;     /* verify steps (the prefill is not one) */
    int64_t  verified;  /* Σ emitted over the verify steps: a + 1, cut at EOS and max_new (z-lab's count) */
    int64_t  drafted;   /* draft tokens sent */
    int64_t  hist[DT_EVAL_MAX_BLOCK];     /* steps that accepted a = 0, 1, ... drafts */
    int64_t  slot_acc[DT_EVAL_MAX_BLOCK]; /* steps whose draft k (1-based) was accepted */
    double   t_start, t_end;              /* seconds (cm_now_s): its first STEP sent, its last answer */
    int      eos;                         /* stopped at an EOS token */
    int32_t *out;                         /* [generated] the tokens (malloc'd by the loop) */
    int32_t *trace;                       /* [2·steps] per verify step: drafts sent, drafts accepted (malloc'd
                                             by the loop; the report's "steps" with trace) */
} dt_eval_seq;

void dt_eval_seq_release(dt_eval_seq *s); /* frees out */

/* Records one verify step of s that sent n_draft drafts, had a of them accepted and emitted `emitted`
 * tokens (a + 1, or fewer where an EOS token or max_new cut the step: z-lab's acceptance length). */
void dt_eval_seq_step(dt_eval_seq *s, int n_draft, int a, int emitted);

/* Figures over some prompts: sums, and τ = verified / steps (the mean tokens per verify step, bonus
 * included; 0 without steps), the acceptance by slot slot_acc[k] / steps, tokens/s = generated / wall. */
typedef struct dt_eval_summary {
    int64_t n_prompts, generated, steps, verified, drafted, n_eos;
    int64_t hist[DT_EVAL_MAX_BLOCK], slot_acc[DT_EVAL_MAX_BLOCK];
    double  tau, wall_s, tokens_per_s;
    double  draft_s, verify_s; /* time in the drafter (append and draft) and in the verifier's steps */
} dt_eval_summary;

void   dt_eval_summarize(const dt_eval_seq *seqs, int64_t n, double wall_s, dt_eval_summary *out);
double dt_eval_seq_tau(const dt_eval_seq *s);

/* What a run was: for the table and the JSON. */
typedef struct dt_eval_meta {
    const char *drafter, *target, *data, *device, *endpoint;
    const char *kind; /* "DFlash", "DFlash2", or "none" (target only) */
    int         block, batch, top_k, target_only;
    int         trace; /* the JSON holds each prompt's tokens and per-step drafts and acceptances */
    int64_t     max_new;
    double      temperature, top_p; /* temperature < 0: the target's generation_config.json */
    uint64_t    seed;
} dt_eval_meta;

/* A report: the speculative run (or the target-only one, alone) and, with compare, the target-only run
 * of the same prompts: its figures and, per prompt, whether its tokens equal the speculative ones. */
typedef struct dt_eval_report {
    dt_eval_meta       meta;
    const dt_eval_seq *seqs;
    int64_t            n;
    dt_eval_summary    all;
    int                compare;
    const dt_eval_seq *base; /* [n] the target-only run (compare) */
    dt_eval_summary    base_all;
} dt_eval_report;

/* The first position where two runs' tokens differ, or −1 when they are the same. */
int64_t dt_eval_first_diff(const dt_eval_seq *a, const dt_eval_seq *b);

/* The table on f: one line per prompt, then the totals, the acceptance histogram and by slot. */
void dt_eval_print(FILE *f, const dt_eval_report *r);
/* The report as JSON text (malloc'd, NUL-terminated; caller frees):
 *   {drafter, kind, target, data, endpoint, device, target_only, block, batch, max_new, temperature, top_p,
 *    top_k, seed (a decimal string), overall: S,
 *    prompts: [{doc, prompt_tokens, generated, steps, tau, accept_hist, accept_by_slot, wall_s, tokens_per_s,
 *               eos; with compare also identical, first_diff (−1 when identical), target_only_tokens_per_s;
 *               with trace also tokens [generated], n_draft [steps] and accepted [steps]}],
 *    with compare target_only_run: S + {identical (prompts), all_identical, speedup}}
 *   S = {prompts, generated, steps, tau, accept_hist [B] (steps with a = 0 .. B − 1), accept_by_slot [B − 1]
 *        (share of steps whose draft k = 1 .. B − 1 was accepted), drafted, eos, wall_s, tokens_per_s,
 *        drafter_s, target_s}
 * Strings of the meta that are NULL are null. */
cm_status dt_eval_json(const dt_eval_report *r, char **out);
/* Writes text to path atomically (path.tmp, fsync, rename). */
cm_status dt_eval_write_file(const char *path, const char *text);

// ----------------------------------------------------------------------------
// the decoding endpoint (dt_eval.c)

/* What a server's STATUS says about decoding: the weights it serves (0: not said), how many sequences
 * it decodes at once and how long (0: not said). */
typedef struct dt_eval_server_info {
    uint64_t weights_id;
    int      decode_seqs;
    int64_t  decode_max_len;
} dt_eval_server_info;

/* The decoding endpoint of the target-server at server (tcp://HOST:PORT or ipc://PATH), from its STATUS
 * ("decode_endpoint" of its "target" object, where target-server puts it, or of the top level), a
 * wildcard host (a server bound to every interface: "*" or 0.0.0.0) replaced by server's host; key and
 * secret: the CURVE key files as cm_chan_status_query takes them (NULL: none).
 * CM_ERR_UNSUPPORTED when the server names none, its message ending with hint (NULL: nothing), e.g.
 * the flag that names an endpoint instead; the STATUS query's own failures as they come. *si: what the
 * STATUS lists about decoding. */
cm_status dt_eval_decode_endpoint(const char *server, const char *key, const char *secret, const char *hint,
                                  char *out, size_t cap, dt_eval_server_info *si);
/* The server's decoding capacity (si, from its STATUS; 0 = not said) against batch sequences at once and
 * prompts of up to `longest` tokens plus max_new: CM_ERR_INVALID_ARG naming the command's flags (batch_flag,
 * max_new_flag, e.g. "--batch" and "--max-new") and the server's, and what to change. */
cm_status dt_eval_check_capacity(const dt_eval_server_info *si, const char *server, int batch, const char *batch_flag,
                                 int64_t longest, int64_t max_new, const char *max_new_flag);

// ----------------------------------------------------------------------------
// the loop (dt_eval_loop.c)

/* The verifier: one DECODE step and its answer (cm_dec_client_step's contract: the answer's tensors
 * stay valid until the next call). */
typedef struct dt_eval_target {
    cm_status (*step)(void *user, cm_proto_decode *rq, cm_proto_answer *ans);
    void *user;
} dt_eval_target;

/* The drafter, as dt_infer's calls (dt_eval_drafter_infer gives those): n_slots sequence slots and
 * blocks of `block` slots. probs may be ignored. */
typedef struct dt_eval_drafter {
    int n_slots, block;
    cm_status (*append)(void *user, const dt_infer_rows *rows);
    /* drafts [n, block − 1] with blocks of `block` slots (2 ≤ block ≤ the drafter's block) */
    cm_status (*draft)(void *user, int block, int n, const int32_t *slots, const int32_t *anchor, int32_t *drafts);
    void (*reset)(void *user, int slot);
    void *user;
} dt_eval_drafter;

/* A dt_infer as the loop's drafter (borrowed). */
dt_eval_drafter dt_eval_drafter_infer(dt_infer *inf);

typedef struct dt_eval_opts {
    int64_t        max_new;     /* tokens to generate per prompt (≥ 1) */
    int            batch;       /* sequences per STEP (≥ 1; ≤ the drafter's n_slots) */
    int            target_only; /* n_draft 0 always; no drafter, no taps asked for */
    float          temperature, top_p;
    uint32_t       top_k;
    uint64_t       seed;     /* prompt i samples with seed + i */
    uint32_t       flags;    /* CM_DECODE_FLAG_* of every record */
    cm_encoding    encoding; /* of the answer's hidden states */
    int            n_taps;   /* layer ids asked for (the drafter's target_layer_ids), D wide each */
    const int32_t *layer_ids;
    int64_t        hidden;
    const int32_t *eos; /* [n_eos] */
    int            n_eos;
    int            quiet; /* each finished prompt's line at debug level (else info) */
} dt_eval_opts;

/* Decodes the n prompts (in order, up to o->batch at a time) with the drafter (NULL with
 * target_only) against the target; seqs [n] receive the figures and the tokens (release each with
 * dt_eval_seq_release). *wall_s: the run's time; draft_s / verify_s (optional): time in the drafter
 * and in the target's steps. An answer that breaks the DECODE contract (a missing or misshapen
 * tensor, a handle or length other than the request's) is CM_ERR_PROTOCOL naming it. */
cm_status dt_eval_run(const dt_eval_target *t, const dt_eval_drafter *d, const dt_eval_opts *o,
                      const dt_eval_prompt *prompts, int64_t n, dt_eval_seq *seqs, double *wall_s,
                      double *draft_s, double *verify_s);

#ifdef __cplusplus
}
#endif
#endif /* DT_EVAL_H */
