/* common/format/cm_proto.c — encoders and decoders of the wire format documented in cm_proto.h.
 * Encoders compute a message's exact size first, check the caller's capacity, then write with
 * no further checks. Decoders read through a bounds-checked cursor: every field read checks the
 * bytes left, every count is checked against the limits and the remaining bytes before it is
 * used, and every failure names the message and the field. */
#include "cm_proto.h"

#include <string.h>

#include "cm_bytes.h"
#include "cm_hash.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cm_proto assumes a little-endian host (the wire is little-endian and arrays are copied as is)"
#endif

// ----------------------------------------------------------------------------
// names

const char *cm_proto_type_name(int type) {
    static const char *names[] = {"", "HELLO", "WELCOME", "REQUEST", "ANSWER", "ERROR", "HEARTBEAT", "BYE",
                                  "NCCL_OFFER", "NCCL_READY", "STATUS"};
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
// little-endian writer (capacity checked by the caller before writing)

typedef struct wr {
    uint8_t *p;
    size_t   off;
} wr;

static void w_bytes(wr *w, const void *src, size_t n) {
    if (n)
        memcpy(w->p + w->off, src, n);
    w->off += n;
}
static void w_u8(wr *w, uint8_t v) {
    w->p[w->off++] = v;
}
static void w_u16(wr *w, uint16_t v) {
    cm_le_put_u16(w->p + w->off, v);
    w->off += 2;
}
static void w_u32(wr *w, uint32_t v) {
    cm_le_put_u32(w->p + w->off, v);
    w->off += 4;
}
static void w_u64(wr *w, uint64_t v) {
    cm_le_put_u64(w->p + w->off, v);
    w->off += 8;
}
static void w_str(wr *w, const char *s) {
    size_t n = strlen(s);
    w_u16(w, (uint16_t)n);
    w_bytes(w, s, n);
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

static cm_status check_name(const char *what, const char *field, const char *s, size_t n, cm_status st) {
    long bad = name_bad(s, n);
    if (bad < 0)
        return CM_FAIL(st, "%s: %s has %zu bytes; a name has 1 to %d", what, field, n, CM_PROTO_NAME_MAX);
    if (bad > 0)
        return CM_FAIL(st, "%s: %s has byte 0x%02x at position %ld; names use only A-Z a-z 0-9 _ . -", what,
                       field, (unsigned char)s[bad - 1], bad - 1);
    return CM_OK;
}

static cm_status check_message(const char *s, size_t n, cm_status st) {
    if (n > CM_PROTO_MESSAGE_MAX)
        return CM_FAIL(st, "ERROR: message has %zu bytes, at most %d", n, CM_PROTO_MESSAGE_MAX);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return CM_FAIL(st, "ERROR: message has control byte 0x%02x at position %zu", (unsigned char)s[i],
                           i);
    return CM_OK;
}

static size_t safe_strlen(const char *s, size_t max) {
    size_t n = 0;
    while (n <= max && s[n])
        n++;
    return n;
}

cm_status cm_proto_name_check(const char *what, const char *name) {
    return check_name(what, "the name", name ? name : "", name ? strlen(name) : 0, CM_ERR_INVALID_ARG);
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
static void seal(uint8_t *p, int type, uint32_t flags, uint32_t n_tensors, uint64_t id, size_t body_len,
                 uint64_t data_len) {
    write_header(p, type, flags, n_tensors, id, (uint32_t)body_len, data_len,
                 cm_xxh64(p + CM_PROTO_HEADER_SIZE, body_len, 0));
}

static cm_status need_cap(const char *what, size_t need, size_t cap, size_t *len) {
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
    if (h.version != CM_PROTO_VERSION)
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
// bounds-checked reader

typedef struct rd {
    const uint8_t *p;
    size_t         len, off;
    const char    *what; /* message name for errors */
} rd;

static cm_status r_need(rd *r, size_t n, const char *field) {
    if (r->len - r->off < n)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "%s: truncated in field '%s' (needs %zu bytes at body offset %zu, %zu left)", r->what,
                       field, n, r->off, r->len - r->off);
    return CM_OK;
}
static cm_status r_u8(rd *r, const char *field, uint8_t *v) {
    CM_TRY(r_need(r, 1, field));
    *v = r->p[r->off++];
    return CM_OK;
}
static cm_status r_u16(rd *r, const char *field, uint16_t *v) {
    CM_TRY(r_need(r, 2, field));
    *v = cm_le_get_u16(r->p + r->off);
    r->off += 2;
    return CM_OK;
}
static cm_status r_u32(rd *r, const char *field, uint32_t *v) {
    CM_TRY(r_need(r, 4, field));
    *v = cm_le_get_u32(r->p + r->off);
    r->off += 4;
    return CM_OK;
}
static cm_status r_u64(rd *r, const char *field, uint64_t *v) {
    CM_TRY(r_need(r, 8, field));
    *v = cm_le_get_u64(r->p + r->off);
    r->off += 8;
    return CM_OK;
}
static cm_status r_str(rd *r, const char *field, char out[CM_PROTO_NAME_MAX + 1]) {
    uint16_t n;
    CM_TRY(r_u16(r, field, &n));
    if (n < 1 || n > CM_PROTO_NAME_MAX)
        return CM_FAIL(CM_ERR_PROTOCOL, "%s: field '%s' has length %u; a name has 1 to %d bytes", r->what,
                       field, n, CM_PROTO_NAME_MAX);
    CM_TRY(r_need(r, n, field));
    CM_TRY(check_name(r->what, field, (const char *)r->p + r->off, n, CM_ERR_PROTOCOL));
    memcpy(out, r->p + r->off, n);
    out[n] = '\0';
    r->off += n;
    return CM_OK;
}
static cm_status r_end(rd *r) {
    if (r->off != r->len)
        return CM_FAIL(CM_ERR_PROTOCOL, "%s: %zu unexpected bytes after the last field (body has %zu)",
                       r->what, r->len - r->off, r->len);
    return CM_OK;
}

/* Validates the frame as a whole (header, type, exact size, body checksum) and sets up a
 * reader over its body. */
static cm_status frame_open(const void *frame, size_t len, const cm_proto_limits *lim, int type,
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
// HELLO, WELCOME, ERROR, HEARTBEAT, BYE

cm_status cm_proto_hello_encode(const cm_proto_hello *m, void *buf, size_t cap, size_t *len) {
    size_t n = safe_strlen(m->name, CM_PROTO_NAME_MAX);
    CM_TRY(check_name("HELLO", "name", m->name, n, CM_ERR_INVALID_ARG));
    if (m->credits < 1)
        return CM_FAIL(CM_ERR_INVALID_ARG, "HELLO: field 'credits' must be at least 1");
    if (m->encodings == 0 || m->encodings >> CM_ENCODING_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "HELLO: field 'encodings' 0x%x names no known encoding",
                       m->encodings);
    size_t body = 26 + n;
    CM_TRY(need_cap("HELLO", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u64(&w, m->target_id);
    w_u64(&w, m->weights_id);
    w_u32(&w, m->credits);
    w_u32(&w, m->encodings);
    w_str(&w, m->name);
    seal(buf, CM_PROTO_TYPE_HELLO, 0, 0, 0, body, 0);
    return CM_OK;
}

cm_status cm_proto_hello_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                cm_proto_hello *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_HELLO, &h, &r, 0));
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
    size_t n = safe_strlen(m->name, CM_PROTO_NAME_MAX);
    CM_TRY(check_name("WELCOME", "name", m->name, n, CM_ERR_INVALID_ARG));
    CM_TRY(welcome_check(m, CM_ERR_INVALID_ARG));
    size_t body = 42 + n;
    CM_TRY(need_cap("WELCOME", CM_PROTO_HEADER_SIZE + body, cap, len));
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
    seal(buf, CM_PROTO_TYPE_WELCOME, 0, 0, 0, body, 0);
    return CM_OK;
}

cm_status cm_proto_welcome_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                  cm_proto_welcome *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_WELCOME, &h, &r, 0));
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
    size_t n = safe_strlen(m->message, CM_PROTO_MESSAGE_MAX);
    CM_TRY(check_message(m->message, n, CM_ERR_INVALID_ARG));
    if (m->code < CM_PROTO_ERROR_BAD_REQUEST || m->code >= CM_PROTO_ERROR_END)
        return CM_FAIL(CM_ERR_INVALID_ARG, "ERROR: unknown code %d", (int)m->code);
    size_t body = 6 + n;
    CM_TRY(need_cap("ERROR", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)m->code);
    w_u16(&w, (uint16_t)n);
    w_bytes(&w, m->message, n);
    seal(buf, CM_PROTO_TYPE_ERROR, 0, 0, m->batch_id, body, 0);
    return CM_OK;
}

