/* tests/tst_shard.h — what the shard store's tests (test_cm_shard.c, test_cm_shard_damage.c)
 * share: deterministic ANSWER frames of a batch id, a small store identity and configuration,
 * stores built and checked byte-exact, file surgery (patch, flip, append, copy, rewrite an index
 * entry with a valid checksum), and each program's temporary directory and seed. */
#ifndef TST_SHARD_H
#define TST_SHARD_H

#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cm_hash.h"
#include "cm_log.h"
#include "cm_shard.h"
#include "tst.h"

#define EXPECT_FAIL TST_EXPECT_FAIL /* tst.h */

static char     tmp[64];
static uint64_t rng_state;

static inline uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// ---- frames: deterministic ANSWER frames of a given batch id and data size

static inline uint8_t *make_frame_n(uint64_t id, size_t n, size_t *len) {
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
static inline size_t frame_size_of(uint64_t id) {
    return id == 77 ? 10000 : 1 + (size_t)((id * 2654435761u) % 2500);
}
static inline uint8_t *make_frame(uint64_t id, size_t *len) {
    return make_frame_n(id, frame_size_of(id), len);
}

/* The fingerprint of batch id's (made-up) request. */
static inline uint64_t hash_of(uint64_t id) {
    int32_t tokens[3] = {(int32_t)(uint32_t)id, (int32_t)(uint32_t)(id >> 32), 7}, cu[2] = {0, 3};
    return cm_shard_batch_hash(tokens, 3, cu, 1);
}

static inline cm_shard_identity ident(void) {
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
static inline void put_ids(cm_shard_writer *w, const uint64_t *ids, int n) {
    for (int i = 0; i < n; i++) {
        size_t   len;
        uint8_t *f = make_frame(ids[i], &len);
        TST_CHECK(cm_shard_writer_append(w, ids[i], hash_of(ids[i]), f, len) == CM_OK);
        free(f);
    }
}

static inline void put_range(cm_shard_writer *w, uint64_t a, uint64_t b) {
    for (uint64_t id = a; id < b; id++)
        put_ids(w, &id, 1);
}

/* The store at dir must hold exactly ids[0..n) in that order, each byte-exact. */
static inline void expect_store(const char *dir, const uint64_t *ids, uint64_t n) {
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

static inline void expect_range(const char *dir, uint64_t n) {
    uint64_t *ids = malloc(n * sizeof *ids + 1);
    for (uint64_t i = 0; i < n; i++)
        ids[i] = i;
    expect_store(dir, ids, n);
    free(ids);
}

// ---- files

static inline void path_of(char *dst, const char *dir, const char *name) {
    int n = snprintf(dst, 512, "%s/%s", dir, name);
    CM_ASSERT(n > 0 && n < 512);
}

static inline long fsize(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

static inline void patch(const char *path, long off, const void *bytes, size_t n) {
    FILE *f = fopen(path, "r+b");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, off, SEEK_SET);
    TST_CHECK(fwrite(bytes, 1, n, f) == n);
    fclose(f);
}

static inline void flip(const char *path, long off) {
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

static inline void append_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "ab");
    TST_CHECK(f != NULL);
    if (!f)
        return;
    TST_CHECK(fwrite(p, 1, n, f) == n);
    fclose(f);
}

/* Removes dir and everything under it (directories recursively, everything else unlinked). */
static inline void rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d));) {
        char        p[512];
        struct stat st;
        if (de->d_name[0] == '.')
            continue;
        path_of(p, dir, de->d_name);
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
            rm_dir(p);
        else
            unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(dir);
}

static inline void copy_dir(const char *src, const char *dst) {
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

static inline void mk(char *dst, const char *name) {
    snprintf(dst, 512, "%s/%s", tmp, name);
    rm_dir(dst);
}

/* Rewrites field (a byte offset; 8 is the 32-bit shard) of index entry i of dir to v, with a valid
 * checksum. */
static inline void rewrite_entry(const char *dir, long i, int field, uint64_t v) {
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
        tst_put32(e + 8, (uint32_t)v); /* shard */
    else
        tst_put64(e + field, v); /* 0 batch_id, 16 offset, 24 length, 48 batch_hash */
    tst_put64(e + 56, cm_xxh64(e, 56, 0));
    patch(path, CM_SHARD_INDEX_HEADER_SIZE + i * CM_SHARD_ENTRY_SIZE, e, sizeof e);
}

static inline void entry_of(const char *dir, uint64_t batch_id, cm_shard_entry *e) {
    cm_shard_reader *r = NULL;
    uint64_t         i = 0;
    memset(e, 0, sizeof *e);
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    TST_CHECK(r && cm_shard_reader_find(r, batch_id, &i));
    if (r)
        cm_shard_reader_entry(r, i, e);
    cm_shard_reader_destroy(&r);
}

static inline void shard_file(char *dst, const char *dir, uint32_t k) {
    char name[32];
    snprintf(name, sizeof name, "shard-%05u.bin", k);
    path_of(dst, dir, name);
}

static inline uint32_t n_shards(const char *dir) {
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, dir, NULL) == CM_OK);
    uint32_t k = r ? cm_shard_reader_n_shards(r) : 0;
    cm_shard_reader_destroy(&r);
    return k;
}

/* A store of ids 0..n-1 with the SMALL config; returns its number of shards. */
static inline uint32_t build(const char *dir, uint64_t n) {
    cm_shard_identity id = ident();
    cm_shard_writer  *w = NULL;
    TST_CHECK(cm_shard_writer_create(&w, dir, &id, &SMALL) == CM_OK);
    if (!w)
        return 0;
    put_range(w, 0, n);
    TST_CHECK(cm_shard_writer_close(&w) == CM_OK);
    return n_shards(dir);
}

// ---- each program's temporary directory and seed

/* The seed from TST_SEED (or the time) and a fresh temporary directory /tmp/NAME.XXXXXX; 0 on
 * success. */
static inline int shard_setup(const char *name) {
    const char *seed = getenv("TST_SEED");
    rng_state = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    fprintf(stderr, "seed %llu (set TST_SEED to repeat)\n", (unsigned long long)rng_state);
    snprintf(tmp, sizeof tmp, "/tmp/%s.XXXXXX", name);
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    return 0;
}

/* The report; on success the temporary directory is removed. */
static inline int shard_finish(void) {
    int rc = tst_report();
    if (rc == 0)
        rm_dir(tmp);
    return rc;
}

#endif /* TST_SHARD_H */
