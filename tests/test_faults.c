/* tests/test_faults.c — fault injection against real processes on loopback (issue 8, docs/architecture.md):
 * every fault is judged by the ledger of metrics.jsonl (step, epoch, batch and the loss printed
 * with %.17g, so equal text is an equal double) against an uninterrupted reference run of the
 * same seed from batch files holding the dump rounded to BF16 (what the server sends), and the
 * run's final checkpoint equals the reference's byte for byte (model.safetensors always,
 * training_state.safetensors when the run read the same batch files, whose hash it records):
 *   a. a trainer killed with SIGKILL mid-step, training from files, live and from shards, then
 *      --resume: the final ledger equals the reference step by step (nothing lost, nothing
 *      twice); the steps logged after the checkpoint resumed from are re-done, and counted
 *   b. a trainer killed inside a checkpoint (TANDEM_FAULT=kill-in-checkpoint:STEP, dt_ckpt.h):
 *      latest still names the previous checkpoint, the half-written step-N.tmp is never loaded
 *   c. a full disk during a checkpoint, stood in for by RLIMIT_FSIZE with SIGXFSZ ignored (the
 *      write fails with EFBIG): one message, exit 1, the previous checkpoint and latest intact
 *   d. the server killed with SIGKILL mid-answer and restarted while a trainer trains live
 *   e. precompute killed with SIGKILL mid-run, resumed: each batch stored once, --verify passes,
 *      and training from those shards gives the reference ledger
 *   f. a trainer frozen (SIGSTOP) for 3 s while another trains, and a flood of 200 sessions
 *      saying HELLO at once: both trainers end with the reference ledger, the flood beyond the
 *      server's 64 sessions is refused with BUSY, `target-server status` still answers
 *   g. a flipped byte in a shard: training stops with one message naming the batch, and never
 *      logs a step of that batch
 * `test_faults N` repeats the kills N times (the table in bench/results/faults-2026-11-30.md);
 * the unit run does each once. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_proto.h"
#include "cm_safetensors.h"
#include "cm_shard.h"
#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define N_BATCHES  8
#define N_EPOCHS   "2"
#define N_STEPS    16 /* two epochs */
#define SAVE_EVERY "3"
#define MAX_STEPS  64

static char tmp[256], config[512], csv_tok[8192], csv_bf[8192], shards[512];

/* what each fault cost: runs, steps logged again after a resume, steps lost or doubled */
typedef struct tally {
    const char *name;
    int         runs, redone, lost, twice, bad;
} tally;
enum { F_FILES, F_LIVE, F_SHARDS, F_CKPT, F_DISK, F_ENOSPC, F_SERVER, F_PRECOMP, F_SLOW, F_FLOOD, F_CORRUPT, F_N };
static tally tallies[F_N] = {
    {.name = "trainer kill -9 mid-step (files)"},   {.name = "trainer kill -9 mid-step (live)"},
    {.name = "trainer kill -9 mid-step (shards)"},  {.name = "trainer kill -9 mid-checkpoint"},
    {.name = "full disk in a checkpoint (RLIMIT_FSIZE)"}, {.name = "full tmpfs in a checkpoint (ENOSPC)"},
    {.name = "server kill -9 mid-answer"},
    {.name = "precompute kill -9 mid-run"},         {.name = "trainer frozen 3 s (SIGSTOP)"},
    {.name = "200 sessions flood HELLO"},           {.name = "flipped byte in a shard"}};

/* `test_faults valgrind`: every child runs under this valgrind (leak check, error exit 99) */
static const char *valgrind_bin;

/* Starts argv as a child (stderr appended to err), without waiting. fsize > 0: the child runs
 * under RLIMIT_FSIZE fsize with SIGXFSZ ignored, so an oversized write fails with EFBIG. */
static pid_t spawn_lim(char *const argv[], const char *err, long fsize) {
    setenv("ASAN_OPTIONS", "exitcode=86", 1);
    setenv("UBSAN_OPTIONS", "halt_on_error=1:exitcode=87:print_stacktrace=1", 1);
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    int fd = open(err, O_WRONLY | O_CREAT | O_APPEND, 0644), nul = open("/dev/null", O_WRONLY);
    if (fd < 0 || nul < 0 || dup2(fd, 2) < 0 || dup2(nul, 1) < 0)
        _exit(120);
    if (fsize > 0) {
        struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
        signal(SIGXFSZ, SIG_IGN); /* ignored dispositions survive exec */
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
            _exit(121);
    }
    if (valgrind_bin) {
        char *vg[64], logopt[600];
        int   n = 0;
        snprintf(logopt, sizeof logopt, "--log-file=%s/valgrind-%%p.log", tmp);
        vg[n++] = (char *)valgrind_bin;
        vg[n++] = "--leak-check=full";
        vg[n++] = "--show-leak-kinds=definite,indirect";
        vg[n++] = "--errors-for-leak-kinds=definite,indirect";
        vg[n++] = "--error-exitcode=99";
        vg[n++] = logopt;
        for (int i = 0; argv[i] && n < 63; i++)
            vg[n++] = argv[i];
        vg[n] = NULL;
        execv(valgrind_bin, vg);
        _exit(123);
    }
    execv(argv[0], argv);
    _exit(122);
}

