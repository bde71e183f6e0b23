/* tests/test_kn_cuda.c — the cuda backend against the cpu reference, entry by entry, through
 * the kn_backend tables: random inputs from a fixed seed, the same call on both, and an
 * elementwise comparison |cuda − cpu| ≤ atol + rtol·|cpu| (GEMM: ≤ tol·Σ_k|a·b|, the
 * rounding bound of a dot product) on at least 3 shapes per op, odd sizes included. Every
 * comparison prints its max abs error and its worst error/tolerance ratio, so a failing run
 * on a GPU machine says which op, which shape and how far. Tolerances: exact for data
 * movement and embed; 1e-5 relative for fp32 ops; GEMM 1e-5 (F32 mode, and BF16 mode on
 * bf16-exact inputs), 1e-2 (BF16 mode on general inputs); the bf16 outputs of the fused
 * producers (add_rmsnorm_bf16, rmsnorm_gated_bf16, swiglu_bf16) within one bf16 ulp. Also bad
 * arguments. Label gpu: exits 77 when the build has no cuda backend or the machine has no
 * cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"

#define TST_KN_SEED 0x2545f4914f6cdd1dull
#include "tst_kn.h"
#include "tst_kn_pair.h"

// ----------------------------------------------------------------------------
// helpers: paired buffers, comparisons (random numbers, cpu/cuda pair: tst_kn.h, tst_kn_pair.h)

/* Downloads both sides of b (n floats from element offset off) into fresh host arrays. */
static void dbuf_get(const dbuf *b, long off, long n, float **c_out, float **g_out) {
    *c_out = tst_zeros_f32(n);
    *g_out = tst_zeros_f32(n);
    if (cpu->download(cctx, *c_out, (const float *)b->c + off, (size_t)n * sizeof(float)) != CM_OK ||
        gpu->download(gctx, *g_out, (const float *)b->g + off, (size_t)n * sizeof(float)) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
}

/* |got − ref| ≤ atol + rtol·|ref| elementwise; prints the max abs error and the worst
 * error/tolerance ratio (≤ 1 passes) for every comparison. */
static void compare(const char *name, const float *got, const float *ref, long n, double atol, double rtol) {
    tst_compare(name, 58, got, ref, n, atol, rtol, NULL);
}

/* Compares dbuf b (n floats) between the backends. */
static void compare_buf(const char *name, const dbuf *b, long n, double atol, double rtol) {
    float *c, *g;
    dbuf_get(b, 0, n, &c, &g);
    compare(name, g, c, n, atol, rtol);
    free(c);
    free(g);
}

// ----------------------------------------------------------------------------
// context, memory, data movement

static void test_memory(void) {
    void *p = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, &p, 1001), "alloc"));
    unsigned char back[1001], src[1001];
    memset(back, 0xab, sizeof back);
    TST_CHECK(tst_ok(gpu->download(gctx, back, p, sizeof back), "download"));
    int zero = 1;
    for (int i = 0; i < 1001; i++)
        zero &= back[i] == 0;
    TST_CHECK(zero);
    for (int i = 0; i < 1001; i++)
        src[i] = (unsigned char)(i * 7 + 3);
    TST_CHECK(tst_ok(gpu->upload(gctx, p, src, sizeof src), "upload"));
    TST_CHECK(tst_ok(gpu->download(gctx, back, p, sizeof back), "download"));
    TST_CHECK(memcmp(src, back, sizeof src) == 0);
    TST_CHECK(tst_ok(gpu->sync(gctx), "sync"));
    gpu->free(gctx, p);
    gpu->free(gctx, NULL);

    void *z = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, &z, 0), "alloc 0") && z != NULL);
    gpu->free(gctx, z);
    TST_CHECK(tst_ok(gpu->upload(gctx, NULL, NULL, 0), "upload 0"));
    TST_CHECK(tst_ok(gpu->download(gctx, NULL, NULL, 0), "download 0"));

    kn_ctx *none = NULL;
    gpu->ctx_destroy(&none);
    gpu->ctx_destroy(NULL);
    printf("%-58s ok\n", "memory: alloc zero-fill, upload/download, alloc 0");
}

/* copy_peer: into another context on the same GPU (a device copy) and, with a second GPU, into a
 * context on GPU 1 (a peer copy), an odd size at an odd offset; the bytes around it untouched. */
static void test_copy_peer(void) {
    for (int dev = 0; dev < 2; dev++) {
        kn_ctx       *other = NULL;
        kn_ctx_config kc    = {dev, KN_GEMM_MODE_BF16};
        if (dev == 1 && gpu->ctx_create(&other, &kc) != CM_OK) { /* one GPU: the peer case waits for two */
            printf("%-58s skipped (no second GPU)\n", "copy_peer GPU 0 -> GPU 1");
            break;
        }
        if (dev == 0) TST_CHECK(tst_ok(gpu->ctx_create(&other, &kc), "ctx_create"));
        if (!other) return;
        enum { N = 100003 };
        unsigned char *src = malloc(N), *back = malloc(N);
        void          *a = NULL, *b = NULL;
        for (int i = 0; i < N; i++) src[i] = (unsigned char)(i * 13 + 5);
        TST_CHECK(tst_ok(gpu->alloc(gctx, &a, N), "alloc"));
        TST_CHECK(tst_ok(gpu->ctx_bind(other), "bind") && tst_ok(gpu->alloc(other, &b, N + 64), "alloc other"));
        TST_CHECK(tst_ok(gpu->ctx_bind(gctx), "bind") && tst_ok(gpu->upload(gctx, a, src, N), "upload"));
        TST_CHECK(tst_ok(gpu->copy_peer(gctx, other, (char *)b + 33, (char *)a + 7, N - 40), "copy_peer"));
        TST_CHECK(tst_ok(gpu->copy_peer(gctx, other, b, a, 0), "copy_peer 0 bytes"));
        TST_CHECK(tst_ok(gpu->ctx_bind(other), "bind") && tst_ok(gpu->download(other, back, b, N), "download"));
        int ok = 1;
        for (int i = 0; i < N; i++)
            ok &= back[i] == (i >= 33 && i < 33 + N - 40 ? src[i - 33 + 7] : 0);
        TST_CHECK(ok);
        printf("copy_peer GPU 0 -> %s%-34s %s\n", dev ? "GPU 1" : "another context on GPU 0", "", ok ? "ok" : "FAILED");
        gpu->free(other, b);
        TST_CHECK(tst_ok(gpu->ctx_bind(gctx), "bind"));
        gpu->free(gctx, a);
        gpu->ctx_destroy(&other);
        free(src);
        free(back);
    }
}

static void test_copy2d(void) {
    static const long shapes[][4] = {
        {1, 1, 1, 1}, {7, 13, 29, 17}, {130, 257, 300, 263}}; /* rows cols src_ld dst_ld */
    for (int s = 0; s < 3; s++) {
        long   rows = shapes[s][0], cols = shapes[s][1], sld = shapes[s][2], dld = shapes[s][3];
        float *src = tst_rand_f32(rows * sld, -1, 1), *dst0 = tst_rand_f32(rows * dld, 5, 6);
        dbuf   bs = dbuf_put(src, (size_t)(rows * sld) * sizeof(float));
        dbuf   bd = dbuf_put(dst0, (size_t)(rows * dld) * sizeof(float));
        tst_ok(cpu->copy2d(cctx, bd.c, dld, bs.c, sld, rows, cols), "cpu copy2d");
        tst_ok(gpu->copy2d(gctx, bd.g, dld, bs.g, sld, rows, cols), "cuda copy2d");
        char name[96];
        snprintf(name, sizeof name, "copy2d rows=%ld cols=%ld src_ld=%ld dst_ld=%ld", rows, cols, sld, dld);
        compare_buf(name, &bd, rows * dld, 0, 0); /* exact, including the untouched columns */
        tst_ok(cpu->zero(cctx, (float *)bd.c + 1, (size_t)(rows * dld - 1) * sizeof(float)), "cpu zero");
        tst_ok(gpu->zero(gctx, (float *)bd.g + 1, (size_t)(rows * dld - 1) * sizeof(float)), "cuda zero");
        snprintf(name, sizeof name, "zero n=%ld (after element 0)", rows * dld - 1);
        compare_buf(name, &bd, rows * dld, 0, 0);
        dbuf_free(&bs);
        dbuf_free(&bd);
        free(src);
        free(dst0);
    }
}

// ----------------------------------------------------------------------------
// elementwise and embedding

