/* tests/test_ts_dump.c — `target-server dump` against the Hugging Face Transformers oracle
 * (tests/oracle/make_target_fixtures.py, float64 references) on every committed fixture:
 * every layer, the final norm and the logits, relative L2 error per tensor.
 *   test_ts_dump cpu          tolerance 1e-4 (unit)
 *   test_ts_dump cuda bf16    tolerance 3e-2 (gpu; exits 77 without a GPU)
 *   test_ts_dump cuda fp32    tolerance 1e-3 (gpu)
 * A MoE fixture's routing (experts_<i>, each token's chosen experts) must equal the oracle's, on the cpu and
 * in fp32 and in bf16: the MoE fixtures' inputs are chosen so that every router's K-th logit exceeds the
 * (K+1)-th by at least 0.25 (tests/oracle/make_moe_fixtures.py), far more than bf16 rounding moves them, so
 * no close call is left to flip. Where a fixture has hf_bf16.json (tests/oracle/bf16_baseline.py --write:
 * Transformers' own bf16 CPU forward against the same float64 reference), cuda bf16 prints its worst error
 * and routing differences beside ours; they do not loosen the check.
 * With precision fp8 it reads the FP8 copies instead (tests/fixtures/target_fp8, W8A8 float64 references of
 * tests/oracle/make_fp8_fixtures.py) and prints every tensor's error, and its distance from the source fixture's
 * unquantized reference (the FP8-vs-bf16 difference; informational):
 *   test_ts_dump cpu fp8      tolerance 1e-4, or 1.5x the oracle's own float32 run of the same W8A8
 *                             forward where larger (manifest.json "float32_simulation": a rounding
 *                             near-tie that any float32 forward meets, e4m3's 6 % steps and these
 *                             O(1)-weight models amplifying it; qwen35_mm_sharded from layer 5, 3.1e-4) (unit)
 *   test_ts_dump cuda fp8     the embedded trained target models/tandem-tiny (real 128-wide blocks) against
 *                             the cpu reference's fp8 dump, with the rest in fp32 (TANDEM_FP8_REST=fp32, as the
 *                             reference): tolerance 5e-2; served (the rest bf16), and bf16 against cpu for
 *                             scale: 0.1; the FP8 fixtures, both ways: 0.25 (3e-2 is not met: below). On an H200 the fixtures are 0.11-0.16
 *                             off: the FP8 tensor cores add a group's products with ~14 mantissa bits (3e-3
 *                             relative at these K), the next quantization then rounds some inputs to the
 *                             neighbouring e4m3 code (6 % apart), and these random O(1)-weight models grow such
 *                             flips through the layers (their FP8 references are 0.20-0.23 from the unquantized
 *                             ones). The cpu reference with a 13-15-bit model of that sum
 *                             (TANDEM_FP8_REF_TC, bench/fp8_accum_model.sh) lands as far from
 *                             the exact dump as the GPU does. (gpu; exits 77 without a GPU or
 *                             without block-scaled FP8) */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_cfg.h"
#include "cm_safetensors.h"
#include "kn_backend.h"
#include "tst.h"
#include "tst_json.h"
#include "tst_kn.h"
#include "tst_proc.h"

static double rel_l2_f32_f64(const float *got, const void *ref_data, cm_dtype ref_dt, long n) {
    double *ref = malloc((size_t)n * sizeof *ref);
    if (!ref || cm_convert(ref, CM_DTYPE_F64, ref_data, ref_dt, (size_t)n) != CM_OK) {
        free(ref);
        return INFINITY;
    }
    double e = tst_rel_l2(got, ref, n);
    free(ref);
    return e;
}

/* Relative L2 of every tensor of the reference file ref_path against the dump got, into err[] (INFINITY where
 * the dump lacks the tensor or its shape differs); names[] borrow from the reference, valid while it is open.
 * Returns the number of tensors, or -1 when the reference cannot be read. */
