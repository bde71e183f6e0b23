/* tests/test_cm_shard.c — the shard store: records of varied sizes over several shards read back
 * byte-exact; reopen and append; resume after a partial record, after records written but not
 * indexed, after a torn index, and after kill -9 of a real writer at random moments (this
 * executable re-runs itself as the writer: `test_cm_shard --writer DIR N DELAY_US`); corrupted
 * payload, record header, index header and entries, entries pointing outside a shard, a wrong
 * identity and bad appends are refused with a message naming the problem; a verifying writer
 * lists damaged records and restores them in place only from the original bytes; a differing
 * weights fingerprint is refused, a version-1 store is read but not appended to; random damage never
 * makes the reader hand out a record that differs from what was written. Seed: TST_SEED or time. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_hash.h"
#include "cm_log.h"
#include "cm_shard.h"
#include "tst.h"

extern char **environ;

#define EXPECT_FAIL TST_EXPECT_FAIL /* tst.h */

static char     tmp[64];
static uint64_t rng_state;

static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// ---- frames: deterministic ANSWER frames of a given batch id and data size

static uint8_t *make_frame_n(uint64_t id, size_t n, size_t *len) {
    uint8_t *data = malloc(n);
    int32_t  idw[2] = {(int32_t)(uint32_t)id, (int32_t)(uint32_t)(id >> 32)};
    for (size_t i = 0; i < n; i++)
        data[i] = (uint8_t)(id * 131 + i * 7 + (i >> 8));
    cm_proto_tensor t[2];
    memset(t, 0, sizeof t);
    snprintf(t[0].name, sizeof t[0].name, "layer_3");
    t[0].dtype = CM_DTYPE_U8, t[0].encoding = CM_ENCODING_RAW, t[0].n_dims = 1, t[0].shape[0] = (int64_t)n;
    t[0].raw_size = t[0].encoded_size = n, t[0].data = data;
    snprintf(t[1].name, sizeof t[1].name, "batch_id");
    t[1].dtype = CM_DTYPE_I32, t[1].encoding = CM_ENCODING_RAW, t[1].n_dims = 1, t[1].shape[0] = 2;
    t[1].raw_size = t[1].encoded_size = 8, t[1].data = idw;
    cm_proto_answer a = {.batch_id = id, .n_tensors = 2, .tensors = t, .cap_tensors = 2};
    size_t          cap = cm_proto_answer_head_size(&a) + n + 8;
    uint8_t        *f = malloc(cap);
    CM_ASSERT(cm_proto_answer_encode(&a, f, cap, len) == CM_OK);
    free(data);
    return f;
}

/* Batch 77 is larger than the SMALL shard size (it must fill a shard alone). */
static size_t frame_size_of(uint64_t id) {
    return id == 77 ? 10000 : 1 + (size_t)((id * 2654435761u) % 2500);
}
static uint8_t *make_frame(uint64_t id, size_t *len) {
    return make_frame_n(id, frame_size_of(id), len);
}

/* The fingerprint of batch id's (made-up) request. */
static uint64_t hash_of(uint64_t id) {
    int32_t tokens[3] = {(int32_t)(uint32_t)id, (int32_t)(uint32_t)(id >> 32), 7}, cu[2] = {0, 3};
    return cm_shard_batch_hash(tokens, 3, cu, 1);
}

static cm_shard_identity ident(void) {
    cm_shard_identity id;
    memset(&id, 0, sizeof id);
    id.target_id = 0x1234abcd5678ef01ull;
    snprintf(id.target_name, sizeof id.target_name, "tiny-qwen35");
    id.hidden_dtype = CM_DTYPE_BF16;
    id.encoding = CM_ENCODING_ZSTD_BYTEPLANE;
    id.hidden_size = 64;
    id.n_layers = 3;
    id.layer_ids[0] = 1, id.layer_ids[1] = 5, id.layer_ids[2] = 9;
    return id;
}

static const cm_shard_writer_config SMALL = {8192, 5, 0};

/* Appends ids[0..n) (frames made from each id). */
static void put_ids(cm_shard_writer *w, const uint64_t *ids, int n) {
    for (int i = 0; i < n; i++) {
        size_t   len;
        uint8_t *f = make_frame(ids[i], &len);
        TST_CHECK(cm_shard_writer_append(w, ids[i], hash_of(ids[i]), f, len) == CM_OK);
        free(f);
    }
}

static void put_range(cm_shard_writer *w, uint64_t a, uint64_t b) {
    for (uint64_t id = a; id < b; id++)
        put_ids(w, &id, 1);
}

/* The store at dir must hold exactly ids[0..n) in that order, each byte-exact. */
static void expect_store(const char *dir, const uint64_t *ids, uint64_t n) {
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    if (!r) {
        fprintf(stderr, "  %s\n", cm_last_error());
        return;
    }
    TST_CHECK(cm_shard_reader_count(r) == n);
    for (uint64_t i = 0; i < n && i < cm_shard_reader_count(r); i++) {
        const void    *p = NULL;
        size_t         len = 0, want_len;
        uint8_t       *want = make_frame(ids[i], &want_len);
        cm_shard_entry e;
        cm_shard_reader_entry(r, i, &e);
        TST_CHECK(e.batch_id == ids[i] && e.batch_hash == hash_of(ids[i]));
        TST_CHECK(cm_shard_reader_at(r, i, &p, &len) == CM_OK);
        TST_CHECK(len == want_len && p && memcmp(p, want, len) == 0);
        TST_CHECK(cm_shard_reader_get(r, ids[i], hash_of(ids[i]), &p, &len) == CM_OK);
        TST_CHECK(len == want_len && p && memcmp(p, want, len) == 0);
        TST_CHECK(e.n_tensors == 2 && e.raw_bytes == frame_size_of(ids[i]) + 8);
        free(want);
    }
    cm_shard_reader_destroy(&r);
}

static void expect_range(const char *dir, uint64_t n) {
    uint64_t *ids = malloc(n * sizeof *ids + 1);
    for (uint64_t i = 0; i < n; i++)
        ids[i] = i;
    expect_store(dir, ids, n);
    free(ids);
}

