/* kernels/ref/kn_dflash_attn_ref.c — reference DFlash block attention (docs/drafter.md), forward
 * and backward. Query (block j, slot k) sees context rows [ctx_lo[j], anchors[j]) and the block
 * rows of block j: all B slots, or slots ≤ k when causal. On a sliding layer (window W) the
 * window bounds every key by position: context rows ≥ anchors[j] + k − (W − 1), block slots s
 * with k − s < W and, when not causal, s − k < W. GQA maps q head h to kv head h / (nq / nkv).
 * Every query sees at least its own slot, so its lse is finite. Scores, softmax (max subtracted)
 * and sums
 * are in double, one query row at a time in per-thread scratch. The backward recomputes the
 * probabilities from the saved lse: pass 1 (parallel over query rows × heads) gives dq and
 * Δ = Σ p·dp; pass 2 (parallel over key rows × kv heads) gives dk and dv by looping the
 * blocks, slots and group heads that see the key in a fixed order, so results are
 * bit-identical for any thread count and no output is shared between threads. With BF16
 * storage (io_dt) the same passes run on F32 widenings of q, k and v, and out is rounded once. */
#include "kn_ref.h"

#include <stdlib.h>

/* The keys a query sees: context rows [c0, c1) and own-block slots [s0, s1). */
typedef struct dflash_vis {
    int64_t c0, c1;
    int     s0, s1;
} dflash_vis;

static dflash_vis visible(const kn_dflash_attn_params *p, int64_t j, int k) {
    dflash_vis v = {p->ctx_lo[j], p->anchors[j], 0, p->causal ? k + 1 : p->B};
    if (p->window > 0) {
        int64_t lo = (int64_t)p->anchors[j] + k - (p->window - 1);
        if (lo > v.c0) v.c0 = lo < v.c1 ? lo : v.c1;
        if (k - (p->window - 1) > v.s0) v.s0 = k - (p->window - 1);
        if (k + p->window < v.s1) v.s1 = k + p->window;
    }
    return v;
}

/* Does slot k see block slot s of its own block? (the same rule as visible()) */
static int slot_sees(const kn_dflash_attn_params *p, int k, int s) {
    if (p->causal && s > k) return 0;
    return p->window <= 0 || (s > k ? s - k : k - s) < p->window;
}

/* Rows of the inputs, which the passes below read as F32 (BF16 ones are widened first). */
static const float *kctx_row(const kn_dflash_attn_params *p, int64_t row, int g) {
    return (const float *)p->k_ctx + (row * p->nkv + g) * p->hd;
}
static const float *vctx_row(const kn_dflash_attn_params *p, int64_t row, int g) {
    return (const float *)p->v_ctx + (row * p->nkv + g) * p->hd;
}
static const float *kblk_row(const kn_dflash_attn_params *p, int64_t row, int g) {
    return (const float *)p->k_blk + (row * p->nkv + g) * p->hd;
}
static const float *vblk_row(const kn_dflash_attn_params *p, int64_t row, int g) {
    return (const float *)p->v_blk + (row * p->nkv + g) * p->hd;
}
static const float *q_row(const kn_dflash_attn_params *p, int64_t task) {
    return (const float *)p->q + task * p->hd;
}

/* Validates the shapes, the pointers the pass needs and every block's context range.
 * Sets *max_keys to the most keys any query sees. */