cm_status cm_proto_error_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                cm_proto_error *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_ERROR, &h, &r, 0));
    uint32_t code;
    uint16_t n;
    CM_TRY(r_u32(&r, "code", &code));
    CM_TRY(r_u16(&r, "message length", &n));
    if (n > CM_PROTO_MESSAGE_MAX)
        return CM_FAIL(CM_ERR_PROTOCOL, "ERROR: field 'message' has length %u, at most %d", n,
                       CM_PROTO_MESSAGE_MAX);
    CM_TRY(r_need(&r, n, "message"));
    const char *msg = (const char *)r.p + r.off;
    CM_TRY(check_message(msg, n, CM_ERR_PROTOCOL));
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
    CM_TRY(need_cap("HEARTBEAT", CM_PROTO_HEADER_SIZE, cap, len));
    seal(buf, CM_PROTO_TYPE_HEARTBEAT, 0, 0, seq, 0, 0);
    return CM_OK;
}

cm_status cm_proto_heartbeat_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                    uint64_t *seq) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_HEARTBEAT, &h, &r, 0));
    *seq = h.id;
    return CM_OK;
}

cm_status cm_proto_bye_encode(void *buf, size_t cap, size_t *len) {
    CM_TRY(need_cap("BYE", CM_PROTO_HEADER_SIZE, cap, len));
    seal(buf, CM_PROTO_TYPE_BYE, 0, 0, 0, 0, 0);
    return CM_OK;
}

