/* tests/test_ts_fp8_load.c — FP8 checkpoints (docs/fp8.md), made here from the committed bf16
 * fixtures by quantizing their projections in C as Transformers' Fp8Quantize does (128 × 128
 * blocks, scale = amax / 448), with Qwen's quantization_config:
 *   - fp8 = 0 dequantizes on load: the forward equals, bit for bit, the forward of the same
 *     weights written dequantized as a bf16 checkpoint (BF16 and F16 scales upcast);
 *   - fp8 = 1 keeps them FP8: the forward runs on the cpu, close to the dequantized one (only the
 *     activations' quantization differs), and a bf16 checkpoint quantized on load gives the same
 *     forward as the FP8 checkpoint made from it (F32 scales);
 *   - every bad checkpoint ends `target-server dump` with exit 1 and one line naming the tensor;
 *   - an FP8 checkpoint runs at precision fp8 unless --precision says otherwise;
 *   - MoE experts per expert, and Qwen3-Next's fused in_proj_qkvz (rows un-interleaved at load with
 *     their block scales), load the same way.
 * The fixture with hidden 40 is the dequantization case; fp8 GEMMs need input widths that are
 * multiples of 16, so the fp8 cases use the one with hidden 64 (ragged 128-blocks either way). */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cm_cfg.h"
#include "cm_safetensors.h"
#include "kn_backend.h"
#include "ts_model.h"
#include "tst.h"
#include "tst_proc.h"

#define FIX TANDEM_TEST_DATA "/fixtures/target"

static char tmp[64];
static char bin[1024];

// ----------------------------------------------------------------------------
// making FP8 checkpoints

/* The projections Qwen's FP8 releases quantize (the MLP's, and a MoE block's experts and shared
 * expert: every gate/up/down_proj; the router mlp.gate and shared_expert_gate stay bf16). */
static int quantized_name(const char *name) {
    static const char *const suffixes[] = {
        ".gate_proj.weight",             ".up_proj.weight",            ".down_proj.weight",
        ".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight", ".linear_attn.out_proj.weight",
        ".self_attn.q_proj.weight",      ".self_attn.k_proj.weight",   ".self_attn.v_proj.weight",
        ".self_attn.o_proj.weight",      ".linear_attn.in_proj_qkvz.weight"};
    if (strncmp(name, "model.language_model.layers.", 28) != 0 && strncmp(name, "model.layers.", 13) != 0) return 0;
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        size_t n = strlen(name), k = strlen(suffixes[i]);
        if (n > k && strcmp(name + n - k, suffixes[i]) == 0) return 1;
    }
    return 0;
}

/* w [N, K] → q [N, K] e4m3 and scale [ceil(N/128), ceil(K/128)] as kn_backend.h's
 * fp8_quantize_weight: a = max(amax, 1e-12), r = 448 / a, q = e4m3(clamp(w · r, ±448)), scale = 1 / r. */
static void quantize(const float *w, int64_t N, int64_t K, uint8_t *q, float *scale) {
    const int64_t R = (N + 127) / 128, L = (K + 127) / 128;
    for (int64_t bi = 0; bi < R; bi++)
        for (int64_t bj = 0; bj < L; bj++) {
            float amax = 0;
            for (int64_t n = bi * 128; n < N && n < bi * 128 + 128; n++)
                for (int64_t k = bj * 128; k < K && k < bj * 128 + 128; k++) {
                    float v = fabsf(w[n * K + k]);
                    amax    = v > amax ? v : amax;
                }
            const float a = amax > 1e-12f ? amax : 1e-12f, r = 448.0f / a;
            for (int64_t n = bi * 128; n < N && n < bi * 128 + 128; n++)
                for (int64_t k = bj * 128; k < K && k < bj * 128 + 128; k++) {
                    float v = w[n * K + k] * r;
                    v       = v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v;
                    q[n * K + k] = cm_f32_to_f8e4m3(v);
                }
            scale[bi * L + bj] = 1.0f / r;
        }
}

/* Writes dst/config.json: src's config plus quantization_config (NULL: none) with Qwen's list of
 * unconverted modules for the text model; extra (a JSON object's members, or NULL) replaces fields. */
