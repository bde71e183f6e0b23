/* common/cm_chan_server.c — the target-server's session loop (see cm_chan.h). The loop thread
 * owns the ROUTER (and the ZAP socket when client keys are configured): it validates every
 * frame, keeps one session per routing identity (HELLO opens or replaces it; BYE, silence
 * past the peer timeout or an unreachable peer ends it and drops its queued requests), queues
 * at most `credits` requests per session (duplicates of a queued or running id are ignored),
 * sends heartbeats and hands one job at a time to the worker, round-robin over the sessions
 * that have work. The worker runs the compute callback, converts, compresses into a pooled
 * buffer and posts the result through a pipe; the loop sends it, DATA zero-copy (ZeroMQ hands
 * the buffer back to the pool when it is on the wire). Nothing from a peer is trusted: sizes
 * are bounded by ZMQ_MAXMSGSIZE and cm_proto_limits before anything is used. */
#include "cm_chan_int.h"

#include <dirent.h>
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

#include "cm_compress.h"
#include "cm_log.h"

#define POOL_MAX        64  /* pooled answer buffers; beyond that an answer gets a one-off buffer */
#define IDENT_MAX       255 /* ZeroMQ routing ids are 1..255 bytes */
#define MAX_CLIENT_KEYS 4096
#define RECV_BURST      256 /* messages read per loop turn before timers and results get a turn */
#define WARN_BURST      20  /* warnings about bad frames per 10 s, then they are counted and summarised */

typedef struct pool_buf {
    atomic_int busy; /* 1 from acquisition (worker) until ZeroMQ frees the message (I/O thread) */
    uint8_t   *data;
    size_t     cap;
} pool_buf;

typedef struct qjob {
    zmq_msg_t msg; /* the REQUEST frame, validated */
    uint64_t  id;
} qjob;

typedef struct session {
    int      used;
    uint8_t  ident[IDENT_MAX];
    size_t   ident_len;
    char     name[CM_PROTO_NAME_MAX + 1];
    char     peer[64];
    uint64_t gen; /* unique per HELLO: a result for an older generation is discarded */
    uint32_t credits, encodings;
    qjob    *queue; /* ring of cfg.credits */
    uint32_t q_head, q_len;
    int      computing;
    uint64_t computing_id;
    int64_t  last_recv, last_send, started, last_stats;
    uint64_t n_requests, n_resends, n_answers, n_errors, bytes, tokens;
} session;

/* The worker's mailbox: one job in, one result out, under mu. */
typedef struct work {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             have_job, quit, done, init_done;
    cm_status       init_status;
    char            init_msg[1024];
    /* job */
    zmq_msg_t msg;
    char      session[CM_PROTO_NAME_MAX + 1];
    int       sess;
    uint64_t  gen;
    /* result */
    int       is_answer;
    uint64_t  id;
    uint32_t  n_tokens;
    uint8_t  *head;
    size_t    head_len, head_cap;
    pool_buf *data; /* NULL: data_oneoff */
    uint8_t  *data_oneoff;
    size_t    data_len;
    uint8_t   err[CM_PROTO_SMALL_FRAME_MAX];
    size_t    err_len;
} work;

struct cm_chan_server {
    cm_chan_server_config cfg;
    char                  endpoint[512];
    char                  name[CM_PROTO_NAME_MAX + 1];
    cm_proto_limits       lim;
    void                 *ctx, *router, *zap;
    uint8_t (*client_keys)[32];
    int        n_client_keys;
    char       client_keys_dir[1024];
    atomic_int stop;
    int        stopping, ran, worker_busy, worker_started;
    int        pipe_r, pipe_w;
    pthread_t  worker;
    work       w;
    session   *sessions;
    uint32_t   rr;
    uint64_t   gen_counter, hb_seq;
    /* loop thread: request decoding scratch */
    int32_t *l_tokens, *l_cu, *l_layers;
    /* worker thread */
    int32_t         *w_tokens, *w_cu, *w_layers;
    float           *out_block;
    size_t           out_cap; /* floats */
    void           **out_ptrs;
    uint8_t         *conv; /* hidden-dtype scratch of T·D */
    size_t           conv_cap;
    cm_proto_tensor *tensors;
    cm_compress     *cc;
    pool_buf         pool[POOL_MAX];
    int              n_pool;
    /* warnings */
    int64_t warn_window;
    int     warn_count, warn_suppressed;
    /* stats */
    pthread_mutex_t      stats_mu;
    cm_chan_server_stats stats;
};

// ----------------------------------------------------------------------------
// small helpers

static int warn_ok(cm_chan_server *s) {
    int64_t now = cm_chan_now_ms();
    if (now - s->warn_window > 10000) {
        if (s->warn_suppressed)
            CM_LOG_WARN("%d more refused frames in the last 10 s (not logged)", s->warn_suppressed);
        s->warn_window = now;
        s->warn_count = 0;
        s->warn_suppressed = 0;
    }
    if (s->warn_count++ < WARN_BURST)
        return 1;
    s->warn_suppressed++;
    return 0;
}

#define STAT_ADD(s, field, v)                                                                                \
    do {                                                                                                     \
        pthread_mutex_lock(&(s)->stats_mu);                                                                  \
        (s)->stats.field += (v);                                                                             \
        pthread_mutex_unlock(&(s)->stats_mu);                                                                \
    } while (0)

static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_le64(const uint8_t *p) {
    return (uint64_t)get_le32(p) | (uint64_t)get_le32(p + 4) << 32;
}

static const char *sess_label(const session *ss) {
    return ss ? ss->name : "(no session)";
}

static void data_free(void *data, void *hint) {
    if (hint)
        atomic_store(&((pool_buf *)hint)->busy, 0);
    else
        free(data);
}

/* Sends identity + one part. CM_ERR_PEER_GONE when the peer is not connected, CM_ERR_TIMEOUT
 * when its queue is full (the frame is dropped), CM_ERR_ZMQ otherwise. */
