/* common/format/cm_proto.c — the wire format of cm_proto.h: names, the validation of names and
 * messages, the frame header (peek, seal, whole-frame checks), and the REQUEST codec. The
 * other messages are in cm_proto_session.c, cm_proto_answer.c and cm_proto_decode.c. Encoders
 * compute a message's exact size first, check the caller's capacity, then write with no further
 * checks. Decoders read through a bounds-checked cursor (cm_proto_int.h): every field read
 * checks the bytes left, every count is checked against the limits and the remaining bytes
 * before it is used, and every failure names the message and the field. */
#include "cm_proto_int.h"

#include <string.h>

#include "cm_bytes.h"
#include "cm_hash.h"

// ----------------------------------------------------------------------------
// names

const char *cm_proto_type_name(int type) {
    static const char *names[] = {"", "HELLO", "WELCOME", "REQUEST", "ANSWER", "ERROR", "HEARTBEAT", "BYE",
                                  "NCCL_OFFER", "NCCL_READY", "STATUS", "DECODE"};
    return type >= CM_PROTO_TYPE_HELLO && type < CM_PROTO_TYPE_END ? names[type] : "unknown";
}

const char *cm_encoding_name(int enc) {
    static const char *names[] = {"raw", "zstd", "zstd-byteplane", "fp8-zstd", "nccl"};
    return enc >= 0 && enc < CM_ENCODING_END ? names[enc] : "unknown";
}

cm_status cm_encoding_parse(const char *name, cm_encoding *out) {
    for (int e = 0; e < CM_ENCODING_END; e++)
        if (name && strcmp(name, cm_encoding_name(e)) == 0) {
            *out = (cm_encoding)e;
            return CM_OK;
        }
    return CM_FAIL(CM_ERR_INVALID_ARG,
                   "unknown encoding '%s': expected raw, zstd, zstd-byteplane or fp8-zstd",
                   name ? name : "(null)");
}

const char *cm_proto_error_name(int code) {
    static const char *names[] = {"",          "bad-request", "corrupt",  "version", "target-mismatch",
                                  "no-credit", "busy",        "internal", "shutdown"};
    return code >= CM_PROTO_ERROR_BAD_REQUEST && code < CM_PROTO_ERROR_END ? names[code] : "unknown";
}

// ----------------------------------------------------------------------------
// validation of names and messages (shared by encoders and decoders)

static int name_char_ok(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
}

/* 0 if the n bytes are a valid name, else the 1-based index of the first bad byte (or -1 for a
 * bad length). */
static long name_bad(const char *s, size_t n) {
    if (n < 1 || n > CM_PROTO_NAME_MAX)
        return -1;
    for (size_t i = 0; i < n; i++)
        if (!name_char_ok((unsigned char)s[i]))
            return (long)i + 1;
    return 0;
}

cm_status cm_proto_check_name_(const char *what, const char *field, const char *s, size_t n, cm_status st) {
    long bad = name_bad(s, n);
    if (bad < 0)
        return CM_FAIL(st, "%s: %s has %zu bytes; a name has 1 to %d", what, field, n, CM_PROTO_NAME_MAX);
    if (bad > 0)
        return CM_FAIL(st, "%s: %s has byte 0x%02x at position %ld; names use only A-Z a-z 0-9 _ . -", what,
                       field, (unsigned char)s[bad - 1], bad - 1);
    return CM_OK;
}

cm_status cm_proto_check_message_(const char *s, size_t n, cm_status st) {
    if (n > CM_PROTO_MESSAGE_MAX)
        return CM_FAIL(st, "ERROR: message has %zu bytes, at most %d", n, CM_PROTO_MESSAGE_MAX);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return CM_FAIL(st, "ERROR: message has control byte 0x%02x at position %zu", (unsigned char)s[i],
                           i);
    return CM_OK;
}

size_t cm_proto_safe_strlen_(const char *s, size_t max) {
    size_t n = 0;
    while (n <= max && s[n])
        n++;
    return n;
}

cm_status cm_proto_name_check(const char *what, const char *name) {
    return cm_proto_check_name_(what, "the name", name ? name : "", name ? strlen(name) : 0,
                                CM_ERR_INVALID_ARG);
}

// ----------------------------------------------------------------------------
// header

