/* tests/test_dt_infer.c — the drafter's own inference (dt_infer) against the training forward: tiny
 * random drafters (DFlash and DFlash2, causal and non-causal sliding layers with windows below the
 * block, full layers, shortened blocks) decode 3 sequences in 4 slots over 5 steps, each step
 * appending 0 .. B committed rows per sequence (F32 rows in the trainer's [n, taps·D] layout and
 * BF16 per-layer tensors in turn, through projection chunks of 4 rows or the default), one slot
 * reset and refilled on the way. After each draft, a training batch holds every sequence's
 * committed rows as one document with one anchor at its length, the anchor token there and the
 * drafts as the labels after it: dt_model_step must find every slot's argmax (DFlash) or greedy
 * selector choice under teacher forcing (DFlash2) equal to the draft (on the cpu: all of them,
 * bit for bit the same arithmetic), and its loss must be Σ w·(−log p)/Σ w of the drafts' returned
 * probabilities (the unary max probability for DFlash, the selector's for DFlash2; within 1e-4).
 * With a shortened block the reference is the same weights under a config of that block size.
 * The appends also go through a kv_cache_write (the cpu table with the test's own, as kn_backend.h
 * states it) where a backend has one. Bad calls (a slot out of range or repeated, an append past
 * max_len, a block below DFlash2's kernel) are refused with their messages.
 *
 * `test_dt_infer cuda` (label gpu; 77 without a cuda build or device) runs the same on cuda: in the
 * F32 GEMM mode at least 97 % of the drafts must equal the training forward's (both fp32 on the
 * device; the GEMMs may sum in another order for other row counts) and the losses agree within 1e-3;
 * the BF16 GEMM mode prints its agreement (information). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_infer.h"
#include "dt_model.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_kn.h"

#define N_SLOTS 4
#define N_SEQ   3
#define MAX_LEN 64
#define N_STEPS 5
#define GAMMA   4.0f

static uint64_t rs = 0x9e3779b97f4a7c15ull;

static double urand(void) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (double)(rs >> 11) / 9007199254740992.0;
}
static float srand1(void) { /* uniform in [−1, 1) */
    return (float)(2.0 * urand() - 1.0);
}
static float bf16_round(float f) {
    return cm_bf16_to_f32(cm_f32_to_bf16(f));
}

static cm_drafter_cfg base_cfg(int v2) {
    cm_drafter_cfg c;
    memset(&c, 0, sizeof c);
    c.kind = v2 ? CM_DRAFTER_DFLASH2 : CM_DRAFTER_DFLASH;
    c.hidden_size = 64;
    c.n_layers = 3;
    c.intermediate_size = 96;
    c.vocab_size = 211;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 16;
    c.rms_norm_eps = 1e-6f;
    c.rope_theta = 1e4;
    c.max_position_embeddings = 4096;
    c.block_size = 8;
    c.mask_token_id = 210;
    c.num_target_layers = 8;
    c.n_taps = 2;
    c.target_layer_ids[0] = 1;
    c.target_layer_ids[1] = 5;
    for (int l = 0; l < c.n_layers; l++)
        c.layer_types[l] = CM_LAYER_TYPE_FULL_ATTENTION;
    if (v2) {
        c.conv_kernel_size = 3;
        c.conv_group_size = 8;
        c.selector_rank = 16;
        c.selector_top_k = 6;
    }
    return c;
}

/* Random weights that make the context matter: matrices with variance 1/fan_in, norms 1 ± 0.1,
 * DFlash2's convolutions away from the identity and a selector strong enough to overrule the unary
 * argmax. The same values every call (the generator is reseeded). */
