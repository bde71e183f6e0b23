/* tests/test_cm_proto_decode.c — the DECODE message of the wire format (cm_proto.h, protocol 3): a
 * round trip of STEP and CLOSE in every encoding a decoding answer may use, the counts a DECODE
 * claims (cm_proto_decode_counts), every corruption of a good frame (a flipped bit anywhere,
 * truncation at every length), and each field the decoder must refuse, built by hand and sealed
 * with valid checksums so the check aimed at is reached; the message must name the field. The
 * encoder refuses the same messages. (Apart from test_cm_proto.c, which holds the other
 * messages, to keep both files short.) */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cm_proto.h"
#include "tst.h"
#include "tst_proto.h"

static const cm_proto_limits LIM = CM_PROTO_LIMITS_DEFAULT;
static uint8_t               frame[1 << 20];

#define MAX_N 8
#define MAX_T 64
#define MAX_L 8

static cm_proto_decode_seq g_seqs[MAX_N];
static int32_t             g_tok[MAX_T], g_lay[MAX_L];
static cm_proto_decode     g_out;

static cm_proto_decode out_decode(void) {
    return (cm_proto_decode){.seqs = g_seqs,
                             .tokens = g_tok,
                             .layer_ids = g_lay,
                             .cap_seqs = MAX_N,
                             .cap_tokens = MAX_T,
                             .cap_layers = MAX_L};
}

static cm_status dec(const uint8_t *f, size_t n) {
    g_out = out_decode();
    return cm_proto_decode_decode(f, n, &LIM, &g_out);
}

/* Three sequences: a new one (prompt of 4, no draft), one continuing with 3 drafts, one sampled
 * with the target's settings and 2 drafts; two layers. */
static cm_proto_decode_seq seqs_in[3] = {
    {0, 0, 4, 0, 0, 0.0f, 1.0f, 0, 0},
    {7, 130, 1, 3, 20, 0.7f, 0.95f, 0, 0x0123456789abcdefull},
    {9, 17, 1, 2, 0, 1.0f, 0.5f, CM_DECODE_FLAG_TARGET_SAMPLING, 42},
};
static int32_t tok_in[11] = {151644, 872, 198, 9707, 13, 100, 101, 102, 5, 6, 0};
static int32_t lay_in[2] = {31, 1};

static cm_proto_decode make_step(cm_encoding enc) {
    return (cm_proto_decode){.id = 0xfeedface12ull,
                             .op = CM_DECODE_STEP,
                             .encoding = enc,
                             .n_seqs = 3,
                             .n_tokens = 11,
                             .n_layers = 2,
                             .seqs = seqs_in,
                             .tokens = tok_in,
                             .layer_ids = lay_in};
}

static int same_decode(const cm_proto_decode *a, const cm_proto_decode *b) {
    if (a->id != b->id || a->op != b->op || a->encoding != b->encoding || a->n_seqs != b->n_seqs ||
        a->n_tokens != b->n_tokens || a->n_layers != b->n_layers)
        return 0;
    for (uint32_t i = 0; i < a->n_seqs; i++) {
        const cm_proto_decode_seq *p = &a->seqs[i], *q = &b->seqs[i];
        if (p->handle != q->handle || p->base != q->base || p->n_ctx != q->n_ctx ||
            p->n_draft != q->n_draft || p->top_k != q->top_k ||
            memcmp(&p->temperature, &q->temperature, 4) != 0 || memcmp(&p->top_p, &q->top_p, 4) != 0 ||
            p->flags != q->flags || p->seed != q->seed)
            return 0;
    }
    return (!a->n_tokens || memcmp(a->tokens, b->tokens, 4u * a->n_tokens) == 0) &&
           (!a->n_layers || memcmp(a->layer_ids, b->layer_ids, 4u * a->n_layers) == 0);
}

// ---- round trips

