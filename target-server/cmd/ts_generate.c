/* target-server/cmd/ts_generate.c — `target-server generate`: the target answers the prompts of a
 * tokenized dataset itself (its responses regenerated), in process, through the same decoder the
 * server's decoding endpoint runs (ts_decode.h), the target alone (no drafts). A document's prompt
 * is its tokens before the first supervised one (loss_mask 1): the chat template's prompt with the
 * assistant's header; later turns are not kept. The output is a tokenized dataset in the same
 * JSONL form (input_ids = prompt + response, loss_mask 1 on the response, the end token included
 * when one was produced), one line per input document in input order, documents with nothing
 * supervised copied unchanged, so `train --dataset` reads it as it is.
 *
 * Resumable: OUT.meta.json records the input's hash and the settings; a run that finds OUT and a
 * matching meta file keeps OUT's complete batches (the partly written one is cut) and goes on
 * from there. Since batches then hold the same documents as in an uninterrupted run, and each
 * document samples from its own stream (seed + document index), the file ends identical. */
#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_cfg.h"
#include "cm_hash.h"
#include "cm_log.h"
#include "cm_time.h"
#include "ts_cmd.h"
#include "ts_decode.h"
#include "ts_model.h"
#include "ts_split.h"

#define CMD "target-server generate"

static void usage(FILE *f) {
    fprintf(f,
            "usage: target-server generate --model DIR --data IN.jsonl --out OUT.jsonl [options]\n"
            "\n"
            "Regenerates a tokenized dataset's responses with the target: each document's prompt (its\n"
            "tokens before the first supervised one) is answered by the target, and OUT holds prompt +\n"
            "response with the loss mask on the response, ready for `drafter-trainer train --dataset`.\n"
            "Killed, it resumes where it stopped when run again with the same arguments.\n"
            "\n"
            "  --model DIR, --device cpu|cuda, --precision bf16|fp32|fp8, --init, --seed: as dump\n"
            "  --gpu N[,M...], --stages N  a target over N pipeline stages, as dump (default 1)\n"
            "  --data FILE               the tokenized dataset (JSONL, as tools/prepare_data.py writes)\n"
            "  --out FILE                the regenerated dataset (JSONL); FILE.meta.json beside it\n"
            "  --max-new N               response tokens at most (default 512)\n"
            "  --batch N                 documents decoded together (default 16)\n"
            "  --temperature T           0 = greedy (default: the model's generation_config.json)\n"
            "  --top-p P, --top-k K      sampling cuts (default: generation_config.json's)\n"
            "  --sample-seed S           document i samples from stream S + i (default 0)\n"
            "  --limit N                 the first N documents only\n"
            "  --log-level L             debug, info, warn, error, off\n");
}

typedef struct doc {
    int32_t *ids;
    int64_t  n, prompt; /* tokens; prompt = index of the first supervised token, or n when none */
} doc;

typedef struct gen_args {
    ts_target_args t;
    const char    *data, *out, *gpus;
    int            max_new, batch, limit, top_k, stages;
    double         temperature, top_p;
    uint64_t       sample_seed;
    int            have_temp, have_top_p, have_top_k;
} gen_args;

// ---- input

