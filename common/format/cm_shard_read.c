/* common/format/cm_shard_read.c — the mmap shard reader of cm_shard.h: opens a directory's
 * index and maps its shards; each record is checked again (header and checksum, cheaply)
 * before it is handed out. */
#include "cm_shard_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cm_hash.h"
#include "cm_log.h"

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
    CM_TRY(cm_shard_path_join_(path, dir, CM_SHARD_INDEX_NAME));
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return CM_FAIL(CM_ERR_IO, "cannot open shard index '%s': %s (is '%s' a shard directory?)", path,
                       strerror(errno), dir);
    if (!(r = calloc(1, sizeof *r)) || !(r->dir = strdup(dir))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate a shard reader");
        goto fail;
    }
    CM_TRY_GOTO(cm_shard_index_load_(&r->x, fd, path, 0), st, fail);
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
        CM_TRY_GOTO(cm_shard_open_(&fd, dir, k, O_RDONLY, path), st, fail);
        CM_TRY_GOTO(cm_shard_file_size_(fd, path, &s->file_bytes), st, fail);
        CM_TRY_GOTO(cm_shard_span_check_(&r->x, k, s->file_bytes, dir), st, fail);
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
    cm_shard_index_release_(&r->x);
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
    return cm_shard_idmap_get_(&r->x.map, batch_id, i);
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
        cm_shard_name_(name, e->shard);
        return REC_FAIL("the record runs past the %llu mapped bytes", (unsigned long long)s->map_len);
    }
    const uint8_t *p = s->map + e->offset;
    CM_TRY(cm_shard_record_header_check_(p, e, dir));
    CM_TRY(cm_shard_payload_check_(cm_xxh64(p + CM_SHARD_RECORD_HEADER_SIZE, (size_t)e->length, 0), e, dir));
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
