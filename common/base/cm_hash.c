/* common/base/cm_hash.c — XXH64 (public algorithm: four 64-bit lanes over 32-byte stripes,
 * merged, then the tail in 8-, 4- and 1-byte steps, then an avalanche). Reads are
 * little-endian and unaligned-safe (cm_bytes.h), so the value is the same on every host. */
#include "cm_hash.h"

#include <string.h>

#include "cm_bytes.h"

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull
#define P4 0x85EBCA77C2B2AE63ull
#define P5 0x27D4EB2F165667C5ull

static inline uint64_t rotl64(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t round64(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t merge64(uint64_t acc, uint64_t lane) {
    acc ^= round64(0, lane);
    return acc * P1 + P4;
}

static void init_acc(uint64_t acc[4], uint64_t seed) {
    acc[0] = seed + P1 + P2;
    acc[1] = seed + P2;
    acc[2] = seed;
    acc[3] = seed - P1;
}

/* Consumes whole 32-byte stripes; returns the bytes consumed. */
static size_t stripes(uint64_t acc[4], const uint8_t *p, size_t len) {
    size_t n = len & ~(size_t)31;
    for (size_t i = 0; i < n; i += 32) {
        acc[0] = round64(acc[0], cm_le_get_u64(p + i));
        acc[1] = round64(acc[1], cm_le_get_u64(p + i + 8));
        acc[2] = round64(acc[2], cm_le_get_u64(p + i + 16));
        acc[3] = round64(acc[3], cm_le_get_u64(p + i + 24));
    }
    return n;
}

static uint64_t finish(const uint64_t acc[4], int long_input, uint64_t seed, uint64_t total_len,
                       const uint8_t *tail, size_t tail_len) {
    uint64_t h;
    if (long_input) {
        h = rotl64(acc[0], 1) + rotl64(acc[1], 7) + rotl64(acc[2], 12) + rotl64(acc[3], 18);
        for (int i = 0; i < 4; i++)
            h = merge64(h, acc[i]);
    } else {
        h = seed + P5;
    }
    h += total_len;
    size_t i = 0;
    for (; i + 8 <= tail_len; i += 8)
        h = rotl64(h ^ round64(0, cm_le_get_u64(tail + i)), 27) * P1 + P4;
    if (i + 4 <= tail_len) {
        h = rotl64(h ^ ((uint64_t)cm_le_get_u32(tail + i) * P1), 23) * P2 + P3;
        i += 4;
    }
    for (; i < tail_len; i++)
        h = rotl64(h ^ (tail[i] * P5), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

uint64_t cm_xxh64(const void *data, size_t len, uint64_t seed) {
    const uint8_t *p = data;
    uint64_t       acc[4];
    init_acc(acc, seed);
    size_t done = len >= 32 ? stripes(acc, p, len) : 0;
    return finish(acc, len >= 32, seed, len, p + done, len - done);
}

void cm_xxh64_init(cm_xxh64_state *s, uint64_t seed) {
    memset(s, 0, sizeof *s);
    s->seed = seed;
    init_acc(s->acc, seed);
}

void cm_xxh64_update(cm_xxh64_state *s, const void *data, size_t len) {
    const uint8_t *p = data;
    if (len == 0)
        return;
    s->total_len += len;
    if (s->buf_len) {
        size_t take = 32 - s->buf_len < len ? 32 - s->buf_len : len;
        memcpy(s->buf + s->buf_len, p, take);
        s->buf_len += (uint32_t)take;
        p += take;
        len -= take;
        if (s->buf_len < 32)
            return;
        stripes(s->acc, s->buf, 32);
        s->buf_len = 0;
    }
    size_t done = stripes(s->acc, p, len);
    memcpy(s->buf, p + done, len - done);
    s->buf_len = (uint32_t)(len - done);
}

uint64_t cm_xxh64_digest(const cm_xxh64_state *s) {
    return finish(s->acc, s->total_len >= 32, s->seed, s->total_len, s->buf, s->buf_len);
}
