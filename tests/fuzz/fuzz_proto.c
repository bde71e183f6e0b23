/* tests/fuzz/fuzz_proto.c — libFuzzer target: one wire frame through cm_proto_peek and every
 * decoder of cm_proto.h, as target-server and drafter-trainer decode what arrives on their
 * sockets and what a shard record holds (NCCL_OFFER/READY and STATUS included; DECODE has a
 * target of its own, fuzz_decode.c). Input: one flag byte, then the frame; with bit 0 set the
 * frame's checksums are re-sealed first (fuzz_proto_seal), so mutations reach the field checks.
 * For a frame that decodes: encoding the decoded message and decoding that again gives the same
 * message, an ANSWER decodes alike whole and in two parts, and each of its tensors decodes with
 * cm_compress when small enough. */
#include <string.h>

#include "cm_compress.h"
#include "cm_proto.h"
#include "fuzz_util.h"

static const cm_proto_limits LIM = CM_PROTO_LIMITS_DEFAULT;
#define MAX_T 131072 /* = LIM.max_tokens, .max_seqs */
static int32_t         tok[MAX_T], cu[MAX_T + 1], lay[64];
static int32_t         tok2[MAX_T], cu2[MAX_T + 1], lay2[64];
static cm_proto_tensor ten[64], ten2[64];
static cm_compress    *cz;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    cm_compress_config cfg = CM_COMPRESS_CONFIG_DEFAULT;
    FUZZ_CHECK(cm_compress_create(&cz, &cfg) == CM_OK);
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

static void check_request(const cm_proto_request *m) {
    size_t   n = cm_proto_request_size(m->n_tokens, m->n_seqs, m->n_layers), len = 0;
    uint8_t *b = reencode_buf(n);
    FUZZ_CHECK(cm_proto_request_encode(m, b, n, &len) == CM_OK && len == n);
    cm_proto_request r = {.tokens = tok2,
                          .cu_seqlens = cu2,
                          .layer_ids = lay2,
                          .cap_tokens = MAX_T,
                          .cap_cu_seqlens = MAX_T + 1,
                          .cap_layers = 64};
    FUZZ_CHECK(cm_proto_request_decode(b, len, &LIM, &r) == CM_OK);
    FUZZ_CHECK(r.batch_id == m->batch_id && r.flags == m->flags && r.encoding == m->encoding);
    FUZZ_CHECK(r.n_tokens == m->n_tokens && r.n_seqs == m->n_seqs && r.n_layers == m->n_layers);
    FUZZ_CHECK(memcmp(tok2, m->tokens, 4u * r.n_tokens) == 0);
    FUZZ_CHECK(memcmp(cu2, m->cu_seqlens, 4u * (r.n_seqs + 1)) == 0);
    FUZZ_CHECK(memcmp(lay2, m->layer_ids, 4u * r.n_layers) == 0);
    FUZZ_CHECK(cu2[0] == 0 && cu2[r.n_seqs] == (int32_t)r.n_tokens);
    for (uint32_t i = 0; i < r.n_seqs; i++)
        FUZZ_CHECK(cu2[i] < cu2[i + 1]);
}

