/* common/format/cm_weights_id.c — the fingerprint of a checkpoint's weights and its cache beside the
 * checkpoint (see cm_weights_id.h). */
#include "cm_weights_id.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_bytes.h"
#include "cm_hash.h"
#include "cm_log.h"
#include "cm_pool.h"
#include "cm_time.h"

#define CHUNK_BYTES (32u << 20)
#define MAX_THREADS 16

int cm_weights_id_covers(const char *name) {
    return strncmp(name, "model.visual.", 13) != 0 && strncmp(name, "mtp.", 4) != 0;
}

static int default_threads(int n) {
    if (n > 0)
        return n < MAX_THREADS ? n : MAX_THREADS;
    return cm_pool_cpu_threads(MAX_THREADS);
}

// ----------------------------------------------------------------------------
// hashing: the chunks of every covered tensor are the work items

typedef struct chunk {
    const uint8_t *p;
    size_t         n;
} chunk;

typedef struct work {
    const chunk *chunks;
    uint64_t    *hashes;
} work;

static cm_status hash_item(void *ctx, int worker, int64_t i) {
    work *w = ctx;
    (void)worker;
    w->hashes[i] = cm_xxh64(w->chunks[i].p, w->chunks[i].n, 0);
    return CM_OK;
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const cm_st_tensor *const *)a)->name, (*(const cm_st_tensor *const *)b)->name);
}

static void hash_u32(cm_xxh64_state *s, uint32_t v) {
    uint8_t b[4];
    cm_le_put_u32(b, v);
    cm_xxh64_update(s, b, 4);
}

static void hash_u64(cm_xxh64_state *s, uint64_t v) {
    uint8_t b[8];
    cm_le_put_u64(b, v);
    cm_xxh64_update(s, b, 8);
}

cm_status cm_weights_id_compute(const cm_st *st, int n_threads, cm_weights_id_info *out) {
    memset(out, 0, sizeof *out);
    const double         t0 = cm_now_s();
    const int            n_all = cm_st_count(st);
    const cm_st_tensor **ts = malloc((size_t)(n_all ? n_all : 1) * sizeof *ts);
    size_t              *first = malloc((size_t)(n_all + 1) * sizeof *first);
    if (!ts || !first) {
        free(ts), free(first);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the fingerprint's tensor list (%d tensors)", n_all);
    }
    int      n = 0;
    size_t   n_chunks = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < n_all; i++)
        if (cm_weights_id_covers(cm_st_at(st, i)->name))
            ts[n++] = cm_st_at(st, i);
    if (n == 0) {
        free(ts), free(first);
        return CM_FAIL(CM_ERR_INVALID_ARG, "the checkpoint holds no text-model tensor to fingerprint");
    }
    qsort(ts, (size_t)n, sizeof *ts, by_name);
    for (int k = 0; k < n; k++) {
        size_t nb = ts[k]->nbytes;
        first[k] = n_chunks;
        n_chunks += nb ? (nb + CHUNK_BYTES - 1) / CHUNK_BYTES : 1;
        bytes += nb;
    }
    first[n] = n_chunks;
    chunk    *chunks = malloc(n_chunks * sizeof *chunks);
    uint64_t *hashes = malloc(n_chunks * sizeof *hashes);
    if (!chunks || !hashes) {
        free(ts), free(first), free(chunks), free(hashes);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the fingerprint's %zu chunks", n_chunks);
    }
    for (int k = 0; k < n; k++) {
        const cm_st_tensor *t = ts[k];
        for (size_t c = first[k], off = 0; c < first[k + 1]; c++, off += CHUNK_BYTES) {
            chunks[c].p = (const uint8_t *)t->data + off;
            chunks[c].n = t->nbytes - off < CHUNK_BYTES ? t->nbytes - off : CHUNK_BYTES;
        }
    }

    work     w = {.chunks = chunks, .hashes = hashes};
    int      nt = default_threads(n_threads), failed;
    cm_pool *pool = NULL;
    if ((size_t)nt > n_chunks)
        nt = (int)n_chunks;
    if (nt > 1 && cm_pool_create(&pool, nt, "weights fingerprint") == CM_OK) {
        cm_pool_run(pool, hash_item, &w, (int64_t)n_chunks, &failed); /* hash_item never fails */
        cm_pool_destroy(&pool);
    } else { /* one thread, or no pool: fewer threads are still exact */
        for (size_t i = 0; i < n_chunks; i++)
            hash_item(&w, 0, (int64_t)i);
    }

    cm_xxh64_state s;
    cm_xxh64_init(&s, 0);
    cm_xxh64_update(&s, "tandem-weights-v1", 17);
    for (int k = 0; k < n; k++) {
        const cm_st_tensor *t = ts[k];
        const char         *dt = cm_dtype_name(t->dtype);
        cm_xxh64_state      cs;
        cm_xxh64_init(&cs, (uint64_t)t->nbytes);
        for (size_t c = first[k]; c < first[k + 1]; c++)
            hash_u64(&cs, hashes[c]);
        cm_xxh64_update(&s, t->name, strlen(t->name) + 1);
        cm_xxh64_update(&s, dt, strlen(dt) + 1);
        hash_u32(&s, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++)
            hash_u64(&s, (uint64_t)t->shape[d]);
        hash_u64(&s, (uint64_t)t->nbytes);
        hash_u64(&s, cm_xxh64_digest(&cs));
    }
    uint64_t id = cm_xxh64_digest(&s);
    out->id = id ? id : 1;
    out->n_tensors = n;
    out->bytes = bytes;
    out->seconds = cm_now_s() - t0;
    free(ts), free(first), free(chunks), free(hashes);
    return CM_OK;
}

