/* target-server/ts_serve.h — the serving of `target-server serve` (its command line is
 * cmd/ts_serve_cmd.c): loads the frozen target once and answers hidden-state requests from any
 * number of trainers over ZeroMQ (cm_chan) until SIGTERM or SIGINT, then finishes the forward in
 * progress and says BYE. */
#ifndef TS_SERVE_H
#define TS_SERVE_H

#include <stdint.h>

#include "cm_chan.h"
#include "kn_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TS_MAX_REPLICAS CM_CHAN_MAX_WORKERS

typedef struct ts_serve_args {
    const char  *model, *device, *bind, *name, *endpoint_file, *curve_secret, *curve_clients, *keygen;
    int          gpus[TS_MAX_REPLICAS], n_gpus, replicas; /* gpus: replica r's stage k on gpus[r·stages + k] */
    int          stages; /* pipeline stages per replica (ts_split.h): its layers over that many GPUs */
    int          threads, zstd_level, heartbeat_ms, peer_timeout_ms, stats_s;
    int          stream; /* cuda: compress layers while the forward runs (TANDEM_SERVE_STREAM=0: after it) */
    int          init_random;
    uint64_t     seed;
    int          credits, max_tokens, max_layers;
    /* decoding (ts_serve_decode.c): 0 sequences turns it off */
    const char  *decode_bind;
    int          decode_seqs, decode_max_len, decode_max_step, decode_idle_s;
    uint32_t     encodings;
    cm_dtype     dtype;
    kn_gemm_mode mode;
    int          fp8; /* FP8 weights (docs/fp8.md): ts_model_config.fp8; mode is then KN_GEMM_MODE_BF16 */
} ts_serve_args;

/* Serves until stopped by a signal; a failure to start or to serve comes back with its message
 * in cm_last_error(). Borrows a. */
cm_status ts_serve_run(const ts_serve_args *a);

#ifdef __cplusplus
}
#endif
#endif /* TS_SERVE_H */