static void write_config(const char *src, const char *dst, int quant, const char *extra) {
    char path[1200], *text = NULL;
    snprintf(path, sizeof path, "%s/config.json", src);
    TST_CHECK(cm_read_text_file(path, 1 << 20, &text) == CM_OK);
    cJSON *root = cJSON_Parse(text ? text : "{}");
    free(text);
    cm_target_cfg cfg;
    TST_CHECK(cm_target_cfg_load(&cfg, src) == CM_OK);
    if (quant) {
        cJSON *q = cJSON_AddObjectToObject(root, "quantization_config");
        cJSON_AddStringToObject(q, "quant_method", "fp8");
        cJSON_AddStringToObject(q, "fmt", "e4m3");
        cJSON_AddStringToObject(q, "activation_scheme", "dynamic");
        cJSON *bs = cJSON_AddArrayToObject(q, "weight_block_size");
        cJSON_AddItemToArray(bs, cJSON_CreateNumber(128));
        cJSON_AddItemToArray(bs, cJSON_CreateNumber(128));
        cJSON *skip = cJSON_AddArrayToObject(q, "modules_to_not_convert");
        for (int i = 0; i < cfg.n_layers; i++) {
            static const char *const lin[] = {"linear_attn.A_log", "linear_attn.conv1d", "linear_attn.dt_bias",
                                              "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.norm"};
            static const char *const att[] = {"self_attn.q_norm", "self_attn.k_norm"};
            static const char *const nrm[] = {"input_layernorm", "post_attention_layernorm"};
            const int                is_lin = cfg.layer_types[i] == CM_LAYER_TYPE_LINEAR_ATTENTION;
            char                     m[160];
            for (int j = 0; j < 2; j++) {
                snprintf(m, sizeof m, "model.language_model.layers.%d.%s", i, nrm[j]);
                cJSON_AddItemToArray(skip, cJSON_CreateString(m));
            }
            for (int j = 0; j < (is_lin ? 6 : 2); j++) {
                snprintf(m, sizeof m, "model.language_model.layers.%d.%s", i, is_lin ? lin[j] : att[j]);
                cJSON_AddItemToArray(skip, cJSON_CreateString(m));
            }
        }
        cJSON_AddItemToArray(skip, cJSON_CreateString("lm_head"));
        cJSON_AddItemToArray(skip, cJSON_CreateString("model.language_model.embed_tokens"));
        cJSON_AddItemToArray(skip, cJSON_CreateString("model.visual.*"));
        if (extra) {
            cJSON *e = cJSON_Parse(extra);
            TST_CHECK(e != NULL);
            for (cJSON *it = e ? e->child : NULL; it; it = it->next) {
                cJSON_DeleteItemFromObject(q, it->string);
                cJSON_AddItemToObject(q, it->string, cJSON_Duplicate(it, 1));
            }
            cJSON_Delete(e);
        }
    }
    mkdir(dst, 0755);
    snprintf(path, sizeof path, "%s/config.json", dst);
    char *out = cJSON_Print(root);
    FILE *f   = fopen(path, "w");
    TST_CHECK(f && out && fputs(out, f) >= 0);
    if (f) fclose(f);
    free(out);
    cJSON_Delete(root);
}

typedef enum scale_kind { SCALE_F32, SCALE_MIXED /* BF16 and F16, alternating */ } scale_kind;

/* src (a model directory, sharded or not) → dst/model.safetensors with its projections FP8
 * (fp8 = 1) or those same FP8 weights dequantized back to BF16 (fp8 = 0: the reference the
 * dequantizing load must equal). Other tensors are copied as stored. */