static int randomize(dt_model *m, const kn_backend *be, kn_ctx *ctx) {
    rs = 0x5eed5eed12345678ull;
    for (int i = 0; i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        float          *h = malloc((size_t)p->numel * sizeof *h);
        const int64_t   fan_in = p->n_dims == 2 ? p->shape[1] : 1;
        for (int64_t e = 0; e < p->numel; e++) {
            const float u = srand1();
            if (strstr(p->name, "codebook"))
                h[e] = 0.8f * u;
            else if (strstr(p->name, "base_kernel"))
                h[e] = (e / p->shape[2]) % p->shape[1] == 0 ? 1.0f + 0.3f * u : 0.3f * u;
            else if (strstr(p->name, "kernel_projection"))
                h[e] = 0.1f * u;
            else if (p->n_dims == 1)
                h[e] = 1.0f + 0.1f * u;
            else
                h[e] = u * (float)sqrt(3.0 / (double)fan_in) *
                       (strstr(p->name, "hidden_projection") ? 3.0f : 1.0f);
        }
        const int ok = be->upload(ctx, p->data, h, (size_t)p->numel * sizeof *h) == CM_OK;
        free(h);
        if (!ok)
            return 0;
    }
    return 1;
}

/* Copies every parameter of src into dst (the same table but for the block size). */
static int copy_params(dt_model *dst, const dt_model *src, const kn_backend *be, kn_ctx *ctx) {
    for (int i = 0; i < dt_model_n_params(src); i++) {
        const dt_param *a = dt_model_param(src, i), *b = dt_model_param(dst, i);
        float          *h = malloc((size_t)a->numel * sizeof *h);
        const int       ok = h && b && a->numel == b->numel &&
                       be->download(ctx, h, a->data, (size_t)a->numel * sizeof *h) == CM_OK &&
                       be->upload(ctx, b->data, h, (size_t)a->numel * sizeof *h) == CM_OK;
        free(h);
        if (!ok)
            return 0;
    }
    return 1;
}

/* One sequence's history on the host: its committed rows' taps (bf16-representable F32). */
typedef struct seq {
    int     slot;
    int64_t len;
    float   F[MAX_LEN * 2 * 64];
    int32_t ids[MAX_LEN];
} seq;

typedef struct tally {
    int64_t slots, agree;
    double  worst_loss;
} tally;

/* Appends n_new[i] random rows to each sequence, through dt_infer_append in one of its layouts. */
static int append_rows(dt_infer *inf, seq *sq, const int32_t *n_new, int bf16_layout,
                       const cm_drafter_cfg *c) {
    const int64_t D = c->hidden_size, nD = (int64_t)c->n_taps * D;
    int64_t       total = 0;
    for (int i = 0; i < N_SEQ; i++)
        total += n_new[i];
    float    *F = malloc((size_t)((total + 1) * nD) * sizeof *F);
    uint16_t *T16 = malloc((size_t)((total + 1) * nD) * sizeof *T16);
    int32_t   slots[N_SEQ];
    int64_t   r = 0;
    for (int i = 0; i < N_SEQ; i++) {
        slots[i] = sq[i].slot;
        for (int t = 0; t < n_new[i]; t++, r++) {
            float *dst = sq[i].F + (sq[i].len + t) * nD;
            for (int64_t e = 0; e < nD; e++)
                dst[e] = F[r * nD + e] = bf16_round(srand1());
            sq[i].ids[sq[i].len + t] = (int32_t)(urand() * (c->vocab_size - 1));
            for (int k = 0; k < c->n_taps; k++) /* per-layer tensors [total, D] */
                for (int64_t d = 0; d < D; d++)
                    T16[k * total * D + r * D + d] = cm_f32_to_bf16(F[r * nD + k * D + d]);
        }
    }
    dt_infer_rows rows = {.n_seq = N_SEQ, .slots = slots, .n_rows = n_new};
    if (bf16_layout) {
        rows.dt = CM_DTYPE_BF16;
        rows.ld = D;
        for (int k = 0; k < c->n_taps; k++)
            rows.tap[k] = T16 + k * total * D;
    } else {
        rows.dt = CM_DTYPE_F32;
        rows.ld = nD;
        for (int k = 0; k < c->n_taps; k++)
            rows.tap[k] = F + k * D;
    }
    const int ok = tst_ok(dt_infer_append(inf, &rows), "dt_infer_append");
    for (int i = 0; ok && i < N_SEQ; i++) {
        sq[i].len += n_new[i];
        TST_CHECK(dt_infer_len(inf, sq[i].slot) == sq[i].len);
    }
    free(F);
    free(T16);
    return ok;
}

