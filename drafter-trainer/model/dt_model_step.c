/* drafter-trainer/model/dt_model_step.c — one training step: layout, upload, forward, loss, backward and
 * the step's statistics. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// step

/* The leading run of block j: the slots 1, 2, ... that have a label and predict it, the unary argmax
 * (selector 0) or DFlash2's selector with the label in the top-K and chosen (selector 1). *i is the
 * cursor into the selected rows (ascending block rows), moved on past what block j looked at. */
static int leading_run(const dt_model *m, int selector, int64_t j, int64_t *i) {
    const dt_host *h = &m->host;
    const int      B = m->cfg.block_size;
    int            run = 0;
    for (int k = 1; k < B; k++) {
        const int64_t r = j * B + k;
        while (*i < m->n_sel && h->sel_row[*i] < r)
            (*i)++;
        if (!(*i < m->n_sel && h->sel_row[*i] == r &&
              (selector ? h->lab_pos[*i] >= 0 && h->choice[*i] == h->lab_pos[*i]
                        : h->argmax[*i] == h->labels[*i])))
            break;
        run++;
    }
    return run;
}

/* τ: the mean over blocks of 1 + the leading run. */
static double leading_tau(const dt_model *m, int selector) {
    double  tau_sum = 0;
    int64_t i = 0;
    for (int64_t j = 0; j < m->n_anchors; j++)
        tau_sum += 1 + leading_run(m, selector, j, &i);
    return m->n_anchors > 0 ? tau_sum / (double)m->n_anchors : 0.0;
}

cm_status dt_model_accepted(const dt_model *m, int path, int32_t *out) {
    if (path != 0 && !(path == 1 && dt_model_is_v2(m)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "acceptance of path %d: a %s drafter has %s", path,
                       dt_model_is_v2(m) ? "DFlash2" : "DFlash",
                       dt_model_is_v2(m) ? "0 (unary argmax) and 1 (selector)" : "only 0 (unary argmax)");
    int64_t i = 0;
    for (int64_t j = 0; j < m->n_anchors; j++)
        out[j] = leading_run(m, path, j, &i);
    return CM_OK;
}

/* DFlash2: the two loss terms, recall@K and the selector's teacher-forced accuracy per slot, and τ of
 * the greedy selector path (a slot continues the run when its label is in the top-K and chosen). */
static void fill_selector_stats(const dt_model *m, dt_step_stats *s) {
    const dt_host *h = &m->host;
    const int      B = m->cfg.block_size;
    double         num = 0;
    s->loss_unary = s->loss;
    s->alpha = m->sel.alpha;
    s->sel_weight_sum = m->sel_weight_sum;
    for (int64_t i = 0; i < m->n_sel; i++) {
        const int k = h->sel_row[i] % B, in = h->lab_pos[i] >= 0;
        if (in || m->sel.miss == KN_SEL_INJECT)
            num += h->weight[i] * (double)h->sce[i];
        s->sel_in_topk[k] += in;
        s->sel_hits[k] += in && h->choice[i] == h->lab_pos[i];
    }
    s->loss_selector = m->sel_weight_sum > 0 ? num / m->sel_weight_sum : 0.0;
    s->loss = s->loss_unary + m->sel.alpha * s->loss_selector;
    s->sel_tau = leading_tau(m, 1);
}

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
    s->tau = leading_tau(m, 0);
    if (dt_model_is_v2(m))
        fill_selector_stats(m, s);
}

cm_status dt_model_step(dt_model *m, const dt_batch *b, float gamma, dt_step_stats *stats) {
    if (!(gamma > 0) || !isfinite(gamma))
        return CM_FAIL(CM_ERR_INVALID_ARG, "loss decay gamma %g must be positive and finite", (double)gamma);
    if (!m->embed || !m->lm_head)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the drafter has no frozen embedding and LM head (dt_model_set_frozen)");
    CM_TRY(dt_batch_validate(m, b));
    CM_TRY(dt_model_grads_begin(m));
    m->T = b->T;
    m->n_anchors = b->n_anchors;
    m->R = b->n_anchors * m->cfg.block_size;
    m->n_sel = 0;
    m->weight_sum = 0;
    m->sel_weight_sum = 0;
    if (m->R > 0) {
        CM_TRY(dt_model_ensure_capacity(m, m->T, m->R));
        dt_model_layout_batch(m, b, gamma);
    }
    if (m->n_sel > 0) {
        CM_TRY(dt_model_upload_batch(m, b));
        CM_TRY(dt_model_forward(m));
        CM_TRY(dt_model_backward(m)); /* which settles every gradient as it declares them final */
        CM_TRY(m->be->sync(m->ctx));
    } else { /* no backward: the gradients no product wrote are zero */
        CM_TRY(dt_model_grads_settle(m, 0));
    }
    if (stats)
        fill_stats(m, stats);
    return CM_OK;
}
