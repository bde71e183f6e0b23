/* target-server/ts_nccl.h — the server side of the NCCL data path (cm_proto.h, "The nccl
 * encoding"): a session's peer (its communicator, as rank 1) and the staging memory its
 * answers leave from. Built only with CUDA and NCCL (TANDEM_HAVE_NCCL). Worker thread only. */
#ifndef TS_NCCL_H
#define TS_NCCL_H

#include <stdint.h>

#include "cm_dtype.h"
#include "cm_proto.h"
#include "cm_status.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_nccl_peer ts_nccl_peer;

/* Joins the communicator of offer as rank 1 on the context's GPU, waiting at most
 * timeout_ms for the trainer. */
cm_status ts_nccl_open(ts_nccl_peer **out, const cm_proto_nccl *offer, kn_ctx *ctx, int timeout_ms);
void      ts_nccl_close(ts_nccl_peer **p); /* aborts a transfer in flight; NULL-safe */

/* Sends one answer: layer i of the request is dev[i] (F32 [T, D] on the context's device,
 * written by the forward on the context's stream). Each is rounded to dt (BF16, RNE, or
 * kept F32) into the peer's staging memory and checked there (a capture holding NaN/Inf or
 * nothing but zeros is refused, docs/architecture.md, naming layers[i] and batch); then the sends are
 * enqueued and the call returns: the previous answer's sends are waited for (≤ timeout_ms)
 * before its staging memory is reused. */
cm_status ts_nccl_send(ts_nccl_peer *p, kn_ctx *ctx, float *const *dev, const int32_t *layers, int n,
                       int64_t T, int64_t D, cm_dtype dt, uint64_t batch, int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif /* TS_NCCL_H */