/* The training forward over every sequence's committed rows with one anchor at its length (the
 * anchor token there, the drafts after it as labels): its hits and loss against the drafts. */
static void check_against_step(dt_model *ref, const cm_drafter_cfg *c, int B, const seq *sq,
                               const int32_t *anchor, const int32_t *drafts, const float *probs,
                               double loss_tol, tally *ty) {
    const int64_t nD = (int64_t)c->n_taps * c->hidden_size;
    int32_t       cu[N_SEQ + 1] = {0}, anchors[N_SEQ];
    for (int i = 0; i < N_SEQ; i++)
        cu[i + 1] = cu[i] + (int32_t)(sq[i].len + B);
    const int64_t T = cu[N_SEQ];
    int32_t      *ids = calloc((size_t)T, sizeof *ids), *mask = calloc((size_t)T, sizeof *mask);
    float        *F = calloc((size_t)(T * nD), sizeof *F);
    double        num = 0, den = 0;
    for (int i = 0; i < N_SEQ; i++) {
        const int64_t o = cu[i], L = sq[i].len;
        memcpy(ids + o, sq[i].ids, (size_t)L * sizeof *ids);
        memcpy(F + o * nD, sq[i].F, (size_t)(L * nD) * sizeof *F);
        ids[o + L] = anchor[i];
        anchors[i] = (int32_t)(o + L);
        for (int k = 1; k < B; k++) {
            ids[o + L + k] = drafts[i * (B - 1) + k - 1];
            mask[o + L + k] = 1;
            const double w = exp(-(double)(k - 1) / GAMMA), p = probs[i * (B - 1) + k - 1];
            TST_CHECK(p > 0 && p <= 1.0 + 1e-6);
            TST_CHECK(p >=
                      (c->kind == CM_DRAFTER_DFLASH2 ? 1.0 / c->selector_top_k : 1.0 / c->vocab_size) - 1e-6);
            num += w * -log(p);
            den += w;
        }
    }
    const dt_batch b = {.T = T,
                        .n_seq = N_SEQ,
                        .cu_seqlens = cu,
                        .input_ids = ids,
                        .loss_mask = mask,
                        .target_hidden = F,
                        .n_anchors = N_SEQ,
                        .anchors = anchors};
    dt_step_stats  s;
    if (tst_ok(dt_model_step(ref, &b, GAMMA, &s), "dt_model_step")) {
        const int v2 = c->kind == CM_DRAFTER_DFLASH2;
        for (int k = 1; k < B; k++) {
            TST_CHECK(s.acc_count[k] == N_SEQ);
            if (v2)
                TST_CHECK(s.sel_in_topk[k] == N_SEQ); /* every draft is a candidate */
            ty->agree += v2 ? s.sel_hits[k] : s.acc_hits[k];
            ty->slots += N_SEQ;
        }
        /* DFlash: the unary CE of the argmax is −log p_max; DFlash2: the selector's CE of its choice */
        const double loss = v2 ? s.loss_selector : s.loss, mine = num / den, err = fabs(loss - mine);
        ty->worst_loss = err > ty->worst_loss ? err : ty->worst_loss;
        if (!(err <= loss_tol))
            fprintf(stderr, "  loss %.9f from the step, %.9f from the draft probabilities\n", loss, mine);
        TST_CHECK(err <= loss_tol);
    }
    free(ids);
    free(mask);
    free(F);
}

