/* tests/test_dt_secrets.c — no secret in any log (issue 8 item 5): a CURVE target-server (secret
 * key, accepted client keys) at log level debug, a drafter-trainer train and a precompute with
 * their own client secret key at debug, a trainer whose key the server does not accept, and
 * `target-server status` through CURVE. Every log, every file of the run and shard
 * directories, and the status output are searched for the Z85 text of both secret keys (and
 * for the 32 raw bytes they stand for): none holds either. The trainer whose key is not
 * accepted gets no hidden states and stops with a message. Skips without CURVE in libzmq. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_chan.h"
#include "cm_log.h"
#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"

#define N_BATCHES 2

static char tmp[256], config[512], csv_tok[4096], csv_dump[4096];
static char secrets[2][CM_CHAN_KEY_LEN + 1];
static uint8_t raw[2][32];
static int  n_files;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Whether the file at path holds either secret, as Z85 text or as its raw bytes. */
static int leaks(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    static char buf[1 << 22];
    size_t      n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    n_files++;
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < n; i++) {
            if (i + CM_CHAN_KEY_LEN <= n && memcmp(buf + i, secrets[k], CM_CHAN_KEY_LEN) == 0) {
                fprintf(stderr, "%s holds secret key %d as text\n", path, k);
                return 1;
            }
            if (i + 32 <= n && memcmp(buf + i, raw[k], 32) == 0) {
                fprintf(stderr, "%s holds secret key %d as bytes\n", path, k);
                return 1;
            }
        }
    return 0;
}

/* Searches every plain file under dir (recursively), skipping the key files themselves. */
static int leaks_under(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int            bad = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        size_t l = strlen(e->d_name);
        if (l > 4 && strcmp(e->d_name + l - 4, ".key") == 0)
            continue;
        char        p[1024];
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (lstat(p, &sb) != 0)
            continue;
        if (S_ISDIR(sb.st_mode))
            bad += leaks_under(p);
        else if (S_ISREG(sb.st_mode))
            bad += leaks(p);
    }
    closedir(d);
    return bad;
}

static pid_t spawn_err(char *const argv[], const char *err) {
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    int fd = open(err, O_WRONLY | O_CREAT | O_APPEND, 0644), out = open(err, O_WRONLY | O_APPEND);
    if (fd < 0 || out < 0 || dup2(fd, 2) < 0 || dup2(out, 1) < 0) /* stdout too: it is a log */
        _exit(120);
    execv(argv[0], argv);
    _exit(122);
}

