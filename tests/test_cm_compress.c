/* tests/test_cm_compress.c — the tensor encodings: bit-exact round trips of every lossless mode
 * over random, structured and edge inputs (empty, one element, odd sizes, NaN/Inf and every
 * bf16 bit pattern, sizes that are not a multiple of the chunk), the same output bytes for any
 * number of threads, corrupt or truncated streams refused (never silently wrong), the fp8
 * quantizer bit for bit against cm_dtype's E4M3 and its documented error bound, and the path
 * through a cm_proto ANSWER. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cm_compress.h"
#include "cm_hash.h"
#include "cm_proto.h"
#include "tst.h"

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double uniform(void) {
    return (double)(rnd() >> 11) / 9007199254740992.0;
}
static float gauss(void) {
    return (float)(sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()));
}

/* Hidden-state-like rows: N(0,1) per element, a few outlier channels ×40..×400, row norms that vary. */
static void hidden_like(float *x, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        float rs = 0.5f + 2.0f * (float)uniform();
        for (int64_t j = 0; j < cols; j++) {
            float s = (j % 97 == 5) ? 400.0f : (j % 61 == 3) ? 40.0f : 1.0f;
            x[r * cols + j] = rs * s * gauss();
        }
    }
}

static cm_compress *make_t(int threads, int level, size_t chunk, int rotate, int tune) {
    cm_compress_config cfg = {threads, level, chunk, rotate, tune};
    cm_compress       *c = NULL;
    if (cm_compress_create(&c, &cfg) != CM_OK) {
        fprintf(stderr, "cannot create: %s\n", cm_last_error());
        exit(1);
    }
    return c;
}

static cm_compress *make(int threads, int level, size_t chunk, int rotate) {
    return make_t(threads, level, chunk, rotate, 1);
}

/* Encodes and decodes; returns the encoded size (0 on failure, with a failed check). */
static size_t roundtrip(cm_compress *c, cm_encoding enc, cm_dtype dt, const void *src, int64_t rows,
                        int64_t cols, uint8_t *enc_buf, size_t enc_cap, void *out) {
    size_t bound = cm_compress_bound(c, enc, dt, rows, cols), len = 0,
           raw = (size_t)(rows * cols) * cm_dtype_size(dt);
    TST_CHECK(bound <= enc_cap);
    cm_status st = cm_compress_encode(c, enc, dt, src, rows, cols, enc_buf, enc_cap, &len);
    TST_CHECK(st == CM_OK);
    if (st != CM_OK) {
        fprintf(stderr, "  encode %s %s %lldx%lld: %s\n", cm_encoding_name(enc), cm_dtype_name(dt),
                (long long)rows, (long long)cols, cm_last_error());
        return 0;
    }
    TST_CHECK(len <= bound);
    st = cm_compress_decode(c, enc, dt, enc_buf, len, rows, cols, out, raw);
    TST_CHECK(st == CM_OK);
    if (st != CM_OK) {
        fprintf(stderr, "  decode %s %s %lldx%lld: %s\n", cm_encoding_name(enc), cm_dtype_name(dt),
                (long long)rows, (long long)cols, cm_last_error());
        return 0;
    }
    return len;
}

#define BIG (1 << 22)
static uint8_t src[BIG], out[BIG], enc1[BIG + (1 << 16)], enc2[BIG + (1 << 16)];

