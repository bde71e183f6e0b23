/* tests/test_kn_cuda_attn_io.c — the DFlash attention on BF16 storage (kn_dflash_attn_params.io_dt),
 * on every implementation: the cpu reference; on cuda the fp32 kernels (F32 GEMM mode), the bf16
 * tensor-core kernels (BF16 mode), the wgmma ones where asked for (TANDEM_DFLASH_KERNEL=wgmma), and
 * the fp32 fallback for a shape the tensor-core kernels do not take. On each, bf16 q, k and v give
 * the bits of the F32 op on their widened values: out that op's out rounded once to nearest even,
 * lse the same, and the backward (which on cuda reads out) the bits of the F32 backward handed
 * that rounded out. K and V are tried as one joint array of T + R rows (what the tensor-core
 * kernels read in place) and as two separate arrays (which they copy), q 16-byte aligned and not.
 * A dtype other than F32 and BF16 is refused. Label gpu: exits 77 without a cuda backend or
 * device. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"
#include "tst_kn_pair.h"

static kn_ctx *gctx_wgmma; /* BF16 mode with TANDEM_DFLASH_KERNEL=wgmma, or NULL */

typedef struct io_case {
    const char *what;
    int         n_docs;
    int         lens[4];
    int         n_blocks, B, nq, nkv, hd, window, causal;
} io_case;

/* n bytes on backend be (a copy of host, or zeros); exits 1 on failure. */
static void *put(const kn_backend *be, kn_ctx *c, const void *host, size_t n) {
    void *d = NULL, *z = host ? NULL : tst_xcalloc(n);
    if (be->alloc(c, &d, n) != CM_OK || be->upload(c, d, host ? host : z, n) != CM_OK) {
        fprintf(stderr, "alloc or upload of %zu bytes failed: %s\n", n, cm_last_error());
        exit(1);
    }
    free(z);
    return d;
}

static void *get(const kn_backend *be, kn_ctx *c, const void *d, size_t n) {
    void *h = tst_xcalloc(n);
    if (be->sync(c) != CM_OK || be->download(c, h, d, n) != CM_OK) {
        fprintf(stderr, "download of %zu bytes failed: %s\n", n, cm_last_error());
        exit(1);
    }
    return h;
}

/* The host inputs of one case: the bf16 roundings of q, k and v (ctx rows, block rows), dout. */
typedef struct io_inputs {
    long      T, R, nq_el, ctx_el, blk_el;
    int32_t  *anchors, *ctx_lo;
    uint16_t *q, *kc, *vc, *kb, *vb;
    float    *dout;
} io_inputs;

static io_inputs make_inputs(const io_case *ic) {
    io_inputs in = {0};
    int32_t   starts[4];
    for (int i = 0; i < ic->n_docs; i++) {
        starts[i] = (int32_t)in.T;
        in.T += ic->lens[i];
    }
    const long nb = ic->n_blocks;
    in.R = nb * ic->B;
    in.nq_el = in.R * ic->nq * ic->hd;
    in.ctx_el = in.T * ic->nkv * ic->hd;
    in.blk_el = in.R * ic->nkv * ic->hd;
    in.anchors = tst_xcalloc((size_t)nb * 4);
    in.ctx_lo = tst_xcalloc((size_t)nb * 4);
    for (long j = 0; j < nb; j++) { /* document starts and ends first, then random */
        const int d = (int)(j % ic->n_docs), len = ic->lens[d];
        const int off = j < ic->n_docs ? 0 : j < 2 * ic->n_docs ? len - 1 : (int)(tst_urand() * len);
        in.anchors[j] = starts[d] + off;
        in.ctx_lo[j] = starts[d];
    }
    float     *x[5] = {tst_rand_f32(in.nq_el, -2, 2), tst_rand_f32(in.ctx_el, -1, 1),
                       tst_rand_f32(in.ctx_el, -1, 1), tst_rand_f32(in.blk_el, -1, 1),
                       tst_rand_f32(in.blk_el, -1, 1)};
    const long n[5] = {in.nq_el, in.ctx_el, in.ctx_el, in.blk_el, in.blk_el};
    uint16_t **b[5] = {&in.q, &in.kc, &in.vc, &in.kb, &in.vb};
    for (int i = 0; i < 5; i++) {
        *b[i] = tst_bf16_round_n(x[i], n[i]);
        free(x[i]);
    }
    in.dout = tst_rand_f32(in.nq_el, -1, 1);
    return in;
}

static void free_inputs(io_inputs *in) {
    free(in->anchors), free(in->ctx_lo), free(in->q), free(in->kc), free(in->vc), free(in->kb), free(in->vb);
    free(in->dout);
}

/* The outputs of one run: out (F32 or BF16 bytes), lse and the five gradients, as downloaded. */
typedef struct io_outputs {
    void  *out;
    float *lse, *g[5];
} io_outputs;

static void free_outputs(io_outputs *o) {
    free(o->out), free(o->lse);
    for (int i = 0; i < 5; i++)
        free(o->g[i]);
}

