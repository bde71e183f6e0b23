/* drafter-trainer/cmd/dt_progress.h — training progress people can read (--progress):
 *   bar   (a TTY): one line redrawn in place with \r, at most every 0.1 s of steps and always
 *         at the last step:
 *         step 120/1200 [##....] 10% | loss 3.21 | τ 1.84 | acc 0.42 | 12.3k tok/s | wait 3% | eta 4m12s
 *   lines (logs, CI): one plain ASCII line every log_every steps and at the last step:
 *         step 120/1200 (10%) epoch 1 loss 3.2100 tau 1.840 acc 0.420 lr 5.96e-04 12.3k tok/s wait 3% eta
 * 4m12s off   nothing; auto = bar when the stream is a terminal (and TERM is not "dumb"), else lines. Rates,
 * the wait share and the ETA come from a moving window of the last DT_PROGRESS_WINDOW steps (step time = wait
 * for hidden states + compute), so they follow the run's current speed rather than its start-up; loss, τ and
 * acc shown are their means over the same window (one batch's values swing too much to read a trend from;
 * metrics.jsonl keeps every step's own). The format
 * functions are pure (they only write buf) and are what the tests check. A dt_progress is a caller-owned
 * struct: no allocation, one owner thread. */
#ifndef DT_PROGRESS_H
#define DT_PROGRESS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_PROGRESS_WINDOW 32 /* steps in the moving averages */
#define DT_PROGRESS_BAR_W  20 /* characters of the bar between [ ] */

typedef enum dt_progress_mode {
    DT_PROGRESS_AUTO = 0,
    DT_PROGRESS_BAR,
    DT_PROGRESS_LINES,
    DT_PROGRESS_OFF,
} dt_progress_mode;

/* "auto", "bar", "lines", "off"; anything else is CM_ERR_INVALID_ARG naming the choices. */
cm_status dt_progress_mode_parse(const char *s, dt_progress_mode *out);

/* What one display line shows. NaN and negative values are shown as such or as "?"; nothing
 * here can make the formatters overflow buf. */
typedef struct dt_progress_line {
    int64_t step, total;    /* steps done (1-based) of total; total ≤ 0 = unknown */
    int64_t epoch;          /* < 0: not shown */
    double  loss, tau, acc; /* acc: slot-1 accuracy in [0, 1] */
    double  lr;             /* lines mode only; < 0: not shown */
    double  tokens_per_s;   /* over the window */
    double  wait_frac;      /* waiting for hidden states / step time, over the window, in [0, 1] */
    double  eta_s;          /* < 0 or NaN: unknown */
    int     v2;             /* DFlash2: also the selector's τ and recall@K (windowed like loss) */
    double  sel_tau, recall;
} dt_progress_line;

/* "4m12s", "59s", "1h02m", "3d04h", ">99d"; "?" for negative or NaN. Returns buf. */
const char *dt_progress_fmt_duration(char *buf, size_t cap, double seconds);
/* "950", "12.3k", "4.56M", "7.89G"; "?" for negative or NaN. Returns buf. */
const char *dt_progress_fmt_count(char *buf, size_t cap, double value);
/* The bar line (no \r, no newline). Returns the length written (< cap, truncated if short). */
size_t dt_progress_fmt_bar(char *buf, size_t cap, const dt_progress_line *l);
/* The plain line (no newline). */
size_t dt_progress_fmt_lines(char *buf, size_t cap, const dt_progress_line *l);

typedef struct dt_progress_config {
    dt_progress_mode mode;
    FILE            *out;       /* usually stderr; borrowed */
    int64_t          log_every; /* lines mode: every N-th step (≥ 1) */
} dt_progress_config;

typedef struct dt_progress {
    dt_progress_mode mode; /* resolved: BAR, LINES or OFF */
    FILE            *out;
    int64_t          log_every;
    double           step_s[DT_PROGRESS_WINDOW], wait_s[DT_PROGRESS_WINDOW], tokens[DT_PROGRESS_WINDOW];
    double           loss[DT_PROGRESS_WINDOW], tau[DT_PROGRESS_WINDOW], acc[DT_PROGRESS_WINDOW];
    double           sel_tau[DT_PROGRESS_WINDOW], recall[DT_PROGRESS_WINDOW];
    int              n, head;      /* samples in the window, next slot */
    double           since_draw_s; /* step time since the bar was last drawn */
    int              drawn;        /* a bar line is on screen (needs a newline at the end) */
} dt_progress;

/* Resolves AUTO against cfg->out (isatty, TERM). */
void dt_progress_init(dt_progress *p, const dt_progress_config *cfg);
/* Records one finished step (step_s = its whole time, wait_s = the part spent waiting for the
 * batch and hidden states, tokens = its packed tokens; l->loss, tau and acc this step's values)
 * and draws or prints when due. The line's rate, wait share and ETA fields are filled here from
 * the window, and its loss, tau and acc replaced by their window means; the caller sets the
 * rest. */
void dt_progress_step(dt_progress *p, dt_progress_line *l, double step_s, double wait_s, double tokens);
/* Fills tokens_per_s, wait_frac and eta_s of l from the window (pure; used by step). */
void dt_progress_window(const dt_progress *p, dt_progress_line *l);
/* Ends a drawn bar with a newline so a log line (a checkpoint saved, a reconnect) starts on
 * its own line; the next step draws the bar again below it. */
void dt_progress_break(dt_progress *p);
/* At the end of the run: dt_progress_break. */
void dt_progress_release(dt_progress *p);

#ifdef __cplusplus
}
#endif
#endif /* DT_PROGRESS_H */
