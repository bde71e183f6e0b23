/* common/base/cm_hash.h — XXH64, the 64-bit xxHash checksum of wire frames, shard records and
 * compressed tensors. Written here from the public algorithm description (xxHash spec,
 * "XXH64 algorithm description"); it returns the same values as the reference library
 * (tested against its published values). One-shot and streaming forms; a state is a
 * caller-owned struct (cm_xxh64_init), no allocation, not shared between threads. */
#ifndef CM_HASH_H
#define CM_HASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* XXH64 of len bytes at data (data may be NULL when len is 0). */
uint64_t cm_xxh64(const void *data, size_t len, uint64_t seed);

typedef struct cm_xxh64_state {
    uint64_t total_len; /* bytes consumed so far */
    uint64_t acc[4];    /* the four lane accumulators */
    uint8_t  buf[32];   /* a partial stripe */
    uint32_t buf_len;   /* bytes in buf, < 32 */
    uint64_t seed;
} cm_xxh64_state;

void     cm_xxh64_init(cm_xxh64_state *s, uint64_t seed);
void     cm_xxh64_update(cm_xxh64_state *s, const void *data, size_t len);
uint64_t cm_xxh64_digest(const cm_xxh64_state *s); /* does not change s; update may continue */

#ifdef __cplusplus
}
#endif
#endif /* CM_HASH_H */
