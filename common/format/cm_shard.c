/* common/format/cm_shard.c — the shard store documented in cm_shard.h: index and record codecs, the
 * checks shared by the writer's resume and the reader's open (identity, entry checksums,
 * placement, unique ids, shard sizes), the appending writer and the mmap reader. Lookups by
 * batch id go through a small open-addressing map. Every length and offset read from a file
 * is bounded first: placements are checked against the tiling rule and the files' sizes
 * before any mapping is touched, and again (cheaply) before each record is handed out. */
#include "cm_shard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_bytes.h"
#include "cm_hash.h"
#include "cm_lock.h"
#include "cm_log.h"
#include "cm_time.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cm_shard assumes a little-endian host"
#endif

#define SH_PATH_MAX  4096
#define SH_READ_SIZE ((size_t)1 << 20) /* streaming reads when verifying a record from a file */

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

static cm_status path_join(char *dst, const char *dir, const char *name) {
    int n = snprintf(dst, SH_PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= SH_PATH_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path '%s/%s' is longer than %d bytes", dir, name,
                       SH_PATH_MAX - 1);
    return CM_OK;
}

static void shard_name(char *dst, uint32_t k) {
    snprintf(dst, 32, "shard-%05u.bin", k);
}

static cm_status shard_path(char *dst, const char *dir, uint32_t k) {
    char name[32];
    shard_name(name, k);
    return path_join(dst, dir, name);
}

/* Full pwrite/pread; CM_ERR_IO naming the file on failure or a short read. */
static cm_status write_all(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", path, k < 0 ? strerror(errno) : "no progress");
        p += k, n -= (size_t)k, off += (uint64_t)k;
    }
    return CM_OK;
}

static cm_status read_all(int fd, void *buf, size_t n, uint64_t off, const char *path) {
    uint8_t *p = buf;
    while (n) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return CM_FAIL(CM_ERR_IO, "cannot read '%s': %s", path, strerror(errno));
        if (k == 0)
            return CM_FAIL(CM_ERR_IO, "cannot read '%s': the file ends early (offset %llu)", path,
                           (unsigned long long)off);
        p += k, n -= (size_t)k, off += (uint64_t)k;
    }
    return CM_OK;
}

// ----------------------------------------------------------------------------
// batch id → entry position (open addressing, linear probing; vals hold position + 1)

typedef struct idmap {
    uint64_t *keys;
    uint64_t *vals; /* 0 = empty slot */
    uint64_t  cap;  /* power of two */
    uint64_t  n;
} idmap;

static uint64_t id_hash(uint64_t x) {
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27, x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void idmap_release(idmap *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

static int idmap_get(const idmap *m, uint64_t key, uint64_t *val) {
    if (!m->cap)
        return 0;
    for (uint64_t i = id_hash(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (!m->vals[i])
            return 0;
        if (m->keys[i] == key) {
            if (val)
                *val = m->vals[i] - 1;
            return 1;
        }
    }
}

static void idmap_place(idmap *m, uint64_t key, uint64_t val1) {
    uint64_t i = id_hash(key) & (m->cap - 1);
    while (m->vals[i])
        i = (i + 1) & (m->cap - 1);
    m->keys[i] = key, m->vals[i] = val1;
    m->n++;
}

/* Inserts key → val: 1 if inserted, 0 if the key was present (nothing changed). */
static cm_status idmap_put(idmap *m, uint64_t key, uint64_t val, int *inserted) {
    *inserted = 0;
    if (idmap_get(m, key, NULL))
        return CM_OK;
    if ((m->n + 1) * 2 > m->cap) {
        idmap    old = *m;
        uint64_t cap = old.cap ? old.cap * 2 : 64;
        m->keys = calloc(cap, sizeof *m->keys);
        m->vals = calloc(cap, sizeof *m->vals);
        if (!m->keys || !m->vals) {
            free(m->keys), free(m->vals);
            *m = old;
            return CM_FAIL(CM_ERR_NOMEM, "cannot grow the batch id map to %llu slots",
                           (unsigned long long)cap);
        }
        m->cap = cap, m->n = 0;
        for (uint64_t i = 0; i < old.cap; i++)
            if (old.vals[i])
                idmap_place(m, old.keys[i], old.vals[i]);
        idmap_release(&old);
    }
    idmap_place(m, key, val + 1);
    *inserted = 1;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// identity

static int name_char_ok(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
}

/* Checks an identity's fields; st is CM_ERR_INVALID_ARG for the caller's, CM_ERR_FORMAT for a file's. */
static cm_status identity_valid(const cm_shard_identity *id, cm_status st, const char *what) {
    size_t n = strnlen(id->target_name, sizeof id->target_name);
    if (n > CM_PROTO_NAME_MAX)
        return CM_FAIL(st, "%s: target name is longer than %d bytes", what, CM_PROTO_NAME_MAX);
    for (size_t i = 0; i < n; i++)
        if (!name_char_ok((unsigned char)id->target_name[i]))
            return CM_FAIL(st, "%s: target name has byte 0x%02x; names use only A-Z a-z 0-9 _ . -", what,
                           (unsigned char)id->target_name[i]);
    if (id->hidden_dtype != CM_DTYPE_F32 && id->hidden_dtype != CM_DTYPE_BF16)
        return CM_FAIL(st, "%s: hidden dtype %s, expected F32 or BF16", what,
                       cm_dtype_name(id->hidden_dtype));
    if ((unsigned)id->encoding >= CM_ENCODING_END)
        return CM_FAIL(st, "%s: unknown encoding %d", what, (int)id->encoding);
    if (id->encoding == CM_ENCODING_NCCL)
        return CM_FAIL(st, "%s: encoding nccl carries no bytes to store; precompute with a ZeroMQ encoding",
                       what);
    if (id->hidden_size < 1)
        return CM_FAIL(st, "%s: hidden size is 0", what);
    if (id->n_layers < 1 || id->n_layers > CM_SHARD_MAX_LAYERS)
        return CM_FAIL(st, "%s: %u layers, expected 1 to %d", what, id->n_layers, CM_SHARD_MAX_LAYERS);
    for (uint32_t i = 0; i < id->n_layers; i++) {
        if (id->layer_ids[i] < 0)
            return CM_FAIL(st, "%s: layer id %d is negative", what, id->layer_ids[i]);
        for (uint32_t j = 0; j < i; j++)
            if (id->layer_ids[j] == id->layer_ids[i])
                return CM_FAIL(st, "%s: layer id %d appears twice", what, id->layer_ids[i]);
    }
    return CM_OK;
}

static void layers_str(char *dst, size_t cap, const cm_shard_identity *id) {
    size_t o = 0;
    dst[0] = '\0';
    for (uint32_t i = 0; i < id->n_layers && o < cap; i++)
        o += (size_t)snprintf(dst + o, cap - o, "%s%d", i ? "," : "", id->layer_ids[i]);
}

cm_status cm_shard_identity_check(const cm_shard_identity *have, const cm_shard_identity *want, int exact,
                                  const char *dir) {
    const char *d = dir ? dir : "(store)";
    if ((exact || want->target_id) && have->target_id != want->target_id)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "shard directory '%s' holds hidden states of target %016llx ('%s'), this "
            "run expects target %016llx ('%s'): use the shards of this target or another directory",
            d, (unsigned long long)have->target_id, have->target_name, (unsigned long long)want->target_id,
            want->target_name);
    if (have->weights_id != want->weights_id && have->weights_id && want->weights_id)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "shard directory '%s' holds hidden states of the same architecture (config %016llx), "
                       "different weights (fingerprint %016llx in the store, %016llx expected): use the "
                       "shards of these weights, or precompute them into another directory",
                       d, (unsigned long long)have->target_id, (unsigned long long)have->weights_id,
                       (unsigned long long)want->weights_id);
    if (exact && have->weights_id != want->weights_id) { /* one of them unknown: never mix in one store */
        char a[32] = "no fingerprint", b[32] = "no fingerprint";
        if (have->weights_id)
            snprintf(a, sizeof a, "fingerprint %016llx", (unsigned long long)have->weights_id);
        if (want->weights_id)
            snprintf(b, sizeof b, "fingerprint %016llx", (unsigned long long)want->weights_id);
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "shard directory '%s' holds hidden states of weights with %s, this run's weights have "
                       "%s: precompute into another directory",
                       d, a, b);
    }
    if ((exact || want->hidden_size) && have->hidden_size != want->hidden_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s' holds hidden size %u, this run expects %u",
                       d, have->hidden_size, want->hidden_size);
    if ((exact || want->n_layers) &&
        (have->n_layers != want->n_layers ||
         memcmp(have->layer_ids, want->layer_ids, have->n_layers * sizeof *have->layer_ids) != 0)) {
        char a[CM_SHARD_MAX_LAYERS * 12], b[CM_SHARD_MAX_LAYERS * 12];
        layers_str(a, sizeof a, have);
        layers_str(b, sizeof b, want);
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s' holds layers [%s], this run expects [%s]", d,
                       a, b);
    }
    if (exact && have->hidden_dtype != want->hidden_dtype)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s' holds %s hidden states, this run writes %s",
                       d, cm_dtype_name(have->hidden_dtype), cm_dtype_name(want->hidden_dtype));
    if (exact && have->encoding != want->encoding)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s' holds encoding %s, this run writes %s", d,
                       cm_encoding_name(have->encoding), cm_encoding_name(want->encoding));
    return CM_OK;
}

