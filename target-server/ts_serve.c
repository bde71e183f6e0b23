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
#include <time.h>
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
#ifdef TANDEM_HAVE_NCCL
#include "ts_nccl.h"
#endif
#ifdef TANDEM_HAVE_CUDA
#include "ts_stage.h"
#endif

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: target-server serve --model DIR [options]\n"
        "\n"
        "Loads the target once and answers hidden-state requests from drafter-trainers over ZeroMQ\n"
        "until SIGTERM or SIGINT (then finishes the forward in progress, says BYE, exits 0).\n"
        "\n"
        "  --model DIR               Hugging Face model directory (config.json + safetensors)\n"
        "  --init checkpoint|random  weights from the checkpoint (default) or, for benchmarks, filled\n"
        "                            on the device from --seed with the checkpoint's shapes (then\n"
        "                            --model or --config may name a config.json alone)\n"
        "  --config FILE             the config.json for --init random (same as --model FILE)\n"
        "  --seed N                  seed of --init random (default 1)\n"
        "  --device cpu|cuda         kernel backend (default cpu)\n"
        "  --gpu LIST                cuda device ordinals, comma-separated: one model replica per GPU\n"
        "                            behind the one endpoint (default 0)\n"
        "  --replicas N              model replicas (default: one per --gpu entry; on cuda without\n"
        "                            --gpu, GPUs 0..N-1); each answers requests on its own\n"
        "  --precision bf16|fp32     cuda matrix products (default bf16, as dump)\n"
        "  --bind ENDPOINT           tcp://HOST:PORT (PORT may be '*') or ipc://PATH\n"
        "                            (default tcp://127.0.0.1:5555); a non-loopback address needs\n"
        "                            --curve-secret-key and --curve-client-keys\n"
        "  --endpoint-file PATH      write the bound endpoint (port resolved) to PATH once bound\n"
        "  --name NAME               target name shown to trainers (default: the model directory's)\n"
        "  --credits N               requests queued per trainer (default 4)\n"
        "  --threads N               compression threads (default: half the CPUs, 2 to 16)\n"
        "  --encoding LIST           encodings offered, comma-separated: raw, zstd, zstd-byteplane,\n"
        "                            fp8-zstd (lossy), or 'lossless' (default) or 'all'; each trainer\n"
        "                            picks one in its requests; with --device cuda and NCCL, trainers\n"
        "                            on a GPU of this host may also ask for 'nccl' (GPU to GPU, raw)\n"
        "  --zstd-level N            zstd level (default 1)\n"
        "  --dtype bf16|f32          dtype of the hidden states sent (default bf16, rounded RNE)\n"
        "  --max-tokens N            largest packed batch accepted (default 16384); on cuda each\n"
        "                            replica runs one forward of that size at start-up, so its memory\n"
        "                            is taken then, not during serving\n"
        "  --max-layers N            most layers per request (default 8)\n"
        "  --heartbeat-ms N          heartbeat to idle trainers (default 1000)\n"
        "  --peer-timeout-ms N       drop a trainer silent this long, with its queued work (default 5000)\n"
        "  --stats-interval S        per-session log line every S seconds (default 30; 0 = off)\n"
        "  --curve-secret-key FILE   this server's CURVE secret key (Z85 text)\n"
        "  --curve-client-keys DIR   accept only trainers whose public key is a DIR/*.pub file\n"
        "  --curve-keygen PREFIX     write a new key pair PREFIX.key (secret) and PREFIX.pub, then exit\n"
        "  --log-level L             debug, info, warn, error, off (default info; env TANDEM_LOG)\n");
}

#define TS_MAX_REPLICAS CM_CHAN_MAX_WORKERS

typedef struct serve_args {
    const char  *model, *device, *bind, *name, *endpoint_file, *curve_secret, *curve_clients, *keygen;
    int          gpus[TS_MAX_REPLICAS], n_gpus, replicas;
    int          threads, zstd_level, heartbeat_ms, peer_timeout_ms, stats_s;
    int          stream; /* cuda: compress layers while the forward runs (TANDEM_SERVE_STREAM=0: after it) */
    int          init_random;
    uint64_t     seed;
    long         credits, max_tokens, max_layers;
    uint32_t     encodings;
    cm_dtype     dtype;
    kn_gemm_mode mode;
} serve_args;

/* What one replica's worker thread owns: backend, context and model on its GPU. */
typedef struct serve_state {
    const serve_args *a;
    int               index, gpu;
    cm_chan_job      *job; /* the job being computed (its streamed tensors' waits read it) */
    const kn_backend *be;
    kn_ctx           *ctx;
    ts_model         *model;
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
} serve_state;

