/* tests/test_dt_eval.c — `drafter-trainer eval` without a target-server: prompts from documents (the
 * tokens before the first supervised one), the target's EOS ids from its configs, the figures (τ,
 * the acceptance histogram and by slot), the JSON report and its atomic write; the decoding loop
 * against an in-process verifier that follows the DECODE contract (a greedy target whose next token
 * is a fixed function of the last one, handles, bases, accepted drafts, the committed rows' taps),
 * with a scripted drafter that checks every committed row reaches its slot in order, and with a real
 * tiny DFlash2 drafter (dt_infer, BF16 taps): 7 prompts, 3 at a time, prompts that end at EOS on the
 * prefill and after a few tokens, max-new cuts; the speculative and the target-only tokens must both
 * be the target's own sequence. Answers that break the contract are refused (CM_ERR_PROTOCOL), and
 * the command's usage and input errors come back from the real binary with exit 2 or 1. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_log.h"
#include "dt_eval.h"
#include "dt_infer.h"
#include "dt_model.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_proto.h"

#define FV     97 /* the fake target's vocabulary */
#define FD     8  /* its hidden size */
#define F_EOS  5
#define F_B    5 /* the block */
#define N_PR   7
#define MAXNEW 20

static char tmp[64];

static int32_t chain(int32_t t) { /* the fake target's greedy next token */
    return (t * 7 + 3) % FV;
}

// ----------------------------------------------------------------------------
// prompts, EOS ids, figures, JSON

static void check_prompts(void) {
    /* doc 0: prompt of 2; doc 1: supervised from the start; doc 2: never supervised; doc 3: prompt of 1 */
    int32_t         ids[] = {10, 11, 12, 13, 20, 21, 30, 31, 32, 40, 41};
    uint8_t         mask[] = {0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1};
    int64_t         off[] = {0, 4, 6, 9, 11};
    dt_docs         d = {.ids = ids, .mask = mask, .offsets = off, .n_docs = 4, .total = 11};
    dt_eval_prompt *p = NULL;
    int64_t         n = 0, skipped = 0;
    TST_CHECK(dt_eval_prompts(&d, 0, &p, &n, &skipped) == CM_OK);
    TST_CHECK(n == 2 && skipped == 2);
    TST_CHECK(p && p[0].doc == 0 && p[0].n == 2 && p[0].ids == ids && p[1].doc == 3 && p[1].n == 1 &&
              p[1].ids[0] == 40);
    free(p);
    TST_CHECK(dt_eval_prompts(&d, 1, &p, &n, &skipped) == CM_OK && n == 1 && skipped == 0);
    free(p);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    TST_CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void check_eos(void) {
    char dir[128], path[256];
    snprintf(dir, sizeof dir, "%s/eos", tmp);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, "{\"eos_token_id\": 7, \"text_config\": {\"eos_token_id\": [7, 9]}}");
    int32_t ids[DT_EVAL_MAX_EOS];
    int     n = -1;
    TST_CHECK(dt_eval_eos_ids(dir, ids, DT_EVAL_MAX_EOS, &n) == CM_OK && n == 2 && ids[0] == 7 &&
              ids[1] == 9);
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    write_text(path, "{\"eos_token_id\": [9, 11, 12]}");
    TST_CHECK(dt_eval_eos_ids(dir, ids, DT_EVAL_MAX_EOS, &n) == CM_OK && n == 4 && ids[2] == 11 &&
              ids[3] == 12);
    write_text(path, "{\"eos_token_id\": \"</s>\"}");
    TST_FAILS(dt_eval_eos_ids(dir, ids, DT_EVAL_MAX_EOS, &n), CM_ERR_FORMAT, "generation_config.json",
              "eos_token_id");
    write_text(path, "[1, 2");
    TST_FAILS(dt_eval_eos_ids(dir, ids, DT_EVAL_MAX_EOS, &n), CM_ERR_FORMAT, "not a JSON object");
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, "{\"eos_token_id\": null}");
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    unlink(path);
    TST_CHECK(dt_eval_eos_ids(dir, ids, DT_EVAL_MAX_EOS, &n) == CM_OK && n == 0);
    snprintf(dir, sizeof dir, "%s/no-such-model", tmp);
    TST_FAILS(dt_eval_eos_ids(dir, ids, DT_EVAL_MAX_EOS, &n), CM_ERR_IO, "config.json");
    /* the embedded tiny target */
    TST_CHECK(dt_eval_eos_ids(TANDEM_TEST_DATA "/../models/tandem-tiny", ids, DT_EVAL_MAX_EOS, &n) == CM_OK &&
              n == 1 && ids[0] == 2);
}

