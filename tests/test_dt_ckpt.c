/* tests/test_dt_ckpt.c — training checkpoints of `drafter-trainer train` (dt_ckpt.h) against
 * the DFlash serving format: config.json keys and values (and its round trip through
 * cm_drafter_cfg), model.safetensors names, shapes, BF16 dtype and values (= bf16 of the fp32
 * masters), no embed_tokens/lm_head; the training state's tensors and metadata; atomicity (no
 * .tmp left, a leftover step-N.tmp or stale step-N from a crash is ignored and replaced, and
 * the recovered run ends bit-identical to a straight one); resume refusals (other lr, seed,
 * data, config; existing run without --resume; nothing to resume; a corrupt latest); bad
 * batch files refused with a message; --init-from a saved checkpoint. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_cfg.h"
#include "dt_ckpt.h"
#include "dt_train_data.h"
#include "tst.h"

static char tmp[256], config[512], config1[512], csv[8192];
static char batch[3][512];

/* Runs drafter-trainer train with the common flags, then extra (NULL-terminated). */
static int train(const char *out, const char *errname, const char *data, const char *cfg,
                 const char *const *extra) {
    char o[512], err[512];
    snprintf(o, sizeof o, "%s/%s", tmp, out);
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    const char *argv[48] = {DTD_DT_BIN, "train", "--target",      DTD_MODEL, "--data",      data,
                            "--out",    o,       "--epochs",      "2",       "--seed",      "3",
                            "--lr",     "3e-3",  "--max-anchors", "8",       "--log-level", "warn"};
    int         n = 18;
    if (cfg) {
        argv[n++] = "--config";
        argv[n++] = cfg;
    }
    for (int i = 0; extra && extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    return tst_run((char *const *)argv, err);
}

static const char *err_text(const char *errname) {
    return tst_err_in(tmp, errname);
}

static void expect_refused(const char *what, int rc, const char *errname, const char *needle) {
    const char *e = err_text(errname);
    int         ok = rc == 1 && strstr(e, needle) != NULL && strstr(e, "AddressSanitizer") == NULL;
    if (!ok)
        fprintf(stderr, "%s: exit %d, expected 1 with '%s'; stderr: %s\n", what, rc, needle, e);
    TST_CHECK(ok);
}

static char *read_text(const char *path) {
    char *t = NULL;
    if (cm_read_text_file(path, 1 << 20, &t) != CM_OK)
        return NULL;
    return t;
}

static int count_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int            n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strstr(e->d_name, ".tmp") != NULL;
    closedir(d);
    return n;
}

static int same_file(const char *a, const char *b) {
    char *cmd = malloc(4096);
    snprintf(cmd, 4096, "cmp -s '%s' '%s'", a, b);
    int same = system(cmd) == 0;
    free(cmd);
    return same;
}

// ---- format

static int json_int(const cJSON *o, const char *k, int want) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) && v->valuedouble == want;
}

static int json_str(const cJSON *o, const char *k, const char *want) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) && strcmp(v->valuestring, want) == 0;
}