static void write_weights(const char *src, const char *dst, int fp8, scale_kind sk) {
    cm_st        *st = NULL;
    cm_st_writer *w  = NULL;
    TST_CHECK(cm_st_open_dir(&st, src) == CM_OK);
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    int n_q = 0;
    for (int i = 0; st && w && i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        if (!quantized_name(t->name)) {
            TST_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
            continue;
        }
        const int64_t N = t->shape[0], K = t->shape[1], R = (N + 127) / 128, L = (K + 127) / 128;
        float        *v = malloc((size_t)(N * K) * 4), *s = malloc((size_t)(R * L) * 4);
        uint8_t      *q = malloc((size_t)(N * K));
        uint16_t     *h = malloc((size_t)(N * K) * 2);
        TST_CHECK(cm_convert(v, CM_DTYPE_F32, t->data, t->dtype, (size_t)(N * K)) == CM_OK);
        quantize(v, N, K, q, s);
        const cm_dtype sdt = sk == SCALE_F32 ? CM_DTYPE_F32 : n_q % 2 ? CM_DTYPE_F16 : CM_DTYPE_BF16;
        if (sdt != CM_DTYPE_F32) { /* the scale as the checkpoint will hold it */
            TST_CHECK(cm_convert(h, sdt, s, CM_DTYPE_F32, (size_t)(R * L)) == CM_OK);
            TST_CHECK(cm_convert(s, CM_DTYPE_F32, h, sdt, (size_t)(R * L)) == CM_OK);
        }
        char          sname[300];
        const int64_t sshape[2] = {R, L};
        snprintf(sname, sizeof sname, "%s_scale_inv", t->name);
        if (fp8) {
            TST_CHECK(cm_st_writer_add(w, t->name, CM_DTYPE_F8_E4M3, 2, t->shape, q) == CM_OK);
            TST_CHECK(cm_st_writer_add(w, sname, sdt, 2, sshape, sdt == CM_DTYPE_F32 ? (void *)s : (void *)h) ==
                      CM_OK);
        } else {
            for (int64_t n = 0; n < N; n++)
                for (int64_t k = 0; k < K; k++)
                    h[n * K + k] = cm_f32_to_bf16(cm_f8e4m3_to_f32(q[n * K + k]) * s[(n / 128) * L + k / 128]);
            TST_CHECK(cm_st_writer_add(w, t->name, CM_DTYPE_BF16, 2, t->shape, h) == CM_OK);
        }
        n_q++;
        free(v);
        free(s);
        free(q);
        free(h);
    }
    TST_CHECK(n_q > 0);
    char path[1200];
    snprintf(path, sizeof path, "%s/model.safetensors", dst);
    TST_CHECK(cm_st_writer_write(w, path) == CM_OK);
    cm_st_writer_destroy(&w);
    cm_st_destroy(&st);
}

/* dst: a copy of src (config and model.safetensors) without tensor drop (NULL: none) and with
 * one tensor added (add_name NULL: none). */
static void rewrite(const char *src, const char *dst, const char *drop, const char *add_name, cm_dtype dt,
                    int n_dims, const int64_t *shape, const void *data) {
    char a[1200], b[1200];
    mkdir(dst, 0755);
    snprintf(a, sizeof a, "cp '%s/config.json' '%s/config.json'", src, dst);
    TST_CHECK(system(a) == 0);
    snprintf(a, sizeof a, "%s/model.safetensors", src);
    snprintf(b, sizeof b, "%s/model.safetensors", dst);
    cm_st        *st = NULL;
    cm_st_writer *w  = NULL;
    TST_CHECK(cm_st_open_file(&st, a) == CM_OK);
    TST_CHECK(cm_st_writer_create(&w) == CM_OK);
    for (int i = 0; st && w && i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        if (!drop || strcmp(t->name, drop) != 0)
            TST_CHECK(cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data) == CM_OK);
    }
    if (add_name) TST_CHECK(cm_st_writer_add(w, add_name, dt, n_dims, shape, data) == CM_OK);
    TST_CHECK(cm_st_writer_write(w, b) == CM_OK);
    cm_st_writer_destroy(&w);
    cm_st_destroy(&st);
}

// ----------------------------------------------------------------------------
// running

typedef struct batch {
    int32_t *ids, *cu; /* malloc'd */
    int64_t  T;
    int      n_seq;
} batch;

/* The fixture's batch (aligned copies); exits when it cannot be read. */
static void read_batch(const char *path, batch *b) {
    cm_st *in = NULL;
    TST_CHECK(cm_st_open_file(&in, path) == CM_OK);
    const cm_st_tensor *ids = in ? cm_st_find(in, "input_ids") : NULL, *cu = in ? cm_st_find(in, "cu_seqlens") : NULL;
    if (!ids || !cu) {
        fprintf(stderr, "cannot read the batch in %s\n", path);
        exit(1);
    }
    b->T     = ids->shape[0];
    b->n_seq = (int)cu->shape[0] - 1;
    b->ids   = malloc((size_t)b->T * 4);
    b->cu    = malloc((size_t)(b->n_seq + 1) * 4);
    memcpy(b->ids, ids->data, (size_t)b->T * 4);
    memcpy(b->cu, cu->data, (size_t)(b->n_seq + 1) * 4);
    cm_st_destroy(&in);
}

/* Loads dir on be (the cpu's table, or a changed copy) and runs the batch: final_norm and
 * logits into fn, lg (T·D, T·V floats). Returns the load's status (the forward's when it loaded). */
