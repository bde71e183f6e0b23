/* tests/test_dt_plan.c — the --dry-run plan (drafter-trainer/cmd/dt_plan.h) against numbers computed
 * by hand in the comments below: a small target and drafter (every count, byte and FLOP of the
 * plan), the drafter parameter count against the parameters dt_model itself allocates, the
 * Qwen3.6-27B target and its DFlash drafter from the config fixtures in tests/data/cm (counts by
 * hand; step FLOPs against the independent estimate of docs/goals.md), the printed table,
 * and the refusals of impossible runs; mixture-of-experts targets: the small target with sparse and
 * dense layers (by hand) and the Qwen3.5-35B-A3B and -122B-A10B deploy configs (counts, weight bytes,
 * prefill FLOPs over the active experts only, and the GPUs the weights need, each computed here
 * tensor by tensor from the configs' numbers). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_model.h"
#include "dt_plan.h"
#include "kn_backend.h"
#include "tst.h"

#define CLOSE(got, want)                                                                                     \
    TST_CHECK(fabs((double)(got) - (double)(want)) <= 1e-9 * fabs((double)(want)) + 1e-12)

/* Target: D 8, 4 layers (GDN, GDN, GDN, full), MLP 16, vocab 32, 2/1 heads x 4 with the
 * output gate, GDN 1 qk head / 2 v heads x 4, conv 4, untied. Drafter: D 8, layer 0 sliding
 * (window 4) + layer 1 full, 2/1 heads x 4, MLP 16, vocab 32, block 4, taps [1, 2]. */
static void small_cfgs(cm_target_cfg *t, cm_drafter_cfg *d) {
    memset(t, 0, sizeof *t);
    t->hidden_size = 8;
    t->n_layers = 4;
    t->intermediate_size = 16;
    t->vocab_size = 32;
    t->rms_norm_eps = 1e-6f;
    for (int l = 0; l < 3; l++)
        t->layer_types[l] = CM_LAYER_TYPE_LINEAR_ATTENTION;
    t->layer_types[3] = CM_LAYER_TYPE_FULL_ATTENTION;
    t->n_heads = 2;
    t->n_kv_heads = 1;
    t->head_dim = 4;
    t->rotary_dim = 4;
    t->rope_theta = 1e4;
    t->attn_output_gate = 1;
    t->lin_n_k_heads = 1;
    t->lin_n_v_heads = 2;
    t->lin_k_head_dim = 4;
    t->lin_v_head_dim = 4;
    t->lin_conv_kernel = 4;

    memset(d, 0, sizeof *d);
    d->hidden_size = 8;
    d->n_layers = 2;
    d->intermediate_size = 16;
    d->vocab_size = 32;
    d->n_heads = 2;
    d->n_kv_heads = 1;
    d->head_dim = 4;
    d->rms_norm_eps = 1e-6f;
    d->rope_theta = 1e4;
    d->max_position_embeddings = 4096;
    d->layer_types[0] = CM_LAYER_TYPE_SLIDING_ATTENTION;
    d->layer_types[1] = CM_LAYER_TYPE_FULL_ATTENTION;
    d->sliding_window = 4;
    d->block_size = 4;
    d->mask_token_id = 31;
    d->num_target_layers = 4;
    d->n_taps = 2;
    d->target_layer_ids[0] = 1;
    d->target_layer_ids[1] = 2;
}

