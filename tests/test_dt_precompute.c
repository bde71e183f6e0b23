/* tests/test_dt_precompute.c — `drafter-trainer precompute` against a real `target-server serve
 * --model models/tiny-qwen35` process over loopback, and `train --shards`: a precompute stopped
 * by SIGTERM (exit 143) and one killed with SIGKILL mid-run (records durable) are resumed, after
 * which every batch id is stored exactly once and `shards inspect --verify` passes; the exported
 * tensors equal `target-server dump` rounded to BF16 bit for bit; training from the shards logs
 * the same losses as training from batch files holding the same dump rounded the same way;
 * shards of another target, lacking a layer, for other tokens, missing a batch or with a corrupt
 * record are refused with a clear message (a damaged one before step 1); precompute over a damaged
 * store restores it in place or says why it cannot; bad precompute flags exit 2. */
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
#include "cm_shard.h"
#include "dt_train_data.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define N_BATCHES 12

static char tmp[256], config[512], csv_dump[8192], csv_tok[8192], csv_bf[8192], shards[512];
static int  T_of[N_BATCHES];

// ---- the server

static pid_t server = -1;
static char  endpoint[256];

// ---- data: batch files with the dump's taps (F32, batch 1 BF16), token-only files, and
// batch files with the taps rounded to BF16

static int make_data(void) {
    return dtd_make_tok_bf(tmp, N_BATCHES, 11, csv_dump, csv_tok, csv_bf, sizeof csv_tok, T_of);
}

// ---- helpers

static pid_t precompute_start(const char *data, const char *layers, const char *dir, const char *err) {
    char *argv[] = {DTD_DT_BIN,   "precompute", "--server",         endpoint, "--data",
                    (char *)data, "--layers",   (char *)layers,     "--out",  (char *)dir,
                    "--credits",  "2",          "--progress-every", "4",      "--timeout-ms",
                    "60000",      NULL};
    return tst_spawn(argv, err);
}

static int precompute(const char *data, const char *layers, const char *dir, const char *errname) {
    char err[512];
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    unlink(err);
    pid_t pid = precompute_start(data, layers, dir, err);
    int   rc = pid < 0 ? -1 : tst_wait_exit(pid, 120000);
    if (rc != 0)
        fprintf(stderr, "precompute %s exited %d:\n%s\n", errname, rc, tst_slurp(err));
    return rc;
}

/* Starts a precompute into `shards`, waits until `more` more records than now are durable, then
 * freezes the server (no answer can complete the run) and sends sig; returns the exit status. */
static int precompute_interrupted(int sig, int more, const char *errname) {
    char err[512];
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    unlink(err);
    long  before = dtd_durable(shards);
    pid_t pid = precompute_start(csv_tok, "5,3,1", shards, err);
    if (pid < 0)
        return -1;
    int rc = -1;
    for (int i = 0; i < 60000 && dtd_durable(shards) < before + more; i++) {
        if ((rc = tst_wait_exit(pid, 0)) >= 0)
            break;
        tst_sleep_ms(2);
    }
    kill(server, SIGSTOP);
    if (rc < 0) {
        tst_sleep_ms(300); /* answers already received get written */
        kill(pid, sig);
        rc = tst_wait_exit(pid, 30000);
    }
    kill(server, SIGCONT);
    if (rc < 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    fprintf(stderr, "precompute %s: exit %d, %ld -> %ld records durable\n", errname, rc, before,
            dtd_durable(shards));
    return rc;
}

/* RUN/metrics.jsonl's "loss" and "tau" texts, one line each step, into out. */
static int read_losses(const char *run, char *out, size_t cap, int *n) {
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    return tst_read_losses(path, out, cap, n, NULL, NULL, NULL);
}

/* train with one more flag and its value (flag NULL: none). */
static int train_with(const char *run, const char *target, const char *data, const char *shard_dir,
                      const char *steps, const char *errname, const char *flag, const char *value) {
    char out[512], err[512];
    snprintf(out, sizeof out, "%s/%s", tmp, run);
    snprintf(err, sizeof err, "%s/%s.err", tmp, errname);
    char *argv[32] = {DTD_DT_BIN,     "train",         "--config",   config,        "--target",
                      (char *)target, "--data",        (char *)data, "--out",       out,
                      "--steps",      (char *)steps,   "--seed",     "3",           "--lr",
                      "3e-3",         "--max-anchors", "16",         "--log-level", "warn"};
    int   n = 18;
    if (shard_dir) {
        argv[n++] = "--shards";
        argv[n++] = (char *)shard_dir;
    }
    if (flag) {
        argv[n++] = (char *)flag;
        argv[n++] = (char *)value;
    }
    argv[n] = NULL;
    return tst_run(argv, err);
}

static int train(const char *run, const char *target, const char *data, const char *shard_dir,
                 const char *steps, const char *errname) {
    return train_with(run, target, data, shard_dir, steps, errname, NULL, NULL);
}

/* Steps logged in RUN/metrics.jsonl (0 if absent). */
static int metric_lines(const char *run) {
    return tst_metrics_lines(tmp, run);
}

static long slurp_file(const char *path, unsigned char **out) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc((size_t)n + 1);
    if (!*out || fread(*out, 1, (size_t)n, f) != (size_t)n)
        n = -1;
    fclose(f);
    return n;
}

