/* drafter-trainer/model/dt_dp.c — data parallelism over NCCL (dt_dp.h): the ZeroMQ rendezvous that
 * hands rank 0's NCCL unique id to the others, a non-blocking communicator whose every wait is
 * polled under a deadline (as common/chan/cm_nccl.c), and the per-step reduction, bucketed and
 * overlapped with the backward: the model's gradient hook (dt_model_set_grad_hook) says when
 * the slab from some offset to its end is final (the final norm, then each layer from the last,
 * then fc); the first call all-reduces Σ den (one double), and each call after an event on the
 * compute stream all-reduces the new bucket on a stream of its own with NCCL's PreMulSum,
 * whose per-rank scalar den_r / Σ den folds the loss weighting into the reduction (no extra
 * pass over the gradients). dt_dp_reduce issues what the hook did not (all of it on a rank
 * whose batch had nothing to train on: the same collectives in the same order on every rank),
 * then the statistics, and waits. */
#include "dt_dp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cm_time.h"
#include "cm_log.h"

#ifndef TANDEM_HAVE_NCCL

int dt_dp_default_device(void) {
    return 0;
}

cm_status dt_dp_create(dt_dp **out, const dt_dp_config *cfg, const kn_backend *be, kn_ctx *ctx, dt_model *m) {
    (void)cfg, (void)be, (void)ctx, (void)m;
    if (out)
        *out = NULL;
    return CM_FAIL(CM_ERR_UNSUPPORTED,
                   "data parallelism over NCCL is not in this build (no CUDA or NCCL found at configure "
                   "time); rebuild with CUDA and NCCL, or train with one rank");
}

void dt_dp_destroy(dt_dp **dp) {
    if (dp)
        *dp = NULL;
}

cm_status dt_dp_reduce(dt_dp *dp, dt_step_stats *s) {
    (void)dp, (void)s;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "data parallelism over NCCL is not in this build");
}

cm_status dt_dp_grad_hook(void *user, size_t off, double weight_sum) {
    (void)user, (void)off, (void)weight_sum;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "data parallelism over NCCL is not in this build");
}

#else /* TANDEM_HAVE_NCCL */

#include <cuda_runtime.h>
#include <errno.h>
#include <nccl.h>
#include <zmq.h>

#include "cm_nccl_try.h"
#include "kn_cuda.h"

#define DP_MAGIC   "tandem-dp/1"
#define DP_N_STATS (4 + 4 * 64 + 4) /* loss·w, Σw, blocks, τ·blocks, per-slot hits/counts, DFlash2's per-slot
                                    recall and selector hits, unary·w, selector·w_sel, Σ w_sel, sel τ·blocks */

struct dt_dp {
    dt_dp_config cfg;
    kn_ctx      *ctx;
    ncclComm_t   comm;
    float       *grad; /* the model's gradient slab (device) */
    size_t       n_grad;
    double      *d_stats; /* device, DP_N_STATS */
    double      *h_stats; /* pinned host, DP_N_STATS: asynchronous copies keep every wait bounded */
    dt_model    *model;
    cudaStream_t stream;  /* every collective, apart from the compute stream */
    cudaEvent_t  ev;      /* a bucket's gradients are written (compute stream) / reduced (ours) */
    /* this step: begun (Σ den known, op made), [0, pending) not yet reduced, buckets issued */
    int         begun, have_op;
    size_t      pending;
    int         n_buckets;
    size_t     *bucket; /* [n_bucket]: the hook's offsets in call order (dt_model_grad_buckets) */
    int         n_bucket;
    float       scalar;
    ncclRedOp_t op;
};

static void nap(void) {
    struct timespec t = {0, 20000};
    nanosleep(&t, NULL);
}

int dt_dp_default_device(void) {
    const char *lr = getenv("LOCAL_RANK");
    int         n = 0;
    if (!lr || cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        cudaGetLastError();
        return 0;
    }
    return atoi(lr) % n;
}

// ----------------------------------------------------------------------------
// rendezvous: rank 0 serves the unique id over ZeroMQ

static cm_status zmq_fail(const char *what, const char *endpoint) {
    return CM_FAIL(CM_ERR_ZMQ, "data-parallel rendezvous: %s '%s': %s", what, endpoint,
                   zmq_strerror(zmq_errno()));
}

/* Rank 0: answers every other rank once with the id; a request from a run of another size
 * is answered with an error and fails this rank too (the launch is inconsistent). */