// ---- files

static void path_of(char *dst, const char *dir, const char *name) {
    int n = snprintf(dst, 512, "%s/%s", dir, name);
    CM_ASSERT(n > 0 && n < 512);
}

static long fsize(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

static void patch(const char *path, long off, const void *bytes, size_t n) {
    FILE *f = fopen(path, "r+b");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, off, SEEK_SET);
    TST_CHECK(fwrite(bytes, 1, n, f) == n);
    fclose(f);
}

static void flip(const char *path, long off) {
    uint8_t b = 0;
    FILE   *f = fopen(path, "rb");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, off, SEEK_SET);
    TST_CHECK(fread(&b, 1, 1, f) == 1);
    fclose(f);
    b ^= 0x20;
    patch(path, off, &b, 1);
}

static void append_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "ab");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    TST_CHECK(fwrite(p, 1, n, f) == n);
    fclose(f);
}

static void rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d));) {
        char p[512];
        if (de->d_name[0] == '.')
            continue;
        path_of(p, dir, de->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(dir);
}

static void copy_dir(const char *src, const char *dst) {
    rm_dir(dst);
    mkdir(dst, 0755);
    DIR *d = opendir(src);
    for (struct dirent *de; d && (de = readdir(d));) {
        char a[512], b[512];
        if (de->d_name[0] == '.')
            continue;
        path_of(a, src, de->d_name);
        path_of(b, dst, de->d_name);
        FILE *fi = fopen(a, "rb"), *fo = fopen(b, "wb");
        char  buf[8192];
        for (size_t n; fi && fo && (n = fread(buf, 1, sizeof buf, fi)) > 0;)
            TST_CHECK(fwrite(buf, 1, n, fo) == n);
        if (fi)
            fclose(fi);
        if (fo)
            fclose(fo);
    }
    if (d)
        closedir(d);
}

static void mk(char *dst, const char *name) {
    snprintf(dst, 512, "%s/%s", tmp, name);
    rm_dir(dst);
}

/* Rewrites index entry i of dir through fn, with a valid checksum. */
static void put64le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put32le(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void rewrite_entry(const char *dir, long i, int field, uint64_t v) {
    char    path[512];
    uint8_t e[CM_SHARD_ENTRY_SIZE];
    path_of(path, dir, "index.bin");
    FILE *f = fopen(path, "rb");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, CM_SHARD_INDEX_HEADER_SIZE + i * CM_SHARD_ENTRY_SIZE, SEEK_SET);
    TST_CHECK(fread(e, 1, sizeof e, f) == sizeof e);
    fclose(f);
    if (field == 8)
        put32le(e + 8, (uint32_t)v); /* shard */
    else
        put64le(e + field, v); /* 0 batch_id, 16 offset, 24 length, 48 batch_hash */
    put64le(e + 56, cm_xxh64(e, 56, 0));
    patch(path, CM_SHARD_INDEX_HEADER_SIZE + i * CM_SHARD_ENTRY_SIZE, e, sizeof e);
}

static void entry_of(const char *dir, uint64_t batch_id, cm_shard_entry *e) {
    cm_shard_reader *r = NULL;
    uint64_t         i = 0;
    memset(e, 0, sizeof *e);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    TST_CHECK(r && cm_shard_reader_find(r, batch_id, &i));
    if (r)
        cm_shard_reader_entry(r, i, e);
    cm_shard_reader_destroy(&r);
}

static void shard_file(char *dst, const char *dir, uint32_t k) {
    char name[32];
    snprintf(name, sizeof name, "shard-%05u.bin", k);
    path_of(dst, dir, name);
}

static uint32_t n_shards(const char *dir) {
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    uint32_t k = r ? cm_shard_reader_n_shards(r) : 0;
    cm_shard_reader_destroy(&r);
    return k;
}

/* A store of ids 0..n-1 with the SMALL config; returns its number of shards. */
static uint32_t build(const char *dir, uint64_t n) {
    cm_shard_identity id = ident();
    cm_shard_writer  *w = NULL;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (!w)
        return 0;
    put_range(w, 0, n);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    return n_shards(dir);
}

// ---- tests

static void test_roundtrip(void) {
    char dir[512];
    mk(dir, "rt");
    cm_shard_identity id = ident();
    cm_shard_writer  *w = NULL;
    uint64_t          ids[80];
    int               n = 0;
    ids[n++] = 0;
    ids[n++] = UINT64_MAX;
    for (int i = 0; i < 50; i++)
        ids[n++] = 1000003ull * (uint64_t)i * 0x9e3779b97f4a7c15ull + 17;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (!w)
        return;
    put_ids(w, ids, n);
    /* a record larger than the shard size fills a shard alone */
    size_t   big_len;
    uint8_t *big = make_frame(77, &big_len);
    TST_CHECK(big_len > 10000 && cm_shard_writer_append(w, 77, hash_of(77), big, big_len) == CM_OK);
    ids[n++] = 77;
    TST_CHECK(cm_shard_writer_count(w) == (uint64_t)n);
    TST_CHECK(cm_shard_writer_durable(w) < cm_shard_writer_count(w)); /* fsync_every 5: some pending */
    TST_CHECK(cm_shard_writer_has(w, UINT64_MAX) && cm_shard_writer_has(w, 77) &&
              !cm_shard_writer_has(w, 78));
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK && w == NULL);

    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, dir, &id) == CM_OK);
    if (!r)
        return;
    TST_CHECK(cm_shard_reader_count(r) == (uint64_t)n);
    TST_CHECK(cm_shard_reader_n_shards(r) >= 4);
    const cm_shard_identity *got = cm_shard_reader_identity(r);
    TST_CHECK(got->target_id == id.target_id && strcmp(got->target_name, "tiny-qwen35") == 0);
    TST_CHECK(got->n_layers == 3 && got->layer_ids[2] == 9 && got->hidden_size == 64);
    TST_CHECK(got->hidden_dtype == CM_DTYPE_BF16 && got->encoding == CM_ENCODING_ZSTD_BYTEPLANE);
    uint64_t total = 0;
    for (uint32_t k = 0; k < cm_shard_reader_n_shards(r); k++) {
        cm_shard_info s;
        cm_shard_reader_shard(r, k, &s);
        TST_CHECK(s.n_records >= 1 && s.bytes == s.file_bytes && fsize(s.path) == (long)s.bytes);
        TST_CHECK(s.bytes <= SMALL.max_shard_bytes || s.n_records == 1);
        TST_CHECK(s.first == total);
        total += s.n_records;
    }
    TST_CHECK(total == (uint64_t)n);
    const void *p;
    size_t      len;
    TST_CHECK(cm_shard_reader_get(r, 77, 0, &p, &len) == CM_OK && len == big_len && memcmp(p, big, len) == 0);
    EXPECT_FAIL(cm_shard_reader_get(r, 78, 0, &p, &len), CM_ERR_INVALID_ARG, "holds no batch 78");
    EXPECT_FAIL(cm_shard_reader_get(r, 77, hash_of(77) ^ 1, &p, &len), CM_ERR_INVALID_ARG,
                "batch 77 was computed for other tokens");
    EXPECT_FAIL(cm_shard_reader_at(r, (uint64_t)n, &p, &len), CM_ERR_INVALID_ARG, "record");
    cm_shard_reader_destroy(&r);
    cm_shard_reader_destroy(&r); /* NULL-safe */
    free(big);
    expect_store(dir, ids, (uint64_t)n);

    /* reopen and append more */
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (!w)
        return;
    TST_CHECK(cm_shard_writer_count(w) == (uint64_t)n && cm_shard_writer_durable(w) == (uint64_t)n);
    for (int i = 0; i < n; i++)
        TST_CHECK(cm_shard_writer_has(w, ids[i]));
    size_t   len0;
    uint8_t *f0 = make_frame(0, &len0);
    EXPECT_FAIL(cm_shard_writer_append(w, 0, hash_of(0), f0, len0), CM_ERR_INVALID_ARG,
                "already holds batch 0");
    free(f0);
    for (uint64_t i = 0; i < 20; i++)
        ids[n++] = 5000 + i;
    put_ids(w, ids + n - 20, 20);
    TST_CHECK(cm_shard_writer_sync(w) == CM_OK && cm_shard_writer_durable(w) == (uint64_t)n);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK); /* NULL-safe */
    cm_shard_writer_destroy(&w);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    if (r) {
        cm_shard_entry e;
        cm_shard_reader_entry(r, cm_shard_reader_count(r) - 1, &e);
        TST_CHECK(cm_shard_reader_count(r) == (uint64_t)n && e.batch_id == 5019);
        for (int i = 0; i < n; i++) {
            uint64_t at;
            TST_CHECK(cm_shard_reader_find(r, ids[i], &at));
        }
    }
    cm_shard_reader_destroy(&r);
    expect_store(dir, ids, (uint64_t)n);

    /* an empty store */
    mk(dir, "empty");
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, NULL) == CM_OK);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    TST_CHECK(cm_shard_reader_open(&r, dir, &id) == CM_OK);
    TST_CHECK(r && cm_shard_reader_count(r) == 0 && cm_shard_reader_n_shards(r) == 0);
    cm_shard_reader_destroy(&r);
}