/* One case on one backend context: the F32 op on the widened inputs (its out rounded and handed
 * back before the backward), then the BF16 op in two layouts; every output compared bit for bit. */
static void run_ctx(const io_case *ic, const io_inputs *in, const kn_backend *be, kn_ctx *c,
                    const char *impl) {
    const long            T = in->T, R = in->R, nq_el = in->nq_el, ctx_el = in->ctx_el, blk_el = in->blk_el;
    const long            n_lse = R * ic->nq, n_g[5] = {nq_el, ctx_el, ctx_el, blk_el, blk_el};
    const size_t          lse_b = (size_t)n_lse * 4;
    kn_dflash_attn_params p = {.T = T,
                               .n_blocks = ic->n_blocks,
                               .B = ic->B,
                               .nq = ic->nq,
                               .nkv = ic->nkv,
                               .hd = ic->hd,
                               .window = ic->window,
                               .causal = ic->causal,
                               .scale = (float)(1.0 / sqrt((double)ic->hd))};
    p.anchors = put(be, c, in->anchors, (size_t)ic->n_blocks * 4);
    p.ctx_lo = put(be, c, in->ctx_lo, (size_t)ic->n_blocks * 4);
    p.dout = put(be, c, in->dout, (size_t)nq_el * 4);
    p.lse = put(be, c, NULL, lse_b);
    float **grads[5] = {&p.dq, &p.dk_ctx, &p.dv_ctx, &p.dk_blk, &p.dv_blk};
    for (int i = 0; i < 5; i++)
        *grads[i] = put(be, c, NULL, (size_t)n_g[i] * 4);

    /* F32 on the widened values */
    const uint16_t *src[5] = {in->q, in->kc, in->vc, in->kb, in->vb};
    const long      n_src[5] = {nq_el, ctx_el, ctx_el, blk_el, blk_el};
    void           *f32_in[5];
    for (int i = 0; i < 5; i++) {
        float *w = tst_bf16_widen_n(src[i], n_src[i]);
        f32_in[i] = put(be, c, w, (size_t)n_src[i] * 4);
        free(w);
    }
    p.io_dt = CM_DTYPE_F32;
    p.q = f32_in[0], p.k_ctx = f32_in[1], p.v_ctx = f32_in[2], p.k_blk = f32_in[3], p.v_blk = f32_in[4];
    p.out = put(be, c, NULL, (size_t)nq_el * 4);
    TST_CHECK(tst_ok(be->dflash_attn_fwd(c, &p), "F32 dflash_attn_fwd"));
    io_outputs ref = {0};
    float     *o32 = get(be, c, p.out, (size_t)nq_el * 4);
    uint16_t  *o16 = tst_bf16_round_n(o32, nq_el);
    float     *o32r = tst_bf16_widen_n(o16, nq_el);
    ref.lse = get(be, c, p.lse, lse_b);
    TST_CHECK(be->upload(c, p.out, o32r, (size_t)nq_el * 4) == CM_OK);
    TST_CHECK(tst_ok(be->dflash_attn_bwd(c, &p), "F32 dflash_attn_bwd"));
    for (int i = 0; i < 5; i++)
        ref.g[i] = get(be, c, *grads[i], (size_t)n_g[i] * 4);
    be->free(c, p.out);
    free(o32), free(o32r);

    /* BF16: layout 0 joint K and V with q aligned; layout 1 separate arrays with q one element off */
    for (int layout = 0; layout < 2; layout++) {
        uint16_t *kj = tst_xcalloc((size_t)(ctx_el + blk_el) * 2),
                 *vj = tst_xcalloc((size_t)(ctx_el + blk_el) * 2);
        memcpy(kj, in->kc, (size_t)ctx_el * 2), memcpy(kj + ctx_el, in->kb, (size_t)blk_el * 2);
        memcpy(vj, in->vc, (size_t)ctx_el * 2), memcpy(vj + ctx_el, in->vb, (size_t)blk_el * 2);
        uint16_t *qh = tst_xcalloc((size_t)(nq_el + 1) * 2);
        memcpy(qh + layout, in->q, (size_t)nq_el * 2);
        void *dq = put(be, c, qh, (size_t)(nq_el + 1) * 2), *dk = NULL, *dv = NULL, *dkb = NULL, *dvb = NULL;
        p.io_dt = CM_DTYPE_BF16;
        p.q = (const uint16_t *)dq + layout;
        if (layout == 0) {
            dk = put(be, c, kj, (size_t)(ctx_el + blk_el) * 2),
            dv = put(be, c, vj, (size_t)(ctx_el + blk_el) * 2);
            p.k_ctx = dk, p.k_blk = (const uint16_t *)dk + ctx_el;
            p.v_ctx = dv, p.v_blk = (const uint16_t *)dv + ctx_el;
        } else {
            dk = put(be, c, in->kc, (size_t)ctx_el * 2), dv = put(be, c, in->vc, (size_t)ctx_el * 2);
            dkb = put(be, c, in->kb, (size_t)blk_el * 2), dvb = put(be, c, in->vb, (size_t)blk_el * 2);
            p.k_ctx = dk, p.v_ctx = dv, p.k_blk = dkb, p.v_blk = dvb;
        }
        p.out = put(be, c, NULL, (size_t)nq_el * 2);
        char what[200];
        snprintf(what, sizeof what, "%s %s W=%d%s %s", impl, ic->what, ic->window,
                 ic->causal ? " causal" : "",
                 layout == 0 ? "joint K/V, q aligned" : "separate K/V, q unaligned");
        TST_CHECK(tst_ok(be->dflash_attn_fwd(c, &p), "BF16 dflash_attn_fwd"));
        TST_CHECK(tst_ok(be->dflash_attn_bwd(c, &p), "BF16 dflash_attn_bwd"));
        io_outputs got = {get(be, c, p.out, (size_t)nq_el * 2), get(be, c, p.lse, lse_b), {0}};
        int same = memcmp(got.out, o16, (size_t)nq_el * 2) == 0 && memcmp(got.lse, ref.lse, lse_b) == 0;
        for (int i = 0; i < 5; i++) {
            got.g[i] = get(be, c, *grads[i], (size_t)n_g[i] * 4);
            same = same && memcmp(got.g[i], ref.g[i], (size_t)n_g[i] * 4) == 0;
        }
        TST_CHECK(same);
        printf("%-96s %s\n", what, same ? "same bits" : "DIFFERS");
        free_outputs(&got);
        be->free(c, dq), be->free(c, dk), be->free(c, dv), be->free(c, p.out);
        if (dkb)
            be->free(c, dkb), be->free(c, dvb);
        free(kj), free(vj), free(qh);
    }
    free(o16);
    free_outputs(&ref);
    for (int i = 0; i < 5; i++)
        be->free(c, f32_in[i]), be->free(c, *grads[i]);
    be->free(c, (void *)p.anchors), be->free(c, (void *)p.ctx_lo), be->free(c, (void *)p.dout),
        be->free(c, p.lse);
}

