/* tests/test_cm_chan_call.c — cm_chan_server_call (cm_chan.h) on an in-process server over real
 * loopback sockets: a call runs on the thread of its worker's init and compute callbacks; calls
 * interleave with the hidden-state requests of a live client (whose answers stay exact), also when
 * two threads call back to back (the jobs are not starved); a function's failure comes back with
 * its message; and the refusals: a bad worker, a call from a worker's own thread, a call before
 * run() or after it returned, a waiting call released with CM_ERR_PEER_GONE when the server stops
 * (a running one finishes), and a call handed to a worker whose init then fails. (Apart from
 * test_cm_chan.c, to keep both files short.) */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cm_chan.h"
#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_time.h"
#include "tst.h"

#define D_TEST    16
#define N_WORKERS 2

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static float syn_value(int32_t tok, int layer, int64_t d) {
    return (float)(tok % 97) * 0.25f + (float)layer * 1.5f + (float)d * 0.0078125f - 3.0f;
}

// ----------------------------------------------------------------------------
// a server whose workers record their threads and what they ran

#define LOG_MAX 4096

typedef struct wk {
    int       index;
    pthread_t init_thread;
    int       init_ms;   /* init sleeps this long, */
    int       init_fail; /* then fails */
    int       compute_ms;
    int       foreign_thread; /* compute saw a thread other than init's */
    cm_status call_inside;    /* what cm_chan_server_call gave inside compute (worker 0, first job) */
    char      log[LOG_MAX];   /* 'j' per job, 'c' per call, in order */
    int       n_log;
} wk;

typedef struct srv {
    cm_chan_server *s;
    pthread_t       th;
    cm_status       run_status;
    wk              w[N_WORKERS];
    void           *users[N_WORKERS];
} srv;

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static srv            *g_srv; /* for the call made inside compute */

static void log_event(wk *w, char ev) {
    pthread_mutex_lock(&log_mu);
    if (w->n_log < LOG_MAX - 1)
        w->log[w->n_log++] = ev;
    pthread_mutex_unlock(&log_mu);
}

static cm_status w_init(void *user) {
    wk *w = user;
    w->init_thread = pthread_self();
    sleep_ms(w->init_ms);
    return w->init_fail ? CM_FAIL(CM_ERR_IO, "worker %d: the test's init fails", w->index) : CM_OK;
}

static cm_status nop_call(void *user, void *arg) {
    (void)user, (void)arg;
    return CM_OK;
}

static cm_status w_compute(void *user, cm_chan_job *job) {
    wk *w = user;
    if (!pthread_equal(pthread_self(), w->init_thread))
        w->foreign_thread = 1;
    if (w->index == 0 && w->call_inside == CM_STATUS_COUNT)
        w->call_inside = cm_chan_server_call(g_srv->s, 0, nop_call, NULL);
    log_event(w, 'j');
    sleep_ms(w->compute_ms);
    const cm_proto_request *r = job->req;
    for (uint32_t i = 0; i < r->n_layers; i++) {
        float *o = job->out[i];
        for (uint32_t t = 0; t < r->n_tokens; t++)
            for (uint32_t d = 0; d < job->hidden_size; d++)
                o[(size_t)t * job->hidden_size + d] = syn_value(r->tokens[t], r->layer_ids[i], d);
    }
    return CM_OK;
}

static void *run_main(void *arg) {
    srv *v = arg;
    v->run_status = cm_chan_server_run(v->s);
    return NULL;
}

static int srv_create(srv *v, int compute_ms, int n_workers) {
    memset(v, 0, sizeof *v);
    for (int i = 0; i < N_WORKERS; i++) {
        v->w[i] = (wk){.index = i, .compute_ms = compute_ms, .call_inside = CM_STATUS_COUNT};
        v->users[i] = &v->w[i];
    }
    cm_chan_server_config cfg = CM_CHAN_SERVER_CONFIG_DEFAULT;
    cfg.endpoint = "tcp://127.0.0.1:*";
    cfg.weights_id = 0x77aa55ull;
    cfg.hidden_dtype = CM_DTYPE_F32;
    cfg.hidden_size = D_TEST;
    cfg.n_layers = 4;
    cfg.max_tokens = 64;
    cfg.heartbeat_ms = 100;
    cfg.peer_timeout_ms = 2000;
    cfg.init = w_init;
    cfg.compute = w_compute;
    cfg.n_workers = n_workers;
    cfg.worker_users = v->users;
    g_srv = v;
    return tst_ok(cm_chan_server_create(&v->s, &cfg), "server create");
}

