/* common/chan/cm_chan_int.h — what the files of cm_chan share and nobody else needs: the CM_ZMQ
 * conversion of ZeroMQ failures, socket option setters, the CURVE helpers (all in
 * cm_chan.c), and the server's and the client's internal structs, each split over two files
 * (loop and worker; owner API and I/O thread). Internal to common/; not installed. */
#ifndef CM_CHAN_INT_H
#define CM_CHAN_INT_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <zmq.h>

#include "cm_chan.h"
#include "cm_compress.h"
#include "cm_time.h"

/* Converts a ZeroMQ return value once, where the call is made: -1 → CM_ERR_ZMQ with the
 * statement, file:line and zmq_strerror(zmq_errno()) in cm_last_error(); else CM_OK. */
#define CM_ZMQ(x) cm_zmq_check_((x) == -1, #x, __FILE__, __LINE__)
cm_status cm_zmq_check_(int failed, const char *stmt, const char *file, int line);

cm_status cm_chan_set_int(void *sock, int option, int value); /* zmq_setsockopt of an int */
cm_status cm_chan_set_i64(void *sock, int option, int64_t value);

/* Fails with CM_ERR_UNSUPPORTED and the fix when libzmq lacks CURVE. */
cm_status cm_chan_curve_require(const char *what);

/* A non-blocking, close-on-exec pipe (what names it in the message: "the worker pipe"). */
cm_status cm_chan_pipe_(int *read_end, int *write_end, const char *what);

/* A random 64-bit value (getrandom, falling back to the clock and the pid). */
uint64_t cm_chan_random_u64(void);

