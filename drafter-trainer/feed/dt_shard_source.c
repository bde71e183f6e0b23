/* drafter-trainer/feed/dt_shard_source.c — target_hidden of `train --shards DIR` (dt_shard_source.h):
 * the records `drafter-trainer precompute` stored, checked against the drafter and the batch's
 * tokens, decoded tap by tap into the batch's own arrays on a few threads, and verified ahead of a
 * run on a few threads. */
#include "dt_shard_source.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_time.h"
#include "cm_cfg_hash.h"
#include "cm_chan.h"
#include "cm_compress.h"
#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_proto.h"
#include "cm_shard.h"

struct dt_shard_source {
    cm_shard_reader *r;
    cm_compress     *cz;
    int              n_taps, hidden;
    int             *pos; /* [n_taps]: tap k is tensor pos[k] of every record */
    uint32_t         n_tensors;
    cm_dtype         dtype;
    cm_proto_tensor  pt[CM_SHARD_MAX_LAYERS];
};

void dt_shard_source_destroy(dt_shard_source **s) {
    if (!s || !*s)
        return;
    cm_shard_reader_destroy(&(*s)->r);
    cm_compress_destroy(&(*s)->cz);
    free((*s)->pos);
    free(*s);
    *s = NULL;
}

static void layer_list(const cm_shard_identity *id, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < id->n_layers && n < cap; i++) {
        int k = snprintf(buf + n, cap - n, "%s%d", i ? "," : "", id->layer_ids[i]);
        if (k < 0)
            break;
        n += (size_t)k;
    }
}

cm_status dt_shard_source_open(dt_shard_source **out, const char *dir, const int *layer_ids, int n_taps,
                               int hidden, uint64_t target_id, uint64_t weights_id) {
    *out = NULL;
    cm_status        st = CM_OK;
    dt_shard_source *s = calloc(1, sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the shard source");
    s->n_taps = n_taps;
    s->hidden = hidden;
    s->pos = calloc((size_t)(n_taps > 0 ? n_taps : 1), sizeof *s->pos);
    if (!s->pos) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the shard source");
        goto fail;
    }
    CM_TRY_GOTO(cm_shard_reader_open(&s->r, dir, NULL), st, fail);
    const cm_shard_identity *id = cm_shard_reader_identity(s->r);
    char                     have[1024];
    layer_list(id, have, sizeof have);
    char why[400];
    if (cm_target_identity_differs(why, sizeof why, id->target_id, id->weights_id ? id->weights_id : weights_id,
                                   target_id, weights_id, "in the store", "in --target")) {
        st = CM_FAIL(CM_ERR_INVALID_ARG,
                     "shard directory '%s' holds hidden states of target '%s', another model than --target: %s; "
                     "precompute shards with a server of this target",
                     dir, id->target_name, why);
        goto fail;
    }
    if (weights_id && !id->weights_id)
        CM_LOG_WARN("shard directory '%s' records no weights fingerprint (written before they were recorded): "
                    "cannot check that its hidden states are of --target's weights %016llx, only of its config",
                    dir, (unsigned long long)weights_id);
    if ((int64_t)id->hidden_size != hidden) {
        st = CM_FAIL(CM_ERR_INVALID_ARG,
                     "shard directory '%s' holds hidden size %u but the drafter's hidden_size is %d; "
                     "use shards of the drafter's target",
                     dir, id->hidden_size, hidden);
        goto fail;
    }
    for (int k = 0; k < n_taps; k++) {
        s->pos[k] = -1;
        for (uint32_t i = 0; i < id->n_layers; i++)
            if (id->layer_ids[i] == layer_ids[k])
                s->pos[k] = (int)i;
        if (s->pos[k] < 0) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "shard directory '%s' holds layers %s but the drafter needs layer %d "
                         "(target_layer_ids[%d]); precompute with --layers covering every target_layer_id",
                         dir, have, layer_ids[k], k);
            goto fail;
        }
    }
    s->n_tensors = id->n_layers;
    s->dtype = id->hidden_dtype;
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = cm_chan_default_threads(); /* a 27B record is 419 MB of BF16 per step */
    CM_TRY_GOTO(cm_compress_create(&s->cz, &cc), st, fail);
    *out = s;
    return CM_OK;
fail:
    dt_shard_source_destroy(&s);
    return st;
}

