/* common/base/cm_arena.h — a bump allocator over one host allocation: reserve at start-up,
 * carve named buffers, reset every step. Not thread-safe (one owner). */
#ifndef CM_ARENA_H
#define CM_ARENA_H

#include <stddef.h>

#include "cm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cm_arena {
    unsigned char *base; /* owned; 64-byte aligned */
    size_t         cap;  /* bytes */
    size_t         used; /* bytes */
    size_t         peak; /* bytes, high-water mark since init */
} cm_arena;

cm_status cm_arena_init(cm_arena *a, size_t cap);
void      cm_arena_release(cm_arena *a); /* frees base; safe on a zeroed arena */
void      cm_arena_reset(cm_arena *a);   /* forgets every carve, keeps the memory */
/* Carves n bytes aligned to 64; CM_ERR_NOMEM (with the sizes) when the arena is full. */
cm_status cm_arena_alloc(cm_arena *a, size_t n, void **out);

#ifdef __cplusplus
}
#endif
#endif /* CM_ARENA_H */
