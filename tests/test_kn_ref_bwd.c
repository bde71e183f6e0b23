/* tests/test_kn_ref_bwd.c — checks the cpu reference of the drafter training ops through the
 * kn_backend table. Every backward is checked against central finite differences of
 * L = Σ r·out (r random, L in double) on tiny shapes, one input coordinate at a time: the
 * link "CPU bwd ← finite differences" of the chain of trust. Also: dflash_attn_fwd against a
 * dense masked softmax built here from the docs/drafter.md rules, lm_ce against full logits (with
 * argmax ties), adamw against a double sequence written the PyTorch way, rope_bwd∘rope = id,
 * gemm_dx/gemm_dw against triple loops, sumsq, determinism and bad arguments. Label unit.
 * The cpu backend's memory is host memory, so the buffers here are plain malloc. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"

#define TST_KN_SEED 0x2545f4914f6cdd1dull
#include "tst_fd.h"
#include "tst_kn.h"

static const kn_backend *be;
static kn_ctx           *ctx;

// ---- helpers: buffers, deterministic random numbers, finite differences

static void   *xalloc(size_t bytes) { return tst_xcalloc(bytes); }
static float  *fnew(long n) { return xalloc((size_t)n * sizeof(float)); }
static double *dnew(long n) { return xalloc((size_t)n * sizeof(double)); }
static float  *frand(long n, double lo, double hi) { return tst_rand_f32(n, lo, hi); }

static uint16_t bf16_trunc(float f) { /* any bf16 value will do as a weight */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}

static double dot_rd(const float *r, const float *x, long n) {
    double s = 0;
    for (long i = 0; i < n; i++) s += (double)r[i] * (double)x[i];
    return s;
}

static void ok(cm_status st, const char *what) {
    if (st != CM_OK) {
        fprintf(stderr, "%s failed: %s\n", what, cm_last_error());
        exit(1);
    }
}


// ---- gemm_dx, gemm_dw

typedef struct gemm_st {
    float  *inp, *w, *r, *out;
    int64_t M, N, K;
} gemm_st;

static double gemm_loss(void *vs) {
    gemm_st *s = vs;
    ok(be->gemm(ctx, s->out, s->inp, s->w, CM_DTYPE_F32, s->M, s->N, s->K), "gemm");
    return dot_rd(s->r, s->out, (long)(s->M * s->N));
}

static void test_gemm_fd(void) {
    gemm_st s    = {frand(3 * 5, -1, 1), frand(4 * 5, -1, 1), frand(3 * 4, -1, 1), fnew(3 * 4), 3, 4, 5};
    float  *dinp = fnew(15), *dw = fnew(20);
    ok(be->gemm_dx(ctx, dinp, s.r, s.w, CM_DTYPE_F32, 3, 4, 5, 0), "gemm_dx");
    ok(be->gemm_dw(ctx, dw, s.r, s.inp, 3, 4, 5), "gemm_dw");
    fd_check("gemm dinp", gemm_loss, &s, s.inp, dinp, 15);
    fd_check("gemm dw", gemm_loss, &s, s.w, dw, 20);

    /* the check is sharp: a 1% error in one coordinate is rejected */
    double *fd = dnew(20);
    fd_grad(gemm_loss, &s, s.w, 20, fd);
    dw[7] *= 1.01f;
    TST_CHECK(!fd_agrees("gemm dw (perturbed)", dw, fd, 20, 1));
    free(fd);
    free(dinp), free(dw), free(s.inp), free(s.w), free(s.r), free(s.out);
}

/* Odd sizes across the 32 × 128 output tiles, F32 and BF16 weights, = and +=. */
static void gemm_bwd_case(int64_t M, int64_t N, int64_t K) {
    float    *dout = frand(M * N, -1, 1), *inp = frand(M * K, -1, 1), *wf = frand(N * K, -1, 1);
    uint16_t *wb = xalloc((size_t)(N * K) * sizeof(uint16_t));
    for (int64_t i = 0; i < N * K; i++) wb[i] = bf16_trunc(wf[i]);
    float *got = fnew(M * K), *ref = fnew(M * K), *prev = frand(M * K, -2, 2);

    for (int bf = 0; bf < 2; bf++) {
        for (int acc = 0; acc < 2; acc++) {
            memcpy(got, prev, (size_t)(M * K) * sizeof(float));
            ok(be->gemm_dx(ctx, got, dout, bf ? (const void *)wb : wf, bf ? CM_DTYPE_BF16 : CM_DTYPE_F32, M,
                           N, K, acc),
               "gemm_dx");
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = 0; k < K; k++) {
                    double s = acc ? prev[m * K + k] : 0.0;
                    double t = 0;
                    for (int64_t n = 0; n < N; n++)
                        t += (double)dout[m * N + n] * (bf ? tst_bf16_widen(wb[n * K + k]) : wf[n * K + k]);
                    ref[m * K + k] = (float)(s + t);
                }
            TST_CLOSE(bf ? (acc ? "gemm_dx bf16 +=" : "gemm_dx bf16")
                         : (acc ? "gemm_dx f32 +=" : "gemm_dx f32"),
                      got, ref, (long)(M * K), 1e-6, 1e-6);
        }
    }

    float *dw = frand(N * K, -2, 2), *dw_ref = fnew(N * K);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            double t = 0;
            for (int64_t m = 0; m < M; m++) t += (double)dout[m * N + n] * (double)inp[m * K + k];
            dw_ref[n * K + k] = (float)((double)dw[n * K + k] + t);
        }
    ok(be->gemm_dw(ctx, dw, dout, inp, M, N, K), "gemm_dw");
    TST_CLOSE("gemm_dw +=", dw, dw_ref, (long)(N * K), 1e-6, 1e-6);

    /* deterministic: the same bits again */
    float *dw2 = fnew(N * K);
    ok(be->gemm_dw(ctx, dw2, dout, inp, M, N, K), "gemm_dw");
    float *dw3 = fnew(N * K);
    ok(be->gemm_dw(ctx, dw3, dout, inp, M, N, K), "gemm_dw");
    TST_CHECK(memcmp(dw2, dw3, (size_t)(N * K) * sizeof(float)) == 0);

    free(dw3), free(dw2), free(dw), free(dw_ref), free(got), free(ref), free(prev);
    free(dout), free(inp), free(wf), free(wb);
}

