/* tests/test_dt_dataset.c — tokenized datasets (drafter-trainer/feed/dt_dataset.h): the JSONL and
 * binary forms read the same documents and `dataset convert` round-trips them; packing keeps
 * every pack within the budget, holds every trainable document exactly once, drops the rest,
 * is deterministic and equals an independent first-fit-decreasing; epoch orders are
 * permutations and data-parallel ranks take equal step counts that together cover each epoch;
 * every bad input stops with its one message; and end to end against a real `target-server
 * serve` of models/tiny-qwen35: `train --dataset --shards` from `precompute --dataset` logs the
 * same losses as `train --dataset --server` live, a resumed run matches an uninterrupted one
 * bit for bit, and a resume with another --dp-size is refused. */
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_log.h"
#include "cm_rng.h"
#include "cm_safetensors.h"
#include "dt_data.h"
#include "dt_dataset.h"
#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define N_DOCS 48 /* per file; two files */
#define BUDGET "160"

static char tmp[256], config[512], jsonl_a[512], jsonl_b[512], bin_b[512], dataset[1100];

// ---- processes

static pid_t server = -1;
static char  endpoint[256];

/* Runs argv to completion (stderr into tmp/name.err); its exit status. */
static int run_named(char *const argv[], const char *name) {
    char err[512];
    snprintf(err, sizeof err, "%s/%s.err", tmp, name);
    unlink(err);
    return tst_finish(tst_spawn(argv, err), 120000);
}

static const char *err_of(const char *name) {
    return tst_err_in(tmp, name);
}

// ---- data

/* Writes N_DOCS patterned documents (16–70 tokens; every 7th without any supervised pair)
 * as JSONL; every 5th line leaves loss_mask out (all supervised) and blank lines sit between. */
static int write_jsonl(const char *path, uint64_t seed) {
    int32_t ids[80], mask[80];
    cm_rng  r;
    cm_rng_seed(&r, seed);
    FILE *f = fopen(path, "w");
    if (!f)
        return 0;
    for (int d = 0; d < N_DOCS; d++) {
        int len = 16 + (int)cm_rng_below(&r, 55);
        dtd_doc(&r, ids, mask, len);
        if (d % 7 == 3)
            for (int i = 0; i < len; i++)
                mask[i] = i % 2; /* no two consecutive supervised tokens */
        fprintf(f, "{\"source\": \"test\", \"input_ids\": [");
        for (int i = 0; i < len; i++)
            fprintf(f, "%s%d", i ? ", " : "", ids[i]);
        fprintf(f, "]");
        if (d % 5 != 4) {
            fprintf(f, ", \"loss_mask\": [");
            for (int i = 0; i < len; i++)
                fprintf(f, "%s%d", i ? "," : "", mask[i]);
            fprintf(f, "]");
        }
        fprintf(f, "}\n%s", d % 9 == 0 ? "\n" : "");
    }
    return fclose(f) == 0;
}

static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f)
        return 0;
    fputs(text, f);
    return fclose(f) == 0;
}

// ---- formats

static int docs_equal(const dt_docs *a, const dt_docs *b) {
    return a->n_docs == b->n_docs && a->total == b->total &&
           memcmp(a->ids, b->ids, (size_t)a->total * sizeof *a->ids) == 0 &&
           memcmp(a->mask, b->mask, (size_t)a->total) == 0 &&
           memcmp(a->offsets, b->offsets, (size_t)(a->n_docs + 1) * sizeof *a->offsets) == 0;
}

