/* common/chan/cm_chan_server_session.c — the server's sessions (loop thread): one per routing
 * identity, opened or replaced by HELLO, ended by BYE, silence past the peer timeout, an
 * unreachable peer or the stop (its queued requests are dropped), and what a session receives:
 * NCCL_OFFER (the communicator is joined between jobs, cm_chan_server_sched.c) and REQUEST
 * (validated, then queued within the session's credits; duplicates of a queued or running id
 * are ignored). */
#include "cm_chan_int.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "cm_cfg_hash.h"
#include "cm_log.h"

session *cm_chan_find_session_(cm_chan_server *s, const uint8_t *ident, size_t len) {
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        session *ss = &s->sessions[i];
        if (ss->used && ss->ident_len == len && memcmp(ss->ident, ident, len) == 0)
            return ss;
    }
    return NULL;
}

void cm_chan_log_session_(const session *ss, const char *what, int64_t now) {
    double secs = (double)(now - ss->started) / 1000.0;
    CM_LOG_INFO(
        "session '%s' from %s %s: %llu requests (%llu re-sent), %llu answers, %llu errors, %.1f MB sent, "
        "%.0f tokens/s over %.1f s",
        ss->name, ss->peer, what, (unsigned long long)ss->n_requests, (unsigned long long)ss->n_resends,
        (unsigned long long)ss->n_answers, (unsigned long long)ss->n_errors, (double)ss->bytes / 1e6,
        secs > 0 ? (double)ss->tokens / secs : 0.0, secs);
}

uint32_t cm_chan_drop_queue_(cm_chan_server *s, session *ss) {
    uint32_t n = ss->q_len; /* the slots keep their arrays for the session's next requests */
    ss->q_head = ss->q_len = 0;
    if (n)
        STAT_ADD(s, dropped_jobs, n);
    return n;
}

void cm_chan_end_session_(cm_chan_server *s, session *ss, end_reason why) {
    static const char *what[] = {"said bye", "timed out", "was replaced by a new HELLO", "is unreachable",
                                 "ended: the server is stopping"};
    int64_t            now = cm_now_ms();
    uint32_t           n = cm_chan_drop_queue_(s, ss);
    cm_chan_log_session_(ss, what[why], now);
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
    cm_chan_close_peer_(s, ss->nccl_worker,
                        ss->nccl_peer); /* an opening peer is closed when its open returns */
    ss->nccl_peer = NULL;
    ss->nccl_worker = -1;
    ss->nccl_state = NCCL_NONE;
    ss->used = 0;
    ss->computing = 0;
}

// ----------------------------------------------------------------------------
// incoming frames

void cm_chan_on_hello_(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len,
                       zmq_msg_t *fr) {
    cm_proto_hello h;
    if (cm_proto_hello_decode(zmq_msg_data(fr), zmq_msg_size(fr), &s->lim, &h) != CM_OK) {
        STAT_ADD(s, bad_frames, 1);
        if (cm_chan_warn_ok_(&s->warn))
            CM_LOG_WARN("refused a HELLO: %s", cm_last_error());
        cm_chan_send_error_(s, ident, ident_len, 0, CM_PROTO_ERROR_CORRUPT, "HELLO refused: %s",
                            cm_last_error());
        return;
    }
    if (s->stopping) {
        cm_chan_send_error_(s, ident, ident_len, 0, CM_PROTO_ERROR_SHUTDOWN, "the target-server is stopping");
        return;
    }
    char why[400];
    if (cm_target_identity_differs(why, sizeof why, s->cfg.target_id, s->cfg.weights_id, h.target_id,
                                   h.weights_id, "served here", "asked for")) {
        CM_LOG_WARN("refused trainer '%s': %s", h.name, why);
        cm_chan_send_error_(
            s, ident, ident_len, 0, CM_PROTO_ERROR_TARGET_MISMATCH,
            "target-server '%s' serves another target: %s; connect to the server of the target the drafter "
            "is trained for",
            s->name, why);
        return;
    }
    uint32_t enc = h.encodings & s->cfg.encodings;
    if (!enc && h.encodings == 1u << CM_ENCODING_NCCL) {
        cm_chan_send_error_(
            s, ident, ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
            "target-server '%s' has no NCCL path (it computes on the CPU, or was built without "
            "NCCL); ask for a ZeroMQ encoding such as zstd-byteplane",
            s->name);
        return;
    }
    if (!enc) {
        cm_chan_send_error_(s, ident, ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                            "no common encoding: the server offers mask 0x%x, the trainer accepts 0x%x",
                            s->cfg.encodings, h.encodings);
        return;
    }
    if (ss) {
        cm_chan_end_session_(s, ss, END_REPLACED);
    } else {
        for (uint32_t i = 0; i < s->cfg.max_sessions && !ss; i++)
            if (!s->sessions[i].used && !s->sessions[i].computing)
                ss = &s->sessions[i];
        if (!ss) {
            cm_chan_send_error_(s, ident, ident_len, 0, CM_PROTO_ERROR_BUSY,
                                "the server has its maximum of %u sessions", s->cfg.max_sessions);
            return;
        }
    }
    qjob   *queue = ss->queue;
    int64_t now = cm_now_ms();
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
        st = cm_chan_send_to_(s, ident, ident_len, buf, len);
    pthread_mutex_lock(&s->stats_mu);
    s->stats.sessions_opened++;
    s->stats.sessions_active++;
    pthread_mutex_unlock(&s->stats_mu);
    if (st != CM_OK) {
        CM_LOG_WARN("cannot welcome trainer '%s': %s", ss->name, cm_last_error());
        cm_chan_end_session_(s, ss, END_UNREACHABLE);
        return;
    }
    CM_LOG_INFO("session '%s' from %s on %s: %u credits (asked %u), encodings 0x%x", ss->name, ss->peer,
                s->endpoint, ss->credits, h.credits, enc);
}