static void check_config(const char *dir) {
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char  *text = read_text(path);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    TST_CHECK(j != NULL);
    if (j) {
        const cJSON *arch = cJSON_GetObjectItemCaseSensitive(j, "architectures");
        TST_CHECK(cJSON_IsArray(arch) && cJSON_GetArraySize(arch) == 1 &&
                  strcmp(cJSON_GetArrayItem(arch, 0)->valuestring, "DFlashDraftModel") == 0);
        TST_CHECK(json_str(j, "model_type", "qwen3"));
        TST_CHECK(json_str(j, "dtype", "bfloat16"));
        TST_CHECK(json_str(j, "hidden_act", "silu"));
        TST_CHECK(json_int(j, "block_size", 8));
        TST_CHECK(json_int(j, "num_target_layers", 6));
        TST_CHECK(json_int(j, "hidden_size", 64) && json_int(j, "intermediate_size", 128));
        TST_CHECK(json_int(j, "num_hidden_layers", 2) && json_int(j, "num_attention_heads", 4));
        TST_CHECK(json_int(j, "num_key_value_heads", 2) && json_int(j, "head_dim", 16));
        TST_CHECK(json_int(j, "vocab_size", 512) && json_int(j, "max_position_embeddings", 4096));
        TST_CHECK(json_int(j, "sliding_window", 16));
        TST_CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "use_sliding_window")));
        TST_CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(j, "tie_word_embeddings")));
        TST_CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(j, "attention_bias")));
        TST_CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(j, "rope_scaling")));
        const cJSON *eps = cJSON_GetObjectItemCaseSensitive(j, "rms_norm_eps");
        TST_CHECK(cJSON_IsNumber(eps) && eps->valuedouble == 1e-6);
        TST_CHECK(strstr(text, "\"rms_norm_eps\": 1e-06,") != NULL); /* shortest form, not 9.99999997e-07 */
        TST_CHECK(json_int(j, "rope_theta", 10000));
        const cJSON *lt = cJSON_GetObjectItemCaseSensitive(j, "layer_types");
        TST_CHECK(cJSON_IsArray(lt) && cJSON_GetArraySize(lt) == 2 &&
                  strcmp(cJSON_GetArrayItem(lt, 0)->valuestring, "sliding_attention") == 0 &&
                  strcmp(cJSON_GetArrayItem(lt, 1)->valuestring, "full_attention") == 0);
        const cJSON *dc = cJSON_GetObjectItemCaseSensitive(j, "dflash_config");
        TST_CHECK(cJSON_IsObject(dc) && json_int(dc, "mask_token_id", 511) && json_int(dc, "block_size", 8));
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(dc, "target_layer_ids");
        TST_CHECK(cJSON_IsArray(ids) && cJSON_GetArraySize(ids) == 2 &&
                  cJSON_GetArrayItem(ids, 0)->valuedouble == DTD_TAP_A &&
                  cJSON_GetArrayItem(ids, 1)->valuedouble == DTD_TAP_B);
    }
    cJSON_Delete(j);
    free(text);

    /* it parses back to the config the run started from */
    cm_drafter_cfg a, b;
    char          *ta = NULL, *tb = NULL;
    TST_CHECK(cm_drafter_cfg_load(&a, path) == CM_OK && cm_drafter_cfg_load(&b, config) == CM_OK);
    TST_CHECK(dt_ckpt_config_json(&a, &ta) == CM_OK && dt_ckpt_config_json(&b, &tb) == CM_OK);
    TST_CHECK(ta && tb && strcmp(ta, tb) == 0);
    /* is_causal: absent stays absent (the loaders derive it from layer_types as we do); given, it is
     * written and parses back to the same per-layer causality */
    TST_CHECK(ta && !strstr(ta, "is_causal"));
    for (int v = 0; v < 2; v++) {
        cm_drafter_cfg c = a, back;
        char          *tc = NULL;
        c.is_causal = v ? CM_CAUSAL_ALL : CM_CAUSAL_NONE;
        TST_CHECK(dt_ckpt_config_json(&c, &tc) == CM_OK && tc &&
                  strstr(tc, v ? "\"is_causal\": true" : "\"is_causal\": false"));
        TST_CHECK(tc && cm_drafter_cfg_parse(&back, tc, "written config") == CM_OK &&
                  back.is_causal == c.is_causal);
        for (int l = 0; tc && l < back.n_layers; l++)
            TST_CHECK(cm_drafter_layer_causal(&back, l) == v);
        free(tc);
    }
    free(ta);
    free(tb);
}

/* The serving keys of the tiny drafter (docs/drafter.md), in parameter order. */
static int expected_keys(char names[][64], int64_t shapes[][2], int *nd) {
    int n = 0;
#define KEY(nm, d, s0, s1)                                                                                   \
    do {                                                                                                     \
        snprintf(names[n], 64, "%s", nm);                                                                    \
        nd[n] = d;                                                                                           \
        shapes[n][0] = s0;                                                                                   \
        shapes[n][1] = s1;                                                                                   \
        n++;                                                                                                 \
    } while (0)
    KEY("fc.weight", 2, 64, 128);
    KEY("hidden_norm.weight", 1, 64, 0);
    KEY("norm.weight", 1, 64, 0);
    for (int l = 0; l < 2; l++) {
        char k[64];
#define LKEY(sfx, d, s0, s1)                                                                                 \
    do {                                                                                                     \
        snprintf(k, sizeof k, "layers.%d.%s", l, sfx);                                                       \
        KEY(k, d, s0, s1);                                                                                   \
    } while (0)
        LKEY("input_layernorm.weight", 1, 64, 0);
        LKEY("post_attention_layernorm.weight", 1, 64, 0);
        LKEY("self_attn.q_proj.weight", 2, 64, 64);
        LKEY("self_attn.k_proj.weight", 2, 32, 64);
        LKEY("self_attn.v_proj.weight", 2, 32, 64);
        LKEY("self_attn.o_proj.weight", 2, 64, 64);
        LKEY("self_attn.q_norm.weight", 1, 16, 0);
        LKEY("self_attn.k_norm.weight", 1, 16, 0);
        LKEY("mlp.gate_proj.weight", 2, 128, 64);
        LKEY("mlp.up_proj.weight", 2, 128, 64);
        LKEY("mlp.down_proj.weight", 2, 64, 128);
    }
    return n;
}

