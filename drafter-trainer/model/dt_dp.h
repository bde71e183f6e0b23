/* drafter-trainer/model/dt_dp.h — data parallelism of the drafter over NCCL (docs/architecture.md, docs/drafter.md): W ranks,
 * one GPU each, each holding a full replica of the drafter and its optimizer, each training on
 * its share of every epoch (dt_data_set_dp). After each rank's forward and backward, dt_dp_reduce
 * makes every rank's gradients and step statistics the global ones:
 *
 *     loss = Σ_r num_r / Σ_r den_r      (num_r = Σ w·CE, den_r = Σ w on rank r)
 *     grad = Σ_r (den_r / Σ_s den_s) · grad_r
 *
 * so W ranks over a global batch give the same step as one GPU over the same rows. A rank whose
 * batch has no anchors (den_r = 0, zero gradients) still joins both collectives with weight 0.
 * The grad-norm clip and AdamW then run on the reduced gradients, identically on every rank,
 * so the replicas stay equal. The gradient slab is reduced in buckets (the final norm, each
 * layer, fc) while the backward goes on: dt_dp_create installs the model's gradient hook
 * (dt_model_set_grad_hook), which all-reduces each bucket on a stream of its own as soon as
 * the backward has written it.
 *
 * Rendezvous: rank 0 makes the NCCL unique id and serves it on a ZeroMQ REP socket bound to
 * tcp://MASTER_ADDR:MASTER_PORT (torchrun's variables; "*" when MASTER_ADDR is not an address
 * of this host); the other ranks ask for it there. Every wait (the rendezvous, the
 * communicator's set-up, each collective) is bounded by timeout_ms: a rank that never comes or
 * dies ends the others with CM_ERR_TIMEOUT or CM_ERR_NCCL naming it, never a hang.
 *
 * Built with NCCL only (TANDEM_HAVE_NCCL); elsewhere dt_dp_create fails with
 * CM_ERR_UNSUPPORTED. One thread, the backend context's. */
#ifndef DT_DP_H
#define DT_DP_H

#include <stddef.h>

#include "cm_status.h"
#include "dt_model.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_dp dt_dp;

typedef struct dt_dp_config {
    int         rank, size;  /* 0 ≤ rank < size, size ≥ 2 */
    const char *master_addr; /* rank 0's host (MASTER_ADDR); NULL = 127.0.0.1 */
    int         master_port; /* rendezvous port (MASTER_PORT); 0 = 29500 */
    int         timeout_ms;  /* longest wait for the other ranks, per rendezvous and collective */
} dt_dp_config;

/* The cuda device this rank should use when --gpu is not given: LOCAL_RANK modulo the
 * visible devices (torchrun sets LOCAL_RANK; tandem-launch also narrows CUDA_VISIBLE_DEVICES
 * to one device, which gives 0), else 0. */
int dt_dp_default_device(void);

/* Joins the W-rank communicator on the context's device (be must be the cuda backend). The
 * gradients of m are reduced in place: m must outlive the dt_dp. Caller destroys with
 * dt_dp_destroy. */
cm_status dt_dp_create(dt_dp **out, const dt_dp_config *cfg, const kn_backend *be, kn_ctx *ctx, dt_model *m);
void      dt_dp_destroy(dt_dp **dp); /* NULL-safe; aborts the communicator */

/* After dt_model_step on every rank: reduces the gradient buckets the backward did not (all of
 * them when this rank had nothing to train on), all-reduces the statistics and rewrites s
 * with the global ones (loss, weight_sum, n_blocks, tau, accuracies). Blocks until every
 * collective of the step completed. */
cm_status dt_dp_reduce(dt_dp *dp, dt_step_stats *s);

/* The model's gradient hook (dt_grad_hook; installed by dt_dp_create). */
cm_status dt_dp_grad_hook(void *user, size_t off, double weight_sum);

#ifdef __cplusplus
}
#endif
#endif /* DT_DP_H */
