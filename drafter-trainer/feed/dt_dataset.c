/* drafter-trainer/feed/dt_dataset.c — tokenized datasets (formats and packing rules in
 * dt_dataset.h): the JSONL and binary readers, the binary writer, and the first-fit-decreasing
 * packer. Every document of every file is held in three flat host arrays (ids, masks, offsets);
 * packs are lists of document numbers into them. First fit uses a max segment tree over the
 * packs' free room, so packing is O(N log N) for N documents. */
#include "dt_dataset.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cm_hash.h"
#include "cm_log.h"
#include "cm_safetensors.h"

// ---- growable document arrays

static cm_status docs_reserve(dt_docs *d, int64_t *cap_tok, int64_t *cap_doc, int64_t add_tok,
                              const char *path) {
    if (d->total + add_tok > *cap_tok) {
        int64_t nc = *cap_tok ? *cap_tok : 4096;
        while (nc < d->total + add_tok)
            nc *= 2;
        int32_t *ni = realloc(d->ids, (size_t)nc * sizeof *ni);
        if (ni)
            d->ids = ni;
        uint8_t *nm = ni ? realloc(d->mask, (size_t)nc) : NULL;
        if (nm)
            d->mask = nm;
        if (!ni || !nm)
            return CM_FAIL(CM_ERR_NOMEM, "cannot hold %lld tokens of '%s'", (long long)nc, path);
        *cap_tok = nc;
    }
    if (d->n_docs + 2 > *cap_doc) {
        int64_t  nc = *cap_doc ? *cap_doc * 2 : 256;
        int64_t *no = realloc(d->offsets, (size_t)nc * sizeof *no);
        if (!no)
            return CM_FAIL(CM_ERR_NOMEM, "cannot hold %lld documents of '%s'", (long long)nc, path);
        d->offsets = no;
        *cap_doc = nc;
    }
    return CM_OK;
}

void dt_docs_release(dt_docs *d) {
    if (!d)
        return;
    free(d->ids);
    free(d->mask);
    free(d->offsets);
    memset(d, 0, sizeof *d);
}

// ---- JSONL

static int blank(const char *s) {
    for (; *s; s++)
        if (*s != ' ' && *s != '\t' && *s != '\r' && *s != '\n')
            return 0;
    return 1;
}

/* One parsed line into d (appended); line is 1-based for messages. */
static cm_status jsonl_doc(dt_docs *d, int64_t *cap_tok, int64_t *cap_doc, const cJSON *root,
                           const char *path, int64_t line) {
    if (!cJSON_IsObject(root))
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s' line %lld: not a JSON object; each line is one document "
                       "{\"input_ids\": [...], \"loss_mask\": [...]}",
                       path, (long long)line);
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(root, "input_ids");
    const cJSON *mask = cJSON_GetObjectItemCaseSensitive(root, "loss_mask");
    if (!cJSON_IsArray(ids))
        return CM_FAIL(CM_ERR_FORMAT,
                       "'%s' line %lld: no \"input_ids\" array (each document needs its token ids)", path,
                       (long long)line);
    int64_t n = cJSON_GetArraySize(ids);
    if (n < 1)
        return CM_FAIL(CM_ERR_FORMAT, "'%s' line %lld: \"input_ids\" is empty; leave empty documents out",
                       path, (long long)line);
    if (mask && !cJSON_IsNull(mask)) {
        if (!cJSON_IsArray(mask))
            return CM_FAIL(CM_ERR_FORMAT, "'%s' line %lld: \"loss_mask\" must be an array of 0 and 1", path,
                           (long long)line);
        int64_t m = cJSON_GetArraySize(mask);
        if (m != n)
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s' line %lld: \"loss_mask\" has %lld entries but \"input_ids\" has %lld; they "
                           "must be equally long",
                           path, (long long)line, (long long)m, (long long)n);
    } else
        mask = NULL;
    CM_TRY(docs_reserve(d, cap_tok, cap_doc, n, path));
    int64_t      k = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, ids) {
        double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!cJSON_IsNumber(it) || v < 0 || v > INT32_MAX || v != floor(v))
            return CM_FAIL(CM_ERR_FORMAT,
                           "'%s' line %lld: input_ids[%lld] is not a token id (an integer in [0, 2^31))",
                           path, (long long)line, (long long)k);
        d->ids[d->total + k++] = (int32_t)v;
    }
    k = 0;
    if (mask)
        cJSON_ArrayForEach(it, mask) {
            int v = cJSON_IsTrue(it) ? 1 : cJSON_IsFalse(it) ? 0 : -1;
            if (cJSON_IsNumber(it) && (it->valuedouble == 0 || it->valuedouble == 1))
                v = (int)it->valuedouble;
            if (v < 0)
                return CM_FAIL(CM_ERR_FORMAT, "'%s' line %lld: loss_mask[%lld] must be 0 or 1", path,
                               (long long)line, (long long)k);
            d->mask[d->total + k++] = (uint8_t)v;
        }
    else
        memset(d->mask + d->total, 1, (size_t)n);
    if (d->n_docs == 0)
        d->offsets[0] = 0;
    d->total += n;
    d->offsets[++d->n_docs] = d->total;
    return CM_OK;
}

