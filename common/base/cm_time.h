/* common/base/cm_time.h — the monotonic clock (CLOCK_MONOTONIC: not moved by changes of the wall
 * clock), for timeouts, deadlines and durations. Header only. */
#ifndef CM_TIME_H
#define CM_TIME_H

#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Seconds, with nanosecond resolution. */
static inline double cm_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whole milliseconds. */
static inline int64_t cm_now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

#ifdef __cplusplus
}
#endif
#endif /* CM_TIME_H */
