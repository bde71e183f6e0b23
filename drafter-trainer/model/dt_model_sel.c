/* drafter-trainer/model/dt_model_sel.c — DFlash2's candidate selector term of the loss
 * (docs/drafter.md): after the unary LM-head pass has taken each selected row's top-K, the selector
 * scores those candidates given the true previous token (teacher forcing), its K-way cross-entropy
 * is weighted by the unary slot weights over the slots in the term, and its gradient goes into the
 * two codebooks (only the rows named), the hidden projection and, unless stopped, the drafter's
 * final-normed hidden states. One host round trip: the label positions and CE come down so the
 * host can weigh the term (a label outside the top-K is injected at rank K or drops the slot).
 * The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <string.h>

cm_status dt_model_selector(dt_model *m, const float *hsel, float *dhsel) {
    const kn_backend     *be = m->be;
    const cm_drafter_cfg *g = &m->cfg;
    dt_acts              *a = &m->acts;
    dt_host              *h = &m->host;
    const int64_t         n = m->n_sel, D = g->hidden_size, Rk = g->selector_rank;
    dt_param *P = &m->params[m->p_sel + SP_PRED], *S = &m->params[m->p_sel + SP_SUCC];
    dt_param *Wh = &m->params[m->p_sel + SP_HPROJ];
    CM_TRY(dt_model_mm_fwd(m, a->su, CM_DTYPE_F32, hsel, CM_DTYPE_F32, Wh, n, Rk, D)); /* u = h·W_hᵀ */
    kn_selector_params sp = {.n = n, .V = m->V, .K = g->selector_top_k, .Rk = (int)Rk, .D = (int)D,
                             .miss = m->sel.miss, .topk_idx = a->topk_idx, .topk_val = a->topk_val,
                             .label_logit = a->lab_logit, .labels = a->labels, .pred = a->pred, .u = a->su,
                             .P = P->data, .S = S->data, .cand = a->cand, .score = a->score, .ce = a->sce,
                             .lab_pos = a->lab_pos, .choice = a->choice};
    CM_TRY(be->selector_fwd(m->ctx, &sp));
    CM_TRY(be->download(m->ctx, h->sce, a->sce, (size_t)n * sizeof(float)));
    CM_TRY(be->download(m->ctx, h->lab_pos, a->lab_pos, (size_t)n * sizeof(int32_t)));
    CM_TRY(be->download(m->ctx, h->choice, a->choice, (size_t)n * sizeof(int32_t)));
    /* the term's weights: every trained slot (inject), or those whose label is in the top-K (drop) */
    double sw = 0;
    for (int64_t i = 0; i < n; i++)
        if (m->sel.miss == KN_SEL_INJECT || h->lab_pos[i] >= 0)
            sw += h->weight[i];
    m->sel_weight_sum = sw;
    if (!(m->sel.alpha > 0) || !(sw > 0))
        return CM_OK; /* scored for the metrics; nothing flows back */
    for (int64_t i = 0; i < n; i++) {
        const int kept = m->sel.miss == KN_SEL_INJECT || h->lab_pos[i] >= 0;
        h->sgs[i] = kept ? (float)(m->sel.alpha * h->weight[i] / sw) : 0.0f;
    }
    CM_TRY(be->upload(m->ctx, a->sgs, h->sgs, (size_t)n * sizeof(float)));
    sp.gscale = a->sgs;
    sp.w = m->lm_head;
    sp.wdt = m->lm_head_dt;
    sp.dh = m->sel.stop_grad ? NULL : dhsel;
    sp.du = a->sdu;
    sp.dP = P->grad;
    sp.dS = S->grad;
    CM_TRY(be->selector_bwd(m->ctx, &sp));
    CM_TRY(dt_model_mm_dw(m, Wh, a->sdu, CM_DTYPE_F32, hsel, CM_DTYPE_F32, n, Rk, D));
    if (!m->sel.stop_grad)
        CM_TRY(dt_model_mm_dx(m, dhsel, CM_DTYPE_F32, a->sdu, CM_DTYPE_F32, Wh, n, Rk, D, 1));
    return CM_OK;
}
