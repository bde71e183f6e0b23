/* target-server/ts_serve.c — `target-server serve` (see ts_serve.h and --help). The config is
 * read and the endpoint bound first, so a bad model directory, a busy port or a refused
 * non-loopback bind fail in a second; the weights then load on the cm_chan worker thread (the
 * thread that runs every forward, so device state stays on one thread) while trainers may
 * already attach. Each request runs one forward over its packed batch with capture of the
 * wanted layers (stopping after the last one); captures holding NaN, Inf or only zeros are
 * refused rather than sent. SIGTERM/SIGINT ask the loop to stop (the handler does one atomic
 * store through the only file-scope pointer). */
#include "ts_serve.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cJSON.h>
#include <stdatomic.h>

#include "cm_cfg_hash.h"
#include "cm_chan.h"
#include "cm_log.h"
#include "cm_time.h"
#include "cm_weights_id.h"
#include "kn_backend.h"
#include "ts_model.h"
#include "ts_serve_int.h"
#ifdef TANDEM_HAVE_NCCL
#include "ts_nccl.h"
#endif
#ifdef TANDEM_HAVE_CUDA
#include "ts_stage.h"
#endif

static cm_chan_server *stop_target; /* the server the signal handler stops */

static void on_signal(int sig) {
    (void)sig;
    cm_chan_server_stop(stop_target);
}

// ----------------------------------------------------------------------------
// worker callbacks

static cm_status serve_init(void *user) {
    serve_state      *s = user;
    const ts_serve_args *a = s->a;
    const double      t0 = cm_now_s();
    ts_model_config mc = {.dir = a->model,
                          .backend = s->be,
                          .n_layers = -1,
                          .load_head = a->decode_seqs > 0, /* decoding needs the head */
                          .bf16_weights = strcmp(s->be->name, "cpu") != 0 && a->mode == KN_GEMM_MODE_BF16,
                          .fp8 = a->fp8,
                          .init_random = a->init_random,
                          .seed = a->seed};
    const int64_t t0_ms = cm_now_ms();
    if (a->stages > 1) { /* the replica's stages, shared with its other workers (ts_serve_split.c) */
        CM_TRY(ts_serve_split_init(s, &mc));
    } else {
        kn_ctx_config kc = KN_CTX_CONFIG_DEFAULT;
        kc.device = s->gpu;
        kc.gemm_mode = a->mode;
        CM_TRY(s->be->ctx_create(&s->ctx, &kc));
        mc.ctx = s->ctx;
        CM_TRY(ts_model_load(&s->model, &mc));
    }
    if (s->model && s->be != kn_backend_cpu()) { /* the GPU's memory and GEMM plans are taken now, not per request */
        CM_TRY(ts_model_warmup(s->model, a->max_tokens));
#ifdef TANDEM_HAVE_CUDA
        CM_TRY(ts_stage_create(&s->stage, s->ctx));
        CM_TRY(ts_stage_reserve(s->stage, s->cap_layers, a->max_tokens, ts_model_cfg(s->model)->hidden_size,
                                a->dtype));
#endif
    }
    atomic_store(&s->load_ms, (int)(cm_now_ms() - t0_ms));
    atomic_store(&s->loaded, 1);
    if (a->replicas > 1 || a->stages > 1)
        CM_LOG_INFO("replica %d%s (%s %d): model ready in %lld s; answering requests", s->replica,
                    a->stages > 1 ? ", a worker" : "", a->device, s->gpu, (long long)(cm_now_s() - t0));
    else
        CM_LOG_INFO("model ready in %lld s; answering requests", (long long)(cm_now_s() - t0));
    return CM_OK;
}

static void serve_fini(void *user) {
    serve_state *s = user;
    if (s->devs && s->be->ctx_bind)
        s->be->ctx_bind(s->ctx); /* the buffers' device current while they go */
    for (int i = 0; s->devs && i < s->cap_layers; i++)
        if (s->devs[i])
            s->be->free(s->ctx, s->devs[i]);
    free(s->devs);
    free(s->dev_sorted);
    s->devs = NULL;
    s->dev_sorted = NULL;
#ifdef TANDEM_HAVE_CUDA
    ts_stage_destroy(&s->stage);
#endif
    ts_serve_decode_fini(s);
    ts_model_destroy(&s->model);
    if (s->shared) {
        ts_serve_split_fini(s);
    } else if (s->be && s->ctx) {
        s->be->ctx_destroy(&s->ctx);
    }
}