cm_status cm_proto_bye_decode(const void *frame, size_t len, const cm_proto_limits *lim) {
    cm_proto_header h;
    rd              r;
    return frame_open(frame, len, lim, CM_PROTO_TYPE_BYE, &h, &r, 0);
}

// ----------------------------------------------------------------------------
// NCCL_OFFER, NCCL_READY

cm_status cm_proto_nccl_offer_encode(const cm_proto_nccl *m, void *buf, size_t cap, size_t *len) {
    if (m->uid_len < 1 || m->uid_len > CM_PROTO_NCCL_UID_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "NCCL_OFFER: uid_len %u is not in [1, %d]", m->uid_len,
                       CM_PROTO_NCCL_UID_MAX);
    size_t body = 8 + (size_t)m->uid_len;
    CM_TRY(need_cap("NCCL_OFFER", CM_PROTO_HEADER_SIZE + body, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, m->device);
    w_u32(&w, m->uid_len);
    w_bytes(&w, m->uid, m->uid_len);
    seal(buf, CM_PROTO_TYPE_NCCL_OFFER, 0, 0, 0, body, 0);
    return CM_OK;
}

cm_status cm_proto_nccl_offer_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                     cm_proto_nccl *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_NCCL_OFFER, &h, &r, 0));
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
    CM_TRY(need_cap("NCCL_READY", CM_PROTO_HEADER_SIZE + 4, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, device);
    seal(buf, CM_PROTO_TYPE_NCCL_READY, 0, 0, 0, 4, 0);
    return CM_OK;
}

