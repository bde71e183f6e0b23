/* drafter-trainer/cmd/dt_train_random.h — `train --target-init random`: the frozen embedding and
 * LM head drawn on the host's cores for a benchmark against a `serve --init random` target. */
#ifndef DT_TRAIN_RANDOM_H
#define DT_TRAIN_RANDOM_H

#include <stdint.h>

#include "cm_status.h"

/* Two BF16 [V, D] matrices (out[0] the embedding, out[1] the LM head; malloc'd, caller frees)
 * uniform in ±0.0346 (std 0.02, the checkpoints' scale). Each block of 256 rows has its own
 * random stream from (seed, matrix, block), so the values do not depend on the thread count. */
cm_status dt_random_frozen(uint64_t seed, int64_t V, int64_t D, uint16_t *out[2]);

#endif /* DT_TRAIN_RANDOM_H */
