/* tests/test_ts_serve.c — the real `target-server serve --model models/tiny-qwen35` process and
 * cm_chan clients over loopback: answers equal `target-server dump` bit for bit (F32 raw and
 * zstd; BF16 zstd-byteplane against the dump rounded to BF16); the server killed with SIGKILL
 * mid-run and restarted on the same endpoint, after which the run ends with every batch id
 * delivered exactly once (a ledger) and a second trainer that attached meanwhile served too;
 * SIGTERM ends the server with status 0; bad flags, a busy port and a refused non-loopback
 * bind exit with one message; an ipc:// path held by a live server is refused and tcp://[::1]
 * binds; CURVE keys through the command line; replicas split over pipeline stages (--stages)
 * answer the same bits. `test_ts_serve fp8`: the same exactness at --precision
 * fp8. */
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_chan.h"
#include "cm_log.h"
#include "cm_safetensors.h"
#include "tst.h"
#include "tst_proc.h"
#include "tst_serve.h"

#define N_PATTERNS 4
#define D_MODEL    64
#define N_LAYERS   6

static char        bin[1024], model[1024], tmp[256];
static const char *precision = "bf16"; /* of the dump references and of test_fp8's server */

// ----------------------------------------------------------------------------
// the server process

typedef struct proc {
    pid_t pid;
    char  log[512], ep_file[512], endpoint[256];
} proc;

/* Starts `target-server serve` with extra args; waits for its endpoint file (bound). */
static int serve_start(proc *p, const char *tag, const char *bind, const char *const *extra) {
    char path[400];
    snprintf(path, sizeof path, "%s/%s", tmp, tag);
    snprintf(p->log, sizeof p->log, "%s.log", path);
    snprintf(p->ep_file, sizeof p->ep_file, "%s.ep", path);
    p->pid = tst_serve_start(bin, model, bind, path, extra, p->endpoint, sizeof p->endpoint, 20000);
    return p->pid > 0;
}

/* Sends sig and returns the exit status (128 + signal when killed); -1 if it outlived 15 s. */
static int serve_end(proc *p, int sig) {
    return tst_end(p->pid, sig, 15000);
}

// ----------------------------------------------------------------------------
// batches and the dump reference

typedef struct pattern {
    int32_t tokens[128], cu[4];
    int     T, N;
    float  *ref[N_LAYERS]; /* dump's layer_<i>, F32 [T, D] */
} pattern;

static pattern       pats[N_PATTERNS];
static const int32_t want_layers[3] = {4, 1, 5}; /* not sorted: answers follow the request */

static int make_reference(void) {
    for (int k = 0; k < N_PATTERNS; k++) {
        pattern *p = &pats[k];
        p->T = 40 + 24 * k;
        p->N = 1 + k % 3;
        for (int t = 0; t < p->T; t++)
            p->tokens[t] = (int32_t)((k * 97 + t * 31 + 7) % 512);
        p->cu[0] = 0;
        for (int s = 1; s < p->N; s++)
            p->cu[s] = p->T * s / p->N;
        p->cu[p->N] = p->T;
        char in[512], out[512], err[512];
        snprintf(in, sizeof in, "%s/in%d.safetensors", tmp, k);
        snprintf(out, sizeof out, "%s/out%d.safetensors", tmp, k);
        snprintf(err, sizeof err, "%s/dump%d.err", tmp, k);
        cm_st_writer *w = NULL;
        int64_t       st_t = p->T, st_c = p->N + 1;
        if (cm_st_writer_create(&w) != CM_OK ||
            cm_st_writer_add(w, "input_ids", CM_DTYPE_I32, 1, &st_t, p->tokens) != CM_OK ||
            cm_st_writer_add(w, "cu_seqlens", CM_DTYPE_I32, 1, &st_c, p->cu) != CM_OK ||
            cm_st_writer_write(w, in) != CM_OK) {
            fprintf(stderr, "cannot write %s: %s\n", in, cm_last_error());
            cm_st_writer_destroy(&w);
            return 0;
        }
        cm_st_writer_destroy(&w);
        char *argv[] = {bin,     "dump", "--model",     model,  "--input",     in,
                        "--out", out,    "--log-level", "warn", "--precision", (char *)precision, NULL};
        if (tst_run(argv, err) != 0) {
            fprintf(stderr, "dump failed:\n%s\n", tst_slurp(err));
            return 0;
        }
        cm_st *st = NULL;
        if (cm_st_open_file(&st, out) != CM_OK)
            return 0;
        for (int l = 0; l < N_LAYERS; l++) {
            char name[32];
            snprintf(name, sizeof name, "layer_%d", l);
            const cm_st_tensor *t = cm_st_find(st, name);
            if (!t || t->dtype != CM_DTYPE_F32 || t->shape[0] != p->T || t->shape[1] != D_MODEL) {
                cm_st_destroy(&st);
                return 0;
            }
            p->ref[l] = malloc((size_t)p->T * D_MODEL * sizeof(float));
            memcpy(p->ref[l], t->data, (size_t)p->T * D_MODEL * sizeof(float));
        }
        cm_st_destroy(&st);
        unlink(in);
        unlink(out);
        unlink(err);
    }
    return 1;
}

