/* common/cm_chan_server_work.c — the server's worker threads and their lifecycle (see
 * cm_chan_server.c for the loop, cm_chan_server_enc.c for the encoding). Each worker (a model
 * replica: cfg.n_workers) runs the init callback once, then one job at a time: decodes the
 * REQUEST, runs the compute callback into the worker's output buffers and has the answer
 * encoded, then posts the result to the loop through a pipe. create checks the config, loads
 * the CURVE keys and binds; nothing here touches the ROUTER after create, so the loop stays
 * its only user. */
#include "cm_chan_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

// ----------------------------------------------------------------------------
// the worker

static void notify_loop(cm_chan_server *s) {
    char b = 1;
    while (write(s->pipe_w, &b, 1) < 0 && errno == EINTR) {
    }
}

static cm_status ensure_out(worker *k, uint32_t L, size_t TD) {
    size_t need = (size_t)L * TD;
    if (need > k->out_cap) {
        if (k->out_pinned && k->s->cfg.host_unlock)
            k->s->cfg.host_unlock(k->user, k->out_block);
        k->out_pinned = 0;
        free(k->out_block);
        k->out_block = malloc(need * sizeof(float));
        k->out_cap = k->out_block ? need : 0;
        if (!k->out_block)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %zu bytes for the captured layers", need * 4);
    }
    for (uint32_t i = 0; i < L; i++)
        k->out_ptrs[i] = k->out_block + (size_t)i * TD;
    return CM_OK;
}

/* The worker's output buffers at their largest, page-locked through cfg.host_lock (then the
 * compute's device-to-host copies into them run at full speed and no job allocates them). */
static void prepare_out(worker *k) {
    const cm_chan_server_config *c = &k->s->cfg;
    if (!c->host_lock)
        return;
    size_t TD = (size_t)c->max_tokens * c->hidden_size;
    if (ensure_out(k, c->max_req_layers, TD) != CM_OK) {
        CM_LOG_WARN("worker %d: %s; output buffers are allocated per request instead", k->index, cm_last_error());
        return;
    }
    if (c->host_lock(k->user, k->out_block, k->out_cap * sizeof(float)) == CM_OK)
        k->out_pinned = 1;
    else
        CM_LOG_WARN("worker %d: cannot page-lock %zu MB of output buffers (%s); they stay pageable", k->index,
                    k->out_cap * sizeof(float) >> 20, cm_last_error());
}

static void worker_process(cm_chan_server *s, worker *k) {
    work            *w = &k->w;
    cm_proto_request rq = {.tokens = k->tokens,
                           .cu_seqlens = k->cu,
                           .layer_ids = k->layers,
                           .cap_tokens = s->cfg.max_tokens,
                           .cap_cu_seqlens = s->cfg.max_tokens + 1,
                           .cap_layers = s->cfg.max_req_layers};
    w->is_answer = 0;
    w->data = NULL;
    w->data_oneoff = NULL;
    cm_status st = cm_proto_request_decode(zmq_msg_data(&w->msg), zmq_msg_size(&w->msg), &s->lim, &rq);
    w->id = rq.batch_id;
    w->n_tokens = rq.n_tokens;
    cm_chan_job job = {.session = w->session,
                       .req = &rq,
                       .hidden_size = s->cfg.hidden_size,
                       .out = (void *const *)k->out_ptrs,
                       .out_dtype = CM_DTYPE_F32,
                       .nccl = rq.encoding == CM_ENCODING_NCCL ? w->job_peer : NULL,
                       .worker = k->index};
    if (st == CM_OK && rq.encoding == CM_ENCODING_NCCL && !job.nccl)
        st = CM_FAIL(CM_ERR_INVALID_ARG, "batch %llu asks for encoding nccl before NCCL_READY",
                     (unsigned long long)rq.batch_id);
    if (st == CM_OK && !job.nccl)
        st = ensure_out(k, rq.n_layers, (size_t)rq.n_tokens * s->cfg.hidden_size);
    int64_t t0 = cm_chan_now_ms();
    if (st == CM_OK && job.nccl) {
        st = s->cfg.compute(k->user, &job);
        if (st == CM_OK)
            st = cm_chan_encode_nccl_head_(s, k, &rq);
    } else if (st == CM_OK) {
        st = cm_chan_compute_encode_(s, k, &rq, &job);
    }
    int bad_request = st == CM_ERR_INVALID_ARG;
    if (st == CM_OK) {
        w->is_answer = 1;
        CM_LOG_DEBUG("batch %llu of '%s' on worker %d: %u tokens, %u layers in %lld ms, %zu bytes",
                     (unsigned long long)rq.batch_id, w->session, k->index, rq.n_tokens, rq.n_layers,
                     (long long)(cm_chan_now_ms() - t0), w->head_len + w->data_len);
        return;
    }
    cm_proto_error e = {.batch_id = rq.batch_id,
                        .code = bad_request ? CM_PROTO_ERROR_BAD_REQUEST : CM_PROTO_ERROR_INTERNAL};
    cm_chan_error_text(e.message, cm_last_error());
    if (!bad_request)
        CM_LOG_WARN("batch %llu of '%s' failed: %s", (unsigned long long)rq.batch_id, w->session,
                    cm_last_error());
    if (cm_proto_error_encode(&e, w->err, sizeof w->err, &w->err_len) != CM_OK)
        w->err_len = 0;
}

