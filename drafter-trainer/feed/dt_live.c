/* drafter-trainer/feed/dt_live.c — the live hidden states of `train --server` (dt_live.h): one
 * cm_chan client per server (`--server a,b,...`), each with up to `credits` requests in flight
 * for the steps after the one being trained; step s goes to server s mod n, so the servers
 * compute in parallel and the assignment, like the data order, depends on the step alone.
 * Prefetched requests sit in a ring in step order; their answers are held (lent by their
 * client) until their step takes them (dt_live_get_taps: the taps as they arrived, in
 * target_layer_ids order) and gives them back (dt_live_release). Each request's token
 * fingerprint (cm_shard_batch_hash) is compared with the tokens the trainer loaded, so an
 * answer is never used for other tokens. dt_live_connect (also used by
 * precompute) waits for a server's WELCOME and says every few seconds what it is waiting for. */
#include "dt_live.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cm_time.h"
#include "cm_cfg_hash.h"
#include "cm_chan.h"
#include "cm_dtype.h"
#include "cm_log.h"
#include "cm_shard.h"
#ifdef TANDEM_HAVE_NCCL
#include "cm_nccl.h"
#endif

typedef struct live_req {
    uint64_t id;
    int64_t  step;
    int32_t  batch;
    uint64_t hash;
} live_req;

#define DT_LIVE_MAX_SERVERS 64

struct dt_live {
    cm_chan_client  *cls[DT_LIVE_MAX_SERVERS]; /* one per server */
    char            *endpoints[DT_LIVE_MAX_SERVERS];
    int              n_cl;
    dt_data         *data; /* the training data (borrowed): tokens of the steps ahead, for requests */
    int             *layer_ids;
    int              n_taps, hidden, credits, timeout_ms, n;
    int              depth; /* credits · n_cl: requests in flight over all servers */
    live_req        *ring;  /* [depth] requests in flight, oldest first */
    int              head, count;
    cm_chan_answer **held;    /* [depth] answers received ahead of their step */
    int             *held_cl; /* [depth] the client each held answer came from */
    int32_t         *order;
    int64_t          order_epoch;
    uint64_t         seed;
    int64_t          end, next_get, next_submit;
    uint64_t         extra_id; /* ids of batches asked for outside the plan */
    /* the answer lent to the step by dt_live_get_taps (device memory with encoding nccl) */
    int                 on_device;
    void               *nc[DT_LIVE_MAX_SERVERS]; /* cm_nccl_client per server */
    cm_chan_nccl_client hooks[DT_LIVE_MAX_SERVERS];
    int                 lent_slot, lent_planned; /* the answer lent (-1: none) */
};

cm_status dt_live_connect(cm_chan_client *cl, const char *ep, int64_t timeout_ms,
                          const volatile sig_atomic_t *stop, cm_proto_welcome *out) {
    const double t0 = cm_now_s();
    double       next = DT_CONNECT_PROGRESS_MS / 1000.0;
    for (;;) {
        /* short waits: the stop flag and the progress lines get a turn */
        double    left = (double)timeout_ms / 1000.0 - (cm_now_s() - t0);
        int       slice = left <= 0 ? 0 : left < 0.2 ? (int)(left * 1000.0) + 1 : 200;
        cm_status st = cm_chan_client_wait_ready(cl, slice, out);
        if (st != CM_ERR_TIMEOUT)
            return st;
        cm_chan_client_stats cs;
        cm_chan_client_get_stats(cl, &cs);
        /* the client's own "no WELCOME" problem carries the hint; before it, nothing was heard */
        const char *problem = cs.last_problem[0]
                                  ? cs.last_problem
                                  : "nothing heard yet (is `target-server serve` running there?)";
        double      waited = cm_now_s() - t0;
        if ((stop && *stop) || waited * 1000.0 >= (double)timeout_ms)
            return CM_FAIL(CM_ERR_TIMEOUT, "last problem: %s", problem);
        if (waited >= next) {
            struct stat sb;
            int         no_file = strncmp(ep, "ipc://", 6) == 0 && ep[6] != '@' && stat(ep + 6, &sb) != 0;
            CM_LOG_WARN("connecting to '%s': no WELCOME after %.0f s of %.0f s (--timeout-ms %lld); %slast "
                        "problem: %s",
                        ep, next, (double)timeout_ms / 1000.0, (long long)timeout_ms,
                        no_file ? "no socket file at that path; " : "", problem);
            next += DT_CONNECT_PROGRESS_MS / 1000.0;
        }
    }
}

