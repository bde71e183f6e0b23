/* tests/tst_chan.h — what the cm_chan tests share: an in-process server thread whose synthetic
 * compute callback writes values that are a function of token, layer and column (so every
 * answer is checked bit for bit), batches of requests, client configs and a loop that submits
 * batches and checks their answers. Header-only, after tst.h; one test executable includes it
 * once (test_cm_chan.c, test_cm_chan_faults.c). */
#ifndef TST_CHAN_H
#define TST_CHAN_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_chan.h"
#include "cm_log.h"
#include "tst.h"

#define D_TEST 64

static inline void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static inline float syn_value(int32_t tok, int layer, int64_t d) {
    return (float)(tok % 97) * 0.25f + (float)layer * 1.5f + (float)d * 0.0078125f - 3.0f + 0.001f;
}

// ----------------------------------------------------------------------------
// the in-process server

typedef struct syn {
    int             delay_ms;
    volatile int    hold;           /* compute waits while this is set (the test releases it) */
    uint64_t        bad_request_id; /* compute refuses this batch with CM_ERR_INVALID_ARG */
    pthread_mutex_t mu;
    char            order[1024][CM_PROTO_NAME_MAX + 1];
    int             n_order;
} syn;

static inline cm_status syn_compute(void *user, cm_chan_job *job) {
    syn                    *s = user;
    const cm_proto_request *r = job->req;
    if (r->batch_id == s->bad_request_id && s->bad_request_id)
        return CM_FAIL(CM_ERR_INVALID_ARG, "batch %llu is refused by the test",
                       (unsigned long long)r->batch_id);
    pthread_mutex_lock(&s->mu);
    if (s->n_order < 1024)
        snprintf(s->order[s->n_order++], CM_PROTO_NAME_MAX + 1, "%s", job->session);
    pthread_mutex_unlock(&s->mu);
    if (s->delay_ms)
        sleep_ms(s->delay_ms);
    for (int waited = 0; s->hold && waited < 5000; waited++) /* released by the test, or 5 s */
        sleep_ms(1);
    for (uint32_t i = 0; i < r->n_layers; i++) {
        float *o = job->out[i];
        for (uint32_t t = 0; t < r->n_tokens; t++)
            for (uint32_t d = 0; d < job->hidden_size; d++)
                o[(size_t)t * job->hidden_size + d] = syn_value(r->tokens[t], r->layer_ids[i], d);
    }
    return CM_OK;
}

typedef struct server {
    cm_chan_server *srv;
    pthread_t       th;
    cm_status       run_status;
    syn             syn;
} server;

static inline void *server_main(void *arg) {
    server *s = arg;
    s->run_status = cm_chan_server_run(s->srv);
    return NULL;
}

static inline cm_chan_server_config server_config(const char *ep, server *s) {
    cm_chan_server_config cfg = CM_CHAN_SERVER_CONFIG_DEFAULT;
    cfg.endpoint = ep;
    cfg.name = "test-target";
    cfg.target_id = 0x1234abcdull;
    cfg.weights_id = 0x77aa55ull;
    cfg.hidden_size = D_TEST;
    cfg.n_layers = 8;
    cfg.max_tokens = 512;
    cfg.encodings = (1u << CM_ENCODING_END) - 1;
    cfg.heartbeat_ms = 100;
    cfg.peer_timeout_ms = 1000;
    cfg.n_threads = 2;
    cfg.compute = syn_compute;
    cfg.user = &s->syn;
    return cfg;
}

static inline int server_start(server *s, const cm_chan_server_config *cfg) {
    if (cm_chan_server_create(&s->srv, cfg) != CM_OK) {
        fprintf(stderr, "server create: %s\n", cm_last_error());
        return 0;
    }
    pthread_create(&s->th, NULL, server_main, s);
    return 1;
}

static inline void server_stop(server *s) {
    if (!s->srv)
        return;
    cm_chan_server_stop(s->srv);
    pthread_join(s->th, NULL);
    TST_CHECK(s->run_status == CM_OK);
    cm_chan_server_destroy(&s->srv);
}

// ----------------------------------------------------------------------------
// batches and clients

typedef struct batch {
    uint64_t id;
    uint32_t T, N, L;
    int32_t  tokens[512], cu[4], layers[4];
} batch;

