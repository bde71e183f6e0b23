/* tests/test_dt_shards.c — `drafter-trainer shards inspect|export` on a shard directory built
 * from real ANSWER frames (hidden states encoded with cm_compress in every encoding, framed by
 * cm_proto_answer_encode, stored by cm_shard): inspect prints the identity and counts and
 * --verify passes; export writes safetensors equal to the original tensors bit for bit for the
 * lossless encodings (and to the codec's own decode for fp8-zstd); a corrupted payload, and a
 * record whose frame is bad under consistent record checksums, are named by inspect --verify and
 * refused by export; bad usage exits 2 and bad input exits 1, each with one message. */
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cm_compress.h"
#include "cm_hash.h"
#include "cm_safetensors.h"
#include "cm_shard.h"
#include "tst.h"
#include "tst_proc.h"

static char tmp[64], bin[1024], store[512];

#define D 64
static const int32_t LAYERS[3] = {1, 5, 9};

/* The batches: id, tokens, encoding of their hidden states. */
typedef struct batch {
    uint64_t    id;
    int         T;
    cm_encoding enc;
    uint16_t   *hidden[3]; /* BF16 [T, D] per layer: the originals */
    float      *norm;      /* F32 [T, D] "final_norm" (batch 3 only) */
} batch;

static batch B[4] = {{3, 7, CM_ENCODING_ZSTD_BYTEPLANE, {0}, NULL},
                     {10, 33, CM_ENCODING_ZSTD, {0}, NULL},
                     {11, 1, CM_ENCODING_RAW, {0}, NULL},
                     {42, 100, CM_ENCODING_FP8_ZSTD, {0}, NULL}};

static float gauss(uint64_t *s) { /* sum of uniforms: smooth, hidden-state-like values */
    float a = 0;
    for (int i = 0; i < 4; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        a += (float)((*s >> 40) & 0xffffff) / 16777216.0f - 0.5f;
    }
    return a;
}

static cm_shard_identity ident(void) {
    cm_shard_identity id;
    memset(&id, 0, sizeof id);
    id.target_id = 0x1234abcd5678ef01ull;
    snprintf(id.target_name, sizeof id.target_name, "tiny-qwen35");
    id.hidden_dtype = CM_DTYPE_BF16;
    id.encoding = CM_ENCODING_ZSTD_BYTEPLANE;
    id.hidden_size = D;
    id.n_layers = 3;
    memcpy(id.layer_ids, LAYERS, sizeof LAYERS);
    return id;
}

static void encode(cm_compress *cz, cm_proto_tensor *t, const char *name, cm_dtype dt, cm_encoding enc,
                   const void *src, int T) {
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt, t->encoding = enc, t->n_dims = 2, t->shape[0] = T, t->shape[1] = D;
    t->raw_size = (uint64_t)T * D * cm_dtype_size(dt);
    size_t cap = cm_compress_bound(cz, enc, dt, T, D);
    TST_CHECK(cap > 0);
    void  *dst = malloc(cap);
    size_t len = 0;
    TST_CHECK(cm_compress_encode(cz, enc, dt, src, T, D, dst, cap, &len) == CM_OK);
    t->encoded_size = len;
    t->data = dst;
}

