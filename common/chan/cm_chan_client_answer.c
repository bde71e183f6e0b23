/* common/chan/cm_chan_client_answer.c — what the trainer's I/O thread does with an ANSWER and an
 * ERROR: answers are decoded ahead of time so the trainer never waits on decompression (the
 * decoding runs without the lock, on SENT slots only this thread touches), checked for NaN/Inf
 * and all-zero tensors, and received over NCCL for encoding nccl; an ERROR fails its batch or
 * schedules a re-send, by code. */
#include "cm_chan_int.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

void cm_chan_client_buf_free_(cm_chan_client *c, slot *s) {
    if (s->buf_locked && c->cfg.host_unlock)
        c->cfg.host_unlock(c->cfg.host_user, s->buf);
    free(s->buf);
    s->buf = NULL;
    s->buf_cap = 0;
    s->buf_locked = 0;
}

/* The answer's tensor i as the trainer sees it (data: where it lies, set later when NULL). */
static void describe(cm_chan_tensor *ct, const slot *s, uint32_t i, const cm_proto_tensor *t, cm_dtype hd,
                     uint32_t D, const void *data, int on_device) {
    memcpy(ct->name, t->name, sizeof ct->name);
    ct->layer = s->layers[i];
    ct->dtype = hd;
    ct->n_tokens = s->n_tokens;
    ct->hidden = D;
    ct->bytes = t->raw_size;
    ct->data = data;
    ct->on_device = on_device;
}

/* An ANSWER of encoding nccl: its tensors follow over NCCL and are received whatever happens
 * (into scratch when no one waits for them) so the transfers stay paired with the ANSWERs. */
static void on_nccl_answer(cm_chan_client *c, const cm_proto_answer *a, size_t received, int64_t now) {
    slot       *s = cm_chan_client_find_sent_(c, a->batch_id);
    const void *dev[MAX_TENSORS];
    uint32_t    at = s ? (uint32_t)(s - c->slots) : c->n_slots;
    for (uint32_t i = 0; i < a->n_tensors; i++)
        if (a->tensors[i].encoding != CM_ENCODING_NCCL) {
            char why[160];
            snprintf(why, sizeof why, "answer to batch %llu mixes encoding %s into an nccl session",
                     (unsigned long long)a->batch_id, cm_encoding_name(a->tensors[i].encoding));
            cm_chan_client_protocol_error_(c, why, a->batch_id, 1, now);
            return;
        }
    if (c->cfg.nccl->recv(c->cfg.nccl->user, at, a->n_tensors, a->tensors, dev) != CM_OK) {
        char why[512];
        cm_chan_fmt(why, sizeof why, "NCCL receive of batch %llu failed: %s", (unsigned long long)a->batch_id,
                    cm_last_error());
        cm_chan_client_problem_(c, "%s", why);
        cm_chan_client_lose_session_(c, why, now);
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
        describe(&s->tensors[i], s, i, t, hd, D, dev[i], 1);
    }
    if (why[0]) { /* well paired but not what was asked for: ask again on this session */
        pthread_mutex_lock(&c->mu);
        c->stats.protocol_errors++;
        c->stats.corrupt_answers++;
        pthread_mutex_unlock(&c->mu);
        CM_LOG_WARN("client '%s': %s", c->name, why);
        cm_chan_client_retry_(c, s, CM_ERR_PROTOCOL, why, now, 0);
        return;
    }
    s->attempts = 0;
    cm_chan_client_complete_(c, s, CM_OK, "", received);
}

