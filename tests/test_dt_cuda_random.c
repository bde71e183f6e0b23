/* tests/test_dt_cuda_random.c — the drafter step on the cpu against cuda on a random drafter larger
 * than the oracle's (hidden 256, 3 layers sliding/full/sliding, 8/2 heads × 64, vocab 4099, block 16,
 * T = 1500 in 5 documents of 1..700 tokens, 64 anchors at document starts, ends and between), as
 * DFlash and as DFlash2 (convolutions Kc 2 / G 16, selector rank 32, top-16), through the dt_model API:
 * cuda in the F32 GEMM mode (as grad runs it) within 1e-4 of the cpu's loss and 1e-3 relative L2 of
 * every gradient (both fp32 with the same op order; cuda sums in fp32 where the cpu sums in double),
 * a repeated cuda step bit-identical, the accuracy counts (and DFlash2's candidate sets and choices)
 * equal; the BF16 GEMM mode's distance from the cpu is printed for information (loss within 3e-2);
 * and in the BF16 mode three steps with AdamW writing the bf16 weight copies bit-identical to three
 * without.
 * Label gpu; exits 77 without a cuda build or device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dt_model.h"
#include "dt_optim.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_dt.h"
#include "tst_kn.h"

typedef struct big_run {
    dt_step_stats s;
    float        *g;
    int64_t       n_g;
} big_run;

static int big_step(const cm_drafter_cfg *cfg, const kn_backend *be, kn_gemm_mode mode, const dt_batch *b,
                    const float *embed, const uint16_t *head, int repeat, big_run *out, int *same_bits) {
    kn_ctx       *ctx = NULL;
    dt_model     *m = NULL;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.gemm_mode = mode;
    int ok = be->ctx_create(&ctx, &kc) == CM_OK && dt_model_create(&m, cfg, be, ctx) == CM_OK &&
             dt_model_init_random(m, 20261130) == CM_OK &&
             dt_model_set_frozen(m, embed, CM_DTYPE_F32, head, CM_DTYPE_BF16, cfg->vocab_size,
                                 cfg->hidden_size) == CM_OK &&
             dt_model_step(m, b, 7.0f, &out->s) == CM_OK;
    if (ok) { /* a second step on grown buffers, timed (information) */
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ok = dt_model_step(m, b, 7.0f, &out->s) == CM_OK;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("%-30s %s %s step: %.1f ms, activations %s, %.1f MB\n",
               cfg->kind == CM_DRAFTER_DFLASH2 ? "random T=1500 DFlash2" : "random T=1500", be->name,
               mode == KN_GEMM_MODE_BF16 ? "BF16" : "F32",
               1e3 * ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec)),
               cm_dtype_name(dt_model_act_dtype(m)), (double)dt_model_act_bytes(m) / 1e6);
        /* cuda stores BF16 exactly when its GEMMs round their inputs */
        TST_CHECK(dt_model_act_dtype(m) ==
                  (be != kn_backend_cpu() && mode == KN_GEMM_MODE_BF16 ? CM_DTYPE_BF16 : CM_DTYPE_F32));
    }
    if (!ok)
        fprintf(stderr, "%s step failed: %s\n", be->name, cm_last_error());
    TST_CHECK(ok);
    if (ok) {
        out->g = tst_dt_grads(m, be, ctx, &out->n_g);
        if (repeat) {
            dt_step_stats s2;
            TST_CHECK(dt_model_step(m, b, 7.0f, &s2) == CM_OK);
            int64_t n2;
            float  *g2 = tst_dt_grads(m, be, ctx, &n2);
            *same_bits = n2 == out->n_g && memcmp(g2, out->g, (size_t)n2 * sizeof *g2) == 0 &&
                         memcmp(&s2, &out->s, sizeof s2) == 0;
            free(g2);
        }
    }
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
    return ok;
}

/* Three training steps (dt_model_step, then AdamW) on cuda in the BF16 GEMM mode, with the update
 * writing the next step's bf16 weight copies (dt_optim_copies_of_model) or not: the losses and the
 * final parameters bit for bit the same, since a written copy is the rounding the forward would make.
 * Then new random weights and one more step: the same loss both ways (the copies of the old weights,
 * written by the last update, are forgotten). */