static void index_header_encode(uint8_t *p, const cm_shard_identity *id) {
    memset(p, 0, CM_SHARD_INDEX_HEADER_SIZE);
    cm_le_put_u32(p, CM_SHARD_INDEX_MAGIC);
    cm_le_put_u16(p + 4, CM_SHARD_VERSION);
    cm_le_put_u16(p + 6, CM_SHARD_INDEX_HEADER_SIZE);
    cm_le_put_u16(p + 8, CM_SHARD_ENTRY_SIZE);
    cm_le_put_u16(p + 10, CM_PROTO_VERSION);
    p[12] = (uint8_t)id->hidden_dtype;
    p[13] = (uint8_t)id->encoding;
    cm_le_put_u16(p + 14, (uint16_t)id->n_layers);
    cm_le_put_u64(p + 16, id->target_id);
    cm_le_put_u32(p + 24, id->hidden_size);
    cm_le_put_u64(p + 352, id->weights_id);
    memcpy(p + 32, id->target_name, strnlen(id->target_name, CM_PROTO_NAME_MAX));
    for (uint32_t i = 0; i < id->n_layers; i++)
        cm_le_put_u32(p + 96 + 4 * i, (uint32_t)id->layer_ids[i]);
    cm_le_put_u64(p + 376, cm_xxh64(p, 376, 0));
}

/* *version: the store's, CM_SHARD_VERSION or 1 (no weights_id). */
static cm_status index_header_decode(const uint8_t *p, const char *path, cm_shard_identity *id,
                                     uint16_t *version) {
    uint32_t magic = cm_le_get_u32(p);
    if (magic != CM_SHARD_INDEX_MAGIC)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': bad magic 0x%08x (expected 0x%08x \"TSHX\"): not a shard index",
                       path, magic, CM_SHARD_INDEX_MAGIC);
    *version = cm_le_get_u16(p + 4);
    if (*version != CM_SHARD_VERSION && *version != 1)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': shard format version %u, this build reads versions 1 to %d: run precompute "
                       "again with this build",
                       path, *version, CM_SHARD_VERSION);
    uint64_t want = cm_le_get_u64(p + 376), got = cm_xxh64(p, 376, 0);
    if (want != got)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': index header checksum mismatch (stored %016llx, computed %016llx): the "
                       "index is corrupted",
                       path, (unsigned long long)want, (unsigned long long)got);
    if (cm_le_get_u16(p + 6) != CM_SHARD_INDEX_HEADER_SIZE || cm_le_get_u16(p + 8) != CM_SHARD_ENTRY_SIZE)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': header size %u and entry size %u, expected %d and %d", path,
                       cm_le_get_u16(p + 6), cm_le_get_u16(p + 8), CM_SHARD_INDEX_HEADER_SIZE,
                       CM_SHARD_ENTRY_SIZE);
    if (cm_le_get_u16(p + 10) != CM_PROTO_VERSION)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': the records hold protocol version %u frames, this build reads version "
                       "%d: run precompute again with this build",
                       path, cm_le_get_u16(p + 10), CM_PROTO_VERSION);
    memset(id, 0, sizeof *id);
    id->hidden_dtype = (cm_dtype)p[12];
    id->encoding = (cm_encoding)p[13];
    id->n_layers = cm_le_get_u16(p + 14);
    id->target_id = cm_le_get_u64(p + 16);
    id->hidden_size = cm_le_get_u32(p + 24);
    id->weights_id = *version >= 2 ? cm_le_get_u64(p + 352) : 0; /* version 1: reserved, checked 0 below */
    memcpy(id->target_name, p + 32, CM_PROTO_NAME_MAX);
    size_t n = strnlen(id->target_name, CM_PROTO_NAME_MAX);
    if (cm_le_get_u32(p + 28) || !all_zero(p + 32 + n, CM_PROTO_NAME_MAX - n) ||
        (*version < 2 && !all_zero(p + 352, 8)) || !all_zero(p + 360, 16))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': reserved or padding bytes of the index header are not 0", path);
    if (id->n_layers > CM_SHARD_MAX_LAYERS)
        return CM_FAIL(CM_ERR_FORMAT, "'%s': %u layers, at most %d", path, id->n_layers, CM_SHARD_MAX_LAYERS);
    for (uint32_t i = 0; i < id->n_layers; i++)
        id->layer_ids[i] = (int32_t)cm_le_get_u32(p + 96 + 4 * i);
    if (!all_zero(p + 96 + 4 * id->n_layers, 4 * (CM_SHARD_MAX_LAYERS - id->n_layers)))
        return CM_FAIL(CM_ERR_FORMAT, "'%s': unused layer id slots are not 0", path);
    return identity_valid(id, CM_ERR_FORMAT, path);
}

// ----------------------------------------------------------------------------
// entries and records

static void entry_encode(uint8_t *p, const cm_shard_entry *e) {
    cm_le_put_u64(p, e->batch_id);
    cm_le_put_u32(p + 8, e->shard);
    cm_le_put_u32(p + 12, e->n_tensors);
    cm_le_put_u64(p + 16, e->offset);
    cm_le_put_u64(p + 24, e->length);
    cm_le_put_u64(p + 32, e->checksum);
    cm_le_put_u64(p + 40, e->raw_bytes);
    cm_le_put_u64(p + 48, e->batch_hash);
    cm_le_put_u64(p + 56, cm_xxh64(p, 56, 0));
}

/* 1 if the entry's checksum holds (and *e is filled), else 0. */
static int entry_decode(const uint8_t *p, cm_shard_entry *e) {
    if (cm_le_get_u64(p + 56) != cm_xxh64(p, 56, 0))
        return 0;
    e->batch_id = cm_le_get_u64(p);
    e->shard = cm_le_get_u32(p + 8);
    e->n_tensors = cm_le_get_u32(p + 12);
    e->offset = cm_le_get_u64(p + 16);
    e->length = cm_le_get_u64(p + 24);
    e->checksum = cm_le_get_u64(p + 32);
    e->raw_bytes = cm_le_get_u64(p + 40);
    e->batch_hash = cm_le_get_u64(p + 48);
    return 1;
}