/* An ANSWER appended in two parts (HEAD, DATA) is stored as the whole frame. */
static void test_parts(void) {
    char dir[512];
    mk(dir, "parts");
    cm_shard_identity            id = ident();
    cm_shard_writer             *w = NULL;
    static const cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    for (uint64_t b = 0; w && b < 12; b++) {
        size_t          len;
        uint8_t        *f = make_frame(b, &len);
        cm_proto_header h;
        TST_CHECK(cm_proto_peek(f, len, &lim, &h) == CM_OK);
        size_t head = CM_PROTO_HEADER_SIZE + h.body_len;
        if (b == 0) {
            EXPECT_FAIL(cm_shard_writer_append_parts(w, b, hash_of(b), f, head, f + head, len - head - 1),
                        CM_ERR_INVALID_ARG, "not a valid ANSWER frame");
            EXPECT_FAIL(
                cm_shard_writer_append_parts(w, b, hash_of(b), f, head - 1, f + head - 1, len - head + 1),
                CM_ERR_INVALID_ARG, "not a valid ANSWER frame");
        }
        TST_CHECK(cm_shard_writer_append_parts(w, b, hash_of(b), f, head, f + head, len - head) == CM_OK);
        free(f);
    }
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 12);
    /* an index entry whose batch hash differs from its record header's */
    rewrite_entry(dir, 4, 48, hash_of(4) ^ 1);
    cm_shard_reader *r = NULL;
    const void      *p;
    size_t           len;
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    if (r)
        EXPECT_FAIL(cm_shard_reader_get(r, 4, 0, &p, &len), CM_ERR_FORMAT, "record header says batch 4");
    cm_shard_reader_destroy(&r);
}

/* (a) a partial record at the end of the last shard, and a shard file past the last indexed one. */
static void test_partial_record(void) {
    char dir[512], path[512], extra[512];
    mk(dir, "partial");
    uint32_t k = build(dir, 20);
    TST_CHECK(k >= 2);
    cm_shard_entry e;
    entry_of(dir, 3, &e);
    shard_file(path, dir, k - 1);
    long end = fsize(path);
    /* the first 100 bytes of record 3 (header + part of its payload) appended as a torn record */
    char src[512];
    shard_file(src, dir, e.shard);
    FILE   *f = fopen(src, "rb");
    uint8_t rec[100];
    TST_CHECK(f && fseek(f, (long)e.offset, SEEK_SET) == 0 && fread(rec, 1, sizeof rec, f) == sizeof rec);
    if (f)
        fclose(f);
    append_bytes(path, rec, sizeof rec);
    shard_file(extra, dir, k + 1);
    append_bytes(extra, rec, 10);

    /* a reader ignores unindexed bytes */
    expect_range(dir, 20);
    cm_shard_identity id = ident();
    cm_shard_writer  *w = NULL;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    TST_CHECK(fsize(path) == end && fsize(extra) == -1);
    TST_CHECK(w && cm_shard_writer_count(w) == 20 && !cm_shard_writer_has(w, 20));
    if (w)
        put_range(w, 20, 30);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 30);

    /* a partial record shorter than a record header */
    shard_file(path, dir, n_shards(dir) - 1);
    append_bytes(path, rec, 7);
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (w)
        put_range(w, 30, 33);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 33);
}

