/* tests/test_ts_fused.c — the fused bf16 forward of ts_model (ts_model_fused: producers write
 * the bf16 GEMM inputs, residual adds deferred into the next norm, the GDN conv/split/l2norm
 * in one op) run on the cpu backend, where TANDEM_TARGET_FUSED=1 forces it and the cpu then
 * rounds every GEMM input to bf16 as cuda does. On an 8-layer model of small heads (GDN and
 * gated attention, packed lengths 1, 17, 64, 30):
 *   - the path is chosen as documented: unset on cpu → unfused (its gemm is fp32), 0 → unfused,
 *     1 → fused;
 *   - fused against unfused: every captured layer, the final norm and the logits within rel L2
 *     3e-2 (the dump tolerance of bf16; only the GEMM inputs' bf16 rounding differs) and not
 *     equal (the fused path really ran);
 *   - the deferred residual add is the same arithmetic as the immediate one: captures at
 *     layers 1, 3, 6, 7 (each forces the add before it is read) and captures at 7 alone, or
 *     a forward that stops at layer 3, give bit-identical layers, final norm and logits;
 *   - the output projections added onto the residual stream by the GEMM (gemm_bf16in_acc and, with
 *     the projections quantized to FP8 on load, gemm_fp8q_acc: the default) and written for the
 *     next norm to add (TANDEM_TARGET_RESIDUAL_GEMM=0) give bit-identical captures, final norm and
 *     logits;
 *   - the MLP's gate and up products written bf16 (the default) against F32
 *     (TANDEM_TARGET_BF16_PRODUCTS=0): within 3e-2 and not equal. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kn_backend.h"
#include "ts_model.h"
#include "tst.h"

#define N_LAYERS 8
#define HIDDEN   64
#define VOCAB    100

static void write_config(const char *path) {
    FILE *f = fopen(path, "w");
    TST_CHECK(f != NULL);
    if (!f) return;
    fprintf(f, "{\"architectures\": [\"Qwen3_5ForConditionalGeneration\"], \"model_type\": \"qwen3_5\",\n"
               " \"tie_word_embeddings\": false, \"text_config\": {\"model_type\": \"qwen3_5_text\",\n"
               " \"hidden_size\": %d, \"num_hidden_layers\": %d, \"layer_types\": [",
            HIDDEN, N_LAYERS);
    for (int i = 0; i < N_LAYERS; i++)
        fprintf(f, "%s\"%s\"", i ? ", " : "", i % 4 == 3 ? "full_attention" : "linear_attention");
    fprintf(f, "], \"intermediate_size\": 96, \"vocab_size\": %d, \"num_attention_heads\": 2,\n"
               " \"num_key_value_heads\": 1, \"head_dim\": 32, \"rope_parameters\": {\"rope_type\": \"default\",\n"
               " \"rope_theta\": 10000000, \"partial_rotary_factor\": 0.25, \"mrope_interleaved\": true,\n"
               " \"mrope_section\": [2, 1, 1]}, \"linear_num_key_heads\": 2, \"linear_num_value_heads\": 4,\n"
               " \"linear_key_head_dim\": 16, \"linear_value_head_dim\": 12, \"linear_conv_kernel_dim\": 4,\n"
               " \"rms_norm_eps\": 1e-06, \"hidden_act\": \"silu\", \"attn_output_gate\": true,\n"
               " \"tie_word_embeddings\": false}}\n",
            VOCAB);
    fclose(f);
}

static const kn_backend *be;
static kn_ctx           *ctx;
static char              cfg_path[256];

/* Loads the seed-7 random model with TANDEM_TARGET_FUSED set to fused ("0", "1" or NULL), its
 * projections quantized to FP8 on load when fp8. */
