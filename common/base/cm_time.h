/* common/base/cm_time.h — the monotonic clock in seconds, for durations and deadlines
 * (never for wall time: it starts at an arbitrary point and only moves forward). */
#ifndef CM_TIME_H
#define CM_TIME_H

#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

static inline double cm_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#ifdef __cplusplus
}
#endif
#endif /* CM_TIME_H */
