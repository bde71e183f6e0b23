/* drafter-trainer/feed/dt_data.h — training data from batch files: one packed batch per file.
 *
 * Batch file: a safetensors file holding (the `drafter-trainer grad` batch of docs/checks.md
 * without anchors; other tensors, e.g. anchors or embed_tokens, are ignored):
 *   input_ids      I32 [T]          token ids, each < the drafter's vocab_size, T ≥ 1
 *   cu_seqlens     I32 [N + 1]      document starts: 0 = c_0 < c_1 < ... < c_N = T, N ≥ 1
 *   loss_mask      I32 [T]          1 where the token is supervised, else 0
 *   target_hidden  BF16|F32 [T, n·D] the target's hidden states after each layer of
 *                                   target_layer_ids (n taps), concatenated in that order
 * Token batch files (precompute's input, and training with --shards) are the same without
 * target_hidden (a target_hidden present is ignored): hidden states come from elsewhere.
 * Every file is checked when the set is opened (tensors, dtypes, shapes, ids, cu_seqlens,
 * mask) and again when it is loaded (plus finite target_hidden); a bad file fails with one
 * message naming the file, the tensor and the fix.
 *
 * Epochs visit every file once in an order shuffled from (seed, epoch) only; the data cursor
 * is (epoch, index within the epoch). A file's position in the list is its batch id (the
 * anchor stream key). The set hash covers the list order, each file's name (not directory),
 * T, N and its ids/cu_seqlens/loss_mask bytes, so a resume can refuse different data.
 * A dt_data owns host buffers sized for the largest batch (allocated at open) and reuses
 * them for every load. One thread.
 *
 * Datasets (dt_dataset.h): a dt_data may instead serve the packs of a tokenized dataset
 * (dt_data_open_dataset): pack i is batch i, its hidden states come from a source (shards or
 * a live server), its hash is the dataset's (packing included).
 *
 * Data parallelism (either kind): rank r of W takes positions k·W + r of each epoch's order,
 * wrapping around to the start of the order when k·W + r ≥ count, so every rank runs the same
 * ceil(count / W) steps per epoch (torch's DistributedSampler pads the same way); the ranks
 * together visit every batch of the epoch, a few twice when W does not divide count. The
 * cursor (epoch, step within the epoch) is per rank and equal on every rank. With W > 1 the
 * hash also covers W, so a resume with another --dp-size is refused. */
#ifndef DT_DATA_H
#define DT_DATA_H

#include <stdint.h>

#include "cm_status.h"
#include "dt_dataset.h"
#include "dt_model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DT_DATA_STREAM 0x73687566666c65ULL /* "shuffle": domain of the epoch-order stream */

typedef struct dt_data dt_data;

/* Opens and checks the n_paths batch files for a drafter with n_taps taps of width hidden
 * and vocab_size tokens. paths are copied. Caller destroys with dt_data_destroy. */
cm_status dt_data_open(dt_data **out, const char *const *paths, int n_paths, int n_taps, int hidden,
                       int vocab_size);

/* Where the hidden states come from when not from the batch files (offline shards,
 * dt_shard_source.h): get writes tap k (target_layer_ids order) [T, hidden] into taps[k] (room
 * for T · hidden F32 values each) in the source's own dtype, BF16 or F32, which it stores in
 * *dt, for batch file `batch` (its position in the list, the batch id) whose tokens and
 * cu_seqlens are given. A failure (missing or damaged record, other tokens) stops the load with
 * its message. The batch then carries the taps as they are (dt_batch.host_taps): no widening. */
typedef struct dt_hidden_source {
    cm_status (*get)(void *self, int batch, const int32_t *input_ids, int64_t T, const int32_t *cu_seqlens,
                     int n_seq, void *const *taps, cm_dtype *dt);
    void *self;
} dt_hidden_source;

/* dt_data_open whose batches take target_hidden from src (borrowed; must outlive d): the files
 * then need only input_ids, cu_seqlens and loss_mask (any target_hidden in them is ignored).
 * With src NULL and n_taps = 0: token batches only (precompute's input), and dt_data_load
 * leaves b->target_hidden NULL. */
cm_status dt_data_open_source(dt_data **out, const char *const *paths, int n_paths, int n_taps, int hidden,
                              int vocab_size, const dt_hidden_source *src);
