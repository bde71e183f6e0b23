/* drafter-trainer/cmd/dt_train_random.c — the random frozen matrices of `train --target-init
 * random`, drawn in blocks of rows on a pool of the host's threads (2 × 1.27 G values at the
 * 27B shape took about a minute on one thread). */
#include "dt_train_random.h"

#include <stdlib.h>

#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_pool.h"
#include "cm_rng.h"

enum { BLOCK_ROWS = 256 };

typedef struct draw {
    uint64_t  seed;
    int64_t   V, D, n_blocks;
    uint16_t *m[2];
} draw;

static cm_status draw_block(void *ctx, int worker, int64_t item) {
    (void)worker;
    const draw   *d = ctx;
    const int     k = (int)(item / d->n_blocks);
    const int64_t b = item % d->n_blocks;
    const int64_t r0 = b * BLOCK_ROWS, r1 = r0 + BLOCK_ROWS < d->V ? r0 + BLOCK_ROWS : d->V;
    cm_rng        g;
    cm_rng_seed_stream(&g, d->seed ^ 0x66726f7a656eull, (uint64_t)k, (uint64_t)b); /* "frozen" */
    uint16_t *p = d->m[k] + r0 * d->D;
    for (int64_t i = 0, n = (r1 - r0) * d->D; i < n; i++)
        p[i] = cm_f32_to_bf16(0.0346f * (2.0f * (float)cm_rng_uniform(&g) - 1.0f));
    return CM_OK;
}

cm_status dt_random_frozen(uint64_t seed, int64_t V, int64_t D, uint16_t *out[2]) {
    draw d = {.seed = seed, .V = V, .D = D, .n_blocks = (V + BLOCK_ROWS - 1) / BLOCK_ROWS};
    out[0] = out[1] = NULL;
    const size_t n = (size_t)V * (size_t)D;
    for (int k = 0; k < 2; k++)
        if (!(d.m[k] = malloc(n * sizeof *d.m[k]))) {
            free(d.m[0]);
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a random [%lld, %lld] frozen matrix", (long long)V,
                           (long long)D);
        }
    int       failed = 0;
    cm_pool  *pool = NULL;
    cm_status st = cm_pool_create(&pool, cm_pool_cpu_threads(32), "the random frozen matrices");
    if (st == CM_OK)
        st = cm_pool_run(pool, draw_block, &d, 2 * d.n_blocks, &failed);
    cm_pool_destroy(&pool);
    if (st != CM_OK) {
        free(d.m[0]);
        free(d.m[1]);
        return st;
    }
    out[0] = d.m[0];
    out[1] = d.m[1];
    return CM_OK;
}
