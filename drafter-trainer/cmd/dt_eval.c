/* drafter-trainer/cmd/dt_eval.c — `drafter-trainer eval`: speculative decoding of a tokenized
 * dataset's prompts with a trained drafter against a running target-server (dt_eval.h), reported as a
 * table and as JSON (--json). The drafter runs here, on --device; the target verifies through its
 * decoding endpoint (cm_dec.h), found in the server's STATUS ("decode_endpoint") or given with
 * --decode-server. --target-only decodes with the target alone (the reference for losslessness and
 * the baseline's tokens/s); --compare-target-only runs both and compares. Exit 0, 1 (one message on
 * stderr) or 2 (usage). */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_args.h"
#include "cm_cfg.h"
#include "cm_chan.h"
#include "cm_dec.h"
#include "cm_log.h"
#include "cm_safetensors.h"
#include "cm_weights_id.h"
#include "dt_ckpt.h"
#include "dt_cmd.h"
#include "dt_eval.h"
#include "dt_infer.h"
#include "dt_model.h"
#include "kn_backend.h"

#define CMD "drafter-trainer eval"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: drafter-trainer eval (--checkpoint DIR | --run RUN_DIR) --target MODEL_DIR\n"
        "                            (--server ENDPOINT | --decode-server ENDPOINT) --data FILE [options]\n"
        "\n"
        "Speculative decoding of held-out prompts with a trained DFlash or DFlash2 drafter against a "
        "running\n"
        "`target-server serve`: the drafter proposes a block after each token the target returns, the "
        "target\n"
        "verifies it and returns the accepted tokens and their hidden states. Prints per prompt and "
        "overall:\n"
        "tau (mean tokens per verify step, the target's own token included), the acceptance histogram and\n"
        "acceptance by draft slot, generated tokens, steps, wall time and tokens/s.\n"
        "\n"
        "  --checkpoint DIR         drafter checkpoint (config.json + model.safetensors, e.g. "
        "RUN/checkpoints/step-N)\n"
        "  --run RUN_DIR            the run's newest checkpoint (RUN_DIR/checkpoints/latest)\n"
        "  --target MODEL_DIR       the served target's model directory: the frozen embed_tokens and "
        "lm_head,\n"
        "                           and the EOS ids (eos_token_id of config.json and "
        "generation_config.json)\n"
        "  --server ENDPOINT        the target-server (tcp://HOST:PORT or ipc://PATH); its STATUS names the\n"
        "                           decoding endpoint\n"
        "  --decode-server ENDPOINT the decoding endpoint itself (instead of --server)\n"
        "  --data FILE              tokenized documents (.jsonl as train --dataset reads, or .safetensors); "
        "a\n"
        "                           document's prompt is its tokens before the first with loss_mask 1\n"
        "  --prompts K              the first K prompts of FILE (default: all)\n"
        "  --max-new M              tokens generated per prompt, EOS included (default 256)\n"
        "  --block B                block size, 2 to the drafter's (default: the drafter's block_size)\n"
        "  --batch N                sequences per verify step (default 1)\n"
        "  --temperature T          0: greedy (default); > 0: the target samples (the drafter stays greedy)\n"
        "  --top-p P --top-k K      the target's nucleus and top-k cuts with --temperature (defaults 1, 0)\n"
        "  --seed S                 prompt i samples with seed S + i (default 0)\n"
        "  --target-sampling        sample as the target's generation_config.json says (temperature, top-p\n"
        "                           and top-k above are not used)\n"
        "  --target-only            the target alone (no drafter: the baseline); --checkpoint/--run not "
        "needed\n"
        "  --compare-target-only    also run --target-only on the same prompts: its tokens/s, the speed-up "
        "and\n"
        "                           whether each prompt's tokens are identical (greedy: they must be)\n"
        "  --json OUT               the report as JSON (written atomically)\n"
        "  --trace                  the JSON also holds each prompt's tokens and per-step drafts and acceptances\n"
        "  --device cpu|cuda        the drafter's kernel backend (default cpu)\n"
        "  --gpu N                  cuda device ordinal (default 0)\n"
        "  --precision bf16|fp32    cuda GEMM inputs in bf16 (default) or true fp32\n"
        "  --encoding NAME          hidden states on the wire: raw (default), zstd or zstd-byteplane\n"
        "  --timeout-ms N           longest wait for one step's answer (default 300000)\n"
        "  --curve-server-key FILE  the server's CURVE public key (a server on another host)\n"
        "  --curve-secret-key FILE  this client's CURVE secret key (default: a fresh pair)\n"
        "  --log-level L            debug, info, warn, error, off (default info)\n");
}