/* A dt_data over the packs of ds (borrowed; must outlive d; its ids were checked against the
 * vocabulary by dt_dataset_open). Batches take target_hidden from src (n_taps ≥ 1, hidden ≥ 1),
 * or, with src NULL and n_taps = 0, are token batches only. CM_ERR_INVALID_ARG naming --shards
 * and --server when taps are asked for without a source. */
cm_status dt_data_open_dataset(dt_data **out, const dt_dataset *ds, int n_taps, int hidden,
                               const dt_hidden_source *src);
void      dt_data_destroy(dt_data **d); /* NULL-safe; sets *d = NULL */

/* Lists DIR/ *.safetensors sorted by name into a malloc'd array of malloc'd strings (free with
 * dt_data_free_list). CM_ERR_IO if the directory cannot be read or holds no such file. */
cm_status dt_data_list_dir(const char *dir, char ***paths, int *n);
/* Splits "a,b,c" into a list as above (empty items refused). */
cm_status dt_data_split_list(const char *csv, char ***paths, int *n);
void      dt_data_free_list(char **paths, int n);

int         dt_data_count(const dt_data *d);
int64_t     dt_data_max_tokens(const dt_data *d); /* largest T over the files */
const char *dt_data_path(const dt_data *d, int i); /* batch file i, or the dataset's file list */
uint64_t    dt_data_hash(const dt_data *d);           /* covers the dp size when > 1 (above) */
uint64_t    dt_data_hash_dp(const dt_data *d, int dp_size); /* the hash under another dp size */

/* Makes this process rank `rank` of `size` data-parallel ranks (default 0 of 1).
 * CM_ERR_INVALID_ARG unless 0 ≤ rank < size. */
cm_status dt_data_set_dp(dt_data *d, int rank, int size);
int       dt_data_dp_rank(const dt_data *d);
int       dt_data_dp_size(const dt_data *d);
/* Steps of one epoch on every rank: ceil(count / dp size). */
int64_t   dt_data_steps_per_epoch(const dt_data *d);
/* The batch of this rank's step k (0 ≤ k < steps per epoch) of the epoch whose order
 * (dt_data_epoch_order) is order: order[(rank + k·size) mod count]. */
int32_t   dt_data_step_batch(const dt_data *d, const int32_t *order, int64_t k);

/* The files of epoch epoch in visiting order (a permutation of 0 .. count − 1 into order,
 * Fisher–Yates from cm_rng_seed_stream(seed ^ DT_DATA_STREAM, epoch, 0)). */
void dt_data_epoch_order(const dt_data *d, uint64_t seed, uint64_t epoch, int32_t *order);

/* Loads file i into the set's buffers and points b at them (target_hidden as F32, from the
 * file or the set's source; anchors NULL, n_anchors 0). b stays valid until the next load,
 * the load after a dt_data_prefetch, or destroy. */
cm_status dt_data_load(dt_data *d, int i, dt_batch *b);

/* Batch i's tokens only (input_ids, cu_seqlens, loss_mask, checked as dt_data_load checks them;
 * target_hidden NULL, no source asked), in a set of buffers of their own: for a hidden-state
 * source that reads ahead of the batch being loaded (dt_live.h), also from inside that load's
 * call of the source. b stays valid until the next dt_data_load_tokens or destroy. Not for use
 * while a dt_data_prefetch is in flight. */
cm_status dt_data_load_tokens(dt_data *d, int i, dt_batch *b);

/* Starts loading batch i on a thread while the caller still uses the batch of the last
 * dt_data_load (it stays valid: the thread fills a second set of buffers, allocated by the
 * first call). The next dt_data_load(d, i) waits for it and returns it (with the thread's
 * error, if it failed); a dt_data_load of another batch waits, drops it and loads as usual.
 * The set's source must not be used by the caller meanwhile (not for live sources). */
cm_status dt_data_prefetch(dt_data *d, int i);

/* Page-locks the set's host buffers of hidden states through pin (now, and the second set
 * when dt_data_prefetch makes it) and unlocks them through unpin at destroy, so uploads from
 * them run at the bus's speed (kn_backend host_pin). A failure to pin is logged and the
 * buffer stays pageable. */
typedef cm_status (*dt_pin_fn)(void *user, void *p, size_t bytes);
typedef void (*dt_unpin_fn)(void *user, void *p);
void dt_data_set_pinning(dt_data *d, dt_pin_fn pin, dt_unpin_fn unpin, void *user);

#ifdef __cplusplus
}
#endif
#endif /* DT_DATA_H */