/* Closes the NCCL peers of ended sessions (queued by the loop with cm_chan_close_peer_). */
static void close_peers(worker *k) {
    work *w = &k->w;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        void *p = w->n_closing ? w->closing[--w->n_closing] : NULL;
        pthread_mutex_unlock(&w->mu);
        if (!p)
            return;
        k->s->cfg.nccl->close(k->user, p);
    }
}

void cm_chan_close_peer_(cm_chan_server *s, int index, void *peer) {
    if (!peer || index < 0 || index >= s->n_workers)
        return;
    worker *k = &s->workers[index];
    work   *w = &k->w;
    pthread_mutex_lock(&w->mu);
    if (w->n_closing < 2 * s->cfg.max_sessions + 2) {
        w->closing[w->n_closing++] = peer;
        peer = NULL;
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    if (peer) /* cannot happen (a peer per session, one more opening); close here rather than leak */
        s->cfg.nccl->close(k->user, peer);
}

void *cm_chan_worker_main_(void *arg) {
    worker         *k = arg;
    cm_chan_server *s = k->s;
    work           *w = &k->w;
    cm_status       st = s->cfg.init ? s->cfg.init(k->user) : CM_OK;
    if (st == CM_OK) {
        prepare_out(k);
        cm_chan_encoder_start_(k);
    }
    pthread_mutex_lock(&w->mu);
    w->init_done = 1;
    w->init_status = st;
    if (st != CM_OK)
        snprintf(w->init_msg, sizeof w->init_msg, "%s", cm_last_error());
    pthread_mutex_unlock(&w->mu);
    notify_loop(s);
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->have_job && !w->quit && !w->n_closing)
            pthread_cond_wait(&w->cv, &w->mu);
        int quit = w->quit && !w->have_job;
        pthread_mutex_unlock(&w->mu);
        close_peers(k);
        if (quit || st != CM_OK)
            break;
        pthread_mutex_lock(&w->mu);
        int have = w->have_job;
        pthread_mutex_unlock(&w->mu);
        if (!have)
            continue;
        if (w->kind == WORK_NCCL_OPEN) {
            w->peer = NULL;
            cm_status ost = s->cfg.nccl->open(k->user, &w->offer, &w->peer);
            if (ost != CM_OK) {
                cm_chan_error_text(w->nccl_msg, cm_last_error());
                w->peer = NULL;
            }
            w->is_answer = ost == CM_OK;
        } else {
            worker_process(s, k);
        }
        pthread_mutex_lock(&w->mu);
        w->have_job = 0;
        w->done = 1;
        zmq_msg_close(&w->msg);
        pthread_mutex_unlock(&w->mu);
        notify_loop(s);
    }
    pthread_mutex_lock(&w->mu);
    if (w->have_job) { /* handed over before init failed: never run */
        zmq_msg_close(&w->msg);
        w->have_job = 0;
    }
    pthread_mutex_unlock(&w->mu);
    close_peers(k);
    cm_chan_encoder_stop_(k);
    if (k->out_pinned && s->cfg.host_unlock) /* before fini: the unlock may need the user's state */
        s->cfg.host_unlock(k->user, k->out_block);
    k->out_pinned = 0;
    if (s->cfg.fini)
        s->cfg.fini(k->user);
    return NULL;
}

