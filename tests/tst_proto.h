/* tests/tst_proto.h — hand-built wire frames for the cm_proto tests: a little-endian body builder,
 * a sealer that writes a header with valid checksums (so a malformed body reaches the field check
 * it aims at), and corrupt_all, which flips a bit of every byte and truncates at every length of a
 * good frame and expects every decode to be refused; and tst_put_tensor, which describes one tensor
 * of an answer. Header-only, after tst.h; one test executable includes it once. */
#ifndef TST_PROTO_H
#define TST_PROTO_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cm_hash.h"
#include "cm_proto.h"
#include "tst.h"

// ---- hand-built frames

/* t describes the [rows, cols] tensor name of dtype dt at d (raw encoding, everything else zero). */
static inline void tst_put_tensor(cm_proto_tensor *t, const char *name, cm_dtype dt, int64_t rows, int64_t cols,
                                  const void *d) {
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt;
    t->n_dims = 2;
    t->shape[0] = rows;
    t->shape[1] = cols;
    t->raw_size = (uint64_t)(rows * cols) * cm_dtype_size(dt);
    t->data = d;
}

typedef struct bld {
    uint8_t b[1 << 16];
    size_t  n;
} bld;

static inline void b_u8(bld *b, uint8_t v) {
    b->b[b->n++] = v;
}
static inline void b_u16(bld *b, uint16_t v) {
    b_u8(b, (uint8_t)v);
    b_u8(b, (uint8_t)(v >> 8));
}
static inline void b_u32(bld *b, uint32_t v) {
    b_u16(b, (uint16_t)v);
    b_u16(b, (uint16_t)(v >> 16));
}
static inline void b_u64(bld *b, uint64_t v) {
    b_u32(b, (uint32_t)v);
    b_u32(b, (uint32_t)(v >> 32));
}
static inline void b_str(bld *b, const char *s) {
    b_u16(b, (uint16_t)strlen(s));
    memcpy(b->b + b->n, s, strlen(s));
    b->n += strlen(s);
}

/* Writes header + body (+ data) to out with valid checksums; returns the frame size. */
static inline size_t seal_frame(uint8_t *out, uint16_t version, uint16_t type, uint32_t flags,
                                uint32_t n_tensors, uint64_t id, const bld *body, const void *data,
                                uint64_t data_len) {
    uint8_t *h = out;
    tst_put32(h, CM_PROTO_MAGIC);
    h[4] = (uint8_t)version;
    h[5] = (uint8_t)(version >> 8);
    h[6] = (uint8_t)type;
    h[7] = (uint8_t)(type >> 8);
    tst_put32(h + 8, flags);
    tst_put32(h + 12, n_tensors);
    tst_put64(h + 16, id);
    tst_put32(h + 24, (uint32_t)body->n);
    tst_put32(h + 28, 0);
    tst_put64(h + 32, data_len);
    tst_put64(h + 40, cm_xxh64(body->b, body->n, 0));
    tst_put64(h + 48, cm_xxh64(h, 48, 0));
    memcpy(out + CM_PROTO_HEADER_SIZE, body->b, body->n);
    if (data_len)
        memcpy(out + CM_PROTO_HEADER_SIZE + body->n, data, data_len);
    return CM_PROTO_HEADER_SIZE + body->n + data_len;
}

/* Recomputes the header checksum after a header field was patched. */
static inline void reseal_header(uint8_t *f) {
    tst_put64(f + 48, cm_xxh64(f, 48, 0));
}

// ---- corruption of a good frame

typedef cm_status (*decode_fn)(const uint8_t *f, size_t len);

static inline void corrupt_all(const char *what, decode_fn dec, const uint8_t *good, size_t len) {
    static uint8_t f[1 << 20];
    TST_CHECK(dec(good, len) == CM_OK);
    int missed = 0, unnamed = 0;
    /* flip one bit of every byte (bit rotating with the position); all bytes of long data */
    for (size_t i = 0; i < len; i++) {
        memcpy(f, good, len);
        f[i] ^= (uint8_t)(1u << (i % 8));
        cm_clear_error();
        if (dec(f, len) != CM_ERR_PROTOCOL)
            missed++;
        /* past the magic and version, a flip is caught by a checksum */
        else if (i >= 6 && !strstr(cm_last_error(), "checksum"))
            unnamed++;
    }
    if (missed || unnamed)
        fprintf(stderr, "%s: %d flips not refused, %d refused without naming a checksum\n", what, missed,
                unnamed);
    TST_CHECK(missed == 0 && unnamed == 0);
    /* truncation at every length, and one trailing byte */
    missed = 0;
    for (size_t n = 0; n < len; n++) {
        memcpy(f, good, n);
        if (dec(f, n) != CM_ERR_PROTOCOL)
            missed++;
    }
    memcpy(f, good, len);
    f[len] = 0;
    if (dec(f, len + 1) != CM_ERR_PROTOCOL)
        missed++;
    if (missed)
        fprintf(stderr, "%s: %d truncations not refused\n", what, missed);
    TST_CHECK(missed == 0);
}

#endif /* TST_PROTO_H */