static cm_status send_to(cm_chan_server *s, const uint8_t *ident, size_t ident_len, const void *frame,
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

static cm_status send_error(cm_chan_server *s, const uint8_t *ident, size_t ident_len, uint64_t id,
                            cm_proto_error_code code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;

static cm_status send_error(cm_chan_server *s, const uint8_t *ident, size_t ident_len, uint64_t id,
                            cm_proto_error_code code, const char *fmt, ...) {
    cm_proto_error e = {.batch_id = id, .code = code};
    char           text[1024];
    va_list        ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    cm_chan_error_text(e.message, text);
    uint8_t buf[CM_PROTO_SMALL_FRAME_MAX];
    size_t  len;
    CM_TRY(cm_proto_error_encode(&e, buf, sizeof buf, &len));
    STAT_ADD(s, errors_sent, 1);
    return send_to(s, ident, ident_len, buf, len);
}

static cm_status send_bye(cm_chan_server *s, const uint8_t *ident, size_t ident_len) {
    uint8_t buf[CM_PROTO_HEADER_SIZE];
    size_t  len;
    CM_TRY(cm_proto_bye_encode(buf, sizeof buf, &len));
    return send_to(s, ident, ident_len, buf, len);
}

// ----------------------------------------------------------------------------
// sessions

static session *find_session(cm_chan_server *s, const uint8_t *ident, size_t len) {
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        session *ss = &s->sessions[i];
        if (ss->used && ss->ident_len == len && memcmp(ss->ident, ident, len) == 0)
            return ss;
    }
    return NULL;
}

static void log_session(const session *ss, const char *what, int64_t now) {
    double secs = (double)(now - ss->started) / 1000.0;
    CM_LOG_INFO(
        "session '%s' from %s %s: %llu requests (%llu re-sent), %llu answers, %llu errors, %.1f MB sent, "
        "%.0f tokens/s over %.1f s",
        ss->name, ss->peer, what, (unsigned long long)ss->n_requests, (unsigned long long)ss->n_resends,
        (unsigned long long)ss->n_answers, (unsigned long long)ss->n_errors, (double)ss->bytes / 1e6,
        secs > 0 ? (double)ss->tokens / secs : 0.0, secs);
}

static uint32_t drop_queue(cm_chan_server *s, session *ss) {
    uint32_t n = ss->q_len;
    for (uint32_t k = 0; k < ss->q_len; k++)
        zmq_msg_close(&ss->queue[(ss->q_head + k) % s->cfg.credits].msg);
    ss->q_head = ss->q_len = 0;
    if (n)
        STAT_ADD(s, dropped_jobs, n);
    return n;
}

typedef enum end_reason { END_BYE, END_TIMEOUT, END_REPLACED, END_UNREACHABLE, END_STOP } end_reason;

static void end_session(cm_chan_server *s, session *ss, end_reason why) {
    static const char *what[] = {"said bye", "timed out", "was replaced by a new HELLO", "is unreachable",
                                 "ended: the server is stopping"};
    int64_t            now = cm_chan_now_ms();
    uint32_t           n = drop_queue(s, ss);
    log_session(ss, what[why], now);
    if (n || ss->computing)
        CM_LOG_INFO("session '%s': dropped %u queued requests%s", ss->name, n,
                    ss->computing ? " and the answer being computed" : "");
    pthread_mutex_lock(&s->stats_mu);
    if (why == END_BYE)
        s->stats.sessions_bye++;
    if (why == END_TIMEOUT)
        s->stats.sessions_timed_out++;
    if (why == END_REPLACED)
        s->stats.sessions_replaced++;
    if (why == END_UNREACHABLE)
        s->stats.sessions_unreachable++;
    s->stats.sessions_active--;
    pthread_mutex_unlock(&s->stats_mu);
    ss->used = 0;
    ss->computing = 0;
}

// ----------------------------------------------------------------------------
// incoming frames

static void on_hello(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len, zmq_msg_t *fr) {
    cm_proto_hello h;
    if (cm_proto_hello_decode(zmq_msg_data(fr), zmq_msg_size(fr), &s->lim, &h) != CM_OK) {
        STAT_ADD(s, bad_frames, 1);
        if (warn_ok(s))
            CM_LOG_WARN("refused a HELLO: %s", cm_last_error());
        send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_CORRUPT, "HELLO refused: %s", cm_last_error());
        return;
    }
    if (s->stopping) {
        send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_SHUTDOWN, "the target-server is stopping");
        return;
    }
    if (h.target_id && h.target_id != s->cfg.target_id) {
        CM_LOG_WARN("refused trainer '%s': it asks for target %016llx, this server serves %016llx", h.name,
                    (unsigned long long)h.target_id, (unsigned long long)s->cfg.target_id);
        send_error(
            s, ident, ident_len, 0, CM_PROTO_ERROR_TARGET_MISMATCH,
            "target-server '%s' serves target %016llx, not %016llx: connect to the server of the target the "
            "drafter is trained for",
            s->name, (unsigned long long)s->cfg.target_id, (unsigned long long)h.target_id);
        return;
    }
    uint32_t enc = h.encodings & s->cfg.encodings;
    if (!enc) {
        send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                   "no common encoding: the server offers mask 0x%x, the trainer accepts 0x%x",
                   s->cfg.encodings, h.encodings);
        return;
    }
    if (ss) {
        end_session(s, ss, END_REPLACED);
    } else {
        for (uint32_t i = 0; i < s->cfg.max_sessions && !ss; i++)
            if (!s->sessions[i].used && !s->sessions[i].computing)
                ss = &s->sessions[i];
        if (!ss) {
            send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_BUSY,
                       "the server has its maximum of %u sessions", s->cfg.max_sessions);
            return;
        }
    }
    qjob   *queue = ss->queue;
    int64_t now = cm_chan_now_ms();
    *ss = (session){.used = 1,
                    .ident_len = ident_len,
                    .gen = ++s->gen_counter,
                    .queue = queue,
                    .credits = h.credits < s->cfg.credits ? h.credits : s->cfg.credits,
                    .encodings = enc,
                    .last_recv = now,
                    .last_send = now,
                    .started = now,
                    .last_stats = now};
    memcpy(ss->ident, ident, ident_len);
    snprintf(ss->name, sizeof ss->name, "%s", h.name);
    const char *peer = zmq_msg_gets(fr, "Peer-Address");
    snprintf(ss->peer, sizeof ss->peer, "%s", peer && *peer ? peer : "a local socket");
    cm_proto_welcome wm = {.target_id = s->cfg.target_id,
                           .version = CM_PROTO_VERSION,
                           .hidden_dtype = s->cfg.hidden_dtype,
                           .hidden_size = s->cfg.hidden_size,
                           .n_layers = s->cfg.n_layers,
                           .max_tokens = s->cfg.max_tokens,
                           .credits = ss->credits,
                           .encodings = enc};
    snprintf(wm.name, sizeof wm.name, "%s", s->name);
    uint8_t   buf[CM_PROTO_SMALL_FRAME_MAX];
    size_t    len;
    cm_status st = cm_proto_welcome_encode(&wm, buf, sizeof buf, &len);
    if (st == CM_OK)
        st = send_to(s, ident, ident_len, buf, len);
    pthread_mutex_lock(&s->stats_mu);
    s->stats.sessions_opened++;
    s->stats.sessions_active++;
    pthread_mutex_unlock(&s->stats_mu);
    if (st != CM_OK) {
        CM_LOG_WARN("cannot welcome trainer '%s': %s", ss->name, cm_last_error());
        end_session(s, ss, END_UNREACHABLE);
        return;
    }
    CM_LOG_INFO("session '%s' from %s on %s: %u credits (asked %u), encodings 0x%x", ss->name, ss->peer,
                s->endpoint, ss->credits, h.credits, enc);
}