static void test_formats(void) {
    char *conv[] = {DTD_DT_BIN, "dataset", "convert", jsonl_b, bin_b, NULL};
    TST_CHECK(run_named(conv, "convert") == 0);
    dt_docs j = {0}, b = {0}, again = {0};
    TST_CHECK(dt_docs_read(&j, jsonl_b) == CM_OK);
    TST_CHECK(dt_docs_read(&b, bin_b) == CM_OK);
    TST_CHECK(j.n_docs == N_DOCS && docs_equal(&j, &b));
    /* the JSONL as written: doc 4 (no loss_mask) is all ones, doc 3 alternates */
    TST_CHECK(j.mask[j.offsets[4]] == 1 && j.mask[j.offsets[4] + 1] == 1);
    TST_CHECK(j.mask[j.offsets[3]] == 0 && j.mask[j.offsets[3] + 1] == 1 && j.mask[j.offsets[3] + 2] == 0);
    /* the writer in process, read back */
    char path[600];
    snprintf(path, sizeof path, "%s/again.safetensors", tmp);
    TST_CHECK(dt_docs_write(&b, path) == CM_OK && dt_docs_read(&again, path) == CM_OK &&
              docs_equal(&b, &again));
    dt_docs_release(&j);
    dt_docs_release(&b);
    dt_docs_release(&again);
}

// ---- packing

/* Independent first-fit decreasing over (length, number) pairs: pack of each document. */
static void naive_ffd(const int64_t *len, const int *keep, int n, int64_t budget, int *pack_of,
                      int *n_packs) {
    int     *idx = malloc((size_t)n * sizeof *idx);
    int64_t *room = malloc((size_t)n * sizeof *room);
    for (int i = 0; i < n; i++)
        idx[i] = keep[i];
    for (int i = 1; i < n; i++) /* insertion sort: longest first, then lower number */
        for (int k = i; k > 0 && (len[idx[k]] > len[idx[k - 1]] ||
                                  (len[idx[k]] == len[idx[k - 1]] && idx[k] < idx[k - 1]));
             k--) {
            int t = idx[k];
            idx[k] = idx[k - 1];
            idx[k - 1] = t;
        }
    *n_packs = 0;
    for (int i = 0; i < n; i++) {
        int p = 0;
        while (p < *n_packs && room[p] < len[idx[i]])
            p++;
        if (p == *n_packs)
            room[(*n_packs)++] = budget;
        room[p] -= len[idx[i]];
        pack_of[idx[i]] = p;
    }
    free(idx);
    free(room);
}

