/* tests/test_ts_split.c — a target split over pipeline stages (target-server/ts_split.h):
 *   - ts_split_even: every stage at least one layer, boundaries ascending, the stages' weights
 *     balanced to within one layer, on the 27B, the 35B-A3B MoE and the tiny configs;
 *   - the split forward equals one context's bit for bit at fp32 (every layer's capture, the final
 *     norm, the logits and a MoE layer's routing) for every oracle fixture (dense, MoE fused and per
 *     expert, Qwen3-Next), at 2 and 3 stages and with boundaries given, and when the capture stops
 *     early (stages past it not run);
 *   - packs in flight: 4 threads at once through one 3-stage split (ts_split_forward_with, each with
 *     its own hand-over), every result bit-identical to the single-threaded one;
 *   - decoding over 2 and 3 stages answers every step bit-identically to one context (greedy drafts
 *     accepted in part and committed, a sampled sequence, a prompt in pieces);
 *   - what a split cannot do is refused with one message: too many stages, bad boundaries, device
 *     captures, decoding without the head or on one stage alone.
 *   test_ts_split cpu    the stages on cpu contexts (unit)
 *   test_ts_split cuda   on cuda contexts: all on GPU 0 (two stages on one GPU: the same code path as two
 *                        GPUs, the hand-over a peer copy on one device), and on GPUs 0 and 1 when a
 *                        second GPU is present (gpu; exits 77 without one) */
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_safetensors.h"
#include "kn_backend.h"
#include "ts_decode.h"
#include "ts_split.h"
#include "tst.h"
#include "tst_kn.h"

#define FIX TANDEM_TEST_DATA "/fixtures/target"

static double layer_w(const cm_target_cfg *c, int i) { /* as the split weighs a layer, rebuilt here */
    const double D = c->hidden_size;
    double       w = c->layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION
                         ? D * (2.0 * c->lin_n_k_heads * c->lin_k_head_dim + c->lin_n_v_heads * c->lin_v_head_dim) +
                               2.0 * D * c->lin_n_v_heads * c->lin_v_head_dim + 2.0 * D * c->lin_n_v_heads
                         : D * c->n_heads * c->head_dim * (c->attn_output_gate ? 3.0 : 2.0) +
                               2.0 * D * c->n_kv_heads * c->head_dim;
    return w + (cm_target_layer_moe(c, i) ? 3.0 * D * c->moe_intermediate_size * c->n_experts +
                                                3.0 * D * c->shared_expert_intermediate_size + D * c->n_experts + D
                                          : 3.0 * D * c->intermediate_size);
}

static void test_even(const char *config) {
    cm_target_cfg c;
    TST_CHECK(cm_target_cfg_load(&c, config) == CM_OK);
    double max_w = 0, total = 0;
    for (int i = 0; i < c.n_layers; i++) {
        total += layer_w(&c, i);
        max_w = layer_w(&c, i) > max_w ? layer_w(&c, i) : max_w;
    }
    for (int n = 1; n <= c.n_layers && n <= TS_SPLIT_MAX_STAGES; n++) {
        int b[TS_SPLIT_MAX_STAGES + 1];
        ts_split_even(&c, c.n_layers, n, b);
        TST_CHECK(b[0] == 0 && b[n] == c.n_layers);
        double worst = 0;
        for (int s = 0; s < n; s++) {
            TST_CHECK(b[s + 1] > b[s]);
            double w = 0;
            for (int i = b[s]; i < b[s + 1]; i++) w += layer_w(&c, i);
            worst = w > worst ? w : worst;
        }
        /* no stage holds more than its share plus one layer (or one layer, when a layer is the share) */
        TST_CHECK(worst <= total / n + max_w + 1e-6 * total);
        if (n == 2 || n == 4 || n == c.n_layers)
            printf("%s: %d stages, heaviest %.1f %% of the weights (an even share %.1f %%)\n", strrchr(config, '/') + 1,
                   n, 100 * worst / total, 100.0 / n);
    }
}

/* Everything a dump captures, from a split of n stages (bounds NULL: even). */
typedef struct outputs {
    float  **layers, *final_norm, *logits;
    int32_t *experts;
} outputs;