typedef struct eval_args {
    const char *checkpoint, *run, *target, *server, *decode_server, *data, *json, *device, *precision;
    const char *key, *secret;
    int64_t     prompts, max_new;
    int         block, batch, gpu, timeout_ms, top_k, target_only, compare, target_sampling, trace;
    double      temperature, top_p;
    uint64_t    seed;
    cm_encoding encoding;
} eval_args;

// ----------------------------------------------------------------------------
// the target: frozen matrices and the decoding endpoint

/* The target's embedding and LM head into the model (the keys train reads). */
static cm_status set_frozen(dt_model *m, const char *target, const cm_target_cfg *t, cm_st **st,
                            float **owned) {
    CM_TRY(cm_st_open_dir(st, target));
    return dt_model_set_frozen_from(m, *st, t->vocab_size, t->hidden_size, t->tie_word_embeddings, owned);
}

cm_status dt_eval_decode_endpoint(const char *server, const char *key, const char *secret, const char *hint,
                                  char *out, size_t cap, dt_eval_server_info *si) {
    static char reply[CM_PROTO_STATUS_MAX + 1];
    CM_TRY(cm_chan_status_query(server, key, secret, 10000, reply, sizeof reply));
    cJSON       *o = cJSON_Parse(reply);
    const cJSON *tg = cJSON_GetObjectItemCaseSensitive(o, "target");
    const cJSON *wi = cJSON_GetObjectItemCaseSensitive(o, "weights_id");
    const cJSON *ns = cJSON_GetObjectItemCaseSensitive(tg, "decode_seqs");
    const cJSON *ml = cJSON_GetObjectItemCaseSensitive(tg, "decode_max_len");
    si->weights_id     = cJSON_IsString(wi) ? strtoull(wi->valuestring, NULL, 16) : 0;
    si->decode_seqs    = cJSON_IsNumber(ns) ? (int)ns->valuedouble : 0;
    si->decode_max_len = cJSON_IsNumber(ml) ? (int64_t)ml->valuedouble : 0;
    const cJSON *ep = cJSON_GetObjectItemCaseSensitive(tg, "decode_endpoint");
    if (!ep) ep = cJSON_GetObjectItemCaseSensitive(o, "decode_endpoint");
    if (!cJSON_IsString(ep) || !ep->valuestring[0]) {
        cJSON_Delete(o);
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "the target-server at '%s' offers no decoding endpoint (no \"decode_endpoint\" in its "
                       "STATUS): it is older than decoding sessions or serves hidden states only; run a "
                       "target-server with decoding%s",
                       server, hint ? hint : "");
    }
    const char *e = ep->valuestring, *colon = strrchr(e, ':');
    const char *host = strstr(server, "://"), *hcolon = strrchr(server, ':');
    if (strncmp(e, "tcp://", 6) == 0 && colon &&
        (strncmp(e + 6, "*:", 2) == 0 || strncmp(e + 6, "0.0.0.0:", 8) == 0) && host && hcolon &&
        hcolon > host + 3)
        snprintf(out, cap, "tcp://%.*s%s", (int)(hcolon - (host + 3)), host + 3, colon);
    else
        snprintf(out, cap, "%s", e);
    cJSON_Delete(o);
    return CM_OK;
}

static cm_status dec_step(void *user, cm_proto_decode *rq, cm_proto_answer *ans) {
    return cm_dec_client_step(user, rq, ans);
}

// ----------------------------------------------------------------------------
// the run

typedef struct eval_run {
    cm_drafter_cfg    cfg;
    cm_target_cfg     tcfg;
    char              drafter[4096], endpoint[1024];
    dt_docs           docs;
    dt_eval_prompt   *prompts;
    int64_t           n_prompts;
    int32_t           eos[DT_EVAL_MAX_EOS];
    int               n_eos;
    const kn_backend *be;
    kn_ctx           *ctx;
    dt_model         *m;
    dt_infer         *inf;
    cm_st            *target;
    float            *owned[2];
    cm_dec_client    *client;
    dt_eval_seq      *spec, *base;
} eval_run;

