/* common/base/cm_bytes.h — little-endian loads and stores of fixed-width integers and
 * floats at any byte address, the one byte order of every Tandem file and wire format.
 * Unaligned-safe (memcpy, which compilers turn into one load or store), and the same
 * bytes on every host: a big-endian host swaps. f32 moves the IEEE-754 bits unchanged. */
#ifndef CM_BYTES_H
#define CM_BYTES_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define CM_LE16(x) __builtin_bswap16(x)
#define CM_LE32(x) __builtin_bswap32(x)
#define CM_LE64(x) __builtin_bswap64(x)
#else
#define CM_LE16(x) (x)
#define CM_LE32(x) (x)
#define CM_LE64(x) (x)
#endif

static inline void cm_le_put_u16(void *p, uint16_t v) {
    v = CM_LE16(v);
    memcpy(p, &v, 2);
}
static inline void cm_le_put_u32(void *p, uint32_t v) {
    v = CM_LE32(v);
    memcpy(p, &v, 4);
}
static inline void cm_le_put_u64(void *p, uint64_t v) {
    v = CM_LE64(v);
    memcpy(p, &v, 8);
}
static inline void cm_le_put_f32(void *p, float f) {
    uint32_t v;
    memcpy(&v, &f, 4);
    cm_le_put_u32(p, v);
}

static inline uint16_t cm_le_get_u16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return CM_LE16(v);
}
static inline uint32_t cm_le_get_u32(const void *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return CM_LE32(v);
}
static inline uint64_t cm_le_get_u64(const void *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return CM_LE64(v);
}
static inline float cm_le_get_f32(const void *p) {
    uint32_t v = cm_le_get_u32(p);
    float    f;
    memcpy(&f, &v, 4);
    return f;
}

#ifdef __cplusplus
}
#endif
#endif /* CM_BYTES_H */
