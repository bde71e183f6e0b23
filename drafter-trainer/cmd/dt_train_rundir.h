/* drafter-trainer/cmd/dt_train_rundir.h — `train`'s run directory (--out): one trainer at a time
 * (RUN_DIR/trainer.lock, cm_lock.h), cleaned of what an unfinished save or metrics trim left
 * behind, and metrics.jsonl trimmed to the checkpoint a resume starts from. */
#ifndef DT_TRAIN_RUNDIR_H
#define DT_TRAIN_RUNDIR_H

#include <stdint.h>

#include "cm_lock.h"
#include "cm_status.h"
#include "dt_train_args.h"

/* Creates --out if needed and takes its lock into *lock (held until cm_lock_destroy), then
 * removes the leftovers of an unfinished save (dt_ckpt_clean) or trim. A --resume of a
 * directory that does not exist is refused before anything is created. */
cm_status dt_train_lock_run_dir(const train_args *a, cm_lock **lock);
/* Keeps the lines of metrics.jsonl at path of steps <= step (a missing file is no error). */
cm_status dt_train_trim_metrics(const char *path, int64_t step);

#endif /* DT_TRAIN_RUNDIR_H */
