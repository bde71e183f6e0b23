/* tests/test_cm_dec.c — the decoding endpoint (cm_dec.h) over real sockets (tcp://127.0.0.1:* and
 * ipc://): a server whose step callback is a fake target (its next token after position p is a
 * function of p, so drafts are accepted exactly while they match; "decode" [N, 4] and one F32 layer
 * tensor per layer id, whose values name token, position, layer and column), real clients in every
 * encoding, and the refusals: bad-request from the callback (a wrong base, another client's handle)
 * and from the limits, internal, corrupt frames and another version sent raw over a DEALER, a
 * malformed step refused by the client before sending, the idle timeout calling drop, busy beyond
 * max_clients, ERROR shutdown to a step waiting when the server stops, a client's timeout once it
 * has stopped, a fake server whose stale, corrupt or inconsistent answers the client refuses, an
 * answer sent just before the server closes that a stopped client still finds, and CURVE with an
 * accepted and a refused key. */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_chan.h"
#include "cm_dec.h"
#include "cm_hash.h"
#include "cm_log.h"
#include "cm_time.h"
#include "tst.h"

#define D_TEST   8
#define MAX_SEQS 8
#define MAX_TOK  256
#define MAX_LAY  4
#define N_LAYERS 8 /* layer ids 0 .. 7 */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The fake target: its token after position p, and a hidden state. */
static int32_t next_token(uint32_t p) {
    return (int32_t)((p * 7u + 3u) % 1000u);
}
static float hidden(int32_t tok, uint32_t pos, int layer, int d) {
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

static cm_status fake_step(void *user, const char *client, const cm_proto_decode *rq, cm_proto_answer *ans) {
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

static void fake_drop(void *user, const char *client) {
    model *m = user;
    pthread_mutex_lock(&m->mu);
    for (int h = 1; h < MAX_HANDLES; h++)
        if (strcmp(m->owner[h], client) == 0)
            m->owner[h][0] = '\0';
    m->drops++;
    snprintf(m->dropped, sizeof m->dropped, "%s", client);
    pthread_mutex_unlock(&m->mu);
}

static void model_init(model *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->layers = calloc((size_t)MAX_LAY * MAX_TOK * D_TEST, sizeof(float));
}

static cm_dec_server_config server_config(const char *ep, model *m) {
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

static cm_dec_client *client_new(const char *ep, int timeout_ms) {
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

static cm_proto_decode_seq rec(uint32_t handle, uint32_t base, uint32_t n_ctx, uint32_t n_draft) {
    return (cm_proto_decode_seq){handle, base, n_ctx, n_draft, 0, 0.0f, 1.0f, 0, 0};
}

static cm_proto_tensor g_ans[MAX_LAY + 1];

/* One step; checks every value of the answer against the fake target and updates the seqs. */
static cm_status step_checked(cm_dec_client *c, cm_encoding enc, uint32_t n, seq *sq,
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
static void run_session(cm_dec_client *c, cm_encoding enc, int *steps, int *good_steps) {
    seq                 sq[2] = {{0}};
    int32_t             layers[2] = {5, 1};
    int32_t             prompt[9] = {151, 152, 153, 154, 155, 21, 22, 23, 24};
    int                 good;
    cm_proto_decode_seq r[2] = {rec(0, 0, 5, 0), rec(0, 0, 4, 0)};
    TST_CHECK(step_checked(c, enc, 2, sq, r, prompt, 9, layers, 2, &good) == CM_OK && good);
    *steps += 1, *good_steps += good;
    TST_CHECK(sq[0].handle && sq[1].handle && sq[0].handle != sq[1].handle && sq[0].base == 5 &&
              sq[1].base == 4);
    for (int it = 0; it < 4; it++) {
        /* sequence 0: 3 drafts, the first `it` right; sequence 1: 2 drafts, all right */
        int32_t t[7];
        t[0] = sq[0].next;
        for (int k = 0; k < 3; k++)
            t[1 + k] = k < it ? next_token(sq[0].base + (uint32_t)k) : 999 - k;
        t[4] = sq[1].next;
        t[5] = next_token(sq[1].base), t[6] = next_token(sq[1].base + 1);
        uint32_t b0 = sq[0].base, b1 = sq[1].base;
        r[0] = rec(sq[0].handle, sq[0].base, 1, 3), r[1] = rec(sq[1].handle, sq[1].base, 1, 2);
        TST_CHECK(step_checked(c, enc, 2, sq, r, t, 7, layers, 2, &good) == CM_OK && good);
        *steps += 1, *good_steps += good;
        TST_CHECK(sq[0].base == b0 + 1 + (uint32_t)(it < 3 ? it : 3) && sq[1].base == b1 + 3);
    }
    /* close both: the decode tensor alone */
    cm_proto_decode_seq cl[2] = {rec(sq[0].handle, 0, 0, 0), rec(sq[1].handle, 0, 0, 0)};
    cm_proto_decode     rq = {.op = CM_DECODE_CLOSE, .encoding = enc, .n_seqs = 2, .seqs = cl};
    cm_proto_answer     ans = {.tensors = g_ans, .cap_tensors = MAX_LAY + 1};
    TST_CHECK(tst_ok(cm_dec_client_step(c, &rq, &ans), "close") && ans.n_tensors == 1);
    const int32_t *d = ans.tensors[0].data;
    TST_CHECK(d[0] == (int32_t)sq[0].handle && d[3] == -1 && d[4] == (int32_t)sq[1].handle && d[7] == -1);
    /* a closed handle is gone */
    r[0] = rec(sq[0].handle, sq[0].base, 1, 0);
    int32_t one = 5;
    TST_FAILS(step_checked(c, enc, 1, sq, r, &one, 1, layers, 0, &good), CM_ERR_INVALID_ARG, "bad-request",
              "not this client's");
}

static void test_round_trip(const char *ep) {
    model m;
    model_init(&m);
    cm_dec_server       *s = NULL;
    cm_dec_server_config cfg = server_config(ep, &m);
    if (!tst_ok(cm_dec_server_start(&s, &cfg), "server start"))
        return;
    cm_dec_client *c = client_new(cm_dec_server_endpoint(s), 5000);
    int            steps = 0, good = 0;
    for (cm_encoding e = CM_ENCODING_RAW; e <= CM_ENCODING_ZSTD_BYTEPLANE; e++)
        run_session(c, e, &steps, &good);
    cm_dec_client_destroy(&c);
    cm_dec_server_stop(&s);
    TST_CHECK(s == NULL && m.drops == 1 && strncmp(m.dropped, "dec-", 4) == 0);
    printf(
        "round trip on %s: %d/%d steps exact in raw, zstd and zstd-byteplane; the client dropped at stop\n",
        strncmp(ep, "ipc", 3) == 0 ? "ipc://" : "tcp://", good, steps);
    TST_CHECK(steps == 15 && good == steps);
    free(m.layers);
}

// ----------------------------------------------------------------------------
// refusals

/* One frame from a raw DEALER (parts > 1: sent that many times as one message), one reply; its
 * type (0: none within 3 s), the ERROR decoded into e. */
static int raw_exchange(void *d, const void *f, size_t len, int parts, cm_proto_error *e) {
    for (int i = 1; i < parts; i++)
        zmq_send(d, f, len, ZMQ_SNDMORE);
    zmq_send(d, f, len, 0);
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 3000) <= 0)
        return 0;
    uint8_t         buf[4096];
    int             n = zmq_recv(d, buf, sizeof buf, 0);
    cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    cm_proto_header h;
    if (n < 0 || cm_proto_peek(buf, (size_t)n, &lim, &h) != CM_OK)
        return 0;
    if (h.type == CM_PROTO_TYPE_ERROR && cm_proto_error_decode(buf, (size_t)n, &lim, e) != CM_OK)
        return 0;
    return h.type;
}

static void reseal(uint8_t *f, size_t len) {
    tst_put64(f + 40, cm_xxh64(f + CM_PROTO_HEADER_SIZE, len - CM_PROTO_HEADER_SIZE, 0));
    tst_put64(f + 48, cm_xxh64(f, 48, 0));
}

static void test_refusals(void) {
    model m;
    model_init(&m);
    cm_dec_server       *s = NULL;
    cm_dec_server_config cfg = server_config("tcp://127.0.0.1:*", &m);
    if (!tst_ok(cm_dec_server_start(&s, &cfg), "server start"))
        return;
    const char         *ep = cm_dec_server_endpoint(s);
    cm_dec_client      *c = client_new(ep, 5000), *other = client_new(ep, 5000);
    seq                 sq[1] = {{0}};
    int32_t             t[MAX_TOK + 1] = {7, 8, 9}, lay[MAX_LAY + 1] = {2, 3, 4, 5, 6};
    int                 good;
    cm_proto_decode_seq r[MAX_SEQS + 1];
    r[0] = rec(0, 0, 3, 0);
    TST_CHECK(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 3, lay, 1, &good) == CM_OK && good);
    /* the callback's refusals: a wrong base, another client's handle; nothing changes */
    r[0] = rec(sq[0].handle, sq[0].base + 1, 1, 0);
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 1, lay, 1, &good), CM_ERR_INVALID_ARG,
              "bad-request", "not base 4");
    seq theirs[1] = {sq[0]};
    r[0] = rec(sq[0].handle, sq[0].base, 1, 0);
    TST_FAILS(step_checked(other, CM_ENCODING_RAW, 1, theirs, r, t, 1, lay, 1, &good), CM_ERR_INVALID_ARG,
              "not this client's");
    TST_CHECK(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 1, lay, 1, &good) == CM_OK && good &&
              sq[0].base == 4);
    /* the limits: too many sequences, tokens or layers, a layer the target lacks */
    for (int i = 0; i <= MAX_SEQS; i++)
        r[i] = rec(0, 0, 1, 0);
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, MAX_SEQS + 1, sq, r, t, MAX_SEQS + 1, lay, 1, &good),
              CM_ERR_INVALID_ARG, "9 sequences", "at most 8");
    r[0] = rec(0, 0, MAX_TOK, 1);
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, MAX_TOK + 1, lay, 1, &good), CM_ERR_INVALID_ARG,
              "257 tokens");
    r[0] = rec(0, 0, 1, 0);
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 1, lay, MAX_LAY + 1, &good), CM_ERR_INVALID_ARG,
              "5 layers");
    lay[4] = N_LAYERS;
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 1, lay + 4, 1, &good), CM_ERR_INVALID_ARG,
              "asks for layer 8", "layers 0 to 7");
    /* a step the client cannot send: refused before anything goes out */
    r[0] = rec(0, 3, 1, 0);
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 1, lay, 1, &good), CM_ERR_INVALID_ARG, "base");
    TST_FAILS(step_checked(c, CM_ENCODING_FP8_ZSTD, 1, sq, r, t, 1, lay, 1, &good), CM_ERR_INVALID_ARG,
              "encoding");
    /* the callback fails otherwise: internal */
    atomic_store(&m.fail_internal, 1);
    r[0] = rec(sq[0].handle, sq[0].base, 1, 0);
    TST_FAILS(step_checked(c, CM_ENCODING_RAW, 1, sq, r, t, 1, lay, 1, &good), CM_ERR_PEER_GONE, "internal",
              "the test's target fails");
    atomic_store(&m.fail_internal, 0);

    /* frames sent raw over a DEALER */
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int   zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    zmq_connect(d, ep);
    cm_proto_error      e;
    uint8_t             f[1024], g[1024];
    size_t              len;
    cm_proto_decode_seq one = rec(0, 0, 3, 0);
    cm_proto_decode     rq = {
            .id = 77, .op = CM_DECODE_STEP, .n_seqs = 1, .n_tokens = 3, .seqs = &one, .tokens = t};
    TST_CHECK(cm_proto_decode_encode(&rq, f, sizeof f, &len) == CM_OK);
    TST_CHECK(raw_exchange(d, f, len, 1, &e) == CM_PROTO_TYPE_ANSWER); /* a good one is answered */
    memcpy(g, f, len);
    g[len - 1] ^= 1; /* a body byte: the body checksum */
    TST_CHECK(raw_exchange(d, g, len, 1, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_CORRUPT &&
              e.batch_id == 77 && strstr(e.message, "checksum"));
    TST_CHECK(raw_exchange(d, f, 30, 1, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_CORRUPT &&
              strstr(e.message, "truncated"));
    memcpy(g, f, len);
    g[4] = CM_PROTO_VERSION + 1; /* another version, well sealed */
    reseal(g, len);
    TST_CHECK(raw_exchange(d, g, len, 1, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_VERSION &&
              strstr(e.message, "protocol version"));
    memcpy(g, f, len);
    tst_put32(g + CM_PROTO_HEADER_SIZE + 20 + 24, 0); /* top_p 0, sealed: the field check */
    reseal(g, len);
    TST_CHECK(raw_exchange(d, g, len, 1, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_CORRUPT &&
              e.batch_id == 77 && strstr(e.message, "top_p"));
    TST_CHECK(raw_exchange(d, f, len, 2, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_CORRUPT &&
              strstr(e.message, "2 parts"));
    TST_CHECK(cm_proto_heartbeat_encode(5, g, sizeof g, &len) == CM_OK);
    TST_CHECK(raw_exchange(d, g, len, 1, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_BAD_REQUEST &&
              strstr(e.message, "HEARTBEAT frame"));
    zmq_close(d);
    zmq_ctx_term(ctx);
    printf("refusals: bad-request (base, handle, limits, layer), internal, corrupt (checksum, truncation, "
           "field, "
           "parts), version, another type\n");
    cm_dec_client_destroy(&c);
    cm_dec_client_destroy(&other);
    cm_dec_server_stop(&s);
    TST_CHECK(m.drops == 3); /* c, other, and the raw DEALER, whose good DECODE gave it state */
    free(m.layers);
}

// ----------------------------------------------------------------------------
// clients: idle, busy, stop

static cm_status new_seq(cm_dec_client *c, seq *sq) {
    cm_proto_decode_seq r = rec(0, 0, 2, 0);
    int32_t             t[2] = {1, 2};
    int                 good;
    cm_status           st = step_checked(c, CM_ENCODING_ZSTD, 1, sq, &r, t, 2, NULL, 0, &good);
    return st == CM_OK && !good ? CM_FAIL(CM_ERR_PROTOCOL, "a wrong answer") : st;
}

static cm_status continue_seq(cm_dec_client *c, seq *sq) {
    cm_proto_decode_seq r = rec(sq->handle, sq->base, 1, 0);
    int                 good;
    cm_status           st = step_checked(c, CM_ENCODING_ZSTD, 1, sq, &r, &sq->next, 1, NULL, 0, &good);
    return st == CM_OK && !good ? CM_FAIL(CM_ERR_PROTOCOL, "a wrong answer") : st;
}

static void test_idle_and_busy(void) {
    model m;
    model_init(&m);
    cm_dec_server       *s = NULL;
    cm_dec_server_config cfg = server_config("tcp://127.0.0.1:*", &m);
    cfg.idle_timeout_ms = 1000; /* far above a's 60 ms pace even on a loaded 2-core machine */
    cfg.max_clients = 2;
    if (!tst_ok(cm_dec_server_start(&s, &cfg), "server start"))
        return;
    const char    *ep = cm_dec_server_endpoint(s);
    cm_dec_client *a = client_new(ep, 3000), *b = client_new(ep, 3000), *c = client_new(ep, 3000);
    seq            sa = {0}, sb = {0}, sc = {0};
    TST_CHECK(new_seq(a, &sa) == CM_OK && new_seq(b, &sb) == CM_OK);
    TST_FAILS(new_seq(c, &sc), CM_ERR_PEER_GONE, "busy", "at most 2 clients");
    /* a steps every 60 ms and stays; b is silent and goes after 1000 ms; then c gets in */
    enum { STEPS = 25 };
    for (int i = 0; i < STEPS; i++) {
        sleep_ms(60);
        TST_CHECK(continue_seq(a, &sa) == CM_OK);
    }
    pthread_mutex_lock(&m.mu);
    int drops = m.drops;
    pthread_mutex_unlock(&m.mu);
    TST_CHECK(drops == 1);
    TST_CHECK(new_seq(c, &sc) == CM_OK);
    TST_FAILS(continue_seq(b, &sb), CM_ERR_PEER_GONE, "busy"); /* b is a new client now, and full */
    TST_CHECK(continue_seq(a, &sa) == CM_OK && sa.base == 2 + STEPS + 1);
    cm_dec_client_destroy(&a);
    cm_dec_client_destroy(&b);
    cm_dec_client_destroy(&c);
    cm_dec_server_stop(&s);
    printf("idle and busy: the silent client dropped after the idle timeout, the busy one let in then; %d "
           "drops\n",
           m.drops);
    TST_CHECK(m.drops == 3);
    free(m.layers);
}

typedef struct bg_step {
    cm_dec_client *c;
    seq            sq;
    cm_status      st;
    char           msg[512];
} bg_step;

static void *bg_main(void *arg) {
    bg_step *b = arg;
    b->st = new_seq(b->c, &b->sq);
    snprintf(b->msg, sizeof b->msg, "%s", cm_last_error());
    return NULL;
}

/* The step in progress finishes, the one waiting gets ERROR shutdown, every client is dropped;
 * then a client's step times out. */
static void test_stop(void) {
    model m;
    model_init(&m);
    char ipc[128];
    snprintf(ipc, sizeof ipc, "ipc:///tmp/tandem-dec-%d-stop.ipc", (int)getpid());
    cm_dec_server       *s = NULL;
    cm_dec_server_config cfg = server_config(ipc, &m);
    if (!tst_ok(cm_dec_server_start(&s, &cfg), "server start"))
        return;
    const char *ep = cm_dec_server_endpoint(s);
    /* a's step is answered after the server's 2 s inside it; b's request must reach the server
     * while a's step runs (1 s is left for that: a loaded machine, ASan on two cores, once took
     * more than the 300 ms this had). Both wait up to 5 s; b's timeout is the one measured below */
    bg_step     a = {.c = client_new(ep, 5000)}, b = {.c = client_new(ep, 5000)};
    seq         warm = {0};
    TST_CHECK(new_seq(a.c, &warm) == CM_OK && new_seq(b.c, &warm) == CM_OK); /* both connected */
    /* a's step begins (the server is then inside it for 1 s), then b's request waits behind it; on
     * a loaded machine fixed sleeps could let b go first, so a's start is observed */
    atomic_store(&m.delay_ms, 2000);
    const int e0 = atomic_load(&m.entered);
    pthread_t ta, tb;
    pthread_create(&ta, NULL, bg_main, &a);
    for (int i = 0; i < 1000 && atomic_load(&m.entered) == e0; i++)
        sleep_ms(10);
    pthread_create(&tb, NULL, bg_main, &b);
    sleep_ms(1000);
    int64_t t0 = cm_now_ms();
    cm_dec_server_stop(&s);
    int64_t stop_ms = cm_now_ms() - t0;
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    TST_CHECK(a.st == CM_OK);
    if (a.st != CM_OK) fprintf(stderr, "the step in progress at the stop failed: %s\n", a.msg);
    TST_CHECK(b.st == CM_ERR_PEER_GONE && strstr(b.msg, "shutdown"));
    if (b.st != CM_ERR_PEER_GONE || !strstr(b.msg, "shutdown"))
        fprintf(stderr, "the waiting step at the stop: %s: %s\n", cm_status_str(b.st), b.msg);
    TST_CHECK(m.drops == 2);
    char path[128];
    snprintf(path, sizeof path, "/tmp/tandem-dec-%d-stop.ipc", (int)getpid());
    TST_CHECK(access(path, F_OK) != 0); /* the socket file is gone with the server */
    /* The next step times out. Whether it was sent depends on whether the client's socket monitor has
     * reported the closed connection yet (ZeroMQ's I/O thread, asynchronous): if so, "not sent";
     * if not, it went into the dead connection and the client says it may or may not have run. A
     * loaded machine (CI on two cores) sees the second. Either is the client's contract. */
    int64_t t1 = cm_now_ms();
    cm_clear_error();
    const cm_status late = new_seq(b.c, &warm);
    int64_t         waited = cm_now_ms() - t1;
    const int       unsent = strstr(cm_last_error(), "not sent") != NULL;
    const int ok = late == CM_ERR_TIMEOUT && (unsent || strstr(cm_last_error(), "may or may not have run"));
    TST_CHECK(ok);
    if (!ok)
        fprintf(stderr, "the step after the stop: %s: %s\n", cm_status_str(late), cm_last_error());
    printf("stop: took %lld ms (the step in progress finished), the waiting step got shutdown; then a step "
           "timed out after %lld ms (%s)\n",
           (long long)stop_ms, (long long)waited,
           unsent ? "not sent" : "sent before the client saw the close");
    TST_CHECK(waited >= 4900 && waited < 8000);
    cm_dec_client_destroy(&a.c);
    cm_dec_client_destroy(&b.c);
    free(m.layers);
}

// ----------------------------------------------------------------------------
// a fake server: what the client refuses

enum {
    FAKE_STALE_THEN_GOOD,
    FAKE_FLIPPED,
    FAKE_TOO_MANY_ACCEPTED,
    FAKE_NO_LAYER,
    FAKE_SILENT,
    FAKE_GOOD,
    FAKE_N
};

typedef struct fake {
    void *ctx, *router;
    char  endpoint[256];
    int   served, bad; /* read by the test after the join (no checks on the fake's thread) */
} fake;

/* The answer to rq (n_draft 0, encoding raw): handles kept or 100 + i, nothing accepted, next 1,
 * zero hidden states; edited as case k says. */
static size_t fake_answer(fake *f, const cm_proto_decode *rq, int k, uint64_t id, uint8_t *buf, size_t cap) {
    static int32_t  dec[MAX_SEQS * 4];
    static float    zeros[MAX_TOK * D_TEST];
    cm_proto_tensor t[MAX_LAY + 1];
    uint32_t        rows = 0;
    memset(t, 0, sizeof t);
    for (uint32_t i = 0; i < rq->n_seqs; i++) {
        const cm_proto_decode_seq *q = &rq->seqs[i];
        dec[4 * i] = (int32_t)(q->handle ? q->handle : 100 + i);
        dec[4 * i + 1] = (int32_t)(q->base + q->n_ctx);
        dec[4 * i + 2] = k == FAKE_TOO_MANY_ACCEPTED ? 1 : 0;
        dec[4 * i + 3] = 1;
        rows += q->n_ctx;
    }
    uint32_t n = 1 + rq->n_layers - (k == FAKE_NO_LAYER);
    snprintf(t[0].name, sizeof t[0].name, "decode");
    t[0].dtype = CM_DTYPE_I32, t[0].n_dims = 2, t[0].shape[0] = rq->n_seqs, t[0].shape[1] = 4;
    t[0].raw_size = t[0].encoded_size = 16u * rq->n_seqs, t[0].data = dec;
    for (uint32_t l = 1; l < n; l++) {
        snprintf(t[l].name, sizeof t[l].name, "layer_%d", rq->layer_ids[l - 1]);
        t[l].dtype = CM_DTYPE_F32, t[l].n_dims = 2, t[l].shape[0] = rows, t[l].shape[1] = D_TEST;
        t[l].raw_size = t[l].encoded_size = 4ull * rows * D_TEST, t[l].data = zeros;
    }
    cm_proto_answer a = {.batch_id = id, .n_tensors = n, .tensors = t};
    size_t          len = 0;
    f->bad += cm_proto_answer_encode(&a, buf, cap, &len) != CM_OK;
    if (k == FAKE_FLIPPED)
        buf[len - 1] ^= 0x40; /* a data byte: the tensor's checksum */
    return len;
}

/* One DECODE from the fake's router into rq (whose arrays are static: one reader at a time); 1 on
 * success. */
static int fake_recv(fake *f, uint8_t ident[256], int *il, cm_proto_decode *rq) {
    static cm_proto_decode_seq seqs[MAX_SEQS];
    static int32_t             tok[MAX_TOK], lay[MAX_LAY];
    static uint8_t             frame[8192];
    cm_proto_limits            lim = CM_PROTO_LIMITS_DEFAULT;
    *il = zmq_recv(f->router, ident, 256, 0);
    int fl = zmq_recv(f->router, frame, sizeof frame, 0);
    *rq = (cm_proto_decode){.seqs = seqs,
                            .tokens = tok,
                            .layer_ids = lay,
                            .cap_seqs = MAX_SEQS,
                            .cap_tokens = MAX_TOK,
                            .cap_layers = MAX_LAY};
    return *il > 0 && fl > 0 && cm_proto_decode_decode(frame, (size_t)fl, &lim, rq) == CM_OK;
}

static void *fake_main(void *arg) {
    fake          *f = arg;
    static uint8_t buf[1 << 16];
    for (int k = 0; k < FAKE_N;) {
        zmq_pollitem_t it = {f->router, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 5000) <= 0)
            break;
        uint8_t         ident[256];
        int             il;
        cm_proto_decode rq;
        if (!fake_recv(f, ident, &il, &rq)) {
            f->bad++;
            continue;
        }
        if (k ==
            FAKE_STALE_THEN_GOOD) { /* the answer to an older step first, and a session ERROR of another */
            size_t n = fake_answer(f, &rq, FAKE_GOOD, rq.id - 1, buf, sizeof buf);
            zmq_send(f->router, ident, (size_t)il, ZMQ_SNDMORE);
            zmq_send(f->router, buf, n, 0);
            cm_proto_error e = {
                .batch_id = rq.id + 5, .code = CM_PROTO_ERROR_INTERNAL, .message = "not yours"};
            f->bad += cm_proto_error_encode(&e, buf, sizeof buf, &n) != CM_OK;
            zmq_send(f->router, ident, (size_t)il, ZMQ_SNDMORE);
            zmq_send(f->router, buf, n, 0);
        }
        if (k != FAKE_SILENT) {
            size_t n = fake_answer(f, &rq, k, rq.id, buf, sizeof buf);
            zmq_send(f->router, ident, (size_t)il, ZMQ_SNDMORE);
            zmq_send(f->router, buf, n, 0);
        }
        f->served = ++k;
    }
    return NULL;
}

static void test_fake_server(void) {
    fake f = {0};
    f.ctx = zmq_ctx_new();
    f.router = zmq_socket(f.ctx, ZMQ_ROUTER);
    int one = 1, zero = 0;
    zmq_setsockopt(f.router, ZMQ_ROUTER_HANDOVER, &one, sizeof one);
    zmq_setsockopt(f.router, ZMQ_LINGER, &zero, sizeof zero);
    TST_CHECK(zmq_bind(f.router, "tcp://127.0.0.1:*") == 0);
    size_t el = sizeof f.endpoint;
    zmq_getsockopt(f.router, ZMQ_LAST_ENDPOINT, f.endpoint, &el);
    pthread_t th;
    pthread_create(&th, NULL, fake_main, &f);
    cm_dec_client      *c = client_new(f.endpoint, 1000);
    cm_proto_decode_seq r[2] = {rec(0, 0, 3, 0), rec(7, 40, 2, 0)};
    int32_t             tok[5] = {1, 2, 3, 4, 5}, lay[2] = {3, 0};
    cm_proto_decode     rq = {.op = CM_DECODE_STEP,
                              .n_seqs = 2,
                              .n_tokens = 5,
                              .n_layers = 2,
                              .seqs = r,
                              .tokens = tok,
                              .layer_ids = lay};
    cm_proto_answer     ans = {.tensors = g_ans, .cap_tensors = MAX_LAY + 1};
    TST_CHECK(tst_ok(cm_dec_client_step(c, &rq, &ans), "the good answer after a stale one") &&
              ans.n_tensors == 3 && ans.tensors[1].shape[0] == 5);
    const int32_t *d = ans.tensors[0].data;
    TST_CHECK(d[0] == 100 && d[1] == 3 && d[4] == 7 && d[5] == 42);
    TST_FAILS(cm_dec_client_step(c, &rq, &ans), CM_ERR_PROTOCOL, "checksum");
    TST_FAILS(cm_dec_client_step(c, &rq, &ans), CM_ERR_PROTOCOL, "does not fit the step");
    TST_FAILS(cm_dec_client_step(c, &rq, &ans), CM_ERR_PROTOCOL, "has 2 tensors; 3 expected");
    TST_FAILS(cm_dec_client_step(c, &rq, &ans), CM_ERR_TIMEOUT, "may or may not have run");
    TST_CHECK(tst_ok(cm_dec_client_step(c, &rq, &ans), "a step on the fresh connection"));
    pthread_join(th, NULL);
    TST_CHECK(f.served == FAKE_N && f.bad == 0);
    printf("fake server: a stale answer and another step's ERROR discarded; a flipped byte, an impossible "
           "acceptance, a missing layer refused; silence timed out; the next step served\n");
    cm_dec_client_destroy(&c);
    zmq_close(f.router);
    zmq_ctx_term(f.ctx);
}

/* The reply a server sends just before it closes reaches a client that had not read it yet: the
 * client runs in a child process, stopped (SIGSTOP) from the moment its step is received until
 * the fake server has answered, closed and gone; continued, it must find the answer that came in
 * with the disconnect (a socket that drops unread messages on disconnect, as ZMQ_IMMEDIATE does,
 * loses it). */
static void test_reply_before_close(void) {
    char ep[128];
    snprintf(ep, sizeof ep, "ipc:///tmp/tandem-dec-%d-close.ipc", (int)getpid());
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        /* one CPU for all the client's threads, and the stepping thread runs only when ZeroMQ's
         * I/O thread has nothing to do: once continued, that thread takes in the answer and the
         * disconnect before the step can read the answer */
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
        sched_setaffinity(0, sizeof one, &one);
        cm_dec_client      *c = client_new(ep, 5000);
        struct sched_param  idle = {0};
        sched_setscheduler(0, SCHED_IDLE, &idle);
        cm_proto_decode_seq r = rec(0, 0, 2, 0);
        int32_t             t[2] = {1, 2};
        cm_proto_decode     rq = {.op = CM_DECODE_STEP, .n_seqs = 1, .n_tokens = 2, .seqs = &r, .tokens = t};
        cm_proto_answer     ans = {.tensors = g_ans, .cap_tensors = MAX_LAY + 1};
        cm_status           st = c ? cm_dec_client_step(c, &rq, &ans) : CM_ERR_IO;
        if (st != CM_OK)
            fprintf(stderr, "the client's step: %s\n", cm_last_error());
        cm_dec_client_destroy(&c);
        _exit(st == CM_OK ? 0 : 1);
    }
    TST_CHECK(child > 0);
    if (child <= 0)
        return;
    fake f = {0};
    f.ctx = zmq_ctx_new();
    f.router = zmq_socket(f.ctx, ZMQ_ROUTER);
    int linger = 2000;
    zmq_setsockopt(f.router, ZMQ_LINGER, &linger, sizeof linger);
    TST_CHECK(zmq_bind(f.router, ep) == 0);
    zmq_pollitem_t  it = {f.router, 0, ZMQ_POLLIN, 0};
    uint8_t         ident[256];
    int             il = 0, wst = 0;
    cm_proto_decode rq;
    int             got = zmq_poll(&it, 1, 10000) == 1 && fake_recv(&f, ident, &il, &rq);
    TST_CHECK(got);
    if (got) {
        kill(child, SIGSTOP);
        TST_CHECK(waitpid(child, &wst, WUNTRACED) == child && WIFSTOPPED(wst));
        static uint8_t buf[1 << 12];
        size_t         n = fake_answer(&f, &rq, FAKE_GOOD, rq.id, buf, sizeof buf);
        zmq_send(f.router, ident, (size_t)il, ZMQ_SNDMORE);
        zmq_send(f.router, buf, n, 0);
    }
    zmq_close(f.router);
    zmq_ctx_term(f.ctx); /* the answer is in the kernel's buffer, the connection closed */
    kill(child, SIGCONT);
    TST_CHECK(waitpid(child, &wst, 0) == child && WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    printf("reply before close: a stopped client found the answer sent just before the server closed\n");
}

// ----------------------------------------------------------------------------
// CURVE

static void test_curve(void) {
    if (!cm_chan_curve_available()) {
        printf("curve: libzmq has no CURVE; skipped\n");
        return;
    }
    char dir[256], allowed[300], skey[400], spub[400], akey[400], mkey[400];
    snprintf(dir, sizeof dir, "/tmp/tandem-dec-keys-%d", (int)getpid());
    snprintf(allowed, sizeof allowed, "%s/allowed", dir);
    mkdir(dir, 0700);
    mkdir(allowed, 0700);
    snprintf(skey, sizeof skey, "%s/server", dir);
    snprintf(akey, sizeof akey, "%s/alice", allowed);
    snprintf(mkey, sizeof mkey, "%s/mallory", dir);
    TST_CHECK(cm_chan_curve_keygen(skey) == CM_OK && cm_chan_curve_keygen(akey) == CM_OK &&
              cm_chan_curve_keygen(mkey) == CM_OK);
    snprintf(skey, sizeof skey, "%s/server.key", dir);
    snprintf(spub, sizeof spub, "%s/server.pub", dir);
    snprintf(akey, sizeof akey, "%s/alice.key", allowed);
    snprintf(mkey, sizeof mkey, "%s/mallory.key", dir);
    model m;
    model_init(&m);
    cm_dec_server       *s = NULL;
    cm_dec_server_config cfg = server_config("tcp://127.0.0.1:*", &m);
    cfg.curve_secret_key = skey;
    cfg.curve_client_keys = allowed;
    if (tst_ok(cm_dec_server_start(&s, &cfg), "server start")) {
        cm_dec_client_config cc = {.endpoint = cm_dec_server_endpoint(s),
                                   .curve_server_key = spub,
                                   .curve_secret_key = akey,
                                   .timeout_ms = 1500,
                                   .limits = CM_PROTO_LIMITS_DEFAULT};
        cm_dec_client       *c = NULL;
        seq                  sq = {0};
        TST_CHECK(cm_dec_client_create(&c, &cc) == CM_OK && new_seq(c, &sq) == CM_OK);
        cm_dec_client_destroy(&c);
        cc.curve_secret_key = mkey;
        TST_CHECK(cm_dec_client_create(&c, &cc) == CM_OK);
        TST_FAILS(new_seq(c, &sq), CM_ERR_TIMEOUT, "not sent");
        cm_dec_client_destroy(&c);
        cc.curve_server_key = NULL;
        cc.endpoint = "tcp://10.1.2.3:5000";
        TST_FAILS(cm_dec_client_create(&c, &cc), CM_ERR_INVALID_ARG, "needs --curve-server-key");
        cm_dec_server_stop(&s);
        printf("curve: the accepted key served, the refused one never connected\n");
    }
    cfg.curve_secret_key = cfg.curve_client_keys = NULL;
    cfg.endpoint = "tcp://0.0.0.0:*";
    TST_FAILS(cm_dec_server_start(&s, &cfg), CM_ERR_INVALID_ARG, "without CURVE");
    const char *files[] = {"server.key",  "server.pub",        "mallory.key",
                           "mallory.pub", "allowed/alice.key", "allowed/alice.pub"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        char p[400];
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(allowed);
    rmdir(dir);
    free(m.layers);
}

static void test_config(void) {
    model m;
    model_init(&m);
    cm_dec_server       *s = NULL;
    cm_dec_server_config cfg = server_config("tcp://127.0.0.1:*", &m);
    cfg.step = NULL;
    TST_FAILS(cm_dec_server_start(&s, &cfg), CM_ERR_INVALID_ARG, "no step callback");
    cfg = server_config("tcp://127.0.0.1:*", &m);
    cfg.max_clients = 0;
    TST_FAILS(cm_dec_server_start(&s, &cfg), CM_ERR_INVALID_ARG, "max_clients 0");
    cfg = server_config("tcp://127.0.0.1:*", &m);
    cfg.idle_timeout_ms = 5;
    TST_FAILS(cm_dec_server_start(&s, &cfg), CM_ERR_INVALID_ARG, "idle timeout 5 ms");
    cfg = server_config("tcp://127.0.0.1:*", &m);
    cfg.limits.max_seqs = 0;
    TST_FAILS(cm_dec_server_start(&s, &cfg), CM_ERR_INVALID_ARG, "limits");
    cfg = server_config("tcp://localhost:5555", &m);
    TST_FAILS(cm_dec_server_start(&s, &cfg), CM_ERR_INVALID_ARG, "127.0.0.1");
    TST_CHECK(s == NULL);
    cm_dec_server_stop(&s); /* NULL-safe */
    cm_dec_client_destroy(NULL);
    cm_dec_client       *c = NULL;
    cm_dec_client_config cc = {
        .endpoint = "tcp://127.0.0.1:1", .timeout_ms = 0, .limits = CM_PROTO_LIMITS_DEFAULT};
    TST_FAILS(cm_dec_client_create(&c, &cc), CM_ERR_INVALID_ARG, "timeout");
    free(m.layers);
}

int main(void) {
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    char ipc[128];
    snprintf(ipc, sizeof ipc, "ipc:///tmp/tandem-dec-%d-rt.ipc", (int)getpid());
    test_config();
    test_round_trip("tcp://127.0.0.1:*");
    test_round_trip(ipc);
    test_refusals();
    test_idle_and_busy();
    test_stop();
    test_fake_server();
    test_reply_before_close();
    test_curve();
    return tst_report();
}
