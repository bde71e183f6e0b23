/* common/chan/cm_chan_server_enc.c — a worker's answers encoded (see cm_chan_server_work.c for the
 * worker): F32 rounded to the hidden dtype on n_threads threads, every tensor compressed with
 * cm_compress into a pooled buffer (reused once ZeroMQ has sent it), the HEAD written. Tensors
 * the compute announces with cm_chan_job_ready are encoded by the worker's encoder thread, in
 * request order, while the compute goes on (the target's forward keeps running while the layers
 * it has passed are compressed); the rest after the compute returns. */
#include "cm_chan_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_compress.h"
#include "cm_log.h"

// ----------------------------------------------------------------------------
// conversion and buffers

typedef struct conv_part {
    void       *dst;
    const void *src;
    cm_dtype    dt;
    size_t      n;
} conv_part;

static void *conv_thread(void *arg) {
    conv_part *c = arg;
    cm_convert(c->dst, c->dt, c->src, CM_DTYPE_F32, c->n);
    return NULL;
}

/* F32 → dt on up to n_threads threads (the caller's included). */
static void convert_parallel(void *dst, cm_dtype dt, const float *src, size_t n, int n_threads) {
    enum { MAXT = 64 };
    int t = n_threads < MAXT ? n_threads : MAXT;
    if (n < ((size_t)1 << 20) || t < 2) {
        cm_convert(dst, dt, src, CM_DTYPE_F32, n);
        return;
    }
    pthread_t th[MAXT];
    conv_part cp[MAXT];
    int       started[MAXT] = {0};
    size_t    per = (n + (size_t)t - 1) / (size_t)t, es = cm_dtype_size(dt);
    for (int i = 0; i < t; i++) {
        size_t lo = (size_t)i * per, hi = lo + per < n ? lo + per : n;
        cp[i] = (conv_part){(uint8_t *)dst + lo * es, src + lo, dt, lo < hi ? hi - lo : 0};
        if (i > 0)
            started[i] = pthread_create(&th[i], NULL, conv_thread, &cp[i]) == 0;
    }
    conv_thread(&cp[0]);
    for (int i = 1; i < t; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            conv_thread(&cp[i]);
    }
}

static pool_buf *pool_acquire(worker *k, size_t need) {
    pool_buf *grow = NULL;
    for (int i = 0; i < k->n_pool; i++) {
        pool_buf *b = &k->pool[i];
        if (atomic_load(&b->busy))
            continue;
        if (b->cap >= need) {
            atomic_store(&b->busy, 1);
            return b;
        }
        if (!grow)
            grow = b;
    }
    if (!grow && k->n_pool < POOL_MAX)
        grow = &k->pool[k->n_pool++];
    if (!grow)
        return NULL;
    free(grow->data); /* no copy: the contents are dead */
    grow->data = malloc(need);
    grow->cap = grow->data ? need : 0;
    if (!grow->data)
        return NULL;
    atomic_store(&grow->busy, 1);
    return grow;
}

static cm_status ensure_head(work *w, size_t head) {
    if (head <= w->head_cap)
        return CM_OK;
    free(w->head);
    w->head = malloc(head);
    w->head_cap = w->head ? head : 0;
    if (!w->head)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate an answer head of %zu bytes", head);
    return CM_OK;
}

/* The HEAD of an answer whose tensors went over NCCL (no DATA). */
cm_status cm_chan_encode_nccl_head_(cm_chan_server *s, worker *k, const cm_proto_request *rq) {
    const cm_dtype hd = s->cfg.hidden_dtype;
    const int64_t  T = rq->n_tokens, D = s->cfg.hidden_size;
    work          *w = &k->w;
    for (uint32_t i = 0; i < rq->n_layers; i++) {
        cm_proto_tensor *t = &k->tensors[i];
        *t = (cm_proto_tensor){.dtype = hd,
                               .encoding = CM_ENCODING_NCCL,
                               .n_dims = 2,
                               .shape = {T, D},
                               .raw_size = (uint64_t)T * (uint64_t)D * cm_dtype_size(hd)};
        snprintf(t->name, sizeof t->name, "layer_%d", rq->layer_ids[i]);
    }
    cm_proto_answer a = {.batch_id = rq->batch_id,
                         .n_tensors = rq->n_layers,
                         .tensors = k->tensors,
                         .cap_tensors = rq->n_layers};
    CM_TRY(ensure_head(w, cm_proto_answer_head_size(&a)));
    CM_TRY(cm_proto_answer_encode_head(&a, w->head, w->head_cap, &w->head_len));
    w->data_len = 0;
    return CM_OK;
}

