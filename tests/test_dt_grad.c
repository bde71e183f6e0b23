/* tests/test_dt_grad.c — `drafter-trainer grad` against the float64 PyTorch oracle
 * (tests/oracle/make_drafter_fixtures.py) on every fixture under tests/fixtures/drafter/, and DFlash2's
 * (tests/oracle/make_dflash2_fixtures.py) under tests/fixtures/drafter2/ (also both loss terms, the
 * selector's τ and per-slot recall and hits, with the fixture's α and miss policy from its metadata):
 * the loss (relative error ≤ 1e-5), every gradient (relative L2 ≤ 1e-4), tau and the per-slot
 * accuracy counts (equal). The real binary runs as a child process; the fixture's gamma (ref
 * metadata) is passed only when it is not the block size's default, so the default is tested too.
 * The first fixture also runs with embed_tokens and lm_head taken from a --target directory
 * instead of the batch, which must give bit-identical output, and goes through the dt_model
 * API directly: buffers grown and reused across steps of different sizes give the same bits as
 * a fresh model, zero anchors and Σw = 0 give loss 0 and zero gradients, the parameter order,
 * and the seeded initialisation.
 *   test_dt_grad cpu    (unit)
 *   test_dt_grad cuda   (gpu; exits 77 without a cuda build or device.) grad --device cuda against
 *                       the same fixtures with issue 7's limits: loss ≤ 1e-2 relative, every
 *                       gradient ≤ 5e-2 relative L2 (tau and the accuracy counts still equal).
 * The cpu against cuda on a larger random drafter is test_dt_cuda_random. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cm_safetensors.h"
#include "dt_model.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_dt.h"
#include "tst_kn.h"
#include "tst_proc.h"

static char bin[1024];
static char tmp[64];

static double default_gamma(int64_t block_size) {
    return block_size >= 16 ? 7.0 : block_size <= 8 ? 4.0 : 5.0;
}

/* DFlash2 fixtures' selector settings (ref metadata), passed when not the defaults */
static const char *sel_alpha, *sel_miss;

static int run_grad(const char *drafter, const char *batch, const char *out, const char *device,
                    const char *gamma, const char *target, const char *err) {
    char *argv[24];
    int   n = 0;
    argv[n++] = bin;
    argv[n++] = "grad";
    argv[n++] = "--drafter";
    argv[n++] = (char *)drafter;
    argv[n++] = "--batch";
    argv[n++] = (char *)batch;
    argv[n++] = "--out";
    argv[n++] = (char *)out;
    argv[n++] = "--device";
    argv[n++] = (char *)device;
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    if (gamma) {
        argv[n++] = "--loss-decay-gamma";
        argv[n++] = (char *)gamma;
    }
    if (target) {
        argv[n++] = "--target";
        argv[n++] = (char *)target;
    }
    if (sel_alpha) {
        argv[n++] = "--selector-alpha";
        argv[n++] = (char *)sel_alpha;
    }
    if (sel_miss) {
        argv[n++] = "--selector-miss";
        argv[n++] = (char *)sel_miss;
    }
    argv[n] = NULL;
    return tst_run(argv, err);
}

static double scalar(const cm_st_tensor *t) {
    double v = NAN;
    if (t && t->shape[0] == 1 && cm_dtype_is_float(t->dtype))
        cm_convert(&v, CM_DTYPE_F64, t->data, t->dtype, 1);
    return v;
}

/* Relative L2 of an F32 tensor against an F64 one (both possibly unaligned in the file). */
static double rel_l2(const cm_st_tensor *got, const cm_st_tensor *ref, long n) {
    float  *g = malloc((size_t)n * sizeof *g);
    double *r = malloc((size_t)n * sizeof *r);
    double  e = INFINITY;
    if (g && r && cm_convert(g, CM_DTYPE_F32, got->data, got->dtype, (size_t)n) == CM_OK &&
        cm_convert(r, CM_DTYPE_F64, ref->data, ref->dtype, (size_t)n) == CM_OK)
        e = tst_rel_l2(g, r, n);
    free(g);
    free(r);
    return e;
}

static int same_i32(const cm_st_tensor *a, const cm_st_tensor *b) {
    return a && b && a->dtype == CM_DTYPE_I32 && b->dtype == CM_DTYPE_I32 && a->n_dims == 1 &&
           b->n_dims == 1 && a->shape[0] == b->shape[0] &&
           memcmp(a->data, b->data, (size_t)a->shape[0] * 4) == 0;
}

