/* common/chan/cm_chan_client_io.c — the trainer's I/O thread (see cm_chan_client.c for the owner
 * side). It owns the DEALER: says HELLO, sends queued requests within the granted credits,
 * heartbeats, re-sends a request whose answer is late, corrupt or refused as malformed,
 * re-creates the socket and re-sends everything in flight when the session is lost (silence,
 * BYE, disconnect). This file holds the slots' transitions, the socket, the dispatch of what
 * arrives (the session's setup is cm_chan_client_session.c, answers and errors
 * cm_chan_client_answer.c) and the timers. An answer is accepted only for a SENT slot with its
 * id, so a batch is never delivered twice. */
#include "cm_chan_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_bytes.h"
#include "cm_compress.h"
#include "cm_log.h"

// ----------------------------------------------------------------------------
// helpers (I/O thread unless noted)

void cm_chan_client_problem_(cm_chan_client *c, const char *fmt, ...) {
    char    text[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&c->mu);
    memcpy(c->stats.last_problem, text, sizeof text);
    pthread_mutex_unlock(&c->mu);
}

static void close_socket(cm_chan_client *c, int linger_ms);

/* Ends this session's NCCL communicator (aborting transfers in flight); the next session
 * negotiates a new one. */
static void nccl_leave(cm_chan_client *c) {
    if (c->nccl_joined) {
        c->cfg.nccl->leave(c->cfg.nccl->user);
        c->nccl_joined = 0;
    }
}

void cm_chan_client_fatal_(cm_chan_client *c, cm_status st, const char *msg) {
    CM_LOG_ERROR("client '%s': %s", c->name, msg);
    pthread_mutex_lock(&c->mu);
    if (c->fatal == CM_OK) {
        c->fatal = st;
        snprintf(c->fatal_msg, sizeof c->fatal_msg, "%s", msg);
    }
    c->session_up = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    c->conn = CONN_DEAD;
    close_socket(c, 0);
    nccl_leave(c);
}

slot *cm_chan_client_find_sent_(cm_chan_client *c, uint64_t id) {
    slot *found = NULL;
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < c->n_slots && !found; i++)
        if (c->slots[i].state == SLOT_SENT && c->slots[i].batch_id == id)
            found = &c->slots[i];
    pthread_mutex_unlock(&c->mu);
    return found; /* SENT slots change state only on this thread */
}