/* One scenario on one backend: 5 steps of appends and drafts checked against the training step. */
static void scenario(const char *name, cm_drafter_cfg c, int block, int64_t chunk, const kn_backend *be,
                     kn_gemm_mode mode, double min_agree, double loss_tol) {
    kn_ctx       *ctx = NULL;
    dt_model     *m = NULL, *m2 = NULL;
    dt_infer     *inf = NULL;
    kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
    kc.gemm_mode = mode;
    const int64_t V = c.vocab_size, D = c.hidden_size;
    float        *embed = malloc((size_t)(V * D) * sizeof *embed);
    uint16_t     *head = malloc((size_t)(V * D) * sizeof *head);
    rs = 0xfeedface01234567ull;
    for (int64_t i = 0; i < V * D; i++) {
        embed[i] = srand1();
        head[i] = cm_f32_to_bf16(0.5f * srand1());
    }
    const int B = block ? block : c.block_size;
    tally     ty = {0};
    if (!tst_ok(be->ctx_create(&ctx, &kc), "ctx_create") ||
        !tst_ok(dt_model_create(&m, &c, be, ctx), "create") || !tst_ok(dt_model_init_random(m, 7), "init") ||
        !randomize(m, be, ctx) ||
        !tst_ok(dt_model_set_frozen(m, embed, CM_DTYPE_F32, head, CM_DTYPE_BF16, V, D), "set_frozen"))
        goto done;
    dt_model *ref = m;
    if (B != c.block_size) { /* the same weights under a config of the shorter block */
        cm_drafter_cfg c2 = c;
        c2.block_size = B;
        if (!tst_ok(dt_model_create(&m2, &c2, be, ctx), "create (short block)") ||
            !copy_params(m2, m, be, ctx) ||
            !tst_ok(dt_model_set_frozen(m2, embed, CM_DTYPE_F32, head, CM_DTYPE_BF16, V, D), "set_frozen"))
            goto done;
        ref = m2;
    }
    const dt_infer_config ic = {.n_slots = N_SLOTS, .max_len = MAX_LEN, .block = block, .chunk_rows = chunk};
    if (!tst_ok(dt_infer_create(&inf, m, &ic), "dt_infer_create"))
        goto done;
    TST_CHECK(dt_infer_block(inf) == B);
    static seq sq[N_SEQ];
    memset(sq, 0, sizeof sq);
    sq[0].slot = 2, sq[1].slot = 0, sq[2].slot = 3; /* not in slot order; slot 1 stays empty */
    rs = 0x0123456789abcdefull;
    int32_t anchor[N_SEQ], drafts[N_SEQ * 63];
    float   probs[N_SEQ * 63];
    for (int step = 0; step < N_STEPS; step++) {
        int32_t n_new[N_SEQ];
        for (int i = 0; i < N_SEQ; i++)
            n_new[i] = step == 0 ? (int32_t)(1 + 4 * i) : (int32_t)(urand() * (B + 1)); /* prefill 1, 5, 9 */
        if (step == 3) { /* sequence 1 ends; a new one takes its slot */
            dt_infer_reset(inf, sq[1].slot);
            sq[1].len = 0;
            n_new[1] = 6;
        }
        if (!append_rows(inf, sq, n_new, step % 2, &c))
            break;
        for (int i = 0; i < N_SEQ; i++)
            anchor[i] = (int32_t)(urand() * (V - 1));
        int32_t slots[N_SEQ] = {sq[0].slot, sq[1].slot, sq[2].slot};
        if (!tst_ok(dt_infer_draft(inf, N_SEQ, slots, anchor, drafts, probs), "dt_infer_draft"))
            break;
        check_against_step(ref, &c, B, sq, anchor, drafts, probs, loss_tol, &ty);
    }
    const double agree = ty.slots ? (double)ty.agree / (double)ty.slots : 0;
    printf("%-44s %s %-4s drafts equal to the training forward's: %lld of %lld (%.1f %%), loss diff %.1e\n",
           name, be->name, mode == KN_GEMM_MODE_BF16 ? "BF16" : "F32", (long long)ty.agree,
           (long long)ty.slots, 100 * agree, ty.worst_loss);
    TST_CHECK(ty.slots == (int64_t)N_STEPS * N_SEQ * (B - 1));
    TST_CHECK(agree >= min_agree);
done:
    dt_infer_destroy(&inf);
    dt_model_destroy(&m2);
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
    free(embed);
    free(head);
}

