/* tests/fuzz/fuzz_decode.c — libFuzzer target: one wire frame through cm_proto_decode_decode, as a
 * target-server's decoding endpoint (cm_dec_server.c) decodes what a client sends. Input: one flag
 * byte, then the frame; bit 0 set: the frame's checksums are re-sealed first (fuzz_proto_seal), so
 * mutations reach the field checks; bit 1 set: small limits (4 sequences, 64 tokens, 4 layers,
 * layer ids < 48), so the limit checks are reached by small frames too. For a frame that decodes,
 * what the decoder promises holds (counts within the limits, T = Σ (n_ctx + n_draft), the rules
 * of STEP and CLOSE, the sampling fields' ranges, tokens and layer ids), and encoding the decoded
 * message and decoding that again gives the same bytes and the same message. */
#include <math.h>
#include <string.h>

#include "cm_proto.h"
#include "fuzz_util.h"

static const cm_proto_limits LIM_DEFAULT = CM_PROTO_LIMITS_DEFAULT;
#define MAX_N 131072 /* = LIM_DEFAULT.max_seqs, .max_tokens */
#define MAX_L 64     /* = LIM_DEFAULT.max_layers */
static cm_proto_decode_seq seqs[MAX_N], seqs2[MAX_N];
static int32_t             tok[MAX_N], tok2[MAX_N], lay[MAX_L], lay2[MAX_L];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    return 0;
}

static uint8_t *reencode_buf(size_t n) {
    static uint8_t *buf;
    static size_t   cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n);
        cap = n;
        FUZZ_CHECK(buf != NULL);
    }
    return buf;
}

static cm_proto_decode out_arrays(cm_proto_decode_seq *s, int32_t *t, int32_t *l) {
    return (cm_proto_decode){
        .seqs = s, .tokens = t, .layer_ids = l, .cap_seqs = MAX_N, .cap_tokens = MAX_N, .cap_layers = MAX_L};
}

/* What the decoder promises of a message it accepted. */
static void check_promises(const cm_proto_decode *m, const cm_proto_limits *lim) {
    FUZZ_CHECK(m->op == CM_DECODE_STEP || m->op == CM_DECODE_CLOSE);
    FUZZ_CHECK((unsigned)m->encoding < CM_ENCODING_END && (CM_ENCODING_LOSSLESS_MASK >> m->encoding & 1));
    FUZZ_CHECK(m->n_seqs >= 1 && m->n_seqs <= lim->max_seqs);
    FUZZ_CHECK(m->n_tokens <= lim->max_tokens && m->n_layers <= lim->max_layers);
    uint64_t sum = 0;
    for (uint32_t i = 0; i < m->n_seqs; i++) {
        const cm_proto_decode_seq *q = &m->seqs[i];
        FUZZ_CHECK(!(q->flags & ~CM_DECODE_FLAGS_KNOWN));
        FUZZ_CHECK(isfinite(q->temperature) && q->temperature >= 0.0f);
        FUZZ_CHECK(q->top_p > 0.0f && q->top_p <= 1.0f);
        if (m->op == CM_DECODE_CLOSE)
            FUZZ_CHECK(q->handle != 0 && q->n_ctx == 0 && q->n_draft == 0);
        else
            FUZZ_CHECK(q->n_ctx >= 1 && (q->handle != 0 || q->base == 0));
        sum += (uint64_t)q->n_ctx + q->n_draft;
    }
    FUZZ_CHECK(sum == m->n_tokens);
    FUZZ_CHECK(m->op == CM_DECODE_STEP || (m->n_tokens == 0 && m->n_layers == 0));
    for (uint32_t i = 0; i < m->n_tokens; i++)
        FUZZ_CHECK(m->tokens[i] >= 0);
    for (uint32_t i = 0; i < m->n_layers; i++) {
        FUZZ_CHECK(m->layer_ids[i] >= 0 && (uint32_t)m->layer_ids[i] < lim->max_layer_id);
        for (uint32_t j = 0; j < i; j++)
            FUZZ_CHECK(m->layer_ids[j] != m->layer_ids[i]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    size_t   len = size - 1;
    uint8_t *f = malloc(len ? len : 1); /* exact size: ASan sees any read past the frame */
    FUZZ_CHECK(f != NULL);
    memcpy(f, data + 1, len);
    if (data[0] & 1)
        fuzz_proto_seal(f, len);
    cm_proto_limits lim = LIM_DEFAULT;
    if (data[0] & 2)
        lim.max_seqs = 4, lim.max_tokens = 64, lim.max_layers = 4, lim.max_layer_id = 48;

    cm_proto_header h;
    if (fuzz_note(cm_proto_peek(f, len, &lim, &h)) == CM_OK)
        FUZZ_CHECK(h.type >= CM_PROTO_TYPE_HELLO && h.type < CM_PROTO_TYPE_END && h.body_len <= lim.max_body_bytes);
    cm_proto_decode m = out_arrays(seqs, tok, lay);
    if (fuzz_note(cm_proto_decode_decode(f, len, &lim, &m)) == CM_OK) {
        FUZZ_CHECK(h.type == CM_PROTO_TYPE_DECODE && m.id == h.id);
        FUZZ_CHECK(len == cm_proto_decode_size(m.n_seqs, m.n_tokens, m.n_layers));
        check_promises(&m, &lim);
        /* encoded again: the same bytes (every field is significant), decoded again: the same message */
        uint8_t *b = reencode_buf(len);
        size_t   n = 0;
        FUZZ_CHECK(cm_proto_decode_encode(&m, b, len, &n) == CM_OK && n == len);
        FUZZ_CHECK(memcmp(b, f, len) == 0);
        cm_proto_decode again = out_arrays(seqs2, tok2, lay2);
        FUZZ_CHECK(cm_proto_decode_decode(b, n, &lim, &again) == CM_OK);
        FUZZ_CHECK(again.id == m.id && again.op == m.op && again.encoding == m.encoding &&
                   again.n_seqs == m.n_seqs && again.n_tokens == m.n_tokens && again.n_layers == m.n_layers);
        FUZZ_CHECK(memcmp(seqs2, seqs, sizeof seqs[0] * m.n_seqs) == 0);
        FUZZ_CHECK(memcmp(tok2, tok, 4u * m.n_tokens) == 0 && memcmp(lay2, lay, 4u * m.n_layers) == 0);
        /* a buffer one byte short is refused, not overrun */
        if (len > CM_PROTO_HEADER_SIZE)
            FUZZ_CHECK(cm_proto_decode_encode(&m, b, len - 1, &n) == CM_ERR_INVALID_ARG && n == len);
    }
    free(f);
    return 0;
}