static void test_elementwise(void) {
    static const long ns[] = {1, 1000, 100003};
    for (int s = 0; s < 3; s++) {
        long   n = ns[s];
        float *x = tst_rand_f32(n, -3, 3), *y = tst_rand_f32(n, -3, 3);
        dbuf   bx = dbuf_put(x, (size_t)n * sizeof(float)), by = dbuf_put(y, (size_t)n * sizeof(float));
        dbuf   bo = dbuf_put(NULL, (size_t)n * sizeof(float));
        char   name[96];
        tst_ok(cpu->swiglu(cctx, bo.c, bx.c, by.c, n), "cpu swiglu");
        tst_ok(gpu->swiglu(gctx, bo.g, bx.g, by.g, n), "cuda swiglu");
        snprintf(name, sizeof name, "swiglu n=%ld", n);
        compare_buf(name, &bo, n, 1e-6, 1e-5);
        tst_ok(cpu->add(cctx, bx.c, by.c, n), "cpu add");
        tst_ok(gpu->add(gctx, bx.g, by.g, n), "cuda add");
        snprintf(name, sizeof name, "add n=%ld", n);
        compare_buf(name, &bx, n, 0, 0); /* one correctly rounded fp32 sum on both */
        dbuf_free(&bx);
        dbuf_free(&by);
        dbuf_free(&bo);
        free(x);
        free(y);
    }
}

static void test_embed(void) {
    static const long shapes[][3] = {{1, 1, 1}, {7, 33, 50}, {130, 257, 1000}}; /* T C V */
    for (int s = 0; s < 3; s++) {
        long      T = shapes[s][0], C = shapes[s][1], V = shapes[s][2];
        float    *tab = tst_rand_f32(V * C, -2, 2);
        uint16_t *tab16 = malloc((size_t)(V * C) * sizeof(uint16_t));
        int32_t  *ids = malloc((size_t)T * sizeof(int32_t));
        if (!tab16 || !ids)
            exit(1);
        for (long i = 0; i < V * C; i++)
            tab16[i] = tst_bf16_round(tab[i]);
        for (long t = 0; t < T; t++)
            ids[t] = (int32_t)(tst_urand() * (double)V);
        ids[T - 1] = (int32_t)(V - 1);
        dbuf bt = dbuf_put(tab, (size_t)(V * C) * sizeof(float)), bt16 = dbuf_put(tab16, (size_t)(V * C) * 2);
        dbuf bi = dbuf_put(ids, (size_t)T * sizeof(int32_t)),
             bo = dbuf_put(NULL, (size_t)(T * C) * sizeof(float));
        char name[96];
        tst_ok(cpu->embed(cctx, bo.c, bi.c, bt.c, CM_DTYPE_F32, T, C), "cpu embed f32");
        tst_ok(gpu->embed(gctx, bo.g, bi.g, bt.g, CM_DTYPE_F32, T, C), "cuda embed f32");
        snprintf(name, sizeof name, "embed F32 T=%ld C=%ld V=%ld", T, C, V);
        compare_buf(name, &bo, T * C, 0, 0);
        tst_ok(cpu->embed(cctx, bo.c, bi.c, bt16.c, CM_DTYPE_BF16, T, C), "cpu embed bf16");
        tst_ok(gpu->embed(gctx, bo.g, bi.g, bt16.g, CM_DTYPE_BF16, T, C), "cuda embed bf16");
        snprintf(name, sizeof name, "embed BF16 T=%ld C=%ld V=%ld", T, C, V);
        compare_buf(name, &bo, T * C, 0, 0);
        dbuf_free(&bt);
        dbuf_free(&bt16);
        dbuf_free(&bi);
        dbuf_free(&bo);
        free(tab);
        free(tab16);
        free(ids);
    }
}

// ----------------------------------------------------------------------------
// GEMM

/* |got − ref| ≤ tol·bound elementwise, bound[m, n] = Σ_k |inp[m, k]·w[n, k]| (+ a denormal
 * floor): the rounding-error bound of a dot product, meaningful even where ref ≈ 0. */
static void compare_bound(const char *name, const float *got, const float *ref, const double *bound, long n,
                          double tol) {
    tst_compare_bound(name, 58, got, ref, bound, n, tol, NULL);
}

/* One shape: W in F32 and BF16, each through the F32-mode and BF16-mode contexts. inp_off
 * shifts the input pointer by that many floats to exercise unaligned operands. */
static void gemm_case(long M, long N, long K, long inp_off, int bf16_exact) {
    float    *inp = tst_rand_f32(M * K + inp_off, -1, 1), *w = tst_rand_f32(N * K, -1, 1);
    uint16_t *w16 = malloc((size_t)(N * K > 0 ? N * K : 1) * sizeof(uint16_t));
    if (!w16)
        exit(1);
    if (bf16_exact)
        for (long i = 0; i < M * K + inp_off; i++)
            inp[i] = tst_bf16_widen(tst_bf16_round(inp[i]));
    for (long i = 0; i < N * K; i++) {
        w16[i] = tst_bf16_round(w[i]);
        if (bf16_exact)
            w[i] = tst_bf16_widen(w16[i]);
    }
    double *bound = malloc((size_t)(M * N > 0 ? M * N : 1) * sizeof(double));
    if (!bound)
        exit(1);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            double s = 0;
            for (long k = 0; k < K; k++)
                s += fabs((double)inp[inp_off + m * K + k] * (double)w[n * K + k]);
            bound[m * N + n] = s;
        }
    dbuf         bin = dbuf_put(inp, (size_t)(M * K + inp_off) * sizeof(float));
    dbuf         bw = dbuf_put(w, (size_t)(N * K) * sizeof(float)), bw16 = dbuf_put(w16, (size_t)(N * K) * 2);
    dbuf         bo = dbuf_put(NULL, (size_t)(M * N) * sizeof(float));
    const float *in_c = (const float *)bin.c + inp_off, *in_g = (const float *)bin.g + inp_off;

    for (int wi = 0; wi < 2; wi++) {
        cm_dtype    wdt = wi ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        const void *wc = wi ? bw16.c : bw.c, *wg = wi ? bw16.g : bw.g;
        /* the cpu reference: exact products of the f32 (or bf16-widened) values, double sums */
        tst_ok(cpu->gemm(cctx, bo.c, in_c, wc, wdt, M, N, K), "cpu gemm");
        float *ref = tst_zeros_f32(M * N), *got = tst_zeros_f32(M * N);
        cpu->download(cctx, ref, bo.c, (size_t)(M * N) * sizeof(float));
        /* with BF16 weights the bound uses the bf16 values the reference saw */
        char name[112];
        for (int mode = 0; mode < 2; mode++) {
            kn_ctx *g = mode ? gctx16 : gctx;
            tst_ok(gpu->gemm(g, bo.g, in_g, wg, wdt, M, N, K), mode ? "cuda gemm bf16" : "cuda gemm f32");
            tst_ok(gpu->download(g, got, bo.g, (size_t)(M * N) * sizeof(float)), "download");
            /* F32 mode: fp32 math, error ~ eps·sqrt(K)·bound. BF16 mode rounds inputs (2^-9
             * each), unless they are bf16 already. */
            double tol = mode == 0 || bf16_exact ? 1e-5 : 1e-2;
            snprintf(name, sizeof name, "gemm %s-mode W=%s M=%ld N=%ld K=%ld%s%s", mode ? "BF16" : "F32",
                     wi ? "BF16" : "F32", M, N, K, inp_off ? " inp+1" : "", bf16_exact ? " bf16-exact" : "");
            compare_bound(name, got, ref, bound, M * N, tol);
        }
        free(ref);
        free(got);
    }
    dbuf_free(&bin);
    dbuf_free(&bw);
    dbuf_free(&bw16);
    dbuf_free(&bo);
    free(inp);
    free(w);
    free(w16);
    free(bound);
}

static void test_gemm(void) {
    gemm_case(1, 1, 1, 0, 0);
    gemm_case(7, 13, 29, 0, 0);
    gemm_case(7, 13, 29, 1, 0);
    gemm_case(130, 257, 96, 0, 0);
    gemm_case(33, 65, 1000, 0, 0);
    gemm_case(130, 257, 96, 0, 1);
    gemm_case(7, 13, 29, 1, 1);

    /* K = 0: zeros, whatever out held */
    float *junk = tst_rand_f32(12, 1, 2);
    dbuf   bo = dbuf_put(junk, 12 * sizeof(float));
    tst_ok(cpu->gemm(cctx, bo.c, bo.c, bo.c, CM_DTYPE_F32, 3, 4, 0), "cpu gemm K=0");
    tst_ok(gpu->gemm(gctx16, bo.g, bo.g, bo.g, CM_DTYPE_F32, 3, 4, 0), "cuda gemm K=0");
    gpu->sync(gctx16);
    compare_buf("gemm M=3 N=4 K=0 (zeros)", &bo, 12, 0, 0);
    dbuf_free(&bo);
    free(junk);
}

// ----------------------------------------------------------------------------
// norms

