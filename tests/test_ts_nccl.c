/* tests/test_ts_nccl.c — the NCCL data path end to end on two GPUs (label gpu; exits 77 with
 * fewer than two): the real `target-server serve --device cuda --gpu 0` process and trainers on
 * GPU 1. A ZeroMQ trainer (raw BF16) and an NCCL trainer ask the same server for the same
 * batches; the NCCL answers, received into GPU 1's memory, equal the ZeroMQ ones bit for bit.
 * Then the server is killed with SIGKILL mid-run and restarted: the NCCL trainer makes a new
 * communicator by itself and every batch id is delivered exactly once (a ledger), all exact.
 * Last, a server whose replica is split over two stages answers over NCCL, equal to the same
 * ZeroMQ answers. Prints the NCCL receive time per answer. */
#include <cuda_runtime.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cm_chan.h"
#include "cm_log.h"
#include "cm_nccl.h"
#include "tst.h"
#include "tst_proc.h"

#define N_PATTERNS 5
#define D_MODEL    64
#define N_REQ      3

static char          bin[1024], model[1024], tmp[256];
static const int32_t want_layers[N_REQ] = {5, 0, 3};

typedef struct proc {
    pid_t pid;
    char  endpoint[320], log[512], epfile[512];
} proc;

/* gpus: serve's --gpu; stages: "1", or "2" for one replica split over two stages (stage k on the
 * k-th GPU of gpus, or both on the one given) */
static int serve_start(proc *p, const char *tag, const char *bind, const char *gpus, const char *stages) {
    snprintf(p->log, sizeof p->log, "%s/%s.log", tmp, tag);
    snprintf(p->epfile, sizeof p->epfile, "%s/%s.ep", tmp, tag);
    unlink(p->epfile);
    char *argv[] = {bin,         "serve",        "--model",         model,     "--device",   "cuda", "--gpu",
                    (char *)gpus, "--bind",      (char *)bind,      "--endpoint-file", p->epfile, "--encoding",
                    "raw",       "--credits",    "4",               "--heartbeat-ms", "200", "--peer-timeout-ms",
                    "3000",      "--stages",     (char *)stages,    NULL};
    setenv("ASAN_OPTIONS", "exitcode=86", 1);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        execv(bin, argv);
        _exit(127);
    }
    p->pid = pid;
    /* the weights load after the bind; the endpoint file is written at bind */
    if (tst_await_endpoint(pid, p->epfile, p->log, p->endpoint, sizeof p->endpoint, 60000))
        return 1;
    p->pid = -1; /* exited, or killed for being late */
    return 0;
}

static int serve_end(proc *p, int sig) {
    return tst_end(p->pid, sig, 30000);
}

typedef struct pattern {
    int32_t   tokens[700], cu[5];
    int       T, N;
    uint16_t *ref[N_REQ]; /* the ZeroMQ answer, BF16 [T, D] per requested layer */
} pattern;
static pattern pats[N_PATTERNS];

static void make_patterns(void) {
    for (int k = 0; k < N_PATTERNS; k++) {
        pattern *p = &pats[k];
        p->T = k == N_PATTERNS - 1 ? 700 : 33 + 61 * k; /* odd sizes, one long */
        p->N = 1 + k % 4;
        for (int t = 0; t < p->T; t++)
            p->tokens[t] = (int32_t)((k * 131 + t * 17 + 3) % 512);
        p->cu[0] = 0;
        for (int s = 1; s < p->N; s++)
            p->cu[s] = p->T * s / p->N;
        p->cu[p->N] = p->T;
    }
}

static cm_chan_client_config client_config(const char *ep, const char *name, cm_encoding enc) {
    cm_chan_client_config cc = CM_CHAN_CLIENT_CONFIG_DEFAULT;
    cc.endpoint = ep;
    cc.name = name;
    cc.encoding = enc;
    cc.accept = 0;
    cc.heartbeat_ms = 200;
    cc.peer_timeout_ms = 3000;
    cc.reconnect_ms = 50;
    return cc;
}

static cm_status submit(cm_chan_client *c, uint64_t id) {
    const pattern *p = &pats[id % N_PATTERNS];
    return cm_chan_client_submit(c, id, p->tokens, (uint32_t)p->T, p->cu, (uint32_t)p->N, want_layers, N_REQ);
}