static void fill(int kind, uint8_t *p, size_t n_bytes, cm_dtype dt) {
    size_t es = cm_dtype_size(dt), n = n_bytes / es;
    switch (kind) {
    case 0: /* random bytes */
        for (size_t i = 0; i < n_bytes; i++)
            p[i] = (uint8_t)rnd();
        break;
    case 1: /* gaussian floats in the dtype (hidden-state-like), else small ints */
        for (size_t i = 0; i < n; i++) {
            float v = gauss() * ((i % 97 == 5) ? 300.0f : 1.0f);
            if (dt == CM_DTYPE_F32)
                memcpy(p + 4 * i, &v, 4);
            else if (dt == CM_DTYPE_BF16) {
                uint16_t h = cm_f32_to_bf16(v);
                memcpy(p + 2 * i, &h, 2);
            } else if (dt == CM_DTYPE_F16) {
                uint16_t h = cm_f32_to_f16(v);
                memcpy(p + 2 * i, &h, 2);
            } else {
                for (size_t k = 0; k < es; k++)
                    p[i * es + k] = k == 0 ? (uint8_t)(v * 10) : 0;
            }
        }
        break;
    case 2: /* constant */
        memset(p, 0x3f, n_bytes);
        break;
    default: /* every 16-bit pattern in turn (NaN, Inf, -0, subnormals), repeated */
        for (size_t i = 0; i < n_bytes / 2; i++) {
            uint16_t h = (uint16_t)(i * 40503u);
            memcpy(p + 2 * i, &h, 2);
        }
        break;
    }
}

static void test_lossless(void) {
    cm_compress      *c1 = make(1, 1, 4096, 1), *c0 = make_t(1, 3, 4096, 0, 0), *c3 = make(3, 1, 4096, 1);
    const cm_dtype    dts[] = {CM_DTYPE_BF16, CM_DTYPE_F32, CM_DTYPE_F16,
                               CM_DTYPE_I32,  CM_DTYPE_U8,  CM_DTYPE_F64};
    const int64_t     sizes[] = {0, 1, 2, 3, 7, 2047, 2048, 2049, 4095, 12289, 100003};
    const cm_encoding encs[] = {CM_ENCODING_RAW, CM_ENCODING_ZSTD, CM_ENCODING_ZSTD_BYTEPLANE};
    int               n_cases = 0;
    for (size_t e = 0; e < 3; e++)
        for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
                for (int kind = 0; kind < 4; kind++) {
                    cm_dtype dt = dts[d];
                    size_t   nb = (size_t)sizes[s] * cm_dtype_size(dt);
                    if (nb > BIG)
                        continue;
                    fill(kind, src, nb, dt);
                    cm_compress *cs[] = {c1, c0, c3};
                    for (int k = 0; k < 3; k++) {
                        memset(out, 0xA5, nb);
                        /* as rows × cols and as one row: the shape does not matter to lossless modes */
                        int64_t rows = sizes[s] % 7 == 0 && sizes[s] ? 7 : 1;
                        if (!roundtrip(cs[k], encs[e], dt, src, rows, sizes[s] / rows, enc1, sizeof enc1,
                                       out) &&
                            nb)
                            continue;
                        if (memcmp(out, src, nb) != 0) {
                            fprintf(stderr, "  not bit-exact: %s %s n=%lld kind %d ctx %d\n",
                                    cm_encoding_name(encs[e]), cm_dtype_name(dt), (long long)sizes[s], kind,
                                    k);
                            tst_failures++;
                        }
                        n_cases++;
                    }
                }
    fprintf(stderr, "lossless: %d round trips\n", n_cases);
    /* every bf16 pattern once, exactly, in a stream of many chunks */
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        memcpy(src + 2 * i, &h, 2);
    }
    for (int e = 1; e <= 2; e++) {
        size_t len = roundtrip(c1, (cm_encoding)e, CM_DTYPE_BF16, src, 256, 256, enc1, sizeof enc1, out);
        TST_CHECK(len > 0 && memcmp(out, src, 65536 * 2) == 0);
    }
    cm_compress_destroy(&c1);
    cm_compress_destroy(&c0);
    cm_compress_destroy(&c3);
    TST_CHECK(c1 == NULL);
    cm_compress_destroy(&c1); /* NULL-safe */
    cm_compress_destroy(NULL);
}