/* Compares one grad output with the fixture's reference. */
static void compare(const char *name, const char *out, const char *ref_path, double loss_tol,
                    double grad_tol) {
    cm_st *ref = NULL, *got = NULL;
    TST_CHECK(cm_st_open_file(&ref, ref_path) == CM_OK);
    TST_CHECK(cm_st_open_file(&got, out) == CM_OK);
    if (!ref || !got) {
        fprintf(stderr, "%s: %s\n", name, cm_last_error());
        goto done;
    }
    double loss_ref = scalar(cm_st_find(ref, "loss")), loss_got = scalar(cm_st_find(got, "loss"));
    double loss_err = fabs(loss_got - loss_ref) / fabs(loss_ref);
    TST_CHECK(loss_err <= loss_tol);
    if (!(loss_err <= loss_tol))
        fprintf(stderr, "%s: loss %.9g, reference %.12g\n", name, loss_got, loss_ref);
    double tau_ref = scalar(cm_st_find(ref, "tau")), tau_got = scalar(cm_st_find(got, "tau"));
    TST_CHECK(fabs(tau_got - tau_ref) <= 1e-6 * tau_ref);
    if (!(fabs(tau_got - tau_ref) <= 1e-6 * tau_ref))
        fprintf(stderr, "%s: tau %.9g, reference %.9g\n", name, tau_got, tau_ref);
    TST_CHECK(same_i32(cm_st_find(got, "acc_hits"), cm_st_find(ref, "acc_hits")));
    TST_CHECK(same_i32(cm_st_find(got, "acc_count"), cm_st_find(ref, "acc_count")));
    if (cm_st_find(ref, "loss_selector")) { /* DFlash2: both terms, the selector's figures */
        static const char *const terms[2] = {"loss_unary", "loss_selector"};
        for (int k = 0; k < 2; k++) {
            const double r = scalar(cm_st_find(ref, terms[k])), g = scalar(cm_st_find(got, terms[k]));
            const double e = fabs(g - r) / fmax(fabs(r), 1e-30);
            TST_CHECK(e <= loss_tol);
            if (!(e <= loss_tol))
                fprintf(stderr, "%s: %s %.9g, reference %.12g\n", name, terms[k], g, r);
        }
        const double st_ref = scalar(cm_st_find(ref, "sel_tau")), st_got = scalar(cm_st_find(got, "sel_tau"));
        TST_CHECK(fabs(st_got - st_ref) <= 1e-6 * st_ref);
        if (!(fabs(st_got - st_ref) <= 1e-6 * st_ref))
            fprintf(stderr, "%s: sel_tau %.9g, reference %.9g\n", name, st_got, st_ref);
        TST_CHECK(same_i32(cm_st_find(got, "sel_in_topk"), cm_st_find(ref, "sel_in_topk")));
        TST_CHECK(same_i32(cm_st_find(got, "sel_hits"), cm_st_find(ref, "sel_hits")));
        printf("%-30s loss_unary %.9f  loss_selector %.9f  sel_tau %.4f\n", name,
               scalar(cm_st_find(got, "loss_unary")), scalar(cm_st_find(got, "loss_selector")), st_got);
    }

    double      worst = 0;
    const char *worst_name = "";
    int         n_ref = 0, n_got = 0;
    for (int i = 0; i < cm_st_count(got); i++)
        n_got += strncmp(cm_st_at(got, i)->name, "grad.", 5) == 0;
    for (int i = 0; i < cm_st_count(ref); i++) {
        const cm_st_tensor *r = cm_st_at(ref, i);
        if (strncmp(r->name, "grad.", 5) != 0)
            continue;
        n_ref++;
        const cm_st_tensor *g = cm_st_find(got, r->name);
        TST_CHECK(g != NULL);
        if (!g) {
            fprintf(stderr, "%s: the output lacks '%s'\n", name, r->name);
            continue;
        }
        int same_shape = g->dtype == CM_DTYPE_F32 && g->n_dims == r->n_dims;
        for (int d = 0; same_shape && d < r->n_dims; d++)
            same_shape = g->shape[d] == r->shape[d];
        TST_CHECK(same_shape);
        if (!same_shape)
            continue;
        long   n = (long)(r->nbytes / cm_dtype_size(r->dtype));
        double e = rel_l2(g, r, n);
        TST_CHECK(e <= grad_tol);
        if (!(e <= grad_tol))
            fprintf(stderr, "%s: %s relative L2 %.3e > %.0e\n", name, r->name, e, grad_tol);
        if (!(e <= worst)) {
            worst = e;
            worst_name = r->name;
        }
    }
    TST_CHECK(n_ref >= 14 && n_got == n_ref);
    printf("%-30s loss %.9f (rel err %.1e)  tau %.4f  %2d grads, worst rel L2 %.2e (%s)\n", name, loss_got,
           loss_err, tau_got, n_ref, worst, worst_name);
done:
    cm_st_destroy(&ref);
    cm_st_destroy(&got);
}