static cm_status shard_get(void *self, int batch, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                           void *const *taps, cm_dtype *dt) {
    dt_shard_source *s = self;
    const char      *dir = cm_shard_reader_dir(s->r);
    const uint64_t   h = cm_shard_batch_hash(ids, (uint32_t)T, cu, (uint32_t)n_seq);
    const void      *frame;
    size_t           len;
    uint64_t         at;
    if (!cm_shard_reader_find(s->r, (uint64_t)batch, &at))
        return CM_FAIL(CM_ERR_FORMAT,
                       "shard directory '%s' has no record for batch %d; run precompute over the same data "
                       "until it completes",
                       dir, batch);
    if (cm_shard_reader_get(s->r, (uint64_t)batch, h, &frame, &len) != CM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", cm_last_error());
        return CM_FAIL(CM_ERR_FORMAT, "batch %d cannot be read from shards: %s", batch, why);
    }
    cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    cm_proto_answer a = {.tensors = s->pt, .cap_tensors = CM_SHARD_MAX_LAYERS};
    if (cm_proto_answer_decode(frame, len, &lim, &a) != CM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", cm_last_error());
        return CM_FAIL(CM_ERR_FORMAT, "shard directory '%s': batch %d: the record is not a valid answer: %s",
                       dir, batch, why);
    }
    if (a.batch_id != (uint64_t)batch || a.n_tensors != s->n_tensors)
        return CM_FAIL(CM_ERR_FORMAT,
                       "shard directory '%s': batch %d: the record answers batch %llu with %u tensors", dir,
                       batch, (unsigned long long)a.batch_id, a.n_tensors);
    const int64_t D = s->hidden;
    for (int k = 0; k < s->n_taps; k++) {
        const cm_proto_tensor *t = &a.tensors[s->pos[k]];
        if (t->n_dims != 2 || t->shape[0] != T || t->shape[1] != D || t->dtype != s->dtype ||
            (t->dtype != CM_DTYPE_BF16 && t->dtype != CM_DTYPE_F32))
            return CM_FAIL(
                CM_ERR_FORMAT,
                "shard directory '%s': batch %d: tensor '%s' is %s with %d dims, expected %s [%lld, %lld]",
                dir, batch, t->name, cm_dtype_name(t->dtype), t->n_dims, cm_dtype_name(s->dtype),
                (long long)T, (long long)D);
        if (cm_compress_decode_tensor(s->cz, t, taps[k], (size_t)t->raw_size) != CM_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", cm_last_error());
            return CM_FAIL(CM_ERR_FORMAT, "shard directory '%s': batch %d: tensor '%s' does not decode: %s",
                           dir, batch, t->name, why);
        }
    }
    *dt = s->dtype;
    return CM_OK;
}

dt_hidden_source dt_shard_source_hidden(dt_shard_source *s) {
    return (dt_hidden_source){.get = shard_get, .self = s};
}

// ---- verifying the records a run will read, before its first step

typedef struct verify_job {
    const cm_shard_reader *r;
    const uint64_t        *at; /* [n]: positions in index order */
    uint64_t               n;
    atomic_uint_fast64_t   next;
    atomic_int             stop;
    pthread_mutex_t        mu;
    uint64_t               bad; /* the lowest failing k, n if none */
    cm_status              st;
    char                   msg[1024];
} verify_job;

static void *verify_worker(void *arg) {
    verify_job *j = arg;
    for (;;) {
        const uint64_t k = atomic_fetch_add(&j->next, 1);
        if (k >= j->n || atomic_load(&j->stop))
            return NULL;
        const void *frame;
        size_t      len;
        cm_status   st = cm_shard_reader_at(j->r, j->at[k], &frame, &len);
        if (st == CM_OK)
            continue;
        pthread_mutex_lock(&j->mu);
        if (k < j->bad) {
            j->bad = k, j->st = st;
            snprintf(j->msg, sizeof j->msg, "%s", cm_last_error());
        }
        pthread_mutex_unlock(&j->mu);
        atomic_store(&j->stop, 1);
    }
}

cm_status dt_shard_source_verify(dt_shard_source *s, const uint8_t *reads, int n_batches, int n_threads) {
    const cm_shard_reader *r = s->r;
    const char            *dir = cm_shard_reader_dir(r);
    const uint64_t         count = cm_shard_reader_count(r);
    for (int b = 0; b < n_batches; b++)
        if (reads[b] && !cm_shard_reader_find(r, (uint64_t)b, NULL))
            return CM_FAIL(CM_ERR_FORMAT,
                           "shard directory '%s' has no record for batch %d, which this run reads; run "
                           "precompute over the same data until it completes",
                           dir, b);
    verify_job j = {.r = r, .st = CM_OK};
    uint64_t  *at = malloc((count ? count : 1) * sizeof *at), bytes = 0;
    if (!at)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %llu record positions", (unsigned long long)count);
    for (uint64_t i = 0; i < count; i++) { /* index order: the shards are read front to back */
        cm_shard_entry e;
        cm_shard_reader_entry(r, i, &e);
        if (e.batch_id < (uint64_t)n_batches && reads[e.batch_id]) {
            at[j.n++] = i;
            bytes += CM_SHARD_RECORD_HEADER_SIZE + e.length;
        }
    }
    j.at = at;
    j.bad = j.n;
    atomic_init(&j.next, 0);
    atomic_init(&j.stop, 0);
    pthread_mutex_init(&j.mu, NULL);
    if (n_threads < 1)
        n_threads = 1;
    if (n_threads > 64)
        n_threads = 64;
    pthread_t th[64];
    int       started = 0;
    double    t0 = cm_now_s();
    for (; started < n_threads - 1; started++) /* and this thread */
        if (pthread_create(&th[started], NULL, verify_worker, &j) != 0)
            break;
    verify_worker(&j);
    for (int t = 0; t < started; t++)
        pthread_join(th[t], NULL);
    const double dt = cm_now_s() - t0;
    pthread_mutex_destroy(&j.mu);
    free(at);
    if (j.bad < j.n)
        return CM_FAIL(j.st, "checking the shards before the first step: %s", j.msg);
    CM_LOG_INFO("shards: %llu records, %.2f GB verified in %.2f s = %.2f GB/s (%d threads)%s",
                (unsigned long long)j.n, (double)bytes / 1e9, dt, dt > 0 ? (double)bytes / 1e9 / dt : 0.0,
                started + 1,
                dt > 60 ? "; each start of the run pays this: --verify-shards lazy checks each record only "
                          "when it is read"
                        : "");
    return CM_OK;
}