/* on_device: the layers gathered in the first stage's memory (layer_dev, layer_dev_ctx), as a
 * server sends them over NCCL, then downloaded into o. */
static cm_status run(const kn_backend *be, const int *gpus, int on_device, const char *model, int n,
                     const int *bounds, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                     int n_cap, const int *cap_layers, int head, outputs *o) {
    cm_target_cfg c;
    CM_TRY(cm_target_cfg_load(&c, model));
    kn_ctx   *ctxs[TS_SPLIT_MAX_STAGES] = {0};
    ts_split *sp                        = NULL;
    cm_status st                        = CM_OK;
    const int n_ctx = n < TS_SPLIT_MAX_STAGES ? n : TS_SPLIT_MAX_STAGES; /* n above it: refused by the load */
    for (int i = 0; i < n_ctx && st == CM_OK; i++) {
        kn_ctx_config kc = {gpus[i], KN_GEMM_MODE_F32};
        st               = be->ctx_create(&ctxs[i], &kc);
    }
    ts_model_config mc = {.dir = model, .backend = be, .n_layers = -1, .load_head = head};
    if (st == CM_OK) st = ts_split_load(&sp, &mc, n, ctxs, bounds);
    ts_capture cap = {.n_layers = n_cap, .layers = cap_layers, .layer_out = o->layers, .experts = o->experts,
                      .final_norm = head ? o->final_norm : NULL, .logits = head ? o->logits : NULL};
    float       *dev[CM_CFG_MAX_LAYERS] = {0};
    const size_t bytes = (size_t)(T * c.hidden_size) * sizeof(float);
    if (on_device && st == CM_OK) {
        for (int i = 0; i < n_cap && st == CM_OK; i++)
            st = be->alloc(ctxs[0], (void **)&dev[i], bytes);
        cap.layer_dev = dev;
        cap.layer_dev_ctx = ctxs[0];
    }
    if (st == CM_OK) st = ts_split_forward(sp, ids, T, cu, n_seq, &cap);
    if (on_device && st == CM_OK && be->ctx_bind)
        st = be->ctx_bind(ctxs[0]);
    for (int i = 0; on_device && i < n_cap && st == CM_OK; i++)
        st = be->download(ctxs[0], o->layers[i], dev[i], bytes);
    for (int i = 0; on_device && i < n_cap && ctxs[0]; i++)
        if (dev[i])
            be->free(ctxs[0], dev[i]);
    ts_split_destroy(&sp);
    for (int i = 0; i < n_ctx; i++) be->ctx_destroy(&ctxs[i]);
    return st;
}

static outputs alloc_out(const cm_target_cfg *c, int64_t T) {
    outputs o = {calloc((size_t)c->n_layers, sizeof(float *)), calloc((size_t)(T * c->hidden_size), 4),
                 calloc((size_t)T * (size_t)c->vocab_size, 4),
                 calloc((size_t)c->n_layers * (size_t)(T * (c->n_experts_per_tok ? c->n_experts_per_tok : 1)), 4)};
    for (int i = 0; i < c->n_layers; i++) o.layers[i] = calloc((size_t)(T * c->hidden_size), 4);
    return o;
}

static void free_out(const cm_target_cfg *c, outputs *o) {
    for (int i = 0; i < c->n_layers; i++) free(o->layers[i]);
    free(o->layers);
    free(o->final_norm);
    free(o->logits);
    free(o->experts);
}

/* Bit equality of what both captured (the first n_cap layers; the head when head). */
static int same(const cm_target_cfg *c, int64_t T, const outputs *a, const outputs *b, int n_cap, int head) {
    const size_t TD = (size_t)(T * c->hidden_size);
    int          eq = 1;
    for (int i = 0; i < n_cap; i++) eq &= memcmp(a->layers[i], b->layers[i], TD * 4) == 0;
    if (head) {
        eq &= memcmp(a->final_norm, b->final_norm, TD * 4) == 0;
        eq &= memcmp(a->logits, b->logits, (size_t)T * (size_t)c->vocab_size * 4) == 0;
    }
    if (c->n_experts)
        eq &= memcmp(a->experts, b->experts, (size_t)c->n_layers * (size_t)(T * c->n_experts_per_tok) * 4) == 0;
    return eq;
}

