/* common/chan/cm_chan_client_session.c — the trainer's session setup (I/O thread): the WELCOME
 * checked against what this run needs and what the first server served, the encoding chosen,
 * for encoding nccl the communicator offered and joined (the session is ready at NCCL_READY),
 * and the queued batches the WELCOME rules out failed with the reason. */
#include "cm_chan_int.h"

#include <pthread.h>
#include <stdio.h>

#include "cm_cfg_hash.h"
#include "cm_log.h"

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
        cm_chan_client_fatal_(c, CM_ERR_UNSUPPORTED, msg);
        return;
    }
    c->nccl_welcome = *w;
    c->conn = CONN_NCCL;
    cm_chan_client_send_(c, buf, len, now);
    if (c->cfg.nccl->join(c->cfg.nccl->user, &o) != CM_OK) {
        cm_chan_fmt(msg, sizeof msg, "cannot join the NCCL communicator with target-server '%s': %s", w->name,
                    cm_last_error());
        cm_chan_client_fatal_(c, CM_ERR_UNSUPPORTED, msg);
        return;
    }
    c->nccl_joined = 1;
    c->last_recv = cm_now_ms(); /* the join blocked this thread; the server kept talking */
}

void cm_chan_client_on_nccl_ready_(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    uint32_t device;
    if (cm_proto_nccl_ready_decode(p, len, &c->lim, &device) != CM_OK) {
        cm_chan_client_protocol_error_(c, cm_last_error(), 0, 0, now);
        cm_chan_client_lose_session_(c, "a refused NCCL_READY", now);
        return;
    }
    CM_LOG_INFO("client '%s': NCCL communicator with '%s' up (its GPU %u)", c->name, c->nccl_welcome.name,
                device);
    session_ready(c, &c->nccl_welcome);
}

void cm_chan_client_on_welcome_(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    if (c->conn != CONN_HELLO)
        return;
    cm_proto_welcome w;
    if (cm_proto_welcome_decode(p, len, &c->lim, &w) != CM_OK) {
        cm_chan_client_protocol_error_(c, cm_last_error(), 0, 0, now);
        return;
    }
    char msg[512];
    char why[400];
    if (cm_target_identity_differs(why, sizeof why, w.target_id, w.weights_id, c->cfg.target_id,
                                   c->cfg.weights_id, "served", "expected")) {
        cm_chan_fmt(msg, sizeof msg, "target-server '%s' at %s serves another target than this run needs: %s",
                    w.name, c->endpoint, why);
        cm_chan_client_fatal_(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    /* a server that comes back must serve what the first one served: answers of another
     * target, dtype or width would be trained on as if they were the same */
    if (c->have_welcome &&
        cm_target_identity_differs(why, sizeof why, w.target_id, w.weights_id, c->welcome.target_id,
                                   c->welcome.weights_id, "now", "when this run started")) {
        cm_chan_fmt(
            msg, sizeof msg,
            "the server at %s ('%s') now serves another target: %s; restart the run against one target",
            c->endpoint, w.name, why);
        cm_chan_client_fatal_(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    if (c->have_welcome &&
        (w.hidden_dtype != c->welcome.hidden_dtype || w.hidden_size != c->welcome.hidden_size)) {
        cm_chan_fmt(
            msg, sizeof msg,
            "the server at %s now serves %s hidden %u, but this run started with %s hidden %u; restart the "
            "run against one target",
            c->endpoint, cm_dtype_name(w.hidden_dtype), w.hidden_size, cm_dtype_name(c->welcome.hidden_dtype),
            c->welcome.hidden_size);
        cm_chan_client_fatal_(c, CM_ERR_INVALID_ARG, msg);
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
            cm_chan_client_fatal_(c, CM_ERR_INVALID_ARG, msg);
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
        if (cm_chan_client_slot_state_(c, s) != SLOT_QUEUED)
            continue;
        int bad = s->n_tokens > w.max_tokens;
        for (uint32_t k = 0; k < s->n_layers; k++)
            bad |= (uint32_t)s->layers[k] >= w.n_layers;
        if (bad) {
            snprintf(msg, sizeof msg,
                     "batch %llu (%u tokens) does not fit target-server '%s': at most %u tokens, "
                     "layers 0..%u",
                     (unsigned long long)s->batch_id, s->n_tokens, w.name, w.max_tokens, w.n_layers - 1);
            cm_chan_client_complete_(c, s, CM_ERR_INVALID_ARG, msg, 0);
        }
    }
    CM_LOG_INFO("client '%s': session with '%s' on %s: %u credits, %s %s answers, hidden size %u, %u layers",
                c->name, w.name, c->endpoint, w.credits, cm_encoding_name(c->enc),
                cm_dtype_name(w.hidden_dtype), w.hidden_size, w.n_layers);
}