void dt_live_destroy(dt_live **l) {
    if (!l || !*l)
        return;
    dt_live *s = *l;
    if (s->held)
        for (int i = 0; i < s->depth; i++)
            if (s->held[i])
                cm_chan_client_release(s->cls[s->held_cl[i]], &s->held[i]);
    for (int c = 0; c < s->n_cl; c++) {
        cm_chan_client_destroy(&s->cls[c]);
#ifdef TANDEM_HAVE_NCCL
        cm_nccl_client *nc = s->nc[c];
        if (nc) {
            cm_nccl_client_stats ns;
            cm_nccl_client_get_stats(nc, &ns);
            if (ns.answers)
                CM_LOG_INFO("NCCL from '%s': %llu answers, %.2f GB in %.3f s of receiving (%.1f GB/s), %llu "
                            "communicators",
                            s->endpoints[c], (unsigned long long)ns.answers, (double)ns.bytes / 1e9, ns.recv_s,
                            ns.recv_s > 0 ? (double)ns.bytes / 1e9 / ns.recv_s : 0.0, (unsigned long long)ns.sessions);
        }
        cm_nccl_client_destroy(&nc); /* after the client, whose I/O thread calls its hooks */
#endif
        free(s->endpoints[c]);
    }
    free(s->layer_ids);
    free(s->ring);
    free(s->held);
    free(s->held_cl);
    free(s->order);
    free(s);
    *l = NULL;
}

/* Checks the WELCOME against the trainer's target and drafter. */
static cm_status check_welcome(const dt_live *s, const dt_live_config *cfg, const char *endpoint,
                               const cm_proto_welcome *w) {
    char why[400];
    if (cm_target_identity_differs(why, sizeof why, w->target_id, w->weights_id, cfg->target_id, cfg->weights_id,
                                   "served there", "in --target"))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the server at '%s' serves target '%s', which is another model than --target: %s; train "
                       "against a server of the drafter's target, or pass its --target",
                       endpoint, w->name, why);
    if ((int64_t)w->hidden_size != cfg->hidden)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the server at '%s' (target '%s') has hidden size %u but the drafter's hidden_size is "
                       "%d; use a server of the drafter's target",
                       endpoint, w->name, w->hidden_size, cfg->hidden);
    for (int k = 0; k < cfg->n_taps; k++)
        if (cfg->layer_ids[k] < 0 || (uint32_t)cfg->layer_ids[k] >= w->n_layers)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "the drafter needs layer %d (target_layer_ids[%d]) but the server at '%s' (target "
                           "'%s') has layers [0, %u); choose tap ids below %u",
                           cfg->layer_ids[k], k, endpoint, w->name, w->n_layers, w->n_layers);
    if (dt_data_max_tokens(s->data) > (int64_t)w->max_tokens)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "the largest batch has %lld tokens but the server at '%s' takes at most %u; start it "
                       "with a larger --max-tokens or repack the data",
                       (long long)dt_data_max_tokens(s->data), endpoint, w->max_tokens);
    return CM_OK;
}

