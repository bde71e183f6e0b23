/* tests/test_dt_live.c — `drafter-trainer train --server` against a real `target-server serve
 * --model models/tiny-qwen35 --encoding zstd-byteplane` process over loopback: the live run logs
 * the same losses as training from batch files holding the dump rounded to BF16 (what the
 * server sends), and metrics carry wait_s and compute_s; a run stopped and resumed live gives
 * the same losses; two trainers on one server at once both finish with those losses; a
 * server killed with SIGKILL mid-run and restarted on the same endpoint lets the run continue
 * with the same losses; `--server a,b` alternates steps between two servers with the same losses;
 * a server of another target is refused with a clear message; --shards
 * with --server and a bad --credits are usage errors. */
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_safetensors.h"
#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define N_BATCHES 12
#define N_STEPS   24 /* two epochs */

static char tmp[256], config[512], csv_tok[8192], csv_bf[8192], ref[65536];
static int  n_ref;

// ---- servers

/* Starts serve --model model bound to bind (BF16 zstd-byteplane answers); the resolved endpoint
 * into ep_out. */
static pid_t serve_start(const char *model, const char *bind, const char *tag, char *ep_out, size_t cap) {
    char name[64];
    snprintf(name, sizeof name, "serve-%s", tag);
    return dtd_serve(model, bind, tmp, name, "zstd-byteplane", ep_out, cap);
}

// ---- data: token-only batch files and batch files with the dump's taps rounded to BF16

static int make_data(void) {
    static char csv_dump[8192];
    return dtd_make_tok_bf(tmp, N_BATCHES, 11, csv_dump, csv_tok, csv_bf, sizeof csv_tok, NULL);
}

// ---- helpers

/* RUN/metrics.jsonl's "loss" and "tau" texts, one line each step, into out; *timed counts the
 * lines with wait_s and compute_s, their sums into *wait and *compute. */
static int read_losses(const char *run, char *out, size_t cap, int *n, int *timed, double *wait,
                       double *compute) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", tmp, run);
    return tst_read_losses(path, out, cap, n, timed, wait, compute);
}

static int count_lines(const char *run) {
    return tst_metrics_lines(tmp, run);
}

/* Starts a train run RUN (stderr into RUN.err); server NULL = from csv_bf. */
static pid_t train_start(const char *run, const char *target, const char *server, const char *steps,
                         int resume) {
    static char out[512], err[512];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s/%s.err", tmp, run);
    char *argv[32] = {DTD_DT_BIN,      "train",
                      "--config",      config,
                      "--target",      (char *)target,
                      "--data",        server ? csv_tok : csv_bf,
                      "--out",         out,
                      "--steps",       (char *)steps,
                      "--seed",        "3",
                      "--lr",          "3e-3",
                      "--max-anchors", "16",
                      "--log-level",   "warn"};
    int   n = 20;
    if (server) {
        argv[n++] = "--server";
        argv[n++] = (char *)server;
        argv[n++] = "--credits";
        argv[n++] = "2";
        argv[n++] = "--timeout-ms";
        argv[n++] = "60000";
    }
    if (resume)
        argv[n++] = "--resume";
    argv[n] = NULL;
    return tst_spawn(argv, err);
}

static int train(const char *run, const char *target, const char *server, const char *steps, int resume) {
    return tst_finish(train_start(run, target, server, steps, resume), 120000);
}

static const char *err_text(const char *run) {
    return tst_err_in(tmp, run);
}

/* The run's losses equal the offline run's first n (n = its line count); 1 if so. */
static int same_as_ref(const char *run, int want_n, double *wait, double *compute) {
    static char a[65536];
    int         n = 0, timed = 0;
    if (!read_losses(run, a, sizeof a, &n, &timed, wait, compute) || n != want_n || timed != n)
        return fprintf(stderr, "%s: %d metrics lines (%d timed), expected %d\n", run, n, timed, want_n), 0;
    if (strncmp(a, ref, strlen(a)) != 0)
        return fprintf(stderr, "%s:\n%s\noffline:\n%s\n", run, a, ref), 0;
    return 1;
}