static cm_status serve_id(const dt_dp_config *c, const ncclUniqueId *id) {
    char      endpoint[300];
    void     *zc = zmq_ctx_new(), *sock = zc ? zmq_socket(zc, ZMQ_REP) : NULL;
    cm_status st = CM_OK;
    int       linger = 0, seen = 0;
    char     *answered = calloc((size_t)c->size, 1);
    if (!sock || !answered) {
        st = CM_FAIL(CM_ERR_NOMEM, "data-parallel rendezvous: cannot create a ZeroMQ socket");
        goto done;
    }
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    snprintf(endpoint, sizeof endpoint, "tcp://%s:%d", c->master_addr, c->master_port);
    if (zmq_bind(sock, endpoint) != 0) { /* MASTER_ADDR may name this host without being an interface */
        snprintf(endpoint, sizeof endpoint, "tcp://*:%d", c->master_port);
        if (zmq_bind(sock, endpoint) != 0) {
            st = CM_FAIL(CM_ERR_ZMQ,
                         "data-parallel rendezvous: rank 0 cannot bind '%s': %s (is MASTER_PORT %d taken by "
                         "another run? choose another)",
                         endpoint, zmq_strerror(zmq_errno()), c->master_port);
            goto done;
        }
    }
    const double deadline = cm_now_s() + c->timeout_ms * 1e-3;
    while (seen < c->size - 1) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        const double   left = deadline - cm_now_s();
        if (left <= 0) {
            st =
                CM_FAIL(CM_ERR_TIMEOUT,
                        "data-parallel rendezvous: only %d of the %d other ranks reached rank 0 at %s within "
                        "%d ms; start every rank with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE",
                        seen, c->size - 1, endpoint, c->timeout_ms);
            goto done;
        }
        int rc = zmq_poll(&it, 1, (long)(left * 1e3) + 1);
        if (rc < 0) {
            st = zmq_fail("poll failed on", endpoint);
            goto done;
        }
        if (rc == 0)
            continue;
        char req[64] = {0};
        int  n = zmq_recv(sock, req, sizeof req - 1, 0);
        if (n < 0) {
            st = zmq_fail("cannot receive on", endpoint);
            goto done;
        }
        int rank = -1, size = -1;
        if (sscanf(req, DP_MAGIC " %d %d", &rank, &size) != 2 || size != c->size || rank < 1 ||
            rank >= size || answered[rank]) {
            zmq_send(sock, "error", 5, 0);
            st = CM_FAIL(CM_ERR_PROTOCOL,
                         "data-parallel rendezvous: rank 0 of %d got '%.40s' (another run's rank, a "
                         "different WORLD_SIZE or a rank started twice); give every rank the same size and "
                         "its own rank",
                         c->size, req);
            goto done;
        }
        if (zmq_send(sock, id, sizeof *id, 0) != (int)sizeof *id) {
            st = zmq_fail("cannot send the id on", endpoint);
            goto done;
        }
        answered[rank] = 1;
        seen++;
    }
done:
    free(answered);
    if (sock)
        zmq_close(sock);
    if (zc)
        zmq_ctx_term(zc);
    return st;
}

static cm_status fetch_id(const dt_dp_config *c, ncclUniqueId *id) {
    char endpoint[300];
    snprintf(endpoint, sizeof endpoint, "tcp://%s:%d", c->master_addr, c->master_port);
    void     *zc = zmq_ctx_new(), *sock = zc ? zmq_socket(zc, ZMQ_REQ) : NULL;
    cm_status st = CM_OK;
    int       linger = 0, tmo = c->timeout_ms;
    if (!sock) {
        st = CM_FAIL(CM_ERR_NOMEM, "data-parallel rendezvous: cannot create a ZeroMQ socket");
        goto done;
    }
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &tmo, sizeof tmo);
    if (zmq_connect(sock, endpoint) != 0) {
        st = zmq_fail("cannot connect to", endpoint);
        goto done;
    }
    char req[64];
    int  len = snprintf(req, sizeof req, DP_MAGIC " %d %d", c->rank, c->size);
    if (zmq_send(sock, req, (size_t)len, 0) != len) {
        st = zmq_fail("cannot send to", endpoint);
        goto done;
    }
    char buf[sizeof *id + 1];
    int  n = zmq_recv(sock, buf, sizeof buf, 0);
    if (n < 0 && zmq_errno() == EAGAIN)
        st = CM_FAIL(CM_ERR_TIMEOUT,
                     "data-parallel rendezvous: rank 0 did not answer at %s within %d ms; start rank 0 with "
                     "the same MASTER_ADDR/MASTER_PORT (or check that the port is reachable)",
                     endpoint, c->timeout_ms);
    else if (n < 0)
        st = zmq_fail("cannot receive from", endpoint);
    else if (n != (int)sizeof *id)
        st = CM_FAIL(CM_ERR_PROTOCOL,
                     "data-parallel rendezvous: rank 0 at %s refused rank %d of %d; give every rank the same "
                     "WORLD_SIZE and its own RANK",
                     endpoint, c->rank, c->size);
    else
        memcpy(id, buf, sizeof *id);
