/* common/format/cm_cfg_hash.h — the target identity sent in WELCOME and checked against a trainer's
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

/* The weights fingerprint of a target whose weights are random (`serve --init random --seed
 * N`; cm_weights_id.h fingerprints a checkpoint): the config's hash with a tag and the seed
 * folded in, so a trainer of the real checkpoint refuses it and a trainer told the same random
 * target (`train --target-init random --target-seed N`) accepts it. */
uint64_t cm_target_random_id(uint64_t cfg_hash, uint64_t seed);

/* A target's identity is its weights fingerprint, with the config hash beside it to say what
 * kind of difference a mismatch is. Compares what a peer has with what is wanted (a wanted 0
 * matches anything) and returns 0 when they agree; otherwise 1, with buf (cap bytes) saying
 * how they differ, e.g. "same architecture (config 467b3a3228c0c02c), different weights
 * (fingerprint 1d2c… here, 9a0f… expected)" or "another architecture (config … here, …
 * expected) and other weights (…)". `here` and `expected` name the two sides in the text. */
int cm_target_identity_differs(char *buf, size_t cap, uint64_t have_cfg, uint64_t have_weights, uint64_t want_cfg,
                               uint64_t want_weights, const char *here, const char *expected);

#ifdef __cplusplus
}
#endif
#endif /* CM_CFG_HASH_H */