static cm_status check_params(const char *op, kn_ctx *ctx, const kn_dflash_attn_params *p, int bwd,
                              int64_t *max_keys) {
    KN_REF_CHECK(ctx && p, "%s: ctx or params is NULL", op);
    KN_REF_CHECK(p->T >= 0 && p->n_blocks >= 0 && p->B > 0 && p->nq > 0 && p->nkv > 0 && p->hd > 0,
                 "%s: bad shape T=%lld n_blocks=%lld B=%d nq=%d nkv=%d hd=%d", op, (long long)p->T,
                 (long long)p->n_blocks, p->B, p->nq, p->nkv, p->hd);
    KN_REF_CHECK(p->nq % p->nkv == 0, "%s: nq=%d must be a multiple of nkv=%d", op, p->nq, p->nkv);
    KN_REF_CHECK(p->window >= 0, "%s: window=%d must be >= 0 (0 = full attention)", op, p->window);
    KN_REF_CHECK(isfinite(p->scale), "%s: scale=%g must be finite", op, (double)p->scale);
    KN_REF_CHECK(p->io_dt == CM_DTYPE_F32 || p->io_dt == CM_DTYPE_BF16,
                 "%s: q, k, v and out in %s are not supported (F32 or BF16)", op, cm_dtype_name(p->io_dt));
    const int64_t row_elems = (int64_t)p->nq * p->hd;
    KN_REF_CHECK(p->n_blocks <= INT64_MAX / p->B / row_elems && p->T <= INT64_MAX / row_elems,
                 "%s: shape T=%lld n_blocks=%lld B=%d overflows", op, (long long)p->T, (long long)p->n_blocks,
                 p->B);
    *max_keys = p->B;
    if (p->n_blocks > 0) {
        KN_REF_CHECK(p->anchors && p->ctx_lo, "%s: anchors or ctx_lo is NULL", op);
        KN_REF_CHECK(p->q && p->k_blk && p->v_blk && p->lse, "%s: q, k_blk, v_blk or lse is NULL", op);
        if (bwd)
            KN_REF_CHECK(p->dout && p->dq && p->dk_blk && p->dv_blk, "%s: dout, dq, dk_blk or dv_blk is NULL",
                         op);
        else
            KN_REF_CHECK(p->out, "%s: out is NULL", op);
        for (int64_t j = 0; j < p->n_blocks; j++) {
            KN_REF_CHECK(p->ctx_lo[j] >= 0 && p->ctx_lo[j] <= p->anchors[j] && p->anchors[j] < p->T,
                         "%s: block %lld has ctx_lo=%d anchor=%d (need 0 <= ctx_lo <= anchor < T=%lld)", op,
                         (long long)j, (int)p->ctx_lo[j], (int)p->anchors[j], (long long)p->T);
            if (p->anchors[j] - p->ctx_lo[j] + p->B > *max_keys)
                *max_keys = p->anchors[j] - p->ctx_lo[j] + p->B;
        }
    }
    if (p->T > 0 && (p->n_blocks > 0 || bwd))
        KN_REF_CHECK(p->k_ctx && p->v_ctx, "%s: k_ctx or v_ctx is NULL", op);
    if (p->T > 0 && bwd) KN_REF_CHECK(p->dk_ctx && p->dv_ctx, "%s: dk_ctx or dv_ctx is NULL", op);
    return CM_OK;
}

/* Scores of query row qr (block j, slot k) against kv head g, in key order: context rows
 * then block slots. Returns the number of keys. */
static int64_t scores(const kn_dflash_attn_params *p, const float *qr, int64_t j, int k, int g, double *sc) {
    const dflash_vis v = visible(p, j, k);
    int64_t          n = 0;
    for (int64_t r = v.c0; r < v.c1; r++)
        sc[n++] = kn_ref_dot(qr, kctx_row(p, r, g), p->hd) * (double)p->scale;
    for (int s = v.s0; s < v.s1; s++)
        sc[n++] = kn_ref_dot(qr, kblk_row(p, j * p->B + s, g), p->hd) * (double)p->scale;
    return n;
}

/* The value (or any [rows, nkv, hd] tensor's) row of key number i of query (j, k). */
static const float *key_row(const kn_dflash_attn_params *p, const float *ctx_t, const float *blk_t, int64_t j,
                            int k, int g, int64_t i) {
    const dflash_vis v = visible(p, j, k);
    const int64_t    r = i < v.c1 - v.c0 ? v.c0 + i : j * p->B + v.s0 + (i - (v.c1 - v.c0));
    return (i < v.c1 - v.c0 ? ctx_t : blk_t) + (r * p->nkv + g) * p->hd;
}

