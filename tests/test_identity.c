/* tests/test_identity.c — a target is its weights (issue 15, hole 1), with real processes on
 * loopback: a copy of models/tiny-qwen35 with one byte of one tensor changed, served under the
 * original's --name, is refused
 *   a. by a live run whose server was SIGKILLed and came back on the copy at the same endpoint,
 *   b. by a fresh run whose --target is the original (before any step),
 *   c. by training from shards precomputed from the copy,
 *   d. by a --resume of a run trained on the copy with the original as --target (and its
 *      server);
 * and accepted by a run whose --target is the copy. `status` shows the fingerprint. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define N_BATCHES 6

static char tmp[256], config[512], csv[8192], perturbed[512];

static pid_t serve(const char *model, const char *bind, const char *tag, char *endpoint, size_t cap) {
    static const char *const extra[] = {"--name", "tiny-qwen35", NULL};
    char                     path[512];
    snprintf(path, sizeof path, "%s/serve-%s", tmp, tag);
    return tst_serve_start(DTD_TS_BIN, model, bind, path, extra, endpoint, cap, 30000);
}

static void stop(pid_t pid, int sig) {
    tst_end(pid, sig, 15000);
}

/* train RUN against --server ep (or --shards dir), --target target; stderr into RUN.err. */
static pid_t train_start(const char *run, const char *target, const char *ep, const char *shards,
                         const char *epochs, int resume) {
    char out[512], err[600];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s/%s.err", tmp, run);
    char *argv[] = {DTD_DT_BIN,
                    "train",
                    "--config",
                    config,
                    "--target",
                    (char *)target,
                    "--data",
                    csv,
                    "--out",
                    out,
                    "--epochs",
                    (char *)epochs,
                    "--seed",
                    "3",
                    "--lr",
                    "3e-3",
                    "--max-anchors",
                    "16",
                    "--log-level",
                    "warn",
                    "--no-tensorboard",
                    "--progress",
                    "off",
                    ep ? "--server" : "--shards",
                    (char *)(ep ? ep : shards),
                    "--timeout-ms",
                    "20000",
                    resume ? "--resume" : NULL,
                    NULL};
    return tst_spawn(argv, err);
}

static int metrics_lines(const char *run) {
    return tst_metrics_lines(tmp, run);
}

static const char *err_of(const char *run) {
    return tst_err_in(tmp, run);
}

/* Exit 1 with the weights named as the difference. */
static int refused_for_weights(const char *run, int rc) {
    const char *e = err_of(run);
    int         ok = rc == 1 && strstr(e, "same architecture") && strstr(e, "different weights");
    if (!ok)
        fprintf(stderr, "%s: exit %d, expected 1 naming the weights:\n%s\n", run, rc, e);
    else
        fprintf(stderr, "%s refused: %s", run, strstr(e, "train:") ? strstr(e, "train:") : e);
    return ok;
}

/* PERTURBED: the model's config and its weights with one bit of one layer tensor flipped. */
static int make_perturbed(void) {
    snprintf(perturbed, sizeof perturbed, "%s/perturbed", tmp);
    mkdir(perturbed, 0755);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cp %s/config.json %s/", DTD_MODEL, perturbed);
    if (system(cmd) != 0)
        return 0;
    cm_st        *st = NULL;
    cm_st_writer *w = NULL;
    int ok = cm_st_open_dir(&st, DTD_MODEL) == CM_OK && cm_st_writer_create(&w) == CM_OK, flipped = 0;
    for (int i = 0; ok && i < cm_st_count(st); i++) {
        const cm_st_tensor *t = cm_st_at(st, i);
        uint8_t            *b = malloc(t->nbytes ? t->nbytes : 1);
        memcpy(b, t->data, t->nbytes);
        if (!flipped && strstr(t->name, "layers.2.mlp.down_proj.weight"))
            b[6] ^= 0x01, flipped = 1;
        ok = cm_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, b) == CM_OK;
        free(b);
    }
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", perturbed);
    ok = ok && flipped && cm_st_writer_write(w, path) == CM_OK;
    cm_st_writer_destroy(&w);
    cm_st_destroy(&st);
    return ok;
}