static cm_status read_jsonl(dt_docs *d, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return CM_FAIL(CM_ERR_IO, "cannot open dataset '%s': %s", path, strerror(errno));
    cm_status st = CM_OK;
    int64_t   cap_tok = 0, cap_doc = 0, line = 0;
    char     *buf = NULL;
    size_t    cap = 0;
    ssize_t   len;
    while ((len = getline(&buf, &cap, f)) >= 0) {
        line++;
        /* text is read as C strings from here on: a NUL would end the line early, and a line
         * that starts with one would pass as blank (a document lost without a word) */
        const char *nul = memchr(buf, '\0', (size_t)len);
        if (nul) {
            st = CM_FAIL(CM_ERR_FORMAT,
                         "'%s' line %lld: NUL byte at byte %lld of the line; JSONL is text (a tokenized binary "
                         "dataset must be named *.safetensors)",
                         path, (long long)line, (long long)(nul - buf));
            goto fail;
        }
        if (blank(buf))
            continue;
        const char *end = NULL;
        cJSON      *root = cJSON_ParseWithLengthOpts(buf, (size_t)len, &end, 0);
        if (!root) {
            st = CM_FAIL(CM_ERR_FORMAT, "'%s' line %lld: not valid JSON (near byte %lld of the line)", path,
                         (long long)line, end ? (long long)(end - buf) : 0LL);
            goto fail;
        }
        if (!blank(end)) {
            cJSON_Delete(root);
            st = CM_FAIL(CM_ERR_FORMAT,
                         "'%s' line %lld: text after the JSON object; put one document per line", path,
                         (long long)line);
            goto fail;
        }
        st = jsonl_doc(d, &cap_tok, &cap_doc, root, path, line);
        cJSON_Delete(root);
        if (st != CM_OK)
            goto fail;
    }
    if (ferror(f)) {
        st = CM_FAIL(CM_ERR_IO, "cannot read dataset '%s': %s", path, strerror(errno));
        goto fail;
    }
    if (d->n_docs == 0) {
        st = CM_FAIL(CM_ERR_FORMAT, "dataset '%s' holds no documents (every line is blank)", path);
        goto fail;
    }
    free(buf);
    fclose(f);
    return CM_OK;
fail:
    free(buf);
    fclose(f);
    return st;
}

// ---- binary