/* (b) records written but not indexed (index cut back), and a torn index tail. */
static void test_unindexed(void) {
    char dir[512], idx[512], base[512];
    mk(base, "unindexed-base");
    mk(dir, "unindexed");
    uint32_t k = build(base, 30);
    TST_CHECK(k >= 3);
    path_of(idx, dir, "index.bin");
    cm_shard_identity id = ident();
    cm_shard_writer  *w = NULL;

    copy_dir(base, dir);
    TST_CHECK(truncate(idx, CM_SHARD_INDEX_HEADER_SIZE + 12 * CM_SHARD_ENTRY_SIZE) == 0);
    expect_range(dir, 12);
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    TST_CHECK(w && cm_shard_writer_count(w) == 12 && cm_shard_writer_has(w, 11) &&
              !cm_shard_writer_has(w, 12));
    if (w)
        put_range(w, 12, 30);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 30);

    /* nothing indexed at all: every shard file goes */
    copy_dir(base, dir);
    TST_CHECK(truncate(idx, CM_SHARD_INDEX_HEADER_SIZE) == 0);
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    char s0[512];
    shard_file(s0, dir, 0);
    TST_CHECK(w && cm_shard_writer_count(w) == 0 && fsize(s0) == -1);
    if (w)
        put_range(w, 0, 30);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 30);

    /* a partial entry at the end: the reader ignores it, the writer cuts it */
    copy_dir(base, dir);
    TST_CHECK(truncate(idx, CM_SHARD_INDEX_HEADER_SIZE + 12 * CM_SHARD_ENTRY_SIZE + 30) == 0);
    expect_range(dir, 12);
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    TST_CHECK(fsize(idx) == CM_SHARD_INDEX_HEADER_SIZE + 12 * CM_SHARD_ENTRY_SIZE);
    if (w)
        put_range(w, 12, 30);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 30);

    /* entries zeroed at the end (a torn append after a power loss): the reader refuses them, the
     * writer cuts them and writes those records again */
    copy_dir(base, dir);
    uint8_t zero[2 * CM_SHARD_ENTRY_SIZE] = {0};
    patch(idx, CM_SHARD_INDEX_HEADER_SIZE + 28 * CM_SHARD_ENTRY_SIZE, zero, sizeof zero);
    cm_shard_reader *r = NULL;
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "entry 28");
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    TST_CHECK(w && cm_shard_writer_count(w) == 28);
    if (w)
        put_range(w, 28, 30);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 30);
}

// ---- (c) kill -9 of a real writer

static int writer_main(const char *dir, uint64_t n, long delay_us) {
    cm_shard_identity            id = ident();
    const cm_shard_writer_config cfg = {16384, 4, 0};
    cm_shard_writer             *w = NULL;
    if (cm_shard_writer_create(&w, dir, &id, &cfg) != CM_OK) {
        fprintf(stderr, "writer: %s\n", cm_last_error());
        return 1;
    }
    for (uint64_t b = 0; b < n; b++) {
        if (cm_shard_writer_has(w, b))
            continue;
        size_t    len;
        uint8_t  *f = make_frame(b, &len);
        cm_status st = cm_shard_writer_append(w, b, hash_of(b), f, len);
        free(f);
        if (st != CM_OK) {
            fprintf(stderr, "writer: %s\n", cm_last_error());
            cm_shard_writer_destroy(&w);
            return 1;
        }
        usleep((useconds_t)delay_us);
    }
    if (cm_shard_writer_close(&w) != CM_OK) {
        fprintf(stderr, "writer: %s\n", cm_last_error());
        return 1;
    }
    return 0;
}

static pid_t spawn_writer(const char *dir, const char *n, const char *delay) {
    char *argv[] = {
        (char *)"/proc/self/exe", (char *)"--writer", (char *)dir, (char *)n, (char *)delay, NULL};
    char    self[512];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    if (k <= 0)
        return -1;
    self[k] = '\0';
    argv[0] = self;
    pid_t pid;
    if (posix_spawn(&pid, self, NULL, NULL, argv, environ) != 0)
        return -1;
    return pid;
}

/* What a killed writer leaves is a valid store (once its index exists) holding distinct ids
 * below n, each byte-exact. */
static void expect_prefix(const char *dir, uint64_t n) {
    char idx[512];
    path_of(idx, dir, "index.bin");
    if (fsize(idx) < 0)
        return; /* killed before the store was created */
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    for (uint64_t i = 0; r && i < cm_shard_reader_count(r); i++) {
        const void    *p;
        size_t         len, want_len;
        cm_shard_entry e;
        cm_shard_reader_entry(r, i, &e);
        TST_CHECK(e.batch_id < n && cm_shard_reader_at(r, i, &p, &len) == CM_OK);
        uint8_t *want = make_frame(e.batch_id, &want_len);
        TST_CHECK(len == want_len && memcmp(p, want, len) == 0);
        free(want);
    }
    if (getenv("TST_VERBOSE") && r)
        fprintf(stderr, "  killed: %llu records\n", (unsigned long long)cm_shard_reader_count(r));
    cm_shard_reader_destroy(&r);
}

/* Runs the writer for ids 0..n-1 in dir, killing it a random 0..kill_ms ms after it has made
 * progress in the first six rounds, then lets it finish; every id must end up stored exactly
 * once, byte-exact. */