static void check_fixture(const char *root, const char *name, const char *device, double loss_tol,
                          double grad_tol) {
    char drafter[1200], batch[1200], ref_path[1200], out[256], err[256], gamma[64] = "";
    snprintf(drafter, sizeof drafter, "%s/%s/drafter", root, name);
    snprintf(batch, sizeof batch, "%s/%s/batch.safetensors", root, name);
    snprintf(ref_path, sizeof ref_path, "%s/%s/ref.safetensors", root, name);
    snprintf(out, sizeof out, "%s/%s.safetensors", tmp, name);
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    cm_st *ref = NULL;
    TST_CHECK(cm_st_open_file(&ref, ref_path) == CM_OK);
    if (!ref)
        return;
    const char         *g = cm_st_metadata(ref, "gamma");
    const cm_st_tensor *hits = cm_st_find(ref, "acc_hits");
    TST_CHECK(g != NULL && hits != NULL);
    if (g && hits && atof(g) != default_gamma(hits->shape[0]))
        snprintf(gamma, sizeof gamma, "%s", g);
    char        alpha[64] = "", miss[16] = "";
    const char *a = cm_st_metadata(ref, "selector_alpha"), *mp = cm_st_metadata(ref, "selector_miss");
    if (a && atof(a) != 1.0)
        snprintf(alpha, sizeof alpha, "%s", a);
    if (mp && strcmp(mp, "inject") != 0)
        snprintf(miss, sizeof miss, "%s", mp);
    sel_alpha = alpha[0] ? alpha : NULL;
    sel_miss = miss[0] ? miss : NULL;
    cm_st_destroy(&ref);
    int rc = run_grad(drafter, batch, out, device, gamma[0] ? gamma : NULL, NULL, err);
    sel_alpha = sel_miss = NULL;
    TST_CHECK(rc == 0);
    if (rc != 0) {
        fprintf(stderr, "%s: grad exited %d:\n%s\n", name, rc, tst_slurp(err));
        return;
    }
    compare(name, out, ref_path, loss_tol, grad_tol);
}

// ---- the --target path: embed_tokens and lm_head from a Qwen3.5 target directory

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    TST_CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void check_target_path(const char *root, const char *name) {
    char batch[1200], drafter[1200], out_a[256], out_b[256], err[256], dir[256], path[512];
    snprintf(batch, sizeof batch, "%s/%s/batch.safetensors", root, name);
    snprintf(drafter, sizeof drafter, "%s/%s/drafter", root, name);
    snprintf(out_a, sizeof out_a, "%s/with-batch.safetensors", tmp);
    snprintf(out_b, sizeof out_b, "%s/with-target.safetensors", tmp);
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    snprintf(dir, sizeof dir, "%s/target", tmp);
    mkdir(dir, 0755);
    cm_st        *in = NULL;
    cm_st_writer *wt = NULL, *wb = NULL;
    TST_CHECK(cm_st_open_file(&in, batch) == CM_OK);
    TST_CHECK(cm_st_writer_create(&wt) == CM_OK && cm_st_writer_create(&wb) == CM_OK);
    const cm_st_tensor *e = in ? cm_st_find(in, "embed_tokens") : NULL,
                       *h = in ? cm_st_find(in, "lm_head") : NULL;
    const cm_st_tensor *th = in ? cm_st_find(in, "target_hidden") : NULL;
    TST_CHECK(e && h && th);
    if (!e || !h || !th || !wt || !wb)
        goto done;
    for (int i = 0; i < cm_st_count(in); i++) { /* the batch without the frozen matrices */
        const cm_st_tensor *t = cm_st_at(in, i);
        if (t != e && t != h)
            TST_CHECK(cm_st_writer_add(wb, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
    }
    char batch_b[512];
    snprintf(batch_b, sizeof batch_b, "%s/batch-no-frozen.safetensors", tmp);
    TST_CHECK(cm_st_writer_write(wb, batch_b) == CM_OK);
    TST_CHECK(cm_st_writer_add(wt, "model.embed_tokens.weight", e->dtype, 2, e->shape, e->data) == CM_OK);
    TST_CHECK(cm_st_writer_add(wt, "lm_head.weight", h->dtype, 2, h->shape, h->data) == CM_OK);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    TST_CHECK(cm_st_writer_write(wt, path) == CM_OK);
    /* a flat Qwen3.5 config of the drafter's hidden size and vocabulary, enough layers for the taps */
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"Qwen3_5ForCausalLM\"], \"model_type\": \"qwen3_5_text\", "
             "\"hidden_size\": %lld,"
             " \"num_hidden_layers\": 12, \"intermediate_size\": 64, \"vocab_size\": %lld,"
             " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, \"rope_theta\": "
             "1000000.0,"
             " \"partial_rotary_factor\": 0.25, \"full_attention_interval\": 2, \"linear_num_key_heads\": 2,"
             " \"linear_num_value_heads\": 4, \"linear_key_head_dim\": 8, \"linear_value_head_dim\": 16,"
             " \"linear_conv_kernel_dim\": 4, \"rms_norm_eps\": 1e-06, \"tie_word_embeddings\": false,"
             " \"hidden_act\": \"silu\"}\n",
             (long long)e->shape[1], (long long)e->shape[0]);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, cfg);
    int rc_a = run_grad(drafter, batch, out_a, "cpu", NULL, NULL, err);
    int rc_b = run_grad(drafter, batch_b, out_b, "cpu", NULL, dir, err);
    TST_CHECK(rc_a == 0 && rc_b == 0);
    if (rc_b != 0)
        fprintf(stderr, "grad with --target exited %d:\n%s\n", rc_b, tst_slurp(err));
    if (rc_a == 0 && rc_b == 0) {
        cm_st *a = NULL, *b = NULL;
        TST_CHECK(cm_st_open_file(&a, out_a) == CM_OK && cm_st_open_file(&b, out_b) == CM_OK);
        int same = a && b && cm_st_count(a) == cm_st_count(b);
        for (int i = 0; same && i < cm_st_count(a); i++) {
            const cm_st_tensor *x = cm_st_at(a, i), *y = cm_st_find(b, x->name);
            same = y && x->nbytes == y->nbytes && memcmp(x->data, y->data, x->nbytes) == 0;
        }
        TST_CHECK(same);
        printf("%-30s embed_tokens and lm_head from --target: %s\n", name,
               same ? "bit-identical output" : "OUTPUT DIFFERS");
        cm_st_destroy(&a);
        cm_st_destroy(&b);
    }
done:
    cm_st_writer_destroy(&wt);
    cm_st_writer_destroy(&wb);
    cm_st_destroy(&in);
}