static void record_header_encode(uint8_t *p, const cm_shard_entry *e) {
    memset(p, 0, CM_SHARD_RECORD_HEADER_SIZE);
    cm_le_put_u32(p, CM_SHARD_RECORD_MAGIC);
    cm_le_put_u16(p + 4, CM_SHARD_RECORD_VERSION);
    cm_le_put_u16(p + 6, CM_SHARD_RECORD_HEADER_SIZE);
    cm_le_put_u64(p + 8, e->batch_id);
    cm_le_put_u64(p + 16, e->length);
    cm_le_put_u64(p + 24, e->checksum);
    cm_le_put_u64(p + 32, e->batch_hash);
    cm_le_put_u64(p + 40, cm_xxh64(p, 40, 0));
}

uint64_t cm_shard_batch_hash(const int32_t *tokens, uint32_t n_tokens, const int32_t *cu_seqlens,
                             uint32_t n_seqs) {
    cm_xxh64_state s;
    uint8_t        n[8];
    cm_le_put_u32(n, n_tokens);
    cm_le_put_u32(n + 4, n_seqs);
    cm_xxh64_init(&s, 0);
    cm_xxh64_update(&s, n, sizeof n);
    cm_xxh64_update(&s, tokens,
                    (size_t)n_tokens * sizeof *tokens); /* little-endian host: the bytes as stored */
    cm_xxh64_update(&s, cu_seqlens, ((size_t)n_seqs + 1) * sizeof *cu_seqlens);
    return cm_xxh64_digest(&s);
}

#define REC_FAIL(fmt, ...)                                                                                   \
    CM_FAIL(                                                                                                 \
        CM_ERR_FORMAT,                                                                                       \
        "shard directory '%s': %s offset %llu (batch %llu): " fmt                                            \
        ": the record is corrupted; run the same `drafter-trainer precompute ... --out %s` again to "       \
        "restore it (`drafter-trainer shards inspect %s --verify` lists every bad record)",                  \
        dir, name, (unsigned long long)e->offset, (unsigned long long)e->batch_id, __VA_ARGS__, dir, dir)

/* Checks a record header against its index entry. */
static cm_status record_header_check(const uint8_t *p, const cm_shard_entry *e, const char *dir) {
    char name[32];
    shard_name(name, e->shard);
    uint64_t want = cm_le_get_u64(p + 40), got = cm_xxh64(p, 40, 0);
    if (cm_le_get_u32(p) != CM_SHARD_RECORD_MAGIC)
        return REC_FAIL("bad record magic 0x%08x (expected 0x%08x \"TSHR\")", cm_le_get_u32(p),
                        CM_SHARD_RECORD_MAGIC);
    if (want != got)
        return REC_FAIL("record header checksum mismatch (stored %016llx, computed %016llx)",
                        (unsigned long long)want, (unsigned long long)got);
    if (cm_le_get_u16(p + 4) != CM_SHARD_RECORD_VERSION ||
        cm_le_get_u16(p + 6) != CM_SHARD_RECORD_HEADER_SIZE)
        return REC_FAIL("record version %u, header size %u (expected %d, %d)", cm_le_get_u16(p + 4),
                        cm_le_get_u16(p + 6), CM_SHARD_RECORD_VERSION, CM_SHARD_RECORD_HEADER_SIZE);
    if (cm_le_get_u64(p + 8) != e->batch_id || cm_le_get_u64(p + 16) != e->length ||
        cm_le_get_u64(p + 24) != e->checksum || cm_le_get_u64(p + 32) != e->batch_hash)
        return REC_FAIL(
            "record header says batch %llu, %llu bytes, checksum %016llx, batch hash %016llx; the index says "
            "%llu, %llu, %016llx, %016llx",
            (unsigned long long)cm_le_get_u64(p + 8), (unsigned long long)cm_le_get_u64(p + 16),
            (unsigned long long)cm_le_get_u64(p + 24), (unsigned long long)cm_le_get_u64(p + 32),
            (unsigned long long)e->batch_id, (unsigned long long)e->length, (unsigned long long)e->checksum,
            (unsigned long long)e->batch_hash);
    return CM_OK;
}

static cm_status payload_check(uint64_t got, const cm_shard_entry *e, const char *dir) {
    char name[32];
    shard_name(name, e->shard);
    if (got != e->checksum)
        return REC_FAIL("payload checksum mismatch (stored %016llx, computed %016llx)",
                        (unsigned long long)e->checksum, (unsigned long long)got);
    return CM_OK;
}

/* Verifies a record in an open shard file (header and streamed payload checksum). */
static cm_status record_verify_fd(int fd, const char *path, const cm_shard_entry *e, const char *dir,
                                  uint8_t *buf) {
    uint8_t h[CM_SHARD_RECORD_HEADER_SIZE];
    CM_TRY(read_all(fd, h, sizeof h, e->offset, path));
    CM_TRY(record_header_check(h, e, dir));
    cm_xxh64_state s;
    cm_xxh64_init(&s, 0);
    for (uint64_t done = 0; done < e->length;) {
        size_t n = e->length - done < SH_READ_SIZE ? (size_t)(e->length - done) : SH_READ_SIZE;
        CM_TRY(read_all(fd, buf, n, e->offset + CM_SHARD_RECORD_HEADER_SIZE + done, path));
        cm_xxh64_update(&s, buf, n);
        done += n;
    }
    return payload_check(cm_xxh64_digest(&s), e, dir);
}

// ----------------------------------------------------------------------------
// index loading and checks (shared by the writer's resume and the reader)

typedef struct shard_span {
    uint64_t first, n_records, end; /* entries [first, first + n_records); bytes [0, end) */
} shard_span;

typedef struct store_index {
    cm_shard_identity id;
    uint16_t          version; /* of the store: 1 or CM_SHARD_VERSION */
    cm_shard_entry   *entries;
    uint64_t          n;
    uint64_t          n_torn;     /* entries cut off the end (writer) */
    uint64_t          torn_bytes; /* bytes of a partial entry at the end */
    shard_span       *spans;
    uint32_t          n_shards;
    idmap             map;
} store_index;

static void store_index_release(store_index *x) {
    free(x->entries);
    free(x->spans);
    idmap_release(&x->map);
    memset(x, 0, sizeof *x);
}

/* Reads DIR/index.bin. torn_ok = 1 (writer): entries failing their checksum at the end are
 * counted in n_torn and dropped; 0 (reader): any bad entry is refused. A partial entry at
 * the end is always dropped (torn_bytes). Then checks placement and unique ids. */
