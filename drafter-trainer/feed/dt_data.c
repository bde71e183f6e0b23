/* drafter-trainer/feed/dt_data.c — batch files: listing, checking, hashing, the per-epoch shuffle
 * and loading into reusable host buffers (layout in dt_data.h). The set hash is FNV-1a 64
 * over the fields listed there; the mmapped file is closed after each load. */
#include "dt_data.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_rng.h"
#include "cm_safetensors.h"
#include "dt_dataset.h"

struct dt_data {
    int              n;     /* files */
    char           **paths; /* [n], owned */
    int64_t         *T;     /* [n] tokens per file */
    int             *N;     /* [n] documents per file */
    int              n_taps, hidden, vocab;
    int64_t          width; /* n_taps · hidden */
    int64_t          max_T;
    int              max_N;
    uint64_t         hash;
    int              file_hidden; /* 1: target_hidden from the files; 0: from src, or none */
    int              have_src;
    dt_hidden_source src;
    int32_t         *ids, *cu, *mask; /* [max_T], [max_N + 1], [max_T] */
    float           *hidden_buf;      /* [max_T, width] */
    const dt_dataset *ds;             /* packs instead of files (borrowed), or NULL */
    int               dp_rank, dp_size;
    /* dt_data_prefetch: a loader thread fills the set above while the caller's batch lives in
     * the other one (alt_*); pf_* is the loaded batch, its status and message */
    int32_t  *alt_ids, *alt_cu, *alt_mask;
    float    *alt_hidden;
    pthread_t pf_thread;
    int       pf_running, pf_index;
    dt_batch  pf_batch;
    cm_status pf_st;
    char      pf_msg[1024];
    /* dt_data_set_pinning: which hidden buffers are page-locked */
    dt_pin_fn   pin;
    dt_unpin_fn unpin;
    void       *pin_user;
    float      *pinned[2];
    /* dt_data_load_tokens: a third, token-only set, for a hidden-state source reading ahead */
    int32_t *tok_ids, *tok_cu, *tok_mask;
};

// ---- FNV-1a 64

static void fnv(uint64_t *h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        *h ^= b[i];
        *h *= 0x100000001b3ULL;
    }
}

static void fnv_i64(uint64_t *h, int64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)v >> (8 * i));
    fnv(h, b, 8);
}

// ---- lists

void dt_data_free_list(char **paths, int n) {
    if (!paths)
        return;
    for (int i = 0; i < n; i++)
        free(paths[i]);
    free(paths);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static cm_status list_push(char ***paths, int *n, int *cap, const char *s, size_t len) {
    if (*n == *cap) {
        int    nc = *cap ? *cap * 2 : 16;
        char **np = realloc(*paths, (size_t)nc * sizeof *np);
        if (!np)
            return CM_FAIL(CM_ERR_NOMEM, "cannot grow the data file list");
        *paths = np;
        *cap = nc;
    }
    char *c = malloc(len + 1);
    if (!c)
        return CM_FAIL(CM_ERR_NOMEM, "cannot grow the data file list");
    memcpy(c, s, len);
    c[len] = '\0';
    (*paths)[*n] = c;
    (*n)++;
    return CM_OK;
}

cm_status dt_data_list_dir(const char *dir, char ***paths, int *n) {
    *paths = NULL;
    *n = 0;
    DIR *dp = opendir(dir);
    if (!dp)
        return CM_FAIL(CM_ERR_IO, "cannot open data directory '%s': %s", dir, strerror(errno));
    cm_status      st = CM_OK;
    int            cap = 0;
    struct dirent *e;
    char           buf[4096];
    while ((e = readdir(dp)) != NULL) {
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.' || len <= 12 || strcmp(e->d_name + len - 12, ".safetensors") != 0)
            continue;
        int k = snprintf(buf, sizeof buf, "%s/%s", dir, e->d_name);
        if (k < 0 || (size_t)k >= sizeof buf) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "data path '%s/%s' is too long", dir, e->d_name);
            goto fail;
        }
        CM_TRY_GOTO(list_push(paths, n, &cap, buf, (size_t)k), st, fail);
    }
    closedir(dp);
    dp = NULL;
    if (*n == 0) {
        st = CM_FAIL(CM_ERR_IO, "data directory '%s' holds no .safetensors batch files", dir);
        goto fail;
    }
    qsort(*paths, (size_t)*n, sizeof **paths, cmp_str);
    return CM_OK;
