/* common/cm_chan_client.c — the trainer's end of a session (see cm_chan.h). The owner thread
 * submits requests into `credits` slots and receives completed answers; a background I/O
 * thread owns the DEALER: it says HELLO, sends queued requests within the granted credits,
 * heartbeats, re-sends a request whose answer is late, corrupt or refused as malformed,
 * re-creates the socket and re-sends everything in flight when the session is lost (silence,
 * BYE, disconnect), and decodes answers ahead of time so the trainer never waits on
 * decompression. Slot states move FREE → QUEUED → SENT → READY → HELD → FREE under `mu`; a
 * slot's arrays and buffers belong to whichever thread its state says (owner: FREE and HELD,
 * I/O: QUEUED, SENT), so decoding runs without the lock. An answer is accepted only for a SENT
 * slot with its id, so a batch is never delivered twice. */
#include "cm_chan_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

#define MAX_TENSORS 256
#define RECV_BURST  64

enum { SLOT_FREE, SLOT_QUEUED, SLOT_SENT, SLOT_READY, SLOT_HELD };
enum { CONN_WAIT, CONN_HELLO, CONN_READY, CONN_DEAD };

typedef struct slot {
    cm_chan_answer  ans; /* first: release() maps the answer back to its slot */
    int             state;
    uint64_t        batch_id, seq;
    int             ever_sent, attempts;
    int64_t         sent_at, resend_at; /* resend_at 0: none scheduled */
    uint32_t        n_tokens, n_seqs, n_layers;
    int32_t        *tokens, *cu, *layers;
    uint32_t        cap_tokens, cap_cu, cap_layers;
    uint8_t        *frame;
    size_t          frame_cap;
    cm_chan_tensor *tensors;
    uint8_t        *buf; /* decoded tensors */
    size_t          buf_cap;
    zmq_msg_t       raw; /* DATA of a raw answer, lent zero-copy */
    int             has_raw;
    char            message[CM_PROTO_MESSAGE_MAX + 128];
} slot;

struct cm_chan_client {
    cm_chan_client_config cfg;
    char                  endpoint[512], name[CM_PROTO_NAME_MAX + 1], ident[32];
    char                  server_key[CM_CHAN_KEY_LEN + 1], public_key[CM_CHAN_KEY_LEN + 1];
    char                  secret_key[CM_CHAN_KEY_LEN + 1];
    int                   curve;
    void                 *ctx, *sock, *mon;
    unsigned              mon_n;
    pthread_t             io;
    int                   io_started, wake_r, wake_w;
    atomic_int            quit;
    /* shared, under mu */
    pthread_mutex_t      mu;
    pthread_cond_t       cv;
    slot                *slots;
    uint32_t             n_slots;
    uint32_t            *ready, ready_head, ready_len;
    uint64_t             seq;
    int                  session_up, have_welcome;
    cm_proto_welcome     welcome;
    cm_status            fatal;
    char                 fatal_msg[1024];
    cm_chan_client_stats stats;
    /* I/O thread only */
    cm_compress     *cc;
    cm_proto_limits  lim;
    cm_proto_tensor *pt;
    cm_encoding      enc;
    int              conn, handshake_ok, backoff_ms;
    uint32_t         granted, in_flight;
    int64_t          last_recv, last_send, hello_at, reconnect_at;
    uint64_t         hb_seq;
};

// ----------------------------------------------------------------------------
// helpers (I/O thread unless noted)

static void wake(cm_chan_client *c) { /* any thread */
    char b = 1;
    while (write(c->wake_w, &b, 1) < 0 && errno == EINTR) {
    }
}

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
        cm_chan_fmt(msg, sizeof msg, "batch %llu given up after %d failed answers; last: %s",
                    (unsigned long long)s->batch_id, s->attempts, why);
        complete(c, s, give_up, msg, 0);
        return;
    }
    if (delay_ms > 0)
        s->resend_at = now + delay_ms;
    else if (c->conn == CONN_READY)
        send_request(c, s, now);
}

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