static cm_status forward(const kn_backend *be, const char *dir, int fp8, int bf16_weights, const batch *b, float *fn,
                         float *lg) {
    kn_ctx       *ctx = NULL;
    ts_model     *m   = NULL;
    kn_ctx_config kc  = KN_CTX_CONFIG_DEFAULT;
    cm_status     st  = be->ctx_create(&ctx, &kc);
    ts_model_config mc = {.dir = dir, .backend = be, .ctx = ctx, .n_layers = -1, .load_head = 1,
                          .bf16_weights = bf16_weights, .fp8 = fp8};
    if (st == CM_OK) st = ts_model_load(&m, &mc);
    ts_capture cap = {.final_norm = fn, .logits = lg};
    if (st == CM_OK) st = ts_model_forward(m, b->ids, b->T, b->cu, b->n_seq, &cap);
    ts_model_destroy(&m);
    be->ctx_destroy(&ctx);
    return st;
}

static double rel_l2(const float *got, const float *ref, size_t n) {
    double e = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        e += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        r += (double)ref[i] * ref[i];
    }
    return sqrt(e / (r + 1e-300));
}

static int   fp8_ready; /* the cpu backend has the FP8 entries (kernels/ref/kn_fp8_ref.c) */
static char *no_fp8_why = "no FP8 on this device (test)";

static int say_no(const kn_ctx *ctx, char *why, size_t n) {
    (void)ctx;
    snprintf(why, n, "%s", no_fp8_why);
    return 0;
}

/* Runs dump (extra flags after --out) and expects exit 1 with one line on stderr holding n1, n2. */
static void expect_fail(const char *what, const char *model, const char *input, const char *prec, const char *n1,
                        const char *n2) {
    char out[512], err[512];
    snprintf(out, sizeof out, "%s/out.safetensors", tmp);
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    char *argv[] = {bin,  "dump", "--model", (char *)model, "--input", (char *)input, "--out", out, "--log-level",
                    "error", prec ? "--precision" : NULL, (char *)prec, NULL};
    int         rc  = tst_run(argv, err);
    const char *msg = tst_slurp(err);
    int ok = rc == 1 && tst_lines(err) == 1 && strncmp(msg, "target-server dump: ", 20) == 0 && (!n1 || strstr(msg, n1)) &&
             (!n2 || strstr(msg, n2));
    TST_CHECK(ok);
    TST_CHECK(access(out, F_OK) != 0);
    printf("%-34s exit %d: %s", what, rc, msg);
    if (!ok) fprintf(stderr, "%s: expected exit 1 and one line with '%s' and '%s'\n", what, n1 ? n1 : "", n2 ? n2 : "");
}

// ----------------------------------------------------------------------------
// the cases

/* TMP/<name>-fp8 (the FP8 checkpoint of src) and TMP/<name>-dequant (its weights written back
 * dequantized) into q8 and ref. */
static void make_pair(const char *src, const char *name, scale_kind sk, char q8[256], char ref[256]) {
    snprintf(q8, 256, "%s/%s-fp8", tmp, name);
    snprintf(ref, 256, "%s/%s-dequant", tmp, name);
    write_config(src, q8, 1, NULL);
    write_weights(src, q8, 1, sk);
    write_config(src, ref, 0, NULL);
    write_weights(src, ref, 0, sk);
}

/* hidden 40: dequantized on load = the dequantized checkpoint, exactly; fp8 runs on the cpu (K = 40). */
static void test_dequantize(void) {
    const char *src = FIX "/qwen36_mm_single_bf16/model", *input = FIX "/qwen36_mm_single_bf16/input.safetensors";
    char        q8[256], ref[256];
    make_pair(src, "single", SCALE_MIXED, q8, ref);
    batch b;
    read_batch(input, &b);
    cm_target_cfg cfg;
    TST_CHECK(cm_target_cfg_load(&cfg, src) == CM_OK);
    const size_t TD = (size_t)b.T * (size_t)cfg.hidden_size, TV = (size_t)b.T * (size_t)cfg.vocab_size;
    float *fn0 = calloc(TD, 4), *lg0 = calloc(TV, 4), *fn1 = calloc(TD, 4), *lg1 = calloc(TV, 4);
    TST_CHECK(tst_ok(forward(kn_backend_cpu(), ref, 0, 1, &b, fn0, lg0), "the dequantized bf16 checkpoint"));
    TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 0, 1, &b, fn1, lg1), "the FP8 checkpoint at fp8 = 0"));
    TST_CHECK(memcmp(fn0, fn1, TD * 4) == 0 && memcmp(lg0, lg1, TV * 4) == 0);
    printf("fp8 = 0 (BF16/F16 scales, hidden 40): forward equals the dequantized checkpoint's bit for bit: %s\n",
           memcmp(lg0, lg1, TV * 4) == 0 ? "yes" : "NO");
    /* fp8 with an input width of 40 runs on the cpu (cuda refuses it at load: test_ts_dump cuda fp8) */
    if (fp8_ready) TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 1, 1, &b, fn1, lg1), "the FP8 checkpoint at fp8 = 1, K = 40"));
    free(fn0);
    free(lg0);
    free(fn1);
    free(lg1);
    free(b.ids);
    free(b.cu);
}

