/* common/format/cm_safetensors_read.c — safetensors reader (mmap; every header field validated
 * before use), of one file or of a sharded directory through its index JSON. A cm_st owns
 * its mapped files, the tensor table and a name index sorted for bsearch; everything it
 * hands out is borrowed until cm_st_destroy. It is immutable after open, so readers on
 * several threads need no lock. */
#include "cm_safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_bytes.h"
#include "cm_cfg.h"    /* cm_read_text_file */

#define ST_MAX_HEADER     ((uint64_t)100 << 20) /* the safetensors library's own limit */
#define ST_MAX_INDEX      ((size_t)64 << 20)
#define ST_INDEX_NAME     "model.safetensors.index.json"
#define ST_SINGLE_NAME    "model.safetensors"
#define ST_KNOWN_DTYPES   "F32 F64 BF16 F16 F8_E4M3 I64 I32 I16 I8 U8 BOOL"
#define ST_JSON_EXACT_MAX 9007199254740992.0 /* 2^53: integers above it are not exact in a double */

typedef struct st_meta {
    char *key;
    char *value;
} st_meta;

typedef struct st_file {
    char                *path;
    void                *map;
    size_t               size;
    cm_st_tensor        *tensors; /* header order; names owned here */
    int                  n_tensors;
    const cm_st_tensor **by_name; /* sorted by name */
    st_meta             *meta;
    int                  n_meta;
} st_file;

struct cm_st {
    char                *origin; /* the file or directory, for messages */
    st_file             *files;
    int                  n_files;
    cm_st_tensor        *tensors; /* copies of the file entries; names borrowed from files */
    int                  n_tensors;
    const cm_st_tensor **by_name;
};