static void on_request(cm_chan_server *s, session *ss, const cm_proto_header *h, zmq_msg_t *fr) {
    const uint8_t *p = zmq_msg_data(fr);
    if (s->stopping) {
        send_error(s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_SHUTDOWN,
                   "the target-server is stopping");
        return;
    }
    if (h->body_len >= 16 && zmq_msg_size(fr) >= CM_PROTO_HEADER_SIZE + 16) {
        /* sizes first, so an oversized batch is a bad request, not a corrupt frame */
        uint32_t T = get_le32(p + CM_PROTO_HEADER_SIZE + 4), L = get_le32(p + CM_PROTO_HEADER_SIZE + 12);
        if (T > s->cfg.max_tokens || L > s->cfg.max_req_layers) {
            send_error(
                s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_BAD_REQUEST,
                "batch %llu has %u tokens and %u layers; this server takes at most %u tokens (--max-tokens) "
                "and %u layers per request",
                (unsigned long long)h->id, T, L, s->cfg.max_tokens, s->cfg.max_req_layers);
            return;
        }
    }
    cm_proto_request rq = {.tokens = s->l_tokens,
                           .cu_seqlens = s->l_cu,
                           .layer_ids = s->l_layers,
                           .cap_tokens = s->cfg.max_tokens,
                           .cap_cu_seqlens = s->cfg.max_tokens + 1,
                           .cap_layers = s->cfg.max_req_layers};
    if (cm_proto_request_decode(p, zmq_msg_size(fr), &s->lim, &rq) != CM_OK) {
        STAT_ADD(s, bad_frames, 1);
        if (warn_ok(s))
            CM_LOG_WARN("session '%s': refused a REQUEST: %s", ss->name, cm_last_error());
        send_error(s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_CORRUPT, "REQUEST refused: %s",
                   cm_last_error());
        return;
    }
    if (!(ss->encodings >> rq.encoding & 1u)) {
        send_error(s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_BAD_REQUEST,
                   "batch %llu asks for encoding %s, which this session did not agree on (mask 0x%x)",
                   (unsigned long long)rq.batch_id, cm_encoding_name(rq.encoding), ss->encodings);
        return;
    }
    for (uint32_t i = 0; i < rq.n_layers; i++)
        if ((uint32_t)rq.layer_ids[i] >= s->cfg.n_layers) {
            send_error(s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_BAD_REQUEST,
                       "batch %llu asks for layer %d; the target has layers 0..%u",
                       (unsigned long long)rq.batch_id, rq.layer_ids[i], s->cfg.n_layers - 1);
            return;
        }
    int dup = ss->computing && ss->computing_id == rq.batch_id;
    for (uint32_t k = 0; k < ss->q_len && !dup; k++)
        dup = ss->queue[(ss->q_head + k) % s->cfg.credits].id == rq.batch_id;
    if (dup) {
        STAT_ADD(s, duplicates, 1);
        return;
    }
    if (ss->q_len + (uint32_t)ss->computing >= ss->credits) {
        send_error(s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_NO_CREDIT,
                   "batch %llu exceeds the %u credits of this session", (unsigned long long)rq.batch_id,
                   ss->credits);
        return;
    }
    qjob *j = &ss->queue[(ss->q_head + ss->q_len) % s->cfg.credits];
    zmq_msg_init(&j->msg);
    zmq_msg_move(&j->msg, fr);
    j->id = rq.batch_id;
    ss->q_len++;
    ss->n_requests++;
    if (rq.flags & CM_PROTO_FLAG_RESEND)
        ss->n_resends++;
    pthread_mutex_lock(&s->stats_mu);
    s->stats.requests++;
    if (rq.flags & CM_PROTO_FLAG_RESEND)
        s->stats.resends++;
    if (ss->q_len + (uint32_t)ss->computing > s->stats.max_queue)
        s->stats.max_queue = ss->q_len + (uint32_t)ss->computing;
    pthread_mutex_unlock(&s->stats_mu);
}

/* Refuses a frame that failed cm_proto_peek: ERROR version when only the version differs,
 * else ERROR corrupt with the id the bytes claim (the trainer re-sends that batch if it waits
 * for it; requests are idempotent, so a wrong guess costs one forward). */
static void refuse_frame(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len,
                         const uint8_t *p, size_t len, const char *why) {
    STAT_ADD(s, bad_frames, 1);
    if (warn_ok(s))
        CM_LOG_WARN("refused a frame from %s (%zu bytes): %s", sess_label(ss), len, why);
    uint64_t id = len >= 24 ? get_le64(p + 16) : 0;
    if (len >= 6 && get_le32(p) == CM_PROTO_MAGIC && (p[4] | p[5] << 8) != CM_PROTO_VERSION)
        send_error(
            s, ident, ident_len, 0, CM_PROTO_ERROR_VERSION,
            "this target-server speaks protocol version %d, the frame has version %u: run matching builds",
            CM_PROTO_VERSION, (unsigned)(p[4] | p[5] << 8));
    else
        send_error(s, ident, ident_len, id, CM_PROTO_ERROR_CORRUPT, "frame refused: %s", why);
}