static void test_packing(void) {
    const char *paths[2] = {jsonl_a, bin_b};
    dt_dataset *ds = NULL, *ds2 = NULL, *ds3 = NULL;
    TST_CHECK(dt_dataset_open(&ds, paths, 2, 160, 512) == CM_OK);
    TST_CHECK(dt_dataset_open(&ds2, paths, 2, 160, 512) == CM_OK);
    TST_CHECK(dt_dataset_open(&ds3, paths, 2, 200, 512) == CM_OK);
    if (!ds || !ds2 || !ds3)
        goto done;
    TST_CHECK(dt_dataset_hash(ds) == dt_dataset_hash(ds2) && dt_dataset_hash(ds) != dt_dataset_hash(ds3));
    dt_docs a = {0}, b = {0};
    TST_CHECK(dt_docs_read(&a, jsonl_a) == CM_OK && dt_docs_read(&b, bin_b) == CM_OK);
    const int n_all = (int)(a.n_docs + b.n_docs);
    int64_t   len[2 * N_DOCS];
    int       keep[2 * N_DOCS], n_keep = 0, seen[2 * N_DOCS] = {0}, want_pack[2 * N_DOCS], want_np = 0;
    for (int g = 0; g < n_all; g++) {
        const dt_docs *d = g < a.n_docs ? &a : &b;
        int64_t        k = g < a.n_docs ? g : g - a.n_docs, o = d->offsets[k];
        len[g] = d->offsets[k + 1] - o;
        int ok = 0;
        for (int64_t p = o; p + 1 < o + len[g]; p++)
            ok |= d->mask[p] && d->mask[p + 1];
        if (ok)
            keep[n_keep++] = g;
    }
    naive_ffd(len, keep, n_keep, 160, want_pack, &want_np);
    dt_dataset_stats s;
    dt_dataset_get_stats(ds, &s);
    TST_CHECK(s.n_docs == n_all && s.n_dropped == n_all - n_keep && s.n_dropped >= 2 * (N_DOCS / 7));
    TST_CHECK(dt_dataset_n_packs(ds) == want_np && s.n_packs == want_np && want_np > 8);
    static int32_t ids[160], cu[64], mask[160], ids2[160], cu2[64], mask2[160];
    int64_t        docs[64];
    for (int p = 0; p < dt_dataset_n_packs(ds); p++) {
        int64_t T, T2;
        int     N, N2;
        dt_dataset_pack_size(ds, p, &T, &N);
        dt_dataset_pack_size(ds2, p, &T2, &N2);
        TST_CHECK(T <= 160 && T >= 1 && N >= 1 && N < 64 && T == T2 && N == N2);
        if (T > 160 || N >= 64)
            continue;
        dt_dataset_pack(ds, p, ids, cu, mask);
        dt_dataset_pack(ds2, p, ids2, cu2, mask2);
        TST_CHECK(memcmp(ids, ids2, (size_t)T * 4) == 0 && memcmp(cu, cu2, (size_t)(N + 1) * 4) == 0 &&
                  memcmp(mask, mask2, (size_t)T * 4) == 0);
        dt_dataset_pack_docs(ds, p, docs);
        TST_CHECK(cu[0] == 0 && cu[N] == T);
        for (int k = 0; k < N; k++) {
            const int      g = (int)docs[k];
            const dt_docs *d = g < a.n_docs ? &a : &b;
            int64_t        local = g < a.n_docs ? g : g - a.n_docs, o = d->offsets[local];
            TST_CHECK(k == 0 || docs[k] > docs[k - 1]);
            TST_CHECK(want_pack[g] == p && cu[k + 1] - cu[k] == len[g]);
            TST_CHECK(memcmp(ids + cu[k], d->ids + o, (size_t)len[g] * 4) == 0);
            for (int64_t t = 0; t < len[g]; t++)
                TST_CHECK(mask[cu[k] + t] == d->mask[o + t]);
            seen[g]++;
        }
    }
    for (int i = 0; i < n_keep; i++)
        TST_CHECK(seen[keep[i]] == 1);
    int total_seen = 0;
    for (int g = 0; g < n_all; g++)
        total_seen += seen[g];
    TST_CHECK(total_seen == n_keep);

    /* epochs and data parallelism over the packs */
    dt_data *d = NULL;
    TST_CHECK(dt_data_open_dataset(&d, ds, 0, 0, NULL) == CM_OK);
    if (d) {
        const int P = dt_data_count(d);
        int32_t  *order = malloc((size_t)P * sizeof *order), *prev = malloc((size_t)P * sizeof *prev);
        int      *hits = malloc((size_t)P * sizeof *hits);
        TST_CHECK(P == want_np && dt_data_hash(d) == dt_dataset_hash(ds));
        for (uint64_t e = 0; e < 3; e++) {
            dt_data_epoch_order(d, 5, e, order);
            memset(hits, 0, (size_t)P * sizeof *hits);
            for (int i = 0; i < P; i++)
                hits[order[i]]++;
            int perm = 1;
            for (int i = 0; i < P; i++)
                perm &= hits[i] == 1;
            TST_CHECK(perm);
            TST_CHECK(e == 0 || memcmp(order, prev, (size_t)P * sizeof *order) != 0);
            memcpy(prev, order, (size_t)P * sizeof *order);
        }
        const int sizes[] = {1, 2, 3, 4, 7, P + 3};
        for (int si = 0; si < 6; si++) {
            const int W = sizes[si];
            dt_data_epoch_order(d, 5, 1, order);
            memset(hits, 0, (size_t)P * sizeof *hits);
            const int64_t want_steps = (P + W - 1) / W;
            for (int r = 0; r < W; r++) {
                TST_CHECK(dt_data_set_dp(d, r, W) == CM_OK);
                TST_CHECK(dt_data_steps_per_epoch(d) == want_steps);
                for (int64_t k = 0; k < want_steps; k++)
                    hits[dt_data_step_batch(d, order, k)]++;
            }
            int cover = 1, extra = 0;
            for (int i = 0; i < P; i++) {
                cover &= hits[i] >= 1;
                extra += hits[i] - 1;
            }
            TST_CHECK(cover && extra == W * want_steps - P);
            TST_CHECK(W == 1 || dt_data_hash(d) != dt_dataset_hash(ds));
        }
        TST_CHECK(dt_data_set_dp(d, 2, 2) != CM_OK && strstr(cm_last_error(), "--dp-rank") != NULL);
        TST_CHECK(dt_data_set_dp(d, 0, 1) == CM_OK && dt_data_hash(d) == dt_dataset_hash(ds));
        free(order);
        free(prev);
        free(hits);
    }
    dt_data_destroy(&d);
    /* taps without a source */
    TST_CHECK(dt_data_open_dataset(&d, ds, 2, 64, NULL) != CM_OK &&
              strstr(cm_last_error(), "--shards") != NULL);
    dt_docs_release(&a);
    dt_docs_release(&b);
done:
    dt_dataset_destroy(&ds);
    dt_dataset_destroy(&ds2);
    dt_dataset_destroy(&ds3);
}

