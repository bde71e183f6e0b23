/* common/chan/cm_chan.h — ZeroMQ sessions between drafter-trainers and the target-server over the
 * cm_proto wire format (docs/formats.md, docs/architecture.md). The server is a ROUTER that answers REQUESTs with the
 * captured hidden states of exactly that request; each trainer is a DEALER with its own
 * routing identity. Requests are idempotent: a lost, late or corrupted answer is asked for
 * again under the same batch id, and an answer for an id the client no longer waits for is
 * dropped, so no batch is ever delivered twice. Credits bound memory on both sides.
 *
 * Threads. cm_chan_server_run() runs the session loop on the caller's thread (it owns the
 * socket) and one worker thread that runs the compute callbacks, converts and compresses:
 * one forward at a time, round-robin over the sessions that have queued requests. A
 * cm_chan_client owns a background I/O thread (socket, heartbeats, reconnects, re-sends,
 * decompression of answers ahead of time); its API is for one owner thread.
 *
 * Transport. Trainer → server: one ZeroMQ part per cm_proto frame. Server → trainer: one part,
 * except ANSWER: two parts, HEAD (header + descriptors) and DATA (the tensors' encoded bytes;
 * sent zero-copy). Any other shape is refused as a protocol error.
 *
 * Security. The server binds loopback (tcp://127.0.0.1 or tcp://[::1]; trainers may also
 * connect to tcp://localhost) or ipc:// unless CURVE keys are configured: a secret key for the
 * server and a directory of the client public keys it accepts (checked by a ZAP handler). Key files are Z85 text (40
 * characters on the first line that is not a '#' comment); secret keys are never logged. */
#ifndef CM_CHAN_H
#define CM_CHAN_H

#include <stddef.h>
#include <stdint.h>

#include "cm_dtype.h"
#include "cm_proto.h"
#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

// ----------------------------------------------------------------------------
// CURVE keys and endpoints

#define CM_CHAN_KEY_LEN 40 /* Z85 characters of a CURVE key (32 bytes) */

/* 1 if the linked libzmq supports CURVE (zmq_has("curve")), else 0. */
int cm_chan_curve_available(void);

/* Writes a new key pair: PREFIX.key (the secret key, mode 0600) and PREFIX.pub (the public
 * key). Refuses to overwrite existing files. CM_ERR_UNSUPPORTED without CURVE, CM_ERR_IO. */
cm_status cm_chan_curve_keygen(const char *prefix);

/* Reads a key file (public or secret) into out (40 Z85 characters + NUL). CM_ERR_IO or
 * CM_ERR_FORMAT naming the file (never echoing its content). */
cm_status cm_chan_curve_read_key(const char *path, char out[CM_CHAN_KEY_LEN + 1]);

/* Checks an endpoint: tcp://HOST:PORT or ipc://PATH (CM_ERR_INVALID_ARG otherwise); *local is
 * 1 for ipc:// and loopback hosts (127.0.0.0/8, localhost, [::1]), 0 for anything else
 * (wildcards, other addresses, interface names). */
cm_status cm_chan_endpoint_check(const char *endpoint, int *local);

// ----------------------------------------------------------------------------
// server

typedef struct cm_chan_server cm_chan_server;

/* One request handed to the compute callback (on the worker thread). */
typedef struct cm_chan_job {
    const char             *session;     /* the trainer's name (from its HELLO) */
    const cm_proto_request *req;         /* validated: T ≤ max_tokens, layer ids < n_layers, distinct */
    uint32_t                hidden_size; /* D */
    void *const            *out;         /* req->n_layers buffers of T·D·4 bytes, owned by the server:
                                            out[i] receives layer req->layer_ids[i] as [T, D] */
    cm_dtype out_dtype;                  /* set by the callback: F32 (the default) or the server's hidden
                                            dtype; F32 is rounded (RNE) to a BF16 hidden dtype */
    void *nccl;                          /* the session's NCCL peer (from cm_chan_nccl_server.open) when
                                            the request asks for encoding nccl, else NULL: then the
                                            callback sends layer i as the server's hidden dtype [T, D]
                                            with ncclSend, in request order, and leaves out[] alone */
    int worker;                          /* the worker (replica) running the job, 0 .. n_workers-1 */
    /* Set by the callback before its first cm_chan_job_ready (optional): blocks until out[i] is
     * final, or fails (the answer then becomes an ERROR with the message). Runs on the worker's
     * encoder thread. NULL: out[i] is final when it is announced. */
    cm_status (*wait)(void *arg, uint32_t i);
    void *wait_arg;
    void *stream_; /* internal */
} cm_chan_job;

