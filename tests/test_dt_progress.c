/* tests/test_dt_progress.c — the progress display (drafter-trainer/cmd/dt_progress.h): every
 * formatter against exact expected text (durations, counts, the bar and the log line, odd
 * values: 0 steps, unknown total, NaN loss, a huge ETA, a short buffer), the moving window's
 * rates, ETA and loss/τ/acc means from known steps (and that it forgets old steps), --progress parsing,
 * and the real output: lines every log_every steps and at the last, the bar throttled to
 * 0.1 s of steps and ended by a newline, and auto choosing the bar on a pseudo-terminal but
 * lines on a file or with TERM=dumb. */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dt_progress.h"
#include "tst.h"

#define CHECK_STR(got, want)                                                                                 \
    do {                                                                                                     \
        const char *g_ = (got), *w_ = (want);                                                                \
        TST_CHECK(strcmp(g_, w_) == 0);                                                                      \
        if (strcmp(g_, w_) != 0)                                                                             \
            fprintf(stderr, "  got  '%s'\n  want '%s'\n", g_, w_);                                           \
    } while (0)

static void test_duration(void) {
    char b[32];
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 0), "0s");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 59.4), "59s");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 59.6), "1m00s");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 252), "4m12s");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 3600), "1h00m");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 3725), "1h02m");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 90000), "1d01h");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 99 * 86400.0), "99d00h");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, 1e12), ">99d");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, INFINITY), ">99d");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, -1), "?");
    CHECK_STR(dt_progress_fmt_duration(b, sizeof b, NAN), "?");
}

static void test_count(void) {
    char b[32];
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 0), "0");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 950), "950");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 999.4), "999");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 999.6), "1.00k");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 12345), "12.3k");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 123456), "123k");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 999999), "1.00M");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 4.56e6), "4.56M");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, 7.891e9), "7.89G");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, NAN), "?");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, -5), "?");
    CHECK_STR(dt_progress_fmt_count(b, sizeof b, INFINITY), "?");
}

static dt_progress_line example(void) {
    return (dt_progress_line){.step = 120,
                              .total = 1200,
                              .epoch = 0,
                              .loss = 3.21,
                              .tau = 1.84,
                              .acc = 0.42,
                              .lr = 5.96e-4,
                              .tokens_per_s = 12300,
                              .wait_frac = 0.03,
                              .eta_s = 252};
}

static void test_lines_format(void) {
    char             b[512];
    dt_progress_line l = example();
    size_t           n = dt_progress_fmt_bar(b, sizeof b, &l);
    CHECK_STR(b, "step 120/1200 [##..................] 10% | loss 3.21 | τ 1.84 | acc 0.42 | 12.3k tok/s | "
                 "wait 3% | eta 4m12s");
    TST_CHECK(n == strlen(b));
    n = dt_progress_fmt_lines(b, sizeof b, &l);
    CHECK_STR(b,
              "step 120/1200 (10%) epoch 0 loss 3.2100 tau 1.840 acc 0.420 lr 5.96e-04 12.3k tok/s wait 3% "
              "eta 4m12s");
    TST_CHECK(n == strlen(b));

    /* nothing known yet: 0 of 0 steps, NaN loss and rates, no epoch or lr */
    dt_progress_line z = {.step = 0,
                          .total = 0,
                          .epoch = -1,
                          .loss = NAN,
                          .tau = 0,
                          .acc = 0,
                          .lr = -1,
                          .tokens_per_s = NAN,
                          .wait_frac = NAN,
                          .eta_s = NAN};
    dt_progress_fmt_bar(b, sizeof b, &z);
    CHECK_STR(b,
              "step 0/? [....................] ?% | loss nan | τ 0 | acc 0.00 | ? tok/s | wait 0% | eta ?");
    dt_progress_fmt_lines(b, sizeof b, &z);
    CHECK_STR(b, "step 0/? (?%) loss nan tau 0.000 acc 0.000 ? tok/s wait 0% eta ?");

    /* the end, past the end (a --steps beyond the schedule), a huge ETA, wait > 1 clamped */
    dt_progress_line e = example();
    e.step = 1200;
    e.eta_s = 0;
    dt_progress_fmt_bar(b, sizeof b, &e);
    CHECK_STR(b, "step 1200/1200 [####################] 100% | loss 3.21 | τ 1.84 | acc 0.42 | 12.3k tok/s | "
                 "wait 3% | eta 0s");
    e.step = 1500;
    e.eta_s = 1e15;
    e.wait_frac = 1.7;
    e.loss = INFINITY;
    dt_progress_fmt_lines(b, sizeof b, &e);
    CHECK_STR(b,
              "step 1500/1200 (100%) epoch 0 loss inf tau 1.840 acc 0.420 lr 5.96e-04 12.3k tok/s wait 100% "
              "eta >99d");
    e = example();
    e.step = 1199; /* 99.9%: floors to 99, the bar one short of full */
    dt_progress_fmt_bar(b, sizeof b, &e);
    TST_CHECK(strncmp(b, "step 1199/1200 [###################.] 99% |", 43) == 0);

    /* a buffer too short: truncated, terminated, the length what is there */
    char s[16];
    memset(s, 'Z', sizeof s);
    n = dt_progress_fmt_bar(s, sizeof s, &l);
    TST_CHECK(n == 15 && s[15] == '\0' && strncmp(s, "step 120/1200 [", 15) == 0);
    n = dt_progress_fmt_lines(s, 1, &l);
    TST_CHECK(n == 0 && s[0] == '\0');
}