/* The output bytes do not depend on the number of threads; the byte-plane split helps. */
static void test_determinism(void) {
    static float x[300 * 1000];
    hidden_like(x, 300, 1000);
    uint16_t *bf = (uint16_t *)src;
    for (int i = 0; i < 300 * 1000; i++)
        bf[i] = cm_f32_to_bf16(x[i]);
    const cm_encoding encs[] = {CM_ENCODING_ZSTD, CM_ENCODING_ZSTD_BYTEPLANE, CM_ENCODING_FP8_ZSTD};
    for (int e = 0; e < 3; e++)
        for (int dti = 0; dti < 2; dti++) {
            cm_dtype     dt = dti ? CM_DTYPE_F32 : CM_DTYPE_BF16;
            const void  *in = dti ? (const void *)x : (const void *)bf;
            cm_compress *one = make(1, 1, 16384, 1);
            size_t       len1 = 0, lenn = 0;
            TST_CHECK(cm_compress_encode(one, encs[e], dt, in, 300, 1000, enc1, sizeof enc1, &len1) == CM_OK);
            for (int t = 2; t <= 5; t++) {
                cm_compress *many = make(t, 1, 16384, 1);
                for (int rep = 0; rep < 3; rep++) {
                    TST_CHECK(cm_compress_encode(many, encs[e], dt, in, 300, 1000, enc2, sizeof enc2,
                                                 &lenn) == CM_OK);
                    TST_CHECK(lenn == len1 && memcmp(enc1, enc2, len1) == 0);
                    /* decoding on t threads gives what one thread gives */
                    static uint8_t o1[1200000], o2[1200000];
                    size_t         raw = 300 * 1000 * cm_dtype_size(dt);
                    TST_CHECK(cm_compress_decode(one, encs[e], dt, enc1, len1, 300, 1000, o1, raw) == CM_OK);
                    TST_CHECK(cm_compress_decode(many, encs[e], dt, enc1, len1, 300, 1000, o2, raw) == CM_OK);
                    TST_CHECK(memcmp(o1, o2, raw) == 0);
                    if (encs[e] != CM_ENCODING_FP8_ZSTD)
                        TST_CHECK(memcmp(o1, in, raw) == 0);
                }
                cm_compress_destroy(&many);
            }
            cm_compress_destroy(&one);
        }
    /* the split beats plain zstd on bf16 hidden-state-like data */
    cm_compress *c = make(1, 1, 256 << 10, 1);
    size_t       plain = 0, planes = 0;
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_ZSTD, CM_DTYPE_BF16, bf, 300, 1000, enc1, sizeof enc1,
                                 &plain) == CM_OK);
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, bf, 300, 1000, enc1,
                                 sizeof enc1, &planes) == CM_OK);
    fprintf(stderr, "bf16 hidden-like: zstd %.3fx, zstd-byteplane %.3fx\n", 600000.0 / plain,
            600000.0 / planes);
    TST_CHECK(planes < plain);
    /* switching between tuned (planes) and untuned (plain zstd) parameters keeps each output the same */
    size_t again = 0;
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_ZSTD, CM_DTYPE_BF16, bf, 300, 1000, enc2, sizeof enc2,
                                 &again) == CM_OK);
    TST_CHECK(again == plain);
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, bf, 300, 1000, enc2,
                                 sizeof enc2, &again) == CM_OK);
    TST_CHECK(again == planes && memcmp(enc1, enc2, planes) == 0);
    cm_compress_destroy(&c);
}

/* Every single-bit flip of a stream made only of zstd chunks is refused or decodes to the
 * original (a few header bits are ignored by zstd by design); every truncation is refused.
 * fp8-zstd's scales are plain F32s: a flipped scale is another valid scale, which only the
 * enclosing checksum (ANSWER descriptor, shard record) catches, so flips there are skipped. */