static cm_status store_index_load(store_index *x, int fd, const char *path, int torn_ok) {
    cm_status   st = CM_OK;
    uint8_t    *buf = NULL;
    struct stat sb;
    memset(x, 0, sizeof *x);
    if (fstat(fd, &sb) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
    uint64_t size = (uint64_t)sb.st_size;
    if (size < CM_SHARD_INDEX_HEADER_SIZE)
        return CM_FAIL(CM_ERR_FORMAT, "'%s' has %llu bytes, less than its %d-byte header: not a shard index",
                       path, (unsigned long long)size, CM_SHARD_INDEX_HEADER_SIZE);
    if (size > SIZE_MAX / 2)
        return CM_FAIL(CM_ERR_FORMAT, "'%s' is too large to be a shard index", path);
    buf = malloc((size_t)size);
    if (!buf)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %llu bytes for '%s'", (unsigned long long)size, path);
    CM_TRY_GOTO(read_all(fd, buf, (size_t)size, 0, path), st, fail);
    CM_TRY_GOTO(index_header_decode(buf, path, &x->id, &x->version), st, fail);

    uint64_t n_all = (size - CM_SHARD_INDEX_HEADER_SIZE) / CM_SHARD_ENTRY_SIZE;
    x->torn_bytes = (size - CM_SHARD_INDEX_HEADER_SIZE) % CM_SHARD_ENTRY_SIZE;
    x->entries = malloc((n_all ? n_all : 1) * sizeof *x->entries);
    if (!x->entries) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %llu index entries", (unsigned long long)n_all);
        goto fail;
    }
    uint64_t first_bad = n_all;
    for (uint64_t i = 0; i < n_all; i++) {
        int ok = entry_decode(buf + CM_SHARD_INDEX_HEADER_SIZE + i * CM_SHARD_ENTRY_SIZE, &x->entries[i]);
        if (!ok && first_bad == n_all)
            first_bad = i;
        if (ok && first_bad < n_all)
            torn_ok = 0; /* a good entry after a bad one: not a torn append */
    }
    if (first_bad < n_all && !torn_ok) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "'%s': index entry %llu (at byte %llu) fails its checksum: the index is "
                     "corrupted",
                     path, (unsigned long long)first_bad,
                     (unsigned long long)(CM_SHARD_INDEX_HEADER_SIZE + first_bad * CM_SHARD_ENTRY_SIZE));
        goto fail;
    }
    x->n = first_bad;
    x->n_torn = n_all - first_bad;

    /* placement: the entries tile shards 0, 1, ... in order */
    uint64_t end = 0;
    for (uint64_t i = 0; i < x->n; i++) {
        const cm_shard_entry *e = &x->entries[i], *p = i ? &x->entries[i - 1] : NULL;
        char                  a[32];
        shard_name(a, e->shard);
        if (e->length < CM_PROTO_HEADER_SIZE || e->length > CM_SHARD_MAX_PAYLOAD) {
            st = CM_FAIL(CM_ERR_FORMAT, "'%s': entry %llu (batch %llu) has length %llu, outside [%d, %llu]",
                         path, (unsigned long long)i, (unsigned long long)e->batch_id,
                         (unsigned long long)e->length, CM_PROTO_HEADER_SIZE,
                         (unsigned long long)CM_SHARD_MAX_PAYLOAD);
            goto fail;
        }
        int same = p && e->shard == p->shard && e->offset == end;
        int next = p ? e->shard == p->shard + 1 && e->offset == 0 : e->shard == 0 && e->offset == 0;
        if ((!same && !next) || e->shard >= CM_SHARD_MAX_SHARDS) {
            char b[32], c[32];
            shard_name(b, p ? p->shard : 0);
            shard_name(c, p ? p->shard + 1 : 0);
            st = CM_FAIL(CM_ERR_FORMAT,
                         "'%s': entry %llu (batch %llu) points to %s offset %llu; records are back to "
                         "back, so it must be at %s offset %llu or %s offset 0: the index is corrupted",
                         path, (unsigned long long)i, (unsigned long long)e->batch_id, a,
                         (unsigned long long)e->offset, b, (unsigned long long)(p ? end : 0), c);
            goto fail;
        }
        end = e->offset + CM_SHARD_RECORD_HEADER_SIZE + e->length; /* both bounded: no overflow */
        int ins;
        CM_TRY_GOTO(idmap_put(&x->map, e->batch_id, i, &ins), st, fail);
        if (!ins) {
            uint64_t j = 0;
            idmap_get(&x->map, e->batch_id, &j);
            st = CM_FAIL(CM_ERR_FORMAT,
                         "'%s': batch %llu appears twice (entries %llu and %llu): the index is "
                         "corrupted",
                         path, (unsigned long long)e->batch_id, (unsigned long long)j, (unsigned long long)i);
            goto fail;
        }
    }
    x->n_shards = x->n ? x->entries[x->n - 1].shard + 1 : 0;
    x->spans = calloc(x->n_shards ? x->n_shards : 1, sizeof *x->spans);
    if (!x->spans) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %u shard summaries", x->n_shards);
        goto fail;
    }
    for (uint64_t i = 0; i < x->n; i++) {
        shard_span *s = &x->spans[x->entries[i].shard];
        if (!s->n_records++)
            s->first = i;
        s->end = x->entries[i].offset + CM_SHARD_RECORD_HEADER_SIZE + x->entries[i].length;
    }
    free(buf);
    return CM_OK;
fail:
    free(buf);
    store_index_release(x);
    return st;
}

/* The shard must hold every byte its entries name. */
static cm_status span_check(const store_index *x, uint32_t k, uint64_t file_bytes, const char *dir) {
    const shard_span *s = &x->spans[k];
    if (file_bytes >= s->end)
        return CM_OK;
    const cm_shard_entry *e = &x->entries[s->first + s->n_records - 1];
    for (uint64_t i = s->first; i < s->first + s->n_records; i++)
        if (x->entries[i].offset + CM_SHARD_RECORD_HEADER_SIZE + x->entries[i].length > file_bytes) {
            e = &x->entries[i];
            break;
        }
    char name[32];
    shard_name(name, k);
    return CM_FAIL(CM_ERR_FORMAT,
                   "shard directory '%s': the index puts batch %llu at %s bytes %llu..%llu, but the "
                   "file has %llu bytes: the shard is truncated or the index is not this directory's",
                   dir, (unsigned long long)e->batch_id, name, (unsigned long long)e->offset,
                   (unsigned long long)(e->offset + CM_SHARD_RECORD_HEADER_SIZE + e->length),
                   (unsigned long long)file_bytes);
}

