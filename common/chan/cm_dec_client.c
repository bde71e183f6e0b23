/* common/chan/cm_dec_client.c — the client of the decoding endpoint (cm_dec.h): a DEALER with a
 * routing identity of its own ("dec-" and 16 random hex digits, kept across the fresh connection a
 * timeout makes, so the server keeps the client's sequences), one synchronous step at a time on
 * the owner's thread. A step is sent once, and only while a handshake with the server stands (a
 * socket monitor tells), so a step "not sent" never reaches a server later; its reply is awaited
 * until the deadline; replies of other ids are a timed-out step's and are discarded. ZMQ_IMMEDIATE
 * would say the same, but it drops a reply that arrived unread when the server closes right after
 * sending it (a stopping server, a descheduled client). The ANSWER is checked (checksums, then its
 * tensors against the request) and its tensors decoded into one 64-byte-aligned buffer the
 * client owns (grown to the largest answer, then reused). */
#include "cm_chan_int.h"
#include "cm_dec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

#define DEC_ALIGN 64

struct cm_dec_client {
    cm_dec_client_config cfg; /* borrowed strings cleared */
    char                 endpoint[512];
    char                 ident[32];
    cm_chan_curve_keys   keys;
    void                *ctx, *sock;
    void                *mon;       /* PAIR: the socket's handshake and disconnect events */
    int                  connected; /* a handshake stands, as far as the events read tell */
    unsigned             gen;       /* sockets opened: names the monitor's inproc endpoint */
    uint64_t             next_id;
    cm_compress         *cc;
    uint8_t             *frame; /* the DECODE being sent */
    size_t               frame_cap;
    cm_proto_tensor     *pt;  /* the ANSWER's descriptors, as received */
    uint8_t             *buf; /* the decoded tensors, DEC_ALIGN-aligned */
    size_t               buf_cap;
};

static void close_socket(cm_dec_client *c) {
    if (c->mon)
        zmq_close(c->mon);
    if (c->sock)
        zmq_close(c->sock); /* linger 0: what it still holds is dropped */
    c->mon = c->sock = NULL;
    c->connected = 0;
}

/* A fresh socket with the client's identity and a monitor of its handshakes, connected (the
 * connection comes up in the background). */
static cm_status open_socket(cm_dec_client *c) {
    close_socket(c);
    if (!(c->sock = zmq_socket(c->ctx, ZMQ_DEALER)))
        return CM_ZMQ(-1);
    const cm_proto_limits *L = &c->cfg.limits;
    uint64_t               max = CM_PROTO_HEADER_SIZE + (uint64_t)L->max_body_bytes + L->max_data_bytes;
    CM_TRY(cm_chan_set_int(c->sock, ZMQ_LINGER, 0));
    CM_TRY(CM_ZMQ(zmq_setsockopt(c->sock, ZMQ_ROUTING_ID, c->ident, strlen(c->ident))));
    CM_TRY(cm_chan_set_i64(c->sock, ZMQ_MAXMSGSIZE, max > INT64_MAX ? INT64_MAX : (int64_t)max));
    if (cm_chan_endpoint_ipv6_(c->endpoint))
        CM_TRY(cm_chan_set_int(c->sock, ZMQ_IPV6, 1));
    CM_TRY(cm_chan_curve_client_apply_(c->sock, &c->keys));
    char mep[64];
    snprintf(mep, sizeof mep, "inproc://dec-monitor-%u", ++c->gen);
    CM_TRY(CM_ZMQ(zmq_socket_monitor(c->sock, mep, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED)));
    if (!(c->mon = zmq_socket(c->ctx, ZMQ_PAIR)))
        return CM_ZMQ(-1);
    CM_TRY(cm_chan_set_int(c->mon, ZMQ_LINGER, 0));
    CM_TRY(CM_ZMQ(zmq_connect(c->mon, mep))); /* before the socket connects: no event is missed */
    return CM_ZMQ(zmq_connect(c->sock, c->endpoint));
}

/* Reads the monitor's waiting events: two parts each, the event number then the endpoint. */
static void read_events(cm_dec_client *c) {
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t e = 0;
        if (zmq_msg_size(&ev) >= sizeof e)
            memcpy(&e, zmq_msg_data(&ev), sizeof e);
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        while (more) {
            zmq_msg_t x;
            zmq_msg_init(&x);
            more = zmq_msg_recv(&x, c->mon, 0) >= 0 && zmq_msg_more(&x);
            zmq_msg_close(&x);
        }
        if (e == ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            c->connected = 1;
        else if (e == ZMQ_EVENT_DISCONNECTED)
            c->connected = 0;
    }
}