// ----------------------------------------------------------------------------
// create / destroy

static cm_status load_client_keys(cm_chan_server *s, const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return CM_FAIL(CM_ERR_IO, "cannot open the client key directory '%s': %s", dir, strerror(errno));
    snprintf(s->client_keys_dir, sizeof s->client_keys_dir, "%s", dir);
    s->client_keys = calloc(MAX_CLIENT_KEYS, 32);
    cm_status st = s->client_keys ? CM_OK : CM_FAIL(CM_ERR_NOMEM, "cannot allocate the client key table");
    struct dirent *e;
    while (st == CM_OK && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 4, ".pub") != 0)
            continue;
        if (s->n_client_keys == MAX_CLIENT_KEYS) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "'%s' holds more than %d client keys", dir, MAX_CLIENT_KEYS);
            break;
        }
        char path[2048], key[CM_CHAN_KEY_LEN + 1];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        st = cm_chan_curve_read_key(path, key);
        if (st == CM_OK)
            zmq_z85_decode(s->client_keys[s->n_client_keys++], key);
    }
    closedir(d);
    if (st == CM_OK && s->n_client_keys == 0)
        st = CM_FAIL(CM_ERR_INVALID_ARG,
                     "the client key directory '%s' holds no *.pub key; copy each trainer's "
                     "public key there",
                     dir);
    return st;
}

static cm_status check_config(const cm_chan_server_config *c) {
    if (!c->compute)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server: no compute callback");
    if (c->hidden_dtype != CM_DTYPE_BF16 && c->hidden_dtype != CM_DTYPE_F32)
        return CM_FAIL(CM_ERR_INVALID_ARG, "hidden dtype %s: answers are BF16 or F32",
                       cm_dtype_name(c->hidden_dtype));
    if (c->weights_id == 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server: no weights fingerprint (weights_id is 0)");
    if (c->hidden_size < 1 || c->n_layers < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "hidden size %u and layer count %u must be at least 1",
                       c->hidden_size, c->n_layers);
    if (c->max_tokens < 1 || c->max_tokens > (1u << 24))
        return CM_FAIL(CM_ERR_INVALID_ARG, "--max-tokens %u: expected 1 to %u", c->max_tokens, 1u << 24);
    if (c->max_req_layers < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "max layers per request must be at least 1");
    if (c->credits < 1 || c->credits > 1024)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--credits %u: expected 1 to 1024", c->credits);
    if (!c->encodings || c->encodings >> CM_ENCODING_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "encodings mask 0x%x names no known encoding", c->encodings);
    if (c->max_sessions < 1 || c->max_sessions > 4096)
        return CM_FAIL(CM_ERR_INVALID_ARG, "max sessions %u: expected 1 to 4096", c->max_sessions);
    if (c->heartbeat_ms < 10 || c->peer_timeout_ms <= c->heartbeat_ms)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "heartbeat %d ms and peer timeout %d ms: need heartbeat ≥ 10 ms and a "
                       "longer peer timeout",
                       c->heartbeat_ms, c->peer_timeout_ms);
    if (c->n_threads < 1 || c->n_threads > CM_COMPRESS_MAX_THREADS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--threads %d: expected 1 to %d", c->n_threads,
                       CM_COMPRESS_MAX_THREADS);
    if (c->n_workers < 0 || c->n_workers > CM_CHAN_MAX_WORKERS)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%d workers: expected 1 to %d", c->n_workers, CM_CHAN_MAX_WORKERS);
    if (c->curve_client_keys && !c->curve_secret_key)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "--curve-client-keys needs --curve-secret-key (the server's own key)");
    return CM_OK;
}

