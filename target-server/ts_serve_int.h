/* target-server/ts_serve_int.h — what the files of `serve` share (ts_serve.c the hidden-state
 * serving, ts_serve_decode.c the decoding endpoint): the replicas' state. */
#ifndef TS_SERVE_INT_H
#define TS_SERVE_INT_H

#include <pthread.h>
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
    int               index, gpu; /* the worker, its (first) GPU */
    int               replica;
    cm_chan_job      *job; /* the job being computed (its streamed tensors' waits read it) */
    const kn_backend *be;
    kn_ctx           *ctx;
    ts_model         *model;    /* one context (--stages 1) */
    /* --stages N > 1: the replica's stages, shared by its N workers (ts_serve_split.c); ctx is
     * stage 0's; ho this worker's hand-over between stages */
    struct serve_split *shared;
    ts_split           *split;
    ts_split_handover  *ho;
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

/* A replica split over stages, loaded by the first of its workers and used by all of them, so
 * that up to one pack per stage is in flight (ts_serve_split.c). */
typedef struct serve_split {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             state; /* 0 not loaded, 1 loading, 2 loaded, -1 failed */
    int             users; /* workers holding it */
    int             replica;
    cm_status       st;
    char            why[512];
    ts_split       *split;
    kn_ctx         *ctx[TS_SPLIT_MAX_STAGES];
} serve_split;

/* The workers (one per replica, or one per stage of each split replica), and what STATUS reads
 * on the loop thread. */
typedef struct serve_all {
    const ts_serve_args    *a;
    const cm_target_cfg *cfg;
    serve_state         *reps; /* the workers' states */
    int                  n;    /* workers */
    serve_split         *splits; /* [replicas] with --stages > 1, else NULL */
    ts_serve_decode     *dec; /* the decoding endpoint, or NULL (--decode-seqs 0) */
} serve_all;


/* ts_serve_split.c: a split replica's worker takes its share of the replica (the first one loads
 * it on mc's settings, the others wait for it), leaves it (the last one frees it), and answers a
 * request through host memory with its own hand-over buffer. */
cm_status ts_serve_split_init(serve_state *s, const ts_model_config *mc);
void      ts_serve_split_fini(serve_state *s);
cm_status ts_serve_split_forward(serve_state *s, const cm_proto_request *r, const ts_capture *cap);

/* Starts the decoding endpoint (--decode-bind, or one derived from --bind): its steps run on
 * replica 0's worker through cm_chan_server_call, against that replica's model and decoder. */
cm_status   ts_serve_decode_start(ts_serve_decode **out, cm_chan_server *srv, serve_all *all);
const char *ts_serve_decode_endpoint(const ts_serve_decode *d);
/* Stops the endpoint; the decoder itself goes with its replica (ts_serve_decode_fini). */
void        ts_serve_decode_stop(ts_serve_decode **d);
/* On the replica's worker, before its model goes: frees the decoder. */
void        ts_serve_decode_fini(serve_state *s);

#endif /* TS_SERVE_INT_H */
