/* tests/test_cm_chan.c — ZeroMQ sessions (cm_chan) over real loopback sockets: an in-process
 * server thread with a synthetic compute callback (values are a function of token, layer and
 * column, so every answer is checked bit for bit), real clients, and raw ZeroMQ peers that
 * misbehave on purpose: round trips in every encoding over tcp:// and ipc://, credits, fair
 * service of two and three trainers, a proxy that flips a byte in one answer and drops
 * another, malformed frames sent to the server (truncated, wrong magic/version/checksum,
 * oversized lengths, extra parts, out-of-session requests) and to the client (a fake server),
 * peers that vanish mid-answer on either side, and CURVE with accepted and refused keys. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_chan.h"
#include "cm_compress.h"
#include "cm_hash.h"
#include "cm_log.h"
#include "tst.h"

#define D_TEST 64

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static float syn_value(int32_t tok, int layer, int64_t d) {
    return (float)(tok % 97) * 0.25f + (float)layer * 1.5f + (float)d * 0.0078125f - 3.0f + 0.001f;
}

// ----------------------------------------------------------------------------
// the in-process server

typedef struct syn {
    int             delay_ms;
    volatile int    hold; /* compute waits while this is set (the test releases it) */
    uint64_t        bad_request_id; /* compute refuses this batch with CM_ERR_INVALID_ARG */
    pthread_mutex_t mu;
    char            order[1024][CM_PROTO_NAME_MAX + 1];
    int             n_order;
} syn;

