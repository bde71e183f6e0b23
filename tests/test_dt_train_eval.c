/* tests/test_dt_train_eval.c — `train --eval-every`: evaluation by speculative decoding during training
 * (drafter-trainer/cmd/dt_train_eval.h).
 *
 * In process (always): a tiny DFlash drafter trains on the cpu on documents whose answers follow a fixed
 * chain (next = 5·t + 3 mod V) with token-dependent taps, while an in-process verifier that follows the
 * DECODE contract (the same chain as its greedy target, the same taps for the committed rows) serves
 * the evaluations: every EVERY steps an evaluator made once over the training model decodes 6 prompts.
 * The evaluated τ must rise from the first evaluation to the last; every evaluation is lossless (the
 * tokens equal the target-only run's); the model's parameters are the same bytes before and after an
 * evaluation; the losses and final parameters of the run are bit-identical to a run without
 * evaluations; the evaluator's memory does not grow; a fresh evaluator over the trained model finds the
 * same figures as the long-lived one (it drafts with the current weights, not those of its creation); a
 * verifier that fails skips that evaluation (done = 0) and the next one succeeds; the metrics.jsonl
 * record and the progress line hold what dt_train_eval.h says.
 *
 * Through the real binary: --eval-every without --eval-data, and without any server (--shards), are
 * refused with one message naming the flag.
 *
 * End to end (skipped when target-server or drafter-trainer is not built): a real `target-server serve`
 * of models/tandem-tiny; `drafter-trainer train` of models/tandem-tiny-drafter.json live on
 * data/tiny/train.jsonl (2 epochs of 512-token packs: 72 steps) with --eval-every 30 on 8 prompts of
 * data/tiny/valid.jsonl, 24 new tokens each: eval records at steps 30, 60 and 72 (the end), τ rising
 * from the first to the last, every prompt lossless, the TensorBoard scalars, and the step records
 * (losses, τ) and the final checkpoint's files byte-identical to the same run without --eval-every;
 * then `precompute` of the same packs
 * and 24 steps from the shards with --eval-server (evaluations at 12 and 24): the live runs' first 24
 * step records. About 50 s on 2 cores (under the sanitizers, shorter runs: see TST_SANITIZED).
 * Set DT_TRAIN_EVAL_KEEP=1 to keep the work dir. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_log.h"
#include "cm_time.h"
#include "dt_optim.h"
#include "dt_train_eval.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_proto.h"
#include "tst_serve.h"

/* Under the sanitizers the cpu kernels run many times slower: the runs are shorter (in process 60 steps,
 * end to end 12), and the τ trend, the loss's fall and the shards leg are left to the plain build. */
#if defined(__SANITIZE_ADDRESS__)
#define TST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TST_SANITIZED 1
#endif
#endif

#define V       64 /* the chain's vocabulary */
#define D       32
#define B       4
#define N_TAPS  2
#define P_LEN   3  /* prompt tokens of a document */
#define A_LEN   20 /* answer tokens */
#define N_DOCS  4  /* documents per batch */
#define N_BATCH 6
#ifdef TST_SANITIZED
#define STEPS     60
#define EVERY     20
#define E2E_EVERY "6"
#define E2E_STEPS 12
#else
#define STEPS     180
#define EVERY     45
#define E2E_EVERY "30" /* 2 epochs of 36 packs: evaluations at steps 30, 60 and 72 (the end) */
#define E2E_STEPS 72
#endif
#define N_EVAL  (STEPS / EVERY)
#define N_PR    6
#define MAXNEW  16

static char          tmp[64];
static const int32_t layers[N_TAPS] = {1, 3};

static int32_t chain(int32_t t) { /* the target's greedy next token */
    return (t * 5 + 3) % V;
}

static float tap(int32_t tok, int k, int c) { /* the target's hidden state of a committed token */
    return 0.5f * cosf(0.37f * (float)(tok * (c + 1)) + (float)k);
}