static void test_parse(void) {
    dt_progress_mode m = DT_PROGRESS_OFF;
    TST_CHECK(dt_progress_mode_parse("auto", &m) == CM_OK && m == DT_PROGRESS_AUTO);
    TST_CHECK(dt_progress_mode_parse("bar", &m) == CM_OK && m == DT_PROGRESS_BAR);
    TST_CHECK(dt_progress_mode_parse("lines", &m) == CM_OK && m == DT_PROGRESS_LINES);
    TST_CHECK(dt_progress_mode_parse("off", &m) == CM_OK && m == DT_PROGRESS_OFF);
    TST_CHECK(dt_progress_mode_parse("tty", &m) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "--progress 'tty': expected auto, bar, lines or off") != NULL);
}

static void test_window(void) {
    dt_progress        p;
    dt_progress_config c = {.mode = DT_PROGRESS_OFF, .out = stderr, .log_every = 1};
    dt_progress_init(&p, &c);
    TST_CHECK(p.mode == DT_PROGRESS_OFF);
    dt_progress_line l = example();
    l.total = 10;
    l.step = 0;
    dt_progress_window(&p, &l); /* no step yet: nothing known */
    TST_CHECK(isnan(l.tokens_per_s) && isnan(l.wait_frac) && isnan(l.eta_s));
    for (int s = 1; s <= 4; s++) {
        l.step = s;
        dt_progress_step(&p, &l, 2.0, 0.5, 1000);
    }
    TST_CHECK(l.tokens_per_s == 500 && l.wait_frac == 0.25 && l.eta_s == 12);
    /* 32 steps of 1 s then 32 of 3 s: the window holds only the 3 s ones */
    dt_progress_init(&p, &c);
    l.total = 1000;
    for (int s = 1; s <= 2 * DT_PROGRESS_WINDOW; s++) {
        l.step = s;
        dt_progress_step(&p, &l, s <= DT_PROGRESS_WINDOW ? 1.0 : 3.0, s <= DT_PROGRESS_WINDOW ? 1.0 : 0.0,
                         300);
    }
    TST_CHECK(p.n == DT_PROGRESS_WINDOW);
    TST_CHECK(fabs(l.tokens_per_s - 100) < 1e-9 && l.wait_frac == 0);
    TST_CHECK(fabs(l.eta_s - 3.0 * (1000 - 2 * DT_PROGRESS_WINDOW)) < 1e-6);
    /* negative or zero times (a clock step) count as 0 and never make a negative rate */
    dt_progress_init(&p, &c);
    l.step = 1;
    dt_progress_step(&p, &l, -1, -1, 100);
    TST_CHECK(isnan(l.tokens_per_s) && isnan(l.wait_frac) && l.eta_s == 0);
    /* loss, τ and acc shown are window means: 1 then 3 shows 2; after a window of 5s, 5 */
    dt_progress_init(&p, &c);
    l.loss = 1, l.tau = 1, l.acc = 0.25;
    dt_progress_step(&p, &l, 1, 0, 100);
    TST_CHECK(l.loss == 1 && l.tau == 1 && l.acc == 0.25);
    l.loss = 3, l.tau = 2, l.acc = 0.75;
    dt_progress_step(&p, &l, 1, 0, 100);
    TST_CHECK(l.loss == 2 && l.tau == 1.5 && l.acc == 0.5);
    for (int s = 0; s < DT_PROGRESS_WINDOW; s++) {
        l.loss = 5, l.tau = 3, l.acc = 1;
        dt_progress_step(&p, &l, 1, 0, 100);
    }
    TST_CHECK(l.loss == 5 && l.tau == 3 && l.acc == 1);
}

