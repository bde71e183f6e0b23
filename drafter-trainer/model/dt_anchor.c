/* drafter-trainer/model/dt_anchor.c — candidate scan and seeded sampling without replacement of the
 * training anchors (docs/drafter.md). The draw swaps within the ascending candidate list (partial
 * Fisher–Yates with unbiased bounded draws), then sorts the chosen prefix, so the result
 * depends only on (seed, epoch, batch id) and the batch. */
#include "dt_anchor.h"

#include <stdlib.h>

cm_status dt_anchor_check(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T) {
    if (n_seq < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "packed batch has %d documents; need at least 1", n_seq);
    if (T < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "packed batch has %lld tokens; need at least 1", (long long)T);
    if (!cu_seqlens || !loss_mask)
        return CM_FAIL(CM_ERR_INVALID_ARG, "packed batch without cu_seqlens or loss_mask");
    if (cu_seqlens[0] != 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens[0] is %d; it must be 0", cu_seqlens[0]);
    for (int i = 0; i < n_seq; i++)
        if (cu_seqlens[i + 1] <= cu_seqlens[i])
            return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens is not strictly increasing at %d (%d then %d)",
                           i + 1, cu_seqlens[i], cu_seqlens[i + 1]);
    if (cu_seqlens[n_seq] != T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cu_seqlens ends at %d but the batch has %lld tokens",
                       cu_seqlens[n_seq], (long long)T);
    for (int64_t p = 0; p < T; p++)
        if (loss_mask[p] != 0 && loss_mask[p] != 1)
            return CM_FAIL(CM_ERR_INVALID_ARG, "loss_mask[%lld] is %d; it must be 0 or 1", (long long)p,
                           loss_mask[p]);
    return CM_OK;
}

int64_t dt_anchor_candidates(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T,
                             int32_t *cand) {
    (void)T;
    int64_t n = 0;
    for (int d = 0; d < n_seq; d++)
        for (int32_t p = cu_seqlens[d]; p + 1 < cu_seqlens[d + 1]; p++)
            if (loss_mask[p] && loss_mask[p + 1])
                cand[n++] = p;
    return n;
}

void dt_anchor_rng(cm_rng *r, uint64_t seed, uint64_t epoch, uint64_t batch_id) {
    cm_rng_seed_stream(r, seed ^ DT_ANCHOR_STREAM, epoch, batch_id);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

cm_status dt_anchor_sample(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T,
                           int64_t max_anchors, uint64_t seed, uint64_t epoch, uint64_t batch_id,
                           int32_t *work, int32_t *anchors, int64_t *n_anchors) {
    if (max_anchors < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "max_anchors is %lld; it must be at least 1",
                       (long long)max_anchors);
    CM_TRY(dt_anchor_check(cu_seqlens, n_seq, loss_mask, T));
    int64_t n = dt_anchor_candidates(cu_seqlens, n_seq, loss_mask, T, work);
    int64_t k = n < max_anchors ? n : max_anchors;
    if (k < n) {
        cm_rng r;
        dt_anchor_rng(&r, seed, epoch, batch_id);
        for (int64_t i = 0; i < k; i++) {
            int64_t j = i + (int64_t)cm_rng_below(&r, (uint64_t)(n - i));
            int32_t t = work[i];
            work[i] = work[j];
            work[j] = t;
        }
    }
    for (int64_t i = 0; i < k; i++)
        anchors[i] = work[i];
    if (k > 1)
        qsort(anchors, (size_t)k, sizeof *anchors, cmp_i32);
    *n_anchors = k;
    return CM_OK;
}