fail:
    if (dp)
        closedir(dp);
    dt_data_free_list(*paths, *n);
    *paths = NULL;
    *n = 0;
    return st;
}

cm_status dt_data_split_list(const char *csv, char ***paths, int *n) {
    *paths = NULL;
    *n = 0;
    cm_status st = CM_OK;
    int       cap = 0;
    for (const char *s = csv;;) {
        const char *e = strchr(s, ',');
        size_t      len = e ? (size_t)(e - s) : strlen(s);
        if (len == 0) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "--data '%s' has an empty file name; separate files with single commas", csv);
            goto fail;
        }
        CM_TRY_GOTO(list_push(paths, n, &cap, s, len), st, fail);
        if (!e)
            break;
        s = e + 1;
    }
    return CM_OK;
fail:
    dt_data_free_list(*paths, *n);
    *paths = NULL;
    *n = 0;
    return st;
}

// ---- checking

/* Shapes and dtypes of one opened file; *T and *N receive its sizes. */
static cm_status check_shapes(const dt_data *d, const cm_st *st, const char *path, int64_t *T, int *N,
                              const cm_st_tensor **ids, const cm_st_tensor **cu, const cm_st_tensor **mask,
                              const cm_st_tensor **hid) {
    const char         *names[4] = {"input_ids", "cu_seqlens", "loss_mask", "target_hidden"};
    const cm_st_tensor *t[4];
    const int           n_need = d->file_hidden ? 4 : 3;
    t[3] = NULL;
    for (int k = 0; k < n_need; k++) {
        t[k] = cm_st_find(st, names[k]);
        if (!t[k])
            return CM_FAIL(
                CM_ERR_FORMAT,
                "batch file '%s' has no tensor '%s' (a batch holds input_ids, cu_seqlens, loss_mask%s)", path,
                names[k], d->file_hidden ? " and target_hidden" : "");
        if (k < 3 && (t[k]->dtype != CM_DTYPE_I32 || t[k]->n_dims != 1))
            return CM_FAIL(CM_ERR_FORMAT,
                           "batch file '%s': '%s' must be I32 with 1 dimension, found %s with %d", path,
                           names[k], cm_dtype_name(t[k]->dtype), t[k]->n_dims);
    }
    *T = t[0]->shape[0];
    if (*T < 1)
        return CM_FAIL(CM_ERR_FORMAT, "batch file '%s': input_ids is empty", path);
    if (t[1]->shape[0] < 2 || t[1]->shape[0] - 1 > INT32_MAX)
        return CM_FAIL(CM_ERR_FORMAT,
                       "batch file '%s': cu_seqlens has %lld entries; need N + 1 with N >= 1 documents", path,
                       (long long)t[1]->shape[0]);
    *N = (int)(t[1]->shape[0] - 1);
    if (t[2]->shape[0] != *T)
        return CM_FAIL(CM_ERR_FORMAT, "batch file '%s': loss_mask has %lld entries but input_ids has %lld",
                       path, (long long)t[2]->shape[0], (long long)*T);
    *ids = t[0];
    *cu = t[1];
    *mask = t[2];
    *hid = t[3];
    if (!d->file_hidden)
        return CM_OK;
    if (t[3]->dtype != CM_DTYPE_F32 && t[3]->dtype != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_FORMAT, "batch file '%s': target_hidden has dtype %s; it must be BF16 or F32",
                       path, cm_dtype_name(t[3]->dtype));
    if (t[3]->n_dims != 2 || t[3]->shape[0] != *T || t[3]->shape[1] != d->width)
        return CM_FAIL(
            CM_ERR_FORMAT,
            "batch file '%s': target_hidden has shape [%lld%s%lld] but the drafter needs [%lld, %lld] "
            "(%d taps x hidden %d, concatenated in target_layer_ids order)",
            path, (long long)t[3]->shape[0], t[3]->n_dims >= 2 ? ", " : "",
            t[3]->n_dims >= 2 ? (long long)t[3]->shape[1] : 0LL, (long long)*T, (long long)d->width,
            d->n_taps, d->hidden);
    return CM_OK;
}

