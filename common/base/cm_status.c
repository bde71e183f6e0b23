/* common/base/cm_status.c — status strings and the thread-local last-error buffer. */
#include "cm_status.h"

#include <stdarg.h>
#include <string.h>

static _Thread_local char last_error[1024];

const char *cm_status_str(cm_status st) {
    switch (st) {
    case CM_OK:              return "ok";
    case CM_ERR_INVALID_ARG: return "invalid argument";
    case CM_ERR_NOMEM:       return "out of memory";
    case CM_ERR_IO:          return "i/o error";
    case CM_ERR_FORMAT:      return "malformed file";
    case CM_ERR_PROTOCOL:    return "protocol error";
    case CM_ERR_UNSUPPORTED: return "unsupported";
    case CM_ERR_TIMEOUT:     return "timed out";
    case CM_ERR_PEER_GONE:   return "peer gone";
    case CM_ERR_ZMQ:         return "zeromq error";
    case CM_ERR_ZSTD:        return "zstd error";
    case CM_ERR_CUDA:        return "cuda error";
    case CM_ERR_CUBLAS:      return "cublas error";
    case CM_ERR_NCCL:        return "nccl error";
    case CM_STATUS_COUNT:    break;
    }
    return "unknown status";
}

const char *cm_last_error(void) { return last_error; }

void cm_clear_error(void) { last_error[0] = '\0'; }

cm_status cm_fail_at(cm_status st, const char *file, int line, const char *fmt, ...) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    va_list ap;
    va_start(ap, fmt);
    char msg[sizeof last_error - 64];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(last_error, sizeof last_error, "%s (%s:%d)", msg, base, line);
    return st;
}
