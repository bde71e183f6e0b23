/* common/chan/cm_chan_server_send.c — what the server's loop thread sends outside an answer: one-part
 * frames to a routing identity (send_to maps an unreachable peer and a full queue to their own
 * statuses), ERRORs, BYE, the refusal of a frame that failed cm_proto_peek, and the rate limit
 * of the warnings about refused frames (also cm_dec_server's). Loop thread only. */
#include "cm_chan_int.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "cm_log.h"

int cm_chan_warn_ok_(cm_chan_warn *w) {
    int64_t now = cm_now_ms();
    if (now - w->window > 10000) {
        if (w->suppressed)
            CM_LOG_WARN("%d more refused frames in the last 10 s (not logged)", w->suppressed);
        w->window = now;
        w->count = 0;
        w->suppressed = 0;
    }
    if (w->count++ < WARN_BURST)
        return 1;
    w->suppressed++;
    return 0;
}

static const char *sess_label(const session *ss) {
    return ss ? ss->name : "(no session)";
}

/* Sends identity + one part. CM_ERR_PEER_GONE when the peer is not connected, CM_ERR_TIMEOUT
 * when its queue is full (the frame is dropped), CM_ERR_ZMQ otherwise. */
cm_status cm_chan_send_to_(cm_chan_server *s, const uint8_t *ident, size_t ident_len, const void *frame,
                           size_t len) {
    if (zmq_send(s->router, ident, ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        if (zmq_errno() == EHOSTUNREACH)
            return CM_FAIL(CM_ERR_PEER_GONE, "the trainer is no longer connected");
        if (zmq_errno() == EAGAIN)
            return CM_FAIL(CM_ERR_TIMEOUT, "the trainer's queue is full; frame dropped");
        return CM_ZMQ(-1);
    }
    return CM_ZMQ(zmq_send(s->router, frame, len, ZMQ_DONTWAIT));
}

cm_status cm_chan_send_error_(cm_chan_server *s, const uint8_t *ident, size_t ident_len, uint64_t id,
                              cm_proto_error_code code, const char *fmt, ...) {
    uint8_t buf[CM_PROTO_SMALL_FRAME_MAX];
    size_t  len;
    va_list ap;
    va_start(ap, fmt);
    cm_status st = cm_chan_error_frame_(buf, sizeof buf, &len, id, code, fmt, ap);
    va_end(ap);
    CM_TRY(st);
    STAT_ADD(s, errors_sent, 1);
    return cm_chan_send_to_(s, ident, ident_len, buf, len);
}

cm_status cm_chan_send_bye_(cm_chan_server *s, const uint8_t *ident, size_t ident_len) {
    uint8_t buf[CM_PROTO_HEADER_SIZE];
    size_t  len;
    CM_TRY(cm_proto_bye_encode(buf, sizeof buf, &len));
    return cm_chan_send_to_(s, ident, ident_len, buf, len);
}

/* Refuses a frame that failed cm_proto_peek: ERROR version when only the version differs,
 * else ERROR corrupt with the id the bytes claim (the trainer re-sends that batch if it waits
 * for it; requests are idempotent, so a wrong guess costs one forward). */
void cm_chan_refuse_frame_(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len,
                           const uint8_t *p, size_t len, const char *why) {
    STAT_ADD(s, bad_frames, 1);
    if (cm_chan_warn_ok_(&s->warn))
        CM_LOG_WARN("refused a frame from %s (%zu bytes): %s", sess_label(ss), len, why);
    uint64_t id;
    uint16_t version;
    if (cm_proto_frame_claims(p, len, &id, &version))
        cm_chan_send_error_(
            s, ident, ident_len, 0, CM_PROTO_ERROR_VERSION,
            "this target-server speaks protocol version %d, the frame has version %u: run matching builds",
            CM_PROTO_VERSION, (unsigned)version);
    else
        cm_chan_send_error_(s, ident, ident_len, id, CM_PROTO_ERROR_CORRUPT, "frame refused: %s", why);
}
