/* tests/test_dt_rundir.c — one trainer per run directory (RUN_DIR/trainer.lock, cm_lock.h),
 * with real drafter-trainer processes on the tiny drafter of dt_train_data.h:
 *  - while a trainer runs, a second one on its --out (with --resume, or as a fresh run) exits 1
 *    with one line naming the first one's pid, and the first one's metrics.jsonl is untouched
 *    (before the lock, the second's trim renamed it under the first: 26 ledger rows lost);
 *  - killed with SIGKILL, the holder leaves no stale lock: --resume continues, and the ledger
 *    holds every step once;
 *  - two data-parallel ranks given one --out: the second is refused and told each rank needs
 *    its own (every rank writes its own metrics and checkpoints);
 *  - leftovers: step-<N>.tmp/, latest.tmp and metrics.jsonl.tmp from an unfinished save or trim
 *    are removed when the next trainer takes the directory; a save that fails removes its
 *    step-<N>.tmp/, and a trim that fails (a file size limit) its metrics.jsonl.tmp. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dt_train_data.h"
#include "tst.h"

static char tmp[256], config[512], csv[8192];

/* The argv of drafter-trainer train on the 3 batch files with epochs, then extra. */
static void build_argv(const char **argv, const char *out, const char *epochs, const char *const *extra) {
    static char o[8][512];
    static int  k;
    char       *ob = o[k++ % 8];
    snprintf(ob, 512, "%s/%s", tmp, out);
    const char *base[] = {DTD_DT_BIN,    "train", "--target",   DTD_MODEL, "--data",        csv,
                          "--out",       ob,      "--epochs",   epochs,    "--seed",        "3",
                          "--lr",        "3e-3",  "--config",   config,    "--max-anchors", "8",
                          "--log-level", "warn",  "--progress", "off"};
    int         n = 0;
    for (; n < 22; n++)
        argv[n] = base[n];
    for (int i = 0; extra && extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
}

static const char *errp(const char *name) {
    static char p[8][512];
    static int  k;
    char       *b = p[k++ % 8];
    snprintf(b, 512, "%s/%s.err", tmp, name);
    return b;
}

static int train(const char *out, const char *errname, const char *epochs, const char *const *extra) {
    const char *argv[48];
    build_argv(argv, out, epochs, extra);
    return tst_run((char *const *)argv, errp(errname));
}

/* Lines of RUN_DIR/metrics.jsonl, and whether they are steps 1..n in order. */
static int ledger(const char *out, int *in_order) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", tmp, out);
    FILE *f = fopen(p, "r");
    int   n = 0, ok = 1;
    char  line[4096];
    while (f && fgets(line, sizeof line, f)) {
        long s = -1;
        ok &= sscanf(line, "{\"step\": %ld", &s) == 1 && s == n + 1;
        n++;
    }
    if (f)
        fclose(f);
    if (in_order)
        *in_order = ok;
    return n;
}

static int exists(const char *out, const char *rel) {
    char p[700];
    snprintf(p, sizeof p, "%s/%s/%s", tmp, out, rel);
    return access(p, F_OK) == 0;
}

static int one_line(const char *text) {
    return text[0] && strchr(text, '\n') == text + strlen(text) - 1;
}

// ---- one trainer per run directory

static void test_twin(void) {
    /* the first trainer: 1000 epochs of 3 batches, a checkpoint every 10 steps */
    const char *first[] = {"--save-every", "10", NULL}, *argv[48];
    build_argv(argv, "twin", "1000", first);
    pid_t a = tst_spawn((char *const *)argv, errp("twin-a"));
    TST_CHECK(a > 0);
    for (int i = 0; i < 600 && !exists("twin", "checkpoints/step-10"); i++)
        tst_sleep_ms(50);
    TST_CHECK(exists("twin", "checkpoints/step-10"));
    char want[80];
    snprintf(want, sizeof want, "is in use by another trainer, pid %ld on host ", (long)a);
    const char *resume[] = {"--resume", "--save-every", "10", NULL};
    const char *modes[2][2] = {{"twin-b", "resume"}, {"twin-c", "fresh"}};
    for (int k = 0; k < 2; k++) {
        int         before = ledger("twin", NULL);
        int         rc = train("twin", modes[k][0], "1000", k == 0 ? resume : first);
        const char *e = tst_slurp(errp(modes[k][0]));
        int         ok = rc == 1 && one_line(e) && strstr(e, want) && strstr(e, "/twin/trainer.lock") &&
                 strstr(e, "stop that trainer or let it finish, or choose another --out");
        if (!ok)
            fprintf(stderr, "second trainer (%s): exit %d, expected 1 naming pid %ld; stderr: %s\n",
                    modes[k][1], rc, (long)a, e);
        TST_CHECK(ok);
        /* the first one's ledger is still its own file, and growing (polled: a loaded machine may
         * take more than a few hundred ms for the next step) */
        int grew = 0;
        for (int i = 0; i < 400 && !(grew = ledger("twin", NULL) > before); i++)
            tst_sleep_ms(25);
        TST_CHECK(grew);
    }
    /* killed: its lock goes with it, and a resume picks up from its latest checkpoint */
    kill(a, SIGKILL);
    TST_CHECK(tst_wait_exit(a, 20000) == 128 + SIGKILL);
    TST_CHECK(exists("twin", "trainer.lock"));
    char lp[600];
    snprintf(lp, sizeof lp, "%s/twin/checkpoints/latest", tmp);
    long latest = -1;
    sscanf(tst_slurp(lp), "step-%ld", &latest);
    TST_CHECK(latest >= 10);
    char steps[32];
    snprintf(steps, sizeof steps, "%ld", latest + 7);
    const char *more[] = {"--resume", "--save-every", "10", "--steps", steps, NULL};
    TST_CHECK(train("twin", "twin-d", "1000", more) == 0);
    int in_order = 0;
    TST_CHECK(ledger("twin", &in_order) == latest + 7 && in_order);
}