static void kill_run(const char *name, uint64_t n, long delay_us, long kill_ms) {
    char dir[512], ns[32], ds[32];
    mk(dir, name);
    snprintf(ns, sizeof ns, "%llu", (unsigned long long)n);
    snprintf(ds, sizeof ds, "%ld", delay_us);
    int kills = 0, done = 0;
    for (int round = 0; round < 12 && !done; round++) {
        pid_t pid = spawn_writer(dir, ns, ds);
        TST_CHECK(pid > 0);
        if (pid <= 0)
            return;
        int status = 0, exited = 0;
        if (round < 6) {
            /* wait for progress (the index grows), so slow start-ups (sanitizers) do not eat the
             * window, then kill after a random delay */
            char idx[512];
            path_of(idx, dir, "index.bin");
            long size0 = fsize(idx);
            for (int ms = 0; ms < 10000 && fsize(idx) == size0; ms++) {
                if (waitpid(pid, &status, WNOHANG) == pid) {
                    exited = 1;
                    break;
                }
                usleep(1000);
            }
            if (!exited) {
                struct timespec ts = {0, (long)(rnd() % (uint64_t)kill_ms) * 1000000L};
                nanosleep(&ts, NULL);
                kill(pid, SIGKILL);
                TST_CHECK(waitpid(pid, &status, 0) == pid);
            }
            if (WIFSIGNALED(status)) {
                kills++;
                expect_prefix(dir, n);
                continue;
            }
        } else {
            TST_CHECK(waitpid(pid, &status, 0) == pid);
        }
        TST_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        done = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    TST_CHECK(done);
    fprintf(stderr, "kill test %s: %d writers killed mid-run, then completed\n", name, kills);
    TST_CHECK(kills >= 1);
    /* every id exactly once (the reader refuses duplicates), each byte-exact */
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    TST_CHECK(r && cm_shard_reader_count(r) == n);
    for (uint64_t b = 0; r && b < n; b++) {
        const void *p;
        size_t      len, want_len;
        uint8_t    *want = make_frame(b, &want_len);
        TST_CHECK(cm_shard_reader_get(r, b, hash_of(b), &p, &len) == CM_OK && len == want_len &&
                  memcmp(p, want, len) == 0);
        free(want);
    }
    cm_shard_reader_destroy(&r);
}

static void test_kill(void) {
    setenv("TANDEM_LOG", "error", 1);
    /* slow: the writer sleeps between records (kills land between appends and syncs) */
    kill_run("kill-slow", 150, 1500, 60);
    /* flat out: the writer is always inside append or fsync when the signal lands */
    kill_run("kill-fast", 300, 0, 30);
}

// ---- corruption, placement, identity, bad appends

static void test_corruption(void) {
    char base[512], dir[512], path[512], idx[512];
    mk(base, "corrupt-base");
    mk(dir, "corrupt");
    build(base, 20);
    path_of(idx, dir, "index.bin");
    cm_shard_reader  *r = NULL;
    cm_shard_writer  *w = NULL;
    cm_shard_identity id = ident();
    const void       *p;
    size_t            len;
    cm_shard_entry    e5, e7, last;
    entry_of(base, 5, &e5);
    entry_of(base, 7, &e7);
    entry_of(base, 19, &last);
    char want[160];

    /* a payload byte: detected when that record is handed out, naming shard, offset and batch */
    copy_dir(base, dir);
    shard_file(path, dir, e5.shard);
    flip(path, (long)e5.offset + CM_SHARD_RECORD_HEADER_SIZE + 60);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    snprintf(want, sizeof want, "shard-%05u.bin offset %llu (batch 5): payload checksum mismatch", e5.shard,
             (unsigned long long)e5.offset);
    if (r)
        EXPECT_FAIL(cm_shard_reader_get(r, 5, 0, &p, &len), CM_ERR_FORMAT, want);
    if (r)
        TST_CHECK(cm_shard_reader_get(r, 4, 0, &p, &len) == CM_OK &&
                  cm_shard_reader_get(r, 6, 0, &p, &len) == CM_OK);
    cm_shard_reader_destroy(&r);

    /* a record header byte */
    copy_dir(base, dir);
    shard_file(path, dir, e7.shard);
    flip(path, (long)e7.offset + 12);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    snprintf(want, sizeof want, "offset %llu (batch 7): record header checksum mismatch",
             (unsigned long long)e7.offset);
    if (r)
        EXPECT_FAIL(cm_shard_reader_get(r, 7, 0, &p, &len), CM_ERR_FORMAT, want);
    cm_shard_reader_destroy(&r);
    copy_dir(base, dir);
    flip(path, (long)e7.offset);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    if (r)
        EXPECT_FAIL(cm_shard_reader_get(r, 7, 0, &p, &len), CM_ERR_FORMAT, "bad record magic");
    cm_shard_reader_destroy(&r);

    /* the tail record of a shard: the writer's resume refuses the store */
    copy_dir(base, dir);
    shard_file(path, dir, last.shard);
    flip(path, (long)last.offset + CM_SHARD_RECORD_HEADER_SIZE + 3);
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_FORMAT, "(batch 19): payload checksum");
    TST_CHECK(w == NULL);

    /* the index header and a middle entry */
    copy_dir(base, dir);
    flip(idx, 40);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "index header checksum mismatch");
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_FORMAT,
                "index header checksum mismatch");
    copy_dir(base, dir);
    flip(idx, CM_SHARD_INDEX_HEADER_SIZE + 4 * CM_SHARD_ENTRY_SIZE + 17);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "entry 4");
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_FORMAT, "entry 4");
    copy_dir(base, dir);
    flip(idx, 0);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "not a shard index");
    copy_dir(base, dir);
    TST_CHECK(truncate(idx, 100) == 0);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "less than its 384-byte header");
}

/* A writer that verifies every record (cfg.verify) lists the damaged ones instead of refusing
 * the store, and writes one again in place only from the very bytes its entry names. */
