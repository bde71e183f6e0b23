/* tests/fuzz/make_corpus.c — writes the seed corpora of the fuzz targets from real fixtures and
 * real encoders: tiny copies of the safetensors fixtures (every tensor's extents cut to ≤ 2), the
 * sharded fixture's index with its shards, the config.json files, every wire message as
 * cm_proto encodes it (DECODE for a target of its own), cm_compress streams of every encoding,
 * and a shard store written by cm_shard's writer (whole, and with a torn index tail). Run by tests/fuzz/make_corpus.sh;
 * usage: fuzz_make_corpus SOURCE_DIR OUT_DIR (OUT_DIR/<target>/ must exist). */
#include <cJSON.h>
#include <string.h>

#include "cm_cfg.h"
#include "cm_compress.h"
#include "cm_proto.h"
#include "cm_safetensors.h"
#include "cm_shard.h"
#include "dt_dataset.h"
#include "dt_runcfg.h"
#include "fuzz_util.h"

static const char *src_dir, *out_dir;

#define OK(call)                                                                                             \
    do {                                                                                                     \
        if ((call) != CM_OK) {                                                                               \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cm_last_error());           \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) {
        perror(path);
        exit(1);
    }
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* Writes OUT/<target>/<name>: a flag byte (if flag ≥ 0), then parts joined by FUZZ_SPLIT. */
static void seed(const char *target, const char *name, int flag, const fuzz_part *parts, int n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    if (flag >= 0)
        fputc(flag, f);
    for (int i = 0; i < n; i++) {
        if (i)
            fputs(FUZZ_SPLIT, f);
        fwrite(parts[i].data, 1, parts[i].len, f);
    }
    fclose(f);
}
static void seed1(const char *target, const char *name, int flag, const void *data, size_t len) {
    fuzz_part p = {data, len};
    seed(target, name, flag, &p, 1);
}

// ---- safetensors: tiny copies of fixtures

/* Writes the first max_tensors tensors of st (or those named in names) with every extent cut to
 * at most 2 and their leading bytes as data. */
static void tiny_copy(const cm_st *st, const char *const *names, int n_names, int max_tensors,
                      const char *path) {
    cm_st_writer *w;
    OK(cm_st_writer_create(&w));
    int n = names ? n_names : cm_st_count(st);
    for (int i = 0; i < n && i < max_tensors; i++) {
        const cm_st_tensor *t = names ? cm_st_find(st, names[i]) : cm_st_at(st, i);
        int64_t             shape[CM_ST_MAX_DIMS];
        for (int d = 0; d < t->n_dims; d++)
            shape[d] = t->shape[d] < 2 ? t->shape[d] : 2;
        OK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, shape, t->data));
    }
    const char *fmt = cm_st_metadata(st, "format");
    if (fmt)
        OK(cm_st_writer_set_metadata(w, "format", fmt));
    OK(cm_st_writer_write(w, path));
    cm_st_writer_destroy(&w);
}