static cm_status syn_compute(void *user, cm_chan_job *job) {
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

static void *server_main(void *arg) {
    server *s = arg;
    s->run_status = cm_chan_server_run(s->srv);
    return NULL;
}

static cm_chan_server_config server_config(const char *ep, server *s) {
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

static int server_start(server *s, const cm_chan_server_config *cfg) {
    if (cm_chan_server_create(&s->srv, cfg) != CM_OK) {
        fprintf(stderr, "server create: %s\n", cm_last_error());
        return 0;
    }
    pthread_create(&s->th, NULL, server_main, s);
    return 1;
}

static void server_stop(server *s) {
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

static void make_batch(batch *b, uint64_t id, uint32_t T) {
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

static cm_status submit(cm_chan_client *c, const batch *b) {
    return cm_chan_client_submit(c, b->id, b->tokens, b->T, b->cu, b->N, b->layers, b->L);
}

/* 1 if the answer holds exactly the synthetic values of b (fp8: within its documented bound). */
static int answer_ok(const cm_chan_answer *a, const batch *b, cm_dtype dt, int lossy) {
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

static cm_chan_client_config client_config(const char *ep, const char *name) {
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
static int run_batches(cm_chan_client *c, uint64_t first_id, int n, uint32_t T, cm_dtype dt, int lossy) {
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

// ----------------------------------------------------------------------------
// round trips, credits

/* host_lock hooks that count: every buffer locked is unlocked once, by the client's end; fail
 * makes each lock fail (the answers must come all the same, from pageable memory). */
typedef struct lock_count {
    int   locks, unlocks, fail;
    void *last;
} lock_count;
static cm_status count_lock(void *user, void *p, size_t bytes) {
    lock_count *l = user;
    if (l->fail)
        return CM_FAIL(CM_ERR_CUDA, "locking %zu bytes refused by the test", bytes);
    l->locks++;
    l->last = p;
    return CM_OK;
}
static void count_unlock(void *user, void *p) {
    lock_count *l = user;
    l->unlocks += p != NULL;
}

static void test_round_trip(const char *ep_in, cm_dtype dt) {
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config(ep_in, &s);
    cfg.hidden_dtype = dt;
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    const char *ep = cm_chan_server_endpoint(s.srv);
    for (int e = 0; e < CM_ENCODING_NCCL; e++) { /* the host encodings; nccl: test_nccl_refused */
        cm_chan_client_config cc = client_config(ep, "rt");
        cc.encoding = (cm_encoding)e;
        cc.accept = 0;
        cc.target_id = 0x1234abcdull;
        lock_count lk = {.fail = e == CM_ENCODING_ZSTD};
        cc.host_lock = count_lock;
        cc.host_unlock = count_unlock;
        cc.host_user = &lk;
        cm_chan_client *c = NULL;
        TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
        cm_proto_welcome w;
        TST_CHECK(cm_chan_client_wait_ready(c, 5000, &w) == CM_OK);
        TST_CHECK(w.hidden_size == D_TEST && w.n_layers == 8 && w.hidden_dtype == dt && w.credits == 4);
        int good = run_batches(c, 100 + 100 * (uint64_t)e, 12, 37, dt, e == CM_ENCODING_FP8_ZSTD);
        TST_CHECK(good == 12);
        printf("round trip %-24s %-4s %-15s %d/12 answers exact%s\n", ep, cm_dtype_name(dt),
               cm_encoding_name(e), good, e == CM_ENCODING_FP8_ZSTD ? " (fp8 within its bound)" : "");
        cm_chan_client_stats st;
        cm_chan_client_get_stats(c, &st);
        TST_CHECK(st.protocol_errors == 0 && st.resends == 0 && st.answers == 12);
        cm_chan_client_destroy(&c);
        /* decoded answers sit in locked buffers (one per credit at most, grown rarely); a raw
           answer lent zero-copy needs none */
        TST_CHECK(lk.unlocks == lk.locks && lk.locks <= 8 &&
                  (lk.fail || e == CM_ENCODING_RAW || lk.locks >= 1));
        printf("  answer buffers page-locked %d time(s), unlocked %d%s\n", lk.locks, lk.unlocks,
               lk.fail ? " (every lock refused: pageable)" : "");
    }
    /* keep_frames: the ANSWER as received decodes to exactly the tensors the client lent */
    {
        cm_chan_client_config cc = client_config(ep, "frames");
        cc.encoding = CM_ENCODING_ZSTD_BYTEPLANE;
        cc.keep_frames = 1;
        cm_chan_client *c = NULL;
        TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
        TST_CHECK(cm_chan_client_wait_ready(c, 5000, NULL) == CM_OK);
        batch b;
        make_batch(&b, 60, 29);
        TST_CHECK(submit(c, &b) == CM_OK);
        cm_chan_answer *a = NULL;
        TST_CHECK(cm_chan_client_recv(c, 5000, &a) == CM_OK && a && a->status == CM_OK);
        const void *head = NULL, *data = NULL;
        size_t      head_len = 0, data_len = 0;
        TST_CHECK(a && cm_chan_client_frames(c, a, &head, &head_len, &data, &data_len) == CM_OK);
        cm_proto_tensor  ts[8];
        cm_proto_answer  pa = {.tensors = ts, .cap_tensors = 8};
        cm_proto_limits  lim = CM_PROTO_LIMITS_DEFAULT;
        cm_compress_config ccfg = CM_COMPRESS_CONFIG_DEFAULT;
        cm_compress     *cz = NULL;
        TST_CHECK(cm_compress_create(&cz, &ccfg) == CM_OK);
        int same = a && head && cz &&
                   cm_proto_answer_decode_parts(head, head_len, data, data_len, &lim, &pa) == CM_OK &&
                   pa.batch_id == 60 && pa.n_tensors == a->n_tensors;
        for (uint32_t i = 0; same && i < pa.n_tensors; i++) {
            void *buf = malloc(a->tensors[i].bytes);
            same = buf && cm_compress_decode_tensor(cz, &ts[i], buf, a->tensors[i].bytes) == CM_OK &&
                   memcmp(buf, a->tensors[i].data, a->tensors[i].bytes) == 0;
            free(buf);
        }
        TST_CHECK(same);
        printf("keep_frames: HEAD %zu + DATA %zu bytes decode to the lent tensors: %s\n", head_len, data_len,
               same ? "yes" : "NO");
        cm_compress_destroy(&cz);
        cm_chan_client_release(c, &a);
        cm_chan_client_destroy(&c);
        /* without keep_frames there are no frames to lend */
        cc.keep_frames = 0;
        TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
        make_batch(&b, 61, 5);
        TST_CHECK(cm_chan_client_wait_ready(c, 5000, NULL) == CM_OK && submit(c, &b) == CM_OK);
        TST_CHECK(cm_chan_client_recv(c, 5000, &a) == CM_OK && a);
        TST_CHECK(a && cm_chan_client_frames(c, a, &head, &head_len, &data, &data_len) == CM_ERR_INVALID_ARG);
        cm_chan_client_release(c, &a);
        cm_chan_client_destroy(&c);
    }
    /* a bad request is delivered as a failed batch, not retried */
    s.syn.bad_request_id = 77;
    cm_chan_client_config cc = client_config(ep, "bad");
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    batch b;
    make_batch(&b, 77, 8);
    TST_CHECK(submit(c, &b) == CM_OK);
    cm_chan_answer *a = NULL;
    TST_CHECK(cm_chan_client_recv(c, 5000, &a) == CM_OK);
    TST_CHECK(a && a->batch_id == 77 && a->status == CM_ERR_INVALID_ARG &&
              strstr(a->message, "refused by the test"));
    cm_chan_client_release(c, &a);
    /* the WELCOME's limits are enforced at submit */
    b.layers[0] = 8;
    TST_CHECK(cm_chan_client_submit(c, 78, b.tokens, b.T, b.cu, b.N, b.layers, b.L) == CM_ERR_INVALID_ARG);
    cm_chan_client_destroy(&c);
    /* a trainer that expects another target is refused for good */
    cc.target_id = 0x999;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(cm_chan_client_wait_ready(c, 5000, NULL) == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "another architecture") != NULL);
    cm_chan_client_destroy(&c);
    server_stop(&s);
}

static void test_credits(void) {
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER, .delay_ms = 30}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    cfg.credits = 2;
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    cm_chan_client_config cc = client_config(cm_chan_server_endpoint(s.srv), "credits");
    cc.credits = 3; /* asks for 3, is granted 2 */
    cm_chan_client *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    cm_proto_welcome w;
    TST_CHECK(cm_chan_client_wait_ready(c, 5000, &w) == CM_OK && w.credits == 2);
    batch b[4];
    for (int i = 0; i < 4; i++)
        make_batch(&b[i], 500 + (uint64_t)i, 16);
    TST_CHECK(submit(c, &b[0]) == CM_OK && submit(c, &b[1]) == CM_OK && submit(c, &b[2]) == CM_OK);
    TST_CHECK(submit(c, &b[3]) == CM_ERR_TIMEOUT); /* all 3 slots taken */
    TST_CHECK(cm_chan_client_submit(c, 501, b[1].tokens, 16, b[1].cu, 2, b[1].layers, 2) ==
              CM_ERR_INVALID_ARG);
    cm_chan_answer *held[3] = {0};
    for (int i = 0; i < 3; i++)
        TST_CHECK(cm_chan_client_recv(c, 5000, &held[i]) == CM_OK);
    TST_CHECK(submit(c, &b[3]) == CM_ERR_TIMEOUT); /* held answers keep their credits */
    cm_chan_client_release(c, &held[0]);
    TST_CHECK(submit(c, &b[3]) == CM_OK);
    cm_chan_client_release(c, &held[1]);
    cm_chan_client_release(c, &held[2]);
    TST_CHECK(cm_chan_client_recv(c, 5000, &held[0]) == CM_OK && held[0]->batch_id == 503);
    cm_chan_client_release(c, &held[0]);
    TST_CHECK(cm_chan_client_pending(c) == 0);
    cm_chan_server_stats st;
    cm_chan_server_get_stats(s.srv, &st);
    TST_CHECK(st.max_queue <= 2);   /* the client never had more than its 2 granted credits out */
    TST_CHECK(st.errors_sent == 0); /* so the server never had to refuse one */
    printf("credits: granted 2 of 3, server queue peaked at %u, %llu answers\n", st.max_queue,
           (unsigned long long)st.answers);
    cm_chan_client_destroy(&c);
    server_stop(&s);
}

// ----------------------------------------------------------------------------
// fairness

typedef struct trainer_arg {
    const char *ep, *name;
    uint64_t    first;
    int         n, good;
} trainer_arg;

static void *trainer_main(void *arg) {
    trainer_arg          *t = arg;
    cm_chan_client_config cc = client_config(t->ep, t->name);
    cc.credits = 3;
    cm_chan_client *c = NULL;
    if (cm_chan_client_create(&c, &cc) != CM_OK)
        return NULL;
    t->good = run_batches(c, t->first, t->n, 24, CM_DTYPE_BF16, 0);
    cm_chan_client_destroy(&c);
    return NULL;
}

static void test_fairness(int n_clients) {
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER, .delay_ms = 15}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    static const char *names[] = {"alpha", "beta", "gamma"};
    trainer_arg        ta[3];
    pthread_t          th[3];
    for (int i = 0; i < n_clients; i++) {
        ta[i] = (trainer_arg){cm_chan_server_endpoint(s.srv), names[i], 1000 * (uint64_t)(i + 1), 16, 0};
        pthread_create(&th[i], NULL, trainer_main, &ta[i]);
    }
    for (int i = 0; i < n_clients; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < n_clients; i++)
        TST_CHECK(ta[i].good == 16);
    /* in the stretch where every trainer still had work, service alternates: no trainer runs
     * more than twice in a row, and each gets its share */
    int first_all = -1, last_all = -1, count[3] = {0};
    int seen[3] = {0}, done[3] = {0};
    for (int k = 0; k < s.syn.n_order; k++)
        for (int i = 0; i < n_clients; i++)
            if (strcmp(s.syn.order[k], names[i]) == 0) {
                seen[i] = 1;
                if (++done[i] == 16 && last_all < 0)
                    last_all = k;
            }
    memset(seen, 0, sizeof seen);
    for (int k = 0; k < s.syn.n_order && first_all < 0; k++) {
        for (int i = 0; i < n_clients; i++)
            seen[i] |= strcmp(s.syn.order[k], names[i]) == 0;
        int all = 1;
        for (int i = 0; i < n_clients; i++)
            all &= seen[i];
        if (all)
            first_all = k;
    }
    int max_run = 0, run = 0;
    for (int k = first_all; k >= 0 && k <= last_all; k++) {
        run = k > first_all && strcmp(s.syn.order[k], s.syn.order[k - 1]) == 0 ? run + 1 : 1;
        if (run > max_run)
            max_run = run;
        for (int i = 0; i < n_clients; i++)
            count[i] += strcmp(s.syn.order[k], names[i]) == 0;
    }
    int span = last_all - first_all + 1, fair = first_all >= 0 && last_all > first_all;
    for (int i = 0; i < n_clients && fair; i++)
        fair = count[i] * n_clients >= span - 2 * n_clients;
    TST_CHECK(fair && max_run <= 2);
    printf("fairness: %d trainers, %d forwards, shared stretch of %d with longest run %d (", n_clients,
           s.syn.n_order, span, max_run);
    for (int i = 0; i < n_clients; i++)
        printf("%s%s %d", i ? ", " : "", names[i], count[i]);
    printf(")\n");
    server_stop(&s);
}

// ----------------------------------------------------------------------------
// a proxy that flips a byte in one answer and drops another

typedef struct proxy {
    char       front[256], back[256];
    int        flip_at, drop_at, n_answers;
    atomic_int quit, ready;
    pthread_t  th;
} proxy;

static void *proxy_main(void *arg) {
    proxy *p = arg;
    void  *ctx = zmq_ctx_new();
    void  *front = zmq_socket(ctx, ZMQ_ROUTER), *back = zmq_socket(ctx, ZMQ_DEALER);
    int    zero = 0;
    zmq_setsockopt(front, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(back, ZMQ_LINGER, &zero, sizeof zero);
    zmq_bind(front, "tcp://127.0.0.1:*");
    size_t n = sizeof p->front;
    zmq_getsockopt(front, ZMQ_LAST_ENDPOINT, p->front, &n);
    zmq_connect(back, p->back);
    atomic_store(&p->ready, 1);
    uint8_t id[256];
    size_t  id_len = 0;
    while (!atomic_load(&p->quit)) {
        zmq_pollitem_t it[2] = {{front, 0, ZMQ_POLLIN, 0}, {back, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 2, 50) <= 0)
            continue;
        if (it[0].revents & ZMQ_POLLIN) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            zmq_msg_recv(&m, front, 0);
            id_len = zmq_msg_size(&m);
            memcpy(id, zmq_msg_data(&m), id_len);
            zmq_msg_close(&m);
            zmq_msg_init(&m);
            zmq_msg_recv(&m, front, 0);
            zmq_msg_send(&m, back, 0);
        }
        if (it[1].revents & ZMQ_POLLIN) {
            zmq_msg_t parts[4];
            int       np = 0, more = 1;
            while (more && np < 4) {
                zmq_msg_init(&parts[np]);
                zmq_msg_recv(&parts[np], back, 0);
                more = zmq_msg_more(&parts[np]);
                np++;
            }
            int drop = 0;
            if (np == 2) { /* an ANSWER */
                p->n_answers++;
                if (p->n_answers == p->flip_at && zmq_msg_size(&parts[1]) > 100)
                    ((uint8_t *)zmq_msg_data(&parts[1]))[zmq_msg_size(&parts[1]) / 2] ^= 0x10;
                drop = p->n_answers == p->drop_at;
            }
            if (!drop && id_len)
                zmq_send(front, id, id_len, ZMQ_SNDMORE);
            for (int k = 0; k < np; k++) {
                if (!drop && id_len)
                    zmq_msg_send(&parts[k], front, k + 1 < np ? ZMQ_SNDMORE : 0);
                else
                    zmq_msg_close(&parts[k]);
            }
        }
    }
    zmq_close(front);
    zmq_close(back);
    zmq_ctx_term(ctx);
    return NULL;
}

static void test_flip_and_drop(void) {
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    proxy p = {.flip_at = 2, .drop_at = 4};
    snprintf(p.back, sizeof p.back, "%s", cm_chan_server_endpoint(s.srv));
    pthread_create(&p.th, NULL, proxy_main, &p);
    while (!atomic_load(&p.ready))
        sleep_ms(5);
    cm_chan_client_config cc = client_config(p.front, "flipped");
    cc.encoding = CM_ENCODING_RAW; /* a flipped byte in raw data is caught by the checksum alone */
    cc.request_timeout_ms = 400;
    cm_chan_client *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(run_batches(c, 2000, 8, 64, CM_DTYPE_BF16, 0) == 8);
    cm_chan_client_stats st;
    cm_chan_client_get_stats(c, &st);
    TST_CHECK(st.corrupt_answers == 1 && st.timeouts >= 1 && st.resends >= 2 && st.answers == 8);
    TST_CHECK(strstr(st.last_problem, "checksum") != NULL || st.timeouts >= 1);
    printf("proxy: answer 2 flipped, answer 4 dropped: %llu corrupt, %llu late, %llu re-sent, 8/8 exact\n",
           (unsigned long long)st.corrupt_answers, (unsigned long long)st.timeouts,
           (unsigned long long)st.resends);
    cm_chan_client_destroy(&c);
    atomic_store(&p.quit, 1);
    pthread_join(p.th, NULL);
    server_stop(&s);
}

// ----------------------------------------------------------------------------
// raw peers against the server

static void reseal(uint8_t *f) { /* recomputes the header checksum after a test edits the header */
    uint64_t h = cm_xxh64(f, 48, 0);
    for (int i = 0; i < 8; i++)
        f[48 + i] = (uint8_t)(h >> (8 * i));
}

/* Sends one frame from a raw DEALER and waits for one reply; returns its type (or 0). */
static int raw_exchange(void *d, const void *f, size_t len, int flags, cm_proto_error *err) {
    zmq_send(d, f, len, flags);
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 3000) <= 0)
        return 0;
    uint8_t         buf[4096];
    int             n = zmq_recv(d, buf, sizeof buf, 0);
    cm_proto_header h;
    cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    int             more;
    size_t          ml = sizeof more;
    while (zmq_getsockopt(d, ZMQ_RCVMORE, &more, &ml) == 0 && more)
        zmq_recv(d, buf, sizeof buf, 0);
    if (n < 0 || cm_proto_peek(buf, (size_t)n, &lim, &h) != CM_OK)
        return 0;
    if (h.type == CM_PROTO_TYPE_ERROR && err)
        cm_proto_error_decode(buf, (size_t)n, &lim, err);
    return h.type;
}

static void test_raw_peer_to_server(void) {
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    cfg.max_tokens = 256;
    cfg.credits = 2;
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    const char *ep = cm_chan_server_endpoint(s.srv);
    void       *ctx = zmq_ctx_new();
    void       *d = zmq_socket(ctx, ZMQ_DEALER);
    int         zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(d, ZMQ_ROUTING_ID, "raw-peer", 8);
    zmq_connect(d, ep);
    uint8_t        f[8192];
    size_t         len;
    cm_proto_error e;
    int            n_bad = 0;
    /* truncated frame (of this build's version: one of another version is refused as such) */
    memset(f, 0, sizeof f);
    const uint8_t trunc[10] = {'T', 'N', 'D', 'M', CM_PROTO_VERSION, 0, CM_PROTO_TYPE_REQUEST, 0, 0, 0};
    TST_CHECK(raw_exchange(d, trunc, sizeof trunc, 0, &e) == CM_PROTO_TYPE_ERROR &&
              e.code == CM_PROTO_ERROR_CORRUPT);
    n_bad++;
    /* a HELLO, then edits of it */
    cm_proto_hello h = {.credits = 2, .encodings = 1u << CM_ENCODING_RAW};
    snprintf(h.name, sizeof h.name, "raw");
    cm_proto_hello_encode(&h, f, sizeof f, &len);
    uint8_t g[256];
    memcpy(g, f, len);
    g[0] ^= 0xff; /* wrong magic */
    TST_CHECK(raw_exchange(d, g, len, 0, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_CORRUPT);
    n_bad++;
    memcpy(g, f, len);
    g[4] = 1; /* version 1, header checksum redone */
    reseal(g);
    TST_CHECK(raw_exchange(d, g, len, 0, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_VERSION);
    TST_CHECK(strstr(e.message, "version") != NULL);
    n_bad++;
    memcpy(g, f, len);
    g[24] = 0xff, g[25] = 0xff, g[26] = 0xff, g[27] = 0x7f; /* body_len 2 GB */
    reseal(g);
    TST_CHECK(raw_exchange(d, g, len, 0, &e) == CM_PROTO_TYPE_ERROR && strstr(e.message, "body_len"));
    n_bad++;
    memcpy(g, f, len);
    g[60] ^= 1; /* body byte: body checksum */
    TST_CHECK(raw_exchange(d, g, len, 0, &e) == CM_PROTO_TYPE_ERROR && strstr(e.message, "checksum"));
    n_bad++;
    memcpy(g, f, len);
    g[50] ^= 1; /* the header checksum itself */
    TST_CHECK(raw_exchange(d, g, len, 0, &e) == CM_PROTO_TYPE_ERROR && strstr(e.message, "checksum"));
    n_bad++;
    zmq_send(d, f, len, ZMQ_SNDMORE); /* three parts */
    zmq_send(d, f, len, ZMQ_SNDMORE);
    TST_CHECK(raw_exchange(d, f, len, 0, &e) == CM_PROTO_TYPE_ERROR && strstr(e.message, "3 parts"));
    n_bad++;
    /* a REQUEST with no session gets BYE */
    batch b;
    make_batch(&b, 9, 16);
    cm_proto_request rq = {.batch_id = 9,
                           .encoding = CM_ENCODING_RAW,
                           .n_tokens = 16,
                           .n_seqs = b.N,
                           .n_layers = 2,
                           .tokens = b.tokens,
                           .cu_seqlens = b.cu,
                           .layer_ids = b.layers};
    uint8_t          rf[4096];
    size_t           rl;
    cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
    TST_CHECK(raw_exchange(d, rf, rl, 0, NULL) == CM_PROTO_TYPE_BYE);
    /* HELLO, then requests the session cannot take */
    TST_CHECK(raw_exchange(d, f, len, 0, NULL) == CM_PROTO_TYPE_WELCOME);
    int32_t bad_layers[2] = {8, 0};
    rq.layer_ids = bad_layers;
    cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
    TST_CHECK(raw_exchange(d, rf, rl, 0, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_BAD_REQUEST &&
              e.batch_id == 9);
    rq.layer_ids = b.layers;
    rq.encoding = CM_ENCODING_ZSTD; /* not agreed in the HELLO */
    cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
    TST_CHECK(raw_exchange(d, rf, rl, 0, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_BAD_REQUEST);
    rq.encoding = CM_ENCODING_RAW;
    static int32_t   big[300], big_cu[2] = {0, 300};
    cm_proto_request rb = rq;
    rb.n_tokens = 300, rb.n_seqs = 1, rb.tokens = big, rb.cu_seqlens = big_cu;
    static uint8_t bf[4096];
    size_t         bl;
    cm_proto_request_encode(&rb, bf, sizeof bf, &bl);
    TST_CHECK(raw_exchange(d, bf, bl, 0, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_BAD_REQUEST &&
              strstr(e.message, "max-tokens"));
    /* a request whose body lies about its size is corrupt, and names the batch */
    cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
    rf[CM_PROTO_HEADER_SIZE + 12] = 3; /* n_layers 3 in a body sized for 2; body checksum redone */
    uint64_t bc = cm_xxh64(rf + CM_PROTO_HEADER_SIZE, rl - CM_PROTO_HEADER_SIZE, 0);
    for (int i = 0; i < 8; i++)
        rf[40 + i] = (uint8_t)(bc >> (8 * i));
    reseal(rf);
    TST_CHECK(raw_exchange(d, rf, rl, 0, &e) == CM_PROTO_TYPE_ERROR && e.code == CM_PROTO_ERROR_CORRUPT &&
              e.batch_id == 9);
    n_bad++;
    /* credits: 2 granted; the raw peer sends 3 at once, the third is refused. The computes are
     * held until the refusal has come back, so that the first cannot finish and free a credit
     * before the server reads the third (with a 200 ms delay instead, a descheduled I/O thread on
     * a loaded machine once let that happen). */
    s.syn.hold = 1;
    for (int i = 0; i < 3; i++) {
        rq.batch_id = 20 + (uint64_t)i;
        cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
        zmq_send(d, rf, rl, 0);
    }
    int got_no_credit = 0, answers = 0;
    for (int k = 0; k < 6 && (answers < 2 || !got_no_credit); k++) {
        zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 3000) <= 0)
            break;
        static uint8_t buf[1 << 16];
        int            n = zmq_recv(d, buf, sizeof buf, 0), more = 0;
        size_t         ml = sizeof more;
        zmq_getsockopt(d, ZMQ_RCVMORE, &more, &ml);
        cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
        cm_proto_header hh;
        if (n > 0 && cm_proto_peek(buf, (size_t)n, &lim, &hh) == CM_OK) {
            if (hh.type == CM_PROTO_TYPE_ERROR && cm_proto_error_decode(buf, (size_t)n, &lim, &e) == CM_OK)
                got_no_credit |= e.code == CM_PROTO_ERROR_NO_CREDIT && e.batch_id == 22;
            if (got_no_credit) s.syn.hold = 0;
            answers += hh.type == CM_PROTO_TYPE_ANSWER;
        }
        while (more) {
            zmq_recv(d, buf, sizeof buf, 0);
            zmq_getsockopt(d, ZMQ_RCVMORE, &more, &ml);
        }
    }
    TST_CHECK(got_no_credit && answers == 2);
    if (!got_no_credit || answers != 2)
        fprintf(stderr, "credits: %d answers, NO_CREDIT for batch 22 %s\n", answers, got_no_credit ? "seen" : "not seen");
    s.syn.hold = 0;
    /* a message above ZMQ_MAXMSGSIZE: the server drops the connection without reading it */
    size_t   huge_len = 4u << 20;
    uint8_t *huge = calloc(huge_len, 1);
    zmq_send(d, huge, huge_len, 0);
    free(huge);
    sleep_ms(200);
    zmq_close(d);
    zmq_ctx_term(ctx);
    /* the server still serves a real trainer */
    cm_chan_client_config cc = client_config(ep, "after-raw");
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(run_batches(c, 3000, 6, 16, CM_DTYPE_BF16, 0) == 6);
    cm_chan_client_destroy(&c);
    cm_chan_server_stats st;
    cm_chan_server_get_stats(s.srv, &st);
    TST_CHECK(st.bad_frames == (uint64_t)n_bad);
    printf(
        "raw peer to server: %llu malformed frames refused, bad requests and credit overrun answered, still "
        "serving\n",
        (unsigned long long)st.bad_frames);
    server_stop(&s);
}

// ----------------------------------------------------------------------------
// a fake server against the client

enum { FAKE_SCRIPT, FAKE_BAD_VERSION, FAKE_VANISH };

typedef struct fake {
    char       ep[256];
    int        mode;
    atomic_int quit, ready;
    int        n_requests, n_resend_flags;
    pthread_t  th;
} fake;

/* Encodes a correct raw BF16 answer for a decoded request into head/data. */
static void fake_answer(const cm_proto_request *r, uint8_t *head, size_t *hl, uint8_t *data, size_t *dl,
                        int nan) {
    cm_proto_tensor t[4];
    size_t          per = (size_t)r->n_tokens * D_TEST * 2;
    for (uint32_t i = 0; i < r->n_layers; i++) {
        uint16_t *o = (uint16_t *)(data + i * per);
        for (uint32_t k = 0; k < r->n_tokens; k++)
            for (int d = 0; d < D_TEST; d++)
                o[k * D_TEST + d] = cm_f32_to_bf16(syn_value(r->tokens[k], r->layer_ids[i], d));
        if (nan)
            o[3] = 0x7fc0;
        t[i] = (cm_proto_tensor){.dtype = CM_DTYPE_BF16,
                                 .encoding = CM_ENCODING_RAW,
                                 .n_dims = 2,
                                 .shape = {r->n_tokens, D_TEST},
                                 .raw_size = per,
                                 .encoded_size = per,
                                 .data = data + i * per};
        snprintf(t[i].name, sizeof t[i].name, "layer_%d", r->layer_ids[i]);
    }
    cm_proto_answer a = {.batch_id = r->batch_id, .n_tensors = r->n_layers, .tensors = t, .cap_tensors = 4};
    cm_proto_answer_encode_head(&a, head, 4096, hl);
    *dl = per * r->n_layers;
}

static void *fake_main(void *arg) {
    fake *f = arg;
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    int   zero = 0;
    zmq_setsockopt(r, ZMQ_LINGER, &zero, sizeof zero);
    zmq_bind(r, f->ep[0] ? f->ep : "tcp://127.0.0.1:*");
    size_t n = sizeof f->ep;
    zmq_getsockopt(r, ZMQ_LAST_ENDPOINT, f->ep, &n);
    atomic_store(&f->ready, 1);
    static uint8_t  head[4096], data[1 << 16], frame[1 << 16];
    int32_t         toks[512], cu[513], lay[8];
    cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    int             step = 0;
    while (!atomic_load(&f->quit)) {
        zmq_pollitem_t it = {r, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 50) <= 0)
            continue;
        uint8_t         id[256];
        int             il = zmq_recv(r, id, sizeof id, 0);
        int             fl = zmq_recv(r, frame, sizeof frame, 0);
        cm_proto_header h;
        if (il <= 0 || fl <= 0 || cm_proto_peek(frame, (size_t)fl, &lim, &h) != CM_OK)
            continue;
        size_t hl, dl;
        if (h.type == CM_PROTO_TYPE_HELLO) {
            cm_proto_welcome w = {.target_id = 0x1234abcdull, /* as the real test server */
                                  .weights_id = 0x77aa55ull,
                                  .version = CM_PROTO_VERSION,
                                  .hidden_dtype = CM_DTYPE_BF16,
                                  .hidden_size = D_TEST,
                                  .n_layers = 8,
                                  .max_tokens = 512,
                                  .credits = 4,
                                  .encodings = 1u << CM_ENCODING_RAW};
            snprintf(w.name, sizeof w.name, "fake");
            cm_proto_welcome_encode(&w, head, sizeof head, &hl);
            if (f->mode == FAKE_BAD_VERSION) {
                head[4] = 9;
                reseal(head);
            }
            zmq_send(r, id, (size_t)il, ZMQ_SNDMORE);
            zmq_send(r, head, hl, 0);
            continue;
        }
        if (h.type != CM_PROTO_TYPE_REQUEST)
            continue;
        cm_proto_request rq = {.tokens = toks,
                               .cu_seqlens = cu,
                               .layer_ids = lay,
                               .cap_tokens = 512,
                               .cap_cu_seqlens = 513,
                               .cap_layers = 8};
        if (cm_proto_request_decode(frame, (size_t)fl, &lim, &rq) != CM_OK)
            continue;
        f->n_requests++;
        f->n_resend_flags += (rq.flags & CM_PROTO_FLAG_RESEND) != 0;
        if (f->mode == FAKE_VANISH)
            break;                                   /* got the request; disappears without an answer */
        int variant = rq.batch_id == 2 ? 0 : step++; /* batch 2: corrupted every time */
        fake_answer(&rq, head, &hl, data, &dl, variant == 6);
        int parts = 2;
        switch (variant) {
        case 0:
            data[dl / 2] ^= 0x01;
            break; /* flipped byte: tensor checksum */
        case 1:
            hl = 40;
            break; /* truncated header */
        case 2:
            head[4] = 1, reseal(head);
            break; /* wrong version */
        case 3:    /* data_len far beyond the client's bound */
            for (int i = 0; i < 8; i++)
                head[32 + i] = i == 7 ? 0x40 : 0;
            reseal(head);
            break;
        case 4:
            parts = 3;
            break; /* an extra part */
        case 5: {  /* the wrong layer */
            int32_t saved = lay[0];
            lay[0] = 7;
            fake_answer(&rq, head, &hl, data, &dl, 0);
            lay[0] = saved;
            break;
        }
        default:
            break; /* 6: NaN inside (caught by the value check); 7+: correct */
        }
        zmq_send(r, id, (size_t)il, ZMQ_SNDMORE);
        zmq_send(r, head, hl, ZMQ_SNDMORE);
        if (parts == 3)
            zmq_send(r, data, dl, ZMQ_SNDMORE);
        zmq_send(r, data, dl, 0);
    }
    zmq_close(r);
    zmq_ctx_term(ctx);
    return NULL;
}

static void test_fake_server(void) {
    fake f = {.mode = FAKE_SCRIPT};
    pthread_create(&f.th, NULL, fake_main, &f);
    while (!atomic_load(&f.ready))
        sleep_ms(5);
    cm_chan_client_config cc = client_config(f.ep, "victim");
    cc.encoding = CM_ENCODING_RAW;
    cc.max_attempts = 10;
    cc.peer_timeout_ms = 20000; /* the fake sends no heartbeats */
    cc.heartbeat_ms = 1000;
    cm_chan_client *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(cm_chan_client_wait_ready(c, 5000, NULL) == CM_OK);
    batch b;
    make_batch(&b, 1, 8);
    TST_CHECK(submit(c, &b) == CM_OK);
    cm_chan_answer *a = NULL;
    TST_CHECK(cm_chan_client_recv(c, 10000, &a) == CM_OK);
    TST_CHECK(a && answer_ok(a, &b, CM_DTYPE_BF16, 0));
    cm_chan_client_release(c, &a);
    cm_chan_client_stats st;
    cm_chan_client_get_stats(c, &st);
    TST_CHECK(st.protocol_errors == 7 && st.corrupt_answers == 7 && st.resends == 7);
    TST_CHECK(f.n_requests == 8 && f.n_resend_flags == 7);
    printf("fake server: 7 bad answers (checksum, truncated, version, size, parts, layer, NaN) refused and "
           "re-requested; the 8th delivered once\n");
    /* a batch that is always corrupted is given up after max_attempts, with the reason */
    make_batch(&b, 2, 8);
    TST_CHECK(submit(c, &b) == CM_OK);
    TST_CHECK(cm_chan_client_recv(c, 10000, &a) == CM_OK);
    TST_CHECK(a && a->batch_id == 2 && a->status == CM_ERR_PROTOCOL && strstr(a->message, "checksum"));
    cm_chan_client_release(c, &a);
    cm_chan_client_destroy(&c);
    atomic_store(&f.quit, 1);
    pthread_join(f.th, NULL);

    /* a server that speaks another protocol version is refused for good */
    fake v = {.mode = FAKE_BAD_VERSION};
    pthread_create(&v.th, NULL, fake_main, &v);
    while (!atomic_load(&v.ready))
        sleep_ms(5);
    cc.endpoint = v.ep;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(cm_chan_client_wait_ready(c, 5000, NULL) == CM_ERR_PROTOCOL);
    TST_CHECK(strstr(cm_last_error(), "protocol version 9") != NULL);
    TST_CHECK(submit(c, &b) == CM_ERR_PROTOCOL);
    cm_chan_client_destroy(&c);
    atomic_store(&v.quit, 1);
    pthread_join(v.th, NULL);
}

// ----------------------------------------------------------------------------
// peers that disappear

static void test_vanishing_peers(void) {
    /* the server vanishes with a request in flight; a real one comes up on the same endpoint */
    char ep[128];
    snprintf(ep, sizeof ep, "ipc:///tmp/tandem-chan-%d-vanish.ipc", (int)getpid());
    fake f = {.mode = FAKE_VANISH};
    snprintf(f.ep, sizeof f.ep, "%s", ep);
    pthread_create(&f.th, NULL, fake_main, &f);
    while (!atomic_load(&f.ready))
        sleep_ms(5);
    cm_chan_client_config cc = client_config(ep, "survivor");
    cc.peer_timeout_ms = 600;
    cm_chan_client *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    batch b;
    make_batch(&b, 42, 16);
    TST_CHECK(submit(c, &b) == CM_OK);
    pthread_join(f.th, NULL); /* the fake got the request and is gone */
    TST_CHECK(f.n_requests == 1);
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config(ep, &s);
    TST_CHECK(server_start(&s, &cfg));
    cm_chan_answer *a = NULL;
    TST_CHECK(cm_chan_client_recv(c, 10000, &a) == CM_OK);
    TST_CHECK(a && answer_ok(a, &b, CM_DTYPE_BF16, 0));
    cm_chan_client_release(c, &a);
    cm_chan_client_stats cs;
    cm_chan_client_get_stats(c, &cs);
    TST_CHECK(cs.reconnects >= 1 && cs.sessions == 2); /* the fake's WELCOME, then the real one */
    printf("server vanished mid-answer: client reconnected (%llu reconnects) and got batch 42 from the new "
           "server\n",
           (unsigned long long)cs.reconnects);

    /* a trainer vanishes while its batch is computed, another goes silent with work queued: the
     * server drops both and keeps serving */
    s.syn.delay_ms = 150;
    void *ctx = zmq_ctx_new();
    int   zero = 0;
    void *d1 = zmq_socket(ctx, ZMQ_DEALER), *d2 = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(d1, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(d2, ZMQ_LINGER, &zero, sizeof zero);
    zmq_connect(d1, ep);
    zmq_connect(d2, ep);
    cm_proto_hello h = {.credits = 4, .encodings = 1u << CM_ENCODING_RAW};
    snprintf(h.name, sizeof h.name, "ghost");
    uint8_t hf[256], rf[4096];
    size_t  hl, rl;
    cm_proto_hello_encode(&h, hf, sizeof hf, &hl);
    cm_proto_request rq = {.batch_id = 7,
                           .encoding = CM_ENCODING_RAW,
                           .n_tokens = b.T,
                           .n_seqs = b.N,
                           .n_layers = b.L,
                           .tokens = b.tokens,
                           .cu_seqlens = b.cu,
                           .layer_ids = b.layers};
    cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
    zmq_send(d1, hf, hl, 0);
    zmq_send(d2, hf, hl, 0);
    sleep_ms(100);
    zmq_send(d1, rf, rl, 0);
    for (int i = 0; i < 4; i++) {
        rq.batch_id = 100 + (uint64_t)i;
        cm_proto_request_encode(&rq, rf, sizeof rf, &rl);
        zmq_send(d2, rf, rl, 0);
    }
    sleep_ms(50);
    zmq_close(d1); /* gone while its batch is computed */
    make_batch(&b, 43, 16);
    TST_CHECK(submit(c, &b) == CM_OK); /* a live trainer keeps being served meanwhile */
    TST_CHECK(cm_chan_client_recv(c, 10000, &a) == CM_OK && a && answer_ok(a, &b, CM_DTYPE_BF16, 0));
    cm_chan_client_release(c, &a);
    sleep_ms(1500); /* d2 is silent past the peer timeout (1000 ms) */
    cm_chan_server_stats st;
    cm_chan_server_get_stats(s.srv, &st);
    TST_CHECK(st.sessions_timed_out >= 1 && st.sessions_active == 1);
    TST_CHECK(st.sessions_unreachable + st.sessions_timed_out >= 2);
    printf("vanished trainers: %llu unreachable, %llu timed out, %llu queued requests dropped, live trainer "
           "served\n",
           (unsigned long long)st.sessions_unreachable, (unsigned long long)st.sessions_timed_out,
           (unsigned long long)st.dropped_jobs);
    zmq_close(d2);
    zmq_ctx_term(ctx);
    cm_chan_client_destroy(&c);
    server_stop(&s);
}

/* a server that comes back with another target ends the run instead of feeding it */
static void test_target_change(void) {
    char ep[128];
    snprintf(ep, sizeof ep, "ipc:///tmp/tandem-chan-%d-change.ipc", (int)getpid());
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config(ep, &s);
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    cm_chan_client_config cc = client_config(ep, "steady");
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(run_batches(c, 6000, 2, 8, CM_DTYPE_BF16, 0) == 2);
    server_stop(&s);
    cfg.target_id = 0x5678;
    cfg.weights_id = 0x5679;
    TST_CHECK(server_start(&s, &cfg));
    batch b;
    make_batch(&b, 6002, 8);
    TST_CHECK(submit(c, &b) == CM_OK);
    cm_chan_answer *a = NULL;
    cm_status       st = cm_chan_client_recv(c, 10000, &a);
    TST_CHECK(st == CM_ERR_INVALID_ARG && !a && strstr(cm_last_error(), "now serves another target"));
    printf("server restarted with another target: the client stops with %s\n", cm_status_str(st));
    cm_chan_client_destroy(&c);
    server_stop(&s);
}

// ----------------------------------------------------------------------------
// CURVE and endpoints

static void test_endpoints_and_keys(void) {
    int local = -1;
    TST_CHECK(cm_chan_endpoint_check("tcp://127.0.0.1:5555", &local) == CM_OK && local == 1);
    TST_CHECK(cm_chan_endpoint_check("tcp://127.1.2.3:*", &local) == CM_OK && local == 1);
    TST_CHECK(cm_chan_endpoint_check("tcp://localhost:1", &local) == CM_OK && local == 1);
    TST_CHECK(cm_chan_endpoint_check("tcp://[::1]:1", &local) == CM_OK && local == 1);
    TST_CHECK(cm_chan_endpoint_check("ipc:///tmp/x", &local) == CM_OK && local == 1);
    TST_CHECK(cm_chan_endpoint_check("tcp://0.0.0.0:5555", &local) == CM_OK && local == 0);
    TST_CHECK(cm_chan_endpoint_check("tcp://*:5555", &local) == CM_OK && local == 0);
    TST_CHECK(cm_chan_endpoint_check("tcp://127.0.0.1.evil.com:5", &local) == CM_OK && local == 0);
    TST_CHECK(cm_chan_endpoint_check("tcp://eth0:5555", &local) == CM_OK && local == 0);
    TST_CHECK(cm_chan_endpoint_check("udp://127.0.0.1:5", &local) == CM_ERR_INVALID_ARG);
    TST_CHECK(cm_chan_endpoint_check("tcp://127.0.0.1", &local) == CM_ERR_INVALID_ARG);
    TST_CHECK(cm_chan_endpoint_check(NULL, &local) == CM_ERR_INVALID_ARG);
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config("tcp://0.0.0.0:*", &s);
    cm_chan_server       *srv = NULL;
    TST_CHECK(cm_chan_server_create(&srv, &cfg) == CM_ERR_INVALID_ARG && !srv);
    TST_CHECK(strstr(cm_last_error(), "without CURVE") != NULL);
    cm_chan_client_config cc = client_config("tcp://10.1.2.3:5555", "remote");
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_ERR_INVALID_ARG && !c);
    cfg.endpoint = "tcp://127.0.0.1:*";
    cfg.name = "bad name!";
    TST_CHECK(cm_chan_server_create(&srv, &cfg) == CM_ERR_INVALID_ARG && !srv);
}

static void test_curve(void) {
    if (!cm_chan_curve_available()) {
        printf("curve: libzmq has no CURVE; only the refusal is checked\n");
        TST_CHECK(cm_chan_curve_keygen("/tmp/never") == CM_ERR_UNSUPPORTED);
        return;
    }
    char dir[256], allowed[300], p[400], q[400];
    snprintf(dir, sizeof dir, "/tmp/tandem-chan-keys-%d", (int)getpid());
    snprintf(allowed, sizeof allowed, "%s/allowed", dir);
    mkdir(dir, 0700);
    mkdir(allowed, 0700);
    snprintf(p, sizeof p, "%s/server", dir);
    TST_CHECK(cm_chan_curve_keygen(p) == CM_OK);
    TST_CHECK(cm_chan_curve_keygen(p) == CM_ERR_IO); /* never overwrites */
    snprintf(p, sizeof p, "%s/alice", allowed);
    TST_CHECK(cm_chan_curve_keygen(p) == CM_OK);
    snprintf(p, sizeof p, "%s/mallory", dir);
    TST_CHECK(cm_chan_curve_keygen(p) == CM_OK);
    struct stat sb;
    snprintf(p, sizeof p, "%s/server.key", dir);
    TST_CHECK(stat(p, &sb) == 0 && (sb.st_mode & 0077) == 0);
    /* a bad key file is refused without echoing its content */
    snprintf(q, sizeof q, "%s/bad.key", dir);
    FILE *f = fopen(q, "w");
    fprintf(f, "# comment\nSECRETSECRETSECRET\n");
    fclose(f);
    char key[CM_CHAN_KEY_LEN + 1];
    TST_CHECK(cm_chan_curve_read_key(q, key) == CM_ERR_FORMAT && !strstr(cm_last_error(), "SECRET"));

    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    char                  skey[400], spub[400], akey[400], mkey[400], mpub[400];
    snprintf(skey, sizeof skey, "%s/server.key", dir);
    snprintf(spub, sizeof spub, "%s/server.pub", dir);
    snprintf(akey, sizeof akey, "%s/alice.key", allowed);
    snprintf(mkey, sizeof mkey, "%s/mallory.key", dir);
    snprintf(mpub, sizeof mpub, "%s/mallory.pub", dir);
    cfg.curve_secret_key = skey;
    cfg.curve_client_keys = allowed;
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    const char *ep = cm_chan_server_endpoint(s.srv);
    /* alice's key is in the directory */
    cm_chan_client_config cc = client_config(ep, "alice");
    cc.curve_server_key = spub;
    cc.curve_secret_key = akey;
    cm_chan_client *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(run_batches(c, 4000, 4, 32, CM_DTYPE_BF16, 0) == 4);
    cm_chan_client_destroy(&c);
    /* mallory knows the server's key but hers is not accepted */
    cc.name = "mallory";
    cc.curve_secret_key = mkey;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    cm_status st = cm_chan_client_wait_ready(c, 4000, NULL);
    TST_CHECK(st == CM_ERR_PROTOCOL && strstr(cm_last_error(), "refused this client's CURVE key"));
    cm_chan_client_destroy(&c);
    /* a client with the wrong server key, or none, gets no session */
    cc.curve_server_key = mpub;
    cc.curve_secret_key = akey;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(cm_chan_client_wait_ready(c, 1500, NULL) != CM_OK);
    cm_chan_client_destroy(&c);
    cc.curve_server_key = NULL;
    cc.curve_secret_key = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(cm_chan_client_wait_ready(c, 1500, NULL) != CM_OK);
    cm_chan_client_destroy(&c);
    cm_chan_server_stats ss;
    cm_chan_server_get_stats(s.srv, &ss);
    TST_CHECK(ss.sessions_opened == 1);
    printf("curve: accepted key served, refused key rejected (%s), wrong or no server key: no session\n",
           cm_status_str(st));
    server_stop(&s);
    const char *files[] = {"server.key", "server.pub",        "mallory.key",      "mallory.pub",
                           "bad.key",    "allowed/alice.key", "allowed/alice.pub"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(allowed);
    rmdir(dir);
}

/* Encoding nccl on a machine without the NCCL path: the client refuses it without hooks, as a
 * fallback, or with keep_frames; a server without hooks (a CPU server) refuses the session
 * with a message naming the fix, before any hook is called. (The path itself is tested on
 * two GPUs: test_ts_nccl.) */
static int hook_calls;
static cm_status no_offer(void *u, cm_proto_nccl *o) {
    (void)u, (void)o;
    hook_calls++;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "no GPU here");
}
static cm_status no_join(void *u, const cm_proto_nccl *o) {
    (void)u, (void)o;
    hook_calls++;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "no GPU here");
}
static cm_status no_recv(void *u, uint32_t slot, uint32_t n, const cm_proto_tensor *t, const void **dev) {
    (void)u, (void)slot, (void)n, (void)t, (void)dev;
    hook_calls++;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "no GPU here");
}
static void no_leave(void *u) {
    (void)u;
    hook_calls++;
}

static void test_nccl_refused(void) {
    server                s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    const char               *ep = cm_chan_server_endpoint(s.srv);
    const cm_chan_nccl_client hooks = {no_offer, no_join, no_recv, no_leave, NULL};
    cm_chan_client           *c = NULL;
    cm_chan_client_config     cc = client_config(ep, "nccl");
    cc.encoding = CM_ENCODING_NCCL;
    cc.accept = 0;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_ERR_INVALID_ARG && !c);
    TST_CHECK(strstr(cm_last_error(), "GPU with NCCL") != NULL);
    cc.nccl = &hooks;
    cc.accept = CM_ENCODING_LOSSLESS_MASK;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_ERR_INVALID_ARG && !c);
    cc.accept = 0;
    cc.keep_frames = 1;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_ERR_INVALID_ARG && !c);
    cc.keep_frames = 0;
    cm_chan_client_config fb = client_config(ep, "nccl-fallback");
    fb.accept |= 1u << CM_ENCODING_NCCL;
    TST_CHECK(cm_chan_client_create(&c, &fb) == CM_ERR_INVALID_ARG && !c);
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    cm_status st = cm_chan_client_wait_ready(c, 5000, NULL);
    TST_CHECK(st == CM_ERR_INVALID_ARG);
    TST_CHECK(strstr(cm_last_error(), "has no NCCL path") != NULL);
    if (st != CM_ERR_INVALID_ARG)
        fprintf(stderr, "nccl refusal: %s: %s\n", cm_status_str(st), cm_last_error());
    cm_chan_client_destroy(&c);
    TST_CHECK(hook_calls == 0);
    server_stop(&s);
    printf("nccl: refused without hooks, as a fallback, with keep_frames, and by a server without NCCL\n");
}