static void test_gemm_bwd(void) {
    test_gemm_fd();
    gemm_bwd_case(1, 1, 1);
    gemm_bwd_case(5, 7, 3);
    gemm_bwd_case(37, 45, 131);
    gemm_bwd_case(70, 3, 257);

    /* N = 0: the product is empty, so dinp = 0 (or unchanged when accumulating) */
    float x[6] = {1, 2, 3, 4, 5, 6};
    ok(be->gemm_dx(ctx, x, NULL, NULL, CM_DTYPE_F32, 2, 0, 3, 1), "gemm_dx");
    TST_CHECK(x[0] == 1 && x[5] == 6);
    ok(be->gemm_dx(ctx, x, NULL, NULL, CM_DTYPE_F32, 2, 0, 3, 0), "gemm_dx");
    TST_CHECK(x[0] == 0 && x[5] == 0);
}

// ---- rmsnorm_bwd

typedef struct norm_st {
    float  *inp, *w, *r, *out;
    int64_t rows, C;
    float   eps;
    int     one_plus;
} norm_st;

static double norm_loss(void *vs) {
    norm_st *s = vs;
    ok(be->rmsnorm(ctx, s->out, s->inp, s->w, s->rows, s->C, s->eps, s->one_plus), "rmsnorm");
    return dot_rd(s->r, s->out, (long)(s->rows * s->C));
}

static void test_rmsnorm_bwd(void) {
    for (int one_plus = 0; one_plus < 2; one_plus++) {
        const int64_t rows = 3, C = 7, n = rows * C;
        norm_st       s = {
                  frand(n, -1.5, 1.5), frand(C, -0.8, 0.8), frand(n, -1, 1), fnew(n), rows, C, 1e-6f, one_plus};
        float *dinp = frand(n, 50, 60), *dw = frand(C, -1, 1), *dw0 = fnew(C);
        memcpy(dw0, dw, (size_t)C * sizeof(float));
        ok(be->rmsnorm_bwd(ctx, dinp, dw, s.r, s.inp, s.w, rows, C, s.eps, one_plus), "rmsnorm_bwd");
        for (int64_t c = 0; c < C; c++) dw[c] = (float)((double)dw[c] - (double)dw0[c]); /* dw += */
        fd_check(one_plus ? "rmsnorm(1+w) dinp" : "rmsnorm(w) dinp", norm_loss, &s, s.inp, dinp, (long)n);
        fd_check(one_plus ? "rmsnorm(1+w) dw" : "rmsnorm(w) dw", norm_loss, &s, s.w, dw, (long)C);
        free(dinp), free(dw), free(dw0), free(s.inp), free(s.w), free(s.r), free(s.out);
    }

    /* many rows and columns (several column chunks), against the closed form in double */
    const int64_t rows = 9, C = 150, n = rows * C;
    float        *x = frand(n, -2, 2), *w = frand(C, -1, 1), *dy = frand(n, -1, 1);
    float        *dx = fnew(n), *dw = fnew(C), *dx_ref = fnew(n), *dw_ref = fnew(C);
    double       *dwd = dnew(C);
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0, g = 0;
        for (int64_t c = 0; c < C; c++) ss += (double)x[r * C + c] * x[r * C + c];
        const double rs = 1.0 / sqrt(ss / (double)C + 1e-5);
        for (int64_t c = 0; c < C; c++) g += (double)dy[r * C + c] * (1.0 + w[c]) * x[r * C + c];
        for (int64_t c = 0; c < C; c++) {
            dx_ref[r * C + c] =
                (float)(rs * (1.0 + w[c]) * dy[r * C + c] - x[r * C + c] * rs * rs * rs * g / (double)C);
            dwd[c] += (double)dy[r * C + c] * x[r * C + c] * rs;
        }
    }
    for (int64_t c = 0; c < C; c++) dw_ref[c] = (float)dwd[c];
    ok(be->rmsnorm_bwd(ctx, dx, dw, dy, x, w, rows, C, 1e-5f, 1), "rmsnorm_bwd");
    TST_CLOSE("rmsnorm_bwd dinp", dx, dx_ref, (long)n, 1e-6, 1e-5);
    TST_CLOSE("rmsnorm_bwd dw", dw, dw_ref, (long)C, 1e-6, 1e-5);
    free(x), free(w), free(dy), free(dx), free(dw), free(dx_ref), free(dw_ref), free(dwd);
}

// ---- rope_bwd

typedef struct rope_st {
    float   *x, *r, *tmp;
    int32_t *pos;
    int64_t  T;
    int      nh, hdim, rot;
    float    theta;
} rope_st;

