/* common/base/cm_args.c — the command-line parser of cm_args.h: a cursor over argv and typed,
 * range-checked values; a refusal prints its message to stderr and marks the line bad. */
#include "cm_args.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

void cm_args_init(cm_args *p, const char *cmd, int argc, char **argv) {
    *p = (cm_args){.cmd = cmd, .argc = argc, .argv = argv, .i = -1, .next = 0};
}

int cm_args_next(cm_args *p) {
    if (p->bad || p->next >= p->argc)
        return 0;
    p->i = p->next;
    p->next = p->i + 1;
    p->arg = p->argv[p->i];
    return 1;
}

int cm_args_help(cm_args *p) {
    return strcmp(p->arg, "-h") == 0 || strcmp(p->arg, "--help") == 0;
}

int cm_args_flag(cm_args *p, const char *name) {
    return strcmp(p->arg, name) == 0;
}

/* The value of the current flag `name`, consumed; NULL when it is another flag or when the
 * value is missing (then bad is set and the message printed). *matched tells them apart. */
static const char *take_value(cm_args *p, const char *name, int *matched) {
    *matched = strcmp(p->arg, name) == 0;
    if (!*matched)
        return NULL;
    if (p->i + 1 >= p->argc) {
        fprintf(stderr, "%s: option '%s' needs a value (see --help)\n", p->cmd, name);
        p->bad = 1;
        return NULL;
    }
    p->next = p->i + 2;
    return p->argv[p->i + 1];
}

int cm_args_str(cm_args *p, const char *name, const char **out) {
    int         m;
    const char *v = take_value(p, name, &m);
    if (v)
        *out = v;
    return m;
}

int cm_parse_i64(const char *cmd, const char *what, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        if (hi == INT64_MAX)
            fprintf(stderr, "%s: %s '%s': expected an integer >= %lld\n", cmd, what, s, (long long)lo);
        else
            fprintf(stderr, "%s: %s '%s': expected an integer in [%lld, %lld]\n", cmd, what, s, (long long)lo,
                    (long long)hi);
        return 0;
    }
    *out = v;
    return 1;
}

int cm_parse_f64(const char *cmd, const char *what, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "%s: %s '%s': expected a number in [%g, %g]\n", cmd, what, s, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

int cm_args_i64(cm_args *p, const char *name, int64_t lo, int64_t hi, int64_t *out) {
    int         m;
    const char *v = take_value(p, name, &m);
    if (v && !cm_parse_i64(p->cmd, name, v, lo, hi, out))
        p->bad = 1;
    return m;
}

int cm_args_int(cm_args *p, const char *name, int lo, int hi, int *out) {
    int64_t x = 0;
    int     m = cm_args_i64(p, name, lo, hi, &x);
    if (m && !p->bad)
        *out = (int)x;
    return m;
}

int cm_args_u64(cm_args *p, const char *name, uint64_t *out) {
    int         m;
    const char *v = take_value(p, name, &m);
    if (!v)
        return m;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || *v == '-') {
        fprintf(stderr, "%s: %s '%s' is not a number\n", p->cmd, name, v);
        p->bad = 1;
        return 1;
    }
    *out = x;
    return 1;
}

int cm_args_f64(cm_args *p, const char *name, double lo, double hi, double *out) {
    int         m;
    const char *v = take_value(p, name, &m);
    if (v && !cm_parse_f64(p->cmd, name, v, lo, hi, out))
        p->bad = 1;
    return m;
}

int cm_args_choice(cm_args *p, const char *name, const char *const *choices, int *out) {
    int         m;
    const char *v = take_value(p, name, &m);
    if (!v)
        return m;
    char expect[256] = "";
    int  n = 0;
    for (; choices[n]; n++) {
        if (strcmp(v, choices[n]) == 0) {
            *out = n;
            return 1;
        }
    }
    size_t o = 0;
    for (int k = 0; k < n && o < sizeof expect; k++)
        o += (size_t)snprintf(expect + o, sizeof expect - o, "%s%s",
                              k == 0       ? ""
                              : k == n - 1 ? " or "
                                           : ", ",
                              choices[k]);
    return cm_args_fail(p, "expected %s", expect);
}

int cm_args_log_level(cm_args *p) {
    int         m;
    const char *v = take_value(p, "--log-level", &m);
    if (!v)
        return m;
    int l = cm_log_level_parse(v);
    if (l < 0)
        return cm_args_fail(p, "expected debug, info, warn, error or off");
    cm_log_set_level((cm_log_level)l);
    return 1;
}

void cm_args_unknown(cm_args *p) {
    fprintf(stderr, "%s: unknown option '%s' (see --help)\n", p->cmd, p->arg);
    p->bad = 1;
}

int cm_args_fail(cm_args *p, const char *fmt, ...) {
    char    msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *v = p->next > p->i + 1 ? p->argv[p->i + 1] : NULL;
    if (v)
        fprintf(stderr, "%s: %s '%s': %s\n", p->cmd, p->arg, v, msg);
    else
        fprintf(stderr, "%s: %s: %s\n", p->cmd, p->arg, msg);
    p->bad = 1;
    return 1;
}
