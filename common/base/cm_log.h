/* common/base/cm_log.h — leveled logging to stderr, one line per call, with a timestamp.
 * The level is process-wide (set once at start-up from --log-level or TANDEM_LOG); calls
 * are thread-safe (one fprintf per line). Messages are lower-case, no trailing period. */
#ifndef CM_LOG_H
#define CM_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cm_log_level {
    CM_LOG_LEVEL_DEBUG = 0,
    CM_LOG_LEVEL_INFO,
    CM_LOG_LEVEL_WARN,
    CM_LOG_LEVEL_ERROR,
    CM_LOG_LEVEL_OFF,
} cm_log_level;

void         cm_log_set_level(cm_log_level level);
cm_log_level cm_log_get_level(void);
/* Parses "debug", "info", "warn", "error", "off"; returns -1 for anything else. */
int  cm_log_level_parse(const char *s);
void cm_log_write(cm_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#define CM_LOG_DEBUG(...) cm_log_write(CM_LOG_LEVEL_DEBUG, __VA_ARGS__)
#define CM_LOG_INFO(...)  cm_log_write(CM_LOG_LEVEL_INFO, __VA_ARGS__)
#define CM_LOG_WARN(...)  cm_log_write(CM_LOG_LEVEL_WARN, __VA_ARGS__)
#define CM_LOG_ERROR(...) cm_log_write(CM_LOG_LEVEL_ERROR, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif /* CM_LOG_H */
