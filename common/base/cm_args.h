#ifndef CM_ARGS_H
#define CM_ARGS_H
/* cm_args: the one command-line parser every command uses.
 *
 * A command walks its arguments with a cursor:
 *
 *     cm_args p;
 *     cm_args_init(&p, "drafter-trainer train", argc, argv);
 *     while (cm_args_next(&p)) {
 *         if (cm_args_help(&p))                       { usage(stdout); return 1; }
 *         else if (cm_args_flag(&p, "--resume"))      a->resume = 1;
 *         else if (cm_args_str(&p, "--config", &a->config)) ;
 *         else if (cm_args_i64(&p, "--steps", 1, INT64_MAX, &a->steps)) ;
 *         else cm_args_unknown(&p);
 *     }
 *     if (p.bad) return 2;
 *
 * Each matcher returns 1 when the current argument is its flag (then the value, if any, is
 * consumed; a missing or malformed value prints one message and sets `bad`), else 0. After the
 * first error the cursor stops. Every message starts with the command's name:
 *
 *     drafter-trainer train: option '--steps' needs a value (see --help)
 *     drafter-trainer train: --steps 'x': expected an integer from 1 to 9223372036854775807
 *     drafter-trainer train: unknown option '--frobnicate' (see --help)
 */
#include <stdint.h>

typedef struct {
    const char *cmd; // "drafter-trainer train": the prefix of every message
    int         argc;
    char      **argv;
    int         i;    // index of the current argument
    int         next; // index of the argument after it (moved past a consumed value)
    const char *arg;  // the current argument
    int         bad;  // 1 after the first error (a message was printed)
} cm_args;

void cm_args_init(cm_args *p, const char *cmd, int argc, char **argv);
// 1 while an argument is current (and no error happened), 0 at the end.
int cm_args_next(cm_args *p);
// -h or --help.
int cm_args_help(cm_args *p);
// A flag without a value.
int cm_args_flag(cm_args *p, const char *name);
// A flag with a value, kept as the string in argv.
int cm_args_str(cm_args *p, const char *name, const char **out);
// A flag with an integer value in [lo, hi].
int cm_args_i64(cm_args *p, const char *name, int64_t lo, int64_t hi, int64_t *out);
int cm_args_int(cm_args *p, const char *name, int lo, int hi, int *out);
// A flag with an unsigned 64-bit value (seeds).
int cm_args_u64(cm_args *p, const char *name, uint64_t *out);
// A flag with a number in [lo, hi].
int cm_args_f64(cm_args *p, const char *name, double lo, double hi, double *out);
// A flag whose value is one of `choices` (NULL-terminated); *out is its index.
int cm_args_choice(cm_args *p, const char *name, const char *const *choices, int *out);
// --log-level debug|info|warn|error|off, applied at once.
int cm_args_log_level(cm_args *p);
// The current argument matched nothing: "unknown option".
void cm_args_unknown(cm_args *p);
// One message about the current flag's value; sets bad. Returns 1 (so a matcher can return it).
int cm_args_fail(cm_args *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The value parsers underneath, for values that come from elsewhere (environment variables):
 * 1 and *out set, else 0 with a message "<cmd>: <what> '<s>': expected …" printed. */
int cm_parse_i64(const char *cmd, const char *what, const char *s, int64_t lo, int64_t hi, int64_t *out);
int cm_parse_f64(const char *cmd, const char *what, const char *s, double lo, double hi, double *out);
#endif
