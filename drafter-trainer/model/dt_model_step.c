/* drafter-trainer/model/dt_model_step.c — one training step: layout, upload, forward, loss, backward and
 * the step's statistics. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// step

static void fill_stats(const dt_model *m, dt_step_stats *s) {
    const dt_host *h = &m->host;
    const int      B = m->cfg.block_size;
    memset(s, 0, sizeof *s);
    s->weight_sum = m->weight_sum;
    s->n_blocks = m->n_anchors;
    double num = 0;
    for (int64_t i = 0; i < m->n_sel; i++) {
        const int k = h->sel_row[i] % B, hit = h->argmax[i] == h->labels[i];
        num += h->weight[i] * (double)h->ce[i];
        s->acc_count[k]++;
        s->acc_hits[k] += hit;
    }
    s->loss = m->n_sel > 0 ? num / m->weight_sum : 0.0;
    /* τ: 1 + the leading run of slots 1, 2, ... that have a label and predict it */
    double  tau_sum = 0;
    int64_t i = 0;
    for (int64_t j = 0; j < m->n_anchors; j++) {
        int run = 0, alive = 1;
        for (int k = 1; k < B; k++) {
            const int64_t r = j * B + k;
            while (i < m->n_sel && h->sel_row[i] < r)
                i++;
            alive = alive && i < m->n_sel && h->sel_row[i] == r && h->argmax[i] == h->labels[i];
            run += alive;
        }
        tau_sum += 1 + run;
    }
    s->tau = m->n_anchors > 0 ? tau_sum / (double)m->n_anchors : 0.0;
}

cm_status dt_model_step(dt_model *m, const dt_batch *b, float gamma, dt_step_stats *stats) {
    if (!(gamma > 0) || !isfinite(gamma))
        return CM_FAIL(CM_ERR_INVALID_ARG, "loss decay gamma %g must be positive and finite", (double)gamma);
    if (!m->embed || !m->lm_head)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the drafter has no frozen embedding and LM head (dt_model_set_frozen)");
    CM_TRY(dt_batch_validate(m, b));
    CM_TRY(dt_model_dev_zero(m, m->grad_base, (int64_t)m->n_slab));
    m->T = b->T;
    m->n_anchors = b->n_anchors;
    m->R = b->n_anchors * m->cfg.block_size;
    m->n_sel = 0;
    m->weight_sum = 0;
    if (m->R > 0) {
        CM_TRY(dt_model_ensure_capacity(m, m->T, m->R));
        dt_model_layout_batch(m, b, gamma);
    }
    if (m->n_sel > 0) {
        CM_TRY(dt_model_upload_batch(m, b));
        CM_TRY(dt_model_forward(m));
        CM_TRY(dt_model_backward(m));
        CM_TRY(m->be->sync(m->ctx));
    }
    if (stats)
        fill_stats(m, stats);
    return CM_OK;
}
