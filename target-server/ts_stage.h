/* target-server/ts_stage.h — the captured layers of an answer made ready on the GPU: each F32
 * [T, D] capture rounded to the hidden dtype (BF16, nearest even, or kept F32) into staging
 * memory on the device, checked there for NaN/Inf and for being all zeros (DESIGN §9), and, for
 * answers over ZeroMQ, copied to the host in that dtype (half the bytes of F32, and no pass
 * over them on the CPU). The NCCL data path sends from the same staging memory. Built with
 * CUDA only; worker thread only. */
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

/* ts_stage_round, then each layer copied to host[i] (T·D values of dt). */
cm_status ts_stage_download(ts_stage *s, float *const *dev, const int32_t *layers, int n, int64_t T, int64_t D,
                            cm_dtype dt, uint64_t batch, void *const *host);

#ifdef __cplusplus
}
#endif
#endif /* TS_STAGE_H */
