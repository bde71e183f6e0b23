/* common/chan/cm_chan_server_call.c — cm_chan_server_call (cm_chan.h): other work on a worker's model
 * replica (a decoding step from cm_dec, say), run on that worker's thread between its jobs, so the
 * replica stays one thread's. The caller queues a chan_call on its own stack and wakes the loop
 * through the worker pipe; the loop hands the call to the worker as soon as the worker is idle
 * (before the next job, except that a worker whose last task was a call takes a waiting job first,
 * so a stream of calls does not starve the trainers); the worker runs it and posts the result like
 * a job's; the loop completes the call, which releases the caller. A call that never runs (the
 * server stops, or a worker failed its init) is completed with CM_ERR_PEER_GONE. */
#include "cm_chan_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "cm_log.h"

/* Completes a call that never ran with st (under s->call_mu) and releases its caller. */
static void fail_locked(cm_chan_server *s, chan_call *c, cm_status st, const char *why) {
    c->st = st;
    snprintf(c->msg, sizeof c->msg, "%s", why);
    c->state = CALL_DONE;
    pthread_cond_broadcast(&s->call_cv);
}

cm_status cm_chan_server_call(cm_chan_server *s, int wi, cm_status (*fn)(void *user, void *arg), void *arg) {
    if (!s || !fn)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server_call: no server or no function");
    if (wi < 0 || wi >= s->n_workers)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server_call: worker %d: the server has workers 0 to %d",
                       wi, s->n_workers - 1);
    chan_call c = {.worker = wi, .fn = fn, .arg = arg, .state = CALL_QUEUED, .st = CM_OK};
    pthread_t self = pthread_self();
    pthread_mutex_lock(&s->call_mu);
    if (!s->calls_open) {
        pthread_mutex_unlock(&s->call_mu);
        return CM_FAIL(CM_ERR_PEER_GONE, "cm_chan_server_call: the server is not running (or is stopping)");
    }
    /* the loop and the workers wait for nothing but their own work: a call from them would never run */
    int own = pthread_equal(self, s->loop_thread) ? 0 : -1;
    for (int i = 0; own < 0 && i < s->n_workers; i++)
        if (pthread_equal(self, s->workers[i].thread))
            own = i + 1;
    if (own >= 0) {
        pthread_mutex_unlock(&s->call_mu);
        if (own == 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server_call from the server's loop thread");
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server_call from worker %d's own thread (a callback)",
                       own - 1);
    }
    chan_call **tail = &s->calls;
    while (*tail)
        tail = &(*tail)->next;
    *tail = &c;
    pthread_mutex_unlock(&s->call_mu);
    char b = 2; /* wakes the loop; a full pipe means a wake-up is pending anyway */
    while (write(s->pipe_w, &b, 1) < 0 && errno == EINTR) {
    }
    pthread_mutex_lock(&s->call_mu);
    while (c.state != CALL_DONE)
        pthread_cond_wait(&s->call_cv, &s->call_mu);
    pthread_mutex_unlock(&s->call_mu);
    if (c.st != CM_OK)
        return CM_FAIL(c.st, "%s", c.msg);
    return CM_OK;
}

void cm_chan_calls_open_(cm_chan_server *s) {
    pthread_mutex_lock(&s->call_mu);
    s->loop_thread = pthread_self();
    s->calls_open = 1;
    pthread_mutex_unlock(&s->call_mu);
}

void cm_chan_calls_close_(cm_chan_server *s, const char *why, int joined) {
    pthread_mutex_lock(&s->call_mu);
    s->calls_open = 0;
    while (s->calls) {
        chan_call *c = s->calls;
        s->calls = c->next;
        fail_locked(s, c, CM_ERR_PEER_GONE, why);
    }
    /* after the join: a worker that quit (its init failed) before running the call it was handed */
    for (int i = 0; joined && i < s->n_workers; i++) {
        worker *k = &s->workers[i];
        if (k->busy && k->w.kind == WORK_CALL && k->w.call) {
            fail_locked(s, k->w.call, CM_ERR_PEER_GONE, why);
            k->w.call = NULL;
            k->busy = 0;
            s->n_busy--;
        }
    }
    pthread_mutex_unlock(&s->call_mu);
}

void cm_chan_calls_schedule_(cm_chan_server *s, int after_call) {
    pthread_mutex_lock(&s->call_mu);
    for (chan_call **pp = &s->calls; *pp;) {
        chan_call *c = *pp;
        worker    *k = &s->workers[c->worker];
        if (k->busy || (k->last_call && !after_call)) {
            pp = &c->next;
            continue;
        }
        *pp = c->next;
        c->next = NULL;
        c->state = CALL_RUNNING;
        work *w = &k->w;
        pthread_mutex_lock(&w->mu);
        w->kind = WORK_CALL;
        w->call = c;
        w->have_job = 1;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        k->busy = 1;
        k->last_call = 1;
        s->n_busy++;
    }
    pthread_mutex_unlock(&s->call_mu);
}

void cm_chan_call_done_(cm_chan_server *s, worker *k) {
    pthread_mutex_lock(&s->call_mu);
    if (k->w.call) { /* st and msg are the worker's (cm_chan_call_run_) */
        k->w.call->state = CALL_DONE;
        pthread_cond_broadcast(&s->call_cv);
    }
    k->w.call = NULL;
    pthread_mutex_unlock(&s->call_mu);
}

void cm_chan_call_run_(worker *k) {
    chan_call *c = k->w.call;
    cm_clear_error();
    c->st = c->fn(k->user, c->arg);
    if (c->st != CM_OK)
        snprintf(c->msg, sizeof c->msg, "%s", cm_last_error());
    CM_LOG_DEBUG("worker %d ran a call: %s", k->index, cm_status_str(c->st));
}