static cm_status read_docs(const char *path, int limit, doc **out, int64_t *n_out, uint64_t *hash) {
    FILE *f = fopen(path, "rb");
    if (!f) return CM_FAIL(CM_ERR_IO, "cannot open --data '%s': %s", path, strerror(errno));
    cm_xxh64_state hs;
    cm_xxh64_init(&hs, 0);
    char     *line = NULL;
    size_t    cap = 0;
    ssize_t   len;
    doc      *docs = NULL;
    int64_t   n = 0, lineno = 0, cap_docs = 0;
    cm_status st = CM_OK;
    while (st == CM_OK && (len = getline(&line, &cap, f)) >= 0 && (limit <= 0 || n < limit)) {
        lineno++;
        cm_xxh64_update(&hs, line, (size_t)len);
        if (strspn(line, " \t\r\n") == (size_t)len) continue;
        cJSON       *j   = cJSON_Parse(line);
        const cJSON *ids = j ? cJSON_GetObjectItemCaseSensitive(j, "input_ids") : NULL;
        const cJSON *msk = j ? cJSON_GetObjectItemCaseSensitive(j, "loss_mask") : NULL;
        if (!cJSON_IsArray(ids) || (msk && !cJSON_IsArray(msk)) ||
            (msk && cJSON_GetArraySize(msk) != cJSON_GetArraySize(ids)) || cJSON_GetArraySize(ids) < 1) {
            st = CM_FAIL(CM_ERR_FORMAT, "'%s' line %lld: expected {\"input_ids\": [...], \"loss_mask\": [...]} of equal "
                                        "lengths (tools/prepare_data.py writes them)",
                         path, (long long)lineno);
        } else {
            if (n == cap_docs) {
                cap_docs = cap_docs ? 2 * cap_docs : 256;
                doc *nd  = realloc(docs, (size_t)cap_docs * sizeof *docs);
                if (!nd) st = CM_FAIL(CM_ERR_NOMEM, "cannot hold %lld documents", (long long)cap_docs);
                else docs = nd;
            }
            if (st == CM_OK) {
                doc *d    = &docs[n++];
                d->n      = cJSON_GetArraySize(ids);
                d->prompt = msk ? d->n : 0;
                d->ids    = malloc((size_t)d->n * 4);
                int64_t k = 0;
                for (const cJSON *e = ids->child; e; e = e->next) d->ids[k++] = (int32_t)e->valuedouble;
                k = 0;
                for (const cJSON *e = msk ? msk->child : NULL; e; e = e->next, k++)
                    if (e->valuedouble != 0 && k < d->prompt) d->prompt = k;
            }
        }
        cJSON_Delete(j);
    }
    free(line);
    fclose(f);
    *out   = docs;
    *n_out = n;
    *hash  = cm_xxh64_digest(&hs);
    return st;
}

// ---- output and resume

static void settings_text(const gen_args *a, const char *weights, char *buf, size_t cap) {
    snprintf(buf, cap, "model=%s;max_new=%d;batch=%d;temperature=%.6g;top_p=%.6g;top_k=%d;sample_seed=%" PRIu64
                       ";limit=%d;device=%s;precision=%d",
             weights, a->max_new, a->batch, a->temperature, a->top_p, a->top_k, a->sample_seed, a->limit,
             a->t.device, a->t.fp8 ? 2 : (int)a->t.mode); /* 0 bf16, 1 fp32 (kn_gemm_mode), 2 fp8 */
}

/* Documents already in OUT (complete batches), OUT cut there; writes the meta file for a new run. */
static cm_status resume_point(const gen_args *a, uint64_t hash, const char *settings, int64_t *done) {
    char meta[4200];
    snprintf(meta, sizeof meta, "%s.meta.json", a->out);
    *done = 0;
    struct stat sb;
    const int   have_out = stat(a->out, &sb) == 0, have_meta = stat(meta, &sb) == 0;
    char        want[2048];
    snprintf(want, sizeof want, "{\"format\": \"tandem-generate\", \"input_hash\": \"%016" PRIx64 "\", \"settings\": \"%s\"}\n",
             hash, settings);
    if (have_out && !have_meta)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--out '%s' exists but '%s' does not: not a generate output; remove it or "
                                           "choose another --out",
                       a->out, meta);
    if (have_meta) {
        char *got = NULL;
        CM_TRY(cm_read_text_file(meta, 1 << 16, &got));
        const int same = strcmp(got, want) == 0;
        free(got);
        if (!same)
            return CM_FAIL(CM_ERR_INVALID_ARG, "'%s' was made from another input or with other settings; remove '%s' "
                                               "and '%s' to start again, or choose another --out",
                           meta, a->out, meta);
    }
    if (have_out) { /* count complete lines, keep whole batches */
        FILE   *f = fopen(a->out, "rb");
        int64_t lines = 0, keep_bytes = 0, pos = 0, batch_end = 0;
        int     c;
        while (f && (c = fgetc(f)) != EOF) {
            pos++;
            if (c == '\n' && ++lines % a->batch == 0) batch_end = pos;
        }
        if (f) fclose(f);
        keep_bytes = batch_end;
        *done      = lines - lines % a->batch;
        if (truncate(a->out, keep_bytes) != 0)
            return CM_FAIL(CM_ERR_IO, "cannot cut '%s' to its complete batches: %s", a->out, strerror(errno));
        if (*done) CM_LOG_INFO("resuming '%s' after %lld documents", a->out, (long long)*done);
        return CM_OK;
    }
    FILE *m = fopen(meta, "w");
    if (!m || fputs(want, m) < 0 || fclose(m) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", meta, strerror(errno));
    return CM_OK;
}