static cm_status load_drafter(eval_run *r, const eval_args *a) {
    if (a->run) {
        int found = 0;
        CM_TRY(dt_ckpt_latest(a->run, r->drafter, sizeof r->drafter, &found));
        if (!found)
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "'%s' has no checkpoint (no %s/checkpoints/latest); give a run directory that has saved "
                "one, or --checkpoint DIR",
                a->run, a->run);
    } else {
        snprintf(r->drafter, sizeof r->drafter, "%s", a->checkpoint);
    }
    CM_TRY(cm_drafter_cfg_load(&r->cfg, r->drafter));
    const cm_target_cfg *t = &r->tcfg;
    if (t->hidden_size != r->cfg.hidden_size || t->vocab_size != r->cfg.vocab_size)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "target '%s' has hidden %d and vocab %d but the drafter '%s' has hidden %d and vocab %d; use "
            "the target the drafter was trained for",
            a->target, t->hidden_size, t->vocab_size, r->drafter, r->cfg.hidden_size, r->cfg.vocab_size);
    for (int i = 0; i < r->cfg.n_taps; i++)
        if (r->cfg.target_layer_ids[i] >= t->n_layers)
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "the drafter's dflash_config.target_layer_ids[%d] = %d is outside the target's layers [0, "
                "%d) ('%s'); use the target the drafter was trained for",
                i, r->cfg.target_layer_ids[i], t->n_layers, a->target);
    const int lo =
        r->cfg.kind == CM_DRAFTER_DFLASH2 && r->cfg.conv_kernel_size > 2 ? r->cfg.conv_kernel_size : 2;
    if (a->block && (a->block > r->cfg.block_size || a->block < lo))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "--block %d: the drafter '%s' takes blocks of %d to %d (its block_size)", a->block,
                       r->drafter, lo, r->cfg.block_size);
    /* the model on the device, then the drafting state sized for the longest prompt */
    CM_TRY(kn_backend_get(a->device, &r->be));
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.device = a->gpu;
    kc.gemm_mode = a->precision && strcmp(a->precision, "fp32") == 0 ? KN_GEMM_MODE_F32 : KN_GEMM_MODE_BF16;
    CM_TRY(r->be->ctx_create(&r->ctx, &kc));
    CM_TRY(dt_model_create(&r->m, &r->cfg, r->be, r->ctx));
    CM_TRY(dt_model_load(r->m, r->drafter));
    CM_TRY(set_frozen(r->m, a->target, t, &r->target, r->owned));
    int64_t longest = 0;
    for (int64_t i = 0; i < r->n_prompts; i++)
        longest = r->prompts[i].n > longest ? r->prompts[i].n : longest;
    /* room for the longest prompt, max_new tokens and a block; a prefill's rows in passes of 512 */
    const dt_infer_config ic = {.n_slots = a->batch,
                                .max_len = longest + a->max_new + DT_EVAL_MAX_BLOCK + 1,
                                .block = a->block,
                                .chunk_rows = 512};
    CM_TRY(dt_infer_create(&r->inf, r->m, &ic));
    CM_LOG_INFO("drafter '%s' (%s, block %d of %d) on %s: %.2f GB for %d sequences of up to %lld tokens",
                r->drafter, r->cfg.kind == CM_DRAFTER_DFLASH2 ? "DFlash2" : "DFlash", dt_infer_block(r->inf),
                r->cfg.block_size, r->be->name, (double)dt_infer_bytes(r->inf) / 1e9, a->batch,
                (long long)ic.max_len);
    return CM_OK;
}

static cm_status load_prompts(eval_run *r, const eval_args *a) {
    int64_t skipped = 0;
    CM_TRY(dt_docs_read(&r->docs, a->data));
    CM_TRY(dt_eval_prompts(&r->docs, a->prompts, &r->prompts, &r->n_prompts, &skipped));
    if (r->n_prompts == 0)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "'%s' has no prompt in its %lld documents: a prompt is the tokens before a document's first "
            "supervised one (loss_mask 1), and each starts supervised or has none",
            a->data, (long long)r->docs.n_docs);
    for (int64_t i = 0; i < r->n_prompts; i++)
        for (int64_t t = 0; t < r->prompts[i].n; t++)
            if (r->prompts[i].ids[t] >= r->tcfg.vocab_size)
                return CM_FAIL(CM_ERR_INVALID_ARG,
                               "document %lld of '%s' has token %d, outside the target's vocabulary [0, %d); "
                               "tokenize the data with the target's tokenizer",
                               (long long)r->prompts[i].doc, a->data, r->prompts[i].ids[t],
                               r->tcfg.vocab_size);
    CM_LOG_INFO("%lld prompts from '%s' (%lld documents passed over: no prompt before their first supervised "
                "token)",
                (long long)r->n_prompts, a->data, (long long)skipped);
    return CM_OK;
}