int cm_chan_client_slot_state_(cm_chan_client *c, const slot *s) {
    pthread_mutex_lock(&c->mu);
    int st = s->state;
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* Moves a SENT or QUEUED slot to READY (with data, or failed) and wakes the owner. */
void cm_chan_client_complete_(cm_chan_client *c, slot *s, cm_status st, const char *msg, uint64_t bytes) {
    s->ans.batch_id = s->batch_id;
    s->ans.status = st;
    if (st != CM_OK) {
        snprintf(s->message, sizeof s->message, "%s", msg);
        s->ans.n_tensors = 0;
    } else {
        s->message[0] = '\0';
        s->ans.n_tensors = s->n_layers;
    }
    s->ans.message = s->message;
    s->ans.tensors = s->tensors;
    pthread_mutex_lock(&c->mu);
    if (s->state == SLOT_SENT && c->in_flight)
        c->in_flight--;
    s->state = SLOT_READY;
    c->ready[(c->ready_head + c->ready_len) % c->n_slots] = (uint32_t)(s - c->slots);
    c->ready_len++;
    if (st == CM_OK) {
        c->stats.answers++;
        c->stats.bytes_received += bytes;
    } else {
        c->stats.failed++;
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void cm_chan_client_send_(cm_chan_client *c, const void *buf, size_t len, int64_t now) {
    if (c->sock && zmq_send(c->sock, buf, len, ZMQ_DONTWAIT) >= 0)
        c->last_send = now;
}

static void send_request(cm_chan_client *c, slot *s, int64_t now) {
    size_t need = cm_proto_request_size(s->n_tokens, s->n_seqs, s->n_layers);
    if (need > s->frame_cap) {
        uint8_t *f = realloc(s->frame, need);
        if (!f) {
            cm_chan_client_complete_(c, s, CM_ERR_NOMEM, "cannot allocate the request frame", 0);
            return;
        }
        s->frame = f;
        s->frame_cap = need;
    }
    cm_proto_request rq = {.batch_id = s->batch_id,
                           .flags = s->ever_sent ? CM_PROTO_FLAG_RESEND : 0,
                           .encoding = c->enc,
                           .n_tokens = s->n_tokens,
                           .n_seqs = s->n_seqs,
                           .n_layers = s->n_layers,
                           .tokens = s->tokens,
                           .cu_seqlens = s->cu,
                           .layer_ids = s->layers};
    size_t           len;
    if (cm_proto_request_encode(&rq, s->frame, s->frame_cap, &len) != CM_OK) {
        cm_chan_client_complete_(c, s, CM_ERR_INVALID_ARG, cm_last_error(), 0);
        return;
    }
    if (zmq_send(c->sock, s->frame, len, ZMQ_DONTWAIT) < 0)
        return; /* queue full: stays QUEUED, tried again */
    c->last_send = now;
    pthread_mutex_lock(&c->mu);
    if (s->state == SLOT_QUEUED)
        c->in_flight++;
    s->state = SLOT_SENT;
    c->stats.sends++;
    if (s->ever_sent)
        c->stats.resends++;
    pthread_mutex_unlock(&c->mu);
    s->ever_sent = 1;
    s->sent_at = now;
    s->resend_at = 0;
}

/* A corrupt or failed answer for s: send again, or give the batch up after max_attempts. */
void cm_chan_client_retry_(cm_chan_client *c, slot *s, cm_status give_up, const char *why, int64_t now,
                           int delay_ms) {
    if (++s->attempts >= c->cfg.max_attempts) {
        char msg[CM_PROTO_MESSAGE_MAX + 96];
        cm_chan_fmt(
            msg, sizeof msg,
            "request %llu given up after %d failed answers (the server keeps sending what the trainer "
            "refuses: check the server's log and model); last: %s",
            (unsigned long long)s->batch_id, s->attempts, why);
        cm_chan_client_complete_(c, s, give_up, msg, 0);
        return;
    }
    if (delay_ms > 0)
        s->resend_at = now + delay_ms;
    else if (c->conn == CONN_READY)
        send_request(c, s, now);
}

/* A frame from the server was refused: report it, and re-request the batch it names if that
 * batch is in flight (the id may be untrusted; a wrong guess costs one idempotent request). */
void cm_chan_client_protocol_error_(cm_chan_client *c, const char *why, uint64_t id, int is_answer,
                                    int64_t now) {
    slot *s = id ? cm_chan_client_find_sent_(c, id) : NULL;
    pthread_mutex_lock(&c->mu);
    c->stats.protocol_errors++;
    if (is_answer)
        c->stats.corrupt_answers++;
    snprintf(c->stats.last_problem, sizeof c->stats.last_problem, "%s", why);
    pthread_mutex_unlock(&c->mu);
    CM_LOG_WARN("client '%s': %s: refused a frame from the server: %s%s", c->name,
                cm_status_str(CM_ERR_PROTOCOL), why, s ? "; re-requesting the batch" : "");
    if (is_answer && c->nccl_joined) {
        /* the NCCL transfers that followed this ANSWER cannot be paired any more: a new session
         * (and communicator) re-sends everything in flight */
        if (s && ++s->attempts >= c->cfg.max_attempts) {
            char msg[CM_PROTO_MESSAGE_MAX + 96];
            cm_chan_fmt(msg, sizeof msg, "request %llu given up after %d refused answers; last: %s",
                        (unsigned long long)s->batch_id, s->attempts, why);
            cm_chan_client_complete_(c, s, CM_ERR_PROTOCOL, msg, 0);
        }
        cm_chan_client_lose_session_(c, "an NCCL answer was refused", now);
        return;
    }
    if (s)
        cm_chan_client_retry_(c, s, CM_ERR_PROTOCOL, why, now, 0);
}

// ----------------------------------------------------------------------------
// socket lifecycle

static void close_socket(cm_chan_client *c, int linger_ms) {
    if (c->sock) {
        /* stop the monitor while its reader is open: libzmq sends monitor events blocking, so an
         * event for a reader already closed would hang the context's I/O thread for good */
        zmq_socket_monitor(c->sock, NULL, 0);
        cm_chan_set_int(c->sock, ZMQ_LINGER, linger_ms);
        zmq_close(c->sock);
        c->sock = NULL;
    }
    if (c->mon) {
        zmq_close(c->mon);
        c->mon = NULL;
    }
}

static cm_status open_socket(cm_chan_client *c, int64_t now) {
    close_socket(c, 0);
    if (!(c->sock = zmq_socket(c->ctx, ZMQ_DEALER)))
        return CM_ZMQ(-1);
    CM_TRY(CM_ZMQ(zmq_setsockopt(c->sock, ZMQ_ROUTING_ID, c->ident, strlen(c->ident))));
    CM_TRY(cm_chan_set_int(c->sock, ZMQ_LINGER, 0));
    if (cm_chan_endpoint_ipv6_(c->endpoint))
        CM_TRY(cm_chan_set_int(c->sock, ZMQ_IPV6, 1));
    CM_TRY(cm_chan_set_i64(c->sock, ZMQ_MAXMSGSIZE, (int64_t)c->cfg.max_answer_bytes + (1 << 20)));
    if (c->curve) {
        CM_TRY(CM_ZMQ(zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, c->server_key, CM_CHAN_KEY_LEN + 1)));
        CM_TRY(CM_ZMQ(zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, c->public_key, CM_CHAN_KEY_LEN + 1)));
        CM_TRY(CM_ZMQ(zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, c->secret_key, CM_CHAN_KEY_LEN + 1)));
    }
    char mon_ep[96];
    snprintf(mon_ep, sizeof mon_ep, "inproc://cm-chan-mon-%p-%u", (void *)c, ++c->mon_n);
    CM_TRY(CM_ZMQ(zmq_socket_monitor(
        c->sock, mon_ep,
        ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
            ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)));
    if (!(c->mon = zmq_socket(c->ctx, ZMQ_PAIR)))
        return CM_ZMQ(-1);
    CM_TRY(CM_ZMQ(zmq_connect(c->mon, mon_ep)));
    CM_TRY(CM_ZMQ(zmq_connect(c->sock, c->endpoint)));
    cm_proto_hello h = {.target_id = c->cfg.target_id,
                        .weights_id = c->cfg.weights_id,
                        .credits = c->cfg.credits,
                        .encodings = (1u << c->cfg.encoding) | c->cfg.accept};
    snprintf(h.name, sizeof h.name, "%s", c->name);
    uint8_t buf[CM_PROTO_SMALL_FRAME_MAX];
    size_t  len;
    CM_TRY(cm_proto_hello_encode(&h, buf, sizeof buf, &len));
    cm_chan_client_send_(c, buf, len, now);
    c->conn = CONN_HELLO;
    c->hello_at = now;
    c->last_recv = now;
    c->handshake_ok = 0;
    return CM_OK;
}