/* Reads one message from the ROUTER; 0 when none was waiting. */
static int handle_msg(cm_chan_server *s) {
    zmq_msg_t idm, fr;
    zmq_msg_init(&idm);
    zmq_msg_init(&fr);
    if (zmq_msg_recv(&idm, s->router, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&idm);
        zmq_msg_close(&fr);
        return 0;
    }
    int parts = 0;
    int more = zmq_msg_more(&idm);
    if (more && zmq_msg_recv(&fr, s->router, 0) >= 0) {
        parts = 1;
        more = zmq_msg_more(&fr);
    }
    while (more) { /* drain extra parts: a trainer sends one part per frame */
        zmq_msg_t x;
        zmq_msg_init(&x);
        if (zmq_msg_recv(&x, s->router, 0) < 0)
            more = 0;
        else
            more = zmq_msg_more(&x);
        zmq_msg_close(&x);
        parts++;
    }
    uint8_t ident[IDENT_MAX];
    size_t  ident_len = zmq_msg_size(&idm) <= IDENT_MAX ? zmq_msg_size(&idm) : IDENT_MAX;
    memcpy(ident, zmq_msg_data(&idm), ident_len);
    zmq_msg_close(&idm);
    session       *ss = ident_len ? find_session(s, ident, ident_len) : NULL;
    const uint8_t *p = zmq_msg_data(&fr);
    size_t         len = zmq_msg_size(&fr);
    if (ss)
        ss->last_recv = cm_chan_now_ms();
    cm_proto_header h;
    if (!ident_len) {
        /* nothing to answer to */
    } else if (parts != 1) {
        char why[96];
        snprintf(why, sizeof why, "a message of %d parts; a trainer sends one frame per message", parts);
        refuse_frame(s, ss, ident, ident_len, p, parts ? len : 0, why);
    } else if (cm_proto_peek(p, len, &s->lim, &h) != CM_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", cm_last_error());
        refuse_frame(s, ss, ident, ident_len, p, len, why);
    } else if (h.type == CM_PROTO_TYPE_HELLO) {
        on_hello(s, ss, ident, ident_len, &fr);
    } else if (!ss) {
        /* no session (the server restarted, or the session timed out): BYE makes the trainer
         * say HELLO again and re-send what it waits for */
        if (h.type != CM_PROTO_TYPE_BYE)
            send_bye(s, ident, ident_len);
    } else if (h.type == CM_PROTO_TYPE_REQUEST) {
        on_request(s, ss, &h, &fr);
    } else if (h.type == CM_PROTO_TYPE_HEARTBEAT) {
        uint64_t seq;
        if (cm_proto_heartbeat_decode(p, len, &s->lim, &seq) != CM_OK)
            refuse_frame(s, ss, ident, ident_len, p, len, cm_last_error());
    } else if (h.type == CM_PROTO_TYPE_BYE) {
        if (cm_proto_bye_decode(p, len, &s->lim) != CM_OK)
            refuse_frame(s, ss, ident, ident_len, p, len, cm_last_error());
        else
            end_session(s, ss, END_BYE);
    } else if (h.type == CM_PROTO_TYPE_ERROR) {
        cm_proto_error e;
        if (cm_proto_error_decode(p, len, &s->lim, &e) == CM_OK)
            CM_LOG_WARN("session '%s' reports %s for batch %llu: %s", ss->name, cm_proto_error_name(e.code),
                        (unsigned long long)e.batch_id, e.message);
        else
            refuse_frame(s, ss, ident, ident_len, p, len, cm_last_error());
    } else {
        char why[96];
        snprintf(why, sizeof why, "a %s frame; trainers send HELLO, REQUEST, HEARTBEAT, BYE",
                 cm_proto_type_name(h.type));
        refuse_frame(s, ss, ident, ident_len, p, len, why);
    }
    zmq_msg_close(&fr);
    return 1;
}

// ----------------------------------------------------------------------------
// ZAP: which CURVE clients may connect

static void zap_reply(cm_chan_server *s, zmq_msg_t *req_id, const char *code, const char *text) {
    zmq_send(s->zap, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(s->zap, zmq_msg_data(req_id), zmq_msg_size(req_id), ZMQ_SNDMORE);
    zmq_send(s->zap, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(s->zap, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(s->zap, "", 0, ZMQ_SNDMORE);
    zmq_send(s->zap, "", 0, 0);
}

static void handle_zap(cm_chan_server *s) {
    zmq_msg_t part[8];
    int       n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->zap, n ? 0 : ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 8)
            part[n++] = m;
        else
            zmq_msg_close(&m);
    }
    if (n == 0)
        return;
    /* version, request id, domain, address, routing id, mechanism, credentials... */
    if (n < 6) {
        zmq_msg_t none;
        zmq_msg_init(&none);
        zap_reply(s, n > 1 ? &part[1] : &none, "500", "malformed ZAP request");
        zmq_msg_close(&none);
    } else {
        int         allowed = 0;
        const char *mech = zmq_msg_data(&part[5]);
        if (n >= 7 && zmq_msg_size(&part[5]) == 5 && memcmp(mech, "CURVE", 5) == 0 &&
            zmq_msg_size(&part[6]) == 32)
            for (int k = 0; k < s->n_client_keys && !allowed; k++)
                allowed = memcmp(s->client_keys[k], zmq_msg_data(&part[6]), 32) == 0;
        char addr[64];
        snprintf(addr, sizeof addr, "%.*s", (int)(zmq_msg_size(&part[3]) < 63 ? zmq_msg_size(&part[3]) : 63),
                 (const char *)zmq_msg_data(&part[3]));
        if (allowed) {
            zap_reply(s, &part[1], "200", "OK");
        } else {
            char key[CM_CHAN_KEY_LEN + 1] = "?";
            if (n >= 7 && zmq_msg_size(&part[6]) == 32)
                zmq_z85_encode(key, zmq_msg_data(&part[6]), 32);
            if (warn_ok(s))
                CM_LOG_WARN("refused a CURVE client from %s: its public key %s is not in '%s'", addr, key,
                            s->client_keys_dir);
            zap_reply(s, &part[1], "400", "client key not accepted");
        }
    }
    for (int k = 0; k < n; k++)
        zmq_msg_close(&part[k]);
}

// ----------------------------------------------------------------------------
// the worker

static void notify_loop(cm_chan_server *s) {
    char b = 1;
    while (write(s->pipe_w, &b, 1) < 0 && errno == EINTR) {
    }
}

typedef struct conv_part {
    void       *dst;
    const void *src;
    cm_dtype    dt;
    size_t      n;
} conv_part;

static void *conv_thread(void *arg) {
    conv_part *c = arg;
    cm_convert(c->dst, c->dt, c->src, CM_DTYPE_F32, c->n);
    return NULL;
}

/* F32 → dt on up to n_threads threads (the caller's included). */
static void convert_parallel(void *dst, cm_dtype dt, const float *src, size_t n, int n_threads) {
    enum { MAXT = 64 };
    int t = n_threads < MAXT ? n_threads : MAXT;
    if (n < ((size_t)1 << 20) || t < 2) {
        cm_convert(dst, dt, src, CM_DTYPE_F32, n);
        return;
    }
    pthread_t th[MAXT];
    conv_part cp[MAXT];
    int       started[MAXT] = {0};
    size_t    per = (n + (size_t)t - 1) / (size_t)t, es = cm_dtype_size(dt);
    for (int i = 0; i < t; i++) {
        size_t lo = (size_t)i * per, hi = lo + per < n ? lo + per : n;
        cp[i] = (conv_part){(uint8_t *)dst + lo * es, src + lo, dt, lo < hi ? hi - lo : 0};
        if (i > 0)
            started[i] = pthread_create(&th[i], NULL, conv_thread, &cp[i]) == 0;
    }
    conv_thread(&cp[0]);
    for (int i = 1; i < t; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            conv_thread(&cp[i]);
    }
}

static pool_buf *pool_acquire(cm_chan_server *s, size_t need) {
    pool_buf *grow = NULL;
    for (int i = 0; i < s->n_pool; i++) {
        pool_buf *b = &s->pool[i];
        if (atomic_load(&b->busy))
            continue;
        if (b->cap >= need) {
            atomic_store(&b->busy, 1);
            return b;
        }
        if (!grow)
            grow = b;
    }
    if (!grow && s->n_pool < POOL_MAX)
        grow = &s->pool[s->n_pool++];
    if (!grow)
        return NULL;
    free(grow->data); /* no copy: the contents are dead */
    grow->data = malloc(need);
    grow->cap = grow->data ? need : 0;
    if (!grow->data)
        return NULL;
    atomic_store(&grow->busy, 1);
    return grow;
}

static cm_status ensure_out(cm_chan_server *s, uint32_t L, size_t TD) {
    size_t need = (size_t)L * TD;
    if (need > s->out_cap) {
        free(s->out_block);
        s->out_block = malloc(need * sizeof(float));
        s->out_cap = s->out_block ? need : 0;
        if (!s->out_block)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for the captured layers", need * 4);
    }
    for (uint32_t i = 0; i < L; i++)
        s->out_ptrs[i] = s->out_block + (size_t)i * TD;
    return CM_OK;
}

/* Converts and encodes job's outputs into a pooled buffer and writes HEAD. */
static cm_status encode_answer(cm_chan_server *s, work *w, const cm_proto_request *rq, cm_dtype out_dt) {
    const cm_dtype hd = s->cfg.hidden_dtype;
    const int64_t  T = rq->n_tokens, D = s->cfg.hidden_size;
    const size_t   n = (size_t)T * (size_t)D, es = cm_dtype_size(hd);
    size_t         per = cm_compress_bound(s->cc, rq->encoding, hd, T, D);
    if (!per)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cannot encode %s tensors as %s", cm_dtype_name(hd),
                       cm_encoding_name(rq->encoding));
    size_t    total = per * rq->n_layers;
    pool_buf *b = pool_acquire(s, total);
    uint8_t  *dst = b ? b->data : malloc(total);
    if (!dst)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for an answer", total);
    w->data = b;
    w->data_oneoff = b ? NULL : dst;
    size_t    off = 0;
    cm_status st = CM_OK;
    if (out_dt != hd && rq->encoding != CM_ENCODING_RAW && n * es > s->conv_cap) {
        free(s->conv);
        s->conv = malloc(n * es);
        s->conv_cap = s->conv ? n * es : 0;
        if (!s->conv)
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes to convert an answer", n * es);
    }
    for (uint32_t i = 0; i < rq->n_layers && st == CM_OK; i++) {
        const void *src = s->out_ptrs[i];
        size_t      len = n * es;
        if (out_dt != hd && rq->encoding == CM_ENCODING_RAW) { /* convert straight into the answer */
            convert_parallel(dst + off, hd, src, n, s->cfg.n_threads);
        } else {
            if (out_dt != hd) {
                convert_parallel(s->conv, hd, src, n, s->cfg.n_threads);
                src = s->conv;
            }
            st = cm_compress_encode(s->cc, rq->encoding, hd, src, T, D, dst + off, total - off, &len);
        }
        cm_proto_tensor *t = &s->tensors[i];
        *t = (cm_proto_tensor){.dtype = hd,
                               .encoding = rq->encoding,
                               .n_dims = 2,
                               .shape = {T, D},
                               .raw_size = n * es,
                               .encoded_size = len,
                               .data = dst + off};
        snprintf(t->name, sizeof t->name, "layer_%d", rq->layer_ids[i]);
        off += len;
    }
    cm_proto_answer a = {.batch_id = rq->batch_id,
                         .n_tensors = rq->n_layers,
                         .tensors = s->tensors,
                         .cap_tensors = rq->n_layers};
    size_t          head = cm_proto_answer_head_size(&a);
    if (st == CM_OK && head > w->head_cap) {
        free(w->head);
        w->head = malloc(head);
        w->head_cap = w->head ? head : 0;
        if (!w->head)
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate an answer head of %zu bytes", head);
    }
    if (st == CM_OK)
        st = cm_proto_answer_encode_head(&a, w->head, w->head_cap, &w->head_len);
    if (st != CM_OK) {
        if (b)
            atomic_store(&b->busy, 0);
        free(w->data_oneoff);
        w->data = NULL;
        w->data_oneoff = NULL;
        return st;
    }
    w->data_len = off;
    return CM_OK;
}

