/* tests/test_cm_proto.c — the wire format: XXH64 against the reference library's values, a
 * round trip of every message type, and every corruption the decoders must refuse (a flipped
 * bit anywhere, truncation at every length, wrong magic/version/type/flags, lengths and counts
 * beyond the limits, shape overflow, duplicate names, inconsistent sizes). Malformed bodies are
 * built by hand here and sealed with valid checksums, so each test reaches the field check it
 * aims at; the message must name that field. */
#include <stdint.h>
#include <string.h>

#include "cm_hash.h"
#include "cm_proto.h"
#include "tst.h"
#include "tst_proto.h"

static const cm_proto_limits LIM = CM_PROTO_LIMITS_DEFAULT;

/* The decoder must fail with st and a message containing want (NULL: any). */
#define EXPECT_FAIL TST_EXPECT_FAIL /* tst.h */

// ---- xxh64

static void test_hash(void) {
    /* computed with the reference xxHash library (libxxhash 0.8.1) over bytes (31·i + 7) mod 256 */
    static const struct {
        size_t   n;
        uint64_t seed, want;
    } v[] = {
        {1, 0x0000000000000000ull, 0xa96c7f0ce858bbb7ull},
        {1, 0x9e3779b185ebca87ull, 0x0c810166b30122a5ull},
        {3, 0x0000000000000000ull, 0x56e6957632a487f9ull},
        {4, 0x9e3779b185ebca87ull, 0xb000bcf3f8bcaefeull},
        {7, 0x0000000000000000ull, 0xafbefc3d6c6f9a8eull},
        {8, 0x0000000000000000ull, 0x3da5c7aa269683e0ull},
        {15, 0x9e3779b185ebca87ull, 0x3eb4d31a7b8359caull},
        {16, 0x0000000000000000ull, 0xa19ad429b02bc413ull},
        {31, 0x0000000000000000ull, 0x4a74f3a1a39ad4a1ull},
        {32, 0x0000000000000000ull, 0x8d57d6a4671cc43dull},
        {32, 0x9e3779b185ebca87ull, 0xf113d2457128cf6dull},
        {33, 0x0000000000000000ull, 0x62c9fd21ed857664ull},
        {63, 0x9e3779b185ebca87ull, 0x355cc1872a486c6eull},
        {64, 0x0000000000000000ull, 0x7bbabbc45729d17eull},
        {65, 0x9e3779b185ebca87ull, 0xe6f9eb9a843fa660ull},
        {100, 0x0000000000000000ull, 0xefa0ad2d3e70c151ull},
        {1000, 0x0000000000000000ull, 0x99594f4828043d35ull},
        {1000, 0x9e3779b185ebca87ull, 0xd79c60b94f81cbf0ull},
        {1999, 0x0000000000000000ull, 0x24ad919a9cbbdd23ull},
        {1999, 0x9e3779b185ebca87ull, 0x0c42c85d07876c8aull},
    };
    uint8_t buf[2000];
    for (int i = 0; i < 2000; i++)
        buf[i] = (uint8_t)(31 * i + 7);
    TST_CHECK(cm_xxh64(NULL, 0, 0) == 0xef46db3751d8e999ull);
    TST_CHECK(cm_xxh64("a", 1, 0) == 0xd24ec4f1a98c6e5bull);
    TST_CHECK(cm_xxh64("abc", 3, 0) == 0x44bc2cf5ad770999ull);
    TST_CHECK(cm_xxh64("abc", 3, 1) == 0xbea9ca8199328908ull);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        TST_CHECK(cm_xxh64(buf, v[i].n, v[i].seed) == v[i].want);
        TST_CHECK(cm_xxh64(buf + 1, v[i].n, v[i].seed) ==
                  cm_xxh64(buf + 1, v[i].n, v[i].seed)); /* unaligned */
        /* streaming in uneven pieces gives the same value */
        for (size_t step = 1; step < 70; step += 13) {
            cm_xxh64_state s;
            cm_xxh64_init(&s, v[i].seed);
            for (size_t off = 0; off < v[i].n; off += step)
                cm_xxh64_update(&s, buf + off, off + step <= v[i].n ? step : v[i].n - off);
            TST_CHECK(cm_xxh64_digest(&s) == v[i].want);
        }
    }
}

// ---- round trips

static uint8_t frame[1 << 20];
static uint8_t frame2[1 << 20];

