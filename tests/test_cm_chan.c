/* tests/test_cm_chan.c — ZeroMQ sessions (cm_chan) over real loopback sockets, with well-behaved
 * peers: an in-process server thread with a synthetic compute callback (tst_chan.h: values are a
 * function of token, layer and column, so every answer is checked bit for bit) and real clients.
 * Round trips in every encoding over tcp:// and ipc:// (answers in page-locked buffers through
 * the host_lock hooks, and in pageable memory when locking fails), credits, fair service of two
 * and three trainers, worker replicas with streamed answers, NCCL refused by a server without it,
 * a server that comes back with another target, endpoints and CURVE with accepted and refused
 * keys. Peers that misbehave on purpose are test_cm_chan_faults.c's. */
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
#include "tst_chan.h"

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
        cm_proto_tensor    ts[8];
        cm_proto_answer    pa = {.tensors = ts, .cap_tensors = 8};
        cm_proto_limits    lim = CM_PROTO_LIMITS_DEFAULT;
        cm_compress_config ccfg = CM_COMPRESS_CONFIG_DEFAULT;
        cm_compress       *cz = NULL;
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
static int       hook_calls;
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
    test_target_change();
    test_curve();
    char path[128];
    snprintf(path, sizeof path, "/tmp/tandem-chan-%d-rt.ipc", (int)getpid());
    TST_CHECK(access(path, F_OK) != 0); /* removed by the server's destroy */
    return tst_report();
}