static void build_store(void) {
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cm_compress       *cz = NULL;
    cc.n_threads = 2;
    TST_CHECK(cm_compress_create(&cz, &cc) == CM_OK);
    cm_shard_identity            id = ident();
    const cm_shard_writer_config cfg = {16384, 2, 0}; /* small shards: several files */
    cm_shard_writer             *w = NULL;
    snprintf(store, sizeof store, "%s/shards", tmp);
    TST_CHECK(cm_shard_writer_create(&w, store, &id, &cfg) == CM_OK);
    uint64_t s = 12345;
    for (int b = 0; b < 4 && cz && w; b++) {
        cm_proto_tensor t[4];
        int             n = 0;
        for (int l = 0; l < 3; l++) {
            B[b].hidden[l] = malloc((size_t)B[b].T * D * 2);
            for (int i = 0; i < B[b].T * D; i++)
                B[b].hidden[l][i] = cm_f32_to_bf16(gauss(&s) * (float)(l + 1));
            char name[32];
            snprintf(name, sizeof name, "layer_%d", LAYERS[l]);
            encode(cz, &t[n++], name, CM_DTYPE_BF16, B[b].enc, B[b].hidden[l], B[b].T);
        }
        if (b == 0) {
            B[b].norm = malloc((size_t)B[b].T * D * 4);
            for (int i = 0; i < B[b].T * D; i++)
                B[b].norm[i] = gauss(&s);
            encode(cz, &t[n++], "final_norm", CM_DTYPE_F32, CM_ENCODING_ZSTD_BYTEPLANE, B[b].norm, B[b].T);
        }
        cm_proto_answer a = {.batch_id = B[b].id, .n_tensors = (uint32_t)n, .tensors = t, .cap_tensors = 4};
        size_t          cap = cm_proto_answer_head_size(&a), len = 0;
        for (int i = 0; i < n; i++)
            cap += t[i].encoded_size;
        uint8_t *frame = malloc(cap);
        TST_CHECK(cm_proto_answer_encode(&a, frame, cap, &len) == CM_OK && len == cap);
        TST_CHECK(cm_shard_writer_append(w, B[b].id, b == 2 ? 0 : 1000 + B[b].id, frame, len) == CM_OK);
        free(frame);
        for (int i = 0; i < n; i++)
            free((void *)t[i].data);
    }
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    cm_compress_destroy(&cz);
}

/* Runs the binary with args; stdout to out, stderr to err (both files under tmp). */
static int run(const char *const *args, const char **out, const char **err) {
    static char out_buf[1 << 16], err_buf[1 << 16];
    char        out_path[600], err_path[600];
    char       *argv[16];
    int         n = 0;
    argv[n++] = bin;
    for (; args[n - 1] && n < 15; n++)
        argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    snprintf(out_path, sizeof out_path, "%s/stdout.txt", tmp);
    snprintf(err_path, sizeof err_path, "%s/stderr.txt", tmp);
    setenv("ASAN_OPTIONS", "exitcode=86", 1);
    setenv("UBSAN_OPTIONS", "halt_on_error=1:exitcode=87:print_stacktrace=1", 1);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid;
    int   rc = posix_spawn(&pid, bin, &fa, NULL, argv, environ), status = 0;
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0 || waitpid(pid, &status, 0) < 0)
        return -1;
    snprintf(out_buf, sizeof out_buf, "%s", tst_slurp(out_path));
    snprintf(err_buf, sizeof err_buf, "%s", tst_slurp(err_path));
    *out = out_buf, *err = err_buf;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#define EXPECT_RUN(want_rc, want_out, want_err, ...)                                                         \
    do {                                                                                                     \
        const char *a_[] = {__VA_ARGS__, NULL}, *o_ = "", *e_ = "";                                          \
        int         rc_ = run(a_, &o_, &e_);                                                                 \
        TST_CHECK(rc_ == (want_rc));                                                                         \
        TST_CHECK(strstr(o_, (want_out)) != NULL);                                                           \
        TST_CHECK(strstr(e_, (want_err)) != NULL);                                                           \
        if (rc_ != (want_rc) || !strstr(o_, (want_out)) || !strstr(e_, (want_err)))                          \
            fprintf(stderr, "  rc %d (want %d)\n  stdout: %s\n  stderr: %s\n  wanted '%s' / '%s'\n", rc_,    \
                    (want_rc), o_, e_, (want_out), (want_err));                                              \
    } while (0)

static void test_inspect(void) {
    EXPECT_RUN(0, "records          4 (batch ids 3 .. 42)", "", "shards", "inspect", store, "--verify");
    EXPECT_RUN(0, "target           tiny-qwen35 (id 1234abcd5678ef01)", "", "shards", "inspect", store);
    EXPECT_RUN(0, "64 x BF16, 3 taps: layers 1,5,9", "", "shards", "inspect", store);
    EXPECT_RUN(0, "encoding         zstd-byteplane", "", "shards", "inspect", store);
    EXPECT_RUN(0, "verified         4 records: every checksum holds", "", "shards", "inspect", store,
               "--verify", "--threads", "2");
    EXPECT_RUN(0, "shard-00000.bin", "", "shards", "inspect", store);
    EXPECT_RUN(0, "batch hashes     recorded for 3 of 4 records", "", "shards", "inspect", store);
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, store, NULL) == CM_OK);
    TST_CHECK(r && cm_shard_reader_n_shards(r) >= 2);
    cm_shard_reader_destroy(&r);
}

