/* common/base/cm_log.c — leveled logging; the initial level comes from TANDEM_LOG when set. */
#include "cm_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int log_level = -1; /* -1: not yet read from the environment */

int cm_log_level_parse(const char *s) {
    static const char *names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; i < 5; i++)
        if (s && strcmp(s, names[i]) == 0) return i;
    return -1;
}

cm_log_level cm_log_get_level(void) {
    if (log_level < 0) {
        int l = cm_log_level_parse(getenv("TANDEM_LOG"));
        log_level = l < 0 ? CM_LOG_LEVEL_INFO : l;
    }
    return (cm_log_level)log_level;
}

void cm_log_set_level(cm_log_level level) { log_level = (int)level; }

void cm_log_write(cm_log_level level, const char *fmt, ...) {
    static const char *tags[] = {"debug", "info", "warn", "error"};
    if (level < cm_log_get_level() || level >= CM_LOG_LEVEL_OFF) return;
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%02d:%02d:%02d.%03ld %-5s %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
            tags[level], msg);
}