static void test_corruption(void) {
    enum { R = 200, C = 96 };
    cm_compress *c = make(2, 1, 16384, 1);
    static float x[R * C];
    hidden_like(x, R, C);
    uint16_t *bf = (uint16_t *)src;
    for (int i = 0; i < R * C; i++)
        bf[i] = cm_f32_to_bf16(x[i]);
    const cm_encoding encs[] = {CM_ENCODING_ZSTD, CM_ENCODING_ZSTD_BYTEPLANE, CM_ENCODING_FP8_ZSTD};
    static uint8_t    bad[1 << 17], ref[R * C * 2];
    for (int e = 0; e < 3; e++) {
        size_t len = 0, raw = R * C * 2;
        TST_CHECK(cm_compress_encode(c, encs[e], CM_DTYPE_BF16, bf, R, C, enc1, sizeof enc1, &len) == CM_OK);
        TST_CHECK(cm_compress_decode(c, encs[e], CM_DTYPE_BF16, enc1, len, R, C, ref, raw) == CM_OK);
        uint32_t n_chunks = (uint32_t)(enc1[28] | enc1[29] << 8);
        int      stored = 0;
        for (uint32_t i = 0; i < n_chunks; i++)
            stored |= enc1[CM_COMPRESS_HEAD_SIZE + 4 * i + 3] & 0x80;
        TST_CHECK(!stored && n_chunks > 1);
        size_t skip0 = CM_COMPRESS_HEAD_SIZE + 4 * n_chunks;
        size_t skip1 = encs[e] == CM_ENCODING_FP8_ZSTD ? skip0 + 4 * R : skip0;
        int    wrong = 0, refused = 0, same = 0;
        for (size_t i = 0; i < len; i++) {
            if (i >= skip0 && i < skip1)
                continue;
            memcpy(bad, enc1, len);
            bad[i] ^= (uint8_t)(1u << (i % 8));
            memset(out, 0, raw);
            cm_status st = cm_compress_decode(c, encs[e], CM_DTYPE_BF16, bad, len, R, C, out, raw);
            if (st == CM_ERR_PROTOCOL)
                refused++;
            else if (st == CM_OK && memcmp(out, ref, raw) == 0)
                same++;
            else
                wrong++;
        }
        fprintf(stderr, "%s: %zu flips: %d refused, %d harmless, %d wrong\n", cm_encoding_name(encs[e]),
                len - (skip1 - skip0), refused, same, wrong);
        TST_CHECK(wrong == 0 && refused > (int)(len - (skip1 - skip0)) * 9 / 10);
        int missed = 0;
        for (size_t n = 0; n < len; n++)
            if (cm_compress_decode(c, encs[e], CM_DTYPE_BF16, enc1, n, R, C, out, raw) != CM_ERR_PROTOCOL)
                missed++;
        memcpy(bad, enc1, len);
        bad[len] = 0;
        if (cm_compress_decode(c, encs[e], CM_DTYPE_BF16, bad, len + 1, R, C, out, raw) != CM_ERR_PROTOCOL)
            missed++;
        TST_CHECK(missed == 0);
    }
    cm_compress_destroy(&c);
}

#define EXPECT_FAIL TST_EXPECT_FAIL /* tst.h */

/* Each stream field set to a bad value is refused with a message naming it. */
static void test_stream_fields(void) {
    cm_compress *c = make(1, 1, 4096, 1);
    float        x[40 * 64];
    hidden_like(x, 40, 64);
    size_t len = 0, raw = sizeof x;
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, x, 40, 64, enc1, sizeof enc1, &len) ==
              CM_OK);
    TST_CHECK(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, enc1, len, 40, 64, out, raw) ==
              CM_OK);