static void srv_run(srv *v) {
    pthread_create(&v->th, NULL, run_main, v);
}

static void srv_stop(srv *v, cm_status want) {
    cm_chan_server_stop(v->s);
    pthread_join(v->th, NULL);
    TST_CHECK(v->run_status == want);
    cm_chan_server_destroy(&v->s);
}

// ----------------------------------------------------------------------------
// calls

typedef struct callrec {
    pthread_t thread;
    int       sleep_ms;
    cm_status fail; /* returned with a message when not CM_OK */
} callrec;

static cm_status rec_call(void *user, void *arg) {
    callrec *c = arg;
    c->thread = pthread_self();
    log_event(user, 'c');
    sleep_ms(c->sleep_ms);
    return c->fail ? CM_FAIL(c->fail, "worker %d: the test's call fails", ((wk *)user)->index) : CM_OK;
}

/* Waits (≤ 10 s) until call() works: run() has opened for calls. */
static int wait_open(srv *v) {
    callrec c = {0};
    for (int i = 0; i < 1000; i++) {
        if (cm_chan_server_call(v->s, 0, rec_call, &c) == CM_OK)
            return 1;
        sleep_ms(10);
    }
    return 0;
}

typedef struct caller {
    srv       *v;
    int        worker, n, failures;
    atomic_int stop;
    int64_t    max_wait_ms;
} caller;

/* Calls its worker back to back (n times, or until stop). */
static void *caller_main(void *arg) {
    caller *c = arg;
    for (int i = 0; (c->n ? i < c->n : !atomic_load(&c->stop)); i++) {
        callrec r = {.sleep_ms = 2};
        int64_t t0 = cm_now_ms();
        if (cm_chan_server_call(c->v->s, c->worker, rec_call, &r) != CM_OK)
            c->failures++;
        int64_t dt = cm_now_ms() - t0;
        if (dt > c->max_wait_ms)
            c->max_wait_ms = dt;
    }
    return NULL;
}

/* A call runs on its worker's own thread (the one of init and compute), and not on another's. */
static void test_thread(void) {
    srv v;
    if (!srv_create(&v, 0, N_WORKERS))
        return;
    callrec early = {0};
    TST_FAILS(cm_chan_server_call(v.s, 0, rec_call, &early), CM_ERR_PEER_GONE, "not running");
    TST_FAILS(cm_chan_server_call(v.s, N_WORKERS, rec_call, &early), CM_ERR_INVALID_ARG, "worker 2",
              "0 to 1");
    TST_FAILS(cm_chan_server_call(v.s, -1, rec_call, &early), CM_ERR_INVALID_ARG, "worker -1");
    TST_FAILS(cm_chan_server_call(v.s, 0, NULL, &early), CM_ERR_INVALID_ARG, "no function");
    srv_run(&v);
    TST_CHECK(wait_open(&v));
    callrec c[N_WORKERS] = {{0}};
    for (int i = 0; i < N_WORKERS; i++) {
        TST_CHECK(cm_chan_server_call(v.s, i, rec_call, &c[i]) == CM_OK);
        TST_CHECK(pthread_equal(c[i].thread, v.w[i].init_thread));
        TST_CHECK(!pthread_equal(c[i].thread, pthread_self()));
    }
    TST_CHECK(!pthread_equal(c[0].thread, c[1].thread));
    callrec bad = {.fail = CM_ERR_IO};
    TST_FAILS(cm_chan_server_call(v.s, 1, rec_call, &bad), CM_ERR_IO, "worker 1: the test's call fails");
    srv_stop(&v, CM_OK);
    TST_FAILS(cm_chan_server_call(NULL, 0, rec_call, &early), CM_ERR_INVALID_ARG, "no server");
}