static void test_small(void) {
    cm_target_cfg  t;
    cm_drafter_cfg d;
    small_cfgs(&t, &d);
    /* T 16, A 2 (Q = 8, K = 24), S 8, raw encoding, 2 credits, chunk 4, 1000 tokens per epoch;
     * rates chosen so a step takes 2 s and a target GPU makes 10 tok/s */
    dt_plan_run r = {16, 2, 8, 1, 2, CM_ENCODING_RAW, 0, 5184e-12 * 10, 94016e-12 / 2, 4, 1000};
    dt_plan     p;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);

    /* drafter layer: q 8·8 + k 8·4 + v 8·4 + o 8·8 = 192, MLP 3·8·16 = 384, norms 2·8 + 2·4 = 24
     * → 600; fc 2·8·8 = 128; + hidden_norm, norm 16 → 128 + 16 + 2·600 = 1344 */
    TST_CHECK(p.p_drafter_layer == 600 && p.p_fc == 128 && p.p_drafter == 1344);
    TST_CHECK(p.p_frozen == 2 * 32 * 8);
    /* GDN layer: conv channels 2·1·4 + 2·4 = 16; linear = MLP 384 + qkv 8·16 + z 8·8 + b, a 2·8·2
     * + out 8·8 = 672; other = norms 16 + conv 16·4 + dt_bias, A_log 4 + norm 4 = 88 → 760.
     * Full layer: linear = 384 + q+gate 8·2·4·2 + k, v 2·8·4 + o 8·8 = 640; other 16 + 8 → 664.
     * Target = 3·760 + 664 + embed, lm_head 2·256 + final norm 8 = 3464; the prefill runs layers
     * 0..2 (last tap 2): 3·672 = 2016 linear parameters. */
    TST_CHECK(p.p_target == 3464 && p.p_target_run == 2016 && p.target_layers_run == 3);

    /* memory: P = 1344 → 2P, 4P, 8P, 4P; frozen 2·512. Per layer saved: 2·Q·(2D + 2Hd + 2I) =
     * 2·8·64 = 1024, LSE 4·8·2 = 64, k and v 2·24·2·4 = 384 → 1472; all layers 2·1472 less layer
     * 0's input 2·8·8, + context 2·2·16·8 = 3328; shared: 3·4·8·8 + 2·8·8 + 4·16·8 = 1408 and the
     * work region, the attention's 16·8·8 + 16·24·4 = 2560 beyond a span of 4·8·16 = 512: 2048
     * (more than 2·8·16 and 4·9·8) → 3456; loss: a tile of 4 rows, logits 4·32 in fp32 and bf16,
     * the rows in bf16: 6·128 + 2·4·8 = 832; hidden 2 taps · 8 · 2 B = 32 B/token, two batches
     * 2·16·32 = 1024; no bf16 working copy → total 31168; host 2 credits · 16 · (32 + 32) = 2048 */
    CLOSE(p.m_weights, 0);
    CLOSE(p.m_master, 5376);
    CLOSE(p.m_adam, 10752);
    CLOSE(p.m_grads, 5376);
    CLOSE(p.m_frozen, 1024);
    CLOSE(p.m_act, 3328);
    CLOSE(p.m_act_transient, 3456);
    CLOSE(p.m_loss, 832);
    CLOSE(p.m_hidden_gpu, 1024);
    CLOSE(p.m_total, 31168);
    CLOSE(p.m_hidden_host, 2048);
    CLOSE(p.wire_raw, 32);
    CLOSE(p.wire_lo, 32);
    CLOSE(p.wire_hi, 32);
    CLOSE(p.disk_lo, 32000);

    /* target per token at S = 8 (no full layer runs): 2·2016 + 3·(8·4·4·2 + 2·4·16) = 5184 */
    CLOSE(p.f_target_token, 5184);
    /* drafter: fc 2·16·16·8 = 4096; per layer q,o 4·8·8·8 = 2048, k,v 4·24·8·4 = 3072, MLP
     * 6·8·8·16 = 6144 → 11264, two layers 22528; attention: sliding vis = 4 − 16/16 + 2.5 = 5.5 →
     * 4·8·8·5.5 = 1408, full vis = 4 + 4 → 2048, sum 3456; LM head 2·2·3·8·32 = 3072.
     * forward 33152; total 33152 + 4096 + 2·22528 + 2.5·3456 + 3072 = 94016 */
    CLOSE(p.f_step_fwd, 33152);
    CLOSE(p.f_step, 94016);
    CLOSE(p.f_step_attn, 3.5 * 3456);
    CLOSE(p.f_step_lm, 6144);
    CLOSE(p.f_drafter_token, 94016.0 / 16);
    CLOSE(p.s_step, 2);
    CLOSE(p.trainer_tok_s, 8);
    CLOSE(p.target_tok_s, 10);
    CLOSE(p.target_per_trainer, 0.8);
    CLOSE(p.wire_bps_lo, 8 * 32);

    /* zstd-byteplane: the measured 1.34..1.51; an explicit ratio replaces it */
    r.encoding = CM_ENCODING_ZSTD_BYTEPLANE;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    CLOSE(p.wire_lo, 32 / 1.51);
    CLOSE(p.wire_hi, 32 / 1.34);
    CLOSE(p.m_hidden_host, 2 * 16 * (32 + 32 / 1.34));
    r.ratio = 2;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    CLOSE(p.wire_lo, 16);
    CLOSE(p.wire_hi, 16);
    r.ratio = 0;

    /* seq_len 0 = the token budget; with a full layer run (tap 3) its attention term appears */
    d.target_layer_ids[1] = 3;
    r.seq_len = 0;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    TST_CHECK(p.run.seq_len == 16 && p.target_layers_run == 4 && p.p_target_run == 2016 + 640);
    /* 2·2656 + 1152 + 2·16·2·4 = 6720 */
    CLOSE(p.f_target_token, 6720);

    /* the printed plan names its parts and assumptions */
    FILE *f = tmpfile();
    dt_plan_print(f, &p, &t, &d);
    rewind(f);
    static char out[16384];
    size_t      n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    fclose(f);
    const char *words[] = {"drafter, trainable",
                           "1344",
                           "Adam moments",
                           "target GPUs per trainer GPU",
                           "assumptions",
                           "1.34..1.51",
                           "compress-2026-11-30.md",
                           "--plan-target-tflops",
                           "hidden states per token",
                           NULL};
    for (int i = 0; words[i]; i++) {
        TST_CHECK(strstr(out, words[i]) != NULL);
        if (!strstr(out, words[i]))
            fprintf(stderr, "  the plan lacks '%s'\n", words[i]);
    }
    if (getenv("TST_VERBOSE"))
        fputs(out, stderr);

    /* refusals */
    dt_plan_run bad = r;
    bad.seq_len = 17;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &bad) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "longer than the token budget") != NULL);
    bad = r;
    bad.max_anchors = 0;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &bad) == CM_ERR_INVALID_ARG);
    bad = r;
    bad.drafter_tflops = 0;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &bad) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "--plan-drafter-tflops") != NULL);
    d.target_layer_ids[1] = 4;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "outside the target's 4 layers") != NULL);
    d.target_layer_ids[1] = 2;
    d.vocab_size = 33;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "use the target the drafter is for") != NULL);
}