// ---- the dt_model API: reuse across steps, empty batches, parameters, initialisation

typedef struct host_batch {
    cm_st   *st;
    int32_t *ids, *cu, *mask, *anchors;
    float   *F;
    int64_t  T, n_cu, n_anchors;
} host_batch;

static int32_t *i32_copy(const cm_st *st, const char *name, int64_t *n) {
    const cm_st_tensor *t = cm_st_find(st, name);
    TST_CHECK(t && t->dtype == CM_DTYPE_I32 && t->n_dims == 1);
    if (!t)
        return NULL;
    *n = t->shape[0];
    int32_t *v = malloc((size_t)(*n + 1) * sizeof *v);
    memcpy(v, t->data, (size_t)*n * sizeof *v);
    return v;
}

static void host_batch_load(host_batch *b, const char *path) {
    memset(b, 0, sizeof *b);
    TST_CHECK(cm_st_open_file(&b->st, path) == CM_OK);
    if (!b->st)
        return;
    int64_t n;
    b->ids = i32_copy(b->st, "input_ids", &b->T);
    b->cu = i32_copy(b->st, "cu_seqlens", &b->n_cu);
    b->mask = i32_copy(b->st, "loss_mask", &n);
    b->anchors = i32_copy(b->st, "anchors", &b->n_anchors);
    const cm_st_tensor *th = cm_st_find(b->st, "target_hidden");
    TST_CHECK(th != NULL);
    if (!th)
        return;
    b->F = malloc((size_t)(th->shape[0] * th->shape[1]) * sizeof *b->F);
    TST_CHECK(cm_st_read(b->st, "target_hidden", 2, th->shape, b->F, CM_DTYPE_F32) == CM_OK);
}

static void host_batch_free(host_batch *b) {
    free(b->ids);
    free(b->cu);
    free(b->mask);
    free(b->anchors);
    free(b->F);
    cm_st_destroy(&b->st);
}

static dt_batch view(const host_batch *b, int64_t n_anchors, const int32_t *mask) {
    dt_batch v = {.T = b->T,
                  .n_seq = (int)(b->n_cu - 1),
                  .cu_seqlens = b->cu,
                  .input_ids = b->ids,
                  .loss_mask = mask ? mask : b->mask,
                  .target_hidden = b->F,
                  .n_anchors = n_anchors,
                  .anchors = b->anchors};
    return v;
}

/* All gradients of m, concatenated. */
static int all_zero(const float *g, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (g[i] != 0.0f)
            return 0;
    return 1;
}

/* One fixture's step with F32 and with BF16 saved activations on the cpu (BF16 storage as cuda
 * --precision bf16 plans it: its slots, spans and work region at this fixture's shapes): the
 * loss within 1e-2 and every gradient within 5e-2 relative L2 (issue 7's bars for the cuda step
 * against the oracle), and not equal (the storage is in effect). */