static void worker_process(cm_chan_server *s, work *w) {
    cm_proto_request rq = {.tokens = s->w_tokens,
                           .cu_seqlens = s->w_cu,
                           .layer_ids = s->w_layers,
                           .cap_tokens = s->cfg.max_tokens,
                           .cap_cu_seqlens = s->cfg.max_tokens + 1,
                           .cap_layers = s->cfg.max_req_layers};
    w->is_answer = 0;
    w->data = NULL;
    w->data_oneoff = NULL;
    cm_status st = cm_proto_request_decode(zmq_msg_data(&w->msg), zmq_msg_size(&w->msg), &s->lim, &rq);
    w->id = rq.batch_id;
    w->n_tokens = rq.n_tokens;
    cm_chan_job job = {.session = w->session,
                       .req = &rq,
                       .hidden_size = s->cfg.hidden_size,
                       .out = (void *const *)s->out_ptrs,
                       .out_dtype = CM_DTYPE_F32};
    if (st == CM_OK)
        st = ensure_out(s, rq.n_layers, (size_t)rq.n_tokens * s->cfg.hidden_size);
    int64_t t0 = cm_chan_now_ms();
    if (st == CM_OK)
        st = s->cfg.compute(s->cfg.user, &job);
    int64_t t1 = cm_chan_now_ms();
    int     bad_request = st == CM_ERR_INVALID_ARG;
    if (st == CM_OK && job.out_dtype != CM_DTYPE_F32 && job.out_dtype != s->cfg.hidden_dtype)
        st = CM_FAIL(CM_ERR_INVALID_ARG, "the compute callback returned %s; expected F32 or %s",
                     cm_dtype_name(job.out_dtype), cm_dtype_name(s->cfg.hidden_dtype));
    if (st == CM_OK)
        st = encode_answer(s, w, &rq, job.out_dtype);
    if (st == CM_OK) {
        w->is_answer = 1;
        CM_LOG_DEBUG("batch %llu of '%s': %u tokens, %u layers: compute %lld ms, encode %lld ms, %zu bytes",
                     (unsigned long long)rq.batch_id, w->session, rq.n_tokens, rq.n_layers,
                     (long long)(t1 - t0), (long long)(cm_chan_now_ms() - t1), w->head_len + w->data_len);
        return;
    }
    cm_proto_error e = {.batch_id = rq.batch_id,
                        .code = bad_request ? CM_PROTO_ERROR_BAD_REQUEST : CM_PROTO_ERROR_INTERNAL};
    cm_chan_error_text(e.message, cm_last_error());
    if (!bad_request)
        CM_LOG_WARN("batch %llu of '%s' failed: %s", (unsigned long long)rq.batch_id, w->session,
                    cm_last_error());
    if (cm_proto_error_encode(&e, w->err, sizeof w->err, &w->err_len) != CM_OK)
        w->err_len = 0;
}