// ----------------------------------------------------------------------------
// workers (replicas) and streamed answers

/* What the workers of test_workers share. */
typedef struct wshared {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             running, max_running; /* computes in progress */
    int             waits_in_compute;     /* wait callbacks that ran before their compute returned */
    int             fail_left;            /* wait fails this many more times (then the retry works) */
    int             jobs[3];
} wshared;

typedef struct wsyn {
    wshared *sh;
    int      index;
    int      in_compute, waited0; /* this worker's current job (its compute and its encoder) */
} wsyn;

static cm_status w_wait(void *arg, uint32_t i) {
    wsyn    *w = arg;
    wshared *sh = w->sh;
    pthread_mutex_lock(&sh->mu);
    sh->waits_in_compute += w->in_compute;
    if (i == 0)
        w->waited0 = 1;
    int fail = i == 1 && sh->fail_left > 0 ? sh->fail_left-- : 0;
    pthread_cond_broadcast(&sh->cv);
    pthread_mutex_unlock(&sh->mu);
    return fail ? CM_FAIL(CM_ERR_FORMAT, "the test's capture check refuses tensor 1") : CM_OK;
}

/* Writes each layer, announces it, and after the first waits (≤ 10 s) until the encoder has
 * taken it: an answer streams while its compute runs, or the test fails. The first job also
 * waits for a second compute to start on another worker. */