/* Opens shard k; a missing file is a damaged store. */
static cm_status shard_open(int *fd, const char *dir, uint32_t k, int flags, char *path) {
    CM_TRY(shard_path(path, dir, k));
    *fd = open(path, flags | O_CLOEXEC);
    if (*fd < 0 && errno == ENOENT)
        return CM_FAIL(CM_ERR_FORMAT, "shard directory '%s': the index names '%s', which is missing", dir,
                       path);
    if (*fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    return CM_OK;
}

static cm_status file_size(int fd, const char *path, uint64_t *size) {
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
    *size = (uint64_t)sb.st_size;
    return CM_OK;
}

/* Parses "shard-<digits>.bin"; 1 and *k on success. */
static int parse_shard_name(const char *s, uint32_t *k) {
    if (strncmp(s, "shard-", 6) != 0)
        return 0;
    const char *p = s + 6;
    uint64_t    v = 0;
    int         n = 0;
    for (; *p >= '0' && *p <= '9' && n < 10; p++, n++)
        v = v * 10 + (uint64_t)(*p - '0');
    if (n < 5 || strcmp(p, ".bin") != 0 || v >= CM_SHARD_MAX_SHARDS)
        return 0;
    char canon[32];
    shard_name(canon, (uint32_t)v);
    if (strcmp(canon, s) != 0)
        return 0;
    *k = (uint32_t)v;
    return 1;
}

// ----------------------------------------------------------------------------
// writer

struct cm_shard_writer {
    char                  *dir;
    cm_shard_identity      id;
    cm_shard_writer_config cfg;
    int                    dir_fd; /* for syncing the directory */
    cm_lock               *lock;   /* CM_SHARD_LOCK_NAME: one writer at a time */
    int                    index_fd;
    uint64_t               index_end;
    int                    shard_fd; /* -1 until the first record of a fresh store */
    uint32_t               shard;
    uint64_t               shard_end;
    idmap                  ids;
    cm_shard_entry        *damaged; /* cfg.verify: records that failed verification at open */
    uint8_t               *restored; /* [n_damaged]: 1 once written again */
    uint64_t               n_damaged, n_restored;
    idmap                  damaged_ids; /* batch id → position in damaged */
    cm_shard_entry        *pending;
    uint64_t               n_pending, cap_pending;
    uint64_t               n_durable;
    uint8_t               *ibuf; /* encoded pending entries */
    uint64_t               cap_ibuf;
    int                    broken; /* a failed fsync or cut-back: reopen to resume */
    char                   index_path[SH_PATH_MAX];
    char                   shard_path[SH_PATH_MAX];
    cm_proto_tensor        tensors[64];
};

static cm_status fsync_fd(int fd, const char *path) {
    if (fsync(fd) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot fsync '%s': %s", path, strerror(errno));
    return CM_OK;
}

/* Writes a fresh index (header only) atomically. */
static cm_status index_create(cm_shard_writer *w) {
    char    tmp[SH_PATH_MAX + 8];
    uint8_t h[CM_SHARD_INDEX_HEADER_SIZE];
    snprintf(tmp, sizeof tmp, "%s.tmp", w->index_path);
    index_header_encode(h, &w->id);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    cm_status st = write_all(fd, h, sizeof h, 0, tmp);
    if (st == CM_OK)
        st = fsync_fd(fd, tmp);
    close(fd);
    if (st == CM_OK && rename(tmp, w->index_path) != 0)
        st = CM_FAIL(CM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, w->index_path, strerror(errno));
    if (st == CM_OK)
        st = fsync_fd(w->dir_fd, w->dir);
    if (st != CM_OK)
        unlink(tmp);
    return st;
}

/* cfg.verify: checks every record of shard k (header and payload checksum); a damaged one is
 * logged and listed, not refused. Only I/O and memory errors fail. */
static cm_status writer_verify_shard(cm_shard_writer *w, const store_index *x, uint32_t k, int fd,
                                     const char *path, uint8_t *buf) {
    for (uint64_t i = x->spans[k].first; i < x->spans[k].first + x->spans[k].n_records; i++) {
        cm_status st = record_verify_fd(fd, path, &x->entries[i], w->dir, buf);
        if (st != CM_ERR_FORMAT) {
            CM_TRY(st);
            continue;
        }
        CM_LOG_WARN("%s", cm_last_error());
        if (w->n_damaged % 64 == 0) {
            cm_shard_entry *p = realloc(w->damaged, (w->n_damaged + 64) * sizeof *p);
            uint8_t        *q = realloc(w->restored, (w->n_damaged + 64) * sizeof *q);
            if (p)
                w->damaged = p;
            if (q)
                w->restored = q;
            if (!p || !q)
                return CM_FAIL(CM_ERR_NOMEM, "cannot list %llu damaged records",
                               (unsigned long long)w->n_damaged + 1);
        }
        int ins;
        CM_TRY(idmap_put(&w->damaged_ids, x->entries[i].batch_id, w->n_damaged, &ins));
        w->restored[w->n_damaged] = 0;
        w->damaged[w->n_damaged++] = x->entries[i];
    }
    return CM_OK;
}

/* Resume: cut the index's torn tail, verify each shard's tail record, truncate unindexed bytes,
 * remove shard files past the last indexed one. */
static cm_status writer_resume(cm_shard_writer *w) {
    cm_status   st = CM_OK;
    uint8_t    *buf = NULL;
    DIR        *d = NULL;
    store_index x;
    CM_TRY(store_index_load(&x, w->index_fd, w->index_path, 1));
    if (x.version != CM_SHARD_VERSION) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "shard directory '%s' is shard format version %u (written before the target's weights "
                     "fingerprint was recorded): it can still be read (train --shards, shards inspect) but "
                     "not appended to; precompute into a new directory",
                     w->dir, x.version);
        goto fail;
    }
    CM_TRY_GOTO(cm_shard_identity_check(&x.id, &w->id, 1, w->dir), st, fail);
    w->index_end = CM_SHARD_INDEX_HEADER_SIZE + x.n * CM_SHARD_ENTRY_SIZE;
    if (x.n_torn || x.torn_bytes) {
        CM_LOG_WARN(
            "shard directory '%s': cutting a torn index tail (%llu entries failing their checksum, %llu "
            "bytes of a partial entry): those records will be written again",
            w->dir, (unsigned long long)x.n_torn, (unsigned long long)x.torn_bytes);
        if (ftruncate(w->index_fd, (off_t)w->index_end) != 0) {
            st = CM_FAIL(CM_ERR_IO, "cannot truncate '%s': %s", w->index_path, strerror(errno));
            goto fail;
        }
        CM_TRY_GOTO(fsync_fd(w->index_fd, w->index_path), st, fail);
    }
    buf = malloc(SH_READ_SIZE);
    if (!buf) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate a read buffer");
        goto fail;
    }
    const double t0 = cm_now_s();
    for (uint32_t k = 0; k < x.n_shards; k++) {
        char     path[SH_PATH_MAX];
        int      fd = -1;
        uint64_t size = 0;
        CM_TRY_GOTO(shard_open(&fd, w->dir, k, O_RDWR, path), st, fail);
        st = file_size(fd, path, &size);
        if (st == CM_OK)
            st = span_check(&x, k, size, w->dir);
        if (st == CM_OK && w->cfg.verify)
            st = writer_verify_shard(w, &x, k, fd, path, buf);
        else if (st == CM_OK)
            st = record_verify_fd(fd, path, &x.entries[x.spans[k].first + x.spans[k].n_records - 1], w->dir,
                                  buf);
        if (st == CM_OK && size > x.spans[k].end) {
            CM_LOG_WARN(
                "shard directory '%s': cutting %llu bytes after the last indexed record of '%s' (records "
                "written but not indexed before a stop; they will be written again)",
                w->dir, (unsigned long long)(size - x.spans[k].end), path);
            if (ftruncate(fd, (off_t)x.spans[k].end) != 0)
                st = CM_FAIL(CM_ERR_IO, "cannot truncate '%s': %s", path, strerror(errno));
            if (st == CM_OK)
                st = fsync_fd(fd, path);
        }
        if (st == CM_OK && k + 1 == x.n_shards) {
            w->shard_fd = fd;
            w->shard = k;
            w->shard_end = x.spans[k].end;
            memcpy(w->shard_path, path, sizeof path);
        } else {
            close(fd);
        }
        if (st != CM_OK)
            goto fail;
    }
    const double t1 = cm_now_s();
    if (w->cfg.verify && x.n) {
        uint64_t     bytes = 0;
        const double s = t1 - t0;
        for (uint32_t k = 0; k < x.n_shards; k++)
            bytes += x.spans[k].end;
        CM_LOG_INFO("shard directory '%s': %llu stored records, %.2f GB verified in %.2f s = %.2f GB/s; %llu "
                    "damaged",
                    w->dir, (unsigned long long)x.n, (double)bytes / 1e9, s, s > 0 ? (double)bytes / 1e9 / s : 0.0,
                    (unsigned long long)w->n_damaged);
    }
    if (!(d = opendir(w->dir))) {
        st = CM_FAIL(CM_ERR_IO, "cannot list '%s': %s", w->dir, strerror(errno));
        goto fail;
    }
    int removed = 0;
    for (struct dirent *de; (de = readdir(d));) {
        uint32_t k;
        char     path[SH_PATH_MAX];
        if (!parse_shard_name(de->d_name, &k) || k < x.n_shards)
            continue;
        CM_TRY_GOTO(path_join(path, w->dir, de->d_name), st, fail);
        CM_LOG_WARN(
            "shard directory '%s': removing '%s', which holds no indexed record (written before a stop)",
            w->dir, de->d_name);
        if (unlink(path) != 0) {
            st = CM_FAIL(CM_ERR_IO, "cannot remove '%s': %s", path, strerror(errno));
            goto fail;
        }
        removed = 1;
    }
    if (removed)
        CM_TRY_GOTO(fsync_fd(w->dir_fd, w->dir), st, fail);
    if (!x.n_shards)
        w->shard = 0;
    for (uint64_t i = 0; i < x.n; i++) {
        int ins;
        CM_TRY_GOTO(idmap_put(&w->ids, x.entries[i].batch_id, 0, &ins), st, fail);
    }
    w->n_durable = x.n;
    if (x.n)
        CM_LOG_INFO("shard directory '%s': resuming after %llu records in %u shards%s", w->dir,
                    (unsigned long long)x.n, x.n_shards, w->cfg.verify ? ", every one verified" : "");
