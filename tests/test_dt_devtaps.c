/* tests/test_dt_devtaps.c — dt_model_step with the batch's taps already in backend memory
 * (dt_batch.dev_taps, the NCCL data path) or as per-tap host arrays (dt_batch.host_taps, the
 * ZeroMQ data path) against the same step with target_hidden on the host, on a drafter fixture
 * of tests/fixtures/drafter (its weights, batch, embedding and LM head): F32 taps give
 * bit-identical loss and gradients; BF16 taps give bit-identical results to host target_hidden
 * holding the same BF16 values widened. Also the refusals: a missing tap (device or host), a
 * dtype other than BF16/F32; and dt_model_grad_slab spans every gradient. The gradient
 * hook data parallelism reduces buckets from (dt_model_set_grad_hook) is called at
 * dt_model_grad_buckets' offsets in order, and what it sees from each offset to the slab's end
 * (downloaded in the call, after everything enqueued before it) is the step's final gradient,
 * bit for bit; a failing hook fails the step. Without NCCL in the build, dt_dp_create refuses
 * with CM_ERR_UNSUPPORTED.
 *   test_dt_devtaps cpu   (unit; on the cpu backend "backend memory" is host memory)
 *   test_dt_devtaps cuda  (gpu; exits 77 without a cuda build or device) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_safetensors.h"
#include "dt_dp.h"
#include "dt_model.h"
#include "kn_backend.h"
#include "tst.h"

#define FIXTURE TANDEM_TEST_DATA "/fixtures/drafter/b16_sw7_full_sw7_gqa2_long"

static int32_t *i32(const cm_st *st, const char *name, int64_t *n) {
    const cm_st_tensor *t = cm_st_find(st, name);
    if (!t || t->dtype != CM_DTYPE_I32)
        return NULL;
    *n = t->shape[0];
    int32_t *v = malloc((size_t)*n * sizeof *v + 4);
    memcpy(v, t->data, (size_t)*n * sizeof *v);
    return v;
}

/* Loss and every gradient of one step, gradients concatenated into *g (malloc'd). */
static int step(dt_model *m, const kn_backend *be, kn_ctx *ctx, const dt_batch *b, double *loss, float **g,
                int64_t *n) {
    dt_step_stats s;
    if (dt_model_step(m, b, 7.0f, &s) != CM_OK) {
        fprintf(stderr, "step: %s\n", cm_last_error());
        return 0;
    }
    *loss = s.loss;
    *n = 0;
    for (int i = 0; i < dt_model_n_params(m); i++)
        *n += dt_model_param(m, i)->numel;
    *g = malloc((size_t)*n * sizeof **g);
    int64_t off = 0;
    for (int i = 0; i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        if (be->download(ctx, *g + off, p->grad, (size_t)p->numel * sizeof(float)) != CM_OK)
            return 0;
        off += p->numel;
    }
    return 1;
}

static int same(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, (size_t)n * sizeof *a) == 0;
}

/* A gradient hook that records each offset and a copy of the slab from it to the end. */
#define HOOK_MAX 64
typedef struct hook_rec {
    const kn_backend *be;
    kn_ctx           *ctx;
    const float      *slab;
    size_t            n;
    int               calls, fail_at;
    size_t            off[HOOK_MAX];
    float            *snap[HOOK_MAX];
} hook_rec;

static cm_status rec_hook(void *user, size_t off, double weight_sum) {
    hook_rec *h = user;
    if (h->calls == h->fail_at)
        return CM_FAIL(CM_ERR_NCCL, "hook refused at offset %zu (weight %g)", off, weight_sum);
    if (h->calls >= HOOK_MAX || off > h->n)
        return CM_FAIL(CM_ERR_INVALID_ARG, "hook: call %d at offset %zu of %zu", h->calls, off, h->n);
    h->off[h->calls] = off;
    h->snap[h->calls] = malloc((h->n - off) * sizeof(float) + 4);
    CM_TRY(h->be->download(h->ctx, h->snap[h->calls], h->slab + off, (h->n - off) * sizeof(float)));
    h->calls++;
    return CM_OK;
}

