/* drafter-trainer/feed/dt_feed.c — the batch feed of dt_feed.h: the data list or dataset, the one
 * dt_data over it, and the shard or live source its loads take target_hidden from. */
#include "dt_feed.h"

#include <stdlib.h>

struct dt_feed {
    char           **paths;  /* the --data / --data-dir / --dataset list */
    int              n_paths;
    dt_dataset      *ds;     /* --dataset: the packed documents behind data */
    dt_data         *data;   /* the one token reader */
    dt_shard_source *shards; /* --shards */
    dt_live         *live;   /* --server: borrows data */
};

/* The dt_data over the list or the dataset, with target_hidden from src (NULL: from the batch
 * files when n_taps > 0, else token batches only). */
static cm_status open_data(dt_feed *f, const dt_feed_config *c, int n_taps, const dt_hidden_source *src) {
    const char *const *paths = (const char *const *)f->paths;
    if (f->ds)
        CM_TRY(dt_data_open_dataset(&f->data, f->ds, n_taps, n_taps ? c->hidden : 0, src));
    else if (src || !n_taps)
        CM_TRY(dt_data_open_source(&f->data, paths, f->n_paths, n_taps, n_taps ? c->hidden : 0, c->vocab_size, src));
    else
        CM_TRY(dt_data_open(&f->data, paths, f->n_paths, n_taps, c->hidden, c->vocab_size));
    return dt_data_set_dp(f->data, c->dp_rank, c->dp_size);
}

static cm_status feed_open(dt_feed *f, const dt_feed_config *c) {
    if (c->dataset) {
        CM_TRY(dt_data_split_list(c->dataset, &f->paths, &f->n_paths));
        CM_TRY(dt_dataset_open(&f->ds, (const char *const *)f->paths, f->n_paths, c->token_budget, c->vocab_size));
    } else if (c->data)
        CM_TRY(dt_data_split_list(c->data, &f->paths, &f->n_paths));
    else
        CM_TRY(dt_data_list_dir(c->data_dir, &f->paths, &f->n_paths));
    const int on_device = c->live && c->live->encoding == CM_ENCODING_NCCL;
    if (on_device && !c->on_cuda)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--encoding nccl puts hidden states in GPU memory; it needs --device cuda");
    if (c->live) { /* tokens only: each step takes its taps from dt_live_get_taps */
        CM_TRY(open_data(f, c, 0, NULL));
        dt_live_config lc = *c->live;
        lc.layer_ids = c->layer_ids;
        lc.n_taps = c->n_taps;
        lc.hidden = c->hidden;
        lc.vocab_size = c->vocab_size;
        lc.target_id = c->target_id;
        lc.weights_id = c->weights_id;
        return dt_live_open(&f->live, &lc, f->data);
    }
    if (c->shards) {
        CM_TRY(dt_shard_source_open(&f->shards, c->shards, c->layer_ids, c->n_taps, c->hidden, c->target_id,
                                    c->weights_id));
        const dt_hidden_source hs = dt_shard_source_hidden(f->shards);
        return open_data(f, c, c->n_taps, &hs);
    }
    return open_data(f, c, c->n_taps, NULL);
}

cm_status dt_feed_open(dt_feed **out, const dt_feed_config *cfg) {
    *out = NULL;
    dt_feed *f = calloc(1, sizeof *f);
    if (!f)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the batch feed");
    cm_status st = feed_open(f, cfg);
    if (st != CM_OK) {
        dt_feed_destroy(&f);
        return st;
    }
    *out = f;
    return CM_OK;
}

void dt_feed_destroy(dt_feed **fp) {
    if (!fp || !*fp)
        return;
    dt_feed *f = *fp;
    dt_live_destroy(&f->live); /* before the data it borrows */
    dt_data_destroy(&f->data);
    dt_shard_source_destroy(&f->shards);
    dt_dataset_destroy(&f->ds);
    dt_data_free_list(f->paths, f->n_paths);
    free(f);
    *fp = NULL;
}

dt_data *dt_feed_data(const dt_feed *f) {
    return f->data;
}
dt_shard_source *dt_feed_shards(const dt_feed *f) {
    return f->shards;
}
dt_live *dt_feed_live(const dt_feed *f) {
    return f->live;
}
int dt_feed_is_dataset(const dt_feed *f) {
    return f->ds != NULL;
}
