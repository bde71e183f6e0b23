/* tests/dt_train_data.h — a small training set with real target hidden states for the
 * training-loop tests: packed batches of patterned documents (arithmetic progressions,
 * repeated n-grams, doubled counts over a 64-token alphabet inside vocab 512, a 3-token
 * unsupervised prompt each), their taps from the real `target-server dump` of
 * models/tiny-qwen35, assembled into batch files (dt_data.h format), and a tiny drafter
 * config matching them (hidden 64, 4 heads x 16, MLP 128, block 8, mask 511, taps [1, 3]).
 * Header-only; include once, after tst.h. */
#ifndef DT_TRAIN_DATA_H
#define DT_TRAIN_DATA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_dtype.h"
#include "cm_rng.h"
#include "cm_safetensors.h"
#include "cm_shard.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define DTD_MAX_T  512
#define DTD_TAP_A  1
#define DTD_TAP_B  3
#define DTD_D      64
#define DTD_MODEL  TANDEM_TEST_DATA "/../models/tiny-qwen35"
#define DTD_TS_BIN TANDEM_BINARY_DIR "/target-server/target-server"
#define DTD_DT_BIN TANDEM_BINARY_DIR "/drafter-trainer/drafter-trainer"

/* Writes the tiny drafter's config.json (n_layers layers; the first is sliding with window
 * 16 when n_layers > 1, the last full). Returns 1 on success. */
static int dtd_write_config_kind(const char *path, int n_layers, int v2) {
    FILE *f = fopen(path, "w");
    if (!f)
        return 0;
    fprintf(f,
            "{\"architectures\": [\"%s\"], \"model_type\": \"qwen3\", \"block_size\": 8,\n"
            " \"num_target_layers\": 6,%s\n"
            " \"dflash_config\": {\"mask_token_id\": 511, \"target_layer_ids\": [%d, %d]%s},\n"
            " \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": %d,\n"
            " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"hidden_act\": "
            "\"silu\",\n"
            " \"rms_norm_eps\": 1e-06, \"rope_theta\": 10000, \"attention_bias\": false,\n"
            " \"max_position_embeddings\": 4096, \"layer_types\": [",
            v2 ? "DFlash2DraftModel" : "DFlashDraftModel", v2 ? " \"is_causal\": false," : "", DTD_TAP_A, DTD_TAP_B,
            v2 ? ", \"conv_kernel_size\": 2, \"conv_group_size\": 16, \"selector_rank\": 8, \"selector_top_k\": 8" : "",
            n_layers);
    for (int l = 0; l < n_layers; l++)
        fprintf(f, "%s\"%s\"", l ? ", " : "", l + 1 < n_layers ? "sliding_attention" : "full_attention");
    fprintf(f, "], \"sliding_window\": 16,\n \"tie_word_embeddings\": false, \"vocab_size\": 512, "
               "\"dtype\": \"bfloat16\"}\n");
    return fclose(f) == 0;
}

static int dtd_write_config(const char *path, int n_layers) {
    return dtd_write_config_kind(path, n_layers, 0);
}

/* One patterned document of len tokens into ids (prompt mask 0 on the first 3). */
static void dtd_doc(cm_rng *r, int32_t *ids, int32_t *mask, int len) {
    int kind = (int)cm_rng_below(r, 3);
    int s = (int)cm_rng_below(r, 64), n = 2 + (int)cm_rng_below(r, 3);
    int steps[4] = {1, 2, 3, 5}, d = steps[cm_rng_below(r, 4)];
    int gram[4];
    for (int k = 0; k < 4; k++)
        gram[k] = (int)cm_rng_below(r, 64);
    for (int i = 0; i < len; i++) {
        int x = kind == 0 ? (s + i * d) % 64 : kind == 1 ? gram[i % n] : (s + i / 2) % 64;
        ids[i] = 100 + x;
        mask[i] = i >= 3;
    }
}

static int dtd_put(cm_st_writer *w, const char *name, cm_dtype dt, int nd, int64_t d0, int64_t d1,
                   const void *data) {
    int64_t shape[2] = {d0, d1};
    return cm_st_writer_add(w, name, dt, nd, shape, data) == CM_OK;
}

/* Builds n_batches batch files dir/batch-<i>.safetensors (96–135 tokens, 3–6 documents
 * each; batch 1 stores target_hidden as BF16, the others F32) and writes their
 * comma-separated paths into csv. Returns 1 on success. */
