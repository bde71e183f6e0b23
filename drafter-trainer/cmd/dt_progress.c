/* drafter-trainer/cmd/dt_progress.c — the progress bar and log lines of dt_progress.h. Formatting
 * is separate from output so the tests can hold every field to its spelling; output is one
 * fputs + fflush per draw, no allocation. */
#include "dt_progress.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

cm_status dt_progress_mode_parse(const char *s, dt_progress_mode *out) {
    static const char *const names[] = {"auto", "bar", "lines", "off"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (dt_progress_mode)i;
            return CM_OK;
        }
    return CM_FAIL(CM_ERR_INVALID_ARG, "--progress '%s': expected auto, bar, lines or off", s);
}

// ---- formatting (pure)

const char *dt_progress_fmt_duration(char *buf, size_t cap, double s) {
    if (!(s >= 0)) /* negative or NaN */
        snprintf(buf, cap, "?");
    else if (s >= 99.5 * 86400)
        snprintf(buf, cap, ">99d");
    else {
        const long long t = llround(s);
        if (t < 60)
            snprintf(buf, cap, "%llds", t);
        else if (t < 3600)
            snprintf(buf, cap, "%lldm%02llds", t / 60, t % 60);
        else if (t < 86400)
            snprintf(buf, cap, "%lldh%02lldm", t / 3600, t % 3600 / 60);
        else
            snprintf(buf, cap, "%lldd%02lldh", t / 86400, t % 86400 / 3600);
    }
    return buf;
}

const char *dt_progress_fmt_count(char *buf, size_t cap, double v) {
    static const char units[] = {'k', 'M', 'G', 'T', 'P'};
    if (!(v >= 0) || isinf(v)) {
        snprintf(buf, cap, "?");
        return buf;
    }
    if (v < 999.5) {
        snprintf(buf, cap, "%.0f", v);
        return buf;
    }
    int u = 0;
    v /= 1000;
    /* 3 significant digits; move up a unit where rounding would print 1000 */
    while (u < 4 && v >= 999.5) {
        v /= 1000;
        u++;
    }
    if (v < 9.995)
        snprintf(buf, cap, "%.2f%c", v, units[u]);
    else if (v < 99.95)
        snprintf(buf, cap, "%.1f%c", v, units[u]);
    else
        snprintf(buf, cap, "%.0f%c", v, units[u]);
    return buf;
}

/* Appends to buf at *n, never past cap (snprintf's return may exceed what fit). */
static void put(char *buf, size_t cap, size_t *n, const char *fmt, ...) {
    if (*n + 1 >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *n, cap - *n, fmt, ap);
    va_end(ap);
    if (w > 0)
        *n += (size_t)w < cap - *n ? (size_t)w : cap - *n - 1;
}

/* Done share in [0, 1], or -1 when the total is unknown. */
static double done_frac(const dt_progress_line *l) {
    if (l->total <= 0)
        return -1;
    double f = (double)l->step / (double)l->total;
    return f < 0 ? 0 : f > 1 ? 1 : f;
}

static void put_pct(char *buf, size_t cap, size_t *n, double frac) {
    if (frac < 0)
        put(buf, cap, n, "?%%");
    else
        put(buf, cap, n, "%d%%", (int)floor(frac * 100));
}

static double clamp01(double x) {
    return !(x >= 0) ? 0 : x > 1 ? 1 : x;
}

size_t dt_progress_fmt_bar(char *buf, size_t cap, const dt_progress_line *l) {
    size_t n = 0;
    char   rate[32], eta[32];
    if (cap)
        buf[0] = '\0';
    const double f = done_frac(l);
    put(buf, cap, &n, "step %" PRId64 "/", l->step);
    if (l->total > 0)
        put(buf, cap, &n, "%" PRId64 " [", l->total);
    else
        put(buf, cap, &n, "? [");
    const int fill = f < 0 ? 0 : (int)floor(f * DT_PROGRESS_BAR_W);
    for (int i = 0; i < DT_PROGRESS_BAR_W; i++)
        put(buf, cap, &n, i < fill ? "#" : ".");
    put(buf, cap, &n, "] ");
    put_pct(buf, cap, &n, f);
    put(buf, cap, &n, " | loss %.3g | τ %.3g | acc %.2f", l->loss, l->tau, l->acc);
    if (l->v2)
        put(buf, cap, &n, " | sel τ %.3g | r@K %.2f", l->sel_tau, l->recall);
    put(buf, cap, &n, " | %s tok/s | wait %.0f%% | eta %s",
        dt_progress_fmt_count(rate, sizeof rate, l->tokens_per_s), 100 * clamp01(l->wait_frac),
        dt_progress_fmt_duration(eta, sizeof eta, l->eta_s));
    return n;
}