static cm_status w_compute(void *user, cm_chan_job *job) {
    wsyn                   *w = user;
    wshared                *sh = w->sh;
    const cm_proto_request *r = job->req;
    if (job->worker != w->index)
        return CM_FAIL(CM_ERR_INVALID_ARG, "worker %d was given worker %d's user", job->worker, w->index);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    pthread_mutex_lock(&sh->mu);
    sh->jobs[w->index]++;
    if (++sh->running > sh->max_running)
        sh->max_running = sh->running;
    pthread_cond_broadcast(&sh->cv);
    while (sh->max_running < 2 && pthread_cond_timedwait(&sh->cv, &sh->mu, &until) == 0) {
    }
    w->in_compute = 1;
    w->waited0 = 0;
    pthread_mutex_unlock(&sh->mu);
    job->out_dtype = CM_DTYPE_F32;
    job->wait = w_wait;
    job->wait_arg = w;
    for (uint32_t i = 0; i < r->n_layers; i++) {
        float *o = job->out[i];
        for (uint32_t t = 0; t < r->n_tokens; t++)
            for (uint32_t d = 0; d < job->hidden_size; d++)
                o[(size_t)t * job->hidden_size + d] = syn_value(r->tokens[t], r->layer_ids[i], d);
        cm_chan_job_ready(job, i);
        if (i == 0) {
            pthread_mutex_lock(&sh->mu);
            while (!w->waited0 && pthread_cond_timedwait(&sh->cv, &sh->mu, &until) == 0) {
            }
            pthread_mutex_unlock(&sh->mu);
        }
    }
    pthread_mutex_lock(&sh->mu);
    w->in_compute = 0;
    sh->running--;
    pthread_mutex_unlock(&sh->mu);
    return CM_OK;
}