/* A trainer's NCCL client on GPU 1 (4 credits) for the server at ep; hooks must outlive it. */
static cm_status nccl_client(const char *ep, const char *name, cm_nccl_client **nc, cm_chan_nccl_client *hooks,
                             cm_chan_client **c) {
    CM_TRY(cm_nccl_client_create(nc, 1, 4, 60000));
    cm_nccl_client_hooks(*nc, hooks);
    cm_chan_client_config cc = client_config(ep, name, CM_ENCODING_NCCL);
    cc.nccl = hooks;
    cc.credits = 4;
    return cm_chan_client_create(c, &cc);
}

/* Reference answers from ZeroMQ (raw BF16). */
static int reference(const char *ep) {
    cm_chan_client_config cc = client_config(ep, "zmq-ref", CM_ENCODING_RAW);
    cm_chan_client       *c = NULL;
    if (cm_chan_client_create(&c, &cc) != CM_OK)
        return 0;
    int got = 0;
    for (int k = 0; k < N_PATTERNS; k++) {
        cm_chan_answer *a = NULL;
        if (submit(c, (uint64_t)k) != CM_OK || cm_chan_client_recv(c, 60000, &a) != CM_OK || a->status != CM_OK) {
            fprintf(stderr, "reference batch %d: %s\n", k, a ? a->message : cm_last_error());
            cm_chan_client_release(c, &a);
            break;
        }
        for (int i = 0; i < N_REQ; i++) {
            const cm_chan_tensor *t = &a->tensors[i];
            pats[k].ref[i] = malloc(t->bytes);
            memcpy(pats[k].ref[i], t->data, t->bytes);
        }
        cm_chan_client_release(c, &a);
        got++;
    }
    cm_chan_client_destroy(&c);
    return got == N_PATTERNS;
}

