/* common/format/cm_proto_claims.c — what a frame's bytes claim before, or without, a decode (see
 * cm_proto.h): the counts of a REQUEST or a DECODE, read ahead of its decode, and the id and
 * version of a frame whose header was refused. The values are claims, used only to word an
 * answer. */
#include "cm_proto.h"

#include <string.h>

/* cm_proto.c asserts a little-endian host: fields are copied as they are */
static uint32_t claim_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

cm_status cm_proto_request_counts(const void *frame, size_t len, uint32_t *n_tokens, uint32_t *n_layers) {
    const uint8_t *p = frame;
    if (!p || len < CM_PROTO_HEADER_SIZE + 16 || claim_u32(p + 24) < 16)
        return CM_FAIL(CM_ERR_PROTOCOL, "REQUEST: %zu bytes hold no body fields", p ? len : 0);
    *n_tokens = claim_u32(p + CM_PROTO_HEADER_SIZE + 4);
    *n_layers = claim_u32(p + CM_PROTO_HEADER_SIZE + 12);
    return CM_OK;
}

cm_status cm_proto_decode_counts(const void *frame, size_t len, uint32_t *n_seqs, uint32_t *n_tokens,
                                 uint32_t *n_layers) {
    const uint8_t *p = frame;
    if (!p || len < CM_PROTO_HEADER_SIZE + 20 || claim_u32(p + 24) < 20)
        return CM_FAIL(CM_ERR_PROTOCOL, "DECODE: %zu bytes hold no body fields", p ? len : 0);
    *n_seqs = claim_u32(p + CM_PROTO_HEADER_SIZE + 8);
    *n_tokens = claim_u32(p + CM_PROTO_HEADER_SIZE + 12);
    *n_layers = claim_u32(p + CM_PROTO_HEADER_SIZE + 16);
    return CM_OK;
}

int cm_proto_frame_claims(const void *frame, size_t len, uint64_t *id, uint16_t *version) {
    const uint8_t *p = frame;
    *id = 0;
    if (len >= 24)
        memcpy(id, p + 16, sizeof *id);
    if (len < 6 || claim_u32(p) != CM_PROTO_MAGIC)
        return 0;
    *version = (uint16_t)(p[4] | p[5] << 8);
    return *version != CM_PROTO_VERSION;
}
