/* kernels/ref/kn_gemm_ref.c — reference GEMM: out[M, N] = inp[M, K] · W[N, K]ᵀ, W in F32 or
 * BF16. Every output is one kn_ref_dot over K of F32 values (BF16 widened exactly): exact
 * products, a double sum, one rounding. Work is split into tiles of GEMM_MB inp rows ×
 * GEMM_NB W rows, run in parallel under OpenMP; a BF16 tile of W is widened once per tile
 * into a per-thread buffer, so the inner loop is F32 × F32. The backward pair gemm_dx and
 * gemm_dw (see their section) sums each output over the reduction index in order;
 * gemm_bf16in widens its BF16 input and runs gemm. Fast enough for CPU training of small
 * drafters; not a tuned BLAS. */
#include "kn_ref.h"

#include <stdlib.h>
#include <string.h>

#define GEMM_MB 16
#define GEMM_NB 16

/* One gemm: its operands and the number of W-row tiles. */
typedef struct {
    float       *out;
    const float *inp;
    const void  *w;
    int64_t      M, N, K, n_nt;
    int          widen; /* W is BF16: each tile widened into the scratch */
} gemm_tiles;

/* Tile `tile` (GEMM_MB inp rows × GEMM_NB W rows) of out; wbuf holds GEMM_NB × K floats when widening. */
static void gemm_tile(int64_t tile, void *wbuf, const void *user) {
    const gemm_tiles *g = user;
    const int64_t     M = g->M, N = g->N, K = g->K;
    const int64_t     m0 = (tile / g->n_nt) * GEMM_MB, m1 = m0 + GEMM_MB < M ? m0 + GEMM_MB : M;
    const int64_t     n0 = (tile % g->n_nt) * GEMM_NB, n1 = n0 + GEMM_NB < N ? n0 + GEMM_NB : N;
    const float      *wt;
    if (g->widen) {
        const uint16_t *src = (const uint16_t *)g->w + n0 * K;
        float          *dst = wbuf;
        for (int64_t i = 0; i < (n1 - n0) * K; i++)
            dst[i] = cm_bf16_to_f32(src[i]);
        wt = dst;
    } else {
        wt = (const float *)g->w + n0 * K;
    }
    for (int64_t m = m0; m < m1; m++) {
        const float *a = g->inp + m * K;
        for (int64_t n = n0; n < n1; n++)
            g->out[m * N + n] = (float)kn_ref_dot(a, wt + (n - n0) * K, K);
    }
}

cm_status kn_ref_gemm(kn_ctx *ctx, float *out, const float *inp, const void *w, cm_dtype wdt, int64_t M,
                      int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "gemm: ctx is NULL");
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                 (long long)M, (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (M == 0 || N == 0) return CM_OK;
    KN_REF_CHECK(out && inp && (w || K == 0), "gemm: out, inp or w is NULL");

    const gemm_tiles g = {out, inp, w, M, N, K, (N + GEMM_NB - 1) / GEMM_NB, wdt == CM_DTYPE_BF16};
    const int64_t    n_tiles = (M + GEMM_MB - 1) / GEMM_MB * g.n_nt;
    return kn_ref_parallel("gemm", n_tiles, 1, g.widen ? (size_t)GEMM_NB * (size_t)K * sizeof(float) : 0,
                           gemm_tile, &g);
}

// ---- backward: gemm_dx and gemm_dw
// Both are out[i, k] (+)= Σ_r A(r, i)·B[r, k] over the reduction index r in order, with
// gemm_dx: i = m, r = n, A(r, i) = dout[m, n], B = W; gemm_dw: i = n, r = m, A(r, i) =
// dout[m, n], B = inp. An output tile of BWD_IB × BWD_KB doubles stays in cache (on the
// stack) while r sweeps the whole reduction, so each row segment of B is copied (a BF16 one
// widened) once per tile into a zero-padded buffer and used for BWD_IB outputs; the padded,
// fixed-length inner loop is what the compiler vectorises. Tiles run in parallel; each output
// belongs to one tile and is summed in one fixed order, so results do not depend on threads.

#define BWD_IB 32
#define BWD_KB 128

typedef struct bwd_gemm {
    float       *out;
    const float *a;
    int64_t      a_rs, a_is; /* A(r, i) = a[r·a_rs + i·a_is] */
    const void  *b;          /* [R, K], row stride K, in bdt */
    cm_dtype     bdt;
    int64_t      n_i, n_r, K;
    int          accumulate;
} bwd_gemm;

static void bwd_gemm_tile(const bwd_gemm *g, int64_t i0, int64_t i1, int64_t k0, int64_t k1) {
    double        acc[BWD_IB * BWD_KB];
    float         wrow[BWD_KB];
    const int64_t ni = i1 - i0, nk = k1 - k0;
    for (int64_t j = 0; j < ni * BWD_KB; j++) acc[j] = 0;
    for (int64_t kk = nk; kk < BWD_KB; kk++) wrow[kk] = 0;
    for (int64_t r = 0; r < g->n_r; r++) {
        if (g->bdt == CM_DTYPE_BF16) {
            const uint16_t *src = (const uint16_t *)g->b + r * g->K + k0;
            for (int64_t kk = 0; kk < nk; kk++) wrow[kk] = cm_bf16_to_f32(src[kk]);
        } else {
            memcpy(wrow, (const float *)g->b + r * g->K + k0, (size_t)nk * sizeof(float));
        }
        const float *ar = g->a + r * g->a_rs;
        for (int64_t i = 0; i < ni; i++) {
            const double d  = (double)ar[(i0 + i) * g->a_is];
            double      *ac = acc + i * BWD_KB;
            for (int kk = 0; kk < BWD_KB; kk++) ac[kk] += d * (double)wrow[kk]; /* fixed trip count: vectorised */
        }
    }
    for (int64_t i = 0; i < ni; i++) {
        float        *o  = g->out + (i0 + i) * g->K + k0;
        const double *ac = acc + i * BWD_KB;
        for (int64_t kk = 0; kk < nk; kk++) o[kk] = (float)(g->accumulate ? (double)o[kk] + ac[kk] : ac[kk]);
    }
}