static pid_t spawn(char *const argv[], const char *err) { return spawn_lim(argv, err, 0); }

// ---- the server

static pid_t server = -1;
static char  endpoint[256];

/* Starts serve bound to bind (the resolved endpoint into endpoint); 1 on success. */
static int serve_start(const char *bind, const char *tag) {
    char log[512], ep[512];
    snprintf(log, sizeof log, "%s/serve-%s.log", tmp, tag);
    snprintf(ep, sizeof ep, "%s/serve-%s.ep", tmp, tag);
    unlink(ep);
    char *argv[] = {DTD_TS_BIN,          "serve", "--model",        DTD_MODEL,      "--bind",
                    (char *)bind,        "--endpoint-file", ep,      "--dtype",     "bf16",
                    "--heartbeat-ms",    "200",   "--peer-timeout-ms", "1500",      "--stats-interval",
                    "0",                 NULL};
    server = spawn(argv, log);
    if (tst_await_endpoint(server, ep, log, endpoint, sizeof endpoint, 30000))
        return 1;
    server = -1;
    return 0;
}

static void serve_stop(void) {
    tst_stop(&server);
}

// ---- data: token-only batch files and batch files with the dump's taps rounded to BF16

static int make_data(void) {
    static char csv_dump[8192];
    return dtd_make_tok_bf(tmp, N_BATCHES, 17, csv_dump, csv_tok, csv_bf, sizeof csv_tok, NULL);
}

// ---- the ledger

typedef struct entry {
    long step, epoch, batch;
    char loss[40];
} entry;

typedef struct ledger {
    int   n;
    entry e[MAX_STEPS];
} ledger;

static ledger ref;

static long num_after(const char *line, const char *key) {
    const char *p = strstr(line, key);
    return p ? strtol(p + strlen(key), NULL, 10) : -1;
}

/* RUN/metrics.jsonl into l (0 lines if absent). */
static void read_ledger(const char *run, ledger *l) {
    char path[600], line[4096];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", tmp, run);
    l->n = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    while (l->n < MAX_STEPS && fgets(line, sizeof line, f)) {
        entry      *e = &l->e[l->n];
        const char *p = strstr(line, "\"loss\": ");
        if (!p || !strchr(line, '\n'))
            break; /* a line cut by the kill is not a step */
        p += 8;
        e->step = num_after(line, "\"step\": ");
        e->epoch = num_after(line, "\"epoch\": ");
        e->batch = num_after(line, "\"batch\": ");
        snprintf(e->loss, sizeof e->loss, "%.*s", (int)strcspn(p, ","), p);
        l->n++;
    }
    fclose(f);
}

static int count_lines(const char *run) {
    ledger l;
    read_ledger(run, &l);
    return l.n;
}

/* The first n entries of a equal ref's (step i+1, epoch, batch, loss text). */
static int ledger_prefix(const char *what, const ledger *a, int n) {
    for (int i = 0; i < n; i++) {
        const entry *x = &a->e[i], *y = &ref.e[i];
        if (i >= ref.n || x->step != i + 1 || x->step != y->step || x->epoch != y->epoch ||
            x->batch != y->batch || strcmp(x->loss, y->loss) != 0) {
            fprintf(stderr, "%s: ledger line %d is step %ld epoch %ld batch %ld loss %s; the reference has "
                            "step %ld epoch %ld batch %ld loss %s\n",
                    what, i, x->step, x->epoch, x->batch, x->loss, i < ref.n ? y->step : -1,
                    i < ref.n ? y->epoch : -1, i < ref.n ? y->batch : -1, i < ref.n ? y->loss : "-");
            return 0;
        }
    }
    return 1;
}