static cm_status bin_tensor(const cm_st *f, const char *path, const char *name, cm_dtype dt,
                            const cm_st_tensor **out) {
    const cm_st_tensor *t = cm_st_find(f, name);
    if (!t)
        return CM_FAIL(CM_ERR_FORMAT,
                       "dataset '%s' has no tensor '%s' (a tandem-tokens file holds input_ids I32, loss_mask "
                       "U8 and doc_offsets I64; write it with drafter-trainer dataset convert)",
                       path, name);
    if (t->dtype != dt || t->n_dims != 1)
        return CM_FAIL(CM_ERR_FORMAT, "dataset '%s': '%s' must be %s with 1 dimension, found %s with %d",
                       path, name, cm_dtype_name(dt), cm_dtype_name(t->dtype), t->n_dims);
    *out = t;
    return CM_OK;
}

static cm_status read_bin(dt_docs *d, const char *path) {
    cm_st *f = NULL;
    CM_TRY(cm_st_open_file(&f, path));
    cm_status           st = CM_OK;
    const cm_st_tensor *ti, *tm, *to;
    const char         *fmt = cm_st_metadata(f, "format"), *ver = cm_st_metadata(f, "version");
    if (!fmt || strcmp(fmt, DT_DATASET_FORMAT) != 0 || !ver || strcmp(ver, DT_DATASET_VERSION) != 0) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "dataset '%s' is not a tandem-tokens file version 1 (__metadata__ format '%s', version "
                     "'%s'); convert JSONL with drafter-trainer dataset convert",
                     path, fmt ? fmt : "", ver ? ver : "");
        goto fail;
    }
    CM_TRY_GOTO(bin_tensor(f, path, "input_ids", CM_DTYPE_I32, &ti), st, fail);
    CM_TRY_GOTO(bin_tensor(f, path, "loss_mask", CM_DTYPE_U8, &tm), st, fail);
    CM_TRY_GOTO(bin_tensor(f, path, "doc_offsets", CM_DTYPE_I64, &to), st, fail);
    const int64_t total = ti->shape[0], n = to->shape[0] - 1;
    if (tm->shape[0] != total) {
        st = CM_FAIL(CM_ERR_FORMAT, "dataset '%s': loss_mask has %lld entries but input_ids has %lld", path,
                     (long long)tm->shape[0], (long long)total);
        goto fail;
    }
    if (n < 1 || total < 1) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "dataset '%s' holds no documents (doc_offsets has %lld entries, %lld tokens)", path,
                     (long long)to->shape[0], (long long)total);
        goto fail;
    }
    d->ids = malloc((size_t)total * sizeof *d->ids);
    d->mask = malloc((size_t)total);
    d->offsets = malloc((size_t)(n + 1) * sizeof *d->offsets);
    if (!d->ids || !d->mask || !d->offsets) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot hold the %lld tokens of '%s'", (long long)total, path);
        goto fail;
    }
    memcpy(d->ids, ti->data, ti->nbytes); /* the mapping may be unaligned */
    memcpy(d->mask, tm->data, tm->nbytes);
    memcpy(d->offsets, to->data, to->nbytes);
    if (d->offsets[0] != 0 || d->offsets[n] != total) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "dataset '%s': doc_offsets runs from %lld to %lld but must run from 0 to %lld (the "
                     "tokens); the file is damaged, convert it again",
                     path, (long long)d->offsets[0], (long long)d->offsets[n], (long long)total);
        goto fail;
    }
    for (int64_t k = 0; k < n; k++)
        if (d->offsets[k + 1] <= d->offsets[k]) {
            st = CM_FAIL(CM_ERR_FORMAT,
                         "dataset '%s': doc_offsets is not strictly increasing at %lld (%lld then %lld); the "
                         "file is damaged, convert it again",
                         path, (long long)k + 1, (long long)d->offsets[k], (long long)d->offsets[k + 1]);
            goto fail;
        }
    for (int64_t k = 0; k < total; k++) {
        if (d->ids[k] < 0) {
            st = CM_FAIL(CM_ERR_FORMAT, "dataset '%s': input_ids[%lld] = %d is negative", path, (long long)k,
                         d->ids[k]);
            goto fail;
        }
        if (d->mask[k] > 1) {
            st = CM_FAIL(CM_ERR_FORMAT, "dataset '%s': loss_mask[%lld] is %d; it must be 0 or 1", path,
                         (long long)k, d->mask[k]);
            goto fail;
        }
    }
    d->n_docs = n;
    d->total = total;
    cm_st_destroy(&f);
    return CM_OK;
