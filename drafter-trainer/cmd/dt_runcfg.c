/* drafter-trainer/cmd/dt_runcfg.c — run config files (dt_runcfg.h): JSON object → argv, with paths
 * made relative to the file and every refusal naming the file and the key. Runs once at
 * start-up; allocates freely. */
#include "dt_runcfg.h"

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_cfg.h"

static const dt_runcfg_flag train_flags[] = {
    {"config", DT_RUNCFG_PATH},
    {"init-from", DT_RUNCFG_PATH},
    {"target", DT_RUNCFG_PATH},
    {"data", DT_RUNCFG_PATHS},
    {"data-dir", DT_RUNCFG_PATH},
    {"dataset", DT_RUNCFG_PATHS},
    {"token-budget", DT_RUNCFG_VALUE},
    {"dp-rank", DT_RUNCFG_VALUE},
    {"dp-size", DT_RUNCFG_VALUE},
    {"shards", DT_RUNCFG_PATH},
    {"verify-shards", DT_RUNCFG_VALUE},
    {"server", DT_RUNCFG_VALUE},
    {"credits", DT_RUNCFG_VALUE},
    {"encoding", DT_RUNCFG_VALUE},
    {"timeout-ms", DT_RUNCFG_VALUE},
    {"gpu", DT_RUNCFG_VALUE},
    {"target-init", DT_RUNCFG_VALUE},
    {"target-seed", DT_RUNCFG_VALUE},
    {"precision", DT_RUNCFG_VALUE},
    {"curve-server-key", DT_RUNCFG_PATH},
    {"curve-secret-key", DT_RUNCFG_PATH},
    {"out", DT_RUNCFG_PATH},
    {"epochs", DT_RUNCFG_VALUE},
    {"steps", DT_RUNCFG_VALUE},
    {"lr", DT_RUNCFG_VALUE},
    {"warmup-ratio", DT_RUNCFG_VALUE},
    {"max-anchors", DT_RUNCFG_VALUE},
    {"loss-decay-gamma", DT_RUNCFG_VALUE},
    {"selector-alpha", DT_RUNCFG_VALUE},
    {"selector-warmup-ratio", DT_RUNCFG_VALUE},
    {"selector-ramp-ratio", DT_RUNCFG_VALUE},
    {"selector-miss", DT_RUNCFG_VALUE},
    {"selector-stop-grad", DT_RUNCFG_BOOL},
    {"weight-decay", DT_RUNCFG_VALUE},
    {"clip", DT_RUNCFG_VALUE},
    {"seed", DT_RUNCFG_VALUE},
    {"save-every", DT_RUNCFG_VALUE},
    {"eval-every", DT_RUNCFG_VALUE},
    {"eval-data", DT_RUNCFG_PATH},
    {"eval-prompts", DT_RUNCFG_VALUE},
    {"eval-max-new", DT_RUNCFG_VALUE},
    {"eval-batch", DT_RUNCFG_VALUE},
    {"eval-server", DT_RUNCFG_VALUE},
    {"prefetch", DT_RUNCFG_VALUE},
    {"resume", DT_RUNCFG_BOOL},
    {"device", DT_RUNCFG_VALUE},
    {"log-every", DT_RUNCFG_VALUE},
    {"log-level", DT_RUNCFG_VALUE},
    /* issue 5: progress display, TensorBoard and the --dry-run plan (wired by dt_train.c) */
    {"progress", DT_RUNCFG_VALUE},
    {"no-tensorboard", DT_RUNCFG_BOOL},
    {"dry-run", DT_RUNCFG_BOOL},
    {"plan-seq-len", DT_RUNCFG_VALUE},
    {"plan-target-tflops", DT_RUNCFG_VALUE},
    {"plan-drafter-tflops", DT_RUNCFG_VALUE},
    {"plan-ratio", DT_RUNCFG_VALUE},
};

const dt_runcfg_flag *dt_runcfg_train_flags(int *n) {
    *n = (int)(sizeof train_flags / sizeof train_flags[0]);
    return train_flags;
}

// ---- argv building

typedef struct strvec {
    char **v;
    int    n, cap;
} strvec;

