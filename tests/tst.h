/* tests/tst.h — the test harness: checks that count failures, a closeness check that prints
 * the first mismatches and the max errors (llm.c validate_result), checks that a call fails with
 * a given status and message, little-endian stores for hand-built bytes, skip, and the report.
 * Header-only; one test executable includes it once. */
#ifndef TST_H
#define TST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_status.h"

static int tst_failures = 0;
static int tst_checks   = 0;

#define TST_CHECK(cond)                                                                                      \
    do {                                                                                                     \
        tst_checks++;                                                                                        \
        if (!(cond)) {                                                                                       \
            tst_failures++;                                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                         \
        }                                                                                                    \
    } while (0)

/* A call's status as a check: a failure prints what, the status and cm_last_error(). */
static inline int tst_ok(cm_status st, const char *what) {
    if (st != CM_OK) fprintf(stderr, "  %s failed: %s: %s\n", what, cm_status_str(st), cm_last_error());
    TST_CHECK(st == CM_OK);
    return st == CM_OK;
}

/* Elementwise |got - ref| <= atol + rtol·|ref|; prints up to 5 mismatches and the maxima. */
#define TST_CLOSE(name, got, ref, n, atol, rtol) tst_close_(__FILE__, __LINE__, (name), (got), (ref), (n), (atol), (rtol))

static inline int tst_close_(const char *file, int line, const char *name, const float *got, const float *ref,
                             long n, double atol, double rtol) {
    int    bad = 0;
    double max_abs = 0, max_rel = 0;
    for (long i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        double r = d / (fabs((double)ref[i]) + 1e-30);
        if (d > max_abs || isnan(d)) max_abs = isnan(d) ? INFINITY : d;
        if (r > max_rel) max_rel = r;
        if (!(d <= atol + rtol * fabs((double)ref[i]))) {
            if (bad < 5) fprintf(stderr, "  %s[%ld]: got %.8g ref %.8g\n", name, i, got[i], ref[i]);
            bad++;
        }
    }
    tst_checks++;
    if (bad) {
        tst_failures++;
        fprintf(stderr, "%s:%d: %s: %d of %ld differ (max abs %.3g, max rel %.3g)\n", file, line, name, bad, n,
                max_abs, max_rel);
    }
    return bad == 0;
}

/* Relative L2 error ||got - ref|| / ||ref|| in double. */
static inline double tst_rel_l2(const float *got, const double *ref, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        double d = (double)got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num) / (sqrt(den) + 1e-300);
}

/* 1 if cm_last_error() lacks want (said, with file:line); 0 if it holds it or want is NULL. */
static inline int tst_lacks_(const char *file, int line, const char *want) {
    if (!want || strstr(cm_last_error(), want))
        return 0;
    fprintf(stderr, "%s:%d: message '%s' lacks '%s'\n", file, line, cm_last_error(), want);
    return 1;
}

/* call fails with status st, and cm_last_error() holds want (want NULL: any message). */
#define TST_EXPECT_FAIL(call, st, want)                                                                      \
    do {                                                                                                     \
        cm_clear_error();                                                                                    \
        cm_status got_ = (call);                                                                             \
        TST_CHECK(got_ == (st));                                                                             \
        if (tst_lacks_(__FILE__, __LINE__, (want)))                                                          \
            tst_failures++;                                                                                  \
    } while (0)

/* A non-OK status with the expected code (or any, if want == CM_OK) and every word in the message. */
static inline int tst_fails_with(cm_status got, cm_status want, const char *const *words) {
    int ok = got != CM_OK && (want == CM_OK || got == want);
    for (int i = 0; words[i]; i++)
        ok = ok && strstr(cm_last_error(), words[i]) != NULL;
    if (!ok || getenv("TST_VERBOSE"))
        fprintf(stderr, "  %s: %s\n", cm_status_str(got), cm_last_error());
    return ok;
}

/* TST_FAILS(call, want, words...): call fails as tst_fails_with says. */
#define TST_FAILS(call, want, ...)                                                                           \
    do {                                                                                                     \
        cm_clear_error();                                                                                    \
        const char *words_[] = {__VA_ARGS__, NULL};                                                          \
        TST_CHECK(tst_fails_with((call), (want), words_));                                                   \
    } while (0)

/* Little-endian stores, for bytes built by hand. */
static inline void tst_put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void tst_put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

#define TST_SKIP(...)                                                                                        \
    do {                                                                                                     \
        fprintf(stderr, "skipped: " __VA_ARGS__);                                                            \
        fprintf(stderr, "\n");                                                                               \
        exit(77);                                                                                            \
    } while (0)

static inline int tst_report(void) {
    fflush(stdout); /* a log of both streams: the buffered output first, so this line is not cut into it */
    fprintf(stderr, "%d checks, %d failed\n", tst_checks, tst_failures);
    return tst_failures ? 1 : 0;
}

#endif /* TST_H */