/* snprintf that may cut its output on purpose (messages bounded by the wire or a struct). */
void cm_chan_fmt(char *dst, size_t cap, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* 1 for a tcp:// endpoint with a bracketed IPv6 host ([::1]): its socket needs ZMQ_IPV6, without
 * which libzmq fails to bind it ("No such device") and to connect it. */
int cm_chan_endpoint_ipv6_(const char *endpoint);

/* The server's checks of a bind endpoint beyond cm_chan_endpoint_check (cm_chan.c): an ipc://
 * path must not be held by a live listener (a stale socket file may be replaced) nor be a file
 * other than a socket; tcp://localhost is refused with the address to use instead. */
cm_status cm_chan_bind_check_(const char *endpoint);

/* Copies a message into an ERROR's message field: control bytes become spaces, cut at
 * CM_PROTO_MESSAGE_MAX bytes. */
void cm_chan_error_text(char *dst, const char *src);

// ----------------------------------------------------------------------------
// what a server's socket needs, shared by cm_chan_server and cm_dec_server (cm_chan.c, _zap.c,
// _send.c)

/* A bind endpoint and its keys, checked before anything is created: cm_chan_endpoint_check, a
 * non-loopback endpoint only with a secret key and a client key directory, the directory only
 * with a secret key, CURVE in the linked libzmq when keys are given, cm_chan_bind_check_. */
cm_status cm_chan_server_endpoint_check_(const char *endpoint, const char *secret_key,
                                         const char *client_keys);

/* Makes sock a CURVE server with the secret key in the file secret_key (read, used and wiped;
 * never logged), checking clients through ZAP (domain "tandem") when zap is set, and logs the
 * public key, prefixed by what ("" or e.g. "decoding endpoint: "). */
cm_status cm_chan_curve_server_(void *sock, const char *secret_key, int zap, const char *what);

/* Binds sock to endpoint (a failure says what to do: port in use, host name instead of an
 * address), writes the bound endpoint with its port resolved into bound (cap bytes) and, for an
 * ipc:// path, the socket file's inode into *ino and *dev (0 otherwise). unbind_file removes that
 * file unless another server has bound the path since (then it is another inode); libzmq leaves
 * it behind. */
cm_status cm_chan_bind_(void *sock, const char *endpoint, char *bound, size_t cap, ino_t *ino, dev_t *dev);
void      cm_chan_unbind_file_(const char *bound, ino_t ino, dev_t dev);

/* The client side of CURVE: checks endpoint (a non-loopback one needs server_key), reads the
 * server's public key and this client's key pair (secret_key NULL: a fresh pair) into k (on = 0
 * without server_key); apply sets them on a socket before its connect. wipe clears k. */
typedef struct cm_chan_curve_keys {
    int  on;
    char server[CM_CHAN_KEY_LEN + 1], pub[CM_CHAN_KEY_LEN + 1], sec[CM_CHAN_KEY_LEN + 1];
} cm_chan_curve_keys;
cm_status cm_chan_curve_client_keys_(cm_chan_curve_keys *k, const char *endpoint, const char *server_key,
                                     const char *secret_key);
cm_status cm_chan_curve_client_apply_(void *sock, const cm_chan_curve_keys *k);
void      cm_chan_curve_keys_wipe_(cm_chan_curve_keys *k);

/* The accepted client keys (*.pub files of a directory) and the ZAP handler that checks a
 * connecting CURVE client against them: a REP socket bound at inproc://zeromq.zap.01 in the
 * server's ZeroMQ context (one handler per context). open loads the keys and binds; handle
 * answers the requests waiting (on the thread that polls sock), logging refusals through warn;
 * close is NULL-safe and idempotent. */
typedef struct cm_chan_warn cm_chan_warn;
typedef struct cm_chan_zap {
    void *sock;
    uint8_t (*keys)[32];
    int  n_keys;
    char dir[1024];
} cm_chan_zap;
cm_status cm_chan_zap_open_(cm_chan_zap *z, void *ctx, const char *dir);
void      cm_chan_zap_handle_(cm_chan_zap *z, cm_chan_warn *warn);
void      cm_chan_zap_close_(cm_chan_zap *z);

/* What a server's listening ROUTER is: its endpoint, the CURVE keys (either may be NULL), the
 * prefix of its log lines ("" or e.g. "decoding endpoint: "), its linger, its send high-water
 * mark (0: libzmq's) and the largest message it takes. */
typedef struct cm_chan_listen {
    const char *endpoint, *curve_secret_key, *curve_client_keys, *what;
    int         linger_ms, sndhwm;
    int64_t     max_msg;
} cm_chan_listen;

/* A server's ZeroMQ context (*ctx), the ZAP handler of the client key directory (zap, when
 * curve_client_keys is set), and its ROUTER (*router): mandatory routing, handover, ZMQ_IPV6 for
 * a bracketed IPv6 endpoint, CURVE with the secret key, then bound as cm_chan_bind_ says. On
 * failure what was made is left in *ctx, *router and zap for the caller's destroy. */
cm_status cm_chan_listen_(const cm_chan_listen *l, void **ctx, void **router, cm_chan_zap *zap, char *bound,
                          size_t cap, ino_t *ino, dev_t *dev);

/* One message from a server's ROUTER, without waiting: the routing id into ident (at most
 * IDENT_MAX bytes; *ident_len), the first frame after it into fr (initialised here, closed by the
 * caller), and into *parts the number of frames after the id (those past the first received and
 * dropped). Returns 0, with fr closed, when no message was waiting. */
int cm_chan_recv_msg_(void *router, zmq_msg_t *fr, uint8_t *ident, size_t *ident_len, int *parts);

/* An ERROR frame (code, batch id, the formatted message cut to the wire's field) into buf (cap
 * bytes; *len its size). */
cm_status cm_chan_error_frame_(uint8_t *buf, size_t cap, size_t *len, uint64_t id, cm_proto_error_code code,
                               const char *fmt, va_list ap);

/* A rate limit on warnings about refused frames and clients: ok is 0 once WARN_BURST warnings
 * went out in the last 10 s (those are then counted and summed up in one line). */
struct cm_chan_warn {
    int64_t window;
    int     count, suppressed;
};
int cm_chan_warn_ok_(cm_chan_warn *w);

// ----------------------------------------------------------------------------
// server internals. cm_chan_server.c: the lifecycle (create, destroy, start and join the
// workers, stop); cm_chan_server_loop.c: run, the loop thread, which calls the files of its
// concerns: _session.c (sessions and what they receive), _sched.c (tasks to workers, results
// back), _status.c (STATUS), _zap.c (CURVE clients), _send.c (frames out, refusals);
// cm_chan_server_work.c: the worker threads, cm_chan_server_enc.c: their answers' encoding;
// cm_chan_server_call.c: other work run on a worker's thread (cm_chan_server_call).

#define POOL_MAX        64  /* pooled answer buffers; beyond that an answer gets a one-off buffer */
#define IDENT_MAX       255 /* ZeroMQ routing ids are 1..255 bytes */
#define MAX_CLIENT_KEYS 4096
#define RECV_BURST      256 /* messages read per loop turn before timers and results get a turn */
#define WARN_BURST      20  /* warnings about bad frames per 10 s, then they are counted and summarised */

typedef struct pool_buf {
    atomic_int busy; /* 1 from acquisition (worker) until ZeroMQ frees the message (I/O thread) */
    uint8_t   *data;
    size_t     cap;
} pool_buf;

/* A queue slot: a REQUEST decoded and validated by the loop. Its arrays are the slot's, grown
 * to fit (cm_chan_request_reserve_) and kept when the slot frees; requests move between the
 * loop, the slots and the workers by swapping these structs, arrays and all. */
typedef struct qjob {
    cm_proto_request rq;
} qjob;

typedef struct session {
    int      used;
    uint8_t  ident[IDENT_MAX];
    size_t   ident_len;
    char     name[CM_PROTO_NAME_MAX + 1];
    char     peer[64];
    uint64_t gen; /* unique per HELLO: a result for an older generation is discarded */
    uint32_t credits, encodings;
    qjob    *queue; /* ring of cfg.credits */
    uint32_t q_head, q_len;
    uint32_t computing; /* jobs of this session on workers now */
    int64_t  last_recv, last_send, started, last_stats;
    uint64_t n_requests, n_resends, n_answers, n_errors, bytes, tokens;
    int           nccl_state; /* NCCL_NONE, NCCL_WANTED (offer kept, open not started), NCCL_OPENING, NCCL_UP */
    cm_proto_nccl nccl_offer;
    void         *nccl_peer;   /* NCCL_UP: the peer from cfg.nccl->open */
    int           nccl_worker; /* the worker that opened it (and runs this session's jobs from then on) */
} session;

enum { NCCL_NONE, NCCL_WANTED, NCCL_OPENING, NCCL_UP };
enum { WORK_JOB, WORK_NCCL_OPEN, WORK_CALL };

/* A cm_chan_server_call: lives on its caller's stack, which waits (on s->call_cv) until state is
 * CALL_DONE; queued on s->calls, then handed to its worker (work.call), then completed by the
 * loop. state, next and the result are under s->call_mu, except while the worker runs it. */
enum { CALL_QUEUED, CALL_RUNNING, CALL_DONE };
typedef struct chan_call {
    int worker;
    cm_status (*fn)(void *user, void *arg);
    void             *arg;
    int               state;
    cm_status         st;        /* fn's status, or CM_ERR_PEER_GONE when it never ran */
    char              msg[1024]; /* its cm_last_error() */
    struct chan_call *next;
} chan_call;

/* The worker's mailbox: one job in, one result out, under mu. */
typedef struct work {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             have_job, quit, done, init_done;
    cm_status       init_status;
    char            init_msg[1024];
    /* job */
    int           kind; /* WORK_JOB, WORK_NCCL_OPEN (offer, result in peer / status) or WORK_CALL */
    chan_call    *call; /* WORK_CALL: the call to run (its result goes into it) */
    cm_proto_nccl offer;
    void         *peer;
    void         *job_peer; /* WORK_JOB: the session's NCCL peer (NULL without one) */
    char          nccl_msg[CM_PROTO_MESSAGE_MAX + 1]; /* why WORK_NCCL_OPEN failed */
    /* NCCL peers of this worker whose sessions ended, closed by it before its next task */
    void   **closing;
    uint32_t n_closing;
    cm_proto_request rq; /* WORK_JOB: the request, as decoded by the loop (swapped in from its slot) */
    char      session[CM_PROTO_NAME_MAX + 1];
    int       sess;
    uint64_t  gen;
    /* result */
    int       is_answer;
    uint64_t  id;
    uint32_t  n_tokens;
    uint8_t  *head;
    size_t    head_len, head_cap;
    pool_buf *data; /* NULL: data_oneoff */
    uint8_t  *data_oneoff;
    size_t    data_len;
    uint8_t   err[CM_PROTO_SMALL_FRAME_MAX];
    size_t    err_len;
} work;

/* An answer being encoded: the output buffer, the running offset, the tensors done. Owned by
 * the worker, or by its encoder thread while that streams (see enc_state). */
typedef struct encoding {
    const cm_proto_request *rq;
    cm_dtype                out_dt; /* what the compute callback wrote */
    uint8_t                *dst;
    size_t                  total, off;
    uint32_t                done; /* tensors encoded, in request order */
} encoding;

/* A worker's encoder thread: encodes the tensors a compute callback announces with
 * cm_chan_job_ready while the compute goes on. Under mu. */
typedef struct enc_state {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    pthread_t       thread;
    int             started, quit;
    int             active; /* a job streams: the thread may take announced tensors */
    int             stop;   /* the compute returned: finish the tensor in hand, then idle */
    int             busy;   /* the thread is encoding a tensor (outside mu) */
    uint8_t        *announced; /* per request position */
    cm_dtype        dt;        /* the dtype of the announced tensors (once dt_set) */
    int             dt_set;
    cm_chan_job    *job;
    encoding       *enc;
    cm_status       st; /* the first failure (wait or encode) */
    char            msg[1024];
} enc_state;

/* One worker: a thread with its own callbacks' user (a model replica), mailbox, buffers and
 * encoder. The loop hands it one job at a time. */
typedef struct worker {
    struct cm_chan_server *s;
    int                    index;
    void                  *user;
    uint32_t               device; /* NCCL_READY's server GPU */
    pthread_t              thread;
    int                    started;
    int                    busy;   /* loop thread: a task is handed over and not yet done */
    int                    last_call; /* loop thread: that task (or the last one) is a call */
    uint64_t               job_id; /* loop thread: the batch of the job handed over */
    work                   w;
    /* worker thread */
    float           *out_block;
    size_t           out_cap; /* floats */
    int              out_pinned;
    void           **out_ptrs;
    uint8_t         *conv; /* hidden-dtype scratch of T·D */
    size_t           conv_cap;
    cm_proto_tensor *tensors;
    cm_compress     *cc;
    pool_buf         pool[POOL_MAX];
    int              n_pool;
    enc_state        es;
} worker;

struct cm_chan_server {
    cm_chan_server_config cfg;
    char                  endpoint[512];
    ino_t                 ipc_ino; /* the ipc:// socket file we bound (0: none) */
    dev_t                 ipc_dev;
    char                  name[CM_PROTO_NAME_MAX + 1];
    cm_proto_limits       lim;
    void                 *ctx, *router;
    cm_chan_zap           zap; /* sock NULL without a client key directory */
    atomic_int            stop;
    int        stopping, ran;
    int64_t    started_ms; /* run() began (STATUS uptime) */
    int        pipe_r, pipe_w;
    worker    *workers;
    int        n_workers, n_busy;
    int        n_answering; /* loop thread: workers on a request (calls left out), since busy_since */
    double     busy_since;  /* cm_now_s() when n_answering last went from 0 to 1 */
    session   *sessions;
    uint32_t   rr;
    uint64_t   gen_counter, hb_seq;
    /* loop thread: the REQUEST being decoded (its arrays owned, grown to fit) */
    cm_proto_request req;
    /* cm_chan_server_call: calls queued (FIFO) while run() accepts them (calls_open), under call_mu */
    pthread_mutex_t call_mu;
    pthread_cond_t  call_cv;
    chan_call      *calls;
    int             calls_open;
    pthread_t       loop_thread; /* run()'s thread (calls from it are refused) */
    cm_chan_warn warn;
    /* stats */
    pthread_mutex_t      stats_mu;
    cm_chan_server_stats stats;
};

#define STAT_ADD(s, field, v)                                                                                \
    do {                                                                                                     \
        pthread_mutex_lock(&(s)->stats_mu);                                                                  \
        (s)->stats.field += (v);                                                                             \
        pthread_mutex_unlock(&(s)->stats_mu);                                                                \
    } while (0)

/* cm_chan_server.c: a REQUEST's own arrays, grown to hold n_tokens tokens (and n_tokens + 1
 * cu_seqlens) and n_layers layer ids, and freed. */
cm_status cm_chan_request_reserve_(cm_proto_request *r, uint32_t n_tokens, uint32_t n_layers);
void      cm_chan_request_release_(cm_proto_request *r);

/* cm_chan_server.c: the worker threads started (a failure leaves those started running: join
 * ends them), and asked to quit and joined. */
cm_status cm_chan_server_start_(cm_chan_server *s);
void      cm_chan_server_join_(cm_chan_server *s);

/* cm_chan_server_send.c (loop thread). send_to: identity + one part; CM_ERR_PEER_GONE when
 * the peer is not connected, CM_ERR_TIMEOUT when its queue is full (the frame is dropped),
 * CM_ERR_ZMQ otherwise. refuse_frame: a frame that failed cm_proto_peek, refused with ERROR
 * version or corrupt. */
cm_status cm_chan_send_to_(cm_chan_server *s, const uint8_t *ident, size_t ident_len, const void *frame,
                           size_t len);
cm_status cm_chan_send_error_(cm_chan_server *s, const uint8_t *ident, size_t ident_len, uint64_t id,
                              cm_proto_error_code code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;
cm_status cm_chan_send_bye_(cm_chan_server *s, const uint8_t *ident, size_t ident_len);
void      cm_chan_refuse_frame_(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len,
                                const uint8_t *p, size_t len, const char *why);

/* cm_chan_server_session.c (loop thread) */
typedef enum end_reason { END_BYE, END_TIMEOUT, END_REPLACED, END_UNREACHABLE, END_STOP } end_reason;
session *cm_chan_find_session_(cm_chan_server *s, const uint8_t *ident, size_t len);
void     cm_chan_log_session_(const session *ss, const char *what, int64_t now);
uint32_t cm_chan_drop_queue_(cm_chan_server *s, session *ss); /* drops a session's queued jobs */
void     cm_chan_end_session_(cm_chan_server *s, session *ss, end_reason why);
void     cm_chan_on_hello_(cm_chan_server *s, session *ss, const uint8_t *ident, size_t ident_len, zmq_msg_t *fr);
void     cm_chan_on_nccl_offer_(cm_chan_server *s, session *ss, zmq_msg_t *fr);
void     cm_chan_on_request_(cm_chan_server *s, session *ss, const cm_proto_header *h, const uint8_t *p,
                            size_t len);

/* cm_chan_server_sched.c (loop thread): tasks handed to idle workers; the results of the
 * workers that are done sent. */
void cm_chan_schedule_(cm_chan_server *s);
void cm_chan_handle_done_(cm_chan_server *s);

/* cm_chan_server_call.c. Loop thread: open lets cm_chan_server_call queue calls (run() started
 * the workers); close refuses new ones and fails the queued ones with CM_ERR_PEER_GONE (why: the
 * message), and after the workers are joined also those handed over and never run; schedule
 * hands queued calls to their idle workers (after_call 0: only to workers whose last task was not
 * a call, so that calls and jobs alternate on a worker both want); done completes worker k's call.
 * Worker thread: run runs worker k's call. */
void cm_chan_calls_open_(cm_chan_server *s);
void cm_chan_calls_close_(cm_chan_server *s, const char *why, int joined);
void cm_chan_calls_schedule_(cm_chan_server *s, int after_call);
void cm_chan_call_done_(cm_chan_server *s, worker *k);
void cm_chan_call_run_(worker *k);

/* cm_chan_server_status.c (loop thread): the answer to a STATUS frame. */
void cm_chan_status_reply_(cm_chan_server *s, const uint8_t *ident, size_t ident_len, const uint8_t *p,
                           size_t len);

/* cm_chan_server_work.c */
void    *cm_chan_worker_main_(void *worker);                  /* a worker thread */
/* cm_chan_server_enc.c, on worker k's thread: the compute of rq and its answer encoded into
 * k->w (a failure leaves no buffer held); the HEAD of an answer sent over NCCL; the encoder
 * thread started after init and stopped before fini. */
cm_status cm_chan_compute_encode_(cm_chan_server *s, worker *k, const cm_proto_request *rq, cm_chan_job *job);
cm_status cm_chan_encode_nccl_head_(cm_chan_server *s, worker *k, const cm_proto_request *rq);
void      cm_chan_encoder_start_(worker *k);
void      cm_chan_encoder_stop_(worker *k);
/* hands an NCCL peer to the worker that opened it, to close */
void cm_chan_close_peer_(cm_chan_server *s, int worker, void *peer);

// ----------------------------------------------------------------------------
// client internals (cm_chan_client.c: the owner's API; cm_chan_client_io.c: the I/O thread,
// which calls cm_chan_client_session.c and cm_chan_client_answer.c)

#define MAX_TENSORS   256
#define IO_RECV_BURST 64

enum { SLOT_FREE, SLOT_QUEUED, SLOT_SENT, SLOT_READY, SLOT_HELD };
enum { CONN_WAIT, CONN_HELLO, CONN_NCCL, CONN_READY, CONN_DEAD }; /* CONN_NCCL: WELCOME read, waiting for NCCL_READY */

typedef struct slot {
    cm_chan_answer  ans; /* first: release() maps the answer back to its slot */
    int             state;
    uint64_t        batch_id, seq;
    int             ever_sent, attempts;
    int64_t         sent_at, resend_at; /* resend_at 0: none scheduled */
    uint32_t        n_tokens, n_seqs, n_layers;
    int32_t        *tokens, *cu, *layers;
    uint32_t        cap_tokens, cap_cu, cap_layers;
    uint8_t        *frame;
    size_t          frame_cap;
    cm_chan_tensor *tensors;
    uint8_t        *buf; /* decoded tensors */
    size_t          buf_cap;
    int             buf_locked; /* buf page-locked through the config's host_lock */
    zmq_msg_t       raw; /* DATA of a raw answer, lent zero-copy */
    int             has_raw;
    zmq_msg_t       head_raw; /* HEAD of the answer, kept with cfg.keep_frames (then DATA is in raw) */
    int             has_head;
    char            message[CM_PROTO_MESSAGE_MAX + 128];
} slot;

struct cm_chan_client {
    cm_chan_client_config cfg;
    char                  endpoint[512], name[CM_PROTO_NAME_MAX + 1], ident[32];
    char                  server_key[CM_CHAN_KEY_LEN + 1], public_key[CM_CHAN_KEY_LEN + 1];
    char                  secret_key[CM_CHAN_KEY_LEN + 1];
    int                   curve;
    void                 *ctx, *sock, *mon;
    unsigned              mon_n;
    pthread_t             io;
    int                   io_started, wake_r, wake_w;
    atomic_int            quit;
    /* shared, under mu */
    pthread_mutex_t      mu;
    pthread_cond_t       cv;
    slot                *slots;
    uint32_t             n_slots;
    uint32_t            *ready, ready_head, ready_len;
    uint64_t             seq;
    int                  session_up, have_welcome;
    cm_proto_welcome     welcome;
    cm_status            fatal;
    char                 fatal_msg[1024];
    cm_chan_client_stats stats;
    /* I/O thread only */
    cm_compress     *cc;
    cm_proto_limits  lim;
    cm_proto_tensor *pt;
    cm_encoding      enc;
    int              conn, handshake_ok, backoff_ms;
    int              nccl_joined;  /* the NCCL communicator of this session is up (cfg.nccl->leave ends it) */
    cm_proto_welcome nccl_welcome; /* CONN_NCCL: the WELCOME that NCCL_READY completes */
    uint32_t         granted, in_flight;
    int64_t          last_recv, last_send, hello_at, reconnect_at;
    uint64_t         hb_seq;
    int              lock_warned; /* cfg.host_lock failed once (said once) */
};

void *cm_chan_client_io_main_(void *client); /* the I/O thread */

/* cm_chan_client_io.c, on the I/O thread: problem records stats.last_problem (under mu); fatal
 * ends the client with st and msg; find_sent is the SENT slot of batch id, or NULL; slot_state
 * reads a slot's state under mu; complete moves a slot to READY with st (msg when it failed);
 * send sends one frame; retry schedules a re-send of a SENT slot in delay_ms, or completes it
 * with give_up once its attempts are spent; protocol_error reports a refused frame and
 * re-requests the batch it names; lose_session closes the socket and re-queues what is in
 * flight. */
void  cm_chan_client_problem_(cm_chan_client *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void  cm_chan_client_fatal_(cm_chan_client *c, cm_status st, const char *msg);
slot *cm_chan_client_find_sent_(cm_chan_client *c, uint64_t id);
int   cm_chan_client_slot_state_(cm_chan_client *c, const slot *s);
void  cm_chan_client_complete_(cm_chan_client *c, slot *s, cm_status st, const char *msg, uint64_t bytes);
void  cm_chan_client_send_(cm_chan_client *c, const void *buf, size_t len, int64_t now);
void  cm_chan_client_retry_(cm_chan_client *c, slot *s, cm_status give_up, const char *why, int64_t now,
                            int delay_ms);
void  cm_chan_client_protocol_error_(cm_chan_client *c, const char *why, uint64_t id, int is_answer, int64_t now);
void  cm_chan_client_lose_session_(cm_chan_client *c, const char *why, int64_t now);
/* Frees a slot's decoded-answer buffer, unlocked first through cfg.host_unlock if it was locked. */
void cm_chan_client_buf_free_(cm_chan_client *c, slot *s);

/* cm_chan_client_session.c: a WELCOME, an NCCL_READY (I/O thread). */
void cm_chan_client_on_welcome_(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now);
void cm_chan_client_on_nccl_ready_(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now);

/* cm_chan_client_answer.c: an ANSWER (HEAD and DATA parts; id from the header), an ERROR. */
void cm_chan_client_on_answer_(cm_chan_client *c, zmq_msg_t *head, zmq_msg_t *data, uint64_t id, int64_t now);
void cm_chan_client_on_error_(cm_chan_client *c, const uint8_t *p, size_t len, int64_t now);

#endif /* CM_CHAN_INT_H */
