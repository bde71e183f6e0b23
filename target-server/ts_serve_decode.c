/* target-server/ts_serve_decode.c — the decoding endpoint of `serve` (docs/architecture.md,
 * "Decoding"): DECODE steps from clients such as `drafter-trainer eval`, received by a cm_dec
 * server on its own thread and run on replica 0's worker thread between hidden-state requests
 * (cm_chan_server_call), so the model that feeds training also verifies drafts and one thread
 * keeps owning it. The decoder (its cache in the replica's device memory, or over its stages
 * when the replica is split) is made there at the first step and freed there before the model. A client that falls silent for --decode-idle-s
 * loses its sequences. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_dec.h"
#include "cm_log.h"
#include "ts_serve_int.h"

struct ts_serve_decode {
    cm_chan_server *srv;
    serve_all      *all;
    cm_dec_server  *dec;
    cm_gen_cfg      gen;
    char            endpoint[512];
};

/* What one call to the worker carries. */
typedef struct call {
    ts_serve_decode       *sd;
    const char            *owner;
    const cm_proto_decode *rq;
    cm_proto_answer       *ans;
} call;

static cm_status ensure_decoder(ts_serve_decode *sd, serve_state *s) {
    if (s->decoder) return CM_OK;
    const ts_serve_args *a = sd->all->a;
    ts_decoder_config    c = {.max_seqs     = a->decode_seqs,
                              .max_len      = a->decode_max_len,
                              .max_step     = a->decode_max_step,
                              .max_forward  = a->max_tokens,
                              .hidden_dtype = a->dtype,
                              .gen          = sd->gen};
    CM_TRY(s->split ? ts_decoder_create_split(s->split, &c, &s->decoder) : ts_decoder_create(s->model, &c, &s->decoder));
    CM_LOG_INFO("decoding: %d sequences of up to %d tokens, %.1f MB of %s memory for their state%s", a->decode_seqs,
                a->decode_max_len, (double)ts_decoder_bytes(sd->all->cfg, &c) / 1e6, a->device,
                s->split ? ", spread over the replica's stages" : "");
    return CM_OK;
}

/* On replica 0's worker thread. */
static cm_status run_step(void *user, void *arg) {
    serve_state *s = user;
    call        *c = arg;
    if (!s->model && !s->split) return CM_FAIL(CM_ERR_PEER_GONE, "the model is not loaded yet; try again in a moment");
    CM_TRY(ensure_decoder(c->sd, s));
    return ts_decoder_step(s->decoder, c->owner, c->rq, c->ans);
}

static cm_status run_drop(void *user, void *arg) {
    serve_state *s = user;
    if (s->decoder) ts_decoder_drop(s->decoder, (const char *)arg);
    return CM_OK;
}

/* cm_dec's callbacks, on its thread. */
static cm_status on_step(void *user, const char *client, const cm_proto_decode *rq, cm_proto_answer *ans) {
    ts_serve_decode *sd = user;
    call             c  = {.sd = sd, .owner = client, .rq = rq, .ans = ans};
    return cm_chan_server_call(sd->srv, 0, run_step, &c);
}

static void on_drop(void *user, const char *client) {
    ts_serve_decode *sd = user;
    if (cm_chan_server_call(sd->srv, 0, run_drop, (void *)client) != CM_OK)
        CM_LOG_DEBUG("decoding: dropping '%s': %s", client, cm_last_error());
}

/* ipc://PATH → ipc://PATH-decode; tcp://HOST:PORT → tcp://HOST:* (a port of the system's choice,
 * found through STATUS). */
static cm_status derive_endpoint(const char *bind, char *out, size_t cap) {
    if (strncmp(bind, "ipc://", 6) == 0) {
        if ((size_t)snprintf(out, cap, "%s-decode", bind) >= cap)
            return CM_FAIL(CM_ERR_INVALID_ARG, "--bind '%s' is too long to derive the decoding endpoint", bind);
        return CM_OK;
    }
    const char *colon = strrchr(bind, ':');
    if (strncmp(bind, "tcp://", 6) != 0 || !colon || colon < bind + 6)
        return CM_FAIL(CM_ERR_INVALID_ARG, "cannot derive a decoding endpoint from --bind '%s'; give --decode-bind",
                       bind);
    if ((size_t)snprintf(out, cap, "%.*s:*", (int)(colon - bind), bind) >= cap)
        return CM_FAIL(CM_ERR_INVALID_ARG, "--bind '%s' is too long to derive the decoding endpoint", bind);
    return CM_OK;
}

cm_status ts_serve_decode_start(ts_serve_decode **out, cm_chan_server *srv, serve_all *all) {
    *out = NULL;
    const ts_serve_args *a  = all->a;
    ts_serve_decode     *sd = calloc(1, sizeof *sd);
    if (!sd) return CM_FAIL(CM_ERR_NOMEM, "cannot allocate the decoding endpoint");
    sd->srv = srv;
    sd->all = all;
    cm_status st = cm_gen_cfg_load(&sd->gen, a->model);
    if (st == CM_OK) {
        if (a->decode_bind)
            snprintf(sd->endpoint, sizeof sd->endpoint, "%s", a->decode_bind);
        else
            st = derive_endpoint(cm_chan_server_endpoint(srv), sd->endpoint, sizeof sd->endpoint);
    }
    if (st == CM_OK) {
        cm_dec_server_config dc = {.endpoint          = sd->endpoint,
                                   .curve_secret_key  = a->curve_secret,
                                   .curve_client_keys = a->curve_clients,
                                   .max_clients       = (uint32_t)(a->decode_seqs > 64 ? a->decode_seqs : 64),
                                   .idle_timeout_ms   = a->decode_idle_s * 1000,
                                   .n_threads         = a->threads,
                                   .zstd_level        = a->zstd_level,
                                   .step              = on_step,
                                   .drop              = on_drop,
                                   .user              = sd};
        cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
        lim.max_tokens      = (uint32_t)a->max_tokens;
        lim.max_seqs        = (uint32_t)a->decode_seqs;
        lim.max_layers      = (uint32_t)a->max_layers;
        lim.max_layer_id    = (uint32_t)all->cfg->n_layers;
        dc.limits           = lim;
        st                  = cm_dec_server_start(&sd->dec, &dc);
    }
    if (st != CM_OK) {
        free(sd);
        return st;
    }
    snprintf(sd->endpoint, sizeof sd->endpoint, "%s", cm_dec_server_endpoint(sd->dec));
    CM_LOG_INFO("decoding endpoint %s (%d sequences of up to %d tokens; drafter-trainer eval finds it through STATUS)",
                sd->endpoint, a->decode_seqs, a->decode_max_len);
    *out = sd;
    return CM_OK;
}

const char *ts_serve_decode_endpoint(const ts_serve_decode *sd) { return sd ? sd->endpoint : NULL; }

void ts_serve_decode_stop(ts_serve_decode **psd) {
    ts_serve_decode *sd = psd ? *psd : NULL;
    if (!sd) return;
    cm_dec_server_stop(&sd->dec);
    free(sd);
    *psd = NULL;
}

void ts_serve_decode_fini(serve_state *s) { ts_decoder_destroy(&s->decoder); }
