/* drafter-trainer/cmd/dt_train_eval.c — evaluation by speculative decoding during training
 * (dt_train_eval.h): the evaluator made once (prompts, EOS ids, decoding client, a dt_infer over the
 * training model), one evaluation through dt_eval_run, and its figures as a metrics.jsonl record,
 * TensorBoard scalars and a progress line. A failure of the target skips that evaluation (warned) and
 * the next one reconnects; a failure of the drafter is the trainer's own and is returned. */
#include "dt_train_eval.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cm_dec.h"
#include "cm_log.h"
#include "dt_infer.h"

struct dt_train_eval {
    dt_train_eval_config cfg; /* strings borrowed */
    const dt_model      *m;
    dt_docs              docs;
    dt_eval_prompt      *prompts; /* [n], borrowing docs */
    int64_t              n;
    int32_t              eos[DT_EVAL_MAX_EOS];
    int                  n_eos;
    int                  batch;
    dt_infer            *inf;
    char                 endpoint[1024];
    cm_dec_client       *client;     /* NULL with cfg.verifier, and after a failed evaluation */
    cm_status            drafter_st; /* the drafter's last call: tells its failures from the target's */
    dt_eval_seq         *spec, *base; /* [n]: this evaluation's, and the target alone (have_base) */
    int                  have_base;
    double               base_tokens_per_s;
};

// ----------------------------------------------------------------------------
// the verifier and the drafter, as dt_eval_run calls them

static cm_status target_step(void *user, cm_proto_decode *rq, cm_proto_answer *ans) {
    dt_train_eval *ev = user;
    if (ev->cfg.verifier)
        return ev->cfg.verifier->step(ev->cfg.verifier->user, rq, ans);
    return cm_dec_client_step(ev->client, rq, ans);
}

static cm_status drafter_append(void *user, const dt_infer_rows *rows) {
    dt_train_eval *ev = user;
    return ev->drafter_st = dt_infer_append(ev->inf, rows);
}

static cm_status drafter_draft(void *user, int block, int n, const int32_t *slots, const int32_t *anchor,
                               int32_t *drafts) {
    dt_train_eval *ev = user;
    return ev->drafter_st = dt_infer_draft_block(ev->inf, block, n, slots, anchor, drafts, NULL);
}

static void drafter_reset(void *user, int slot) {
    dt_train_eval *ev = user;
    dt_infer_reset(ev->inf, slot);
}

static cm_status dec_connect(dt_train_eval *ev) {
    if (ev->cfg.verifier || ev->client)
        return CM_OK;
    const cm_dec_client_config cc = {.endpoint = ev->endpoint,
                                     .curve_server_key = ev->cfg.curve_server_key,
                                     .curve_secret_key = ev->cfg.curve_secret_key,
                                     .timeout_ms = ev->cfg.timeout_ms,
                                     .limits = CM_PROTO_LIMITS_DEFAULT};
    return cm_dec_client_create(&ev->client, &cc);
}

// ----------------------------------------------------------------------------
// lifecycle

static cm_status load_prompts(dt_train_eval *ev) {
    const dt_train_eval_config *c = &ev->cfg;
    const int64_t               V = dt_model_cfg(ev->m)->vocab_size;
    int64_t                     skipped = 0;
    CM_TRY(dt_docs_read(&ev->docs, c->data));
    CM_TRY(dt_eval_prompts(&ev->docs, c->prompts, &ev->prompts, &ev->n, &skipped));
    if (ev->n == 0)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "--eval-data '%s' has no prompt in its %lld documents: a prompt is the tokens before a "
                       "document's first supervised one (loss_mask 1), and each starts supervised or has none",
                       c->data, (long long)ev->docs.n_docs);
    for (int64_t i = 0; i < ev->n; i++)
        for (int64_t t = 0; t < ev->prompts[i].n; t++)
            if (ev->prompts[i].ids[t] < 0 || ev->prompts[i].ids[t] >= V)
                return CM_FAIL(CM_ERR_INVALID_ARG,
                               "document %lld of --eval-data '%s' has token %d, outside the target's vocabulary "
                               "[0, %lld); tokenize it with the target's tokenizer",
                               (long long)ev->prompts[i].doc, c->data, ev->prompts[i].ids[t], (long long)V);
    if (skipped)
        CM_LOG_DEBUG("--eval-data '%s': %lld documents passed over (no prompt before their first supervised "
                     "token)",
                     c->data, (long long)skipped);
    return CM_OK;
}

/* The decoding endpoint from the server's STATUS, and what it lists checked against this run: the
 * weights it serves, the sequences it decodes at once and their length. */
