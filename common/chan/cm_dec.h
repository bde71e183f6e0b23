/* common/chan/cm_dec.h — the decoding endpoint: DECODE frames (cm_proto.h) from clients such as
 * `drafter-trainer eval` to a target-server, answered one at a time, over a ZeroMQ ROUTER of its
 * own beside the hidden-state channel (cm_chan.h). A decoding step changes the server's state
 * (the sequence's caches), so unlike a hidden-state REQUEST it is never sent twice: a client
 * that loses an answer fails the step, and its sequences are gone once the server has not heard
 * from it for idle_timeout_ms (the server then calls drop). The same endpoint rules as cm_chan's:
 * loopback or ipc:// without CURVE keys; with them, any endpoint. */
#ifndef CM_DEC_H
#define CM_DEC_H

#include <stddef.h>
#include <stdint.h>

#include "cm_proto.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

// ----------------------------------------------------------------------------
// server

typedef struct cm_dec_server cm_dec_server;

/* Runs on the server's thread for each well-formed DECODE of a client (client: a printable name
 * of its ZeroMQ routing identity, stable while it stays connected). It fills ans->tensors (room
 * for ans->cap_tensors) and ans->n_tensors: descriptors with encoding raw and data the callback
 * owns until its next call; the server checksums, compresses (as rq->encoding asks) and sends
 * them. CM_ERR_INVALID_ARG becomes an ERROR bad-request, any other failure an ERROR internal
 * (message: cm_last_error()). */
typedef cm_status (*cm_dec_step_fn)(void *user, const char *client, const cm_proto_decode *rq, cm_proto_answer *ans);
/* The client has sent nothing for idle_timeout_ms (or the server stops): forget its sequences. */
typedef void (*cm_dec_drop_fn)(void *user, const char *client);

typedef struct cm_dec_server_config {
    const char     *endpoint;          /* bind: tcp://127.0.0.1:PORT (PORT may be '*'), ipc://PATH */
    const char     *curve_secret_key;  /* as cm_chan_server_config */
    const char     *curve_client_keys;
    cm_proto_limits limits;            /* what a DECODE may hold */
    uint32_t        max_clients;       /* clients with state at once; one more is refused (busy) */
    int             idle_timeout_ms;   /* a silent client's sequences are dropped after this long */
    int             n_threads;         /* compression threads */
    int             zstd_level;
    cm_dec_step_fn  step;              /* required */
    cm_dec_drop_fn  drop;              /* optional */
    void           *user;
} cm_dec_server_config;

/* Checks the config, binds and starts the server's thread. CM_ERR_INVALID_ARG, CM_ERR_ZMQ, ... */
cm_status   cm_dec_server_start(cm_dec_server **out, const cm_dec_server_config *cfg);
/* The bound endpoint with the port resolved. */
const char *cm_dec_server_endpoint(const cm_dec_server *s);
/* Stops the thread (the step in progress finishes), calls drop for every client, unbinds. NULL-safe. */
void        cm_dec_server_stop(cm_dec_server **s);

// ----------------------------------------------------------------------------
// client (one owner thread)

typedef struct cm_dec_client cm_dec_client;

typedef struct cm_dec_client_config {
    const char *endpoint;         /* the server's decoding endpoint */
    const char *curve_server_key; /* file with the server's public key; NULL = no CURVE */
    const char *curve_secret_key; /* file with this client's secret key; NULL = a fresh pair */
    int         timeout_ms;       /* no answer this long: the step fails with CM_ERR_TIMEOUT */
    cm_proto_limits limits;       /* what an answer may hold */
} cm_dec_client_config;

cm_status cm_dec_client_create(cm_dec_client **out, const cm_dec_client_config *cfg);
/* Sends one DECODE (rq->id is set by the client) and waits for its answer: ans->tensors (room for
 * ans->cap_tensors) point at decoded, aligned copies the client owns until its next step. An
 * ERROR from the server comes back as CM_ERR_INVALID_ARG (bad-request) or CM_ERR_PEER_GONE and
 * others, with the server's message. */
cm_status cm_dec_client_step(cm_dec_client *c, cm_proto_decode *rq, cm_proto_answer *ans);
void      cm_dec_client_destroy(cm_dec_client **c); /* NULL-safe */

#ifdef __cplusplus
}
#endif
#endif /* CM_DEC_H */
