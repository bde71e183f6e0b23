/* tests/tst_dt.h — what the drafter-model tests share: every gradient of a dt_model in one host array.
 * Header-only; include after tst.h. */
#ifndef TST_DT_H
#define TST_DT_H

#include <stdlib.h>

#include "dt_model.h"
#include "tst.h"

/* Every parameter's gradient, in parameter order, downloaded into one malloc'd array of *total floats
 * (caller frees). */
static inline float *tst_dt_grads(const dt_model *m, const kn_backend *be, kn_ctx *ctx, int64_t *total) {
    *total = 0;
    for (int i = 0; i < dt_model_n_params(m); i++)
        *total += dt_model_param(m, i)->numel;
    float  *g = malloc((size_t)*total * sizeof *g);
    int64_t off = 0;
    for (int i = 0; g && i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        TST_CHECK(be->download(ctx, g + off, p->grad, (size_t)p->numel * sizeof *g) == CM_OK);
        off += p->numel;
    }
    return g;
}

#endif /* TST_DT_H */