static const char *err_text(const char *name) {
    return tst_err_in(tmp, name);
}

// ---- the tests

static void test_resume(void) {
    /* SIGTERM: a clean stop, exit 143, everything so far durable */
    TST_CHECK(precompute_interrupted(SIGTERM, 2, "term") == 143);
    long after_term = dtd_durable(shards);
    TST_CHECK(after_term >= 2 && after_term < N_BATCHES);
    /* SIGKILL mid-run */
    TST_CHECK(precompute_interrupted(SIGKILL, 2, "kill") == 128 + SIGKILL);
    long after_kill = dtd_durable(shards);
    TST_CHECK(after_kill >= after_term + 2 && after_kill < N_BATCHES);
    /* resumed to the end */
    TST_CHECK(precompute(csv_tok, "5,3,1", shards, "resume") == 0);
    TST_CHECK(strstr(err_text("resume"), "already stored") != NULL);
    /* every batch id exactly once */
    cm_shard_reader *r = NULL;
    TST_CHECK(cm_shard_reader_open(&r, shards, NULL) == CM_OK);
    if (r) {
        int seen[N_BATCHES] = {0};
        TST_CHECK(cm_shard_reader_count(r) == N_BATCHES);
        for (uint64_t i = 0; i < cm_shard_reader_count(r); i++) {
            cm_shard_entry e;
            cm_shard_reader_entry(r, i, &e);
            TST_CHECK(e.batch_id < N_BATCHES && e.batch_hash != 0);
            if (e.batch_id < N_BATCHES)
                seen[e.batch_id]++;
        }
        for (int b = 0; b < N_BATCHES; b++)
            TST_CHECK(seen[b] == 1);
        const cm_shard_identity *id = cm_shard_reader_identity(r);
        TST_CHECK(id->hidden_size == DTD_D && id->hidden_dtype == CM_DTYPE_BF16 && id->n_layers == 3 &&
                  id->layer_ids[0] == 5 && id->layer_ids[1] == 3 && id->layer_ids[2] == 1 &&
                  id->encoding == CM_ENCODING_ZSTD_BYTEPLANE && id->target_id != 0);
        cm_shard_reader_destroy(&r);
    }
    /* a run over a complete store stores nothing and exits 0 */
    TST_CHECK(precompute(csv_tok, "5,3,1", shards, "again") == 0);
    TST_CHECK(dtd_durable(shards) == N_BATCHES);
    char *inspect[] = {DTD_DT_BIN, "shards", "inspect", shards, "--verify", NULL};
    char  err[512];
    snprintf(err, sizeof err, "%s/inspect.err", tmp);
    TST_CHECK(tst_run(inspect, err) == 0);
}