static cm_status push_owned(strvec *s, char *str) {
    if (!str)
        return CM_FAIL(CM_ERR_NOMEM, "out of memory building the argument list");
    if (s->n + 2 > s->cap) {
        int    cap = s->cap ? 2 * s->cap : 16;
        char **v = realloc(s->v, (size_t)cap * sizeof *v);
        if (!v) {
            free(str);
            return CM_FAIL(CM_ERR_NOMEM, "out of memory building the argument list");
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = str;
    s->v[s->n] = NULL;
    return CM_OK;
}

static cm_status push(strvec *s, const char *str) {
    return push_owned(s, strdup(str));
}

/* Makes sure v->v exists (an argv of no arguments is still {NULL}). */
static cm_status terminate(strvec *s) {
    if (s->v)
        return CM_OK;
    if (!(s->v = calloc(1, sizeof *s->v)))
        return CM_FAIL(CM_ERR_NOMEM, "out of memory building the argument list");
    s->cap = 1;
    return CM_OK;
}

static void strvec_free(strvec *s) {
    for (int i = 0; i < s->n; i++)
        free(s->v[i]);
    free(s->v);
    *s = (strvec){0};
}

/* A growing string. */
typedef struct sbuf {
    char  *p;
    size_t n, cap;
} sbuf;

static cm_status sb_add(sbuf *b, const char *s) {
    size_t len = strlen(s);
    if (b->n + len + 1 > b->cap) {
        size_t cap = (b->n + len + 1) * 2;
        char  *p = realloc(b->p, cap);
        if (!p)
            return CM_FAIL(CM_ERR_NOMEM, "out of memory building a run-config value");
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len + 1);
    b->n += len;
    return CM_OK;
}

// ---- closest flag

static int is_dash(char c) {
    return c == '-' || c == '_';
}

/* Levenshtein distance, '-' and '_' equal; keys longer than 63 bytes are cut (still far). */
static int distance(const char *a, const char *b) {
    int row[64 + 1], la = (int)strnlen(a, 63), lb = (int)strnlen(b, 63);
    for (int j = 0; j <= lb; j++)
        row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int same = a[i - 1] == b[j - 1] || (is_dash(a[i - 1]) && is_dash(b[j - 1]));
            int best = diag + !same;
            if (row[j] + 1 < best)
                best = row[j] + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            diag = row[j];
            row[j] = best;
        }
    }
    return row[lb];
}

const char *dt_runcfg_closest(const dt_runcfg_flag *flags, int n_flags, const char *key) {
    while (is_dash(*key)) /* "--lr" → "lr" */
        key++;
    const char *best = NULL;
    int         best_d = 1 << 30;
    for (int i = 0; i < n_flags; i++) {
        int d = distance(key, flags[i].name);
        if (d < best_d) {
            best_d = d;
            best = flags[i].name;
        }
    }
    return best;
}

// ---- values

/* The shortest decimal that reads back as v. */
static void number_text(double v, char *buf, size_t cap) {
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(buf, cap, "%.0f", v);
        return;
    }
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

/* dir + "/" + value unless value is absolute or dir empty (a config in the working directory). */
static cm_status resolve(const char *dir, const char *value, sbuf *b) {
    if (value[0] != '/' && dir[0]) {
        CM_TRY(sb_add(b, dir));
        if (dir[strlen(dir) - 1] != '/')
            CM_TRY(sb_add(b, "/"));
    }
    return sb_add(b, value);
}

/* One array element or scalar as text into b (resolved when is_path). */
static cm_status element(const cJSON *v, const char *dir, int is_path, const char *path, const char *key,
                         sbuf *b) {
    if (cJSON_IsString(v)) {
        if (is_path && !v->valuestring[0])
            return CM_FAIL(CM_ERR_INVALID_ARG, "run config '%s': key '%s' holds an empty path", path, key);
        return is_path ? resolve(dir, v->valuestring, b) : sb_add(b, v->valuestring);
    }
    if (cJSON_IsNumber(v) && !is_path) {
        char num[64];
        number_text(v->valuedouble, num, sizeof num);
        return sb_add(b, num);
    }
    return CM_FAIL(CM_ERR_INVALID_ARG, "run config '%s': key '%s' needs %s, not %s", path, key,
                   is_path ? "a path (a string)" : "a string or a number",
                   cJSON_IsBool(v)     ? "true/false"
                   : cJSON_IsNull(v)   ? "null"
                   : cJSON_IsArray(v)  ? "a nested array"
                   : cJSON_IsObject(v) ? "an object"
                                       : "a number");
}

static cm_status add_key(strvec *out, const dt_runcfg_flag *f, const cJSON *v, const char *dir,
                         const char *path) {
    char flag[128];
    snprintf(flag, sizeof flag, "--%s", f->name);
    if (f->kind == DT_RUNCFG_BOOL) {
        if (!cJSON_IsBool(v))
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "run config '%s': key '%s' is a bare flag: give true (present) or false (absent)",
                           path, f->name);
        return cJSON_IsTrue(v) ? push(out, flag) : CM_OK;
    }
    if (cJSON_IsBool(v))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "run config '%s': key '%s' takes a value (--%s VALUE), not true/false", path, f->name,
                       f->name);
    const int is_path = f->kind == DT_RUNCFG_PATH || f->kind == DT_RUNCFG_PATHS;
    sbuf      b = {0};
    cm_status st = CM_OK;
    if (cJSON_IsArray(v)) {
        if (f->kind == DT_RUNCFG_PATH)
            st = CM_FAIL(CM_ERR_INVALID_ARG, "run config '%s': key '%s' takes one path, not an array", path,
                         f->name);
        else if (cJSON_GetArraySize(v) == 0)
            st = CM_FAIL(CM_ERR_INVALID_ARG, "run config '%s': key '%s' is an empty array", path, f->name);
        int i = 0;
        for (const cJSON *e = v->child; e && st == CM_OK; e = e->next, i++) {
            if (i > 0)
                st = sb_add(&b, ",");
            if (st == CM_OK)
                st = element(e, dir, is_path, path, f->name, &b);
        }
    } else if (f->kind == DT_RUNCFG_PATHS && cJSON_IsString(v)) {
        /* "a.st,b.st" as the command line spells it: resolve each */
        const char *s = v->valuestring;
        do {
            const char *comma = strchr(s, ',');
            size_t      len = comma ? (size_t)(comma - s) : strlen(s);
            char       *one = strndup(s, len);
            cJSON      *item = one ? cJSON_CreateString(one) : NULL;
            st = item ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "out of memory building a run-config value");
            if (st == CM_OK && b.n)
                st = sb_add(&b, ",");
            if (st == CM_OK)
                st = element(item, dir, 1, path, f->name, &b);
            cJSON_Delete(item);
            free(one);
            s = comma ? comma + 1 : NULL;
        } while (s && st == CM_OK);
    } else
        st = element(v, dir, is_path, path, f->name, &b);
    if (st == CM_OK)
        st = push(out, flag);
    if (st == CM_OK) {
        st = push_owned(out, b.p);
        b.p = NULL;
    }
    free(b.p);
    return st;
}