/* Contents of the I32 tensors (already copied to aligned buffers). */
static cm_status check_contents(const dt_data *d, const char *path, const int32_t *ids, const int32_t *cu,
                                const int32_t *mask, int64_t T, int N) {
    for (int64_t i = 0; i < T; i++)
        if (ids[i] < 0 || ids[i] >= d->vocab)
            return CM_FAIL(CM_ERR_FORMAT,
                           "batch file '%s': input_ids[%lld] = %d is outside the vocabulary [0, %d)", path,
                           (long long)i, ids[i], d->vocab);
    if (cu[0] != 0)
        return CM_FAIL(CM_ERR_FORMAT, "batch file '%s': cu_seqlens[0] is %d; it must be 0", path, cu[0]);
    for (int i = 0; i < N; i++)
        if (cu[i + 1] <= cu[i])
            return CM_FAIL(CM_ERR_FORMAT,
                           "batch file '%s': cu_seqlens is not strictly increasing at %d (%d then %d)", path,
                           i + 1, cu[i], cu[i + 1]);
    if (cu[N] != T)
        return CM_FAIL(CM_ERR_FORMAT, "batch file '%s': cu_seqlens ends at %d but input_ids has %lld tokens",
                       path, cu[N], (long long)T);
    for (int64_t i = 0; i < T; i++)
        if (mask[i] != 0 && mask[i] != 1)
            return CM_FAIL(CM_ERR_FORMAT, "batch file '%s': loss_mask[%lld] is %d; it must be 0 or 1", path,
                           (long long)i, mask[i]);
    return CM_OK;
}

// ---- open / destroy

/* One set of reusable buffers, sized for the largest batch (freed by destroy, also when
 * this fails). */
static cm_status alloc_set(const dt_data *d, int32_t **ids, int32_t **mask, int32_t **cu, float **hidden) {
    *ids = malloc((size_t)d->max_T * sizeof **ids);
    *mask = malloc((size_t)d->max_T * sizeof **mask);
    *cu = malloc((size_t)(d->max_N + 1) * sizeof **cu);
    if (d->width > 0)
        *hidden = malloc((size_t)d->max_T * (size_t)d->width * sizeof **hidden);
    if (!*ids || !*mask || !*cu || (d->width > 0 && !*hidden))
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate batch buffers for %lld tokens x %lld features",
                       (long long)d->max_T, (long long)d->width);
    return CM_OK;
}

static cm_status alloc_buffers(dt_data *d) {
    return alloc_set(d, &d->ids, &d->mask, &d->cu, &d->hidden_buf);
}

cm_status dt_data_open_dataset(dt_data **out, const dt_dataset *ds, int n_taps, int hidden,
                               const dt_hidden_source *src) {
    *out = NULL;
    if (n_taps < 0 || hidden < 0 || (n_taps > 0) != (src != NULL) || (src && (!src->get || hidden < 1)))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "a dataset has no hidden states of its own: give --shards DIR (from precompute "
                       "--dataset) or --server ENDPOINT");
    dt_data *d = calloc(1, sizeof *d);
    if (!d)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the data set");
    d->ds = ds;
    d->n = dt_dataset_n_packs(ds);
    d->n_taps = n_taps;
    d->hidden = hidden;
    d->vocab = INT32_MAX; /* checked by dt_dataset_open */
    d->width = (int64_t)n_taps * hidden;
    d->have_src = src != NULL;
    if (src)
        d->src = *src;
    d->dp_size = 1;
    d->hash = dt_dataset_hash(ds);
    for (int i = 0; i < d->n; i++) {
        int64_t T;
        int     N;
        dt_dataset_pack_size(ds, i, &T, &N);
        if (T > d->max_T)
            d->max_T = T;
        if (N > d->max_N)
            d->max_N = N;
    }
    cm_status st = alloc_buffers(d);
    if (st != CM_OK) {
        dt_data_destroy(&d);
        return st;
    }
    *out = d;
    return CM_OK;
}

