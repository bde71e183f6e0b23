/* target-server/ts_nccl.cu — the server side of the NCCL data path (ts_nccl.h): the captured
 * layers rounded and checked in staging memory (ts_stage.h), then ncclSend through
 * common/chan/cm_nccl. */
#include "ts_nccl.h"

#include <stdlib.h>

#include "cm_log.h"
#include "cm_nccl.h"
#include "kn_cuda.h"
#include "ts_stage.h"

struct ts_nccl_peer {
    cm_nccl_peer *nc;
    int           device;
    ts_stage     *stage;     /* the answer being sent (or last sent), rounded and checked */
    int           in_flight; /* sends enqueued and not yet waited for */
};

extern "C" cm_status ts_nccl_open(ts_nccl_peer **out, const cm_proto_nccl *offer, kn_ctx *ctx, int timeout_ms) {
    *out = NULL;
    ts_nccl_peer *p = (ts_nccl_peer *)calloc(1, sizeof *p);
    if (!p)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate an NCCL peer");
    p->device = ctx->device;
    cm_status st = ts_stage_create(&p->stage, ctx);
    if (st == CM_OK)
        st = cm_nccl_peer_open(&p->nc, offer, 1, ctx->device, timeout_ms);
    if (st != CM_OK) {
        ts_stage_destroy(&p->stage);
        free(p);
        return st;
    }
    *out = p;
    return CM_OK;
}

extern "C" void ts_nccl_close(ts_nccl_peer **pp) {
    if (!pp || !*pp)
        return;
    ts_nccl_peer *p = *pp;
    cm_nccl_peer_close(&p->nc);
    ts_stage_destroy(&p->stage);
    free(p);
    *pp = NULL;
}

extern "C" cm_status ts_nccl_send(ts_nccl_peer *p, kn_ctx *ctx, float *const *dev, const int32_t *layers, int n,
                                  int64_t T, int64_t D, cm_dtype dt, uint64_t batch, int timeout_ms) {
    if (dt != CM_DTYPE_BF16 && dt != CM_DTYPE_F32)
        return CM_FAIL(CM_ERR_INVALID_ARG, "NCCL answers are BF16 or F32, not %s", cm_dtype_name(dt));
    if (n > 256)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d layers in one answer; at most 256", n);
    (void)ctx; /* the stage holds the peer's context */
    KN_CUDA(cudaSetDevice(p->device));
    if (p->in_flight) { /* the staging memory is the previous answer's until its sends are done */
        CM_TRY(cm_nccl_peer_wait(p->nc, timeout_ms));
        p->in_flight = 0;
    }
    const void *bufs[256];
    size_t      bytes[256];
    CM_TRY(ts_stage_round(p->stage, dev, layers, n, T, D, dt, batch, bufs));
    for (int i = 0; i < n; i++)
        bytes[i] = (size_t)T * (size_t)D * cm_dtype_size(dt);
    CM_TRY(cm_nccl_peer_send(p->nc, bufs, bytes, n));
    p->in_flight = 1;
    return CM_OK;
}