static void safetensors_seeds(void) {
    static const char *files[][2] = {
        {"tests/fixtures/target/qwen35_flat_f32_tied/input.safetensors", "target_input"},
        {"tests/fixtures/target/qwen35_flat_f32_tied/model/model.safetensors", "qwen35_flat_f32"},
        {"tests/fixtures/target/qwen36_mm_single_bf16/model/model.safetensors", "qwen36_mm_bf16"},
        {"tests/fixtures/target/qwen35_flat_f32_tied/ref.safetensors", "target_ref"},
        {"tests/fixtures/drafter/b16_sw5_full_gqa2/batch.safetensors", "drafter_batch"},
        {"tests/fixtures/drafter/b16_sw5_full_gqa2/drafter/model.safetensors", "drafter_model"},
        {"tests/fixtures/drafter/b16_sw5_full_gqa2/ref.safetensors", "drafter_ref"},
    };
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s/tiny.safetensors", fuzz_dir());
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", src_dir, files[i][0]);
        cm_st *st;
        OK(cm_st_open_file(&st, path));
        tiny_copy(st, NULL, 0, 12, tmp);
        cm_st_destroy(&st);
        size_t   len;
        uint8_t *b = slurp(tmp, &len);
        seed1("safetensors", files[i][1], -1, b, len);
        free(b);
    }
    // every dtype, a scalar, an empty tensor, metadata
    cm_st_writer *w;
    OK(cm_st_writer_create(&w));
    static const uint8_t bytes[64] = {0x3f, 0x80, 0, 0, 0x40, 0x49, 0x0f, 0xdb, 1, 2, 3, 4, 5, 6, 7, 8};
    for (int dt = 0; dt < CM_DTYPE_COUNT; dt++) {
        char    name[32];
        int64_t shape[2] = {2, 2};
        snprintf(name, sizeof name, "t.%s", cm_dtype_name((cm_dtype)dt));
        OK(cm_st_writer_add(w, name, (cm_dtype)dt, 2, shape, bytes));
    }
    int64_t zero[2] = {0, 3};
    OK(cm_st_writer_add(w, "empty", CM_DTYPE_F32, 2, zero, bytes));
    OK(cm_st_writer_add(w, "scalar", CM_DTYPE_F32, 0, zero, bytes));
    OK(cm_st_writer_set_metadata(w, "format", "pt"));
    OK(cm_st_writer_write(w, tmp));
    cm_st_writer_destroy(&w);
    size_t   len;
    uint8_t *b = slurp(tmp, &len);
    seed1("safetensors", "every_dtype", -1, b, len);
    free(b);
    // two tensors sharing bytes (refused: the ranges overlap)
    static const char overlap[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}";
    uint8_t ov[8 + sizeof overlap - 1 + 16] = {0};
    ov[0] = (uint8_t)(sizeof overlap - 1);
    memcpy(ov + 8, overlap, sizeof overlap - 1);
    seed1("safetensors", "overlap", -1, ov, sizeof ov);
}

// ---- st_index: the sharded fixture, shards renamed a, b, ...

static void st_index_seeds(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/fixtures/target/qwen35_mm_sharded/model", src_dir);
    cm_st *st;
    OK(cm_st_open_dir(&st, dir));
    const char *files[FUZZ_MAX_PARTS];
    const char *names[FUZZ_MAX_PARTS][4];
    int         n_files = 0, n_names[FUZZ_MAX_PARTS] = {0};
    cJSON      *root = cJSON_CreateObject(), *map = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    cJSON_AddItemToObject(meta, "total_size", cJSON_CreateNumber(575440));
    cJSON_AddItemToObject(root, "metadata", meta);
    cJSON_AddItemToObject(root, "weight_map", map);
    for (int i = 0; i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        int                 k = 0;
        while (k < n_files && strcmp(files[k], t->file) != 0)
            k++;
        if (k == n_files) {
            if (n_files == FUZZ_MAX_PARTS - 1)
                continue;
            files[n_files++] = t->file;
        }
        if (n_names[k] == 4)
            continue;
        names[k][n_names[k]++] = t->name;
        char shard[2] = {(char)('a' + k), 0};
        cJSON_AddItemToObject(map, t->name, cJSON_CreateString(shard));
    }
    char     *json = cJSON_Print(root);
    fuzz_part parts[FUZZ_MAX_PARTS];
    uint8_t  *bufs[FUZZ_MAX_PARTS];
    parts[0].data = (const uint8_t *)json, parts[0].len = strlen(json);
    for (int k = 0; k < n_files; k++) {
        char   path[512];
        cm_st *one;
        snprintf(path, sizeof path, "%s/shard.safetensors", fuzz_dir());
        OK(cm_st_open_file(&one, files[k]));
        tiny_copy(one, names[k], n_names[k], 4, path);
        cm_st_destroy(&one);
        bufs[k] = slurp(path, &parts[k + 1].len);
        parts[k + 1].data = bufs[k];
    }
    seed("st_index", "qwen35_mm_sharded", -1, parts, n_files + 1);
    seed("st_index", "two_shards", -1, parts, 3); /* names shards the input lacks */
    for (int k = 0; k < n_files; k++)
        free(bufs[k]);
    free(json);
    cJSON_Delete(root);
    cm_st_destroy(&st);
}

// ---- cfg: the config.json files of the fixtures and test data