fail:
    cm_st_destroy(&f);
    dt_docs_release(d);
    return st;
}

static int is_binary(const char *path) {
    size_t n = strlen(path);
    return n >= 12 && strcmp(path + n - 12, ".safetensors") == 0;
}

cm_status dt_docs_read(dt_docs *out, const char *path) {
    memset(out, 0, sizeof *out);
    cm_status st = is_binary(path) ? read_bin(out, path) : read_jsonl(out, path);
    if (st != CM_OK)
        dt_docs_release(out);
    return st;
}

cm_status dt_docs_write(const dt_docs *d, const char *path) {
    cm_st_writer *w = NULL;
    cm_status     st;
    const int64_t nt = d->total, no = d->n_docs + 1;
    CM_TRY(cm_st_writer_create(&w));
    CM_TRY_GOTO(cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, &nt, d->ids), st, done);
    CM_TRY_GOTO(cm_st_writer_add(w, "loss_mask", CM_DTYPE_U8, 1, &nt, d->mask), st, done);
    CM_TRY_GOTO(cm_st_writer_add(w, "doc_offsets", CM_DTYPE_I64, 1, &no, d->offsets), st, done);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "format", DT_DATASET_FORMAT), st, done);
    CM_TRY_GOTO(cm_st_writer_set_metadata(w, "version", DT_DATASET_VERSION), st, done);
    st = cm_st_writer_write(w, path);
done:
    cm_st_writer_destroy(&w);
    return st;
}

// ---- the packed dataset

struct dt_dataset {
    dt_docs          all;        /* every document of every file, in file order */
    int64_t         *file_first; /* [n_files + 1] first global document of each file */
    char           **paths;      /* [n_files] */
    int              n_files;
    char            *name; /* paths joined by commas */
    int64_t          budget;
    int              n_packs;
    int64_t         *pack_start; /* [n_packs + 1] into pack_docs */
    int64_t         *pack_docs;  /* kept documents, grouped by pack, ascending within a pack */
    int64_t         *pack_T;     /* [n_packs] */
    uint64_t         hash;
    dt_dataset_stats stats;
};

void dt_dataset_destroy(dt_dataset **ds) {
    if (!ds || !*ds)
        return;
    dt_dataset *x = *ds;
    dt_docs_release(&x->all);
    if (x->paths)
        for (int i = 0; i < x->n_files; i++)
            free(x->paths[i]);
    free(x->paths);
    free(x->file_first);
    free(x->name);
    free(x->pack_start);
    free(x->pack_docs);
    free(x->pack_T);
    free(x);
    *ds = NULL;
}

/* Appends file f's documents to ds->all. */
static cm_status append_file(dt_dataset *ds, const dt_docs *f) {
    dt_docs *a = &ds->all;
    int64_t *no = realloc(a->offsets, (size_t)(a->n_docs + f->n_docs + 1) * sizeof *no);
    if (no)
        a->offsets = no;
    int32_t *ni = no ? realloc(a->ids, (size_t)(a->total + f->total) * sizeof *ni) : NULL;
    if (ni)
        a->ids = ni;
    uint8_t *nm = ni ? realloc(a->mask, (size_t)(a->total + f->total)) : NULL;
    if (nm)
        a->mask = nm;
    if (!no || !ni || !nm)
        return CM_FAIL(CM_ERR_NOMEM, "cannot hold %lld tokens of datasets", (long long)(a->total + f->total));
    memcpy(a->ids + a->total, f->ids, (size_t)f->total * sizeof *a->ids);
    memcpy(a->mask + a->total, f->mask, (size_t)f->total);
    a->offsets[0] = 0;
    for (int64_t k = 1; k <= f->n_docs; k++)
        a->offsets[a->n_docs + k] = a->total + f->offsets[k];
    a->n_docs += f->n_docs;
    a->total += f->total;
    return CM_OK;
}