/* Decodes a tensor of the store in-process (the reference for fp8-zstd). */
static void *decode_here(uint64_t id, const char *name, size_t *n) {
    static const cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    cm_shard_reader             *r = NULL;
    cm_compress                 *cz = NULL;
    cm_compress_config           cc = CM_COMPRESS_CONFIG_DEFAULT;
    cm_proto_tensor              t[4];
    cm_proto_answer              a = {.tensors = t, .cap_tensors = 4};
    const void                  *f;
    size_t                       len;
    void                        *out = NULL;
    TST_CHECK(cm_shard_reader_open(&r, store, NULL) == CM_OK);
    TST_CHECK(cm_compress_create(&cz, &cc) == CM_OK);
    TST_CHECK(r && cm_shard_reader_get(r, id, 0, &f, &len) == CM_OK);
    TST_CHECK(r && cm_proto_answer_decode(f, len, &lim, &a) == CM_OK);
    for (uint32_t i = 0; i < a.n_tensors; i++)
        if (strcmp(t[i].name, name) == 0) {
            out = malloc(t[i].raw_size);
            *n = t[i].raw_size;
            TST_CHECK(cm_compress_decode_tensor(cz, &t[i], out, *n) == CM_OK);
        }
    cm_compress_destroy(&cz);
    cm_shard_reader_destroy(&r);
    return out;
}

static void test_export(void) {
    char out[600];
    snprintf(out, sizeof out, "%s/export.safetensors", tmp);
    EXPECT_RUN(0, "wrote 10 tensors of 3 batches", "", "shards", "export", store, "--batch", "3,11,42",
               "--out", out);
    cm_st *st = NULL;
    TST_CHECK(cm_st_open_file(&st, out) == CM_OK);
    if (!st)
        return;
    TST_CHECK(cm_st_count(st) == 10);
    for (int b = 0; b < 4; b++) {
        for (int l = 0; l < 3; l++) {
            char tname[32], name[64];
            snprintf(tname, sizeof tname, "layer_%d", LAYERS[l]);
            snprintf(name, sizeof name, "%llu/%s", (unsigned long long)B[b].id, tname);
            const cm_st_tensor *t = cm_st_find(st, name);
            if (b == 1) { /* batch 10 was not asked for */
                TST_CHECK(t == NULL);
                continue;
            }
            TST_CHECK(t && t->dtype == CM_DTYPE_BF16 && t->n_dims == 2 && t->shape[0] == B[b].T &&
                      t->shape[1] == D);
            if (!t || t->nbytes != (size_t)B[b].T * D * 2)
                continue;
            if (B[b].enc != CM_ENCODING_FP8_ZSTD) {
                TST_CHECK(memcmp(t->data, B[b].hidden[l], t->nbytes) == 0); /* lossless: bit-exact */
                continue;
            }
            size_t n = 0;
            void  *ref = decode_here(B[b].id, tname, &n);
            TST_CHECK(ref && n == t->nbytes && memcmp(ref, t->data, n) == 0);
            /* and within the documented fp8 bound of the originals (per row: 2^-4|x| + 2^-10 scale + bf16) */
            const uint16_t *got = t->data;
            int             bad = 0;
            for (int row = 0; row < B[b].T; row++) {
                float amax = 0;
                for (int j = 0; j < D; j++)
                    amax = fmaxf(amax, fabsf(cm_bf16_to_f32(B[b].hidden[l][row * D + j])));
                for (int j = 0; j < D; j++) {
                    float x = cm_bf16_to_f32(B[b].hidden[l][row * D + j]),
                          y = cm_bf16_to_f32(got[row * D + j]);
                    if (!(fabsf(y - x) <= 0.0625f * fabsf(x) + amax / 448.0f / 1024.0f + fabsf(y) / 256.0f))
                        bad++;
                }
            }
            TST_CHECK(bad == 0);
            free(ref);
        }
    }
    const cm_st_tensor *fn = cm_st_find(st, "3/final_norm");
    TST_CHECK(fn && fn->dtype == CM_DTYPE_F32 && fn->nbytes == (size_t)B[0].T * D * 4 &&
              memcmp(fn->data, B[0].norm, fn->nbytes) == 0);
    const char *m;
    TST_CHECK((m = cm_st_metadata(st, "target_id")) && strcmp(m, "1234abcd5678ef01") == 0);
    TST_CHECK((m = cm_st_metadata(st, "layer_ids")) && strcmp(m, "1,5,9") == 0);
    TST_CHECK((m = cm_st_metadata(st, "batches")) && strcmp(m, "3,11,42") == 0);
    TST_CHECK((m = cm_st_metadata(st, "lossy")) && strstr(m, "fp8-zstd"));
    cm_st_destroy(&st);

    /* one lossless batch: no "lossy" note */
    EXPECT_RUN(0, "wrote 3 tensors of 1 batches", "", "shards", "export", store, "--batch", "10", "--out",
               out);
    TST_CHECK(cm_st_open_file(&st, out) == CM_OK);
    const cm_st_tensor *t = st ? cm_st_find(st, "10/layer_9") : NULL;
    TST_CHECK(t && t->nbytes == (size_t)B[1].T * D * 2 && memcmp(t->data, B[1].hidden[2], t->nbytes) == 0);
    TST_CHECK(st && cm_st_metadata(st, "lossy") == NULL);
    cm_st_destroy(&st);
}

