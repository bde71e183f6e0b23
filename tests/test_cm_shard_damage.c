/* tests/test_cm_shard_damage.c — the shard store against damage and misuse: corrupted payload,
 * record header, index header and entries, entries pointing outside a shard, a wrong identity and
 * bad appends are refused with a message naming the problem; a verifying writer lists damaged
 * records and restores them in place only from the original bytes; a differing weights
 * fingerprint is refused, a version-1 store is read but not appended to; random damage never makes
 * the reader hand out a record that differs from what was written. Seed: TST_SEED or time. */
#include "tst_shard.h"

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
    TST_CHECK(cm_shard_writer_damaged(w, 5) && cm_shard_writer_damaged(w, 7) &&
              cm_shard_writer_damaged(w, 19));
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
        FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
        int   same = fa && fb;
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
    tst_put64(h + 376, cm_xxh64(h, 376, 0));
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
    tst_put64(h + 376, cm_xxh64(h, 376, 0));
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
    tst_put64(v + 376, cm_xxh64(v, 376, 0));
    patch(idx, 0, v, sizeof v);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "shard format version 3");
    memcpy(v, h, sizeof v);
    v[10] = 9;
    tst_put64(v + 376, cm_xxh64(v, 376, 0));
    patch(idx, 0, v, sizeof v);
    EXPECT_FAIL(cm_shard_reader_open(&r, dir, NULL), CM_ERR_FORMAT, "protocol version 9 frames");
    memcpy(v, h, sizeof v);
    v[100] = 1; /* an unused layer slot */
    tst_put64(v + 376, cm_xxh64(v, 376, 0));
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

int main(void) {
    if (shard_setup("test_cm_shard_damage"))
        return 1;
    test_corruption();
    test_repair();
    test_weights();
    test_placement();
    test_identity();
    test_bad_use();
    test_fuzz();
    return shard_finish();
}
