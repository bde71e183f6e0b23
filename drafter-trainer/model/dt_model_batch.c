/* drafter-trainer/model/dt_model_batch.c — a batch: validation, the host-side block layout (labels,
 * weights, positions) and its upload to the backend. The design: dt_model_int.h. */
#include "dt_model_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// batch validation and layout

cm_status dt_batch_validate(const dt_model *m, const dt_batch *b) {
    if (!b)
        return CM_FAIL(CM_ERR_INVALID_ARG, "no batch given");
    if (b->T < 1 || b->T > INT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch has %lld tokens; expected 1 to %d", (long long)b->T,
                       INT32_MAX);
    if (b->n_seq < 1 || b->n_seq > b->T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch has %d sequences for %lld tokens; expected 1 to T",
                       b->n_seq, (long long)b->T);
    if (!b->cu_seqlens || !b->input_ids || !b->loss_mask)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch lacks cu_seqlens, input_ids or loss_mask");
    if (!b->target_hidden) {
        const int   on_host = b->host_taps[0] != NULL;
        const char *where = on_host ? "host" : "device";
        if (m->cfg.n_taps > DT_MAX_TAPS)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "%d taps in %s memory; at most %d", m->cfg.n_taps, where, DT_MAX_TAPS);
        for (int k = 0; k < m->cfg.n_taps; k++)
            if (!(on_host ? b->host_taps[k] : b->dev_taps[k]))
                return CM_FAIL(CM_ERR_INVALID_ARG, "the batch has no target_hidden and no %s tap %d", where, k);
        if (b->taps_dt != CM_DTYPE_BF16 && b->taps_dt != CM_DTYPE_F32)
            return CM_FAIL(CM_ERR_UNSUPPORTED, "%s taps in %s; expected BF16 or F32", where, cm_dtype_name(b->taps_dt));
    }
    if (b->cu_seqlens[0] != 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens[0] is %d; it must be 0", b->cu_seqlens[0]);
    for (int s = 0; s < b->n_seq; s++)
        if (b->cu_seqlens[s + 1] <= b->cu_seqlens[s])
            return CM_FAIL(
                CM_ERR_INVALID_ARG,
                "cu_seqlens must increase strictly (no empty sequence): cu_seqlens[%d] = %d follows %d",
                s + 1, b->cu_seqlens[s + 1], b->cu_seqlens[s]);
    if (b->cu_seqlens[b->n_seq] != b->T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens ends at %d but the batch has %lld tokens",
                       b->cu_seqlens[b->n_seq], (long long)b->T);
    const int V = m->cfg.vocab_size;
    for (int64_t t = 0; t < b->T; t++) {
        if (b->input_ids[t] < 0 || b->input_ids[t] >= V)
            return CM_FAIL(CM_ERR_INVALID_ARG, "input_ids[%lld] = %d is outside the vocabulary [0, %d)",
                           (long long)t, b->input_ids[t], V);
        if (b->loss_mask[t] != 0 && b->loss_mask[t] != 1)
            return CM_FAIL(CM_ERR_INVALID_ARG, "loss_mask[%lld] = %d; it must be 0 or 1", (long long)t,
                           b->loss_mask[t]);
    }
    if (b->n_anchors < 0 || b->n_anchors > INT32_MAX / m->cfg.block_size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%lld anchors is out of range (0 to %d with block size %d)",
                       (long long)b->n_anchors, INT32_MAX / m->cfg.block_size, m->cfg.block_size);
    if (b->n_anchors > 0 && !b->anchors)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the batch lacks anchors");
    for (int64_t j = 0; j < b->n_anchors; j++) {
        if (b->anchors[j] < 0 || b->anchors[j] >= b->T)
            return CM_FAIL(CM_ERR_INVALID_ARG, "anchors[%lld] = %d is outside the batch's tokens [0, %lld)",
                           (long long)j, b->anchors[j], (long long)b->T);
        if (j > 0 && b->anchors[j] < b->anchors[j - 1])
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "anchors are not sorted: anchors[%lld] = %d follows %d; sort them "
                           "ascending",
                           (long long)j, b->anchors[j], b->anchors[j - 1]);
    }
    return CM_OK;
}
/* Host side of docs/drafter.md: block tokens and positions, context positions restarting at
 * every document, and for every slot k ≥ 1 inside the anchor's document with loss_mask 1
 * the label ids[a + k] and weight exp(−(k − 1)/γ). Selected rows are listed in order. */