/* A worker's calls interleave with a live client's requests: with one worker and two threads that
 * call it back to back, the client's answers all come, exact, and the calls all return. */
static void test_interleave(void) {
    srv v;
    if (!srv_create(&v, 10, 1))
        return;
    srv_run(&v);
    TST_CHECK(wait_open(&v));
    cm_chan_client_config cc = CM_CHAN_CLIENT_CONFIG_DEFAULT;
    cc.endpoint = cm_chan_server_endpoint(v.s);
    cc.name = "live";
    cc.credits = 4;
    cc.encoding = CM_ENCODING_RAW;
    cc.heartbeat_ms = 100;
    cc.peer_timeout_ms = 2000;
    cm_chan_client *cl = NULL;
    TST_CHECK(tst_ok(cm_chan_client_create(&cl, &cc), "client create"));
    TST_CHECK(tst_ok(cm_chan_client_wait_ready(cl, 5000, NULL), "client ready"));
    caller    ca[2] = {{.v = &v, .worker = 0}, {.v = &v, .worker = 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&th[i], NULL, caller_main, &ca[i]);
    enum { N_BATCHES = 40, T = 9 };
    int32_t tokens[N_BATCHES][T], cu[2] = {0, T}, layers[2] = {3, 1};
    int     next = 0, got = 0, good = 0;
    int64_t deadline = cm_now_ms() + 30000;
    while (got < N_BATCHES && cm_now_ms() < deadline) {
        while (next < N_BATCHES) {
            for (int t = 0; t < T; t++)
                tokens[next][t] = next * 13 + t;
            if (cm_chan_client_submit(cl, 100 + (uint64_t)next, tokens[next], T, cu, 1, layers, 2) != CM_OK)
                break;
            next++;
        }
        cm_chan_answer *a;
        if (cm_chan_client_recv(cl, 200, &a) != CM_OK)
            continue;
        int b = (int)(a->batch_id - 100),
            ok = a->status == CM_OK && a->n_tensors == 2 && b >= 0 && b < N_BATCHES;
        for (uint32_t i = 0; ok && i < 2; i++) {
            const float *x = a->tensors[i].data;
            for (int t = 0; ok && t < T; t++)
                for (int d = 0; ok && d < D_TEST; d++)
                    ok = x[t * D_TEST + d] == syn_value(tokens[b][t], layers[i], d);
        }
        good += ok;
        got++;
        cm_chan_client_release(cl, &a);
    }
    for (int i = 0; i < 2; i++) {
        atomic_store(&ca[i].stop, 1);
        pthread_join(th[i], NULL);
    }
    cm_chan_client_destroy(&cl);
    srv_stop(&v, CM_OK);
    TST_CHECK(got == N_BATCHES && good == N_BATCHES);
    TST_CHECK(ca[0].failures == 0 && ca[1].failures == 0);
    /* worker 0 ran calls and jobs in alternation: jobs between calls, calls between jobs */
    int       jobs = 0, calls = 0, jc = 0, cj = 0;
    const wk *w0 = &v.w[0];
    for (int i = 0; i < w0->n_log; i++) {
        jobs += w0->log[i] == 'j', calls += w0->log[i] == 'c';
        if (i) {
            jc += w0->log[i - 1] == 'j' && w0->log[i] == 'c';
            cj += w0->log[i - 1] == 'c' && w0->log[i] == 'j';
        }
    }
    printf("interleave: %d/%d answers exact; the worker ran %d jobs and %d calls (%d job→call, %d call→job); "
           "longest call %lld ms\n",
           good, N_BATCHES, jobs, calls, jc, cj,
           (long long)(ca[0].max_wait_ms > ca[1].max_wait_ms ? ca[0].max_wait_ms : ca[1].max_wait_ms));
    TST_CHECK(calls >= 10 && jobs == N_BATCHES);
    TST_CHECK(cj >= jobs / 2); /* most jobs came right after a call: neither side starved */
    int last_job = w0->n_log - 1, calls_among_jobs = 0;
    while (last_job >= 0 && w0->log[last_job] != 'j')
        last_job--;
    for (int i = 0; i < last_job; i++)
        calls_among_jobs += w0->log[i] == 'c';
    TST_CHECK(calls_among_jobs <= 2 * jobs); /* while jobs wait, a call does not follow a call */
    TST_CHECK(v.w[0].foreign_thread == 0);
    TST_CHECK(v.w[0].call_inside == CM_ERR_INVALID_ARG); /* from its own compute: would wait for itself */
}

typedef struct bg_call {
    srv      *v;
    int       worker;
    callrec   r;
    cm_status st;
    char      msg[256];
    int64_t   done_ms;
} bg_call;

static void *bg_main(void *arg) {
    bg_call *b = arg;
    b->st = cm_chan_server_call(b->v->s, b->worker, rec_call, &b->r);
    snprintf(b->msg, sizeof b->msg, "%s", cm_last_error());
    b->done_ms = cm_now_ms();
    return NULL;
}

/* Stopping releases a waiting call with CM_ERR_PEER_GONE before the job ahead of it ends; a call
 * that runs finishes; after run() returned, calls fail at once. */
static void test_stop(void) {
    srv v;
    if (!srv_create(&v, 0, N_WORKERS))
        return;
    srv_run(&v);
    TST_CHECK(wait_open(&v));
    /* worker 1 runs a long call, worker 0 a long one with a second waiting behind it */
    bg_call   run1 = {.v = &v, .worker = 1, .r = {.sleep_ms = 400}};
    bg_call   run0 = {.v = &v, .worker = 0, .r = {.sleep_ms = 400}};
    bg_call   wait0 = {.v = &v, .worker = 0, .r = {.sleep_ms = 0}};
    pthread_t th[3];
    pthread_create(&th[0], NULL, bg_main, &run1);
    pthread_create(&th[1], NULL, bg_main, &run0);
    sleep_ms(100);
    pthread_create(&th[2], NULL, bg_main, &wait0);
    sleep_ms(100);
    int64_t t_stop = cm_now_ms();
    cm_chan_server_stop(v.s);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    pthread_join(v.th, NULL);
    TST_CHECK(v.run_status == CM_OK);
    TST_CHECK(run1.st == CM_OK && run0.st == CM_OK);
    TST_CHECK(wait0.st == CM_ERR_PEER_GONE && strstr(wait0.msg, "stopping"));
    TST_CHECK(wait0.done_ms < run0.done_ms); /* released at once, not after the call ahead of it */
    printf("stop: the waiting call released after %lld ms, the running ones done after %lld and %lld ms\n",
           (long long)(wait0.done_ms - t_stop), (long long)(run0.done_ms - t_stop),
           (long long)(run1.done_ms - t_stop));
    callrec late = {0};
    TST_FAILS(cm_chan_server_call(v.s, 0, rec_call, &late), CM_ERR_PEER_GONE, "not running");
    cm_chan_server_destroy(&v.s);
}

/* A call handed to a worker still in its init: the init fails, run() returns its failure, and
 * the call is released with CM_ERR_PEER_GONE. */
static void test_init_fails(void) {
    srv v;
    if (!srv_create(&v, 0, N_WORKERS))
        return;
    v.w[0].init_ms = 300, v.w[0].init_fail = 1;
    srv_run(&v);
    bg_call b = {.v = &v, .worker = 0};
    int64_t until = cm_now_ms() + 5000;
    for (;;) { /* until run() has opened for calls (the call then waits for the init) */
        bg_main(&b);
        if (!(b.st == CM_ERR_PEER_GONE && strstr(b.msg, "not running")) || cm_now_ms() > until)
            break;
        sleep_ms(5);
    }
    pthread_join(v.th, NULL);
    TST_CHECK(v.run_status == CM_ERR_IO);
    TST_CHECK(b.st == CM_ERR_PEER_GONE && strstr(b.msg, "the server failed"));
    cm_chan_server_destroy(&v.s);
}

int main(void) {
    cm_log_set_level(CM_LOG_LEVEL_WARN);
    test_thread();
    test_interleave();
    test_stop();
    test_init_fails();
    return tst_report();
}
