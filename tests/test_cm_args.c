/* test_cm_args: the shared command-line parser — flags, values, ranges, choices, the messages
 * users read, and that parsing stops at the first error. stderr is redirected to a file and read
 * back so each message is checked as printed. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cm_args.h"
#include "tst.h"

typedef struct {
    int         resume;
    const char *config;
    int64_t     steps;
    int         threads;
    double      lr;
    uint64_t    seed;
    int         mode;
} opts;

static char err_text[4096];

/* Parses argv as a small command would; returns 0 ok, 1 help, 2 usage error. The messages
 * printed land in err_text. */
static int parse(opts *o, char **argv, int argc) {
    static const char *const modes[] = {"bf16", "fp32", "fp8", NULL};
    *o = (opts){.steps = -1, .threads = -1, .lr = -1, .mode = -1};
    fflush(stderr);
    FILE *f = tmpfile();
    int   saved = dup(2);
    dup2(fileno(f), 2);
    cm_args p;
    cm_args_init(&p, "tool cmd", argc, argv);
    int rc = 0;
    while (cm_args_next(&p)) {
        if (cm_args_help(&p)) {
            rc = 1;
            break;
        } else if (cm_args_flag(&p, "--resume"))
            o->resume = 1;
        else if (cm_args_str(&p, "--config", &o->config))
            ;
        else if (cm_args_i64(&p, "--steps", 1, INT64_MAX, &o->steps))
            ;
        else if (cm_args_int(&p, "--threads", 1, 64, &o->threads))
            ;
        else if (cm_args_f64(&p, "--lr", 0, 1e3, &o->lr))
            ;
        else if (cm_args_u64(&p, "--seed", &o->seed))
            ;
        else if (cm_args_choice(&p, "--precision", modes, &o->mode))
            ;
        else if (cm_args_log_level(&p))
            ;
        else
            cm_args_unknown(&p);
    }
    if (p.bad)
        rc = 2;
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(f);
    size_t n = fread(err_text, 1, sizeof err_text - 1, f);
    err_text[n] = 0;
    fclose(f);
    return rc;
}

#define ARGV(...) ((char *[]){__VA_ARGS__}), (int)(sizeof((char *[]){__VA_ARGS__}) / sizeof(char *))

static void expect_error(const char *why, char **argv, int argc, const char *msg) {
    opts o;
    int  rc = parse(&o, argv, argc);
    if (rc != 2 || !strstr(err_text, msg))
        fprintf(stderr, "  %s: rc %d, stderr '%s', expected '%s'\n", why, rc, err_text, msg);
    TST_CHECK(rc == 2 && strstr(err_text, msg));
    // One message, not a cascade.
    TST_CHECK(strchr(err_text, '\n') == strrchr(err_text, '\n'));
}

int main(void) {
    opts   o;
    char **av;
    int    ac;

    // Values of every kind, bare flags between them, in any order.
    {
        char *v[] = {"--steps",
                     "12",
                     "--resume",
                     "--config",
                     "c.json",
                     "--threads",
                     "64",
                     "--lr",
                     "6e-4",
                     "--seed",
                     "18446744073709551615",
                     "--precision",
                     "fp32",
                     "--log-level",
                     "warn"};
        av = v;
        ac = (int)(sizeof v / sizeof *v);
        TST_CHECK(parse(&o, av, ac) == 0 && err_text[0] == 0);
        TST_CHECK(o.resume == 1 && o.config && strcmp(o.config, "c.json") == 0);
        TST_CHECK(o.steps == 12 && o.threads == 64 && o.lr == 6e-4 && o.mode == 1);
        TST_CHECK(o.seed == UINT64_MAX);
    }
    // A value that looks like a flag is still the value ("--config --resume" names a file).
    TST_CHECK(parse(&o, ARGV("--config", "--resume")) == 0 && o.config && strcmp(o.config, "--resume") == 0 &&
              o.resume == 0);
    TST_CHECK(parse(&o, ARGV("--resume", "-h", "--bogus")) == 1);
    TST_CHECK(parse(&o, NULL, 0) == 0 && o.steps == -1);

    expect_error("unknown", ARGV("--resume", "--frobnicate", "1"),
                 "tool cmd: unknown option '--frobnicate' (see --help)");
    expect_error("missing value", ARGV("--resume", "--steps"),
                 "tool cmd: option '--steps' needs a value (see --help)");
    expect_error("not an integer", ARGV("--steps", "12x"),
                 "tool cmd: --steps '12x': expected an integer >= 1");
    expect_error("below range", ARGV("--steps", "0"), "expected an integer >= 1");
    expect_error("empty integer", ARGV("--steps", ""), "expected an integer >= 1");
    expect_error("above range", ARGV("--threads", "65"),
                 "tool cmd: --threads '65': expected an integer in [1, 64]");
    expect_error("overflow", ARGV("--threads", "99999999999999999999"), "expected an integer in [1, 64]");
    expect_error("bad number", ARGV("--lr", "fast"), "tool cmd: --lr 'fast': expected a number in [0, 1000]");
    expect_error("nan", ARGV("--lr", "nan"), "expected a number in [0, 1000]");
    expect_error("seed", ARGV("--seed", "x1"), "tool cmd: --seed 'x1' is not a number");
    expect_error("negative seed", ARGV("--seed", "-1"), "--seed '-1' is not a number");
    expect_error("choice", ARGV("--precision", "fp4"),
                 "tool cmd: --precision 'fp4': expected bf16, fp32 or fp8");
    expect_error("log level", ARGV("--log-level", "loud"),
                 "tool cmd: --log-level 'loud': expected debug, info, warn, error or off");
    // Parsing stops at the first error: the later unknown option is not reported.
    expect_error("first error only", ARGV("--steps", "0", "--frobnicate"), "expected an integer >= 1");
    TST_CHECK(!strstr(err_text, "frobnicate"));

    // The value parsers on their own (environment variables).
    int64_t x = 0;
    double  d = 0;
    TST_CHECK(cm_parse_i64("t", "RANK", "3", 0, INT64_MAX, &x) == 1 && x == 3);
    TST_CHECK(cm_parse_f64("t", "X", "0.5", 0, 1, &d) == 1 && d == 0.5);
    TST_CHECK(cm_parse_f64("t", "X", "1.5", 0, 1, &d) == 0 && d == 0.5);

    return tst_report();
}