// ---- bad inputs: one message each

/* `dataset inspect FILE [extra...]` fails with exit 1 and a message holding want. */
static int inspect_fails(const char *file, const char *extra_flag, const char *extra_val, const char *want) {
    char *argv[] = {DTD_DT_BIN,         "dataset",         "inspect", (char *)file,
                    (char *)extra_flag, (char *)extra_val, NULL};
    if (!extra_flag)
        argv[4] = NULL;
    int         rc = run_named(argv, "bad");
    const char *e = err_of("bad");
    int         lines = 0;
    for (const char *p = e; *p; p++)
        lines += *p == '\n';
    if (rc != 1 || !strstr(e, want) || lines != 1) {
        fprintf(stderr, "inspect '%s': exit %d, expected 1 and one line with '%s':\n%s", file, rc, want, e);
        return 0;
    }
    return 1;
}

static int write_bin(const char *path, const int32_t *ids, const uint8_t *mask, int64_t total,
                     const int64_t *off, int64_t n_off, const char *format) {
    cm_st_writer *w = NULL;
    int           ok = cm_st_writer_create(&w) == CM_OK &&
             cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, &total, ids) == CM_OK &&
             cm_st_writer_add(w, "loss_mask", CM_DTYPE_U8, 1, &total, mask) == CM_OK &&
             cm_st_writer_add(w, "doc_offsets", CM_DTYPE_I64, 1, &n_off, off) == CM_OK &&
             cm_st_writer_set_metadata(w, "format", format) == CM_OK &&
             cm_st_writer_set_metadata(w, "version", "1") == CM_OK && cm_st_writer_write(w, path) == CM_OK;
    cm_st_writer_destroy(&w);
    return ok;
}

