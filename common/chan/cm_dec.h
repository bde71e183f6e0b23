/* common/chan/cm_dec.h — the decoding endpoint: DECODE frames (cm_proto.h) from clients such as
 * `drafter-trainer eval` to a target-server, answered one at a time, over a ZeroMQ ROUTER of its
 * own beside the hidden-state channel (cm_chan.h). A decoding step changes the server's state
 * (the sequence's caches), so unlike a hidden-state REQUEST it is never sent twice: a client
 * that loses an answer fails the step, and its sequences are gone once the server has not heard
 * from it for idle_timeout_ms (the server then calls drop). The same endpoint rules as cm_chan's:
 * loopback or ipc:// without CURVE keys; with them, any endpoint.
 *
 * Transport. No HELLO, no session, no credits: client → server, one ZeroMQ part per DECODE
 * frame; server → client, one part per reply: an ANSWER as one whole frame (HEAD and DATA
 * together, the tensors encoded straight into the message after the head's place) or an ERROR,
 * both with the step's id. Any other shape is refused. The server answers an ERROR
 *   bad-request  the step callback refused the step (CM_ERR_INVALID_ARG), or the step has more
 *                sequences, tokens or layers than limits allow, or a layer id ≥ limits.max_layer_id,
 *                or the frame is well formed but not a DECODE
 *   corrupt      the frame fails its checks (cm_proto_decode_decode's message)
 *   version      the frame speaks another protocol version (id 0)
 *   busy         a new client while max_clients clients have state
 *   internal     the step callback failed otherwise, or its tensors could not be encoded (then
 *                the step has run: the next step's base tells the client)
 *   shutdown     the server stopped with the DECODE unanswered
 * Before the callback runs nothing changes on the server; the callback must keep its own
 * failures from changing anything (cm_proto.h: a failed step changes nothing).
 *
 * Clients. The server knows a client by its ZeroMQ routing identity and names it for the
 * callbacks: the identity itself when it is 1 to 64 bytes of [A-Za-z0-9_.-] (cm_dec_client sets
 * "dec-" and 16 hex digits, so a reconnect keeps its sequences), else '#' and its bytes in hex.
 * A client has state from its first well-formed DECODE until it has been silent (no message
 * received, no answer sent) for idle_timeout_ms: then drop is called.
 *
 * Threads. The server's thread runs step and drop, one call at a time. A step that needs a model
 * replica owned by a cm_chan worker reaches it with cm_chan_server_call (cm_chan.h), which blocks
 * the step until that worker is between jobs; stop the decoding endpoint before the cm_chan
 * server is destroyed. */
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

/* Runs on the server's thread for each well-formed DECODE of a client (client: its name, see
 * above; stable while it stays connected), one step at a time. It fills ans->tensors (room for
 * ans->cap_tensors = limits.max_layers + 1) and ans->n_tensors (ans->batch_id is the step's id):
 * descriptors with encoding raw, encoded_size = raw_size, and data the callback owns until its
 * next call (or drop's); the server checks them (names, dims, sizes), checksums, encodes each
 * tensor as rq->encoding asks and sends them (cm_proto.h, DECODE, says which tensors). rq and its
 * arrays are the server's, valid during the call. CM_ERR_INVALID_ARG becomes an ERROR
 * bad-request, any other failure an ERROR internal (message: cm_last_error()). */
typedef cm_status (*cm_dec_step_fn)(void *user, const char *client, const cm_proto_decode *rq,
                                    cm_proto_answer *ans);
/* The client has been silent for idle_timeout_ms (or the server stops): forget its sequences.
 * On the server's thread, never during a step. */
typedef void (*cm_dec_drop_fn)(void *user, const char *client);

typedef struct cm_dec_server_config {
    const char     *endpoint;          /* bind: tcp://127.0.0.1:PORT (PORT may be '*'), ipc://PATH */
    const char     *curve_secret_key;  /* as cm_chan_server_config */
    const char     *curve_client_keys;
    cm_proto_limits limits;            /* what a DECODE may hold: max_seqs, max_tokens, max_layers (the
                                          server's arrays, allocated at start) and max_layer_id; the
                                          other fields are not used (the body's bound follows) */
    uint32_t        max_clients;       /* clients with state at once (1 .. 4096); one more is refused (busy) */
    int             idle_timeout_ms;   /* a silent client's sequences are dropped after this long (≥ 10) */
    int             n_threads;         /* compression threads (0 = 1) */
    int             zstd_level;        /* as cm_compress_config.level (0: zstd's default) */
    cm_dec_step_fn  step;              /* required */
    cm_dec_drop_fn  drop;              /* optional */
    void           *user;
} cm_dec_server_config;

