/* common/base/cm_pool.h — a fixed pool of worker threads that runs one job at a time: fn(ctx,
 * worker, item) for every item in [0, n). Every worker, the calling thread among them
 * (worker 0), takes items from one atomic counter, so the split of items over workers varies
 * from run to run: a job whose result must not depend on it gives each item its own output.
 * The first failure stops the handing out of items. A cm_pool runs jobs for one thread at a
 * time. */
#ifndef CM_POOL_H
#define CM_POOL_H

#include <stdint.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cm_pool cm_pool;

/* One item of a job, run by worker `worker` in [0, n_threads). Returns CM_OK or a failure;
 * the pool records no message, so fn keeps its own per worker. */
typedef cm_status (*cm_pool_fn)(void *ctx, int worker, int64_t item);

/* Starts n_threads − 1 threads (n_threads >= 1); `what` names the owner in error messages.
 * Caller destroys with cm_pool_destroy. */
cm_status cm_pool_create(cm_pool **out, int n_threads, const char *what);
void      cm_pool_destroy(cm_pool **pool); /* NULL-safe: stops and joins the threads; sets *pool = NULL */
/* Runs fn over items [0, n) on every worker (on the caller's thread alone when n < 2) and
 * waits for all. CM_OK, or the status fn returned for the lowest failed item seen, with
 * *failed set to the worker that ran it. */
cm_status cm_pool_run(cm_pool *pool, cm_pool_fn fn, void *ctx, int64_t n, int *failed);

/* The host's online CPUs, within [1, cap]: a pool size for work that scales with cores. */
int cm_pool_cpu_threads(int cap);

#ifdef __cplusplus
}
#endif
#endif /* CM_POOL_H */