/* hidden 64 (sharded fixture): fp8 forward, quantize-on-load = FP8 checkpoint, backend refusals,
 * the default precision, and the bad checkpoints. */
static void test_fp8(void) {
    const char *src = FIX "/qwen35_mm_sharded/model", *input = FIX "/qwen35_mm_sharded/input.safetensors";
    char        q8[256], bf[256], dir[256];
    snprintf(q8, sizeof q8, "%s/sharded-fp8", tmp);
    snprintf(bf, sizeof bf, "%s/sharded-bf16", tmp);
    write_config(src, q8, 1, NULL);
    write_weights(src, q8, 1, SCALE_F32);
    snprintf(dir, sizeof dir, "%s/sharded-dequant", tmp);
    write_config(src, dir, 0, NULL);
    write_weights(src, dir, 0, SCALE_F32);
    batch b;
    read_batch(input, &b);
    cm_target_cfg cfg;
    TST_CHECK(cm_target_cfg_load(&cfg, src) == CM_OK);
    const size_t TD = (size_t)b.T * (size_t)cfg.hidden_size, TV = (size_t)b.T * (size_t)cfg.vocab_size;
    float *fn0 = calloc(TD, 4), *lg0 = calloc(TV, 4), *fn1 = calloc(TD, 4), *lg1 = calloc(TV, 4);
    float *fn2 = calloc(TD, 4), *lg2 = calloc(TV, 4);

    /* the backend: without the entries, or saying no, fp8 is refused with the way out */
    kn_backend fake = *kn_backend_cpu();
    fake.gemm_fp8   = NULL;
    TST_FAILS(forward(&fake, q8, 1, 0, &b, fn1, lg1), CM_ERR_UNSUPPORTED, "--precision fp8: the cpu backend has no FP8 GEMM",
              "use --precision bf16 to run the checkpoint dequantized to bf16");
    fake               = *kn_backend_cpu();
    fake.fp8_supported = say_no;
    if (fake.gemm_fp8 && fake.fp8_quantize_weight)
        TST_FAILS(forward(&fake, q8, 1, 0, &b, fn1, lg1), CM_ERR_UNSUPPORTED, no_fp8_why, "use --precision bf16");

    TST_CHECK(tst_ok(forward(kn_backend_cpu(), dir, 0, 0, &b, fn0, lg0), "the dequantized checkpoint"));
    if (fp8_ready) {
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 1, 0, &b, fn1, lg1), "the FP8 checkpoint at fp8 = 1"));
        /* the same weights; only the activations' 1 × 128 quantization differs (about 2^-4 relative
         * per element), against the weights' own quantization (the bf16 checkpoint's forward) */
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), src, 0, 0, &b, fn2, lg2), "the bf16 checkpoint"));
        const double e_act = rel_l2(fn1, fn0, TD), e_w = rel_l2(fn0, fn2, TD);
        printf("fp8 = 1 (hidden 64): final norm within %.3g (relative L2) of the dequantized weights' forward; the "
               "weights' quantization alone moves it %.3g\n",
               e_act, e_w);
        /* both are e4m3 roundings of like size, which this small random-weight model amplifies alike
         * over its 6 layers (about 0.16 and 0.18 at the final norm): the activations' part must stay
         * of the weights' order, not blow up */
        TST_CHECK(e_act < 1.5 * e_w && e_w < 0.3);
        /* the bf16 checkpoint quantized on load: the same FP8 weights */
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), src, 1, 0, &b, fn2, lg2), "the bf16 checkpoint quantized on load"));
        TST_CHECK(memcmp(fn1, fn2, TD * 4) == 0 && memcmp(lg1, lg2, TV * 4) == 0);
        printf("fp8 = 1: the bf16 checkpoint quantized on load gives the FP8 checkpoint's forward bit for bit: %s\n",
               memcmp(lg1, lg2, TV * 4) == 0 ? "yes" : "NO");
    }

    /* the default precision: an FP8 checkpoint runs in fp8 unless --precision says otherwise */
    {
        char out[512], err[512];
        snprintf(out, sizeof out, "%s/default.safetensors", tmp);
        snprintf(err, sizeof err, "%s/default.txt", tmp);
        char *argv[] = {bin, "dump", "--model", q8, "--input", (char *)input, "--out", out, NULL};
        int   rc     = tst_run(argv, err);
        const char *msg = tst_slurp(err);
        TST_CHECK(strstr(msg, "is an FP8 checkpoint: precision fp8 (its default") != NULL);
        if (fp8_ready) {
            TST_CHECK(rc == 0);
            cm_st *o = NULL;
            TST_CHECK(cm_st_open_file(&o, out) == CM_OK);
            const char *p = o ? cm_st_metadata(o, "precision") : NULL;
            TST_CHECK(p && strcmp(p, "fp8") == 0);
            cm_st_destroy(&o);
        } else {
            TST_CHECK(rc == 1 && strstr(msg, "--precision fp8: the cpu backend has no FP8 GEMM"));
        }
        printf("default precision of an FP8 checkpoint: exit %d, %s", rc,
               strstr(msg, "is an FP8 checkpoint") ? strstr(msg, "is an FP8 checkpoint") : msg);
        char *argv2[] = {bin, "dump", "--model", q8, "--input", (char *)input, "--out", out, "--precision", "bf16", NULL};
        rc  = tst_run(argv2, err);
        msg = tst_slurp(err);
        TST_CHECK(rc == 0 && strstr(msg, "FP8 weights are dequantized on load, precision bf16 (--precision)"));
        cm_st *o = NULL;
        TST_CHECK(cm_st_open_file(&o, out) == CM_OK);
        const char *p = o ? cm_st_metadata(o, "precision") : NULL;
        TST_CHECK(p && strcmp(p, "bf16") == 0);
        cm_st_destroy(&o);
        char *argv3[] = {bin, "dump", "--model", (char *)src, "--input", (char *)input, "--out", out, NULL};
        rc  = tst_run(argv3, err);
        msg = tst_slurp(err);
        TST_CHECK(rc == 0 && !strstr(msg, "FP8"));
    }

    /* bad checkpoints: one line each, naming the tensor */
    const char *P  = "model.language_model.layers.0.";
    char        victim[200], extra[200], d[256];
    snprintf(victim, sizeof victim, "%smlp.gate_proj.weight_scale_inv", P);
    snprintf(d, sizeof d, "%s/bad-no-scale", tmp);
    rewrite(q8, d, victim, NULL, CM_DTYPE_F32, 0, NULL, NULL);
    snprintf(extra, sizeof extra, "'%smlp.gate_proj.weight'", P);
    expect_fail("FP8 weight without its scale", d, input, "bf16", extra, "is F8_E4M3 but has no block scales");

    const float   zeros[8] = {0};
    const int64_t wrong[2] = {2, 1};
    snprintf(d, sizeof d, "%s/bad-scale-shape", tmp);
    rewrite(q8, d, victim, victim, CM_DTYPE_F32, 2, wrong, zeros);
    expect_fail("scale of the wrong shape", d, input, "bf16", victim, "has shape [2, 1], but the FP8 weight");

    snprintf(extra, sizeof extra, "%smlp.extra.weight_scale_inv", P);
    const int64_t one[2] = {1, 1};
    snprintf(d, sizeof d, "%s/bad-orphan-scale", tmp);
    rewrite(q8, d, NULL, extra, CM_DTYPE_F32, 2, one, zeros);
    expect_fail("scale without a weight", d, input, "bf16", extra, "block scale without its weight");

    snprintf(extra, sizeof extra, "%slinear_attn.in_proj_a.weight_scale_inv", P);
    snprintf(d, sizeof d, "%s/bad-bf16-scaled", tmp);
    rewrite(q8, d, NULL, extra, CM_DTYPE_F32, 2, one, zeros);
    expect_fail("scale of a bf16 weight", d, input, "bf16", extra, "which is stored BF16, not F8_E4M3");

    snprintf(d, sizeof d, "%s/bad-listed", tmp);
    rewrite(q8, d, NULL, NULL, CM_DTYPE_F32, 0, NULL, NULL);
    write_config(src, d, 1, "{\"modules_to_not_convert\": [\"lm_head\", \"model.language_model.layers.0.mlp.up_proj\"]}");
    snprintf(extra, sizeof extra, "'%smlp.up_proj.weight'", P);
    expect_fail("quantized but listed as not converted", d, input, "bf16", extra,
                "lists 'model.language_model.layers.0.mlp.up_proj' among the modules not converted");

    {
        const int64_t V = cfg.vocab_size, D = cfg.hidden_size, shape[2] = {V, D};
        uint8_t      *q = calloc((size_t)(V * D), 1);
        snprintf(d, sizeof d, "%s/bad-fp8-embed", tmp);
        rewrite(q8, d, "model.language_model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                CM_DTYPE_F8_E4M3, 2, shape, q);
        expect_fail("FP8 embedding", d, input, "bf16", "'model.language_model.embed_tokens.weight'",
                    "is stored F8_E4M3, but Tandem reads it in bf16 or f32");
        int64_t nv = cfg.lin_n_v_heads;
        snprintf(victim, sizeof victim, "%slinear_attn.A_log", P);
        snprintf(d, sizeof d, "%s/bad-fp8-alog", tmp);
        rewrite(q8, d, victim, victim, CM_DTYPE_F8_E4M3, 1, &nv, q);
        expect_fail("FP8 A_log", d, input, "bf16", victim, "is stored F8_E4M3, but Tandem reads it in bf16 or f32");
        free(q);
    }

    snprintf(d, sizeof d, "%s/bad-block", tmp);
    rewrite(q8, d, NULL, NULL, CM_DTYPE_F32, 0, NULL, NULL);
    write_config(src, d, 1, "{\"weight_block_size\": [64, 64]}");
    expect_fail("block size 64 x 64", d, input, NULL, "quantization_config.weight_block_size [64, 64] is not supported",
                "config.json");
    snprintf(d, sizeof d, "%s/bad-fmt", tmp);
    rewrite(q8, d, NULL, NULL, CM_DTYPE_F32, 0, NULL, NULL);
    write_config(src, d, 1, "{\"fmt\": \"e5m2\"}");
    expect_fail("fmt e5m2", d, input, "bf16", "quantization_config.fmt 'e5m2' is not supported", "e4m3");
    snprintf(d, sizeof d, "%s/bad-method", tmp);
    rewrite(q8, d, NULL, NULL, CM_DTYPE_F32, 0, NULL, NULL);
    write_config(src, d, 1, "{\"quant_method\": \"awq\"}");
    expect_fail("quant_method awq", d, input, NULL, "quantization_config.quant_method 'awq' is not supported", NULL);

    free(fn0);
    free(lg0);
    free(fn1);
    free(lg1);
    free(fn2);
    free(lg2);
    free(b.ids);
    free(b.cu);
}