/* The replicas, and what STATUS reads on the loop thread. */
typedef struct serve_all {
    const serve_args    *a;
    const cm_target_cfg *cfg;
    serve_state         *reps;
    int                  n;
} serve_all;

static cm_chan_server *stop_target; /* the server the signal handler stops */

static void on_signal(int sig) {
    (void)sig;
    cm_chan_server_stop(stop_target);
}

// ----------------------------------------------------------------------------
// worker callbacks

static cm_status serve_init(void *user) {
    serve_state      *s = user;
    const serve_args *a = s->a;
    int64_t           t0 = (int64_t)time(NULL);
    kn_ctx_config     kc = KN_CTX_CONFIG_DEFAULT;
    kc.device = s->gpu;
    kc.gemm_mode = a->mode;
    CM_TRY(s->be->ctx_create(&s->ctx, &kc));
    ts_model_config mc = {.dir = a->model,
                          .backend = s->be,
                          .ctx = s->ctx,
                          .n_layers = -1,
                          .load_head = 0,
                          .bf16_weights = strcmp(s->be->name, "cpu") != 0 && a->mode == KN_GEMM_MODE_BF16,
                          .init_random = a->init_random,
                          .seed = a->seed};
    const int64_t t0_ms = cm_now_ms();
    CM_TRY(ts_model_load(&s->model, &mc));
    if (s->be != kn_backend_cpu()) { /* the GPU's memory and GEMM plans are taken now, not per request */
        CM_TRY(ts_model_warmup(s->model, a->max_tokens));
#ifdef TANDEM_HAVE_CUDA
        CM_TRY(ts_stage_create(&s->stage, s->ctx));
        CM_TRY(ts_stage_reserve(s->stage, s->cap_layers, a->max_tokens, ts_model_cfg(s->model)->hidden_size,
                                a->dtype));
#endif
    }
    atomic_store(&s->load_ms, (int)(cm_now_ms() - t0_ms));
    atomic_store(&s->loaded, 1);
    if (s->a->replicas > 1)
        CM_LOG_INFO("replica %d (%s %d): model ready in %lld s; answering requests", s->index, a->device, s->gpu,
                    (long long)((int64_t)time(NULL) - t0));
    else
        CM_LOG_INFO("model ready in %lld s; answering requests", (long long)((int64_t)time(NULL) - t0));
    return CM_OK;
}