static void test_norms(void) {
    static const long shapes[][2] = {{1, 1}, {7, 33}, {130, 1000}, {3, 5120}}; /* rows C */
    char              name[96];
    for (int s = 0; s < 4; s++) {
        long   rows = shapes[s][0], C = shapes[s][1];
        float *x = tst_rand_f32(rows * C, -2, 2), *z = tst_rand_f32(rows * C, -4, 4),
              *w = tst_rand_f32(C, -0.5, 1.5);
        dbuf   bx = dbuf_put(x, (size_t)(rows * C) * sizeof(float)), bz = dbuf_put(z, (size_t)(rows * C) * 4);
        dbuf   bw = dbuf_put(w, (size_t)C * sizeof(float)), bo = dbuf_put(NULL, (size_t)(rows * C) * 4);
        for (int one_plus = 0; one_plus < 2; one_plus++) {
            tst_ok(cpu->rmsnorm(cctx, bo.c, bx.c, bw.c, rows, C, 1e-6f, one_plus), "cpu rmsnorm");
            tst_ok(gpu->rmsnorm(gctx, bo.g, bx.g, bw.g, rows, C, 1e-6f, one_plus), "cuda rmsnorm");
            snprintf(name, sizeof name, "rmsnorm rows=%ld C=%ld one_plus=%d", rows, C, one_plus);
            compare_buf(name, &bo, rows * C, 1e-6, 1e-5);
        }
        tst_ok(cpu->rmsnorm_gated(cctx, bo.c, bx.c, bz.c, bw.c, rows, C, 1e-6f), "cpu rmsnorm_gated");
        tst_ok(gpu->rmsnorm_gated(gctx, bo.g, bx.g, bz.g, bw.g, rows, C, 1e-6f), "cuda rmsnorm_gated");
        snprintf(name, sizeof name, "rmsnorm_gated rows=%ld C=%ld", rows, C);
        compare_buf(name, &bo, rows * C, 1e-6, 1e-5);
        tst_ok(cpu->l2norm(cctx, bo.c, bx.c, rows, C, 1e-6f), "cpu l2norm");
        tst_ok(gpu->l2norm(gctx, bo.g, bx.g, rows, C, 1e-6f), "cuda l2norm");
        snprintf(name, sizeof name, "l2norm rows=%ld C=%ld", rows, C);
        compare_buf(name, &bo, rows * C, 1e-6, 1e-5);
        /* in place (out == inp) */
        tst_ok(cpu->rmsnorm(cctx, bx.c, bx.c, bw.c, rows, C, 1e-6f, 1), "cpu rmsnorm in place");
        tst_ok(gpu->rmsnorm(gctx, bx.g, bx.g, bw.g, rows, C, 1e-6f, 1), "cuda rmsnorm in place");
        tst_ok(cpu->l2norm(cctx, bx.c, bx.c, rows, C, 1e-6f), "cpu l2norm in place");
        tst_ok(gpu->l2norm(gctx, bx.g, bx.g, rows, C, 1e-6f), "cuda l2norm in place");
        snprintf(name, sizeof name, "rmsnorm+l2norm in place rows=%ld C=%ld", rows, C);
        compare_buf(name, &bx, rows * C, 1e-6, 1e-5);
        dbuf_free(&bx);
        dbuf_free(&bz);
        dbuf_free(&bw);
        dbuf_free(&bo);
        free(x);
        free(z);
        free(w);
    }
}

// ----------------------------------------------------------------------------
// attention pieces

/* Packed sequence table for lens; returns T. cu has n + 1 entries. */
static long make_seqs(const int *lens, int n, int32_t *cu) {
    cu[0] = 0;
    for (int i = 0; i < n; i++)
        cu[i + 1] = cu[i] + lens[i];
    return cu[n];
}

static void test_rope(void) {
    static const struct {
        long  T;
        int   nh, hd, rot;
        float theta;
        int   pos_max;
    } cases[] = {{1, 1, 2, 2, 1e4f, 1},
                 {7, 3, 32, 8, 1e7f, 200},
                 {130, 5, 256, 64, 1e7f, 262143},
                 {65, 2, 30, 30, 1e6f, 4096}};
    for (int s = 0; s < 4; s++) {
        long     T = cases[s].T;
        int      nh = cases[s].nh, hd = cases[s].hd, rot = cases[s].rot;
        float   *x = tst_rand_f32(T * nh * hd, -2, 2);
        int32_t *pos = malloc((size_t)T * sizeof(int32_t));
        if (!pos)
            exit(1);
        for (long t = 0; t < T; t++)
            pos[t] = (int32_t)(tst_urand() * cases[s].pos_max);
        pos[T - 1] = cases[s].pos_max - 1;
        dbuf bx = dbuf_put(x, (size_t)(T * nh * hd) * sizeof(float)), bp = dbuf_put(pos, (size_t)T * 4);
        tst_ok(cpu->rope(cctx, bx.c, bp.c, T, nh, hd, rot, cases[s].theta), "cpu rope");
        tst_ok(gpu->rope(gctx, bx.g, bp.g, T, nh, hd, rot, cases[s].theta), "cuda rope");
        char name[96];
        snprintf(name, sizeof name, "rope T=%ld heads=%d hd=%d rot=%d theta=%g pos<%d", T, nh, hd, rot,
                 (double)cases[s].theta, cases[s].pos_max);
        compare_buf(name, &bx, T * nh * hd, 1e-6, 1e-5);
        dbuf_free(&bx);
        dbuf_free(&bp);
        free(x);
        free(pos);
    }
}

/* ||got − ref|| / ||ref|| ≤ rel_l2 and max|got − ref| ≤ rel_max · max|ref| (NaN fails): for the
 * bf16 tensor-core kernels, whose error is spread over every element rather than bounded per
 * element by fp32 rounding. */