/* The workers' state (threads start in run()). */
static cm_status workers_create(cm_chan_server *s) {
    const uint32_t T = s->cfg.max_tokens, L = s->cfg.max_req_layers;
    const int      n = s->cfg.n_workers > 0 ? s->cfg.n_workers : 1;
    s->workers = calloc((size_t)n, sizeof *s->workers);
    if (!s->workers)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d workers", n);
    for (int i = 0; i < n; i++) {
        worker *k = &s->workers[i];
        s->n_workers = i + 1; /* what destroy releases */
        k->s = s;
        k->index = i;
        k->user = s->cfg.worker_users ? s->cfg.worker_users[i] : s->cfg.user;
        k->device = s->cfg.nccl_devices ? s->cfg.nccl_devices[i] : s->cfg.nccl ? s->cfg.nccl->device : 0;
        pthread_mutex_init(&k->w.mu, NULL);
        pthread_cond_init(&k->w.cv, NULL);
        pthread_mutex_init(&k->es.mu, NULL);
        pthread_cond_init(&k->es.cv, NULL);
        k->w.closing = calloc(2 * (size_t)s->cfg.max_sessions + 2, sizeof *k->w.closing);
        k->tokens = malloc((size_t)T * 4);
        k->cu = malloc(((size_t)T + 1) * 4);
        k->layers = malloc((size_t)L * 4);
        k->out_ptrs = calloc(L, sizeof *k->out_ptrs);
        k->tensors = calloc(L, sizeof *k->tensors);
        k->es.announced = calloc(L, 1);
        if (!k->w.closing || !k->tokens || !k->cu || !k->layers || !k->out_ptrs || !k->tensors || !k->es.announced)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate worker %d's tables for %u tokens", i, T);
        cm_compress_config cc = CM_COMPRESS_CONFIG_DEFAULT;
        cc.n_threads = s->cfg.n_threads;
        cc.level = s->cfg.zstd_level;
        CM_TRY(cm_compress_create(&k->cc, &cc));
    }
    return CM_OK;
}

static void workers_destroy(cm_chan_server *s) {
    for (int i = 0; s->workers && i < s->n_workers; i++) {
        worker *k = &s->workers[i];
        for (int j = 0; j < k->n_pool; j++)
            free(k->pool[j].data);
        for (uint32_t j = 0; j < k->w.n_closing; j++) /* left by a run that failed */
            s->cfg.nccl->close(k->user, k->w.closing[j]);
        cm_compress_destroy(&k->cc);
        free(k->w.head);
        free(k->w.closing);
        free(k->tokens);
        free(k->cu);
        free(k->layers);
        free(k->out_block);
        free(k->out_ptrs);
        free(k->conv);
        free(k->tensors);
        free(k->es.announced);
        pthread_cond_destroy(&k->es.cv);
        pthread_mutex_destroy(&k->es.mu);
        pthread_cond_destroy(&k->w.cv);
        pthread_mutex_destroy(&k->w.mu);
    }
    free(s->workers);
    s->workers = NULL;
}