static void check_tensors(const char *dir, int64_t step, int64_t epoch, int64_t index) {
    static char names[64][64];
    int64_t     shapes[64][2];
    int         nd[64];
    const int   n = expected_keys(names, shapes, nd);
    char        path[700];
    cm_st      *model = NULL, *state = NULL;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    TST_CHECK(cm_st_open_file(&model, path) == CM_OK);
    snprintf(path, sizeof path, "%s/training_state.safetensors", dir);
    TST_CHECK(cm_st_open_file(&state, path) == CM_OK);
    if (!model || !state)
        goto done;

    TST_CHECK(cm_st_count(model) == n);
    for (int i = 0; i < cm_st_count(model); i++) {
        const char *k = cm_st_at(model, i)->name;
        TST_CHECK(strstr(k, "embed_tokens") == NULL && strstr(k, "lm_head") == NULL);
    }
    TST_CHECK(cm_st_metadata(model, "format") && strcmp(cm_st_metadata(model, "format"), "pt") == 0);
    int bf16_ok = 1, shapes_ok = 1;
    for (int i = 0; i < n; i++) {
        const cm_st_tensor *t = NULL, *m = NULL, *am = NULL, *av = NULL;
        char                k[160];
        shapes_ok &= cm_st_expect(model, names[i], nd[i], shapes[i], &t) == CM_OK;
        snprintf(k, sizeof k, "master.%.63s", names[i]);
        shapes_ok &= cm_st_expect(state, k, nd[i], shapes[i], &m) == CM_OK;
        snprintf(k, sizeof k, "adam_m.%.63s", names[i]);
        shapes_ok &= cm_st_expect(state, k, nd[i], shapes[i], &am) == CM_OK;
        snprintf(k, sizeof k, "adam_v.%.63s", names[i]);
        shapes_ok &= cm_st_expect(state, k, nd[i], shapes[i], &av) == CM_OK;
        if (!t || !m || !am || !av)
            continue;
        shapes_ok &= t->dtype == CM_DTYPE_BF16 && m->dtype == CM_DTYPE_F32 && am->dtype == CM_DTYPE_F32 &&
                     av->dtype == CM_DTYPE_F32;
        if (t->dtype != CM_DTYPE_BF16 || m->dtype != CM_DTYPE_F32)
            continue;
        size_t count = t->nbytes / 2;
        for (size_t e = 0; e < count; e++) {
            float    f;
            uint16_t h;
            memcpy(&f, (const char *)m->data + 4 * e, 4);
            memcpy(&h, (const char *)t->data + 2 * e, 2);
            bf16_ok &= cm_f32_to_bf16(f) == h;
        }
    }
    TST_CHECK(shapes_ok);
    TST_CHECK(bf16_ok);
    TST_CHECK(cm_st_count(state) == 3 * n + 3);
    const cm_st_tensor *ts = cm_st_find(state, "step"), *tc = cm_st_find(state, "cursor"),
                       *tr = cm_st_find(state, "rng");
    TST_CHECK(ts && ts->dtype == CM_DTYPE_I64 && ts->nbytes == 8);
    TST_CHECK(tc && tc->dtype == CM_DTYPE_I64 && tc->nbytes == 16);
    TST_CHECK(tr && tr->dtype == CM_DTYPE_I64 && tr->nbytes == 32);
    if (ts && tc && ts->nbytes == 8 && tc->nbytes == 16) {
        int64_t s, c[2];
        memcpy(&s, ts->data, 8);
        memcpy(c, tc->data, 16);
        TST_CHECK(s == step && c[0] == epoch && c[1] == index);
    }
    const char *fmt = cm_st_metadata(state, "format"), *ver = cm_st_metadata(state, "version");
    const char *hp = cm_st_metadata(state, "hparams"), *dh = cm_st_metadata(state, "data_hash");
    TST_CHECK(fmt && strcmp(fmt, DT_CKPT_FORMAT) == 0 && ver && strcmp(ver, DT_CKPT_VERSION) == 0);
    TST_CHECK(dh && strlen(dh) == 16);
    cJSON *h = hp ? cJSON_Parse(hp) : NULL;
    TST_CHECK(h != NULL);
    if (h) {
        const cJSON *lr = cJSON_GetObjectItemCaseSensitive(h, "lr");
        TST_CHECK(cJSON_IsNumber(lr) && lr->valuedouble == 3e-3);
        TST_CHECK(json_int(h, "epochs", 2) && json_int(h, "max_anchors", 8) && json_int(h, "n_batches", 3));
        TST_CHECK(json_int(h, "total_steps", 6) && json_int(h, "warmup_steps", 0));
        TST_CHECK(json_int(h, "loss_decay_gamma", 4) && json_str(h, "seed", "3"));
    }
    cJSON_Delete(h);
done:
    cm_st_destroy(&model);
    cm_st_destroy(&state);
}