static void test_bad_inputs(void) {
    char p[600];
    snprintf(p, sizeof p, "%s/missing.jsonl", tmp);
    TST_CHECK(inspect_fails(p, NULL, NULL, "cannot open dataset"));
    snprintf(p, sizeof p, "%s/badjson.jsonl", tmp);
    write_text(p, "{\"input_ids\": [1, 2, 3]}\n\n{\"input_ids\": [1, 2,\n");
    TST_CHECK(inspect_fails(p, NULL, NULL, "line 3: not valid JSON"));
    snprintf(p, sizeof p, "%s/mismatch.jsonl", tmp);
    write_text(p, "{\"input_ids\": [1, 2, 3], \"loss_mask\": [1, 1]}\n");
    TST_CHECK(inspect_fails(p, NULL, NULL, "line 1: \"loss_mask\" has 2 entries but \"input_ids\" has 3"));
    snprintf(p, sizeof p, "%s/badmask.jsonl", tmp);
    write_text(p, "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}\n");
    TST_CHECK(inspect_fails(p, NULL, NULL, "line 2: loss_mask[1] must be 0 or 1"));
    /* a NUL byte: at the start of a line it made the line look blank (a document lost), inside
     * one it cut the line short */
    static const char nul_start[] = "{\"input_ids\": [1, 2, 3]}\n\0{\"input_ids\": [4, 5, 6]}\n";
    static const char nul_inside[] = "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\0, \"x\": 1}\n";
    snprintf(p, sizeof p, "%s/nul-start.jsonl", tmp);
    FILE *nf = fopen(p, "wb");
    TST_CHECK(nf && fwrite(nul_start, 1, sizeof nul_start - 1, nf) == sizeof nul_start - 1);
    if (nf)
        fclose(nf);
    TST_CHECK(inspect_fails(p, NULL, NULL, "line 2: NUL byte at byte 0 of the line"));
    snprintf(p, sizeof p, "%s/nul-inside.jsonl", tmp);
    nf = fopen(p, "wb");
    TST_CHECK(nf && fwrite(nul_inside, 1, sizeof nul_inside - 1, nf) == sizeof nul_inside - 1);
    if (nf)
        fclose(nf);
    TST_CHECK(inspect_fails(p, NULL, NULL, "line 2: NUL byte at byte 21 of the line"));
    snprintf(p, sizeof p, "%s/noids.jsonl", tmp);
    write_text(p, "{\"ids\": [1, 2, 3]}\n");
    TST_CHECK(inspect_fails(p, NULL, NULL, "no \"input_ids\" array"));
    TST_CHECK(inspect_fails(jsonl_a, "--vocab-size", "120", "is outside the vocabulary [0, 120)"));
    snprintf(p, sizeof p, "%s/untrainable.jsonl", tmp);
    write_text(
        p,
        "{\"input_ids\": [1, 2, 3], \"loss_mask\": [1, 0, 1]}\n{\"input_ids\": [4], \"loss_mask\": [1]}\n");
    TST_CHECK(inspect_fails(p, NULL, NULL, "dataset has no trainable tokens"));

    /* longer than the budget: inspect reports it; train stops naming the document and the fix */
    char out[600];
    snprintf(out, sizeof out, "%s/run-long", tmp);
    char *tr[] = {DTD_DT_BIN,       "train", "--config", config, "--target", DTD_MODEL, "--dataset", jsonl_a,
                  "--token-budget", "40",    "--out",    out,    "--shards", tmp,       NULL};
    TST_CHECK(run_named(tr, "long") == 1);
    TST_CHECK(strstr(err_of("long"), "more than --token-budget 40; raise --token-budget") != NULL &&
              strstr(err_of("long"), jsonl_a) != NULL);
    /* a dataset without hidden states, and half a dp pair: usage errors */
    char *nohid[] = {DTD_DT_BIN,  "train", "--config", config, "--target", DTD_MODEL,
                     "--dataset", jsonl_a, "--out",    out,    NULL};
    TST_CHECK(run_named(nohid, "nohid") == 2 && strstr(err_of("nohid"), "--shards") != NULL);
    char *half[] = {DTD_DT_BIN, "train", "--config", config, "--target",  DTD_MODEL, "--dataset", jsonl_a,
                    "--out",    out,     "--shards", tmp,    "--dp-rank", "1",       NULL};
    TST_CHECK(run_named(half, "half") == 2 && strstr(err_of("half"), "--dp-size") != NULL);
    char *both[] = {DTD_DT_BIN, "train", "--config", config, "--target", DTD_MODEL, "--dataset", jsonl_a,
                    "--data",   jsonl_a, "--out",    out,    "--shards", tmp,       NULL};
    TST_CHECK(run_named(both, "both") == 2 && strstr(err_of("both"), "one of --data") != NULL);

    /* binary files: offsets are never trusted */
    int32_t ids[6] = {1, 2, 3, 4, 5, 6};
    uint8_t mask[6] = {1, 1, 1, 1, 1, 1}, bad_mask[6] = {1, 1, 3, 1, 1, 1};
    int64_t ok_off[3] = {0, 2, 6}, back[3] = {0, 4, 2}, short_end[3] = {0, 2, 5}, start[3] = {1, 2, 6};
    snprintf(p, sizeof p, "%s/off-back.safetensors", tmp);
    TST_CHECK(write_bin(p, ids, mask, 6, back, 3, "tandem-tokens"));
    TST_CHECK(inspect_fails(p, NULL, NULL, "doc_offsets runs from 0 to 2 but must run from 0 to 6"));
    int64_t back2[4] = {0, 4, 2, 6};
    TST_CHECK(write_bin(p, ids, mask, 6, back2, 4, "tandem-tokens"));
    TST_CHECK(inspect_fails(p, NULL, NULL, "doc_offsets is not strictly increasing at 2"));
    TST_CHECK(write_bin(p, ids, mask, 6, short_end, 3, "tandem-tokens"));
    TST_CHECK(inspect_fails(p, NULL, NULL, "must run from 0 to 6"));
    TST_CHECK(write_bin(p, ids, mask, 6, start, 3, "tandem-tokens"));
    TST_CHECK(inspect_fails(p, NULL, NULL, "doc_offsets runs from 1"));
    TST_CHECK(write_bin(p, ids, bad_mask, 6, ok_off, 3, "tandem-tokens"));
    TST_CHECK(inspect_fails(p, NULL, NULL, "loss_mask[2] is 3"));
    TST_CHECK(write_bin(p, ids, mask, 6, ok_off, 3, "something-else"));
    TST_CHECK(inspect_fails(p, NULL, NULL, "is not a tandem-tokens file"));
    TST_CHECK(write_bin(p, ids, mask, 6, ok_off, 3, "tandem-tokens"));
    char *ins[] = {DTD_DT_BIN, "dataset", "inspect", p, "--token-budget", "4", NULL};
    TST_CHECK(run_named(ins, "ins") == 0);
    /* truncated file: the reader's own check */
    FILE *f = fopen(p, "r+");
    TST_CHECK(f && ftruncate(fileno(f), 100) == 0);
    if (f)
        fclose(f);
    dt_docs d;
    TST_CHECK(dt_docs_read(&d, p) != CM_OK);
}