static void test_small_roundtrips(void) {
    size_t         len;
    cm_proto_hello hi = {0x1234567890abcdefull, 0x0fedcba987654321ull, 8, (1u << CM_ENCODING_ZSTD_BYTEPLANE) | 1u, "trainer-0.a_b"},
                   hi2;
    TST_CHECK(cm_proto_hello_encode(&hi, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(len == CM_PROTO_HEADER_SIZE + 26 + strlen(hi.name) && len <= CM_PROTO_SMALL_FRAME_MAX);
    memset(&hi2, 0, sizeof hi2);
    TST_CHECK(cm_proto_hello_decode(frame, len, &LIM, &hi2) == CM_OK);
    TST_CHECK(hi2.target_id == hi.target_id && hi2.weights_id == hi.weights_id && hi2.credits == 8 && hi2.encodings == hi.encodings &&
              strcmp(hi2.name, hi.name) == 0);
    cm_proto_header h;
    TST_CHECK(cm_proto_peek(frame, len, &LIM, &h) == CM_OK && h.type == CM_PROTO_TYPE_HELLO &&
              h.version == CM_PROTO_VERSION && CM_PROTO_VERSION == 3);

    cm_proto_welcome
        we = {0xfeedull,    0xbeefull, 0, CM_DTYPE_BF16, 5120, 64, 16384, 4, 1u << CM_ENCODING_ZSTD_BYTEPLANE,
              "qwen3.6-27b"},
        we2;
    TST_CHECK(cm_proto_welcome_encode(&we, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(cm_proto_welcome_decode(frame, len, &LIM, &we2) == CM_OK);
    TST_CHECK(we2.target_id == 0xfeedull && we2.weights_id == 0xbeefull && we2.version == CM_PROTO_VERSION &&
              we2.hidden_dtype == CM_DTYPE_BF16 && we2.hidden_size == 5120 && we2.n_layers == 64 &&
              we2.max_tokens == 16384 && we2.credits == 4 && we2.encodings == we.encodings &&
              strcmp(we2.name, "qwen3.6-27b") == 0);

    cm_proto_error er = {77, CM_PROTO_ERROR_BAD_REQUEST,
                         "layer 70 is out of range; the target has layers 0..63"},
                   er2;
    TST_CHECK(cm_proto_error_encode(&er, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(cm_proto_error_decode(frame, len, &LIM, &er2) == CM_OK);
    TST_CHECK(er2.batch_id == 77 && er2.code == CM_PROTO_ERROR_BAD_REQUEST &&
              strcmp(er2.message, er.message) == 0);
    cm_proto_error empty = {0, CM_PROTO_ERROR_SHUTDOWN, ""};
    TST_CHECK(cm_proto_error_encode(&empty, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(cm_proto_error_decode(frame, len, &LIM, &er2) == CM_OK && er2.message[0] == '\0');

    uint64_t seq = 0;
    TST_CHECK(cm_proto_heartbeat_encode(991, frame, sizeof frame, &len) == CM_OK &&
              len == CM_PROTO_HEADER_SIZE);
    TST_CHECK(cm_proto_heartbeat_decode(frame, len, &LIM, &seq) == CM_OK && seq == 991);
    TST_CHECK(cm_proto_bye_encode(frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(cm_proto_bye_decode(frame, len, &LIM) == CM_OK);
    /* a frame of one type is not another */
    EXPECT_FAIL(cm_proto_hello_decode(frame, len, &LIM, &hi2), CM_ERR_PROTOCOL,
                "expected type HELLO, got BYE");

    /* NCCL_OFFER / NCCL_READY */
    cm_proto_nccl no = {.device = 1, .uid_len = CM_PROTO_NCCL_UID_MAX}, no2;
    for (int i = 0; i < CM_PROTO_NCCL_UID_MAX; i++)
        no.uid[i] = (uint8_t)(i * 37 + 5);
    TST_CHECK(cm_proto_nccl_offer_encode(&no, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(len == CM_PROTO_HEADER_SIZE + 8 + CM_PROTO_NCCL_UID_MAX && len <= CM_PROTO_SMALL_FRAME_MAX);
    TST_CHECK(cm_proto_nccl_offer_decode(frame, len, &LIM, &no2) == CM_OK);
    TST_CHECK(no2.device == 1 && no2.uid_len == no.uid_len && memcmp(no2.uid, no.uid, no.uid_len) == 0);
    EXPECT_FAIL(cm_proto_nccl_offer_decode(frame, len - 1, &LIM, &no2), CM_ERR_PROTOCOL, "truncated");
    frame[CM_PROTO_HEADER_SIZE + 20] ^= 1; /* a flipped uid byte fails the body checksum */
    EXPECT_FAIL(cm_proto_nccl_offer_decode(frame, len, &LIM, &no2), CM_ERR_PROTOCOL, "body checksum");
    cm_proto_nccl bad = {.device = 0, .uid_len = 0};
    EXPECT_FAIL(cm_proto_nccl_offer_encode(&bad, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "uid_len 0");
    bad.uid_len = CM_PROTO_NCCL_UID_MAX + 1;
    EXPECT_FAIL(cm_proto_nccl_offer_encode(&bad, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "uid_len 129");
    uint32_t dev = 0;
    TST_CHECK(cm_proto_nccl_ready_encode(7, frame, sizeof frame, &len) == CM_OK &&
              len == CM_PROTO_HEADER_SIZE + 4);
    TST_CHECK(cm_proto_nccl_ready_decode(frame, len, &LIM, &dev) == CM_OK && dev == 7);
    EXPECT_FAIL(cm_proto_nccl_offer_decode(frame, len, &LIM, &no2), CM_ERR_PROTOCOL,
                "expected type NCCL_OFFER, got NCCL_READY");
    /* an nccl tensor carries no bytes in DATA */
    cm_proto_tensor nt = {.name = "layer_3", .dtype = CM_DTYPE_BF16, .encoding = CM_ENCODING_NCCL,
                          .n_dims = 2, .shape = {5, 8}, .raw_size = 80, .encoded_size = 0};
    TST_CHECK(cm_proto_tensor_check(&nt, &LIM, CM_ERR_PROTOCOL, NULL, NULL) == CM_OK);
    cm_proto_answer na = {.batch_id = 9, .n_tensors = 1, .tensors = &nt, .cap_tensors = 1};
    TST_CHECK(cm_proto_answer_encode(&na, frame, sizeof frame, &len) == CM_OK);
    cm_proto_tensor nt2;
    cm_proto_answer na2 = {.tensors = &nt2, .cap_tensors = 1};
    TST_CHECK(cm_proto_answer_decode(frame, len, &LIM, &na2) == CM_OK && na2.n_tensors == 1 &&
              nt2.encoding == CM_ENCODING_NCCL && nt2.raw_size == 80 && nt2.encoded_size == 0);
    nt.encoded_size = 4;
    EXPECT_FAIL(cm_proto_tensor_check(&nt, &LIM, CM_ERR_PROTOCOL, NULL, NULL), CM_ERR_PROTOCOL,
                "must be 0");
    TST_CHECK(strcmp(cm_encoding_name(CM_ENCODING_NCCL), "nccl") == 0);

    /* STATUS: an empty request, a JSON reply */
    char   js[64];
    size_t jn = 99;
    TST_CHECK(cm_proto_status_encode(NULL, 0, frame, sizeof frame, &len) == CM_OK && len == CM_PROTO_HEADER_SIZE);
    TST_CHECK(cm_proto_status_decode(frame, len, &LIM, js, sizeof js, &jn) == CM_OK && jn == 0);
    const char *j = "{\"name\":\"t\",\"answers\":3}";
    TST_CHECK(cm_proto_status_encode(j, strlen(j), frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(cm_proto_status_decode(frame, len, &LIM, js, sizeof js, &jn) == CM_OK && jn == strlen(j) &&
              strcmp(js, j) == 0);
    EXPECT_FAIL(cm_proto_status_decode(frame, len, &LIM, js, 8, &jn), CM_ERR_INVALID_ARG, "do not fit");
    EXPECT_FAIL(cm_proto_status_encode("{\n}", 3, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "control byte");
    /* names */
    TST_CHECK(strcmp(cm_proto_type_name(CM_PROTO_TYPE_STATUS), "STATUS") == 0);
    TST_CHECK(strcmp(cm_proto_type_name(CM_PROTO_TYPE_NCCL_READY), "NCCL_READY") == 0);
    TST_CHECK(strcmp(cm_proto_type_name(CM_PROTO_TYPE_ANSWER), "ANSWER") == 0);
    TST_CHECK(strcmp(cm_proto_type_name(99), "unknown") == 0);
    cm_encoding e;
    TST_CHECK(cm_encoding_parse("fp8-zstd", &e) == CM_OK && e == CM_ENCODING_FP8_ZSTD);
    EXPECT_FAIL(cm_encoding_parse("lz4", &e), CM_ERR_INVALID_ARG, "unknown encoding 'lz4'");
    TST_CHECK(strcmp(cm_proto_error_name(CM_PROTO_ERROR_CORRUPT), "corrupt") == 0);
}

static int32_t tok[4096], cu[64], lay[16];
static int32_t tok2[4096], cu2[64], lay2[16];

static cm_proto_request make_request(void) {
    for (int i = 0; i < 1000; i++)
        tok[i] = (i * 7919) % 248320;
    cu[0] = 0, cu[1] = 1, cu[2] = 400, cu[3] = 1000;
    lay[0] = 1, lay[1] = 16, lay[2] = 31, lay[3] = 46, lay[4] = 61;
    cm_proto_request r = {.batch_id = 0x0102030405060708ull,
                          .flags = CM_PROTO_FLAG_RESEND,
                          .encoding = CM_ENCODING_ZSTD_BYTEPLANE,
                          .n_tokens = 1000,
                          .n_seqs = 3,
                          .n_layers = 5,
                          .tokens = tok,
                          .cu_seqlens = cu,
                          .layer_ids = lay};
    return r;
}

static cm_proto_request out_request(void) {
    cm_proto_request o = {.tokens = tok2,
                          .cu_seqlens = cu2,
                          .layer_ids = lay2,
                          .cap_tokens = 4096,
                          .cap_cu_seqlens = 64,
                          .cap_layers = 16};
    return o;
}

static void test_request_roundtrip(void) {
    cm_proto_request r = make_request(), o = out_request();
    size_t           len;
    TST_CHECK(cm_proto_request_encode(&r, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(len == cm_proto_request_size(1000, 3, 5));
    TST_CHECK(cm_proto_request_decode(frame, len, &LIM, &o) == CM_OK);
    TST_CHECK(o.batch_id == r.batch_id && o.flags == CM_PROTO_FLAG_RESEND && o.encoding == r.encoding &&
              o.n_tokens == 1000 && o.n_seqs == 3 && o.n_layers == 5);
    TST_CHECK(memcmp(tok2, tok, 1000 * 4) == 0 && memcmp(cu2, cu, 4 * 4) == 0 &&
              memcmp(lay2, lay, 5 * 4) == 0);

    /* too small a buffer: INVALID_ARG and the size needed */
    size_t need;
    EXPECT_FAIL(cm_proto_request_encode(&r, frame, 100, &need), CM_ERR_INVALID_ARG, "too small");
    TST_CHECK(need == len);
    /* caller arrays too small for a valid request */
    o.cap_tokens = 999;
    EXPECT_FAIL(cm_proto_request_decode(frame, len, &LIM, &o), CM_ERR_INVALID_ARG, "caller arrays");
    /* the encoder refuses invalid requests */
    r.cu_seqlens[2] = 1;
    EXPECT_FAIL(cm_proto_request_encode(&r, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "cu_seqlens[2]");
    r = make_request();
    r.layer_ids[3] = 16;
    EXPECT_FAIL(cm_proto_request_encode(&r, frame, sizeof frame, &len), CM_ERR_INVALID_ARG,
                "repeats layer 16");
    r = make_request();
    r.n_seqs = 0;
    EXPECT_FAIL(cm_proto_request_encode(&r, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, NULL);
}

static uint8_t         data_a[3000], data_b[17];
static cm_proto_tensor ts[8], ts2[8];

static cm_proto_answer make_answer(void) {
    for (int i = 0; i < 3000; i++)
        data_a[i] = (uint8_t)(i * 13 + 1);
    for (int i = 0; i < 17; i++)
        data_b[i] = (uint8_t)(200 - i);
    memset(ts, 0, sizeof ts);
    strcpy(ts[0].name, "layer_1");
    ts[0].dtype = CM_DTYPE_BF16, ts[0].encoding = CM_ENCODING_ZSTD_BYTEPLANE, ts[0].n_dims = 2;
    ts[0].shape[0] = 1000, ts[0].shape[1] = 64, ts[0].raw_size = 1000 * 64 * 2;
    ts[0].encoded_size = 3000, ts[0].data = data_a;
    strcpy(ts[1].name, "layer_16");
    ts[1].dtype = CM_DTYPE_F32, ts[1].encoding = CM_ENCODING_FP8_ZSTD, ts[1].n_dims = 3;
    ts[1].shape[0] = 2, ts[1].shape[1] = 5, ts[1].shape[2] = 7, ts[1].raw_size = 2 * 5 * 7 * 4;
    ts[1].encoded_size = 17, ts[1].data = data_b;
    strcpy(ts[2].name, "empty.rows");
    ts[2].dtype = CM_DTYPE_F32, ts[2].encoding = CM_ENCODING_RAW, ts[2].n_dims = 2;
    ts[2].shape[0] = 0, ts[2].shape[1] = 64, ts[2].raw_size = 0, ts[2].encoded_size = 0, ts[2].data = NULL;
    strcpy(ts[3].name, "raw-i32");
    ts[3].dtype = CM_DTYPE_I32, ts[3].encoding = CM_ENCODING_RAW, ts[3].n_dims = 1;
    ts[3].shape[0] = 4, ts[3].raw_size = 16, ts[3].encoded_size = 16, ts[3].data = data_a + 100;
    cm_proto_answer a = {.batch_id = 42, .n_tensors = 4, .tensors = ts};
    return a;
}

static void test_answer_roundtrip(void) {
    cm_proto_answer a = make_answer();
    size_t          len, hlen;
    TST_CHECK(cm_proto_answer_encode(&a, frame, sizeof frame, &len) == CM_OK);
    TST_CHECK(len == cm_proto_answer_head_size(&a) + 3000 + 17 + 16);
    TST_CHECK(ts[0].checksum == cm_xxh64(data_a, 3000, 0));
    cm_proto_answer o = {.tensors = ts2, .cap_tensors = 8};
    TST_CHECK(cm_proto_answer_decode(frame, len, &LIM, &o) == CM_OK);
    TST_CHECK(o.batch_id == 42 && o.n_tensors == 4);
    /* an ANSWER of version 2 (as shard stores of version-2 builds hold) reads alike; version 1 does not */
    memcpy(frame2, frame, len);
    frame2[4] = CM_PROTO_ANSWER_MIN_VERSION;
    reseal_header(frame2);
    TST_CHECK(cm_proto_answer_decode(frame2, len, &LIM, &o) == CM_OK && o.n_tensors == 4);
    frame2[4] = CM_PROTO_ANSWER_MIN_VERSION - 1;
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_answer_decode(frame2, len, &LIM, &o), CM_ERR_PROTOCOL, "protocol version 1");
    for (int i = 0; i < 4; i++) {
        TST_CHECK(strcmp(ts2[i].name, ts[i].name) == 0 && ts2[i].dtype == ts[i].dtype &&
                  ts2[i].encoding == ts[i].encoding && ts2[i].n_dims == ts[i].n_dims &&
                  ts2[i].raw_size == ts[i].raw_size && ts2[i].encoded_size == ts[i].encoded_size &&
                  ts2[i].checksum == ts[i].checksum);
        for (int d = 0; d < ts[i].n_dims; d++)
            TST_CHECK(ts2[i].shape[d] == ts[i].shape[d]);
        TST_CHECK(ts[i].encoded_size == 0 || memcmp(ts2[i].data, ts[i].data, ts[i].encoded_size) == 0);
    }
    int64_t rows, row_len;
    TST_CHECK(cm_proto_tensor_check(&ts2[1], &LIM, CM_ERR_FORMAT, &rows, &row_len) == CM_OK && rows == 10 &&
              row_len == 7);
    TST_CHECK(cm_proto_tensor_check(&ts2[2], &LIM, CM_ERR_FORMAT, &rows, &row_len) == CM_OK && rows == 0 &&
              row_len == 64);
    /* head and data in separate parts (zero-copy transport) */
    TST_CHECK(cm_proto_answer_encode_head(&a, frame2, sizeof frame2, &hlen) == CM_OK);
    TST_CHECK(hlen == cm_proto_answer_head_size(&a) && memcmp(frame2, frame, hlen) == 0);
    memset(ts2, 0, sizeof ts2);
    TST_CHECK(cm_proto_answer_decode_parts(frame2, hlen, frame + hlen, len - hlen, &LIM, &o) == CM_OK);
    TST_CHECK(o.n_tensors == 4 && ts2[1].data == frame + hlen + 3000);
    EXPECT_FAIL(cm_proto_answer_decode_parts(frame2, hlen, frame + hlen, len - hlen - 1, &LIM, &o),
                CM_ERR_PROTOCOL, "data_len");
    /* an answer with no tensors */
    cm_proto_answer none = {.batch_id = 5, .n_tensors = 0, .tensors = NULL};
    TST_CHECK(cm_proto_answer_encode(&none, frame2, sizeof frame2, &hlen) == CM_OK &&
              hlen == CM_PROTO_HEADER_SIZE);
    TST_CHECK(cm_proto_answer_decode(frame2, hlen, &LIM, &o) == CM_OK && o.n_tensors == 0 && o.batch_id == 5);
    /* caller array too small */
    o.cap_tensors = 3;
    EXPECT_FAIL(cm_proto_answer_decode(frame, len, &LIM, &o), CM_ERR_INVALID_ARG, "caller array");

    /* the encoder refuses what must never be sent */
    a = make_answer();
    strcpy(ts[1].name, "layer_1");
    EXPECT_FAIL(cm_proto_answer_encode(&a, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "appears twice");
    a = make_answer();
    strcpy(ts[1].name, "layer 16");
    EXPECT_FAIL(cm_proto_answer_encode(&a, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "byte 0x20");
    a = make_answer();
    ts[0].raw_size++;
    EXPECT_FAIL(cm_proto_answer_encode(&a, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "raw_size");
    a = make_answer();
    ts[3].encoded_size = 15;
    EXPECT_FAIL(cm_proto_answer_encode(&a, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "encoded_size");
}

// ---- corruption of valid frames

/* Every single-bit flip and every truncation of a valid frame is refused. */
static cm_proto_hello   g_hello;
static cm_proto_welcome g_welcome;
static cm_proto_error   g_error;
static cm_status        dec_hello(const uint8_t *f, size_t n) {
           return cm_proto_hello_decode(f, n, &LIM, &g_hello);
}
static cm_status dec_welcome(const uint8_t *f, size_t n) {
    return cm_proto_welcome_decode(f, n, &LIM, &g_welcome);
}
static cm_status dec_error(const uint8_t *f, size_t n) {
    return cm_proto_error_decode(f, n, &LIM, &g_error);
}
static cm_status dec_request(const uint8_t *f, size_t n) {
    cm_proto_request o = out_request();
    return cm_proto_request_decode(f, n, &LIM, &o);
}
static cm_status dec_answer(const uint8_t *f, size_t n) {
    cm_proto_answer o = {.tensors = ts2, .cap_tensors = 8};
    return cm_proto_answer_decode(f, n, &LIM, &o);
}
static cm_status dec_heartbeat(const uint8_t *f, size_t n) {
    uint64_t s;
    return cm_proto_heartbeat_decode(f, n, &LIM, &s);
}
static cm_status dec_bye(const uint8_t *f, size_t n) {
    return cm_proto_bye_decode(f, n, &LIM);
}

static void test_corruption(void) {
    size_t         len;
    cm_proto_hello hi = {1, 4, 2, 3, "t"};
    TST_CHECK(cm_proto_hello_encode(&hi, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("HELLO", dec_hello, frame, len);
    cm_proto_welcome we = {9, 10, 0, CM_DTYPE_F32, 64, 6, 4096, 2, 1, "tiny-qwen35"};
    TST_CHECK(cm_proto_welcome_encode(&we, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("WELCOME", dec_welcome, frame, len);
    cm_proto_error er = {3, CM_PROTO_ERROR_CORRUPT, "answer 3 arrived corrupted; sending it again"};
    TST_CHECK(cm_proto_error_encode(&er, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("ERROR", dec_error, frame, len);
    TST_CHECK(cm_proto_heartbeat_encode(5, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("HEARTBEAT", dec_heartbeat, frame, len);
    TST_CHECK(cm_proto_bye_encode(frame, sizeof frame, &len) == CM_OK);
    corrupt_all("BYE", dec_bye, frame, len);
    cm_proto_request r = make_request();
    r.n_tokens = 100, r.n_seqs = 2, cu[2] = 100;
    TST_CHECK(cm_proto_request_encode(&r, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("REQUEST", dec_request, frame, len);
    cm_proto_answer a = make_answer();
    TST_CHECK(cm_proto_answer_encode(&a, frame, sizeof frame, &len) == CM_OK);
    corrupt_all("ANSWER", dec_answer, frame, len);
}

// ---- the header's fields

static void test_header_fields(void) {
    size_t len;
    TST_CHECK(cm_proto_bye_encode(frame, sizeof frame, &len) == CM_OK);
    memcpy(frame2, frame, len);
    tst_put32(frame2, 0x46554747); /* "GGUF" */
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "bad magic");
    memcpy(frame2, frame, len);
    frame2[4] = 1; /* a version-1 peer (before weights fingerprints) */
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "protocol version 1");
    reseal_header(frame2); /* a well-sealed version-1 frame too */
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "protocol version 1");
    memcpy(frame2, frame, len);
    frame2[6] = 99;
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "unknown message type 99");
    memcpy(frame2, frame, len);
    frame2[6] = 0;
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_peek(frame2, len, &LIM, &(cm_proto_header){0}), CM_ERR_PROTOCOL,
                "unknown message type 0");
    memcpy(frame2, frame, len);
    frame2[8] = 0x1; /* RESEND is for requests only */
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "flags");
    memcpy(frame2, frame, len);
    frame2[28] = 1;
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "reserved");
    memcpy(frame2, frame, len);
    frame2[12] = 1; /* n_tensors on a non-answer */
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "n_tensors");
    memcpy(frame2, frame, len);
    frame2[32] = 1; /* data_len on a non-answer */
    reseal_header(frame2);
    EXPECT_FAIL(cm_proto_bye_decode(frame2, len, &LIM), CM_ERR_PROTOCOL, "data_len");
    EXPECT_FAIL(cm_proto_peek(NULL, 0, &LIM, &(cm_proto_header){0}), CM_ERR_PROTOCOL, "truncated");

    /* lengths beyond the limits are refused from the header alone, before any body is read */
    bld body = {.n = 0};
    len = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_REQUEST, 0, 0, 1, &body, NULL, 0);
    tst_put32(frame + 24, LIM.max_body_bytes + 1);
    reseal_header(frame);
    EXPECT_FAIL(cm_proto_peek(frame, len, &LIM, &(cm_proto_header){0}), CM_ERR_PROTOCOL, "body_len");
    tst_put32(frame + 24, 0xffffffffu);
    reseal_header(frame);
    EXPECT_FAIL(dec_request(frame, len), CM_ERR_PROTOCOL, "body_len");
    len = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 0, 1, &body, NULL, 0);
    tst_put64(frame + 32, LIM.max_data_bytes + 1);
    reseal_header(frame);
    EXPECT_FAIL(dec_answer(frame, len), CM_ERR_PROTOCOL, "data_len");
    tst_put64(frame + 32, UINT64_MAX);
    reseal_header(frame);
    EXPECT_FAIL(dec_answer(frame, len), CM_ERR_PROTOCOL, "data_len");
    tst_put64(frame + 32, 0);
    tst_put32(frame + 12, LIM.max_tensors + 1);
    reseal_header(frame);
    EXPECT_FAIL(dec_answer(frame, len), CM_ERR_PROTOCOL, "n_tensors");
    /* a header promising more than is there */
    tst_put32(frame + 12, 0);
    tst_put64(frame + 32, 1000);
    reseal_header(frame);
    EXPECT_FAIL(dec_answer(frame, len), CM_ERR_PROTOCOL, "truncated");
    /* a non-empty heartbeat */
    body.n = 0;
    b_u32(&body, 7);
    len = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HEARTBEAT, 0, 0, 1, &body, NULL, 0);
    EXPECT_FAIL(dec_heartbeat(frame, len), CM_ERR_PROTOCOL, "body_len");
}

// ---- typed bodies with bad fields (valid checksums)

static size_t req_frame(uint32_t enc, uint32_t T, uint32_t N, uint32_t L, const int32_t *t, const int32_t *c,
                        const int32_t *l, int extra) {
    bld b = {.n = 0};
    b_u32(&b, enc);
    b_u32(&b, T);
    b_u32(&b, N);
    b_u32(&b, L);
    for (uint32_t i = 0; t && i < T; i++)
        b_u32(&b, (uint32_t)t[i]);
    for (uint32_t i = 0; c && i <= N; i++)
        b_u32(&b, (uint32_t)c[i]);
    for (uint32_t i = 0; l && i < L; i++)
        b_u32(&b, (uint32_t)l[i]);
    for (int i = 0; i < extra; i++)
        b_u8(&b, 0);
    return seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_REQUEST, 0, 0, 9, &b, NULL, 0);
}

static void test_request_fields(void) {
    int32_t t[16] = {1, 2, 3, 4, 5, 6, 7, 8}, c[16] = {0, 3, 8}, l[16] = {0, 5};
    size_t  n = req_frame(CM_ENCODING_ZSTD, 8, 2, 2, t, c, l, 0);
    TST_CHECK(dec_request(frame, n) == CM_OK);
    n = req_frame(CM_ENCODING_END, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "encoding");
    n = req_frame(1, 0, 1, 1, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_tokens");
    n = req_frame(1, LIM.max_tokens + 1, 2, 2, NULL, NULL, NULL, 0); /* count beyond the limit, no payload */
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_tokens");
    n = req_frame(1, 0xffffffffu, 0xffffffffu, 0xffffffffu, NULL, NULL, NULL, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_tokens");
    n = req_frame(1, 8, 9, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_seqs");
    n = req_frame(1, 8, 0, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_seqs");
    n = req_frame(1, 8, 2, LIM.max_layers + 1, t, c, NULL, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_layers");
    n = req_frame(1, 8, 2, 0, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "n_layers");
    cm_proto_limits small = LIM;
    small.max_tokens = 7;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    cm_proto_request o = out_request();
    EXPECT_FAIL(cm_proto_request_decode(frame, n, &small, &o), CM_ERR_PROTOCOL, "n_tokens");
    small = LIM;
    small.max_seqs = 1;
    EXPECT_FAIL(cm_proto_request_decode(frame, n, &small, &o), CM_ERR_PROTOCOL, "n_seqs");
    /* counts that disagree with the body's size: short (truncated arrays) and long */
    n = req_frame(1, 8, 2, 2, t, c, l, 4);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "body has");
    n = req_frame(1, 8, 2, 2, t, c, NULL, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "body has");
    n = req_frame(1, 8, 2, 2, NULL, NULL, NULL, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "body has");
    bld b = {.n = 0};
    b_u32(&b, 1);
    b_u32(&b, 8); /* body ends inside the counts */
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_REQUEST, 0, 0, 9, &b, NULL, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "truncated in field 'n_seqs'");
    /* array contents */
    t[3] = -1;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "tokens[3]");
    t[3] = 4;
    c[0] = 1;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "cu_seqlens[0]");
    c[0] = 0, c[1] = 0;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "empty or backwards");
    c[1] = 3, c[2] = 7;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "must equal n_tokens");
    c[2] = 8, l[1] = 0;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "repeats layer 0");
    l[1] = (int32_t)LIM.max_layer_id;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "layer_ids[1]");
    l[1] = -3;
    n = req_frame(1, 8, 2, 2, t, c, l, 0);
    EXPECT_FAIL(dec_request(frame, n), CM_ERR_PROTOCOL, "layer_ids[1]");
}

static void test_small_fields(void) {
    bld    b = {.n = 0};
    size_t n;
    /* HELLO */
    b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 0), b_u32(&b, 1), b_str(&b, "x");
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "credits");
    b.n = 0, b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 1), b_u32(&b, 1u << 20), b_str(&b, "x");
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "encodings");
    b.n = 0, b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 1), b_u32(&b, 1), b_str(&b, "");
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "name");
    char long_name[80];
    memset(long_name, 'a', 65), long_name[65] = '\0';
    b.n = 0, b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 1), b_u32(&b, 1), b_str(&b, long_name);
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "name");
    b.n = 0, b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 1), b_u32(&b, 1), b_str(&b, "a\nb");
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "byte 0x0a");
    b.n = 0, b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 1), b_u32(&b, 1), b_u16(&b, 60),
    b_u8(&b, 'a'); /* name runs off the body */
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "truncated in field 'name'");
    b.n = 0, b_u64(&b, 1), b_u64(&b, 0), b_u32(&b, 1), b_u32(&b, 1), b_str(&b, "a"), b_u8(&b, 0);
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_HELLO, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_hello(frame, n), CM_ERR_PROTOCOL, "unexpected bytes");
    /* WELCOME */
    enum { V = CM_PROTO_VERSION };
    struct {
        uint64_t    wid;
        uint16_t    ver;
        uint8_t     dt, rsv;
        uint32_t    d, l, t, cr, enc;
        const char *want;
    } wb[] = {
        {1, V + 1, CM_DTYPE_F32, 0, 64, 6, 8, 1, 1, "version"},
        {1, V, CM_DTYPE_I32, 0, 64, 6, 8, 1, 1, "hidden_dtype"},
        {1, V, CM_DTYPE_F32, 1, 64, 6, 8, 1, 1, "reserved"},
        {1, V, CM_DTYPE_F32, 0, 0, 6, 8, 1, 1, "hidden_size"},
        {1, V, CM_DTYPE_F32, 0, 64, 0, 8, 1, 1, "n_layers"},
        {1, V, CM_DTYPE_F32, 0, 64, 6, 0, 1, 1, "max_tokens"},
        {1, V, CM_DTYPE_F32, 0, 64, 6, 8, 0, 1, "credits"},
        {1, V, CM_DTYPE_F32, 0, 64, 6, 8, 1, 0, "encodings"},
        {0, V, CM_DTYPE_F32, 0, 64, 6, 8, 1, 1, "weights_id"},
    };
    for (size_t i = 0; i < sizeof wb / sizeof wb[0]; i++) {
        b.n = 0;
        b_u64(&b, 1), b_u64(&b, wb[i].wid), b_u16(&b, wb[i].ver), b_u8(&b, wb[i].dt), b_u8(&b, wb[i].rsv), b_u32(&b, wb[i].d);
        b_u32(&b, wb[i].l), b_u32(&b, wb[i].t), b_u32(&b, wb[i].cr), b_u32(&b, wb[i].enc), b_str(&b, "m");
        n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_WELCOME, 0, 0, 0, &b, NULL, 0);
        EXPECT_FAIL(dec_welcome(frame, n), CM_ERR_PROTOCOL, wb[i].want);
    }
    /* ERROR */
    b.n = 0, b_u32(&b, 0), b_u16(&b, 1), b_u8(&b, 'x');
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ERROR, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_error(frame, n), CM_ERR_PROTOCOL, "unknown code 0");
    b.n = 0, b_u32(&b, 1), b_u16(&b, CM_PROTO_MESSAGE_MAX + 1);
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ERROR, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_error(frame, n), CM_ERR_PROTOCOL, "message");
    b.n = 0, b_u32(&b, 1), b_u16(&b, 3), b_u8(&b, 'o'), b_u8(&b, 0), b_u8(&b, 'k');
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ERROR, 0, 0, 0, &b, NULL, 0);
    EXPECT_FAIL(dec_error(frame, n), CM_ERR_PROTOCOL, "control byte");
    /* the encoders refuse what they could not decode */
    size_t         len;
    cm_proto_hello h = {0, 0, 1, 1, "bad name"};
    EXPECT_FAIL(cm_proto_hello_encode(&h, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "name");
    cm_proto_error e = {0, CM_PROTO_ERROR_END, "x"};
    EXPECT_FAIL(cm_proto_error_encode(&e, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "code");
    cm_proto_welcome w = {1, 2, 0, CM_DTYPE_F32, 0, 6, 8, 1, 1, "m"};
    EXPECT_FAIL(cm_proto_welcome_encode(&w, frame, sizeof frame, &len), CM_ERR_INVALID_ARG, "hidden_size");
}

/* One descriptor, written field by field. */
static void b_desc(bld *b, const char *name, uint8_t dt, uint8_t enc, uint8_t nd, uint8_t rsv,
                   const uint64_t *shape, uint64_t raw, uint64_t encsz, uint64_t sum) {
    b_str(b, name);
    b_u8(b, dt), b_u8(b, enc), b_u8(b, nd), b_u8(b, rsv);
    for (int d = 0; d < nd; d++)
        b_u64(b, shape[d]);
    b_u64(b, raw), b_u64(b, encsz), b_u64(b, sum);
}

static void test_answer_fields(void) {
    static uint8_t data[256];
    for (int i = 0; i < 256; i++)
        data[i] = (uint8_t)i;
    uint64_t s2[2] = {4, 8}, sum = cm_xxh64(data, 64, 0);
    bld      b = {.n = 0};
    size_t   n;
    b_desc(&b, "layer_0", CM_DTYPE_BF16, CM_ENCODING_RAW, 2, 0, s2, 64, 64, sum);
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 1, 3, &b, data, 64);
    TST_CHECK(dec_answer(frame, n) == CM_OK);
    struct {
        const char *name;
        uint8_t     dt, enc, nd, rsv;
        uint64_t    shape[5], raw, encsz;
        const char *want;
    } bad[] = {
        {"layer_0", CM_DTYPE_COUNT, 0, 2, 0, {4, 8}, 64, 64, "dtype"},
        {"layer_0", CM_DTYPE_BF16, CM_ENCODING_END, 2, 0, {4, 8}, 64, 64, "encoding"},
        {"layer_0", CM_DTYPE_I32, CM_ENCODING_FP8_ZSTD, 2, 0, {4, 4}, 64, 64, "fp8-zstd needs"},
        {"layer_0", CM_DTYPE_BF16, 0, 0, 0, {0}, 64, 64, "n_dims"},
        {"layer_0", CM_DTYPE_BF16, 0, 5, 0, {1, 1, 4, 8, 1}, 64, 64, "n_dims"},
        {"layer_0", CM_DTYPE_BF16, 0, 2, 7, {4, 8}, 64, 64, "reserved"},
        {"layer_0", CM_DTYPE_BF16, 0, 2, 0, {4, 9}, 64, 64, "raw_size"},
        {"layer_0", CM_DTYPE_BF16, CM_ENCODING_ZSTD, 2, 0, {4, 8}, 64, 63, "account for 63"},
        {"layer_0", CM_DTYPE_BF16, CM_ENCODING_ZSTD, 2, 0, {4, 8}, 64, 65, "encoded_size' 65 runs past"},
        {"layer_0", CM_DTYPE_BF16, 0, 2, 0, {(uint64_t)1 << 63, 2}, 64, 64, "negative"},
        {"layer_0", CM_DTYPE_BF16, 0, 3, 0, {1ull << 32, 1ull << 32, 1ull << 10}, 0, 64, "overflows"},
        {"layer_0", CM_DTYPE_F32, 0, 2, 0, {1ull << 31, 1ull << 31}, 0, 64, "exceed the limit"},
        {"layer_0", CM_DTYPE_F32, 0, 2, 0, {1ull << 30, 4}, 1ull << 34, 64, "exceed the limit"},
        {"layer/0", CM_DTYPE_BF16, 0, 2, 0, {4, 8}, 64, 64, "byte 0x2f"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        b.n = 0;
        b_desc(&b, bad[i].name, bad[i].dt, bad[i].enc, bad[i].nd, bad[i].rsv, bad[i].shape, bad[i].raw,
               bad[i].encsz, sum);
        n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 1, 3, &b, data, 64);
        EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, bad[i].want);
    }
    /* duplicate names */
    uint64_t s1[1] = {16};
    b.n = 0;
    b_desc(&b, "layer_0", CM_DTYPE_U8, CM_ENCODING_RAW, 1, 0, s1, 16, 16, cm_xxh64(data, 16, 0));
    b_desc(&b, "layer_0", CM_DTYPE_U8, CM_ENCODING_RAW, 1, 0, s1, 16, 16, cm_xxh64(data + 16, 16, 0));
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 2, 3, &b, data, 32);
    EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, "repeats the name 'layer_0'");
    /* n_tensors larger than the descriptors present, and smaller */
    b.n = 0;
    b_desc(&b, "a", CM_DTYPE_U8, CM_ENCODING_RAW, 1, 0, s1, 16, 16, cm_xxh64(data, 16, 0));
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 2, 3, &b, data, 16);
    EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, "truncated in field 'tensor name'");
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 0, 3, &b, data, 16);
    EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, "unexpected bytes");
    /* data section longer or shorter than the descriptors say */
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 1, 3, &b, data, 17);
    EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, "account for 16");
    b.n = 0;
    b_desc(&b, "a", CM_DTYPE_U8, CM_ENCODING_ZSTD, 1, 0, s1, 16, 200, 0);
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 1, 3, &b, data, 16);
    EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, "runs past the data");
    /* wrong checksum on otherwise valid data */
    b.n = 0;
    b_desc(&b, "a", CM_DTYPE_U8, CM_ENCODING_RAW, 1, 0, s1, 16, 16, cm_xxh64(data, 16, 1));
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 1, 3, &b, data, 16);
    EXPECT_FAIL(dec_answer(frame, n), CM_ERR_PROTOCOL, "tensor 'a': checksum mismatch");
    /* a limit lower than a tensor */
    cm_proto_limits small = LIM;
    small.max_tensor_bytes = 15;
    b.n = 0;
    b_desc(&b, "a", CM_DTYPE_U8, CM_ENCODING_RAW, 1, 0, s1, 16, 16, cm_xxh64(data, 16, 0));
    n = seal_frame(frame, CM_PROTO_VERSION, CM_PROTO_TYPE_ANSWER, 0, 1, 3, &b, data, 16);
    cm_proto_answer o = {.tensors = ts2, .cap_tensors = 8};
    EXPECT_FAIL(cm_proto_answer_decode(frame, n, &small, &o), CM_ERR_PROTOCOL, "exceed the limit of 15");
}

int main(void) {
    test_hash();
    test_small_roundtrips();
    test_request_roundtrip();
    test_answer_roundtrip();
    test_corruption();
    test_header_fields();
    test_request_fields();
    test_small_fields();
    test_answer_fields();
    return tst_report();
}