static int tensor_errors(const char *fix, const cm_st *got, const cm_st *ref, double *err, const char **names, int max) {
    int n_cmp = 0;
    for (int i = 0; i < cm_st_count(ref) && n_cmp < max; i++) {
        const cm_st_tensor *r = cm_st_at(ref, i);
        const cm_st_tensor *g = cm_st_find(got, r->name);
        if (r->dtype == CM_DTYPE_I32) continue; /* a MoE layer's routing: routing_mismatches */
        names[n_cmp] = r->name;
        err[n_cmp]   = INFINITY;
        if (!g) {
            fprintf(stderr, "%s: dump lacks '%s'\n", fix, r->name);
        } else if (g->dtype != CM_DTYPE_F32 || g->n_dims != r->n_dims || g->shape[0] != r->shape[0] ||
                   g->shape[1] != r->shape[1]) {
            fprintf(stderr, "%s: dump's '%s' is not F32 of the reference's shape\n", fix, r->name);
        } else {
            long   n  = (long)(r->shape[0] * r->shape[1]);
            float *gv = malloc((size_t)n * sizeof *gv);
            if (gv) {
                memcpy(gv, g->data, (size_t)n * sizeof *gv);
                err[n_cmp] = rel_l2_f32_f64(gv, r->data, r->dtype, n);
            }
            free(gv);
        }
        n_cmp++;
    }
    return n_cmp;
}

/* fp8: the source fixture of an FP8 copy, tests/fixtures/target/<name>, whose reference is unquantized. */
static void source_ref_path(char *out, size_t n, const char *fix) {
    snprintf(out, n, "%s/fixtures/target/%s/ref.safetensors", TANDEM_TEST_DATA, strrchr(fix, '/') + 1);
}

/* Whether every FP8 GEMM's input width of the model is a multiple of 16 (cuda's FP8 kernels refuse
 * the others at load; the cpu runs any). */
static int cuda_fp8_widths(const char *model) {
    cm_target_cfg c;
    if (cm_target_cfg_load(&c, model) != CM_OK) return 1;
    const int w[] = {c.hidden_size, c.intermediate_size, c.lin_n_v_heads * c.lin_v_head_dim, c.n_heads * c.head_dim};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (w[i] % 16) return 0;
    return 1;
}

/* A MoE fixture's routing: every experts_<i> of the reference (I32 [T, K], the oracle's top-k in
 * descending weight) against the dump's; *n_rows receives the (token, layer) pairs compared and the
 * return value those whose chosen experts differ as sets (-1 when the dump lacks a layer's). */
static long routing_mismatches(const char *fix, const cm_st *got, const cm_st *ref, long *n_rows) {
    long bad = 0;
    *n_rows  = 0;
    for (int i = 0; i < cm_st_count(ref); i++) {
        const cm_st_tensor *r = cm_st_at(ref, i);
        if (r->dtype != CM_DTYPE_I32) continue;
        const cm_st_tensor *g = cm_st_find(got, r->name);
        if (!g || g->dtype != CM_DTYPE_I32 || g->n_dims != 2 || g->shape[0] != r->shape[0] ||
            g->shape[1] != r->shape[1]) {
            fprintf(stderr, "%s: dump lacks '%s' as I32 of the reference's shape\n", fix, r->name);
            return -1;
        }
        const int64_t T = r->shape[0], K = r->shape[1];
        for (int64_t t = 0; t < T; t++) {
            int32_t a[64], b[64];
            memcpy(a, (const int32_t *)r->data + t * K, (size_t)K * sizeof *a); /* may be unaligned */
            memcpy(b, (const int32_t *)g->data + t * K, (size_t)K * sizeof *b);
            int same = 1;
            for (int64_t k = 0; k < K && same; k++) {
                int found = 0;
                for (int64_t j = 0; j < K; j++) found |= a[k] == b[j];
                same = found;
            }
            bad += !same;
            ++*n_rows;
        }
    }
    return bad;
}

/* cuda bf16: the fixture's hf_bf16.json (Transformers' own bf16 errors, printed beside ours; see the top),
 * NULL without it. */
static cJSON *hf_bf16_load(const char *fix) {
    char path[2048];
    snprintf(path, sizeof path, "%s/hf_bf16.json", fix);
    return access(path, R_OK) == 0 ? tst_json_load(path) : NULL;
}

/* The number member key of hf (under "tensors" when tensors), or -1 when hf or it is absent (also
 * read from the manifest's float32_simulation errors). */
static double hf_bf16_get(const cJSON *hf, int tensors, const char *key) {
    if (hf && tensors) hf = cJSON_GetObjectItemCaseSensitive(hf, "tensors");
    const cJSON *v = hf ? cJSON_GetObjectItemCaseSensitive(hf, key) : NULL;
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* cpu fp8: the oracle's own float32 run of the same W8A8 forward (tests/fixtures/target_fp8/
 * manifest.json, "float32_simulation"): the manifest, read once per fixture (NULL when absent),
 * and *rel the fixture's "rel_l2" object in it (tensor name → relative L2 against the float64
 * reference), NULL when the manifest has none for it. */