static int write_doc(FILE *f, const int32_t *ids, int64_t n, int64_t prompt) {
    int ok = fputs("{\"input_ids\":[", f) >= 0;
    for (int64_t i = 0; i < n; i++) ok &= fprintf(f, i ? ",%d" : "%d", ids[i]) > 0;
    ok &= fputs("],\"loss_mask\":[", f) >= 0;
    for (int64_t i = 0; i < n; i++) ok &= fputs(i ? (i >= prompt ? ",1" : ",0") : (i >= prompt ? "1" : "0"), f) >= 0;
    return ok && fputs("]}\n", f) >= 0;
}

// ---- decoding one batch

typedef struct gen_run {
    const gen_args *a;
    ts_decoder     *dec;
    cm_gen_cfg      gen;
    float           temp, top_p;
    int             top_k;
    int64_t         tokens; /* generated, for the rate */
} gen_run;

static cm_status step_once(ts_decoder *dec, cm_proto_decode *rq, int32_t (*rows)[4]) {
    cm_proto_tensor t[1];
    cm_proto_answer ans = {.tensors = t, .cap_tensors = 1};
    CM_TRY(ts_decoder_step(dec, "generate", rq, &ans));
    memcpy(rows, t[0].data, (size_t)rq->n_seqs * 16);
    return CM_OK;
}

/* Generates the responses of docs[0 .. n) (each with a prompt) into out[i] (prompt + response). */
static cm_status gen_batch(gen_run *g, const doc *docs, const int64_t *index, int n, int32_t **out, int64_t *out_n) {
    const gen_args      *a    = g->a;
    cm_proto_decode_seq *recs = calloc((size_t)n, sizeof *recs), *sr = calloc((size_t)n, sizeof *sr);
    int32_t (*rows)[4]        = calloc((size_t)n, sizeof *rows);
    int32_t  *len = calloc((size_t)n, 4), *next = calloc((size_t)n, 4), *map = calloc((size_t)n, 4);
    int      *live = calloc((size_t)n, sizeof *live);
    int64_t   T    = 0;
    for (int i = 0; i < n; i++) T += docs[i].prompt;
    int32_t  *toks = malloc((size_t)(T > n ? T : n) * 4);
    cm_status st   = recs && sr && rows && len && next && map && live && toks
                         ? CM_OK
                         : CM_FAIL(CM_ERR_NOMEM, "cannot allocate a batch");
    int64_t off = 0;
    for (int i = 0; st == CM_OK && i < n; i++) {
        recs[i] = (cm_proto_decode_seq){.n_ctx = (uint32_t)docs[i].prompt, .temperature = g->temp, .top_p = g->top_p,
                                        .top_k = (uint32_t)g->top_k, .seed = a->sample_seed + (uint64_t)index[i]};
        memcpy(toks + off, docs[i].ids, (size_t)docs[i].prompt * 4);
        off += docs[i].prompt;
        out[i] = malloc((size_t)(docs[i].prompt + a->max_new) * 4);
        if (!out[i]) st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate a response");
        else memcpy(out[i], docs[i].ids, (size_t)docs[i].prompt * 4);
        out_n[i] = docs[i].prompt;
        live[i]  = 1;
    }
    cm_proto_decode rq = {.id = 1, .op = CM_DECODE_STEP, .encoding = CM_ENCODING_RAW, .n_seqs = (uint32_t)n,
                          .n_tokens = (uint32_t)T, .seqs = recs, .tokens = toks};
    if (st == CM_OK) st = step_once(g->dec, &rq, rows);
    for (int i = 0; st == CM_OK && i < n; i++) {
        recs[i].handle = (uint32_t)rows[i][0];
        len[i]         = rows[i][1];
        next[i]        = rows[i][3];
    }
    for (;;) { /* the target alone: each step takes every live sequence's last token */
        int m = 0;
        for (int i = 0; st == CM_OK && i < n; i++) {
            if (!live[i]) continue;
            const int32_t t    = next[i];
            out[i][out_n[i]++] = t;
            g->tokens++;
            int end = out_n[i] - docs[i].prompt >= a->max_new;
            for (int e = 0; e < g->gen.n_eos; e++) end |= t == g->gen.eos[e];
            if (end) {
                live[i] = 0;
                continue;
            }
            sr[m]       = recs[i];
            sr[m].base  = (uint32_t)len[i];
            sr[m].n_ctx = 1;
            toks[m]     = t;
            map[m++]    = i;
        }
        if (st != CM_OK || !m) break;
        rq.n_seqs   = (uint32_t)m;
        rq.n_tokens = (uint32_t)m;
        rq.seqs     = sr;
        st          = step_once(g->dec, &rq, rows);
        for (int k = 0; st == CM_OK && k < m; k++) {
            len[map[k]]  = rows[k][1];
            next[map[k]] = rows[k][3];
        }
    }
    if (st == CM_OK) { /* close the batch's sequences */
        rq.op       = CM_DECODE_CLOSE;
        rq.n_seqs   = (uint32_t)n;
        rq.n_tokens = 0;
        rq.seqs     = recs;
        for (int i = 0; i < n; i++) recs[i].n_ctx = 0;
        st = step_once(g->dec, &rq, rows);
    }
    free(recs);
    free(sr);
    free(rows);
    free(len);
    free(next);
    free(map);
    free(live);
    free(toks);
    return st;
}