#define BADFIELD(patch, want)                                                                                \
    do {                                                                                                     \
        memcpy(enc2, enc1, len);                                                                             \
        patch;                                                                                               \
        EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, enc2, len, 40, 64, out, raw),  \
                    CM_ERR_PROTOCOL, want);                                                                  \
    } while (0)
    BADFIELD(enc2[0] ^= 1, "magic");
    BADFIELD(enc2[4] = CM_ENCODING_ZSTD, "encoding");
    BADFIELD(enc2[5] = CM_DTYPE_BF16, "dtype");
    BADFIELD(enc2[6] = 1, "transform");
    BADFIELD(enc2[7] = 1, "reserved");
    BADFIELD(tst_put64(enc2 + 8, 40 * 64 + 1), "n_elems");
    BADFIELD(tst_put64(enc2 + 16, 32), "row_len");
    BADFIELD(tst_put32(enc2 + 24, 0), "chunk_elems");
    BADFIELD(tst_put32(enc2 + 24, 100), "not a multiple of row_len");
    BADFIELD(tst_put32(enc2 + 24, 0x7fffffff), "chunk_elems");
    BADFIELD(tst_put32(enc2 + 28, 99), "n_chunks");
    BADFIELD(tst_put32(enc2 + CM_COMPRESS_HEAD_SIZE, 0x7fffffff), "runs past");
    BADFIELD(enc2[CM_COMPRESS_HEAD_SIZE + 3] |= 0x80, "stored chunk");
    uint32_t n_chunks = (uint32_t)(enc1[28] | enc1[29] << 8);
    size_t   scales = CM_COMPRESS_HEAD_SIZE + 4 * n_chunks;
    float    f = -1.0f;
    BADFIELD(memcpy(enc2 + scales + 4 * 7, &f, 4), "scale of row 7");
    f = NAN;
    BADFIELD(memcpy(enc2 + scales + 4 * 8, &f, 4), "scale of row 8");
    f = 1e30f;
    BADFIELD(memcpy(enc2 + scales, &f, 4), "scale of row 0");
    /* wrong expectations of the caller */
    EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, enc1, len, 40, 64, out, raw - 4),
                CM_ERR_INVALID_ARG, "output buffer");
    EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, enc1, len, 64, 40, out, raw),
                CM_ERR_PROTOCOL, "row_len");
    EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_RAW, CM_DTYPE_F32, enc1, len, 40, 64, out, raw),
                CM_ERR_PROTOCOL, "raw tensor");
    EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_ZSTD, CM_DTYPE_F32, enc1, 10, 40, 64, out, raw),
                CM_ERR_PROTOCOL, "truncated");
    EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_I32, enc1, len, 40, 64, out, raw),
                CM_ERR_INVALID_ARG, "fp8-zstd encodes");
    /* a stored chunk of NaN codes (made by hand) */
    static uint8_t hand[256];
    memset(hand, 0, sizeof hand);
    tst_put32(hand, CM_COMPRESS_MAGIC);
    hand[4] = CM_ENCODING_FP8_ZSTD, hand[5] = CM_DTYPE_F32;
    tst_put64(hand + 8, 8), tst_put64(hand + 16, 4), tst_put32(hand + 24, 8), tst_put32(hand + 28, 1);
    tst_put32(hand + 32, 8 | 0x80000000u);
    float one = 1.0f;
    memcpy(hand + 36, &one, 4), memcpy(hand + 40, &one, 4);
    for (int i = 0; i < 8; i++)
        hand[44 + i] = (uint8_t)(0x38 + i);
    TST_CHECK(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, hand, 52, 2, 4, out, 32) == CM_OK);
    TST_CHECK(((float *)out)[0] == 1.0f && ((float *)out)[7] == 1.875f);
    hand[44 + 5] = 0x7f;
    EXPECT_FAIL(cm_compress_decode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, hand, 52, 2, 4, out, 32),
                CM_ERR_PROTOCOL, "row 1 column 1 is the NaN code");
    /* encoder arguments */
    size_t small = 0;
    EXPECT_FAIL(cm_compress_encode(c, CM_ENCODING_ZSTD, CM_DTYPE_F32, x, 40, 64, enc2, 100, &small),
                CM_ERR_INVALID_ARG, "below the bound");
    EXPECT_FAIL(cm_compress_encode(c, CM_ENCODING_ZSTD, CM_DTYPE_F32, x, -1, 64, enc2, sizeof enc2, &small),
                CM_ERR_INVALID_ARG, "negative");
    EXPECT_FAIL(
        cm_compress_encode(c, CM_ENCODING_ZSTD, CM_DTYPE_F32, x, INT64_MAX, 64, enc2, sizeof enc2, &small),
        CM_ERR_INVALID_ARG, "overflow");
    EXPECT_FAIL(cm_compress_encode(c, CM_ENCODING_END, CM_DTYPE_F32, x, 4, 4, enc2, sizeof enc2, &small),
                CM_ERR_INVALID_ARG, "unknown encoding");
    TST_CHECK(cm_compress_bound(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_I32, 4, 4) == 0);
    cm_compress_destroy(&c);
    /* configs */
    cm_compress_config bads[] = {{0, 1, 4096, 1, 1},     {1, 1000, 4096, 1, 1}, {1, 1, 100, 1, 1},
                                 {1, 1, 1u << 30, 1, 1}, {1, 1, 4096, 2, 1},    {1, 1, 4096, 1, 2}};
    for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
        cm_compress *b = (cm_compress *)1;
        TST_CHECK(cm_compress_create(&b, &bads[i]) == CM_ERR_INVALID_ARG && b == NULL);
    }
}

