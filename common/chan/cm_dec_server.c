/* common/chan/cm_dec_server.c — the server of the decoding endpoint (cm_dec.h): a ROUTER on a thread
 * of its own, which reads DECODE frames, decodes them against the limits (refusals answered with
 * ERROR, as cm_chan's loop does), keeps a table of the clients with state (last heard from;
 * drop after idle_timeout_ms; busy beyond max_clients), runs the step callback, and encodes its
 * raw tensors straight into one reply message: the head's place is known from the names and
 * dims, so each tensor is compressed into the bytes after it, then the head is written with the
 * checksums of what was written. The thread owns the socket, the step's arrays, the compressor
 * and the reply buffer (which only grows); stop wakes it through a pipe. */
#include "cm_chan_int.h"
#include "cm_dec.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

#define DEC_MAX_CLIENTS 4096
#define DEC_NAME_MAX    (2 * IDENT_MAX + 2) /* '#', two hex digits a byte, NUL */

typedef struct dec_client {
    int     used;
    uint8_t ident[IDENT_MAX];
    size_t  ident_len;
    char    name[DEC_NAME_MAX];
    int64_t last_seen; /* the last message received from it or answer sent to it */
} dec_client;

struct cm_dec_server {
    cm_dec_server_config cfg; /* borrowed strings cleared */
    char                 endpoint[512];
    ino_t                ipc_ino;
    dev_t                ipc_dev;
    cm_proto_limits      lim; /* the decoder's: cfg.limits, layer ids bounded apart (bad-request) */
    void                *ctx, *router;
    cm_chan_zap          zap;
    cm_chan_warn         warn;
    int                  pipe_r, pipe_w;
    pthread_t            thread;
    int                  started;
    atomic_int           stop;
    dec_client          *clients;
    uint32_t             n_clients;
    cm_compress         *cc;
    cm_proto_decode      rq;          /* the step being served; its arrays the server's */
    cm_proto_tensor     *raw, *enc;   /* the callback's descriptors, the encoded ones */
    int64_t             *rows, *cols; /* of each tensor (its last dim, the product of the others) */
    uint32_t             cap_tensors;
    uint8_t             *out; /* the reply being built */
    size_t               out_cap;
};

// ----------------------------------------------------------------------------
// clients

static void client_name(const uint8_t *id, size_t n, char *out) {
    int printable = n >= 1 && n <= CM_PROTO_NAME_MAX;
    for (size_t i = 0; printable && i < n; i++)
        printable = (id[i] >= 'a' && id[i] <= 'z') || (id[i] >= 'A' && id[i] <= 'Z') ||
                    (id[i] >= '0' && id[i] <= '9') || id[i] == '_' || id[i] == '.' || id[i] == '-';
    if (printable) {
        memcpy(out, id, n);
        out[n] = '\0';
        return;
    }
    static const char hex[] = "0123456789abcdef";
    out[0] = '#';
    for (size_t i = 0; i < n; i++) {
        out[1 + 2 * i] = hex[id[i] >> 4];
        out[2 + 2 * i] = hex[id[i] & 15];
    }
    out[1 + 2 * n] = '\0';
}

static dec_client *find_client(cm_dec_server *s, const uint8_t *id, size_t n) {
    for (uint32_t i = 0; i < s->cfg.max_clients; i++) {
        dec_client *c = &s->clients[i];
        if (c->used && c->ident_len == n && memcmp(c->ident, id, n) == 0)
            return c;
    }
    return NULL;
}

/* A new client's entry, or NULL when max_clients have state. */
static dec_client *add_client(cm_dec_server *s, const uint8_t *id, size_t n, int64_t now) {
    for (uint32_t i = 0; i < s->cfg.max_clients; i++) {
        dec_client *c = &s->clients[i];
        if (c->used)
            continue;
        c->used = 1;
        memcpy(c->ident, id, n);
        c->ident_len = n;
        client_name(id, n, c->name);
        c->last_seen = now;
        s->n_clients++;
        CM_LOG_INFO("decoding endpoint: client '%s' (%u of %u)", c->name, s->n_clients, s->cfg.max_clients);
        return c;
    }
    return NULL;
}