cm_status dt_data_open(dt_data **out, const char *const *paths, int n_paths, int n_taps, int hidden,
                       int vocab_size) {
    if (n_taps < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a drafter needs at least one target layer tap");
    return dt_data_open_source(out, paths, n_paths, n_taps, hidden, vocab_size, NULL);
}

cm_status dt_data_open_source(dt_data **out, const char *const *paths, int n_paths, int n_taps, int hidden,
                              int vocab_size, const dt_hidden_source *src) {
    *out = NULL;
    if (n_paths < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "no batch files given (--data or --data-dir)");
    if (n_taps < 0 || hidden < 0 || (src && (!src->get || n_taps < 1 || hidden < 1)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_data_open_source: bad taps (%d), hidden (%d) or source",
                       n_taps, hidden);
    cm_status st = CM_OK;
    cm_st    *f = NULL;
    int32_t  *tmp = NULL;
    dt_data  *d = calloc(1, sizeof *d);
    if (!d)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the data set");
    d->n = n_paths;
    d->n_taps = n_taps;
    d->hidden = hidden;
    d->vocab = vocab_size;
    d->width = (int64_t)n_taps * hidden;
    d->file_hidden = !src && n_taps > 0;
    d->have_src = src != NULL;
    if (src)
        d->src = *src;
    d->dp_size = 1;
    d->hash = 0xcbf29ce484222325ULL;
    d->paths = calloc((size_t)n_paths, sizeof *d->paths);
    d->T = calloc((size_t)n_paths, sizeof *d->T);
    d->N = calloc((size_t)n_paths, sizeof *d->N);
    if (!d->paths || !d->T || !d->N) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the data set");
        goto fail;
    }
    for (int i = 0; i < n_paths; i++) {
        if (!(d->paths[i] = strdup(paths[i]))) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the data set");
            goto fail;
        }
        const cm_st_tensor *ti, *tc, *tm, *th;
        CM_TRY_GOTO(cm_st_open_file(&f, paths[i]), st, fail);
        CM_TRY_GOTO(check_shapes(d, f, paths[i], &d->T[i], &d->N[i], &ti, &tc, &tm, &th), st, fail);
        int64_t T = d->T[i];
        int     N = d->N[i];
        tmp = malloc((size_t)(2 * T + N + 1) * sizeof *tmp);
        if (!tmp) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot read batch file '%s'", paths[i]);
            goto fail;
        }
        memcpy(tmp, ti->data, ti->nbytes);
        memcpy(tmp + T, tm->data, tm->nbytes);
        memcpy(tmp + 2 * T, tc->data, tc->nbytes);
        CM_TRY_GOTO(check_contents(d, paths[i], tmp, tmp + 2 * T, tmp + T, T, N), st, fail);
        const char *base = strrchr(paths[i], '/');
        base = base ? base + 1 : paths[i];
        fnv(&d->hash, base, strlen(base) + 1);
        fnv_i64(&d->hash, T);
        fnv_i64(&d->hash, N);
        fnv(&d->hash, tmp, (size_t)(2 * T + N + 1) * sizeof *tmp);
        free(tmp);
        tmp = NULL;
        cm_st_destroy(&f);
        if (T > d->max_T)
            d->max_T = T;
        if (N > d->max_N)
            d->max_N = N;
    }
    CM_TRY_GOTO(alloc_buffers(d), st, fail);
    *out = d;
    return CM_OK;
fail:
    free(tmp);
    cm_st_destroy(&f);
    dt_data_destroy(&d);
    return st;
}

void dt_data_destroy(dt_data **d) {
    if (!d || !*d)
        return;
    dt_data *x = *d;
    if (x->pf_running) /* a load in flight: let it end before its buffers go */
        pthread_join(x->pf_thread, NULL);
    for (int k = 0; k < 2; k++)
        if (x->pinned[k])
            x->unpin(x->pin_user, x->pinned[k]);
    if (x->paths)
        for (int i = 0; i < x->n; i++)
            free(x->paths[i]);
    free(x->paths);
    free(x->T);
    free(x->N);
    free(x->ids);
    free(x->cu);
    free(x->mask);
    free(x->hidden_buf);
    free(x->alt_ids);
    free(x->alt_cu);
    free(x->alt_mask);
    free(x->alt_hidden);
    free(x->tok_ids);
    free(x->tok_cu);
    free(x->tok_mask);
    free(x);
    *d = NULL;
}