fail:
    if (d)
        closedir(d);
    free(buf);
    store_index_release(&x);
    return st;
}

cm_status cm_shard_writer_create(cm_shard_writer **out, const char *dir, const cm_shard_identity *id,
                                 const cm_shard_writer_config *cfg) {
    static const cm_shard_writer_config defaults = CM_SHARD_WRITER_CONFIG_DEFAULT;
    cm_status                           st = CM_OK;
    cm_shard_writer                    *w = NULL;
    *out = NULL;
    if (!dir || !dir[0] || !id)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard writer: no directory or identity given");
    if (!cfg)
        cfg = &defaults;
    if (cfg->max_shard_bytes < 4096)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "shard writer: max shard size %llu bytes is below the minimum of 4096",
                       (unsigned long long)cfg->max_shard_bytes);
    CM_TRY(identity_valid(id, CM_ERR_INVALID_ARG, "shard writer identity"));
    if (!(w = calloc(1, sizeof *w)))
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a shard writer");
    w->dir_fd = w->index_fd = w->shard_fd = -1;
    w->id = *id, w->cfg = *cfg;
    if (!(w->dir = strdup(dir))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot copy a path");
        goto fail;
    }
    CM_TRY_GOTO(path_join(w->index_path, dir, CM_SHARD_INDEX_NAME), st, fail);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        st = CM_FAIL(CM_ERR_IO, "cannot create shard directory '%s': %s", dir, strerror(errno));
        goto fail;
    }
    if ((w->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot open shard directory '%s': %s", dir, strerror(errno));
        goto fail;
    }
    {
        char lock_path[SH_PATH_MAX], what[SH_PATH_MAX + 32];
        CM_TRY_GOTO(path_join(lock_path, dir, CM_SHARD_LOCK_NAME), st, fail);
        snprintf(what, sizeof what, "shard directory '%s'", dir);
        CM_TRY_GOTO(cm_lock_create(&w->lock, lock_path, what, "writer", "stop it or use another directory"), st,
                    fail);
    }
    if (access(w->index_path, F_OK) != 0) {
        DIR *d = opendir(dir);
        for (struct dirent *de; d && (de = readdir(d));) {
            uint32_t k;
            if (parse_shard_name(de->d_name, &k)) {
                st = CM_FAIL(CM_ERR_FORMAT,
                             "shard directory '%s' has '%s' but no %s: it was not written by a shard "
                             "writer, or is damaged; use an empty directory",
                             dir, de->d_name, CM_SHARD_INDEX_NAME);
                break;
            }
        }
        if (d)
            closedir(d);
        if (st != CM_OK)
            goto fail;
        CM_TRY_GOTO(index_create(w), st, fail);
    }
    if ((w->index_fd = open(w->index_path, O_RDWR | O_CLOEXEC)) < 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", w->index_path, strerror(errno));
        goto fail;
    }
    CM_TRY_GOTO(writer_resume(w), st, fail);
    *out = w;
    return CM_OK;
fail:
    w->n_pending = 0;
    cm_shard_writer_destroy(&w);
    return st;
}

int cm_shard_writer_has(const cm_shard_writer *w, uint64_t batch_id) {
    return idmap_get(&w->ids, batch_id, NULL);
}
uint64_t cm_shard_writer_count(const cm_shard_writer *w) {
    return w->n_durable + w->n_pending;
}
uint64_t cm_shard_writer_durable(const cm_shard_writer *w) {
    return w->n_durable;
}

uint64_t cm_shard_writer_n_damaged(const cm_shard_writer *w) {
    return w->n_damaged - w->n_restored;
}

int cm_shard_writer_damaged(const cm_shard_writer *w, uint64_t batch_id) {
    uint64_t k;
    return idmap_get(&w->damaged_ids, batch_id, &k) && !w->restored[k];
}

int cm_shard_writer_first_damaged(const cm_shard_writer *w, cm_shard_entry *e) {
    for (uint64_t k = 0; k < w->n_damaged; k++)
        if (!w->restored[k]) {
            *e = w->damaged[k];
            return 1;
        }
    return 0;
}

static cm_status writer_usable(const cm_shard_writer *w) {
    if (w->broken)
        return CM_FAIL(CM_ERR_IO,
                       "shard directory '%s': the writer stopped after an I/O error; open the directory "
                       "again to resume",
                       w->dir);
    return CM_OK;
}

cm_status cm_shard_writer_sync(cm_shard_writer *w) {
    CM_TRY(writer_usable(w));
    if (!w->n_pending)
        return CM_OK;
    if (fsync(w->shard_fd) != 0) {
        w->broken = 1; /* after a failed fsync the page cache cannot be trusted */
        return CM_FAIL(CM_ERR_IO, "cannot fsync '%s': %s", w->shard_path, strerror(errno));
    }
    uint64_t need = w->n_pending * CM_SHARD_ENTRY_SIZE;
    if (need > w->cap_ibuf) {
        uint8_t *p = realloc(w->ibuf, need);
        if (!p)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %llu bytes of index entries",
                           (unsigned long long)need);
        w->ibuf = p, w->cap_ibuf = need;
    }
    for (uint64_t i = 0; i < w->n_pending; i++)
        entry_encode(w->ibuf + i * CM_SHARD_ENTRY_SIZE, &w->pending[i]);
    cm_status st = write_all(w->index_fd, w->ibuf, need, w->index_end, w->index_path);
    if (st != CM_OK) {
        if (ftruncate(w->index_fd, (off_t)w->index_end) != 0)
            w->broken = 1;
        return st;
    }
    if (fsync(w->index_fd) != 0) {
        w->broken = 1;
        return CM_FAIL(CM_ERR_IO, "cannot fsync '%s': %s", w->index_path, strerror(errno));
    }
    w->index_end += need;
    w->n_durable += w->n_pending;
    w->n_pending = 0;
    return CM_OK;
}

/* Closes the current shard (synced) and creates shard k, durable in the directory. A failed
 * create can be retried: shard k holds no indexed record. */