cm_status cm_chan_server_create(cm_chan_server **out, const cm_chan_server_config *cfg) {
    *out = NULL;
    CM_TRY(check_config(cfg));
    int local;
    CM_TRY(cm_chan_endpoint_check(cfg->endpoint, &local));
    if (!local && (!cfg->curve_secret_key || !cfg->curve_client_keys))
        return CM_FAIL(
            CM_ERR_INVALID_ARG,
            "refusing to bind '%s' without CURVE: a non-loopback endpoint needs "
            "--curve-secret-key FILE and --curve-client-keys DIR; or bind tcp://127.0.0.1:PORT or ipc://PATH",
            cfg->endpoint);
    if (cfg->curve_secret_key)
        CM_TRY(cm_chan_curve_require("--curve-secret-key"));
    CM_TRY(cm_chan_bind_check_(cfg->endpoint));
    cm_chan_server *s = calloc(1, sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the server");
    s->cfg = *cfg;
    s->pipe_r = s->pipe_w = -1;
    pthread_mutex_init(&s->stats_mu, NULL);
    if (s->cfg.max_req_layers > s->cfg.n_layers)
        s->cfg.max_req_layers = s->cfg.n_layers;
    /* encoding nccl is offered exactly when the compute can send over NCCL */
    if (s->cfg.nccl && (!s->cfg.nccl->open || !s->cfg.nccl->close)) {
        cm_chan_server_destroy(&s);
        return CM_FAIL(CM_ERR_INVALID_ARG, "cm_chan_server: the NCCL hooks need open and close");
    }
    if (s->cfg.nccl)
        s->cfg.encodings |= 1u << CM_ENCODING_NCCL;
    else
        s->cfg.encodings &= ~(1u << CM_ENCODING_NCCL);
    if (!s->cfg.encodings) {
        cm_chan_server_destroy(&s);
        return CM_FAIL(CM_ERR_INVALID_ARG, "encoding nccl needs a server that computes on a GPU with NCCL");
    }
    s->cfg.endpoint = NULL; /* borrowed strings are not kept */
    s->cfg.curve_secret_key = NULL;
    s->cfg.curve_client_keys = NULL;
    snprintf(s->name, sizeof s->name, "%s", cfg->name ? cfg->name : "target");
    s->cfg.name = s->name;
    cm_status st = CM_OK;
    /* a trial WELCOME checks the name with the wire's own rules */
    cm_proto_welcome trial = {.weights_id = cfg->weights_id,
                              .hidden_dtype = cfg->hidden_dtype,
                              .hidden_size = 1,
                              .n_layers = 1,
                              .max_tokens = 1,
                              .credits = 1,
                              .encodings = cfg->encodings};
    snprintf(trial.name, sizeof trial.name, "%s", s->name);
    uint8_t tb[CM_PROTO_SMALL_FRAME_MAX];
    size_t  tl;
    CM_TRY_GOTO(cm_proto_welcome_encode(&trial, tb, sizeof tb, &tl), st, fail);

    const uint32_t T = s->cfg.max_tokens, L = s->cfg.max_req_layers;
    s->lim = (cm_proto_limits){.max_tokens = T,
                               .max_seqs = T,
                               .max_layers = L,
                               .max_layer_id = INT32_MAX,
                               .max_tensors = 0,
                               .max_body_bytes = 16 + 4 * (2 * T + 1 + L),
                               .max_tensor_bytes = 0,
                               .max_data_bytes = 0};
    s->sessions = calloc(s->cfg.max_sessions, sizeof *s->sessions);
    s->l_tokens = malloc((size_t)T * 4);
    s->l_cu = malloc(((size_t)T + 1) * 4);
    s->l_layers = malloc((size_t)L * 4);
    if (!s->sessions || !s->l_tokens || !s->l_cu || !s->l_layers) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the server's tables for %u tokens", T);
        goto fail;
    }
    CM_TRY_GOTO(workers_create(s), st, fail);
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        s->sessions[i].queue = calloc(s->cfg.credits, sizeof(qjob));
        if (!s->sessions[i].queue) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the session queues");
            goto fail;
        }
    }
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) {
        st = CM_FAIL(CM_ERR_IO, "cannot create the worker pipe: %s", strerror(errno));
        goto fail;
    }
    s->pipe_r = fds[0];
    s->pipe_w = fds[1];

    if (!(s->ctx = zmq_ctx_new())) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    char secret[CM_CHAN_KEY_LEN + 1], public_key[CM_CHAN_KEY_LEN + 1];
    if (cfg->curve_secret_key) {
        CM_TRY_GOTO(cm_chan_curve_read_key(cfg->curve_secret_key, secret), st, fail);
        if (zmq_curve_public(public_key, secret) != 0) {
            memset(secret, 0, sizeof secret);
            st = CM_FAIL(CM_ERR_FORMAT, "key file '%s' does not hold a CURVE secret key",
                         cfg->curve_secret_key);
            goto fail;
        }
    }
    if (cfg->curve_client_keys) {
        CM_TRY_GOTO(load_client_keys(s, cfg->curve_client_keys), st, fail);
        if (!(s->zap = zmq_socket(s->ctx, ZMQ_REP))) {
            st = CM_ZMQ(-1);
            goto fail;
        }
        CM_TRY_GOTO(cm_chan_set_int(s->zap, ZMQ_LINGER, 0), st, fail);
        CM_TRY_GOTO(CM_ZMQ(zmq_bind(s->zap, "inproc://zeromq.zap.01")), st, fail);
    }
    if (!(s->router = zmq_socket(s->ctx, ZMQ_ROUTER))) {
        st = CM_ZMQ(-1);
        goto fail;
    }
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_ROUTER_MANDATORY, 1), st, fail);
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_ROUTER_HANDOVER, 1), st, fail);
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_LINGER, 2000), st, fail);
    if (cm_chan_endpoint_ipv6_(cfg->endpoint))
        CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_IPV6, 1), st, fail);
    CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_SNDHWM, (int)(4 * s->cfg.credits + 64)), st, fail);
    CM_TRY_GOTO(
        cm_chan_set_i64(s->router, ZMQ_MAXMSGSIZE, CM_PROTO_HEADER_SIZE + (int64_t)s->lim.max_body_bytes), st,
        fail);
    if (cfg->curve_secret_key) {
        CM_TRY_GOTO(cm_chan_set_int(s->router, ZMQ_CURVE_SERVER, 1), st, fail);
        st = CM_ZMQ(zmq_setsockopt(s->router, ZMQ_CURVE_SECRETKEY, secret, CM_CHAN_KEY_LEN + 1));
        memset(secret, 0, sizeof secret);
        if (st != CM_OK)
            goto fail;
        if (s->zap)
            CM_TRY_GOTO(CM_ZMQ(zmq_setsockopt(s->router, ZMQ_ZAP_DOMAIN, "tandem", 6)), st, fail);
        CM_LOG_INFO("CURVE on: server public key %s, %s", public_key,
                    s->zap ? "clients checked against the key directory" : "any client that knows it");
    }
    if (zmq_bind(s->router, cfg->endpoint) != 0) {
        int e = zmq_errno();
        st =
            CM_FAIL(CM_ERR_ZMQ, "cannot bind '%s': %s%s", cfg->endpoint, zmq_strerror(e),
                    e == EADDRINUSE ? " (another server runs there? choose another port)"
                    : e == ENODEV ? " (a bind takes an IP address, '*' or an interface name, not a host name)"
                                  : "");
        goto fail;
    }
    size_t el = sizeof s->endpoint;
    if (zmq_getsockopt(s->router, ZMQ_LAST_ENDPOINT, s->endpoint, &el) != 0)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", cfg->endpoint);
    struct stat sb;
    if (strncmp(s->endpoint, "ipc://", 6) == 0 && s->endpoint[6] != '@' && stat(s->endpoint + 6, &sb) == 0) {
        s->ipc_ino = sb.st_ino;
        s->ipc_dev = sb.st_dev;
    }
    *out = s;
    return CM_OK;