cm_status cm_proto_status_encode(const char *json, size_t n, void *buf, size_t cap, size_t *len) {
    if (!json) {
        CM_TRY(need_cap("STATUS", CM_PROTO_HEADER_SIZE, cap, len));
        seal(buf, CM_PROTO_TYPE_STATUS, 0, 0, 0, 0, 0);
        return CM_OK;
    }
    if (n < 1 || n > CM_PROTO_STATUS_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "STATUS: %zu bytes of JSON; 1 to %d", n, CM_PROTO_STATUS_MAX);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)json[i] < 0x20)
            return CM_FAIL(CM_ERR_INVALID_ARG, "STATUS: control byte 0x%02x at %zu", (unsigned char)json[i], i);
    CM_TRY(need_cap("STATUS", CM_PROTO_HEADER_SIZE + 4 + n, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)n);
    w_bytes(&w, json, n);
    seal(buf, CM_PROTO_TYPE_STATUS, 0, 0, 0, 4 + n, 0);
    return CM_OK;
}

cm_status cm_proto_status_decode(const void *frame, size_t len, const cm_proto_limits *lim, char *out,
                                 size_t cap, size_t *n) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_STATUS, &h, &r, 0));
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
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_NCCL_READY, &h, &r, 0));
    CM_TRY(r_u32(&r, "device", device));
    return r_end(&r);
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
    CM_TRY(need_cap("REQUEST", need, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)m->encoding);
    w_u32(&w, m->n_tokens);
    w_u32(&w, m->n_seqs);
    w_u32(&w, m->n_layers);
    w_bytes(&w, m->tokens, 4 * (size_t)m->n_tokens);
    w_bytes(&w, m->cu_seqlens, 4 * ((size_t)m->n_seqs + 1));
    w_bytes(&w, m->layer_ids, 4 * (size_t)m->n_layers);
    seal(buf, CM_PROTO_TYPE_REQUEST, m->flags, 0, m->batch_id, need - CM_PROTO_HEADER_SIZE, 0);
    return CM_OK;
}

cm_status cm_proto_request_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                  cm_proto_request *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(frame_open(frame, len, lim, CM_PROTO_TYPE_REQUEST, &h, &r, 0));
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

// ----------------------------------------------------------------------------
// ANSWER