const char *cm_weights_id_hex(uint64_t id, char *buf) {
    snprintf(buf, 17, "%016llx", (unsigned long long)id);
    return buf;
}

// ----------------------------------------------------------------------------
// the cache: DIR/.tandem-fingerprint

typedef struct file_list {
    int         n;
    const char *path[4096]; /* borrowed from the cm_st */
} file_list;

static int by_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The distinct files st reads from, sorted. */
static cm_status files_of(const cm_st *st, file_list *fl) {
    fl->n = 0;
    for (int i = 0; i < cm_st_count(st); i++) {
        const char *f = cm_st_at(st, i)->file;
        int         seen = 0;
        for (int j = fl->n - 1; j >= 0 && !seen; j--)
            seen = strcmp(fl->path[j], f) == 0;
        if (seen)
            continue;
        if (fl->n == (int)(sizeof fl->path / sizeof fl->path[0]))
            return CM_FAIL(CM_ERR_UNSUPPORTED, "the checkpoint has more than %d files", fl->n);
        fl->path[fl->n++] = f;
    }
    qsort(fl->path, (size_t)fl->n, sizeof fl->path[0], by_str);
    return CM_OK;
}

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* The cache's text for id over the files of fl, with its checksum line; malloc'ed. NULL if a
 * file cannot be stat'ed (then there is nothing to cache against). */
static char *cache_text(const file_list *fl, const cm_weights_id_info *info) {
    size_t cap = 256 + (size_t)fl->n * 320, len = 0;
    char  *s = malloc(cap);
    if (!s)
        return NULL;
    char hex[17];
    len +=
        (size_t)snprintf(s + len, cap - len, "tandem-fingerprint 1\nid %s\ntensors %d bytes %llu\n",
                         cm_weights_id_hex(info->id, hex), info->n_tensors, (unsigned long long)info->bytes);
    for (int i = 0; i < fl->n; i++) {
        struct stat sb;
        if (stat(fl->path[i], &sb) != 0 || strlen(base_name(fl->path[i])) > 255) {
            free(s);
            return NULL;
        }
        len +=
            (size_t)snprintf(s + len, cap - len, "file %lld %lld.%09ld %s\n", (long long)sb.st_size,
                             (long long)sb.st_mtim.tv_sec, (long)sb.st_mtim.tv_nsec, base_name(fl->path[i]));
    }
    snprintf(s + len, cap - len, "check %s\n", cm_weights_id_hex(cm_xxh64(s, len, 0), hex));
    return s;
}

/* 1 and *info from the cache when its text is exactly what the files are now (sizes, times and
 * names) with a matching checksum; 0 otherwise. */