static void *worker_main(void *arg) {
    cm_chan_server *s = arg;
    work           *w = &s->w;
    cm_status       st = s->cfg.init ? s->cfg.init(s->cfg.user) : CM_OK;
    pthread_mutex_lock(&w->mu);
    w->init_done = 1;
    w->init_status = st;
    if (st != CM_OK)
        snprintf(w->init_msg, sizeof w->init_msg, "%s", cm_last_error());
    pthread_mutex_unlock(&w->mu);
    notify_loop(s);
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->have_job && !w->quit)
            pthread_cond_wait(&w->cv, &w->mu);
        int quit = w->quit && !w->have_job;
        pthread_mutex_unlock(&w->mu);
        if (quit || st != CM_OK)
            break;
        worker_process(s, w);
        pthread_mutex_lock(&w->mu);
        w->have_job = 0;
        w->done = 1;
        zmq_msg_close(&w->msg);
        pthread_mutex_unlock(&w->mu);
        notify_loop(s);
    }
    pthread_mutex_lock(&w->mu);
    if (w->have_job) { /* handed over before init failed: never run */
        zmq_msg_close(&w->msg);
        w->have_job = 0;
    }
    pthread_mutex_unlock(&w->mu);
    if (s->cfg.fini)
        s->cfg.fini(s->cfg.user);
    return NULL;
}

// ----------------------------------------------------------------------------
// the loop

static void schedule(cm_chan_server *s) {
    if (s->worker_busy || s->stopping)
        return;
    uint32_t M = s->cfg.max_sessions;
    for (uint32_t k = 1; k <= M; k++) {
        uint32_t i = (s->rr + k) % M;
        session *ss = &s->sessions[i];
        if (!ss->used || !ss->q_len)
            continue;
        qjob *j = &ss->queue[ss->q_head];
        ss->q_head = (ss->q_head + 1) % s->cfg.credits;
        ss->q_len--;
        ss->computing = 1;
        ss->computing_id = j->id;
        pthread_mutex_lock(&s->w.mu);
        zmq_msg_init(&s->w.msg);
        zmq_msg_move(&s->w.msg, &j->msg);
        zmq_msg_close(&j->msg);
        snprintf(s->w.session, sizeof s->w.session, "%s", ss->name);
        s->w.sess = (int)i;
        s->w.gen = ss->gen;
        s->w.have_job = 1;
        pthread_cond_signal(&s->w.cv);
        pthread_mutex_unlock(&s->w.mu);
        s->worker_busy = 1;
        s->rr = i;
        return;
    }
}

static void handle_done(cm_chan_server *s) {
    work *w = &s->w;
    pthread_mutex_lock(&w->mu);
    int done = w->done;
    w->done = 0;
    pthread_mutex_unlock(&w->mu);
    if (!done)
        return;
    s->worker_busy = 0;
    session *ss = &s->sessions[w->sess];
    int      live = ss->used && ss->gen == w->gen;
    if (ss->gen == w->gen)
        ss->computing = 0;
    if (!live) {
        if (w->data)
            atomic_store(&w->data->busy, 0);
        free(w->data_oneoff);
        CM_LOG_DEBUG("discarded the answer to batch %llu: its session ended", (unsigned long long)w->id);
        return;
    }
    cm_status st;
    if (w->is_answer) {
        zmq_msg_t dm;
        uint8_t  *data = w->data ? w->data->data : w->data_oneoff;
        zmq_msg_init_data(&dm, data, w->data_len, data_free, w->data);
        st = CM_OK;
        if (zmq_send(s->router, ss->ident, ss->ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
            st = zmq_errno() == EHOSTUNREACH ? CM_FAIL(CM_ERR_PEER_GONE, "the trainer is no longer connected")
                                             : CM_ZMQ(-1);
        if (st == CM_OK)
            st = CM_ZMQ(zmq_send(s->router, w->head, w->head_len, ZMQ_SNDMORE | ZMQ_DONTWAIT));
        if (st == CM_OK)
            st = CM_ZMQ(zmq_msg_send(&dm, s->router, ZMQ_DONTWAIT));
        if (st != CM_OK)
            zmq_msg_close(&dm); /* gives the buffer back */
        if (st == CM_OK) {
            uint64_t bytes = w->head_len + w->data_len;
            ss->n_answers++;
            ss->bytes += bytes;
            ss->tokens += w->n_tokens;
            pthread_mutex_lock(&s->stats_mu);
            s->stats.answers++;
            s->stats.bytes_sent += bytes;
            s->stats.tokens += w->n_tokens;
            pthread_mutex_unlock(&s->stats_mu);
        }
    } else {
        st = w->err_len ? send_to(s, ss->ident, ss->ident_len, w->err, w->err_len) : CM_OK;
        if (w->err_len)
            STAT_ADD(s, errors_sent, 1);
        ss->n_errors++;
    }
    ss->last_send = cm_chan_now_ms();
    if (st == CM_ERR_PEER_GONE)
        end_session(s, ss, END_UNREACHABLE);
    else if (st != CM_OK)
        CM_LOG_WARN("session '%s': cannot send batch %llu: %s", ss->name, (unsigned long long)w->id,
                    cm_last_error());
}

static void timers(cm_chan_server *s, int64_t now) {
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        session *ss = &s->sessions[i];
        if (!ss->used)
            continue;
        if (now - ss->last_recv > s->cfg.peer_timeout_ms) {
            end_session(s, ss, END_TIMEOUT);
            continue;
        }
        if (now - ss->last_send >= s->cfg.heartbeat_ms) {
            uint8_t buf[CM_PROTO_HEADER_SIZE];
            size_t  len;
            cm_proto_heartbeat_encode(++s->hb_seq, buf, sizeof buf, &len);
            cm_status st = send_to(s, ss->ident, ss->ident_len, buf, len);
            ss->last_send = now;
            if (st == CM_ERR_PEER_GONE) {
                end_session(s, ss, END_UNREACHABLE);
                continue;
            }
        }
        if (s->cfg.stats_interval_ms > 0 && now - ss->last_stats >= s->cfg.stats_interval_ms) {
            ss->last_stats = now;
            log_session(ss, "running", now);
        }
    }
}

cm_status cm_chan_server_run(cm_chan_server *s) {
    if (s->ran)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server_run: a server runs once");
    s->ran = 1;
    CM_LOG_INFO("serving '%s' on %s: target %016llx, %u layers of %u, %s answers, %u credits per session",
                s->name, s->endpoint, (unsigned long long)s->cfg.target_id, s->cfg.n_layers,
                s->cfg.hidden_size, cm_dtype_name(s->cfg.hidden_dtype), s->cfg.credits);
    if (pthread_create(&s->worker, NULL, worker_main, s) != 0)
        return CM_FAIL(CM_ERR_NOMEM, "cannot start the worker thread");
    s->worker_started = 1;
    cm_status st = CM_OK;
    for (;;) {
        if (atomic_load(&s->stop) && !s->stopping) {
            s->stopping = 1;
            CM_LOG_INFO("stopping: %s",
                        s->worker_busy ? "finishing the forward in progress" : "no forward in progress");
            for (uint32_t i = 0; i < s->cfg.max_sessions; i++)
                if (s->sessions[i].used)
                    drop_queue(s, &s->sessions[i]);
        }
        if (s->stopping && !s->worker_busy)
            break;
        pthread_mutex_lock(&s->w.mu);
        int init_failed = s->w.init_done && s->w.init_status != CM_OK;
        pthread_mutex_unlock(&s->w.mu);
        if (init_failed) {
            st = CM_FAIL(s->w.init_status, "%s", s->w.init_msg);
            break;
        }
        zmq_pollitem_t items[3] = {
            {s->router, 0, ZMQ_POLLIN, 0}, {NULL, s->pipe_r, ZMQ_POLLIN, 0}, {s->zap, 0, ZMQ_POLLIN, 0}};
        int  n_items = s->zap ? 3 : 2;
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
            handle_done(s);
        }
        if (s->zap && (items[2].revents & ZMQ_POLLIN))
            handle_zap(s);
        for (int k = 0; k < RECV_BURST && handle_msg(s); k++) {
        }
        timers(s, cm_chan_now_ms());
        schedule(s);
    }
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        session *ss = &s->sessions[i];
        if (!ss->used)
            continue;
        send_bye(s, ss->ident, ss->ident_len);
        end_session(s, ss, END_STOP);
    }
    pthread_mutex_lock(&s->w.mu);
    s->w.quit = 1;
    pthread_cond_signal(&s->w.cv);
    pthread_mutex_unlock(&s->w.mu);
    pthread_join(s->worker, NULL);
    s->worker_started = 0;
    if (s->worker_busy) { /* only after a failure: the last result is not sent */
        handle_done(s);
    }
    CM_LOG_INFO("stopped serving '%s' on %s", s->name, s->endpoint);
    return st;
}

