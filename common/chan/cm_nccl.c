/* common/chan/cm_nccl.c — two-rank NCCL communicators for the hidden-state data path (cm_nccl.h).
 * Non-blocking communicators (ncclConfig_t.blocking = 0): every NCCL call may return
 * ncclInProgress, and completion is polled with ncclCommGetAsyncError under a deadline, so no
 * wait is unbounded; on any failure the communicator is aborted (ncclCommAbort also ends
 * transfers a dead peer will never match). */
#include "cm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"
#include "cm_nccl_try.h"
#include "cm_time.h"

_Static_assert(sizeof(ncclUniqueId) <= CM_PROTO_NCCL_UID_MAX, "ncclUniqueId must fit NCCL_OFFER");

#define CUDA_TRY(x)                                                                                          \
    do {                                                                                                     \
        cudaError_t e_ = (x);                                                                                \
        if (e_ != cudaSuccess)                                                                               \
            return CM_FAIL(CM_ERR_CUDA, "%s failed: %s (%s)", #x, cudaGetErrorString(e_),                    \
                           cudaGetErrorName(e_));                                                            \
    } while (0)


static void nap(void) {
    struct timespec t = {0, 20000}; /* 20 µs: transfers of interest take ≥ 100 µs */
    nanosleep(&t, NULL);
}

cm_status cm_nccl_make_offer(cm_proto_nccl *offer, int device) {
    ncclUniqueId id;
    NCCL_TRY(ncclGetUniqueId(&id));
    memset(offer, 0, sizeof *offer);
    offer->device = (uint32_t)device;
    offer->uid_len = (uint32_t)sizeof id;
    memcpy(offer->uid, &id, sizeof id);
    return CM_OK;
}

struct cm_nccl_peer {
    ncclComm_t   comm;
    cudaStream_t stream;
    int          device, rank, timeout_ms;
    void        *probe; /* 4 device bytes for the connection set-up exchange */
};

/* Waits until the communicator has no operation in progress (ncclSuccess) or fails. */
static cm_status comm_settle(ncclComm_t comm, int timeout_ms, const char *what) {
    double deadline = cm_now_s() + timeout_ms * 1e-3;
    for (;;) {
        ncclResult_t state;
        NCCL_TRY(ncclCommGetAsyncError(comm, &state));
        if (state == ncclSuccess)
            return CM_OK;
        if (state != ncclInProgress)
            return CM_FAIL(CM_ERR_NCCL, "%s: %s (%s)", what, ncclGetErrorString(state), ncclGetLastError(comm));
        if (cm_now_s() > deadline)
            return CM_FAIL(CM_ERR_TIMEOUT, "%s: no progress within %d ms (is the other side alive?)", what,
                           timeout_ms);
        nap();
    }
}

cm_status cm_nccl_peer_wait(cm_nccl_peer *p, int timeout_ms) {
    CUDA_TRY(cudaSetDevice(p->device));
    CM_TRY(comm_settle(p->comm, timeout_ms, "NCCL transfer"));
    double deadline = cm_now_s() + timeout_ms * 1e-3;
    for (;;) {
        cudaError_t e = cudaStreamQuery(p->stream);
        if (e == cudaSuccess)
            return CM_OK;
        if (e != cudaErrorNotReady)
            CUDA_TRY(e);
        ncclResult_t state;
        NCCL_TRY(ncclCommGetAsyncError(p->comm, &state));
        if (state != ncclSuccess && state != ncclInProgress)
            return CM_FAIL(CM_ERR_NCCL, "NCCL transfer failed: %s (%s)", ncclGetErrorString(state),
                           ncclGetLastError(p->comm));
        if (cm_now_s() > deadline)
            return CM_FAIL(CM_ERR_TIMEOUT,
                           "NCCL transfer did not complete within %d ms (the other side stopped receiving "
                           "or sending)",
                           timeout_ms);
        nap();
    }
}

void cm_nccl_peer_close(cm_nccl_peer **pp) {
    if (!pp || !*pp)
        return;
    cm_nccl_peer *p = *pp;
    cudaSetDevice(p->device);
    if (p->comm)
        ncclCommAbort(p->comm); /* ends unmatched transfers too; a clean peer has none */
    if (p->stream) {
        cudaStreamSynchronize(p->stream);
        cudaStreamDestroy(p->stream);
    }
    cudaFree(p->probe);
    free(p);
    *pp = NULL;
}

static cm_status exchange_probe(cm_nccl_peer *p);