static void optim_copies_check(const char *tag, const cm_drafter_cfg *cfg, const dt_batch *b,
                               const float *embed, const uint16_t *head) {
    const kn_backend *be = kn_backend_cuda();
    float            *vals[2] = {NULL, NULL};
    double            loss[2][3] = {{0}}, reinit[2] = {0, 0};
    int64_t           n[2] = {0, 0};
    int               n_copies = 0, written = 0;
    for (int k = 0; k < 2; k++) {
        kn_ctx       *ctx = NULL;
        dt_model     *m = NULL;
        dt_optim     *o = NULL;
        kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
        kc.gemm_mode = KN_GEMM_MODE_BF16;
        dt_optim_config oc = DT_OPTIM_CONFIG_DEFAULT;
        oc.total_steps = 10;
        int ok = be->ctx_create(&ctx, &kc) == CM_OK && dt_model_create(&m, cfg, be, ctx) == CM_OK &&
                 dt_model_init_random(m, 20261206) == CM_OK &&
                 dt_model_set_frozen(m, embed, CM_DTYPE_F32, head, CM_DTYPE_BF16, cfg->vocab_size,
                                     cfg->hidden_size) == CM_OK;
        const dt_param **pp = ok ? malloc((size_t)dt_model_n_params(m) * sizeof *pp) : NULL;
        for (int i = 0; pp && i < dt_model_n_params(m); i++)
            pp[i] = dt_model_param(m, i);
        ok = ok && pp && dt_optim_create(&o, be, ctx, pp, dt_model_n_params(m), &oc) == CM_OK;
        if (ok && k == 0) {
            uint16_t **dst = calloc((size_t)dt_model_n_params(m), sizeof *dst);
            int       *grp = calloc((size_t)dt_model_n_params(m), sizeof *grp);
            n_copies = dst && grp ? dt_model_w16_targets(m, dst, grp) : 0;
            free(dst), free(grp);
            ok = dt_optim_copies_of_model(o, m) == CM_OK;
        }
        for (int s = 0; ok && s < 3; s++) {
            dt_step_stats  ss;
            dt_optim_stats os;
            memset(&os, 0, sizeof os);
            ok = dt_model_step(m, b, 7.0f, &ss) == CM_OK && dt_optim_step(o, &os) == CM_OK;
            loss[k][s] = ss.loss;
            if (ok && os.copies) {
                dt_model_w16_written(m);
                written++;
            }
        }
        if (!ok)
            fprintf(stderr, "%s: training steps failed: %s\n", tag, cm_last_error());
        TST_CHECK(ok);
        if (ok)
            vals[k] = tst_dt_download(m, be, ctx, &n[k], 1);
        /* new weights after the update wrote its copies: the next step must not read those */
        dt_step_stats sr;
        ok = ok && dt_model_init_random(m, 7) == CM_OK && dt_model_step(m, b, 7.0f, &sr) == CM_OK;
        TST_CHECK(ok);
        reinit[k] = ok ? sr.loss : -1.0;
        free(pp);
        dt_optim_destroy(&o);
        dt_model_destroy(&m);
        be->ctx_destroy(&ctx);
    }
    const int same = vals[0] && vals[1] && n[0] == n[1] &&
                     memcmp(vals[0], vals[1], (size_t)n[0] * sizeof *vals[0]) == 0 &&
                     memcmp(loss[0], loss[1], sizeof loss[0]) == 0;
    TST_CHECK(n_copies > 0 && written == 3 && same);
    TST_CHECK(reinit[0] == reinit[1] && reinit[0] > 0);
    printf("%-30s 3 steps with %d bf16 weight copies written by AdamW: losses %.6f %.6f %.6f, parameters %s "
           "the steps without; after dt_model_init_random, loss %.6f against %.6f without copies\n",
           tag, n_copies, loss[0][0], loss[0][1], loss[0][2], same ? "bit-identical to" : "DIFFER from",
           reinit[0], reinit[1]);
    free(vals[0]);
    free(vals[1]);
}