static void check_bf16_storage(const char *root, const char *name) {
    char dir[1200], path[1200];
    snprintf(dir, sizeof dir, "%s/%s/drafter", root, name);
    snprintf(path, sizeof path, "%s/%s/batch.safetensors", root, name);
    cm_drafter_cfg cfg;
    TST_CHECK(cm_drafter_cfg_load(&cfg, dir) == CM_OK);
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    host_batch        hb;
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    TST_CHECK(dt_model_create(&m, &cfg, be, ctx) == CM_OK && dt_model_load(m, dir) == CM_OK);
    host_batch_load(&hb, path);
    const cm_st_tensor *e = hb.st ? cm_st_find(hb.st, "embed_tokens") : NULL,
                       *h = hb.st ? cm_st_find(hb.st, "lm_head") : NULL;
    TST_CHECK(m && hb.F && e && h);
    if (m && hb.F && e && h) {
        TST_CHECK(dt_model_set_frozen(m, e->data, e->dtype, h->data, h->dtype, e->shape[0], e->shape[1]) ==
                  CM_OK);
        const dt_batch b = view(&hb, hb.n_anchors, NULL);
        dt_step_stats  s32, s16;
        /* DFlash2: the selector term off here. Its top-K is a discontinuous choice: the bf16 roundings move
         * near-tie logits across the K-th place and a changed candidate set changes the gradient of the
         * whole stack, which is no measure of the storage path (the selector's numerics are checked
         * against the oracle above and on cuda). */
        const dt_selector_opts no_sel = {0.0, KN_SEL_INJECT, 0};
        if (cfg.kind == CM_DRAFTER_DFLASH2)
            TST_CHECK(dt_model_set_selector(m, &no_sel) == CM_OK);
        int64_t        n32 = 0, n16 = 0;
        TST_CHECK(dt_model_step(m, &b, (float)default_gamma(cfg.block_size), &s32) == CM_OK);
        float *g32 = tst_dt_grads(m, be, ctx, &n32);
        TST_CHECK(dt_model_set_act_dtype(m, CM_DTYPE_BF16) == CM_OK);
        TST_CHECK(dt_model_step(m, &b, (float)default_gamma(cfg.block_size), &s16) == CM_OK);
        float  *g16 = tst_dt_grads(m, be, ctx, &n16);
        double      worst = 0;
        const char *worst_name = "";
        int64_t     o = 0;
        for (int i = 0; i < dt_model_n_params(m) && n16 == n32; i++) {
            const dt_param *p = dt_model_param(m, i);
            double          num = 0, den = 0;
            for (int64_t j = 0; j < p->numel; j++) {
                const double d = (double)g16[o + j] - (double)g32[o + j];
                num += d * d;
                den += (double)g32[o + j] * g32[o + j];
            }
            const double err = den > 0 ? sqrt(num / den) : sqrt(num);
            if (err > worst)
                worst = err, worst_name = p->name;
            o += p->numel;
        }
        const double loss_err = fabs(s16.loss - s32.loss) / fabs(s32.loss);
        TST_CHECK(n16 == n32 && loss_err <= 1e-2 && worst <= 5e-2 && loss_err > 0);
        printf("%-30s BF16 saved activations (cpu): loss rel err %.1e, worst grad rel L2 %.2e (%s)\n", name,
               loss_err, worst, worst_name);
        free(g32);
        free(g16);
    }
    host_batch_free(&hb);
    dt_model_destroy(&m);
    be->ctx_destroy(&ctx);
}