/* Refuses a capture with NaN/Inf or nothing but zeros (docs/architecture.md, reliability: never trained on). */
static cm_status check_capture(const float *x, size_t n, int layer, int D, uint64_t batch) {
    size_t first_bad = n, n_bad = 0;
    int    nonzero = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) {
            if (!n_bad++)
                first_bad = i;
        } else if (x[i] != 0.0f) {
            nonzero = 1;
        }
    }
    if (n_bad)
        return CM_FAIL(CM_ERR_FORMAT,
                       "batch %llu: layer %d capture holds %zu NaN/Inf values (first at token %zu, "
                       "column %zu); refusing to send it",
                       (unsigned long long)batch, layer, n_bad, first_bad / (size_t)D, first_bad % (size_t)D);
    if (!nonzero && n)
        return CM_FAIL(CM_ERR_FORMAT, "batch %llu: layer %d capture is all zeros; refusing to send it",
                       (unsigned long long)batch, layer);
    return CM_OK;
}

#ifdef TANDEM_HAVE_CUDA
/* The captured layers in device memory (cuda): s->dev_sorted[k] for the k-th smallest layer,
 * s->devs[i] for request position i; s->order/s->layers are already set by serve_compute. */
static cm_status capture_on_device(serve_state *s, const cm_chan_job *job) {
    const cm_proto_request *r = job->req;
    const int               L = (int)r->n_layers;
    const int64_t           TD = (int64_t)r->n_tokens * job->hidden_size;
    if (s->be->ctx_bind)
        CM_TRY(s->be->ctx_bind(s->ctx)); /* a split's last stage may be current */
    if (!s->devs) {
        s->devs = calloc((size_t)s->cap_layers, sizeof *s->devs);
        s->dev_sorted = calloc((size_t)s->cap_layers, sizeof *s->dev_sorted);
        if (!s->devs || !s->dev_sorted)
            return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the device capture table");
    }
    if (TD > s->dev_elems) {
        for (int i = 0; i < s->cap_layers; i++) {
            if (s->devs[i])
                s->be->free(s->ctx, s->devs[i]);
            s->devs[i] = NULL;
        }
        s->dev_elems = 0;
        for (int i = 0; i < s->cap_layers; i++)
            CM_TRY(s->be->alloc(s->ctx, (void **)&s->devs[i], (size_t)TD * sizeof(float)));
        s->dev_elems = TD;
    }
    for (int k = 0; k < L; k++)
        s->dev_sorted[k] = s->devs[s->order[k]];
    ts_capture cap = {
        .n_layers = L, .layers = s->layers, .layer_dev = s->dev_sorted, .layer_dev_ctx = s->ctx};
    if (s->split) /* every stage copies its layers into this worker's buffers on the first stage's GPU */
        return ts_serve_split_forward(s, r, &cap);
    return ts_model_forward(s->model, r->tokens, r->n_tokens, r->cu_seqlens, (int)r->n_seqs, &cap);
}

/* ZeroMQ answers on cuda, streamed: as the forward passes a wanted layer, the layer is rounded
 * to the hidden dtype and checked on the GPU and copied to the host on a stream of its own
 * (ts_stage_put) while the next layers run; cm_chan's encoder compresses it as soon as the
 * copy is done (staged_wait), so only the last wanted layer is compressed after the forward. */
static cm_status staged_layer(void *user, int k, const float *x) {
    serve_state *s = user;
    cm_chan_job *job = s->job;
    const int    pos = s->order[k]; /* the capture goes in ascending layers; the answer in request order */
    CM_TRY(ts_stage_put(s->stage, pos, x, job->req->n_tokens, job->hidden_size, s->a->dtype, job->out[pos]));
    if (s->a->stream)
        cm_chan_job_ready(job, (uint32_t)pos);
    return CM_OK;
}