/* Streams an answer out while the compute callback still runs: announces that out[i] holds
 * (or, once job->wait(job->wait_arg, i) returns CM_OK, will hold) its final values in
 * job->out_dtype, which must be set before and not change after. The worker's encoder thread
 * encodes the tensors in request order, each as soon as it and those before it are announced;
 * what is not announced is encoded after compute returns. Call once per tensor, from the
 * compute callback; nothing for NCCL jobs. */
void cm_chan_job_ready(cm_chan_job *job, uint32_t i);

/* Callbacks run on a worker thread, with that worker's user (cm_chan_server_config.n_workers).
 * init (optional) runs once before the worker's first job (e.g. load the model there, so CUDA
 * state lives on the thread that uses it); a failure ends run() with its status. compute fills job->out; CM_ERR_INVALID_ARG becomes an ERROR bad-request for that
 * batch (the trainer does not retry), any other failure an ERROR internal (the trainer retries
 * up to its max_attempts); the message is cm_last_error(). fini (optional) runs at the end. */
typedef cm_status (*cm_chan_init_fn)(void *user);
typedef cm_status (*cm_chan_compute_fn)(void *user, cm_chan_job *job);
typedef void (*cm_chan_fini_fn)(void *user);

/* The server side of the NCCL data path (cm_proto.h, "The nccl encoding"), given by a server
 * whose compute runs on a GPU. Both run on the worker thread. open joins the communicator whose
 * unique id the trainer sent (rank 1 of 2; blocks until the trainer joins as rank 0) and
 * returns a peer handle for cm_chan_job.nccl; a failure is sent to the trainer as the reason.
 * close ends a peer (aborting transfers in flight) once its session is gone. */
typedef struct cm_chan_nccl_server {
    cm_status (*open)(void *user, const cm_proto_nccl *offer, void **peer);
    void (*close)(void *user, void *peer);
    uint32_t device; /* the server's CUDA device ordinal, for NCCL_READY */
} cm_chan_nccl_server;

#define CM_CHAN_MAX_WORKERS 64

