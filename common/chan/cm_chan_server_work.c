/* common/chan/cm_chan_server_work.c — the server's worker threads (created and started by
 * cm_chan_server.c, fed by the scheduler, cm_chan_server_sched.c; the encoding is in
 * cm_chan_server_enc.c). Each worker (a model replica: cfg.n_workers) runs the init callback
 * once, then one task at a time: runs the compute callback on the REQUEST the loop decoded, into
 * the worker's output buffers and has the answer encoded (or joins an NCCL communicator, or runs
 * a cm_chan_server_call), then posts the result to the loop through a pipe. Nothing here
 * touches the ROUTER, so the loop stays its only user. */
#include "cm_chan_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

// ----------------------------------------------------------------------------
// the worker

static void notify_loop(cm_chan_server *s) {
    char b = 1;
    while (write(s->pipe_w, &b, 1) < 0 && errno == EINTR) {
    }
}

static cm_status ensure_out(worker *k, uint32_t L, size_t TD) {
    size_t need = (size_t)L * TD;
    if (need > k->out_cap) {
        if (k->out_pinned && k->s->cfg.host_unlock)
            k->s->cfg.host_unlock(k->user, k->out_block);
        k->out_pinned = 0;
        free(k->out_block);
        k->out_block = malloc(need * sizeof(float));
        k->out_cap = k->out_block ? need : 0;
        if (!k->out_block)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for the captured layers", need * 4);
    }
    for (uint32_t i = 0; i < L; i++)
        k->out_ptrs[i] = k->out_block + (size_t)i * TD;
    return CM_OK;
}

/* The worker's output buffers at their largest, page-locked through cfg.host_lock (then the
 * compute's device-to-host copies into them run at full speed and no job allocates them). */
static void prepare_out(worker *k) {
    const cm_chan_server_config *c = &k->s->cfg;
    if (!c->host_lock)
        return;
    size_t TD = (size_t)c->max_tokens * c->hidden_size;
    if (ensure_out(k, c->max_req_layers, TD) != CM_OK) {
        CM_LOG_WARN("worker %d: %s; output buffers are allocated per request instead", k->index,
                    cm_last_error());
        return;
    }
    if (c->host_lock(k->user, k->out_block, k->out_cap * sizeof(float)) == CM_OK)
        k->out_pinned = 1;
    else
        CM_LOG_WARN("worker %d: cannot page-lock %zu MB of output buffers (%s); they stay pageable", k->index,
                    k->out_cap * sizeof(float) >> 20, cm_last_error());
}

static void worker_process(cm_chan_server *s, worker *k) {
    work                   *w = &k->w;
    const cm_proto_request *rq = &w->rq; /* decoded and checked by the loop (cm_chan_on_request_) */
    w->is_answer = 0;
    w->data = NULL;
    w->data_oneoff = NULL;
    w->id = rq->batch_id;
    w->n_tokens = rq->n_tokens;
    cm_chan_job job = {.session = w->session,
                       .req = rq,
                       .hidden_size = s->cfg.hidden_size,
                       .out = (void *const *)k->out_ptrs,
                       .out_dtype = CM_DTYPE_F32,
                       .nccl = rq->encoding == CM_ENCODING_NCCL ? w->job_peer : NULL,
                       .worker = k->index};
    cm_status   st = CM_OK;
    if (rq->encoding == CM_ENCODING_NCCL && !job.nccl)
        st = CM_FAIL(CM_ERR_INVALID_ARG, "batch %llu asks for encoding nccl before NCCL_READY",
                     (unsigned long long)rq->batch_id);
    if (st == CM_OK && !job.nccl)
        st = ensure_out(k, rq->n_layers, (size_t)rq->n_tokens * s->cfg.hidden_size);
    int64_t t0 = cm_now_ms();
    if (st == CM_OK && job.nccl) {
        st = s->cfg.compute(k->user, &job);
        if (st == CM_OK)
            st = cm_chan_encode_nccl_head_(s, k, rq);
    } else if (st == CM_OK) {
        st = cm_chan_compute_encode_(s, k, rq, &job);
    }
    int bad_request = st == CM_ERR_INVALID_ARG;
    if (st == CM_OK) {
        w->is_answer = 1;
        CM_LOG_DEBUG("batch %llu of '%s' on worker %d: %u tokens, %u layers in %lld ms, %zu bytes",
                     (unsigned long long)rq->batch_id, w->session, k->index, rq->n_tokens, rq->n_layers,
                     (long long)(cm_now_ms() - t0), w->head_len + w->data_len);
        return;
    }
    cm_proto_error e = {.batch_id = rq->batch_id,
                        .code = bad_request ? CM_PROTO_ERROR_BAD_REQUEST : CM_PROTO_ERROR_INTERNAL};
    cm_chan_error_text(e.message, cm_last_error());
    if (!bad_request)
        CM_LOG_WARN("batch %llu of '%s' failed: %s", (unsigned long long)rq->batch_id, w->session,
                    cm_last_error());
    if (cm_proto_error_encode(&e, w->err, sizeof w->err, &w->err_len) != CM_OK)
        w->err_len = 0;
}