static void write_header(uint8_t *p, int type, uint32_t flags, uint32_t n_tensors, uint64_t id,
                         uint32_t body_len, uint64_t data_len, uint64_t body_checksum) {
    wr w = {p, 0};
    w_u32(&w, CM_PROTO_MAGIC);
    w_u16(&w, CM_PROTO_VERSION);
    w_u16(&w, (uint16_t)type);
    w_u32(&w, flags);
    w_u32(&w, n_tensors);
    w_u64(&w, id);
    w_u32(&w, body_len);
    w_u32(&w, 0);
    w_u64(&w, data_len);
    w_u64(&w, body_checksum);
    w_u64(&w, cm_xxh64(p, 48, 0));
}

/* Finishes a frame whose body has been written at p + HEADER_SIZE. */
void cm_proto_seal_(uint8_t *p, int type, uint32_t flags, uint32_t n_tensors, uint64_t id, size_t body_len,
                 uint64_t data_len) {
    write_header(p, type, flags, n_tensors, id, (uint32_t)body_len, data_len,
                 cm_xxh64(p + CM_PROTO_HEADER_SIZE, body_len, 0));
}

cm_status cm_proto_need_cap_(const char *what, size_t need, size_t cap, size_t *len) {
    *len = need;
    if (cap < need)
        return CM_FAIL(CM_ERR_INVALID_ARG, "%s: buffer of %zu bytes is too small; the frame needs %zu", what,
                       cap, need);
    return CM_OK;
}

cm_status cm_proto_peek(const void *frame, size_t len, const cm_proto_limits *lim, cm_proto_header *out) {
    const uint8_t *p = frame;
    if (!p || len < CM_PROTO_HEADER_SIZE)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame: truncated: %zu bytes, the header alone has %d", p ? len : 0,
                       CM_PROTO_HEADER_SIZE);
    uint32_t magic = cm_le_get_u32(p);
    if (magic != CM_PROTO_MAGIC)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "frame: bad magic 0x%08x (expected 0x%08x \"TNDM\"): not a tandem frame", magic,
                       CM_PROTO_MAGIC);
    cm_proto_header h;
    h.version = cm_le_get_u16(p + 4);
    /* an ANSWER is laid out alike from CM_PROTO_ANSWER_MIN_VERSION on (shard stores keep them) */
    const int answer_ok = h.version >= CM_PROTO_ANSWER_MIN_VERSION && h.version <= CM_PROTO_VERSION &&
                          cm_le_get_u16(p + 6) == CM_PROTO_TYPE_ANSWER;
    if (h.version != CM_PROTO_VERSION && !answer_ok)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "frame: protocol version %u is not spoken here (this build speaks %d); run matching "
                       "target-server and drafter-trainer builds",
                       h.version, CM_PROTO_VERSION);
    uint64_t want = cm_le_get_u64(p + 48), got = cm_xxh64(p, 48, 0);
    if (want != got)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "frame: header checksum mismatch (field header_checksum %016llx, computed "
                       "%016llx): corrupted header",
                       (unsigned long long)want, (unsigned long long)got);
    h.type = cm_le_get_u16(p + 6);
    h.flags = cm_le_get_u32(p + 8);
    h.n_tensors = cm_le_get_u32(p + 12);
    h.id = cm_le_get_u64(p + 16);
    h.body_len = cm_le_get_u32(p + 24);
    uint32_t rsv = cm_le_get_u32(p + 28);
    h.data_len = cm_le_get_u64(p + 32);
    h.body_checksum = cm_le_get_u64(p + 40);
    if (h.type < CM_PROTO_TYPE_HELLO || h.type >= CM_PROTO_TYPE_END)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame: unknown message type %u in field 'type'", h.type);
    const char *tn = cm_proto_type_name(h.type);
    uint32_t    allowed = h.type == CM_PROTO_TYPE_REQUEST ? CM_PROTO_FLAGS_KNOWN : 0;
    if (h.flags & ~allowed)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: unknown bits 0x%x in field 'flags'", tn,
                       h.flags & ~allowed);
    if (rsv)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: field 'reserved' is 0x%x, must be 0", tn, rsv);
    if (h.body_len > lim->max_body_bytes)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: field 'body_len' %u exceeds the limit of %u bytes", tn,
                       h.body_len, lim->max_body_bytes);
    if (h.type == CM_PROTO_TYPE_ANSWER) {
        if (h.n_tensors > lim->max_tensors)
            return CM_FAIL(CM_ERR_PROTOCOL, "frame ANSWER: field 'n_tensors' %u exceeds the limit of %u",
                           h.n_tensors, lim->max_tensors);
        if (h.data_len > lim->max_data_bytes)
            return CM_FAIL(CM_ERR_PROTOCOL,
                           "frame ANSWER: field 'data_len' %llu exceeds the limit of %llu bytes",
                           (unsigned long long)h.data_len, (unsigned long long)lim->max_data_bytes);
    } else {
        if (h.n_tensors)
            return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: field 'n_tensors' is %u, must be 0", tn, h.n_tensors);
        if (h.data_len)
            return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: field 'data_len' is %llu, must be 0", tn,
                           (unsigned long long)h.data_len);
    }
    if ((h.type == CM_PROTO_TYPE_HEARTBEAT || h.type == CM_PROTO_TYPE_BYE) && h.body_len)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: field 'body_len' is %u, must be 0", tn, h.body_len);
    *out = h;
    return CM_OK;
}