cm_status dt_live_open(dt_live **out, const dt_live_config *cfg, dt_data *data) {
    *out = NULL;
    cm_status st = CM_OK;
    if (!cfg->endpoint || cfg->credits < 1 || cfg->n_taps < 1 || cfg->hidden < 1 || cfg->timeout_ms < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "live source: bad config (endpoint, credits, taps, hidden, timeout)");
    dt_live *s = calloc(1, sizeof *s);
    if (!s)
        return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the live source");
    s->data = data;
    s->n_taps = cfg->n_taps;
    s->hidden = cfg->hidden;
    s->credits = cfg->credits;
    s->timeout_ms = cfg->timeout_ms;
    s->order_epoch = -1;
    s->extra_id = 1ull << 62;
    s->lent_slot = -1;
    /* "a,b,c": one server each, in this order */
    for (const char *p = cfg->endpoint; *p;) {
        const char *e = strchr(p, ',');
        size_t      len = e ? (size_t)(e - p) : strlen(p);
        if (!len || s->n_cl == DT_LIVE_MAX_SERVERS) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "--server '%s': expected 1 to %d comma-separated endpoints",
                         cfg->endpoint, DT_LIVE_MAX_SERVERS);
            goto fail;
        }
        if (!(s->endpoints[s->n_cl] = strndup(p, len))) {
            st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the live source");
            goto fail;
        }
        for (int c = 0; c < s->n_cl; c++)
            if (strcmp(s->endpoints[c], s->endpoints[s->n_cl]) == 0) {
                st = CM_FAIL(CM_ERR_INVALID_ARG, "--server names '%s' twice", s->endpoints[c]);
                s->n_cl++;
                goto fail;
            }
        s->n_cl++;
        p += len + (e != NULL);
        if (e && !*p) {
            st = CM_FAIL(CM_ERR_INVALID_ARG, "--server '%s' ends with a comma", cfg->endpoint);
            goto fail;
        }
    }
    s->depth = cfg->credits * s->n_cl;
    s->layer_ids = malloc((size_t)cfg->n_taps * sizeof *s->layer_ids);
    s->ring = calloc((size_t)s->depth, sizeof *s->ring);
    s->held = calloc((size_t)s->depth, sizeof *s->held);
    s->held_cl = calloc((size_t)s->depth, sizeof *s->held_cl);
    if (!s->n_cl || !s->layer_ids || !s->ring || !s->held || !s->held_cl) {
        st = s->n_cl ? CM_FAIL(CM_ERR_NOMEM, "cannot allocate the live source")
                     : CM_FAIL(CM_ERR_INVALID_ARG, "--server names no endpoint");
        goto fail;
    }
    memcpy(s->layer_ids, cfg->layer_ids, (size_t)cfg->n_taps * sizeof *s->layer_ids);
    s->n = dt_data_count(s->data);
    if (!(s->order = malloc((size_t)s->n * sizeof *s->order))) {
        st = CM_FAIL(CM_ERR_NOMEM, "cannot allocate the epoch order of %d batches", s->n);
        goto fail;
    }

    cm_proto_welcome first = {0};
    for (int c = 0; c < s->n_cl; c++) {
        const char           *ep = s->endpoints[c];
        cm_chan_client_config cc = CM_CHAN_CLIENT_CONFIG_DEFAULT;
        cc.endpoint = ep;
        cc.name = cfg->name ? cfg->name : "trainer";
        cc.credits = (uint32_t)cfg->credits;
        cc.encoding = cfg->encoding;
        cc.n_threads = cm_chan_default_threads(); /* decompression keeps up with a 27B answer per step */
        cc.curve_server_key = cfg->curve_server_key;
        cc.curve_secret_key = cfg->curve_secret_key;
        cc.host_lock = cfg->host_lock;
        cc.host_unlock = cfg->host_unlock;
        cc.host_user = cfg->host_user;
        cc.target_id = 0; /* checked below with a message naming --target; a returning server with
                             another identity is refused by the client itself */
        if (cfg->encoding == CM_ENCODING_NCCL) {
#ifdef TANDEM_HAVE_NCCL
            cm_nccl_client *nc = NULL;
            CM_TRY_GOTO(cm_nccl_client_create(&nc, cfg->device, (uint32_t)cfg->credits, cfg->timeout_ms), st, fail);
            s->nc[c] = nc;
            cm_nccl_client_hooks(nc, &s->hooks[c]);
            cc.nccl = &s->hooks[c];
            cc.accept = 0; /* answers must land in GPU memory */
            s->on_device = 1;
#else
            st = CM_FAIL(CM_ERR_UNSUPPORTED,
                         "--encoding nccl needs a build with CUDA and NCCL; use raw or zstd-byteplane");
            goto fail;
#endif
        }
        CM_TRY_GOTO(cm_chan_client_create(&s->cls[c], &cc), st, fail);
    }
    for (int c = 0; c < s->n_cl; c++) { /* the servers start up in parallel; then each is checked */
        const char      *ep = s->endpoints[c];
        cm_proto_welcome w;
        st = dt_live_connect(s->cls[c], ep, cfg->timeout_ms, NULL, &w);
        if (st == CM_ERR_TIMEOUT) {
            char why[512];
            snprintf(why, sizeof why, "%s", cm_last_error());
            st = CM_FAIL(CM_ERR_TIMEOUT,
                         "no target-server answered at '%s' within --timeout-ms %d (%s); start `target-server "
                         "serve` there or fix --server",
                         ep, cfg->timeout_ms, why);
            goto fail;
        }
        CM_TRY_GOTO(st, st, fail);
        CM_TRY_GOTO(check_welcome(s, cfg, ep, &w), st, fail);
        if (c == 0) {
            first = w;
        } else if (w.weights_id != first.weights_id || w.target_id != first.target_id ||
                   w.hidden_dtype != first.hidden_dtype) {
            st = CM_FAIL(CM_ERR_INVALID_ARG,
                         "the servers disagree: '%s' serves weights %016llx (config %016llx) as %s, '%s' serves "
                         "%016llx (config %016llx) as %s; every --server must serve the same target with the same "
                         "--dtype",
                         s->endpoints[0], (unsigned long long)first.weights_id, (unsigned long long)first.target_id,
                         cm_dtype_name(first.hidden_dtype), ep, (unsigned long long)w.weights_id,
                         (unsigned long long)w.target_id, cm_dtype_name(w.hidden_dtype));
            goto fail;
        }
        CM_LOG_INFO("live hidden states from '%s': target '%s' (hidden %u %s, %u layers), %d credits, %s", ep,
                    w.name, w.hidden_size, cm_dtype_name(w.hidden_dtype), w.n_layers, cfg->credits,
                    cm_encoding_name(cfg->encoding));
    }
    *out = s;
    return CM_OK;
