/* drafter-trainer/model/dt_tau_chain.c — the decoder's chain of anchors over teacher-forced
 * acceptances (dt_tau_chain.h). One pass over the batch: spans and chain anchors come in ascending
 * packed order, so one cursor into the sorted anchors finds each acceptance. */
#include "dt_tau_chain.h"

#include <string.h>

#include "dt_anchor.h"

static cm_status check_anchors(const int32_t *anchors, const int32_t *accepted, int64_t n, int64_t T) {
    if (n < 0 || (n > 0 && (!anchors || !accepted)))
        return CM_FAIL(CM_ERR_INVALID_ARG, "%lld anchors without their positions or acceptances",
                       (long long)n);
    for (int64_t j = 0; j < n; j++) {
        if (anchors[j] < 0 || anchors[j] >= T)
            return CM_FAIL(CM_ERR_INVALID_ARG, "anchor %lld is at %d, outside the batch's %lld tokens",
                           (long long)j, anchors[j], (long long)T);
        if (j > 0 && anchors[j] <= anchors[j - 1])
            return CM_FAIL(CM_ERR_INVALID_ARG, "anchors are not strictly ascending at %lld (%d then %d)",
                           (long long)j, anchors[j - 1], anchors[j]);
        if (accepted[j] < 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "anchor %lld (position %d) has acceptance %d; it must be >= 0",
                           (long long)j, anchors[j], accepted[j]);
    }
    return CM_OK;
}

cm_status dt_tau_chain_walk(const int32_t *cu_seqlens, int n_seq, const int32_t *loss_mask, int64_t T,
                            const int32_t *anchors, const int32_t *accepted, int64_t n_anchors,
                            int64_t *seq_steps, dt_tau_chain *out) {
    CM_TRY(dt_anchor_check(cu_seqlens, n_seq, loss_mask, T));
    CM_TRY(check_anchors(anchors, accepted, n_anchors, T));
    memset(out, 0, sizeof *out);
    out->missing = -1;
    int64_t j = 0;
    for (int d = 0; d < n_seq; d++) {
        const int64_t end = cu_seqlens[d + 1];
        int64_t       steps = 0;
        for (int64_t f = cu_seqlens[d]; f < end;) {
            if (!loss_mask[f]) {
                f++;
                continue;
            }
            int64_t e = f;
            while (e < end && loss_mask[e])
                e++;
            for (int64_t a = f; a + 1 < e;) { /* the span [f, e) */
                while (j < n_anchors && anchors[j] < a)
                    j++;
                if (j == n_anchors || anchors[j] != a) {
                    out->tokens = out->steps = 0;
                    out->missing = a;
                    return CM_OK;
                }
                const int64_t left = e - 1 - a, n = (int64_t)accepted[j] + 1 < left ? accepted[j] + 1 : left;
                out->tokens += n;
                steps++;
                a += n;
            }
            f = e;
        }
        if (seq_steps)
            seq_steps[d] = steps;
        out->steps += steps;
    }
    return CM_OK;
}

double dt_tau_chain_tau(const dt_tau_chain *c) {
    return c->steps > 0 ? (double)c->tokens / (double)c->steps : 0.0;
}