/* The session is gone: everything in flight is queued again and re-sent after the next
 * WELCOME; the socket is re-created after a backoff. */
void cm_chan_client_lose_session_(cm_chan_client *c, const char *why, int64_t now) {
    if (c->conn == CONN_DEAD)
        return;
    int was_ready = c->conn == CONN_READY;
    close_socket(c, 0);
    nccl_leave(c);
    pthread_mutex_lock(&c->mu);
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].state == SLOT_SENT) {
            c->slots[i].state = SLOT_QUEUED;
            n++;
        }
    c->session_up = 0;
    snprintf(c->stats.last_problem, sizeof c->stats.last_problem, "%s", why);
    pthread_mutex_unlock(&c->mu);
    if (was_ready)
        CM_LOG_WARN("client '%s': lost the session with %s: %s; reconnecting (%u requests to re-send)",
                    c->name, c->endpoint, why, n);
    else
        CM_LOG_DEBUG("client '%s': no session with %s yet: %s", c->name, c->endpoint, why);
    c->in_flight = 0;
    c->conn = CONN_WAIT;
    c->reconnect_at = now + c->backoff_ms;
    c->backoff_ms = c->backoff_ms * 2 < 2000 ? c->backoff_ms * 2 : 2000;
}

/* Reads one message; 0 when none was waiting. */
static int handle_msg(cm_chan_client *c, int64_t now) {
    zmq_msg_t m[2];
    zmq_msg_init(&m[0]);
    zmq_msg_init(&m[1]);
    if (!c->sock || zmq_msg_recv(&m[0], c->sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m[0]);
        zmq_msg_close(&m[1]);
        return 0;
    }
    int parts = 1, more = zmq_msg_more(&m[0]);
    if (more && zmq_msg_recv(&m[1], c->sock, 0) >= 0) {
        parts = 2;
        more = zmq_msg_more(&m[1]);
    }
    while (more) {
        zmq_msg_t x;
        zmq_msg_init(&x);
        more = zmq_msg_recv(&x, c->sock, 0) >= 0 && zmq_msg_more(&x);
        zmq_msg_close(&x);
        parts++;
    }
    c->last_recv = now;
    const uint8_t  *p = zmq_msg_data(&m[0]);
    size_t          n = zmq_msg_size(&m[0]);
    cm_proto_header h;
    if (cm_proto_peek(p, n, &c->lim, &h) != CM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", cm_last_error());
        if (c->conn == CONN_HELLO && n >= 6 && cm_le_get_u32(p) == CM_PROTO_MAGIC &&
            cm_le_get_u16(p + 4) != CM_PROTO_VERSION) {
            char msg[600];
            cm_chan_fmt(msg, sizeof msg,
                        "the server at %s speaks protocol version %u, this client %d: run matching "
                        "target-server and drafter-trainer builds",
                        c->endpoint, (unsigned)cm_le_get_u16(p + 4), CM_PROTO_VERSION);
            cm_chan_client_fatal_(c, CM_ERR_PROTOCOL, msg);
        } else {
            uint64_t id;
            uint16_t version;
            cm_proto_frame_claims(p, n, &id, &version);
            cm_chan_client_protocol_error_(c, why, id, parts == 2, now);
        }
    } else if (parts != (h.type == CM_PROTO_TYPE_ANSWER ? 2 : 1)) {
        char why[160];
        snprintf(why, sizeof why, "a %s frame in %d message parts (expected %d)", cm_proto_type_name(h.type),
                 parts, h.type == CM_PROTO_TYPE_ANSWER ? 2 : 1);
        cm_chan_client_protocol_error_(c, why, h.id, h.type == CM_PROTO_TYPE_ANSWER, now);
    } else if (h.type == CM_PROTO_TYPE_WELCOME) {
        cm_chan_client_on_welcome_(c, p, n, now);
    } else if (h.type == CM_PROTO_TYPE_NCCL_READY && c->conn == CONN_NCCL) {
        cm_chan_client_on_nccl_ready_(c, p, n, now);
    } else if (c->conn != CONN_READY) {
        if (h.type == CM_PROTO_TYPE_ERROR)
            cm_chan_client_on_error_(c, p, n, now);
        /* anything else before WELCOME belongs to no session */
    } else if (h.type == CM_PROTO_TYPE_ANSWER) {
        cm_chan_client_on_answer_(c, &m[0], &m[1], h.id, now);
    } else if (h.type == CM_PROTO_TYPE_ERROR) {
        cm_chan_client_on_error_(c, p, n, now);
    } else if (h.type == CM_PROTO_TYPE_HEARTBEAT) {
        uint64_t seq;
        if (cm_proto_heartbeat_decode(p, n, &c->lim, &seq) != CM_OK)
            cm_chan_client_protocol_error_(c, cm_last_error(), 0, 0, now);
    } else if (h.type == CM_PROTO_TYPE_BYE) {
        if (cm_proto_bye_decode(p, n, &c->lim) != CM_OK)
            cm_chan_client_protocol_error_(c, cm_last_error(), 0, 0, now);
        else
            cm_chan_client_lose_session_(c, "the server ended the session (BYE)", now);
    } else {
        char why[96];
        snprintf(why, sizeof why, "unexpected %s frame from the server", cm_proto_type_name(h.type));
        cm_chan_client_protocol_error_(c, why, 0, 0, now);
    }
    zmq_msg_close(&m[0]);
    zmq_msg_close(&m[1]);
    return 1;
}