static void on_welcome(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    if (c->conn != CONN_HELLO)
        return;
    cm_proto_welcome w;
    if (cm_proto_welcome_decode(p, len, &c->lim, &w) != CM_OK) {
        protocol_error(c, cm_last_error(), 0, 0, now);
        return;
    }
    char msg[512];
    if (c->cfg.target_id && w.target_id != c->cfg.target_id) {
        snprintf(msg, sizeof msg, "target-server '%s' serves target %016llx, not the %016llx this run needs",
                 w.name, (unsigned long long)w.target_id, (unsigned long long)c->cfg.target_id);
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

/* Returns the number of non-finite values, and whether every value is zero. */
static void scan_values(cm_dtype dt, const void *data, size_t n, size_t *n_bad, int *all_zero) {
    size_t bad = 0, nonzero = 0;
    if (dt == CM_DTYPE_BF16) {
        const uint16_t *v = data;
        for (size_t i = 0; i < n; i++) {
            bad += (v[i] & 0x7F80u) == 0x7F80u;
            nonzero |= v[i] & 0x7FFFu;
        }
    } else {
        const uint32_t *v = data;
        for (size_t i = 0; i < n; i++) {
            bad += (v[i] & 0x7F800000u) == 0x7F800000u;
            nonzero |= v[i] & 0x7FFFFFFFu;
        }
    }
    *n_bad = bad;
    *all_zero = n > 0 && nonzero == 0;
}

static void on_answer(cm_chan_client *c, zmq_msg_t *head, zmq_msg_t *data, uint64_t id, int64_t now) {
    cm_proto_answer a = {.tensors = c->pt, .cap_tensors = MAX_TENSORS};
    if (cm_proto_answer_decode_parts(zmq_msg_data(head), zmq_msg_size(head), zmq_msg_data(data),
                                     zmq_msg_size(data), &c->lim, &a) != CM_OK) {
        protocol_error(c, cm_last_error(), id, 1, now);
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
            size_t n_bad;
            int    zero;
            scan_values(hd, ct->data, (size_t)s->n_tokens * D, &n_bad, &zero);
            if (n_bad || zero)
                snprintf(why, sizeof why, "answer to batch %llu: %s holds %s", (unsigned long long)a.batch_id,
                         t->name, zero ? "only zeros" : "NaN or Inf values");
        }
    }
    if (why[0]) {
        protocol_error(c, why, a.batch_id, 1, now);
        return;
    }
    if (zero_copy) { /* the tensors point into DATA: keep it until release */
        const uint8_t *base = zmq_msg_data(data);
        zmq_msg_init(&s->raw);
        zmq_msg_move(&s->raw, data);
        s->has_raw = 1;
        /* a small message lives inside the zmq_msg_t itself: re-point at its new home */
        for (uint32_t i = 0; i < a.n_tensors; i++)
            s->tensors[i].data =
                (const uint8_t *)zmq_msg_data(&s->raw) + ((const uint8_t *)a.tensors[i].data - base);
    }
    s->attempts = 0;
    complete(c, s, CM_OK, "", zmq_msg_size(head) + (s->has_raw ? zmq_msg_size(&s->raw) : zmq_msg_size(data)));
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

static void *io_main(void *arg) {
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
        for (int k = 0; k < RECV_BURST && c->sock && handle_msg(c, now); k++)
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
    return NULL;
}

// ----------------------------------------------------------------------------
// the owner's API

static cm_status fatal_status(cm_chan_client *c) { /* under mu */
    return CM_FAIL(c->fatal, "%s", c->fatal_msg);
}

static void deadline_after(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

cm_status cm_chan_client_wait_ready(cm_chan_client *c, int timeout_ms, cm_proto_welcome *out) {
    struct timespec dl;
    deadline_after(&dl, timeout_ms < 0 ? 0 : timeout_ms);
    pthread_mutex_lock(&c->mu);
    while (!c->session_up && c->fatal == CM_OK)
        if ((timeout_ms >= 0 && pthread_cond_timedwait(&c->cv, &c->mu, &dl) == ETIMEDOUT) ||
            (timeout_ms < 0 && pthread_cond_wait(&c->cv, &c->mu) != 0))
            break;
    cm_status st;
    if (c->fatal != CM_OK)
        st = fatal_status(c);
    else if (!c->session_up)
        st = CM_FAIL(CM_ERR_TIMEOUT, "no session with '%s' after %d ms: %s", c->endpoint, timeout_ms,
                     c->stats.last_problem[0] ? c->stats.last_problem
                                              : "no reply to HELLO (is the target-server up?)");
    else {
        st = CM_OK;
        if (out)
            *out = c->welcome;
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

static cm_status check_batch(const int32_t *tokens, uint32_t T, const int32_t *cu, uint32_t N,
                             const int32_t *layers, uint32_t L) {
    if (!tokens || !cu || !layers || T < 1 || N < 1 || N > T || L < 1 || L > MAX_TENSORS || T > INT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "submit: need 1 ≤ n_seqs ≤ n_tokens and 1 ≤ n_layers ≤ %d, with arrays "
                       "(got T=%u N=%u L=%u)",
                       MAX_TENSORS, T, N, L);
    for (uint32_t i = 0; i < T; i++)
        if (tokens[i] < 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "submit: tokens[%u] is %d", i, tokens[i]);
    if (cu[0] != 0 || (uint32_t)cu[N] != T)
        return CM_FAIL(CM_ERR_INVALID_ARG, "submit: cu_seqlens must run from 0 to n_tokens %u (got %d .. %d)",
                       T, cu[0], cu[N]);
    for (uint32_t i = 1; i <= N; i++)
        if (cu[i] <= cu[i - 1])
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "submit: cu_seqlens[%u] = %d does not exceed cu_seqlens[%u] = %d", i, cu[i], i - 1,
                           cu[i - 1]);
    for (uint32_t i = 0; i < L; i++) {
        if (layers[i] < 0)
            return CM_FAIL(CM_ERR_INVALID_ARG, "submit: layer_ids[%u] is %d", i, layers[i]);
        for (uint32_t j = 0; j < i; j++)
            if (layers[j] == layers[i])
                return CM_FAIL(CM_ERR_INVALID_ARG, "submit: layer %d is asked for twice", layers[i]);
    }
    return CM_OK;
}

static int grow_i32(int32_t **p, uint32_t *cap, uint32_t n) {
    if (n <= *cap)
        return 1;
    int32_t *q = realloc(*p, (size_t)n * sizeof *q);
    if (!q)
        return 0;
    *p = q;
    *cap = n;
    return 1;
}

cm_status cm_chan_client_submit(cm_chan_client *c, uint64_t batch_id, const int32_t *tokens,
                                uint32_t n_tokens, const int32_t *cu_seqlens, uint32_t n_seqs,
                                const int32_t *layer_ids, uint32_t n_layers) {
    CM_TRY(check_batch(tokens, n_tokens, cu_seqlens, n_seqs, layer_ids, n_layers));
    cm_status st = CM_OK;
    pthread_mutex_lock(&c->mu);
    slot *free_slot = NULL;
    for (uint32_t i = 0; i < c->n_slots && st == CM_OK; i++) {
        slot *s = &c->slots[i];
        if (s->state == SLOT_FREE) {
            if (!free_slot)
                free_slot = s;
        } else if (s->batch_id == batch_id) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "submit: batch id %llu is already in flight or held; ids must be unique",
                         (unsigned long long)batch_id);
        }
    }
    if (st != CM_OK)
        goto done;
    if (c->fatal != CM_OK) {
        st = fatal_status(c);
        goto done;
    }
    if (c->have_welcome) {
        const cm_proto_welcome *w = &c->welcome;
        if (n_tokens > w->max_tokens) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "submit: batch %llu has %u tokens; target-server '%s' takes at most %u",
                         (unsigned long long)batch_id, n_tokens, w->name, w->max_tokens);
            goto done;
        }
        for (uint32_t i = 0; i < n_layers; i++)
            if ((uint32_t)layer_ids[i] >= w->n_layers) {
                st = CM_FAIL(CM_ERR_INVALID_ARG,
                             "submit: layer %d is out of range; target '%s' has layers 0..%u", layer_ids[i],
                             w->name, w->n_layers - 1);
                goto done;
            }
    }
    if (!free_slot) {
        st = CM_FAIL(CM_ERR_TIMEOUT,
                     "no credit: all %u slots are in flight or held; receive and release an answer "
                     "first",
                     c->n_slots);
        goto done;
    }
    slot *s = free_slot;
    if (!grow_i32(&s->tokens, &s->cap_tokens, n_tokens) || !grow_i32(&s->cu, &s->cap_cu, n_seqs + 1) ||
        !grow_i32(&s->layers, &s->cap_layers, n_layers)) {
        st = CM_FAIL(CM_ERR_NOMEM, "submit: cannot copy a batch of %u tokens", n_tokens);
        goto done;
    }
    memcpy(s->tokens, tokens, (size_t)n_tokens * 4);
    memcpy(s->cu, cu_seqlens, ((size_t)n_seqs + 1) * 4);
    memcpy(s->layers, layer_ids, (size_t)n_layers * 4);
    s->batch_id = batch_id;
    s->n_tokens = n_tokens;
    s->n_seqs = n_seqs;
    s->n_layers = n_layers;
    s->seq = ++c->seq;
    s->ever_sent = 0;
    s->attempts = 0;
    s->resend_at = 0;
    s->state = SLOT_QUEUED;
    c->stats.submitted++;
done:
    pthread_mutex_unlock(&c->mu);
    if (st == CM_OK)
        wake(c);
    return st;
}