static cm_status staged_wait(void *arg, uint32_t i) {
    serve_state *s = arg;
    return ts_stage_wait(s->stage, (int)i, s->job->req->layer_ids[i], s->job->req->batch_id);
}

static cm_status compute_staged(serve_state *s, cm_chan_job *job) {
    const cm_proto_request *r = job->req;
    if (!s->stage)
        CM_TRY(ts_stage_create(&s->stage, s->ctx));
    s->job = job;
    job->out_dtype = s->a->dtype;
    job->wait = staged_wait;
    job->wait_arg = s;
    ts_capture cap = {.n_layers = (int)r->n_layers, .layers = s->layers, .on_layer = staged_layer, .user = s};
    CM_TRY(ts_model_forward(s->model, r->tokens, r->n_tokens, r->cu_seqlens, (int)r->n_seqs, &cap));
    if (s->a->stream)
        return CM_OK;
    for (uint32_t i = 0; i < r->n_layers; i++) /* not announced: every copy is done before compute returns */
        CM_TRY(staged_wait(s, i));
    return CM_OK;
}
#endif

#ifdef TANDEM_HAVE_NCCL
/* Encoding nccl: the captured layers stay on the GPU and leave it through the session's
 * communicator (ts_nccl_send). */
static cm_status compute_nccl(serve_state *s, cm_chan_job *job) {
    const cm_proto_request *r = job->req;
    CM_TRY(capture_on_device(s, job));
    CM_TRY(ts_nccl_send(job->nccl, s->ctx, s->devs, r->layer_ids, (int)r->n_layers, r->n_tokens, job->hidden_size,
                        s->a->dtype, r->batch_id, s->a->peer_timeout_ms));
    job->out_dtype = s->a->dtype;
    return CM_OK;
}

static cm_status serve_nccl_open(void *user, const cm_proto_nccl *offer, void **peer) {
    serve_state *s = user;
    if (!s->ctx)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "the target is not loaded");
    ts_nccl_peer *p = NULL;
    CM_TRY(ts_nccl_open(&p, offer, s->ctx, 60000));
    *peer = p;
    return CM_OK;
}

static void serve_nccl_close(void *user, void *peer) {
    (void)user;
    ts_nccl_peer *p = peer;
    ts_nccl_close(&p);
}
#else
static cm_status compute_nccl(serve_state *s, cm_chan_job *job) {
    (void)s;
    (void)job;
    return CM_FAIL(CM_ERR_UNSUPPORTED, "this target-server was built without NCCL");
}
#endif

/* STATUS's "target" object (loop thread: reads only the args, the config and the replicas'
 * atomics). */
static void serve_status(void *user, char *buf, size_t cap) {
    serve_all        *all = user;
    const ts_serve_args *a = all->a;
    cJSON            *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "model", a->model);
    cJSON_AddStringToObject(o, "model_type", all->cfg->model_type);
    cJSON_AddNumberToObject(o, "n_layers", all->cfg->n_layers);
    cJSON_AddNumberToObject(o, "hidden_size", all->cfg->hidden_size);
    cJSON_AddNumberToObject(o, "vocab_size", all->cfg->vocab_size);
    cJSON_AddStringToObject(o, "device", a->device);
    int loaded = 1, load_ms = 0;
    for (int i = 0; i < all->n; i++) {
        loaded &= atomic_load(&all->reps[i].loaded);
        int ms = atomic_load(&all->reps[i].load_ms);
        load_ms = ms > load_ms ? ms : load_ms;
    }
    if (strcmp(a->device, "cuda") == 0) { /* every replica's GPUs, stage after stage */
        cJSON_AddNumberToObject(o, "gpu", all->reps[0].gpu);
        cJSON *g = cJSON_AddArrayToObject(o, "gpus");
        for (int i = 0; i < a->replicas * a->stages; i++)
            cJSON_AddItemToArray(g, cJSON_CreateNumber(a->gpus[i]));
    }
    cJSON_AddNumberToObject(o, "replicas", a->replicas);
    cJSON_AddNumberToObject(o, "stages", a->stages);
    cJSON_AddStringToObject(o, "precision", a->fp8 ? "fp8" : a->mode == KN_GEMM_MODE_BF16 ? "bf16" : "fp32");
    cJSON_AddBoolToObject(o, "loaded", loaded);
    if (all->dec) {
        cJSON_AddStringToObject(o, "decode_endpoint", ts_serve_decode_endpoint(all->dec));
        cJSON_AddNumberToObject(o, "decode_seqs", a->decode_seqs);
        cJSON_AddNumberToObject(o, "decode_max_len", a->decode_max_len);
    }
    if (loaded)
        cJSON_AddNumberToObject(o, "load_s", load_ms / 1e3);
    char *j = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    snprintf(buf, cap, "%s", j && strlen(j) < cap ? j : "{}");
    cJSON_free(j);
}