static void handle_monitor(cm_chan_client *c, int64_t now) {
    for (;;) {
        zmq_msg_t ev, addr;
        zmq_msg_init(&ev);
        zmq_msg_init(&addr);
        if (!c->mon || zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            zmq_msg_close(&addr);
            return;
        }
        if (zmq_msg_more(&ev))
            zmq_msg_recv(&addr, c->mon, 0);
        uint16_t event = 0;
        uint32_t value = 0;
        if (zmq_msg_size(&ev) >= 6) {
            memcpy(&event, zmq_msg_data(&ev), 2);
            memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
        }
        zmq_msg_close(&ev);
        zmq_msg_close(&addr);
        char msg[512];
        CM_LOG_DEBUG("client '%s': socket event 0x%x value %u", c->name, event, value);
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            c->handshake_ok = 1;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            cm_chan_fmt(msg, sizeof msg,
                        "the server at %s refused this client's CURVE key (status %u): add its public "
                        "key to the server's --curve-client-keys directory",
                        c->endpoint, value);
            cm_chan_client_fatal_(c, CM_ERR_PROTOCOL, msg);
            close_socket(c, 0);
            return;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                   event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
            cm_chan_client_problem_(c, "the handshake with %s failed (%s, code 0x%x)%s", c->endpoint,
                                    event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? "protocol" : "no detail",
                                    value,
                                    c->curve ? ": is --curve-server-key the server's public key?" : "");
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            if (!c->handshake_ok && c->curve)
                cm_chan_fmt(msg, sizeof msg,
                            "the server at %s closed the connection during the CURVE handshake: is "
                            "--curve-server-key the server's public key, and does the server expect CURVE?",
                            c->endpoint);
            else
                cm_chan_fmt(msg, sizeof msg, "disconnected from %s", c->endpoint);
            cm_chan_client_lose_session_(c, msg, now);
            return; /* the monitor socket is closed with the socket */
        }
    }
}