void dt_model_layout_batch(dt_model *m, const dt_batch *b, float gamma) {
    const int B = m->cfg.block_size;
    dt_host  *h = &m->host;
    for (int s = 0; s < b->n_seq; s++)
        for (int32_t p = b->cu_seqlens[s]; p < b->cu_seqlens[s + 1]; p++)
            h->ctx_pos[p] = p - b->cu_seqlens[s];
    int    s = 0;
    double wsum = 0;
    m->n_sel = 0;
    for (int64_t j = 0; j < b->n_anchors; j++) {
        const int32_t a = b->anchors[j];
        while (b->cu_seqlens[s + 1] <= a)
            s++; /* anchors are sorted */
        const int32_t lo = b->cu_seqlens[s], hi = b->cu_seqlens[s + 1];
        h->ctx_lo[j] = lo;
        for (int k = 0; k < B; k++) {
            const int64_t r = j * B + k;
            h->blk_ids[r] = k == 0 ? b->input_ids[a] : m->cfg.mask_token_id;
            h->blk_pos[r] = a - lo + k;
            if (k >= 1 && (int64_t)a + k < hi && b->loss_mask[a + k]) {
                const double w = exp(-(double)(k - 1) / (double)gamma);
                h->sel_row[m->n_sel] = (int32_t)r;
                h->labels[m->n_sel] = b->input_ids[a + k];
                if (dt_model_is_v2(m)) /* teacher forcing: the true token before the slot */
                    h->pred[m->n_sel] = b->input_ids[a + k - 1];
                h->weight[m->n_sel] = w;
                wsum += w;
                m->n_sel++;
            }
        }
    }
    for (int64_t i = 0; i < m->n_sel; i++)
        h->gscale[i] = (float)(h->weight[i] / wsum);
    for (int64_t r = 0; r < m->R; r++)
        h->inv[r] = (int32_t)m->n_sel;
    for (int64_t i = 0; i < m->n_sel; i++)
        h->inv[h->sel_row[i]] = (int32_t)i;
    m->weight_sum = wsum;
}

/* The region the host features pass through on their way in: the larger of layer 0's span and
 * the work region, both free until the forward. */
static void *upload_stage(dt_model *m, size_t *bytes) {
    dt_acts  *a = &m->acts;
    const int in_span = a->span_bytes > a->work_bytes;
    *bytes = in_span ? a->span_bytes : a->work_bytes;
    return in_span ? (void *)a->layer[0].gate : (void *)a->work;
}

/* Fh, the BF16 (activation dtype) copies of host-fed taps, sized for the plan; m->tap points
 * into it. */
static cm_status host_tap_buffers(dt_model *m) {
    dt_acts      *a = &m->acts;
    const int64_t D = m->cfg.hidden_size;
    const size_t  es = cm_dtype_size(m->adt), tap_bytes = ((size_t)(a->T_cap * D) * es + 255) / 256 * 256;
    if (m->Fh_T < a->T_cap) { /* the first host-fed step (or a grown plan) */
        m->be->free(m->ctx, m->Fh);
        m->Fh = NULL;
        m->Fh_T = 0;
        CM_TRY(m->be->alloc(m->ctx, &m->Fh, tap_bytes * (size_t)m->cfg.n_taps));
        m->Fh_T = a->T_cap;
    }
    for (int k = 0; k < m->cfg.n_taps; k++)
        m->tap[k] = (const char *)m->Fh + tap_bytes * (size_t)k;
    m->tap_dt = m->adt;
    m->tap_ld = m->cfg.hidden_size;
    return CM_OK;
}

/* Host taps [T, D] each, in b->taps_dt, into dst[k] (rows dst_ld apart, dtype dst_dt): through the
 * stage in chunks of rows, converted by the backend as they land. */
static cm_status upload_host_taps(dt_model *m, const dt_batch *b, void *const *dst, cm_dtype dst_dt, int64_t dst_ld) {
    const kn_backend *be = m->be;
    const int64_t     T = m->T, D = m->cfg.hidden_size;
    const size_t      es_in = cm_dtype_size(b->taps_dt), es_out = cm_dtype_size(dst_dt);
    size_t            stage_bytes;
    void             *stage = upload_stage(m, &stage_bytes);
    const int64_t     rows = (int64_t)(stage_bytes / ((size_t)D * es_in));
    for (int k = 0; k < m->cfg.n_taps; k++)
        for (int64_t r0 = 0; r0 < T; r0 += rows) {
            const int64_t n = T - r0 < rows ? T - r0 : rows;
            CM_TRY(be->upload(m->ctx, stage, (const char *)b->host_taps[k] + (size_t)(r0 * D) * es_in,
                              (size_t)(n * D) * es_in));
            CM_TRY(be->cast2d(m->ctx, (char *)dst[k] + (size_t)(r0 * dst_ld) * es_out, dst_dt, dst_ld, stage,
                              b->taps_dt, D, n, D));
        }
    return CM_OK;
}

