/* tests/tst_dec.h — what the decoding-endpoint tests share (test_cm_dec, test_cm_dec_faults): a fake
 * target for cm_dec_server (its next token after position p is a function of p, so drafts are accepted
 * exactly while they match; "decode" [N, 4] and one F32 layer tensor per layer id, whose values name
 * token, position, layer and column), the server and client configurations, and steps from the
 * client's side checked value by value against the fake target. Header-only; include once, after
 * tst.h. */
#ifndef TST_DEC_H
#define TST_DEC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_dec.h"
#include "tst.h"

#define D_TEST   8
#define MAX_SEQS 8
#define MAX_TOK  256
#define MAX_LAY  4
#define N_LAYERS 8 /* layer ids 0 .. 7 */

static inline void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The fake target: its token after position p, and a hidden state. */
static inline int32_t next_token(uint32_t p) {
    return (int32_t)((p * 7u + 3u) % 1000u);
}
static inline float hidden(int32_t tok, uint32_t pos, int layer, int d) {
    return (float)tok + 0.001f * (float)pos + 10000.0f * (float)layer + 0.125f * (float)d;
}

// ----------------------------------------------------------------------------
// the step callback: sequences with owners and committed tokens

#define MAX_HANDLES 64

typedef struct model {
    pthread_mutex_t mu; /* the test reads what the server's thread writes */
    char            owner[MAX_HANDLES][600];
    uint32_t        committed[MAX_HANDLES];
    uint32_t        next_handle;
    atomic_int      delay_ms, fail_internal; /* set by the test while the server runs */
    atomic_int      entered;                 /* steps begun (before the delay) */
    int             drops, steps;
    char            dropped[600];
    int32_t         dec[MAX_SEQS * 4];
    float          *layers; /* [MAX_LAY][MAX_TOK * D_TEST] */
} model;

static inline cm_status fake_step(void *user, const char *client, const cm_proto_decode *rq,
                                  cm_proto_answer *ans) {
    model *m = user;
    atomic_fetch_add(&m->entered, 1);
    if (atomic_load(&m->delay_ms))
        sleep_ms(atomic_load(&m->delay_ms));
    if (atomic_load(&m->fail_internal))
        return CM_FAIL(CM_ERR_IO, "the test's target fails");
    pthread_mutex_lock(&m->mu);
    m->steps++;
    cm_status st = CM_OK;
    for (uint32_t i = 0; i < rq->n_seqs && st == CM_OK;
         i++) { /* checks first: a failed step changes nothing */
        const cm_proto_decode_seq *q = &rq->seqs[i];
        if (q->handle && (q->handle >= MAX_HANDLES || strcmp(m->owner[q->handle], client) != 0))
            st = CM_FAIL(CM_ERR_INVALID_ARG, "handle %u is not this client's", q->handle);
        else if (q->handle && rq->op == CM_DECODE_STEP && q->base != m->committed[q->handle])
            st = CM_FAIL(CM_ERR_INVALID_ARG, "sequence %u has %u tokens committed, not base %u", q->handle,
                         m->committed[q->handle], q->base);
        else if (!q->handle && m->next_handle + 1 >= MAX_HANDLES)
            st = CM_FAIL(CM_ERR_INVALID_ARG, "too many sequences");
    }
    if (st != CM_OK) {
        pthread_mutex_unlock(&m->mu);
        return st;
    }
    const int32_t *tok = rq->tokens;
    uint32_t       row = 0;
    for (uint32_t i = 0; i < rq->n_seqs; i++) {
        const cm_proto_decode_seq *q = &rq->seqs[i];
        int32_t                   *d = &m->dec[4 * i];
        if (rq->op == CM_DECODE_CLOSE) {
            m->owner[q->handle][0] = '\0';
            d[0] = (int32_t)q->handle, d[1] = 0, d[2] = 0, d[3] = -1;
            continue;
        }
        uint32_t h = q->handle;
        if (!h) {
            h = ++m->next_handle;
            snprintf(m->owner[h], sizeof m->owner[h], "%s", client);
            m->committed[h] = 0;
        }
        uint32_t base = m->committed[h], a = 0;
        while (a < q->n_draft && tok[q->n_ctx + a] == next_token(base + q->n_ctx - 1 + a))
            a++;
        for (uint32_t k = 0; k < q->n_ctx + a; k++, row++)
            for (uint32_t l = 0; l < rq->n_layers; l++)
                for (int c = 0; c < D_TEST; c++)
                    m->layers[(size_t)l * MAX_TOK * D_TEST + (size_t)row * D_TEST + c] =
                        hidden(tok[k], base + k, rq->layer_ids[l], c);
        m->committed[h] = base + q->n_ctx + a;
        d[0] = (int32_t)h, d[1] = (int32_t)m->committed[h], d[2] = (int32_t)a;
        d[3] = next_token(m->committed[h] - 1);
        tok += q->n_ctx + q->n_draft;
    }
    pthread_mutex_unlock(&m->mu);
    cm_proto_tensor *t = &ans->tensors[0];
    snprintf(t->name, sizeof t->name, "decode");
    t->dtype = CM_DTYPE_I32, t->encoding = CM_ENCODING_RAW, t->n_dims = 2;
    t->shape[0] = rq->n_seqs, t->shape[1] = 4;
    t->raw_size = t->encoded_size = 16u * rq->n_seqs;
    t->data = m->dec;
    ans->n_tensors = 1;
    for (uint32_t l = 0; rq->op == CM_DECODE_STEP && l < rq->n_layers; l++) {
        t = &ans->tensors[ans->n_tensors++];
        snprintf(t->name, sizeof t->name, "layer_%d", rq->layer_ids[l]);
        t->dtype = CM_DTYPE_F32, t->encoding = CM_ENCODING_RAW, t->n_dims = 2;
        t->shape[0] = row, t->shape[1] = D_TEST;
        t->raw_size = t->encoded_size = 4ull * row * D_TEST;
        t->data = m->layers + (size_t)l * MAX_TOK * D_TEST;
    }
    return CM_OK;
}