static void compare_rel(const char *name, const float *got, const float *ref, long n, double rel_l2,
                        double rel_max) {
    double num = 0, den = 0, max_abs = 0, max_ref = 0;
    int    nan = 0;
    for (long i = 0; i < n; i++) {
        double d = (double)got[i] - (double)ref[i];
        if (isnan(d) || isinf(d))
            nan = 1;
        num += d * d;
        den += (double)ref[i] * ref[i];
        if (fabs(d) > max_abs)
            max_abs = fabs(d);
        if (fabs((double)ref[i]) > max_ref)
            max_ref = fabs((double)ref[i]);
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    int    ok = !nan && rel <= rel_l2 && max_abs <= rel_max * max_ref;
    TST_CHECK(ok);
    printf("%-58s n=%-8ld max|ref| %.2e  max_abs %.2e  rel_l2 %.2e  %s\n", name, n, max_ref, max_abs, rel,
           ok ? "ok" : "FAIL");
}

/* Poisons a device buffer with NaN so that an element the kernel never writes fails. */
static void poison(void *dev, long n) {
    float *nan = malloc((size_t)n * sizeof(float));
    if (!nan) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    for (long i = 0; i < n; i++)
        nan[i] = NAN;
    TST_CHECK(tst_ok(gpu->upload(gctx, dev, nan, (size_t)n * sizeof(float)), "poison upload"));
    free(nan);
}

/* flash: the cuda call runs on the bf16 context (the flash tensor-core kernel) instead of the
 * fp32 one (the exact per-token kernel). */
static void attention_case(const int *lens, int n_seq, int nq, int nkv, int hd, int gated, int flash) {
    int32_t cu[16];
    long    T = make_seqs(lens, n_seq, cu);
    float  *q = tst_rand_f32(T * nq * hd, -1, 1), *k = tst_rand_f32(T * nkv * hd, -1, 1),
          *v = tst_rand_f32(T * nkv * hd, -1, 1);
    float *gate = tst_rand_f32(T * nq * hd, -3, 3);
    /* spread the scores a little more than unit-variance q·k/sqrt(hd) would */
    for (long i = 0; i < T * nq * hd; i++)
        q[i] *= 2.0f;
    dbuf  bq = dbuf_put(q, (size_t)(T * nq * hd) * 4), bk = dbuf_put(k, (size_t)(T * nkv * hd) * 4);
    dbuf  bv = dbuf_put(v, (size_t)(T * nkv * hd) * 4), bg = dbuf_put(gate, (size_t)(T * nq * hd) * 4);
    dbuf  bc = dbuf_put(cu, (size_t)(n_seq + 1) * 4), bo = dbuf_put(NULL, (size_t)(T * nq * hd) * 4);
    float scale = 1.0f / sqrtf((float)hd);
    tst_ok(
        cpu->attention(cctx, bo.c, bq.c, bk.c, bv.c, gated ? bg.c : NULL, bc.c, n_seq, T, nq, nkv, hd, scale),
        "cpu attention");
    if (flash) {
        poison(bo.g, T * nq * hd);
        tst_ok(gpu->sync(gctx), "sync");
    }
    tst_ok(gpu->attention(flash ? gctx16 : gctx, bo.g, bq.g, bk.g, bv.g, gated ? bg.g : NULL, bc.g, n_seq, T,
                           nq, nkv, hd, scale),
            "cuda attention");
    tst_ok(gpu->sync(flash ? gctx16 : gctx), "sync");
    char name[112];
    snprintf(name, sizeof name, "attention%s T=%ld n_seq=%d nq=%d nkv=%d hd=%d%s", flash ? " flash" : "", T,
             n_seq, nq, nkv, hd, gated ? " gated" : "");
    if (flash) {
        /* q, k, v and the probabilities enter the tensor cores as bf16 (relative 2^-9 each),
         * fp32 accumulation and softmax statistics: a few 1e-3 relative L2, as FlashAttention
         * in bf16; a wrong mask or sequence boundary gives errors of order 1. */
        float *c, *gg;
        dbuf_get(&bo, 0, T * nq * hd, &c, &gg);
        compare_rel(name, gg, c, T * nq * hd, 1e-2, 5e-2);
        free(c);
        free(gg);
    } else {
        compare_buf(name, &bo, T * nq * hd, 2e-6, 1e-5);
    }
    dbuf_free(&bq);
    dbuf_free(&bk);
    dbuf_free(&bv);
    dbuf_free(&bg);
    dbuf_free(&bc);
    dbuf_free(&bo);
    free(q);
    free(k);
    free(v);
    free(gate);
}

static void test_attention(void) {
    static const int packed[] = {1, 63, 64, 65, 200};
    static const int one[] = {5};
    static const int small[] = {3, 1, 2};
    static const int longer[] = {700, 1, 1300, 67};
    static const int target[] = {97, 2300, 411}; /* a long sequence between two short ones */
    for (int flash = 0; flash < 2; flash++) {
        attention_case(packed, 5, 3, 3, 32, 1, flash);  /* group 1 */
        attention_case(packed, 5, 6, 2, 64, 1, flash);  /* group 3 */
        attention_case(packed, 5, 3, 1, 256, 0, flash); /* group 3, no gate */
        attention_case(packed, 5, 2, 2, 256, 1, flash); /* group 1 */
        attention_case(one, 1, 2, 1, 48, 1, flash);     /* hd not a multiple of 32 */
        attention_case(small, 3, 3, 1, 1, 0, flash);    /* hd 1 */
    }
    attention_case(longer, 4, 3, 1, 256, 1, 1); /* long sequences: many key tiles, tiles across boundaries */
    attention_case(packed, 5, 4, 2, 128, 1, 1); /* hd 128 */
    attention_case(target, 3, 6, 1, 256, 1, 1); /* the 27B layout: hd 256, group 6, > 2048 keys */
    /* even groups at hd 128 and 256: the wgmma kernel on compute capability 9.0 (key tiles aligned
     * to the batch, so sequences start inside tiles: lengths across 64) */
    static const int odd[] = {1, 129, 63, 250, 2, 65};
    attention_case(longer, 4, 4, 2, 256, 1, 1);
    attention_case(packed, 5, 2, 1, 256, 0, 1);
    attention_case(odd, 6, 8, 2, 128, 1, 1);
    attention_case(odd, 6, 4, 1, 256, 1, 1);
    /* the kernels the dispatch would not pick here: the WMMA one (other head dims, devices with
     * less shared memory, misaligned arrays), two heads per CTA, and FlashAttention-2 where the
     * wgmma kernel would run */
    static const char *forced[] = {"wmma", "fa2-2", "fa2", NULL};
    for (int i = 0; i < 4; i++) { /* the switch is read at ctx_create: a bf16 context per kernel */
        kn_ctx_config c16 = {0, KN_GEMM_MODE_BF16};
        if (forced[i])
            setenv("TANDEM_ATTN_KERNEL", forced[i], 1);
        else
            unsetenv("TANDEM_ATTN_KERNEL"); /* the last one: the dispatch again, for what follows */
        gpu->ctx_destroy(&gctx16);
        if (!tst_ok(gpu->ctx_create(&gctx16, &c16), "cuda ctx_create (bf16, forced attention kernel)"))
            exit(1);
        if (!forced[i])
            break;
        printf("TANDEM_ATTN_KERNEL=%s:\n", forced[i]);
        attention_case(longer, 4, 3, 1, 256, 1, 1);
        attention_case(packed, 5, 4, 2, 128, 1, 1);
        attention_case(odd, 6, 4, 1, 256, 1, 1);
    }
}

// ----------------------------------------------------------------------------
// gated deltanet pieces

static void conv_case(const int *lens, int n_seq, long C, int K) {
    int32_t cu[16];
    long    T = make_seqs(lens, n_seq, cu);
    float  *x = tst_rand_f32(T * C, -2, 2), *w = tst_rand_f32(C * K, -1, 1);
    dbuf    bx = dbuf_put(x, (size_t)(T * C) * 4), bw = dbuf_put(w, (size_t)(C * K) * 4);
    dbuf    bc = dbuf_put(cu, (size_t)(n_seq + 1) * 4), bo = dbuf_put(NULL, (size_t)(T * C) * 4);
    tst_ok(cpu->conv1d_silu(cctx, bo.c, bx.c, bw.c, bc.c, n_seq, T, C, K), "cpu conv1d_silu");
    tst_ok(gpu->conv1d_silu(gctx, bo.g, bx.g, bw.g, bc.g, n_seq, T, C, K), "cuda conv1d_silu");
    char name[96];
    snprintf(name, sizeof name, "conv1d_silu T=%ld n_seq=%d C=%ld K=%d", T, n_seq, C, K);
    compare_buf(name, &bo, T * C, 1e-6, 1e-5);
    dbuf_free(&bx);
    dbuf_free(&bw);
    dbuf_free(&bc);
    dbuf_free(&bo);
    free(x);
    free(w);
}

static void test_conv1d(void) {
    static const int packed[] = {1, 63, 64, 65, 200};
    static const int small[] = {1, 2, 3};
    conv_case(packed, 5, 37, 4);
    conv_case(packed, 5, 300, 4);
    conv_case(packed, 5, 1, 1);
    conv_case(small, 3, 5, 7); /* kernel longer than every sequence */
}

static void test_gdn_gate(void) {
    static const long Ts[] = {1, 65, 393};
    static const int  nvs[] = {1, 6, 48};
    for (int s = 0; s < 3; s++) {
        long   T = Ts[s];
        int    nv = nvs[s];
        float *a = tst_rand_f32(T * nv, -8, 24),
              *b = tst_rand_f32(T * nv, -6, 6); /* a + dt crosses the threshold 20 */
        float *A_log = tst_rand_f32(nv, -2, 2), *dt = tst_rand_f32(nv, -1, 1);
        dbuf   ba = dbuf_put(a, (size_t)(T * nv) * 4), bb = dbuf_put(b, (size_t)(T * nv) * 4);
        dbuf   bA = dbuf_put(A_log, (size_t)nv * 4), bd = dbuf_put(dt, (size_t)nv * 4);
        dbuf   bg = dbuf_put(NULL, (size_t)(T * nv) * 4), bbeta = dbuf_put(NULL, (size_t)(T * nv) * 4);
        tst_ok(cpu->gdn_gate(cctx, bg.c, bbeta.c, ba.c, bb.c, bA.c, bd.c, T, nv), "cpu gdn_gate");
        tst_ok(gpu->gdn_gate(gctx, bg.g, bbeta.g, ba.g, bb.g, bA.g, bd.g, T, nv), "cuda gdn_gate");
        char name[96];
        snprintf(name, sizeof name, "gdn_gate g T=%ld nv=%d", T, nv);
        compare_buf(name, &bg, T * nv, 1e-6, 1e-5);
        snprintf(name, sizeof name, "gdn_gate beta T=%ld nv=%d", T, nv);
        compare_buf(name, &bbeta, T * nv, 1e-6, 1e-5);
        dbuf_free(&ba);
        dbuf_free(&bb);
        dbuf_free(&bA);
        dbuf_free(&bd);
        dbuf_free(&bg);
        dbuf_free(&bbeta);
        free(a);
        free(b);
        free(A_log);
        free(dt);
    }
}

/* chunked: the cuda call runs on the bf16 context (the chunked tensor-core form) instead of
 * the fp32 one (the per-token recurrence). */
static void gdn_case(const int *lens, int n_seq, int nk, int nv, int dk, int dv, int chunked) {
    int32_t cu[16];
    long    T = make_seqs(lens, n_seq, cu);
    float  *q = tst_rand_f32(T * nk * dk, -1, 1), *k = tst_rand_f32(T * nk * dk, -1, 1),
          *v = tst_rand_f32(T * nv * dv, -1, 1);
    float *g = tst_rand_f32(T * nv, -1.5, -0.001), *beta = tst_rand_f32(T * nv, 0.02, 0.98);
    if (chunked) /* also slow decays, so the state carries far across chunk boundaries */
        for (long i = 0; i < T * nv; i += 2)
            g[i] *= 0.01f;
    tst_l2norm_rows(q, T * nk, dk);
    tst_l2norm_rows(k, T * nk, dk);
    dbuf  bq = dbuf_put(q, (size_t)(T * nk * dk) * 4), bk = dbuf_put(k, (size_t)(T * nk * dk) * 4);
    dbuf  bv = dbuf_put(v, (size_t)(T * nv * dv) * 4), bg = dbuf_put(g, (size_t)(T * nv) * 4);
    dbuf  bb = dbuf_put(beta, (size_t)(T * nv) * 4), bc = dbuf_put(cu, (size_t)(n_seq + 1) * 4);
    dbuf  bo = dbuf_put(NULL, (size_t)(T * nv * dv) * 4);
    float scale = 1.0f / sqrtf((float)dk);
    tst_ok(cpu->gated_delta_rule(cctx, bo.c, bq.c, bk.c, bv.c, bg.c, bb.c, bc.c, n_seq, T, nk, nv, dk, dv,
                                  scale),
            "cpu gated_delta_rule");
    if (chunked) {
        poison(bo.g, T * nv * dv);
        tst_ok(gpu->sync(gctx), "sync");
    }
    tst_ok(gpu->gated_delta_rule(chunked ? gctx16 : gctx, bo.g, bq.g, bk.g, bv.g, bg.g, bb.g, bc.g, n_seq, T,
                                  nk, nv, dk, dv, scale),
            "cuda gated_delta_rule");
    tst_ok(gpu->sync(chunked ? gctx16 : gctx), "sync");
    char name[112];
    snprintf(name, sizeof name, "gated_delta_rule%s T=%ld n_seq=%d nk=%d nv=%d dk=%d dv=%d",
             chunked ? " chunked" : "", T, n_seq, nk, nv, dk, dv);
    if (chunked) {
        /* q, k, W, U, the state and δ enter the tensor cores rounded to bf16 (relative 2^-9
         * each, as FLA rounds them), with fp32 accumulation and an fp32 state; the errors are
         * independent across the few products each output goes through, so the relative L2
         * error sits at a few 1e-3 (FLA's own bar against an fp32 reference is 5e-3). 1e-2
         * leaves room for long sequences without hiding a wrong chunk boundary or a missed
         * decay, which give errors of order 1; the max-element bound catches a wrong row. */
        float *c, *gg;
        dbuf_get(&bo, 0, T * nv * dv, &c, &gg);
        compare_rel(name, gg, c, T * nv * dv, 1e-2, 5e-2);
        free(c);
        free(gg);
    } else {
        /* fp32 recurrence vs double chunked form: the state update is a contraction (|k| = 1,
         * β < 1, e^g ≤ 1), so rounding does not grow with the sequence length */
        compare_buf(name, &bo, T * nv * dv, 1e-6, 1e-5);
    }
    dbuf_free(&bq);
    dbuf_free(&bk);
    dbuf_free(&bv);
    dbuf_free(&bg);
    dbuf_free(&bb);
    dbuf_free(&bc);
    dbuf_free(&bo);
    free(q);
    free(k);
    free(v);
    free(g);
    free(beta);
}

static void test_gdn(void) {
    static const int packed[] = {1, 63, 64, 65, 200};
    static const int one[] = {130};
    static const int longer[] = {1000, 1, 2500, 129};
    for (int chunked = 0; chunked < 2; chunked++) {
        gdn_case(packed, 5, 2, 6, 16, 12, chunked);
        gdn_case(packed, 5, 2, 6, 128, 128, chunked);
        gdn_case(packed, 5, 2, 2, 16, 128, chunked); /* nk = nv */
        gdn_case(packed, 5, 2, 2, 128, 12, chunked); /* nk = nv */
        gdn_case(one, 1, 1, 3, 100, 33, chunked);    /* dk, dv not multiples of 8 or 32 */
        gdn_case(one, 1, 1, 1, 256, 40, chunked);    /* the largest dk */
    }
    gdn_case(longer, 4, 1, 3, 128, 128, 1); /* long sequences: 40 chunks of state carried */
}

// ----------------------------------------------------------------------------
// bf16 GEMM inputs written by their producers (the target's fused path)

/* Downloads n bf16 values of b from element offset off on both sides, widened. */
static void dbuf_get16(const dbuf *b, long off, long n, float **c_out, float **g_out) {
    uint16_t *c16 = malloc((size_t)(n > 0 ? n : 1) * 2), *g16 = malloc((size_t)(n > 0 ? n : 1) * 2);
    if (!c16 || !g16)
        exit(1);
    if (cpu->download(cctx, c16, (const uint16_t *)b->c + off, (size_t)n * 2) != CM_OK ||
        gpu->download(gctx, g16, (const uint16_t *)b->g + off, (size_t)n * 2) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
    *c_out = tst_zeros_f32(n);
    *g_out = tst_zeros_f32(n);
    for (long i = 0; i < n; i++) {
        (*c_out)[i] = tst_bf16_widen(c16[i]);
        (*g_out)[i] = tst_bf16_widen(g16[i]);
    }
    free(c16);
    free(g16);
}

/* Both sides round an f32 value that agrees to ~1e-6 relative, so their bf16 outputs agree
 * or differ by one bf16 ulp (≤ 2^-7 relative) where the value lies next to a rounding
 * boundary: rtol 2^-7. */
#define BF16_RTOL 0.0078125

static void compare_buf16(const char *name, const dbuf *b, long off, long n) {
    float *c, *g;
    dbuf_get16(b, off, n, &c, &g);
    compare(name, g, c, n, 1e-30, BF16_RTOL);
    free(c);
    free(g);
}

/* Fills a bf16 device buffer with NaN (0xffff) so that an element the kernel skips fails. */
static void poison16(void *dev, long n) {
    uint16_t *nan = malloc((size_t)(n > 0 ? n : 1) * 2);
    if (!nan)
        exit(1);
    for (long i = 0; i < n; i++)
        nan[i] = 0xffffu;
    TST_CHECK(tst_ok(gpu->upload(gctx, dev, nan, (size_t)n * 2), "poison16 upload"));
    free(nan);
}

static void gemm_bf16in_case(long M, long N, long K) {
    float    *inp = tst_rand_f32(M * K, -1, 1), *w = tst_rand_f32(N * K, -1, 1);
    uint16_t *in16 = malloc((size_t)(M * K) * 2), *w16 = malloc((size_t)(N * K) * 2);
    double   *bound = malloc((size_t)(M * N) * sizeof(double));
    if (!in16 || !w16 || !bound)
        exit(1);
    for (long i = 0; i < M * K; i++) {
        in16[i] = tst_bf16_round(inp[i]);
        inp[i] = tst_bf16_widen(in16[i]);
    }
    for (long i = 0; i < N * K; i++)
        w16[i] = tst_bf16_round(w[i]);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            double sum = 0;
            for (long k = 0; k < K; k++)
                sum += fabs((double)inp[m * K + k] * (double)w[n * K + k]);
            bound[m * N + n] = sum;
        }
    dbuf bin = dbuf_put(in16, (size_t)(M * K) * 2), bw = dbuf_put(w, (size_t)(N * K) * 4);
    dbuf bw16 = dbuf_put(w16, (size_t)(N * K) * 2), bo = dbuf_put(NULL, (size_t)(M * N) * 4);
    for (int wi = 0; wi < 2; wi++) {
        cm_dtype    wdt = wi ? CM_DTYPE_BF16 : CM_DTYPE_F32;
        const void *wc = wi ? bw16.c : bw.c, *wg = wi ? bw16.g : bw.g;
        tst_ok(cpu->gemm_bf16in(cctx, bo.c, bin.c, wc, wdt, M, N, K), "cpu gemm_bf16in");
        float *ref = tst_zeros_f32(M * N), *got = tst_zeros_f32(M * N);
        cpu->download(cctx, ref, bo.c, (size_t)(M * N) * sizeof(float));
        for (int mode = 0; mode < 2; mode++) {
            kn_ctx *g = mode ? gctx16 : gctx;
            poison(bo.g, M * N);
            tst_ok(gpu->gemm_bf16in(g, bo.g, bin.g, wg, wdt, M, N, K), "cuda gemm_bf16in");
            tst_ok(gpu->download(g, got, bo.g, (size_t)(M * N) * sizeof(float)), "download");
            /* the input is bf16-exact: only BF16 mode with F32 weights rounds an operand */
            double tol = mode == 1 && wi == 0 ? 1e-2 : 1e-5;
            char   name[112];
            snprintf(name, sizeof name, "gemm_bf16in %s-mode W=%s M=%ld N=%ld K=%ld", mode ? "BF16" : "F32",
                     wi ? "BF16" : "F32", M, N, K);
            compare_bound(name, got, ref, bound, M * N, tol);
            /* gemm_bf16in_acc onto a base: within an ulp of the gpu's own product plus the base (its
             * epilogue adds the fp32 sum once); the cpu's is its product then add, exactly */
            float *base = tst_rand_f32(M * N, -4, 4), *acc = tst_zeros_f32(M * N);
            tst_ok(gpu->upload(g, bo.g, base, (size_t)(M * N) * sizeof(float)), "upload");
            tst_ok(gpu->gemm_bf16in_acc(g, bo.g, bin.g, wg, wdt, M, N, K), "cuda gemm_bf16in_acc");
            tst_ok(gpu->download(g, acc, bo.g, (size_t)(M * N) * sizeof(float)), "download");
            long far = 0, bits = 0;
            for (long i = 0; i < M * N; i++) {
                const float want = base[i] + got[i];
                bits += memcmp(&acc[i], &want, 4) != 0;
                far += fabs((double)acc[i] - want) > 2.4e-7 * (fabs((double)base[i]) + fabs((double)got[i]));
            }
            printf("gemm_bf16in_acc %s-mode W=%s M=%ld N=%ld K=%ld: %ld of %ld not bit-equal to the product + add "
                   "(%ld past an ulp)\n", mode ? "BF16" : "F32", wi ? "BF16" : "F32", M, N, K, bits, M * N, far);
            TST_CHECK(far == 0);
            if (mode == 0) { /* the cpu, once per weight type: its product, then the add, exactly */
                float *cacc = tst_zeros_f32(M * N);
                tst_ok(cpu->upload(cctx, bo.c, base, (size_t)(M * N) * sizeof(float)), "upload");
                tst_ok(cpu->gemm_bf16in_acc(cctx, bo.c, bin.c, wc, wdt, M, N, K), "cpu gemm_bf16in_acc");
                tst_ok(cpu->download(cctx, cacc, bo.c, (size_t)(M * N) * sizeof(float)), "download");
                long cbad = 0;
                for (long i = 0; i < M * N; i++) {
                    const float want = base[i] + ref[i];
                    cbad += memcmp(&cacc[i], &want, 4) != 0;
                }
                TST_CHECK(cbad == 0);
                free(cacc);
            }
            free(base);
            free(acc);
        }
        free(ref);
        free(got);
    }
    dbuf_free(&bin);
    dbuf_free(&bw);
    dbuf_free(&bw16);
    dbuf_free(&bo);
    free(inp);
    free(w);
    free(in16);
    free(w16);
    free(bound);
}

/* off shifts x and y by one float, so the cuda kernels take their scalar (unaligned) path. */
static void norm_bf16_case(long rows, long C, int off) {
    float *x = tst_rand_f32(rows * C + off, -2, 2), *y = tst_rand_f32(rows * C + off, -2, 2);
    float *z = tst_rand_f32(rows * C + off, -4, 4), *w = tst_rand_f32(C, -0.5, 1.5);
    dbuf   bx = dbuf_put(x, (size_t)(rows * C + off) * 4), by = dbuf_put(y, (size_t)(rows * C + off) * 4);
    dbuf   bz = dbuf_put(z, (size_t)(rows * C + off) * 4), bw = dbuf_put(w, (size_t)C * 4);
    dbuf   bo = dbuf_put(NULL, (size_t)(rows * C) * 2);
    char   name[112];
    float *xc = (float *)bx.c + off, *xg = (float *)bx.g + off;
    float *yc = (float *)by.c + off, *yg = (float *)by.g + off;
    float *zc = (float *)bz.c + off, *zg = (float *)bz.g + off;
    for (int one_plus = 0; one_plus < 2; one_plus++) {
        /* one_plus 0: no residual (y NULL); 1: x += y first */
        poison16(bo.g, rows * C);
        tst_ok(cpu->add_rmsnorm_bf16(cctx, bo.c, xc, one_plus ? yc : NULL, bw.c, rows, C, 1e-6f, one_plus),
                "cpu add_rmsnorm_bf16");
        tst_ok(gpu->add_rmsnorm_bf16(gctx, bo.g, xg, one_plus ? yg : NULL, bw.g, rows, C, 1e-6f, one_plus),
                "cuda add_rmsnorm_bf16");
        snprintf(name, sizeof name, "add_rmsnorm_bf16 rows=%ld C=%ld %s one_plus=%d%s", rows, C,
                 one_plus ? "x+=y" : "y=NULL", one_plus, off ? " unaligned" : "");
        compare_buf16(name, &bo, 0, rows * C);
        snprintf(name, sizeof name, "add_rmsnorm_bf16 rows=%ld C=%ld: x after the add%s", rows, C,
                 off ? " unaligned" : "");
        compare_buf(name, &bx, rows * C + off, 0, 0); /* one correctly rounded fp32 sum, as add */
    }
    poison16(bo.g, rows * C);
    tst_ok(cpu->rmsnorm_gated_bf16(cctx, bo.c, xc, zc, bw.c, rows, C, 1e-6f), "cpu rmsnorm_gated_bf16");
    tst_ok(gpu->rmsnorm_gated_bf16(gctx, bo.g, xg, zg, bw.g, rows, C, 1e-6f), "cuda rmsnorm_gated_bf16");
    snprintf(name, sizeof name, "rmsnorm_gated_bf16 rows=%ld C=%ld%s", rows, C, off ? " unaligned" : "");
    compare_buf16(name, &bo, 0, rows * C);
    poison16(bo.g, rows * C);
    tst_ok(cpu->swiglu_bf16(cctx, bo.c, zc, yc, rows * C), "cpu swiglu_bf16");
    tst_ok(gpu->swiglu_bf16(gctx, bo.g, zg, yg, rows * C), "cuda swiglu_bf16");
    snprintf(name, sizeof name, "swiglu_bf16 n=%ld%s", rows * C, off ? " unaligned" : "");
    compare_buf16(name, &bo, 0, rows * C);
    dbuf_free(&bx);
    dbuf_free(&by);
    dbuf_free(&bz);
    dbuf_free(&bw);
    dbuf_free(&bo);
    free(x);
    free(y);
    free(z);
    free(w);
}

static void gdn_conv_case(const int *lens, int n_seq, int nk, int nv, int dk, int dv, int K) {
    int32_t cu[16];
    long    T = make_seqs(lens, n_seq, cu);
    long    qk = (long)nk * dk, C = 2 * qk + (long)nv * dv;
    float  *x = tst_rand_f32(T * C, -2, 2), *w = tst_rand_f32(C * K, -1, 1);
    dbuf    bx = dbuf_put(x, (size_t)(T * C) * 4), bw = dbuf_put(w, (size_t)(C * K) * 4);
    dbuf    bc = dbuf_put(cu, (size_t)(n_seq + 1) * 4);
    dbuf    bq = dbuf_put(NULL, (size_t)(T * qk) * 4), bk = dbuf_put(NULL, (size_t)(T * qk) * 4);
    dbuf    bv = dbuf_put(NULL, (size_t)(T * nv * dv) * 4);
    poison(bq.g, T * qk);
    poison(bk.g, T * qk);
    poison(bv.g, T * nv * dv);
    tst_ok(cpu->gdn_conv_qkv(cctx, bq.c, bk.c, bv.c, bx.c, bw.c, bc.c, n_seq, T, nk, nv, dk, dv, K, 1e-6f),
            "cpu gdn_conv_qkv");
    tst_ok(gpu->gdn_conv_qkv(gctx, bq.g, bk.g, bv.g, bx.g, bw.g, bc.g, n_seq, T, nk, nv, dk, dv, K, 1e-6f),
            "cuda gdn_conv_qkv");
    char name[112];
    snprintf(name, sizeof name, "gdn_conv_qkv q T=%ld n_seq=%d nk=%d dk=%d K=%d", T, n_seq, nk, dk, K);
    compare_buf(name, &bq, T * qk, 1e-6, 1e-5);
    snprintf(name, sizeof name, "gdn_conv_qkv k T=%ld n_seq=%d nk=%d dk=%d K=%d", T, n_seq, nk, dk, K);
    compare_buf(name, &bk, T * qk, 1e-6, 1e-5);
    snprintf(name, sizeof name, "gdn_conv_qkv v T=%ld n_seq=%d nv=%d dv=%d K=%d", T, n_seq, nv, dv, K);
    compare_buf(name, &bv, T * nv * dv, 1e-6, 1e-5);
    dbuf_free(&bx);
    dbuf_free(&bw);
    dbuf_free(&bc);
    dbuf_free(&bq);
    dbuf_free(&bk);
    dbuf_free(&bv);
    free(x);
    free(w);
}

static void test_bf16_producers(void) {
    TST_CHECK(cpu->gemm_rounds_input(cctx) == 0);
    TST_CHECK(gpu->gemm_rounds_input(gctx) == 0);
    TST_CHECK(gpu->gemm_rounds_input(gctx16) == 1);
    gemm_bf16in_case(1, 1, 1);
    gemm_bf16in_case(7, 13, 29);
    gemm_bf16in_case(130, 257, 96);

    static const long shapes[][2] = {{1, 1}, {7, 33}, {130, 1000}, {3, 5120}, {300, 128}}; /* rows C */
    for (int s = 0; s < 5; s++)
        norm_bf16_case(shapes[s][0], shapes[s][1], 0);
    norm_bf16_case(7, 36, 1);
    norm_bf16_case(5, 128, 1);

    static const int packed[] = {1, 63, 64, 65, 200};
    static const int small[] = {1, 2, 3};
    static const int longs[] = {300, 1, 140, 2};
    gdn_conv_case(packed, 5, 2, 4, 16, 12, 4);  /* float4 path, several runs and sequence starts */
    gdn_conv_case(packed, 5, 1, 3, 33, 40, 4);  /* odd head size: scalar path */
    gdn_conv_case(longs, 4, 2, 6, 128, 128, 4); /* the Qwen head sizes, GVA 3 */
    gdn_conv_case(longs, 4, 1, 1, 300, 5, 3);   /* a head wider than the block */
    gdn_conv_case(small, 3, 1, 2, 5, 7, 7);     /* kernel longer than every sequence */
    gdn_conv_case(packed, 5, 1, 1, 8, 8, 1);
}

// ----------------------------------------------------------------------------
// empty shapes: CM_OK and no launch (a zero-sized grid would be a launch error)

static void test_empty(void) {
    float  *buf = NULL;
    int32_t zero = 0;
    void   *cu = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&buf, 64 * sizeof(float)), "alloc"));
    TST_CHECK(tst_ok(gpu->alloc(gctx, &cu, sizeof zero), "alloc"));
    TST_CHECK(tst_ok(gpu->copy2d(gctx, buf, 4, buf + 32, 4, 0, 4), "copy2d rows=0"));
    TST_CHECK(tst_ok(gpu->add(gctx, buf, buf, 0), "add n=0"));
    TST_CHECK(tst_ok(gpu->swiglu(gctx, buf, buf, buf, 0), "swiglu n=0"));
    TST_CHECK(tst_ok(gpu->embed(gctx, buf, cu, buf, CM_DTYPE_BF16, 0, 8), "embed T=0"));
    TST_CHECK(tst_ok(gpu->gemm(gctx16, buf, buf, buf, CM_DTYPE_F32, 0, 8, 8), "gemm M=0"));
    TST_CHECK(tst_ok(gpu->gemm(gctx, buf, buf, buf, CM_DTYPE_BF16, 8, 0, 8), "gemm N=0"));
    TST_CHECK(tst_ok(gpu->rmsnorm(gctx, buf, buf, buf, 0, 8, 1e-6f, 1), "rmsnorm rows=0"));
    TST_CHECK(tst_ok(gpu->rmsnorm_gated(gctx, buf, buf, buf, buf, 0, 8, 1e-6f), "rmsnorm_gated rows=0"));
    TST_CHECK(tst_ok(gpu->l2norm(gctx, buf, buf, 0, 8, 1e-6f), "l2norm rows=0"));
    TST_CHECK(tst_ok(gpu->rope(gctx, buf, cu, 0, 2, 8, 8, 1e4f), "rope T=0"));
    TST_CHECK(
        tst_ok(gpu->attention(gctx, buf, buf, buf, buf, NULL, cu, 0, 0, 2, 1, 8, 0.3f), "attention T=0"));
    TST_CHECK(tst_ok(gpu->conv1d_silu(gctx, buf, buf + 32, buf, cu, 0, 0, 8, 4), "conv1d_silu T=0"));
    TST_CHECK(tst_ok(gpu->gdn_conv_qkv(gctx, buf, buf, buf, buf + 32, buf, cu, 0, 0, 1, 1, 4, 4, 4, 1e-6f),
                      "gdn_conv_qkv T=0"));
    TST_CHECK(tst_ok(gpu->gemm_bf16in(gctx16, buf, (const uint16_t *)buf, buf, CM_DTYPE_BF16, 0, 8, 8),
                      "gemm_bf16in M=0"));
    TST_CHECK(tst_ok(gpu->add_rmsnorm_bf16(gctx, (uint16_t *)buf, buf, buf, buf, 0, 8, 1e-6f, 1),
                      "add_rmsnorm_bf16 rows=0"));
    TST_CHECK(tst_ok(gpu->rmsnorm_gated_bf16(gctx, (uint16_t *)buf, buf, buf, buf, 0, 8, 1e-6f),
                      "rmsnorm_gated_bf16 rows=0"));
    TST_CHECK(tst_ok(gpu->swiglu_bf16(gctx, (uint16_t *)buf, buf, buf, 0), "swiglu_bf16 n=0"));
    TST_CHECK(tst_ok(gpu->gdn_gate(gctx, buf, buf, buf, buf, buf, buf, 0, 4), "gdn_gate T=0"));
    TST_CHECK(tst_ok(gpu->gated_delta_rule(gctx, buf, buf, buf, buf, buf, buf, cu, 0, 0, 1, 2, 8, 8, 0.3f),
                      "gated_delta_rule T=0"));
    TST_CHECK(tst_ok(gpu->sync(gctx), "sync") && tst_ok(gpu->sync(gctx16), "sync"));
    gpu->free(gctx, cu);
    gpu->free(gctx, buf);
    printf("%-58s ok\n", "empty shapes: every op returns ok without launching");
}