static uint64_t rs = 0x2545f4914f6cdd1dull;
static int32_t  rtok(void) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (int32_t)(rs % (V - 1)); /* never the mask token */
}

// ----------------------------------------------------------------------------
// an in-process verifier: the chain as the greedy target, the DECODE contract of cm_dec.h

typedef struct vseq {
    int      open;
    uint32_t committed;
    int32_t  last;
} vseq;

typedef struct verifier {
    vseq            seqs[256];
    int             n_handles, errors, calls, fail_at; /* fail_at: that call fails (0: none) */
    cm_proto_tensor t[4];
    int32_t         decode[64 * 4];
    float          *rows; /* [N_TAPS][4096][D] */
} verifier;

static cm_status v_step(void *u, cm_proto_decode *rq, cm_proto_answer *ans) {
    verifier *f = u;
    if (++f->calls == f->fail_at)
        return CM_FAIL(CM_ERR_PEER_GONE, "the test's verifier is gone for this call");
    const int32_t *tok = rq->tokens;
    int64_t        rows = 0;
    for (uint32_t i = 0; i < rq->n_seqs; i++) {
        cm_proto_decode_seq *r = &rq->seqs[i];
        int32_t             *d = f->decode + 4 * i;
        if (rq->op == CM_DECODE_CLOSE) {
            f->errors += !(r->handle >= 1 && (int)r->handle <= f->n_handles && f->seqs[r->handle - 1].open);
            if (r->handle >= 1 && (int)r->handle <= f->n_handles)
                f->seqs[r->handle - 1].open = 0;
            d[0] = (int32_t)r->handle, d[1] = d[2] = 0, d[3] = -1;
            continue;
        }
        uint32_t h = r->handle;
        if (h == 0) {
            if (f->n_handles == 256)
                return CM_FAIL(CM_ERR_INVALID_ARG, "too many sequences");
            f->seqs[f->n_handles++] = (vseq){.open = 1};
            h = (uint32_t)f->n_handles;
        }
        if (h > (uint32_t)f->n_handles)
            return CM_FAIL(CM_ERR_INVALID_ARG, "unknown handle %u", h);
        vseq *s = &f->seqs[h - 1];
        f->errors += !s->open || r->base != s->committed || r->n_ctx < 1 || r->temperature != 0;
        s->last = tok[r->n_ctx - 1];
        int a = 0;
        while (a < (int)r->n_draft && tok[r->n_ctx + a] == chain(s->last))
            s->last = tok[r->n_ctx + a++];
        const int64_t n_rows = r->n_ctx + a;
        for (int64_t j = 0; j < n_rows; j++)
            for (int k = 0; k < N_TAPS; k++)
                for (int c = 0; c < D; c++)
                    f->rows[((int64_t)k * 4096 + rows + j) * D + c] = tap(tok[j], k, c);
        rows += n_rows;
        s->committed += (uint32_t)n_rows;
        d[0] = (int32_t)h, d[1] = (int32_t)s->committed, d[2] = a, d[3] = chain(s->last);
        tok += r->n_ctx + r->n_draft;
    }
    tst_put_tensor(&f->t[0], "decode", CM_DTYPE_I32, rq->n_seqs, 4, f->decode);
    ans->n_tensors = 1;
    for (uint32_t k = 0; rq->op == CM_DECODE_STEP && k < rq->n_layers && k < N_TAPS; k++) {
        char name[32];
        snprintf(name, sizeof name, "layer_%d", rq->layer_ids[k]);
        f->errors += rq->layer_ids[k] != layers[k];
        tst_put_tensor(&f->t[ans->n_tensors++], name, CM_DTYPE_F32, rows, D, f->rows + (int64_t)k * 4096 * D);
    }
    memcpy(ans->tensors, f->t, ans->n_tensors * sizeof *f->t);
    return CM_OK;
}