// ---- forward

/* What the tasks of one call share: the parameters and the longest key list. */
typedef struct {
    const kn_dflash_attn_params *p;
    int64_t                      max_keys;
    double                      *delta; /* the backward's Δ per query task */
} dflash_run;

/* Query task (row qi, head h): out and lse; scratch holds max_keys scores, then hd accumulators. */
static void fwd_task(int64_t task, void *scratch, const void *user) {
    const dflash_run            *r = user;
    const kn_dflash_attn_params *p = r->p;
    const int                    hd = p->hd, group = p->nq / p->nkv;
    double                      *sc = scratch, *acc = sc + r->max_keys;
    const int64_t                qi = task / p->nq, j = qi / p->B;
    const int                    h = (int)(task % p->nq), k = (int)(qi % p->B), g = h / group;
    const float                 *qr = q_row(p, task);
    const int64_t                n = scores(p, qr, j, k, g, sc);
    double                       mx = -INFINITY, sum = 0;
    for (int64_t i = 0; i < n; i++)
        mx = sc[i] > mx ? sc[i] : mx;
    for (int c = 0; c < hd; c++)
        acc[c] = 0;
    for (int64_t i = 0; i < n; i++) {
        const double e = exp(sc[i] - mx);
        const float *vr = key_row(p, p->v_ctx, p->v_blk, j, k, g, i);
        sum += e;
        for (int c = 0; c < hd; c++)
            acc[c] += e * (double)vr[c];
    }
    float *o = (float *)p->out + task * hd;
    for (int c = 0; c < hd; c++)
        o[c] = (float)(acc[c] / sum);
    p->lse[task] = (float)(mx + log(sum));
}

static cm_status fwd_f32(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    dflash_run r = {p, 0, NULL};
    CM_TRY(check_params("dflash_attn_fwd", ctx, p, 0, &r.max_keys));
    return kn_ref_parallel("dflash_attn_fwd", p->n_blocks * p->B * p->nq, 16,
                           (size_t)(r.max_keys + p->hd) * sizeof(double), fwd_task, &r);
}

// ---- BF16 storage: the F32 passes on the widened inputs, out rounded once

/* n elements of a BF16 input widened (cast2d) into *at, which advances: *out; NULL for a NULL src. */
static cm_status widen_into(kn_ctx *ctx, float **at, const void *src, int64_t n, const void **out) {
    *out = NULL;
    if (!src)
        return CM_OK;
    float *dst = *at;
    *at += n;
    *out = dst;
    return kn_ref_cast2d(ctx, dst, CM_DTYPE_F32, n, src, CM_DTYPE_BF16, n, 1, n);
}

/* io_dt BF16: pass (fwd_f32 or bwd_f32) on a copy of p whose q, k and v are F32 widenings (and, fwd,
 * whose out is F32), then the F32 out rounded once into p's. */
static cm_status typed_pass(const char *op, kn_ctx *ctx, const kn_dflash_attn_params *p, int fwd,
                            cm_status (*pass)(kn_ctx *, const kn_dflash_attn_params *)) {
    int64_t max_keys;
    CM_TRY(check_params(op, ctx, p, !fwd, &max_keys));
    const int64_t R = p->n_blocks * p->B, nq_el = R * p->nq * p->hd;
    const int64_t ctx_el = p->T * p->nkv * p->hd, blk_el = R * p->nkv * p->hd;
    const int64_t n = nq_el * (fwd ? 2 : 1) + 2 * (ctx_el + blk_el);
    float        *buf = malloc((size_t)(n > 0 ? n : 1) * sizeof(float)), *at = buf;
    if (!buf)
        return CM_FAIL(CM_ERR_NOMEM, "%s: cannot allocate %lld floats for the widened inputs", op,
                       (long long)n);
    kn_dflash_attn_params f = *p;
    f.io_dt = CM_DTYPE_F32;
    cm_status st = widen_into(ctx, &at, p->q, nq_el, &f.q);
    if (st == CM_OK)
        st = widen_into(ctx, &at, p->k_ctx, ctx_el, &f.k_ctx);
    if (st == CM_OK)
        st = widen_into(ctx, &at, p->v_ctx, ctx_el, &f.v_ctx);
    if (st == CM_OK)
        st = widen_into(ctx, &at, p->k_blk, blk_el, &f.k_blk);
    if (st == CM_OK)
        st = widen_into(ctx, &at, p->v_blk, blk_el, &f.v_blk);
    if (fwd)
        f.out = p->out ? at : NULL;
    if (st == CM_OK)
        st = pass(ctx, &f);
    if (st == CM_OK && fwd && f.out)
        st = kn_ref_cast2d(ctx, p->out, CM_DTYPE_BF16, nq_el, f.out, CM_DTYPE_F32, nq_el, 1, nq_el);
    free(buf);
    return st;
}