static void test_format(void) {
    const char *extra[] = {"--save-every", "2", NULL};
    TST_CHECK(train("run", "run", csv, config, extra) == 0);
    char ck[512], dir[600];
    snprintf(ck, sizeof ck, "%s/run/checkpoints", tmp);
    for (int s = 2; s <= 6; s += 2) {
        snprintf(dir, sizeof dir, "%s/step-%d", ck, s);
        struct stat sb;
        TST_CHECK(stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode));
    }
    snprintf(dir, sizeof dir, "%s/latest", ck);
    char *latest = read_text(dir);
    TST_CHECK(latest && strcmp(latest, "step-6\n") == 0);
    free(latest);
    TST_CHECK(count_tmp(ck) == 0);
    snprintf(dir, sizeof dir, "%s/step-6", ck);
    TST_CHECK(count_tmp(dir) == 0);
    check_config(dir);
    check_tensors(dir, 6, 2, 0);
    snprintf(dir, sizeof dir, "%s/step-2", ck);
    check_tensors(dir, 2, 0, 2);
}

// ---- crashes and refusals

static void test_crash_recovery(void) {
    char ck[512], p[2048];
    snprintf(ck, sizeof ck, "%s/crash/checkpoints", tmp);
    const char *first[] = {"--save-every", "2", "--steps", "2", NULL};
    TST_CHECK(train("crash", "crash1", csv, config, first) == 0);

    /* a save of step 4 died half-way: junk in step-4.tmp and latest.tmp */
    snprintf(p, sizeof p,
             "mkdir -p '%s/step-4.tmp' && echo junk > '%s/step-4.tmp/model.safetensors' && "
             "echo step-999 > '%s/latest.tmp'",
             ck, ck, ck);
    TST_CHECK(system(p) == 0);
    const char *second[] = {"--save-every", "2", "--steps", "4", "--resume", NULL};
    TST_CHECK(train("crash", "crash2", csv, config, second) == 0);
    snprintf(p, sizeof p, "%s/latest", ck);
    char *latest = read_text(p);
    TST_CHECK(latest && strcmp(latest, "step-4\n") == 0);
    free(latest);
    snprintf(p, sizeof p, "%s/step-4.tmp", ck);
    TST_CHECK(access(p, F_OK) != 0);

    /* a save of step 6 was renamed but latest not updated: a stale step-6 holds junk */
    snprintf(p, sizeof p, "mkdir -p '%s/step-6' && echo junk > '%s/step-6/model.safetensors'", ck, ck);
    TST_CHECK(system(p) == 0);
    const char *third[] = {"--save-every", "2", "--resume", NULL};
    TST_CHECK(train("crash", "crash3", csv, config, third) == 0);
    snprintf(p, sizeof p, "%s/step-6", ck);
    check_tensors(p, 6, 2, 0);
    /* the recovered run ends where the straight run did, bit for bit */
    const char *files[] = {"model.safetensors", "training_state.safetensors", "config.json"};
    for (int k = 0; k < 3; k++) {
        char a[700], b[700];
        snprintf(a, sizeof a, "%s/run/checkpoints/step-6/%s", tmp, files[k]);
        snprintf(b, sizeof b, "%s/step-6/%s", ck, files[k]);
        TST_CHECK(same_file(a, b));
    }
    char a[700], b[700];
    snprintf(a, sizeof a, "%s/run/metrics.jsonl", tmp);
    snprintf(b, sizeof b, "%s/crash/metrics.jsonl", tmp);
    FILE *fa = fopen(a, "r"), *fb = fopen(b, "r");
    int   lines = 0, same = fa && fb;
    char  la[4096], lb[4096];
    while (same && fgets(la, sizeof la, fa)) {
        same = fgets(lb, sizeof lb, fb) != NULL;
        if (!same)
            break;
        char *sa = strstr(la, ", \"seconds\""), *sb = strstr(lb, ", \"seconds\"");
        if (sa)
            *sa = '\0';
        if (sb)
            *sb = '\0';
        same = strcmp(la, lb) == 0;
        lines++;
    }
    if (same && fb)
        same = fgets(lb, sizeof lb, fb) == NULL;
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    TST_CHECK(same && lines == 6);
}