static void check_model_api(const char *root, const char *name, const char *cli_out) {
    char dir[1200], path[1200];
    snprintf(dir, sizeof dir, "%s/%s/drafter", root, name);
    snprintf(path, sizeof path, "%s/%s/batch.safetensors", root, name);
    cm_drafter_cfg cfg;
    TST_CHECK(cm_drafter_cfg_load(&cfg, dir) == CM_OK);
    const kn_backend *be = kn_backend_cpu();
    kn_ctx           *ctx = NULL;
    dt_model         *m = NULL;
    host_batch        hb;
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    TST_CHECK(dt_model_create(&m, &cfg, be, ctx) == CM_OK);
    host_batch_load(&hb, path);
    if (!m || !hb.F)
        goto done;
    dt_step_stats  s_full, s_half, s;
    const dt_batch full = view(&hb, hb.n_anchors, NULL), half = view(&hb, hb.n_anchors / 2, NULL);

    /* a table without the drafter kernels is refused with the clear message */
    {
        kn_backend partial = *be;
        partial.name = "partial";
        partial.dflash_attn_bwd = NULL;
        dt_model *p = NULL;
        TST_CHECK(dt_model_create(&p, &cfg, &partial, ctx) == CM_ERR_UNSUPPORTED && p == NULL);
        TST_CHECK(strstr(cm_last_error(),
                         "the partial backend has no drafter kernels yet (no dflash_attn_bwd; "
                         "use --device cpu)") != NULL);
    }
    /* the parameter table: serving-key order, 11 per layer */
    TST_CHECK(dt_model_n_params(m) == 3 + 11 * cfg.n_layers);
    TST_CHECK(strcmp(dt_model_param(m, 0)->name, "fc.weight") == 0);
    TST_CHECK(strcmp(dt_model_param(m, 1)->name, "hidden_norm.weight") == 0);
    TST_CHECK(strcmp(dt_model_param(m, 2)->name, "layers.0.input_layernorm.weight") == 0);
    TST_CHECK(strcmp(dt_model_param(m, 12)->name, "layers.0.mlp.down_proj.weight") == 0);
    TST_CHECK(strcmp(dt_model_param(m, dt_model_n_params(m) - 1)->name, "norm.weight") == 0);
    TST_CHECK(dt_model_find_param(m, "layers.1.self_attn.k_norm.weight") != NULL);
    TST_CHECK(dt_model_find_param(m, "lm_head.weight") == NULL);
    TST_CHECK(dt_model_param(m, -1) == NULL && dt_model_param(m, dt_model_n_params(m)) == NULL);

    /* a step needs the frozen matrices and a positive gamma */
    TST_CHECK(dt_model_step(m, &full, 7.0f, &s) == CM_ERR_INVALID_ARG);
    TST_CHECK(dt_model_load(m, dir) == CM_OK);
    const cm_st_tensor *e = cm_st_find(hb.st, "embed_tokens"), *h = cm_st_find(hb.st, "lm_head");
    TST_CHECK(e && h);
    if (!e || !h)
        goto done;
    TST_CHECK(dt_model_set_frozen(m, e->data, e->dtype, h->data, h->dtype, e->shape[0], e->shape[1] + 1) ==
              CM_ERR_INVALID_ARG);
    TST_CHECK(dt_model_set_frozen(m, e->data, e->dtype, h->data, h->dtype, e->shape[0], e->shape[1]) ==
              CM_OK);
    TST_CHECK(dt_model_step(m, &full, 0.0f, &s) == CM_ERR_INVALID_ARG);

    /* growing and reusing the buffers: half, full (grows), half, full again */
    float  gamma = (float)default_gamma(cfg.block_size); /* the fixture's, as the command line ran */
    cm_st *ref = NULL;
    snprintf(path, sizeof path, "%s/%s/ref.safetensors", root, name);
    TST_CHECK(cm_st_open_file(&ref, path) == CM_OK);
    if (ref && cm_st_metadata(ref, "gamma"))
        gamma = (float)atof(cm_st_metadata(ref, "gamma"));
    cm_st_destroy(&ref);
    int64_t n_g;
    TST_CHECK(dt_model_step(m, &half, gamma, &s_half) == CM_OK);
    float *g_half = tst_dt_grads(m, be, ctx, &n_g);
    TST_CHECK(dt_model_step(m, &full, gamma, &s_full) == CM_OK);
    float *g_full = tst_dt_grads(m, be, ctx, &n_g);
    TST_CHECK(dt_model_step(m, &half, gamma, &s) == CM_OK);
    float *g = tst_dt_grads(m, be, ctx, &n_g);
    TST_CHECK(memcmp(g, g_half, (size_t)n_g * sizeof *g) == 0 && memcmp(&s, &s_half, sizeof s) == 0);
    free(g);
    TST_CHECK(dt_model_step(m, &full, gamma, &s) == CM_OK);
    g = tst_dt_grads(m, be, ctx, &n_g);
    TST_CHECK(memcmp(g, g_full, (size_t)n_g * sizeof *g) == 0 && memcmp(&s, &s_full, sizeof s) == 0);
    free(g);
    TST_CHECK(s_full.n_blocks == hb.n_anchors && s_half.n_blocks == hb.n_anchors / 2);
    TST_CHECK(s_full.weight_sum > s_half.weight_sum && s_half.weight_sum > 0);
    /* the same bits as the command line's fresh model (which had not grown anything) */
    cm_st *cli = NULL;
    TST_CHECK(cm_st_open_file(&cli, cli_out) == CM_OK);
    int64_t off = 0, same = cli != NULL;
    for (int i = 0; cli && i < dt_model_n_params(m); i++) {
        const dt_param *p = dt_model_param(m, i);
        char            key[128];
        snprintf(key, sizeof key, "grad.%s", p->name);
        const cm_st_tensor *t = cm_st_find(cli, key);
        same =
            same && t && t->nbytes == (size_t)p->numel * 4 && memcmp(t->data, g_full + off, t->nbytes) == 0;
        off += p->numel;
    }
    TST_CHECK(same);
    cm_st_destroy(&cli);

    /* no anchors: loss 0, zero gradients, no blocks */
    const dt_batch none = view(&hb, 0, NULL);
    TST_CHECK(dt_model_step(m, &none, gamma, &s) == CM_OK);
    g = tst_dt_grads(m, be, ctx, &n_g);
    TST_CHECK(all_zero(g, n_g) && s.loss == 0 && s.weight_sum == 0 && s.n_blocks == 0 && s.tau == 0);
    free(g);
    /* anchors but no label (loss_mask all 0): loss 0, zero gradients, tau 1 */
    int32_t       *zeros = calloc((size_t)hb.T, sizeof *zeros);
    const dt_batch unlabeled = view(&hb, hb.n_anchors, zeros);
    TST_CHECK(dt_model_step(m, &unlabeled, gamma, &s) == CM_OK);
    g = tst_dt_grads(m, be, ctx, &n_g);
    TST_CHECK(all_zero(g, n_g) && s.loss == 0 && s.weight_sum == 0 && s.n_blocks == hb.n_anchors &&
              s.tau == 1.0);
    free(g);
    free(zeros);
    printf("%-30s dt_model API: reuse across steps bit-identical, empty batches zero, %d parameters\n", name,
           dt_model_n_params(m));

    /* BF16 saved activations (what cuda --precision bf16 stores) on the cpu: the same step
     * within bf16 rounding of the F32 one, and a re-plan keeps the results */
    TST_CHECK(dt_model_act_dtype(m) == CM_DTYPE_F32);
    TST_CHECK(dt_model_set_act_dtype(m, CM_DTYPE_I32) == CM_ERR_UNSUPPORTED);
    {
        const size_t f32_bytes = dt_model_act_bytes(m);
        TST_CHECK(dt_model_set_act_dtype(m, CM_DTYPE_BF16) == CM_OK);
        TST_CHECK(dt_model_act_dtype(m) == CM_DTYPE_BF16);
        const size_t bf16_bytes = dt_model_act_bytes(m);
        TST_CHECK(bf16_bytes > 0 && bf16_bytes < f32_bytes);
        dt_step_stats s_bf;
        TST_CHECK(dt_model_step(m, &full, gamma, &s_bf) == CM_OK);
        g = tst_dt_grads(m, be, ctx, &n_g);
        double  worst = 0, num = 0, den = 0;
        int64_t o = 0;
        for (int i = 0; i < dt_model_n_params(m); i++) {
            const dt_param *p = dt_model_param(m, i);
            num = den = 0;
            for (int64_t j = 0; j < p->numel; j++) {
                const double d = (double)g[o + j] - (double)g_full[o + j];
                num += d * d;
                den += (double)g_full[o + j] * g_full[o + j];
            }
            const double err = den > 0 ? sqrt(num / den) : sqrt(num);
            worst = err > worst ? err : worst;
            o += p->numel;
        }
        const double loss_err = fabs(s_bf.loss - s_full.loss) / s_full.loss;
        TST_CHECK(loss_err <= 1e-2 && worst <= 5e-2);
        TST_CHECK(s_bf.n_blocks == s_full.n_blocks && s_bf.weight_sum == s_full.weight_sum);
        TST_CHECK(loss_err > 0); /* the storage did change something */
        dt_step_stats s2;
        TST_CHECK(dt_model_step(m, &half, gamma, &s2) == CM_OK &&
                  dt_model_step(m, &full, gamma, &s2) == CM_OK);
        float *g2 = tst_dt_grads(m, be, ctx, &n_g);
        TST_CHECK(memcmp(g, g2, (size_t)n_g * sizeof *g) == 0 && s2.loss == s_bf.loss);
        free(g2);
        free(g);
        /* device BF16 taps (one array per tap) and host features holding the same values: the
         * same bits (fc runs tap by tap on both paths) */
        {
            const int64_t T = hb.T, D = cfg.hidden_size, nT = cfg.n_taps;
            float        *Fw = malloc((size_t)(T * nT * D) * sizeof *Fw);
            uint16_t     *taps = malloc((size_t)(T * nT * D) * sizeof *taps);
            for (int64_t t = 0; t < T; t++)
                for (int64_t k = 0; k < nT; k++)
                    for (int64_t c = 0; c < D; c++) {
                        const uint16_t v = cm_f32_to_bf16(hb.F[(t * nT + k) * D + c]);
                        taps[(k * T + t) * D + c] = v;
                        Fw[(t * nT + k) * D + c] = cm_bf16_to_f32(v);
                    }
            dt_batch host = full, dev = full;
            host.target_hidden = Fw;
            dev.target_hidden = NULL;
            dev.taps_dt = CM_DTYPE_BF16;
            for (int64_t k = 0; k < nT; k++)
                dev.dev_taps[k] = taps + k * T * D;
            dt_step_stats sh, sd;
            TST_CHECK(dt_model_step(m, &host, gamma, &sh) == CM_OK);
            float *gh = tst_dt_grads(m, be, ctx, &n_g);
            TST_CHECK(dt_model_step(m, &dev, gamma, &sd) == CM_OK);
            float *gd = tst_dt_grads(m, be, ctx, &n_g);
            TST_CHECK(memcmp(gh, gd, (size_t)n_g * sizeof *gh) == 0 && sh.loss == sd.loss);
            TST_CHECK(sh.loss == s_bf.loss); /* host features are rounded to BF16 on upload anyway */
            free(gh), free(gd), free(Fw), free(taps);
        }
        TST_CHECK(dt_model_set_act_dtype(m, CM_DTYPE_F32) == CM_OK &&
                  dt_model_step(m, &full, gamma, &s2) == CM_OK);
        g = tst_dt_grads(m, be, ctx, &n_g);
        TST_CHECK(memcmp(g, g_full, (size_t)n_g * sizeof *g) == 0 && s2.loss == s_full.loss);
        free(g);
        printf("%-30s BF16 saved activations (cpu): %zu vs %zu bytes, loss rel err %.1e, worst grad rel L2 "
               "%.2e\n",
               name, bf16_bytes, f32_bytes, loss_err, worst);
    }
    free(g_half);
    free(g_full);

    /* seeded initialisation: same seed, same bits; norms 1; matrices N(0, 0.02) */
    {
        dt_model *a = NULL, *b = NULL;
        TST_CHECK(dt_model_create(&a, &cfg, be, ctx) == CM_OK && dt_model_create(&b, &cfg, be, ctx) == CM_OK);
        if (a && b) {
            TST_CHECK(dt_model_init_random(a, 42) == CM_OK && dt_model_init_random(b, 42) == CM_OK);
            const dt_param *pa = dt_model_find_param(a, "fc.weight"),
                           *pb = dt_model_find_param(b, "fc.weight");
            TST_CHECK(memcmp(pa->data, pb->data, (size_t)pa->numel * 4) == 0);
            double sum = 0, sq = 0;
            for (int64_t i = 0; i < pa->numel; i++) {
                sum += pa->data[i];
                sq += (double)pa->data[i] * pa->data[i];
            }
            double mean = sum / (double)pa->numel, sd = sqrt(sq / (double)pa->numel - mean * mean);
            TST_CHECK(fabs(mean) < 0.002 && fabs(sd - 0.02) < 0.002);
            const dt_param *nw = dt_model_find_param(a, "layers.0.post_attention_layernorm.weight");
            int             ones = 1;
            for (int64_t i = 0; i < nw->numel; i++)
                ones = ones && nw->data[i] == 1.0f;
            TST_CHECK(ones);
            TST_CHECK(dt_model_init_random(b, 43) == CM_OK);
            TST_CHECK(memcmp(pa->data, pb->data, (size_t)pa->numel * 4) != 0);
            printf("%-30s init_random: fc.weight mean %.5f sd %.5f, norms 1, seeded\n", name, mean, sd);
        }
        dt_model_destroy(&a);
        dt_model_destroy(&b);
    }
done:
    host_batch_free(&hb);
    dt_model_destroy(&m);
    dt_model_destroy(&m); /* NULL-safe */
    be->ctx_destroy(&ctx);
}