int main(int argc, char **argv) {
    const char       *device = argc > 1 ? argv[1] : "cpu";
    const kn_backend *be = strcmp(device, "cuda") == 0 ? kn_backend_cuda() : kn_backend_cpu();
    if (!be)
        TST_SKIP("this build has no cuda backend");
    kn_ctx       *ctx = NULL;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.gemm_mode = KN_GEMM_MODE_F32;
    if (be->ctx_create(&ctx, &kc) != CM_OK)
        TST_SKIP("no usable %s device: %s", device, cm_last_error());

    cm_drafter_cfg cfg;
    dt_model      *m = NULL;
    cm_st         *st = NULL;
    TST_CHECK(cm_drafter_cfg_load(&cfg, FIXTURE "/drafter") == CM_OK);
    TST_CHECK(dt_model_create(&m, &cfg, be, ctx) == CM_OK);
    TST_CHECK(m && dt_model_load(m, FIXTURE "/drafter") == CM_OK);
    TST_CHECK(cm_st_open_file(&st, FIXTURE "/batch.safetensors") == CM_OK);
    if (!m || !st)
        return tst_report();
    const cm_st_tensor *e = cm_st_find(st, "embed_tokens"), *h = cm_st_find(st, "lm_head"),
                       *th = cm_st_find(st, "target_hidden");
    TST_CHECK(e && h && th);
    if (!e || !h || !th)
        return tst_report();
    TST_CHECK(dt_model_set_frozen(m, e->data, e->dtype, h->data, h->dtype, e->shape[0], e->shape[1]) ==
              CM_OK);

    int64_t  T, n_cu, n_mask, n_anchors;
    int32_t *ids = i32(st, "input_ids", &T), *cu = i32(st, "cu_seqlens", &n_cu),
            *mask = i32(st, "loss_mask", &n_mask), *anchors = i32(st, "anchors", &n_anchors);
    const int64_t D = cfg.hidden_size, W = (int64_t)cfg.n_taps * D;
    TST_CHECK(ids && cu && mask && anchors && th->shape[0] == T && th->shape[1] == W);
    float    *F = malloc((size_t)(T * W) * sizeof *F), *Fw = malloc((size_t)(T * W) * sizeof *Fw);
    uint16_t *F16 = malloc((size_t)(T * W) * sizeof *F16);
    TST_CHECK(cm_st_read(st, "target_hidden", 2, th->shape, F, CM_DTYPE_F32) == CM_OK);
    /* the same values as BF16, and widened back: what a BF16 tap holds */
    cm_convert(F16, CM_DTYPE_BF16, F, CM_DTYPE_F32, (size_t)(T * W));
    cm_convert(Fw, CM_DTYPE_F32, F16, CM_DTYPE_BF16, (size_t)(T * W));

    /* per-tap [T, D] arrays in host memory (as a server's answer holds them) and in backend
     * memory, F32 and BF16 */
    void     *tap32[DT_MAX_TAPS] = {0}, *tap16[DT_MAX_TAPS] = {0};
    float    *col[DT_MAX_TAPS] = {0};
    uint16_t *col16[DT_MAX_TAPS] = {0};
    for (int k = 0; k < cfg.n_taps; k++) {
        col[k] = malloc((size_t)(T * D) * sizeof(float));
        col16[k] = malloc((size_t)(T * D) * sizeof(uint16_t));
        TST_CHECK(col[k] && col16[k]);
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < D; c++) {
                col[k][t * D + c] = F[t * W + k * D + c];
                col16[k][t * D + c] = F16[t * W + k * D + c];
            }
        TST_CHECK(be->alloc(ctx, &tap32[k], (size_t)(T * D) * sizeof(float)) == CM_OK);
        TST_CHECK(be->alloc(ctx, &tap16[k], (size_t)(T * D) * sizeof(uint16_t)) == CM_OK);
        TST_CHECK(be->upload(ctx, tap32[k], col[k], (size_t)(T * D) * sizeof(float)) == CM_OK);
        TST_CHECK(be->upload(ctx, tap16[k], col16[k], (size_t)(T * D) * sizeof(uint16_t)) == CM_OK);
    }

    dt_batch host = {.T = T,
                     .n_seq = (int)(n_cu - 1),
                     .cu_seqlens = cu,
                     .input_ids = ids,
                     .loss_mask = mask,
                     .target_hidden = F,
                     .n_anchors = n_anchors,
                     .anchors = anchors};
    dt_batch dev32 = host, dev16 = host, hostw = host, ht32 = host, ht16 = host;
    dev32.target_hidden = dev16.target_hidden = ht32.target_hidden = ht16.target_hidden = NULL;
    hostw.target_hidden = Fw;
    dev32.taps_dt = ht32.taps_dt = CM_DTYPE_F32;
    dev16.taps_dt = ht16.taps_dt = CM_DTYPE_BF16;
    for (int k = 0; k < cfg.n_taps; k++) {
        dev32.dev_taps[k] = tap32[k];
        dev16.dev_taps[k] = tap16[k];
        ht32.host_taps[k] = col[k];
        ht16.host_taps[k] = col16[k];
    }
    double  l_host, l_dev32, l_hostw, l_dev16, l_ht32, l_ht16;
    float  *g_host = NULL, *g_dev32 = NULL, *g_hostw = NULL, *g_dev16 = NULL, *g_ht32 = NULL, *g_ht16 = NULL;
    int64_t n = 0;
    TST_CHECK(step(m, be, ctx, &host, &l_host, &g_host, &n));
    TST_CHECK(step(m, be, ctx, &dev32, &l_dev32, &g_dev32, &n));
    TST_CHECK(step(m, be, ctx, &hostw, &l_hostw, &g_hostw, &n));
    TST_CHECK(step(m, be, ctx, &dev16, &l_dev16, &g_dev16, &n));
    TST_CHECK(step(m, be, ctx, &ht32, &l_ht32, &g_ht32, &n));
    TST_CHECK(step(m, be, ctx, &ht16, &l_ht16, &g_ht16, &n));
    if (g_host && g_dev32 && g_hostw && g_dev16 && g_ht32 && g_ht16) {
        fprintf(stderr,
                "%s: loss host F32 %.9g, device F32 taps %.9g, host F32 taps %.9g; host BF16-valued %.9g, device "
                "BF16 taps %.9g, host BF16 taps %.9g\n",
                device, l_host, l_dev32, l_ht32, l_hostw, l_dev16, l_ht16);
        TST_CHECK(l_host == l_dev32 && same(g_host, g_dev32, n));
        TST_CHECK(l_host == l_ht32 && same(g_host, g_ht32, n));
        TST_CHECK(l_hostw == l_dev16 && same(g_hostw, g_dev16, n));
        TST_CHECK(l_hostw == l_ht16 && same(g_hostw, g_ht16, n));
        TST_CHECK(l_host != l_hostw); /* the BF16 rounding is visible: the comparison can fail */
    }
    /* BF16 activation storage: host features are kept as BF16 copies (F32 ones rounded as they
     * land), BF16 host taps are copied as they are: every form gives the same step */
    if (dt_model_set_act_dtype(m, CM_DTYPE_BF16) == CM_OK) {
        double l_b[5];
        float *g_b[5] = {0};
        const dt_batch *forms[5] = {&host, &hostw, &ht32, &ht16, &dev16};
        for (int i = 0; i < 5; i++)
            TST_CHECK(step(m, be, ctx, forms[i], &l_b[i], &g_b[i], &n));
        fprintf(stderr, "%s, bf16 storage: loss host F32 %.9g, host BF16-valued %.9g, host F32 taps %.9g, host "
                        "BF16 taps %.9g, device BF16 taps %.9g\n", device, l_b[0], l_b[1], l_b[2], l_b[3], l_b[4]);
        for (int i = 1; i < 5; i++)
            TST_CHECK(g_b[0] && g_b[i] && l_b[i] == l_b[0] && same(g_b[0], g_b[i], n));
        for (int i = 0; i < 5; i++)
            free(g_b[i]);
        TST_CHECK(dt_model_set_act_dtype(m, CM_DTYPE_F32) == CM_OK);
    } else {
        TST_CHECK(!"dt_model_set_act_dtype BF16");
    }

    /* refusals */
    dt_batch bad = dev32;
    bad.dev_taps[cfg.n_taps - 1] = NULL;
    TST_CHECK(dt_model_step(m, &bad, 7.0f, NULL) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "no target_hidden and no device tap") != NULL);
    bad = ht16;
    bad.host_taps[cfg.n_taps - 1] = NULL;
    TST_CHECK(dt_model_step(m, &bad, 7.0f, NULL) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "no target_hidden and no host tap") != NULL);
    bad = dev32;
    bad.taps_dt = CM_DTYPE_I32;
    TST_CHECK(dt_model_step(m, &bad, 7.0f, NULL) == CM_ERR_UNSUPPORTED);

    /* the gradient slab spans every parameter's gradient */
    float *slab;
    size_t n_slab;
    dt_model_grad_slab(m, &slab, &n_slab);
    const dt_param *last = dt_model_param(m, dt_model_n_params(m) - 1);
    TST_CHECK(slab == dt_model_param(m, 0)->grad && last->grad + last->numel <= slab + n_slab);
    TST_CHECK((int64_t)n_slab >= n);

    /* the gradient hook: each bucket is final when announced */
    hook_rec hr = {.be = be, .ctx = ctx, .slab = slab, .n = n_slab, .fail_at = -1};
    size_t   want[HOOK_MAX];
    const int n_want = dt_model_grad_buckets(m, want, HOOK_MAX);
    dt_model_set_grad_hook(m, rec_hook, &hr);
    dt_step_stats hs;
    TST_CHECK(dt_model_step(m, &dev16, 7.0f, &hs) == CM_OK);
    float *fin = malloc(n_slab * sizeof *fin);
    TST_CHECK(be->download(ctx, fin, slab, n_slab * sizeof *fin) == CM_OK);
    int in_order = hr.calls == n_want && n_want == cfg.n_layers + 2 && want[n_want - 1] == 0, final = 1;
    for (int c = 0; c < hr.calls; c++) {
        in_order = in_order && hr.off[c] == want[c] && (c == 0 || hr.off[c] < hr.off[c - 1]);
        final = final && memcmp(hr.snap[c], fin + hr.off[c], (n_slab - hr.off[c]) * sizeof *fin) == 0;
    }
    fprintf(stderr, "%s: gradient hook called %d times (buckets %d), in order: %s, each bucket final: %s\n", device,
            hr.calls, n_want, in_order ? "yes" : "no", final ? "yes" : "no");
    TST_CHECK(in_order && final);
    for (int c = 0; c < hr.calls; c++)
        free(hr.snap[c]);
    /* a hook that fails (a collective that did not complete) fails the step with its message */
    hr.calls = 0;
    hr.fail_at = 2;
    TST_CHECK(dt_model_step(m, &dev16, 7.0f, NULL) == CM_ERR_NCCL);
    TST_CHECK(strstr(cm_last_error(), "hook refused") != NULL);
    for (int c = 0; c < hr.calls; c++)
        free(hr.snap[c]);
    dt_model_set_grad_hook(m, NULL, NULL);
    free(fin);

#ifndef TANDEM_HAVE_NCCL
    dt_dp             *dp = NULL;
    const dt_dp_config dc = {.rank = 0, .size = 2, .timeout_ms = 1000};
    TST_CHECK(dt_dp_create(&dp, &dc, be, ctx, m) == CM_ERR_UNSUPPORTED && dp == NULL);
    TST_CHECK(strstr(cm_last_error(), "not in this build") != NULL);
#endif

    for (int k = 0; k < DT_MAX_TAPS; k++) {
        be->free(ctx, tap32[k]);
        be->free(ctx, tap16[k]);
    }
    free(g_host), free(g_dev32), free(g_hostw), free(g_dev16), free(g_ht32), free(g_ht16);
    free(F), free(Fw), free(F16);
    for (int k = 0; k < cfg.n_taps; k++)
        free(col[k]), free(col16[k]);
    free(ids), free(cu), free(mask), free(anchors);
    cm_st_destroy(&st);
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
    return tst_report();
}