static void release_seqs(dt_eval_seq **s, int64_t n) {
    for (int64_t i = 0; *s && i < n; i++)
        dt_eval_seq_release(&(*s)[i]);
    free(*s);
    *s = NULL;
}

/* One pass over the prompts, speculative or target-only; the figures into seqs and sum. */
static cm_status decode_all(eval_run *r, const eval_args *a, int target_only, dt_eval_seq **seqs,
                            dt_eval_summary *sum) {
    dt_eval_target  t = {dec_step, r->client};
    dt_eval_drafter d = {0};
    if (!target_only)
        d = dt_eval_drafter_infer(r->inf);
    dt_eval_opts o = {.max_new = a->max_new,
                      .batch = a->batch,
                      .target_only = target_only,
                      .temperature = (float)a->temperature,
                      .top_p = (float)a->top_p,
                      .top_k = (uint32_t)a->top_k,
                      .seed = a->seed,
                      .flags = a->target_sampling ? CM_DECODE_FLAG_TARGET_SAMPLING : 0,
                      .encoding = a->encoding,
                      .n_taps = r->cfg.n_taps,
                      .layer_ids = r->cfg.target_layer_ids,
                      .hidden = r->tcfg.hidden_size,
                      .eos = r->eos,
                      .n_eos = r->n_eos};
    if (!(*seqs = calloc((size_t)r->n_prompts, sizeof **seqs)))
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the figures of %lld prompts", (long long)r->n_prompts);
    double wall = 0, ds = 0, vs = 0;
    CM_LOG_INFO("%s decoding of %lld prompts, %d at a time", target_only ? "target-only" : "speculative",
                (long long)r->n_prompts, a->batch);
    CM_TRY(dt_eval_run(&t, target_only ? NULL : &d, &o, r->prompts, r->n_prompts, *seqs, &wall, &ds, &vs));
    dt_eval_summarize(*seqs, r->n_prompts, wall, sum);
    sum->draft_s = ds;
    sum->verify_s = vs;
    return CM_OK;
}

/* The server's STATUS against the run: its weights against the drafter's training target and --target
 * (the drafter uses --target's embedding and head), its decoding capacity against --batch and the
 * longest prompt + --max-new. */
static cm_status check_server(eval_run *r, const eval_args *a) {
    dt_eval_server_info si;
    CM_TRY(dt_eval_decode_endpoint(a->server, a->key, a->secret, ", or give --decode-server ENDPOINT", r->endpoint,
                                   sizeof r->endpoint, &si));
    const uint64_t trained = a->target_only ? 0 : dt_ckpt_target_weights(r->drafter);
    if (si.weights_id && trained && trained != si.weights_id)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the drafter '%s' was trained on the hidden states of target weights %016llx, but the "
                       "server at '%s' serves weights %016llx: evaluate a drafter against the target it was "
                       "trained for",
                       r->drafter, (unsigned long long)trained, a->server, (unsigned long long)si.weights_id);
    if (si.weights_id) {
        cm_st             *st = NULL;
        cm_weights_id_info wi;
        CM_TRY(cm_st_open_dir(&st, a->target));
        cm_status s = cm_weights_id_dir(st, a->target, CM_WEIGHTS_ID_READ_CACHE | CM_WEIGHTS_ID_WRITE_CACHE, 0, &wi);
        cm_st_destroy(&st);
        CM_TRY(s);
        if (wi.id != si.weights_id)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "--target '%s' has weights %016llx but the server at '%s' serves %016llx: give the "
                           "served target's directory",
                           a->target, (unsigned long long)wi.id, a->server, (unsigned long long)si.weights_id);
    }
    int64_t longest = 0;
    for (int64_t i = 0; i < r->n_prompts; i++) longest = r->prompts[i].n > longest ? r->prompts[i].n : longest;
    return dt_eval_check_capacity(&si, a->server, a->batch, "--batch", longest, a->max_new, "--max-new");
}

cm_status dt_eval_check_capacity(const dt_eval_server_info *si, const char *server, int batch, const char *batch_flag,
                                 int64_t longest, int64_t max_new, const char *max_new_flag) {
    if (si->decode_seqs && batch > si->decode_seqs)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "%s %d: the target-server at '%s' decodes at most %d sequences at once (serve "
                       "--decode-seqs); use %s %d, or restart the server with more",
                       batch_flag, batch, server, si->decode_seqs, batch_flag, si->decode_seqs);
    if (si->decode_max_len && longest + max_new + 1 > si->decode_max_len)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the longest prompt (%lld tokens) + %s %lld exceeds the %lld tokens per sequence the "
                       "target-server at '%s' decodes (serve --decode-max-len); lower %s or restart the server "
                       "with more",
                       (long long)longest, max_new_flag, (long long)max_new, (long long)si->decode_max_len, server,
                       max_new_flag);
    return CM_OK;
}