/* cm_chan's host_lock/unlock: the worker's output buffers page-locked for the streamed copies. */
static cm_status serve_host_lock(void *user, void *p, size_t bytes) {
    serve_state *s = user;
    return s->be->host_pin(s->ctx, p, bytes);
}

static void serve_host_unlock(void *user, void *p) {
    serve_state *s = user;
    s->be->host_unpin(s->ctx, p);
}

static cm_status serve_compute(void *user, cm_chan_job *job) {
    serve_state            *s = user;
    const cm_proto_request *r = job->req;
    const cm_target_cfg    *cfg = s->split ? ts_split_cfg(s->split) : ts_model_cfg(s->model);
    /* cm_chan decoded and checked the request (counts, cu_seqlens, layer ids < n_layers and
     * distinct); what depends on the model is the token ids against its vocabulary */
    CM_TRY(ts_tokens_validate(cfg, r->tokens, r->n_tokens));
    int L = (int)r->n_layers;
    if (L > s->cap_layers) /* the capture tables' size (cm_chan holds L to --max-layers) */
        return CM_FAIL(CM_ERR_INVALID_ARG, "batch %llu asks for %d layers; at most %d",
                       (unsigned long long)r->batch_id, L, s->cap_layers);
    /* the capture wants ascending layers; the answer keeps the request's order */
    for (int i = 0; i < L; i++)
        s->order[i] = i;
    for (int i = 1; i < L; i++)
        for (int j = i; j > 0 && r->layer_ids[s->order[j - 1]] > r->layer_ids[s->order[j]]; j--) {
            int t = s->order[j];
            s->order[j] = s->order[j - 1];
            s->order[j - 1] = t;
        }
    for (int k = 0; k < L; k++) {
        s->layers[k] = r->layer_ids[s->order[k]];
        s->outs[k] = job->out[s->order[k]];
    }
    if (job->nccl)
        return compute_nccl(s, job);
#ifdef TANDEM_HAVE_CUDA
    if (s->be != kn_backend_cpu() && !s->split)
        return compute_staged(s, job);
#endif
    ts_capture cap = {.n_layers = L, .layers = s->layers, .layer_out = s->outs};
    if (s->split)
        CM_TRY(ts_serve_split_forward(s, r, &cap));
    else
        CM_TRY(ts_model_forward(s->model, r->tokens, r->n_tokens, r->cu_seqlens, (int)r->n_seqs, &cap));
    const size_t n = (size_t)r->n_tokens * job->hidden_size;
    for (int k = 0; k < L; k++)
        CM_TRY(check_capture(s->outs[k], n, s->layers[k], (int)job->hidden_size, r->batch_id));
    job->out_dtype = CM_DTYPE_F32;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// the command

static cm_status write_endpoint_file(const char *path, const char *endpoint) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--endpoint-file path is too long");
    FILE *f = fopen(tmp, "w");
    if (!f)
        return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", tmp, strerror(errno));
    int ok = fprintf(f, "%s\n", endpoint) > 0;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return CM_FAIL(CM_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
    }
    return CM_OK;
}

/* A cm_proto name from the model directory's last component. */
static void default_name(const char *dir, char *out, size_t cap) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    size_t b = n;
    while (b > 0 && dir[b - 1] != '/')
        b--;
    size_t k = 0;
    for (size_t i = b; i < n && k + 1 < cap && k < CM_PROTO_NAME_MAX; i++) {
        unsigned char ch = (unsigned char)dir[i];
        out[k++] = isalnum(ch) || ch == '_' || ch == '.' || ch == '-' ? (char)ch : '-';
    }
    out[k] = '\0';
    if (!k)
        snprintf(out, cap, "target");
}

