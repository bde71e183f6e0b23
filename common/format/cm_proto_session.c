/* common/format/cm_proto_session.c — the codecs of cm_proto.h's session messages: HELLO,
 * WELCOME, ERROR, HEARTBEAT, BYE, NCCL_OFFER, NCCL_READY and STATUS (same rules as cm_proto.c). */
#include "cm_proto_int.h"

#include <string.h>

// ----------------------------------------------------------------------------
// HELLO, WELCOME, ERROR, HEARTBEAT, BYE

cm_status cm_proto_hello_encode(const cm_proto_hello *m, void *buf, size_t cap, size_t *len) {
    size_t n = cm_proto_safe_strlen_(m->name, CM_PROTO_NAME_MAX);
    CM_TRY(cm_proto_check_name_("HELLO", "name", m->name, n, CM_ERR_INVALID_ARG));
    if (m->credits < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "HELLO: field 'credits' must be at least 1");
    if (m->encodings == 0 || m->encodings >> CM_ENCODING_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "HELLO: field 'encodings' 0x%x names no known encoding",
                       m->encodings);
    size_t body = 26 + n;
    CM_TRY(cm_proto_need_cap_("HELLO", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u64(&w, m->target_id);
    w_u64(&w, m->weights_id);
    w_u32(&w, m->credits);
    w_u32(&w, m->encodings);
    w_str(&w, m->name);
    cm_proto_seal_(buf, CM_PROTO_TYPE_HELLO, 0, 0, 0, body, 0);
    return CM_OK;
}

cm_status cm_proto_hello_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                cm_proto_hello *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_HELLO, &h, &r, 0));
    cm_proto_hello m;
    CM_TRY(r_u64(&r, "target_id", &m.target_id));
    CM_TRY(r_u64(&r, "weights_id", &m.weights_id));
    CM_TRY(r_u32(&r, "credits", &m.credits));
    CM_TRY(r_u32(&r, "encodings", &m.encodings));
    CM_TRY(r_str(&r, "name", m.name));
    CM_TRY(r_end(&r));
    if (m.credits < 1)
        return CM_FAIL(CM_ERR_PROTOCOL, "HELLO: field 'credits' is 0, must be at least 1");
    if (m.encodings == 0 || m.encodings >> CM_ENCODING_END)
        return CM_FAIL(CM_ERR_PROTOCOL, "HELLO: field 'encodings' 0x%x is empty or names unknown encodings",
                       m.encodings);
    *out = m;
    return CM_OK;
}

static cm_status welcome_check(const cm_proto_welcome *m, cm_status st) {
    if (m->weights_id == 0)
        return CM_FAIL(st, "WELCOME: field 'weights_id' is 0");
    if (m->hidden_dtype != CM_DTYPE_F32 && m->hidden_dtype != CM_DTYPE_BF16)
        return CM_FAIL(st, "WELCOME: field 'hidden_dtype' is %d, expected F32 or BF16", (int)m->hidden_dtype);
    if (m->hidden_size < 1)
        return CM_FAIL(st, "WELCOME: field 'hidden_size' is 0");
    if (m->n_layers < 1)
        return CM_FAIL(st, "WELCOME: field 'n_layers' is 0");
    if (m->max_tokens < 1)
        return CM_FAIL(st, "WELCOME: field 'max_tokens' is 0");
    if (m->credits < 1)
        return CM_FAIL(st, "WELCOME: field 'credits' is 0");
    if (m->encodings == 0 || m->encodings >> CM_ENCODING_END)
        return CM_FAIL(st, "WELCOME: field 'encodings' 0x%x is empty or names unknown encodings",
                       m->encodings);
    return CM_OK;
}

