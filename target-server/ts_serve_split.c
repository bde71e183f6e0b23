/* target-server/ts_serve_split.c — `serve --stages N`: a replica split over N contexts
 * (ts_split.h) served by N workers. Each worker takes one request at a time like any other, and
 * they share the replica's stages: while one worker's pack runs in stage 1, the next worker's
 * runs in stage 0, so up to N packs are in flight and every GPU of the replica works. The first
 * worker to start loads the replica; the others wait for it and share it; the last to stop frees
 * it. Answers go through host memory; each worker has its own hand-over between the stages. */
#include "ts_serve_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cm_log.h"

/* Loads the replica's contexts and stages (the loading worker, outside the lock). */
static cm_status load(serve_state *s, serve_split *sh, const ts_model_config *mc) {
    const ts_serve_args *a  = s->a;
    kn_ctx_config        kc = KN_CTX_CONFIG_DEFAULT;
    kc.gemm_mode            = a->mode;
    for (int k = 0; k < a->stages; k++) {
        kc.device = a->gpus[sh->replica * a->stages + k];
        CM_TRY(s->be->ctx_create(&sh->ctx[k], &kc));
    }
    ts_model_config m = *mc;
    m.ctx             = sh->ctx[0];
    CM_TRY(ts_split_load(&sh->split, &m, a->stages, sh->ctx, NULL));
    if (s->be != kn_backend_cpu()) CM_TRY(ts_split_warmup(sh->split, a->max_tokens));
    for (int k = 0; k < a->stages; k++)
        CM_LOG_INFO("replica %d, stage %d: layers %d to %d on %s %d", sh->replica, k, ts_split_bound(sh->split, k),
                    ts_split_bound(sh->split, k + 1) - 1, a->device, a->gpus[sh->replica * a->stages + k]);
    return CM_OK;
}

static void release(serve_state *s, serve_split *sh) {
    ts_split_destroy(&sh->split);
    for (int k = 0; k < TS_SPLIT_MAX_STAGES; k++) {
        if (sh->ctx[k] && s->be->ctx_bind) s->be->ctx_bind(sh->ctx[k]); /* its device current while it goes */
        if (sh->ctx[k]) s->be->ctx_destroy(&sh->ctx[k]);
    }
}

cm_status ts_serve_split_init(serve_state *s, const ts_model_config *mc) {
    serve_split *sh = s->shared;
    pthread_mutex_lock(&sh->mu);
    const int loader = sh->state == 0;
    if (loader) sh->state = 1;
    pthread_mutex_unlock(&sh->mu);
    if (loader) {
        cm_status st = load(s, sh, mc);
        pthread_mutex_lock(&sh->mu);
        sh->st    = st;
        sh->state = st == CM_OK ? 2 : -1;
        if (st != CM_OK) snprintf(sh->why, sizeof sh->why, "%s", cm_last_error());
        pthread_cond_broadcast(&sh->cv);
        pthread_mutex_unlock(&sh->mu);
    }
    pthread_mutex_lock(&sh->mu);
    while (sh->state == 1) pthread_cond_wait(&sh->cv, &sh->mu);
    const int ok = sh->state == 2;
    if (ok) sh->users++;
    pthread_mutex_unlock(&sh->mu);
    if (!ok) {
        if (loader) return sh->st; /* its message is the current one */
        return CM_FAIL(sh->st, "replica %d did not load: %s", sh->replica, sh->why);
    }
    s->split = sh->split;
    s->ctx   = sh->ctx[0];
    return CM_OK;
}

void ts_serve_split_fini(serve_state *s) {
    serve_split *sh = s->shared;
    ts_split_handover_destroy(&s->ho); /* while the replica is still this worker's too */
    if (!sh) return;
    pthread_mutex_lock(&sh->mu);
    if (s->split) sh->users--;
    s->split = NULL;
    s->ctx   = NULL;
    /* the last worker out frees the replica (or the main thread, after a start that failed) */
    if (sh->users == 0 && sh->state != 1) release(s, sh);
    pthread_mutex_unlock(&sh->mu);
}

cm_status ts_serve_split_forward(serve_state *s, const cm_proto_request *r, const ts_capture *cap) {
    if (!s->ho) CM_TRY(ts_split_handover_create(s->split, &s->ho));
    return ts_split_forward_with(s->split, s->ho, r->tokens, r->n_tokens, r->cu_seqlens, (int)r->n_seqs, cap);
}
