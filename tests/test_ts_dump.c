/* tests/test_ts_dump.c — `target-server dump` against the Hugging Face Transformers oracle
 * (tests/oracle/make_target_fixtures.py, float64 references) on every committed fixture:
 * every layer, the final norm and the logits, relative L2 error per tensor.
 *   test_ts_dump cpu          tolerance 1e-4 (unit)
 *   test_ts_dump cuda bf16    tolerance 3e-2 (gpu; exits 77 without a GPU)
 *   test_ts_dump cuda fp32    tolerance 1e-3 (gpu) */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_safetensors.h"
#include "kn_backend.h"
#include "tst.h"
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

static void check_fixture(const char *fix, const char *device, const char *precision, double tol) {
    char model[2048], input[2048], ref_path[2048], out[256], err[256];
    snprintf(model, sizeof model, "%s/model", fix);
    snprintf(input, sizeof input, "%s/input.safetensors", fix);
    snprintf(ref_path, sizeof ref_path, "%s/ref.safetensors", fix);
    snprintf(out, sizeof out, "/tmp/tandem-dump-%d.safetensors", (int)getpid());
    snprintf(err, sizeof err, "/tmp/tandem-dump-%d.err", (int)getpid());
    char  bin[1024];
    snprintf(bin, sizeof bin, "%s/target-server/target-server", TANDEM_BINARY_DIR);
    char *argv[] = {bin, "dump", "--model", model, "--input", input, "--out", out, "--device", (char *)device,
                    "--precision", (char *)precision, "--logits", "--log-level", "warn", NULL};
    int rc = tst_run(argv, err);
    TST_CHECK(rc == 0);
    if (rc != 0) {
        fprintf(stderr, "%s: dump exited %d:\n%s\n", fix, rc, tst_slurp(err));
        return;
    }
    cm_st *ref = NULL, *got = NULL;
    TST_CHECK(cm_st_open_file(&ref, ref_path) == CM_OK);
    TST_CHECK(cm_st_open_file(&got, out) == CM_OK);
    if (!ref || !got) {
        fprintf(stderr, "%s\n", cm_last_error());
        goto done;
    }
    double worst = 0;
    int    n_cmp = 0;
    for (int i = 0; i < cm_st_count(ref); i++) {
        const cm_st_tensor *r = cm_st_at(ref, i);
        const cm_st_tensor *g = cm_st_find(got, r->name);
        TST_CHECK(g != NULL);
        if (!g) {
            fprintf(stderr, "%s: dump lacks '%s'\n", fix, r->name);
            continue;
        }
        TST_CHECK(g->dtype == CM_DTYPE_F32 && g->n_dims == r->n_dims);
        TST_CHECK(g->shape[0] == r->shape[0] && g->shape[1] == r->shape[1]);
        long n = (long)(r->shape[0] * r->shape[1]);
        if (g->shape[0] * g->shape[1] != n) continue;
        float *gv = malloc((size_t)n * sizeof *gv);
        memcpy(gv, g->data, (size_t)n * sizeof *gv);
        double e = rel_l2_f32_f64(gv, r->data, r->dtype, n);
        free(gv);
        TST_CHECK(e <= tol);
        if (e > worst) worst = e;
        if (e > tol) fprintf(stderr, "%s: %s relative L2 %.3e > %.1e\n", fix, r->name, e, tol);
        n_cmp++;
    }
    TST_CHECK(n_cmp >= 3);
    printf("%-40s %-5s %-5s %2d tensors, worst relative L2 %.3e (tolerance %.0e)\n", strrchr(fix, '/') + 1,
           device, precision, n_cmp, worst, tol);
done:
    cm_st_destroy(&ref);
    cm_st_destroy(&got);
    unlink(out);
    unlink(err);
}

int main(int argc, char **argv) {
    const char *device    = argc > 1 ? argv[1] : "cpu";
    const char *precision = argc > 2 ? argv[2] : "bf16";
    double      tol       = 1e-4;
    if (strcmp(device, "cuda") == 0) {
        tst_need_cuda();
        tol = strcmp(precision, "fp32") == 0 ? 1e-3 : 3e-2;
    }
    char root[1024];
    snprintf(root, sizeof root, "%s/fixtures/target", TANDEM_TEST_DATA);
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
    for (int i = 0; i < n; i++) {
        char fix[1400];
        snprintf(fix, sizeof fix, "%s/%s", root, names[i]);
        check_fixture(fix, device, precision, tol);
        free(names[i]);
    }
    return tst_report();
}