static cm_status run_eval(const eval_args *a) {
    cm_status st;
    eval_run  r;
    memset(&r, 0, sizeof r);
    char tc[4096];
    snprintf(tc, sizeof tc, "%s/config.json", a->target);
    CM_TRY_GOTO(cm_target_cfg_load(&r.tcfg, tc), st, fail);
    CM_TRY_GOTO(dt_eval_eos_ids(a->target, r.eos, DT_EVAL_MAX_EOS, &r.n_eos), st, fail);
    if (r.n_eos == 0)
        CM_LOG_WARN("target '%s' names no eos_token_id: every prompt decodes --max-new %lld tokens",
                    a->target, (long long)a->max_new);
    CM_TRY_GOTO(load_prompts(&r, a), st, fail);
    if (!a->target_only)
        CM_TRY_GOTO(load_drafter(&r, a), st, fail);
    if (a->decode_server)
        snprintf(r.endpoint, sizeof r.endpoint, "%s", a->decode_server);
    else
        CM_TRY_GOTO(check_server(&r, a), st, fail);
    cm_dec_client_config cc = {.endpoint = r.endpoint,
                               .curve_server_key = a->key,
                               .curve_secret_key = a->secret,
                               .timeout_ms = a->timeout_ms,
                               .limits = CM_PROTO_LIMITS_DEFAULT};
    CM_TRY_GOTO(cm_dec_client_create(&r.client, &cc), st, fail);
    CM_LOG_INFO("decoding against '%s'", r.endpoint);

    dt_eval_report rep;
    memset(&rep, 0, sizeof rep);
    rep.meta = (dt_eval_meta){.drafter = a->target_only ? NULL : r.drafter,
                              .target = a->target,
                              .data = a->data,
                              .device = a->target_only ? NULL : r.be->name,
                              .endpoint = r.endpoint,
                              .kind = a->target_only                     ? "none"
                                      : r.cfg.kind == CM_DRAFTER_DFLASH2 ? "DFlash2"
                                                                         : "DFlash",
                              .block = a->target_only ? 1 : dt_infer_block(r.inf),
                              .batch = a->batch,
                              .top_k = a->top_k,
                              .target_only = a->target_only,
                              .max_new = a->max_new,
                              .temperature = a->target_sampling ? -1 : a->temperature,
                              .top_p = a->top_p,
                              .seed = a->seed,
                              .trace = a->trace};
    CM_TRY_GOTO(decode_all(&r, a, a->target_only, &r.spec, &rep.all), st, fail);
    rep.seqs = r.spec;
    rep.n = r.n_prompts;
    if (a->compare) {
        CM_TRY_GOTO(decode_all(&r, a, 1, &r.base, &rep.base_all), st, fail);
        rep.compare = 1;
        rep.base = r.base;
    }
    dt_eval_print(stdout, &rep);
    if (a->json) {
        char *text = NULL;
        CM_TRY_GOTO(dt_eval_json(&rep, &text), st, fail);
        st = dt_eval_write_file(a->json, text);
        free(text);
        if (st != CM_OK)
            goto fail;
        CM_LOG_INFO("wrote '%s'", a->json);
    }
fail:
    release_seqs(&r.spec, r.n_prompts);
    release_seqs(&r.base, r.n_prompts);
    cm_dec_client_destroy(&r.client);
    dt_infer_destroy(&r.inf);
    dt_model_destroy(&r.m);
    if (r.be)
        r.be->ctx_destroy(&r.ctx);
    cm_st_destroy(&r.target);
    free(r.owned[0]);
    free(r.owned[1]);
    free(r.prompts);
    dt_docs_release(&r.docs);
    return st;
}

// ----------------------------------------------------------------------------
// flags

static const char *const devices[] = {"cpu", "cuda", NULL};
static const char *const precisions[] = {"bf16", "fp32", NULL};
static const char *const encodings[] = {"raw", "zstd", "zstd-byteplane", NULL};

