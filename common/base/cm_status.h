/* common/base/cm_status.h — status codes, the thread-local last error, and the check macros.
 * Every fallible function returns cm_status and puts results in out-params; only main()
 * and tests turn a status into an exit code. cm_last_error() is thread-local: the failing
 * statement, file:line and the library's or validator's message. */
#ifndef CM_STATUS_H
#define CM_STATUS_H

#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cm_status {
    CM_OK = 0,
    CM_ERR_INVALID_ARG, /* bad flag, bad value, inconsistent shapes */
    CM_ERR_NOMEM,
    CM_ERR_IO,          /* open/read/write/mmap failed, file missing or truncated */
    CM_ERR_FORMAT,      /* a file's bytes are malformed (header, offsets, dtype, shape) */
    CM_ERR_PROTOCOL,    /* a peer's bytes are malformed */
    CM_ERR_UNSUPPORTED, /* valid input that this build cannot handle (model_type, dtype, no CUDA) */
    CM_ERR_TIMEOUT,
    CM_ERR_PEER_GONE,
    CM_ERR_ZMQ,
    CM_ERR_ZSTD,
    CM_ERR_CUDA,
    CM_ERR_CUBLAS,
    CM_ERR_NCCL,
    CM_STATUS_COUNT
} cm_status;

const char *cm_status_str(cm_status st);

/* The message of the last failure on this thread ("" if none). */
const char *cm_last_error(void);
void        cm_clear_error(void);

/* Records a formatted message as the last error (file:line prefixed) and returns st, so
 * validators can write `return CM_FAIL(CM_ERR_FORMAT, "bad dtype '%s' for '%s'", ...)`. */
cm_status cm_fail_at(cm_status st, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
#define CM_FAIL(st, ...) cm_fail_at((st), __FILE__, __LINE__, __VA_ARGS__)

#define CM_TRY(call)                                                                                         \
    do {                                                                                                     \
        cm_status st_ = (call);                                                                              \
        if (st_ != CM_OK) return st_;                                                                        \
    } while (0)
#define CM_TRY_GOTO(call, st, label)                                                                         \
    do {                                                                                                     \
        (st) = (call);                                                                                       \
        if ((st) != CM_OK) goto label;                                                                       \
    } while (0)

/* Programmer errors only: never on bytes from a file or a peer. Always on. */
#define CM_ASSERT(cond)                                                                                      \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #cond);                     \
            abort();                                                                                         \
        }                                                                                                    \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif /* CM_STATUS_H */
