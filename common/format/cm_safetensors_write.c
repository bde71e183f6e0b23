/* common/format/cm_safetensors_write.c — the atomic safetensors writer of cm_safetensors.h. It
 * copies what it is given (or asks for a later tensor's bytes as it writes) and writes data contiguously
 * (what the safetensors library and HF loaders require: no gaps), largest element size first, so each tensor
 * is naturally aligned; the file is written to path.tmp, synced and renamed. */
#include "cm_safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cm_bytes.h"

typedef struct st_meta {
    char *key;
    char *value;
} st_meta;

typedef struct st_entry {
    char    *name;
    cm_dtype dtype;
    int      n_dims;
    int64_t  shape[CM_ST_MAX_DIMS];
    void    *data; /* NULL: added later, given by the fill at write time */
    size_t   nbytes;
    uint64_t offset; /* in the data area, set by write */
} st_entry;

struct cm_st_writer {
    st_entry *entries;
    int       n, cap;
    st_meta  *meta;
    int       n_meta, cap_meta;
};

cm_status cm_st_writer_create(cm_st_writer **out) {
    *out = calloc(1, sizeof **out);
    if (!*out)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a safetensors writer");
    return CM_OK;
}

void cm_st_writer_destroy(cm_st_writer **pw) {
    if (!pw || !*pw)
        return;
    cm_st_writer *w = *pw;
    for (int i = 0; i < w->n; i++) {
        free(w->entries[i].name);
        free(w->entries[i].data);
    }
    for (int i = 0; i < w->n_meta; i++) {
        free(w->meta[i].key);
        free(w->meta[i].value);
    }
    free(w->entries);
    free(w->meta);
    free(w);
    *pw = NULL;
}

static cm_status add_entry(cm_st_writer *w, const char *name, cm_dtype dt, int n_dims, const int64_t *shape,
                           const void *data, int later) {
    if (!name || !name[0] || strcmp(name, "__metadata__") == 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "bad tensor name '%s' for a safetensors file",
                       name ? name : "(null)");
    if ((unsigned)dt >= CM_DTYPE_COUNT)
        return CM_FAIL(CM_ERR_INVALID_ARG, "tensor '%s': bad dtype %d", name, (int)dt);
    if (n_dims < 0 || n_dims > CM_ST_MAX_DIMS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "tensor '%s': %d dims, expected 0 to %d", name, n_dims,
                       CM_ST_MAX_DIMS);
    uint64_t numel = 1, nbytes;
    int      overflow = 0;
    for (int i = 0; i < n_dims; i++) {
        if (shape[i] < 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "tensor '%s': negative extent in shape", name);
        overflow |= __builtin_mul_overflow(numel, (uint64_t)shape[i], &numel);
    }
    overflow |= __builtin_mul_overflow(numel, (uint64_t)cm_dtype_size(dt), &nbytes);
    if (overflow || nbytes > (uint64_t)SIZE_MAX / 2)
        return CM_FAIL(CM_ERR_INVALID_ARG, "tensor '%s': shape too large", name);
    if (nbytes > 0 && !data && !later)
        return CM_FAIL(CM_ERR_INVALID_ARG, "tensor '%s': no data", name);
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->entries[i].name, name) == 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "duplicate tensor name '%s' in a safetensors writer", name);
    if (w->n == w->cap) {
        int       cap = w->cap ? 2 * w->cap : 16;
        st_entry *ne = realloc(w->entries, (size_t)cap * sizeof *ne);
        if (!ne)
            return CM_FAIL(CM_ERR_NOMEM, "cannot grow the safetensors writer to %d tensors", cap);
        w->entries = ne;
        w->cap = cap;
    }
    st_entry *e = &w->entries[w->n];
    memset(e, 0, sizeof *e);
    e->name = strdup(name);
    e->data = later ? NULL : malloc(nbytes ? (size_t)nbytes : 1);
    if (!e->name || (!later && !e->data)) {
        free(e->name);
        free(e->data);
        return CM_FAIL(CM_ERR_NOMEM, "cannot copy tensor '%s' (%llu bytes)", name,
                       (unsigned long long)nbytes);
    }
    if (nbytes && !later)
        memcpy(e->data, data, (size_t)nbytes);
    e->dtype = dt;
    e->n_dims = n_dims;
    for (int i = 0; i < n_dims; i++)
        e->shape[i] = shape[i];
    e->nbytes = (size_t)nbytes;
    w->n++;
    return CM_OK;
}

cm_status cm_st_writer_add(cm_st_writer *w, const char *name, cm_dtype dt, int n_dims, const int64_t *shape,
                           const void *data) {
    return add_entry(w, name, dt, n_dims, shape, data, 0);
}

cm_status cm_st_writer_add_later(cm_st_writer *w, const char *name, cm_dtype dt, int n_dims,
                                 const int64_t *shape) {
    return add_entry(w, name, dt, n_dims, shape, NULL, 1);
}