static cm_status submit_pattern(cm_chan_client *c, uint64_t id) {
    const pattern *p = &pats[id % N_PATTERNS];
    return cm_chan_client_submit(c, id, p->tokens, (uint32_t)p->T, p->cu, (uint32_t)p->N, want_layers, 3);
}

/* Bit-exact against dump: F32 as is, BF16 as dump rounded to nearest even. */
static int answer_exact(const cm_chan_answer *a) {
    const pattern *p = &pats[a->batch_id % N_PATTERNS];
    if (a->status != CM_OK || a->n_tensors != 3) {
        fprintf(stderr, "batch %llu: %s %s\n", (unsigned long long)a->batch_id, cm_status_str(a->status),
                a->message);
        return 0;
    }
    for (int i = 0; i < 3; i++) {
        const cm_chan_tensor *t = &a->tensors[i];
        const float          *r = p->ref[want_layers[i]];
        size_t                n = (size_t)p->T * D_MODEL;
        if (t->layer != want_layers[i] || t->n_tokens != p->T || t->hidden != D_MODEL)
            return 0;
        for (size_t k = 0; k < n; k++) {
            int ok = t->dtype == CM_DTYPE_F32 ? memcmp(&((const float *)t->data)[k], &r[k], 4) == 0
                                              : ((const uint16_t *)t->data)[k] == cm_f32_to_bf16(r[k]);
            if (!ok) {
                fprintf(stderr, "batch %llu layer %d element %zu differs from dump\n",
                        (unsigned long long)a->batch_id, t->layer, k);
                return 0;
            }
        }
    }
    return 1;
}

static cm_chan_client_config client_config(const char *ep, const char *name, cm_encoding enc) {
    cm_chan_client_config cc = CM_CHAN_CLIENT_CONFIG_DEFAULT;
    cc.endpoint = ep;
    cc.name = name;
    cc.encoding = enc;
    cc.accept = 0;
    cc.heartbeat_ms = 200;
    cc.peer_timeout_ms = 1500;
    cc.reconnect_ms = 50;
    return cc;
}

/* Runs ids first..first+n-1; counts each delivery in ledger[id - first]; calls hook(done) after
 * each answer. Returns the number of exact answers. */
typedef void (*progress_fn)(int done, void *arg);
static int run_ledger(cm_chan_client *c, uint64_t first, int n, int *ledger, progress_fn hook, void *arg) {
    int     next = 0, done = 0, exact = 0;
    int64_t end = (int64_t)time(NULL) + 90;
    while (done < n && time(NULL) < end) {
        while (next < n && submit_pattern(c, first + (uint64_t)next) == CM_OK)
            next++;
        cm_chan_answer *a;
        if (cm_chan_client_recv(c, 200, &a) != CM_OK)
            continue;
        int64_t i = (int64_t)(a->batch_id - first);
        if (i >= 0 && i < n)
            ledger[i]++;
        exact += answer_exact(a);
        cm_chan_client_release(c, &a);
        done++;
        if (hook)
            hook(done, arg);
    }
    return exact;
}

// ----------------------------------------------------------------------------
// tests

/* One client per encoding against the server at ep, 8 batches each: every answer bit-exact with
 * the dump references (at the run's precision). */
static void exact_per_encoding(const char *ep, const char *name, const cm_encoding *encs, int n) {
    for (int e = 0; e < n; e++) {
        cm_chan_client_config cc = client_config(ep, name, encs[e]);
        cm_chan_client       *c = NULL;
        TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
        int ledger[8] = {0};
        int exact = run_ledger(c, 8 * (uint64_t)e, 8, ledger, NULL, NULL);
        TST_CHECK(exact == 8);
        printf("serve --precision %s, %-15s: %d/8 answers bit-exact with dump\n", precision, cm_encoding_name(encs[e]),
               exact);
        cm_chan_client_destroy(&c);
    }
}