static cJSON *f32_sim_load(const char *fix, const cJSON **rel) {
    char path[2048];
    snprintf(path, sizeof path, "%.*s/manifest.json", (int)(strrchr(fix, '/') - fix), fix);
    cJSON       *m = access(path, R_OK) == 0 ? tst_json_load(path) : NULL;
    const cJSON *f, *all = m ? cJSON_GetObjectItemCaseSensitive(m, "fixtures") : NULL;
    *rel = NULL;
    cJSON_ArrayForEach(f, all) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (cJSON_IsString(name) && strcmp(name->valuestring, strrchr(fix, '/') + 1) == 0)
            *rel = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(f, "float32_simulation"),
                                                    "rel_l2");
    }
    return m;
}

/* label: what the summary line calls the run (the precision, or how it was run). */
static void check_fixture(const char *fix, const char *device, const char *precision, const char *label, double tol) {
    char model[2048], input[2048], ref_path[2048], src_path[2048], out[256], err[256];
    snprintf(model, sizeof model, "%s/model", fix);
    snprintf(input, sizeof input, "%s/input.safetensors", fix);
    snprintf(ref_path, sizeof ref_path, "%s/ref.safetensors", fix);
    snprintf(out, sizeof out, "/tmp/tandem-dump-%d.safetensors", (int)getpid());
    snprintf(err, sizeof err, "/tmp/tandem-dump-%d.err", (int)getpid());
    const int fp8 = strcmp(precision, "fp8") == 0;
    char      bin[1024];
    snprintf(bin, sizeof bin, "%s/target-server/target-server", TANDEM_BINARY_DIR);
    char *argv[] = {bin, "dump", "--model", model, "--input", input, "--out", out, "--device", (char *)device,
                    "--precision", (char *)precision, "--logits", "--log-level", "warn", NULL};
    int rc = tst_run(argv, err);
    if (fp8 && strcmp(device, "cuda") == 0 && !cuda_fp8_widths(model)) { /* the cuda FP8 kernels' alignment */
        const char *msg = tst_slurp(err);
        TST_CHECK(rc != 0 && strstr(msg, "not a multiple of 16") && strstr(msg, "--precision bf16"));
        printf("%-40s cuda  fp8    refused as it should be (an input width not a multiple of 16): %s", fix, msg);
        return;
    }
    TST_CHECK(rc == 0);
    if (rc != 0) {
        fprintf(stderr, "%s: dump exited %d:\n%s\n", fix, rc, tst_slurp(err));
        return;
    }
    enum { MAX_T = 256 };
    cm_st      *ref = NULL, *got = NULL, *src = NULL;
    double      e[MAX_T], e_src[MAX_T];
    const char *names[MAX_T], *src_names[MAX_T];
    TST_CHECK(cm_st_open_file(&ref, ref_path) == CM_OK);
    TST_CHECK(cm_st_open_file(&got, out) == CM_OK);
    if (!ref || !got) {
        fprintf(stderr, "%s\n", cm_last_error());
        goto done;
    }
    int    n_cmp = tensor_errors(fix, got, ref, e, names, MAX_T), n_src = 0;
    cJSON *hf    = strcmp(device, "cuda") == 0 && strcmp(precision, "bf16") == 0 ? hf_bf16_load(fix) : NULL;
    if (fp8) { /* informational: how far W8A8 is from the unquantized model */
        source_ref_path(src_path, sizeof src_path, fix);
        if (cm_st_open_file(&src, src_path) == CM_OK)
            n_src = tensor_errors(fix, got, src, e_src, src_names, MAX_T);
        else
            fprintf(stderr, "%s: no source reference (%s)\n", fix, cm_last_error());
    }
    const cJSON *sim_rel = NULL;
    cJSON       *sim_doc = fp8 && strcmp(device, "cpu") == 0 ? f32_sim_load(fix, &sim_rel) : NULL;
    double       worst = 0, hf_worst = 0, sim_worst = 0;
    for (int i = 0; i < n_cmp; i++) {
        const double hf_e = hf_bf16_get(hf, 1, names[i]);
        const double sim  = hf_bf16_get(sim_rel, 0, names[i]);
        if (sim > sim_worst) sim_worst = sim;
        /* cpu fp8: a rounding near-tie the oracle's own float32 run hits too */
        const double t = 1.5 * sim > tol ? 1.5 * sim : tol;
        TST_CHECK(e[i] <= t);
        if (e[i] > worst) worst = e[i];
        if (hf_e > hf_worst) hf_worst = hf_e;
        if (e[i] > t) fprintf(stderr, "%s: %s relative L2 %.3e > %.3e\n", fix, names[i], e[i], t);
        if (fp8)
            printf("  %-12s relative L2 %.3e against the fp8 reference, %.3e against the unquantized one\n",
                   names[i], e[i], i < n_src && strcmp(src_names[i], names[i]) == 0 ? e_src[i] : NAN);
    }
    TST_CHECK(n_cmp >= 3);
    char hf_note[64] = "";
    if (hf) snprintf(hf_note, sizeof hf_note, "; Transformers' own bf16 %.3e", hf_worst);
    if (sim_worst > 0) snprintf(hf_note, sizeof hf_note, "; the oracle's float32 run %.3e", sim_worst);
    printf("%-40s %-5s %-5s %2d tensors, worst relative L2 %.3e (tolerance %.0e%s)\n", strrchr(fix, '/') + 1,
           device, label, n_cmp, worst, tol, hf_note);
    long n_rows, bad = routing_mismatches(fix, got, ref, &n_rows);
    if (n_rows > 0 || bad < 0) {
        /* equal routing everywhere: the inputs leave no close call (see the top) */
        const long hf_bad = (long)hf_bf16_get(hf, 0, "routing_differ");
        TST_CHECK(bad == 0);
        hf_note[0] = '\0';
        if (hf_bad >= 0) snprintf(hf_note, sizeof hf_note, " (Transformers' own bf16: %ld)", hf_bad);
        printf("%-40s %-5s %-5s routing: %ld of %ld (token, layer) choices differ from the oracle's%s\n",
               strrchr(fix, '/') + 1, device, label, bad, n_rows, hf_note);
    }
    cJSON_Delete(hf);
    cJSON_Delete(sim_doc);
done:
    cm_st_destroy(&ref);
    cm_st_destroy(&got);
    cm_st_destroy(&src);
    unlink(out);
    unlink(err);
}