/* The parameters dt_model allocates for the small drafter add up to the plan's count; and for its
 * DFlash2 form (two convolutions per layer, the selector). */
static void test_against_model(int v2) {
    cm_target_cfg  t;
    cm_drafter_cfg d;
    small_cfgs(&t, &d);
    if (v2) {
        d.kind = CM_DRAFTER_DFLASH2;
        d.conv_kernel_size = 2, d.conv_group_size = 4, d.selector_rank = 6, d.selector_top_k = 5;
    }
    const kn_backend *be = NULL;
    kn_ctx           *ctx = NULL;
    kn_ctx_config     kc = KN_CTX_CONFIG_DEFAULT;
    dt_model         *m = NULL;
    TST_CHECK(kn_backend_get("cpu", &be) == CM_OK && be->ctx_create(&ctx, &kc) == CM_OK);
    cm_status st = dt_model_create(&m, &d, be, ctx);
    if (st != CM_OK)
        fprintf(stderr, "  %s\n", cm_last_error());
    TST_CHECK(st == CM_OK);
    if (m) {
        int64_t n = 0;
        for (int i = 0; i < dt_model_n_params(m); i++)
            n += dt_model_param(m, i)->numel;
        dt_plan     p;
        dt_plan_run r = DT_PLAN_RUN_DEFAULT;
        r.token_budget = 64;
        TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
        TST_CHECK(n == p.p_drafter);
        if (n != p.p_drafter)
            fprintf(stderr, "  dt_model has %lld parameters, the plan %lld\n", (long long)n,
                    (long long)p.p_drafter);
        TST_CHECK(!v2 || p.p_selector == 2 * 32 * 6 + 6 * 8);
        printf("%s drafter: %lld parameters, plan %lld\n", v2 ? "DFlash2" : "DFlash", (long long)n,
               (long long)p.p_drafter);
    }
    dt_model_destroy(&m);
    if (be && ctx)
        be->ctx_destroy(&ctx);
}