static cm_status writer_next_shard(cm_shard_writer *w, uint32_t k) {
    if (k >= CM_SHARD_MAX_SHARDS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s': more than %u shards; raise the shard size",
                       w->dir, CM_SHARD_MAX_SHARDS);
    if (w->shard_fd >= 0) {
        CM_TRY(cm_shard_writer_sync(w));
        close(w->shard_fd);
        w->shard_fd = -1;
    }
    w->shard = k;
    w->shard_end = 0;
    CM_TRY(shard_path(w->shard_path, w->dir, k));
    w->shard_fd = open(w->shard_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->shard_fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", w->shard_path, strerror(errno));
    if (fsync(w->dir_fd) != 0) {
        w->broken = 1;
        return CM_FAIL(CM_ERR_IO, "cannot fsync '%s': %s", w->dir, strerror(errno));
    }
    return CM_OK;
}

/* Appends a checked ANSWER (payload = parts[0] then parts[1]) as one record. */
static cm_status writer_append(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                               const cm_proto_answer *a, const void *const parts[2], const size_t lens[2]) {
    if (a->batch_id != batch_id)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "shard directory '%s': the ANSWER frame is for batch %llu, not %llu; nothing written",
                       w->dir, (unsigned long long)a->batch_id, (unsigned long long)batch_id);
    cm_shard_entry e = {.batch_id = batch_id, .batch_hash = batch_hash, .n_tensors = a->n_tensors};
    cm_xxh64_state hs;
    cm_xxh64_init(&hs, 0);
    for (int i = 0; i < 2; i++) {
        cm_xxh64_update(&hs, parts[i], lens[i]);
        e.length += lens[i];
    }
    e.checksum = cm_xxh64_digest(&hs);
    for (uint32_t i = 0; i < a->n_tensors; i++)
        e.raw_bytes += a->tensors[i].raw_size;

    uint64_t rec = CM_SHARD_RECORD_HEADER_SIZE + e.length;
    if (w->shard_fd < 0)
        CM_TRY(writer_next_shard(w, w->shard));
    else if (w->shard_end > 0 && w->shard_end + rec > w->cfg.max_shard_bytes) /* both < 2^37: no overflow */
        CM_TRY(writer_next_shard(w, w->shard + 1));
    if (w->n_pending == w->cap_pending) {
        uint64_t        cap = w->cap_pending ? 2 * w->cap_pending : 64;
        cm_shard_entry *p = realloc(w->pending, cap * sizeof *p);
        if (!p)
            return CM_FAIL(CM_ERR_NOMEM, "cannot grow the pending entries to %llu", (unsigned long long)cap);
        w->pending = p, w->cap_pending = cap;
    }
    e.shard = w->shard;
    e.offset = w->shard_end;
    uint8_t h[CM_SHARD_RECORD_HEADER_SIZE];
    record_header_encode(h, &e);
    cm_status st = write_all(w->shard_fd, h, sizeof h, e.offset, w->shard_path);
    if (st == CM_OK)
        st = write_all(w->shard_fd, parts[0], lens[0], e.offset + sizeof h, w->shard_path);
    if (st == CM_OK)
        st = write_all(w->shard_fd, parts[1], lens[1], e.offset + sizeof h + lens[0], w->shard_path);
    if (st != CM_OK) {
        if (ftruncate(w->shard_fd, (off_t)w->shard_end) != 0)
            w->broken = 1;
        return st;
    }
    int ins;
    CM_TRY(idmap_put(&w->ids, batch_id, 0, &ins));
    w->pending[w->n_pending++] = e;
    w->shard_end += rec;
    if (w->cfg.fsync_every && w->n_pending >= w->cfg.fsync_every)
        CM_TRY(cm_shard_writer_sync(w));
    return CM_OK;
}

/* The checks before any append: usable, batch not stored, bounded size. */
static cm_status append_check(cm_shard_writer *w, uint64_t batch_id, uint64_t len) {
    CM_TRY(writer_usable(w));
    if (cm_shard_writer_has(w, batch_id))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "shard directory '%s' already holds batch %llu (check cm_shard_writer_has before "
                       "appending)",
                       w->dir, (unsigned long long)batch_id);
    if (len > CM_SHARD_MAX_PAYLOAD)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s': batch %llu has %llu bytes, more than %llu",
                       w->dir, (unsigned long long)batch_id, (unsigned long long)len,
                       (unsigned long long)CM_SHARD_MAX_PAYLOAD);
    return CM_OK;
}

static cm_status not_an_answer(const cm_shard_writer *w, uint64_t batch_id) {
    char why[512];
    snprintf(why, sizeof why, "%s", cm_last_error());
    return CM_FAIL(CM_ERR_INVALID_ARG,
                   "shard directory '%s': batch %llu is not a valid ANSWER frame (%s); nothing "
                   "written",
                   w->dir, (unsigned long long)batch_id, why);
}

cm_status cm_shard_writer_append(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                                 const void *frame, size_t len) {
    static const cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    CM_TRY(append_check(w, batch_id, len));
    cm_proto_answer a = {.tensors = w->tensors, .cap_tensors = 64};
    if (cm_proto_answer_decode(frame, len, &lim, &a) != CM_OK)
        return not_an_answer(w, batch_id);
    const void  *parts[2] = {frame, NULL};
    const size_t lens[2] = {len, 0};
    return writer_append(w, batch_id, batch_hash, &a, parts, lens);
}

cm_status cm_shard_writer_append_parts(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                                       const void *head, size_t head_len, const void *data, size_t data_len) {
    static const cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    CM_TRY(append_check(w, batch_id, (uint64_t)head_len + data_len));
    cm_proto_answer a = {.tensors = w->tensors, .cap_tensors = 64};
    if (cm_proto_answer_decode_parts(head, head_len, data, data_len, &lim, &a) != CM_OK)
        return not_an_answer(w, batch_id);
    const void  *parts[2] = {head, data};
    const size_t lens[2] = {head_len, data_len};
    return writer_append(w, batch_id, batch_hash, &a, parts, lens);
}

cm_status cm_shard_writer_restore_parts(cm_shard_writer *w, uint64_t batch_id, uint64_t batch_hash,
                                        const void *head, size_t head_len, const void *data, size_t data_len) {
    CM_TRY(writer_usable(w));
    uint64_t k;
    if (!idmap_get(&w->damaged_ids, batch_id, &k) || w->restored[k])
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s': batch %llu is not a damaged record", w->dir,
                       (unsigned long long)batch_id);
    const cm_shard_entry *e = &w->damaged[k];
    const char           *dir = w->dir;
    char                  name[32], path[SH_PATH_MAX];
    shard_name(name, e->shard);
    cm_xxh64_state hs;
    cm_xxh64_init(&hs, 0);
    cm_xxh64_update(&hs, head, head_len);
    cm_xxh64_update(&hs, data, data_len);
    const uint64_t sum = cm_xxh64_digest(&hs), len = (uint64_t)head_len + data_len;
    if (len != e->length || sum != e->checksum || (batch_hash && e->batch_hash && batch_hash != e->batch_hash))
        return CM_FAIL(CM_ERR_FORMAT,
                       "shard directory '%s': %s offset %llu (batch %llu) is corrupted and cannot be restored "
                       "in place: the new answer (%llu bytes, checksum %016llx, batch hash %016llx) is not "
                       "the stored one (%llu, %016llx, %016llx): the target, its weights or the data "
                       "changed, or its forward is not bit-reproducible; precompute into a new directory",
                       dir, name, (unsigned long long)e->offset, (unsigned long long)e->batch_id,
                       (unsigned long long)len, (unsigned long long)sum, (unsigned long long)batch_hash,
                       (unsigned long long)e->length, (unsigned long long)e->checksum,
                       (unsigned long long)e->batch_hash);
    int fd = -1;
    CM_TRY(shard_open(&fd, dir, e->shard, O_RDWR, path));
    uint8_t h[CM_SHARD_RECORD_HEADER_SIZE];
    record_header_encode(h, e);
    uint8_t  *buf = malloc(SH_READ_SIZE);
    cm_status st = buf ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate a read buffer");
    if (st == CM_OK)
        st = write_all(fd, h, sizeof h, e->offset, path);
    if (st == CM_OK)
        st = write_all(fd, head, head_len, e->offset + sizeof h, path);
    if (st == CM_OK)
        st = write_all(fd, data, data_len, e->offset + sizeof h + head_len, path);
    if (st == CM_OK)
        st = fsync_fd(fd, path); /* a failure leaves the record damaged, as it was: a re-run retries */
    if (st == CM_OK)
        st = record_verify_fd(fd, path, e, dir, buf);
    close(fd);
    free(buf);
    CM_TRY(st);
    CM_LOG_INFO("shard directory '%s': restored %s offset %llu (batch %llu)", dir, name,
                (unsigned long long)e->offset, (unsigned long long)e->batch_id);
    w->restored[k] = 1;
    w->n_restored++;
    return CM_OK;
}

static void writer_free(cm_shard_writer *w) {
    if (w->shard_fd >= 0)
        close(w->shard_fd);
    if (w->index_fd >= 0)
        close(w->index_fd);
    if (w->dir_fd >= 0)
        close(w->dir_fd);
    cm_lock_destroy(&w->lock);
    idmap_release(&w->ids);
    idmap_release(&w->damaged_ids);
    free(w->damaged);
    free(w->restored);
    free(w->pending);
    free(w->ibuf);
    free(w->dir);
    free(w);
}