static cm_status check_server(dt_train_eval *ev, int64_t longest) {
    const dt_train_eval_config *c = &ev->cfg;
    dt_eval_server_info         si;
    CM_TRY(dt_eval_decode_endpoint(c->server, c->curve_server_key, c->curve_secret_key, c->hint, ev->endpoint,
                                   sizeof ev->endpoint, &si));
    if (si.weights_id && c->weights_id && si.weights_id != c->weights_id)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the target-server at '%s' serves weights %016llx but this run trains on target weights "
                       "%016llx: evaluate on a server of the run's target",
                       c->server, (unsigned long long)si.weights_id, (unsigned long long)c->weights_id);
    return dt_eval_check_capacity(&si, c->server, ev->batch, "--eval-batch", longest, c->max_new, "--eval-max-new");
}

cm_status dt_train_eval_create(dt_train_eval **out, const dt_train_eval_config *cfg, const dt_model *m) {
    if (!out || !cfg || !m || !cfg->data || cfg->max_new < 1 || cfg->batch < 1 || (!cfg->server && !cfg->verifier))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "dt_train_eval_create: data, a server or a verifier, max_new and batch of at least 1");
    *out = NULL;
    cm_status      st;
    dt_train_eval *ev = calloc(1, sizeof *ev);
    if (!ev)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the evaluator");
    ev->cfg = *cfg;
    ev->m = m;
    CM_TRY_GOTO(load_prompts(ev), st, fail);
    if (cfg->target)
        CM_TRY_GOTO(dt_eval_eos_ids(cfg->target, ev->eos, DT_EVAL_MAX_EOS, &ev->n_eos), st, fail);
    int64_t longest = 1;
    for (int64_t i = 0; i < ev->n; i++)
        longest = ev->prompts[i].n > longest ? ev->prompts[i].n : longest;
    ev->batch = (int)(cfg->batch < ev->n ? cfg->batch : ev->n);
    /* room for the longest prompt, max_new tokens and a block; a prefill's rows in passes of 512 */
    const dt_infer_config ic = {
        .n_slots = ev->batch, .max_len = longest + cfg->max_new + DT_EVAL_MAX_BLOCK + 1, .block = 0, .chunk_rows = 512};
    CM_TRY_GOTO(dt_infer_create(&ev->inf, m, &ic), st, fail);
    ev->spec = calloc((size_t)ev->n, sizeof *ev->spec);
    ev->base = calloc((size_t)ev->n, sizeof *ev->base);
    if (!ev->spec || !ev->base) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the figures of %lld prompts", (long long)ev->n);
        goto fail;
    }
    if (!cfg->verifier) {
        CM_TRY_GOTO(check_server(ev, longest), st, fail);
        CM_TRY_GOTO(dec_connect(ev), st, fail);
    }
    CM_LOG_INFO("evaluation: %lld prompts of '%s', up to %lld new tokens each, %d at a time, block %d, against "
                "'%s'; %.1f MB for the drafting state%s",
                (long long)ev->n, cfg->data, (long long)cfg->max_new, ev->batch, dt_infer_block(ev->inf),
                cfg->verifier ? "(in process)" : ev->endpoint, (double)dt_infer_bytes(ev->inf) / 1e6,
                ev->n_eos ? "" : "; the target names no EOS token: every prompt decodes max-new tokens");
    *out = ev;
    return CM_OK;
fail:
    dt_train_eval_destroy(&ev);
    return st;
}

static void release_seqs(dt_eval_seq *s, int64_t n) {
    for (int64_t i = 0; s && i < n; i++)
        dt_eval_seq_release(&s[i]);
}

void dt_train_eval_destroy(dt_train_eval **evp) {
    if (!evp || !*evp)
        return;
    dt_train_eval *ev = *evp;
    release_seqs(ev->spec, ev->n);
    release_seqs(ev->base, ev->n);
    free(ev->spec);
    free(ev->base);
    cm_dec_client_destroy(&ev->client);
    dt_infer_destroy(&ev->inf);
    free(ev->prompts);
    dt_docs_release(&ev->docs);
    free(ev);
    *evp = NULL;
}

size_t dt_train_eval_bytes(const dt_train_eval *ev) {
    return dt_infer_bytes(ev->inf);
}

int64_t dt_train_eval_n_prompts(const dt_train_eval *ev) {
    return ev->n;
}

// ----------------------------------------------------------------------------
// one evaluation