/* A MoE target with its experts per expert (docs/moe.md), as Qwen's FP8 releases store them: every
 * expert's and the shared expert's matrices FP8 with their own scales. fp8 = 0 dequantizes them
 * exactly; fp8 = 1 runs them FP8, equal to the bf16 checkpoint quantized on load. */
static void test_moe(void) {
    const char *src   = FIX "/qwen35moe_flat_experts/model";
    const char *input = FIX "/qwen35moe_flat_experts/input.safetensors";
    char        q8[256], ref[256];
    make_pair(src, "moe", SCALE_F32, q8, ref); /* F32 scales: what quantizing on load makes */
    batch b;
    read_batch(input, &b);
    cm_target_cfg cfg;
    TST_CHECK(cm_target_cfg_load(&cfg, src) == CM_OK && cfg.n_experts > 0);
    const size_t TD = (size_t)b.T * (size_t)cfg.hidden_size, TV = (size_t)b.T * (size_t)cfg.vocab_size;
    float *fn0 = calloc(TD, 4), *lg0 = calloc(TV, 4), *fn1 = calloc(TD, 4), *lg1 = calloc(TV, 4);
    TST_CHECK(tst_ok(forward(kn_backend_cpu(), ref, 0, 1, &b, fn0, lg0), "the dequantized MoE checkpoint"));
    TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 0, 1, &b, fn1, lg1), "the FP8 MoE checkpoint at fp8 = 0"));
    TST_CHECK(memcmp(fn0, fn1, TD * 4) == 0 && memcmp(lg0, lg1, TV * 4) == 0);
    printf("MoE, fp8 = 0: forward equals the dequantized checkpoint's bit for bit: %s\n",
           memcmp(lg0, lg1, TV * 4) == 0 ? "yes" : "NO");
    if (fp8_ready) {
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 1, 0, &b, fn0, lg0), "the FP8 MoE checkpoint at fp8 = 1"));
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), src, 1, 0, &b, fn1, lg1), "the MoE checkpoint quantized on load"));
        TST_CHECK(memcmp(fn0, fn1, TD * 4) == 0 && memcmp(lg0, lg1, TV * 4) == 0);
        printf("MoE, fp8 = 1: the checkpoint quantized on load gives the FP8 checkpoint's forward bit for bit: %s\n",
               memcmp(lg0, lg1, TV * 4) == 0 ? "yes" : "NO");
    }
    free(fn0);
    free(lg0);
    free(fn1);
    free(lg1);
    free(b.ids);
    free(b.cu);
}