static void test_export_exact(void) {
    char out[512], err[512];
    snprintf(out, sizeof out, "%s/export.safetensors", tmp);
    snprintf(err, sizeof err, "%s/export.err", tmp);
    char *argv[] = {DTD_DT_BIN, "shards", "export", shards, "--batch", "0,1,7", "--out", out, NULL};
    TST_CHECK(tst_run(argv, err) == 0);
    cm_st *e = NULL;
    TST_CHECK(cm_st_open_file(&e, out) == CM_OK);
    if (!e)
        return;
    static float    ref[DTD_MAX_T * 2 * DTD_D], col[DTD_MAX_T * DTD_D];
    static uint16_t col16[DTD_MAX_T * DTD_D];
    const int       batches[3] = {0, 1, 7};
    int             compared = 0;
    for (int k = 0; k < 3; k++) {
        int  b = batches[k];
        char src[512];
        snprintf(src, sizeof src, "%s/batch-%d.safetensors", tmp, b);
        cm_st *s = NULL;
        TST_CHECK(cm_st_open_file(&s, src) == CM_OK);
        if (!s)
            continue;
        const cm_st_tensor *th = cm_st_find(s, "target_hidden");
        const int64_t       T = T_of[b];
        cm_convert(ref, CM_DTYPE_F32, th->data, th->dtype,
                   (size_t)T * 2 * DTD_D); /* dump's F32 (batch 1: BF16) */
        cm_st_destroy(&s);
        for (int tap = 0; tap < 2; tap++) {
            for (int64_t t = 0; t < T; t++)
                memcpy(col + t * DTD_D, ref + t * 2 * DTD_D + tap * DTD_D, DTD_D * sizeof(float));
            cm_convert(col16, CM_DTYPE_BF16, col, CM_DTYPE_F32, (size_t)T * DTD_D);
            char name[64];
            snprintf(name, sizeof name, "%d/layer_%d", b, tap ? DTD_TAP_B : DTD_TAP_A);
            const cm_st_tensor *x = cm_st_find(e, name);
            TST_CHECK(x && x->dtype == CM_DTYPE_BF16 && x->n_dims == 2 && x->shape[0] == T &&
                      x->shape[1] == DTD_D);
            if (x && x->nbytes == (size_t)T * DTD_D * 2) {
                TST_CHECK(memcmp(x->data, col16, x->nbytes) == 0);
                compared++;
            }
        }
    }
    TST_CHECK(compared == 6);
    cm_st_destroy(&e);
}

static void test_train_same(void) {
    TST_CHECK(train("from-shards", DTD_MODEL, csv_tok, shards, "14", "train-shards") == 0);
    TST_CHECK(train("from-files", DTD_MODEL, csv_bf, NULL, "14", "train-files") == 0);
    static char a[65536], b[65536];
    int         na = 0, nb = 0;
    char        ra[512], rb[512];
    snprintf(ra, sizeof ra, "%s/from-shards", tmp);
    snprintf(rb, sizeof rb, "%s/from-files", tmp);
    TST_CHECK(read_losses(ra, a, sizeof a, &na) && read_losses(rb, b, sizeof b, &nb));
    TST_CHECK(na == 14 && nb == 14 && strcmp(a, b) == 0);
    if (strcmp(a, b) != 0)
        fprintf(stderr, "shards:\n%s\nfiles:\n%s\n", a, b);
}

/* One flipped payload byte in a complete store: train --shards stops before step 1 naming the
 * shard file, the record and the repair (--verify-shards lazy meets it at its step instead);
 * precompute over the store cannot restore it from other tokens under that id, nor from data
 * lacking that batch, and says so (exit 1); the same precompute as before restores it in place
 * (exit 0, the shard byte-identical to before the damage, inspect --verify passes). */
