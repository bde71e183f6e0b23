/* drafter-trainer/model/dt_model_w16.c — bf16 copies of the layers' weight matrices for their GEMMs, kept
 * from the forward to the backward without memory of their own.
 *
 * With BF16 storage the GEMMs round their F32 weights to bf16 (cuda --precision bf16). Without copies
 * every GEMM rounds its weight again into the ctx scratch: the forward once per use and the backward's dx
 * products once more, 6 bytes of traffic a parameter each time. A copy made by the forward's first use
 * and read by every later use of the step saves the backward's rounding passes, and it needs no memory:
 * it lives in the gradient of a parameter whose backward comes later. Layer l's projections (q, k, v,
 * o, gate, up, down) are hosted in the gradients of layer l − 1's projections, which hold nothing from
 * the step's start (their first dW product writes them, beta 0; dt_model_grad_first) until layer
 * l − 1's backward, after layer l's; layer 0's in fc's gradient, written last of all. Each host holds 4
 * bytes a parameter, a copy takes 2, so a layer's copies fit in the layer before's gradients; a copy
 * that finds no room (layer 0's largest, fc being smaller than a layer) is rounded per call as before.
 *
 * A copy is the same nearest-even rounding the GEMM makes of an F32 operand (cast2d), so the products
 * and their bits do not change. dt_model_weight checks that the host's gradient is still unwritten
 * before it hands a copy out, so a change in the order of the backward is an error, never a silent
 * read of gradients as weights.
 *
 * The optimizer can write the copies instead (dt_optim_set_copies): its update produces the new
 * weights, and rounding them there costs 2 bytes a parameter against the forward's 6 (read 4,
 * write 2). The hosts are free then too: the update has read a gradient once it has updated that
 * parameter. So the update runs layer by layer, fc and everything without a copy first (group
 * 0), then layer l's projections (group l + 1), whose copies go into gradients of group l. The
 * next step's start keeps them (dt_model_w16_written) where it would otherwise forget them. */
#include "dt_model_int.h"

#include <stdlib.h>

#define W16_ALIGN 256 /* bytes: every copy starts on this boundary inside its host */

/* Places the copies of layer l's projections into the gradients of hosts[0 .. n_h − 1], largest
 * first, each into the first host with room. */
static void place_layer(dt_model *m, int l, const int *hosts, int n_h) {
    size_t used[LP_COUNT2] = {0};
    int    items[LP_COUNT2], n_i = 0;
    for (int j = 0; j < m->n_lp; j++)
        if (dt_lp_is_projection(j))
            items[n_i++] = P_LAYER0 + l * m->n_lp + j;
    for (int a = 1; a < n_i; a++) /* by size, descending; stable */
        for (int b = a; b > 0 && m->params[items[b]].numel > m->params[items[b - 1]].numel; b--) {
            const int t = items[b];
            items[b] = items[b - 1];
            items[b - 1] = t;
        }
    for (int a = 0; a < n_i; a++) {
        const dt_param *p = &m->params[items[a]];
        const size_t    need = (size_t)p->numel * 2;
        for (int h = 0; h < n_h; h++) {
            const size_t off = (used[h] + W16_ALIGN - 1) / W16_ALIGN * W16_ALIGN;
            const size_t cap = (size_t)m->params[hosts[h]].numel * sizeof(float);
            if (off + need <= cap) {
                m->w16[items[a]] = (char *)m->params[hosts[h]].grad + off;
                m->w16_host[items[a]] = hosts[h];
                used[h] = off + need;
                break;
            }
        }
    }
}

cm_status dt_model_w16_plan(dt_model *m) {
    m->w16 = calloc((size_t)m->n_params, sizeof *m->w16);
    m->w16_host = calloc((size_t)m->n_params, sizeof *m->w16_host);
    m->w16_made = calloc((size_t)m->n_params, 1);
    if (!m->w16 || !m->w16_host || !m->w16_made)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the drafter's weight-copy table");
    if (dt_model_gemm_op_dt(m) != CM_DTYPE_BF16)
        return CM_OK; /* F32 GEMMs: the weights are used as they are */
    for (int l = 0; l < m->cfg.n_layers; l++) {
        int hosts[LP_COUNT2], n_h = 0;
        if (l == 0) {
            hosts[n_h++] = P_FC;
        } else {
            for (int j = 0; j < m->n_lp; j++)
                if (dt_lp_is_projection(j))
                    hosts[n_h++] = P_LAYER0 + (l - 1) * m->n_lp + j;
        }
        place_layer(m, l, hosts, n_h);
    }
    return CM_OK;
}

void dt_model_w16_release(dt_model *m) {
    free(m->w16);
    free(m->w16_host);
    free(m->w16_made);
    m->w16 = NULL;
    m->w16_host = NULL;
    m->w16_made = NULL;
}

void dt_model_w16_begin(dt_model *m) {
    for (int i = 0; i < m->n_params; i++)
        m->w16_made[i] = m->w16_written && m->w16[i];
    m->w16_written = 0; /* the hosts hold gradients again after this step's backward */
}

int dt_model_w16_targets(const dt_model *m, uint16_t **dst, int *group) {
    int n = 0;
    for (int i = 0; i < m->n_params; i++) {
        dst[i] = m->w16[i];
        group[i] = m->w16[i] ? 1 + (i - P_LAYER0) / m->n_lp : 0; /* only layer projections have copies */
        n += m->w16[i] != NULL;
    }
    return n;
}

void dt_model_w16_written(dt_model *m) {
    m->w16_written = 1;
}

cm_status dt_model_weight(dt_model *m, const dt_param *p, const void **w, cm_dtype *dt) {
    const ptrdiff_t i = p - m->params;
    if (!m->w16[i] || dt_model_gemm_op_dt(m) != CM_DTYPE_BF16) { /* none, or F32 storage set since */
        *w = p->data;
        *dt = CM_DTYPE_F32;
        return CM_OK;
    }
    if (!m->grad_unset[m->w16_host[i]])
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "the bf16 copy of %s lives in the gradient of %s, which this step has already "
                       "written (the backward's order changed; see dt_model_w16.c)",
                       p->name, m->params[m->w16_host[i]].name);
    if (!m->w16_made[i]) {
        CM_TRY(m->be->cast2d(m->ctx, m->w16[i], CM_DTYPE_BF16, p->numel, p->data, CM_DTYPE_F32, p->numel, 1,
                             p->numel));
        m->w16_made[i] = 1;
    }
    *w = m->w16[i];
    *dt = CM_DTYPE_BF16;
    return CM_OK;
}