static void test_bad_usage(void) {
    char out[600];
    snprintf(out, sizeof out, "%s/bad.safetensors", tmp);
    EXPECT_RUN(2, "", "expected 'inspect DIR' or 'export DIR'", "shards");
    EXPECT_RUN(2, "", "expected 'inspect DIR' or 'export DIR'", "shards", "list", store);
    EXPECT_RUN(0, "usage: drafter-trainer shards inspect", "", "shards", "--help");
    EXPECT_RUN(2, "", "unknown option '--bogus'", "shards", "inspect", store, "--bogus", "1");
    EXPECT_RUN(2, "", "unknown option '--verify'", "shards", "export", store, "--verify");
    EXPECT_RUN(2, "", "--batch and --out are required", "shards", "export", store, "--batch", "3");
    EXPECT_RUN(2, "", "expected decimal batch ids", "shards", "export", store, "--batch", "3,x", "--out",
               out);
    EXPECT_RUN(2, "", "expected decimal batch ids", "shards", "export", store, "--batch", "3,", "--out", out);
    EXPECT_RUN(2, "", "batch 3 is named twice", "shards", "export", store, "--batch", "3,3", "--out", out);
    EXPECT_RUN(2, "", "--threads '0'", "shards", "inspect", store, "--threads", "0");
    EXPECT_RUN(2, "", "one directory only", "shards", "inspect", store, store);
    EXPECT_RUN(2, "", "needs a value", "shards", "export", store, "--out");
    EXPECT_RUN(1, "", "holds no batch 7 (4 records", "shards", "export", store, "--batch", "3,7", "--out",
               out);
    TST_CHECK(access(out, F_OK) != 0);
    EXPECT_RUN(1, "", "cannot open shard index", "shards", "inspect", "/nonexistent-dir");
    EXPECT_RUN(1, "", "cannot", "shards", "export", store, "--batch", "3", "--out",
               "/nonexistent-dir/x.safetensors");
}

/* Reads len bytes at off of path into buf, or writes them (w = 1). */
static void file_io(const char *path, long off, void *buf, size_t len, int w) {
    FILE *f = fopen(path, w ? "r+b" : "rb");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, off, SEEK_SET);
    TST_CHECK((w ? fwrite(buf, 1, len, f) : fread(buf, 1, len, f)) == len);
    fclose(f);
}