/* Worst relative L2 over the parameters of got against ref; prints it. */
static double big_compare(const char *what, const cm_drafter_cfg *cfg, const big_run *ref, const big_run *got,
                          double loss_tol, double grad_tol, int check) {
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL; /* only for the parameter table */
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK && dt_model_create(&m, cfg, be, ctx) == CM_OK);
    double      worst = 0, loss_err = fabs(got->s.loss - ref->s.loss) / fabs(ref->s.loss);
    const char *worst_name = "";
    int64_t     off = 0;
    for (int i = 0; m && i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        double         *r = malloc((size_t)p->numel * sizeof *r);
        for (int64_t e = 0; e < p->numel; e++)
            r[e] = ref->g[off + e];
        double err = tst_rel_l2(got->g + off, r, (long)p->numel);
        free(r);
        if (check) {
            TST_CHECK(err <= grad_tol);
            if (!(err <= grad_tol))
                fprintf(stderr, "%s: %s relative L2 %.3e > %.0e\n", what, p->name, err, grad_tol);
        }
        if (!(err <= worst)) {
            worst = err;
            worst_name = p->name;
        }
        off += p->numel;
    }
    if (check) {
        TST_CHECK(loss_err <= loss_tol);
        TST_CHECK(got->n_g == ref->n_g);
    }
    printf("%-30s loss %.9f vs cpu %.9f (rel err %.1e)  tau %.4f vs %.4f  worst grad rel L2 %.2e (%s)%s\n",
           what, got->s.loss, ref->s.loss, loss_err, got->s.tau, ref->s.tau, worst, worst_name,
           check ? "" : "  [information]");
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
    return worst;
}

/* v2: the same drafter as DFlash2 (convolutions Kc 2 over groups of 16, selector rank 32, top-16; the
 * convolutions at their identity init, their gradients and the selector's are compared all the same). */