/* dump of model on device at precision into out; 1 when it ran. */
static int dump_to(const char *model, const char *input, const char *device, const char *precision, const char *out) {
    char bin[1024], err[256];
    snprintf(bin, sizeof bin, "%s/target-server/target-server", TANDEM_BINARY_DIR);
    snprintf(err, sizeof err, "/tmp/tandem-dump-%d.err", (int)getpid());
    char *argv[] = {bin, "dump", "--model", (char *)model, "--input", (char *)input, "--out", (char *)out, "--device",
                    (char *)device, "--precision", (char *)precision, "--logits", "--log-level", "warn", NULL};
    int rc = tst_run(argv, err);
    TST_CHECK(rc == 0);
    if (rc != 0) fprintf(stderr, "%s: dump on %s at %s exited %d:\n%s\n", model, device, precision, rc, tst_slurp(err));
    unlink(err);
    return rc == 0;
}

/* The cuda dump against the cpu one (the reference) of model at precision, every tensor within tol. */
static void check_pair(const char *model, const char *input, const char *precision, const char *label, double tol) {
    char out_c[256], out_g[256];
    snprintf(out_c, sizeof out_c, "/tmp/tandem-dump-%d-cpu.safetensors", (int)getpid());
    snprintf(out_g, sizeof out_g, "/tmp/tandem-dump-%d-cuda.safetensors", (int)getpid());
    if (!dump_to(model, input, "cpu", precision, out_c) || !dump_to(model, input, "cuda", precision, out_g)) return;
    enum { MAX_T = 256 };
    cm_st      *ref = NULL, *got = NULL;
    double      e[MAX_T], worst = 0;
    const char *names[MAX_T];
    TST_CHECK(cm_st_open_file(&ref, out_c) == CM_OK && cm_st_open_file(&got, out_g) == CM_OK);
    int n = ref && got ? tensor_errors(model, got, ref, e, names, MAX_T) : 0;
    for (int i = 0; i < n; i++) {
        TST_CHECK(e[i] <= tol);
        worst = e[i] > worst ? e[i] : worst;
        printf("  %-12s relative L2 %.3e, cuda against cpu\n", names[i], e[i]);
    }
    TST_CHECK(n >= 3);
    printf("%-28s cuda against cpu, %-26s %d tensors, worst relative L2 %.3e (tolerance %.0e)\n",
           strrchr(model, '/') + 1, label, n, worst, tol);
    cm_st_destroy(&ref);
    cm_st_destroy(&got);
    unlink(out_c);
    unlink(out_g);
}