static void bwd_gemm_run(const bwd_gemm *g) {
    const int64_t n_it = (g->n_i + BWD_IB - 1) / BWD_IB;
    const int64_t n_kt = (g->K + BWD_KB - 1) / BWD_KB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t tile = 0; tile < n_it * n_kt; tile++) {
        const int64_t i0 = (tile / n_kt) * BWD_IB, k0 = (tile % n_kt) * BWD_KB;
        bwd_gemm_tile(g, i0, i0 + BWD_IB < g->n_i ? i0 + BWD_IB : g->n_i, k0,
                      k0 + BWD_KB < g->K ? k0 + BWD_KB : g->K);
    }
}

cm_status kn_ref_gemm_dx(kn_ctx *ctx, float *dinp, const float *dout, const void *w, cm_dtype wdt, int64_t M,
                         int64_t N, int64_t K, int accumulate) {
    KN_REF_CHECK(ctx, "gemm_dx: ctx is NULL");
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm_dx: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                 (long long)M, (long long)N, (long long)K);
    if (wdt != CM_DTYPE_F32 && wdt != CM_DTYPE_BF16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gemm_dx: weight dtype %s is not supported (use F32 or BF16)",
                       cm_dtype_name(wdt));
    if (M == 0 || K == 0) return CM_OK;
    KN_REF_CHECK(dinp && (N == 0 || (dout && w)), "gemm_dx: dinp, dout or w is NULL");
    bwd_gemm g = {dinp, dout, 1, N, w, wdt, M, N, K, accumulate != 0};
    bwd_gemm_run(&g);
    return CM_OK;
}

cm_status kn_ref_gemm_dw(kn_ctx *ctx, float *dw, const float *dout, const float *inp, int64_t M, int64_t N,
                         int64_t K) {
    KN_REF_CHECK(ctx, "gemm_dw: ctx is NULL");
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm_dw: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                 (long long)M, (long long)N, (long long)K);
    if (M == 0 || N == 0 || K == 0) return CM_OK;
    KN_REF_CHECK(dw && dout && inp, "gemm_dw: dw, dout or inp is NULL");
    bwd_gemm g = {dw, dout, N, 1, inp, CM_DTYPE_F32, N, M, K, 1};
    bwd_gemm_run(&g);
    return CM_OK;
}

// ---- bf16 GEMM input (target forward under --precision bf16)

int kn_ref_gemm_rounds_input(const kn_ctx *ctx) {
    (void)ctx;
    return 0;
}

cm_status kn_ref_gemm_bf16in(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt, int64_t M,
                             int64_t N, int64_t K) {
    KN_REF_CHECK(ctx, "gemm_bf16in: ctx is NULL");
    KN_REF_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm_bf16in: bad shape M=%lld N=%lld K=%lld (each must be >= 0)",
                 (long long)M, (long long)N, (long long)K);
    if (M == 0 || N == 0) return kn_ref_gemm(ctx, out, NULL, w, wdt, M, N, K);
    KN_REF_CHECK(inp || K == 0, "gemm_bf16in: inp is NULL");
    const size_t n   = (size_t)M * (size_t)K;
    float       *wid = malloc((n ? n : 1) * sizeof(float));
    if (!wid) return CM_FAIL(CM_ERR_NOMEM, "gemm_bf16in: cannot allocate %zu floats to widen the input", n);
    for (size_t i = 0; i < n; i++) wid[i] = cm_bf16_to_f32(inp[i]);
    cm_status st = kn_ref_gemm(ctx, out, wid, w, wdt, M, N, K);
    free(wid);
    return st;
}

cm_status kn_ref_gemm_bf16in_acc(kn_ctx *ctx, float *out, const uint16_t *inp, const void *w, cm_dtype wdt,
                                 int64_t M, int64_t N, int64_t K) {
    KN_REF_CHECK(M >= 0 && N >= 0, "gemm_bf16in_acc: bad shape M=%lld N=%lld (each must be >= 0)", (long long)M,
                 (long long)N);
    if (M == 0 || N == 0) return kn_ref_gemm_bf16in(ctx, out, inp, w, wdt, M, N, K);
    KN_REF_CHECK(out, "gemm_bf16in_acc: out is NULL");
    float *y = malloc((size_t)M * (size_t)N * sizeof *y);
    if (!y)
        return CM_FAIL(CM_ERR_NOMEM, "gemm_bf16in_acc: cannot allocate the %lld x %lld product", (long long)M,
                       (long long)N);
    cm_status st = kn_ref_gemm_bf16in(ctx, y, inp, w, wdt, M, N, K);
    if (st == CM_OK) st = kn_ref_add(ctx, out, y, M * N);
    free(y);
    return st;
}