void cm_chan_client_on_answer_(cm_chan_client *c, zmq_msg_t *head, zmq_msg_t *data, uint64_t id,
                               int64_t now) {
    cm_proto_answer a = {.tensors = c->pt, .cap_tensors = MAX_TENSORS};
    if (cm_proto_answer_decode_parts(zmq_msg_data(head), zmq_msg_size(head), zmq_msg_data(data),
                                     zmq_msg_size(data), &c->lim, &a) != CM_OK) {
        cm_chan_client_protocol_error_(c, cm_last_error(), id, 1, now);
        return;
    }
    if (c->nccl_joined) {
        on_nccl_answer(c, &a, zmq_msg_size(head) + zmq_msg_size(data), now);
        return;
    }
    slot *s = cm_chan_client_find_sent_(c, a.batch_id);
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
        cm_chan_client_buf_free_(c, s);
        s->buf = malloc(total);
        s->buf_cap = s->buf ? total : 0;
        if (!s->buf)
            snprintf(why, sizeof why, "cannot allocate %llu bytes for an answer", (unsigned long long)total);
        else if (c->cfg.host_lock) {
            s->buf_locked = c->cfg.host_lock(c->cfg.host_user, s->buf, total) == CM_OK;
            if (!s->buf_locked && !c->lock_warned++)
                CM_LOG_WARN("client '%s': answers stay in pageable memory (uploads from them are slower): %s",
                            c->name, cm_last_error());
            cm_clear_error();
        }
    }
    uint64_t off = 0;
    for (uint32_t i = 0; i < a.n_tensors && !why[0]; i++) {
        const cm_proto_tensor *t = &a.tensors[i];
        cm_chan_tensor        *ct = &s->tensors[i];
        describe(ct, s, i, t, hd, D, NULL, 0);
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
            cm_scan_values(hd, ct->data, (size_t)s->n_tokens * D, &any_bad, &zero);
            if (any_bad || zero)
                snprintf(why, sizeof why, "answer to batch %llu: %s holds %s", (unsigned long long)a.batch_id,
                         t->name, zero ? "only zeros" : "NaN or Inf values");
        }
    }
    if (why[0]) {
        cm_chan_client_protocol_error_(c, why, a.batch_id, 1, now);
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
    cm_chan_client_complete_(c, s, CM_OK, "", received);
}

void cm_chan_client_on_error_(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now) {
    cm_proto_error e;
    if (cm_proto_error_decode(p, len, &c->lim, &e) != CM_OK) {
        cm_chan_client_protocol_error_(c, cm_last_error(), 0, 0, now);
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
        cm_chan_client_fatal_(c, CM_ERR_PROTOCOL, msg);
        return;
    }
    if (e.code == CM_PROTO_ERROR_TARGET_MISMATCH ||
        (e.code == CM_PROTO_ERROR_BAD_REQUEST && e.batch_id == 0)) {
        cm_chan_client_fatal_(c, CM_ERR_INVALID_ARG, msg);
        return;
    }
    if (e.code == CM_PROTO_ERROR_SHUTDOWN || (e.batch_id == 0 && e.code == CM_PROTO_ERROR_BUSY)) {
        cm_chan_client_lose_session_(c, msg, now);
        return;
    }
    slot *s = e.batch_id ? cm_chan_client_find_sent_(c, e.batch_id) : NULL;
    if (!s) {
        if (e.code == CM_PROTO_ERROR_CORRUPT && c->conn == CONN_HELLO)
            cm_chan_client_lose_session_(c, msg, now); /* HELLO again */
        else
            CM_LOG_WARN("client '%s': %s (%s)", c->name, msg, cm_proto_error_name(e.code));
        return;
    }
    switch (e.code) {
    case CM_PROTO_ERROR_BAD_REQUEST:
        cm_chan_client_complete_(c, s, CM_ERR_INVALID_ARG, msg, 0);
        break;
    case CM_PROTO_ERROR_CORRUPT:
        cm_chan_client_retry_(c, s, CM_ERR_PROTOCOL, msg, now, 0);
        break;
    case CM_PROTO_ERROR_NO_CREDIT:
    case CM_PROTO_ERROR_BUSY:
        s->resend_at = now + 100;
        break;
    default:
        CM_LOG_WARN("client '%s': batch %llu: %s (%s)", c->name, (unsigned long long)s->batch_id, msg,
                    cm_proto_error_name(e.code));
        cm_chan_client_retry_(c, s, CM_ERR_IO, msg, now, 100);
        break;
    }
}
