/* common/base/cm_arena.c — bump allocator. */
#include "cm_arena.h"

#include <stdlib.h>
#include <string.h>

#define ARENA_ALIGN 64

cm_status cm_arena_init(cm_arena *a, size_t cap) {
    memset(a, 0, sizeof *a);
    size_t rounded = (cap + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    if (rounded == 0) rounded = ARENA_ALIGN;
    a->base = aligned_alloc(ARENA_ALIGN, rounded);
    if (!a->base) return CM_FAIL(CM_ERR_NOMEM, "cannot reserve an arena of %zu bytes", cap);
    a->cap = rounded;
    return CM_OK;
}

void cm_arena_release(cm_arena *a) {
    free(a->base);
    memset(a, 0, sizeof *a);
}

void cm_arena_reset(cm_arena *a) { a->used = 0; }

cm_status cm_arena_alloc(cm_arena *a, size_t n, void **out) {
    size_t need = (n + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    if (need < n || need > a->cap - a->used)
        return CM_FAIL(CM_ERR_NOMEM, "arena full: %zu of %zu bytes used, %zu more asked", a->used, a->cap, n);
    *out = a->base + a->used;
    a->used += need;
    if (a->used > a->peak) a->peak = a->used;
    return CM_OK;
}