typedef struct cm_chan_server_config {
    const char *endpoint;       /* bind: tcp://127.0.0.1:PORT (PORT may be '*'), ipc://PATH */
    const char *name;           /* target name in WELCOME (a cm_proto name) */
    uint64_t    target_id;      /* config hash sent in WELCOME (cm_target_cfg_hash) */
    uint64_t    weights_id;     /* weights fingerprint sent in WELCOME (cm_weights_id; ≠ 0);
                                   HELLOs asking for another non-zero config or fingerprint
                                   are refused */
    cm_dtype    hidden_dtype;   /* BF16 or F32: dtype of the answers' tensors */
    uint32_t    hidden_size;    /* D ≥ 1 */
    uint32_t    n_layers;       /* layers 0 .. n_layers-1 can be requested */
    uint32_t    max_tokens;     /* largest T of one request */
    uint32_t    max_req_layers; /* most layers in one request (bounds the output buffers) */
    uint32_t    credits;        /* most requests queued per session (granted in WELCOME) */
    uint32_t    encodings;      /* bit (1 << cm_encoding) per encoding offered */
    uint32_t    max_sessions;
    int         heartbeat_ms;    /* HEARTBEAT to an idle session after this long */
    int         peer_timeout_ms; /* a session that sends nothing for this long is dropped */
    int         n_threads;       /* compression and conversion threads (≥ 1) */
    int         zstd_level;
    int         stats_interval_ms; /* periodic per-session log line; 0 = only at start/end */
    const char *curve_secret_key;  /* file with the server's secret key; NULL = no CURVE */
    const char *curve_client_keys; /* directory of accepted client keys (*.pub); NULL = any
                                      client that knows the server's public key */
    cm_chan_init_fn    init;
    cm_chan_compute_fn compute; /* required */
    cm_chan_fini_fn    fini;
    void              *user; /* passed to status, and to the other callbacks without worker_users */
    const cm_chan_nccl_server *nccl; /* NULL: no NCCL path (encoding nccl is not offered) */
    /* Optional: writes a JSON object describing the target (model, device, load state) into buf
     * for STATUS replies (its "target" field). Runs on the loop thread while the workers work:
     * read only what is safe to read from there. */
    void (*status)(void *user, char *buf, size_t cap);
    /* Workers (0 = 1): threads that each run init once and then jobs, one at a time, in
     * parallel (model replicas, e.g. one per GPU); the loop gives each free worker the next job,
     * round-robin over the sessions. A session with an NCCL communicator runs on the worker that
     * opened it. worker_users[i] (NULL: user for all) is worker i's callbacks' user, and
     * nccl_devices[i] (NULL: nccl->device for all) its GPU for NCCL_READY. */
    int                    n_workers;    /* ≤ CM_CHAN_MAX_WORKERS */
    void *const           *worker_users; /* borrowed until destroy, like nccl_devices */
    const uint32_t        *nccl_devices;
    /* Optional, on each worker thread once it has initialised: page-locks (and unlock
     * releases) a worker's output buffers, which the server then sizes for max_req_layers ×
     * max_tokens × hidden_size floats up front (so that device-to-host copies into job->out
     * run at full speed and nothing is allocated per job). A failure is logged and the buffers
     * stay pageable. */
    cm_status (*host_lock)(void *user, void *p, size_t bytes);
    void (*host_unlock)(void *user, void *p);
} cm_chan_server_config;
#define CM_CHAN_SERVER_CONFIG_DEFAULT                                                                        \
    {                                                                                                        \
        "tcp://127.0.0.1:5555", "target", 0, 0, CM_DTYPE_BF16, 0, 0, 16384, 8, 4, CM_ENCODING_LOSSLESS_MASK, \
            64, 1000, 5000, 1, 1, 30000, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, \
            NULL                                                                                             \
    }

/* Checks the config (a non-loopback endpoint needs curve_secret_key and curve_client_keys;
 * CURVE needs a libzmq with CURVE), loads the keys and binds. Nothing is served before run().
 * An ipc:// path on which a server listens, or that holds a file other than a socket, is
 * refused (a socket file no one listens on is replaced); destroy removes the socket file only
 * while it is still the one this server bound. tcp://localhost is refused (use 127.0.0.1).
 * CM_ERR_INVALID_ARG, CM_ERR_UNSUPPORTED, CM_ERR_IO/FORMAT (keys), CM_ERR_ZMQ (bind). Caller
 * destroys with cm_chan_server_destroy. */
cm_status cm_chan_server_create(cm_chan_server **out, const cm_chan_server_config *cfg);
void      cm_chan_server_destroy(cm_chan_server **s); /* after run() returned, or without run(); NULL-safe */

/* The bound endpoint with the port resolved (e.g. "tcp://127.0.0.1:41234"); owned by s. */
const char *cm_chan_server_endpoint(const cm_chan_server *s);

/* Serves until cm_chan_server_stop(): then finishes the forward in progress and sends its
 * answer, drops queued requests (trainers re-send them), sends BYE to every session and
 * returns CM_OK. Returns early with the init callback's failure, or CM_ERR_ZMQ. Once only. */
cm_status cm_chan_server_run(cm_chan_server *s);

/* Asks run() to stop. Thread-safe and async-signal-safe (one atomic store). */
void cm_chan_server_stop(cm_chan_server *s);

