/* common/chan/cm_chan_server.c — the server's lifecycle (see cm_chan.h): create checks the config,
 * allocates the sessions and the workers' state, loads the CURVE keys and binds; start and join
 * run and end the worker threads (cm_chan_server_run, cm_chan_server_loop.c); stop asks the
 * loop to stop; destroy releases it all. The loop (cm_chan_server_loop.c and the files it
 * calls) and the workers (cm_chan_server_work.c) run on what create built. */
#include "cm_chan_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "cm_compress.h"
#include "cm_log.h"

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
        k->out_ptrs = calloc(L, sizeof *k->out_ptrs);
        k->tensors = calloc(L, sizeof *k->tensors);
        k->es.announced = calloc(L, 1);
        if (!k->w.closing || !k->out_ptrs || !k->tensors || !k->es.announced)
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
        cm_chan_request_release_(&k->w.rq);
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
    CM_TRY(cm_chan_server_endpoint_check_(cfg->endpoint, cfg->curve_secret_key, cfg->curve_client_keys));
    cm_chan_server *s = calloc(1, sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the server");
    s->cfg = *cfg;
    s->pipe_r = s->pipe_w = -1;
    pthread_mutex_init(&s->stats_mu, NULL);
    pthread_mutex_init(&s->call_mu, NULL);
    pthread_cond_init(&s->call_cv, NULL);
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
    if (!s->sessions) {
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
    CM_TRY_GOTO(cm_chan_pipe_(&s->pipe_r, &s->pipe_w, "the worker pipe"), st, fail);

    const cm_chan_listen l = {.endpoint = cfg->endpoint,
                              .curve_secret_key = cfg->curve_secret_key,
                              .curve_client_keys = cfg->curve_client_keys,
                              .what = "",
                              .linger_ms = 2000,
                              .sndhwm = (int)(4 * s->cfg.credits + 64),
                              .max_msg = CM_PROTO_HEADER_SIZE + (int64_t)s->lim.max_body_bytes};
    CM_TRY_GOTO(cm_chan_listen_(&l, &s->ctx, &s->router, &s->zap, s->endpoint, sizeof s->endpoint, &s->ipc_ino,
                                &s->ipc_dev),
                st, fail);
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
    for (uint32_t i = 0; s->sessions && i < s->cfg.max_sessions; i++) {
        for (uint32_t j = 0; s->sessions[i].queue && j < s->cfg.credits; j++)
            cm_chan_request_release_(&s->sessions[i].queue[j].rq);
        free(s->sessions[i].queue);
    }
    if (s->router)
        zmq_close(s->router);
    cm_chan_zap_close_(&s->zap);
    if (s->ctx)
        zmq_ctx_term(s->ctx); /* waits for queued messages (linger) and frees them */
    cm_chan_unbind_file_(s->endpoint, s->ipc_ino, s->ipc_dev);
    if (s->pipe_r >= 0)
        close(s->pipe_r);
    if (s->pipe_w >= 0)
        close(s->pipe_w);
    workers_destroy(s);
    free(s->sessions);
    cm_chan_request_release_(&s->req);
    pthread_mutex_destroy(&s->stats_mu);
    pthread_cond_destroy(&s->call_cv);
    pthread_mutex_destroy(&s->call_mu);
    free(s);
    *sp = NULL;
}

cm_status cm_chan_request_reserve_(cm_proto_request *r, uint32_t n_tokens, uint32_t n_layers) {
    n_tokens = n_tokens ? n_tokens : 1;
    n_layers = n_layers ? n_layers : 1;
    if (n_tokens > r->cap_tokens) {
        int32_t *tokens = realloc(r->tokens, (size_t)n_tokens * sizeof *tokens);
        if (tokens)
            r->tokens = tokens;
        int32_t *cu = tokens ? realloc(r->cu_seqlens, ((size_t)n_tokens + 1) * sizeof *cu) : NULL;
        if (cu)
            r->cu_seqlens = cu;
        if (!tokens || !cu)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a request of %u tokens", n_tokens);
        r->cap_tokens = n_tokens;
        r->cap_cu_seqlens = n_tokens + 1;
    }
    if (n_layers > r->cap_layers) {
        int32_t *layers = realloc(r->layer_ids, (size_t)n_layers * sizeof *layers);
        if (!layers)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate a request of %u layers", n_layers);
        r->layer_ids = layers;
        r->cap_layers = n_layers;
    }
    return CM_OK;
}

void cm_chan_request_release_(cm_proto_request *r) {
    free(r->tokens);
    free(r->cu_seqlens);
    free(r->layer_ids);
    *r = (cm_proto_request){0};
}

cm_status cm_chan_server_start_(cm_chan_server *s) {
    cm_status st = CM_OK;
    for (int i = 0; i < s->n_workers && st == CM_OK; i++) {
        if (pthread_create(&s->workers[i].thread, NULL, cm_chan_worker_main_, &s->workers[i]) != 0)
            st = CM_FAIL(CM_ERR_NOMEM, "cannot start worker thread %d", i);
        else
            s->workers[i].started = 1;
    }
    return st;
}

void cm_chan_server_join_(cm_chan_server *s) {
    for (int i = 0; i < s->n_workers; i++) {
        worker *k = &s->workers[i];
        if (!k->started)
            continue;
        pthread_mutex_lock(&k->w.mu);
        k->w.quit = 1;
        pthread_cond_signal(&k->w.cv);
        pthread_mutex_unlock(&k->w.mu);
        pthread_join(k->thread, NULL);
        k->started = 0;
    }
}

void cm_chan_server_stop(cm_chan_server *s) {
    if (s)
        atomic_store(&s->stop, 1);
}

void cm_chan_server_get_stats(cm_chan_server *s, cm_chan_server_stats *out) {
    pthread_mutex_lock(&s->stats_mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->stats_mu);
}

const char *cm_chan_server_endpoint(const cm_chan_server *s) {
    return s->endpoint;
}