static void test_exact(void) {
    proc              p;
    const char *const f32[] = {"--dtype", "f32", "--encoding", "all", NULL};
    if (!serve_start(&p, "exact-f32", "tcp://127.0.0.1:*", f32)) {
        TST_CHECK(0);
        return;
    }
    const cm_encoding encs[] = {CM_ENCODING_RAW, CM_ENCODING_ZSTD, CM_ENCODING_ZSTD_BYTEPLANE};
    exact_per_encoding(p.endpoint, "exact", encs, 3);
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
}

/* Replicas split over pipeline stages (--stages, target-server/ts_split.h): the same answers, bit for bit. */
static void test_stages(void) {
    proc              p;
    const char *const args[] = {"--dtype", "f32", "--encoding", "all", "--stages", "3", "--replicas", "2", NULL};
    if (!serve_start(&p, "stages", "tcp://127.0.0.1:*", args)) {
        TST_CHECK(0);
        return;
    }
    const cm_encoding encs[] = {CM_ENCODING_RAW, CM_ENCODING_ZSTD_BYTEPLANE};
    printf("serve --stages 3 --replicas 2 (each replica's 6 layers over 3 cpu contexts):\n");
    exact_per_encoding(p.endpoint, "stages", encs, 2);
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
}

typedef struct killer {
    proc       *p;
    const char *bind;
    int         killed, restarted, second_started;
    pthread_t   second;
    int         second_ledger[12], second_exact;
    char        endpoint[256];
} killer;

static void *second_trainer(void *arg) {
    killer               *k = arg;
    cm_chan_client_config cc = client_config(k->endpoint, "second", CM_ENCODING_ZSTD_BYTEPLANE);
    cm_chan_client       *c = NULL;
    if (cm_chan_client_create(&c, &cc) != CM_OK)
        return NULL;
    k->second_exact = run_ledger(c, 5000, 12, k->second_ledger, NULL, NULL);
    cm_chan_client_destroy(&c);
    return NULL;
}

static void on_progress(int done, void *arg) {
    killer *k = arg;
    if (done == 15 && !k->killed) {
        k->killed = serve_end(k->p, SIGKILL) == 128 + SIGKILL;
        tst_sleep_ms(300);
        k->restarted = serve_start(k->p, "ledger-2", k->bind, NULL);
    }
    if (done == 30 && !k->second_started) {
        k->second_started = pthread_create(&k->second, NULL, second_trainer, k) == 0;
    }
}

static void test_kill_restart(void) {
    proc p;
    if (!serve_start(&p, "ledger-1", "tcp://127.0.0.1:*", NULL)) {
        TST_CHECK(0);
        return;
    }
    killer k = {.p = &p};
    snprintf(k.endpoint, sizeof k.endpoint, "%s", p.endpoint);
    k.bind = k.endpoint; /* the restart binds the very port the trainers know */
    cm_chan_client_config cc = client_config(p.endpoint, "ledger", CM_ENCODING_ZSTD_BYTEPLANE);
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    enum { N = 60 };
    int ledger[N] = {0};
    int exact = run_ledger(c, 1000, N, ledger, on_progress, &k);
    if (k.second_started)
        pthread_join(k.second, NULL);
    int lost = 0, dup = 0, lost2 = 0, dup2 = 0;
    for (int i = 0; i < N; i++)
        lost += ledger[i] == 0, dup += ledger[i] > 1;
    for (int i = 0; i < 12; i++)
        lost2 += k.second_ledger[i] == 0, dup2 += k.second_ledger[i] > 1;
    cm_chan_client_stats st;
    cm_chan_client_get_stats(c, &st);
    TST_CHECK(k.killed && k.restarted);
    TST_CHECK(exact == N && lost == 0 && dup == 0);
    TST_CHECK(k.second_started && k.second_exact == 12 && lost2 == 0 && dup2 == 0);
    TST_CHECK(st.reconnects >= 1 && st.sessions >= 2 && st.resends >= 1);
    printf(
        "kill -9 after 15 answers, restart on %s: %d/%d exact, %d lost, %d duplicated (%llu reconnects, %llu "
        "re-sent, %llu duplicate answers dropped); second trainer %d/12 exact\n",
        k.endpoint, exact, N, lost, dup, (unsigned long long)st.reconnects, (unsigned long long)st.resends,
        (unsigned long long)st.duplicates, k.second_exact);
    cm_chan_client_destroy(&c);
    /* SIGTERM: clean exit; the log names the sessions */
    int rc = serve_end(&p, SIGTERM);
    TST_CHECK(rc == 0);
    const char *log = tst_slurp(p.log);
    TST_CHECK(strstr(log, "session 'ledger'") && strstr(log, "session 'second'") && strstr(log, "said bye") &&
              strstr(log, "stopped serving"));
    if (rc != 0)
        fprintf(stderr, "serve log:\n%s\n", log);
}