cm_status cm_nccl_peer_open(cm_nccl_peer **out, const cm_proto_nccl *offer, int rank, int device,
                            int timeout_ms) {
    *out = NULL;
    if (rank != 0 && rank != 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "NCCL rank %d: a session has ranks 0 (trainer) and 1 (server)", rank);
    if (offer->uid_len != sizeof(ncclUniqueId))
        return CM_FAIL(CM_ERR_PROTOCOL, "NCCL_OFFER holds a %u-byte id; this NCCL's ids have %zu bytes",
                       offer->uid_len, sizeof(ncclUniqueId));
    cm_nccl_peer *p = calloc(1, sizeof *p);
    if (!p)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate an NCCL peer");
    p->device = device;
    p->rank = rank;
    p->timeout_ms = timeout_ms;
    *out = p;
    cm_status st = CM_OK;
#define TRY(x)                                                                                               \
    do {                                                                                                     \
        if ((st = (x)) != CM_OK)                                                                             \
            goto fail;                                                                                       \
    } while (0)
    TRY(cudaSetDevice(device) == cudaSuccess
            ? CM_OK
            : CM_FAIL(CM_ERR_CUDA, "cudaSetDevice(%d): %s", device, cudaGetErrorString(cudaGetLastError())));
    TRY(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking) == cudaSuccess
            ? CM_OK
            : CM_FAIL(CM_ERR_CUDA, "cannot create a stream on GPU %d", device));
    TRY(cudaMalloc(&p->probe, 4) == cudaSuccess ? CM_OK
                                                : CM_FAIL(CM_ERR_CUDA, "cannot allocate on GPU %d", device));
    ncclUniqueId id;
    memcpy(&id, offer->uid, sizeof id);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&p->comm, 2, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = CM_FAIL(CM_ERR_NCCL, "ncclCommInitRankConfig (rank %d on GPU %d) failed: %s (%s)", rank, device,
                     ncclGetErrorString(r), ncclGetLastError(NULL));
        goto fail;
    }
    TRY(comm_settle(p->comm, timeout_ms, "joining the NCCL communicator"));
    /* one tiny exchange both ways sets up the point-to-point connections now, not inside the
     * first answer */
    TRY(exchange_probe(p));
    TRY(cm_nccl_peer_wait(p, timeout_ms));
#undef TRY
    CM_LOG_DEBUG("NCCL communicator up: rank %d on GPU %d", rank, device);
    return CM_OK;
fail:
    cm_nccl_peer_close(out);
    return st;
}

/* Enqueues n sends or receives as one group; a non-blocking communicator may still be
 * enqueueing when ncclGroupEnd returns (ncclInProgress), and must settle before its next call. */
static cm_status transfer(cm_nccl_peer *p, void *const *bufs, const size_t *bytes, int n, int send) {
    CUDA_TRY(cudaSetDevice(p->device));
    NCCL_TRY(ncclGroupStart());
    for (int i = 0; i < n; i++) {
        ncclResult_t r = send ? ncclSend(bufs[i], bytes[i], ncclUint8, 1 - p->rank, p->comm, p->stream)
                              : ncclRecv(bufs[i], bytes[i], ncclUint8, 1 - p->rank, p->comm, p->stream);
        if (r != ncclSuccess && r != ncclInProgress) {
            ncclGroupEnd();
            return CM_FAIL(CM_ERR_NCCL, "%s of %zu bytes failed: %s (%s)", send ? "ncclSend" : "ncclRecv",
                           bytes[i], ncclGetErrorString(r), ncclGetLastError(p->comm));
        }
    }
    NCCL_TRY(ncclGroupEnd());
    return comm_settle(p->comm, p->timeout_ms, send ? "enqueueing an NCCL send" : "enqueueing an NCCL receive");
}

/* 4 bytes each way in one group (both ranks issue the same group, so neither waits). */
static cm_status exchange_probe(cm_nccl_peer *p) {
    CUDA_TRY(cudaSetDevice(p->device));
    NCCL_TRY(ncclGroupStart());
    ncclResult_t r1 = ncclSend(p->probe, 2, ncclUint8, 1 - p->rank, p->comm, p->stream);
    ncclResult_t r2 = ncclRecv((char *)p->probe + 2, 2, ncclUint8, 1 - p->rank, p->comm, p->stream);
    ncclResult_t r3 = ncclGroupEnd();
    ncclResult_t r = r1 != ncclSuccess && r1 != ncclInProgress   ? r1
                     : r2 != ncclSuccess && r2 != ncclInProgress ? r2
                                                                 : r3;
    if (r != ncclSuccess && r != ncclInProgress)
        return CM_FAIL(CM_ERR_NCCL, "the NCCL connection set-up exchange failed: %s (%s)", ncclGetErrorString(r),
                       ncclGetLastError(p->comm));
    return comm_settle(p->comm, p->timeout_ms, "the NCCL connection set-up exchange");
}

