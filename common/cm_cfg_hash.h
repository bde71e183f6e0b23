/* common/cm_cfg_hash.h — the target identity sent in WELCOME and checked against a trainer's
 * HELLO: XXH64 (seed 0) of a canonical text of the config values the frozen forward depends
 * on (family, sizes, layer types, attention and GDN geometry, norms, RoPE, tied embeddings).
 * Two configs that give the same forward give the same hash on every host; weights are not
 * part of it. Pure functions of a cm_target_cfg, no allocation, thread-safe. */
#ifndef CM_CFG_HASH_H
#define CM_CFG_HASH_H

#include <stddef.h>
#include <stdint.h>

#include "cm_cfg.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the canonical text into buf (cap bytes, NUL-terminated when cap > 0) and returns its
 * length, as snprintf does (a return ≥ cap means the text was cut). One "key=value;" per field,
 * in a fixed order; floats with %.9g (float) and %.17g (double), so the text is exact. */
size_t cm_target_cfg_canonical(const cm_target_cfg *cfg, char *buf, size_t cap);

/* XXH64 of the canonical text; never 0 (0 means "any target" in a HELLO, so a hash of 0 is
 * mapped to 1). */
uint64_t cm_target_cfg_hash(const cm_target_cfg *cfg);

/* The identity of a target whose weights are random (`serve --init random --seed N`): the
 * config's hash with a tag and the seed folded in, so a trainer of the real checkpoint refuses
 * it and a trainer told the same random target (`train --target-init random --target-seed N`)
 * accepts it. */
uint64_t cm_target_random_id(uint64_t cfg_hash, uint64_t seed);

#ifdef __cplusplus
}
#endif
#endif /* CM_CFG_HASH_H */