static void test_sigterm_in_flight(void) {
    proc p;
    if (!serve_start(&p, "term-1", "tcp://127.0.0.1:*", NULL)) {
        TST_CHECK(0);
        return;
    }
    char ep[256];
    snprintf(ep, sizeof ep, "%s", p.endpoint);
    cm_chan_client_config cc = client_config(ep, "term", CM_ENCODING_ZSTD_BYTEPLANE);
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    TST_CHECK(cm_chan_client_wait_ready(c, 10000, NULL) == CM_OK);
    for (uint64_t id = 1; id <= 4; id++)
        TST_CHECK(submit_pattern(c, id) == CM_OK);
    tst_sleep_ms(5);
    int rc = serve_end(&p, SIGTERM);
    TST_CHECK(rc == 0);
    /* what was answered before the BYE stays answered; the rest is re-sent to the next server */
    int ok = serve_start(&p, "term-2", ep, NULL);
    TST_CHECK(ok);
    int seen[5] = {0}, exact = 0;
    for (int k = 0; k < 4 && ok; k++) {
        cm_chan_answer *a = NULL;
        if (cm_chan_client_recv(c, 15000, &a) != CM_OK)
            break;
        if (a->batch_id >= 1 && a->batch_id <= 4)
            seen[a->batch_id]++;
        exact += answer_exact(a);
        cm_chan_client_release(c, &a);
    }
    cm_chan_answer *extra = NULL;
    TST_CHECK(cm_chan_client_recv(c, 300, &extra) == CM_ERR_TIMEOUT); /* nothing twice */
    TST_CHECK(exact == 4 && seen[1] == 1 && seen[2] == 1 && seen[3] == 1 && seen[4] == 1);
    cm_chan_client_stats st;
    cm_chan_client_get_stats(c, &st);
    printf(
        "SIGTERM with 4 batches in flight: exit %d; after a restart %d/4 exact, each once (%llu re-sent)\n",
        rc, exact, (unsigned long long)st.resends);
    cm_chan_client_destroy(&c);
    if (ok)
        TST_CHECK(serve_end(&p, SIGTERM) == 0);
}