static ts_model *load_p(const char *fused, int fp8) {
    if (fused)
        setenv("TANDEM_TARGET_FUSED", fused, 1);
    else
        unsetenv("TANDEM_TARGET_FUSED");
    ts_model       *m  = NULL;
    ts_model_config mc = {.dir = cfg_path, .backend = be, .ctx = ctx, .n_layers = -1, .load_head = 1,
                          .bf16_weights = 1, .init_random = 1, .seed = 7, .fp8 = fp8};
    cm_status       st = ts_model_load(&m, &mc);
    if (st != CM_OK) fprintf(stderr, "ts_model_load: %s: %s\n", cm_status_str(st), cm_last_error());
    TST_CHECK(st == CM_OK);
    return m;
}

static ts_model *load(const char *fused) { return load_p(fused, 0); }

typedef struct outs {
    float *layer[4], *final_norm, *logits;
} outs;

static const int32_t cu[] = {0, 1, 18, 82, 112};
#define T     112
#define N_SEQ 4

/* One forward capturing layers[0..n) (and the head when head); NULL buffers for the rest. */
static void forward(ts_model *m, const int *layers, int n, int head, outs *o) {
    int32_t ids[T];
    for (int t = 0; t < T; t++) ids[t] = (int32_t)((t * 37 + 11) % VOCAB);
    memset(o, 0, sizeof *o);
    for (int i = 0; i < n; i++) o->layer[i] = calloc((size_t)T * HIDDEN, sizeof(float));
    if (head) {
        o->final_norm = calloc((size_t)T * HIDDEN, sizeof(float));
        o->logits     = calloc((size_t)T * VOCAB, sizeof(float));
    }
    ts_capture cap = {.n_layers = n, .layers = layers, .layer_out = o->layer, .final_norm = o->final_norm,
                      .logits = o->logits};
    cm_status  st  = ts_model_forward(m, ids, T, cu, N_SEQ, &cap);
    if (st != CM_OK) fprintf(stderr, "ts_model_forward: %s: %s\n", cm_status_str(st), cm_last_error());
    TST_CHECK(st == CM_OK);
}

static void outs_free(outs *o) {
    for (int i = 0; i < 4; i++) free(o->layer[i]);
    free(o->final_norm);
    free(o->logits);
}

static double rel_l2(const float *got, const float *ref, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        double d = (double)got[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num) / (sqrt(den) + 1e-300);
}

static void check_close(const char *name, const float *fused, const float *unfused, long n) {
    double e = rel_l2(fused, unfused, n);
    printf("%-34s rel L2 %.2e (tolerance 3e-2, must be > 0)\n", name, e);
    TST_CHECK(e <= 3e-2 && e > 0);
}

static void check_same(const char *name, const float *a, const float *b, long n) {
    int same = memcmp(a, b, (size_t)n * sizeof(float)) == 0;
    printf("%-34s %s\n", name, same ? "bit-identical" : "DIFFERS");
    TST_CHECK(same);
}

/* check_same on every capture of four[], the final norm and the logits of two forwards */
static void check_outs_same(const char *what, const int *four, const outs *a, const outs *b) {
    const long n = (long)T * HIDDEN;
    char       name[64];
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof name, "layer %d, %s", four[i], what);
        check_same(name, a->layer[i], b->layer[i], n);
    }
    snprintf(name, sizeof name, "final norm, %s", what);
    check_same(name, a->final_norm, b->final_norm, n);
    snprintf(name, sizeof name, "logits, %s", what);
    check_same(name, a->logits, b->logits, (long)T * VOCAB);
}