static void test_corrupt(void) {
    cm_shard_reader *r = NULL;
    cm_shard_entry   e;
    uint64_t         i = 0;
    char             shard[600], idx[600], want[200], out[600];
    TST_CHECK(cm_shard_reader_open(&r, store, NULL) == CM_OK);
    TST_CHECK(r && cm_shard_reader_find(r, 10, &i));
    if (!r)
        return;
    cm_shard_reader_entry(r, i, &e);
    cm_shard_reader_destroy(&r);
    snprintf(shard, sizeof shard, "%s/shard-%05u.bin", store, e.shard);
    snprintf(idx, sizeof idx, "%s/index.bin", store);
    snprintf(out, sizeof out, "%s/corrupt.safetensors", tmp);
    long    data_at = (long)(e.offset + CM_SHARD_RECORD_HEADER_SIZE + e.length - 5); /* in the last tensor */
    uint8_t byte;
    file_io(shard, data_at, &byte, 1, 0);
    byte ^= 0x01;
    file_io(shard, data_at, &byte, 1, 1);

    /* the record's checksum catches it */
    snprintf(want, sizeof want, "shard-%05u.bin offset %llu (batch 10): payload checksum mismatch", e.shard,
             (unsigned long long)e.offset);
    EXPECT_RUN(1, "records          4", want, "shards", "inspect", store, "--verify");
    EXPECT_RUN(1, "", "1 records of", "shards", "inspect", store, "--verify");
    EXPECT_RUN(0, "records          4", "", "shards", "inspect",
               store); /* without --verify: the index only */
    EXPECT_RUN(1, "", want, "shards", "export", store, "--batch", "10", "--out", out);
    TST_CHECK(access(out, F_OK) != 0);
    EXPECT_RUN(0, "wrote 4 tensors of 1 batches", "", "shards", "export", store, "--batch", "3", "--out",
               out);

    /* the same damage under consistent record checksums (record header and index entry rewritten):
     * the frame's own tensor checksum catches it */
    uint8_t *payload = malloc(e.length), h[CM_SHARD_RECORD_HEADER_SIZE], en[CM_SHARD_ENTRY_SIZE];
    file_io(shard, (long)(e.offset + CM_SHARD_RECORD_HEADER_SIZE), payload, e.length, 0);
    uint64_t sum = cm_xxh64(payload, e.length, 0);
    free(payload);
    file_io(shard, (long)e.offset, h, sizeof h, 0);
    tst_put64(h + 24, sum);
    tst_put64(h + 40, cm_xxh64(h, 40, 0));
    file_io(shard, (long)e.offset, h, sizeof h, 1);
    long en_at = (long)(CM_SHARD_INDEX_HEADER_SIZE + i * CM_SHARD_ENTRY_SIZE);
    file_io(idx, en_at, en, sizeof en, 0);
    tst_put64(en + 32, sum);
    tst_put64(en + 56, cm_xxh64(en, 56, 0));
    file_io(idx, en_at, en, sizeof en, 1);
    snprintf(want, sizeof want, "(batch 10): the ANSWER frame is bad");
    EXPECT_RUN(1, "", want, "shards", "inspect", store, "--verify");
    EXPECT_RUN(1, "", "checksum mismatch", "shards", "inspect", store, "--verify");
    unlink(out);
    EXPECT_RUN(1, "", want, "shards", "export", store, "--batch", "3,10", "--out", out);
    TST_CHECK(access(out, F_OK) != 0);
}

int main(void) {
    snprintf(bin, sizeof bin, "%s/drafter-trainer/drafter-trainer", TANDEM_BINARY_DIR);
    snprintf(tmp, sizeof tmp, "/tmp/test_dt_shards.XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    build_store();
    test_inspect();
    test_export();
    test_bad_usage();
    test_corrupt();
    for (int b = 0; b < 4; b++) {
        for (int l = 0; l < 3; l++)
            free(B[b].hidden[l]);
        free(B[b].norm);
    }
    return tst_cleanup(tmp, tst_report());
}