// ---- the tests

static pid_t server = -1;
static char  endpoint[256];

static void test_live_same(void) {
    double w = 0, c = 0;
    TST_CHECK(train("live", DTD_MODEL, endpoint, "14", 0) == 0);
    TST_CHECK(same_as_ref("live", 14, &w, &c));
    fprintf(stderr, "live 14 steps: waited %.3f s for hidden states, computed %.3f s\n", w, c);
    /* stopped after 5 steps and resumed live from the cursor */
    TST_CHECK(train("live-resume", DTD_MODEL, endpoint, "5", 0) == 0);
    TST_CHECK(train("live-resume", DTD_MODEL, endpoint, "14", 1) == 0);
    TST_CHECK(same_as_ref("live-resume", 14, &w, &c));
}

static void test_two_trainers(void) {
    pid_t a = train_start("two-a", DTD_MODEL, endpoint, "14", 0);
    pid_t b = train_start("two-b", DTD_MODEL, endpoint, "14", 0);
    int   ra = a < 0 ? -1 : tst_wait_exit(a, 120000), rb = b < 0 ? -1 : tst_wait_exit(b, 120000);
    TST_CHECK(ra == 0 && rb == 0);
    if (ra != 0 || rb != 0)
        fprintf(stderr, "two-a: %s\ntwo-b: %s\n", err_text("two-a"), err_text("two-b"));
    double w, c;
    TST_CHECK(same_as_ref("two-a", 14, &w, &c));
    TST_CHECK(same_as_ref("two-b", 14, &w, &c));
}

static void test_server_killed(void) {
    pid_t t = train_start("killed", DTD_MODEL, endpoint, "24", 0);
    TST_CHECK(t > 0);
    if (t < 0)
        return;
    for (int i = 0; i < 30000 && count_lines("killed") < 3 && tst_wait_exit(t, 0) < 0; i++)
        tst_sleep_ms(2);
    kill(server, SIGKILL);
    waitpid(server, NULL, 0);
    server = -1;
    int at_kill = count_lines("killed");
    TST_CHECK(at_kill >= 3 && at_kill < N_STEPS);
    tst_sleep_ms(500);
    char again[256];
    server = serve_start(DTD_MODEL, endpoint, "restart", again, sizeof again);
    TST_CHECK(server > 0 && strcmp(again, endpoint) == 0);
    int rc = tst_wait_exit(t, 120000);
    if (rc < 0) {
        kill(t, SIGKILL);
        waitpid(t, NULL, 0);
    }
    TST_CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "killed: %s\n", err_text("killed"));
    double w, c;
    TST_CHECK(same_as_ref("killed", N_STEPS, &w, &c));
    fprintf(stderr, "server killed after %d of %d steps; the run waited %.3f s in all\n", at_kill, N_STEPS,
            w);
}

/* `--server a,b`: steps alternate between two servers of the same target; the losses are the
 * offline reference's, and both servers answered half of the requests (target-server status).
 * Two servers of different targets, or one named twice, are refused. */