cm_status cm_proto_tensor_check(const cm_proto_tensor *t, const cm_proto_limits *lim, cm_status on_bad,
                                int64_t *n_rows, int64_t *row_len) {
    const char *nm = t->name;
    if ((unsigned)t->dtype >= CM_DTYPE_COUNT)
        return CM_FAIL(on_bad, "tensor '%s': unknown dtype %d in field 'dtype'", nm, (int)t->dtype);
    if ((unsigned)t->encoding >= CM_ENCODING_END)
        return CM_FAIL(on_bad, "tensor '%s': unknown encoding %d in field 'encoding'", nm, (int)t->encoding);
    if (t->encoding == CM_ENCODING_FP8_ZSTD && t->dtype != CM_DTYPE_F32 && t->dtype != CM_DTYPE_BF16 &&
        t->dtype != CM_DTYPE_F16)
        return CM_FAIL(on_bad, "tensor '%s': encoding fp8-zstd needs dtype F32, BF16 or F16, not %s", nm,
                       cm_dtype_name(t->dtype));
    if (t->n_dims < 1 || t->n_dims > CM_PROTO_MAX_DIMS)
        return CM_FAIL(on_bad, "tensor '%s': field 'n_dims' is %d, must be in [1, %d]", nm, t->n_dims,
                       CM_PROTO_MAX_DIMS);
    uint64_t numel = 1;
    for (int d = 0; d < t->n_dims; d++) {
        if (t->shape[d] < 0)
            return CM_FAIL(on_bad, "tensor '%s': shape[%d] is %lld, must be ≥ 0", nm, d,
                           (long long)t->shape[d]);
        if (__builtin_mul_overflow(numel, (uint64_t)t->shape[d], &numel))
            return CM_FAIL(on_bad, "tensor '%s': the product of field 'shape' overflows 64 bits", nm);
    }
    uint64_t bytes;
    if (__builtin_mul_overflow(numel, (uint64_t)cm_dtype_size(t->dtype), &bytes) ||
        bytes > lim->max_tensor_bytes)
        return CM_FAIL(on_bad, "tensor '%s': %llu elements of %s exceed the limit of %llu bytes per tensor",
                       nm, (unsigned long long)numel, cm_dtype_name(t->dtype),
                       (unsigned long long)lim->max_tensor_bytes);
    if (t->raw_size != bytes)
        return CM_FAIL(on_bad, "tensor '%s': field 'raw_size' is %llu, but the shape and dtype give %llu", nm,
                       (unsigned long long)t->raw_size, (unsigned long long)bytes);
    if (t->encoding == CM_ENCODING_RAW && t->encoded_size != t->raw_size)
        return CM_FAIL(on_bad, "tensor '%s': raw encoding with field 'encoded_size' %llu ≠ raw_size %llu", nm,
                       (unsigned long long)t->encoded_size, (unsigned long long)t->raw_size);
    if (t->encoding == CM_ENCODING_NCCL && t->encoded_size)
        return CM_FAIL(on_bad, "tensor '%s': nccl encoding with field 'encoded_size' %llu; its bytes travel "
                       "over NCCL, so it must be 0", nm, (unsigned long long)t->encoded_size);
    if (t->encoded_size > lim->max_data_bytes)
        return CM_FAIL(on_bad, "tensor '%s': field 'encoded_size' %llu exceeds the limit of %llu bytes", nm,
                       (unsigned long long)t->encoded_size, (unsigned long long)lim->max_data_bytes);
    uint64_t rows = 1;
    for (int d = 0; d < t->n_dims - 1; d++)
        if (__builtin_mul_overflow(rows, (uint64_t)t->shape[d], &rows) || rows > INT64_MAX)
            return CM_FAIL(on_bad, "tensor '%s': the product of field 'shape' overflows 64 bits", nm);
    if (n_rows)
        *n_rows = (int64_t)rows;
    if (row_len)
        *row_len = t->shape[t->n_dims - 1];
    return CM_OK;
}

static size_t descriptor_size(const cm_proto_tensor *t) {
    return 2 + strlen(t->name) + 4 + 8 * (size_t)t->n_dims + 24;
}

/* Checks the tensors the caller wants to send; returns HEAD's size and DATA's size. */
static cm_status answer_check(const cm_proto_answer *m, size_t *head, uint64_t *data) {
    static const cm_proto_limits unbounded = {UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX,
                                              UINT32_MAX, UINT32_MAX, UINT64_MAX, UINT64_MAX};
    size_t                       h = CM_PROTO_HEADER_SIZE;
    uint64_t                     d = 0;
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        const cm_proto_tensor *t = &m->tensors[i];
        size_t                 n = safe_strlen(t->name, CM_PROTO_NAME_MAX);
        CM_TRY(check_name("ANSWER", "tensor name", t->name, n, CM_ERR_INVALID_ARG));
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(m->tensors[j].name, t->name) == 0)
                return CM_FAIL(CM_ERR_INVALID_ARG, "ANSWER: tensor name '%s' appears twice", t->name);
        CM_TRY(cm_proto_tensor_check(t, &unbounded, CM_ERR_INVALID_ARG, NULL, NULL));
        if (t->encoded_size && !t->data)
            return CM_FAIL(CM_ERR_INVALID_ARG, "ANSWER: tensor '%s' has %llu encoded bytes but no data",
                           t->name, (unsigned long long)t->encoded_size);
        h += descriptor_size(t);
        d += t->encoded_size;
    }
    if (h - CM_PROTO_HEADER_SIZE > UINT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "ANSWER: %u descriptors do not fit the u32 field 'body_len'",
                       m->n_tensors);
    *head = h;
    *data = d;
    return CM_OK;
}