static double rope_loss(void *vs) {
    rope_st   *s = vs;
    const long n = (long)(s->T * s->nh * s->hdim);
    memcpy(s->tmp, s->x, (size_t)n * sizeof(float));
    ok(be->rope(ctx, s->tmp, s->pos, s->T, s->nh, s->hdim, s->rot, s->theta), "rope");
    return dot_rd(s->r, s->tmp, n);
}

static void test_rope_bwd(void) {
    int32_t       pos[5] = {0, 3, 17, 1000, 65535};
    const int64_t T      = 5;
    const int     nh = 2, hdim = 6, rot = 4;
    const long    n  = (long)T * nh * hdim;
    rope_st       s  = {frand(n, -1, 1), frand(n, -1, 1), fnew(n), pos, T, nh, hdim, rot, 10000.0f};
    float        *dx = fnew(n);
    memcpy(dx, s.r, (size_t)n * sizeof(float));
    ok(be->rope_bwd(ctx, dx, pos, T, nh, hdim, rot, 10000.0f), "rope_bwd");
    fd_check("rope dx", rope_loss, &s, s.x, dx, n);

    /* rope_bwd ∘ rope = identity (an orthogonal map and its transpose) */
    float *y = fnew(n);
    memcpy(y, s.x, (size_t)n * sizeof(float));
    ok(be->rope(ctx, y, pos, T, nh, hdim, rot, 10000.0f), "rope");
    ok(be->rope_bwd(ctx, y, pos, T, nh, hdim, rot, 10000.0f), "rope_bwd");
    TST_CLOSE("rope_bwd(rope(x))", y, s.x, n, 3e-7, 1e-6);
    int pass = 1; /* dims past rot_dim are untouched bit for bit */
    for (long t = 0; t < T * nh; t++)
        for (int c = rot; c < hdim; c++) pass &= y[t * hdim + c] == s.x[t * hdim + c];
    TST_CHECK(pass);
    free(y), free(dx), free(s.x), free(s.r), free(s.tmp);
}

// ---- swiglu_bwd

typedef struct swiglu_st {
    float  *gate, *up, *r, *out;
    int64_t n;
} swiglu_st;

static double swiglu_loss(void *vs) {
    swiglu_st *s = vs;
    ok(be->swiglu(ctx, s->out, s->gate, s->up, s->n), "swiglu");
    return dot_rd(s->r, s->out, (long)s->n);
}

static void test_swiglu_bwd(void) {
    const int64_t n  = 13;
    swiglu_st     s  = {frand(n, -4, 4), frand(n, -2, 2), frand(n, -1, 1), fnew(n), n};
    float        *dg = fnew(n), *du = fnew(n);
    ok(be->swiglu_bwd(ctx, dg, du, s.r, s.gate, s.up, n), "swiglu_bwd");
    fd_check("swiglu dgate", swiglu_loss, &s, s.gate, dg, (long)n);
    fd_check("swiglu dup", swiglu_loss, &s, s.up, du, (long)n);

    /* dgate may alias dout */
    float *alias = fnew(n);
    memcpy(alias, s.r, (size_t)n * sizeof(float));
    float *du2 = fnew(n);
    ok(be->swiglu_bwd(ctx, alias, du2, alias, s.gate, s.up, n), "swiglu_bwd aliased");
    TST_CHECK(memcmp(alias, dg, (size_t)n * sizeof(float)) == 0 &&
              memcmp(du2, du, (size_t)n * sizeof(float)) == 0);
    free(alias), free(du2), free(dg), free(du), free(s.gate), free(s.up), free(s.r), free(s.out);
}

// ---- dflash attention
// The test builds ctx_lo from the documents itself and checks the op against a dense
// softmax over all T + n_blocks·B keys with the mask written from docs/drafter.md.

typedef struct dflash_case {
    const char *name;
    int         n_docs;
    int32_t     cu[4];
    int         n_blocks;
    int32_t     anchors[4];
    int         B, nq, nkv, hd, window;
    int         causal; /* block slots ≤ k only */
} dflash_case;

typedef struct dflash_st {
    kn_dflash_attn_params p;
    int32_t               ctx_lo[4];
    const dflash_case    *c;
    float                *r;
    long                  n_q, n_kctx, n_kblk;
} dflash_st;

static int doc_of(const dflash_case *c, int64_t row) {
    for (int d = 0; d < c->n_docs; d++)
        if (row >= c->cu[d] && row < c->cu[d + 1]) return d;
    return -1;
}

/* docs/drafter.md visibility of key `key` (context rows first, then the block rows) for the query
 * in block j, slot k. */
static int dense_visible(const dflash_case *c, int64_t T, int j, int k, int64_t key) {
    const int64_t a = c->anchors[j];
    if (key < T) {
        if (doc_of(c, key) != doc_of(c, a) || key >= a) return 0;
        return c->window == 0 || key >= a + k - (c->window - 1);
    }
    const int64_t br = key - T, slot = br % c->B;
    if (br / c->B != j) return 0;
    if (c->causal && slot > k) return 0;
    return c->window == 0 || (slot > k ? slot - k : k - slot) < c->window; /* the window bounds slots too */
}