/* Qwen3-Next's fused in_proj_qkvz stored FP8: its rows un-interleaved at load with their block
 * scales (the fixture's 112 rows are one 128-row block). At fp8 = 0 the forward equals the
 * dequantized checkpoint's bit for bit (every row and scale where it belongs); at fp8 = 1 it runs,
 * the activations' quantization of the weights' order as in test_fp8. */
static void test_next(void) {
    const char *src   = FIX "/qwen3next_flat/model";
    const char *input = FIX "/qwen3next_flat/input.safetensors";
    char        q8[256], ref[256];
    make_pair(src, "next", SCALE_F32, q8, ref);
    batch b;
    read_batch(input, &b);
    cm_target_cfg cfg;
    TST_CHECK(cm_target_cfg_load(&cfg, src) == CM_OK && cfg.n_experts > 0);
    const size_t TD = (size_t)b.T * (size_t)cfg.hidden_size, TV = (size_t)b.T * (size_t)cfg.vocab_size;
    float *fn0 = calloc(TD, 4), *lg0 = calloc(TV, 4), *fn1 = calloc(TD, 4), *lg1 = calloc(TV, 4);
    float *fn2 = calloc(TD, 4), *lg2 = calloc(TV, 4);
    TST_CHECK(tst_ok(forward(kn_backend_cpu(), ref, 0, 1, &b, fn0, lg0), "the dequantized Qwen3-Next checkpoint"));
    TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 0, 1, &b, fn1, lg1), "the FP8 Qwen3-Next checkpoint at fp8 = 0"));
    TST_CHECK(memcmp(fn0, fn1, TD * 4) == 0 && memcmp(lg0, lg1, TV * 4) == 0);
    printf("Qwen3-Next, in_proj_qkvz stored FP8, fp8 = 0: forward equals the dequantized checkpoint's bit for bit: %s\n",
           memcmp(lg0, lg1, TV * 4) == 0 ? "yes" : "NO");
    if (fp8_ready) {
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), ref, 0, 0, &b, fn0, lg0), "the dequantized checkpoint, fp32"));
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), q8, 1, 0, &b, fn1, lg1), "the FP8 Qwen3-Next checkpoint at fp8 = 1"));
        TST_CHECK(tst_ok(forward(kn_backend_cpu(), src, 0, 0, &b, fn2, lg2), "the bf16 Qwen3-Next checkpoint"));
        const double e_act = rel_l2(fn1, fn0, TD), e_w = rel_l2(fn0, fn2, TD);
        printf("Qwen3-Next, fp8 = 1: final norm within %.3g of the dequantized weights' forward; the weights' "
               "quantization alone moves it %.3g\n", e_act, e_w);
        TST_CHECK(e_act < 1.5 * e_w && e_w < 0.3);
    }
    free(fn0), free(lg0), free(fn1), free(lg1), free(fn2), free(lg2);
    free(b.ids);
    free(b.cu);
}

int main(void) {
    snprintf(bin, sizeof bin, "%s/target-server/target-server", TANDEM_BINARY_DIR);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-fp8-XXXXXX");
    TST_CHECK(mkdtemp(tmp) != NULL);
    const kn_backend *cpu = kn_backend_cpu();
    fp8_ready             = cpu->gemm_fp8 && cpu->fp8_quantize_weight && cpu->fp8_supported;
    if (!fp8_ready) printf("the cpu backend has no FP8 GEMM yet: the fp8 forwards are not run\n");
    test_dequantize();
    test_fp8();
    test_moe();
    test_next();
    return tst_cleanup(tmp, tst_report());
}
