/* tests/test_kn_gdn16.c — the GDN conv and core on bf16 operands (gdn_conv_qkv_bf16 and
 * gated_delta_rule_bf16: the fused target path, where the conv writes q·scale, k and v in bf16
 * and the chunked core reads them without its own copies), on cuda against
 *   - the same GPU's F32 ops, bit for bit: the conv's outputs equal bf16(q·scale), bf16(k) and
 *     bf16(v) of gdn_conv_qkv's F32 outputs (rounded on the host), and the core's output equals
 *     gated_delta_rule in bf16 mode (the chunked form) on those F32 outputs with that scale;
 *   - the cpu reference of each: the conv within one bf16 step (rel 8e-3, the SiLU's exp is the
 *     device's fast one), the core within rel L2 1e-2 (test_kn_cuda's bar for the chunked form);
 *   - the refusals: an F32-mode context and dk 100 give CM_ERR_UNSUPPORTED on cuda (the caller
 *     then widens), the cpu takes any dk;
 *   - the two state kernels of the chunked form against each other and the cpu: the dispatch
 *     (warpgroup MMA on compute capability 9.0) and TANDEM_GDN_KERNEL=mma (mma.sync), each within
 *     rel L2 1e-2 of the cpu, and within 1e-3 of each other (the same bf16 roundings, fp32 sums in
 *     another order), on packed and long sequences, dk 128, 64 and 100 (padded to 128), dv 128,
 *     40 and 33, and at the 27B's 16 / 48 heads (480 CTAs, more than the GPU's multiprocessors).
 * Shapes: the 27B's heads (dk = dv = 128, GVA 3) on a pack of five sequences, dk 64 with dv 40,
 * dk 256 with dv 33, conv kernels 3 and 4. Label gpu; exits 77 without a cuda device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_dtype.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

static void *host_of(const dbuf *b, int on_gpu) {
    void *h = malloc(b->bytes);
    if (!h ||
        (on_gpu ? gpu->download(gctx, h, b->g, b->bytes) : cpu->download(cctx, h, b->c, b->bytes)) != CM_OK) {
        fprintf(stderr, "download failed: %s\n", cm_last_error());
        exit(1);
    }
    return h;
}

static float *widen(const uint16_t *h, long n) {
    float *f = malloc((size_t)n * 4);
    for (long i = 0; i < n; i++)
        f[i] = cm_bf16_to_f32(h[i]);
    return f;
}

/* how many of n bf16 values differ from bf16(f[i]·mul) */
static long diff16(const uint16_t *h, const float *f, float mul, long n) {
    long d = 0;
    for (long i = 0; i < n; i++)
        d += h[i] != cm_f32_to_bf16(f[i] * mul);
    return d;
}

