/* drafter-trainer/feed/dt_live.h — live hidden states (docs/architecture.md): `train --server ENDPOINT`
 * asks a running target-server for each batch's taps while it trains. A dt_live is backed by
 * one cm_chan client per server; it keeps up to `credits` requests in flight AHEAD of the step
 * being trained (the next batches of the epoch order, whose tokens it reads from the training
 * data itself with dt_data_load_tokens), so the trainer does not wait when the server is fast
 * enough. Request ids are step + 1 (unique for the run; a resume starts at the cursor); a batch
 * asked for out of the planned order gets an id from a separate counter. The trainer takes each
 * batch's taps with dt_live_get_taps, as the server sent them (BF16 by default; checked for
 * NaN/Inf and all-zero taps by the client on arrival), and gives them back with dt_live_release
 * after its step: no widening or copy on the host, the model uploads each tap once. A lost
 * server is the client's business (reconnect, re-send); an answer that does not come within
 * timeout_ms fails the step with a message naming the endpoint. One thread.
 *
 * With encoding nccl (CM_ENCODING_NCCL; builds with NCCL only) the answers travel GPU to GPU
 * into the trainer's device `device` (cm_nccl_client, one device buffer per credit) and the
 * taps are device pointers: no host copy at all. */
#ifndef DT_LIVE_H
#define DT_LIVE_H

#include <signal.h>
#include <stdint.h>

#include "cm_chan.h"
#include "cm_proto.h"
#include "cm_status.h"
#include "dt_data.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dt_live dt_live;

typedef struct dt_live_config {
    const char *endpoint;   /* tcp://HOST:PORT or ipc://PATH of target-server serve; several comma-separated:
                               one client each, step s served by server s mod n, all of one target */
    const char *name;       /* this trainer's name in the server's logs */
    int         credits;    /* requests in flight ahead of training (≥ 1) */
    cm_encoding encoding;   /* answers' encoding asked for */
    int         timeout_ms; /* longest wait for the server at connect and for one answer */
    const int  *layer_ids;  /* [n_taps] the drafter's target_layer_ids (distinct) */
    int         n_taps, hidden;
    int         vocab_size; /* of the drafter (ids are checked by the data given to open) */
    uint64_t    target_id;  /* cm_target_cfg_hash of the trainer's --target (0: not checked) */
    uint64_t    weights_id; /* its weights fingerprint (cm_weights_id; 0: not checked) */
    const char *curve_server_key, *curve_secret_key; /* CURVE key files (NULL: loopback, or a fresh pair) */
    int         device;     /* encoding nccl: the cuda device the answers land on */
    /* Optional: page-lock the clients' answer buffers (cm_chan_client_config's host_lock), so
     * that a step's upload of its taps runs at the bus's speed. */
    cm_status (*host_lock)(void *user, void *p, size_t bytes);
    void (*host_unlock)(void *user, void *p);
    void *host_user;
} dt_live_config;

/* Borrows data (must outlive the source): the token-only training data, with its data-parallel
 * rank and size set; the requests ahead take their tokens from it (dt_data_load_tokens).
 * Connects and waits for the server's WELCOME, then checks it: weights fingerprint and config
 * hash equal to weights_id and target_id, hidden size equal to hidden, every layer id < the
 * server's n_layers, the largest batch ≤ its max_tokens; CM_ERR_INVALID_ARG naming the
 * difference and the fix, CM_ERR_TIMEOUT when no server answered. Caller destroys. */
cm_status dt_live_open(dt_live **out, const dt_live_config *cfg, dt_data *data);

#define DT_CONNECT_PROGRESS_MS 5000 /* a "still connecting" line this often while no WELCOME came */

/* Waits up to timeout_ms for cl's session with the server at endpoint and copies its WELCOME
 * into out (may be NULL), logging a warning every DT_CONNECT_PROGRESS_MS while none has come
 * (the endpoint, the time so far, the deadline, the last connection problem and a hint), so a
 * trainer started before its server (or pointed at the wrong one) says what it waits for.
 * CM_ERR_TIMEOUT at the deadline, or as soon as *stop (may be NULL) is nonzero, with the last
 * problem in cm_last_error(); a refusal's status otherwise (cm_chan_client_wait_ready). */
cm_status dt_live_connect(cm_chan_client *cl, const char *endpoint, int64_t timeout_ms,
                          const volatile sig_atomic_t *stop, cm_proto_welcome *out);
void      dt_live_destroy(dt_live **l); /* NULL-safe; sets *l = NULL */

/* The plan: steps start .. end − 1 of the run, epoch e = step / dt_data_steps_per_epoch
 * visiting dt_data_step_batch of dt_data_epoch_order(seed, e). get() for the planned batch of the next step uses (and tops
 * up) the prefetched requests. */
void dt_live_plan(dt_live *l, uint64_t seed, int64_t start, int64_t end);

/* Batch b (loaded by the token-only training data in plan order; its ids and cu_seqlens are
 * checked against the request's) gets its taps: b->target_hidden = NULL, b->taps_dt the
 * server's dtype, and per tap (target_layer_ids order) b->host_taps[k] (host memory; dev_taps
 * NULL) or, with encoding nccl, b->dev_taps[k] (device memory; host_taps NULL). The answer stays
 * held, its memory untouched, until dt_live_release; one batch at a time. */
cm_status dt_live_get_taps(dt_live *l, int batch, dt_batch *b);
void      dt_live_release(dt_live *l); /* no-op when nothing is held */

#ifdef __cplusplus
}
#endif
#endif /* DT_LIVE_H */