/* CM_FAIL with a suffix (e.g. which index listed the shard) appended to the message. */
static cm_status st_fail_at(cm_status st, int line, const char *note, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
static cm_status st_fail_at(cm_status st, int line, const char *note, const char *fmt, ...) {
    char    msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return cm_fail_at(st, __FILE__, line, "%s%s", msg, note ? note : "");
}
#define ST_FAIL(st, note, ...) st_fail_at((st), __LINE__, (note), __VA_ARGS__)

// ----------------------------------------------------------------------------
// name index

static int cmp_by_name(const void *a, const void *b) {
    return strcmp((*(const cm_st_tensor *const *)a)->name, (*(const cm_st_tensor *const *)b)->name);
}

/* Sorts pointers to t[0..n) by name; the first duplicate name, if any, goes to *dup. */
static cm_status index_build(const cm_st_tensor *t, int n, const cm_st_tensor ***out, const char **dup) {
    *dup = NULL;
    *out = malloc((size_t)(n > 0 ? n : 1) * sizeof **out);
    if (!*out)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the index of %d tensors", n);
    for (int i = 0; i < n; i++)
        (*out)[i] = &t[i];
    qsort(*out, (size_t)n, sizeof **out, cmp_by_name);
    for (int i = 1; i < n && !*dup; i++)
        if (strcmp((*out)[i - 1]->name, (*out)[i]->name) == 0)
            *dup = (*out)[i]->name;
    return CM_OK;
}

static int cmp_by_offset(const void *a, const void *b) {
    const cm_st_tensor *x = *(const cm_st_tensor *const *)a, *y = *(const cm_st_tensor *const *)b;
    uintptr_t           px = (uintptr_t)x->data, py = (uintptr_t)y->data;
    return px < py ? -1 : px > py ? 1 : x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

/* Two tensors of one file whose bytes overlap (a writing to one would change the other, and
 * their values cannot both be what the file means): sorted by start, each non-empty range must
 * begin at or after the furthest end before it. O(n log n); *a = NULL when none overlap. */
static cm_status overlap_find(const cm_st_tensor *t, int n, const cm_st_tensor **a, const cm_st_tensor **b) {
    *a = *b = NULL;
    const cm_st_tensor **by = malloc((size_t)(n > 0 ? n : 1) * sizeof *by);
    if (!by)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the offset index of %d tensors", n);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (t[i].nbytes)
            by[m++] = &t[i];
    qsort(by, (size_t)m, sizeof *by, cmp_by_offset);
    const cm_st_tensor *reach = NULL; /* the tensor that ends furthest so far */
    for (int i = 0; i < m && !*a; i++) {
        const uint8_t *start = by[i]->data;
        if (reach && start < (const uint8_t *)reach->data + reach->nbytes) {
            *a = reach;
            *b = by[i];
        } else if (!reach || start + by[i]->nbytes > (const uint8_t *)reach->data + reach->nbytes) {
            reach = by[i];
        }
    }
    free(by);
    return CM_OK;
}

static const cm_st_tensor *index_find(const cm_st_tensor *const *idx, int n, const char *name) {
    cm_st_tensor               key = {.name = name};
    const cm_st_tensor        *pkey = &key;
    const cm_st_tensor *const *hit = bsearch(&pkey, idx, (size_t)n, sizeof *idx, cmp_by_name);
    return hit ? *hit : NULL;
}

// ----------------------------------------------------------------------------
// one file: map, parse and validate the header

static void file_release(st_file *f) {
    if (!f)
        return;
    for (int i = 0; i < f->n_tensors; i++)
        free((char *)f->tensors[i].name);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta[i].key);
        free(f->meta[i].value);
    }
    free(f->tensors);
    free(f->by_name);
    free(f->meta);
    if (f->map)
        munmap(f->map, f->size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

/* A JSON number holding an integer in [0, 2^53]. */
static int json_u64(const cJSON *it, uint64_t *out) {
    if (!cJSON_IsNumber(it))
        return 0;
    double d = it->valuedouble;
    if (!(d >= 0 && d <= ST_JSON_EXACT_MAX) || d != floor(d))
        return 0;
    *out = (uint64_t)d;
    return 1;
}

static cm_status parse_metadata(st_file *f, const cJSON *obj, const char *note) {
    if (f->meta)
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': header has '__metadata__' twice", f->path);
    if (!cJSON_IsObject(obj))
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': '__metadata__' must be an object of strings", f->path);
    int n = cJSON_GetArraySize(obj);
    f->meta = calloc((size_t)(n > 0 ? n : 1), sizeof *f->meta);
    if (!f->meta)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the metadata of '%s'", f->path);
    const cJSON *it = NULL;
    cJSON_ArrayForEach(it, obj) {
        if (!cJSON_IsString(it))
            return ST_FAIL(CM_ERR_FORMAT, note, "'%s': __metadata__ value of '%s' must be a string", f->path,
                           it->string);
        st_meta *m = &f->meta[f->n_meta++];
        m->key = strdup(it->string);
        m->value = strdup(it->valuestring);
        if (!m->key || !m->value)
            return CM_FAIL(CM_ERR_NOMEM, "cannot copy the metadata of '%s'", f->path);
    }
    return CM_OK;
}

static cm_status parse_entry(st_file *f, const cJSON *e, const uint8_t *data, size_t data_size,
                             const char *note) {
    const char   *name = e->string;
    cm_st_tensor *t = &f->tensors[f->n_tensors];
    char          shape_buf[160];
    if (name[0] == '\0')
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': header has a tensor with an empty name", f->path);
    if (!cJSON_IsObject(e))
        return ST_FAIL(CM_ERR_FORMAT, note,
                       "'%s': tensor '%s' is not an object with dtype, shape and data_offsets", f->path,
                       name);

    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    if (!cJSON_IsString(jd))
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': tensor '%s' has no dtype string", f->path, name);
    if (cm_dtype_parse(jd->valuestring, &t->dtype) != CM_OK)
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': tensor '%s' has unknown dtype '%s' (known: %s)", f->path,
                       name, jd->valuestring, ST_KNOWN_DTYPES);

    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    if (!cJSON_IsArray(js))
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': tensor '%s' has no shape array", f->path, name);
    int nd = cJSON_GetArraySize(js);
    if (nd > CM_ST_MAX_DIMS)
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': tensor '%s' shape has %d dims, more than the %d supported",
                       f->path, name, nd, CM_ST_MAX_DIMS);
    uint64_t     numel = 1;
    int          overflow = 0;
    const cJSON *it = NULL;
    t->n_dims = 0;
    cJSON_ArrayForEach(it, js) {
        uint64_t v;
        if (!json_u64(it, &v))
            return ST_FAIL(CM_ERR_FORMAT, note, "'%s': tensor '%s' shape[%d] is not a non-negative integer",
                           f->path, name, t->n_dims);
        overflow |= __builtin_mul_overflow(numel, v, &numel);
        t->shape[t->n_dims++] = (int64_t)v;
    }
    uint64_t nbytes;
    overflow |= __builtin_mul_overflow(numel, (uint64_t)cm_dtype_size(t->dtype), &nbytes);
    cm_shape_str(shape_buf, sizeof shape_buf, t->n_dims, t->shape);
    if (overflow)
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': tensor '%s' shape %s overflows 64-bit sizes", f->path,
                       name, shape_buf);

    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    uint64_t     b = 0, end = 0;
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_u64(cJSON_GetArrayItem(jo, 0), &b) ||
        !json_u64(cJSON_GetArrayItem(jo, 1), &end))
        return ST_FAIL(CM_ERR_FORMAT, note,
                       "'%s': tensor '%s' data_offsets must be [begin, end], two non-negative "
                       "integers",
                       f->path, name);
    if (b > end)
        return ST_FAIL(CM_ERR_FORMAT, note,
                       "'%s': tensor '%s' data_offsets [%llu, %llu] end before they begin", f->path, name,
                       (unsigned long long)b, (unsigned long long)end);
    if (end > data_size)
        return ST_FAIL(CM_ERR_IO, note,
                       "'%s': tensor '%s' data_offsets [%llu, %llu] lie outside the data area of %zu "
                       "bytes (truncated file?)",
                       f->path, name, (unsigned long long)b, (unsigned long long)end, data_size);
    if (end - b != nbytes)
        return ST_FAIL(CM_ERR_FORMAT, note,
                       "'%s': tensor '%s' data_offsets [%llu, %llu] hold %llu bytes but shape %s "
                       "of %s needs %llu",
                       f->path, name, (unsigned long long)b, (unsigned long long)end,
                       (unsigned long long)(end - b), shape_buf, cm_dtype_name(t->dtype),
                       (unsigned long long)nbytes);

    t->data = data + b;
    t->nbytes = (size_t)nbytes;
    t->file = f->path;
    t->name = strdup(name);
    if (!t->name)
        return CM_FAIL(CM_ERR_NOMEM, "cannot copy a tensor name of '%s'", f->path);
    f->n_tensors++;
    return CM_OK;
}