done:
    if (sock)
        zmq_close(sock);
    if (zc)
        zmq_ctx_term(zc);
    return st;
}

// ----------------------------------------------------------------------------
// communicator

/* Waits until the communicator has nothing in progress and (stream_too) our stream has
 * drained. */
static cm_status settle(dt_dp *dp, const char *what, int stream_too) {
    const double deadline = cm_now_s() + dp->cfg.timeout_ms * 1e-3;
    for (;;) {
        ncclResult_t state;
        NCCL_TRY(ncclCommGetAsyncError(dp->comm, &state));
        if (state != ncclSuccess && state != ncclInProgress)
            return CM_FAIL(CM_ERR_NCCL, "%s failed on rank %d of %d: %s (%s); another rank probably stopped",
                           what, dp->cfg.rank, dp->cfg.size, ncclGetErrorString(state),
                           ncclGetLastError(dp->comm));
        if (state == ncclSuccess) {
            if (!stream_too)
                return CM_OK;
            cudaError_t e = cudaStreamQuery(dp->stream);
            if (e == cudaSuccess)
                return CM_OK;
            if (e != cudaErrorNotReady)
                KN_CUDA(e);
        }
        if (cm_now_s() > deadline)
            return CM_FAIL(CM_ERR_TIMEOUT,
                           "%s did not complete within %d ms on rank %d of %d (another rank stopped or is "
                           "stuck)",
                           what, dp->cfg.timeout_ms, dp->cfg.rank, dp->cfg.size);
        nap();
    }
}

cm_status dt_dp_create(dt_dp **out, const dt_dp_config *cfg, const kn_backend *be, kn_ctx *ctx, dt_model *m) {
    if (!out || !cfg || !be || !ctx || !m)
        return CM_FAIL(CM_ERR_INVALID_ARG, "dt_dp_create: NULL argument");
    *out = NULL;
    if (be != kn_backend_cuda())
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "data parallelism over NCCL needs --device cuda (the %s backend has no NCCL)",
                       be->name);
    if (cfg->size < 2 || cfg->rank < 0 || cfg->rank >= cfg->size)
        return CM_FAIL(CM_ERR_INVALID_ARG, "data-parallel rank %d of %d: need 0 <= rank < size and size >= 2",
                       cfg->rank, cfg->size);
    dt_dp *dp = calloc(1, sizeof *dp);
    if (!dp)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the data-parallel state");
    dp->cfg = *cfg;
    if (!dp->cfg.master_addr || !*dp->cfg.master_addr)
        dp->cfg.master_addr = "127.0.0.1";
    if (dp->cfg.master_port <= 0)
        dp->cfg.master_port = 29500;
    dp->ctx = ctx;
    dt_model_grad_slab(m, &dp->grad, &dp->n_grad);
    cm_status    st = CM_OK;
    ncclUniqueId id;
#define TRY(x)                                                                                               \
    do {                                                                                                     \
        if ((st = (x)) != CM_OK)                                                                             \
            goto fail;                                                                                       \
    } while (0)
    dp->pending = dp->n_grad;
    dp->n_bucket = dt_model_grad_buckets(m, NULL, 0);
    dp->bucket = malloc((size_t)dp->n_bucket * sizeof *dp->bucket);
    if (!dp->bucket) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d gradient buckets", dp->n_bucket);
        goto fail;
    }
    dt_model_grad_buckets(m, dp->bucket, dp->n_bucket);
    if (cudaSetDevice(ctx->device) != cudaSuccess ||
        cudaMalloc((void **)&dp->d_stats, DP_N_STATS * sizeof(double)) != cudaSuccess ||
        cudaMallocHost((void **)&dp->h_stats, DP_N_STATS * sizeof(double)) != cudaSuccess ||
        cudaStreamCreateWithFlags(&dp->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&dp->ev, cudaEventDisableTiming) != cudaSuccess) {
        st = CM_FAIL(CM_ERR_CUDA, "cannot allocate the data-parallel statistics on device %d: %s",
                     ctx->device, cudaGetErrorString(cudaGetLastError()));
        goto fail;
    }
    if (cfg->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) {
            st = CM_FAIL(CM_ERR_NCCL, "ncclGetUniqueId failed: %s", ncclGetErrorString(r));
            goto fail;
        }
        TRY(serve_id(&dp->cfg, &id));
    } else
        TRY(fetch_id(&dp->cfg, &id));
    ncclConfig_t nc = NCCL_CONFIG_INITIALIZER;
    nc.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&dp->comm, cfg->size, id, cfg->rank, &nc);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = CM_FAIL(CM_ERR_NCCL, "ncclCommInitRankConfig (rank %d of %d) failed: %s (%s)", cfg->rank,
                     cfg->size, ncclGetErrorString(r), ncclGetLastError(NULL));
        goto fail;
    }
    TRY(settle(dp, "joining the data-parallel communicator", 0));
    dt_model_set_grad_hook(m, dt_dp_grad_hook, dp);
    dp->model = m;
    CM_LOG_INFO("data parallel: rank %d of %d on cuda device %d, rendezvous %s:%d, %zu gradient floats "
                "reduced in buckets during the backward",
                cfg->rank, cfg->size, ctx->device, dp->cfg.master_addr, dp->cfg.master_port, dp->n_grad);
    *out = dp;
    return CM_OK;