/* A trainer offers an NCCL communicator: the worker joins it between jobs (schedule). */
void cm_chan_on_nccl_offer_(cm_chan_server *s, session *ss, zmq_msg_t *fr) {
    cm_proto_nccl o;
    if (cm_proto_nccl_offer_decode(zmq_msg_data(fr), zmq_msg_size(fr), &s->lim, &o) != CM_OK) {
        cm_chan_refuse_frame_(s, ss, ss->ident, ss->ident_len, zmq_msg_data(fr), zmq_msg_size(fr),
                              cm_last_error());
        return;
    }
    if (!s->cfg.nccl) {
        cm_chan_send_error_(
            s, ss->ident, ss->ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
            "target-server '%s' has no NCCL path (it computes on the CPU or was built without "
            "NCCL); use a ZeroMQ encoding such as zstd-byteplane",
            s->name);
        return;
    }
    if (ss->nccl_state != NCCL_NONE) {
        cm_chan_send_error_(s, ss->ident, ss->ident_len, 0, CM_PROTO_ERROR_BAD_REQUEST,
                            "session '%s' already has an NCCL communicator; say HELLO again for a new one",
                            ss->name);
        return;
    }
    ss->nccl_offer = o;
    ss->nccl_state = NCCL_WANTED;
    CM_LOG_INFO("session '%s': joining the NCCL communicator of its GPU %u", ss->name, o.device);
}

/* The REQUEST is decoded here, once, into the loop's request (s->req); a request that passes
 * every check is queued by swapping that struct with the free queue slot's, and goes to its
 * worker the same way (cm_chan_server_sched.c), so its arrays are never decoded or copied
 * again. */
void cm_chan_on_request_(cm_chan_server *s, session *ss, const cm_proto_header *h, const uint8_t *p,
                         size_t len) {
    if (s->stopping) {
        cm_chan_send_error_(s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_SHUTDOWN,
                            "the target-server is stopping");
        return;
    }
    uint32_t T, L;
    if (cm_proto_request_counts(p, len, &T, &L) == CM_OK) {
        /* sizes first, so an oversized batch is a bad request, not a corrupt frame */
        if (T > s->cfg.max_tokens || L > s->cfg.max_req_layers) {
            cm_chan_send_error_(
                s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_BAD_REQUEST,
                "batch %llu has %u tokens and %u layers; this server takes at most %u tokens (--max-tokens) "
                "and %u layers per request",
                (unsigned long long)h->id, T, L, s->cfg.max_tokens, s->cfg.max_req_layers);
            return;
        }
        /* arrays for the counts claimed (without them the decode fails before it needs arrays) */
        if (cm_chan_request_reserve_(&s->req, T, L) != CM_OK) {
            CM_LOG_WARN("session '%s': cannot take batch %llu: %s", ss->name, (unsigned long long)h->id,
                        cm_last_error());
            cm_chan_send_error_(s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_INTERNAL, "%s",
                                cm_last_error());
            return;
        }
    }
    if (cm_proto_request_decode(p, len, &s->lim, &s->req) != CM_OK) {
        STAT_ADD(s, bad_frames, 1);
        if (cm_chan_warn_ok_(&s->warn))
            CM_LOG_WARN("session '%s': refused a REQUEST: %s", ss->name, cm_last_error());
        cm_chan_send_error_(s, ss->ident, ss->ident_len, h->id, CM_PROTO_ERROR_CORRUPT, "REQUEST refused: %s",
                            cm_last_error());
        return;
    }
    const cm_proto_request rq = s->req; /* its arrays stay s->req's until it is queued */
    if (rq.encoding == CM_ENCODING_NCCL && ss->nccl_state != NCCL_UP) {
        cm_chan_send_error_(
            s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_BAD_REQUEST,
            "batch %llu asks for encoding nccl, but this session has no NCCL communicator yet "
            "(send NCCL_OFFER and wait for NCCL_READY)",
            (unsigned long long)rq.batch_id);
        return;
    }
    if (!(ss->encodings >> rq.encoding & 1u)) {
        cm_chan_send_error_(
            s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_BAD_REQUEST,
            "batch %llu asks for encoding %s, which this session did not agree on (mask 0x%x)",
            (unsigned long long)rq.batch_id, cm_encoding_name(rq.encoding), ss->encodings);
        return;
    }
    for (uint32_t i = 0; i < rq.n_layers; i++)
        if ((uint32_t)rq.layer_ids[i] >= s->cfg.n_layers) {
            cm_chan_send_error_(s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_BAD_REQUEST,
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
        dup = ss->queue[(ss->q_head + k) % s->cfg.credits].rq.batch_id == rq.batch_id;
    if (dup) {
        STAT_ADD(s, duplicates, 1);
        return;
    }
    if (ss->q_len + (uint32_t)ss->computing >= ss->credits) {
        cm_chan_send_error_(s, ss->ident, ss->ident_len, rq.batch_id, CM_PROTO_ERROR_NO_CREDIT,
                            "batch %llu exceeds the %u credits of this session",
                            (unsigned long long)rq.batch_id, ss->credits);
        return;
    }
    qjob            *j = &ss->queue[(ss->q_head + ss->q_len) % s->cfg.credits];
    cm_proto_request free_arrays = j->rq; /* the slot's arrays become the loop's next request's */
    j->rq = s->req;
    s->req = free_arrays;
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