static inline void make_batch(batch *b, uint64_t id, uint32_t T) {
    b->id = id;
    b->T = T;
    b->N = T >= 4 ? 2 : 1;
    b->L = 2;
    for (uint32_t t = 0; t < T; t++)
        b->tokens[t] = (int32_t)((id * 31 + t * 7) % 1000);
    b->cu[0] = 0;
    b->cu[1] = b->N == 2 ? (int32_t)T / 3 : (int32_t)T;
    b->cu[b->N] = (int32_t)T;
    b->layers[0] = (int32_t)(id % 5) + 1; /* not sorted: the answer follows this order */
    b->layers[1] = 0;
}

static inline cm_status submit(cm_chan_client *c, const batch *b) {
    return cm_chan_client_submit(c, b->id, b->tokens, b->T, b->cu, b->N, b->layers, b->L);
}

/* 1 if the answer holds exactly the synthetic values of b (fp8: within its documented bound). */
static inline int answer_ok(const cm_chan_answer *a, const batch *b, cm_dtype dt, int lossy) {
    if (a->status != CM_OK || a->batch_id != b->id || a->n_tensors != b->L) {
        fprintf(stderr, "answer %llu: status %s (%s), %u tensors\n", (unsigned long long)a->batch_id,
                cm_status_str(a->status), a->message, a->n_tensors);
        return 0;
    }
    for (uint32_t i = 0; i < b->L; i++) {
        const cm_chan_tensor *t = &a->tensors[i];
        if (t->layer != b->layers[i] || t->dtype != dt || t->n_tokens != b->T || t->hidden != D_TEST)
            return 0;
        for (uint32_t r = 0; r < b->T; r++)
            for (int d = 0; d < D_TEST; d++) {
                float  v = syn_value(b->tokens[r], b->layers[i], d);
                size_t k = (size_t)r * D_TEST + d;
                float  got = dt == CM_DTYPE_BF16 ? cm_bf16_to_f32(((const uint16_t *)t->data)[k])
                                                 : ((const float *)t->data)[k];
                int    ok;
                if (lossy)
                    ok = fabsf(got - v) <= 0.075f * fabsf(v) + 0.002f;
                else if (dt == CM_DTYPE_BF16)
                    ok = ((const uint16_t *)t->data)[k] == cm_f32_to_bf16(v);
                else
                    ok = memcmp(&got, &v, 4) == 0;
                if (!ok) {
                    fprintf(stderr, "answer %llu layer %d [%u, %d]: got %g, want %g\n",
                            (unsigned long long)b->id, b->layers[i], r, d, got, v);
                    return 0;
                }
            }
    }
    return 1;
}

static inline cm_chan_client_config client_config(const char *ep, const char *name) {
    cm_chan_client_config cfg = CM_CHAN_CLIENT_CONFIG_DEFAULT;
    cfg.endpoint = ep;
    cfg.name = name;
    cfg.heartbeat_ms = 100;
    cfg.peer_timeout_ms = 1000;
    cfg.request_timeout_ms = 5000;
    cfg.reconnect_ms = 50;
    return cfg;
}

/* Runs n batches (ids first_id..) through c, keeping it full; checks every answer and that each
 * id arrives exactly once. Returns the number of good answers. */
static inline int run_batches(cm_chan_client *c, uint64_t first_id, int n, uint32_t T, cm_dtype dt,
                              int lossy) {
    static batch bs[256];
    int          seen[256] = {0}, next = 0, got = 0, good = 0;
    batch       *mine = calloc((size_t)n, sizeof *mine);
    for (int i = 0; i < n; i++)
        make_batch(&mine[i], first_id + (uint64_t)i, T);
    (void)bs;
    int64_t deadline = (int64_t)time(NULL) + 30;
    while (got < n && time(NULL) < deadline) {
        while (next < n && submit(c, &mine[next]) == CM_OK)
            next++;
        cm_chan_answer *a;
        if (cm_chan_client_recv(c, 200, &a) != CM_OK)
            continue;
        int idx = (int)(a->batch_id - first_id);
        if (idx >= 0 && idx < n) {
            seen[idx]++;
            good += answer_ok(a, &mine[idx], dt, lossy);
        }
        got++;
        cm_chan_client_release(c, &a);
    }
    for (int i = 0; i < n; i++)
        if (seen[i] != 1) {
            fprintf(stderr, "batch %llu delivered %d times\n", (unsigned long long)(first_id + (uint64_t)i),
                    seen[i]);
            good = -1;
            break;
        }
    free(mine);
    return good;
}

#endif /* TST_CHAN_H */