static void check_answer(cm_proto_answer *m, const uint8_t *frame, size_t len) {
    size_t head = cm_proto_answer_head_size(m), total = head;
    for (uint32_t i = 0; i < m->n_tensors; i++)
        total += m->tensors[i].encoded_size;
    FUZZ_CHECK(total == len);
    // the same frame in two parts, as a cm_chan client receives it
    cm_proto_answer p = {.tensors = ten2, .cap_tensors = 64};
    FUZZ_CHECK(cm_proto_answer_decode_parts(frame, head, frame + head, len - head, &LIM, &p) == CM_OK);
    FUZZ_CHECK(p.n_tensors == m->n_tensors && p.batch_id == m->batch_id);
    // re-encoded from the decoded descriptors
    uint8_t *b = reencode_buf(total);
    size_t   blen = 0;
    FUZZ_CHECK(cm_proto_answer_encode(m, b, total, &blen) == CM_OK && blen == total);
    FUZZ_CHECK(cm_proto_answer_decode(b, blen, &LIM, &p) == CM_OK && p.n_tensors == m->n_tensors);
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        const cm_proto_tensor *a = &m->tensors[i], *c = &p.tensors[i];
        FUZZ_CHECK(strcmp(a->name, c->name) == 0 && a->dtype == c->dtype && a->encoding == c->encoding);
        FUZZ_CHECK(a->n_dims == c->n_dims && a->raw_size == c->raw_size &&
                   a->encoded_size == c->encoded_size);
        FUZZ_CHECK(memcmp(a->shape, c->shape, sizeof(int64_t) * (size_t)a->n_dims) == 0);
        FUZZ_CHECK(a->checksum == c->checksum);
    }
    // the tensors' bytes, as the trainer decodes them (small ones: the fuzzer's budget)
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        const cm_proto_tensor *t = &m->tensors[i];
        if (t->raw_size > (4u << 20))
            continue;
        void *dst = malloc(t->raw_size ? t->raw_size : 1);
        FUZZ_CHECK(dst != NULL);
        cm_compress_decode_tensor(cz, t, dst, t->raw_size);
        free(dst);
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

    cm_proto_header h;
    if (fuzz_note(cm_proto_peek(f, len, &LIM, &h)) == CM_OK) {
        FUZZ_CHECK(h.type >= CM_PROTO_TYPE_HELLO && h.type < CM_PROTO_TYPE_END);
        FUZZ_CHECK(h.body_len <= LIM.max_body_bytes);
    }
    cm_proto_hello hello;
    if (cm_proto_hello_decode(f, len, &LIM, &hello) == CM_OK) {
        uint8_t        b[CM_PROTO_SMALL_FRAME_MAX];
        size_t         n;
        cm_proto_hello again;
        FUZZ_CHECK(cm_proto_hello_encode(&hello, b, sizeof b, &n) == CM_OK);
        FUZZ_CHECK(cm_proto_hello_decode(b, n, &LIM, &again) == CM_OK);
        FUZZ_CHECK(again.target_id == hello.target_id && again.credits == hello.credits &&
                   again.encodings == hello.encodings && strcmp(again.name, hello.name) == 0);
    }
    cm_proto_welcome wel;
    if (cm_proto_welcome_decode(f, len, &LIM, &wel) == CM_OK) {
        uint8_t          b[CM_PROTO_SMALL_FRAME_MAX];
        size_t           n;
        cm_proto_welcome again;
        FUZZ_CHECK(cm_proto_welcome_encode(&wel, b, sizeof b, &n) == CM_OK);
        FUZZ_CHECK(cm_proto_welcome_decode(b, n, &LIM, &again) == CM_OK);
        FUZZ_CHECK(again.target_id == wel.target_id && again.hidden_dtype == wel.hidden_dtype &&
                   again.hidden_size == wel.hidden_size && again.n_layers == wel.n_layers &&
                   again.max_tokens == wel.max_tokens && again.credits == wel.credits &&
                   again.encodings == wel.encodings && strcmp(again.name, wel.name) == 0);
    }
    cm_proto_request req = {.tokens = tok,
                            .cu_seqlens = cu,
                            .layer_ids = lay,
                            .cap_tokens = MAX_T,
                            .cap_cu_seqlens = MAX_T + 1,
                            .cap_layers = 64};
    if (cm_proto_request_decode(f, len, &LIM, &req) == CM_OK)
        check_request(&req);
    cm_proto_error err;
    if (cm_proto_error_decode(f, len, &LIM, &err) == CM_OK) {
        uint8_t        b[CM_PROTO_SMALL_FRAME_MAX];
        size_t         n;
        cm_proto_error again;
        FUZZ_CHECK(cm_proto_error_encode(&err, b, sizeof b, &n) == CM_OK);
        FUZZ_CHECK(cm_proto_error_decode(b, n, &LIM, &again) == CM_OK);
        FUZZ_CHECK(again.batch_id == err.batch_id && again.code == err.code &&
                   strcmp(again.message, err.message) == 0);
    }
    uint64_t seq;
    cm_proto_heartbeat_decode(f, len, &LIM, &seq);
    cm_proto_bye_decode(f, len, &LIM);
    cm_proto_nccl offer;
    if (cm_proto_nccl_offer_decode(f, len, &LIM, &offer) == CM_OK) {
        uint8_t       b[CM_PROTO_SMALL_FRAME_MAX + CM_PROTO_NCCL_UID_MAX];
        size_t        n;
        cm_proto_nccl again;
        FUZZ_CHECK(offer.uid_len >= 1 && offer.uid_len <= CM_PROTO_NCCL_UID_MAX);
        FUZZ_CHECK(cm_proto_nccl_offer_encode(&offer, b, sizeof b, &n) == CM_OK);
        FUZZ_CHECK(cm_proto_nccl_offer_decode(b, n, &LIM, &again) == CM_OK);
        FUZZ_CHECK(again.device == offer.device && again.uid_len == offer.uid_len &&
                   memcmp(again.uid, offer.uid, offer.uid_len) == 0);
    }
    uint32_t device;
    cm_proto_nccl_ready_decode(f, len, &LIM, &device);
    static char status[CM_PROTO_STATUS_MAX + 1];
    size_t      status_len;
    if (cm_proto_status_decode(f, len, &LIM, status, sizeof status, &status_len) == CM_OK)
        FUZZ_CHECK(status_len <= CM_PROTO_STATUS_MAX && (status_len == 0 || status[status_len] == '\0'));
    cm_proto_answer ans = {.tensors = ten, .cap_tensors = 64};
    if (fuzz_note(cm_proto_answer_decode(f, len, &LIM, &ans)) == CM_OK)
        check_answer(&ans, f, len);
    free(f);
    return 0;
}
