/* drafter-trainer/feed/dt_feed.h — the one batch feed of `train`: where a batch's tokens meet its
 * hidden states. The tokens come from batch files (--data, --data-dir) or from the packs of a
 * tokenized dataset (--dataset, dt_dataset.h), read by a single dt_data (dt_data.h); target_hidden
 * from the batch files themselves, from precomputed shards (--shards, dt_shard_source.h) or live
 * from target-servers (--server, dt_live.h). A live source reads the tokens of the steps ahead
 * (its requests) from that same dt_data (dt_data_load_tokens), so every token the run sees is
 * read and checked by one reader; the dt_data is then token-only and each step takes its taps
 * from dt_live_get_taps. The feed owns all of them. One thread. */
#ifndef DT_FEED_H
#define DT_FEED_H

#include <stdint.h>

#include "cm_status.h"
#include "dt_data.h"
#include "dt_live.h"
#include "dt_shard_source.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_feed dt_feed;

typedef struct dt_feed_config {
    const char           *data, *data_dir, *dataset; /* one of them: --data, --data-dir, --dataset */
    int64_t               token_budget;              /* tokens per pack of a dataset */
    const char           *shards;                    /* --shards DIR, or NULL */
    const dt_live_config *live;                      /* --server and its settings, or NULL; its taps,
                                                        sizes and ids are taken from below */
    const int            *layer_ids;                 /* [n_taps] the drafter's target_layer_ids */
    int                   n_taps, hidden, vocab_size;
    uint64_t              target_id, weights_id; /* of --target, for the shards' and servers' checks */
    int                   dp_rank, dp_size;      /* this process's data-parallel share */
    int                   on_cuda;               /* the backend is cuda (encoding nccl needs it) */
} dt_feed_config;

/* Opens the data and its hidden-state source and makes the data this rank's share; each
 * part's errors as its open gives them (dt_data, dt_dataset, dt_shard_source, dt_live).
 * Caller destroys. */
cm_status dt_feed_open(dt_feed **out, const dt_feed_config *cfg);
void      dt_feed_destroy(dt_feed **f); /* NULL-safe; sets *f = NULL */

dt_data         *dt_feed_data(const dt_feed *f);       /* the batches (dt_data_load) */
dt_shard_source *dt_feed_shards(const dt_feed *f);     /* --shards, else NULL */
dt_live         *dt_feed_live(const dt_feed *f);       /* --server, else NULL */
int              dt_feed_is_dataset(const dt_feed *f); /* 1: the batches are a dataset's packs */

#ifdef __cplusplus
}
#endif
#endif /* DT_FEED_H */