// ----------------------------------------------------------------------------
// a tiny drafter trained in process

typedef struct batch_data {
    int32_t ids[N_DOCS * (P_LEN + A_LEN)], mask[N_DOCS * (P_LEN + A_LEN)], cu[N_DOCS + 1];
    int32_t anchors[N_DOCS * (P_LEN + A_LEN)];
    float   hidden[N_DOCS * (P_LEN + A_LEN) * N_TAPS * D];
    dt_batch b;
} batch_data;

static batch_data batches[N_BATCH];
static float      table[V * D]; /* the frozen embedding and LM head */

static void make_batches(void) {
    for (int bi = 0; bi < N_BATCH; bi++) {
        batch_data *x = &batches[bi];
        int         T = 0, na = 0;
        for (int d = 0; d < N_DOCS; d++) {
            x->cu[d] = T;
            for (int t = 0; t < P_LEN + A_LEN; t++, T++) {
                x->ids[T] = t < P_LEN ? rtok() : chain(x->ids[T - 1]);
                x->mask[T] = t >= P_LEN;
                for (int k = 0; k < N_TAPS; k++)
                    for (int c = 0; c < D; c++)
                        x->hidden[((int64_t)T * N_TAPS + k) * D + c] = tap(x->ids[T], k, c);
                if (t >= P_LEN && t + 1 < P_LEN + A_LEN) /* p and p + 1 supervised */
                    x->anchors[na++] = T;
            }
        }
        x->cu[N_DOCS] = T;
        x->b = (dt_batch){.T = T,
                          .n_seq = N_DOCS,
                          .cu_seqlens = x->cu,
                          .input_ids = x->ids,
                          .loss_mask = x->mask,
                          .target_hidden = x->hidden,
                          .n_anchors = na,
                          .anchors = x->anchors};
    }
    for (int i = 0; i < V * D; i++) {
        rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
        table[i] = (float)((double)(rs >> 11) / 9007199254740992.0 - 0.5);
    }
}

static cm_drafter_cfg tiny_cfg(void) {
    cm_drafter_cfg c;
    memset(&c, 0, sizeof c);
    c.kind = CM_DRAFTER_DFLASH;
    c.hidden_size = D;
    c.n_layers = 1;
    c.intermediate_size = 64;
    c.vocab_size = V;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 16;
    c.rms_norm_eps = 1e-6f;
    c.rope_theta = 1e4;
    c.max_position_embeddings = 4096;
    c.block_size = B;
    c.mask_token_id = V - 1;
    c.num_target_layers = 4;
    c.n_taps = N_TAPS;
    c.target_layer_ids[0] = layers[0];
    c.target_layer_ids[1] = layers[1];
    c.layer_types[0] = CM_LAYER_TYPE_FULL_ATTENTION;
    return c;
}

typedef struct trained {
    double               loss[STEPS];
    dt_train_eval_result ev[N_EVAL + 1];
    int                  n_ev;
    float               *params; /* every parameter at the end, in order */
    size_t               n_params;
} trained;

static int same_params(const dt_model *m, const float *snap) {
    size_t off = 0;
    int    same = 1;
    for (int i = 0; i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        same &= memcmp(p->data, snap + off, (size_t)p->numel * sizeof(float)) == 0;
        off += (size_t)p->numel;
    }
    return same;
}

static size_t snapshot(const dt_model *m, float **out) {
    size_t n = 0, off = 0;
    for (int i = 0; i < dt_model_n_params(m); i++)
        n += (size_t)dt_model_param(m, i)->numel;
    *out = realloc(*out, n * sizeof(float));
    for (int i = 0; i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        memcpy(*out + off, p->data, (size_t)p->numel * sizeof(float));
        off += (size_t)p->numel;
    }
    return n;
}

/* Trains STEPS steps; with evaluate, an evaluation every EVERY steps through v (and the checks that
 * need the live evaluator). */