size_t cm_proto_answer_head_size(const cm_proto_answer *m) {
    size_t h = CM_PROTO_HEADER_SIZE;
    for (uint32_t i = 0; i < m->n_tensors; i++)
        h += descriptor_size(&m->tensors[i]);
    return h;
}

static void answer_write_head(cm_proto_answer *m, uint8_t *buf, size_t head, uint64_t data) {
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        cm_proto_tensor *t = &m->tensors[i];
        t->checksum = cm_xxh64(t->data, t->encoded_size, 0);
        w_str(&w, t->name);
        w_u8(&w, (uint8_t)t->dtype);
        w_u8(&w, (uint8_t)t->encoding);
        w_u8(&w, (uint8_t)t->n_dims);
        w_u8(&w, 0);
        for (int d = 0; d < t->n_dims; d++)
            w_u64(&w, (uint64_t)t->shape[d]);
        w_u64(&w, t->raw_size);
        w_u64(&w, t->encoded_size);
        w_u64(&w, t->checksum);
    }
    CM_ASSERT(w.off == head);
    seal(buf, CM_PROTO_TYPE_ANSWER, 0, m->n_tensors, m->batch_id, head - CM_PROTO_HEADER_SIZE, data);
}

cm_status cm_proto_answer_encode_head(cm_proto_answer *m, void *buf, size_t cap, size_t *len) {
    size_t   head;
    uint64_t data;
    CM_TRY(answer_check(m, &head, &data));
    CM_TRY(need_cap("ANSWER", head, cap, len));
    answer_write_head(m, buf, head, data);
    return CM_OK;
}

cm_status cm_proto_answer_encode(cm_proto_answer *m, void *buf, size_t cap, size_t *len) {
    size_t   head;
    uint64_t data;
    CM_TRY(answer_check(m, &head, &data));
    if (data > SIZE_MAX - head)
        return CM_FAIL(CM_ERR_INVALID_ARG, "ANSWER: %llu data bytes do not fit in memory",
                       (unsigned long long)data);
    CM_TRY(need_cap("ANSWER", head + (size_t)data, cap, len));
    answer_write_head(m, buf, head, data);
    uint8_t *p = (uint8_t *)buf + head;
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        if (m->tensors[i].encoded_size)
            memcpy(p, m->tensors[i].data, m->tensors[i].encoded_size);
        p += m->tensors[i].encoded_size;
    }
    return CM_OK;
}