static int run_serve_args(const char *const *args, const char *tag, const char **err_text) {
    char        err[512];
    const char *argv[24] = {bin, "serve"};
    int         n = 2;
    for (int i = 0; args[i] && n < 23; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    snprintf(err, sizeof err, "%s/%s.err", tmp, tag);
    int rc = tst_run((char *const *)argv, err);
    *err_text = tst_slurp(err);
    unlink(err);
    return rc;
}

static void test_bad_flags(void) {
    const char *e;
    const char *no_model[] = {"--bind", "tcp://127.0.0.1:*", NULL};
    TST_CHECK(run_serve_args(no_model, "nomodel", &e) == 2 && strstr(e, "--model DIR is required"));
    const char *bad_enc[] = {"--model", model, "--encoding", "gzip", NULL};
    TST_CHECK(run_serve_args(bad_enc, "badenc", &e) == 2 && strstr(e, "unknown encoding 'gzip'"));
    const char *bad_num[] = {"--model", model, "--credits", "0", NULL};
    TST_CHECK(run_serve_args(bad_num, "badnum", &e) == 2 && strstr(e, "--credits '0'"));
    const char *unknown[] = {"--model", model, "--frobnicate", "1", NULL};
    TST_CHECK(run_serve_args(unknown, "unknown", &e) == 2 && strstr(e, "unknown option '--frobnicate'"));
    const char *remote[] = {"--model", model, "--bind", "tcp://0.0.0.0:5555", NULL};
    TST_CHECK(run_serve_args(remote, "remote", &e) == 1 && strstr(e, "without CURVE"));
    const char *gpus_cpu[] = {"--model", model, "--gpu", "0,1", NULL};
    TST_CHECK(run_serve_args(gpus_cpu, "gpuscpu", &e) == 2 && strstr(e, "needs --device cuda"));
    const char *gpus_twice[] = {"--model", model, "--device", "cuda", "--gpu", "1,1", NULL};
    TST_CHECK(run_serve_args(gpus_twice, "gpustwice", &e) == 2 && strstr(e, "names GPU 1 twice"));
    const char *gpus_reps[] = {"--model", model, "--device", "cuda", "--gpu", "0,1", "--replicas", "3", NULL};
    TST_CHECK(run_serve_args(gpus_reps, "gpusreps", &e) == 2 && strstr(e, "one GPU per replica"));
    const char *stages_gpus[] = {"--model", model, "--device", "cuda", "--gpu", "0,1,2", "--stages", "2", NULL};
    TST_CHECK(run_serve_args(stages_gpus, "stagesgpus", &e) == 2 && strstr(e, "give 2 GPUs per replica"));
    const char *slash[] = {"--model", model, "--name", "a/b", NULL};
    TST_CHECK(run_serve_args(slash, "slash", &e) == 2 && strstr(e, "--name 'a/b'") && strstr(e, "0x2f"));
    /* libzmq binds addresses, not host names: refused up front with the address to use */
    const char *lhost[] = {"--model", model, "--bind", "tcp://localhost:5555", NULL};
    TST_CHECK(run_serve_args(lhost, "lhost", &e) == 1 && strstr(e, "bind tcp://127.0.0.1:5555"));
    const char *missing[] = {"--model", "/nonexistent/model", "--bind", "tcp://127.0.0.1:*", NULL};
    TST_CHECK(run_serve_args(missing, "missing", &e) == 1 && strstr(e, "/nonexistent/model"));
    /* a busy port */
    proc p;
    if (serve_start(&p, "busy", "tcp://127.0.0.1:*", NULL)) {
        const char *busy[] = {"--model", model, "--bind", p.endpoint, NULL};
        TST_CHECK(run_serve_args(busy, "busy2", &e) == 1 && strstr(e, "cannot bind"));
        TST_CHECK(serve_end(&p, SIGINT) == 0);
    } else {
        TST_CHECK(0);
    }
    printf("bad flags: missing model, bad encoding, bad number, unknown option, --gpu lists, --stages, --name a/b "
           "(exit 2); non-loopback without CURVE, tcp://localhost, missing model dir, busy port (exit 1)\n");
}

/* Runs a second serve on bind; its exit status, or -1 (killed) if it still runs after 10 s: then it
 * has taken the endpoint over. */
static int second_serve(const char *bind, const char *tag, const char **err_text) {
    char err[512];
    snprintf(err, sizeof err, "%s/%s.err", tmp, tag);
    unlink(err);
    char *argv[] = {bin, "serve", "--model", model, "--bind", (char *)bind, "--stats-interval", "0", NULL};
    pid_t pid = tst_spawn(argv, err);
    int   rc = pid > 0 ? tst_wait_exit(pid, 10000) : -2;
    if (rc == -1)
        tst_end(pid, SIGINT, 10000);
    *err_text = tst_slurp(err);
    return rc;
}

/* An ipc:// path held by a live server is refused (libzmq's bind would unlink its socket file
 * and take the endpoint over); a stale file left by a killed server is replaced; a file that
 * is not a socket is never deleted; a server removes only the socket file it bound. */
static void test_ipc_endpoint(void) {
    char bind[320], path[300], status[8192];
    snprintf(path, sizeof path, "%s/held.sock", tmp);
    snprintf(bind, sizeof bind, "ipc://%s", path);
    proc a;
    if (!serve_start(&a, "held", bind, NULL)) {
        TST_CHECK(0);
        return;
    }
    struct stat before, after;
    TST_CHECK(stat(path, &before) == 0);
    const char *e;
    int         rc = second_serve(bind, "held2", &e);
    TST_CHECK(rc == 1 && strstr(e, "is listening on the socket file") && strstr(e, path));
    if (rc != 1)
        fprintf(stderr, "second serve on %s: exit %d\n%s\n", bind, rc, e);
    TST_CHECK(stat(path, &after) == 0 && after.st_ino == before.st_ino);
    TST_CHECK(cm_chan_status_query(a.endpoint, NULL, NULL, 3000, status, sizeof status) == CM_OK);
    /* killed: its socket file stays behind, and the next server replaces it */
    TST_CHECK(serve_end(&a, SIGKILL) == 128 + SIGKILL);
    TST_CHECK(stat(path, &after) == 0 && S_ISSOCK(after.st_mode));
    proc b;
    TST_CHECK(serve_start(&b, "stale", bind, NULL));
    TST_CHECK(cm_chan_status_query(b.endpoint, NULL, NULL, 3000, status, sizeof status) == CM_OK);
    /* the path taken away from b (removed, and a third server bound it): b's stop leaves it alone (the
     * third serves no decoding: b still holds the decoding endpoint derived from the path) */
    TST_CHECK(unlink(path) == 0);
    proc c;
    static const char *const no_decoding[] = {"--decode-seqs", "0", NULL};
    TST_CHECK(serve_start(&c, "third", bind, no_decoding));
    TST_CHECK(serve_end(&b, SIGTERM) == 0);
    TST_CHECK(stat(path, &after) == 0 &&
              cm_chan_status_query(c.endpoint, NULL, NULL, 3000, status, sizeof status) == CM_OK);
    TST_CHECK(serve_end(&c, SIGTERM) == 0);
    TST_CHECK(stat(path, &after) != 0); /* its own file: removed */
    /* a regular file at the path: libzmq's bind would delete it */
    FILE *f = fopen(path, "w");
    if (f) {
        fputs("not a socket\n", f);
        fclose(f);
    }
    rc = second_serve(bind, "notsock", &e);
    TST_CHECK(rc == 1 && strstr(e, "is not a socket"));
    TST_CHECK(stat(path, &after) == 0 && S_ISREG(after.st_mode) && after.st_size == 13);
    unlink(path);
    printf(
        "ipc://: a held path refused (the holder still answers), a stale socket file replaced, a file that "
        "is not a socket kept, only a server's own socket file removed\n");
}

/* tcp://[::1] is loopback: it binds (with ZMQ_IPV6, which libzmq needs for it) and answers. */
static void test_ipv6_loopback(void) {
    int                 fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    int                 have = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (fd >= 0)
        close(fd);
    if (!have) {
        printf("tcp://[::1]: this machine has no IPv6 loopback; not checked\n");
        return;
    }
    proc p;
    char status[8192];
    if (!serve_start(&p, "v6", "tcp://[::1]:*", NULL)) {
        TST_CHECK(0);
        return;
    }
    TST_CHECK(cm_chan_status_query(p.endpoint, NULL, NULL, 3000, status, sizeof status) == CM_OK);
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
    printf("tcp://[::1]: bound (%s) and answered a status query\n", p.endpoint);
}

static int run_status(const char *args, char *out, size_t cap);

static void test_curve_cli(void) {
    if (!cm_chan_curve_available())
        return;
    char srv_prefix[400], cli_prefix[400], allowed[300], pub[420], key[420], cpub[420], ckey[420];
    snprintf(allowed, sizeof allowed, "%s/allowed", tmp);
    mkdir(allowed, 0700);
    snprintf(srv_prefix, sizeof srv_prefix, "%s/server", tmp);
    snprintf(cli_prefix, sizeof cli_prefix, "%s/trainer", allowed);
    const char *e;
    const char *g1[] = {"--curve-keygen", srv_prefix, NULL}, *g2[] = {"--curve-keygen", cli_prefix, NULL};
    TST_CHECK(run_serve_args(g1, "keygen1", &e) == 0 && run_serve_args(g2, "keygen2", &e) == 0);
    TST_CHECK(run_serve_args(g1, "keygen3", &e) == 1 && strstr(e, "already exists"));
    snprintf(pub, sizeof pub, "%s.pub", srv_prefix);
    snprintf(key, sizeof key, "%s.key", srv_prefix);
    snprintf(cpub, sizeof cpub, "%s.pub", cli_prefix);
    snprintf(ckey, sizeof ckey, "%s.key", cli_prefix);
    proc              p;
    const char *const extra[] = {"--curve-secret-key", key, "--curve-client-keys", allowed, NULL};
    if (!serve_start(&p, "curve", "tcp://127.0.0.1:*", extra)) {
        TST_CHECK(0);
        return;
    }
    cm_chan_client_config cc = client_config(p.endpoint, "curved", CM_ENCODING_ZSTD_BYTEPLANE);
    cc.curve_server_key = pub;
    cc.curve_secret_key = ckey;
    cm_chan_client *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    int ledger[4] = {0};
    TST_CHECK(run_ledger(c, 1, 4, ledger, NULL, NULL) == 4);
    cm_chan_client_destroy(&c);
    /* status through CURVE: the accepted key is answered; a fresh (unlisted) key is not, and the
     * message points at the key */
    static char sout[1 << 16];
    char        sargs[2048];
    snprintf(sargs, sizeof sargs, "--server %s --curve-server-key %s --curve-secret-key %s", p.endpoint, pub, ckey);
    TST_CHECK(run_status(sargs, sout, sizeof sout) == 0 &&
              strstr(sout, "totals") != NULL);
    snprintf(sargs, sizeof sargs, "--server %s --curve-server-key %s --timeout-ms 500", p.endpoint, pub);
    TST_CHECK(run_status(sargs, sout, sizeof sout) == 1 && strstr(sout, "--curve-secret-key"));
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
    const char *log = tst_slurp(p.log);
    TST_CHECK(strstr(log, "CURVE on") != NULL);
    /* the secret never reaches the log */
    char secret[CM_CHAN_KEY_LEN + 1];
    TST_CHECK(cm_chan_curve_read_key(key, secret) == CM_OK && !strstr(log, secret));
    printf("curve through the command line: keygen, keyed server, accepted trainer 4/4 exact, secret not "
           "logged\n");
    unlink(pub), unlink(key), unlink(cpub), unlink(ckey);
    rmdir(allowed);
}

/* argv: optional test names (exact, kill, term, flags, curve) to run only those. */
/* Runs `target-server status ARGS…` and returns its exit status; stdout+stderr into out. */
static int run_status(const char *args, char *out, size_t cap) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' status %s 2>&1", bin, args);
    return tst_sh(cmd, out, cap);
}

