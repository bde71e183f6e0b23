/* common/cm_chan_int.h — what the two halves of cm_chan (cm_chan_server.c, cm_chan_client.c)
 * share and nobody else needs: the CM_ZMQ conversion of ZeroMQ failures, the monotonic clock,
 * socket option setters and the CURVE key helpers. Internal to common/; not installed. */
#ifndef CM_CHAN_INT_H
#define CM_CHAN_INT_H

#include <stddef.h>
#include <stdint.h>

#include "cm_chan.h"

/* Converts a ZeroMQ return value once, where the call is made: -1 → CM_ERR_ZMQ with the
 * statement, file:line and zmq_strerror(zmq_errno()) in cm_last_error(); else CM_OK. */
#define CM_ZMQ(x) cm_zmq_check_((x) == -1, #x, __FILE__, __LINE__)
cm_status cm_zmq_check_(int failed, const char *stmt, const char *file, int line);

int64_t   cm_chan_now_ms(void);                               /* CLOCK_MONOTONIC */
cm_status cm_chan_set_int(void *sock, int option, int value); /* zmq_setsockopt of an int */
cm_status cm_chan_set_i64(void *sock, int option, int64_t value);

/* Fails with CM_ERR_UNSUPPORTED and the fix when libzmq lacks CURVE. */
cm_status cm_chan_curve_require(const char *what);

/* A random 64-bit value (getrandom, falling back to the clock and the pid). */
uint64_t cm_chan_random_u64(void);

/* snprintf that may cut its output on purpose (messages bounded by the wire or a struct). */
void cm_chan_fmt(char *dst, size_t cap, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Copies a message into an ERROR's message field: control bytes become spaces, cut at
 * CM_PROTO_MESSAGE_MAX bytes. */
void cm_chan_error_text(char *dst, const char *src);

#endif /* CM_CHAN_INT_H */
