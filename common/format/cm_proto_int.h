/* common/format/cm_proto_int.h — what the files of the wire codec share (private to
 * cm_proto*.c): a little-endian writer whose capacity the caller checked, a bounds-checked
 * reader, name and message validation, and the frame header. */
#ifndef CM_PROTO_INT_H
#define CM_PROTO_INT_H

#include <string.h>

#include "cm_bytes.h"
#include "cm_proto.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cm_proto assumes a little-endian host (the wire is little-endian and arrays are copied as is)"
#endif

// ----------------------------------------------------------------------------
// little-endian writer (capacity checked by the caller before writing)

typedef struct wr {
    uint8_t *p;
    size_t   off;
} wr;

static inline void w_bytes(wr *w, const void *src, size_t n) {
    if (n)
        memcpy(w->p + w->off, src, n);
    w->off += n;
}
static inline void w_u8(wr *w, uint8_t v) {
    w->p[w->off++] = v;
}
static inline void w_u16(wr *w, uint16_t v) {
    cm_le_put_u16(w->p + w->off, v);
    w->off += 2;
}
static inline void w_u32(wr *w, uint32_t v) {
    cm_le_put_u32(w->p + w->off, v);
    w->off += 4;
}
static inline void w_u64(wr *w, uint64_t v) {
    cm_le_put_u64(w->p + w->off, v);
    w->off += 8;
}
static inline void w_f32(wr *w, float v) {
    cm_le_put_f32(w->p + w->off, v);
    w->off += 4;
}
static inline void w_str(wr *w, const char *s) {
    size_t n = strlen(s);
    w_u16(w, (uint16_t)n);
    w_bytes(w, s, n);
}

/* CM_OK if the n bytes at s are a valid name (1 to CM_PROTO_NAME_MAX bytes of A-Z a-z 0-9 _ . -),
 * else st naming `what` and `field`. */
cm_status cm_proto_check_name_(const char *what, const char *field, const char *s, size_t n, cm_status st);
/* CM_OK if the n bytes at s are a valid ERROR message (at most CM_PROTO_MESSAGE_MAX, no control
 * bytes), else st. */
cm_status cm_proto_check_message_(const char *s, size_t n, cm_status st);
/* strlen that stops at max + 1, for fields that may lack their terminator. */
size_t cm_proto_safe_strlen_(const char *s, size_t max);

/* Capacity: *len = need; CM_ERR_INVALID_ARG when cap is smaller. */
cm_status cm_proto_need_cap_(const char *what, size_t need, size_t cap, size_t *len);
/* Finishes a frame whose body has been written at p + HEADER_SIZE. */
void cm_proto_seal_(uint8_t *p, int type, uint32_t flags, uint32_t n_tensors, uint64_t id, size_t body_len,
                    uint64_t data_len);

// ----------------------------------------------------------------------------
// bounds-checked reader

typedef struct rd {
    const uint8_t *p;
    size_t         len, off;
    const char    *what; /* message name for errors */
} rd;

static inline cm_status r_need(rd *r, size_t n, const char *field) {
    if (r->len - r->off < n)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "%s: truncated in field '%s' (needs %zu bytes at body offset %zu, %zu left)", r->what,
                       field, n, r->off, r->len - r->off);
    return CM_OK;
}
static inline cm_status r_u8(rd *r, const char *field, uint8_t *v) {
    CM_TRY(r_need(r, 1, field));
    *v = r->p[r->off++];
    return CM_OK;
}
static inline cm_status r_u16(rd *r, const char *field, uint16_t *v) {
    CM_TRY(r_need(r, 2, field));
    *v = cm_le_get_u16(r->p + r->off);
    r->off += 2;
    return CM_OK;
}
static inline cm_status r_u32(rd *r, const char *field, uint32_t *v) {
    CM_TRY(r_need(r, 4, field));
    *v = cm_le_get_u32(r->p + r->off);
    r->off += 4;
    return CM_OK;
}
static inline cm_status r_u64(rd *r, const char *field, uint64_t *v) {
    CM_TRY(r_need(r, 8, field));
    *v = cm_le_get_u64(r->p + r->off);
    r->off += 8;
    return CM_OK;
}
static inline cm_status r_str(rd *r, const char *field, char out[CM_PROTO_NAME_MAX + 1]) {
    uint16_t n;
    CM_TRY(r_u16(r, field, &n));
    if (n < 1 || n > CM_PROTO_NAME_MAX)
        return CM_FAIL(CM_ERR_PROTOCOL, "%s: field '%s' has length %u; a name has 1 to %d bytes", r->what,
                       field, n, CM_PROTO_NAME_MAX);
    CM_TRY(r_need(r, n, field));
    CM_TRY(cm_proto_check_name_(r->what, field, (const char *)r->p + r->off, n, CM_ERR_PROTOCOL));
    memcpy(out, r->p + r->off, n);
    out[n] = '\0';
    r->off += n;
    return CM_OK;
}
static inline cm_status r_end(rd *r) {
    if (r->off != r->len)
        return CM_FAIL(CM_ERR_PROTOCOL, "%s: %zu unexpected bytes after the last field (body has %zu)",
                       r->what, r->len - r->off, r->len);
    return CM_OK;
}

/* Validates the frame as a whole (header, type, exact size, body checksum) and sets up a
 * reader over its body. */
cm_status cm_proto_frame_open_(const void *frame, size_t len, const cm_proto_limits *lim, int type,
                               cm_proto_header *h, rd *body, size_t data_len);

#endif /* CM_PROTO_INT_H */