cm_status kn_ref_dflash_attn_fwd(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    if (!ctx || !p || p->io_dt != CM_DTYPE_BF16)
        return fwd_f32(ctx, p);
    return typed_pass("dflash_attn_fwd", ctx, p, 1, fwd_f32);
}

// ---- backward
// With P = exp(s − lse), dp = dout·v, Δ = Σ_keys P·dp and dS = P·(dp − Δ):
//   dq = scale·Σ_keys dS·k,  dk = scale·Σ_queries dS·q,  dv = Σ_queries P·dout.

/* Pass 1: dq and Δ for query task (row qi, head h); pr and dp hold one row each. */
static void bwd_query(const kn_dflash_attn_params *p, int64_t task, double *pr, double *dp, double *acc,
                      double *delta) {
    const int     hd = p->hd, group = p->nq / p->nkv;
    const int64_t qi = task / p->nq, j = qi / p->B;
    const int     h = (int)(task % p->nq), k = (int)(qi % p->B), g = h / group;
    const float  *qr = q_row(p, task), *dor = p->dout + task * hd;
    const double  lse = p->lse[task];
    const int64_t n   = scores(p, qr, j, k, g, pr);
    double        d   = 0;
    for (int64_t i = 0; i < n; i++) {
        pr[i] = exp(pr[i] - lse);
        dp[i] = kn_ref_dot(dor, key_row(p, p->v_ctx, p->v_blk, j, k, g, i), hd);
        d += pr[i] * dp[i];
    }
    for (int c = 0; c < hd; c++) acc[c] = 0;
    for (int64_t i = 0; i < n; i++) {
        const double ds = pr[i] * (dp[i] - d);
        const float *kr = key_row(p, p->k_ctx, p->k_blk, j, k, g, i);
        for (int c = 0; c < hd; c++) acc[c] += ds * (double)kr[c];
    }
    float *dq = p->dq + task * hd;
    for (int c = 0; c < hd; c++) dq[c] = (float)(acc[c] * (double)p->scale);
    delta[task] = d;
}

/* Adds the contribution of query (row qi, head h) to the key (kr, vr) accumulators. */
static void bwd_pair(const kn_dflash_attn_params *p, const double *delta, int64_t qi, int h, const float *kr,
                     const float *vr, double *dk, double *dv) {
    const int     hd   = p->hd;
    const int64_t task = qi * p->nq + h;
    const float  *qr = q_row(p, task), *dor = p->dout + task * hd;
    const double  pr = exp(kn_ref_dot(qr, kr, hd) * (double)p->scale - (double)p->lse[task]);
    const double  ds = pr * (kn_ref_dot(dor, vr, hd) - delta[task]);
    for (int c = 0; c < hd; c++) {
        dk[c] += ds * (double)qr[c];
        dv[c] += pr * (double)dor[c];
    }
}