static void test_damage(void) {
    char           p[600];
    unsigned char *orig = NULL, *now = NULL;
    snprintf(p, sizeof p, "%s/shard-00000.bin", shards);
    long n = slurp_file(p, &orig);
    TST_CHECK(n > 0);
    if (n <= 0)
        return;
    int fd = open(p, O_RDWR);
    TST_CHECK(fd >= 0);
    unsigned char c = orig[n / 2] ^ 0x10;
    TST_CHECK(pwrite(fd, &c, 1, n / 2) == 1);
    close(fd);

    TST_CHECK(train("d-full", DTD_MODEL, csv_tok, shards, "12", "d-full") == 1);
    const char *t = err_text("d-full");
    TST_CHECK(strstr(t, "checking the shards before the first step") && strstr(t, "': shard-00000.bin offset ") &&
              strstr(t, "payload checksum mismatch") &&
              strstr(t, "run the same `drafter-trainer precompute ... --out"));
    TST_CHECK(metric_lines("d-full") == 0);
    TST_CHECK(train_with("d-lazy", DTD_MODEL, csv_tok, shards, "12", "d-lazy", "--verify-shards", "lazy") == 1);
    TST_CHECK(strstr(err_text("d-lazy"), "cannot be read from shards") != NULL);
    fprintf(stderr, "--verify-shards lazy: %d steps before the damaged record\n", metric_lines("d-lazy"));
    TST_CHECK(metric_lines("d-lazy") < 12);

    char rev[8192] = "", two[2048];
    for (int b = N_BATCHES - 1; b >= 0; b--) {
        size_t u = strlen(rev);
        snprintf(rev + u, sizeof rev - u, "%s%s/tok-%02d.safetensors", b < N_BATCHES - 1 ? "," : "", tmp, b);
    }
    TST_CHECK(precompute(rev, "5,3,1", shards, "d-rev") == 1);
    TST_CHECK(strstr(err_text("d-rev"), "cannot be restored in place") != NULL);
    snprintf(two, sizeof two, "%s/tok-00.safetensors,%s/tok-01.safetensors", tmp, tmp);
    TST_CHECK(precompute(two, "5,3,1", shards, "d-two") == 1);
    TST_CHECK(strstr(err_text("d-two"), "is damaged and cannot be restored: the data given has 2 batches") !=
              NULL);

    TST_CHECK(precompute(csv_tok, "5,3,1", shards, "d-fix") == 0);
    TST_CHECK(strstr(err_text("d-fix"), "0 stored now, 11 already stored and verified, 1 restored") != NULL);
    TST_CHECK(slurp_file(p, &now) == n && memcmp(now, orig, (size_t)n) == 0);
    char *inspect[] = {DTD_DT_BIN, "shards", "inspect", shards, "--verify", NULL}, err[512];
    snprintf(err, sizeof err, "%s/d-inspect.err", tmp);
    TST_CHECK(tst_run(inspect, err) == 0);
    TST_CHECK(train("d-after", DTD_MODEL, csv_tok, shards, "2", "d-after") == 0 && metric_lines("d-after") == 2);
    free(orig);
    free(now);
}

static void test_refusals(void) {
    /* a store lacking layer 3 */
    char lacking[512];
    snprintf(lacking, sizeof lacking, "%s/shards-lacking", tmp);
    char two[2048];
    snprintf(two, sizeof two, "%s/tok-00.safetensors,%s/tok-01.safetensors", tmp, tmp);
    TST_CHECK(precompute(two, "1", lacking, "pc-lacking") == 0);
    TST_CHECK(train("r-lacking", DTD_MODEL, csv_tok, lacking, "2", "r-lacking") == 1);
    TST_CHECK(strstr(err_text("r-lacking"), "needs layer 3") != NULL);

    /* another target: the same weights under a config with another identity */
    char other[512], p[600], q[600];
    snprintf(other, sizeof other, "%s/other-target", tmp);
    mkdir(other, 0700);
    snprintf(p, sizeof p, "%s/model.safetensors", other);
    snprintf(q, sizeof q, "%s/model.safetensors", DTD_MODEL);
    TST_CHECK(symlink(q, p) == 0);
    snprintf(q, sizeof q, "%s/config.json", DTD_MODEL);
    FILE       *f = fopen(q, "rb");
    static char cfg[1 << 16];
    size_t      n = f ? fread(cfg, 1, sizeof cfg - 1, f) : 0;
    if (f)
        fclose(f);
    cfg[n] = '\0';
    char *eps = strstr(cfg, "\"rms_norm_eps\"");
    TST_CHECK(eps != NULL);
    if (eps) {
        char  *colon = strchr(eps, ':');
        size_t len = strcspn(colon + 1, ",}");
        snprintf(p, sizeof p, "%s/config.json", other);
        FILE *g = fopen(p, "wb");
        fprintf(g, "%.*s: 0.000123%s", (int)(colon - cfg), cfg, colon + 1 + len);
        fclose(g);
        TST_CHECK(train("r-other", other, csv_tok, shards, "2", "r-other") == 1);
        TST_CHECK(strstr(err_text("r-other"), "another model") != NULL);
    }

    /* other tokens under the same ids: the data list in another order */
    char rev[8192] = "";
    for (int b = N_BATCHES - 1; b >= 0; b--) {
        size_t u = strlen(rev);
        snprintf(rev + u, sizeof rev - u, "%s%s/tok-%02d.safetensors", b < N_BATCHES - 1 ? "," : "", tmp, b);
    }
    TST_CHECK(train("r-order", DTD_MODEL, rev, shards, "2", "r-order") == 1);
    TST_CHECK(strstr(err_text("r-order"), "cannot be read from shards") != NULL);

    /* a batch the store does not hold */
    char more[8192 + 512];
    snprintf(more, sizeof more, "%s,%s/tok-00.safetensors", csv_tok, tmp);
    TST_CHECK(train("r-missing", DTD_MODEL, more, shards, "13", "r-missing") == 1);
    TST_CHECK(strstr(err_text("r-missing"), "no record for batch 12") != NULL);

    /* a corrupt record: one flipped byte in the middle of the first shard */
    snprintf(p, sizeof p, "%s/shard-00000.bin", shards);
    int fd = open(p, O_RDWR);
    TST_CHECK(fd >= 0);
    if (fd >= 0) {
        struct stat st;
        fstat(fd, &st);
        unsigned char c;
        off_t         at = st.st_size / 2;
        TST_CHECK(pread(fd, &c, 1, at) == 1);
        c ^= 0x10;
        TST_CHECK(pwrite(fd, &c, 1, at) == 1);
        close(fd);
        TST_CHECK(train("r-corrupt", DTD_MODEL, csv_tok, shards, "12", "r-corrupt") == 1);
        TST_CHECK(strstr(err_text("r-corrupt"), "checking the shards before the first step") != NULL);
        TST_CHECK(metric_lines("r-corrupt") == 0);
    }
}