/* Waits until a handshake stands or the deadline passes; 1 when it stands. */
static int await_connection(cm_dec_client *c, int64_t deadline) {
    int64_t left;
    for (read_events(c); !c->connected && (left = deadline - cm_now_ms()) > 0; read_events(c)) {
        zmq_pollitem_t it = {c->mon, 0, ZMQ_POLLIN, 0};
        zmq_poll(&it, 1, (long)left);
    }
    return c->connected;
}

cm_status cm_dec_client_create(cm_dec_client **out, const cm_dec_client_config *cfg) {
    *out = NULL;
    if (cfg->timeout_ms < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding client: timeout %d ms: expected at least 1",
                       cfg->timeout_ms);
    if (cfg->limits.max_tensors < 1 || cfg->limits.max_tensors > (1u << 16))
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding client: limits.max_tensors %u: expected 1 to 65536",
                       cfg->limits.max_tensors);
    cm_dec_client *c = calloc(1, sizeof *c);
    if (!c)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the decoding client");
    cm_status st =
        cm_chan_curve_client_keys_(&c->keys, cfg->endpoint, cfg->curve_server_key, cfg->curve_secret_key);
    if (st != CM_OK) {
        free(c);
        return st;
    }
    c->cfg = *cfg;
    c->cfg.endpoint = c->cfg.curve_server_key = c->cfg.curve_secret_key = NULL; /* borrowed */
    snprintf(c->endpoint, sizeof c->endpoint, "%s", cfg->endpoint);
    snprintf(c->ident, sizeof c->ident, "dec-%016llx", (unsigned long long)cm_chan_random_u64());
    c->pt = calloc(cfg->limits.max_tensors, sizeof *c->pt);
    if (!c->pt) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the decoding client's tables");
        goto fail;
    }
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = cm_chan_default_threads();
    CM_TRY_GOTO(cm_compress_create(&c->cc, &cc), st, fail);
    if (!(c->ctx = zmq_ctx_new())) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    CM_TRY_GOTO(open_socket(c), st, fail);
    *out = c;
    return CM_OK;
fail:
    cm_dec_client_destroy(&c);
    return st;
}

void cm_dec_client_destroy(cm_dec_client **cp) {
    if (!cp || !*cp)
        return;
    cm_dec_client *c = *cp;
    close_socket(c);
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    cm_chan_curve_keys_wipe_(&c->keys);
    cm_compress_destroy(&c->cc);
    free(c->frame);
    free(c->pt);
    free(c->buf);
    free(c);
    *cp = NULL;
}

// ----------------------------------------------------------------------------
// the answer, against its request

/* What the descriptors must be before anything is decoded. */
static cm_status check_descriptors(const cm_proto_decode *rq, const cm_proto_answer *a) {
    uint32_t want = 1 + (rq->op == CM_DECODE_STEP ? rq->n_layers : 0);
    if (a->n_tensors != want)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "the answer to step %llu has %u tensors; %u expected (decode, then one per layer)",
                       (unsigned long long)rq->id, a->n_tensors, want);
    for (uint32_t i = 0; i < a->n_tensors; i++) {
        const cm_proto_tensor *t = &a->tensors[i];
        char                   name[CM_PROTO_NAME_MAX + 1];
        if (i == 0)
            snprintf(name, sizeof name, "decode");
        else
            snprintf(name, sizeof name, "layer_%d", rq->layer_ids[i - 1]);
        if (strcmp(t->name, name) != 0)
            return CM_FAIL(CM_ERR_PROTOCOL, "the answer to step %llu has tensor '%s' where '%s' belongs",
                           (unsigned long long)rq->id, t->name, name);
        if (t->encoding != rq->encoding)
            return CM_FAIL(CM_ERR_PROTOCOL, "tensor '%s' is %s; the step asked for %s", t->name,
                           cm_encoding_name(t->encoding), cm_encoding_name(rq->encoding));
        if (t->n_dims != 2)
            return CM_FAIL(CM_ERR_PROTOCOL, "tensor '%s' has %d dims, 2 expected", t->name, t->n_dims);
    }
    const cm_proto_tensor *d = &a->tensors[0];
    if (d->dtype != CM_DTYPE_I32 || d->shape[0] != rq->n_seqs || d->shape[1] != 4)
        return CM_FAIL(CM_ERR_PROTOCOL, "tensor 'decode' is %s [%lld, %lld]; I32 [%u, 4] expected",
                       cm_dtype_name(d->dtype), (long long)d->shape[0], (long long)d->shape[1], rq->n_seqs);
    return CM_OK;
}