// ---- the command

static cm_status run(gen_args *a) {
    doc      *docs = NULL;
    int64_t   n_docs = 0, done = 0;
    uint64_t  hash = 0;
    kn_ctx   *ctxs[TS_SPLIT_MAX_STAGES] = {0};
    ts_split *model = NULL;
    FILE     *out = NULL;
    gen_run   g = {.a = a};
    const kn_backend *be = NULL;
    cm_status st = read_docs(a->data, a->limit, &docs, &n_docs, &hash);
    if (st == CM_OK) st = cm_gen_cfg_load(&g.gen, a->t.model);
    if (st == CM_OK) st = ts_args_precision(&a->t); /* before the settings: the meta names it */
    g.temp  = a->have_temp ? (float)a->temperature : g.gen.do_sample ? g.gen.temperature : 0.0f;
    g.top_p = a->have_top_p ? (float)a->top_p : g.gen.top_p;
    g.top_k = a->have_top_k ? a->top_k : g.gen.top_k;
    a->temperature = g.temp;
    a->top_p       = g.top_p;
    a->top_k       = g.top_k;
    char settings[1024];
    settings_text(a, a->t.model, settings, sizeof settings);
    if (st == CM_OK) st = resume_point(a, hash, settings, &done);
    if (st == CM_OK) st = kn_backend_get(a->t.device, &be);
    if (st == CM_OK) st = ts_args_stage_ctxs(be, a->gpus, a->stages, a->t.mode, ctxs);
    ts_model_config mc = {.dir = a->t.model, .backend = be, .n_layers = -1, .load_head = 1,
                          .bf16_weights = be != kn_backend_cpu() && a->t.mode == KN_GEMM_MODE_BF16,
                          .fp8 = a->t.fp8, .init_random = a->t.init_random, .seed = a->t.seed};
    if (st == CM_OK) st = ts_split_load(&model, &mc, a->stages, ctxs, NULL);
    int64_t max_prompt = 1;
    for (int64_t i = 0; i < n_docs; i++) max_prompt = docs[i].prompt > max_prompt ? docs[i].prompt : max_prompt;
    ts_decoder_config dc = {.max_seqs = a->batch, .max_len = max_prompt + a->max_new + 1, .max_step = a->batch,
                            .max_forward = 16384, .hidden_dtype = CM_DTYPE_F32, .gen = g.gen};
    if (st == CM_OK) st = ts_decoder_create_split(model, &dc, &g.dec);
    if (st == CM_OK && !(out = fopen(a->out, "ab")))
        st = CM_FAIL(CM_ERR_IO, "cannot write --out '%s': %s", a->out, strerror(errno));
    const double t0 = cm_now_s();
    double       last = t0;
    int32_t    **resp = calloc((size_t)a->batch, sizeof *resp);
    int64_t     *resp_n = calloc((size_t)a->batch, sizeof *resp_n), *index = calloc((size_t)a->batch, sizeof *index);
    doc         *sel = calloc((size_t)a->batch, sizeof *sel);
    if (st == CM_OK && (!resp || !resp_n || !index || !sel)) st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate a batch");
    for (int64_t b0 = done; st == CM_OK && b0 < n_docs; b0 += a->batch) {
        const int64_t b1 = b0 + a->batch < n_docs ? b0 + a->batch : n_docs;
        int           n  = 0;
        for (int64_t i = b0; i < b1; i++)
            if (docs[i].prompt > 0 && docs[i].prompt < docs[i].n) {
                sel[n]     = docs[i];
                index[n++] = i;
            }
        if (n) st = gen_batch(&g, sel, index, n, resp, resp_n);
        for (int64_t i = b0, k = 0; st == CM_OK && i < b1; i++) {
            int ok;
            if (k < n && index[k] == i) { /* regenerated */
                ok = write_doc(out, resp[k], resp_n[k], docs[i].prompt);
                free(resp[k]);
                resp[k++] = NULL;
            } else { /* nothing supervised (or nothing before it): kept as it was */
                ok = write_doc(out, docs[i].ids, docs[i].n, docs[i].prompt);
            }
            if (!ok) st = CM_FAIL(CM_ERR_IO, "cannot write --out '%s': %s", a->out, strerror(errno));
        }
        if (st == CM_OK && fflush(out) != 0) st = CM_FAIL(CM_ERR_IO, "cannot write --out '%s'", a->out);
        const double now = cm_now_s();
        if (now - last > 5 || b1 == n_docs) {
            last = now;
            fprintf(stderr, "generate: %lld/%lld documents, %lld tokens, %.0f tokens/s\n", (long long)b1,
                    (long long)n_docs, (long long)g.tokens, g.tokens / (now - t0 + 1e-9));
        }
    }
    if (out && fclose(out) != 0 && st == CM_OK) st = CM_FAIL(CM_ERR_IO, "cannot write --out '%s'", a->out);
    for (int i = 0; resp && i < a->batch; i++) free(resp[i]);
    free(resp);
    free(resp_n);
    free(index);
    free(sel);
    for (int64_t i = 0; i < n_docs; i++) free(docs[i].ids);
    free(docs);
    ts_decoder_destroy(&g.dec);
    ts_split_destroy(&model);
    if (be) ts_args_stage_ctxs_free(be, ctxs, a->stages);
    return st;
}