static int32_t out_a[8] = {1, 2, 3, 4, 5}, out_b[8] = {1, 2, 9, 4, 5};

/* Two prompts at block 4: steps with a = 3, 0, 2 and a = 1; the second's tokens differ at 2. */
static void check_figures_and_json(void) {
    dt_eval_seq s[2], base[2];
    memset(s, 0, sizeof s);
    memset(base, 0, sizeof base);
    s[0] =
        (dt_eval_seq){.doc = 4, .prompt_len = 10, .generated = 5, .t_start = 1.0, .t_end = 3.0, .out = out_a};
    s[1] = (dt_eval_seq){
        .doc = 9, .prompt_len = 3, .generated = 5, .eos = 1, .t_start = 1.0, .t_end = 2.0, .out = out_a};
    dt_eval_seq_step(&s[0], 3, 3, 4);
    dt_eval_seq_step(&s[0], 3, 0, 1);
    dt_eval_seq_step(&s[0], 3, 2, 3);
    dt_eval_seq_step(&s[1], 2, 1, 2);
    TST_CHECK(s[0].steps == 3 && s[0].verified == 8 && s[0].drafted == 9);
    TST_CHECK(s[0].hist[0] == 1 && s[0].hist[2] == 1 && s[0].hist[3] == 1 && s[0].hist[1] == 0);
    TST_CHECK(s[0].slot_acc[1] == 2 && s[0].slot_acc[2] == 2 && s[0].slot_acc[3] == 1);
    TST_CHECK(fabs(dt_eval_seq_tau(&s[0]) - 8.0 / 3.0) < 1e-12);
    dt_eval_summary sum;
    dt_eval_summarize(s, 2, 4.0, &sum);
    TST_CHECK(sum.steps == 4 && sum.verified == 10 && sum.generated == 10 && sum.n_eos == 1 &&
              sum.drafted == 11);
    TST_CHECK(fabs(sum.tau - 2.5) < 1e-12 && fabs(sum.tokens_per_s - 2.5) < 1e-12);
    TST_CHECK(sum.hist[1] == 1 && sum.slot_acc[1] == 3 && sum.slot_acc[3] == 1);
    base[0] =
        (dt_eval_seq){.generated = 5, .steps = 4, .verified = 4, .out = out_a, .t_start = 0, .t_end = 5};
    base[1] =
        (dt_eval_seq){.generated = 5, .steps = 4, .verified = 4, .out = out_b, .t_start = 0, .t_end = 5};
    TST_CHECK(dt_eval_first_diff(&s[0], &base[0]) == -1 && dt_eval_first_diff(&s[1], &base[1]) == 2);
    dt_eval_report r = {.meta = {.drafter = "ckpt",
                                 .kind = "DFlash",
                                 .target = "tgt",
                                 .data = "d.jsonl",
                                 .device = "cpu",
                                 .endpoint = "tcp://127.0.0.1:5556",
                                 .block = 4,
                                 .batch = 2,
                                 .max_new = 5},
                        .seqs = s,
                        .n = 2,
                        .all = sum,
                        .compare = 1,
                        .base = base};
    dt_eval_summarize(base, 2, 10.0, &r.base_all);
    char *text = NULL;
    TST_CHECK(dt_eval_json(&r, &text) == CM_OK && text);
    char path[128];
    snprintf(path, sizeof path, "%s/report.json", tmp);
    TST_CHECK(dt_eval_write_file(path, text) == CM_OK);
    cJSON *o = cJSON_Parse(tst_slurp(path));
    free(text);
    TST_CHECK(o != NULL);
    if (o) {
        const cJSON *all = cJSON_GetObjectItem(o, "overall"), *ps = cJSON_GetObjectItem(o, "prompts");
        const cJSON *b = cJSON_GetObjectItem(o, "target_only_run");
        TST_CHECK(cJSON_GetObjectItem(o, "block")->valuedouble == 4);
        TST_CHECK(strcmp(cJSON_GetObjectItem(o, "kind")->valuestring, "DFlash") == 0);
        TST_CHECK(fabs(cJSON_GetObjectItem(all, "tau")->valuedouble - 2.5) < 1e-12);
        TST_CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(all, "accept_hist")) == 4);
        const cJSON *by = cJSON_GetObjectItem(all, "accept_by_slot");
        TST_CHECK(cJSON_GetArraySize(by) == 3 && fabs(cJSON_GetArrayItem(by, 0)->valuedouble - 0.75) < 1e-12);
        TST_CHECK(cJSON_GetArraySize(ps) == 2);
        const cJSON *p1 = cJSON_GetArrayItem(ps, 1);
        TST_CHECK(cJSON_IsFalse(cJSON_GetObjectItem(p1, "identical")) &&
                  cJSON_GetObjectItem(p1, "first_diff")->valuedouble == 2 &&
                  cJSON_IsTrue(cJSON_GetObjectItem(p1, "eos")));
        TST_CHECK(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(ps, 0), "identical")));
        TST_CHECK(fabs(cJSON_GetObjectItem(cJSON_GetArrayItem(ps, 0), "tokens_per_s")->valuedouble - 2.5) <
                  1e-12);
        TST_CHECK(b && cJSON_GetObjectItem(b, "identical")->valuedouble == 1 &&
                  cJSON_IsFalse(cJSON_GetObjectItem(b, "all_identical")) &&
                  fabs(cJSON_GetObjectItem(b, "speedup")->valuedouble - 2.5) < 1e-12);
        cJSON_Delete(o);
    }
    FILE *devnull = fopen("/dev/null", "w");
    dt_eval_print(devnull ? devnull : stdout, &r); /* no crash; the format is for people */
    if (devnull)
        fclose(devnull);
    snprintf(path, sizeof path, "%s/no-such-dir/report.json", tmp);
    TST_FAILS(dt_eval_write_file(path, "{}"), CM_ERR_IO, "cannot create");
}

