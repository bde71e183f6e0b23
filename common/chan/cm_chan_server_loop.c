/* common/chan/cm_chan_server_loop.c — the target-server's session loop (see cm_chan.h). The loop
 * thread owns the ROUTER (and the ZAP socket when client keys are configured): it reads every
 * message and hands each frame to what handles it (sessions and their REQUESTs:
 * cm_chan_server_session.c; STATUS: _status.c; ZAP: _zap.c; refusals: _send.c), ends the
 * sessions silent past the peer timeout, sends heartbeats, and after each turn sends the
 * workers' results and hands them new tasks (cm_chan_server_sched.c). Nothing from a peer is
 * trusted: sizes are bounded by ZMQ_MAXMSGSIZE and cm_proto_limits before use. */
#include "cm_chan_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_log.h"

/* Reads one message from the ROUTER; 0 when none was waiting. */
static int handle_msg(cm_chan_server *s) {
    zmq_msg_t fr;
    uint8_t   ident[IDENT_MAX];
    size_t    ident_len;
    int       parts;
    if (!cm_chan_recv_msg_(s->router, &fr, ident, &ident_len, &parts))
        return 0;
    session       *ss = ident_len ? cm_chan_find_session_(s, ident, ident_len) : NULL;
    const uint8_t *p = zmq_msg_data(&fr);
    size_t         len = zmq_msg_size(&fr);
    if (ss)
        ss->last_recv = cm_now_ms();
    cm_proto_header h;
    if (!ident_len) {
        /* nothing to answer to */
    } else if (parts != 1) {
        char why[96];
        snprintf(why, sizeof why, "a message of %d parts; a trainer sends one frame per message", parts);
        cm_chan_refuse_frame_(s, ss, ident, ident_len, p, parts ? len : 0, why);
    } else if (cm_proto_peek(p, len, &s->lim, &h) != CM_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", cm_last_error());
        cm_chan_refuse_frame_(s, ss, ident, ident_len, p, len, why);
    } else if (h.type == CM_PROTO_TYPE_HELLO) {
        cm_chan_on_hello_(s, ss, ident, ident_len, &fr);
    } else if (h.type == CM_PROTO_TYPE_STATUS) {
        cm_chan_status_reply_(s, ident, ident_len, p, len);
    } else if (!ss) {
        /* no session (the server restarted, or the session timed out): BYE makes the trainer
         * say HELLO again and re-send what it waits for */
        if (h.type != CM_PROTO_TYPE_BYE)
            cm_chan_send_bye_(s, ident, ident_len);
    } else if (h.type == CM_PROTO_TYPE_REQUEST) {
        cm_chan_on_request_(s, ss, &h, p, len);
    } else if (h.type == CM_PROTO_TYPE_NCCL_OFFER) {
        cm_chan_on_nccl_offer_(s, ss, &fr);
    } else if (h.type == CM_PROTO_TYPE_HEARTBEAT) {
        uint64_t seq;
        if (cm_proto_heartbeat_decode(p, len, &s->lim, &seq) != CM_OK)
            cm_chan_refuse_frame_(s, ss, ident, ident_len, p, len, cm_last_error());
    } else if (h.type == CM_PROTO_TYPE_BYE) {
        if (cm_proto_bye_decode(p, len, &s->lim) != CM_OK)
            cm_chan_refuse_frame_(s, ss, ident, ident_len, p, len, cm_last_error());
        else
            cm_chan_end_session_(s, ss, END_BYE);
    } else if (h.type == CM_PROTO_TYPE_ERROR) {
        cm_proto_error e;
        if (cm_proto_error_decode(p, len, &s->lim, &e) == CM_OK)
            CM_LOG_WARN("session '%s' reports %s for batch %llu: %s", ss->name, cm_proto_error_name(e.code),
                        (unsigned long long)e.batch_id, e.message);
        else
            cm_chan_refuse_frame_(s, ss, ident, ident_len, p, len, cm_last_error());
    } else {
        char why[96];
        snprintf(why, sizeof why, "a %s frame; trainers send HELLO, REQUEST, NCCL_OFFER, HEARTBEAT, BYE",
                 cm_proto_type_name(h.type));
        cm_chan_refuse_frame_(s, ss, ident, ident_len, p, len, why);
    }
    zmq_msg_close(&fr);
    return 1;
}