int main(void) {
    snprintf(tmp, sizeof tmp, "/tmp/tandem-identity-%d", (int)getpid());
    mkdir(tmp, 0755);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    if (!dtd_write_config(config, 1) || !dtd_make_batches(tmp, N_BATCHES, 11, csv, sizeof csv) ||
        !make_perturbed()) {
        fprintf(stderr, "cannot build the test data in %s\n", tmp);
        return 1;
    }
    char ep[256], ep2[256];

    /* a. the server dies mid-run and comes back at the same endpoint with other weights */
    pid_t s1 = serve(DTD_MODEL, "tcp://127.0.0.1:*", "orig", ep, sizeof ep);
    TST_CHECK(s1 > 0);
    pid_t tr = train_start("reconnect", DTD_MODEL, ep, NULL, "40", 0);
    for (int i = 0; i < 6000 && metrics_lines("reconnect") < 3 && tst_wait_exit(tr, 0) < 0; i++)
        tst_sleep_ms(10);
    int before = metrics_lines("reconnect");
    TST_CHECK(before >= 3);
    stop(s1, SIGKILL);
    pid_t s2 = serve(perturbed, ep, "perturbed", ep2, sizeof ep2);
    TST_CHECK(s2 > 0 && strcmp(ep, ep2) == 0);
    int rc = tst_wait_exit(tr, 60000);
    TST_CHECK(refused_for_weights("reconnect", rc));
    TST_CHECK(strstr(err_of("reconnect"), "now serves another target") != NULL);
    int after = metrics_lines("reconnect");
    TST_CHECK(after < 6 * N_BATCHES); /* it did not train on to the end */
    fprintf(stderr, "reconnect: %d steps before the kill, %d when it stopped\n", before, after);
    if (rc < 0)
        stop(tr, SIGKILL);

    /* b. a fresh run of the original against the copy: refused at connect */
    rc = tst_wait_exit(train_start("fresh", DTD_MODEL, ep, NULL, "1", 0), 60000);
    TST_CHECK(refused_for_weights("fresh", rc) && metrics_lines("fresh") == 0);
    /* the copy's own trainer is served */
    rc = tst_wait_exit(train_start("copy", perturbed, ep, NULL, "1", 0), 60000);
    TST_CHECK(rc == 0 && metrics_lines("copy") == N_BATCHES);
    if (rc != 0)
        fprintf(stderr, "copy: exit %d\n%s\n", rc, err_of("copy"));

    /* status names both identities */
    char cmd[1200], st_out[600];
    snprintf(st_out, sizeof st_out, "%s/status.txt", tmp);
    snprintf(cmd, sizeof cmd, "%s status --server %s --timeout-ms 5000 > %s 2>&1", DTD_TS_BIN, ep, st_out);
    TST_CHECK(system(cmd) == 0 && strstr(tst_slurp(st_out), "weights ") &&
              strstr(tst_slurp(st_out), "(config "));

    /* c. shards precomputed from the copy do not train the original */
    char store[600], log[700];
    snprintf(store, sizeof store, "%s/store", tmp);
    snprintf(log, sizeof log, "%s/precompute.err", tmp);
    char *pargv[] = {DTD_DT_BIN, "precompute", "--server",    ep,     "--data", csv, "--out", store,
                     "--layers", "1,3",        "--log-level", "warn", NULL};
    rc = tst_run(pargv, log);
    TST_CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "precompute: exit %d\n%s\n", rc, tst_slurp(log));
    rc = tst_wait_exit(train_start("shards", DTD_MODEL, NULL, store, "1", 0), 60000);
    TST_CHECK(refused_for_weights("shards", rc) && metrics_lines("shards") == 0);
    rc = tst_wait_exit(train_start("shards-copy", perturbed, NULL, store, "1", 0), 60000);
    TST_CHECK(rc == 0 && metrics_lines("shards-copy") == N_BATCHES);
    stop(s2, SIGTERM);

    /* d. the run trained on the copy, resumed with the original as --target against its server */
    char  ep3[256];
    pid_t s3 = serve(DTD_MODEL, "tcp://127.0.0.1:*", "orig-again", ep3, sizeof ep3);
    TST_CHECK(s3 > 0);
    rc = tst_wait_exit(train_start("copy", DTD_MODEL, ep3, NULL, "2", 1), 60000);
    const char *e = err_of("copy");
    TST_CHECK(rc == 1 && strstr(e, "cannot resume") &&
              strstr(e, "trained on the hidden states of target weights"));
    TST_CHECK(metrics_lines("copy") == N_BATCHES);
    if (rc == 1)
        fprintf(stderr, "resume refused: %s", strstr(e, "train:") ? strstr(e, "train:") : e);
    stop(s3, SIGTERM);

    return tst_cleanup(tmp, tst_report());
}