/* Three workers with their own users serve two trainers at once; every answer streams (its
 * first tensor is encoded while its compute runs) and is exact; a failing wait becomes an
 * ERROR and the trainer's re-send is answered. */
static void test_workers(void) {
    wshared sh = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .fail_left = 1};
    wsyn    ws[3] = {{&sh, 0, 0, 0}, {&sh, 1, 0, 0}, {&sh, 2, 0, 0}};
    void   *users[3] = {&ws[0], &ws[1], &ws[2]};
    server  s = {.syn = {.mu = PTHREAD_MUTEX_INITIALIZER}};
    cm_chan_server_config cfg = server_config("tcp://127.0.0.1:*", &s);
    cfg.compute = w_compute;
    cfg.n_workers = 3;
    cfg.worker_users = users;
    if (!server_start(&s, &cfg)) {
        TST_CHECK(0);
        return;
    }
    const char       *ep = cm_chan_server_endpoint(s.srv);
    const cm_encoding encs[2] = {CM_ENCODING_ZSTD_BYTEPLANE, CM_ENCODING_RAW};
    cm_chan_client   *c[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        cm_chan_client_config cc = client_config(ep, k ? "w-raw" : "w-zstd");
        cc.encoding = encs[k];
        cc.accept = 0;
        TST_CHECK(cm_chan_client_create(&c[k], &cc) == CM_OK);
        TST_CHECK(cm_chan_client_wait_ready(c[k], 5000, NULL) == CM_OK);
    }
    int good0 = run_batches(c[0], 7000, 16, 45, CM_DTYPE_BF16, 0);
    int good1 = run_batches(c[1], 8000, 16, 3, CM_DTYPE_BF16, 0);
    TST_CHECK(good0 == 16 && good1 == 16);
    cm_chan_client_stats cst;
    cm_chan_client_get_stats(c[0], &cst);
    uint64_t resends = cst.resends;
    cm_chan_client_get_stats(c[1], &cst);
    resends += cst.resends;
    for (int k = 0; k < 2; k++)
        cm_chan_client_destroy(&c[k]);
    cm_chan_server_stats st;
    cm_chan_server_get_stats(s.srv, &st);
    server_stop(&s);
    printf("3 workers: %d/16 + %d/16 answers exact (zstd-byteplane, raw; F32 rounded to BF16), jobs per "
           "worker %d %d %d, at most %d computes at once, %d encodes started inside their compute, %llu "
           "error(s) sent and %llu re-sent\n",
           good0, good1, sh.jobs[0], sh.jobs[1], sh.jobs[2], sh.max_running, sh.waits_in_compute,
           (unsigned long long)st.errors_sent, (unsigned long long)resends);
    TST_CHECK(sh.max_running >= 2);
    TST_CHECK(sh.waits_in_compute >= 32); /* every answer's first tensor, at least */
    TST_CHECK(st.errors_sent == 1 && resends >= 1 && sh.fail_left == 0);
    TST_CHECK(sh.jobs[0] + sh.jobs[1] + sh.jobs[2] == 33);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    char ipc[128];
    snprintf(ipc, sizeof ipc, "ipc:///tmp/tandem-chan-%d-rt.ipc", (int)getpid());
    test_endpoints_and_keys();
    test_round_trip("tcp://127.0.0.1:*", CM_DTYPE_BF16);
    test_round_trip(ipc, CM_DTYPE_F32);
    test_workers();
    test_nccl_refused();
    test_credits();
    test_fairness(2);
    test_fairness(3);
    test_flip_and_drop();
    test_raw_peer_to_server();
    test_fake_server();
    test_vanishing_peers();
    test_target_change();
    test_curve();
    /* the fake server's socket file (libzmq leaves it; cm_chan_server removes its own) */
    char path[128];
    snprintf(path, sizeof path, "/tmp/tandem-chan-%d-vanish.ipc", (int)getpid());
    unlink(path);
    snprintf(path, sizeof path, "/tmp/tandem-chan-%d-rt.ipc", (int)getpid());
    TST_CHECK(access(path, F_OK) != 0); /* removed by the server's destroy */
    return tst_report();
}