static void test_repair(void) {
    char base[512], dir[512], path[512];
    mk(base, "repair-base");
    mk(dir, "repair");
    build(base, 20);
    cm_shard_entry e5, e7, last, e;
    entry_of(base, 5, &e5);
    entry_of(base, 7, &e7);
    entry_of(base, 19, &last);
    copy_dir(base, dir);
    shard_file(path, dir, e5.shard);
    flip(path, (long)e5.offset + CM_SHARD_RECORD_HEADER_SIZE + 60); /* a payload byte */
    shard_file(path, dir, e7.shard);
    flip(path, (long)e7.offset + 12); /* a record header byte */
    shard_file(path, dir, last.shard);
    flip(path, (long)last.offset + CM_SHARD_RECORD_HEADER_SIZE + 3); /* the store's tail record */
    cm_shard_writer_config vc = SMALL;
    vc.verify = 1;
    cm_shard_identity id = ident();
    cm_shard_writer  *w = NULL;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &vc) == CM_OK);
    if (!w)
        return;
    TST_CHECK(cm_shard_writer_n_damaged(w) == 3 && cm_shard_writer_count(w) == 20);
    TST_CHECK(cm_shard_writer_damaged(w, 5) && cm_shard_writer_damaged(w, 7) && cm_shard_writer_damaged(w, 19));
    TST_CHECK(!cm_shard_writer_damaged(w, 6) && !cm_shard_writer_damaged(w, 99) && cm_shard_writer_has(w, 5));
    TST_CHECK(cm_shard_writer_first_damaged(w, &e) && e.batch_id == 5 && e.offset == e5.offset);
    size_t   len, olen;
    uint8_t *f = make_frame(5, &len), *other = make_frame(6, &olen);
    EXPECT_FAIL(cm_shard_writer_restore_parts(w, 5, hash_of(5), other, olen, NULL, 0), CM_ERR_FORMAT,
                "(batch 5) is corrupted and cannot be restored in place");
    EXPECT_FAIL(cm_shard_writer_restore_parts(w, 5, hash_of(6), f, len, NULL, 0), CM_ERR_FORMAT,
                "cannot be restored in place");
    EXPECT_FAIL(cm_shard_writer_restore_parts(w, 6, hash_of(6), other, olen, NULL, 0), CM_ERR_INVALID_ARG,
                "batch 6 is not a damaged record");
    TST_CHECK(cm_shard_writer_damaged(w, 5)); /* a refused restore writes nothing */
    TST_CHECK(cm_shard_writer_restore_parts(w, 5, hash_of(5), f, 100, f + 100, len - 100) == CM_OK);
    TST_CHECK(!cm_shard_writer_damaged(w, 5) && cm_shard_writer_n_damaged(w) == 2);
    EXPECT_FAIL(cm_shard_writer_restore_parts(w, 5, hash_of(5), f, len, NULL, 0), CM_ERR_INVALID_ARG,
                "not a damaged record");
    free(f);
    free(other);
    for (uint64_t b = 7; b < 20; b += 12) {
        f = make_frame(b, &len);
        TST_CHECK(cm_shard_writer_restore_parts(w, b, 0, f, len, NULL, 0) == CM_OK); /* 0: hash not given */
        free(f);
    }
    TST_CHECK(cm_shard_writer_n_damaged(w) == 0 && !cm_shard_writer_first_damaged(w, &e));
    put_range(w, 20, 23); /* appending goes on after the restored tail */
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    expect_range(dir, 23);
    for (uint32_t k = 0; k + 1 < n_shards(base); k++) { /* byte-identical to the undamaged store */
        char a[512], b[512];
        shard_file(a, base, k);
        shard_file(b, dir, k);
        FILE   *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
        int     same = fa && fb;
        for (int ca = 0, cb = 0; same && ca != EOF; same = ca == cb)
            ca = fgetc(fa), cb = fgetc(fb);
        TST_CHECK(same);
        if (fa)
            fclose(fa);
        if (fb)
            fclose(fb);
    }
    /* without verify the same damage in a tail record still refuses the store */
    copy_dir(base, dir);
    shard_file(path, dir, last.shard);
    flip(path, (long)last.offset + CM_SHARD_RECORD_HEADER_SIZE + 3);
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_FORMAT, "(batch 19): payload checksum");
}

/* weights_id: a differing fingerprint is refused naming both and the config; a version-1 store
 * (before weights_id) is read with weights_id 0 but never appended to. */
static void test_weights(void) {
    char dir[512], idx[512];
    mk(dir, "weights");
    path_of(idx, dir, "index.bin");
    cm_shard_identity id = ident(), want;
    cm_shard_writer  *w = NULL;
    cm_shard_reader  *r = NULL;
    id.weights_id = 0xaaaa5555aaaa5555ull;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (!w)
        return;
    put_range(w, 0, 4);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    want = id;
    want.weights_id = 0xbbbb6666bbbb6666ull;
    const char *msg = "holds hidden states of the same architecture (config 1234abcd5678ef01), different "
                      "weights (fingerprint aaaa5555aaaa5555 in the store, bbbb6666bbbb6666 expected)";
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, &want), CM_ERR_INVALID_ARG, msg);
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &want, &SMALL), CM_ERR_INVALID_ARG, msg);
    want.target_id = 0; /* not compared: the store's config is named */
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, &want), CM_ERR_INVALID_ARG, msg);
    want = id;
    want.weights_id = 0; /* unknown: a reader does not compare it, a writer never mixes */
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &want, &SMALL), CM_ERR_INVALID_ARG,
                "weights with fingerprint aaaa5555aaaa5555, this run's weights have no fingerprint");
    TST_CHECK(cm_shard_reader_open(&r, dir, &want) == CM_OK);
    if (r) {
        TST_CHECK(cm_shard_reader_version(r) == CM_SHARD_VERSION &&
                  cm_shard_reader_identity(r)->weights_id == id.weights_id);
        cm_shard_reader_destroy(&r);
    }

    /* version 1: bytes 352..359 were reserved */
    uint8_t h[CM_SHARD_INDEX_HEADER_SIZE];
    FILE   *f = fopen(idx, "rb");
    TST_CHECK(f && fread(h, 1, sizeof h, f) == sizeof h);
    if (f)
        fclose(f);
    h[4] = 1;
    memset(h + 352, 0, 8);
    put64le(h + 376, cm_xxh64(h, 376, 0));
    patch(idx, 0, h, sizeof h);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    if (r) {
        TST_CHECK(cm_shard_reader_version(r) == 1 && cm_shard_reader_identity(r)->weights_id == 0);
        cm_shard_reader_destroy(&r);
    }
    expect_range(dir, 4);
    id.weights_id = 0;
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_FORMAT,
                "is shard format version 1 (written before the target's weights fingerprint");
    h[355] = 1; /* a version-1 store has no fingerprint there */
    put64le(h + 376, cm_xxh64(h, 376, 0));
    patch(idx, 0, h, sizeof h);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "reserved or padding bytes");
}