/* A fixture's model directory, config and packed batch (aligned copies; free with free_fixture). 0 when
 * it cannot be read. */
typedef struct fixture {
    char          model[1200];
    cm_target_cfg c;
    int32_t      *ids, *cu;
    int64_t       T;
    int           n_seq;
} fixture;

static int load_fixture(const char *name, fixture *fx) {
    char   input[1200];
    cm_st *in = NULL;
    memset(fx, 0, sizeof *fx);
    snprintf(fx->model, sizeof fx->model, "%s/%s/model", FIX, name);
    snprintf(input, sizeof input, "%s/%s/input.safetensors", FIX, name);
    TST_CHECK(cm_target_cfg_load(&fx->c, fx->model) == CM_OK && cm_st_open_file(&in, input) == CM_OK);
    if (!in) return 0;
    const cm_st_tensor *ti = cm_st_find(in, "input_ids"), *tc = cm_st_find(in, "cu_seqlens");
    fx->T     = ti->shape[0];
    fx->n_seq = (int)tc->shape[0] - 1;
    fx->ids   = malloc((size_t)fx->T * 4);
    fx->cu    = malloc((size_t)(fx->n_seq + 1) * 4);
    memcpy(fx->ids, ti->data, (size_t)fx->T * 4);
    memcpy(fx->cu, tc->data, (size_t)(fx->n_seq + 1) * 4);
    cm_st_destroy(&in);
    return 1;
}

static void free_fixture(fixture *fx) {
    free(fx->ids);
    free(fx->cu);
}

static void test_fixture(const kn_backend *be, const int *gpus, const char *name) {
    fixture fx;
    if (!load_fixture(name, &fx)) return;
    const cm_target_cfg c = fx.c;
    const char         *model = fx.model;
    const int32_t      *ids = fx.ids, *cu = fx.cu;
    const int64_t       T = fx.T;
    const int           n_seq = fx.n_seq;
    int all[CM_CFG_MAX_LAYERS];
    for (int i = 0; i < c.n_layers; i++) all[i] = i;
    outputs one = alloc_out(&c, T), got = alloc_out(&c, T);
    TST_CHECK(tst_ok(run(be, gpus, 0, model, 1, NULL, ids, T, cu, n_seq, c.n_layers, all, 1, &one), name));
    for (int n = 2; n <= 3 && n <= c.n_layers; n++) {
        TST_CHECK(
            tst_ok(run(be, gpus, 0, model, n, NULL, ids, T, cu, n_seq, c.n_layers, all, 1, &got), name));
        const int eq = same(&c, T, &one, &got, c.n_layers, 1);
        TST_CHECK(eq);
        printf("%-24s %d stages (even): every layer, final norm, logits%s bit-identical to one context: %s\n", name,
               n, c.n_experts ? ", routing" : "", eq ? "yes" : "NO");
        /* the layers gathered in the first stage's memory instead (what NCCL answers send) */
        for (int i = 0; i < c.n_layers; i++)
            memset(got.layers[i], 0xff, (size_t)(T * c.hidden_size) * 4);
        TST_CHECK(
            tst_ok(run(be, gpus, 1, model, n, NULL, ids, T, cu, n_seq, c.n_layers, all, 0, &got), name));
        const int eq_dev = same(&c, T, &one, &got, c.n_layers, 0);
        TST_CHECK(eq_dev);
        printf(
            "%-24s %d stages (even): every layer gathered on the first stage's device, bit-identical: %s\n",
            name, n, eq_dev ? "yes" : "NO");
    }
    /* boundaries given: the first layer alone, then the rest */
    const int b[3] = {0, 1, c.n_layers};
    TST_CHECK(tst_ok(run(be, gpus, 0, model, 2, b, ids, T, cu, n_seq, c.n_layers, all, 1, &got), name));
    TST_CHECK(same(&c, T, &one, &got, c.n_layers, 1));
    /* a capture that stops at layer 1: the stages after it do not run, layers 0 and 1 as before */
    memset(got.layers[1], 0, (size_t)(T * c.hidden_size) * 4);
    TST_CHECK(tst_ok(run(be, gpus, 0, model, 3, NULL, ids, T, cu, n_seq, 2, all, 0, &got), name));
    for (int i = 0; i < 2; i++) TST_CHECK(memcmp(one.layers[i], got.layers[i], (size_t)(T * c.hidden_size) * 4) == 0);
    free_out(&c, &one);
    free_out(&c, &got);
    free_fixture(&fx);
}