fail:
    dt_live_destroy(&s);
    return st;
}

void dt_live_plan(dt_live *l, uint64_t seed, int64_t start, int64_t end) {
    l->seed = seed;
    l->next_get = l->next_submit = start;
    l->end = end;
    l->order_epoch = -1;
}

static int32_t batch_of(dt_live *s, int64_t step) {
    const int64_t per = dt_data_steps_per_epoch(s->data), e = step / per;
    if (e != s->order_epoch) {
        dt_data_epoch_order(s->data, s->seed, (uint64_t)e, s->order);
        s->order_epoch = e;
    }
    return dt_data_step_batch(s->data, s->order, step % per);
}

/* The server of a step (outside the plan: the first). */
static int server_of(const dt_live *s, int64_t step) {
    return step >= 0 ? (int)(step % s->n_cl) : 0;
}

/* Sends requests for the planned steps after next_get while credits allow. */
static cm_status top_up(dt_live *s) {
    while (s->next_submit < s->end && s->count < s->depth) {
        const int32_t batch = batch_of(s, s->next_submit);
        dt_batch      b;
        CM_TRY(dt_data_load_tokens(s->data, batch, &b));
        const uint64_t id = (uint64_t)s->next_submit + 1;
        cm_status      st = cm_chan_client_submit(s->cls[server_of(s, s->next_submit)], id, b.input_ids,
                                                  (uint32_t)b.T, b.cu_seqlens, (uint32_t)b.n_seq, s->layer_ids,
                                                  (uint32_t)s->n_taps);
        if (st == CM_ERR_TIMEOUT)
            break; /* that server's credits are in use: the steps go in order */
        CM_TRY(st);
        live_req *r = &s->ring[(s->head + s->count) % s->depth];
        *r = (live_req){id, s->next_submit, batch,
                        cm_shard_batch_hash(b.input_ids, (uint32_t)b.T, b.cu_seqlens, (uint32_t)b.n_seq)};
        s->count++;
        s->next_submit++;
    }
    return CM_OK;
}