static void test_placement(void) {
    char base[512], dir[512], path[512];
    mk(base, "place-base");
    mk(dir, "place");
    uint32_t          k = build(base, 20);
    cm_shard_identity id = ident();
    cm_shard_reader  *r = NULL;
    cm_shard_writer  *w = NULL;
    cm_shard_entry    last;
    entry_of(base, 19, &last);

    /* the last entry claims more bytes than its shard has */
    copy_dir(base, dir);
    rewrite_entry(dir, 19, 24, last.length + 1000);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "but the file has");
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_FORMAT, "but the file has");
    /* ... a huge length */
    copy_dir(base, dir);
    rewrite_entry(dir, 19, 24, 1ull << 40);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "(batch 19) has length");
    /* ... a shard that does not exist */
    copy_dir(base, dir);
    rewrite_entry(dir, 19, 8, k);
    rewrite_entry(dir, 19, 16, 0);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "which is missing");
    /* ... an offset that breaks the tiling (a gap, an overlap, a jump of shards) */
    copy_dir(base, dir);
    rewrite_entry(dir, 19, 16, last.offset + 8);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "records are back to back");
    copy_dir(base, dir);
    rewrite_entry(dir, 19, 8, last.shard + 2);
    rewrite_entry(dir, 19, 16, 0);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "records are back to back");
    copy_dir(base, dir);
    rewrite_entry(dir, 0, 16, 48);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "entry 0 (batch 0) points to");
    /* ... a duplicate batch id */
    copy_dir(base, dir);
    rewrite_entry(dir, 3, 0, 2);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "batch 2 appears twice");
    /* ... a shard file cut short under an indexed record */
    copy_dir(base, dir);
    shard_file(path, dir, 0);
    TST_CHECK(truncate(path, fsize(path) - 1) == 0);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "shard-00000.bin bytes");
    TST_CHECK(r == NULL && w == NULL);
}

static void test_identity(void) {
    char dir[512], idx[512];
    mk(dir, "ident");
    build(dir, 5);
    path_of(idx, dir, "index.bin");
    cm_shard_reader  *r = NULL;
    cm_shard_writer  *w = NULL;
    cm_shard_identity id;

    id = ident();
    id.target_id = 42;
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_INVALID_ARG,
                "holds hidden states of target");
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, &id), CM_ERR_INVALID_ARG,
                "this run expects target 000000000000002a");
    id = ident();
    id.layer_ids[2] = 10;
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_INVALID_ARG, "holds layers [1,5,9]");
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, &id), CM_ERR_INVALID_ARG, "this run expects [1,5,10]");
    id = ident();
    id.hidden_size = 128;
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, &id), CM_ERR_INVALID_ARG, "holds hidden size 64");
    id = ident();
    id.encoding = CM_ENCODING_ZSTD;
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_INVALID_ARG,
                "holds encoding zstd-byteplane");
    TST_CHECK(cm_shard_reader_open(&r, dir, &id) == CM_OK); /* a reader decodes any encoding */
    cm_shard_reader_destroy(&r);
    id = ident();
    id.hidden_dtype = CM_DTYPE_F32;
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &SMALL), CM_ERR_INVALID_ARG, "holds BF16 hidden states");
    /* zeros in a reader's expectation are not compared */
    memset(&id, 0, sizeof id);
    TST_CHECK(cm_shard_reader_open(&r, dir, &id) == CM_OK);
    cm_shard_reader_destroy(&r);

    /* invalid identities for a new store */
    char fresh[512];
    mk(fresh, "ident-fresh");
    id = ident();
    id.n_layers = 0;
    EXPECT_FAIL(cm_shard_writer_create(&w, fresh, &id, &SMALL), CM_ERR_INVALID_ARG, "0 layers");
    id = ident();
    id.layer_ids[1] = 1;
    EXPECT_FAIL(cm_shard_writer_create(&w, fresh, &id, &SMALL), CM_ERR_INVALID_ARG,
                "layer id 1 appears twice");
    id = ident();
    id.hidden_dtype = CM_DTYPE_I32;
    EXPECT_FAIL(cm_shard_writer_create(&w, fresh, &id, &SMALL), CM_ERR_INVALID_ARG, "hidden dtype I32");
    id = ident();
    id.target_name[2] = ' ';
    EXPECT_FAIL(cm_shard_writer_create(&w, fresh, &id, &SMALL), CM_ERR_INVALID_ARG,
                "target name has byte 0x20");
    TST_CHECK(w == NULL);

    /* another format or protocol version (valid checksum) */
    uint8_t h[CM_SHARD_INDEX_HEADER_SIZE];
    FILE   *f = fopen(idx, "rb");
    TST_CHECK(f && fread(h, 1, sizeof h, f) == sizeof h);
    if (f)
        fclose(f);
    uint8_t v[CM_SHARD_INDEX_HEADER_SIZE];
    memcpy(v, h, sizeof v);
    v[4] = 3;
    put64le(v + 376, cm_xxh64(v, 376, 0));
    patch(idx, 0, v, sizeof v);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "shard format version 3");
    memcpy(v, h, sizeof v);
    v[10] = 9;
    put64le(v + 376, cm_xxh64(v, 376, 0));
    patch(idx, 0, v, sizeof v);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "protocol version 9 frames");
    memcpy(v, h, sizeof v);
    v[100] = 1; /* an unused layer slot */
    put64le(v + 376, cm_xxh64(v, 376, 0));
    patch(idx, 0, v, sizeof v);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "layer id 1 appears twice");
    patch(idx, 0, h, sizeof h);
    expect_range(dir, 5);
}