// ---- end to end

/* RUN's metrics.jsonl loss|tau|batch texts into out; the line count. */
static int losses(const char *run, char *out, size_t cap) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", tmp, run);
    FILE *f = fopen(path, "r");
    out[0] = '\0';
    if (!f)
        return 0;
    char line[4096];
    int  n = 0;
    while (fgets(line, sizeof line, f)) {
        const char *l = strstr(line, "\"loss\": "), *b = strstr(line, "\"batch\": ");
        if (!l || !b)
            break;
        size_t u = strlen(out);
        snprintf(out + u, cap - u, "%.*s|%.*s\n", (int)strcspn(b + 9, ","), b + 9, (int)strcspn(l + 8, ","),
                 l + 8);
        n++;
    }
    fclose(f);
    return n;
}

/* one more flag and value for train() (NULL: none) */
static const char *train_extra[2];

/* train --dataset ... (--shards SHARDS or --server ENDPOINT) into tmp/run. */
static int train(const char *run, const char *steps, int live, int resume, const char *dp_rank,
                 const char *dp_size) {
    static char out[600], shards[600];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(shards, sizeof shards, "%s/shards", tmp);
    char *argv[40] = {DTD_DT_BIN,    "train",       "--config",       config, "--target",     DTD_MODEL,
                      "--dataset",   dataset,       "--token-budget", BUDGET, "--out",        out,
                      "--steps",     (char *)steps, "--epochs",       "2",    "--seed",       "4",
                      "--lr",        "3e-3",        "--max-anchors",  "16",   "--save-every", "3",
                      "--log-level", "warn"};
    int   n = 26;
    argv[n++] = live ? "--server" : "--shards";
    argv[n++] = live ? endpoint : shards;
    if (live) {
        argv[n++] = "--credits";
        argv[n++] = "2";
        argv[n++] = "--timeout-ms";
        argv[n++] = "60000";
    }
    if (dp_rank) {
        argv[n++] = "--dp-rank";
        argv[n++] = (char *)dp_rank;
        argv[n++] = "--dp-size";
        argv[n++] = (char *)dp_size;
    }
    if (resume)
        argv[n++] = "--resume";
    if (train_extra[0]) {
        argv[n++] = (char *)train_extra[0];
        argv[n++] = (char *)train_extra[1];
    }
    argv[n] = NULL;
    int rc = run_named(argv, run);
    if (rc != 0)
        fprintf(stderr, "train %s: exit %d\n%s", run, rc, err_of(run));
    return rc;
}