static void train_run(int evaluate, verifier *v, trained *out, const char *prompts_file) {
    const kn_backend *be = kn_backend_cpu();
    const cm_drafter_cfg c = tiny_cfg();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    dt_optim         *o = NULL;
    dt_train_eval    *ev = NULL;
    const dt_param  **params = NULL;
    float            *snap = NULL;
    memset(out->loss, 0, sizeof out->loss);
    out->n_ev = 0;
    if (!tst_ok(be->ctx_create(&ctx, NULL), "ctx") || !tst_ok(dt_model_create(&m, &c, be, ctx), "model") ||
        !tst_ok(dt_model_init_random(m, 7), "init") ||
        !tst_ok(dt_model_set_frozen(m, table, CM_DTYPE_F32, table, CM_DTYPE_F32, V, D), "frozen") ||
        !tst_ok(dt_model_reserve(m, N_DOCS * (P_LEN + A_LEN), N_DOCS * (P_LEN + A_LEN)), "reserve"))
        goto done;
    const int np = dt_model_n_params(m);
    params = malloc((size_t)np * sizeof *params);
    for (int i = 0; i < np; i++)
        params[i] = dt_model_param(m, i);
    const dt_optim_config oc = {1e-2, 0.9, 0.999, 1e-8, 0, 1.0, STEPS, 3};
    if (!tst_ok(dt_optim_create(&o, be, ctx, params, np, &oc), "optim"))
        goto done;
    const dt_eval_target       vt = {v_step, v};
    const dt_train_eval_config ec = {
        .data = prompts_file, .prompts = N_PR, .max_new = MAXNEW, .batch = 4, .verifier = &vt};
    if (evaluate && !tst_ok(dt_train_eval_create(&ev, &ec, m), "dt_train_eval_create"))
        goto done;
    const size_t bytes = ev ? dt_train_eval_bytes(ev) : 0;
    for (int t = 0; t < STEPS; t++) {
        dt_step_stats  ss;
        dt_optim_stats os;
        if (!tst_ok(dt_model_step(m, &batches[t % N_BATCH].b, 4.0f, &ss), "step") ||
            !tst_ok(dt_optim_step(o, &os), "optim step"))
            goto done;
        out->loss[t] = ss.loss;
        if (ev && (t + 1) % EVERY == 0) {
            snapshot(m, &snap);
            dt_train_eval_result *r = &out->ev[out->n_ev];
            TST_CHECK(tst_ok(dt_train_eval_run(ev, t + 1, r), "evaluation") && r->done);
            TST_CHECK(same_params(m, snap)); /* the evaluation wrote nothing of the model's */
            TST_CHECK(dt_train_eval_bytes(ev) == bytes);
            TST_CHECK(r->have_base && r->identical == N_PR && r->all.n_prompts == N_PR &&
                      r->all.generated == N_PR * MAXNEW && v->errors == 0);
            out->n_ev++;
        }
    }
    out->n_params = snapshot(m, &out->params);
    if (ev) {
        /* a fresh evaluator over the trained weights finds what the long-lived one found last */
        dt_train_eval       *fresh = NULL;
        dt_train_eval_result a, b;
        TST_CHECK(tst_ok(dt_train_eval_create(&fresh, &ec, m), "fresh evaluator") &&
                  tst_ok(dt_train_eval_run(fresh, STEPS, &b), "fresh evaluation"));
        a = out->ev[out->n_ev - 1];
        TST_CHECK(b.done && a.all.tau == b.all.tau && a.all.steps == b.all.steps &&
                  memcmp(a.all.hist, b.all.hist, sizeof a.all.hist) == 0);
        dt_train_eval_destroy(&fresh);
        /* the target fails on the second call of the next evaluation: skipped, then the one after works */
        v->fail_at = v->calls + 2;
        cm_log_set_level(CM_LOG_LEVEL_ERROR); /* its warning is expected */
        int ok = tst_ok(dt_train_eval_run(ev, STEPS + 1, &a), "evaluation with a failing target");
        cm_log_set_level(CM_LOG_LEVEL_WARN);
        TST_CHECK(ok && !a.done);
        ok = tst_ok(dt_train_eval_run(ev, STEPS + 2, &a), "evaluation after the failure");
        TST_CHECK(ok && a.done && a.all.tau == b.all.tau && a.identical == N_PR);
        TST_CHECK(dt_train_eval_bytes(ev) == bytes);
    }
done:
    dt_train_eval_destroy(&ev);
    dt_optim_destroy(&o);
    dt_model_destroy(&m);
    if (ctx)
        be->ctx_destroy(&ctx);
    free(params);
    free(snap);
}