// ---- cuda: a larger random drafter through the dt_model API, cpu against cuda

int main(int argc, char **argv) {
    const char *device = argc > 1 ? argv[1] : "cpu";
    double      loss_tol = 1e-5, grad_tol = 1e-4;
    if (strcmp(device, "cuda") == 0) {
        tst_need_cuda();
        loss_tol = 1e-2; /* issue 7's limits for the cuda step against the float64 oracle */
        grad_tol = 5e-2;
    }
    snprintf(bin, sizeof bin, "%s/drafter-trainer/drafter-trainer", TANDEM_BINARY_DIR);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-dtgrad-XXXXXX");
    TST_CHECK(mkdtemp(tmp) != NULL);
    char root[1024], root2[1024];
    snprintf(root, sizeof root, "%s/fixtures/drafter", TANDEM_TEST_DATA);
    snprintf(root2, sizeof root2, "%s/fixtures/drafter2", TANDEM_TEST_DATA);
    char *names[64], *names2[64];
    int   n = tst_dt_fixtures(root, names), n2 = tst_dt_fixtures(root2, names2);
    TST_CHECK(n >= 3 && n2 >= 3);
    for (int i = 0; i < n; i++)
        check_fixture(root, names[i], device, loss_tol, grad_tol);
    for (int i = 0; i < n2; i++) /* DFlash2 (tests/oracle/make_dflash2_fixtures.py) */
        check_fixture(root2, names2[i], device, loss_tol, grad_tol);
    if (strcmp(device, "cpu") == 0)
        for (int i = 0; i < n2; i++)
            check_bf16_storage(root2, names2[i]);
    for (int i = 0; i < n2; i++)
        free(names2[i]);
    if (strcmp(device, "cpu") == 0 && n > 0) {
        check_target_path(root, names[0]);
        char out[256];
        snprintf(out, sizeof out, "%s/%s.safetensors", tmp, names[n - 1]);
        check_model_api(root, names[n - 1], out);
        for (int i = 0; i < n; i++)
            check_bf16_storage(root, names[i]);
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    TST_CHECK(tst_rmdir(tmp));
    return tst_report();
}