static void test_27b(void) {
    cm_target_cfg  t;
    cm_drafter_cfg d;
    cm_status      st = cm_target_cfg_load(&t, TANDEM_TEST_DATA "/data/cm/qwen3_6_27b/config.json");
    if (st == CM_OK)
        st = cm_drafter_cfg_load(&d, TANDEM_TEST_DATA "/data/cm/dflash_qwen3_6_27b/config.json");
    if (st != CM_OK)
        fprintf(stderr, "  %s\n", cm_last_error());
    TST_CHECK(st == CM_OK);
    if (st != CM_OK)
        return;
    dt_plan_run r = DT_PLAN_RUN_DEFAULT; /* 8192 tokens, 512 anchors, documents of 8192 */
    dt_plan     p;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    /* Drafter (D 5120, 32/8 heads x 128, MLP 17408, 5 layers, 5 taps):
     *   layer: q 5120·4096 = 20 971 520, k 5120·1024 = 5 242 880, v 5 242 880, o 20 971 520,
     *          MLP 3·5120·17408 = 267 386 880, norms 2·5120 + 2·128 = 10 496 → 319 826 176;
     *   5 layers 1 599 130 880 + fc 5120·25600 = 131 072 000 + hidden_norm, norm 10 240
     *   = 1 730 213 120 (docs/goals.md: "1.73 B trainable"). */
    TST_CHECK(p.p_drafter_layer == 319826176LL);
    TST_CHECK(p.p_fc == 131072000LL);
    TST_CHECK(p.p_drafter == 1730213120LL);
    /* frozen: embed + lm_head, untied, 2 · 248320 · 5120 */
    TST_CHECK(p.p_frozen == 2542796800LL);
    /* Target (64 layers: 48 GDN, 16 full at 3, 7, ..., 63):
     *   full layer: q+gate 5120·12288 = 62 914 560, k, v 2·5 242 880, o 6144·5120 = 31 457 280,
     *     q/k norms 512, layer norms 10 240, MLP 267 386 880 → 372 255 232;
     *   GDN layer: qkv 10240·5120 = 52 428 800, z 6144·5120 = 31 457 280, b, a 2·48·5120 = 491 520,
     *     conv 10240·4 = 40 960, dt_bias + A_log 96, norm 128, out 31 457 280, layer norms 10 240,
     *     MLP 267 386 880 → 383 273 184;
     *   16·372 255 232 + 48·383 273 184 = 24 353 196 544 (docs/goals.md: "24.35 B non-embedding")
     *   + embed + lm_head 2 542 796 800 + final norm 5120 = 26 895 998 464.
     * Prefill runs layers 0..61 (last tap 61): 15 full + 47 GDN layers of linear parameters,
     *   15·372 244 480 + 47·383 221 760 = 23 595 089 920. */
    TST_CHECK(p.p_target == 26895998464LL);
    /* one target GPU's weights: bf16 = 2 bytes per matrix element (embed + lm_head 2 542 796 800,
     * the layers' matrices 24 350 556 160) + 4 per small parameter (2 640 384 + final norm 5120)
     * = 53 797 287 936; fp8: the projections 1 byte plus fp32 scales per 128 × 128 block
     * (rows of ceil(K/128) rounded up to 4), in_proj_a/b, embed and lm_head 2 bytes
     * = 29 476 263 936 (27.45 GiB) */
    TST_CHECK(p.m_target_bf16 == 53797287936.0 && p.m_target_fp8 == 29476263936.0);
    TST_CHECK(p.p_target_run == 23595089920LL && p.target_layers_run == 62);
    /* Step FLOPs: docs/goals.md estimates 138 TFLOP for C = 8192 with attention at ~29 % dense
     * density plus tile waste and the LM head over all 8192 rows; the plan counts the visible
     * keys and the 7680 trained rows: fc 2.15 + layers 5·5.41 + attention 1.52 + head 19.5 = 50.3
     * forward, 129.9 total. Within 10 % of 138 and the forward within 10 % of 53.2. */
    TST_CHECK(fabs(p.f_step / 138e12 - 1) < 0.10 && fabs(p.f_step_fwd / 53.2e12 - 1) < 0.10);
    /* target per token at 8192: 2·23 595 089 920 + 15·2·8192·6144 + 47·(8·128·128·48 + 2·4·10240)
     * = 47 190 179 840 + 1 509 949 440 + 39 813 120 ≈ 48.74 GFLOP (docs/goals.md: 50.6 for all 64
     * layers) */
    CLOSE(p.f_target_token, 47190179840.0 + 1509949440.0 + 47.0 * (8.0 * 128 * 128 * 48 + 2.0 * 4 * 10240));
    /* wire: 5 taps · 5120 · 2 = 51 200 B/token raw (docs/goals.md: 51.2 KB/token) */
    CLOSE(p.wire_raw, 51200);
    /* memory: 16 bytes per trainable parameter = 27.7 GB (no bf16 working copy), + frozen 5.09 GB;
     * the whole estimate within 3 % of what bench_dt_step measured on an H200 at this shape
     * (bench/results/drafter-step-2026-11-30.md: 39.845 GB in use, 0.590 GB of it the CUDA
     * context) */
    CLOSE(p.m_weights + p.m_master + p.m_adam + p.m_grads, 16.0 * 1730213120.0);
    TST_CHECK(fabs(p.m_total / (39.845e9 - 0.590e9) - 1) < 0.03);
    TST_CHECK(p.target_per_trainer > 1.5 && p.target_per_trainer < 4); /* docs/goals.md: about 3 : 1 at 8192 */
    if (getenv("TST_VERBOSE"))
        dt_plan_print(stderr, &p, &t, &d);
}