static void test_two_servers(void) {
    char  second[256], both[600], status[1024];
    pid_t s2 = serve_start(DTD_MODEL, "tcp://127.0.0.1:*", "second", second, sizeof second);
    TST_CHECK(s2 > 0);
    if (s2 < 0)
        return;
    snprintf(both, sizeof both, "%s,%s", endpoint, second);
    TST_CHECK(train("two-servers", DTD_MODEL, both, "14", 0) == 0);
    double w, c;
    TST_CHECK(same_as_ref("two-servers", 14, &w, &c));
    /* each served 7 of the 14 steps (plus none twice) */
    snprintf(status, sizeof status, "'%s' status --server %s --json", DTD_TS_BIN, second);
    FILE *f = popen(status, "r");
    char  out[8192] = "";
    if (f) {
        size_t n = fread(out, 1, sizeof out - 1, f);
        out[n] = '\0';
        pclose(f);
    }
    TST_CHECK(strstr(out, "\"answers\":7,") != NULL);
    if (!strstr(out, "\"answers\":7,"))
        fprintf(stderr, "second server's status: %s\n", out);
    char dup[600];
    snprintf(dup, sizeof dup, "%s,%s", endpoint, endpoint);
    TST_CHECK(train("r-dup", DTD_MODEL, dup, "2", 0) == 1 && strstr(err_text("r-dup"), "twice") != NULL);
    tst_stop(&s2);
    char other_ep[256], model[600], mixed[600];
    snprintf(model, sizeof model, "%s/fixtures/target/qwen35_mm_sharded/model", TANDEM_TEST_DATA);
    pid_t other = serve_start(model, "tcp://127.0.0.1:*", "other2", other_ep, sizeof other_ep);
    if (other > 0) {
        snprintf(mixed, sizeof mixed, "%s,%s", endpoint, other_ep);
        TST_CHECK(train("r-mixed", DTD_MODEL, mixed, "2", 0) == 1);
        TST_CHECK(strstr(err_text("r-mixed"), other_ep) != NULL);
        tst_stop(&other);
    }
    fprintf(stderr, "two servers: 14 steps alternating, losses as offline; the second served 7\n");
}

/* A server of random weights (`serve --init random --seed 7`, for benchmarks without a
 * checkpoint) is refused by a trainer of the real checkpoint and by one told another seed, and
 * trains a trainer told `--target-init random --target-seed 7` (whose frozen matrices are random
 * too). */
static void test_random_target(void) {
    char  ep[256], log[512], epf[512], cfgp[600];
    snprintf(log, sizeof log, "%s/serve-random.log", tmp);
    snprintf(epf, sizeof epf, "%s/serve-random.ep", tmp);
    snprintf(cfgp, sizeof cfgp, "%s/config.json", DTD_MODEL);
    char *sargv[] = {DTD_TS_BIN, "serve", "--init", "random", "--config", cfgp, "--seed", "7", "--bind",
                     "tcp://127.0.0.1:*", "--endpoint-file", epf, "--encoding", "zstd-byteplane", NULL};
    pid_t srv = tst_spawn(sargv, log);
    int   up = tst_await_endpoint(srv, epf, log, ep, sizeof ep, 30000);
    TST_CHECK(up);
    if (!up)
        return;
    TST_CHECK(train("rnd-real", DTD_MODEL, ep, "2", 0) == 1 && strstr(err_text("rnd-real"), "another model"));
    char out[512], err[512];
    const char *seeds[2] = {"8", "7"};
    for (int k = 0; k < 2; k++) {
        snprintf(out, sizeof out, "%s/rnd-%s", tmp, seeds[k]);
        snprintf(err, sizeof err, "%s/rnd-%s.err", tmp, seeds[k]);
        char *argv[] = {DTD_DT_BIN, "train", "--config", config, "--target", cfgp, "--target-init", "random",
                        "--target-seed", (char *)seeds[k], "--data", csv_tok, "--server", ep, "--out", out,
                        "--steps", "3", "--max-anchors", "16", "--timeout-ms", "30000", NULL};
        int rc = tst_run(argv, err);
        if (k == 0)
            TST_CHECK(rc == 1 && strstr(tst_slurp(err), "another model"));
        else
            TST_CHECK(rc == 0);
        if (k == 1 && rc != 0)
            fprintf(stderr, "rnd-7: %s\n", tst_slurp(err));
    }
    TST_CHECK(count_lines("rnd-7") == 3);
    tst_stop(&srv);
    fprintf(stderr, "random-weights server: refused by the checkpoint's trainer and by another seed; 3 steps with "
                    "--target-init random --target-seed 7\n");
}

