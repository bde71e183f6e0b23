/* tests/test_cm_dec_faults.c — the decoding endpoint's client (cm_dec.h) against what it must refuse
 * or survive, over real sockets: a fake server (a raw ROUTER) whose stale, corrupt or inconsistent
 * answers the client refuses, an answer sent just before the server closes that a stopped client
 * still finds, and CURVE with an accepted and a refused key (the server's step callback is the fake
 * target of tst_dec.h). */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
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
#include "cm_log.h"
#include "tst.h"
#include "tst_dec.h"

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
        cm_dec_client     *c = client_new(ep, 5000);
        struct sched_param idle = {0};
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

int main(void) {
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    test_fake_server();
    test_reply_before_close();
    test_curve();
    return tst_report();
}
