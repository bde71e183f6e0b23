/* kernels/ref/kn_attention_ref.c — reference causal GQA attention over packed sequences with
 * the Qwen3.5 output gate: for token t of a sequence starting at bos and q head h (kv head
 * h / (nq/nkv)), scores s = scale·(q·k) for bos ≤ s ≤ t, a two-pass softmax in double with
 * max subtraction, o = Σ p·v in double, then o ⊙ sigmoid(gate) when gate is given. Each
 * (token, head) is independent and runs in parallel under OpenMP with per-thread scratch
 * (scores for the longest sequence, an accumulator of hd doubles). */
#include "kn_ref.h"

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

typedef struct att_args {
    float         *out;
    const float   *q, *k, *v, *gate;
    const int32_t *cu_seqlens;
    int            n_seq, nq, nkv, hd;
    float          scale;
} att_args;

/* Row task = t·nq + h: token t against its sequence's keys bos..t. */
static void att_row(int64_t task, double *p, double *acc, const void *user) {
    const att_args *a   = user;
    const int64_t   t   = task / a->nq;
    const int       h   = (int)(task % a->nq), kvh = h / (a->nq / a->nkv), hd = a->hd;
    const int64_t   bos = a->cu_seqlens[seq_of(a->cu_seqlens, a->n_seq, t)];
    kn_ref_attend_row(a->out + task * hd, a->q + task * hd, a->k + (bos * a->nkv + kvh) * hd,
                      a->v + (bos * a->nkv + kvh) * hd, (int64_t)a->nkv * hd, t - bos + 1, hd, a->scale,
                      a->gate ? a->gate + task * hd : NULL, p, acc);
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
    const att_args a = {out, q, k, v, gate, cu_seqlens, n_seq, nq, nkv, hd, scale};
    return kn_ref_attend_rows("attention", T * nq, max_len, hd, att_row, &a);
}

typedef struct {
    kn_ref_attend_fn row;
    const void      *user;
    int64_t          n_keys;
} attend_rows;

static void attend_task(int64_t task, void *scratch, const void *user) {
    const attend_rows *a = user;
    double            *p = scratch;
    a->row(task, p, p + (a->n_keys > 0 ? a->n_keys : 1), a->user);
}

cm_status kn_ref_attend_rows(const char *op, int64_t n_tasks, int64_t n_keys, int hd, kn_ref_attend_fn row,
                             const void *user) {
    const attend_rows a = {row, user, n_keys};
    return kn_ref_parallel(op, n_tasks, 1, (size_t)((n_keys > 0 ? n_keys : 1) + hd) * sizeof(double),
                           attend_task, &a);
}
