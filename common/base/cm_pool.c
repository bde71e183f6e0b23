/* common/base/cm_pool.c — the worker pool of cm_pool.h: the threads sleep on a condition
 * variable until a new job (a generation count) is posted, run items until the counter
 * passes n or a failure raises the abort flag, and the last one to finish wakes the caller,
 * who ran items too. */
#include "cm_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct pool_worker {
    cm_pool  *pool;
    pthread_t thread;
    int       started;
    cm_status st; /* this worker's failure in the current job */
    int64_t   fail_item;
} pool_worker;

struct cm_pool {
    pool_worker    *w;
    int             n_workers;
    pthread_mutex_t mu;
    pthread_cond_t  go, done;
    int             sync_ok;
    uint64_t        gen;
    int             pending, quit;
    /* the current job */
    cm_pool_fn   fn;
    void        *ctx;
    int64_t      n_items;
    atomic_llong next;
    atomic_int   abort;
};

static void run_items(cm_pool *p, int k) {
    pool_worker *w = &p->w[k];
    for (;;) {
        if (atomic_load(&p->abort))
            break;
        int64_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n_items)
            break;
        cm_status st = p->fn(p->ctx, k, i);
        if (st != CM_OK) {
            w->st = st;
            w->fail_item = i;
            atomic_store(&p->abort, 1);
            break;
        }
    }
}

static void *worker_main(void *arg) {
    pool_worker *w = arg;
    cm_pool     *p = w->pool;
    uint64_t     seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->quit)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->quit)
            break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        run_items(p, (int)(w - p->w));
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

cm_status cm_pool_run(cm_pool *p, cm_pool_fn fn, void *ctx, int64_t n, int *failed) {
    for (int k = 0; k < p->n_workers; k++)
        p->w[k].st = CM_OK;
    p->fn = fn;
    p->ctx = ctx;
    p->n_items = n;
    atomic_store(&p->next, 0);
    atomic_store(&p->abort, 0);
    if (p->n_workers > 1 && n > 1) {
        pthread_mutex_lock(&p->mu);
        p->pending = p->n_workers - 1;
        p->gen++;
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
        run_items(p, 0);
        pthread_mutex_lock(&p->mu);
        while (p->pending)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    } else {
        run_items(p, 0);
    }
    int bad = -1;
    for (int k = 0; k < p->n_workers; k++)
        if (p->w[k].st != CM_OK && (bad < 0 || p->w[k].fail_item < p->w[bad].fail_item))
            bad = k;
    if (bad < 0)
        return CM_OK;
    *failed = bad;
    return p->w[bad].st;
}

void cm_pool_destroy(cm_pool **pp) {
    if (!pp || !*pp)
        return;
    cm_pool *p = *pp;
    if (p->sync_ok) {
        pthread_mutex_lock(&p->mu);
        p->quit = 1;
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
    }
    for (int k = 0; p->w && k < p->n_workers; k++)
        if (p->w[k].started)
            pthread_join(p->w[k].thread, NULL);
    if (p->sync_ok) {
        pthread_cond_destroy(&p->go);
        pthread_cond_destroy(&p->done);
        pthread_mutex_destroy(&p->mu);
    }
    free(p->w);
    free(p);
    *pp = NULL;
}

cm_status cm_pool_create(cm_pool **out, int n_threads, const char *what) {
    cm_status st = CM_OK;
    cm_pool  *p = NULL;
    *out = NULL;
    if (n_threads < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%s: %d threads, at least 1", what, n_threads);
    p = calloc(1, sizeof *p);
    if (!p)
        return CM_FAIL(CM_ERR_NOMEM, "%s: out of memory", what);
    p->n_workers = n_threads;
    p->w = calloc((size_t)n_threads, sizeof *p->w);
    if (!p->w) {
        st = CM_FAIL(CM_ERR_NOMEM, "%s: out of memory", what);
        goto fail;
    }
    if (pthread_mutex_init(&p->mu, NULL)) {
        st = CM_FAIL(CM_ERR_NOMEM, "%s: cannot create a mutex", what);
        goto fail;
    }
    if (pthread_cond_init(&p->go, NULL)) {
        pthread_mutex_destroy(&p->mu);
        st = CM_FAIL(CM_ERR_NOMEM, "%s: cannot create a condition variable", what);
        goto fail;
    }
    if (pthread_cond_init(&p->done, NULL)) {
        pthread_cond_destroy(&p->go);
        pthread_mutex_destroy(&p->mu);
        st = CM_FAIL(CM_ERR_NOMEM, "%s: cannot create a condition variable", what);
        goto fail;
    }
    p->sync_ok = 1;
    for (int k = 0; k < n_threads; k++)
        p->w[k].pool = p;
    for (int k = 1; k < n_threads; k++) {
        int e = pthread_create(&p->w[k].thread, NULL, worker_main, &p->w[k]);
        if (e) {
            st = CM_FAIL(CM_ERR_NOMEM, "%s: cannot start worker thread %d of %d: %s", what, k, n_threads,
                         strerror(e));
            goto fail;
        }
        p->w[k].started = 1;
    }
    *out = p;
    return CM_OK;
fail:
    cm_pool_destroy(&p);
    return st;
}

int cm_pool_cpu_threads(int cap) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c < 1 ? 1 : c > cap ? (cap < 1 ? 1 : cap) : (int)c;
}