static int cache_read(const char *dir, const file_list *fl, cm_weights_id_info *info) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, CM_WEIGHTS_ID_CACHE);
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    char   buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    int    whole = feof(f);
    fclose(f);
    if (!whole)
        return 0;
    buf[n] = '\0';
    unsigned long long id = 0, bytes = 0;
    int                tensors = 0;
    if (sscanf(buf, "tandem-fingerprint 1\nid %16llx\ntensors %d bytes %llu\n", &id, &tensors, &bytes) != 3 ||
        !id)
        return 0;
    cm_weights_id_info c = {.id = id, .n_tensors = tensors, .bytes = bytes, .from_cache = 1};
    char              *now = cache_text(fl, &c);
    int                ok = now && strcmp(now, buf) == 0; /* same files, sizes, times, id, checksum */
    free(now);
    if (ok)
        *info = c;
    return ok;
}

static void cache_write(const char *dir, const file_list *fl, const cm_weights_id_info *info) {
    char *text = cache_text(fl, info);
    char  path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%s", dir, CM_WEIGHTS_ID_CACHE);
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    FILE *f = text ? fopen(tmp, "wb") : NULL;
    int   ok = f && fputs(text, f) >= 0;
    if (f)
        ok = (fflush(f) == 0 && fsync(fileno(f)) == 0) && ok, ok = fclose(f) == 0 && ok;
    if (ok)
        ok = rename(tmp, path) == 0;
    if (!ok) {
        CM_LOG_DEBUG("not caching the fingerprint in '%s': %s", path, strerror(errno));
        if (f)
            unlink(tmp);
    }
    free(text);
}

cm_status cm_weights_id_dir(const cm_st *st, const char *dir, int flags, int n_threads,
                            cm_weights_id_info *out) {
    file_list *fl = malloc(sizeof *fl); /* 32 KB: not on a loader thread's stack */
    if (!fl)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the checkpoint's file list");
    cm_status st_ = files_of(st, fl);
    if (st_ == CM_OK && (flags & CM_WEIGHTS_ID_READ_CACHE) && cache_read(dir, fl, out)) {
        free(fl);
        return CM_OK;
    }
    if (st_ == CM_OK)
        st_ = cm_weights_id_compute(st, n_threads, out);
    if (st_ == CM_OK && (flags & CM_WEIGHTS_ID_WRITE_CACHE))
        cache_write(dir, fl, out);
    free(fl);
    return st_;
}

// ----------------------------------------------------------------------------
// the background form

struct cm_weights_id_job {
    pthread_t          th;
    cm_st             *st;
    char               dir[4096];
    int                flags, n_threads;
    cm_status          status;
    char               error[1024];
    cm_weights_id_info info;
};

static void *job_main(void *arg) {
    cm_weights_id_job *j = arg;
    j->status = cm_weights_id_dir(j->st, j->dir, j->flags, j->n_threads, &j->info);
    if (j->status != CM_OK)
        snprintf(j->error, sizeof j->error, "%s", cm_last_error());
    return NULL;
}

cm_status cm_weights_id_start(cm_weights_id_job **out, const char *dir, int flags, int n_threads) {
    *out = NULL;
    cm_weights_id_job *j = calloc(1, sizeof *j);
    if (!j)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a fingerprint job");
    snprintf(j->dir, sizeof j->dir, "%s", dir);
    j->flags = flags;
    j->n_threads = n_threads;
    cm_status st = cm_st_open_dir(&j->st, dir);
    if (st != CM_OK) {
        free(j);
        return st;
    }
    if (pthread_create(&j->th, NULL, job_main, j) != 0) {
        cm_st_destroy(&j->st);
        free(j);
        return CM_FAIL(CM_ERR_NOMEM, "cannot start the fingerprint thread");
    }
    *out = j;
    return CM_OK;
}

cm_status cm_weights_id_finish(cm_weights_id_job **pj, cm_weights_id_info *out) {
    cm_weights_id_job *j = pj ? *pj : NULL;
    if (!j)
        return CM_FAIL(CM_ERR_INVALID_ARG, "no fingerprint job");
    pthread_join(j->th, NULL);
    cm_status st = j->status;
    if (st == CM_OK)
        *out = j->info;
    else
        st = CM_FAIL(st, "%s", j->error);
    cm_st_destroy(&j->st);
    free(j);
    *pj = NULL;
    return st;
}