static int has_anchor(const uint8_t *mask, int64_t len) {
    for (int64_t p = 0; p + 1 < len; p++)
        if (mask[p] && mask[p + 1])
            return 1;
    return 0;
}

typedef struct doc_len {
    int64_t len, doc;
} doc_len;

static int cmp_len_desc(const void *pa, const void *pb) { /* longest first, ties by number */
    const doc_len *a = pa, *b = pb;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;
    return a->doc < b->doc ? -1 : a->doc > b->doc;
}

/* First-fit decreasing over the kept documents keep[n] (ascending numbers). */
static cm_status pack(dt_dataset *ds, const int64_t *keep, int64_t n) {
    cm_status st = CM_OK;
    int64_t   leaves = 1;
    if (n > INT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%lld documents are too many for one run; split the dataset",
                       (long long)n);
    while (leaves < n)
        leaves *= 2;
    int64_t *len = malloc((size_t)ds->all.n_docs * sizeof *len);
    doc_len *sorted = malloc((size_t)n * sizeof *sorted);
    int64_t *cursor = malloc((size_t)n * sizeof *cursor);
    int64_t *room = malloc((size_t)(2 * leaves) * sizeof *room); /* max free room over each subtree */
    int32_t *pack_of = malloc((size_t)ds->all.n_docs * sizeof *pack_of);
    if (!len || !sorted || !cursor || !room || !pack_of) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot pack %lld documents", (long long)n);
        goto done;
    }
    for (int64_t g = 0; g < ds->all.n_docs; g++)
        len[g] = ds->all.offsets[g + 1] - ds->all.offsets[g];
    for (int64_t i = 0; i < n; i++)
        sorted[i] = (doc_len){len[keep[i]], keep[i]};
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_len_desc);
    for (int64_t i = 0; i < 2 * leaves; i++)
        room[i] = ds->budget;
    int64_t n_packs = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t L = sorted[i].len;
        int64_t       node = 1;
        while (node < leaves) /* leftmost leaf with room ≥ L: always exists, n leaves suffice */
            node = room[2 * node] >= L ? 2 * node : 2 * node + 1;
        const int64_t p = node - leaves;
        pack_of[sorted[i].doc] = (int32_t)p;
        if (p + 1 > n_packs)
            n_packs = p + 1;
        room[node] -= L;
        for (node /= 2; node >= 1; node /= 2)
            room[node] = room[2 * node] > room[2 * node + 1] ? room[2 * node] : room[2 * node + 1];
    }
    if (n_packs > INT32_MAX - 1) {
        st = CM_FAIL(CM_ERR_INVALID_ARG, "%lld packs are too many; raise --token-budget", (long long)n_packs);
        goto done;
    }
    ds->n_packs = (int)n_packs;
    ds->pack_start = calloc((size_t)n_packs + 1, sizeof *ds->pack_start);
    ds->pack_docs = malloc((size_t)n * sizeof *ds->pack_docs);
    ds->pack_T = calloc((size_t)n_packs, sizeof *ds->pack_T);
    if (!ds->pack_start || !ds->pack_docs || !ds->pack_T) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot hold %lld packs", (long long)n_packs);
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        ds->pack_start[pack_of[keep[i]] + 1]++;
        ds->pack_T[pack_of[keep[i]]] += len[keep[i]];
    }
    for (int64_t p = 0; p < n_packs; p++)
        ds->pack_start[p + 1] += ds->pack_start[p];
    for (int64_t p = 0; p < n_packs; p++)
        cursor[p] = ds->pack_start[p];
    for (int64_t i = 0; i < n; i++) /* keep is ascending, so each pack's list is too */
        ds->pack_docs[cursor[pack_of[keep[i]]]++] = keep[i];
done:
    free(len);
    free(sorted);
    free(cursor);
    free(room);
    free(pack_of);
    return st;
}