// ----------------------------------------------------------------------------
// an in-process verifier and a scripted drafter

typedef struct fseq {
    uint32_t committed;
    int32_t  last;
    int      open;
} fseq;

typedef struct fake_target {
    fseq            seqs[64]; /* by handle − 1 */
    int             n_handles, n_closed, errors, n_taps, bad;
    int             accept_any; /* accept (committed % 3) drafts whatever they are */
    int32_t         layer_ids[4];
    cm_dtype        dt;
    cm_proto_tensor t[8];
    int32_t         decode[64 * 4];
    float          *rows_f;
    uint16_t       *rows_h;
} fake_target;

static float tap_value(int64_t pos, int k) { /* exact in bf16 */
    return (float)(pos % 64 + 64 * k);
}

static cm_status fake_step(void *u, cm_proto_decode *rq, cm_proto_answer *ans) {
    fake_target   *f = u;
    const int32_t *tok = rq->tokens;
    int64_t        rows = 0, T = 0;
    for (uint32_t i = 0; i < rq->n_seqs; i++) {
        cm_proto_decode_seq *r = &rq->seqs[i];
        int32_t             *d = f->decode + 4 * i;
        T += r->n_ctx + r->n_draft;
        if (rq->op == CM_DECODE_CLOSE) {
            const int ok = r->handle >= 1 && (int)r->handle <= f->n_handles && f->seqs[r->handle - 1].open;
            f->errors += !ok;
            if (ok) {
                f->seqs[r->handle - 1].open = 0;
                f->n_closed++;
            }
            d[0] = (int32_t)r->handle, d[1] = d[2] = 0, d[3] = -1;
            continue;
        }
        uint32_t h = r->handle;
        if (h == 0) {
            f->errors += r->base != 0 || f->n_handles == 64;
            f->seqs[f->n_handles++] = (fseq){.open = 1};
            h = (uint32_t)f->n_handles;
        }
        if (h > (uint32_t)f->n_handles)
            return CM_FAIL(CM_ERR_INVALID_ARG, "unknown handle %u", h);
        fseq *s = &f->seqs[h - 1];
        f->errors += !s->open || r->base != s->committed || r->n_ctx < 1 || r->n_draft > F_B - 1 ||
                     r->temperature != 0 || r->top_p != 1.0f;
        /* commit the context, then the drafts while they are the target's tokens */
        s->last = tok[r->n_ctx - 1];
        int a = 0;
        while (a < (int)r->n_draft &&
               (f->accept_any ? a < (int)(s->committed % 3) : tok[r->n_ctx + a] == chain(s->last)))
            s->last = tok[r->n_ctx + a++];
        const int64_t n_rows = r->n_ctx + a;
        for (int64_t j = 0; j < n_rows; j++)
            for (int k = 0; k < f->n_taps; k++)
                for (int c = 0; c < FD; c++) {
                    const float v = tap_value(s->committed + j, k);
                    f->rows_f[(k * 4096 + rows + j) * FD + c] = v;
                    f->rows_h[(k * 4096 + rows + j) * FD + c] = cm_f32_to_bf16(v);
                }
        rows += n_rows;
        s->committed += (uint32_t)n_rows;
        d[0] = (int32_t)h, d[1] = (int32_t)s->committed, d[2] = a, d[3] = chain(s->last);
        if (f->bad == 1 && i == 0 && r->n_draft > 0)
            d[0]++;
        if (f->bad == 4 && i == 0)
            d[1]++;
        tok += r->n_ctx + r->n_draft;
    }
    f->errors += T != rq->n_tokens;
    tst_put_tensor(&f->t[0], "decode", CM_DTYPE_I32, rq->n_seqs, 4, f->decode);
    ans->n_tensors = 1;
    if (rq->op == CM_DECODE_STEP) {
        f->errors += rq->n_layers != 0 && (int)rq->n_layers != f->n_taps;
        for (uint32_t k = 0; k < rq->n_layers && k < 4; k++) {
            char name[32];
            snprintf(name, sizeof name, "layer_%d", rq->layer_ids[k]);
            const void *d = f->dt == CM_DTYPE_BF16 ? (const void *)(f->rows_h + k * 4096 * FD)
                                                   : (const void *)(f->rows_f + k * 4096 * FD);
            if (f->bad == 2 && k == 1)
                continue;
            tst_put_tensor(&f->t[ans->n_tensors++], name, f->dt, rows + (f->bad == 3), FD, d);
        }
    }
    memcpy(ans->tensors, f->t, ans->n_tensors * sizeof *f->t);
    return CM_OK;
}