static void test_end_to_end(void) {
    static char off[65536], live[65536], res[65536], r1[65536];
    char        shards[600];
    snprintf(shards, sizeof shards, "%s/shards", tmp);
    char *pc[] = {DTD_DT_BIN, "precompute",     "--server",  endpoint,   "--dataset",
                  dataset,    "--token-budget", BUDGET,      "--layers", "1,3",
                  "--out",    shards,           "--credits", "2",        "--timeout-ms",
                  "60000",    "--log-level",    "warn",      NULL};
    TST_CHECK(run_named(pc, "precompute") == 0);
    if (strlen(err_of("precompute")))
        fprintf(stderr, "precompute: %s", err_of("precompute"));

    const char *paths[2] = {jsonl_a, bin_b};
    dt_dataset *ds = NULL;
    TST_CHECK(dt_dataset_open(&ds, paths, 2, atoi(BUDGET), 512) == CM_OK);
    const int P = ds ? dt_dataset_n_packs(ds) : 0;
    dt_dataset_destroy(&ds);
    char all[16];
    snprintf(all, sizeof all, "%d", 2 * P); /* two epochs */
    fprintf(stderr, "end to end: %d packs of at most %s tokens\n", P, BUDGET);

    TST_CHECK(train("offline", all, 0, 0, NULL, NULL) == 0);
    TST_CHECK(train("live", all, 1, 0, NULL, NULL) == 0);
    int n_off = losses("offline", off, sizeof off), n_live = losses("live", live, sizeof live);
    TST_CHECK(n_off == 2 * P && n_live == 2 * P && strcmp(off, live) == 0);
    if (strcmp(off, live) != 0)
        fprintf(stderr, "offline:\n%s\nlive:\n%s\n", off, live);

    /* the shards run loaded each next batch on a thread (--prefetch 1, the default); loading
     * between the steps gives the same losses; a bad value is refused */
    static char noprefetch[65536];
    train_extra[0] = "--prefetch";
    train_extra[1] = "0";
    TST_CHECK(train("noprefetch", all, 0, 0, NULL, NULL) == 0);
    TST_CHECK(losses("noprefetch", noprefetch, sizeof noprefetch) == 2 * P && strcmp(noprefetch, off) == 0);
    train_extra[1] = "2";
    TST_CHECK(train("badprefetch", all, 0, 0, NULL, NULL) == 2 &&
              strstr(err_of("badprefetch"), "--prefetch 2: expected 0 (off) or 1 (on)") != NULL);
    train_extra[0] = NULL;

    /* stopped after 5 steps (a checkpoint at 3, one at the stop) and resumed */
    TST_CHECK(train("resume", "5", 0, 0, NULL, NULL) == 0);
    TST_CHECK(train("resume", all, 0, 1, NULL, NULL) == 0);
    TST_CHECK(losses("resume", res, sizeof res) == 2 * P && strcmp(res, off) == 0);

    /* dp: rank 1 of 2 runs ceil(P / 2) steps per epoch; a resume with another size is refused */
    char half[16];
    snprintf(half, sizeof half, "%d", 2 * ((P + 1) / 2));
    TST_CHECK(train("dp1", "2", 0, 0, "1", "2") == 0);
    TST_CHECK(train("dp1", half, 0, 1, "1", "2") == 0);
    TST_CHECK(losses("dp1", r1, sizeof r1) == 2 * ((P + 1) / 2));
    char out[600];
    snprintf(out, sizeof out, "%s/dp1", tmp);
    char *again[] = {DTD_DT_BIN,
                     "train",
                     "--target",
                     DTD_MODEL,
                     "--dataset",
                     dataset,
                     "--token-budget",
                     BUDGET,
                     "--out",
                     out,
                     "--shards",
                     shards,
                     "--epochs",
                     "2",
                     "--seed",
                     "4",
                     "--lr",
                     "3e-3",
                     "--max-anchors",
                     "16",
                     "--resume",
                     "--dp-rank",
                     "0",
                     "--dp-size",
                     "3",
                     NULL};
    TST_CHECK(run_named(again, "dp-other") == 1 &&
              strstr(err_of("dp-other"), "was trained with data-parallel size 2 but this run has 3") != NULL);
    char budget_other[600];
    snprintf(budget_other, sizeof budget_other, "%s/resume", tmp);
    char *other[] = {DTD_DT_BIN,       "train", "--target", DTD_MODEL,    "--dataset", dataset,
                     "--token-budget", "200",   "--out",    budget_other, "--shards",  shards,
                     "--epochs",       "2",     "--seed",   "4",          "--lr",      "3e-3",
                     "--max-anchors",  "16",    "--resume", NULL};
    TST_CHECK(run_named(other, "budget-other") == 1 &&
              strstr(err_of("budget-other"), "the dataset or its packing differs") != NULL);
    /* the environment's RANK and WORLD_SIZE act as --dp-rank and --dp-size */
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    static char r2[65536];
    TST_CHECK(train("dp-env", half, 0, 0, NULL, NULL) == 0);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    TST_CHECK(losses("dp-env", r2, sizeof r2) == 2 * ((P + 1) / 2) && strcmp(r1, r2) == 0);
}

