/* common/chan/cm_chan_server_sched.c — the server's scheduler (loop thread): hands one task at a time
 * to each idle worker, calls (cm_chan_server_call.c) first, then NCCL joins, then jobs round-robin
 * over the sessions that have work (a session with an NCCL communicator only to the worker that
 * opened it), and sends each result when its worker is done, DATA zero-copy (ZeroMQ hands the
 * buffer back to the pool when it is on the wire). */
#include "cm_chan_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <zmq.h>

#include "cm_log.h"
#include "cm_time.h"

static void data_free(void *data, void *hint) {
    if (hint)
        atomic_store(&((pool_buf *)hint)->busy, 0);
    else
        free(data);
}

/* Hands a task to idle worker k (loop thread; the mailbox fields are the worker's once
 * have_job is set). */
static void hand_over(cm_chan_server *s, worker *k, session *ss, int kind, qjob *j) {
    work *w = &k->w;
    pthread_mutex_lock(&w->mu);
    w->kind = kind;
    if (kind == WORK_NCCL_OPEN) {
        w->offer = ss->nccl_offer;
    } else {
        cm_proto_request done = w->rq; /* the worker's last request's arrays go to the freed slot */
        w->rq = j->rq;
        j->rq = done;
        w->job_peer = ss->nccl_peer;
        k->job_id = w->rq.batch_id;
    }
    snprintf(w->session, sizeof w->session, "%s", ss->name);
    w->sess = (int)(ss - s->sessions);
    w->gen = ss->gen;
    w->have_job = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    k->busy = 1;
    k->last_call = 0;
    s->n_busy++;
    if (s->n_answering++ == 0)
        s->busy_since = cm_now_s();
}

/* The idle worker holding the fewest NCCL sessions, or NULL. */
static worker *idle_for_nccl(cm_chan_server *s) {
    worker *best = NULL;
    int     best_n = 0;
    for (int i = 0; i < s->n_workers; i++) {
        worker *k = &s->workers[i];
        if (k->busy)
            continue;
        int n = 0;
        for (uint32_t j = 0; j < s->cfg.max_sessions; j++)
            n += s->sessions[j].used && s->sessions[j].nccl_worker == i;
        if (!best || n < best_n) {
            best = k;
            best_n = n;
        }
    }
    return best;
}

void cm_chan_schedule_(cm_chan_server *s) {
    if (s->stopping || s->n_busy == s->n_workers)
        return;
    cm_chan_calls_schedule_(s, 0); /* calls first, but alternating with jobs on a worker */
    uint32_t M = s->cfg.max_sessions;
    for (uint32_t i = 0; i < M; i++) { /* communicators first: their trainers wait for nothing else */
        session *ss = &s->sessions[i];
        if (!ss->used || ss->nccl_state != NCCL_WANTED)
            continue;
        worker *k = idle_for_nccl(s);
        if (!k)
            return;
        ss->nccl_state = NCCL_OPENING;
        ss->nccl_worker = k->index;
        hand_over(s, k, ss, WORK_NCCL_OPEN, NULL);
    }
    for (int n = 0; n < s->n_workers; n++) {
        worker *k = &s->workers[n];
        if (k->busy)
            continue;
        for (uint32_t t = 1; t <= M; t++) {
            uint32_t i = (s->rr + t) % M;
            session *ss = &s->sessions[i];
            /* a session with a communicator (or one being opened) stays on its worker */
            if (!ss->used || !ss->q_len || (ss->nccl_worker >= 0 && ss->nccl_worker != n) ||
                ss->nccl_state == NCCL_WANTED)
                continue;
            qjob *j = &ss->queue[ss->q_head];
            ss->q_head = (ss->q_head + 1) % s->cfg.credits;
            ss->q_len--;
            ss->computing++;
            hand_over(s, k, ss, WORK_JOB, j);
            s->rr = i;
            break;
        }
    }
    cm_chan_calls_schedule_(s, 1); /* workers that ran a call and found no job */
}

