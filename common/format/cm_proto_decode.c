/* common/format/cm_proto_decode.c — the DECODE codec of cm_proto.h: a decoding step (or the close
 * of sequences) sent to a target-server's decoding endpoint (cm_dec.h). Same rules as cm_proto.c:
 * the encoder refuses what the decoder would refuse (CM_ERR_INVALID_ARG), and the decoder checks
 * the counts against the limits and the body's exact size before it copies anything, then every
 * record, token and layer id (CM_ERR_PROTOCOL naming the field). */
#include "cm_proto_int.h"

#include <math.h>
#include <string.h>

#define DECODE_FIXED 20 /* op, encoding, n_seqs, n_tokens, n_layers */

size_t cm_proto_decode_size(uint32_t n_seqs, uint32_t n_tokens, uint32_t n_layers) {
    return CM_PROTO_HEADER_SIZE + DECODE_FIXED + (size_t)CM_DECODE_RECORD_SIZE * n_seqs +
           4 * ((size_t)n_tokens + n_layers);
}

/* The fields before the records: op, encoding and the counts, against lim (st: INVALID_ARG for
 * our own message, PROTOCOL for a peer's). */
static cm_status decode_check_counts(uint32_t op, uint32_t enc, uint32_t N, uint32_t T, uint32_t L,
                                     const cm_proto_limits *lim, cm_status st) {
    if (op != CM_DECODE_STEP && op != CM_DECODE_CLOSE)
        return CM_FAIL(st, "DECODE: field 'op' is %u, must be %d (STEP) or %d (CLOSE)", op, CM_DECODE_STEP,
                       CM_DECODE_CLOSE);
    if (enc >= CM_ENCODING_END || !(CM_ENCODING_LOSSLESS_MASK & (1u << enc)))
        return CM_FAIL(st,
                       "DECODE: field 'encoding' is %u (%s); a decoding answer is raw, zstd or "
                       "zstd-byteplane",
                       enc, cm_encoding_name((int)enc));
    if (N < 1 || N > lim->max_seqs)
        return CM_FAIL(st, "DECODE: field 'n_seqs' is %u, must be in [1, %u]", N, lim->max_seqs);
    if (op == CM_DECODE_CLOSE && (T || L))
        return CM_FAIL(st, "DECODE: CLOSE with field 'n_tokens' %u and 'n_layers' %u; both must be 0", T, L);
    if (T > lim->max_tokens)
        return CM_FAIL(st, "DECODE: field 'n_tokens' is %u, exceeds the limit of %u", T, lim->max_tokens);
    if (L > lim->max_layers)
        return CM_FAIL(st, "DECODE: field 'n_layers' is %u, exceeds the limit of %u", L, lim->max_layers);
    return CM_OK;
}

/* The records, tokens and layer ids of a DECODE whose counts passed decode_check_counts. */
static cm_status decode_check_arrays(const cm_proto_decode *m, uint32_t max_layer_id, cm_status st) {
    const int close = m->op == CM_DECODE_CLOSE;
    uint64_t  sum = 0;
    for (uint32_t i = 0; i < m->n_seqs; i++) {
        const cm_proto_decode_seq *q = &m->seqs[i];
        if (q->flags & ~CM_DECODE_FLAGS_KNOWN)
            return CM_FAIL(st, "DECODE: seqs[%u]: unknown bits 0x%x in field 'flags'", i,
                           q->flags & ~CM_DECODE_FLAGS_KNOWN);
        if (!(isfinite(q->temperature) && q->temperature >= 0.0f))
            return CM_FAIL(st, "DECODE: seqs[%u]: field 'temperature' is %g, must be finite and ≥ 0", i,
                           (double)q->temperature);
        if (!(q->top_p > 0.0f && q->top_p <= 1.0f))
            return CM_FAIL(st, "DECODE: seqs[%u]: field 'top_p' is %g, must be in (0, 1]", i,
                           (double)q->top_p);
        if (close) {
            if (q->handle == 0)
                return CM_FAIL(st, "DECODE: seqs[%u]: CLOSE of field 'handle' 0, which names no sequence", i);
            if (q->n_ctx || q->n_draft)
                return CM_FAIL(st,
                               "DECODE: seqs[%u]: CLOSE with field 'n_ctx' %u and 'n_draft' %u; both "
                               "must be 0",
                               i, q->n_ctx, q->n_draft);
            continue;
        }
        if (q->n_ctx < 1)
            return CM_FAIL(st, "DECODE: seqs[%u]: field 'n_ctx' is 0; a STEP commits at least one token", i);
        if (q->handle == 0 && q->base != 0)
            return CM_FAIL(st, "DECODE: seqs[%u]: a new sequence (handle 0) with field 'base' %u, must be 0",
                           i, q->base);
        sum += (uint64_t)q->n_ctx + q->n_draft;
    }
    if (sum != m->n_tokens)
        return CM_FAIL(st, "DECODE: field 'n_tokens' is %u, but the records' n_ctx + n_draft add up to %llu",
                       m->n_tokens, (unsigned long long)sum);
    for (uint32_t i = 0; i < m->n_tokens; i++)
        if (m->tokens[i] < 0)
            return CM_FAIL(st, "DECODE: tokens[%u] is %d, must be ≥ 0", i, m->tokens[i]);
    for (uint32_t i = 0; i < m->n_layers; i++) {
        if (m->layer_ids[i] < 0 || (uint32_t)m->layer_ids[i] >= max_layer_id)
            return CM_FAIL(st, "DECODE: layer_ids[%u] is %d, must be in [0, %u)", i, m->layer_ids[i],
                           max_layer_id);
        for (uint32_t j = 0; j < i; j++)
            if (m->layer_ids[j] == m->layer_ids[i])
                return CM_FAIL(st, "DECODE: layer_ids[%u] repeats layer %d (also layer_ids[%u])", i,
                               m->layer_ids[i], j);
    }
    return CM_OK;
}

