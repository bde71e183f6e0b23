/* common/format/cm_shard_idmap.c — batch id → entry position, the shard store's lookup map:
 * open addressing with linear probing, grown by doubling at half full. */
#include "cm_shard_int.h"

#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// batch id → entry position (open addressing, linear probing; vals hold position + 1)

static uint64_t id_hash(uint64_t x) {
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27, x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void cm_shard_idmap_release_(idmap *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

int cm_shard_idmap_get_(const idmap *m, uint64_t key, uint64_t *val) {
    if (!m->cap)
        return 0;
    for (uint64_t i = id_hash(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (!m->vals[i])
            return 0;
        if (m->keys[i] == key) {
            if (val)
                *val = m->vals[i] - 1;
            return 1;
        }
    }
}

static void idmap_place(idmap *m, uint64_t key, uint64_t val1) {
    uint64_t i = id_hash(key) & (m->cap - 1);
    while (m->vals[i])
        i = (i + 1) & (m->cap - 1);
    m->keys[i] = key, m->vals[i] = val1;
    m->n++;
}

/* Inserts key → val: 1 if inserted, 0 if the key was present (nothing changed). */
cm_status cm_shard_idmap_put_(idmap *m, uint64_t key, uint64_t val, int *inserted) {
    *inserted = 0;
    if (cm_shard_idmap_get_(m, key, NULL))
        return CM_OK;
    if ((m->n + 1) * 2 > m->cap) {
        idmap    old = *m;
        uint64_t cap = old.cap ? old.cap * 2 : 64;
        m->keys = calloc(cap, sizeof *m->keys);
        m->vals = calloc(cap, sizeof *m->vals);
        if (!m->keys || !m->vals) {
            free(m->keys), free(m->vals);
            *m = old;
            return CM_FAIL(CM_ERR_NOMEM, "cannot grow the batch id map to %llu slots",
                           (unsigned long long)cap);
        }
        m->cap = cap, m->n = 0;
        for (uint64_t i = 0; i < old.cap; i++)
            if (old.vals[i])
                idmap_place(m, old.keys[i], old.vals[i]);
        cm_shard_idmap_release_(&old);
    }
    idmap_place(m, key, val + 1);
    *inserted = 1;
    return CM_OK;
}