/* `target-server status`: the served model and its load state with no trainer, a trainer's
 * session and its answers while it is attached (readable and --json), a clear message where no
 * server listens, and usage errors. */
static void test_status(void) {
    proc p;
    if (!serve_start(&p, "status", "tcp://127.0.0.1:*", NULL)) {
        TST_CHECK(0);
        return;
    }
    static char out[1 << 16];
    char        args[512];
    snprintf(args, sizeof args, "--server %s", p.endpoint);
    int ok = 0;
    for (int i = 0; i < 100 && !ok; i++) { /* the weights load after the bind */
        TST_CHECK(run_status(args, out, sizeof out) == 0);
        ok = strstr(out, "loaded in") != NULL;
        if (!ok)
            tst_sleep_ms(50);
    }
    TST_CHECK(ok && strstr(out, "qwen3_5_text, 6 layers, hidden 64, vocab 512") && strstr(out, "no trainer attached"));
    cm_chan_client_config cc = client_config(p.endpoint, "status-probe", CM_ENCODING_ZSTD_BYTEPLANE);
    cm_chan_client       *c = NULL;
    TST_CHECK(cm_chan_client_create(&c, &cc) == CM_OK);
    int ledger[6] = {0};
    TST_CHECK(run_ledger(c, 700, 6, ledger, NULL, NULL) == 6);
    TST_CHECK(run_status(args, out, sizeof out) == 0);
    TST_CHECK(strstr(out, "session 'status-probe'") && strstr(out, "6 answers") && strstr(out, "1 sessions active"));
    snprintf(args, sizeof args, "--server %s --json", p.endpoint);
    TST_CHECK(run_status(args, out, sizeof out) == 0);
    TST_CHECK(strstr(out, "\"sessions\":[{\"name\":\"status-probe\"") && strstr(out, "\"answers\":6") &&
              strstr(out, "\"loaded\":true"));
    cm_chan_client_destroy(&c);
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
    TST_CHECK(run_status("--server tcp://127.0.0.1:1 --timeout-ms 300", out, sizeof out) == 1 &&
              strstr(out, "is a target-server running there?"));
    TST_CHECK(run_status("--frobnicate", out, sizeof out) == 2 && strstr(out, "unknown option"));
    TST_CHECK(run_status("--server tcp://10.1.2.3:5555", out, sizeof out) == 1 && strstr(out, "--curve-server-key"));
    printf("status: model and load state, a trainer's session and answers (text and --json), no server, bad flags\n");
}