int main(void) {
    (void)dtd_make_batches; /* the shared fixture header's batch files are not used here */
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    setenv("OMP_NUM_THREADS", "1", 1);
    unsetenv("RANK");
    unsetenv("WORLD_SIZE");
    snprintf(tmp, sizeof tmp, "/tmp/tandem-dataset-%d", (int)getpid());
    mkdir(tmp, 0700);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    snprintf(jsonl_a, sizeof jsonl_a, "%s/a.jsonl", tmp);
    snprintf(jsonl_b, sizeof jsonl_b, "%s/b.jsonl", tmp);
    snprintf(bin_b, sizeof bin_b, "%s/b.safetensors", tmp);
    snprintf(dataset, sizeof dataset, "%s,%s", jsonl_a, bin_b);
    if (!dtd_write_config(config, 1) || !write_jsonl(jsonl_a, 1) || !write_jsonl(jsonl_b, 2)) {
        TST_CHECK(0);
        return tst_report();
    }
    test_formats();
    test_packing();
    test_bad_inputs();
    server = dtd_serve(DTD_MODEL, "tcp://127.0.0.1:*", tmp, "serve", NULL, endpoint, sizeof endpoint);
    if (server > 0) {
        test_end_to_end();
        tst_stop(&server);
    } else
        TST_CHECK(0);
    return tst_cleanup(tmp, tst_report());
}