fail:
    cm_chan_server_destroy(&s);
    return st;
}

void cm_chan_server_destroy(cm_chan_server **sp) {
    if (!sp || !*sp)
        return;
    cm_chan_server *s = *sp;
    if (s->sessions)
        for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
            if (s->sessions[i].used)
                cm_chan_drop_queue_(s, &s->sessions[i]);
            free(s->sessions[i].queue);
        }
    if (s->router)
        zmq_close(s->router);
    if (s->zap)
        zmq_close(s->zap);
    if (s->ctx)
        zmq_ctx_term(s->ctx); /* waits for queued messages (linger) and frees them */
    /* libzmq leaves an ipc:// socket file behind; remove it unless another server has bound
     * the path since (then the file is another inode) */
    struct stat sb;
    if (s->ipc_ino && stat(s->endpoint + 6, &sb) == 0 && sb.st_ino == s->ipc_ino && sb.st_dev == s->ipc_dev)
        unlink(s->endpoint + 6);
    if (s->pipe_r >= 0)
        close(s->pipe_r);
    if (s->pipe_w >= 0)
        close(s->pipe_w);
    workers_destroy(s);
    free(s->client_keys);
    free(s->sessions);
    free(s->l_tokens);
    free(s->l_cu);
    free(s->l_layers);
    pthread_mutex_destroy(&s->stats_mu);
    free(s);
    *sp = NULL;
}