cm_status cm_st_writer_set_metadata(cm_st_writer *w, const char *key, const char *value) {
    if (!key || !value)
        return CM_FAIL(CM_ERR_INVALID_ARG, "metadata key and value must not be NULL");
    char *v = strdup(value);
    if (!v)
        return CM_FAIL(CM_ERR_NOMEM, "cannot copy metadata '%s'", key);
    for (int i = 0; i < w->n_meta; i++) {
        if (strcmp(w->meta[i].key, key) == 0) {
            free(w->meta[i].value);
            w->meta[i].value = v;
            return CM_OK;
        }
    }
    if (w->n_meta == w->cap_meta) {
        int      cap = w->cap_meta ? 2 * w->cap_meta : 8;
        st_meta *nm = realloc(w->meta, (size_t)cap * sizeof *nm);
        if (!nm) {
            free(v);
            return CM_FAIL(CM_ERR_NOMEM, "cannot grow the metadata table");
        }
        w->meta = nm;
        w->cap_meta = cap;
    }
    char *k = strdup(key);
    if (!k) {
        free(v);
        return CM_FAIL(CM_ERR_NOMEM, "cannot copy metadata '%s'", key);
    }
    w->meta[w->n_meta++] = (st_meta){k, v};
    return CM_OK;
}

/* Header JSON with every entry's offsets; w->entries[].offset must be set. NULL on OOM. */
static char *writer_header(const cm_st_writer *w) {
    cJSON *root = cJSON_CreateObject();
    char  *out = NULL;
    if (!root)
        return NULL;
    if (w->n_meta) {
        cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
        if (!m)
            goto done;
        for (int i = 0; i < w->n_meta; i++)
            if (!cJSON_AddStringToObject(m, w->meta[i].key, w->meta[i].value))
                goto done;
    }
    for (int i = 0; i < w->n; i++) {
        const st_entry *e = &w->entries[i];
        cJSON          *jt = cJSON_AddObjectToObject(root, e->name);
        cJSON          *js = jt ? cJSON_AddArrayToObject(jt, "shape") : NULL;
        if (!jt || !cJSON_AddStringToObject(jt, "dtype", cm_dtype_name(e->dtype)) || !js)
            goto done;
        for (int d = 0; d < e->n_dims; d++) {
            cJSON *v = cJSON_CreateNumber((double)e->shape[d]);
            if (!v || !cJSON_AddItemToArray(js, v))
                goto done;
        }
        cJSON *jo = cJSON_AddArrayToObject(jt, "data_offsets");
        cJSON *b = cJSON_CreateNumber((double)e->offset);
        cJSON *en = cJSON_CreateNumber((double)(e->offset + e->nbytes));
        if (!jo || !b || !cJSON_AddItemToArray(jo, b) || !en || !cJSON_AddItemToArray(jo, en))
            goto done;
    }
    out = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return out;
}

static int write_all(int fd, const void *buf, size_t len) {
    const unsigned char *p = buf;
    while (len > 0) {
        ssize_t k = write(fd, p, len > ((size_t)1 << 30) ? ((size_t)1 << 30) : len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

cm_status cm_st_writer_write(cm_st_writer *w, const char *path) {
    return cm_st_writer_write_with(w, path, NULL, NULL);
}

cm_status cm_st_writer_write_with(cm_st_writer *w, const char *path, cm_st_fill_fn fill, void *user) {
    for (int i = 0; i < w->n && !fill; i++)
        if (!w->entries[i].data)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "tensor '%s' of '%s' was added later and nothing gives its bytes",
                           w->entries[i].name, path);
    // data order: element size 8, 4, 2, 1 (stable), so every tensor is naturally aligned
    uint64_t off = 0;
    for (size_t size = 8; size >= 1; size /= 2) {
        for (int i = 0; i < w->n; i++) {
            if (cm_dtype_size(w->entries[i].dtype) != size)
                continue;
            w->entries[i].offset = off;
            off += w->entries[i].nbytes;
        }
    }
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path too long: '%s'", path);
    char *hdr = writer_header(w);
    if (!hdr)
        return CM_FAIL(CM_ERR_NOMEM, "cannot build the header of '%s'", path);
    size_t  hlen = strlen(hdr), padded = (hlen + 7) / 8 * 8;
    uint8_t len8[8];
    cm_le_put_u64(len8, (uint64_t)padded);
    static const char spaces[8] = "        ";

    cm_status st = CM_OK;
    int       fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
        goto fail;
    }
    int bad = write_all(fd, len8, 8) || write_all(fd, hdr, hlen) || write_all(fd, spaces, padded - hlen);
    for (size_t size = 8; size >= 1 && !bad; size /= 2)
        for (int i = 0; i < w->n && !bad; i++) {
            if (cm_dtype_size(w->entries[i].dtype) != size)
                continue;
            const void *data = w->entries[i].data;
            if (!data && (st = fill(user, i, &data)) != CM_OK)
                goto fail;
            bad = write_all(fd, data, w->entries[i].nbytes);
        }
    if (bad || fsync(fd) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", tmp, strerror(errno));
        goto fail;
    }
    int rc_close = close(fd);
    fd = -1;
    if (rc_close != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", tmp, strerror(errno));
        goto fail;
    }
    if (rename(tmp, path) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
        goto fail;
    }
    // make the rename itself durable (best effort: some file systems refuse fsync on a directory)
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    free(hdr);
    return CM_OK;
fail:
    if (fd >= 0)
        close(fd);
    unlink(tmp);
    free(hdr);
    return st;
}