/* Receives until the answer for id is held; its slot in *slot. */
static cm_status await(dt_live *s, uint64_t id, int c, int batch, int *slot) {
    double t0 = cm_now_s(), warned = t0;
    for (;;) {
        for (int i = 0; i < s->depth; i++)
            if (s->held[i] && s->held[i]->batch_id == id) {
                *slot = i;
                return CM_OK;
            }
        double waited = cm_now_s() - t0;
        if (waited * 1000.0 >= (double)s->timeout_ms) {
            cm_chan_client_stats cs;
            cm_chan_client_get_stats(s->cls[c], &cs);
            return CM_FAIL(
                CM_ERR_TIMEOUT,
                "no hidden states for batch %d from '%s' within --timeout-ms %d (last problem: %s); "
                "check that the server is running",
                batch, s->endpoints[c], s->timeout_ms, cs.last_problem[0] ? cs.last_problem : "none");
        }
        if (cm_now_s() - warned >= 10.0) {
            CM_LOG_WARN("waiting %.0f s for the hidden states of batch %d from '%s'", waited, batch,
                        s->endpoints[c]);
            warned = cm_now_s();
        }
        cm_chan_answer *a = NULL;
        cm_status       st = cm_chan_client_recv(s->cls[c], 200, &a);
        if (st == CM_ERR_TIMEOUT)
            continue;
        CM_TRY(st);
        int free_slot = -1;
        for (int i = 0; i < s->depth && free_slot < 0; i++)
            if (!s->held[i])
                free_slot = i;
        if (free_slot < 0) { /* cannot happen: credits bound the answers held */
            cm_chan_client_release(s->cls[c], &a);
            return CM_FAIL(CM_ERR_PROTOCOL, "live source: more answers held than credits");
        }
        s->held[free_slot] = a;
        s->held_cl[free_slot] = c;
    }
}

/* The answer for batch (tokens ids/cu) held in *slot after its checks; *planned says whether
 * it came from the plan (then live_done advances it). */