static void cfg_seeds(void) {
    static const char *files[][2] = {
        {"tests/data/cm/qwen3_6_27b/config.json", "qwen3_6_27b"},
        {"tests/data/cm/qwen3_5_tiny_flat/config.json", "qwen3_5_tiny_flat"},
        {"tests/data/cm/dflash_qwen3_6_27b/config.json", "dflash_qwen3_6_27b"},
        {"tests/fixtures/target/qwen35_mm_sharded/model/config.json", "qwen35_mm_sharded"},
        {"tests/fixtures/target/qwen36_mm_single_bf16/model/config.json", "qwen36_mm_single_bf16"},
        {"tests/fixtures/drafter/b16_sw5_full_gqa2/drafter/config.json", "drafter_b16_sw5"},
        {"tests/fixtures/drafter/b8_full_sw9_sw9_gqa3/drafter/config.json", "drafter_b8_sw9"},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", src_dir, files[i][0]);
        size_t   len;
        uint8_t *b = slurp(path, &len);
        seed1("cfg", files[i][1], -1, b, len);
        free(b);
    }
    // a drafter that taps one layer twice (refused)
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/drafter/b16_sw5_full_gqa2/drafter/config.json", src_dir);
    size_t len;
    char  *b = (char *)slurp(path, &len);
    char  *taps = strstr(b, "\"target_layer_ids\"");
    char  *open = taps ? strchr(taps, '[') : NULL, *close = open ? strchr(open, ']') : NULL;
    if (!close) {
        fprintf(stderr, "%s: no target_layer_ids array\n", path);
        exit(1);
    }
    size_t head = (size_t)(open - b), tail = len - (size_t)(close + 1 - b);
    char  *dup = malloc(head + 6 + tail);
    memcpy(dup, b, head);
    memcpy(dup + head, "[1, 1]", 6);
    memcpy(dup + head + 6, close + 1, tail);
    seed1("cfg", "drafter_dup_taps", -1, dup, head + 6 + tail);
    free(dup);
    free(b);
}

// ---- proto and compress: real encoder output

static cm_compress *cz;

/* A [rows, cols] tensor of dt with smooth values, encoded with enc into *out (malloc'd). */
static size_t encode_tensor(cm_encoding enc, cm_dtype dt, int64_t rows, int64_t cols, uint8_t **out) {
    size_t   n = (size_t)(rows * cols), esz = cm_dtype_size(dt);
    float   *x = malloc(n * sizeof *x + 1);
    uint8_t *raw = malloc(n * esz + 1);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((int)(i % 17) - 8) * 0.125f + (float)(i / 17) * 0.01f;
    OK(cm_convert(raw, dt, x, CM_DTYPE_F32, n));
    size_t cap = cm_compress_bound(cz, enc, dt, rows, cols), len = 0;
    *out = malloc(cap + 1);
    OK(cm_compress_encode(cz, enc, dt, raw, rows, cols, *out, cap, &len));
    free(x);
    free(raw);
    return len;
}

static size_t answer_frame(uint64_t id, int64_t cols, uint8_t *buf, size_t cap) {
    cm_proto_tensor t[4];
    uint8_t        *enc[4];
    memset(t, 0, sizeof t);
    for (int i = 0; i < 4; i++) {
        snprintf(t[i].name, sizeof t[i].name, "layer_%d", 2 * i + 1);
        t[i].encoding = (cm_encoding)i;
        t[i].dtype = i == 1 ? CM_DTYPE_F32 : CM_DTYPE_BF16;
        t[i].n_dims = 2, t[i].shape[0] = 3, t[i].shape[1] = cols;
        t[i].raw_size = (uint64_t)(3 * cols) * cm_dtype_size(t[i].dtype);
        t[i].encoded_size = encode_tensor(t[i].encoding, t[i].dtype, 3, cols, &enc[i]);
        t[i].data = enc[i];
    }
    cm_proto_answer a = {.batch_id = id, .n_tensors = 4, .tensors = t, .cap_tensors = 4};
    size_t          len;
    OK(cm_proto_answer_encode(&a, buf, cap, &len));
    for (int i = 0; i < 4; i++)
        free(enc[i]);
    return len;
}

