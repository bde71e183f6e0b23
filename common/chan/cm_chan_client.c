/* common/chan/cm_chan_client.c — the trainer's end of a session, owner side (see cm_chan.h): the
 * owner thread submits requests into `credits` slots and receives completed answers, while
 * the I/O thread (cm_chan_client_io.c) owns the socket. Slot states move FREE → QUEUED → SENT
 * → READY → HELD → FREE under `mu`; a slot's arrays and buffers belong to whichever thread its
 * state says (owner: FREE and HELD; I/O: QUEUED and SENT). */
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

// ----------------------------------------------------------------------------
// the owner's API

static void wake(cm_chan_client *c) { /* any thread */
    char b = 1;
    while (write(c->wake_w, &b, 1) < 0 && errno == EINTR) {
    }
}

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
    if (s->has_head) {
        zmq_msg_close(&s->head_raw);
        s->has_head = 0;
    }
    s->state = SLOT_FREE;
    pthread_mutex_unlock(&c->mu);
    *a = NULL;
}

cm_status cm_chan_client_frames(cm_chan_client *c, const cm_chan_answer *a, const void **head,
                                size_t *head_len, const void **data, size_t *data_len) {
    if (!c || !a || !head || !head_len || !data || !data_len)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_client_frames: NULL argument");
    slot *s = (slot *)a; /* ans is the first member */
    if (s < c->slots || s >= c->slots + c->n_slots)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_client_frames: not an answer of this client");
    pthread_mutex_lock(&c->mu);
    const int ok = s->state == SLOT_HELD && s->has_head && s->has_raw;
    pthread_mutex_unlock(&c->mu);
    if (!ok)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "batch %llu: no ANSWER parts kept (a failed answer, or the client was created "
                       "without keep_frames)",
                       (unsigned long long)a->batch_id);
    *head = zmq_msg_data(&s->head_raw);
    *head_len = zmq_msg_size(&s->head_raw);
    *data = zmq_msg_data(&s->raw);
    *data_len = zmq_msg_size(&s->raw);
    return CM_OK;
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
    if (cfg->encoding == CM_ENCODING_NCCL) {
        const cm_chan_nccl_client *n = cfg->nccl;
        if (!n || !n->offer || !n->join || !n->recv || !n->leave)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "encoding nccl needs a trainer on a GPU with NCCL (the client's NCCL hooks)");
        if (cfg->accept & ~(1u << CM_ENCODING_NCCL))
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "encoding nccl delivers to GPU memory; it cannot fall back to host encodings "
                           "(accept mask must be 0)");
        if (cfg->keep_frames)
            return CM_FAIL(CM_ERR_INVALID_ARG, "keep_frames stores encoded bytes; encoding nccl has none");
    } else if (cfg->accept >> CM_ENCODING_NCCL & 1u) {
        return CM_FAIL(CM_ERR_INVALID_ARG, "encoding nccl cannot be a fallback; ask for it as the encoding");
    }

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
    CM_TRY_GOTO(cm_chan_pipe_(&c->wake_r, &c->wake_w, "the client's wake pipe"), st, fail);
    if (!(c->ctx = zmq_ctx_new())) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    if (pthread_create(&c->io, NULL, cm_chan_client_io_main_, c) != 0) {
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
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    if (c->slots)
        for (uint32_t i = 0; i < c->n_slots; i++) {
            slot *s = &c->slots[i];
            if (s->has_raw)
                zmq_msg_close(&s->raw);
            if (s->has_head)
                zmq_msg_close(&s->head_raw);
            free(s->tokens);
            free(s->cu);
            free(s->layers);
            free(s->frame);
            free(s->tensors);
            cm_chan_client_buf_free_(c, s);
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