static void timers(cm_chan_server *s, int64_t now) {
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        session *ss = &s->sessions[i];
        if (!ss->used)
            continue;
        if (now - ss->last_recv > s->cfg.peer_timeout_ms) {
            cm_chan_end_session_(s, ss, END_TIMEOUT);
            continue;
        }
        if (now - ss->last_send >= s->cfg.heartbeat_ms) {
            uint8_t buf[CM_PROTO_HEADER_SIZE];
            size_t  len;
            cm_proto_heartbeat_encode(++s->hb_seq, buf, sizeof buf, &len);
            cm_status st = cm_chan_send_to_(s, ss->ident, ss->ident_len, buf, len);
            ss->last_send = now;
            if (st == CM_ERR_PEER_GONE) {
                cm_chan_end_session_(s, ss, END_UNREACHABLE);
                continue;
            }
        }
        if (s->cfg.stats_interval_ms > 0 && now - ss->last_stats >= s->cfg.stats_interval_ms) {
            ss->last_stats = now;
            cm_chan_log_session_(ss, "running", now);
        }
    }
}

cm_status cm_chan_server_run(cm_chan_server *s) {
    if (s->ran)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server_run: a server runs once");
    s->ran = 1;
    s->started_ms = cm_now_ms();
    CM_LOG_INFO(
        "serving '%s' on %s: weights %016llx (config %016llx), %u layers of %u, %s answers, %u credits "
        "per session",
        s->name, s->endpoint, (unsigned long long)s->cfg.weights_id, (unsigned long long)s->cfg.target_id,
        s->cfg.n_layers, s->cfg.hidden_size, cm_dtype_name(s->cfg.hidden_dtype), s->cfg.credits);
    cm_status st = cm_chan_server_start_(s);
    if (st == CM_OK)
        cm_chan_calls_open_(s);
    while (st == CM_OK) {
        if (atomic_load(&s->stop) && !s->stopping) {
            s->stopping = 1;
            CM_LOG_INFO("stopping: %s",
                        s->n_busy ? "finishing the forwards in progress" : "no forward in progress");
            for (uint32_t i = 0; i < s->cfg.max_sessions; i++)
                if (s->sessions[i].used)
                    cm_chan_drop_queue_(s, &s->sessions[i]);
            cm_chan_calls_close_(s, "the server is stopping", 0);
        }
        if (s->stopping && !s->n_busy)
            break;
        for (int i = 0; i < s->n_workers && st == CM_OK; i++) {
            work *w = &s->workers[i].w;
            pthread_mutex_lock(&w->mu);
            if (w->init_done && w->init_status != CM_OK)
                st = s->n_workers > 1 ? CM_FAIL(w->init_status, "worker %d: %s", i, w->init_msg)
                                      : CM_FAIL(w->init_status, "%s", w->init_msg);
            pthread_mutex_unlock(&w->mu);
        }
        if (st != CM_OK)
            break;
        zmq_pollitem_t items[3] = {{s->router, 0, ZMQ_POLLIN, 0},
                                   {NULL, s->pipe_r, ZMQ_POLLIN, 0},
                                   {s->zap.sock, 0, ZMQ_POLLIN, 0}};
        int            n_items = s->zap.sock ? 3 : 2;
        long timeout = 100; /* the stop flag is looked at this often */
        if (zmq_poll(items, n_items, timeout) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            st = CM_ZMQ(-1);
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            char drain[64];
            while (read(s->pipe_r, drain, sizeof drain) > 0) {
            }
            cm_chan_handle_done_(s);
        }
        if (s->zap.sock && (items[2].revents & ZMQ_POLLIN))
            cm_chan_zap_handle_(&s->zap, &s->warn);
        for (int k = 0; k < RECV_BURST && handle_msg(s); k++) {
        }
        timers(s, cm_now_ms());
        cm_chan_schedule_(s);
    }
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        session *ss = &s->sessions[i];
        if (!ss->used)
            continue;
        cm_chan_send_bye_(s, ss->ident, ss->ident_len);
        cm_chan_end_session_(s, ss, END_STOP);
    }
    cm_chan_calls_close_(s, "the server is stopping", 0);
    cm_chan_server_join_(s);
    if (s->n_busy) /* only after a failure: the last results are not sent */
        cm_chan_handle_done_(s);
    cm_chan_calls_close_(s, st == CM_OK ? "the server stopped" : "the server failed", 1);
    CM_LOG_INFO("stopped serving '%s' on %s", s->name, s->endpoint);
    return st;
}