static void test_roundtrip(void) {
    TST_CHECK(strcmp(cm_proto_type_name(CM_PROTO_TYPE_DECODE), "DECODE") == 0);
    TST_CHECK(strcmp(cm_proto_type_name(CM_PROTO_TYPE_END), "unknown") == 0);
    static const cm_encoding encs[] = {CM_ENCODING_RAW, CM_ENCODING_ZSTD, CM_ENCODING_ZSTD_BYTEPLANE};
    for (size_t e = 0; e < sizeof encs / sizeof encs[0]; e++) {
        cm_proto_decode m = make_step(encs[e]);
        size_t          len = 0;
        TST_CHECK(cm_proto_decode_encode(&m, frame, sizeof frame, &len) == CM_OK);
        TST_CHECK(len == cm_proto_decode_size(3, 11, 2) &&
                  len == CM_PROTO_HEADER_SIZE + 20 + 40 * 3 + 4 * 13);
        cm_proto_header h;
        TST_CHECK(cm_proto_peek(frame, len, &LIM, &h) == CM_OK && h.type == CM_PROTO_TYPE_DECODE &&
                  h.version == CM_PROTO_VERSION && h.id == m.id && h.flags == 0);
        TST_CHECK(dec(frame, len) == CM_OK && same_decode(&m, &g_out));
    }
    /* no layers: the decode tensor alone */
    cm_proto_decode m = make_step(CM_ENCODING_RAW);
    size_t          len;
    m.n_layers = 0, m.layer_ids = NULL;
    TST_CHECK(cm_proto_decode_encode(&m, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(dec(frame, len) == CM_OK && same_decode(&m, &g_out));
    /* CLOSE: no tokens, no layers; the caller's token and layer arrays may be NULL */
    cm_proto_decode_seq cl[2] = {{7, 0, 0, 0, 0, 0.0f, 1.0f, 0, 0}, {9, 19, 0, 0, 0, 0.0f, 1.0f, 0, 0}};
    cm_proto_decode     c = {
            .id = 3, .op = CM_DECODE_CLOSE, .encoding = CM_ENCODING_ZSTD, .n_seqs = 2, .seqs = cl};
    TST_CHECK(cm_proto_decode_encode(&c, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(len == cm_proto_decode_size(2, 0, 0));
    cm_proto_decode_seq got[2];
    cm_proto_decode     o = {.seqs = got, .cap_seqs = 2};
    TST_CHECK(cm_proto_decode_decode(frame, len, &LIM, &o) == CM_OK && same_decode(&c, &o));
    /* the bytes are where the header comment says */
    m = make_step(CM_ENCODING_ZSTD_BYTEPLANE);
    TST_CHECK(cm_proto_decode_encode(&m, frame, sizeof frame, &len) == CM_OK);
    const uint8_t *b = frame + CM_PROTO_HEADER_SIZE, *r1 = b + 20 + 40;
    float          t, p;
    memcpy(&t, r1 + 20, 4), memcpy(&p, r1 + 24, 4);
    TST_CHECK(b[0] == CM_DECODE_STEP && b[4] == CM_ENCODING_ZSTD_BYTEPLANE && b[8] == 3 && b[12] == 11 &&
              b[16] == 2);
    TST_CHECK(r1[0] == 7 && r1[4] == 130 && r1[8] == 1 && r1[12] == 3 && r1[16] == 20 && t == 0.7f &&
              p == 0.95f && r1[32] == 0xef && r1[39] == 0x01);
    TST_CHECK(b[20 + 120] == (uint8_t)(151644 & 0xff) && b[20 + 120 + 44] == 31);
}

/* What a DECODE claims, read ahead of its decode (for a server's bad-request on sizes). */
static void test_counts(void) {
    cm_proto_decode m = make_step(CM_ENCODING_RAW);
    size_t          len;
    uint32_t        N = 0, T = 0, L = 0;
    TST_CHECK(cm_proto_decode_encode(&m, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(cm_proto_decode_counts(frame, len, &N, &T, &L) == CM_OK && N == 3 && T == 11 && L == 2);
    TST_EXPECT_FAIL(cm_proto_decode_counts(frame, CM_PROTO_HEADER_SIZE + 19, &N, &T, &L), CM_ERR_PROTOCOL,
                    "no body fields");
    TST_EXPECT_FAIL(cm_proto_decode_counts(NULL, 0, &N, &T, &L), CM_ERR_PROTOCOL, "no body fields");
}

static void test_corruption(void) {
    cm_proto_decode m = make_step(CM_ENCODING_ZSTD);
    size_t          len;
    TST_CHECK(cm_proto_decode_encode(&m, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("DECODE", dec, frame, len);
}

// ---- bodies with bad fields (valid checksums)

static void b_rec(bld *b, const cm_proto_decode_seq *q) {
    uint32_t t, p;
    memcpy(&t, &q->temperature, 4);
    memcpy(&p, &q->top_p, 4);
    b_u32(b, q->handle), b_u32(b, q->base), b_u32(b, q->n_ctx), b_u32(b, q->n_draft), b_u32(b, q->top_k);
    b_u32(b, t), b_u32(b, p), b_u32(b, q->flags), b_u64(b, q->seed);
}

/* A DECODE frame with the fields as given (N records from q, T tokens, L layers), extra bytes
 * appended (or, negative, cut), sealed. */
static size_t dec_frame(uint32_t op, uint32_t enc, uint32_t N, uint32_t T, uint32_t L,
                        const cm_proto_decode_seq *q, uint32_t n_q, const int32_t *tok, uint32_t n_tok,
                        const int32_t *lay, uint32_t n_lay, int extra) {
    static bld b;
    b.n = 0;
    b_u32(&b, op), b_u32(&b, enc), b_u32(&b, N), b_u32(&b, T), b_u32(&b, L);
    for (uint32_t i = 0; i < n_q; i++)
        b_rec(&b, &q[i]);
    for (uint32_t i = 0; i < n_tok; i++)
        b_u32(&b, (uint32_t)tok[i]);
    for (uint32_t i = 0; i < n_lay; i++)
        b_u32(&b, (uint32_t)lay[i]);
    for (int i = 0; i < extra; i++)
        b_u8(&b, 0);
    if (extra < 0)
        b.n -= (size_t)-extra;
    return seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_DECODE, 0, 0, 5, &b, NULL, 0);
}

/* The good step with record i's fields replaced by q (the frame otherwise unchanged). */
static size_t step_with(uint32_t i, cm_proto_decode_seq q) {
    cm_proto_decode_seq s[3];
    memcpy(s, seqs_in, sizeof s);
    s[i] = q;
    return dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, s, 3, tok_in, 11, lay_in, 2, 0);
}

static void test_fields(void) {
    const cm_proto_decode_seq *q = seqs_in;
    size_t                     n;
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_CHECK(dec(frame, n) == CM_OK); /* the builder's good frame */
    /* op, encoding, counts */
    n = dec_frame(0, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'op' is 0");
    n = dec_frame(3, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'op' is 3");
    n = dec_frame(CM_DECODE_STEP, CM_ENCODING_FP8_ZSTD, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'encoding' is 3 (fp8-zstd)");
    n = dec_frame(CM_DECODE_STEP, CM_ENCODING_NCCL, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'encoding' is 4 (nccl)");
    n = dec_frame(CM_DECODE_STEP, 77, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'encoding' is 77");
    n = dec_frame(CM_DECODE_STEP, 0, 0, 11, 2, q, 0, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'n_seqs' is 0");
    n = dec_frame(CM_DECODE_STEP, 0, LIM.max_seqs + 1, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'n_seqs' is 131073");
    n = dec_frame(CM_DECODE_STEP, 0, 3, LIM.max_tokens + 1, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'n_tokens' is 131073");
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, LIM.max_layers + 1, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'n_layers' is 65");
    n = dec_frame(CM_DECODE_STEP, 0, 0xffffffffu, 0xffffffffu, 0xffffffffu, q, 3, tok_in, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "n_seqs");
    /* the body's size */
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 1);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "body has 193 bytes");
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, -4);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "need 192");
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 1, 0); /* a layer id short */
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "body has");
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 0, NULL, 0, NULL, 0, 0); /* the counts alone */
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "body has 20 bytes");
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 0, NULL, 0, NULL, 0, -3);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "truncated in field 'n_layers'");
    /* records */
    cm_proto_decode_seq r = q[1];
    r.flags = 0x6;
    TST_EXPECT_FAIL(dec(frame, step_with(1, r)), CM_ERR_PROTOCOL,
                    "seqs[1]: unknown bits 0x6 in field 'flags'");
    const float bad_t[] = {-1.0f, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        r = q[2], r.temperature = bad_t[i];
        TST_EXPECT_FAIL(dec(frame, step_with(2, r)), CM_ERR_PROTOCOL, "seqs[2]: field 'temperature'");
    }
    const float bad_p[] = {0.0f, -0.5f, 1.0001f, NAN};
    for (int i = 0; i < 4; i++) {
        r = q[0], r.top_p = bad_p[i];
        TST_EXPECT_FAIL(dec(frame, step_with(0, r)), CM_ERR_PROTOCOL, "seqs[0]: field 'top_p'");
    }
    r = q[1], r.n_ctx = 0, r.n_draft = 4; /* the total is unchanged */
    TST_EXPECT_FAIL(dec(frame, step_with(1, r)), CM_ERR_PROTOCOL, "seqs[1]: field 'n_ctx' is 0");
    r = q[0], r.base = 5;
    TST_EXPECT_FAIL(dec(frame, step_with(0, r)), CM_ERR_PROTOCOL,
                    "seqs[0]: a new sequence (handle 0) with field 'base' 5");
    r = q[1], r.n_draft = 2; /* one token fewer than n_tokens says */
    TST_EXPECT_FAIL(dec(frame, step_with(1, r)), CM_ERR_PROTOCOL,
                    "'n_tokens' is 11, but the records' n_ctx + n_draft add up to 10");
    r = q[1], r.n_draft = 0xffffffffu; /* a sum that overflows 32 bits */
    TST_EXPECT_FAIL(dec(frame, step_with(1, r)), CM_ERR_PROTOCOL, "add up to 4294967303");
    /* tokens and layer ids */
    int32_t t2[11], l2[2];
    memcpy(t2, tok_in, sizeof t2);
    t2[9] = -2;
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, t2, 11, lay_in, 2, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "tokens[9] is -2");
    const int32_t bad_l[][2] = {{31, 31}, {-1, 2}, {5, 1024}};
    const char   *want_l[] = {"layer_ids[1] repeats layer 31", "layer_ids[0] is -1", "layer_ids[1] is 1024"};
    for (int i = 0; i < 3; i++) {
        memcpy(l2, bad_l[i], sizeof l2);
        n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, l2, 2, 0);
        TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, want_l[i]);
    }
    /* CLOSE */
    cm_proto_decode_seq c[2] = {{7, 0, 0, 0, 0, 0.0f, 1.0f, 0, 0}, {9, 0, 0, 0, 0, 0.0f, 1.0f, 0, 0}};
    n = dec_frame(CM_DECODE_CLOSE, 0, 2, 0, 0, c, 2, NULL, 0, NULL, 0, 0);
    TST_CHECK(dec(frame, n) == CM_OK && g_out.op == CM_DECODE_CLOSE && g_out.n_seqs == 2);
    n = dec_frame(CM_DECODE_CLOSE, 0, 2, 1, 0, c, 2, tok_in, 1, NULL, 0, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "CLOSE with field 'n_tokens' 1");
    n = dec_frame(CM_DECODE_CLOSE, 0, 2, 0, 1, c, 2, NULL, 0, lay_in, 1, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "'n_layers' 1; both must be 0");
    c[1].handle = 0;
    n = dec_frame(CM_DECODE_CLOSE, 0, 2, 0, 0, c, 2, NULL, 0, NULL, 0, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "seqs[1]: CLOSE of field 'handle' 0");
    c[1].handle = 9, c[1].n_draft = 1;
    n = dec_frame(CM_DECODE_CLOSE, 0, 2, 0, 0, c, 2, NULL, 0, NULL, 0, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "seqs[1]: CLOSE with field 'n_ctx' 0 and 'n_draft' 1");
    c[1].n_draft = 0, c[1].top_p = 0.0f; /* checked on CLOSE too */
    n = dec_frame(CM_DECODE_CLOSE, 0, 2, 0, 0, c, 2, NULL, 0, NULL, 0, 0);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "seqs[1]: field 'top_p'");
    /* the header: RESEND is a REQUEST's flag; another type */
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    frame[8] = 1;
    reseal_header(frame);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "frame DECODE: unknown bits 0x1 in field 'flags'");
    frame[8] = 0, frame[6] = CM_PROTO_TYPE_REQUEST;
    reseal_header(frame);
    TST_EXPECT_FAIL(dec(frame, n), CM_ERR_PROTOCOL, "expected type DECODE, got REQUEST");
    /* limits of the caller's choosing, and capacities */
    cm_proto_limits small = LIM;
    small.max_seqs = 2, small.max_tokens = 10, small.max_layers = 1, small.max_layer_id = 31;
    n = dec_frame(CM_DECODE_STEP, 0, 3, 11, 2, q, 3, tok_in, 11, lay_in, 2, 0);
    g_out = out_decode();
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &small, &g_out), CM_ERR_PROTOCOL,
                    "'n_seqs' is 3, must be in [1, 2]");
    small.max_seqs = 3;
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &small, &g_out), CM_ERR_PROTOCOL,
                    "exceeds the limit of 10");
    small.max_tokens = 11;
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &small, &g_out), CM_ERR_PROTOCOL,
                    "exceeds the limit of 1");
    small.max_layers = 2;
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &small, &g_out), CM_ERR_PROTOCOL,
                    "layer_ids[0] is 31, must be in [0, 31)");
    small.max_layer_id = 32;
    TST_CHECK(cm_proto_decode_decode(frame, n, &small, &g_out) == CM_OK);
    cm_proto_decode o = out_decode();
    o.cap_seqs = 2;
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &LIM, &o), CM_ERR_INVALID_ARG,
                    "caller arrays hold 2 records");
    o = out_decode(), o.cap_tokens = 10;
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &LIM, &o), CM_ERR_INVALID_ARG,
                    "size them from the limits");
    o = out_decode(), o.layer_ids = NULL;
    TST_EXPECT_FAIL(cm_proto_decode_decode(frame, n, &LIM, &o), CM_ERR_INVALID_ARG, "caller arrays");
}

