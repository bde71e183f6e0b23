/* kernels/ref/kn_attention_ref.c — reference causal GQA attention over packed sequences with
 * the Qwen3.5 output gate: for token t of a sequence starting at bos and q head h (kv head
 * h / (nq/nkv)), scores s = scale·(q·k) for bos ≤ s ≤ t, a two-pass softmax in double with
 * max subtraction, o = Σ p·v in double, then o ⊙ sigmoid(gate) when gate is given. Each
 * (token, head) is independent and runs in parallel under OpenMP with per-thread scratch
 * (scores for the longest sequence, an accumulator of hd doubles). */
#include "kn_ref.h"

#include <stdlib.h>

/* Index of the sequence holding token t: the last s with cu[s] <= t and cu[s+1] > t. */
static int seq_of(const int32_t *cu, int n_seq, int64_t t) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

cm_status kn_ref_attention(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                           const float *gate, const int32_t *cu_seqlens, int n_seq, int64_t T, int nq,
                           int nkv, int hd, float scale) {
    KN_REF_CHECK(ctx, "attention: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nq > 0 && nkv > 0 && hd > 0, "attention: bad shape T=%lld nq=%d nkv=%d hd=%d",
                 (long long)T, nq, nkv, hd);
    KN_REF_CHECK(nq % nkv == 0, "attention: nq=%d must be a multiple of nkv=%d", nq, nkv);
    CM_TRY(kn_ref_seqlens_check("attention", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(out && q && k && v, "attention: out, q, k or v is NULL");

    int64_t max_len = 0;
    for (int s = 0; s < n_seq; s++)
        if (cu_seqlens[s + 1] - cu_seqlens[s] > max_len) max_len = cu_seqlens[s + 1] - cu_seqlens[s];
    const int     group   = nq / nkv;
    const int64_t n_tasks = T * nq;
    int           failed  = 0;

#ifdef _OPENMP
#pragma omp parallel
#endif
    {
        double *p   = malloc((size_t)max_len * sizeof(double));
        double *acc = malloc((size_t)hd * sizeof(double));
        if (!p || !acc) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t task = 0; task < n_tasks; task++) {
            if (!p || !acc) continue;
            const int64_t t   = task / nq;
            const int     h   = (int)(task % nq);
            const int     kvh = h / group;
            const int64_t bos = cu_seqlens[seq_of(cu_seqlens, n_seq, t)];
            const float  *qr  = q + (t * nq + h) * hd;

            kn_ref_attend_row(out + (t * nq + h) * hd, qr, k + (bos * nkv + kvh) * hd, v + (bos * nkv + kvh) * hd,
                              (int64_t)nkv * hd, t - bos + 1, hd, scale, gate ? gate + (t * nq + h) * hd : NULL, p, acc);
        }
        free(acc);
        free(p);
    }
    if (failed)
        return CM_FAIL(CM_ERR_NOMEM, "attention: cannot allocate scratch for %lld scores",
                       (long long)max_len);
    return CM_OK;
}