static double rel_l2(const float *a, const float *b, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        const double e = (double)a[i] - b[i];
        num += e * e;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void one_case(const int *lens, int n_seq, int nk, int nv, int dk, int dv, int K) {
    int32_t cu[8] = {0};
    for (int s = 0; s < n_seq; s++)
        cu[s + 1] = cu[s] + lens[s];
    const long  T = cu[n_seq], qk = (long)nk * dk, vd = (long)nv * dv, C = 2 * qk + vd;
    const float scale = 1.0f / sqrtf((float)dk);
    float      *x = tst_rand_f32(T * C, -2, 2), *w = tst_rand_f32(C * K, -1, 1);
    float      *g = tst_rand_f32(T * nv, -1.5, -0.001), *beta = tst_rand_f32(T * nv, 0.02, 0.98);
    dbuf        bx = dbuf_put(x, (size_t)(T * C) * 4), bw = dbuf_put(w, (size_t)(C * K) * 4);
    dbuf        bcu = dbuf_put(cu, (size_t)(n_seq + 1) * 4), bg = dbuf_put(g, (size_t)(T * nv) * 4);
    dbuf        bb = dbuf_put(beta, (size_t)(T * nv) * 4);
    dbuf        q32 = dbuf_put(NULL, (size_t)(T * qk) * 4), k32 = dbuf_put(NULL, (size_t)(T * qk) * 4);
    dbuf        v32 = dbuf_put(NULL, (size_t)(T * vd) * 4);
    dbuf        q16 = dbuf_put(NULL, (size_t)(T * qk) * 2), k16 = dbuf_put(NULL, (size_t)(T * qk) * 2);
    dbuf        v16 = dbuf_put(NULL, (size_t)(T * vd) * 2);
    dbuf        o32 = dbuf_put(NULL, (size_t)(T * vd) * 4), o16 = dbuf_put(NULL, (size_t)(T * vd) * 4);
    char        name[128];
    snprintf(name, sizeof name, "T=%ld n_seq=%d nk=%d nv=%d dk=%d dv=%d K=%d", T, n_seq, nk, nv, dk, dv, K);

    /* the conv: F32 and bf16 outputs on the GPU, bf16 on the cpu */
    tst_ok(
        gpu->gdn_conv_qkv(gctx16, q32.g, k32.g, v32.g, bx.g, bw.g, bcu.g, n_seq, T, nk, nv, dk, dv, K, 1e-6f),
        "cuda gdn_conv_qkv");
    tst_ok(gpu->gdn_conv_qkv_bf16(gctx16, q16.g, k16.g, v16.g, bx.g, bw.g, bcu.g, n_seq, T, nk, nv, dk, dv, K,
                                  1e-6f, scale),
           "cuda gdn_conv_qkv_bf16");
    tst_ok(cpu->gdn_conv_qkv_bf16(cctx, q16.c, k16.c, v16.c, bx.c, bw.c, bcu.c, n_seq, T, nk, nv, dk, dv, K,
                                  1e-6f, scale),
           "cpu gdn_conv_qkv_bf16");
    tst_ok(gpu->sync(gctx16), "sync");
    float     *hq = host_of(&q32, 1), *hk = host_of(&k32, 1), *hv = host_of(&v32, 1);
    uint16_t  *gq = host_of(&q16, 1), *gk = host_of(&k16, 1), *gv = host_of(&v16, 1);
    uint16_t  *cq = host_of(&q16, 0), *ck = host_of(&k16, 0), *cv = host_of(&v16, 0);
    const long d =
        diff16(gq, hq, scale, T * qk) + diff16(gk, hk, 1.0f, T * qk) + diff16(gv, hv, 1.0f, T * vd);
    printf("gdn_conv_qkv_bf16 %s: %ld of %ld values differ from the F32 op's rounded\n", name, d,
           2 * T * qk + T * vd);
    TST_CHECK(d == 0);
    float *a = widen(gq, T * qk), *b = widen(cq, T * qk);
    TST_CHECK(tst_compare("conv q·scale bf16, cuda vs cpu", 48, a, b, T * qk, 1e-6, 8e-3, NULL));
    free(a), free(b);
    a = widen(gk, T * qk), b = widen(ck, T * qk);
    TST_CHECK(tst_compare("conv k bf16, cuda vs cpu", 48, a, b, T * qk, 1e-6, 8e-3, NULL));
    free(a), free(b);
    a = widen(gv, T * vd), b = widen(cv, T * vd);
    TST_CHECK(tst_compare("conv v bf16, cuda vs cpu", 48, a, b, T * vd, 1e-6, 8e-3, NULL));
    free(a), free(b);

    /* the core: bf16 operands against the F32 op on the F32 conv outputs (GPU), and the cpu */
    tst_ok(gpu->gated_delta_rule(gctx16, o32.g, q32.g, k32.g, v32.g, bg.g, bb.g, bcu.g, n_seq, T, nk, nv, dk,
                                 dv, scale),
           "cuda gated_delta_rule");
    tst_ok(gpu->gated_delta_rule_bf16(gctx16, o16.g, q16.g, k16.g, v16.g, bg.g, bb.g, bcu.g, n_seq, T, nk, nv,
                                      dk, dv),
           "cuda gated_delta_rule_bf16");
    tst_ok(cpu->gated_delta_rule_bf16(cctx, o16.c, q16.c, k16.c, v16.c, bg.c, bb.c, bcu.c, n_seq, T, nk, nv,
                                      dk, dv),
           "cpu gated_delta_rule_bf16");
    tst_ok(gpu->sync(gctx16), "sync");
    float       *go32 = host_of(&o32, 1), *go16 = host_of(&o16, 1), *co16 = host_of(&o16, 0);
    const int    same = memcmp(go32, go16, (size_t)(T * vd) * 4) == 0;
    const double e = rel_l2(go16, co16, T * vd);
    printf("gated_delta_rule_bf16 %s: %s the F32 op's output; cuda vs cpu rel L2 %.2e (tol 1e-2)\n", name,
           same ? "bit-identical to" : "DIFFERS from", e);
    TST_CHECK(same && e <= 1e-2);

    free(hq), free(hk), free(hv), free(gq), free(gk), free(gv), free(cq), free(ck), free(cv);
    free(go32), free(go16), free(co16), free(x), free(w), free(g), free(beta);
    dbuf *all[] = {&bx, &bw, &bcu, &bg, &bb, &q32, &k32, &v32, &q16, &k16, &v16, &o32, &o16};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
}

static void refusals(void) {
    static const int32_t cu_h[2] = {0, 8};
    dbuf                 b = dbuf_put(NULL, 1 << 16), c = dbuf_put(cu_h, sizeof cu_h);
    float               *f = b.g;
    uint16_t            *h = b.g;
    TST_FAILS(gpu->gated_delta_rule_bf16(gctx, f, h, h, h, f, f, c.g, 1, 8, 1, 1, 128, 128),
              CM_ERR_UNSUPPORTED, "bf16-mode");
    TST_FAILS(gpu->gated_delta_rule_bf16(gctx16, f, h, h, h, f, f, c.g, 1, 8, 1, 1, 100, 16),
              CM_ERR_UNSUPPORTED, "dk 64, 128 or 256", "dk=100");
    TST_FAILS(gpu->gated_delta_rule_bf16(gctx16, f, h, h, h, f, f, c.g, 1, 8, 2, 3, 64, 16),
              CM_ERR_INVALID_ARG, "multiple");
    tst_ok(cpu->gated_delta_rule_bf16(cctx, b.c, b.c, b.c, b.c, b.c, b.c, c.c, 1, 8, 1, 1, 100, 16),
           "cpu gated_delta_rule_bf16 dk=100");
    dbuf_free(&b);
    dbuf_free(&c);
}

/* gated_delta_rule (F32 entry, bf16 mode: the chunked form) on the dispatch's state kernel and
 * on gmma's (TANDEM_GDN_KERNEL=mma), against the cpu and each other */
static void state_kernels(kn_ctx *gmma, const int *lens, int n_seq, int nk, int nv, int dk, int dv) {
    int32_t cu[8] = {0};
    for (int s = 0; s < n_seq; s++)
        cu[s + 1] = cu[s] + lens[s];
    const long T = cu[n_seq], qk = (long)nk * dk, vd = (long)nv * dv;
    float     *q = tst_rand_f32(T * qk, -1, 1), *k = tst_rand_f32(T * qk, -1, 1), *v = tst_rand_f32(T * vd, -1, 1);
    float     *g = tst_rand_f32(T * nv, -1.5, -0.001), *beta = tst_rand_f32(T * nv, 0.02, 0.98);
    for (long i = 0; i < T * nv; i += 2) /* slow decays too: the state carries across many chunks */
        g[i] *= 0.01f;
    tst_l2norm_rows(q, T * nk, dk);
    tst_l2norm_rows(k, T * nk, dk);
    dbuf bq = dbuf_put(q, (size_t)(T * qk) * 4), bk = dbuf_put(k, (size_t)(T * qk) * 4);
    dbuf bv = dbuf_put(v, (size_t)(T * vd) * 4), bg = dbuf_put(g, (size_t)(T * nv) * 4);
    dbuf bb = dbuf_put(beta, (size_t)(T * nv) * 4), bcu = dbuf_put(cu, (size_t)(n_seq + 1) * 4);
    dbuf o1 = dbuf_put(NULL, (size_t)(T * vd) * 4), o2 = dbuf_put(NULL, (size_t)(T * vd) * 4);
    const float scale = 1.0f / sqrtf((float)dk);
    tst_ok(cpu->gated_delta_rule(cctx, o1.c, bq.c, bk.c, bv.c, bg.c, bb.c, bcu.c, n_seq, T, nk, nv, dk, dv, scale),
           "cpu gated_delta_rule");
    tst_ok(gpu->gated_delta_rule(gctx16, o1.g, bq.g, bk.g, bv.g, bg.g, bb.g, bcu.g, n_seq, T, nk, nv, dk, dv,
                                 scale),
           "cuda gated_delta_rule (dispatch)");
    tst_ok(gpu->gated_delta_rule(gmma, o2.g, bq.g, bk.g, bv.g, bg.g, bb.g, bcu.g, n_seq, T, nk, nv, dk, dv, scale),
           "cuda gated_delta_rule (TANDEM_GDN_KERNEL=mma)");
    tst_ok(gpu->sync(gctx16), "sync");
    tst_ok(gpu->sync(gmma), "sync");
    float       *ref = host_of(&o1, 0), *a = host_of(&o1, 1), *b = host_of(&o2, 1);
    const double ea = rel_l2(a, ref, T * vd), eb = rel_l2(b, ref, T * vd), eab = rel_l2(a, b, T * vd);
    const int    same = memcmp(a, b, (size_t)(T * vd) * 4) == 0;
    printf("state kernels T=%ld n_seq=%d nk=%d nv=%d dk=%d dv=%d: dispatch vs cpu %.2e, mma vs cpu %.2e "
           "(tol 1e-2), dispatch vs mma %.2e%s (tol 1e-3)\n",
           T, n_seq, nk, nv, dk, dv, ea, eb, eab, same ? " (bit-identical: the same kernel ran)" : "");
    TST_CHECK(ea <= 1e-2 && eb <= 1e-2 && eab <= 1e-3);
    if (eab > 1e-3) { /* where they part: the first few outputs that differ by more than 1 % */
        int shown = 0;
        for (long i = 0; i < T * vd && shown < 8; i++)
            if (fabsf(a[i] - b[i]) > 1e-2f * (fabsf(b[i]) + 1e-3f)) {
                long tt = i / vd, hh = (i % vd) / dv, cc = i % dv;
                int  sq = 0;
                while (tt >= cu[sq + 1]) sq++;
                printf("  t=%ld (seq %d, +%ld) h=%ld c=%ld: %g vs %g\n", tt, sq, tt - cu[sq], hh, cc, a[i], b[i]);
                shown++;
            }
    }
    free(ref), free(a), free(b), free(q), free(k), free(v), free(g), free(beta);
    dbuf *all[] = {&bq, &bk, &bv, &bg, &bb, &bcu, &o1, &o2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        dbuf_free(all[i]);
}

int main(void) {
    if (!tst_pair_open())
        return tst_report();
    static const int packed[5] = {1, 64, 65, 130, 17}, one[1] = {150};
    one_case(packed, 5, 2, 6, 128, 128, 4);
    one_case(one, 1, 1, 3, 64, 40, 3);
    one_case(packed, 5, 1, 1, 256, 33, 4);
    refusals();
    kn_ctx *gmma = NULL;
    if (tst_gpu_ctx_env(&gmma, "TANDEM_GDN_KERNEL", "mma")) {
        static const int pk[5] = {1, 63, 64, 65, 200}, longer[4] = {1000, 1, 2500, 129}, odd[2] = {130, 77};
        state_kernels(gmma, pk, 5, 2, 6, 128, 128);
        state_kernels(gmma, longer, 4, 1, 3, 128, 128);
        state_kernels(gmma, pk, 5, 1, 3, 64, 40);
        state_kernels(gmma, odd, 2, 1, 2, 100, 33);
        state_kernels(gmma, pk, 5, 16, 48, 128, 128); /* the 27B's heads: 480 CTAs, more than the SMs */
        gpu->ctx_destroy(&gmma);
    }
    tst_pair_close();
    return tst_report();
}