static void test_bad_use(void) {
    char dir[512], path[512];
    mk(dir, "baduse");
    cm_shard_identity            id = ident();
    cm_shard_writer             *w = NULL, *w2 = NULL;
    cm_shard_reader             *r = NULL;
    const cm_shard_writer_config tiny = {1000, 1, 0};
    EXPECT_FAIL(cm_shard_writer_create(&w, dir, &id, &tiny), CM_ERR_INVALID_ARG, "below the minimum of 4096");
    EXPECT_FAIL(cm_shard_writer_create(&w, "/nonexistent-parent/x", &id, NULL), CM_ERR_IO, "cannot create");
    EXPECT_FAIL(cm_shard_reader_open(&r, "/nonexistent-parent/x", NULL), CM_ERR_IO,
                "cannot open shard index");
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (!w)
        return;
    EXPECT_FAIL(cm_shard_writer_create(&w2, dir, &id, &SMALL), CM_ERR_INVALID_ARG,
                "in use by another writer");
    size_t   len;
    uint8_t *f = make_frame(3, &len);
    EXPECT_FAIL(cm_shard_writer_append(w, 4, 0, f, len), CM_ERR_INVALID_ARG, "is for batch 3, not 4");
    EXPECT_FAIL(cm_shard_writer_append(w, 3, 0, f, len - 1), CM_ERR_INVALID_ARG, "not a valid ANSWER frame");
    f[len - 1] ^= 1; /* a tensor's bytes: its checksum fails */
    EXPECT_FAIL(cm_shard_writer_append(w, 3, 0, f, len), CM_ERR_INVALID_ARG, "checksum mismatch");
    f[len - 1] ^= 1;
    EXPECT_FAIL(cm_shard_writer_append(w, 3, 0, NULL, 0), CM_ERR_INVALID_ARG, "not a valid ANSWER frame");
    TST_CHECK(cm_shard_writer_count(w) == 0);
    TST_CHECK(cm_shard_writer_append(w, 3, hash_of(3), f, len) == CM_OK);
    EXPECT_FAIL(cm_shard_writer_append(w, 3, 0, f, len), CM_ERR_INVALID_ARG, "already holds batch 3");
    free(f);
    cm_shard_writer_destroy(&w); /* destroy indexes what is pending */
    TST_CHECK(w == NULL);
    uint64_t three = 3;
    expect_store(dir, &three, 1);

    /* shard files without an index */
    char other[512];
    mk(other, "noindex");
    mkdir(other, 0755);
    shard_file(path, other, 0);
    append_bytes(path, "x", 1);
    EXPECT_FAIL(cm_shard_writer_create(&w, other, &id, &SMALL), CM_ERR_FORMAT, "but no index.bin");
}

/* Random damage: whatever the reader (or a resumed writer) accepts is exactly what was written. */
static void test_fuzz(void) {
    char base[512], dir[512];
    mk(base, "fuzz-base");
    mk(dir, "fuzz");
    build(base, 15);
    cm_shard_identity id = ident();
    setenv("TANDEM_LOG", "off", 1);
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    int opened = 0, refused = 0, bad_records = 0;
    for (int it = 0; it < 300; it++) {
        copy_dir(base, dir);
        char names[8][512];
        int  nf = 0;
        DIR *d = opendir(dir);
        for (struct dirent *de; d && (de = readdir(d)) && nf < 8;)
            if (de->d_name[0] != '.')
                path_of(names[nf++], dir, de->d_name);
        if (d)
            closedir(d);
        const char *victim = names[rnd() % (uint64_t)nf];
        long        size = fsize(victim);
        int         kind = (int)(rnd() % 4);
        if (kind == 3 && size > 0)
            TST_CHECK(truncate(victim, (off_t)(rnd() % (uint64_t)size)) == 0);
        else
            for (int j = 0; j <= kind && size > 0; j++)
                flip(victim, (long)(rnd() % (uint64_t)size));

        for (int pass = 0; pass < 2; pass++) {
            cm_shard_reader *r = NULL;
            if (cm_shard_reader_open(&r, dir, NULL) != CM_OK) {
                refused++;
            } else {
                opened++;
                for (uint64_t i = 0; i < cm_shard_reader_count(r); i++) {
                    const void    *p;
                    size_t         len, want_len;
                    cm_shard_entry e;
                    cm_shard_reader_entry(r, i, &e);
                    if (cm_shard_reader_at(r, i, &p, &len) != CM_OK) {
                        bad_records++;
                        continue;
                    }
                    uint8_t *want = make_frame(e.batch_id, &want_len);
                    TST_CHECK(e.batch_id < 15 && len == want_len && memcmp(p, want, len) == 0);
                    free(want);
                }
            }
            cm_shard_reader_destroy(&r);
            if (pass == 0) { /* a resumed writer completes the store, or refuses it */
                cm_shard_writer *w = NULL;
                if (cm_shard_writer_create(&w, dir, &id, &SMALL) != CM_OK)
                    break;
                for (uint64_t b = 0; b < 15; b++)
                    if (!cm_shard_writer_has(w, b))
                        put_range(w, b, b + 1);
                TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
            }
        }
    }
    cm_log_set_level(CM_LOG_LEVEL_WARN);
    fprintf(stderr, "fuzz: %d opens, %d refused, %d records refused\n", opened, refused, bad_records);
    TST_CHECK(opened > 0 && refused > 0 && bad_records > 0);
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--writer") == 0)
        return writer_main(argv[2], strtoull(argv[3], NULL, 10), strtol(argv[4], NULL, 10));
    const char *seed = getenv("TST_SEED");
    rng_state = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    fprintf(stderr, "seed %llu (set TST_SEED to repeat)\n", (unsigned long long)rng_state);
    snprintf(tmp, sizeof tmp, "/tmp/test_cm_shard.XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    test_roundtrip();
    test_parts();
    test_partial_record();
    test_unindexed();
    test_kill();
    test_corruption();
    test_repair();
    test_weights();
    test_placement();
    test_identity();
    test_bad_use();
    test_fuzz();
    int rc = tst_report();
    if (rc == 0) {
        DIR *d = opendir(tmp);
        for (struct dirent *de; d && (de = readdir(d));) {
            char p[512];
            if (de->d_name[0] == '.')
                continue;
            path_of(p, tmp, de->d_name);
            rm_dir(p);
        }
        if (d)
            closedir(d);
        rmdir(tmp);
    }
    return rc;
}