static void write_prompts(const char *path) {
    FILE *f = fopen(path, "w");
    TST_CHECK(f != NULL);
    for (int d = 0; f && d < N_PR; d++) {
        int32_t ids[P_LEN + 1];
        for (int t = 0; t < P_LEN; t++)
            ids[t] = rtok();
        ids[P_LEN] = chain(ids[P_LEN - 1]);
        fprintf(f, "{\"input_ids\": [%d, %d, %d, %d], \"loss_mask\": [0, 0, 0, 1]}\n", ids[0], ids[1], ids[2],
                ids[3]);
    }
    if (f)
        fclose(f);
}

static void check_in_process(void) {
    char prompts[128];
    snprintf(prompts, sizeof prompts, "%s/prompts.jsonl", tmp);
    write_prompts(prompts);
    make_batches();
    verifier *v = calloc(1, sizeof *v);
    v->rows = malloc((size_t)N_TAPS * 4096 * D * sizeof(float));
    trained *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    train_run(1, v, a, prompts);
    train_run(0, v, b, prompts);
    TST_CHECK(a->n_ev == N_EVAL);
    printf("in process: %d steps, loss %.4f -> %.4f; eval tau", STEPS, a->loss[0], a->loss[STEPS - 1]);
    for (int i = 0; i < a->n_ev; i++)
        printf(" %.3f (step %lld)", a->ev[i].all.tau, (long long)a->ev[i].step);
    printf("\n");
#ifndef TST_SANITIZED
    if (a->n_ev == N_EVAL)
        TST_CHECK(a->ev[N_EVAL - 1].all.tau > a->ev[0].all.tau + 0.3);
    TST_CHECK(a->loss[STEPS - 1] < 0.5 * a->loss[0]);
#endif
    /* the training is the same bits with and without the evaluations */
    TST_CHECK(memcmp(a->loss, b->loss, sizeof a->loss) == 0);
    TST_CHECK(a->n_params == b->n_params && a->n_params > 0 &&
              memcmp(a->params, b->params, a->n_params * sizeof(float)) == 0);

    /* the record and the line */
    if (a->n_ev == N_EVAL) {
        char path[128], line[4096];
        snprintf(path, sizeof path, "%s/metrics.jsonl", tmp);
        FILE *f = fopen(path, "w");
        TST_CHECK(f && tst_ok(dt_train_eval_report(&a->ev[N_EVAL - 1], f, path, NULL, NULL), "report"));
        if (f)
            fclose(f);
        f = fopen(path, "r");
        TST_CHECK(f && fgets(line, sizeof line, f));
        if (f)
            fclose(f);
        char want[64];
        snprintf(want, sizeof want, "{\"step\": %d, \"eval_tau\": ", STEPS);
        TST_CHECK(strncmp(line, want, strlen(want)) == 0 && strstr(line, "\"eval_accept_hist\": [") &&
                  strstr(line, "\"eval_accept_by_slot\": [") && strstr(line, "\"eval_identical\": 6}") &&
                  strstr(line, "\"eval_tokens_per_s\": ") && !strstr(line, "\"loss\"") &&
                  !strstr(line, "\"tau\""));
        dt_train_eval_format(line, sizeof line, &a->ev[N_EVAL - 1]);
        snprintf(want, sizeof want, "eval step %d: tau ", STEPS);
        TST_CHECK(strncmp(line, want, strlen(want)) == 0 && strstr(line, "identical 6/6"));
        printf("  %s\n", line);
    }
    free(a->params);
    free(b->params);
    free(a);
    free(b);
    free(v->rows);
    free(v);
}