int dt_data_count(const dt_data *d) {
    return d->n;
}
int64_t dt_data_max_tokens(const dt_data *d) {
    return d->max_T;
}
const char *dt_data_path(const dt_data *d, int i) {
    return d->ds ? dt_dataset_name(d->ds) : d->paths[i];
}
uint64_t dt_data_hash_dp(const dt_data *d, int dp_size) {
    if (dp_size <= 1)
        return d->hash; /* single-process runs keep the hash of before data parallelism */
    uint64_t h = d->hash;
    fnv(&h, "dp", 2);
    fnv_i64(&h, dp_size);
    return h;
}
uint64_t dt_data_hash(const dt_data *d) {
    return dt_data_hash_dp(d, d->dp_size);
}

cm_status dt_data_set_dp(dt_data *d, int rank, int size) {
    if (size < 1 || rank < 0 || rank >= size)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "data-parallel rank %d of %d is impossible; need 0 <= --dp-rank < --dp-size (or RANK < "
                       "WORLD_SIZE)",
                       rank, size);
    d->dp_rank = rank;
    d->dp_size = size;
    return CM_OK;
}
int dt_data_dp_rank(const dt_data *d) {
    return d->dp_rank;
}
int dt_data_dp_size(const dt_data *d) {
    return d->dp_size;
}
int64_t dt_data_steps_per_epoch(const dt_data *d) {
    return ((int64_t)d->n + d->dp_size - 1) / d->dp_size;
}
int32_t dt_data_step_batch(const dt_data *d, const int32_t *order, int64_t k) {
    return order[((int64_t)d->dp_rank + k * d->dp_size) % d->n];
}