/* Runs 10 steps of 0.06 s each through a display writing to f; returns what it wrote. */
static const char *run_ten(dt_progress_mode mode, int64_t log_every, FILE *f, dt_progress_mode *resolved) {
    static char        out[8192];
    dt_progress        p;
    dt_progress_config c = {.mode = mode, .out = f, .log_every = log_every};
    dt_progress_init(&p, &c);
    *resolved = p.mode;
    dt_progress_line l = example();
    l.total = 10;
    for (int s = 1; s <= 10; s++) {
        l.step = s;
        dt_progress_step(&p, &l, 0.06, 0.003, 600);
        if (s == 4)
            dt_progress_break(&p); /* as before a "saved checkpoint" log line */
    }
    dt_progress_release(&p);
    fflush(f);
    rewind(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    return out;
}

static int count(const char *s, const char *sub) {
    int n = 0;
    for (const char *p = strstr(s, sub); p; p = strstr(p + 1, sub))
        n++;
    return n;
}

static void test_output(void) {
    dt_progress_mode m;
    FILE            *f = tmpfile();
    const char      *o = run_ten(DT_PROGRESS_LINES, 3, f, &m);
    fclose(f);
    TST_CHECK(m == DT_PROGRESS_LINES);
    TST_CHECK(count(o, "\n") == 4 && count(o, "\r") == 0);
    TST_CHECK(strncmp(o, "step 3/10 (30%) epoch 0 loss 3.2100", 35) == 0);
    TST_CHECK(strstr(o, "\nstep 6/10 (60%)") && strstr(o, "\nstep 9/10 (90%)") &&
              strstr(o, "\nstep 10/10 (100%)"));
    TST_CHECK(strstr(o, " 10.0k tok/s wait 5% eta 0s\n") != NULL); /* 600 tokens / 0.06 s; 0.003 / 0.06 */
    TST_CHECK(strstr(o, "step 3/10 (30%)") && strstr(o, "eta 0s\n") && strstr(o, "wait 5% eta 0s"));

    /* the bar on a file (forced): draws at steps 1, 3, 5 (and 5 again after the break), 7, 9, 10 */
    f = tmpfile();
    o = run_ten(DT_PROGRESS_BAR, 3, f, &m);
    fclose(f);
    TST_CHECK(m == DT_PROGRESS_BAR);
    TST_CHECK(count(o, "\r") == 6 && count(o, "\033[K") == 6);
    TST_CHECK(strncmp(o, "\rstep 1/10 [##..................] 10% | loss 3.21 | τ 1.84", 40) == 0);
    TST_CHECK(strstr(o, "\rstep 3/10 [######") != NULL && strstr(o, "\rstep 2/10") == NULL);
    TST_CHECK(strstr(o, "eta 0s\033[K\n") != NULL);        /* the last step, then release's newline */
    TST_CHECK(strstr(o, "\033[K\n\rstep 5/10 [") != NULL); /* the break after step 4 */
    TST_CHECK(count(o, "\n") == 2 && o[strlen(o) - 1] == '\n');
    TST_CHECK(strstr(o, "eta 0s") && strstr(o, "step 10/10 [####################] 100%"));

    /* auto: a file is not a terminal → lines; off → nothing */
    f = tmpfile();
    o = run_ten(DT_PROGRESS_AUTO, 5, f, &m);
    fclose(f);
    TST_CHECK(m == DT_PROGRESS_LINES && count(o, "\n") == 2);
    f = tmpfile();
    o = run_ten(DT_PROGRESS_OFF, 1, f, &m);
    fclose(f);
    TST_CHECK(m == DT_PROGRESS_OFF && o[0] == '\0');

    /* auto on a pseudo-terminal → the bar, unless TERM=dumb */
    int master = posix_openpt(O_RDWR | O_NOCTTY);
    if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) {
        fprintf(stderr, "  no pseudo-terminal here: the tty case of auto is not checked\n");
        if (master >= 0)
            close(master);
        return;
    }
    int   slave = open(ptsname(master), O_RDWR | O_NOCTTY);
    FILE *tty = slave >= 0 ? fdopen(slave, "w") : NULL;
    TST_CHECK(tty != NULL);
    if (tty) {
        const char        *old = getenv("TERM");
        char               saved[64] = "";
        dt_progress        p;
        dt_progress_config c = {.mode = DT_PROGRESS_AUTO, .out = tty, .log_every = 1};
        if (old)
            snprintf(saved, sizeof saved, "%s", old);
        setenv("TERM", "xterm", 1);
        dt_progress_init(&p, &c);
        TST_CHECK(p.mode == DT_PROGRESS_BAR);
        setenv("TERM", "dumb", 1);
        dt_progress_init(&p, &c);
        TST_CHECK(p.mode == DT_PROGRESS_LINES);
        if (old)
            setenv("TERM", saved, 1);
        else
            unsetenv("TERM");
        fclose(tty);
    }
    close(master);
}

int main(void) {
    test_duration();
    test_count();
    test_lines_format();
    test_parse();
    test_window();
    test_output();
    return tst_report();
}