// ----------------------------------------------------------------------------
// the command line

#define DT_BIN    TANDEM_BINARY_DIR "/drafter-trainer/drafter-trainer"
#define TS_BIN    TANDEM_BINARY_DIR "/target-server/target-server"
#define MODEL     TANDEM_TEST_DATA "/../models/tandem-tiny"
#define DRAFTER   TANDEM_TEST_DATA "/../models/tandem-tiny-drafter.json"
#define TRAIN_SET TANDEM_TEST_DATA "/../data/tiny/train.jsonl"
#define VALID_SET TANDEM_TEST_DATA "/../data/tiny/valid.jsonl"

static void check_refusals(void) {
    if (access(DT_BIN, X_OK) != 0) {
        printf("%s is not built: the command-line refusals are skipped\n", DT_BIN);
        return;
    }
    char out[128], err[128];
    snprintf(out, sizeof out, "%s/refused", tmp);
    snprintf(err, sizeof err, "%s/refused.err", tmp);
    char *no_data[] = {DT_BIN,  "train", "--config",   DRAFTER, "--target",     MODEL, "--dataset",
                       TRAIN_SET, "--server", "ipc:///nowhere", "--out", out, "--eval-every", "5", NULL};
    TST_CHECK(tst_run(no_data, err) == 2);
    TST_CHECK(strstr(tst_slurp(err), "--eval-every needs --eval-data FILE") != NULL);
    char *no_server[] = {DT_BIN,      "train",  "--config",   DRAFTER,   "--target",    MODEL,
                         "--dataset", TRAIN_SET, "--shards",  tmp,       "--out",       out,
                         "--eval-every", "5",    "--eval-data", VALID_SET, NULL};
    TST_CHECK(tst_run(no_server, err) == 2);
    const char *e = tst_slurp(err);
    TST_CHECK(strstr(e, "give --eval-server ENDPOINT") != NULL && strstr(e, "--shards") != NULL &&
              strchr(e, '\n') == strrchr(e, '\n'));
    printf("refusals: %s", e);
}

// ----------------------------------------------------------------------------
// end to end: a real target-server, train live with and without --eval-every


/* train RUN: the common flags, then extra (NULL-terminated) */
static int e2e_train(const char *run, const char *const *extra) {
    char out[256], err[256];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s/%s.err", tmp, run);
    char *argv[48] = {DT_BIN,          "train",     "--config",       DRAFTER, "--target",   MODEL,
                      "--dataset",     TRAIN_SET,   "--token-budget", "512",   "--out",      out,
                      "--epochs",      "2",         "--lr",           "1e-2",  "--max-anchors", "64",
                      "--progress",    "lines",     "--log-every",    "1000",  "--log-level", "warn"};
    int   n = 22;
    for (int i = 0; extra[i] && n < 47; i++)
        argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    const int rc = tst_run(argv, err);
    if (rc != 0)
        fprintf(stderr, "train (%s) exited %d: %s\n", run, rc, tst_slurp(err));
    return rc;
}

/* The step records of RUN/metrics.jsonl (lines without "eval_") as text, and the eval records' steps
 * and τ. */