typedef struct fake_drafter {
    int64_t len[8];
    int     resets, errors, n_taps;
} fake_drafter;

static cm_status fd_append(void *u, const dt_infer_rows *r) {
    fake_drafter *f = u;
    int64_t       packed = 0;
    for (int i = 0; i < r->n_seq; i++) {
        const int s = r->slots[i];
        for (int32_t j = 0; j < r->n_rows[i]; j++, packed++)
            for (int k = 0; k < f->n_taps; k++) {
                float v;
                if (r->dt == CM_DTYPE_F32)
                    memcpy(&v, (const float *)r->tap[k] + packed * r->ld, sizeof v);
                else
                    v = cm_bf16_to_f32(((const uint16_t *)r->tap[k])[packed * r->ld]);
                f->errors += v != tap_value(f->len[s] + j, k);
            }
        f->len[s] += r->n_rows[i];
    }
    return CM_OK;
}

/* The target's chain, with a wrong guess wherever (anchor + k) % 4 == 0. */
static cm_status fd_draft(void *u, int block, int n, const int32_t *slots, const int32_t *anchor,
                          int32_t *drafts) {
    (void)u, (void)slots;
    TST_CHECK(block >= 2 && block <= F_B);
    for (int i = 0; i < n; i++) {
        int32_t t = anchor[i];
        for (int k = 1; k < block; k++) {
            t = chain(t);
            drafts[i * (block - 1) + k - 1] = (anchor[i] + k) % 4 == 0 ? (t + 1) % FV : t;
        }
    }
    return CM_OK;
}