static int dtd_make_batches(const char *dir, int n_batches, uint64_t seed, char *csv, size_t cap) {
    static int32_t  ids[DTD_MAX_T], mask[DTD_MAX_T], cu[64];
    static float    hid[DTD_MAX_T * 2 * DTD_D];
    static uint16_t hid16[DTD_MAX_T * 2 * DTD_D];
    cm_rng          r;
    cm_rng_seed(&r, seed);
    csv[0] = '\0';
    for (int b = 0; b < n_batches; b++) {
        int T = 0, n = 0;
        cu[0] = 0;
        while (T < 96) {
            int len = 16 + (int)cm_rng_below(&r, 25);
            dtd_doc(&r, ids + T, mask + T, len);
            T += len;
            cu[++n] = T;
        }
        char in[1024], out[1024], path[1024], err[1024];
        snprintf(in, sizeof in, "%s/ids-%d.safetensors", dir, b);
        snprintf(out, sizeof out, "%s/taps-%d.safetensors", dir, b);
        snprintf(path, sizeof path, "%s/batch-%d.safetensors", dir, b);
        snprintf(err, sizeof err, "%s/dump-%d.err", dir, b);
        cm_st_writer *w = NULL;
        int ok = cm_st_writer_create(&w) == CM_OK && dtd_put(w, "input_ids", CM_DTYPE_I32, 1, T, 0, ids) &&
                 dtd_put(w, "cu_seqlens", CM_DTYPE_I32, 1, n + 1, 0, cu) &&
                 cm_st_writer_write(w, in) == CM_OK;
        cm_st_writer_destroy(&w);
        if (!ok)
            return 0;
        char layers[32];
        snprintf(layers, sizeof layers, "%d,%d", DTD_TAP_A, DTD_TAP_B);
        char *argv[] = {DTD_TS_BIN, "dump",     "--model", DTD_MODEL,     "--input", in,  "--out",
                        out,        "--layers", layers,    "--log-level", "warn",    NULL};
        int   rc = tst_run(argv, err);
        if (rc != 0) {
            fprintf(stderr, "target-server dump failed (%d): %s\n", rc, tst_slurp(err));
            return 0;
        }
        cm_st *taps = NULL;
        if (cm_st_open_file(&taps, out) != CM_OK)
            return 0;
        char ka[32], kb[32];
        snprintf(ka, sizeof ka, "layer_%d", DTD_TAP_A);
        snprintf(kb, sizeof kb, "layer_%d", DTD_TAP_B);
        const cm_st_tensor *ta = cm_st_find(taps, ka), *tb = cm_st_find(taps, kb);
        ok = ta && tb && ta->dtype == CM_DTYPE_F32 && tb->dtype == CM_DTYPE_F32 && ta->shape[0] == T &&
             ta->shape[1] == DTD_D && tb->shape[0] == T && tb->shape[1] == DTD_D;
        if (ok)
            for (int t = 0; t < T; t++) {
                memcpy(hid + (size_t)t * 2 * DTD_D, (const float *)ta->data + (size_t)t * DTD_D,
                       DTD_D * sizeof(float));
                memcpy(hid + (size_t)t * 2 * DTD_D + DTD_D, (const float *)tb->data + (size_t)t * DTD_D,
                       DTD_D * sizeof(float));
            }
        cm_st_destroy(&taps);
        if (!ok)
            return 0;
        w = NULL;
        ok = cm_st_writer_create(&w) == CM_OK && dtd_put(w, "input_ids", CM_DTYPE_I32, 1, T, 0, ids) &&
             dtd_put(w, "cu_seqlens", CM_DTYPE_I32, 1, n + 1, 0, cu) &&
             dtd_put(w, "loss_mask", CM_DTYPE_I32, 1, T, 0, mask);
        if (ok && b == 1) {
            cm_convert(hid16, CM_DTYPE_BF16, hid, CM_DTYPE_F32, (size_t)T * 2 * DTD_D);
            ok = dtd_put(w, "target_hidden", CM_DTYPE_BF16, 2, T, 2 * DTD_D, hid16);
        } else if (ok) {
            ok = dtd_put(w, "target_hidden", CM_DTYPE_F32, 2, T, 2 * DTD_D, hid);
        }
        ok = ok && cm_st_writer_write(w, path) == CM_OK;
        cm_st_writer_destroy(&w);
        if (!ok)
            return 0;
        size_t used = strlen(csv);
        snprintf(csv + used, cap - used, "%s%s", b ? "," : "", path);
    }
    return 1;
}

/* dtd_make_batches into dir (their paths into csv_dump), and from each batch-<i> a token-only
 * file dir/tok-<ii>.safetensors (input_ids, cu_seqlens, loss_mask) and a file
 * dir/bf-<ii>.safetensors with its taps rounded to BF16 (what a BF16 server sends); their
 * comma-separated paths into csv_tok and csv_bf. The three lists have cap bytes each; T_of
 * (n_batches entries, may be NULL) gets each batch's token count. Returns 1 on success. */