cm_status cm_proto_answer_decode_parts(const void *head, size_t head_len, const void *data, size_t data_len,
                                       const cm_proto_limits *lim, cm_proto_answer *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_peek(head, head_len, lim, &h));
    if (h.type != CM_PROTO_TYPE_ANSWER)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame: expected type ANSWER, got %s", cm_proto_type_name(h.type));
    if (data_len != h.data_len)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame ANSWER: data part has %zu bytes, field 'data_len' says %llu",
                       data_len, (unsigned long long)h.data_len);
    if (data_len && !data)
        return CM_FAIL(CM_ERR_INVALID_ARG, "ANSWER: data part is NULL");
    CM_TRY(frame_open(head, head_len, lim, CM_PROTO_TYPE_ANSWER, &h, &r, 0));
    if (h.n_tensors > out->cap_tensors || (h.n_tensors && !out->tensors))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "ANSWER: caller array holds %u tensors, the answer has %u (size it from "
                       "the limits)",
                       out->cap_tensors, h.n_tensors);
    uint64_t off = 0;
    for (uint32_t i = 0; i < h.n_tensors; i++) {
        cm_proto_tensor *t = &out->tensors[i];
        uint8_t          dt, enc, nd, rsv;
        CM_TRY(r_str(&r, "tensor name", t->name));
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(out->tensors[j].name, t->name) == 0)
                return CM_FAIL(CM_ERR_PROTOCOL, "ANSWER: tensor %u repeats the name '%s' of tensor %u", i,
                               t->name, j);
        CM_TRY(r_u8(&r, "dtype", &dt));
        CM_TRY(r_u8(&r, "encoding", &enc));
        CM_TRY(r_u8(&r, "n_dims", &nd));
        CM_TRY(r_u8(&r, "reserved", &rsv));
        if (rsv)
            return CM_FAIL(CM_ERR_PROTOCOL, "ANSWER: tensor '%s': field 'reserved' is %u, must be 0", t->name,
                           rsv);
        if (nd < 1 || nd > CM_PROTO_MAX_DIMS)
            return CM_FAIL(CM_ERR_PROTOCOL, "ANSWER: tensor '%s': field 'n_dims' is %u, must be in [1, %d]",
                           t->name, nd, CM_PROTO_MAX_DIMS);
        t->dtype = (cm_dtype)dt;
        t->encoding = (cm_encoding)enc;
        t->n_dims = nd;
        for (int d = 0; d < nd; d++) {
            uint64_t v;
            CM_TRY(r_u64(&r, "shape", &v));
            if (v > INT64_MAX)
                return CM_FAIL(CM_ERR_PROTOCOL, "ANSWER: tensor '%s': shape[%d] = %llu is negative as i64",
                               t->name, d, (unsigned long long)v);
            t->shape[d] = (int64_t)v;
        }
        CM_TRY(r_u64(&r, "raw_size", &t->raw_size));
        CM_TRY(r_u64(&r, "encoded_size", &t->encoded_size));
        CM_TRY(r_u64(&r, "checksum", &t->checksum));
        CM_TRY(cm_proto_tensor_check(t, lim, CM_ERR_PROTOCOL, NULL, NULL));
        if (t->encoded_size > data_len - off)
            return CM_FAIL(CM_ERR_PROTOCOL,
                           "ANSWER: tensor '%s': field 'encoded_size' %llu runs past the data part "
                           "(%llu of %zu bytes left)",
                           t->name, (unsigned long long)t->encoded_size, (unsigned long long)(data_len - off),
                           data_len);
        t->data = (const uint8_t *)data + off;
        off += t->encoded_size;
    }
    CM_TRY(r_end(&r));
    if (off != data_len)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "ANSWER: the descriptors account for %llu data bytes, field 'data_len' says %zu",
                       (unsigned long long)off, data_len);
    for (uint32_t i = 0; i < h.n_tensors; i++) {
        cm_proto_tensor *t = &out->tensors[i];
        uint64_t         got = cm_xxh64(t->data, t->encoded_size, 0);
        if (got != t->checksum)
            return CM_FAIL(CM_ERR_PROTOCOL,
                           "ANSWER: tensor '%s': checksum mismatch (field checksum %016llx, computed "
                           "%016llx): corrupted data",
                           t->name, (unsigned long long)t->checksum, (unsigned long long)got);
    }
    out->batch_id = h.id;
    out->n_tensors = h.n_tensors;
    return CM_OK;
}

cm_status cm_proto_answer_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                 cm_proto_answer *out) {
    cm_proto_header h;
    CM_TRY(cm_proto_peek(frame, len, lim, &h));
    size_t   head = (size_t)CM_PROTO_HEADER_SIZE + h.body_len;
    uint64_t want = head + h.data_len;
    if (h.type != CM_PROTO_TYPE_ANSWER)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame: expected type ANSWER, got %s", cm_proto_type_name(h.type));
    if (len < want)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame ANSWER: truncated: %zu bytes, the header says %llu", len,
                       (unsigned long long)want);
    if (len > want)
        return CM_FAIL(CM_ERR_PROTOCOL, "frame ANSWER: %llu trailing bytes after the %llu the header says",
                       (unsigned long long)(len - want), (unsigned long long)want);
    return cm_proto_answer_decode_parts(frame, head, (const uint8_t *)frame + head, len - head, lim, out);
}