static void dflash_setup(dflash_st *s, const dflash_case *c) {
    memset(s, 0, sizeof *s);
    s->c                = c;
    const int64_t T     = c->cu[c->n_docs];
    const int64_t nrows = (int64_t)c->n_blocks * c->B;
    s->n_q              = (long)(nrows * c->nq * c->hd);
    s->n_kctx           = (long)(T * c->nkv * c->hd);
    s->n_kblk           = (long)(nrows * c->nkv * c->hd);
    for (int j = 0; j < c->n_blocks; j++) s->ctx_lo[j] = c->cu[doc_of(c, c->anchors[j])];
    kn_dflash_attn_params *p = &s->p;
    p->T = T, p->n_blocks = c->n_blocks, p->B = c->B, p->nq = c->nq, p->nkv = c->nkv, p->hd = c->hd;
    p->window = c->window, p->causal = c->causal, p->scale = (float)(1.0 / sqrt((double)c->hd));
    p->anchors = c->anchors, p->ctx_lo = s->ctx_lo;
    p->q = frand(s->n_q, -1, 1), p->k_ctx = frand(s->n_kctx, -1, 1), p->v_ctx = frand(s->n_kctx, -1, 1);
    p->k_blk = frand(s->n_kblk, -1, 1), p->v_blk = frand(s->n_kblk, -1, 1);
    p->out = fnew(s->n_q), p->lse = fnew(nrows * c->nq);
    s->r = frand(s->n_q, -1, 1);
}

static void dflash_free(dflash_st *s) {
    kn_dflash_attn_params *p = &s->p;
    free((void *)p->q), free((void *)p->k_ctx), free((void *)p->v_ctx), free((void *)p->k_blk);
    free((void *)p->v_blk), free(p->out), free(p->lse), free(s->r);
}

static double dflash_loss(void *vs) {
    dflash_st *s = vs;
    ok(be->dflash_attn_fwd(ctx, &s->p), "dflash_attn_fwd");
    return dot_rd(s->r, s->p.out, s->n_q);
}

static void dflash_dense_check(dflash_st *s) {
    const dflash_case           *c = s->c;
    const kn_dflash_attn_params *p = &s->p;
    const int64_t                T = p->T, nkeys = T + (int64_t)c->n_blocks * c->B;
    const long                   n_lse   = (long)c->n_blocks * c->B * c->nq;
    float                       *out_ref = fnew(s->n_q), *lse_ref = fnew(n_lse);
    double                      *sc = dnew((long)nkeys);
    for (int j = 0; j < c->n_blocks; j++)
        for (int k = 0; k < c->B; k++)
            for (int h = 0; h < c->nq; h++) {
                const int64_t qrow = ((int64_t)j * c->B + k) * c->nq + h;
                const int     g    = h / (c->nq / c->nkv);
                const float  *qv = (const float *)p->q + qrow * c->hd;
                double        mx   = -INFINITY;
                for (int64_t key = 0; key < nkeys; key++) {
                    const float *kv = key < T ? (const float *)p->k_ctx + (key * c->nkv + g) * c->hd
                                              : (const float *)p->k_blk + ((key - T) * c->nkv + g) * c->hd;
                    double       d  = 0;
                    for (int e = 0; e < c->hd; e++) d += (double)qv[e] * kv[e];
                    sc[key] = dense_visible(c, T, j, k, key) ? d * p->scale : -INFINITY;
                    if (sc[key] > mx) mx = sc[key];
                }
                double sum = 0;
                for (int64_t key = 0; key < nkeys; key++) sum += sc[key] == -INFINITY ? 0 : exp(sc[key] - mx);
                for (int e = 0; e < c->hd; e++) {
                    double o = 0;
                    for (int64_t key = 0; key < nkeys; key++) {
                        if (sc[key] == -INFINITY) continue;
                        const float *vv = key < T
                                              ? (const float *)p->v_ctx + (key * c->nkv + g) * c->hd
                                              : (const float *)p->v_blk + ((key - T) * c->nkv + g) * c->hd;
                        o += exp(sc[key] - mx) / sum * vv[e];
                    }
                    out_ref[qrow * c->hd + e] = (float)o;
                }
                lse_ref[qrow] = (float)(mx + log(sum));
            }
    ok(be->dflash_attn_fwd(ctx, p), "dflash_attn_fwd");
    char name[96];
    snprintf(name, sizeof name, "dflash %s out", c->name);
    TST_CLOSE(name, p->out, out_ref, s->n_q, 2e-6, 1e-5);
    snprintf(name, sizeof name, "dflash %s lse", c->name);
    TST_CLOSE(name, p->lse, lse_ref, n_lse, 2e-6, 1e-6);
    free(sc), free(out_ref), free(lse_ref);
}