#undef TRY
fail:
    dt_dp_destroy(&dp);
    return st;
}

void dt_dp_destroy(dt_dp **pp) {
    if (!pp || !*pp)
        return;
    dt_dp *dp = *pp;
    if (dp->ctx)
        cudaSetDevice(dp->ctx->device);
    if (dp->model)
        dt_model_set_grad_hook(dp->model, NULL, NULL);
    if (dp->comm)
        ncclCommAbort(dp->comm);
    if (dp->stream)
        cudaStreamDestroy(dp->stream);
    if (dp->ev)
        cudaEventDestroy(dp->ev);
    cudaFree(dp->d_stats);
    cudaFreeHost(dp->h_stats);
    free(dp->bucket);
    free(dp);
    *pp = NULL;
}

/* The step's first collective: Σ den over the ranks, and the PreMulSum op with this rank's
 * share den_r / Σ den (0 for a rank without anchors, whose gradient is zero anyway, and when
 * no rank had a labelled slot). */
static cm_status begin_step(dt_dp *dp, double den_r) {
    double *h = dp->h_stats;
    h[0] = den_r;
    KN_CUDA(cudaMemcpyAsync(dp->d_stats, h, sizeof(double), cudaMemcpyHostToDevice, dp->stream));
    NCCL_TRY(ncclAllReduce(dp->d_stats, dp->d_stats, 1, ncclDouble, ncclSum, dp->comm, dp->stream));
    CM_TRY(settle(dp, "the weight all-reduce", 0));
    KN_CUDA(cudaMemcpyAsync(h, dp->d_stats, sizeof(double), cudaMemcpyDeviceToHost, dp->stream));
    CM_TRY(settle(dp, "the weight all-reduce", 1));
    const double den = h[0];
    dp->scalar = den > 0 ? (float)(den_r / den) : 0.0f;
    NCCL_TRY(ncclRedOpCreatePreMulSum(&dp->op, &dp->scalar, ncclFloat, ncclScalarHostImmediate, dp->comm));
    CM_TRY(settle(dp, "creating the weighted-sum reduction", 0));
    dp->have_op = 1;
    dp->begun = 1;
    return CM_OK;
}

/* All-reduces grad[off, pending) on our stream once the compute stream has written it, one
 * collective per bucket, so every rank issues the same collectives whether its hook ran or
 * not. */
static cm_status reduce_from(dt_dp *dp, size_t off) {
    if (off >= dp->pending)
        return CM_OK;
    KN_CUDA(cudaEventRecord(dp->ev, dp->ctx->stream));
    KN_CUDA(cudaStreamWaitEvent(dp->stream, dp->ev, 0));
    for (int b = 0; b < dp->n_bucket; b++) {
        const size_t lo = dp->bucket[b];
        if (lo < off || lo >= dp->pending)
            continue;
        const size_t n = dp->pending - lo;
        ncclResult_t r = ncclAllReduce(dp->grad + lo, dp->grad + lo, n, ncclFloat, dp->op, dp->comm, dp->stream);
        if (r != ncclSuccess && r != ncclInProgress)
            return CM_FAIL(CM_ERR_NCCL, "ncclAllReduce of %zu gradients failed: %s (%s)", n,
                           ncclGetErrorString(r), ncclGetLastError(dp->comm));
        CM_TRY(settle(dp, "the gradient all-reduce", 0));
        dp->pending = lo;
        dp->n_buckets++;
    }
    return CM_OK;
}