void cm_chan_server_stop(cm_chan_server *s) {
    if (s)
        atomic_store(&s->stop, 1);
}

void cm_chan_server_get_stats(cm_chan_server *s, cm_chan_server_stats *out) {
    pthread_mutex_lock(&s->stats_mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->stats_mu);
}

const char *cm_chan_server_endpoint(const cm_chan_server *s) {
    return s->endpoint;
}

// ----------------------------------------------------------------------------
// create / destroy

static cm_status load_client_keys(cm_chan_server *s, const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return CM_FAIL(CM_ERR_IO, "cannot open the client key directory '%s': %s", dir, strerror(errno));
    snprintf(s->client_keys_dir, sizeof s->client_keys_dir, "%s", dir);
    s->client_keys = calloc(MAX_CLIENT_KEYS, 32);
    cm_status st = s->client_keys ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate the client key table");
    struct dirent *e;
    while (st == CM_OK && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 4, ".pub") != 0)
            continue;
        if (s->n_client_keys == MAX_CLIENT_KEYS) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "'%s' holds more than %d client keys", dir, MAX_CLIENT_KEYS);
            break;
        }
        char path[2048], key[CM_CHAN_KEY_LEN + 1];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        st = cm_chan_curve_read_key(path, key);
        if (st == CM_OK)
            zmq_z85_decode(s->client_keys[s->n_client_keys++], key);
    }
    closedir(d);
    if (st == CM_OK && s->n_client_keys == 0)
        st = CM_FAIL(CM_ERR_INVALID_ARG,
                     "the client key directory '%s' holds no *.pub key; copy each trainer's "
                     "public key there",
                     dir);
    return st;
}

static cm_status check_config(const cm_chan_server_config *c) {
    if (!c->compute)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server: no compute callback");
    if (c->hidden_dtype != CM_DTYPE_BF16 && c->hidden_dtype != CM_DTYPE_F32)
        return CM_FAIL(CM_ERR_INVALID_ARG, "hidden dtype %s: answers are BF16 or F32",
                       cm_dtype_name(c->hidden_dtype));
    if (c->hidden_size < 1 || c->n_layers < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "hidden size %u and layer count %u must be at least 1",
                       c->hidden_size, c->n_layers);
    if (c->max_tokens < 1 || c->max_tokens > (1u << 24))
        return CM_FAIL(CM_ERR_INVALID_ARG, "--max-tokens %u: expected 1 to %u", c->max_tokens, 1u << 24);
    if (c->max_req_layers < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "max layers per request must be at least 1");
    if (c->credits < 1 || c->credits > 1024)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--credits %u: expected 1 to 1024", c->credits);
    if (!c->encodings || c->encodings >> CM_ENCODING_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "encodings mask 0x%x names no known encoding", c->encodings);
    if (c->max_sessions < 1 || c->max_sessions > 4096)
        return CM_FAIL(CM_ERR_INVALID_ARG, "max sessions %u: expected 1 to 4096", c->max_sessions);
    if (c->heartbeat_ms < 10 || c->peer_timeout_ms <= c->heartbeat_ms)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "heartbeat %d ms and peer timeout %d ms: need heartbeat ≥ 10 ms and a "
                       "longer peer timeout",
                       c->heartbeat_ms, c->peer_timeout_ms);
    if (c->n_threads < 1 || c->n_threads > CM_COMPRESS_MAX_THREADS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--threads %d: expected 1 to %d", c->n_threads,
                       CM_COMPRESS_MAX_THREADS);
    if (c->curve_client_keys && !c->curve_secret_key)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "--curve-client-keys needs --curve-secret-key (the server's own key)");
    return CM_OK;
}