/* What the decoded "decode" tensor must say of each sequence, and the layers' rows. */
static cm_status check_values(const cm_proto_decode *rq, const cm_proto_answer *a, const int32_t *d) {
    uint64_t rows = 0;
    for (uint32_t i = 0; i < rq->n_seqs; i++, d += 4) {
        const cm_proto_decode_seq *q = &rq->seqs[i];
        uint32_t                   handle = (uint32_t)d[0];
        int                        ok;
        if (rq->op == CM_DECODE_CLOSE) {
            ok = handle == q->handle && d[1] == 0 && d[2] == 0 && d[3] == -1;
        } else {
            uint64_t committed = (uint64_t)q->base + q->n_ctx + (uint64_t)(d[2] > 0 ? d[2] : 0);
            ok = (q->handle ? handle == q->handle : handle != 0) && d[2] >= 0 &&
                 (uint32_t)d[2] <= q->n_draft && (uint32_t)d[1] == (uint32_t)committed && d[3] >= 0;
            rows += q->n_ctx + (uint64_t)(d[2] > 0 ? d[2] : 0);
        }
        if (!ok)
            return CM_FAIL(
                CM_ERR_PROTOCOL,
                "the answer to step %llu says (%u, %d, %d, %d) of sequence %u (handle %u, base %u, "
                "%u + %u tokens), which does not fit the step",
                (unsigned long long)rq->id, handle, d[1], d[2], d[3], i, q->handle, q->base, q->n_ctx,
                q->n_draft);
    }
    for (uint32_t i = 1; i < a->n_tensors; i++)
        if ((uint64_t)a->tensors[i].shape[0] != rows)
            return CM_FAIL(CM_ERR_PROTOCOL, "tensor '%s' has %lld rows; the committed tokens are %llu",
                           a->tensors[i].name, (long long)a->tensors[i].shape[0], (unsigned long long)rows);
    return CM_OK;
}

static cm_status on_answer(cm_dec_client *c, const cm_proto_decode *rq, const uint8_t *p, size_t len,
                           cm_proto_answer *ans) {
    cm_proto_answer a = {.tensors = c->pt, .cap_tensors = c->cfg.limits.max_tensors};
    if (cm_proto_answer_decode(p, len, &c->cfg.limits, &a) != CM_OK)
        return CM_FAIL(CM_ERR_PROTOCOL, "the answer to step %llu from %s is refused: %s",
                       (unsigned long long)rq->id, c->endpoint, cm_last_error());
    CM_TRY(check_descriptors(rq, &a));
    if (a.n_tensors > ans->cap_tensors || !ans->tensors)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the caller's array holds %u tensors, the answer has %u",
                       ans->cap_tensors, a.n_tensors);
    size_t total = 0;
    for (uint32_t i = 0; i < a.n_tensors; i++) {
        size_t r = (size_t)a.tensors[i].raw_size; /* ≤ limits.max_tensor_bytes (decode checked) */
        if (r > SIZE_MAX / 2 - total - DEC_ALIGN)
            return CM_FAIL(CM_ERR_PROTOCOL, "the answer's tensors do not fit in memory");
        total += (r + DEC_ALIGN - 1) / DEC_ALIGN * DEC_ALIGN;
    }
    if (total > c->buf_cap) {
        void *b = NULL;
        if (posix_memalign(&b, DEC_ALIGN, total) != 0)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for an answer's tensors", total);
        free(c->buf);
        c->buf = b;
        c->buf_cap = total;
    }
    size_t off = 0;
    for (uint32_t i = 0; i < a.n_tensors; i++) {
        const cm_proto_tensor *t = &a.tensors[i];
        if (cm_compress_decode_tensor(c->cc, t, c->buf + off, (size_t)t->raw_size) != CM_OK)
            return CM_FAIL(CM_ERR_PROTOCOL, "tensor '%s' of the answer to step %llu does not decode: %s",
                           t->name, (unsigned long long)rq->id, cm_last_error());
        ans->tensors[i] = *t;
        ans->tensors[i].encoding = CM_ENCODING_RAW;
        ans->tensors[i].encoded_size = t->raw_size;
        ans->tensors[i].checksum = 0;
        ans->tensors[i].data = c->buf + off;
        off += ((size_t)t->raw_size + DEC_ALIGN - 1) / DEC_ALIGN * DEC_ALIGN;
    }
    CM_TRY(check_values(rq, &a, (const int32_t *)c->buf));
    ans->batch_id = a.batch_id;
    ans->n_tensors = a.n_tensors;
    return CM_OK;
}

