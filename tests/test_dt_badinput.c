/* tests/test_dt_badinput.c — bad input to `drafter-trainer grad` ends with exit status 1 and
 * one message naming the problem (usage errors: exit 2), never a crash and never a written
 * output. Each case builds its broken drafter, batch or target in a temporary directory from a
 * committed fixture (tests/fixtures/drafter/) and runs the real binary; the unbroken copies
 * must succeed first, so a failing case is failing for its own reason. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cm_cfg.h"
#include "cm_safetensors.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_proc.h"

static char           tmp[64];
static char           bin[1024];
static char           fixture[1024]; /* tests/fixtures/drafter/<first fixture> */
static cm_drafter_cfg cfg;           /* its drafter config */

/* A replacement of one tensor while copying a safetensors file: dropped, or re-added with
 * another dtype, shape or data (data NULL keeps the original bytes). */
typedef struct tensor_repl {
    const char *name;
    int         drop;
    cm_dtype    dt;
    int         n_dims;
    int64_t     shape[2];
    const void *data;
} tensor_repl;

static void copy_st(const char *src, const char *dst, const tensor_repl *r, int n_r) {
    cm_st        *st = NULL;
    cm_st_writer *w = NULL;
    TST_CHECK(cm_st_open_file(&st, src) == CM_OK);
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    int found = 0;
    for (int i = 0; st && w && i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        const tensor_repl  *m = NULL;
        for (int j = 0; j < n_r; j++)
            if (strcmp(t->name, r[j].name) == 0)
                m = &r[j];
        if (!m) {
            TST_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
            continue;
        }
        found++;
        if (!m->drop)
            TST_CHECK(cm_st_writer_add(w, t->name, m->dt, m->n_dims, m->shape, m->data ? m->data : t->data) ==
                      CM_OK);
    }
    TST_CHECK(found == n_r);
    TST_CHECK(w && cm_st_writer_write(w, dst) == CM_OK);
    cm_st_writer_destroy(&w);
    cm_st_destroy(&st);
}

/* A replacement that keeps the tensor's name and changes what the caller fills in. */
static tensor_repl like(const char *src, const char *name) {
    tensor_repl r = {.name = name};
    cm_st      *st = NULL;
    TST_CHECK(cm_st_open_file(&st, src) == CM_OK);
    const cm_st_tensor *t = st ? cm_st_find(st, name) : NULL;
    TST_CHECK(t != NULL);
    if (t) {
        r.dt = t->dtype;
        r.n_dims = t->n_dims;
        r.shape[0] = t->shape[0];
        r.shape[1] = t->n_dims > 1 ? t->shape[1] : 0;
    }
    cm_st_destroy(&st);
    return r;
}

/* A copy of an I32 vector of the fixture batch (caller frees). */
static int32_t *batch_i32(const char *name, int64_t *n) {
    char path[1200];
    snprintf(path, sizeof path, "%s/batch.safetensors", fixture);
    cm_st *st = NULL;
    TST_CHECK(cm_st_open_file(&st, path) == CM_OK);
    const cm_st_tensor *t = st ? cm_st_find(st, name) : NULL;
    TST_CHECK(t && t->dtype == CM_DTYPE_I32);
    int32_t *v = NULL;
    *n = 0;
    if (t && t->dtype == CM_DTYPE_I32) {
        *n = t->shape[0];
        v = malloc((size_t)*n * sizeof *v);
        memcpy(v, t->data, (size_t)*n * sizeof *v);
    }
    cm_st_destroy(&st);
    return v;
}

// ---- writing drafter directories

static const char *layer_type_name(cm_layer_type t) {
    return t == CM_LAYER_TYPE_SLIDING_ATTENTION ? "sliding_attention" : "full_attention";
}

