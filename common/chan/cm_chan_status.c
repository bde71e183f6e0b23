/* common/chan/cm_chan_status.c — cm_chan_status_query (cm_chan.h): one STATUS request on a fresh
 * DEALER, outside any session, for `target-server status` and monitoring scripts. */
#include "cm_chan_int.h"

#include <stdlib.h>
#include <string.h>
#include <zmq.h>

cm_status cm_chan_status_query(const char *endpoint, const char *curve_server_key, const char *curve_secret_key,
                               int timeout_ms, char *out, size_t cap) {
    cm_chan_curve_keys keys;
    CM_TRY(cm_chan_curve_client_keys_(&keys, endpoint, curve_server_key, curve_secret_key));
    void *ctx = zmq_ctx_new(), *sock = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    cm_status st = sock ? CM_OK : CM_ZMQ(-1);
    if (st == CM_OK)
        st = cm_chan_set_int(sock, ZMQ_LINGER, 0);
    if (st == CM_OK && cm_chan_endpoint_ipv6_(endpoint))
        st = cm_chan_set_int(sock, ZMQ_IPV6, 1);
    if (st == CM_OK)
        st = cm_chan_set_i64(sock, ZMQ_MAXMSGSIZE, CM_PROTO_HEADER_SIZE + 4 + CM_PROTO_STATUS_MAX);
    if (st == CM_OK)
        st = cm_chan_curve_client_apply_(sock, &keys);
    cm_chan_curve_keys_wipe_(&keys);
    if (st == CM_OK)
        st = CM_ZMQ(zmq_connect(sock, endpoint));
    uint8_t req[CM_PROTO_HEADER_SIZE];
    size_t  len;
    if (st == CM_OK)
        st = cm_proto_status_encode(NULL, 0, req, sizeof req, &len);
    if (st == CM_OK)
        st = CM_ZMQ(zmq_send(sock, req, len, 0));
    int64_t deadline = cm_now_ms() + timeout_ms;
    while (st == CM_OK) {
        int64_t        left = deadline - cm_now_ms();
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        if (left <= 0 || zmq_poll(&it, 1, (long)left) == 0) {
            st = CM_FAIL(CM_ERR_TIMEOUT, "no status from %s within %d ms (is a target-server running there%s?)",
                         endpoint, timeout_ms,
                         curve_server_key ? ", and does it accept this client's key (--curve-secret-key)" : "");
            break;
        }
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, 0) < 0) {
            zmq_msg_close(&m);
            continue; /* EINTR */
        }
        cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
        cm_proto_header h;
        size_t          n = 0;
        const uint8_t  *p = zmq_msg_data(&m);
        size_t          sz = zmq_msg_size(&m);
        if (cm_proto_peek(p, sz, &lim, &h) != CM_OK) {
            st = CM_FAIL(CM_ERR_PROTOCOL, "the reply from %s is not a tandem frame: %s", endpoint, cm_last_error());
        } else if (h.type == CM_PROTO_TYPE_ERROR) {
            cm_proto_error e;
            st = cm_proto_error_decode(p, sz, &lim, &e) == CM_OK
                     ? CM_FAIL(CM_ERR_PROTOCOL, "target-server at %s: %s", endpoint, e.message)
                     : CM_FAIL(CM_ERR_PROTOCOL, "a malformed ERROR from %s", endpoint);
        } else if (h.type != CM_PROTO_TYPE_STATUS) {
            zmq_msg_close(&m); /* a heartbeat or the like: not ours */
            continue;
        } else {
            st = cm_proto_status_decode(p, sz, &lim, out, cap, &n);
            if (st == CM_OK && n == 0)
                st = CM_FAIL(CM_ERR_PROTOCOL, "an empty STATUS reply from %s", endpoint);
        }
        zmq_msg_close(&m);
        break;
    }
    if (sock)
        zmq_close(sock);
    if (ctx)
        zmq_ctx_term(ctx);
    return st;
}