static void test_refusals(const kn_backend *be, const int *gpus) {
    const char *model = FIX "/qwen3next_flat/model";
    int32_t     ids[4] = {1, 2, 3, 4}, cu[2] = {0, 4};
    outputs     o      = {0};
    const int   b_bad[3] = {0, 3, 3};
    TST_FAILS(run(be, gpus, 0, model, TS_SPLIT_MAX_STAGES + 1, NULL, ids, 4, cu, 1, 0, NULL, 0, &o),
              CM_ERR_INVALID_ARG, "stages for 6 layers", "at most one per layer");
    const int   b_short[3] = {0, 2, 5};
    TST_FAILS(run(be, gpus, 0, model, 2, b_bad, ids, 4, cu, 1, 0, NULL, 0, &o), CM_ERR_INVALID_ARG,
              "stage 1 would hold layers [3, 3)", "at least one layer");
    TST_FAILS(run(be, gpus, 0, model, 2, b_short, ids, 4, cu, 1, 0, NULL, 0, &o), CM_ERR_INVALID_ARG,
              "the stages hold layers [0, 5)", "cover [0, 6) exactly");
    /* device captures stay with one context */
    {
        kn_ctx         *ctx = NULL;
        kn_ctx_config   kc  = {gpus[0], KN_GEMM_MODE_F32};
        ts_split       *sp  = NULL;
        ts_model_config mc  = {.dir = model, .backend = be, .n_layers = -1};
        TST_CHECK(be->ctx_create(&ctx, &kc) == CM_OK && ts_split_load(&sp, &mc, 1, &ctx, NULL) == CM_OK);
        float     *dev[1] = {NULL};
        const int  l0     = 0;
        ts_capture cap    = {.n_layers = 1, .layers = &l0, .layer_dev = dev};
        TST_FAILS(ts_split_forward(sp, ids, 4, cu, 1, &cap), CM_ERR_INVALID_ARG,
                  "layer_dev with layer_dev_ctx");
        /* decoding needs the head: on a split loaded without it, and on one stage alone */
        ts_decoder_config dc = {.max_seqs = 1, .max_len = 8, .max_step = 4, .max_forward = 4,
                                .hidden_dtype = CM_DTYPE_F32};
        ts_decoder       *d  = NULL;
        TST_FAILS(ts_decoder_create_split(sp, &dc, &d), CM_ERR_INVALID_ARG, "every layer and the head", "no head");
        ts_model       *stage = NULL;
        ts_model_config sc    = {.dir = model, .backend = be, .ctx = ctx, .first_layer = 2, .n_layers = 6,
                                 .load_head = 1};
        TST_CHECK(ts_model_load(&stage, &sc) == CM_OK);
        TST_FAILS(ts_decoder_create(stage, &dc, &d), CM_ERR_INVALID_ARG, "every layer and the head", "layers 2 to 5");
        ts_model_destroy(&stage);
        ts_split_destroy(&sp);
        be->ctx_destroy(&ctx);
    }
}

/* Several threads through one split at once, each pack its own hand-over and outputs. */
typedef struct flight {
    ts_split      *sp;
    const int32_t *ids, *cu;
    int64_t        T;
    int            n_seq, D, V, rounds, bad;
    const float   *ref_logits;
} flight;

static void *fly(void *arg) {
    flight            *f  = arg;
    float             *lg = malloc((size_t)f->T * (size_t)f->V * 4);
    ts_split_handover *ho = NULL;
    if (ts_split_handover_create(f->sp, &ho) != CM_OK) f->bad++;
    for (int r = 0; r < f->rounds; r++) {
        ts_capture cap = {.logits = lg};
        if (!ho || !lg || ts_split_forward_with(f->sp, ho, f->ids, f->T, f->cu, f->n_seq, &cap) != CM_OK ||
            memcmp(lg, f->ref_logits, (size_t)f->T * (size_t)f->V * 4) != 0)
            f->bad++;
    }
    ts_split_handover_destroy(&ho);
    free(lg);
    return NULL;
}