void dt_data_epoch_order(const dt_data *d, uint64_t seed, uint64_t epoch, int32_t *order) {
    cm_rng r;
    cm_rng_seed_stream(&r, seed ^ DT_DATA_STREAM, epoch, 0);
    for (int i = 0; i < d->n; i++)
        order[i] = i;
    for (int i = d->n - 1; i > 0; i--) {
        int     j = (int)cm_rng_below(&r, (uint64_t)i + 1);
        int32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

static void point(dt_data *d, int64_t T, int N, dt_batch *b) {
    b->T = T;
    b->n_seq = N;
    b->cu_seqlens = d->cu;
    b->input_ids = d->ids;
    b->loss_mask = d->mask;
    b->target_hidden = d->width > 0 ? d->hidden_buf : NULL;
    b->n_anchors = 0;
    b->anchors = NULL;
}

/* docs/architecture.md: a capture holding NaN/Inf, or a tap that is all zeros (a broken capture, never a
 * real layer output), is refused before anything trains on it. what names the batch. */
static cm_status check_hidden(const dt_data *d, int64_t T, const char *what_fmt, int i, const char *name) {
    char what[1200];
    snprintf(what, sizeof what, what_fmt, i, name);
    for (int64_t k = 0; k < T * d->width; k++)
        if (!isfinite(d->hidden_buf[k]))
            return CM_FAIL(CM_ERR_FORMAT, "%s: target_hidden[%lld, %lld] is not finite", what, (long long)(k / d->width),
                           (long long)(k % d->width));
    for (int tap = 0; tap < d->n_taps && T > 0; tap++) {
        int nonzero = 0;
        for (int64_t t = 0; t < T && !nonzero; t++) {
            const float *row = d->hidden_buf + t * d->width + (int64_t)tap * d->hidden;
            for (int c = 0; c < d->hidden && !nonzero; c++)
                nonzero = row[c] != 0.0f;
        }
        if (!nonzero)
            return CM_FAIL(CM_ERR_FORMAT,
                           "%s: tap %d of target_hidden is all zeros, which no target layer produces: the capture "
                           "is broken; make the hidden states again (target-server dump, or precompute)",
                           what, tap);
    }
    return CM_OK;
}

/* The source's taps of batch i into the current set (tap k at k · max_T · hidden floats of the
 * hidden buffer), checked as check_hidden checks a file's, and b pointed at them. */
static cm_status load_src(dt_data *d, int i, int64_t T, int N, dt_batch *b, const char *what_fmt, const char *name) {
    void *taps[DT_MAX_TAPS];
    if (d->n_taps > DT_MAX_TAPS)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%d taps from a hidden-state source; at most %d", d->n_taps, DT_MAX_TAPS);
    for (int k = 0; k < d->n_taps; k++)
        taps[k] = d->hidden_buf + (size_t)k * (size_t)d->max_T * (size_t)d->hidden;
    cm_dtype dt = CM_DTYPE_F32;
    CM_TRY(d->src.get(d->src.self, i, d->ids, T, d->cu, N, taps, &dt));
    char what[1200];
    snprintf(what, sizeof what, what_fmt, i, name);
    for (int k = 0; k < d->n_taps; k++) {
        int bad, zero;
        cm_scan_values(dt, taps[k], (size_t)(T * d->hidden), &bad, &zero);
        if (bad || zero)
            return CM_FAIL(CM_ERR_FORMAT,
                           zero ? "%s: tap %d of target_hidden is all zeros, which no target layer produces: the "
                                  "capture is broken; make the hidden states again (target-server dump, or precompute)"
                                : "%s: tap %d of target_hidden holds NaN or Inf values; make the hidden states again",
                           what, k);
    }
    point(d, T, N, b);
    b->target_hidden = NULL;
    for (int k = 0; k < d->n_taps; k++)
        b->host_taps[k] = taps[k];
    b->taps_dt = dt;
    return CM_OK;
}

/* Batch i's tokens into ids, cu and mask, checked: a pack of the dataset from memory (checked at
 * open), or batch file i, whose mapping stays open in *f for its target_hidden (*th) when it
 * holds one (the caller closes *f, also on failure). */
static cm_status read_tokens(dt_data *d, int i, int32_t *ids, int32_t *cu, int32_t *mask, int64_t *T, int *N,
                             cm_st **f, const cm_st_tensor **th) {
    *f = NULL;
    if (i < 0 || i >= d->n)
        return CM_FAIL(CM_ERR_INVALID_ARG, "batch %d is outside the %d files", i, d->n);
    if (d->ds) {
        dt_dataset_pack_size(d->ds, i, T, N);
        dt_dataset_pack(d->ds, i, ids, cu, mask);
        return CM_OK;
    }
    const char         *path = d->paths[i];
    const cm_st_tensor *ti, *tc, *tm;
    CM_TRY(cm_st_open_file(f, path));
    CM_TRY(check_shapes(d, *f, path, T, N, &ti, &tc, &tm, th));
    if (*T != d->T[i] || *N != d->N[i])
        return CM_FAIL(CM_ERR_FORMAT, "batch file '%s' changed since the run started (%lld tokens, was %lld)", path,
                       (long long)*T, (long long)d->T[i]);
    memcpy(ids, ti->data, ti->nbytes);
    memcpy(cu, tc->data, tc->nbytes);
    memcpy(mask, tm->data, tm->nbytes);
    return check_contents(d, path, ids, cu, mask, *T, *N);
}

static cm_status load_now(dt_data *d, int i, dt_batch *b) {
    memset(b, 0, sizeof *b);
    cm_st              *f = NULL;
    const cm_st_tensor *th = NULL;
    int64_t             T;
    int                 N;
    cm_status           st;
    CM_TRY_GOTO(read_tokens(d, i, d->ids, d->cu, d->mask, &T, &N, &f, &th), st, fail);
    if (d->ds) { /* a pack: target_hidden from the source */
        if (d->have_src)
            return load_src(d, i, T, N, b, "pack %d of dataset '%s'", dt_dataset_name(d->ds));
        point(d, T, N, b);
        return CM_OK;
    }
    if (d->file_hidden)
        CM_TRY_GOTO(cm_convert(d->hidden_buf, CM_DTYPE_F32, th->data, th->dtype, (size_t)(T * d->width)), st,
                    fail);
    cm_st_destroy(&f); /* th->data lives in the mapping */
    if (d->have_src)
        return load_src(d, i, T, N, b, "batch %d, file '%s'", d->paths[i]);
    if (d->width)
        CM_TRY_GOTO(check_hidden(d, T, "batch %d, file '%s'", i, d->paths[i]), st, fail);
    point(d, T, N, b);
    return CM_OK;
fail:
    cm_st_destroy(&f);
    return st;
}

cm_status dt_data_load_tokens(dt_data *d, int i, dt_batch *b) {
    memset(b, 0, sizeof *b);
    if (!d->tok_ids || !d->tok_mask || !d->tok_cu) {
        free(d->tok_ids);
        free(d->tok_mask);
        free(d->tok_cu);
        d->tok_ids = malloc((size_t)d->max_T * sizeof *d->tok_ids);
        d->tok_mask = malloc((size_t)d->max_T * sizeof *d->tok_mask);
        d->tok_cu = malloc((size_t)(d->max_N + 1) * sizeof *d->tok_cu);
        if (!d->tok_ids || !d->tok_mask || !d->tok_cu)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate token buffers for %lld tokens", (long long)d->max_T);
    }
    cm_st              *f = NULL;
    const cm_st_tensor *th = NULL;
    int64_t             T;
    int                 N;
    cm_status           st = read_tokens(d, i, d->tok_ids, d->tok_cu, d->tok_mask, &T, &N, &f, &th);
    cm_st_destroy(&f);
    if (st != CM_OK)
        return st;
    b->T = T;
    b->n_seq = N;
    b->cu_seqlens = d->tok_cu;
    b->input_ids = d->tok_ids;
    b->loss_mask = d->tok_mask;
    return CM_OK;
}

// ---- page-locked hidden buffers

static void pin_hidden(dt_data *d, int k, float *p) {
    if (!d->pin || !p || d->pinned[k])
        return;
    const size_t bytes = (size_t)d->max_T * (size_t)d->width * sizeof(float);
    if (d->pin(d->pin_user, p, bytes) == CM_OK)
        d->pinned[k] = p;
    else
        CM_LOG_WARN("hidden-state buffer left pageable (uploads slower): %s", cm_last_error());
}

void dt_data_set_pinning(dt_data *d, dt_pin_fn pin, dt_unpin_fn unpin, void *user) {
    d->pin = pin;
    d->unpin = unpin;
    d->pin_user = user;
    pin_hidden(d, 0, d->hidden_buf); /* the sets swap pointers later; each stays pinned */
    pin_hidden(d, 1, d->alt_hidden);
}

// ---- prefetch

static void *prefetch_main(void *arg) {
    dt_data *d = arg;
    d->pf_st = load_now(d, d->pf_index, &d->pf_batch);
    if (d->pf_st != CM_OK)
        snprintf(d->pf_msg, sizeof d->pf_msg, "%s", cm_last_error());
    return NULL;
}

/* Waits for the loader thread; 1 when it loaded batch i (status in d->pf_st). */
static int prefetch_join(dt_data *d, int i) {
    if (!d->pf_running)
        return 0;
    pthread_join(d->pf_thread, NULL);
    d->pf_running = 0;
    return d->pf_index == i;
}

cm_status dt_data_prefetch(dt_data *d, int i) {
    if (i < 0 || i >= d->n)
        return CM_FAIL(CM_ERR_INVALID_ARG, "batch %d is outside the %d files", i, d->n);
    prefetch_join(d, -1); /* an earlier prefetch nobody asked for */
    if (!d->alt_ids) {
        if (alloc_set(d, &d->alt_ids, &d->alt_mask, &d->alt_cu, &d->alt_hidden) != CM_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", cm_last_error()); /* CM_FAIL rewrites that buffer */
            return CM_FAIL(CM_ERR_NOMEM, "%s (a second set, to load ahead); train with --prefetch 0", why);
        }
        pin_hidden(d, 1, d->alt_hidden);
    }
    /* the caller's batch stays in the set it was loaded into; the thread fills the other */
    int32_t *t;
    t = d->ids, d->ids = d->alt_ids, d->alt_ids = t;
    t = d->cu, d->cu = d->alt_cu, d->alt_cu = t;
    t = d->mask, d->mask = d->alt_mask, d->alt_mask = t;
    float *h = d->hidden_buf;
    d->hidden_buf = d->alt_hidden, d->alt_hidden = h;
    d->pf_index = i;
    d->pf_msg[0] = 0;
    const int e = pthread_create(&d->pf_thread, NULL, prefetch_main, d);
    if (e != 0)
        return CM_FAIL(CM_ERR_IO, "cannot start the batch loader thread: %s; train with --prefetch 0",
                       strerror(e));
    d->pf_running = 1;
    return CM_OK;
}

cm_status dt_data_load(dt_data *d, int i, dt_batch *b) {
    if (prefetch_join(d, i)) {
        if (d->pf_st != CM_OK)
            return CM_FAIL(d->pf_st, "%s", d->pf_msg);
        *b = d->pf_batch;
        return CM_OK;
    }
    return load_now(d, i, b);
}