cm_status cm_chan_client_recv(cm_chan_client *c, int timeout_ms, cm_chan_answer **out) {
    *out = NULL;
    struct timespec dl;
    deadline_after(&dl, timeout_ms < 0 ? 0 : timeout_ms);
    cm_status st = CM_OK;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->ready_len) {
            slot *s = &c->slots[c->ready[c->ready_head]];
            c->ready_head = (c->ready_head + 1) % c->n_slots;
            c->ready_len--;
            s->state = SLOT_HELD;
            *out = &s->ans;
            break;
        }
        if (c->fatal != CM_OK) {
            st = fatal_status(c);
            break;
        }
        int rc = timeout_ms < 0    ? pthread_cond_wait(&c->cv, &c->mu)
                 : timeout_ms == 0 ? ETIMEDOUT
                                   : pthread_cond_timedwait(&c->cv, &c->mu, &dl);
        if (rc == ETIMEDOUT) {
            st = CM_FAIL(CM_ERR_TIMEOUT, "no answer within %d ms", timeout_ms);
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

void cm_chan_client_release(cm_chan_client *c, cm_chan_answer **a) {
    if (!a || !*a)
        return;
    slot *s = (slot *)*a; /* ans is the first member */
    CM_ASSERT(s >= c->slots && s < c->slots + c->n_slots);
    pthread_mutex_lock(&c->mu);
    CM_ASSERT(s->state == SLOT_HELD);
    if (s->has_raw) {
        zmq_msg_close(&s->raw);
        s->has_raw = 0;
    }
    s->state = SLOT_FREE;
    pthread_mutex_unlock(&c->mu);
    *a = NULL;
}

uint32_t cm_chan_client_pending(cm_chan_client *c) {
    uint32_t n = 0;
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < c->n_slots; i++)
        n += c->slots[i].state != SLOT_FREE;
    pthread_mutex_unlock(&c->mu);
    return n;
}

