/* tests/test_kn_cuda_seq.c — the cuda backend's sequence-mixing entries against the cpu
 * reference, through the kn_backend tables: rope, attention (the exact per-token kernel and the
 * flash tensor-core one), conv1d + SiLU, the GDN gate, the gated delta rule (per-token and
 * chunked), the GDN's fused conv producer of bf16 q/k/v, and qk_prep. Packed sequences of odd
 * lengths from a fixed seed, the same call on both backends, outputs poisoned with NaN first.
 * Tolerances: 1e-5 relative for fp32 ops; the bf16 tensor-core kernels by relative L2 and
 * max error against max|ref|; bf16 outputs within one bf16 ulp. The entries without a sequence
 * table are test_kn_cuda's. Label gpu: exits 77 when the build has no cuda backend or the
 * machine has no cuda device. */
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
// rope

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

// ----------------------------------------------------------------------------
// attention, conv1d, the GDN gate and the gated delta rule

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
// the GDN's fused conv producer: bf16 q/k/v for the chunked kernel

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

static void test_gdn_conv(void) {
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
// qk_prep: the attention's q/gate split, q/k head rmsnorm and partial rope in one op

/* cuda qk_prep against cpu qk_prep (itself bit-identical to the copy2d/rmsnorm/rope chain,
 * tests/test_kn_qk_prep.c): gate exact, q and k within 1e-5 relative; outputs poisoned. */
static void qk_prep_case(const int *lens, int n_seq, int nq, int nkv, int hd, int rot, int gated,
                         int in_place, int one_plus, float theta, int pos_base) {
    int32_t  cu[16];
    long     T = make_seqs(lens, n_seq, cu);
    long     qs = gated ? 2L * hd : hd, nqg = T * nq * qs, nqe = T * nq * hd, nke = T * nkv * hd;
    int32_t *pos = malloc((size_t)T * sizeof(int32_t));
    if (!pos)
        exit(1);
    for (int s = 0; s < n_seq; s++)
        for (int t = cu[s]; t < cu[s + 1]; t++)
            pos[t] = pos_base + t - cu[s];
    float *qg = tst_rand_f32(nqg, -3, 3), *k = tst_rand_f32(nke, -3, 3), *qn = tst_rand_f32(hd, -0.5, 0.5),
          *kn = tst_rand_f32(hd, -0.5, 0.5);
    dbuf bqg = dbuf_put(qg, (size_t)nqg * 4), bk = dbuf_put(k, (size_t)nke * 4),
         bp = dbuf_put(pos, (size_t)T * 4);
    dbuf bqn = dbuf_put(qn, (size_t)hd * 4), bkn = dbuf_put(kn, (size_t)hd * 4);
    dbuf bq = dbuf_put(NULL, (size_t)nqe * 4), bg = dbuf_put(NULL, (size_t)nqe * 4);
    if (!in_place)
        poison(bq.g, nqe);
    poison(bg.g, nqe);
    const dbuf *qout = in_place ? &bqg : &bq;
    tst_ok(cpu->qk_prep(cctx, qout->c, gated ? bg.c : NULL, bk.c, bqg.c, bqn.c, bkn.c, bp.c, T, nq, nkv, hd,
                        rot, theta, 1e-6f, one_plus),
           "cpu qk_prep");
    tst_ok(gpu->qk_prep(gctx, qout->g, gated ? bg.g : NULL, bk.g, bqg.g, bqn.g, bkn.g, bp.g, T, nq, nkv, hd,
                        rot, theta, 1e-6f, one_plus),
           "cuda qk_prep");
    char name[128];
    snprintf(name, sizeof name, "qk_prep q T=%ld seqs=%d nq=%d hd=%d rot=%d gated=%d inplace=%d pos+%d", T,
             n_seq, nq, hd, rot, gated, in_place, pos_base);
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
    float   *buf = NULL;
    int32_t *p = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&buf, 8192 * 4), "alloc"));
    TST_CHECK(tst_ok(gpu->alloc(gctx, (void **)&p, 64), "alloc"));
    expect(
        gpu->qk_prep(gctx, buf + 4096, NULL, buf + 6144, buf, buf, buf, p, 1, 1, 1, 1030, 8, 1e4f, 1e-6f, 1),
        CM_ERR_UNSUPPORTED, "qk_prep hd=1030");
    expect(gpu->qk_prep(gctx, buf + 64, buf + 2048, buf + 4096, buf, buf + 6144, buf + 6144, p, 4, 2, 1, 8, 8,
                        1e4f, 1e-6f, 1),
           CM_ERR_INVALID_ARG, "qk_prep gated q overlaps qg");
    expect(gpu->qk_prep(gctx, buf, NULL, buf + 4096, buf, buf + 6144, buf + 6144, p, 4, 2, 1, 8, 7, 1e4f,
                        1e-6f, 1),
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

    test_rope();
    test_attention();
    test_conv1d();
    test_gdn_gate();
    test_gdn();
    test_gdn_conv();
    test_qk_prep();

    tst_pair_close();
    TST_CHECK(gctx == NULL && gctx16 == NULL);
    return tst_report();
}