static int answer_exact(const cm_chan_answer *a) {
    const pattern *p = &pats[a->batch_id % N_PATTERNS];
    if (a->status != CM_OK || a->n_tensors != N_REQ) {
        fprintf(stderr, "batch %llu: %s %s\n", (unsigned long long)a->batch_id, cm_status_str(a->status),
                a->message);
        return 0;
    }
    static uint16_t host[700 * D_MODEL];
    for (int i = 0; i < N_REQ; i++) {
        const cm_chan_tensor *t = &a->tensors[i];
        if (!t->on_device || t->dtype != CM_DTYPE_BF16 || t->layer != want_layers[i] || t->n_tokens != p->T ||
            t->hidden != D_MODEL || t->bytes != (size_t)p->T * D_MODEL * 2)
            return 0;
        if (cudaMemcpy(host, t->data, t->bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
            return 0;
        if (memcmp(host, p->ref[i], t->bytes) != 0) {
            fprintf(stderr, "batch %llu layer %d: the NCCL answer differs from the ZeroMQ one\n",
                    (unsigned long long)a->batch_id, t->layer);
            return 0;
        }
    }
    return 1;
}

static void test_nccl(void) {
    proc p;
    char bind[300];
    snprintf(bind, sizeof bind, "ipc://%s/serve.ipc", tmp);
    if (!serve_start(&p, "serve-1", bind, "0", "1")) {
        TST_CHECK(0);
        return;
    }
    TST_CHECK(reference(p.endpoint));
    cm_nccl_client     *nc = NULL;
    cm_chan_nccl_client hooks;
    cm_chan_client     *c = NULL;
    TST_CHECK(nccl_client(p.endpoint, "nccl", &nc, &hooks, &c) == CM_OK);
    cm_proto_welcome w;
    cm_status        st = cm_chan_client_wait_ready(c, 60000, &w);
    TST_CHECK(st == CM_OK);
    if (st != CM_OK) {
        fprintf(stderr, "nccl session: %s\nserver log:\n%s\n", cm_last_error(), tst_slurp(p.log));
        cm_chan_client_destroy(&c);
        cm_nccl_client_destroy(&nc);
        serve_end(&p, SIGKILL);
        return;
    }
    /* 60 batches; the server is killed after 20 answers and restarted on the same endpoint */
    enum { N = 60 };
    int     ledger[N] = {0}, next = 0, done = 0, exact = 0, killed = 0, restarted = 0;
    int64_t end = (int64_t)time(NULL) + 240;
    while (done < N && time(NULL) < end) {
        while (next < N && submit(c, 100 + (uint64_t)next) == CM_OK)
            next++;
        cm_chan_answer *a;
        if (cm_chan_client_recv(c, 200, &a) != CM_OK)
            continue;
        int64_t i = (int64_t)a->batch_id - 100;
        if (i >= 0 && i < N)
            ledger[i]++;
        exact += answer_exact(a);
        cm_chan_client_release(c, &a);
        if (++done == 20) {
            killed = serve_end(&p, SIGKILL) == 128 + SIGKILL;
            tst_sleep_ms(300);
            restarted = serve_start(&p, "serve-2", p.endpoint, "0", "1");
        }
    }
    int once = 1;
    for (int i = 0; i < N; i++)
        once &= ledger[i] == 1;
    cm_chan_client_stats cs;
    cm_chan_client_get_stats(c, &cs);
    cm_nccl_client_stats ns;
    cm_nccl_client_get_stats(nc, &ns);
    TST_CHECK(killed && restarted);
    TST_CHECK(done == N && once && exact == N);
    TST_CHECK(ns.sessions >= 2); /* a new communicator after the restart */
    printf("nccl: %d/%d answers bit-exact with ZeroMQ raw, each id once: %s; server killed and restarted: "
           "%d communicators, %llu reconnects; %llu answers, %.1f MB over NCCL, %.3f ms receive per answer\n",
           exact, N, once ? "yes" : "NO", (int)ns.sessions, (unsigned long long)cs.reconnects,
           (unsigned long long)ns.answers, (double)ns.bytes / 1e6, ns.answers ? 1e3 * ns.recv_s / ns.answers : 0);
    cm_chan_client_destroy(&c);
    cm_nccl_client_destroy(&nc);
    int rc = serve_end(&p, SIGTERM);
    TST_CHECK(rc == 0);
    if (rc != 0 || exact != N)
        fprintf(stderr, "serve log:\n%s\n", tst_slurp(p.log));
}

/* A replica split over two stages (stage 0 on GPU 0, stage 1 on GPU 1) sends NCCL answers too:
 * stage 1 copies its layers to GPU 0 over peer to peer, and GPU 0 sends the answer to the trainer
 * on GPU 1. The answers equal the unsplit server's ZeroMQ ones. */
static void test_nccl_split(void) {
    proc p;
    char bind[300];
    snprintf(bind, sizeof bind, "ipc://%s/split.ipc", tmp);
    if (!serve_start(&p, "serve-split", bind, "0,1", "2")) {
        TST_CHECK(0);
        return;
    }
    cm_nccl_client     *nc = NULL;
    cm_chan_nccl_client hooks;
    cm_chan_client     *c = NULL;
    TST_CHECK(nccl_client(p.endpoint, "nccl-split", &nc, &hooks, &c) == CM_OK);
    int       exact = 0, done = 0, next = 0;
    cm_status st = cm_chan_client_wait_ready(c, 60000, NULL);
    TST_CHECK(st == CM_OK);
    enum { N = 15 };
    int64_t end = (int64_t)time(NULL) + 120;
    while (st == CM_OK && done < N && time(NULL) < end) {
        while (next < N && submit(c, 300 + (uint64_t)next) == CM_OK)
            next++;
        cm_chan_answer *a;
        if (cm_chan_client_recv(c, 200, &a) != CM_OK)
            continue;
        exact += answer_exact(a);
        cm_chan_client_release(c, &a);
        done++;
    }
    TST_CHECK(done == N && exact == N);
    printf("nccl from a replica split over 2 stages: %d/%d answers bit-exact with the unsplit server's "
           "ZeroMQ ones\n",
           exact, N);
    cm_chan_client_destroy(&c);
    cm_nccl_client_destroy(&nc);
    int rc = serve_end(&p, SIGTERM);
    TST_CHECK(rc == 0);
    if (rc != 0 || exact != N)
        fprintf(stderr, "serve log:\n%s\n", tst_slurp(p.log));
}

int main(int argc, char **argv) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 2) {
        printf("test_ts_nccl: needs two GPUs (found %d); skipped\n", n_dev);
        return 77;
    }
    if (argc < 3) {
        fprintf(stderr, "usage: test_ts_nccl TARGET_SERVER MODEL_DIR\n");
        return 2;
    }
    snprintf(bin, sizeof bin, "%s", argv[1]);
    snprintf(model, sizeof model, "%s", argv[2]);
    snprintf(tmp, sizeof tmp, "/tmp/tandem-nccl-%d", (int)getpid());
    mkdir(tmp, 0700);
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_WARN);
    make_patterns();
    test_nccl();
    test_nccl_split();
    tst_rmdir(tmp);
    return tst_report();
}