static void proto_seeds(void) {
    uint8_t        b[8192];
    size_t         len;
    cm_proto_hello h = {.target_id = 0x1234abcd5678ef01ull,
                        .weights_id = 0x5eed0f3e1a2b3c4dull,
                        .credits = 4,
                        .encodings = CM_ENCODING_LOSSLESS_MASK,
                        .name = "trainer-0"};
    OK(cm_proto_hello_encode(&h, b, sizeof b, &len));
    seed1("proto", "hello", 1, b, len);
    cm_proto_welcome we = {.target_id = 0x1234abcd5678ef01ull,
                           .weights_id = 0x5eed0f3e1a2b3c4dull,
                           .version = CM_PROTO_VERSION,
                           .hidden_dtype = CM_DTYPE_BF16,
                           .hidden_size = 64,
                           .n_layers = 6,
                           .max_tokens = 4096,
                           .credits = 4,
                           .encodings = 7,
                           .name = "tiny-qwen35"};
    OK(cm_proto_welcome_encode(&we, b, sizeof b, &len));
    seed1("proto", "welcome", 1, b, len);
    int32_t          tok[7] = {1, 5, 9, 2, 0, 511, 3}, cu[3] = {0, 4, 7}, lay[2] = {1, 3};
    cm_proto_request r = {.batch_id = 42,
                          .flags = CM_PROTO_FLAG_RESEND,
                          .encoding = CM_ENCODING_ZSTD_BYTEPLANE,
                          .n_tokens = 7,
                          .n_seqs = 2,
                          .n_layers = 2,
                          .tokens = tok,
                          .cu_seqlens = cu,
                          .layer_ids = lay};
    OK(cm_proto_request_encode(&r, b, sizeof b, &len));
    seed1("proto", "request", 1, b, len);
    seed1("proto", "request_unsealed", 0, b, len);
    len = answer_frame(42, 16, b, sizeof b);
    seed1("proto", "answer", 1, b, len);
    seed1("proto", "answer_unsealed", 0, b, len);
    cm_proto_error e = {42, CM_PROTO_ERROR_BAD_REQUEST, "layer 99 is out of range: the target has 6 layers"};
    OK(cm_proto_error_encode(&e, b, sizeof b, &len));
    seed1("proto", "error", 1, b, len);
    OK(cm_proto_heartbeat_encode(7, b, sizeof b, &len));
    seed1("proto", "heartbeat", 1, b, len);
    OK(cm_proto_bye_encode(b, sizeof b, &len));
    seed1("proto", "bye", 1, b, len);
    cm_proto_nccl offer = {.device = 3, .uid_len = 16};
    for (int i = 0; i < 16; i++)
        offer.uid[i] = (uint8_t)(i * 37 + 1);
    OK(cm_proto_nccl_offer_encode(&offer, b, sizeof b, &len));
    seed1("proto", "nccl_offer", 1, b, len);
    OK(cm_proto_nccl_ready_encode(3, b, sizeof b, &len));
    seed1("proto", "nccl_ready", 1, b, len);
    OK(cm_proto_status_encode(NULL, 0, b, sizeof b, &len));
    seed1("proto", "status_request", 1, b, len);
    static const char status[] = "{\"target\": \"tiny-qwen35\", \"device\": \"cpu\", \"trainers\": []}";
    OK(cm_proto_status_encode(status, sizeof status - 1, b, sizeof b, &len));
    seed1("proto", "status_reply", 1, b, len);
}

/* DECODE frames (fuzz_decode.c): a STEP of a new sequence and two continuing ones (greedy,
 * sampled, the target's sampling), one without layers, a CLOSE; flag bit 0 re-seals, bit 1 picks
 * the small limits. */