/* The weights' fingerprint, hashed from the checkpoint's bytes on every start (the cache beside
 * the checkpoint is written for trainers, never trusted here); that read also brings the files
 * into the page cache for the load that follows. Random weights: derived from config and seed. */
static cm_status serve_fingerprint(const ts_serve_args *a, uint64_t cfg_hash, uint64_t *id) {
    if (a->init_random) {
        *id = cm_target_random_id(cfg_hash, a->seed);
        return CM_OK;
    }
    cm_st             *st = NULL;
    cm_weights_id_info wi;
    CM_TRY(cm_st_open_dir(&st, a->model));
    cm_status s = cm_weights_id_dir(st, a->model, CM_WEIGHTS_ID_WRITE_CACHE, 0, &wi);
    cm_st_destroy(&st);
    CM_TRY(s);
    CM_LOG_INFO("weights fingerprint %016llx: %d tensors, %.2f GB hashed in %.2f s (%.1f GB/s)",
                (unsigned long long)wi.id, wi.n_tensors, (double)wi.bytes / 1e9, wi.seconds,
                wi.seconds > 0 ? (double)wi.bytes / 1e9 / wi.seconds : 0.0);
    *id = wi.id;
    return CM_OK;
}

cm_status ts_serve_run(const ts_serve_args *a) {
    cm_status        st;
    cm_chan_server  *srv = NULL;
    serve_state     *reps = NULL;
    void            *users[TS_MAX_REPLICAS];
    uint32_t         devices[TS_MAX_REPLICAS];
    const kn_backend *be = NULL;
    cm_target_cfg    cfg;
    char             name[CM_PROTO_NAME_MAX + 1];
    struct sigaction sa = {0}, old_term, old_int;
    int              handlers = 0;
    const int        n = a->replicas * a->stages; /* workers: one per stage of each replica */
    serve_all        all = {.a = a, .cfg = &cfg, .n = n};
    CM_TRY_GOTO(kn_backend_get(a->device, &be), st, fail);
    CM_TRY_GOTO(cm_target_cfg_load(&cfg, a->model), st, fail);
    reps = calloc((size_t)n, sizeof *reps);
    if (!reps) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d replicas", n);
        goto fail;
    }
    all.reps = reps;
    if (a->stages > 1 && !(all.splits = calloc((size_t)a->replicas, sizeof *all.splits))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d split replicas", a->replicas);
        goto fail;
    }
    for (int i = 0; all.splits && i < a->replicas; i++) {
        pthread_mutex_init(&all.splits[i].mu, NULL);
        pthread_cond_init(&all.splits[i].cv, NULL);
        all.splits[i].replica = i;
    }
    for (int i = 0; i < n; i++) {
        serve_state *r = &reps[i];
        r->a = a;
        r->index = i;
        r->replica = i / a->stages;
        r->shared = all.splits ? &all.splits[r->replica] : NULL;
        r->gpu = a->gpus[r->replica * a->stages];
        r->be = be;
        r->cap_layers = (int)a->max_layers;
        r->order = malloc((size_t)r->cap_layers * sizeof *r->order);
        r->layers = malloc((size_t)r->cap_layers * sizeof *r->layers);
        r->outs = malloc((size_t)r->cap_layers * sizeof *r->outs);
        if (!r->order || !r->layers || !r->outs) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the capture tables");
            goto fail;
        }
        users[i] = r;
        devices[i] = (uint32_t)r->gpu;
    }
    (void)devices; /* NCCL_READY's GPUs, in builds with NCCL */
    if (a->name)
        snprintf(name, sizeof name, "%s", a->name);
    else
        default_name(a->model, name, sizeof name);

    cm_chan_server_config sc = CM_CHAN_SERVER_CONFIG_DEFAULT;
    sc.endpoint = a->bind;
    sc.name = name;
    /* the identity is the weights' fingerprint (random weights are another target: a trainer
     * expecting the checkpoint refuses them); the config hash rides along for messages */
    sc.target_id = cm_target_cfg_hash(&cfg);
    CM_TRY_GOTO(serve_fingerprint(a, sc.target_id, &sc.weights_id), st, fail);
    sc.hidden_dtype = a->dtype;
    sc.hidden_size = (uint32_t)cfg.hidden_size;
    sc.n_layers = (uint32_t)cfg.n_layers;
    sc.max_tokens = (uint32_t)a->max_tokens;
    sc.max_req_layers = (uint32_t)a->max_layers;
    sc.credits = (uint32_t)a->credits;
    sc.encodings = a->encodings;
    sc.heartbeat_ms = a->heartbeat_ms;
    sc.peer_timeout_ms = a->peer_timeout_ms;
    sc.n_threads = a->threads;
    sc.zstd_level = a->zstd_level;
    sc.stats_interval_ms = a->stats_s * 1000;
    sc.curve_secret_key = a->curve_secret;
    sc.curve_client_keys = a->curve_clients;
    sc.init = serve_init;
    sc.compute = serve_compute;
    sc.fini = serve_fini;
    sc.status = serve_status;
    sc.user = &all;
    sc.n_workers = n;
    sc.worker_users = users;
    if (be->host_pin && be->host_unpin) {
        sc.host_lock = serve_host_lock;
        sc.host_unlock = serve_host_unlock;
    }