/* The small target made sparse, Qwen3-Next style: layers 0, 1 and 3 MoE (E 4, top-2, expert MLP 4,
 * shared 8), layer 2 dense (MLP 16). */
static void test_small_moe(void) {
    cm_target_cfg  t;
    cm_drafter_cfg d;
    small_cfgs(&t, &d);
    t.n_experts = 4, t.n_experts_per_tok = 2, t.moe_intermediate_size = 4,
    t.shared_expert_intermediate_size = 8;
    t.norm_topk_prob = 1;
    t.layer_moe[0] = t.layer_moe[1] = t.layer_moe[3] = 1;
    dt_plan_run r = {16, 2, 8, 1, 2, CM_ENCODING_RAW, 0, 1, 1, 4, 1000};
    dt_plan     p;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    /* sparse MLP: router 4·8 = 32, experts 4·3·4·8 = 384, shared 3·8·8 = 192 + its gate 8 → 616
     * parameters, of which a token multiplies 32 + 2·96 + 192 + 8 = 424. GDN layer without MLP:
     * 288 linear + 88 other; full layer without MLP: 256 linear + 24 other.
     * Target: layers 0, 1 (GDN, sparse) 992 each, layer 2 (GDN, dense) 760, layer 3 (full, sparse)
     * 896, + embed, lm_head 512 + final norm 8 = 4160. Prefill runs layers 0..2: 712 + 712 + 672 =
     * 2096 linear parameters a token multiplies. */
    TST_CHECK(p.p_target == 4160 && p.p_target_run == 2096 && p.target_layers_run == 3);
    /* 2·2096 + 3·(8·4·4·2 + 2·4·16) = 5344 */
    CLOSE(p.f_target_token, 5344);
    /* bf16: embed + lm_head 2·512 + final norm 4·8 = 1056; small parameters 4·(3·88 + 24) = 1152;
     * matrices 2·(288 + 616 + 288 + 616 + 672 + 256 + 616) = 6704 → 8912 */
    CLOSE(p.m_target_bf16, 8912);
    TST_CHECK(p.target_gpus_bf16 == 1 && p.target_gpus_fp8 == 1);
    /* the rates: the run's own target rate, the MoE fp8 factor; without a rate, the MoE default */
    TST_CHECK(p.target_tflops == 1 && p.fp8_speedup == DT_PLAN_FP8_SPEEDUP_MOE);
    r.target_tflops = 0;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    TST_CHECK(p.target_tflops == DT_PLAN_TARGET_TFLOPS_MOE);
    CLOSE(p.target_tok_s, DT_PLAN_TARGET_TFLOPS_MOE * 1e12 / 5344);
    CLOSE(p.target_tok_s_fp8, p.target_tok_s * DT_PLAN_FP8_SPEEDUP_MOE);
    r.target_tflops = 1;
    /* no shared expert: 192 + 8 fewer per sparse layer, in the count and in what a token multiplies */
    t.shared_expert_intermediate_size = 0;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    TST_CHECK(p.p_target == 4160 - 3 * 200 && p.p_target_run == 2096 - 2 * 200);
    /* every layer dense again (layer_moe cleared): the dense figures of test_small */
    memset(t.layer_moe, 0, sizeof t.layer_moe);
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    TST_CHECK(p.p_target == 3464 && p.p_target_run == 2016);
    r.target_tflops = 0; /* and the dense defaults */
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);
    TST_CHECK(p.target_tflops == DT_PLAN_TARGET_TFLOPS && p.fp8_speedup == DT_PLAN_FP8_SPEEDUP);
}