// ----------------------------------------------------------------------------
// the I/O thread

static slot *next_queued(cm_chan_client *c) {
    slot *best = NULL;
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < c->n_slots; i++) {
        slot *s = &c->slots[i];
        if (s->state == SLOT_QUEUED && (!best || s->seq < best->seq))
            best = s;
    }
    pthread_mutex_unlock(&c->mu);
    return best;
}

static void tick(cm_chan_client *c, int64_t now) {
    if (c->conn == CONN_WAIT && now >= c->reconnect_at) {
        pthread_mutex_lock(&c->mu);
        c->stats.reconnects += c->stats.sessions > 0 || c->mon_n > 0;
        pthread_mutex_unlock(&c->mu);
        if (open_socket(c, now) != CM_OK) {
            cm_chan_client_problem_(c, "cannot open a socket to %s: %s", c->endpoint, cm_last_error());
            cm_chan_client_lose_session_(c, "cannot open a socket", now);
        }
        return;
    }
    if (c->conn == CONN_HELLO && now - c->hello_at > c->cfg.peer_timeout_ms) {
        char msg[600];
        snprintf(msg, sizeof msg, "no WELCOME from %s within %d ms (is the target-server running there?)",
                 c->endpoint, c->cfg.peer_timeout_ms);
        cm_chan_client_lose_session_(c, msg, now);
        return;
    }
    if (c->conn == CONN_NCCL && now - c->last_recv > c->cfg.peer_timeout_ms) {
        cm_chan_client_lose_session_(c, "no NCCL_READY from the server", now);
        return;
    }
    if (c->conn != CONN_READY)
        return;
    if (now - c->last_recv > c->cfg.peer_timeout_ms) {
        char msg[96];
        snprintf(msg, sizeof msg, "the server has been silent for %lld ms", (long long)(now - c->last_recv));
        cm_chan_client_lose_session_(c, msg, now);
        return;
    }
    slot *q;
    while (c->conn == CONN_READY && c->in_flight < c->granted && (q = next_queued(c))) {
        uint32_t before = c->in_flight;
        send_request(c, q, now);
        if (c->in_flight == before && cm_chan_client_slot_state_(c, q) == SLOT_QUEUED)
            break; /* socket full: later */
    }
    for (uint32_t i = 0; i < c->n_slots && c->conn == CONN_READY; i++) {
        slot *s = &c->slots[i];
        if (cm_chan_client_slot_state_(c, s) != SLOT_SENT)
            continue;
        if (s->resend_at && now >= s->resend_at) {
            send_request(c, s, now);
        } else if (!s->resend_at && now - s->sent_at > c->cfg.request_timeout_ms) {
            pthread_mutex_lock(&c->mu);
            c->stats.timeouts++;
            pthread_mutex_unlock(&c->mu);
            CM_LOG_WARN("client '%s': no answer to batch %llu within %d ms; asking again", c->name,
                        (unsigned long long)s->batch_id, c->cfg.request_timeout_ms);
            send_request(c, s, now);
        }
    }
    if (c->conn == CONN_READY && now - c->last_send >= c->cfg.heartbeat_ms) {
        uint8_t buf[CM_PROTO_HEADER_SIZE];
        size_t  len;
        cm_proto_heartbeat_encode(++c->hb_seq, buf, sizeof buf, &len);
        cm_chan_client_send_(c, buf, len, now);
        c->last_send = now; /* even when the queue is full: the next try is a heartbeat later */
    }
}