/* Checks the config (CM_ERR_INVALID_ARG naming the field; the endpoint as cm_chan_server_create
 * does), allocates the step's arrays, binds and starts the server's thread. CM_ERR_INVALID_ARG,
 * CM_ERR_UNSUPPORTED (CURVE), CM_ERR_IO/FORMAT (keys), CM_ERR_ZMQ (bind), CM_ERR_NOMEM. Caller
 * stops it with cm_dec_server_stop. */
cm_status   cm_dec_server_start(cm_dec_server **out, const cm_dec_server_config *cfg);
/* The bound endpoint with the port resolved; owned by s. */
const char *cm_dec_server_endpoint(const cm_dec_server *s);
/* Stops the thread (the step in progress finishes), answers the DECODEs still waiting with ERROR
 * shutdown, calls drop for every client (on the server's thread), unbinds and frees. NULL-safe;
 * sets *s = NULL. */
void        cm_dec_server_stop(cm_dec_server **s);

// ----------------------------------------------------------------------------
// client (one owner thread)

typedef struct cm_dec_client cm_dec_client;

typedef struct cm_dec_client_config {
    const char *endpoint;         /* the server's decoding endpoint */
    const char *curve_server_key; /* file with the server's public key; NULL = no CURVE */
    const char *curve_secret_key; /* file with this client's secret key; NULL = a fresh pair */
    int         timeout_ms;       /* no answer this long: the step fails with CM_ERR_TIMEOUT (≥ 1) */
    cm_proto_limits limits;       /* what an answer may hold (max_tensors ≥ 1 + the most layers asked
                                     for, max_tensor_bytes, max_data_bytes, max_body_bytes) */
} cm_dec_client_config;

/* Checks the config, makes the socket and connects (without waiting for the server, which may
 * come later). CM_ERR_INVALID_ARG (a non-loopback endpoint needs curve_server_key), CURVE key
 * errors as cm_chan's, CM_ERR_ZMQ. Caller destroys with cm_dec_client_destroy. */
cm_status cm_dec_client_create(cm_dec_client **out, const cm_dec_client_config *cfg);
/* Sends one DECODE (rq->id is set by the client: a counter) and waits up to timeout_ms for its
 * answer, never sending it again: after CM_ERR_TIMEOUT the step may or may not have run on the
 * server (the next step's base tells), and the client starts a fresh connection (same identity)
 * so that nothing of it arrives late. A reply with another id (a timed-out step's) is discarded.
 * The answer is checked (checksums, then against rq: "decode" I32 [N, 4] first, a handle per
 * sequence (its own, or a new one ≠ 0), on STEP 0 ≤ a ≤ n_draft, committed = base + n_ctx + a, a
 * next token ≥ 0, then "layer_<id>" per layer id in order, 2-D, Σ (n_ctx + a) rows; on CLOSE the
 * "decode" tensor alone; every tensor in rq->encoding) and decoded: ans->tensors (room for
 * ans->cap_tensors) get the descriptors with encoding raw, encoded_size = raw_size, checksum 0 and
 * data pointing at decoded copies, each 64-byte aligned, that the client owns until its next step.
 * Returns CM_ERR_INVALID_ARG for a malformed rq (nothing sent) or an ERROR bad-request,
 * CM_ERR_PROTOCOL for an answer that fails its checks or an ERROR corrupt or version,
 * CM_ERR_PEER_GONE for an ERROR busy, internal or shutdown, CM_ERR_TIMEOUT; an ERROR's message
 * (with its code) is in cm_last_error(). */
cm_status cm_dec_client_step(cm_dec_client *c, cm_proto_decode *rq, cm_proto_answer *ans);
void      cm_dec_client_destroy(cm_dec_client **c); /* NULL-safe */

#ifdef __cplusplus
}
#endif
#endif /* CM_DEC_H */