void cm_chan_client_get_stats(cm_chan_client *c, cm_chan_client_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->mu);
}

// ----------------------------------------------------------------------------
// create / destroy

cm_status cm_chan_client_create(cm_chan_client **out, const cm_chan_client_config *cfg) {
    *out = NULL;
    int local;
    CM_TRY(cm_chan_endpoint_check(cfg->endpoint, &local));
    if (!local && !cfg->curve_server_key)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "connecting to '%s' needs --curve-server-key (the server's public key): "
                       "a target-server binds a non-loopback endpoint only with CURVE",
                       cfg->endpoint);
    if (cfg->curve_secret_key && !cfg->curve_server_key)
        return CM_FAIL(CM_ERR_INVALID_ARG, "a client CURVE secret key needs --curve-server-key too");
    if (cfg->credits < 1 || cfg->credits > 1024)
        return CM_FAIL(CM_ERR_INVALID_ARG, "client credits %u: expected 1 to 1024", cfg->credits);
    if ((unsigned)cfg->encoding >= CM_ENCODING_END || cfg->accept >> CM_ENCODING_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "client encoding %d or accept mask 0x%x is unknown",
                       (int)cfg->encoding, cfg->accept);
    if (cfg->heartbeat_ms < 10 || cfg->peer_timeout_ms <= cfg->heartbeat_ms || cfg->request_timeout_ms < 10 ||
        cfg->reconnect_ms < 1 || cfg->max_attempts < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "client timing: need heartbeat ≥ 10 ms < peer timeout, request timeout ≥ "
                       "10 ms, reconnect ≥ 1 ms, max attempts ≥ 1");
    if (cfg->n_threads < 1 || cfg->n_threads > CM_COMPRESS_MAX_THREADS || cfg->max_answer_bytes < 1024)
        return CM_FAIL(CM_ERR_INVALID_ARG, "client: %d threads, max answer %llu bytes", cfg->n_threads,
                       (unsigned long long)cfg->max_answer_bytes);
    if (cfg->curve_server_key)
        CM_TRY(cm_chan_curve_require("--curve-server-key"));

    cm_chan_client *c = calloc(1, sizeof *c);
    if (!c)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the client");
    c->cfg = *cfg;
    c->wake_r = c->wake_w = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    cm_status st = CM_OK;
    snprintf(c->endpoint, sizeof c->endpoint, "%s", cfg->endpoint);
    snprintf(c->name, sizeof c->name, "%s", cfg->name ? cfg->name : "trainer");
    snprintf(c->ident, sizeof c->ident, "tdm-%016llx", (unsigned long long)cm_chan_random_u64());
    c->cfg.endpoint = c->endpoint;
    c->cfg.name = c->name;
    c->cfg.curve_server_key = NULL;
    c->cfg.curve_secret_key = NULL;
    c->backoff_ms = cfg->reconnect_ms;
    /* a trial HELLO checks the name with the wire's own rules */
    cm_proto_hello trial = {.credits = cfg->credits, .encodings = (1u << cfg->encoding) | cfg->accept};
    snprintf(trial.name, sizeof trial.name, "%s", c->name);
    uint8_t tb[CM_PROTO_SMALL_FRAME_MAX];
    size_t  tl;
    CM_TRY_GOTO(cm_proto_hello_encode(&trial, tb, sizeof tb, &tl), st, fail);
    if (cfg->curve_server_key) {
        c->curve = 1;
        CM_TRY_GOTO(cm_chan_curve_read_key(cfg->curve_server_key, c->server_key), st, fail);
        if (cfg->curve_secret_key) {
            CM_TRY_GOTO(cm_chan_curve_read_key(cfg->curve_secret_key, c->secret_key), st, fail);
            if (zmq_curve_public(c->public_key, c->secret_key) != 0) {
                st = CM_FAIL(CM_ERR_FORMAT, "key file '%s' does not hold a CURVE secret key",
                             cfg->curve_secret_key);
                goto fail;
            }
        } else {
            CM_TRY_GOTO(CM_ZMQ(zmq_curve_keypair(c->public_key, c->secret_key)), st, fail);
        }
    }
    c->n_slots = cfg->credits;
    c->slots = calloc(c->n_slots, sizeof *c->slots);
    c->ready = calloc(c->n_slots, sizeof *c->ready);
    c->pt = calloc(MAX_TENSORS, sizeof *c->pt);
    if (!c->slots || !c->ready || !c->pt) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the client's %u slots", c->n_slots);
        goto fail;
    }
    for (uint32_t i = 0; i < c->n_slots; i++) {
        c->slots[i].tensors = calloc(MAX_TENSORS, sizeof(cm_chan_tensor));
        if (!c->slots[i].tensors) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the client's slots");
            goto fail;
        }
    }
    c->lim = (cm_proto_limits){.max_tokens = UINT32_MAX,
                               .max_seqs = UINT32_MAX,
                               .max_layers = MAX_TENSORS,
                               .max_layer_id = INT32_MAX,
                               .max_tensors = MAX_TENSORS,
                               .max_body_bytes = 1u << 20,
                               .max_tensor_bytes = cfg->max_answer_bytes,
                               .max_data_bytes = cfg->max_answer_bytes};
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = cfg->n_threads;
    CM_TRY_GOTO(cm_compress_create(&c->cc, &cc), st, fail);
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot create the client's wake pipe: %s", strerror(errno));
        goto fail;
    }
    c->wake_r = fds[0];
    c->wake_w = fds[1];
    if (!(c->ctx = zmq_ctx_new())) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    if (pthread_create(&c->io, NULL, io_main, c) != 0) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot start the client's I/O thread");
        goto fail;
    }
    c->io_started = 1;
    *out = c;
    return CM_OK;
fail:
    cm_chan_client_destroy(&c);
    return st;
}

void cm_chan_client_destroy(cm_chan_client **cp) {
    if (!cp || !*cp)
        return;
    cm_chan_client *c = *cp;
    if (c->io_started) {
        atomic_store(&c->quit, 1);
        wake(c);
        pthread_join(c->io, NULL);
    }
    close_socket(c, 0);
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    if (c->slots)
        for (uint32_t i = 0; i < c->n_slots; i++) {
            slot *s = &c->slots[i];
            if (s->has_raw)
                zmq_msg_close(&s->raw);
            free(s->tokens);
            free(s->cu);
            free(s->layers);
            free(s->frame);
            free(s->tensors);
            free(s->buf);
        }
    if (c->wake_r >= 0)
        close(c->wake_r);
    if (c->wake_w >= 0)
        close(c->wake_w);
    cm_compress_destroy(&c->cc);
    memset(c->secret_key, 0, sizeof c->secret_key);
    free(c->slots);
    free(c->ready);
    free(c->pt);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    *cp = NULL;
}