/* 0 ok; else a usage message was printed. */
static int check_args(const eval_args *a) {
    if (!a->target || !a->data || (!a->server && !a->decode_server)) {
        fprintf(stderr,
                CMD ": --target, --data and --server (or --decode-server) are required (see --help)\n");
        return 1;
    }
    if (a->server && a->decode_server) {
        fprintf(stderr, CMD
                ": give --server (its STATUS names the decoding endpoint) or --decode-server, not both\n");
        return 1;
    }
    if (a->target_only && a->compare) {
        fprintf(stderr, CMD ": --compare-target-only already runs the target alone; drop --target-only\n");
        return 1;
    }
    if (!a->target_only && !a->checkpoint == !a->run) {
        fprintf(stderr, a->run ? CMD ": give --checkpoint or --run, not both\n"
                               : CMD
                            ": a drafter is required: --checkpoint DIR or --run RUN_DIR (or --target-only "
                            "for the target alone)\n");
        return 1;
    }
    if (a->target_sampling && (a->temperature > 0 || a->top_k || a->top_p != 1.0)) {
        fprintf(stderr,
                CMD ": --target-sampling takes the target's generation_config.json; drop --temperature, "
                    "--top-p and --top-k\n");
        return 1;
    }
    if ((a->top_k || a->top_p != 1.0) && !(a->temperature > 0)) {
        fprintf(stderr,
                CMD ": --top-p and --top-k cut a sampled distribution; give --temperature T > 0 too\n");
        return 1;
    }
    return 0;
}

int dt_cmd_eval(int argc, char **argv) {
    eval_args a = {.max_new = 256,
                   .batch = 1,
                   .timeout_ms = 300000,
                   .top_p = 1.0,
                   .device = "cpu",
                   .encoding = CM_ENCODING_RAW};
    cm_args   p;
    cm_args_init(&p, CMD, argc, argv);
    while (cm_args_next(&p)) {
        int k = 0;
        if (cm_args_help(&p)) {
            usage(stdout);
            return 0;
        } else if (cm_args_str(&p, "--checkpoint", &a.checkpoint) || cm_args_str(&p, "--run", &a.run) ||
                   cm_args_str(&p, "--target", &a.target) || cm_args_str(&p, "--server", &a.server) ||
                   cm_args_str(&p, "--decode-server", &a.decode_server) ||
                   cm_args_str(&p, "--data", &a.data) || cm_args_str(&p, "--json", &a.json) ||
                   cm_args_str(&p, "--curve-server-key", &a.key) ||
                   cm_args_str(&p, "--curve-secret-key", &a.secret) ||
                   cm_args_i64(&p, "--prompts", 1, INT32_MAX, &a.prompts) ||
                   cm_args_i64(&p, "--max-new", 1, 1 << 24, &a.max_new) ||
                   cm_args_int(&p, "--block", 2, DT_EVAL_MAX_BLOCK, &a.block) ||
                   cm_args_int(&p, "--batch", 1, 4096, &a.batch) ||
                   cm_args_int(&p, "--gpu", 0, 1024, &a.gpu) ||
                   cm_args_int(&p, "--timeout-ms", 1, INT32_MAX, &a.timeout_ms) ||
                   cm_args_f64(&p, "--temperature", 0, 1e6, &a.temperature) ||
                   cm_args_f64(&p, "--top-p", 1e-9, 1, &a.top_p) ||
                   cm_args_int(&p, "--top-k", 0, INT32_MAX, &a.top_k) || cm_args_u64(&p, "--seed", &a.seed)) {
        } else if (cm_args_flag(&p, "--target-only")) {
            a.target_only = 1;
        } else if (cm_args_flag(&p, "--compare-target-only")) {
            a.compare = 1;
        } else if (cm_args_flag(&p, "--trace")) {
            a.trace = 1;
        } else if (cm_args_flag(&p, "--target-sampling")) {
            a.target_sampling = 1;
        } else if (cm_args_choice(&p, "--device", devices, &k)) {
            a.device = devices[k];
        } else if (cm_args_choice(&p, "--precision", precisions, &k)) {
            a.precision = precisions[k];
        } else if (cm_args_choice(&p, "--encoding", encodings, &k)) {
            a.encoding = (cm_encoding)k; /* raw, zstd, zstd-byteplane: the cm_encoding order */
        } else if (!cm_args_log_level(&p)) {
            cm_args_unknown(&p);
        }
    }
    if (p.bad)
        return 2;
    if (check_args(&a) != 0)
        return 2;
    cm_status st = run_eval(&a);
    if (st != CM_OK) {
        fprintf(stderr, CMD ": %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