// ----------------------------------------------------------------------------
// bad arguments: one clear status, no launch, and the context stays usable

static void expect(cm_status got, cm_status want, const char *what) {
    if (got != want)
        fprintf(stderr, "  %s: got %s, want %s (%s)\n", what, cm_status_str(got), cm_status_str(want),
                cm_last_error());
    else
        printf("%-58s -> %s: %s\n", what, cm_status_str(got), cm_last_error());
    TST_CHECK(got == want);
}

static void test_bad_args(void) {
    float *buf = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&buf, 4096 * sizeof(float)), "alloc"));
    int32_t cu_h[2] = {0, 8};
    void   *cu = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, &cu, sizeof cu_h), "alloc"));
    gpu->upload(gctx, cu, cu_h, sizeof cu_h);

    kn_ctx       *c = NULL;
    kn_ctx_config bad = {999, KN_GEMM_MODE_F32};
    expect(gpu->ctx_create(&c, &bad), CM_ERR_INVALID_ARG, "ctx_create device 999");
    TST_CHECK(c == NULL);
    kn_ctx_config badm = {0, (kn_gemm_mode)7};
    expect(gpu->ctx_create(&c, &badm), CM_ERR_INVALID_ARG, "ctx_create gemm_mode 7");
    expect(gpu->alloc(gctx, NULL, 16), CM_ERR_INVALID_ARG, "alloc out=NULL");
    expect(gpu->gemm(gctx, buf, buf, buf, CM_DTYPE_F32, -1, 2, 2), CM_ERR_INVALID_ARG, "gemm M=-1");
    expect(gpu->gemm(gctx, buf, buf, buf, CM_DTYPE_F16, 2, 2, 2), CM_ERR_UNSUPPORTED, "gemm W F16");
    expect(gpu->gemm(gctx, buf, NULL, buf, CM_DTYPE_F32, 2, 2, 2), CM_ERR_INVALID_ARG, "gemm inp=NULL");
    expect(gpu->embed(gctx, buf, cu, buf, CM_DTYPE_F16, 2, 2), CM_ERR_UNSUPPORTED, "embed table F16");
    expect(gpu->copy2d(gctx, buf, 3, buf + 100, 8, 2, 4), CM_ERR_INVALID_ARG, "copy2d dst_ld < cols");
    expect(gpu->rmsnorm(gctx, buf, buf, buf, 2, 0, 1e-6f, 1), CM_ERR_INVALID_ARG, "rmsnorm C=0");
    expect(gpu->rope(gctx, buf, cu, 2, 1, 8, 5, 1e4f), CM_ERR_INVALID_ARG, "rope rot_dim odd");
    expect(gpu->rope(gctx, buf, cu, 2, 1, 8, 8, -1.0f), CM_ERR_INVALID_ARG, "rope theta < 0");
    expect(gpu->attention(gctx, buf, buf, buf, buf, NULL, cu, 1, 8, 5, 2, 16, 0.25f), CM_ERR_INVALID_ARG,
           "attention nq=5 nkv=2");
    expect(gpu->attention(gctx, buf, buf, buf, buf, NULL, cu, 1, 8, 1, 1, 300, 0.25f), CM_ERR_UNSUPPORTED,
           "attention hd=300");
    expect(gpu->attention(gctx, buf, buf, buf, buf, NULL, cu, 0, 8, 1, 1, 16, 0.25f), CM_ERR_INVALID_ARG,
           "attention n_seq=0 with T=8");
    expect(gpu->conv1d_silu(gctx, buf, buf, buf + 2048, cu, 1, 8, 4, 4), CM_ERR_INVALID_ARG,
           "conv1d_silu out == x");
    expect(gpu->conv1d_silu(gctx, buf, buf + 64, buf + 2048, cu, 1, 8, 4, 0), CM_ERR_INVALID_ARG,
           "conv1d_silu K=0");
    expect(gpu->gdn_gate(gctx, buf, buf, buf, buf, buf, buf, 8, 0), CM_ERR_INVALID_ARG, "gdn_gate nv=0");
    expect(gpu->gdn_conv_qkv(gctx, buf + 64, buf + 128, buf + 192, buf, buf + 2048, cu, 1, 8, 1, 1, 4, 4, 4,
                             1e-6f),
           CM_ERR_INVALID_ARG, "gdn_conv_qkv q overlaps x");
    expect(gpu->gdn_conv_qkv(gctx, buf + 256, buf + 512, buf + 768, buf, buf + 2048, cu, 1, 8, 1, 1, 4, 4, 9,
                             1e-6f),
           CM_ERR_UNSUPPORTED, "gdn_conv_qkv K=9");
    expect(gpu->gdn_conv_qkv(gctx, buf + 256, buf + 512, buf + 768, buf, buf + 2048, cu, 1, 8, 0, 1, 4, 4, 4,
                             1e-6f),
           CM_ERR_INVALID_ARG, "gdn_conv_qkv nk=0");
    expect(gpu->add_rmsnorm_bf16(gctx, (uint16_t *)buf, buf + 64, NULL, buf, 2, 0, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "add_rmsnorm_bf16 C=0");
    expect(gpu->gemm_bf16in(gctx16, buf, NULL, buf, CM_DTYPE_BF16, 2, 2, 2), CM_ERR_INVALID_ARG,
           "gemm_bf16in inp=NULL");
    expect(gpu->gated_delta_rule(gctx, buf, buf, buf, buf, buf, buf, cu, 1, 8, 2, 3, 16, 16, 0.25f),
           CM_ERR_INVALID_ARG, "gated_delta_rule nv=3 nk=2");
    expect(gpu->gated_delta_rule(gctx, buf, buf, buf, buf, buf, buf, cu, 1, 8, 1, 1, 300, 16, 0.25f),
           CM_ERR_UNSUPPORTED, "gated_delta_rule dk=300");
    TST_CHECK(tst_ok(gpu->sync(gctx), "sync after bad arguments"));
    gpu->free(gctx, cu);
    gpu->free(gctx, buf);
}