/* fp8-zstd: with a row's absmax 448 the scale is 1, so each value must be exactly cm_dtype's
 * E4M3 rounding; on hidden-state-like data the documented bound holds. */
static void test_fp8(void) {
    cm_compress *c = make(2, 1, 4096, 1);
    enum { COLS = 1024 };
    static float x[1024 * COLS], y[1024 * COLS];
    int64_t      rows = 0, mism = 0;
    /* row 0: every bf16 value in [-448, 448]; then random floats over the range */
    int64_t k = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        float v = cm_bf16_to_f32((uint16_t)i);
        if (isfinite(v) && fabsf(v) <= 448.0f)
            x[k++] = v;
    }
    for (; k % COLS; k++)
        x[k] = 0.0f;
    for (int r = 0; r < 200; r++, k += COLS)
        for (int j = 0; j < COLS; j++)
            x[k + j] =
                j == 0 ? 448.0f : (float)((uniform() * 2 - 1) * ldexp(1.0, (int)(uniform() * 30) - 21));
    rows = k / COLS;
    for (int64_t r = 0; r < rows; r++)
        x[r * COLS + COLS - 1] = r % 2 ? -448.0f : 448.0f; /* scale = 1 */
    TST_CHECK(roundtrip(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, x, rows, COLS, enc1, sizeof enc1, y) > 0);
    for (int64_t i = 0; i < rows * COLS; i++)
        if (memcmp(&y[i], &(float){cm_f8e4m3_to_f32(cm_f32_to_f8e4m3(x[i]))}, 4) != 0 && mism++ < 5)
            fprintf(stderr, "  fp8 of %.9g: got %.9g, cm_dtype gives %.9g\n", x[i], y[i],
                    cm_f8e4m3_to_f32(cm_f32_to_f8e4m3(x[i])));
    TST_CHECK(mism == 0);

    /* error bound on hidden-state-like rows, from F32 and from BF16 */
    rows = 512;
    hidden_like(x, rows, COLS);
    for (int j = 0; j < COLS; j++)
        x[7 * COLS + j] = 0.0f; /* a zero row */
    for (int j = 0; j < COLS; j++)
        x[8 * COLS + j] = j % 2 ? 1e-37f : 0.0f; /* flushed to zero */
    for (int dti = 0; dti < 3; dti++) {
        cm_dtype        dt = dti == 0 ? CM_DTYPE_F32 : dti == 1 ? CM_DTYPE_BF16 : CM_DTYPE_F16;
        static uint16_t h[1024 * COLS], hy[1024 * COLS];
        static float    xr[1024 * COLS];
        for (int64_t i = 0; i < rows * COLS; i++) {
            if (dt == CM_DTYPE_F32)
                xr[i] = x[i];
            else if (dt == CM_DTYPE_BF16)
                xr[i] = cm_bf16_to_f32(h[i] = cm_f32_to_bf16(x[i]));
            else
                xr[i] = cm_f16_to_f32(h[i] = cm_f32_to_f16(x[i] * 0.01f)); /* keep within f16 range */
        }
        size_t len = roundtrip(c, CM_ENCODING_FP8_ZSTD, dt, dt == CM_DTYPE_F32 ? (void *)xr : (void *)h, rows,
                               COLS, enc1, sizeof enc1, dt == CM_DTYPE_F32 ? (void *)y : (void *)hy);
        double num = 0, den = 0, worst = 0;
        int    bad = 0;
        for (int64_t r = 0; r < rows; r++) {
            float amax = 0;
            for (int j = 0; j < COLS; j++)
                amax = fmaxf(amax, fabsf(xr[r * COLS + j]));
            float scale = amax / 448.0f;
            if (scale < FLT_MIN)
                scale = 0;
            for (int j = 0; j < COLS; j++) {
                int64_t i = r * COLS + j;
                float   yi = dt == CM_DTYPE_F32    ? y[i]
                             : dt == CM_DTYPE_BF16 ? cm_bf16_to_f32(hy[i])
                                                   : cm_f16_to_f32(hy[i]);
                double  err = fabs((double)yi - xr[i]);
                double  out_r = dt == CM_DTYPE_BF16 ? ldexp(1, -8) : dt == CM_DTYPE_F16 ? ldexp(1, -11) : 0;
                double  bound = ldexp(1, -4) * fabs(xr[i]) + ldexp(1, -10) * scale + out_r * fabs(yi) +
                               (dt == CM_DTYPE_F16 ? ldexp(1, -24) : 0);
                if (scale == 0)
                    bound = fabs(xr[i]); /* flushed row */
                if (err > bound * (1 + 1e-6) && bad++ < 5)
                    fprintf(stderr, "  fp8 %s [%lld,%d]: %.9g -> %.9g (err %.3g > bound %.3g)\n",
                            cm_dtype_name(dt), (long long)r, j, xr[i], yi, err, bound);
                num += err * err;
                den += (double)xr[i] * xr[i];
                if (err > worst)
                    worst = err;
            }
        }
        double rel = sqrt(num / den);
        fprintf(stderr, "fp8-zstd from %s: ratio %.2fx, rel L2 %.4f, max abs %.4g\n", cm_dtype_name(dt),
                (double)(rows * COLS * cm_dtype_size(dt)) / (double)len, rel, worst);
        TST_CHECK(bad == 0);
        TST_CHECK(rel < 0.04);
        if (dt == CM_DTYPE_F32) {
            for (int j = 0; j < COLS; j++)
                TST_CHECK(y[7 * COLS + j] == 0.0f && y[8 * COLS + j] == 0.0f);
        }
    }
    /* values fp8 cannot carry */
    size_t len = 0;
    x[3 * COLS + 5] = INFINITY;
    EXPECT_FAIL(
        cm_compress_encode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, x, rows, COLS, enc1, sizeof enc1, &len),
        CM_ERR_INVALID_ARG, "row 3 holds inf at column 5");
    x[3 * COLS + 5] = NAN;
    EXPECT_FAIL(
        cm_compress_encode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, x, rows, COLS, enc1, sizeof enc1, &len),
        CM_ERR_INVALID_ARG, "row 3 holds nan");
    x[3 * COLS + 5] = 1e30f;
    EXPECT_FAIL(
        cm_compress_encode(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, x, rows, COLS, enc1, sizeof enc1, &len),
        CM_ERR_INVALID_ARG, "up to 2^64");
    /* empty tensors and zero-length rows */
    TST_CHECK(roundtrip(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_F32, x, 0, COLS, enc1, sizeof enc1, y) ==
              CM_COMPRESS_HEAD_SIZE);
    TST_CHECK(roundtrip(c, CM_ENCODING_FP8_ZSTD, CM_DTYPE_BF16, x, 5, 0, enc1, sizeof enc1, y) ==
              CM_COMPRESS_HEAD_SIZE);
    cm_compress_destroy(&c);
}