typedef struct cm_chan_server_stats {
    uint64_t sessions_opened; /* WELCOMEs sent */
    uint32_t sessions_active;
    uint64_t sessions_timed_out, sessions_bye, sessions_replaced, sessions_unreachable;
    uint64_t requests;     /* REQUESTs accepted into a queue */
    uint64_t resends;      /* of those, flagged RESEND */
    uint64_t duplicates;   /* REQUESTs for an id already queued or computing (ignored) */
    uint64_t answers;      /* ANSWERs sent */
    uint64_t errors_sent;  /* ERRORs sent */
    uint64_t bad_frames;   /* frames refused as malformed */
    uint64_t dropped_jobs; /* queued requests dropped with their session */
    uint64_t tokens;       /* tokens of the answers sent */
    uint64_t bytes_sent;   /* ANSWER bytes (HEAD + DATA) */
    uint32_t max_queue;    /* largest queue (queued + computing) seen in one session */
    double   busy_s;       /* seconds during which at least one worker was on a request (the
                              server's producing time: tokens / busy_s is what it makes when busy) */
} cm_chan_server_stats;

/* A snapshot of the counters; thread-safe (tests read it while run() works). */
void cm_chan_server_get_stats(cm_chan_server *s, cm_chan_server_stats *out);

/* Runs fn(user of worker `worker`, arg) on that worker's thread between its jobs and returns its
 * status (its message in the caller's cm_last_error()); blocks the calling thread until then.
 * Other work on the model (decoding, through cm_dec) goes this way, so that a model replica stays
 * one thread's. The loop hands the call over as soon as the worker is idle (after its init, before
 * its next job; a worker that has just run a call takes a waiting job first, so calls and the
 * trainers' jobs alternate rather than starve each other); calls to one worker run in the order
 * made. Thread-safe; any thread but run()'s and the workers' (a call from those would wait for
 * itself: CM_ERR_INVALID_ARG). CM_ERR_PEER_GONE when run() has not started the workers yet, has
 * returned, or is stopping: calls still waiting then are released with it, while a call already
 * running finishes and returns fn's status; run() returns only once every call is released, and
 * the server may be destroyed once the callers have returned. CM_ERR_INVALID_ARG for a worker
 * out of range or a NULL fn. */
cm_status cm_chan_server_call(cm_chan_server *s, int worker, cm_status (*fn)(void *user, void *arg), void *arg);

/* Asks the server at endpoint for its status (a STATUS frame outside any session; works
 * while trainers are attached) and copies the JSON reply into out (NUL-terminated). CURVE as
 * for a client: curve_server_key NULL for loopback; curve_secret_key NULL = a fresh key pair
 * (refused by a server that accepts only listed client keys). CM_ERR_TIMEOUT when no reply comes within
 * timeout_ms (no server there, or an old one). */
cm_status cm_chan_status_query(const char *endpoint, const char *curve_server_key, const char *curve_secret_key,
                               int timeout_ms, char *out, size_t cap);

// ----------------------------------------------------------------------------
// client

typedef struct cm_chan_client cm_chan_client;

/* The trainer side of the NCCL data path, called on the client's I/O thread. offer makes a
 * unique id (the trainer is rank 0); join joins that communicator (blocks until the server
 * joins). recv receives the n tensors of one ANSWER (descriptors t, encoding nccl) into device
 * memory of answer slot `slot` (0 .. credits − 1; slot = credits is scratch for an answer no
 * one waits for), waits for them and sets dev[i]; the memory stays the slot's until its next
 * answer. leave aborts and frees the communicator when the session ends. */
typedef struct cm_chan_nccl_client {
    cm_status (*offer)(void *user, cm_proto_nccl *offer);
    cm_status (*join)(void *user, const cm_proto_nccl *offer);
    cm_status (*recv)(void *user, uint32_t slot, uint32_t n, const cm_proto_tensor *t, const void **dev);
    void (*leave)(void *user);
    void *user;
} cm_chan_nccl_client;

