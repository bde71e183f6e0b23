/* drafter-trainer/feed/dt_shard_source.h — hidden states from a shard directory (common/format/cm_shard.h)
 * that `drafter-trainer precompute` wrote (dt_precompute.h: the store, its batch ids and
 * identity): the dt_hidden_source of `train --shards DIR`. */
#ifndef DT_SHARD_SOURCE_H
#define DT_SHARD_SOURCE_H

#include <stdint.h>

#include "cm_status.h"
#include "dt_data.h"

#ifdef __cplusplus
extern "C" {
#endif

/* target_hidden from a shard directory, for dt_data_open_source. */
typedef struct dt_shard_source dt_shard_source;

/* Opens dir (cm_shard_reader_open) and checks it against the drafter: the store's hidden size
 * must be hidden, it must hold every layer of layer_ids[n_taps] (the drafter's
 * target_layer_ids, in any answer order), and come from that target: config hash target_id
 * (cm_target_cfg_hash of the trainer's target config) and weights fingerprint weights_id,
 * each checked when ≠ 0 (a store that records no fingerprint, format 1, is let through with
 * a warning). CM_ERR_INVALID_ARG naming the difference and the fix; the reader's errors
 * otherwise. Caller destroys. */
cm_status dt_shard_source_open(dt_shard_source **out, const char *dir, const int *layer_ids, int n_taps,
                               int hidden, uint64_t target_id, uint64_t weights_id);
void      dt_shard_source_destroy(dt_shard_source **s); /* NULL-safe; sets *s = NULL */

/* The source's dt_hidden_source: batch i's record (batch id i, checked against the tokens'
 * hash), each tap decoded straight into its array in layer_ids order, in the stored dtype
 * (BF16 or F32), on cm_chan_default_threads() threads.
 * A missing record, a record for other tokens or a damaged one fails with CM_ERR_FORMAT or
 * CM_ERR_INVALID_ARG naming the batch: it is never trained on. */
dt_hidden_source dt_shard_source_hidden(dt_shard_source *s);

/* Checks, before training, the records of the batches marked in reads[n_batches] (nonzero =
 * this run reads batch i): each is stored, and its record header and payload checksum hold
 * (cm_shard_reader_at), so that a damaged store stops the run before its first step instead of
 * at the batch. n_threads threads read the records in index order (front to back in each
 * shard); the cost is one read of those bytes, logged as "shards: N records, X GB verified in
 * Y s = Z GB/s". CM_ERR_FORMAT naming the first bad record (shard file, offset, batch) and the
 * repair (the reader's message), or the first missing batch. */
cm_status dt_shard_source_verify(dt_shard_source *s, const uint8_t *reads, int n_batches, int n_threads);

#ifdef __cplusplus
}
#endif
#endif /* DT_SHARD_SOURCE_H */
