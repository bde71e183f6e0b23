/* tests/test_ts_badinput.c — bad input to `target-server dump` ends with exit status 1 and
 * one message naming the problem, never a crash. Each case builds its broken model or batch
 * in a temporary directory from a committed fixture and runs the real binary. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cm_cfg.h"
#include "cm_safetensors.h"
#include "tst.h"
#include "tst_proc.h"

static char tmp[64];
static char bin[1024];
static char single_model[1024]; /* a fixture model with one model.safetensors */
static char sharded_model[1024];/* a fixture model with model.safetensors.index.json */
static char good_input[1024];

static int copy_file(const char *src, const char *dst) {
    FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
    int   ok = in && out;
    char  buf[1 << 16];
    size_t n;
    while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, out) == n;
    if (in) fclose(in);
    if (out) fclose(out);
    return ok;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* Copies a model directory's config and shards (listed by name) into dst. */
static void copy_dir_files(const char *src, const char *dst, const char *const *files) {
    mkdir(dst, 0755);
    for (int i = 0; files[i]; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s/%s", src, files[i]);
        snprintf(b, sizeof b, "%s/%s", dst, files[i]);
        TST_CHECK(copy_file(a, b));
    }
}

/* Rewrites single_model into dst with one tensor dropped, reshaped or retyped. */
typedef enum mutation { MUT_DROP, MUT_SHAPE, MUT_DTYPE } mutation;

static void mutated_model(const char *dst, const char *victim, mutation mut) {
    static const char *const cfg[] = {"config.json", NULL};
    copy_dir_files(single_model, dst, cfg);
    char path[1200];
    snprintf(path, sizeof path, "%s/model.safetensors", single_model);
    cm_st        *st = NULL;
    cm_st_writer *w  = NULL;
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK);
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    if (!st || !w) goto done;
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        if (strcmp(t->name, victim) != 0) {
            TST_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
        } else if (mut == MUT_SHAPE) { /* same bytes, one row fewer and a wider last axis */
            int64_t shape[CM_ST_MAX_DIMS];
            memcpy(shape, t->shape, sizeof shape);
            int64_t numel = 1;
            for (int d = 0; d < t->n_dims; d++) numel *= t->shape[d];
            shape[0] = 1;
            for (int d = 1; d < t->n_dims; d++) shape[d] = 1;
            shape[t->n_dims - 1] = numel;
            TST_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, shape, t->data) == CM_OK);
        } else if (mut == MUT_DTYPE) { /* same size in bytes, integer dtype */
            TST_CHECK(cm_dtype_size(t->dtype) == 2 || cm_dtype_size(t->dtype) == 4);
            cm_dtype dt = cm_dtype_size(t->dtype) == 2 ? CM_DTYPE_I16 : CM_DTYPE_I32;
            TST_CHECK(cm_st_writer_add(w, t->name, dt, t->n_dims, t->shape, t->data) == CM_OK);
        }
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dst);
    TST_CHECK(cm_st_writer_write(w, path) == CM_OK);
done:
    cm_st_writer_destroy(&w);
    cm_st_destroy(&st);
}

static void write_input(const char *path, const int32_t *ids, int64_t T, const int32_t *cu, int64_t n_cu) {
    cm_st_writer *w = NULL;
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    TST_CHECK(cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, &T, ids) == CM_OK);
    TST_CHECK(cm_st_writer_add(w, "cu_seqlens", CM_DTYPE_I32, 1, &n_cu, cu) == CM_OK);
    TST_CHECK(cm_st_writer_write(w, path) == CM_OK);
    cm_st_writer_destroy(&w);
}

/* Runs dump and expects exit 1 and every needle in its stderr. */
static void expect_fail(const char *what, const char *model, const char *input, const char *n1, const char *n2) {
    char out[512], err[512];
    snprintf(out, sizeof out, "%s/out.safetensors", tmp);
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    char *argv[] = {bin, "dump", "--model", (char *)model, "--input", (char *)input, "--out", out, NULL};
    int   rc     = tst_run(argv, err);
    const char *msg = tst_slurp(err);
    int ok = rc == 1 && strstr(msg, "target-server dump: ") && (!n1 || strstr(msg, n1)) && (!n2 || strstr(msg, n2));
    TST_CHECK(ok);
    TST_CHECK(access(out, F_OK) != 0); /* nothing half-written */
    printf("%-32s exit %d: %s", what, rc, msg);
    if (!ok) fprintf(stderr, "%s: expected exit 1 with '%s' and '%s'\n", what, n1 ? n1 : "", n2 ? n2 : "");
}