/* config.json of the serving format, written from the struct (so a case edits a field). */
static void write_config(const char *path, const cm_drafter_cfg *c) {
    FILE *f = fopen(path, "w");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"qwen3\",\n",
            c->kind == CM_DRAFTER_DFLASH2 ? "DFlash2DraftModel" : "DFlashDraftModel");
    fprintf(f, "  \"block_size\": %d,\n  \"num_target_layers\": %d,\n", c->block_size, c->num_target_layers);
    fprintf(f, "  \"dflash_config\": {\"mask_token_id\": %d, \"block_size\": %d, \"target_layer_ids\": [",
            c->mask_token_id, c->block_size);
    for (int i = 0; i < c->n_taps; i++)
        fprintf(f, "%s%d", i ? ", " : "", c->target_layer_ids[i]);
    fprintf(f, "]");
    if (c->kind == CM_DRAFTER_DFLASH2)
        fprintf(f, ", \"conv_kernel_size\": %d, \"conv_group_size\": %d, \"selector_rank\": %d, "
                   "\"selector_top_k\": %d",
                c->conv_kernel_size, c->conv_group_size, c->selector_rank, c->selector_top_k);
    fprintf(f, "},\n");
    fprintf(f, "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n",
            c->hidden_size, c->intermediate_size, c->n_layers);
    fprintf(f, "  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n",
            c->n_heads, c->n_kv_heads, c->head_dim);
    fprintf(f, "  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": %.9g,\n  \"rope_theta\": %.17g,\n",
            (double)c->rms_norm_eps, c->rope_theta);
    fprintf(f, "  \"max_position_embeddings\": %d,\n  \"layer_types\": [", c->max_position_embeddings);
    for (int l = 0; l < c->n_layers; l++)
        fprintf(f, "%s\"%s\"", l ? ", " : "", layer_type_name(c->layer_types[l]));
    fprintf(f, "],\n");
    if (c->sliding_window > 0)
        fprintf(f, "  \"sliding_window\": %d,\n", c->sliding_window);
    fprintf(f, "  \"attention_bias\": %s,\n  \"tie_word_embeddings\": %s,\n  \"vocab_size\": %d\n}\n",
            c->attention_bias ? "true" : "false", c->tie_word_embeddings ? "true" : "false", c->vocab_size);
    fclose(f);
}

static void make_drafter(const char *dir, const cm_drafter_cfg *c,
                         const tensor_repl *r) { /* r: one or NULL */
    char src[1200], path[512];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_config(path, c);
    snprintf(src, sizeof src, "%s/drafter/model.safetensors", fixture);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    copy_st(src, path, r, r ? 1 : 0);
}

static void make_batch(const char *path, const tensor_repl *r, int n_r) {
    char src[1200];
    snprintf(src, sizeof src, "%s/batch.safetensors", fixture);
    copy_st(src, path, r, n_r);
}

/* A flat Qwen3.5 target config (config only: the checks run before any weight is read). */
static void make_target(const char *dir, int hidden, int n_layers, int vocab) {
    mkdir(dir, 0755);
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fprintf(
        f,
        "{\"architectures\": [\"Qwen3_5ForCausalLM\"], \"model_type\": \"qwen3_5_text\", \"hidden_size\": %d,"
        " \"num_hidden_layers\": %d, \"intermediate_size\": 64, \"vocab_size\": %d,"
        " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"rope_theta\": "
        "1000000.0,"
        " \"partial_rotary_factor\": 0.25, \"full_attention_interval\": 2, \"linear_num_key_heads\": 2,"
        " \"linear_num_value_heads\": 4, \"linear_key_head_dim\": 8, \"linear_value_head_dim\": 16,"
        " \"linear_conv_kernel_dim\": 4, \"rms_norm_eps\": 1e-06, \"tie_word_embeddings\": false,"
        " \"hidden_act\": \"silu\"}\n",
        hidden, n_layers, vocab);
    fclose(f);
}

// ---- running

static char good_drafter[256], good_batch[256];