static void test_dp_share(void) {
    const char *r0[] = {"--dp-rank", "0", "--dp-size", "2", NULL};
    const char *r1[] = {"--dp-rank", "1", "--dp-size", "2", NULL};
    const char *argv[48];
    build_argv(argv, "dp", "1000", r0);
    pid_t a = tst_spawn((char *const *)argv, errp("dp-0"));
    TST_CHECK(a > 0);
    for (int i = 0; i < 600 && ledger("dp", NULL) < 2; i++)
        tst_sleep_ms(50);
    int         rc = train("dp", "dp-1", "1000", r1);
    const char *e = tst_slurp(errp("dp-1"));
    char        want[80];
    snprintf(want, sizeof want, "in use by another trainer, pid %ld", (long)a);
    TST_CHECK(rc == 1 && strstr(e, want) && strstr(e, "each data-parallel rank needs its own --out"));
    kill(a, SIGKILL);
    TST_CHECK(tst_wait_exit(a, 20000) == 128 + SIGKILL);
    /* each rank on its own --out is fine */
    const char *s0[] = {"--dp-rank", "0", "--dp-size", "2", "--steps", "2", NULL};
    const char *s1[] = {"--dp-rank", "1", "--dp-size", "2", "--steps", "2", NULL};
    TST_CHECK(train("dp/rank-0", "dp-r0", "2", s0) == 0 && train("dp/rank-1", "dp-r1", "2", s1) == 0);
}

// ---- leftovers

static void test_leftovers(void) {
    const char *two[] = {"--save-every", "2", "--steps", "2", NULL};
    TST_CHECK(train("left", "left-1", "2", two) == 0);
    /* a save of step 5 and a trim that died: never saved again at step 5 (--steps 4) */
    char p[1400];
    snprintf(p, sizeof p,
             "cd '%s/left' && mkdir -p checkpoints/step-5.tmp && echo junk > "
             "checkpoints/step-5.tmp/model.safetensors "
             "&& echo step-5 > checkpoints/latest.tmp && echo junk > metrics.jsonl.tmp",
             tmp);
    TST_CHECK(system(p) == 0);
    const char *four[] = {"--resume", "--save-every", "2", "--steps", "4", NULL};
    TST_CHECK(train("left", "left-2", "2", four) == 0);
    TST_CHECK(!exists("left", "checkpoints/step-5.tmp") && !exists("left", "checkpoints/latest.tmp") &&
              !exists("left", "metrics.jsonl.tmp"));
    TST_CHECK(exists("left", "checkpoints/step-4/model.safetensors"));

    /* a save that fails after its files are written (the stale step-6 cannot be replaced: it
     * holds a directory) removes its step-6.tmp */
    snprintf(p, sizeof p, "mkdir -p '%s/left/checkpoints/step-6/sub'", tmp);
    TST_CHECK(system(p) == 0);
    const char *six[] = {"--resume", "--save-every", "2", NULL};
    int         rc = train("left", "left-3", "2", six);
    const char *e = tst_slurp(errp("left-3"));
    TST_CHECK(rc == 1 && strstr(e, "cannot remove") && one_line(e));
    TST_CHECK(!exists("left", "checkpoints/step-6.tmp"));
    snprintf(p, sizeof p, "rm -rf '%s/left/checkpoints/step-6'", tmp);
    TST_CHECK(system(p) == 0);

    /* a trim that fails (RLIMIT_FSIZE below the ledger's size, SIGXFSZ ignored: EFBIG) removes
     * its metrics.jsonl.tmp */
    const char *argv[48];
    build_argv(argv, "left", "2", six);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(errp("left-4"), O_WRONLY | O_CREAT | O_TRUNC, 0644), nul = open("/dev/null", O_WRONLY);
        struct rlimit rl = {1000, 1000};
        signal(SIGXFSZ, SIG_IGN);
        if (fd < 0 || nul < 0 || dup2(fd, 2) < 0 || dup2(nul, 1) < 0 || setrlimit(RLIMIT_FSIZE, &rl) != 0)
            _exit(120);
        execv(argv[0], (char *const *)argv);
        _exit(121);
    }
    int st = 0;
    TST_CHECK(pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 1);
    e = tst_slurp(errp("left-4"));
    TST_CHECK(strstr(e, "cannot rewrite") && strstr(e, "metrics.jsonl"));
    TST_CHECK(!exists("left", "metrics.jsonl.tmp"));
    /* and the run still finishes, every step once */
    TST_CHECK(train("left", "left-5", "2", six) == 0);
    int in_order = 0;
    TST_CHECK(ledger("left", &in_order) == 6 && in_order &&
              exists("left", "checkpoints/step-6/checksums.json"));
}

int main(void) {
    if (!dtd_begin(tmp, sizeof tmp, "/tmp/tandem-drd-XXXXXX"))
        return 1;
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    TST_CHECK(dtd_write_config(config, 2));
    TST_CHECK(dtd_make_batches(tmp, 3, 5, csv, sizeof csv));
    if (tst_failures == 0) {
        test_twin();
        test_dp_share();
        test_leftovers();
    }
    return dtd_end(tmp);
}
