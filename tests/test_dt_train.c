/* tests/test_dt_train.c — `drafter-trainer train` end to end, as real processes: a small
 * fixed training set with real hidden states of models/tiny-qwen35 (tests/dt_train_data.h),
 * a tiny 2-layer drafter trained for 204 steps (34 epochs of 6 batches, 16 anchors each) whose loss must fall
 * clearly and whose τ must rise (read from metrics.jsonl); then resume exactness: run A takes 24 steps
 * straight with checkpoints, run B stops at step 10 and resumes to 24; every logged loss, τ and lr and the
 * final checkpoint files must be bit-identical. Set DT_TRAIN_KEEP=1 to keep the work dir. */
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

static char tmp[256], config[512], csv[8192];

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

static int train(const char *run, const char *extra1, const char *extra2, const char *extra3,
                 const char *extra4, const char *epochs, const char *errname) {
    char out[512], err[512];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    char       *argv[32] = {DTD_DT_BIN,    "train", "--config",    config, "--target",      DTD_MODEL,
                            "--data",      csv,     "--out",       out,    "--epochs",      (char *)epochs,
                            "--seed",      "3",     "--lr",        "3e-3", "--max-anchors", "16",
                            "--log-every", "50",    "--log-level", "warn"};
    int         n = 20;
    const char *x[4] = {extra1, extra2, extra3, extra4};
    for (int i = 0; i < 4; i++)
        if (x[i])
            argv[n++] = (char *)x[i];
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

static void test_resume_exact(void) {
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/run-a", tmp);
    snprintf(b, sizeof b, "%s/run-b", tmp);
    /* A: 24 steps (4 epochs of 6 batches) straight, checkpoints at 8, 16, 24 */
    TST_CHECK(train("run-a", "--save-every", "8", NULL, NULL, "4", "run-a") == 0);
    /* B: stops after step 10 (mid-epoch, checkpoints 8 and 10), then resumes to 24 */
    TST_CHECK(train("run-b", "--save-every", "8", "--steps", "10", "4", "run-b1") == 0);
    TST_CHECK(train("run-b", "--save-every", "8", "--resume", NULL, "4", "run-b2") == 0);

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

int main(void) {
    if (!dtd_begin(tmp, sizeof tmp, "/tmp/tandem-dtt-XXXXXX"))
        return 1;
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    TST_CHECK(dtd_write_config(config, 2));
    double t0 = now_s();
    TST_CHECK(dtd_make_batches(tmp, 6, 11, csv, sizeof csv));
    fprintf(stderr, "dataset: 6 batches in %.1f s\n", now_s() - t0);
    if (tst_failures == 0) {
        test_learns();
        test_resume_exact();
    }
    return dtd_end(tmp);
}