/* The whole path: encode tensors, send them in an ANSWER, decode the frame and the tensors. A
 * flipped byte inside a stored chunk (which no zstd checksum covers) is caught by the frame. */
static void test_through_answer(void) {
    cm_compress *c = make(2, 3, 8192, 1);
    enum { T = 77, D = 96 };
    static float    x[T * D];
    static uint16_t h[T * D], hy[T * D];
    static uint8_t  e_bf[65536], e_rnd[65536], fr[1 << 18];
    hidden_like(x, T, D);
    for (int i = 0; i < T * D; i++)
        h[i] = cm_f32_to_bf16(x[i]);
    size_t         l_bf = 0, l_rnd = 0, flen = 0;
    static uint8_t rb[T * D * 2];
    for (size_t i = 0; i < sizeof rb; i++)
        rb[i] = (uint8_t)rnd(); /* incompressible: stored chunks */
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_ZSTD_BYTEPLANE, CM_DTYPE_BF16, h, T, D, e_bf, sizeof e_bf,
                                 &l_bf) == CM_OK);
    TST_CHECK(cm_compress_encode(c, CM_ENCODING_ZSTD, CM_DTYPE_BF16, rb, T, D, e_rnd, sizeof e_rnd, &l_rnd) ==
              CM_OK);
    TST_CHECK(e_rnd[CM_COMPRESS_HEAD_SIZE + 3] & 0x80); /* stored */
    cm_proto_tensor ts[2] = {
        {"layer_3", CM_DTYPE_BF16, CM_ENCODING_ZSTD_BYTEPLANE, 2, {T, D}, T * D * 2, l_bf, 0, e_bf},
        {"noise", CM_DTYPE_BF16, CM_ENCODING_ZSTD, 2, {T, D}, T * D * 2, l_rnd, 0, e_rnd},
    };
    cm_proto_answer a = {9, 2, ts, 2};
    cm_proto_limits lim = CM_PROTO_LIMITS_DEFAULT;
    TST_CHECK(cm_proto_answer_encode(&a, fr, sizeof fr, &flen) == CM_OK);
    cm_proto_tensor back[4];
    cm_proto_answer o = {.tensors = back, .cap_tensors = 4};
    TST_CHECK(cm_proto_answer_decode(fr, flen, &lim, &o) == CM_OK && o.n_tensors == 2);
    TST_CHECK(cm_compress_decode_tensor(c, &back[0], hy, sizeof hy) == CM_OK && memcmp(hy, h, sizeof h) == 0);
    TST_CHECK(cm_compress_decode_tensor(c, &back[1], hy, sizeof hy) == CM_OK &&
              memcmp(hy, rb, sizeof rb) == 0);
    EXPECT_FAIL(cm_compress_decode_tensor(c, &back[0], hy, sizeof hy - 2), CM_ERR_INVALID_ARG,
                "output buffer");
    /* flip a byte in the middle of the stored chunk of 'noise' */
    size_t off = cm_proto_answer_head_size(&a) + l_bf + CM_COMPRESS_HEAD_SIZE + 4 * 2 + 100;
    fr[off] ^= 0x10;
    EXPECT_FAIL(cm_proto_answer_decode(fr, flen, &lim, &o), CM_ERR_PROTOCOL,
                "tensor 'noise': checksum mismatch");
    cm_compress_destroy(&c);
}

int main(void) {
    test_lossless();
    test_determinism();
    test_corruption();
    test_stream_fields();
    test_fp8();
    test_through_answer();
    return tst_report();
}