cm_status cm_chan_server_create(cm_chan_server **out, const cm_chan_server_config *cfg) {
    *out = NULL;
    CM_TRY(check_config(cfg));
    int local;
    CM_TRY(cm_chan_endpoint_check(cfg->endpoint, &local));
    if (!local && (!cfg->curve_secret_key || !cfg->curve_client_keys))
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "refusing to bind '%s' without CURVE: a non-loopback endpoint needs "
            "--curve-secret-key FILE and --curve-client-keys DIR; or bind tcp://127.0.0.1:PORT or ipc://PATH",
            cfg->endpoint);
    if (cfg->curve_secret_key)
        CM_TRY(cm_chan_curve_require("--curve-secret-key"));
    cm_chan_server *s = calloc(1, sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the server");
    s->cfg = *cfg;
    s->pipe_r = s->pipe_w = -1;
    pthread_mutex_init(&s->stats_mu, NULL);
    pthread_mutex_init(&s->w.mu, NULL);
    pthread_cond_init(&s->w.cv, NULL);
    if (s->cfg.max_req_layers > s->cfg.n_layers)
        s->cfg.max_req_layers = s->cfg.n_layers;
    s->cfg.endpoint = NULL; /* borrowed strings are not kept */
    s->cfg.curve_secret_key = NULL;
    s->cfg.curve_client_keys = NULL;
    snprintf(s->name, sizeof s->name, "%s", cfg->name ? cfg->name : "target");
    s->cfg.name = s->name;
    cm_status st = CM_OK;
    /* a trial WELCOME checks the name with the wire's own rules */
    cm_proto_welcome trial = {.hidden_dtype = cfg->hidden_dtype,
                              .hidden_size = 1,
                              .n_layers = 1,
                              .max_tokens = 1,
                              .credits = 1,
                              .encodings = cfg->encodings};
    snprintf(trial.name, sizeof trial.name, "%s", s->name);
    uint8_t tb[CM_PROTO_SMALL_FRAME_MAX];
    size_t  tl;
    CM_TRY_GOTO(cm_proto_welcome_encode(&trial, tb, sizeof tb, &tl), st, fail);

    const uint32_t T = s->cfg.max_tokens, L = s->cfg.max_req_layers;
    s->lim = (cm_proto_limits){.max_tokens = T,
                               .max_seqs = T,
                               .max_layers = L,
                               .max_layer_id = INT32_MAX,
                               .max_tensors = 0,
                               .max_body_bytes = 16 + 4 * (2 * T + 1 + L),
                               .max_tensor_bytes = 0,
                               .max_data_bytes = 0};
    s->sessions = calloc(s->cfg.max_sessions, sizeof *s->sessions);
    s->l_tokens = malloc((size_t)T * 4);
    s->l_cu = malloc(((size_t)T + 1) * 4);
    s->l_layers = malloc((size_t)L * 4);
    s->w_tokens = malloc((size_t)T * 4);
    s->w_cu = malloc(((size_t)T + 1) * 4);
    s->w_layers = malloc((size_t)L * 4);
    s->out_ptrs = calloc(L, sizeof *s->out_ptrs);
    s->tensors = calloc(L, sizeof *s->tensors);
    if (!s->sessions || !s->l_tokens || !s->l_cu || !s->l_layers || !s->w_tokens || !s->w_cu ||
        !s->w_layers || !s->out_ptrs || !s->tensors) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the server's tables for %u tokens", T);
        goto fail;
    }
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        s->sessions[i].queue = calloc(s->cfg.credits, sizeof(qjob));
        if (!s->sessions[i].queue) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the session queues");
            goto fail;
        }
    }
    cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
    cc.n_threads = s->cfg.n_threads;
    cc.level = s->cfg.zstd_level;
    CM_TRY_GOTO(cm_compress_create(&s->cc, &cc), st, fail);
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot create the worker pipe: %s", strerror(errno));
        goto fail;
    }
    s->pipe_r = fds[0];
    s->pipe_w = fds[1];

    if (!(s->ctx = zmq_ctx_new())) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    char secret[CM_CHAN_KEY_LEN + 1], public_key[CM_CHAN_KEY_LEN + 1];
    if (cfg->curve_secret_key) {
        CM_TRY_GOTO(cm_chan_curve_read_key(cfg->curve_secret_key, secret), st, fail);
        if (zmq_curve_public(public_key, secret) != 0) {
            memset(secret, 0, sizeof secret);
            st = CM_FAIL(CM_ERR_FORMAT, "key file '%s' does not hold a CURVE secret key",
                         cfg->curve_secret_key);
            goto fail;
        }
    }
    if (cfg->curve_client_keys) {
        CM_TRY_GOTO(load_client_keys(s, cfg->curve_client_keys), st, fail);
        if (!(s->zap = zmq_socket(s->ctx, ZMQ_REP))) {
            st = CM_ZMQ(-1);
            goto fail;
        }
        CM_TRY_GOTO(cm_chan_set_int(s->zap, ZMQ_LINGER, 0), st, fail);
        CM_TRY_GOTO(CM_ZMQ(zmq_bind(s->zap, "inproc://zeromq.zap.01")), st, fail);
    }
    if (!(s->router = zmq_socket(s->ctx, ZMQ_ROUTER))) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_ROUTER_MANDATORY, 1), st, fail);
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_ROUTER_HANDOVER, 1), st, fail);
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_LINGER, 2000), st, fail);
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_SNDHWM, (int)(4 * s->cfg.credits + 64)), st, fail);
    CM_TRY_GOTO(
        cm_chan_set_i64(s->router, ZMQ_MAXMSGSIZE, CM_PROTO_HEADER_SIZE + (int64_t)s->lim.max_body_bytes), st,
        fail);
    if (cfg->curve_secret_key) {
        CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_CURVE_SERVER, 1), st, fail);
        st = CM_ZMQ(zmq_setsockopt(s->router, ZMQ_CURVE_SECRETKEY, secret, CM_CHAN_KEY_LEN + 1));
        memset(secret, 0, sizeof secret);
        if (st != CM_OK)
            goto fail;
        if (s->zap)
            CM_TRY_GOTO(CM_ZMQ(zmq_setsockopt(s->router, ZMQ_ZAP_DOMAIN, "tandem", 6)), st, fail);
        CM_LOG_INFO("CURVE on: server public key %s, %s", public_key,
                    s->zap ? "clients checked against the key directory" : "any client that knows it");
    }
    if (zmq_bind(s->router, cfg->endpoint) != 0) {
        int e = zmq_errno();
        st = CM_FAIL(CM_ERR_ZMQ, "cannot bind '%s': %s%s", cfg->endpoint, zmq_strerror(e),
                     e == EADDRINUSE ? " (another server runs there? choose another port)" : "");
        goto fail;
    }
    size_t el = sizeof s->endpoint;
    if (zmq_getsockopt(s->router, ZMQ_LAST_ENDPOINT, s->endpoint, &el) != 0)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", cfg->endpoint);
    *out = s;
    return CM_OK;
fail:
    cm_chan_server_destroy(&s);
    return st;
}

void cm_chan_server_destroy(cm_chan_server **sp) {
    if (!sp || !*sp)
        return;
    cm_chan_server *s = *sp;
    if (s->sessions)
        for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
            if (s->sessions[i].used)
                drop_queue(s, &s->sessions[i]);
            free(s->sessions[i].queue);
        }
    if (s->router)
        zmq_close(s->router);
    if (s->zap)
        zmq_close(s->zap);
    if (s->ctx)
        zmq_ctx_term(s->ctx); /* waits for queued messages (linger) and frees them */
    for (int i = 0; i < s->n_pool; i++)
        free(s->pool[i].data);
    if (s->pipe_r >= 0)
        close(s->pipe_r);
    if (s->pipe_w >= 0)
        close(s->pipe_w);
    cm_compress_destroy(&s->cc);
    free(s->w.head);
    free(s->client_keys);
    free(s->sessions);
    free(s->l_tokens);
    free(s->l_cu);
    free(s->l_layers);
    free(s->w_tokens);
    free(s->w_cu);
    free(s->w_layers);
    free(s->out_block);
    free(s->out_ptrs);
    free(s->conv);
    free(s->tensors);
    pthread_cond_destroy(&s->w.cv);
    pthread_mutex_destroy(&s->w.mu);
    pthread_mutex_destroy(&s->stats_mu);
    free(s);
    *sp = NULL;
}
