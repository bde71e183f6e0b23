/* common/format/cm_shard_index.c — the shard store's files and index (cm_shard.h): paths and
 * full reads and writes, the identity checks, the entry and record codecs, and the index
 * loading with the checks shared by the writer's resume and the reader's open (identity,
 * entry checksums, placement, unique ids, shard sizes). Every length and offset read from a
 * file is bounded first: placements are checked against the tiling rule and the files' sizes
 * before any mapping is touched. */
#include "cm_shard_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_bytes.h"
#include "cm_hash.h"

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

cm_status cm_shard_path_join_(char *dst, const char *dir, const char *name) {
    int n = snprintf(dst, SH_PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= SH_PATH_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path '%s/%s' is longer than %d bytes", dir, name,
                       SH_PATH_MAX - 1);
    return CM_OK;
}

void cm_shard_name_(char *dst, uint32_t k) {
    snprintf(dst, 32, "shard-%05u.bin", k);
}

cm_status cm_shard_path_(char *dst, const char *dir, uint32_t k) {
    char name[32];
    cm_shard_name_(name, k);
    return cm_shard_path_join_(dst, dir, name);
}

/* Full pwrite/pread; CM_ERR_IO naming the file on failure or a short read. */
cm_status cm_shard_write_all_(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
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
// identity

static int name_char_ok(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
}

/* Checks an identity's fields; st is CM_ERR_INVALID_ARG for the caller's, CM_ERR_FORMAT for a file's. */
cm_status cm_shard_identity_valid_(const cm_shard_identity *id, cm_status st, const char *what) {
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

void cm_shard_index_header_encode_(uint8_t *p, const cm_shard_identity *id) {
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
    if (cm_le_get_u16(p + 10) < CM_PROTO_ANSWER_MIN_VERSION || cm_le_get_u16(p + 10) > CM_PROTO_VERSION)
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s': the records hold protocol version %u frames, this build reads versions "
                       "%d to %d: run precompute again with this build",
                       path, cm_le_get_u16(p + 10), CM_PROTO_ANSWER_MIN_VERSION, CM_PROTO_VERSION);
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
    return cm_shard_identity_valid_(id, CM_ERR_FORMAT, path);
}

// ----------------------------------------------------------------------------
// entries and records

void cm_shard_entry_encode_(uint8_t *p, const cm_shard_entry *e) {
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

void cm_shard_record_header_encode_(uint8_t *p, const cm_shard_entry *e) {
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

/* Checks a record header against its index entry. */
cm_status cm_shard_record_header_check_(const uint8_t *p, const cm_shard_entry *e, const char *dir) {
    char name[32];
    cm_shard_name_(name, e->shard);
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

cm_status cm_shard_payload_check_(uint64_t got, const cm_shard_entry *e, const char *dir) {
    char name[32];
    cm_shard_name_(name, e->shard);
    if (got != e->checksum)
        return REC_FAIL("payload checksum mismatch (stored %016llx, computed %016llx)",
                        (unsigned long long)e->checksum, (unsigned long long)got);
    return CM_OK;
}

/* Verifies a record in an open shard file (header and streamed payload checksum). */
cm_status cm_shard_record_verify_fd_(int fd, const char *path, const cm_shard_entry *e, const char *dir,
                                  uint8_t *buf) {
    uint8_t h[CM_SHARD_RECORD_HEADER_SIZE];
    CM_TRY(read_all(fd, h, sizeof h, e->offset, path));
    CM_TRY(cm_shard_record_header_check_(h, e, dir));
    cm_xxh64_state s;
    cm_xxh64_init(&s, 0);
    for (uint64_t done = 0; done < e->length;) {
        size_t n = e->length - done < SH_READ_SIZE ? (size_t)(e->length - done) : SH_READ_SIZE;
        CM_TRY(read_all(fd, buf, n, e->offset + CM_SHARD_RECORD_HEADER_SIZE + done, path));
        cm_xxh64_update(&s, buf, n);
        done += n;
    }
    return cm_shard_payload_check_(cm_xxh64_digest(&s), e, dir);
}

// ----------------------------------------------------------------------------
// index loading and checks (shared by the writer's resume and the reader)

void cm_shard_index_release_(store_index *x) {
    free(x->entries);
    free(x->spans);
    cm_shard_idmap_release_(&x->map);
    memset(x, 0, sizeof *x);
}

/* Reads DIR/index.bin. torn_ok = 1 (writer): entries failing their checksum at the end are
 * counted in n_torn and dropped; 0 (reader): any bad entry is refused. A partial entry at
 * the end is always dropped (torn_bytes). Then checks placement and unique ids. */
cm_status cm_shard_index_load_(store_index *x, int fd, const char *path, int torn_ok) {
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
        cm_shard_name_(a, e->shard);
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
            cm_shard_name_(b, p ? p->shard : 0);
            cm_shard_name_(c, p ? p->shard + 1 : 0);
            st = CM_FAIL(CM_ERR_FORMAT,
                         "'%s': entry %llu (batch %llu) points to %s offset %llu; records are back to "
                         "back, so it must be at %s offset %llu or %s offset 0: the index is corrupted",
                         path, (unsigned long long)i, (unsigned long long)e->batch_id, a,
                         (unsigned long long)e->offset, b, (unsigned long long)(p ? end : 0), c);
            goto fail;
        }
        end = e->offset + CM_SHARD_RECORD_HEADER_SIZE + e->length; /* both bounded: no overflow */
        int ins;
        CM_TRY_GOTO(cm_shard_idmap_put_(&x->map, e->batch_id, i, &ins), st, fail);
        if (!ins) {
            uint64_t j = 0;
            cm_shard_idmap_get_(&x->map, e->batch_id, &j);
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
    cm_shard_index_release_(x);
    return st;
}

/* The shard must hold every byte its entries name. */
cm_status cm_shard_span_check_(const store_index *x, uint32_t k, uint64_t file_bytes, const char *dir) {
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
    cm_shard_name_(name, k);
    return CM_FAIL(CM_ERR_FORMAT,
                   "shard directory '%s': the index puts batch %llu at %s bytes %llu..%llu, but the "
                   "file has %llu bytes: the shard is truncated or the index is not this directory's",
                   dir, (unsigned long long)e->batch_id, name, (unsigned long long)e->offset,
                   (unsigned long long)(e->offset + CM_SHARD_RECORD_HEADER_SIZE + e->length),
                   (unsigned long long)file_bytes);
}

/* Opens shard k; a missing file is a damaged store. */
cm_status cm_shard_open_(int *fd, const char *dir, uint32_t k, int flags, char *path) {
    CM_TRY(cm_shard_path_(path, dir, k));
    *fd = open(path, flags | O_CLOEXEC);
    if (*fd < 0 && errno == ENOENT)
        return CM_FAIL(CM_ERR_FORMAT, "shard directory '%s': the index names '%s', which is missing", dir,
                       path);
    if (*fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    return CM_OK;
}

cm_status cm_shard_file_size_(int fd, const char *path, uint64_t *size) {
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
    *size = (uint64_t)sb.st_size;
    return CM_OK;
}

/* Parses "shard-<digits>.bin"; 1 and *k on success. */
int cm_shard_parse_name_(const char *s, uint32_t *k) {
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
    cm_shard_name_(canon, (uint32_t)v);
    if (strcmp(canon, s) != 0)
        return 0;
    *k = (uint32_t)v;
    return 1;
}
