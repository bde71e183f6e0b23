/* tests/tst_serve.h — a `target-server serve` child for the end-to-end tests, started with an
 * endpoint file and waited for until it has bound, and what a run's metrics.jsonl says: its
 * lines, and its losses as text to compare runs by. Header-only; include after tst_proc.h. */
#ifndef TST_SERVE_H
#define TST_SERVE_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tst_proc.h"

/* Starts `bin serve --model model --bind bind --endpoint-file PATH.ep --heartbeat-ms 200
 * --peer-timeout-ms 1500 --stats-interval 0` and the NULL-terminated extra args (extra may be
 * NULL), stderr appended to PATH.log, and waits up to ms for the endpoint it bound (into
 * endpoint, cap bytes). Its pid; -1 if it exited first or did not bind in time (its log
 * printed, a late child killed). */
static inline pid_t tst_serve_start(const char *bin, const char *model, const char *bind, const char *path,
                                    const char *const *extra, char *endpoint, size_t cap, int ms) {
    char log[600], ep_file[600];
    snprintf(log, sizeof log, "%s.log", path);
    snprintf(ep_file, sizeof ep_file, "%s.ep", path);
    unlink(ep_file);
    const char *argv[48] = {bin,
                            "serve",
                            "--model",
                            model,
                            "--bind",
                            bind,
                            "--endpoint-file",
                            ep_file,
                            "--heartbeat-ms",
                            "200",
                            "--peer-timeout-ms",
                            "1500",
                            "--stats-interval",
                            "0"};
    int         n = 14;
    for (int i = 0; extra && extra[i] && n < 46; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = tst_spawn((char *const *)argv, log); /* bind may be endpoint: spawned before it is cleared */
    endpoint[0] = '\0';
    return tst_await_endpoint(pid, ep_file, log, endpoint, cap, ms) ? pid : -1;
}

/* The lines of dir/run/metrics.jsonl, one a logged step (0 if absent). */
static inline int tst_metrics_lines(const char *dir, const char *run) {
    char path[900];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, run);
    return tst_lines(path);
}

/* The text after key in line, or NULL. */
static inline const char *tst_field(const char *line, const char *key) {
    const char *p = strstr(line, key);
    return p ? p + strlen(key) : NULL;
}

/* A metrics.jsonl's "loss" and "tau" texts, "loss|tau\n" a step, into out (cap bytes), up to the
 * first line without both (evaluation records, with "eval_tau", are passed over); their count into *n. With timed (then wait and compute) not NULL,
 * the lines with wait_s ≥ 0 and compute_s > 0 are counted there and those summed. 1 if there
 * was a step. */
static inline int tst_read_losses(const char *path, char *out, size_t cap, int *n, int *timed, double *wait,
                                  double *compute) {
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[4096];
    out[0] = '\0';
    *n = 0;
    if (timed) {
        *timed = 0;
        *wait = *compute = 0;
    }
    while (fgets(line, sizeof line, f)) {
        if (tst_field(line, "\"eval_tau\": ")) /* an evaluation's record (train --eval-every) */
            continue;
        const char *l = tst_field(line, "\"loss\": "), *t = tst_field(line, "\"tau\": ");
        const char *w = tst_field(line, "\"wait_s\": "), *c = tst_field(line, "\"compute_s\": ");
        if (!l || !t)
            break;
        size_t u = strlen(out);
        snprintf(out + u, cap - u, "%.*s|%.*s\n", (int)strcspn(l, ","), l, (int)strcspn(t, ","), t);
        (*n)++;
        if (timed && w && c && atof(w) >= 0 && atof(c) > 0) {
            (*timed)++;
            *wait += atof(w);
            *compute += atof(c);
        }
    }
    fclose(f);
    return *n > 0;
}

#endif /* TST_SERVE_H */