static void serve_fini(void *user) {
    serve_state *s = user;
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
    ts_model_destroy(&s->model);
    if (s->be && s->ctx)
        s->be->ctx_destroy(&s->ctx);
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
    ts_capture cap = {.n_layers = L, .layers = s->layers, .layer_dev = s->dev_sorted};
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
    const serve_args *a = all->a;
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
    if (strcmp(a->device, "cuda") == 0) {
        cJSON_AddNumberToObject(o, "gpu", all->reps[0].gpu);
        cJSON *g = cJSON_AddArrayToObject(o, "gpus");
        for (int i = 0; i < all->n; i++)
            cJSON_AddItemToArray(g, cJSON_CreateNumber(all->reps[i].gpu));
    }
    cJSON_AddNumberToObject(o, "replicas", all->n);
    cJSON_AddStringToObject(o, "precision", a->mode == KN_GEMM_MODE_BF16 ? "bf16" : "fp32");
    cJSON_AddBoolToObject(o, "loaded", loaded);
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
    const cm_target_cfg    *cfg = ts_model_cfg(s->model);
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
    if (s->be != kn_backend_cpu())
        return compute_staged(s, job);
#endif
    ts_capture cap = {.n_layers = L, .layers = s->layers, .layer_out = s->outs};
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
static cm_status serve_fingerprint(const serve_args *a, uint64_t cfg_hash, uint64_t *id) {
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

static cm_status run_serve(const serve_args *a) {
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
    const int        n = a->replicas;
    serve_all        all = {.a = a, .cfg = &cfg, .n = n};
    CM_TRY_GOTO(kn_backend_get(a->device, &be), st, fail);
    CM_TRY_GOTO(cm_target_cfg_load(&cfg, a->model), st, fail);
    reps = calloc((size_t)n, sizeof *reps);
    if (!reps) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate %d replicas", n);
        goto fail;
    }
    all.reps = reps;
    for (int i = 0; i < n; i++) {
        serve_state *r = &reps[i];
        r->a = a;
        r->index = i;
        r->gpu = a->gpus[i];
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
    if (strcmp(a->device, "cuda") == 0) {
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
    cm_chan_server_destroy(&srv);
    for (int i = 0; reps && i < n; i++) {
        serve_fini(&reps[i]); /* no-op when the worker ran fini; frees a model left by a failed start */
        free(reps[i].order);
        free(reps[i].layers);
        free(reps[i].outs);
    }
    free(reps);
    return st;
}

static int parse_long(const char *flag, const char *val, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (end == val || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "target-server serve: %s '%s': expected a whole number from %ld to %ld\n", flag, val,
                lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

/* --gpu 0 or --gpu 0,1,3: distinct ordinals. */
static int parse_gpus(const char *val, int *gpus, int *n) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", val);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long v;
        if (*n == TS_MAX_REPLICAS) {
            fprintf(stderr, "target-server serve: --gpu '%s': at most %d GPUs\n", val, TS_MAX_REPLICAS);
            return 0;
        }
        if (!parse_long("--gpu", tok, 0, 1023, &v))
            return 0;
        for (int i = 0; i < *n; i++)
            if (gpus[i] == (int)v) {
                fprintf(stderr, "target-server serve: --gpu '%s' names GPU %ld twice\n", val, v);
                return 0;
            }
        gpus[(*n)++] = (int)v;
    }
    if (!*n)
        fprintf(stderr, "target-server serve: --gpu '%s' names no GPU\n", val);
    return *n > 0;
}

static int parse_encodings(const char *val, uint32_t *mask) {
    if (strcmp(val, "lossless") == 0) {
        *mask = CM_ENCODING_LOSSLESS_MASK;
        return 1;
    }
    if (strcmp(val, "all") == 0) {
        *mask = (1u << CM_ENCODING_END) - 1;
        return 1;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", val);
    *mask = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        cm_encoding e;
        if (cm_encoding_parse(tok, &e) != CM_OK) {
            fprintf(stderr, "target-server serve: --encoding '%s': %s\n", val, cm_last_error());
            return 0;
        }
        *mask |= 1u << e;
    }
    if (!*mask)
        fprintf(stderr, "target-server serve: --encoding '%s' names no encoding\n", val);
    return *mask != 0;
}

int ts_serve_main(int argc, char **argv) {
    serve_args a = {.device = "cpu",
                    .bind = "tcp://127.0.0.1:5555",
                    .threads = cm_chan_default_threads(),
                    .zstd_level = 1,
                    .heartbeat_ms = 1000,
                    .peer_timeout_ms = 5000,
                    .stats_s = 30,
                    .credits = 4,
                    .max_tokens = 16384,
                    .max_layers = 8,
                    .encodings = CM_ENCODING_LOSSLESS_MASK,
                    .dtype = CM_DTYPE_BF16,
                    .mode = KN_GEMM_MODE_BF16,
                    .seed = 1};
    for (int i = 0; i < argc; i++) {
        const char *f = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        long        v;
        if (strcmp(f, "-h") == 0 || strcmp(f, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (!val) {
            fprintf(stderr, "target-server serve: option '%s' needs a value (see --help)\n", f);
            return 2;
        }
        if (strcmp(f, "--model") == 0 || strcmp(f, "--config") == 0)
            a.model = val;
        else if (strcmp(f, "--init") == 0) {
            if (strcmp(val, "random") != 0 && strcmp(val, "checkpoint") != 0) {
                fprintf(stderr, "target-server serve: --init '%s': expected checkpoint or random\n", val);
                return 2;
            }
            a.init_random = strcmp(val, "random") == 0;
        } else if (strcmp(f, "--seed") == 0) {
            char *end;
            a.seed = strtoull(val, &end, 10);
            if (*end || !*val) {
                fprintf(stderr, "target-server serve: --seed '%s' is not a number\n", val);
                return 2;
            }
        } else if (strcmp(f, "--device") == 0)
            a.device = val;
        else if (strcmp(f, "--bind") == 0)
            a.bind = val;
        else if (strcmp(f, "--name") == 0)
            a.name = val;
        else if (strcmp(f, "--endpoint-file") == 0)
            a.endpoint_file = val;
        else if (strcmp(f, "--curve-secret-key") == 0)
            a.curve_secret = val;
        else if (strcmp(f, "--curve-client-keys") == 0)
            a.curve_clients = val;
        else if (strcmp(f, "--curve-keygen") == 0)
            a.keygen = val;
        else if (strcmp(f, "--encoding") == 0) {
            if (!parse_encodings(val, &a.encodings))
                return 2;
        } else if (strcmp(f, "--dtype") == 0) {
            if (strcmp(val, "bf16") == 0)
                a.dtype = CM_DTYPE_BF16;
            else if (strcmp(val, "f32") == 0)
                a.dtype = CM_DTYPE_F32;
            else {
                fprintf(stderr, "target-server serve: --dtype '%s': expected bf16 or f32\n", val);
                return 2;
            }
        } else if (strcmp(f, "--precision") == 0) {
            if (strcmp(val, "bf16") == 0)
                a.mode = KN_GEMM_MODE_BF16;
            else if (strcmp(val, "fp32") == 0)
                a.mode = KN_GEMM_MODE_F32;
            else {
                fprintf(stderr, "target-server serve: --precision '%s': expected bf16 or fp32\n", val);
                return 2;
            }
        } else if (strcmp(f, "--log-level") == 0) {
            int l = cm_log_level_parse(val);
            if (l < 0) {
                fprintf(stderr,
                        "target-server serve: --log-level '%s': expected debug, info, warn, error or off\n",
                        val);
                return 2;
            }
            cm_log_set_level((cm_log_level)l);
        } else if (strcmp(f, "--gpu") == 0) {
            if (!parse_gpus(val, a.gpus, &a.n_gpus))
                return 2;
        } else if (strcmp(f, "--replicas") == 0) {
            if (!parse_long(f, val, 1, TS_MAX_REPLICAS, &v))
                return 2;
            a.replicas = (int)v;
        } else if (strcmp(f, "--credits") == 0) {
            if (!parse_long(f, val, 1, 1024, &a.credits))
                return 2;
        } else if (strcmp(f, "--threads") == 0) {
            if (!parse_long(f, val, 1, 256, &v))
                return 2;
            a.threads = (int)v;
        } else if (strcmp(f, "--zstd-level") == 0) {
            if (!parse_long(f, val, -7, 22, &v))
                return 2;
            a.zstd_level = (int)v;
        } else if (strcmp(f, "--max-tokens") == 0) {
            if (!parse_long(f, val, 1, 1 << 24, &a.max_tokens))
                return 2;
        } else if (strcmp(f, "--max-layers") == 0) {
            if (!parse_long(f, val, 1, 256, &a.max_layers))
                return 2;
        } else if (strcmp(f, "--heartbeat-ms") == 0) {
            if (!parse_long(f, val, 10, 600000, &v))
                return 2;
            a.heartbeat_ms = (int)v;
        } else if (strcmp(f, "--peer-timeout-ms") == 0) {
            if (!parse_long(f, val, 20, 3600000, &v))
                return 2;
            a.peer_timeout_ms = (int)v;
        } else if (strcmp(f, "--stats-interval") == 0) {
            if (!parse_long(f, val, 0, 86400, &v))
                return 2;
            a.stats_s = (int)v;
        } else {
            fprintf(stderr, "target-server serve: unknown option '%s' (see --help)\n", f);
            return 2;
        }
        i++;
    }
    if (a.keygen) {
        cm_status st = cm_chan_curve_keygen(a.keygen);
        if (st != CM_OK) {
            fprintf(stderr, "target-server serve: %s: %s\n", cm_status_str(st), cm_last_error());
            return 1;
        }
        printf("wrote %s.key (secret: keep it private) and %s.pub (public: give it to the other side)\n",
               a.keygen, a.keygen);
        return 0;
    }
    char what[96];
    snprintf(what, sizeof what, "--name '%.70s'", a.name ? a.name : "");
    if (a.name && cm_proto_name_check(what, a.name) != CM_OK) { /* trainers see it: the wire's rules */
        fprintf(stderr, "target-server serve: %s\n", cm_last_error());
        return 2;
    }
    if (!a.model) {
        fprintf(stderr, "target-server serve: --model DIR is required (or --init random --config FILE; see --help)\n");
        return 2;
    }
    if (a.n_gpus && a.replicas && a.n_gpus != a.replicas) {
        fprintf(stderr, "target-server serve: --gpu names %d GPUs but --replicas is %d; give one GPU per replica\n",
                a.n_gpus, a.replicas);
        return 2;
    }
    if (a.n_gpus > 1 && strcmp(a.device, "cuda") != 0) {
        fprintf(stderr, "target-server serve: --gpu %d,... needs --device cuda (use --replicas N on the cpu)\n",
                a.gpus[0]);
        return 2;
    }
    if (!a.replicas)
        a.replicas = a.n_gpus ? a.n_gpus : 1;
    const char *stream_env = getenv("TANDEM_SERVE_STREAM");
    a.stream = !stream_env || strcmp(stream_env, "0") != 0;
    for (int i = a.n_gpus; i < a.replicas; i++) /* cuda without --gpu: 0..N-1; cpu: ignored */
        a.gpus[i] = strcmp(a.device, "cuda") == 0 ? i : 0;
    if (a.peer_timeout_ms <= a.heartbeat_ms) {
        fprintf(stderr, "target-server serve: --peer-timeout-ms %d must exceed --heartbeat-ms %d\n",
                a.peer_timeout_ms, a.heartbeat_ms);
        return 2;
    }
    cm_status st = run_serve(&a);
    if (st != CM_OK) {
        fprintf(stderr, "target-server serve: %s: %s\n", cm_status_str(st), cm_last_error());
        return 1;
    }
    return 0;
}