static int read_run(const char *run, char *steps, size_t cap, int64_t *ev_step, double *ev_tau, int *n_ev,
                    int *n_steps) {
    char path[600], line[8192];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", tmp, run);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    steps[0] = '\0';
    *n_ev = *n_steps = 0;
    while (fgets(line, sizeof line, f)) {
        const char *t = tst_field(line, "\"eval_tau\": ");
        if (t) {
            if (*n_ev < 64) {
                ev_step[*n_ev] = strtoll(tst_field(line, "{\"step\": "), NULL, 10);
                ev_tau[(*n_ev)++] = strtod(t, NULL);
            }
            continue;
        }
        const char *l = tst_field(line, "\"loss\": "), *u = tst_field(line, "\"tau\": ");
        if (!l || !u)
            continue;
        size_t k = strlen(steps);
        snprintf(steps + k, cap - k, "%.*s|%.*s\n", (int)strcspn(l, ","), l, (int)strcspn(u, ","), u);
        (*n_steps)++;
    }
    fclose(f);
    return 1;
}

static void check_end_to_end(void) {
    if (access(TS_BIN, X_OK) != 0 || access(DT_BIN, X_OK) != 0) {
        printf("end to end skipped: build target-server and drafter-trainer\n");
        return;
    }
    char bind[128], endpoint[256], path[128], shards[128];
    snprintf(bind, sizeof bind, "ipc://%s/target.ipc", tmp);
    snprintf(path, sizeof path, "%s/serve", tmp);
    snprintf(shards, sizeof shards, "%s/shards", tmp);
    const char *sx[] = {"--log-level", "warn", NULL};
    const double t0 = cm_now_s();
    pid_t        srv = tst_serve_start(TS_BIN, MODEL, bind, path, sx, endpoint, sizeof endpoint, 30000);
    TST_CHECK(srv > 0);
    if (srv <= 0)
        return;
    /* live, with and without evaluations */
    char steps[16];
    snprintf(steps, sizeof steps, "%d", E2E_STEPS);
    const char *const with[] = {"--server",       endpoint, "--eval-every",   E2E_EVERY, "--eval-data", VALID_SET,
                                "--eval-prompts", "8",      "--eval-max-new", "24",      "--steps",     steps,
                                NULL};
    const char *const plain[] = {"--server", endpoint, "--steps", steps, NULL};
    const int         rc_eval = e2e_train("with-eval", with);
    const double      t1 = cm_now_s();
    const int         rc_plain = e2e_train("plain", plain);
    const double      t2 = cm_now_s();
    char err[256];
    snprintf(err, sizeof err, "%s/precompute.err", tmp);
#ifdef TST_SANITIZED
    const int rc_pc = 0, rc_shards = 0;
#else
    /* from precomputed shards, evaluating on the server through --eval-server: 24 steps */
    char *pc[] = {DT_BIN,  "precompute", "--server", endpoint, "--dataset", TRAIN_SET, "--token-budget", "512",
                  "--layers", "1,5",     "--out",    shards,   "--log-level", "warn",  NULL};
    const int         rc_pc = tst_run(pc, err);
    const char *const from_shards[] = {"--shards", shards, "--steps", "24", "--eval-server", endpoint,
                                       "--eval-every", "12", "--eval-data", VALID_SET, "--eval-prompts", "8",
                                       "--eval-max-new", "24", NULL};
    const int         rc_shards = rc_pc == 0 ? e2e_train("shards", from_shards) : -1;
#endif
    const double t3 = cm_now_s();
    tst_stop(&srv);
    TST_CHECK(rc_eval == 0 && rc_plain == 0 && rc_pc == 0 && rc_shards == 0);
    if (rc_pc != 0)
        fprintf(stderr, "precompute exited %d: %s\n", rc_pc, tst_slurp(err));

    static char a[1 << 17], b[1 << 17];
    int64_t     ev_step[64], sh_step[64];
    double      ev_tau[64], sh_tau[64];
    int         n_ev = 0, n_a = 0, n_b = 0, n_none = 0, n_sh = 0, n_c = 0;
    TST_CHECK(read_run("with-eval", a, sizeof a, ev_step, ev_tau, &n_ev, &n_a));
    TST_CHECK(read_run("plain", b, sizeof b, sh_step, sh_tau, &n_none, &n_b));
#ifndef TST_SANITIZED
    static char c[1 << 17];
    TST_CHECK(read_run("shards", c, sizeof c, sh_step, sh_tau, &n_sh, &n_c));
#endif
    printf("end to end: %d steps with --eval-every " E2E_EVERY " in %.1f s, %d without in %.1f s; eval tau", n_a,
           t1 - t0, n_b, t2 - t1);
    for (int i = 0; i < n_ev; i++)
        printf(" %.3f (step %lld)", ev_tau[i], (long long)ev_step[i]);
    printf("\n");
    if (n_c) {
        printf("  from shards with --eval-server: precompute and %d steps in %.1f s; eval tau", n_c, t3 - t2);
        for (int i = 0; i < n_sh; i++)
            printf(" %.3f (step %lld)", sh_tau[i], (long long)sh_step[i]);
        printf("\n");
    }
    /* the step records and the final checkpoint are the same bytes with and without evaluations */
    TST_CHECK(n_a == E2E_STEPS && n_a == n_b && strcmp(a, b) == 0 && n_none == 0);
    const char *files[] = {"config.json", "model.safetensors", "training_state.safetensors"};
    for (int k = 0; k < 3; k++) {
        char fa[600], fb[600];
        snprintf(fa, sizeof fa, "%s/with-eval/checkpoints/step-%d/%s", tmp, E2E_STEPS, files[k]);
        snprintf(fb, sizeof fb, "%s/plain/checkpoints/step-%d/%s", tmp, E2E_STEPS, files[k]);
        TST_CHECK(tst_same_file(fa, fb));
    }
    const int every = atoi(E2E_EVERY), want = n_a / every + (n_a % every != 0);
    TST_CHECK(n_ev == want);
    for (int i = 0; i < n_ev && i < want; i++)
        TST_CHECK(ev_step[i] == (i + 1 < want || n_a % every == 0 ? (int64_t)(i + 1) * every : n_a));
#ifndef TST_SANITIZED
    TST_CHECK(n_ev >= 2 && ev_tau[n_ev - 1] > ev_tau[0]);
#endif
    snprintf(err, sizeof err, "%s/with-eval.err", tmp);
    const char *e = tst_slurp(err);
    TST_CHECK(strstr(e, "eval step " E2E_EVERY ": tau ") != NULL && strstr(e, "identical 8/8") != NULL);
    /* from shards: the live runs' first 24 steps (the shards hold the same hidden states), and
     * evaluations at 12 and 24 through --eval-server */
#ifndef TST_SANITIZED
    TST_CHECK(n_c == 24 && strncmp(a, c, strlen(c)) == 0);
    TST_CHECK(n_sh == 2 && sh_step[0] == 12 && sh_step[1] == 24 && sh_tau[0] >= 1 && sh_tau[1] >= 1);
#endif
    /* TensorBoard has the scalars (their tags are plain text in the event file) */
    char cmd[600], found[64];
    snprintf(cmd, sizeof cmd, "cat %s/with-eval/tb/events.out.tfevents.* | grep -c -a 'eval/tau'", tmp);
    TST_CHECK(tst_sh(cmd, found, sizeof found) == 0 && atoi(found) >= 1);
}

int main(void) {
    cm_log_set_level(CM_LOG_LEVEL_WARN);
    /* the tiny models gain nothing from threads on a small machine, and spinning threads on a busy
     * one (two processes end to end, or other tests) make every step wait (as scripts/quickstart.sh
     * says); the children inherit it */
    setenv("OMP_NUM_THREADS", "1", 1);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-dtte-XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    check_in_process();
    check_refusals();
    check_end_to_end();
    const int rc = tst_report();
    if (getenv("DT_TRAIN_EVAL_KEEP")) {
        printf("kept %s\n", tmp);
        return rc;
    }
    return tst_cleanup(tmp, rc);
}