static void dflash_bwd_check(dflash_st *s) {
    kn_dflash_attn_params *p = &s->p;
    float *dq = frand(s->n_q, 1e6, 2e6), *dkc = frand(s->n_kctx, 1e6, 2e6), *dvc = frand(s->n_kctx, 1e6, 2e6);
    float *dkb = frand(s->n_kblk, 1e6, 2e6), *dvb = frand(s->n_kblk, 1e6, 2e6); /* garbage: outputs are = */
    ok(be->dflash_attn_fwd(ctx, p), "dflash_attn_fwd");
    p->dout = s->r, p->dq = dq, p->dk_ctx = dkc, p->dv_ctx = dvc, p->dk_blk = dkb, p->dv_blk = dvb;
    ok(be->dflash_attn_bwd(ctx, p), "dflash_attn_bwd");

    /* deterministic: a second run gives the same bits */
    float *dq2 = fnew(s->n_q), *dkc2 = fnew(s->n_kctx), *dvc2 = fnew(s->n_kctx), *dkb2 = fnew(s->n_kblk),
          *dvb2              = fnew(s->n_kblk);
    kn_dflash_attn_params p2 = *p;
    p2.dq = dq2, p2.dk_ctx = dkc2, p2.dv_ctx = dvc2, p2.dk_blk = dkb2, p2.dv_blk = dvb2;
    ok(be->dflash_attn_bwd(ctx, &p2), "dflash_attn_bwd");
    TST_CHECK(memcmp(dq, dq2, (size_t)s->n_q * 4) == 0 && memcmp(dkc, dkc2, (size_t)s->n_kctx * 4) == 0 &&
              memcmp(dvc, dvc2, (size_t)s->n_kctx * 4) == 0 &&
              memcmp(dkb, dkb2, (size_t)s->n_kblk * 4) == 0 && memcmp(dvb, dvb2, (size_t)s->n_kblk * 4) == 0);

    char name[96];
    struct {
        const char  *what;
        float       *x;
        const float *g;
        long         n;
    } in[5] = {{"dq", (float *)p->q, dq, s->n_q},
               {"dk_ctx", (float *)p->k_ctx, dkc, s->n_kctx},
               {"dv_ctx", (float *)p->v_ctx, dvc, s->n_kctx},
               {"dk_blk", (float *)p->k_blk, dkb, s->n_kblk},
               {"dv_blk", (float *)p->v_blk, dvb, s->n_kblk}};
    for (int i = 0; i < 5; i++) {
        snprintf(name, sizeof name, "dflash %s %s", s->c->name, in[i].what);
        fd_check(name, dflash_loss, s, in[i].x, in[i].g, in[i].n);
    }
    p->dout = NULL, p->dq = p->dk_ctx = p->dv_ctx = p->dk_blk = p->dv_blk = NULL;
    free(dq), free(dkc), free(dvc), free(dkb), free(dvb);
    free(dq2), free(dkc2), free(dvc2), free(dkb2), free(dvb2);
}