typedef struct cm_chan_client_config {
    const char *endpoint;           /* tcp://HOST:PORT or ipc://PATH of the server */
    const char *name;               /* this trainer's name in the server's logs (a cm_proto name) */
    uint32_t    credits;            /* requests in flight asked for; also the answers held at once */
    cm_encoding encoding;           /* encoding asked for in every REQUEST */
    uint32_t    accept;             /* other encodings accepted if the server lacks `encoding` (mask;
                                       default the lossless ones; 0 = `encoding` only) */
    uint64_t    target_id;          /* the config expected (cm_target_cfg_hash); 0 = any */
    uint64_t    weights_id;         /* the weights expected (fingerprint); 0 = any; a server that
                                       comes back must in any case serve the first one's */
    int         heartbeat_ms;       /* HEARTBEAT after this long without sending */
    int         peer_timeout_ms;    /* nothing heard for this long: the server is gone; reconnect */
    int         request_timeout_ms; /* no answer this long after sending: send the request again */
    int         reconnect_ms;       /* first delay between reconnect attempts (doubles up to 2 s) */
    int         max_attempts;       /* corrupt or failed answers for one batch before it is given up */
    int         n_threads;          /* decompression threads */
    int         check_values;       /* refuse answers holding NaN/Inf or an all-zero tensor (1) */
    uint64_t    max_answer_bytes;   /* bound on one answer's DATA (and on any ZeroMQ message) */
    const char *curve_server_key;   /* file with the server's public key; NULL = no CURVE */
    const char *curve_secret_key;   /* file with this client's secret key; NULL = a fresh key pair */
    int         keep_frames;        /* 1: also keep each answer's verified HEAD and DATA parts as
                                       received, lent by cm_chan_client_frames (e.g. to store them in
                                       shards without encoding again); 0 (default): freed once decoded */
    const cm_chan_nccl_client *nccl; /* required for encoding nccl (then accept must be 0: the
                                        answers land in GPU memory, not host memory) */
    /* Optional: page-locks (host_unlock releases) each buffer the client decodes answers into,
     * one per credit, grown to the largest answer and then reused, so that uploads from the
     * answers run at the bus's speed. Called on the client's thread with host_user. A failure is
     * logged once and the buffer stays pageable. Raw answers lent zero-copy are not locked. */
    cm_status (*host_lock)(void *user, void *p, size_t bytes);
    void (*host_unlock)(void *user, void *p);
    void *host_user;
} cm_chan_client_config;
/* The default number of (de)compression threads: half the online CPUs, within [2, 16] (a
 * 27B-shape answer is ~280 MB compressed; two threads need ~0.35 s for it). */
int cm_chan_default_threads(void);

#define CM_CHAN_CLIENT_CONFIG_DEFAULT                                                                        \
    {                                                                                                        \
        NULL, "trainer", 4, CM_ENCODING_ZSTD_BYTEPLANE, CM_ENCODING_LOSSLESS_MASK, 0, 0, 1000, 5000, 60000,  \
            200, 5, 2, 1, 8ull << 30, NULL, NULL, 0, NULL, NULL, NULL, NULL                                  \
    }

/* One decoded tensor of an answer: layer `layer` of the request, [n_tokens, hidden] of dtype. */
typedef struct cm_chan_tensor {
    char        name[CM_PROTO_NAME_MAX + 1]; /* "layer_<i>" */
    int         layer;
    cm_dtype    dtype; /* the server's hidden dtype */
    int64_t     n_tokens, hidden;
    const void *data; /* n_tokens × hidden elements, aligned to the dtype;
                         owned by the client until release */
    int on_device;    /* data is CUDA device memory (encoding nccl) */
    size_t bytes;
} cm_chan_tensor;

typedef struct cm_chan_answer {
    uint64_t              batch_id;
    cm_status             status;    /* CM_OK, or why the batch cannot be served (then no tensors) */
    const char           *message;   /* "" when status is CM_OK */
    uint32_t              n_tensors; /* = the request's n_layers, in its layer order */
    const cm_chan_tensor *tensors;
} cm_chan_answer;

