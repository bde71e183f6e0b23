/* common/format/cm_shard_write.c — the appending shard writer of cm_shard.h: create or resume a
 * directory (the index's torn tail cut, records past it removed, with cfg.verify every
 * record checked and the damaged ones kept for restoring), append ANSWER frames as records,
 * and sync the index in batches. */
#include "cm_shard_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_hash.h"
#include "cm_lock.h"
#include "cm_log.h"
#include "cm_time.h"

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
    cm_shard_index_header_encode_(h, &w->id);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    cm_status st = cm_shard_write_all_(fd, h, sizeof h, 0, tmp);
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
        cm_status st = cm_shard_record_verify_fd_(fd, path, &x->entries[i], w->dir, buf);
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
        CM_TRY(cm_shard_idmap_put_(&w->damaged_ids, x->entries[i].batch_id, w->n_damaged, &ins));
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
    CM_TRY(cm_shard_index_load_(&x, w->index_fd, w->index_path, 1));
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
        CM_TRY_GOTO(cm_shard_open_(&fd, w->dir, k, O_RDWR, path), st, fail);
        st = cm_shard_file_size_(fd, path, &size);
        if (st == CM_OK)
            st = cm_shard_span_check_(&x, k, size, w->dir);
        if (st == CM_OK && w->cfg.verify)
            st = writer_verify_shard(w, &x, k, fd, path, buf);
        else if (st == CM_OK)
            st = cm_shard_record_verify_fd_(fd, path, &x.entries[x.spans[k].first + x.spans[k].n_records - 1],
                                            w->dir, buf);
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
        if (!cm_shard_parse_name_(de->d_name, &k) || k < x.n_shards)
            continue;
        CM_TRY_GOTO(cm_shard_path_join_(path, w->dir, de->d_name), st, fail);
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
        CM_TRY_GOTO(cm_shard_idmap_put_(&w->ids, x.entries[i].batch_id, 0, &ins), st, fail);
    }
    w->n_durable = x.n;
    if (x.n)
        CM_LOG_INFO("shard directory '%s': resuming after %llu records in %u shards%s", w->dir,
                    (unsigned long long)x.n, x.n_shards, w->cfg.verify ? ", every one verified" : "");
fail:
    if (d)
        closedir(d);
    free(buf);
    cm_shard_index_release_(&x);
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
    CM_TRY(cm_shard_identity_valid_(id, CM_ERR_INVALID_ARG, "shard writer identity"));
    if (!(w = calloc(1, sizeof *w)))
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a shard writer");
    w->dir_fd = w->index_fd = w->shard_fd = -1;
    w->id = *id, w->cfg = *cfg;
    if (!(w->dir = strdup(dir))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot copy a path");
        goto fail;
    }
    CM_TRY_GOTO(cm_shard_path_join_(w->index_path, dir, CM_SHARD_INDEX_NAME), st, fail);
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
        CM_TRY_GOTO(cm_shard_path_join_(lock_path, dir, CM_SHARD_LOCK_NAME), st, fail);
        snprintf(what, sizeof what, "shard directory '%s'", dir);
        CM_TRY_GOTO(cm_lock_create(&w->lock, lock_path, what, "writer", "stop it or use another directory"), st,
                    fail);
    }
    if (access(w->index_path, F_OK) != 0) {
        DIR *d = opendir(dir);
        for (struct dirent *de; d && (de = readdir(d));) {
            uint32_t k;
            if (cm_shard_parse_name_(de->d_name, &k)) {
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
    return cm_shard_idmap_get_(&w->ids, batch_id, NULL);
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
    return cm_shard_idmap_get_(&w->damaged_ids, batch_id, &k) && !w->restored[k];
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
        cm_shard_entry_encode_(w->ibuf + i * CM_SHARD_ENTRY_SIZE, &w->pending[i]);
    cm_status st = cm_shard_write_all_(w->index_fd, w->ibuf, need, w->index_end, w->index_path);
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
    CM_TRY(cm_shard_path_(w->shard_path, w->dir, k));
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
    cm_shard_record_header_encode_(h, &e);
    cm_status st = cm_shard_write_all_(w->shard_fd, h, sizeof h, e.offset, w->shard_path);
    if (st == CM_OK)
        st = cm_shard_write_all_(w->shard_fd, parts[0], lens[0], e.offset + sizeof h, w->shard_path);
    if (st == CM_OK)
        st =
            cm_shard_write_all_(w->shard_fd, parts[1], lens[1], e.offset + sizeof h + lens[0], w->shard_path);
    if (st != CM_OK) {
        if (ftruncate(w->shard_fd, (off_t)w->shard_end) != 0)
            w->broken = 1;
        return st;
    }
    int ins;
    CM_TRY(cm_shard_idmap_put_(&w->ids, batch_id, 0, &ins));
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
    if (!cm_shard_idmap_get_(&w->damaged_ids, batch_id, &k) || w->restored[k])
        return CM_FAIL(CM_ERR_INVALID_ARG, "shard directory '%s': batch %llu is not a damaged record", w->dir,
                       (unsigned long long)batch_id);
    const cm_shard_entry *e = &w->damaged[k];
    const char           *dir = w->dir;
    char                  name[32], path[SH_PATH_MAX];
    cm_shard_name_(name, e->shard);
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
    CM_TRY(cm_shard_open_(&fd, dir, e->shard, O_RDWR, path));
    uint8_t h[CM_SHARD_RECORD_HEADER_SIZE];
    cm_shard_record_header_encode_(h, e);
    uint8_t  *buf = malloc(SH_READ_SIZE);
    cm_status st = buf ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate a read buffer");
    if (st == CM_OK)
        st = cm_shard_write_all_(fd, h, sizeof h, e->offset, path);
    if (st == CM_OK)
        st = cm_shard_write_all_(fd, head, head_len, e->offset + sizeof h, path);
    if (st == CM_OK)
        st = cm_shard_write_all_(fd, data, data_len, e->offset + sizeof h + head_len, path);
    if (st == CM_OK)
        st = fsync_fd(fd, path); /* a failure leaves the record damaged, as it was: a re-run retries */
    if (st == CM_OK)
        st = cm_shard_record_verify_fd_(fd, path, e, dir, buf);
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
    cm_shard_idmap_release_(&w->ids);
    cm_shard_idmap_release_(&w->damaged_ids);
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