#ifdef TANDEM_HAVE_NCCL
    const cm_chan_nccl_server nccl = {serve_nccl_open, serve_nccl_close, devices[0]};
    if (strcmp(a->device, "cuda") == 0) { /* a split replica sends from its first stage's GPU */
        sc.nccl = &nccl;
        sc.nccl_devices = devices;
    }
#endif
    CM_TRY_GOTO(cm_chan_server_create(&srv, &sc), st, fail);
    CM_LOG_INFO("target '%s' (%s, %d layers, hidden %d): weights %016llx, config %016llx, bound %s; loading "
                "weights on %s",
                name, cfg.model_type, cfg.n_layers, cfg.hidden_size, (unsigned long long)sc.weights_id,
                (unsigned long long)sc.target_id, cm_chan_server_endpoint(srv), be->name);
    if (n > 1)
        CM_LOG_INFO("%d replicas, each with its own copy of the weights", n);
    if (a->stages > 1)
        CM_LOG_INFO("each replica's layers split over %d stages (docs/target.md), with a worker per stage: up to %d "
                    "packs in flight per replica; NCCL answers leave from each replica's first GPU", a->stages,
                    a->stages);
    if (a->decode_seqs > 0) CM_TRY_GOTO(ts_serve_decode_start(&all.dec, srv, &all), st, fail);
    if (a->endpoint_file)
        CM_TRY_GOTO(write_endpoint_file(a->endpoint_file, cm_chan_server_endpoint(srv)), st, fail);

    stop_target = srv;
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, &old_term);
    sigaction(SIGINT, &sa, &old_int);
    handlers = 1;
    signal(SIGPIPE, SIG_IGN);
    st = cm_chan_server_run(srv);
fail:
    if (handlers) {
        sigaction(SIGTERM, &old_term, NULL);
        sigaction(SIGINT, &old_int, NULL);
    }
    if (srv) {
        cm_chan_server_stats ss;
        cm_chan_server_get_stats(srv, &ss);
        CM_LOG_INFO(
            "served %llu answers (%llu tokens, %.1f MB) in %llu sessions; %llu malformed frames refused",
            (unsigned long long)ss.answers, (unsigned long long)ss.tokens, (double)ss.bytes_sent / 1e6,
            (unsigned long long)ss.sessions_opened, (unsigned long long)ss.bad_frames);
    }
    stop_target = NULL;
    ts_serve_decode_stop(&all.dec); /* its steps run on a worker: before the server goes */
    cm_chan_server_destroy(&srv);
    for (int i = 0; reps && i < n; i++) {
        serve_fini(&reps[i]); /* no-op when the worker ran fini; frees a model left by a failed start */
        free(reps[i].order);
        free(reps[i].layers);
        free(reps[i].outs);
    }
    free(reps);
    for (int i = 0; all.splits && i < a->replicas; i++) {
        pthread_mutex_destroy(&all.splits[i].mu);
        pthread_cond_destroy(&all.splits[i].cv);
    }
    free(all.splits);
    return st;
}