typedef struct cm_chan_client_stats {
    uint64_t submitted, answers, failed; /* batches submitted, delivered with data, delivered failed */
    uint64_t sends, resends;             /* REQUEST frames sent; of those, re-sends */
    uint64_t timeouts;                   /* re-sends because an answer was late */
    uint64_t protocol_errors;            /* frames from the server refused (each one logged) */
    uint64_t corrupt_answers;            /* of those, answers that failed a checksum or a check */
    uint64_t duplicates;                 /* answers for ids not waited for (dropped) */
    uint64_t server_errors;              /* ERROR frames received */
    uint64_t sessions;                   /* WELCOMEs received (1 + reconnects) */
    uint64_t reconnects;                 /* sockets re-created after a lost session */
    uint64_t bytes_received;             /* ANSWER bytes */
    char     last_problem[256];          /* the latest refused frame or connection problem */
} cm_chan_client_stats;

/* Checks the config, starts the I/O thread, connects and sends HELLO; returns without waiting
 * for the server (which may not be up yet: the client keeps trying). Connecting to a
 * non-loopback endpoint needs curve_server_key. Caller destroys with cm_chan_client_destroy. */
cm_status cm_chan_client_create(cm_chan_client **out, const cm_chan_client_config *cfg);
/* Sends BYE if a session is up, stops the I/O thread, frees every answer. NULL-safe. */
void cm_chan_client_destroy(cm_chan_client **c);

/* Waits up to timeout_ms for a session (WELCOME) and copies the WELCOME into out (may be
 * NULL). CM_ERR_TIMEOUT with the last connection problem in cm_last_error(); a refusal that
 * retrying cannot cure (protocol version, target mismatch, no common encoding, CURVE key
 * refused) gives its status (CM_ERR_PROTOCOL, CM_ERR_INVALID_ARG) here and from every later
 * call. */
cm_status cm_chan_client_wait_ready(cm_chan_client *c, int timeout_ms, cm_proto_welcome *out);

/* Queues one request and returns without waiting (the I/O thread sends it as soon as a session
 * and a credit allow). Copies the arrays. batch_id must differ from every id in flight or held
 * (use a counter: ids are the idempotency key). CM_ERR_TIMEOUT when all `credits` slots are in
 * flight or held (receive and release an answer first); CM_ERR_INVALID_ARG for a malformed
 * batch, or one the session's WELCOME rules out (T > max_tokens, layer ≥ n_layers). */
cm_status cm_chan_client_submit(cm_chan_client *c, uint64_t batch_id, const int32_t *tokens,
                                uint32_t n_tokens, const int32_t *cu_seqlens, uint32_t n_seqs,
                                const int32_t *layer_ids, uint32_t n_layers);

/* Waits up to timeout_ms (0 = poll, -1 = forever) for the next completed batch, in completion
 * order, and lends it: the tensors stay valid until cm_chan_client_release. CM_ERR_TIMEOUT if
 * none completed in time; a fatal refusal's status otherwise (see wait_ready). */
cm_status cm_chan_client_recv(cm_chan_client *c, int timeout_ms, cm_chan_answer **out);
/* With keep_frames = 1: the ANSWER of a lent answer (status CM_OK) exactly as received and
 * verified (checksums, shapes, values as for the decoded tensors), as its two parts HEAD and
 * DATA (cm_proto_answer_decode_parts takes them; cm_shard_writer_append_parts stores them).
 * Valid until cm_chan_client_release. CM_ERR_INVALID_ARG without keep_frames or for a failed
 * answer. */
cm_status cm_chan_client_frames(cm_chan_client *c, const cm_chan_answer *a, const void **head,
                                size_t *head_len, const void **data, size_t *data_len);
/* Returns a lent answer; its slot (and credit) is reused. NULL-safe; sets *a = NULL. */
void cm_chan_client_release(cm_chan_client *c, cm_chan_answer **a);

/* Submitted batches not yet released (in flight, completed or lent). */
uint32_t cm_chan_client_pending(cm_chan_client *c);
void     cm_chan_client_get_stats(cm_chan_client *c, cm_chan_client_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* CM_CHAN_H */
