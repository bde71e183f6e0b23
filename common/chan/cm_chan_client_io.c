/* common/cm_chan_client_io.c — the trainer's I/O thread (see cm_chan_client.c for the owner
 * side). It owns the DEALER: says HELLO, sends queued requests within the granted credits,
 * heartbeats, re-sends a request whose answer is late, corrupt or refused as malformed,
 * re-creates the socket and re-sends everything in flight when the session is lost (silence,
 * BYE, disconnect), and decodes answers ahead of time so the trainer never waits on
 * decompression; decoding runs without the lock, on SENT slots only this thread touches. An
 * answer is accepted only for a SENT slot with its id, so a batch is never delivered twice. */
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

#include "cm_cfg_hash.h"
#include "cm_compress.h"
#include "cm_log.h"

// ----------------------------------------------------------------------------
// helpers (I/O thread unless noted)

static void problem(cm_chan_client *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static void problem(cm_chan_client *c, const char *fmt, ...) {
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

static void set_fatal(cm_chan_client *c, cm_status st, const char *msg) {
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

static slot *find_sent(cm_chan_client *c, uint64_t id) {
    slot *found = NULL;
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < c->n_slots && !found; i++)
        if (c->slots[i].state == SLOT_SENT && c->slots[i].batch_id == id)
            found = &c->slots[i];
    pthread_mutex_unlock(&c->mu);
    return found; /* SENT slots change state only on this thread */
}

static int slot_state(cm_chan_client *c, const slot *s) {
    pthread_mutex_lock(&c->mu);
    int st = s->state;
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* Moves a SENT or QUEUED slot to READY (with data, or failed) and wakes the owner. */
static void complete(cm_chan_client *c, slot *s, cm_status st, const char *msg, uint64_t bytes) {
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

static void send_frame(cm_chan_client *c, const void *buf, size_t len, int64_t now) {
    if (c->sock && zmq_send(c->sock, buf, len, ZMQ_DONTWAIT) >= 0)
        c->last_send = now;
}

static void send_request(cm_chan_client *c, slot *s, int64_t now) {
    size_t need = cm_proto_request_size(s->n_tokens, s->n_seqs, s->n_layers);
    if (need > s->frame_cap) {
        uint8_t *f = realloc(s->frame, need);
        if (!f) {
            complete(c, s, CM_ERR_NOMEM, "cannot allocate the request frame", 0);
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
        complete(c, s, CM_ERR_INVALID_ARG, cm_last_error(), 0);
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
static void retry(cm_chan_client *c, slot *s, cm_status give_up, const char *why, int64_t now, int delay_ms) {
    if (++s->attempts >= c->cfg.max_attempts) {
        char msg[CM_PROTO_MESSAGE_MAX + 96];
        cm_chan_fmt(msg, sizeof msg,
                    "request %llu given up after %d failed answers (the server keeps sending what the trainer "
                    "refuses: check the server's log and model); last: %s",
                    (unsigned long long)s->batch_id, s->attempts, why);
        complete(c, s, give_up, msg, 0);
        return;
    }
    if (delay_ms > 0)
        s->resend_at = now + delay_ms;
    else if (c->conn == CONN_READY)
        send_request(c, s, now);
}

static void lose_session(cm_chan_client *c, const char *why, int64_t now);

/* A frame from the server was refused: report it, and re-request the batch it names if that
 * batch is in flight (the id may be untrusted; a wrong guess costs one idempotent request). */
static void protocol_error(cm_chan_client *c, const char *why, uint64_t id, int is_answer, int64_t now) {
    slot *s = id ? find_sent(c, id) : NULL;
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
            complete(c, s, CM_ERR_PROTOCOL, msg, 0);
        }
        lose_session(c, "an NCCL answer was refused", now);
        return;
    }
    if (s)
        retry(c, s, CM_ERR_PROTOCOL, why, now, 0);
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
    send_frame(c, buf, len, now);
    c->conn = CONN_HELLO;
    c->hello_at = now;
    c->last_recv = now;
    c->handshake_ok = 0;
    return CM_OK;
}

/* The session is gone: everything in flight is queued again and re-sent after the next
 * WELCOME; the socket is re-created after a backoff. */
static void lose_session(cm_chan_client *c, const char *why, int64_t now) {
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

// ----------------------------------------------------------------------------
// incoming frames

static void session_ready(cm_chan_client *c, const cm_proto_welcome *w);

/* Encoding nccl: makes a communicator id, offers it and joins as rank 0 (blocking until the
 * server joins too, bounded by the hook); the session is ready at NCCL_READY. */
static void nccl_offer(cm_chan_client *c, const cm_proto_welcome *w, int64_t now) {
    cm_proto_nccl o = {0};
    uint8_t       buf[CM_PROTO_HEADER_SIZE + 8 + CM_PROTO_NCCL_UID_MAX];
    size_t        len;
    char          msg[1024];
    if (c->cfg.nccl->offer(c->cfg.nccl->user, &o) != CM_OK ||
        cm_proto_nccl_offer_encode(&o, buf, sizeof buf, &len) != CM_OK) {
        cm_chan_fmt(msg, sizeof msg, "cannot make an NCCL communicator: %s", cm_last_error());
        set_fatal(c, CM_ERR_UNSUPPORTED, msg);
        return;
    }
    c->nccl_welcome = *w;
    c->conn = CONN_NCCL;
    send_frame(c, buf, len, now);
    if (c->cfg.nccl->join(c->cfg.nccl->user, &o) != CM_OK) {
        cm_chan_fmt(msg, sizeof msg, "cannot join the NCCL communicator with target-server '%s': %s", w->name,
                    cm_last_error());
        set_fatal(c, CM_ERR_UNSUPPORTED, msg);
        return;
    }
    c->nccl_joined = 1;
    c->last_recv = cm_chan_now_ms(); /* the join blocked this thread; the server kept talking */
}

static void on_nccl_ready(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    uint32_t device;
    if (cm_proto_nccl_ready_decode(p, len, &c->lim, &device) != CM_OK) {
        protocol_error(c, cm_last_error(), 0, 0, now);
        lose_session(c, "a refused NCCL_READY", now);
        return;
    }
    CM_LOG_INFO("client '%s': NCCL communicator with '%s' up (its GPU %u)", c->name, c->nccl_welcome.name,
                device);
    session_ready(c, &c->nccl_welcome);
}

static void on_welcome(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    if (c->conn != CONN_HELLO)
        return;
    cm_proto_welcome w;
    if (cm_proto_welcome_decode(p, len, &c->lim, &w) != CM_OK) {
        protocol_error(c, cm_last_error(), 0, 0, now);
        return;
    }
    char msg[512];
    char why[400];
    if (cm_target_identity_differs(why, sizeof why, w.target_id, w.weights_id, c->cfg.target_id, c->cfg.weights_id,
                                   "served", "expected")) {
        cm_chan_fmt(msg, sizeof msg, "target-server '%s' at %s serves another target than this run needs: %s",
                    w.name, c->endpoint, why);
        set_fatal(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    /* a server that comes back must serve what the first one served: answers of another
     * target, dtype or width would be trained on as if they were the same */
    if (c->have_welcome && cm_target_identity_differs(why, sizeof why, w.target_id, w.weights_id,
                                                      c->welcome.target_id, c->welcome.weights_id, "now",
                                                      "when this run started")) {
        cm_chan_fmt(msg, sizeof msg,
                    "the server at %s ('%s') now serves another target: %s; restart the run against one target",
                    c->endpoint, w.name, why);
        set_fatal(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    if (c->have_welcome && (w.hidden_dtype != c->welcome.hidden_dtype || w.hidden_size != c->welcome.hidden_size)) {
        cm_chan_fmt(msg, sizeof msg,
                    "the server at %s now serves %s hidden %u, but this run started with %s hidden %u; restart the "
                    "run against one target",
                    c->endpoint, cm_dtype_name(w.hidden_dtype), w.hidden_size, cm_dtype_name(c->welcome.hidden_dtype),
                    c->welcome.hidden_size);
        set_fatal(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    uint32_t offer = w.encodings & ((1u << c->cfg.encoding) | c->cfg.accept);
    if (offer >> c->cfg.encoding & 1u) {
        c->enc = c->cfg.encoding;
    } else {
        static const cm_encoding pref[] = {CM_ENCODING_ZSTD_BYTEPLANE, CM_ENCODING_ZSTD, CM_ENCODING_RAW,
                                           CM_ENCODING_FP8_ZSTD};
        int                      found = 0;
        for (int i = 0; i < 4 && !found; i++)
            if (offer >> pref[i] & 1u) {
                c->enc = pref[i];
                found = 1;
            }
        if (!found) {
            snprintf(msg, sizeof msg,
                     "target-server '%s' offers encodings 0x%x, none of which this client accepts "
                     "(%s or mask 0x%x)",
                     w.name, w.encodings, cm_encoding_name(c->cfg.encoding), c->cfg.accept);
            set_fatal(c, CM_ERR_INVALID_ARG, msg);
            return;
        }
    }
    if (c->enc == CM_ENCODING_NCCL) {
        nccl_offer(c, &w, now);
        return;
    }
    session_ready(c, &w);
}

/* The session can carry requests: WELCOME read (and, for encoding nccl, NCCL_READY too). */
static void session_ready(cm_chan_client *c, const cm_proto_welcome *wp) {
    const cm_proto_welcome w = *wp;
    char                   msg[512];
    c->conn = CONN_READY;
    c->granted = w.credits;
    c->in_flight = 0;
    c->backoff_ms = c->cfg.reconnect_ms;
    pthread_mutex_lock(&c->mu);
    c->welcome = w;
    c->have_welcome = 1;
    c->session_up = 1;
    c->stats.sessions++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    /* batches queued before this WELCOME that it rules out fail now, with the reason */
    for (uint32_t i = 0; i < c->n_slots; i++) {
        slot *s = &c->slots[i];
        if (slot_state(c, s) != SLOT_QUEUED)
            continue;
        int bad = s->n_tokens > w.max_tokens;
        for (uint32_t k = 0; k < s->n_layers; k++)
            bad |= (uint32_t)s->layers[k] >= w.n_layers;
        if (bad) {
            snprintf(msg, sizeof msg,
                     "batch %llu (%u tokens) does not fit target-server '%s': at most %u tokens, "
                     "layers 0..%u",
                     (unsigned long long)s->batch_id, s->n_tokens, w.name, w.max_tokens, w.n_layers - 1);
            complete(c, s, CM_ERR_INVALID_ARG, msg, 0);
        }
    }
    CM_LOG_INFO("client '%s': session with '%s' on %s: %u credits, %s %s answers, hidden size %u, %u layers",
                c->name, w.name, c->endpoint, w.credits, cm_encoding_name(c->enc),
                cm_dtype_name(w.hidden_dtype), w.hidden_size, w.n_layers);
}

/* Whether any value is NaN/Inf and whether every value is zero. The exponent test is
 * branch-free ((x & EXP) + EXP_LSB carries into the sign bit only for an all-ones exponent)
 * and runs in fixed blocks of 64 so the compiler vectorises it even at -O2. */
#define SCAN_BLOCK 64
#define SCAN_LOOP(T, EXP, LSB, SIGN)                                                                         \
    do {                                                                                                     \
        const T *v = data;                                                                                   \
        T        bad = 0, nz = 0;                                                                            \
        size_t   i = 0;                                                                                      \
        for (; i + SCAN_BLOCK <= n; i += SCAN_BLOCK)                                                         \
            for (int k = 0; k < SCAN_BLOCK; k++) {                                                           \
                bad |= (T)((v[i + k] & EXP) + LSB);                                                          \
                nz |= (T)(v[i + k] & (T)~SIGN);                                                              \
            }                                                                                                \
        for (; i < n; i++) {                                                                                 \
            bad |= (T)((v[i] & EXP) + LSB);                                                                  \
            nz |= (T)(v[i] & (T)~SIGN);                                                                      \
        }                                                                                                    \
        *any_bad = (bad & SIGN) != 0;                                                                        \
        *all_zero = n > 0 && nz == 0;                                                                        \
    } while (0)

static void scan_values(cm_dtype dt, const void *data, size_t n, int *any_bad, int *all_zero) {
    if (dt == CM_DTYPE_BF16)
        SCAN_LOOP(uint16_t, 0x7F80u, 0x0080u, 0x8000u);
    else
        SCAN_LOOP(uint32_t, 0x7F800000u, 0x00800000u, 0x80000000u);
}

/* An ANSWER of encoding nccl: its tensors follow over NCCL and are received whatever happens
 * (into scratch when no one waits for them) so the transfers stay paired with the ANSWERs. */
static void on_nccl_answer(cm_chan_client *c, const cm_proto_answer *a, size_t received, int64_t now) {
    slot       *s = find_sent(c, a->batch_id);
    const void *dev[MAX_TENSORS];
    uint32_t    at = s ? (uint32_t)(s - c->slots) : c->n_slots;
    for (uint32_t i = 0; i < a->n_tensors; i++)
        if (a->tensors[i].encoding != CM_ENCODING_NCCL) {
            char why[160];
            snprintf(why, sizeof why, "answer to batch %llu mixes encoding %s into an nccl session",
                     (unsigned long long)a->batch_id, cm_encoding_name(a->tensors[i].encoding));
            protocol_error(c, why, a->batch_id, 1, now);
            return;
        }
    if (c->cfg.nccl->recv(c->cfg.nccl->user, at, a->n_tensors, a->tensors, dev) != CM_OK) {
        char why[512];
        cm_chan_fmt(why, sizeof why, "NCCL receive of batch %llu failed: %s", (unsigned long long)a->batch_id,
                    cm_last_error());
        problem(c, "%s", why);
        lose_session(c, why, now);
        return;
    }
    if (!s) {
        pthread_mutex_lock(&c->mu);
        c->stats.duplicates++;
        pthread_mutex_unlock(&c->mu);
        return;
    }
    const uint32_t D = c->welcome.hidden_size;
    const cm_dtype hd = c->welcome.hidden_dtype;
    char           why[256] = "";
    if (a->n_tensors != s->n_layers)
        snprintf(why, sizeof why, "answer to batch %llu has %u tensors for %u requested layers",
                 (unsigned long long)a->batch_id, a->n_tensors, s->n_layers);
    for (uint32_t i = 0; i < a->n_tensors && !why[0]; i++) {
        const cm_proto_tensor *t = &a->tensors[i];
        char                   want[32];
        snprintf(want, sizeof want, "layer_%d", s->layers[i]);
        if (strcmp(t->name, want) != 0 || t->dtype != hd || t->n_dims != 2 || t->shape[0] != s->n_tokens ||
            t->shape[1] != D)
            snprintf(why, sizeof why, "answer to batch %llu: tensor %u is '%s' %s, expected '%s' %s [%u, %u]",
                     (unsigned long long)a->batch_id, i, t->name, cm_dtype_name(t->dtype), want,
                     cm_dtype_name(hd), s->n_tokens, D);
        cm_chan_tensor *ct = &s->tensors[i];
        memcpy(ct->name, t->name, sizeof ct->name);
        ct->layer = s->layers[i];
        ct->dtype = hd;
        ct->n_tokens = s->n_tokens;
        ct->hidden = D;
        ct->bytes = t->raw_size;
        ct->data = dev[i];
        ct->on_device = 1;
    }
    if (why[0]) { /* well paired but not what was asked for: ask again on this session */
        pthread_mutex_lock(&c->mu);
        c->stats.protocol_errors++;
        c->stats.corrupt_answers++;
        pthread_mutex_unlock(&c->mu);
        CM_LOG_WARN("client '%s': %s", c->name, why);
        retry(c, s, CM_ERR_PROTOCOL, why, now, 0);
        return;
    }
    s->attempts = 0;
    complete(c, s, CM_OK, "", received);
}

static void on_answer(cm_chan_client *c, zmq_msg_t *head, zmq_msg_t *data, uint64_t id, int64_t now) {
    cm_proto_answer a = {.tensors = c->pt, .cap_tensors = MAX_TENSORS};
    if (cm_proto_answer_decode_parts(zmq_msg_data(head), zmq_msg_size(head), zmq_msg_data(data),
                                     zmq_msg_size(data), &c->lim, &a) != CM_OK) {
        protocol_error(c, cm_last_error(), id, 1, now);
        return;
    }
    if (c->nccl_joined) {
        on_nccl_answer(c, &a, zmq_msg_size(head) + zmq_msg_size(data), now);
        return;
    }
    slot *s = find_sent(c, a.batch_id);
    if (!s) {
        pthread_mutex_lock(&c->mu);
        c->stats.duplicates++;
        pthread_mutex_unlock(&c->mu);
        CM_LOG_DEBUG("client '%s': dropped an answer to batch %llu, which is not awaited", c->name,
                     (unsigned long long)a.batch_id);
        return;
    }
    const uint32_t D = c->welcome.hidden_size;
    const cm_dtype hd = c->welcome.hidden_dtype;
    char           why[256] = "";
    if (a.n_tensors != s->n_layers)
        snprintf(why, sizeof why, "answer to batch %llu has %u tensors for %u requested layers",
                 (unsigned long long)a.batch_id, a.n_tensors, s->n_layers);
    uint64_t total = 0;
    for (uint32_t i = 0; i < a.n_tensors && !why[0]; i++) {
        const cm_proto_tensor *t = &a.tensors[i];
        char                   want[32];
        snprintf(want, sizeof want, "layer_%d", s->layers[i]);
        if (strcmp(t->name, want) != 0 || t->dtype != hd || t->n_dims != 2 || t->shape[0] != s->n_tokens ||
            t->shape[1] != D || t->encoding != c->enc)
            snprintf(why, sizeof why,
                     "answer to batch %llu: tensor %u is '%s' %s %s [%lld, %lld], expected '%s' %s %s "
                     "[%u, %u]",
                     (unsigned long long)a.batch_id, i, t->name, cm_dtype_name(t->dtype),
                     cm_encoding_name(t->encoding), (long long)t->shape[0],
                     (long long)(t->n_dims > 1 ? t->shape[1] : 0), want, cm_dtype_name(hd),
                     cm_encoding_name(c->enc), s->n_tokens, D);
        total += t->raw_size;
    }
    /* raw answers are lent zero-copy when every tensor is aligned to its dtype (large ZeroMQ
     * messages are; small ones may sit at any offset of a shared receive buffer), else copied */
    int zero_copy = c->enc == CM_ENCODING_RAW;
    for (uint32_t i = 0; i < a.n_tensors && zero_copy; i++)
        zero_copy = (uintptr_t)a.tensors[i].data % cm_dtype_size(hd) == 0;
    if (!why[0] && !zero_copy && total > s->buf_cap) {
        free(s->buf);
        s->buf = malloc(total);
        s->buf_cap = s->buf ? total : 0;
        if (!s->buf)
            snprintf(why, sizeof why, "cannot allocate %llu bytes for an answer", (unsigned long long)total);
    }
    uint64_t off = 0;
    for (uint32_t i = 0; i < a.n_tensors && !why[0]; i++) {
        const cm_proto_tensor *t = &a.tensors[i];
        cm_chan_tensor        *ct = &s->tensors[i];
        memcpy(ct->name, t->name, sizeof ct->name);
        ct->layer = s->layers[i];
        ct->dtype = hd;
        ct->n_tokens = s->n_tokens;
        ct->hidden = D;
        ct->bytes = t->raw_size;
        ct->on_device = 0;
        if (zero_copy) {
            ct->data = t->data;
        } else if (c->enc == CM_ENCODING_RAW) {
            memcpy(s->buf + off, t->data, t->raw_size);
            ct->data = s->buf + off;
            off += t->raw_size;
        } else {
            if (cm_compress_decode_tensor(c->cc, t, s->buf + off, t->raw_size) != CM_OK)
                snprintf(why, sizeof why, "%s", cm_last_error());
            ct->data = s->buf + off;
            off += t->raw_size;
        }
        if (!why[0] && c->cfg.check_values) {
            int any_bad, zero;
            scan_values(hd, ct->data, (size_t)s->n_tokens * D, &any_bad, &zero);
            if (any_bad || zero)
                snprintf(why, sizeof why, "answer to batch %llu: %s holds %s", (unsigned long long)a.batch_id,
                         t->name, zero ? "only zeros" : "NaN or Inf values");
        }
    }
    if (why[0]) {
        protocol_error(c, why, a.batch_id, 1, now);
        return;
    }
    const size_t received = zmq_msg_size(head) + zmq_msg_size(data);
    if (zero_copy || c->cfg.keep_frames) { /* the tensors point into DATA, or the owner wants it: keep it */
        const uint8_t *base = zmq_msg_data(data);
        zmq_msg_init(&s->raw);
        zmq_msg_move(&s->raw, data);
        s->has_raw = 1;
        /* a small message lives inside the zmq_msg_t itself: re-point at its new home */
        for (uint32_t i = 0; i < a.n_tensors && zero_copy; i++)
            s->tensors[i].data =
                (const uint8_t *)zmq_msg_data(&s->raw) + ((const uint8_t *)a.tensors[i].data - base);
    }
    if (c->cfg.keep_frames) {
        zmq_msg_init(&s->head_raw);
        zmq_msg_move(&s->head_raw, head);
        s->has_head = 1;
    }
    s->attempts = 0;
    complete(c, s, CM_OK, "", received);
}

static void on_error(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    cm_proto_error e;
    if (cm_proto_error_decode(p, len, &c->lim, &e) != CM_OK) {
        protocol_error(c, cm_last_error(), 0, 0, now);
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->stats.server_errors++;
    cm_chan_fmt(c->stats.last_problem, sizeof c->stats.last_problem, "server: %s: %s",
                cm_proto_error_name(e.code), e.message);
    pthread_mutex_unlock(&c->mu);
    char msg[CM_PROTO_MESSAGE_MAX + 64];
    snprintf(msg, sizeof msg, "target-server: %s", e.message);
    if (e.code == CM_PROTO_ERROR_VERSION) {
        set_fatal(c, CM_ERR_PROTOCOL, msg);
        return;
    }
    if (e.code == CM_PROTO_ERROR_TARGET_MISMATCH ||
        (e.code == CM_PROTO_ERROR_BAD_REQUEST && e.batch_id == 0)) {
        set_fatal(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    if (e.code == CM_PROTO_ERROR_SHUTDOWN || (e.batch_id == 0 && e.code == CM_PROTO_ERROR_BUSY)) {
        lose_session(c, msg, now);
        return;
    }
    slot *s = e.batch_id ? find_sent(c, e.batch_id) : NULL;
    if (!s) {
        if (e.code == CM_PROTO_ERROR_CORRUPT && c->conn == CONN_HELLO)
            lose_session(c, msg, now); /* HELLO again */
        else
            CM_LOG_WARN("client '%s': %s (%s)", c->name, msg, cm_proto_error_name(e.code));
        return;
    }
    switch (e.code) {
    case CM_PROTO_ERROR_BAD_REQUEST:
        complete(c, s, CM_ERR_INVALID_ARG, msg, 0);
        break;
    case CM_PROTO_ERROR_CORRUPT:
        retry(c, s, CM_ERR_PROTOCOL, msg, now, 0);
        break;
    case CM_PROTO_ERROR_NO_CREDIT:
    case CM_PROTO_ERROR_BUSY:
        s->resend_at = now + 100;
        break;
    default:
        CM_LOG_WARN("client '%s': batch %llu: %s (%s)", c->name, (unsigned long long)s->batch_id, msg,
                    cm_proto_error_name(e.code));
        retry(c, s, CM_ERR_IO, msg, now, 100);
        break;
    }
}

static uint64_t raw_id(const uint8_t *p, size_t len) {
    uint64_t id = 0;
    for (int i = 7; len >= 24 && i >= 0; i--)
        id = id << 8 | p[16 + i];
    return id;
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
        if (c->conn == CONN_HELLO && n >= 6 &&
            (uint32_t)(p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24) == CM_PROTO_MAGIC &&
            (p[4] | p[5] << 8) != CM_PROTO_VERSION) {
            char msg[600];
            cm_chan_fmt(msg, sizeof msg,
                        "the server at %s speaks protocol version %u, this client %d: run matching "
                        "target-server and drafter-trainer builds",
                        c->endpoint, (unsigned)(p[4] | p[5] << 8), CM_PROTO_VERSION);
            set_fatal(c, CM_ERR_PROTOCOL, msg);
        } else {
            protocol_error(c, why, raw_id(p, n), parts == 2, now);
        }
    } else if (parts != (h.type == CM_PROTO_TYPE_ANSWER ? 2 : 1)) {
        char why[160];
        snprintf(why, sizeof why, "a %s frame in %d message parts (expected %d)", cm_proto_type_name(h.type),
                 parts, h.type == CM_PROTO_TYPE_ANSWER ? 2 : 1);
        protocol_error(c, why, h.id, h.type == CM_PROTO_TYPE_ANSWER, now);
    } else if (h.type == CM_PROTO_TYPE_WELCOME) {
        on_welcome(c, p, n, now);
    } else if (h.type == CM_PROTO_TYPE_NCCL_READY && c->conn == CONN_NCCL) {
        on_nccl_ready(c, p, n, now);
    } else if (c->conn != CONN_READY) {
        if (h.type == CM_PROTO_TYPE_ERROR)
            on_error(c, p, n, now);
        /* anything else before WELCOME belongs to no session */
    } else if (h.type == CM_PROTO_TYPE_ANSWER) {
        on_answer(c, &m[0], &m[1], h.id, now);
    } else if (h.type == CM_PROTO_TYPE_ERROR) {
        on_error(c, p, n, now);
    } else if (h.type == CM_PROTO_TYPE_HEARTBEAT) {
        uint64_t seq;
        if (cm_proto_heartbeat_decode(p, n, &c->lim, &seq) != CM_OK)
            protocol_error(c, cm_last_error(), 0, 0, now);
    } else if (h.type == CM_PROTO_TYPE_BYE) {
        if (cm_proto_bye_decode(p, n, &c->lim) != CM_OK)
            protocol_error(c, cm_last_error(), 0, 0, now);
        else
            lose_session(c, "the server ended the session (BYE)", now);
    } else {
        char why[96];
        snprintf(why, sizeof why, "unexpected %s frame from the server", cm_proto_type_name(h.type));
        protocol_error(c, why, 0, 0, now);
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
            set_fatal(c, CM_ERR_PROTOCOL, msg);
            close_socket(c, 0);
            return;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                   event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
            problem(c, "the handshake with %s failed (%s, code 0x%x)%s", c->endpoint,
                    event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? "protocol" : "no detail", value,
                    c->curve ? ": is --curve-server-key the server's public key?" : "");
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            if (!c->handshake_ok && c->curve)
                cm_chan_fmt(msg, sizeof msg,
                            "the server at %s closed the connection during the CURVE handshake: is "
                            "--curve-server-key the server's public key, and does the server expect CURVE?",
                            c->endpoint);
            else
                cm_chan_fmt(msg, sizeof msg, "disconnected from %s", c->endpoint);
            lose_session(c, msg, now);
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
            problem(c, "cannot open a socket to %s: %s", c->endpoint, cm_last_error());
            lose_session(c, "cannot open a socket", now);
        }
        return;
    }
    if (c->conn == CONN_HELLO && now - c->hello_at > c->cfg.peer_timeout_ms) {
        char msg[600];
        snprintf(msg, sizeof msg, "no WELCOME from %s within %d ms (is the target-server running there?)",
                 c->endpoint, c->cfg.peer_timeout_ms);
        lose_session(c, msg, now);
        return;
    }
    if (c->conn == CONN_NCCL && now - c->last_recv > c->cfg.peer_timeout_ms) {
        lose_session(c, "no NCCL_READY from the server", now);
        return;
    }
    if (c->conn != CONN_READY)
        return;
    if (now - c->last_recv > c->cfg.peer_timeout_ms) {
        char msg[96];
        snprintf(msg, sizeof msg, "the server has been silent for %lld ms", (long long)(now - c->last_recv));
        lose_session(c, msg, now);
        return;
    }
    slot *q;
    while (c->conn == CONN_READY && c->in_flight < c->granted && (q = next_queued(c))) {
        uint32_t before = c->in_flight;
        send_request(c, q, now);
        if (c->in_flight == before && slot_state(c, q) == SLOT_QUEUED)
            break; /* socket full: later */
    }
    for (uint32_t i = 0; i < c->n_slots && c->conn == CONN_READY; i++) {
        slot *s = &c->slots[i];
        if (slot_state(c, s) != SLOT_SENT)
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
        send_frame(c, buf, len, now);
        c->last_send = now; /* even when the queue is full: the next try is a heartbeat later */
    }
}

void *cm_chan_client_io_main_(void *arg) {
    cm_chan_client *c = arg;
    c->conn = CONN_WAIT;
    c->reconnect_at = 0;
    while (!atomic_load(&c->quit)) {
        int64_t        now = cm_chan_now_ms();
        zmq_pollitem_t items[3] = {
            {NULL, c->wake_r, ZMQ_POLLIN, 0}, {c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
        int  n = c->sock ? 3 : 1;
        long timeout = c->conn == CONN_DEAD ? 1000 : 20;
        if (zmq_poll(items, n, timeout) < 0 && zmq_errno() != EINTR) {
            char msg[300];
            snprintf(msg, sizeof msg, "zmq_poll failed: %s", zmq_strerror(zmq_errno()));
            set_fatal(c, CM_ERR_ZMQ, msg);
        }
        if (items[0].revents & ZMQ_POLLIN) {
            char drain[64];
            while (read(c->wake_r, drain, sizeof drain) > 0) {
            }
        }
        now = cm_chan_now_ms();
        if (n == 3 && (items[2].revents & ZMQ_POLLIN))
            handle_monitor(c, now);
        for (int k = 0; k < IO_RECV_BURST && c->sock && handle_msg(c, now); k++)
            now = cm_chan_now_ms();
        if (c->conn != CONN_DEAD)
            tick(c, cm_chan_now_ms());
    }
    if (c->conn == CONN_READY) {
        uint8_t buf[CM_PROTO_HEADER_SIZE];
        size_t  len;
        cm_proto_bye_encode(buf, sizeof buf, &len);
        send_frame(c, buf, len, cm_chan_now_ms());
    }
    close_socket(c, 200); /* lets the BYE out */
    nccl_leave(c);
    return NULL;
}