/* The encoder refuses what the decoder would refuse, and a short buffer. */
static void test_encoder(void) {
    size_t          len = 0;
    cm_proto_decode m = make_step(CM_ENCODING_RAW);
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, 100, &len), CM_ERR_INVALID_ARG, "too small");
    TST_CHECK(len == cm_proto_decode_size(3, 11, 2));
    m.op = (cm_decode_op)0;
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "'op'");
    m = make_step(CM_ENCODING_FP8_ZSTD);
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "'encoding'");
    m = make_step(CM_ENCODING_RAW), m.n_seqs = 0;
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "'n_seqs'");
    m = make_step(CM_ENCODING_RAW), m.n_tokens = 12;
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG,
                    "add up to 11");
    m = make_step(CM_ENCODING_RAW), m.tokens = NULL;
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "NULL");
    int32_t dup[2] = {3, 3};
    m = make_step(CM_ENCODING_RAW), m.layer_ids = dup;
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG,
                    "repeats layer 3");
    cm_proto_decode_seq s[3];
    memcpy(s, seqs_in, sizeof s);
    s[2].temperature = NAN;
    m = make_step(CM_ENCODING_RAW), m.seqs = s;
    TST_EXPECT_FAIL(cm_proto_decode_encode(&m, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "temperature");
    cm_proto_decode_seq cl = {0, 0, 0, 0, 0, 0.0f, 1.0f, 0, 0};
    cm_proto_decode     c = {.op = CM_DECODE_CLOSE, .n_seqs = 1, .seqs = &cl};
    TST_EXPECT_FAIL(cm_proto_decode_encode(&c, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "handle' 0");
}

int main(void) {
    test_roundtrip();
    test_counts();
    test_corruption();
    test_fields();
    test_encoder();
    return tst_report();
}