// ----------------------------------------------------------------------------
// qk_prep: the attention's q/gate split, q/k head rmsnorm and partial rope in one op

/* cuda qk_prep against cpu qk_prep (itself bit-identical to the copy2d/rmsnorm/rope chain,
 * tests/test_kn_qk_prep.c): gate exact, q and k within 1e-5 relative; outputs poisoned. */
static void qk_prep_case(const int *lens, int n_seq, int nq, int nkv, int hd, int rot, int gated, int in_place,
                         int one_plus, float theta, int pos_base) {
    int32_t cu[16];
    long    T = make_seqs(lens, n_seq, cu);
    long    qs = gated ? 2L * hd : hd, nqg = T * nq * qs, nqe = T * nq * hd, nke = T * nkv * hd;
    int32_t *pos = malloc((size_t)T * sizeof(int32_t));
    if (!pos)
        exit(1);
    for (int s = 0; s < n_seq; s++)
        for (int t = cu[s]; t < cu[s + 1]; t++)
            pos[t] = pos_base + t - cu[s];
    float *qg = tst_rand_f32(nqg, -3, 3), *k = tst_rand_f32(nke, -3, 3), *qn = tst_rand_f32(hd, -0.5, 0.5),
          *kn = tst_rand_f32(hd, -0.5, 0.5);
    dbuf bqg = dbuf_put(qg, (size_t)nqg * 4), bk = dbuf_put(k, (size_t)nke * 4), bp = dbuf_put(pos, (size_t)T * 4);
    dbuf bqn = dbuf_put(qn, (size_t)hd * 4), bkn = dbuf_put(kn, (size_t)hd * 4);
    dbuf bq = dbuf_put(NULL, (size_t)nqe * 4), bg = dbuf_put(NULL, (size_t)nqe * 4);
    if (!in_place)
        poison(bq.g, nqe);
    poison(bg.g, nqe);
    const dbuf *qout = in_place ? &bqg : &bq;
    tst_ok(cpu->qk_prep(cctx, qout->c, gated ? bg.c : NULL, bk.c, bqg.c, bqn.c, bkn.c, bp.c, T, nq, nkv, hd, rot,
                         theta, 1e-6f, one_plus),
            "cpu qk_prep");
    tst_ok(gpu->qk_prep(gctx, qout->g, gated ? bg.g : NULL, bk.g, bqg.g, bqn.g, bkn.g, bp.g, T, nq, nkv, hd, rot,
                         theta, 1e-6f, one_plus),
            "cuda qk_prep");
    char name[128];
    snprintf(name, sizeof name, "qk_prep q T=%ld seqs=%d nq=%d hd=%d rot=%d gated=%d inplace=%d pos+%d", T, n_seq,
             nq, hd, rot, gated, in_place, pos_base);
    compare_buf(name, qout, nqe, 1e-6, 1e-5);
    snprintf(name, sizeof name, "qk_prep k T=%ld nkv=%d hd=%d rot=%d one_plus=%d", T, nkv, hd, rot, one_plus);
    compare_buf(name, &bk, nke, 1e-6, 1e-5);
    if (gated) {
        snprintf(name, sizeof name, "qk_prep gate T=%ld nq=%d hd=%d (exact)", T, nq, hd);
        compare_buf(name, &bg, nqe, 0, 0);
    }
    dbuf *all[] = {&bqg, &bk, &bp, &bqn, &bkn, &bq, &bg};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
    free(pos);
    free(qg);
    free(k);
    free(qn);
    free(kn);
}