/* An answer's DATA buffer: every tensor's bound, from the pool. */
static cm_status encode_begin(cm_chan_server *s, worker *k, const cm_proto_request *rq, encoding *e) {
    const cm_dtype hd = s->cfg.hidden_dtype;
    size_t         per = cm_compress_bound(k->cc, rq->encoding, hd, rq->n_tokens, s->cfg.hidden_size);
    if (!per)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cannot encode %s tensors as %s", cm_dtype_name(hd),
                       cm_encoding_name(rq->encoding));
    size_t    total = per * rq->n_layers;
    pool_buf *b = pool_acquire(k, total);
    uint8_t  *dst = b ? b->data : malloc(total);
    if (!dst)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for an answer", total);
    k->w.data = b;
    k->w.data_oneoff = b ? NULL : dst;
    *e = (encoding){.rq = rq, .dst = dst, .total = total};
    return CM_OK;
}

static void encode_abort(worker *k) {
    if (k->w.data)
        atomic_store(&k->w.data->busy, 0);
    free(k->w.data_oneoff);
    k->w.data = NULL;
    k->w.data_oneoff = NULL;
}

/* Encodes tensor e->done (request order) of dtype dt at the running offset. Runs on the worker
 * or on its encoder thread, never both at once. */
static cm_status encode_next(cm_chan_server *s, worker *k, encoding *e, cm_dtype dt) {
    const cm_proto_request *rq = e->rq;
    const cm_dtype          hd = s->cfg.hidden_dtype;
    const int64_t           T = rq->n_tokens, D = s->cfg.hidden_size;
    const size_t            n = (size_t)T * (size_t)D, es = cm_dtype_size(hd);
    const uint32_t          i = e->done;
    const void             *src = k->out_ptrs[i];
    size_t                  len = n * es;
    if (dt != hd && rq->encoding == CM_ENCODING_RAW) { /* convert straight into the answer */
        convert_parallel(e->dst + e->off, hd, src, n, s->cfg.n_threads);
    } else {
        if (dt != hd) {
            if (n * es > k->conv_cap) {
                free(k->conv);
                k->conv = malloc(n * es);
                k->conv_cap = k->conv ? n * es : 0;
                if (!k->conv)
                    return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes to convert an answer", n * es);
            }
            convert_parallel(k->conv, hd, src, n, s->cfg.n_threads);
            src = k->conv;
        }
        CM_TRY(
            cm_compress_encode(k->cc, rq->encoding, hd, src, T, D, e->dst + e->off, e->total - e->off, &len));
    }
    cm_proto_tensor *t = &k->tensors[i];
    *t = (cm_proto_tensor){.dtype = hd,
                           .encoding = rq->encoding,
                           .n_dims = 2,
                           .shape = {T, D},
                           .raw_size = n * es,
                           .encoded_size = len,
                           .data = e->dst + e->off};
    snprintf(t->name, sizeof t->name, "layer_%d", rq->layer_ids[i]);
    e->off += len;
    e->done++;
    return CM_OK;
}

