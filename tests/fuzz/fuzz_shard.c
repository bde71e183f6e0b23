/* tests/fuzz/fuzz_shard.c — libFuzzer target: a shard store directory (cm_shard.h) as the
 * trainer's reader opens it and as a resumed precompute's writer opens it. Input: one flag
 * byte, then index.bin, shard-00000.bin, shard-00001.bin and shard-00002.bin separated by
 * FUZZ_SPLIT. Flag bit 0: re-seal every checksum first (ANSWER frames in the records, record
 * payload and header checksums, each entry's copy of its record's checksum, entry and index
 * header checksums), so mutations reach the checks behind them. Flag bit 1: also resume a writer
 * on the directory with the identity its index header states; a writer that resumes must leave a
 * store that takes one more record and then opens with every record readable. Flag bit 2: that
 * writer verifies every record (cfg.verify): then exactly the records it lists as damaged may
 * fail to read. */
#include <string.h>

#include "cm_proto.h"
#include "cm_shard.h"
#include "fuzz_util.h"

static const cm_proto_limits LIM = CM_PROTO_LIMITS_DEFAULT;
static cm_proto_tensor       ten[64];
static uint8_t               extra[512]; /* a valid ANSWER frame for the resumed writer */
static size_t                extra_len;
#define EXTRA_ID 0x5eedull

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    fuzz_dir();
    static const uint8_t bytes[40] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    cm_proto_tensor      t;
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "layer_1");
    t.dtype = CM_DTYPE_BF16, t.encoding = CM_ENCODING_RAW, t.n_dims = 2, t.shape[0] = 4, t.shape[1] = 5;
    t.raw_size = t.encoded_size = sizeof bytes, t.data = bytes;
    cm_proto_answer a = {.batch_id = EXTRA_ID, .n_tensors = 1, .tensors = &t, .cap_tensors = 1};
    FUZZ_CHECK(cm_proto_answer_encode(&a, extra, sizeof extra, &extra_len) == CM_OK);
    return 0;
}

static void seal(uint8_t *index, size_t index_len, fuzz_part *shards, int n_shards) {
    const size_t rh = CM_SHARD_RECORD_HEADER_SIZE;
    for (int k = 0; k < n_shards; k++) {
        uint8_t *s = (uint8_t *)shards[k].data;
        size_t   len = shards[k].len, off = 0;
        while (len - off >= rh) {
            uint64_t plen = fuzz_rd64(s + off + 16);
            if (plen > len - off - rh)
                break;
            fuzz_proto_seal(s + off + rh, (size_t)plen);
            fuzz_wr64(s + off + 24, cm_xxh64(s + off + rh, (size_t)plen, 0));
            fuzz_wr64(s + off + 40, cm_xxh64(s + off, 40, 0));
            off += rh + (size_t)plen;
        }
    }
    if (index_len < CM_SHARD_INDEX_HEADER_SIZE)
        return;
    for (size_t e = CM_SHARD_INDEX_HEADER_SIZE; index_len - e >= CM_SHARD_ENTRY_SIZE;
         e += CM_SHARD_ENTRY_SIZE) {
        uint32_t k = fuzz_rd32(index + e + 8);
        uint64_t off = fuzz_rd64(index + e + 16);
        if ((int)k < n_shards && k < 64 && shards[k].len >= rh && off <= shards[k].len - rh)
            memcpy(index + e + 32, shards[k].data + off + 24, 8);
        fuzz_wr64(index + e + 56, cm_xxh64(index + e, 56, 0));
    }
    fuzz_wr64(index + 376, cm_xxh64(index, 376, 0));
}