// ----------------------------------------------------------------------------
// frames

/* Validates the frame as a whole (header, type, exact size, body checksum) and sets up a
 * reader over its body. */
cm_status cm_proto_frame_open_(const void *frame, size_t len, const cm_proto_limits *lim, int type,
                            cm_proto_header *h, rd *body, size_t data_len) {
    CM_TRY(cm_proto_peek(frame, len, lim, h));
    const char *tn = cm_proto_type_name(type);
    if (h->type != type)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame: expected type %s, got %s", tn, cm_proto_type_name(h->type));
    uint64_t want = (uint64_t)CM_PROTO_HEADER_SIZE + h->body_len + data_len;
    if (len < want)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: truncated: %zu bytes, the header says %llu", tn, len,
                       (unsigned long long)want);
    if (len > want)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame %s: %llu trailing bytes after the %llu the header says", tn,
                       (unsigned long long)(len - want), (unsigned long long)want);
    const uint8_t *b = (const uint8_t *)frame + CM_PROTO_HEADER_SIZE;
    uint64_t       got = cm_xxh64(b, h->body_len, 0);
    if (got != h->body_checksum)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "frame %s: body checksum mismatch (field body_checksum %016llx, computed "
                       "%016llx): corrupted body",
                       tn, (unsigned long long)h->body_checksum, (unsigned long long)got);
    *body = (rd){b, h->body_len, 0, tn};
    return CM_OK;
}

// ----------------------------------------------------------------------------
// REQUEST

size_t cm_proto_request_size(uint32_t n_tokens, uint32_t n_seqs, uint32_t n_layers) {
    return CM_PROTO_HEADER_SIZE + 16 + 4 * ((size_t)n_tokens + n_seqs + 1 + n_layers);
}

/* The checks shared by encode (st = INVALID_ARG) and decode (st = PROTOCOL), on arrays already
 * in host memory. */
static cm_status request_check_arrays(const cm_proto_request *m, uint32_t max_layer_id, cm_status st) {
    for (uint32_t i = 0; i < m->n_tokens; i++)
        if (m->tokens[i] < 0)
            return CM_FAIL(st, "REQUEST: tokens[%u] is %d, must be ≥ 0", i, m->tokens[i]);
    if (m->cu_seqlens[0] != 0)
        return CM_FAIL(st, "REQUEST: cu_seqlens[0] is %d, must be 0", m->cu_seqlens[0]);
    for (uint32_t i = 1; i <= m->n_seqs; i++)
        if (m->cu_seqlens[i] <= m->cu_seqlens[i - 1])
            return CM_FAIL(st,
                           "REQUEST: cu_seqlens[%u] = %d does not exceed cu_seqlens[%u] = %d (empty or "
                           "backwards sequence)",
                           i, m->cu_seqlens[i], i - 1, m->cu_seqlens[i - 1]);
    if ((uint32_t)m->cu_seqlens[m->n_seqs] != m->n_tokens)
        return CM_FAIL(st, "REQUEST: cu_seqlens[%u] is %d, must equal n_tokens %u", m->n_seqs,
                       m->cu_seqlens[m->n_seqs], m->n_tokens);
    for (uint32_t i = 0; i < m->n_layers; i++) {
        if (m->layer_ids[i] < 0 || (uint32_t)m->layer_ids[i] >= max_layer_id)
            return CM_FAIL(st, "REQUEST: layer_ids[%u] is %d, must be in [0, %u)", i, m->layer_ids[i],
                           max_layer_id);
        for (uint32_t j = 0; j < i; j++)
            if (m->layer_ids[j] == m->layer_ids[i])
                return CM_FAIL(st, "REQUEST: layer_ids[%u] repeats layer %d (also layer_ids[%u])", i,
                               m->layer_ids[i], j);
    }
    return CM_OK;
}

