/* tests/test_dt_train.c — `drafter-trainer train` end to end, as real processes: a small
 * fixed training set with real hidden states of models/tiny-qwen35 (tests/dt_train_data.h),
 * a tiny 2-layer drafter trained for 204 steps (34 epochs of 6 batches, 16 anchors each) whose loss must fall
 * clearly and whose τ must rise (read from metrics.jsonl); then resume exactness: run A takes 24 steps
 * straight with checkpoints, run B stops at step 10 and resumes to 24; every logged loss, τ and lr and the
 * final checkpoint files must be bit-identical; the same for a DFlash2 drafter with the selector's α
 * ramped and the drop policy, whose metrics carry the selector's fields and whose resume refuses another
 * α. Set DT_TRAIN_KEEP=1 to keep the work dir. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"

#define MAX_STEPS 1024

static char tmp[256], config[512], config2[512], csv[8192];
static const char *cur_config = config; /* the drafter config train() uses */

typedef struct metrics {
    int    n;
    double loss[MAX_STEPS], tau[MAX_STEPS], lr[MAX_STEPS];
    char   text[MAX_STEPS][160]; /* "loss ... tau ... lr ..." as printed, for bitwise equality */
} metrics;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Reads RUN/metrics.jsonl; steps must be 1, 2, ... in order. */
static int read_metrics(const char *run, metrics *m) {
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[4096];
    m->n = 0;
    int ok = 1;
    while (fgets(line, sizeof line, f) && m->n < MAX_STEPS) {
        long long   step = -1;
        const char *l = tst_field(line, "\"loss\": "), *t = tst_field(line, "\"tau\": "),
                   *r = tst_field(line, "\"lr\": ");
        if (sscanf(line, "{\"step\": %lld", &step) != 1 || step != m->n + 1 || !l || !t || !r) {
            ok = 0;
            break;
        }
        m->loss[m->n] = strtod(l, NULL);
        m->tau[m->n] = strtod(t, NULL);
        m->lr[m->n] = strtod(r, NULL);
        snprintf(m->text[m->n], sizeof m->text[m->n], "%.*s|%.*s|%.*s", (int)strcspn(l, ","), l,
                 (int)strcspn(t, ","), t, (int)strcspn(r, ","), r);
        m->n++;
    }
    fclose(f);
    return ok;
}

/* DFlash2 runs add these flags (NULL-terminated) */
static const char *const *sel_flags;

static int train(const char *run, const char *extra1, const char *extra2, const char *extra3,
                 const char *extra4, const char *epochs, const char *errname) {
    char out[512], err[512];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    char       *argv[40] = {DTD_DT_BIN,    "train", "--config",    (char *)cur_config, "--target",      DTD_MODEL,
                            "--data",      csv,     "--out",       out,    "--epochs",      (char *)epochs,
                            "--seed",      "3",     "--lr",        "3e-3", "--max-anchors", "16",
                            "--log-every", "50",    "--log-level", "warn"};
    int         n = 20;
    const char *x[4] = {extra1, extra2, extra3, extra4};
    for (int i = 0; i < 4; i++)
        if (x[i])
            argv[n++] = (char *)x[i];
    for (int i = 0; sel_flags && sel_flags[i] && n < 38; i++)
        argv[n++] = (char *)sel_flags[i];
    argv[n] = NULL;
    int rc = tst_run(argv, err);
    if (rc != 0)
        fprintf(stderr, "drafter-trainer train (%s) exited %d: %s\n", run, rc, tst_slurp(err));
    return rc;
}

static double mean(const double *x, int n) {
    double s = 0;
    for (int i = 0; i < n; i++)
        s += x[i];
    return s / n;
}

static void test_learns(void) {
    double t0 = now_s();
    TST_CHECK(train("learn", NULL, NULL, NULL, NULL, "34", "learn") == 0);
    double   secs = now_s() - t0;
    metrics *m = calloc(1, sizeof *m);
    char     run[512];
    snprintf(run, sizeof run, "%s/learn", tmp);
    TST_CHECK(read_metrics(run, m));
    TST_CHECK(m->n == 204);
    if (m->n == 204) {
        double l0 = mean(m->loss, 20), l1 = mean(m->loss + 184, 20);
        double t0m = mean(m->tau, 20), t1m = mean(m->tau + 184, 20);
        fprintf(stderr, "learning run: 204 steps in %.1f s; loss %.4f -> %.4f, tau %.4f -> %.4f\n", secs, l0,
                l1, t0m, t1m);
        TST_CHECK(l1 < 0.6 * l0);
        TST_CHECK(t1m > t0m + 0.3);
    }
    free(m);
}