cm_status cm_proto_decode_encode(const cm_proto_decode *m, void *buf, size_t cap, size_t *len) {
    static const cm_proto_limits unbounded = {UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX,
                                              UINT32_MAX, UINT32_MAX, UINT64_MAX, UINT64_MAX};
    CM_TRY(decode_check_counts((uint32_t)m->op, (uint32_t)m->encoding, m->n_seqs, m->n_tokens, m->n_layers,
                               &unbounded, CM_ERR_INVALID_ARG));
    if (!m->seqs || (m->n_tokens && !m->tokens) || (m->n_layers && !m->layer_ids))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "DECODE: an array of %u records, %u tokens or %u layer ids is NULL", m->n_seqs,
                       m->n_tokens, m->n_layers);
    CM_TRY(decode_check_arrays(m, INT32_MAX, CM_ERR_INVALID_ARG));
    size_t need = cm_proto_decode_size(m->n_seqs, m->n_tokens, m->n_layers);
    if (need - CM_PROTO_HEADER_SIZE > UINT32_MAX)
        return CM_FAIL(CM_ERR_INVALID_ARG, "DECODE: body of %zu bytes does not fit the u32 field 'body_len'",
                       need - CM_PROTO_HEADER_SIZE);
    CM_TRY(cm_proto_need_cap_("DECODE", need, cap, len));
    wr w = {buf, CM_PROTO_HEADER_SIZE};
    w_u32(&w, (uint32_t)m->op);
    w_u32(&w, (uint32_t)m->encoding);
    w_u32(&w, m->n_seqs);
    w_u32(&w, m->n_tokens);
    w_u32(&w, m->n_layers);
    for (uint32_t i = 0; i < m->n_seqs; i++) {
        const cm_proto_decode_seq *q = &m->seqs[i];
        w_u32(&w, q->handle);
        w_u32(&w, q->base);
        w_u32(&w, q->n_ctx);
        w_u32(&w, q->n_draft);
        w_u32(&w, q->top_k);
        w_f32(&w, q->temperature);
        w_f32(&w, q->top_p);
        w_u32(&w, q->flags);
        w_u64(&w, q->seed);
    }
    w_bytes(&w, m->tokens, 4 * (size_t)m->n_tokens);
    w_bytes(&w, m->layer_ids, 4 * (size_t)m->n_layers);
    CM_ASSERT(w.off == need);
    cm_proto_seal_(buf, CM_PROTO_TYPE_DECODE, 0, 0, m->id, need - CM_PROTO_HEADER_SIZE, 0);
    return CM_OK;
}

cm_status cm_proto_decode_decode(const void *frame, size_t len, const cm_proto_limits *lim,
                                 cm_proto_decode *out) {
    cm_proto_header h;
    rd              r;
    CM_TRY(cm_proto_frame_open_(frame, len, lim, CM_PROTO_TYPE_DECODE, &h, &r, 0));
    uint32_t op, enc, N, T, L;
    CM_TRY(r_u32(&r, "op", &op));
    CM_TRY(r_u32(&r, "encoding", &enc));
    CM_TRY(r_u32(&r, "n_seqs", &N));
    CM_TRY(r_u32(&r, "n_tokens", &T));
    CM_TRY(r_u32(&r, "n_layers", &L));
    CM_TRY(decode_check_counts(op, enc, N, T, L, lim, CM_ERR_PROTOCOL));
    uint64_t want = DECODE_FIXED + (uint64_t)CM_DECODE_RECORD_SIZE * N + 4 * ((uint64_t)T + L);
    if (want != r.len)
        return CM_FAIL(CM_ERR_PROTOCOL,
                       "DECODE: body has %zu bytes, but n_seqs %u, n_tokens %u, n_layers %u need %llu", r.len,
                       N, T, L, (unsigned long long)want);
    if (!out->seqs || N > out->cap_seqs || (T && (!out->tokens || T > out->cap_tokens)) ||
        (L && (!out->layer_ids || L > out->cap_layers)))
        return CM_FAIL(CM_ERR_INVALID_ARG,
                       "DECODE: caller arrays hold %u records, %u tokens, %u layers; the step has %u, %u, "
                       "%u (size them from the limits)",
                       out->cap_seqs, out->cap_tokens, out->cap_layers, N, T, L);
    const uint8_t *p = r.p + r.off; /* the body's size is exact: every read below is in bounds */
    for (uint32_t i = 0; i < N; i++, p += CM_DECODE_RECORD_SIZE)
        out->seqs[i] = (cm_proto_decode_seq){.handle = cm_le_get_u32(p),
                                             .base = cm_le_get_u32(p + 4),
                                             .n_ctx = cm_le_get_u32(p + 8),
                                             .n_draft = cm_le_get_u32(p + 12),
                                             .top_k = cm_le_get_u32(p + 16),
                                             .temperature = cm_le_get_f32(p + 20),
                                             .top_p = cm_le_get_f32(p + 24),
                                             .flags = cm_le_get_u32(p + 28),
                                             .seed = cm_le_get_u64(p + 32)};
    if (T)
        memcpy(out->tokens, p, 4 * (size_t)T);
    if (L)
        memcpy(out->layer_ids, p + 4 * (size_t)T, 4 * (size_t)L);
    out->id = h.id;
    out->op = (cm_decode_op)op;
    out->encoding = (cm_encoding)enc;
    out->n_seqs = N;
    out->n_tokens = T;
    out->n_layers = L;
    return decode_check_arrays(out, lim->max_layer_id, CM_ERR_PROTOCOL);
}
