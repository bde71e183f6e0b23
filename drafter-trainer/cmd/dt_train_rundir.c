/* drafter-trainer/cmd/dt_train_rundir.c — the run directory of `train` (dt_train_rundir.h): its
 * lock, what an unfinished save or trim left there, and metrics.jsonl cut back for a resume. */
#include "dt_train_rundir.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cm_log.h"
#include "dt_ckpt.h"

/* Keeps the metrics lines of steps ≤ step (a resumed run rewrites what came after). */
cm_status dt_train_trim_metrics(const char *path, int64_t step) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return errno == ENOENT ? CM_OK : CM_FAIL(CM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    char tmp[4096 + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *g = fopen(tmp, "wb");
    if (!g) {
        fclose(f);
        return CM_FAIL(CM_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    }
    char  *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        long long s;
        if (sscanf(line, "{\"step\": %lld", &s) == 1 && s <= step)
            fputs(line, g);
    }
    free(line);
    fclose(f);
    int bad = ferror(g) || fflush(g) != 0 || fsync(fileno(g)) != 0;
    bad |= fclose(g) != 0;
    if (bad || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return CM_FAIL(CM_ERR_IO, "cannot rewrite '%s': %s", path, strerror(e));
    }
    return CM_OK;
}

static cm_status make_run_dir(const char *path) {
    struct stat sb;
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return CM_FAIL(CM_ERR_IO, "cannot create run directory '%s': %s", path, strerror(errno));
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return CM_FAIL(CM_ERR_IO, "run directory '%s' is not a directory", path);
    return CM_OK;
}

/* One trainer per run directory, for its whole life, taken before anything in the directory is
 * read or written: two would interleave their checkpoints, and a resume's trim of metrics.jsonl
 * would rename the file under the other, whose lines then go to the orphaned inode. Under the
 * lock, what an unfinished save or trim left behind is removed. Every data-parallel rank writes
 * its own --out (metrics, checkpoints), so each rank takes the lock of its own. */
cm_status dt_train_lock_run_dir(const train_args *a, cm_lock **lock) {
    struct stat       sb;
    char              path[4096 + 32], what[4096 + 32], advice[256];
    if (a->resume && stat(a->out, &sb) != 0 && errno == ENOENT) /* nothing to lock: refuse as below */
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "cannot resume: '%s' has no checkpoint (%s/checkpoints/latest is missing); drop "
                       "--resume to start a new run",
                       a->out, a->out);
    CM_TRY(make_run_dir(a->out));
    snprintf(path, sizeof path, "%s/trainer.lock", a->out);
    snprintf(what, sizeof what, "run directory '%s'", a->out);
    if (a->dp_size > 1)
        snprintf(advice, sizeof advice,
                 "each data-parallel rank needs its own --out (tandem-launch gives rank r RUN_DIR/rank-<r>); "
                 "stop the other trainer or choose another --out");
    else
        snprintf(advice, sizeof advice, "stop that trainer or let it finish, or choose another --out");
    CM_TRY(cm_lock_create(lock, path, what, "trainer", advice));
    CM_TRY(dt_ckpt_clean(a->out));
    snprintf(path, sizeof path, "%s/metrics.jsonl.tmp", a->out);
    if (unlink(path) == 0)
        CM_LOG_INFO("removed '%s', left by a resume that did not finish", path);
    else if (errno != ENOENT)
        return CM_FAIL(CM_ERR_IO, "cannot remove '%s': %s", path, strerror(errno));
    return CM_OK;
}