static void check_large_random(int v2) {
    cm_drafter_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    if (v2) {
        cfg.kind = CM_DRAFTER_DFLASH2;
        cfg.conv_kernel_size = 2, cfg.conv_group_size = 16, cfg.selector_rank = 32, cfg.selector_top_k = 16;
    }
    const char *tag = v2 ? "random T=1500 DFlash2" : "random T=1500";
    char        what[96];
    cfg.hidden_size = 256;
    cfg.n_layers = 3;
    cfg.intermediate_size = 704;
    cfg.vocab_size = 4099;
    cfg.n_heads = 8;
    cfg.n_kv_heads = 2;
    cfg.head_dim = 64;
    cfg.rms_norm_eps = 1e-6f;
    cfg.rope_theta = 1e7;
    cfg.max_position_embeddings = 32768;
    cfg.layer_types[0] = CM_LAYER_TYPE_SLIDING_ATTENTION;
    cfg.layer_types[1] = CM_LAYER_TYPE_FULL_ATTENTION;
    cfg.layer_types[2] = CM_LAYER_TYPE_SLIDING_ATTENTION;
    cfg.sliding_window = 200;
    cfg.block_size = 16;
    cfg.mask_token_id = 4098;
    cfg.num_target_layers = 12;
    cfg.n_taps = 3;
    cfg.target_layer_ids[0] = 1;
    cfg.target_layer_ids[1] = 5;
    cfg.target_layer_ids[2] = 9;

    static const int lens[5] = {1, 63, 65, 700, 671};
    int32_t          cu[6] = {0};
    for (int i = 0; i < 5; i++)
        cu[i + 1] = cu[i] + lens[i];
    const int64_t T = cu[5], D = cfg.hidden_size, V = cfg.vocab_size, W = (int64_t)cfg.n_taps * D;
    uint64_t      rs = 0x1234567887654321ull;
#define BIG_RAND() (rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17, (double)(rs >> 11) / 9007199254740992.0)
    int32_t  *ids = malloc((size_t)T * sizeof *ids), *mask = malloc((size_t)T * sizeof *mask);
    float    *F = malloc((size_t)(T * W) * sizeof *F), *embed = malloc((size_t)(V * D) * sizeof *embed);
    uint16_t *head = malloc((size_t)(V * D) * sizeof *head);
    for (int64_t t = 0; t < T; t++) {
        ids[t] = (int32_t)(BIG_RAND() * (double)(V - 1));
        mask[t] = BIG_RAND() < 0.85;
    }
    for (int64_t i = 0; i < T * W; i++)
        F[i] = (float)(2.0 * BIG_RAND() - 1.0);
    for (int64_t i = 0; i < V * D; i++) {
        embed[i] = (float)(0.1 * (2.0 * BIG_RAND() - 1.0));
        float    f = (float)(0.2 * (2.0 * BIG_RAND() - 1.0));
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        head[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    /* 64 sorted anchors: every document's start and last token, the rest spread at random */
    int32_t anchors[64];
    int     na = 0;
    for (int i = 0; i < 5; i++) {
        anchors[na++] = cu[i];
        if (lens[i] > 1)
            anchors[na++] = cu[i + 1] - 1;
    }
    while (na < 64)
        anchors[na++] = (int32_t)(BIG_RAND() * (double)T);
#undef BIG_RAND
    for (int i = 0; i < na; i++)
        for (int j = i + 1; j < na; j++)
            if (anchors[j] < anchors[i]) {
                int32_t t = anchors[i];
                anchors[i] = anchors[j];
                anchors[j] = t;
            }
    const dt_batch b = {.T = T,
                        .n_seq = 5,
                        .cu_seqlens = cu,
                        .input_ids = ids,
                        .loss_mask = mask,
                        .target_hidden = F,
                        .n_anchors = na,
                        .anchors = anchors};
    big_run        r_cpu = {0}, r_f32 = {0}, r_bf16 = {0};
    int            same = 0, unused = 0;
    if (big_step(&cfg, kn_backend_cpu(), KN_GEMM_MODE_F32, &b, embed, head, 0, &r_cpu, &unused) &&
        big_step(&cfg, kn_backend_cuda(), KN_GEMM_MODE_F32, &b, embed, head, 1, &r_f32, &same)) {
        TST_CHECK(r_cpu.s.weight_sum > 0 && r_cpu.s.n_blocks == 64);
        snprintf(what, sizeof what, "%s cuda F32", tag);
        big_compare(what, &cfg, &r_cpu, &r_f32, 1e-4, 1e-3, 1);
        TST_CHECK(same);
        printf("%-30s repeated cuda step: %s\n", what, same ? "bit-identical" : "DIFFERS");
        TST_CHECK(memcmp(r_cpu.s.acc_count, r_f32.s.acc_count, sizeof r_cpu.s.acc_count) == 0);
        /* BF16 GEMMs and BF16 saved activations: the loss within the bf16 training bar (3e-2,
         * as test_dt_cuda_train's), every gradient finite and within 100 % (the figures are
         * printed: information on how far bf16 moves them) */
        snprintf(what, sizeof what, "%s cuda BF16", tag);
        if (big_step(&cfg, kn_backend_cuda(), KN_GEMM_MODE_BF16, &b, embed, head, 0, &r_bf16, &unused))
            big_compare(what, &cfg, &r_cpu, &r_bf16, 3e-2, 1.0, 1);
        optim_copies_check(what, &cfg, &b, embed, head);
        if (v2) /* the selector's figures: the same candidate sets and choices as the cpu's */
            TST_CHECK(memcmp(r_cpu.s.sel_in_topk, r_f32.s.sel_in_topk, sizeof r_cpu.s.sel_in_topk) == 0 &&
                      memcmp(r_cpu.s.sel_hits, r_f32.s.sel_hits, sizeof r_cpu.s.sel_hits) == 0);
    }
    free(r_cpu.g);
    free(r_f32.g);
    free(r_bf16.g);
    free(ids);
    free(mask);
    free(F);
    free(embed);
    free(head);
}

int main(void) {
    tst_need_cuda();
    check_large_random(0);
    check_large_random(1);
    return tst_report();
}