static void test_cases(void) {
    static const io_case cases[] = {
        {"docs 1/63/65/74 hd64", 4, {1, 63, 65, 74}, 13, 16, 4, 2, 64, 5, 0},
        {"gqa4 hd128", 2, {700, 301}, 24, 16, 8, 2, 128, 64, 1},
        {"gqa4 hd128 full", 2, {300, 137}, 12, 16, 8, 2, 128, 0, 0},
        {"B20 hd64", 3, {1, 90, 77}, 6, 20, 2, 2, 64, 30, 0},
        {"odd hd33 B7 (fp32 fallback)", 3, {65, 63, 1}, 7, 7, 2, 1, 33, 3, 1},
    };
    tst_gpu_ctx_env(&gctx_wgmma, "TANDEM_DFLASH_KERNEL", "wgmma");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const io_case *ic = &cases[i];
        io_inputs      in = make_inputs(ic);
        run_ctx(ic, &in, cpu, cctx, "cpu");
        run_ctx(ic, &in, gpu, gctx, "cuda F32 mode");
        run_ctx(ic, &in, gpu, gctx16, "cuda BF16 mode");
        if (gctx_wgmma && (ic->hd == 64 || ic->hd == 128))
            run_ctx(ic, &in, gpu, gctx_wgmma, "cuda wgmma");
        free_inputs(&in);
    }
    gpu->ctx_destroy(&gctx_wgmma);
}

static void test_bad_dtype(void) {
    static const char *const words[] = {"I32", "not supported", NULL};
    float                   *buf = NULL;
    TST_CHECK(tst_ok(gpu->alloc(gctx16, (void **)&buf, 4096), "alloc"));
    float cbuf[1024] = {0};
    for (int side = 0; side < 2; side++) {
        float                *b = side ? buf : cbuf;
        kn_dflash_attn_params p = {.T = 4, .n_blocks = 1, .B = 2, .nq = 1, .nkv = 1, .hd = 4, .scale = 0.5f};
        int32_t               idx[2] = {2, 0};
        p.anchors = side ? (int32_t *)buf : idx;
        p.ctx_lo = side ? (int32_t *)buf + 1 : idx + 1;
        p.io_dt = CM_DTYPE_I32;
        p.q = p.k_ctx = p.v_ctx = p.k_blk = p.v_blk = b;
        p.out = p.lse = b;
        TST_CHECK(tst_fails_with(side ? gpu->dflash_attn_fwd(gctx16, &p) : cpu->dflash_attn_fwd(cctx, &p),
                                 CM_ERR_INVALID_ARG, words));
    }
    gpu->free(gctx16, buf);
    printf("%-96s refused\n", "q, k, v and out in I32 (cpu and cuda)");
}

int main(void) {
    if (!tst_pair_open())
        return tst_report();
    test_cases();
    test_bad_dtype();
    tst_pair_close();
    return tst_report();
}