/* `test_ts_serve fp8`: a server at --precision fp8 (the tiny model's projections quantized on load,
 * W8A8 products on the cpu reference) answers bit-exact with `dump --precision fp8`, the hidden states
 * on the wire as they are for bf16 (F32 raw, BF16 byteplane), and STATUS names the precision. */
static void test_fp8(void) {
    proc              p;
    const char *const extra[] = {"--dtype", "f32", "--encoding", "all", "--precision", "fp8", NULL};
    if (!serve_start(&p, "fp8", "tcp://127.0.0.1:*", extra)) {
        TST_CHECK(0);
        return;
    }
    const cm_encoding encs[] = {CM_ENCODING_RAW, CM_ENCODING_ZSTD_BYTEPLANE};
    exact_per_encoding(p.endpoint, "fp8", encs, 2);
    static char out[1 << 16];
    char        args[512];
    snprintf(args, sizeof args, "--server %s --json", p.endpoint);
    TST_CHECK(run_status(args, out, sizeof out) == 0 && strstr(out, "\"precision\":\"fp8\""));
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
}

typedef struct replica_trainer {
    const char *endpoint;
    uint64_t    first;
    int         ledger[8], exact;
} replica_trainer;

static void *replica_trainer_main(void *arg) {
    replica_trainer      *t = arg;
    char                  name[32];
    snprintf(name, sizeof name, "rep-%llu", (unsigned long long)t->first);
    cm_chan_client_config cc = client_config(t->endpoint, name, CM_ENCODING_ZSTD_BYTEPLANE);
    cm_chan_client       *c = NULL;
    if (cm_chan_client_create(&c, &cc) != CM_OK)
        return NULL;
    t->exact = run_ledger(c, t->first, 8, t->ledger, NULL, NULL);
    cm_chan_client_destroy(&c);
    return NULL;
}

