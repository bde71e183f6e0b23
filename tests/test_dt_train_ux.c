/* tests/test_dt_train_ux.c — the run experience of `drafter-trainer train` through the real
 * binary: a run config file (relative paths resolved against it, a command-line flag
 * overriding it, an unknown key refused with the closest flag), plain progress lines on a
 * non-terminal, TensorBoard event files that hold the same losses as metrics.jsonl (read back
 * with cm_tb's CRC-checking reader), and --dry-run printing the plan without loading weights. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cm_tb.h"
#include "tst.h"
#include "tst_proc.h"
#include "dt_train_data.h"

static char tmp[256];

/* Runs cmd (a shell line) and returns its exit status; stdout + stderr into out. */
static int run_sh(const char *cmd, char *out, size_t cap) {
    return tst_sh(cmd, out, cap);
}

/* The losses of metrics.jsonl, in order; returns how many. */
static int read_losses(const char *path, double *loss, int cap) {
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char line[8192];
    int  n = 0;
    while (n < cap && fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "\"loss\": ");
        if (p)
            loss[n++] = strtod(p + 8, NULL);
    }
    fclose(f);
    return n;
}

/* train/loss of every summary event of the one events file in dir/tb, in file order. */
static int read_tb_losses(const char *run_dir, double *loss, int cap) {
    char dir[1024], path[2048];
    snprintf(dir, sizeof dir, "%s/tb", run_dir);
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *e;
    int            files = 0;
    while ((e = readdir(d)))
        if (strncmp(e->d_name, "events.out.tfevents.", 20) == 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            files++;
        }
    closedir(d);
    if (files != 1)
        return -1;
    cm_tb_reader *r = NULL;
    if (cm_tb_reader_open(&r, path) != CM_OK)
        return -1;
    int n = 0, done = 0, version = 0;
    while (n >= 0) {
        cm_tb_event ev;
        if (cm_tb_reader_next(r, &ev, &done) != CM_OK) {
            n = -1;
            break;
        }
        if (done)
            break;
        version |= ev.kind == CM_TB_KIND_FILE_VERSION && strcmp(ev.file_version, "brain.Event:2") == 0;
        for (int i = 0; ev.kind == CM_TB_KIND_SUMMARY && i < ev.n_values; i++)
            if (strcmp(ev.tags[i], "train/loss") == 0 && n < cap && ev.step == n + 1)
                loss[n++] = ev.values[i];
    }
    cm_tb_reader_destroy(&r);
    return version ? n : -1;
}

int main(void) {
    setenv("OMP_NUM_THREADS", "1", 0);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-trainux-%d", (int)getpid());
    mkdir(tmp, 0700);
    char config[512], csv[8192], runcfg[512], run_dir[512], cmd[16384], err[512];
    static char out[1 << 16];
    snprintf(config, sizeof config, "%s/drafter.json", tmp);
    TST_CHECK(dtd_write_config(config, 2));
    TST_CHECK(dtd_make_batches(tmp, 3, 11, csv, sizeof csv));

    /* the file says 6 steps; the command line says 4 and wins. "config" and "out" are relative. */
    snprintf(runcfg, sizeof runcfg, "%s/run.json", tmp);
    snprintf(run_dir, sizeof run_dir, "%s/run", tmp);
    FILE *f = fopen(runcfg, "w");
    TST_CHECK(f != NULL);
    if (f) {
        fprintf(f,
                "{\"config\": \"drafter.json\", \"target\": \"%s\", \"data\": \"%s\", \"out\": \"run\",\n"
                " \"steps\": 6, \"lr\": 1e-3, \"max-anchors\": 64, \"log-every\": 2, \"progress\": \"lines\",\n"
                " \"seed\": 3}\n",
                DTD_MODEL, csv);
        fclose(f);
    }
    snprintf(err, sizeof err, "%s/train.err", tmp);
    char *argv[] = {DTD_DT_BIN, "train", "--run-config", runcfg, "--steps", "4", NULL};
    int   rc = tst_run(argv, err);
    TST_CHECK(rc == 0);
    const char *log = tst_slurp(err);
    TST_CHECK(strstr(log, "step 2/4") && strstr(log, "step 4/4") && strstr(log, "tok/s") && strstr(log, "eta"));
    TST_CHECK(!strstr(log, "step 6/"));
    if (rc != 0)
        fprintf(stderr, "train:\n%s\n", log);
    double loss[16], tb[16];
    char   metrics[1024];
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", run_dir);
    int n = read_losses(metrics, loss, 16), m = read_tb_losses(run_dir, tb, 16);
    TST_CHECK(n == 4 && m == 4);
    int same = n == m;
    for (int i = 0; i < n && i < m; i++)
        same &= (float)loss[i] == (float)tb[i];
    TST_CHECK(same);
    printf("run config + override: %d steps; progress lines on stderr; TensorBoard holds the %d losses of "
           "metrics.jsonl (as float): %s\n",
           n, m, same ? "yes" : "NO");

    /* an unknown key is refused before anything runs, naming the closest flag */
    snprintf(runcfg, sizeof runcfg, "%s/bad.json", tmp);
    f = fopen(runcfg, "w");
    if (f) {
        fprintf(f, "{\"epoch\": 3}\n");
        fclose(f);
    }
    snprintf(cmd, sizeof cmd, "'%s' train --run-config '%s' 2>&1", DTD_DT_BIN, runcfg);
    TST_CHECK(run_sh(cmd, out, sizeof out) == 2 && strstr(out, "'epoch'") && strstr(out, "epochs"));

    /* --dry-run: the plan, with no weights loaded (the target given as its config file) */
    snprintf(cmd, sizeof cmd, "'%s' train --dry-run --config '%s' --target '%s/config.json' --token-budget 512 2>&1",
             DTD_DT_BIN, config, DTD_MODEL);
    rc = run_sh(cmd, out, sizeof out);
    TST_CHECK(rc == 0 && strstr(out, "parameters") && strstr(out, "memory per trainer GPU") &&
              strstr(out, "target GPUs per trainer GPU"));
    if (rc != 0)
        fprintf(stderr, "dry run:\n%s\n", out);
    snprintf(cmd, sizeof cmd, "'%s' train --dry-run --config '%s' --target /nonexistent 2>&1", DTD_DT_BIN, config);
    TST_CHECK(run_sh(cmd, out, sizeof out) == 1 && strstr(out, "/nonexistent/config.json"));
    printf("unknown run-config key refused; --dry-run prints the plan; a missing target config is named\n");

    tst_rmdir(tmp);
    return tst_report();
}