static cm_status file_parse(st_file *f, const char *note) {
    const uint8_t *bytes = f->map;
    uint64_t       n = cm_le_get_u64(bytes);
    if (n > f->size - 8)
        return ST_FAIL(CM_ERR_IO, note,
                       "'%s': header length %llu exceeds the file size %zu (truncated or not a "
                       "safetensors file)",
                       f->path, (unsigned long long)n, f->size);
    if (n > ST_MAX_HEADER)
        return ST_FAIL(CM_ERR_FORMAT, note,
                       "'%s': header length %llu exceeds the %llu-byte limit (not a safetensors "
                       "file?)",
                       f->path, (unsigned long long)n, (unsigned long long)ST_MAX_HEADER);
    const char    *hdr = (const char *)bytes + 8;
    const uint8_t *data = bytes + 8 + n;
    size_t         data_size = f->size - 8 - (size_t)n;

    const char *end = NULL;
    cJSON      *root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!root)
        return ST_FAIL(CM_ERR_FORMAT, note, "'%s': header JSON is malformed near byte %td of %llu", f->path,
                       end ? end - hdr : (ptrdiff_t)0, (unsigned long long)n);
    cm_status st = CM_OK;
    for (const char *p = end; p < hdr + n; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            st = ST_FAIL(CM_ERR_FORMAT, note,
                         "'%s': header JSON is malformed: stray bytes after it at byte %td of %llu", f->path,
                         p - hdr, (unsigned long long)n);
            goto fail;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = ST_FAIL(CM_ERR_FORMAT, note, "'%s': header JSON is not an object", f->path);
        goto fail;
    }
    int n_items = cJSON_GetArraySize(root);
    f->tensors = calloc((size_t)(n_items > 0 ? n_items : 1), sizeof *f->tensors);
    if (!f->tensors) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the tensor table of '%s'", f->path);
        goto fail;
    }
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, root) {
        if (strcmp(e->string, "__metadata__") == 0)
            CM_TRY_GOTO(parse_metadata(f, e, note), st, fail);
        else
            CM_TRY_GOTO(parse_entry(f, e, data, data_size, note), st, fail);
    }
    const char *dup;
    CM_TRY_GOTO(index_build(f->tensors, f->n_tensors, &f->by_name, &dup), st, fail);
    if (dup) {
        st = ST_FAIL(CM_ERR_FORMAT, note, "'%s': duplicate tensor '%s' in the header", f->path, dup);
        goto fail;
    }
    const cm_st_tensor *oa, *ob;
    CM_TRY_GOTO(overlap_find(f->tensors, f->n_tensors, &oa, &ob), st, fail);
    if (oa) {
        const uint8_t *ra = oa->data, *rb = ob->data;
        st =
            ST_FAIL(CM_ERR_FORMAT, note,
                    "'%s': tensors '%s' (data_offsets [%zu, %zu]) and '%s' ([%zu, %zu]) overlap; each tensor "
                    "needs bytes of its own (a corrupt or hand-made file)",
                    f->path, oa->name, (size_t)(ra - data), (size_t)(ra - data) + oa->nbytes, ob->name,
                    (size_t)(rb - data), (size_t)(rb - data) + ob->nbytes);
    }