cm_status cm_proto_welcome_encode(const cm_proto_welcome *m, void *buf, size_t cap, size_t *len) {
    size_t n = cm_proto_safe_strlen_(m->name, CM_PROTO_NAME_MAX);
    CM_TRY(cm_proto_check_name_("WELCOME", "name", m->name, n, CM_ERR_INVALID_ARG));
    CM_TRY(welcome_check(m, CM_ERR_INVALID_ARG));
    size_t body = 42 + n;
    CM_TRY(cm_proto_need_cap_("WELCOME", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u64(&w, m->target_id);
    w_u64(&w, m->weights_id);
    w_u16(&w, CM_PROTO_VERSION);
    w_u8(&w, (uint8_t)m->hidden_dtype);
    w_u8(&w, 0);
    w_u32(&w, m->hidden_size);
    w_u32(&w, m->n_layers);
    w_u32(&w, m->max_tokens);
    w_u32(&w, m->credits);
    w_u32(&w, m->encodings);
    w_str(&w, m->name);
    cm_proto_seal_(buf, CM_PROTO_TYPE_WELCOME, 0, 0, 0, body, 0);
    return CM_OK;
}

cm_status cm_proto_welcome_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                  cm_proto_welcome *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_WELCOME, &h, &r, 0));
    cm_proto_welcome m;
    uint8_t          dt, rsv;
    CM_TRY(r_u64(&r, "target_id", &m.target_id));
    CM_TRY(r_u64(&r, "weights_id", &m.weights_id));
    CM_TRY(r_u16(&r, "version", &m.version));
    CM_TRY(r_u8(&r, "hidden_dtype", &dt));
    CM_TRY(r_u8(&r, "reserved", &rsv));
    CM_TRY(r_u32(&r, "hidden_size", &m.hidden_size));
    CM_TRY(r_u32(&r, "n_layers", &m.n_layers));
    CM_TRY(r_u32(&r, "max_tokens", &m.max_tokens));
    CM_TRY(r_u32(&r, "credits", &m.credits));
    CM_TRY(r_u32(&r, "encodings", &m.encodings));
    CM_TRY(r_str(&r, "name", m.name));
    CM_TRY(r_end(&r));
    if (m.version != h.version)
        return CM_FAIL(CM_ERR_PROTOCOL, "WELCOME: field 'version' %u differs from the header's %u", m.version,
                       h.version);
    if (rsv)
        return CM_FAIL(CM_ERR_PROTOCOL, "WELCOME: field 'reserved' is %u, must be 0", rsv);
    m.hidden_dtype = (cm_dtype)dt;
    CM_TRY(welcome_check(&m, CM_ERR_PROTOCOL));
    *out = m;
    return CM_OK;
}

cm_status cm_proto_error_encode(const cm_proto_error *m, void *buf, size_t cap, size_t *len) {
    size_t n = cm_proto_safe_strlen_(m->message, CM_PROTO_MESSAGE_MAX);
    CM_TRY(cm_proto_check_message_(m->message, n, CM_ERR_INVALID_ARG));
    if (m->code < CM_PROTO_ERROR_BAD_REQUEST || m->code >= CM_PROTO_ERROR_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "ERROR: unknown code %d", (int)m->code);
    size_t body = 6 + n;
    CM_TRY(cm_proto_need_cap_("ERROR", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)m->code);
    w_u16(&w, (uint16_t)n);
    w_bytes(&w, m->message, n);
    cm_proto_seal_(buf, CM_PROTO_TYPE_ERROR, 0, 0, m->batch_id, body, 0);
    return CM_OK;
}

cm_status cm_proto_error_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                cm_proto_error *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_ERROR, &h, &r, 0));
    uint32_t code;
    uint16_t n;
    CM_TRY(r_u32(&r, "code", &code));
    CM_TRY(r_u16(&r, "message length", &n));
    if (n > CM_PROTO_MESSAGE_MAX)
        return CM_FAIL(CM_ERR_PROTOCOL, "ERROR: field 'message' has length %u, at most %d", n,
                       CM_PROTO_MESSAGE_MAX);
    CM_TRY(r_need(&r, n, "message"));
    const char *msg = (const char *)r.p + r.off;
    CM_TRY(cm_proto_check_message_(msg, n, CM_ERR_PROTOCOL));
    r.off += n;
    CM_TRY(r_end(&r));
    if (code < CM_PROTO_ERROR_BAD_REQUEST || code >= CM_PROTO_ERROR_END)
        return CM_FAIL(CM_ERR_PROTOCOL, "ERROR: unknown code %u in field 'code'", code);
    out->batch_id = h.id;
    out->code = (cm_proto_error_code)code;
    memcpy(out->message, msg, n);
    out->message[n] = '\0';
    return CM_OK;
}

cm_status cm_proto_heartbeat_encode(uint64_t seq, void *buf, size_t cap, size_t *len) {
    CM_TRY(cm_proto_need_cap_("HEARTBEAT", CM_PROTO_HEADER_SIZE, cap, len));
    cm_proto_seal_(buf, CM_PROTO_TYPE_HEARTBEAT, 0, 0, seq, 0, 0);
    return CM_OK;
}

cm_status cm_proto_heartbeat_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                    uint64_t *seq) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_HEARTBEAT, &h, &r, 0));
    *seq = h.id;
    return CM_OK;
}

cm_status cm_proto_bye_encode(void *buf, size_t cap, size_t *len) {
    CM_TRY(cm_proto_need_cap_("BYE", CM_PROTO_HEADER_SIZE, cap, len));
    cm_proto_seal_(buf, CM_PROTO_TYPE_BYE, 0, 0, 0, 0, 0);
    return CM_OK;
}

cm_status cm_proto_bye_decode(const void *frame, size_t len, const cm_proto_limits *lim) {
    cm_proto_header h;
    rd              r;
    return cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_BYE, &h, &r, 0);
}