int ts_generate_main(int argc, char **argv) {
    gen_args a = {.t = TS_TARGET_ARGS_DEFAULT, .max_new = 512, .batch = 16, .stages = 1};
    cm_args  p;
    cm_args_init(&p, CMD, argc, argv);
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            usage(stdout);
            return 0;
        } else if (ts_args_target(&p, &a.t) || cm_args_str(&p, "--data", &a.data) || cm_args_str(&p, "--out", &a.out) ||
                   cm_args_int(&p, "--max-new", 1, 1 << 20, &a.max_new) ||
                   cm_args_int(&p, "--batch", 1, 4096, &a.batch) || cm_args_int(&p, "--limit", 0, 1 << 30, &a.limit) ||
                   cm_args_u64(&p, "--sample-seed", &a.sample_seed) || cm_args_str(&p, "--gpu", &a.gpus) ||
                   cm_args_int(&p, "--stages", 1, TS_SPLIT_MAX_STAGES, &a.stages))
            ;
        else if (cm_args_f64(&p, "--temperature", 0, 1e3, &a.temperature))
            a.have_temp = 1;
        else if (cm_args_f64(&p, "--top-p", 1e-6, 1, &a.top_p))
            a.have_top_p = 1;
        else if (cm_args_int(&p, "--top-k", 0, 1 << 30, &a.top_k))
            a.have_top_k = 1;
        else
            cm_args_unknown(&p);
    }
    if (p.bad) return 2;
    if (!a.t.model || !a.data || !a.out) {
        fprintf(stderr, CMD ": --model, --data and --out are required (see --help)\n");
        return 2;
    }
    cm_status st = run(&a);
    if (st != CM_OK) {
        fprintf(stderr, CMD ": %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