static void decode_seeds(void) {
    uint8_t             b[4096];
    size_t              len;
    cm_proto_decode_seq q[3] = {{0, 0, 4, 0, 0, 0.0f, 1.0f, 0, 0},
                                {7, 130, 1, 3, 20, 0.7f, 0.95f, 0, 0x0123456789abcdefull},
                                {9, 17, 1, 2, 0, 1.0f, 0.5f, CM_DECODE_FLAG_TARGET_SAMPLING, 42}};
    int32_t             tok[11] = {151644, 872, 198, 9707, 13, 100, 101, 102, 5, 6, 0}, lay[2] = {31, 1};
    cm_proto_decode     m = {.id = 12,
                             .op = CM_DECODE_STEP,
                             .encoding = CM_ENCODING_ZSTD_BYTEPLANE,
                             .n_seqs = 3,
                             .n_tokens = 11,
                             .n_layers = 2,
                             .seqs = q,
                             .tokens = tok,
                             .layer_ids = lay};
    OK(cm_proto_decode_encode(&m, b, sizeof b, &len));
    seed1("decode", "step", 1, b, len);
    seed1("decode", "step_unsealed", 0, b, len);
    seed1("decode", "step_small_limits", 3, b, len);
    m.encoding = CM_ENCODING_RAW, m.n_layers = 0, m.n_seqs = 1, m.n_tokens = 4;
    OK(cm_proto_decode_encode(&m, b, sizeof b, &len));
    seed1("decode", "step_no_layers", 1, b, len);
    q[0].handle = 3, q[0].n_ctx = 0;
    q[1].n_ctx = 0, q[1].n_draft = 0;
    cm_proto_decode c = {.id = 13, .op = CM_DECODE_CLOSE, .encoding = CM_ENCODING_ZSTD, .n_seqs = 2, .seqs = q};
    OK(cm_proto_decode_encode(&c, b, sizeof b, &len));
    seed1("decode", "close", 1, b, len);
}

static void compress_seeds(void) {
    static const struct {
        cm_dtype dt;
        int64_t  rows, cols;
    } cases[] = {{CM_DTYPE_BF16, 3, 40}, {CM_DTYPE_F32, 2, 33}, {CM_DTYPE_F16, 1, 1}, {CM_DTYPE_BF16, 0, 8}};
    for (int enc = 0; enc <= CM_ENCODING_FP8_ZSTD; enc++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            uint8_t *s;
            size_t   n = encode_tensor((cm_encoding)enc, cases[i].dt, cases[i].rows, cases[i].cols, &s);
            uint8_t *b = malloc(n + 6);
            b[0] = (uint8_t)(enc | (i == 1 ? 0x80 : 0));
            b[1] = (uint8_t)cases[i].dt;
            b[2] = (uint8_t)cases[i].rows, b[3] = 0, b[4] = (uint8_t)cases[i].cols, b[5] = 0;
            memcpy(b + 6, s, n);
            char name[64];
            snprintf(name, sizeof name, "%s_%s_%lldx%lld", cm_encoding_name(enc), cm_dtype_name(cases[i].dt),
                     (long long)cases[i].rows, (long long)cases[i].cols);
            seed1("compress", name, -1, b, n + 6);
            free(s);
            free(b);
        }
}

// ---- shard: a store written by cm_shard's writer

static void shard_seeds(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/store", fuzz_dir());
    cm_shard_identity id;
    memset(&id, 0, sizeof id);
    id.target_id = 0x1234abcd5678ef01ull;
    snprintf(id.target_name, sizeof id.target_name, "tiny-qwen35");
    id.hidden_dtype = CM_DTYPE_BF16, id.encoding = CM_ENCODING_ZSTD_BYTEPLANE, id.hidden_size = 16;
    id.n_layers = 2, id.layer_ids[0] = 1, id.layer_ids[1] = 3;
    id.weights_id = 0x5eed0f3e1a2b3c4dull;
    cm_shard_writer       *w;
    cm_shard_writer_config cfg = {4096, 2, 0};
    OK(cm_shard_writer_create(&w, dir, &id, &cfg));
    uint8_t frame[8192];
    for (uint64_t b = 0; b < 3; b++) { /* one shard each: the target takes three */
        size_t  len = answer_frame(b, 160, frame, sizeof frame);
        int32_t tok[3] = {(int32_t)b, 7, 9}, cu[2] = {0, 3};
        OK(cm_shard_writer_append(w, b, cm_shard_batch_hash(tok, 3, cu, 1), frame, len));
    }
    OK(cm_shard_writer_close(&w));
    fuzz_part parts[4];
    uint8_t  *bufs[4];
    int       n = 0;
    for (; n < 4; n++) {
        char path[600];
        if (n == 0)
            snprintf(path, sizeof path, "%s/%s", dir, CM_SHARD_INDEX_NAME);
        else
            snprintf(path, sizeof path, "%s/shard-%05d.bin", dir, n - 1);
        if (access(path, F_OK) != 0)
            break;
        bufs[n] = slurp(path, &parts[n].len);
        parts[n].data = bufs[n];
    }
    seed("shard", "store", 3, parts, n);
    seed("shard", "store_unsealed", 0, parts, n);
    seed("shard", "store_verify", 7, parts, n); /* the resumed writer verifies every record */
    parts[0].len -= 20; /* a torn last entry: the reader ignores it, the writer cuts it */
    seed("shard", "store_torn_index", 3, parts, n);
    parts[0].len += 20;
    if (n > 1) {
        parts[1].len -= 100; /* a shard shorter than its index says */
        seed("shard", "store_short_shard", 3, parts, n);
    }
    for (int k = 0; k < n; k++)
        free(bufs[k]);
    fuzz_dir_clear(dir);
    rmdir(dir);
}