/* The worker has joined (or failed to join) a session's NCCL communicator. */
static void nccl_opened(cm_chan_server *s, worker *k, session *ss, int live) {
    work *w = &k->w;
    if (!live) {
        cm_chan_close_peer_(s, k->index, w->peer);
        return;
    }
    if (!w->is_answer) {
        ss->nccl_state = NCCL_NONE;
        ss->nccl_worker = -1;
        CM_LOG_WARN("session '%s': cannot join its NCCL communicator: %s", ss->name, w->nccl_msg);
        cm_chan_send_error_(s, ss->ident, ss->ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                            "target-server '%s' cannot join the NCCL communicator: %s", s->name, w->nccl_msg);
        return;
    }
    ss->nccl_peer = w->peer;
    ss->nccl_state = NCCL_UP;
    uint8_t   buf[CM_PROTO_HEADER_SIZE + 8];
    size_t    len;
    cm_status st = cm_proto_nccl_ready_encode(k->device, buf, sizeof buf, &len);
    if (st == CM_OK)
        st = cm_chan_send_to_(s, ss->ident, ss->ident_len, buf, len);
    ss->last_send = cm_now_ms();
    if (st == CM_ERR_PEER_GONE)
        cm_chan_end_session_(s, ss, END_UNREACHABLE);
    else
        CM_LOG_INFO("session '%s': NCCL communicator up (server GPU %u, trainer GPU %u)", ss->name, k->device,
                    w->offer.device);
}

static void handle_done_one(cm_chan_server *s, worker *k) {
    work *w = &k->w;
    pthread_mutex_lock(&w->mu);
    int done = w->done;
    w->done = 0;
    pthread_mutex_unlock(&w->mu);
    if (!done)
        return;
    k->busy = 0;
    s->n_busy--;
    if (w->kind == WORK_CALL) {
        cm_chan_call_done_(s, k);
        return;
    }
    if (--s->n_answering == 0)
        STAT_ADD(s, busy_s, cm_now_s() - s->busy_since);
    session *ss = &s->sessions[w->sess];
    int      live = ss->used && ss->gen == w->gen;
    if (w->kind == WORK_NCCL_OPEN) {
        nccl_opened(s, k, ss, live);
        return;
    }
    if (ss->gen == w->gen && ss->computing)
        ss->computing--;
    if (!live) {
        if (w->data)
            atomic_store(&w->data->busy, 0);
        free(w->data_oneoff);
        CM_LOG_DEBUG("discarded the answer to batch %llu: its session ended", (unsigned long long)w->id);
        return;
    }
    cm_status st;
    if (w->is_answer) {
        zmq_msg_t dm;
        uint8_t  *data = w->data ? w->data->data : w->data_oneoff;
        zmq_msg_init_data(&dm, data, w->data_len, data_free, w->data);
        st = CM_OK;
        if (zmq_send(s->router, ss->ident, ss->ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
            st = zmq_errno() == EHOSTUNREACH ? CM_FAIL(CM_ERR_PEER_GONE, "the trainer is no longer connected")
                                             : CM_ZMQ(-1);
        if (st == CM_OK)
            st = CM_ZMQ(zmq_send(s->router, w->head, w->head_len, ZMQ_SNDMORE | ZMQ_DONTWAIT));
        if (st == CM_OK)
            st = CM_ZMQ(zmq_msg_send(&dm, s->router, ZMQ_DONTWAIT));
        if (st != CM_OK)
            zmq_msg_close(&dm); /* gives the buffer back */
        if (st == CM_OK) {
            uint64_t bytes = w->head_len + w->data_len;
            ss->n_answers++;
            ss->bytes += bytes;
            ss->tokens += w->n_tokens;
            pthread_mutex_lock(&s->stats_mu);
            s->stats.answers++;
            s->stats.bytes_sent += bytes;
            s->stats.tokens += w->n_tokens;
            pthread_mutex_unlock(&s->stats_mu);
        }
    } else {
        st = w->err_len ? cm_chan_send_to_(s, ss->ident, ss->ident_len, w->err, w->err_len) : CM_OK;
        if (w->err_len)
            STAT_ADD(s, errors_sent, 1);
        ss->n_errors++;
    }
    ss->last_send = cm_now_ms();
    if (st == CM_ERR_PEER_GONE)
        cm_chan_end_session_(s, ss, END_UNREACHABLE);
    else if (st != CM_OK)
        CM_LOG_WARN("session '%s': cannot send batch %llu: %s", ss->name, (unsigned long long)w->id,
                    cm_last_error());
}

void cm_chan_handle_done_(cm_chan_server *s) {
    for (int i = 0; i < s->n_workers; i++)
        handle_done_one(s, &s->workers[i]);
}
