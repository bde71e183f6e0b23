/* tests/test_kn_cuda.c — the cuda backend against the cpu reference, entry by entry, through
 * the kn_backend tables, for the entries without a sequence table (memory, data movement,
 * elementwise, embed, GEMM, norms, the bf16 producers; test_kn_cuda_seq has the others):
 * random inputs from a fixed seed, the same call on both, and an elementwise comparison
 * |cuda − cpu| ≤ atol + rtol·|cpu| (GEMM: ≤ tol·Σ_k|a·b|, the rounding bound of a dot product)
 * on at least 3 shapes per op, odd sizes included. Every comparison prints its max abs error
 * and its worst error/tolerance ratio, so a failing run on a GPU machine says which op, which
 * shape and how far. Tolerances: exact for data movement and embed; 1e-5 relative for fp32 ops;
 * GEMM 1e-5 (F32 mode, and BF16 mode on bf16-exact inputs), 1e-2 (BF16 mode on general inputs);
 * the bf16 outputs of the fused producers (add_rmsnorm_bf16, rmsnorm_gated_bf16, swiglu_bf16)
 * within one bf16 ulp. Also empty shapes and bad arguments. Label gpu: exits 77 when the build
 * has no cuda backend or the machine has no cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"

#define TST_KN_SEED 0x2545f4914f6cdd1dull
#include "tst_kn.h"
#include "tst_kn_cmp.h"
#include "tst_kn_pair.h"

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
    /* T C V; C % 4 == 0 takes the four-column kernel */
    static const long shapes[][3] = {{1, 1, 1}, {7, 33, 50}, {130, 257, 1000}, {9, 4, 40}, {70, 5120, 300}};
    for (int s = 0; s < 5; s++) {
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
// bf16 GEMM inputs written by their producers (the target's fused path)

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
    test_bf16_producers();
    test_empty();
    test_bad_args();

    tst_pair_close();
    TST_CHECK(gctx == NULL && gctx16 == NULL);
    return tst_report();
}