/* Bytes of an [N, K] projection at --precision fp8: N·K e4m3 and fp32 scales, ceil(N/128) rows of
 * ceil(K/128) rounded up to 4 (docs/fp8.md). */
static double fp8_mat(double N, double K) {
    const double L = ceil(K / 128);
    return N * K + 4 * ceil(N / 128) * (ceil(L / 4) * 4);
}

/* A Qwen3.5-MoE deploy config (head_dim 256, GDN 16 k heads of 128, v heads of 128, conv 4, vocab
 * 248320, untied, every layer sparse, full attention every 4th) and its drafter: the plan's target
 * figures against the same figures computed here tensor by tensor from the config's numbers. */
typedef struct moe_shape {
    const char *dir;
    int64_t     D, L, H, KV, nv, E, K, Ie, Is, last_tap;
    int64_t     p_target; /* the total, summed once by hand (README of the folder) */
    int         gpus_bf16, gpus_fp8;
} moe_shape;

static void test_moe_deploy(const moe_shape *m) {
    char           tp[512], dp[512];
    cm_target_cfg  t;
    cm_drafter_cfg d;
    snprintf(tp, sizeof tp, "%s/../deploy/configs/%s/target-config.json", TANDEM_TEST_DATA, m->dir);
    snprintf(dp, sizeof dp, "%s/../deploy/configs/%s/drafter.json", TANDEM_TEST_DATA, m->dir);
    cm_status st = cm_target_cfg_load(&t, tp);
    if (st == CM_OK)
        st = cm_drafter_cfg_load(&d, dp);
    if (st != CM_OK)
        fprintf(stderr, "  %s\n", cm_last_error());
    TST_CHECK(st == CM_OK);
    if (st != CM_OK)
        return;
    dt_plan_run r = DT_PLAN_RUN_DEFAULT; /* documents of 8192 */
    dt_plan     p;
    TST_CHECK(dt_plan_compute(&p, &t, &d, &r) == CM_OK);

    const double D = (double)m->D, V = 248320, hd = 256, nk = 16, dk = 128, dv = 128, nv = (double)m->nv;
    const double H = (double)m->H, KV = (double)m->KV, E = (double)m->E, K = (double)m->K;
    const double Ie = (double)m->Ie, Is = (double)m->Is, S = 8192;
    const double conv = 2 * nk * dk + nv * dv;
    /* per GDN layer: in_proj_qkv [conv, D], in_proj_z [nv·dv, D], out_proj [D, nv·dv] (quantized
     * under fp8) and in_proj_b, in_proj_a [nv, D] (bf16); small: conv1d conv·4, dt_bias and A_log
     * 2·nv, the gated norm dv, the two layer norms 2·D */
    const double g_q = conv * D + nv * dv * D + D * nv * dv, g_ba = 2 * nv * D;
    const double g_small = conv * 4 + 2 * nv + dv + 2 * D;
    const double g_fp8 = fp8_mat(conv, D) + fp8_mat(nv * dv, D) + fp8_mat(D, nv * dv) + 2 * g_ba;
    /* per full layer: q with its gate [2·H·hd, D], k and v [KV·hd, D], o [D, H·hd]; small: q/k norms
     * 2·hd and the layer norms 2·D */
    const double f_q = 2 * H * hd * D + 2 * KV * hd * D + D * H * hd, f_small = 2 * hd + 2 * D;
    const double f_fp8 = fp8_mat(2 * H * hd, D) + 2 * fp8_mat(KV * hd, D) + fp8_mat(D, H * hd);
    /* per sparse MLP: E experts of gate, up [Ie, D] and down [D, Ie], the shared expert's [Is, D] ×
     * 2 and [D, Is] (quantized under fp8); the router [E, D] and the shared gate [1, D] (bf16) */
    const double x_q = E * 3 * Ie * D + 3 * Is * D, x_bf = E * D + D;
    const double x_act = K * 3 * Ie * D + 3 * Is * D + x_bf;
    const double x_fp8 =
        E * (2 * fp8_mat(Ie, D) + fp8_mat(D, Ie)) + 2 * fp8_mat(Is, D) + fp8_mat(D, Is) + 2 * x_bf;
    const double L = (double)m->L, nf = L / 4, ng = L - nf, head = 2 * V * D;
    const double all = head + D + ng * (g_q + g_ba + g_small) + nf * (f_q + f_small) + L * (x_q + x_bf);
    TST_CHECK((double)p.p_target == all && p.p_target == m->p_target);
    if (p.p_target != m->p_target)
        fprintf(stderr, "  %s: the plan counts %lld target parameters, expected %lld\n", m->dir,
                (long long)p.p_target, (long long)m->p_target);
    /* prefill: layers 0..last tap, of which every 4th full attention */
    const double run = (double)(m->last_tap + 1), nf_run = (double)((m->last_tap + 1) / 4),
                 ng_run = run - nf_run;
    const double act = ng_run * (g_q + g_ba) + nf_run * f_q + run * x_act;
    TST_CHECK((double)p.p_target_run == act && p.target_layers_run == m->last_tap + 1);
    CLOSE(p.f_target_token, 2 * act + nf_run * 2 * S * H * hd + ng_run * (8 * dk * dv * nv + 2 * 4 * conv));
    /* all E experts would be 2·(E − K)·3·Ie·D more per layer: the active count is far below */
    TST_CHECK(p.f_target_token < 0.2 * 2 * all);
    /* weights: embed + lm_head bf16, small parameters fp32, matrices 2 bytes (bf16) or as above */
    const double small = ng * g_small + nf * f_small + D;
    const double bf16 = 2 * head + 4 * small + 2 * (ng * (g_q + g_ba) + nf * f_q + L * (x_q + x_bf));
    const double fp8 = 2 * head + 4 * small + ng * g_fp8 + nf * f_fp8 + L * x_fp8;
    CLOSE(p.m_target_bf16, bf16);
    CLOSE(p.m_target_fp8, fp8);
    const double usable = 143771.0 * 1024 * 1024 - 8.0 * 1024 * 1024 * 1024; /* an H200 less 8 GiB */
    TST_CHECK(p.target_gpus_bf16 == (int)ceil(bf16 / usable) && p.target_gpus_bf16 == m->gpus_bf16);
    TST_CHECK(p.target_gpus_fp8 == (int)ceil(fp8 / usable) && p.target_gpus_fp8 == m->gpus_fp8);
    printf(
        "%s: %lld target parameters, weights %.2f GiB bf16 (%d H200) / %.2f GiB fp8 (%d H200), prefill %.2f "
        "GFLOP per token\n",
        m->dir, (long long)p.p_target, p.m_target_bf16 / 1073741824.0, p.target_gpus_bf16,
        p.m_target_fp8 / 1073741824.0, p.target_gpus_fp8, p.f_target_token / 1e9);

    /* the printed plan names the experts and the GPU counts */
    FILE *f = tmpfile();
    dt_plan_print(f, &p, &t, &d);
    rewind(f);
    static char out[16384];
    size_t      n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    fclose(f);
    char want[64];
    snprintf(want, sizeof want, "%d / %d", m->gpus_bf16, m->gpus_fp8);
    const char *words[] = {"mixture of experts", "experts top-8", "H200s that hold them", want, NULL};
    for (int i = 0; words[i]; i++) {
        TST_CHECK(strstr(out, words[i]) != NULL);
        if (!strstr(out, words[i]))
            fprintf(stderr, "  the plan lacks '%s'\n", words[i]);
    }
    char stages[96];
    snprintf(stages, sizeof stages, "serve --stages N (tandem-launch --server-gpus 0+1+...), N = %d at bf16, %d at fp8",
             m->gpus_bf16, m->gpus_fp8);
    TST_CHECK((strstr(out, stages) != NULL) == (m->gpus_bf16 > 1)); /* the advice when a replica spans GPUs */
    if (getenv("TST_VERBOSE"))
        fputs(out, stderr);
}

int main(void) {
    test_small();
    test_small_moe();
    /* 35B-A3B: 40 layers (30 GDN, 10 full), 16/2 heads, GDN 16/32, 256 experts top-8, 512/512; taps
     * to 37. 122B-A10B: 48 layers (36 GDN, 12 full), 32/2 heads, GDN 16/64, 256 top-8, 1024/1024;
     * taps to 45. bf16 64.56 and 227.45 GiB, fp8 33.26 and 115.23 GiB: 1 / 1 and 2 / 1 H200s. */
    static const moe_shape moe[] = {
        {"qwen3.5-35b-a3b", 2048, 40, 16, 2, 32, 256, 8, 512, 512, 37, 34660610688LL, 1, 1},
        {"qwen3.5-122b-a10b", 3072, 48, 32, 2, 64, 256, 8, 1024, 1024, 45, 122111526912LL, 2, 1},
    };
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
        test_moe_deploy(&moe[i]);
    test_against_model(0);
    test_against_model(1);
    test_27b();
    return tst_report();
}