static int run(char **extra, int n_extra, const char *err, const char *out) {
    char *argv[24];
    int   n = 0;
    argv[n++] = bin;
    argv[n++] = "grad";
    for (int i = 0; i < n_extra && n < 22; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    unlink(out);
    return tst_run(argv, err);
}

/* Runs grad with args and expects exit 1, both needles in a one-line message and no output. */
static void expect_fail_args(const char *what, char **args, int n_args, const char *out, const char *n1,
                             const char *n2) {
    char err[256];
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    int         rc = run(args, n_args, err, out);
    const char *msg = tst_slurp(err);
    int         ok = rc == 1 && strstr(msg, "drafter-trainer grad: ") && (!n1 || strstr(msg, n1)) &&
             (!n2 || strstr(msg, n2)) && strchr(msg, '\n') == msg + strlen(msg) - 1;
    TST_CHECK(ok);
    TST_CHECK(access(out, F_OK) != 0); /* nothing half-written */
    printf("%-38s exit %d: %s", what, rc, msg);
    if (!ok)
        fprintf(stderr, "%s: expected exit 1 and one line with '%s' and '%s'\n", what, n1 ? n1 : "",
                n2 ? n2 : "");
}

/* grad on drafter/batch (NULL: the good ones), optionally with --target. */
static void expect_fail(const char *what, const char *drafter, const char *batch, const char *target,
                        const char *n1, const char *n2) {
    char out[256];
    snprintf(out, sizeof out, "%s/out.safetensors", tmp);
    char *args[] = {"--drafter", (char *)(drafter ? drafter : good_drafter),
                    "--batch",   (char *)(batch ? batch : good_batch),
                    "--out",     out,
                    "--target",  (char *)target};
    expect_fail_args(what, args, target ? 8 : 6, out, n1, n2);
}

static void expect_usage(const char *what, char **args, int n_args, const char *needle) {
    char out[256], err[256];
    snprintf(out, sizeof out, "%s/out.safetensors", tmp);
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    int         rc = run(args, n_args, err, out);
    const char *msg = tst_slurp(err);
    TST_CHECK(rc == 2 && strstr(msg, needle));
    printf("%-38s exit %d: %s", what, rc, msg);
}

static int find_fixture(void) {
    char root[1024];
    snprintf(root, sizeof root, "%s/fixtures/drafter", TANDEM_TEST_DATA);
    DIR *d = opendir(root);
    if (!d)
        return 0;
    char           best[256] = "";
    struct dirent *e;
    while ((e = readdir(d))) {
        char probe[2048];
        snprintf(probe, sizeof probe, "%s/%s/batch.safetensors", root, e->d_name);
        if (e->d_name[0] != '.' && access(probe, R_OK) == 0 && (!best[0] || strcmp(e->d_name, best) < 0))
            snprintf(best, sizeof best, "%s", e->d_name);
    }
    closedir(d);
    if (!best[0])
        return 0;
    snprintf(fixture, sizeof fixture, "%.700s/%s", root, best);
    return 1;
}

int main(void) {
    snprintf(bin, sizeof bin, "%s/drafter-trainer/drafter-trainer", TANDEM_BINARY_DIR);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-dtbad-XXXXXX");
    TST_CHECK(mkdtemp(tmp) != NULL);
    TST_CHECK(find_fixture());
    if (!fixture[0])
        return tst_report();
    char path[1200];
    snprintf(path, sizeof path, "%s/drafter", fixture);
    TST_CHECK(cm_drafter_cfg_load(&cfg, path) == CM_OK);
    char src_batch[1200], dir[256], batch[256], target[256];
    snprintf(src_batch, sizeof src_batch, "%s/batch.safetensors", fixture);

    /* the rewritten, unbroken copies run */
    snprintf(good_drafter, sizeof good_drafter, "%s/good-drafter", tmp);
    snprintf(good_batch, sizeof good_batch, "%s/good-batch.safetensors", tmp);
    make_drafter(good_drafter, &cfg, NULL);
    make_batch(good_batch, NULL, 0);
    {
        char out[256], err[256];
        snprintf(out, sizeof out, "%s/out.safetensors", tmp);
        snprintf(err, sizeof err, "%s/err.txt", tmp);
        char *args[] = {"--drafter", good_drafter, "--batch", good_batch, "--out", out};
        int   rc = run(args, 6, err, out);
        TST_CHECK(rc == 0 && access(out, R_OK) == 0);
        printf("%-38s exit %d%s%s", "unbroken copies", rc, rc ? ": " : "\n", rc ? tst_slurp(err) : "");
    }

    // ---- the drafter checkpoint
    cm_drafter_cfg c;
    c = cfg;
    c.block_size = 1;
    snprintf(dir, sizeof dir, "%s/block1", tmp);
    make_drafter(dir, &c, NULL);
    expect_fail("block size 1", dir, NULL, NULL, "block_size 1", "at least 2");

    c = cfg;
    c.target_layer_ids[c.n_taps - 1] = c.num_target_layers;
    snprintf(dir, sizeof dir, "%s/tap-range", tmp);
    make_drafter(dir, &c, NULL);
    expect_fail("tap id >= num_target_layers", dir, NULL, NULL, "target layer id", "num_target_layers");

    c = cfg;
    c.mask_token_id = c.vocab_size;
    snprintf(dir, sizeof dir, "%s/mask-vocab", tmp);
    make_drafter(dir, &c, NULL);
    expect_fail("mask_token_id >= vocab_size", dir, NULL, NULL, "mask_token_id", "vocabulary");

    /* DFlash2: each invalid combination stops at the config with one message naming the field; a
     * valid config whose checkpoint lacks the DFlash2 tensors names the first missing one */
    {
        cm_drafter_cfg c2 = cfg;
        c2.kind = CM_DRAFTER_DFLASH2;
        c2.conv_kernel_size = 2, c2.conv_group_size = 4, c2.selector_rank = 8, c2.selector_top_k = 4;
        const struct {
            const char *what, *n1, *n2;
            int         kc, g, rank, k;
        } bad2[] = {
            {"DFlash2 group size not dividing hidden", "conv_group_size 5", "does not divide hidden_size", 2, 5, 8, 4},
            {"DFlash2 kernel size above block size", "conv_kernel_size", "above block_size", 99, 4, 8, 4},
            {"DFlash2 top-K above vocabulary", "selector_top_k", "above vocab_size", 2, 4, 8, 9999},
            {"DFlash2 selector rank 0", "selector_rank must be at least 1", NULL, 2, 4, 0, 4},
        };
        for (size_t i = 0; i < sizeof bad2 / sizeof bad2[0]; i++) {
            c = c2;
            c.conv_kernel_size = bad2[i].kc, c.conv_group_size = bad2[i].g;
            c.selector_rank = bad2[i].rank, c.selector_top_k = bad2[i].k;
            snprintf(dir, sizeof dir, "%s/dflash2-bad%zu", tmp, i);
            make_drafter(dir, &c, NULL);
            expect_fail(bad2[i].what, dir, NULL, NULL, bad2[i].n1, bad2[i].n2);
        }
        snprintf(dir, sizeof dir, "%s/dflash2-dflash-weights", tmp);
        make_drafter(dir, &c2, NULL);
        expect_fail("DFlash2 config, DFlash weights", dir, NULL, NULL, "layers.0.attention_conv.base_kernel", NULL);
    }

    c = cfg;
    c.attention_bias = 1;
    snprintf(dir, sizeof dir, "%s/bias", tmp);
    make_drafter(dir, &c, NULL);
    expect_fail("attention_bias", dir, NULL, NULL, "attention_bias", NULL);

    {
        tensor_repl r = {.name = "layers.0.self_attn.k_norm.weight", .drop = 1};
        snprintf(dir, sizeof dir, "%s/missing-knorm", tmp);
        make_drafter(dir, &cfg, &r);
        expect_fail("missing drafter tensor", dir, NULL, NULL,
                    "missing tensor 'layers.0.self_attn.k_norm.weight'", NULL);
    }
    {
        char mpath[1200];
        snprintf(mpath, sizeof mpath, "%s/drafter/model.safetensors", fixture);
        tensor_repl r = like(mpath, "fc.weight");
        TST_CHECK(cm_dtype_size(r.dt) == 2);
        r.dt = CM_DTYPE_I16;
        snprintf(dir, sizeof dir, "%s/fc-dtype", tmp);
        make_drafter(dir, &cfg, &r);
        expect_fail("drafter tensor of integer dtype", dir, NULL, NULL, "'fc.weight'", "float dtype");

        r = like(mpath, "layers.1.mlp.up_proj.weight");
        r.shape[0] = r.shape[1];
        r.shape[1] = cfg.intermediate_size; /* transposed: same bytes */
        TST_CHECK(r.shape[0] != r.shape[1]);
        snprintf(dir, sizeof dir, "%s/up-shape", tmp);
        make_drafter(dir, &cfg, &r);
        expect_fail("drafter tensor of the wrong shape", dir, NULL, NULL, "'layers.1.mlp.up_proj.weight'",
                    "shape");
    }

    // ---- the target (--target): hidden size, taps, mask token
    {
        snprintf(target, sizeof target, "%s/../models/tiny-qwen35", TANDEM_TEST_DATA);
        cm_target_cfg tc;
        TST_CHECK(cm_target_cfg_load(&tc, target) == CM_OK);
        TST_CHECK(tc.hidden_size != cfg.hidden_size);
        expect_fail("hidden size != the target's", NULL, NULL, target, "hidden_size", "target");

        int max_tap = 0;
        for (int i = 0; i < cfg.n_taps; i++)
            if (cfg.target_layer_ids[i] > max_tap)
                max_tap = cfg.target_layer_ids[i];
        snprintf(dir, sizeof dir, "%s/target-few-layers", tmp);
        make_target(dir, cfg.hidden_size, max_tap, cfg.vocab_size);
        expect_fail("tap id >= the target's layers", NULL, NULL, dir, "target_layer_ids", "target's layers");

        snprintf(dir, sizeof dir, "%s/target-small-vocab", tmp);
        make_target(dir, cfg.hidden_size, cfg.num_target_layers, cfg.mask_token_id);
        expect_fail("mask_token_id >= the target's vocab", NULL, NULL, dir, "mask_token_id",
                    "target's vocabulary");
    }

    // ---- the batch
    snprintf(batch, sizeof batch, "%s/batch.safetensors", tmp);
    const int64_t D = cfg.hidden_size, V = cfg.vocab_size;
    {
        tensor_repl e = like(src_batch, "embed_tokens");
        float      *wide = calloc((size_t)(V * (D + 8)), sizeof *wide);
        e.dt = CM_DTYPE_F32;
        e.shape[1] = D + 8;
        e.data = wide;
        tensor_repl h = e;
        h.name = "lm_head";
        tensor_repl both[2] = {e, h};
        make_batch(batch, both, 2); /* embed_tokens and lm_head wider than the drafter */
        expect_fail("hidden size != embed_tokens width", NULL, batch, NULL, "hidden_size", "embed_tokens");

        e = like(src_batch, "embed_tokens");
        e.shape[0] = cfg.mask_token_id; /* fewer rows, the same leading bytes */
        h = like(src_batch, "lm_head");
        h.shape[0] = cfg.mask_token_id;
        TST_CHECK(cfg.mask_token_id > 0);
        tensor_repl short_rows[2] = {e, h};
        make_batch(batch, short_rows, 2);
        expect_fail("mask_token_id >= embed_tokens rows", NULL, batch, NULL, "mask_token_id",
                    "target vocabulary");
        free(wide);
    }
    {
        tensor_repl r = like(src_batch, "target_hidden");
        r.shape[1] -= D;
        make_batch(batch, &r, 1);
        expect_fail("target_hidden width != taps x hidden", NULL, batch, NULL, "target_hidden",
                    "taps x hidden");

        r = like(src_batch, "target_hidden");
        r.dt = cm_dtype_size(r.dt) == 2 ? CM_DTYPE_I16 : CM_DTYPE_I32;
        make_batch(batch, &r, 1);
        expect_fail("target_hidden of integer dtype", NULL, batch, NULL, "target_hidden", "BF16 or F32");
    }
    {
        int64_t  n;
        int32_t *a = batch_i32("anchors", &n);
        TST_CHECK(n >= 2);
        if (a && n >= 2) {
            int32_t t = a[0];
            a[0] = a[1];
            a[1] = t;
            tensor_repl r = like(src_batch, "anchors");
            r.data = a;
            make_batch(batch, &r, 1);
            expect_fail("anchors unsorted", NULL, batch, NULL, "anchors are not sorted", NULL);
            a[1] = a[0];
            a[0] = t;
            int64_t T_;
            free(batch_i32("input_ids", &T_));
            a[n - 1] = (int32_t)T_;
            make_batch(batch, &r, 1);
            expect_fail("anchor out of range", NULL, batch, NULL, "anchors[", "outside");
        }
        free(a);
    }
    {
        int64_t  T;
        int32_t *ids = batch_i32("input_ids", &T);
        if (ids) {
            ids[T / 2] = (int32_t)V;
            tensor_repl r = like(src_batch, "input_ids");
            r.data = ids;
            make_batch(batch, &r, 1);
            expect_fail("input id >= vocab", NULL, batch, NULL, "input_ids[", "vocabulary");
            r.dt = CM_DTYPE_F32;
            make_batch(batch, &r, 1);
            expect_fail("input_ids of dtype F32", NULL, batch, NULL, "'input_ids'", "expected I32");
        }
        free(ids);
        int32_t *mask = batch_i32("loss_mask", &T);
        if (mask) {
            mask[1] = 2;
            tensor_repl r = like(src_batch, "loss_mask");
            r.data = mask;
            make_batch(batch, &r, 1);
            expect_fail("loss_mask value 2", NULL, batch, NULL, "loss_mask[1] = 2", "0 or 1");
        }
        free(mask);
        int64_t  n_cu;
        int32_t *cu = batch_i32("cu_seqlens", &n_cu);
        if (cu) {
            cu[n_cu - 1] = cu[n_cu - 1] - 1;
            tensor_repl r = like(src_batch, "cu_seqlens");
            r.data = cu;
            make_batch(batch, &r, 1);
            expect_fail("cu_seqlens short of T", NULL, batch, NULL, "cu_seqlens", "tokens");
        }
        free(cu);
    }
    {
        static const struct {
            const char *name, *n1, *n2;
        } missing[] = {
            {"loss_mask", "no tensor 'loss_mask'", NULL},
            {"anchors", "no tensor 'anchors'", NULL},
            {"target_hidden", "no tensor 'target_hidden'", NULL},
            {"embed_tokens", "no tensor 'embed_tokens'", "--target"},
            {"lm_head", "no tensor 'lm_head'", "--target"},
        };
        for (size_t i = 0; i < sizeof missing / sizeof missing[0]; i++) {
            tensor_repl r = {.name = missing[i].name, .drop = 1};
            make_batch(batch, &r, 1);
            char what[64];
            snprintf(what, sizeof what, "batch without %s", missing[i].name);
            expect_fail(what, NULL, batch, NULL, missing[i].n1, missing[i].n2);
        }
    }

    // ---- the device
    {
        char out[256];
        snprintf(out, sizeof out, "%s/out.safetensors", tmp);
        char *a0[] = {"--drafter", good_drafter, "--batch", good_batch, "--out", out, "--device", "cuda"};
        if (!kn_backend_cuda())
            expect_fail_args("--device cuda without cuda", a0, 8, out, "no cuda backend", NULL);
        char *a1[] = {NULL};
        expect_usage("no options", a1, 0, "required");
        char *a2[] = {"--drafter", good_drafter, "--batch", good_batch, "--out", out, "--frobnicate", "1"};
        expect_usage("unknown option", a2, 8, "unknown option '--frobnicate'");
        char *a3[] = {"--drafter", good_drafter, "--batch", good_batch};
        expect_usage("no --out", a3, 4, "required");
        char *a4[] = {"--drafter", good_drafter,         "--batch", good_batch, "--out",
                      out,         "--loss-decay-gamma", "0"};
        expect_usage("gamma 0", a4, 8, "--loss-decay-gamma");
        char *a5[] = {"--drafter", good_drafter, "--batch", good_batch, "--out", out, "--device", "tpu"};
        expect_usage("unknown device", a5, 8, "--device 'tpu'");
        char *a6[] = {"--drafter", good_drafter, "--batch", good_batch, "--out"};
        expect_usage("option without value", a6, 5, "needs a value");
    }
    TST_CHECK(tst_rmdir(tmp));
    return tst_report();
}