static void test_in_flight(const kn_backend *be, const int *gpus) {
    const char *name = "qwen35moe_mm_fused";
    fixture     fx;
    if (!load_fixture(name, &fx)) return;
    const cm_target_cfg c = fx.c;
    const char         *model = fx.model;
    const int32_t      *ids = fx.ids, *cu = fx.cu;
    flight f = {.ids = ids, .cu = cu, .T = fx.T, .n_seq = fx.n_seq, .D = c.hidden_size, .V = c.vocab_size,
                .rounds = 3};
    outputs one = alloc_out(&c, f.T);
    TST_CHECK(tst_ok(run(be, gpus, 0, model, 1, NULL, ids, f.T, cu, f.n_seq, 0, NULL, 1, &one), name));
    f.ref_logits = one.logits;
    kn_ctx *ctxs[3] = {0};
    for (int i = 0; i < 3; i++) {
        kn_ctx_config kc = {gpus[i], KN_GEMM_MODE_F32};
        TST_CHECK(be->ctx_create(&ctxs[i], &kc) == CM_OK);
    }
    ts_model_config mc = {.dir = model, .backend = be, .n_layers = -1, .load_head = 1};
    TST_CHECK(tst_ok(ts_split_load(&f.sp, &mc, 3, ctxs, NULL), "3 stages"));
    flight    fl[4];
    pthread_t th[4];
    int       bad = 0;
    for (int i = 0; f.sp && i < 4; i++) {
        fl[i] = f;
        TST_CHECK(pthread_create(&th[i], NULL, fly, &fl[i]) == 0);
    }
    for (int i = 0; f.sp && i < 4; i++) {
        pthread_join(th[i], NULL);
        bad += fl[i].bad;
    }
    TST_CHECK(f.sp && bad == 0);
    printf("%s, 3 stages, 4 threads x %d packs in flight at once: %d of %d results differ from one context's\n", name,
           f.rounds, bad, 4 * f.rounds);
    ts_split_destroy(&f.sp);
    for (int i = 0; i < 3; i++) be->ctx_destroy(&ctxs[i]);
    free_out(&c, &one);
    free_fixture(&fx);
}

// ---- decoding on a split target

typedef struct dec_out {
    cm_proto_tensor t[4];
    cm_proto_answer ans;
} dec_out;

/* One STEP of n records (tokens back to back in toks) with the layers lay[0 .. n_lay). */
static cm_status dec_step(ts_decoder *d, cm_proto_decode_seq *recs, int n, int32_t *toks, int32_t *lay, int n_lay,
                          dec_out *o) {
    uint32_t T = 0;
    for (int i = 0; i < n; i++) T += recs[i].n_ctx + recs[i].n_draft;
    cm_proto_decode rq = {.id = 1, .op = CM_DECODE_STEP, .encoding = CM_ENCODING_RAW, .n_seqs = (uint32_t)n,
                          .n_tokens = T, .n_layers = (uint32_t)n_lay, .seqs = recs, .tokens = toks, .layer_ids = lay};
    memset(o, 0, sizeof *o);
    o->ans.tensors     = o->t;
    o->ans.cap_tensors = 4;
    return ts_decoder_step(d, "c", &rq, &o->ans);
}

/* Bit equality of two answers: the decode table and every layer's rows. */
static int same_answer(const dec_out *a, const dec_out *b) {
    if (a->ans.n_tensors != b->ans.n_tensors) return 0;
    for (uint32_t i = 0; i < a->ans.n_tensors; i++)
        if (a->t[i].raw_size != b->t[i].raw_size || memcmp(a->t[i].data, b->t[i].data, (size_t)a->t[i].raw_size))
            return 0;
    return 1;
}

static ts_decoder *new_decoder(ts_model *m, ts_split *sp) {
    ts_decoder_config c = {.max_seqs = 4, .max_len = 64, .max_step = 32, .max_forward = 8,
                           .hidden_dtype = CM_DTYPE_F32};
    ts_decoder *d = NULL;
    TST_CHECK(tst_ok(m ? ts_decoder_create(m, &c, &d) : ts_decoder_create_split(sp, &c, &d), "decoder"));
    return d;
}

