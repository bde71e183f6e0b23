/* common/cm_chan_server.c — the target-server's session loop (see cm_chan.h). The loop thread
 * owns the ROUTER (and the ZAP socket when client keys are configured): it validates every
 * frame, keeps one session per routing identity (HELLO opens or replaces it; BYE, silence
 * past the peer timeout or an unreachable peer ends it and drops its queued requests), queues
 * at most `credits` requests per session (duplicates of a queued or running id are ignored),
 * sends heartbeats and hands one job at a time to each idle worker (cm_chan_server_work.c;
 * one per model replica), round-robin over the sessions that have work (a session with an
 * NCCL communicator only to the worker that opened it), then sends each result, DATA
 * zero-copy (ZeroMQ hands the buffer back to the pool when it is on the wire). Nothing from a
 * peer is trusted: sizes are bounded by ZMQ_MAXMSGSIZE and cm_proto_limits before use. */
#include "cm_chan_int.h"

#include <cJSON.h>

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

uint32_t cm_chan_drop_queue_(cm_chan_server *s, session *ss) {
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
    uint32_t           n = cm_chan_drop_queue_(s, ss);
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
    cm_chan_close_peer_(s, ss->nccl_worker, ss->nccl_peer); /* an opening peer is closed when its open returns */
    ss->nccl_peer = NULL;
    ss->nccl_worker = -1;
    ss->nccl_state = NCCL_NONE;
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
    char why[400];
    if (cm_target_identity_differs(why, sizeof why, s->cfg.target_id, s->cfg.weights_id, h.target_id, h.weights_id,
                                   "served here", "asked for")) {
        CM_LOG_WARN("refused trainer '%s': %s", h.name, why);
        send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_TARGET_MISMATCH,
                   "target-server '%s' serves another target: %s; connect to the server of the target the drafter "
                   "is trained for",
                   s->name, why);
        return;
    }
    uint32_t enc = h.encodings & s->cfg.encodings;
    if (!enc && h.encodings == 1u << CM_ENCODING_NCCL) {
        send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                   "target-server '%s' has no NCCL path (it computes on the CPU, or was built without "
                   "NCCL); ask for a ZeroMQ encoding such as zstd-byteplane",
                   s->name);
        return;
    }
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
                    .last_stats = now,
                    .nccl_worker = -1};
    memcpy(ss->ident, ident, ident_len);
    snprintf(ss->name, sizeof ss->name, "%s", h.name);
    const char *peer = zmq_msg_gets(fr, "Peer-Address");
    snprintf(ss->peer, sizeof ss->peer, "%s", peer && *peer ? peer : "a local socket");
    cm_proto_welcome wm = {.target_id = s->cfg.target_id,
                           .weights_id = s->cfg.weights_id,
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

static void refuse_frame(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len,
                         const uint8_t *p, size_t len, const char *why);

/* A trainer offers an NCCL communicator: the worker joins it between jobs (schedule). */
static void on_nccl_offer(cm_chan_server *s, session *ss, zmq_msg_t *fr) {
    cm_proto_nccl o;
    if (cm_proto_nccl_offer_decode(zmq_msg_data(fr), zmq_msg_size(fr), &s->lim, &o) != CM_OK) {
        refuse_frame(s, ss, ss->ident, ss->ident_len, zmq_msg_data(fr), zmq_msg_size(fr), cm_last_error());
        return;
    }
    if (!s->cfg.nccl) {
        send_error(s, ss->ident, ss->ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                   "target-server '%s' has no NCCL path (it computes on the CPU or was built without "
                   "NCCL); use a ZeroMQ encoding such as zstd-byteplane",
                   s->name);
        return;
    }
    if (ss->nccl_state != NCCL_NONE) {
        send_error(s, ss->ident, ss->ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                   "session '%s' already has an NCCL communicator; say HELLO again for a new one", ss->name);
        return;
    }
    ss->nccl_offer = o;
    ss->nccl_state = NCCL_WANTED;
    CM_LOG_INFO("session '%s': joining the NCCL communicator of its GPU %u", ss->name, o.device);
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
    if (rq.encoding == CM_ENCODING_NCCL && ss->nccl_state != NCCL_UP) {
        send_error(s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_BAD_REQUEST,
                   "batch %llu asks for encoding nccl, but this session has no NCCL communicator yet "
                   "(send NCCL_OFFER and wait for NCCL_READY)",
                   (unsigned long long)rq.batch_id);
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
    int dup = 0;
    for (int i = 0; i < s->n_workers && !dup; i++) {
        const worker *k = &s->workers[i];
        dup = k->busy && k->w.kind == WORK_JOB && &s->sessions[k->w.sess] == ss && k->w.gen == ss->gen &&
              k->job_id == rq.batch_id;
    }
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
/* STATUS: what the server serves, to whom, how fast; answered to anyone who can reach the
 * socket (the socket's CURVE rules apply), outside any session. */
static void status_reply(cm_chan_server *s, const uint8_t *ident, size_t ident_len, const uint8_t *p, size_t len) {
    char   *json = NULL, info[4096] = "";
    size_t  n_json, dummy;
    uint8_t tmp[CM_PROTO_HEADER_SIZE];
    if (cm_proto_status_decode(p, len, &s->lim, (char *)tmp, sizeof tmp, &dummy) != CM_OK || dummy) {
        refuse_frame(s, NULL, ident, ident_len, p, len, "a STATUS request carries no body");
        return;
    }
    int64_t              now = cm_chan_now_ms();
    cm_chan_server_stats st;
    cm_chan_server_get_stats(s, &st);
    cJSON *o = cJSON_CreateObject(), *ses = cJSON_CreateArray(), *tot = cJSON_CreateObject();
    char   hex[20];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)s->cfg.target_id);
    cJSON_AddStringToObject(o, "name", s->name);
    cJSON_AddStringToObject(o, "target_id", hex);
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)s->cfg.weights_id);
    cJSON_AddStringToObject(o, "weights_id", hex);
    cJSON_AddStringToObject(o, "endpoint", s->endpoint);
    cJSON_AddNumberToObject(o, "uptime_s", (double)(now - s->started_ms) / 1e3);
    cJSON_AddStringToObject(o, "hidden_dtype", cm_dtype_name(s->cfg.hidden_dtype));
    cJSON_AddNumberToObject(o, "hidden_size", s->cfg.hidden_size);
    cJSON_AddNumberToObject(o, "n_layers", s->cfg.n_layers);
    cJSON_AddNumberToObject(o, "max_tokens", s->cfg.max_tokens);
    cJSON_AddNumberToObject(o, "credits", s->cfg.credits);
    cJSON *encs = cJSON_AddArrayToObject(o, "encodings");
    for (int e = 0; e < CM_ENCODING_END; e++)
        if (s->cfg.encodings >> e & 1u)
            cJSON_AddItemToArray(encs, cJSON_CreateString(cm_encoding_name(e)));
    cJSON_AddBoolToObject(o, "computing", s->n_busy > 0);
    cJSON_AddNumberToObject(o, "workers", s->n_workers);
    cJSON_AddNumberToObject(o, "workers_busy", s->n_busy);
    cJSON_AddBoolToObject(o, "stopping", s->stopping);
    if (s->cfg.status) {
        s->cfg.status(s->cfg.user, info, sizeof info);
        cJSON *t = cJSON_Parse(info);
        if (t)
            cJSON_AddItemToObject(o, "target", t);
    }
    cJSON_AddNumberToObject(tot, "sessions_opened", (double)st.sessions_opened);
    cJSON_AddNumberToObject(tot, "sessions_active", st.sessions_active);
    cJSON_AddNumberToObject(tot, "requests", (double)st.requests);
    cJSON_AddNumberToObject(tot, "resends", (double)st.resends);
    cJSON_AddNumberToObject(tot, "answers", (double)st.answers);
    cJSON_AddNumberToObject(tot, "tokens", (double)st.tokens);
    cJSON_AddNumberToObject(tot, "bytes_sent", (double)st.bytes_sent);
    cJSON_AddNumberToObject(tot, "errors_sent", (double)st.errors_sent);
    cJSON_AddNumberToObject(tot, "bad_frames", (double)st.bad_frames);
    cJSON_AddNumberToObject(tot, "dropped_jobs", (double)st.dropped_jobs);
    cJSON_AddNumberToObject(tot, "tokens_per_s",
                            now > s->started_ms ? (double)st.tokens * 1e3 / (double)(now - s->started_ms) : 0);
    cJSON_AddItemToObject(o, "totals", tot);
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        const session *ss = &s->sessions[i];
        if (!ss->used)
            continue;
        cJSON *x = cJSON_CreateObject();
        double age = (double)(now - ss->started) / 1e3;
        cJSON_AddStringToObject(x, "name", ss->name);
        cJSON_AddStringToObject(x, "peer", ss->peer);
        cJSON_AddNumberToObject(x, "age_s", age);
        cJSON_AddNumberToObject(x, "credits", ss->credits);
        cJSON_AddBoolToObject(x, "nccl", ss->nccl_state == NCCL_UP);
        cJSON_AddNumberToObject(x, "queued", ss->q_len);
        cJSON_AddNumberToObject(x, "computing", ss->computing);
        cJSON_AddNumberToObject(x, "requests", (double)ss->n_requests);
        cJSON_AddNumberToObject(x, "resends", (double)ss->n_resends);
        cJSON_AddNumberToObject(x, "answers", (double)ss->n_answers);
        cJSON_AddNumberToObject(x, "errors", (double)ss->n_errors);
        cJSON_AddNumberToObject(x, "tokens", (double)ss->tokens);
        cJSON_AddNumberToObject(x, "bytes_sent", (double)ss->bytes);
        cJSON_AddNumberToObject(x, "tokens_per_s", age > 0 ? (double)ss->tokens / age : 0);
        cJSON_AddItemToArray(ses, x);
    }
    cJSON_AddItemToObject(o, "sessions", ses);
    json = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    n_json = json ? strlen(json) : 0;
    size_t   cap = CM_PROTO_HEADER_SIZE + 4 + (n_json < CM_PROTO_STATUS_MAX ? n_json : CM_PROTO_STATUS_MAX);
    uint8_t *buf = json ? malloc(cap) : NULL;
    size_t   flen;
    if (buf && cm_proto_status_encode(json, n_json, buf, cap, &flen) == CM_OK)
        send_to(s, ident, ident_len, buf, flen);
    else
        send_error(s, ident, ident_len, 0, CM_PROTO_ERROR_INTERNAL, "cannot build the status (%zu bytes)", n_json);
    free(buf);
    cJSON_free(json);
}

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
    } else if (h.type == CM_PROTO_TYPE_STATUS) {
        status_reply(s, ident, ident_len, p, len);
    } else if (!ss) {
        /* no session (the server restarted, or the session timed out): BYE makes the trainer
         * say HELLO again and re-send what it waits for */
        if (h.type != CM_PROTO_TYPE_BYE)
            send_bye(s, ident, ident_len);
    } else if (h.type == CM_PROTO_TYPE_REQUEST) {
        on_request(s, ss, &h, &fr);
    } else if (h.type == CM_PROTO_TYPE_NCCL_OFFER) {
        on_nccl_offer(s, ss, &fr);
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
        snprintf(why, sizeof why, "a %s frame; trainers send HELLO, REQUEST, NCCL_OFFER, HEARTBEAT, BYE",
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
// the loop

/* Hands a task to idle worker k (loop thread; the mailbox fields are the worker's once
 * have_job is set). */
static void hand_over(cm_chan_server *s, worker *k, session *ss, int kind, qjob *j) {
    work *w = &k->w;
    pthread_mutex_lock(&w->mu);
    w->kind = kind;
    if (kind == WORK_NCCL_OPEN) {
        w->offer = ss->nccl_offer;
    } else {
        zmq_msg_init(&w->msg);
        zmq_msg_move(&w->msg, &j->msg);
        zmq_msg_close(&j->msg);
        w->job_peer = ss->nccl_peer;
        k->job_id = j->id;
    }
    snprintf(w->session, sizeof w->session, "%s", ss->name);
    w->sess = (int)(ss - s->sessions);
    w->gen = ss->gen;
    w->have_job = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    k->busy = 1;
    s->n_busy++;
}

/* The idle worker holding the fewest NCCL sessions, or NULL. */
static worker *idle_for_nccl(cm_chan_server *s) {
    worker *best = NULL;
    int     best_n = 0;
    for (int i = 0; i < s->n_workers; i++) {
        worker *k = &s->workers[i];
        if (k->busy)
            continue;
        int n = 0;
        for (uint32_t j = 0; j < s->cfg.max_sessions; j++)
            n += s->sessions[j].used && s->sessions[j].nccl_worker == i;
        if (!best || n < best_n) {
            best = k;
            best_n = n;
        }
    }
    return best;
}

static void schedule(cm_chan_server *s) {
    if (s->stopping || s->n_busy == s->n_workers)
        return;
    uint32_t M = s->cfg.max_sessions;
    for (uint32_t i = 0; i < M; i++) { /* communicators first: their trainers wait for nothing else */
        session *ss = &s->sessions[i];
        if (!ss->used || ss->nccl_state != NCCL_WANTED)
            continue;
        worker *k = idle_for_nccl(s);
        if (!k)
            return;
        ss->nccl_state = NCCL_OPENING;
        ss->nccl_worker = k->index;
        hand_over(s, k, ss, WORK_NCCL_OPEN, NULL);
    }
    for (int n = 0; n < s->n_workers; n++) {
        worker *k = &s->workers[n];
        if (k->busy)
            continue;
        for (uint32_t t = 1; t <= M; t++) {
            uint32_t i = (s->rr + t) % M;
            session *ss = &s->sessions[i];
            /* a session with a communicator (or one being opened) stays on its worker */
            if (!ss->used || !ss->q_len || (ss->nccl_worker >= 0 && ss->nccl_worker != n) ||
                ss->nccl_state == NCCL_WANTED)
                continue;
            qjob *j = &ss->queue[ss->q_head];
            ss->q_head = (ss->q_head + 1) % s->cfg.credits;
            ss->q_len--;
            ss->computing++;
            hand_over(s, k, ss, WORK_JOB, j);
            s->rr = i;
            break;
        }
    }
}

/* The worker has joined (or failed to join) a session's NCCL communicator. */
static void nccl_opened(cm_chan_server *s, worker *k, session *ss, int live) {
    work *w = &k->w;
    if (!live) {
        cm_chan_close_peer_(s, k->index, w->peer);
        return;
    }
    if (!w->is_answer) {
        ss->nccl_state = NCCL_NONE;
        ss->nccl_worker = -1;
        CM_LOG_WARN("session '%s': cannot join its NCCL communicator: %s", ss->name, w->nccl_msg);
        send_error(s, ss->ident, ss->ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                   "target-server '%s' cannot join the NCCL communicator: %s", s->name, w->nccl_msg);
        return;
    }
    ss->nccl_peer = w->peer;
    ss->nccl_state = NCCL_UP;
    uint8_t   buf[CM_PROTO_HEADER_SIZE + 8];
    size_t    len;
    cm_status st = cm_proto_nccl_ready_encode(k->device, buf, sizeof buf, &len);
    if (st == CM_OK)
        st = send_to(s, ss->ident, ss->ident_len, buf, len);
    ss->last_send = cm_chan_now_ms();
    if (st == CM_ERR_PEER_GONE)
        end_session(s, ss, END_UNREACHABLE);
    else
        CM_LOG_INFO("session '%s': NCCL communicator up (server GPU %u, trainer GPU %u)", ss->name, k->device,
                    w->offer.device);
}

static void handle_done_one(cm_chan_server *s, worker *k) {
    work *w = &k->w;
    pthread_mutex_lock(&w->mu);
    int done = w->done;
    w->done = 0;
    pthread_mutex_unlock(&w->mu);
    if (!done)
        return;
    k->busy = 0;
    s->n_busy--;
    session *ss = &s->sessions[w->sess];
    int      live = ss->used && ss->gen == w->gen;
    if (w->kind == WORK_NCCL_OPEN) {
        nccl_opened(s, k, ss, live);
        return;
    }
    if (ss->gen == w->gen && ss->computing)
        ss->computing--;
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

static void handle_done(cm_chan_server *s) {
    for (int i = 0; i < s->n_workers; i++)
        handle_done_one(s, &s->workers[i]);
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
    s->started_ms = cm_chan_now_ms();
    CM_LOG_INFO("serving '%s' on %s: weights %016llx (config %016llx), %u layers of %u, %s answers, %u credits "
                "per session",
                s->name, s->endpoint, (unsigned long long)s->cfg.weights_id, (unsigned long long)s->cfg.target_id,
                s->cfg.n_layers,
                s->cfg.hidden_size, cm_dtype_name(s->cfg.hidden_dtype), s->cfg.credits);
    cm_status st = CM_OK;
    for (int i = 0; i < s->n_workers && st == CM_OK; i++) {
        if (pthread_create(&s->workers[i].thread, NULL, cm_chan_worker_main_, &s->workers[i]) != 0)
            st = CM_FAIL(CM_ERR_NOMEM, "cannot start worker thread %d", i);
        else
            s->workers[i].started = 1;
    }
    while (st == CM_OK) {
        if (atomic_load(&s->stop) && !s->stopping) {
            s->stopping = 1;
            CM_LOG_INFO("stopping: %s",
                        s->n_busy ? "finishing the forwards in progress" : "no forward in progress");
            for (uint32_t i = 0; i < s->cfg.max_sessions; i++)
                if (s->sessions[i].used)
                    cm_chan_drop_queue_(s, &s->sessions[i]);
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
    for (int i = 0; i < s->n_workers; i++) {
        worker *k = &s->workers[i];
        if (!k->started)
            continue;
        pthread_mutex_lock(&k->w.mu);
        k->w.quit = 1;
        pthread_cond_signal(&k->w.cv);
        pthread_mutex_unlock(&k->w.mu);
        pthread_join(k->thread, NULL);
        k->started = 0;
    }
    if (s->n_busy) /* only after a failure: the last results are not sent */
        handle_done(s);
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