static int find_fixtures(void) {
    FILE *p;
    char  cmd[1200];
    snprintf(cmd, sizeof cmd, "ls -d %s/fixtures/target/*/model 2>/dev/null", TANDEM_TEST_DATA);
    if (!(p = popen(cmd, "r"))) return 0;
    char line[1024];
    while (fgets(line, sizeof line, p)) {
        line[strcspn(line, "\n")] = '\0';
        char probe[1200];
        snprintf(probe, sizeof probe, "%s/model.safetensors.index.json", line);
        if (!sharded_model[0] && access(probe, R_OK) == 0) snprintf(sharded_model, sizeof sharded_model, "%s", line);
        snprintf(probe, sizeof probe, "%s/model.safetensors", line);
        if (!single_model[0] && access(probe, R_OK) == 0) {
            snprintf(single_model, sizeof single_model, "%s", line);
            snprintf(good_input, sizeof good_input, "%.*s/input.safetensors", (int)(strlen(line) - 6), line);
        }
    }
    pclose(p);
    return single_model[0] && sharded_model[0];
}

int main(void) {
    snprintf(bin, sizeof bin, "%s/target-server/target-server", TANDEM_BINARY_DIR);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-bad-XXXXXX");
    TST_CHECK(mkdtemp(tmp) != NULL);
    TST_CHECK(find_fixtures());
    if (!single_model[0] || !sharded_model[0]) return tst_report();
    cm_target_cfg cfg;
    TST_CHECK(cm_target_cfg_load(&cfg, single_model) == CM_OK);
    char dir[256], path[2048], input[256];

    /* sharded checkpoints: a missing shard, a truncated shard */
    {
        char idx[1200];
        snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", sharded_model);
        char *text = NULL;
        TST_CHECK(cm_read_text_file(idx, 1 << 20, &text) == CM_OK);
        const char *shard = text ? strstr(text, "model-0000") : NULL;
        TST_CHECK(shard != NULL);
        char shard_name[64] = "";
        if (shard) snprintf(shard_name, sizeof shard_name, "%.*s", (int)strcspn(shard, "\""), shard);
        free(text);
        const char *files[] = {"config.json", "model.safetensors.index.json", NULL};
        snprintf(dir, sizeof dir, "%s/missing-shard", tmp);
        copy_dir_files(sharded_model, dir, files);
        /* the other shards are copied, the named one is not */
        char ls[4096];
        snprintf(ls, sizeof ls, "cd '%s' && for f in model-*.safetensors; do [ \"$f\" = '%s' ] || cp \"$f\" '%s/'; done",
                 sharded_model, shard_name, dir);
        TST_CHECK(system(ls) == 0);
        expect_fail("missing shard", dir, good_input, shard_name, "No such file");

        snprintf(dir, sizeof dir, "%s/truncated-shard", tmp);
        snprintf(ls, sizeof ls, "mkdir -p '%s' && cp '%s'/config.json '%s'/*.safetensors* '%s/' && truncate -s -100 '%s/%s'",
                 dir, sharded_model, sharded_model, dir, dir, shard_name);
        TST_CHECK(system(ls) == 0);
        expect_fail("truncated shard", dir, good_input, shard_name, "truncated");
    }

    /* a header length beyond the file */
    {
        const char *files[] = {"config.json", NULL};
        snprintf(dir, sizeof dir, "%s/header-length", tmp);
        copy_dir_files(single_model, dir, files);
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        FILE         *f   = fopen(path, "wb");
        unsigned char hdr[8 + 16] = {0x00, 0x10, 0, 0, 0, 0, 0, 0, '{', '}'};
        if (f) {
            fwrite(hdr, 1, sizeof hdr, f);
            fclose(f);
        }
        expect_fail("header length beyond the file", dir, good_input, "model.safetensors", "header length");
    }

    /* tensor offsets outside the data area */
    {
        const char *files[] = {"config.json", NULL};
        snprintf(dir, sizeof dir, "%s/offsets", tmp);
        copy_dir_files(single_model, dir, files);
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        const char *json = "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,32]}}";
        uint64_t    n    = strlen(json);
        FILE       *f    = fopen(path, "wb");
        if (f) {
            fwrite(&n, 8, 1, f);
            fwrite(json, 1, n, f);
            fwrite("0123456789abcdef", 1, 16, f);
            fclose(f);
        }
        expect_fail("offsets outside the data", dir, good_input, "'a'", "outside");
    }

    /* wrong shape, wrong dtype, missing tensor */
    char victim[256];
    const char *prefix = "model.language_model.";
    snprintf(path, sizeof path, "%s/model.safetensors", single_model);
    {
        cm_st *st = NULL;
        TST_CHECK(cm_st_open_file(&st, path) == CM_OK);
        if (st && !cm_st_find(st, "model.language_model.embed_tokens.weight")) prefix = "model.";
        cm_st_destroy(&st);
    }
    snprintf(victim, sizeof victim, "%slayers.1.mlp.up_proj.weight", prefix);
    snprintf(dir, sizeof dir, "%s/wrong-shape", tmp);
    mutated_model(dir, victim, MUT_SHAPE);
    expect_fail("wrong shape", dir, good_input, victim, "shape");
    snprintf(victim, sizeof victim, "%slayers.0.input_layernorm.weight", prefix);
    snprintf(dir, sizeof dir, "%s/wrong-dtype", tmp);
    mutated_model(dir, victim, MUT_DTYPE);
    expect_fail("wrong dtype", dir, good_input, victim, "dtype");
    snprintf(victim, sizeof victim, "%slayers.1.post_attention_layernorm.weight", prefix);
    snprintf(dir, sizeof dir, "%s/missing-tensor", tmp);
    mutated_model(dir, victim, MUT_DROP);
    expect_fail("missing tensor", dir, good_input, victim, "missing");

    /* unknown model_type */
    snprintf(dir, sizeof dir, "%s/model-type", tmp);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, "{\"model_type\": \"llama\", \"hidden_size\": 64}");
    expect_fail("unknown model_type", dir, good_input, "llama", "model_type");

    /* batches: token id >= vocab, cu_seqlens not increasing, not ending at T, wrong dtype */
    int32_t ids[6] = {1, 2, 3, 4, 5, 6};
    int32_t cu_ok[3] = {0, 2, 6}, cu_dec[3] = {0, 4, 3}, cu_short[3] = {0, 2, 5};
    snprintf(input, sizeof input, "%s/ids.safetensors", tmp);
    ids[4] = cfg.vocab_size;
    write_input(input, ids, 6, cu_ok, 3);
    expect_fail("token id >= vocab", single_model, input, "input_ids[4]", "vocab_size");
    ids[4] = 5;
    write_input(input, ids, 6, cu_dec, 3);
    expect_fail("cu_seqlens not increasing", single_model, input, "cu_seqlens", "increasing");
    write_input(input, ids, 6, cu_short, 3);
    expect_fail("cu_seqlens not ending at T", single_model, input, "cu_seqlens", "token count");
    {
        cm_st_writer *w  = NULL;
        float         fi[6] = {1, 2, 3, 4, 5, 6};
        int64_t       T = 6, n_cu = 3;
        TST_CHECK(cm_st_writer_create(&w) == CM_OK);
        TST_CHECK(cm_st_writer_add(w, "input_ids", CM_DTYPE_F32, 1, &T, fi) == CM_OK);
        TST_CHECK(cm_st_writer_add(w, "cu_seqlens", CM_DTYPE_I32, 1, &n_cu, cu_ok) == CM_OK);
        TST_CHECK(cm_st_writer_write(w, input) == CM_OK);
        cm_st_writer_destroy(&w);
        expect_fail("input_ids of dtype F32", single_model, input, "input_ids", "I32");
    }
    TST_CHECK(tst_rmdir(tmp));
    return tst_report();
}