static inline void fake_drop(void *user, const char *client) {
    model *m = user;
    pthread_mutex_lock(&m->mu);
    for (int h = 1; h < MAX_HANDLES; h++)
        if (strcmp(m->owner[h], client) == 0)
            m->owner[h][0] = '\0';
    m->drops++;
    snprintf(m->dropped, sizeof m->dropped, "%s", client);
    pthread_mutex_unlock(&m->mu);
}

static inline void model_init(model *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->layers = calloc((size_t)MAX_LAY * MAX_TOK * D_TEST, sizeof(float));
}

static inline cm_dec_server_config server_config(const char *ep, model *m) {
    cm_dec_server_config c = {.endpoint = ep,
                              .limits = CM_PROTO_LIMITS_DEFAULT,
                              .max_clients = 4,
                              .idle_timeout_ms = 5000,
                              .n_threads = 2,
                              .zstd_level = 1,
                              .step = fake_step,
                              .drop = fake_drop,
                              .user = m};
    c.limits.max_seqs = MAX_SEQS, c.limits.max_tokens = MAX_TOK, c.limits.max_layers = MAX_LAY;
    c.limits.max_layer_id = N_LAYERS;
    return c;
}

static inline cm_dec_client *client_new(const char *ep, int timeout_ms) {
    cm_dec_client_config cc = {.endpoint = ep, .timeout_ms = timeout_ms, .limits = CM_PROTO_LIMITS_DEFAULT};
    cm_dec_client       *c = NULL;
    tst_ok(cm_dec_client_create(&c, &cc), "client create");
    return c;
}

// ----------------------------------------------------------------------------
// steps from the client's side

typedef struct seq {
    uint32_t handle, base;
    int32_t  next; /* the token to send as n_ctx next */
} seq;

static inline cm_proto_decode_seq rec(uint32_t handle, uint32_t base, uint32_t n_ctx, uint32_t n_draft) {
    return (cm_proto_decode_seq){handle, base, n_ctx, n_draft, 0, 0.0f, 1.0f, 0, 0};
}

static cm_proto_tensor g_ans[MAX_LAY + 1];

/* One step; checks every value of the answer against the fake target and updates the seqs. */
static inline cm_status step_checked(cm_dec_client *c, cm_encoding enc, uint32_t n, seq *sq,
                                     const cm_proto_decode_seq *r, const int32_t *tokens, uint32_t n_tokens,
                                     const int32_t *layers, uint32_t n_layers, int *good) {
    cm_proto_decode_seq rs[2 * MAX_SEQS];
    memcpy(rs, r, n * sizeof *r);
    cm_proto_decode rq = {.op = CM_DECODE_STEP,
                          .encoding = enc,
                          .n_seqs = n,
                          .n_tokens = n_tokens,
                          .n_layers = n_layers,
                          .seqs = rs,
                          .tokens = (int32_t *)tokens,
                          .layer_ids = (int32_t *)layers};
    cm_proto_answer ans = {.tensors = g_ans, .cap_tensors = MAX_LAY + 1};
    cm_status       st = cm_dec_client_step(c, &rq, &ans);
    *good = 0;
    if (st != CM_OK)
        return st;
    const int32_t *d = ans.tensors[0].data;
    int            ok = ans.batch_id == rq.id && ans.n_tensors == 1 + n_layers;
    for (uint32_t i = 0; i < ans.n_tensors; i++)
        ok = ok && ((uintptr_t)ans.tensors[i].data % 64) == 0 && ans.tensors[i].encoding == CM_ENCODING_RAW;
    uint32_t row = 0;
    for (uint32_t i = 0; ok && i < n; i++, d += 4) {
        uint32_t base = sq[i].base, a = (uint32_t)d[2];
        for (uint32_t k = 0; ok && k < r[i].n_ctx + a; k++, row++)
            for (uint32_t l = 0; ok && l < n_layers; l++)
                for (int cc = 0; ok && cc < D_TEST; cc++) {
                    const float *x = ans.tensors[1 + l].data;
                    ok = x[row * D_TEST + cc] == hidden(tokens[k], base + k, layers[l], cc);
                }
        sq[i].handle = (uint32_t)d[0];
        sq[i].base = (uint32_t)d[1];
        sq[i].next = d[3];
        ok = ok && d[3] == next_token(sq[i].base - 1);
        tokens += r[i].n_ctx + r[i].n_draft;
    }
    *good = ok;
    return CM_OK;
}

/* Two sequences over several steps with drafts right, wrong and partly right, in encoding enc. */

static inline cm_status new_seq(cm_dec_client *c, seq *sq) {
    cm_proto_decode_seq r = rec(0, 0, 2, 0);
    int32_t             t[2] = {1, 2};
    int                 good;
    cm_status           st = step_checked(c, CM_ENCODING_ZSTD, 1, sq, &r, t, 2, NULL, 0, &good);
    return st == CM_OK && !good ? CM_FAIL(CM_ERR_PROTOCOL, "a wrong answer") : st;
}

static inline cm_status continue_seq(cm_dec_client *c, seq *sq) {
    cm_proto_decode_seq r = rec(sq->handle, sq->base, 1, 0);
    int                 good;
    cm_status           st = step_checked(c, CM_ENCODING_ZSTD, 1, sq, &r, &sq->next, 1, NULL, 0, &good);
    return st == CM_OK && !good ? CM_FAIL(CM_ERR_PROTOCOL, "a wrong answer") : st;
}

#endif /* TST_DEC_H */
