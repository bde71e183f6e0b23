/* common/chan/cm_nccl.h — the NCCL data path's two-rank communicators (docs/architecture.md: hidden states GPU
 * to GPU on one host, control on ZeroMQ). Built into libcm_nccl only where CUDA and NCCL are
 * found; the header has no CUDA or NCCL types, so host code includes it freely.
 *
 * A session's communicator has two ranks: the trainer (rank 0) makes the unique id and sends it
 * in NCCL_OFFER (cm_proto.h); the server joins as rank 1. Communicators are non-blocking NCCL
 * communicators, so every wait here is bounded (timeout_ms) and a peer that never shows up or
 * dies mid-transfer ends with CM_ERR_TIMEOUT or CM_ERR_NCCL instead of a hang, and is aborted.
 * Transfers are point-to-point ncclSend/ncclRecv of bytes on the peer's own stream, paired in
 * the order both sides issue them. One thread uses a peer at a time. */
#ifndef CM_NCCL_H
#define CM_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "cm_chan.h"
#include "cm_proto.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills offer->uid/uid_len with a fresh ncclUniqueId and offer->device with device. */
cm_status cm_nccl_make_offer(cm_proto_nccl *offer, int device);

typedef struct cm_nccl_peer cm_nccl_peer;

/* Joins the communicator of offer as rank (0: the trainer, 1: the server) on CUDA device
 * `device`, waiting at most timeout_ms for the other rank, then exchanges one small message to
 * set up the point-to-point connection (so later transfers never wait on connection setup).
 * Caller closes with cm_nccl_peer_close. */
cm_status cm_nccl_peer_open(cm_nccl_peer **out, const cm_proto_nccl *offer, int rank, int device,
                            int timeout_ms);
/* Aborts transfers in flight, frees the communicator and the stream. NULL-safe. */
void cm_nccl_peer_close(cm_nccl_peer **p);

/* Enqueues n sends (bufs[i]: device memory of bytes[i]) on the peer's stream and returns; the
 * memory must stay untouched until cm_nccl_peer_wait. */
cm_status cm_nccl_peer_send(cm_nccl_peer *p, const void *const *bufs, const size_t *bytes, int n);
/* Enqueues n receives into device memory. */
cm_status cm_nccl_peer_recv(cm_nccl_peer *p, void *const *bufs, const size_t *bytes, int n);
/* Waits up to timeout_ms for everything enqueued on the peer; CM_ERR_TIMEOUT or CM_ERR_NCCL
 * (the peer is then unusable: close it). */
cm_status cm_nccl_peer_wait(cm_nccl_peer *p, int timeout_ms);
int       cm_nccl_peer_device(const cm_nccl_peer *p);

// ----------------------------------------------------------------------------
// the trainer's side: the cm_chan_nccl_client hooks, with device memory per answer slot

typedef struct cm_nccl_client cm_nccl_client;

/* n_slots = the client's credits (one more scratch slot is kept for unawaited answers);
 * timeout_ms bounds the join and every receive. */
cm_status cm_nccl_client_create(cm_nccl_client **out, int device, uint32_t n_slots, int timeout_ms);
void      cm_nccl_client_destroy(cm_nccl_client **c); /* after the cm_chan client; NULL-safe */
/* The hooks to put in cm_chan_client_config.nccl (user = c). */
void cm_nccl_client_hooks(cm_nccl_client *c, cm_chan_nccl_client *out);

typedef struct cm_nccl_client_stats {
    uint64_t answers, bytes; /* answers and bytes received over NCCL */
    double   recv_s;         /* seconds from posting an answer's receives to their completion */
    uint64_t sessions;       /* communicators joined */
} cm_nccl_client_stats;
void cm_nccl_client_get_stats(cm_nccl_client *c, cm_nccl_client_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* CM_NCCL_H */