/* The scenarios, on one backend. */
static void all_scenarios(const kn_backend *be, kn_gemm_mode mode, double min_agree, double loss_tol) {
    cm_drafter_cfg c = base_cfg(0);
    c.layer_types[0] = c.layer_types[2] = CM_LAYER_TYPE_SLIDING_ATTENTION; /* causal, window 3 < B */
    c.sliding_window = 3;
    scenario("DFlash B8, causal sliding W3/full/sliding, chunk 4", c, 0, 4, be, mode, min_agree, loss_tol);
    c = base_cfg(0);
    c.is_causal = CM_CAUSAL_ALL;
    scenario("DFlash B8 served as B5, causal full layers", c, 5, 0, be, mode, min_agree, loss_tol);
    c = base_cfg(1);
    c.is_causal = CM_CAUSAL_NONE;
    c.layer_types[0] = c.layer_types[1] = CM_LAYER_TYPE_SLIDING_ATTENTION; /* non-causal, window 5 < B */
    c.sliding_window = 5;
    scenario("DFlash2 B8, non-causal sliding W5/W5/full, chunk 4", c, 0, 4, be, mode, min_agree, loss_tol);
    c = base_cfg(1);
    c.layer_types[1] = CM_LAYER_TYPE_SLIDING_ATTENTION;
    c.sliding_window = 2;
    scenario("DFlash2 B8 served as B4, causal sliding W2", c, 4, 0, be, mode, min_agree, loss_tol);
}

/* kv_cache_write as kn_backend.h states it, for a cpu table that lacks it: the appends' one-call path. */
static int       kv_calls = 0;
static cm_status test_kv_write(kn_ctx *ctx, float *kc, float *vc, const float *k, const float *v,
                               const int32_t *slots, const int32_t *base, const int32_t *cu, int n_seq,
                               int64_t T, int nkv, int hd, int64_t max_len) {
    (void)ctx;
    kv_calls++;
    const int64_t KV = (int64_t)nkv * hd;
    if (cu[0] != 0 || cu[n_seq] != T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "kv_cache_write: cu_seqlens do not span the %lld rows",
                       (long long)T);
    for (int s = 0; s < n_seq; s++)
        for (int32_t i = 0; i < cu[s + 1] - cu[s]; i++) {
            if (base[s] + i >= max_len)
                return CM_FAIL(CM_ERR_INVALID_ARG, "kv_cache_write: row past max_len");
            memcpy(kc + ((int64_t)slots[s] * max_len + base[s] + i) * KV, k + (cu[s] + i) * KV,
                   (size_t)KV * 4);
            memcpy(vc + ((int64_t)slots[s] * max_len + base[s] + i) * KV, v + (cu[s] + i) * KV,
                   (size_t)KV * 4);
        }
    return CM_OK;
}