int main(void) {
    be = kn_backend_cpu();
    TST_CHECK(be->ctx_create(&ctx, NULL) == CM_OK);
    snprintf(cfg_path, sizeof cfg_path, "/tmp/tandem-fused-%d.json", (int)getpid());
    write_config(cfg_path);

    ts_model *m_auto = load(NULL), *m_off = load("0"), *m_on = load("1");
    ts_model *m_fp8 = load_p("1", 1);
    setenv("TANDEM_TARGET_RESIDUAL_GEMM", "0", 1);
    ts_model *m_on_noacc = load("1"), *m_fp8_noacc = load_p("1", 1);
    unsetenv("TANDEM_TARGET_RESIDUAL_GEMM");
    setenv("TANDEM_TARGET_BF16_PRODUCTS", "0", 1);
    ts_model *m_on_f32p = load("1");
    unsetenv("TANDEM_TARGET_BF16_PRODUCTS");
    if (!m_auto || !m_off || !m_on || !m_on_noacc || !m_fp8 || !m_fp8_noacc || !m_on_f32p) return tst_report();
    TST_CHECK(ts_model_fused(m_auto) == 0 && ts_model_fused(m_off) == 0 && ts_model_fused(m_on) == 1);
    printf("path chosen: unset on cpu %d, TANDEM_TARGET_FUSED=0 %d, =1 %d\n", ts_model_fused(m_auto),
           ts_model_fused(m_off), ts_model_fused(m_on));

    static const int four[] = {1, 3, 6, 7}, last[] = {7}, three[] = {3};
    outs             ref, fus, fus_last, fus_stop, fus_noacc;
    forward(m_off, four, 4, 1, &ref);
    forward(m_on, four, 4, 1, &fus);
    forward(m_on_noacc, four, 4, 1, &fus_noacc);
    forward(m_on, last, 1, 1, &fus_last);
    forward(m_on, three, 1, 0, &fus_stop);
    const long n = (long)T * HIDDEN;
    for (int i = 0; i < 4; i++) {
        char name[64];
        snprintf(name, sizeof name, "layer %d", four[i]);
        check_close(name, fus.layer[i], ref.layer[i], n);
    }
    check_close("final norm", fus.final_norm, ref.final_norm, n);
    check_close("logits", fus.logits, ref.logits, (long)T * VOCAB);
    check_same("layer 7, captured alone", fus_last.layer[0], fus.layer[3], n);
    check_same("final norm, layer 7 captured alone", fus_last.final_norm, fus.final_norm, n);
    check_same("logits, layer 7 captured alone", fus_last.logits, fus.logits, (long)T * VOCAB);
    check_same("layer 3, forward stopped there", fus_stop.layer[0], fus.layer[1], n);
    check_outs_same("no residual GEMM", four, &fus_noacc, &fus);
    {
        outs f32p;
        forward(m_on_f32p, four, 4, 1, &f32p);
        for (int i = 0; i < 4; i++) {
            char name[64];
            snprintf(name, sizeof name, "layer %d, F32 gate/up", four[i]);
            check_close(name, fus.layer[i], f32p.layer[i], n);
        }
        check_close("logits, F32 gate/up", fus.logits, f32p.logits, (long)T * VOCAB);
        outs_free(&f32p);
        ts_model_destroy(&m_on_f32p);
    }
    outs f8, f8_noacc;
    forward(m_fp8, four, 4, 1, &f8);
    forward(m_fp8_noacc, four, 4, 1, &f8_noacc);
    check_outs_same("fp8, no residual GEMM", four, &f8_noacc, &f8);
    {
        double e = rel_l2(f8.logits, fus.logits, (long)T * VOCAB);
        printf("%-34s fp8 vs bf16 rel L2 %.2e (must be > 0: the FP8 path ran)\n", "logits", e);
        TST_CHECK(e > 0 && e < 0.5);
    }
    outs_free(&f8);
    outs_free(&f8_noacc);
    ts_model_destroy(&m_fp8);
    ts_model_destroy(&m_fp8_noacc);

    outs_free(&ref);
    outs_free(&fus);
    outs_free(&fus_last);
    outs_free(&fus_stop);
    outs_free(&fus_noacc);
    ts_model_destroy(&m_on_noacc);
    ts_model_destroy(&m_auto);
    ts_model_destroy(&m_off);
    ts_model_destroy(&m_on);
    be->ctx_destroy(&ctx);
    unlink(cfg_path);
    return tst_report();
}