/* Decoding over n stages answers every step exactly as over one context: a greedy sequence whose
 * drafts are the target's own continuation with a wrong token every other step (so blocks are
 * accepted in part and committed), and a sampled one (its logits rows); prompts longer than a
 * forward go in pieces. The continuation comes from a third decoder running ahead alone. */
static void test_decode(const kn_backend *be, const int *gpus, const char *name, int n) {
    fixture fx;
    if (!load_fixture(name, &fx)) return;
    const cm_target_cfg *c = &fx.c;
    enum { PA = 5, PB = 11, STEPS = 5, NDR = 3, AHEAD = STEPS * (NDR + 1) + 2 };
    int32_t prompt[PA + PB]; /* B is longer than a forward: it goes in two pieces */
    for (int i = 0; i < PA + PB; i++) prompt[i] = (int32_t)((7 * i + 3) % c->vocab_size);
    kn_ctx *ctxs[TS_SPLIT_MAX_STAGES + 1] = {0};
    for (int i = 0; i <= n; i++) {
        kn_ctx_config kc = {gpus[i % n], KN_GEMM_MODE_F32};
        TST_CHECK(be->ctx_create(&ctxs[i], &kc) == CM_OK);
    }
    ts_model_config mc = {.dir = fx.model, .backend = be, .n_layers = -1, .load_head = 1, .ctx = ctxs[n]};
    ts_model       *m  = NULL;
    ts_split       *sp = NULL;
    TST_CHECK(tst_ok(ts_model_load(&m, &mc), name) && tst_ok(ts_split_load(&sp, &mc, n, ctxs, NULL), name));
    ts_decoder *d0 = m ? new_decoder(m, NULL) : NULL, *d1 = m ? new_decoder(m, NULL) : NULL,
               *d2 = sp ? new_decoder(NULL, sp) : NULL;
    int32_t lay[3] = {0, c->n_layers / 2, c->n_layers - 1}, n_lay = c->n_layers > 2 ? 3 : c->n_layers;
    if (c->n_layers == 2) lay[1] = 1;
    int steps = 0, eq = 1, accepted = 0;
    if (d0 && d1 && d2) {
        /* the greedy continuation of prompt A, AHEAD tokens */
        int32_t             ahead[AHEAD + 1], toks[64];
        cm_proto_decode_seq r = {.n_ctx = PA, .top_p = 1};
        dec_out            *o = calloc(2, sizeof *o);
        memcpy(toks, prompt, PA * 4);
        int ok = tst_ok(dec_step(d0, &r, 1, toks, lay, 0, &o[0]), "one context ahead");
        for (int k = 0; k < AHEAD && ok; k++) {
            const int32_t *dec = o[0].t[0].data;
            ahead[k]           = dec[3];
            r                  = (cm_proto_decode_seq){.handle = (uint32_t)dec[0], .base = (uint32_t)dec[1],
                                                       .n_ctx = 1, .top_p = 1};
            ok = tst_ok(dec_step(d0, &r, 1, &ahead[k], lay, 0, &o[0]), "one context ahead");
        }
        TST_CHECK(ok);
        eq = ok;
        /* A greedy, B sampled, in lockstep on one context and on the stages */
        cm_proto_decode_seq recs[2] = {{.n_ctx = PA, .top_p = 1},
                                       {.n_ctx = PB, .temperature = 0.8f, .top_p = 0.95f, .top_k = 20, .seed = 7}};
        memcpy(toks, prompt, (PA + PB) * 4);
        for (int g = 0; g <= STEPS && eq; g++) {
            cm_status s1 = dec_step(d1, recs, 2, toks, lay, n_lay, &o[0]);
            cm_status s2 = dec_step(d2, recs, 2, toks, lay, n_lay, &o[1]);
            TST_CHECK(tst_ok(s1, "one context") && tst_ok(s2, "stages"));
            eq &= s1 == CM_OK && s2 == CM_OK && same_answer(&o[0], &o[1]);
            if (!eq) {
                if (s1 == CM_OK && s2 == CM_OK) { /* the decode tables: handle, length, accepted, next */
                    const int32_t *a = o[0].t[0].data, *b = o[1].t[0].data;
                    fprintf(stderr, "step %d differs: %d %d %d %d, %d %d %d %d on one context; %d %d %d %d, %d %d %d %d "
                            "on the stages\n", g, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], b[0], b[1], b[2], b[3],
                            b[4], b[5], b[6], b[7]);
                }
                break;
            }
            steps++;
            const int32_t *dec = o[0].t[0].data;
            accepted += g ? dec[2] : 0;
            /* A: the anchor, then the continuation's next NDR tokens, the second one wrong on odd steps */
            const int pos = dec[1] - PA; /* A's generated tokens so far; ahead[pos] is its anchor */
            recs[0] = (cm_proto_decode_seq){.handle = (uint32_t)dec[0], .base = (uint32_t)dec[1], .n_ctx = 1,
                                            .n_draft = NDR, .top_p = 1};
            toks[0] = dec[3];
            for (int k = 0; k < NDR; k++) toks[1 + k] = ahead[pos + 1 + k];
            if (g % 2) toks[2] = (toks[2] + 1) % c->vocab_size;
            recs[1] = (cm_proto_decode_seq){.handle = (uint32_t)dec[4], .base = (uint32_t)dec[5], .n_ctx = 1,
                                            .n_draft = 2, .temperature = 0.8f, .top_p = 0.95f, .top_k = 20};
            toks[1 + NDR] = dec[7];
            toks[2 + NDR] = toks[3 + NDR] = (dec[7] + 1) % c->vocab_size;
        }
        free(o);
    }
    TST_CHECK(eq && steps == STEPS + 1 && accepted > 0);
    printf("%-24s decoding over %d stages: %d steps (%d drafts accepted) bit-identical to one context: %s\n", name, n,
           steps, accepted, eq && steps == STEPS + 1 ? "yes" : "NO");
    ts_decoder_destroy(&d0);
    ts_decoder_destroy(&d1);
    ts_decoder_destroy(&d2);
    ts_split_destroy(&sp);
    ts_model_destroy(&m);
    for (int i = 0; i <= n; i++) be->ctx_destroy(&ctxs[i]);
    free_fixture(&fx);
}