static void fd_reset(void *u, int slot) {
    fake_drafter *f = u;
    f->len[slot] = 0;
    f->resets++;
}

// ----------------------------------------------------------------------------
// the loop

static int32_t        prompt_ids[N_PR][12];
static dt_eval_prompt prompts[N_PR];
static int32_t        expect[N_PR][MAXNEW];
static int64_t        expect_n[N_PR];
static const int32_t  eos_id = F_EOS;
static const int32_t  layers[2] = {3, 7};

static void make_prompts(void) {
    uint64_t r = 12345;
    for (int i = 0; i < N_PR; i++) {
        const int n = 1 + (i * 5) % 9;
        for (int t = 0; t < n; t++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            prompt_ids[i][t] = (int32_t)((r >> 33) % FV);
        }
        if (i == 0)
            prompt_ids[i][n - 1] = 28; /* chain(28) = EOS: done on the prefill */
        if (i == 1)
            prompt_ids[i][n - 1] = 8; /* 59, 28, EOS */
        prompts[i] = (dt_eval_prompt){.doc = 100 + i, .ids = prompt_ids[i], .n = n};
        int32_t t = prompt_ids[i][n - 1];
        expect_n[i] = 0;
        while (expect_n[i] < MAXNEW) {
            t = chain(t);
            expect[i][expect_n[i]++] = t;
            if (t == F_EOS)
                break;
        }
    }
}

static fake_target *new_target(cm_dtype dt) {
    fake_target *f = calloc(1, sizeof *f);
    f->rows_f = calloc((size_t)(2 * 4096 * FD), sizeof(float));
    f->rows_h = calloc((size_t)(2 * 4096 * FD), sizeof(uint16_t));
    f->n_taps = 2;
    f->dt = dt;
    return f;
}

static void free_target(fake_target *f) {
    free(f->rows_f);
    free(f->rows_h);
    free(f);
}

static dt_eval_opts base_opts(int target_only) {
    return (dt_eval_opts){.max_new = MAXNEW,
                          .batch = 3,
                          .target_only = target_only,
                          .top_p = 1.0f,
                          .encoding = CM_ENCODING_RAW,
                          .n_taps = 2,
                          .layer_ids = layers,
                          .hidden = FD,
                          .eos = &eos_id,
                          .n_eos = 1};
}