/* The identity an index header states (no checks: the writer makes them). */
static void header_identity(const uint8_t *h, size_t len, cm_shard_identity *id) {
    memset(id, 0, sizeof *id);
    if (len < CM_SHARD_INDEX_HEADER_SIZE)
        return;
    id->hidden_dtype = (cm_dtype)h[12];
    id->encoding = (cm_encoding)h[13];
    id->n_layers = fuzz_rd16(h + 14);
    id->target_id = fuzz_rd64(h + 16);
    id->hidden_size = fuzz_rd32(h + 24);
    id->weights_id = fuzz_rd16(h + 4) >= 2 ? fuzz_rd64(h + 352) : 0;
    memcpy(id->target_name, h + 32, CM_PROTO_NAME_MAX);
    id->target_name[CM_PROTO_NAME_MAX] = '\0';
    for (int i = 0; i < CM_SHARD_MAX_LAYERS; i++)
        id->layer_ids[i] = (int32_t)fuzz_rd32(h + 96 + 4 * i);
}

static void read_all(const char *dir, int must_open, uint64_t want_count, uint64_t want_bad) {
    cm_shard_reader *r = NULL;
    if (fuzz_note(cm_shard_reader_open(&r, dir, NULL)) != CM_OK) {
        if (must_open) {
            fprintf(stderr, "the resumed store does not open: %s\n", cm_last_error());
            FUZZ_CHECK(0);
        }
        return;
    }
    uint64_t n = cm_shard_reader_count(r);
    if (must_open)
        FUZZ_CHECK(n == want_count);
    for (uint32_t k = 0; k < cm_shard_reader_n_shards(r); k++) {
        cm_shard_info info;
        cm_shard_reader_shard(r, k, &info);
        FUZZ_CHECK(info.bytes <= info.file_bytes);
    }
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        cm_shard_entry e;
        uint64_t       at;
        cm_shard_reader_entry(r, i, &e);
        FUZZ_CHECK(cm_shard_reader_find(r, e.batch_id, &at) && at == i);
        const void *frame;
        size_t      len;
        cm_status   st = cm_shard_reader_at(r, i, &frame, &len);
        if (must_open && st != CM_OK && !want_bad) {
            fprintf(stderr, "record %llu of the resumed store: %s\n", (unsigned long long)i, cm_last_error());
            FUZZ_CHECK(0);
        }
        if (st != CM_OK) {
            bad++;
            continue;
        }
        FUZZ_CHECK(len == e.length);
        cm_proto_answer a = {.tensors = ten, .cap_tensors = 64};
        cm_proto_answer_decode(frame, len, &LIM, &a);
    }
    if (must_open)
        FUZZ_CHECK(bad == want_bad);
    cm_shard_reader_destroy(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    uint8_t *copy = malloc(size);
    FUZZ_CHECK(copy != NULL);
    memcpy(copy, data, size);
    fuzz_part parts[FUZZ_MAX_PARTS];
    int       n = fuzz_split(copy + 1, size - 1, parts, 4);
    if (copy[0] & 1)
        seal((uint8_t *)parts[0].data, parts[0].len, parts + 1, n - 1);
    const char *dir = fuzz_dir();
    char        path[512];
    fuzz_dir_clear(dir);
    snprintf(path, sizeof path, "%s/%s", dir, CM_SHARD_INDEX_NAME);
    fuzz_write(path, parts[0].data, parts[0].len);
    for (int k = 1; k < n; k++) {
        snprintf(path, sizeof path, "%s/shard-%05d.bin", dir, k - 1);
        fuzz_write(path, parts[k].data, parts[k].len);
    }
    read_all(dir, 0, 0, 0);

    if (copy[0] & 2) {
        cm_shard_identity      id;
        cm_shard_writer       *w = NULL;
        cm_shard_writer_config cfg = {4096, 1, (uint32_t)(copy[0] >> 2 & 1)};
        header_identity(parts[0].data, parts[0].len, &id);
        if (fuzz_note(cm_shard_writer_create(&w, dir, &id, &cfg)) == CM_OK) {
            uint64_t count = cm_shard_writer_count(w), damaged = cm_shard_writer_n_damaged(w);
            if (!cm_shard_writer_has(w, EXTRA_ID)) {
                FUZZ_CHECK(cm_shard_writer_append(w, EXTRA_ID, 0, extra, extra_len) == CM_OK);
                count++;
            }
            FUZZ_CHECK(cm_shard_writer_close(&w) == CM_OK);
            read_all(dir, 1, count, damaged);
        }
    }
    free(copy);
    return 0;
}