/* Whether a context opens on GPU 1. */
static int second_gpu(const kn_backend *be) {
    kn_ctx       *ctx = NULL;
    kn_ctx_config kc  = {1, KN_GEMM_MODE_F32};
    if (be->ctx_create(&ctx, &kc) != CM_OK) return 0;
    be->ctx_destroy(&ctx);
    return 1;
}

int main(int argc, char **argv) {
    const char       *device = argc > 1 ? argv[1] : "cpu";
    const kn_backend *be     = kn_backend_cpu();
    int               gpus[TS_SPLIT_MAX_STAGES] = {0};
    if (strcmp(device, "cuda") == 0) {
        tst_need_cuda();
        be = kn_backend_cuda();
    }
    test_even(TANDEM_TEST_DATA "/../deploy/configs/qwen3.6-27b/target-config.json");
    test_even(TANDEM_TEST_DATA "/../deploy/configs/qwen3.5-35b-a3b/target-config.json");
    test_even(FIX "/qwen3next_flat/model/config.json");
    const char *fixtures[] = {"qwen35_flat_f32_tied", "qwen35_mm_sharded", "qwen36_mm_single_bf16",
                              "qwen35moe_flat_experts", "qwen35moe_mm_fused", "qwen3next_flat"};
    for (size_t i = 0; i < sizeof fixtures / sizeof fixtures[0]; i++) test_fixture(be, gpus, fixtures[i]);
    if (strcmp(device, "cuda") == 0 && second_gpu(be)) { /* stage i on GPU i */
        for (int i = 0; i < TS_SPLIT_MAX_STAGES; i++) gpus[i] = i % 2;
        printf("two GPUs: stages alternate between GPU 0 and GPU 1\n");
        for (size_t i = 0; i < sizeof fixtures / sizeof fixtures[0]; i++) test_fixture(be, gpus, fixtures[i]);
    }
    test_in_flight(be, gpus);
    test_decode(be, gpus, "qwen35_mm_sharded", 2);
    test_decode(be, gpus, "qwen35moe_mm_fused", 3);
    test_decode(be, gpus, "qwen3next_flat", 2);
    test_refusals(be, gpus);
    return tst_report();
}