static cm_status live_take(dt_live *s, int batch, const int32_t *ids, int64_t T, const int32_t *cu, int n_seq,
                           int *slot, int *planned) {
    const uint64_t h = cm_shard_batch_hash(ids, (uint32_t)T, cu, (uint32_t)n_seq);
    uint64_t       id;
    int            c = 0;
    *slot = -1;
    *planned = s->next_get < s->end;
    if (*planned) {
        CM_TRY(top_up(s));
        const live_req *r = &s->ring[s->head];
        if (s->count == 0 || r->step != s->next_get || r->batch != batch)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "live source: step %lld asks for batch %d but the plan has batch %d; the trainer "
                           "must load batches in epoch order",
                           (long long)s->next_get + 1, batch, s->count ? r->batch : -1);
        if (r->hash != h)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "batch %d ('%s') changed between its request and its step; do not edit the data "
                           "during a run",
                           batch, dt_data_path(s->data, batch));
        id = r->id;
        c = server_of(s, r->step);
    } else { /* outside the plan: one request, answered before returning */
        if (s->count > 0)
            return CM_FAIL(CM_ERR_INVALID_ARG,
                           "live source: batch %d asked for while prefetches are in flight", batch);
        id = s->extra_id++;
        CM_TRY(cm_chan_client_submit(s->cls[c], id, ids, (uint32_t)T, cu, (uint32_t)n_seq, s->layer_ids,
                                     (uint32_t)s->n_taps));
    }
    CM_TRY(await(s, id, c, batch, slot));
    const char     *endpoint = s->endpoints[c];
    cm_chan_answer *a = s->held[*slot];
    const int64_t   D = s->hidden;
    if (a->status != CM_OK)
        return CM_FAIL(a->status, "the server at '%s' cannot serve batch %d ('%s'): %s", endpoint, batch,
                       dt_data_path(s->data, batch), a->message);
    if (a->n_tensors != (uint32_t)s->n_taps)
        return CM_FAIL(CM_ERR_PROTOCOL, "the server at '%s' answered batch %d with %u tensors, expected %d",
                       endpoint, batch, a->n_tensors, s->n_taps);
    for (int k = 0; k < s->n_taps; k++) {
        const cm_chan_tensor *t = &a->tensors[k];
        if (t->n_tokens != T || t->hidden != D || (t->dtype != CM_DTYPE_BF16 && t->dtype != CM_DTYPE_F32) ||
            t->dtype != a->tensors[0].dtype || t->on_device != s->on_device)
            return CM_FAIL(CM_ERR_PROTOCOL,
                           "the server at '%s' answered batch %d with tensor '%s' %s [%lld, %lld]%s, expected "
                           "[%lld, %lld]%s",
                           endpoint, batch, t->name, cm_dtype_name(t->dtype), (long long)t->n_tokens,
                           (long long)t->hidden, t->on_device ? " on the device" : "", (long long)T,
                           (long long)D, s->on_device ? " on the device" : "");
    }
    return CM_OK;
}

/* Releases the answer in slot and, for a planned one, advances the plan and sends the next
 * requests (they compute while this step trains). */
static cm_status live_done(dt_live *s, int slot, int planned, cm_status st) {
    if (slot >= 0)
        cm_chan_client_release(s->cls[s->held_cl[slot]], &s->held[slot]);
    if (planned && slot >= 0) {
        s->head = (s->head + 1) % s->depth;
        s->count--;
        s->next_get++;
        if (st == CM_OK)
            st = top_up(s);
    }
    return st;
}

cm_status dt_live_get_taps(dt_live *l, int batch, dt_batch *b) {
    if (l->lent_slot >= 0)
        return CM_FAIL(CM_ERR_INVALID_ARG, "live source: the previous batch's taps were not released");
    if (l->n_taps > DT_MAX_TAPS)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "%d taps; at most %d", l->n_taps, DT_MAX_TAPS);
    int       slot, planned;
    cm_status st = live_take(l, batch, b->input_ids, b->T, b->cu_seqlens, b->n_seq, &slot, &planned);
    if (st != CM_OK)
        return live_done(l, slot, planned, st);
    const cm_chan_answer *a = l->held[slot];
    b->target_hidden = NULL;
    b->taps_dt = a->tensors[0].dtype;
    for (int k = 0; k < l->n_taps; k++) {
        b->dev_taps[k] = l->on_device ? a->tensors[k].data : NULL;
        b->host_taps[k] = l->on_device ? NULL : a->tensors[k].data;
    }
    l->lent_slot = slot;
    l->lent_planned = planned;
    return CM_OK;
}

void dt_live_release(dt_live *l) {
    if (!l || l->lent_slot < 0)
        return;
    cm_status st = live_done(l, l->lent_slot, l->lent_planned, CM_OK);
    if (st != CM_OK) /* top_up failures surface at the next get, which retries them */
        cm_clear_error();
    l->lent_slot = -1;
}