static void test_dflash_attn(void) {
    static const dflash_case cases[] = {
        /* two documents; anchor 5 starts the second (empty context); GQA group 2 */
        {"full", 2, {0, 5, 12}, 3, {2, 5, 9}, 3, 4, 2, 4, 0, 0},
        {"sliding W=2", 2, {0, 5, 12}, 3, {2, 5, 9}, 3, 4, 2, 4, 2, 1},
        {"sliding W=3 = B", 2, {0, 5, 12}, 3, {2, 5, 9}, 3, 4, 2, 4, 3, 1}, /* W = 1 would leave one key each */
        /* non-causal sliding: the window bounds block slots in both directions */
        {"sliding W=2 non-causal", 2, {0, 5, 12}, 3, {2, 5, 9}, 3, 4, 2, 4, 2, 0},
        {"full causal", 2, {0, 5, 12}, 3, {2, 5, 9}, 3, 4, 2, 4, 0, 1},
        /* three documents, window longer than some contexts, GQA group 1 */
        {"sliding W=4 3 docs", 3, {0, 4, 6, 13}, 4, {1, 4, 8, 12}, 3, 2, 2, 3, 4, 1},
        {"sliding W=4 3 docs non-causal", 3, {0, 4, 6, 13}, 4, {1, 4, 8, 12}, 3, 2, 2, 3, 4, 0},
        {"full 3 docs", 3, {0, 4, 6, 13}, 4, {1, 4, 8, 12}, 3, 2, 2, 3, 0, 0},
        /* one document, anchor 0 (empty context), B = 4, one kv head for three q heads */
        {"full 1 doc", 1, {0, 9}, 3, {0, 3, 6}, 4, 3, 1, 5, 0, 0},
        {"sliding W=3 1 doc", 1, {0, 9}, 3, {0, 3, 6}, 4, 3, 1, 5, 3, 1},
        {"sliding W=2 1 doc non-causal", 1, {0, 9}, 3, {0, 3, 6}, 4, 3, 1, 5, 2, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dflash_st s;
        dflash_setup(&s, &cases[i]);
        dflash_dense_check(&s);
        dflash_bwd_check(&s);
        dflash_free(&s);
    }

    /* bwd with no blocks writes zero key gradients */
    float                 kc[8] = {1, 2, 3, 4, 5, 6, 7, 8}, dk[8], dv[8];
    kn_dflash_attn_params p     = {.T = 2, .n_blocks = 0, .B = 2, .nq = 2, .nkv = 2, .hd = 2, .scale = 1};
    p.k_ctx = p.v_ctx = kc;
    p.dk_ctx = dk, p.dv_ctx = dv;
    for (int i = 0; i < 8; i++) dk[i] = dv[i] = 9;
    ok(be->dflash_attn_bwd(ctx, &p), "dflash_attn_bwd (no blocks)");
    int zero = 1;
    for (int i = 0; i < 8; i++) zero &= dk[i] == 0 && dv[i] == 0;
    TST_CHECK(zero);
}

// ---- lm_ce

typedef struct lm_st {
    float   *h, *gs, *w, *ce;
    int32_t *labels, *amax;
    int64_t  R, V, D;
} lm_st;

static double lm_loss(void *vs) {
    lm_st *s = vs;
    ok(be->lm_ce(ctx, NULL, s->ce, s->amax, s->h, s->labels, NULL, s->w, CM_DTYPE_F32, s->R, s->V, s->D),
       "lm_ce");
    return dot_rd(s->gs, s->ce, (long)s->R);
}

static double w_at(const void *w, int bf, int64_t i) {
    return bf ? tst_bf16_widen(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Full [R, V] logits in double, written out naively. */
static void lm_naive(const float *h, const void *w, int bf, const int32_t *labels, const float *gs, int64_t R,
                     int64_t V, int64_t D, float *ce, int32_t *amax, float *dh) {
    double *lg = dnew((long)(R * V));
    for (int64_t r = 0; r < R; r++)
        for (int64_t v = 0; v < V; v++) {
            double s = 0;
            for (int64_t d = 0; d < D; d++) s += (double)h[r * D + d] * w_at(w, bf, v * D + d);
            lg[r * V + v] = s;
        }
    for (int64_t r = 0; r < R; r++) {
        double  mx = -INFINITY, z = 0;
        int32_t best = -1;
        for (int64_t v = 0; v < V; v++)
            if (lg[r * V + v] > mx) mx = lg[r * V + v], best = (int32_t)v;
        for (int64_t v = 0; v < V; v++) z += exp(lg[r * V + v] - mx);
        ce[r]   = (float)(mx + log(z) - lg[r * V + labels[r]]);
        amax[r] = best;
        for (int64_t d = 0; d < D; d++) {
            double g = 0;
            for (int64_t v = 0; v < V; v++) {
                g += (exp(lg[r * V + v] - mx) / z - (v == labels[r])) * w_at(w, bf, v * D + d);
            }
            dh[r * D + d] = (float)(gs[r] * g);
        }
    }
    free(lg);
}

static void lm_case(int64_t R, int64_t V, int64_t D, int bf) {
    float   *h = frand(R * D, -1, 1), *wf = frand(V * D, -0.5, 0.5), *gs = frand(R, 0.1, 2);
    int32_t *labels = xalloc((size_t)R * sizeof(int32_t));
    for (int64_t r = 0; r < R; r++) labels[r] = (int32_t)((r * 7 + 3) % V);
    /* ties: rows 3 and 20 of W are equal and dominant for h row 1 (argmax 3, not 20);
     * h row 2 is zero, so every logit ties (argmax 0); row 3 has zero weight */
    for (int64_t d = 0; d < D; d++) wf[3 * D + d] = wf[20 * D + d] = 3.0f * wf[3 * D + d];
    for (int64_t d = 0; d < D; d++) h[1 * D + d] = wf[3 * D + d], h[2 * D + d] = 0;
    gs[3]        = 0;
    uint16_t *wb = xalloc((size_t)(V * D) * sizeof(uint16_t));
    for (int64_t i = 0; i < V * D; i++) wb[i] = bf16_trunc(wf[i]);
    const void    *w   = bf ? (const void *)wb : wf;
    const cm_dtype wdt = bf ? CM_DTYPE_BF16 : CM_DTYPE_F32;

    float   *ce = fnew(R), *dh = frand(R * D, 5, 6), *ce_ref = fnew(R), *dh_ref = fnew(R * D), *ce2 = fnew(R);
    int32_t *amax = xalloc((size_t)R * 4), *amax_ref = xalloc((size_t)R * 4), *amax2 = xalloc((size_t)R * 4);
    lm_naive(h, w, bf, labels, gs, R, V, D, ce_ref, amax_ref, dh_ref);
    ok(be->lm_ce(ctx, dh, ce, amax, h, labels, gs, w, wdt, R, V, D), "lm_ce");
    TST_CLOSE(bf ? "lm_ce bf16 ce" : "lm_ce f32 ce", ce, ce_ref, (long)R, 1e-6, 1e-6);
    TST_CLOSE(bf ? "lm_ce bf16 dh" : "lm_ce f32 dh", dh, dh_ref, (long)(R * D), 1e-6, 1e-6);
    TST_CHECK(memcmp(amax, amax_ref, (size_t)R * 4) == 0);
    TST_CHECK(amax[1] == 3 && amax[2] == 0);
    int zero = 1;
    for (int64_t d = 0; d < D; d++) zero &= dh[3 * D + d] == 0;
    TST_CHECK(zero);
    /* without dh (and gscale) the same ce and argmax */
    ok(be->lm_ce(ctx, NULL, ce2, amax2, h, labels, NULL, w, wdt, R, V, D), "lm_ce");
    TST_CHECK(memcmp(ce, ce2, (size_t)R * 4) == 0 && memcmp(amax, amax2, (size_t)R * 4) == 0);

    if (!bf && R <= 8) { /* finite differences of L = Σ gscale·ce over h */
        lm_st s = {h, gs, wf, fnew(R), labels, xalloc((size_t)R * 4), R, V, D};
        fd_check("lm_ce dh", lm_loss, &s, h, dh, (long)(R * D));
        free(s.ce), free(s.amax);
    }
    free(h), free(wf), free(gs), free(labels), free(wb), free(ce), free(dh), free(ce_ref), free(dh_ref);
    free(ce2), free(amax), free(amax_ref), free(amax2);
}

static void test_lm_ce(void) {
    lm_case(5, 37, 11, 0);
    lm_case(5, 37, 11, 1);
    lm_case(19, 37, 11, 0); /* several row chunks, the last one partial */
    lm_case(19, 41, 6, 1);
}

// ---- sumsq and adamw

static void test_sumsq(void) {
    const int64_t n   = 3 * 65536 + 17;
    float        *x   = frand(n, -3, 3);
    double        got = -1, ref = 0, again = -1;
    for (int64_t i = 0; i < n; i++) ref += (double)x[i] * x[i];
    ok(be->sumsq(ctx, &got, x, n), "sumsq");
    ok(be->sumsq(ctx, &again, x, n), "sumsq");
    TST_CHECK(fabs(got - ref) <= 1e-12 * ref);
    TST_CHECK(got == again);
    ok(be->sumsq(ctx, &got, x, 0), "sumsq");
    TST_CHECK(got == 0);
    float small[3] = {1, -2, 3};
    ok(be->sumsq(ctx, &got, small, 3), "sumsq");
    TST_CHECK(got == 14.0);
    free(x);
}

static void test_adamw(void) {
    enum { N = 5, STEPS = 3 };
    const kn_adamw_params base = {
        .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f, .grad_scale = 0.5f};
    float  p[N] = {0.5f, -1.25f, 2.0f, 0.0f, -0.03125f}, m[N] = {0}, v[N] = {0};
    double pd[N], md[N] = {0}, vd[N] = {0};
    float  grads[STEPS][N] = {{0.1f, -0.2f, 0.3f, 1.0f, 0.0f},
                              {-0.4f, 0.5f, 0.25f, -1.0f, 2.0f},
                              {0.05f, 0.05f, -0.3f, 0.5f, -2.0f}};
    for (int i = 0; i < N; i++) pd[i] = p[i];
    for (int t = 1; t <= STEPS; t++) {
        kn_adamw_params hp = base;
        hp.step            = t;
        ok(be->adamw(ctx, p, grads[t - 1], m, v, N, &hp), "adamw");
        /* torch.optim.AdamW, single tensor: param.mul_(1 − lr·wd); exp_avg.lerp_(g, 1 − β1);
         * exp_avg_sq.mul_(β2).addcmul_(g, g, 1 − β2); denom = sqrt(v)/sqrt(bc2) + eps;
         * param.addcdiv_(exp_avg, denom, −lr/bc1) */
        const double lr = base.lr, b1 = base.beta1, b2 = base.beta2, eps = base.eps, wd = base.weight_decay;
        const double bc1 = 1 - pow(b1, t), bc2 = 1 - pow(b2, t);
        float        pf[N], mf[N], vf[N];
        for (int i = 0; i < N; i++) {
            const double g = (double)grads[t - 1][i] * base.grad_scale;
            pd[i] *= 1 - lr * wd;
            md[i] += (g - md[i]) * (1 - b1);
            vd[i] = vd[i] * b2 + (1 - b2) * g * g;
            pd[i] += -lr / bc1 * md[i] / (sqrt(vd[i]) / sqrt(bc2) + eps);
            pf[i] = (float)pd[i], mf[i] = (float)md[i], vf[i] = (float)vd[i];
        }
        TST_CLOSE("adamw param", p, pf, N, 1e-7, 1e-6);
        TST_CLOSE("adamw m", m, mf, N, 1e-9, 1e-6);
        TST_CLOSE("adamw v", v, vf, N, 1e-12, 1e-6);
    }

    /* step 1 without weight decay moves each param by lr·sign(g) (m̂/√v̂ = g/|g|) */
    float           p1[3] = {1, 1, 1}, g1[3] = {0.3f, -2.0f, 0.0f}, m1[3] = {0}, v1[3] = {0};
    kn_adamw_params hp = {
        .lr = 0.25f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 0, .weight_decay = 0, .grad_scale = 1, .step = 1};
    g1[2] = 1e-3f;
    ok(be->adamw(ctx, p1, g1, m1, v1, 3, &hp), "adamw");
    TST_CHECK(fabsf(p1[0] - 0.75f) < 1e-6f && fabsf(p1[1] - 1.25f) < 1e-6f && fabsf(p1[2] - 0.75f) < 1e-6f);
}

// ---- bad arguments: one clear error, never a crash

static void test_bad_args(void) {
    float   x[64] = {0}, y[64] = {0}, z[64] = {0};
    int32_t pos[4] = {0}, lab[2] = {0, 99}, am[2];
    double  d;
    TST_CHECK(be->gemm_dx(NULL, x, y, z, CM_DTYPE_F32, 1, 1, 1, 0) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->gemm_dx(ctx, x, y, z, CM_DTYPE_F32, -1, 1, 1, 0) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->gemm_dx(ctx, x, y, z, CM_DTYPE_F16, 1, 1, 1, 0) == CM_ERR_UNSUPPORTED);
    TST_CHECK(be->gemm_dx(ctx, x, NULL, z, CM_DTYPE_F32, 1, 1, 1, 0) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->gemm_dw(ctx, x, y, z, 1, -2, 1) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->gemm_dw(ctx, NULL, y, z, 1, 1, 1) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->rmsnorm_bwd(ctx, x, z, y, y, y, 2, 0, 1e-6f, 0) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->rmsnorm_bwd(ctx, x, z, x, y, y, 2, 4, 1e-6f, 0) == CM_ERR_INVALID_ARG); /* dinp = dout */
    TST_CHECK(be->rmsnorm_bwd(ctx, x, NULL, y, y, y, 2, 4, 1e-6f, 1) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->rope_bwd(ctx, x, pos, 2, 1, 4, 3, 1e4f) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->rope_bwd(ctx, x, pos, 2, 1, 4, 4, -1.0f) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->rope_bwd(ctx, x, NULL, 2, 1, 4, 4, 1e4f) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->swiglu_bwd(ctx, x, y, z, z, z, -1) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->swiglu_bwd(ctx, x, x, z, z, z, 4) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->swiglu_bwd(ctx, x, NULL, z, z, z, 4) == CM_ERR_INVALID_ARG);

    TST_CHECK(be->lm_ce(ctx, NULL, x, am, y, lab, NULL, z, CM_DTYPE_F32, 2, 8, 4) ==
              CM_ERR_INVALID_ARG); /* 99 */
    lab[1] = -1;
    TST_CHECK(be->lm_ce(ctx, NULL, x, am, y, lab, NULL, z, CM_DTYPE_F32, 2, 8, 4) == CM_ERR_INVALID_ARG);
    lab[1] = 1;
    TST_CHECK(be->lm_ce(ctx, NULL, x, am, y, lab, NULL, z, CM_DTYPE_F32, 2, 8, 4) == CM_OK);
    TST_CHECK(be->lm_ce(ctx, x + 8, x, am, y, lab, NULL, z, CM_DTYPE_F32, 2, 8, 4) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->lm_ce(ctx, NULL, x, am, y, lab, NULL, z, CM_DTYPE_F8_E4M3, 2, 8, 4) == CM_ERR_UNSUPPORTED);
    TST_CHECK(be->lm_ce(ctx, NULL, x, am, y, lab, NULL, z, CM_DTYPE_F32, 2, 0, 4) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->lm_ce(ctx, NULL, x, NULL, y, lab, NULL, z, CM_DTYPE_F32, 2, 8, 4) == CM_ERR_INVALID_ARG);

    TST_CHECK(be->sumsq(ctx, NULL, x, 4) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->sumsq(ctx, &d, NULL, 4) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->sumsq(ctx, &d, x, -4) == CM_ERR_INVALID_ARG);

    kn_adamw_params hp = {
        .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .grad_scale = 1, .step = 1};
    TST_CHECK(be->adamw(ctx, x, y, z, z + 8, 4, &hp) == CM_OK);
    TST_CHECK(be->adamw(ctx, x, y, z, z + 8, 4, NULL) == CM_ERR_INVALID_ARG);
    hp.step = 0;
    TST_CHECK(be->adamw(ctx, x, y, z, z + 8, 4, &hp) == CM_ERR_INVALID_ARG);
    hp.step = 1, hp.beta2 = 1.0f;
    TST_CHECK(be->adamw(ctx, x, y, z, z + 8, 4, &hp) == CM_ERR_INVALID_ARG);
    hp.beta2 = 0.999f, hp.lr = -1;
    TST_CHECK(be->adamw(ctx, x, y, z, z + 8, 4, &hp) == CM_ERR_INVALID_ARG);
    hp.lr = 1e-3f, hp.grad_scale = NAN;
    TST_CHECK(be->adamw(ctx, x, y, z, z + 8, 4, &hp) == CM_ERR_INVALID_ARG);
    hp.grad_scale = 1;
    TST_CHECK(be->adamw(ctx, x, NULL, z, z + 8, 4, &hp) == CM_ERR_INVALID_ARG);

    /* dflash: shapes, GQA, window, anchors outside the context, missing buffers */
    int32_t               anc[2] = {1, 3}, lo[2] = {0, 2};
    kn_dflash_attn_params good = {.T        = 4,
                                  .n_blocks = 2,
                                  .B        = 2,
                                  .nq       = 2,
                                  .nkv      = 1,
                                  .hd       = 4,
                                  .window   = 0,
                                  .scale    = 0.5f,
                                  .anchors  = anc,
                                  .ctx_lo   = lo,
                                  .q        = x,
                                  .k_ctx    = y,
                                  .v_ctx    = y,
                                  .k_blk    = z,
                                  .v_blk    = z,
                                  .out      = x + 32,
                                  .lse      = z + 32};
    TST_CHECK(be->dflash_attn_fwd(ctx, &good) == CM_OK);
    TST_CHECK(be->dflash_attn_fwd(ctx, NULL) == CM_ERR_INVALID_ARG);
    TST_CHECK(be->dflash_attn_fwd(NULL, &good) == CM_ERR_INVALID_ARG);
    kn_dflash_attn_params p = good;
    p.nq = 3, p.nkv = 2;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p = good, p.B = 0;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p = good, p.window = -1;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p = good, p.scale = INFINITY;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    anc[1] = 4; /* anchor == T */
    TST_CHECK(be->dflash_attn_fwd(ctx, &good) == CM_ERR_INVALID_ARG);
    anc[1] = 3, lo[1] = 4; /* ctx_lo > anchor */
    TST_CHECK(be->dflash_attn_fwd(ctx, &good) == CM_ERR_INVALID_ARG);
    lo[1] = -1;
    TST_CHECK(be->dflash_attn_fwd(ctx, &good) == CM_ERR_INVALID_ARG);
    lo[1] = 2;
    p = good, p.anchors = NULL;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p = good, p.k_ctx = NULL;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p = good, p.out = NULL;
    TST_CHECK(be->dflash_attn_fwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p = good; /* bwd without its gradient buffers */
    TST_CHECK(be->dflash_attn_bwd(ctx, &p) == CM_ERR_INVALID_ARG);
    p.dout = x, p.dq = x + 16, p.dk_blk = y + 16, p.dv_blk = y + 32, p.dk_ctx = z + 40;
    TST_CHECK(be->dflash_attn_bwd(ctx, &p) == CM_ERR_INVALID_ARG); /* dv_ctx missing */
    p.dv_ctx = z + 48;
    TST_CHECK(be->dflash_attn_bwd(ctx, &p) == CM_OK);
}

int main(void) {
    be                = kn_backend_cpu();
    kn_ctx_config cfg = KN_CTX_CONFIG_DEFAULT;
    if (be->ctx_create(&ctx, &cfg) != CM_OK) {
        fprintf(stderr, "cannot create a cpu context: %s\n", cm_last_error());
        return 1;
    }
    test_gemm_bwd();
    test_rmsnorm_bwd();
    test_rope_bwd();
    test_swiglu_bwd();
    test_dflash_attn();
    test_lm_ce();
    test_sumsq();
    test_adamw();
    test_bad_args();
    be->ctx_destroy(&ctx);
    return tst_report();
}
