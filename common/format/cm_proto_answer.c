/* common/format/cm_proto_answer.c — the ANSWER codec of cm_proto.h: tensor descriptors, the head
 * (header and descriptors) encoded apart from the data or with it, and the decoders of a
 * whole frame or of a head and data received in two parts (same rules as cm_proto.c). */
#include "cm_proto_int.h"

#include <string.h>

#include "cm_hash.h"

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
        size_t                 n = cm_proto_safe_strlen_(t->name, CM_PROTO_NAME_MAX);
        CM_TRY(cm_proto_check_name_("ANSWER", "tensor name", t->name, n, CM_ERR_INVALID_ARG));
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
    cm_proto_seal_(buf, CM_PROTO_TYPE_ANSWER, 0, m->n_tensors, m->batch_id, head - CM_PROTO_HEADER_SIZE,
                   data);
}

cm_status cm_proto_answer_encode_head(cm_proto_answer *m, void *buf, size_t cap, size_t *len) {
    size_t   head;
    uint64_t data;
    CM_TRY(answer_check(m, &head, &data));
    CM_TRY(cm_proto_need_cap_("ANSWER", head, cap, len));
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
    CM_TRY(cm_proto_need_cap_("ANSWER", head + (size_t)data, cap, len));
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
    CM_TRY(cm_proto_frame_open_(head, head_len, lim, CM_PROTO_TYPE_ANSWER, &h, &r, 0));
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