static void test_qk_prep(void) {
    if (!gpu->qk_prep) {
        printf("%-58s skipped (no cuda qk_prep)\n", "qk_prep");
        return;
    }
    static const int l1[] = {1}, l3[] = {3, 1, 7}, l4[] = {1, 17, 4}, l2[] = {9, 2}, l27[] = {70, 60},
                     l5[] = {4, 5};
    qk_prep_case(l1, 1, 1, 1, 2, 2, 0, 1, 1, 1e4f, 0);
    qk_prep_case(l3, 3, 3, 1, 32, 8, 1, 0, 1, 1e7f, 0);
    qk_prep_case(l4, 3, 6, 2, 64, 64, 1, 0, 1, 1e7f, 0);
    qk_prep_case(l2, 2, 6, 2, 64, 16, 0, 1, 0, 1e6f, 0);
    qk_prep_case(l2, 2, 6, 2, 64, 16, 0, 0, 1, 1e6f, 0);
    qk_prep_case(l5, 2, 4, 2, 30, 10, 1, 0, 0, 1e4f, 0);
    qk_prep_case(l27, 2, 24, 4, 256, 64, 1, 0, 1, 1e7f, 0); /* the 27B target's attention */
    qk_prep_case(l27, 2, 24, 4, 256, 64, 1, 0, 1, 1e7f, 262000);
    qk_prep_case(l5, 2, 2, 1, 1024, 1024, 1, 0, 1, 1e7f, 0);
    float  *buf = NULL;
    int32_t *p = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&buf, 8192 * 4), "alloc"));
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&p, 64), "alloc"));
    expect(gpu->qk_prep(gctx, buf + 4096, NULL, buf + 6144, buf, buf, buf, p, 1, 1, 1, 1030, 8, 1e4f, 1e-6f, 1),
           CM_ERR_UNSUPPORTED, "qk_prep hd=1030");
    expect(gpu->qk_prep(gctx, buf + 64, buf + 2048, buf + 4096, buf, buf + 6144, buf + 6144, p, 4, 2, 1, 8, 8, 1e4f,
                        1e-6f, 1),
           CM_ERR_INVALID_ARG, "qk_prep gated q overlaps qg");
    expect(gpu->qk_prep(gctx, buf, NULL, buf + 4096, buf, buf + 6144, buf + 6144, p, 4, 2, 1, 8, 7, 1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "qk_prep odd rot_dim");
    expect(gpu->qk_prep(gctx, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 2, 1, 8, 8, 1e4f, 1e-6f, 1), CM_OK,
           "qk_prep T=0");
    TST_CHECK(tst_ok(gpu->sync(gctx), "sync after qk_prep bad arguments"));
    gpu->free(gctx, p);
    gpu->free(gctx, buf);
}

// ----------------------------------------------------------------------------

int main(void) {
    if (!tst_pair_open())
        return tst_report();

    test_memory();
    test_copy_peer();
    test_copy2d();
    test_elementwise();
    test_embed();
    test_gemm();
    test_norms();
    test_rope();
    test_attention();
    test_conv1d();
    test_gdn_gate();
    test_gdn();
    test_bf16_producers();
    test_empty();
    test_bad_args();
    test_qk_prep();

    tst_pair_close();
    TST_CHECK(gctx == NULL && gctx16 == NULL);
    return tst_report();
}