cm_status dt_dp_grad_hook(void *user, size_t off, double weight_sum) {
    dt_dp *dp = user;
    if (!dp->begun)
        CM_TRY(begin_step(dp, weight_sum));
    return reduce_from(dp, off);
}

cm_status dt_dp_reduce(dt_dp *dp, dt_step_stats *s) {
    cm_status st = CM_OK;
    if (!dp->begun) /* the backward never ran here: no anchors, or no labelled slot */
        st = begin_step(dp, s->weight_sum);
    if (st == CM_OK)
        st = reduce_from(dp, 0);
    double *h = dp->h_stats;
    if (st == CM_OK) {
        memset(h, 0, DP_N_STATS * sizeof(double));
        h[0] = s->loss * s->weight_sum;
        h[1] = s->weight_sum;
        h[2] = (double)s->n_blocks;
        h[3] = s->tau * (double)s->n_blocks;
        for (int k = 0; k < 64; k++) {
            h[4 + k] = (double)s->acc_hits[k];
            h[4 + 64 + k] = (double)s->acc_count[k];
            h[4 + 128 + k] = (double)s->sel_in_topk[k];
            h[4 + 192 + k] = (double)s->sel_hits[k];
        }
        h[4 + 256] = s->loss_unary * s->weight_sum;
        h[4 + 257] = s->loss_selector * s->sel_weight_sum;
        h[4 + 258] = s->sel_weight_sum;
        h[4 + 259] = s->sel_tau * (double)s->n_blocks;
        if (cudaMemcpyAsync(dp->d_stats, h, DP_N_STATS * sizeof(double), cudaMemcpyHostToDevice, dp->stream) !=
            cudaSuccess)
            st = CM_FAIL(CM_ERR_CUDA, "cannot copy the step statistics: %s", cudaGetErrorString(cudaGetLastError()));
    }
    if (st == CM_OK) {
        ncclResult_t r = ncclAllReduce(dp->d_stats, dp->d_stats, DP_N_STATS, ncclDouble, ncclSum, dp->comm,
                                       dp->stream);
        st = r == ncclSuccess || r == ncclInProgress
                 ? settle(dp, "the statistics all-reduce", 0)
                 : CM_FAIL(CM_ERR_NCCL, "ncclAllReduce of the step statistics failed: %s (%s)",
                           ncclGetErrorString(r), ncclGetLastError(dp->comm));
    }
    if (st == CM_OK &&
        cudaMemcpyAsync(h, dp->d_stats, DP_N_STATS * sizeof(double), cudaMemcpyDeviceToHost, dp->stream) !=
            cudaSuccess)
        st = CM_FAIL(CM_ERR_CUDA, "cannot copy the step statistics: %s", cudaGetErrorString(cudaGetLastError()));
    if (st == CM_OK) /* every bucket and the statistics reduced: the optimizer may read them */
        st = settle(dp, "the gradient and statistics all-reduces", 1);
    if (dp->have_op)
        ncclRedOpDestroy(dp->op, dp->comm);
    const int n_buckets = dp->n_buckets;
    dp->have_op = dp->begun = dp->n_buckets = 0;
    dp->pending = dp->n_grad;
    CM_TRY(st);
    CM_LOG_DEBUG("data parallel: %d gradient buckets this step", n_buckets);
    const double den = h[1];
    s->weight_sum = den;
    s->loss = den > 0 ? h[0] / den : 0.0;
    s->n_blocks = (int64_t)h[2];
    s->tau = h[2] > 0 ? h[3] / h[2] : 0.0;
    for (int k = 0; k < 64; k++) {
        s->acc_hits[k] = (int64_t)h[4 + k];
        s->acc_count[k] = (int64_t)h[4 + 64 + k];
        s->sel_in_topk[k] = (int64_t)h[4 + 128 + k];
        s->sel_hits[k] = (int64_t)h[4 + 192 + k];
    }
    /* DFlash2: each term over its own weights (with --selector-miss drop the ranks' gradients were
     * normalised by their own kept weight, so only the figures, not the step, are the global ones) */
    s->loss_unary = den > 0 ? h[4 + 256] / den : 0.0;
    s->sel_weight_sum = h[4 + 258];
    s->loss_selector = h[4 + 258] > 0 ? h[4 + 257] / h[4 + 258] : 0.0;
    s->sel_tau = h[2] > 0 ? h[4 + 259] / h[2] : 0.0;
    if (s->alpha > 0 || s->loss_selector > 0)
        s->loss = s->loss_unary + s->alpha * s->loss_selector;
    return CM_OK;
}

#endif /* TANDEM_HAVE_NCCL */
