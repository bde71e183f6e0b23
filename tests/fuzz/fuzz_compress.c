/* tests/fuzz/fuzz_compress.c — libFuzzer target: an encoded tensor (raw, zstd, zstd-byteplane,
 * fp8-zstd streams of cm_compress.h) through cm_compress_decode_tensor, as the trainer decodes
 * every tensor of an ANSWER or a shard record. Input: byte 0 the encoding (bits 0..1) and the
 * compressor (bit 7: two worker threads, else one), byte 1 the dtype, bytes 2..5 the shape
 * [rows, row_len] (u16 each), then the stream. The descriptor is checked with
 * cm_proto_tensor_check first, as cm_proto_answer_decode does. A lossless stream that decodes
 * must re-encode and decode to the same bytes. */
#include <string.h>

#include "cm_compress.h"
#include "cm_proto.h"
#include "fuzz_util.h"

#define MAX_RAW (4u << 20) /* the fuzzer's memory budget, far below the wire's 4 GiB */

static const cm_proto_limits LIM = CM_PROTO_LIMITS_DEFAULT;
static cm_compress          *cz1, *cz2;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    cm_log_set_level(CM_LOG_LEVEL_OFF);
    cm_compress_config cfg = CM_COMPRESS_CONFIG_DEFAULT;
    FUZZ_CHECK(cm_compress_create(&cz1, &cfg) == CM_OK);
    cfg.n_threads = 2;
    FUZZ_CHECK(cm_compress_create(&cz2, &cfg) == CM_OK);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 6)
        return 0;
    cm_compress    *c = data[0] & 0x80 ? cz2 : cz1;
    cm_proto_tensor t;
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "layer_1");
    t.encoding = (cm_encoding)(data[0] & 3);
    t.dtype = (cm_dtype)(data[1] % CM_DTYPE_COUNT);
    t.n_dims = 2;
    t.shape[0] = fuzz_rd16(data + 2);
    t.shape[1] = fuzz_rd16(data + 4);
    t.raw_size = (uint64_t)t.shape[0] * (uint64_t)t.shape[1] * cm_dtype_size(t.dtype);
    t.encoded_size = size - 6;
    if (t.raw_size > MAX_RAW || cm_proto_tensor_check(&t, &LIM, CM_ERR_PROTOCOL, NULL, NULL) != CM_OK)
        return 0;
    uint8_t *src = malloc(size - 6 ? size - 6 : 1); /* exact size: ASan sees a read past the stream */
    uint8_t *dst = malloc(t.raw_size ? t.raw_size : 1);
    FUZZ_CHECK(src && dst);
    memcpy(src, data + 6, size - 6);
    t.data = src;
    if (fuzz_note(cm_compress_decode_tensor(c, &t, dst, t.raw_size)) == CM_OK &&
        t.encoding != CM_ENCODING_FP8_ZSTD) {
        size_t   bound = cm_compress_bound(c, t.encoding, t.dtype, t.shape[0], t.shape[1]), len = 0;
        uint8_t *enc = malloc(bound ? bound : 1), *back = malloc(t.raw_size ? t.raw_size : 1);
        FUZZ_CHECK((bound > 0 || t.raw_size == 0) && enc && back);
        FUZZ_CHECK(cm_compress_encode(c, t.encoding, t.dtype, dst, t.shape[0], t.shape[1], enc, bound,
                                      &len) == CM_OK);
        FUZZ_CHECK(cm_compress_decode(c, t.encoding, t.dtype, enc, len, t.shape[0], t.shape[1], back,
                                      t.raw_size) == CM_OK);
        FUZZ_CHECK(memcmp(dst, back, t.raw_size) == 0);
        free(enc);
        free(back);
    }
    free(src);
    free(dst);
    return 0;
}