static inline int dtd_make_tok_bf(const char *dir, int n_batches, uint64_t seed, char *csv_dump,
                                  char *csv_tok, char *csv_bf, size_t cap, int *T_of) {
    static float    hid[DTD_MAX_T * 2 * DTD_D];
    static uint16_t h16[DTD_MAX_T * 2 * DTD_D];
    if (!dtd_make_batches(dir, n_batches, seed, csv_dump, cap))
        return 0;
    csv_tok[0] = csv_bf[0] = '\0';
    for (int b = 0; b < n_batches; b++) {
        char src[512], tok[512], bf[512];
        snprintf(src, sizeof src, "%s/batch-%d.safetensors", dir, b);
        snprintf(tok, sizeof tok, "%s/tok-%02d.safetensors", dir, b);
        snprintf(bf, sizeof bf, "%s/bf-%02d.safetensors", dir, b);
        cm_st *s = NULL;
        if (cm_st_open_file(&s, src) != CM_OK)
            return 0;
        const cm_st_tensor *ti = cm_st_find(s, "input_ids"), *tc = cm_st_find(s, "cu_seqlens"),
                           *tm = cm_st_find(s, "loss_mask"), *th = cm_st_find(s, "target_hidden");
        int64_t T = ti->shape[0];
        if (T_of)
            T_of[b] = (int)T;
        cm_convert(hid, CM_DTYPE_F32, th->data, th->dtype, (size_t)T * 2 * DTD_D);
        cm_convert(h16, CM_DTYPE_BF16, hid, CM_DTYPE_F32, (size_t)T * 2 * DTD_D);
        cm_st_writer *w = NULL;
        int           ok =
            cm_st_writer_create(&w) == CM_OK && dtd_put(w, "input_ids", CM_DTYPE_I32, 1, T, 0, ti->data) &&
            dtd_put(w, "cu_seqlens", CM_DTYPE_I32, 1, tc->shape[0], 0, tc->data) &&
            dtd_put(w, "loss_mask", CM_DTYPE_I32, 1, T, 0, tm->data) && cm_st_writer_write(w, tok) == CM_OK &&
            dtd_put(w, "target_hidden", CM_DTYPE_BF16, 2, T, 2 * DTD_D, h16) &&
            cm_st_writer_write(w, bf) == CM_OK;
        cm_st_writer_destroy(&w);
        cm_st_destroy(&s);
        if (!ok)
            return 0;
        size_t u = strlen(csv_tok), v = strlen(csv_bf);
        snprintf(csv_tok + u, cap - u, "%s%s", b ? "," : "", tok);
        snprintf(csv_bf + v, cap - v, "%s%s", b ? "," : "", bf);
    }
    return 1;
}

/* Starts `target-server serve --model model --bind bind --dtype bf16` (and `--encoding
 * encoding` unless NULL) logging to dir/NAME.log; its pid, or -1 if it did not bind within
 * 30 s, and the endpoint it bound into endpoint (cap bytes). */
static inline pid_t dtd_serve(const char *model, const char *bind, const char *dir, const char *name,
                              const char *encoding, char *endpoint, size_t cap) {
    const char *extra[] = {"--dtype", "bf16", encoding ? "--encoding" : NULL, encoding, NULL};
    char        path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return tst_serve_start(DTD_TS_BIN, model, bind, path, extra, endpoint, cap, 30000);
}

/* The start of a training-loop test: both programs must be built (else a message and 0), one
 * kernel thread (results are the same for any count, and OpenMP spinning on a shared small box
 * costs several times the work itself), and a fresh folder made from templ ("…XXXXXX") into dir
 * (cap bytes). 1 on success. */
static inline int dtd_begin(char *dir, size_t cap, const char *templ) {
    if (access(DTD_DT_BIN, X_OK) != 0 || access(DTD_TS_BIN, X_OK) != 0) {
        fprintf(stderr, "missing %s or %s: build drafter-trainer and target-server\n", DTD_DT_BIN,
                DTD_TS_BIN);
        return 0;
    }
    setenv("OMP_NUM_THREADS", "1", 1);
    snprintf(dir, cap, "%s", templ);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "cannot create a temporary directory\n");
        return 0;
    }
    return 1;
}

/* The end of a training-loop test: dir removed (a failed removal is a failed check) unless
 * DT_TRAIN_KEEP is set; returns tst_report(). */
static inline int dtd_end(const char *dir) {
    if (getenv("DT_TRAIN_KEEP"))
        fprintf(stderr, "kept %s\n", dir);
    else {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        TST_CHECK(system(cmd) == 0);
    }
    return tst_report();
}

/* Records durable in the shard store dir (from the size of its index.bin; 0 without one). */
static inline long dtd_durable(const char *dir) {
    char p[600];
    snprintf(p, sizeof p, "%s/index.bin", dir);
    struct stat st;
    if (stat(p, &st) != 0 || st.st_size < CM_SHARD_INDEX_HEADER_SIZE)
        return 0;
    return (long)((st.st_size - CM_SHARD_INDEX_HEADER_SIZE) / CM_SHARD_ENTRY_SIZE);
}

#endif /* DT_TRAIN_DATA_H */