fail:
    cJSON_Delete(root);
    return st;
}

/* Opens and validates one file; note is appended to every message. On failure the caller
 * releases f. */
static cm_status file_open(st_file *f, const char *path, const char *note) {
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path)
        return CM_FAIL(CM_ERR_NOMEM, "cannot copy the path '%s'", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return ST_FAIL(CM_ERR_IO, note, "cannot open '%s': %s", path, strerror(errno));
    cm_status   st = CM_OK;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = ST_FAIL(CM_ERR_IO, note, "cannot stat '%s': %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = ST_FAIL(CM_ERR_IO, note, "cannot read '%s': not a regular file", path);
        goto fail;
    }
    if (sb.st_size < 8) {
        st = ST_FAIL(CM_ERR_IO, note,
                     "'%s': file size %lld is smaller than the 8-byte header length (truncated or "
                     "not a safetensors file)",
                     path, (long long)sb.st_size);
        goto fail;
    }
    f->size = (size_t)sb.st_size;
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        st = ST_FAIL(CM_ERR_IO, note, "cannot mmap '%s': %s", path, strerror(errno));
        goto fail;
    }
    close(fd);
    return file_parse(f, note);
fail:
    close(fd);
    return st;
}

// ----------------------------------------------------------------------------
// cm_st

static cm_status st_alloc(cm_st **out, const char *origin, int n_files) {
    cm_st *st = calloc(1, sizeof *st);
    if (!st)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a safetensors set");
    *out = st;
    st->origin = strdup(origin);
    st->files = calloc((size_t)(n_files > 0 ? n_files : 1), sizeof *st->files);
    if (!st->origin || !st->files)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a safetensors set");
    return CM_OK;
}

void cm_st_destroy(cm_st **pst) {
    if (!pst || !*pst)
        return;
    cm_st *st = *pst;
    for (int i = 0; i < st->n_files; i++)
        file_release(&st->files[i]);
    free(st->files);
    free(st->tensors);
    free(st->by_name);
    free(st->origin);
    free(st);
    *pst = NULL;
}

cm_status cm_st_open_file(cm_st **out, const char *path) {
    *out = NULL;
    cm_st    *st = NULL;
    cm_status rc = CM_OK;
    CM_TRY_GOTO(st_alloc(&st, path, 1), rc, fail);
    st->n_files = 1;
    CM_TRY_GOTO(file_open(&st->files[0], path, NULL), rc, fail);
    st_file *f = &st->files[0];
    st->n_tensors = f->n_tensors;
    st->tensors = malloc((size_t)(f->n_tensors > 0 ? f->n_tensors : 1) * sizeof *st->tensors);
    if (!st->tensors) {
        rc = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the tensor table of '%s'", path);
        goto fail;
    }
    if (f->n_tensors)
        memcpy(st->tensors, f->tensors, (size_t)f->n_tensors * sizeof *st->tensors);
    const char *dup;
    CM_TRY_GOTO(index_build(st->tensors, st->n_tensors, &st->by_name, &dup), rc, fail);
    *out = st;
    return CM_OK;
fail:
    cm_st_destroy(&st);
    return rc;
}