static void test_refusals(void) {
    const char *resume[] = {"--resume", NULL};
    const char *lr[] = {"--resume", "--lr", "1e-3", NULL};
    const char *seed[] = {"--resume", "--seed", "4", NULL};
    expect_refused("other lr", train("run", "lr", csv, NULL, lr), "lr", "cannot resume: --lr is 0.001");
    /* flags later on the command line override the common ones */
    expect_refused("other seed", train("run", "seed", csv, NULL, seed), "seed", "cannot resume: --seed is 4");
    char two[1100], swapped[1600];
    snprintf(two, sizeof two, "%s,%s", batch[0], batch[1]);
    snprintf(swapped, sizeof swapped, "%s,%s,%s", batch[1], batch[0], batch[2]);
    expect_refused("fewer files", train("run", "two", two, NULL, resume), "two",
                   "cannot resume: the number of batch");
    expect_refused("other order", train("run", "swap", swapped, NULL, resume), "swap", "batch files differ");
    expect_refused("other config", train("run", "cfg", csv, config1, resume), "cfg",
                   "differs from the checkpoint");
    expect_refused("existing run", train("run", "again", csv, config, NULL), "again", "already holds a run");
    expect_refused("nothing to resume", train("empty", "empty", csv, config, resume), "empty",
                   "has no checkpoint");
    /* the same settings resume fine (and there is nothing left to do) */
    TST_CHECK(train("run", "same", csv, NULL, resume) == 0);

    /* a corrupt latest */
    char p[700];
    snprintf(p, sizeof p, "%s/crash/checkpoints/latest", tmp);
    FILE *f = fopen(p, "w");
    if (f) {
        fputs("garbage\n", f);
        fclose(f);
    }
    expect_refused("corrupt latest", train("crash", "latest", csv, NULL, resume), "latest", "step-<N>");
    snprintf(p, sizeof p, "%s/crash/checkpoints/latest", tmp);
    f = fopen(p, "w");
    if (f) {
        fputs("step-77\n", f);
        fclose(f);
    }
    expect_refused("missing step dir", train("crash", "latest2", csv, NULL, resume), "latest2",
                   "not a checkpoint directory");
    /* a truncated training state */
    snprintf(p, sizeof p,
             "truncate -s 100 '%s/crash/checkpoints/step-4/training_state.safetensors' && "
             "echo step-4 > '%s/crash/checkpoints/latest'",
             tmp, tmp);
    TST_CHECK(system(p) == 0);
    expect_refused("truncated state", train("crash", "trunc", csv, NULL, resume), "trunc", "training_state");
}