static int same_file(const char *a, const char *b) {
    char cmd[1500];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

/* The run's final checkpoint equals the reference's byte for byte: model.safetensors always,
 * training_state.safetensors (masters, Adam moments, cursor, RNG) when the run read the same
 * batch files (the state records their hash). */
static int same_checkpoint(const char *run, int same_data) {
    static const char *const files[2] = {"model.safetensors", "training_state.safetensors"};
    for (int k = 0; k < 1 + same_data; k++) {
        char a[700], b[700];
        snprintf(a, sizeof a, "%s/%s/checkpoints/step-%d/%s", tmp, run, N_STEPS, files[k]);
        snprintf(b, sizeof b, "%s/ref/checkpoints/step-%d/%s", tmp, N_STEPS, files[k]);
        if (!same_file(a, b)) {
            fprintf(stderr, "%s: %s differs from the reference's\n", run, files[k]);
            return 0;
        }
    }
    return 1;
}

/* Judges the final ledger of run against the reference into t: lost and doubled steps. */
static int judge(tally *t, const char *run) {
    ledger l;
    read_ledger(run, &l);
    int seen[MAX_STEPS + 1] = {0};
    for (int i = 0; i < l.n; i++)
        if (l.e[i].step >= 1 && l.e[i].step <= MAX_STEPS)
            seen[l.e[i].step]++;
    for (int s = 1; s <= ref.n; s++) {
        t->lost += seen[s] == 0;
        t->twice += seen[s] > 1;
    }
    int ok = l.n == ref.n && ledger_prefix(run, &l, l.n) &&
             same_checkpoint(run, strncmp(run, "kill-files", 10) == 0 || strncmp(run, "ckpt", 4) == 0 ||
                                      strncmp(run, "disk", 4) == 0 || strncmp(run, "tmpfs/", 6) == 0);
    t->bad += !ok;
    if (!ok)
        fprintf(stderr, "%s: %d ledger lines, the reference %d\n", run, l.n, ref.n);
    return ok;
}

/* N of RUN/checkpoints/latest ("step-N"), -1 without one. */
static long latest_step(const char *run) {
    char p[600];
    snprintf(p, sizeof p, "%s/checkpoints/latest", run);
    const char *t = tst_slurp(p);
    return strncmp(t, "step-", 5) == 0 ? strtol(t + 5, NULL, 10) : -1;
}

// ---- runs

/* TMP/RUN.err with any '/' of RUN as '_' (so a run on the tmpfs logs outside it). */
static const char *err_path(const char *run) {
    static char p[600];
    int         n = snprintf(p, sizeof p, "%s/", tmp);
    snprintf(p + n, sizeof p - (size_t)n, "%s.err", run);
    for (char *c = p + n; *c; c++)
        if (*c == '/')
            *c = '_';
    return p;
}

enum { SRC_FILES, SRC_LIVE, SRC_SHARDS };

/* Starts train RUN (stderr appended to RUN.err) from src; fsize as spawn_lim. */
static pid_t train_start(const char *run, int src, int resume, const char *steps, long fsize) {
    static char out[512], err[600];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s", err_path(run));
    char *argv[40] = {DTD_DT_BIN,      "train",        "--config",  config,      "--target",
                      DTD_MODEL,       "--data",       src == SRC_FILES ? csv_bf : csv_tok,
                      "--out",         out,            "--epochs",  N_EPOCHS,    "--seed",
                      "3",             "--lr",         "3e-3",      "--max-anchors", "16",
                      "--save-every",  SAVE_EVERY,     "--log-level", "warn",    "--no-tensorboard",
                      "--progress",    "off"};
    int   n = 25;
    if (src == SRC_LIVE) {
        argv[n++] = "--server";
        argv[n++] = endpoint;
        argv[n++] = "--credits";
        argv[n++] = "2";
        argv[n++] = "--timeout-ms";
        argv[n++] = "60000";
    } else if (src == SRC_SHARDS) {
        argv[n++] = "--shards";
        argv[n++] = shards;
    }
    if (steps) {
        argv[n++] = "--steps";
        argv[n++] = (char *)steps;
    }
    if (resume)
        argv[n++] = "--resume";
    argv[n] = NULL;
    return spawn_lim(argv, err, fsize);
}

static int train(const char *run, int src, int resume, const char *steps) {
    int rc = tst_finish(train_start(run, src, resume, steps, 0), 120000);
    if (rc != 0)
        fprintf(stderr, "%s exited %d:\n%s\n", run, rc, tst_slurp(err_path(run)));
    return rc;
}

/* Waits until RUN logs at least n steps (or pid ends); 1 if it did before ending. */
static int await_lines(pid_t pid, const char *run, int n) {
    for (int i = 0; i < 60000; i++) {
        if (count_lines(run) >= n)
            return 1;
        if (tst_wait_exit(pid, 0) >= 0)
            return 0;
        tst_sleep_ms(1);
    }
    return 0;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static int      rnd(int n) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (int)(rng_state % (uint64_t)n);
}

// ---- a. trainer kill -9 mid-step

static void fault_trainer_kill(int src, int rep) {
    static const char *const names[3] = {"files", "live", "shards"};
    tally                   *t = &tallies[F_FILES + src];
    char                     run[64];
    snprintf(run, sizeof run, "kill-%s-%d", names[src], rep);
    pid_t pid = train_start(run, src, 0, NULL, 0);
    int   after = 1 + rnd(N_STEPS - 3); /* killed while computing the step after this one */
    int   up = await_lines(pid, run, after);
    tst_sleep_ms(rnd(30));
    kill(pid, SIGKILL);
    int rc = tst_finish(pid, 30000);
    TST_CHECK(up && rc == 128 + SIGKILL);
    ledger before;
    read_ledger(run, &before);
    char rd[600];
    snprintf(rd, sizeof rd, "%s/%s", tmp, run);
    long c = latest_step(rd);
    /* what the killed run logged was right; the lines after the checkpoint resumed from are
     * re-done (none lost: the resume trims them and trains them again) */
    TST_CHECK(ledger_prefix(run, &before, before.n));
    t->runs++;
    t->redone += before.n - (c > 0 ? (int)c : 0);
    /* killed before the first checkpoint: nothing to resume, and a fresh start is the recovery */
    TST_CHECK(train(run, src, c >= 0, NULL) == 0);
    TST_CHECK(judge(t, run));
    fprintf(stderr, "%s: killed after %d logged steps (latest checkpoint step %ld), %d re-done\n", run,
            before.n, c, before.n - (c > 0 ? (int)c : 0));
}

// ---- b. trainer kill -9 inside a checkpoint

static void fault_kill_in_checkpoint(int rep) {
    tally *t = &tallies[F_CKPT];
    char   run[64], rd[600], p[700];
    snprintf(run, sizeof run, "ckpt-%d", rep);
    snprintf(rd, sizeof rd, "%s/%s", tmp, run);
    const int at = 6 + 3 * (rep % 3); /* the checkpoint of step 6, 9 or 12 */
    char      fault[64];
    snprintf(fault, sizeof fault, "kill-in-checkpoint:%d", at);
    setenv("TANDEM_FAULT", fault, 1);
    int rc = tst_finish(train_start(run, SRC_FILES, 0, NULL, 0), 120000);
    unsetenv("TANDEM_FAULT");
    TST_CHECK(rc == 128 + SIGKILL);
    /* the half-written checkpoint holds every file but was never renamed or named by latest */
    snprintf(p, sizeof p, "%s/checkpoints/step-%d.tmp/training_state.safetensors", rd, at);
    struct stat sb;
    TST_CHECK(stat(p, &sb) == 0 && sb.st_size > 0);
    snprintf(p, sizeof p, "%s/checkpoints/step-%d", rd, at);
    TST_CHECK(stat(p, &sb) != 0);
    TST_CHECK(latest_step(rd) == at - 3);
    ledger before;
    read_ledger(run, &before);
    TST_CHECK(before.n == at && ledger_prefix(run, &before, before.n));
    t->runs++;
    t->redone += before.n - (at - 3);
    TST_CHECK(train(run, SRC_FILES, 1, NULL) == 0);
    snprintf(p, sizeof p, "%s/checkpoints/step-%d.tmp", rd, at);
    TST_CHECK(stat(p, &sb) != 0); /* cleared by the next save of that step */
    TST_CHECK(latest_step(rd) == N_STEPS);
    TST_CHECK(judge(t, run));
}

// ---- c. full disk during a checkpoint

static long file_size(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

static void fault_full_disk(int rep) {
    tally *t = &tallies[F_DISK];
    char   run[64], rd[600], p[700], q[700], err[80];
    snprintf(run, sizeof run, "disk-%d", rep);
    snprintf(rd, sizeof rd, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s.err", run);
    TST_CHECK(train(run, SRC_FILES, 0, "3") == 0);
    snprintf(p, sizeof p, "%s/checkpoints/step-3/training_state.safetensors", rd);
    snprintf(q, sizeof q, "%s/step-3-copy.safetensors", tmp);
    long state = file_size(p), model;
    char cmd[1600];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", p, q);
    TST_CHECK(state > 0 && system(cmd) == 0);
    snprintf(p, sizeof p, "%s/checkpoints/step-3/model.safetensors", rd);
    model = file_size(p);
    long limit = state / 2; /* room for the model file, the metrics and the logs, not the state */
    TST_CHECK(model > 0 && model < limit);
    snprintf(p, sizeof p, "%s/%s", tmp, err);
    unlink(p);
    int         rc = tst_finish(train_start(run, SRC_FILES, 1, NULL, limit), 120000);
    const char *e = tst_text_in(tmp, err);
    int         one_line = strchr(e, '\n') == strrchr(e, '\n');
    TST_CHECK(rc == 1 && strstr(e, "File too large") != NULL && one_line);
    if (rc != 1 || !one_line || rep == 0)
        fprintf(stderr, "full disk: exit %d, stderr:\n%s", rc, e);
    TST_CHECK(latest_step(rd) == 3);
    snprintf(p, sizeof p, "%s/checkpoints/step-3/training_state.safetensors", rd);
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", p, q);
    TST_CHECK(system(cmd) == 0);
    ledger before;
    read_ledger(run, &before);
    t->runs++;
    t->redone += before.n - 3;
    TST_CHECK(train(run, SRC_FILES, 1, NULL) == 0);
    TST_CHECK(judge(t, run));
}

/* The same with a real ENOSPC: the run directory on a small tmpfs filled up to leave half a
 * training state free. Needs mount (root); skipped (said so) where it is not allowed. */
static void fault_enospc(int rep) {
    tally *t = &tallies[F_ENOSPC];
    char   mnt[512], cmd[1400], run[64], rd[600], p[700];
    snprintf(mnt, sizeof mnt, "%s/tmpfs", tmp);
    mkdir(mnt, 0700);
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=8m tmpfs '%s' 2>/dev/null", mnt);
    if (system(cmd) != 0) {
        fprintf(stderr, "ENOSPC: cannot mount a tmpfs here (not root?); skipped, RLIMIT_FSIZE stands in\n");
        return;
    }
    snprintf(run, sizeof run, "tmpfs/enospc-%d", rep);
    snprintf(rd, sizeof rd, "%s/%s", tmp, run);
    int ok = train(run, SRC_FILES, 0, "3") == 0;
    snprintf(p, sizeof p, "%s/checkpoints/step-3/training_state.safetensors", rd);
    long           state = file_size(p);
    struct statvfs vf;
    ok = ok && state > 0 && statvfs(mnt, &vf) == 0;
    long long free_b = ok ? (long long)vf.f_bavail * (long long)vf.f_frsize : 0;
    snprintf(p, sizeof p, "%s/filler", mnt);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    static char zeros[1 << 16];
    for (long long left = free_b - state / 2; ok && fd >= 0 && left > 0;) {
        ssize_t n = write(fd, zeros, left < (long long)sizeof zeros ? (size_t)left : sizeof zeros);
        if (n <= 0)
            break;
        left -= n;
    }
    if (fd >= 0)
        close(fd);
    TST_CHECK(ok && fd >= 0);
    unlink(err_path(run));
    int         rc = tst_finish(train_start(run, SRC_FILES, 1, NULL, 0), 120000);
    const char *e = tst_slurp(err_path(run));
    TST_CHECK(rc == 1 && strstr(e, "No space left on device") != NULL);
    if (rc != 1 || rep == 0)
        fprintf(stderr, "ENOSPC: exit %d, stderr:\n%s", rc, e);
    TST_CHECK(latest_step(rd) == 3);
    ledger before;
    read_ledger(run, &before);
    t->runs++;
    t->redone += before.n - 3;
    snprintf(p, sizeof p, "%s/filler", mnt);
    unlink(p);
    TST_CHECK(train(run, SRC_FILES, 1, NULL) == 0);
    TST_CHECK(judge(t, run));
    snprintf(cmd, sizeof cmd, "umount '%s'", mnt);
    TST_CHECK(system(cmd) == 0);
}

// ---- d. server kill -9 mid-answer

static void fault_server_kill(int rep) {
    tally *t = &tallies[F_SERVER];
    char   run[64];
    snprintf(run, sizeof run, "server-%d", rep);
    pid_t pid = train_start(run, SRC_LIVE, 0, NULL, 0);
    int   up = await_lines(pid, run, 1 + rnd(N_STEPS - 4));
    kill(server, SIGKILL);
    waitpid(server, NULL, 0);
    server = -1;
    int at = count_lines(run);
    tst_sleep_ms(300);
    char bind[256];
    snprintf(bind, sizeof bind, "%s", endpoint);
    TST_CHECK(serve_start(bind, "restart") && strcmp(bind, endpoint) == 0);
    int rc = tst_finish(pid, 120000);
    TST_CHECK(up && rc == 0);
    t->runs++;
    TST_CHECK(judge(t, run));
    fprintf(stderr, "%s: server killed after %d steps, the run went on\n", run, at);
}

// ---- e. precompute kill -9 mid-run

static pid_t precompute_start(const char *dir, const char *err) {
    char *argv[] = {DTD_DT_BIN,  "precompute", "--server", endpoint, "--data",       csv_tok,
                    "--layers",  "1,3",        "--out",    (char *)dir, "--credits", "1",
                    "--timeout-ms", "60000",   "--log-level", "warn", NULL};
    return spawn(argv, err);
}

static void fault_precompute_kill(int rep) {
    tally *t = &tallies[F_PRECOMP];
    char   dir[512], err[600], cmd[1100];
    snprintf(dir, sizeof dir, "%s/shards-%d", tmp, rep);
    snprintf(err, sizeof err, "%s/precompute-%d.err", tmp, rep);
    pid_t pid = precompute_start(dir, err);
    int   want = 1 + rnd(N_BATCHES - 2), rc = -1;
    for (int i = 0; i < 60000 && dtd_durable(dir) < want; i++) {
        if ((rc = tst_wait_exit(pid, 0)) >= 0)
            break;
        tst_sleep_ms(1);
    }
    kill(pid, SIGKILL);
    int  killed = tst_finish(pid, 30000) == 128 + SIGKILL;
    long at = dtd_durable(dir);
    TST_CHECK(rc < 0 && killed && at < N_BATCHES);
    pid = precompute_start(dir, err);
    TST_CHECK(tst_finish(pid, 120000) == 0);
    cm_shard_reader *r = NULL;
    int              seen[N_BATCHES] = {0}, ok = cm_shard_reader_open(&r, dir, NULL) == CM_OK;
    TST_CHECK(ok && cm_shard_reader_count(r) == N_BATCHES);
    for (uint64_t i = 0; ok && i < cm_shard_reader_count(r); i++) {
        cm_shard_entry e;
        cm_shard_reader_entry(r, i, &e);
        if (e.batch_id < N_BATCHES)
            seen[e.batch_id]++;
    }
    cm_shard_reader_destroy(&r);
    for (int b = 0; b < N_BATCHES; b++) {
        t->lost += seen[b] == 0;
        t->twice += seen[b] > 1;
    }
    char *inspect[] = {DTD_DT_BIN, "shards", "inspect", dir, "--verify", NULL};
    TST_CHECK(tst_run(inspect, err) == 0);
    t->runs++;
    fprintf(stderr, "precompute %d: killed with %ld of %d records durable, resumed\n", rep, at, N_BATCHES);
    /* the first repetition's store is the one trained from */
    if (rep == 0) {
        snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", dir, shards);
        TST_CHECK(system(cmd) == 0);
        TST_CHECK(train("from-shards", SRC_SHARDS, 0, NULL) == 0);
        TST_CHECK(judge(t, "from-shards"));
    }
}

// ---- f. a frozen trainer and a flood of sessions

/* n DEALER sockets say HELLO at once; counts the WELCOMEs (returned) and BUSY refusals among
 * the replies received within 10 s. The sockets close without BYE: the server drops them. */
static int flood(int n, int *busy) {
    void          *ctx = zmq_ctx_new();
    void          *s[256];
    zmq_pollitem_t it[256];
    int            zero = 0, welcomed = 0, answered[256] = {0};
    *busy = 0;
    cm_proto_hello h = {.credits = 4, .encodings = 1u << CM_ENCODING_RAW};
    snprintf(h.name, sizeof h.name, "flood");
    uint8_t hf[256], buf[4096];
    size_t  hl = 0;
    TST_CHECK(n <= 256 && cm_proto_hello_encode(&h, hf, sizeof hf, &hl) == CM_OK);
    for (int i = 0; i < n; i++) {
        s[i] = zmq_socket(ctx, ZMQ_DEALER);
        zmq_setsockopt(s[i], ZMQ_LINGER, &zero, sizeof zero);
        zmq_connect(s[i], endpoint);
        it[i] = (zmq_pollitem_t){s[i], 0, ZMQ_POLLIN, 0};
    }
    for (int i = 0; i < n; i++)
        zmq_send(s[i], hf, hl, 0);
    cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    int             got = 0;
    for (int round = 0; round < 200 && got < n; round++) {
        if (zmq_poll(it, n, 50) <= 0)
            continue;
        for (int i = 0; i < n; i++) {
            if (!(it[i].revents & ZMQ_POLLIN))
                continue;
            int             len = zmq_recv(s[i], buf, sizeof buf, ZMQ_DONTWAIT);
            cm_proto_header ph;
            if (len <= 0 || answered[i] || cm_proto_peek(buf, (size_t)len, &lim, &ph) != CM_OK)
                continue; /* heartbeats after the WELCOME are not counted */
            cm_proto_error e;
            if (ph.type == CM_PROTO_TYPE_WELCOME)
                welcomed++, answered[i] = 1, got++;
            else if (ph.type == CM_PROTO_TYPE_ERROR &&
                     cm_proto_error_decode(buf, (size_t)len, &lim, &e) == CM_OK)
                *busy += e.code == CM_PROTO_ERROR_BUSY, answered[i] = 1, got++;
        }
    }
    for (int i = 0; i < n; i++)
        zmq_close(s[i]);
    zmq_ctx_term(ctx);
    return welcomed;
}

static void fault_slow_and_flood(int rep) {
    char norm[64], slow[64];
    snprintf(norm, sizeof norm, "normal-%d", rep);
    snprintf(slow, sizeof slow, "slow-%d", rep);
    pid_t a = train_start(norm, SRC_LIVE, 0, NULL, 0), b = train_start(slow, SRC_LIVE, 0, NULL, 0);
    TST_CHECK(await_lines(b, slow, 2));
    kill(b, SIGSTOP); /* receives nothing, sends no heartbeat: the server drops it (1.5 s) */
    int busy = 0, welcomed = flood(200, &busy);
    TST_CHECK(welcomed >= 1 && busy >= 1 && welcomed + busy == 200);
    tst_sleep_ms(3000);
    kill(b, SIGCONT);
    char out[600];
    snprintf(out, sizeof out, "%s/status-%d.out", tmp, rep);
    char *st[] = {DTD_TS_BIN, "status", "--server", endpoint, NULL};
    TST_CHECK(tst_run(st, out) == 0);
    TST_CHECK(server > 0 && tst_wait_exit(server, 0) < 0);
    TST_CHECK(tst_finish(a, 120000) == 0 && tst_finish(b, 120000) == 0);
    tallies[F_SLOW].runs++;
    tallies[F_FLOOD].runs++;
    TST_CHECK(judge(&tallies[F_FLOOD], norm));
    TST_CHECK(judge(&tallies[F_SLOW], slow));
    fprintf(stderr, "flood %d: %d welcomed, %d refused BUSY; the frozen trainer resumed\n", rep, welcomed, busy);
}

// ---- g. a flipped byte in a shard

static void fault_corrupt_shard(void) {
    tally *t = &tallies[F_CORRUPT];
    char   cmd[1700], bad[512], p[700];
    snprintf(bad, sizeof bad, "%s/shards-bad", tmp);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", bad, shards, bad);
    TST_CHECK(system(cmd) == 0);
    snprintf(p, sizeof p, "%s/shard-00000.bin", bad);
    int fd = open(p, O_RDWR);
    TST_CHECK(fd >= 0);
    if (fd < 0)
        return;
    struct stat sb;
    fstat(fd, &sb);
    unsigned char c;
    off_t         at = sb.st_size / 2;
    TST_CHECK(pread(fd, &c, 1, at) == 1);
    c ^= 0x10;
    TST_CHECK(pwrite(fd, &c, 1, at) == 1);
    close(fd);
    char save[512];
    snprintf(save, sizeof save, "%s", shards);
    snprintf(shards, sizeof shards, "%s", bad);
    int rc = train("corrupt", SRC_SHARDS, 0, NULL);
    snprintf(shards, sizeof shards, "%s", save);
    const char *e = tst_text_in(tmp, "corrupt.err");
    const char *m = strstr(e, "batch ");
    long        named = m ? strtol(m + 6, NULL, 10) : -1;
    TST_CHECK(rc == 1 && named >= 0 && strstr(e, "shards") != NULL && strchr(e, '\n') == strrchr(e, '\n'));
    fprintf(stderr, "corrupt shard: %s", e);
    ledger l;
    read_ledger("corrupt", &l);
    int trained_on = 0;
    for (int i = 0; i < l.n; i++)
        trained_on += l.e[i].batch == named;
    TST_CHECK(trained_on == 0 && ledger_prefix("corrupt", &l, l.n));
    t->runs++;
    t->bad += trained_on;
}

// ---- the CPU end-to-end run under valgrind (by hand: `test_faults valgrind`)

/* serve, live training, precompute and training from the shards, each under valgrind; every
 * process must exit 0 (99 = valgrind found errors or definite/indirect leaks) with the
 * reference's ledger. Prints each valgrind log's summary lines. */
static void valgrind_e2e(void) {
    valgrind_bin = "/usr/bin/valgrind";
    if (access(valgrind_bin, X_OK) != 0)
        TST_SKIP("no %s (apt-get install valgrind)", valgrind_bin);
    TST_CHECK(serve_start("tcp://127.0.0.1:*", "valgrind"));
    TST_CHECK(train("vg-live", SRC_LIVE, 0, "4") == 0);
    char err[600];
    snprintf(err, sizeof err, "%s/vg-precompute.err", tmp);
    TST_CHECK(tst_finish(precompute_start(shards, err), 600000) == 0);
    TST_CHECK(train("vg-shards", SRC_SHARDS, 0, "4") == 0);
    TST_CHECK(train("vg-files", SRC_FILES, 0, "4") == 0);
    TST_CHECK(train("vg-files", SRC_FILES, 1, "6") == 0); /* and a resume */
    kill(server, SIGTERM);
    TST_CHECK(tst_finish(server, 120000) == 0);
    server = -1;
    valgrind_bin = NULL;
    static const char *const runs[] = {"vg-live", "vg-shards", "vg-files"};
    for (int i = 0; i < 3; i++) {
        ledger l;
        read_ledger(runs[i], &l);
        TST_CHECK(l.n == (i == 2 ? 6 : 4) && ledger_prefix(runs[i], &l, l.n));
    }
    char cmd[700];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && for f in valgrind-*.log; do printf '%%s: ' \"$(sed -n 's/.*Command: //p' $f | cut -c1-80)\"; "
             "grep -h 'ERROR SUMMARY\\|definitely lost\\|indirectly lost\\|All heap blocks' $f | tr -s ' ' | "
             "sed 's/^==[0-9]*== //' | paste -sd ';' -; done >&2",
             tmp);
    TST_CHECK(system(cmd) == 0);
}

int main(int argc, char **argv) {
    int vg = argc > 1 && strcmp(argv[1], "valgrind") == 0;
    int reps = argc > 1 && !vg ? atoi(argv[1]) : 1;
    if (reps < 1)
        reps = 1;
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    setenv("OMP_NUM_THREADS", "1", 1);
    unsetenv("TANDEM_FAULT");
    rng_state ^= (uint64_t)getpid() << 20;
    snprintf(tmp, sizeof tmp, "/tmp/tandem-faults-%d", (int)getpid());
    mkdir(tmp, 0700);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    snprintf(shards, sizeof shards, "%s/shards", tmp);
    if (!dtd_write_config(config, 1) || !make_data() || train("ref", SRC_FILES, 0, NULL) != 0) {
        TST_CHECK(0);
        return tst_report();
    }
    read_ledger("ref", &ref);
    TST_CHECK(ref.n == N_STEPS);
    if (vg && ref.n == N_STEPS) {
        valgrind_e2e();
        return tst_report(); /* logs kept */
    }
    if (ref.n != N_STEPS || !serve_start("tcp://127.0.0.1:*", "main")) {
        TST_CHECK(0);
        return tst_report();
    }
    for (int r = 0; r < reps; r++) {
        fault_precompute_kill(r);
        fault_trainer_kill(SRC_FILES, r);
        fault_trainer_kill(SRC_LIVE, r);
        fault_trainer_kill(SRC_SHARDS, r);
        fault_kill_in_checkpoint(r);
        fault_full_disk(r);
        fault_enospc(r);
        fault_server_kill(r);
        fault_slow_and_flood(r);
    }
    fault_corrupt_shard();
    serve_stop();
    fprintf(stderr, "\n| fault | runs | steps re-done after resume | lost | twice | wrong ledgers |\n");
    fprintf(stderr, "| --- | ---: | ---: | ---: | ---: | ---: |\n");
    for (int f = 0; f < F_N; f++)
        fprintf(stderr, "| %s | %d | %d | %d | %d | %d |\n", tallies[f].name, tallies[f].runs, tallies[f].redone,
                tallies[f].lost, tallies[f].twice, tallies[f].bad);
    return tst_cleanup(tmp, tst_report()); /* logs are kept for a failed run */
}
