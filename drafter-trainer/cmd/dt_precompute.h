/* drafter-trainer/cmd/dt_precompute.h — offline hidden states (docs/architecture.md): `precompute` asks
 * a running target-server for the hidden states of every token batch file and stores the
 * ANSWER frames, as received, in a shard directory (common/cm_shard.h); training with
 * `--shards DIR` then reads target_hidden from those records instead of from the batch files.
 *
 * Input: token batch files (dt_data.h without target_hidden: input_ids, cu_seqlens, loss_mask;
 * any target_hidden in them is ignored). The batch id of a file is its index in the sorted data
 * list (--data in the order given, --data-dir sorted by name), so a restarted precompute, and
 * the trainer, use the same ids; each record also holds cm_shard_batch_hash of its tokens, so
 * shards used with other data are refused. With --dataset (dt_dataset.h) the batches are the
 * dataset's packs at --token-budget, pack i being batch id i, exactly as train packs them. The
 * store's identity is the WELCOME's config hash and weights fingerprint, the target's
 * name, hidden size and dtype, the requested layers and the encoding. */
#ifndef DT_PRECOMPUTE_H
#define DT_PRECOMPUTE_H

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
 * hash), decoded and verified, its tensors concatenated per token in layer_ids order as F32.
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
#endif /* DT_PRECOMPUTE_H */