cm_status cm_proto_request_encode(const cm_proto_request *m, void *buf, size_t cap, size_t *len) {
    if (m->n_tokens < 1 || m->n_seqs < 1 || m->n_layers < 1 || m->n_seqs > m->n_tokens ||
        m->n_tokens > INT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "REQUEST: needs 1 ≤ n_seqs ≤ n_tokens and n_layers ≥ 1 (got T=%u N=%u L=%u)",
                       m->n_tokens, m->n_seqs, m->n_layers);
    if ((unsigned)m->encoding >= CM_ENCODING_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "REQUEST: unknown encoding %d", (int)m->encoding);
    if (m->flags & ~CM_PROTO_FLAGS_KNOWN)
        return CM_FAIL(CM_ERR_INVALID_ARG, "REQUEST: unknown flags 0x%x", m->flags);
    CM_TRY(request_check_arrays(m, UINT32_MAX, CM_ERR_INVALID_ARG));
    size_t need = cm_proto_request_size(m->n_tokens, m->n_seqs, m->n_layers);
    if (need - CM_PROTO_HEADER_SIZE > UINT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "REQUEST: body of %zu bytes does not fit the u32 field 'body_len'",
                       need - CM_PROTO_HEADER_SIZE);
    CM_TRY(cm_proto_need_cap_("REQUEST", need, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)m->encoding);
    w_u32(&w, m->n_tokens);
    w_u32(&w, m->n_seqs);
    w_u32(&w, m->n_layers);
    w_bytes(&w, m->tokens, 4 * (size_t)m->n_tokens);
    w_bytes(&w, m->cu_seqlens, 4 * ((size_t)m->n_seqs + 1));
    w_bytes(&w, m->layer_ids, 4 * (size_t)m->n_layers);
    cm_proto_seal_(buf, CM_PROTO_TYPE_REQUEST, m->flags, 0, m->batch_id, need - CM_PROTO_HEADER_SIZE, 0);
    return CM_OK;
}

cm_status cm_proto_request_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                  cm_proto_request *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_REQUEST, &h, &r, 0));
    uint32_t enc, T, N, L;
    CM_TRY(r_u32(&r, "encoding", &enc));
    CM_TRY(r_u32(&r, "n_tokens", &T));
    CM_TRY(r_u32(&r, "n_seqs", &N));
    CM_TRY(r_u32(&r, "n_layers", &L));
    if (enc >= CM_ENCODING_END)
        return CM_FAIL(CM_ERR_PROTOCOL, "REQUEST: unknown encoding %u in field 'encoding'", enc);
    if (T < 1 || T > lim->max_tokens)
        return CM_FAIL(CM_ERR_PROTOCOL, "REQUEST: field 'n_tokens' is %u, must be in [1, %u]", T,
                       lim->max_tokens);
    if (N < 1 || N > T || N > lim->max_seqs)
        return CM_FAIL(CM_ERR_PROTOCOL, "REQUEST: field 'n_seqs' is %u, must be in [1, min(n_tokens %u, %u)]",
                       N, T, lim->max_seqs);
    if (L < 1 || L > lim->max_layers)
        return CM_FAIL(CM_ERR_PROTOCOL, "REQUEST: field 'n_layers' is %u, must be in [1, %u]", L,
                       lim->max_layers);
    uint64_t want = 16 + 4 * ((uint64_t)T + N + 1 + L);
    if (want != r.len)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "REQUEST: body has %zu bytes, but n_tokens %u, n_seqs %u, n_layers %u need %llu",
                       r.len, T, N, L, (unsigned long long)want);
    if (!out->tokens || !out->cu_seqlens || !out->layer_ids || T > out->cap_tokens ||
        N + 1 > out->cap_cu_seqlens || L > out->cap_layers)
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "REQUEST: caller arrays hold %u tokens, %u cu_seqlens, %u layers; the "
                       "request has %u, %u, %u (size them from the limits)",
                       out->cap_tokens, out->cap_cu_seqlens, out->cap_layers, T, N + 1, L);
    const uint8_t *p = r.p + r.off;
    memcpy(out->tokens, p, 4 * (size_t)T);
    memcpy(out->cu_seqlens, p + 4 * (size_t)T, 4 * ((size_t)N + 1));
    memcpy(out->layer_ids, p + 4 * ((size_t)T + N + 1), 4 * (size_t)L);
    out->batch_id = h.id;
    out->flags = h.flags;
    out->encoding = (cm_encoding)enc;
    out->n_tokens = T;
    out->n_seqs = N;
    out->n_layers = L;
    return request_check_arrays(out, lim->max_layer_id, CM_ERR_PROTOCOL);
}