static void hash_i64(cm_xxh64_state *h, int64_t v) {
    cm_xxh64_update(h, &v, sizeof v);
}

cm_status dt_dataset_open(dt_dataset **out, const char *const *paths, int n_paths, int64_t budget,
                          int vocab_size) {
    *out = NULL;
    if (n_paths < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "no dataset files given (--dataset FILE[,FILE...])");
    if (budget < 2 || budget > INT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--token-budget %lld is outside [2, %d]", (long long)budget,
                       INT32_MAX);
    cm_status   st = CM_OK;
    dt_docs     f = {0};
    int64_t    *keep = NULL;
    dt_dataset *ds = calloc(1, sizeof *ds);
    if (!ds)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the dataset");
    ds->budget = budget;
    ds->n_files = n_paths;
    ds->paths = calloc((size_t)n_paths, sizeof *ds->paths);
    ds->file_first = calloc((size_t)n_paths + 1, sizeof *ds->file_first);
    size_t name_len = 1;
    for (int i = 0; i < n_paths; i++)
        name_len += strlen(paths[i]) + 1;
    ds->name = calloc(name_len, 1);
    if (!ds->paths || !ds->file_first || !ds->name) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the dataset");
        goto fail;
    }
    for (int i = 0; i < n_paths; i++) {
        if (!(ds->paths[i] = strdup(paths[i]))) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the dataset");
            goto fail;
        }
        strcat(ds->name, i ? "," : "");
        strcat(ds->name, paths[i]);
        CM_TRY_GOTO(dt_docs_read(&f, paths[i]), st, fail);
        for (int64_t k = 0; k < f.n_docs; k++) {
            const int64_t len = f.offsets[k + 1] - f.offsets[k];
            if (len > budget) {
                st = CM_FAIL(
                    CM_ERR_INVALID_ARG,
                    "dataset '%s': document %lld has %lld tokens, more than --token-budget %lld; raise "
                    "--token-budget or split or truncate the data (tools/prepare_data.py "
                    "--max-length)",
                    paths[i], (long long)k, (long long)len, (long long)budget);
                goto fail;
            }
            for (int64_t t = f.offsets[k]; t < f.offsets[k + 1]; t++)
                if (f.ids[t] >= vocab_size) {
                    st =
                        CM_FAIL(CM_ERR_INVALID_ARG,
                                "dataset '%s': document %lld: input_ids[%lld] = %d is outside the vocabulary "
                                "[0, %d) (was the data tokenized for another model?)",
                                paths[i], (long long)k, (long long)(t - f.offsets[k]), f.ids[t], vocab_size);
                    goto fail;
                }
        }
        CM_TRY_GOTO(append_file(ds, &f), st, fail);
        dt_docs_release(&f);
        ds->file_first[i + 1] = ds->all.n_docs;
    }
    const dt_docs *a = &ds->all;
    keep = malloc((size_t)a->n_docs * sizeof *keep);
    if (!keep) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the document list");
        goto fail;
    }
    int64_t n_keep = 0;
    ds->stats.n_docs = a->n_docs;
    for (int64_t g = 0; g < a->n_docs; g++) {
        const int64_t o = a->offsets[g], len = a->offsets[g + 1] - o;
        if (!has_anchor(a->mask + o, len)) {
            ds->stats.n_dropped++;
            continue;
        }
        keep[n_keep++] = g;
        ds->stats.n_tokens += len;
        for (int64_t t = o; t < o + len; t++)
            ds->stats.n_supervised += a->mask[t];
    }
    if (n_keep == 0) {
        st =
            CM_FAIL(CM_ERR_INVALID_ARG,
                    "dataset has no trainable tokens: none of the %lld documents of '%s' has two consecutive "
                    "supervised tokens (loss_mask 1 at p and p + 1); check the loss masks "
                    "(tools/prepare_data.py sets 1 on assistant tokens)",
                    (long long)a->n_docs, ds->name);
        goto fail;
    }
    CM_TRY_GOTO(pack(ds, keep, n_keep), st, fail);

    cm_xxh64_state h;
    cm_xxh64_init(&h, 0x7061636b73ULL); /* "packs" */
    hash_i64(&h, budget);
    hash_i64(&h, ds->n_packs);
    for (int p = 0; p < ds->n_packs; p++) {
        const int64_t N = ds->pack_start[p + 1] - ds->pack_start[p];
        hash_i64(&h, N);
        if (ds->pack_T[p] > ds->stats.max_pack_tokens)
            ds->stats.max_pack_tokens = ds->pack_T[p];
        if (N > ds->stats.max_pack_docs)
            ds->stats.max_pack_docs = N;
        for (int64_t j = ds->pack_start[p]; j < ds->pack_start[p + 1]; j++) {
            const int64_t g = ds->pack_docs[j], o = a->offsets[g], len = a->offsets[g + 1] - o;
            hash_i64(&h, len);
            cm_xxh64_update(&h, a->ids + o, (size_t)len * sizeof *a->ids);
            cm_xxh64_update(&h, a->mask + o, (size_t)len);
        }
    }
    ds->hash = cm_xxh64_digest(&h);
    ds->stats.n_packs = ds->n_packs;
    CM_LOG_INFO("dataset '%s': %lld documents (%lld dropped: no two consecutive supervised tokens), %lld "
                "tokens (%lld supervised) in %d packs of at most %lld tokens (largest %lld)",
                ds->name, (long long)ds->stats.n_docs, (long long)ds->stats.n_dropped,
                (long long)ds->stats.n_tokens, (long long)ds->stats.n_supervised, ds->n_packs,
                (long long)budget, (long long)ds->stats.max_pack_tokens);
    free(keep);
    *out = ds;
    return CM_OK;