static void test_refusals(void) {
    /* a server of another target */
    char other_ep[256], model[600];
    snprintf(model, sizeof model, "%s/fixtures/target/qwen35_mm_sharded/model", TANDEM_TEST_DATA);
    pid_t other = serve_start(model, "tcp://127.0.0.1:*", "other", other_ep, sizeof other_ep);
    TST_CHECK(other > 0);
    if (other > 0) {
        TST_CHECK(train("r-other", DTD_MODEL, other_ep, "2", 0) == 1);
        TST_CHECK(strstr(err_text("r-other"), "another model") != NULL);
        tst_stop(&other);
    }
    /* nobody listening */
    char *argv[] = {DTD_DT_BIN,     "train", "--config", config, "--target", DTD_MODEL,
                    "--data",       csv_tok, "--out",    "",     "--server", "tcp://127.0.0.1:1",
                    "--timeout-ms", "1000",  NULL};
    char  out[512], err[512];
    snprintf(out, sizeof out, "%s/r-none", tmp);
    snprintf(err, sizeof err, "%s/r-none.err", tmp);
    argv[9] = out;
    TST_CHECK(tst_run(argv, err) == 1 && strstr(tst_slurp(err), "no target-server answered") != NULL);
    /* nobody there for longer: a progress line every 5 s while connecting (it was silent until the
     * deadline, 300 s by default), naming the endpoint, the time so far and the deadline */
    char nothing[300];
    snprintf(nothing, sizeof nothing, "ipc://%s/nothing.sock", tmp);
    argv[11] = nothing;
    argv[13] = "6400";
    TST_CHECK(tst_run(argv, err) == 1);
    const char *log = tst_slurp(err);
    char        want[400];
    snprintf(want, sizeof want, "connecting to '%s': no WELCOME after 5 s of 6 s (--timeout-ms 6400)",
             nothing);
    /* the hint is the trainer's ("is `target-server serve` running there?") until the client's own
     * WELCOME timeout has fired, then the client's ("is the target-server running there?"): on a
     * loaded machine either comes first */
    const int ok = strstr(log, want) && strstr(log, "no socket file at that path") && strstr(log, "running there?") &&
                   strstr(log, "no target-server answered");
    TST_CHECK(ok);
    if (!ok)
        fprintf(stderr, "train --server %s:\n%s\n", nothing, log);
    /* usage errors */
    char *both[] = {DTD_DT_BIN, "train", "--config", config, "--target", DTD_MODEL, "--data", csv_tok,
                    "--out",    out,     "--shards", tmp,    "--server", endpoint,  NULL};
    TST_CHECK(tst_run(both, err) == 2 && strstr(tst_slurp(err), "--shards or --server") != NULL);
    char *cred[] = {DTD_DT_BIN, "train", "--config", config,   "--target",  DTD_MODEL, "--data", csv_tok,
                    "--out",    out,     "--server", endpoint, "--credits", "0",       NULL};
    TST_CHECK(tst_run(cred, err) == 2 && strstr(tst_slurp(err), "--credits") != NULL);
    char *enc[] = {DTD_DT_BIN, "train", "--config", config,   "--target",   DTD_MODEL, "--data", csv_tok,
                   "--out",    out,     "--server", endpoint, "--encoding", "lz4",     NULL};
    TST_CHECK(tst_run(enc, err) == 2 && strstr(tst_slurp(err), "--encoding") != NULL);
}

int main(void) {
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    setenv("OMP_NUM_THREADS", "1", 1);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-live-%d", (int)getpid());
    mkdir(tmp, 0700);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    if (!dtd_write_config(config, 1) || !make_data()) {
        TST_CHECK(0);
        return tst_report();
    }
    /* the offline reference: N_STEPS steps from batch files of the dump rounded to BF16 */
    double w, c;
    int    timed = 0;
    TST_CHECK(train("offline", DTD_MODEL, NULL, "24", 0) == 0);
    TST_CHECK(read_losses("offline", ref, sizeof ref, &n_ref, &timed, &w, &c) && n_ref == N_STEPS &&
              timed == N_STEPS);
    server = serve_start(DTD_MODEL, "tcp://127.0.0.1:*", "main", endpoint, sizeof endpoint);
    if (server < 0 || n_ref != N_STEPS) {
        TST_CHECK(0);
        tst_stop(&server);
        return tst_report();
    }
    test_live_same();
    test_two_trainers();
    test_two_servers();
    test_random_target();
    test_server_killed();
    test_refusals();
    tst_stop(&server);
    return tst_cleanup(tmp, tst_report()); /* logs are kept for a failed run */
}