static void test_resume_exact(const char *tag) {
    char a[512], b[512], ra[32], rb[32], eb1[40], eb2[40];
    snprintf(ra, sizeof ra, "run-a%s", tag);
    snprintf(rb, sizeof rb, "run-b%s", tag);
    snprintf(eb1, sizeof eb1, "%s1", rb);
    snprintf(eb2, sizeof eb2, "%s2", rb);
    snprintf(a, sizeof a, "%s/%s", tmp, ra);
    snprintf(b, sizeof b, "%s/%s", tmp, rb);
    /* A: 24 steps (4 epochs of 6 batches) straight, checkpoints at 8, 16, 24 */
    TST_CHECK(train(ra, "--save-every", "8", NULL, NULL, "4", ra) == 0);
    /* B: stops after step 10 (mid-epoch, checkpoints 8 and 10), then resumes to 24 */
    TST_CHECK(train(rb, "--save-every", "8", "--steps", "10", "4", eb1) == 0);
    TST_CHECK(train(rb, "--save-every", "8", "--resume", NULL, "4", eb2) == 0);

    metrics *ma = calloc(1, sizeof *ma), *mb = calloc(1, sizeof *mb);
    TST_CHECK(read_metrics(a, ma) && read_metrics(b, mb));
    TST_CHECK(ma->n == 24 && mb->n == 24);
    int same = ma->n == mb->n;
    for (int i = 0; same && i < ma->n; i++)
        if (strcmp(ma->text[i], mb->text[i]) != 0) {
            fprintf(stderr, "step %d differs: A %s, B %s\n", i + 1, ma->text[i], mb->text[i]);
            same = 0;
        }
    TST_CHECK(same);
    const char *files[] = {"config.json", "model.safetensors", "training_state.safetensors"};
    for (int k = 0; k < 3; k++) {
        char fa[700], fb[700];
        snprintf(fa, sizeof fa, "%s/checkpoints/step-24/%s", a, files[k]);
        snprintf(fb, sizeof fb, "%s/checkpoints/step-24/%s", b, files[k]);
        TST_CHECK(tst_same_file(fa, fb));
        snprintf(fa, sizeof fa, "%s/checkpoints/step-16/%s", a, files[k]);
        snprintf(fb, sizeof fb, "%s/checkpoints/step-16/%s", b, files[k]);
        TST_CHECK(tst_same_file(fa, fb));
    }
    /* a straight run and a resumed one differ from a run with another seed (the check can fail) */
    TST_CHECK(ma->n == 24 && ma->loss[23] != ma->loss[0]);
    free(ma);
    free(mb);
}

/* DFlash2: the same exactness with the selector on (α ramped over the first quarter of the steps, so
 * every resumed step has another α, and the drop policy); the selector's fields in metrics.jsonl, α
 * following the schedule; a resume with another α refused by name. */
static void test_dflash2(void) {
    static const char *const flags[] = {"--selector-alpha", "0.5", "--selector-ramp-ratio", "0.25",
                                        "--selector-miss",  "drop", NULL};
    cur_config = config2;
    sel_flags = flags;
    test_resume_exact("-v2");
    char path[600], line[4096];
    snprintf(path, sizeof path, "%s/run-a-v2/metrics.jsonl", tmp);
    FILE  *f = fopen(path, "r");
    int    n = 0, fields = 1;
    double alpha[24] = {0};
    while (f && fgets(line, sizeof line, f) && n < 24) {
        const char *a = tst_field(line, "\"selector_alpha\": ");
        fields &= a && tst_field(line, "\"loss_selector\": ") && tst_field(line, "\"recall_at_k\": ") &&
                  tst_field(line, "\"selector_tau\": ");
        alpha[n++] = a ? strtod(a, NULL) : -1;
    }
    if (f)
        fclose(f);
    /* ramp over floor(0.25 · 24) = 6 steps: 0.5·k/6 at step k ≤ 6, then 0.5 */
    int ramp = n == 24 && fields;
    for (int k = 1; ramp && k <= 24; k++)
        ramp = fabs(alpha[k - 1] - (k <= 6 ? 0.5 * k / 6 : 0.5)) < 1e-12;
    TST_CHECK(ramp);
    printf("DFlash2 metrics: %d steps with the selector's fields, alpha %.4f at step 1 .. %.4f at step 24%s\n", n,
           alpha[0], alpha[23], ramp ? "" : " (NOT the schedule)");
    /* resuming with another alpha */
    static const char *const other[] = {"--selector-alpha", "0.7", "--selector-ramp-ratio", "0.25",
                                        "--selector-miss",  "drop", NULL};
    sel_flags = other;
    char err[600];
    snprintf(err, sizeof err, "%s/run-a-v2x.err", tmp);
    TST_CHECK(train("run-a-v2", "--resume", NULL, NULL, NULL, "4", "run-a-v2x") == 1);
    TST_CHECK(strstr(tst_slurp(err), "--selector-alpha") != NULL);
    sel_flags = NULL;
    cur_config = config;
}

int main(void) {
    if (!dtd_begin(tmp, sizeof tmp, "/tmp/tandem-dtt-XXXXXX"))
        return 1;
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    TST_CHECK(dtd_write_config(config, 2));
    double t0 = now_s();
    TST_CHECK(dtd_make_batches(tmp, 6, 11, csv, sizeof csv));
    fprintf(stderr, "dataset: 6 batches in %.1f s\n", now_s() - t0);
    snprintf(config2, sizeof config2, "%s/drafter2.json", tmp);
    TST_CHECK(dtd_write_config_kind(config2, 2, 1)); /* DFlash2: convolutions Kc 2 / G 16, rank 8, top-8, non-causal */
    if (tst_failures == 0) {
        test_learns();
        test_resume_exact("");
        test_dflash2();
    }
    return dtd_end(tmp);
}
