/* common/chan/cm_chan_server_status.c — the server's answer to STATUS (loop thread): a JSON object of
 * what the server serves, its totals and one entry per session, with the target's own object
 * from cfg.status. */
#include "cm_chan_int.h"

#include <cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* STATUS: what the server serves, to whom, how fast; answered to anyone who can reach the
 * socket (the socket's CURVE rules apply), outside any session. */
void cm_chan_status_reply_(cm_chan_server *s, const uint8_t *ident, size_t ident_len, const uint8_t *p,
                           size_t len) {
    char   *json = NULL, info[4096] = "";
    size_t  n_json, dummy;
    uint8_t tmp[CM_PROTO_HEADER_SIZE];
    if (cm_proto_status_decode(p, len, &s->lim, (char *)tmp, sizeof tmp, &dummy) != CM_OK || dummy) {
        cm_chan_refuse_frame_(s, NULL, ident, ident_len, p, len, "a STATUS request carries no body");
        return;
    }
    int64_t              now = cm_now_ms();
    cm_chan_server_stats st;
    cm_chan_server_get_stats(s, &st);
    cJSON *o = cJSON_CreateObject(), *ses = cJSON_CreateArray(), *tot = cJSON_CreateObject();
    char   hex[20];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)s->cfg.target_id);
    cJSON_AddStringToObject(o, "name", s->name);
    cJSON_AddStringToObject(o, "target_id", hex);
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)s->cfg.weights_id);
    cJSON_AddStringToObject(o, "weights_id", hex);
    cJSON_AddStringToObject(o, "endpoint", s->endpoint);
    cJSON_AddNumberToObject(o, "uptime_s", (double)(now - s->started_ms) / 1e3);
    cJSON_AddStringToObject(o, "hidden_dtype", cm_dtype_name(s->cfg.hidden_dtype));
    cJSON_AddNumberToObject(o, "hidden_size", s->cfg.hidden_size);
    cJSON_AddNumberToObject(o, "n_layers", s->cfg.n_layers);
    cJSON_AddNumberToObject(o, "max_tokens", s->cfg.max_tokens);
    cJSON_AddNumberToObject(o, "credits", s->cfg.credits);
    cJSON *encs = cJSON_AddArrayToObject(o, "encodings");
    for (int e = 0; e < CM_ENCODING_END; e++)
        if (s->cfg.encodings >> e & 1u)
            cJSON_AddItemToArray(encs, cJSON_CreateString(cm_encoding_name(e)));
    cJSON_AddBoolToObject(o, "computing", s->n_busy > 0);
    cJSON_AddNumberToObject(o, "workers", s->n_workers);
    cJSON_AddNumberToObject(o, "workers_busy", s->n_busy);
    cJSON_AddBoolToObject(o, "stopping", s->stopping);
    if (s->cfg.status) {
        s->cfg.status(s->cfg.user, info, sizeof info);
        cJSON *t = cJSON_Parse(info);
        if (t)
            cJSON_AddItemToObject(o, "target", t);
    }
    cJSON_AddNumberToObject(tot, "sessions_opened", (double)st.sessions_opened);
    cJSON_AddNumberToObject(tot, "sessions_active", st.sessions_active);
    cJSON_AddNumberToObject(tot, "requests", (double)st.requests);
    cJSON_AddNumberToObject(tot, "resends", (double)st.resends);
    cJSON_AddNumberToObject(tot, "answers", (double)st.answers);
    cJSON_AddNumberToObject(tot, "tokens", (double)st.tokens);
    cJSON_AddNumberToObject(tot, "bytes_sent", (double)st.bytes_sent);
    cJSON_AddNumberToObject(tot, "errors_sent", (double)st.errors_sent);
    cJSON_AddNumberToObject(tot, "bad_frames", (double)st.bad_frames);
    cJSON_AddNumberToObject(tot, "dropped_jobs", (double)st.dropped_jobs);
    cJSON_AddNumberToObject(tot, "busy_s", st.busy_s);
    cJSON_AddNumberToObject(tot, "tokens_per_s",
                            now > s->started_ms ? (double)st.tokens * 1e3 / (double)(now - s->started_ms)
                                                : 0);
    cJSON_AddItemToObject(o, "totals", tot);
    for (uint32_t i = 0; i < s->cfg.max_sessions; i++) {
        const session *ss = &s->sessions[i];
        if (!ss->used)
            continue;
        cJSON *x = cJSON_CreateObject();
        double age = (double)(now - ss->started) / 1e3;
        cJSON_AddStringToObject(x, "name", ss->name);
        cJSON_AddStringToObject(x, "peer", ss->peer);
        cJSON_AddNumberToObject(x, "age_s", age);
        cJSON_AddNumberToObject(x, "credits", ss->credits);
        cJSON_AddBoolToObject(x, "nccl", ss->nccl_state == NCCL_UP);
        cJSON_AddNumberToObject(x, "queued", ss->q_len);
        cJSON_AddNumberToObject(x, "computing", ss->computing);
        cJSON_AddNumberToObject(x, "requests", (double)ss->n_requests);
        cJSON_AddNumberToObject(x, "resends", (double)ss->n_resends);
        cJSON_AddNumberToObject(x, "answers", (double)ss->n_answers);
        cJSON_AddNumberToObject(x, "errors", (double)ss->n_errors);
        cJSON_AddNumberToObject(x, "tokens", (double)ss->tokens);
        cJSON_AddNumberToObject(x, "bytes_sent", (double)ss->bytes);
        cJSON_AddNumberToObject(x, "tokens_per_s", age > 0 ? (double)ss->tokens / age : 0);
        cJSON_AddItemToArray(ses, x);
    }
    cJSON_AddItemToObject(o, "sessions", ses);
    json = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    n_json = json ? strlen(json) : 0;
    size_t   cap = CM_PROTO_HEADER_SIZE + 4 + (n_json < CM_PROTO_STATUS_MAX ? n_json : CM_PROTO_STATUS_MAX);
    uint8_t *buf = json ? malloc(cap) : NULL;
    size_t   flen;
    if (buf && cm_proto_status_encode(json, n_json, buf, cap, &flen) == CM_OK)
        cm_chan_send_to_(s, ident, ident_len, buf, flen);
    else
        cm_chan_send_error_(s, ident, ident_len, 0, CM_PROTO_ERROR_INTERNAL,
                            "cannot build the status (%zu bytes)", n_json);
    free(buf);
    cJSON_free(json);
}
