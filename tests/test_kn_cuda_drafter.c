/* tests/test_kn_cuda_drafter.c — the cuda drafter-training ops against the cpu reference
 * (the specification, kernels/ref/), forward and backward, through the kn_backend tables:
 * gemm_dx, gemm_dw, rmsnorm_bwd, rope_bwd, swiglu_bwd, sumsq, adamw, lm_ce and the DFlash
 * block attention (fwd and bwd). Random inputs from a fixed seed, the same call on both
 * backends, an elementwise comparison |cuda − cpu| ≤ atol + rtol·|cpu| (GEMMs: ≤ tol·Σ|a·b|,
 * the rounding bound of a dot product), at least 3 shapes per op with odd sizes. Each
 * comparison prints its max abs error and worst error/tolerance ratio, and the run ends with
 * the worst ratio per op, so one GPU run says which op, which shape and how far.
 * Tolerances (why):
 * - fp32 elementwise ops evaluated in double on both sides (swiglu_bwd, rope_bwd, adamw,
 *   rmsnorm_bwd): 1e-5 relative (a few fp32 ulps: double exp/sincos differ by an ulp between
 *   host and device libm, then one rounding);
 * - sumsq: double sums in different orders: 1e-12 relative;
 * - GEMMs in F32 mode: fp32 products and sums, error ~ eps·sqrt(K)·Σ|a·b|: 1e-5 of the bound;
 *   in BF16 mode each input is rounded to 8 bits of mantissa (2^-9 relative): 1e-2 of it;
 * - lm_ce (F32 mode): fp32 logits (|error| ~ 1e-6 for the sizes here) feed a log-sum-exp in
 *   double: ce within 1e-5·(1 + |ce|); dh 1e-4 of the largest |dh| plus 1e-4 relative;
 *   BF16 mode 2e-2 of the same scales; argmax equal unless the reference's two top logits are
 *   within 1e-4 (a near tie that fp32 may order either way);
 * - DFlash attention: fp32 dots over hd and online-softmax sums over up to ~1000 keys give
 *   ~1e-6 relative; the backward's dS = P·(dp − Δ) cancels, so its error is relative to the
 *   tensor's scale: out 2e-5 of max|out| + 1e-4 relative, lse 2e-5 absolute (lse ~ O(1..10)),
 *   dq/dk/dv 1e-4 of max|·| + 1e-3 relative. A wrong mask or a missed tile gives O(1) errors.
 * - DFlash attention in BF16 mode (the bf16 tensor-core kernels where the shape allows,
 *   else the fp32 fallback): Q, K, V, dO, P and dS are rounded to bf16 (2^-9 relative) with
 *   fp32 sums, so every output within 3e-2 of its tensor's scale (+3e-2 relative; lse 3e-2
 *   absolute) and each tensor's relative L2 error ≤ 2e-2.
 * Head_dim 64 and 128 run again with TANDEM_DFLASH_KERNEL=wgmma (the wgmma kernels on compute
 * capability 9.0, mma.sync elsewhere), to the same tolerances.
 * The backward is also run twice and must give the same bits (no atomics). Label gpu: exits
 * 77 when the build has no cuda backend or the machine has no cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

// ----------------------------------------------------------------------------
// helpers (random numbers, comparisons, the cpu/cuda pair: tst_kn.h, tst_kn_pair.h)

/* Downloads both sides of b; work queued on either cuda context is finished first. */
static void get_both(const dbuf *b, size_t bytes, void *c_out, void *g_out) {
    if (gpu->sync(gctx16) != CM_OK || cpu->download(cctx, c_out, b->c, bytes) != CM_OK ||
        gpu->download(gctx, g_out, b->g, bytes) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

/* The worst error/tolerance ratio seen per op, for the closing summary. */
#define N_OPS 14
static const char *op_names[N_OPS] = {"gemm_dx",    "gemm_dw",    "rmsnorm_bwd", "rope_bwd",   "swiglu_bwd",
                                      "sumsq",      "adamw",      "lm_ce",       "dflash_fwd", "dflash_bwd",
                                      "lm_ce bf16", "gemm bf16",  "dflash_fwd bf16", "dflash_bwd bf16"};
static double      op_worst[N_OPS];
static double      op_max_abs[N_OPS];

static void note(int op, double worst, double max_abs) {
    if (!(worst <= op_worst[op]))
        op_worst[op] = worst;
    if (max_abs > op_max_abs[op])
        op_max_abs[op] = max_abs;
}

/* |got − ref| ≤ atol + rtol·|ref|, elementwise; prints max abs error and worst ratio. */
static void compare(int op, const char *name, const float *got, const float *ref, long n, double atol,
                    double rtol) {
    tst_err e;
    tst_compare(name, 64, got, ref, n, atol, rtol, &e);
    note(op, e.worst, e.max_abs);
}

/* compare() with atol = scale_tol·max|ref|: for outputs whose error scales with the tensor. */
static void compare_scaled(int op, const char *name, const float *got, const float *ref, long n, double scale_tol,
                           double rtol) {
    compare(op, name, got, ref, n, scale_tol * tst_max_abs(ref, n) + 1e-30, rtol);
}

/* Compares dbuf b (n floats) between the backends. */
static void compare_buf(int op, const char *name, const dbuf *b, long n, double atol, double rtol) {
    float *c = tst_xcalloc((size_t)n * 4), *g = tst_xcalloc((size_t)n * 4);
    get_both(b, (size_t)n * 4, c, g);
    compare(op, name, g, c, n, atol, rtol);
    free(c);
    free(g);
}

/* |got − ref| ≤ tol·bound elementwise (bound = Σ|a·b| of each output). */
static void compare_bound(int op, const char *name, const float *got, const float *ref, const double *bound, long n,
                          double tol) {
    tst_err e;
    tst_compare_bound(name, 64, got, ref, bound, n, tol, &e);
    note(op, e.worst, e.max_abs);
}

// ----------------------------------------------------------------------------
// gemm_dx, gemm_dw

/* dinp[M, K] (=/+=) dout[M, N]·W[N, K] and dw[N, K] += dout[M, N]ᵀ·inp[M, K], W in F32 and
 * BF16, both GEMM modes, accumulate off and on. */
static void gemm_bwd_case(long M, long N, long K) {
    float *dout = tst_rand_f32(M * N, -1, 1), *w = tst_rand_f32(N * K, -1, 1),
          *inp = tst_rand_f32(M * K, -1, 1);
    float    *init = tst_rand_f32(M * K > N * K ? M * K : N * K, -1, 1);
    uint16_t *w16 = tst_xcalloc((size_t)(N * K) * 2);
    for (long i = 0; i < N * K; i++)
        w16[i] = tst_bf16_round(w[i]);
    dbuf    bd = dbuf_put(dout, (size_t)(M * N) * 4), bw = dbuf_put(w, (size_t)(N * K) * 4);
    dbuf    bw16 = dbuf_put(w16, (size_t)(N * K) * 2), bi = dbuf_put(inp, (size_t)(M * K) * 4);
    long    n_out = M * K > N * K ? M * K : N * K;
    dbuf    bo = dbuf_put(NULL, (size_t)n_out * 4);
    float  *ref = tst_xcalloc((size_t)n_out * 4), *got = tst_xcalloc((size_t)n_out * 4);
    double *bound = tst_xcalloc((size_t)n_out * sizeof(double));
    char    name[128];

    for (int wi = 0; wi < 2; wi++)
        for (int acc = 0; acc < 2; acc++) {
            /* bound: Σ_n |dout·W| with the weights the reference saw, plus |init| when accumulating */
            for (long m = 0; m < M; m++)
                for (long k = 0; k < K; k++) {
                    double s = acc ? fabs((double)init[m * K + k]) : 0;
                    for (long n = 0; n < N; n++)
                        s += fabs((double)dout[m * N + n] *
                                  (double)(wi ? tst_bf16_widen(w16[n * K + k]) : w[n * K + k]));
                    bound[m * K + k] = s;
                }
            for (int mode = 0; mode < 2; mode++) {
                kn_ctx *g = mode ? gctx16 : gctx;
                cpu->upload(cctx, bo.c, init, (size_t)(M * K) * 4);
                gpu->upload(gctx, bo.g, init, (size_t)(M * K) * 4);
                tst_ok(cpu->gemm_dx(cctx, bo.c, bd.c, wi ? bw16.c : bw.c, wi ? CM_DTYPE_BF16 : CM_DTYPE_F32, M, N, K,
                                     acc),
                        "cpu gemm_dx");
                tst_ok(gpu->gemm_dx(g, bo.g, bd.g, wi ? bw16.g : bw.g, wi ? CM_DTYPE_BF16 : CM_DTYPE_F32, M, N, K,
                                     acc),
                        "cuda gemm_dx");
                get_both(&bo, (size_t)(M * K) * 4, ref, got);
                snprintf(name, sizeof name, "gemm_dx %s-mode W=%s M=%ld N=%ld K=%ld%s", mode ? "BF16" : "F32",
                         wi ? "BF16" : "F32", M, N, K, acc ? " +=" : "");
                compare_bound(mode ? 11 : 0, name, got, ref, bound, M * K, mode ? 1e-2 : 1e-5);
            }
        }
    for (long n = 0; n < N; n++)
        for (long k = 0; k < K; k++) {
            double s = fabs((double)init[n * K + k]);
            for (long m = 0; m < M; m++)
                s += fabs((double)dout[m * N + n] * (double)inp[m * K + k]);
            bound[n * K + k] = s;
        }
    for (int mode = 0; mode < 2; mode++) {
        cpu->upload(cctx, bo.c, init, (size_t)(N * K) * 4);
        gpu->upload(gctx, bo.g, init, (size_t)(N * K) * 4);
        tst_ok(cpu->gemm_dw(cctx, bo.c, bd.c, bi.c, M, N, K), "cpu gemm_dw");
        tst_ok(gpu->gemm_dw(mode ? gctx16 : gctx, bo.g, bd.g, bi.g, M, N, K), "cuda gemm_dw");
        get_both(&bo, (size_t)(N * K) * 4, ref, got);
        snprintf(name, sizeof name, "gemm_dw %s-mode M=%ld N=%ld K=%ld (+=)", mode ? "BF16" : "F32", M, N, K);
        compare_bound(mode ? 11 : 1, name, got, ref, bound, N * K, mode ? 1e-2 : 1e-5);
    }
    dbuf_free(&bd);
    dbuf_free(&bw);
    dbuf_free(&bw16);
    dbuf_free(&bi);
    dbuf_free(&bo);
    free(dout);
    free(w);
    free(inp);
    free(init);
    free(w16);
    free(ref);
    free(got);
    free(bound);
}

static void test_gemm_bwd(void) {
    gemm_bwd_case(1, 1, 1);
    gemm_bwd_case(7, 13, 29);
    gemm_bwd_case(130, 257, 96);
    gemm_bwd_case(1023, 65, 33);
}

// ----------------------------------------------------------------------------
// rmsnorm_bwd, rope_bwd, swiglu_bwd

static void test_rmsnorm_bwd(void) {
    static const long shapes[][2] = {{1, 1}, {37, 64}, {1500, 257}, {3, 5120}}; /* rows C */
    for (int s = 0; s < 4; s++) {
        const long rows = shapes[s][0], C = shapes[s][1];
        float     *x = tst_rand_f32(rows * C, -2, 2), *dy = tst_rand_f32(rows * C, -1, 1),
              *w = tst_rand_f32(C, -0.5, 1.5);
        float     *dw0 = tst_rand_f32(C, -1, 1);
        dbuf       bx = dbuf_put(x, (size_t)(rows * C) * 4), bdy = dbuf_put(dy, (size_t)(rows * C) * 4);
        dbuf       bw = dbuf_put(w, (size_t)C * 4), bdx = dbuf_put(NULL, (size_t)(rows * C) * 4);
        for (int one_plus = 0; one_plus < 2; one_plus++) {
            dbuf bdw = dbuf_put(dw0, (size_t)C * 4);
            tst_ok(cpu->rmsnorm_bwd(cctx, bdx.c, bdw.c, bdy.c, bx.c, bw.c, rows, C, 1e-6f, one_plus),
                    "cpu rmsnorm_bwd");
            tst_ok(gpu->rmsnorm_bwd(gctx, bdx.g, bdw.g, bdy.g, bx.g, bw.g, rows, C, 1e-6f, one_plus),
                    "cuda rmsnorm_bwd");
            char name[96];
            /* dx = r·s·dy − x·k cancels where the two terms meet: 1e-6 of the row scale */
            float *c = tst_xcalloc((size_t)(rows * C) * 4), *g = tst_xcalloc((size_t)(rows * C) * 4);
            get_both(&bdx, (size_t)(rows * C) * 4, c, g);
            snprintf(name, sizeof name, "rmsnorm_bwd dx rows=%ld C=%ld one_plus=%d", rows, C, one_plus);
            compare_scaled(2, name, g, c, rows * C, 1e-6, 1e-5);
            snprintf(name, sizeof name, "rmsnorm_bwd dw (+=) rows=%ld C=%ld one_plus=%d", rows, C, one_plus);
            compare_buf(2, name, &bdw, C, 1e-6, 1e-5);
            free(c);
            free(g);
            dbuf_free(&bdw);
        }
        dbuf_free(&bx);
        dbuf_free(&bdy);
        dbuf_free(&bw);
        dbuf_free(&bdx);
        free(x);
        free(dy);
        free(w);
        free(dw0);
    }
}

static void test_rope_bwd(void) {
    static const struct {
        long  T;
        int   nh, hd, rot;
        float theta;
        int   pos_max;
    } cases[] = {{1, 1, 2, 2, 1e4f, 1}, {37, 3, 16, 16, 1e7f, 200}, {130, 5, 128, 128, 1e6f, 262143},
                 {65, 2, 30, 10, 1e6f, 4096}};
    for (int s = 0; s < 4; s++) {
        const long T = cases[s].T;
        const int  nh = cases[s].nh, hd = cases[s].hd, rot = cases[s].rot;
        float     *x = tst_rand_f32(T * nh * hd, -2, 2);
        int32_t   *pos = tst_xcalloc((size_t)T * 4);
        for (long t = 0; t < T; t++)
            pos[t] = (int32_t)(tst_urand() * cases[s].pos_max);
        pos[T - 1] = cases[s].pos_max - 1;
        dbuf bx = dbuf_put(x, (size_t)(T * nh * hd) * 4), bp = dbuf_put(pos, (size_t)T * 4);
        tst_ok(cpu->rope_bwd(cctx, bx.c, bp.c, T, nh, hd, rot, cases[s].theta), "cpu rope_bwd");
        tst_ok(gpu->rope_bwd(gctx, bx.g, bp.g, T, nh, hd, rot, cases[s].theta), "cuda rope_bwd");
        char name[96];
        snprintf(name, sizeof name, "rope_bwd T=%ld heads=%d hd=%d rot=%d pos<%d", T, nh, hd, rot, cases[s].pos_max);
        compare_buf(3, name, &bx, T * nh * hd, 1e-6, 1e-5);
        dbuf_free(&bx);
        dbuf_free(&bp);
        free(x);
        free(pos);
    }
}

static void test_swiglu_bwd(void) {
    static const long ns[] = {1, 1000, 100003};
    for (int s = 0; s < 3; s++) {
        const long n = ns[s];
        float     *d = tst_rand_f32(n, -1, 1), *gt = tst_rand_f32(n, -8, 8), *up = tst_rand_f32(n, -2, 2);
        gt[0] = -1.2785f; /* near the zero of 1 + g·(1 − σ(g)) */
        dbuf bd = dbuf_put(d, (size_t)n * 4), bg = dbuf_put(gt, (size_t)n * 4), bu = dbuf_put(up, (size_t)n * 4);
        dbuf bdg = dbuf_put(NULL, (size_t)n * 4), bdu = dbuf_put(NULL, (size_t)n * 4);
        tst_ok(cpu->swiglu_bwd(cctx, bdg.c, bdu.c, bd.c, bg.c, bu.c, n), "cpu swiglu_bwd");
        tst_ok(gpu->swiglu_bwd(gctx, bdg.g, bdu.g, bd.g, bg.g, bu.g, n), "cuda swiglu_bwd");
        char name[64];
        snprintf(name, sizeof name, "swiglu_bwd dgate n=%ld", n);
        compare_buf(4, name, &bdg, n, 1e-12, 1e-5);
        snprintf(name, sizeof name, "swiglu_bwd dup n=%ld", n);
        compare_buf(4, name, &bdu, n, 1e-12, 1e-5);
        dbuf_free(&bd);
        dbuf_free(&bg);
        dbuf_free(&bu);
        dbuf_free(&bdg);
        dbuf_free(&bdu);
        free(d);
        free(gt);
        free(up);
    }
}

// ----------------------------------------------------------------------------
// sumsq, adamw

static void test_sumsq(void) {
    static const long ns[] = {1, 8191, 8193, 1000003};
    for (int s = 0; s < 4; s++) {
        const long n = ns[s];
        float     *x = tst_rand_f32(n, -3, 3);
        dbuf       bx = dbuf_put(x, (size_t)n * 4);
        double     c = -1, g = -1, g2 = -2;
        tst_ok(cpu->sumsq(cctx, &c, bx.c, n), "cpu sumsq");
        tst_ok(gpu->sumsq(gctx, &g, bx.g, n), "cuda sumsq");
        tst_ok(gpu->sumsq(gctx, &g2, bx.g, n), "cuda sumsq again");
        const double rel = fabs(g - c) / c;
        TST_CHECK(rel <= 1e-12);
        TST_CHECK(memcmp(&g, &g2, sizeof g) == 0);
        note(5, rel / 1e-12, fabs(g - c));
        printf("%-64s cpu %.17g cuda %.17g rel %.1e %s%s\n", "sumsq", c, g, rel, rel <= 1e-12 ? "ok" : "FAIL",
               memcmp(&g, &g2, sizeof g) == 0 ? ", repeat bit-identical" : ", REPEAT DIFFERS");
        (void)n;
        dbuf_free(&bx);
        free(x);
    }
    double z = -1;
    tst_ok(gpu->sumsq(gctx, &z, NULL, 0), "cuda sumsq n=0");
    TST_CHECK(z == 0);
}

static void test_adamw(void) {
    static const long ns[] = {1, 1001, 100003};
    for (int s = 0; s < 3; s++) {
        const long      n = ns[s];
        float          *p = tst_rand_f32(n, -1, 1), *gr = tst_rand_f32(n, -0.1, 0.1),
              *m = tst_rand_f32(n, -0.01, 0.01);
        float          *v = tst_rand_f32(n, 0, 1e-4);
        kn_adamw_params ap = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, s == 0 ? 1 : 7 + s};
        dbuf            bp = dbuf_put(p, (size_t)n * 4), bg = dbuf_put(gr, (size_t)n * 4);
        dbuf            bm = dbuf_put(m, (size_t)n * 4), bv = dbuf_put(v, (size_t)n * 4);
        for (int it = 0; it < 3; it++) { /* three steps in a row: state carried on each side */
            ap.step += it;
            tst_ok(cpu->adamw(cctx, bp.c, bg.c, bm.c, bv.c, n, &ap), "cpu adamw");
            tst_ok(gpu->adamw(gctx, bp.g, bg.g, bm.g, bv.g, n, &ap), "cuda adamw");
        }
        char name[64];
        snprintf(name, sizeof name, "adamw param n=%ld (3 steps)", n);
        compare_buf(6, name, &bp, n, 1e-7, 1e-5);
        snprintf(name, sizeof name, "adamw m n=%ld", n);
        compare_buf(6, name, &bm, n, 1e-10, 1e-5);
        snprintf(name, sizeof name, "adamw v n=%ld", n);
        compare_buf(6, name, &bv, n, 1e-14, 1e-5);
        dbuf_free(&bp);
        dbuf_free(&bg);
        dbuf_free(&bm);
        dbuf_free(&bv);
        free(p);
        free(gr);
        free(m);
        free(v);
    }
}

// ----------------------------------------------------------------------------
// lm_ce

static void lm_ce_case(long R, long V, long D, int w_bf16, int with_dh) {
    float    *h = tst_rand_f32(R * D, -1, 1), *w = tst_rand_f32(V * D, -1, 1), *gs = tst_rand_f32(R, 0, 1);
    uint16_t *w16 = tst_xcalloc((size_t)(V * D) * 2);
    int32_t  *lab = tst_xcalloc((size_t)R * 4);
    for (long i = 0; i < V * D; i++) {
        w16[i] = tst_bf16_round(w[i]);
        if (w_bf16)
            w[i] = tst_bf16_widen(w16[i]); /* the host copy holds what the kernels see */
    }
    for (long r = 0; r < R; r++) {
        lab[r] = (int32_t)(tst_urand() * (double)V);
        if (r % 5 == 3)
            gs[r] = 0; /* rows that do not count: zero gradient */
    }
    lab[R - 1] = (int32_t)(V - 1);
    dbuf bh = dbuf_put(h, (size_t)(R * D) * 4), bl = dbuf_put(lab, (size_t)R * 4), bg = dbuf_put(gs, (size_t)R * 4);
    dbuf bw = w_bf16 ? dbuf_put(w16, (size_t)(V * D) * 2) : dbuf_put(w, (size_t)(V * D) * 4);
    dbuf bdh = dbuf_put(NULL, (size_t)(R * D) * 4), bce = dbuf_put(NULL, (size_t)R * 4), bam = dbuf_put(NULL, (size_t)R * 4);
    const cm_dtype wdt = w_bf16 ? CM_DTYPE_BF16 : CM_DTYPE_F32;
    tst_ok(cpu->lm_ce(cctx, with_dh ? bdh.c : NULL, bce.c, bam.c, bh.c, bl.c, bg.c, bw.c, wdt, R, V, D), "cpu lm_ce");
    float   *ce_c = tst_xcalloc((size_t)R * 4), *dh_c = tst_xcalloc((size_t)(R * D) * 4);
    float   *ce_g = tst_xcalloc((size_t)R * 4), *dh_g = tst_xcalloc((size_t)(R * D) * 4);
    int32_t *am_c = tst_xcalloc((size_t)R * 4), *am_g = tst_xcalloc((size_t)R * 4);
    cpu->download(cctx, ce_c, bce.c, (size_t)R * 4);
    cpu->download(cctx, am_c, bam.c, (size_t)R * 4);
    cpu->download(cctx, dh_c, bdh.c, (size_t)(R * D) * 4);
    for (int mode = 0; mode < 2; mode++) {
        kn_ctx *g = mode ? gctx16 : gctx;
        tst_ok(gpu->lm_ce(g, with_dh ? bdh.g : NULL, bce.g, bam.g, bh.g, bl.g, bg.g, bw.g, wdt, R, V, D),
                "cuda lm_ce");
        gpu->download(g, ce_g, bce.g, (size_t)R * 4);
        gpu->download(g, am_g, bam.g, (size_t)R * 4);
        gpu->download(g, dh_g, bdh.g, (size_t)(R * D) * 4);
        const double tol = mode ? 2e-2 : 1e-5;
        char         name[128];
        snprintf(name, sizeof name, "lm_ce %s-mode ce R=%ld V=%ld D=%ld W=%s", mode ? "BF16" : "F32", R, V, D,
                 w_bf16 ? "BF16" : "F32");
        compare(mode ? 10 : 7, name, ce_g, ce_c, R, tol, tol);
        if (with_dh) {
            snprintf(name, sizeof name, "lm_ce %s-mode dh R=%ld V=%ld D=%ld W=%s", mode ? "BF16" : "F32", R, V, D,
                     w_bf16 ? "BF16" : "F32");
            compare_scaled(mode ? 10 : 7, name, dh_g, dh_c, R * D, mode ? 2e-2 : 1e-4, mode ? 2e-2 : 1e-4);
        }
        if (mode == 0) { /* argmax: equal, or a near tie of the double logits */
            int bad = 0, ties = 0;
            for (long r = 0; r < R; r++) {
                if (am_g[r] == am_c[r])
                    continue;
                double lc = 0, lg = 0;
                for (long d = 0; d < D; d++) {
                    lc += (double)h[r * D + d] * (double)w[(long)am_c[r] * D + d];
                    lg += (double)h[r * D + d] * (double)w[(long)am_g[r] * D + d];
                }
                if (am_g[r] >= 0 && am_g[r] < V && fabs(lc - lg) <= 1e-4)
                    ties++;
                else
                    bad++;
            }
            TST_CHECK(bad == 0);
            printf("%-64s %ld rows: %ld equal, %d near ties, %d wrong %s\n", "lm_ce argmax", R, R - ties - bad, ties,
                   bad, bad ? "FAIL" : "ok");
        }
    }
    dbuf_free(&bh);
    dbuf_free(&bl);
    dbuf_free(&bg);
    dbuf_free(&bw);
    dbuf_free(&bdh);
    dbuf_free(&bce);
    dbuf_free(&bam);
    free(h);
    free(w);
    free(gs);
    free(w16);
    free(lab);
    free(ce_c);
    free(dh_c);
    free(ce_g);
    free(dh_g);
    free(am_c);
    free(am_g);
}

static void test_lm_ce(void) {
    lm_ce_case(1, 1, 1, 0, 1);
    lm_ce_case(5, 37, 16, 0, 1);
    lm_ce_case(130, 5003, 64, 0, 1);
    lm_ce_case(130, 5003, 64, 1, 1);
    lm_ce_case(77, 1000, 33, 0, 0);   /* no dh */
    lm_ce_case(2100, 20011, 16, 1, 1); /* two row tiles (2048 + 52) and three vocab chunks */
}

// ----------------------------------------------------------------------------
// DFlash block attention

typedef struct attn_case {
    const char *what;
    int         n_docs;
    int         lens[6];
    int         n_blocks, B, nq, nkv, hd;
    int         windows[3]; /* tried in turn; 0 = full attention; -1 ends */
} attn_case;

static kn_ctx *gctx_wgmma; /* bf16 mode with TANDEM_DFLASH_KERNEL=wgmma, or NULL */

static void attn_run(const attn_case *ac, int window, int causal) {
    int32_t starts[8];
    long    T = 0;
    for (int i = 0; i < ac->n_docs; i++) {
        starts[i] = (int32_t)T;
        T += ac->lens[i];
    }
    const long nb = ac->n_blocks, B = ac->B, nq = ac->nq, nkv = ac->nkv, hd = ac->hd, R = nb * B;
    int32_t   *anchors = tst_xcalloc((size_t)nb * 4), *ctx_lo = tst_xcalloc((size_t)nb * 4);
    for (long j = 0; j < nb; j++) { /* document starts and ends first, then random, unsorted */
        const int d = (int)(j % ac->n_docs), len = ac->lens[d];
        const int off = j < ac->n_docs ? 0 : j < 2 * ac->n_docs ? len - 1 : (int)(tst_urand() * len);
        anchors[j] = starts[d] + off;
        ctx_lo[j] = starts[d];
    }
    float *q = tst_rand_f32(R * nq * hd, -2, 2), *kc = tst_rand_f32(T * nkv * hd, -1, 1),
          *vc = tst_rand_f32(T * nkv * hd, -1, 1);
    float *kb = tst_rand_f32(R * nkv * hd, -1, 1), *vb = tst_rand_f32(R * nkv * hd, -1, 1),
          *dout = tst_rand_f32(R * nq * hd, -1, 1);
    dbuf   ba = dbuf_put(anchors, (size_t)nb * 4), bl = dbuf_put(ctx_lo, (size_t)nb * 4);
    dbuf   bq = dbuf_put(q, (size_t)(R * nq * hd) * 4), bkc = dbuf_put(kc, (size_t)(T * nkv * hd) * 4);
    dbuf   bvc = dbuf_put(vc, (size_t)(T * nkv * hd) * 4), bkb = dbuf_put(kb, (size_t)(R * nkv * hd) * 4);
    dbuf   bvb = dbuf_put(vb, (size_t)(R * nkv * hd) * 4), bdo = dbuf_put(dout, (size_t)(R * nq * hd) * 4);
    dbuf   bo = dbuf_put(NULL, (size_t)(R * nq * hd) * 4), blse = dbuf_put(NULL, (size_t)(R * nq) * 4);
    dbuf   bdq = dbuf_put(NULL, (size_t)(R * nq * hd) * 4), bdkc = dbuf_put(NULL, (size_t)(T * nkv * hd) * 4);
    dbuf   bdvc = dbuf_put(NULL, (size_t)(T * nkv * hd) * 4), bdkb = dbuf_put(NULL, (size_t)(R * nkv * hd) * 4);
    dbuf   bdvb = dbuf_put(NULL, (size_t)(R * nkv * hd) * 4);
    kn_dflash_attn_params pc = {.T = T, .n_blocks = nb, .B = (int)B, .nq = (int)nq, .nkv = (int)nkv,
                                .hd = (int)hd, .window = window, .causal = causal,
                                .scale = (float)(1.0 / sqrt((double)hd))};
    kn_dflash_attn_params pg = pc;
    pc.anchors = ba.c, pc.ctx_lo = bl.c, pc.q = bq.c, pc.k_ctx = bkc.c, pc.v_ctx = bvc.c, pc.k_blk = bkb.c;
    pc.v_blk = bvb.c, pc.out = bo.c, pc.lse = blse.c, pc.dout = bdo.c, pc.dq = bdq.c, pc.dk_ctx = bdkc.c;
    pc.dv_ctx = bdvc.c, pc.dk_blk = bdkb.c, pc.dv_blk = bdvb.c;
    pg.anchors = ba.g, pg.ctx_lo = bl.g, pg.q = bq.g, pg.k_ctx = bkc.g, pg.v_ctx = bvc.g, pg.k_blk = bkb.g;
    pg.v_blk = bvb.g, pg.out = bo.g, pg.lse = blse.g, pg.dout = bdo.g, pg.dq = bdq.g, pg.dk_ctx = bdkc.g;
    pg.dv_ctx = bdvc.g, pg.dk_blk = bdkb.g, pg.dv_blk = bdvb.g;
    tst_ok(cpu->dflash_attn_fwd(cctx, &pc), "cpu dflash_attn_fwd");
    tst_ok(cpu->dflash_attn_bwd(cctx, &pc), "cpu dflash_attn_bwd");
    const long  sizes[7] = {R * nq * hd, R * nq, R * nq * hd, T * nkv * hd, T * nkv * hd, R * nkv * hd, R * nkv * hd};
    const dbuf *bufs[7] = {&bo, &blse, &bdq, &bdkc, &bdvc, &bdkb, &bdvb};
    const char *names[7] = {"out", "lse", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"};
    /* the tensor-core kernels take these shapes in BF16 mode (kn_dflash_attn_mma.cu) */
    const int mma = (hd == 16 || hd == 32 || hd == 64 || hd == 128) && B <= 64 && (nq / nkv) * ((B + 15) / 16) <= 8;
    /* mode 2: the wgmma kernels asked for (they run on compute capability 9.0) */
    const int n_modes = gctx_wgmma && mma && (hd == 64 || hd == 128) ? 3 : 2;
    for (int mode = 0; mode < n_modes; mode++) {
        kn_ctx *g = mode == 0 ? gctx : mode == 1 ? gctx16 : gctx_wgmma;
        char    label[160], name[224];
        snprintf(label, sizeof label, "%s T=%ld blocks=%ld B=%ld nq=%ld nkv=%ld hd=%ld W=%d%s%s", ac->what, T,
                 nb, B, nq, nkv, hd, window, causal ? " causal" : "",
                 mode == 0   ? ""
                 : !mma      ? " BF16 (fp32 fallback)"
                 : mode == 1 ? " BF16 mma"
                             : " BF16 wgmma");
        tst_ok(gpu->dflash_attn_fwd(g, &pg), "cuda dflash_attn_fwd");
        tst_ok(gpu->dflash_attn_bwd(g, &pg), "cuda dflash_attn_bwd");
        float *first[7] = {0};
        for (int i = 0; i < 7; i++) {
            float *c = tst_xcalloc((size_t)sizes[i] * 4), *gg = tst_xcalloc((size_t)sizes[i] * 4);
            get_both(bufs[i], (size_t)sizes[i] * 4, c, gg);
            snprintf(name, sizeof name, "dflash %-6s %s", names[i], label);
            if (mode == 0) {
                if (i == 0)
                    compare_scaled(8, name, gg, c, sizes[i], 2e-5, 1e-4);
                else if (i == 1)
                    compare(8, name, gg, c, sizes[i], 2e-5, 0);
                else
                    compare_scaled(9, name, gg, c, sizes[i], 1e-4, 1e-3);
            } else {
                /* bf16 operands (Q, K, V, dO, P, dS rounded to 8-bit mantissas, 2^-9 relative)
                 * with fp32 sums: elementwise within 3e-2 of the tensor's scale, and relative
                 * L2 within 2e-2 overall (a mask or fragment error is O(1)) */
                if (i == 1)
                    compare(12, name, gg, c, sizes[i], 3e-2, 0);
                else
                    compare_scaled(i == 0 ? 12 : 13, name, gg, c, sizes[i], 3e-2, 3e-2);
                if (i != 1) {
                    double *cd = tst_xcalloc((size_t)sizes[i] * sizeof(double));
                    for (long e = 0; e < sizes[i]; e++)
                        cd[e] = c[e];
                    const double rl2 = tst_rel_l2(gg, cd, sizes[i]);
                    TST_CHECK(rl2 <= 2e-2);
                    printf("%-64s rel L2 %.2e %s\n", name, rl2, rl2 <= 2e-2 ? "ok" : "FAIL");
                    free(cd);
                }
            }
            first[i] = gg;
            free(c);
        }
        /* determinism: the backward again gives the same bits */
        tst_ok(gpu->dflash_attn_bwd(g, &pg), "cuda dflash_attn_bwd again");
        int same = 1;
        for (int i = 2; i < 7; i++) {
            float *c = tst_xcalloc((size_t)sizes[i] * 4), *gg = tst_xcalloc((size_t)sizes[i] * 4);
            get_both(bufs[i], (size_t)sizes[i] * 4, c, gg);
            same = same && memcmp(gg, first[i], (size_t)sizes[i] * 4) == 0;
            free(c);
            free(gg);
        }
        TST_CHECK(same);
        printf("%-64s %s\n", "dflash backward repeated", same ? "bit-identical" : "DIFFERS");
        for (int i = 0; i < 7; i++)
            free(first[i]);
    }
    dbuf *all[] = {&ba, &bl, &bq, &bkc, &bvc, &bkb, &bvb, &bdo, &bo, &blse, &bdq, &bdkc, &bdvc, &bdkb, &bdvb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
    free(anchors);
    free(ctx_lo);
    free(q);
    free(kc);
    free(vc);
    free(kb);
    free(vb);
    free(dout);
}

static void test_dflash(void) {
    static const attn_case cases[] = {
        {"docs 1/63/65/74", 4, {1, 63, 65, 74}, 13, 16, 4, 2, 64, {0, 5, 300}},
        {"gqa1 hd8", 3, {40, 1, 88}, 9, 4, 3, 3, 8, {0, 7, -1}},
        {"gqa4 hd128", 2, {700, 301}, 24, 16, 8, 2, 128, {0, 64, 300}},
        {"gqa4 hd128 long", 2, {1500, 637}, 20, 16, 8, 2, 128, {0, 1024, -1}},
        {"odd hd33 B7", 3, {65, 63, 1}, 7, 7, 2, 1, 33, {0, 3, -1}},
        {"B64 hd128", 2, {150, 151}, 5, 64, 2, 1, 128, {0, 40, -1}},
        {"hd16 gqa2", 1, {257}, 6, 10, 4, 2, 16, {0, 2, -1}}, /* W = 1: each slot would see itself alone */
        {"gqa8 hd32", 2, {129, 200}, 8, 16, 8, 1, 32, {0, 9, -1}},
        {"B20 hd64", 3, {1, 90, 77}, 6, 20, 2, 2, 64, {0, 30, -1}},
    };
    /* the wgmma kernels as well (head_dim 64 and 128 on compute capability 9.0): both forms
     * against the cpu */
    tst_gpu_ctx_env(&gctx_wgmma, "TANDEM_DFLASH_KERNEL", "wgmma");
    /* every window causal and not (non-causal sliding layers; is_causal true on a full layer);
     * windows below B cut block slots too, in both directions when not causal */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int w = 0; w < 3 && cases[c].windows[w] >= 0; w++)
            for (int causal = 0; causal < 2; causal++)
                attn_run(&cases[c], cases[c].windows[w], causal);
    gpu->ctx_destroy(&gctx_wgmma);
}

// ----------------------------------------------------------------------------
// empty shapes and bad arguments

static void expect(cm_status got, cm_status want, const char *what) {
    if (got != want)
        fprintf(stderr, "  %s: got %s, want %s (%s)\n", what, cm_status_str(got), cm_status_str(want),
                cm_last_error());
    else
        printf("%-64s -> %s: %s\n", what, cm_status_str(got), cm_last_error());
    TST_CHECK(got == want);
}

static void test_edges(void) {
    float *buf = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&buf, 4096 * sizeof(float)), "alloc"));
    /* empty shapes: ok, nothing written */
    TST_CHECK(tst_ok(gpu->gemm_dx(gctx, buf, buf, buf, CM_DTYPE_F32, 0, 4, 4, 0), "gemm_dx M=0"));
    TST_CHECK(tst_ok(gpu->gemm_dw(gctx, buf, buf, buf, 0, 4, 4), "gemm_dw M=0"));
    TST_CHECK(tst_ok(gpu->rmsnorm_bwd(gctx, buf, buf + 64, buf + 128, buf, buf, 0, 8, 1e-6f, 0), "rmsnorm_bwd rows=0"));
    TST_CHECK(tst_ok(gpu->swiglu_bwd(gctx, buf, buf + 8, buf, buf, buf, 0), "swiglu_bwd n=0"));
    TST_CHECK(tst_ok(gpu->lm_ce(gctx, buf, buf, (int32_t *)buf, buf, (int32_t *)buf, buf, buf, CM_DTYPE_F32, 0, 8, 8),
                      "lm_ce R=0"));
    /* gemm_dx with N = 0: zeros (=), untouched (+=) */
    float ones[12] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, got[12];
    gpu->upload(gctx, buf, ones, sizeof ones);
    TST_CHECK(tst_ok(gpu->gemm_dx(gctx, buf, buf + 64, buf + 64, CM_DTYPE_F32, 3, 0, 4, 1), "gemm_dx N=0 +="));
    gpu->download(gctx, got, buf, sizeof got);
    TST_CHECK(memcmp(got, ones, sizeof got) == 0);
    TST_CHECK(tst_ok(gpu->gemm_dx(gctx, buf, buf + 64, buf + 64, CM_DTYPE_F32, 3, 0, 4, 0), "gemm_dx N=0 ="));
    gpu->download(gctx, got, buf, sizeof got);
    int zero = 1;
    for (int i = 0; i < 12; i++)
        zero = zero && got[i] == 0.0f;
    TST_CHECK(zero);
    /* attention with no blocks: the backward still writes zero context gradients */
    gpu->upload(gctx, buf + 1000, ones, sizeof ones);
    kn_dflash_attn_params p = {0};
    p.T = 3;
    p.B = 4;
    p.nq = p.nkv = 1;
    p.hd = 4;
    p.scale = 0.5f;
    p.k_ctx = p.v_ctx = buf + 2000;
    p.dk_ctx = buf + 1000;
    p.dv_ctx = buf + 1100;
    TST_CHECK(tst_ok(gpu->dflash_attn_fwd(gctx, &p), "dflash_attn_fwd n_blocks=0"));
    TST_CHECK(tst_ok(gpu->dflash_attn_bwd(gctx, &p), "dflash_attn_bwd n_blocks=0"));
    gpu->download(gctx, got, buf + 1000, sizeof got);
    zero = 1;
    for (int i = 0; i < 12; i++)
        zero = zero && got[i] == 0.0f;
    TST_CHECK(zero);
    printf("%-64s ok\n", "empty shapes (and N=0 / no blocks writes zeros)");

    /* bad arguments: one clear status, the context stays usable */
    expect(gpu->gemm_dx(gctx, buf, buf, buf, CM_DTYPE_F16, 2, 2, 2, 0), CM_ERR_UNSUPPORTED, "gemm_dx W F16");
    expect(gpu->gemm_dw(gctx, buf, buf, NULL, 2, 2, 2), CM_ERR_INVALID_ARG, "gemm_dw inp=NULL");
    expect(gpu->rmsnorm_bwd(gctx, buf, buf + 64, buf, buf, buf, 2, 8, 1e-6f, 0), CM_ERR_INVALID_ARG,
           "rmsnorm_bwd dinp == dout");
    expect(gpu->rope_bwd(gctx, buf, (int32_t *)buf, 2, 1, 8, 5, 1e4f), CM_ERR_INVALID_ARG, "rope_bwd rot_dim odd");
    expect(gpu->swiglu_bwd(gctx, buf, buf, buf, buf, buf, 4), CM_ERR_INVALID_ARG, "swiglu_bwd dgate == dup");
    expect(gpu->lm_ce(gctx, NULL, buf, (int32_t *)buf, buf, (int32_t *)buf, buf, buf, CM_DTYPE_I32, 2, 8, 8),
           CM_ERR_UNSUPPORTED, "lm_ce W I32");
    expect(gpu->lm_ce(gctx, buf, buf, (int32_t *)buf, buf, (int32_t *)buf, NULL, buf, CM_DTYPE_F32, 2, 8, 8),
           CM_ERR_INVALID_ARG, "lm_ce dh without gscale");
    double s;
    expect(gpu->sumsq(gctx, &s, buf, -1), CM_ERR_INVALID_ARG, "sumsq n=-1");
    kn_adamw_params ap = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f, 0};
    expect(gpu->adamw(gctx, buf, buf, buf, buf, 4, &ap), CM_ERR_INVALID_ARG, "adamw step=0");
    p.n_blocks = 1;
    p.anchors = p.ctx_lo = (int32_t *)buf;
    p.q = p.k_blk = p.v_blk = p.dout = buf;
    p.out = p.lse = p.dq = p.dk_blk = p.dv_blk = buf;
    p.nq = 3;
    p.nkv = 2;
    expect(gpu->dflash_attn_fwd(gctx, &p), CM_ERR_INVALID_ARG, "dflash_attn_fwd nq=3 nkv=2");
    p.nq = p.nkv = 1;
    p.hd = 300;
    expect(gpu->dflash_attn_fwd(gctx, &p), CM_ERR_UNSUPPORTED, "dflash_attn_fwd hd=300");
    p.hd = 4;
    p.out = NULL;
    expect(gpu->dflash_attn_bwd(gctx, &p), CM_ERR_INVALID_ARG, "dflash_attn_bwd out=NULL");
    TST_CHECK(tst_ok(gpu->sync(gctx), "sync after bad arguments"));
    gpu->free(gctx, buf);
}

// ----------------------------------------------------------------------------

/* usage: test_kn_cuda_drafter [dflash]   (dflash: only the attention checks, e.g. under
 * compute-sanitizer) */
int main(int argc, char **argv) {
    const int only_dflash = argc > 1 && strcmp(argv[1], "dflash") == 0;
    if (!tst_pair_open())
        return tst_report();

    if (!only_dflash) {
        test_gemm_bwd();
        test_rmsnorm_bwd();
        test_rope_bwd();
        test_swiglu_bwd();
        test_sumsq();
        test_adamw();
        test_lm_ce();
    }
    test_dflash();
    if (!only_dflash)
        test_edges();

    printf("\nworst error/tolerance per op (<= 1 passes) and max abs error:\n");
    for (int i = 0; i < N_OPS; i++)
        printf("  %-12s %.3f  %.2e\n", op_names[i], op_worst[i], op_max_abs[i]);
    tst_pair_close();
    return tst_report();
}