cm_status cm_shard_writer_close(cm_shard_writer **pw) {
    if (!pw || !*pw)
        return CM_OK;
    cm_shard_writer *w = *pw;
    cm_status        st = w->n_pending ? cm_shard_writer_sync(w) : CM_OK;
    writer_free(w);
    *pw = NULL;
    return st;
}

void cm_shard_writer_destroy(cm_shard_writer **pw) {
    if (!pw || !*pw)
        return;
    if ((*pw)->n_pending && !(*pw)->broken && cm_shard_writer_sync(*pw) != CM_OK)
        CM_LOG_WARN(
            "shard directory '%s': %llu records not indexed at close (%s); a resumed run writes them again",
            (*pw)->dir, (unsigned long long)(*pw)->n_pending, cm_last_error());
    writer_free(*pw);
    *pw = NULL;
}

// ----------------------------------------------------------------------------
// reader

typedef struct rd_shard {
    char    *path;
    uint8_t *map;
    uint64_t map_len; /* = the indexed end */
    uint64_t file_bytes;
} rd_shard;

struct cm_shard_reader {
    char       *dir;
    store_index x;
    rd_shard   *shards;
};

cm_status cm_shard_reader_open(cm_shard_reader **out, const char *dir, const cm_shard_identity *want) {
    cm_status        st = CM_OK;
    cm_shard_reader *r = NULL;
    char             path[SH_PATH_MAX];
    int              fd = -1;
    *out = NULL;
    if (!dir || !dir[0])
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard reader: no directory given");
    CM_TRY(path_join(path, dir, CM_SHARD_INDEX_NAME));
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return CM_FAIL(CM_ERR_IO, "cannot open shard index '%s': %s (is '%s' a shard directory?)", path,
                       strerror(errno), dir);
    if (!(r = calloc(1, sizeof *r)) || !(r->dir = strdup(dir))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate a shard reader");
        goto fail;
    }
    CM_TRY_GOTO(store_index_load(&r->x, fd, path, 0), st, fail);
    close(fd), fd = -1;
    if (r->x.torn_bytes)
        CM_LOG_WARN(
            "shard directory '%s': ignoring a partial entry (%llu bytes) at the end of the index: a writer "
            "is appending or stopped",
            dir, (unsigned long long)r->x.torn_bytes);
    if (r->x.version < CM_SHARD_VERSION)
        CM_LOG_WARN("shard directory '%s' is shard format version %u: it does not record the target's weights, "
                    "so only its config (%016llx) can be checked; precompute again to record them",
                    dir, r->x.version, (unsigned long long)r->x.id.target_id);
    if (want)
        CM_TRY_GOTO(cm_shard_identity_check(&r->x.id, want, 0, dir), st, fail);
    if (!(r->shards = calloc(r->x.n_shards ? r->x.n_shards : 1, sizeof *r->shards))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %u shards", r->x.n_shards);
        goto fail;
    }
    for (uint32_t k = 0; k < r->x.n_shards; k++) {
        rd_shard *s = &r->shards[k];
        CM_TRY_GOTO(shard_open(&fd, dir, k, O_RDONLY, path), st, fail);
        CM_TRY_GOTO(file_size(fd, path, &s->file_bytes), st, fail);
        CM_TRY_GOTO(span_check(&r->x, k, s->file_bytes, dir), st, fail);
        if (!(s->path = strdup(path))) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot copy a path");
            goto fail;
        }
        s->map_len = r->x.spans[k].end; /* ≥ 1 record: never 0 */
        if (s->map_len > SIZE_MAX) {
            st = CM_FAIL(CM_ERR_FORMAT, "'%s' is too large to map", path);
            goto fail;
        }
        void *m = mmap(NULL, (size_t)s->map_len, PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) {
            st = CM_FAIL(CM_ERR_IO, "cannot map '%s' (%llu bytes): %s", path, (unsigned long long)s->map_len,
                         strerror(errno));
            goto fail;
        }
        s->map = m;
        close(fd), fd = -1;
    }
    *out = r;
    return CM_OK;
fail:
    if (fd >= 0)
        close(fd);
    cm_shard_reader_destroy(&r);
    return st;
}

void cm_shard_reader_destroy(cm_shard_reader **pr) {
    if (!pr || !*pr)
        return;
    cm_shard_reader *r = *pr;
    for (uint32_t k = 0; r->shards && k < r->x.n_shards; k++) {
        if (r->shards[k].map)
            munmap(r->shards[k].map, (size_t)r->shards[k].map_len);
        free(r->shards[k].path);
    }
    free(r->shards);
    store_index_release(&r->x);
    free(r->dir);
    free(r);
    *pr = NULL;
}

const cm_shard_identity *cm_shard_reader_identity(const cm_shard_reader *r) {
    return &r->x.id;
}
uint32_t cm_shard_reader_version(const cm_shard_reader *r) {
    return r->x.version;
}
const char *cm_shard_reader_dir(const cm_shard_reader *r) {
    return r->dir;
}
uint64_t cm_shard_reader_count(const cm_shard_reader *r) {
    return r->x.n;
}
uint32_t cm_shard_reader_n_shards(const cm_shard_reader *r) {
    return r->x.n_shards;
}

void cm_shard_reader_entry(const cm_shard_reader *r, uint64_t i, cm_shard_entry *out) {
    CM_ASSERT(i < r->x.n);
    *out = r->x.entries[i];
}

void cm_shard_reader_shard(const cm_shard_reader *r, uint32_t k, cm_shard_info *out) {
    CM_ASSERT(k < r->x.n_shards);
    out->path = r->shards[k].path;
    out->n_records = r->x.spans[k].n_records;
    out->bytes = r->x.spans[k].end;
    out->file_bytes = r->shards[k].file_bytes;
    out->first = r->x.spans[k].first;
}

int cm_shard_reader_find(const cm_shard_reader *r, uint64_t batch_id, uint64_t *i) {
    return idmap_get(&r->x.map, batch_id, i);
}

cm_status cm_shard_reader_at(const cm_shard_reader *r, uint64_t i, const void **frame, size_t *len) {
    if (i >= r->x.n)
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s': record %llu asked for, it holds %llu",
                       r->dir, (unsigned long long)i, (unsigned long long)r->x.n);
    const cm_shard_entry *e = &r->x.entries[i];
    const rd_shard       *s = &r->shards[e->shard];
    const char           *dir = r->dir;
    if (e->offset > s->map_len || s->map_len - e->offset < CM_SHARD_RECORD_HEADER_SIZE + e->length) {
        char name[32];
        shard_name(name, e->shard);
        return REC_FAIL("the record runs past the %llu mapped bytes", (unsigned long long)s->map_len);
    }
    const uint8_t *p = s->map + e->offset;
    CM_TRY(record_header_check(p, e, dir));
    CM_TRY(payload_check(cm_xxh64(p + CM_SHARD_RECORD_HEADER_SIZE, (size_t)e->length, 0), e, dir));
    *frame = p + CM_SHARD_RECORD_HEADER_SIZE;
    *len = (size_t)e->length;
    return CM_OK;
}

cm_status cm_shard_reader_get(const cm_shard_reader *r, uint64_t batch_id, uint64_t batch_hash,
                              const void **frame, size_t *len) {
    uint64_t i;
    if (!cm_shard_reader_find(r, batch_id, &i))
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s' holds no batch %llu (%llu records)", r->dir,
                       (unsigned long long)batch_id, (unsigned long long)r->x.n);
    const cm_shard_entry *e = &r->x.entries[i];
    if (batch_hash && e->batch_hash && batch_hash != e->batch_hash)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "shard directory '%s': batch %llu was computed for other tokens (its request hashed to "
            "%016llx, this batch to %016llx): the shards belong to another dataset or packing; "
            "run precompute for this data",
            r->dir, (unsigned long long)batch_id, (unsigned long long)e->batch_hash,
            (unsigned long long)batch_hash);
    return cm_shard_reader_at(r, i, frame, len);
}