/* Every prompt's tokens are the target's sequence; the figures add up. */
static void check_run(const dt_eval_seq *s, int target_only, const char *what) {
    int64_t steps = 0, verified = 0, cut = 0;
    for (int i = 0; i < N_PR; i++) {
        const int same = s[i].generated == expect_n[i] &&
                         memcmp(s[i].out, expect[i], (size_t)expect_n[i] * sizeof(int32_t)) == 0;
        if (!same)
            fprintf(stderr, "%s: prompt %d: %lld tokens, expected %lld\n", what, i, (long long)s[i].generated,
                    (long long)expect_n[i]);
        TST_CHECK(same);
        TST_CHECK(s[i].eos == (expect[i][expect_n[i] - 1] == F_EOS) && s[i].doc == 100 + i);
        int64_t h = 0, acc = 0;
        for (int a = 0; a < F_B; a++) {
            h += s[i].hist[a];
            acc += (int64_t)a * s[i].hist[a];
        }
        /* verified counts what the steps emitted (z-lab's count): a + 1 each, cut at EOS and max_new */
        TST_CHECK(h == s[i].steps && s[i].verified <= s[i].steps + acc);
        for (int k = 2; k < F_B; k++)
            TST_CHECK(s[i].slot_acc[k] <= s[i].slot_acc[k - 1]);
        /* every token after the prefill's came from a verify step */
        TST_CHECK(s[i].verified == s[i].generated - 1);
        if (target_only)
            TST_CHECK(s[i].steps == s[i].generated - 1 && s[i].drafted == 0);
        steps += s[i].steps;
        verified += s[i].verified;
        cut += s[i].generated < MAXNEW;
    }
    TST_CHECK(cut == 2); /* the two that end at EOS */
    printf("%-34s %lld verify steps, tau %.3f\n", what, (long long)steps, (double)verified / (double)steps);
    if (!target_only)
        TST_CHECK(verified > steps); /* drafts were accepted */
}

static void check_loop(void) {
    make_prompts();
    dt_eval_seq     spec[N_PR], base[N_PR];
    double          wall = 0, ds = -1, vs = -1;
    fake_target    *t = new_target(CM_DTYPE_F32);
    fake_drafter    fd = {.n_taps = 2};
    dt_eval_target  tg = {fake_step, t};
    dt_eval_drafter d = {
        .n_slots = 4, .block = F_B, .append = fd_append, .draft = fd_draft, .reset = fd_reset, .user = &fd};
    dt_eval_opts o = base_opts(0);
    TST_CHECK(tst_ok(dt_eval_run(&tg, &d, &o, prompts, N_PR, spec, &wall, &ds, &vs), "speculative run"));
    TST_CHECK(t->errors == 0 && fd.errors == 0 && fd.resets == N_PR);
    TST_CHECK(t->n_handles == N_PR && t->n_closed == N_PR && wall >= 0 && ds >= 0 && vs >= 0);
    check_run(spec, 0, "scripted drafter");
    free_target(t);
    t = new_target(CM_DTYPE_F32);
    tg.user = t;
    o = base_opts(1);
    TST_CHECK(tst_ok(dt_eval_run(&tg, NULL, &o, prompts, N_PR, base, &wall, NULL, NULL), "target-only run"));
    TST_CHECK(t->errors == 0 && t->n_closed == N_PR);
    check_run(base, 1, "target only");
    for (int i = 0; i < N_PR; i++)
        TST_CHECK(dt_eval_first_diff(&spec[i], &base[i]) == -1);
    for (int i = 0; i < N_PR; i++) {
        dt_eval_seq_release(&spec[i]);
        dt_eval_seq_release(&base[i]);
    }
    free_target(t);

    /* answers that break the contract */
    static const struct {
        int         bad;
        const char *word;
    } bad[] = {
        {1, "answered sequence 0"}, {2, "has no \"layer_7\""}, {3, "\"layer_3\" has"}, {4, "committed"}};
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        t = new_target(CM_DTYPE_F32);
        t->bad = bad[b].bad;
        tg.user = t;
        o = base_opts(0);
        memset(&fd, 0, sizeof fd);
        fd.n_taps = 2;
        TST_FAILS(dt_eval_run(&tg, &d, &o, prompts, N_PR, spec, &wall, NULL, NULL), CM_ERR_PROTOCOL,
                  bad[b].word);
        for (int i = 0; i < N_PR; i++)
            dt_eval_seq_release(&spec[i]);
        free_target(t);
    }
    t = new_target(CM_DTYPE_F32);
    tg.user = t;
    o = base_opts(0);
    o.hidden = FD + 1;
    TST_FAILS(dt_eval_run(&tg, &d, &o, prompts, N_PR, spec, &wall, NULL, NULL), CM_ERR_INVALID_ARG,
              "hidden states are 8 wide", "hidden size is 9");
    for (int i = 0; i < N_PR; i++)
        dt_eval_seq_release(&spec[i]);
    free_target(t);
}

