/* target-server/ts_serve_int.h — what the files of `serve` share (ts_serve.c the hidden-state
 * serving, ts_serve_decode.c the decoding endpoint): the replicas' state. */
#ifndef TS_SERVE_INT_H
#define TS_SERVE_INT_H

#include <stdatomic.h>

#include "cm_chan.h"
#include "kn_backend.h"
#include "ts_decode.h"
#include "ts_model.h"
#include "ts_serve.h"
#include "ts_split.h"
#ifdef TANDEM_HAVE_CUDA
#include "ts_stage.h"
#endif

typedef struct ts_serve_decode ts_serve_decode;

/* What one replica's worker thread owns: backend, context and model on its GPU. */
typedef struct serve_state {
    const ts_serve_args *a;
    int               index, gpu;
    cm_chan_job      *job; /* the job being computed (its streamed tensors' waits read it) */
    const kn_backend *be;
    kn_ctx           *ctx;
    ts_model         *model;    /* one context (--stages 1) */
    ts_split         *split;    /* or the replica's stages (--stages N > 1; ctx is stage 0's) */
    kn_ctx           *sctx[TS_SPLIT_MAX_STAGES];
    int              *order;  /* request index of the k-th smallest layer id */
    int              *layers; /* sorted layer ids */
    float           **outs;
    int               cap_layers;
    float           **devs;     /* cuda answers: per request position, T·D floats in device memory */
    float           **dev_sorted;
    int64_t           dev_elems; /* capacity of each devs[i] */
#ifdef TANDEM_HAVE_CUDA
    ts_stage         *stage; /* ZeroMQ answers on cuda: rounded and checked on the GPU */
#endif
    atomic_int        loaded;   /* the worker has loaded the model (STATUS reads it on the loop thread) */
    atomic_int        load_ms;
    ts_decoder       *decoder;  /* replica 0 with decoding on: made on the worker at its first step */
} serve_state;

/* The replicas, and what STATUS reads on the loop thread. */
typedef struct serve_all {
    const ts_serve_args    *a;
    const cm_target_cfg *cfg;
    serve_state         *reps;
    int                  n;
    ts_serve_decode     *dec; /* the decoding endpoint, or NULL (--decode-seqs 0) */
} serve_all;


/* Starts the decoding endpoint (--decode-bind, or one derived from --bind): its steps run on
 * replica 0's worker through cm_chan_server_call, against that replica's model and decoder. */
cm_status   ts_serve_decode_start(ts_serve_decode **out, cm_chan_server *srv, serve_all *all);
const char *ts_serve_decode_endpoint(const ts_serve_decode *d);
/* Stops the endpoint; the decoder itself goes with its replica (ts_serve_decode_fini). */
void        ts_serve_decode_stop(ts_serve_decode **d);
/* On the replica's worker, before its model goes: frees the decoder. */
void        ts_serve_decode_fini(serve_state *s);

#endif /* TS_SERVE_INT_H */