/* Closes the NCCL peers of ended sessions (queued by the loop with cm_chan_close_peer_). */
static void close_peers(worker *k) {
    work *w = &k->w;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        void *p = w->n_closing ? w->closing[--w->n_closing] : NULL;
        pthread_mutex_unlock(&w->mu);
        if (!p)
            return;
        k->s->cfg.nccl->close(k->user, p);
    }
}

void cm_chan_close_peer_(cm_chan_server *s, int index, void *peer) {
    if (!peer || index < 0 || index >= s->n_workers)
        return;
    worker *k = &s->workers[index];
    work   *w = &k->w;
    pthread_mutex_lock(&w->mu);
    if (w->n_closing < 2 * s->cfg.max_sessions + 2) {
        w->closing[w->n_closing++] = peer;
        peer = NULL;
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    if (peer) /* cannot happen (a peer per session, one more opening); close here rather than leak */
        s->cfg.nccl->close(k->user, peer);
}

void *cm_chan_worker_main_(void *arg) {
    worker         *k = arg;
    cm_chan_server *s = k->s;
    work           *w = &k->w;
    cm_status       st = s->cfg.init ? s->cfg.init(k->user) : CM_OK;
    if (st == CM_OK) {
        prepare_out(k);
        cm_chan_encoder_start_(k);
    }
    pthread_mutex_lock(&w->mu);
    w->init_done = 1;
    w->init_status = st;
    if (st != CM_OK)
        snprintf(w->init_msg, sizeof w->init_msg, "%s", cm_last_error());
    pthread_mutex_unlock(&w->mu);
    notify_loop(s);
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->have_job && !w->quit && !w->n_closing)
            pthread_cond_wait(&w->cv, &w->mu);
        int quit = w->quit && !w->have_job;
        pthread_mutex_unlock(&w->mu);
        close_peers(k);
        if (quit || st != CM_OK)
            break;
        pthread_mutex_lock(&w->mu);
        int have = w->have_job;
        pthread_mutex_unlock(&w->mu);
        if (!have)
            continue;
        if (w->kind == WORK_NCCL_OPEN) {
            w->peer = NULL;
            cm_status ost = s->cfg.nccl->open(k->user, &w->offer, &w->peer);
            if (ost != CM_OK) {
                cm_chan_error_text(w->nccl_msg, cm_last_error());
                w->peer = NULL;
            }
            w->is_answer = ost == CM_OK;
        } else if (w->kind == WORK_CALL) {
            cm_chan_call_run_(k);
        } else {
            worker_process(s, k);
        }
        pthread_mutex_lock(&w->mu);
        w->have_job = 0;
        w->done = 1;
        pthread_mutex_unlock(&w->mu);
        notify_loop(s);
    }
    pthread_mutex_lock(&w->mu);
    if (w->have_job) /* handed over before init failed: never run */
        w->have_job = 0;
    pthread_mutex_unlock(&w->mu);
    close_peers(k);
    cm_chan_encoder_stop_(k);
    if (k->out_pinned && s->cfg.host_unlock) /* before fini: the unlock may need the user's state */
        s->cfg.host_unlock(k->user, k->out_block);
    k->out_pinned = 0;
    if (s->cfg.fini)
        s->cfg.fini(k->user);
    return NULL;
}