cm_status dt_runcfg_load(dt_runcfg_argv *out, const dt_runcfg_flag *flags, int n_flags, const char *path) {
    *out = (dt_runcfg_argv){0};
    char *text = NULL;
    CM_TRY(cm_read_text_file(path, 1 << 20, &text));
    const char *end = NULL;
    cJSON      *root = cJSON_ParseWithOpts(text, &end, 1);
    if (!root) {
        long at = end ? (long)(end - text) : -1;
        free(text);
        return CM_FAIL(CM_ERR_FORMAT, "run config '%s' is not valid JSON (near byte %ld)", path, at);
    }
    free(text);
    cm_status   st = CM_OK;
    strvec      v = {0};
    char        dir[4096] = "";
    const char *slash = strrchr(path, '/');
    if (slash)
        snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    if (!cJSON_IsObject(root)) {
        st = CM_FAIL(CM_ERR_FORMAT,
                     "run config '%s' must be a JSON object of flag names and values, e.g. {\"lr\": 6e-4}",
                     path);
        goto done;
    }
    for (const cJSON *item = root->child; item && st == CM_OK; item = item->next) {
        const char *key = item->string;
        for (const cJSON *prev = root->child; prev != item; prev = prev->next)
            if (strcmp(prev->string, key) == 0) {
                st = CM_FAIL(CM_ERR_INVALID_ARG, "run config '%s': key '%s' appears twice", path, key);
                goto done;
            }
        if (strcmp(key, "run-config") == 0) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "run config '%s': a run config cannot name another (key 'run-config')", path);
            goto done;
        }
        const dt_runcfg_flag *f = NULL;
        for (int i = 0; i < n_flags && !f; i++)
            if (strcmp(flags[i].name, key) == 0)
                f = &flags[i];
        if (!f) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "run config '%s': unknown key '%s'; keys are the long flag names without the dashes "
                         "(the closest is '%s')",
                         path, key, dt_runcfg_closest(flags, n_flags, key));
            goto done;
        }
        st = add_key(&v, f, item, dir, path);
    }
done:
    cJSON_Delete(root);
    if (st != CM_OK) {
        strvec_free(&v);
        return st;
    }
    CM_TRY(terminate(&v)); /* an empty object: still a NULL-terminated argv */
    out->argc = v.n;
    out->argv = v.v;
    return CM_OK;
}

cm_status dt_runcfg_expand(dt_runcfg_argv *out, const dt_runcfg_flag *flags, int n_flags, int argc,
                           char *const *argv) {
    *out = (dt_runcfg_argv){0};
    const char *file = NULL;
    int         at = -1;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--run-config") != 0)
            continue;
        if (i + 1 >= argc)
            return CM_FAIL(CM_ERR_INVALID_ARG, "option '--run-config' needs a value (a JSON file)");
        if (file)
            return CM_FAIL(CM_ERR_INVALID_ARG, "--run-config is given twice ('%s' and '%s'); give one", file,
                           argv[i + 1]);
        file = argv[i + 1];
        at = i++;
    }
    strvec    v = {0};
    cm_status st = CM_OK;
    if (file) {
        dt_runcfg_argv f;
        CM_TRY(dt_runcfg_load(&f, flags, n_flags, file));
        v.v = f.argv; /* take it over: its strings are owned and NULL-terminated */
        v.n = f.argc;
        v.cap = f.argc + 1;
    }
    for (int i = 0; i < argc && st == CM_OK; i++)
        if (!(file && (i == at || i == at + 1)))
            st = push(&v, argv[i]);
    if (st == CM_OK)
        st = terminate(&v);
    if (st != CM_OK) {
        strvec_free(&v);
        return st;
    }
    out->argc = v.n;
    out->argv = v.v;
    return CM_OK;
}

void dt_runcfg_argv_release(dt_runcfg_argv *a) {
    if (!a)
        return;
    for (int i = 0; i < a->argc; i++)
        free(a->argv[i]);
    free(a->argv);
    *a = (dt_runcfg_argv){0};
}
