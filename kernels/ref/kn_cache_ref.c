/* kernels/ref/kn_cache_ref.c — reference incremental decoding (kn_backend.h, "incremental
 * decoding"): the cache write, attention over the cache, and the GDN short conv and gated delta
 * rule continued from a per-slot state. Each op repeats the arithmetic of its uncached
 * neighbour, so that feeding a sequence in pieces gives what the uncached op gives on the whole:
 * attention_cached is kn_ref_attention's two-pass double softmax over cache rows 0..p (bit for
 * bit, the cache holding the keys' exact bits); conv1d_silu_cached is kn_ref_conv1d_silu's
 * double sum over the taps in order (bit for bit: the state holds the earlier inputs' bits and
 * the zeros before a start add +0); gdn_cached is the per-token recurrence of kn_backend.h in
 * double from the F32 state, rounded once into the state (so it matches the chunked
 * kn_ref_gated_delta_rule to the rounding of the state between pieces). The sequence tables
 * (cu_seqlens, slots, base, n_adv) are host memory here and fully validated, except that a slot
 * below the arena's n_slots cannot be checked (the ops are not told n_slots). Parallel under
 * OpenMP over sequences, (token, head) or (sequence, v-head); distinct slots keep the writes
 * apart. */
#include "kn_ref.h"

#include <string.h>

/* The per-sequence tables of a cached op: every len_s ≥ 1, slots ≥ 0 and distinct, and, when
 * given, 0 ≤ base[s] with base[s] + len_s ≤ max_len and 0 ≤ n_adv[s] ≤ len_s. */
static cm_status cache_tables_check(const char *op, const int32_t *cu, int n_seq, const int32_t *slots,
                                    const int32_t *base, int64_t max_len, const int32_t *n_adv) {
    for (int s = 0; s < n_seq; s++) {
        const int64_t len = (int64_t)cu[s + 1] - cu[s];
        KN_REF_CHECK(len >= 1, "%s: sequence %d is empty (cu_seqlens[%d] = cu_seqlens[%d] = %d; len >= 1)",
                     op, s, s, s + 1, (int)cu[s]);
        KN_REF_CHECK(slots[s] >= 0, "%s: slots[%d]=%d must be >= 0", op, s, (int)slots[s]);
        for (int r = 0; r < s; r++)
            KN_REF_CHECK(slots[r] != slots[s], "%s: slots[%d]=%d repeats slots[%d] (slots must be distinct)",
                         op, s, (int)slots[s], r);
        if (base) {
            KN_REF_CHECK(base[s] >= 0, "%s: base[%d]=%d must be >= 0", op, s, (int)base[s]);
            KN_REF_CHECK(base[s] + len <= max_len, "%s: base[%d]=%d + len %lld > max_len=%lld", op, s,
                         (int)base[s], (long long)len, (long long)max_len);
        }
        if (n_adv)
            KN_REF_CHECK(n_adv[s] >= 0 && n_adv[s] <= len, "%s: n_adv[%d]=%d is out of range [0, len=%lld]",
                         op, s, (int)n_adv[s], (long long)len);
    }
    return CM_OK;
}

// ----------------------------------------------------------------------------
// attention layers: the key/value cache