static int wait_rc(pid_t pid, int ms) {
    int st;
    for (int w = 0; w <= ms; w += 10) {
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static int keygen(const char *prefix) {
    char  err[600];
    char *argv[] = {DTD_TS_BIN, "serve", "--curve-keygen", (char *)prefix, NULL};
    snprintf(err, sizeof err, "%s.keygen.log", prefix);
    return wait_rc(spawn_err(argv, err), 10000);
}

int main(void) {
    if (!cm_chan_curve_available())
        TST_SKIP("libzmq has no CURVE");
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    setenv("OMP_NUM_THREADS", "1", 1);
    setenv("ASAN_OPTIONS", "exitcode=86", 1);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-secrets-%d", (int)getpid());
    mkdir(tmp, 0700);
    char keys[512], allowed[600], srv[600], cli[700], other[600], p[800];
    snprintf(keys, sizeof keys, "%s/keys", tmp);
    snprintf(allowed, sizeof allowed, "%s/allowed", keys);
    mkdir(keys, 0700);
    mkdir(allowed, 0700);
    snprintf(srv, sizeof srv, "%s/server", keys);
    snprintf(cli, sizeof cli, "%s/trainer", allowed);
    snprintf(other, sizeof other, "%s/stranger", keys);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    if (keygen(srv) != 0 || keygen(cli) != 0 || keygen(other) != 0 || !dtd_write_config(config, 1) ||
        !dtd_make_batches(tmp, N_BATCHES, 9, csv_dump, sizeof csv_dump)) {
        TST_CHECK(0);
        return tst_report();
    }
    /* the token batches: the batch files' target_hidden is not needed live, but harmless */
    snprintf(csv_tok, sizeof csv_tok, "%s", csv_dump);
    snprintf(p, sizeof p, "%s.key", srv);
    TST_CHECK(cm_chan_curve_read_key(p, secrets[0]) == CM_OK);
    snprintf(p, sizeof p, "%s.key", cli);
    TST_CHECK(cm_chan_curve_read_key(p, secrets[1]) == CM_OK);
    for (int k = 0; k < 2; k++)
        TST_CHECK(zmq_z85_decode(raw[k], secrets[k]) != NULL);

    /* the server, at debug */
    char log[600], ep_file[600], ep[256] = "", skey[700], spub[700], ckey[800], okey[700];
    snprintf(log, sizeof log, "%s/serve.log", tmp);
    snprintf(ep_file, sizeof ep_file, "%s/serve.ep", tmp);
    snprintf(skey, sizeof skey, "%s.key", srv);
    snprintf(spub, sizeof spub, "%s.pub", srv);
    snprintf(ckey, sizeof ckey, "%s.key", cli);
    snprintf(okey, sizeof okey, "%s.key", other);
    char *sv[] = {DTD_TS_BIN,          "serve",       "--model",           DTD_MODEL, "--bind",
                  "tcp://127.0.0.1:*", "--endpoint-file", ep_file,          "--curve-secret-key", skey,
                  "--curve-client-keys", allowed,     "--log-level",       "debug",   "--heartbeat-ms",
                  "200",               "--stats-interval", "1",             NULL};
    pid_t server = spawn_err(sv, log);
    for (int i = 0; i < 600 && !ep[0]; i++) {
        FILE *f = fopen(ep_file, "r");
        if (f) {
            if (!fgets(ep, sizeof ep, f))
                ep[0] = '\0';
            ep[strcspn(ep, "\n")] = '\0';
            fclose(f);
        }
        sleep_ms(50);
    }
    TST_CHECK(ep[0] != '\0');

    /* an accepted trainer and a precompute at debug, with the client's secret key */
    char out[600], err[600], shards[600];
    snprintf(out, sizeof out, "%s/run", tmp);
    snprintf(err, sizeof err, "%s/train.log", tmp);
    char *tv[] = {DTD_DT_BIN,         "train",     "--config",        config,       "--target", DTD_MODEL,
                  "--data",           csv_tok,     "--out",           out,          "--steps",  "2",
                  "--max-anchors",    "8",         "--server",        ep,           "--curve-server-key",
                  spub,               "--curve-secret-key", ckey,     "--log-level", "debug",   NULL};
    TST_CHECK(wait_rc(spawn_err(tv, err), 120000) == 0);
    snprintf(shards, sizeof shards, "%s/shards", tmp);
    snprintf(err, sizeof err, "%s/precompute.log", tmp);
    char *pv[] = {DTD_DT_BIN, "precompute", "--server", ep,   "--data",   csv_tok, "--layers", "1,3",
                  "--out",    shards,       "--curve-server-key", spub, "--curve-secret-key", ckey,
                  "--log-level", "debug",   NULL};
    TST_CHECK(wait_rc(spawn_err(pv, err), 120000) == 0);
    /* a trainer whose key the server does not accept gets nothing and says so */
    snprintf(out, sizeof out, "%s/run-stranger", tmp);
    snprintf(err, sizeof err, "%s/stranger.log", tmp);
    char *xv[] = {DTD_DT_BIN,         "train",     "--config",        config,       "--target", DTD_MODEL,
                  "--data",           csv_tok,     "--out",           out,          "--steps",  "1",
                  "--server",         ep,          "--curve-server-key", spub,      "--curve-secret-key",
                  okey,               "--timeout-ms", "3000",         "--log-level", "debug",   NULL};
    TST_CHECK(wait_rc(spawn_err(xv, err), 60000) == 1);
    const char *xe = tst_slurp(err);
    TST_CHECK(strstr(xe, "refused this client's CURVE key") != NULL && strstr(xe, "--curve-client-keys"));
    /* status through CURVE (it has no --curve-secret-key: a server with --curve-client-keys
     * refuses its fresh key, so only its output is searched here, whatever its exit) */
    snprintf(err, sizeof err, "%s/status.log", tmp);
    char *st[] = {DTD_TS_BIN, "status", "--server", ep, "--curve-server-key", spub, "--json", NULL};
    int   src = wait_rc(spawn_err(st, err), 30000);
    kill(server, SIGTERM);
    TST_CHECK(wait_rc(server, 15000) == 0);
    fprintf(stderr, "status through CURVE with a fresh client key: exit %d: %s", src, tst_slurp(err));
    const char *sl = tst_slurp(log);
    TST_CHECK(strstr(sl, "CURVE") != NULL && strstr(sl, "debug") != NULL);
    /* the search finds a secret where there is one (the key files, skipped below) */
    TST_CHECK(leaks(skey) == 1 && leaks(ckey) == 1);
    /* nothing else anywhere holds a secret */
    n_files = 0;
    TST_CHECK(leaks_under(tmp) == 0);
    TST_CHECK(n_files >= 10);
    fprintf(stderr, "%d files (logs at debug, run and shard directories, status) searched: no secret key\n",
            n_files);
    return tst_cleanup(tmp, tst_report());
}
