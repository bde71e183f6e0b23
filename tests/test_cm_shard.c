/* tests/test_cm_shard.c — the shard store: records of varied sizes over several shards read back
 * byte-exact; reopen and append; resume after a partial record, after records written but not
 * indexed, after a torn index, and after kill -9 of a real writer at random moments (this
 * executable re-runs itself as the writer: `test_cm_shard --writer DIR N DELAY_US`). Damage,
 * repair, identity and bad use: test_cm_shard_damage.c. Seed: TST_SEED or time. */
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include "tst_shard.h"

extern char **environ;

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

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--writer") == 0)
        return writer_main(argv[2], strtoull(argv[3], NULL, 10), strtol(argv[4], NULL, 10));
    if (shard_setup("test_cm_shard"))
        return 1;
    test_roundtrip();
    test_parts();
    test_partial_record();
    test_unindexed();
    test_kill();
    return shard_finish();
}
