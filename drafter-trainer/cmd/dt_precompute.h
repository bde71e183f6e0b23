/* drafter-trainer/cmd/dt_precompute.h — offline hidden states (docs/architecture.md): `precompute` asks
 * a running target-server for the hidden states of every token batch file and stores the
 * ANSWER frames, as received, in a shard directory (common/format/cm_shard.h); training with
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

/* Nothing to declare: the command is dt_cmd_precompute (dt_cmd.h), and the trainer reads the
 * store through feed/dt_shard_source.h. */

#endif /* DT_PRECOMPUTE_H */