static void drop_client(cm_dec_server *s, dec_client *c, const char *why) {
    CM_LOG_INFO("decoding endpoint: client '%s' dropped: %s", c->name, why);
    if (s->cfg.drop)
        s->cfg.drop(s->cfg.user, c->name);
    c->used = 0;
    s->n_clients--;
}

static void expire_clients(cm_dec_server *s, int64_t now) {
    for (uint32_t i = 0; i < s->cfg.max_clients; i++)
        if (s->clients[i].used && now - s->clients[i].last_seen > s->cfg.idle_timeout_ms)
            drop_client(s, &s->clients[i], "silent past the idle timeout");
}

// ----------------------------------------------------------------------------
// replies

/* ident + one part; a peer that is gone or whose queue is full loses the reply (its step then
 * times out, as a lost reply would). */
static void send_reply(cm_dec_server *s, const uint8_t *ident, size_t ident_len, const void *p, size_t len) {
    int rc = zmq_send(s->router, ident, ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    if (rc >= 0)
        rc = zmq_send(s->router, p, len, ZMQ_DONTWAIT);
    if (rc < 0 && cm_chan_warn_ok_(&s->warn))
        CM_LOG_WARN("decoding endpoint: a reply of %zu bytes is lost: %s", len,
                    zmq_errno() == EHOSTUNREACH ? "the client is gone" : zmq_strerror(zmq_errno()));
}

static void send_error(cm_dec_server *s, const uint8_t *ident, size_t ident_len, uint64_t id,
                       cm_proto_error_code code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;
static void send_error(cm_dec_server *s, const uint8_t *ident, size_t ident_len, uint64_t id,
                       cm_proto_error_code code, const char *fmt, ...) {
    uint8_t buf[CM_PROTO_SMALL_FRAME_MAX];
    size_t  len;
    va_list ap;
    va_start(ap, fmt);
    const cm_status st = cm_chan_error_frame_(buf, sizeof buf, &len, id, code, fmt, ap);
    va_end(ap);
    if (st == CM_OK)
        send_reply(s, ident, ident_len, buf, len);
}

/* A frame that failed cm_proto_peek: ERROR version when only the version differs, else corrupt
 * with the id the bytes claim. */
static void refuse_frame(cm_dec_server *s, const uint8_t *ident, size_t ident_len, const uint8_t *p,
                         size_t len, const char *why) {
    if (cm_chan_warn_ok_(&s->warn))
        CM_LOG_WARN("decoding endpoint: refused a frame (%zu bytes): %s", len, why);
    uint64_t id;
    uint16_t version;
    if (cm_proto_frame_claims(p, len, &id, &version))
        send_error(
            s, ident, ident_len, 0, CM_PROTO_ERROR_VERSION,
            "this decoding endpoint speaks protocol version %d, the frame has version %u: run matching "
            "builds",
            CM_PROTO_VERSION, (unsigned)version);
    else
        send_error(s, ident, ident_len, id, CM_PROTO_ERROR_CORRUPT, "frame refused: %s", why);
}

/* The callback's raw tensors encoded as enc into s->out (head, then the tensors); *len the
 * reply's size. CM_ERR_INVALID_ARG for what the callback got wrong. */
static cm_status encode_answer(cm_dec_server *s, const cm_proto_answer *ans, cm_encoding enc, size_t *len) {
    static const cm_proto_limits unbounded = {UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX,
                                              UINT32_MAX, UINT32_MAX, UINT64_MAX, UINT64_MAX};
    if (ans->n_tensors > s->cap_tensors)
        return CM_FAIL(CM_ERR_INVALID_ARG, "the step callback gave %u tensors, room for %u", ans->n_tensors,
                       s->cap_tensors);
    size_t bound = 0;
    for (uint32_t i = 0; i < ans->n_tensors; i++) {
        const cm_proto_tensor *t = &ans->tensors[i];
        if (t->encoding != CM_ENCODING_RAW)
            return CM_FAIL(CM_ERR_INVALID_ARG, "the step callback's tensor %u has encoding %s, not raw", i,
                           cm_encoding_name(t->encoding));
        CM_TRY(cm_proto_tensor_check(t, &unbounded, CM_ERR_INVALID_ARG, &s->rows[i], &s->cols[i]));
        if (t->raw_size && !t->data)
            return CM_FAIL(CM_ERR_INVALID_ARG, "the step callback's tensor '%s' has no data", t->name);
        size_t b = cm_compress_bound(s->cc, enc, t->dtype, s->rows[i], s->cols[i]);
        if (!b && t->raw_size)
            return CM_FAIL(CM_ERR_INVALID_ARG, "tensor '%s' (%s) cannot be encoded as %s", t->name,
                           cm_dtype_name(t->dtype), cm_encoding_name(enc));
        if (b > SIZE_MAX / 2 - bound)
            return CM_FAIL(CM_ERR_INVALID_ARG, "the answer's tensors do not fit in memory");
        bound += b;
        s->enc[i] = *t;
        s->enc[i].encoding = enc;
    }
    cm_proto_answer e = {.batch_id = ans->batch_id, .n_tensors = ans->n_tensors, .tensors = s->enc};
    size_t          head = cm_proto_answer_head_size(&e);
    if (head + bound > s->out_cap) {
        size_t   cap = head + bound + (head + bound) / 4;
        uint8_t *p = realloc(s->out, cap);
        if (!p)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for an answer", cap);
        s->out = p;
        s->out_cap = cap;
    }
    size_t off = head;
    for (uint32_t i = 0; i < e.n_tensors; i++) {
        cm_proto_tensor *t = &s->enc[i];
        size_t           n;
        CM_TRY(cm_compress_encode(s->cc, enc, t->dtype, ans->tensors[i].data, s->rows[i], s->cols[i],
                                  s->out + off, s->out_cap - off, &n));
        t->data = s->out + off;
        t->encoded_size = n;
        off += n;
    }
    size_t hl;
    CM_TRY(cm_proto_answer_encode_head(&e, s->out, head, &hl));
    CM_ASSERT(hl == head);
    *len = off;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// a DECODE

static void on_decode(cm_dec_server *s, dec_client *c, const uint8_t *ident, size_t ident_len,
                      const cm_proto_header *h, const uint8_t *p, size_t len) {
    const cm_proto_limits *L = &s->cfg.limits;
    uint32_t               N, T, nl;
    if (cm_proto_decode_counts(p, len, &N, &T, &nl) == CM_OK &&
        (N > L->max_seqs || T > L->max_tokens || nl > L->max_layers)) {
        send_error(
            s, ident, ident_len, h->id, CM_PROTO_ERROR_BAD_REQUEST,
            "step %llu has %u sequences, %u tokens and %u layers; this server takes at most %u, %u and %u",
            (unsigned long long)h->id, N, T, nl, L->max_seqs, L->max_tokens, L->max_layers);
        return;
    }
    if (cm_proto_decode_decode(p, len, &s->lim, &s->rq) != CM_OK) {
        if (cm_chan_warn_ok_(&s->warn))
            CM_LOG_WARN("decoding endpoint: refused a DECODE: %s", cm_last_error());
        send_error(s, ident, ident_len, h->id, CM_PROTO_ERROR_CORRUPT, "DECODE refused: %s", cm_last_error());
        return;
    }
    const cm_proto_decode *rq = &s->rq;
    for (uint32_t i = 0; i < rq->n_layers; i++)
        if ((uint32_t)rq->layer_ids[i] >= L->max_layer_id) {
            send_error(s, ident, ident_len, rq->id, CM_PROTO_ERROR_BAD_REQUEST,
                       "step %llu asks for layer %d; this target has layers 0 to %u",
                       (unsigned long long)rq->id, rq->layer_ids[i], L->max_layer_id - 1);
            return;
        }
    int64_t now = cm_now_ms();
    if (!c && !(c = add_client(s, ident, ident_len, now))) {
        if (cm_chan_warn_ok_(&s->warn))
            CM_LOG_WARN("decoding endpoint: refused a client: %u clients have state already",
                        s->cfg.max_clients);
        send_error(s, ident, ident_len, rq->id, CM_PROTO_ERROR_BUSY,
                   "this decoding endpoint serves at most %u clients at once; try again later",
                   s->cfg.max_clients);
        return;
    }
    cm_proto_answer ans = {.batch_id = rq->id, .tensors = s->raw, .cap_tensors = s->cap_tensors};
    memset(s->raw, 0, sizeof *s->raw * s->cap_tensors);
    cm_clear_error();
    int64_t   t0 = cm_now_ms();
    cm_status st = s->cfg.step(s->cfg.user, c->name, rq, &ans);
    size_t    n = 0;
    if (st == CM_OK) {
        ans.batch_id = rq->id;
        st = encode_answer(s, &ans, rq->encoding, &n);
        if (st != CM_OK) { /* the callback's answer: an internal failure, not the client's */
            CM_LOG_WARN("decoding endpoint: cannot encode the answer to step %llu of '%s': %s",
                        (unsigned long long)rq->id, c->name, cm_last_error());
            send_error(s, ident, ident_len, rq->id, CM_PROTO_ERROR_INTERNAL, "cannot encode the answer: %s",
                       cm_last_error());
        } else {
            send_reply(s, ident, ident_len, s->out, n);
            CM_LOG_DEBUG("decoding endpoint: step %llu of '%s' (%s, %u sequences, %u tokens) in %lld ms, %zu "
                         "bytes",
                         (unsigned long long)rq->id, c->name, rq->op == CM_DECODE_STEP ? "STEP" : "CLOSE",
                         rq->n_seqs, rq->n_tokens, (long long)(cm_now_ms() - t0), n);
        }
    } else {
        if (st != CM_ERR_INVALID_ARG)
            CM_LOG_WARN("decoding endpoint: step %llu of '%s' failed: %s", (unsigned long long)rq->id,
                        c->name, cm_last_error());
        send_error(s, ident, ident_len, rq->id,
                   st == CM_ERR_INVALID_ARG ? CM_PROTO_ERROR_BAD_REQUEST : CM_PROTO_ERROR_INTERNAL, "%s",
                   cm_last_error());
    }
    c->last_seen = cm_now_ms();
}

/* Reads one message; 0 when none was waiting. stopping: DECODEs get ERROR shutdown. */
static int handle_msg(cm_dec_server *s, int stopping) {
    zmq_msg_t fr;
    uint8_t   ident[IDENT_MAX];
    size_t    ident_len;
    int       parts;
    if (!cm_chan_recv_msg_(s->router, &fr, ident, &ident_len, &parts))
        return 0;
    const uint8_t  *p = zmq_msg_data(&fr);
    size_t          len = zmq_msg_size(&fr);
    dec_client     *c = ident_len ? find_client(s, ident, ident_len) : NULL;
    cm_proto_header h;
    if (c)
        c->last_seen = cm_now_ms();
    if (!ident_len) {
        /* nothing to answer to */
    } else if (parts != 1) {
        char why[96];
        snprintf(why, sizeof why, "a message of %d parts; a client sends one DECODE per message", parts);
        refuse_frame(s, ident, ident_len, p, parts ? len : 0, why);
    } else if (cm_proto_peek(p, len, &s->lim, &h) != CM_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", cm_last_error());
        refuse_frame(s, ident, ident_len, p, len, why);
    } else if (h.type != CM_PROTO_TYPE_DECODE) {
        send_error(s, ident, ident_len, h.id, CM_PROTO_ERROR_BAD_REQUEST,
                   "a %s frame: the decoding endpoint takes DECODE frames only", cm_proto_type_name(h.type));
    } else if (stopping) {
        send_error(s, ident, ident_len, h.id, CM_PROTO_ERROR_SHUTDOWN, "the decoding endpoint is stopping");
    } else {
        on_decode(s, c, ident, ident_len, &h, p, len);
    }
    zmq_msg_close(&fr);
    return 1;
}

static void *server_main(void *arg) {
    cm_dec_server *s = arg;
    int            tick = s->cfg.idle_timeout_ms / 4;
    tick = tick < 10 ? 10 : tick > 100 ? 100 : tick;
    while (!atomic_load(&s->stop)) {
        zmq_pollitem_t items[3] = {
            {s->router, 0, ZMQ_POLLIN, 0}, {NULL, s->pipe_r, ZMQ_POLLIN, 0}, {s->zap.sock, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, s->zap.sock ? 3 : 2, tick) < 0 && zmq_errno() != EINTR) {
            CM_LOG_ERROR("decoding endpoint: poll failed: %s; stopping", zmq_strerror(zmq_errno()));
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            char drain[16];
            while (read(s->pipe_r, drain, sizeof drain) > 0) {
            }
        }
        if (s->zap.sock && (items[2].revents & ZMQ_POLLIN))
            cm_chan_zap_handle_(&s->zap, &s->warn);
        for (int k = 0; k < RECV_BURST && !atomic_load(&s->stop) && handle_msg(s, 0); k++) {
        }
        expire_clients(s, cm_now_ms());
    }
    /* what is waiting now gets ERROR shutdown rather than silence; the clients' state goes */
    for (int k = 0; k < 4 * RECV_BURST && handle_msg(s, 1); k++) {
    }
    for (uint32_t i = 0; i < s->cfg.max_clients; i++)
        if (s->clients[i].used)
            drop_client(s, &s->clients[i], "the server stops");
    return NULL;
}

// ----------------------------------------------------------------------------
// start, stop

static cm_status check_config(const cm_dec_server_config *c) {
    const cm_proto_limits *L = &c->limits;
    if (!c->step)
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding endpoint: no step callback");
    if (c->max_clients < 1 || c->max_clients > DEC_MAX_CLIENTS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding endpoint: max_clients %u: expected 1 to %d",
                       c->max_clients, DEC_MAX_CLIENTS);
    if (c->idle_timeout_ms < 10)
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding endpoint: idle timeout %d ms: expected at least 10",
                       c->idle_timeout_ms);
    if (c->n_threads < 0 || c->n_threads > CM_COMPRESS_MAX_THREADS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "decoding endpoint: %d threads: expected 1 to %d", c->n_threads,
                       CM_COMPRESS_MAX_THREADS);
    if (L->max_seqs < 1 || L->max_tokens < 1 || L->max_tokens > (1u << 26) || L->max_seqs > (1u << 24) ||
        L->max_layers > 4096 || (L->max_layers && !L->max_layer_id) || L->max_layer_id > INT32_MAX)
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "decoding endpoint: limits of %u sequences (1 to 2^24), %u tokens (1 to 2^26), %u layers "
            "(≤ 4096) with ids below %u (≥ 1 when layers may be asked for)",
            L->max_seqs, L->max_tokens, L->max_layers, L->max_layer_id);
    return CM_OK;
}

static void server_free(cm_dec_server *s) {
    if (s->router)
        zmq_close(s->router);
    cm_chan_zap_close_(&s->zap);
    if (s->ctx)
        zmq_ctx_term(s->ctx); /* sends what is queued within the linger */
    cm_chan_unbind_file_(s->endpoint, s->ipc_ino, s->ipc_dev);
    if (s->pipe_r >= 0)
        close(s->pipe_r);
    if (s->pipe_w >= 0)
        close(s->pipe_w);
    cm_compress_destroy(&s->cc);
    free(s->clients);
    free(s->rq.seqs);
    free(s->rq.tokens);
    free(s->rq.layer_ids);
    free(s->raw);
    free(s->enc);
    free(s->rows);
    free(s->out);
    free(s);
}

cm_status cm_dec_server_start(cm_dec_server **out, const cm_dec_server_config *cfg) {
    *out = NULL;
    CM_TRY(check_config(cfg));
    CM_TRY(cm_chan_server_endpoint_check_(cfg->endpoint, cfg->curve_secret_key, cfg->curve_client_keys));
    cm_dec_server *s = calloc(1, sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the decoding endpoint");
    s->cfg = *cfg;
    s->cfg.endpoint = s->cfg.curve_secret_key = s->cfg.curve_client_keys = NULL; /* borrowed */
    s->pipe_r = s->pipe_w = -1;
    const cm_proto_limits *L = &cfg->limits;
    uint64_t body = cm_proto_decode_size(L->max_seqs, L->max_tokens, L->max_layers) - CM_PROTO_HEADER_SIZE;
    s->lim = *L;
    s->lim.max_layer_id = INT32_MAX;
    s->lim.max_body_bytes = (uint32_t)(2 * body); /* < 2^32 by check_config; counts are checked apart */
    s->cap_tensors = L->max_layers + 1;
    s->rq = (cm_proto_decode){.seqs = calloc(L->max_seqs, sizeof(cm_proto_decode_seq)),
                              .tokens = calloc(L->max_tokens, sizeof(int32_t)),
                              .layer_ids = calloc(L->max_layers + 1, sizeof(int32_t)),
                              .cap_seqs = L->max_seqs,
                              .cap_tokens = L->max_tokens,
                              .cap_layers = L->max_layers};
    s->raw = calloc(s->cap_tensors, sizeof *s->raw);
    s->enc = calloc(s->cap_tensors, sizeof *s->enc);
    s->rows = calloc(2 * (size_t)s->cap_tensors, sizeof *s->rows);
    s->cols = s->rows ? s->rows + s->cap_tensors : NULL;
    s->clients = calloc(cfg->max_clients, sizeof *s->clients);
    cm_status st = CM_OK;
    if (!s->rq.seqs || !s->rq.tokens || !s->rq.layer_ids || !s->raw || !s->enc || !s->rows || !s->clients) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the decoding endpoint's arrays for %u tokens",
                     L->max_tokens);
        goto fail;
    }
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = cfg->n_threads > 0 ? cfg->n_threads : 1;
    cc.level = cfg->zstd_level;
    CM_TRY_GOTO(cm_compress_create(&s->cc, &cc), st, fail);
    CM_TRY_GOTO(cm_chan_pipe_(&s->pipe_r, &s->pipe_w, "the decoding endpoint's pipe"), st, fail);
    /* the largest message: twice the largest DECODE, so that a step somewhat past the limits gets
     * its bad-request; a larger message makes ZeroMQ drop the connection (the client's step then
     * times out) */
    const cm_chan_listen l = {.endpoint = cfg->endpoint,
                              .curve_secret_key = cfg->curve_secret_key,
                              .curve_client_keys = cfg->curve_client_keys,
                              .what = "decoding endpoint: ",
                              .linger_ms = 1000,
                              .max_msg = (int64_t)(CM_PROTO_HEADER_SIZE + 2 * body)};
    CM_TRY_GOTO(cm_chan_listen_(&l, &s->ctx, &s->router, &s->zap, s->endpoint, sizeof s->endpoint, &s->ipc_ino,
                                &s->ipc_dev),
                st, fail);
    if (pthread_create(&s->thread, NULL, server_main, s) != 0) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot start the decoding endpoint's thread");
        goto fail;
    }
    s->started = 1;
    CM_LOG_INFO(
        "decoding endpoint on %s: up to %u clients, %u sequences and %u tokens a step, idle timeout %d ms",
        s->endpoint, s->cfg.max_clients, L->max_seqs, L->max_tokens, s->cfg.idle_timeout_ms);
    *out = s;
    return CM_OK;
fail:
    server_free(s);
    return st;
}

const char *cm_dec_server_endpoint(const cm_dec_server *s) {
    return s->endpoint;
}

void cm_dec_server_stop(cm_dec_server **sp) {
    if (!sp || !*sp)
        return;
    cm_dec_server *s = *sp;
    if (s->started) {
        atomic_store(&s->stop, 1);
        char b = 1;
        while (write(s->pipe_w, &b, 1) < 0 && errno == EINTR) {
        }
        pthread_join(s->thread, NULL);
    }
    CM_LOG_INFO("decoding endpoint on %s stopped", s->endpoint);
    server_free(s);
    *sp = NULL;
}