cm_status cm_nccl_peer_send(cm_nccl_peer *p, const void *const *bufs, const size_t *bytes, int n) {
    return transfer(p, (void *const *)bufs, bytes, n, 1);
}

cm_status cm_nccl_peer_recv(cm_nccl_peer *p, void *const *bufs, const size_t *bytes, int n) {
    return transfer(p, bufs, bytes, n, 0);
}

int cm_nccl_peer_device(const cm_nccl_peer *p) {
    return p->device;
}

// ----------------------------------------------------------------------------
// the trainer's hooks

typedef struct nc_slot {
    void  *mem;
    size_t cap;
} nc_slot;

struct cm_nccl_client {
    int                  device, timeout_ms;
    uint32_t             n_slots;
    nc_slot             *slots; /* n_slots + 1: the last is scratch */
    cm_nccl_peer        *peer;
    cm_nccl_client_stats stats;
};

cm_status cm_nccl_client_create(cm_nccl_client **out, int device, uint32_t n_slots, int timeout_ms) {
    *out = NULL;
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || device < 0 || device >= n_dev)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "NCCL data path: CUDA device %d is not there (%d devices)", device,
                       n_dev);
    cm_nccl_client *c = calloc(1, sizeof *c);
    if (c)
        c->slots = calloc((size_t)n_slots + 1, sizeof *c->slots);
    if (!c || !c->slots) {
        free(c);
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the NCCL client");
    }
    c->device = device;
    c->n_slots = n_slots;
    c->timeout_ms = timeout_ms;
    *out = c;
    return CM_OK;
}

void cm_nccl_client_destroy(cm_nccl_client **cp) {
    if (!cp || !*cp)
        return;
    cm_nccl_client *c = *cp;
    cm_nccl_peer_close(&c->peer);
    cudaSetDevice(c->device);
    for (uint32_t i = 0; i <= c->n_slots; i++)
        cudaFree(c->slots[i].mem);
    free(c->slots);
    free(c);
    *cp = NULL;
}

static cm_status hook_offer(void *user, cm_proto_nccl *offer) {
    cm_nccl_client *c = user;
    CUDA_TRY(cudaSetDevice(c->device));
    return cm_nccl_make_offer(offer, c->device);
}

static cm_status hook_join(void *user, const cm_proto_nccl *offer) {
    cm_nccl_client *c = user;
    cm_nccl_peer_close(&c->peer);
    CM_TRY(cm_nccl_peer_open(&c->peer, offer, 0, c->device, c->timeout_ms));
    c->stats.sessions++;
    return CM_OK;
}

static cm_status hook_recv(void *user, uint32_t slot, uint32_t n, const cm_proto_tensor *t, const void **dev) {
    cm_nccl_client *c = user;
    if (!c->peer)
        return CM_FAIL(CM_ERR_INVALID_ARG, "an nccl answer outside an NCCL session");
    if (slot > c->n_slots || n > 256)
        return CM_FAIL(CM_ERR_INVALID_ARG, "nccl answer slot %u of %u, %u tensors", slot, c->n_slots, n);
    nc_slot *s = &c->slots[slot];
    size_t   total = 0, off[256], bytes[256];
    for (uint32_t i = 0; i < n; i++) {
        off[i] = total;
        bytes[i] = (size_t)t[i].raw_size;
        total += (bytes[i] + 255) & ~(size_t)255; /* each tensor 256-byte aligned */
    }
    CUDA_TRY(cudaSetDevice(c->device));
    if (total > s->cap) {
        cudaFree(s->mem);
        s->mem = NULL;
        s->cap = 0;
        CUDA_TRY(cudaMalloc(&s->mem, total));
        s->cap = total;
    }
    void *bufs[256];
    for (uint32_t i = 0; i < n; i++)
        bufs[i] = (uint8_t *)s->mem + off[i];
    double t0 = cm_now_s();
    CM_TRY(cm_nccl_peer_recv(c->peer, bufs, bytes, (int)n));
    CM_TRY(cm_nccl_peer_wait(c->peer, c->timeout_ms));
    c->stats.recv_s += cm_now_s() - t0;
    c->stats.answers++;
    for (uint32_t i = 0; i < n; i++) {
        dev[i] = bufs[i];
        c->stats.bytes += bytes[i];
    }
    return CM_OK;
}

static void hook_leave(void *user) {
    cm_nccl_client *c = user;
    cm_nccl_peer_close(&c->peer);
}

void cm_nccl_client_hooks(cm_nccl_client *c, cm_chan_nccl_client *out) {
    *out = (cm_chan_nccl_client){hook_offer, hook_join, hook_recv, hook_leave, c};
}

void cm_nccl_client_get_stats(cm_nccl_client *c, cm_nccl_client_stats *out) {
    *out = c->stats; /* written by the client's I/O thread; a snapshot for reports */
}
