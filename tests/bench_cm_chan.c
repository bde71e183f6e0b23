/* tests/bench_cm_chan.c — ZeroMQ session throughput over loopback (not a test): an in-process
 * cm_chan server whose compute callback writes a BF16 [T, D] answer once and then reuses it
 * (so the figure is transport, not compute), and one cm_chan client keeping `credits`
 * requests in flight. Reports GB/s of answer bytes end to end (server copy into the pooled
 * buffer, zero-copy send, loopback, receive, lend), over tcp:// and ipc://, for large and
 * small raw answers, with the client's NaN/zero scan on and off. Three runs per row: best
 * and median.
 *   bench_cm_chan [--answers N] [--credits C] [--quick]      (--quick: smaller sizes, 1 run) */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cm_chan.h"
#include "cm_log.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct fill {
    const void *filled; /* the out buffer already holding the pattern */
    size_t      n;
} fill;

static cm_status bench_compute(void *user, cm_chan_job *job) {
    fill  *f = user;
    size_t n = (size_t)job->req->n_tokens * job->hidden_size;
    for (uint32_t i = 0; i < job->req->n_layers; i++) {
        uint16_t *o = job->out[i];
        if (o == f->filled && n == f->n)
            continue;
        for (size_t k = 0; k < n; k++)
            o[k] = cm_f32_to_bf16((float)((k * 2654435761u) % 1000) * 0.01f - 5.0f + 0.001f);
        f->filled = o;
        f->n = n;
    }
    job->out_dtype = CM_DTYPE_BF16;
    return CM_OK;
}

typedef struct server {
    cm_chan_server *srv;
    pthread_t       th;
    fill            f;
} server;

static void *server_main(void *arg) {
    cm_chan_server_run(((server *)arg)->srv);
    return NULL;
}

/* One run: n answers of T × D BF16 after 2 warm-up answers; returns GB/s, or 0 on failure. */
static double run_once(const char *ep_in, uint32_t T, uint32_t D, int n, int credits, int check) {
    server                s = {0};
    cm_chan_server_config sc = CM_CHAN_SERVER_CONFIG_DEFAULT;
    sc.endpoint = ep_in;
    sc.name = "bench";
    sc.weights_id = 1;
    sc.hidden_size = D;
    sc.n_layers = 1;
    sc.max_tokens = T;
    sc.max_req_layers = 1;
    sc.credits = (uint32_t)credits;
    sc.encodings = 1u << CM_ENCODING_RAW;
    sc.compute = bench_compute;
    sc.user = &s.f;
    if (cm_chan_server_create(&s.srv, &sc) != CM_OK) {
        fprintf(stderr, "server: %s\n", cm_last_error());
        return 0;
    }
    pthread_create(&s.th, NULL, server_main, &s);
    cm_chan_client_config cc = CM_CHAN_CLIENT_CONFIG_DEFAULT;
    cc.endpoint = cm_chan_server_endpoint(s.srv);
    cc.name = "bench";
    cc.credits = (uint32_t)credits;
    cc.encoding = CM_ENCODING_RAW;
    cc.check_values = check;
    cm_chan_client *c = NULL;
    double          gbs = 0;
    int32_t        *tokens = calloc(T, sizeof *tokens);
    int32_t         cu[2] = {0, (int32_t)T}, layer = 0;
    if (tokens && cm_chan_client_create(&c, &cc) == CM_OK &&
        cm_chan_client_wait_ready(c, 10000, NULL) == CM_OK) {
        int    total = n + 2, next = 0, done = 0;
        double t0 = 0;
        size_t bytes = 0;
        while (done < total) {
            while (next < total &&
                   cm_chan_client_submit(c, (uint64_t)next + 1, tokens, T, cu, 1, &layer, 1) == CM_OK)
                next++;
            cm_chan_answer *a;
            cm_status       st = cm_chan_client_recv(c, 30000, &a);
            if (st != CM_OK) {
                fprintf(stderr, "recv: %s\n", cm_last_error());
                break;
            }
            if (a->status != CM_OK) {
                fprintf(stderr, "batch failed: %s\n", a->message);
                cm_chan_client_release(c, &a);
                break;
            }
            if (++done == 2)
                t0 = now_s();
            else if (done > 2)
                bytes += a->tensors[0].bytes;
            cm_chan_client_release(c, &a);
        }
        if (done == total)
            gbs = (double)bytes / (now_s() - t0) / 1e9;
    } else {
        fprintf(stderr, "client: %s\n", cm_last_error());
    }
    cm_chan_client_destroy(&c);
    cm_chan_server_stop(s.srv);
    pthread_join(s.th, NULL);
    cm_chan_server_destroy(&s.srv);
    free(tokens);
    return gbs;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int n_answers = 0, credits = 2, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--answers") == 0 && i + 1 < argc)
            n_answers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--credits") == 0 && i + 1 < argc)
            credits = atoi(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else {
            fprintf(stderr, "usage: bench_cm_chan [--answers N] [--credits C] [--quick]\n");
            return 2;
        }
    }
    if (credits < 1 || credits > 64) {
        fprintf(stderr, "bench_cm_chan: --credits %d: expected 1 to 64\n", credits);
        return 2;
    }
    if (!getenv("TANDEM_LOG"))
        cm_log_set_level(CM_LOG_LEVEL_WARN);
    char ipc[128];
    snprintf(ipc, sizeof ipc, "ipc:///tmp/tandem-bench-chan-%d.ipc", (int)getpid());
    const char *eps[2] = {"tcp://127.0.0.1:*", ipc};
    const char *names[2] = {"tcp", "ipc"};
    typedef struct size_case {
        uint32_t T, D;
        int      n;
    } size_case;
    size_case sizes[2] = {{8192, 5120, 20}, {512, 4096, 200}};
    if (quick) {
        sizes[0] = (size_case){1024, 1024, 10};
        sizes[1] = (size_case){64, 1024, 50};
    }
    int runs = quick ? 1 : 3;
    printf("| transport | answer (BF16 raw) | MB | answers | credits | value scan | best GB/s | median GB/s "
           "|\n");
    printf("|---|---|---:|---:|---:|---|---:|---:|\n");
    for (int si = 0; si < 2; si++)
        for (int e = 0; e < 2; e++)
            for (int check = 1; check >= 0; check--) {
                double g[3] = {0};
                int    n = n_answers > 0 ? n_answers : sizes[si].n;
                for (int r = 0; r < runs; r++)
                    g[r] = run_once(eps[e], sizes[si].T, sizes[si].D, n, credits, check);
                qsort(g, (size_t)runs, sizeof *g, cmp_double);
                printf("| %s | %u × %u | %.1f | %d | %d | %s | %.2f | %.2f |\n", names[e], sizes[si].T,
                       sizes[si].D, (double)sizes[si].T * sizes[si].D * 2 / 1e6, n, credits,
                       check ? "on" : "off", g[runs - 1], g[runs / 2]);
                fflush(stdout);
            }
    unlink(ipc + 6);
    return 0;
}