size_t dt_progress_fmt_lines(char *buf, size_t cap, const dt_progress_line *l) {
    size_t n = 0;
    char   rate[32], eta[32];
    if (cap)
        buf[0] = '\0';
    put(buf, cap, &n, "step %" PRId64 "/", l->step);
    if (l->total > 0)
        put(buf, cap, &n, "%" PRId64 " (", l->total);
    else
        put(buf, cap, &n, "? (");
    put_pct(buf, cap, &n, done_frac(l));
    put(buf, cap, &n, ")");
    if (l->epoch >= 0)
        put(buf, cap, &n, " epoch %" PRId64, l->epoch);
    put(buf, cap, &n, " loss %.4f tau %.3f acc %.3f", l->loss, l->tau, l->acc);
    if (l->v2)
        put(buf, cap, &n, " sel_tau %.3f recall@K %.3f", l->sel_tau, l->recall);
    if (l->lr >= 0)
        put(buf, cap, &n, " lr %.2e", l->lr);
    put(buf, cap, &n, " %s tok/s wait %.0f%% eta %s",
        dt_progress_fmt_count(rate, sizeof rate, l->tokens_per_s), 100 * clamp01(l->wait_frac),
        dt_progress_fmt_duration(eta, sizeof eta, l->eta_s));
    return n;
}

// ---- state and output

void dt_progress_init(dt_progress *p, const dt_progress_config *cfg) {
    memset(p, 0, sizeof *p);
    p->out = cfg->out;
    p->log_every = cfg->log_every > 0 ? cfg->log_every : 1;
    p->mode = cfg->mode;
    if (p->mode == DT_PROGRESS_AUTO) {
        const char *term = getenv("TERM");
        int         tty = p->out && isatty(fileno(p->out));
        p->mode = tty && !(term && strcmp(term, "dumb") == 0) ? DT_PROGRESS_BAR : DT_PROGRESS_LINES;
    }
    if (!p->out)
        p->mode = DT_PROGRESS_OFF;
}

void dt_progress_window(const dt_progress *p, dt_progress_line *l) {
    double secs = 0, wait = 0, tok = 0;
    for (int i = 0; i < p->n; i++) {
        secs += p->step_s[i];
        wait += p->wait_s[i];
        tok += p->tokens[i];
    }
    l->tokens_per_s = secs > 0 ? tok / secs : NAN;
    l->wait_frac = secs > 0 ? wait / secs : NAN;
    const int64_t left = l->total - l->step;
    l->eta_s = p->n > 0 && l->total > 0 ? (left > 0 ? (double)left * secs / p->n : 0) : NAN;
}

void dt_progress_step(dt_progress *p, dt_progress_line *l, double step_s, double wait_s, double tokens) {
    p->step_s[p->head] = step_s > 0 ? step_s : 0;
    p->wait_s[p->head] = wait_s > 0 ? wait_s : 0;
    p->tokens[p->head] = tokens > 0 ? tokens : 0;
    p->loss[p->head] = l->loss, p->tau[p->head] = l->tau, p->acc[p->head] = l->acc;
    p->sel_tau[p->head] = l->sel_tau, p->recall[p->head] = l->recall;
    p->head = (p->head + 1) % DT_PROGRESS_WINDOW;
    if (p->n < DT_PROGRESS_WINDOW)
        p->n++;
    double loss = 0, tau = 0, acc = 0, stau = 0, rec = 0; /* a NaN step shows as NaN until it leaves the window */
    for (int i = 0; i < p->n; i++)
        loss += p->loss[i], tau += p->tau[i], acc += p->acc[i], stau += p->sel_tau[i], rec += p->recall[i];
    l->loss = loss / p->n, l->tau = tau / p->n, l->acc = acc / p->n;
    l->sel_tau = stau / p->n, l->recall = rec / p->n;
    p->since_draw_s += p->step_s[(p->head + DT_PROGRESS_WINDOW - 1) % DT_PROGRESS_WINDOW];
    dt_progress_window(p, l);
    const int last = l->total > 0 && l->step >= l->total;
    char      buf[512];
    if (p->mode == DT_PROGRESS_LINES) {
        if (l->step % p->log_every != 0 && !last)
            return;
        dt_progress_fmt_lines(buf, sizeof buf, l);
        fprintf(p->out, "%s\n", buf);
        fflush(p->out);
    } else if (p->mode == DT_PROGRESS_BAR) {
        /* a redraw costs a terminal write; 10 a second is smooth enough and cheap for fast steps */
        if (p->drawn && p->since_draw_s < 0.1 && !last)
            return;
        p->since_draw_s = 0;
        dt_progress_fmt_bar(buf, sizeof buf, l);
        /* \033[K clears what a longer previous line left on the right */
        fprintf(p->out, "\r%s\033[K", buf);
        fflush(p->out);
        p->drawn = 1;
    }
}

void dt_progress_break(dt_progress *p) {
    if (p->mode == DT_PROGRESS_BAR && p->drawn) {
        fputc('\n', p->out);
        fflush(p->out);
        p->drawn = 0;
    }
}

void dt_progress_release(dt_progress *p) {
    dt_progress_break(p);
}