static cm_status encode_finish(worker *k, encoding *e) {
    const cm_proto_request *rq = e->rq;
    cm_proto_answer         a = {.batch_id = rq->batch_id,
                                 .n_tensors = rq->n_layers,
                                 .tensors = k->tensors,
                                 .cap_tensors = rq->n_layers};
    CM_TRY(ensure_head(&k->w, cm_proto_answer_head_size(&a)));
    CM_TRY(cm_proto_answer_encode_head(&a, k->w.head, k->w.head_cap, &k->w.head_len));
    k->w.data_len = e->off;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// streaming: the encoder thread takes announced tensors while the compute runs

void cm_chan_job_ready(cm_chan_job *job, uint32_t i) {
    enc_state *es = job->stream_;
    if (!es || job->nccl || i >= job->req->n_layers)
        return;
    pthread_mutex_lock(&es->mu);
    if (!es->dt_set) {
        es->dt = job->out_dtype;
        es->dt_set = 1;
    }
    es->announced[i] = 1;
    pthread_cond_broadcast(&es->cv);
    pthread_mutex_unlock(&es->mu);
}

static int enc_can_take(const enc_state *es) {
    return es->active && !es->stop && es->st == CM_OK && es->enc->done < es->enc->rq->n_layers &&
           es->announced[es->enc->done];
}

static void *enc_main(void *arg) {
    worker    *k = arg;
    enc_state *es = &k->es;
    pthread_mutex_lock(&es->mu);
    for (;;) {
        while (!es->quit && !enc_can_take(es))
            pthread_cond_wait(&es->cv, &es->mu);
        if (es->quit)
            break;
        uint32_t     i = es->enc->done;
        cm_chan_job *job = es->job;
        cm_dtype     dt = es->dt;
        es->busy = 1;
        pthread_mutex_unlock(&es->mu);
        cm_status st = job->wait ? job->wait(job->wait_arg, i) : CM_OK;
        if (st == CM_OK)
            st = encode_next(k->s, k, es->enc, dt);
        pthread_mutex_lock(&es->mu);
        es->busy = 0;
        if (st != CM_OK && es->st == CM_OK) {
            es->st = st;
            snprintf(es->msg, sizeof es->msg, "%s", cm_last_error());
        }
        pthread_cond_broadcast(&es->cv);
    }
    pthread_mutex_unlock(&es->mu);
    return NULL;
}

/* Ends a job's streaming: the encoder finishes the tensor in hand and takes no more. */
static void stream_end(enc_state *es) {
    pthread_mutex_lock(&es->mu);
    es->stop = 1;
    while (es->busy)
        pthread_cond_wait(&es->cv, &es->mu);
    es->active = 0;
    pthread_mutex_unlock(&es->mu);
}

/* The compute, the encoding of what it streamed and then of the rest, and the HEAD. */
cm_status cm_chan_compute_encode_(cm_chan_server *s, worker *k, const cm_proto_request *rq,
                                  cm_chan_job *job) {
    enc_state *es = &k->es;
    encoding   e;
    CM_TRY(encode_begin(s, k, rq, &e));
    pthread_mutex_lock(&es->mu);
    memset(es->announced, 0, rq->n_layers);
    es->job = job;
    es->enc = &e;
    es->dt_set = 0;
    es->st = CM_OK;
    es->stop = 0;
    es->active = es->started; /* without the thread, announced tensors are waited for and encoded below */
    pthread_mutex_unlock(&es->mu);
    job->stream_ = es;
    cm_status st = s->cfg.compute(k->user, job);
    stream_end(es);
    job->stream_ = NULL;
    if (st == CM_OK && job->out_dtype != CM_DTYPE_F32 && job->out_dtype != s->cfg.hidden_dtype)
        st = CM_FAIL(CM_ERR_INVALID_ARG, "the compute callback returned %s; expected F32 or %s",
                     cm_dtype_name(job->out_dtype), cm_dtype_name(s->cfg.hidden_dtype));
    if (st == CM_OK && es->dt_set && es->dt != job->out_dtype)
        st = CM_FAIL(CM_ERR_INVALID_ARG, "the compute callback announced %s tensors and returned %s",
                     cm_dtype_name(es->dt), cm_dtype_name(job->out_dtype));
    if (st == CM_OK && es->st != CM_OK)
        st = CM_FAIL(es->st, "%s", es->msg);
    while (st == CM_OK && e.done < rq->n_layers) {
        if (es->announced[e.done] && job->wait)
            st = job->wait(job->wait_arg, e.done);
        if (st == CM_OK)
            st = encode_next(s, k, &e, job->out_dtype);
    }
    if (st == CM_OK)
        st = encode_finish(k, &e);
    if (st != CM_OK)
        encode_abort(k);
    return st;
}

/* The encoder thread of a worker (without one, the worker encodes after its compute). */
void cm_chan_encoder_start_(worker *k) {
    if (pthread_create(&k->es.thread, NULL, enc_main, k) == 0)
        k->es.started = 1;
    else
        CM_LOG_WARN("worker %d: no encoder thread; answers are encoded after their compute", k->index);
}

void cm_chan_encoder_stop_(worker *k) {
    if (!k->es.started)
        return;
    pthread_mutex_lock(&k->es.mu);
    k->es.quit = 1;
    pthread_cond_broadcast(&k->es.cv);
    pthread_mutex_unlock(&k->es.mu);
    pthread_join(k->es.thread, NULL);
    k->es.started = 0;
}