void *cm_chan_client_io_main_(void *arg) {
    cm_chan_client *c = arg;
    c->conn = CONN_WAIT;
    c->reconnect_at = 0;
    while (!atomic_load(&c->quit)) {
        int64_t        now = cm_now_ms();
        zmq_pollitem_t items[3] = {
            {NULL, c->wake_r, ZMQ_POLLIN, 0}, {c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
        int  n = c->sock ? 3 : 1;
        long timeout = c->conn == CONN_DEAD ? 1000 : 20;
        if (zmq_poll(items, n, timeout) < 0 && zmq_errno() != EINTR) {
            char msg[300];
            snprintf(msg, sizeof msg, "zmq_poll failed: %s", zmq_strerror(zmq_errno()));
            cm_chan_client_fatal_(c, CM_ERR_ZMQ, msg);
        }
        if (items[0].revents & ZMQ_POLLIN) {
            char drain[64];
            while (read(c->wake_r, drain, sizeof drain) > 0) {
            }
        }
        now = cm_now_ms();
        if (n == 3 && (items[2].revents & ZMQ_POLLIN))
            handle_monitor(c, now);
        for (int k = 0; k < IO_RECV_BURST && c->sock && handle_msg(c, now); k++)
            now = cm_now_ms();
        if (c->conn != CONN_DEAD)
            tick(c, cm_now_ms());
    }
    if (c->conn == CONN_READY) {
        uint8_t buf[CM_PROTO_HEADER_SIZE];
        size_t  len;
        cm_proto_bye_encode(buf, sizeof buf, &len);
        cm_chan_client_send_(c, buf, len, cm_now_ms());
    }
    close_socket(c, 200); /* lets the BYE out */
    nccl_leave(c);
    return NULL;
}