/* tests/test_cm_pool.c — cm_pool: every item runs exactly once whatever the thread count, on
 * workers in range; an empty or one-item job runs on the caller alone; a failure reports the
 * status and worker of the lowest failed item; the pool runs job after job. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "cm_pool.h"
#include "tst.h"

#define N_ITEMS 10000

typedef struct job {
    atomic_int runs[N_ITEMS];
    atomic_int bad_worker;
    int        n_threads;
    int64_t    fail_from; /* items >= fail_from fail; -1: none */
} job;

static cm_status count_item(void *ctx, int worker, int64_t i) {
    job *j = ctx;
    if (worker < 0 || worker >= j->n_threads)
        atomic_store(&j->bad_worker, 1);
    atomic_fetch_add(&j->runs[i], 1);
    if (j->fail_from >= 0 && i >= j->fail_from)
        return i == j->fail_from ? CM_ERR_FORMAT : CM_ERR_IO;
    return CM_OK;
}

static void test_every_item_once(int n_threads) {
    cm_pool *p = NULL;
    if (!tst_ok(cm_pool_create(&p, n_threads, "test"), "cm_pool_create"))
        return;
    static job j;
    for (int rep = 0; rep < 3; rep++) { /* the same pool, job after job */
        memset(&j, 0, sizeof j);
        j.n_threads = n_threads;
        j.fail_from = -1;
        int failed = -7;
        TST_CHECK(cm_pool_run(p, count_item, &j, N_ITEMS, &failed) == CM_OK);
        TST_CHECK(failed == -7); /* untouched on success */
        int once = 1;
        for (int i = 0; i < N_ITEMS; i++)
            once &= atomic_load(&j.runs[i]) == 1;
        TST_CHECK(once);
        TST_CHECK(!atomic_load(&j.bad_worker));
    }
    memset(&j, 0, sizeof j);
    j.n_threads = n_threads;
    j.fail_from = -1;
    int failed = 0;
    TST_CHECK(cm_pool_run(p, count_item, &j, 0, &failed) == CM_OK);
    TST_CHECK(cm_pool_run(p, count_item, &j, 1, &failed) == CM_OK);
    TST_CHECK(atomic_load(&j.runs[0]) == 1 && atomic_load(&j.runs[1]) == 0);
    cm_pool_destroy(&p);
    TST_CHECK(p == NULL);
}

static void test_failure(int n_threads) {
    cm_pool *p = NULL;
    if (!tst_ok(cm_pool_create(&p, n_threads, "test"), "cm_pool_create"))
        return;
    static job j;
    memset(&j, 0, sizeof j);
    j.n_threads = n_threads;
    j.fail_from = 100; /* item 100 fails with FORMAT, later ones (if reached) with IO */
    int failed = -1;
    TST_CHECK(cm_pool_run(p, count_item, &j, N_ITEMS, &failed) == CM_ERR_FORMAT);
    TST_CHECK(failed >= 0 && failed < n_threads);
    int ran_first = 1;
    for (int i = 0; i <= 100; i++)
        ran_first &= atomic_load(&j.runs[i]) <= 1;
    TST_CHECK(ran_first && atomic_load(&j.runs[100]) == 1);
    /* a failed job leaves the pool usable */
    memset(&j, 0, sizeof j);
    j.n_threads = n_threads;
    j.fail_from = -1;
    TST_CHECK(cm_pool_run(p, count_item, &j, N_ITEMS, &failed) == CM_OK);
    cm_pool_destroy(&p);
}

int main(void) {
    cm_pool *p = NULL;
    TST_CHECK(cm_pool_create(&p, 0, "test") == CM_ERR_INVALID_ARG && p == NULL);
    cm_pool_destroy(&p); /* NULL-safe */
    cm_pool_destroy(NULL);
    for (int t = 1; t <= 8; t *= 2) {
        test_every_item_once(t);
        test_failure(t);
    }
    return tst_report();
}