/* Refusals: bad slots, a cache past max_len, a block below DFlash2's kernel. */
static void check_refusals(void) {
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    dt_infer         *inf = NULL;
    cm_drafter_cfg    c = base_cfg(1);
    const int64_t     V = c.vocab_size, D = c.hidden_size;
    float            *table = calloc((size_t)(V * D), sizeof *table);
    if (!tst_ok(be->ctx_create(&ctx, NULL), "ctx_create") ||
        !tst_ok(dt_model_create(&m, &c, be, ctx), "create") || !tst_ok(dt_model_init_random(m, 1), "init"))
        goto done;
    dt_infer_config ic = {.n_slots = 2, .max_len = 4};
    TST_FAILS(dt_infer_create(&inf, m, &ic), CM_ERR_INVALID_ARG, "frozen embedding");
    TST_CHECK(dt_model_set_frozen(m, table, CM_DTYPE_F32, table, CM_DTYPE_F32, V, D) == CM_OK);
    ic.block = 2;
    TST_FAILS(dt_infer_create(&inf, m, &ic), CM_ERR_INVALID_ARG, "block size 2", "conv_kernel_size 3");
    ic.block = 9;
    TST_FAILS(dt_infer_create(&inf, m, &ic), CM_ERR_INVALID_ARG, "block size 9", "block_size 8");
    ic.block = 0;
    if (!tst_ok(dt_infer_create(&inf, m, &ic), "dt_infer_create"))
        goto done;
    float         rows[5 * 128] = {0};
    int32_t       slot = 1, n = 5, two[2] = {0, 0}, anchor[2] = {1, 1}, drafts[2 * 7];
    dt_infer_rows r = {
        .n_seq = 1, .slots = &slot, .n_rows = &n, .tap = {rows, rows + 64}, .dt = CM_DTYPE_F32, .ld = 128};
    TST_FAILS(dt_infer_append(inf, &r), CM_ERR_INVALID_ARG, "5 rows for slot 1", "raise max_len");
    TST_CHECK(dt_infer_len(inf, 1) == 0);
    n = 4;
    TST_CHECK(dt_infer_append(inf, &r) == CM_OK && dt_infer_len(inf, 1) == 4);
    TST_FAILS(dt_infer_draft(inf, 1, &slot, anchor, drafts, NULL), CM_ERR_INVALID_ARG, "slot 1 holds 4 rows");
    TST_FAILS(dt_infer_draft(inf, 2, two, anchor, drafts, NULL), CM_ERR_INVALID_ARG, "slot 0 is given twice");
    slot = 2;
    TST_FAILS(dt_infer_append(inf, &r), CM_ERR_INVALID_ARG, "slot 2", "outside [0, 2)");
    dt_infer_reset(inf, 1);
    TST_CHECK(dt_infer_len(inf, 1) == 0);
    anchor[0] = (int32_t)V;
    slot = 1;
    TST_FAILS(dt_infer_draft(inf, 1, &slot, anchor, drafts, NULL), CM_ERR_INVALID_ARG,
              "outside the vocabulary");
    anchor[0] = 3;
    TST_CHECK(dt_infer_draft(inf, 1, &slot, anchor, drafts, NULL) == CM_OK); /* an empty context drafts too */
done:
    dt_infer_destroy(&inf);
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
    free(table);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "cuda") == 0) {
        tst_need_cuda();
        all_scenarios(kn_backend_cuda(), KN_GEMM_MODE_F32, 0.97, 1e-3);
        all_scenarios(kn_backend_cuda(), KN_GEMM_MODE_BF16, 0.0, INFINITY);
        return tst_report();
    }
    all_scenarios(kn_backend_cpu(), KN_GEMM_MODE_F32, 1.0, 1e-4);
    static kn_backend kv = {0}; /* the cpu table with a kv_cache_write: appends through it */
    kv = *kn_backend_cpu();
    kv.kv_cache_write = test_kv_write;
    cm_drafter_cfg c = base_cfg(1);
    c.layer_types[0] = CM_LAYER_TYPE_SLIDING_ATTENTION;
    c.sliding_window = 3;
    scenario("DFlash2 B8 through kv_cache_write, chunk 4", c, 0, 4, &kv, KN_GEMM_MODE_F32, 1.0, 1e-4);
    TST_CHECK(kv_calls > 0);
    check_refusals();
    return tst_report();
}
