/* target-server/ts_stage.h — the captured layers of an answer made ready on the GPU: each F32
 * [T, D] capture rounded to the hidden dtype (BF16, nearest even, or kept F32) into staging
 * memory on the device, checked there for NaN/Inf and for being all zeros (docs/architecture.md), and, for
 * answers over ZeroMQ, copied to the host in that dtype (half the bytes of F32, and no pass
 * over them on the CPU) layer by layer while the forward goes on (ts_stage_put). The NCCL
 * data path sends from staging memory of its own (ts_stage_round). Built with CUDA only;
 * worker thread only, except ts_stage_wait. */
#ifndef TS_STAGE_H
#define TS_STAGE_H

#include <stdint.h>

#include "cm_dtype.h"
#include "cm_status.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ts_stage ts_stage;

cm_status ts_stage_create(ts_stage **out, kn_ctx *ctx);
void      ts_stage_destroy(ts_stage **s); /* NULL-safe */

/* Rounds dev[i] (F32 [T, D], written on the context's stream) to dt into the stage, i < n ≤ 256,
 * and checks each: a capture holding NaN/Inf or nothing but zeros fails with CM_ERR_FORMAT
 * naming layers[i] and batch. Blocks until done; out[i] then points at layer i's T·D values
 * in device memory, valid until the next call. */
cm_status ts_stage_round(ts_stage *s, float *const *dev, const int32_t *layers, int n, int64_t T, int64_t D,
                         cm_dtype dt, uint64_t batch, const void **out);

/* Streamed answers over ZeroMQ: the staging memory for n layers of up to T·D values of dt,
 * made now (at start-up) so that ts_stage_put allocates nothing. */
cm_status ts_stage_reserve(ts_stage *s, int n, int64_t T, int64_t D, cm_dtype dt);

/* Rounds x (F32 [T, D], as the forward leaves it on the context's stream) to dt into slot
 * i < 256 and checks it, in order with the forward; then copies the slot to host (T·D values
 * of dt; page-locked memory makes this fast) on the stage's own stream, which waits for
 * nothing else, so the forward's next layers run meanwhile. Returns at once. */
cm_status ts_stage_put(ts_stage *s, int i, const float *x, int64_t T, int64_t D, cm_dtype dt, void *host);

/* Blocks until slot i's copy to the host is done (any thread), then gives the check's
 * verdict: CM_ERR_FORMAT naming layer and batch for a capture holding NaN/Inf or nothing but
 * zeros (docs/architecture.md). */
cm_status ts_stage_wait(ts_stage *s, int i, int layer, uint64_t batch);

#ifdef __cplusplus
}
#endif
#endif /* TS_STAGE_H */