/* Two replicas behind one endpoint (--replicas 2 on the cpu, as --gpu 0,1 on cuda): both load
 * their own weights, two trainers at once get answers bit-exact with dump, STATUS says 2. */
static void test_replicas(void) {
    proc              p;
    const char *const flags[] = {"--dtype", "f32", "--encoding", "all", "--replicas", "2", "--log-level", "debug", NULL};
    if (!serve_start(&p, "replicas", "tcp://127.0.0.1:*", flags)) {
        TST_CHECK(0);
        return;
    }
    replica_trainer t[2] = {{.endpoint = p.endpoint, .first = 900}, {.endpoint = p.endpoint, .first = 950}};
    pthread_t       th[2];
    for (int i = 0; i < 2; i++)
        TST_CHECK(pthread_create(&th[i], NULL, replica_trainer_main, &t[i]) == 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    TST_CHECK(t[0].exact == 8 && t[1].exact == 8);
    static char out[1 << 16];
    char        args[512];
    snprintf(args, sizeof args, "--server %s --json", p.endpoint);
    TST_CHECK(run_status(args, out, sizeof out) == 0);
    TST_CHECK(strstr(out, "\"replicas\":2") && strstr(out, "\"workers\":2") && strstr(out, "\"loaded\":true"));
    snprintf(args, sizeof args, "--server %s", p.endpoint);
    TST_CHECK(run_status(args, out, sizeof out) == 0 && strstr(out, "0 of 2 replicas computing"));
    TST_CHECK(serve_end(&p, SIGTERM) == 0);
    const char *log = tst_slurp(p.log);
    int         ready0 = log && strstr(log, "replica 0 (cpu 0): model ready"),
                ready1 = log && strstr(log, "replica 1 (cpu 0): model ready");
    int         on0 = 0, on1 = 0;
    for (const char *q = log; q && (q = strstr(q, " on worker ")); q += 11)
        *(q[11] == '0' ? &on0 : &on1) += 1;
    TST_CHECK(ready0 && ready1 && on0 + on1 == 16);
    printf("replicas: 2 loaded, %d/8 + %d/8 answers bit-exact with dump, %d on replica 0 and %d on replica 1\n",
           t[0].exact, t[1].exact, on0, on1);
}

static int want(int argc, char **argv, const char *name) {
    if (argc < 2)
        return 1;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv) {
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_ERROR);
    /* the children's cpu forward on one thread: a test of the transport should not wait on
     * OpenMP teams fighting other jobs for this machine's cores (dump runs the same way) */
    setenv("OMP_NUM_THREADS", "1", 0);
    snprintf(bin, sizeof bin, "%s/target-server/target-server", TANDEM_BINARY_DIR);
    snprintf(model, sizeof model, "%s/../models/tiny-qwen35", TANDEM_TEST_DATA);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-serve-%d", (int)getpid());
    mkdir(tmp, 0700);
    const int fp8 = argc == 2 && strcmp(argv[1], "fp8") == 0; /* its own run: its own references */
    if (fp8) precision = "fp8";
    if (!make_reference()) {
        TST_CHECK(0);
        return tst_report();
    }
    if (fp8) {
        test_fp8();
        for (int k = 0; k < N_PATTERNS; k++)
            for (int l = 0; l < N_LAYERS; l++)
                free(pats[k].ref[l]);
        return tst_cleanup(tmp, tst_report());
    }
    if (want(argc, argv, "exact"))
        test_exact();
    if (want(argc, argv, "kill"))
        test_kill_restart();
    if (want(argc, argv, "term"))
        test_sigterm_in_flight();
    if (want(argc, argv, "flags"))
        test_bad_flags();
    if (want(argc, argv, "curve"))
        test_curve_cli();
    if (want(argc, argv, "bind")) {
        test_ipc_endpoint();
        test_ipv6_loopback();
    }
    if (want(argc, argv, "status"))
        test_status();
    if (want(argc, argv, "replicas"))
        test_replicas();
    if (want(argc, argv, "stages"))
        test_stages();
    for (int k = 0; k < N_PATTERNS; k++)
        for (int l = 0; l < N_LAYERS; l++)
            free(pats[k].ref[l]);
    return tst_cleanup(tmp, tst_report()); /* logs are kept for a failed run */
}
