/* drafter-trainer/cmd/dt_runcfg.h — `--run-config FILE.json`: a run's flags kept in a file, with the
 * command line overriding it. The file is one JSON object whose keys are the command's long
 * flag names without the dashes:
 *     {"config": "drafter.json", "target": "/models/Qwen3.6-27B", "data": ["a.st", "b.st"],
 *      "out": "runs/r1", "lr": 6e-4, "epochs": 6, "resume": true}
 * It becomes an argv placed before the command line's flags, so a flag given on the command
 * line wins (the parser keeps the last value it sees). Values: a string as is; a number in its
 * shortest form that reads back to the same double; true for a bare flag (present), false
 * (absent); an array of strings or numbers joined by commas. Keys of path flags (kind PATH or
 * PATHS) holding relative paths are resolved against the config file's directory, so a config
 * works from any working directory. Unknown keys, nulls, objects, a value of the wrong kind,
 * duplicate keys and a --run-config inside the file are refused with a message naming the
 * key, and for unknown keys the closest known flag. */
#ifndef DT_RUNCFG_H
#define DT_RUNCFG_H

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dt_runcfg_kind {
    DT_RUNCFG_VALUE = 0, /* --flag VALUE */
    DT_RUNCFG_BOOL,      /* bare --flag: true / false */
    DT_RUNCFG_PATH,      /* --flag PATH: relative paths resolved against the file's directory */
    DT_RUNCFG_PATHS,     /* --flag P1,P2,...: each resolved */
} dt_runcfg_kind;

typedef struct dt_runcfg_flag {
    const char    *name; /* without the leading "--" */
    dt_runcfg_kind kind;
} dt_runcfg_flag;

/* The flags of `drafter-trainer train` (keep in step with its parse_args; test_dt_runcfg
 * checks every flag of `train --help` is here). Path keys: config, init-from, target, data,
 * data-dir, dataset, shards, out. --server endpoints are not paths (ipc:// paths are used as
 * given). Integers above 2^53 (a large --seed) must be written as strings: JSON numbers are
 * doubles. */
const dt_runcfg_flag *dt_runcfg_train_flags(int *n);

/* An argv owned by the struct. */
typedef struct dt_runcfg_argv {
    int    argc;
    char **argv; /* argc entries + NULL */
} dt_runcfg_argv;

/* If argv (the command's arguments, without the program and command names) holds
 * `--run-config FILE`, out gets FILE's flags followed by argv without that pair; otherwise a
 * copy of argv. Usage problems are CM_ERR_INVALID_ARG, an unreadable file CM_ERR_IO, bad JSON
 * CM_ERR_FORMAT; every message names the file and the key. Caller releases out. */
cm_status dt_runcfg_expand(dt_runcfg_argv *out, const dt_runcfg_flag *flags, int n_flags, int argc,
                           char *const *argv);
/* FILE's flags alone (what expand puts first). */
cm_status dt_runcfg_load(dt_runcfg_argv *out, const dt_runcfg_flag *flags, int n_flags, const char *path);
void      dt_runcfg_argv_release(dt_runcfg_argv *a);

/* The known flag closest to key by edit distance (dashes and underscores count as equal). */
const char *dt_runcfg_closest(const dt_runcfg_flag *flags, int n_flags, const char *key);

#ifdef __cplusplus
}
#endif
#endif /* DT_RUNCFG_H */