/* A weight_map file name must name a file inside the model directory. */
static int plain_file_name(const char *s) {
    return s[0] != '\0' && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static cm_status open_sharded(cm_st **out, const char *dir, const char *index_path) {
    char        *text = NULL;
    cJSON       *root = NULL;
    cm_st       *st = NULL;
    const char **shards = NULL;   /* distinct shard names, in order of first mention */
    const char **first_of = NULL; /* a tensor of each shard, for messages */
    int         *shard_of = NULL; /* each weight_map entry's shard */
    int          n_shards = 0, i = 0;
    const cJSON *e = NULL;
    const char  *dup;
    cm_status    rc = CM_OK;
    CM_TRY(cm_read_text_file(index_path, ST_MAX_INDEX, &text));
    const char *end = NULL;
    root = cJSON_ParseWithOpts(text, &end, 1);
    if (!root) {
        rc = CM_FAIL(CM_ERR_FORMAT, "'%s': malformed JSON near byte %td", index_path,
                     end ? end - text : (ptrdiff_t)0);
        goto fail;
    }
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(root) || !cJSON_IsObject(map)) {
        rc =
            CM_FAIL(CM_ERR_FORMAT, "'%s': missing object 'weight_map' {tensor name: shard file}", index_path);
        goto fail;
    }
    int n_map = cJSON_GetArraySize(map);
    if (n_map == 0) {
        rc = CM_FAIL(CM_ERR_FORMAT, "'%s': weight_map is empty", index_path);
        goto fail;
    }
    shards = calloc((size_t)n_map, sizeof *shards);
    first_of = calloc((size_t)n_map, sizeof *first_of);
    shard_of = calloc((size_t)n_map, sizeof *shard_of);
    if (!shards || !first_of || !shard_of) {
        rc = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the shard table of '%s'", index_path);
        goto fail;
    }
    cJSON_ArrayForEach(e, map) {
        if (!cJSON_IsString(e) || !plain_file_name(e->valuestring)) {
            rc = CM_FAIL(CM_ERR_FORMAT,
                         "'%s': weight_map entry '%s' must name a shard file in the model directory",
                         index_path, e->string);
            goto fail;
        }
        int s = 0;
        while (s < n_shards && strcmp(shards[s], e->valuestring) != 0)
            s++;
        if (s == n_shards) {
            shards[n_shards] = e->valuestring;
            first_of[n_shards++] = e->string;
        }
        shard_of[i++] = s;
    }

    // each shard opened once; its whole header is validated, even tensors the map ignores
    CM_TRY_GOTO(st_alloc(&st, dir, n_shards), rc, fail);
    for (int s = 0; s < n_shards; s++) {
        char path[4096], note[512];
        if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, shards[s]) >= sizeof path) {
            rc = CM_FAIL(CM_ERR_INVALID_ARG, "path too long: '%s/%s'", dir, shards[s]);
            goto fail;
        }
        snprintf(note, sizeof note, " (listed in %s for tensor '%s')", ST_INDEX_NAME, first_of[s]);
        st->n_files++;
        CM_TRY_GOTO(file_open(&st->files[s], path, note), rc, fail);
    }

    st->tensors = calloc((size_t)n_map, sizeof *st->tensors);
    if (!st->tensors) {
        rc = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the tensor table of '%s'", dir);
        goto fail;
    }
    i = 0;
    cJSON_ArrayForEach(e, map) {
        st_file            *f = &st->files[shard_of[i++]];
        const cm_st_tensor *t = index_find(f->by_name, f->n_tensors, e->string);
        if (!t) {
            rc = CM_FAIL(CM_ERR_FORMAT,
                         "tensor '%s' is listed in '%s' for shard '%s', but that shard does not hold "
                         "it (incomplete or mismatched shard)",
                         e->string, index_path, f->path);
            goto fail;
        }
        st->tensors[st->n_tensors++] = *t;
    }
    CM_TRY_GOTO(index_build(st->tensors, st->n_tensors, &st->by_name, &dup), rc, fail);
    if (dup) {
        rc = CM_FAIL(CM_ERR_FORMAT, "'%s': duplicate tensor '%s' in weight_map", index_path, dup);
        goto fail;
    }
    *out = st;
    st = NULL;
fail:
    free(shard_of);
    free(first_of);
    free(shards);
    cm_st_destroy(&st);
    cJSON_Delete(root);
    free(text);
    return rc;
}

cm_status cm_st_open_dir(cm_st **out, const char *dir) {
    *out = NULL;
    struct stat sb;
    char        path[4096];
    if (stat(dir, &sb) != 0)
        return CM_FAIL(CM_ERR_IO, "cannot open model directory '%s': %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return CM_FAIL(CM_ERR_IO, "'%s' is not a directory", dir);
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, ST_INDEX_NAME) >= sizeof path)
        return CM_FAIL(CM_ERR_INVALID_ARG, "path too long: '%s'", dir);
    if (stat(path, &sb) == 0)
        return open_sharded(out, dir, path);
    if (errno != ENOENT)
        return CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/%s", dir, ST_SINGLE_NAME);
    if (stat(path, &sb) != 0 && errno == ENOENT)
        return CM_FAIL(CM_ERR_IO, "cannot open model weights in '%s': neither %s nor %s exists", dir,
                       ST_INDEX_NAME, ST_SINGLE_NAME);
    cm_status rc = cm_st_open_file(out, path);
    if (rc == CM_OK) {
        free((*out)->origin);
        (*out)->origin = strdup(dir);
        if (!(*out)->origin) {
            cm_st_destroy(out);
            return CM_FAIL(CM_ERR_NOMEM, "cannot copy the path '%s'", dir);
        }
    }
    return rc;
}