/* Pass 2: dk and dv of key row `row` (context rows first, then block rows) and kv head g. */
static void bwd_key(const kn_dflash_attn_params *p, const double *delta, int64_t row, int g, double *dk,
                    double *dv) {
    const int hd = p->hd, group = p->nq / p->nkv, B = p->B;
    for (int c = 0; c < hd; c++) dk[c] = dv[c] = 0;
    float *dko, *dvo;
    if (row < p->T) {
        const float *kr = kctx_row(p, row, g), *vr = vctx_row(p, row, g);
        for (int64_t j = 0; j < p->n_blocks; j++) {
            if (row < p->ctx_lo[j] || row >= p->anchors[j]) continue;
            /* sliding: slot k sees row iff row ≥ anchor + k − (W − 1) */
            int64_t kmax = p->window > 0 ? row - p->anchors[j] + p->window - 1 : B - 1;
            if (kmax > B - 1) kmax = B - 1;
            for (int64_t k = 0; k <= kmax; k++)
                for (int h = g * group; h < (g + 1) * group; h++)
                    bwd_pair(p, delta, j * B + k, h, kr, vr, dk, dv);
        }
        dko = p->dk_ctx + (row * p->nkv + g) * hd;
        dvo = p->dv_ctx + (row * p->nkv + g) * hd;
    } else {
        const int64_t br = row - p->T, j = br / B;
        const int     s  = (int)(br % B);
        const float  *kr = kblk_row(p, br, g), *vr = vblk_row(p, br, g);
        for (int k = 0; k < B; k++) {
            if (!slot_sees(p, k, s)) continue;
            for (int h = g * group; h < (g + 1) * group; h++)
                bwd_pair(p, delta, j * B + k, h, kr, vr, dk, dv);
        }
        dko = p->dk_blk + (br * p->nkv + g) * hd;
        dvo = p->dv_blk + (br * p->nkv + g) * hd;
    }
    for (int c = 0; c < hd; c++) {
        dko[c] = (float)(dk[c] * (double)p->scale);
        dvo[c] = (float)dv[c];
    }
}

/* Pass 1, query task: dq and Δ; scratch holds two rows of max_keys, then hd accumulators. */
static void bwd_query_task(int64_t task, void *scratch, const void *user) {
    const dflash_run *r = user;
    double           *sc = scratch;
    bwd_query(r->p, task, sc, sc + r->max_keys, sc + 2 * r->max_keys, r->delta);
}

/* Pass 2, key task (key row, kv head): dk and dv; scratch holds 2·hd accumulators. */
static void bwd_key_task(int64_t task, void *scratch, const void *user) {
    const dflash_run *r = user;
    double           *acc = scratch;
    bwd_key(r->p, r->delta, task / r->p->nkv, (int)(task % r->p->nkv), acc, acc + r->p->hd);
}

static cm_status bwd_f32(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    dflash_run r = {p, 0, NULL};
    CM_TRY(check_params("dflash_attn_bwd", ctx, p, 1, &r.max_keys));
    const int64_t n_q = p->n_blocks * p->B * p->nq;
    const int64_t n_k = (p->T + p->n_blocks * p->B) * p->nkv;
    r.delta = malloc((size_t)(n_q > 0 ? n_q : 1) * sizeof(double));
    if (!r.delta)
        return CM_FAIL(CM_ERR_NOMEM, "dflash_attn_bwd: cannot allocate %lld row sums", (long long)n_q);
    /* pass 1 writes every Δ before pass 2 reads them: two parallel regions */
    cm_status st = kn_ref_parallel("dflash_attn_bwd", n_q, 16,
                                   (size_t)(2 * r.max_keys + p->hd) * sizeof(double), bwd_query_task, &r);
    if (st == CM_OK)
        st = kn_ref_parallel("dflash_attn_bwd", n_k, 4, (size_t)2 * p->hd * sizeof(double), bwd_key_task, &r);
    free(r.delta);
    return st;
}

cm_status kn_ref_dflash_attn_bwd(kn_ctx *ctx, const kn_dflash_attn_params *p) {
    if (!ctx || !p || p->io_dt != CM_DTYPE_BF16)
        return bwd_f32(ctx, p);
    return typed_pass("dflash_attn_bwd", ctx, p, 0, bwd_f32);
}