static cm_status on_error(cm_dec_client *c, const uint8_t *p, size_t len) {
    cm_proto_error e;
    if (cm_proto_error_decode(p, len, &c->cfg.limits, &e) != CM_OK)
        return CM_FAIL(CM_ERR_PROTOCOL, "a malformed ERROR from the decoding server at %s: %s", c->endpoint,
                       cm_last_error());
    cm_status st = e.code == CM_PROTO_ERROR_BAD_REQUEST                                   ? CM_ERR_INVALID_ARG
                   : e.code == CM_PROTO_ERROR_CORRUPT || e.code == CM_PROTO_ERROR_VERSION ? CM_ERR_PROTOCOL
                                                                                          : CM_ERR_PEER_GONE;
    return CM_FAIL(st, "decoding server at %s: %s: %s", c->endpoint, cm_proto_error_name(e.code), e.message);
}

// ----------------------------------------------------------------------------
// a step

cm_status cm_dec_client_step(cm_dec_client *c, cm_proto_decode *rq, cm_proto_answer *ans) {
    if (!c || !rq || !ans)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_dec_client_step: no client, step or answer");
    rq->id = ++c->next_id;
    size_t need = cm_proto_decode_size(rq->n_seqs, rq->n_tokens, rq->n_layers), len;
    if (need > c->frame_cap) {
        uint8_t *f = realloc(c->frame, need);
        if (!f)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a DECODE of %zu bytes", need);
        c->frame = f;
        c->frame_cap = need;
    }
    CM_TRY(cm_proto_decode_encode(rq, c->frame, c->frame_cap, &len));
    int64_t        deadline = cm_now_ms() + c->cfg.timeout_ms;
    int64_t        left;
    if (!await_connection(c, deadline) || zmq_send(c->sock, c->frame, len, ZMQ_DONTWAIT) < 0)
        return CM_FAIL(CM_ERR_TIMEOUT, "no decoding server at %s within %d ms; step %llu not sent",
                       c->endpoint, c->cfg.timeout_ms, (unsigned long long)rq->id);
    for (;;) {
        zmq_pollitem_t in = {c->sock, 0, ZMQ_POLLIN, 0};
        if ((left = deadline - cm_now_ms()) <= 0 || zmq_poll(&in, 1, (long)left) < 0 ||
            !(in.revents & ZMQ_POLLIN)) {
            if (left > 0)
                continue;                  /* EINTR */
            cm_status st = open_socket(c); /* a late reply, or the step still queued, must not come later */
            if (st != CM_OK)
                CM_LOG_WARN("decoding client: cannot reconnect to %s: %s", c->endpoint, cm_last_error());
            return CM_FAIL(
                CM_ERR_TIMEOUT,
                "no answer to step %llu from the decoding server at %s within %d ms: the step may or "
                "may not have run (the next step's base tells)",
                (unsigned long long)rq->id, c->endpoint, c->cfg.timeout_ms);
        }
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->sock, 0) < 0) {
            zmq_msg_close(&m);
            continue; /* EINTR */
        }
        int more = zmq_msg_more(&m), parts = 1;
        while (more) {
            zmq_msg_t x;
            zmq_msg_init(&x);
            more = zmq_msg_recv(&x, c->sock, 0) >= 0 && zmq_msg_more(&x);
            zmq_msg_close(&x);
            parts++;
        }
        const uint8_t  *p = zmq_msg_data(&m);
        size_t          n = zmq_msg_size(&m);
        cm_proto_header h;
        cm_status       st;
        if (parts != 1) {
            st = CM_FAIL(CM_ERR_PROTOCOL, "a reply of %d parts from the decoding server at %s; one expected",
                         parts, c->endpoint);
        } else if (cm_proto_peek(p, n, &c->cfg.limits, &h) != CM_OK) {
            st = CM_FAIL(CM_ERR_PROTOCOL, "a reply from the decoding server at %s is refused: %s",
                         c->endpoint, cm_last_error());
        } else if (h.id != rq->id && !(h.type == CM_PROTO_TYPE_ERROR && h.id == 0)) {
            CM_LOG_DEBUG("decoding client: discarded a %s for step %llu (waiting for %llu)",
                         cm_proto_type_name(h.type), (unsigned long long)h.id, (unsigned long long)rq->id);
            zmq_msg_close(&m);
            continue;
        } else if (h.type == CM_PROTO_TYPE_ERROR) {
            st = on_error(c, p, n);
        } else if (h.type == CM_PROTO_TYPE_ANSWER) {
            st = on_answer(c, rq, p, n, ans);
        } else {
            st = CM_FAIL(CM_ERR_PROTOCOL,
                         "a %s frame from the decoding server at %s; ANSWER or ERROR expected",
                         cm_proto_type_name(h.type), c->endpoint);
        }
        zmq_msg_close(&m);
        return st;
    }
}