/* After a failed run: the drafter's failure is returned; the target's is warned about, and the client
 * goes (its sequences on the server are stale; the next evaluation connects anew). */
static cm_status target_failed(dt_train_eval *ev, cm_status st, int64_t step, const char *what) {
    if (ev->drafter_st != CM_OK)
        return st;
    CM_LOG_WARN("evaluation at step %" PRId64 ": %s failed, %s: %s", step, what, cm_status_str(st),
                cm_last_error());
    cm_clear_error();
    cm_dec_client_destroy(&ev->client);
    return CM_OK;
}

static dt_eval_opts eval_opts(const dt_train_eval *ev, int target_only) {
    const cm_drafter_cfg *g = dt_model_cfg(ev->m);
    return (dt_eval_opts){.max_new = ev->cfg.max_new,
                          .batch = ev->batch,
                          .target_only = target_only,
                          .temperature = 0,
                          .top_p = 1,
                          .encoding = CM_ENCODING_RAW,
                          .n_taps = g->n_taps,
                          .layer_ids = g->target_layer_ids,
                          .hidden = g->hidden_size,
                          .eos = ev->eos,
                          .n_eos = ev->n_eos,
                          .quiet = 1};
}

cm_status dt_train_eval_run(dt_train_eval *ev, int64_t step, dt_train_eval_result *res) {
    memset(res, 0, sizeof *res);
    res->step = step;
    res->block = dt_infer_block(ev->inf);
    CM_TRY(dt_infer_refresh(ev->inf)); /* the bf16 copies (where kept) of the weights just trained */
    ev->drafter_st = CM_OK;
    cm_status st = dec_connect(ev);
    if (st != CM_OK)
        return target_failed(ev, st, step, "connecting to the decoding endpoint");
    const dt_eval_target  t = {target_step, ev};
    const dt_eval_drafter d = {.n_slots = dt_infer_n_slots(ev->inf),
                               .block = res->block,
                               .append = drafter_append,
                               .draft = drafter_draft,
                               .reset = drafter_reset,
                               .user = ev};
    dt_eval_opts          o = eval_opts(ev, 0);
    double                wall = 0, ds = 0, vs = 0;
    release_seqs(ev->spec, ev->n);
    st = dt_eval_run(&t, &d, &o, ev->prompts, ev->n, ev->spec, &wall, &ds, &vs);
    if (st != CM_OK)
        return target_failed(ev, st, step, "speculative decoding");
    dt_eval_summarize(ev->spec, ev->n, wall, &res->all);
    res->all.draft_s = ds;
    res->all.verify_s = vs;
    res->done = 1;
    if (!ev->have_base) { /* once: the target alone, its speed and its tokens */
        o = eval_opts(ev, 1);
        release_seqs(ev->base, ev->n);
        st = dt_eval_run(&t, NULL, &o, ev->prompts, ev->n, ev->base, &wall, NULL, NULL);
        if (st != CM_OK)
            return target_failed(ev, st, step, "target-only decoding (the baseline; tried again next time)");
        dt_eval_summary b;
        dt_eval_summarize(ev->base, ev->n, wall, &b);
        ev->base_tokens_per_s = b.tokens_per_s;
        ev->have_base = 1;
    }
    res->have_base = 1;
    res->base_tokens_per_s = ev->base_tokens_per_s;
    for (int64_t i = 0; i < ev->n; i++)
        res->identical += dt_eval_first_diff(&ev->spec[i], &ev->base[i]) < 0;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// the figures out

static double accept_rate(const dt_eval_summary *a) { /* accepted drafts / drafts sent */
    int64_t acc = 0;
    for (int k = 1; k < DT_EVAL_MAX_BLOCK; k++)
        acc += k * a->hist[k];
    return a->drafted ? (double)acc / (double)a->drafted : 0.0;
}

static double slot_share(const dt_eval_summary *a, int k) {
    return a->steps ? (double)a->slot_acc[k] / (double)a->steps : 0.0;
}

static void write_json(FILE *f, const dt_train_eval_result *r) {
    const dt_eval_summary *a = &r->all;
    fprintf(f, "{\"step\": %" PRId64 ", \"eval_tau\": %.17g, \"eval_accept_hist\": [", r->step, a->tau);
    for (int k = 0; k < r->block; k++)
        fprintf(f, "%s%" PRId64, k ? ", " : "", a->hist[k]);
    fprintf(f, "], \"eval_accept_by_slot\": [");
    for (int k = 1; k < r->block; k++)
        fprintf(f, "%s%.9g", k > 1 ? ", " : "", slot_share(a, k));
    fprintf(f,
            "], \"eval_accept_rate\": %.9g, \"eval_prompts\": %" PRId64 ", \"eval_generated\": %" PRId64
            ", \"eval_steps\": %" PRId64 ", \"eval_drafted\": %" PRId64 ", \"eval_eos\": %" PRId64
            ", \"eval_wall_s\": %.6f, \"eval_tokens_per_s\": %.3f, \"eval_drafter_s\": %.6f, \"eval_target_s\": %.6f",
            accept_rate(a), a->n_prompts, a->generated, a->steps, a->drafted, a->n_eos, a->wall_s, a->tokens_per_s,
            a->draft_s, a->verify_s);
    if (r->have_base)
        fprintf(f, ", \"eval_target_only_tokens_per_s\": %.3f, \"eval_speedup\": %.6g, \"eval_identical\": %" PRId64,
                r->base_tokens_per_s, r->base_tokens_per_s > 0 ? a->tokens_per_s / r->base_tokens_per_s : 0.0,
                r->identical);
    fprintf(f, "}\n");
}

static cm_status write_tb(cm_tb *tb, const dt_train_eval_result *r) {
    const dt_eval_summary *a = &r->all;
    char                   names[DT_EVAL_MAX_BLOCK][32];
    const char            *tags[DT_EVAL_MAX_BLOCK + 8];
    double                 vals[DT_EVAL_MAX_BLOCK + 8];
    int                    n = 0;
    tags[n] = "eval/tau", vals[n++] = a->tau;
    tags[n] = "eval/accept_rate", vals[n++] = accept_rate(a);
    tags[n] = "eval/tokens_per_s", vals[n++] = a->tokens_per_s;
    if (r->have_base) {
        tags[n] = "eval/target_only_tokens_per_s", vals[n++] = r->base_tokens_per_s;
        tags[n] = "eval/speedup", vals[n++] = r->base_tokens_per_s > 0 ? a->tokens_per_s / r->base_tokens_per_s : 0.0;
        tags[n] = "eval/identical", vals[n++] = a->n_prompts ? (double)r->identical / (double)a->n_prompts : 0.0;
    }
    for (int k = 1; k < r->block && n < CM_TB_MAX_VALUES; k++) {
        snprintf(names[k], sizeof names[k], "eval/accept_slot_%d", k);
        tags[n] = names[k], vals[n++] = slot_share(a, k);
    }
    return cm_tb_scalars(tb, 0, r->step, n, tags, vals);
}

size_t dt_train_eval_format(char *buf, size_t cap, const dt_train_eval_result *r) {
    const dt_eval_summary *a = &r->all;
    size_t                 n = 0;
#define PUT(...)                                                                                                \
    do {                                                                                                        \
        int w_ = snprintf(buf + n, n < cap ? cap - n : 0, __VA_ARGS__);                                         \
        n += w_ > 0 ? (size_t)w_ : 0;                                                                           \
    } while (0)
    PUT("eval step %" PRId64 ": tau %.3f | accepted by slot", r->step, a->tau);
    for (int k = 1; k < r->block && k <= 8; k++)
        PUT(" %.2f", slot_share(a, k));
    if (r->block > 9)
        PUT(" ...");
    PUT(" | %" PRId64 " prompts, %" PRId64 " tokens in %" PRId64 " steps | %.1f tok/s", a->n_prompts, a->generated,
        a->steps, a->tokens_per_s);
    if (r->have_base)
        PUT(", target alone %.1f (x%.2f) | identical %" PRId64 "/%" PRId64, r->base_tokens_per_s,
            r->base_tokens_per_s > 0 ? a->tokens_per_s / r->base_tokens_per_s : 0.0, r->identical, a->n_prompts);
    PUT(" | %.1f s", a->wall_s);
#undef PUT
    if (cap)
        buf[n < cap ? n : cap - 1] = '\0';
    return n < cap ? n : cap ? cap - 1 : 0;
}

cm_status dt_train_eval_report(const dt_train_eval_result *r, FILE *metrics, const char *path, cm_tb *tb,
                               FILE *out) {
    if (!r->done)
        return CM_OK;
    write_json(metrics, r);
    if (fflush(metrics) != 0 || ferror(metrics))
        return CM_FAIL(CM_ERR_IO, "cannot append to '%s': %s", path, strerror(errno));
    if (tb)
        CM_TRY(write_tb(tb, r));
    if (out) {
        char line[1024];
        dt_train_eval_format(line, sizeof line, r);
        fprintf(out, "%s\n", line);
        fflush(out);
    }
    return CM_OK;
}