/* The embedded trained target (models/tandem-tiny: hidden 128, so real 128-wide groups and blocks, and a
 * trained model's conditioning) on cuda against the cpu reference: fp8 with the rest in fp32 as the reference
 * runs it (TANDEM_FP8_REST=fp32) within 5e-2; the served fp8 path (the rest bf16) and, beside it for scale,
 * the bf16 path against the cpu's fp32 math, within 0.1. Seen on an H200: 3.8e-2 (logits 2.0e-2), 5.0e-2
 * (logits 2.4e-2) and 4.3e-3: the FP8 products' accumulation (see the top) moves activations by a few 1e-3,
 * enough to flip some e4m3 codes at the next quantization, ten times the bf16 path's distance. */
static void check_trained(double tol) {
    char model[1024], input[1024];
    snprintf(model, sizeof model, "%s/../models/tandem-tiny", TANDEM_TEST_DATA);
    snprintf(input, sizeof input, "%s/../models/tiny-qwen35/example_input.safetensors", TANDEM_TEST_DATA);
    setenv("TANDEM_FP8_REST", "fp32", 1);
    check_pair(model, input, "fp8", "fp8, fp32 rest", tol > 5e-2 ? tol : 5e-2);
    unsetenv("TANDEM_FP8_REST");
    check_pair(model, input, "fp8", "fp8 (served: bf16 rest)", 0.1);
    check_pair(model, input, "bf16", "bf16", 0.1);
}

/* Exits 77 (skipped) when the backend cannot run the block-scaled FP8 product here (cuda before sm_90 or
 * cuBLASLt 12.9). */
static void need_fp8(const kn_backend *be) {
    kn_ctx       *ctx = NULL;
    kn_ctx_config kc  = KN_CTX_CONFIG_DEFAULT;
    char          why[400] = "the backend has no FP8 product";
    int           ok       = 0;
    if (be->ctx_create(&ctx, &kc) == CM_OK) {
        ok = be->fp8_supported && be->fp8_supported(ctx, why, sizeof why);
        be->ctx_destroy(&ctx);
    }
    if (!ok) TST_SKIP("%s", why);
}

int main(int argc, char **argv) {
    const char *device    = argc > 1 ? argv[1] : "cpu";
    const char *precision = argc > 2 ? argv[2] : "bf16";
    double      tol       = 1e-4;
    if (strcmp(device, "cuda") == 0) {
        tst_need_cuda();
        tol = strcmp(precision, "fp32") == 0 ? 1e-3 : 3e-2;
        if (strcmp(precision, "fp8") == 0) need_fp8(kn_backend_cuda());
    }
    char root[1024];
    snprintf(root, sizeof root, "%s/fixtures/%s", TANDEM_TEST_DATA,
             strcmp(precision, "fp8") == 0 ? "target_fp8" : "target");
    DIR *d = opendir(root);
    TST_CHECK(d != NULL);
    if (!d) return tst_report();
    char          *names[64];
    int            n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) {
        char ref[2048];
        snprintf(ref, sizeof ref, "%s/%s/ref.safetensors", root, e->d_name);
        if (e->d_name[0] != '.' && access(ref, R_OK) == 0) names[n++] = strdup(e->d_name);
    }
    closedir(d);
    TST_CHECK(n >= 3);
    for (int i = 0; i < n; i++) { /* sorted for a stable report */
        for (int j = i + 1; j < n; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t  = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    }
    if (strcmp(device, "cuda") == 0 && strcmp(precision, "fp8") == 0) check_trained(tol);
    for (int i = 0; i < n; i++) {
        char fix[1400];
        snprintf(fix, sizeof fix, "%s/%s", root, names[i]);
        if (strcmp(device, "cuda") == 0 && strcmp(precision, "fp8") == 0) {
            /* the FP8 products on cuda with every other product in fp32, as the reference runs them */
            setenv("TANDEM_FP8_REST", "fp32", 1);
            check_fixture(fix, device, precision, "fp8, fp32 rest", 0.25);
            unsetenv("TANDEM_FP8_REST");
            check_fixture(fix, device, precision, "fp8 (served: bf16 rest)", 0.25);
        } else {
            check_fixture(fix, device, precision, precision, tol);
        }
        free(names[i]);
    }
    return tst_report();
}