// ---- dataset: JSONL as tools/prepare_data.py writes it, and its binary form

static void dataset_seeds(void) {
    static const char jsonl[] =
        "{\"source\": \"chat\", \"input_ids\": [11, 12, 13, 14, 15, 16], \"loss_mask\": [0, 0, 1, 1, 1, 1]}\n"
        "{\"input_ids\": [7, 8, 9]}\n"
        "\n"
        "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], \"loss_mask\": [false, true, true, false, true, "
        "true, true, false, false, true]}\n"
        "{\"input_ids\": [5, 6], \"loss_mask\": [1, 0]}\n";
    const int budget_flag = 8 << 1; /* budget 16 */
    seed1("dataset", "chat.jsonl", budget_flag, jsonl, sizeof jsonl - 1);
    static const char nul[] = "{\"input_ids\": [7, 8, 9]}\n\0{\"input_ids\": [1, 2]}\n{\"input_ids\": [3]\0}\n";
    seed1("dataset", "nul.jsonl", budget_flag, nul, sizeof nul - 1);
    char path[512], out[512];
    snprintf(path, sizeof path, "%s/docs.jsonl", fuzz_dir());
    snprintf(out, sizeof out, "%s/docs.safetensors", fuzz_dir());
    fuzz_write(path, jsonl, sizeof jsonl - 1);
    dt_docs d;
    OK(dt_docs_read(&d, path));
    OK(dt_docs_write(&d, out));
    dt_docs_release(&d);
    size_t   len;
    uint8_t *b = slurp(out, &len);
    seed1("dataset", "chat.safetensors", budget_flag | 1, b, len);
    free(b);
}

// ---- runcfg: the deploy run config and one with every value kind

static void runcfg_seeds(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/deploy/configs/qwen3.6-27b/run.json", src_dir);
    size_t   len;
    uint8_t *b = slurp(path, &len);
    seed1("runcfg", "deploy_qwen3.6-27b", -1, b, len);
    free(b);
    static const char kinds[] =
        "{\"config\": \"drafter.json\", \"target\": \"/models/q\", \"data\": [\"a.st\", "
        "\"/abs/b.st\"], \"out\": \"runs/r1\", \"lr\": 6e-4, \"epochs\": 6, \"resume\": "
        "true, \"seed\": \"18446744073709551615\", \"dataset\": [\"x.jsonl\", \"y.jsonl\"]}\n";
    seed1("runcfg", "every_kind", -1, kinds, sizeof kinds - 1);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOURCE_DIR OUT_DIR\n", argv[0]);
        return 2;
    }
    src_dir = argv[1], out_dir = argv[2];
    cm_log_set_level(CM_LOG_LEVEL_WARN);
    cm_compress_config cfg = CM_COMPRESS_CONFIG_DEFAULT;
    cfg.chunk_bytes = 4096; /* several chunks in the larger seeds */
    OK(cm_compress_create(&cz, &cfg));
    safetensors_seeds();
    st_index_seeds();
    cfg_seeds();
    proto_seeds();
    decode_seeds();
    compress_seeds();
    shard_seeds();
    dataset_seeds();
    runcfg_seeds();
    cm_compress_destroy(&cz);
    return 0;
}