static void test_usage(void) {
    char err[512];
    snprintf(err, sizeof err, "%s/usage.err", tmp);
    char *help[] = {DTD_DT_BIN, "train", "--help", NULL};
    TST_CHECK(tst_run(help, err) == 0);
    char *unknown[] = {DTD_DT_BIN, "train", "--frobnicate", "1", NULL};
    TST_CHECK(tst_run(unknown, err) == 2 && strstr(tst_slurp(err), "unknown option '--frobnicate'"));
    char *bad_lr[] = {DTD_DT_BIN, "train", "--lr", "fast", NULL};
    TST_CHECK(tst_run(bad_lr, err) == 2 && strstr(tst_slurp(err), "--lr 'fast'"));
    char *no_target[] = {DTD_DT_BIN, "train", "--config", config, "--data", csv, "--out", tmp, NULL};
    TST_CHECK(tst_run(no_target, err) == 2 && strstr(tst_slurp(err), "--target"));
    char *no_value[] = {DTD_DT_BIN, "train", "--epochs", NULL};
    TST_CHECK(tst_run(no_value, err) == 2 && strstr(tst_slurp(err), "needs a value"));
    char *zero[] = {DTD_DT_BIN, "train", "--max-anchors", "0", NULL};
    TST_CHECK(tst_run(zero, err) == 2 && strstr(tst_slurp(err), "--max-anchors '0'"));
}

static void test_bad_batches(void) {
    /* target_hidden of one tap only, ids outside the vocabulary, a non-increasing cu_seqlens */
    static float   hid[200 * 128];
    static int32_t ids[200], mask[200];
    for (int i = 0; i < 200; i++) {
        ids[i] = 100 + i % 50;
        mask[i] = 1;
    }
    int32_t     cu[3] = {0, 100, 200}, cu_bad[3] = {0, 100, 100};
    const char *names[3] = {"width", "vocab", "cu"};
    const char *needles[3] = {"target_hidden has shape [200, 64] but the drafter needs [200, 128]",
                              "input_ids[7] = 600 is outside the vocabulary",
                              "cu_seqlens is not strictly increasing"};
    for (int k = 0; k < 3; k++) {
        char path[600];
        snprintf(path, sizeof path, "%s/bad-%s.safetensors", tmp, names[k]);
        ids[7] = k == 1 ? 600 : 107;
        cm_st_writer *w = NULL;
        int ok = cm_st_writer_create(&w) == CM_OK && dtd_put(w, "input_ids", CM_DTYPE_I32, 1, 200, 0, ids) &&
                 dtd_put(w, "cu_seqlens", CM_DTYPE_I32, 1, 3, 0, k == 2 ? cu_bad : cu) &&
                 dtd_put(w, "loss_mask", CM_DTYPE_I32, 1, 200, 0, mask) &&
                 dtd_put(w, "target_hidden", CM_DTYPE_F32, 2, 200, k == 0 ? 64 : 128, hid) &&
                 cm_st_writer_write(w, path) == CM_OK;
        cm_st_writer_destroy(&w);
        TST_CHECK(ok);
        char data[1200], out[64];
        snprintf(data, sizeof data, "%s,%s", batch[0], path);
        snprintf(out, sizeof out, "bad-%s", names[k]);
        expect_refused(names[k], train(out, out, data, config, NULL), out, needles[k]);
    }
}

static void test_init_from(void) {
    char from[600];
    snprintf(from, sizeof from, "%s/run/checkpoints/step-6", tmp);
    const char *extra[] = {"--init-from", from, "--steps", "1", NULL};
    TST_CHECK(train("init", "init", csv, NULL, extra) == 0);
    char p[600];
    snprintf(p, sizeof p, "%s/init/checkpoints/step-1", tmp);
    check_config(p);
}

int main(void) {
    if (!dtd_begin(tmp, sizeof tmp, "/tmp/tandem-dtc-XXXXXX"))
        return 1;
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    snprintf(config1, sizeof config1, "%s/drafter1.json", tmp);
    TST_CHECK(dtd_write_config(config, 2) && dtd_write_config(config1, 1));
    TST_CHECK(dtd_make_batches(tmp, 3, 5, csv, sizeof csv));
    for (int i = 0; i < 3; i++)
        snprintf(batch[i], sizeof batch[i], "%s/batch-%d.safetensors", tmp, i);
    if (tst_failures == 0) {
        test_format();
        test_crash_recovery();
        test_refusals();
        test_bad_batches();
        test_usage();
        test_init_from();
    }
    return dtd_end(tmp);
}