cm_status kn_ref_kv_cache_write(kn_ctx *ctx, float *kc, float *vc, const float *k, const float *v,
                                const int32_t *slots, const int32_t *base, const int32_t *cu_seqlens,
                                int n_seq, int64_t T, int nkv, int hd, int64_t max_len) {
    KN_REF_CHECK(ctx, "kv_cache_write: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nkv > 0 && hd > 0 && max_len > 0,
                 "kv_cache_write: bad shape T=%lld nkv=%d hd=%d max_len=%lld (T >= 0, the others > 0)",
                 (long long)T, nkv, hd, (long long)max_len);
    CM_TRY(kn_ref_seqlens_check("kv_cache_write", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(kc && vc && k && v && slots && base, "kv_cache_write: kc, vc, k, v, slots or base is NULL");
    CM_TRY(cache_tables_check("kv_cache_write", cu_seqlens, n_seq, slots, base, max_len, NULL));

    const int64_t row = (int64_t)nkv * hd;
    for (int s = 0; s < n_seq; s++) {
        const int64_t bos = cu_seqlens[s], len = cu_seqlens[s + 1] - bos;
        const int64_t dst = ((int64_t)slots[s] * max_len + base[s]) * row;
        memcpy(kc + dst, k + bos * row, (size_t)(len * row) * sizeof(float));
        memcpy(vc + dst, v + bos * row, (size_t)(len * row) * sizeof(float));
    }
    return CM_OK;
}

typedef struct cache_att_args {
    float         *out;
    const float   *q, *kc, *vc, *gate;
    const int32_t *slots, *base, *cu_seqlens;
    int            nq, nkv, hd;
    int64_t        max_len;
    float          scale;
} cache_att_args;

/* Row task = t·nq + h: token t at position pos of its slot against the slot's cache rows 0..pos. */
static void cache_att_row(int64_t task, double *p, double *acc, const void *user) {
    const cache_att_args *a = user;
    const int64_t         t = task / a->nq;
    const int             h = (int)(task % a->nq), kvh = h / (a->nq / a->nkv), hd = a->hd;
    int                   s = 0;
    while (a->cu_seqlens[s + 1] <= t) s++;
    const int64_t pos = a->base[s] + (t - a->cu_seqlens[s]);
    const int64_t row = (int64_t)a->slots[s] * a->max_len * a->nkv * hd + (int64_t)kvh * hd;
    kn_ref_attend_row(a->out + task * hd, a->q + task * hd, a->kc + row, a->vc + row, (int64_t)a->nkv * hd,
                      pos + 1, hd, a->scale, a->gate ? a->gate + task * hd : NULL, p, acc);
}

/* kn_ref_attention's loop body with the keys of cache rows 0..p of the slot in place of the
 * sequence's rows bos..t. */
cm_status kn_ref_attention_cached(kn_ctx *ctx, float *out, const float *q, const float *kc, const float *vc,
                                  const float *gate, const int32_t *slots, const int32_t *base,
                                  const int32_t *cu_seqlens, int n_seq, int64_t T, int nq, int nkv, int hd,
                                  int64_t max_len, float scale) {
    KN_REF_CHECK(ctx, "attention_cached: ctx is NULL");
    KN_REF_CHECK(
        T >= 0 && nq > 0 && nkv > 0 && hd > 0 && max_len > 0,
        "attention_cached: bad shape T=%lld nq=%d nkv=%d hd=%d max_len=%lld (T >= 0, the others > 0)",
        (long long)T, nq, nkv, hd, (long long)max_len);
    KN_REF_CHECK(nq % nkv == 0, "attention_cached: nq=%d must be a multiple of nkv=%d", nq, nkv);
    CM_TRY(kn_ref_seqlens_check("attention_cached", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(out && q && kc && vc && slots && base,
                 "attention_cached: out, q, kc, vc, slots or base is NULL");
    CM_TRY(cache_tables_check("attention_cached", cu_seqlens, n_seq, slots, base, max_len, NULL));

    int64_t n_keys = 0; /* the most keys one query sees */
    for (int s = 0; s < n_seq; s++)
        if (base[s] + (int64_t)cu_seqlens[s + 1] - cu_seqlens[s] > n_keys)
            n_keys = base[s] + (int64_t)cu_seqlens[s + 1] - cu_seqlens[s];
    const cache_att_args a = {out, q, kc, vc, gate, slots, base, cu_seqlens, nq, nkv, hd, max_len, scale};
    return kn_ref_attend_rows("attention_cached", T * nq, n_keys, hd, cache_att_row, &a);
}

// ----------------------------------------------------------------------------
// GDN layers: the short conv and the gated delta rule from a state

cm_status kn_ref_conv1d_silu_cached(kn_ctx *ctx, float *out, const float *x, const float *w, float *state,
                                    const int32_t *slots, const int32_t *n_adv, const int32_t *cu_seqlens,
                                    int n_seq, int64_t T, int64_t C, int K) {
    KN_REF_CHECK(ctx, "conv1d_silu_cached: ctx is NULL");
    KN_REF_CHECK(T >= 0 && C > 0 && K > 0,
                 "conv1d_silu_cached: bad shape T=%lld C=%lld K=%d (T >= 0, C > 0, K > 0)", (long long)T,
                 (long long)C, K);
    CM_TRY(kn_ref_seqlens_check("conv1d_silu_cached", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(x && w && slots && (state || K == 1), "conv1d_silu_cached: x, w, state or slots is NULL");
    if (out) {
        const uintptr_t o0 = (uintptr_t)out, x0 = (uintptr_t)x, bytes = (uintptr_t)(T * C) * sizeof(float);
        KN_REF_CHECK(o0 + bytes <= x0 || x0 + bytes <= o0,
                     "conv1d_silu_cached: out overlaps x (use a separate buffer)");
    }
    CM_TRY(cache_tables_check("conv1d_silu_cached", cu_seqlens, n_seq, slots, NULL, 0, n_adv));

    const int H = K - 1; /* state rows per slot */
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int s = 0; s < n_seq; s++) {
        const int64_t bos = cu_seqlens[s], len = cu_seqlens[s + 1] - bos;
        float        *st = H ? state + (int64_t)slots[s] * H * C : NULL;
        /* x̃[r]: state row H + r before the sequence's rows (r < 0), then x row bos + r */
#define XT(r, c) ((r) < 0 ? st[(H + (r)) * C + (c)] : x[(bos + (r)) * C + (c)])
        if (out) {
            for (int64_t i = 0; i < len; i++) {
                for (int64_t c = 0; c < C; c++) {
                    double acc = 0;
                    for (int j = 0; j < K; j++) acc += (double)w[c * K + j] * (double)XT(i - H + j, c);
                    out[(bos + i) * C + c] = (float)kn_ref_silu(acc);
                }
            }
        }
        if (n_adv && n_adv[s] > 0 && H > 0) {
            /* row r ← x̃[a − H + r]: for a ≥ 1 a state row it reads is a + r > r, not written yet */
            const int64_t a = n_adv[s];
            for (int r = 0; r < H; r++)
                for (int64_t c = 0; c < C; c++) st[r * C + c] = XT(a - H + r, c);
        }
#undef XT
    }
    return CM_OK;
}

/* One (sequence [bos, bos + len), v-head h) pair from its state st [dk, dv]: the recurrence of
 * kn_backend.h per token in double, out for every token when out is given (else only the
 * first adv tokens run), st ← S after token adv − 1 when adv > 0 (adv < 0: never). S [dk, dv]
 * and kv [dv] are the thread's scratch. */
static void gdn_cached_one(double *S, double *kv, float *out, const float *q, const float *k, const float *v,
                           const float *g, const float *beta, float *st, int64_t bos, int64_t len,
                           int64_t adv, int h, int kh, int nk, int nv, int dk, int dv, double scale) {
    for (int64_t i = 0; i < (int64_t)dk * dv; i++) S[i] = st[i];
    const int64_t n_run = out ? len : adv;
    for (int64_t tok = 0; tok < n_run; tok++) {
        const int64_t t     = bos + tok;
        const float  *kt    = k + (t * nk + kh) * (int64_t)dk;
        const float  *vt    = v + (t * nv + h) * (int64_t)dv;
        const double  decay = exp((double)g[t * nv + h]), bt = beta[t * nv + h];
        // S = e^g S; kv = Sᵀk; u = β(v − kv) (in kv); S += k uᵀ
        for (int c = 0; c < dv; c++) kv[c] = 0;
        for (int i = 0; i < dk; i++) {
            double *Si = S + (int64_t)i * dv;
            for (int c = 0; c < dv; c++) {
                Si[c] *= decay;
                kv[c] += Si[c] * (double)kt[i];
            }
        }
        for (int c = 0; c < dv; c++) kv[c] = bt * ((double)vt[c] - kv[c]);
        for (int i = 0; i < dk; i++) {
            double *Si = S + (int64_t)i * dv;
            for (int c = 0; c < dv; c++) Si[c] += (double)kt[i] * kv[c];
        }
        if (out) { // o = Sᵀ(q·scale), kv reused as the accumulator
            const float *qt = q + (t * nk + kh) * (int64_t)dk;
            for (int c = 0; c < dv; c++) kv[c] = 0;
            for (int i = 0; i < dk; i++) {
                const double  qi = (double)qt[i] * scale;
                const double *Si = S + (int64_t)i * dv;
                for (int c = 0; c < dv; c++) kv[c] += Si[c] * qi;
            }
            float *orow = out + (t * nv + h) * (int64_t)dv;
            for (int c = 0; c < dv; c++) orow[c] = (float)kv[c];
        }
        if (tok == adv - 1)
            for (int64_t i = 0; i < (int64_t)dk * dv; i++) st[i] = (float)S[i];
    }
}

/* One gdn_cached call's operands. */
typedef struct {
    float         *out;
    const float   *q, *k, *v, *g, *beta;
    float         *state;
    const int32_t *slots, *n_adv, *cu;
    int            nk, nv, dk, dv;
    double         scale;
} gdn_cached_args;

/* Task s·nv + h: sequence s, v-head h, with scratch S [dk·dv] and kv [dv] doubles. */
static void gdn_cached_task(int64_t task, void *scratch, const void *user) {
    const gdn_cached_args *a = user;
    const int              s = (int)(task / a->nv), h = (int)(task % a->nv), dk = a->dk, dv = a->dv;
    const int64_t          bos = a->cu[s], len = a->cu[s + 1] - bos;
    float                 *st = a->state + ((int64_t)a->slots[s] * a->nv + h) * dk * dv;
    double                *S = scratch;
    gdn_cached_one(S, S + (size_t)dk * dv, a->out, a->q, a->k, a->v, a->g, a->beta, st, bos, len,
                   a->n_adv ? a->n_adv[s] : -1, h, h / (a->nv / a->nk), a->nk, a->nv, dk, dv, a->scale);
}

cm_status kn_ref_gdn_cached(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                            const float *g, const float *beta, float *state, const int32_t *slots,
                            const int32_t *n_adv, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk,
                            int nv, int dk, int dv, float scale) {
    KN_REF_CHECK(ctx, "gdn_cached: ctx is NULL");
    KN_REF_CHECK(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                 "gdn_cached: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d (T >= 0, the others > 0)",
                 (long long)T, nk, nv, dk, dv);
    KN_REF_CHECK(nv % nk == 0, "gdn_cached: nv=%d must be a multiple of nk=%d", nv, nk);
    CM_TRY(kn_ref_seqlens_check("gdn_cached", cu_seqlens, n_seq, T));
    if (T == 0) return CM_OK;
    KN_REF_CHECK(k && v && g && beta && state && slots, "gdn_cached: k, v, g, beta, state or slots is NULL");
    KN_REF_CHECK(!out || q, "gdn_cached: q is NULL but out is not (q may be NULL only without out)");
    CM_TRY(cache_tables_check("gdn_cached", cu_seqlens, n_seq, slots, NULL, 0, n_adv));
    if (!out && !n_adv) return CM_OK;

    const gdn_cached_args a = {out,   q,          k,  v,  g,  beta, state,        slots,
                               n_adv, cu_seqlens, nk, nv, dk, dv,   (double)scale};
    return kn_ref_parallel("gdn_cached", (int64_t)n_seq * nv, 1, ((size_t)dk * dv + dv) * sizeof(double),
                           gdn_cached_task, &a);
}