// ----------------------------------------------------------------------------
// NCCL_OFFER, NCCL_READY

cm_status cm_proto_nccl_offer_encode(const cm_proto_nccl *m, void *buf, size_t cap, size_t *len) {
    if (m->uid_len < 1 || m->uid_len > CM_PROTO_NCCL_UID_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "NCCL_OFFER: uid_len %u is not in [1, %d]", m->uid_len,
                       CM_PROTO_NCCL_UID_MAX);
    size_t body = 8 + (size_t)m->uid_len;
    CM_TRY(cm_proto_need_cap_("NCCL_OFFER", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, m->device);
    w_u32(&w, m->uid_len);
    w_bytes(&w, m->uid, m->uid_len);
    cm_proto_seal_(buf, CM_PROTO_TYPE_NCCL_OFFER, 0, 0, 0, body, 0);
    return CM_OK;
}

cm_status cm_proto_nccl_offer_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                     cm_proto_nccl *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_NCCL_OFFER, &h, &r, 0));
    cm_proto_nccl m = {0};
    CM_TRY(r_u32(&r, "device", &m.device));
    CM_TRY(r_u32(&r, "uid_len", &m.uid_len));
    if (m.uid_len < 1 || m.uid_len > CM_PROTO_NCCL_UID_MAX)
        return CM_FAIL(CM_ERR_PROTOCOL, "NCCL_OFFER: field 'uid_len' is %u, must be in [1, %d]", m.uid_len,
                       CM_PROTO_NCCL_UID_MAX);
    CM_TRY(r_need(&r, m.uid_len, "uid"));
    memcpy(m.uid, r.p + r.off, m.uid_len);
    r.off += m.uid_len;
    CM_TRY(r_end(&r));
    *out = m;
    return CM_OK;
}

cm_status cm_proto_nccl_ready_encode(uint32_t device, void *buf, size_t cap, size_t *len) {
    CM_TRY(cm_proto_need_cap_("NCCL_READY", CM_PROTO_HEADER_SIZE + 4, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, device);
    cm_proto_seal_(buf, CM_PROTO_TYPE_NCCL_READY, 0, 0, 0, 4, 0);
    return CM_OK;
}

cm_status cm_proto_status_encode(const char *json, size_t n, void *buf, size_t cap, size_t *len) {
    if (!json) {
        CM_TRY(cm_proto_need_cap_("STATUS", CM_PROTO_HEADER_SIZE, cap, len));
        cm_proto_seal_(buf, CM_PROTO_TYPE_STATUS, 0, 0, 0, 0, 0);
        return CM_OK;
    }
    if (n < 1 || n > CM_PROTO_STATUS_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "STATUS: %zu bytes of JSON; 1 to %d", n, CM_PROTO_STATUS_MAX);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)json[i] < 0x20)
            return CM_FAIL(CM_ERR_INVALID_ARG, "STATUS: control byte 0x%02x at %zu", (unsigned char)json[i], i);
    CM_TRY(cm_proto_need_cap_("STATUS", CM_PROTO_HEADER_SIZE + 4 + n, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)n);
    w_bytes(&w, json, n);
    cm_proto_seal_(buf, CM_PROTO_TYPE_STATUS, 0, 0, 0, 4 + n, 0);
    return CM_OK;
}

cm_status cm_proto_status_decode(const void *frame, size_t len, const cm_proto_limits *lim, char *out,
                                 size_t cap, size_t *n) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_STATUS, &h, &r, 0));
    *n = 0;
    if (!h.body_len)
        return CM_OK;
    uint32_t m;
    CM_TRY(r_u32(&r, "n", &m));
    if (m < 1 || m > CM_PROTO_STATUS_MAX)
        return CM_FAIL(CM_ERR_PROTOCOL, "STATUS: field 'n' is %u, must be in [1, %d]", m, CM_PROTO_STATUS_MAX);
    CM_TRY(r_need(&r, m, "json"));
    const char *j = (const char *)r.p + r.off;
    for (uint32_t i = 0; i < m; i++)
        if ((unsigned char)j[i] < 0x20)
            return CM_FAIL(CM_ERR_PROTOCOL, "STATUS: control byte 0x%02x in field 'json' at %u", (unsigned char)j[i],
                           i);
    r.off += m;
    CM_TRY(r_end(&r));
    if (cap < (size_t)m + 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "STATUS: %u bytes of JSON do not fit a buffer of %zu", m, cap);
    memcpy(out, j, m);
    out[m] = '\0';
    *n = m;
    return CM_OK;
}

cm_status cm_proto_nccl_ready_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                     uint32_t *device) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_NCCL_READY, &h, &r, 0));
    CM_TRY(r_u32(&r, "device", device));
    return r_end(&r);
}