fail:
    free(keep);
    dt_docs_release(&f);
    dt_dataset_destroy(&ds);
    return st;
}

void dt_dataset_get_stats(const dt_dataset *ds, dt_dataset_stats *out) {
    *out = ds->stats;
}
int64_t dt_dataset_budget(const dt_dataset *ds) {
    return ds->budget;
}
uint64_t dt_dataset_hash(const dt_dataset *ds) {
    return ds->hash;
}
const char *dt_dataset_name(const dt_dataset *ds) {
    return ds->name;
}
int dt_dataset_n_packs(const dt_dataset *ds) {
    return ds->n_packs;
}

void dt_dataset_pack_size(const dt_dataset *ds, int i, int64_t *T, int *N) {
    CM_ASSERT(i >= 0 && i < ds->n_packs);
    *T = ds->pack_T[i];
    *N = (int)(ds->pack_start[i + 1] - ds->pack_start[i]);
}

void dt_dataset_pack(const dt_dataset *ds, int i, int32_t *ids, int32_t *cu_seqlens, int32_t *loss_mask) {
    CM_ASSERT(i >= 0 && i < ds->n_packs);
    const dt_docs *a = &ds->all;
    int32_t        T = 0, n = 0;
    cu_seqlens[0] = 0;
    for (int64_t j = ds->pack_start[i]; j < ds->pack_start[i + 1]; j++) {
        const int64_t g = ds->pack_docs[j], o = a->offsets[g], len = a->offsets[g + 1] - o;
        memcpy(ids + T, a->ids + o, (size_t)len * sizeof *ids);
        for (int64_t t = 0; t < len; t++)
            loss_mask[T + t] = a->mask[o + t];
        T += (int32_t)len;
        cu_seqlens[++n] = T;
    }
}

void dt_dataset_pack_docs(const dt_dataset *ds, int i, int64_t *docs) {
    CM_ASSERT(i >= 0 && i < ds->n_packs);
    for (int64_t j = ds->pack_start[i]; j < ds->pack_start[i + 1]; j++)
        docs[j - ds->pack_start[i]] = ds->pack_docs[j];
}