static void test_bad_flags(void) {
    char err[512], dir[512];
    snprintf(err, sizeof err, "%s/flags.err", tmp);
    snprintf(dir, sizeof dir, "%s/shards-bad", tmp);
    char *a1[] = {DTD_DT_BIN, "precompute", "--server", endpoint, "--data", csv_tok,
                  "--layers", "1,x",        "--out",    dir,      NULL};
    TST_CHECK(tst_run(a1, err) == 1 && strstr(tst_slurp(err), "--layers") != NULL);
    char *a2[] = {DTD_DT_BIN, "precompute", "--server", endpoint, "--data", csv_tok, NULL};
    TST_CHECK(tst_run(a2, err) == 2);
    char *a3[] = {DTD_DT_BIN, "precompute", "--server", endpoint, "--data", csv_tok,
                  "--layers", "1,99",       "--out",    dir,      NULL};
    TST_CHECK(tst_run(a3, err) == 1 && strstr(tst_slurp(err), "outside target") != NULL);
    char *a4[] = {DTD_DT_BIN, "precompute", "--server", endpoint, "--data", csv_tok, "--layers", "1",
                  "--out",    dir,          "--verify-stored", "some", NULL};
    TST_CHECK(tst_run(a4, err) == 2 && strstr(tst_slurp(err), "expected full or tail") != NULL);
    TST_CHECK(train_with("flags", DTD_MODEL, csv_tok, shards, "2", "flags", "--verify-shards", "some") == 2);
    TST_CHECK(strstr(err_text("flags"), "expected full or lazy") != NULL);
    char *a5[] = {DTD_DT_BIN, "precompute", "--server", endpoint, "--data", csv_tok, "--layers",
                  "1",        "--out",      dir,        "--name", "a/b",    NULL};
    TST_CHECK(tst_run(a5, err) == 2 && strstr(tst_slurp(err), "--name 'a/b'") != NULL);
    /* no server: a progress line every 5 s while connecting, then the timeout */
    char *a6[] = {DTD_DT_BIN, "precompute", "--server", "tcp://127.0.0.1:1", "--data", csv_tok, "--layers",
                  "1",        "--out",      dir,        "--timeout-ms",      "5800",   NULL};
    TST_CHECK(tst_run(a6, err) == 1);
    const char *log = tst_slurp(err);
    TST_CHECK(
        strstr(log, "connecting to 'tcp://127.0.0.1:1': no WELCOME after 5 s of 6 s (--timeout-ms 5800)") &&
        strstr(log, "no target-server answered"));
}

int main(void) {
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    setenv("OMP_NUM_THREADS", "1", 1);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-precompute-%d", (int)getpid());
    mkdir(tmp, 0700);
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    snprintf(shards, sizeof shards, "%s/shards", tmp);
    if (dtd_write_config(config, 1) && make_data())
        server = dtd_serve(DTD_MODEL, "tcp://127.0.0.1:*", tmp, "serve", NULL, endpoint, sizeof endpoint);
    if (server < 0) {
        TST_CHECK(0);
        return tst_report();
    }
    test_resume();
    test_export_exact();
    test_train_same();
    test_damage();
    test_bad_flags();
    test_refusals();
    tst_stop(&server);
    return tst_cleanup(tmp, tst_report()); /* logs are kept for a failed run */
}