int cm_st_count(const cm_st *st) {
    return st->n_tensors;
}

const cm_st_tensor *cm_st_at(const cm_st *st, int i) {
    return i >= 0 && i < st->n_tensors ? &st->tensors[i] : NULL;
}

const cm_st_tensor *cm_st_find(const cm_st *st, const char *name) {
    return index_find(st->by_name, st->n_tensors, name);
}

const char *cm_st_metadata(const cm_st *st, const char *key) {
    for (int f = 0; f < st->n_files; f++)
        for (int i = 0; i < st->files[f].n_meta; i++)
            if (strcmp(st->files[f].meta[i].key, key) == 0)
                return st->files[f].meta[i].value;
    return NULL;
}

/* "[4, *]": like cm_shape_str, with * for a wildcard (negative) extent. */
static char *want_str(char *buf, size_t len, int n_dims, const int64_t *want) {
    size_t off = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < n_dims && off < len; i++) {
        if (want[i] < 0)
            off += (size_t)snprintf(buf + off, len - off, i ? ", *" : "*");
        else
            off += (size_t)snprintf(buf + off, len - off, i ? ", %lld" : "%lld", (long long)want[i]);
    }
    if (off < len)
        snprintf(buf + off, len - off, "]");
    return buf;
}

cm_status cm_st_expect(const cm_st *st, const char *name, int n_dims, const int64_t *want,
                       const cm_st_tensor **out) {
    if (out)
        *out = NULL;
    const cm_st_tensor *t = cm_st_find(st, name);
    if (!t)
        return CM_FAIL(CM_ERR_FORMAT, "missing tensor '%s' (looked in %s)", name, st->origin);
    int ok = t->n_dims == n_dims;
    for (int i = 0; ok && i < n_dims; i++)
        ok = want[i] < 0 || want[i] == t->shape[i];
    if (!ok) {
        char got_s[160], want_s[160];
        return CM_FAIL(CM_ERR_FORMAT, "tensor '%s' has shape %s, expected %s (in %s)", name,
                       cm_shape_str(got_s, sizeof got_s, t->n_dims, t->shape),
                       want_str(want_s, sizeof want_s, n_dims, want), t->file);
    }
    if (out)
        *out = t;
    return CM_OK;
}

cm_status cm_st_expect_dtype(const cm_st_tensor *t, cm_dtype dt) {
    if (t->dtype != dt)
        return CM_FAIL(CM_ERR_FORMAT, "tensor '%s' has dtype %s, expected %s (in %s)", t->name,
                       cm_dtype_name(t->dtype), cm_dtype_name(dt), t->file);
    return CM_OK;
}

cm_status cm_st_read(const cm_st *st, const char *name, int n_dims, const int64_t *want, void *dst,
                     cm_dtype dst_dt) {
    const cm_st_tensor *t;
    CM_TRY(cm_st_expect(st, name, n_dims, want, &t));
    if (!cm_dtype_is_float(t->dtype))
        return CM_FAIL(CM_ERR_FORMAT,
                       "tensor '%s' has dtype %s, expected a float dtype (F32, F64, BF16, F16, "
                       "F8_E4M3) (in %s)",
                       name, cm_dtype_name(t->dtype), t->file);
    if (!cm_dtype_is_float(dst_dt))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "cannot read tensor '%s' into %s: the destination must be a float dtype", name,
                       cm_dtype_name(dst_dt));
    size_t esize = cm_dtype_size(t->dtype), n = t->nbytes / esize;
    if ((uintptr_t)t->data % esize == 0)
        return cm_convert(dst, dst_dt, t->data, t->dtype, n);
    // a file may place a tensor at any byte offset: bounce through an aligned buffer
    _Alignas(8) unsigned char buf[1 << 14];
    size_t                    chunk = sizeof buf / esize;
    for (size_t i = 0; i < n; i += chunk) {
        size_t m = n - i < chunk ? n - i : chunk;
        memcpy(buf, (const unsigned char *)t->data + i * esize, m * esize);
        CM_TRY(cm_convert((unsigned char *)dst + i * cm_dtype_size(dst_dt), dst_dt, buf, t->dtype, m));
    }
    return CM_OK;
}