cm_status dt_model_upload_batch(dt_model *m, const dt_batch *b) {
    const kn_backend *be = m->be;
    dt_acts          *a = &m->acts;
    const int64_t     NA = m->n_anchors, R = m->R, T = m->T;
    const int64_t     D = m->cfg.hidden_size, nD = (int64_t)m->cfg.n_taps * D;
    const int         host_taps = !b->target_hidden && b->host_taps[0];
    if (m->adt == CM_DTYPE_F32) {
        if (b->target_hidden)
            CM_TRY(be->upload(m->ctx, a->F, b->target_hidden, (size_t)T * (size_t)nD * sizeof(float)));
        else if (host_taps) { /* each into its columns of F */
            void *cols[DT_MAX_TAPS];
            for (int k = 0; k < m->cfg.n_taps; k++)
                cols[k] = a->F + k * D;
            CM_TRY(upload_host_taps(m, b, cols, CM_DTYPE_F32, nD));
        } else { /* taps in device memory: each into its columns of F */
            for (int k = 0; k < m->cfg.n_taps; k++)
                CM_TRY(be->cast2d(m->ctx, a->F + k * D, CM_DTYPE_F32, nD, b->dev_taps[k], b->taps_dt, D, T, D));
        }
    } else if (b->target_hidden) {
        CM_TRY(host_tap_buffers(m));
        const size_t es = cm_dtype_size(m->adt);
        size_t       stage_bytes;
        float       *stage = upload_stage(m, &stage_bytes);
        /* in chunks of rows rounded as they land */
        const int64_t rows = (int64_t)(stage_bytes / ((size_t)nD * sizeof(float)));
        for (int64_t r0 = 0; r0 < T; r0 += rows) {
            const int64_t n = T - r0 < rows ? T - r0 : rows;
            CM_TRY(be->upload(m->ctx, stage, b->target_hidden + r0 * nD, (size_t)(n * nD) * sizeof(float)));
            for (int k = 0; k < m->cfg.n_taps; k++)
                CM_TRY(be->cast2d(m->ctx, (char *)m->tap[k] + (size_t)(r0 * D) * es, m->adt, D, stage + k * D,
                                  CM_DTYPE_F32, nD, n, D));
        }
    } else if (host_taps) { /* as they came: one copy per tap when the dtypes agree */
        CM_TRY(host_tap_buffers(m));
        for (int k = 0; k < m->cfg.n_taps; k++)
            if (b->taps_dt == m->adt)
                CM_TRY(be->upload(m->ctx, (void *)m->tap[k], b->host_taps[k], (size_t)(T * D) * cm_dtype_size(m->adt)));
        if (b->taps_dt != m->adt)
            CM_TRY(upload_host_taps(m, b, (void *const *)m->tap, m->adt, D));
    } else {
        for (int k = 0; k < m->cfg.n_taps; k++)
            m->tap[k] = b->dev_taps[k];
        m->tap_dt = b->taps_dt;
        m->tap_ld = D;
    }
    CM_TRY(be->upload(m->ctx, a->blk_ids, m->host.blk_ids, (size_t)R * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->blk_pos, m->host.blk_pos, (size_t)R * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->ctx_pos, m->host.ctx_pos, (size_t)T * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->anchors, b->anchors, (size_t)NA * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->ctx_lo, m->host.ctx_lo, (size_t)NA * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->labels, m->host.labels, (size_t)m->n_sel * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->gscale, m->host.gscale, (size_t)m->n_sel * sizeof(float)));
    CM_TRY(be->upload(m->ctx, a->sel, m->host.sel_row, (size_t)m->n_sel * sizeof(int32_t)));
    CM_TRY(be->upload(m->ctx, a->inv, m->host.inv, (size_t)R * sizeof(int32_t)));
    if (dt_model_is_v2(m))
        CM_TRY(be->upload(m->ctx, a->pred, m->host.pred, (size_t)m->n_sel * sizeof(int32_t)));
    return CM_OK;
}