/* A real tiny DFlash2 drafter (dt_infer) in the loop, its taps in BF16: lossless whatever it drafts. */
static void check_loop_infer(void) {
    cm_drafter_cfg c;
    memset(&c, 0, sizeof c);
    c.kind = CM_DRAFTER_DFLASH2;
    c.hidden_size = FD;
    c.n_layers = 2;
    c.intermediate_size = 16;
    c.vocab_size = FV;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 4;
    c.rms_norm_eps = 1e-6f;
    c.rope_theta = 1e4;
    c.max_position_embeddings = 4096;
    c.block_size = 8;
    c.mask_token_id = FV - 1;
    c.num_target_layers = 8;
    c.n_taps = 2;
    c.target_layer_ids[0] = layers[0];
    c.target_layer_ids[1] = layers[1];
    c.layer_types[0] = CM_LAYER_TYPE_SLIDING_ATTENTION;
    c.layer_types[1] = CM_LAYER_TYPE_FULL_ATTENTION;
    c.sliding_window = 4;
    c.conv_kernel_size = 2, c.conv_group_size = 4, c.selector_rank = 4, c.selector_top_k = 4;
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    dt_infer         *inf = NULL;
    float            *table = malloc((size_t)(FV * FD) * sizeof *table);
    for (int i = 0; i < FV * FD; i++)
        table[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
    const dt_infer_config ic = {.n_slots = 3, .max_len = 64, .block = F_B};
    dt_eval_seq           s[N_PR];
    double                wall;
    if (tst_ok(be->ctx_create(&ctx, NULL), "ctx") && tst_ok(dt_model_create(&m, &c, be, ctx), "create") &&
        tst_ok(dt_model_init_random(m, 3), "init") &&
        tst_ok(dt_model_set_frozen(m, table, CM_DTYPE_F32, table, CM_DTYPE_F32, FV, FD), "frozen") &&
        tst_ok(dt_infer_create(&inf, m, &ic), "dt_infer_create")) {
        fake_target    *t = new_target(CM_DTYPE_BF16);
        dt_eval_target  tg = {fake_step, t};
        dt_eval_drafter d = dt_eval_drafter_infer(inf);
        dt_eval_opts    o = base_opts(0);
        TST_CHECK(d.n_slots == 3 && d.block == F_B);
        TST_CHECK(tst_ok(dt_eval_run(&tg, &d, &o, prompts, N_PR, s, &wall, NULL, NULL), "run with dt_infer"));
        TST_CHECK(t->errors == 0 && t->n_closed == N_PR);
        int64_t steps = 0, verified = 0;
        for (int i = 0; i < N_PR; i++) {
            TST_CHECK(s[i].generated == expect_n[i] &&
                      memcmp(s[i].out, expect[i], (size_t)expect_n[i] * sizeof(int32_t)) == 0);
            steps += s[i].steps;
            verified += s[i].verified;
            dt_eval_seq_release(&s[i]);
        }
        printf("%-34s %lld verify steps, tau %.3f (a random drafter)\n", "tiny DFlash2 drafter",
               (long long)steps, (double)verified / (double)steps);
        /* a verifier that accepts drafts whatever they are: several committed rows per step */
        free_target(t);
        t = new_target(CM_DTYPE_BF16);
        t->accept_any = 1;
        tg.user = t;
        TST_CHECK(
            tst_ok(dt_eval_run(&tg, &d, &o, prompts, N_PR, s, &wall, NULL, NULL), "run accepting drafts"));
        steps = verified = 0;
        for (int i = 0; i < N_PR; i++) {
            steps += s[i].steps;
            verified += s[i].verified;
            dt_eval_seq_release(&s[i]);
        }
        TST_CHECK(t->errors == 0 && t->n_closed == N_PR && verified > steps);
        o.batch = 4; /* more than the drafter's slots */
        TST_FAILS(dt_eval_run(&tg, &d, &o, prompts, N_PR, s, &wall, NULL, NULL), CM_ERR_INVALID_ARG,
                  "batch 4");
        free_target(t);
    }
    dt_infer_destroy(&inf);
    dt_model_destroy(&m);
    if (ctx)
        be->ctx_destroy(&ctx);
    free(table);
}

// ----------------------------------------------------------------------------
// the command line

static int run_eval(const char *const *args, const char *want) {
    char bin[1024], err[128];
    snprintf(bin, sizeof bin, "%s/drafter-trainer/drafter-trainer", TANDEM_BINARY_DIR);
    snprintf(err, sizeof err, "%s/eval.err", tmp);
    char *argv[32] = {bin, "eval"};
    int   n = 2;
    for (int i = 0; args[i] && n < 31; i++)
        argv[n++] = (char *)args[i];
    argv[n] = NULL;
    const int   rc = tst_run(argv, err);
    const char *msg = tst_slurp(err);
    if (want && !strstr(msg, want)) {
        fprintf(stderr, "eval %s...: stderr lacks '%s':\n%s", args[0] ? args[0] : "", want, msg);
        tst_failures++;
    }
    return rc;
}

static void check_cli(void) {
    char data[128], nodata[128], run[128];
    snprintf(data, sizeof data, "%s/prompts.jsonl", tmp);
    snprintf(nodata, sizeof nodata, "%s/noprompt.jsonl", tmp);
    snprintf(run, sizeof run, "%s/run", tmp);
    mkdir(run, 0755);
    write_text(data, "{\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [0, 0, 1, 1]}\n");
    write_text(nodata, "{\"input_ids\": [1, 2, 3], \"loss_mask\": [1, 1, 1]}\n{\"input_ids\": [4, 5]}\n");
    const char *target = TANDEM_TEST_DATA "/../models/tandem-tiny";
    TST_CHECK(run_eval((const char *[]){"--help", NULL}, NULL) == 0);
    TST_CHECK(run_eval((const char *[]){"--data", data, NULL}, "are required") == 2);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", data, "--server", "tcp://127.0.0.1:1",
                                        "--decode-server", "tcp://127.0.0.1:2", "--target-only", NULL},
                       "not both") == 2);
    TST_CHECK(
        run_eval((const char *[]){"--target", target, "--data", data, "--server", "tcp://127.0.0.1:1", NULL},
                 "a drafter is required") == 2);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", data, "--server", "tcp://127.0.0.1:1",
                                        "--target-only", "--compare-target-only", NULL},
                       "drop --target-only") == 2);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", data, "--server", "tcp://127.0.0.1:1",
                                        "--target-only", "--top-k", "5", NULL},
                       "give --temperature") == 2);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", data, "--server", "tcp://127.0.0.1:1",
                                        "--target-only", "--block", "1", NULL},
                       "--block") == 2);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", nodata, "--decode-server",
                                        "tcp://127.0.0.1:1", "--target-only", NULL},
                       "has no prompt") == 1);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", data, "--decode-server",
                                        "tcp://127.0.0.1:1", "--run", run, NULL},
                       "has no checkpoint") == 1);
    char missing[160];
    snprintf(missing, sizeof missing, "%s/missing.jsonl", tmp);
    TST_CHECK(run_eval((const char *[]){"--target", target, "--data", missing, "--decode-server",
                                        "tcp://127.0.0.1:1", "--target-only", NULL},
                       "missing.jsonl") == 1);
}

int main(void) {
    snprintf(tmp, sizeof tmp, "/tmp/test_dt_eval.XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    cm_log_set_level(CM_LOG_LEVEL_WARN); /* no line per finished prompt */
    check_prompts();
    check_eos();
    check_figures_and_json();
    check_loop();
    check_loop_infer();
    check_cli();
    return tst_cleanup(tmp, tst_report());
}
